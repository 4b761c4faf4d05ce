"""Parameters cross to JAX as arrays made once and reused: never stale, never a copy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from torchside import FlaxModule


class Square(nn.Module):
    """One square kernel: a transposed view has the same address, shape and dtype."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, use_bias=False)(x) ** 2


def _reference(module: FlaxModule, x: torch.Tensor, cot: torch.Tensor):
    """Output and gradients from jax.vjp on fresh copies of the module's current values."""
    kernel = jnp.asarray(module.get_parameter("params.Dense_0.kernel").detach().numpy().copy())
    xs = jnp.asarray(x.numpy().copy())
    y, vjp = jax.vjp(lambda k, a: Square().apply({"params": {"Dense_0": {"kernel": k}}}, a),
                     kernel, xs)
    gk, gx = vjp(jnp.asarray(cot.numpy()))
    return np.asarray(y), np.asarray(gk), np.asarray(gx)


def _check(module: FlaxModule, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=gen).requires_grad_()
    cot = torch.randn(4, 8, generator=gen)
    kernel = module.get_parameter("params.Dense_0.kernel")
    kernel.grad = None
    y = module(x)
    y.backward(cot)
    ref_y, ref_gk, ref_gx = _reference(module, x.detach(), cot)
    np.testing.assert_allclose(y.detach().numpy(), ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel.grad.numpy(), ref_gk, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), ref_gx, rtol=1e-5, atol=1e-5)


def _module() -> FlaxModule:
    return FlaxModule(Square(), example_args=(torch.zeros(4, 8),))


def _held(module: FlaxModule) -> list:
    (entry,) = module._caller.entries
    return [h for h in entry.held._held if h is not None]


def test_parameter_array_is_made_once_and_shares_memory():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    _check(m, 0)
    (first,) = _held(m)
    assert first[1].unsafe_buffer_pointer() == kernel.data_ptr()  # zero-copy
    _check(m, 1)
    (second,) = _held(m)
    assert second[1] is first[1]  # reused, not made again


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
    (held,) = _held(m)
    assert held[1].unsafe_buffer_pointer() == kernel.data_ptr()


def test_transposed_view_at_the_same_address_is_not_mistaken_for_the_held_array():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    with torch.no_grad():
        kernel.copy_(torch.randn(8, 8))
    _check(m, 0)
    kernel.data = kernel.data.t()  # same data_ptr, shape and dtype; other layout
    assert not kernel.is_contiguous()
    _check(m, 1)


def test_unaligned_parameter_is_never_held_and_never_stale():
    m = _module()
    kernel = m.get_parameter("params.Dense_0.kernel")
    storage = torch.zeros(64 + 1)
    kernel.data = storage[1:].view(8, 8)  # 4 bytes past an aligned address: JAX copies it
    with torch.no_grad():
        kernel.copy_(torch.randn(8, 8))
    assert kernel.data_ptr() % bridge.ALIGNMENT != 0
    _check(m, 0)
    assert _held(m) == []
    with torch.no_grad():
        kernel.mul_(-2.0)
    _check(m, 1)


def test_saved_tensor_hooks_that_copy_get_correct_gradients_and_are_not_held():
    m = _module()
    _check(m, 0)
    (before,) = _held(m)
    copies = []

    def pack(t):
        copies.append(t.clone())
        return copies[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.clone()):
        _check(m, 1)
    (after,) = _held(m)
    assert after[1] is before[1]  # the backward's temporaries were not held


def test_autocast_copies_are_not_held():
    m = FlaxModule(Square(), example_args=(torch.zeros(4, 8),), autocast="inputs")
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1 = m(x)
        y2 = m(x)
    assert y1.dtype == torch.bfloat16
    torch.testing.assert_close(y1, y2)
    assert all(not e.held._held[0] for e in m._caller.entries)


def test_clear_caches_releases_held_arrays():
    m = _module()
    _check(m, 0)
    assert _held(m)
    m.clear_caches()
    assert m._caller.entries == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_held_arrays_for_narrow_float_dtypes(dtype):
    m = _module().to(dtype)
    kernel = m.get_parameter("params.Dense_0.kernel")
    x = torch.randn(4, 8, dtype=dtype)
    y = m(x)
    expected = (x.float() @ kernel.detach().float()) ** 2
    torch.testing.assert_close(y.float(), expected, rtol=5e-2, atol=5e-2)
    with torch.no_grad():
        kernel.mul_(0.5)
    torch.testing.assert_close(m(x).float(), expected * 0.25, rtol=5e-2, atol=5e-2)
