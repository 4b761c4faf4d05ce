"""Checks of a call's tensors and of what its programs return, before anything runs.

They run when a signature's programs are built (``_build.build``), or when a call fails
before its signature exists (``explain_state_error``); none is on the per-call path. The
messages are worded in ``_errors.py``.
"""

from __future__ import annotations

import jax
import torch

import bridge
from bridge.internal import check_memory
from flaxside.internal import ARRAY, Program, internal_assert
from torchside import _errors
from torchside.call._values import arg_names

jtu = jax.tree_util


def check_devices(tensors, names, device: torch.device, lead: str | None, where: str) -> None:
    """Refuses a tensor on another device than ``device``, the call's.

    ``lead``: the argument that decided ``device``, or ``None`` for the parameters.
    """
    for t, name in zip(tensors, names, strict=True):
        if t.device != device:
            raise _errors.other_device(name, t.device, device, lead, where)


def numpy_dtypes(tensors, names, where: str) -> tuple:
    """The numpy dtype JAX sees for each tensor; refuses one JAX cannot hold."""
    try:
        return tuple(bridge.numpy_dtype(t.dtype, name=n)
                     for t, n in zip(tensors, names, strict=True))
    except TypeError as e:
        raise _errors.for_owner(e, where) from None


def jax_device_for(device: torch.device, name: str, where: str):
    """The JAX device a call on ``device`` runs on; the error names the owner and argument."""
    try:
        return bridge.jax_device(device, name=name)
    except ValueError as e:
        raise _errors.for_owner(e, where) from None


def explain_state_error(var_names, call, where: str) -> None:
    """Raises the error naming the argument, for a call that failed before its signature.

    A variable on another device than the call's, a dtype JAX cannot hold, or a device
    JAX shares no memory with; returns if none of those is the cause.
    """
    if call.variables and call.device.type == "meta":  # built under torch.device("meta")
        raise _errors.meta_variables(var_names[0], where)
    from torch.distributed.tensor import DTensor

    for name, v in zip(var_names, call.variables, strict=False):
        if isinstance(v, DTensor):  # sharded elsewhere: an unpickled sharded module
            raise _errors.dtensor_not_sharded(name, where)
        if v.device.type != "meta":  # a meta tensor's address is 0 too (checked below)
            try:
                check_memory(v, f"the variable '{name}'")
            except TypeError as e:
                raise _errors.for_owner(e, where) from None
    check_devices(call.variables, var_names, call.device, None, where)
    numpy_dtypes(call.variables, var_names, where)
    if call.variables:
        lead = var_names[0]
    elif call.arg_treedef is None:  # torch.compile: positional tensors
        lead = "args[0]"
    else:
        lead = next(n for n, s in zip(arg_names(call.arg_treedef), call.statics, strict=True)
                    if s is ARRAY)
    jax_device_for(call.device, lead, where)


def check_output_dtypes(program: Program, where: str) -> None:
    """Refuses, by output path, a result dtype torch has no match for."""
    tree = jtu.tree_unflatten(program.out_treedef, range(program.n_out))
    for path, k in jtu.tree_flatten_with_path(tree)[0]:
        dtype = program.out_specs[k].dtype
        try:
            bridge.torch_dtype(dtype)
        except TypeError:
            raise _errors.output_dtype(jtu.keystr(path), dtype, where) from None


def check_updates(program: Program, names, where: str) -> None:
    """The state a call writes back must fit the buffers it replaces."""
    targets = program.write_back.targets
    updates = program.out_specs[program.n_out :]
    internal_assert(len(targets) == len(updates),
                    f"{where} returns {len(updates)} state updates for {len(targets)} targets")
    for i, u in zip(targets, updates, strict=True):
        held = program.specs[i]
        if (u.shape, u.dtype) != (held.shape, held.dtype):
            raise _errors.update_mismatch(names[i], u, held, where)


def unhashable(leaves, treedef, where: str) -> TypeError:
    """The error for a static argument that is not hashable, naming it."""
    for name, leaf in zip(arg_names(treedef), leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            try:
                hash(leaf)
            except TypeError:
                return _errors.unhashable_static(name, leaf, where)
    return TypeError(f"{where}: an argument is not hashable.")
