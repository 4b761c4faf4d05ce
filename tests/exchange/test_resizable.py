"""Tensors that crossed into JAX stay resizable, as FSDP2 and ``out=`` need (issue 15).

``tensor.numpy()`` marks a storage non-resizable for good; the bridge must not use it. Each
check runs on the default exchange and on the DLPack route CUDA takes.
"""

import flax.linen as nn
import pytest
import torch

import bridge
from torchside import FlaxModule


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(6)(x))
        return nn.Dense(3)(nn.tanh(x))


@pytest.fixture(params=["auto", "dlpack"])
def exchange(request):
    previous = bridge.set_exchange_mode(request.param)
    yield request.param
    bridge.set_exchange_mode(previous)


def _module():
    return FlaxModule(Net(), example_args=(torch.zeros(2, 4),), train_kwarg="train")


def _step(m, x, ct):
    """A train-mode forward and backward; returns the output and every gradient."""
    m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = m(x)
    y.backward(ct)
    return y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


def test_inputs_stay_resizable_after_a_call(exchange):
    m = _module()
    plain = torch.randn(8, 4)
    needs_grad = torch.randn(8, 4, requires_grad=True)
    y = m(plain) + m(needs_grad)
    y.backward(torch.randn_like(y))
    m.eval()
    with torch.no_grad():
        expected = m(torch.arange(64.0).reshape(16, 4).div(64))
        for x in (plain, needs_grad.detach()):
            torch.randn(16, 4, out=x)  # grows the storage the call read
            assert x.shape == (16, 4)
            x.copy_(torch.arange(64.0).reshape(16, 4).div(64))
            torch.testing.assert_close(m(x), expected, rtol=0, atol=0)
            x.untyped_storage().resize_(0)


def test_parameters_and_buffers_can_be_freed_and_refilled_as_fsdp2_does(exchange):
    m = _module()
    x, ct = torch.randn(8, 4), torch.randn(8, 3)
    _step(m, torch.randn(8, 4), ct)  # compiled programs and held arrays exist now
    state = {k: v.clone() for k, v in m.state_dict().items()}
    y0, gx0, g0 = _step(m, x, ct)
    m.load_state_dict(state)  # the train step moved the batch statistics
    tensors = [*m.parameters(), *m.buffers()]
    for t in tensors:  # free every variable's memory, as FSDP2 does after a forward
        t.untyped_storage().resize_(0)
    for t in tensors:
        t.untyped_storage().resize_(t.numel() * t.element_size())
    with torch.no_grad():
        for k, v in state.items():
            m.get_parameter(k).copy_(v) if k.startswith("params") else m.get_buffer(k).copy_(v)
    y1, gx1, g1 = _step(m, x, ct)
    torch.testing.assert_close((y1, gx1, g1), (y0, gx0, g0), rtol=0, atol=0)

    # Freed again and refilled with other values: the call reads the new ones.
    other = {k: 2 * v for k, v in state.items()}
    for t in tensors:
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(t.numel() * t.element_size())
    m.load_state_dict(other)
    reference = _module()
    reference.load_state_dict(other)
    torch.testing.assert_close(_step(m, x, ct), _step(reference, x, ct))


@pytest.mark.xfail(raises=RuntimeError, strict=True,
                   reason="known limit: outputs and gradients are zero-copy views of JAX "
                          "buffers, whose storage torch cannot resize (README, trainers)")
@pytest.mark.parametrize("what", ["output", "gradient"])
def test_outputs_and_gradients_from_jax_are_not_resizable(what):
    m = _module()
    y = m(torch.randn(8, 4))
    y.backward(torch.randn_like(y))
    t = y.detach() if what == "output" else m.params.Dense_0.kernel.grad
    torch.randn(64, out=t)
