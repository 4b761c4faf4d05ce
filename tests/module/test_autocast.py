"""bf16 activations into a float32 scan stack under ``torch.autocast`` (issue 15).

Under ``torch.autocast("cpu", torch.bfloat16)`` the torch layer before the block hands it
bf16 activations. With the default ``autocast="outputs"`` the block runs in its parameters'
dtype, inputs included: a scan whose carry is the residual stream would otherwise see a
bf16 carry in and a float32 carry out.
"""

import functools as ft

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.twins import ReadmeBlock, ReadmeDeep
from torchside import FlaxModule

WIDTH = 16


# The README's block under nn.scan without remat. Not twins.ScanStack: its block computes
# in an explicit float32, which would turn a bf16 carry into float32 whatever FlaxModule
# does; this one computes in the carry's dtype, as the README's does.
class Cell(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return ReadmeBlock(WIDTH)(carry), None


class ScanStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(name="scan")(x, None)[0]


def _j(t):
    return jnp.asarray(t.detach().float().numpy())


def _t(a):
    return torch.from_numpy(np.array(a))


@pytest.mark.parametrize("block", [ft.partial(ReadmeDeep, WIDTH), ScanStack],
                         ids=["remat_scan", "nn.scan"])
def test_bf16_activations_run_the_float32_stack_and_reach_every_gradient(block):
    trunk = FlaxModule(block(), example_args=(torch.zeros(2, WIDTH),))
    stem = torch.nn.Linear(8, WIDTH)
    x = torch.randn(6, 8)
    with torch.autocast("cpu", torch.bfloat16):
        h = stem(x)
        h.retain_grad()
        y = trunk(h)
    assert h.dtype == y.dtype == torch.bfloat16
    ct = torch.randn(6, WIDTH, dtype=torch.bfloat16)
    y.backward(ct)

    # The same float32 program, called on the bf16 activations cast to float32.
    with torch.no_grad():
        same_program = trunk(h.detach().float())
    torch.testing.assert_close(y.detach(), same_program.to(torch.bfloat16), rtol=0, atol=0)

    # Pure JAX: the float32 block, its VJP at those activations with the cotangent in float32.
    variables = jax.tree_util.tree_map(jnp.array, trunk.flax_variables())

    def f(params, x):
        return block().apply({"params": params}, x)

    out, vjp = jax.vjp(f, variables["params"], _j(h))
    g_params, g_h = vjp(_j(ct))
    torch.testing.assert_close(same_program, _t(out))
    torch.testing.assert_close(h.grad, _t(g_h).to(torch.bfloat16))
    flat = {"params." + ".".join(k.key for k in path): g
            for path, g in jax.tree_util.tree_flatten_with_path(g_params)[0]}
    assert set(flat) == {name for name, _ in trunk.named_parameters()}
    for name, p in trunk.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, _t(flat[name]), msg=lambda m, n=name: f"{n}: {m}")
    assert stem.weight.grad is not None and torch.isfinite(stem.weight.grad).all()
