"""DistributedDataParallel (gloo, CPU, loopback) over a model that holds a FlaxModule."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from tests.ddp_worker import build

WORKER = Path(__file__).with_name("ddp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_two_process_ddp_equals_single_process_full_batch(tmp_path):
    port = _free_port()
    out_ddp, out_ref = tmp_path / "ddp.pt", tmp_path / "ref.pt"
    # Output goes to files, not pipes: a worker blocked on a full pipe while the test waits
    # on the other one hangs both (seen once under load).
    # The single-process reference runs first, alone: three JAX processes on two cores made
    # one DDP rank stall once. Output goes to files, not pipes, so no rank blocks on a pipe.
    subprocess.run([sys.executable, str(WORKER), "0", "1", "0", str(out_ref)], env=_env(),
                   check=True, timeout=300, capture_output=True)
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(rank), "2", str(port), str(out_ddp)],
                env=_env(), stdout=sink, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log.read_text()[-3000:]
    ddp = torch.load(out_ddp, weights_only=True)
    ref = torch.load(out_ref, weights_only=True)
    assert set(ddp) == set(ref) and any("stack" in k for k in ddp)
    initial = build().state_dict()
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], msg=name)
        assert not torch.equal(ref[name], initial[name]), f"{name} did not train"
