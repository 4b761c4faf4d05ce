"""A ``Program`` over a mesh of processes: ``OnMesh`` (a placement: NOTE [Placement]).

NOTE [SPMD programs]. A block sharded over processes runs as one SPMD program: parameters
are sharded as their ``PartitionSpec`` says, the batch over the batch axes (FSDP's; on a
mesh with a tensor axis, the ranks along it see the same rows, as tensor parallelism
needs), and XLA's partitioner inserts the collectives, inside a scan one layer's gather per
iteration.

* an executable takes the local arrays, makes each the process's shard of a global array
  (``jax.make_array_from_single_device_arrays``, no copy), runs, and returns each result's
  local shard (``addressable_data(0)``);
* results whose leading dimension is the global batch are split over the batch axes on it,
  every other result (a loss, state updates) is replicated; gradients have their leaf's
  sharding; residuals take the sharding the partitioner chose, read from the compiled
  forward (``residual_shardings``);
* gradients of what is not sharded over the batch (parameters, state) follow FSDP's mean:
  the contributions of batch-sharded outputs, whose cotangents are each process's own
  loss, are divided by the number of processes that split the batch, as FSDP2 and DDP
  average the ranks' gradients (a tensor axis's ranks compute one loss together);
  replicated outputs (a loss computed inside) are one loss, already global, and are not
  divided. Gradients of batch-sharded inputs are each process's own (over a tensor axis,
  summed over its ranks, as tensor parallelism's input gradients are);
* small arrays are not packed into shared buffers: a buffer that concatenates arrays of
  different shardings would reshard them.

NOTE [One collective per layer]. Left to itself, XLA's partitioner gathers each parameter
of a scanned layer separately inside every iteration, and reduces each gradient
separately: one collective per parameter per iteration, a round trip each. A stack that
owns its loop (``flaxside.remat_stack``) gathers a layer as one buffer instead: while a
program over a mesh is traced, ``OnMesh.tracing`` tells code inside which of the
program's leaves (by identity) are sharded on which dimension (``program_leaves``), and
``OnMesh.gathered`` packs a layer's shards rank by rank (``pack_by_rank``: each rank's own
shards side by side, so packing moves nothing between ranks), constrains the buffer
replicated (one all-gather) and unpacks it; ``OnMesh.scattered`` packs the layer's
gradients the same way and constrains the buffer sharded. One gather per layer, per
dtype (a stock scan's layers the same way, reached through its jaxpr: NOTE [Packed scans]
in ``_packed_scans.py``). The reduction is the partitioner's: an all-reduce of each
gradient where the op contracting the batch makes it, which XLA's all-reduce combiner
(CPU and GPU backends) merges into one tuple per loop body, moving full gradients. Where a
layer computes the same per rank, the stack runs per rank instead and moves each layer
both ways with one all-to-all, the gradient's a reduce-scatter (NOTE [Per-rank stacks] in
``_per_rank.py``); ``gathered`` and ``scattered`` here are the route for the other layers.

NOTE [Mixed precision]. A placement over a mesh may read parameters in another dtype than
they are held in, as FSDP2's ``MixedPrecisionPolicy`` does: ``OnMesh.cast`` gives per leaf
the dtype the function reads it in (bfloat16 for float32 shards). While the program is
traced, ``tracing`` yields the leaves with each such leaf replaced by its cast, and the
function is called on those: a block that XLA partitions (a stock ``nn.scan``) reads each
shard cast before the partitioner's gathers, and its gradients come back in the leaf's
dtype. A stack that owns its loop (``remat_stack``) asks ``program_leaves`` for the leaf
behind each cast and runs on that instead: each layer's shards are cast before its packed
gather (``gathered``), and its gradients cast back to the leaf's dtype after their
reduction (``scattered``). Gradients are reduced in the compute dtype: XLA's partitioner
reduces each parameter's gradient where the op contracting the batch makes it (an
all-reduce per parameter, in that op's dtype, bfloat16 for a Dense kernel; the CPU backend
then combines them into one all-reduce per loop body). Per rank (NOTE [Per-rank
stacks]) a layer's gradients are summed in the dtype ``OnMesh.reduce`` names for the leaf
(FSDP2's ``reduce_dtype``), cast before their all-to-all, else in the compute dtype, then
cast to the leaf's dtype, as FSDP2 does; where the partitioner reduces, another dtype
cannot be asked of it, so a program whose function reads such a leaf outside a per-rank
stack is refused when traced.
XLA's CPU backend widens bfloat16 collectives to float32 after partitioning
(``float-normalization-bf16``, ``all-reduce-promotion``): on CPU the bytes moved stay
float32's; GPU backends keep them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxside.mesh._packed_scans import packed_scans
from flaxside.mesh._per_rank import read_outside, refuse_unreduced
from flaxside.mesh._per_rank_scans import per_rank_scans
from flaxside.mesh._traced_leaves import TRACING, ProgramLeaf, program_leaves
from flaxside.program._pack import Alone, pack_by_rank, sharded_by_dtype, unpack_by_rank
from flaxside.program._specs import LeafSpec, spec_axes

jtu = jax.tree_util


@dataclasses.dataclass(frozen=True)
class OnMesh:
    """A mesh of processes, one device each, of one or more axes (NOTE [SPMD programs]).

    Attributes:
        mesh: the JAX mesh, one device per process, in the order of torch's mesh (its
            position (i, j) is process mesh.mesh[i, j]'s device: process id = torch rank).
        batch_axes: the axes the batch is split over (FSDP's data-parallel axes); every
            other axis (a tensor-parallel one) sees the same rows on each of its ranks.
        specs: per leaf, its ``PartitionSpec`` over the mesh (``None``: replicated, every
            process passes the whole value); entries of several axes in mesh order.
        batch: per leaf, whether it is a batch-sharded argument (its gradient is the
            process's own; every other leaf's gradient follows FSDP's mean).
        cast: per leaf, the dtype the function reads it in, or ``None`` (as passed);
            empty: none is cast (NOTE [Mixed precision]).
        reduce: per leaf, the dtype its gradient is summed over the ranks in, or ``None``
            (the dtype the function computes it in); empty: none. Only a per-rank stack
            sums in another dtype; a program whose function reads such a leaf anywhere
            else is refused when traced (NOTE [Mixed precision]).
    """

    mesh: jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    specs: tuple
    batch: tuple[bool, ...]
    cast: tuple = ()
    reduce: tuple = ()

    @property
    def axis(self):
        """The batch axes as one ``PartitionSpec`` entry (a name, or a tuple of names)."""
        return self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes

    @property
    def size(self) -> int:
        """How many processes split the batch (the product of the batch axes' sizes)."""
        return int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))

    @property
    def batch_only(self) -> bool:
        """Whether every axis of more than one process is a batch axis (no tensor axis)."""
        return all(n == 1 for a, n in self.mesh.shape.items() if a not in self.batch_axes)

    def batch_dim(self, spec) -> int | None:
        """The dimension a leaf of ``spec`` is split on over the batch axes and nothing else.

        ``None`` where it is replicated or any of its dimensions is sharded otherwise
        (over a tensor axis): such a leaf is left to XLA's partitioner.
        """
        if spec is None:
            return None
        axes = [tuple(a for a in spec_axes(e) if self.mesh.shape[a] > 1) for e in spec]
        sharded = [d for d, a in enumerate(axes) if a]  # axes of one rank shard nothing
        batch = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        if len(sharded) != 1 or axes[sharded[0]] != batch:
            return None
        return sharded[0]

    def on_batch(self, ndim: int, dim=None) -> NamedSharding:
        """An array of ``ndim`` dimensions split on ``dim`` over the batch axes (or replicated)."""
        return self.sharding(None if dim is None else P(*(
            self.axis if k == dim else None for k in range(ndim))))

    def compiling(self):
        """Lowerings take their placement from the avals' shardings."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def tracing(self, leaves: list, unreduced: list | None = None):
        """While the function is traced: the leaves to call it on, and what each one is.

        Yields ``leaves`` with each leaf that ``cast`` names a dtype for replaced by its
        cast (NOTE [Mixed precision]); inside, ``program_leaves`` tells which of those are
        sharded or cast (NOTE [One collective per layer]). After, ``unreduced`` (if given)
        gets the index of each leaf ``reduce`` names a dtype for that no per-rank stack
        took (``check_reduced``).
        """
        casts = self.cast or (None,) * len(leaves)
        reduces = self.reduce or (None,) * len(leaves)
        read, known, reduced = [], {}, set()
        for x, spec, dtype, r in zip(leaves, self.specs, casts, reduces, strict=True):
            cast = dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype)
            read.append(x.astype(dtype) if cast else x)
            if spec is not None or cast or r is not None:
                known[id(read[-1])] = ProgramLeaf(x, self.batch_dim(spec),
                                                  dtype if cast else None, r)
        token = TRACING.set((self, known, reduced))
        try:
            yield read
        finally:
            TRACING.reset(token)
        if unreduced is not None:
            unreduced.extend(k for k, (x, r) in enumerate(zip(read, reduces, strict=True))
                             if r is not None and id(x) not in reduced)

    def call(self, fn: Callable, read: list):
        """``fn(read)`` inside ``tracing``, a stock scan's layer gathered as one buffer.

        NOTE [Packed scans] (``_packed_scans.py``): each leaf split over the batch axes
        alone is followed into the scans that slice it, and gathered there with
        ``gathered``; over one batch axis, per rank where the function computes the same
        on each rank's rows (NOTE [Per-rank scans] in ``_per_rank_scans.py``).
        """
        _, found = program_leaves(read)
        # The parameters' and state's splits: a batch-split argument is never gathered.
        dims = [None if f is None or b else f.dim
                for f, b in zip(found, self.batch, strict=True)]
        per_rank = None
        if len(self.batch_axes) == 1 and self.batch_only and not any(
                r is not None for r in self.reduce):  # NOTE [Per-rank scans]
            per_rank = per_rank_scans(self.mesh, self.batch_axes[0], self.specs, self.batch,
                                      fn)
        return packed_scans(fn, read, dims, self.gathered, per_rank)

    def check_reduced(self, jaxpr, unreduced: list, wanted: list) -> None:
        """Refuses a program that cannot sum a leaf's gradient in the dtype ``reduce`` asks.

        ``jaxpr``: the program's function traced (``tracing`` around it), ``unreduced`` what
        ``tracing`` reported, ``wanted``: per leaf, whether its gradient is asked for and
        some result reads it. Such a leaf must be read by per-rank stacks only (NOTE
        [Per-rank stacks]); anywhere else XLA's partitioner sums in the compute dtype.
        """
        reduces = self.reduce or (None,) * len(wanted)
        refuse_unreduced([
            r if r is not None and w and (k in unreduced or read_outside(jaxpr, k)) else None
            for k, (r, w) in enumerate(zip(reduces, wanted, strict=True))])

    def gathered(self, arrays: list, dims: list, dtypes=None) -> list:
        """``arrays`` (one layer's, global shapes) replicated, sharded ones in one all-gather.

        ``dims``: per array the dimension it is sharded on, or ``None`` (left as it is).
        ``dtypes``: per array the dtype it is read in, cast before the gather (``None``:
        its own; NOTE [Mixed precision]). One collective per dtype (NOTE [One collective
        per layer]).
        """
        arrays = [a if t is None else a.astype(t)
                  for a, t in zip(arrays, dtypes or [None] * len(arrays), strict=True)]
        out = list(arrays)
        for group in sharded_by_dtype(arrays, dims):
            buffer = pack_by_rank([arrays[k] for k in group], [dims[k] for k in group],
                                  self.size)
            buffer = jax.lax.with_sharding_constraint(buffer, self.on_batch(2, 0))
            buffer = jax.lax.with_sharding_constraint(buffer, self.sharding())
            parts = unpack_by_rank(buffer, [arrays[k].shape for k in group],
                                   [dims[k] for k in group], self.size)
            for k, part in zip(group, parts, strict=True):
                out[k] = part
        return out

    def scattered(self, grads: list, dims: list, dtypes=None) -> list:
        """One layer's gradients, summed over ranks and sharded on ``dims``, one collective.

        ``grads`` are what each rank's part of the computation contributes (global shapes,
        sums pending); those with a dim in ``dims`` are packed and reduced as one buffer
        per dtype, the rest left to XLA (NOTE [One collective per layer]). Each is cast
        to its entry of ``dtypes`` after (``None``: left in the dtype it was reduced in;
        NOTE [Mixed precision]).
        """
        out = list(grads)
        for group in sharded_by_dtype(grads, dims):
            buffer = pack_by_rank([grads[k] for k in group], [dims[k] for k in group],
                                  self.size)
            buffer = jax.lax.with_sharding_constraint(buffer, self.on_batch(2, 0))
            parts = unpack_by_rank(buffer, [grads[k].shape for k in group],
                                   [dims[k] for k in group], self.size)
            for k, part in zip(group, parts, strict=True):
                out[k] = jax.lax.with_sharding_constraint(
                    part, self.on_batch(part.ndim, dims[k]))
        return [g if t is None else g.astype(t)
                for g, t in zip(out, dtypes or [None] * len(out), strict=True)]

    def leaf_specs(self, n: int) -> tuple:
        """Per leaf, its ``PartitionSpec`` over the mesh (``None``: replicated)."""
        return self.specs

    def traced(self, local: LeafSpec, spec) -> LeafSpec:
        """The global spec of a local argument placed by ``spec``."""
        if spec is None:
            return local
        shape = list(local.shape)
        for d, entry in enumerate(spec):
            for a in spec_axes(entry):
                shape[d] *= self.mesh.shape[a]
        return dataclasses.replace(local, shape=tuple(shape))

    def sharding(self, spec=None) -> NamedSharding:
        """The sharding of an array placed by ``spec`` (``None``: replicated)."""
        return NamedSharding(self.mesh, P() if spec is None else spec)

    def result_specs(self, traced_out, n_out: int, traced_specs) -> tuple:
        """Outputs whose leading dimension is the global batch are split on it."""
        batch = [s.shape[0] for s, b in zip(traced_specs, self.batch, strict=True) if b]
        size = batch[0] if batch else None
        return tuple(P(self.axis) if k < n_out and size is not None and s.shape
                     and s.shape[0] == size else None for k, s in enumerate(traced_out))

    def pack_plan(self, avals, alone=None):
        """Every array alone, one buffer each (NOTE [SPMD programs])."""
        return tuple(Alone(k) for k in range(len(avals))), tuple(
            (tuple(a.shape), np.dtype(a.dtype)) for a in avals)

    def constrain(self, x, sharding):
        """``x`` as a traced result leaves the program: with its sharding."""
        return jax.lax.with_sharding_constraint(x, sharding)

    def pull(self, pull: Callable, cotangents, sharded_outputs, index) -> list:
        """The gradients for ``cotangents``, with FSDP's mean for leaves not in the batch.

        ``pull``: the VJP in torch's convention; ``sharded_outputs``: per cotangent,
        whether its output is batch-sharded; ``index``: per gradient, its leaf.
        """
        n = self.size
        batch_leaves = [self.batch[i] for i in index]
        if not any(sharded_outputs):  # replicated outputs only: one global loss
            return pull(cotangents)
        if all(sharded_outputs):
            return [g if b else g / n
                    for g, b in zip(pull(cotangents), batch_leaves, strict=True)]
        # Both: the batch-sharded part is averaged, the replicated part is not.
        zero = [jnp.zeros_like(c) for c in cotangents]
        part_s = pull([c if s else z for c, z, s in
                       zip(cotangents, zero, sharded_outputs, strict=True)])
        part_r = pull([z if s else c for c, z, s in
                       zip(cotangents, zero, sharded_outputs, strict=True)])
        return [gs + gr if b else gs / n + gr
                for gs, gr, b in zip(part_s, part_r, batch_leaves, strict=True)]

    def residual_shardings(self, compiled, n_results: int, count: int) -> list:
        """The partitioner's shardings of the residuals, read from the compiled forward."""
        return jtu.tree_leaves(compiled.output_shardings)[n_results : n_results + count]

    def executable(self, compiled, in_avals) -> Callable[..., list]:
        """Local arrays in, local shards out: each is this process's part of a global one."""
        in_avals = jtu.tree_leaves(in_avals)
        device = self.mesh.local_devices[0]

        def shard(aval, x):
            if not isinstance(x, jax.Array):  # an empty tensor's placeholder
                x = jax.device_put(x, device)
            return jax.make_array_from_single_device_arrays(aval.shape, aval.sharding, [x])

        def run(*args):
            flat, tree = jtu.tree_flatten(args)
            arrays = [shard(a, x) for a, x in zip(in_avals, flat, strict=True)]
            return [o.addressable_data(0) for o in compiled(*jtu.tree_unflatten(tree, arrays))]

        return run

