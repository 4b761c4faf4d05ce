"""Flax variables as torch parameters and buffers, named by their Flax path."""

from __future__ import annotations

import jax
import torch

import bridge

jtu = jax.tree_util


class FlaxScope(torch.nn.Module):
    """A namespace for the variables of one Flax scope; it has no forward of its own."""

    def forward(self, *args, **kwargs):  # noqa: D102
        raise RuntimeError("FlaxScope only holds variables; call the FlaxModule that owns it.")


def _path_keys(path) -> list[str]:
    keys = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        key = str(key)
        if not key or "." in key:
            raise ValueError(
                f"FlaxModule: the Flax variable path {jtu.keystr(path)} has the part {key!r}, "
                f"which cannot be a torch state_dict name part (empty or containing '.'). "
                f"Rename the Flax submodule or variable."
            )
        keys.append(key)
    return keys


def attach_variables(root: torch.nn.Module, variables, trainable=("params",)):
    """Registers every variable leaf on ``root`` under its Flax path.

    Collections named in ``trainable`` become ``nn.Parameter``s, the others persistent
    buffers; both own a copy of the values (torch owns the state, JAX only borrows it for
    a call). Entries are written straight into ``_parameters``/``_modules``/``_buffers`` so
    that a Flax name such as ``train`` or ``to`` cannot collide with a torch attribute.

    Returns:
        ``(treedef, refs, names)``: the variables' treedef and, per leaf in flatten order,
        ``(scope, name, is_param)`` and the dotted path.
    """
    path_leaves, treedef = jtu.tree_flatten_with_path(variables)
    refs, names = [], []
    for path, leaf in path_leaves:
        keys = _path_keys(path)
        scope = root
        for k in keys[:-1]:
            child = scope._modules.get(k)
            if child is None:
                child = FlaxScope()
                scope._modules[k] = child
            scope = child
        value = bridge.to_torch(jax.numpy.asarray(leaf), copy=True, name=".".join(keys))
        is_param = keys[0] in trainable
        if is_param:
            scope._parameters[keys[-1]] = torch.nn.Parameter(
                value, requires_grad=bool(value.is_floating_point() or value.is_complex())
            )
        else:
            scope._buffers[keys[-1]] = value
        refs.append((scope, keys[-1], is_param))
        names.append(".".join(keys))
    return treedef, tuple(refs), tuple(names)


def current_tensors(refs) -> list[torch.Tensor]:
    """The variables' tensors as they are now (``.to()`` or ``load_state_dict`` may replace them)."""
    return [s._parameters[n] if p else s._buffers[n] for s, n, p in refs]
