"""CUDA: device following, DLPack stream ordering both ways, no JAX preallocation.

Every test here carries the ``gpu`` marker and is skipped without a CUDA GPU that both
torch and JAX see (conftest.py). ``examples/gpu_check.py`` runs them with a summary.
"""

import os

import flax.linen as nn
import jax.numpy as jnp
import pytest
import torch

import bridge
from tests.support.twins import RematScanStack
from torchside import FlaxModule

pytestmark = pytest.mark.gpu


def test_jax_does_not_preallocate_beside_torch():
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    free_before, total = torch.cuda.mem_get_info()
    m = FlaxModule(RematScanStack(64, (2, 2)), example_args=(torch.zeros(4, 64),)).cuda()
    m(torch.randn(4, 64, device="cuda"))
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after < 0.25 * total  # JAX's default would take 75%


def test_module_follows_its_device_and_matches_cpu():
    x = torch.randn(8, 32)
    m = FlaxModule(RematScanStack(32, (2, 4)), example_args=(x,))
    ct = torch.randn(8, 32)
    xc = x.clone().requires_grad_()
    (m(xc) * ct).sum().backward()
    cpu_grads = [xc.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.cuda()
    assert all(p.device.type == "cuda" for p in m.parameters())
    xg = x.cuda().requires_grad_()
    y = m(xg)
    assert y.device == xg.device
    (y * ct.cuda()).sum().backward()
    gpu_grads = [xg.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(cpu_grads, gpu_grads, strict=True):
        # GPU float32 matmuls may run in TF32 (JAX's default there): atol scales with max|CPU|.
        scale = max(1.0, a.abs().max().item())
        torch.testing.assert_close(b.cpu(), a, rtol=1e-3, atol=1e-2 * scale)


def test_stream_ordering_torch_to_jax_and_back():
    """torch writes on its stream right before the call; JAX must see the finished values."""
    m = FlaxModule(RematScanStack(512, (2, 2)), example_args=(torch.zeros(2048, 512),)).cuda()
    base = torch.randn(2048, 512, device="cuda")
    expected = m(base.clone())
    torch.cuda.synchronize()
    for _ in range(5):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = base.clone()
            for _ in range(20):  # keep torch's stream busy so a missing wait shows
                x = (x @ torch.eye(512, device="cuda")).contiguous()
            y = m(x)
            z = y * 1.0  # torch reads JAX's output at once on its own stream
        side.synchronize()
        torch.testing.assert_close(z, expected, rtol=1e-4, atol=1e-4)


def test_cuda_round_trip_is_zero_copy():
    t = torch.randn(1024, device="cuda")
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert bridge.to_torch(a).data_ptr() == t.data_ptr()


class _Loss(nn.Module):
    """A scalar output: the fused route, whose gradients torch takes as ``.grad``."""

    @nn.compact
    def __call__(self, x):
        return jnp.mean(jnp.tanh(nn.Dense(2048)(x)) ** 2)


def test_dropped_gradients_from_jax_are_not_reused_before_torch_reads_them():
    """The fused route hands JAX's gradient buffers to torch as ``.grad``. Dropping them
    (``zero_grad``) returns their memory to JAX's pool at once, while torch's reads of them
    may still wait on its stream; the next call's program, which may reuse that memory,
    must not write it before they run: the call's fence orders it after all torch queued.
    """
    m = FlaxModule(_Loss(), example_args=(torch.zeros(64, 2048),)).cuda()
    for _ in range(3):
        m(torch.randn(64, 2048, device="cuda")).backward()
        grads = [p.grad for p in m.parameters()]
        torch.cuda.synchronize()
        expected = [g.clone() for g in grads]
        torch.cuda._sleep(200_000_000)  # keeps torch's stream busy: the reads below wait
        late = [g * 1 for g in grads]
        del grads
        m.zero_grad()  # the last references: JAX may hand the memory out again
        m(torch.randn(64, 2048, device="cuda")).backward()  # allocates as much again
        torch.cuda.synchronize()
        for got, want in zip(late, expected, strict=True):
            assert torch.equal(got, want)
        m.zero_grad()
