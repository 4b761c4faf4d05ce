"""Where ``torchside.shard`` puts each parameter: specs, placements and the JAX mesh.

NOTE [Sharded blocks] in ``_shard.py``. A parameter's ``PartitionSpec`` over the mesh
(``leaf_spec``) decides both sides: torch's DTensor placements (``dtensor_placements``) and
JAX's ``NamedSharding`` over the mesh ``jax_mesh`` builds in torch's mesh order, so that
rank r's local shard is the block JAX gives process r.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from flaxside.internal import spec_axes
from torchside import _shard_errors


def batch_axes_on(batch_axes, names: tuple, shape: tuple, where: str) -> tuple:
    """``shard``'s ``batch_axes`` as a tuple of mesh dimension names, in mesh order.

    In mesh order: a rank's rows of the global batch are block ``i`` of the batch axes'
    ranks counted in that order (``i = i_fsdp * n_tensor + i_tensor`` for both axes of
    ``("fsdp", "tensor")``), as JAX splits a dimension over several axes. Axes of one rank
    split nothing and are dropped (the first kept if all are), so that an ``(N, 1)`` mesh
    with ``batch_axes=("fsdp", "tensor")`` runs as the one-dimensional mesh it is.
    """
    if batch_axes is None:
        return names[:1]
    given = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    if (not isinstance(given, tuple | list) or not given
            or any(a not in names for a in given) or len(set(given)) != len(given)):
        raise _shard_errors.batch_axes_unknown(where, batch_axes, names)
    ordered = tuple(a for a in names if a in given)
    sizes = dict(zip(names, shape, strict=True))
    return tuple(a for a in ordered if sizes[a] > 1) or ordered[:1]


def jax_mesh(ranks: np.ndarray, names: tuple, by_process: dict) -> jax.sharding.Mesh:
    """The JAX mesh of torch's mesh ``ranks``, dimensions ``names``.

    Position ``(i, j)`` holds process ``ranks[i, j]``'s device (process id = torch rank), so
    that DTensor's shard ``(i, j)`` and JAX's are one.
    """
    return jax.sharding.Mesh(np.vectorize(by_process.__getitem__, otypes=[object])(ranks),
                             names)


def dtensor_placements(spec, names: tuple) -> list:
    """DTensor placements of a parameter placed by ``spec`` over a mesh of ``names``.

    Mesh dimension ``k`` shards the tensor dimension whose entry names its axis, else
    replicates; entries are in mesh order, the order DTensor splits a dimension sharded
    over two mesh dimensions in (``[Shard(d), Shard(d)]``).
    """
    from torch.distributed.tensor import Replicate, Shard

    axes = [spec_axes(e) for e in spec] if spec is not None else []
    return [next((Shard(d) for d, a in enumerate(axes) if name in a), Replicate())
            for name in names]


def leaf_spec(name: str, shape: tuple, sizes: dict, flax_names, batch_axes: tuple,
               where: str):
    """A parameter's ``PartitionSpec`` over a mesh of ``sizes`` (axis: size, mesh order).

    Flax's partitioning metadata where it has names (mesh axes after ``axis_rules``): each
    dimension over the axes its entry names that the mesh has, in mesh order, none where
    their product does not divide it; axes of one rank are dropped. Without metadata,
    FSDP-style: the last dimension that divides by the batch axes' product, over them.
    ``None``: replicated.
    """
    if flax_names is not None:
        entries, seen = [], set()
        for d, entry in enumerate(flax_names):
            axes = tuple(a for a in sizes if a in spec_axes(entry))
            for a in axes:
                if a in seen:
                    raise _shard_errors.axis_on_two_dims(where, name, tuple(flax_names), a)
                seen.add(a)
            # Axes of one rank shard nothing: dropped, so that a leaf on a mesh like
            # ("fsdp", "tensor") = (N, 1) is split over the batch axes alone (batch_dim).
            axes = tuple(a for a in axes if sizes[a] > 1)
            if axes and shape[d] % math.prod(sizes[a] for a in axes):
                axes = ()
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries) if any(e is not None for e in entries) else None
    n = math.prod(sizes[a] for a in batch_axes)
    for d in reversed(range(len(shape)) if n > 1 else ()):
        if shape[d] % n == 0 and shape[d] >= n:
            return P(*((batch_axes[0] if len(batch_axes) == 1 else batch_axes)
                       if k == d else None for k in range(len(shape))))
    return None
