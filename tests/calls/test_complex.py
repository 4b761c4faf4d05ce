"""Complex tensors follow torch's gradient convention; lazy conj/neg bits cross (issue 14).

torch's gradient of a real loss with respect to a complex tensor is the conjugate of JAX's
VJP applied to the conjugated cotangent. Every reference here is torch's own autograd on
the same expression, so the convention is checked end to end, not restated.
"""

import flax.linen as nn
import jax.numpy as jnp
import pytest
import torch

from torchside import FlaxModule, jax_function

MODES = ["save", "recompute"]


def _cn(*shape):
    return torch.randn(*shape, dtype=torch.complex64)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


# name -> (JAX function, torch twin, argument factories); each is non-trivial in conj(z).
FUNCTIONS = {
    "square": (lambda x: x * x, lambda x: x * x, (lambda: _cn(5),)),
    "non-holomorphic": (
        lambda a, b: a * jnp.conj(b) + a * a + jnp.abs(b) * a,
        lambda a, b: a * b.conj() + a * a + b.abs() * a,
        (lambda: _cn(4), lambda: _cn(4)),
    ),
    "real-and-complex": (
        lambda r, z: jnp.sin(r) * z + jnp.real(z) * r,
        lambda r, z: torch.sin(r) * z + z.real * r,
        (lambda: torch.randn(4), lambda: _cn(4)),
    ),
    "complex-to-real": (
        lambda z: jnp.abs(z) ** 2 + jnp.angle(z),
        lambda z: z.abs() ** 2 + z.angle(),
        (lambda: _cn(6),),
    ),
}


@pytest.mark.parametrize("residuals", MODES, ids=MODES)
@pytest.mark.parametrize("name", list(FUNCTIONS), ids=list(FUNCTIONS))
def test_jax_function_complex_gradients_match_torch_autograd(name, residuals):
    fn, twin, makers = FUNCTIONS[name]
    args = [make() for make in makers]
    ours, ref = _leaves(*args), _leaves(*args)
    y = jax_function(fn, residuals=residuals)(*ours)
    y_ref = twin(*ref)
    ct = torch.randn_like(y_ref)
    y.backward(ct)
    y_ref.backward(ct)
    torch.testing.assert_close(y.detach(), y_ref.detach())
    for k, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a.grad, b.grad, msg=f"grad of argument {k}")


class ComplexScale(nn.Module):
    """``x * w + conj(w) * |x|``: a complex parameter in a non-holomorphic expression."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", lambda _: jnp.array([0.3 + 0.2j, -0.5 + 1.1j], jnp.complex64))
        return x * w + jnp.conj(w) * jnp.abs(x)


def _twin_scale(x, w):
    return x * w + w.conj() * x.abs()


@pytest.mark.parametrize("residuals", MODES, ids=MODES)
def test_flax_module_complex_parameter_and_input_gradients_match_torch(residuals):
    x = _cn(3, 2)
    m = FlaxModule(ComplexScale(), example_args=(x,), residuals=residuals)
    w = torch.nn.Parameter(m.get_parameter("params.w").detach().clone())
    x1, x2 = _leaves(x, x)
    y1, y2 = m(x1), _twin_scale(x2, w)
    ct = torch.randn_like(y2)
    y1.backward(ct)
    y2.backward(ct)
    torch.testing.assert_close(y1.detach(), y2.detach())
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(m.get_parameter("params.w").grad, w.grad)


class Scale(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("w", lambda _: jnp.array([0.3 + 0.2j], jnp.complex64))


def test_complex_sgd_follows_the_torch_twin():
    """The issue's loss ``|x*w - t|^2``: with JAX's convention |w| ran off to 77."""
    xs = _cn(16)
    t = xs * torch.tensor(1.5 - 0.7j, dtype=torch.complex64)
    m = FlaxModule(Scale(), example_args=(xs,))
    w_twin = torch.nn.Parameter(torch.tensor([0.3 + 0.2j], dtype=torch.complex64))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    opt_twin = torch.optim.SGD([w_twin], lr=0.05)
    for _ in range(50):
        opt.zero_grad()
        ((m(xs) - t).abs() ** 2).mean().backward()
        opt.step()
        opt_twin.zero_grad()
        ((xs * w_twin - t).abs() ** 2).mean().backward()
        opt_twin.step()
    w = m.get_parameter("params.w").detach()
    # Two libraries, 50 steps: the tolerance scales with the size of the weight (no floor:
    # the weight is never near zero, it converges to 1.5 - 0.7j, asserted below).
    scale = w_twin.abs().max().item()
    torch.testing.assert_close(w, w_twin.detach(), rtol=1e-4, atol=1e-4 * scale)
    assert abs(w.item() - (1.5 - 0.7j)) < 0.05  # and it converged


# -- lazy conjugate / negative bits ---------------------------------------------------
VIEWS = {
    "conj": lambda z: z.conj(),
    "neg": lambda z: torch._neg_view(z),
    "conj-neg": lambda z: torch._neg_view(z.conj()),
}


@pytest.mark.parametrize("view", list(VIEWS), ids=list(VIEWS))
def test_lazy_bit_inputs_match_resolved_copies(view):
    x = _cn(5)
    x1, x2 = _leaves(x, x)
    v1 = VIEWS[view](x1)
    assert v1.is_conj() or v1.is_neg()
    v2 = VIEWS[view](x2).resolve_conj().resolve_neg()
    y1 = jax_function(lambda z: jnp.sin(z) * z)(v1)
    y2 = torch.sin(v2) * v2
    ct = torch.randn_like(y2)
    y1.backward(ct)
    y2.backward(ct)
    torch.testing.assert_close(y1.detach(), y2.detach())
    torch.testing.assert_close(x1.grad, x2.grad)


# How ordinary loss code hands a lazy bit to the backward as the cotangent.
LOSSES = {
    "conj-of-output": lambda y, c: (y.conj() * c).real.sum(),
    "neg-of-conj": lambda y, c: (torch._neg_view(y.conj()) * c).real.sum(),
    "abs-squared": lambda y, c: ((y - c).abs() ** 2).sum(),
}


@pytest.mark.parametrize("residuals", MODES, ids=MODES)
@pytest.mark.parametrize("loss", list(LOSSES), ids=list(LOSSES))
def test_lazy_bit_cotangents_match_torch(loss, residuals):
    x, c = _cn(5), _cn(5)
    x1, x2 = _leaves(x, x)
    LOSSES[loss](jax_function(jnp.sin, residuals=residuals)(x1), c).backward()
    LOSSES[loss](torch.sin(x2), c).backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_negative_view_real_cotangent():
    r = torch.randn(3, requires_grad=True)
    ct = torch.randn(3)
    jax_function(lambda x: x * 3.0)(r).backward(torch._neg_view(ct))
    torch.testing.assert_close(r.grad, -3.0 * ct)


def test_flax_module_takes_a_conjugate_view_input():
    x = _cn(2, 2)
    m = FlaxModule(ComplexScale(), example_args=(x,))
    w = m.get_parameter("params.w").detach()
    x1, x2 = _leaves(x, x)
    y1, y2 = m(x1.conj()), _twin_scale(x2.conj(), w)
    ct = torch.randn_like(y2)
    y1.backward(ct)
    y2.backward(ct)
    torch.testing.assert_close(y1.detach(), y2.detach())
    torch.testing.assert_close(x1.grad, x2.grad)
