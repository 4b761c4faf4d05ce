"""Derivatives of a call's backward: gradient penalties, HVPs, MAML, third order.

NOTE [Higher order] in ``torchside/edges/_higher.py``: with ``create_graph=True`` the backward
is a differentiable call of the VJP, to any order. Every result is compared with pure JAX
differentiating the same function (``jax.grad`` of ``jax.grad``, ``jax.jvp`` of
``jax.grad``) on the same values, and with random cotangents where there is one; float64
checks run ``torch.autograd.gradgradcheck``. A first-order step keeps its programs and what
it saves, and the refusals name what to do.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flaxside
from tests.support import pipeline
from tests.support.references import to_jax, to_torch
from tests.support.twins import NnxResidualMLPBlock, ReadmeDeep
from torchside import FlaxModule, jax_function

MODES = pytest.mark.parametrize("residuals", ["save", "split", "recompute"])


def _close(got: torch.Tensor, want, what: str) -> None:
    want = torch.as_tensor(np.array(want))  # a copy: numpy views of JAX arrays are read-only
    scale = float(want.abs().max())
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-5 * max(scale, 1e-6),
                               msg=lambda m: f"{what}: {m}")


class Critic(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))


def _linen(residuals):
    return FlaxModule(Critic(), example_args=(torch.zeros(4, 3),), residuals=residuals)


def _stack(residuals):
    return FlaxModule(ReadmeDeep(width=3, lengths=(2, 2)), example_args=(torch.zeros(4, 3),),
                      residuals=residuals)


def _nnx(residuals):
    return FlaxModule(NnxResidualMLPBlock(3, rngs=nnx.Rngs(0)), residuals=residuals)


class TanhLayer(nn.Module):
    width: int

    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(self.width)(h))


def _remat_stack(residuals):
    """flaxside's own stack, whose VJP is a jax.custom_vjp: JAX differentiates it again."""
    stack = flaxside.remat_stack(TanhLayer, 4, lengths=(2, 2), width=3)
    return FlaxModule(stack, example_args=(torch.zeros(4, 3),), residuals=residuals)


OWNERS = {"linen": _linen, "remat_scan": _stack, "nnx": _nnx, "remat_stack": _remat_stack}


def _apply(module: FlaxModule):
    """The module as a pure JAX function of (parameter leaves, x), for references."""
    names = [n for n, _ in module.named_parameters()]

    def f(values, x):
        return module.flax_module.apply(pipeline.variables_from(module, values), x) \
            if not module._nnx else _nnx_apply(module, values, x)

    return names, f


def _nnx_apply(module, values, x):
    graphdef, _, rest = nnx.split(module.flax_module, nnx.Param, ...)
    params = nnx.split(module.flax_module, nnx.Param, ...)[1]
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values), rest)(x)


@MODES
@pytest.mark.parametrize("owner", list(OWNERS))
def test_a_gradient_penalty_equals_pure_jax(owner, residuals):
    """WGAN-GP: the penalty on the input gradient's norm, backpropagated to everything."""
    m = OWNERS[owner](residuals)
    x = torch.randn(4, 3, requires_grad=True)
    out = m(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = ((gx.norm(dim=1) - 1) ** 2).mean()
    penalty.backward()

    names, f = _apply(m)
    values = [to_jax(p) for _, p in m.named_parameters()]

    def jax_penalty(values, x):
        g = jax.grad(lambda x: f(values, x).sum())(x)
        return ((jnp.linalg.norm(g, axis=1) - 1) ** 2).mean()

    want_p, want_x = jax.grad(jax_penalty, argnums=(0, 1))(values, to_jax(x))
    _close(x.grad, want_x, "x.grad")
    for name, p, want in zip(names, m.parameters(), want_p, strict=True):
        # torch gives None where nothing depends on the parameter (an output bias): zero.
        _close(torch.zeros_like(p) if p.grad is None else p.grad, want, f"{name}.grad")


def test_a_derivative_computes_only_the_gradients_the_backward_reads():
    """``autograd.grad`` of the input alone (a penalty) derives a VJP that returns the
    input's gradient only: the weight gradients' products, and their own VJP, would be
    computed for nobody. Another ``create_graph`` backward that reads the weights gets a
    VJP of its own, and each equals pure JAX's."""
    m = _linen("save")
    x = torch.randn(4, 3, requires_grad=True)
    params = list(m.parameters())
    names, f = _apply(m)
    values = [to_jax(p) for p in params]
    ct = torch.randn(4, 1)

    def jvjp(values, x):
        return jax.vjp(f, values, x)[1](to_jax(ct))

    want_p, want_x = jvjp(values, to_jax(x))
    (gx,) = torch.autograd.grad(m(x), x, ct, create_graph=True)
    assert [len(p.out_specs) for p in pipeline.derived_programs(m)] == [1]
    gp = torch.autograd.grad(m(x), params, ct, create_graph=True)
    both = torch.autograd.grad(m(x), [x, *params], ct, create_graph=True)
    assert [len(p.out_specs) for p in pipeline.derived_programs(m)] == [1, 4, 5]
    _close(gx, want_x, "x alone")
    _close(both[0], want_x, "x with the weights")
    for name, got, got_both, want in zip(names, gp, both[1:], want_p, strict=True):
        _close(got, want, f"{name} alone")
        _close(got_both, want, f"{name} with x")
    # Each one differentiates again, to what it read.
    (gx.sum() + sum(g.sum() for g in gp)).backward()
    want_xx = jax.grad(lambda x: jvjp(values, x)[1].sum() + sum(
        g.sum() for g in jvjp(values, x)[0]))(to_jax(x))
    _close(x.grad, want_xx, "x.grad")


class LossInside(nn.Module):
    """A scalar loss: the fused (value_and_grad) route at first order."""

    @nn.compact
    def __call__(self, x):
        return jnp.mean(jnp.tanh(nn.Dense(4)(x)) ** 2)


def test_the_fused_route_differentiates_its_gradient_too():
    m = FlaxModule(LossInside(), example_args=(torch.zeros(5, 3),))
    x = torch.randn(5, 3, requires_grad=True)
    (gx,) = torch.autograd.grad(m(x), x, create_graph=True)
    (gx.sin().sum()).backward()

    def loss(p, x):
        return LossInside().apply({"params": p}, x)

    params = jax.tree_util.tree_map(jnp.asarray, m.flax_variables()["params"])
    want_p, want_x = jax.grad(lambda p, x: jnp.sin(jax.grad(loss, argnums=1)(p, x)).sum(),
                              argnums=(0, 1))(params, to_jax(x))
    _close(x.grad, want_x, "x.grad")
    _close(m.params.Dense_0.kernel.grad, want_p["Dense_0"]["kernel"], "kernel.grad")


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_gradgradcheck_in_float64(x64, residuals):
    f = jax_function(lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2, axis=1), residuals=residuals)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.autograd.gradgradcheck(f, (x, w))


def _sin3(w):
    return jnp.sum(jnp.sin(w) ** 3)


def test_hessian_vector_products_and_a_third_derivative():
    f = jax_function(_sin3)
    w, v = torch.randn(6, requires_grad=True), torch.randn(6)
    _, hv = torch.autograd.functional.hvp(f, w, v)
    want = jax.jvp(jax.grad(_sin3), (to_jax(w),), (to_jax(v),))[1]
    _close(hv, want, "hvp")
    w = torch.tensor([0.7, -1.3], requires_grad=True)
    (g1,) = torch.autograd.grad(f(w), w, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), w, create_graph=True)
    (g3,) = torch.autograd.grad(g2.sum(), w)

    def second_sum(w):
        return jax.grad(lambda w: jax.grad(_sin3)(w).sum())(w).sum()

    _close(g3, jax.grad(second_sum)(to_jax(w)), "third derivative")


def test_a_maml_step_differentiates_through_the_inner_update():
    """The outer gradient flows through ``p - lr * grad(inner loss)`` (create_graph)."""
    m = _linen("save")
    names = [n for n, _ in m.named_parameters()]
    params = {n: p for n, p in m.named_parameters()}
    xs, ys = torch.randn(6, 3), torch.randn(6, 1)
    xq, yq = torch.randn(6, 3), torch.randn(6, 1)

    def loss(p, x, y):
        return ((torch.func.functional_call(m, p, (x,)) - y) ** 2).mean()

    grads = torch.autograd.grad(loss(params, xs, ys), list(params.values()), create_graph=True)
    adapted = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads, strict=True)}
    outer = torch.autograd.grad(loss(adapted, xq, yq), list(params.values()))

    _, f = _apply(m)

    def jloss(v, x, y):
        return ((f(v, x) - y) ** 2).mean()

    def jouter(v):
        g = jax.grad(jloss)(v, to_jax(xs), to_jax(ys))
        return jloss([a - 0.1 * b for a, b in zip(v, g, strict=True)], to_jax(xq), to_jax(yq))

    want = jax.grad(jouter)([to_jax(p) for p in params.values()])
    for name, got, w in zip(names, outer, want, strict=True):
        _close(got, w, name)


def test_a_first_order_step_runs_and_saves_what_it_did():
    """Being differentiable again costs a first-order step nothing: the same programs, and
    torch's saved-tensor hooks see exactly what its backward reads (no leaf kept for a
    second derivative is saved); no derived program is compiled."""
    m = _stack("save")
    x = torch.randn(4, 3, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = m(x)
    y.backward(torch.randn_like(y))
    rmap = pipeline.residual_map(m)
    assert len(packed) == (len(rmap.saved_inputs) + len(rmap.saved_outputs)
                           + len(rmap.residual_specs))
    assert {kind for _, kind, _ in pipeline.executables_run(m)} == {
        "forward_with_residuals", "backward"}


class Counter(nn.Module):
    """Its output reads a counter that the forward increments (written back in place)."""

    @nn.compact
    def __call__(self, x):
        calls = self.variable("stats", "calls", lambda: jnp.ones(()))
        y = nn.Dense(2)(x) * calls.value
        if not self.is_initializing():
            calls.value = calls.value + 1
        return y


def test_a_derivative_that_needs_overwritten_state_is_refused_unless_recompute():
    m = FlaxModule(Counter(), example_args=(torch.zeros(3, 2),))
    x = torch.randn(3, 2, requires_grad=True)
    y = m(x)
    with pytest.raises(RuntimeError, match=r"FlaxModule\(Counter\).*read the state "
                                           r"'stats.calls'.*residuals='recompute'"):
        torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    r = FlaxModule(Counter(), example_args=(torch.zeros(3, 2),), residuals="recompute")
    x = torch.randn(3, 2, requires_grad=True)
    (g,) = torch.autograd.grad(r(x).pow(2).sum(), x, create_graph=True)
    g.sum().backward()  # d/dx of d/dx sum(y^2), y = 1 * (x W + b): 2 W W^T summed
    kernel = r.params.Dense_0.kernel.detach()
    _close(x.grad, (2 * kernel @ kernel.T).sum(1).expand(3, 2).numpy(), "x.grad")


def test_a_leaf_written_in_place_before_the_second_derivative_is_refused():
    f = jax_function(lambda x, w: jnp.sum(jnp.tanh(x @ w)))
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2)
    y = f(x, w)
    w.mul_(2)  # the first-order backward never reads w; a second derivative would
    with pytest.raises(RuntimeError, match=r"'args\[1\]' was modified by an inplace"):
        torch.autograd.grad(y, x, create_graph=True)


def test_a_second_derivative_through_torch_compile_is_refused_not_dropped():
    """torch.compile's backward graph is not differentiable again (AOTAutograd); torch
    refuses the second backward itself, rather than treating the gradient as constant."""
    torch._dynamo.reset()
    m = _linen("save")
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(4, 3, requires_grad=True)
    (g,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        g.pow(2).sum().backward()
    torch._dynamo.reset()


def test_reference_helpers_are_consistent():
    """The test's own JAX view of a module gives the module's output (a control)."""
    for make in OWNERS.values():
        m = make("save")
        x = torch.randn(4, 3)
        _, f = _apply(m)
        with torch.no_grad():
            _close(m(x), f([to_jax(p) for p in m.parameters()], to_jax(x)), "forward")
    assert to_torch(jnp.ones(2)).shape == (2,)
