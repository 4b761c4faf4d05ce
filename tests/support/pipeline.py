"""The one place the tests read the call pipeline's internals (torchside ``Caller``).

Tests that check what a call compiled, held or exchanged read it through these functions,
never through an owner's private attributes, so that a change to those internals is one
change here. ``owner`` is a ``FlaxModule`` or a ``jax_function``. Prefer public behaviour
where it exists: ``owner.trace_count``, ``owner.cache_size``, ``owner.clear_caches()``,
``owner.memory_report(...)``.

A ``Program`` (``flaxside.internal``) is tested on its own in
``tests/calls/test_program.py``; the programs returned here are used through that API
(``trace_count``, ``diff_index``, ``residual_map()``, ``specs``, ``device``, ``fence``).
"""

from __future__ import annotations

import collections
import contextlib
import gc

import jax


def entries(owner) -> list:
    """The owner's cached entries, one per call signature, least recently used first.

    Compare them by identity (``is``) or count them; what an entry holds is read through
    the functions below.
    """
    return owner._caller.entries


def programs(owner) -> list:
    """The compiled ``flaxside`` program of each cached entry, in ``entries`` order."""
    return [e.program for e in entries(owner)]


def only_program(owner):
    """The program of the owner's one cached call signature (fails if there are more)."""
    found = programs(owner)
    assert len(found) == 1, f"expected one cached call signature, found {len(found)}"
    return found[0]


def residual_map(owner):
    """The residual map (what a call keeps for its backward) of the one cached signature."""
    return only_program(owner).residual_map()


def held_arrays(owner) -> list:
    """The JAX arrays the owner holds over its variables' memory (one set per owner).

    Variables that cannot be held (unaligned or non-compact memory, autocast copies) have
    no held array and are left out.
    """
    return [s.array for s in owner._caller.held.slots if s is not None and s.array is not None]


def crosses_by_dlpack(owner) -> list[bool]:
    """Per cached entry, whether its tensors cross by DLPack (the CUDA route)."""
    return [e.exchange.dlpack for e in entries(owner)]


def executables_run(owner) -> list[tuple[str, str, object]]:
    """``(program name, kind, jax.stages.Compiled)`` for every executable the calls ran.

    ``kind`` is ``"forward"``, ``"forward_with_residuals"``, ``"backward"``,
    ``"backward_recompute"`` or ``"value_and_grad"``.
    """
    return [(e.program.name, kind, e.program.compiled(kind))
            for e in entries(owner) for kind in e._executables]


def compiled_kinds(program) -> list[tuple[str, object]]:
    """``(kind, jax.stages.Compiled)`` for each kind the program has compiled so far."""
    return [(kind, program.compiled(kind)) for kind in list(program._compiled)]


def variables_from(module, values: list):
    """The Flax variables of a ``FlaxModule`` with ``values`` as its parameter leaves.

    ``values`` holds one array per ``module.named_parameters()``, in that order (torch's
    order, which differs from Flax's leaf order when parameters sit both at a scope and in
    its submodules); buffers keep their current values.
    """
    by_name = dict(zip((n for n, _ in module.named_parameters()), values, strict=True))
    state = dict(module.named_buffers())
    leaves = [by_name[n] if n in by_name else jax.numpy.asarray(state[n].detach().cpu().numpy())
              for n in module._adapter.names]
    return module._adapter.variables(leaves)


def derived_programs(owner) -> list:
    """The programs of the calls derived from the owner's (NOTE [Higher order]: a
    backward differentiated again, torch.func's vmap), in entry order."""
    from torchside.edges._derived import derived_owners

    return [e.program for entry in entries(owner) for derived in derived_owners(entry)
            for e in entries(derived)]


class Runs(collections.Counter):
    """``{(program name, kind): runs}``; a program that never ran reads 0 only if it exists.

    A zero read for a name no program has would pass vacuously when a program is renamed
    (mutation: the derived programs renamed in ``torchside/edges/_derived.py``): it raises instead.
    """

    def __missing__(self, key):
        from flaxside.internal import Program

        names = {o.name for o in gc.get_objects() if type(o) is Program}
        if key[0] not in names:
            raise KeyError(f"no program is named {key[0]!r} (programs: {sorted(names)})")
        return 0

    def derived(self, base: str, kind: str) -> dict:
        """``{suffix: runs}`` of the programs derived from ``base`` directly (named ``base
        (...)``, not their own derived ones) that ran ``kind``: compared whole, a renamed
        program fails it."""
        return {name[len(base) + 1:]: n for (name, k), n in self.items()
                if k == kind and name.startswith(base + " (") and n
                and name[len(base) + 1:].count("(") == 1}


@contextlib.contextmanager
def program_runs():
    """Counts the program runs of every entry while active: a ``Runs``."""
    from torchside.call._entry import Entry

    runs = Runs()
    run = Entry.run

    def counted(entry, kind, *args):
        runs[entry.program.name, kind] += 1
        return run(entry, kind, *args)

    Entry.run = counted
    try:
        yield runs
    finally:
        Entry.run = run


def whole_vjps(owner) -> None:
    """The owner's backwards differentiated again take the whole VJP or the shared
    linearization, never the given residuals' route (its edges: ``WHOLE_VJPS``)."""
    from torchside.edges._edges import WHOLE_VJPS

    owner._caller.edges = WHOLE_VJPS


def shared_residuals(owner) -> list:
    """The residual tensors still alive that the owner's VJP calls may share
    (NOTE [Shared linearization] in ``torchside/edges/_higher.py``)."""
    from torchside.edges._derived import owners_of
    from torchside.edges._higher import VjpCalls

    out = []
    for entry in entries(owner):
        for calls in owners_of(entry).values():
            if isinstance(calls, VjpCalls):
                out += [r() for r in calls._last if r() is not None]
    return out
