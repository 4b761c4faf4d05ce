"""torchside.parity.copy_weights: a rule per torch module type, stacked layers, its errors.

The comparison itself (assert_matches, compare): parity/test_assert_matches.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.twins import ResidualMLPBlock, TorchResidualMLPBlock
from tests.support.twins_parity import flax_variables
from torchside import FlaxModule
from torchside.parity import (
    FlaxSource,
    copy_weights,
    nest_mapping,
    stack_mapping,
)


def flax_apply(module, variables, x) -> torch.Tensor:
    return torch.from_numpy(np.array(jax.jit(module.apply)(variables, jnp.asarray(x))))


# -- copy_weights: one rule per torch module type ---------------------------------------------
class TwoLayerLSTM(nn.Module):
    @nn.compact
    def __call__(self, x):
        for k in range(2):
            x = nn.RNN(nn.LSTMCell(4, name=f"cell{k}"))(x)
        return x


def _channels_last(module):
    """Runs a channels-first torch module on channels-last input, like Flax."""
    return lambda x: module(x.movedim(-1, 1)).movedim(1, -1)


RULE_CASES = {
    # name: (flax module, torch module, mapping, input, torch call)
    "linear": (nn.Dense(5), torch.nn.Linear(4, 5), {"": ""}, (3, 4), None),
    "dense_general_in_axes": (nn.DenseGeneral(5, axis=(-2, -1)), torch.nn.Linear(6, 5),
                              {"": ""}, (3, 2, 3), lambda m: lambda x: m(x.reshape(3, 6))),
    "conv1d": (nn.Conv(6, (3,), padding=1), torch.nn.Conv1d(4, 6, 3, padding=1), {"": ""},
               (2, 7, 4), _channels_last),
    "conv2d_strided": (nn.Conv(6, (3, 2), strides=2, padding=((1, 1), (0, 0))),
                       torch.nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0)), {"": ""},
                       (2, 7, 6, 4), _channels_last),
    "conv2d_groups": (nn.Conv(6, (3, 3), padding=1, feature_group_count=2),
                      torch.nn.Conv2d(4, 6, 3, padding=1, groups=2), {"": ""}, (2, 5, 5, 4),
                      _channels_last),
    "layernorm": (nn.LayerNorm(epsilon=1e-5), torch.nn.LayerNorm(4), {"": ""}, (3, 4), None),
    "rmsnorm": (nn.RMSNorm(epsilon=1e-5), torch.nn.RMSNorm(4, eps=1e-5), {"": ""}, (3, 4), None),
    "groupnorm": (nn.GroupNorm(num_groups=2, epsilon=1e-5), torch.nn.GroupNorm(2, 4),
                  {"": ""}, (2, 5, 4), _channels_last),
    "batchnorm_eval": (nn.BatchNorm(use_running_average=True, epsilon=1e-5),
                       torch.nn.BatchNorm1d(4).eval(), {"": ""}, (3, 4), None),
    "attention": (nn.MultiHeadDotProductAttention(2, qkv_features=8),
                  torch.nn.MultiheadAttention(8, 2, batch_first=True), {"": ""}, (2, 3, 8),
                  lambda m: lambda x: m(x, x, x, need_weights=False)[0]),
    "lstm_two_layers": (TwoLayerLSTM(), torch.nn.LSTM(3, 4, num_layers=2, batch_first=True),
                        {"": ["cell0", "cell1"]}, (2, 5, 3), lambda m: lambda x: m(x)[0]),
}


@pytest.mark.parametrize("case", list(RULE_CASES), ids=list(RULE_CASES))
def test_module_rule_reproduces_flax(case):
    flax_module, torch_module, mapping, shape, call = RULE_CASES[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    variables = flax_variables(flax_module, x.numpy())
    copy_weights(variables, torch_module, mapping)
    with torch.no_grad():
        got = (call(torch_module) if call else torch_module)(x)
    torch.testing.assert_close(got, flax_apply(flax_module, variables, x.numpy()))


def test_embedding_rule():
    embed, table = nn.Embed(10, 4), torch.nn.Embedding(10, 4)
    ids = np.array([[1, 7, 3]], np.int32)
    variables = flax_variables(embed, ids)
    copy_weights(variables, table, {"": ""})
    torch.testing.assert_close(table(torch.from_numpy(ids).long()).detach(),
                               flax_apply(embed, variables, ids))


def test_lstm_bias_ih_is_zero_and_bias_hh_holds_the_flax_biases():
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    variables = flax_variables(nn.RNN(nn.LSTMCell(4, name="cell")), np.zeros((1, 2, 3), np.float32))
    copy_weights(variables, lstm, {"": "cell"})
    assert torch.count_nonzero(lstm.bias_ih_l0) == 0
    biases = [variables["params"]["cell"][f"h{g}"]["bias"] for g in "ifgo"]
    torch.testing.assert_close(lstm.bias_hh_l0.detach(), torch.from_numpy(np.concatenate(biases)))


def test_tensor_entries_layouts_and_concatenation():
    variables = {"params": {"a": {"kernel": np.arange(6.0).reshape(2, 3)},
                            "b": {"kernel": np.arange(6.0, 12.0).reshape(2, 3)}}}
    linear = torch.nn.Linear(2, 6, bias=False, dtype=torch.float64)
    copy_weights(variables, linear, {"weight": [FlaxSource("a/kernel", layout="linear"),
                                                FlaxSource("b/kernel", layout="linear")]})
    expected = np.concatenate([variables["params"][k]["kernel"].T for k in "ab"])
    np.testing.assert_array_equal(linear.weight.detach().numpy(), expected)


def test_flaxmodule_and_variables_dict_fill_the_same_weights():
    x = torch.randn(2, 8)
    block = ResidualMLPBlock(8)
    variables = flax_variables(block, x.numpy())
    from_dict, from_module = TorchResidualMLPBlock(8), TorchResidualMLPBlock(8)
    mapping = {"norm": "LayerNorm_0", "fc1": "Dense_0", "fc2": "Dense_1"}
    copy_weights(variables, from_dict, mapping)
    copy_weights(FlaxModule(block, variables=variables), from_module, mapping)
    for (name, a), (_, b) in zip(from_dict.state_dict().items(),
                                 from_module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


# -- stacked scan variables -> per-layer torch modules ------------------------------------------
class DenseTanh(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(x.shape[-1])(x))


class RematScanDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(DenseTanh, lengths=(2, 3))(name="stack")(x)


def _torch_dense_stack(n):
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                 for _ in range(n)])


def test_stack_mapping_slices_layers_row_major():
    x = torch.randn(3, 4)
    variables = flax_variables(RematScanDense(), x.numpy())
    assert variables["params"]["stack"]["Dense_0"]["kernel"].shape == (2, 3, 4, 4)
    mapping = stack_mapping({"0": "Dense_0"}, "", "stack", (2, 3))
    assert mapping["4.0"] == FlaxSource("stack/Dense_0", layer=(1, 1))
    torch_stack = _torch_dense_stack(6)
    copy_weights(variables, torch_stack, mapping)
    expected = flax_apply(RematScanDense(), variables, x.numpy())
    torch.testing.assert_close(torch_stack(x).detach(), expected)
    # Layers taken in another order compute something else: the order is what is tested.
    reversed_map = {k.replace(f"{i}.", f"{5 - i}.", 1): v
                    for i in range(6) for k, v in mapping.items() if k.startswith(f"{i}.")}
    copy_weights(variables, torch_stack, reversed_map)
    assert not torch.allclose(torch_stack(x).detach(), expected, atol=1e-3)


def test_nest_mapping_prefixes_and_sets_the_layer():
    nested = nest_mapping({"fc": "Dense_0", "w": FlaxSource("k", layout="linear")}, "b.2",
                          "stack", layer=2)
    assert nested == {"b.2.fc": FlaxSource("stack/Dense_0", (2,)),
                      "b.2.w": FlaxSource("stack/k", (2,), "linear")}


# -- copy_weights: errors ---------------------------------------------------------------------
@pytest.fixture
def dense_pair():
    variables = flax_variables(nn.Dense(5), np.zeros((1, 4), np.float32))
    return variables, torch.nn.Linear(4, 5)


def test_unknown_torch_name_suggests_the_closest(dense_pair):
    variables, linear = dense_pair
    with pytest.raises(KeyError, match=r"'wieght'.*Closest names: \['weight'\]"):
        copy_weights(variables, linear, {"wieght": "kernel"})


def test_unknown_flax_path_suggests_the_closest(dense_pair):
    variables, linear = dense_pair
    with pytest.raises(KeyError, match=r"'kernal'.*for torch 'weight'.*Closest: \['kernel'"):
        copy_weights(variables, linear, {"weight": "kernal", "bias": "bias"})


def test_shape_mismatch_names_both_sides():
    variables = flax_variables(nn.Dense(5), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"torch 'weight' wants shape \[6, 4\].*kernel"):
        copy_weights(variables, torch.nn.Linear(4, 6), {"": ""})


def test_container_without_rule_says_how_to_map_it(dense_pair):
    variables, _ = dense_pair
    with pytest.raises(ValueError, match=r"Sequential, which has no built-in rule.*Conv1d/2d/3d"):
        copy_weights(variables, torch.nn.Sequential(torch.nn.Linear(4, 5)), {"": ""})


def test_strict_requires_every_torch_tensor(dense_pair):
    variables, linear = dense_pair
    with pytest.raises(ValueError, match=r"unfilled: 'bias'"):
        copy_weights(variables, linear, {"weight": FlaxSource("kernel", layout="linear")})
    copy_weights(variables, linear, {"weight": FlaxSource("kernel", layout="linear")},
                 strict=False)


def test_strict_requires_every_flax_layer():
    variables = flax_variables(RematScanDense(), np.zeros((3, 4), np.float32))
    shallow = _torch_dense_stack(5)
    mapping = {f"{i}.0": FlaxSource("stack/Dense_0", layer=np.unravel_index(i, (2, 3)))
               for i in range(5)}
    with pytest.raises(ValueError, match=r"reads no torch tensor from 2 Flax.*kernel \(16 "):
        copy_weights(variables, shallow, mapping)


def test_layer_out_of_range():
    variables = flax_variables(RematScanDense(), np.zeros((3, 4), np.float32))
    with pytest.raises(IndexError, match=r"layer \(2, 0\).*leading axes are \[2, 3\]"):
        copy_weights(variables, _torch_dense_stack(1), {"0.0": FlaxSource("stack/Dense_0", (2, 0))},
                     strict=False)


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="layout.*'transpose'"):
        FlaxSource("kernel", layout="transpose")


def test_a_tensor_filled_twice_is_refused(dense_pair):
    variables, linear = dense_pair
    with pytest.raises(ValueError, match="'weight' is filled twice"):
        copy_weights(variables, linear, {"": "", "weight": FlaxSource("kernel", layout="linear")})


def test_nothing_is_written_when_an_entry_fails(dense_pair):
    variables, linear = dense_pair
    before = {k: v.clone() for k, v in linear.state_dict().items()}
    bad = {"bias": "bias", "weight": "bias"}  # the bias cannot fill the weight
    with pytest.raises(ValueError):
        copy_weights(variables, linear, bad)
    for k, v in linear.state_dict().items():
        assert torch.equal(v, before[k]), k
