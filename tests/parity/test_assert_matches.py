"""torchside.parity.assert_matches / compare: messages, tolerances, cotangents, bf16."""

from __future__ import annotations

import copy
import re
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.twins import ResidualMLPBlock, TorchResidualMLPBlock
from tests.support.twins_parity import flax_variables
from torchside import FlaxModule
from torchside.parity import (
    TOLERANCES,
    ParityError,
    assert_matches,
    compare,
    copy_weights,
)


# -- assert_matches ---------------------------------------------------------------------------
def _docstring_example() -> str:
    """The code block of assert_matches' Example section (the last section)."""
    doc = assert_matches.__doc__
    return textwrap.dedent(doc[doc.index("Example:"):].split("::", 1)[1])


def test_docstring_example_runs():
    namespace: dict = {}
    exec(compile(_docstring_example(), "assert_matches_example", "exec"), namespace)
    namespace["test_block_matches_torch"]()


@pytest.fixture(scope="module")
def example_pair():
    """The docstring's Block and TorchBlock, compiled once for the tests below."""
    namespace: dict = {}
    exec(compile(_docstring_example(), "assert_matches_example", "exec"), namespace)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    block = namespace["Block"]()
    ours = FlaxModule(block, variables=flax_variables(block, x.numpy()))
    mapping = {"norm": "norm", "up": "up", "down": "down"}
    return ours, namespace["TorchBlock"], mapping, x


def _reference(example_pair, cls=None):
    ours, torch_cls, mapping, x = example_pair
    reference = (cls or torch_cls)()
    copy_weights(ours, reference, mapping)
    return reference


def test_matching_pair_passes_and_reports_every_tensor(example_pair):
    ours, _, mapping, x = example_pair
    report = assert_matches(ours, _reference(example_pair), x, mapping=mapping)
    names = [r.name for r in report.rows]
    assert names[:2] == ["output", "grad of input[0]"]
    assert sorted(n.split("<-")[0] for n in names[2:]) == sorted(
        f"grad of {n}" for n, _ in ours.named_parameters())
    assert report.max_rel_error < 1e-5
    assert str(report).count("\n") == len(report.rows)


def test_wrong_weight_fails_naming_the_tensor_and_its_errors(example_pair):
    ours, _, mapping, x = example_pair
    reference = _reference(example_pair)
    with torch.no_grad():
        reference.up.weight[3, 1] += 0.5
    with pytest.raises(ParityError) as info:
        assert_matches(ours, reference, x, mapping=mapping)
    err = info.value
    assert isinstance(err, AssertionError)
    assert err.name == "output" and err.max_abs > 1e-3 and err.max_rel > 1e-3
    message = str(err)
    assert re.search(r"assert_matches: output \(float32\[4, 8\]\): \d+ of 32 elements exceed",
                     message)
    assert "Max abs error" in message and "max rel error" in message
    failing = {r.name.split(" <-")[0] for r in err.report.failures}
    assert "grad of params.up.kernel" in failing


class _TorchBlockNoBiasGrad(torch.nn.Module):
    """Same forward as the docstring's TorchBlock; up.bias gets no gradient."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = F.linear(self.norm(x), self.up.weight, self.up.bias.detach())
        return x + self.down(F.gelu(h))


class _TorchBlockNoInputGrad(_TorchBlockNoBiasGrad):
    """Same forward; the residual path carries no input gradient."""

    def forward(self, x):
        return x.detach() + self.down(F.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("cls, name, head", [
    (_TorchBlockNoBiasGrad, "grad of params.up.bias", "(float32[32] <- up.bias)"),
    (_TorchBlockNoInputGrad, "grad of input[0]", "(float32[4, 8])"),
], ids=["parameter", "input"])
def test_gradient_only_mismatch_names_the_tensor(example_pair, cls, name, head):
    """Outputs match and one gradient differs: the error names that parameter or input."""
    ours, _, mapping, x = example_pair
    reference = _reference(example_pair, cls)
    with pytest.raises(ParityError) as info:
        assert_matches(ours, reference, x, mapping=mapping)
    assert info.value.name == name
    assert str(info.value).startswith(f"assert_matches: {name} {head}")


def test_float64_catches_an_epsilon_that_float32_can_miss():
    # Flax's LayerNorm epsilon defaults to 1e-6, torch's to 1e-5: a real porting mistake
    # whose float32 error (~1e-5) sits near float32's tolerance. In float64 it fails for sure.
    with jax.enable_x64(True):
        block = nn.Sequential([nn.LayerNorm(), nn.Dense(8)])  # epsilon 1e-6
        x = torch.randn(4, 8, dtype=torch.float64)
        variables = jax.tree_util.tree_map(lambda a: a.astype(np.float64),
                                           flax_variables(block, np.zeros((4, 8), np.float32)))
        ours = FlaxModule(block, variables=variables)
        reference = torch.nn.Sequential(torch.nn.LayerNorm(8, dtype=torch.float64),
                                        torch.nn.Linear(8, 8, dtype=torch.float64))
        mapping = {"0": "layers_0", "1": "layers_1"}
        copy_weights(ours, reference, mapping)
        with pytest.raises(ParityError) as info:
            assert_matches(ours, reference, x, mapping=mapping)
        assert info.value.report.max_rel_error > 1e4 * TOLERANCES[torch.float64][0]
        reference[0].eps = 1e-6
        assert_matches(ours, reference, x, mapping=mapping)


def test_explicit_tolerances_override_the_dtype_defaults(example_pair):
    ours, _, mapping, x = example_pair
    reference = _reference(example_pair)
    assert not compare(ours, reference, x, mapping=mapping).failures
    with pytest.raises(ParityError):  # XLA and torch differ in the last bits
        assert_matches(ours, reference, x, mapping=mapping, rtol=0.0, atol=0.0)


def test_cotangent_options(example_pair):
    ours, _, mapping, x = example_pair
    reference = _reference(example_pair)
    assert_matches(ours, reference, x, mapping=mapping, cotangent="ones")
    assert_matches(ours, reference, x, mapping=mapping, cotangent=torch.randn(4, 8))
    with pytest.raises(ValueError, match="'cotangent' is 'sum'"):
        assert_matches(ours, reference, x, mapping=mapping, cotangent="sum")
    with pytest.raises(ValueError, match="'cotangent' has 2"):
        assert_matches(ours, reference, x, mapping=mapping, cotangent=(x, x))


def test_existing_grads_are_left_as_they_were(example_pair):
    ours, _, mapping, x = example_pair
    reference = _reference(example_pair)
    marker = torch.full_like(reference.up.weight, 7.0)
    reference.up.weight.grad = marker
    assert_matches(ours, reference, x, mapping=mapping)
    assert reference.up.weight.grad is marker and torch.all(marker == 7.0)
    assert all(p.grad is None for p in ours.parameters())


def test_names_that_differ_need_a_mapping(example_pair):
    ours, _, _, x = example_pair
    with pytest.raises(ValueError, match="mapping="):
        assert_matches(ours, _reference(example_pair), x)


def test_mapping_that_misses_a_parameter_is_refused(example_pair):
    ours, _, mapping, x = example_pair
    partial = {"up": "up", "down": "down", "norm.bias": "norm/bias", "norm.weight": None}
    with pytest.raises(ValueError, match=r"does not reach.*params\.norm\.scale"):
        assert_matches(ours, _reference(example_pair), x, mapping=partial)


class _Linear(torch.nn.Module):
    """One square ``torch.nn.Linear`` named ``lin``; each test's subclass gives ``forward``."""

    def __init__(self, n: int):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)


def test_output_structure_must_match():
    class Pair(_Linear):
        def forward(self, x):
            return self.lin(x), x * 2

    one = Pair(3)
    two = copy.deepcopy(one)
    two.forward = lambda x: two.lin(x)
    with pytest.raises(ValueError, match="ours returns 2 tensor"):
        assert_matches(one, two, torch.randn(2, 3))


@pytest.mark.parametrize(
    "dtype, delta, fails",
    [(torch.float64, 1e-8, True), (torch.float64, 1e-12, False),
     (torch.float32, 1e-8, False), (torch.float32, 1e-4, True),
     (torch.bfloat16, 2e-2, False), (torch.bfloat16, 0.5, True)],
    ids=["f64_1e-8_fails", "f64_1e-12_passes", "f32_1e-8_passes", "f32_1e-4_fails",
         "bf16_2e-2_passes", "bf16_0.5_fails"],
)
def test_tolerances_follow_the_dtype(dtype, delta, fails):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(6, 6, dtype=dtype), torch.nn.Tanh())
    reference = copy.deepcopy(ours)
    with torch.no_grad():
        reference[0].weight.copy_((reference[0].weight.double() * (1 + delta)).to(dtype))
    x = torch.randn(4, 6, dtype=dtype)
    report = compare(ours, reference, x)
    assert report.rows[0].rtol == TOLERANCES[dtype][0]
    assert (not report.ok) == fails, str(report)


def test_numerically_zero_reference_is_left_out_of_the_relative_error():
    class Centered(_Linear):  # the bias gradient is exactly zero in exact arithmetic
        def forward(self, x):
            y = self.lin(x)
            return y - y.mean(0, keepdim=True)

    ours = Centered(4)
    reference = copy.deepcopy(ours)
    report = assert_matches(ours, reference, torch.randn(3, 4))
    bias = next(r for r in report.rows if r.name == "grad of lin.bias")
    assert bias.ref_max <= bias.atol
    assert report.max_rel_error == max(r.norm_rel for r in report.rows if r is not bias)


def test_integer_outputs_must_be_equal():
    class WithArgmax(_Linear):
        def forward(self, x):
            y = self.lin(x)
            return y, y.argmax(-1)

    torch.manual_seed(0)
    ours = WithArgmax(3)
    reference = copy.deepcopy(ours)
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    report = assert_matches(ours, reference, x)
    assert report.rows[1].name == "output[1]" and report.rows[1].atol == 0.0
    assert len(set(ours(x)[1].tolist())) > 1
    with torch.no_grad():
        reference.lin.bias[0] += 100.0  # every argmax moves to 0
    assert "output[1]" in {r.name for r in compare(ours, reference, x).failures}


def test_nan_is_a_mismatch():
    ours = torch.nn.Linear(2, 2)
    reference = copy.deepcopy(ours)
    with torch.no_grad():
        reference.bias[0] = float("nan")
    with pytest.raises(ParityError, match="output"):
        assert_matches(ours, reference, torch.randn(3, 2))


# -- bfloat16: a correct twin passes, a wrong mapping fails -------------------------------------
MLP_MAPPING = {"norm": "LayerNorm_0", "fc1": "Dense_0", "fc2": "Dense_1"}


@pytest.fixture(scope="module")
def bf16_block():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    block = ResidualMLPBlock(16, dtype=jnp.bfloat16)
    variables = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16),
                                       flax_variables(block, np.zeros((4, 16), np.float32)))
    return FlaxModule(block, variables=variables), x


def test_bf16_twin_passes(bf16_block):
    ours, x = bf16_block
    reference = TorchResidualMLPBlock(16, torch.bfloat16)
    copy_weights(ours, reference, MLP_MAPPING)
    assert_matches(ours, reference, x, mapping=MLP_MAPPING)


@pytest.mark.parametrize("mistake", ["scale_and_bias_swapped", "rows_of_fc1_permuted"])
def test_bf16_wrong_weights_fail(bf16_block, mistake):
    ours, x = bf16_block
    reference = TorchResidualMLPBlock(16, torch.bfloat16)
    if mistake == "scale_and_bias_swapped":
        mapping = {"fc1": "Dense_0", "fc2": "Dense_1",
                   "norm.weight": "LayerNorm_0/bias", "norm.bias": "LayerNorm_0/scale"}
        copy_weights(ours, reference, mapping)
    else:  # a kernel read in the wrong order, e.g. (out, in) taken for (in, out)
        copy_weights(ours, reference, MLP_MAPPING)
        with torch.no_grad():
            reference.fc1.weight.copy_(reference.fc1.weight.flip(0))
    with pytest.raises(ParityError) as info:
        assert_matches(ours, reference, x, mapping=MLP_MAPPING)
    print(mistake, info.value.report.max_rel_error)
    assert info.value.report.max_rel_error > 10 * TOLERANCES[torch.bfloat16][0]
