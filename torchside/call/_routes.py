"""What a signature fixes: the order of its leaves, the route each edge takes, what it holds.

Values made once per entry (``_build.py``) and read by every step after: ``Layout``,
``Route`` per ``Edge``, ``Holds`` per route, ``GradientViews``. Nothing here runs on a
call's path but their construction; the methods serve the cold paths (building an
entry, ``torch.compile``'s ops, derivatives of the backward, ``memory_report``).

NOTE [Leaves]. Every program of a call takes one flat list of leaves: the owner's
variables, then the RNG slot (raw key data drawn from torch's generator, where the owner
has RNG streams), then the call's tensor arguments. ``Layout`` is that order.

NOTE [Routes]. What a call runs is a ``Route``, fixed per entry and ``Edge`` (the place a
call enters the pipeline, one of ``ALL_EDGES``): ``EAGER`` (``BridgeFunction``), ``COMPILED``
(``torch.compile``'s ops; ``FAKE`` while Dynamo traces them with fake tensors),
``TRANSFORMED`` (under ``torch.func``), ``REPORT`` (``memory_report``, which compiles
without running). An edge is a value that answers what each step asks of it (whether the
variables' memory is read, whether a key is drawn), so no step compares names. A route's
``programs`` is one of:

* ``PLAIN``: no backward (no gradient wanted, or a transform that differentiates by
  calls of its own): ``forward`` only;
* ``RESIDUALS``: ``forward_with_residuals``, then ``backward`` from what it saved;
* ``RECOMPUTE``: ``forward``, saving the inputs; ``backward_recompute`` reruns it;
* ``FUSED``: a scalar loss, eagerly: ``value_and_grad``, whose gradients the backward
  scales (NOTE [Scalar loss] in ``_eager.py``). Compiled calls of such an entry take
  ``RESIDUALS``.

Both are compared by identity (``route.programs is FUSED``); neither defines ``__eq__``
or ``__hash__``, so a dictionary keyed by one (``Entry.holds``) looks it up in C.

NOTE [What a call holds]. ``Holds`` says, per route, what a call keeps for its backward:
what torch saves (``ctx.save_for_backward``, so that saved-tensor hooks and version
counters see it: leaves, results, then program buffers, residuals or gradients), and what
a derivative of the backward reads besides (NOTE [Higher order] in ``edges/_higher.py``), kept
by reference. ``save``, the backward and ``memory_report`` all read the same value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple


# -- what a signature fixes ---------------------------------------------------------------------
class _Kind:
    """One object per kind, compared by identity.

    A copy or an unpickled value is the same module-level object (named by
    ``name.upper()``), since kinds key dictionaries that copies may carry.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self) -> str:
        return self.name.upper()


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Edge(_Kind):
    """Where a call enters the pipeline, as what each step asks of it (NOTE [Routes]).

    Attributes:
        name: the edge's name, in messages and reprs.
        holds: its tensors have memory (under ``torch.func`` they may be wrappers without
            any, and a compiled graph's fake tensors have none): the variables' held arrays
            are read, and a zero RNG slot is kept for the next call.
        draws: it draws an RNG key where the programs read one (a report runs nothing).
        named: a compiled graph finds its entry by key (``Graph._by_key``).
        differentiated: torch's autograd differentiates its results (under ``torch.func``
            the transform differentiates by calls of its own: no backward program).
        fuses: a scalar loss may run ``value_and_grad`` in one program (eager calls, and
            ``memory_report`` reporting them).
    """

    name: str
    holds: bool
    draws: bool
    named: bool
    differentiated: bool
    fuses: bool



EAGER = Edge("eager", holds=True, draws=True, named=False, differentiated=True, fuses=True)
COMPILED = Edge("compiled", holds=True, draws=True, named=True, differentiated=True, fuses=False)
FAKE = Edge("fake", holds=False, draws=False, named=True, differentiated=True, fuses=False)
TRANSFORMED = Edge("transformed", holds=False, draws=True, named=False, differentiated=False,
                   fuses=False)
REPORT = Edge("report", holds=True, draws=False, named=False, differentiated=True, fuses=True)
ALL_EDGES = (EAGER, COMPILED, FAKE, TRANSFORMED, REPORT)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Programs(_Kind):
    """Which of a ``Program``'s executables a route runs (NOTE [Routes]).

    Attributes:
        name: in messages and reprs.
        forward: the forward executable's kind (``flaxside``'s ``PROGRAMS``).
        backward: the backward's, or ``None`` (no backward, or the fused route's, which
            scales what the forward saved).
    """

    name: str
    forward: str
    backward: str | None



PLAIN = Programs("plain", "forward", None)
RESIDUALS = Programs("residuals", "forward_with_residuals", "backward")
RECOMPUTE = Programs("recompute", "forward", "backward_recompute")
FUSED = Programs("fused", "value_and_grad", None)


class Layout(NamedTuple):
    """The order of a call's leaves (NOTE [Leaves]).

    Attributes:
        names: one per leaf: the variables' Flax paths, ``rngs``, then the arguments'
            (``args[0]``, ``kwargs['mask']``).
        variables: the variables' slice.
        rng: the RNG slot's index, or ``None`` where the owner has no RNG streams.
        arguments: the tensor arguments' slice.
        narrow: indices of int64 arguments that cross as int32 (each value checked).
    """

    names: tuple[str, ...]
    variables: slice
    rng: int | None
    arguments: slice
    narrow: frozenset

    @classmethod
    def of(cls, var_names, rng_name: str | None, arg_names, narrowed=()) -> Layout:
        """The layout of variables, an RNG slot named ``rng_name`` (or none), arguments.

        ``narrowed``: positions among the arguments of those that cross as int32.
        """
        n_variables = len(var_names)
        rng = None if rng_name is None else n_variables
        start = n_variables + (rng_name is not None)
        names = (*var_names, *(() if rng_name is None else (rng_name,)), *arg_names)
        return cls(names, slice(0, n_variables), rng, slice(start, len(names)),
                   frozenset(start + k for k in narrowed))

    @property
    def state(self) -> slice:
        """The variables and the RNG slot: the leaves an owner supplies."""
        return slice(0, self.arguments.start)

    def of_leaves(self, variables, rng, arguments) -> list:
        """Per-leaf items in this order (``rng`` is dropped where there is no slot)."""
        return [*variables, rng, *arguments] if self.rng is not None else [
            *variables, *arguments]

    def without_rng(self, per_leaf) -> list:
        """``per_leaf`` without the RNG slot's item (the leaves of a compiled op)."""
        per_leaf = list(per_leaf)
        if self.rng is not None:
            del per_leaf[self.rng]
        return per_leaf



class Route(NamedTuple):
    """How a call runs (NOTE [Routes]); one per entry and edge, made when it is built.

    Attributes:
        programs: which executables it runs (``PLAIN``, ``RESIDUALS``, ``RECOMPUTE``,
            ``FUSED``).
        edge: the ``Edge`` it is taken from.
        forward: ``programs.forward``, read on the call's path.
        backward: ``programs.backward``.
        mesh: whether the programs run over a mesh of processes (NOTE [Sharded blocks] in
            ``integrations/_shard.py``).
        order: 1 for a call of an owner; k + 1 for the backward of an order-k call
            differentiated again (NOTE [Higher order]).
    """

    programs: Programs
    edge: Edge
    forward: str
    backward: str | None
    mesh: bool
    order: int

    @classmethod
    def of(cls, programs: Programs, edge: Edge, mesh: bool, order: int) -> Route:
        """The route that runs ``programs`` from ``edge``."""
        return cls(programs, edge, programs.forward, programs.backward, mesh, order)


class Holds(NamedTuple):
    """What a call of one route keeps for its backward (NOTE [What a call holds]).

    Attributes:
        inputs: the leaves torch saves.
        clones: those of ``inputs`` saved as clones: state the owner overwrites after the
            forward, which a recompute must see as it was.
        outputs: the results torch saves after them.
        buffers: the program buffers torch saves last: residuals or gradients.
        offloaded: per buffer, whether a remat policy put it in host memory.
        kept: leaves kept by reference for a derivative of the backward (not saved:
            saved-tensor hooks never see them).
        state: leaves a derivative of the backward reads as they are then (state the
            owner overwrites).
        bounds: where ``inputs`` end and ``outputs`` end in what torch saved.
    """

    inputs: tuple[int, ...] = ()
    clones: frozenset = frozenset()
    outputs: tuple[int, ...] = ()
    buffers: tuple = ()
    offloaded: tuple[bool, ...] = ()
    kept: tuple[int, ...] = ()
    state: tuple[int, ...] = ()
    bounds: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, programs: Programs, program, layout: Layout) -> Holds:
        """What a call running ``programs`` of ``program`` holds."""
        n = len(layout.names)
        targets = tuple(program.write_back.targets)
        if programs is PLAIN:
            return cls()
        if programs is RECOMPUTE:  # every leaf, overwritten state as it was
            return cls(inputs=tuple(range(n)), clones=frozenset(targets), bounds=(n, n))
        if programs is FUSED:  # the gradient buffers (NOTE [Scalar loss])
            specs = program.grad_specs
            return cls(buffers=specs, offloaded=(False,) * len(specs),
                       kept=tuple(i for i in range(n) if i not in targets), state=targets)
        rmap = program.residual_map()
        skip = set(targets) | set(rmap.saved_inputs)
        return cls(inputs=rmap.saved_inputs, outputs=rmap.saved_outputs,
                   buffers=rmap.residual_specs, offloaded=rmap.offloaded,
                   kept=tuple(i for i in range(n) if i not in skip), state=targets,
                   bounds=(len(rmap.saved_inputs),
                           len(rmap.saved_inputs) + len(rmap.saved_outputs)))

    def held_specs(self, program, layout: Layout) -> list:
        """What a call holds beyond parameters, arguments and outputs, as ``LeafSpec``s.

        The buffers, clones of state, a drawn RNG key, and saved state updates.
        """
        rng = [] if layout.rng is None or layout.rng not in self.inputs else [layout.rng]
        return [*self.buffers, *(program.specs[i] for i in sorted(self.clones)),
                *(program.specs[i] for i in rng if i not in self.clones),
                *(program.out_specs[k] for k in self.outputs if k >= program.n_out)]

    def every_leaf(self, layout: Layout, saved, kept, state: dict) -> list:
        """Every leaf, from what torch saved, what was kept, and the state now."""
        leaves = [None] * len(layout.names)
        for j, t in zip(self.inputs, saved, strict=False):
            leaves[j] = t
        for i, t in zip(self.kept, kept, strict=True):
            leaves[i] = t
        for i, t in state.items():
            leaves[i] = t
        return leaves


class GradientViews(NamedTuple):
    """How ``Entry.gradients`` hands each leaf its gradient out of the backward's buffers.

    Attributes:
        runs: per run of gradients, ``(buffer, start, stop, shape, count)``: a buffer of
            its own (``shape`` is ``None``), one gradient viewed out of a packed buffer
            (``count`` 1), ``count`` gradients of one shape side by side in a packed
            buffer, unbound in one op (``flaxside``'s ``pack_plan`` puts them so), or a
            whole packed buffer viewed at once (``count`` -1; ``shape``: meta tensors of
            the gradients' shapes, in order).
        pick: from the runs' gradients in order, then ``None``, the list of gradients per
            leaf of the layout (``None`` for a leaf without one).
    """

    runs: tuple[tuple, ...]
    pick: Callable
