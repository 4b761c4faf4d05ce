"""Building one signature's programs, and the errors that name what a call received.

Runs on a cache miss, or on a call that fails before its signature exists; nothing here is
on the per-call path (NOTE [Call path] in ``_call.py``). ``build`` returns plain parts
(``Built``); the caller makes its ``Entry`` from them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import torch

import bridge
import bridge.internal as bi
from flaxside.internal import (
    ARRAY,
    LeafSpec,
    Program,
    flat_apply,
    internal_assert,
    is_differentiable,
)

jtu = jax.tree_util


class Built(NamedTuple):
    """What ``build`` makes for one signature.

    Attributes:
        program: the ``flaxside`` programs, compiled for the call's device.
        names: a name per leaf: the variables, ``rngs`` where the owner has RNG streams,
            then the arguments (``args[0]``, ``kwargs['mask']``).
        n_vars: how many leaves are the owner's variables.
        n_state: ``n_vars`` plus the RNG leaf.
        device: the torch device the call runs on.
        narrow: leaf indices of int64 arguments that cross as int32.
        unpack: how the gradients of small leaves are viewed out of their packed buffers
            (``grad_unpacker``), or ``None`` where none is packed.
    """

    program: Program
    names: tuple[str, ...]
    n_vars: int
    n_state: int
    device: torch.device
    narrow: tuple[int, ...]
    unpack: tuple | None


def for_owner(error: Exception, where: str) -> Exception:
    """The same error, its message naming the owner the user called (``FlaxModule(Block)``).

    The one place where errors that bridge raises about a call's tensors (a dtype or device
    JAX cannot hold, an int64 value beyond int32) are re-raised for the user.
    """
    return type(error)(f"{where}: {error}")


def arg_names(treedef) -> list[str]:
    """Readable names (``args[0]``, ``kwargs['mask']``) for each leaf of ``(args, kwargs)``."""
    tree = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    names = []
    for path, _ in jtu.tree_flatten_with_path(tree)[0]:
        head, rest = path[0].idx, path[1:]
        names.append(("args" if head == 0 else "kwargs") + jtu.keystr(rest))
    return names


def unhashable_static(leaves, treedef, where: str) -> TypeError:
    """The error for a non-tensor argument that cannot be part of a compile key."""
    for name, leaf in zip(arg_names(treedef), leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            try:
                hash(leaf)
            except TypeError:
                return TypeError(
                    f"{where}: argument {name} is a {type(leaf).__name__}, which is neither a "
                    f"torch.Tensor nor hashable. Non-tensor arguments are static (part of the "
                    f"compile key) and must be hashable: pass a tensor, or a tuple instead of "
                    f"a list of numbers."
                )
    return TypeError(f"{where}: an argument is not hashable.")


def check_devices(tensors, names, device: torch.device, where: str,
                  has_parameters: bool = True) -> None:
    """Refuses a tensor on another device than ``device`` (the variables' or first's)."""
    for t, name in zip(tensors, names, strict=True):
        if t.device != device:
            if has_parameters:
                what = "the module's parameters are"
                fix = f"Move the input with .to('{device}') or the module with .to('{t.device}')."
            else:
                what = f"{names[0]} is"
                fix = f"Move every tensor argument to one device, e.g. {name}.to('{device}')."
            raise ValueError(
                f"{where}: argument {name} is on {t.device}, but {what} on {device}. {fix}"
            )


def numpy_dtypes(tensors, names, where: str) -> tuple:
    """The numpy dtype JAX sees for each tensor; refuses one JAX cannot hold."""
    try:
        return tuple(bridge.numpy_dtype(t.dtype, name=n)
                     for t, n in zip(tensors, names, strict=True))
    except TypeError as e:
        raise for_owner(e, where) from None


def jax_device_for(device: torch.device, name: str, where: str):
    """The JAX device a call on ``device`` runs on; the error names the owner and argument."""
    try:
        return bridge.jax_device(device, name=name)
    except ValueError as e:
        raise for_owner(e, where) from None


def explain_state_error(settings, variables, tensors, treedef, statics, device) -> None:
    """Raises the error naming the argument, for a call that failed before its signature.

    A variable on another device than the first, a dtype JAX cannot hold, or a device JAX
    shares no memory with; returns if none of those is the cause.
    """
    where, names = settings.where, settings.var_names
    check_devices(variables, names, device, where)
    numpy_dtypes(variables, names, where)
    if variables:
        lead = names[0]
    else:
        lead = next(n for n, s in zip(arg_names(treedef), statics, strict=True) if s is ARRAY)
    jax_device_for(device, lead, where)


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


def _check_updates(program: Program, specs, names, where: str) -> None:
    """The state a call writes back must fit the buffers it replaces (before anything runs)."""
    targets = program.write_back.targets
    updates = program.out_specs[program.n_out :]
    internal_assert(len(targets) == len(updates),
                    f"{where} returns {len(updates)} state updates for {len(targets)} targets")
    for i, u in zip(targets, updates, strict=True):
        if (u.shape, u.dtype) != (specs[i].shape, specs[i].dtype):
            raise TypeError(
                f"{where}: the forward updates '{names[i]}' to {u.dtype}{list(u.shape)}, but "
                f"the buffer holds {specs[i].dtype}{list(specs[i].shape)}; torch keeps its "
                f"buffers' dtype and shape. Keep the state's dtype and shape in the forward "
                f"(e.g. cast the new value with .astype(old.dtype))."
            )


def build(settings, sig, values, monitor) -> Built:
    """Compiles the programs for one signature.

    Reads only the signature (shapes, dtypes, devices, grad flags) besides the static
    ``values``, so an entry evicted from the cache can be rebuilt from it.

    Args:
        settings: the owner's ``Settings``.
        sig: the call's ``Signature``.
        values: every leaf of ``(args, kwargs)``; the static ones are baked in.
        monitor: the owner's ``RecompileMonitor``, told about the new signature.
    """
    where = settings.where
    n_vars = len(sig.variables)
    names = list(settings.var_names)
    metas = [m[:3] for m in sig.variables]
    grads = [m[3] for m in sig.variables]
    device = metas[0][2] if metas else (sig.arrays[0][2] if sig.arrays
                                        else torch.device("cpu"))
    if settings.rng_shape is not None:
        names.append("rngs")
        metas.append((settings.rng_shape, torch.int32, device))
        grads.append(False)
    n_state = len(names)
    arg_slot_names = [n for n, s in zip(arg_names(sig.args), sig.statics, strict=True)
                      if s is ARRAY]
    names += arg_slot_names
    # int64 arguments (token ids, masks) cross as int32 while JAX runs 32-bit, each value
    # checked at every call (bridge.internal.narrow_to_int32); the program sees int32.
    narrow = tuple(n_state + k for k, m in enumerate(sig.arrays) if bi.narrows_to_int32(m[1]))
    metas += [(m[0], torch.int32 if n_state + k in narrow else m[1], m[2])
              for k, m in enumerate(sig.arrays)]
    grads += [m[3] for m in sig.arrays]
    try:
        checked = [_Meta(*m) for m in metas[:n_vars] + metas[n_state:]]
        checked_names = names[:n_vars] + names[n_state:]
        check_devices(checked, checked_names, device, where, has_parameters=n_vars > 0)
        dtypes = numpy_dtypes(checked, checked_names, where)
        np_dtypes = dtypes[:n_vars] + (np.dtype("int32"),) * (n_state - n_vars) + dtypes[n_vars:]
        jax_device = jax_device_for(device, names[0] if names else "input", where)
        specs = [LeafSpec(tuple(shape), dt, bool(g) and is_differentiable(dt))
                 for (shape, _, _), dt, g in zip(metas, np_dtypes, grads, strict=True)]
        slots = tuple(ARRAY if s is ARRAY else v
                      for s, v in zip(sig.statics, values, strict=True))
        fn = flat_apply(settings.make_apply(sig.mode), settings.state_treedef, sig.args, slots)
        program = Program(fn, specs, name=where, fence=sig.exchange.dlpack, device=jax_device)
        check_output_dtypes(program, where)
        _check_updates(program, specs, names, where)
    except Exception as e:
        shapes = ", ".join(f"{n}: {d}{list(shape)}"
                           for n, (shape, d, *_) in zip(arg_slot_names, sig.arrays, strict=True))
        e.add_note(f"{where} was called with {shapes or 'no tensors'}.")  # type kept
        raise
    _record(monitor, sig, arg_slot_names, values)
    return Built(program, tuple(names), n_vars, n_state, device, narrow,
                 grad_unpacker(program.grad_pack, program.specs, program.diff_index))


def grad_unpacker(placement, specs, diff_index):
    """What ``Entry.gradients`` needs to view packed gradients; ``None`` when none are."""
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




class _Meta:
    """Tensor metadata standing in for a tensor in the checks."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = shape, dtype, device


def _record(monitor, sig, names, values) -> None:
    """Tells the recompile monitor about a new signature, with readable names."""
    if monitor.done:
        return
    all_names = arg_names(sig.args)
    monitor.record(
        sig._replace(exchange=None),
        [(n, tuple(shape), d) for n, (shape, d, *_) in zip(names, sig.arrays, strict=True)],
        [(n, v) for n, s, v in zip(all_names, sig.statics, values, strict=True) if s is not ARRAY],
        [("the argument structure", sig.args),
         ("which arguments require grad", tuple(g for *_, g in sig.arrays)),
         ("which parameters require grad", tuple(g for *_, g in sig.variables)),
         ("parameter dtypes", tuple(str(d) for _, d, _, _ in sig.variables)),
         ("train/eval mode", sig.mode),
         ("jax_enable_x64", sig.x64)],
    )
