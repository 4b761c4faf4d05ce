"""Compiled forward / residual / backward programs for one call signature.

``Program(fn, specs)`` compiles, for one signature, the programs a torch caller needs over
one flat list of array leaves (the owner's variables first, then the call's arrays):

* ``forward(leaves) -> results``: outputs then aux leaves; nothing kept for a backward;
* ``forward_with_residuals(leaves) -> results + residuals`` (one flat list);
* ``backward(saved_inputs, saved_outputs, residuals, cotangents) -> gradient buffers``;
* ``backward_recompute(leaves, cotangents) -> gradient buffers`` (forward rerun inside);
* ``value_and_grad(leaves) -> results + gradient buffers``, when the one differentiable
  output is a real scalar and the VJP is linear in it (``scalar_loss``): the gradients for
  a cotangent of one, in the one program JAX's ``jit(value_and_grad)`` compiles; any
  other cotangent scales them.

Every executable is lowered for one device (``device``; see ``_device.py``): its arguments
are placed there and its results come back there, whatever JAX's default device is.
``SpmdProgram`` (``_spmd.py``) lowers the same bodies over a mesh of processes.

Small gradients leave the backward packed, one buffer per dtype (``grad_pack``), as small
residuals leave the forward: a call then costs per buffer, not per parameter.

What the first trace of ``forward_with_residuals`` learns (which VJP leaf is an input, an
output or a true residual, how residuals are packed) is returned as one frozen
``ResidualMap``; see ``flaxside/README.md``. Gradients follow torch's convention for
complex leaves (the conjugate of JAX's), since the caller hands them to torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxside._bodies import Structure, TracedBodies
from flaxside._conventions import internal_assert
from flaxside._depends import input_masks, linear_in_cotangent
from flaxside._device import aval, compiling_for
from flaxside._specs import LeafSpec, Learned, ResidualMap, is_differentiable

jtu = jax.tree_util

PROGRAMS = ("forward", "forward_with_residuals", "backward", "backward_recompute",
            "value_and_grad")


class Program(TracedBodies):
    """The compiled programs for one function and one call signature.

    Built once per signature. One abstract trace at construction fixes the output structure,
    which results carry gradients and which inputs each result reads; the residual map is
    fixed by the first lowering of ``forward_with_residuals``. A call does only the dispatch.

    Args:
        fn: ``fn(leaves) -> (outputs, aux, write_back)``: ``outputs`` a pytree of arrays,
            ``aux`` a list of arrays that never carry gradients (updated Flax collections) and
            ``write_back`` a hashable Python value that every trace returns equal (which
            state the aux leaves replace).
        specs: one ``LeafSpec`` per leaf; ``diff`` marks the leaves to differentiate.
        name: used in error messages.
        fence: every program takes one more array after its arguments and waits until it
            is ready (see ``bridge``'s ordering note); kept even though nothing reads it.
        device: the JAX device every executable is lowered for (arguments are placed
            there, results come back there); ``None`` leaves placement to JAX (its default
            device), as a plain ``jax.jit`` would.

    Attributes:
        out_specs: one ``LeafSpec`` per output then aux leaf; ``diff`` marks the outputs
            that depend on a differentiated leaf (the only ones that take a cotangent).
        n_out: how many of ``out_specs`` are outputs (the rest are aux).
        out_treedef: the structure of the outputs.
        write_back: the ``write_back`` value ``fn`` returned (``flaxside.internal.WriteBack``
            for the torch side: which variables the aux replace, the NNX graph after).
        reads: per leaf, whether any result depends on it.
        out_reads: per result, a bitmask over leaves of those it depends on.
        grad_pack: where each gradient (``diff_index`` order) sits in what the backward
            programs return (``pack_plan``): small gradients leave packed, one buffer per
            dtype, and ``unpack`` (or views on the torch side) recovers them.
        grad_specs: the buffers the backward programs return.
        grad_reach: per differentiable output (``diff_out_index`` order), a bitmask over
            ``diff_index`` positions of the leaves it depends on.

    Example:
        >>> fn = lambda xs: (xs[0] * xs[1], [], None)
        >>> p = Program(fn, [LeafSpec((2,), np.float32, True)] * 2)
        >>> out, *res = p.forward_with_residuals([np.ones(2, np.float32)] * 2)
    """

    def __init__(self, fn: Callable, specs: Sequence[LeafSpec], *, name: str = "program",
                 fence: bool = False, device=None):
        self.fn = fn
        self.specs = tuple(specs)
        self.name = name
        self.fence = fence
        self.device = device
        self.diff_index = tuple(i for i, s in enumerate(self.specs) if s.diff)
        self.grad_pack, buffers = self._pack_plan([self.specs[i] for i in self.diff_index])
        self.grad_specs = tuple(LeafSpec(shape, dtype) for shape, dtype in buffers)
        self.trace_count = 0
        self._lock = threading.RLock()  # compiling the backward asks for the residual map

        def abstract(leaves):
            results, structure = self._results(leaves)
            return results, Learned(structure)

        with compiling_for(device):  # code traced inside may compile for the device
            closed, (_, learned) = jax.make_jaxpr(abstract, return_shape=True)(
                [s.aval for s in self.specs])
        self._structure: Structure = learned.take()
        self.out_treedef = self._structure.out_treedef
        self.n_out = self._structure.n_out
        self.write_back = self._structure.write_back
        masks = input_masks(closed.jaxpr)
        diff_bits = sum(1 << i for i in self.diff_index)
        self.out_specs = tuple(
            LeafSpec(tuple(o.shape), np.dtype(o.dtype),
                     k < self.n_out and bool(m & diff_bits) and is_differentiable(o.dtype))
            for k, (o, m) in enumerate(zip(closed.out_avals, masks, strict=True))
        )
        self.diff_out_index = tuple(k for k, s in enumerate(self.out_specs) if s.diff)
        # One real scalar to differentiate (a loss) and a VJP linear in its cotangent:
        # value_and_grad applies, its gradients times a real cotangent being the VJP's.
        self.scalar_loss = len(self.diff_out_index) == 1 and (
            self.out_specs[self.diff_out_index[0]].shape == ()
            and jnp.issubdtype(self.out_specs[self.diff_out_index[0]].dtype, jnp.floating)
            and linear_in_cotangent(closed.jaxpr))
        used = 0
        for m in masks:
            used |= m
        self.reads = tuple(bool(used >> i & 1) for i in range(len(self.specs)))
        self.out_reads = tuple(masks)  # per result, a bitmask of the leaves it depends on
        self.grad_reach = tuple(
            sum(1 << p for p, i in enumerate(self.diff_index) if masks[k] >> i & 1)
            for k in self.diff_out_index
        )
        self._residual_map: ResidualMap | None = None
        self._fwd_res_lowered = None
        self._compiled: dict[str, jax.stages.Compiled] = {}
        self._executables: dict[str, Callable[..., list]] = {}

    # -- compilation -------------------------------------------------------------------
    def _avals(self, specs) -> list:
        """Abstract arguments placed on the program's device."""
        return [aval(s.shape, s.dtype, self.device) for s in specs]

    def _fence_avals(self) -> tuple:
        return (aval((1,), np.uint8, self.device),) if self.fence else ()

    def _lower(self, body: Callable, *avals):
        with compiling_for(self.device):
            return jax.jit(body, keep_unused=self.fence).lower(*avals, *self._fence_avals())

    def _compile(self, body: Callable, *avals):
        lowered = self._lower(body, *avals)
        with compiling_for(self.device):
            return lowered.compile()

    def residual_map(self) -> ResidualMap:
        """The residual map; the first call traces and lowers ``forward_with_residuals``."""
        if self._residual_map is None:
            with self._lock:
                if self._residual_map is None:
                    lowered = self._lower(self._forward_res_body, self._avals(self.specs))
                    self._fwd_res_lowered = lowered
                    self._residual_map = lowered.out_info[1].take()
        return self._residual_map

    def _backward_avals(self, rmap: ResidualMap) -> tuple:
        return (
            self._avals(self.specs[j] for j in rmap.saved_inputs),
            self._avals(self.out_specs[k] for k in rmap.saved_outputs),
            self._avals(rmap.residual_specs),
            self._avals(self.out_specs[k] for k in self.diff_out_index),
        )

    def executable(self, kind: str) -> Callable[..., list]:
        """The executable of one program (``PROGRAMS``), compiled at its first request.

        The torch side keeps what this returns per signature and calls it directly, with
        the arguments of the method of the same name (and the fence, with ``fence=True``);
        it returns the flat list of result arrays.
        """
        exe = self._executables.get(kind)
        if exe is None:
            with self._lock:
                exe = self._executables.get(kind)
                if exe is None:
                    exe = self._executables[kind] = self._callable(kind, self.compiled(kind))
        return exe

    def _callable(self, kind: str, compiled: jax.stages.Compiled) -> Callable[..., list]:
        if kind == "forward_with_residuals":
            # Its results are (arrays, Learned(residual map)), the map as the lowering
            # learned it (``residual_map``); a call takes the arrays.
            return lambda *args: compiled(*args)[0]
        return compiled

    def compiled(self, kind: str) -> jax.stages.Compiled:
        """The XLA executable of one program (for ``memory_analysis``, HLO text)."""
        exe = self._compiled.get(kind)
        if exe is None:
            with self._lock:
                exe = self._compiled.get(kind)
                if exe is None:
                    exe = self._compiled[kind] = self._compile_program(kind)
        return exe

    def _arg_avals(self, kind: str) -> tuple:
        """The abstract arguments of program ``kind`` (the fence aside)."""
        if kind in ("forward", "forward_with_residuals", "value_and_grad"):
            return (self._avals(self.specs),)
        if kind == "backward":
            return self._backward_avals(self.residual_map())
        if kind == "backward_recompute":
            return (self._avals(self.specs),
                    self._avals(self.out_specs[k] for k in self.diff_out_index))
        raise ValueError(f"Program.executable: kind={kind!r} is not one of {PROGRAMS}.")

    def _compile_program(self, kind: str) -> jax.stages.Compiled:
        if kind == "forward_with_residuals":
            self.residual_map()
            with compiling_for(self.device):
                return self._fwd_res_lowered.compile()
        if kind == "value_and_grad":
            internal_assert(self.scalar_loss, f"value_and_grad of {self.name}, no scalar loss")
        avals = self._arg_avals(kind)
        bodies = {"forward": self._forward_body, "backward": self._backward_body,
                  "backward_recompute": self._backward_recompute_body,
                  "value_and_grad": self._value_and_grad_body}
        return self._compile(bodies[kind], *avals)

    # -- calls -------------------------------------------------------------------------
    def forward(self, leaves: Sequence, *fence) -> list[jax.Array]:
        """Outputs (then aux) only: nothing is kept for a backward."""
        return self.executable("forward")(leaves, *fence)

    def forward_with_residuals(self, leaves: Sequence, *fence) -> list[jax.Array]:
        """Outputs, aux, then the residuals the backward needs beyond inputs and outputs.

        One flat list: the first ``len(out_specs)`` are the results, the rest the residual
        buffers (``residual_map().residual_specs``).
        """
        return self.executable("forward_with_residuals")(leaves, *fence)

    def backward(self, saved_inputs, saved_outputs, residuals, cotangents,
                 *fence) -> list[jax.Array]:
        """Gradients of the ``diff`` leaves, packed as ``grad_pack`` says (``unpack``).

        Gradients follow torch's convention for complex leaves.

        Args:
            saved_inputs: the input leaves at ``residual_map().saved_inputs``, passed again.
            saved_outputs: the results at ``residual_map().saved_outputs``.
            residuals: the residual buffers ``forward_with_residuals`` returned.
            cotangents: one per differentiable output (``diff_out_index``).
            *fence: the ordering array, with ``fence=True``.
        """
        return self.executable("backward")(saved_inputs, saved_outputs, residuals,
                                           cotangents, *fence)

    def backward_recompute(self, leaves: Sequence, cotangents: Sequence,
                           *fence) -> list[jax.Array]:
        """Gradient buffers (``grad_pack``), rerunning the forward inside one program.

        Like ``torch.utils.checkpoint`` around the whole block: nothing but the inputs is
        held between ``forward`` and this call.
        """
        return self.executable("backward_recompute")(leaves, cotangents, *fence)
