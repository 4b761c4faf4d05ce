"""FlaxModule as a torch.nn.Module: variables, calls, autograd, caching, ordering."""

import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support import pipeline
from tests.support.twins import RematScanStack, ResidualMLPBlock
from torchside import FlaxModule


class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, inputs, *, scale=1.0, mode="sum"):
        h = nn.Dense(8)(inputs["x"]) * scale
        y = nn.Dense(3, name="head")(h + inputs["bias"])
        count = jnp.sum(inputs["ids"] > 0).astype(jnp.int32)
        return {"y": y, "count": count, "pair": (h, y.sum() if mode == "sum" else y.mean())}


def _inputs(batch=4, grad=True):
    return {
        "x": torch.randn(batch, 5, requires_grad=grad),
        "bias": torch.randn(8),
        "ids": torch.randint(-3, 3, (batch,), dtype=torch.int32),
    }


def _jax_variables(module: FlaxModule):
    """Fresh copies of the module's current variables, as Flax variables."""
    return jax.tree_util.tree_map(jnp.array, module.flax_variables())


def test_parameters_are_torch_owned_with_flax_names():
    x = torch.zeros(2, 16)
    variables = RematScanStack(16, (2, 3)).init(jax.random.key(1), jnp.zeros((2, 16)))
    m = FlaxModule(RematScanStack(16, (2, 3)), variables=variables)
    names = dict(m.named_parameters())
    assert names["params.stack.Dense_0.kernel"].shape == (2, 3, 16, 32)
    assert set(m.state_dict()) == set(names)
    leaf = variables["params"]["stack"]["Dense_0"]["kernel"]
    assert names["params.stack.Dense_0.kernel"].data_ptr() != leaf.unsafe_buffer_pointer()
    assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())
    m(x)  # runs


class Partitioned(nn.Module):
    """A kernel boxed by ``nn.with_partitioning`` and a variable the user named "value"."""

    @nn.compact
    def __call__(self, x):
        kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        scale = self.param("value", nn.initializers.ones, (4,))
        return nn.Dense(4, kernel_init=kernel_init)(x) * scale


def test_partitioned_parameters_are_named_as_the_variable():
    """``nn.Partitioned`` holds its array under a ``value`` attribute: torch's name is the
    variable's own (``kernel``, not ``kernel.value``); a variable the user named "value"
    keeps its name; the module computes what Flax computes with the boxes."""
    x = torch.randn(2, 3)
    m = FlaxModule(Partitioned(), example_args=(x,))
    assert sorted(dict(m.named_parameters())) == [
        "params.Dense_0.bias", "params.Dense_0.kernel", "params.value"]
    want = Partitioned().apply(m.flax_variables(), jnp.asarray(x.numpy()))
    assert isinstance(m.flax_variables()["params"]["Dense_0"]["kernel"], nn.Partitioned)
    torch.testing.assert_close(m(x).detach(), torch.from_numpy(np.array(want)))


def test_pytrees_kwargs_and_static_values():
    m = FlaxModule(TwoHeads(), example_args=(_inputs(),))
    out = m(_inputs(), scale=2.0, mode="mean")
    assert set(out) == {"y", "count", "pair"} and isinstance(out["pair"], tuple)
    assert out["count"].dtype == torch.int32 and not out["count"].requires_grad
    assert out["y"].requires_grad
    inputs = _inputs()
    ref = TwoHeads().apply(_jax_variables(m), jax.tree_util.tree_map(
        lambda t: jnp.asarray(t.detach().numpy()), inputs), scale=2.0, mode="mean")
    np.testing.assert_allclose(m(inputs, scale=2.0, mode="mean")["pair"][1].detach(),
                               ref["pair"][1], rtol=1e-6)


def test_gradients_reach_parameters_and_inputs_that_require_grad():
    m = FlaxModule(TwoHeads(), example_args=(_inputs(),))
    inputs = _inputs()
    out = m(inputs)
    ct = torch.randn_like(out["y"])
    (out["y"] * ct).sum().backward()
    assert inputs["x"].grad is not None and inputs["bias"].grad is None
    variables = _jax_variables(m)
    xj = {k: jnp.asarray(v.detach().numpy()) for k, v in inputs.items()}

    def f(v, x):
        return TwoHeads().apply(v, {**xj, "x": x})["y"]

    _, vjp = jax.vjp(f, variables, xj["x"])
    gv, gx = vjp(jnp.asarray(ct.numpy()))
    torch.testing.assert_close(inputs["x"].grad, torch.from_numpy(np.array(gx)))
    for (name, p), g in zip(m.named_parameters(), jax.tree_util.tree_leaves(gv), strict=True):
        torch.testing.assert_close(p.grad, torch.from_numpy(np.array(g)), msg=name)


def test_inputs_without_grad_cost_no_gradient_work():
    m = FlaxModule(TwoHeads(), example_args=(_inputs(),))
    m(_inputs(grad=False))
    n_params = len(list(m.parameters()))
    assert pipeline.only_program(m).diff_index == tuple(range(n_params))  # parameters only


def test_no_grad_runs_plain_forward_and_holds_nothing():
    m = FlaxModule(TwoHeads(), example_args=(_inputs(),))
    with torch.no_grad():
        out = m(_inputs())
    assert out["y"].grad_fn is None and pipeline.only_program(m).diff_index == ()
    assert m.trace_count == 1  # the plain forward only: no residual program


def test_repeated_calls_do_not_retrace_and_new_batch_compiles_once():
    m = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),))
    for _ in range(3):
        m(torch.randn(4, 8, requires_grad=True)).backward(torch.randn(4, 8))
    assert m.trace_count == 2 and len(pipeline.entries(m)) == 1
    for _ in range(3):
        m(torch.randn(6, 8, requires_grad=True)).backward(torch.randn(6, 8))
    assert m.trace_count == 4 and len(pipeline.entries(m)) == 2


def test_outputs_are_ready_before_forward_returns():
    """JAX dispatch is asynchronous: an in-place write right after the call must not leak in."""

    class Heavy(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(30):
                x = jnp.tanh(x @ x.T @ x * 1e-3) + x
            return x

    m = FlaxModule(Heavy(), example_args=(torch.zeros(256, 256),))
    x = torch.randn(256, 256)
    expected = m(x.clone())
    for _ in range(3):
        x_run = x.clone()
        y = m(x_run)
        x_run.add_(1000.0)  # torch writes to the input the moment the call returns
        torch.testing.assert_close(y, expected)


def test_output_never_aliases_input():
    class Identity(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x

    m = FlaxModule(Identity(), example_args=(torch.zeros(16),))
    x = torch.randn(16)
    y = m(x)
    assert y.data_ptr() != x.data_ptr()
    y.add_(1)
    assert not torch.equal(x, y)


def test_saved_tensor_hooks_see_residuals_and_inplace_write_is_caught():
    m = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),))
    packed = []
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = m(x)
    rmap = pipeline.residual_map(m)
    n_saved = len(rmap.saved_inputs) + len(rmap.saved_outputs) + len(rmap.residual_specs)
    assert len(packed) == n_saved > 0
    y = m(x)  # saved-tensor hooks switch off torch's version check, so call again without
    with torch.no_grad():
        m.params.Dense_0.kernel.add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.randn_like(y))


def test_optimizer_step_matches_the_same_update_in_jax():
    m = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),))
    x = torch.randn(4, 8)
    ct = torch.randn(4, 8)
    before = _jax_variables(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    (m(x) * ct).sum().backward()
    opt.step()
    xj, ctj = jnp.asarray(x.numpy()), jnp.asarray(ct.numpy())
    grads = jax.grad(lambda v: jnp.sum(ResidualMLPBlock(8).apply(v, xj) * ctj))(before)
    after = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, before, grads)
    with torch.no_grad():
        torch.testing.assert_close(m(x), torch.from_numpy(np.array(
            ResidualMLPBlock(8).apply(after, xj))))


def test_unhashable_static_argument_is_named():
    m = FlaxModule(TwoHeads(), example_args=(_inputs(),))
    with pytest.raises(TypeError, match=r"kwargs\['mode'\].*hashable"):
        m(_inputs(), mode=np.zeros(2))


def test_input_on_another_device_is_named():
    m = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),))
    with pytest.raises(ValueError, match=r"args\[0\] is on meta.*parameters are on cpu"):
        m(torch.zeros(2, 8, device="meta"))


def test_flax_shape_error_mentions_what_we_received():
    m = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),))
    with pytest.raises(Exception) as err:
        m(torch.zeros(2, 5))
    assert "args[0]: torch.float32[2, 5]" in "".join(getattr(err.value, "__notes__", []))


def test_state_dict_round_trips_through_torch_save_weights_only():
    m = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),), seed=1)
    other = FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),), seed=2)
    x = torch.randn(3, 8)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    other(x)  # compiled before loading: the cache must not keep stale state
    other.load_state_dict(torch.load(buf, weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)


def test_dtype_change_behind_torchs_back_recompiles():
    m = FlaxModule(nn.Dense(8), example_args=(torch.zeros(2, 8),))
    m(torch.randn(2, 8))
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    y = m(torch.randn(2, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
