"""Flax variables as torch parameters and buffers, named by their Flax path."""

from __future__ import annotations

import jax
import torch

import bridge
from torchside import _errors


class FlaxScope(torch.nn.Module):
    """A namespace for the variables of one Flax scope; it has no forward of its own.

    Its forward pre-hooks run before every forward of the ``FlaxModule`` that owns it, as
    if it were called: hook-based weight transforms (``torch.nn.utils.prune``, the older
    ``weight_norm`` and ``spectral_norm``) recompute the weight there.
    """

    def forward(self, *args, **kwargs):  # noqa: D102
        raise _errors.scope_called()


def attach_variables(root: torch.nn.Module, names, is_param, values, device: torch.device):
    """Registers variable leaves on ``root`` under their Flax paths.

    Parameters become ``nn.Parameter``s, the rest persistent buffers; both own a copy of
    the values (torch owns the state, JAX only borrows it for a call). Entries are written
    straight into ``_parameters``/``_modules``/``_buffers`` so that a Flax name such as
    ``train`` or ``to`` cannot collide with a torch attribute.

    Args:
        root: the module to attach to.
        names: the dotted Flax path of each leaf (no part contains a dot).
        is_param: per leaf, whether it is a parameter.
        values: per leaf, its JAX array (on any device), or its ``jax.ShapeDtypeStruct``
            where ``device`` is ``meta``.
        device: the torch device the tensors are made on.

    Returns:
        ``(refs, scopes)``: per leaf ``(scope, name, is_param)``, and every scope made.
    """
    refs, scopes = [], []
    # On the meta device nothing is computed or copied: the values may be abstract.
    target = None if device.type == "meta" else bridge.jax_device(device, name="variables")
    for dotted, param, value in zip(names, is_param, values, strict=True):
        keys = dotted.split(".")
        scope = root
        for k in keys[:-1]:
            child = scope._modules.get(k)
            if child is None:
                child = FlaxScope()
                scope._modules[k] = child
                scopes.append(child)
            scope = child
        if target is None:
            tensor = torch.empty(value.shape, dtype=bridge.torch_dtype(value.dtype),
                                 device=device)
        else:
            tensor = bridge.to_torch(jax.device_put(value, target), copy=True, name=dotted)
        if param:
            scope._parameters[keys[-1]] = torch.nn.Parameter(
                tensor, requires_grad=bool(tensor.is_floating_point() or tensor.is_complex())
            )
        else:
            scope._buffers[keys[-1]] = tensor
        refs.append((scope, keys[-1], param))
    return tuple(refs), tuple(scopes)


def assign(tensor: torch.Tensor, value, name: str, local: bool = False) -> None:
    """Copies a JAX value into a variable's tensor in place (a DTensor's own shard only).

    ``local``: ``value`` is already this rank's shard (a sharded module's own init).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = jax.device_put(value, bridge.jax_device(tensor.device, name=name))
    source = bridge.to_torch(value, name=name)
    if local and isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    elif isinstance(tensor, DTensor):
        # Every rank computed the same full value; each keeps the shard its placements
        # give it, without communication.
        source = distribute_tensor(source, tensor.device_mesh, tensor.placements,
                                   src_data_rank=None).to_local()
        tensor = tensor.to_local()
    tensor.copy_(source)
