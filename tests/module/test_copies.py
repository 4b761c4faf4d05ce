"""Copies of a model that holds a FlaxModule: deepcopy, pickle, torch.save, AveragedModel (EMA).

A copy is an independent module with its own parameters and buffers; its compiled programs
are rebuilt on first use (issue 15). Each copy is checked against pure JAX applied to the
copy's own variables, and against the original trained the same way.
"""

import copy
import io
import pickle
import subprocess
import sys

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.support import subprocess_env
from torchside import FlaxModule


class Net(nn.Module):
    """Parameters and BatchNorm buffers: both must be copied."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return nn.Dense(2)(nn.relu(x))


def _make():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        FlaxModule(Net(), example_args=(torch.zeros(3, 4),), train_kwarg="train"),
    )


def _torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_save,
    "AveragedModel": lambda m: AveragedModel(m).module,
}


def _pure_jax_eval(model, x):
    """The model in eval mode, its Flax part applied by Flax to the model's own variables."""
    with torch.no_grad():
        h = model[0](x)
    y = Net().apply(model[1].flax_variables(), jnp.asarray(h.numpy()), train=False)
    return torch.from_numpy(np.array(y))


def _train_step(model, x, ct):
    model.train()
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(ct)
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _storages(model):
    tensors = [*model.parameters(), *model.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("called", [False, True], ids=["fresh", "after-a-call"])
@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_computes_like_the_original_and_trains_on_its_own(how, called):
    x, ct = torch.randn(5, 4), torch.randn(5, 2)
    original = _make()
    if called:  # compiled programs, held arrays and gradients now exist
        _train_step(original, torch.randn(5, 4), torch.randn(5, 2))
    clone = COPIES[how](original)
    assert not _storages(clone) & _storages(original)
    assert [n for n, _ in clone.named_parameters()] == [n for n, _ in original.named_parameters()]

    original.eval()
    clone.eval()
    with torch.no_grad():
        torch.testing.assert_close(clone(x), original(x), rtol=0, atol=0)
    torch.testing.assert_close(clone(x).detach(), _pure_jax_eval(clone, x))

    # The same train step on the copy, then on the original: the copy's step (which writes
    # BatchNorm statistics) leaves the original alone, and both give the same gradients.
    before = {k: v.clone() for k, v in original.state_dict().items()}
    y_clone, g_clone = _train_step(clone, x, ct)
    torch.testing.assert_close(original.state_dict(), before, rtol=0, atol=0)
    y_original, g_original = _train_step(original, x, ct)
    torch.testing.assert_close(y_clone, y_original, rtol=0, atol=0)
    torch.testing.assert_close(g_clone, g_original, rtol=0, atol=0)
    torch.testing.assert_close(clone.state_dict(), original.state_dict(), rtol=0, atol=0)

    before = {k: v.clone() for k, v in original.state_dict().items()}
    torch.optim.SGD(clone.parameters(), lr=0.5).step()
    torch.testing.assert_close(original.state_dict(), before, rtol=0, atol=0)
    kernel = "1.params.Dense_0.kernel"
    assert not torch.equal(clone.state_dict()[kernel], before[kernel])
    # Each computes with its own variables: the copy with its new ones, the original as before.
    clone.eval()
    original.eval()
    torch.testing.assert_close(clone(x).detach(), _pure_jax_eval(clone, x))
    torch.testing.assert_close(original(x).detach(), _pure_jax_eval(original, x))
    assert not torch.allclose(clone(x), original(x))


def test_ema_with_averaged_model_matches_a_hand_computed_average():
    model = _make()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.75), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    expected = None
    for _ in range(3):
        model.train()
        opt.zero_grad()
        y = model(torch.randn(6, 4))
        y.backward(torch.randn_like(y))
        opt.step()
        ema.update_parameters(model)
        now = {k: v.detach().clone() for k, v in model.state_dict().items()}
        expected = now if expected is None else {
            k: 0.75 * expected[k] + 0.25 * now[k] if v.is_floating_point() else now[k]
            for k, v in now.items()}
    got = {k[len("module."):]: v for k, v in ema.state_dict().items() if k != "n_averaged"}
    assert set(got) == set(expected)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got["1.params.Dense_0.kernel"], now["1.params.Dense_0.kernel"])

    reference = _make()
    reference.load_state_dict(expected)
    ema.eval()
    reference.eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), _pure_jax_eval(reference, x))


def test_a_saved_module_gives_the_same_outputs_in_a_fresh_process(tmp_path):
    model = _make()
    _train_step(model, torch.randn(5, 4), torch.randn(5, 2))
    model.eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = model(x)
    torch.save(model, tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    env = subprocess_env()  # the pickle names Net by its module, tests.module.test_copies
    script = (
        "import sys, torch\n"
        "d = sys.argv[1]\n"
        "m = torch.load(d + '/model.pt', weights_only=False)\n"
        "x = torch.load(d + '/x.pt', weights_only=True)\n"
        "with torch.no_grad():\n"
        "    torch.save(m(x), d + '/y.pt')\n"
        "m.train()\n"
        "y = m(x)\n"
        "y.backward(torch.ones_like(y))\n"
        "assert all(p.grad is not None for p in m.parameters())\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "y.pt", weights_only=True), expected,
                               rtol=0, atol=0)


def test_route_kinds_are_themselves_after_a_copy_or_a_pickle():
    """Edges and route programs are compared by identity (NOTE [Routes]); a deep copy or an
    unpickled value of one is the same object, so a copied dictionary keyed by them (an
    entry's routes) still answers for ``EAGER``. Mutation: ``__deepcopy__`` removed."""
    import copy
    import pickle

    from torchside.call._routes import ALL_EDGES, EAGER, FUSED, PLAIN, RECOMPUTE, RESIDUALS

    for kind in (*ALL_EDGES, PLAIN, RESIDUALS, RECOMPUTE, FUSED):
        assert copy.deepcopy(kind) is kind and pickle.loads(pickle.dumps(kind)) is kind
    assert copy.deepcopy({EAGER: 1})[EAGER] == 1
