"""Pure JAX/Flax: deep rematerialized stacks and memory analysis. Never imports torch.

The user API is below. ``flaxside.internal`` holds what ``torchside`` builds on (compiled
programs, adapters); nothing there is stable.
"""

from flaxside._lengths import LengthsChoice as LengthsChoice
from flaxside._lengths import choose_stack_lengths as choose_stack_lengths
from flaxside._memory import MemoryReport as MemoryReport
from flaxside._memory import memory_report as memory_report
from flaxside._stack import RematStack as RematStack
from flaxside._stack import remat_stack as remat_stack
from flaxside._stack_args import policy_names as policy_names
from flaxside._stack_core import stack_apply as stack_apply
from flaxside._stack_nnx import NnxRematStack as NnxRematStack

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
