"""The one call path: signature, compile cache, compiled call and autograd Function.

NOTE [Call path]. An owner (``FlaxModule``, ``jax_function``) hands a ``Caller`` what is
fixed at construction (an ``Owner``). A call passes only what changes:

    Caller(variables, args, kwargs, mode) -> (outputs, updates, compiled call)

1. ``split_args``: tensor leaves, the structure and a key of every static value.
2. ``HeldArrays.arrays``: one JAX array per variable, reused while it is unchanged; a
   changed dtype, shape or grad flag gives a new ``Signature``.
3. ``Signature`` -> ``CompiledCall`` (LRU cache; built by ``_build.build_call``).
4. ``BridgeFunction`` (or ``CompiledCall.run`` when no gradient is needed): arrays in,
   ``flaxside`` programs, tensors out; what the backward needs goes to
   ``ctx.save_for_backward`` (``save_for_backward`` below, shared with ``torch.compile``).
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
from torchside._recompile import RecompileMonitor

jtu = jax.tree_util

RESIDUAL_MODES = ("save", "recompute")

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


class CompiledCall:
    """What one signature's calls need, fixed when it is built (see ``_build.build_call``).

    Attributes:
        program: the ``flaxside`` programs.
        exchange: how tensors cross (``bridge.exchange_for``).
        held: the owner's ``HeldArrays`` (variables are read through them).
        recompute: ``residuals="recompute"``.
        n_vars: variable leaves; the rng leaf follows them when ``has_rng``.
        n_state: ``n_vars`` plus the rng leaf.
        rng_used: whether the program reads the rng leaf (else no key is drawn).
        write_back: ``WriteBack``: the variables the aux results replace, the graph after.
        nondiff_out: results torch must treat as non-differentiable (ints, aux, outputs
            that depend on no differentiated leaf).
        grad_slots: per gradient (``program.diff_index`` order), the leaf it belongs to.
        names: a name per leaf, for messages.
        key: a small int naming this call inside its caller (``torch.compile`` ops).
    """

    __slots__ = ("program", "exchange", "held", "recompute", "n_vars", "n_state", "rng_used",
                 "write_back", "n_out", "n_results", "nondiff_out", "grad_slots", "names",
                 "device", "key", "_zero_cots", "_unreached", "_rng_zeros", "_unpack")

    def __init__(self, program, exchange, held, *, recompute: bool, n_vars: int, n_state: int,
                 names: tuple, device: torch.device, key: int):
        self.program = program
        self.exchange = exchange
        self.held = held
        self.recompute = recompute
        self.n_vars = n_vars
        self.n_state = n_state
        self.rng_used = n_state > n_vars and program.reads[n_vars]
        self.write_back = program.static
        self.n_out = program.n_out
        self.n_results = len(program.out_specs)
        self.nondiff_out = tuple(k for k, s in enumerate(program.out_specs) if not s.diff)
        self.grad_slots = program.diff_index
        self.names = names
        self.device = device
        self.key = key
        self._zero_cots: dict[int, Any] = {}
        self._unreached: dict[tuple, frozenset] = {}
        self._rng_zeros = None
        self._unpack = _grad_unpacker(program.grad_pack, program.specs, program.diff_index)

    # -- forward -------------------------------------------------------------------------
    def rng(self, shape) -> torch.Tensor:
        """The rng leaf: fresh key data from torch's generator if the program reads it.

        From torch's default generator: ``torch.manual_seed`` reproduces a run, and
        ``torch.utils.checkpoint``'s RNG-state replay reproduces the key on recompute. An
        eval-mode forward that uses no stream draws nothing (validation does not shift the
        training stream).
        """
        if self.rng_used:
            return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32,
                                 device=self.device)
        if self._rng_zeros is None:
            self._rng_zeros = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self._rng_zeros

    def arrays(self, head: list, leaves) -> list:
        """The program's arrays: ``head`` (the state's) then views of the arguments."""
        view = self.exchange.view
        return head + [view(t) for t in leaves[self.n_state :]]

    def run(self, head: list, leaves) -> list[torch.Tensor]:
        """Forward without autograd: nothing is computed or held for a backward."""
        exchange = self.exchange
        return exchange.results(self.program.forward(self.arrays(head, leaves),
                                                     *exchange.fence()))

    def forward(self, head: list, leaves) -> tuple[list, list, list]:
        """Forward for autograd: ``(results, residual tensors, JAX arrays kept for reuse)``."""
        exchange = self.exchange
        arrays = self.arrays(head, leaves)
        if self.recompute:
            return exchange.results(self.program.forward(arrays, *exchange.fence())), [], []
        results, residuals = self.program.forward_with_residuals(arrays, *exchange.fence())
        rmap = self.program.residual_map()
        kept = [results[k] for k in rmap.saved_outputs] + list(residuals)
        tensors = exchange.results(list(results) + list(residuals))
        return tensors[: self.n_results], tensors[self.n_results :], kept

    # -- backward ------------------------------------------------------------------------
    def zero_cotangent(self, k: int):
        """The cotangent of output ``k`` when torch has none, made once (JAX never writes it)."""
        zero = self._zero_cots.get(k)
        if zero is None:
            spec = self.program.out_specs[k]
            zero = self.exchange.view(torch.zeros(
                spec.shape, dtype=bridge.torch_dtype(spec.dtype), device=self.device))
            self._zero_cots[k] = zero
        return zero

    def unreached(self, used: tuple[bool, ...]) -> frozenset:
        """Gradient positions that no used output depends on: torch gives them ``None``."""
        none = self._unreached.get(used)
        if none is None:
            reach = 0
            for mask, u in zip(self.program.grad_reach, used, strict=True):
                if u:
                    reach |= mask
            none = frozenset(p for p in range(len(self.grad_slots)) if not reach >> p & 1)
            self._unreached[used] = none
        return none

    def saved_arrays(self, saved, kept) -> list:
        """Arrays for what ``save_for_backward`` kept (see there), reusing what is unchanged."""
        exchange, held, n_vars = self.exchange, self.held, self.n_vars
        if self.recompute:
            return [held.get(j, t, exchange) if j < n_vars else exchange.view(t)
                    for j, t in enumerate(saved)]
        rmap = self.program.residual_map()
        n_in = len(rmap.saved_inputs)
        arrays = [held.get(j, t, exchange) if j < n_vars else exchange.view(t)
                  for j, t in zip(rmap.saved_inputs, saved[:n_in], strict=True)]
        if kept is None:
            return arrays + [exchange.view(t) for t in saved[n_in:]]
        for t, k in zip(saved[n_in:], kept, strict=True):
            array = None if k is None else k[0]()
            # The array the forward made, unless a saved-tensor hook replaced the tensor.
            arrays.append(array if array is not None and t.data_ptr() == k[1]
                          else exchange.view(t))
        return arrays

    def unpack_grads(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per differentiated leaf its gradient: views into the packed buffers.

        Views of one buffer share its memory. torch's ``AccumulateGrad`` takes each view as
        the parameter's ``.grad`` without a copy; an in-place accumulation then writes only
        the view's own elements.
        """
        unpack = self._unpack
        if unpack is None:
            return buffers
        alone, groups, n = unpack
        out = [None] * n
        for p, b in alone:
            out[p] = buffers[b]
        for b, positions, templates in groups:
            for p, g in zip(positions, _unflatten(buffers[b], templates), strict=True):
                out[p] = g
        return out

    def backward(self, saved, kept, cots) -> list[torch.Tensor]:
        """Gradient buffers (``program.grad_pack``) from what was saved.

        Args:
            saved: what ``save_for_backward`` saved, as torch unpacked it.
            kept: ``ctx.kept`` (arrays to reuse), or ``None``.
            cots: per differentiable output (``diff_out_index``), its cotangent or ``None``.
        """
        program, exchange = self.program, self.exchange
        cots = [self.zero_cotangent(k) if g is None else exchange.view(g)
                for k, g in zip(program.diff_out_index, cots, strict=True)]
        arrays = self.saved_arrays(saved, kept)
        if self.recompute:
            result = program.backward_recompute(arrays, cots, *exchange.fence())
        else:
            rmap = program.residual_map()
            a = len(rmap.saved_inputs)
            b = a + len(rmap.saved_outputs)
            result = program.backward(arrays[:a], arrays[a:b], arrays[b:], cots,
                                      *exchange.fence())
        return exchange.results(result)


def save_for_backward(ctx, call: CompiledCall, leaves, results, residuals, kept=None) -> None:
    """Saves what the backward of ``call`` needs; shared by eager and ``torch.compile`` calls.

    ``ctx.save_for_backward`` makes torch's saved-tensor hooks, ``save_on_cpu`` and
    non-reentrant checkpointing see exactly what is held, and in-place writes to anything
    the backward reads raise torch's version-counter error. ``kept`` are the JAX arrays
    behind the saved results and residuals; only weak references are kept, so a hook that
    moves or drops a tensor frees its memory as usual (``None``: nothing to reuse).
    """
    if call.recompute:
        # State the owner writes back in place after this forward (batch statistics,
        # counters) is saved as it was, so the recompute sees the forward's values.
        targets = set(call.write_back.targets)
        ctx.save_for_backward(*(t.clone() if i in targets else t for i, t in enumerate(leaves)))
        ctx.kept = None
        return
    rmap = call.program.residual_map()
    ctx.save_for_backward(*(leaves[j] for j in rmap.saved_inputs),
                          *(results[k] for k in rmap.saved_outputs), *residuals)
    if kept is None:
        ctx.kept = None
        return
    # Offloaded residuals live in host memory, which the backward program does not take.
    skip = (False,) * len(rmap.saved_outputs) + rmap.offloaded
    ctx.kept = tuple(None if off else (weakref.ref(a), a.unsafe_buffer_pointer())
                     for a, off in zip(kept, skip, strict=True))


def scatter_grads(call: CompiledCall, grads: list, cots) -> list:
    """Gradients per leaf: the program's in their slots, ``None`` elsewhere.

    ``cots`` are the cotangents torch passed (per differentiable output, ``None`` for an
    output nobody used). A leaf that no used output depends on gets ``None``, as torch
    gives it: optimizers such as AdamW then leave it alone (a zero would move it through
    momentum and decay).
    """
    out = [None] * (len(call.names))
    used = tuple(c is not None for c in cots)
    none = call.unreached(used) if not all(used) else ()
    for p, (slot, g) in enumerate(zip(call.grad_slots, grads, strict=True)):
        if p not in none:
            out[slot] = g
    return out


def _grad_unpacker(placement, specs, diff_index):
    """What ``CompiledCall.unpack_grads`` needs, fixed once; ``None`` when nothing is packed."""
    if all(entry[0] == "alone" for entry in placement):
        return None
    alone, groups = [], {}
    for p, entry in enumerate(placement):
        if entry[0] == "alone":
            alone.append((p, entry[1]))
        else:
            group = groups.setdefault(entry[1], ([], []))
            group[0].append(p)
            # Shapes only: meta tensors stand for the views' sizes.
            group[1].append(torch.empty(specs[diff_index[p]].shape, device="meta"))
    return (tuple(alone), tuple((b, tuple(ps), ts) for b, (ps, ts) in groups.items()),
            len(placement))


def _unflatten(buffer: torch.Tensor, templates: list) -> list[torch.Tensor]:
    """Views of ``buffer``, one per template's shape, in order (one C++ call)."""
    return torch._C._nn.unflatten_dense_tensors(buffer, templates)


class BridgeFunction(torch.autograd.Function):
    """``apply(call, head, *leaves) -> results``: one compiled call inside torch autograd.

    ``head`` holds the arrays of the state leaves (held ones for variables). The backward
    is differentiable once: with ``create_graph=True`` it raises (see ``backward``) rather
    than hand torch gradients without a graph.
    """

    @staticmethod
    def forward(ctx, call: CompiledCall, head: list, *leaves: torch.Tensor):
        results, residuals, kept = call.forward(head, leaves)
        ctx.mark_non_differentiable(*(results[k] for k in call.nondiff_out))
        # Unused outputs get no gradient. Materialised, each would be a zero tensor
        # allocated per backward (README: "Per-call cost").
        ctx.set_materialize_grads(False)
        save_for_backward(ctx, call, leaves, results, residuals, kept)
        ctx.call = call
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            if any(_functorch_wrapped(g) for g in grads):  # torch.func.grad runs us so
                raise _under_torch_func(ctx.call.program.name)
            # create_graph=True: torch would differentiate these gradients again, through a
            # compiled JAX VJP it cannot see into. Refuse now. A lazy refusal (torch's
            # once_differentiable) hangs its error node on fresh leaves, off the path to the
            # parameters: autograd.grad(loss_with_gradient_penalty, params) never reaches it
            # and silently drops the penalty's gradient.
            raise NotImplementedError(
                f"{ctx.call.program.name}: backward with create_graph=True (a gradient "
                f"penalty, a Hessian-vector product, MAML) needs the second derivative of "
                f"this call, which is not implemented: its backward is a compiled JAX VJP "
                f"that torch cannot differentiate. Compute the higher-order term inside JAX "
                f"(e.g. a jax_function that returns jax.grad of the inner loss, so torch "
                f"needs only its first derivative), or differentiate without create_graph."
            )
        call = ctx.call
        cots = [grads[k] for k in call.program.diff_out_index]
        return (None, None, *scatter_grads(
            call, call.unpack_grads(call.backward(ctx.saved_tensors, ctx.kept, cots)), cots))


# torch's Function.apply walks every argument in Python (functorch's dead-wrapper check);
# functorch transforms are refused before a call (``Caller.__call__``), so we call the C++
# apply directly.
_c_apply = super(torch.autograd.Function, BridgeFunction).apply


def _functorch_wrapped(tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(isinstance(tensor, torch.Tensor) and check and check(tensor))


def _under_torch_func(where: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: called under a torch.func transform (vmap, grad, jacrev, ...), whose "
        f"tensors have no memory JAX can read. Call it outside the transform, or apply the "
        f"JAX transform (jax.vmap, jax.grad) inside a jax_function."
    )


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

    def __call__(self, variables: list, args: tuple, kwargs: dict, mode: Hashable = None):
        """Runs one call. Returns ``(outputs pytree, updates, compiled call)``."""
        if torch._C._are_functorch_transforms_active():
            raise _under_torch_func(self.where)
        tensors, treedef, statics, values = split_args(args, kwargs, self.where)
        grad = torch.is_grad_enabled()
        lead = variables[0] if variables else (tensors[0] if tensors else None)
        device = lead.device if lead is not None else torch.device("cpu")
        exchange = bridge.exchange_for(device)
        try:
            head, changed = self.held.arrays(variables, exchange)
        except Exception:
            from torchside._build import check_tensors

            check_tensors(variables, self.owner.var_names, device, self.where)
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
            results = _c_apply(call, head, *leaves)
        else:
            results = call.run(head, leaves)
        outs = jtu.tree_unflatten(call.program.out_treedef, results[: call.n_out])
        return outs, results[call.n_out : call.n_results], call
