"""FSDP2 (``fully_shard``, gloo, 2 CPU processes) over a model that holds a FlaxModule.

FSDP2 frees each unsharded parameter with ``storage.resize_(0)`` after use, so every tensor
that crossed into JAX must stay resizable (issue 15). The pure-torch twin, from the same
initial weights, runs in the same processes as the control, and so does the whole model
with its loss in one FlaxModule (the scalar-loss route, whose gradients reach ``.grad`` as
buffers JAX computed in the forward).
"""

from pathlib import Path

import pytest
import torch

from tests.ranks import run_reference, run_two_ranks

WORKER = Path(__file__).with_name("fsdp2_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs the reference, then the two ranks; ``load(run, kind)`` gives a kind's states."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    ref = run_reference(WORKER, tmp / "ref")
    logs = [tmp / f"rank{rank}.log" for rank in range(2)]
    codes = run_two_ranks(WORKER, tmp / "sharded", logs)
    failures = {"ref": ref.stderr, "sharded": "".join(
        f"rank {rank} exited with {code}:\n{log.read_text()[-3000:]}"
        for rank, (code, log) in enumerate(zip(codes, logs, strict=True)) if code)}

    def load(run, kind):
        path = tmp / f"{run}.{kind}.pt"
        assert path.exists(), f"the {run} run did not finish {kind}: {failures[run][-3000:]}"
        return torch.load(path, weights_only=True)

    return load


@pytest.mark.parametrize("kind", ["torch", "flax", "flax-loss"],
                         ids=["torch-control", "flax", "flax-loss-inside"])
def test_fully_shard_on_two_ranks_equals_single_process_full_batch(runs, kind):
    sharded, reference = runs("sharded", kind), runs("ref", kind)
    assert set(sharded["final"]) == set(reference["final"])
    torch.testing.assert_close(sharded["initial"], reference["initial"], rtol=0, atol=0)
    torch.testing.assert_close(sharded["final"], reference["final"])
    for name, value in reference["final"].items():
        assert not torch.equal(value, reference["initial"][name]), f"{name} did not train"


def test_the_flax_model_trains_like_its_torch_twin(runs):
    """The reference itself: the Flax block and its torch twin end with the same weights."""
    flax, twin = runs("ref", "flax")["final"], runs("ref", "torch")["final"]
    as_torch = {k: v for k, v in flax.items() if not k.startswith("1.")}
    for i in range(2):
        as_torch[f"1.l{i + 1}.weight"] = flax[f"1.params.Dense_{i}.kernel"].T
        as_torch[f"1.l{i + 1}.bias"] = flax[f"1.params.Dense_{i}.bias"]
    assert set(as_torch) == set(twin)
    for name, value in twin.items():  # float32 across two libraries: scale with magnitude
        torch.testing.assert_close(as_torch[name], value, rtol=1e-5,
                                   atol=1e-6 * float(value.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_loss_inside_model_trains_like_the_torch_twin(runs):
    """The scalar-loss route, sharded and not, against the pure-torch control."""
    twin = runs("ref", "torch")["final"]
    for run in ("ref", "sharded"):
        flax = runs(run, "flax-loss")["final"]
        as_torch = {}
        for torch_name, flax_name in (("0", "inp"), ("1.l1", "block.Dense_0"),
                                      ("1.l2", "block.Dense_1"), ("2", "out")):
            as_torch[f"{torch_name}.weight"] = flax[f"params.{flax_name}.kernel"].T
            as_torch[f"{torch_name}.bias"] = flax[f"params.{flax_name}.bias"]
        assert set(as_torch) == set(twin)
        for name, value in twin.items():
            torch.testing.assert_close(as_torch[name], value, rtol=1e-5,
                                       atol=1e-6 * float(value.abs().max()),
                                       msg=lambda m, name=name, run=run: f"{run} {name}: {m}")
