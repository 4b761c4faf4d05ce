"""Ordering between torch's writes and JAX's reads, on every exchange route.

Parameters cross as held arrays made once (NOTE [Exchange] in ``bridge/_exchange.py``):
on CUDA a held array was imported long before torch's latest write to it, so each call
orders JAX after torch's current stream once (the fence), and results order torch after
JAX. Each test runs on three routes: CPU pointer views, the DLPack route forced on CPU
(``FLAXTORCH_EXCHANGE=dlpack``: the CUDA code path, ordering calls included, run by CI),
and CUDA (``gpu`` marker; skipped without a GPU). References are pure JAX on CPU copies
of the current values.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from torchside import FlaxModule


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width)(jnp.tanh(nn.Dense(self.width)(x)))


ROUTES = [
    pytest.param(("cpu", "auto"), id="cpu-views"),
    pytest.param(("cpu", "dlpack"), id="cpu-dlpack"),
    pytest.param(("cuda", "auto"), id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=ROUTES)
def route(request):
    device, mode = request.param
    previous = bridge.set_exchange_mode(mode)
    try:
        yield device
    finally:
        bridge.set_exchange_mode(previous)


def _width(device: str) -> int:
    # On CUDA the programs must run long enough for a missing wait to show.
    return 1024 if device == "cuda" else 16


def _busy(device: str) -> None:
    """Queue slow work on torch's current stream, so that torch's next write lands late."""
    if device == "cuda":
        a = torch.randn(2048, 2048, device=device)
        for _ in range(20):
            a = a @ a / 2048**0.5


def _reference(module: FlaxModule, x: torch.Tensor, ct: torch.Tensor):
    """Output and every gradient by jax.vjp of pure Flax on CPU copies of the current values."""
    names = [n for n, _ in module.named_parameters()]
    values = [jnp.asarray(p.detach().cpu().numpy()) for _, p in module.named_parameters()]
    adapter = module._adapter

    def f(vs, x):
        return module.flax_module.apply(adapter.variables(vs), x)

    y, pull = jax.vjp(f, values, jnp.asarray(x.detach().cpu().numpy()))
    g_params, g_x = pull(jnp.asarray(ct.cpu().numpy()))
    return (np.asarray(y), dict(zip(names, map(np.asarray, g_params), strict=True)),
            np.asarray(g_x))


def _close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    # JAX on CUDA may run float32 matmuls in TF32; on CPU both sides are XLA's CPU kernels.
    tol = 2e-2 if got.device.type == "cuda" else 1e-5
    got = got.detach().cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()),
                               err_msg=what)


def test_optimizer_step_on_torchs_stream_is_seen_by_the_next_forward(route):
    width = _width(route)
    torch.manual_seed(0)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),)).to(route)
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        x = torch.randn(8, width, device=route, requires_grad=True)
        ct = torch.randn(8, width, device=route)
        y = m(x)
        y.backward(ct)
        want_y, want_g, want_gx = _reference(m, x, ct)
        _close(y, want_y, f"output, step {step}")
        _close(x.grad, want_gx, f"x.grad, step {step}")
        for name, p in m.named_parameters():
            _close(p.grad, want_g[name], f"{name}.grad, step {step}")
        _busy(route)
        opt.step()  # in place, on torch's stream, into the memory JAX holds arrays over
        opt.zero_grad()
    held = [s[5] for s in m._caller.held._slots if s[5] is not None]
    assert len(held) == 4  # the arrays were reused, not re-imported per call


def test_a_write_to_an_output_right_after_the_call_is_not_overwritten(route):
    width = _width(route)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),)).to(route)
    x = torch.randn(512, width, device=route)
    with torch.no_grad():
        for _ in range(3):
            y = m(x)
            y.fill_(7.0)  # torch's stream must wait for JAX to finish writing y
            assert bool((y == 7.0).all())


def test_an_input_written_right_after_the_call_was_read_before(route):
    width = _width(route)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),)).to(route)
    x = torch.randn(512, width, device=route)
    want = _reference(m, x, torch.zeros(512, width))[0]
    with torch.no_grad():
        y = m(x)
        x.fill_(1e6)  # JAX must have read x (or torch must wait) before this lands
    _close(y, want, "output after the input was overwritten")


def test_replaced_parameter_memory_is_read_afresh(route):
    width = _width(route)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),)).to(route)
    x = torch.randn(8, width, device=route)
    m(x)
    for p in m.parameters():
        p.data = torch.randn_like(p)  # new memory: the held array must not be reused
    with torch.no_grad():
        y = m(x)
    _close(y, _reference(m, x, torch.zeros(8, width))[0], "output after p.data = ...")


def test_the_dlpack_route_holds_parameters_and_takes_one_fence_per_call():
    previous = bridge.set_exchange_mode("dlpack")
    try:
        m = FlaxModule(MLP(8), example_args=(torch.zeros(2, 8),))
        m(torch.randn(2, 8, requires_grad=True)).sum().backward()
        (call,) = m._caller.calls
        assert call.exchange.dlpack and call.program.fence
        held = {s[5].unsafe_buffer_pointer() for s in m._caller.held._slots}
        assert held == {p.data_ptr() for p in m.parameters()}  # zero-copy, made once
    finally:
        bridge.set_exchange_mode(previous)
