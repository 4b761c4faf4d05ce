"""The interpreter exits cleanly while JAX's threads still hold torch memory it imported.

NOTE [Imports at exit] in ``bridge/_dlpack.py``: the last run's inputs are dropped by a
thread of JAX's after the run; if that is the last reference to a tensor torch exported by
DLPack, torch's deleter takes the GIL on that thread, which aborts the process once the
interpreter is finalizing. Pinning the process to one core makes JAX's thread lose the race
to the finalizing main thread most of the time (``examples/exit_aborts.py`` counts aborted
exits with flaxtorch and with ``jax.dlpack.from_dlpack`` used directly).

The registry of imports is global: each test first waits for what earlier tests left to
JAX, then counts from there, so that it passes in any order.
"""

import subprocess
import sys
import threading
import time

import jax
import pytest
import torch

from bridge import _dlpack
from tests.support import subprocess_env

SCRIPT = """
import os, sys
os.sched_setaffinity(0, {{0}})
import torch, jax.numpy as jnp
from torchside import jax_function

f = jax_function(lambda w, x: jnp.tanh(x @ w).sum(axis=1))
w = torch.randn(64, 64, requires_grad=True, device="{device}")
y = f(w, torch.randn(32, 64, device="{device}"))
y.backward(torch.randn_like(y))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_exit_right_after_a_backward_on_the_dlpack_route_does_not_abort(device):
    """Catches an exit that does not wait for JAX to drop its DLPack imports: the process
    aborts (a non-zero exit code or a message on stderr) in some of the four runs."""
    env = subprocess_env({"FLAXTORCH_EXCHANGE": "dlpack"})
    for attempt in range(4):
        run = subprocess.run([sys.executable, "-c", SCRIPT.format(device=device)], env=env,
                             capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, (attempt, run.returncode, run.stderr[-3000:])
        assert run.stderr == "", run.stderr[-3000:]


def _import(tensor):
    """JAX's import of a fresh export of ``tensor``, recorded as the exchange records it."""
    exported = tensor.detach()
    return exported, _dlpack.imported(exported, jax.dlpack.from_dlpack(exported))


def _settled() -> int:
    """How many imports only JAX holds, once what earlier tests left has been let go."""
    assert _dlpack.wait_for_jax(timeout=60), "an earlier import was never released"
    return _dlpack.jax_held()


def test_waiting_ends_when_the_last_holder_lets_go():
    """``wait_for_jax`` waits, with the GIL released, for imports Python has dropped."""
    base = _settled()
    held = [_import(torch.randn(8))[0]]  # stands in for a run of JAX's that holds the tensor
    assert _dlpack.jax_held() == base + 1  # Python dropped the array; the tensor lives on
    threading.Timer(0.3, held.clear).start()  # another thread lets go, as JAX's would
    start = time.monotonic()
    assert _dlpack.wait_for_jax(timeout=30)
    assert time.monotonic() - start >= 0.25
    assert _dlpack.jax_held() == base


def test_imports_python_still_holds_are_not_waited_for():
    """A module's held parameters live until the main thread, holding the GIL, drops them."""
    base = _settled()
    exported, array = _import(torch.randn(8))
    assert _dlpack.jax_held() == base
    start = time.monotonic()
    assert _dlpack.wait_for_jax(timeout=30)
    assert time.monotonic() - start < 0.25
    del exported, array
    assert _dlpack.jax_held() == base
