"""The eager edge: one call as one autograd node (``BridgeFunction``), and what it saves.

Step 4's eager edge and the backward of NOTE [Call path] (``_call.py``): the forward runs
the entry's programs (``_entry.py``) and saves exactly what its route holds; the backward
runs the backward program, scales the fused route's gradients (NOTE [Scalar loss]), or,
when torch differentiates it again, calls up through the owner's ``Edges``. ``save`` is
shared with the ``torch.compile`` ops (``edges/_compile.py``).
"""

from __future__ import annotations

import operator

import torch

from bridge.internal import HeldArrays
from torchside.call._entry import Entry
from torchside.call._routes import EAGER, FUSED, Holds

# NOTE [Scalar loss]. When the one differentiable output of a call is a real scalar (a loss
# computed inside the block), its VJP is linear in the cotangent (no ``custom_vjp`` rule, no
# float16 value: ``flaxside``'s ``linear_in_cotangent``) and ``residuals="save"``, a
# grad-enabled eager call takes the ``FUSED`` route: ``value_and_grad``, the loss and its
# gradients for a cotangent of one, in the one program JAX compiles for
# ``jit(value_and_grad)``, instead of a forward that writes residuals and a backward that
# reads them. What it holds for backward is the gradient buffers (saved with
# ``ctx.save_for_backward``, so saved-tensor hooks and ``memory_report`` see them); the
# backward scales them by the incoming gradient (the VJP is linear over the reals;
# ``scaled``: in place and handed over to ``.grad`` when torch frees the graph, into new
# buffers when it keeps it), and runs no program. The cost: a forward that is never
# followed by a backward computed the gradients for nothing (evaluate under
# ``torch.no_grad()``). ``torch.compile`` calls take the ``RESIDUALS`` route.


def save(ctx, holds: Holds, leaves, results, buffers) -> None:
    """Saves what the backward reads (``holds``); every edge's forward shares it.

    ``ctx.save_for_backward`` makes torch's saved-tensor hooks, ``save_on_cpu`` and
    non-reentrant checkpointing see exactly what is held, and in-place writes to anything
    the backward reads raise torch's version-counter error.
    """
    clones = holds.clones
    inputs = (map(leaves.__getitem__, holds.inputs) if not clones else
              [leaves[i].clone() if i in clones else leaves[i] for i in holds.inputs])
    ctx.save_for_backward(*inputs, *map(results.__getitem__, holds.outputs), *buffers)


_NO_STATE: dict = {}  # never written: a call without state shares it
_VERSION = operator.attrgetter("_version")


def scaled(buffers, cotangent: torch.Tensor) -> list[torch.Tensor]:
    """The fused route's gradient buffers for ``cotangent`` (NOTE [Scalar loss]).

    When torch frees the graph after this backward (no ``retain_graph``, no
    ``create_graph``), the saved buffers are read by nothing else: they are handed over,
    scaled in place unless the cotangent is one, and ``AccumulateGrad`` takes them (or
    views of them) as ``.grad`` without a copy. When it keeps the graph, a later backward
    reads them again, so each is multiplied into a new buffer: handed over, it would
    become ``.grad``, which torch accumulates into and optimizers zero in place.
    """
    if _keep_graph():
        return [b * cotangent for b in buffers]
    # A CUDA cotangent's value is not read: that would wait for the device.
    if cotangent.device.type == "cpu" and cotangent.item() == 1:
        return list(buffers)
    return [b.mul_(cotangent) for b in buffers]


def _keep_graph() -> bool:
    """Whether torch keeps this backward's graph (``retain_graph``), saved tensors included.

    torch's own compiled autograd asks the same to donate saved tensors; without the query
    (a torch that lacks it) the answer is the safe one.
    """
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else query()


class BridgeFunction(torch.autograd.Function):
    """``apply(entry, held, edges, state_arrays, *leaves) -> results``: an eager call.

    ``edges``: the owner's ``Edges``; a backward that torch differentiates again
    (``create_graph=True``) is a call of its own through ``edges.differentiate``.
    """

    @staticmethod
    def forward(ctx, entry: Entry, held: HeldArrays, edges, state_arrays: list, *leaves):
        # The program runs while autograd's records are made; nothing below reads a
        # result until the wait (saved-tensor hooks run after we return), which also comes
        # first on an error: no return while JAX still reads the inputs.
        route = entry.routes[EAGER]
        try:  # entry.holding(route), without a call once made
            holds = entry.holds[route.programs]
        except KeyError:
            holds = entry.holding(route)
        fwd = entry.forward(state_arrays, leaves, route, holds)
        try:
            results = fwd.results
            if entry.nondiff_out:
                ctx.mark_non_differentiable(*[results[k] for k in entry.nondiff_out])
            # Unused outputs get no gradient: materialised, each would be a zero tensor
            # allocated per backward.
            ctx.set_materialize_grads(False)
            save(ctx, holds, leaves, results, fwd.buffers)
            # What a derivative of the backward reads besides (NOTE [Higher order] in
            # edges/_higher.py): the leaves ``holds.kept`` with their versions, and the state the
            # owner overwrites. They are inputs of this call, upstream of its node, so no
            # reference cycle forms; saved-tensor hooks (save_on_cpu) never see them, so a
            # first-order step holds and moves exactly what it saves.
            index = holds.kept
            ctx.kept = kept = list(map(leaves.__getitem__, index)) if index else ()
            ctx.kept_versions = list(map(_VERSION, kept)) if index else ()
            ctx.state = ({i: leaves[i] for i in holds.state} if holds.state else _NO_STATE)
            # ``derivatives``: what this call's derivatives share, made by the first
            # (``CallDerivatives`` in edges/_derived.py).
            ctx.entry, ctx.held, ctx.edges, ctx.route, ctx.reuse, ctx.holds, ctx.derivatives = (
                entry, held, edges, route, fwd.reuse, holds, None)
        finally:
            entry.exchange.wait(fwd.pending)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        entry, route = ctx.entry, ctx.route
        cots = list(map(grads.__getitem__, entry.diff_out_index))
        saved = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (or torch.func.grad): torch differentiates these gradients
            # again, so they are the outputs of a differentiable call of the VJP, not of a
            # compiled backward torch cannot see into (NOTE [Higher order]).
            return (None, None, None, None,
                    *ctx.edges.differentiate(ctx, entry, route, saved, cots))
        if route.programs is FUSED:
            if cots[0] is None:  # the loss reached the backward without a gradient
                return (None,) * (4 + len(entry.layout.names))
            return (None, None, None, None, *entry.gradients(scaled(saved, cots[0]), cots))
        # The gradients are viewed out of their buffers while the program runs.
        buffers, pending = entry.backward(ctx.held, route, saved, ctx.reuse, cots, ctx.holds)
        try:
            grads = entry.gradients(buffers, cots)
        finally:
            entry.exchange.wait(pending)
        return (None, None, None, None, *grads)


# torch's Function.apply walks every argument in Python (functorch's dead-wrapper check);
# calls under a functorch transform take another Function (``_higher.TransformedCall``), so
# we call the C++ apply directly.
apply_bridge = super(torch.autograd.Function, BridgeFunction).apply
