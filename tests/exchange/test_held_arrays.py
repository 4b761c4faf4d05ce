"""Parameters cross to JAX as arrays made once per module and reused: never stale, never a copy.

Every check compares with ``jax.vjp`` of pure Flax on fresh copies of the parameters'
current values (their current dtype and shape included), so old bits read as a new dtype
or shape fail here.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import bridge
from tests.support.pipeline import crosses_by_dlpack, entries, held_arrays, programs
from torchside import FlaxModule


class Square(nn.Module):
    """One square kernel: a transposed view has the same address, shape and dtype."""

    features: int = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, use_bias=False)(x) ** 2


_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}


def _jax(t: torch.Tensor) -> jax.Array:
    """A fresh JAX copy of a tensor's current values in its own dtype."""
    return jnp.asarray(t.detach().resolve_neg().float().numpy().astype(_NP[t.dtype]))


def _reference(module: FlaxModule, x: torch.Tensor, cot: torch.Tensor):
    """Output and gradients from jax.vjp of pure Flax on the module's current values."""
    kernel = _jax(module.get_parameter("params.Dense_0.kernel"))
    y, vjp = jax.vjp(
        lambda k, a: module.flax_module.apply({"params": {"Dense_0": {"kernel": k}}}, a),
        kernel, _jax(x))
    gk, gx = vjp(_jax(cot).astype(y.dtype))
    return [np.asarray(a, np.float32) for a in (y, gk, gx)]


def _check(module: FlaxModule, seed: int, dtype=torch.float32, features: int = 8) -> None:
    gen = torch.Generator().manual_seed(seed)
    kernel = module.get_parameter("params.Dense_0.kernel")
    x = torch.randn(4, kernel.shape[0], generator=gen).to(dtype).requires_grad_()
    kernel.grad = None
    y = module(x)
    cot = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(cot)
    ref_y, ref_gk, ref_gx = _reference(module, x.detach(), cot)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((y, ref_y), (kernel.grad, ref_gk), (x.grad, ref_gx)):
        got = got.detach().float().numpy()
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _module(features: int = 8, in_features: int = 8) -> FlaxModule:
    return FlaxModule(Square(features), example_args=(torch.zeros(4, in_features),))


def test_parameter_array_is_made_once_and_shares_memory():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    _check(m, 0)
    (first,) = held_arrays(m)
    assert first.unsafe_buffer_pointer() == kernel.data_ptr()  # zero-copy
    _check(m, 1)
    (second,) = held_arrays(m)
    assert second is first  # reused, not made again


def test_optimizer_steps_in_place_are_read_by_the_next_call():
    m = _module()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for seed in range(4):
        _check(m, seed)  # compares with jax.vjp on a fresh copy of the current kernel
        opt.step()


def test_replaced_parameter_memory_is_used_not_the_held_array():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    _check(m, 0)
    with torch.no_grad():
        kernel.data = torch.randn(8, 8)  # new memory, same signature
    _check(m, 1)
    (held,) = held_arrays(m)
    assert held.unsafe_buffer_pointer() == kernel.data_ptr()


def test_transposed_view_at_the_same_address_is_not_mistaken_for_the_held_array():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    with torch.no_grad():
        kernel.copy_(torch.randn(8, 8))
    _check(m, 0)
    kernel.data = kernel.data.t()  # same data_ptr, shape and dtype; other layout
    assert not kernel.is_contiguous()
    _check(m, 1)


@pytest.mark.parametrize("how", ["p.data", "load_state_dict(assign=True)"])
def test_retyped_parameters_are_read_in_their_new_dtype(how):
    """fp16 then bf16 at the same sizes: the bf16 bits must never be read as fp16 (issue 13)."""
    m = _module().half()
    _check(m, 0, torch.float16)
    if how == "p.data":
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)
    else:
        state = {k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}
        torch.nn.Sequential(m).load_state_dict({f"0.{k}": v for k, v in state.items()},
                                               assign=True)
    assert m.get_parameter("params.Dense_0.kernel").dtype == torch.bfloat16
    _check(m, 1, torch.float16)  # fp16 input, bf16 kernel: as pure Flax promotes them


def test_fp32_parameters_retyped_to_bf16_with_an_odd_last_dimension():
    m = _module(features=7, in_features=3)
    _check(m, 0)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    _check(m, 1)


def test_parameter_reshaped_at_the_same_address_raises_like_pure_flax():
    m = _module(features=7, in_features=3)
    kernel = m.get_parameter("params.Dense_0.kernel")
    x = torch.randn(4, 3)
    with torch.no_grad():
        m(x)
    ptr = kernel.data_ptr()
    kernel.data = kernel.data.view(7, 3)  # it was (3, 7)
    assert kernel.data_ptr() == ptr
    with pytest.raises(Exception) as pure:
        m.flax_module.apply({"params": {"Dense_0": {"kernel": _jax(kernel)}}}, _jax(x))
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(type(pure.value), match="kernel"):
            m(x.requires_grad_(grad))


def test_unaligned_parameter_is_never_held_and_never_stale():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    storage = torch.zeros(64 + 1)
    kernel.data = storage[1:].view(8, 8)  # 4 bytes past an aligned address: JAX copies it
    with torch.no_grad():
        kernel.copy_(torch.randn(8, 8))
    assert kernel.data_ptr() % bridge.internal.ALIGNMENT != 0
    _check(m, 0)
    assert held_arrays(m) == []
    with torch.no_grad():
        kernel.mul_(-2.0)
    _check(m, 1)


def test_saved_tensor_hooks_that_copy_get_correct_gradients_and_are_not_held():
    m = _module()
    _check(m, 0)
    (before,) = held_arrays(m)
    copies = []

    def pack(t):
        copies.append(t.clone())
        return copies[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.clone()):
        _check(m, 1)
    (after,) = held_arrays(m)
    assert after is before  # the backward's temporaries were not held


def test_autocast_copies_are_not_held():
    m = FlaxModule(Square(), example_args=(torch.zeros(4, 8),), autocast="inputs")
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1 = m(x)
        y2 = m(x)
    assert y1.dtype == torch.bfloat16
    torch.testing.assert_close(y1, y2)
    assert held_arrays(m) == []


def test_held_arrays_are_one_set_per_module_not_per_signature():
    m = _module()
    for batch in (1, 2, 3, 4):
        m(torch.randn(batch, 8))
    assert len(entries(m)) == 4 and len(held_arrays(m)) == 1


def test_clear_caches_releases_held_arrays():
    m = _module()
    _check(m, 0)
    assert held_arrays(m)
    m.clear_caches()
    assert entries(m) == [] and held_arrays(m) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_held_arrays_for_narrow_float_dtypes(dtype):
    m = _module().to(dtype)
    _check(m, 0, dtype)
    with torch.no_grad():
        m.get_parameter("params.Dense_0.kernel").mul_(0.5)
    _check(m, 1, dtype)


def test_dlpack_exchange_mode_matches_pure_jax():
    """The CUDA code path (DLPack both ways, one fence per call), run on CPU."""
    previous = bridge.set_exchange_mode("dlpack")
    try:
        m = _module()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for seed in range(3):
            _check(m, seed)
            opt.step()
        assert all(crosses_by_dlpack(m)) and all(p.fence for p in programs(m))
        (held,) = held_arrays(m)
        assert held.unsafe_buffer_pointer() == m.get_parameter("params.Dense_0.kernel").data_ptr()
    finally:
        bridge.set_exchange_mode(previous)


def test_a_lazy_negation_at_the_same_address_is_read_negated():
    """Catches the held arrays' whole-list check (NOTE [Held arrays per call]) skipping the
    negative bit: the same address, shape, dtype and strides, read as the old bits."""
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    with torch.no_grad():
        kernel.copy_(torch.randn(8, 8))
    _check(m, 0)
    kernel.data = torch._neg_view(kernel.data)
    assert kernel.is_neg() and kernel.is_contiguous()
    _check(m, 1)  # against jax.vjp on the negated values
