"""The device a program is compiled for, visible to code traced inside it.

``Program`` lowers every executable for one device (the torch side passes the tensors'
device; see NOTE [Devices] in ``bridge/_devices.py``). Code that compiles programs of its
own while being traced, such as ``remat_stack(lengths="auto")`` measuring candidate
nestings with ``memory_report``, reads that device here, so that it measures for the
device the block will run on rather than for JAX's default one.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_target: contextvars.ContextVar = contextvars.ContextVar("flaxside_target_device",
                                                         default=None)


def target_device():
    """The device the program being traced is compiled for; ``None`` outside a ``Program``."""
    return _target.get()


@contextlib.contextmanager
def compiling_for(device):
    """Traces and lowers inside it are for ``device`` (``None``: JAX's usual placement).

    Constants and programs without array arguments follow JAX's default device, which this
    sets to ``device`` for the duration; arguments get their placement from their avals.
    """
    if device is None:
        yield
        return
    token = _target.set(device)
    try:
        with jax.default_device(device):
            yield
    finally:
        _target.reset(token)


def jax_default_device():
    """JAX's default device, where a plain ``jax.jit`` without placed arguments runs."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def describe(device) -> str:
    """``cpu:0``, ``cuda:1``: a JAX device as messages and reports name it."""
    return f"{device.platform}:{device.id}"
