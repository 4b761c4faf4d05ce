"""Static values that compare equal but compute differently never share a program (issue 14).

``0.0 == -0.0`` and ``1 == 1.0 == True``, and ``nan != nan``; a compile cache keyed on
equality would hand ``-0.0`` the program traced for ``0.0`` (``x / -0.0`` gives ``+inf``)
and retrace for every NaN. The reference is JAX itself, run on the same static value.
"""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchside import FlaxModule, jax_function

ONES = np.ones(2, np.float32)

# name -> (0.0-like, -0.0-like); the function divides by the value (or its real part).
ZEROS = {
    "float": (0.0, -0.0),
    "np.float32": (np.float32(0.0), np.float32(-0.0)),
    "np.float64": (np.float64(0.0), np.float64(-0.0)),
    "complex": (0j, complex(-0.0, 0.0)),
    "nested-dict": ({"s": 0.0}, {"s": -0.0}),
}


def _divide(x, s):
    s = s["s"] if isinstance(s, dict) else s
    return x / jnp.real(jnp.asarray(s))


@pytest.mark.parametrize("order", ["positive-first", "negative-first"],
                         ids=["positive-first", "negative-first"])
@pytest.mark.parametrize("kind", list(ZEROS), ids=list(ZEROS))
def test_signed_zeros_get_their_own_programs(kind, order):
    values = ZEROS[kind] if order == "positive-first" else ZEROS[kind][::-1]
    f = jax_function(_divide)
    for s in values:
        want = np.asarray(_divide(jnp.asarray(ONES), s))
        np.testing.assert_array_equal(f(torch.from_numpy(ONES), s).numpy(), want)
    assert f.trace_count == 2
    assert {np.sign(np.asarray(_divide(jnp.asarray(ONES), s)))[0] for s in values} == {-1, 1}


class Divide(nn.Module):
    @nn.compact
    def __call__(self, x, s):
        return x / s


@pytest.mark.parametrize("order", [(0.0, -0.0), (-0.0, 0.0)], ids=["positive-first",
                                                                   "negative-first"])
def test_flax_module_static_signed_zero(order):
    m = FlaxModule(Divide(), example_args=(torch.ones(2), 1.0))
    for s in order:
        want = np.asarray(Divide().apply({}, jnp.ones(2), s))
        np.testing.assert_array_equal(m(torch.ones(2), s).numpy(), want)


def test_nan_gets_one_program_and_reuses_it():
    f = jax_function(lambda x, s: x + s)
    x = torch.ones(2)
    # float("nan") makes a new object each time: only a key on its bits finds the program.
    for _ in range(3):
        assert torch.isnan(f(x, float("nan"))).all()
    assert f.trace_count == 1
    torch.testing.assert_close(f(x, 2.0), torch.full((2,), 3.0))
    assert f.trace_count == 2
    assert torch.isnan(f(x, float("nan"))).all()
    assert f.trace_count == 2


def test_cache_after_a_sequence_of_equal_comparing_values():
    f = jax_function(lambda x, s: x + s)
    for s in (float("nan"), float("nan"), 0.0, -0.0, 0.0, 1, 1.0, True, 1, -0.0,
              float("nan")):
        f(torch.ones(2), s)
    assert f.trace_count == 6  # nan, 0.0, -0.0, 1, 1.0, True


def _kind(s) -> int:
    return len(type(s).__name__)  # Python code that tells the types apart, as users write


# Values equal under ==; each computes differently (its type reaches the function).
EQUAL_GROUPS = {
    "1/1.0/True": (1, 1.0, True),
    "np.int32/np.float32/float": (np.int32(1), np.float32(1), 1.0),
}


@pytest.mark.parametrize("group", list(EQUAL_GROUPS), ids=list(EQUAL_GROUPS))
def test_equal_values_of_different_types_compile_apart(group):
    f = jax_function(lambda x, s: x * 0 + _kind(s))
    values = EQUAL_GROUPS[group]
    for order in (values, values[::-1]):
        for s in order:
            torch.testing.assert_close(f(torch.ones(2), s), torch.full((2,), float(_kind(s))))
    assert f.trace_count == len(values)
