"""Step 1 of NOTE [Call path]: a call resolved once, into a value every route starts from.

NOTE [Resolve]. What a call is depends on the owner's state and on torch's modes, not on
the route that runs it: the variables it reads (after their scopes' pre-hooks), the
tensors it passes (autocast's casts applied), the device it runs on, and the owner's mode.
``resolve`` reads all of that once and returns a ``Call``. The eager route
(``Caller.__call__``), the ``torch.compile`` route (``_compile.compiled_call``, in code
Dynamo traces, which is why this module only reads torch state and runs torch ops there)
and ``FlaxModule.memory_report`` all start from one, so a call under ``torch.autocast``
computes in the same dtypes eagerly and compiled. What depends on the compiled entry
(whether an RNG key is drawn, the held arrays) is step 2, ``Caller.prepare``.
"""

from __future__ import annotations

import functools as ft
import struct
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import torch
import torch.autograd.forward_ad as _fwAD

from flaxside.internal import ARRAY
from torchside import _errors

jtu = jax.tree_util

CPU = torch.device("cpu")
AUTOCAST_MODES = ("outputs", "inputs", "off")


class TensorMeta(NamedTuple):
    """A tensor's metadata, standing in for it where only that is known (a fake tensor's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def lead_device(variables, tensors) -> torch.device:
    """The device a call runs on: its first variable's, else its first tensor's, else the CPU.

    The tensors decide, never JAX's default device (NOTE [Devices] in docs/design.md);
    every other tensor must be on the same device (``_checks.check_devices``).
    """
    lead = variables[0] if variables else (tensors[0] if tensors else None)
    return CPU if lead is None else lead.device


class Call(NamedTuple):
    """One call, resolved (NOTE [Resolve]).

    Attributes:
        variables: the tensors the programs read for the owner's variables, in the owner's
            order (autocast copies of the parameters with ``autocast="inputs"``).
        tensors: the tensor leaves of the arguments, autocast's casts applied.
        arg_treedef: the structure of ``(args, kwargs)``; ``None`` under ``torch.compile``,
            whose calls take positional tensors only (``tensors`` is then ``args``).
        statics: per argument leaf, ``ARRAY`` or the key of a static value (``static_key``);
            ``None`` under ``torch.compile``.
        values: every argument leaf as given (only the static ones are read: they are
            baked into the programs); ``None`` under ``torch.compile``.
        mode: the owner's mode (train/eval; for NNX with the module graph).
        device: the device the call runs on (``lead_device``).
        out_dtype: the dtype floating outputs are cast to after the call
            (``autocast="outputs"`` under ``torch.autocast``), or ``None``.
    """

    variables: list
    tensors: list
    arg_treedef: Any
    statics: tuple | None
    values: list | None
    mode: Hashable
    device: torch.device
    out_dtype: torch.dtype | None

    def finish(self, outputs):
        """The outputs as the caller returns them: autocast's output cast applied."""
        return outputs if self.out_dtype is None else _cast_tree(outputs, self.out_dtype)


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


def arg_names(treedef) -> list[str]:
    """Readable names (``args[0]``, ``kwargs['mask']``) for each leaf of ``(args, kwargs)``."""
    tree = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    names = []
    for path, _ in jtu.tree_flatten_with_path(tree)[0]:
        head, rest = path[0].idx, path[1:]
        names.append(("args" if head == 0 else "kwargs") + jtu.keystr(rest))
    return names


@ft.cache
def positional(n: int):
    """The structure of ``(args, {})`` for ``n`` positional arguments (compiled calls)."""
    return jtu.tree_structure((tuple(range(n)), {}))


def resolve(variables: list, args: tuple, kwargs: dict, *, mode: Hashable, where: str,
            autocast: str = "off", is_param: tuple = (), sharded: bool = False) -> Call:
    """Resolves one call of an owner (NOTE [Resolve]).

    Args:
        variables: the owner's variable tensors, as the call reads them.
        args: the call's positional arguments (pytrees of tensors and static values).
        kwargs: its keyword arguments.
        mode: the owner's mode.
        where: the owner's name for messages.
        autocast: the owner's autocast behaviour (``AUTOCAST_MODES``; see ``FlaxModule``).
        is_param: per variable, whether it is a parameter (autocast casts those).
        sharded: the owner is sharded (NOTE [Sharded blocks]): its DTensor parameters are
            read as their local shards (``to_local()``, whose backward makes the local
            gradient a DTensor with the parameter's placements).

    Raises:
        TypeError: a static argument is unhashable; under ``torch.compile``, an argument
            that is not a positional tensor.
    """
    if sharded:
        from torch.distributed.tensor import DTensor

        if torch._C._are_functorch_transforms_active() or _fwAD._current_level >= 0:
            raise _errors.sharded_under_transform(where)

        variables = [v.to_local() if isinstance(v, DTensor) else v for v in variables]
    compiled = torch.compiler.is_compiling()
    if compiled:
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            raise _errors.compiled_arguments(where, len(args), len(kwargs))
        tensors, treedef, statics, values = list(args), None, None, None
    else:
        tensors, treedef, statics, values = _split_args(args, kwargs, where)
    device = lead_device(variables, tensors)
    cast = _autocast_dtype(device) if autocast != "off" else None
    out_dtype = None
    if cast is not None:
        if autocast == "inputs":
            variables = [_cast(v, cast) if p else v
                         for v, p in zip(variables, is_param, strict=True)]
            tensors = [_cast(t, cast) for t in tensors]
        else:  # "outputs": the block runs in its parameters' dtype, inputs included
            own = _compute_dtype(variables, is_param)
            if own is not None:
                tensors = [_cast(t, own) for t in tensors]
            out_dtype = cast
    return Call(variables, tensors, treedef, statics, values, mode, device, out_dtype)


def _split_args(args: tuple, kwargs: dict, where: str):
    """``(tensors, treedef, statics, values)`` of a call's arguments."""
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
        raise _unhashable(leaves, treedef, where) from None
    return tensors, treedef, statics, leaves


def _unhashable(leaves, treedef, where: str) -> TypeError:
    for name, leaf in zip(arg_names(treedef), leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            try:
                hash(leaf)
            except TypeError:
                return _errors.unhashable_static(name, leaf, where)
    return TypeError(f"{where}: an argument is not hashable.")


def _autocast_dtype(device: torch.device):
    # Only cpu and cuda can run a call (others are refused with the device error).
    if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def _compute_dtype(variables, is_param):
    """The dtype of the floating parameters (``None`` if they have several or none)."""
    dtypes = {v.dtype for v, p in zip(variables, is_param, strict=True)
              if p and v.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _cast(t, dtype):
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def _cast_tree(tree, dtype):
    if isinstance(tree, torch.Tensor):  # the common case, and traceable by Dynamo
        return _cast(tree, dtype)
    if type(tree) in (tuple, list):
        return type(tree)(_cast_tree(t, dtype) for t in tree)
    if type(tree) is dict:
        return {k: _cast_tree(v, dtype) for k, v in tree.items()}
    return jtu.tree_map(lambda t: _cast(t, dtype), tree,
                        is_leaf=lambda x: isinstance(x, torch.Tensor))
