"""A FlaxModule's variables sharded over torch's ranks: DTensors in, local shards out.

What ``torchside.shard`` (NOTE [Sharded blocks] in ``integrations/_shard.py``) and FSDP2
need of a module's variables: assigning values into DTensor parameters (each rank its own
shard), a call's local shards, and the internal API through which ``shard`` replaces the
parameters. ``ShardedVariables`` is mixed into ``FlaxModule``; it reads the module's
adapter (``_adapter``), variable references (``_refs``) and caller.
"""

from __future__ import annotations

import jax
import torch
import torch.autograd.forward_ad as _fwAD

import bridge
from torchside import _errors, _shard_errors


def assign(tensor: torch.Tensor, value, name: str) -> None:
    """Copies a JAX value into a variable's tensor in place (a DTensor: its own shard).

    Every rank computed the same full value; each keeps the shard its placements give it,
    without communication.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    source = _to_torch(tensor, value, name)
    if isinstance(tensor, DTensor):
        source = distribute_tensor(source, tensor.device_mesh, tensor.placements,
                                   src_data_rank=None).to_local()
        tensor = tensor.to_local()
    tensor.copy_(source)


def assign_shard(tensor: torch.Tensor, value, name: str) -> None:
    """Copies this rank's shard of a variable, computed as such, into its tensor in place."""
    from torch.distributed.tensor import DTensor

    source = _to_torch(tensor, value, name)
    (tensor.to_local() if isinstance(tensor, DTensor) else tensor).copy_(source)


def _to_torch(tensor: torch.Tensor, value, name: str) -> torch.Tensor:
    return bridge.to_torch(jax.device_put(value, bridge.jax_device(tensor.device, name=name)),
                           name=name)


class ShardedVariables:
    """What sharding adds to a ``FlaxModule``'s variables (mixed into it)."""

    @property
    def _where(self) -> str:
        """The module's name in messages (``FlaxModule(Block)``)."""
        return self._caller.where

    def _local_shards(self, variables: list) -> list:
        """A sharded module's variables as a call reads them: each DTensor's local shard.

        ``to_local()``'s backward makes the local gradient a DTensor with the parameter's
        placements (NOTE [Sharded blocks] in ``integrations/_shard.py``).
        """
        if torch._C._are_functorch_transforms_active() or _fwAD._current_level >= 0:
            raise _errors.sharded_under_transform(self._caller.where)
        from torch.distributed.tensor import DTensor

        return [v.to_local() if isinstance(v, DTensor) else v for v in variables]

    def _shard_targets(self, axis_rules=None) -> list[tuple]:
        """Per variable ``(tensor, is_param, partition names)``, for ``torchside.shard``.

        The partition names are what Flax's partitioning metadata gives its dimensions
        (``None`` without metadata).

        Raises:
            ValueError: the module is already sharded.
        """
        if self._caller.plan is not None:
            raise _shard_errors.already_sharded(self._caller.where)
        names = self._adapter.partition_names(axis_rules)
        return [((scope._parameters if p else scope._buffers)[name], p, n)
                for (scope, name, p), n in zip(self._refs, names, strict=True)]

    def _shard_with(self, plan, parameters: dict) -> None:
        """Makes parameter ``i`` ``parameters[i]`` (a DTensor); calls then run over ``plan``."""
        for i, value in parameters.items():
            scope, name, _ = self._refs[i]
            scope._parameters[name] = value
        self._caller.place(plan)
