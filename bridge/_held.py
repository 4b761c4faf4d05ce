"""Held arrays: one JAX array per owner variable, reused while its tensor is unchanged.

NOTE [Exchange] in ``_exchange.py`` says when a held array is valid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bridge._exchange import in_place


class HeldSlot(NamedTuple):
    """What ``HeldArrays`` keeps for one variable slot: the tensor as last seen, its array.

    Attributes:
        pointer: the tensor's data pointer.
        dtype, shape, device: the tensor's.
        requires_grad: its grad flag as the signature saw it.
        exchange: the exchange the array was made by.
        array: the JAX array over the tensor's memory, or ``None`` where the tensor cannot
            be held (a non-leaf, such as an autocast copy or a parametrized weight,
            unaligned or non-compact memory): such a tensor gets a fresh view each call.
    """

    pointer: int
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    exchange: object
    array: object


class HeldArrays:
    """One JAX array per variable slot of one owner, reused while its tensor is unchanged.

    See NOTE [Exchange] for when a held array is valid.
    """

    __slots__ = ("slots",)

    def __init__(self):
        self.slots: list[HeldSlot | None] = []

    def arrays(self, tensors, exchange, grads=None) -> tuple[list, bool]:
        """Arrays for ``tensors`` (one per slot), and whether a signature-relevant flag changed.

        Signature-relevant: a device, dtype, shape or grad flag. A slot whose tensor moved
        (same device, dtype and shape, another address or layout) gets a new array, which is
        no change of signature. ``grads`` replaces the tensors' ``requires_grad`` flags
        (inside a custom op, tensors arrive detached).

        Raises:
            ValueError: a tensor is not on ``exchange``'s device (nothing is held for it).
        """
        slots = self.slots
        changed = len(slots) != len(tensors)
        if changed:
            slots[:] = [None] * len(tensors)
        out = []
        for i, t in enumerate(tensors):
            s = slots[i]
            ptr = t.data_ptr()
            grad = t.requires_grad if grads is None else grads[i]
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
        # Whether the slot's array is ``tensor``'s memory as JAX reads it (same layout
        # too); written out rather than a method: it runs per leaf in every backward.
        if (s is not None and s.array is not None and s.pointer == tensor.data_ptr()
                and s.exchange is exchange and s.dtype is tensor.dtype
                and s.shape == tensor.shape and in_place(tensor)):
            return s.array
        return exchange.view(tensor)

    def clear(self) -> None:
        """Releases every held array."""
        self.slots = []
