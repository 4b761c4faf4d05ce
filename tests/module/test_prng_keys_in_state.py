"""Typed PRNG keys in a Linen collection: held as raw key data, round trip (issue 14).

``self.variable("state", "key", lambda: jax.random.key(0))`` is what Flax's own
``nn.while_loop`` test does. torch holds the key's raw data (int32 bits); the program
wraps it back. Every reference is ``module.apply(..., mutable=[...])`` on the same state.
"""

import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchside import FlaxModule

IMPLS = ["threefry2x32", "rbg"]


class NoisyScale(nn.Module):
    """Splits a key held in ``state`` on every call and scales its input by fresh noise."""

    impl: str = "threefry2x32"

    @nn.compact
    def __call__(self, x):
        key = self.variable("state", "key", lambda: jax.random.key(0, impl=self.impl))
        k1, k2 = jax.random.split(key.value)
        key.value = k1
        return x * jax.random.normal(k2, x.shape)


def _j(t):
    return jnp.asarray(t.detach().numpy())


def _key_bits(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key)).view(np.int32)


def _typed_key(tree) -> bool:
    return jax.dtypes.issubdtype(tree["state"]["key"].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPLS)
def test_train_mode_calls_match_apply_with_mutable_state(impl):
    module = NoisyScale(impl)
    variables = module.init(jax.random.key(1), jnp.zeros(3))
    m = FlaxModule(module, variables=variables)
    key = m.get_buffer("state.key")
    assert key.dtype == torch.int32 and key.shape == jax.random.key_data(
        variables["state"]["key"]).shape
    for call in range(3):
        x = torch.randn(3, requires_grad=True)
        ct = torch.randn(3)
        y = m(x)
        y.backward(ct)

        y_ref, pull, updates = jax.vjp(
            lambda x, v=variables: module.apply(v, x, mutable=["state"]), _j(x), has_aux=True)
        # Same math in one JAX program and op by op: tight, not bitwise (fusion may round).
        np.testing.assert_allclose(y.detach().numpy(), np.asarray(y_ref), rtol=1e-6,
                                   atol=1e-7, err_msg=f"call {call}")
        np.testing.assert_allclose(x.grad.numpy(), np.asarray(pull(_j(ct))[0]), rtol=1e-6,
                                   atol=1e-7, err_msg=f"call {call}")
        variables = {**variables, **updates}
        np.testing.assert_array_equal(m.get_buffer("state.key").numpy(),
                                      _key_bits(variables["state"]["key"]))


def test_init_from_example_args_holds_the_key_as_data():
    m = FlaxModule(NoisyScale(), example_args=(torch.zeros(3),))
    want = NoisyScale().init(jax.random.key(0), jnp.zeros(3))["state"]["key"]
    np.testing.assert_array_equal(m.get_buffer("state.key").numpy(), _key_bits(want))


def _two_calls(m):
    with torch.no_grad():
        m(torch.ones(3))
        m(torch.ones(3))


def test_flax_variables_give_typed_keys_with_the_same_bits():
    module = NoisyScale()
    variables = module.init(jax.random.key(1), jnp.zeros(3))
    m = FlaxModule(module, variables=variables)
    _two_calls(m)
    for _ in range(2):
        _, variables = module.apply(variables, jnp.ones(3), mutable=["state"])
    got = m.flax_variables()
    assert _typed_key(got) and got["state"]["key"].dtype == variables["state"]["key"].dtype
    np.testing.assert_array_equal(_key_bits(got["state"]["key"]),
                                  _key_bits(variables["state"]["key"]))


@pytest.mark.parametrize("route", ["load_flax_variables", "state_dict"],
                         ids=["load_flax_variables", "state_dict"])
def test_key_state_round_trips(route):
    module = NoisyScale()
    variables = module.init(jax.random.key(1), jnp.zeros(3))
    source = FlaxModule(module, variables=variables)
    _two_calls(source)
    target = FlaxModule(module, variables=variables)
    if route == "load_flax_variables":
        target.load_flax_variables(source.flax_variables())
    else:
        buffer = io.BytesIO()
        torch.save(source.state_dict(), buffer)
        buffer.seek(0)
        target.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(target.get_buffer("state.key"), source.get_buffer("state.key"))
    with torch.no_grad():
        assert torch.equal(target(torch.ones(3)), source(torch.ones(3)))
    assert torch.equal(target.get_buffer("state.key"), source.get_buffer("state.key"))


class WhileKey(nn.Module):
    """Flax's ``nn.while_loop`` test with a key: the loop body splits a key held in state."""

    impl: str = "threefry2x32"

    @nn.compact
    def __call__(self, x):
        def cond_fn(mdl, c):
            return mdl.variables["state"]["acc"] < 5

        def body_fn(mdl, c):
            acc = mdl.variable("state", "acc", lambda: jnp.array(0))
            key = mdl.variable("state", "key", lambda: jax.random.key(0, impl=self.impl))
            acc.value += 1
            k1, k2 = jax.random.split(key.value)
            key.value = k1
            return c + jax.random.uniform(k2, c.shape)

        if self.is_mutable_collection("params"):
            return body_fn(self, x)
        return nn.while_loop(cond_fn, body_fn, self, x, carry_variables="state")


@pytest.mark.parametrize("impl", IMPLS, ids=IMPLS)
def test_while_loop_with_a_key_in_state(impl):
    m = FlaxModule(WhileKey(impl), example_args=(torch.zeros(2),))
    variables = m.flax_variables()
    assert _typed_key(variables)
    want, state = WhileKey(impl).apply(variables, jnp.zeros(2), mutable=["state"])
    with torch.no_grad():
        got = m(torch.zeros(2))
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert m.get_buffer("state.acc").item() == int(state["state"]["acc"]) == 5
    np.testing.assert_array_equal(m.get_buffer("state.key").numpy(),
                                  _key_bits(state["state"]["key"]))
