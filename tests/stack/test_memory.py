"""What a remat_stack holds for its backward, and how its program grows with depth.

The forward holds only the outer level's carries; inside the backward of an outer step the
innermost layers are checkpointed too; held bytes grow with the square root of depth (two
levels) while a scan without remat holds every layer, and the lowered program does not grow
with depth.
"""

import math

import jax
import jax.numpy as jnp
import pytest

import flaxside
from tests.support.stacks import B, W
from tests.support.twins import ResidualMLPBlock, ScanStack


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
    the matmul outputs here is part of what that would cost. The control is
    ``dots_saveable``, which keeps its meaning under ``jax_remat3``; ``everything_saveable``
    saves only named values there (docs/design.md, "JAX's remat3"), and nothing in this
    block is named.
    """
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def backward_temp(policy):
        stack = flaxside.remat_stack(ResidualMLPBlock, 16, lengths=(4, 4), width=16,
                                     policy=policy)
        return flaxside.memory_report(stack, x).backward_temp_bytes

    assert backward_temp(None) < backward_temp("dots_saveable")


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
