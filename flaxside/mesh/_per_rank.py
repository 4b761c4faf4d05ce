"""A stack over a mesh run per rank: each layer gathered and reduced with one all-to-all.

NOTE [Per-rank stacks]. Over a mesh, ``remat_stack`` (``stacks/_core.py``) can leave each
layer's collectives to XLA's partitioner (NOTE [One collective per layer] in
``_on_mesh.py``: a packed all-gather per layer, and an all-reduce of each gradient where
the op contracting the batch makes it, which the combiner merges into one tuple) or run the
whole stack inside ``shard_map``, per rank, with its collectives written out. Per rank, a
layer's shards are packed into one row and gathered by one ``all_to_all`` (every rank
sends its row to every rank); its gradient, this rank's partial sum over its part of the
batch, is packed rank by rank (``pack_by_rank``) and reduce-scattered by one
``all_to_all`` and a local sum in the leaf's dtype: FSDP's reduce-scatter, moving half
the bytes of an all-reduce on two ranks, in one collective where the partitioner's tuple
all-reduce is one per gradient on gloo (the figures, from ``examples/bench/collectives.py``,
are in docs/design.md "Sharded blocks").

Per rank is the same computation only where a layer is: each rank's rows of the output
depend on its own rows of the input alone, the same way on every rank. A layer that mixes
the batch (a batch norm), or that reads where its rows lie in the global batch (random bits
drawn for the global shape, which JAX's partitionable threefry computes per shard from the
shard's offset; an iota over the batch), or whose Python code reads the batch's size (a
scale by it, a reshape into a fixed number of groups), would compute something else per
rank. So before the stack runs per rank, one layer (its index abstract, as in the loop) is
compiled as an SPMD program over the mesh (the carry sharded as the stack's, parameters
and consts replicated) and traced again on one rank's rows; per rank is taken only if that
program holds no collective and never asks which partition it is, and the trace on one
rank's rows is the same program but for the batch's size (``same_up_to_batch``): then
every rank runs, on its own rows, what the partitioner would have run, which is what
``shard_map`` runs. Otherwise the partitioner's route stays (``plan`` returns ``None``), as
it does for a leaf sharded on a layer axis, a carry leaf the mesh does not divide on its
first dimension, or a mesh with an axis of more than one process that is not the batch's
(a tensor axis: per rank, a leaf sharded over it would be gathered whole, and each layer
computed again on each of its ranks).

Only a per-rank stack sums a gradient in another dtype than it is computed in (FSDP2's
``reduce_dtype``, ``OnMesh.reduce``): a program whose function reads such a leaf anywhere
else, and asks for its gradient, is refused where it is built (``OnMesh.check_reduced``,
``read_outside``). A replicated leaf's gradient is summed by ``shard_map``'s transpose,
in the leaf's own dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxside import jaxprs
from flaxside.program._depends import same_closed_up_to_batch
from flaxside.program._pack import pack_by_rank, sharded_by_dtype, unpack_by_rank

jtu = jax.tree_util

# Ops in a compiled SPMD program that make it differ from one rank's program run alone.
_RANK_AWARE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast|partition-id|replica-id)"
                         r"(?:-start)?\(")


class Plan(NamedTuple):
    """How a stack runs per rank (NOTE [Per-rank stacks]).

    Attributes:
        mesh, axis: the mesh and its axis.
        param_specs: per parameter leaf (the stack's layout axes first), its ``PartitionSpec``.
        carry_specs: per carry leaf, sharded on its first dimension or replicated.
        dims: per parameter leaf, the dimension of one layer's slice it is sharded on.
        reads: per parameter leaf, the dtype the layer reads it in (``None``: its own).
        reduces: per parameter leaf, the dtype its gradient is summed in (``None``: the
            dtype it is computed in; NOTE [Mixed precision]).
    """

    mesh: jax.sharding.Mesh
    axis: str
    param_specs: list
    carry_specs: list
    dims: list
    reads: list
    reduces: list

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]


def plan(layer_fn: Callable, placement, found: list, sources: list, treedef, n_layout: int,
         carry, consts) -> Plan | None:
    """The per-rank plan for a stack over ``placement``'s mesh, or ``None``.

    ``None`` keeps the partitioner's route, where per rank could compute something else
    (NOTE [Per-rank stacks]).
    ``found``: per parameter leaf its ``ProgramLeaf`` or ``None`` (replicated, or not one of
    the program's leaves); ``sources``: the leaves the stack runs on, of ``treedef``.
    """
    if len(placement.batch_axes) != 1 or not placement.batch_only:
        # A tensor axis: shard_map's specs name the batch axis only, so each leaf sharded
        # over it would be gathered whole before the loop, and every layer computed again
        # on each of its ranks.
        return None
    if any(f is not None and f.dim is not None and f.dim < n_layout for f in found):
        return None  # a leaf sharded on a layer axis: a layer lives on one rank
    n, axis = placement.size, placement.batch_axes[0]
    dims = [None if f is None or f.dim is None else f.dim - n_layout for f in found]
    reads = [None if f is None else f.dtype for f in found]
    param_specs = [P(*(axis if k == f.dim else None for k in range(np.ndim(x))))
                   if d is not None else P() for x, f, d in zip(sources, found, dims, strict=True)]
    carry_leaves = jtu.tree_leaves(carry)
    carry_specs = [P(axis) if np.ndim(c) and c.shape[0] % n == 0 else P() for c in carry_leaves]
    if not any(spec != P() for spec in carry_specs):
        return None  # nothing is split over the ranks: per rank would repeat the whole batch
    layer = jtu.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape[n_layout:], x.dtype if t is None else t)
        for x, t in zip(sources, reads, strict=True)])
    if not _rank_oblivious(layer_fn, placement.mesh, layer, carry, carry_specs, consts):
        return None
    reduces = [None if f is None else f.reduce for f in found]
    return Plan(placement.mesh, axis, param_specs, carry_specs, dims, reads, reduces)


def _rank_oblivious(layer_fn, mesh, layer, carry, carry_specs, consts) -> bool:
    """Whether one layer runs the same program on every rank, on its own rows.

    Compiled over ``mesh`` with the carry sharded as ``carry_specs`` (its layer index
    abstract, as in the stack): no collective, no partition id. And traced on one rank's
    rows, the same program as on the whole batch (``same_up_to_batch``): Python code
    reading the batch's size would compute something else per rank.
    """
    n = mesh.size
    leaves, treedef = jtu.tree_flatten(carry)
    shard = [NamedSharding(mesh, s) for s in carry_specs]
    replicated = NamedSharding(mesh, P())

    def aval(x, sharding=replicated, shape=None):
        dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)  # a Python scalar
        return jax.ShapeDtypeStruct(np.shape(x) if shape is None else shape, dtype,
                                    sharding=sharding)

    def local(c, spec):
        return (c.shape[0] // n, *c.shape[1:]) if spec != P() else np.shape(c)

    def traced():
        params, const = jtu.tree_map(aval, layer), jtu.tree_map(aval, consts)
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        whole = jtu.tree_unflatten(treedef, [aval(c, s) for c, s in zip(leaves, shard,
                                                                          strict=True)])
        rows = jtu.tree_unflatten(treedef, [
            aval(c, replicated, local(c, spec)) for c, spec in zip(leaves, carry_specs,
                                                                    strict=True)])
        return (jax.make_jaxpr(layer_fn)(params, whole, const, index),
                jax.make_jaxpr(layer_fn)(params, rows, const, index),
                lambda: jax.jit(layer_fn, out_shardings=jtu.tree_unflatten(treedef, shard))
                .lower(params, whole, const, index).compile())

    return rank_oblivious(traced, n)


def rank_oblivious(traced: Callable, n: int) -> bool:
    """Whether a function computes on each of ``n`` ranks what it computes on its rows.

    ``traced()`` returns the function's jaxpr on the whole batch, its jaxpr on one rank's
    rows (``None``: refused already) and ``compile()``, the function compiled over the
    mesh. Oblivious where both jaxprs are the same program but for the batch
    (``same_closed_up_to_batch``: Python code reading the batch's size computes something
    else per rank) and the compiled program holds no collective and no partition id. A
    function that does not trace or compile alone (it closes over the enclosing trace) is
    not: it keeps the partitioner's route.
    """
    try:
        whole, rows, compile_ = traced()
        if rows is None or not same_closed_up_to_batch(whole, rows, n):
            return False
        compiled = compile_()
    except Exception:  # noqa: BLE001 a probe
        return False
    return not _RANK_AWARE.search(compiled.as_text())


def apply(stack: Callable, plan: Plan, params, carry, consts):
    """``stack(params, carry, consts)`` run per rank inside ``shard_map``."""
    p_leaves, p_tree = jtu.tree_flatten(params)
    c_leaves, c_tree = jtu.tree_flatten(carry)
    specs = (jtu.tree_unflatten(p_tree, plan.param_specs),
             jtu.tree_unflatten(c_tree, plan.carry_specs), P())
    per_rank = jax.shard_map(stack, mesh=plan.mesh, in_specs=specs,
                             out_specs=specs[1], check_vma=False)
    return per_rank(jtu.tree_unflatten(p_tree, p_leaves), carry, consts)


def gathered(plan: Plan, local: list) -> list:
    """One layer's parameters in full from this rank's shards: one all-to-all per dtype.

    Its send buffer (this rank's row once per rank) is one more layer's bytes while the
    all-to-all runs: with the gathered layer, the two layers a step may hold.
    """
    n = plan.size
    local = [a if t is None else a.astype(t) for a, t in zip(local, plan.reads, strict=True)]
    out = list(local)
    for group in sharded_by_dtype(local, plan.dims):
        dims = [plan.dims[k] for k in group]
        row = pack_by_rank([local[k] for k in group], dims, 1)[0]  # this rank's shards
        # Every rank sends its row to every rank: row r of the result is rank r's.
        rows = jax.lax.all_to_all(jnp.broadcast_to(row, (n, row.size)), plan.axis, 0, 0,
                                  tiled=True)
        shapes = [_global(local[k].shape, plan.dims[k], n) for k in group]
        for k, part in zip(group, unpack_by_rank(rows, shapes, dims, n), strict=True):
            out[k] = part
    return out


def scattered(plan: Plan, grads: list, dtypes: list) -> list:
    """This rank's shard of one layer's gradients, summed over the ranks, in ``dtypes``.

    ``grads``: this rank's partial sums, full shapes. Each is summed in its leaf's entry of
    ``plan.reduces`` (else its own dtype): one all-to-all and a local sum per dtype, then
    cast to its entry of ``dtypes``, as FSDP2 reduce-scatters in ``reduce_dtype`` and casts
    to the parameter's. Gradients of replicated leaves stay partial: ``shard_map``'s
    transpose sums them.
    """
    n = plan.size
    out = [g if r is None else g.astype(r) for g, r in zip(grads, plan.reduces, strict=True)]
    for group in sharded_by_dtype(out, plan.dims):
        dims = [plan.dims[k] for k in group]
        rows = pack_by_rank([out[k] for k in group], dims, n)
        # Row r goes to rank r; rank r sums what every rank computed for its shard.
        mine = jax.lax.all_to_all(rows, plan.axis, 0, 0, tiled=True).sum(axis=0)
        shapes = [_local(out[k].shape, plan.dims[k], n) for k in group]
        for k, part in zip(group, unpack_by_rank(mine[None], shapes, dims, 1), strict=True):
            out[k] = part
    return [g.astype(t) for g, t in zip(out, dtypes, strict=True)]


def read_outside(jaxpr, k: int) -> bool:
    """Whether ``jaxpr`` (a program's function) reads its input ``k`` but by per-rank stacks.

    A per-rank stack reads the input itself, by ``shard_map``; its cast (the leaf as the
    function reads it, ``OnMesh.tracing``) is read by nothing.
    """
    source = jaxpr.invars[k]
    reads = {source}
    for eqn in jaxprs.walk(jaxpr):
        uses = [v for v in eqn.invars if jaxprs.is_var(v) and v in reads]
        if not uses:
            continue
        name = eqn.primitive.name
        if name == "convert_element_type" and eqn.invars[0] is source:
            reads.add(eqn.outvars[0])
        elif name != "shard_map" or any(v is not source for v in uses):
            return True
    return any(v in reads for v in jaxpr.outvars if jaxprs.is_var(v))


def refuse_unreduced(reduces: list) -> None:
    """Raises if any leaf's gradient is left to be summed in another dtype.

    ``reduces``: per leaf, that dtype, or ``None`` (a per-rank stack sums it, or none asked).
    """
    left = [k for k, r in enumerate(reduces) if r is not None]
    if left:
        raise ValueError(
            f"A program over the mesh sums the gradients of leaves {left} over the ranks in "
            f"{[str(jnp.dtype(reduces[k])) for k in left]} (FSDP2's reduce_dtype), but its "
            "function reads them outside a flaxside.remat_stack that runs per rank, where "
            "XLA's partitioner sums them in the dtype it computes them in. Leave "
            "reduce_dtype None or equal to param_dtype, or build the repeated layers with "
            "flaxside.remat_stack from a layer that computes the same on each rank's rows "
            "(no batch statistics, no dropout): NOTE [Per-rank stacks].")


def _global(shape, d, n) -> tuple:
    return (*shape[:d], shape[d] * n, *shape[d + 1:])


def _local(shape, d, n) -> tuple:
    return (*shape[:d], shape[d] // n, *shape[d + 1:])

