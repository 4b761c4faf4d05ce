"""Blocks bigger than one device: a FlaxModule's parameters sharded over torch's ranks.

NOTE [Sharded blocks]. ``shard(module, mesh)`` makes each floating parameter of a
``FlaxModule`` a DTensor over a ``DeviceMesh`` of one rank per process, of one dimension or
of several named ones (``("fsdp", "tensor")``): on each mesh dimension, ``Shard(dim)`` on
the dimension Flax's partitioning metadata names for that mesh axis
(``nn.with_partitioning``, or ``nn.with_logical_partitioning`` with ``axis_rules``; in NNX,
``nnx.with_partitioning``, whose names ``axis_rules`` maps where it has a rule), else
``Replicate()``; a parameter without metadata, FSDP-style, on the last dimension that
divides by the batch axes' size (scanned stacks keep their layer axes first, so each scan
iteration gathers its own layer) over the batch axes, replicated over the others. The
batch is split over ``batch_axes`` (the first mesh dimension by default, torch's ``("dp",
"tp")`` order); the ranks along any other dimension see the same rows, as tensor
parallelism needs. Buffers stay plain tensors, the same on every rank.

A call then runs one SPMD program over JAX's distributed runtime (a ``flaxside`` program
placed ``OnMesh``, NOTE [SPMD programs]): each rank passes its parameters' local shards and
its local batch (every tensor argument is its shard of the batch on dimension 0),
XLA's partitioner gathers each layer's parameters inside the scan and reduces their
gradients, and each rank receives its own rows of the outputs and its own shards of the
gradients: the module reads each DTensor parameter through ``to_local()`` before the
resolve step, whose backward makes the local gradient a DTensor with the parameter's
placements. Gradients
are reduced once, in the program, with FSDP's mean, and FSDP2 must not reduce them again:
leave the block's parameters out of an enclosing ``fully_shard`` (``ignored_params``).

``mp_policy`` is FSDP2's ``MixedPrecisionPolicy`` with FSDP2's meaning: the DTensor
shards (and an optimizer's state of them) stay in their dtype; inside the program each
floating parameter is read in ``param_dtype``, cast from the local shard before it is
gathered, and its gradient arrives in the parameter's dtype. Gradients are summed over the
ranks in ``reduce_dtype`` (``None``: ``param_dtype``), which only a ``remat_stack`` run per
rank can do (NOTE [Mixed precision] in ``flaxside/mesh/_on_mesh.py``): a program that reads
such a parameter elsewhere is refused at its first call rather than reduced in another
dtype. A forward pre-hook casts floating inputs to ``param_dtype``
(``cast_forward_inputs``) and a forward hook floating outputs to ``output_dtype``, as
``fully_shard``'s hooks do.

JAX's distributed runtime comes up from torch.distributed's rendezvous at the first
``shard``: the same ranks and world, ``MASTER_ADDR`` and a port of its own that rank 0
picks and broadcasts, each process owning only its rank's device (its CUDA device, or its
one CPU device, with gloo collectives on the CPU). It must start before JAX has made its
backends, so build the model under ``torch.device("meta")`` (which starts none) and call
``shard`` before anything else runs JAX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import warnings
from typing import NamedTuple

import jax
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from jax.sharding import PartitionSpec as P

import bridge as bi
from flaxside.internal import OnMesh, spec_axes
from torchside import _errors, _shard_errors
from torchside.integrations._shard_specs import batch_axes_on, dtensor_placements, leaf_spec
from torchside.integrations._shard_specs import jax_mesh as jax_mesh_of

DEFAULT_AXIS = "shard"


def shard(module, mesh=None, *, axis_rules=None, mp_policy=None, batch_axes=None):
    """Shards a ``FlaxModule``'s parameters over torch's ranks; its calls become SPMD.

    In the spirit of ``fully_shard``: in place, returning the module. See NOTE [Sharded
    blocks] in ``torchside/integrations/_shard.py`` for what is sharded where and what a call does.

    Args:
        module: the ``FlaxModule``, best built under ``torch.device("meta")``; then
            ``to_empty(device=...)`` and ``reset_parameters()``, which initializes each
            rank's shards only.
        mesh: a ``torch.distributed.DeviceMesh`` over every rank (not a dimension of a
            larger mesh): one-dimensional, or of several named dimensions (``("fsdp",
            "tensor")``); ``None`` makes a one-dimensional one over every rank, on the CPU
            or, where CUDA is available, each rank's current GPU.
        axis_rules: Flax logical axis rules (``(("embed", "shard"), ...)``) for
            parameters made with ``nn.with_logical_partitioning`` (or an NNX factory's
            ``nnx.with_partitioning`` with logical names).
        batch_axes: the mesh dimension (a name, or a tuple of names) the batch is split
            over, FSDP's; ``None``: the mesh's first. On a mesh of two dimensions
            (``("fsdp", "tensor")``) the ranks along the other see the same rows, as
            tensor parallelism needs, and parameters are sharded over it only where
            Flax's partitioning metadata names it.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``, as ``fully_shard``
            takes it; dtypes ``torch.bfloat16``, ``torch.float16``, ``torch.float32`` or
            ``None``. A ``reduce_dtype`` other than ``None`` or ``param_dtype`` needs the
            parameters read only by ``flaxside.remat_stack`` layers run per rank (NOTE
            [Per-rank stacks]); other blocks refuse it at their first call, and a mesh
            with a dimension of more than one rank outside one batch axis refuses it here.

    Returns:
        The module.

    Raises:
        RuntimeError: torch.distributed is not initialized, JAX's backends already exist
            (JAX's distributed runtime must start first), or a runtime started elsewhere
            has another world, another process id than the rank, or several devices a
            process.
        ValueError: the mesh is not over every rank, has several dimensions and no names,
            ``batch_axes`` names none of its dimensions, a parameter's partition names put
            one mesh axis on two of its dimensions, the module is already sharded, or a
            field of ``mp_policy`` is not supported or not on this mesh (the module is
            left unchanged).
        TypeError: ``mp_policy`` is not a ``MixedPrecisionPolicy``.

    Example:
        Under ``torchrun --nproc_per_node 2`` (``examples/train_sharded.py`` runs it whole)::

            dist.init_process_group("gloo")
            with torch.device("meta"):
                block = FlaxModule(Deep(), example_args=(torch.zeros(32, 64),))
            shard(block)                      # parameters become DTensors over the ranks
            block.to_empty(device="cpu")
            block.reset_parameters()          # each rank initializes its own shards

        Mixed precision as FSDP2 writes it (float32 shards, bfloat16 compute)::

            shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    where = module._where
    precision = _precision(mp_policy, where)
    if not dist.is_available() or not dist.is_initialized():
        raise _shard_errors.shard_without_process_group(where)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise _shard_errors.mesh_unnamed(where, mesh)
        names = (DEFAULT_AXIS,)
    batch_axes = batch_axes_on(batch_axes, tuple(names), tuple(mesh.shape), where)
    ranks = mesh.mesh.numpy()
    if sorted(ranks.ravel().tolist()) != list(range(dist.get_world_size())):
        raise _shard_errors.mesh_not_every_rank(where, ranks.ravel().tolist(),
                                                dist.get_world_size())
    targets = module._shard_targets(axis_rules)  # refuses a module already sharded
    sizes = dict(zip(names, mesh.shape, strict=True))  # in mesh order
    specs = [leaf_spec(name, tuple(t.shape), sizes, flax_names, batch_axes, where)
             if is_param and (t.is_floating_point() or t.is_complex()) else None
             for name, (t, is_param, flax_names) in zip(module._adapter.names, targets,
                                                         strict=True)]
    idle = [a for a, n in sizes.items() if a not in batch_axes and n > 1
            and not any(a in spec_axes(e) for spec in specs if spec is not None for e in spec)]
    if idle:  # e.g. axis_rules that name no parameter dimension for it (a typo, or none)
        warnings.warn(_shard_errors.idle_axes(where, idle, sizes, batch_axes), stacklevel=2)
    casts, reduces = [], []
    for t, is_param, _ in targets:
        # FSDP2 casts floating parameters of another dtype than param_dtype (_fsdp_param.py).
        casts.append(precision.param_dtype if is_param and t.is_floating_point()
                     and precision.param_dtype not in (None, t.dtype) else None)
        # FSDP2's reduce_dtype: None, or the dtype the gradient is computed in, sums as is.
        computed = casts[-1] or t.dtype
        reduces.append(precision.reduce_dtype if is_param and t.is_floating_point()
                       and precision.reduce_dtype not in (None, computed) else None)
    per_rank = len(batch_axes) == 1 and all(n == 1 for a, n in sizes.items()
                                            if a not in batch_axes)
    if not per_rank and any(r is not None for r in reduces):
        raise _shard_errors.reduce_dtype_on_mesh(where, precision.reduce_dtype, tuple(names),
                                                 tuple(mesh.shape), batch_axes)
    start_jax_distributed(mesh.device_type)
    # Position (i, j) of the mesh is rank mesh.mesh[i, j], torch's and JAX's alike (process
    # id = rank: start_jax_distributed), so that DTensor's shard (i, j) and JAX's are one.
    devices = jax.devices()
    if len(devices) != ranks.size:  # which device a process meant would be a guess
        raise _shard_errors.jax_devices_per_process(devices, ranks.size)
    jax_mesh = jax_mesh_of(ranks, tuple(names), {d.process_index: d for d in devices})
    parameters = {}
    for i, ((t, is_param, _), spec) in enumerate(zip(targets, specs, strict=True)):
        if not is_param:
            continue
        placements = dtensor_placements(spec, tuple(names))
        if t.device.type == "meta":
            local_shape = [n // math.prod(sizes[a] for a in spec_axes(e))
                           for n, e in zip(t.shape, spec or (None,) * t.dim(), strict=True)]
            value = DTensor.from_local(torch.empty(local_shape, dtype=t.dtype, device="meta"),
                                       mesh, placements, run_check=False, shape=t.shape,
                                       stride=t.stride())
        else:
            value = distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)
        parameters[i] = torch.nn.Parameter(value, requires_grad=t.requires_grad)
    on_mesh = OnMesh(jax_mesh, batch_axes, (), ())
    module._shard_with(ShardPlan(mesh, on_mesh, tuple(specs), *(tuple(
        None if c is None else bi.numpy_dtype(c) for c in column)
        for column in (casts, reduces))), parameters)
    if precision.param_dtype is not None and precision.cast_forward_inputs:
        module.register_forward_pre_hook(CastFloating(precision.param_dtype).inputs,
                                         with_kwargs=True)
    if precision.output_dtype is not None:
        module.register_forward_hook(CastFloating(precision.output_dtype).outputs)
    return module


class Precision(NamedTuple):
    """What ``shard`` reads of a ``MixedPrecisionPolicy`` (torch dtypes, or ``None``)."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _precision(policy, where: str) -> Precision:
    """``policy`` checked field by field (before ``shard`` changes anything)."""
    if policy is None:
        return Precision(None, None, None, False)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise _errors.mp_policy_type(where, policy)
    names = "torch.bfloat16, torch.float16, torch.float32 or None"
    why = "JAX runs without 64-bit types here, and a policy's dtypes are floating"
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, field)
        if value is not None and value not in _DTYPES:
            raise _errors.mp_policy_field(where, field, value, names, why)
    if not isinstance(policy.cast_forward_inputs, bool):
        raise _errors.mp_policy_field(where, "cast_forward_inputs",
                                      policy.cast_forward_inputs, "True or False",
                                      "it says whether floating inputs are cast")
    return Precision(policy.param_dtype, policy.reduce_dtype, policy.output_dtype,
                     policy.cast_forward_inputs)


class CastFloating:
    """Forward hooks casting every floating tensor of a call, or its output, to ``dtype``.

    As FSDP2's ``_cast_fp_tensor`` (``_fsdp_common.py``): floating tensors of another
    dtype only, through nested lists, tuples and dicts. A class, not a closure, so that a
    deep copy or a pickled module keeps it.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def inputs(self, module, args, kwargs):
        """A forward pre-hook (``with_kwargs=True``): the call's tensors cast."""
        return pytree.tree_map(self._cast, (args, kwargs))

    def outputs(self, module, args, output):
        """A forward hook: the output's tensors cast."""
        return pytree.tree_map(self._cast, output)


class ShardPlan:
    """What ``shard`` decided: the meshes, and per variable its ``PartitionSpec``.

    Attributes:
        mesh: torch's ``DeviceMesh``.
        on_mesh: the JAX side's ``flaxside.internal.OnMesh`` (its mesh and batch axes; the
            leaves' specs are filled per call by ``placement``).
        specs: per variable, its ``PartitionSpec`` over the mesh, or ``None`` (replicated).
        casts: per variable, the dtype the program reads it in (``mp_policy``'s
            ``param_dtype``, as a numpy dtype), or ``None``.
        reduces: per variable, the dtype its gradient is summed over the ranks in
            (``mp_policy``'s ``reduce_dtype``, as a numpy dtype), or ``None``: as computed.
    """

    __slots__ = ("mesh", "on_mesh", "specs", "casts", "reduces")

    def __init__(self, mesh, on_mesh: OnMesh, specs: tuple, casts: tuple = (),
                 reduces: tuple = ()):
        self.mesh, self.on_mesh, self.specs = mesh, on_mesh, specs
        self.casts = casts or (None,) * len(specs)
        self.reduces = reduces or (None,) * len(specs)

    def placement(self, layout, arg_ndims) -> OnMesh:
        """Where a call's programs run (``OnMesh``), per leaf of ``layout``.

        Variables as planned, the RNG slot replicated, every tensor argument (but a 0-d
        one) its rank's shard of the batch on dimension 0, split over the batch axes.
        """
        args = [P(self.on_mesh.axis) if ndim else None for ndim in arg_ndims]
        specs = layout.of_leaves(self.specs, None, args)
        batch = layout.of_leaves([False] * len(self.specs), False,
                                 [s is not None for s in args])
        cast = layout.of_leaves(self.casts, None, [None] * len(args))
        reduce = layout.of_leaves(self.reduces, None, [None] * len(args))
        return dataclasses.replace(self.on_mesh, specs=tuple(specs), batch=tuple(batch),
                                   cast=tuple(cast), reduce=tuple(reduce))

    def sharding(self, spec):
        """The JAX sharding of a variable placed by ``spec`` (``None``: replicated)."""
        return self.on_mesh.sharding(spec)


# -- JAX's distributed runtime, from torch's --------------------------------------------------
def start_jax_distributed(device_type: str) -> None:
    """Brings up JAX's distributed runtime with torch.distributed's ranks (once)."""
    if jax.distributed.is_initialized():
        if jax.process_count() != dist.get_world_size():
            raise _shard_errors.jax_world_mismatch(jax.process_count(), dist.get_world_size())
        if jax.process_index() != dist.get_rank():
            raise _shard_errors.jax_process_mismatch(jax.process_index(), dist.get_rank())
        return
    if _backends_started():
        raise _shard_errors.jax_backends_started()
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
