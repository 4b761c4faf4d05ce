"""The one device table: torch ``cpu`` <-> JAX's CPU backend, torch ``cuda:i`` <-> JAX GPU ``i``.

NOTE [Devices]. The tensors decide where a program runs, never JAX's default device:

* torch ``cpu`` is the first device of JAX's CPU backend, also where JAX's default backend
  is a GPU (a CPU module on a host whose jaxlib has CUDA must stay on the CPU);
* torch ``cuda:i`` is the JAX GPU whose ``local_hardware_id`` is ``i``: both number the
  GPUs that ``CUDA_VISIBLE_DEVICES`` leaves visible to this process, in the same order.
  Under ``torchrun`` every process sees every GPU and rank ``r`` works on ``cuda:r``, so a
  program compiled for JAX's default device (GPU 0) would fail on every rank but 0.

Every compiled program is lowered for the device this table gives for its tensors (the
device is part of the call signature), and results come back there. Two host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``) with JAX's default device set to
the second reproduce the ``torchrun`` case on a CPU (``tests/devices/test_devices.py``).
"""

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
_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def configure_gpu_memory() -> None:
    """Keep JAX from preallocating GPU memory beside torch.

    Sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless the user set it) before JAX starts
    its GPU backend, so that JAX allocates what it uses, as torch's caching allocator does,
    instead of reserving 75% of the GPU at start-up. If that backend already started, warns
    once: the setting can no longer take effect.

    Example:
        >>> import os
        >>> import bridge  # calls configure_gpu_memory() before JAX can start a GPU backend
        >>> os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"]  # unless you had set it yourself
        'false'
        >>> bridge.configure_gpu_memory()  # again: nothing to do, the variable is set
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
    if any(name in _GPU_PLATFORMS for name in started):
        warnings.warn(
            "flaxtorch: JAX's GPU backend started before flaxtorch was imported, so it may "
            "have preallocated most of the GPU memory torch needs. Import flaxtorch (bridge) "
            "before using JAX, or set XLA_PYTHON_CLIENT_PREALLOCATE=false in the environment.",
            RuntimeWarning,
            stacklevel=3,
        )


@ft.cache
def _cpu_device():
    return jax.local_devices(backend="cpu")[0]


@ft.cache
def _gpu_devices() -> tuple:
    """This process's JAX GPUs, or ``()`` where jaxlib has no GPU backend."""
    for backend in _GPU_PLATFORMS:
        try:
            return tuple(jax.local_devices(backend=backend))
        except RuntimeError:
            continue
    return ()


def _no_gpu_fix() -> str:
    cuda = getattr(torch.version, "cuda", None)
    if getattr(torch.version, "hip", None):
        return "Install a ROCm build of jaxlib (see JAX's install guide for AMD GPUs)"
    major = cuda.split(".")[0] if cuda else "12"
    return (f"Install the CUDA build of JAX that matches torch's CUDA {cuda or '(unknown)'}: "
            f"pip install -U 'jax[cuda{major}]'")


@ft.cache
def jax_device(device: torch.device, *, name: str = "tensor"):
    """The JAX device holding the same memory as a torch device (see NOTE [Devices]).

    Args:
        device: a torch device (``cpu``, ``cuda``, ``cuda:i``).
        name: the argument named in errors.

    Raises:
        ValueError: JAX has no such device: no GPU backend (the message names the jaxlib
            to install), a GPU JAX does not see, or a device type JAX shares no memory with.

    Example:
        >>> jax_device(torch.device("cpu")).platform
        'cpu'
    """
    if device.type == "cpu":
        return _cpu_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpus = _gpu_devices()
        for d in gpus:
            if d.local_hardware_id == index:
                return d
        if not gpus:
            raise ValueError(
                f"argument '{name}' is on {device}, but this JAX has no GPU backend "
                f"(jax {jax.__version__}, CPU only). {_no_gpu_fix()}, or move the tensor "
                f"with .cpu()."
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
        raise ValueError(
            f"argument '{name}' is on cuda:{index}, but JAX sees the GPUs "
            f"{sorted(d.local_hardware_id for d in gpus)} only. torch and JAX must see the "
            f"same GPUs: set CUDA_VISIBLE_DEVICES (now {visible}) before either starts, "
            f"not in between."
        )
    raise ValueError(
        f"argument '{name}' is on {device}; flaxtorch exchanges memory on cpu and cuda "
        f"only. Move it with .cpu() or .cuda() first."
    )


def torch_device(device) -> torch.device:
    """The torch device for a JAX device (the inverse of ``jax_device``).

    Example:
        >>> torch_device(jax.devices("cpu")[0])
        device(type='cpu')
    """
    if device.platform == "cpu":
        return torch.device("cpu")
    if device.platform in _GPU_PLATFORMS:
        return torch.device("cuda", device.local_hardware_id)
    raise ValueError(
        f"JAX device {device} ({device.platform}) has no torch counterpart; "
        f"move the array with jax.device_put(x, jax.devices('cpu')[0]) first."
    )


def default_torch_device() -> torch.device:
    """Where a new module's variables go: torch's default device, as for ``torch.nn.Linear``.

    ``torch.set_default_device("cuda")`` or ``with torch.device("cuda"):`` put them on the
    GPU, ``with torch.device("meta"):`` on the meta device (shapes only, no memory); other
    devices, which JAX shares no memory with, fall back to the CPU.
    """
    get = getattr(torch, "get_default_device", None)
    device = get() if get is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device if device.type in ("cpu", "cuda", "meta") else torch.device("cpu")


# Before anything can start JAX's GPU backend: importing bridge (which imports this module
# first) is what keeps JAX from reserving most of the GPU beside torch.
configure_gpu_memory()
