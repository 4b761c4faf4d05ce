"""Programs over a mesh of processes: each process passes and receives its own shards.

NOTE [SPMD programs]. A block sharded over processes (one device each) runs as one SPMD
program: parameters are sharded over the mesh axis, the batch too, and XLA's partitioner
inserts the collectives, inside a scan one layer's gather per iteration. The caller on
each process knows only its local pieces, so ``SpmdProgram`` speaks local shapes to it:

* its ``specs``, ``out_specs``, ``grad_specs`` and residual specs are what this process
  passes and receives; the traced bodies (``Program``'s) see the global shapes;
* an executable takes the local arrays, makes each the process's shard of a global array
  (``jax.make_array_from_single_device_arrays``, no copy), runs, and returns each result's
  local shard (``addressable_data(0)``);
* results whose leading dimension is the global batch are sharded over the axis on it,
  every other result (a loss, state updates) is replicated; gradients have their leaf's
  sharding; residuals take the sharding the partitioner chose, recorded at compilation;
* gradients of what is not sharded over the batch (parameters, state) follow
  FSDP's mean: the contributions of batch-sharded outputs, whose cotangents are each
  process's own loss, are divided by the number of processes, as FSDP2 and DDP average
  the ranks' gradients; replicated outputs (a loss computed inside) are one loss, already
  global, and are not divided. Gradients of batch-sharded inputs are each process's own.
* small arrays are not packed into shared buffers: a packed buffer would mix shardings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxside._conventions import conj
from flaxside._program import Program
from flaxside._specs import LeafSpec, ResidualMap

jtu = jax.tree_util


@dataclasses.dataclass(frozen=True)
class SpmdLayout:
    """How a call's leaves lie over a one-axis mesh of processes.

    Attributes:
        mesh: the JAX mesh, one device per process, in process order.
        axis: its axis name.
        dims: per leaf, the dimension sharded over ``axis`` (``None``: replicated, every
            process passes the whole value).
        batch: per leaf, whether it is a batch-sharded argument (its gradient is the
            process's own; every other leaf's gradient follows FSDP's mean).
    """

    mesh: jax.sharding.Mesh
    axis: str
    dims: tuple[int | None, ...]
    batch: tuple[bool, ...]

    @property
    def size(self) -> int:
        """How many processes share the axis."""
        return self.mesh.shape[self.axis]

    def sharding(self, ndim: int, dim: int | None) -> NamedSharding:
        """The sharding of an array of ``ndim`` dimensions sharded on ``dim``."""
        spec = [None] * ndim
        if dim is not None:
            spec[dim] = self.axis
        return NamedSharding(self.mesh, P(*spec))

    def global_shape(self, shape, dim: int | None) -> tuple[int, ...]:
        """The global shape of a local ``shape`` sharded on ``dim``."""
        shape = list(shape)
        if dim is not None:
            shape[dim] *= self.size
        return tuple(shape)


class SpmdProgram(Program):
    """``Program`` over a mesh: local shapes outside, global ones inside (NOTE above).

    Args:
        fn: as for ``Program``.
        specs: per leaf its *local* ``LeafSpec`` (what this process passes).
        layout: the ``SpmdLayout`` of the leaves.
        name: used in error messages.
        fence: as for ``Program``; the fence is replicated.
    """

    def __init__(self, fn: Callable, specs: Sequence[LeafSpec], layout: SpmdLayout, *,
                 name: str = "program", fence: bool = False):
        self.layout = layout
        specs = tuple(specs)
        self._global_of: dict[int, LeafSpec] = {}
        self._sharding_of: dict[int, NamedSharding] = {}
        global_specs = [LeafSpec(layout.global_shape(s.shape, d), s.dtype, s.diff)
                        for s, d in zip(specs, layout.dims, strict=True)]
        batch = [g.shape[d] for g, d, b in zip(global_specs, layout.dims, layout.batch,
                                               strict=True) if b and d == 0]
        self._global_batch = batch[0] if batch else None
        super().__init__(fn, global_specs, name=name, fence=fence, device=None)
        # Outside, everything is local: what this process passes and receives.
        self.specs = self._localize(global_specs, layout.dims, specs)
        out_dims = tuple(self._result_dim(k, s) for k, s in enumerate(self.out_specs))
        self.out_specs = self._localize(self.out_specs, out_dims)
        self._out_dims = out_dims
        self.grad_specs = tuple(self.specs[i] for i in self.diff_index)
        self._rmap_local: ResidualMap | None = None

    # -- local <-> global -----------------------------------------------------------------
    def _localize(self, global_specs, dims, local=None) -> tuple[LeafSpec, ...]:
        """Local specs of ``global_specs`` sharded on ``dims``, remembered for lowering."""
        out = []
        for k, (g, d) in enumerate(zip(global_specs, dims, strict=True)):
            sharding = self.layout.sharding(len(g.shape), d)
            spec = local[k] if local is not None else LeafSpec(
                tuple(sharding.shard_shape(g.shape)), g.dtype, g.diff)
            self._global_of[id(spec)] = g
            self._sharding_of[id(spec)] = sharding
            out.append(spec)
        return tuple(out)

    def _result_dim(self, k: int, spec: LeafSpec) -> int | None:
        """Outputs whose leading dimension is the global batch are sharded on it."""
        if (k < self.n_out and self._global_batch is not None and spec.shape
                and spec.shape[0] == self._global_batch):
            return 0
        return None

    def _avals(self, specs) -> list:
        return [jax.ShapeDtypeStruct(self._global_of[id(s)].shape, s.dtype,
                                     sharding=self._sharding_of[id(s)]) for s in specs]

    def _fence_avals(self) -> tuple:
        if not self.fence:
            return ()
        return (jax.ShapeDtypeStruct((1,), np.uint8, sharding=self.layout.sharding(1, None)),)

    # -- hooks of Program's traced bodies ------------------------------------------------
    def _pack_plan(self, avals, alone=None):
        # Nothing packed: a buffer that concatenates arrays of different shardings would
        # reshard them. Every array alone, one buffer each.
        return tuple(("alone", k) for k in range(len(avals))), tuple(
            (tuple(a.shape), np.dtype(a.dtype)) for a in avals)

    def _place_results(self, results: list) -> list:
        if not hasattr(self, "_out_dims"):  # the first, abstract trace: nothing placed yet
            return results
        return [jax.lax.with_sharding_constraint(r, self.layout.sharding(r.ndim, d))
                for r, d in zip(results, self._out_dims, strict=True)]

    def _pull(self, vjp, cotangents) -> list:
        """The gradients for ``cotangents``, with FSDP's mean for non-batch leaves."""
        n = self.layout.size
        sharded = [self._out_dims[k] is not None for k in self.diff_out_index]
        batch_leaf = [self.layout.batch[i] for i in self.diff_index]
        if not any(sharded):  # replicated outputs only: one global loss
            grads = self._full_pull(vjp, cotangents)
        elif all(sharded):
            grads = [g if b else g / n for g, b in zip(
                self._full_pull(vjp, cotangents), batch_leaf, strict=True)]
        else:  # both: the batch-sharded part is averaged, the replicated part is not
            zero = [jnp.zeros_like(c) for c in cotangents]
            part_s = self._full_pull(vjp, [c if s else z for c, z, s in
                                           zip(cotangents, zero, sharded, strict=True)])
            part_r = self._full_pull(vjp, [z if s else c for c, z, s in
                                           zip(cotangents, zero, sharded, strict=True)])
            grads = [gs + gr if b else gs / n + gr
                     for gs, gr, b in zip(part_s, part_r, batch_leaf, strict=True)]
        return [jax.lax.with_sharding_constraint(
                    g, self.layout.sharding(g.ndim, self.layout.dims[i]))
                for g, i in zip(grads, self.diff_index, strict=True)]

    def _full_pull(self, vjp, cotangents) -> list:
        return [conj(g) for g in vjp(self._cotangents(cotangents))]

    def _cotangents(self, cotangents):
        """Full cotangents for the outputs (global shapes) from the differentiable ones."""
        cots = iter(cotangents)
        full = []
        for s in self.out_specs[: self.n_out]:
            g = self._global_of[id(s)]
            if s.diff:
                full.append(conj(next(cots)))
            elif jnp.issubdtype(g.dtype, jnp.inexact):
                full.append(jnp.zeros(g.shape, g.dtype))
            else:
                full.append(np.zeros(g.shape, jax.dtypes.float0))
        return full

    # -- residuals and executables ---------------------------------------------------------
    def residual_map(self) -> ResidualMap:
        """The residual map, its residual specs local (the partitioner's shardings).

        The residuals' shardings are the partitioner's choice, known once
        ``forward_with_residuals`` is compiled: it is compiled here, once.
        """
        with self._lock:
            if self._rmap_local is None:
                rmap = super().residual_map()
                compiled = self._fwd_res_lowered.compile()
                shardings = jtu.tree_leaves(compiled.output_shardings)[len(self.out_specs):]
                local = []
                for g, sharding in zip(rmap.residual_specs, shardings, strict=True):
                    spec = LeafSpec(tuple(sharding.shard_shape(g.shape)), g.dtype)
                    self._global_of[id(spec)] = g
                    self._sharding_of[id(spec)] = sharding
                    local.append(spec)
                self._fwd_res_compiled = compiled
                self._rmap_local = dataclasses.replace(rmap, residual_specs=tuple(local))
        return self._rmap_local

    def _compile_program(self, kind: str) -> jax.stages.Compiled:
        if kind == "forward_with_residuals":
            self.residual_map()
            return self._fwd_res_compiled
        return super()._compile_program(kind)

    def _callable(self, kind: str, compiled: jax.stages.Compiled) -> Callable[..., list]:
        in_avals = jtu.tree_leaves((self._arg_avals(kind), self._fence_avals()))
        device = self.layout.mesh.local_devices[0]
        drop_map = kind == "forward_with_residuals"  # its results carry the residual map

        def shard(aval, x):
            if not isinstance(x, jax.Array):  # an empty tensor's placeholder
                x = jax.device_put(x, device)
            return jax.make_array_from_single_device_arrays(aval.shape, aval.sharding, [x])

        def run(*args):
            flat, tree = jtu.tree_flatten(args)
            arrays = [shard(a, x) for a, x in zip(in_avals, flat, strict=True)]
            out = compiled(*jtu.tree_unflatten(tree, arrays))
            return [o.addressable_data(0) for o in (out[0] if drop_map else out)]

        return run
