"""A cached call runs in seven library files (NOTE [Call path] in ``torchside/call/_call.py``).

A cached eager forward and backward of a ``FlaxModule`` is profiled (cProfile) and the
library files whose code ran are compared with the seven that NOTE names; the DLPack route
(CUDA's, forced on the CPU) adds its own file. A count of files, not a time: it fails on
the first per-call step that lands in another file (a per-call closure in ``flaxside``, a
helper in a cold module), on any machine.
"""

import cProfile
import pstats
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

import bridge
from torchside import FlaxModule

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("bridge", "flaxside", "torchside")
HOT = {"torchside/owners/_module.py", "torchside/call/_resolve.py", "torchside/call/_call.py",
       "torchside/call/_eager.py", "torchside/call/_entry.py",
       "bridge/_exchange.py", "bridge/_held.py"}
# Without gradients a call makes no autograd node: the eager edge's file does not run.
NO_GRAD = HOT - {"torchside/call/_eager.py"}


class MLP(nn.Module):
    loss: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(16)(jnp.tanh(nn.Dense(16)(x)))
        return jnp.mean(y**2) if self.loss else y


class Dropped(nn.Module):
    """A Linen call with an RNG stream: a key drawn per call."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(16)(x))))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


# Per kind of call, the module and the files it adds to HOT (NOTE [Call path]): an NNX
# call hashes its signature's module graph (``Graph.__hash__``, compared by value).
KINDS = {
    "linen-rng": (lambda: FlaxModule(Dropped(), example_args=(torch.zeros(4, 8),),
                                     rngs=("dropout",)), set()),
    "nnx": (lambda: FlaxModule(NnxMLP(nnx.Rngs(0))), {"flaxside/adapters/_nnx.py"}),
}


def _files_run(step) -> set[str]:
    for _ in range(3):  # compile and settle
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        step()
    profile.disable()
    files = set()
    for filename, _, _ in pstats.Stats(profile).stats:
        path = Path(filename)
        if (path.is_absolute() and path.is_relative_to(ROOT)
                and path.relative_to(ROOT).parts[0] in LIBRARY):
            files.add(path.relative_to(ROOT).as_posix())
    return files


@pytest.mark.parametrize("residuals", ["save", "split", "recompute"])
@pytest.mark.parametrize("loss", [False, True], ids=["output", "loss-inside"])
@pytest.mark.parametrize("mode", ["auto", "dlpack"])
def test_a_cached_forward_and_backward_runs_in_the_seven_files(residuals, loss, mode):
    previous = bridge.set_exchange_mode(mode)
    try:
        m = FlaxModule(MLP(loss), example_args=(torch.zeros(4, 8),), residuals=residuals)
        x = torch.randn(4, 8, requires_grad=True)
        ct = torch.randn(() if loss else (4, 16))

        def step():
            m.zero_grad()
            m(x).backward(ct)

        files = _files_run(step)
    finally:
        bridge.set_exchange_mode(previous)
    want = HOT | ({"bridge/_dlpack.py"} if mode == "dlpack" else set())
    assert files == want, f"a cached call ran in {sorted(files)}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_rng_stream_and_nnx_calls_run_in_the_files_the_note_names(kind):
    """A Linen call with RNG streams in the same seven files, an NNX call in those and the
    one NOTE [Call path] names, with gradients and without."""
    make, extra = KINDS[kind]
    m = make()
    x = torch.randn(4, 8, requires_grad=True)
    ct = torch.randn(4, 16)

    def step():
        m.zero_grad()
        m(x).backward(ct)

    def no_grad():
        with torch.no_grad():
            m(x)

    for fn, want in ((step, HOT | extra), (no_grad, NO_GRAD | extra)):
        files = _files_run(fn)
        assert files == want, f"{fn.__name__}: a cached call ran in {sorted(files)}"


def test_a_cached_call_without_gradients_runs_in_the_same_files():
    """The same files exactly: a subset alone would pass with none profiled (mutation:
    ``_files_run`` matching no path)."""
    m = FlaxModule(MLP(), example_args=(torch.zeros(4, 8),))
    x = torch.randn(4, 8)

    def step():
        with torch.no_grad():
            m(x)

    files = _files_run(step)
    assert files == NO_GRAD, f"a cached call without gradients ran in {sorted(files)}"
