"""Pure JAX/Flax: compiled forward/residual/backward programs. Never imports torch."""

from flaxside._adapters import INVERTED_TRAIN_KWARGS as INVERTED_TRAIN_KWARGS
from flaxside._adapters import LinenAdapter as LinenAdapter
from flaxside._adapters import NNXAdapter as NNXAdapter
from flaxside._adapters import adapter_for as adapter_for
from flaxside._adapters import init_linen as init_linen
from flaxside._adapters import key_data_shape as key_data_shape
from flaxside._adapters import wrap_keys as wrap_keys
from flaxside._depends import depends_on as depends_on
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
