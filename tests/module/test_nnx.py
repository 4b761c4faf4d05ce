"""NNX modules through FlaxModule: names, gradients against nnx.grad, state, RNG."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.support.twins import NnxDropoutMLP, NnxResidualMLPBlock
from torchside import FlaxModule


def _t(a):
    return torch.from_numpy(np.array(a))


MLP = NnxDropoutMLP


class ScanRematStack(nnx.Module):
    """Layers made with nnx.vmap + split_rngs; applied with nnx.scan over nnx.remat.

    The stack NNX users write by hand (``flaxside.remat_stack`` builds its own).
    """

    def __init__(self, width, depth, rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxResidualMLPBlock(width, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def body(layer, h):
            return layer(h)

        return body(self.layers, x)


def _grads_by_nnx(model, x, ct):
    def loss(model, x):
        return jnp.sum(model(x) * ct)

    return nnx.grad(loss, argnums=(0, 1))(model, x)


def test_names_are_attribute_paths_and_params_are_parameters():
    m = FlaxModule(MLP(nnx.Rngs(0)))
    params = dict(m.named_parameters())
    buffers = dict(m.named_buffers())
    assert {"fc1.kernel", "fc1.bias", "bn.scale", "fc2.kernel"} <= set(params)
    assert {"bn.mean", "bn.var", "drop.rngs.key", "drop.rngs.count"} <= set(buffers)
    # torch holds NNX's uint32 key data as int32 bits (a pickled uint32 tensor does not load
    # and gloo cannot broadcast one); flax_variables() gives back NNX's own uint32 values.
    assert buffers["drop.rngs.key"].dtype == torch.int32
    want = nnx.state(MLP(nnx.Rngs(0)), nnx.RngKey)
    _, rest = m.flax_variables()
    got_key = rest["drop"]["rngs"]["key"][...]
    want_key = want["drop"]["rngs"]["key"][...]
    assert jax.random.key_data(got_key).dtype == jnp.uint32
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(want_key))


def test_scan_remat_stack_gradients_equal_nnx_grad():
    model = ScanRematStack(8, 6, nnx.Rngs(1))
    m = FlaxModule(model)
    assert dict(m.named_parameters())["layers.fc1.kernel"].shape == (6, 8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    ct = torch.randn(4, 8)
    y = m(x)
    (y * ct).sum().backward()
    g_model, g_x = _grads_by_nnx(model, jnp.asarray(x.detach().numpy()), jnp.asarray(ct.numpy()))
    torch.testing.assert_close(y.detach(), _t(model(jnp.asarray(x.detach().numpy()))))
    torch.testing.assert_close(x.grad, _t(g_x))
    g_state = nnx.state(g_model, nnx.Param)
    for path, g in jax.tree_util.tree_flatten_with_path(g_state)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path[:-1])
        torch.testing.assert_close(dict(m.named_parameters())[name].grad, _t(g), msg=name)


def test_batchnorm_statistics_follow_pure_nnx_in_train_mode():
    model = MLP(nnx.Rngs(0, dropout=1))
    model.drop.rate = 0.0  # no randomness: compare statistics only
    m = FlaxModule(model)
    reference = nnx.clone(model)
    reference.train()
    for _ in range(3):
        x = torch.randn(6, 5)
        torch.testing.assert_close(m(x).detach(), _t(reference(jnp.asarray(x.numpy()))))
    torch.testing.assert_close(m.bn.mean, _t(reference.bn.mean[...]))
    torch.testing.assert_close(m.bn.var, _t(reference.bn.var[...]))
    m.eval()
    reference.eval()
    before = m.bn.mean.clone()
    x = torch.randn(6, 5)
    torch.testing.assert_close(m(x), _t(reference(jnp.asarray(x.numpy()))))
    assert torch.equal(m.bn.mean, before)


class Drop(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(5, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.fc(x))


def test_dropout_streams_drawn_from_torch_seed():
    m = FlaxModule(Drop(nnx.Rngs(0, dropout=1)), rngs=("dropout",))
    x = torch.randn(6, 5)
    torch.manual_seed(4)
    a = m(x)
    torch.manual_seed(4)
    b = m(x)
    c = m(x)
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_nnx_rejects_linen_only_options():
    with pytest.raises(ValueError, match="train_kwarg"):
        FlaxModule(MLP(nnx.Rngs(0)), train_kwarg="train")


class FastWeights(nnx.Module):
    """Uses its kernel, then assigns it inside the forward (a fast-weights update)."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        y = self.norm(self.fc(x))
        self.fc.kernel[...] = self.fc.kernel[...] * 0.5 + jnp.tanh(x.T @ y) * 0.1
        return y * self.fc.kernel[...].sum()


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_param_assigned_in_forward_is_written_back_with_nnx_gradients(train, residuals):
    model = FastWeights(nnx.Rngs(0))
    wrapped = FlaxModule(FastWeights(nnx.Rngs(0)), residuals=residuals)
    wrapped.train(train)
    model.train() if train else model.eval()
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # the second and later calls run the copied-Param programs
        # x requires grad, so the backward needs the kernel as it was before the assignment
        x = torch.randn(6, 4, generator=gen, dtype=torch.float32).requires_grad_()
        cot = torch.randn(6, 4, generator=gen, dtype=torch.float32)
        for p in wrapped.parameters():
            p.grad = None
        y = wrapped(x)
        y.backward(cot)

        cot_jax = jnp.asarray(cot.numpy())

        def loss(m, xs, cot_jax=cot_jax):
            return jnp.vdot(m(xs), cot_jax)

        # nnx.grad also applies the forward's assignment to model, as NNX does
        grads, grad_x = nnx.grad(loss, argnums=(0, 1))(model, jnp.asarray(x.detach().numpy()))
        np.testing.assert_allclose(x.grad.numpy(), np.asarray(grad_x), rtol=1e-4, atol=1e-5)
        params = dict(wrapped.named_parameters())
        for name in ("fc.kernel", "fc.bias", "norm.scale", "norm.bias"):
            layer, leaf = name.split(".")
            value = getattr(getattr(model, layer), leaf)[...]  # after NNX's own assignment
            np.testing.assert_allclose(params[name].detach().numpy(), np.asarray(value),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{name} at step {step}")
            np.testing.assert_allclose(params[name].grad.numpy(),
                                       np.asarray(grads[layer][leaf][...]),
                                       rtol=1e-4, atol=1e-5, err_msg=f"grad {name} at {step}")
    np.testing.assert_allclose(wrapped.get_buffer("norm.mean").numpy(),
                               np.asarray(model.norm.mean[...]), rtol=1e-5, atol=1e-6)


class GrowsParams(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        self.extra = nnx.Param(jnp.ones(4))  # a Param made in the forward: torch can't own it
        return self.fc(x) * self.extra[...]


def test_param_created_in_forward_is_refused_with_the_fix():
    wrapped = FlaxModule(GrowsParams(nnx.Rngs(0)))
    with pytest.raises(NotImplementedError, match=r"adds or removes nnx.Param.*2 before the "
                                                  r"call, 3 after.*__init__"):
        wrapped(torch.randn(2, 4))
