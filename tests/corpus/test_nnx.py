"""Flax NNX's lifted transforms inside a wrapped ``nnx.Module``, after their docstrings.

Each module reproduces an example from ``flax/nnx/transforms/*.py`` (flax 0.12.8) in our
own code, used inside ``__call__`` of a module that ``FlaxModule`` wraps. The reference
merges the module's state before the bridge ran, calls it in the same mode and splits
again (``check_nnx``); outputs, every gradient and the non-Param state written back (RNG
counts, counters) must agree.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.support.corpus_helpers import check_nnx, covers, to_jax
from tests.support.docstring_models import Model
from torchside import FlaxModule

POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


class Count(nnx.Variable):
    """A counter: non-Param state that FlaxModule holds as a buffer and writes back."""


# -- nnx.remat -------------------------------------------------------------------------
class RematMLP(nnx.Module):
    def __init__(self, remat_kwargs=(), *, rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)
        self.remat_kwargs = dict(remat_kwargs)

    def __call__(self, x):
        # nnx.remat lifts a function of the module (a bound method is refused by NNX).
        @nnx.remat(**self.remat_kwargs)
        def block(m, x):
            return m.l2(nnx.relu(m.l1(x)))

        return block(self, x)


@covers("nnx.remat", "a function of the module", "prevent_cse=False", "policy=")
@pytest.mark.parametrize(
    "remat_kwargs",
    [(), (("prevent_cse", False),), *((("policy", POLICIES[p]),) for p in sorted(POLICIES))],
    ids=["default", "prevent_cse=False", *(f"policy={p}" for p in sorted(POLICIES))],
)
def test_remat(remat_kwargs):
    check_nnx(RematMLP(remat_kwargs, rngs=nnx.Rngs(0)), (torch.randn(4, 6),))


class RematStatic(nnx.Module):
    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(6, 4, rngs=rngs)

    def __call__(self, x, double: bool):
        @nnx.remat(static_argnums=(2,))
        def block(m, x, double):
            y = m.l1(x)
            return 2.0 * y if double else y  # Python control flow on the static argument

        return block(self, x, double)


@covers("nnx.remat", "static_argnums=")
@pytest.mark.parametrize("double", [True, False], ids=["true", "false"])
def test_remat_static_argnums(double):
    check_nnx(RematStatic(rngs=nnx.Rngs(0)), (torch.randn(4, 6), double))


# -- nnx.scan --------------------------------------------------------------------------
# flax.nnx.scan docstring: Model, Blocks (Linear + Dropout) stacked with split_rngs + vmap,
# applied with nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry); in tests/support
# because module tests use it too.
@covers("nnx.scan", "Model / Block with Dropout (split_rngs + vmap init, in_axes=(Carry, 0))",
        "reverse=True", "unroll=2")
@pytest.mark.parametrize(
    ("scan_kwargs", "train"),
    [((), True), ((), False), ((("reverse", True),), True), ((("unroll", 2),), True)],
    ids=["docstring-train", "docstring-eval", "reverse-train", "unroll=2-train"],
)
def test_scan_model(scan_kwargs, train):
    model = Model(3, 4, scan_kwargs, rngs=nnx.Rngs(0))
    checked = check_nnx(model, (torch.randn(5, 4),), train=train)
    counts = [n for n in checked.state if n.endswith("rngs.count")]
    assert counts, checked.state  # the dropout streams' counts are state the bridge holds
    if train:  # dropout drew a key per layer: the counts moved and were written back
        assert all(not np.array_equal(checked.state[n], checked.initial[n]) for n in counts)


@covers("FlaxModule(residuals='recompute')",
        "NNX train mode with any written-back state (the scan Model's dropout RNG counts)",
        note="the written-back leaves are saved as clones, so the recompute sees the "
             "forward's state")
def test_scan_model_recompute_mode():
    check_nnx(Model(3, 4, rngs=nnx.Rngs(0)), (torch.randn(5, 4),), residuals="recompute")


class ScanAxes(nnx.Module):
    """Scanned input along axis 1 and stacked output along axis 1, with a broadcast weight."""

    def __init__(self, *, rngs):
        self.cell = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, xs):
        @nnx.scan(in_axes=(nnx.Carry, None, 1), out_axes=(nnx.Carry, 1))
        def step(h, cell, x):
            h = jnp.tanh(cell(h) + x)
            return h, 2.0 * h

        h0 = jnp.zeros((xs.shape[0], 3))
        return step(h0, self.cell, xs)


@covers("nnx.scan", "in_axes=(Carry, None, 1), out_axes=(Carry, 1)")
def test_scan_other_axes():
    checked = check_nnx(ScanAxes(rngs=nnx.Rngs(0)), (torch.randn(2, 6, 3),))
    assert checked.outputs[1].shape == (2, 6, 3)


# -- nnx.vmap --------------------------------------------------------------------------
# flax.nnx.vmap docstring: forward(model, x) with in_axes=(None, 0), and LinearEnsemble
# with in_axes=(0, None).
class VmapForward(nnx.Module):
    def __init__(self, *, rngs):
        self.model = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.vmap(in_axes=(None, 0), out_axes=0)
        def forward(model, x):
            return model(x)

        return forward(self.model, x)


class LinearEnsemble(nnx.Module):
    def __init__(self, num, *, rngs):
        self.w = nnx.Param(jax.random.uniform(rngs(), (num, 2, 3)))

    def __call__(self, x):
        @nnx.vmap(in_axes=(0, None), out_axes=0)
        def forward(model, x):
            return x @ model.w

        return forward(self, x)


@covers("nnx.vmap", "forward(model, x), in_axes=(None, 0)", "LinearEnsemble, in_axes=(0, None)")
@pytest.mark.parametrize("example", ["forward", "ensemble"])
def test_vmap(example):
    if example == "forward":
        check_nnx(VmapForward(rngs=nnx.Rngs(0)), (torch.randn(5, 2),))
    else:
        checked = check_nnx(LinearEnsemble(5, rngs=nnx.Rngs(0)), (torch.randn(2),))
        assert checked.outputs.shape == (5, 3)


# -- control flow ----------------------------------------------------------------------
class CondCounter(nnx.Module):
    """nnx.cond / nnx.switch over the module, a branch counter that also enters the math."""

    def __init__(self, *, rngs):
        self.heads = nnx.List([nnx.Linear(4, 2, rngs=rngs) for _ in range(3)])
        self.count = Count(jnp.zeros((3,), jnp.float32))

    def __call__(self, x, which):
        def branch(i):
            def run(m, x):
                m.count[...] = m.count[...].at[i].add(1.0)
                # The counter enters the math: the backward needs the value it had.
                return m.heads[i](x) * (1.0 + 0.1 * m.count[i])
            return run

        if which.dtype == jnp.bool_:
            return nnx.cond(which, branch(0), branch(1), self, x)
        return nnx.switch(which, [branch(i) for i in range(3)], self, x)


@covers("nnx.cond", "branches over the module, a counter Variable updated and used in the math")
@pytest.mark.parametrize("pred", [True, False], ids=["true", "false"])
def test_cond(pred):
    checked = check_nnx(CondCounter(rngs=nnx.Rngs(0)), (torch.randn(3, 4), torch.tensor(pred)))
    assert checked.wrapped.count.tolist() == ([1.0, 0.0, 0.0] if pred else [0.0, 1.0, 0.0])


@covers("nnx.switch", "three branches over the module, index as an int32 tensor")
@pytest.mark.parametrize("index", [0, 1, 2], ids=["b0", "b1", "b2"])
def test_switch(index):
    checked = check_nnx(CondCounter(rngs=nnx.Rngs(0)),
                        (torch.randn(3, 4), torch.tensor(index, dtype=torch.int32)))
    assert checked.wrapped.count.tolist() == [float(i == index) for i in range(3)]


# flax.nnx.while_loop docstring: (module, x, count) carried, the module applied 3 times.
class WhileLoopModel(nnx.Module):
    def __init__(self, *, rngs):
        self.module = nnx.Linear(10, 10, rngs=rngs)

    def __call__(self, x):
        def fwd_fn(inputs):
            module, x, count = inputs
            return module, module(x), count - 1.0

        _, y, _ = nnx.while_loop(lambda inputs: inputs[-1] > 0, fwd_fn,
                                 (self.module, x, 3.0))
        return y


@covers("nnx.while_loop", "fwd_fn over (module, x, count)", result="forward only",
        note="JAX has no reverse-mode rule for lax.while_loop: the backward raises JAX's "
             "ValueError naming while_loop, as jax.grad does. The forward works.")
def test_while_loop_forward_only():
    model = WhileLoopModel(rngs=nnx.Rngs(0))
    x = torch.randn(10)
    ref = model.module(model.module(model.module(to_jax(x))))  # the loop, unrolled by hand
    wrapped = FlaxModule(model)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), torch.from_numpy(np.array(ref)))
    y = wrapped(x.requires_grad_())
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work for "
                                         "lax.while_loop"):
        (y * torch.randn_like(y)).sum().backward()


# flax.nnx.fori_loop docstring: fwd_fn sets the kernel to i * identity, then applies it.
class ForiLoopModel(nnx.Module):
    def __init__(self, *, rngs):
        self.module = nnx.Linear(10, 10, rngs=rngs)

    def __call__(self, x):
        def fwd_fn(i, inputs):
            m, x = inputs
            m.kernel[...] = jnp.identity(10) * i
            return m, m(x)

        _, y = nnx.fori_loop(2, 4, fwd_fn, (self.module, x))
        return y


@covers("nnx.fori_loop", "fwd_fn (static bounds 2..4, the kernel set inside the loop)")
def test_fori_loop():
    x = torch.randn(10)
    checked = check_nnx(ForiLoopModel(rngs=nnx.Rngs(0)), (x,))
    torch.testing.assert_close(checked.outputs, x * 2 * 3)  # the docstring's own check


@covers("nnx.fori_loop", "a Param assigned inside the loop, written back to the module",
        note="Params the forward assigns are written back in train and eval mode, as pure "
             "NNX keeps them")
def test_fori_loop_param_assignment_is_written_back():
    model = ForiLoopModel(rngs=nnx.Rngs(0))
    wrapped = FlaxModule(model)
    x = torch.randn(10)
    wrapped(x)
    model(to_jax(x))  # pure NNX: the kernel is now 3 * identity
    torch.testing.assert_close(wrapped.module.kernel.detach(),
                               torch.from_numpy(np.array(model.module.kernel[...])))
