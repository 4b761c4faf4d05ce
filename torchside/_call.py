"""One compiled call inside torch autograd: forward, saved tensors, backward, gradients.

Step 4 and 5 of NOTE [Call path] (``_caller.py``): ``CompiledCall`` runs a signature's
programs, ``save_for_backward`` and ``scatter_grads`` are shared by ``BridgeFunction``
(eager) and the ``torch.compile`` ops (``_compile.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import bridge


class CompiledCall:
    """What one signature's calls need, fixed when it is built (see ``_build.build_call``).

    Attributes:
        program: the ``flaxside`` programs.
        exchange: how tensors cross (``bridge.exchange_for``).
        held: the owner's ``HeldArrays`` (variables are read through them).
        recompute: ``residuals="recompute"``.
        n_vars: variable leaves; the rng leaf follows them when ``has_rng``.
        n_state: ``n_vars`` plus the rng leaf.
        rng_used: whether the program reads the rng leaf (else no key is drawn).
        write_back: ``WriteBack``: the variables the aux results replace, the graph after.
        nondiff_out: results torch must treat as non-differentiable (ints, aux, outputs
            that depend on no differentiated leaf).
        grad_slots: per gradient (``program.diff_index`` order), the leaf it belongs to.
        names: a name per leaf, for messages.
        key: a small int naming this call inside its caller (``torch.compile`` ops).
        narrow: indices of the int64 argument leaves that cross as int32 (JAX runs
            32-bit): checked in the forward, converted again unchecked in the backward.
    """

    __slots__ = ("program", "exchange", "held", "recompute", "n_vars", "n_state", "rng_used",
                 "write_back", "n_out", "n_results", "nondiff_out", "grad_slots", "names",
                 "device", "key", "narrow", "_zero_cots", "_unreached", "_rng_zeros",
                 "_unpack")

    def __init__(self, program, exchange, held, *, recompute: bool, n_vars: int, n_state: int,
                 names: tuple, device: torch.device, key: int, narrow: tuple = ()):
        self.program = program
        self.exchange = exchange
        self.held = held
        self.recompute = recompute
        self.n_vars = n_vars
        self.n_state = n_state
        self.rng_used = n_state > n_vars and program.reads[n_vars]
        self.write_back = program.static
        self.n_out = program.n_out
        self.n_results = len(program.out_specs)
        self.nondiff_out = tuple(k for k, s in enumerate(program.out_specs) if not s.diff)
        self.grad_slots = program.diff_index
        self.names = names
        self.device = device
        self.key = key
        self.narrow = frozenset(narrow)
        self._zero_cots: dict[int, Any] = {}
        self._unreached: dict[tuple, frozenset] = {}
        self._rng_zeros = None
        self._unpack = _grad_unpacker(program.grad_pack, program.specs, program.diff_index)

    # -- forward -------------------------------------------------------------------------
    def rng(self, shape) -> torch.Tensor:
        """The rng leaf: fresh key data from torch's generator if the program reads it.

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

    def arrays(self, head: list, leaves) -> list:
        """The program's arrays: ``head`` (the state's) then views of the arguments."""
        view = self.exchange.view
        if not self.narrow:
            return head + [view(t) for t in leaves[self.n_state :]]
        return head + [view(self.narrowed(j, t) if j in self.narrow else t)
                       for j, t in enumerate(leaves[self.n_state :], self.n_state)]

    def narrowed(self, j: int, tensor: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Argument leaf ``j`` (int64) as int32; raises naming it if a value does not fit."""
        try:
            return bridge.narrow_to_int32(tensor, name=self.names[j], check=check)
        except TypeError as e:
            raise TypeError(f"{self.program.name}: {e}") from None

    def run(self, head: list, leaves) -> list[torch.Tensor]:
        """Forward without autograd: nothing is computed or held for a backward."""
        return self.exchange.run(self.program.forward, self.arrays(head, leaves))[1]

    def forward(self, head: list, leaves) -> tuple[list, list, list]:
        """Forward for autograd: ``(results, residual tensors, JAX arrays kept for reuse)``."""
        exchange = self.exchange
        arrays = self.arrays(head, leaves)
        if self.recompute:
            return exchange.run(self.program.forward, arrays)[1], [], []
        out, tensors = exchange.run(self.program.forward_with_residuals, arrays)
        n = self.n_results
        kept = [out[k] for k in self.program.residual_map().saved_outputs] + list(out[n:])
        return tensors[:n], tensors[n:], kept

    def held_besides_residuals(self) -> list:
        """What a call saves for the backward besides the program's residuals, as specs.

        Besides the owner's variables, the call's arguments and its outputs too (see
        ``save_for_backward``): a drawn RNG key, copies of written-back state, saved state
        updates.
        """
        program = self.program
        rng = [program.specs[self.n_vars]] if self.n_state > self.n_vars else []
        if self.recompute:
            # Every leaf is saved (the RNG leaf too), written-back state as a clone.
            return [program.specs[i] for i in self.write_back.targets] + rng
        rmap = program.residual_map()
        return ([s for s in rng if self.n_vars in rmap.saved_inputs]
                + [program.out_specs[k] for k in rmap.saved_outputs if k >= self.n_out])

    # -- backward ------------------------------------------------------------------------
    def zero_cotangent(self, k: int):
        """The cotangent of output ``k`` when torch has none, made once (JAX never writes it)."""
        zero = self._zero_cots.get(k)
        if zero is None:
            spec = self.program.out_specs[k]
            zero = self.exchange.view(torch.zeros(
                spec.shape, dtype=bridge.torch_dtype(spec.dtype), device=self.device))
            self._zero_cots[k] = zero
        return zero

    def unreached(self, used: tuple[bool, ...]) -> frozenset:
        """Gradient positions that no used output depends on: torch gives them ``None``."""
        none = self._unreached.get(used)
        if none is None:
            reach = 0
            for mask, u in zip(self.program.grad_reach, used, strict=True):
                if u:
                    reach |= mask
            none = frozenset(p for p in range(len(self.grad_slots)) if not reach >> p & 1)
            self._unreached[used] = none
        return none

    def saved_arrays(self, saved, kept) -> list:
        """Arrays for what ``save_for_backward`` kept (see there), reusing what is unchanged."""
        exchange, held, n_vars, narrow = self.exchange, self.held, self.n_vars, self.narrow

        def view(j, t):
            if j < n_vars:
                return held.get(j, t, exchange)
            # Saved as given (int64); its values were checked by the forward, and torch's
            # version counter refuses an in-place change in between.
            return exchange.view(self.narrowed(j, t, check=False) if j in narrow else t)

        if self.recompute:
            return [view(j, t) for j, t in enumerate(saved)]
        rmap = self.program.residual_map()
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

    def unpack_grads(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per differentiated leaf its gradient: views into the packed buffers.

        Views of one buffer share its memory. torch's ``AccumulateGrad`` takes each view as
        the parameter's ``.grad`` without a copy; an in-place accumulation then writes only
        the view's own elements.
        """
        unpack = self._unpack
        if unpack is None:
            return buffers
        alone, groups, n = unpack
        out = [None] * n
        for p, b in alone:
            out[p] = buffers[b]
        for b, positions, templates in groups:
            for p, g in zip(positions, _unflatten(buffers[b], templates), strict=True):
                out[p] = g
        return out

    def backward(self, saved, kept, cots) -> list[torch.Tensor]:
        """Gradient buffers (``program.grad_pack``) from what was saved.

        Args:
            saved: what ``save_for_backward`` saved, as torch unpacked it.
            kept: ``ctx.kept`` (arrays to reuse), or ``None``.
            cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
        """
        program, exchange = self.program, self.exchange
        cots = [self.zero_cotangent(k) if g is None else exchange.view(g)
                for k, g in zip(program.diff_out_index, cots, strict=True)]
        arrays = self.saved_arrays(saved, kept)
        if self.recompute:
            return exchange.run(program.backward_recompute, arrays, cots)[1]
        rmap = program.residual_map()
        a = len(rmap.saved_inputs)
        b = a + len(rmap.saved_outputs)
        return exchange.run(program.backward, arrays[:a], arrays[a:b], arrays[b:], cots)[1]


def save_for_backward(ctx, call: CompiledCall, leaves, results, residuals, kept=None) -> None:
    """Saves what the backward of ``call`` needs; shared by eager and ``torch.compile`` calls.

    ``ctx.save_for_backward`` makes torch's saved-tensor hooks, ``save_on_cpu`` and
    non-reentrant checkpointing see exactly what is held, and in-place writes to anything
    the backward reads raise torch's version-counter error. ``kept`` are the JAX arrays
    behind the saved results and residuals; only weak references are kept, so a hook that
    moves or drops a tensor frees its memory as usual (``None``: nothing to reuse).
    """
    if call.recompute:
        # State the owner writes back in place after this forward (batch statistics,
        # counters) is saved as it was, so the recompute sees the forward's values.
        targets = set(call.write_back.targets)
        ctx.save_for_backward(*(t.clone() if i in targets else t for i, t in enumerate(leaves)))
        ctx.kept = None
        return
    rmap = call.program.residual_map()
    ctx.save_for_backward(*(leaves[j] for j in rmap.saved_inputs),
                          *(results[k] for k in rmap.saved_outputs), *residuals)
    if kept is None:
        ctx.kept = None
        return
    # Offloaded residuals live in host memory, which the backward program does not take.
    skip = (False,) * len(rmap.saved_outputs) + rmap.offloaded
    ctx.kept = tuple(None if off else (weakref.ref(a), a.unsafe_buffer_pointer())
                     for a, off in zip(kept, skip, strict=True))


def scatter_grads(call: CompiledCall, grads: list, cots) -> list:
    """Gradients per leaf: the program's in their slots, ``None`` elsewhere.

    ``cots`` are the cotangents torch passed (per differentiable output, ``None`` for an
    output nobody used). A leaf that no used output depends on gets ``None``, as torch
    gives it: optimizers such as AdamW then leave it alone (a zero would move it through
    momentum and decay).
    """
    out = [None] * (len(call.names))
    used = tuple(c is not None for c in cots)
    none = call.unreached(used) if not all(used) else ()
    for p, (slot, g) in enumerate(zip(call.grad_slots, grads, strict=True)):
        if p not in none:
            out[slot] = g
    return out


def _grad_unpacker(placement, specs, diff_index):
    """What ``CompiledCall.unpack_grads`` needs, fixed once; ``None`` when nothing is packed."""
    if all(entry[0] == "alone" for entry in placement):
        return None
    alone, groups = [], {}
    for p, entry in enumerate(placement):
        if entry[0] == "alone":
            alone.append((p, entry[1]))
        else:
            group = groups.setdefault(entry[1], ([], []))
            group[0].append(p)
            # Shapes only: meta tensors stand for the views' sizes.
            group[1].append(torch.empty(specs[diff_index[p]].shape, device="meta"))
    return (tuple(alone), tuple((b, tuple(ps), ts) for b, (ps, ts) in groups.items()),
            len(placement))


def _unflatten(buffer: torch.Tensor, templates: list) -> list[torch.Tensor]:
    """Views of ``buffer``, one per template's shape, in order (one C++ call)."""
    return torch._C._nn.unflatten_dense_tensors(buffer, templates)


class BridgeFunction(torch.autograd.Function):
    """``apply(call, head, *leaves) -> results``: one compiled call inside torch autograd.

    ``head`` holds the arrays of the state leaves (held ones for variables). The backward
    is differentiable once: with ``create_graph=True`` it raises (see ``backward``) rather
    than hand torch gradients without a graph.
    """

    @staticmethod
    def forward(ctx, call: CompiledCall, head: list, *leaves: torch.Tensor):
        results, residuals, kept = call.forward(head, leaves)
        ctx.mark_non_differentiable(*(results[k] for k in call.nondiff_out))
        # Unused outputs get no gradient. Materialised, each would be a zero tensor
        # allocated per backward (README: "Per-call cost").
        ctx.set_materialize_grads(False)
        save_for_backward(ctx, call, leaves, results, residuals, kept)
        ctx.call = call
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            if any(_functorch_wrapped(g) for g in grads):  # torch.func.grad runs us so
                raise under_torch_func(ctx.call.program.name)
            # create_graph=True: torch would differentiate these gradients again, through a
            # compiled JAX VJP it cannot see into. Refuse now. A lazy refusal (torch's
            # once_differentiable) hangs its error node on fresh leaves, off the path to the
            # parameters: autograd.grad(loss_with_gradient_penalty, params) never reaches it
            # and silently drops the penalty's gradient.
            raise NotImplementedError(
                f"{ctx.call.program.name}: backward with create_graph=True (a gradient "
                f"penalty, a Hessian-vector product, MAML) needs the second derivative of "
                f"this call, which is not implemented: its backward is a compiled JAX VJP "
                f"that torch cannot differentiate. Compute the higher-order term inside JAX "
                f"(e.g. a jax_function that returns jax.grad of the inner loss, so torch "
                f"needs only its first derivative), or differentiate without create_graph."
            )
        call = ctx.call
        cots = [grads[k] for k in call.program.diff_out_index]
        return (None, None, *scatter_grads(
            call, call.unpack_grads(call.backward(ctx.saved_tensors, ctx.kept, cots)), cots))


# torch's Function.apply walks every argument in Python (functorch's dead-wrapper check);
# functorch transforms are refused before a call (``Caller.__call__``), so we call the C++
# apply directly.
apply_bridge = super(torch.autograd.Function, BridgeFunction).apply


def _functorch_wrapped(tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(isinstance(tensor, torch.Tensor) and check and check(tensor))


def under_torch_func(where: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: called under a torch.func transform (vmap, grad, jacrev, ...), whose "
        f"tensors have no memory JAX can read. Call it outside the transform, or apply the "
        f"JAX transform (jax.vmap, jax.grad) inside a jax_function."
    )
