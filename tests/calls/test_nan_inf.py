"""NaN and Inf: propagated exactly as JAX does, and anomaly mode names our backward.

A NaN in the backward under ``torch.autograd.detect_anomaly`` is reported as
``BridgeFunctionBackward`` with the line of the forward call; outside anomaly mode the
gradient holds the NaN, as ``jax.grad`` gives.
"""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.references import to_jax, to_torch
from tests.support.twins import ResidualMLPBlock, residual_block_module
from torchside import jax_function

MODES = pytest.mark.parametrize("residuals", ["save", "recompute"])


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
    ref, vjp = jax.vjp(_nasty, to_jax(x), to_jax(w))
    gx, gw = vjp(tuple(to_jax(c) for c in ct))
    for got, want in zip(out + (x.grad, w.grad), ref + (gx, gw), strict=True):
        want = to_torch(want)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.isposinf(got), torch.isposinf(want))
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        torch.testing.assert_close(got.detach(), want, equal_nan=True)
    for t in (out[0], out[1], x.grad, w.grad):  # the case is exercised
        assert torch.isnan(t).any() and torch.isinf(t).any() and torch.isfinite(t).any()


def test_nan_and_inf_rows_through_a_flax_block_match_jax():
    m = residual_block_module()
    x = torch.randn(4, 8)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    x.requires_grad_()
    ct = torch.randn(4, 8)
    y = m(x)
    y.backward(ct)
    ref, vjp = jax.vjp(ResidualMLPBlock(8).apply, m.flax_variables(), to_jax(x))
    gv, gx = vjp(to_jax(ct))
    torch.testing.assert_close(y.detach(), to_torch(ref), equal_nan=True)
    torch.testing.assert_close(x.grad, to_torch(gx), equal_nan=True)
    for p, g in zip(list(m.parameters()), jax.tree_util.tree_leaves(gv), strict=True):
        torch.testing.assert_close(p.grad, to_torch(g), equal_nan=True)
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
    torch.testing.assert_close(x.grad, to_torch(gx(to_jax(x))), equal_nan=True)
