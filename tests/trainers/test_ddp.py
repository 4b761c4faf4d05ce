"""DistributedDataParallel over a model that holds a FlaxModule: 2 ranks against 1 process.

On CPU (gloo, loopback), also with each rank's JAX default device elsewhere than its
tensors (two host devices, the default set to the second): the ``torchrun`` case, where
rank ``r`` works on ``cuda:r`` and JAX's default device is GPU 0 in every rank. With two
GPUs the same run goes over NCCL on ``cuda:0`` and ``cuda:1``. Each run also trains the
same model with its loss inside one FlaxModule (the scalar-loss route) under DDP with
``gradient_as_bucket_view=True``: it must end where the first model ends.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.support import ROOT
from tests.support.ddp_worker import build
from tests.support.ranks import run_reference, run_two_ranks

pytestmark = pytest.mark.processes  # gloo ranks: alone under pytest-xdist (conftest)

WORKER = ROOT / "tests" / "support" / "ddp_worker.py"
ELSEWHERE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
             "FLAXTORCH_TEST_JAX_DEFAULT": "cpu:1"}
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.parametrize("env", [
    pytest.param({}, id="gloo"),
    pytest.param(ELSEWHERE, id="gloo-jax-default-elsewhere"),
    pytest.param({"FLAXTORCH_TEST_DDP_BACKEND": "nccl"}, id="nccl",
                 marks=[pytest.mark.gpu, TWO_GPUS]),
])
def test_two_process_ddp_equals_single_process_full_batch(env, tmp_path):
    """Catches a rank computing on another device than its tensors' (the ``torchrun`` case),
    a wrong all-reduce of the bridge's gradients, and the loss-inside model falling back
    from its fused program."""
    out_ddp, out_ref = tmp_path / "ddp.pt", tmp_path / "ref.pt"
    # The reference: one process, JAX's default device left alone (on the GPU run, cuda:0).
    ref = run_reference(WORKER, out_ref, {k: v for k, v in env.items()
                                          if k == "FLAXTORCH_TEST_DDP_BACKEND"})
    assert ref.returncode == 0, ref.stderr[-3000:]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    for code, log in zip(run_two_ranks(WORKER, out_ddp, logs, env), logs, strict=True):
        assert code == 0, log.read_text()[-3000:]
    ddp = torch.load(out_ddp, weights_only=True)
    ref = torch.load(out_ref, weights_only=True)
    assert set(ddp) == set(ref) and any("stack" in k for k in ddp)
    initial = build().state_dict()
    for name in ref:
        # Both sides run the same programs on one backend; the all-reduce sums in another
        # order than the full batch does, so allow float32 rounding.
        torch.testing.assert_close(ddp[name], ref[name], msg=name)
        assert not torch.equal(ref[name], initial[name]), f"{name} did not train"
    # The loss-inside model: DDP against one process, and against the first model (the same
    # function and initial weights, its loss in torch): float32 rounding apart.
    loss_ddp = torch.load(f"{out_ddp}.loss", weights_only=True)
    loss_ref = torch.load(f"{out_ref}.loss", weights_only=True)
    # It took the fused route in every process: value_and_grad, no backward program.
    for routes in [f"{out_ref}.loss.routes.0.json", f"{out_ddp}.loss.routes.0.json",
                   f"{out_ddp}.loss.routes.1.json"]:
        assert json.loads(Path(routes).read_text()) == ["value_and_grad"], routes
    assert set(loss_ddp) == set(loss_ref)
    for name in loss_ref:
        torch.testing.assert_close(loss_ddp[name], loss_ref[name], msg=name)
    for state in (loss_ref, loss_ddp):
        as_first = {"0.weight": state["params.inp.kernel"].T, "0.bias": state["params.inp.bias"],
                    "2.weight": state["params.out.kernel"].T, "2.bias": state["params.out.bias"]}
        as_first.update({k.replace("params.block.", "1.params."): v
                         for k, v in state.items() if k.startswith("params.block.")})
        assert set(as_first) == set(ref)
        for name, value in ref.items():
            torch.testing.assert_close(as_first[name], value, rtol=1e-5,
                                       atol=1e-6 * float(value.abs().max()), msg=name)
