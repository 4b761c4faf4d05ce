"""torch side: the autograd.Function and FlaxModule. Uses bridge and flaxside."""

from torchside._function import BridgeFunction as BridgeFunction
from torchside._module import FlaxModule as FlaxModule
