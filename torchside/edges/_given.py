"""A first-order backward differentiated again, from what the forward saved.

NOTE [Given residuals]. What a first-order forward saved
for its backward (saved results and residual buffers, ``z``) is a function of the leaves
that has been computed. When torch differentiates that backward (``create_graph``), the
whole VJP (``vjp_function``) would compute it again with the forward. Where flaxside's
``given_vjp`` applies, the backward is instead:

* ``GivenResiduals``: a node whose outputs are ``z`` (aliases of what torch saved, nothing
  computed), made once per eager call (its autograd context) and shared by every
  derivative of it, whose backward is a call of ``transpose`` (the VJP of ``z`` in the
  leaves, the forward's operations taken out);
* a call of ``apply(leaves, z, cotangents)``: the first order's backward body on ``z``.

torch's autograd sums what each ``apply`` sends back into the one node and runs its
backward once. A gradient penalty's second order so runs no forward at all; the route
covers first-order calls that save residuals (``Route.programs is RESIDUALS``), eager,
outside torch.func, with no state written back. Elsewhere, or where ``given_vjp`` says it
would not remove the forward, the whole VJP or the shared linearization run (NOTE [Shared
linearization] in ``_higher.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flaxside.internal import given_vjp
from torchside.edges._derived import derived, executes, owners_of, shared_by

_NOT_YET = object()


class _Bundle(NamedTuple):
    """What ``GivenResiduals`` passes besides the leaves (not a tensor: torch ignores it)."""

    entry: object
    edges: object
    z: tuple


def given_backward(edges, entry, key, leaves: list, z, cots: list, ctx) -> list | None:
    """The gradients ``key`` names (``None``: every one) through the given route, or ``None``.

    ``z``: what the eager call saved after its inputs (saved results, residual buffers);
    ``ctx``: that call's autograd context, which keeps the ``GivenResiduals`` outputs.
    """
    # The node's backward takes every gradient where a subset's parts would not apply.
    parts = _parts(entry, key) if _parts(entry, None) is not None else None
    if parts is None:
        return None
    if z:
        shared = shared_by(ctx)
        outputs = shared.given
        if outputs is None or not alive(outputs):
            # Detached: a saved result torch hands back has this call's node as its
            # grad_fn, which the bundle would keep alive through the node it makes.
            outputs = shared.given = GivenResiduals.apply(
                _Bundle(entry, edges, tuple(t.detach() for t in z)), *leaves)
    else:
        outputs = ()
    apply = derived(edges, entry, "given apply", lambda _: parts[0], key)
    return apply(list(leaves), list(outputs), list(cots))


def alive(outputs) -> bool:
    """Whether the node that made ``outputs`` still has what its backward reads.

    A backward through it without ``retain_graph`` frees that: the next derivative makes
    another. Outputs that need no gradient have no node to free.
    """
    node = outputs[0].grad_fn if outputs else None
    if node is None:
        return True
    try:
        node.saved_tensors  # noqa: B018  (raises once torch freed them)
    except RuntimeError:
        return False
    return True


def _parts(entry, key):
    """``given_vjp(entry.program, key)``, traced once per entry and key (``None`` cached)."""
    owners = owners_of(entry)
    parts = owners.get(("given", key), _NOT_YET)
    if parts is _NOT_YET:
        parts = owners["given", key] = given_vjp(entry.program, key)
    return parts


class GivenResiduals(torch.autograd.Function):
    """``apply(bundle, *leaves) -> z``: what the forward saved, as outputs of the leaves."""

    @staticmethod
    def forward(ctx, bundle: _Bundle, *leaves):
        out = tuple(t.detach() for t in bundle.z)  # aliases: nothing copied, nothing run
        ctx.bundle = bundle
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*leaves, *out)
        return out

    @staticmethod
    def backward(ctx, *cots):
        entry, edges, _ = ctx.bundle
        saved = ctx.saved_tensors
        n = len(saved) - len(cots)
        leaves, z = list(saved[:n]), list(saved[n:])
        nodes = [node for node, _ in ctx.next_functions]
        wanted = tuple(p for p, slot in enumerate(entry.grad_slots) if executes(nodes[slot]))
        out = [None] * n
        if not wanted or all(c is None for c in cots):
            return (None, *out)
        key = None if len(wanted) == len(entry.grad_slots) else wanted
        if _parts(entry, key) is None:  # (the forward's ops stay for these leaves alone)
            key, wanted = None, tuple(range(len(entry.grad_slots)))
        transpose = derived(edges, entry, "given transpose",
                            lambda _: _parts(entry, key)[1], key)
        cots = [torch.zeros_like(t) if c is None else c for c, t in zip(cots, z, strict=True)]
        for p, g in zip(wanted, transpose(leaves, z, cots), strict=True):
            out[entry.grad_slots[p]] = g
        return (None, *out)
