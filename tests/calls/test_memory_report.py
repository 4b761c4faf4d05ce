"""memory_report: held bytes from the residual map, XLA temp sizes, FlaxModule delegation."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flaxside
from flaxside.internal import ARRAY, LeafSpec, Program, compile_for_report, flat_apply, unpack
from tests.support import pipeline
from tests.support.twins import (
    NnxDropoutMLP,
    NnxResidualMLPBlock,
    ResidualMLPBlock,
    ScanRematStack,
    ScanStack,
)
from torchside import FlaxModule

jtu = jax.tree_util
W, B, DEPTH = 8, 4, 6



def _split(program, flat):
    """``forward_with_residuals``'s flat list as (results, residual buffers)."""
    n = len(program.out_specs)
    return flat[:n], flat[n:]

def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jtu.tree_leaves(tree))


def _residuals_of_a_real_call(module, variables, x):
    """Runs the Program a FlaxModule would build and returns the residual arrays it keeps."""
    var_leaves, var_treedef = jtu.tree_flatten(variables)
    _, arg_treedef = jtu.tree_flatten(((x,), {}))
    specs = [LeafSpec(a.shape, np.dtype(a.dtype), True) for a in [*var_leaves, x]]
    apply = lambda v, x: (module.apply(v, x), [], None)  # noqa: E731 - Program's contract
    program = Program(flat_apply(apply, var_treedef, arg_treedef, (ARRAY,)), specs)
    _, residuals = _split(program, program.forward_with_residuals([*var_leaves, x]))
    return residuals


@pytest.mark.parametrize(
    "module",
    [ScanStack(W, DEPTH), flaxside.remat_stack(ResidualMLPBlock, DEPTH, lengths=(2, 3), width=W)],
    ids=["scan", "remat_stack"],
)
def test_held_bytes_are_the_residuals_a_call_keeps(module):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, W)), jnp.float32)
    variables = jax.jit(module.init)(jax.random.key(0), x)
    report = flaxside.memory_report(module, x, variables=variables)
    residuals = _residuals_of_a_real_call(module, variables, x)
    assert report.held_bytes == _nbytes(residuals) > 0
    assert report.residual_count == len(residuals)
    assert report.param_bytes == _nbytes(variables["params"])
    assert report.forward_temp_bytes >= 0 and report.backward_temp_bytes >= 0
    assert report.compile_seconds > 0


def test_remat_holds_less_and_shapes_suffice():
    x = jax.ShapeDtypeStruct((B, W), jnp.float32)
    plain = flaxside.memory_report(ScanStack(W, DEPTH), x)
    remat = flaxside.memory_report(ScanRematStack(W, DEPTH), x)
    assert remat.held_bytes == DEPTH * B * W * 4  # one carry per layer
    assert plain.held_bytes > 2 * remat.held_bytes
    assert remat.param_bytes == plain.param_bytes


def test_report_prints_as_a_table():
    report = flaxside.memory_report(nn.Dense(3), jax.ShapeDtypeStruct((2, 4), jnp.float32))
    text = str(report)
    for row in ("held (residuals)", "parameters", "forward temp", "backward temp", "compile"):
        assert row in text
    assert "60 B" in text  # kernel 4x3 + bias 3, float32


def test_nnx_module_and_plain_function():
    x = jax.ShapeDtypeStruct((B, W), jnp.float32)
    block = NnxResidualMLPBlock(W, rngs=nnx.Rngs(0))
    report = flaxside.memory_report(block, x)
    assert report.param_bytes == _nbytes(nnx.state(block, nnx.Param))
    assert report.held_bytes > 0

    def fn(w, x):
        return jnp.tanh(x @ w)

    report = flaxside.memory_report(fn, jax.ShapeDtypeStruct((W, W), jnp.float32), x)
    assert report.param_bytes == 0
    assert report.held_bytes == B * W * 4  # tanh's output, for its derivative


def test_errors():
    with pytest.raises(ValueError, match="nothing in the call is differentiable"):
        flaxside.memory_report(lambda i: i * 2, jax.ShapeDtypeStruct((3,), jnp.int32))
    with pytest.raises(TypeError, match="argument 'target' is a int"):
        flaxside.memory_report(3)


def test_compile_for_report_then_calls_agree_with_jax_vjp():
    rng = np.random.default_rng(1)
    w, x, ct = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((W, W), (B, W), (B, W)))
    program = Program(lambda xs: (jnp.tanh(xs[1] @ xs[0]), [], None),
                      [LeafSpec((W, W), np.dtype(np.float32), True),
                       LeafSpec((B, W), np.dtype(np.float32), True)])
    compiled = compile_for_report(program)
    assert set(compiled) == {"forward_with_residuals", "backward"}
    out, res = _split(program, program.forward_with_residuals([w, x]))
    rmap = program.residual_map()
    saved_in = [[w, x][j] for j in rmap.saved_inputs]
    saved_out = [out[k] for k in rmap.saved_outputs]
    grads = unpack(program.backward(saved_in, saved_out, res, [ct]), program.grad_pack)
    want_out, pull = jax.vjp(lambda w, x: jnp.tanh(x @ w), w, x)
    torch.testing.assert_close([torch.from_numpy(np.array(a)) for a in [*out, *grads]],
                               [torch.from_numpy(np.array(a)) for a in [want_out, *pull(ct)]])


def test_flax_module_memory_report_delegates():
    stack = flaxside.remat_stack(ResidualMLPBlock, DEPTH, lengths=(2, 3), width=W)
    variables = jax.jit(stack.init)(jax.random.key(0), jnp.zeros((B, W)))
    layer = FlaxModule(stack, variables=variables)
    got = layer.memory_report(torch.zeros(B, W))
    want = flaxside.memory_report(stack, jax.ShapeDtypeStruct((B, W), jnp.float32))
    assert (got.held_bytes, got.param_bytes, got.forward_temp_bytes, got.backward_temp_bytes) == (
        want.held_bytes, want.param_bytes, want.forward_temp_bytes, want.backward_temp_bytes)
    assert got.held_bytes == 2 * B * W * 4


# -- FlaxModule.memory_report measures the call the module makes (issue 24) ---------------
class DropNet(nn.Module):
    """The issue's reproduction: Dense -> Dropout(0.5) -> tanh -> Dense."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dropout(0.5, deterministic=not train)(nn.Dense(64)(x))
        return nn.Dense(1)(jnp.tanh(h))


class BNDropNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(32)(x))
        h = nn.remat(nn.Dropout, static_argnums=(2,))(0.3)(jnp.tanh(h), not train)
        return nn.Dense(4)(h)


def _held_by_a_real_call(layer, x) -> int:
    """Bytes a call's graph saves, beyond parameters, buffers, the input and the outputs."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = layer(x)
    own = {t.data_ptr() for t in [*layer.parameters(), *layer.buffers(), x, y]}
    return sum(t.numel() * t.element_size() for t in packed if t.data_ptr() not in own)


MODELS = {
    "dropout": lambda res: FlaxModule(DropNet(), example_args=(torch.zeros(16, 8),),
                                      rngs=("dropout",), train_kwarg="train", residuals=res),
    "batchnorm+remat dropout": lambda res: FlaxModule(
        BNDropNet(), example_args=(torch.zeros(16, 8),), rngs=("dropout",),
        train_kwarg="train", residuals=res),
    "nnx": lambda res: FlaxModule(NnxDropoutMLP(nnx.Rngs(0, dropout=1), din=8, hidden=32,
                                                dout=4, rate=0.3), residuals=res),
}


@pytest.mark.parametrize("residuals", ["save", "recompute"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("model", list(MODELS))
def test_flax_module_report_is_what_its_call_holds(model, train, residuals):
    layer = MODELS[model](residuals)
    layer.train(train)
    x = torch.randn(16, 8, requires_grad=True)
    report = layer.memory_report(x)
    compiled = len(pipeline.entries(layer))
    assert report.held_bytes == _held_by_a_real_call(layer, x), report
    assert len(pipeline.entries(layer)) == compiled  # the call ran the report's programs


def test_train_mode_report_differs_from_eval_where_the_call_does():
    layer = MODELS["dropout"]("save")
    x = torch.randn(16, 8, requires_grad=True)
    layer.train()
    train = layer.memory_report(x)
    layer.eval()
    evaluation = layer.memory_report(x)
    assert train.held_bytes > evaluation.held_bytes  # the dropout mask and its input


def test_report_refuses_a_call_with_no_backward():
    layer = FlaxModule(nn.Dense(3), example_args=(torch.zeros(2, 4),))
    layer.requires_grad_(False)
    with pytest.raises(ValueError, match=r"memory_report: nothing in the call requires grad"):
        layer.memory_report(torch.zeros(2, 4, dtype=torch.int32))
