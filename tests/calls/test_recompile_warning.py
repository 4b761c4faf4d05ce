"""Hostile inputs: errors that name the argument, and the recompile-storm warning.

Already covered elsewhere (not repeated here): a Flax shape error carries our note with the
argument's name and shape (test_module.py::test_flax_shape_error_mentions_what_we_received),
an input on another device than the parameters (test_module.py::
test_input_on_another_device_is_named), unhashable static arguments (test_module.py,
test_jax_function.py) and a module returning a Flax Module (test_jax_function.py::
test_module_returning_non_arrays_is_refused).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.twins import ResidualMLPBlock
from torchside import FlaxModule, RecompileWarning, jax_function


def _block(**kwargs):
    return FlaxModule(ResidualMLPBlock(8), example_args=(torch.zeros(2, 8),), **kwargs)


# -- errors that name the argument ------------------------------------------------------


def test_rank_jax_rejects_keeps_its_type_and_gets_our_names_and_shapes():
    f = jax_function(lambda x, w: jnp.einsum("bi,io->bo", x, w))
    with pytest.raises(ValueError, match="subscript") as err:
        f(torch.randn(2, 3, 4), torch.randn(4, 5))
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "args[0]: torch.float32[2, 3, 4], args[1]: torch.float32[4, 5]" in notes
    torch.testing.assert_close(f(torch.ones(2, 4), torch.ones(4, 5)), torch.full((2, 5), 4.0))


@pytest.mark.parametrize(
    ("dtype", "expected"),
    # int64 arguments are narrowed to int32 (tests/test_int64_ids.py); float64 never is.
    [(torch.float8_e4m3fnuz, "JAX cannot hold"), (torch.float64, "64-bit")],
    ids=["float8-fnuz", "float64-without-x64"],
)
def test_dtype_jax_cannot_hold_names_argument_and_module(dtype, expected):
    m = _block()
    with pytest.raises(TypeError, match=rf"argument 'args\[0\]'.*{expected}") as err:
        m(torch.zeros(2, 8).to(dtype))
    assert "FlaxModule(ResidualMLPBlock) was called with args[0]" in "".join(err.value.__notes__)


def test_inputs_on_two_devices_without_parameters_name_both():
    f = jax_function(lambda a, b: a + b)
    with pytest.raises(ValueError, match=r"args\[1\] is on meta, but args\[0\] is on cpu"):
        f(torch.zeros(2), torch.zeros(2, device="meta"))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x: (x, "label"), r"output \[1\] of the function is a str"),
        (lambda x: {"y": x, "obj": object()}, r"output \['obj'\] of the function is a object"),
        (lambda x: (x, jax.random.key(0)), r"output \[1\].*typed PRNG key.*key_data"),
        (lambda x: (x, x.astype(jnp.int4)), r"output \[1\] has dtype int4.*torch cannot hold"),
    ],
    ids=["string", "python-object", "prng-key", "int4"],
)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_outputs_torch_cannot_hold_are_named_by_path(make, match, grad):
    f = jax_function(make)
    with pytest.raises(TypeError, match=match):
        f(torch.randn(3, requires_grad=grad))


# -- recompile storms ------------------------------------------------------------------


def test_recompile_warning_names_changing_dimension_once_and_points_at_caller():
    m = _block(recompile_warning=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in range(1, 4):
            m(torch.randn(batch, 8))
    assert caught == []  # three signatures: within the threshold
    with pytest.warns(RecompileWarning) as record:
        for batch in range(4, 9):
            m(torch.randn(batch, 8))  # the call the warning must point at
    assert len(record) == 1  # once, not at every new signature
    (w,) = record
    text = str(w.message)
    assert "FlaxModule(ResidualMLPBlock)" in text and "4 distinct call signatures" in text
    assert "args[0] dimension 0 (sizes 1, 2, 3, 4)" in text
    assert "dimension 1" not in text and "pad or bucket" in text
    assert w.filename == __file__


def test_recompile_warning_names_static_values_and_dtypes():
    f = jax_function(lambda x, scale: x * scale, recompile_warning=2)
    with pytest.warns(RecompileWarning, match=r"args\[1\] \(static value: 0\.1, 0\.2, 0\.3\)"
                      r".*pass numbers that change every call as tensors"):
        for scale in (0.1, 0.2, 0.3):
            f(torch.ones(2), scale)
    g = jax_function(lambda x: x * 2, recompile_warning=1)
    g(torch.ones(2))
    with pytest.warns(RecompileWarning, match=r"args\[0\] dtype") as record:
        g(torch.ones(2, dtype=torch.bfloat16))
    assert "dimension" not in str(record[0].message)


def test_same_signatures_again_and_rebuilds_after_clear_do_not_count():
    m = _block(recompile_warning=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for _ in range(3):
            for batch in (2, 3):
                m(torch.randn(batch, 8))
            m.clear_caches()  # compiles again, but for signatures already seen
    with pytest.warns(RecompileWarning):
        m(torch.randn(4, 8))


def test_recompile_warning_none_never_warns_and_bad_values_are_refused():
    f = jax_function(lambda x: x + 1, recompile_warning=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for n in range(1, 12):
            f(torch.ones(n))
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="recompile_warning=.*positive int"):
            jax_function(lambda x: x, recompile_warning=bad)
    with pytest.raises(ValueError, match="cache_size=0 must be a positive int"):
        _block(cache_size=0)


def test_default_threshold_is_eight():
    f = jax_function(lambda x: x * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for n in range(1, 9):
            f(torch.ones(n))
    with pytest.warns(RecompileWarning, match="9 distinct call signatures"):
        f(torch.ones(9))
    np.testing.assert_array_equal(f(torch.ones(9)).numpy(), np.full(9, 3.0, np.float32))
