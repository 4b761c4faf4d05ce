"""Per-call exchange between torch tensors and JAX arrays: views in, results out, ordering.

NOTE [Exchange]. Every route is zero-copy where JAX can use the memory in place.

* CPU (default): a numpy array over the tensor's memory, built from its data pointer
  through the array interface. ``tensor.numpy()`` is never used: it marks the storage
  non-resizable for good, and FSDP2's ``storage.resize_(0)`` then fails. Results come back
  as torch tensors over the JAX buffers.
* DLPack (CUDA, or any device with ``FLAXTORCH_EXCHANGE=dlpack``): ``__dlpack__`` both
  ways. The forced mode sends CPU tensors through this code so that CI runs it.

Held arrays (``HeldArrays``, ``_held.py``): parameters and buffers keep their memory from
call to call (optimizers and ``load_state_dict`` write in place), so each gets one array,
reused while the tensor's address, device, dtype, shape, strides and flags are unchanged
and replaced at the first call that sees otherwise: old bits are never read as a new dtype
or shape, nor one device's memory as another's.

Ordering. Every program runs through its exchange's ``run``, the one place that orders
JAX's work after torch's and torch's after JAX's:

* CPU: a jitted call returns before it has run, and so does ``run``: its caller waits
  (``wait``) before torch may read a result, after bookkeeping that reads none
  (``BridgeFunction`` saves for backward and views packed gradients meanwhile). Results
  depend on the inputs they read, so no input is overwritten while JAX still reads it.
* DLPack: a held array was imported long before torch's latest write to it (an optimizer
  step), so each ``run`` imports one tiny fence tensor (torch's current stream -> an event
  -> JAX's stream) that the program waits for (``keep_unused``): after every write torch
  has queued, before JAX reads anything, the arguments imported for the run included (so
  their imports make no stream handshake of their own: NOTE [Lean crossing] in
  ``_dlpack.py``). Results are exported to torch's current stream, so torch's next work,
  a write to an output included, waits for JAX's. Every crossing (``Crossing``) records
  its step where it happens while a ``record_ordering`` log is open: tests check on a CPU
  the very path every call takes. Exit waits for JAX to let go of every import (NOTE
  [Imports at exit] in ``_dlpack.py``).
"""

from __future__ import annotations

import functools as ft
import types
from typing import NamedTuple

import jax
import numpy as np
import torch

from bridge import _devices, _dlpack, _dtypes, _rules
from bridge._dlpack import Crossing, imported, record
from bridge._held import in_place
from bridge._ordering import recorders
from bridge._rules import ALIGNMENT, check_memory, elsewhere, no_memory


def _memory(owner, pointer: int, shape: tuple, typestr: str) -> types.SimpleNamespace:
    """Memory at an address, as numpy sees it through the array interface.

    ``owner`` keeps the memory alive for as long as numpy (or JAX, which keeps the numpy
    array) uses it; held arrays pass ``None`` (see ``HeldArrays``). A ``SimpleNamespace``:
    made in C, it costs no Python call, and the per-call paths below build it inline.
    """
    return types.SimpleNamespace(owner=owner, __array_interface__={
        "data": (pointer, False), "shape": shape, "typestr": typestr, "version": 3})


def is_zero_copy(tensor: torch.Tensor) -> bool:
    """Whether JAX can use ``tensor``'s memory in place (compact and 64-byte aligned).

    Example:
        >>> is_zero_copy(torch.zeros(16)) and not is_zero_copy(torch.zeros(4, 4).T)
        True
    """
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


def cpu_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over a CPU tensor's memory (compacted and resolved first if needed).

    The caller has checked the dtype (``_dtypes.numpy_dtype``) and the device. The view
    keeps the tensor (or its compact copy) alive.
    """
    if not in_place(tensor):
        tensor = logical(tensor.detach())  # a copy; detached so autograd records nothing
    return _view(tensor, tensor)


def _view(tensor: torch.Tensor, owner) -> np.ndarray:
    """A numpy array over ``tensor``'s memory (held in place), kept alive by ``owner``.

    ``owner`` is ``None`` for a held array, which must not keep the memory alive.
    """
    typestr, np_dtype = _dtypes.view_typestr(tensor.dtype)
    shape = tuple(tensor.shape)
    if 0 in shape:
        return np.empty(shape, np_dtype)
    pointer = tensor.data_ptr()
    if not pointer:
        raise no_memory(tensor)
    view = np.asarray(types.SimpleNamespace(owner=owner, __array_interface__={  # _memory
        "data": (pointer, False), "shape": shape, "typestr": typestr, "version": 3}))
    return view if view.dtype == np_dtype else view.view(np_dtype)


def cpu_tensor(array: jax.Array) -> torch.Tensor:
    """A torch view of a JAX CPU array (no copy) that keeps the array alive.

    The buffer exists from dispatch on; torch may read it once the array is ready.
    """
    return _tensor_over(array, result_template(array.shape, array.dtype))


class ResultTemplate(NamedTuple):
    """What ``cpu_tensor`` needs of a result, fixed by its program (made once per entry).

    ``empty``: the torch dtype of a result with no elements (nothing to view), else
    ``None``; ``view_as``: the torch dtype to re-view the exposed bytes as, or ``None``.
    """

    shape: tuple
    typestr: str
    view_as: torch.dtype | None
    empty: torch.dtype | None


def result_template(shape, dtype) -> ResultTemplate:
    """The ``ResultTemplate`` of a result of ``shape`` and (numpy or JAX) ``dtype``."""
    typestr, view_as = _dtypes.typestr(dtype)
    shape = tuple(shape)
    return ResultTemplate(shape, typestr, view_as,
                          (view_as or _dtypes.torch_dtype(dtype)) if 0 in shape else None)


def _tensor_over(array: jax.Array, template: ResultTemplate) -> torch.Tensor:
    shape, typestr, view_as, empty = template
    if empty is not None:  # not torch's default device, which may be a GPU
        return torch.empty(shape, dtype=empty, device="cpu")
    out = torch.from_numpy(np.asarray(types.SimpleNamespace(  # _memory
        owner=array, __array_interface__={"data": (array.unsafe_buffer_pointer(), False),
                                          "shape": shape, "typestr": typestr,
                                          "version": 3})))
    return out if view_as is None else out.view(view_as)


def _holdable(tensor: torch.Tensor) -> bool:
    return tensor.is_leaf and is_zero_copy(tensor)


# NOTE [Packing per route]. A program's residuals and gradients leave it packed, one buffer
# per dtype (``flaxside``'s ``pack_plan``), where the copy into the buffer (and for
# gradients torch's views out of it) costs less than crossing each alone, so the limit
# belongs to the route:
#
# * DLPack (a GPU's): a copy runs at terabytes a second (4 MiB read and written in about
#   3 us on an H100) where a crossing cost 26-29 us on the H200 (docs/benchmarks.md): every
#   array up to ``DLPACK_PACK_BYTES`` is packed, so a call crosses a fixed number of times
#   however many such parameters the block has. A larger array crosses alone: its own
#   compute dwarfs one crossing, and packing it would add its size to the program's peak.
#   Forced on a CPU, the route keeps the GPU's limit, so that CI runs it.
# * CPU: a copy runs at about 10 GB/s and a pointer view costs a few microseconds, so the
#   limit is 64 KiB (``examples/bench/call_costs.py`` measures both).
#
# Packing costs memory: a program writes each array, then copies it into the buffer, so
# its peak grows by up to the packed bytes (``examples/bench/packing.py`` reads XLA's
# ``memory_analysis`` for both routes; docs/benchmarks.md quotes it).
DLPACK_PACK_BYTES = 4 * 1024 * 1024
CPU_PACK_BYTES = 64 * 1024


class CpuExchange:
    """Pointer views on CPU (see NOTE [Exchange])."""

    dlpack = False
    pack_bytes = CPU_PACK_BYTES  # NOTE [Packing per route]

    def __init__(self, device, torch_device: torch.device):
        self.device = device  # the JAX device
        self.torch_device = torch_device

    def view(self, tensor: torch.Tensor):
        """What a program takes for ``tensor`` in this call."""
        if not tensor.is_cpu:  # a pointer view of another device's memory is never right
            raise elsewhere(tensor, self.torch_device)
        # cpu_view's body, in_place's written out: per-call calls less per tensor.
        if not tensor.is_contiguous() or tensor.is_neg() or (tensor.dtype.is_complex
                                                              and tensor.is_conj()):
            tensor = logical(tensor.detach())  # a copy; detached so autograd records nothing
        # _view's body, written out for the same reason.
        typestr, np_dtype = _dtypes.view_typestr(tensor.dtype)
        shape = tuple(tensor.shape)
        pointer = tensor.data_ptr()
        if not pointer or 0 in shape:
            return _view(tensor, tensor)  # no elements, or no memory: _view says which
        view = np.asarray(types.SimpleNamespace(owner=tensor, __array_interface__={
            "data": (pointer, False), "shape": shape, "typestr": typestr, "version": 3}))
        return view if view.dtype == np_dtype else view.view(np_dtype)

    def narrowed(self, tensor: torch.Tensor, name: str):
        """What a program takes for an int64 ``tensor`` as int32: its values, checked.

        In numpy, over the tensor's memory: torch's ops cost more per call, in dispatch,
        than the pass over a batch of token ids (``_dtypes.narrow_array``).
        """
        return _dtypes.narrow_array(self.view(tensor), name=name)

    def narrowed_again(self, tensor: torch.Tensor):
        """``narrowed`` for values checked before (the same tensor, saved for the backward)."""
        return self.view(tensor).astype(np.int32)

    def hold(self, tensor: torch.Tensor):
        """A JAX array over ``tensor``'s memory to reuse across calls, or ``None``.

        It does not keep the memory alive: it is used only in a call that has just checked
        the tensor is still at that address, so it reads the tensor's current memory, and
        memory the user replaced is released at once (FSDP2 frees and re-gathers parameter
        storage between calls). JAX never writes to or frees it.
        """
        if not tensor.is_cpu:
            raise elsewhere(tensor, self.torch_device)
        if not _holdable(tensor):
            return None
        array = jax.device_put(_view(tensor, None), self.device)
        if array.unsafe_buffer_pointer() != tensor.data_ptr():  # JAX copied: never hold
            return None
        return array

    @staticmethod
    def templates(specs) -> tuple[tuple[ResultTemplate, ...], bool]:
        """Per result of a program (``specs``: each a shape and a dtype), its template.

        Returns:
            ``(templates, plain)``: ``plain`` says every result has elements and a
            numpy-native dtype (``run`` then makes its tensors without a call per result).
        """
        templates = tuple(result_template(s.shape, s.dtype) for s in specs)
        return templates, all(t.empty is None and t.view_as is None for t in templates)

    def run(self, name: str, program, templates, *args) -> tuple[list, list[torch.Tensor]]:
        """Runs ``program(*args)``: its result arrays, and torch tensors over them.

        Returns while JAX computes: the caller does work that reads none of the results
        meanwhile, then calls ``wait(arrays)`` before anything (torch, user code, a
        saved-tensor hook) may read them. ``name`` names the program (for
        ``record_ordering`` on the DLPack route); ``templates``: ``templates`` of its
        results.
        """
        arrays = program(*args)
        # A torch mode sees every op, a view included, and may read it (NaN checkers,
        # DebugMode's hashes; torch.set_default_device is one that reads nothing).
        if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
            self.wait(arrays)
        templates, plain = templates
        if not plain:
            return arrays, list(map(_tensor_over, arrays, templates))
        # _tensor_over's body for plain results, written out: no Python call per result.
        # The tensors are made while JAX computes.
        return arrays, [torch.from_numpy(np.asarray(types.SimpleNamespace(
            owner=a, __array_interface__={"data": (a.unsafe_buffer_pointer(), False),
                                          "shape": t.shape, "typestr": t.typestr,
                                          "version": 3})))
            for a, t in zip(arrays, templates, strict=True)]

    @staticmethod
    def wait(arrays) -> None:
        """Waits until JAX has computed ``arrays`` (results of ``run``)."""
        for a in arrays:  # the method: jax.block_until_ready walks a pytree first
            a.block_until_ready()


class DlpackExchange:
    """``__dlpack__`` both ways, one fence per program run (see NOTE [Exchange])."""

    dlpack = True
    pack_bytes = DLPACK_PACK_BYTES  # NOTE [Packing per route]

    def __init__(self, device, torch_device: torch.device, lean: bool = False):
        self.device = device
        self.torch_device = torch_device
        self.crossing = Crossing(device, torch_device, lean)
        # Made at the first run, not here: the first exchange_for of a device may come from
        # a torch.compile op's fake implementation, where torch makes fake tensors only.
        self._fence = None

    def view(self, tensor: torch.Tensor):
        """A JAX array over ``tensor``'s memory, ordered after torch's pending writes to it."""
        if tensor.device != self.torch_device:
            raise elsewhere(tensor, self.torch_device)
        tensor = logical(tensor.detach())
        if 0 in tensor.shape:
            return np.empty(tuple(tensor.shape), _dtypes.numpy_dtype(tensor.dtype))
        if not tensor.data_ptr():
            raise no_memory(tensor)
        return imported(tensor, self.crossing.argument(tensor))

    def narrowed(self, tensor: torch.Tensor, name: str):
        """What a program takes for an int64 ``tensor`` as int32: its values, checked.

        In torch, on the tensor's device: on CUDA the check waits for the device
        (``_dtypes.narrow_to_int32``).
        """
        return self.view(_dtypes.narrow_to_int32(tensor, name=name))

    def narrowed_again(self, tensor: torch.Tensor):
        """``narrowed`` for values checked before (the same tensor, saved for the backward)."""
        return self.view(tensor.to(torch.int32))

    def hold(self, tensor: torch.Tensor):
        """A JAX array over ``tensor``'s memory to reuse across calls, or ``None``.

        The import keeps the tensor alive until the array is dropped (the next call that
        finds the tensor replaced). Reads are ordered by the fence in ``run``, not by the
        import.
        """
        if tensor.device != self.torch_device:
            raise elsewhere(tensor, self.torch_device)
        if not _holdable(tensor) or 0 in tensor.shape:
            return None
        check_memory(tensor, "a tensor")
        exported = tensor.detach()
        array = imported(exported, jax.dlpack.from_dlpack(exported))
        if array.unsafe_buffer_pointer() != tensor.data_ptr():  # JAX copied: never hold
            return None
        return array

    @staticmethod
    def templates(specs) -> None:
        """Nothing: DLPack tells torch each result's shape and dtype."""

    def run(self, name: str, program, templates, *args) -> tuple[list, list[torch.Tensor]]:
        """Runs ``program(*args, fence)``: its result arrays, and torch tensors over them.

        ``program`` is compiled with one more argument, the fence, that it waits for;
        ``name`` names it in what ``record_ordering`` records. The results are handed to
        torch's stream, which orders every later read: ``wait`` has nothing to do.
        """
        device = self.torch_device
        # torch's current stream -> event -> JAX's stream, after everything torch queued.
        if self._fence is None:
            self._fence = torch.zeros(1, dtype=torch.uint8, device=device)
        exported = self._fence.detach()  # its own object, to see JAX let go (imported)
        fence = imported(exported, self.crossing.fence(exported))
        if recorders:
            record("run", device, detail=name)
        arrays = program(*args, fence)
        # JAX's results -> torch's current stream.
        return arrays, self.crossing.results(arrays)

    @staticmethod
    def wait(arrays) -> None:
        """Nothing to wait for: ``run`` ordered torch's stream after the results."""


@ft.cache
def _exchange(device: torch.device, mode: str):
    jax_device = _devices.jax_device(device)
    if device.type == "cpu" and mode == "auto":
        return CpuExchange(jax_device, device)
    return DlpackExchange(jax_device, device, _dlpack.LEAN)


def exchange_for(device: torch.device):
    """The exchange for tensors on ``device`` under the current mode (one per device)."""
    return _exchange(device, _rules.current)
