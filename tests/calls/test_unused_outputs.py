"""Backward when torch gives no gradient for some outputs (materialize_grads is off).

Parameters that only an unused output depends on get ``None``, as torch gives a torch
twin's; the others get JAX's gradient with a zero cotangent for the unused output.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchside import FlaxModule


class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(6)(x))
        return nn.Dense(3)(h), nn.Dense(2)(h)


@pytest.mark.parametrize(
    "used", [(True, False), (False, True), (True, True)], ids=["first", "second", "both"]
)
def test_unused_output_gets_zero_cotangent_and_its_own_parameters_none(used):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((4, 5), dtype=np.float32)
    module = TwoHeads()
    variables = module.init(jax.random.key(0), jnp.asarray(x_np))
    layer = FlaxModule(module, variables=variables)
    x = torch.from_numpy(x_np.copy()).requires_grad_()
    cots = [rng.standard_normal(s, dtype=np.float32) for s in ((4, 3), (4, 2))]

    outs = layer(x)
    loss = sum(
        (o * torch.from_numpy(c)).sum() for o, c, u in zip(outs, cots, used, strict=True) if u
    )
    loss.backward()

    _, vjp = jax.vjp(lambda v, x: module.apply(v, x), variables, jnp.asarray(x_np))
    ref_cots = tuple(
        jnp.asarray(c) if u else jnp.zeros_like(c) for c, u in zip(cots, used, strict=True)
    )
    ref_vars, ref_x = vjp(ref_cots)
    torch.testing.assert_close(x.grad, torch.from_numpy(np.array(ref_x)))
    ref = dict(jax.tree_util.tree_flatten_with_path(ref_vars)[0])
    head_of = {"Dense_1": 0, "Dense_2": 1}  # Dense_0 feeds both heads
    for path, value in ref.items():
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        grad = layer.get_parameter(name).grad
        head = head_of.get(name.split(".")[1])
        if head is not None and not used[head]:
            assert grad is None, name
        else:
            torch.testing.assert_close(grad, torch.from_numpy(np.array(value)), msg=name)
