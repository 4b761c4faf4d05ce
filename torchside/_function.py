"""The eager edge (step 3 of NOTE [Call path]): an entry's programs as one autograd node.

``save_for_backward`` and ``scaled`` are shared with the ``torch.compile`` ops
(``_compile.py``).
"""

from __future__ import annotations

import torch

from bridge.internal import HeldArrays
from torchside import _errors
from torchside._entry import Entry

# NOTE [Scalar loss]. When the one differentiable output of a call is a real scalar (a loss
# computed inside the block), its VJP is linear in the cotangent (no ``custom_vjp`` rule, no
# float16 value: ``flaxside``'s ``linear_in_cotangent``) and ``residuals="save"``, a
# grad-enabled eager call takes the "fused" route: ``value_and_grad``, the loss and its
# gradients for a cotangent of one, in the one program JAX compiles for
# ``jit(value_and_grad)``, instead of a forward that writes residuals and a backward that
# reads them. What it holds for backward is the gradient buffers (saved with
# ``ctx.save_for_backward``, so saved-tensor hooks and ``memory_report`` see them); the
# backward scales them by the incoming gradient (the VJP is linear over the reals;
# ``scaled``: in place and handed over to ``.grad`` when torch frees the graph, into new
# buffers when it keeps it), and runs no program. The cost: a forward that is never
# followed by a backward computed the gradients for nothing (evaluate under
# ``torch.no_grad()``). ``torch.compile`` calls take the "residuals" route.


_NO_STATE: dict = {}  # never written: a call without state shares it


def save_for_backward(ctx, entry: Entry, route: str, leaves, results, extra,
                      higher: bool = True) -> None:
    """Saves what the backward of ``entry`` reads on ``route``; both edges share it.

    ``ctx.save_for_backward`` makes torch's saved-tensor hooks, ``save_on_cpu`` and
    non-reentrant checkpointing see exactly what is held, and in-place writes to anything
    the backward reads raise torch's version-counter error. ``extra``: ``Forward.extra``.
    ``higher``: also keep, outside what torch saves, the leaves a derivative of the
    backward reads and the first order does not (``Entry.kept``), with their versions,
    and the state the owner overwrites: NOTE [Higher order] in ``_higher.py``. They are
    inputs of this call, upstream of its node, so no reference cycle forms; saved-tensor
    hooks (``save_on_cpu``) never see them, so a first-order step holds and moves exactly
    what it did.
    """
    index = entry.kept(route) if higher else ()
    ctx.kept = kept = [leaves[i] for i in index] if index else ()
    ctx.kept_versions = [t._version for t in kept] if index else ()
    targets = entry.write_back.targets if higher else ()
    ctx.state = {i: leaves[i] for i in targets} if targets else _NO_STATE
    if route == "fused":  # NOTE [Scalar loss]: the gradient buffers are what is held
        ctx.save_for_backward(*extra)
    elif route == "recompute":
        # State the owner writes back in place after this forward (batch statistics,
        # counters) is saved as it was, so the recompute sees the forward's values.
        targets = set(entry.write_back.targets)
        ctx.save_for_backward(*(t.clone() if i in targets else t for i, t in enumerate(leaves)))
    else:
        ctx.save_for_backward(*entry.saved.select(leaves, results, extra))


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


class BridgeFunction(torch.autograd.Function):
    """``apply(entry, held, state_arrays, *leaves) -> results``: an eager call in autograd.

    The backward is differentiable once: with ``create_graph=True`` it raises (see
    ``backward``) rather than hand torch gradients without a graph.
    """

    @staticmethod
    def forward(ctx, entry: Entry, held: HeldArrays, state_arrays: list, *leaves):
        # The program runs while autograd's records are made; nothing below reads a
        # result until the wait (saved-tensor hooks run after we return), which also comes
        # first on an error: no return while JAX still reads the inputs.
        fwd = entry.forward(state_arrays, leaves, fuse=True, wait=False)
        try:
            results = fwd.results
            ctx.mark_non_differentiable(*(results[k] for k in entry.nondiff_out))
            # Unused outputs get no gradient: materialised, each would be a zero tensor
            # allocated per backward.
            ctx.set_materialize_grads(False)
            save_for_backward(ctx, entry, fwd.route, leaves, results, fwd.extra)
            ctx.entry, ctx.held, ctx.route, ctx.reuse = entry, held, fwd.route, fwd.reuse
        finally:
            entry.exchange.wait(fwd.pending)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        cots = [grads[k] for k in entry.diff_out_index]
        saved = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (or torch.func.grad): torch differentiates these gradients
            # again, so they are the outputs of a differentiable call of the VJP, not of a
            # compiled backward torch cannot see into (NOTE [Higher order]).
            return (None, None, None, *higher_backward(entry, ctx.route, saved, ctx, cots))
        if ctx.route == "fused":
            if cots[0] is None:  # the loss reached the backward without a gradient
                return (None,) * (3 + len(entry.names))
            return (None, None, None, *entry.gradients(scaled(saved, cots[0]), cots))
        # The gradients are viewed out of their buffers while the program runs.
        buffers, pending = entry.backward(ctx.held, saved, ctx.reuse, cots, wait=False)
        try:
            grads = entry.gradients(buffers, cots)
        finally:
            entry.exchange.wait(pending)
        return (None, None, None, *grads)


# torch's Function.apply walks every argument in Python (functorch's dead-wrapper check);
# functorch transforms are refused before a call (``Caller.__call__``), so we call the C++
# apply directly.
apply_bridge = super(torch.autograd.Function, BridgeFunction).apply


def higher_backward(entry: Entry, route: str, saved, ctx, cots) -> list:
    """The backward as a differentiable call of the VJP (NOTE [Higher order])."""
    if entry.sharded:
        raise _errors.sharded_higher_order(entry.program.name)
    changed = None if route == "recompute" else entry.reads_overwritten_state()
    if changed is not None:
        raise _errors.higher_order_after_write_back(entry.program.name, changed)
    for i, t, version in zip(entry.kept(route), ctx.kept, ctx.kept_versions, strict=True):
        if t._version != version:  # as torch's check of what it saved
            raise _errors.modified_for_higher_order(entry.program.name, entry.names[i])
    from torchside._higher import differentiable_backward  # _higher imports _call

    leaves = entry.all_leaves(route, saved, ctx.kept, ctx.state)
    # The leaves' nodes (torch lists an edge per tensor argument: the leaves alone).
    nodes = [node for node, _ in ctx.next_functions]
    return differentiable_backward(entry, leaves, cots, nodes)


def _keep_graph() -> bool:
    """Whether torch keeps this backward's graph (``retain_graph``), saved tensors included.

    torch's own compiled autograd asks the same to donate saved tensors; without the query
    (a torch that lacks it) the answer is the safe one.
    """
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else query()

