"""The recompile warning: once, after too many call signatures, naming what changes.

A changing dimension, static value or dtype is named with the values seen, the warning
points at the caller's line, and ``recompile_warning=`` sets the threshold (``None``:
never).
"""

import warnings

import numpy as np
import pytest
import torch

from tests.support.twins import residual_block_module
from torchside import RecompileWarning, jax_function


def test_recompile_warning_names_changing_dimension_once_and_points_at_caller():
    m = residual_block_module(recompile_warning=3)
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
    m = residual_block_module(recompile_warning=2)
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
        residual_block_module(cache_size=0)


def test_default_threshold_is_eight():
    f = jax_function(lambda x: x * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for n in range(1, 9):
            f(torch.ones(n))
    with pytest.warns(RecompileWarning, match="9 distinct call signatures"):
        f(torch.ones(9))
    np.testing.assert_array_equal(f(torch.ones(9)).numpy(), np.full(9, 3.0, np.float32))
