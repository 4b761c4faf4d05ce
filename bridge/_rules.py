"""What may cross between torch and JAX, and how: the exchange mode, alignment, memory.

Read when a call's tensors cross (``_exchange.py``) and by the user-facing conversions
(``_convert.py``); nothing here runs on a call's path unless a tensor is refused.
"""

from __future__ import annotations

import os

import torch

ALIGNMENT = 64  # bytes; XLA's CPU client copies host buffers aligned less than this.

EXCHANGE_MODES = ("auto", "dlpack")
current = os.environ.get("FLAXTORCH_EXCHANGE", "auto")  # read per call by ``exchange_for``
if current not in EXCHANGE_MODES:
    raise ValueError(
        f"flaxtorch: FLAXTORCH_EXCHANGE={current!r} is not one of {EXCHANGE_MODES}: "
        f"'auto' uses pointer views on CPU and DLPack on CUDA, 'dlpack' uses DLPack everywhere."
    )


def exchange_mode() -> str:
    """``"auto"`` (pointer views on CPU, DLPack on CUDA) or ``"dlpack"`` (DLPack everywhere).

    Example:
        >>> exchange_mode() in EXCHANGE_MODES
        True
    """
    return current


def set_exchange_mode(mode: str) -> str:
    """Sets the exchange mode for calls compiled from now on; returns the previous one.

    ``"dlpack"`` sends CPU tensors through the code path CUDA uses (DLPack imports and
    exports, one fence per call), so that it runs without a GPU. Also settable with the
    environment variable ``FLAXTORCH_EXCHANGE``.

    Example:
        >>> previous = set_exchange_mode("dlpack")
        >>> set_exchange_mode(previous)
        'dlpack'
    """
    global current
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"set_exchange_mode: mode={mode!r} is not one of {EXCHANGE_MODES}.")
    previous, current = current, mode
    return previous


def no_memory(tensor: torch.Tensor, what: str = "a tensor") -> TypeError:
    """The error for a tensor with elements but no memory of its own (``check_memory``)."""
    return TypeError(
        f"flaxtorch: {what} is a {type(tensor).__name__} of shape {tuple(tensor.shape)} "
        f"with no memory of its own (a tensor subclass that wraps others, such as a DTensor "
        f"or a pickled DTensor), so JAX has nothing to read. Pass a tensor with memory: a "
        f"DTensor's to_local() or full_tensor(), or the tensor the subclass wraps."
    )


def check_memory(tensor: torch.Tensor, what: str) -> None:
    """Refuses a tensor whose data pointer is null though it has elements.

    ``what`` names it in the message ("argument 'x'").

    A wrapper subclass (a DTensor) reports address 0 and exports, through ``__dlpack__``,
    a capsule over address 0 with its global shape, which JAX accepts and then reads.
    """
    if not tensor.data_ptr() and tensor.numel():
        raise no_memory(tensor, what)


def elsewhere(tensor: torch.Tensor, device: torch.device) -> ValueError:
    """The error for a tensor on another device than the call's."""
    return ValueError(
        f"flaxtorch: a tensor on {tensor.device} reached a call that runs on {device}. If "
        f"a saved-tensor hook moves tensors (e.g. to offload them), its unpack hook must "
        f"move them back to the device they came from."
    )
