"""Lightning ``strategy="ddp"`` and ``"ddp_spawn"`` on 2 CPU ranks vs a plain torch loop.

Each strategy runs tests/support/lightning_worker.py in its own process: ``ddp`` relaunches the
script it runs in (here the worker, not pytest), ``ddp_spawn`` pickles the LightningModule,
FlaxModule included, into two spawned processes (issue 15).
"""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

from tests.support import ROOT, subprocess_env  # noqa: E402
from tests.support.lightning_worker import BATCH, DDP_EPOCHS, Lit, plain_loop  # noqa: E402

WORKER = ROOT / "tests" / "support" / "lightning_worker.py"

pytestmark = [
    pytest.mark.processes,  # gloo ranks: alone under pytest-xdist (conftest)
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates.
    pytest.mark.filterwarnings("ignore:.*treespec, LeafSpec.* is deprecated:FutureWarning"),
]


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_cpu_ranks_equal_a_plain_loop_on_the_full_batches(strategy, tmp_path):
    out = tmp_path / "state.pt"
    with open(tmp_path / "log.txt", "w") as sink:  # a file, not a pipe: no rank blocks on it
        run = subprocess.run([sys.executable, str(WORKER), strategy, str(out)],
                             env=subprocess_env(), stdout=sink, stderr=subprocess.STDOUT,
                             timeout=300)
    assert run.returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]
    final = torch.load(out, weights_only=True)
    initial = Lit().state_dict()
    torch.testing.assert_close(final, plain_loop(Lit(), epochs=DDP_EPOCHS, n=BATCH))
    for k in [k for k in final if ".params." in k]:
        assert not torch.equal(final[k], initial[k]), f"{k} did not train"
