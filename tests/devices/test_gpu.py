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
from tests.support.closeness import close, highest_precision
from tests.support.twins import RematScanStack
from torchside import FlaxModule

pytestmark = pytest.mark.gpu


def test_jax_does_not_preallocate_beside_torch():
    """Catches JAX reserving 75% of the GPU at its first use beside torch's allocator."""
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    free_before, total = torch.cuda.mem_get_info()
    m = FlaxModule(RematScanStack(64, (2, 2)), example_args=(torch.zeros(4, 64),)).cuda()
    m(torch.randn(4, 64, device="cuda"))
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after < 0.25 * total  # JAX's default would take 75%


def test_module_follows_its_device_and_matches_cpu():
    """Catches a module that computes on the wrong device or with stale programs after
    ``.cuda()``: outputs and gradients against the same module on the CPU, both in full
    float32 (no TF32), with a doubled gradient as the negative control."""
    with highest_precision():
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
    for k, (a, b) in enumerate(zip(cpu_grads, gpu_grads, strict=True)):
        close(b, a.numpy(), f"gradient {k}", wrong=[2 * a.numpy()])


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Slow work on torch's stream whose every step changes the values."""
    for _ in range(20):
        x = torch.tanh(x @ w)
    return x


def test_stream_ordering_torch_to_jax_and_back():
    """Catches JAX reading its input before torch's queued writes finished, or torch
    reading JAX's output before JAX wrote it. Each iteration computes new values on a side
    stream through a chain of ops that changes them at every step, calls the module and
    reads its output at once on that stream; the reference is the same computation with
    the device synchronized between steps. An early read sees a partial chain: other
    values (the previous iteration's result is the negative control)."""
    with highest_precision():
        m = FlaxModule(RematScanStack(512, (2, 2)), example_args=(torch.zeros(2048, 512),)).cuda()
        w = torch.randn(512, 512, device="cuda") / 512**0.5
        previous = None
        for step in range(5):
            base = torch.randn(2048, 512, device="cuda",
                               generator=torch.Generator("cuda").manual_seed(step))
            torch.cuda.synchronize()
            want = _chain(base, w)
            torch.cuda.synchronize()
            want = m(want) * 1.0
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                x = _chain(base, w)  # queued: slow, and every step changes x
                y = m(x)
                z = y * 1.0  # torch reads JAX's output at once on its own stream
            side.synchronize()
            close(z, want.detach().cpu().numpy(), f"iteration {step}",
                  wrong=[] if previous is None else [previous])
            previous = want.detach().cpu().numpy()


def test_cuda_round_trip_is_zero_copy():
    """Catches a copy on either crossing: the memory must be the tensor's."""
    t = torch.randn(1024, device="cuda")
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert bridge.to_torch(a).data_ptr() == t.data_ptr()


class _HeldLoss(nn.Module):
    """A scalar loss (the fused route, whose gradient buffers torch takes as ``.grad``) of
    an input kept as a parameter: a call with no tensor argument, so nothing is imported
    per call and only the call's fence orders its program after torch's queued work."""

    @nn.compact
    def __call__(self):
        x = self.param("x", nn.initializers.normal(1.0), (64, 2048))
        return jnp.mean(jnp.tanh(nn.Dense(2048)(x)) ** 2)


def test_dropped_gradients_from_jax_are_not_reused_before_torch_reads_them():
    """The fused route hands JAX's gradient buffers to torch as ``.grad``. Dropping them
    (``zero_grad``) returns their memory to JAX's pool at once, while torch's reads of them
    may still wait on its stream; the next call's program, which may reuse that memory,
    must not write it before they run. The call takes no tensor argument (checked: it
    imports nothing), so only its fence orders the program after all torch queued.
    """
    m = FlaxModule(_HeldLoss()).cuda()
    x = dict(m.named_parameters())["params.x"]
    for step in range(3):
        m().backward()
        grads = [p.grad for p in m.parameters()]
        torch.cuda.synchronize()
        expected = [g.clone() for g in grads]
        with torch.no_grad():
            x.normal_()  # the next gradients differ, so a write over these would show
        # Finished before the wait below: the next call reads the new input, fenced or not.
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # keeps torch's stream busy: the reads below wait
        late = [g * 1 for g in grads]
        del grads
        m.zero_grad()  # the last references: JAX may hand the memory out again
        with bridge.internal.record_ordering() as log:
            loss = m()  # allocates as much again; no import orders it, only the fence
        assert not [e for e in log if e.kind == "import"], step
        loss.backward()
        torch.cuda.synchronize()
        for k, (got, want, new) in enumerate(
                zip(late, expected, (p.grad for p in m.parameters()), strict=True)):
            assert not torch.equal(new, want), (step, k)  # an early write would change got
            assert torch.equal(got, want), (step, k)
        m.zero_grad()


def test_a_gradient_penalty_on_cuda_equals_the_cpu():
    """Catches derived calls (NOTE [Higher order]) that compute on the wrong device, read
    a cotangent before torch wrote it, or drop the second derivative: a WGAN-GP step on
    CUDA against the same module on the CPU, in full float32; zero, what a dropped second
    derivative gives the parameters, is the negative control."""
    def step(m, x):
        m.zero_grad()
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(m(xi).sum(), xi, create_graph=True)
        ((gx.norm(dim=1) - 1) ** 2).mean().backward()
        return [p.grad.detach().cpu().clone() for p in m.parameters()]

    with highest_precision():
        m = FlaxModule(RematScanStack(64, (2, 2)), example_args=(torch.zeros(32, 64),))
        x = torch.randn(32, 64)
        on_cpu = step(m, x)
        m.cuda()
        on_cuda = step(m, x.cuda())
    for k, (got, want) in enumerate(zip(on_cuda, on_cpu, strict=True)):
        close(got.cuda(), want.numpy(), f"parameter {k}", wrong=[0 * want.numpy()])
