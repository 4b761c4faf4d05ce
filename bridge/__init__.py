"""torch <-> JAX arrays: zero-copy exchange, dtype and device tables. Never imports flax."""

from bridge._devices import configure_gpu_memory as configure_gpu_memory

configure_gpu_memory()  # before anything can start JAX's GPU backend

from bridge._devices import jax_device as jax_device  # noqa: E402
from bridge._devices import torch_device as torch_device  # noqa: E402
from bridge._dtypes import numpy_dtype as numpy_dtype  # noqa: E402
from bridge._dtypes import torch_dtype as torch_dtype  # noqa: E402
from bridge._exchange import ALIGNMENT as ALIGNMENT  # noqa: E402
from bridge._exchange import HeldArrays as HeldArrays  # noqa: E402
from bridge._exchange import cpu_tensor as cpu_tensor  # noqa: E402
from bridge._exchange import is_zero_copy as is_zero_copy  # noqa: E402
from bridge._exchange import numpy_view as numpy_view  # noqa: E402
from bridge._exchange import to_jax as to_jax  # noqa: E402
from bridge._exchange import to_torch as to_torch  # noqa: E402
from bridge._exchange import tree_to_jax as tree_to_jax  # noqa: E402
from bridge._exchange import tree_to_torch as tree_to_torch  # noqa: E402
