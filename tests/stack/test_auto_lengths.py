"""remat_stack(lengths="auto"): candidate nestings measured, the least memory picked.

With ``memory_budget=`` the fewest levels that fit are picked from the same measured table.
"""

import math

import jax
import jax.numpy as jnp
import pytest

import flaxside
from flaxside.stacks._lengths import candidate_lengths, factorizations, pick_lengths
from tests.support.stacks import W, assert_close, data, jit_vjp, unrolled_linen
from tests.support.twins import ResidualMLPBlock


def test_factorizations():
    assert factorizations(16, 2) == [(2, 8), (4, 4), (8, 2)]
    assert sorted(factorizations(8, 3)) == [(2, 2, 2)]
    assert all(math.prod(f) == 1024 for f in candidate_lengths(1024))
    assert candidate_lengths(16)[:4] == [(16,), (4, 4), (2, 8), (8, 2)]
    assert candidate_lengths(7) == [(7,)]


def test_auto_measures_candidates_and_picks_the_least_memory():
    x, ct = data(jnp.float32, seed=4)
    stack = flaxside.remat_stack(ResidualMLPBlock, 4, lengths="auto", width=W)
    choice = stack.choose_lengths(x)
    assert [row[0] for row in choice.table] == candidate_lengths(4) == [(4,), (2, 2)]
    cost = {f: held + temp for f, held, temp, _ in choice.table}
    assert cost[choice.lengths] == min(cost.values())
    assert str(choice.lengths) in choice.reason and "<- chosen" in str(choice)
    # the module uses it; parameters keep one leading axis of depth
    params = jax.jit(stack.init)(jax.random.key(0), x)["params"]
    assert params["Dense_0"]["kernel"].shape == (4, W, 2 * W)
    got = jit_vjp(lambda p, x: stack.apply({"params": p}, x))(params, x, ct)
    assert_close(got, jit_vjp(unrolled_linen(ResidualMLPBlock(W), 4))(params, x, ct))


def test_budget_picks_the_fewest_levels_that_fit():
    table = [((8,), 800, 100, 0.1), ((2, 4), 200, 150, 0.1), ((4, 2), 400, 120, 0.1),
             ((2, 2, 2), 200, 100, 0.1)]
    assert pick_lengths(table, 8).lengths == (2, 2, 2)
    assert pick_lengths(table, 8, memory_budget=900).lengths == (8,)
    assert pick_lengths(table, 8, memory_budget=899).lengths == (2, 4)
    assert pick_lengths(table, 8, memory_budget=300).lengths == (2, 2, 2)
    assert "fit memory_budget" in pick_lengths(table, 8, memory_budget=899).reason
    with pytest.raises(ValueError, match="no nesting of depth 8 fits memory_budget=299 "):
        pick_lengths(table, 8, memory_budget=299)


def test_auto_with_budget_end_to_end():
    """A budget reuses the measured table (no new compiles) and picks the fewest levels."""
    x, _ = data(jnp.float32)
    free = flaxside.remat_stack(ResidualMLPBlock, 4, lengths="auto", width=W).choose_lengths(x)
    cost = {f: held + temp for f, held, temp, _ in free.table}
    stack = flaxside.remat_stack(ResidualMLPBlock, 4, lengths="auto", width=W,
                                 memory_budget=max(cost.values()))
    choice = stack.choose_lengths(x)
    assert choice.lengths == (4,) and choice.table == free.table
    params = jax.jit(stack.init)(jax.random.key(0), x)
    assert_close(jax.jit(stack.apply)(params, x),
                  jax.jit(unrolled_linen(ResidualMLPBlock(W), 4))(params["params"], x))
