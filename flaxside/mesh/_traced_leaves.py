"""What code traced inside a program over a mesh learns about the program's leaves.

``OnMesh.tracing`` (``_on_mesh.py``) sets ``TRACING`` while the program's function is
traced; a stack that owns its loops (``stacks/_core.py``) asks ``program_leaves`` which of
the arrays it was handed are the program's leaves, sharded or cast, and tells
``reduced_per_rank`` which gradients it sums itself (NOTE [One collective per layer], NOTE
[Mixed precision], NOTE [Per-rank stacks]).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple


class ProgramLeaf(NamedTuple):
    """One of a mesh program's leaves, as code traced inside the program meets it.

    Attributes:
        source: the leaf as the program received it (a parameter's float32 shards).
        dim: the dimension it is split on over the mesh's batch axes, or ``None``:
            replicated, or sharded over another axis too (left to XLA's partitioner).
        dtype: the dtype the function reads it in (``None``: the source's).
        reduce: the dtype its gradient is to be summed over the ranks in (``None``: as
            computed; NOTE [Mixed precision]).
    """

    source: Any
    dim: int | None
    dtype: Any
    reduce: Any = None


# While a program over a mesh is traced: (its OnMesh, {id(leaf as read): ProgramLeaf}, the
# ids of the leaves a per-rank stack reduces: NOTE [Per-rank stacks]).
TRACING: contextvars.ContextVar = contextvars.ContextVar("flaxside_mesh_leaves",
                                                          default=None)


def program_leaves(arrays) -> tuple[Any, list]:
    """``(placement, found)`` for ``arrays`` traced inside a program over a mesh.

    ``found``: per array, its ``ProgramLeaf`` if it is one of the program's leaves as the
    function reads them (by identity) and is sharded or cast, else ``None``;
    ``placement`` is the program's ``OnMesh``, or ``None`` outside such a trace (NOTE
    [One collective per layer], NOTE [Mixed precision]).
    """
    tracing = TRACING.get()
    if tracing is None:
        return None, [None] * len(arrays)
    placement, known, _ = tracing
    return placement, [known.get(id(a)) for a in arrays]


def reduced_per_rank(arrays) -> None:
    """Tells the program being traced that a per-rank stack sums ``arrays``' gradients.

    ``arrays``: its leaves as read; summed in the dtype ``OnMesh.reduce`` asks.
    """
    TRACING.get()[2].update(id(a) for a in arrays)


@contextlib.contextmanager
def traced_again(read: list, again: list):
    """While the function is traced again on ``again``, new tracers standing for ``read``.

    Inside, ``program_leaves`` knows each of ``again`` as the leaf it stands for, and what
    a per-rank stack reports reducing reaches the program's trace as ``read``'s (NOTE
    [Packed scans] in ``_packed_scans.py`` traces the function once more to a jaxpr).
    """
    tracing = TRACING.get()
    if tracing is None:
        yield
        return
    placement, known, reduced = tracing
    inner = set()
    token = TRACING.set((placement, {id(b): known[id(a)] for a, b in
                                     zip(read, again, strict=True) if id(a) in known}, inner))
    try:
        yield
    finally:
        TRACING.reset(token)
        reduced.update(id(a) for a, b in zip(read, again, strict=True) if id(b) in inner)
