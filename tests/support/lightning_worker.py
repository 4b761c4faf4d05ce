"""A LightningModule that holds a FlaxModule, its plain torch loop, and a DDP run.

tests/trainers/test_lightning.py imports the definitions; test_lightning_ddp.py beside it
runs the two-rank strategies as ``python tests/support/lightning_worker.py STRATEGY OUT``
(``ddp`` relaunches this script for rank 1, ``ddp_spawn`` pickles the module into two
spawned processes). Rank 0 saves the final state dict to OUT.
"""

import datetime
import faulthandler
import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from tests.support.twins import ReadmeDeep  # noqa: E402
from torchside import FlaxModule  # noqa: E402

WIDTH, N, BATCH = 16, 32, 16
DDP_EPOCHS = 2


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, WIDTH),
            FlaxModule(ReadmeDeep(WIDTH), example_args=(torch.zeros(2, WIDTH),)),
            torch.nn.Linear(WIDTH, 1),
        )

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def dataset(n: int = N) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=g)[:n]
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


def loader(batch_size: int = BATCH, n: int = N) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(n), batch_size=batch_size)


def trainer(**kwargs) -> L.Trainer:
    """A quiet CPU trainer: no logger, progress bar, summary or checkpoints unless asked."""
    options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    return L.Trainer(**{**options, **kwargs})


def plain_loop(module: Lit, epochs: int = 1, autocast: bool = False, n: int = N) -> dict:
    """What ``fit`` does, as a plain torch loop over the first ``n`` samples."""
    opt = module.configure_optimizers()
    for _ in range(epochs):
        for i, batch in enumerate(loader(n=n)):
            opt.zero_grad()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = module.training_step(batch, i)
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def main(strategy: str, out: str) -> None:
    # A stalled rank prints where every thread is and exits, instead of hanging the test.
    faulthandler.dump_traceback_later(240, exit=True)
    warnings.filterwarnings("ignore", module="lightning")
    from lightning.pytorch.strategies import DDPStrategy

    # "ddp" and "ddp_spawn" as Lightning's registry builds them, with a collective timeout.
    start = {"ddp": "popen", "ddp_spawn": "spawn"}[strategy]
    ddp = DDPStrategy(start_method=start, timeout=datetime.timedelta(seconds=120))
    module = Lit()
    run = trainer(strategy=ddp, devices=2, max_epochs=DDP_EPOCHS)
    # One batch per epoch: Lightning's distributed sampler shuffles the training set, so
    # only then is the union of the two ranks' batches the plain loop's batch.
    run.fit(module, loader(BATCH // 2, n=BATCH))
    if run.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
