"""The call pipeline: one call of an owner (``FlaxModule``, ``jax_function``).

NOTE [Call path]. An owner hands its ``Caller`` what it fixes at construction
(``Settings``, and the ``Edges`` above the first-order pipeline); a call passes only what
changes, resolved, and the owner's ``write_back``:

    caller(resolve(...), write_back) -> outputs

1. ``resolve`` (NOTE [Resolve] in ``_resolve.py``): the variables the call reads, its
   tensors and static values, autocast's casts, its device and the owner's mode, as one
   ``Call``.
   Every edge starts here.
2. ``Caller.prepare``: the variables' held arrays (``bridge.internal.HeldArrays``), the
   ``Signature``, its ``Entry`` from the LRU cache (built on a miss, ``_build.build``), and
   the RNG slot, drawn from torch's generator only if the entry's programs read it.
3. The edge, the one step where calls differ (NOTE [Routes] in ``_routes.py``): eagerly
   ``BridgeFunction`` (``_eager.py``; no autograd at all when nothing needs a gradient);
   under ``torch.compile`` the ``flaxtorch::forward`` op (``edges/_compile.py``), whose
   implementation is steps 2 and 4 again; under ``torch.func`` a call of the layer above
   (``edges/_higher.py``).
4. ``Entry.forward``: views of the arguments, the entry's executable through the
   exchange's ``run`` (NOTE [Exchange] in ``bridge/_exchange.py``); ``save`` keeps what the
   backward reads (``Holds``), so that torch's saved-tensor hooks and version counters see
   it.
5. ``write_back``: the owner copies updated state into its buffers (and, for NNX, takes
   the graph the call left); ``apply_write_back`` is shared by every edge.

Backward: ``Entry.backward`` views what was saved (held arrays reused) and runs the
backward program through the exchange (for a scalar loss, whose forward ran
``value_and_grad``, ``scaled`` scales the saved gradients instead: NOTE [Scalar loss] in
``_eager.py``); ``Entry.gradients`` hands each leaf its gradient (a view of a packed
buffer), ``None`` where no used output depends on it.

A cached eager forward and backward of a ``FlaxModule`` runs our code in seven files, one
concept each: ``owners/_module.py``, ``_resolve.py`` (step 1), this file, ``_eager.py`` (the
eager edge), ``_entry.py``, ``bridge/_exchange.py`` and ``bridge/_held.py``
(the held arrays' check, a concept of its own: NOTE [Held arrays per call]); the DLPack
route adds ``bridge/_dlpack.py`` (and on CUDA ``bridge/_ordering.py``, for torch's current
stream), a call under ``torch.autocast`` ``_autocast.py``, an NNX call
``flaxside/adapters/_nnx.py`` (one ``Graph.__hash__``: its signature holds the module graph, which
is compared by value); a Linen call with RNG streams takes the same seven, a call
without gradients all but ``_eager.py``. Otherwise
``flaxside`` runs only when a signature's programs are built
(``tests/calls/test_hot_path.py``, for Linen calls with and without RNG streams and NNX).
Code there that a per-call step would otherwise call once per tensor reads all tensors
through ``map`` (no Python call per tensor: a leaf costs the call what it costs torch's C
code).
"""

from __future__ import annotations

import collections
import copy
import itertools
import operator
import threading
import weakref
from collections.abc import Callable

import jax
import torch
import torch.autograd.forward_ad as _fwAD

from bridge.internal import HeldArrays, exchange_for
from torchside import _errors
from torchside.call import _build, _checks
from torchside.call._eager import apply_bridge
from torchside.call._entry import Entry, apply_write_back
from torchside.call._options import check_choice, check_positive_int
from torchside.call._recompile import RecompileMonitor
from torchside.call._routes import EAGER, Edge
from torchside.call._values import Call, Edges, Settings, Signature, TensorKey
from torchside.call._values import function_settings as function_settings

jtu = jax.tree_util

RESIDUAL_MODES = ("save", "split", "recompute")
# A signature's parts per tensor, read by ``map`` (in C: no Python call per tensor).
_SHAPE = operator.attrgetter("shape")  # a compiled call's are stand-ins (TensorMeta)
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

_caller_ids = itertools.count(1)
_var_key_ids = itertools.count(1)  # never restarted: no two VarKeys ever share an int


class VarKey(int):
    """A signature's variables, as an int that names them (``keys``: a ``TensorKey`` each).

    Hashed and compared in C whatever the number of variables (a tuple of 768 keys was
    hashed at every call: NOTE [Held arrays per call] in ``bridge/_held.py``); one caller
    gives equal keys one ``VarKey`` (``Caller._intern``).
    """

    keys: tuple


# Callers by compile id, for ``torch.compile``'s ops (``edges/_compile.py``), which carry only
# ints and strings. Weak: nothing here outlives its owner.
CALLERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def variable_key(variables, grads) -> tuple[TensorKey, ...]:
    """The variables' part of a signature: per variable its ``TensorKey``."""
    return tuple(TensorKey(t.shape, t.dtype, t.device, g)
                 for t, g in zip(variables, grads, strict=True))


# -- steps 2 to 5 ---------------------------------------------------------------------------
class Caller:
    """An owner's entries (an LRU cache of compiled signatures), held arrays and calls.

    Args:
        settings: what the owner fixes at construction.
        edges: the edges above the first-order pipeline (``torchside.edges._edges.EDGES``).
        residuals: the boundary mode, one of ``RESIDUAL_MODES`` (``FlaxModule``).
        cache_size: how many signatures keep their entries (LRU).
        recompile_warning: warn once (``RecompileWarning``) after this many distinct
            signatures, naming what changes; ``None`` never warns.

    A caller pickles (and deep-copies) as its configuration only: entries, held arrays and
    locks are rebuilt on first use.
    """

    _CONFIG = ("settings", "edges", "where", "residuals", "cache_size", "recompile_warning")

    def __init__(self, settings: Settings, edges: Edges, *, residuals: str = "save",
                 cache_size: int = 32, recompile_warning: int | None = 8):
        where = settings.where
        self.settings = settings
        self.edges = edges
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
        new.plan = self.plan
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
        self._interned: dict = {}  # variables' keys -> their VarKey
        self._rng_zeros: dict = {}
        # torchside.integrations._shard.ShardPlan once the owner is sharded; kept by a deep
        # copy, not pickled (another process has other meshes): an unpickled copy refuses its
        # DTensors by name (``_checks.explain_state_error``).
        self.plan = None
        self.compile_id = next(_caller_ids)
        CALLERS[self.compile_id] = self

    def place(self, plan) -> None:
        """Calls from now on run SPMD programs over ``plan`` (``torchside.integrations._shard``)."""
        self.clear()
        self.plan = plan

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

    def lookup(self, sig: Signature, values) -> Entry:
        """The entry for ``sig``, built on a miss (``values``: the leaves of the arguments)."""
        entry = self._cache.get(sig)
        if entry is not None:
            try:
                self._cache.move_to_end(sig)  # LRU
            except KeyError:  # evicted by another thread just now
                pass
            return entry
        entry = _build.build(self.settings, sig, values, self.monitor, self.plan,
                             self.residuals, next(self._keys))
        with self._lock:
            self._cache[sig] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return entry

    def entry(self, key: int) -> Entry:
        """The entry numbered ``key`` (a compiled graph's), rebuilt if it was evicted."""
        sig = self._by_key[key]
        entry = self._cache.get(sig)
        return entry if entry is not None and entry.key == key else self.lookup(
            sig, [None] * len(sig.statics))

    def prepare(self, call: Call, grads, var_grads, edge: Edge):
        """Step 2 of NOTE [Call path]: ``(entry, state arrays, leaves)`` for ``call``.

        Args:
            call: the resolved call.
            grads: per tensor argument, whether it needs a gradient.
            var_grads: per variable, whether it may need one (``None``: each variable's
                ``requires_grad`` under the grad mode).
            edge: where the call enters (an ``Edge``): it decides whether the
                variables' memory is read (the state arrays are ``None`` where not) and
                whether an RNG key is drawn.
        """
        state_arrays, changed = None, False
        try:
            exchange = exchange_for(call.device)
            if edge.holds:
                state_arrays, changed = self.held.arrays(call.variables, exchange, var_grads)
        except Exception:
            _checks.explain_state_error(self.settings.var_names, call, self.where)
            raise
        if state_arrays is None:  # stand-in tensors: a key of their own, not kept
            var_key = self._intern(variable_key(call.variables, var_grads))
        else:
            if changed:
                self._var_keys = {}
            flags = torch.is_grad_enabled() if var_grads is None else var_grads
            var_key = self._var_keys[flags] if flags in self._var_keys else None
            if var_key is None:  # until a variable changes (``changed``), per grad mode
                var_key = self._var_keys[flags] = self._intern(variable_key(
                    call.variables, [flags and t.requires_grad for t in call.variables]
                    if var_grads is None else var_grads))
        tensors = call.tensors
        # (tuple.__new__ makes the NamedTuples in C: no Python __new__ on this path)
        sig = tuple.__new__(Signature, (
            call.arg_treedef, call.statics,
            tuple(map(tuple.__new__, itertools.repeat(TensorKey),
                      zip(map(_SHAPE, tensors), map(_DTYPE, tensors), map(_DEVICE, tensors),
                          grads, strict=True))),
            var_key, call.mode, jax.config.jax_enable_x64, exchange))
        try:  # (a subscript, not .get: no call on a hit)
            entry = self._cache[sig]
            self._cache.move_to_end(sig)  # LRU
        except KeyError:  # a miss, or evicted by another thread just now
            entry = self.lookup(sig, call.values)
        if edge.named:
            self._by_key[entry.key] = sig
        layout = entry.layout
        if layout.rng is None:
            return entry, state_arrays, [*call.variables, *call.tensors]
        rng = self._rng(entry, edge)
        if state_arrays is not None:
            state_arrays.append(exchange.view(rng))
        # (Layout.of_leaves written out: a call with RNG streams runs no other file)
        return entry, state_arrays, [*call.variables, rng, *call.tensors]

    def _intern(self, keys: tuple) -> VarKey:
        """The ``VarKey`` of a signature's variables (equal keys, one ``VarKey``)."""
        key = self._interned.get(keys)
        if key is None:
            key = self._interned[keys] = VarKey(next(_var_key_ids))
            key.keys = keys
        return key

    def _rng(self, entry: Entry, edge: Edge) -> torch.Tensor:
        """The RNG slot: fresh key data from torch's generator if the programs read it.

        From torch's default generator: ``torch.manual_seed`` reproduces a run, and
        ``torch.utils.checkpoint``'s RNG-state replay reproduces the key on recompute. An
        eval-mode forward that uses no stream draws nothing (validation does not shift the
        training stream); neither does a call that does not run.
        """
        shape, device = self.settings.rng_shape, entry.exchange.torch_device
        if entry.rng_read and edge.draws:
            try:
                return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32,
                                     device=device)
            except RuntimeError as e:  # torch.func.vmap(randomness="error")
                if "randomness" not in str(e):
                    raise
                raise _errors.random_under_vmap(self.where) from e
        zeros = self._rng_zeros.get(device)
        if zeros is None:
            zeros = torch.zeros(shape, dtype=torch.int32, device=device)
            if edge.holds:  # under a torch.func transform a new tensor is its wrapper
                self._rng_zeros[device] = zeros
        return zeros

    def __call__(self, call: Call, write_back: Callable | None = None):
        """Runs one call (NOTE [Call path]); returns the outputs' pytree."""
        if call.arg_treedef is None:  # resolved under torch.compile
            return self.edges.compiled(self, call, write_back)
        if torch._C._are_functorch_transforms_active() or _fwAD._current_level >= 0:
            # NOTE [torch.func]; forward-mode AD (forward_ad's dual tensors) too.
            entry, results = self.edges.transformed(self, call, write_back)
        else:
            tensors = call.tensors
            grads = (tuple(map(_REQUIRES_GRAD, tensors)) if torch.is_grad_enabled()
                     else (False,) * len(tensors))
            entry, state_arrays, leaves = self.prepare(call, grads, None, EAGER)
            if entry.grad_slots:  # the edge: autograd only where a gradient is wanted
                results = apply_bridge(entry, self.held, self.edges, state_arrays, *leaves)
            else:
                fwd = entry.forward(state_arrays, leaves, entry.routes[EAGER])
                entry.exchange.wait(fwd.pending)
                results = fwd.results
        if entry.writes_back:
            apply_write_back(write_back, entry.write_back, results, entry.n_out)
        return jtu.tree_unflatten(entry.out_treedef, results[: entry.n_out])
