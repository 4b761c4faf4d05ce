"""torch.compile(fullgraph=True) of torch models that contain a FlaxModule."""

import flax.linen as nn
import pytest
import torch

from tests.support.twins import RematScanStack
from torchside import FlaxModule


def _run(model, x, ct):
    model.zero_grad()
    xi = x.clone().requires_grad_()
    y = model(xi)
    (y * ct).sum().backward()
    return [y.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_fullgraph_compile_matches_eager(residuals):
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    flax = FlaxModule(RematScanStack(8, (2, 2)), example_args=(x,), residuals=residuals)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), flax, torch.nn.Tanh(),
                                torch.nn.Linear(8, 2))
    ct = torch.randn(4, 2)
    eager = _run(model, x, ct)
    compiled = torch.compile(model, fullgraph=True)
    for a, b in zip(eager, _run(compiled, x, ct), strict=True):
        torch.testing.assert_close(b, a)
    # a second batch size recompiles (shapes are specialized) and stays correct
    x6, ct6 = torch.randn(6, 8), torch.randn(6, 2)
    for a, b in zip(_run(model, x6, ct6), _run(compiled, x6, ct6), strict=True):
        torch.testing.assert_close(b, a)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


class BNHead(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(6)(x))
        return {"y": nn.relu(h), "n": jnp_sum_positive(h)}


def jnp_sum_positive(h):
    import jax.numpy as jnp

    return jnp.sum(h > 0).astype(jnp.int32)


def test_compiled_train_mode_updates_buffers_like_eager():
    torch._dynamo.reset()
    x = torch.randn(8, 5)
    eager = FlaxModule(BNHead(), example_args=(x,), train_kwarg="train")
    twin = FlaxModule(BNHead(), example_args=(x,), train_kwarg="train")
    compiled = torch.compile(twin, fullgraph=True)
    for _ in range(2):
        xb = torch.randn(8, 5)
        a, b = eager(xb), compiled(xb)
        torch.testing.assert_close(b["y"], a["y"])
        assert torch.equal(b["n"], a["n"]) and b["n"].dtype == torch.int32
    torch.testing.assert_close(twin.batch_stats.BatchNorm_0.mean,
                               eager.batch_stats.BatchNorm_0.mean)
    eager.eval()
    twin.eval()
    xb = torch.randn(8, 5)
    torch.testing.assert_close(compiled(xb)["y"], eager(xb)["y"])


def test_compile_path_rejects_static_arguments_clearly():
    torch._dynamo.reset()
    x = torch.randn(2, 5)
    m = FlaxModule(BNHead(), example_args=(x,), train_kwarg="train")
    with pytest.raises(Exception, match="positional arguments only"):
        torch.compile(m, fullgraph=True)(x, train=True)
