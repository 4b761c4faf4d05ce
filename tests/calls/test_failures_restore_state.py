"""Failures inside JAX leave the module usable and its state untouched.

An exception while tracing (at build, forward or backward), an error raised while XLA
runs (forward or backward) and an allocation XLA refuses: afterwards the parameters,
buffers and gradients are as before the call, and the next step matches ``jax.vjp``.
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchside import FlaxModule


def _t(a):
    return torch.from_numpy(np.array(a))


def _j(t):
    return jnp.asarray(t.detach().numpy())


def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _assert_untouched(m, before):
    after = m.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert all(p.grad is None for p in m.parameters())


class Switch:
    """A failure the test turns on and off: at trace time or at run time."""

    def __init__(self):
        self.fail_at_trace = None  # the trace number (1-based) that raises
        self.traces = 0
        self.fail_at_run = False

    def trace(self):
        self.traces += 1
        if self.traces == self.fail_at_trace:
            raise RuntimeError(f"tracing failed on purpose (trace {self.traces})")

    def run(self, x):
        def callback(v):
            if self.fail_at_run:
                raise ValueError("failed on purpose while running")
            return v

        return jax.pure_callback(callback, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


SWITCH = Switch()


class Net(nn.Module):
    """Dense, BatchNorm (buffers updated in train mode), a run-time guard in the backward."""

    @nn.compact
    def __call__(self, x, *, expand=0, train=True):
        SWITCH.trace()
        h = nn.Dense(6)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)
        h = guarded(jnp.tanh(h))
        h = h + SWITCH.run(jax.lax.stop_gradient(h)) * 0.0  # a run-time failure point
        y = nn.Dense(3)(h)
        if expand:  # a static size: an output too large to allocate
            return y, jnp.broadcast_to(y.sum(), (expand,))
        return y


@jax.custom_vjp
def guarded(x):
    return x


def _guarded_fwd(x):
    return x, None


def _guarded_bwd(_, g):
    return (SWITCH.run(g),)  # fails in the backward when fail_at_run is set


guarded.defvjp(_guarded_fwd, _guarded_bwd)


@pytest.fixture
def switch():
    SWITCH.__init__()
    yield SWITCH
    SWITCH.__init__()


def _net(residuals="save"):
    return FlaxModule(Net(), example_args=(torch.zeros(4, 5),), train_kwarg="train",
                      residuals=residuals)


def _reference_step(m, x, ct):
    """Output, input grad and parameter grads of one train-mode step, by jax.vjp."""
    variables = m.flax_variables()

    def f(params, x):
        out, _ = Net().apply({**variables, "params": params}, x, train=True,
                             mutable=["batch_stats"])
        return out

    y, vjp = jax.vjp(f, variables["params"], _j(x))
    gp, gx = vjp(_j(ct))
    return _t(y), _t(gx), [_t(g) for g in jax.tree_util.tree_leaves(gp)]


def _check_next_step_works(m, x, ct):
    y_ref, gx_ref, gp_ref = _reference_step(m, x, ct)
    xi = x.clone().requires_grad_()
    y = m(xi)
    y.backward(ct)
    torch.testing.assert_close(y.detach(), y_ref)
    torch.testing.assert_close(xi.grad, gx_ref)
    for p, g in zip(m.parameters(), gp_ref, strict=True):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize(
    ("residuals", "fail_at", "during"),
    [("save", 1, "build"), ("save", 2, "forward"), ("recompute", 3, "backward")],
    ids=["build-trace", "forward-trace", "backward-trace-recompute"],
)
def test_exception_while_tracing_leaves_module_usable(switch, residuals, fail_at, during):
    m = _net(residuals)
    before = _snapshot(m)
    switch.traces = 0
    switch.fail_at_trace = fail_at
    x, ct = torch.randn(4, 5, requires_grad=True), torch.randn(4, 3)
    if during == "backward":
        y = m(x)
        before = _snapshot(m)  # the forward moved the batch statistics, as in JAX
        with pytest.raises(RuntimeError, match="tracing failed on purpose"):
            y.backward(ct)
    else:
        with pytest.raises(RuntimeError, match="tracing failed on purpose"):
            m(x)
    assert switch.traces >= fail_at
    _assert_untouched(m, before)
    assert x.grad is None
    _check_next_step_works(m, torch.randn(4, 5), torch.randn(4, 3))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_runtime_error_inside_xla_leaves_module_usable(switch, where):
    m = _net()
    m(torch.randn(4, 5)).backward(torch.randn(4, 3))  # compiled and traced already
    m.zero_grad(set_to_none=True)
    before = _snapshot(m)
    x, ct = torch.randn(4, 5, requires_grad=True), torch.randn(4, 3)
    if where == "forward":
        switch.fail_at_run = True
        with pytest.raises(Exception, match="failed on purpose while running"):
            m(x)
    else:
        y = m(x)
        before = _snapshot(m)  # the forward updated batch statistics, as in JAX
        switch.fail_at_run = True
        with pytest.raises(Exception, match="failed on purpose while running"):
            y.backward(ct)
    _assert_untouched(m, before)
    assert x.grad is None
    switch.fail_at_run = False
    _check_next_step_works(m, torch.randn(4, 5), torch.randn(4, 3))


def _overcommit_refuses_huge_allocations() -> bool:
    try:
        return pathlib.Path("/proc/sys/vm/overcommit_memory").read_text().strip() in ("0", "2")
    except OSError:
        return False


@pytest.mark.skipif(not _overcommit_refuses_huge_allocations(), reason=(
    "needs Linux overcommit mode 0 or 2, where a 4 TiB allocation fails at once; under "
    "mode 1 it could succeed and be written to"))
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_out_of_memory_leaves_module_usable(switch, grad):
    m = _net()
    before = _snapshot(m)
    x = torch.randn(4, 5, requires_grad=True)
    with torch.set_grad_enabled(grad), pytest.raises(jax.errors.JaxRuntimeError,
                                                     match="RESOURCE_EXHAUSTED"):
        m(x, expand=2**40)  # 4 TiB of float32
    _assert_untouched(m, before)
    _check_next_step_works(m, torch.randn(4, 5), torch.randn(4, 3))
