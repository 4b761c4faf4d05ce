"""Flax names containing a dot are refused, naming the path (issue 14).

torch joins state_dict names with ``.``: ``params['a.kernel']['bias']`` and
``params['a']['kernel']['bias']`` would both read ``params.a.kernel.bias``, one silently
replacing the other. The refusal must name the Flax path; a clean name still works.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from torchside import FlaxModule


class TwoDense(nn.Module):
    """``Dense(name=first)`` beside ``Dense(name="a")``: with first='a.kernel' they collide."""

    first: str = "a.kernel"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name=self.first)(x) + nn.Dense(3, name="a")(x)


class DottedParam(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = self.param("a.kernel", nn.initializers.ones, (4, 3))
        return x @ k + nn.Dense(3, name="a", use_bias=False)(x)


class DottedDict(nnx.Module):
    def __init__(self):
        self.d = nnx.Dict({"a.b": nnx.Param(jnp.ones(4)),
                           "a": nnx.Dict({"b": nnx.Param(jnp.ones(4))})})

    def __call__(self, x):
        return x * self.d["a.b"][...] + x * self.d["a"]["b"][...]


def _variables(module):
    return module.init(jax.random.key(0), jnp.ones((2, 4)))


CASES = {
    "linen-submodule": (lambda: FlaxModule(TwoDense(), example_args=(torch.ones(2, 4),)),
                        "('params', 'a.kernel', 'bias')"),
    "linen-param": (lambda: FlaxModule(DottedParam(), example_args=(torch.ones(2, 4),)),
                    "('params', 'a.kernel')"),
    "linen-variables=": (lambda: FlaxModule(TwoDense(), variables=_variables(TwoDense())),
                         "('params', 'a.kernel', 'bias')"),
    "nnx-dict-key": (lambda: FlaxModule(DottedDict()), "('d', 'a.b')"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dotted_names_are_refused_naming_the_path(case):
    build, path = CASES[case]
    with pytest.raises(ValueError, match=re.escape(path)) as info:
        build()
    assert "Rename" in str(info.value)


def test_a_clean_name_keeps_every_leaf_and_matches_flax():
    module = TwoDense(first="a_kernel")
    variables = _variables(module)
    m = FlaxModule(module, variables=variables)
    assert len(list(m.parameters())) == len(jax.tree_util.tree_leaves(variables)) == 4
    x = torch.randn(2, 4)
    want = module.apply(variables, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(m(x).detach().numpy(), np.asarray(want), rtol=1e-6, atol=1e-6)
