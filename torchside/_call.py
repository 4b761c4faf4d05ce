"""The call pipeline: one call of an owner (``FlaxModule``, ``jax_function``), eager or compiled.

NOTE [Call path]. An owner hands its ``Caller`` what it fixes at construction
(``Settings``); a call passes only what changes, and the owner's ``write_back``:

    caller(variables, args, kwargs, mode, write_back) -> outputs

1. ``split_args``: the tensor leaves, the structure, a key per static value.
2. ``Caller.prepare``: the variables' held arrays (``bridge.internal.HeldArrays``), the
   ``Signature``, its ``Entry`` from the LRU cache (built on a miss, ``_build.build``), and
   the RNG leaf, drawn from torch's generator only if the entry's programs read it.
3. The edge, the one step where eager and compiled calls differ: eagerly
   ``BridgeFunction`` (no autograd at all when nothing needs a gradient); under
   ``torch.compile`` the ``flaxtorch::forward`` op (``_compile.py``), whose implementation
   is steps 2 and 4 again.
4. ``Entry.forward`` (``_entry.py``): views of the arguments, the entry's executable
   through the exchange's ``run`` (NOTE [Exchange] in ``bridge/_exchange.py``);
   ``save_for_backward`` keeps what the backward reads, so that torch's saved-tensor hooks
   and version counters see it.
5. ``write_back(entry.write_back, updates)``: the owner copies updated state into its
   buffers (and, for NNX, takes the graph the call left).

Backward: ``Entry.backward`` views what was saved (held arrays reused) and runs the
backward program through the exchange (for a scalar loss, whose forward ran
``value_and_grad``, ``Entry.scaled`` scales the saved gradients instead: NOTE [Scalar
loss]); ``Entry.gradients`` hands each leaf its gradient (a view of a packed buffer),
``None`` where no used output depends on it.

A cached forward and backward of a ``FlaxModule`` runs code of four files: ``_module.py``,
this one, ``_entry.py`` and ``bridge/_exchange.py``; ``flaxside`` compiles the programs at
their first use and is not called again.
"""

from __future__ import annotations

import collections
import itertools
import struct
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import torch

from bridge.internal import HeldArrays, exchange_for
from flaxside.internal import ARRAY
from torchside import _build
from torchside._entry import Entry, apply_bridge, under_torch_func
from torchside._options import check_choice, check_positive_int
from torchside._recompile import RecompileMonitor

jtu = jax.tree_util

RESIDUAL_MODES = ("save", "split", "recompute")
_CPU = torch.device("cpu")

# Callers by compile id, for torch.compile's ops, which carry only ints and strings. Weak:
# nothing here outlives its owner.
CALLERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_caller_ids = itertools.count(1)


class Settings(NamedTuple):
    """What an owner fixes once, at construction.

    Attributes:
        where: the owner's name for messages (``FlaxModule(Block)``).
        state_treedef: treedef of ``(variables, raw rng keys or None)``; its leaves are the
            variable tensors, then the rng leaf.
        var_names: a name per variable leaf (``params.Dense_0.kernel``).
        make_apply: ``make_apply(mode) -> apply``; ``apply(state, *args, **kwargs)``
            returns ``(outputs, updates, flaxside.internal.WriteBack)``.
        rng_shape: shape of the int32 raw key data drawn per call from torch's generator,
            or ``None`` without RNG streams.
    """

    where: str
    state_treedef: Any
    var_names: tuple[str, ...]
    make_apply: Callable
    rng_shape: tuple[int, ...] | None = None


class Signature(NamedTuple):
    """Everything an entry depends on; calls with equal signatures share one."""

    args: Any  # treedef of (args, kwargs)
    statics: tuple  # per leaf: ARRAY, or a key of the static value (static_key)
    arrays: tuple  # per tensor argument: (shape, dtype, device, needs grad)
    variables: tuple  # per variable leaf: (shape, dtype, device, needs grad)
    mode: Hashable  # the owner's mode (train/eval, the NNX graph)
    x64: bool
    exchange: Any  # bridge's exchange: device and route


def static_key(value) -> tuple:
    """A key that tells apart static values that compute differently.

    ``0.0 == -0.0`` and ``1 == 1.0 == True`` but they compute differently, and ``nan !=
    nan`` would never find its own program: floats are keyed by their bits, all by type.
    """
    if isinstance(value, float):
        return (float, struct.pack("<d", value))
    if isinstance(value, complex):
        return (complex, struct.pack("<dd", value.real, value.imag))
    tobytes = getattr(value, "tobytes", None)  # numpy scalars
    if tobytes is not None and getattr(value, "ndim", None) == 0:
        return (type(value), tobytes())
    return (type(value), value)


def split_args(args: tuple, kwargs: dict, where: str):
    """``(tensors, treedef, statics, values)`` of a call's arguments (step 1).

    ``statics`` per leaf ``ARRAY`` or the key of a static value, ``values`` every leaf.

    Raises:
        TypeError: a non-tensor leaf is unhashable, so it cannot be part of a compile key.
    """
    leaves, treedef = jtu.tree_flatten((args, kwargs))
    tensors, statics = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            statics.append(ARRAY)
        else:
            statics.append(static_key(leaf))
    statics = tuple(statics)
    try:
        hash(statics)
    except TypeError:
        raise _build.unhashable_static(leaves, treedef, where) from None
    return tensors, treedef, statics, leaves


class Caller:
    """An owner's entries (an LRU cache of compiled signatures), held arrays and calls.

    Args:
        settings: what the owner fixes at construction.
        residuals: the boundary mode, one of ``RESIDUAL_MODES`` (``FlaxModule``).
        cache_size: how many signatures keep their entries (LRU).
        recompile_warning: warn once (``RecompileWarning``) after this many distinct
            signatures, naming what changes; ``None`` never warns.

    A caller pickles (and deep-copies) as its configuration only: entries, held arrays and
    locks are rebuilt on first use.
    """

    _CONFIG = ("settings", "where", "residuals", "cache_size", "recompile_warning")

    def __init__(self, settings: Settings, *, residuals: str = "save", cache_size: int = 32,
                 recompile_warning: int | None = 8):
        where = settings.where
        self.settings = settings
        self.where = where
        self.residuals = check_choice(
            residuals, RESIDUAL_MODES, option="residuals", where=where,
            meaning="Use 'save' to hold what the remat policy keeps (the gradients, for a "
                    "scalar loss), 'split' to hold that even for a scalar loss, or "
                    "'recompute' to hold only the inputs.")
        self.cache_size = check_positive_int(
            cache_size, option="cache_size", where=where,
            meaning="how many call signatures keep their compiled programs")
        self.recompile_warning = recompile_warning
        self.__setstate__({})

    def __getstate__(self):
        return {k: self.__dict__[k] for k in self._CONFIG}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.monitor = RecompileMonitor(self.recompile_warning, self.where)
        self._cache: collections.OrderedDict[Signature, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._by_key: dict[int, Signature] = {}  # torch.compile's graphs name entries by key
        self.held = HeldArrays()
        self._var_keys: dict = {}
        self.compile_id = next(_caller_ids)
        CALLERS[self.compile_id] = self

    def clear(self) -> None:
        """Drops every entry and held array; the next call compiles again."""
        with self._lock:
            self._cache.clear()
            self.held.clear()
            self._var_keys = {}

    @property
    def entries(self) -> list[Entry]:
        """The cached entries, oldest first."""
        return list(self._cache.values())

    def lookup(self, sig: Signature, values, remember: bool = False) -> Entry:
        """The entry for ``sig``, built on a miss (``values``: the leaves of the arguments).

        ``remember`` keeps the signature by the entry's key, for compiled graphs that
        name the entry by key (``entry(key)``).
        """
        entry = self._cache.get(sig)
        if entry is not None:
            try:
                self._cache.move_to_end(sig)  # LRU
            except KeyError:  # evicted by another thread just now
                pass
        else:
            built = _build.build(self.settings, sig, values, self.monitor)
            entry = Entry(built, sig.exchange, self.residuals, next(self._keys))
            with self._lock:
                self._cache[sig] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if remember:
            self._by_key[entry.key] = sig
        return entry

    def entry(self, key: int) -> Entry:
        """The entry numbered ``key`` (a compiled graph's), rebuilt if it was evicted."""
        sig = self._by_key[key]
        entry = self._cache.get(sig)
        return entry if entry is not None and entry.key == key else self.lookup(
            sig, [None] * len(sig.statics))

    def signature(self, variables, tensors, treedef, statics, mode, grads, var_grads,
                  exchange, cached: bool = True) -> Signature:
        """The signature of a call.

        ``grads`` / ``var_grads``: per argument / variable whether it needs a gradient;
        ``var_grads=None`` takes each variable's ``requires_grad`` under the grad mode. The
        variables' part is cached per grad mode (or flags) until one of them changes.
        """
        flags = torch.is_grad_enabled() if var_grads is None else var_grads
        key = self._var_keys.get(flags) if cached else None
        if key is None:
            if var_grads is None:
                key = tuple((t.shape, t.dtype, t.device, flags and t.requires_grad)
                            for t in variables)
            else:
                key = tuple((t.shape, t.dtype, t.device, g)
                            for t, g in zip(variables, var_grads, strict=True))
            if cached:
                self._var_keys[flags] = key
        return Signature(treedef, statics,
                         tuple((t.shape, t.dtype, t.device, g)
                               for t, g in zip(tensors, grads, strict=True)),
                         key, mode, jax.config.jax_enable_x64, exchange)

    def prepare(self, variables, tensors, treedef, statics, values, mode, grads,
                var_grads=None, remember: bool = False):
        """Step 2 of NOTE [Call path]: ``(entry, state arrays, leaves)`` of one call.

        Args:
            variables: the owner's variable tensors.
            tensors: the tensor arguments.
            treedef: the structure of ``(args, kwargs)`` (``split_args``).
            statics: per leaf ``ARRAY`` or a static value's key (``split_args``).
            values: every leaf of ``(args, kwargs)`` (``split_args``).
            mode: the owner's mode.
            grads: per tensor argument, whether it needs a gradient.
            var_grads: per variable, whether it may need one (``None``: grad mode).
            remember: see ``lookup``.

        Returns:
            The entry, the arrays of the state leaves (variables, then the RNG leaf), and
            every leaf (variables, the RNG leaf, the arguments).
        """
        lead = variables[0] if variables else (tensors[0] if tensors else None)
        device = lead.device if lead is not None else _CPU
        try:
            exchange = exchange_for(device)
            arrays, changed = self.held.arrays(variables, exchange, var_grads)
        except Exception:
            _build.explain_state_error(self.settings, variables, tensors, treedef, statics,
                                       device)
            raise
        if changed:
            self._var_keys = {}
        sig = self.signature(variables, tensors, treedef, statics, mode, grads, var_grads,
                             exchange)
        entry = self.lookup(sig, values, remember)
        leaves = list(variables)
        if entry.n_state > entry.n_vars:
            rng = entry.rng(self.settings.rng_shape)
            leaves.append(rng)
            arrays.append(exchange.view(rng))
        leaves += tensors
        return entry, arrays, leaves

    def __call__(self, variables: list, args: tuple, kwargs: dict, mode: Hashable = None,
                 write_back: Callable | None = None):
        """Runs one eager call (NOTE [Call path]); returns the outputs' pytree."""
        if torch._C._are_functorch_transforms_active():
            raise under_torch_func(self.where)
        tensors, treedef, statics, values = split_args(args, kwargs, self.where)
        grad = torch.is_grad_enabled()
        entry, arrays, leaves = self.prepare(variables, tensors, treedef, statics, values,
                                             mode, tuple(grad and t.requires_grad
                                                         for t in tensors))
        if entry.grad_slots:  # the edge: autograd only where a gradient is wanted
            results = apply_bridge(entry, self.held, arrays, *leaves)
        else:
            results = entry.forward(arrays, leaves)[0]
        if write_back is not None and entry.writes:
            write_back(entry.write_back, results[entry.n_out : entry.n_results])
        return jtu.tree_unflatten(entry.out_treedef, results[: entry.n_out])
