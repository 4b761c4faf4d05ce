"""torch side: the autograd.Function, FlaxModule, jax_function and parity helpers."""

from torchside import parity as parity
from torchside._call import BridgeFunction as BridgeFunction
from torchside._jax_function import JaxFunction as JaxFunction
from torchside._jax_function import jax_function as jax_function
from torchside._module import FlaxModule as FlaxModule
from torchside._recompile import RecompileWarning as RecompileWarning
