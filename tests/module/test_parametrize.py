"""torch's weight transforms on a Flax kernel: parametrizations, hook-based norms, pruning.

Each transform is applied, with the same call, to ``Dense_0.kernel`` of a FlaxModule and of
a torch twin that keeps Flax's layout (``kernel`` is ``(in, out)``, ``y = x @ kernel + b``),
so torch does exactly the same to both; outputs, gradients of the original parameters and
the transforms' buffers must then match over a few SGD steps, and after the transform is
removed (issue 15).
"""

import flax.linen as nn
import pytest
import torch
import torch.nn.utils.parametrize as P
from torch.nn.utils import parametrizations, prune

from torchside import FlaxModule


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(6)(x))  # Dense_0
        return nn.Dense(3)(h)  # Dense_1


class TwinDense(torch.nn.Module):
    def __init__(self, scope):
        super().__init__()
        self.kernel = torch.nn.Parameter(scope.kernel.detach().clone())
        self.bias = torch.nn.Parameter(scope.bias.detach().clone())

    def forward(self, x):
        return x @ self.kernel + self.bias


class TwinNet(torch.nn.Module):
    def __init__(self, m: FlaxModule):
        super().__init__()
        self.Dense_0 = TwinDense(m.params.Dense_0)
        self.Dense_1 = TwinDense(m.params.Dense_1)

    def forward(self, x):
        return self.Dense_1(torch.tanh(self.Dense_0(x)))


class SoftClip(torch.nn.Module):
    def forward(self, w):
        return 0.5 * torch.tanh(2 * w)


def _mask(module, name):
    g = torch.Generator().manual_seed(3)
    prune.custom_from_mask(module, name, torch.rand(4, 6, generator=g) > 0.4)


def _remove_parametrizations(module, name):
    P.remove_parametrizations(module, name)


# name: (apply to a module with a ``kernel``, remove from it)
TRANSFORMS = {
    "register_parametrization": (
        lambda m, n: P.register_parametrization(m, n, SoftClip()), _remove_parametrizations),
    "parametrizations.weight_norm": (
        lambda m, n: parametrizations.weight_norm(m, n, dim=1), _remove_parametrizations),
    "parametrizations.spectral_norm": (
        lambda m, n: parametrizations.spectral_norm(m, n, dim=1), _remove_parametrizations),
    "weight_norm-hooks": (
        lambda m, n: torch.nn.utils.weight_norm(m, n, dim=1), torch.nn.utils.remove_weight_norm),
    "spectral_norm-hooks": (
        lambda m, n: torch.nn.utils.spectral_norm(m, n, dim=1),
        torch.nn.utils.remove_spectral_norm),
    "prune.l1_unstructured": (
        lambda m, n: prune.l1_unstructured(m, n, amount=0.5), prune.remove),
    "prune.custom_from_mask": (_mask, prune.remove),
}


def _close(got, want, what):
    """float32 across two libraries: ``atol`` scales with max|want|, with no floor, so an
    output or buffer well under 1 is held to its own precision."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def _step_both(flax_model, twin, step):
    x = torch.randn(5, 4)
    ct = torch.randn(5, 3)
    xs = (x.clone().requires_grad_(), x.clone().requires_grad_())
    outs = []
    for model, xi in zip((flax_model, twin), xs, strict=True):
        model.zero_grad(set_to_none=True)
        y = model(xi)
        y.backward(ct)
        outs.append(y.detach())
    _close(outs[0], outs[1], f"step {step}: output")
    _close(xs[0].grad, xs[1].grad, f"step {step}: input gradient")
    flax_params = {n.removeprefix("params."): p for n, p in flax_model.named_parameters()}
    twin_params = dict(twin.named_parameters())
    assert set(flax_params) == set(twin_params)
    for name, p in twin_params.items():
        assert flax_params[name].grad is not None, f"step {step}: {name} got no gradient"
        _close(flax_params[name].grad, p.grad, f"step {step}: gradient of {name}")
    flax_buffers = {n.removeprefix("params."): b for n, b in flax_model.named_buffers()}
    assert set(flax_buffers) == set(dict(twin.named_buffers()))
    for name, b in twin.named_buffers():  # spectral norm's u and v, pruning masks
        _close(flax_buffers[name].float(), b.float(), f"step {step}: buffer {name}")
    for model in (flax_model, twin):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return flax_params


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_transformed_flax_kernel_trains_like_the_same_on_torch(transform):
    apply, remove = TRANSFORMS[transform]
    flax_model = FlaxModule(Net(), example_args=(torch.zeros(2, 4),))
    twin = TwinNet(flax_model)
    for model in (flax_model.params.Dense_0, twin.Dense_0):
        torch.manual_seed(11)  # spectral norm starts its power iteration from random vectors
        apply(model, "kernel")
    torch.manual_seed(1)
    for step in range(2):
        params = _step_both(flax_model, twin, step)
        assert "Dense_0.kernel" not in params  # the transform owns the original now

    for model in (flax_model.params.Dense_0, twin.Dense_0):
        remove(model, "kernel")
    params = _step_both(flax_model, twin, "after remove")
    assert isinstance(flax_model.params.Dense_0._parameters["kernel"], torch.nn.Parameter)
    assert params["Dense_0.kernel"].grad is not None
