"""Flax variables as torch parameters and buffers, named by their Flax path."""

from __future__ import annotations

import torch

import bridge


class FlaxScope(torch.nn.Module):
    """A namespace for the variables of one Flax scope; it has no forward of its own."""

    def forward(self, *args, **kwargs):  # noqa: D102
        raise RuntimeError("FlaxScope only holds variables; call the FlaxModule that owns it.")


def attach_variables(root: torch.nn.Module, leaves):
    """Registers variable leaves on ``root`` under their Flax paths.

    Parameters become ``nn.Parameter``s, the rest persistent buffers; both own a copy of
    the values (torch owns the state, JAX only borrows it for a call). Entries are written
    straight into ``_parameters``/``_modules``/``_buffers`` so that a Flax name such as
    ``train`` or ``to`` cannot collide with a torch attribute.

    Args:
        root: the module to attach to.
        leaves: ``(dotted name, JAX array, is_param)`` per leaf, in the adapter's order.

    Returns:
        ``(refs, names)``: per leaf ``(scope, name, is_param)``, and the dotted names.
    """
    refs, names = [], []
    for dotted, value, is_param in leaves:
        keys = dotted.split(".")
        if not all(keys):
            raise ValueError(
                f"FlaxModule: the Flax variable path {dotted!r} has an empty part, which "
                f"cannot be a torch state_dict name. Rename the Flax submodule or variable."
            )
        scope = root
        for k in keys[:-1]:
            child = scope._modules.get(k)
            if child is None:
                child = FlaxScope()
                scope._modules[k] = child
            scope = child
        tensor = bridge.to_torch(value, copy=True, name=dotted)
        if is_param:
            scope._parameters[keys[-1]] = torch.nn.Parameter(
                tensor, requires_grad=bool(tensor.is_floating_point() or tensor.is_complex())
            )
        else:
            scope._buffers[keys[-1]] = tensor
        refs.append((scope, keys[-1], is_param))
        names.append(dotted)
    return tuple(refs), tuple(names)


def current_tensors(refs) -> list[torch.Tensor]:
    """The variables' tensors now (``.to()`` or ``load_state_dict`` may replace them)."""
    return [s._parameters[n] if p else s._buffers[n] for s, n, p in refs]
