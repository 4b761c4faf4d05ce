"""Ordering between torch's writes and JAX's reads, on every exchange route, by values.

Parameters cross as held arrays made once (NOTE [Exchange] in ``bridge/_exchange.py``):
on CUDA a held array was imported long before torch's latest write to it, so each call
orders JAX after torch's current stream once (the fence), and results order torch after
JAX. Each test runs on three routes: CPU pointer views, the DLPack route forced on CPU
(``FLAXTORCH_EXCHANGE=dlpack``: the CUDA code path, ordering calls included, run by CI),
and CUDA (``gpu`` marker; skipped without a GPU). References are pure JAX on CPU copies
of the current values; each comparison also checks that the wrong answer the bug would
give (a stale parameter, an overwritten input, a skipped accumulation) fails it.
``test_fences.py`` checks the recorded steps of the DLPack route. On the CPU these
comparisons cannot fail for a missing or reused fence (torch's writes finish before JAX
runs): they check the values every route computes, and the recorded steps there are
what fails on the CPU for a fence's bugs.

On CUDA each test names the race it catches. A tensor argument is imported by DLPack per
call, which by itself orders JAX's reads of it after torch's stream, so the test of the
fence calls a module with no tensor argument (its input is a parameter, held like the
others); the other tests check memory that JAX writes or reads and torch touches next
(outputs, inputs, gradients), which the export of the results orders.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from torch.utils._python_dispatch import TorchDispatchMode

import bridge
from tests.support import pipeline
from tests.support.closeness import close, route_fixture
from torchside import FlaxModule


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width)(jnp.tanh(nn.Dense(self.width)(x)))


_route = route_fixture()


def _width(device: str) -> int:
    # On CUDA the programs must run long enough for a missing wait to show.
    return 1024 if device == "cuda" else 16


def _busy(device: str) -> None:
    """Queue slow work on torch's current stream, so that torch's next write lands late."""
    if device == "cuda":
        a = torch.randn(2048, 2048, device=device)
        for _ in range(20):
            a = a @ a / 2048**0.5


def _reference(module: FlaxModule, x: torch.Tensor | None, ct: torch.Tensor, params=None):
    """Output and every gradient by jax.vjp of pure Flax on the CPU, from copies of the
    current values (or of ``params``, name -> tensor). ``x=None``: a call with no argument
    (the gradient of ``x`` is then ``None``)."""
    named = dict(module.named_parameters()) if params is None else params
    names = [n for n, _ in module.named_parameters()]
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        values = [jnp.asarray(named[n].detach().cpu().numpy()) for n in names]
        args = () if x is None else (jnp.asarray(x.detach().cpu().numpy()),)

        def f(vs, *args):
            # Flax's variables rebuilt from torch's dotted names, not by the bridge's order.
            variables = traverse_util.unflatten_dict(dict(zip(names, vs, strict=True)), sep=".")
            return module.flax_module.apply(variables, *args)

        y, pull = jax.vjp(f, values, *args)
        g_params, *g_x = pull(jnp.asarray(ct.float().cpu().numpy()))
    return (np.asarray(y), dict(zip(names, map(np.asarray, g_params), strict=True)),
            np.asarray(g_x[0]) if g_x else None)


class HeldInput(nn.Module):
    """The MLP on an input it keeps as a parameter: a call with no tensor argument, so every
    array it reads is held and nothing is imported per call (NOTE [Exchange])."""

    width: int

    @nn.compact
    def __call__(self):
        x = self.param("x", nn.initializers.normal(1.0), (8, self.width))
        return MLP(self.width)(x)


def test_optimizer_step_on_torchs_stream_is_seen_by_the_next_forward(route):
    """Catches a call that reads a parameter before the optimizer's queued step wrote it.

    The call takes no tensor argument (its input is a parameter too), so every array it
    reads is held, imported once and never per call (checked: the call imports nothing).
    On CUDA the step is queued behind slow work on torch's stream, and only the call's
    fence orders JAX's reads after it. A stale read gives the previous step's values: the
    negative control.
    """
    width = _width(route)
    torch.manual_seed(0)
    m = FlaxModule(HeldInput(width)).to(route)
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    before = None
    for step in range(3):
        with bridge.internal.record_ordering() as log:
            y = m()  # right after the queued step: nothing but the fence orders the reads
        # No per-call import that would order JAX after torch's stream in the fence's place.
        imports = [e for e in log if e.kind == "import"]
        assert not imports, (step, imports)
        ct = torch.randn(8, width, device=route)
        y.backward(ct)
        want_y, want_g, _ = _reference(m, None, ct)
        stale = [] if before is None else [_reference(m, None, ct, before)[0]]
        close(y, want_y, f"output, step {step}", wrong=stale)
        for name, p in m.named_parameters():
            close(p.grad, want_g[name], f"{name}.grad, step {step}")
        if step == 0:
            held = pipeline.held_arrays(m)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        _busy(route)
        opt.step()  # in place, on torch's stream, into the memory JAX holds arrays over
        opt.zero_grad()
    # The same held arrays in every call, the input's included: reused, never imported again.
    now = pipeline.held_arrays(m)
    assert len(now) == 5 and all(a is b for a, b in zip(held, now, strict=True))


def test_a_write_to_an_output_right_after_the_call_is_not_overwritten(route):
    """Catches results handed to torch before JAX wrote them: JAX's late write would land
    after torch's fill. No import orders this: only the results' export to torch's stream."""
    width = _width(route)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),)).to(route)
    x = torch.randn(512, width, device=route)
    with torch.no_grad():
        for _ in range(3):
            y = m(x)
            y.fill_(7.0)  # torch's stream must wait for JAX to finish writing y
            assert bool((y == 7.0).all())


def test_an_input_written_right_after_the_call_was_read_before(route):
    """Catches a call that returns before JAX read its input: torch's next write to the
    input would be read instead (the negative control is the output of the written input)."""
    width = _width(route)
    m = FlaxModule(MLP(width), example_args=(torch.zeros(8, width),)).to(route)
    x = torch.randn(512, width, device=route)
    want = _reference(m, x, torch.zeros(512, width))[0]
    late = _reference(m, torch.full_like(x, 1e6), torch.zeros(512, width))[0]
    with torch.no_grad():
        y = m(x)
        x.fill_(1e6)  # JAX must have read x (or torch must wait) before this lands
    close(y, want, "output after the input was overwritten", wrong=[late])


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
    Catches that, and on CUDA a gradient handed to torch's accumulation before JAX wrote
    it; the gradient alone, as if nothing was accumulated, is the negative control.
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
    close(y, want_y, "output")
    for name, p in m.named_parameters():
        # Negative control: the gradient alone, as if torch never accumulated into .grad.
        close(p.grad, want_g[name] + 0.25, f"{name}.grad", wrong=[want_g[name]])


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
    by ops; on CPU they are made while the program runs unless a mode is watching. Catches
    a view read early: its sum then differs from the sum read after the step.
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
    old = _reference(m, x, torch.zeros(8, width))[0]
    for p in m.parameters():
        p.data = torch.randn_like(p)  # new memory: the held array must not be reused
    with torch.no_grad():
        y = m(x)
    close(y, _reference(m, x, torch.zeros(8, width))[0], "output after p.data = ...",
          wrong=[old])
