"""Held arrays: one JAX array per variable of an owner, reused while its tensor is unchanged.

Parameters and buffers keep their memory from call to call (optimizers and
``load_state_dict`` write in place), so each gets one JAX array over that memory (the
exchange's ``hold``), reused while the tensor's address, device, dtype, shape, layout and
grad flag are unchanged, and replaced at the first call that sees otherwise: old bits are
never read as a new dtype or shape, nor one device's memory as another's (NOTE [Exchange]
in ``_exchange.py``).

NOTE [Held arrays per call]. Checking that is work per variable on every call and every
backward, which a block of many small parameters pays many times (the benchmark's LEAVES
has 768). So the check reads each property of every tensor in one list comprehension and
compares whole lists at C speed: the addresses, sizes (``size()``, not ``shape``: a
torch 2.13 ``shape`` costs four times as much), dtypes, devices, grad flags, that each is
contiguous with no lazy negation (or conjugation, for a complex one). Only when a list
differs does it fall back to the slot-by-slot path that replaces arrays and tells a
change of signature from a move.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch


def in_place(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its values as JAX reads them.

    Compact, with no lazy conjugate or negative bit; alignment aside (``is_zero_copy``).
    """
    return tensor.is_contiguous() and not tensor.is_neg() and not (
        tensor.dtype.is_complex and tensor.is_conj())  # only a complex tensor has the bit


class HeldSlot(NamedTuple):
    """What ``HeldArrays`` keeps for one variable slot: the tensor as last seen, its array.

    ``requires_grad`` is the grad flag the signature saw; ``array`` is ``None`` where the
    tensor cannot be held (a non-leaf such as an autocast copy or a parametrized weight,
    unaligned or non-compact memory): such a tensor gets a fresh view each call.
    """

    pointer: int
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    exchange: object
    array: object


class _Seen(NamedTuple):
    """Every slot as the last call saw it, list by list (NOTE [Held arrays per call]).

    ``picked``: per tuple of slots (a backward's saved variables), the same lists for
    those slots alone, made at the first backward that asks.
    """

    exchange: object
    pointers: list
    sizes: list
    dtypes: list
    devices: list
    flags: list
    complex: bool
    arrays: list
    picked: dict


_Tensor = torch._C.TensorBase
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _same(seen: _Seen, tensors) -> bool:
    """Whether ``tensors`` are, list by list, what ``seen`` saw, contiguous and unflagged.

    Each ``map`` calls a tensor method from C: no Python call per tensor.
    """
    return (list(map(_Tensor.data_ptr, tensors)) == seen.pointers
            and list(map(_Tensor.size, tensors)) == seen.sizes
            and list(map(_DTYPE, tensors)) == seen.dtypes
            and list(map(_Tensor.get_device, tensors)) == seen.devices  # -1 on the CPU
            and all(map(_Tensor.is_contiguous, tensors))
            and not any(map(_Tensor.is_neg, tensors))
            and not (seen.complex and any(map(_Tensor.is_conj, tensors))))


class HeldArrays:
    """One JAX array per variable slot of one owner, reused while its tensor is unchanged."""

    __slots__ = ("slots", "_seen")

    def __init__(self):
        self.slots: list[HeldSlot | None] = []
        self._seen: _Seen | None = None

    def arrays(self, tensors, exchange, grads=None) -> tuple[list, bool]:
        """Arrays for ``tensors`` (one per slot), and whether a signature-relevant flag changed.

        Signature-relevant: a device, dtype, shape or grad flag. A slot whose tensor moved
        (same device, dtype and shape, another address or layout) gets a new array, which is
        no change of signature. ``grads`` replaces the tensors' ``requires_grad`` flags
        (inside a custom op, tensors arrive detached).

        Raises:
            ValueError: a tensor is not on ``exchange``'s device (nothing is held for it).
        """
        flags = list(map(_REQUIRES_GRAD, tensors)) if grads is None else list(grads)
        seen = self._seen
        if (seen is not None and seen.exchange is exchange and flags == seen.flags
                and _same(seen, tensors)):
            return list(seen.arrays), False
        self._seen = None
        out, changed = self._slot_by_slot(tensors, exchange, flags)
        if all(s.array is not None for s in self.slots):  # all held: the fast path next
            self._seen = _Seen(exchange, [s.pointer for s in self.slots],
                               [t.size() for t in tensors], [s.dtype for s in self.slots],
                               [t.get_device() for t in tensors], flags,
                               any(s.dtype.is_complex for s in self.slots), list(out), {})
        return out, changed

    def _slot_by_slot(self, tensors, exchange, flags) -> tuple[list, bool]:
        slots = self.slots
        changed = len(slots) != len(tensors)
        if changed:
            slots[:] = [None] * len(tensors)
        out = []
        for i, t in enumerate(tensors):
            s = slots[i]
            ptr = t.data_ptr()
            grad = flags[i]
            if (s is not None and s.pointer == ptr and s.exchange is exchange
                    and s.dtype is t.dtype and s.shape == t.shape and s.requires_grad == grad):
                if s.array is None:
                    out.append(exchange.view(t))
                    continue
                if in_place(t):  # not so: a same-address view with other strides
                    out.append(s.array)
                    continue
            # The address alone cannot tell devices apart (a meta tensor's is 0): compare.
            if (s is None or s.dtype is not t.dtype or s.shape != t.shape
                    or s.requires_grad != grad or s.device != t.device):
                changed = True
            array = exchange.hold(t)
            slots[i] = HeldSlot(ptr, t.dtype, t.shape, t.device, grad, exchange, array)
            out.append(exchange.view(t) if array is None else array)
        return out, changed

    def get(self, slot: int, tensor: torch.Tensor, exchange):
        """The held array of ``slot`` if ``tensor`` is still its tensor, else a fresh view.

        Nothing new is held: in a backward, saved-tensor hooks may hand back temporary
        copies.
        """
        s = self.slots[slot] if slot < len(self.slots) else None
        if (s is not None and s.array is not None and s.pointer == tensor.data_ptr()
                and s.exchange is exchange and s.dtype is tensor.dtype
                and s.shape == tensor.size() and in_place(tensor)):
            return s.array
        return exchange.view(tensor)

    def gather(self, slots, tensors, exchange) -> list:
        """``get`` for each of ``slots`` and its tensor (a backward's saved variables).

        The whole lists are compared first (NOTE [Held arrays per call]): saved
        variables are the parameters themselves unless a saved-tensor hook replaced them.
        """
        seen = self._seen
        if seen is not None and seen.exchange is exchange and tensors:
            picked = seen.picked[slots] if slots in seen.picked else None
            if picked is None:
                picked = seen.picked[slots] = seen._replace(**{
                    f: [getattr(seen, f)[j] for j in slots]
                    for f in ("pointers", "sizes", "dtypes", "devices", "arrays")})
            if _same(picked, tensors):
                return list(picked.arrays)
        return [self.get(j, t, exchange) for j, t in zip(slots, tensors, strict=True)]

    def clear(self) -> None:
        """Releases every held array."""
        self.slots = []
        self._seen = None
