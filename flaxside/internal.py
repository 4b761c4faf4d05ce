"""What ``torchside`` builds on: compiled programs, Flax adapters, call structure.

Nothing here is a stable API: it changes with the torch side that uses it (as
``equinox.internal``). Users want ``flaxside.remat_stack`` and ``flaxside.memory_report``.
"""

from flaxside._adapters import INVERTED_TRAIN_KWARGS as INVERTED_TRAIN_KWARGS
from flaxside._adapters import Graph as Graph
from flaxside._adapters import LinenAdapter as LinenAdapter
from flaxside._adapters import NNXAdapter as NNXAdapter
from flaxside._adapters import adapter_for as adapter_for
from flaxside._adapters import init_linen as init_linen
from flaxside._conventions import internal_assert as internal_assert
from flaxside._depends import input_masks as input_masks
from flaxside._flat import ARRAY as ARRAY
from flaxside._flat import flat_apply as flat_apply
from flaxside._leaves import WriteBack as WriteBack
from flaxside._leaves import is_key as is_key
from flaxside._leaves import key_data_shape as key_data_shape
from flaxside._leaves import wrap_keys as wrap_keys
from flaxside._memory import compile_for_report as compile_for_report
from flaxside._memory import program_report as program_report
from flaxside._pack import PACK_BYTES as PACK_BYTES
from flaxside._pack import pack as pack
from flaxside._pack import pack_plan as pack_plan
from flaxside._pack import unpack as unpack
from flaxside._program import Program as Program
from flaxside._specs import LeafSpec as LeafSpec
from flaxside._specs import Learned as Learned
from flaxside._specs import ResidualMap as ResidualMap
from flaxside._specs import is_differentiable as is_differentiable
from flaxside._vjp_leaves import label_leaves as label_leaves

__all__ = [
    "ARRAY",
    "Graph",
    "INVERTED_TRAIN_KWARGS",
    "LeafSpec",
    "Learned",
    "PACK_BYTES",
    "LinenAdapter",
    "NNXAdapter",
    "Program",
    "ResidualMap",
    "WriteBack",
    "adapter_for",
    "compile_for_report",
    "flat_apply",
    "init_linen",
    "input_masks",
    "internal_assert",
    "is_differentiable",
    "is_key",
    "key_data_shape",
    "label_leaves",
    "pack",
    "pack_plan",
    "program_report",
    "unpack",
    "wrap_keys",
]
