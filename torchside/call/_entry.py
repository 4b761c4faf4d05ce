"""One signature's entry: its programs, run through the exchange.

Step 4, step 5 and the backward of NOTE [Call path] (``_call.py``). An ``Entry`` keeps what
its signature fixes (its ``Layout``, ``Route``s and ``Holds``: ``_values.py``) and runs its
first-order programs: the executables, fetched from ``flaxside.Program`` at first use and
then called directly through the exchange (on one device an executable is the compiled
program itself, so a cached call runs no ``flaxside`` code), how gradients are viewed out of
packed buffers. The eager edge (``BridgeFunction``, ``_eager.py``) and the
``torch.compile`` ops (``edges/_compile.py``) run the same entry, and derivatives of a call are
calls above it (NOTE [Higher order] in ``edges/_higher.py``), reached through the owner's
``Edges``.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import NamedTuple

import torch

import bridge
from bridge.internal import HeldArrays, check_memory, own_arrays
from torchside import _errors
from torchside.call._routes import RECOMPUTE, RESIDUALS, Holds, Route

# ``tuple.__new__(Cls, values)`` makes a NamedTuple in C; ``Cls(...)`` runs its Python
# ``__new__`` first (a call more, on the per-call path).
_new = tuple.__new__


class Reusable(NamedTuple):
    """A JAX array a forward made, for its backward to reuse while its tensor is unchanged."""

    array: weakref.ref
    pointer: int


class Forward(NamedTuple):
    """What ``Entry.forward`` returns.

    Attributes:
        results: the outputs, then the state updates, as tensors.
        buffers: the program buffers torch saves (``Holds.buffers``): residuals or
            gradients.
        reuse: per saved output and buffer, a ``Reusable`` or ``None`` (offloaded), on the
            ``RESIDUALS`` route; else ``None``.
        pending: the arrays to ``exchange.wait`` for before anything reads the tensors.
    """

    results: list
    buffers: list
    reuse: tuple | None
    pending: list


def apply_write_back(write_back, wb, results, n_out: int) -> None:
    """Step 5 of NOTE [Call path], on every edge: hands the owner a call's updates.

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
        layout: the order of the leaves (NOTE [Leaves]).
        routes: per edge, its ``Route`` (NOTE [Routes]).
        holds: per route's ``programs``, its ``Holds``, made when its forward is first run.
        rng_read: whether the programs read the RNG slot (else no key is drawn).
        nondiff_out: results torch treats as non-differentiable (ints, updates, outputs that
            depend on no differentiated leaf).
        grad_slots: per gradient (``program.diff_index`` order), the leaf it belongs to.
        views: how gradients are viewed out of the backward's buffers (``GradientViews``).
        key: a small int naming the entry inside its caller (``torch.compile``'s ops).
        derived: what the layer of derivatives makes of this entry, by kind, when first
            asked (its VJP's and JVP's owners, shared linearizations, given residuals:
            ``torchside/edges/_derived.py``); freed with the entry.
    """

    __slots__ = ("program", "exchange", "layout", "routes", "holds", "rng_read",
                 "write_back", "n_out", "n_results", "out_treedef", "nondiff_out",
                 "diff_out_index", "grad_slots", "views", "key", "writes_back", "_executables",
                 "_zero_cots", "_unreached", "_splits", "derived", "__weakref__")

    def __init__(self, program, exchange, layout, views, routes: dict, key: int):
        self.program = program
        self.exchange = exchange
        self.layout = layout
        self.views = views
        self.routes = routes
        self.holds: dict[str, Holds] = {}
        self.rng_read = layout.rng is not None and program.reads[layout.rng]
        self.write_back = wb = program.write_back
        self.writes_back = bool(wb.targets or wb.graph is not None)  # apply_write_back's test
        self.n_out = program.n_out
        self.n_results = len(program.out_specs)
        self.out_treedef = program.out_treedef
        self.nondiff_out = tuple(k for k, s in enumerate(program.out_specs) if not s.diff)
        self.diff_out_index = program.diff_out_index
        self.grad_slots = program.diff_index
        self.key = key
        self._executables: dict = {}
        self._zero_cots: dict = {}
        self._unreached: dict = {}
        self._splits: dict = {}
        self.derived: dict = {}

    def holding(self, route: Route) -> Holds:
        """What a call on ``route`` holds (lowering ``forward_with_residuals`` if needed)."""
        try:  # (a subscript, not .get: no call on the per-call path)
            return self.holds[route.programs]
        except KeyError:
            holds = self.holds[route.programs] = Holds.of(route.programs, self.program,
                                                          self.layout)
        return holds

    def saved_split(self, holds: Holds) -> tuple:
        """Where ``holds.inputs`` has variables and where arguments: ``(at, slots)`` of each."""
        try:
            return self._splits[holds.inputs]
        except KeyError:
            split = None
        if split is None:
            stop = self.layout.variables.stop
            var = [(k, j) for k, j in enumerate(holds.inputs) if j < stop]
            arg = [(k, j) for k, j in enumerate(holds.inputs) if j >= stop]
            split = self._splits[holds.inputs] = (
                tuple(k for k, _ in var), tuple(j for _, j in var), tuple(k for k, _ in arg),
                tuple(j for _, j in arg))
        return split

    def run(self, kind: str, *args) -> tuple[list, list[torch.Tensor]]:
        """Runs program ``kind`` through the exchange: its result arrays and tensors.

        Returns before JAX has computed them: ``exchange.wait`` the arrays before anything
        reads the tensors. Every program run of an entry goes through here (tests count
        them by wrapping it: ``tests/support/pipeline.py``).
        """
        try:
            exe, templates = self._executables[kind]
        except KeyError:
            exe, templates = self.executable(kind)
        return self.exchange.run(kind, exe, templates, *args)

    def executable(self, kind: str) -> tuple:
        """Program ``kind``'s executable and its results' templates (``exchange.templates``).

        Compiled at the first call that needs it, then kept in ``_executables``.
        """
        exe = self._executables[kind] = (self.program.executable(kind),
                                         self.exchange.templates(self._results_of(kind)))
        return exe

    def _results_of(self, kind: str) -> tuple:
        """The specs of what program ``kind`` returns (``flaxside``'s ``PROGRAMS``)."""
        program = self.program
        if kind == "forward":
            return program.out_specs
        if kind == "forward_with_residuals":
            return (*program.out_specs, *program.residual_map().residual_specs)
        if kind == "value_and_grad":
            return (*program.out_specs, *program.grad_specs)
        return program.grad_specs  # backward, backward_recompute

    def narrowed(self, j: int, tensor: torch.Tensor):
        """What the program takes for argument leaf ``j`` (int64) as int32.

        Raises naming the leaf if a value does not fit.
        """
        try:
            return self.exchange.narrowed(tensor, self.layout.names[j])
        except TypeError as e:
            raise _errors.for_owner(e, self.program.name) from None

    def program_arrays(self, state_arrays: list, leaves) -> list:
        """Every leaf's array: the state's (held), then views of the arguments."""
        view, layout = self.exchange.view, self.layout
        arguments = layout.arguments
        try:
            if not layout.narrow:
                return [*state_arrays, *map(view, leaves[arguments])]
            return state_arrays + [self.narrowed(j, t) if j in layout.narrow else view(t)
                                   for j, t in enumerate(leaves[arguments], arguments.start)]
        except TypeError:  # a tensor subclass without memory (a DTensor): name it
            for j, t in enumerate(leaves[arguments], arguments.start):
                try:
                    check_memory(t, f"the argument '{layout.names[j]}'")
                except TypeError as e:
                    raise _errors.for_owner(e, self.program.name) from None
            raise

    # -- forward -----------------------------------------------------------------------------
    def forward(self, state_arrays: list, leaves, route: Route, holds: Holds | None = None
                ) -> Forward:
        """Runs the forward program of ``route``; returns while JAX computes (``pending``).

        ``holds``: the route's ``Holds``, where the caller has it already.
        """
        out, tensors = self.run(route.forward, self.program_arrays(state_arrays, leaves))
        n = self.n_results
        if route.programs is not RESIDUALS:
            return _new(Forward, (tensors[:n], tensors[n:], None, out))
        if holds is None:
            holds = self.holding(route)
        # Offloaded residuals live in host memory, which the backward program does not take.
        # (``map(seq.__getitem__, index)``: in C, no Python call per item, on this path.)
        kept = [*map(out.__getitem__, holds.outputs), *out[n:]]
        skip = (False,) * len(holds.outputs) + holds.offloaded
        if self.exchange.dlpack:
            own_arrays([tensors[k] for k in holds.outputs] + tensors[n:], kept)
        reuse = tuple([None if off else _new(Reusable, (weakref.ref(a), a.unsafe_buffer_pointer()))
                       for a, off in zip(kept, skip, strict=True)])
        return _new(Forward, (tensors[:n], tensors[n:], reuse, out))

    # -- backward ----------------------------------------------------------------------------
    def zero_cotangent(self, k: int):
        """The cotangent of output ``k`` when torch has none, made once (JAX never writes it)."""
        zero = self._zero_cots.get(k)
        if zero is None:
            spec = self.program.out_specs[k]
            zero = self._zero_cots[k] = self.exchange.view(torch.zeros(
                spec.shape, dtype=bridge.torch_dtype(spec.dtype),
                device=self.exchange.torch_device))
        return zero

    def saved_arrays(self, held: HeldArrays, holds: Holds, saved, reuse) -> tuple:
        """Arrays for what was saved (``holds``), reusing what is unchanged.

        ``reuse``: ``Forward.reuse`` (``None``: nothing to reuse).
        """
        exchange, narrow = self.exchange, self.layout.narrow
        a, b = holds.bounds
        try:  # self.saved_split(holds), written out: no call once made
            held_at, held_slots, other_at, other_slots = self._splits[holds.inputs]
        except KeyError:
            held_at, held_slots, other_at, other_slots = self.saved_split(holds)
        inputs = [None] * a
        # The variables' held arrays, all compared at once (NOTE [Held arrays per call]).
        for k, array in zip(held_at, held.gather(held_slots, list(map(saved.__getitem__,
                                                                      held_at)), exchange),
                            strict=True):
            inputs[k] = array
        for k, j in zip(other_at, other_slots, strict=True):
            # Saved as given (int64); its values were checked by the forward, and torch's
            # version counter refuses an in-place change in between.
            inputs[k] = (exchange.narrowed_again(saved[k]) if j in narrow
                         else exchange.view(saved[k]))
        rest = saved[a:]
        if reuse is None:
            arrays = [exchange.view(t) for t in rest]
        else:
            arrays = []
            for t, r in zip(rest, reuse, strict=True):
                array = None if r is None else r.array()
                # The array the forward made, unless a saved-tensor hook replaced the tensor.
                arrays.append(array if array is not None and t.data_ptr() == r.pointer
                              else exchange.view(t))
        return inputs, arrays[: b - a], arrays[b - a :]

    def backward(self, held: HeldArrays, route: Route, saved, reuse, cots,
                 holds: Holds | None = None) -> tuple:
        """The gradient buffers (``program.grad_pack``) of one call, and ``pending``.

        Args:
            held: the owner's held arrays (the variables' arrays are reused).
            route: the call's route.
            saved: what ``save`` saved, as torch unpacked it.
            reuse: ``Forward.reuse`` of the call, or ``None``.
            cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
            holds: the route's ``Holds``, where the caller has it already.
        """
        view = self.exchange.view
        cots = [self.zero_cotangent(k) if g is None else view(g)
                for k, g in zip(self.diff_out_index, cots, strict=True)]
        if holds is None:
            holds = self.holding(route)
        inputs, outputs, buffers = self.saved_arrays(held, holds, saved, reuse)
        if route.programs is RECOMPUTE:
            out, tensors = self.run("backward_recompute", inputs, cots)
        else:
            out, tensors = self.run("backward", inputs, outputs, buffers, cots)
        return tensors, out

    def gradients(self, buffers: list, cots) -> list:
        """Per leaf its gradient: views into the packed buffers, ``None`` where unreached.

        Views of one buffer share its memory; torch's ``AccumulateGrad`` takes each view as
        the parameter's ``.grad`` without a copy. Gradients of one shape side by side in a
        buffer are viewed by one ``unbind`` (``GradientViews``). A leaf that no used output
        depends on gets ``None``, as torch gives it: optimizers such as AdamW then leave it
        alone.
        """
        parts = []
        for b, start, stop, shape, count in self.views.runs:
            buffer = buffers[b]
            if shape is None:
                parts.append(buffer)
            elif count < 0:  # ``shape``: templates for the whole buffer
                parts += torch._C._nn.unflatten_dense_tensors(buffer, shape)
            elif count == 1:
                parts.append(buffer[start:stop].view(shape))
            else:
                parts += buffer[start:stop].view(count, *shape).unbind(0)
        parts.append(None)
        out = self.views.pick(parts)
        used = list(map(operator.is_not, cots, itertools.repeat(None)))
        if False in used:
            out, slots = list(out), self.grad_slots
            for p in self.unreached(tuple(used)):
                out[slots[p]] = None
        return out

    def unreached(self, used: tuple[bool, ...]) -> frozenset:
        """Positions (``diff_index``) of the gradients no used output depends on."""
        none = self._unreached.get(used)
        if none is None:
            reach = 0
            for mask, u in zip(self.program.grad_reach, used, strict=True):
                if u:
                    reach |= mask
            none = frozenset(p for p in range(len(self.grad_slots)) if not reach >> p & 1)
            self._unreached[used] = none
        return none
