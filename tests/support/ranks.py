"""Runs a worker script as a single-process reference and as gloo ranks (DDP, FSDP2, shard).

Output goes to files, not pipes: a worker blocked on a full pipe while the test waits on
the other one hangs both (seen once under load). The reference runs first, alone: three
JAX processes on two cores made one rank stall once.
"""

import socket
import subprocess
import sys
from pathlib import Path

from tests.support import subprocess_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_reference(worker: Path, out, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python worker 0 1 0 out``: the single-process run on the full batch.

    ``env`` adds environment variables (e.g. ``tests/support/devices_env.py``'s).
    """
    return subprocess.run([sys.executable, str(worker), "0", "1", "0", str(out)],
                          env=subprocess_env(env), timeout=300, capture_output=True, text=True)


def run_two_ranks(worker: Path, out, logs: list[Path], env: dict | None = None) -> list[int]:
    """``python worker RANK 2 PORT out`` for ranks 0 and 1; their exit codes.

    Each rank's output goes to its log; a rank still running after 300 s is killed.
    ``env`` adds environment variables to both ranks.
    """
    return run_ranks(worker, out, logs, env)


def run_ranks(worker: Path, out, logs: list[Path], env: dict | None = None) -> list[int]:
    """``python worker RANK WORLD PORT out`` for one rank per log; their exit codes.

    Each rank's output goes to its log; a rank still running after 300 s is killed.
    ``env`` adds environment variables to every rank.
    """
    port = _free_port()
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), str(rank), str(len(logs)), str(port), str(out)],
                env=subprocess_env(env), stdout=sink, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]
