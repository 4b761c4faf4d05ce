"""How many times a cached call crosses between torch and JAX on the DLPack route.

The DLPack route (CUDA's, forced on the CPU here) packs every residual and every gradient
into one buffer per dtype (NOTE [Packing per route] in ``bridge/_exchange.py``), so a
cached forward+backward crosses a fixed number of times however many parameters the block
has: the fence of each run, the input, the cotangent and the input again for the backward,
the output, the residuals and the gradients. Each crossing is one of torch's own DLPack
conversions (``torch._C._to_dlpack``, ``_to_dlpack_versioned`` and ``_from_dlpack``,
which both the public calls and the lean path end in), counted here; a per-tensor crossing
(the gradients of 128 kernels leaving one by one) makes the count grow with the block.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from bridge import _dlpack, _exchange
from tests.support.closeness import close
from torchside import FlaxModule

WIDTH = 256  # a kernel of 256 x 256 float32 is 256 KiB, four times the CPU route's limit


class Kernels(nn.Module):
    """``n`` unrolled layers, each one kernel and no bias: ``n`` parameter tensors."""

    n: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.n):
            x = jnp.tanh(nn.Dense(WIDTH, use_bias=False)(x))
        return x


CONVERSIONS = ("_to_dlpack", "_to_dlpack_versioned", "_from_dlpack")


@pytest.fixture(params=[True, False], ids=["lean", "public"])
def dlpack_route(request, monkeypatch):
    """The forced DLPack route, on its lean path (NOTE [Lean crossing]) or the public one."""
    if request.param and not _dlpack.LEAN:
        pytest.skip("this jax release has no lean DLPack path (NOTE [Lean crossing])")
    monkeypatch.setattr(_dlpack, "LEAN", request.param)
    _exchange._exchange.cache_clear()  # an exchange made now takes the path chosen above
    previous = bridge.set_exchange_mode("dlpack")
    yield request.param
    bridge.set_exchange_mode(previous)
    _exchange._exchange.cache_clear()


def _crossings(n: int) -> tuple[int, FlaxModule, torch.Tensor, torch.Tensor]:
    torch.manual_seed(n)
    m = FlaxModule(Kernels(n), example_args=(torch.zeros(8, WIDTH),))
    assert len(list(m.parameters())) == n
    assert all(p.numel() * p.element_size() == 256 * 1024 for p in m.parameters())
    x = torch.randn(8, WIDTH, requires_grad=True)
    ct = torch.randn(8, WIDTH)

    def step():
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x).backward(ct)

    step()  # compiles; the call below is a cached one
    with pytest.MonkeyPatch.context() as mp:
        count = [0]
        for name in CONVERSIONS:
            original = getattr(torch._C, name)

            def counted(*args, original=original, **kwargs):
                count[0] += 1
                return original(*args, **kwargs)

            mp.setattr(torch._C, name, counted)
        step()
    return count[0], m, x, ct


def test_a_cached_call_crosses_as_often_with_16_kernels_as_with_128(dlpack_route):
    """Fails on any per-tensor crossing: 128 kernels' gradients crossing alone (the CPU
    route's 64 KiB limit on this route) make 128 more crossings than with none packed."""
    few, *_ = _crossings(16)
    many, m, x, ct = _crossings(128)
    assert few == many <= 8, (few, many)
    # And the call is right: each gradient against jax.vjp of the same Flax function.
    params = {"params": {name.split(".")[1]: {"kernel": jnp.asarray(p.detach().numpy())}
                         for name, p in m.named_parameters()}}
    _, vjp = jax.vjp(Kernels(128).apply, params, jnp.asarray(x.detach().numpy()))
    gv, gx = vjp(jnp.asarray(ct.numpy()))
    close(x.grad, np.asarray(gx), "x.grad")
    for name, p in m.named_parameters():
        close(p.grad, np.asarray(gv["params"][name.split(".")[1]]["kernel"]), f"{name}.grad")
