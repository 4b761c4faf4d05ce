"""bridge.to_jax / to_torch: exact zero-copy round trips per dtype, layouts, trees, refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import bridge

ROUND_TRIP = [
    torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.uint8, torch.bool, torch.complex64,
]


def _sample(dtype, shape=(5, 7)):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", ROUND_TRIP, ids=str)
def test_round_trip_is_exact_and_zero_copy(dtype):
    t = _sample(dtype)
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    expected = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if dtype == torch.bfloat16 \
        else t.numpy()
    np.testing.assert_array_equal(np.asarray(a), expected)
    back = bridge.to_torch(a)
    assert back.dtype == dtype
    assert back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", ROUND_TRIP, ids=str)
def test_jax_result_to_torch_is_zero_copy(dtype):
    a = jnp.asarray(np.asarray(bridge.to_jax(_sample(dtype)))) + jnp.zeros((), dtype=
                                                                           bridge.numpy_dtype(dtype))
    if dtype == torch.bool:
        a = a.astype(bool)
    t = bridge.to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.dtype == dtype
    np.testing.assert_array_equal(bridge.to_jax(t.clone()), a)


def test_float64_and_int64_round_trip_under_x64(x64):
    for t in (torch.randn(3, dtype=torch.float64), torch.tensor([2147483653, -5]),
              torch.randn(2, dtype=torch.complex128)):
        a = bridge.to_jax(t)
        assert a.dtype == bridge.numpy_dtype(t.dtype)
        assert torch.equal(bridge.to_torch(a), t)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.complex128], ids=str)
def test_64_bit_without_x64_is_refused_not_wrapped(dtype):
    t = torch.tensor([2147483653]).to(dtype)
    with pytest.raises(TypeError, match=r"argument 'ids'.*jax_enable_x64") as err:
        bridge.to_jax(t, name="ids")
    assert ".to(torch." in str(err.value)


def test_unsupported_dtype_names_argument():
    t = torch.zeros(2, dtype=torch.float8_e4m3fnuz)
    with pytest.raises(TypeError, match="argument 'q'"):
        bridge.to_jax(t, name="q")


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 8).t(),
        lambda: torch.randn(6, 8)[:, 1:5],
        lambda: torch.randn(1, 8).expand(5, 8),
        lambda: torch.randn(100)[1:33],  # 4 bytes past an aligned address
        lambda: torch.randn(4, 4)[::2],
    ],
    ids=["transposed", "column-slice", "expanded-stride0", "unaligned", "row-step"],
)
def test_awkward_layouts_give_correct_values_and_refuse_copy_false(make):
    t = make()
    a = bridge.to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.contiguous().numpy())
    with pytest.raises(ValueError, match="copy=False"):
        bridge.to_jax(t, copy=False)


def test_copy_true_copies_and_copy_false_shares():
    t = torch.randn(16)
    shared = bridge.to_jax(t, copy=False)
    copied = bridge.to_jax(t, copy=True)
    assert shared.unsafe_buffer_pointer() == t.data_ptr()
    assert copied.unsafe_buffer_pointer() != t.data_ptr()
    before = np.asarray(copied).copy()
    t.add_(1)
    np.testing.assert_array_equal(np.asarray(copied), before)
    assert bridge.to_torch(jnp.ones(3), copy=True).data_ptr() != 0


def test_requires_grad_is_detached():
    t = torch.randn(4, requires_grad=True)
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()


def test_transposed_input_compiles_once():
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x * 2

    base = torch.randn(8, 6)
    f(bridge.to_jax(base.t().contiguous()))
    f(bridge.to_jax(base.t()))  # made compact: same layout, same executable
    assert len(traces) == 1
    assert f._cache_size() == 1


def test_trees():
    tree = {"a": torch.ones(2), "b": [torch.zeros(3, dtype=torch.int32), 4], "c": None}
    j = bridge.tree_to_jax(tree)
    assert isinstance(j["a"], jax.Array) and j["b"][1] == 4 and j["c"] is None
    back = bridge.tree_to_torch(j)
    assert torch.equal(back["b"][0], tree["b"][0])


def test_wrong_types_and_devices():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        bridge.to_jax(np.ones(2))
    with pytest.raises(TypeError, match="must be a jax.Array"):
        bridge.to_torch(torch.ones(2))
    with pytest.raises(ValueError, match="meta"):
        bridge.to_jax(torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match="torch cannot hold"):
        bridge.to_torch(jnp.zeros(2, jnp.int4))


def test_device_table():
    assert bridge.jax_device(torch.device("cpu")).platform == "cpu"
    assert bridge.torch_device(jax.devices("cpu")[0]) == torch.device("cpu")


@pytest.mark.gpu
def test_cuda_round_trip_zero_copy():
    """Catches a copy on the way in and a wrong device or value on the way back."""
    t = torch.randn(64, 64, device="cuda")
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = bridge.to_torch(a * 2)
    assert back.device.type == "cuda"
    torch.testing.assert_close(back, t * 2)
