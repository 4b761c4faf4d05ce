"""The call pipeline: one call of an owner (``FlaxModule``, ``jax_function``), eager or compiled.

NOTE [Call path]. An owner hands its ``Caller`` what it fixes at construction
(``Settings``); a call passes only what changes, resolved, and the owner's ``write_back``:

    caller(resolve(...), write_back) -> outputs

1. ``resolve`` (``_resolve.py``, NOTE [Resolve]): the variables the call reads, its
   tensors and static values, autocast's casts, its device and the owner's mode, as one
   ``Call``. Every route starts here.
2. ``Caller.prepare``: the variables' held arrays (``bridge.internal.HeldArrays``), the
   ``Signature``, its ``Entry`` from the LRU cache (built on a miss, ``_build.build``), and
   the RNG leaf, drawn from torch's generator only if the entry's programs read it
   (``Entry.leaves`` places it).
3. The edge, the one step where eager and compiled calls differ: eagerly
   ``BridgeFunction`` (``_function.py``; no autograd at all when nothing needs a
   gradient); under ``torch.compile`` the ``flaxtorch::forward`` op (``_compile.py``),
   whose implementation is steps 2 and 4 again.
4. ``Entry.forward`` (``_entry.py``): views of the arguments, the entry's executable
   through the exchange's ``run`` (NOTE [Exchange] in ``bridge/_exchange.py``);
   ``save_for_backward`` keeps what the backward reads (``SavedLayout``), so that torch's
   saved-tensor hooks and version counters see it.
5. ``write_back``: the owner copies updated state into its buffers (and, for NNX, takes
   the graph the call left); ``apply_write_back`` is shared by both routes.

Backward: ``Entry.backward`` views what was saved (held arrays reused) and runs the
backward program through the exchange (for a scalar loss, whose forward ran
``value_and_grad``, ``scaled`` scales the saved gradients instead: NOTE [Scalar loss] in
``_function.py``); ``Entry.gradients`` hands each leaf its gradient (a view of a packed
buffer), ``None`` where no used output depends on it.

A cached eager forward and backward of a ``FlaxModule`` runs our code in ``_module.py``,
``_resolve.py``, this file, ``_function.py``, ``_entry.py``, ``bridge/_held.py`` and
``bridge/_exchange.py``, and, on the "residuals" route, ``flaxside/_program.py`` (a
lambda that drops the residual map from ``forward_with_residuals``'s results); the rest of
``flaxside`` runs only when a signature's programs are built.
"""

from __future__ import annotations

import collections
import copy
import itertools
import threading
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import torch
import torch.autograd.forward_ad as _fwAD

from bridge.internal import HeldArrays, exchange_for
from torchside import _build, _checks, _errors
from torchside._compile import CALLERS, compiled_call
from torchside._entry import Entry, apply_write_back
from torchside._function import apply_bridge
from torchside._options import check_choice, check_positive_int
from torchside._recompile import RecompileMonitor
from torchside._resolve import Call
from torchside._transforms import apply_transformed

jtu = jax.tree_util

RESIDUAL_MODES = ("save", "split", "recompute")

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


class TensorKey(NamedTuple):
    """One tensor as a signature sees it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool


class Signature(NamedTuple):
    """Everything an entry depends on; calls with equal signatures share one.

    Attributes:
        arg_treedef: the structure of the call's ``(args, kwargs)``.
        statics: per argument leaf, ``ARRAY`` or the key of a static value.
        tensors: per tensor argument, its ``TensorKey``.
        variables: per variable, its ``TensorKey``.
        mode: the owner's mode (train/eval, the NNX graph).
        x64: whether JAX runs with 64-bit types.
        exchange: how tensors cross (``bridge.internal.exchange_for``: device and route).
    """

    arg_treedef: Any
    statics: tuple
    tensors: tuple[TensorKey, ...]
    variables: tuple[TensorKey, ...]
    mode: Hashable
    x64: bool
    exchange: Any


class Prepared(NamedTuple):
    """Step 2 of NOTE [Call path] for one call.

    Attributes:
        entry: the signature's ``Entry``.
        state_arrays: JAX arrays of the state leaves: the variables' (held), then the
            RNG leaf's.
        leaves: every leaf as a torch tensor, in the programs' order (``Entry.leaves``).
    """

    entry: Entry
    state_arrays: list
    leaves: list


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


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

    def __deepcopy__(self, memo):
        # A deep copy lives in this process, beside the original: a sharded owner's copy
        # (an EMA of the model) holds DTensors over the same mesh, so it keeps the plan.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        new.spmd = self.spmd
        return new

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.monitor = RecompileMonitor(self.recompile_warning, self.where)
        self._cache: collections.OrderedDict[Signature, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._by_key: dict[int, Signature] = {}  # torch.compile's graphs name entries by key
        self.held = HeldArrays()
        self._var_keys: dict = {}
        # torchside._shard.ShardPlan once the owner is sharded; kept by a deep copy, not
        # pickled (another process has other meshes): an unpickled copy refuses its
        # DTensors by name (``_checks.explain_state_error``).
        self.spmd = None
        self.compile_id = next(_caller_ids)
        CALLERS[self.compile_id] = self

    def shard(self, plan) -> None:
        """Calls from now on run SPMD programs over ``plan`` (``torchside._shard``)."""
        self.clear()
        self.spmd = plan

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
            built = _build.build(self.settings, sig, values, self.monitor, self.spmd)
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

    def signature(self, call: Call, grads, var_grads, exchange,
                  cached: bool = True) -> Signature:
        """The signature of a call.

        ``grads`` / ``var_grads``: per tensor argument / variable whether it needs a
        gradient; ``var_grads=None`` takes each variable's ``requires_grad`` under the grad
        mode. The variables' part is cached per grad mode (or flags) until one of them
        changes (``cached=False``: neither read nor written, for stand-in tensors).
        """
        flags = torch.is_grad_enabled() if var_grads is None else var_grads
        key = self._var_keys.get(flags) if cached else None
        if key is None:
            if var_grads is None:
                var_grads = [flags and t.requires_grad for t in call.variables]
            key = tuple(TensorKey(t.shape, t.dtype, t.device, g)
                        for t, g in zip(call.variables, var_grads, strict=True))
            if cached:
                self._var_keys[flags] = key
        return Signature(call.arg_treedef, call.statics,
                         tuple(TensorKey(t.shape, t.dtype, t.device, g)
                               for t, g in zip(call.tensors, grads, strict=True)),
                         key, call.mode, jax.config.jax_enable_x64, exchange)

    def prepare(self, call: Call, grads, var_grads=None, remember: bool = False,
                draw_rng: bool = True, hold: bool = True) -> Prepared:
        """Step 2 of NOTE [Call path] for ``call``.

        Args:
            call: the resolved call.
            grads: per tensor argument, whether it needs a gradient.
            var_grads: per variable, whether it may need one (``None``: grad mode).
            remember: see ``lookup``.
            draw_rng: ``False`` never draws a key (the RNG leaf is zeros): for a call that
                does not run (``memory_report``).
            hold: ``False`` touches no memory (``state_arrays`` is ``None``): under a
                torch.func transform the tensors may be wrappers without any.
        """
        try:
            exchange = exchange_for(call.device)
            state_arrays, changed = (self.held.arrays(call.variables, exchange, var_grads)
                                     if hold else (None, False))
        except Exception:
            _checks.explain_state_error(self.settings.var_names, call, self.where)
            raise
        if changed:
            self._var_keys = {}
        sig = self.signature(call, grads, var_grads, exchange, cached=hold)
        entry = self.lookup(sig, call.values, remember)
        if entry.has_rng:
            try:
                rng = entry.rng(self.settings.rng_shape, draw_rng)
            except RuntimeError as e:  # torch.func.vmap(randomness="error")
                if "randomness" not in str(e):
                    raise
                raise _errors.random_under_vmap(self.where) from e
            if hold:
                state_arrays.append(exchange.view(rng))
        else:
            rng = None
        return Prepared(entry, state_arrays, entry.leaves(call.variables, rng, call.tensors))

    def __call__(self, call: Call, write_back: Callable | None = None):
        """Runs one call (NOTE [Call path]); returns the outputs' pytree.

        Under ``torch.compile`` the call is the custom ops of ``_compile.py``.
        """
        if call.arg_treedef is None:  # resolved under torch.compile
            return compiled_call(self, call, write_back)
        grad = torch.is_grad_enabled()
        grads = tuple(grad and t.requires_grad for t in call.tensors)
        if torch._C._are_functorch_transforms_active() or _fwAD._current_level >= 0:
            # NOTE [torch.func]; forward-mode AD (forward_ad's dual tensors) too.
            # A transform's tangents and cotangents may reach any floating leaf, whatever
            # its requires_grad says (forward mode sets none): every one is differentiable.
            entry, _, leaves = self.prepare(
                call, tuple(map(_floating, call.tensors)),
                tuple(map(_floating, call.variables)), hold=False)
            if (entry.write_back.targets and write_back is not None
                    and torch._C._are_functorch_transforms_active()):
                raise _errors.write_back_under_transform(
                    self.where, [entry.names[i] for i in entry.write_back.targets])
            results = apply_transformed(entry, leaves)
        else:
            entry, state_arrays, leaves = self.prepare(call, grads)
            if entry.grad_slots:  # the edge: autograd only where a gradient is wanted
                results = apply_bridge(entry, self.held, state_arrays, *leaves)
            else:
                results = entry.forward(state_arrays, leaves).results
        apply_write_back(write_back, entry.write_back, results, entry.n_out)
        return jtu.tree_unflatten(entry.out_treedef, results[: entry.n_out])
