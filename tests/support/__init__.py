"""Code the tests share; pytest collects nothing here (no file starts with ``test_``).

* ``twins``, ``twins_parity``: Flax modules with torch twins of the same math, the models
  several test files share, and the parity suite's registry of twins;
* ``references``: conversions to compare with pure JAX, and a pure-NNX training step;
* ``stacks``: sizes, data and unrolled references of the ``remat_stack`` tests;
* ``docstring_models``: Flax's and ``jax.checkpoint``'s docstring examples that more than
  one test file runs;
* ``corpus_helpers``: runs a module or function through the bridge and as pure JAX, and
  tags the corpus tests for the coverage table (``docs/coverage.md``);
* ``pipeline``: the only module that reads the call pipeline's internals;
* ``closeness``: comparisons whose tolerance scales with the values, with negative
  controls, and JAX's highest matmul precision for CUDA comparisons;
* ``devices_env``: which devices a test process pairs, from the environment;
* ``ranks`` runs the worker scripts ``ddp_worker``, ``fsdp2_worker``,
  ``deferred_init_worker`` and ``lightning_worker`` as separate processes;
  ``loss_inside`` builds the model the DDP and FSDP2 workers train with its loss inside
  one FlaxModule, and takes the SGD steps both workers train with.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def subprocess_env(extra: dict | None = None) -> dict:
    """This process's environment plus ``extra``, with the repository root on PYTHONPATH.

    A child started with it imports this checkout's packages and ``tests.support``.
    """
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def pytest_in_subprocess(path: Path, env: dict, log: Path) -> tuple[int, str, dict]:
    """Runs pytest on ``path`` in a child process with ``env`` (``subprocess_env``'s).

    For cases that need a fresh JAX (two host devices, set by ``XLA_FLAGS`` before JAX
    starts). Output goes to ``log``, a file, not a pipe: a full pipe would block the child.

    Returns:
        ``(exit code, output, {"passed": n, ...})`` from pytest's summary line.
    """
    with open(log, "w") as sink:
        code = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", str(path)],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=600).returncode
    out = log.read_text()
    lines = out.strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", lines[-1] if lines else "")}
    return code, out, counts
