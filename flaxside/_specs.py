"""The values that describe a program: its leaves and what its first trace learns.

``LeafSpec`` is one array leaf of a call; ``ResidualMap`` is how the backward rebuilds the
VJP the forward traced (see ``flaxside/README.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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
        pack: per unpacked residual, ``("alone", buffer)`` or ``("packed", buffer,
            offset, shape)``: where it sits in what the forward returns.
        residual_specs: the residual buffers as they leave the forward.
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
