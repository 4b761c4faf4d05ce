"""Lightning over a model that holds a FlaxModule, each run against a plain torch loop.

The LightningModule, data and plain loop live in tests/support/lightning_worker.py; the two-rank
strategies are in tests/trainers/test_lightning_ddp.py.
"""

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.support.lightning_worker import Lit, loader, plain_loop, trainer  # noqa: E402

pytestmark = [
    # Lightning's advice for a toy run (few batches, no dataloader workers) is not an
    # error here.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates.
    pytest.mark.filterwarnings("ignore:.*treespec, LeafSpec.* is deprecated:FutureWarning"),
]


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _full_loss(module):
    (x, y), = loader(batch_size=10**6)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(module(x).float(), y))


def _flax_keys(state):
    return [k for k in state if ".params." in k]


def test_fit_trains_the_flax_parameters_like_a_plain_loop():
    module = Lit()
    initial, loss_before = _state(module), _full_loss(module)
    trainer(max_epochs=3).fit(module, loader())
    assert _full_loss(module) < 0.9 * loss_before
    final = _state(module)
    assert _flax_keys(final)
    for k in [k for k in final if ".params." in k]:
        assert not torch.equal(final[k], initial[k]), f"{k} did not train"
    torch.testing.assert_close(final, plain_loop(Lit(), epochs=3))


def _checkpointing(dirpath):
    checkpoints = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1,
                                  filename="{epoch}")
    return dict(enable_checkpointing=True, callbacks=[checkpoints], default_root_dir=dirpath)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* is not empty:UserWarning")  # resuming
def test_checkpoint_resume_and_load_from_checkpoint(tmp_path):
    trainer(max_epochs=2, **_checkpointing(tmp_path)).fit(Lit(), loader())
    resumed = Lit()
    trainer(max_epochs=4, **_checkpointing(tmp_path)).fit(
        resumed, loader(), ckpt_path=tmp_path / "epoch=1.ckpt")
    reference = Lit()
    after_two = plain_loop(reference, epochs=2)
    after_four = plain_loop(reference, epochs=2)  # plain SGD: a new optimizer just goes on
    torch.testing.assert_close(_state(resumed), after_four)

    loaded = Lit.load_from_checkpoint(tmp_path / "epoch=1.ckpt")
    torch.testing.assert_close(_state(loaded), after_two)
    last = Lit.load_from_checkpoint(tmp_path / "epoch=3.ckpt")
    torch.testing.assert_close(_state(last), _state(resumed), rtol=0, atol=0)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(last.eval()(x), resumed.eval()(x), rtol=0, atol=0)


def test_bf16_mixed_equals_a_plain_loop_under_autocast():
    module = Lit()
    trainer(precision="bf16-mixed").fit(module, loader())
    torch.testing.assert_close(_state(module), plain_loop(Lit(), autocast=True))
    assert all(v.dtype == torch.float32 for v in module.state_dict().values())
