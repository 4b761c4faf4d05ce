"""Gradients reach each parameter as a view of the backward's packed buffer, never a copy.

Small gradients leave a program packed, one buffer per dtype, with gradients of one shape
side by side (``flaxside``'s ``pack_plan``); the torch side views a run of one shape with
one ``unbind``, and a buffer of mostly distinct shapes with one ``unflatten_dense_tensors``
(``GradientViews`` in ``torchside/call/_routes.py``). Each case is compared with ``jax.vjp`` of
the same Flax function under a random cotangent, and every packed gradient must share the
one buffer's memory (torch's ``AccumulateGrad`` took the view, no copy).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.closeness import close
from torchside import FlaxModule


class SameShapes(nn.Module):
    """Twelve layers of one shape: runs of twelve kernels and twelve biases (``unbind``)."""

    @nn.compact
    def __call__(self, x):
        for _ in range(12):
            x = jnp.tanh(nn.Dense(16)(x))
        return x


class MixedShapes(nn.Module):
    """Layers of distinct shapes and a scalar: mostly runs of one (``unflatten``)."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, ())
        for width in (24, 8, 16, 4, 16):
            x = jnp.tanh(nn.Dense(width)(x))
        return x * scale


@pytest.mark.parametrize("block", [SameShapes, MixedShapes], ids=["unbind", "unflatten"])
def test_packed_gradients_are_views_of_one_buffer_and_equal_jax(block):
    torch.manual_seed(0)
    m = FlaxModule(block(), example_args=(torch.zeros(5, 16),))
    x = torch.randn(5, 16, requires_grad=True)
    y = m(x)
    ct = torch.randn(y.shape)
    for _ in range(2):  # the second call: cached, on the held arrays' fast path
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(ct)
    names = [n for n, _ in m.named_parameters()]
    values = [jnp.asarray(p.detach().numpy()) for p in m.parameters()]

    def apply(leaves, a):
        return block().apply(_variables(m, names, leaves), a)

    _, vjp = jax.vjp(apply, values, jnp.asarray(x.detach().numpy()))
    grads, gx = vjp(jnp.asarray(ct.numpy()))
    close(x.grad, np.asarray(gx), "x.grad")
    for name, p, g in zip(names, m.parameters(), grads, strict=True):
        close(p.grad, np.asarray(g), f"{name}.grad")
    storages = {p.grad.untyped_storage().data_ptr() for p in m.parameters()}
    assert len(storages) == 1, "each gradient should be a view of the one packed buffer"


def _variables(m, names, leaves) -> dict:
    tree: dict = {}
    for name, leaf in zip(names, leaves, strict=True):
        node = tree
        *path, last = name.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree
