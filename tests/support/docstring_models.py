"""Models from Flax's and ``jax.checkpoint``'s docstrings that more than one test file runs.

The corpus (``tests/corpus/``) reproduces each docstring example next to its test; the ones
here are also used elsewhere, so they live once, in our own code.
"""

import functools as ft

import jax
import jax.numpy as jnp
from flax import nnx


# jax.checkpoint docstring (and brainstate.transform.checkpoint's copy of it):
# recursive_checkpoint, a binary tree of checkpoints, over tanh layers.
def recursive_checkpoint(funs, checkpoint):
    """``funs`` composed as ``f1(f2(x))``, halved recursively, each right half under
    ``checkpoint`` (``jax.checkpoint``, or a library's own)."""
    if len(funs) == 1:
        return funs[0]
    if len(funs) == 2:
        f1, f2 = funs
        return lambda x: f1(f2(x))
    f1 = recursive_checkpoint(funs[: len(funs) // 2], checkpoint)
    f2 = recursive_checkpoint(funs[len(funs) // 2:], checkpoint)
    return lambda x: f1(checkpoint(f2)(x))


def _layer(w, x):
    return jnp.tanh(x @ w)


def deep_checkpointed(checkpoint):
    """``deep(x, ws)``: one tanh layer per weight, composed by ``recursive_checkpoint``."""
    def deep(x, ws):
        return recursive_checkpoint([ft.partial(_layer, w) for w in ws], checkpoint)(x)

    return deep


def deep_plain(x, ws):
    """``deep_checkpointed``'s math without checkpoints, its reference."""
    for w in reversed(ws):  # recursive_checkpoint composes f1(f2(x)): the last runs first
        x = _layer(w, x)
    return x


# flax.nnx.scan docstring: Block (Linear + Dropout) stacked with split_rngs + vmap, then
# applied with nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry).
class Block(nnx.Module):
    def __init__(self, input_dim, features, *, rngs):
        self.linear = nnx.Linear(input_dim, features, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.dropout(self.linear(x)))


class Model(nnx.Module):
    """``num_layers`` ``Block``s with stacked stream keys, applied by ``nnx.scan``."""

    def __init__(self, num_layers, features, scan_kwargs=(), *, rngs):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return Block(features, features, rngs=rngs)

        self.blocks = create_block(rngs)
        self.scan_kwargs = dict(scan_kwargs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **self.scan_kwargs)
        def forward(x, model):
            return model(x)

        return forward(x, self.blocks)
