"""The declarative Flax -> torch weight mapping: its grammar and how paths resolve.

A mapping says, per torch submodule or tensor, where its values live among the Flax
variables: ``{"fc1": "Dense_0", "blocks.3.norm": FlaxSource("stack/LayerNorm_0", layer=3)}``.
``_rules.py`` turns it into one linear rule per torch tensor.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping, Sequence

import jax
import ml_dtypes
import numpy as np
import torch

import bridge

jtu = jax.tree_util

LAYOUTS = frozenset({"copy", "linear", "conv"})


@dataclasses.dataclass(frozen=True)
class FlaxSource:
    """Where a torch tensor (or submodule) takes its values from among the Flax variables.

    Args:
        path: the Flax path, parts separated by ``/`` or ``.``: a scope (``"Dense_0"``) for a
            torch submodule, a leaf (``"Dense_0/kernel"``) for a torch tensor. A leading
            collection name (``"params/..."``, ``"batch_stats/..."``) is optional.
        layer: for stacked (``nn.scan`` / ``nn.remat_scan``) variables, the index into the
            leading axes: an int for the first axis, a tuple for several.
        layout: how a leaf becomes a torch tensor (tensor entries only): ``"copy"`` (same
            shape; a 1-D target takes the flattened leaf), ``"linear"`` (Dense kernel
            ``(*in, *out)`` -> Linear weight ``(out, in)``), ``"conv"`` (Conv kernel
            ``(*spatial, in, out)`` -> ``(out, in, *spatial)``).

    Example:
        >>> FlaxSource("stack/Dense_0", layer=3)  # a scope, layer 3 of a scanned stack
        FlaxSource(path='stack/Dense_0', layer=(3,), layout='copy')

        Layer 1 of a scanned Dense kernel ``(layer, in, out)`` as a ``Linear`` weight (the
        layers not read are why ``strict=False``):

        >>> from torchside.parity import copy_weights
        >>> kernel = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        >>> linear = torch.nn.Linear(3, 4, bias=False)
        >>> source = FlaxSource("params/stack/kernel", layer=1, layout="linear")
        >>> copy_weights({"params": {"stack": {"kernel": kernel}}}, linear,
        ...              {"weight": source}, strict=False)
        >>> torch.equal(linear.weight, torch.from_numpy(kernel[1].T))
        True
    """

    path: str
    layer: int | tuple[int, ...] | None = None
    layout: str = "copy"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"FlaxSource: argument 'layout' is {self.layout!r}; expected one of "
                f"{sorted(LAYOUTS)}."
            )
        if isinstance(self.layer, int | np.integer):
            object.__setattr__(self, "layer", (int(self.layer),))
        elif self.layer is not None:
            object.__setattr__(self, "layer", tuple(int(i) for i in self.layer))

    @property
    def parts(self) -> tuple[str, ...]:
        """The path split into its parts."""
        return tuple(p for p in re.split(r"[/.]", self.path) if p)

    def child(self, name: str, layout: str = "copy") -> FlaxSource:
        """The source of leaf ``name`` under this scope, same layer."""
        return FlaxSource(f"{self.path}/{name}" if self.path else name, self.layer, layout)


def source(value, where: str) -> FlaxSource:
    if isinstance(value, FlaxSource):
        return value
    if isinstance(value, str):
        return FlaxSource(value)
    raise TypeError(
        f"copy_weights: mapping entry {where!r} is a {type(value).__name__}; expected a Flax "
        f"path string, a FlaxSource, a list of them (concatenated along dim 0), or None."
    )


def nest_mapping(
    mapping: Mapping, torch_prefix: str, flax_prefix: str, layer=None
) -> dict[str, object]:
    """One block's mapping, moved under a torch prefix and a Flax prefix (and a layer).

    Args:
        mapping: the block's mapping, e.g. ``{"fc1": "Dense_0"}``.
        torch_prefix: where the block sits in the torch module, e.g. ``"blocks.3"``.
        flax_prefix: where it sits among the Flax variables, e.g. ``"layers_3"``.
        layer: index into stacked leading axes (see ``FlaxSource``), or ``None``.

    Returns:
        The mapping for the enclosing modules.

    Example:
        >>> nest_mapping({"fc1": "Dense_0"}, "blocks.1", "stack", layer=1)
        {'blocks.1.fc1': FlaxSource(path='stack/Dense_0', layer=(1,), layout='copy')}
    """

    def move(value, key):
        if value is None:
            return None
        if isinstance(value, list | tuple):
            return [move(v, key) for v in value]
        src = source(value, key)
        path = f"{flax_prefix}/{src.path}" if flax_prefix else src.path
        if layer is not None and src.layer is not None:
            raise ValueError(
                f"nest_mapping: entry {key!r} already has layer {src.layer}; a block mapping "
                f"nested with layer={layer} must not set layers itself."
            )
        return FlaxSource(path, src.layer if layer is None else layer, src.layout)

    return {
        (f"{torch_prefix}.{k}" if k else torch_prefix) if torch_prefix else k: move(v, k)
        for k, v in mapping.items()
    }


def stack_mapping(
    mapping: Mapping, torch_prefix: str, flax_prefix: str, lengths: Sequence[int]
) -> dict[str, object]:
    """A block mapping for every layer of a scanned stack -> per-layer torch modules.

    Torch block ``f"{torch_prefix}.{i}"`` takes layer ``i`` of the stacked variables under
    ``flax_prefix``, ``i`` counted row-major over the leading axes ``lengths`` (the order in
    which ``nn.scan`` and ``nn.remat_scan`` apply the layers).

    Args:
        mapping: one block's mapping.
        torch_prefix: the torch ``ModuleList`` (or ``Sequential``) holding the blocks.
        flax_prefix: the scanned Flax scope.
        lengths: the leading axes, ``(depth,)`` for ``nn.scan``, the ``lengths`` of
            ``nn.remat_scan``.

    Returns:
        The mapping for the whole stack.

    Example:
        >>> m = stack_mapping({"fc1": "Dense_0"}, "blocks", "stack", (2, 2))
        >>> m["blocks.3.fc1"].layer
        (1, 1)
    """
    lengths = tuple(int(n) for n in lengths)
    out: dict[str, object] = {}
    for i in range(math.prod(lengths)):
        index = tuple(int(j) for j in np.unravel_index(i, lengths))
        block = f"{torch_prefix}.{i}" if torch_prefix else str(i)
        out.update(nest_mapping(mapping, block, flax_prefix, index))
    return out


# -- Flax leaves as torch tensors ----------------------------------------------------------
def _as_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, jax.Array):
        return bridge.to_torch(value, copy=True, name=name)
    array = np.asarray(value)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def flax_leaves(flax_variables) -> dict[tuple[str, ...], torch.Tensor]:
    """Flax variables (a nested dict, or a module named by Flax paths) as ``{path: tensor}``.

    A ``torch.nn.Module`` (such as a ``FlaxModule``) contributes its parameters and buffers,
    each name split at ``.``; the tensors are the module's own (detached), not copies.
    """
    if isinstance(flax_variables, torch.nn.Module):
        named = list(flax_variables.named_parameters()) + list(flax_variables.named_buffers())
        return {tuple(n.split(".")): t.detach() for n, t in named}
    leaves = {}
    for path, leaf in jtu.tree_flatten_with_path(flax_variables)[0]:
        keys = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                     for k in path)
        leaves[keys] = _as_tensor(leaf, "/".join(keys))
    return leaves


def resolve(leaves: Mapping, parts: tuple[str, ...], where: str) -> tuple[str, ...]:
    """The full path of a leaf given with or without its leading collection."""
    if parts in leaves:
        return parts
    found = [p for p in leaves if p[1:] == parts]
    if len(found) == 1:
        return found[0]
    shown = "/".join(parts)
    if found:
        raise ValueError(
            f"copy_weights: Flax path {shown!r} (for torch {where!r}) is in several "
            f"collections: {sorted('/'.join(p) for p in found)}. Name the collection, e.g. "
            f"'{'/'.join(found[0])}'."
        )
    names = ["/".join(p) for p in leaves] + ["/".join(p[1:]) for p in leaves]
    close = difflib.get_close_matches(shown, names, n=3, cutoff=0.5)
    raise KeyError(
        f"copy_weights: Flax path {shown!r} (for torch {where!r}) is not among the Flax "
        f"variables. Closest: {close or 'none'}; there are {len(leaves)} leaves, e.g. "
        f"{names[: min(3, len(leaves))]}."
    )
