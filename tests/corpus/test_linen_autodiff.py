"""Differentiation inside Linen modules (nn.vjp, nn.jvp, nn.grad, nn.value_and_grad,
nn.custom_vjp): the docstring examples of ``flax/linen/transforms.py`` through FlaxModule.

The outer torch gradient differentiates through the inner transform (second order for
vjp/grad, reverse-over-forward for jvp, the custom rule for custom_vjp); it must equal
``jax.vjp`` of the pure apply, which ``check_linen`` computes.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import torch

from tests.support.corpus_helpers import check_linen, covers


# The docstrings' LearnScale starts its parameter at zero, which makes every gradient
# through it zero; the tests load a scale of 1.5 (``_scaled``) so the comparison can fail.
class LearnScale(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        p = self.param("scale", nn.initializers.zeros_init(), ())
        return p * x * y


def _scaled(module, *args, value=1.5):
    variables = module.init(jax.random.key(0), *[jnp.zeros(a.shape) for a in args])
    return jax.tree_util.tree_map(lambda v: jnp.full_like(v, value), variables)


# flax.linen.vjp docstring: Foo returns z and the cotangents from the inner vjp.
class VjpFoo(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        z, bwd = nn.vjp(lambda mdl, x, y: mdl(x, y), LearnScale(), x, y)
        params_grad, x_grad, y_grad = bwd(jnp.ones(z.shape))
        return z, params_grad, x_grad, y_grad


@covers("nn.vjp", "Foo / LearnScale (inner vjp outputs differentiated again)")
def test_vjp_foo():
    x, y = torch.randn(3), torch.randn(3)
    check_linen(VjpFoo(), (x, y), variables=_scaled(VjpFoo(), x, y))


# flax.linen.jvp docstring: Foo returns the tangent of LearnScale along its parameters.
class LearnScale1(nn.Module):
    @nn.compact
    def __call__(self, x):
        p = self.param("test", nn.initializers.zeros_init(), ())
        return p * x


class JvpFoo(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = LearnScale1()
        vars_t = jax.tree_util.tree_map(jnp.ones_like, scale.variables.get("params", {}))
        _, out_t = nn.jvp(lambda mdl, x: mdl(x), scale, (x,), (jnp.zeros_like(x),),
                          variable_tangents={"params": vars_t})
        return out_t


class JvpSquare(nn.Module):
    """Like JvpFoo, through a nonlinear layer, so the tangent depends on the parameters."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(3)
        out, out_t = nn.jvp(lambda mdl, x: jnp.tanh(mdl(x)), dense, (x,), (jnp.ones_like(x),),
                            variable_tangents={})
        return out, out_t


@covers("nn.jvp", "Foo / LearnScale (tangent along the parameters)",
        "a Dense under tanh with an input tangent")
@pytest.mark.parametrize("module", [JvpFoo, JvpSquare], ids=["docstring", "dense-tanh"])
def test_jvp(module):
    x = torch.randn(4, 5)
    # JvpFoo's tangent is x itself and needs no scale; JvpSquare uses its own init.
    check_linen(module(), (x,))


# flax.linen.grad / value_and_grad docstrings: input gradients of a scalar LearnScale.
class GradFoo(nn.Module):
    """The docstrings' Foo, by ``nn.grad`` or ``nn.value_and_grad`` (``transform``)."""

    transform: str = "grad"
    reduce: bool = False

    @nn.compact
    def __call__(self, x, y):
        def fn(mdl, x, y):
            return mdl(x, y).sum() if self.reduce else mdl(x, y)
        if self.transform == "grad":
            x_grad, y_grad = nn.grad(fn, LearnScale(), x, y)
            return x_grad, y_grad
        z, (x_grad, y_grad) = nn.value_and_grad(fn, LearnScale(), x, y)
        return z, x_grad, y_grad


@covers("nn.grad", "Foo / LearnScale (scalar inputs, as in the docstring)",
        "vector inputs, summed inside")
@covers("nn.value_and_grad", "Foo / LearnScale (scalar inputs, as in the docstring)",
        "vector inputs, summed inside")
@pytest.mark.parametrize("transform", ["grad", "value_and_grad"])
@pytest.mark.parametrize("shape", [(), (4,)], ids=["scalar", "vector"])
def test_grad_and_value_and_grad(transform, shape):
    x, y = torch.randn(shape), torch.randn(shape)
    m = GradFoo(transform, reduce=bool(shape))
    check_linen(m, (x, y), variables=_scaled(m, x, y))


# flax.linen.custom_vjp docstring: Foo, whose parameter gradient is replaced by its sign.
class SignGradFoo(nn.Module):
    @nn.compact
    def __call__(self, x):
        def f(mdl, x):
            return mdl(x)

        def fwd(mdl, x):
            return nn.vjp(f, mdl, x)

        def bwd(vjp_fn, y_t):
            params_t, *inputs_t = vjp_fn(y_t)
            params_t = jax.tree_util.tree_map(jnp.sign, params_t)
            return (params_t, *inputs_t)

        sign_grad = nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)
        return sign_grad(nn.Dense(1), x).reshape(())


@covers("nn.custom_vjp", "Foo (sign of the parameter gradient)")
def test_custom_vjp_sign_gradient():
    x = torch.randn(2)
    checked = check_linen(SignGradFoo(), (x,))
    # The custom rule ran: every parameter gradient is a sign, the input gradient is not.
    for name, p in checked.wrapped.named_parameters():
        assert torch.equal(p.grad.abs(), torch.ones_like(p.grad)), name
