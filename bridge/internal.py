"""What ``torchside`` builds on: held arrays, per-call exchange, ordering, int64 narrowing.

Nothing here is a stable API: it changes with the torch side that uses it (as
``equinox.internal``). Users want ``bridge.to_jax`` / ``bridge.to_torch``.
"""

from bridge._devices import default_torch_device as default_torch_device
from bridge._dlpack import own_arrays as own_arrays
from bridge._dlpack import stored_array as stored_array
from bridge._dtypes import narrow_to_int32 as narrow_to_int32
from bridge._dtypes import narrows_to_int32 as narrows_to_int32
from bridge._exchange import exchange_for as exchange_for
from bridge._held import HeldArrays as HeldArrays
from bridge._ordering import OrderingEvent as OrderingEvent
from bridge._ordering import record_ordering as record_ordering
from bridge._rules import ALIGNMENT as ALIGNMENT
from bridge._rules import check_memory as check_memory

__all__ = [
    "ALIGNMENT",
    "HeldArrays",
    "OrderingEvent",
    "check_memory",
    "default_torch_device",
    "exchange_for",
    "narrow_to_int32",
    "narrows_to_int32",
    "own_arrays",
    "record_ordering",
    "stored_array",
]
