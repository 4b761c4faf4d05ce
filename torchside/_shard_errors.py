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


def mesh_not_1d(where: str, mesh) -> ValueError:
    """A mesh of several dimensions."""
    return ValueError(
        f"shard({where}): mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}; a block is "
        f"sharded over one. Pass a one-dimensional DeviceMesh over every rank, e.g. "
        f"init_device_mesh('cuda', (world_size,))."
    )


def mesh_not_every_rank(where: str, ranks: list, world: int) -> ValueError:
    """A one-dimensional mesh over some ranks only (a dimension of a larger mesh)."""
    return ValueError(
        f"shard({where}): mesh is over ranks {ranks} of a world of {world}; a block is "
        f"sharded over every rank (one JAX program spans all processes). Pass a "
        f"one-dimensional DeviceMesh over all {world} ranks, e.g. "
        f"init_device_mesh('cuda', ({world},)); meshes of two dimensions, and their "
        f"sub-meshes, are not supported yet."
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
