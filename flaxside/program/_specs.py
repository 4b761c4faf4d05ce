"""The values that describe a program: its leaves and what its first trace learns.

``LeafSpec`` is one array leaf of a call; ``ResidualMap`` is how the backward rebuilds the
VJP the forward traced (see ``flaxside/README.md``); ``Learned`` carries what a trace learns
out of it as part of its result, and ``Carrying`` does so for an executable whose callers
want its arrays alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def spec_axes(entry) -> tuple:
    """The mesh axes of one ``PartitionSpec`` entry, as a tuple (``None``: none)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Shape, dtype and whether a gradient is wanted, for one array leaf of a call."""

    shape: tuple[int, ...]
    dtype: np.dtype
    diff: bool = False

    @property
    def aval(self) -> jax.ShapeDtypeStruct:
        """The abstract value JAX traces with."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype)


@jax.tree_util.register_static
class Learned:
    """A Python value a traced function returns next to its arrays, as JAX returns ``out_tree``.

    A pytree node with no leaves: the value travels in the output's tree structure, so
    ``jax.make_jaxpr(..., return_shape=True)``, ``Lowered.out_info``, ``lax.scan``'s stacked
    outputs and ``custom_vjp`` residuals all hand it back. What a trace learns (an output
    structure, a residual map, VJP labels) is thereby a result of that trace, never a
    variable a trace fills for another to read. ``value`` must be hashable: JAX compares
    tree structures.

    JAX's compile caches keep the output tree structures of what ``jax.jit`` lowered, and so
    this node, after its program is gone. ``take()`` hands the value over and leaves the node
    empty, so that those caches hold nothing of ours (a residual map holds the VJP's jaxpr).
    """

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def take(self):
        """The value, which this node then drops (it stays in JAX's caches, empty)."""
        value, self.value = self.value, None
        return value

    def __eq__(self, other):
        return (isinstance(other, Learned) and self._hash == other._hash
                and other.value == self.value)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"Learned({self.value!r})"


class Carrying:
    """A traced body's arrays, carrying what the trace learned in the output's structure.

    A pytree node whose children are the arrays and whose node data is the ``Learned``:
    ``Lowered.out_tree.node_data()`` hands the value back at lowering, while rebuilding
    the node gives a plain list of the arrays. So a compiled executable returns just the
    list, and its callers need no per-call wrapper to drop what the trace learned.
    """

    __slots__ = ("arrays", "learned")

    def __init__(self, arrays: list, learned: Learned):
        self.arrays, self.learned = arrays, learned

    @staticmethod
    def learned_by(lowered) -> Learned:
        """The ``Learned`` of a lowered body that returned a ``Carrying``."""
        return lowered.out_tree.node_data()[1]


jax.tree_util.register_pytree_node(
    Carrying, lambda c: (tuple(c.arrays), c.learned), lambda _learned, arrays: list(arrays))


def is_differentiable(dtype) -> bool:
    """Whether a dtype carries gradients (floating or complex)."""
    return jnp.issubdtype(dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class ResidualMap:
    """How the backward rebuilds the VJP that ``forward_with_residuals`` traced.

    Attributes:
        vjp_treedef: the treedef of the ``jax.vjp`` function object.
        sources: per VJP leaf, ``("in", i)`` (``saved_inputs[i]``), ``("out", i)``
            (``saved_outputs[i]``) or ``("res", i)`` (the i-th residual, unpacked).
        saved_inputs: indices of the input leaves the backward is passed again.
        saved_outputs: indices of the results the backward is passed again.
        key_impls: per unpacked residual, the PRNG implementation of a typed key that
            crosses as raw key data, else ``None``.
        pack: per unpacked residual, ``Alone`` or ``Packed`` (``_pack.py``): where it sits
            in what the forward returns.
        residual_specs: the residual buffers as they leave the forward (the shards this
            process receives, for a program over a mesh).
        offloaded: per residual buffer, whether an offloading policy put it in host
            memory (it reaches the backward as a plain array, like every other).
    """

    vjp_treedef: Any
    sources: tuple[tuple[str, int], ...]
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    key_impls: tuple
    pack: tuple
    residual_specs: tuple[LeafSpec, ...]
    offloaded: tuple[bool, ...]
