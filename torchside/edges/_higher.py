"""The layer above the first-order pipeline: ``create_graph``, ``torch.func``, forward mode.

NOTE [Higher order]. A first-order backward runs the
entry's backward program on what the forward saved, and hands torch plain gradients. When
torch differentiates that backward again (``create_graph=True``, ``torch.func.grad``),
the backward is instead a call of its own: ``vjp_function(program)``, a JAX function of
every leaf and the cotangents, called through a ``Derived`` owner, a ``jax_function`` of
that program. Its backward is that function's VJP, run the same way, so a third
derivative is a call of the second's, and so on (``Route.order``). Each order compiles its
own programs once per signature, and each recomputes the forward from the leaves (what the
first order saved as residuals is not differentiable with respect to them); calls of one
VJP on the same leaves share that recomputation (NOTE [Shared linearization] below). The VJP
returns only the gradients whose autograd node the running backward executes
(``autograd.grad(out, x)`` executes no weight's): the rest are constants of it, so neither
it nor its own VJP computes them, one owner per such subset.

What a second derivative reads: every leaf of the call. The eager forward keeps, besides
what its first-order backward reads, the leaves it does not (``Holds.kept``: references,
no copies: parameters and arguments alive anyway cost nothing); state the owner
overwrites right after the forward (batch statistics, counters) is read as it is at the
backward, which is refused where a differentiable output depends on it
(``residuals="recompute"`` keeps the forward's copy).

NOTE [torch.func]. torch's function transforms accept only an autograd Function in the
``setup_context`` form, and hand it plain tensors only in ``forward`` and in its ``vmap``
rule; ``backward`` and ``jvp`` see wrapped tensors with no memory JAX could read. So a
call made while a transform is active (``transformed``, reached from ``Caller.__call__``
through the owner's ``Edges``) takes ``TransformedCall`` instead of the eager
``BridgeFunction``, and:

* ``forward`` runs the plain forward program on views of the leaves (no residuals);
* ``backward`` is always the differentiable call of the VJP (above):
  ``torch.func.grad`` runs every backward with ``create_graph``;
* ``jvp`` is the differentiable call of ``jax.jvp`` (forward mode);
* ``vmap`` runs ``jax.vmap`` of the program, torch's ``in_dims`` as ``in_axes``, every
  result batched on dimension 0. torch's ``randomness`` reaches the RNG streams through
  the key torch draws: "different" draws a key per batch entry (the key is batched),
  "same" one key, "error" refuses a call that draws one. State a call writes back
  (batch statistics) cannot be written from a batch of calls and is refused.

The first-order files never import this one: the owner hands its ``Caller`` the
``Edges`` (``_edges.py``), and the pipeline calls up through them.
"""

from __future__ import annotations

import re
import weakref
from typing import NamedTuple

import jax
import torch

import bridge
from flaxside.internal import (
    Batched,
    batched_function,
    jvp_function,
    linearized_vjp,
    vjp_function,
    vjp_work,
)
from torchside import _errors
from torchside.call._call import Caller
from torchside.call._routes import RESIDUALS, TRANSFORMED
from torchside.edges._derived import Derived, derived, executes, owners_of, shared_by
from torchside.edges._given import alive, given_backward


# -- a backward differentiated again (Edges.differentiate) ------------------------------------
def differentiate(ctx, entry, route, saved, cots, given_residuals: bool = True) -> list:
    """The eager backward as a differentiable call of the VJP (NOTE [Higher order]).

    ``ctx``: the eager call's autograd context (``keep`` left the kept leaves there).
    ``given_residuals``: whether the route of NOTE [Given residuals] is taken where it
    applies (``False``: the whole VJP or the shared linearization, for tests of those and
    the benchmark's contestant without sharing; ``torchside.edges._edges.WHOLE_VJPS``).
    """
    where = entry.program.name
    if route.mesh:
        raise _errors.sharded_higher_order(where)
    holds = entry.holding(route)
    if holds.state:
        changed = _overwritten_state_read(entry)
        if changed is not None:
            raise _errors.higher_order_after_write_back(where, changed)
    for i, t, version in zip(holds.kept, ctx.kept, ctx.kept_versions, strict=True):
        if t._version != version:  # as torch's check of what it saved
            raise _errors.modified_for_higher_order(where, entry.layout.names[i])
    leaves = holds.every_leaf(entry.layout, saved, ctx.kept, ctx.state)
    # The leaves' nodes (torch lists an edge per tensor argument: the leaves alone).
    nodes = [node for node, _ in ctx.next_functions]
    # What the forward saved after its inputs (NOTE [Given residuals] in _given.py).
    given = (saved[holds.bounds[0]:] if given_residuals and route.programs is RESIDUALS
             and route.order == 1 and not holds.state and not entry.write_back.targets
             else None)
    return differentiable_backward(ctx.edges, entry, leaves, cots, nodes, ctx, given)


def _overwritten_state_read(entry) -> str | None:
    """The name of a written-back state leaf a differentiable output depends on."""
    out_reads = entry.program.out_reads
    for i in entry.write_back.targets:
        if any(out_reads[k] >> i & 1 for k in entry.diff_out_index):
            return entry.layout.names[i]
    return None


def differentiable_backward(edges, entry, leaves: list, cots: list, nodes=None,
                            ctx=None, given=None) -> list:
    """Per leaf its gradient, as the output of a differentiable call (NOTE above).

    Args:
        edges: the edges of the call (its derived owners get them too).
        entry: the call's entry.
        leaves: every leaf of the call, as torch tensors, in the programs' order.
        cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
        nodes: per leaf, the autograd node its gradient goes to (``None``: no node, or
            not known): a gradient whose node the running backward will not execute
            (``autograd.grad`` of the input alone, as a gradient penalty asks) is
            neither computed nor differentiated later.
        ctx: the autograd context of the eager call whose backward this is: calls with
            one context may share a linearization (NOTE [Shared linearization]).
        given: what that first-order call saved after its inputs, where the backward may
            read it instead of rerunning the forward (NOTE [Given residuals]).
    """
    n = len(entry.layout.names)
    if nodes is not None and len(nodes) != n:
        raise AssertionError(f"{len(nodes)} autograd edges for {n} leaves")
    used = tuple(c is not None for c in cots)
    none = entry.unreached(used) if not all(used) else ()
    wanted = tuple(p for p, slot in enumerate(entry.grad_slots)
                   if p not in none and (nodes is None or executes(nodes[slot])))
    out = [None] * n
    if not wanted:
        return out
    device = entry.exchange.torch_device
    zeros = [torch.zeros(s.shape, dtype=bridge.torch_dtype(s.dtype), device=device)
             for s in (entry.program.out_specs[k] for k in entry.diff_out_index)]
    cots = [z if c is None else c for c, z in zip(cots, zeros, strict=True)]
    key = None if len(wanted) == len(entry.grad_slots) else wanted
    grads = None
    if given is not None and not _outside_eager(leaves):
        grads = given_backward(edges, entry, key, list(leaves), given, cots, ctx)
    if grads is not None:
        for p, g in zip(wanted, grads, strict=True):
            out[entry.grad_slots[p]] = g
        return out
    calls = owners_of(entry).get(("vjp calls", key))
    if calls is None:
        calls = owners_of(entry)["vjp calls", key] = VjpCalls(edges, key)
    for p, g in zip(wanted, calls(entry, list(leaves), cots, ctx), strict=True):
        out[entry.grad_slots[p]] = g
    return out


class VjpCalls:
    """The differentiable calls of one entry's VJP, for one set of wanted gradients.

    NOTE [Shared linearization]. Calls of one VJP that differ only in the cotangents (the
    PINN's Laplacian differentiates its first derivative back through the same call once
    per dimension, and differentiates that call's own backward once per dimension) each
    recompute, from the same leaves, everything that does not depend on the cotangents:
    the forward and its linearization. ``flaxside``'s ``linearized_vjp`` splits the VJP
    there, into ``linearize(leaves) -> residuals`` and ``apply(leaves, residuals,
    cotangents) -> gradients``, two calls of their own, so the residuals are differentiable
    outputs. The derivatives of one eager call (one autograd context) share them: the
    first runs ``linearize``, every later one on the same leaves (the same tensors at the
    same versions and memory) runs ``apply`` alone, and torch's autograd sums what each
    ``apply`` sends back into the one ``linearize`` node and runs its backward once. The
    residuals are kept on that context, so they live exactly as long as the call's node:
    another step's call, even on the same tensors written through ``.data``, shares none.

    A split costs a call more, worth it only where the linearization outweighs the
    dispatch: a call's derivatives are split when the last differentiated call had
    ``SHARE_AFTER`` derivatives or more (a gradient penalty has one) and the VJP's work
    (``vjp_work``) reaches ``SPLIT_MIN_WORK``, and never where a ``custom_vjp`` rule may
    not be linear in its cotangent (``program.linear_vjp``). The first step, calls under
    torch.func (tensors wrapped per level) and ``TransformedCall``'s backward take the
    whole VJP.
    """

    SHARE_AFTER = 2
    # Below this many floating-point operations per VJP call (``vjp_work``) the call more
    # costs more than the linearizations saved: examples/bench/shared_linearization.py
    # (docs/benchmarks.md) puts the crossover between 3.3e6 and 6.7e6 on a 2-core CPU.
    SPLIT_MIN_WORK = 5e6
    # On jax 0.8.1 a PINN's third step fails in a split order-3 call ("compiled for 8
    # inputs but called with 7"): 0.8.1's jax.linearize keeps outputs that do not depend
    # on the cotangents in its static structure, as tracers of our linearize program's
    # trace, which apply's trace then takes as an argument it has no value for
    # (docs/compatibility.md).
    # The split, a speed-up only, runs where it was tested.
    SPLIT_SAFE = tuple(map(int, re.findall(r"\d+", jax.__version__)[:3])) >= (0, 10, 2)

    def __init__(self, edges, key):
        # Not the entry: this is a value of the entry's (``Entry.derived``), no cycle.
        self._edges, self._key = edges, key
        self._whole = self._linearize = self._apply = None
        self._calls = 0  # calls derived from the last differentiated call (context)
        self._split = False  # whether that call's derivatives are split
        self._work = None  # the VJP's floating-point operations (``vjp_work``), once
        self._last = ()  # weak references to the last residuals (for tests)

    def __call__(self, entry, leaves: list, cots: list, ctx) -> list:
        if ctx is None or _outside_eager(leaves):
            return self._whole_vjp(entry)(leaves, cots)  # (a dead transform's tensors)
        kept = shared_by(ctx).linearized  # lives as long as the call's node
        shared = kept.get(self._key)
        if shared is None:  # the first derivative of this call
            self._split = self._calls >= self.SHARE_AFTER and self._worth_it(entry)
            self._calls = 1
            shared = kept[self._key] = [None]
        else:
            self._calls += 1
            computed = shared[0]  # (the leaves' identities, the residuals), set at once
            if (computed is not None and _same(computed[0], leaves)
                    and alive(computed[1])):  # (a backward through them frees them)
                return self._apply(leaves, computed[1], cots)
        if not self._split:
            return self._whole_vjp(entry)(leaves, cots)
        if self._linearize is None:
            self._linearize, self._apply = self._split_vjp(entry)
        identities = _identities(leaves)  # before: a write meanwhile makes it stale
        residuals = self._linearize(leaves)
        shared[0] = (identities, residuals)
        self._last = tuple(weakref.ref(r) for r in residuals)
        return self._apply(leaves, residuals, cots)

    def _worth_it(self, entry) -> bool:
        if self._work is None:  # -1: a custom_vjp rule may not be linear in its cotangent
            self._work = (vjp_work(entry.program, self._key)
                          if entry.program.linear_vjp else -1.0)
        return self.SPLIT_SAFE and 0 <= self._work >= self.SPLIT_MIN_WORK

    def _whole_vjp(self, entry) -> Derived:
        if self._whole is None:
            key = self._key
            self._whole = derived(self._edges, entry, "vjp",
                                  lambda program: vjp_function(program, key), key)
        return self._whole

    def _split_vjp(self, entry) -> tuple[Derived, Derived]:
        key = self._key
        parts = linearized_vjp(entry.program, key)
        return (derived(self._edges, entry, "vjp linearize", lambda _: parts[0], key),
                derived(self._edges, entry, "vjp apply", lambda _: parts[1], key))


def _identities(leaves) -> tuple:
    # The object, its version (in-place writes) and memory (``.data =`` keeps the version).
    return tuple((weakref.ref(t), t._version, t.data_ptr()) for t in leaves)


def _same(identities: tuple, leaves) -> bool:
    if len(identities) != len(leaves):
        return False
    for (ref, version, pointer), t in zip(identities, leaves, strict=True):
        if ref() is not t or t._version != version or t.data_ptr() != pointer:
            return False
    return True


def _outside_eager(leaves) -> bool:
    """Under torch.func, without grad mode, or on a dead transform's tensors."""
    return (torch._C._are_functorch_transforms_active() or not torch.is_grad_enabled()
            or any(map(_wrapped, leaves)))


def _wrapped(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def forward_tangents(edges, entry, leaves: list, tangents: list) -> list:
    """Per differentiable output its tangent, for per-leaf ``tangents`` (``None``: zero)."""
    tangents = [torch.zeros_like(leaves[i]) if tangents[i] is None else tangents[i]
                for i in entry.grad_slots]
    try:
        _, out = derived(edges, entry, "jvp", jvp_function)(list(leaves), tangents)
    except Exception as e:
        if "custom_vjp" in str(e) or "can't apply forward-mode" in str(e):
            raise _errors.no_forward_mode(entry.program.name) from e
        raise
    return out


# -- calls under torch.func (Edges.transformed) ------------------------------------------------
class Bundle(NamedTuple):
    """What a transformed call passes besides its leaves (not a tensor: torch ignores it)."""

    entry: object
    edges: object


def transformed(caller: Caller, call, write_back) -> tuple:
    """``(entry, results)`` of one call under an active transform (NOTE [torch.func]).

    A transform's tangents and cotangents may reach any floating leaf, whatever its
    ``requires_grad`` says (forward mode sets none): every one is differentiable.
    """
    if caller.plan is not None:
        raise _errors.sharded_under_transform(caller.where)
    entry, _, leaves = caller.prepare(call, tuple(map(_floating, call.tensors)),
                                      tuple(map(_floating, call.variables)), TRANSFORMED)
    if (entry.write_back.targets and write_back is not None
            and torch._C._are_functorch_transforms_active()):
        raise _errors.write_back_under_transform(
            caller.where, [entry.layout.names[i] for i in entry.write_back.targets])
    return entry, TransformedCall.apply(Bundle(entry, caller.edges), *leaves)


def _floating(t) -> bool:
    return t.is_floating_point() or t.is_complex()


class TransformedCall(torch.autograd.Function):
    """``apply(bundle, *leaves) -> results``: one call of an entry under torch.func."""

    @staticmethod
    def forward(bundle: Bundle, *leaves):
        entry = bundle.entry
        view = entry.exchange.view
        arrays = [view(t) for t in leaves[entry.layout.state]]
        fwd = entry.forward(arrays, leaves, entry.routes[TRANSFORMED])
        entry.exchange.wait(fwd.pending)
        return tuple(fwd.results)

    @staticmethod
    def setup_context(ctx, inputs, output):
        bundle, *leaves = inputs
        ctx.mark_non_differentiable(*(output[k] for k in bundle.entry.nondiff_out))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*leaves)
        ctx.save_for_forward(*leaves)
        ctx.bundle = bundle

    @staticmethod
    def backward(ctx, *grads):
        entry, edges = ctx.bundle
        cots = [grads[k] for k in entry.diff_out_index]
        nodes = [node for node, _ in ctx.next_functions]  # the leaves' (the only tensors)
        return (None, *differentiable_backward(edges, entry, list(ctx.saved_tensors), cots,
                                               nodes))

    @staticmethod
    def jvp(ctx, _bundle, *tangents):
        entry, edges = ctx.bundle
        out = forward_tangents(edges, entry, list(ctx.saved_tensors), list(tangents))
        results = [None] * entry.n_results
        for k, t in zip(entry.diff_out_index, out, strict=True):
            results[k] = t
        return tuple(results)

    @staticmethod
    def vmap(info, in_dims, bundle, *leaves):
        entry, edges = bundle
        dims = tuple(in_dims[1:])
        if entry.write_back.targets:
            raise _errors.write_back_under_transform(
                entry.program.name, [entry.layout.names[i] for i in entry.write_back.targets])
        owner = derived(edges, entry, f"vmap over {dims}",
                        lambda program: _batched(program, dims))
        results = owner(list(leaves))
        # Each result batched where the batched program computed it (a VJP's gradients of
        # scan-stacked parameters: behind the layer axes), which torch takes as is.
        return tuple(results), tuple(owner.batch_axes)


def _batched(program, dims) -> Batched:
    fn = batched_function(program, dims)
    return Batched(lambda leaves: fn(list(leaves)), fn.batch_axes)
