"""A cached call runs in five library files (NOTE [Call path] in ``torchside/_call.py``).

A cached eager forward and backward of a ``FlaxModule`` is profiled (cProfile) and the
library files whose code ran are compared with the four that NOTE names; the DLPack route
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

import bridge
from torchside import FlaxModule

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("bridge", "flaxside", "torchside")
HOT = {"torchside/_module.py", "torchside/_call.py", "torchside/_entry.py",
       "bridge/_exchange.py", "bridge/_held.py"}


class MLP(nn.Module):
    loss: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(16)(jnp.tanh(nn.Dense(16)(x)))
        return jnp.mean(y**2) if self.loss else y


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
def test_a_cached_forward_and_backward_runs_in_five_files(residuals, loss, mode):
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


def test_a_cached_call_without_gradients_runs_in_the_same_files():
    m = FlaxModule(MLP(), example_args=(torch.zeros(4, 8),))
    x = torch.randn(4, 8)

    def step():
        with torch.no_grad():
            m(x)

    assert _files_run(step) <= HOT
