"""torch side: FlaxModule, jax_function and the parity helpers.

The call pipeline behind them (``_call.py``, NOTE [Call path]) is private.
"""

from torchside import _opacus as _opacus  # registers with Opacus when it is imported
from torchside import parity as parity
from torchside._jax_function import JaxFunction as JaxFunction
from torchside._jax_function import jax_function as jax_function
from torchside._module import FlaxModule as FlaxModule
from torchside._recompile import RecompileWarning as RecompileWarning
from torchside._shard import shard as shard

__all__ = ["FlaxModule", "JaxFunction", "RecompileWarning", "jax_function", "parity", "shard"]
