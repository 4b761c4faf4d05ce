"""What the DLPack route (``DlpackExchange`` in ``_exchange.py``) does besides exchanging.

Every export it makes goes through ``Observed``, which records the step for
``record_ordering`` (``_ordering.py``) while a log is open, and every import is recorded
(``imported``) for the exit handler below. ``own_arrays`` makes a result's torch storage
keep its JAX array, for a backward to reuse (``stored_array``).

NOTE [Imports at exit]. A program run keeps its inputs until it has finished, and JAX
dispatches runs asynchronously: the thread of JAX's that finishes a run drops them. When
that drop is the last reference to a tensor torch exported by DLPack, torch's deleter runs
on that thread and takes the GIL to release the tensor's Python object. Once the
interpreter is finalizing, a thread that asks for the GIL is ended with ``pthread_exit``,
whose unwinding through C++ frames that may not throw aborts the process ("terminate called
without an active exception"; ``examples/exit_aborts.py`` counts such exits on CPU with
``FLAXTORCH_EXCHANGE=dlpack``). On a GPU, JAX's client may well release a
run's inputs from a thread of its own too, once the stream has passed the run (not seen:
the exit test passed on the one GPU run, which does not show whether the wait was needed),
so the same wait applies there.

So every import the exchange makes is recorded here as a pair of weak references, to the
tensor object torch exported (a fresh ``detach()`` nobody else holds) and to the JAX array
over it, and an exit handler waits, with the GIL released, until no tensor is alive whose
array Python has dropped: JAX's threads have let go of every import. Imports whose arrays
Python still holds (a module's held parameters) are released later by the finalizing main
thread, which holds the GIL.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref

import jax
import torch

from bridge._ordering import OrderingEvent, current_stream, recorders

try:  # NOTE [Lean crossing]: jaxlib's own DLPack entry points, where their form is known
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _JAXLIB_EXTENSION
except ImportError:  # pragma: no cover - a jax that moved them: the public path
    _jaxlib, _JAXLIB_EXTENSION = None, 0

EXIT_TIMEOUT = 60.0  # seconds the exit handler waits before it warns and lets go

# NOTE [Lean crossing]. ``jax.dlpack.from_dlpack`` and ``torch.from_dlpack`` cost 39 and 7 us
# a tensor on a CPU (``examples/bench/call_costs.py``), almost all of it Python: each asks
# the producer for its device, looks up the backend and JAX's stream, checks its arguments
# and wraps the result again (``jnp.asarray``). A call of the DLPack route knows all of
# that already (its exchange is one device's), so it goes straight to what both end in:
# ``torch._C._to_dlpack`` and jaxlib's ``dlpack_managed_tensor_to_buffer`` for an import,
# jaxlib's ``buffer_to_dlpack_managed_tensor`` and ``torch._C._from_dlpack`` for an export.
# Those are private names, so the lean path is taken only where their form is the one
# ``jax.dlpack.from_dlpack`` of the same release calls (jaxlib extension 467 and later:
# jax 0.10.x, which CI runs); elsewhere (the oldest leg's jax 0.8.1) the public calls run,
# and ``LEAN = False`` forces them (tests run both). Ordering is unchanged in meaning: an
# argument's import makes no stream handshake of its own, since the run's fence, exported
# after every argument's import, orders the program after all of torch's queued writes
# (NOTE [Exchange] in ``_exchange.py``); the fence itself and each export still hand
# over streams as the public calls do. Every crossing records itself (``record``) where it
# happens, as ``Observed`` does on the public path.
LEAN = _jaxlib is not None and _JAXLIB_EXTENSION >= 467

# weak ref to the exported tensor (its callback removes the entry) -> weak ref to the array
_imports: dict = {}


def _forget(tensor_ref) -> None:
    _imports.pop(tensor_ref, None)  # runs on whichever thread drops the tensor, with the GIL


def imported(tensor: torch.Tensor, array: jax.Array) -> jax.Array:
    """Records that ``array`` is JAX's import of ``tensor``; returns ``array``.

    ``tensor`` must be the object given to JAX's ``from_dlpack`` and held by nothing else
    the caller keeps (a fresh ``detach()``), so that it dies when JAX lets go of it.
    """
    _imports[weakref.ref(tensor, _forget)] = weakref.ref(array)
    return array


def jax_held() -> int:
    """How many imports only JAX holds now (their arrays dropped by Python, not yet by JAX)."""
    return sum(1 for a in tuple(_imports.values()) if a() is None)


def wait_for_jax(timeout: float = EXIT_TIMEOUT) -> bool:
    """Waits, with the GIL released, until JAX holds no import Python has dropped.

    Returns whether it got there within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while jax_held():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # releases the GIL: JAX's threads take it to drop the tensors
    return True


@atexit.register  # registered after jax's own handlers, so it runs before them
def _wait_at_exit() -> None:
    if _imports and not wait_for_jax():
        print(f"flaxtorch: at exit, JAX still held {jax_held()} torch tensors after "
              f"{EXIT_TIMEOUT:.0f} s; the interpreter may abort while finalizing "
              f"(NOTE [Imports at exit] in bridge/_dlpack.py).", file=sys.stderr)


def record(kind: str, device: torch.device, stream=None, detail=None) -> None:
    """Appends one step to every open ``record_ordering`` log (``_ordering.py``)."""
    event = OrderingEvent(kind, device, stream, detail)
    for log in recorders:
        log.append(event)


class Observed:
    """A tensor or array whose DLPack export records itself as an ordering step.

    ``torch->jax`` kinds record torch's current stream (the producer's) and the stream JAX
    passed; ``jax->torch`` records the stream torch passed (``streams`` keeps them). Every
    export of the DLPack route goes through one, so that the steps a test records are the
    steps every call makes: a fence imported once and reused is missing from the log.
    """

    __slots__ = ("obj", "kind", "device", "streams")

    def __init__(self, obj, kind: str, device: torch.device):
        self.obj, self.kind, self.device, self.streams = obj, kind, device, []

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()

    def __dlpack__(self, *args, stream=None, **kwargs):
        self.streams.append(stream)
        if recorders and self.kind != "jax->torch":
            record(self.kind, self.device, current_stream(self.device),
                   (stream, self.obj.data_ptr()))
        return self.obj.__dlpack__(*args, stream=stream, **kwargs)


class Crossing:
    """The DLPack crossings of one device's exchange: lean or public (NOTE [Lean crossing]).

    Args:
        jax_device: the JAX device every import lands on.
        torch_device: the torch device of the tensors that cross.
        lean: take the lean path (``LEAN`` when the exchange is made).
    """

    __slots__ = ("jax_device", "torch_device", "lean", "dl_type", "_stream")

    def __init__(self, jax_device, torch_device: torch.device, lean: bool):
        self.jax_device, self.torch_device, self.lean = jax_device, torch_device, lean
        self.dl_type = 2 if torch_device.type == "cuda" else 1  # kDLCUDA, kDLCPU
        self._stream = False  # JAX's stream for external ready events: read at first use

    def _jax_stream(self):
        """The stream JAX asks a producer to order its export on (``None`` on a CPU)."""
        if self._stream is False:
            try:
                self._stream = self.jax_device.get_stream_for_external_ready_events()
            except Exception as e:  # a CPU device: UNIMPLEMENTED, as from_dlpack handles it
                if "UNIMPLEMENTED" not in str(e):
                    raise
                self._stream = None
        return self._stream

    def argument(self, tensor: torch.Tensor) -> jax.Array:
        """JAX's array over ``tensor`` (compact, detached, with memory): an argument of a run.

        Ordered by the run's fence, which is imported after it.
        """
        if not self.lean:
            return jax.dlpack.from_dlpack(Observed(tensor, "import", self.torch_device))
        if recorders:
            record("import", self.torch_device, current_stream(self.torch_device),
                   (None, tensor.data_ptr()))
        return _jaxlib.dlpack_managed_tensor_to_buffer(
            torch._C._to_dlpack(tensor), self.jax_device, None, None, self.dl_type)

    def fence(self, tensor: torch.Tensor) -> jax.Array:
        """JAX's array over the fence ``tensor``, after everything torch has queued."""
        observed = Observed(tensor, "torch->jax", self.torch_device)
        if not self.lean:
            return jax.dlpack.from_dlpack(observed)
        stream = self._jax_stream()
        return _jaxlib.dlpack_managed_tensor_to_buffer(
            observed.__dlpack__(stream=stream), self.jax_device, stream, None, self.dl_type)

    def results(self, arrays: list) -> list[torch.Tensor]:
        """Torch tensors over a run's result ``arrays``, handed to torch's current stream."""
        device = self.torch_device
        if self.lean:
            stream = None if self.dl_type == 1 else current_stream(device)  # a CPU: no stream
            # addressable_data(0): a new array over the same buffer, as jax's own to_dlpack
            # exports, so that the capsule (which torch's memory keeps) holds that one and
            # ``a`` lives as ``own_arrays`` says, not as long as torch's memory by chance.
            tensors = [torch._C._from_dlpack(_jaxlib.buffer_to_dlpack_managed_tensor(
                a.addressable_data(0), stream=stream)) for a in arrays]
            streams = (stream,)
        else:
            observed = [Observed(a, "jax->torch", device) for a in arrays]
            tensors = [torch.from_dlpack(o) for o in observed]
            streams = tuple({s for o in observed for s in o.streams})
        if recorders:
            record("jax->torch", device, streams[0] if len(streams) == 1 else streams,
                   tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors))
        return tensors


# The attribute of a torch storage, made over a JAX result on the DLPack route, that holds
# the result's array (``own_arrays``).
_ARRAY = "_flaxtorch_array"


def own_arrays(tensors, arrays) -> None:
    """Makes each torch storage over a result (DLPack route) hold the result's array.

    On the CPU route ``cpu_tensor``'s tensor owns its array (its base), so a weak
    reference to the array lives exactly as long as torch's memory. On the DLPack route the
    tensor owns JAX's buffer but not the array object, and a weak reference dies at once:
    every backward imported each saved tensor again (about 70 us an import on a GPU: most
    of a small block's call there). torch keeps a storage's Python object, and its
    attributes, as long as the storage lives (views, saved tensors and ``tensor_data()``
    share it), so the array lives exactly as long as torch's memory: until the backward
    frees what it saved, a saved-tensor hook drops the tensor it moved off the device, or
    torch drops a graph never run backward.
    """
    for t, a in zip(tensors, arrays, strict=True):
        setattr(t.untyped_storage(), _ARRAY, a)


def stored_array(tensor: torch.Tensor):
    """The array ``own_arrays`` gave ``tensor``'s storage, or ``None``."""
    return getattr(tensor.untyped_storage(), _ARRAY, None)
