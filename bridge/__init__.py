"""torch <-> JAX arrays: zero-copy exchange, dtype and device tables. Never imports flax.

The user API is below. ``bridge.internal`` holds the exchange machinery a call of
``torchside`` uses (held arrays, per-call views, ordering, int64 narrowing); nothing there
is stable. Importing this package keeps JAX from preallocating GPU memory beside torch
(``configure_gpu_memory``).

``EXCHANGE_MODES`` are the modes ``set_exchange_mode`` accepts: ``"auto"`` (pointer views
on CPU, DLPack on CUDA; the default) and ``"dlpack"`` (DLPack everywhere, so that CUDA's
route runs on a CPU); the environment variable ``FLAXTORCH_EXCHANGE`` sets the first.

Example:
    >>> import bridge
    >>> bridge.EXCHANGE_MODES
    ('auto', 'dlpack')
    >>> previous = bridge.set_exchange_mode("dlpack")  # for calls compiled from now on
    >>> bridge.exchange_mode(), previous in bridge.EXCHANGE_MODES
    ('dlpack', True)
    >>> _ = bridge.set_exchange_mode(previous)
"""

from bridge import internal as internal
from bridge._convert import to_jax as to_jax
from bridge._convert import to_torch as to_torch
from bridge._convert import tree_to_jax as tree_to_jax
from bridge._convert import tree_to_torch as tree_to_torch
from bridge._devices import configure_gpu_memory as configure_gpu_memory
from bridge._devices import jax_device as jax_device
from bridge._devices import torch_device as torch_device
from bridge._dtypes import numpy_dtype as numpy_dtype
from bridge._dtypes import torch_dtype as torch_dtype
from bridge._exchange import is_zero_copy as is_zero_copy
from bridge._rules import EXCHANGE_MODES as EXCHANGE_MODES
from bridge._rules import exchange_mode as exchange_mode
from bridge._rules import set_exchange_mode as set_exchange_mode

__all__ = [
    "EXCHANGE_MODES",
    "configure_gpu_memory",
    "exchange_mode",
    "is_zero_copy",
    "jax_device",
    "numpy_dtype",
    "set_exchange_mode",
    "to_jax",
    "to_torch",
    "torch_device",
    "torch_dtype",
    "tree_to_jax",
    "tree_to_torch",
]
