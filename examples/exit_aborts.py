"""How often a process that hands torch tensors to JAX by DLPack aborts at exit.

What this shows:
    A JAX program keeps its inputs until it has run, and JAX dispatches runs
    asynchronously: the JAX thread that finishes a run drops its inputs. When that drop is
    the last reference to a torch tensor JAX imported by DLPack, torch's deleter takes the
    GIL on that thread, which aborts an interpreter that is already finalizing
    ("terminate called without an active exception"). The script starts fresh Python
    processes pinned to one core (so that JAX's thread tends to lose the race to the
    finalizing main thread) whose last line starts such a run, two ways:

    * flaxtorch on the DLPack route (``FLAXTORCH_EXCHANGE=dlpack``: the code path CUDA
      takes, run on CPU), a ``jax_function`` forward and backward: flaxtorch's exit
      handler waits until JAX has let go of every tensor it imported, so no exit aborts;
    * the same function with ``jax.dlpack.from_dlpack`` called directly and no flaxtorch:
      nothing waits, and some exits abort (how many depends on the machine and its load).

    docs/design.md ("Imports at exit") describes the handler.

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

PIN = "import os; os.sched_setaffinity(0, {0})\n"

# Forward and backward through flaxtorch; the backward's run may still hold its inputs
# when the script ends.
WITH_FLAXTORCH = PIN + """
import torch, jax.numpy as jnp
from torchside import jax_function

f = jax_function(lambda w, x: jnp.tanh(x @ w).sum(axis=1))
w = torch.randn(256, 256, requires_grad=True)
y = f(w, torch.randn(32, 256))
y.backward(torch.randn_like(y))
"""

# The same function on tensors JAX imports itself; nothing waits for the run to let go.
PLAIN_DLPACK = PIN + """
import torch, jax, jax.numpy as jnp

f = jax.jit(lambda w, x: jnp.tanh(x @ w).sum(axis=1))
w, x = torch.randn(256, 256), torch.randn(32, 256)
y = f(jax.dlpack.from_dlpack(w.detach()), jax.dlpack.from_dlpack(x.detach()))
"""

VARIANTS = (
    ("exit handler registered", WITH_FLAXTORCH),
    ("no exit handler (jax.dlpack.from_dlpack directly)", PLAIN_DLPACK),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="exits per variant")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "FLAXTORCH_EXCHANGE": "dlpack", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for label, script in VARIANTS:
        aborted = 0
        for _ in range(args.runs):
            run = subprocess.run([sys.executable, "-c", script], env=env,
                                 capture_output=True, text=True, timeout=300)
            aborted += run.returncode != 0
        print(f"{label}: {aborted} of {args.runs} exits aborted", flush=True)


if __name__ == "__main__":
    main()
