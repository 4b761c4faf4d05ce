"""Devices: programs run where the tensors are, never where JAX's default device is.

The cases themselves (FlaxModule Linen/NNX in train and eval with buffers and dropout,
jax_function, remat_stack, residuals="recompute", torch.compile and memory_report) live in
``tests/devices/cases.py``; here they run in a subprocess with two host devices and JAX's
default device set to the one the tensors are not on, on both exchange routes. The rest
of this file checks the device table and tensors on devices JAX cannot share memory with.
"""

from types import SimpleNamespace

import flax.linen as nn
import pytest
import torch

import bridge
from bridge import _devices
from tests.support import ROOT, pytest_in_subprocess, subprocess_env
from tests.support.twins import TanhMLP
from torchside import FlaxModule, jax_function


@pytest.mark.parametrize("exchange", ["auto", "dlpack"])
def test_every_case_on_two_host_devices_with_the_default_elsewhere(exchange, tmp_path):
    env = subprocess_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                          "FLAXTORCH_TEST_JAX_DEFAULT": "cpu:1",
                          "FLAXTORCH_TEST_TORCH_DEVICE": "cpu", "FLAXTORCH_EXCHANGE": exchange})
    code, out, counts = pytest_in_subprocess(ROOT / "tests" / "devices" / "cases.py", env,
                                             tmp_path / "cases.log")
    assert code == 0, out[-6000:]
    assert set(counts) == {"passed"} and counts["passed"] >= 18, counts  # no skip, no xfail


# -- the device table -------------------------------------------------------------------
def _fake_gpu(hardware_id: int):
    return SimpleNamespace(platform="gpu", id=10 + hardware_id, local_hardware_id=hardware_id)


@pytest.fixture
def gpus(monkeypatch):
    """Replaces the JAX GPUs the table sees (the table's cache is cleared around it)."""
    def use(devices):
        monkeypatch.setattr(_devices, "_gpu_devices", lambda: tuple(devices))
        _devices.jax_device.cache_clear()

    yield use
    _devices.jax_device.cache_clear()


def test_cuda_index_is_the_jax_gpu_with_that_hardware_id(gpus):
    first, second = _fake_gpu(1), _fake_gpu(0)  # JAX's order need not be CUDA's
    gpus([first, second])
    assert bridge.jax_device(torch.device("cuda", 0)) is second
    assert bridge.jax_device(torch.device("cuda", 1)) is first
    assert bridge.torch_device(first) == torch.device("cuda", 1)


def test_cpu_is_jax_cpu_backend_even_where_the_default_backend_is_a_gpu(gpus):
    gpus([_fake_gpu(0)])
    assert bridge.jax_device(torch.device("cpu")).platform == "cpu"


def test_a_jax_without_gpus_names_the_install(gpus):
    gpus([])
    with pytest.raises(ValueError, match=r"argument 'x' is on cuda:0, but this JAX has no "
                                         r"GPU backend.*pip install -U 'jax\[cuda\d+\]'"):
        bridge.jax_device(torch.device("cuda", 0), name="x")


def test_a_gpu_jax_does_not_see_names_cuda_visible_devices(gpus):
    gpus([_fake_gpu(0)])
    with pytest.raises(ValueError, match=r"cuda:3, but JAX sees the GPUs \[0\] only.*"
                                         r"CUDA_VISIBLE_DEVICES"):
        bridge.jax_device(torch.device("cuda", 3), name="x")


def test_to_jax_names_itself_and_the_argument():
    with pytest.raises(ValueError, match=r"to_jax: argument 'w' is on meta"):
        bridge.to_jax(torch.empty(2, device="meta"), name="w")


def test_new_modules_follow_torchs_default_device():
    assert bridge.internal.default_torch_device() == torch.device("cpu")
    with torch.device("meta"):  # shapes only: tests/module/test_deferred_init.py
        assert bridge.internal.default_torch_device() == torch.device("meta")
        m = FlaxModule(nn.Dense(3), example_args=(torch.zeros(1, 2, device="cpu"),))
    assert {p.device for p in m.parameters()} == {torch.device("meta")}


# -- tensors on devices the call does not run on ------------------------------------------
def test_a_parameter_moved_behind_the_modules_back_is_refused_by_name():
    m = FlaxModule(TanhMLP(4, 3), example_args=(torch.zeros(2, 5),))
    x = torch.randn(2, 5)
    m(x).sum().backward()  # held arrays and a cached signature exist
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.params.Dense_1.to("meta")  # a part of the module: FlaxModule's own .to() never runs
    with pytest.raises(ValueError, match=r"params\.Dense_1\.bias is on meta, but the "
                                         r"module's parameters are on cpu"):
        m(x)
    m.params.Dense_1.to_empty(device="cpu")
    m.load_state_dict(before)
    after = m.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    fresh = FlaxModule(TanhMLP(4, 3), example_args=(torch.zeros(2, 5),))
    torch.testing.assert_close(m(x), fresh(x))


def test_parameters_all_on_a_device_jax_cannot_reach_are_refused_by_name():
    m = FlaxModule(TanhMLP(4, 3), example_args=(torch.zeros(2, 5),)).to("meta")
    with pytest.raises(ValueError, match=r"FlaxModule\(TanhMLP\): argument 'params\.Dense_0\.bias' "
                                         r"is on meta, which holds shapes but no values"):
        m(torch.randn(2, 5, device="meta"))


def test_jax_function_arguments_on_two_devices_are_refused_by_name():
    f = jax_function(lambda a, b: a * b)
    with pytest.raises(ValueError, match=r"args\[1\] is on meta, but args\[0\] is on cpu"):
        f(torch.ones(2), torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"jax_function\(<lambda>\): argument 'args\[0\]' is "
                                         r"on meta"):
        f(torch.ones(2, device="meta"), torch.ones(2, device="meta"))


def test_a_saved_tensor_hook_that_moves_tensors_away_is_refused():
    m = FlaxModule(TanhMLP(4, 3), example_args=(torch.zeros(2, 5),))
    x = torch.randn(2, 5, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                  lambda t: torch.empty_like(t, device="meta")):
        y = m(x)
    with pytest.raises(ValueError, match=r"a tensor on meta reached a call that runs on cpu.*"
                                         r"unpack hook must move them back"):
        y.sum().backward()
