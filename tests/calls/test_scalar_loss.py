"""A loss computed inside the block: one fused value-and-grad program (NOTE [Scalar loss]).

With ``residuals="save"`` a grad-enabled eager call whose one differentiable output is a
real scalar runs the loss and its gradients in one program at forward, holds the gradient
buffers, and scales them by the incoming gradient at backward. Every test compares with
pure JAX (``jax.value_and_grad``) or with the two-program route (``residuals="split"``),
with random cotangents.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
import bridge.internal
from flaxside.internal import key_data_shape, wrap_keys
from torchside import FlaxModule, jax_function


class LossNet(nn.Module):
    """Dense -> BatchNorm -> Dropout -> tanh -> Dense, mean squared error inside."""

    @nn.compact
    def __call__(self, x, y, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.7)(nn.Dense(16)(x))
        h = nn.Dropout(0.3, deterministic=not train)(jnp.tanh(h))
        err = nn.Dense(3)(h) - y
        # A second output that needs no gradient: an int count, as metrics often are.
        return jnp.mean(err**2), jnp.sum(jnp.abs(err) < 0.5)


def _module(residuals):
    torch.manual_seed(0)
    return FlaxModule(LossNet(), example_args=(torch.zeros(2, 5), torch.zeros(2, 3)),
                      rngs=("dropout",), train_kwarg="train", residuals=residuals)


def _key_after_seed(seed):
    """The dropout key a call draws after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31 - 1, (1, *key_data_shape()), dtype=torch.int32)
    return wrap_keys(jnp.asarray(raw.numpy()), ("dropout",))


def _pure(variables, x, y, rngs):
    """Pure JAX: ``value_and_grad`` of the Linen loss, and the batch statistics after it."""

    def loss(params, x):
        (value, _), state = LossNet().apply({**variables, "params": params}, x, y, rngs=rngs,
                                            mutable=["batch_stats"])
        return value, state

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables["params"], x)


def _j(t):
    return jnp.asarray(t.detach().numpy())


def _close(actual: torch.Tensor, expected, scale=None) -> None:
    """Equal up to float32 rounding, relative to ``scale`` (default: ``expected``'s largest).

    Gradients pass the largest of all: a bias in front of a BatchNorm has an exact
    gradient of zero, which each program rounds to its own tiny noise.
    """
    expected = torch.from_numpy(np.array(expected))
    scale = scale or float(expected.abs().max()) or 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale)


def _at(tree, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


@pytest.fixture(params=["views", "dlpack"])
def route(request):
    previous = bridge.set_exchange_mode("auto" if request.param == "views" else "dlpack")
    yield request.param
    bridge.set_exchange_mode(previous)


@pytest.mark.parametrize("residuals", ["save", "split"])
def test_loss_gradients_and_state_equal_pure_jax_for_a_random_cotangent(route, residuals):
    module = _module(residuals)
    variables = jax.tree.map(jnp.array, module.flax_variables())  # copies, before the call
    x, y, c = torch.randn(6, 5, requires_grad=True), torch.randn(6, 3), torch.randn(())
    torch.manual_seed(1)
    loss, hits = module(x, y)
    assert hits.dtype == torch.int32 and not hits.requires_grad
    loss.backward(c)
    (value, state), (g_params, g_x) = _pure(variables, _j(x), _j(y), _key_after_seed(1))
    _close(loss.detach(), value)
    scale = abs(c.item()) * max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_params))
    _close(x.grad, c.item() * g_x)
    names = [n for n, _ in module.named_parameters()]
    assert len(names) == len(jax.tree.leaves(g_params)) == 6  # 2 Dense, 1 BatchNorm
    for name, p in module.named_parameters():
        _close(p.grad, c.item() * _at(g_params, name.removeprefix("params.")), scale)
    for name, b in module.named_buffers():
        _close(b, _at(state, name))


def _saved_bytes(call, exclude) -> int:
    """Bytes autograd saves for backward during ``call()``, beyond ``exclude``'s storages."""
    known = {t.untyped_storage().data_ptr() for t in exclude}
    held = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    return sum(held.values()), out


def test_the_fused_route_holds_the_gradients_and_runs_one_program(route):
    # memory_report counts every floating argument as requiring grad: so does this call.
    x, y = torch.randn(6, 5, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    held = {}
    for residuals in ("save", "split"):
        module = _module(residuals)
        with bridge.internal.record_ordering() as log:
            held[residuals], (loss, _) = _saved_bytes(
                lambda m=module: m(x, y), [*module.parameters(), *module.buffers(), x, y])
            log.append("backward")
            loss.backward()
        runs = [e if e == "backward" else e.detail for e in log
                if e == "backward" or e.kind == "run"]
        report = module.memory_report(x, y)
        assert report.held_bytes == held[residuals], residuals
        if route == "dlpack":
            expected = (["value_and_grad", "backward"] if residuals == "save" else
                        ["forward_with_residuals", "backward", "backward"])
            assert runs == expected, runs
    # The gradients of the 6 parameters and of both arguments.
    grad_bytes = 4 * (sum(p.numel() for p in _module("save").parameters()) + x.numel()
                      + y.numel())
    assert held["save"] == grad_bytes
    assert held["split"] != grad_bytes


@pytest.mark.parametrize("cotangent", [1.0, -0.7])
def test_a_freed_graph_hands_its_gradient_buffers_over_without_a_copy(route, cotangent):
    """Without ``retain_graph`` the saved buffers become ``.grad`` (scaled in place).

    Nothing reads them after a backward that frees the graph; a second backward raises
    torch's own error, and existing ``.grad`` (zeroed in place) is accumulated into.
    """
    grads, storages = {}, set()

    def pack(t):
        storages.add(t.untyped_storage().data_ptr())
        return t

    for residuals in ("save", "split", "save"):
        module = _module(residuals)
        x, y = torch.randn(6, 5), torch.randn(6, 3)
        torch.manual_seed(2)
        storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = module(x, y)
        if residuals in grads:  # the second "save" module: .grad exists, zeroed in place
            for p in module.parameters():
                p.grad = torch.full_like(p, 0.25)
        (loss * cotangent).backward()
        if residuals == "save" and residuals not in grads:
            for p in module.parameters():  # .grad lies in a buffer the call saved
                assert p.grad.untyped_storage().data_ptr() in storages
            with pytest.raises(RuntimeError, match="second time"):
                loss.backward()
            grads[residuals] = [p.grad.clone() for p in module.parameters()]
        elif residuals == "split":
            grads[residuals] = [p.grad for p in module.parameters()]
        else:
            accumulated = [p.grad for p in module.parameters()]
    scale = max(float(a.abs().max()) for a in grads["split"])
    for a_save, a_split, acc in zip(grads["save"], grads["split"], accumulated, strict=True):
        torch.testing.assert_close(a_save, a_split, rtol=1e-5, atol=1e-6 * scale)
        torch.testing.assert_close(acc, a_save + 0.25, rtol=1e-6, atol=1e-7 * scale)


def test_a_second_backward_of_a_retained_graph_accumulates_like_torch(route):
    grads = {}
    for residuals in ("save", "split"):
        module = _module(residuals)
        x, y = torch.randn(6, 5), torch.randn(6, 3)
        torch.manual_seed(2)
        loss, _ = module(x, y)
        loss.backward(retain_graph=True)  # a cotangent of one
        once = [p.grad.clone() for p in module.parameters()]
        loss.backward(torch.tensor(0.5))
        grads[residuals] = [(a, p.grad) for a, p in zip(once, module.parameters(), strict=True)]
    scale = max(float(a.abs().max()) for a, _ in grads["split"])
    for (a_save, b_save), (a_split, b_split) in zip(grads["save"], grads["split"], strict=True):
        torch.testing.assert_close(a_save, a_split, rtol=1e-5, atol=1e-6 * scale)
        torch.testing.assert_close(b_save, 1.5 * a_save, rtol=1e-6, atol=1e-7 * scale)
        torch.testing.assert_close(b_save, b_split, rtol=1e-5, atol=1e-6 * scale)


def test_every_backward_of_a_retained_graph_and_in_place_zeroing_between(route):
    """Gradients torch accumulated into, or an optimizer zeroed in place, are never read back.

    Three backwards of one graph (the second and third accumulate into ``.grad``), with
    ``zero_grad(set_to_none=False)`` (an in-place zero) before the last: what torch does.
    """
    grads = {}
    for residuals in ("save", "split"):
        module = _module(residuals)
        opt = torch.optim.SGD(module.parameters(), lr=0.0)
        x, y = torch.randn(6, 5), torch.randn(6, 3)
        torch.manual_seed(2)
        loss, _ = module(x, y)
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        twice = [p.grad.clone() for p in module.parameters()]
        opt.zero_grad(set_to_none=False)
        loss.backward(torch.tensor(-2.0))
        grads[residuals] = [(a, p.grad) for a, p in zip(twice, module.parameters(), strict=True)]
    scale = max(float(a.abs().max()) for a, _ in grads["split"])
    for (a_save, b_save), (a_split, b_split) in zip(grads["save"], grads["split"], strict=True):
        torch.testing.assert_close(a_save, a_split, rtol=1e-5, atol=1e-6 * scale)
        torch.testing.assert_close(b_save, b_split, rtol=1e-5, atol=1e-6 * scale)
        torch.testing.assert_close(b_save, -a_save, rtol=1e-6, atol=1e-7 * scale)


def test_jax_function_losses_with_one_and_with_two_scalar_outputs(route):
    w = torch.randn(5, 4, requires_grad=True)
    x = torch.randn(8, 5)

    def pure(w, x):
        h = jnp.tanh(x @ w)
        return jnp.mean(h**2), jnp.sum(h)

    one = jax_function(lambda w, x: pure(w, x)[0])
    two = jax_function(pure)
    c1, c2 = torch.randn(()), torch.randn(())
    one(w, x).backward(c1)
    g_one = w.grad
    w.grad = None
    a, b = two(w, x)
    (a * c1 + b * c2).backward()
    _, vjp = jax.vjp(lambda w: pure(w, _j(x)), _j(w))
    (expected_two,) = vjp((jnp.float32(c1.item()), jnp.float32(c2.item())))
    (expected_one,) = vjp((jnp.float32(c1.item()), jnp.float32(0.0)))
    _close(g_one, expected_one)
    _close(w.grad, expected_two)


def test_no_gradient_no_fused_program():
    """Evaluation (``no_grad``) runs the plain forward: no gradients computed for nothing."""
    previous = bridge.set_exchange_mode("dlpack")
    try:
        module = _module("save").eval()
        with bridge.internal.record_ordering() as log, torch.no_grad():
            loss, _ = module(torch.randn(6, 5), torch.randn(6, 3))
        assert [e.detail for e in log if e.kind == "run"] == ["forward"]
    finally:
        bridge.set_exchange_mode(previous)


@jax.custom_vjp
def _sign_grad(w):
    return w


_sign_grad.defvjp(lambda w: (w, None), lambda _, g: (jnp.sign(g),))


@pytest.mark.parametrize("kind", ["custom_vjp", "float16"])
def test_losses_whose_gradient_does_not_scale_keep_two_programs(kind):
    """``sign(c * g) != c * sign(g)``; float16 gradients for a cotangent of one underflow."""
    if kind == "custom_vjp":
        def loss(w, x):
            return jnp.sum(jnp.tanh(x @ _sign_grad(w)))
    else:
        def loss(w, x):
            return jnp.sum(jnp.tanh(x.astype(jnp.float16) @ w.astype(jnp.float16))
                           .astype(jnp.float32) * 1e-4)
    w, x, c = torch.randn(5, 4, requires_grad=True), torch.randn(8, 5), torch.tensor(-3e4)
    previous = bridge.set_exchange_mode("dlpack")
    try:
        with bridge.internal.record_ordering() as log:
            jax_function(loss)(w, x).backward(c)
    finally:
        bridge.set_exchange_mode(previous)
    assert [e.detail for e in log if e.kind == "run"] == ["forward_with_residuals", "backward"]
    _, vjp = jax.vjp(lambda w: loss(w, _j(x)), _j(w))
    expected = torch.from_numpy(np.array(vjp(jnp.float32(c.item()))[0]))
    # float16 products: the two programs may round their float16 steps apart on another CPU.
    tol = 1e-5 if kind == "custom_vjp" else 2e-3
    torch.testing.assert_close(w.grad, expected, rtol=tol,
                               atol=tol * float(expected.abs().max()))


def test_a_bfloat16_loss_takes_the_fused_route():
    """bfloat16 keeps float32's exponent range, so its gradients scale like float32's: a
    bfloat16 loss (autocast, FSDP2's bfloat16 policy) runs one program. It fell back to two
    when the dtype check read bfloat16 as not floating."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w = torch.randn(5, 4, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(8, 5, dtype=torch.bfloat16)
    previous = bridge.set_exchange_mode("dlpack")
    try:
        with bridge.internal.record_ordering() as log:
            jax_function(loss)(w, x).backward(torch.tensor(2.0, dtype=torch.bfloat16))
    finally:
        bridge.set_exchange_mode(previous)
    assert [e.detail for e in log if e.kind == "run"] == ["value_and_grad"]
    def bf16(t):
        return _j(t.float()).astype(jnp.bfloat16)

    _, vjp = jax.vjp(lambda w: loss(w, bf16(x)), bf16(w))
    expected = torch.from_numpy(np.asarray(vjp(jnp.bfloat16(2.0))[0], dtype=np.float32))
    # Pure JAX op by op against one fused program, both in bfloat16 (8 significant bits):
    # a few roundings apart, relative to the gradient's size.
    scale = float(expected.abs().max())
    torch.testing.assert_close(w.grad.float(), expected, rtol=0, atol=2**-6 * scale)
