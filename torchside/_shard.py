"""Blocks bigger than one device: a FlaxModule's parameters sharded over torch's ranks.

NOTE [Sharded blocks]. ``shard(module, mesh)`` makes each floating parameter of a
``FlaxModule`` a DTensor over a one-dimensional ``DeviceMesh`` (one rank per process):
``Shard(dim)`` on the dimension Flax's partitioning metadata names for the mesh's axis
(``nn.with_partitioning``, or ``nn.with_logical_partitioning`` with ``axis_rules``), else,
FSDP-style, on the last dimension that divides by the mesh size (scanned stacks keep their
layer axes first, so each scan iteration gathers its own layer), else ``Replicate()``.
Buffers stay plain tensors, the same on every rank.

A call then runs one SPMD program over JAX's distributed runtime (a ``flaxside`` program
placed ``OnMesh``, NOTE [SPMD programs]): each rank passes its parameters' local shards and
its local batch (every tensor argument is its rank's shard of the batch on dimension 0),
XLA's partitioner gathers each layer's parameters inside the scan and reduces their
gradients, and each rank receives its own rows of the outputs and its own shards of the
gradients: the module reads each DTensor parameter through ``to_local()`` before the
resolve step, whose backward makes the local gradient a DTensor with the parameter's
placements. Gradients
are reduced once, in the program, with FSDP's mean, and FSDP2 must not reduce them again:
leave the block's parameters out of an enclosing ``fully_shard`` (``ignored_params``).

JAX's distributed runtime comes up from torch.distributed's rendezvous at the first
``shard``: the same ranks and world, ``MASTER_ADDR`` and a port of its own that rank 0
picks and broadcasts, each process owning only its rank's device (its CUDA device, or its
one CPU device, with gloo collectives on the CPU). It must start before JAX has made its
backends, so build the model under ``torch.device("meta")`` (which starts none) and call
``shard`` before anything else runs JAX.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import jax
import numpy as np
import torch
import torch.distributed as dist

from flaxside.internal import OnMesh
from torchside import _errors

DEFAULT_AXIS = "shard"


def shard(module, mesh=None, *, axis_rules=None):
    """Shards a ``FlaxModule``'s parameters over torch's ranks; its calls become SPMD.

    In the spirit of ``fully_shard``: in place, returning the module. See NOTE [Sharded
    blocks] in ``torchside/_shard.py`` for what is sharded where and what a call does.

    Args:
        module: the ``FlaxModule``, best built under ``torch.device("meta")``; then
            ``to_empty(device=...)`` and ``reset_parameters()``, which initializes each
            rank's shards only.
        mesh: a one-dimensional ``torch.distributed.DeviceMesh``; ``None`` makes one over
            every rank, on the CPU or, where CUDA is available, each rank's current GPU.
        axis_rules: Flax logical axis rules (``(("embed", "shard"), ...)``) for
            parameters made with ``nn.with_logical_partitioning``.

    Returns:
        The module.

    Raises:
        RuntimeError: torch.distributed is not initialized, or JAX's backends already
            exist (JAX's distributed runtime must start first).
        ValueError: the mesh is not one-dimensional, or the module is already sharded.

    Example:
        Under ``torchrun --nproc_per_node 2`` (``examples/train_sharded.py`` runs it whole)::

            dist.init_process_group("gloo")
            with torch.device("meta"):
                block = FlaxModule(Deep(), example_args=(torch.zeros(32, 64),))
            shard(block)                      # parameters become DTensors over the ranks
            block.to_empty(device="cpu")
            block.reset_parameters()          # each rank initializes its own shards
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    where = module._where
    if not dist.is_available() or not dist.is_initialized():
        raise _errors.shard_without_process_group(where)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise _errors.mesh_not_1d(where, mesh)
    targets = module._shard_targets(axis_rules)  # refuses a module already sharded
    start_jax_distributed(mesh.device_type)
    axis = (mesh.mesh_dim_names or (DEFAULT_AXIS,))[0]
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    jax_mesh = jax.sharding.Mesh(np.array(devices), (axis,))
    size = mesh.size()
    dims, parameters = [], {}
    for i, (t, is_param, flax_names) in enumerate(targets):
        dim = None
        if is_param and (t.is_floating_point() or t.is_complex()):
            dim = _sharded_dim(tuple(t.shape), size, axis, flax_names)
        dims.append(dim)
        if not is_param:
            continue
        placements = [Replicate()] if dim is None else [Shard(dim)]
        if t.device.type == "meta":
            local_shape = list(t.shape)
            if dim is not None:
                local_shape[dim] //= size
            value = DTensor.from_local(torch.empty(local_shape, dtype=t.dtype, device="meta"),
                                       mesh, placements, run_check=False, shape=t.shape,
                                       stride=t.stride())
        else:
            value = distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)
        parameters[i] = torch.nn.Parameter(value, requires_grad=t.requires_grad)
    module._shard_with(ShardPlan(mesh, OnMesh(jax_mesh, axis, (), ()), tuple(dims)),
                       parameters)
    return module


class ShardPlan:
    """What ``shard`` decided: the meshes, and per variable its sharded dimension.

    Attributes:
        mesh: torch's ``DeviceMesh``.
        on_mesh: the JAX side's ``flaxside.internal.OnMesh`` (its mesh and axis; the
            leaves' dimensions are filled per call by ``placement``).
        dims: per variable, the dimension sharded over the axis, or ``None``.
    """

    __slots__ = ("mesh", "on_mesh", "dims")

    def __init__(self, mesh, on_mesh: OnMesh, dims: tuple):
        self.mesh, self.on_mesh, self.dims = mesh, on_mesh, dims

    def placement(self, layout, arg_ndims) -> OnMesh:
        """Where a call's programs run (``OnMesh``), per leaf of ``layout``.

        Variables as planned, the RNG slot replicated, every tensor argument (but a 0-d
        one) its rank's shard of the batch on dimension 0.
        """
        args = [0 if ndim else None for ndim in arg_ndims]
        dims = layout.of_leaves(self.dims, None, args)
        batch = layout.of_leaves([False] * len(self.dims), False, [d is not None for d in args])
        return dataclasses.replace(self.on_mesh, dims=tuple(dims), batch=tuple(batch))

    def sharding(self, ndim: int, dim):
        """The JAX sharding of a variable of ``ndim`` dimensions sharded on ``dim``."""
        return self.on_mesh.sharding(ndim, dim)


def _sharded_dim(shape: tuple, size: int, axis: str, flax_names) -> int | None:
    """The dimension a parameter is sharded on: Flax's metadata, else FSDP-style."""
    if flax_names is not None:
        dims = [d for d, n in enumerate(flax_names) if n == axis]
        return dims[0] if dims and shape[dims[0]] % size == 0 else None
    for d in reversed(range(len(shape))):
        if shape[d] % size == 0 and shape[d] >= size:
            return d
    return None


# -- JAX's distributed runtime, from torch's --------------------------------------------------
def start_jax_distributed(device_type: str) -> None:
    """Brings up JAX's distributed runtime with torch.distributed's ranks (once)."""
    if jax.distributed.is_initialized():
        if jax.process_count() != dist.get_world_size():
            raise _errors.jax_world_mismatch(jax.process_count(), dist.get_world_size())
        return
    if _backends_started():
        raise _errors.jax_backends_started()
    if device_type == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port = [_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    options = {}
    if device_type == "cuda":  # under torchrun every process sees every GPU
        options["local_device_ids"] = [torch.cuda.current_device()]
    jax.distributed.initialize(f"{address}:{port[0]}", num_processes=dist.get_world_size(),
                               process_id=dist.get_rank(), **options)


def _backends_started() -> bool:
    try:  # private, feature-detected
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # pragma: no cover - layout of jax internals changed
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
