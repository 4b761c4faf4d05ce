"""torch.compile(fullgraph=True) of torch models that contain a FlaxModule."""

import flax.linen as nn
import pytest
import torch
from flax import nnx

from tests.support.twins import ReadmeDeep, RematScanStack
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


@pytest.mark.parametrize("autocast", ["outputs", "inputs"])
def test_autocast_gives_the_same_dtypes_and_values_eagerly_and_compiled(autocast):
    """One resolve step for both routes: under torch.autocast a compiled call casts as the
    eager one does (before, the compiled route skipped autocast and returned float32)."""
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    eager = FlaxModule(ReadmeDeep(width=8), example_args=(x,), autocast=autocast)
    twin = FlaxModule(ReadmeDeep(width=8), example_args=(x,), autocast=autocast)
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, fullgraph=True)
    ct = torch.randn(4, 8)
    results = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        (y.float() * ct).sum().backward()
        results.append([y, xi.grad, *(p.grad for p in (eager if m is eager else twin)
                                      .parameters())])
    (y_eager, *g_eager), (y_compiled, *g_compiled) = results
    assert y_eager.dtype == y_compiled.dtype == torch.bfloat16
    for a, b in zip([y_eager, *g_eager], [y_compiled, *g_compiled], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # the same XLA programs


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
        self.fc2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.tanh(self.bn(self.fc1(x))))


def test_nnx_module_compiles_fullgraph_like_eager():
    """An NNX module's mode carries its graph, which the ops take as an int key."""
    torch._dynamo.reset()
    eager = FlaxModule(_NnxMLP(nnx.Rngs(0)))
    twin = FlaxModule(_NnxMLP(nnx.Rngs(0)))
    compiled = torch.compile(twin, fullgraph=True)
    for _ in range(2):
        x, ct = torch.randn(6, 5), torch.randn(6, 3)
        outs = []
        for m, owner in ((eager, eager), (compiled, twin)):
            owner.zero_grad()
            xi = x.clone().requires_grad_()
            y = m(xi)
            (y * ct).sum().backward()
            outs.append([y.detach(), xi.grad, *(p.grad for p in owner.parameters())])
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(b, a)
        torch.testing.assert_close(twin.bn.mean, eager.bn.mean)  # train-mode write-back
    eager.eval()
    twin.eval()
    x = torch.randn(6, 5)
    torch.testing.assert_close(compiled(x), eager(x))
    torch._dynamo.reset()  # its caches would keep the module and its graphs alive


def test_jax_function_compiles_fullgraph_like_eager():
    torch._dynamo.reset()
    import jax.numpy as jnp

    from torchside import jax_function

    f = jax_function(lambda x, w: jnp.tanh(x @ w))
    compiled = torch.compile(lambda x, w: f(x, w) * 2, fullgraph=True)
    x, w, ct = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    outs = []
    for fn in (lambda x, w: f(x, w) * 2, compiled):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        (y * ct).sum().backward()
        outs.append([y.detach(), xi.grad, wi.grad])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a)
