"""remat_stack of NNX blocks: values and gradients against the blocks in a loop, policies.

Also: NNX with lengths="auto", and state besides Params refused (Linen and NNX).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import flaxside
from flaxside.stacks._lengths import candidate_lengths
from tests.support.stacks import (
    LENGTH_IDS,
    LENGTHS,
    W,
    assert_close,
    data,
    flat_layers,
    jit_vjp,
    relayout,
)
from tests.support.twins import NnxResidualMLPBlock


# -- NNX ----------------------------------------------------------------------------------
@functools.lru_cache
def _nnx_reference(depth: int, seed: int):
    """Float64 NNX parameters (leading axis depth), data, and the vjp of blocks in a loop."""
    dtype = jnp.float64
    with jax.enable_x64(True):
        x, ct = data(dtype, seed)
        stack = flaxside.remat_stack(NnxResidualMLPBlock, depth, rngs=nnx.Rngs(seed), width=W,
                                     dtype=dtype)
        params = nnx.state(stack.layers, nnx.Param)

        def unrolled(params, x):
            for p in flat_layers(params, depth):
                layer = NnxResidualMLPBlock(W, dtype=dtype, rngs=nnx.Rngs(0))
                nnx.update(layer, p)
                x = layer(x)
            return x

        return params, x, ct, jit_vjp(unrolled)(params, x, ct)


def _nnx_check(stack, lead, reference):
    params, x, ct, (ref_out, (ref_grads, ref_gx)) = reference
    nnx.update(stack.layers, relayout(params, lead))
    graphdef, state = nnx.split(stack, nnx.Param)
    out, (grads, gx) = jit_vjp(lambda p, x: nnx.merge(graphdef, p)(x))(state, x, ct)
    assert_close((out, grads["layers"], gx), (ref_out, relayout(ref_grads, lead), ref_gx))


@pytest.mark.parametrize("lengths", LENGTHS, ids=LENGTH_IDS)
def test_nnx_matches_unrolled_layers(lengths):
    with jax.enable_x64(True):
        stack = flaxside.remat_stack(NnxResidualMLPBlock, 8, lengths=lengths, rngs=nnx.Rngs(3),
                                     width=W, dtype=jnp.float64)
        lead = lengths or (8,)
        kernel = stack.layers.fc1.kernel
        assert isinstance(kernel, nnx.Param) and kernel.shape == (*lead, W, 2 * W)
        _nnx_check(stack, lead, _nnx_reference(8, 2))


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_nnx_policies(policy):
    with jax.enable_x64(True):
        stack = flaxside.remat_stack(NnxResidualMLPBlock, 8, lengths=(2, 4), policy=policy,
                                     rngs=nnx.Rngs(0), width=W, dtype=jnp.float64)
        _nnx_check(stack, (2, 4), _nnx_reference(8, 2))


def test_nnx_auto_lengths():
    with jax.enable_x64(True):
        stack = flaxside.remat_stack(NnxResidualMLPBlock, 4, lengths="auto", rngs=nnx.Rngs(3),
                                     width=W, dtype=jnp.float64)
        assert stack.layers.fc1.kernel.shape == (4, W, 2 * W)
        reference = _nnx_reference(4, 2)
        assert stack.choose_lengths(reference[1]).lengths in candidate_lengths(4)
        _nnx_check(stack, (4,), reference)


class _Counter(nn.Module):
    @nn.compact
    def __call__(self, x):
        count = self.variable("stats", "count", jnp.zeros, ())
        count.value += 1
        return nn.Dense(x.shape[-1])(x)


class _NnxDropout(nnx.Module):
    def __init__(self, width, *, rngs):
        self.fc = nnx.Linear(width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.fc(x))


def test_state_besides_params_is_refused():
    x, _ = data(jnp.float32)
    with pytest.raises(NotImplementedError, match=r"collections \['stats'\] besides 'params'"):
        jax.eval_shape(flaxside.remat_stack(_Counter, 4).init, jax.random.key(0), x)
    with pytest.raises(NotImplementedError, match=r"\['drop.rngs.count', 'drop.rngs.key'\]"):
        flaxside.remat_stack(_NnxDropout, 4, rngs=nnx.Rngs(0), width=W)
