"""A program computes at the matmul precision its first call saw, in every thread.

JAX's ``default_matmul_precision`` context is thread-local, and torch runs a CUDA backward
on a thread of its own: a backward compiled at its first use there, or a derived program
built there (a gradient penalty), would otherwise compute at another precision than the
forward it differentiates (TF32 gradients under a "highest" context: the likely cause of
the first GPU run's CUDA-against-CPU penalty failure). On the CPU, autograd runs a backward
in the calling thread, so these tests run it in a thread outside the context. The
precision is read in the compiled programs' HLO; a program built outside the context is
the negative control.
"""

import contextlib
import threading

import flax.linen as nn
import jax
import pytest
import torch

from tests.support.pipeline import compiled_kinds, derived_programs, entries, executables_run
from torchside import FlaxModule


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(jax.numpy.tanh(nn.Dense(8)(x)))


def _in_thread(fn) -> None:
    """Runs ``fn`` in a new thread, outside this thread's JAX contexts; re-raises."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _forward(m, x, context: bool):
    """The module's forward in this thread, at "highest" where ``context``, else the default."""
    with jax.default_matmul_precision("highest") if context else contextlib.nullcontext():
        return m(x)


def _highest(compiled) -> bool:
    text = compiled.as_text()
    dots = [line for line in text.splitlines() if " dot(" in line]
    assert dots, "no dot in the program: nothing to check"
    return all("operand_precision={highest,highest}" in line for line in dots)


@pytest.mark.parametrize("residuals", ["save", "recompute"])
@pytest.mark.parametrize("context", [True, False], ids=["highest", "default"])
def test_a_backward_in_another_thread_computes_at_the_forwards_precision(residuals, context):
    m = FlaxModule(MLP(), example_args=(torch.zeros(4, 8),), residuals=residuals)
    x = torch.randn(4, 8, requires_grad=True)
    y = _forward(m, x, context)
    _in_thread(lambda: y.backward(torch.randn(4, 8)))
    kinds = {kind: _highest(c) for _, kind, c in executables_run(m)}
    assert {"backward", "backward_recompute"} & set(kinds), kinds
    assert all(v == context for v in kinds.values()), kinds


@pytest.mark.parametrize("residuals", ["save", "recompute"])
@pytest.mark.parametrize("context", [True, False], ids=["highest", "default"])
def test_a_gradient_penalty_differentiated_in_another_thread_keeps_the_precision(
        residuals, context):
    m = FlaxModule(MLP(), example_args=(torch.zeros(4, 8),), residuals=residuals)
    x = torch.randn(4, 8, requires_grad=True)
    y = _forward(m, x, context)

    def penalty_step():  # where a CUDA backward runs: torch's own thread
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        gx.square().sum().backward()

    _in_thread(penalty_step)  # builds the backward's VJP as a derived program, there
    derived = derived_programs(m)
    assert derived, "no derived program was built"
    for program in derived:
        for kind, compiled in compiled_kinds(program):
            assert _highest(compiled) == context, (program.name, kind)


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_a_kind_first_compiled_later_elsewhere_keeps_the_programs_precision(residuals):
    """NOTE [Precision of a program]: read once, where the program is built. Built by a
    call under "highest", the program compiles the kinds its calls have not run yet
    later, in another thread outside the context: at "highest" too. Mutation: the
    precision read where each body is traced (the save route traces its backward with
    its forward, so the first test above passes with it there; these kinds compile at
    the default)."""
    m = FlaxModule(MLP(), example_args=(torch.zeros(4, 8),), residuals=residuals)
    x = torch.randn(4, 8, requires_grad=True)
    _forward(m, x, True).backward(torch.randn(4, 8))
    (entry,) = entries(m)
    program = entry.program
    later = {"forward", "forward_with_residuals", "backward", "backward_recompute"} - set(
        program._compiled)
    assert later, program._compiled
    _in_thread(lambda: [program.compiled(kind) for kind in sorted(later)])
    kinds = {kind: _highest(c) for kind, c in compiled_kinds(program)}
    assert later <= set(kinds) and all(kinds.values()), kinds
