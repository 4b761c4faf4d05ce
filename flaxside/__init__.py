"""Pure JAX/Flax: deep rematerialized stacks and memory analysis. Never imports torch.

The user API is below. ``flaxside.internal`` holds what ``torchside`` builds on (compiled
programs, adapters); nothing there is stable.
"""

from flaxside.stacks._core import stack_apply as stack_apply
from flaxside.stacks._lengths import LengthsChoice as LengthsChoice
from flaxside.stacks._lengths import choose_stack_lengths as choose_stack_lengths
from flaxside.stacks._memory import MemoryReport as MemoryReport
from flaxside.stacks._memory import memory_report as memory_report
from flaxside.stacks._nnx import NnxRematStack as NnxRematStack
from flaxside.stacks._options import policy_names as policy_names
from flaxside.stacks._remat_stack import RematStack as RematStack
from flaxside.stacks._remat_stack import remat_stack as remat_stack

__all__ = [
    "LengthsChoice",
    "MemoryReport",
    "NnxRematStack",
    "RematStack",
    "choose_stack_lengths",
    "memory_report",
    "policy_names",
    "remat_stack",
    "stack_apply",
]
