"""The errors of sharded blocks (``torchside.shard``), worded as ``_errors`` words the rest.

Each function returns the exception; the caller raises it. A message names what was
received, what was expected and how to fix it.
"""

from __future__ import annotations


def shard_without_process_group(where: str) -> RuntimeError:
    """``shard`` before ``torch.distributed`` is up."""
    return RuntimeError(
        f"shard({where}): torch.distributed is not initialized, so there are no ranks to "
        f"shard over. Call torch.distributed.init_process_group(...) first (torchrun sets "
        f"the environment it reads)."
    )


def mesh_unnamed(where: str, mesh) -> ValueError:
    """A mesh of several dimensions without names."""
    return ValueError(
        f"shard({where}): mesh has {mesh.ndim} dimensions {tuple(mesh.shape)} and no "
        f"names; a mesh of several dimensions needs them (they say which dimension the "
        f"batch is split over and which names Flax's partitioning metadata means). Build "
        f"it with names, e.g. init_device_mesh('cuda', (2, 2), "
        f"mesh_dim_names=('fsdp', 'tensor'))."
    )


def batch_axes_unknown(where: str, batch_axes, names) -> ValueError:
    """``batch_axes`` naming something but the mesh's dimensions, none, or one twice."""
    return ValueError(
        f"shard({where}): batch_axes={batch_axes!r}, but the mesh's dimensions are "
        f"{tuple(names)}; batch_axes names the dimensions the batch is split over (FSDP's): "
        f"one of those, or a tuple of distinct ones. Pass e.g. batch_axes={names[0]!r}, or "
        f"None for the first."
    )


def idle_axes(where: str, idle: list, sizes: dict, batch_axes: tuple) -> str:
    """A mesh dimension, not the batch's, that no parameter is split over (a warning)."""
    return (
        f"shard({where}): no parameter is split over mesh dimension(s) {idle} of the mesh "
        f"{sizes} (the batch is split over {batch_axes}), so each of their ranks computes "
        f"the same thing on the same rows. Name them in the parameters' partitioning "
        f"metadata, e.g. axis_rules=(('mlp', {idle[0]!r}), ('heads', {idle[0]!r}), ...) for "
        f"nn.with_logical_partitioning names, or add them to batch_axes to split the batch."
    )


def reduce_dtype_on_mesh(where: str, reduce_dtype, names: tuple, shape: tuple,
                         batch_axes: tuple) -> ValueError:
    """``mp_policy.reduce_dtype`` on a mesh no per-rank stack runs on."""
    return ValueError(
        f"shard({where}): mp_policy.reduce_dtype={reduce_dtype} differs from the compute "
        f"dtype, but the mesh {dict(zip(names, shape, strict=True))} with "
        f"batch_axes={batch_axes} has ranks outside one batch axis. Only a remat_stack run "
        f"per rank sums gradients in another dtype, and it runs per rank on a mesh whose "
        f"every dimension of more than one rank is the one batch axis; elsewhere XLA's "
        f"partitioner sums in the compute dtype. Pass reduce_dtype=None (or the "
        f"param_dtype), or a one-dimensional mesh."
    )


def axis_on_two_dims(where: str, name: str, names: tuple, axis: str) -> ValueError:
    """Partition names that put one mesh axis on two dimensions of a parameter."""
    return ValueError(
        f"shard({where}): parameter {name!r} has partition names {names} (mesh axes after "
        f"axis_rules), which shard two of its dimensions over the mesh axis {axis!r}; an "
        f"axis shards one dimension. Name {axis!r} for one dimension in its "
        f"nn.with_partitioning / nn.with_logical_partitioning (or in axis_rules)."
    )


def mesh_not_every_rank(where: str, ranks: list, world: int) -> ValueError:
    """A mesh over some ranks only (a dimension of a larger mesh)."""
    return ValueError(
        f"shard({where}): mesh is over ranks {ranks} of a world of {world}; a block is "
        f"sharded over every rank (one JAX program spans all processes). Pass the whole "
        f"DeviceMesh, over all {world} ranks, e.g. init_device_mesh('cuda', ({world},)) or "
        f"a mesh of named dimensions (batch_axes says which split the batch); a dimension "
        f"of a larger mesh (mesh['tp']) is not supported."
    )


def already_sharded(where: str) -> ValueError:
    """``shard`` twice."""
    return ValueError(f"shard({where}): the module is already sharded; shard it once.")


def jax_backends_started() -> RuntimeError:
    """JAX made its backends before its distributed runtime could start."""
    return RuntimeError(
        "shard: JAX's distributed runtime must start before JAX makes its backends, and "
        "something in this process already ran JAX (a FlaxModule built off the meta device, "
        "a JAX computation). Build the model under torch.device('meta') and call shard() "
        "before anything runs JAX, then to_empty() and reset_parameters(); or call "
        "jax.distributed.initialize(...) yourself first, with torch's ranks and world."
    )


def jax_world_mismatch(jax_processes: int, world: int) -> RuntimeError:
    """JAX's distributed runtime started with another world than torch's."""
    return RuntimeError(
        f"shard: JAX's distributed runtime has {jax_processes} processes but torch's "
        f"process group {world}; both must span the same ranks. Start JAX's with "
        f"num_processes={world} and process_id=torch.distributed.get_rank(), or let shard() "
        f"start it."
    )


def jax_process_mismatch(jax_process: int, rank: int) -> RuntimeError:
    """JAX's process id is not torch's rank."""
    return RuntimeError(
        f"shard: this process is JAX's process {jax_process} but torch's rank {rank}; a "
        f"sharded block places rank r's shards on JAX's process r. Start JAX's runtime "
        f"with process_id=torch.distributed.get_rank(), or let shard() start it."
    )


def jax_devices_per_process(devices: list, world: int) -> RuntimeError:
    """More than one JAX device per process."""
    return RuntimeError(
        f"shard: JAX sees {len(devices)} devices over {world} process(es) ({devices}); a "
        f"sharded block runs one device per process, the one its tensors are on. Start "
        f"JAX's runtime with local_device_ids=[the rank's GPU] (or let shard() start it), "
        f"and leave out XLA_FLAGS=--xla_force_host_platform_device_count on the CPU."
    )
