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
from torch.utils._python_dispatch import TorchDispatchMode

import bridge
from tests.support import pipeline
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


def _in_mode(request):
    """Runs the test in the route's exchange mode; yields its torch device."""
    device, mode = request.param
    previous = bridge.set_exchange_mode(mode)
    try:
        yield device
    finally:
        bridge.set_exchange_mode(previous)


route = pytest.fixture(params=ROUTES, name="route")(_in_mode)


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
    def f(vs, x):
        return module.flax_module.apply(pipeline.variables_from(module, vs), x)

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
    assert len(pipeline.held_arrays(m)) == 4  # the arrays were reused, not re-imported per call


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


class Deep(nn.Module):
    """Programs that take milliseconds on a CPU: long enough for an early read to see it.

    Narrow widths keep the parameters small, so their gradients leave packed, as views.
    """

    width: int
    scalar: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        for _ in range(6):
            x = jnp.tanh(nn.Dense(self.width)(x))
        return jnp.mean(x**2) if self.scalar else x.astype(self.dtype)


@pytest.mark.parametrize("scalar", [False, True], ids=["residuals", "scalar-loss"])
def test_saved_tensor_hooks_and_the_gradients_read_finished_results(route, scalar):
    """A pack hook that reads what is saved, and the gradients torch accumulates, are final.

    On CPU the bridge makes autograd's records while the program runs and waits before it
    returns from forward and from backward (NOTE [Exchange]): a wait after torch's pack
    hooks, or after the backward returned, would hand them memory JAX is still writing.
    """
    width = 1024 if route == "cuda" else 512
    torch.manual_seed(0)
    m = FlaxModule(Deep(width, scalar), example_args=(torch.zeros(8, width),)).to(route)
    x = torch.randn(256, width, device=route)
    ct = torch.randn(() if scalar else (256, width), device=route)
    packed = []

    def pack(t):
        packed.append(t.clone())  # reads the values now, as save_on_cpu does
        return packed[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    for p in m.parameters():  # torch then reads each gradient inside the backward
        p.grad = torch.full_like(p, 0.25)
    y.backward(ct)
    assert packed
    want_y, want_g, _ = _reference(m, x, ct)
    _close(y, want_y, "output")
    for name, p in m.named_parameters():
        _close(p.grad, want_g[name] + 0.25, f"{name}.grad")


class _ReadEveryView(TorchDispatchMode):
    """Reads each view an op returns when it returns it, as NaN checkers and hashes do."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and func in (
                torch.ops.aten.view.default, torch.ops.aten.view.dtype,
                torch.ops.aten.narrow.default, torch.ops.aten.slice.Tensor):
            self.seen.append((out, out.float().sum().item()))
        return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_a_dispatch_mode_sees_finished_results_and_gradients(route, dtype):
    """A ``TorchDispatchMode`` sees each result and gradient view only once JAX wrote it.

    A bfloat16 result is viewed as bfloat16 by an op, and packed gradients are views made
    by ops; on CPU they are made while the program runs unless a mode is watching.
    """
    torch.manual_seed(0)
    m = FlaxModule(Deep(64, dtype=dtype), example_args=(torch.zeros(2, 64),)).to(route)
    x = torch.randn(20000, 64, device=route)
    ct = torch.randn(20000, 64, device=route, dtype=bridge.torch_dtype(jnp.dtype(dtype)))
    m(x).backward(ct)  # compiled outside the mode
    for _ in range(2):
        m.zero_grad()
        with _ReadEveryView() as mode:
            y = m(x)
            y.backward(ct)
        assert mode.seen
        for t, early in mode.seen:
            assert early == t.float().sum().item(), (tuple(t.shape), t.dtype)


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


# -- the recorded ordering steps of the DLPack route (the CUDA code path) ------------------
DLPACK_ROUTES = [
    pytest.param(("cpu", "dlpack"), id="cpu-dlpack"),
    pytest.param(("cuda", "auto"), id="cuda", marks=pytest.mark.gpu),
]


dlpack_route = pytest.fixture(params=DLPACK_ROUTES, name="dlpack_route")(_in_mode)


def _steps(log) -> list[str]:
    """The log as kinds: ``torch->jax``, ``run:<program>``, ``jax->torch``, test markers."""
    out = []
    for e in log:
        if isinstance(e, bridge.internal.OrderingEvent):
            out.append(f"run:{e.detail}" if e.kind == "run" else e.kind)
        else:
            out.append(e)
    return out


def _handed_back(event, tensor) -> bool:
    """Whether ``tensor``'s memory is among what a ``jax->torch`` step handed to torch."""
    return any(start <= tensor.data_ptr() < start + size for start, size in event.detail)


def _stream(device: str):
    return torch.cuda.current_stream().cuda_stream if device == "cuda" else None


FENCED = ["torch->jax", "run", "jax->torch"]


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_each_run_is_fenced_once_after_torchs_writes_and_handed_back_before_torch_reads(
        dlpack_route, residuals):
    device = dlpack_route
    width = _width(device)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),),
                   residuals=residuals).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, width, device=device, requires_grad=True)
    ct = torch.randn(8, width, device=device)
    m(x).backward(ct)  # compiled outside the log: the log shows the steady state
    opt.zero_grad()
    x.grad = None  # torch then takes the handed-back gradient itself, as for parameters
    forward = "forward" if residuals == "recompute" else "forward_with_residuals"
    backward = "backward_recompute" if residuals == "recompute" else "backward"
    with bridge.internal.record_ordering() as log:
        y = m(x)
        log.append("test: backward")
        y.backward(ct)
        log.append("test: optimizer step")
        opt.step()  # in place, on torch's stream, into memory JAX holds arrays over
        with torch.no_grad():
            y2 = m(x)
        log.append("test: write to the output")
        y2.fill_(7.0)
    assert _steps(log) == [
        "torch->jax", f"run:{forward}", "jax->torch", "test: backward",
        "torch->jax", f"run:{backward}", "jax->torch", "test: optimizer step",
        "torch->jax", "run:forward", "jax->torch", "test: write to the output",
    ]
    events = [e for e in log if isinstance(e, bridge.internal.OrderingEvent)]
    assert all(e.device == torch.device(device) if device == "cpu" else e.device.type == device
               for e in events)
    assert all(e.stream == _stream(device) for e in events)
    # What torch reads or writes next was handed to its stream first: the outputs, the
    # input gradient and every parameter gradient (views into packed buffers included).
    assert _handed_back(events[2], y) and _handed_back(events[8], y2)
    for t in [x.grad, *(p.grad for p in m.parameters())]:
        assert _handed_back(events[5], t)
    with torch.no_grad():
        want = _reference(m, x, ct)[0]
    _close(m(x), want, "output after the optimizer step")  # it read the step's values


def test_the_order_follows_torchs_current_stream(dlpack_route):
    """Each step names the stream that is current at the call: a side stream on CUDA."""
    device = dlpack_route
    m = FlaxModule(MLP(8), example_args=(torch.zeros(2, 8),)).to(device)
    x = torch.randn(2, 8, device=device)
    side = torch.cuda.Stream() if device == "cuda" else None
    with bridge.internal.record_ordering() as log, torch.no_grad():
        if side is None:
            y = m(x)
        else:
            with torch.cuda.stream(side):
                y = m(x)
    assert _steps(log) == ["torch->jax", "run:forward", "jax->torch"]
    want = None if side is None else side.cuda_stream
    assert [e.stream for e in log] == [want] * 3
    assert _handed_back(log[2], y)


def test_compiled_graph_runs_are_fenced_like_eager_ones(dlpack_route):
    device = dlpack_route
    m = FlaxModule(MLP(8), example_args=(torch.zeros(2, 8),)).to(device)
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(2, 8, device=device, requires_grad=True)
    ct = torch.randn(2, 8, device=device)
    compiled(x).backward(ct)  # tracing and compiling, outside the log
    with bridge.internal.record_ordering() as log:
        y = compiled(x)
        log.append("test: backward")
        y.backward(ct)
    assert _steps(log) == ["torch->jax", "run:forward_with_residuals", "jax->torch",
                           "test: backward",
                           "torch->jax", "run:backward", "jax->torch"]


def test_the_dlpack_route_holds_parameters_zero_copy():
    previous = bridge.set_exchange_mode("dlpack")
    try:
        m = FlaxModule(MLP(8), example_args=(torch.zeros(2, 8),))
        m(torch.randn(2, 8, requires_grad=True)).sum().backward()
        assert pipeline.crosses_by_dlpack(m) == [True] and pipeline.only_program(m).fence
        held = {a.unsafe_buffer_pointer() for a in pipeline.held_arrays(m)}
        assert held == {p.data_ptr() for p in m.parameters()}  # zero-copy, made once
    finally:
        bridge.set_exchange_mode(previous)
