"""DeepXDE (pytorch backend) trains a PINN whose trunk is a FlaxModule.

DeepXDE's PDE loss is built from ``dde.grad.hessian`` of the network in its inputs, so
each Adam step needs the third derivative of the call: refused by the bridge before
derivatives of any order (NOTE [Higher order]). ``tests/support/deepxde_worker.py`` runs
DeepXDE once with the trunk as a FlaxModule over ``nn.remat_scan`` and once as its torch
twin from the same weights, each in a process of its own; their loss histories and their
parameter updates must agree. DeepXDE is the optional extra ``flaxtorch[deepxde]``, which
CI installs.
"""

import subprocess
import sys

import pytest
import torch

from tests.support import ROOT, subprocess_env

WORKER = ROOT / "tests" / "support" / "deepxde_worker.py"


def _run(kind: str, out) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), kind, str(out)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_deepxde_trains_a_pinn_through_a_flax_trunk_like_its_torch_twin(tmp_path):
    pytest.importorskip("deepxde")
    flax, twin = (_run(kind, tmp_path / f"{kind}.pt") for kind in ("flax", "torch"))
    assert set(flax["final"]) == set(twin["final"]) and len(twin["final"]) == 12
    for name, value in twin["initial"].items():
        assert torch.equal(flax["initial"][name], value), name
    # Float32 in two libraries, through a Laplacian: relative to what is compared.
    torch.testing.assert_close(flax["loss"], twin["loss"], rtol=1e-3, atol=0)
    assert float(twin["loss"][-1].sum()) < 0.5 * float(twin["loss"][0].sum()), "not trained"
    for name, value in twin["final"].items():
        step = value - twin["initial"][name]
        scale = float(step.abs().max())
        assert scale > 0, f"{name} did not train"
        torch.testing.assert_close(flax["final"][name] - flax["initial"][name], step, rtol=0,
                                   atol=1e-2 * scale, msg=lambda m, name=name: f"{name}: {m}")
