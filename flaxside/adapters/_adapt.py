"""Linen and NNX modules seen the same way: named leaves, an apply per mode, state updates.

An adapter turns a Flax module into what the torch side needs and nothing torch-specific:

* ``names`` / ``is_param``: one dotted Flax path and kind per variable leaf, in a fixed
  order, and ``take_initial_values()``: their values once, to hand to their new owner;
* ``treedef``: how those leaves rebuild the module's state;
* ``make_apply(mode)``: ``apply(state, *args, **kwargs) -> (outputs, updates, WriteBack)``
  with ``state = (variable leaves tree, raw key data or None)``; ``updates`` are the new
  values of the leaves at ``WriteBack.targets`` (learned by each trace: an NNX forward may
  assign a Param). ``mode`` is ``training`` for Linen and ``(training, graph)`` for NNX.

Typed PRNG keys (RNG streams, key-typed state) cross as raw key data so that torch can
hold, save and draw them, and unsigned 16/32/64-bit state as the signed dtype of its width
(``Leaves`` in ``program/_codecs.py``); both are restored, bit for bit, inside the program.
"""

from __future__ import annotations

from flax import linen as nn
from flax import nnx

from flaxside.adapters._linen import LinenAdapter
from flaxside.adapters._nnx import NNXAdapter


def adapter_for(module, variables=None, *, where: str = "FlaxModule", **options):
    """The adapter for a Linen or NNX module.

    Raises:
        TypeError: ``module`` is neither.
    """
    if isinstance(module, nnx.Module):
        if variables is not None:
            raise ValueError(f"{where}: variables= is for Linen modules; an NNX module "
                             f"carries its own state. Load weights into it before wrapping.")
        return NNXAdapter(module, where=where, **options)
    if isinstance(module, nn.Module):
        return LinenAdapter(module, variables, where=where, **options)
    raise TypeError(
        f"{where}: module must be a flax.linen.Module or a flax.nnx.Module, got "
        f"{type(module).__name__}. Wrap a plain JAX function with torchside.jax_function."
    )


def is_nnx_module(module) -> bool:
    """Whether ``module`` is an NNX module (an instance, not a factory)."""
    return isinstance(module, nnx.Module)


def is_nnx_factory(module) -> bool:
    """Whether ``module`` is an NNX factory: a callable that is not a Flax module."""
    return callable(module) and not isinstance(module, nn.Module | nnx.Module)
