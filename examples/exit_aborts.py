"""How often a process on the DLPack route aborts at exit, with and without the exit wait.

What this shows:
    NOTE [Imports at exit] in ``bridge/_imports.py``: the JAX thread that finishes a run
    drops the torch tensors the run imported by DLPack, and torch's deleter takes the GIL
    there, which aborts an interpreter that is finalizing. The script starts fresh Python
    processes on the forced DLPack route (``FLAXTORCH_EXCHANGE=dlpack``: the CUDA code path,
    on CPU) whose last line is a backward, pinned to one core so that JAX's thread tends to
    lose the race to the finalizing main thread, and counts aborted exits with flaxtorch's
    exit handler and with it unregistered (the code before the handler existed).

How to run (about 2 minutes on 2 CPU cores):
    python examples/exit_aborts.py            # 20 exits each way
    python examples/exit_aborts.py --runs 50
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import atexit, os, sys
os.sched_setaffinity(0, {0})
import torch, jax.numpy as jnp
import bridge._imports
from torchside import jax_function

if sys.argv[1] == "unregistered":
    atexit.unregister(bridge._imports._wait_at_exit)
f = jax_function(lambda w, x: jnp.tanh(x @ w).sum(axis=1))
w = torch.randn(64, 64, requires_grad=True)
y = f(w, torch.randn(32, 64))
y.backward(torch.randn_like(y))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="exits per variant")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "FLAXTORCH_EXCHANGE": "dlpack", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for variant in ("registered", "unregistered"):
        aborted = 0
        for _ in range(args.runs):
            run = subprocess.run([sys.executable, "-c", CHILD, variant], env=env,
                                 capture_output=True, text=True, timeout=300)
            aborted += run.returncode != 0
        print(f"exit handler {variant}: {aborted} of {args.runs} exits aborted", flush=True)


if __name__ == "__main__":
    main()
