"""remat_stack of Linen blocks: values and gradients, layout, policies, RNG streams, errors.

Every stack is compared with the same blocks unrolled in a Python loop (float64, so that
only a wrong layer order or a lost gradient shows). NNX blocks: stack/test_nnx.py; held
memory and program size: stack/test_memory.py; lengths="auto": stack/test_auto_lengths.py.
"""

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxside
from tests.support.stacks import (
    LENGTH_IDS,
    LENGTHS,
    W,
    assert_close,
    data,
    flat_layers,
    jit_vjp,
    relayout,
    unrolled_linen,
)
from tests.support.twins import (
    NnxResidualMLPBlock,
    RematScanStack,
    ResidualMLPBlock,
    ScanRematStack,
)

jtu = jax.tree_util


@functools.lru_cache
def _linen_reference(depth: int, seed: int):
    """Float64 parameters (leading axis depth), data, and the unrolled layers' vjp."""
    with jax.enable_x64(True):
        x, ct = data(jnp.float64, seed)
        stack = flaxside.remat_stack(ResidualMLPBlock, depth, width=W, dtype=jnp.float64)
        params = stack.init(jax.random.key(seed), x)["params"]
        ref = jit_vjp(unrolled_linen(ResidualMLPBlock(W, jnp.float64), depth))
        return params, x, ct, ref(params, x, ct)


@pytest.mark.parametrize("lengths", LENGTHS, ids=LENGTH_IDS)
def test_linen_matches_unrolled_layers(lengths):
    params, x, ct, (ref_out, (ref_grads, ref_gx)) = _linen_reference(8, 0)
    with jax.enable_x64(True):
        stack = flaxside.remat_stack(ResidualMLPBlock, 8, lengths=lengths, width=W,
                                     dtype=jnp.float64)
        lead = lengths or (8,)
        out, (grads, gx) = jit_vjp(lambda p, x: stack.apply({"params": p}, x))(
            relayout(params, lead), x, ct)
    assert_close((out, grads, gx), (ref_out, relayout(ref_grads, lead), ref_gx))


@pytest.mark.parametrize(
    "lengths, flax_stack",
    [((8,), ScanRematStack(W, 8, jnp.float64)), ((2, 4), RematScanStack(W, (2, 4), jnp.float64))],
    ids=["scan_remat", "remat_scan"],
)
def test_layout_matches_flax_lifts_and_so_do_their_gradients(lengths, flax_stack):
    """Same parameter names and shapes as Flax's lifts; they match the unrolled reference too."""
    params, x, ct, (ref_out, (ref_grads, ref_gx)) = _linen_reference(8, 0)
    with jax.enable_x64(True):
        stack = flaxside.remat_stack(ResidualMLPBlock, 8, lengths=lengths, width=W,
                                     dtype=jnp.float64)
        ours = jax.eval_shape(stack.init, jax.random.key(0), x)["params"]
        flax_params = jax.eval_shape(flax_stack.init, jax.random.key(0), x)["params"]["stack"]
        assert jtu.tree_map(jnp.shape, ours) == jtu.tree_map(jnp.shape, flax_params)
        out, (grads, gx) = jit_vjp(lambda p, x: flax_stack.apply({"params": {"stack": p}}, x))(
            relayout(params, lengths), x, ct)
    assert_close((out, grads, gx), (ref_out, relayout(ref_grads, lengths), ref_gx))


@pytest.mark.parametrize("policy", [*flaxside.policy_names(), "callable"])
def test_every_policy_gives_the_gradients_of_no_remat(policy):
    if policy == "callable":
        policy = jax.checkpoint_policies.save_only_these_names("nothing_named")
    params, x, ct, want = _linen_reference(8, 0)
    with jax.enable_x64(True):
        stack = flaxside.remat_stack(ResidualMLPBlock, 8, lengths=(2, 4), policy=policy,
                                     width=W, dtype=jnp.float64)
        out, (grads, gx) = jit_vjp(lambda p, x: stack.apply({"params": p}, x))(
            relayout(params, (2, 4)), x, ct)
    assert_close((out, (grads, gx)), (want[0], (relayout(want[1][0], (2, 4)), want[1][1])))


class _Noisy(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1])(nn.Dropout(0.5, deterministic=False)(x))


def _stream_key(seed):
    """The key a top-level module's first make_rng('dropout') yields for key(seed)."""

    class Probe(nn.Module):
        @nn.compact
        def __call__(self):
            return jax.random.key_data(self.make_rng("dropout"))

    return jax.random.wrap_key_data(Probe().apply({}, rngs={"dropout": jax.random.key(seed)}))


def test_instance_block_and_rng_streams():
    """An unbound instance works; layer i draws dropout from fold_in(make_rng, i)."""
    x, ct = data(jnp.float32)
    stack = flaxside.remat_stack(_Noisy(), 6, lengths=(2, 3))
    variables = jax.jit(stack.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                    x)

    def run(p, x, seed):
        return stack.apply({"params": p}, x, rngs={"dropout": jax.random.key(seed)})

    def unrolled(p, x):
        for i, layer_p in enumerate(flat_layers(p, 6)):
            rng = jax.random.fold_in(_stream_key(2), i)
            x = _Noisy().apply({"params": layer_p}, x, rngs={"dropout": rng})
        return x

    got = jit_vjp(lambda p, x: run(p, x, 2))(variables["params"], x, ct)
    assert_close(got, jit_vjp(unrolled)(variables["params"], x, ct))
    assert not np.allclose(got[0], jax.jit(run, static_argnums=2)(variables["params"], x, 3))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lengths=(3, 4)), ValueError, r"multiply to 12, but depth is 16"),
        (dict(lengths=(4, 0, 4)), ValueError, r"at least 1"),
        (dict(lengths=(4.0, 4)), TypeError, r"tuple of ints"),
        (dict(lengths="deep"), ValueError, r"'auto', None or a tuple"),
        (dict(lengths=(4, 4), memory_budget=10**6), ValueError, r"only used with lengths='auto'"),
        (dict(policy="dots_saveable_typo"), ValueError, r"expected one of \[.*'dots_saveable'"),
        (dict(policy="save_only_these_names"), ValueError, r"factory that needs arguments"),
        (dict(policy=3), TypeError, r"'policy' is a int"),
    ],
    ids=["product", "zero", "float", "unknown_string", "budget_without_auto", "policy_name",
         "policy_factory", "policy_type"],
)
def test_invalid_options_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        flaxside.remat_stack(ResidualMLPBlock, 16, width=W, **kwargs)


def test_invalid_block_and_stored_params_raise():
    with pytest.raises(TypeError, match="argument 'block'"):
        flaxside.remat_stack(lambda x: x, 4)
    with pytest.raises(ValueError, match="rngs= is needed"):
        flaxside.remat_stack(NnxResidualMLPBlock, 4, width=W)
    x, _ = data(jnp.float32)
    params = jax.eval_shape(flaxside.remat_stack(ResidualMLPBlock, 16, lengths=(2, 8),
                                                 width=W).init, jax.random.key(0), x)
    other = flaxside.remat_stack(ResidualMLPBlock, 16, lengths=(4, 4), width=W)
    with pytest.raises(flax.errors.ScopeParamShapeError, match=r"\(4, 4, 16\).*\(2, 8, 16\)"):
        jax.eval_shape(other.apply, params, x)


class Scaled(nn.Module):
    """A block whose fields share names with remat_stack's own arguments."""

    depth: int
    policy: float

    @nn.compact
    def __call__(self, x):
        return x + self.policy * jnp.tanh(nn.Dense(x.shape[-1])(x)) / self.depth


def test_block_fields_named_like_remat_stack_arguments():
    x = jnp.ones((2, 4))
    stack = flaxside.remat_stack(Scaled, 4, lengths=(2, 2), depth=3,
                                 block_kwargs={"policy": 0.5})
    variables = stack.init(jax.random.key(0), x)
    layers = [jax.tree_util.tree_map(lambda a, i=i: a.reshape(4, *a.shape[2:])[i],
                                     variables["params"]) for i in range(4)]
    want = x
    for p in layers:
        want = Scaled(depth=3, policy=0.5).apply({"params": p}, want)
    np.testing.assert_allclose(stack.apply(variables, x), want, rtol=1e-6, atol=1e-6)
