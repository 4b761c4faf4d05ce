"""Small arrays cross the boundary packed: one flat buffer per dtype.

Every array that crosses to torch costs per tensor (a conversion each way, a tensor torch
tracks), which dominated calls with many small residuals or parameters. Inside a program,
small arrays are concatenated per dtype and cross as one buffer; large ones (and those the
caller marks) cross alone, without a copy. ``Program`` packs its residuals and its
gradients this way; the torch side views each gradient out of its buffer without a copy
(``GradientViews`` in ``torchside/call/_build.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

# Arrays this small cross packed, one buffer per dtype, by default. The torch side passes
# its exchange route's own limit (``OnDevice(pack_bytes=...)``): a copy inside the program
# against a crossing, which costs differently per device (NOTE [Packing per route] in
# ``bridge/_exchange.py``).
PACK_BYTES = 64 * 1024


class Alone(NamedTuple):
    """An array that crosses as a buffer of its own (``buffer``: its index)."""

    buffer: int


class Packed(NamedTuple):
    """An array that crosses as the elements ``offset:offset + size`` of a flat buffer."""

    buffer: int
    offset: int
    shape: tuple[int, ...]


def pack_plan(avals, alone=None, limit: int | None = PACK_BYTES) -> tuple[tuple, tuple]:
    """Where each array goes when small ones cross as one buffer per dtype.

    Args:
        avals: shapes and dtypes (anything with ``.shape`` and ``.dtype``).
        alone: per array, whether it must cross alone whatever its size.
        limit: the bytes up to which an array counts as small; ``None``: every array
            (one buffer per dtype, whatever the sizes).

    Returns:
        ``(placement, buffers)``: per array ``Alone`` or ``Packed`` into the buffers, and
        per buffer its ``(shape, dtype)``: the arrays that cross alone first, then one flat
        buffer per dtype, in order of first use. Inside a buffer, arrays of one shape sit
        side by side (shapes in order of first use), so that the torch side views each run
        of them with one ``unbind``. With fewer than two small arrays nothing is packed.
    """
    shapes = [tuple(a.shape) for a in avals]
    dtypes = [np.dtype(a.dtype) for a in avals]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    small = [not (alone is not None and alone[k])
             and (limit is None or sizes[k] * dtypes[k].itemsize <= limit)
             for k in range(len(avals))]
    if sum(small) < 2:
        small = [False] * len(avals)
    buffers = [(shapes[k], dtypes[k]) for k in range(len(avals)) if not small[k]]
    n_alone = len(buffers)
    # dtype -> buffer index, then per shape the arrays of that dtype and shape, in order
    groups: dict[np.dtype, tuple[int, dict]] = {}
    placement: list = [None] * len(avals)
    alone_so_far = 0
    for k in range(len(avals)):
        if not small[k]:
            placement[k] = Alone(alone_so_far)
            alone_so_far += 1
            continue
        group = groups.setdefault(dtypes[k], (n_alone + len(groups), {}))
        group[1].setdefault(shapes[k], []).append(k)
    for buffer, by_shape in groups.values():
        offset = 0
        for shape, members in by_shape.items():
            for k in members:
                placement[k] = Packed(buffer, offset, shape)
                offset += sizes[k]
        buffers.append(((offset,), dtypes[members[0]]))
    return tuple(placement), tuple(buffers)


def pack(arrays: list, placement) -> list:
    """The buffers ``placement`` (from ``pack_plan``) describes, built inside a program."""
    buffers: dict[int, object] = {}
    groups: dict[int, list] = {}
    for x, entry in zip(arrays, placement, strict=True):
        if type(entry) is Alone:
            buffers[entry.buffer] = x
        else:
            groups.setdefault(entry.buffer, []).append((entry.offset, x.reshape(-1)))
    for b, parts in groups.items():
        buffers[b] = jnp.concatenate([x for _, x in sorted(parts, key=lambda p: p[0])])
    return [buffers[b] for b in range(len(buffers))]


def unpack(buffers: list, placement) -> list:
    """The arrays ``pack`` was given, sliced back out of its buffers."""
    out = []
    for entry in placement:
        if type(entry) is Alone:
            out.append(buffers[entry.buffer])
        else:
            size = int(np.prod(entry.shape, dtype=np.int64))
            out.append(buffers[entry.buffer][entry.offset : entry.offset + size]
                       .reshape(entry.shape))
    return out


# -- one collective per layer over a mesh (NOTE [One collective per layer] in mesh/_on_mesh.py)
def pack_by_rank(arrays: list, dims: list, n: int):
    """Arrays each sharded ``n`` ways on its dim in ``dims``, as one ``(n, total)`` buffer.

    Row ``r`` holds, for every array in order, the elements of rank ``r``'s shard (the
    array's sharded dimension moved first and split ``n`` ways): sharded on its first
    dimension, the buffer is each rank's own shards side by side, made without moving data
    between ranks, and one collective gathers (or reduces and scatters) all of them.
    """
    rows = []
    for a, d in zip(arrays, dims, strict=True):
        moved = jnp.moveaxis(a, d, 0)
        rows.append(moved.reshape((n, moved.shape[0] // n, *moved.shape[1:])).reshape(n, -1))
    return jnp.concatenate(rows, axis=1)


def unpack_by_rank(buffer, shapes: list, dims: list, n: int) -> list:
    """The arrays ``pack_by_rank`` packed, of ``shapes``, from its ``(n, total)`` buffer."""
    out, offset = [], 0
    for shape, d in zip(shapes, dims, strict=True):
        moved = (shape[d], *(s for k, s in enumerate(shape) if k != d))
        size = int(np.prod(moved, dtype=np.int64)) // n
        part = buffer[:, offset : offset + size].reshape((n, moved[0] // n, *moved[1:]))
        out.append(jnp.moveaxis(part.reshape(moved), 0, d))
        offset += size
    return out


def sharded_by_dtype(arrays, dims) -> list[list[int]]:
    """Indices of the sharded arrays (a dim in ``dims``), grouped by dtype in first order."""
    groups: dict = {}
    for k, (a, d) in enumerate(zip(arrays, dims, strict=True)):
        if d is not None:
            groups.setdefault(jnp.dtype(a.dtype), []).append(k)
    return list(groups.values())
