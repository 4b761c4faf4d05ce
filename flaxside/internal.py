"""What ``torchside`` builds on: compiled programs, Flax adapters, call structure.

Exactly what ``torchside`` and the tests use. Nothing here is a stable API: it changes with
the torch side that uses it (as ``equinox.internal``). Users want ``flaxside.remat_stack``
and ``flaxside.memory_report``.
"""

from flaxside._adapters import adapter_for as adapter_for
from flaxside._conventions import internal_assert as internal_assert
from flaxside._flat import ARRAY as ARRAY
from flaxside._flat import flat_apply as flat_apply
from flaxside._given import given_vjp as given_vjp
from flaxside._higher import batched_function as batched_function
from flaxside._higher import jvp_function as jvp_function
from flaxside._higher import linearized_vjp as linearized_vjp
from flaxside._higher import per_sample_norms_function as per_sample_norms_function
from flaxside._higher import per_sample_vjp_function as per_sample_vjp_function
from flaxside._higher import vjp_function as vjp_function
from flaxside._higher import vjp_work as vjp_work
from flaxside._leaves import WriteBack as WriteBack
from flaxside._leaves import key_data_shape as key_data_shape
from flaxside._leaves import wrap_keys as wrap_keys
from flaxside._linen import init_linen as init_linen
from flaxside._memory import compile_for_report as compile_for_report
from flaxside._memory import program_report as program_report
from flaxside._nnx import Graph as Graph
from flaxside._on_device import OnDevice as OnDevice
from flaxside._pack import PACK_BYTES as PACK_BYTES
from flaxside._pack import Alone as Alone
from flaxside._pack import Packed as Packed
from flaxside._pack import unpack as unpack
from flaxside._placement import OnMesh as OnMesh
from flaxside._program import Program as Program
from flaxside._specs import LeafSpec as LeafSpec
from flaxside._specs import ResidualMap as ResidualMap
from flaxside._specs import is_differentiable as is_differentiable
from flaxside._specs import spec_axes as spec_axes

__all__ = [
    "ARRAY",
    "Alone",
    "Graph",
    "LeafSpec",
    "OnDevice",
    "OnMesh",
    "PACK_BYTES",
    "Packed",
    "Program",
    "ResidualMap",
    "WriteBack",
    "adapter_for",
    "batched_function",
    "compile_for_report",
    "flat_apply",
    "given_vjp",
    "init_linen",
    "internal_assert",
    "is_differentiable",
    "jvp_function",
    "key_data_shape",
    "per_sample_norms_function",
    "per_sample_vjp_function",
    "linearized_vjp",
    "program_report",
    "spec_axes",
    "unpack",
    "vjp_function",
    "vjp_work",
    "wrap_keys",
]
