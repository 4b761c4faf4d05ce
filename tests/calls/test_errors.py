"""Errors name the function, the argument and what it received, and say how to fix it.

Elsewhere, beside what they are about: a Flax shape error, an input on another device than
the parameters and an unhashable static argument (module/test_module.py); an unhashable
static argument and a module returning a Flax Module (calls/test_jax_function.py); dtypes
bridge.to_jax refuses (exchange/test_convert.py); tensors on devices JAX cannot reach
(devices/test_devices.py).
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import torch

from tests.support.twins import residual_block_module
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


def test_rank_jax_rejects_keeps_its_type_and_gets_our_names_and_shapes():
    f = jax_function(lambda x, w: jnp.einsum("bi,io->bo", x, w))
    with pytest.raises(ValueError, match="subscript") as err:
        f(torch.randn(2, 3, 4), torch.randn(4, 5))
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "args[0]: torch.float32[2, 3, 4], args[1]: torch.float32[4, 5]" in notes
    torch.testing.assert_close(f(torch.ones(2, 4), torch.ones(4, 5)), torch.full((2, 5), 4.0))


@pytest.mark.parametrize(
    ("dtype", "expected"),
    # int64 arguments are narrowed to int32 (exchange/test_int64_ids.py); float64 never is.
    [(torch.float8_e4m3fnuz, "JAX cannot hold"), (torch.float64, "64-bit")],
    ids=["float8-fnuz", "float64-without-x64"],
)
def test_dtype_jax_cannot_hold_names_argument_and_module(dtype, expected):
    m = residual_block_module()
    with pytest.raises(TypeError, match=rf"argument 'args\[0\]'.*{expected}") as err:
        m(torch.zeros(2, 8).to(dtype))
    assert "FlaxModule(ResidualMLPBlock) was called with args[0]" in "".join(err.value.__notes__)


def test_inputs_on_two_devices_without_parameters_name_both():
    f = jax_function(lambda a, b: a + b)
    with pytest.raises(ValueError, match=r"args\[1\] is on meta, but args\[0\] is on cpu"):
        f(torch.zeros(2), torch.zeros(2, device="meta"))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x: (x, "label"), r"output \[1\] of the function is a str"),
        (lambda x: {"y": x, "obj": object()}, r"output \['obj'\] of the function is a object"),
        (lambda x: (x, jax.random.key(0)), r"output \[1\].*typed PRNG key.*key_data"),
        (lambda x: (x, x.astype(jnp.int4)), r"output \[1\] has dtype int4.*torch cannot hold"),
    ],
    ids=["string", "python-object", "prng-key", "int4"],
)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_outputs_torch_cannot_hold_are_named_by_path(make, match, grad):
    f = jax_function(make)
    with pytest.raises(TypeError, match=match):
        f(torch.randn(3, requires_grad=grad))
