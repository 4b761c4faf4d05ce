"""Tensor subclasses without memory of their own (a DTensor, a pickled DTensor): refused.

Such a wrapper reports address 0, and its ``__dlpack__`` exports a capsule over address 0
with the wrapper's shape, which JAX accepts: the forced-DLPack run of the sharded-block
test crashed in a pickled copy's call. Without the refusal each test here fails: on the
DLPack route JAX reads address 0 (the process crashes), on the views route numpy raises
its own ValueError about a NULL data pointer, which names nothing.
"""

import flax.linen as nn
import pytest
import torch
from torch.utils._pytree import tree_map

import bridge
from tests.support.closeness import route_fixture
from torchside import FlaxModule

_route = route_fixture()


class Wrapper(torch.Tensor):
    """A wrapper subclass as DTensor is one: no storage, results (``detach`` too) wrapped."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(lambda t: t.inner if isinstance(t, Wrapper) else t, args),
                   **tree_map(lambda t: t.inner if isinstance(t, Wrapper) else t,
                              kwargs or {}))
        return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


def _wrapped(device):
    w = Wrapper(torch.randn(4, 8, device=device))
    assert w.data_ptr() == 0 and w.detach().data_ptr() == 0  # what a DTensor reports
    return w


def test_to_jax_refuses_a_wrapper_by_name(route):
    with pytest.raises(TypeError, match=r"argument 'x' is a Wrapper .*no memory of its own"):
        bridge.to_jax(_wrapped(route), name="x")


def test_a_call_refuses_a_wrapper_argument(route):
    module = FlaxModule(nn.Dense(3), example_args=(torch.zeros(4, 8),)).to(route)
    with pytest.raises(TypeError, match=r"argument 'args\[0\]' is a Wrapper .*no memory"):
        module(_wrapped(route))


def test_a_call_refuses_a_wrapper_parameter_and_leaves_it(route):
    module = FlaxModule(nn.Dense(8), example_args=(torch.zeros(4, 8),)).to(route)
    x = torch.randn(4, 8, device=route)
    module(x)  # the parameters are held: the next call must see the new one
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    module.params.kernel = torch.nn.Parameter(Wrapper(before["params.kernel"].clone()))
    with pytest.raises(TypeError, match=r"variable 'params.kernel' is a Wrapper .*no memory"):
        module(x)
    assert torch.equal(module.params.kernel.inner, before["params.kernel"])
    assert torch.equal(module.params.bias, before["params.bias"])
