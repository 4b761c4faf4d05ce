"""Eval mode draws no keys from torch's generator, as torch's own Dropout (issue 15).

A FlaxModule with ``rngs=`` draws its keys from torch's default generator in ``forward``,
only when the compiled program can use them: a validation pass must not shift the training
stream. A stream the module uses in eval mode too still draws.
"""

import flax.linen as nn
import jax
import pytest
import torch

from torchside import FlaxModule


class DropNet(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = nn.Dropout(0.5)(nn.relu(nn.Dense(8)(x)), deterministic)
        return nn.Dense(3)(h)


class Noisy(nn.Module):
    """Uses its stream in eval mode too."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        return nn.Dense(3)(x) + jax.random.normal(self.make_rng("noise"), (3,))


def _flax():
    return FlaxModule(DropNet(), example_args=(torch.zeros(2, 5),), rngs=("dropout",),
                      train_kwarg="deterministic")


def _torch():
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(8, 3))


def _draws(model, grad: bool) -> bool:
    """Whether a forward (and backward, with ``grad``) moved torch's default generator."""
    x = torch.randn(4, 5, requires_grad=grad)
    state = torch.get_rng_state()
    with torch.set_grad_enabled(grad):
        y = model(x)
        if grad:
            y.backward(torch.ones_like(y))
    return not torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("make", [_torch, _flax], ids=["torch", "flax"])
def test_only_a_train_mode_forward_draws(make, grad):
    model = make()
    assert _draws(model.train(), grad)
    assert not _draws(model.eval(), grad)
    assert _draws(model.train(), grad)  # and training draws again after validation


@pytest.mark.parametrize("make", [_torch, _flax], ids=["torch", "flax"])
def test_validation_in_between_leaves_the_training_run_unchanged(make):
    x, ct = torch.randn(6, 5), torch.randn(6, 3)

    def run(validate: bool):
        model = make()
        model.load_state_dict(initial)
        torch.manual_seed(5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outs = []
        for _ in range(3):
            model.train()
            opt.zero_grad()
            y = model(x)
            y.backward(ct)
            opt.step()
            outs.append(y.detach())
            if validate:
                model.eval()
                with torch.no_grad():
                    model(x)
                model(x).backward(ct)  # a pass with gradients (e.g. a saliency check)
        return torch.stack(outs), model.state_dict()

    initial = make().state_dict()
    plain, with_validation = run(False), run(True)
    torch.testing.assert_close(with_validation, plain, rtol=0, atol=0)


def test_a_stream_used_in_eval_mode_still_draws():
    m = FlaxModule(Noisy(), example_args=(torch.zeros(2, 5),), rngs="noise",
                   train_kwarg="deterministic").eval()
    x = torch.randn(4, 5)
    with torch.no_grad():
        assert _draws(m, grad=False)
        torch.manual_seed(3)
        first, second = m(x), m(x)
        torch.manual_seed(3)
        again = m(x)
    assert not torch.equal(first, second)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
