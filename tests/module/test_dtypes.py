"""Dtypes a trainer changes: ``torch.autocast``, ``.half()`` / ``.to(dtype)``, float64.

Under ``torch.autocast`` the default ``autocast="outputs"`` runs the block in its
parameters' dtype and casts the outputs; ``"inputs"`` runs it in the autocast dtype;
``"off"`` leaves it alone. bf16 activations from a torch layer under autocast then meet a
float32 scan stack: with the default the block runs in float32, inputs included, where a
scan whose carry is the residual stream would otherwise see a bf16 carry in and a float32
carry out. Moving the parameters to another dtype compiles for it; float64 needs x64.
Also: a dtype changed behind torch's back (module/test_module.py), held arrays of
re-typed parameters (exchange/test_held_arrays.py).
"""

import functools as ft

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.references import to_jax, to_torch
from tests.support.twins import ReadmeBlock, ReadmeDeep
from torchside import FlaxModule

WIDTH = 16


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.tanh(nn.Dense(8)(x)))


def _module(**kw):
    return FlaxModule(Head(), example_args=(torch.zeros(2, 5),), **kw)


def test_autocast_default_runs_in_parameter_dtype_and_casts_outputs():
    m = _module()
    x = torch.randn(3, 5, requires_grad=True)
    reference = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        lin = torch.nn.Linear(5, 4)(x)
    assert y.dtype == lin.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference.to(torch.bfloat16))  # computed in float32
    y.float().sum().backward()
    assert m.params.Dense_0.kernel.grad.dtype == torch.float32


def test_autocast_inputs_mode_runs_in_autocast_dtype():
    m = _module(autocast="inputs")
    x = torch.randn(3, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    variables = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), m.flax_variables())
    expected = Head().apply(variables, jnp.asarray(x.numpy()).astype(jnp.bfloat16))
    torch.testing.assert_close(y.float(), torch.from_numpy(np.array(expected.astype(jnp.float32))))
    y.float().sum().backward()
    assert m.params.Dense_0.kernel.grad.dtype == torch.float32  # the master copy


def test_autocast_off_and_bad_option():
    m = _module(autocast="off")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(torch.randn(3, 5)).dtype == torch.float32
    with pytest.raises(ValueError, match="autocast='sometimes'"):
        _module(autocast="sometimes")


@pytest.mark.parametrize("move", ["half", "bfloat16", "to"])
def test_dtype_moves_respecialize(move):
    m = _module()
    x = torch.randn(3, 5)
    m(x)
    target = {"half": torch.float16, "bfloat16": torch.bfloat16, "to": torch.bfloat16}[move]
    m = m.to(target) if move == "to" else getattr(m, move)()
    assert all(p.dtype == target for p in m.parameters())
    y = m(x.to(target))
    assert y.dtype == target
    expected = Head().apply(m.flax_variables(), jnp.asarray(x.numpy()).astype(
        np.dtype(jnp.bfloat16) if target == torch.bfloat16 else np.float16))
    torch.testing.assert_close(y.float(), torch.from_numpy(np.array(expected.astype(np.float32))))


def test_double_without_x64_is_refused_and_works_with_it():
    m = _module()
    with pytest.raises(TypeError, match="jax_enable_x64"):
        m.double()
    with pytest.raises(TypeError, match="jax_enable_x64"):
        m.to(torch.float64)
    assert all(p.dtype == torch.float32 for p in m.parameters())  # nothing moved
    with jax.enable_x64(True):
        m.double()
        y = m(torch.randn(3, 5, dtype=torch.float64))
        assert y.dtype == torch.float64


# -- bf16 activations into a float32 stack ------------------------------------------------
# The README's block under nn.scan without remat. Not twins.ScanStack: its block computes
# in an explicit float32, which would turn a bf16 carry into float32 whatever FlaxModule
# does; this one computes in the carry's dtype, as the README's does.
class Cell(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return ReadmeBlock(WIDTH)(carry), None


class ScanStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(name="scan")(x, None)[0]


@pytest.mark.parametrize("block", [ft.partial(ReadmeDeep, WIDTH), ScanStack],
                         ids=["remat_scan", "nn.scan"])
def test_bf16_activations_run_the_float32_stack_and_reach_every_gradient(block):
    trunk = FlaxModule(block(), example_args=(torch.zeros(2, WIDTH),))
    stem = torch.nn.Linear(8, WIDTH)
    x = torch.randn(6, 8)
    with torch.autocast("cpu", torch.bfloat16):
        h = stem(x)
        h.retain_grad()
        y = trunk(h)
    assert h.dtype == y.dtype == torch.bfloat16
    ct = torch.randn(6, WIDTH, dtype=torch.bfloat16)
    y.backward(ct)

    # The same float32 program, called on the bf16 activations cast to float32.
    with torch.no_grad():
        same_program = trunk(h.detach().float())
    torch.testing.assert_close(y.detach(), same_program.to(torch.bfloat16), rtol=0, atol=0)

    # Pure JAX: the float32 block, its VJP at those activations with the cotangent in float32.
    variables = jax.tree_util.tree_map(jnp.array, trunk.flax_variables())

    def f(params, x):
        return block().apply({"params": params}, x)

    out, vjp = jax.vjp(f, variables["params"], to_jax(h.float()))
    g_params, g_h = vjp(to_jax(ct.float()))
    torch.testing.assert_close(same_program, to_torch(out))
    torch.testing.assert_close(h.grad, to_torch(g_h).to(torch.bfloat16))
    flat = {"params." + ".".join(k.key for k in path): g
            for path, g in jax.tree_util.tree_flatten_with_path(g_params)[0]}
    assert set(flat) == {name for name, _ in trunk.named_parameters()}
    for name, p in trunk.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, to_torch(flat[name]), msg=lambda m, n=name: f"{n}: {m}")
    assert stem.weight.grad is not None and torch.isfinite(stem.weight.grad).all()
