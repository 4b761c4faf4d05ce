"""A program whose stock scans compute the same per rank runs per rank (NOTE [Per-rank scans]).

NOTE [Per-rank scans]. Packed scans (NOTE [Packed scans] in ``_packed_scans.py``) gather
each layer in one collective, but their gradients are still reduced by XLA's partitioner:
one all-reduce per gradient, which gloo runs operand by operand, moving full gradients.
``remat_stack`` runs per rank where its layer computes the same on each rank's rows (NOTE
[Per-rank stacks] in ``_per_rank.py``): one all-to-all gathers a layer, and its
transpose, one all-to-all and a local sum, reduce-scatters the gradient. A stock block
gets the same where the whole function does: every leaf split over the batch axis is read
inside loops only (``reached_in_loops``), and the function computes the same on each
rank's rows, asked as ``remat_stack`` asks of a layer (``oblivious``): compiled over the
mesh with its split leaves replicated and its batch split, it holds no collective and
never reads its partition id, and traced on one rank's rows it is the same program but
for the batch's size. Then the function runs inside ``shard_map``, traced again on one
rank's rows with each split leaf's global shape, and evaluated on the rank's shards, each
layer's gathered by ``_per_rank.gathered``'s all-to-all in the body that reads it; JAX's
transpose of that gather is the reduce-scatter, and a replicated leaf's gradient is summed
by ``shard_map``'s. Otherwise (a batch mean, dropout, a leaf read outside the loops, a
mesh with a tensor axis) the packed scans' partitioner route stays.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxside.mesh._packed_scans import evaluate
from flaxside.mesh._per_rank import Plan, gathered, rank_oblivious

# Per function, per signature (shapes, dtypes, dims, mesh): whether it runs per rank.
_OBLIVIOUS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def per_rank_scans(mesh, axis: str, specs: tuple, batch: tuple, fn: Callable) -> Callable:
    """The ``per_rank`` route ``packed_scans`` tries for ``fn`` over a one-axis mesh.

    ``specs``: per leaf its ``PartitionSpec`` (``None``: replicated); ``batch``: per leaf,
    whether it is a batch-split argument; ``fn``: the program's function (the probe's
    answer is kept per function).
    """
    return functools.partial(_run, mesh, axis, specs, batch, fn)


def _run(mesh, axis, specs, batch, fn, arrays, closed, read, dims):
    """The function's results run per rank, or ``None`` (NOTE [Per-rank scans])."""
    n = mesh.shape[axis]
    sizes = {x.shape[0] for x, b in zip(read, batch, strict=True) if b}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    # As ``OnMesh.result_specs``: results whose first dimension is the batch are split.
    out_specs = [P(axis) if a.shape and a.shape[0] == size else P() for a in closed.out_avals]
    in_specs = [P() if s is None else s for s in specs]
    if not oblivious(fn, arrays, closed, read, batch, in_specs, out_specs, mesh, n):
        return None

    def gather(local, ds):
        k = len(ds)
        return gathered(Plan(mesh, axis, [], [], list(ds), [None] * k, [None] * k), local)

    def local(*leaves):
        # The function on one rank's rows, each split leaf at its global shape: the jaxpr's
        # inputs; the values are the rank's shards, gathered where a body reads them.
        again = jax.make_jaxpr(arrays)([
            jax.ShapeDtypeStruct((x if d is not None else y).shape, y.dtype)
            for x, y, d in zip(read, leaves, dims, strict=True)])
        marks = {v: d for v, d in zip(again.jaxpr.invars, dims, strict=True) if d is not None}
        return evaluate(again.jaxpr, again.consts, list(leaves), marks, gather, in_loop=False)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         check_vma=False)(*read)


def oblivious(fn, arrays, closed, read, batch, in_specs, out_specs, mesh, n: int) -> bool:
    """Whether ``arrays`` computes the same on each rank's rows (NOTE [Per-rank scans]).

    ``closed``: its jaxpr on the whole batch. Kept per function and signature.
    """
    key = (tuple((tuple(x.shape), str(x.dtype)) for x in read), tuple(map(str, in_specs)),
           tuple(batch), mesh)
    try:
        known = _OBLIVIOUS.setdefault(fn, {})
    except TypeError:  # a function no weak reference can follow: asked every time
        known = {}
    if key not in known:
        known[key] = _probe(arrays, closed, read, batch, in_specs, out_specs, mesh, n)
    return known[key]


def _probe(arrays, closed, read, batch, in_specs, out_specs, mesh, n) -> bool:
    """Whether the function computes the same per rank (``oblivious``), asked once.

    Compiled over the mesh (split leaves replicated, the batch split): no collective and
    no partition id; traced on one rank's rows: the same program but for the batch.
    """
    rows = [jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]) if b else x.shape, x.dtype)
            for x, b in zip(read, batch, strict=True)]
    whole = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s if b else P()))
             for x, b, s in zip(read, batch, in_specs, strict=True)]

    def traced():
        local = jax.make_jaxpr(arrays)(rows)
        # Each result split as ``out_specs`` says: a rank's rows of a split one, all of
        # another (a result as long as the batch by chance would be split wrongly).
        split = all(tuple(r.shape) == ((g.shape[0] // n, *g.shape[1:]) if spec != P()
                                       else tuple(g.shape))
                    for g, r, spec in zip(closed.out_avals, local.out_avals, out_specs,
                                          strict=True))
        return closed, local if split else None, lambda: jax.jit(
            lambda leaves: _flat(arrays(leaves)),
            out_shardings=[NamedSharding(mesh, s) for s in out_specs]).lower(whole).compile()

    return rank_oblivious(traced, n)


def _flat(results) -> list:
    outs, aux = results
    return [*outs, *aux]
