"""A call's derivatives as calls of their own: ``create_graph`` and ``torch.func``.

NOTE [Higher order] (also in ``flaxside/_higher.py``). A first-order backward runs the
entry's backward program on what the forward saved, and hands torch plain gradients. When
torch differentiates that backward again (``create_graph=True``, ``torch.func.grad``),
the backward is instead a call of its own: ``vjp_function(program)``, a JAX function of
every leaf and the cotangents, through a ``Caller`` exactly like ``jax_function``'s. Its
backward is that function's VJP, run the same way, so a third derivative is a call of the
second's, and so on. Each order compiles its own programs once per signature, and each
recomputes the forward from the leaves (what the first order saved as residuals is not
differentiable with respect to them). The VJP returns only the gradients whose autograd
node the running backward executes (``autograd.grad(out, x)`` executes no weight's): the
rest are constants of it, so neither it nor its own VJP computes them, one caller per
such subset.

What a second derivative reads: every leaf of the call. The forward saves, besides what
its first-order backward reads, the leaves it does not (references, no copies:
parameters and arguments alive anyway cost nothing); state the owner overwrites right
after the forward (batch statistics, counters) is read as it is at the backward, which is
refused where a differentiable output depends on it (``residuals="recompute"`` keeps the
forward's copy).
"""

from __future__ import annotations

import jax
import torch

from flaxside.internal import WriteBack, jvp_function, vjp_function
from torchside import _errors
from torchside._call import Caller, Settings
from torchside._resolve import resolve

_NO_STATE = jax.tree_util.tree_structure(((), None))


class _Apply:
    """A flat JAX function in the owner's apply contract: no state, no updates."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, _mode):
        return self.apply

    def apply(self, _state, *args):
        return self.fn(*args), [], WriteBack()


def derived(entry, kind: str, make, key=None) -> Caller:
    """The entry's caller of one derived function (``kind``: "vjp", "jvp"), made once.

    ``key``: what else the function depends on (the gradients a VJP returns).
    """
    callers = entry.derived
    caller = callers.get((kind, key))
    if caller is None:
        settings = Settings(f"{entry.program.name} ({kind})", _NO_STATE, (),
                            _Apply(make(entry.program)))
        caller = callers[kind, key] = Caller(settings, residuals="save",
                                              recompile_warning=None)
    return caller


def run(caller: Caller, *args):
    """Calls ``caller`` with positional ``args`` (pytrees of tensors), eagerly or transformed.

    Outside a transform, tensors a finished transform left wrapped (``torch.func.vjp``'s
    pull runs after its level ended) are unwrapped first, as torch's ``Function.apply``
    does for its own.
    """
    if not torch._C._are_functorch_transforms_active():
        unwrap = torch._C._functorch.unwrap_if_dead
        args = jax.tree_util.tree_map(
            lambda t: unwrap(t) if isinstance(t, torch.Tensor) else t, args)
    return caller(resolve([], args, {}, mode=None, where=caller.where))


def differentiable_backward(entry, leaves: list, cots: list, nodes=None) -> list:
    """Per leaf its gradient, as the output of a differentiable call (NOTE above).

    Args:
        entry: the call's entry.
        leaves: every leaf of the call, as torch tensors, in the programs' order.
        cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
        nodes: per leaf, the autograd node its gradient goes to (``None``: no node, or
            not known): a gradient whose node the running backward will not execute
            (``autograd.grad`` of the input alone, as a gradient penalty asks) is
            neither computed nor differentiated later.
    """
    if nodes is not None and len(nodes) != len(entry.names):
        raise AssertionError(f"{len(nodes)} autograd edges for {len(entry.names)} leaves")
    used = tuple(c is not None for c in cots)
    none = entry._unreached_by(used) if not all(used) else ()
    wanted = tuple(p for p, slot in enumerate(entry.grad_slots)
                   if p not in none and (nodes is None or _executes(nodes[slot])))
    out = [None] * len(entry.names)
    if not wanted:
        return out
    zeros = [torch.zeros(s.shape, dtype=_torch_dtype(s.dtype), device=entry.device)
             for s in (entry.program.out_specs[k] for k in entry.diff_out_index)]
    cots = [z if c is None else c for c, z in zip(cots, zeros, strict=True)]
    key = None if len(wanted) == len(entry.grad_slots) else wanted
    caller = derived(entry, "vjp", lambda program: vjp_function(program, key), key)
    grads = run(caller, list(leaves), cots)
    for p, g in zip(wanted, grads, strict=True):
        out[entry.grad_slots[p]] = g
    return out


def _executes(node) -> bool:
    """Whether the running backward executes ``node`` (and so reads the gradient sent to it).

    torch refuses the question for a node ``autograd.grad`` captures its result at (one of
    its ``inputs``): that gradient is read.
    """
    if node is None:
        return True
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True


def forward_tangents(entry, leaves: list, tangents: list) -> list:
    """Per differentiable output its tangent, for per-leaf ``tangents`` (``None``: zero)."""
    tangents = [torch.zeros_like(leaves[i]) if tangents[i] is None else tangents[i]
                for i in entry.grad_slots]
    try:
        _, out = run(derived(entry, "jvp", jvp_function), list(leaves), tangents)
    except Exception as e:
        if "custom_vjp" in str(e) or "can't apply forward-mode" in str(e):
            raise _errors.no_forward_mode(entry.program.name) from e
        raise
    return out


def _torch_dtype(dtype):
    import bridge

    return bridge.torch_dtype(dtype)
