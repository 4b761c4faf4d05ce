"""Step 1 of NOTE [Call path] (``_call.py``): what a call is, read once, as one ``Call``.

NOTE [Resolve]. What a call is depends on the owner's state and on torch's modes, not on
the edge that runs it: the variables it reads (after their scopes' pre-hooks), the tensors
it passes (autocast's casts applied), the device it runs on, and the owner's mode.
``resolve`` reads all of that once. The eager edge, the ``torch.compile`` edge (in code
Dynamo traces, which is why ``resolve`` only reads torch state and runs torch ops there)
and ``FlaxModule.memory_report`` all start from one, so a call under ``torch.autocast``
computes in the same dtypes eagerly and compiled.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Hashable

import jax
import torch

from flaxside.internal import ARRAY
from torchside import _errors
from torchside.call import _checks
from torchside.call._autocast import cast, cast_tree, compute_dtype
from torchside.call._values import Call, positional

jtu = jax.tree_util

CPU = torch.device("cpu")


def lead_device(variables, tensors) -> torch.device:
    """The device a call runs on: its first variable's, else its first tensor's, else the CPU.

    The tensors decide, never JAX's default device (NOTE [Devices] in ``bridge/_devices.py``);
    every other tensor must be on the same device (``_checks.check_devices``).
    """
    lead = variables[0] if variables else (tensors[0] if tensors else None)
    return CPU if lead is None else lead.device


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


def resolve(variables: list, args: tuple, kwargs: dict, *, mode: Hashable, where: str,
            autocast: str = "off", is_param: tuple = (), compiling: bool | None = None) -> Call:
    """Resolves one call of an owner (NOTE [Resolve]).

    Args:
        variables: the owner's variable tensors, as the call reads them (a sharded owner's
            local shards: NOTE [Sharded blocks] in ``integrations/_shard.py``).
        args: the call's positional arguments (pytrees of tensors and static values).
        kwargs: its keyword arguments.
        mode: the owner's mode.
        where: the owner's name for messages.
        autocast: the owner's autocast behaviour (``AUTOCAST_MODES``; see ``FlaxModule``).
        is_param: per variable, whether it is a parameter (autocast casts those).
        compiling: whether Dynamo traces the call (``None``: asks torch).

    Raises:
        TypeError: a static argument is unhashable; under ``torch.compile``, an argument
            that is not a positional tensor.
    """
    if torch.compiler.is_compiling() if compiling is None else compiling:
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            raise _errors.compiled_arguments(where, len(args), len(kwargs))
        tensors, treedef, statics, values = list(args), None, None, None
    else:
        tensors, treedef, statics, values = _split_args(args, kwargs, where)
    # (lead_device and autocast's dtype written out: no Python call on this path)
    lead = variables[0] if variables else (tensors[0] if tensors else None)
    device = CPU if lead is None else lead.device
    # Only cpu and cuda can run a call (others are refused with the device error).
    to = (torch.get_autocast_dtype(device.type) if autocast != "off"
          and device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)
          else None)
    out_dtype = None
    if to is not None:
        if autocast == "inputs":
            variables = [cast(v, to) if p else v
                         for v, p in zip(variables, is_param, strict=True)]
            tensors = [cast(t, to) for t in tensors]
        else:  # "outputs": the block runs in its parameters' dtype, inputs included
            own = compute_dtype(variables, is_param)
            if own is not None:
                tensors = [cast(t, own) for t in tensors]
            out_dtype = to
    return Call(variables, tensors, treedef, statics, values, mode, device, out_dtype)


def finish(call: Call, outputs):
    """The outputs as the owner returns them: autocast's output cast applied."""
    return outputs if call.out_dtype is None else cast_tree(outputs, call.out_dtype)


def _split_args(args: tuple, kwargs: dict, where: str):
    """``(tensors, treedef, statics, values)`` of a call's arguments."""
    if not kwargs and all(map(isinstance, args, itertools.repeat(torch.Tensor))):
        # Positional tensors only, the common call: the structure flatten would give.
        n = len(args)
        return list(args), positional(n), (ARRAY,) * n, list(args)
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
        raise _checks.unhashable(leaves, treedef, where) from None
    return tensors, treedef, statics, leaves
