"""The one autograd.Function that runs a compiled flaxside Program from torch."""

from __future__ import annotations

import jax
import torch

import bridge
from flaxside import Program

RESIDUAL_MODES = ("save", "recompute")


class Entry:
    """Everything a call needs that depends only on its signature, computed once.

    Args:
        program: the compiled programs for this signature.
        np_dtypes: the numpy dtype of each input leaf (already checked).
        device: the torch device all leaves live on.
        residuals: ``"save"`` keeps what the Flax remat policy keeps; ``"recompute"`` keeps
            only the inputs and reruns the forward inside the backward.
        n_vars: how many leading leaves are the owner's parameters and buffers: on CPU
            their JAX arrays are made once and reused (``bridge.HeldArrays``).
    """

    __slots__ = ("program", "np_dtypes", "device", "cpu", "recompute", "n_results", "n_out",
                 "nondiff_out", "res_dtypes", "saved_in_dtypes", "saved_out_dtypes",
                 "cot_dtypes", "grad_slots", "traced", "aux_targets", "compile_id", "n_vars",
                 "held")

    def __init__(self, program: Program, np_dtypes, device: torch.device, residuals="save",
                 n_vars: int = 0):
        self.program = program
        self.np_dtypes = tuple(np_dtypes)
        self.device = device
        self.cpu = device.type == "cpu"
        self.recompute = residuals == "recompute"
        self.n_results = len(program.out_specs)
        self.n_out = program.n_out
        self.nondiff_out = tuple(k for k, s in enumerate(program.out_specs) if not s.diff)
        self.cot_dtypes = tuple(program.out_specs[k].dtype for k in program.diff_out_index)
        self.grad_slots = tuple(1 + i for i in program.diff_index)  # +1: the Entry argument
        self.traced = False
        self.aux_targets = ()  # variable leaves the aux outputs replace (set by the Caller)
        self.n_vars = n_vars if self.cpu else 0
        self.held = bridge.HeldArrays(self.n_vars, bridge.jax_device(device)) if self.cpu else None

    def finish_trace(self) -> None:
        """Record what the first residual trace fixed (dtypes of what the backward gets)."""
        p = self.program
        self.saved_in_dtypes = tuple(self.np_dtypes[j] for j in p.saved_input_index)
        self.saved_out_dtypes = tuple(p.out_specs[k].dtype for k in p.saved_output_index)
        self.res_dtypes = tuple(s.dtype for s in p.residual_specs)
        self.traced = True

    # -- conversions on the per-call path ----------------------------------------------
    def arrays(self, tensors, np_dtypes) -> list:
        """Tensors -> what the jitted program takes (numpy views on CPU, DLPack on CUDA)."""
        try:
            if self.cpu:
                return [bridge.numpy_view(t, d) for t, d in zip(tensors, np_dtypes, strict=True)]
            return [jax.dlpack.from_dlpack(t.detach().contiguous()) for t in tensors]
        except Exception as e:
            _explain_torch_func(e, tensors, self.program.name)
            raise

    def leaf_arrays(self, leaves, keep: bool = True) -> list:
        """Arrays for the call's leaves: held ones for the variables on CPU, views for the rest.

        ``keep=False`` (backward) reuses held arrays but holds nothing new: saved-tensor
        hooks may hand back temporary copies.
        """
        n = self.n_vars
        if not n:
            return self.arrays(leaves, self.np_dtypes)
        try:
            held = [self.held.get(i, leaves[i], self.np_dtypes[i], keep) for i in range(n)]
        except Exception as e:
            _explain_torch_func(e, leaves, self.program.name)
            raise
        return held + self.arrays(leaves[n:], self.np_dtypes[n:])

    def saved_arrays(self, saved) -> list:
        """Arrays for the saved input leaves (``program.saved_input_index``) in the backward."""
        n = self.n_vars
        if not n:
            return self.arrays(saved, self.saved_in_dtypes)
        get = self.held.get
        return [get(j, t, d, False) if j < n else bridge.numpy_view(t, d)
                for j, t, d in zip(self.program.saved_input_index, saved, self.saved_in_dtypes,
                                   strict=True)]

    def tensors(self, arrays) -> list[torch.Tensor]:
        """Program results -> torch tensors, after waiting for JAX to compute them."""
        if self.cpu:
            jax.block_until_ready(arrays)
            return [bridge.cpu_tensor(a) for a in arrays]
        return [torch.from_dlpack(a) for a in arrays]

    def zeros(self, k: int) -> torch.Tensor:
        """The cotangent of output ``k`` when torch has none (the output was not used)."""
        spec = self.program.out_specs[k]
        return torch.zeros(spec.shape, dtype=bridge.torch_dtype(spec.dtype), device=self.device)

    def forward(self, leaves) -> list[torch.Tensor]:
        """Forward for autograd: outputs, then residuals in ``"save"`` mode."""
        arrays = self.leaf_arrays(leaves)
        if self.recompute:
            return self.tensors(self.program.forward(arrays))
        outs, res = self.program.forward_with_residuals(arrays)
        if not self.traced:
            self.finish_trace()
        return self.tensors(list(outs) + list(res))

    def to_save(self, leaves, outs, res) -> list[torch.Tensor]:
        """What the backward needs, for ``ctx.save_for_backward``."""
        if self.recompute:
            # State the owner writes back in place after this forward (batch statistics,
            # counters) is saved as it was, so the recompute sees the forward's values.
            targets = set(self.aux_targets)
            return [t.clone() if i in targets else t for i, t in enumerate(leaves)]
        p = self.program
        return ([leaves[j] for j in p.saved_input_index]
                + [outs[k] for k in p.saved_output_index] + list(res))

    def backward(self, saved, cots) -> list[torch.Tensor]:
        """Gradients of the differentiated leaves from what ``to_save`` kept."""
        program = self.program
        cots = self.arrays(cots, self.cot_dtypes)
        if self.recompute:
            result = program.backward_recompute(self.leaf_arrays(saved, keep=False), cots)
        else:
            a = len(program.saved_input_index)
            b = a + len(program.saved_output_index)
            result = program.backward(
                self.saved_arrays(saved[:a]),
                self.arrays(saved[a:b], self.saved_out_dtypes),
                self.arrays(saved[b:], self.res_dtypes),
                cots,
            )
        return self.tensors(result)

    def run(self, tensors) -> list[torch.Tensor]:
        """Forward without autograd: nothing is computed or held for a backward."""
        return self.tensors(self.program.forward(self.leaf_arrays(tensors)))


def _functorch_wrapped(tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(isinstance(tensor, torch.Tensor) and check and check(tensor))


def _explain_torch_func(error: Exception, tensors, where: str) -> None:
    """Raises the torch.func explanation for a failed conversion, if that is its cause.

    Checked only on failure: the per-call path pays nothing for it.
    """
    if any(_functorch_wrapped(t) for t in tensors):
        raise _under_torch_func(where) from error


def _under_torch_func(where: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: called under a torch.func transform (vmap, grad, jacrev, ...), whose "
        f"tensors have no memory JAX can read. Call it outside the transform, or apply the "
        f"JAX transform (jax.vmap, jax.grad) inside a jax_function."
    )


class BridgeFunction(torch.autograd.Function):
    """``apply(entry, *leaves) -> (*outputs, *aux, *residuals)``; the caller drops residuals.

    Residuals leave ``forward`` as extra outputs so that ``setup_context`` can hand them to
    ``ctx.save_for_backward``: torch's saved-tensor hooks, ``save_on_cpu`` and
    non-reentrant checkpointing then see exactly what we hold, and in-place writes to any
    saved input, parameter or output raise torch's usual version-counter error.

    The backward is differentiable once: with ``create_graph=True`` it raises (see
    ``backward``) rather than hand torch gradients without a graph.
    """

    @staticmethod
    def forward(entry: Entry, *leaves: torch.Tensor):
        return tuple(entry.forward(leaves))

    @staticmethod
    def setup_context(ctx, inputs, output):
        entry, leaves = inputs[0], inputs[1:]
        outs, res = output[: entry.n_results], output[entry.n_results :]
        ctx.mark_non_differentiable(*(outs[k] for k in entry.nondiff_out), *res)
        # Residuals and unused outputs get no gradient. Materialised, each would be a zero
        # tensor allocated per backward: 896 of them on a 64-block unrolled stack (~5 ms).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*entry.to_save(leaves, outs, res))
        ctx.entry = entry
        ctx.n_leaves = len(leaves)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            if any(_functorch_wrapped(g) for g in grads):  # torch.func.grad runs us so
                raise _under_torch_func(ctx.entry.program.name)
            # create_graph=True: torch would differentiate these gradients again, through a
            # compiled JAX VJP it cannot see into. Refuse now. A lazy refusal (torch's
            # once_differentiable) hangs its error node on fresh leaves, off the path to the
            # parameters: autograd.grad(loss_with_gradient_penalty, params) never reaches it
            # and silently drops the penalty's gradient. A node on that path would have to
            # save one of our own outputs, which identity saved-tensor hooks (save_on_cpu on
            # CPU) turn into a reference cycle that leaks the whole graph.
            raise NotImplementedError(
                f"{ctx.entry.program.name}: backward with create_graph=True (a gradient "
                f"penalty, a Hessian-vector product, MAML) needs the second derivative of "
                f"this call, which is not implemented: its backward is a compiled JAX VJP "
                f"that torch cannot differentiate. Compute the higher-order term inside JAX "
                f"(e.g. a jax_function that returns jax.grad of the inner loss, so torch "
                f"needs only its first derivative), or differentiate without create_graph."
            )
        return _backward(ctx, ctx.saved_tensors, grads)


def _backward(ctx, saved, grads) -> tuple:
    entry = ctx.entry
    cots = [grads[k] if grads[k] is not None else entry.zeros(k)
            for k in entry.program.diff_out_index]
    result = entry.backward(saved, cots)
    out = [None] * (1 + ctx.n_leaves)
    for slot, g in zip(entry.grad_slots, result, strict=True):
        out[slot] = g
    return tuple(out)


# torch's Function.apply binds default arguments with inspect.signature on every call when
# setup_context is defined (about 20-30 us measured here); BridgeFunction.forward has no
# defaults, so outside functorch transforms we call the C++ apply directly.
_c_apply = super(torch.autograd.Function, BridgeFunction).apply


def apply_bridge(entry: Entry, *leaves: torch.Tensor):
    """``BridgeFunction.apply`` without the per-call signature binding."""
    if torch._C._are_functorch_transforms_active():
        return BridgeFunction.apply(entry, *leaves)
    return _c_apply(entry, *leaves)
