"""Flax Linen's vmap, jit, map_variables and control-flow docstring examples, through FlaxModule.

Each module reproduces an example from ``flax/linen/transforms.py`` (flax 0.12.8) in our own
code; the comment above it names the docstring. State collections the examples update
(``state`` counters) are compared with pure ``module.apply(..., mutable=...)``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.corpus_helpers import check_linen, covers, to_jax
from torchside import FlaxModule


# -- nn.vmap ---------------------------------------------------------------------------
# flax.linen.vmap docstring: BatchDense, without and with parameter sharing.
def batch_dense(shared: bool):
    return nn.vmap(nn.Dense, in_axes=0, out_axes=0,
                   variable_axes={"params": None if shared else 0},
                   split_rngs={"params": not shared})


@covers("nn.vmap", "BatchDense, variable_axes={'params': 0} (one Dense per batch entry)",
        "BatchDense, variable_axes={'params': None} (shared parameters)")
@pytest.mark.parametrize("shared", [False, True], ids=["mapped-params", "shared-params"])
def test_vmap_batch_dense(shared):
    checked = check_linen(batch_dense(shared)(3), (torch.randn(4, 2, 5),))
    assert checked.wrapped.params.kernel.shape == ((5, 3) if shared else (4, 5, 3))


class VmapAxes(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        # in_axes other than 0 and a broadcast (None) argument; out_axes=1.
        body = nn.vmap(lambda mdl, a, b: mdl(a) + b, in_axes=(1, None), out_axes=1,
                       variable_axes={"params": None}, split_rngs={"params": False})
        return body(nn.Dense(4), x, y)


@covers("nn.vmap", "in_axes=(1, None), out_axes=1")
def test_vmap_other_axes():
    check_linen(VmapAxes(), (torch.randn(3, 6, 5), torch.randn(3, 4)))


# -- nn.jit ----------------------------------------------------------------------------
class JitMLP(nn.Module):
    @nn.compact
    def __call__(self, x, scale: float):
        return nn.Dense(2)(nn.tanh(nn.Dense(8)(x))) * scale


class UsesJit(nn.Module):
    @nn.compact
    def __call__(self, x):
        # nn.jit (static_argnums counts self: scale is argument 2) inside the bridge's jit.
        mlp = nn.jit(JitMLP, static_argnums=(2,))(name="mlp")
        return mlp(x, 2.0) + mlp(x, 0.5)


@covers("nn.jit", "a jitted submodule, static_argnums=")
def test_jit_submodule():
    check_linen(UsesJit(), (torch.randn(4, 3),))


# -- nn.map_variables ------------------------------------------------------------------
# flax.linen.map_variables docstring: CausalDense, weights masked with jnp.triu.
class CausalDense(nn.Module):
    features: int

    def apply_mask(self, variables):
        return (jax.tree_util.tree_map(jnp.triu, variables)
                if not self.is_initializing() else variables)

    def setup(self):
        causal = nn.map_variables(nn.Dense, "params", self.apply_mask,
                                  init=self.is_initializing())
        self.dense = causal(features=self.features, use_bias=False)

    def __call__(self, x):
        return self.dense(x)


@covers("nn.map_variables", "CausalDense (mask applied to the kernel)")
def test_map_variables_causal_dense():
    checked = check_linen(CausalDense(features=5), (torch.randn(3, 5),))
    # The mask reaches the gradient: entries below the diagonal get none.
    g = checked.wrapped.params.dense.kernel.grad
    assert torch.count_nonzero(torch.tril(g, -1)) == 0
    assert torch.count_nonzero(torch.triu(g)) > 0


# -- control flow ----------------------------------------------------------------------
# flax.linen.while_loop docstring: WhileLoopExample, a 'state' counter carried by the loop.
class WhileLoopExample(nn.Module):
    @nn.compact
    def __call__(self, x):
        def cond_fn(mdl, c):
            return mdl.variables["state"]["acc"] < 10

        def body_fn(mdl, c):
            acc = mdl.variable("state", "acc", lambda: jnp.array(0))
            acc.value += 1
            return nn.Dense(c.shape[-1])(c)

        if self.is_mutable_collection("params"):
            return body_fn(self, x)
        return nn.while_loop(cond_fn, body_fn, self, x, carry_variables="state")


def _while_reference(wrapped, x):
    variables = jax.tree_util.tree_map(jnp.array, wrapped.flax_variables())
    return WhileLoopExample().apply(variables, to_jax(x), mutable=["state"])


@covers("nn.while_loop", "WhileLoopExample, carry_variables='state'", result="forward only",
        note="JAX has no reverse-mode rule for lax.while_loop: the backward raises JAX's "
             "ValueError naming while_loop, as jax.grad of the pure apply does. Forward "
             "and the 'state' update work.")
def test_while_loop_forward_and_state():
    x = torch.randn(2, 2)
    wrapped = FlaxModule(WhileLoopExample(), example_args=(x,))
    assert wrapped.state.acc.item() == 1  # init ran the body once
    ref, state = _while_reference(wrapped, x)
    with torch.no_grad():
        y = wrapped(x)
    torch.testing.assert_close(y, torch.from_numpy(np.array(ref)))
    assert wrapped.state.acc.item() == int(state["state"]["acc"]) == 10
    # Frozen parameters and an input without grad need no backward, so grad mode runs too.
    wrapped.requires_grad_(False)
    wrapped.state.acc.fill_(6)
    ref, state = _while_reference(wrapped, x)
    torch.testing.assert_close(wrapped(x), torch.from_numpy(np.array(ref)))
    assert wrapped.state.acc.item() == int(state["state"]["acc"]) == 10


def test_while_loop_backward_raises_naming_while_loop():
    x = torch.randn(2, 2, requires_grad=True)
    wrapped = FlaxModule(WhileLoopExample(), example_args=(x,))
    variables = jax.tree_util.tree_map(jnp.array, wrapped.flax_variables())
    message = "Reverse-mode differentiation does not work for lax.while_loop"
    # Pure JAX refuses the same thing: the bridge must not produce numbers where JAX can't.
    with pytest.raises(ValueError, match=message):
        jax.grad(lambda p: WhileLoopExample().apply(
            {**variables, "params": p}, to_jax(x), mutable=["state"])[0].sum())(
            variables["params"])
    y = wrapped(x)
    with pytest.raises(ValueError, match=message):
        (y * torch.randn_like(y)).sum().backward()


def _counted(mdl, signs: dict):
    """The branches of the cond and switch docstrings, one per 'state' counter in ``signs``:
    each adds one to its counter, then applies the one Dense they share, negated where the
    sign is -1."""
    for name in signs:
        mdl.variable("state", name, lambda: 0)

    def branch(name, sign):
        def fn(mdl, x):
            mdl.variable("state", name).value += 1
            y = nn.Dense(2, name="dense")(x)
            return -y if sign < 0 else y  # as the docstrings write it: no multiply

        return fn

    return [branch(name, sign) for name, sign in signs.items()]


# flax.linen.cond docstring: CondExample, 'state' counts which branch ran.
class CondExample(nn.Module):
    @nn.compact
    def __call__(self, x, pred):
        true_fn, false_fn = _counted(self, {"true_count": 1, "false_count": -1})
        return nn.cond(pred, true_fn, false_fn, self, x)


@covers("nn.cond", "CondExample, predicate as a tensor, 'state' counters updated")
@pytest.mark.parametrize("pred", [True, False], ids=["true", "false"])
def test_cond_example(pred):
    x = torch.randn(3, 4)
    checked = check_linen(CondExample(), (x, torch.tensor(pred)))
    after = checked.wrapped.state
    ran = (after.true_count.item() - checked.initial["state.true_count"],
           after.false_count.item() - checked.initial["state.false_count"])
    assert ran == ((1, 0) if pred else (0, 1))  # init ran a branch too; count this call


@covers("nn.cond", "predicate as a static Python bool")
def test_cond_static_predicate():
    check_linen(CondExample(), (torch.randn(3, 4), False))


# flax.linen.switch docstring: SwitchExample, 'state' counts which branch ran.
class SwitchExample(nn.Module):
    @nn.compact
    def __call__(self, x, index):
        branches = _counted(self, {"a_count": 1, "b_count": -1, "c_count": 1})
        return nn.switch(index, branches, self, x)


@covers("nn.switch", "SwitchExample, index as an int32 tensor, 'state' counters updated")
@pytest.mark.parametrize("index", [0, 1, 2], ids=["a", "b", "c"])
def test_switch_example(index):
    checked = check_linen(SwitchExample(),
                          (torch.randn(3, 4), torch.tensor(index, dtype=torch.int32)))
    ran = [getattr(checked.wrapped.state, f"{b}_count").item() - checked.initial[f"state.{b}_count"]
           for b in "abc"]
    assert ran == [int(i == index) for i in range(3)]


# flax.linen.switch docstring: MultiHeadSwitchExample, a different head per branch.
class MultiHeadSwitchExample(nn.Module):
    def setup(self):
        self.heads = [
            nn.Sequential([nn.Dense(10), nn.Dense(7), nn.Dense(5)]),
            nn.Sequential([nn.Dense(11), nn.Dense(5)]),
            nn.Dense(5),
        ]

    @nn.compact
    def __call__(self, x, index):
        def head_fn(i):
            return lambda mdl, x: mdl.heads[i](x)

        branches = [head_fn(i) for i in range(len(self.heads))]
        if self.is_mutable_collection("params"):  # run all branches on init
            for branch in branches:
                _ = branch(self, x)
        return nn.switch(index, branches, self, x)


@covers("nn.switch", "MultiHeadSwitchExample (a different parameter structure per branch)")
@pytest.mark.parametrize("index", [0, 2], ids=["head0", "head2"])
def test_multi_head_switch(index):
    x = torch.randn(3, 4)
    checked = check_linen(MultiHeadSwitchExample(), (x, torch.tensor(index, dtype=torch.int32)),
                          init_args=(x, 0))
    # Only the chosen head's parameters get a gradient that is not zero.
    for name, p in checked.wrapped.named_parameters():
        chosen = name.startswith(f"params.heads_{index}.")
        assert bool(torch.count_nonzero(p.grad)) == chosen, name
