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

EXIT_TIMEOUT = 60.0  # seconds the exit handler waits before it warns and lets go

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
