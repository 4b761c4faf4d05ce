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

Every executable is lowered where the program's ``placement`` says (NOTE [Placement] in
``_placement.py``): one device (``OnDevice``; its arguments are placed there and its
results come back there, whatever JAX's default device is) or a mesh of processes
(``OnMesh``). The traced bodies (``_traced_bodies.py``) are the same for both.

Small gradients leave the backward packed, one buffer per dtype (``grad_pack``), as small
residuals leave the forward: a call then costs per buffer, not per parameter.

What the first trace of ``forward_with_residuals`` learns (which VJP leaf is an input, an
output or a true residual, how residuals are packed) is returned as one frozen
``ResidualMap``; see ``flaxside/README.md``. Gradients follow torch's convention for
complex leaves (the conjugate of JAX's), since the caller hands them to torch.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxside.program._conventions import internal_assert
from flaxside.program._depends import input_masks, linear_in_cotangent
from flaxside.program._one_device import OnDevice
from flaxside.program._pack import Alone
from flaxside.program._placement import local_spec, placed
from flaxside.program._specs import Carrying, LeafSpec, Learned, ResidualMap, is_differentiable
from flaxside.program._traced_bodies import Structure, TracedBodies

jtu = jax.tree_util

PROGRAMS = ("forward", "forward_with_residuals", "backward", "backward_recompute",
            "value_and_grad")
_FENCE = LeafSpec((1,), np.dtype(np.uint8))


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
        specs: one ``LeafSpec`` per leaf, as the caller passes it (over a mesh: this
            process's shard); ``diff`` marks the leaves to differentiate.
        placement: where it runs: ``OnDevice(device)`` (the default, ``OnDevice(None)``,
            leaves placement to JAX's default device, as a plain ``jax.jit`` would) or
            ``OnMesh(...)`` (NOTE [Placement]).
        name: used in error messages.
        fence: every program takes one more array after its arguments and waits until it
            is ready (see ``bridge``'s ordering note); kept even though nothing reads it.

    Attributes:
        specs: the leaves as the caller passes them.
        out_specs: one ``LeafSpec`` per output then aux leaf, as the caller receives it;
            ``diff`` marks the outputs that depend on a differentiated leaf (the only ones
            that take a cotangent).
        n_out: how many of ``out_specs`` are outputs (the rest are aux).
        out_treedef: the structure of the outputs.
        write_back: the ``write_back`` value ``fn`` returned (``flaxside.internal.WriteBack``
            for the torch side: which variables the aux replace, the NNX graph after).
        reads: per leaf, whether any result depends on it.
        out_reads: per result, a bitmask over leaves of those it depends on.
        grad_pack: where each gradient (``diff_index`` order) sits in what the backward
            programs return (``Alone`` or ``Packed``): small gradients leave packed, one
            buffer per dtype, and ``unpack`` (or views on the torch side) recovers them.
        grad_specs: the buffers the backward programs return.
        grad_reach: per differentiable output (``diff_out_index`` order), a bitmask over
            ``diff_index`` positions of the leaves it depends on.

    Example:
        >>> fn = lambda xs: (xs[0] * xs[1], [], None)
        >>> p = Program(fn, [LeafSpec((2,), np.float32, True)] * 2)
        >>> out, *res = p.forward_with_residuals([np.ones(2, np.float32)] * 2)
    """

    def __init__(self, fn: Callable, specs: Sequence[LeafSpec], *, placement=None,
                 name: str = "program", fence: bool = False):
        self.fn = fn
        self.name = name
        self.fence = fence
        # NOTE [Precision of a program]. JAX's matmul precision (jax.config's value, or
        # jax.default_matmul_precision's in this thread) is read once, here, where the
        # program is built for its first call; every body is traced at it. Its context
        # manager is thread-local and torch runs a CUDA backward on a thread of its own:
        # read there, a backward compiled at its first use (or a derived program built
        # in it) would compute at another precision than the forward it differentiates.
        # A program keeps it: calls of the same signature later, at another precision,
        # reuse the program (as a jitted function's cache would not).
        self.precision = jax.config.jax_default_matmul_precision
        self.placement = placement = OnDevice() if placement is None else placement
        self.specs = tuple(specs)
        placed_by = placement.leaf_specs(len(self.specs))
        # What the bodies trace (over a mesh, global shapes) and where each leaf lives.
        self._traced_specs = tuple(placement.traced(s, p)
                                   for s, p in zip(self.specs, placed_by, strict=True))
        self._in_shardings = tuple(placement.sharding(p) for p in placed_by)
        self.diff_index = tuple(i for i, s in enumerate(self.specs) if s.diff)
        self.grad_pack, buffers = placement.pack_plan(
            [self._traced_specs[i] for i in self.diff_index])
        grad_traced = tuple(LeafSpec(shape, dtype) for shape, dtype in buffers)
        # A buffer of its own has its leaf's sharding; a packed buffer is on the one device.
        alone = {entry.buffer: self._in_shardings[i] for entry, i in
                 zip(self.grad_pack, self.diff_index, strict=True) if type(entry) is Alone}
        self._grad_shardings = tuple(alone[b] if b in alone else placement.sharding()
                                     for b in range(len(grad_traced)))
        self.grad_specs = tuple(local_spec(s, sh) for s, sh in
                                zip(grad_traced, self._grad_shardings, strict=True))
        self.trace_count = 0
        self._lock = threading.RLock()  # compiling the backward asks for the residual map

        unreduced: list = []  # NOTE [Mixed precision]: leaves no per-rank stack summed

        def abstract(leaves):
            results, structure = self._results(leaves, unreduced)
            return results, Learned(structure)

        with placement.compiling():  # code traced inside may compile for the device
            closed, (_, learned) = jax.make_jaxpr(abstract, return_shape=True)(
                [s.aval for s in self._traced_specs])
        self._structure: Structure = learned.take()
        self.out_treedef = self._structure.out_treedef
        self.n_out = self._structure.n_out
        self.write_back = self._structure.write_back
        masks = input_masks(closed.jaxpr)
        diff_bits = sum(1 << i for i in self.diff_index)
        self._traced_out = tuple(
            LeafSpec(tuple(o.shape), np.dtype(o.dtype),
                     k < self.n_out and bool(m & diff_bits) and is_differentiable(o.dtype))
            for k, (o, m) in enumerate(zip(closed.out_avals, masks, strict=True))
        )
        out_placed = placement.result_specs(self._traced_out, self.n_out, self._traced_specs)
        self._out_shardings = tuple(placement.sharding(p) for p in out_placed)
        self.out_specs = tuple(local_spec(s, sh) for s, sh in
                               zip(self._traced_out, self._out_shardings, strict=True))
        self.diff_out_index = tuple(k for k, s in enumerate(self.out_specs) if s.diff)
        self._sharded_diff_outputs = tuple(out_placed[k] is not None for k in self.diff_out_index)
        # Whether the VJP is linear in its cotangent (no custom_vjp rule, no float16):
        # scaled after (NOTE [Scalar loss]) or linearized once (NOTE [Shared linearization]).
        self.linear_vjp = linear_in_cotangent(closed.jaxpr)
        # One real scalar to differentiate (a loss) and a VJP linear in its cotangent:
        # value_and_grad applies, its gradients times a real cotangent being the VJP's.
        self.scalar_loss = len(self.diff_out_index) == 1 and (
            self.out_specs[self.diff_out_index[0]].shape == ()
            and jnp.issubdtype(self.out_specs[self.diff_out_index[0]].dtype, jnp.floating)
            and self.linear_vjp)
        used = 0
        for m in masks:
            used |= m
        self.reads = tuple(bool(used >> i & 1) for i in range(len(self.specs)))
        placement.check_reduced(closed.jaxpr, unreduced, [
            s.diff and r for s, r in zip(self.specs, self.reads, strict=True)])
        self.out_reads = tuple(masks)  # per result, a bitmask of the leaves it depends on
        self.grad_reach = tuple(
            sum(1 << p for p, i in enumerate(self.diff_index) if masks[k] >> i & 1)
            for k in self.diff_out_index
        )
        self._residual_map: ResidualMap | None = None
        self._residual_avals: tuple = ()
        self._compiled: dict[str, jax.stages.Compiled] = {}
        self._executables: dict[str, Callable[..., list]] = {}

    # -- compilation -------------------------------------------------------------------
    def _placed(self, specs, shardings) -> list:
        return [placed(s, sh) for s, sh in zip(specs, shardings, strict=True)]

    def _fence_avals(self) -> tuple:
        return (placed(_FENCE, self.placement.sharding()),) if self.fence else ()

    def _lower(self, body: Callable, *avals):
        with self.placement.compiling():
            return jax.jit(body, keep_unused=self.fence).lower(*avals, *self._fence_avals())

    def _compile(self, lowered) -> jax.stages.Compiled:
        with self.placement.compiling():
            return lowered.compile()

    def residual_map(self) -> ResidualMap:
        """The residual map; the first call traces, lowers and compiles the forward with them.

        Its ``residual_specs`` are what the caller receives (over a mesh, the shards of
        the partitioner's choice, known once the forward is compiled).
        """
        if self._residual_map is None:
            with self._lock:
                if self._residual_map is None:
                    in_avals = self._placed(self._traced_specs, self._in_shardings)
                    lowered = self._lower(self._forward_res_body, in_avals)
                    rmap = Carrying.learned_by(lowered).take()
                    compiled = self._compile(lowered)
                    traced = rmap.residual_specs
                    shardings = self.placement.residual_shardings(
                        compiled, len(self.out_specs), len(traced))
                    self._residual_avals = tuple(self._placed(traced, shardings))
                    self._compiled["forward_with_residuals"] = compiled
                    self._residual_map = dataclasses.replace(rmap, residual_specs=tuple(
                        local_spec(s, sh) for s, sh in zip(traced, shardings, strict=True)))
        return self._residual_map

    def _arg_avals(self, kind: str) -> tuple:
        """The abstract arguments of program ``kind`` (the fence aside)."""
        leaves = self._placed(self._traced_specs, self._in_shardings)
        cotangents = [placed(self._traced_out[k], self._out_shardings[k])
                      for k in self.diff_out_index]
        if kind in ("forward", "forward_with_residuals", "value_and_grad"):
            return (leaves,)
        if kind == "backward":
            rmap = self.residual_map()
            return ([leaves[j] for j in rmap.saved_inputs],
                    [placed(self._traced_out[k], self._out_shardings[k])
                     for k in rmap.saved_outputs],
                    list(self._residual_avals), cotangents)
        if kind == "backward_recompute":
            return (leaves, cotangents)
        raise ValueError(f"Program.executable: kind={kind!r} is not one of {PROGRAMS}.")

    def executable(self, kind: str) -> Callable[..., list]:
        """The executable of one program (``PROGRAMS``), compiled at its first request.

        The torch side keeps what this returns per signature and calls it directly, with
        the arguments of the method of the same name (and the fence, with ``fence=True``);
        it returns the flat list of result arrays. On one device it is the compiled
        program itself: a call runs no code of ours.
        """
        exe = self._executables.get(kind)
        if exe is None:
            with self._lock:
                exe = self._executables.get(kind)
                if exe is None:
                    compiled = self.compiled(kind)
                    exe = self._executables[kind] = self.placement.executable(
                        compiled, (self._arg_avals(kind), self._fence_avals()))
        return exe

    def compiled(self, kind: str) -> jax.stages.Compiled:
        """The XLA executable of one program (for ``memory_analysis``, HLO text)."""
        exe = self._compiled.get(kind)
        if exe is None:
            with self._lock:
                exe = self._compiled.get(kind)
                if exe is None:
                    exe = self._compiled[kind] = self._compile_program(kind)
        return exe

    def _compile_program(self, kind: str) -> jax.stages.Compiled:
        if kind == "forward_with_residuals":
            self.residual_map()  # compiles it
            return self._compiled[kind]
        if kind == "value_and_grad":
            internal_assert(self.scalar_loss, f"value_and_grad of {self.name}, no scalar loss")
        avals = self._arg_avals(kind)
        bodies = {"forward": self._forward_body, "backward": self._backward_body,
                  "backward_recompute": self._backward_recompute_body,
                  "value_and_grad": self._value_and_grad_body}
        return self._compile(self._lower(bodies[kind], *avals))

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
