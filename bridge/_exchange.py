"""Per-call exchange between torch tensors and JAX arrays: views in, results out, ordering.

NOTE [Exchange]. Every route is zero-copy where JAX can use the memory in place.

* CPU (default): a numpy array over the tensor's memory, built from its data pointer
  through the array interface. ``tensor.numpy()`` is never used: it marks the storage
  non-resizable for good, and FSDP2's ``storage.resize_(0)`` then fails. Results come back
  as torch tensors over the JAX buffers, after waiting for them.
* DLPack (CUDA, or any device with ``FLAXTORCH_EXCHANGE=dlpack``): ``__dlpack__`` both
  ways. The forced mode sends CPU tensors through this code so that CI runs it.

Held arrays (``HeldArrays`` in ``_held.py``): an owner's parameters and buffers keep their
memory from call to call (optimizers and ``load_state_dict`` write in place), so each gets
one JAX array over that memory, reused while the tensor's address, device, dtype, shape, strides
and flags are unchanged, and replaced (releasing the old one) at the first call that sees
otherwise. Old bits are never read as a new dtype or shape, nor one device's memory as
another's.

Ordering. Every program runs through its exchange's ``run``, the one place that orders
JAX's work after torch's and torch's after JAX's:

* CPU: a jitted call returns before it has run, so ``run`` waits for the results before
  torch may read them; results depend on the inputs they read, so no input can be
  overwritten by torch while JAX still reads it. With ``wait=False`` the caller waits
  (``wait``) after bookkeeping that reads no result: ``BridgeFunction`` saves for
  backward and views packed gradients while JAX computes, and waits before it returns.
* DLPack: a held array was imported once, long before torch's latest write to it (an
  optimizer step), so importing it ordered nothing this call. Before each program ``run``
  imports one tiny fence tensor (torch's current stream -> an event -> JAX's stream: JAX's
  ``from_dlpack`` passes its stream to torch's ``__dlpack__``), and the program takes it
  as an argument it waits for (``keep_unused``): one fence per run, after every write
  torch has queued, before JAX reads anything. Results are exported to torch's current
  stream (``torch.from_dlpack`` passes it to JAX's ``__dlpack__``), so torch's next work,
  a write to an output included, waits for JAX's. ``record_ordering`` records these
  steps from inside the exports that make them (``_ordering.py``), so that tests check
  them on a CPU. Exit
  waits for JAX to let go of every import (NOTE [Imports at exit], ``bridge/_imports.py``).
"""

from __future__ import annotations

import functools as ft
import os

import jax
import numpy as np
import torch

from bridge import _devices, _dtypes
from bridge._imports import imported
from bridge._ordering import Observed, record, recorders

ALIGNMENT = 64  # bytes; XLA's CPU client copies host buffers aligned less than this.

EXCHANGE_MODES = ("auto", "dlpack")
_exchange_mode = os.environ.get("FLAXTORCH_EXCHANGE", "auto")
if _exchange_mode not in EXCHANGE_MODES:
    raise ValueError(
        f"flaxtorch: FLAXTORCH_EXCHANGE={_exchange_mode!r} is not one of {EXCHANGE_MODES}: "
        f"'auto' uses pointer views on CPU and DLPack on CUDA, 'dlpack' uses DLPack everywhere."
    )


def exchange_mode() -> str:
    """``"auto"`` (pointer views on CPU, DLPack on CUDA) or ``"dlpack"`` (DLPack everywhere)."""
    return _exchange_mode


def set_exchange_mode(mode: str) -> str:
    """Sets the exchange mode for calls compiled from now on; returns the previous one.

    ``"dlpack"`` sends CPU tensors through the code path CUDA uses (DLPack imports and
    exports, one fence per call), so that it runs without a GPU. Also settable with the
    environment variable ``FLAXTORCH_EXCHANGE``.
    """
    global _exchange_mode
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"set_exchange_mode: mode={mode!r} is not one of {EXCHANGE_MODES}.")
    previous, _exchange_mode = _exchange_mode, mode
    return previous


class _Memory:
    """Memory at an address, as numpy sees it through the array interface.

    ``owner`` keeps the memory alive for as long as numpy (or JAX, which keeps the numpy
    array) uses it; held arrays pass ``None`` (see ``HeldArrays``).
    """

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner, pointer: int, shape: tuple, typestr: str):
        self.owner = owner
        self.__array_interface__ = {
            "data": (pointer, False),
            "shape": shape,
            "typestr": typestr,
            "version": 3,
        }


def in_place(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its values as JAX reads them.

    Compact, with no lazy conjugate or negative bit; alignment aside (``is_zero_copy``).
    """
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def is_zero_copy(tensor: torch.Tensor) -> bool:
    """Whether JAX can use ``tensor``'s memory in place (compact and 64-byte aligned)."""
    return in_place(tensor) and tensor.data_ptr() % ALIGNMENT == 0


def logical(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its values in memory: compact, no lazy conjugate or negative bit."""
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if not tensor.is_contiguous():
        # Stride-0 (expanded) and transposed tensors: JAX would reject the first and compile a
        # second executable for the layout of the second. One compact copy avoids both.
        tensor = tensor.contiguous()
    return tensor


def cpu_view(tensor: torch.Tensor, owner=True) -> np.ndarray:
    """A numpy array over a CPU tensor's memory (compacted and resolved first if needed).

    The caller has checked the dtype (``_dtypes.numpy_dtype``). ``owner=True`` keeps the
    tensor alive with the view; ``None`` does not (held arrays).
    """
    if not in_place(tensor):
        tensor = logical(tensor.detach())  # a copy; detached so autograd records nothing
    typestr, np_dtype = _dtypes.view_typestr(tensor.dtype)
    shape = tuple(tensor.shape)
    if 0 in shape:
        return np.empty(shape, np_dtype)
    pointer = tensor.data_ptr()
    if not pointer:
        raise _no_memory(tensor)
    view = np.asarray(_Memory(tensor if owner else None, pointer, shape, typestr))
    return view if view.dtype == np_dtype else view.view(np_dtype)


def cpu_tensor(array: jax.Array) -> torch.Tensor:
    """A torch view of a JAX CPU array (no copy) that keeps the array alive.

    The buffer exists from dispatch on; torch may read it once the array is ready.
    """
    typestr, view_as = _dtypes.typestr(array.dtype)
    shape = array.shape
    if 0 in shape:  # not array.size: a Python property, slower on this path
        return torch.empty(shape, dtype=view_as or _dtypes.torch_dtype(array.dtype),
                           device="cpu")  # not torch's default device, which may be a GPU
    out = torch.from_numpy(np.asarray(
        _Memory(array, array.unsafe_buffer_pointer(), shape, typestr)))
    return out if view_as is None else out.view(view_as)


def _holdable(tensor: torch.Tensor) -> bool:
    return tensor.is_leaf and is_zero_copy(tensor)


def _no_memory(tensor: torch.Tensor, what: str = "a tensor") -> TypeError:
    return TypeError(
        f"flaxtorch: {what} is a {type(tensor).__name__} of shape {tuple(tensor.shape)} "
        f"with no memory of its own (a tensor subclass that wraps others, such as a DTensor "
        f"or a pickled DTensor), so JAX has nothing to read. Pass a tensor with memory: a "
        f"DTensor's to_local() or full_tensor(), or the tensor the subclass wraps."
    )


def check_memory(tensor: torch.Tensor, what: str) -> None:
    """Refuses a tensor whose data pointer is null though it has elements.

    ``what`` names it in the message ("argument 'x'").

    A wrapper subclass (a DTensor) reports address 0 and exports, through ``__dlpack__``,
    a capsule over address 0 with its global shape, which JAX accepts and then reads.
    """
    if not tensor.data_ptr() and tensor.numel():
        raise _no_memory(tensor, what)


def _elsewhere(tensor: torch.Tensor, device: torch.device) -> ValueError:
    return ValueError(
        f"flaxtorch: a tensor on {tensor.device} reached a call that runs on {device}. If "
        f"a saved-tensor hook moves tensors (e.g. to offload them), its unpack hook must "
        f"move them back to the device they came from."
    )


def _modes_active() -> bool:
    """Whether a torch dispatch or function mode is on: it would see the tensors being made.

    Such modes (``DebugMode``'s tensor hashes, NaN checkers) may read every op's output,
    so results are made into tensors, and viewed, only once JAX has written them.
    ``torch.set_default_device`` is such a mode too (one that reads nothing).
    """
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()


class CpuExchange:
    """Pointer views on CPU (see NOTE [Exchange])."""

    dlpack = False

    def __init__(self, device, torch_device: torch.device):
        self.device = device  # the JAX device
        self.torch_device = torch_device

    def view(self, tensor: torch.Tensor):
        """What a program takes for ``tensor`` in this call."""
        if not tensor.is_cpu:  # a pointer view of another device's memory is never right
            raise _elsewhere(tensor, self.torch_device)
        return cpu_view(tensor)

    def narrowed(self, tensor: torch.Tensor, name: str, check: bool = True):
        """What a program takes for an int64 ``tensor`` as int32: its values, checked.

        In numpy, over the tensor's memory: torch's ops cost more per call, in dispatch,
        than the pass over a batch of token ids (``_dtypes.narrow_array``).
        """
        return _dtypes.narrow_array(self.view(tensor), name=name, check=check)

    def hold(self, tensor: torch.Tensor):
        """A JAX array over ``tensor``'s memory to reuse across calls, or ``None``.

        It does not keep the memory alive: it is used only in a call that has just checked
        the tensor is still at that address, so it reads the tensor's current memory, and
        memory the user replaced is released at once (FSDP2 frees and re-gathers parameter
        storage between calls). JAX never writes to or frees it.
        """
        if not tensor.is_cpu:
            raise _elsewhere(tensor, self.torch_device)
        if not _holdable(tensor):
            return None
        array = jax.device_put(cpu_view(tensor, owner=None), self.device)
        if array.unsafe_buffer_pointer() != tensor.data_ptr():  # JAX copied: never hold
            return None
        return array

    def run(self, name: str, program, *args,
            wait: bool = True) -> tuple[list, list[torch.Tensor]]:
        """Runs ``program(*args)``: its result arrays, and torch tensors over them.

        Waits for JAX to compute the results before torch may read them. ``wait=False``
        returns while JAX computes: the caller does work that reads none of the results
        meanwhile, then calls ``wait(arrays)`` before anything (torch, user code, a
        saved-tensor hook) may read them. ``name`` names the program (for
        ``record_ordering`` on the DLPack route).
        """
        arrays = program(*args)
        if _modes_active():  # a mode sees every op, a view included, and may read it
            self.wait(arrays)
            return arrays, [cpu_tensor(a) for a in arrays]
        tensors = [cpu_tensor(a) for a in arrays]  # made while JAX computes (cpu_tensor)
        if wait:
            self.wait(arrays)
        return arrays, tensors

    @staticmethod
    def wait(arrays) -> None:
        """Waits until JAX has computed ``arrays`` (results of ``run``)."""
        for a in arrays:  # the method: jax.block_until_ready walks a pytree first
            a.block_until_ready()


class DlpackExchange:
    """``__dlpack__`` both ways, one fence per program run (see NOTE [Exchange])."""

    dlpack = True

    def __init__(self, device, torch_device: torch.device):
        self.device = device
        self.torch_device = torch_device
        self._fence = torch.zeros(1, dtype=torch.uint8, device=torch_device)

    def view(self, tensor: torch.Tensor):
        """A JAX array over ``tensor``'s memory, ordered after torch's pending writes to it."""
        if tensor.device != self.torch_device:
            raise _elsewhere(tensor, self.torch_device)
        tensor = logical(tensor.detach())
        if 0 in tensor.shape:
            return np.empty(tuple(tensor.shape), _dtypes.numpy_dtype(tensor.dtype))
        if not tensor.data_ptr():
            raise _no_memory(tensor)
        source = Observed(tensor, "import", self.torch_device) if recorders else tensor
        return imported(tensor, jax.dlpack.from_dlpack(source))

    def narrowed(self, tensor: torch.Tensor, name: str, check: bool = True):
        """What a program takes for an int64 ``tensor`` as int32: its values, checked.

        In torch, on the tensor's device: on CUDA the check waits for the device
        (``_dtypes.narrow_to_int32``).
        """
        return self.view(_dtypes.narrow_to_int32(tensor, name=name, check=check))

    def hold(self, tensor: torch.Tensor):
        """A JAX array over ``tensor``'s memory to reuse across calls, or ``None``.

        The import keeps the tensor alive until the array is dropped (the next call that
        finds the tensor replaced). Reads are ordered by the fence in ``run``, not by the
        import.
        """
        if tensor.device != self.torch_device:
            raise _elsewhere(tensor, self.torch_device)
        if not _holdable(tensor) or 0 in tensor.shape:
            return None
        check_memory(tensor, "a tensor")
        exported = tensor.detach()
        array = imported(exported, jax.dlpack.from_dlpack(exported))
        if array.unsafe_buffer_pointer() != tensor.data_ptr():  # JAX copied: never hold
            return None
        return array

    def run(self, name: str, program, *args,
            wait: bool = True) -> tuple[list, list[torch.Tensor]]:
        """Runs ``program(*args, fence)``: its result arrays, and torch tensors over them.

        ``program`` is compiled with one more argument, the fence, that it waits for;
        ``name`` names it in what ``record_ordering`` records. ``wait`` changes nothing:
        the results are handed to torch's stream, which orders every later read.
        """
        device = self.torch_device
        # torch's current stream -> event -> JAX's stream, after everything torch queued.
        exported = self._fence.detach()  # its own object, to see JAX let go (_imports)
        source = Observed(exported, "torch->jax", device) if recorders else exported
        fence = imported(exported, jax.dlpack.from_dlpack(source))
        if not recorders:
            arrays = program(*args, fence)
            # JAX's results -> torch's current stream (torch passes it to __dlpack__).
            return arrays, [torch.from_dlpack(a) for a in arrays]
        record("run", device, detail=name)
        arrays = program(*args, fence)
        observed = [Observed(a, "jax->torch", device) for a in arrays]
        tensors = [torch.from_dlpack(o) for o in observed]
        streams = {s for o in observed for s in o.streams}
        record("jax->torch", device, streams.pop() if len(streams) == 1 else tuple(streams),
               tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors))
        return arrays, tensors

    @staticmethod
    def wait(arrays) -> None:
        """Nothing to wait for: ``run`` ordered torch's stream after the results."""


@ft.cache
def _exchange(device: torch.device, mode: str):
    jax_device = _devices.jax_device(device)
    if device.type == "cpu" and mode == "auto":
        return CpuExchange(jax_device, device)
    return DlpackExchange(jax_device, device)


def exchange_for(device: torch.device):
    """The exchange for tensors on ``device`` under the current mode (one per device)."""
    return _exchange(device, _exchange_mode)
