"""Stock scans over a mesh: one collective per layer, per rank where the block computes
the same on each rank's rows, run by test_mesh_collectives.py.

Not collected by the main run (no ``test_`` prefix): two host devices, in a subprocess.
Each case builds a ``flaxside`` program of a stock Flax stack (``nn.remat_scan``,
``nn.scan`` with and without ``nn.remat``, ``nnx.scan``) placed ``OnMesh`` over the two
devices, checks its results and gradients against the same program on one device, and
counts each loop body's collectives (NOTE [Packed scans] in ``flaxside/mesh/_packed_scans.py``,
NOTE [Per-rank scans] in ``flaxside/mesh/_per_rank_scans.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from tests.stack.mesh_cases import (
    BatchCentered,
    Dropped,
    N,
    NnxBlock,
    _check,
    _per_rank,
    _programs,
    applied,
    partitioners_route,
)
from tests.support.twins import RematScanStack, ResidualMLPBlock

jtu = jax.tree_util
WIDTH = 16


class Scanned(nn.Module):
    """``block`` (``ResidualMLPBlock``) by ``nn.scan``, remat'd per layer with ``policy`` or
    not."""

    depth: int
    remat: bool
    policy: object = None
    block: type = ResidualMLPBlock

    @nn.compact
    def __call__(self, x):
        block = nn.remat(self.block, policy=self.policy) if self.remat else self.block
        stack = nn.scan(lambda mdl, c, _: (mdl(c), None), variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, length=self.depth)
        return stack(block(WIDTH), x, None)[0]


def _linen(module):
    return applied(module, WIDTH)


def _residual_bytes(program) -> int:
    """What a program keeps for the backward in floating point, bfloat16 included (RNG keys
    are replicated)."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in program.residual_map().residual_specs
               if jnp.issubdtype(s.dtype, jnp.floating))


def _check_stock(fn, leaves, route=_per_rank, rtol=1e-5) -> None:
    """Equal to one device, one gather per loop body (``route``'s), and what the forward
    keeps for the backward each rank's half of what one device keeps: no layer's gathered
    parameters (a scan that kept them would hold the whole block gathered, stacked)."""
    route(_check(fn, leaves, rtol=rtol))
    sharded, whole, *_ = _programs(fn, leaves, 1)
    assert _residual_bytes(sharded) <= _residual_bytes(whole) / N, (
        sharded.residual_map().residual_specs, whole.residual_map().residual_specs)


class CastDense(nn.Module):
    """Computes in bfloat16 from float32 parameters: the kernel's cast is layer-sized."""

    width: int

    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(self.width, dtype=jnp.bfloat16)(x)).astype(x.dtype)


class WeightNorm(nn.Module):
    """A kernel normalized per column before use: computed from the layer alone."""

    width: int

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.lecun_normal(), (self.width, self.width))
        return x + jnp.tanh(x @ (k / jnp.sqrt(jnp.sum(k * k, axis=0))))


STACKS = {
    "remat_scan": lambda: RematScanStack(WIDTH, (2, 3)),
    "scan": lambda: Scanned(4, remat=False),
    "scan-remat": lambda: Scanned(4, remat=True),
    "scan-remat-dots": lambda: Scanned(4, remat=True,
                                       policy=jax.checkpoint_policies.dots_saveable),
    # A policy that saves anything would save each layer gathered but for _refused.
    "scan-remat-everything": lambda: Scanned(
        4, remat=True, policy=jax.checkpoint_policies.everything_saveable),
    "scan-weight-norm": lambda: Scanned(4, remat=False, block=WeightNorm),
}


@pytest.mark.parametrize("name", list(STACKS))
def test_a_stock_linen_stack_gathers_each_layer_in_one_collective(name):
    _check_stock(*_linen(STACKS[name]()))


@pytest.mark.parametrize(("block", "own"), [(BatchCentered, 1), (Dropped, 0)],
                         ids=["batch-mean", "dropout"])
def test_a_stock_stack_not_the_same_per_rank_packs_on_the_partitioners_route(block, own):
    """Per rank, these would compute something else (NOTE [Per-rank scans]): the packed
    gathers stay on the partitioner's route, equal to one device, and a backward body
    reduces the layer's gradients once besides the layer's own reductions."""
    _check_stock(*_linen(Scanned(4, remat=True, block=block)),
                 route=lambda counts: partitioners_route(counts, own))


def test_a_stock_nnx_scan_gathers_each_layer_in_one_collective():
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return NnxBlock(WIDTH, rngs=rngs)

    graphdef, state = nnx.split(make(nnx.Rngs(0)))
    leaves, treedef = jtu.tree_flatten(state)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4 * N, WIDTH)), jnp.float32)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(layer, c):
        return layer(c)

    def fn(ls):
        return run(nnx.merge(graphdef, jtu.tree_unflatten(treedef, ls[:-1])), ls[-1]), [], None

    _check_stock(fn, [*leaves, x])


def test_without_packing_the_count_finds_a_gather_per_parameter(monkeypatch):
    """The negative control: with ``OnMesh.call`` calling the function as it is, XLA's
    partitioner gathers each parameter of a layer on its own and reduces their gradients
    in several collectives, and the count sees both."""
    from flaxside.mesh._on_mesh import OnMesh

    monkeypatch.setattr(OnMesh, "call", lambda self, fn, read: fn(read))
    counts = _check(*_linen(STACKS["scan"]()))
    assert max(ops.count("all-gather") for ops in counts["forward_with_residuals"]) > 1, counts
    # The gradients reduced one by one too: the bound ``partitioners_route`` sets on them
    # fails here, as does the route's check as a whole.
    assert max(ops.count("all-reduce") + ops.count("reduce-scatter")
               for ops in counts["backward"]) > 1, counts
    with pytest.raises(AssertionError):
        partitioners_route(counts)


def test_a_layer_computing_in_bfloat16_keeps_its_cast_kernels_sharded():
    """The kernel's bfloat16 cast is layer-sized: kept for the backward, every layer's would
    be (NOTE [Packed scans]). bfloat16's rounding differs per shape: its tolerance."""
    _check_stock(*_linen(Scanned(4, remat=False, block=CastDense)), rtol=2e-2)


def _scanned_tanh(scale, size=False):
    """A scan of ``tanh(c @ w) * scale(c)`` over a stack of 4 kernels (and the batch's size,
    a Python int, as a second output where ``size``), and its leaves."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((4, WIDTH, WIDTH)) / WIDTH ** 0.5, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4 * N, WIDTH)), jnp.float32)

    def fn(ls):
        def body(c, wl):
            return jnp.tanh(c @ wl) * scale(c), None

        y = jax.lax.scan(body, ls[1], ls[0])[0]
        return ((y, ls[1].shape[0]) if size else y), [], None

    return fn, [w, x]


def test_a_python_result_read_from_the_batch_size_keeps_the_whole_batchs_value():
    """Traced on one rank's rows the function returns another Python value: not per rank."""
    sharded, _, placed, *_ = _programs(*_scanned_tanh(lambda c: 1.0, size=True), 1)
    assert int(sharded.compiled("forward_with_residuals")(placed)[1]) == 4 * N


def test_a_constant_computed_from_the_batch_size_keeps_the_partitioners_route():
    """The constant is the jaxpr's, compared by value: per rank it would be twice as large."""
    fn, leaves = _scanned_tanh(lambda c: np.full((WIDTH,), 8.0 / c.shape[0], np.float32))
    partitioners_route(_check(fn, leaves))
