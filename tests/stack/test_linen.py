"""remat_stack (Linen and NNX): values and gradients, layout, policies, memory, errors."""

import functools
import math

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
    B,
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
    ScanStack,
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


def _carry_bytes():
    return B * W * 4


@pytest.mark.parametrize("lengths", [(16,), (2, 2, 4)], ids=["one_level", "three_levels"])
def test_forward_holds_only_the_outer_carries(lengths):
    """Two levels: see test_held_memory_and_program_size_per_depth."""
    x = jax.ShapeDtypeStruct((B, W), jnp.float32)
    report = flaxside.memory_report(flaxside.remat_stack(ResidualMLPBlock, 16, lengths=lengths,
                                                         width=W), x)
    assert report.held_bytes == lengths[0] * _carry_bytes()


def test_innermost_layers_are_checkpointed_too():
    """Inside the backward of an outer step, layers keep their input only, not internals.

    ``nn.remat_scan(Block)`` keeps the internals of its innermost loop's layers; saving
    everything here is what that would cost.
    """
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def backward_temp(policy):
        stack = flaxside.remat_stack(ResidualMLPBlock, 16, lengths=(4, 4), width=16,
                                     policy=policy)
        return flaxside.memory_report(stack, x).backward_temp_bytes

    assert backward_temp(None) < backward_temp("everything_saveable")


def _program_lines(module, x) -> int:
    """Lines of the lowered (StableHLO) training step: what XLA has to compile."""
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    grad = jax.jit(jax.grad(lambda v, x: jnp.vdot(module.apply(v, x), x), argnums=(0, 1)))
    return len(grad.lower(variables, x).as_text().splitlines())


def test_held_memory_and_program_size_per_depth():
    x = jax.ShapeDtypeStruct((B, W), jnp.float32)
    held, scan_held, lines = {}, {}, {}
    for depth in (16, 64, 256):
        a = math.isqrt(depth)
        stack = flaxside.remat_stack(ResidualMLPBlock, depth, lengths=(a, a), width=W)
        report = flaxside.memory_report(stack, x)
        held[depth] = report.held_bytes
        assert held[depth] == a * _carry_bytes()  # the outer level keeps its a carries
        scan_held[depth] = flaxside.memory_report(ScanStack(W, depth), x).held_bytes
        lines[depth] = _program_lines(stack, x)
        print(f"depth {depth}: held {held[depth]} B (scan without remat {scan_held[depth]} B), "
              f"compile {report.compile_seconds:.2f} s, {lines[depth]} lines of StableHLO")
    for small, big in ((16, 64), (64, 256)):
        assert held[big] <= 2.5 * held[small]
        assert scan_held[big] >= 3.5 * scan_held[small]
    # Compile time follows program size, which must not grow with depth (timings are not
    # asserted here: see examples/stack_speed.py and the printed compile seconds).
    assert lines[256] <= 1.1 * lines[16]


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
