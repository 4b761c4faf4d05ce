"""torch <-> JAX arrays: zero-copy exchange, dtype and device tables. Never imports flax."""

from bridge._devices import configure_gpu_memory as configure_gpu_memory

configure_gpu_memory()  # before anything can start JAX's GPU backend

from bridge._convert import is_zero_copy as is_zero_copy  # noqa: E402
from bridge._convert import to_jax as to_jax  # noqa: E402
from bridge._convert import to_torch as to_torch  # noqa: E402
from bridge._convert import tree_to_jax as tree_to_jax  # noqa: E402
from bridge._convert import tree_to_torch as tree_to_torch  # noqa: E402
from bridge._devices import default_torch_device as default_torch_device  # noqa: E402
from bridge._devices import jax_device as jax_device  # noqa: E402
from bridge._devices import torch_device as torch_device  # noqa: E402
from bridge._dtypes import narrow_to_int32 as narrow_to_int32  # noqa: E402
from bridge._dtypes import narrows_to_int32 as narrows_to_int32  # noqa: E402
from bridge._dtypes import numpy_dtype as numpy_dtype  # noqa: E402
from bridge._dtypes import torch_dtype as torch_dtype  # noqa: E402
from bridge._exchange import ALIGNMENT as ALIGNMENT  # noqa: E402
from bridge._exchange import EXCHANGE_MODES as EXCHANGE_MODES  # noqa: E402
from bridge._exchange import HeldArrays as HeldArrays  # noqa: E402
from bridge._exchange import OrderingEvent as OrderingEvent  # noqa: E402
from bridge._exchange import cpu_tensor as cpu_tensor  # noqa: E402
from bridge._exchange import cpu_view as cpu_view  # noqa: E402
from bridge._exchange import exchange_for as exchange_for  # noqa: E402
from bridge._exchange import exchange_mode as exchange_mode  # noqa: E402
from bridge._exchange import record_ordering as record_ordering  # noqa: E402
from bridge._exchange import set_exchange_mode as set_exchange_mode  # noqa: E402
