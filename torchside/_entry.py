"""One signature's entry: its programs run inside torch autograd, forward and backward.

Steps 4 and the backward of NOTE [Call path] (``_call.py``). An ``Entry`` keeps what its
signature fixes: the programs' executables (fetched from ``flaxside.Program`` at first use,
so that a cached call runs no flaxside code), the residual map, how gradients are viewed
out of packed buffers. ``save_for_backward`` and ``Entry.gradients`` are shared by the
eager ``BridgeFunction`` and the ``torch.compile`` ops (``_compile.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import bridge
from bridge.internal import HeldArrays
from torchside._build import for_owner


class Entry:
    """One signature's programs and what a call of them needs, fixed when built.

    Attributes:
        program: the ``flaxside`` programs (``program.write_back``: which variables the
            aux results replace, and the NNX graph after the call).
        exchange: how tensors cross (``bridge.internal.exchange_for``).
        recompute: ``residuals="recompute"``.
        fuses: a grad-enabled eager call runs ``value_and_grad`` (``residuals="save"`` and a
            scalar loss; NOTE [Scalar loss]).
        names, n_vars, n_state, device, narrow: as ``_build.Built`` has them.
        rng_used: whether the programs read the RNG leaf (else no key is drawn).
        nondiff_out: results torch treats as non-differentiable (ints, aux, outputs that
            depend on no differentiated leaf).
        grad_slots: per gradient (``program.diff_index`` order), the leaf it belongs to.
        key: a small int naming the entry inside its caller (``torch.compile``'s ops).
    """

    __slots__ = ("program", "exchange", "recompute", "fuses", "names", "n_vars", "n_state",
                 "device", "narrow", "rng_used", "write_back", "writes", "n_out", "n_results",
                 "out_treedef", "nondiff_out", "diff_out_index", "grad_slots", "key",
                 "_executables", "_rmap", "_zero_cots", "_unreached", "_rng_zeros", "_unpack")

    def __init__(self, built, exchange, residuals: str, key: int):
        program = built.program
        self.program = program
        self.exchange = exchange
        self.recompute = residuals == "recompute"
        self.fuses = residuals == "save" and program.scalar_loss
        self.names, self.n_vars, self.n_state = built.names, built.n_vars, built.n_state
        self.device = built.device
        self.narrow = frozenset(built.narrow)
        self.rng_used = self.n_state > self.n_vars and program.reads[self.n_vars]
        self.write_back = program.write_back
        self.writes = bool(program.write_back.targets) or program.write_back.graph is not None
        self.n_out = program.n_out
        self.n_results = len(program.out_specs)
        self.out_treedef = program.out_treedef
        self.nondiff_out = tuple(k for k, s in enumerate(program.out_specs) if not s.diff)
        self.diff_out_index = program.diff_out_index
        self.grad_slots = program.diff_index
        self.key = key
        self._executables: dict[str, Any] = {}
        self._rmap = None
        self._zero_cots: dict[int, Any] = {}
        self._unreached: dict[tuple, frozenset] = {}
        self._rng_zeros = None
        self._unpack = built.unpack

    def run(self, kind: str, *args, wait: bool = True) -> tuple[list, list[torch.Tensor]]:
        """Runs program ``kind`` through the exchange: its result arrays and tensors.

        ``wait=False``: see the exchange's ``run``; ``self.exchange.wait`` the arrays.
        """
        exe = self._executables.get(kind)
        if exe is None:  # compiled at the first call that needs it, then kept here
            exe = self._executables[kind] = self.program.executable(kind)
        return self.exchange.run(kind, exe, *args, wait=wait)

    def residual_map(self):
        """The program's residual map (lowering ``forward_with_residuals`` if not yet)."""
        rmap = self._rmap
        if rmap is None:
            rmap = self._rmap = self.program.residual_map()
        return rmap

    # -- forward ---------------------------------------------------------------------------
    def rng(self, shape) -> torch.Tensor:
        """The RNG leaf: fresh key data from torch's generator if the programs read it.

        From torch's default generator: ``torch.manual_seed`` reproduces a run, and
        ``torch.utils.checkpoint``'s RNG-state replay reproduces the key on recompute. An
        eval-mode forward that uses no stream draws nothing (validation does not shift the
        training stream).
        """
        if self.rng_used:
            return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32,
                                 device=self.device)
        if self._rng_zeros is None:
            self._rng_zeros = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self._rng_zeros

    def narrowed(self, j: int, tensor: torch.Tensor, check: bool = True):
        """What the program takes for argument leaf ``j`` (int64) as int32.

        Raises naming the leaf if a value does not fit.
        """
        try:
            return self.exchange.narrowed(tensor, self.names[j], check)
        except TypeError as e:
            raise for_owner(e, self.program.name) from None

    def arrays(self, state_arrays: list, leaves) -> list:
        """The program's arrays: the state's (held), then views of the arguments."""
        view = self.exchange.view
        if not self.narrow:
            return state_arrays + [view(t) for t in leaves[self.n_state :]]
        return state_arrays + [self.narrowed(j, t) if j in self.narrow else view(t)
                               for j, t in enumerate(leaves[self.n_state :], self.n_state)]

    def forward(self, state_arrays: list, leaves, fuse: bool = False,
                wait: bool = True) -> tuple[list, list, list | None, list]:
        """``(results, residual tensors, JAX arrays kept for the backward, pending)``.

        Without a gradient to take, or in recompute mode, the plain forward: no residuals.
        With ``fuse`` (eager calls) and ``self.fuses``: the results and the gradient buffers
        of ``value_and_grad``, and ``FUSED``. ``pending``: with ``wait=False``, the arrays
        to ``self.exchange.wait`` for before anything reads the tensors; else empty.
        """
        arrays = self.arrays(state_arrays, leaves)
        if not self.grad_slots or self.recompute:
            out, tensors = self.run("forward", arrays, wait=wait)
            return tensors, [], None, [] if wait else out
        if fuse and self.fuses:
            out, tensors = self.run("value_and_grad", arrays, wait=wait)
            n = self.n_results
            return tensors[:n], tensors[n:], FUSED, [] if wait else out
        out, tensors = self.run("forward_with_residuals", arrays, wait=wait)
        n = self.n_results
        kept = [out[k] for k in self.residual_map().saved_outputs] + list(out[n:])
        return tensors[:n], tensors[n:], kept, [] if wait else out

    # -- backward --------------------------------------------------------------------------
    def zero_cotangent(self, k: int):
        """The cotangent of output ``k`` when torch has none, made once (JAX never writes it)."""
        zero = self._zero_cots.get(k)
        if zero is None:
            spec = self.program.out_specs[k]
            zero = self._zero_cots[k] = self.exchange.view(torch.zeros(
                spec.shape, dtype=bridge.torch_dtype(spec.dtype), device=self.device))
        return zero

    def saved_arrays(self, held: HeldArrays, saved, kept) -> list:
        """Arrays for what ``save_for_backward`` kept, reusing what is unchanged."""
        exchange, n_vars, narrow = self.exchange, self.n_vars, self.narrow

        def view(j, t):
            if j < n_vars:
                return held.get(j, t, exchange)
            # Saved as given (int64); its values were checked by the forward, and torch's
            # version counter refuses an in-place change in between.
            return self.narrowed(j, t, check=False) if j in narrow else exchange.view(t)

        if self.recompute:
            return [view(j, t) for j, t in enumerate(saved)]
        rmap = self.residual_map()
        n_in = len(rmap.saved_inputs)
        arrays = [view(j, t) for j, t in zip(rmap.saved_inputs, saved[:n_in], strict=True)]
        if kept is None:
            return arrays + [exchange.view(t) for t in saved[n_in:]]
        for t, k in zip(saved[n_in:], kept, strict=True):
            array = None if k is None else k[0]()
            # The array the forward made, unless a saved-tensor hook replaced the tensor.
            arrays.append(array if array is not None and t.data_ptr() == k[1]
                          else exchange.view(t))
        return arrays

    def backward(self, held: HeldArrays, saved, kept, cots,
                 wait: bool = True) -> tuple[list[torch.Tensor], list]:
        """The gradient buffers (``program.grad_pack``) of one call, and ``pending``.

        Args:
            held: the owner's held arrays (the variables' arrays are reused).
            saved: what ``save_for_backward`` saved, as torch unpacked it.
            kept: ``ctx.kept`` (arrays to reuse), or ``None``.
            cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
            wait: as for ``forward``; ``pending`` is empty when it waited.
        """
        view = self.exchange.view
        cots = [self.zero_cotangent(k) if g is None else view(g)
                for k, g in zip(self.diff_out_index, cots, strict=True)]
        arrays = self.saved_arrays(held, saved, kept)
        if self.recompute:
            out, tensors = self.run("backward_recompute", arrays, cots, wait=wait)
        else:
            rmap = self.residual_map()
            a = len(rmap.saved_inputs)
            b = a + len(rmap.saved_outputs)
            out, tensors = self.run("backward", arrays[:a], arrays[a:b], arrays[b:], cots,
                                    wait=wait)
        return tensors, [] if wait else out

    @staticmethod
    def scaled(buffers, cotangent: torch.Tensor) -> list[torch.Tensor]:
        """The fused gradient buffers for ``cotangent`` (NOTE [Scalar loss]).

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

    def gradients(self, buffers: list[torch.Tensor], cots) -> list:
        """Per leaf its gradient: views into the packed buffers, ``None`` where unreached.

        Views of one buffer share its memory; torch's ``AccumulateGrad`` takes each view as
        the parameter's ``.grad`` without a copy. A leaf that no used output depends on
        gets ``None``, as torch gives it: optimizers such as AdamW then leave it alone.
        """
        grads = buffers
        if self._unpack is not None:
            alone, groups, n = self._unpack
            grads = [None] * n
            for p, b in alone:
                grads[p] = buffers[b]
            for b, positions, templates in groups:
                views = torch._C._nn.unflatten_dense_tensors(buffers[b], templates)
                for p, g in zip(positions, views, strict=True):
                    grads[p] = g
        used = tuple(c is not None for c in cots)
        none = self._unreached_by(used) if not all(used) else ()
        out = [None] * len(self.names)
        for p, (slot, g) in enumerate(zip(self.grad_slots, grads, strict=True)):
            if p not in none:
                out[slot] = g
        return out

    def _unreached_by(self, used: tuple[bool, ...]) -> frozenset:
        none = self._unreached.get(used)
        if none is None:
            reach = 0
            for mask, u in zip(self.program.grad_reach, used, strict=True):
                if u:
                    reach |= mask
            none = frozenset(p for p in range(len(self.grad_slots)) if not reach >> p & 1)
            self._unreached[used] = none
        return none


# NOTE [Scalar loss]. When the one differentiable output of a call is a real scalar (a loss
# computed inside the block), its VJP is linear in the cotangent (no ``custom_vjp`` rule, no
# float16 value: ``flaxside``'s ``linear_in_cotangent``) and ``residuals="save"``, a
# grad-enabled eager call runs ``value_and_grad``: the loss and its gradients for a
# cotangent of one, in the one program JAX compiles for ``jit(value_and_grad)``, instead of
# a forward that writes residuals and a backward that reads them. What it holds for
# backward is the gradient buffers (saved with ``ctx.save_for_backward``, so saved-tensor
# hooks and ``memory_report`` see them); the backward scales them by the incoming gradient
# (the VJP is linear over the reals; ``Entry.scaled``: in place and handed over to
# ``.grad`` when torch frees the graph, into new buffers when it keeps it), and runs no
# program. The cost: a forward that is never followed by a backward computed the gradients
# for nothing (evaluate under ``torch.no_grad()``). ``torch.compile`` calls keep the two programs.
FUSED = object()  # what ``Entry.forward`` returns as ``kept`` on the fused route


def save_for_backward(ctx, entry: Entry, leaves, results, residuals, kept=None) -> None:
    """Saves what the backward of ``entry`` reads; eager and compiled calls share it.

    ``ctx.save_for_backward`` makes torch's saved-tensor hooks, ``save_on_cpu`` and
    non-reentrant checkpointing see exactly what is held, and in-place writes to anything
    the backward reads raise torch's version-counter error. ``kept`` are the JAX arrays
    behind the saved results and residuals; only weak references are kept, so a hook that
    moves or drops a tensor frees its memory as usual (``None``: nothing to reuse).
    """
    if entry.recompute:
        # State the owner writes back in place after this forward (batch statistics,
        # counters) is saved as it was, so the recompute sees the forward's values.
        targets = set(entry.write_back.targets)
        ctx.save_for_backward(*(t.clone() if i in targets else t for i, t in enumerate(leaves)))
        ctx.kept = None
        return
    rmap = entry.residual_map()
    ctx.save_for_backward(*(leaves[j] for j in rmap.saved_inputs),
                          *(results[k] for k in rmap.saved_outputs), *residuals)
    if kept is None:
        ctx.kept = None
        return
    # Offloaded residuals live in host memory, which the backward program does not take.
    skip = (False,) * len(rmap.saved_outputs) + rmap.offloaded
    ctx.kept = tuple(None if off else (weakref.ref(a), a.unsafe_buffer_pointer())
                     for a, off in zip(kept, skip, strict=True))


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
        results, residuals, kept, pending = entry.forward(state_arrays, leaves, fuse=True,
                                                          wait=False)
        try:
            ctx.mark_non_differentiable(*(results[k] for k in entry.nondiff_out))
            # Unused outputs get no gradient: materialised, each would be a zero tensor
            # allocated per backward.
            ctx.set_materialize_grads(False)
            ctx.fused = kept is FUSED
            if ctx.fused:  # NOTE [Scalar loss]: the gradient buffers are what is held
                ctx.save_for_backward(*residuals)
            else:
                save_for_backward(ctx, entry, leaves, results, residuals, kept)
            ctx.entry, ctx.held = entry, held
        finally:
            entry.exchange.wait(pending)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        if torch.is_grad_enabled():
            if any(_functorch_wrapped(g) for g in grads):  # torch.func.grad runs us so
                raise under_torch_func(entry.program.name)
            # create_graph=True: torch would differentiate these gradients again, through a
            # compiled JAX VJP it cannot see into. Refuse now. A lazy refusal (torch's
            # once_differentiable) hangs its error node on fresh leaves, off the path to the
            # parameters: autograd.grad(loss_with_gradient_penalty, params) never reaches it
            # and silently drops the penalty's gradient.
            raise NotImplementedError(
                f"{entry.program.name}: backward with create_graph=True (a gradient "
                f"penalty, a Hessian-vector product, MAML) needs the second derivative of "
                f"this call, which is not implemented: its backward is a compiled JAX VJP "
                f"that torch cannot differentiate. Compute the higher-order term inside JAX "
                f"(e.g. a jax_function that returns jax.grad of the inner loss, so torch "
                f"needs only its first derivative), or differentiate without create_graph."
            )
        cots = [grads[k] for k in entry.diff_out_index]
        if ctx.fused:
            if cots[0] is None:  # the loss reached the backward without a gradient
                return (None,) * (3 + len(entry.names))
            return (None, None, None, *entry.gradients(
                entry.scaled(ctx.saved_tensors, cots[0]), cots))
        # The gradients are viewed out of their buffers while the program runs.
        buffers, pending = entry.backward(ctx.held, ctx.saved_tensors, ctx.kept, cots,
                                          wait=False)
        try:
            grads = entry.gradients(buffers, cots)
        finally:
            entry.exchange.wait(pending)
        return (None, None, None, *grads)


# torch's Function.apply walks every argument in Python (functorch's dead-wrapper check);
# functorch transforms are refused before a call (``Caller.__call__``), so we call the C++
# apply directly.
apply_bridge = super(torch.autograd.Function, BridgeFunction).apply


def _keep_graph() -> bool:
    """Whether torch keeps this backward's graph (``retain_graph``), saved tensors included.

    torch's own compiled autograd asks the same to donate saved tensors; without the query
    (a torch that lacks it) the answer is the safe one.
    """
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else query()


def _functorch_wrapped(tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(isinstance(tensor, torch.Tensor) and check and check(tensor))


def under_torch_func(where: str) -> NotImplementedError:
    """The error for a call under a ``torch.func`` transform."""
    return NotImplementedError(
        f"{where}: called under a torch.func transform (vmap, grad, jacrev, ...), whose "
        f"tensors have no memory JAX can read. Call it outside the transform, or apply the "
        f"JAX transform (jax.vmap, jax.grad) inside a jax_function."
    )
