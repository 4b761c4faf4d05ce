"""Hostile autograd use: backward twice, double backward, aliasing, NaN/Inf, anomaly mode.

Already covered elsewhere (not repeated here): an in-place write to a parameter under
no_grad between forward and backward (test_module.py::
test_saved_tensor_hooks_see_residuals_and_inplace_write_is_caught), an output that is an
input unchanged never aliases it (test_module.py::test_output_never_aliases_input).
"""

import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.support import pipeline
from tests.support.twins import ResidualMLPBlock
from torchside import FlaxModule, jax_function

MODES = pytest.mark.parametrize("residuals", ["save", "recompute"])


def _t(a):
    return torch.from_numpy(np.array(a))


def _j(t):
    return jnp.asarray(t.detach().numpy())


def _block(**kwargs):
    return FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),), **kwargs)


def _params(m):
    return [p for _, p in m.named_parameters()]


# -- backward twice and double backward -------------------------------------------------


@MODES
def test_backward_twice_gives_torchs_error_and_retain_graph_accumulates(residuals):
    m = _block(residuals=residuals)
    x = torch.randn(3, 8, requires_grad=True)
    ct = torch.randn(3, 8)
    y = m(x)
    y.backward(ct, retain_graph=True)
    once = [x.grad.clone()] + [p.grad.clone() for p in _params(m)]
    y.backward(ct)
    for a, b in zip(once, [x.grad] + [p.grad for p in _params(m)], strict=True):
        torch.testing.assert_close(b, 2 * a)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(ct)


@MODES
@pytest.mark.parametrize("wrt", ["input", "parameters"])
def test_create_graph_raises_instead_of_a_silent_zero_second_derivative(residuals, wrt):
    """torch's once_differentiable returns plain tensors when the cotangent needs no grad:
    a gradient penalty on them would add nothing to the loss's gradient, silently."""
    m = _block(residuals=residuals)
    x = torch.randn(4, 8, requires_grad=True)
    ct = torch.randn(4, 8)
    y = m(x)
    with pytest.raises(NotImplementedError, match=r"FlaxModule\(ResidualMLPBlock\): backward "
                       r"with create_graph=True.*not implemented.*jax\.grad"):
        torch.autograd.grad(y, [x] if wrt == "input" else _params(m), ct, create_graph=True)
    # The refusal leaves the graph and the module usable: a plain backward is right.
    y.backward(ct)
    _, vjp = jax.vjp(ResidualMLPBlock(8).apply, m.flax_variables(), _j(x))
    gv, gx = vjp(_j(ct))
    torch.testing.assert_close(x.grad, _t(gx))
    for p, g in zip(_params(m), jax.tree_util.tree_leaves(gv), strict=True):
        torch.testing.assert_close(p.grad, _t(g))


def test_create_graph_with_a_cotangent_that_requires_grad_raises():
    f = jax_function(lambda x, w: jnp.tanh(x @ w))
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    ct = torch.randn(3, 2, requires_grad=True)  # the double-backward trick for a JVP
    with pytest.raises(NotImplementedError, match=r"jax_function\(<lambda>\): backward with"):
        torch.autograd.grad(f(x, w), x, ct, create_graph=True)
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.functional.jvp(lambda x: f(x, w), x, torch.randn(3, 4))


def test_torch_func_transforms_are_refused_clearly():
    f = jax_function(jnp.sin)
    with pytest.raises(NotImplementedError, match=r"torch\.func transform.*jax\.vmap"):
        torch.func.vmap(f)(torch.ones(3, 2))
    with pytest.raises(NotImplementedError, match=r"torch\.func transform"):
        torch.func.grad(lambda t: f(t).sum())(torch.ones(3))
    torch.testing.assert_close(f(torch.ones(3)), torch.sin(torch.ones(3)))  # still usable


# -- aliasing: in-place writes between forward and backward -----------------------------


@MODES
def test_inplace_write_to_an_output_the_backward_needs_raises(residuals):
    f = jax_function(jnp.tanh, residuals=residuals)
    x = torch.randn(5, requires_grad=True)
    y = f(x)
    if residuals == "save":
        assert pipeline.residual_map(f).saved_outputs == (0,)  # tanh' uses y
    y.mul_(2.0)
    if residuals == "save":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(torch.randn(5))
    else:  # recompute keeps only the inputs: the gradient is still right
        ct = torch.randn(5)
        y.backward(ct)
        torch.testing.assert_close(x.grad, 2 * ct * (1 - torch.tanh(x.detach()) ** 2))


def test_inplace_write_to_an_output_the_backward_does_not_need_keeps_gradients_right():
    m = _block()
    x = torch.randn(3, 8, requires_grad=True)
    ct = torch.randn(3, 8)
    y = m(x)
    assert pipeline.residual_map(m).saved_outputs == ()
    y.mul_(3.0)
    y.backward(ct)
    _, vjp = jax.vjp(ResidualMLPBlock(8).apply, m.flax_variables(), _j(x))
    torch.testing.assert_close(x.grad, _t(vjp(_j(3.0 * ct))[1]))


@MODES
@pytest.mark.parametrize("x_grad", [False, True], ids=["input-no-grad", "input-grad"])
def test_inplace_write_to_an_input_the_backward_needs_raises(residuals, x_grad):
    f = jax_function(lambda x, w: x @ w, residuals=residuals)
    w = torch.randn(4, 2, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=x_grad)
    x_used = x * 1.0 if x_grad else x  # a leaf that requires grad refuses in-place writes
    y = f(x_used, w)
    x_used.add_(1.0)  # the gradient of w is x^T ct: this would change it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.randn(3, 2))


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
        lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    ],
    ids=["sgd-for-loop", "sgd-foreach", "adamw-foreach"],
)
def test_optimizer_step_between_forward_and_backward_raises(make_opt):
    m = _block()
    opt = make_opt(m.parameters())
    x = torch.randn(3, 8, requires_grad=True)
    m(x).backward(torch.randn(3, 8))
    y = m(x)
    opt.step()  # the second Dense's kernel is saved: the first layer's gradient needs it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.randn(3, 8))


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception, reason=(
    "torch's fused optimizers (fused=True) update parameters without bumping their version "
    "counters (torch 2.13), so torch's own modules miss this too; no cheap check exists"))
def test_fused_optimizer_step_between_forward_and_backward_is_not_detected():
    m = _block()
    opt = torch.optim.Adam(m.parameters(), lr=0.1, fused=True)
    x = torch.randn(3, 8, requires_grad=True)
    m(x).backward(torch.randn(3, 8))
    y = m(x)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.randn(3, 8))


def test_outputs_are_fresh_memory_every_call():
    """Constants and a value returned twice: writing to one output changes nothing else."""
    f = jax_function(lambda x: (x * 2.0, jnp.ones(3), jnp.sin(x), jnp.sin(x)))
    x = torch.randn(3)
    first = f(x)
    for out in first:
        out.add_(100.0)
    second = f(x)
    torch.testing.assert_close(second[1], torch.ones(3))
    torch.testing.assert_close(second[2], torch.sin(x))
    assert second[2].data_ptr() != second[3].data_ptr()
    assert len({t.data_ptr() for t in first + second}) == 8


@MODES
def test_same_tensor_passed_twice_sums_both_gradients(residuals):
    f = jax_function(lambda a, b: a * jnp.sin(b), residuals=residuals)
    x = torch.randn(5, requires_grad=True)
    ct = torch.randn(5)
    f(x, x).backward(ct)
    xd = x.detach()
    torch.testing.assert_close(x.grad, ct * (torch.sin(xd) + xd * torch.cos(xd)))


# -- NaN and Inf ------------------------------------------------------------------------


def _nasty(x, w):
    return jnp.log(x) * w, w / x, jnp.sum(jnp.exp(w))


SPECIALS = [0.0, -1.0, np.inf, -np.inf, np.nan, 2.0, 1e-30, 3.0]


@MODES
def test_nan_and_inf_propagate_exactly_as_in_jax(residuals):
    f = jax_function(_nasty, residuals=residuals)
    x = torch.tensor(SPECIALS, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    ct = (torch.randn(8), torch.randn(8), torch.randn(()))
    out = f(x, w)
    torch.autograd.backward(out, ct)
    ref, vjp = jax.vjp(_nasty, _j(x), _j(w))
    gx, gw = vjp(tuple(_j(c) for c in ct))
    for got, want in zip(out + (x.grad, w.grad), ref + (gx, gw), strict=True):
        want = _t(want)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.isposinf(got), torch.isposinf(want))
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        torch.testing.assert_close(got.detach(), want, equal_nan=True)
    for t in (out[0], out[1], x.grad, w.grad):  # the case is exercised
        assert torch.isnan(t).any() and torch.isinf(t).any() and torch.isfinite(t).any()


def test_nan_and_inf_rows_through_a_flax_block_match_jax():
    m = _block()
    x = torch.randn(4, 8)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    x.requires_grad_()
    ct = torch.randn(4, 8)
    y = m(x)
    y.backward(ct)
    ref, vjp = jax.vjp(ResidualMLPBlock(8).apply, m.flax_variables(), _j(x))
    gv, gx = vjp(_j(ct))
    torch.testing.assert_close(y.detach(), _t(ref), equal_nan=True)
    torch.testing.assert_close(x.grad, _t(gx), equal_nan=True)
    for p, g in zip(_params(m), jax.tree_util.tree_leaves(gv), strict=True):
        torch.testing.assert_close(p.grad, _t(g), equal_nan=True)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


def test_detect_anomaly_names_our_backward_and_points_at_the_call():
    f = jax_function(lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.0))
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly():
            y = f(x)  # the line the anomaly report must show
            line = inspect.currentframe().f_lineno - 1
            with pytest.raises(RuntimeError, match="'BridgeFunctionBackward' returned nan"):
                y.backward(torch.tensor([0.5, 2.0]))
    reports = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
    assert len(reports) == 1
    assert "Error detected in BridgeFunctionBackward" in reports[0]
    assert f'File "{__file__}", line {line}' in reports[0] and "y = f(x)" in reports[0]
    x.grad = None
    f(x).backward(torch.tensor([0.5, 2.0]))  # outside anomaly mode: NaN, as jax.grad gives
    gx = jax.grad(lambda v: jnp.sum(jnp.where(v > 0, jnp.sqrt(v), 0.0) * jnp.array([0.5, 2.0])))
    torch.testing.assert_close(x.grad, _t(gx(_j(x))), equal_nan=True)


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(6)(x))
        return nn.Dense(3)(jnp.tanh(h))


class _DropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(5, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jnp.tanh(self.fc(x))))


@pytest.mark.parametrize(
    "make",
    [
        lambda mode: FlaxModule(_BatchNormNet(), example_args=(torch.zeros(4, 5),),
                                train_kwarg="train", residuals=mode),
        lambda mode: FlaxModule(_DropoutNet(nnx.Rngs(0, dropout=1)), residuals=mode),
    ],
    ids=["linen-batchnorm", "nnx-dropout-count"],
)
def test_buffers_written_back_after_forward_do_not_break_the_backward(make):
    """Train-mode state is written into torch's buffers right after the forward; the
    backward (a recompute, or a saved input) must still see the values the forward saw."""
    results = {}
    for mode in ("save", "recompute"):
        m = make(mode)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3), requires_grad=True)
        ct = torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
        y = m(x)
        y.backward(ct)
        results[mode] = [y.detach(), x.grad] + [p.grad for p in _params(m)] + list(
            m.buffers())
    for a, b in zip(results["save"], results["recompute"], strict=True):
        torch.testing.assert_close(b, a)
