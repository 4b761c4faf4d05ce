"""Opacus (DP-SGD) over a model that holds a FlaxModule, against its torch twin.

A torch ``Linear`` then a 2-layer Flax MLP in a ``FlaxModule``; the twin is the same
network in torch with the same values. Per-sample gradients (``GradSampleModule``, hooks
and functorch modes) must equal the twin's and pure JAX's ``vmap(grad)`` of the same Flax
block; three DP-SGD steps of ``PrivacyEngine.make_private`` (clipping, with and without
noise, Poisson sampling on and off) must move the parameters as the twin's. The per-sample
gradients of the block come from one JAX program: ``vmap`` over the batch of the block's
VJP with the cotangents Opacus's backward hook captured (``torchside/integrations/_opacus.py``).
"""

import jax
import jax.numpy as jnp
import pytest
import torch

pytest.importorskip("opacus", reason="the 'dp' extra: pip install 'flaxtorch[dp]'")

from opacus import GradSampleModule, PrivacyEngine  # noqa: E402
from opacus.validators import ModuleValidator  # noqa: E402

from tests.support import pipeline  # noqa: E402
from tests.support.closeness import close  # noqa: E402
from tests.support.references import to_jax  # noqa: E402
from tests.support.twins import BatchNormMLP, TanhMLP  # noqa: E402
from torchside import FlaxModule  # noqa: E402

pytestmark = [
    # PrivacyEngine warns that its RNG is not cryptographically secure (secure_mode=False).
    pytest.mark.filterwarnings("ignore:Secure RNG turned off:UserWarning"),
    # Opacus hooks the first Linear too, whose input (the data) needs no gradient.
    pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients:UserWarning"),
    # Opacus's accountant on a tiny data set.
    pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning"),
]

D_IN, WIDTH, HIDDEN, OUT, N, BATCH = 5, 8, 16, 3, 24, 8


def _flax_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, WIDTH),
        FlaxModule(TanhMLP(HIDDEN, OUT), example_args=(torch.zeros(2, WIDTH),), seed=1))


class TorchDense(torch.nn.Module):
    """Flax's ``Dense`` in torch, with its layout (``kernel`` is (in, out)) and order."""

    def __init__(self, kernel, bias):
        super().__init__()
        self.bias = torch.nn.Parameter(bias.detach().clone())
        self.kernel = torch.nn.Parameter(kernel.detach().clone())

    def forward(self, x):
        return x @ self.kernel + self.bias


def _twin(model, dense_layout: bool):
    """The torch twin of ``_flax_model()``: ``nn.Linear`` layers, or ``TorchDense`` ones
    whose parameters are in the FlaxModule's order and layout (noise draws then match)."""
    lin, flax = model
    layers = [torch.nn.Linear(D_IN, WIDTH)]
    layers[0].load_state_dict(lin.state_dict())
    for k in (1, 0):  # TanhMLP builds its output Dense first: Dense_1 is the hidden layer
        scope = getattr(flax.params, f"Dense_{k}")
        if dense_layout:
            layers.append(TorchDense(scope.kernel, scope.bias))
        else:
            layer = torch.nn.Linear(*scope.kernel.shape)
            with torch.no_grad():
                layer.weight.copy_(scope.kernel.T)
                layer.bias.copy_(scope.bias)
            layers.append(layer)
        if k == 1:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def _twin_name(name: str, dense_layout: bool) -> tuple[str, bool]:
    """The twin's name of a FlaxModule model's parameter, and whether it is transposed."""
    if name.startswith("0."):
        return name, False
    k = int(name.split("Dense_")[1][0])
    leaf = name.rsplit(".", 1)[1]
    index = 1 if k == 1 else 3
    if dense_layout:
        return f"{index}.{leaf}", False
    return f"{index}.{'weight' if leaf == 'kernel' else 'bias'}", leaf == "kernel"


def _jax_per_sample(flax_layer, h, weights, ones=False):
    """Pure JAX: ``vmap(grad)`` of ``<weights_i, block(params, h_i)>`` per sample."""
    params = jax.tree_util.tree_map(jnp.array, flax_layer.flax_variables()["params"])
    block = TanhMLP(HIDDEN, OUT)

    def loss(p, x, w):
        return (block.apply({"params": p}, x[None]) * w[None]).sum()

    w = jnp.ones_like(to_jax(weights)) if ones else to_jax(weights)
    return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, to_jax(h), w)


@pytest.mark.parametrize("force_functorch", [False, True], ids=["hooks", "functorch"])
def test_per_sample_gradients_equal_the_twin_and_pure_jax(force_functorch):
    """Two routes: Opacus's hooks call the bridge's grad sampler (``per_sample_gradients``);
    ``force_functorch`` skips every registered sampler and runs Opacus's own
    ``vmap(grad(functional_call))`` over the block, which the bridge serves as a torch.func
    call (NOTE [torch.func]: a ``vmap`` derived program). Each case checks, by the
    programs that ran, that its route ran and the other did not (the functorch case was
    once taken for a second test of the sampler, which it never runs)."""
    model = _flax_model()
    twin = _twin(model, dense_layout=False)
    g = torch.Generator().manual_seed(2)
    x, weights = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, OUT, generator=g)
    samples = {}
    for name, m in (("flax", model), ("twin", twin)):
        gsm = GradSampleModule(m, loss_reduction="sum", force_functorch=force_functorch)
        with pipeline.program_runs() as runs:
            (gsm(x) * weights).sum().backward()
        samples[name] = {k: p.grad_sample for k, p in m.named_parameters()}
        gsm._close()
        if name == "flax":  # the route that ran: the sampler's program, or torch.func's
            ran = {program for program, _ in runs}
            sampler = any(n.endswith("(per-sample vjp)") for n in ran)
            vmapped = any("(vmap over" in n for n in ran)
            assert (sampler, vmapped) == (not force_functorch, force_functorch), ran
    with torch.no_grad():
        h = model[0](x)
    ref = _jax_per_sample(model[1], h, weights)
    wrong = _jax_per_sample(model[1], h, weights, ones=True)  # backprops not used
    for name, got in samples["flax"].items():
        assert got is not None, f"{name}: no grad_sample"
        assert got.shape == (BATCH, *dict(model.named_parameters())[name].shape)
        twin_name, transposed = _twin_name(name, dense_layout=False)
        want = samples["twin"][twin_name]
        close(got, want.transpose(1, 2) if transposed else want, f"{name} vs twin")
        if name.startswith("1."):
            path = name.split(".")[2:]
            close(got, ref[path[0]][path[1]], f"{name} vs vmap(grad)",
                  wrong=[wrong[path[0]][path[1]]])


def test_the_comparison_sees_a_wrong_cotangent(monkeypatch):
    """Negative control: the grad sampler with the hook's backprops replaced by ones (the
    per-sample cotangent not used) must fail the comparison of the test above."""
    from opacus.grad_sample import GradSampleModule as Hooks

    from torchside.integrations._opacus import per_sample_gradients

    monkeypatch.setitem(Hooks.GRAD_SAMPLERS, FlaxModule, lambda m, a, b: per_sample_gradients(
        m, a, torch.ones_like(b)))
    with pytest.raises(AssertionError, match="vs twin"):
        test_per_sample_gradients_equal_the_twin_and_pure_jax(force_functorch=False)


def test_arguments_not_batch_first_are_refused_by_name():
    layer = FlaxModule(TanhMLP(HIDDEN, OUT), example_args=(torch.zeros(2, WIDTH),))
    from torchside.integrations._opacus import per_sample_gradients

    with pytest.raises(ValueError, match=r"positional argument 0 has shape \(4, 8\).*"
                                         r"batch \(6 samples"):
        per_sample_gradients(layer, [torch.randn(4, WIDTH)], torch.randn(6, OUT))


def test_a_call_with_keyword_arguments_is_refused_when_opacus_captures_it():
    """Opacus's hooks capture positional arguments only: per-sample gradients of a call
    with ``scale=`` would be those of another function, so a call Opacus captures (training
    mode, grad on) is refused as it runs; calls it does not capture are not."""

    class ScaledMLP(TanhMLP):
        def __call__(self, x, scale=None):
            return super().__call__(x) * (1.0 if scale is None else scale)

    class Scaled(torch.nn.Module):
        def __init__(self, keyword: bool):
            super().__init__()
            self.keyword = keyword
            self.flax = FlaxModule(ScaledMLP(HIDDEN, OUT), example_args=(torch.zeros(2, WIDTH),))

        def forward(self, x):
            s = torch.full((len(x), 1), 2.0)
            if self.keyword:
                return self.flax(x, scale=s)
            out = self.flax(x, s)  # positional: captured, and exact
            with torch.no_grad():  # a monitoring call with a keyword: not captured
                self.flax(x[:2], scale=s[:2])
            return out

    x = torch.randn(BATCH, WIDTH)
    gsm = GradSampleModule(Scaled(keyword=True))
    with pytest.raises(ValueError, match=r"keyword arguments \['scale'\].*positional"):
        gsm(x)
    gsm.eval()
    with torch.no_grad():
        gsm(x)  # not captured: allowed
    gsm._close()

    model = Scaled(keyword=False)
    gsm = GradSampleModule(model, loss_reduction="sum")
    weights = torch.randn(BATCH, OUT)
    (gsm(x) * weights).sum().backward()
    samples = {k: p.grad_sample.clone() for k, p in model.flax.named_parameters()}
    gsm._close()
    for i in (0, BATCH - 1):  # each sample's gradient, by the module called alone
        model.flax.zero_grad()
        (model.flax(x[i:i + 1], torch.full((1, 1), 2.0)) * weights[i]).sum().backward()
        for name, p in model.flax.named_parameters():
            close(samples[name][i], p.grad, f"{name}, sample {i}")


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D_IN, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randn(N, OUT, generator=g))


def _train(model, names, *, poisson: bool, noise: float, steps: int = 3, mode: str = "hooks",
           epsilon: float | None = None):
    """``steps`` DP-SGD steps; the parameters after each, by the model's names.

    ``names``: the parameters in the order the optimizer gets them (the noise is drawn in
    that order). ``mode``: Opacus's ``grad_sample_mode``; "ghost" (fast gradient clipping)
    trains on a cross-entropy loss of the targets' argmax, whose per-sample loss it needs.
    ``epsilon``: ``make_private_with_epsilon`` for 2 epochs at that budget (``noise``
    unused)."""
    params = [dict(model.named_parameters())[k] for k in names]
    opt = torch.optim.SGD(params, lr=0.5)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    engine = PrivacyEngine()
    ghost = mode == "ghost"
    criterion = torch.nn.CrossEntropyLoss() if ghost else torch.nn.MSELoss()
    common = dict(module=model, optimizer=opt, data_loader=loader, max_grad_norm=0.5,
                  poisson_sampling=poisson, noise_generator=torch.Generator().manual_seed(4),
                  grad_sample_mode=mode, criterion=criterion)
    if epsilon is None:
        private = engine.make_private(noise_multiplier=noise, **common)
    else:
        private = engine.make_private_with_epsilon(target_epsilon=epsilon, target_delta=1e-3,
                                                   epochs=2, **common)
    gsm, opt, loader = private[0], private[1], private[-1]
    criterion = private[2] if ghost else criterion
    torch.manual_seed(5)  # Poisson sampling draws from torch's default generator
    after = []
    for x, y in loader:
        opt.zero_grad()
        criterion(gsm(x), y.argmax(1) if ghost else y).backward()
        opt.step()
        after.append({k: p.detach().clone() for k, p in model.named_parameters()})
        if len(after) == steps:
            break
    return after


def _steps_equal_the_twin(**train):
    model = _flax_model()
    twin = _twin(model, dense_layout=True)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    names = [k for k, _ in model.named_parameters()]
    got = _train(model, names, **train)
    want = _train(twin, [_twin_name(k, dense_layout=True)[0] for k in names], **train)
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, value in g.items():
            twin_name, _ = _twin_name(name, dense_layout=True)
            close(value, w[twin_name], f"step {step}, {name}", wrong=[start[name]])


@pytest.mark.parametrize("noise", [0.0, 1.0], ids=["no-noise", "noise"])
@pytest.mark.parametrize("poisson", [False, True], ids=["fixed-batches", "poisson"])
def test_dp_sgd_steps_equal_the_twin(poisson, noise):
    _steps_equal_the_twin(poisson=poisson, noise=noise)


@pytest.mark.parametrize("noise", [0.0, 1.0], ids=["no-noise", "noise"])
def test_fast_gradient_clipping_steps_equal_the_twin(noise):
    """``grad_sample_mode="ghost"``: the block's per-sample norms from its norm sampler, the
    twin's from Opacus's functorch route; the second backward clips."""
    _steps_equal_the_twin(poisson=False, noise=noise, mode="ghost")


def test_make_private_with_epsilon_trains_like_the_twin():
    _steps_equal_the_twin(poisson=True, noise=None, epsilon=4.0)


@pytest.mark.parametrize("ghost", [False, True], ids=["fast-gradient", "ghost"])
def test_per_sample_norms_equal_the_twin_and_pure_jax(ghost, monkeypatch):
    """``GradSampleModuleFastGradientClipping``'s per-sample norms per parameter: the
    block's (its norm sampler, or its grad sampler under fast gradient clipping) against
    the twin's (``nn.Linear``: Opacus's own samplers) and pure JAX's ``vmap(grad)``."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    samplers = GradSampleModuleFastGradientClipping.NORM_SAMPLERS
    norm_sampler, calls = samplers[FlaxModule], []

    def counted(*args):
        calls.append(1)
        return norm_sampler(*args)

    monkeypatch.setitem(samplers, FlaxModule, counted)
    model = _flax_model()
    twin = _twin(model, dense_layout=False)
    x, y = _data().tensors
    x, labels = x[:BATCH], y[:BATCH].argmax(1)
    norms = {}
    for key, m in (("flax", model), ("twin", twin)):
        gsm = GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0,
                                                   use_ghost_clipping=ghost)
        torch.nn.functional.cross_entropy(gsm(x), labels).backward()
        norms[key] = {k: p._norm_sample for k, p in m.named_parameters()}
    # Ghost clipping asks the block's norm sampler; fast gradient clipping its grad sampler.
    assert len(calls) == (1 if ghost else 0), calls
    h = model[0](x).detach()
    logits = model[1](h).detach().requires_grad_()
    # Opacus's backprops of a mean loss: each sample's cotangent times the batch size.
    weights = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels),
                                  logits)[0] * BATCH
    jax_grads = _jax_per_sample(model[1], h, weights)
    wrong = _jax_per_sample(model[1], h, weights, ones=True)  # backprops not used

    def norms_of(grads, path):
        g = grads[path[0]][path[1]]
        return jnp.linalg.norm(g.reshape(BATCH, -1), axis=1)

    assert any(k.startswith("1.") for k in norms["flax"])
    for name, got in norms["flax"].items():
        twin_name, _ = _twin_name(name, dense_layout=False)
        assert got.shape == (BATCH,), (name, got.shape)
        close(got, norms["twin"][twin_name], f"{name} norms against the twin")
        if name.startswith("1."):
            path = name.split(".")[2:]
            close(got, norms_of(jax_grads, path), f"{name} norms against pure JAX",
                  wrong=[norms_of(wrong, path)])


def test_validators_see_the_flax_block():
    model = _flax_model()
    assert ModuleValidator.validate(model) == []
    assert GradSampleModule.validate(model) == []
    bn = torch.nn.Sequential(torch.nn.Linear(D_IN, 5), FlaxModule(
        BatchNormMLP(), example_args=(torch.zeros(4, 5),), train_kwarg="train"))
    errors = ModuleValidator.validate(bn)
    assert len(errors) == 1 and "batch_stats" in str(errors[0]), errors
    with pytest.raises(NotImplementedError, match="buffers"):
        GradSampleModule(bn)


def test_registered_when_opacus_is_imported_after_torchside():
    """flaxtorch never imports Opacus; importing it later registers (a post-import hook).
    This process covers whichever order its imports took."""
    import subprocess
    import sys

    from opacus.grad_sample import GradSampleModule as Hooks

    assert FlaxModule in Hooks.GRAD_SAMPLERS and FlaxModule in ModuleValidator.VALIDATORS
    code = ("import sys, torchside; assert 'opacus' not in sys.modules; import opacus; "
            "from opacus.grad_sample import GradSampleModule; "
            "from opacus.validators import ModuleValidator; from torchside import FlaxModule; "
            "assert FlaxModule in GradSampleModule.GRAD_SAMPLERS; "
            "assert FlaxModule in ModuleValidator.VALIDATORS")
    subprocess.run([sys.executable, "-c", code], check=True)
