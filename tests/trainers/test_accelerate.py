"""accelerate over a model that holds a FlaxModule, each run against a plain torch loop.

``prepare`` / ``backward`` / ``accumulate``, ``save_state`` + ``load_state`` and
``mixed_precision="bf16"`` (the FlaxModule then gets bf16 activations and runs in float32,
issue 15), on one CPU process; and a model whose loss is inside the FlaxModule (the
scalar-loss route: accelerate scales its loss for accumulation, and the second micro-batch
accumulates into gradients handed over by the first) against its torch twin.
"""

import flax.linen as nn
import jax.numpy as jnp
import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from tests.support import pipeline  # noqa: E402
from tests.support.twins import ReadmeDeep  # noqa: E402
from torchside import FlaxModule  # noqa: E402

WIDTH, N, BATCH = 16, 32, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, WIDTH),
        FlaxModule(ReadmeDeep(WIDTH), example_args=(torch.zeros(2, WIDTH),)),
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


class WithLoss(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        h = nn.tanh(nn.Dense(WIDTH)(x))  # Dense_0
        return jnp.mean((nn.Dense(1)(h) - y) ** 2)  # Dense_1


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_loss_inside_the_module_accumulates_like_its_torch_twin(precision):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision=precision)
    torch.manual_seed(0)
    model = FlaxModule(WithLoss(), example_args=(torch.zeros(2, 8), torch.zeros(2, 1)))
    layers = torch.nn.Linear(8, WIDTH), torch.nn.Linear(WIDTH, 1)
    with torch.no_grad():
        for lin, dense in zip(layers, (model.params.Dense_0, model.params.Dense_1), strict=True):
            lin.weight.copy_(dense.kernel.T)
            lin.bias.copy_(dense.bias)
    prepared, opt, loader = accelerator.prepare(model, _optimizer(model), _loader())
    for _ in range(2):
        for x, y in loader:
            with accelerator.accumulate(prepared):
                accelerator.backward(prepared(x, y))
                opt.step()
                opt.zero_grad()
    twin_opt = _optimizer(torch.nn.ModuleList(layers))
    for _ in range(2):
        for i, (x, y) in enumerate(_loader()):
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                out = layers[1](torch.tanh(layers[0](x)))
            (((out.float() - y) ** 2).mean() / 2).backward()
            if i % 2:
                twin_opt.step()
                twin_opt.zero_grad()
    # The fused route ran, not a fall-back to a forward and a backward program.
    assert {kind for _, kind, _ in pipeline.executables_run(model)} == {"value_and_grad"}
    # The block runs in float32 under autocast (its bf16 loss is cast back): against the
    # twin's bf16 layers, bf16's precision relative to the weights' size.
    atol = 1e-6 if precision == "no" else 2e-3
    for lin, dense in zip(layers, (model.params.Dense_0, model.params.Dense_1), strict=True):
        scale = float(lin.weight.detach().abs().max())
        torch.testing.assert_close(dense.kernel.T, lin.weight, rtol=0, atol=atol * scale)
        torch.testing.assert_close(dense.bias, lin.bias, rtol=0, atol=atol * scale)
