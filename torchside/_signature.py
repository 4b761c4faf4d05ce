"""Splitting a call's arguments into tensors (dynamic) and static values, and naming them."""

from __future__ import annotations

import jax
import torch

import bridge
from flaxside import ARRAY

jtu = jax.tree_util


def split_args(args: tuple, kwargs: dict, where: str):
    """Flattens ``(args, kwargs)`` into tensor leaves and a hashable static key.

    Returns:
        ``(tensors, treedef, static_key)`` where ``static_key`` holds each non-tensor leaf
        with its type (so ``1``, ``1.0`` and ``True`` compile apart).

    Raises:
        TypeError: a non-tensor leaf is unhashable, so it cannot be part of a compile key.
    """
    leaves, treedef = jtu.tree_flatten((args, kwargs))
    tensors = []
    static = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            static.append(ARRAY)
        else:
            static.append((type(leaf), leaf))
    static_key = tuple(static)
    try:
        hash(static_key)
    except TypeError:
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                try:
                    hash(leaf)
                except TypeError:
                    raise TypeError(
                        f"{where}: argument {arg_names(treedef)[i]} is a "
                        f"{type(leaf).__name__}, which is neither a torch.Tensor nor "
                        f"hashable. Non-tensor arguments are static (part of the compile key) "
                        f"and must be hashable: pass a tensor, or a tuple instead of a list "
                        f"of numbers."
                    ) from None
        raise
    return tensors, treedef, static_key


def arg_slots(static_key: tuple) -> tuple:
    """The ``flat_apply`` slots for a static key: ``ARRAY`` or the static value."""
    return tuple(s if s is ARRAY else s[1] for s in static_key)


def arg_names(treedef) -> list[str]:
    """Readable names (``args[0]``, ``kwargs['mask']``) for each leaf of ``(args, kwargs)``."""
    tree = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    names = []
    for path, _ in jtu.tree_flatten_with_path(tree)[0]:
        head, rest = path[0].idx, path[1:]
        names.append(("args" if head == 0 else "kwargs") + jtu.keystr(rest))
    return names


def leaf_dtypes(tensors, names, device: torch.device, where: str,
                has_parameters: bool = True) -> tuple:
    """Checks dtypes and devices once per signature and returns the numpy dtypes.

    ``device`` is the parameters' device, or without parameters the first tensor's.
    """
    out = []
    for t, name in zip(tensors, names, strict=True):
        if t.device != device:
            if has_parameters:
                what = "the module's parameters are"
                fix = f"Move the input with .to('{device}') or the module with .to('{t.device}')."
            else:
                what = f"{names[0]} is"
                fix = f"Move every tensor argument to one device, e.g. {name}.to('{device}')."
            raise ValueError(
                f"{where}: argument {name} is on {t.device}, but {what} on {device}. {fix}"
            )
        out.append(bridge.numpy_dtype(t.dtype, name=name))
    return tuple(out)
