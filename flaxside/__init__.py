"""Pure JAX/Flax: compiled forward/residual/backward programs. Never imports torch."""

from flaxside._flat import ARRAY as ARRAY
from flaxside._flat import flat_apply as flat_apply
from flaxside._lengths import LengthsChoice as LengthsChoice
from flaxside._lengths import choose_stack_lengths as choose_stack_lengths
from flaxside._memory import MemoryReport as MemoryReport
from flaxside._memory import memory_report as memory_report
from flaxside._program import LeafSpec as LeafSpec
from flaxside._program import Program as Program
from flaxside._program import StaleSignature as StaleSignature
from flaxside._program import is_differentiable as is_differentiable
from flaxside._stack import RematStack as RematStack
from flaxside._stack import remat_stack as remat_stack
from flaxside._stack_args import policy_names as policy_names
from flaxside._stack_core import stack_apply as stack_apply
from flaxside._stack_nnx import NnxRematStack as NnxRematStack
