"""The call path's entry: what a call is keyed by, and the compile cache.

NOTE [Call path]. An owner (``FlaxModule``, ``jax_function``) hands a ``Caller`` what is
fixed at construction (an ``Owner``). A call passes only what changes:

    Caller(variables, args, kwargs, mode) -> (outputs, updates, compiled call)

1. ``split_args``: tensor leaves, the structure and a key of every static value.
2. ``HeldArrays.arrays``: one JAX array per variable, reused while it is unchanged; a
   changed dtype, shape or grad flag gives a new ``Signature``.
3. ``Signature`` -> ``CompiledCall`` (LRU cache; built by ``_build.build_call``).
4. ``BridgeFunction`` (or ``CompiledCall.run`` when no gradient is needed): arrays in,
   ``flaxside`` programs, tensors out; what the backward needs goes to
   ``ctx.save_for_backward`` (``_call.save_for_backward``, shared with ``torch.compile``).
5. The backward converts cotangents, runs the backward program and hands each gradient to
   its leaf (``scatter_grads``, shared too): ``None`` where no used output depends on it.

The owner writes ``updates`` into its buffers (train-mode state) after the call.
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

import bridge
from flaxside.internal import ARRAY
from torchside._call import CompiledCall, apply_bridge, under_torch_func
from torchside._recompile import RecompileMonitor

jtu = jax.tree_util

RESIDUAL_MODES = ("save", "recompute")
_CPU = torch.device("cpu")

# Callers by compile id, for torch.compile's custom ops, which can carry only ints. Weak:
# nothing here outlives its owner.
CALLERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_caller_ids = itertools.count(1)


class Owner(NamedTuple):
    """What a caller's owner fixes once, at construction.

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
    """Everything a compiled call depends on; calls with equal signatures share one."""

    args: Any  # treedef of (args, kwargs)
    statics: tuple  # per leaf: ARRAY, or a key of the static value (see _static_key)
    arrays: tuple  # per tensor argument: (shape, dtype, device, needs grad)
    variables: tuple  # per variable leaf: (shape, dtype, device, needs grad)
    mode: Hashable  # the owner's mode (train/eval, the NNX graph)
    x64: bool
    exchange: Any  # bridge's exchange: device and route


def _static_key(value) -> tuple:
    """A key that tells apart static values that compute differently.

    ``0.0 == -0.0`` and ``1 == 1.0 == True`` but they compute differently, and ``nan !=
    nan`` would never find its own program: floats are keyed by their bits, everything
    by its type.
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
    """Flattens ``(args, kwargs)`` into tensor leaves, the structure and a static key.

    Returns:
        ``(tensors, treedef, statics, values)``: ``statics`` per leaf ``ARRAY`` or the key
        of a static value, ``values`` the static values themselves.

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
            statics.append(_static_key(leaf))
    statics = tuple(statics)
    try:
        hash(statics)
    except TypeError:
        from torchside._build import unhashable_static

        raise unhashable_static(leaves, treedef, where) from None
    return tensors, treedef, statics, leaves


class Caller:
    """The compile cache and the call path shared by ``FlaxModule`` and ``jax_function``.

    Args:
        owner: what the owner fixes at construction (``Owner``).
        residuals: the boundary mode, ``"save"`` or ``"recompute"``.
        cache_size: how many signatures keep their compiled calls (LRU).
        recompile_warning: warn once (``RecompileWarning``) after this many distinct
            signatures, naming what changes; ``None`` never warns.

    A caller pickles (and deep-copies) as its configuration only: compiled calls, held
    arrays and locks are rebuilt on first use.
    """

    def __init__(self, owner: Owner, *, residuals: str = "save", cache_size: int = 32,
                 recompile_warning: int | None = 8):
        where = owner.where
        if residuals not in RESIDUAL_MODES:
            raise ValueError(
                f"{where}: residuals={residuals!r} is not one of {RESIDUAL_MODES}. Use 'save' "
                f"to hold what the remat policy keeps, or 'recompute' to hold only the inputs."
            )
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(
                f"{where}: cache_size={cache_size!r} must be a positive int (how many call "
                f"signatures keep their compiled programs)."
            )
        self.owner = owner
        self.where = where
        self.residuals = residuals
        self.cache_size = cache_size
        self.recompile_warning = recompile_warning
        self._recompiles = RecompileMonitor(recompile_warning, where)
        self._reset()

    def _reset(self) -> None:
        self._cache: collections.OrderedDict[Signature, CompiledCall] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keys = iter(range(1, 1 << 62))
        self.held = bridge.HeldArrays()
        self._var_keys: dict[bool, tuple] = {}
        self._modes: dict = {}
        self._sigs: dict[int, Signature] = {}  # call key -> signature (torch.compile's ops)
        self.traced: dict[tuple, int] = {}  # (mode id, mask) -> key of the call last traced
        # A process-unique id that compiled graphs carry as a constant (see _compile.py).
        self.compile_id = next(_caller_ids)
        CALLERS[self.compile_id] = self

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k in ("owner", "where", "residuals", "cache_size", "recompile_warning")}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._recompiles = RecompileMonitor(self.recompile_warning, self.where)
        self._reset()

    def clear(self) -> None:
        """Drops every compiled call and held array; the next call compiles again."""
        with self._lock:
            self._cache.clear()
            self.held.clear()
            self._var_keys = {}

    @property
    def calls(self) -> list[CompiledCall]:
        """The cached compiled calls, oldest first."""
        return list(self._cache.values())

    # -- torch.compile (see _compile.py) -------------------------------------------------
    def mode_id(self, mode: Hashable) -> int:
        """A small int for ``mode`` (custom ops take ints, not arbitrary values)."""
        return self._modes.setdefault(mode, len(self._modes))

    def mode_of(self, mode_id: int) -> Hashable:
        """The mode ``mode_id`` stands for."""
        for mode, i in self._modes.items():
            if i == mode_id:
                return mode
        raise KeyError(mode_id)

    def signature_of(self, metas, mode: Hashable, mask: str) -> Signature:
        """The signature of a call from per-leaf ``(shape, dtype, device)`` and a grad mask.

        Leaves are the variables then the positional tensors (no rng leaf); equal to the
        signature of the same eager call, so both share compiled calls.
        """
        n_vars = len(self.owner.var_names)
        args = metas[n_vars:]
        device = metas[0][2] if metas else torch.device("cpu")
        return Signature(
            jtu.tree_structure((tuple(range(len(args))), {})), (ARRAY,) * len(args),
            tuple((tuple(s), d, v, m == "1") for (s, d, v), m in zip(args, mask[n_vars:],
                                                                   strict=True)),
            tuple((tuple(s), d, v, m == "1") for (s, d, v), m in zip(metas[:n_vars], mask,
                                                                   strict=False)),
            mode, jax.config.jax_enable_x64, bridge.exchange_for(device),
        )

    def compiled(self, key: int) -> CompiledCall:
        """The compiled call numbered ``key``, rebuilt from its signature if evicted."""
        sig = self._sigs[key]
        call = self._cache.get(sig)
        if call is None:  # evicted: rebuild under the same key
            from torchside._build import build_call

            call = build_call(self, sig, [None] * len(sig.statics), key)
            self._store(sig, call)
        return call

    def variable_key(self, variables, grad: bool) -> tuple:
        """Per variable ``(shape, dtype, device, needs grad)``; cached until one changes."""
        key = self._var_keys.get(grad)
        if key is None:
            key = self._var_keys[grad] = tuple(
                (t.shape, t.dtype, t.device, grad and t.requires_grad) for t in variables)
        return key

    def lookup(self, sig: Signature, values, remember: bool = False) -> CompiledCall:
        """The compiled call for ``sig``, built on a miss (``values``: the static leaves).

        ``remember`` keeps the signature by the call's key (``compiled``), for compiled
        graphs whose backward names the call by key.
        """
        call = self._cache.get(sig)
        if call is not None:
            try:
                self._cache.move_to_end(sig)  # LRU
            except KeyError:  # evicted by another thread just now
                pass
        else:
            from torchside._build import build_call

            call = build_call(self, sig, values, next(self._keys))
            self._store(sig, call)
        if remember:
            self._sigs[call.key] = sig
        return call

    def _store(self, sig: Signature, call: CompiledCall) -> None:
        with self._lock:
            self._cache[sig] = call
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return call

    def _explain_state_error(self, variables, tensors, treedef, statics, device) -> None:
        """Raises the error that names the argument, for a failure before the signature."""
        from torchside._build import arg_names, check_tensors, jax_device_for

        names = self.owner.var_names
        check_tensors(variables, names, device, self.where)  # one on another device, a dtype
        if variables:
            lead = names[0]
        else:
            lead = next(n for n, s in zip(arg_names(treedef), statics, strict=True)
                        if s is ARRAY)
        jax_device_for(device, lead, self.where)  # a device JAX shares no memory with

    def training_call(self, variables: list, args: tuple, kwargs: dict,
                      mode: Hashable = None) -> CompiledCall:
        """The compiled call a training call with these arguments would use; nothing runs.

        Built (and cached) for the signature of a call with grad enabled in ``mode``: the
        variables as they require grad, and every floating argument requiring grad, as
        for a block inside a network. ``memory_report`` measures its programs.
        """
        tensors, treedef, statics, values = split_args(args, kwargs, self.where)
        lead = variables[0] if variables else (tensors[0] if tensors else None)
        device = lead.device if lead is not None else _CPU
        try:
            exchange = bridge.exchange_for(device)
        except Exception:
            self._explain_state_error(variables, tensors, treedef, statics, device)
            raise
        sig = Signature(
            treedef, statics,
            tuple((t.shape, t.dtype, t.device, t.is_floating_point() or t.is_complex())
                  for t in tensors),
            tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in variables),
            mode, jax.config.jax_enable_x64, exchange,
        )
        return self.lookup(sig, values)

    def __call__(self, variables: list, args: tuple, kwargs: dict, mode: Hashable = None):
        """Runs one call. Returns ``(outputs pytree, updates, compiled call)``."""
        if torch._C._are_functorch_transforms_active():
            raise under_torch_func(self.where)
        tensors, treedef, statics, values = split_args(args, kwargs, self.where)
        grad = torch.is_grad_enabled()
        # The call runs where its tensors are (NOTE [Devices] in bridge/_devices.py): the
        # variables' device, or the first argument's; the signature holds every tensor's.
        lead = variables[0] if variables else (tensors[0] if tensors else None)
        device = lead.device if lead is not None else _CPU
        try:
            exchange = bridge.exchange_for(device)
            head, changed = self.held.arrays(variables, exchange)
        except Exception:
            self._explain_state_error(variables, tensors, treedef, statics, device)
            raise
        if changed:
            self._var_keys = {}
        sig = Signature(
            treedef, statics,
            tuple((t.shape, t.dtype, t.device, grad and t.requires_grad) for t in tensors),
            self.variable_key(variables, grad), mode, jax.config.jax_enable_x64, exchange,
        )
        call = self.lookup(sig, values)
        leaves = list(variables)
        if self.owner.rng_shape is not None:
            rng = call.rng(self.owner.rng_shape)
            leaves.append(rng)
            head = head + [exchange.view(rng)]
        leaves += tensors
        if call.grad_slots:
            results = apply_bridge(call, head, *leaves)
        else:
            results = call.run(head, leaves)
        outs = jtu.tree_unflatten(call.program.out_treedef, results[: call.n_out])
        return outs, results[call.n_out : call.n_results], call
