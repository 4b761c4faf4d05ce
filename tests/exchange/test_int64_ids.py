"""int64 arguments (token ids, masks, positions) while JAX runs without 64-bit types.

Tokenizers, ``torch.randint`` and DataLoaders hand int64 ids. A call narrows each int64
argument to int32 after checking that every value fits; a value that does not fit raises
naming the argument, before anything runs. References are pure JAX with int32 ids.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support import pipeline
from torchside import FlaxModule, jax_function

VOCAB, WIDTH = 50, 16


class TinyLM(nn.Module):
    """Embedding, one attention-free mixing layer masked by ``mask``, logits."""

    @nn.compact
    def __call__(self, ids, mask):
        h = nn.Embed(VOCAB, WIDTH)(ids)
        h = h + nn.Dense(WIDTH)(jnp.tanh(h)) * mask[..., None]
        return nn.Dense(VOCAB)(h)


def _ids(shape=(4, 6)):
    return torch.randint(0, VOCAB, shape)  # int64, as a tokenizer's


def _reference(m: FlaxModule, ids, mask, ct):
    variables = jax.tree_util.tree_map(jnp.array, m.flax_variables())
    ids32 = jnp.asarray(ids.numpy().astype(np.int32))
    mask32 = jnp.asarray(mask.numpy().astype(np.int32))

    def f(params):
        return TinyLM().apply({"params": params}, ids32, mask32)

    out, pull = jax.vjp(f, variables["params"])
    (grads,) = pull(jnp.asarray(ct.numpy()))
    return np.array(out), grads


def _assert_matches(m: FlaxModule, y, ids, mask, ct) -> None:
    """Output and every parameter gradient against pure JAX with int32 ids."""
    want, grads = _reference(m, ids, mask, ct)
    torch.testing.assert_close(y.detach(), torch.from_numpy(want))
    for name, p in m.named_parameters():
        _, scope, leaf = name.split(".")
        torch.testing.assert_close(p.grad, torch.from_numpy(np.array(grads[scope][leaf])),
                                   msg=lambda msg, n=name: f"{n}.grad: {msg}")


def _module(**options):
    example = (torch.zeros(4, 6, dtype=torch.int32), torch.ones(4, 6, dtype=torch.int32))
    return FlaxModule(TinyLM(), example_args=example, **options)


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_int64_ids_and_mask_train_like_int32_ones_in_pure_jax(residuals):
    m = _module(residuals=residuals)
    ids, mask = _ids(), torch.randint(0, 2, (4, 6))
    assert ids.dtype == mask.dtype == torch.int64
    y = m(ids, mask)
    ct = torch.randn_like(y)
    (y * ct).sum().backward()
    _assert_matches(m, y, ids, mask, ct)
    assert ids.dtype == torch.int64  # the caller's tensor is left alone


def test_int64_ids_without_grad_and_under_torch_compile():
    m = _module()
    ids, mask = _ids(), torch.ones(4, 6, dtype=torch.int64)
    with torch.no_grad():
        plain = m(ids, mask)
    torch.testing.assert_close(plain, torch.from_numpy(_reference(m, ids, mask,
                                                                  torch.zeros(4, 6, VOCAB))[0]))
    compiled = torch.compile(m, fullgraph=True)
    y = compiled(ids, mask)
    ct = torch.randn_like(y)
    (y * ct).sum().backward()
    _assert_matches(m, y, ids, mask, ct)


class CountingLM(nn.Module):
    """``TinyLM`` that also counts its train-mode calls in a state collection."""

    @nn.compact
    def __call__(self, ids, mask):
        calls = self.variable("stats", "calls", lambda: jnp.zeros((), jnp.int32))
        if not self.is_initializing():
            calls.value = calls.value + 1
        return TinyLM()(ids, mask)


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1], ids=["too-large", "too-small"])
def test_a_value_that_does_not_fit_int32_is_refused_by_name_before_anything_runs(bad):
    """No program runs before the check: a fresh module has fetched no executable, its
    counter and parameters are unchanged, and no gradient exists."""
    example = (torch.zeros(4, 6, dtype=torch.int32), torch.ones(4, 6, dtype=torch.int32))
    m = FlaxModule(CountingLM(), example_args=example)
    m.train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ids = _ids()
    ids[1, 2] = bad
    with pytest.raises(TypeError, match=r"FlaxModule\(CountingLM\): argument 'args\[0\]' is "
                                        r"torch.int64 with values from -?\d+ to -?\d+, which "
                                        r"do not fit int32.*jax_enable_x64"):
        m(ids, torch.ones(4, 6, dtype=torch.int64))
    assert pipeline.executables_run(m) == []  # checked before any program ran
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    assert all(p.grad is None for p in m.parameters())
    ids[1, 2] = 3
    m(ids, torch.ones(4, 6, dtype=torch.int64)).sum().backward()  # the next call works
    assert int(m.stats.calls) == 1 and pipeline.executables_run(m)  # it ran, once


def test_int64_and_int32_calls_agree():
    m = _module()
    ids, mask = _ids(), torch.ones(4, 6, dtype=torch.int64)
    with torch.no_grad():
        torch.testing.assert_close(m(ids, mask), m(ids.int(), mask.int()), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["limits", "strided", "scalar", "empty"])
def test_every_value_that_fits_crosses_unchanged(case):
    """int32's limits pass the check; strided, 0-d and empty int64 tensors cross as their
    values (the program returns what it received; the reference is numpy's int32 cast)."""
    limits = torch.tensor([[-(2**31), 2**31 - 1, 0], [-1, 1, 7]])
    values = {"limits": limits, "strided": torch.arange(24).reshape(4, 6)[:, ::2].T,
              "scalar": torch.tensor(2**31 - 1), "empty": torch.zeros(0, 3, dtype=torch.int64)}
    given = values[case]
    out = jax_function(lambda v: v)(given)
    assert out.dtype == torch.int32 and out.shape == given.shape
    np.testing.assert_array_equal(out.numpy(), given.numpy().astype(np.int32))


def test_jax_function_int64_positions_with_a_float_input_that_needs_grad():
    @jax_function
    def shift(x, pos):
        return x * jnp.sin(pos.astype(x.dtype))

    x = torch.randn(3, 5, requires_grad=True)
    pos = torch.arange(15).reshape(3, 5)
    y = shift(x, pos)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.sin(pos.float()))


def test_under_x64_int64_stays_int64(x64):
    f = jax_function(lambda ids: (ids + 1, ids.dtype == jnp.int64))
    big = torch.tensor([2**40, -(2**35)])
    out, is64 = f(big)
    assert out.dtype == torch.int64 and bool(is64)
    torch.testing.assert_close(out, big + 1, rtol=0, atol=0)


def test_int64_example_args_initialize_like_int32_ones():
    example = (torch.zeros(4, 6, dtype=torch.int64), torch.ones(4, 6, dtype=torch.int64))
    m64 = FlaxModule(TinyLM(), example_args=example, seed=3)
    m32 = FlaxModule(TinyLM(), example_args=tuple(t.int() for t in example), seed=3)
    for (name, a), (_, b) in zip(m64.state_dict().items(), m32.state_dict().items(),
                                 strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    bad = (torch.full((4, 6), 2**40), example[1])
    with pytest.raises(TypeError, match=r"FlaxModule\(TinyLM\): argument 'example_args\[0\]' "
                                        r"is torch.int64 with values from"):
        FlaxModule(TinyLM(), example_args=bad)
