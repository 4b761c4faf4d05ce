"""Building a compiled call for one signature: checks, names and the flaxside programs.

Runs on a cache miss only; nothing here is on the per-call path (see NOTE [Call path]).
"""

from __future__ import annotations

import jax
import numpy as np
import torch

import bridge
from flaxside.internal import ARRAY, LeafSpec, Program, flat_apply, is_differentiable
from torchside._call import CompiledCall
from torchside._caller import Signature

jtu = jax.tree_util


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


def check_tensors(tensors, names, device: torch.device, where: str,
                  has_parameters: bool = True) -> tuple:
    """Checks dtypes and devices and returns the numpy dtypes JAX will see.

    ``device`` is the variables' device, or without variables the first tensor's.
    """
    out = []
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
        out.append(bridge.numpy_dtype(t.dtype, name=name))
    return tuple(out)


def jax_device_for(device: torch.device, name: str, where: str):
    """The JAX device a call on ``device`` runs on; the error names the owner and argument."""
    try:
        return bridge.jax_device(device, name=name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


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
    targets = program.static.targets
    updates = program.out_specs[program.n_out :]
    if len(targets) != len(updates):
        raise AssertionError(
            f"flaxtorch internal error: {where} returns {len(updates)} state updates for "
            f"{len(targets)} targets. This is a bug in flaxtorch; please report it."
        )
    for i, u in zip(targets, updates, strict=True):
        if (u.shape, u.dtype) != (specs[i].shape, specs[i].dtype):
            raise TypeError(
                f"{where}: the forward updates '{names[i]}' to {u.dtype}{list(u.shape)}, but "
                f"the buffer holds {specs[i].dtype}{list(specs[i].shape)}; torch keeps its "
                f"buffers' dtype and shape. Keep the state's dtype and shape in the forward "
                f"(e.g. cast the new value with .astype(old.dtype))."
            )


def build_call(caller, sig: Signature, values, key: int) -> CompiledCall:
    """Compiles the programs for one signature (the caller caches the result).

    Reads only the signature (shapes, dtypes, devices, grad flags), so a call evicted from
    the cache can be rebuilt from it.

    Args:
        caller: the ``Caller`` (its owner, boundary mode and held arrays).
        sig: the call's signature.
        values: every leaf of ``(args, kwargs)``; the static ones are baked in.
        key: the call's number inside the caller.
    """
    owner, where = caller.owner, caller.where
    n_vars = len(sig.variables)
    names = list(owner.var_names)
    metas = [m[:3] for m in sig.variables]
    grads = [m[3] for m in sig.variables]
    device = metas[0][2] if metas else (sig.arrays[0][2] if sig.arrays
                                        else torch.device("cpu"))
    if owner.rng_shape is not None:
        names.append("rngs")
        metas.append((owner.rng_shape, torch.int32, device))
        grads.append(False)
    n_state = len(names)
    arg_slot_names = [n for n, s in zip(arg_names(sig.args), sig.statics, strict=True)
                      if s is ARRAY]
    names += arg_slot_names
    # int64 arguments (token ids, masks) cross as int32 while JAX runs 32-bit, each value
    # checked at every call (bridge.narrow_to_int32); the program sees int32.
    narrow = tuple(n_state + k for k, m in enumerate(sig.arrays)
                   if bridge.narrows_to_int32(m[1]))
    metas += [(m[0], torch.int32 if n_state + k in narrow else m[1], m[2])
              for k, m in enumerate(sig.arrays)]
    grads += [m[3] for m in sig.arrays]
    try:
        checked = check_tensors(
            [_Meta(*m) for m in metas[:n_vars] + metas[n_state:]],
            names[:n_vars] + names[n_state:], device, where, has_parameters=n_vars > 0)
        np_dtypes = (checked[:n_vars] + (np.dtype("int32"),) * (n_state - n_vars)
                     + checked[n_vars:])
        jax_device = jax_device_for(device, names[0] if names else "input", where)
        specs = [LeafSpec(tuple(shape), dt, bool(g) and is_differentiable(dt))
                 for (shape, _, _), dt, g in zip(metas, np_dtypes, grads, strict=True)]
        slots = tuple(ARRAY if s is ARRAY else v
                      for s, v in zip(sig.statics, values, strict=True))
        fn = flat_apply(owner.make_apply(sig.mode), owner.state_treedef, sig.args, slots)
        program = Program(fn, specs, name=where, fence=sig.exchange.dlpack, device=jax_device)
        check_output_dtypes(program, where)
        _check_updates(program, specs, names, where)
    except Exception as e:
        if hasattr(e, "add_note"):  # Python 3.11+: keep the type, add what we received
            shapes = ", ".join(f"{n}: {d}{list(shape)}"
                               for n, (shape, d, *_) in zip(arg_slot_names, sig.arrays,
                                                            strict=True))
            e.add_note(f"{where} was called with {shapes or 'no tensors'}.")
        raise
    record_signature(caller._recompiles, sig, arg_slot_names, values)
    return CompiledCall(program, sig.exchange, caller.held,
                        recompute=caller.residuals == "recompute", n_vars=n_vars,
                        n_state=n_state, names=tuple(names), device=device, key=key,
                        narrow=narrow)


class _Meta:
    """Tensor metadata standing in for a tensor in ``check_tensors``."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = shape, dtype, device


def record_signature(monitor, sig: Signature, names, values) -> None:
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

