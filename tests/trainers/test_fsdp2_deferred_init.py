"""FSDP2's deferred init over a model holding a FlaxModule: meta, shard, to_empty, reset.

Two gloo ranks run ``tests/support/deferred_init_worker.py``. The Flax block's values after
``reset_parameters()`` must equal a block built directly, bit for bit, while each rank
keeps only its shard; one step's Flax gradients must equal a single process's on the
full batch from the same initial weights (FSDP2 averages the ranks' gradients, and each
rank's loss is the mean over its half of the batch); and the sharded model's
``torch.distributed.checkpoint``, saved by 2 ranks, loads into one process as it was.
"""

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.ranks import run_two_ranks
from tests.support.twins import ReadmeDeep
from torchside import FlaxModule

pytestmark = pytest.mark.processes  # gloo ranks: alone under pytest-xdist (conftest)

WORKER = Path(__file__).resolve().parent.parent / "support" / "deferred_init_worker.py"


def test_meta_sharded_then_reset_equals_a_direct_build_and_trains_like_one_process(tmp_path):
    out = tmp_path / "run"
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    codes = run_two_ranks(WORKER, out, logs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    reports = [torch.load(f"{out}.{r}.pt") for r in (0, 1)]
    for report in reports:
        assert report["equal"] and all(report["equal"].values()), report["equal"]
        # FSDP2 shards dim 0 of each parameter: the stack's first scan axis, 2 -> 1
        assert all(shape[0] == 1 for shape in report["local"].values()), report["local"]
    initial = reports[0]["initial"]
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        FlaxModule(ReadmeDeep(width=8, lengths=(2, 2)), example_args=(torch.zeros(4, 8),)),
        torch.nn.Linear(8, 1))
    model.load_state_dict(initial)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    for name, p in model[1].named_parameters():
        want = p.grad
        for report in reports:
            got = report["grads"][name]
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(scale, 1e-3),
                                       msg=name)
    # The FSDP2 checkpoint of 2 ranks, loaded into one process, is what the ranks held.
    single = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        FlaxModule(ReadmeDeep(width=8, lengths=(2, 2)), example_args=(torch.zeros(4, 8),)),
        torch.nn.Linear(8, 1))
    state = single.state_dict()
    with warnings.catch_warnings():  # DCP says it loads in one process, as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=f"{out}.dcp", no_dist=True)
    single.load_state_dict(state)
    for name, value in single.state_dict().items():
        assert torch.equal(value, reports[0]["final"][name]), name
    assert any(not torch.equal(reports[0]["final"][n], v) for n, v in initial.items())
