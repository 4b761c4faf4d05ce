"""Compiles and runs a JAX function of (variables, *args, **kwargs) from torch, per signature."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import jax
import torch

import bridge
from flaxside import ARRAY, LeafSpec, Program, StaleSignature, flat_apply, is_differentiable
from torchside._function import RESIDUAL_MODES, Entry, apply_bridge
from torchside._recompile import RecompileMonitor
from torchside._signature import arg_names, arg_slots, leaf_dtypes, split_args

jtu = jax.tree_util


def check_residuals(residuals: str, where: str) -> str:
    """Validates the boundary mode option."""
    if residuals not in RESIDUAL_MODES:
        raise ValueError(
            f"{where}: residuals={residuals!r} is not one of {RESIDUAL_MODES}. Use 'save' to "
            f"hold what the remat policy keeps, or 'recompute' to hold only the inputs."
        )
    return residuals


def check_output_dtypes(program: Program, where: str) -> None:
    """Refuses, at build time and by output path, a result dtype torch has no match for."""
    tree = jtu.tree_unflatten(program.out_treedef, range(program.n_out))
    for path, k in jtu.tree_flatten_with_path(tree)[0]:
        dtype = program.out_specs[k].dtype
        try:
            bridge.torch_dtype(dtype)
        except TypeError:
            raise TypeError(
                f"{where}: output {jtu.keystr(path) or '(the result)'} has dtype {dtype}, which "
                f"torch cannot hold. Cast it inside the function (e.g. .astype(jnp.int8) for "
                f"int4) or leave it out of the outputs."
            ) from None


class Caller:
    """The compile cache and the call path shared by ``FlaxModule`` and ``jax_function``.

    Args:
        make_apply: ``make_apply(context) -> (apply, has_aux, aux_targets)`` where
            ``aux_targets`` are the indices of the variable leaves that the aux outputs
            replace after the call (or a callable returning them, read once ``apply`` has
            been traced), and ``apply(variables,
            *args, **kwargs)`` returns outputs, or ``(outputs, aux)`` with ``has_aux``.
            ``context`` is a hashable value the owner passes per call (train mode, ...).
        where: the owner's name for error messages.
        residuals: the boundary mode, ``"save"`` or ``"recompute"``.
        cache_size: how many signatures keep their compiled programs (LRU).
        recompile_warning: warn once (``RecompileWarning``) after this many distinct
            signatures, naming what changes; ``None`` never warns.
    """

    def __init__(self, make_apply: Callable, *, where: str, residuals: str = "save",
                 cache_size: int = 32, recompile_warning: int | None = 8):
        self.make_apply = make_apply
        self.where = where
        self.residuals = check_residuals(residuals, where)
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(
                f"{where}: cache_size={cache_size!r} must be a positive int (how many call "
                f"signatures keep their compiled programs)."
            )
        self.cache_size = cache_size
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._epoch = 0
        self._recompiles = RecompileMonitor(recompile_warning, where)

    def clear(self) -> None:
        """Drops every compiled program; the next call compiles again."""
        with self._lock:
            self._cache.clear()
            self._epoch += 1

    @property
    def entries(self) -> list[Entry]:
        """The cached entries, oldest first."""
        return list(self._cache.values())

    def __call__(self, variables, var_treedef, var_names, args, kwargs, context=()):
        """Runs one call. Returns ``(outputs pytree, aux leaves, entry)``."""
        try:
            return self._call(variables, var_treedef, var_names, args, kwargs, context)
        except StaleSignature:
            # A variable was re-typed behind torch's back (``p.data = ...``): rebuild once.
            self.clear()
            return self._call(variables, var_treedef, var_names, args, kwargs, context)

    def _call(self, variables, var_treedef, var_names, args, kwargs, context):
        tensors, treedef, static_key = split_args(args, kwargs, self.where)
        grad_on = torch.is_grad_enabled()
        key = (
            treedef,
            static_key,
            tuple((t.shape, t.dtype, t.device, grad_on and t.requires_grad) for t in tensors),
            tuple(v.requires_grad for v in variables) if grad_on else None,
            self._epoch,
            context,
            jax.config.jax_enable_x64,
        )
        entry = self._cache.get(key)
        if entry is not None:
            try:
                self._cache.move_to_end(key)  # LRU
            except KeyError:  # evicted by another thread just now
                pass
        else:
            entry = self._build(key, variables, var_treedef, var_names, tensors, treedef,
                                static_key, grad_on, context)
        leaves = list(variables) + tensors
        if entry.program.diff_index:
            results = apply_bridge(entry, *leaves)[: entry.n_results]
        else:
            results = entry.run(leaves)
        outs = jtu.tree_unflatten(entry.program.out_treedef, results[: entry.n_out])
        return outs, results[entry.n_out :], entry

    def _build(self, key, variables, var_treedef, var_names, tensors, treedef, static_key,
               grad_on, context) -> Entry:
        leaves = list(variables) + tensors
        diff = [grad_on and t.requires_grad for t in leaves]
        entry = self.build_entry(leaves, diff, var_treedef, var_names, len(variables), treedef,
                                 static_key, context)
        with self._lock:
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        names = arg_names(treedef)
        self._recompiles.record(
            key[:4] + key[5:],  # without the epoch: a rebuild after clear() is no new signature
            [(n, t.shape, t.dtype) for n, t in
             zip([n for n, s in zip(names, static_key, strict=True) if s is ARRAY], tensors,
                 strict=True)],
            [(n, s[1]) for n, s in zip(names, static_key, strict=True) if s is not ARRAY],
            [("the argument structure", treedef),
             ("which arguments require grad", tuple(g for *_, g in key[2])),
             ("which parameters require grad", key[3]),
             ("train/eval mode", context),
             ("jax_enable_x64", key[6])],
        )
        return entry

    def build_entry(self, leaves, diff, var_treedef, var_names, n_vars, treedef, static_key,
                    context) -> Entry:
        """Compiles the programs for one signature (not cached here).

        Args:
            leaves: variable tensors then argument tensors (real or fake: only their
                metadata is read).
            diff: per leaf, whether a gradient is wanted (floating dtypes only count).
            var_treedef: treedef of the state the variable leaves rebuild.
            var_names: names of the variable leaves, for error messages.
            n_vars: how many leading leaves are variables.
            treedef: treedef of ``(args, kwargs)``.
            static_key: per argument leaf, ``ARRAY`` or ``(type, value)``.
            context: the owner's per-call context (train mode).

        Returns:
            A new ``Entry``.
        """
        if leaves:
            device = leaves[0].device
        else:
            device = torch.device("cpu")
        names = list(var_names) + [
            n for n, s in zip(arg_names(treedef), static_key, strict=True) if s is ARRAY
        ]
        try:
            np_dtypes = leaf_dtypes(leaves, names, device, self.where, n_vars > 0)
            bridge.jax_device(device, name=names[0] if names else "input")  # JAX has it?
            specs = [
                LeafSpec(tuple(int(d) for d in t.shape), dt,
                         bool(want) and is_differentiable(dt))
                for t, dt, want in zip(leaves, np_dtypes, diff, strict=True)
            ]
            apply, has_aux, aux_targets = self.make_apply(context)
            fn = flat_apply(apply, var_treedef, treedef, arg_slots(static_key))
            program = Program(fn, specs, has_aux=has_aux, name=self.where)
            check_output_dtypes(program, self.where)
        except StaleSignature:
            raise
        except Exception as e:
            if hasattr(e, "add_note"):  # Python 3.11+: keep the type, add what we received
                shapes = ", ".join(
                    f"{n}: {t.dtype}{list(t.shape)}"
                    for n, t in zip(names[n_vars:], leaves[n_vars:], strict=True)
                )
                e.add_note(f"{self.where} was called with {shapes or 'no tensors'}.")
            raise
        entry = Entry(program, np_dtypes, device, self.residuals, n_vars)
        entry.aux_targets = tuple(aux_targets() if callable(aux_targets) else aux_targets)
        return entry
