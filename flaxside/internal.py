"""What ``torchside`` builds on: compiled programs, Flax adapters, call structure.

Exactly what ``torchside`` and the tests use. Nothing here is a stable API: it changes with
the torch side that uses it (as ``equinox.internal``). Users want ``flaxside.remat_stack``
and ``flaxside.memory_report``.
"""

from flaxside.adapters._adapt import adapter_for as adapter_for
from flaxside.adapters._adapt import is_nnx_factory as is_nnx_factory
from flaxside.adapters._adapt import is_nnx_module as is_nnx_module
from flaxside.adapters._flat_apply import ARRAY as ARRAY
from flaxside.adapters._flat_apply import flat_apply as flat_apply
from flaxside.adapters._linen import init_linen as init_linen
from flaxside.adapters._nnx import Graph as Graph
from flaxside.adapters._nnx import build_nnx as build_nnx
from flaxside.adapters._nnx import nnx_merged as nnx_merged
from flaxside.adapters._nnx import nnx_shapes as nnx_shapes
from flaxside.adapters._nnx import nnx_state as nnx_state
from flaxside.derivatives._functions import Batched as Batched
from flaxside.derivatives._functions import batched_function as batched_function
from flaxside.derivatives._functions import jvp_function as jvp_function
from flaxside.derivatives._functions import linearized_vjp as linearized_vjp
from flaxside.derivatives._functions import per_sample_norms_function as per_sample_norms_function
from flaxside.derivatives._functions import per_sample_vjp_function as per_sample_vjp_function
from flaxside.derivatives._functions import vjp_function as vjp_function
from flaxside.derivatives._functions import vjp_work as vjp_work
from flaxside.derivatives._given import given_vjp as given_vjp
from flaxside.mesh._on_mesh import OnMesh as OnMesh
from flaxside.program._codecs import WriteBack as WriteBack
from flaxside.program._codecs import key_data_shape as key_data_shape
from flaxside.program._codecs import wrap_keys as wrap_keys
from flaxside.program._conventions import internal_assert as internal_assert
from flaxside.program._one_device import OnDevice as OnDevice
from flaxside.program._pack import PACK_BYTES as PACK_BYTES
from flaxside.program._pack import Alone as Alone
from flaxside.program._pack import Packed as Packed
from flaxside.program._pack import unpack as unpack
from flaxside.program._program import Program as Program
from flaxside.program._specs import LeafSpec as LeafSpec
from flaxside.program._specs import ResidualMap as ResidualMap
from flaxside.program._specs import is_differentiable as is_differentiable
from flaxside.program._specs import spec_axes as spec_axes
from flaxside.stacks._memory import compile_for_report as compile_for_report
from flaxside.stacks._memory import program_report as program_report

__all__ = [
    "Alone",
    "ARRAY",
    "Batched",
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
    "build_nnx",
    "compile_for_report",
    "flat_apply",
    "given_vjp",
    "init_linen",
    "internal_assert",
    "is_differentiable",
    "is_nnx_factory",
    "is_nnx_module",
    "jvp_function",
    "key_data_shape",
    "linearized_vjp",
    "nnx_merged",
    "nnx_shapes",
    "nnx_state",
    "per_sample_norms_function",
    "per_sample_vjp_function",
    "program_report",
    "spec_axes",
    "unpack",
    "vjp_function",
    "vjp_work",
    "wrap_keys",
]
