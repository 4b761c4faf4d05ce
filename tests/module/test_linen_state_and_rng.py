"""Linen state collections (train/eval) and RNG streams through FlaxModule."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from flaxside.internal import key_data_shape, wrap_keys
from tests.support import pipeline
from torchside import FlaxModule


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(6)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return nn.relu(x)


class DropNet(nn.Module):
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, deterministic: bool):
        h = nn.Dense(8)(x)
        # Rematerialized: the backward recomputes the mask, which needs the forward's key.
        h = nn.remat(nn.Dropout, static_argnums=(2,))(self.rate)(h, deterministic)
        return nn.Dense(3)(h)


def _j(t):
    return jnp.asarray(t.detach().numpy())


def _t(a):
    return torch.from_numpy(np.array(a))


def test_batch_stats_are_named_buffers_and_track_pure_flax():
    x0 = torch.zeros(4, 5)
    m = FlaxModule(BNNet(), example_args=(x0,), example_kwargs={"train": False},
                   train_kwarg="train")
    buffers = dict(m.named_buffers())
    assert set(buffers) == {"batch_stats.BatchNorm_0.mean", "batch_stats.BatchNorm_0.var"}
    variables = m.flax_variables()
    variables = jax.tree_util.tree_map(jnp.array, variables)  # our own copy
    m.train()
    for _ in range(3):
        x = torch.randn(4, 5)
        y = m(x)
        ref, updates = BNNet().apply(variables, _j(x), train=True, mutable=["batch_stats"])
        variables = {**variables, **updates}
        torch.testing.assert_close(y.detach(), _t(ref))
        torch.testing.assert_close(m.batch_stats.BatchNorm_0.mean,
                                   _t(variables["batch_stats"]["BatchNorm_0"]["mean"]))
        torch.testing.assert_close(m.batch_stats.BatchNorm_0.var,
                                   _t(variables["batch_stats"]["BatchNorm_0"]["var"]))
    m.eval()
    before = m.batch_stats.BatchNorm_0.mean.clone()
    x = torch.randn(4, 5)
    torch.testing.assert_close(m(x), _t(BNNet().apply(variables, _j(x), train=False)))
    assert torch.equal(m.batch_stats.BatchNorm_0.mean, before)


def test_train_mode_gradients_match_jax():
    m = FlaxModule(BNNet(), example_args=(torch.zeros(4, 5),), example_kwargs={"train": False},
                   train_kwarg="train")
    variables = jax.tree_util.tree_map(jnp.array, m.flax_variables())
    x = torch.randn(4, 5, requires_grad=True)
    ct = torch.randn(4, 6)
    (m(x) * ct).sum().backward()

    def f(params, x):
        return BNNet().apply({**variables, "params": params}, x, train=True,
                             mutable=["batch_stats"])[0]

    _, vjp = jax.vjp(f, variables["params"], _j(x))
    g_params, g_x = vjp(_j(ct))
    torch.testing.assert_close(x.grad, _t(g_x))
    torch.testing.assert_close(m.params.Dense_0.kernel.grad, _t(g_params["Dense_0"]["kernel"]))


def _raw_key_after_seed(seed, n_streams=1):
    torch.manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n_streams, *key_data_shape()), dtype=torch.int32)


def test_dropout_keys_come_from_torch_and_backward_reuses_them():
    x0 = torch.zeros(16, 5)
    m = FlaxModule(DropNet(), example_args=(x0,), example_kwargs={"deterministic": True},
                   rngs=("dropout",), train_kwarg="deterministic")
    m.train()
    variables = jax.tree_util.tree_map(jnp.array, m.flax_variables())
    x = torch.randn(16, 5, requires_grad=True)
    ct = torch.randn(16, 3)
    torch.manual_seed(7)
    y = m(x)
    (y * ct).sum().backward()
    rngs = wrap_keys(jnp.asarray(_raw_key_after_seed(7).numpy()), ("dropout",))

    def f(params, x):
        return DropNet().apply({"params": params}, x, deterministic=False, rngs=rngs)

    ref, vjp = jax.vjp(f, variables["params"], _j(x))
    g_params, g_x = vjp(_j(ct))
    torch.testing.assert_close(y.detach(), _t(ref))
    torch.testing.assert_close(x.grad, _t(g_x))
    torch.testing.assert_close(m.params.Dense_0.kernel.grad, _t(g_params["Dense_0"]["kernel"]))


def test_same_seed_same_run_other_seed_other_masks():
    m = FlaxModule(DropNet(), example_args=(torch.zeros(16, 5),),
                   example_kwargs={"deterministic": True}, rngs="dropout",
                   train_kwarg="deterministic")
    x = torch.randn(16, 5)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(torch.stack([m(x) for _ in range(3)]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0][0], runs[0][1])  # a fresh key every forward
    m.eval()
    torch.testing.assert_close(m(x), m(x))  # deterministic in eval mode


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_dropout_under_torch_checkpoint_matches_plain_call(reentrant):
    m = FlaxModule(DropNet(), example_args=(torch.zeros(16, 5),),
                   example_kwargs={"deterministic": True}, rngs=("dropout",),
                   train_kwarg="deterministic")
    x = torch.randn(16, 5, requires_grad=True)
    ct = torch.randn(16, 3)
    grads = []
    for wrap in (False, True):
        x.grad = None
        m.zero_grad()
        torch.manual_seed(3)
        y = checkpoint(m, x, use_reentrant=reentrant) if wrap else m(x)
        (y * ct).sum().backward()
        grads.append((y.detach(), x.grad.clone(), m.params.Dense_0.kernel.grad.clone()))
    for plain, ckpt in zip(*grads, strict=True):
        torch.testing.assert_close(ckpt, plain)


def test_flax_variables_round_trip_and_mismatch_errors():
    a = FlaxModule(BNNet(), example_args=(torch.zeros(2, 5),), example_kwargs={"train": False},
                   train_kwarg="train", seed=1)
    b = FlaxModule(BNNet(), example_args=(torch.zeros(2, 5),), example_kwargs={"train": False},
                   train_kwarg="train", seed=2)
    shared = a.flax_variables()
    assert shared["params"]["Dense_0"]["kernel"].unsafe_buffer_pointer() == \
        a.params.Dense_0.kernel.data_ptr()
    b.load_flax_variables(shared)
    a.eval()
    b.eval()
    x = torch.randn(3, 5)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)
    wrong = jax.tree_util.tree_map(lambda v: v, dict(shared))
    wrong["params"] = {**wrong["params"], "Dense_0": {**wrong["params"]["Dense_0"],
                                                      "kernel": jnp.zeros((4, 6))}}
    with pytest.raises(ValueError, match=r"'params.Dense_0.kernel' has shape \(4, 6\)"):
        b.load_flax_variables(wrong)
    with pytest.raises(ValueError, match="structure"):
        b.load_flax_variables({"params": shared["params"]})


def test_static_arguments_are_part_of_the_compile_key():
    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, scale, use_bias=True):
            return nn.Dense(3, use_bias=use_bias)(x) * scale

    m = FlaxModule(Scaled(), example_args=(torch.zeros(2, 4), 1.0))
    x = torch.randn(2, 4)
    m(x, 1.0), m(x, 1.0), m(x, 2.0), m(x, 1)
    assert len(pipeline.entries(m)) == 3  # 1.0, 2.0 and the int 1 compile apart
    torch.testing.assert_close(m(x, 2.0), 2 * m(x, 1.0))


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_train_mode_state_with_both_boundary_modes(residuals):
    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x):
            n = self.variable("counter", "n", lambda: jnp.ones((), jnp.float32))
            y = nn.Dense(3)(x) * n.value  # the counter enters the math
            n.value = n.value + 1.0
            return y

    m = FlaxModule(Counter(), example_args=(torch.zeros(2, 4),), residuals=residuals)
    variables = jax.tree_util.tree_map(jnp.array, m.flax_variables())
    for _ in range(2):
        x = torch.randn(2, 4, requires_grad=True)
        ct = torch.randn(2, 3)
        (m(x) * ct).sum().backward()  # the write-back must not break the backward

        def f(params, x, state=variables):
            return Counter().apply({**state, "params": params}, x, mutable=["counter"])[0]

        _, vjp = jax.vjp(f, variables["params"], _j(x))
        torch.testing.assert_close(x.grad, _t(vjp(_j(ct))[1]))
        variables = {**variables, "counter": {"n": variables["counter"]["n"] + 1.0}}
        assert float(m.counter.n) == float(variables["counter"]["n"])
