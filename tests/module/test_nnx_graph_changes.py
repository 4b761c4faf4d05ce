"""NNX forwards that change the graph, create state, or draw stacked stream keys (issue 14).

References are pure NNX: the module called eagerly, under ``nnx.jit``, and differentiated
with ``nnx.value_and_grad`` (which propagates graph changes as ``nnx.jit`` does).
"""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flaxside.internal import Graph
from tests.support.docstring_models import Model  # the flax.nnx.scan docstring model
from torchside import FlaxModule

MODES = ["save", "recompute"]


def _j(t):
    return jnp.asarray(t.detach().numpy())


def _t(a):
    return torch.from_numpy(np.array(a))


def _grads_by_name(state) -> dict:
    return {".".join(str(k) for k in path): v.get_value()
            for path, v in nnx.to_flat_state(state)}


def _pure_step(module, x, ct):
    """Output and gradients (Params, x) of ``sum(module(x) * ct)`` in pure NNX."""
    def loss(m, x):
        y = m(x)
        return jnp.sum(y * ct), y

    (_, y), (g_m, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(module, x)
    return y, _grads_by_name(g_m), g_x


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
        want_y, want_g, want_gx = _pure_step(diffed, _j(x), _j(ct))
        np.testing.assert_allclose(np.asarray(eager(_j(x))), np.asarray(want_y), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(step(jitted, _j(x))), np.asarray(want_y), rtol=1e-6)
        msg = f"call {call}"
        torch.testing.assert_close(y.detach(), _t(want_y), msg=msg)
        torch.testing.assert_close(x.grad, _t(want_gx), msg=msg)
        torch.testing.assert_close(m.get_parameter("w").grad, _t(want_g["w"]), msg=msg)
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
        want_y, _, want_gx = _pure_step(ref, _j(x), _j(ct))
        torch.testing.assert_close(ys[k].detach(), _t(want_y), msg=f"forward {k}")
        torch.testing.assert_close(x.grad, _t(want_gx), msg=f"forward {k}")


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
    # signatures it reports), 2 cached signatures.
    m = FlaxModule(Counter(), cache_size=2, recompile_warning=None)
    ref = Counter()
    for call in range(8):
        x = torch.randn(2, requires_grad=True)
        y = m(x)
        y.sum().backward()
        want_y, _, want_gx = _pure_step(ref, _j(x), jnp.ones(2))
        torch.testing.assert_close(y.detach(), _t(want_y), msg=f"call {call}")
        torch.testing.assert_close(x.grad, _t(want_gx), msg=f"call {call}")
    assert m.flax_module.calls == ref.calls == 8
    gc.collect()
    graphs = [o for o in gc.get_objects() if type(o) is Graph]
    # the module's current graph and the 2 cached signatures' graphs (with those they return)
    assert len(graphs) <= 2 * 2 + 1, len(graphs)
    del m, graphs, x, y  # y.grad_fn holds its entry
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Graph]


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


# -- stacked stream keys (nnx.split_rngs + nnx.vmap, applied in nnx.scan) ----------------
def _stacked():
    return Model(3, 4, rngs=nnx.Rngs(params=0, dropout=1))


def test_stacked_stream_keys_keep_their_shape_and_match_pure_nnx():
    m = FlaxModule(_stacked(), rngs=("dropout",))
    key_before = m.get_buffer("blocks.dropout.rngs.key").clone()
    x = torch.randn(5, 4, requires_grad=True)
    ct = torch.randn(5, 4)
    torch.manual_seed(3)
    y = m(x)
    y.backward(ct)
    drawn = m.get_buffer("blocks.dropout.rngs.key")  # the keys the forward ran with
    assert drawn.shape == key_before.shape == (3, 2)  # one key per layer
    assert not torch.equal(drawn, key_before)
    # Pure NNX from the state before the call, with the per-layer keys the bridge drew.
    ref = _stacked()
    ref.blocks.dropout.rngs.key.set_value(jax.random.wrap_key_data(
        jnp.asarray(drawn.numpy().view(np.uint32))))
    want_y, want_g, want_gx = _pure_step(ref, _j(x), _j(ct))
    torch.testing.assert_close(y.detach(), _t(want_y))
    torch.testing.assert_close(x.grad, _t(want_gx))
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, _t(want_g[name]), msg=name)
    np.testing.assert_array_equal(m.get_buffer("blocks.dropout.rngs.count").numpy(),
                                  np.asarray(ref.blocks.dropout.rngs.count.get_value()))


def test_stacked_stream_keys_follow_the_torch_seed():
    m = FlaxModule(_stacked(), rngs=("dropout",))
    x = torch.randn(5, 4)
    outs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outs.append(m(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert not torch.equal(outs[0], m.eval()(x))  # dropout was active


# -- a requested stream the module does not have ---------------------------------------
def test_a_stream_no_key_belongs_to_is_refused():
    # nnx.Rngs(0) tags every key 'default': rngs=("dropout",) would draw nothing.
    with pytest.raises(ValueError, match=r"stream 'dropout'.*its streams: \['default'\]"):
        FlaxModule(Model(3, 4, rngs=nnx.Rngs(0)), rngs=("dropout",))
    m = FlaxModule(Model(3, 4, rngs=nnx.Rngs(0)), rngs=("default",))  # the fix it gives
    x = torch.randn(5, 4)
    outs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outs.append(m(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
