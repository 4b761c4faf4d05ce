"""The DLPack route's ordering steps, recorded from the exports that make them.

On the DLPack route (CUDA, or the CPU with ``FLAXTORCH_EXCHANGE=dlpack``, which makes the
same calls) each program run imports one fence tensor from torch's current stream, runs,
and exports its results to torch's stream (NOTE [Exchange] in ``bridge/_exchange.py``).
Every call makes those exports through the same observed wrappers, log or no log;
``bridge.internal.record_ordering`` only collects what they record, from inside the
``__dlpack__`` call that makes each step, with the stream the consumer passed. So a fence
imported once and reused, or an import without a stream, is missing from the log of an
ordinary call. Each test runs on the forced route on the CPU and, with the ``gpu`` marker,
on CUDA.
"""

import contextlib
import re
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from bridge import _exchange as bridge_exchange
from tests.support import pipeline
from tests.support.closeness import ALL_ROUTES, close, route_fixture
from torchside import FlaxModule

_route = route_fixture(ALL_ROUTES[1:])  # the DLPack routes: fences exist there


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width)(jnp.tanh(nn.Dense(self.width)(x)))


def _events(log) -> list:
    return [e for e in log if isinstance(e, bridge.internal.OrderingEvent)]


def _steps(log) -> list[str]:
    """The log as ``torch->jax``, ``run:<program>``, ``jax->torch`` and test markers;
    per-call imports of arguments and cotangents are left out."""
    out = []
    for e in log:
        if not isinstance(e, bridge.internal.OrderingEvent):
            out.append(e)
        elif e.kind == "run":
            out.append(f"run:{e.detail}")
        elif e.kind != "import":
            out.append(e.kind)
    return out


def _fenced_right_before_each_run(log) -> bool:
    """Whether the step before every run is its fence: after every import of that call."""
    events = _events(log)
    return all(k > 0 and events[k - 1].kind == "torch->jax"
               for k, e in enumerate(events) if e.kind == "run")


def _handed_back(event, tensor) -> bool:
    """Whether ``tensor``'s memory is among what a ``jax->torch`` step handed to torch."""
    return any(start <= tensor.data_ptr() < start + size for start, size in event.detail)


def _stream(device: str):
    """torch's current stream as DLPack's ``stream=`` names it: 1 for the legacy default
    stream (handle 0), which is what ``torch.from_dlpack`` passes (torch/utils/dlpack.py)."""
    if device != "cuda":
        return None
    handle = torch.cuda.current_stream().cuda_stream
    return 1 if handle == 0 else handle


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_each_run_is_fenced_once_after_torchs_writes_and_handed_back_before_torch_reads(
        route, residuals):
    """Catches a run without its own fence, a parameter imported again per call, an export
    on another stream than torch's, and a result torch touches before it was handed back.

    Mutation: the fence imported once and reused by every later run (``run`` in
    ``bridge/_exchange.py``): no ``torch->jax`` step before the later runs. On the CPU only
    these recorded steps can show it: torch's CPU writes finish before JAX runs, so the
    values ``test_ordering.py`` compares come out right without any fence."""
    device = route
    m = FlaxModule(MLP(16), example_args=(torch.zeros(8, 16),), residuals=residuals).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    ct = torch.randn(8, 16, device=device)
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
    assert _fenced_right_before_each_run(log)
    events = [e for e in _events(log) if e.kind != "import"]
    assert all(e.device.type == device for e in events)
    # Parameters are held arrays: no call imports their memory again.
    params = {p.data_ptr() for p in m.parameters()}
    assert not [e for e in _events(log) if e.kind == "import" and e.detail[1] in params]
    # Nor what the forward handed to torch for the backward (its residuals): the backward
    # runs on the forward's own arrays (an import costs about 70 us on a GPU).
    assert not _imported_again(log, events[2])
    # torch's stream is what each export named: torch's for the fence, the one torch
    # passed to JAX for the results; JAX passed a stream of its own for the fence on CUDA.
    for e in events:
        if e.kind != "run":
            assert e.stream == _stream(device), e
        if e.kind == "torch->jax":
            assert (e.detail[0] is not None) == (device == "cuda"), e
    # What torch reads or writes next was handed to its stream first: the outputs, the
    # input gradient and every parameter gradient (views into packed buffers included).
    assert _handed_back(events[2], y) and _handed_back(events[8], y2)
    for t in [x.grad, *(p.grad for p in m.parameters())]:
        assert _handed_back(events[5], t)


def test_the_order_follows_torchs_current_stream(route):
    """Each step names the stream current at the call: a side stream on CUDA, as passed to
    the exports, not read by the recorder alone."""
    device = route
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
    assert [e.stream for e in _events(log) if e.kind != "run"] == [want] * 3  # x, fence, out
    assert _handed_back(_events(log)[-1], y)


def test_compiled_graph_runs_are_fenced_like_eager_ones(route):
    """Catches a ``torch.compile`` op that runs a program without its fence."""
    device = route
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
    assert _fenced_right_before_each_run(log)
    handed = [e for e in _events(log) if e.kind == "jax->torch"][0]
    assert not _imported_again(log, handed)  # the backward op reuses the residuals


def _imported_again(log, handed) -> list:
    """The imports in ``log`` of memory that the ``jax->torch`` step ``handed`` gave torch."""
    ranges = [(s, s + n) for s, n in handed.detail]
    return [e for e in _events(log)
            if e.kind == "import" and any(a <= e.detail[1] < b for a, b in ranges)]


def test_a_compiled_first_call_fences_with_a_real_tensor(route):
    """Catches a fence made while Dynamo traces the first call of a device's exchange:
    the op's fake implementation runs under fake mode, where a new tensor is fake, and a
    fake fence has no memory to export when the compiled graph runs."""
    device = route
    bridge_exchange._exchange.cache_clear()  # this device's exchange is made anew below
    m = FlaxModule(MLP(8), example_args=(torch.zeros(2, 8),)).to(device)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        y = torch.compile(m, fullgraph=True)(x)  # the first call anything makes
        close(y, m(x), "compiled against eager")


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


class TanhOut(nn.Module):
    """An output its backward reads (tanh's derivative is 1 - y**2): saved as an output."""

    width: int

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(self.width)(jnp.tanh(nn.Dense(self.width)(x))))


def _recording(monkeypatch) -> list:
    """Per program run on the DLPack route, its name and weak references to its arrays."""
    made = []
    run = bridge_exchange.DlpackExchange.run

    def recorded(self, name, program, *args):
        arrays, tensors = run(self, name, program, *args)
        made.append((name, [weakref.ref(a) for a in arrays]))
        return arrays, tensors

    monkeypatch.setattr(bridge_exchange.DlpackExchange, "run", recorded)
    return made


def _alive(refs) -> int:
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("block", [MLP, TanhOut])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "saved-tensor-hook"])
def test_the_forwards_arrays_live_until_the_backward_unless_a_hook_moves_them(
        route, hooked, compiled, block, monkeypatch):
    """On the DLPack route the backward reuses the forward's arrays (above), which torch's
    memory over them owns (``own_arrays``): alive until the backward frees what it saved,
    never beyond it (the user's loss outlives the step), and gone at once where a
    saved-tensor hook saved something else (it may move a tensor off the device to free
    it)."""
    device = route
    made = _recording(monkeypatch)
    m = FlaxModule(block(16), example_args=(torch.zeros(8, 16),), residuals="save").to(device)
    call = torch.compile(m, fullgraph=True) if compiled else m
    x = torch.randn(8, 16, device=device)
    call(x).sum().backward()  # compiled and traced before anything is recorded
    made.clear()
    with jax.default_device(jax.devices("cpu")[0]):  # the reference on the CPU (no TF32)
        values = [jnp.asarray(p.detach().cpu().numpy()) for p in m.parameters()]
        ref = block(16).apply(pipeline.variables_from(m, values),
                              jnp.asarray(x.cpu().numpy()))
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
             if hooked else contextlib.nullcontext())
    with hooks:
        y = call(x)
    forward = [r for name, refs in made if name == "forward_with_residuals"
               for r in refs]
    # Alive before the backward, but the output's (whose memory the user holds).
    live = sum(r() is not None and r().unsafe_buffer_pointer() != y.data_ptr()
               for r in forward)
    y.sum().backward()
    close(y, ref, "the output")
    assert [name for name, _ in made] == ["forward_with_residuals", "backward"]
    # What outlives the backward is the output's array only (the user holds ``y``,
    # whose memory it is: a saved output's, or the output a hook never saw).
    left = [r() for r in forward if r() is not None]
    assert all(a.unsafe_buffer_pointer() == y.data_ptr() for a in left), (
        "the forward's arrays outlived its backward")
    if hooked:  # the clones are what torch saved: the originals' memory must go
        assert live == 0
    else:  # the positive control: torch's saved residuals hold them until the backward
        assert live > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_graph_dropped_without_its_backward_lets_its_arrays_go(
        route, compiled, monkeypatch):
    """An evaluation with gradients on drops each graph unrun: its arrays go with it."""
    device = route
    made = _recording(monkeypatch)
    m = FlaxModule(MLP(16), example_args=(torch.zeros(8, 16),), residuals="save").to(device)
    call = torch.compile(m, fullgraph=True) if compiled else m
    x = torch.randn(8, 16, device=device)
    call(x).sum().backward()
    made.clear()
    y = call(x)
    (name, first), = made
    assert name == "forward_with_residuals" and _alive(first)  # the graph may run
    del y
    assert not _alive(first), "a dropped graph's arrays outlived it"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpointed_blocks_hold_no_arrays_between_forward_and_backward(
        route, compiled, monkeypatch):
    """``torch.utils.checkpoint`` (non-reentrant) keeps no block's residuals: nor may the
    arrays under them stay, eager or inside a compiled graph (where no saved-tensor hook
    is active when the op runs). Gradients equal the same blocks unchecked."""
    from torch.utils.checkpoint import checkpoint

    device = route
    made = _recording(monkeypatch)
    blocks = [FlaxModule(MLP(16), example_args=(torch.zeros(8, 16),),
                         residuals="save").to(device) for _ in range(3)]

    def net(x, checked):
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False) if checked else b(x)
        return x

    run = torch.compile(net, fullgraph=True) if compiled else net
    x = torch.randn(8, 16, device=device, requires_grad=True)
    ct = torch.randn(8, 16, device=device)
    grads = []
    for checked in (False, True):
        run(x, checked).backward(ct)  # compiled and traced first
        for t in [x, *(p for b in blocks for p in b.parameters())]:
            t.grad = None
        made.clear()
        y = run(x, checked)
        forwards = [refs for name, refs in made if name == "forward_with_residuals"]
        assert len(forwards) == len(blocks)
        live = [_alive(refs) for refs in forwards]
        y.backward(ct)
        grads.append([t.grad.clone() for t in
                      [x, *(p for b in blocks for p in b.parameters())]])
        if checked:
            assert live == [0] * len(blocks), live
        else:  # the positive control: unchecked, each block holds its residuals
            assert all(live), live
    for k, (a, b) in enumerate(zip(*grads, strict=True)):
        close(a, b, f"gradient {k} checkpointed against unchecked")


# -- a call that only its fence can order ---------------------------------------------------
class NoArguments(nn.Module):
    """A call with no tensor argument: its one parameter is a held array, so nothing is
    imported per call and no import can stand in for the fence."""

    width: int

    @nn.compact
    def __call__(self):
        w = self.param("w", nn.initializers.normal(1.0), (self.width, self.width))
        return jnp.tanh(w) @ w


def _no_arguments_reference(w: torch.Tensor) -> np.ndarray:
    with jax.default_device(jax.devices("cpu")[0]):
        v = jnp.asarray(w.detach().cpu().numpy())
        return np.asarray(jnp.tanh(v) @ v)


def test_a_call_with_no_tensor_argument_is_ordered_by_its_fence_alone(route):
    """Catches a fence imported once and reused, a fence dropped from the program, or one
    imported without a stream: the parameter is written in place on torch's stream (on
    CUDA behind ``torch.cuda._sleep``, so the write lands late), then the module is called
    with no argument, so the fence is the only thing that orders JAX's read after the
    write. A read before the write gives the previous value: the negative control.
    """
    device = route
    width = 1024 if device == "cuda" else 8
    m = FlaxModule(NoArguments(width)).to(device)
    with torch.no_grad():
        m()  # compiled, parameter held
    (w,) = m.parameters()
    for step in range(3):
        old = _no_arguments_reference(w)
        new = torch.randn(width, width, generator=torch.Generator().manual_seed(step))
        new = new.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # torch's stream busy: the write below waits
        with torch.no_grad():
            w.copy_(new)
            y = m()  # no log open: the ordinary call
        close(y, _no_arguments_reference(new), f"output after write {step}", wrong=[old])
        # The same call with a log open: one fence, imported for this run from torch's
        # stream, and nothing else imported.
        with bridge.internal.record_ordering() as log, torch.no_grad():
            m()
        assert [(e.kind, e.detail if e.kind == "run" else None) for e in _events(log)] == [
            ("torch->jax", None), ("run", "forward"), ("jax->torch", None)], step
        assert (_events(log)[0].detail[0] is not None) == (device == "cuda")
    # The executable takes the fence as a parameter: it survived lowering.
    ((_, kind, compiled),) = pipeline.executables_run(m)
    assert kind == "forward"
    entry = compiled.as_text()[compiled.as_text().index("ENTRY"):]
    names = re.findall(r'parameter\(\d+\).*?op_name="([^"]+)"', entry)
    assert sorted(names) == ["fence[0]", "leaves[0]"], names
