"""One signature's entry: what running its programs needs, fixed when it is built.

Step 4 and the backward of NOTE [Call path] (``_call.py``). An ``Entry`` keeps what its
signature fixes: the programs' executables (fetched from ``flaxside.Program`` at first use,
so that a cached call runs no flaxside code), the order of its leaves, what its backward
reads (``SavedLayout``), how gradients are viewed out of packed buffers. The eager
``BridgeFunction`` and the ``torch.compile`` ops both run it.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

import bridge
from bridge.internal import HeldArrays, check_memory
from flaxside.internal import SpmdProgram
from torchside import _errors

# How a call runs its programs (``Entry.route``):
# "plain"      no backward: ``forward`` only (no grad wanted, or none possible);
# "residuals"  ``forward_with_residuals``, then ``backward`` from what it saved;
# "recompute"  ``forward``, saving the inputs; ``backward_recompute`` reruns the forward;
# "fused"      a scalar loss, eagerly: ``value_and_grad``, whose gradients the backward
#              scales (NOTE [Scalar loss] in ``_function.py``). Compiled calls of such an
#              entry take "residuals".
ROUTES = ("plain", "residuals", "recompute", "fused")
_FORWARD_PROGRAM = {"plain": "forward", "residuals": "forward_with_residuals",
                    "recompute": "forward", "fused": "value_and_grad"}


class SavedLayout(NamedTuple):
    """What ``save_for_backward`` saves, in order, and how the backward reads it back.

    The saved tensors are ``inputs | outputs | residuals``: the leaves at ``inputs``, the
    results at ``outputs``, then the residual buffers. ``residuals="recompute"`` saves
    every leaf as an input, and nothing else.

    Attributes:
        inputs: the leaf indices passed to the backward again.
        outputs: the result indices passed to the backward again.
        offloaded: per residual buffer, whether a remat policy put it in host memory.
    """

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    offloaded: tuple[bool, ...]

    def select(self, leaves, results, residuals) -> list:
        """The tensors to save, in this layout's order."""
        return [*(leaves[j] for j in self.inputs), *(results[k] for k in self.outputs),
                *residuals]

    def split(self, saved) -> tuple:
        """``(inputs, outputs, residuals)`` of what was saved."""
        a, b = len(self.inputs), len(self.inputs) + len(self.outputs)
        return saved[:a], saved[a:b], saved[b:]


class Reusable(NamedTuple):
    """A JAX array a forward made, for its backward to reuse while its tensor is unchanged."""

    array: weakref.ref
    pointer: int


class Forward(NamedTuple):
    """What ``Entry.forward`` returns.

    Attributes:
        results: the outputs, then the state updates, as tensors.
        extra: the tensors the backward needs besides leaves and results: the residual
            buffers (route ``"residuals"``) or the gradient buffers (``"fused"``).
        route: the route that ran (``ROUTES``).
        reuse: per saved output and residual buffer (``SavedLayout``), a ``Reusable`` or
            ``None`` (offloaded), for route ``"residuals"``; else ``None``.
        pending: with ``wait=False``, the arrays to ``exchange.wait`` for before anything
            reads the tensors; else empty.
    """

    results: list
    extra: list
    route: str
    reuse: tuple | None
    pending: list


def apply_write_back(write_back, wb, results, n_out: int) -> None:
    """Step 5 of NOTE [Call path], on both routes: hands the owner a call's updates.

    ``write_back``: the owner's (``None``: it keeps no state); ``wb``: the entry's
    ``flaxside.internal.WriteBack``; the updates follow the ``n_out`` outputs in ``results``.
    """
    if write_back is not None and (wb.targets or wb.graph is not None):
        write_back(wb, results[n_out : n_out + len(wb.targets)])


class Entry:
    """One signature's programs and what a call of them needs, fixed when built.

    Attributes:
        program: the ``flaxside`` programs (``program.write_back``: which variables the
            updates replace, and the NNX graph after the call).
        exchange: how tensors cross (``bridge.internal.exchange_for``).
        recompute: ``residuals="recompute"``.
        fuses: a grad-enabled eager call runs ``value_and_grad`` (``residuals="save"`` and a
            scalar loss; NOTE [Scalar loss]).
        names, n_vars, n_state, device, narrow: as ``_build.Built`` has them.
        has_rng: whether the owner has RNG streams (a leaf after the variables).
        rng_used: whether the programs read the RNG leaf (else no key is drawn).
        nondiff_out: results torch treats as non-differentiable (ints, updates, outputs that
            depend on no differentiated leaf).
        grad_slots: per gradient (``program.diff_index`` order), the leaf it belongs to.
        key: a small int naming the entry inside its caller (``torch.compile``'s ops).
        sharded: the programs are SPMD over torch's ranks (NOTE [Sharded blocks]).
    """

    __slots__ = ("program", "exchange", "recompute", "fuses", "names", "n_vars", "n_state",
                 "device", "narrow", "has_rng", "rng_used", "write_back", "n_out",
                 "n_results", "out_treedef", "nondiff_out", "diff_out_index", "grad_slots",
                 "key", "sharded", "derived", "_executables", "_saved", "_kept", "_zero_cots",
                 "_unreached", "_rng_zeros", "_unpack")

    def __init__(self, built, exchange, residuals: str, key: int):
        program = built.program
        self.program = program
        self.exchange = exchange
        self.recompute = residuals == "recompute"
        self.fuses = residuals == "save" and program.scalar_loss
        self.names, self.n_vars, self.n_state = built.names, built.n_vars, built.n_state
        self.device = built.device
        self.narrow = frozenset(built.narrow)
        self.has_rng = self.n_state > self.n_vars
        self.rng_used = self.has_rng and program.reads[self.n_vars]
        self.write_back = program.write_back
        self.n_out = program.n_out
        self.n_results = len(program.out_specs)
        self.out_treedef = program.out_treedef
        self.nondiff_out = tuple(k for k, s in enumerate(program.out_specs) if not s.diff)
        self.diff_out_index = program.diff_out_index
        self.grad_slots = program.diff_index
        self.key = key
        self.sharded = isinstance(program, SpmdProgram)
        self._executables: dict[str, Any] = {}
        self.derived: dict[tuple, Any] = {}  # NOTE [Higher order]: callers of derivatives
        self._saved: SavedLayout | None = None
        self._kept: dict[str, tuple[int, ...]] = {}
        self._zero_cots: dict[int, Any] = {}
        self._unreached: dict[tuple, frozenset] = {}
        self._rng_zeros = None
        self._unpack = built.unpack

    def route(self, fuse: bool) -> str:
        """The route a call takes (``ROUTES``); ``fuse``: eager, which may fuse."""
        if not self.grad_slots:
            return "plain"
        if self.recompute:
            return "recompute"
        return "fused" if fuse and self.fuses else "residuals"

    def run(self, kind: str, *args, wait: bool = True) -> tuple[list, list[torch.Tensor]]:
        """Runs program ``kind`` through the exchange: its result arrays and tensors.

        ``wait=False``: see the exchange's ``run``; ``self.exchange.wait`` the arrays.
        """
        exe = self._executables.get(kind)
        if exe is None:  # compiled at the first call that needs it, then kept here
            exe = self._executables[kind] = self.program.executable(kind)
        return self.exchange.run(kind, exe, *args, wait=wait)

    @property
    def saved(self) -> SavedLayout:
        """What the backward reads (lowering ``forward_with_residuals`` at first use)."""
        saved = self._saved
        if saved is None:
            if self.recompute:
                saved = SavedLayout(tuple(range(len(self.names))), (), ())
            else:
                rmap = self.program.residual_map()
                saved = SavedLayout(rmap.saved_inputs, rmap.saved_outputs, rmap.offloaded)
            self._saved = saved
        return saved

    def kept(self, route: str) -> tuple[int, ...]:
        """Leaves the forward saves besides what its first-order backward reads.

        A derivative of the backward reads every leaf (NOTE [Higher order] in
        ``_higher.py``); state the owner overwrites after the forward is not saved.
        """
        kept = self._kept.get(route)
        if kept is None:
            skip = set(self.write_back.targets)
            if route == "residuals":
                skip.update(self.saved.inputs)
            kept = () if route == "recompute" else tuple(
                i for i in range(len(self.names)) if i not in skip)
            self._kept[route] = kept
        return kept

    def all_leaves(self, route: str, saved, kept, state: dict) -> list:
        """Every leaf for a derivative of the backward: saved, kept, then current state."""
        if route == "recompute":
            return list(saved)
        leaves = [None] * len(self.names)
        if route == "residuals":
            for j, t in zip(self.saved.inputs, saved, strict=False):
                leaves[j] = t
        for i, t in zip(self.kept(route), kept, strict=True):
            leaves[i] = t
        for i, t in state.items():
            leaves[i] = t
        return leaves

    def reads_overwritten_state(self) -> str | None:
        """The name of a written-back state leaf a differentiable output depends on."""
        for i in self.write_back.targets:
            if any(self.program.out_reads[k] >> i & 1 for k in self.diff_out_index):
                return self.names[i]
        return None

    # -- leaves ------------------------------------------------------------------------------
    def leaves(self, variables, rng, tensors) -> list:
        """Every leaf in the programs' order: the variables, the RNG leaf, the arguments."""
        return [*variables, rng, *tensors] if self.has_rng else [*variables, *tensors]

    def without_rng(self, per_leaf: list) -> list:
        """``per_leaf`` (one item per leaf) without the RNG leaf's item."""
        if self.has_rng:
            del per_leaf[self.n_vars]
        return per_leaf

    def rng(self, shape, draw: bool = True) -> torch.Tensor:
        """The RNG leaf: fresh key data from torch's generator if the programs read it.

        From torch's default generator: ``torch.manual_seed`` reproduces a run, and
        ``torch.utils.checkpoint``'s RNG-state replay reproduces the key on recompute. An
        eval-mode forward that uses no stream draws nothing (validation does not shift the
        training stream); neither does a call that does not run (``draw=False``).
        """
        if self.rng_used and draw:
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
            raise _errors.for_owner(e, self.program.name) from None

    def program_arrays(self, state_arrays: list, leaves) -> list:
        """Every leaf's array: the state's (held), then views of the arguments."""
        view = self.exchange.view
        try:
            if not self.narrow:
                return state_arrays + [view(t) for t in leaves[self.n_state :]]
            return state_arrays + [self.narrowed(j, t) if j in self.narrow else view(t)
                                   for j, t in enumerate(leaves[self.n_state :], self.n_state)]
        except TypeError:  # a tensor subclass without memory (a DTensor): name it
            for j, t in enumerate(leaves[self.n_state :], self.n_state):
                try:
                    check_memory(t, f"the argument '{self.names[j]}'")
                except TypeError as e:
                    raise _errors.for_owner(e, self.program.name) from None
            raise

    # -- forward -----------------------------------------------------------------------------
    def forward(self, state_arrays: list, leaves, fuse: bool = False, wait: bool = True,
                plain: bool = False) -> Forward:
        """Runs the forward program of this call's route (``route(fuse)``).

        ``plain``: the plain forward whatever the route (its backward recomputes).
        """
        arrays = self.program_arrays(state_arrays, leaves)
        route = "plain" if plain else self.route(fuse)
        out, tensors = self.run(_FORWARD_PROGRAM[route], arrays, wait=wait)
        pending = [] if wait else out
        n = self.n_results
        if route != "residuals":
            return Forward(tensors[:n], tensors[n:], route, None, pending)
        saved = self.saved
        # Offloaded residuals live in host memory, which the backward program does not take.
        kept = [out[k] for k in saved.outputs] + list(out[n:])
        skip = (False,) * len(saved.outputs) + saved.offloaded
        reuse = tuple(None if off else Reusable(weakref.ref(a), a.unsafe_buffer_pointer())
                      for a, off in zip(kept, skip, strict=True))
        return Forward(tensors[:n], tensors[n:], route, reuse, pending)

    # -- backward ----------------------------------------------------------------------------
    def zero_cotangent(self, k: int):
        """The cotangent of output ``k`` when torch has none, made once (JAX never writes it)."""
        zero = self._zero_cots.get(k)
        if zero is None:
            spec = self.program.out_specs[k]
            zero = self._zero_cots[k] = self.exchange.view(torch.zeros(
                spec.shape, dtype=bridge.torch_dtype(spec.dtype), device=self.device))
        return zero

    def saved_arrays(self, held: HeldArrays, saved, reuse) -> tuple[list, list, list]:
        """Arrays for what was saved (``SavedLayout.split``), reusing what is unchanged.

        ``reuse``: ``Forward.reuse`` (``None``: nothing to reuse).
        """
        exchange, n_vars, narrow = self.exchange, self.n_vars, self.narrow
        layout = self.saved
        inputs, outputs, residuals = layout.split(saved)

        def view(j, t):
            if j < n_vars:
                return held.get(j, t, exchange)
            # Saved as given (int64); its values were checked by the forward, and torch's
            # version counter refuses an in-place change in between.
            return self.narrowed(j, t, check=False) if j in narrow else exchange.view(t)

        in_arrays = [view(j, t) for j, t in zip(layout.inputs, inputs, strict=True)]
        rest = [*outputs, *residuals]
        if reuse is None:
            arrays = [exchange.view(t) for t in rest]
        else:
            arrays = []
            for t, r in zip(rest, reuse, strict=True):
                array = None if r is None else r.array()
                # The array the forward made, unless a saved-tensor hook replaced the tensor.
                arrays.append(array if array is not None and t.data_ptr() == r.pointer
                              else exchange.view(t))
        return in_arrays, arrays[: len(outputs)], arrays[len(outputs) :]

    def backward(self, held: HeldArrays, saved, reuse, cots,
                 wait: bool = True) -> tuple[list[torch.Tensor], list]:
        """The gradient buffers (``program.grad_pack``) of one call, and ``pending``.

        Args:
            held: the owner's held arrays (the variables' arrays are reused).
            saved: what ``save_for_backward`` saved, as torch unpacked it.
            reuse: ``Forward.reuse`` of the call, or ``None``.
            cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
            wait: as for ``forward``; ``pending`` is empty when it waited.
        """
        view = self.exchange.view
        cots = [self.zero_cotangent(k) if g is None else view(g)
                for k, g in zip(self.diff_out_index, cots, strict=True)]
        inputs, outputs, residuals = self.saved_arrays(held, saved, reuse)
        if self.recompute:
            out, tensors = self.run("backward_recompute", inputs, cots, wait=wait)
        else:
            out, tensors = self.run("backward", inputs, outputs, residuals, cots, wait=wait)
        return tensors, [] if wait else out

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
