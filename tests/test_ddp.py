"""DistributedDataParallel (gloo, CPU, loopback) over a model that holds a FlaxModule."""

from pathlib import Path

import torch

from tests.ddp_worker import build
from tests.ranks import run_reference, run_two_ranks

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_two_process_ddp_equals_single_process_full_batch(tmp_path):
    out_ddp, out_ref = tmp_path / "ddp.pt", tmp_path / "ref.pt"
    ref = run_reference(WORKER, out_ref)
    assert ref.returncode == 0, ref.stderr[-3000:]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    for code, log in zip(run_two_ranks(WORKER, out_ddp, logs), logs, strict=True):
        assert code == 0, log.read_text()[-3000:]
    ddp = torch.load(out_ddp, weights_only=True)
    ref = torch.load(out_ref, weights_only=True)
    assert set(ddp) == set(ref) and any("stack" in k for k in ddp)
    initial = build().state_dict()
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], msg=name)
        assert not torch.equal(ref[name], initial[name]), f"{name} did not train"
