"""The dtype table shared by both directions of the exchange."""

from __future__ import annotations

import functools as ft

import jax
import ml_dtypes
import numpy as np
import torch

# torch dtype -> (numpy dtype JAX sees, torch dtype with the same bytes that numpy can hold).
# numpy has no bfloat16 or float8: those cross as same-width integers and are re-viewed.
_TABLE: dict[torch.dtype, tuple[np.dtype, torch.dtype]] = {
    torch.float32: (np.dtype(np.float32), torch.float32),
    torch.float16: (np.dtype(np.float16), torch.float16),
    torch.bfloat16: (np.dtype(ml_dtypes.bfloat16), torch.int16),
    torch.float64: (np.dtype(np.float64), torch.float64),
    torch.complex64: (np.dtype(np.complex64), torch.complex64),
    torch.complex128: (np.dtype(np.complex128), torch.complex128),
    torch.int8: (np.dtype(np.int8), torch.int8),
    torch.int16: (np.dtype(np.int16), torch.int16),
    torch.int32: (np.dtype(np.int32), torch.int32),
    torch.int64: (np.dtype(np.int64), torch.int64),
    torch.uint8: (np.dtype(np.uint8), torch.uint8),
    torch.bool: (np.dtype(np.bool_), torch.bool),
    torch.float8_e4m3fn: (np.dtype(ml_dtypes.float8_e4m3fn), torch.uint8),
    torch.float8_e5m2: (np.dtype(ml_dtypes.float8_e5m2), torch.uint8),
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TABLE[getattr(torch, _name)] = (np.dtype(_name), getattr(torch, _name))

_FROM_NUMPY: dict[np.dtype, torch.dtype] = {np_dt: t for t, (np_dt, _) in _TABLE.items()}

# The integer typestr used when a dtype crosses numpy as raw bytes.
_RAW_TYPESTR = {torch.int16: "<i2", torch.uint8: "|u1"}

_WIDE = (torch.int64, torch.float64, torch.complex128, getattr(torch, "uint64", torch.int64))
_NARROW = {
    torch.int64: "torch.int32",
    torch.float64: "torch.float32",
    torch.complex128: "torch.complex64",
}


def numpy_dtype(dtype: torch.dtype, *, name: str = "tensor") -> np.dtype:
    """The numpy (and so JAX) dtype that holds a torch dtype's values exactly.

    Args:
        dtype: a torch dtype.
        name: the argument name used in error messages.

    Returns:
        The numpy dtype JAX will see.

    Raises:
        TypeError: the dtype has no exact JAX counterpart, or it is 64-bit while JAX's x64
            mode is off (JAX would silently cast it to 32 bits with wraparound).

    Example:
        >>> numpy_dtype(torch.bfloat16)
        dtype(bfloat16)
    """
    entry = _TABLE.get(dtype)
    if entry is None:
        supported = ", ".join(sorted(str(d) for d in _TABLE))
        raise TypeError(
            f"argument '{name}' has dtype {dtype}, which JAX cannot hold. "
            f"Supported dtypes: {supported}. Cast it first, e.g. {name}.float()."
        )
    if dtype in _WIDE and not jax.config.jax_enable_x64:
        narrow = _NARROW.get(dtype, "a 32-bit dtype")
        raise TypeError(
            f"argument '{name}' is {dtype}, but JAX runs without 64-bit types here "
            f"and would silently cast it to 32 bits (2147483653 becomes -2147483643). Either "
            f"pass {name}.to({narrow}), or enable 64-bit JAX before the first call with "
            f"jax.config.update('jax_enable_x64', True)."
        )
    return entry[0]


_INT32 = (-(2**31), 2**31 - 1)


def narrows_to_int32(dtype: torch.dtype) -> bool:
    """Whether a call argument of ``dtype`` crosses as int32: int64 while JAX runs 32-bit.

    Token ids, masks and positions come as int64 from tokenizers, ``torch.randint`` and
    DataLoaders; they need no gradient, and JAX without x64 would cast them silently.
    """
    return dtype is torch.int64 and not jax.config.jax_enable_x64


def narrow_to_int32(tensor: torch.Tensor, *, name: str = "tensor") -> torch.Tensor:
    """An int64 tensor as int32, after checking that every value fits (a copy).

    The check is one pass over the values (``aminmax``) and reads two numbers back to the
    host: on CUDA it waits for the work that produces ``tensor``. Values checked before
    (the same tensor, saved for the backward) need only ``tensor.to(torch.int32)``.
    ``narrow_array`` does the same to a CPU tensor's values in numpy, without torch's
    per-op dispatch (the CPU exchange's route).

    Raises:
        TypeError: a value does not fit int32 (naming the argument, the values and the fix).

    Example:
        >>> narrow_to_int32(torch.tensor([1, 50256])).dtype
        torch.int32
    """
    if tensor.numel():
        lo, hi = (int(v) for v in torch.aminmax(tensor))
        _check_fits(name, lo, hi)
    return tensor.to(torch.int32)


def narrow_array(values: np.ndarray, *, name: str = "tensor") -> np.ndarray:
    """``narrow_to_int32`` for an int64 numpy array (a view of a CPU tensor): int32, a copy.

    Example:
        >>> narrow_array(np.array([1, 50256])).dtype
        dtype('int32')
    """
    if values.size:
        _check_fits(name, int(values.min()), int(values.max()))
    return values.astype(np.int32)


def _check_fits(name: str, lo: int, hi: int) -> None:
    if lo < _INT32[0] or hi > _INT32[1]:
        raise TypeError(
            f"argument '{name}' is torch.int64 with values from {lo} to {hi}, which do "
            f"not fit int32, and JAX runs without 64-bit types here (int64 arguments "
            f"are narrowed to int32 when every value fits). Keep the values within "
            f"[{_INT32[0]}, {_INT32[1]}], or enable 64-bit JAX before the first call with "
            f"jax.config.update('jax_enable_x64', True)."
        )


@ft.cache  # on the per-call path: one dict lookup per tensor
def view_typestr(dtype: torch.dtype) -> tuple[str, np.dtype]:
    """The array-interface typestr of a torch dtype's bytes, and the numpy dtype to view as.

    numpy-native dtypes expose themselves; bfloat16 and float8 expose integers of the same
    width, which the caller re-views as the ml_dtypes type.
    """
    np_dtype, raw = _TABLE[dtype]
    if raw is dtype:
        return np_dtype.str, np_dtype
    return _RAW_TYPESTR[raw], np_dtype


def torch_dtype(dtype: np.dtype, *, name: str = "array") -> torch.dtype:
    """The torch dtype for a numpy/JAX dtype.

    Raises:
        TypeError: torch has no such dtype (e.g. JAX's float0 or int4).

    Example:
        >>> torch_dtype(np.dtype("float32"))
        torch.float32
    """
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(
            f"argument '{name}' has dtype {dtype}, which torch cannot hold. "
            f"Cast it in JAX first, e.g. {name}.astype(jnp.float32)."
        ) from None


@ft.cache  # on the per-call path: one dict lookup per output
def typestr(dtype: np.dtype) -> tuple[str, torch.dtype | None]:
    """The numpy typestr to expose a JAX buffer with, and the torch dtype to re-view it as.

    numpy-native dtypes expose themselves; bfloat16 and float8 expose raw integers of the
    same width and return the torch dtype to ``.view`` them as.
    """
    t = torch_dtype(dtype)
    raw = _TABLE[t][1]
    if raw is t:
        return np.dtype(dtype).str, None
    return _RAW_TYPESTR[raw], t
