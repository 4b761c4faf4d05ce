"""torch side: the autograd.Function, FlaxModule and parity helpers. Uses bridge and flaxside."""

from torchside import parity as parity
from torchside._function import BridgeFunction as BridgeFunction
from torchside._module import FlaxModule as FlaxModule
