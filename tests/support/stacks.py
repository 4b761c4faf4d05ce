"""What the ``remat_stack`` tests share: sizes, data, and unrolled references.

A stack's parameters carry leading axes that multiply to its depth (``(depth,)`` for one
level, ``lengths`` for nested ones); the references run the same blocks one by one in a
Python loop and differentiate that with ``jax.vjp``.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch

jtu = jax.tree_util
W, B = 8, 4  # width and batch of the stacks' blocks
LENGTHS = [None, (2, 4), (2, 2, 2)]  # None is one level, (8,)
LENGTH_IDS = ["one_level", "two_levels", "three_levels"]


def _torch(tree):
    return jtu.tree_map(lambda a: torch.from_numpy(np.array(a)), tree)


def assert_close(actual, expected, **kw):
    """``torch.testing.assert_close`` on trees of JAX or numpy arrays."""
    torch.testing.assert_close(_torch(actual), _torch(expected), **kw)


def flat_layers(stacked, depth: int):
    """Per-layer parameter trees from leaves whose leading axes multiply to ``depth``."""
    def flat(a):
        lead = next(k for k in range(a.ndim + 1) if math.prod(a.shape[:k]) == depth)
        return a.reshape((depth,) + a.shape[lead:])

    flat_tree = jtu.tree_map(flat, stacked)
    return [jtu.tree_map(lambda a, i=i: a[i], flat_tree) for i in range(depth)]


def unrolled_linen(block: nn.Module, depth: int):
    """``apply(params, x)``: ``block`` applied ``depth`` times, layer ``i`` with its params."""
    def apply(params, x):
        for p in flat_layers(params, depth):
            x = block.apply({"params": p}, x)
        return x

    return apply


def jit_vjp(fn):
    """``(params, x, ct) -> (fn(params, x), (grad params, grad x))``, jitted."""
    def vjp(p, x, ct):
        out, pull = jax.vjp(fn, p, x)
        return out, pull(ct)

    return jax.jit(vjp)


def data(dtype, seed=0):
    """An input and a cotangent of shape ``(B, W)``."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, W)), dtype)
    ct = jnp.asarray(rng.normal(size=(B, W)), dtype)
    return x, ct


def relayout(tree, lead):
    """Stacked leaves with leading axis ``(depth,)`` reshaped to leading axes ``lead``."""
    return jtu.tree_map(lambda a: a.reshape(tuple(lead) + a.shape[1:]), tree)
