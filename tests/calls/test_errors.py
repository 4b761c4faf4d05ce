"""Errors at the edges say what was passed and how to fix it (issue 14)."""

import dataclasses
import re

import flax.linen as nn
import jax
import pytest
import torch

from torchside import FlaxModule, jax_function


def test_linen_without_example_args_says_what_to_pass():
    with pytest.raises(TypeError, match=r"example_args=") as info:
        FlaxModule(nn.Dense(3))
    message = str(info.value)
    assert "FlaxModule(Dense)" in message and "variables=" in message
    assert "'inputs'" in message  # Flax's own complaint is kept inside


@pytest.mark.parametrize(
    ("where", "build"),
    [("example_args[0]", lambda t: FlaxModule(nn.Dense(3), example_args=(t,))),
     ("example_kwargs['inputs']",
      lambda t: FlaxModule(nn.Dense(3), example_args=(), example_kwargs={"inputs": t}))],
    ids=["example_args", "example_kwargs"],
)
def test_float64_example_input_is_named(where, build):
    with pytest.raises(TypeError, match=re.escape(f"argument '{where}' is torch.float64")) as info:
        build(torch.zeros(2, 4, dtype=torch.float64))
    assert f"{where}.to(torch.float32)" in str(info.value)


@dataclasses.dataclass
class PlainOut:
    y: jax.Array


class ReturnsPlain(nn.Module):
    @nn.compact
    def __call__(self, x):
        return PlainOut(nn.Dense(2)(x))


@pytest.mark.parametrize(
    ("call", "where"),
    [(lambda x: jax_function(lambda x: PlainOut(x * 2))(x), "the output"),
     (lambda x: jax_function(lambda x: {"a": [x, PlainOut(x)]})(x), "output ['a'][1]"),
     (lambda x: FlaxModule(ReturnsPlain(), example_args=(x,))(x), "the output")],
    ids=["jax_function", "nested", "FlaxModule"],
)
def test_plain_dataclass_output_is_named(call, where):
    with pytest.raises(TypeError, match=re.escape(f"{where} of the function is a PlainOut")) as e:
        call(torch.ones(1, 2))
    assert "register PlainOut as a pytree" in str(e.value)
