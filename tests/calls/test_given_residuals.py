"""A first-order backward differentiated again reads what the forward saved.

NOTE [Given residuals] in ``torchside/edges/_given.py`` and NOTE [Given VJP] in
``flaxside/derivatives/_given.py``: where the first order's residuals give its VJP without rerunning
the forward (no remat), a derivative of the backward is a call of the first order's
backward body on them, and their own VJP in the leaves, with the forward's operations
taken out. Each result is
compared with pure JAX on the same values, with random cotangents and weights; the
program runs show that no VJP reruns the forward.
"""

import gc
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flaxside.internal import given_vjp, vjp_function
from tests.calls.test_higher_order import _apply, _close
from tests.support import pipeline
from tests.support.references import to_jax
from torchside import FlaxModule


class Critic(nn.Module):
    """A WGAN critic: tanh layers, no remat."""

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = jnp.tanh(nn.Dense(16)(x))
        return nn.Dense(1)(x)


def _critic():
    return FlaxModule(Critic(), example_args=(torch.zeros(8, 5),))


@pytest.mark.parametrize("wanted", ["input", "input and weights"])
def test_a_gradient_penalty_equals_pure_jax_and_reruns_no_forward(wanted):
    """WGAN-GP: the input's gradient, a weighted penalty on its norms, every gradient of
    that; the second order runs the first order's backward body once and the VJP of its
    residuals once, never the VJP with the forward inside."""
    torch.manual_seed(0)
    m = _critic()
    params = list(m.parameters())
    names, f = _apply(m)
    x = torch.randn(8, 5, requires_grad=True)
    ct, w = torch.randn(8, 1), torch.rand(8)
    inputs = [x] if wanted == "input" else [x, *params]

    def jax_loss(values, x):
        _, pull = jax.vjp(lambda v, x: f(v, x), values, x)
        gv, gx = pull(to_jax(ct))
        g = jnp.concatenate([gx.ravel()] if wanted == "input" else
                            [gx.ravel(), *(a.ravel() for a in gv)])
        return jnp.sum(to_jax(w).mean() * (jnp.linalg.norm(g) - 1) ** 2) + jnp.sum(
            to_jax(w)[:, None] * gx ** 2)

    with pipeline.program_runs() as runs:
        grads = torch.autograd.grad(m(x), inputs, ct, create_graph=True)
        gx = grads[0]
        g = torch.cat([t.reshape(-1) for t in grads])
        loss = (w.mean() * (g.norm() - 1) ** 2).sum() + (w[:, None] * gx**2).sum()
        loss.backward()
    want_p, want_x = jax.grad(jax_loss, argnums=(0, 1))(
        [to_jax(p) for p in params], to_jax(x))
    _close(x.grad, want_x, "x.grad")
    for name, p, want in zip(names, params, want_p, strict=True):
        _close(p.grad, want, f"{name}.grad")
    base = pipeline.entries(m)[0].program.name
    # No forward rerun: the given apply is the one derived call with residuals, and the
    # given transpose (its backward) runs once.
    assert runs.derived(base, "forward_with_residuals") == {"(given apply)": 1}
    assert runs[f"{base} (given transpose)", "forward"] == 1


def test_the_given_vjp_holds_none_of_the_forward():
    """``apply`` is the VJP on the saved residuals, and neither it nor ``transpose``
    computes the forward's nonlinearity (the forward's matmuls go with it)."""
    m = _critic()
    x = torch.randn(8, 5, requires_grad=True)
    m(x).sum().backward()
    program = pipeline.entries(m)[0].program
    apply, transpose = given_vjp(program)
    rng = np.random.default_rng(0)
    leaves = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in program.specs]
    fence = (jnp.zeros(1, jnp.uint8),) if program.fence else ()  # (the DLPack route's)
    out = program.forward_with_residuals(leaves, *fence)
    n = len(program.out_specs)
    rmap = program.residual_map()
    z = [out[k] for k in rmap.saved_outputs] + list(out[n:])
    cts = [jnp.asarray(rng.standard_normal(program.out_specs[k].shape), jnp.float32)
           for k in program.diff_out_index]
    got = jax.jit(apply)(leaves, z, cts)
    want = jax.jit(vjp_function(program))(leaves, cts)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    z_cts = [jnp.asarray(rng.standard_normal(t.shape), t.dtype) for t in z]

    def primitives(fn, *args):
        return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]

    whole = primitives(vjp_function(program), leaves, cts)
    assert "tanh" in whole  # the whole VJP reruns the forward
    assert "tanh" not in primitives(apply, leaves, z, cts)
    for_z = primitives(transpose, leaves, z, z_cts)
    assert "tanh" not in for_z
    # Two products per dense layer whose output z holds (its weight's, its input's): the
    # transposed ones; the forward's would make a third.
    assert for_z.count("dot_general") == 2 * 3, for_z


def test_remat_keeps_the_whole_vjp():
    """Under remat the residuals are the carries, and their VJP reruns each layer: the
    route says so, and the bridge keeps the whole VJP (or the shared linearization)."""
    from tests.calls.test_shared_linearization import _trunk

    m = _trunk("save")
    x = torch.randn(4, 3, requires_grad=True)
    m(x).sum().backward()
    assert given_vjp(pipeline.entries(m)[0].program) is None


class TanhOut(nn.Module):
    """A block whose backward reads its own output (``saved_outputs``: the last tanh)."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(3)(jnp.tanh(nn.Dense(4)(x))))


def test_the_given_residuals_live_no_longer_than_the_graph():
    """The node of the residuals is kept on the call's autograd context: a step's
    derivatives share it, and it goes with the step's graph, also where the residuals
    hold the call's own output (whose node a bundle of them must not keep alive)."""
    m = FlaxModule(TanhOut(), example_args=(torch.zeros(2, 3),))
    x = torch.randn(2, 3, requires_grad=True)
    y = m(x)
    assert pipeline.entries(m)[0].program.residual_map().saved_outputs == (0,)
    (g1,) = torch.autograd.grad(y, x, torch.randn(2, 3), create_graph=True)
    (g2,) = torch.autograd.grad(y, x, torch.randn(2, 3), create_graph=True)
    (g1**2).sum().backward()
    given = y.grad_fn.derivatives.given  # the call's context (torch's Function node)
    refs = [weakref.ref(t) for t in given] + [weakref.ref(y.grad_fn)]
    assert g2.grad_fn is not None
    del y, g1, g2, given
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("route", ["given", "split"])
def test_a_call_differentiated_again_after_a_backward_through_its_derivative(
        route, monkeypatch):
    """A backward through the first derivative's graph frees what its nodes saved: the
    next derivative of the same call makes its residuals' node again, and both steps
    equal pure JAX (the shared linearization of NOTE [Shared linearization] alike)."""
    from torchside.edges._higher import VjpCalls

    if route == "split":
        monkeypatch.setattr(VjpCalls, "SHARE_AFTER", 0)
        monkeypatch.setattr(VjpCalls, "SPLIT_MIN_WORK", 0.0)
        monkeypatch.setattr(VjpCalls, "SPLIT_SAFE", True)
    torch.manual_seed(0)
    m = FlaxModule(TanhOut(), example_args=(torch.zeros(2, 3),))
    if route == "split":
        pipeline.whole_vjps(m)  # the given residuals' route off
    params = list(m.parameters())
    names, f = _apply(m)
    x = torch.randn(2, 3, requires_grad=True)
    y = m(x)
    for scale in (1.0, 2.0):
        for p in params:
            p.grad = None
        (g,) = torch.autograd.grad((scale * y).sum(), x, create_graph=True)
        (g**2).sum().backward()

        def jax_loss(values, x, scale=scale):
            g = jax.grad(lambda x: (scale * f(values, x)).sum())(x)
            return jnp.sum(g**2)

        want = jax.grad(jax_loss)([to_jax(p) for p in params], to_jax(x))
        for name, p, w in zip(names, params, want, strict=True):
            _close(p.grad, w, f"scale {scale}: {name}.grad")


def test_two_live_calls_each_read_their_own_residuals():
    """Two calls of one module alive at once, each differentiated twice: each reads what
    its own forward saved. Mutation: the given residuals kept per entry instead of per
    call (the second call's derivative reads the first call's), gradients 110% off."""
    torch.manual_seed(0)
    m = _critic()
    params = list(m.parameters())
    names, f = _apply(m)
    xs = [torch.randn(8, 5, requires_grad=True) for _ in range(2)]
    cts = [torch.randn(8, 1) for _ in range(2)]
    with pipeline.program_runs() as runs:
        ys = [m(x) for x in xs]  # both forwards before either backward
        gs = [torch.autograd.grad(y, x, ct, create_graph=True)[0]
              for y, x, ct in zip(ys, xs, cts, strict=True)]
        sum((k + 1.0) * (g**2).sum() for k, g in enumerate(gs)).backward()

    def jax_loss(values, x0, x1):
        gs = [jax.vjp(lambda x: f(values, x), x)[1](to_jax(ct))[0]
              for x, ct in zip((x0, x1), cts, strict=True)]
        return sum((k + 1.0) * jnp.sum(g**2) for k, g in enumerate(gs))

    want_p, *want_x = jax.grad(jax_loss, argnums=(0, 1, 2))(
        [to_jax(p) for p in params], *map(to_jax, xs))
    for k, (x, w) in enumerate(zip(xs, want_x, strict=True)):
        _close(x.grad, w, f"x{k}.grad")
    for name, p, w in zip(names, params, want_p, strict=True):
        _close(p.grad, w, f"{name}.grad")
    base = pipeline.entries(m)[0].program.name
    assert runs.derived(base, "forward_with_residuals") == {"(given apply)": 2}


def test_a_subset_the_route_takes_where_every_gradient_would_not():
    """The route applies to the gradients a derivative asks for, but the backward of its
    residuals may need every leaf's: where that set does not qualify, neither does the
    route, and the result equals pure JAX."""
    from torchside import jax_function

    def fn(x, w, v):
        return jnp.tanh(jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w) @ v)

    torch.manual_seed(0)
    x, w, v = (torch.randn(*s, requires_grad=True) for s in ((2, 3), (3, 4), (4, 3)))
    call = jax_function(fn)
    ct = torch.randn(2, 3)
    (gv,) = torch.autograd.grad(call(x, w, v), [v], ct, create_graph=True)
    got = torch.autograd.grad((gv**2).sum(), [x, w, v])

    def jax_loss(x, w, v):
        gv = jax.grad(lambda v: jnp.sum(fn(x, w, v) * to_jax(ct)))(v)
        return jnp.sum(gv**2)

    want = jax.grad(jax_loss, argnums=(0, 1, 2))(to_jax(x), to_jax(w), to_jax(v))
    for g, w_, name in zip(got, want, "xwv", strict=True):
        _close(g, w_, name)


def test_complex_residuals_keep_the_whole_vjp():
    """A complex residual of a real function: its cotangents would need torch's conjugate
    convention, which the route does not apply; it declines, and the result equals pure
    JAX."""
    from torchside import jax_function

    def fn(x, w, v, c):
        h = (x @ w) * c
        return jnp.tanh(jnp.real(h * h) @ v)

    torch.manual_seed(0)
    x, w, v = (torch.randn(*s, requires_grad=True) for s in ((2, 3), (3, 4), (4, 3)))
    c = torch.randn(2, 4, dtype=torch.complex64)
    call = jax_function(fn)
    ct, weight = torch.randn(2, 3), torch.rand(2, 3)
    (gx,) = torch.autograd.grad(call(x, w, v, c), [x], ct, create_graph=True)
    got = torch.autograd.grad((weight * gx**2).sum(), [x, w, v])
    assert given_vjp(pipeline.entries(call)[0].program) is None

    def jax_loss(x, w, v):
        gx = jax.grad(lambda x: jnp.sum(fn(x, w, v, to_jax(c)) * to_jax(ct)))(x)
        return jnp.sum(to_jax(weight) * gx**2)

    want = jax.grad(jax_loss, argnums=(0, 1, 2))(to_jax(x), to_jax(w), to_jax(v))
    for g, w_, name in zip(got, want, "xwv", strict=True):
        _close(g, w_, name)
