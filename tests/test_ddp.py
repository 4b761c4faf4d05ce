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
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(port), str(out_ddp)],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    subprocess.run([sys.executable, str(WORKER), "0", "1", "0", str(out_ref)], env=_env(),
                   check=True, timeout=300)
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output
    ddp = torch.load(out_ddp, weights_only=True)
    ref = torch.load(out_ref, weights_only=True)
    assert set(ddp) == set(ref) and any("stack" in k for k in ddp)
    initial = build().state_dict()
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], msg=name)
        assert not torch.equal(ref[name], initial[name]), f"{name} did not train"
