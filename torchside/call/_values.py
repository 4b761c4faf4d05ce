"""The call as values: what a call is, and what an owner fixes.

Every step of NOTE [Call path] (``_call.py``) passes these values on instead of working
them out again: ``Call`` (a call, resolved), ``Signature`` (what its compiled programs
depend on) and ``Settings`` (what an owner fixes); what a signature fixes (its
``Layout``, ``Route``s and ``Holds``) is ``_routes.py``'s. Nothing here runs on a call's
path but their construction.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import torch

from flaxside.internal import WriteBack

jtu = jax.tree_util

AUTOCAST_MODES = ("outputs", "inputs", "off")


# -- what an owner fixes, and what a call is --------------------------------------------------
class Edges(NamedTuple):
    """The edges above the first-order pipeline, handed to every ``Caller`` by its owner.

    The first-order files never import them: they call up through this value
    (``torchside.edges._edges.EDGES``).

    Attributes:
        compiled: ``compiled(caller, call, write_back) -> outputs``: a call Dynamo traces
            (``edges/_compile.py``).
        transformed: ``transformed(caller, call, write_back) -> (entry, results)``: a call
            under a ``torch.func`` transform or forward-mode AD (``edges/_higher.py``).
        differentiate: ``differentiate(ctx, entry, route, saved, cots) -> per-leaf
            gradients``: a backward torch differentiates again (``edges/_higher.py``).
    """

    compiled: Callable
    transformed: Callable
    differentiate: Callable


class Settings(NamedTuple):
    """What an owner fixes once, at construction.

    Attributes:
        where: the owner's name for messages (``FlaxModule(Block)``).
        state_treedef: treedef of ``(variables, raw rng keys or None)``; its leaves are the
            variable tensors, then the rng leaf.
        var_names: a name per variable leaf (``params.Dense_0.kernel``).
        make_apply: ``make_apply(mode) -> apply``; ``apply(state, *args, **kwargs)``
            returns ``(outputs, updates, flaxside.internal.WriteBack)``.
        rng_shape: shape of the int32 raw key data drawn per call from torch's generator,
            or ``None`` without RNG streams.
        order: 1 for an owner's calls; k + 1 for the backward of an order-k call (a call
            derived from it: NOTE [Higher order]).
    """

    where: str
    state_treedef: Any
    var_names: tuple[str, ...]
    make_apply: Callable
    rng_shape: tuple[int, ...] | None = None
    order: int = 1

    def split_leaves(self, leaves) -> tuple[list, list]:
        """``(variables, arguments)`` of an owner's leaves without an RNG slot.

        A ``torch.compile`` op's leaves, before the entry (and its ``Layout``) is known.
        """
        n = len(self.var_names)
        return list(leaves[:n]), list(leaves[n:])


class TensorMeta(NamedTuple):
    """A tensor's metadata, standing in for it where only that is known (a fake tensor's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class Call(NamedTuple):
    """One call, resolved (NOTE [Resolve] in ``_resolve.py``).

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
        device: the device the call runs on (``lead_device`` in ``_call.py``).
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


class TensorKey(NamedTuple):
    """One tensor as a signature sees it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool


class Signature(NamedTuple):
    """Everything an entry depends on; calls with equal signatures share one.

    Attributes:
        arg_treedef: the structure of the call's ``(args, kwargs)``.
        statics: per argument leaf, ``ARRAY`` or the key of a static value.
        tensors: per tensor argument, its ``TensorKey``.
        variables: the variables' ``TensorKey`` each, as a ``VarKey`` (``_call.py``).
        mode: the owner's mode (train/eval, the NNX graph).
        x64: whether JAX runs with 64-bit types.
        exchange: how tensors cross (``bridge.internal.exchange_for``: device and route).
    """

    arg_treedef: Any
    statics: tuple
    tensors: tuple[TensorKey, ...]
    variables: int
    mode: Hashable
    x64: bool
    exchange: Any


class _Apply:
    """A function of arrays in an owner's apply contract: no state, no updates.

    Picklable when ``fn`` is.
    """

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, _mode):
        return self.apply

    def apply(self, _state, *args, **kwargs):
        return self.fn(*args, **kwargs), [], WriteBack()


_NO_STATE = jtu.tree_structure(((), None))


def function_settings(where: str, fn: Callable, order: int = 1) -> Settings:
    """The ``Settings`` of an owner of a plain JAX function (no variables, no RNG)."""
    return Settings(where, _NO_STATE, (), _Apply(fn), None, order)


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
