"""torch side: FlaxModule, jax_function and the parity helpers.

The call pipeline behind them (``call/_call.py``, NOTE [Call path]) is private.
"""

from torchside import parity as parity
from torchside.call._recompile import RecompileWarning as RecompileWarning
from torchside.integrations import _opacus as _opacus  # registers with Opacus when it is imported
from torchside.integrations._shard import shard as shard
from torchside.owners._jax_function import JaxFunction as JaxFunction
from torchside.owners._jax_function import jax_function as jax_function
from torchside.owners._module import FlaxModule as FlaxModule

__all__ = ["FlaxModule", "JaxFunction", "RecompileWarning", "jax_function", "parity", "shard"]
