"""NNX forwards that change the module: its graph, or the state it holds.

A forward that changes a Python attribute (the next call takes another branch) propagates
like pure NNX, eagerly, under ``nnx.jit`` and under ``nnx.value_and_grad``; each call's
graph lives as long as the module and its cached signatures. A forward that creates state
is refused, naming the path, and writes nothing. Also: a Param assigned or created in the
forward (module/test_nnx.py); stream keys (module/test_nnx_rng_streams.py).
"""

import gc
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flaxside.internal import Graph
from tests.support.references import nnx_step, to_jax, to_torch
from torchside import FlaxModule

MODES = ["save", "recompute"]


# -- a forward that changes a Python attribute ----------------------------------------
class Switcher(nnx.Module):
    """Advances ``next_index`` on every call and picks a branch with it (the issue's case)."""

    def __init__(self):
        self.next_index = 0
        self.w = nnx.Param(jnp.array([1.5, -0.5]))

    def __call__(self, x):
        i = self.next_index
        self.next_index = (i + 1) % 3
        return nnx.switch(i, [lambda x: x * self.w[...], lambda x: 2 * x * self.w[...],
                              lambda x: jnp.sin(x) * self.w[...]], x)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("residuals", MODES, ids=MODES)
def test_graph_change_propagates_like_pure_nnx(residuals, train):
    m = FlaxModule(Switcher(), residuals=residuals).train(train)
    eager, jitted, diffed = Switcher(), Switcher(), Switcher()
    step = nnx.jit(lambda mod, x: mod(x))
    for call in range(4):
        x = torch.randn(2, requires_grad=True)
        ct = torch.randn(2)
        m.zero_grad()
        y = m(x)
        y.backward(ct)
        want_y, want_g, want_gx = nnx_step(diffed, to_jax(x), to_jax(ct))
        np.testing.assert_allclose(np.asarray(eager(to_jax(x))), np.asarray(want_y), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(step(jitted, to_jax(x))), np.asarray(want_y),
                                   rtol=1e-6)
        msg = f"call {call}"
        torch.testing.assert_close(y.detach(), to_torch(want_y), msg=msg)
        torch.testing.assert_close(x.grad, to_torch(want_gx), msg=msg)
        torch.testing.assert_close(m.get_parameter("w").grad, to_torch(want_g["w"]), msg=msg)
    assert eager.next_index == jitted.next_index == diffed.next_index == 1


@pytest.mark.parametrize("residuals", MODES, ids=MODES)
def test_two_forwards_then_one_backward_keep_each_graph(residuals):
    m = FlaxModule(Switcher(), residuals=residuals)
    xs = [torch.randn(2, requires_grad=True) for _ in range(2)]
    cts = [torch.randn(2) for _ in range(2)]
    ys = [m(x) for x in xs]
    torch.autograd.backward(ys, cts)
    ref = Switcher()
    for k, (x, ct) in enumerate(zip(xs, cts, strict=True)):
        want_y, _, want_gx = nnx_step(ref, to_jax(x), to_jax(ct))
        torch.testing.assert_close(ys[k].detach(), to_torch(want_y), msg=f"forward {k}")
        torch.testing.assert_close(x.grad, to_torch(want_gx), msg=f"forward {k}")


class Counter(nnx.Module):
    """Counts its calls in a Python attribute: every call makes a graph never seen before."""

    def __init__(self):
        self.calls = 0
        self.w = nnx.Param(jnp.array([0.5, -1.0]))

    def __call__(self, x):
        self.calls += 1
        return x * self.w[...] * self.calls


def test_graphs_live_only_as_long_as_the_module_and_its_cached_signatures():
    # A recompile per call is what this module asks for: no warning (which would keep the
    # signatures it reports), 2 cached signatures. Graphs other tests left alive (a
    # torch.compile cache holds its module's) are not this test's.
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is Graph}
    m = FlaxModule(Counter(), cache_size=2, recompile_warning=None)
    ref = Counter()
    for call in range(8):
        x = torch.randn(2, requires_grad=True)
        y = m(x)
        y.sum().backward()
        want_y, _, want_gx = nnx_step(ref, to_jax(x), jnp.ones(2))
        torch.testing.assert_close(y.detach(), to_torch(want_y), msg=f"call {call}")
        torch.testing.assert_close(x.grad, to_torch(want_gx), msg=f"call {call}")
    assert m.flax_module.calls == ref.calls == 8
    gc.collect()
    graphs = [o for o in gc.get_objects() if type(o) is Graph and id(o) not in before]
    # the module's current graph and the 2 cached signatures' graphs (with those they return)
    assert len(graphs) <= 2 * 2 + 1, len(graphs)
    del m, graphs, x, y  # y.grad_fn holds its entry
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Graph and id(o) not in before]


# -- a forward that creates state -------------------------------------------------------
class Creates(nnx.Module):
    def __init__(self, what):
        self.what = what
        self.count = nnx.BatchStat(jnp.array(7.0))
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.count[...] = self.count[...] + 1.0  # a buffer written before the new state
        y = self.lin(x)
        if self.what == "sow":
            self.sow(nnx.Intermediate, "h", y)
        elif self.what == "param":
            self.extra = nnx.Param(jnp.ones(2))
        else:
            self.extra = nnx.BatchStat(jnp.zeros(2))
        return y


CREATED = {"sow": "'h", "param": "'extra'", "buffer": "'extra'"}


def _bits(module) -> dict:
    return {n: t.detach().clone().flatten().view(torch.uint8)
            for n, t in module.state_dict().items()}


# The case; flax 0.12 deprecates sow outside nnx.capture but still runs it.
@pytest.mark.filterwarnings(r"ignore:Using 'Module.sow\(\)' outside:DeprecationWarning")
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("what", list(CREATED), ids=list(CREATED))
def test_state_creation_is_refused_naming_the_path_and_nothing_is_written(what, train):
    m = FlaxModule(Creates(what)).train(train)
    before = _bits(m)
    with pytest.raises(NotImplementedError, match=re.escape(f"added {CREATED[what]}")):
        m(torch.ones(1, 2, requires_grad=True))
    after = _bits(m)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
