"""accelerate over a model that holds a FlaxModule, each run against a plain torch loop.

``prepare`` / ``backward`` / ``accumulate``, ``save_state`` + ``load_state`` and
``mixed_precision="bf16"`` (the FlaxModule then gets bf16 activations and runs in float32,
issue 15), on one CPU process.
"""

import flax.linen as nn
import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from torchside import FlaxModule  # noqa: E402

WIDTH, N, BATCH = 16, 32, 8


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))


class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(nn.remat(Residual), lengths=(2, 2))(name="stack")(x)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, WIDTH),
        FlaxModule(Deep(), example_args=(torch.zeros(2, WIDTH),)),
        torch.nn.Linear(WIDTH, 1),
    )


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)  # state to save


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plain(epochs=1, accumulate=1, autocast=False):
    model = _model()
    opt = _optimizer(model)
    for _ in range(epochs):
        for i, batch in enumerate(_loader()):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = _loss(model, batch)
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
    return _state(model)


def _reset_accelerate():
    """accelerate keeps one process-wide state; a new Accelerator needs it cleared."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    yield
    _reset_accelerate()


def _accelerated_epoch(accelerator, model, opt, loader):
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, batch))
            opt.step()
            opt.zero_grad()


def test_prepare_backward_accumulate_equal_a_plain_loop():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    initial = _state(model)
    model, opt, loader = accelerator.prepare(model, _optimizer(model), _loader())
    _accelerated_epoch(accelerator, model, opt, loader)
    final = _state(model)
    torch.testing.assert_close(final, _plain(accumulate=2))
    for k in [k for k in final if ".params." in k]:
        assert not torch.equal(final[k], initial[k]), f"{k} did not train"


def test_save_state_and_load_state_resume_the_run(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = _model()
    model, opt, loader = accelerator.prepare(model, _optimizer(model), _loader())
    _accelerated_epoch(accelerator, model, opt, loader)
    accelerator.save_state(tmp_path / "state")
    _accelerated_epoch(accelerator, model, opt, loader)
    torch.testing.assert_close(_state(model), _plain(epochs=2))

    _reset_accelerate()  # as a restarted process would
    accelerator = Accelerator(cpu=True)
    resumed = _model()  # initial weights, a fresh optimizer: all must come from the state
    resumed, resumed_opt, resumed_loader = accelerator.prepare(
        resumed, _optimizer(resumed), _loader())
    accelerator.load_state(tmp_path / "state")
    _accelerated_epoch(accelerator, resumed, resumed_opt, resumed_loader)
    torch.testing.assert_close(_state(resumed), _state(model), rtol=0, atol=0)


def test_mixed_precision_bf16_equals_a_plain_loop_under_autocast():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = _model()
    model, opt, loader = accelerator.prepare(model, _optimizer(model), _loader())
    _accelerated_epoch(accelerator, model, opt, loader)
    final = _state(model)
    assert all(v.dtype == torch.float32 for v in final.values())
    torch.testing.assert_close(final, _plain(autocast=True))
