"""Which devices a test process pairs: the tensors' torch device and JAX's default device.

Set from the environment before anything compiles, so that subprocesses (the two-device
cases, DDP ranks) reproduce a machine where JAX's default device is not the tensors':

* ``FLAXTORCH_TEST_TORCH_DEVICE``: the torch device the tensors live on (default ``cpu``);
* ``FLAXTORCH_TEST_JAX_DEFAULT``: JAX's default device, ``platform:index`` into
  ``jax.devices(platform)`` (``cpu:1`` needs ``XLA_FLAGS=--xla_force_host_platform_device_count=2``;
  ``gpu:0`` on a CUDA machine). Unset: JAX's default is left alone.
"""

from __future__ import annotations

import os

import jax
import torch


def jax_device_named(spec: str):
    """``"cpu:1"`` -> ``jax.devices("cpu")[1]``."""
    platform, _, index = spec.partition(":")
    devices = jax.devices(platform)
    if int(index or 0) >= len(devices):
        raise RuntimeError(
            f"FLAXTORCH_TEST_JAX_DEFAULT={spec!r}, but JAX has {len(devices)} {platform} "
            f"device(s). For two host devices set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=2 before Python starts."
        )
    return devices[int(index or 0)]


def apply_default_device():
    """Sets JAX's default device from ``FLAXTORCH_TEST_JAX_DEFAULT``; returns it (or None)."""
    spec = os.environ.get("FLAXTORCH_TEST_JAX_DEFAULT")
    if not spec:
        return None
    device = jax_device_named(spec)
    jax.config.update("jax_default_device", device)
    return device


def tensor_device() -> torch.device:
    """The torch device tensors are made on (``FLAXTORCH_TEST_TORCH_DEVICE``)."""
    return torch.device(os.environ.get("FLAXTORCH_TEST_TORCH_DEVICE", "cpu"))
