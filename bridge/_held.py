"""``HeldArrays``: an owner's variables as JAX arrays, made once and reused (NOTE [Exchange]).

Parameters and buffers keep their memory from call to call (optimizers and
``load_state_dict`` write in place), so each slot keeps one array over that memory and
reuses it while the tensor is unchanged.
"""

from __future__ import annotations

import torch

from bridge._exchange import in_place


class HeldArrays:
    """One JAX array per variable slot of one owner, reused while its tensor is unchanged.

    Per slot it keeps the tensor's address, dtype, shape, ``requires_grad``, exchange, the
    array (``None`` when the tensor cannot be held: a non-leaf, such as an autocast copy or
    a parametrized weight, unaligned or non-compact memory; those get a fresh view each
    call) and device. See NOTE [Exchange] for when a held array is valid.
    """

    __slots__ = ("_slots",)

    def __init__(self):
        self._slots: list = []

    def arrays(self, tensors, exchange, grads=None) -> tuple[list, bool]:
        """Arrays for ``tensors`` (one per slot), and whether a signature-relevant flag changed.

        Signature-relevant: a device, dtype, shape or grad flag. A slot whose tensor moved
        (same device, dtype and shape, another address or layout) gets a new array, which is
        no change of signature. ``grads`` replaces the tensors' ``requires_grad`` flags
        (inside a custom op, tensors arrive detached).

        Raises:
            ValueError: a tensor is not on ``exchange``'s device (nothing is held for it).
        """
        slots = self._slots
        changed = len(slots) != len(tensors)
        if changed:
            slots[:] = [None] * len(tensors)
        out = []
        for i, t in enumerate(tensors):
            s = slots[i]
            ptr = t.data_ptr()
            grad = t.requires_grad if grads is None else grads[i]
            if s is not None and s[0] == ptr and s[4] is exchange:
                if s[1] is t.dtype and s[2] == t.shape and s[3] == grad:
                    array = s[5]
                    if array is None:
                        out.append(exchange.view(t))
                        continue
                    if in_place(t):  # not so: a same-address view with other strides
                        out.append(array)
                        continue
            # The address alone cannot tell devices apart (a meta tensor's is 0): compare.
            if (s is None or s[1] is not t.dtype or s[2] != t.shape or s[3] != grad
                    or s[6] != t.device):
                changed = True
            array = exchange.hold(t)
            slots[i] = (ptr, t.dtype, t.shape, grad, exchange, array, t.device)
            out.append(exchange.view(t) if array is None else array)
        return out, changed

    def get(self, slot: int, tensor: torch.Tensor, exchange):
        """The held array of ``slot`` if ``tensor`` is still its tensor, else a fresh view.

        Nothing new is held: in a backward, saved-tensor hooks may hand back temporary
        copies.
        """
        s = self._slots[slot] if slot < len(self._slots) else None
        if (s is not None and s[5] is not None and s[0] == tensor.data_ptr() and s[4] is exchange
                and s[1] is tensor.dtype and s[2] == tensor.shape and in_place(tensor)):
            return s[5]
        return exchange.view(tensor)

    def clear(self) -> None:
        """Releases every held array."""
        self._slots = []
