"""What a trainer does on day one: autocast, dtype moves, threads."""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support import pipeline
from torchside import FlaxModule


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


def test_threads_share_the_cache_and_get_correct_gradients():
    m = _module()
    batches = [torch.randn(b, 5) for b in (2, 3, 2, 3, 4, 2, 4, 3)]
    params = list(m.parameters())

    def grads(x):
        y = m(x)
        return torch.autograd.grad((y * y).sum(), params)

    expected = [grads(x) for x in batches]
    results = [None] * len(batches)
    errors = []

    def work(i):
        try:
            for _ in range(5):
                results[i] = grads(batches[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in zip(results, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert len(pipeline.entries(m)) == 3  # one program per batch size, shared by all threads
