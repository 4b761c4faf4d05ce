"""Calls of one VJP that differ only in their cotangents share its linearization.

NOTE [Shared linearization] in ``torchside/edges/_higher.py``: a PINN's Laplacian differentiates
its first derivative back through the block's call once per dimension, so the block's VJP
is called several times on the same leaves. From the second step on, the bridge splits it
into ``linearize`` (run once per leaf set, its backward once, torch summing what every
call sends it) and ``apply`` (once per call). Each step's gradients are compared with pure
JAX's on the values of that step; the split is counted in program runs; residuals are
never served for leaves changed since, and live no longer than the step's graph.
"""

import gc

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flaxside.internal import (
    LeafSpec,
    Program,
    given_vjp,
    linearized_vjp,
    vjp_function,
    vjp_work,
)
from tests.calls.test_higher_order import OWNERS, TanhLayer, _apply, _close, _linen
from tests.support import pipeline
from tests.support.references import to_jax
from torchside.edges._higher import VjpCalls


def _pinn_loss(m, x):
    """``u = |x|^2 m(x)``; the mean squared Laplacian residual, by nested autograd.grad."""
    u = (x.pow(2).sum(1, keepdim=True) * m(x)).sum()
    (g,) = torch.autograd.grad(u, x, create_graph=True)
    lap = sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i]
              for i in range(x.shape[1]))
    return (lap - 1).pow(2).mean()


def _jax_pinn_loss(f, values, x):
    def u(x):
        return ((x**2).sum(1, keepdims=True) * f(values, x)).sum()

    g = jax.grad(u)
    lap = sum(jax.grad(lambda x, i=i: g(x)[:, i].sum())(x)[:, i] for i in range(x.shape[1]))
    return jnp.mean((lap - 1) ** 2)


class TanhTrunk(nn.Module):
    """``examples/pinn.py``'s trunk: ``nn.remat_scan`` of smooth residual layers."""

    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(TanhLayer, lengths=(2, 2))(3, name="stack")(x)


def _trunk(residuals):
    from torchside import FlaxModule

    return FlaxModule(TanhTrunk(), example_args=(torch.zeros(4, 3),), residuals=residuals)


class NnxTanh(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(3, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def _nnx_tanh(residuals):
    from torchside import FlaxModule

    return FlaxModule(NnxTanh(nnx.Rngs(0)), residuals=residuals)


# The shared blocks normalize width-3 rows (LayerNorm): a Laplacian there is not finite.
PINN_OWNERS = {**OWNERS, "remat_scan": _trunk, "nnx": _nnx_tanh}


# The owners whose first-order residuals give the VJP without the forward (no remat).
GIVEN = ("linen", "nnx")


@pytest.mark.parametrize("owner", list(PINN_OWNERS))
def test_a_pinn_trained_over_steps_equals_pure_jax_and_shares_the_linearization(
        owner, monkeypatch):
    monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", 0.0)  # these blocks are small
    torch.manual_seed(0)
    m = PINN_OWNERS[owner]("save")
    x = torch.randn(4, 3, requires_grad=True)
    params = list(m.parameters())
    names, f = _apply(m)
    reference = jax.jit(jax.grad(lambda v, x: _jax_pinn_loss(f, v, x), argnums=(0, 1)))
    opt = torch.optim.SGD(params, lr=0.05)
    for step in range(3):
        values = [to_jax(p) for p in params]
        want_p, want_x = reference(values, to_jax(x))
        opt.zero_grad()
        x.grad = None
        with pipeline.program_runs() as runs:
            _pinn_loss(m, x).backward()
        _close(x.grad, want_x, f"step {step}: x.grad")
        for name, p, want in zip(names, params, want_p, strict=True):
            _close(torch.zeros_like(p) if p.grad is None else p.grad, want,
                   f"step {step}: {name}.grad")
        program = pipeline.entries(m)[0].program
        base = program.name
        # The block's VJP is called once for the first derivative and once per dimension;
        # which derived programs ran is compared whole (a renamed one fails it).
        derived = runs.derived(base, "forward_with_residuals")
        assert (given_vjp(program) is not None) == (owner in GIVEN), owner
        if owner in GIVEN:
            # NOTE [Given residuals]: where the forward's residuals give the VJP without the
            # forward (no remat), every call is an apply of them, from the first step on;
            # the Laplacian's three derivatives of the first run the given transpose,
            # differentiable, once each.
            assert derived == {"(given apply)": 4, "(given transpose)": 3}, derived
        elif step == 0 or owner == "remat_stack" or not VjpCalls.SPLIT_SAFE:
            # the first step takes the whole VJP,
            # and counts its calls; remat_stack's is a custom_vjp: never split
            assert derived == {"(vjp)": 4}, derived
        else:  # one leaf set (this step's parameters): linearized once, applied per call
            assert derived == {"(vjp linearize)": 1, "(vjp apply)": 4}, derived
            assert runs[f"{base} (vjp linearize)", "backward"] == 1
        opt.step()


@pytest.mark.parametrize("change", ["in place", "data"])
def test_residuals_are_not_shared_with_leaves_changed_since(monkeypatch, change):
    """A parameter written in place (its version) or replaced through ``.data`` (its
    memory) between two calls, while the first call's graph still lives: the second call
    linearizes again, and equals pure JAX at the new values."""
    monkeypatch.setattr(VjpCalls, "SHARE_AFTER", 0)  # every leaf set split
    # The split on a plain block, whose residuals would give its VJP without the
    # forward (NOTE [Given residuals]): that route off here.
    monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", 0.0)
    torch.manual_seed(0)
    m = _linen("save")
    pipeline.whole_vjps(m)  # the given residuals' route off
    x = torch.randn(4, 3, requires_grad=True)
    ct = torch.randn(4, 1)
    names, f = _apply(m)
    (g1,) = torch.autograd.grad(m(x), x, ct, create_graph=True)
    assert pipeline.shared_residuals(m)  # held by g1's graph
    p = dict(m.named_parameters())[names[-1]]
    if change == "in place":
        with torch.no_grad():
            p.add_(0.5)
    else:
        p.data = p.data + 0.5
    with pipeline.program_runs() as runs:
        (g2,) = torch.autograd.grad(m(x), x, ct, create_graph=True)
    assert runs[f"{pipeline.entries(m)[0].program.name} (vjp linearize)",
                "forward_with_residuals"] == 1
    values = [to_jax(q) for _, q in m.named_parameters()]
    want = jax.vjp(lambda x: f(values, x), to_jax(x))[1](to_jax(ct))[0]
    _close(g2, want, "the gradient after the change")
    assert not torch.allclose(g1, g2)


def test_the_residuals_live_no_longer_than_the_graph(monkeypatch):
    monkeypatch.setattr(VjpCalls, "SHARE_AFTER", 0)
    # The split on a plain block, whose residuals would give its VJP without the
    # forward (NOTE [Given residuals]): that route off here.
    monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", 0.0)
    torch.manual_seed(0)
    m = _linen("save")
    pipeline.whole_vjps(m)  # the given residuals' route off
    x = torch.randn(4, 3, requires_grad=True)
    loss = _pinn_loss(m, x)
    assert pipeline.shared_residuals(m)
    loss.backward()
    del loss
    gc.collect()
    assert pipeline.shared_residuals(m) == []


def _dropout_block(leaves):
    """``tanh(x @ w)`` under ``jax.checkpoint``, dropped out by a key leaf: the remat keeps
    the key, so the linearization's residuals hold a typed PRNG key."""
    w, x, key_data = leaves

    @jax.checkpoint
    def body(w, x, key):
        h = jnp.tanh(x @ w)
        return jnp.where(jax.random.bernoulli(key, 0.5, h.shape), h * 2, 0.0)

    key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    return (body(w, x, key) ** 2).sum(1), [], None


@pytest.mark.parametrize("wanted", [None, (1,)])
def test_linearize_then_apply_is_the_vjp_and_differentiates_as_it(wanted):
    """``flaxside``'s split against the whole VJP, and the gradients of a random linear
    function of both (second derivatives) against each other, on a program whose
    residuals hold a key, a leaf and arrays."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    key = np.asarray(jax.random.key_data(jax.random.key(1)))
    program = Program(_dropout_block, [LeafSpec(w.shape, w.dtype, True),
                                       LeafSpec(x.shape, x.dtype, True),
                                       LeafSpec(key.shape, key.dtype, False)])
    linearize, apply = linearized_vjp(program, wanted)
    whole = vjp_function(program, wanted)
    ct = rng.standard_normal(5).astype(np.float32)
    weights = [rng.standard_normal(a.shape).astype(np.float32)
               for a in ((w, x) if wanted is None else (x,))]

    def split(w, x, ct):
        leaves = [w, x, key]
        return apply(leaves, linearize(leaves), [ct])

    def joined(w, x, ct):
        return whole([w, x, key], [ct])

    residuals = jax.jit(linearize)([w, x, key])
    # The key, as its data (jax_remat3 stages the remat so that no key is a residual).
    assert jax.config.jax_remat3 or any(r.dtype == np.uint32 for r in residuals)
    # The weight is read from the leaves, not copied out (jax_remat3 stages the remat so
    # that it leaves as a residual of its own: a copy, correct but not spared).
    assert jax.config.jax_remat3 or not any(r.shape == w.shape for r in residuals)
    for got, want in zip(jax.jit(split)(w, x, ct), jax.jit(joined)(w, x, ct), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    def scalar(fn):
        return lambda *a: sum((g * v).sum() for g, v in zip(fn(*a), weights, strict=True))

    got = jax.jit(jax.grad(scalar(split), argnums=(0, 1, 2)))(w, x, ct)
    want = jax.jit(jax.grad(scalar(joined), argnums=(0, 1, 2)))(w, x, ct)
    for g, v in zip(got, want, strict=True):
        np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5 * float(np.abs(v).max()))


def test_a_vjp_below_the_work_that_pays_stays_whole(monkeypatch):
    """The gate: a VJP whose work (``vjp_work``) is under ``SPLIT_MIN_WORK`` is called
    whole every step, however many calls share its leaves."""
    monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", float("inf"))
    torch.manual_seed(0)
    m = _trunk("save")
    x = torch.randn(4, 3, requires_grad=True)
    for _ in range(2):
        with pipeline.program_runs() as runs:
            _pinn_loss(m, x).backward()
    base = pipeline.entries(m)[0].program.name
    assert runs[f"{base} (vjp)", "forward_with_residuals"] == 4
    assert not any("linearize" in name for name, _ in runs)


@pytest.mark.parametrize("layers", [1, 8])
def test_vjp_work_counts_each_matmul_once_per_scan_iteration(layers):
    """``vjp_work`` against a hand count: a VJP for the weights and the input of
    ``layers`` matmuls ``(m, k) @ (k, k)`` computes the forward and two products per
    layer, ``6 m k k`` each, plus elementwise work far below one matmul's."""
    m, k = 32, 16

    def fn(leaves):
        w, h = leaves

        def layer(h, w):
            return h @ w, None

        return jax.lax.scan(layer, h, w)[0], [], None

    program = Program(fn, [LeafSpec((layers, k, k), np.float32, True),
                           LeafSpec((m, k), np.float32, True)])
    work = vjp_work(program)
    matmuls = 6 * m * k * k * layers
    assert matmuls <= work < matmuls + 2 * m * k * k, (work, matmuls)


def test_a_step_after_data_written_in_place_is_not_served_the_last_steps_residuals(
        monkeypatch):
    """``p.data.add_`` (a hand-written SGD step, weight clipping) changes neither the
    parameter's version nor its memory. The last step's graph, still alive, holds its
    residuals: the next step's calls are another call's derivatives and share nothing
    with them, so its gradients are pure JAX's at the new values."""
    monkeypatch.setattr(VjpCalls, "SHARE_AFTER", 0)
    # The split on a plain block, whose residuals would give its VJP without the
    # forward (NOTE [Given residuals]): that route off here.
    monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", 0.0)
    torch.manual_seed(0)
    m = _linen("save")
    pipeline.whole_vjps(m)  # the given residuals' route off
    x = torch.randn(4, 3, requires_grad=True)
    params = list(m.parameters())
    names, f = _apply(m)
    kept = _pinn_loss(m, x)  # the last step's graph, alive
    assert pipeline.shared_residuals(m)
    for p in params:
        p.data.add_(0.25)
    _pinn_loss(m, x).backward()
    want_p, want_x = jax.grad(lambda v, x: _jax_pinn_loss(f, v, x), argnums=(0, 1))(
        [to_jax(p) for p in params], to_jax(x))
    _close(x.grad, want_x, "x.grad")
    for name, p, want in zip(names, params, want_p, strict=True):
        _close(p.grad, want, f"{name}.grad")
    del kept


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


class Clipped(nn.Module):
    """A block whose VJP is not linear in its cotangent: a ``custom_vjp`` clipping it."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(_clip_gradient(jnp.tanh(nn.Dense(8)(x))))


def test_a_custom_vjp_not_linear_in_its_cotangent_is_never_split(monkeypatch):
    """Linearized at a zero cotangent, a clipping rule is the identity: split, the first
    derivative itself would change from the second step on. Such a VJP stays whole, and
    each step's first derivative equals JAX's."""
    from torchside import FlaxModule

    monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", 0.0)
    # The split on a plain block, whose residuals would give its VJP without the
    # forward (NOTE [Given residuals]): that route off here.
    torch.manual_seed(0)
    m = FlaxModule(Clipped(), example_args=(torch.zeros(4, 3),))
    pipeline.whole_vjps(m)  # the given residuals' route off
    x = torch.randn(4, 3, requires_grad=True)
    names, f = _apply(m)
    params = list(m.parameters())

    def u(values, x):
        return ((x**2).sum(1, keepdims=True) * f(values, x)).sum()

    for _ in range(3):
        want = jax.grad(u, argnums=1)([to_jax(p) for p in params], to_jax(x))
        with pipeline.program_runs() as runs:
            (g,) = torch.autograd.grad((x.pow(2).sum(1, keepdim=True) * m(x)).sum(), x,
                                       create_graph=True)
            lap = sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i]
                      for i in range(3))
            lap.pow(2).mean().backward()
        _close(g, want, "the first derivative")
        # The block's own VJP (its derivatives' VJPs are JAX's, linear: they may split).
        base = pipeline.entries(m)[0].program.name
        assert runs.derived(base, "forward_with_residuals") == {"(vjp)": 4}
        with torch.no_grad():
            for p in params:
                p -= 0.05 * p.grad
                p.grad = None
