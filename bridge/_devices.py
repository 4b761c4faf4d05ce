"""Device table: torch ``cpu`` <-> JAX cpu, torch ``cuda:i`` <-> JAX gpu ``i``."""

from __future__ import annotations

import functools as ft
import os
import warnings

import jax
import torch

_ALLOCATOR_VARS = {
    # JAX would otherwise grab 75% of every GPU at start-up and starve torch's allocator.
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}


def configure_gpu_memory() -> None:
    """Keep JAX from preallocating GPU memory beside torch.

    Sets the allocator variables (unless the user set them) before JAX starts its GPU
    backend; if that backend already started with preallocation on, warns once, since the
    setting can no longer take effect.
    """
    missing = {k: v for k, v in _ALLOCATOR_VARS.items() if k not in os.environ}
    os.environ.update(missing)
    if not missing:
        return
    try:  # private, feature-detected: which backends exist already.
        from jax._src import xla_bridge

        started = dict(getattr(xla_bridge, "_backends", {}) or {})
    except Exception:  # pragma: no cover - layout of jax internals changed
        started = {}
    if any(name in ("cuda", "gpu", "rocm") for name in started):
        warnings.warn(
            "flaxtorch: JAX's GPU backend started before flaxtorch was imported, so it may "
            "have preallocated most of the GPU memory torch needs. Import flaxtorch (bridge) "
            "before using JAX, or set XLA_PYTHON_CLIENT_PREALLOCATE=false in the environment.",
            RuntimeWarning,
            stacklevel=3,
        )


@ft.cache
def _gpu_devices() -> tuple:
    for backend in ("cuda", "gpu", "rocm"):
        try:
            return tuple(jax.local_devices(backend=backend))
        except RuntimeError:
            continue
    return ()


@ft.cache
def jax_device(device: torch.device, *, name: str = "tensor"):
    """The JAX device holding the same memory as a torch device.

    Raises:
        ValueError: JAX has no such device (no GPU backend, index out of range, or a device
            type JAX does not share memory with).

    Example:
        >>> jax_device(torch.device("cpu")).platform
        'cpu'
    """
    if device.type == "cpu":
        return jax.local_devices(backend="cpu")[0]
    if device.type == "cuda":
        gpus = _gpu_devices()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= len(gpus):
            raise ValueError(
                f"to_jax: argument '{name}' is on {device}, but JAX sees {len(gpus)} GPU(s). "
                f"Install a CUDA build of jaxlib (pip install 'jax[cuda12]') whose GPUs match "
                f"torch's, or move the tensor with .cpu()."
            )
        return gpus[index]
    raise ValueError(
        f"to_jax: argument '{name}' is on {device}; flaxtorch exchanges memory only on cpu "
        f"and cuda. Move it with .cpu() or .cuda() first."
    )


def torch_device(device) -> torch.device:
    """The torch device for a JAX device.

    Example:
        >>> torch_device(jax.devices("cpu")[0])
        device(type='cpu')
    """
    if device.platform == "cpu":
        return torch.device("cpu")
    if device.platform in ("gpu", "cuda", "rocm"):
        return torch.device("cuda", _gpu_devices().index(device))
    raise ValueError(
        f"to_torch: JAX device {device} ({device.platform}) has no torch counterpart; "
        f"move the array with jax.device_put(x, jax.devices('cpu')[0]) first."
    )
