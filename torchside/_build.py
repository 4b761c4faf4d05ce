"""Building one signature's programs, on a cache miss (never on the per-call path).

``build`` returns plain parts (``Built``); the caller makes its ``Entry`` from them
(NOTE [Call path] in ``_call.py``). The checks it runs are in ``_checks.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import torch

import bridge.internal as bi
from flaxside.internal import (
    ARRAY,
    LeafSpec,
    Program,
    SpmdProgram,
    flat_apply,
    is_differentiable,
)
from torchside import _checks
from torchside._resolve import TensorMeta, arg_names

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


def build(settings, sig, values, monitor, spmd=None) -> Built:
    """Compiles the programs for one signature.

    Reads only the signature (shapes, dtypes, devices, grad flags) besides the static
    ``values``, so an entry evicted from the cache can be rebuilt from it.

    Args:
        settings: the owner's ``Settings``.
        sig: the call's ``Signature``.
        values: every leaf of ``(args, kwargs)``; the static ones are baked in.
        monitor: the owner's ``RecompileMonitor``, told about the new signature.
        spmd: the owner's ``torchside._shard.ShardPlan`` when it is sharded: the programs
            are then SPMD over its mesh (NOTE [Sharded blocks]).
    """
    where = settings.where
    n_vars = len(sig.variables)
    device = sig.exchange.torch_device
    names = list(settings.var_names)
    metas = [TensorMeta(k.shape, k.dtype, k.device) for k in sig.variables]
    grads = [k.needs_grad for k in sig.variables]
    if settings.rng_shape is not None:
        names.append("rngs")
        metas.append(TensorMeta(settings.rng_shape, torch.int32, device))
        grads.append(False)
    n_state = len(names)
    arg_slot_names = [n for n, s in zip(arg_names(sig.arg_treedef), sig.statics, strict=True)
                      if s is ARRAY]
    names += arg_slot_names
    # int64 arguments (token ids, masks) cross as int32 while JAX runs 32-bit, each value
    # checked at every call (bridge.internal.narrow_to_int32); the program sees int32.
    narrow = tuple(n_state + k for k, t in enumerate(sig.tensors)
                   if bi.narrows_to_int32(t.dtype))
    metas += [TensorMeta(t.shape, torch.int32 if n_state + k in narrow else t.dtype, t.device)
              for k, t in enumerate(sig.tensors)]
    grads += [t.needs_grad for t in sig.tensors]
    try:
        checked = metas[:n_vars] + metas[n_state:]
        checked_names = names[:n_vars] + names[n_state:]
        _checks.check_devices(checked, checked_names, device,
                              None if n_vars else (checked_names or [None])[0], where)
        dtypes = _checks.numpy_dtypes(checked, checked_names, where)
        np_dtypes = dtypes[:n_vars] + (np.dtype("int32"),) * (n_state - n_vars) + dtypes[n_vars:]
        jax_device = _checks.jax_device_for(device, names[0] if names else "input", where)
        specs = [LeafSpec(tuple(m.shape), dt, bool(g) and is_differentiable(dt))
                 for m, dt, g in zip(metas, np_dtypes, grads, strict=True)]
        slots = tuple(ARRAY if s is ARRAY else v
                      for s, v in zip(sig.statics, values, strict=True))
        fn = flat_apply(settings.make_apply(sig.mode), settings.state_treedef, sig.arg_treedef,
                        slots)
        if spmd is None:
            program = Program(fn, specs, name=where, fence=sig.exchange.dlpack,
                              device=jax_device)
        else:
            layout = spmd.layout(n_state, n_vars, [len(t.shape) for t in sig.tensors])
            program = SpmdProgram(fn, specs, layout, name=where, fence=sig.exchange.dlpack)
        _checks.check_output_dtypes(program, where)
        _checks.check_updates(program, names, where)
    except Exception as e:
        shapes = ", ".join(f"{n}: {t.dtype}{list(t.shape)}"
                           for n, t in zip(arg_slot_names, sig.tensors, strict=True))
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



def _record(monitor, sig, names, values) -> None:
    """Tells the recompile monitor about a new signature, with readable names."""
    if monitor.done:
        return
    all_names = arg_names(sig.arg_treedef)
    monitor.record(
        sig._replace(exchange=None),
        [(n, tuple(t.shape), t.dtype) for n, t in zip(names, sig.tensors, strict=True)],
        [(n, v) for n, s, v in zip(all_names, sig.statics, values, strict=True) if s is not ARRAY],
        [("the argument structure", sig.arg_treedef),
         ("which arguments require grad", tuple(t.needs_grad for t in sig.tensors)),
         ("which parameters require grad", tuple(k.needs_grad for k in sig.variables)),
         ("parameter dtypes", tuple(str(k.dtype) for k in sig.variables)),
         ("train/eval mode", sig.mode),
         ("jax_enable_x64", sig.x64)],
    )
