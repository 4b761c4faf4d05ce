"""Every script in examples/ and examples/bench/ runs, at a tiny size, in a fresh process (so
they never rot)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Tiny-size arguments per example, by its path under examples/; ``{out}`` becomes a temporary
# folder. A new example must be added here: test_example_runs fails for it until it is.
TINY_ARGS = {
    "quickstart.py": ["--steps", "5"],
    "bench/call_costs.py": ["--tensors", "16", "--repeats", "2"],
    "bench/dp_norms.py": ["--smoke"],
    "bench/shared_linearization.py": ["--smoke"],
    "bench/packing.py": ["--smoke"],
    "bench/collectives.py": [],  # one layer's collectives, 2 gloo processes: seconds
    "bench/shard2d.py": ["--quick"],  # a 4-layer block on a 2x2 mesh, 4 gloo processes
    "gpu_check.py": [],
    "stack_speed.py": ["--depth", "16", "--width", "16", "--batch", "4",
                       "--rounds", "1"],  # without a GPU it says so and exits 0
    "train_digits.py": ["--depth", "8", "--epochs", "1", "--limit", "128", "--batch", "32"],
    "train_dp.py": ["--depth", "4", "--epochs", "1", "--limit", "128", "--batch", "32"],
    # The benchmark's parts in two runs: its sharded part starts gloo ranks, so it runs
    # alone under pytest-xdist (conftest); the others run beside the other worker's tests.
    "bench/benchmark.py": ["--smoke", "--out", "{out}", "--only",
                           "tiny,medium,deep,leaves,lm,higher,dp,sweep,leafsweep"],
    "bench/benchmark.py:shard": ["--smoke", "--out", "{out}", "--only", "shard"],
    "exit_aborts.py": ["--runs", "1"],
    "pinn.py": ["--steps", "40", "--points", "64", "--out", "{out}"],
    "train_sharded.py": ["--steps", "3", "--lengths", "2", "2", "--width", "16",
                         "--batch", "8", "--out", "{out}/checkpoint"],
    "train_lm.py": ["--steps", "30", "--layers", "2", "--width", "32", "--heads", "2",
                    "--batch", "8", "--context", "16", "--eval-batches", "2",
                    "--sample-chars", "40", "--log-every", "10"],
}


# Examples started by a launcher, as their docstrings say: torchrun's module, 2 processes.
LAUNCHERS = {
    "train_sharded.py": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
}


def _scripts() -> list[str]:
    """The user examples and the benchmark harness's scripts (its ``_`` modules are imports)."""
    paths = [*EXAMPLES.glob("*.py"), *(EXAMPLES / "bench").glob("*.py")]
    return sorted(p.relative_to(EXAMPLES).as_posix() for p in paths
                  if not p.name.startswith("_"))


def _run(name: str, tmp_path) -> subprocess.CompletedProcess:
    """Runs the example ``name`` (``script`` or ``script:part``) at its tiny size."""
    args = [a.format(out=tmp_path) for a in TINY_ARGS[name]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE", MPLBACKEND="Agg")
    script = name.partition(":")[0]
    done = subprocess.run(
        [sys.executable, *LAUNCHERS.get(script, []), str(EXAMPLES / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # Warnings in an example are bugs a user would see; tqdm's bar also goes to stderr.
    warnings = [line for line in done.stderr.splitlines() if "Warning" in line]
    assert not warnings, f"{name} printed warnings:\n" + "\n".join(warnings)
    return done


def _check_train_digits(done, out) -> None:
    assert "held-out accuracy" in done.stdout
    held = re.search(r"([\d.]+) MiB with remat_scan .*, ([\d.]+) MiB for the same", done.stdout)
    assert held, done.stdout
    assert float(held.group(1)) < float(held.group(2))


def _check_train_dp(done, out) -> None:
    epsilon = re.search(r"held-out accuracy ([\d.]+)  epsilon ([\d.]+)", done.stdout)
    assert epsilon, done.stdout
    assert 0 < float(epsilon.group(2)) <= 4.0 + 1e-6, done.stdout  # the default budget


def _check_train_lm(done, out) -> None:
    losses = [float(x) for x in re.findall(r"^step +\d+/\d+  loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 4, done.stdout  # steps 1, 10, 20, 30
    assert losses[-1] < losses[0] - 0.5, losses  # from chance (ln 256 = 5.5) towards the text
    assert re.search(r"^held-out loss [\d.]+ ", done.stdout, re.M), done.stdout
    held = re.search(r"([\d.]+) MiB with remat_stack, ([\d.]+) MiB for the same", done.stdout)
    assert held, done.stdout
    assert float(held.group(1)) < float(held.group(2))
    # The prompt and 40 sampled characters between the two rules.
    sample = re.search(r"^-{60}\n(.*?)\n-{60}$", done.stdout, re.M | re.S)
    assert sample and sample.group(1).startswith("Return a "), done.stdout
    assert len(sample.group(1)) >= len("Return a ") + 20, sample.group(1)


def _check_benchmark(done, out) -> None:
    for png in ("held_bytes_vs_depth.png", "time_vs_depth.png", "compile_vs_depth.png",
                "time_vs_leaves.png"):
        assert (out / png).stat().st_size > 1000, png
    results = json.loads((out / "results.json").read_text())
    names = {r["name"] for r in results["workloads"]}
    assert {"TINY", "MEDIUM", "DEEP", "LEAVES", "TINY sync"} <= names
    for r in results["workloads"]:
        # Same weights, same inputs: the three contestants compute one function.
        assert max(r["mismatch"].values()) < 1e-4, r["name"]
    assert all(row["mismatch"] < 1e-4 for row in results["sweep"])
    deepest = results["sweep"][-1]["held"]
    assert deepest["remat_scan x2"] < deepest["torch ckpt_seq"] < deepest["torch"]
    assert deepest["remat_scan x3"] <= deepest["remat_scan x2"] < deepest["scan"]
    leaves = results["leaf_sweep"]
    assert leaves["counts"] == [1, 4] and leaves["mismatch"] < 1e-4
    assert set(leaves["per_leaf"]) == {"bridge", "pure JAX", "torch"}
    assert "Targets" in done.stdout
    (dp,) = results["dp"]  # DP-SGD through Opacus: one noiseless step agrees with pure JAX
    assert max(dp["mismatch"].values()) < 1e-4 and set(dp["times"]) == {
        "bridge", "bridge ghost", "torch", "torch ghost", "pure JAX"}, dp
    lm = {r["name"]: r for r in results["lm"]}
    assert "own Linen GPT-2" in lm
    for r in lm.values():  # the JAX routes compute one loss
        assert r["mismatch"] < 1e-5 and set(r["times"]) == {
            "pure JAX", "pure JAX split", "pure JAX split, dots",
            "no bridge: JAX + torch loss", "no bridge: JAX dots + torch loss",
            "bridge, loss in torch",
            "bridge, loss in torch, remat dots", "bridge, loss inside", "torch eager"}, r
        # The remat policy that keeps matmul outputs only holds less than keeping all.
        assert r["held"]["remat dots"] < r["held"]["plain"], r
    higher = {r["name"]: r for r in results["higher"]}
    assert set(higher) == {"PENALTY", "PINN"}
    for r in higher.values():  # same weights and points: one set of parameter gradients
        assert max(r["mismatch"].values()) < 1e-4, r["mismatch"]
        assert set(r["times"]) - {"bridge, whole VJPs"} == {
            "bridge", "pure JAX", "no bridge", "torch", "fast path"}, r["times"]
        # The floor runs only programs the bridge compiled too, by order and kind.
        assert all(p["compiled"] >= 1 for p in r["programs"] if p["runs"]), r
    assert all("bridge, whole VJPs" in r["times"] for r in higher.values())
    assert max(p["order"] for p in higher["PINN"]["programs"]) == 3
    # NOTE [Shared linearization]: at the smoke size the PINN's VJPs are far below the work
    # a split pays for (``VjpCalls.SPLIT_MIN_WORK``): whole, 3 calls a step at order 2.
    runs = {(p["order"], p["kind"]): p["runs"] for p in higher["PINN"]["programs"]}
    assert runs[2, "forward_with_residuals"] == 3, runs
    assert not any(k.startswith("linearize") for _, k in runs), runs
    # NOTE [Given residuals]: the penalty's second order reads order 1's residuals; no
    # program of it reruns the critic's forward (the whole VJP's kinds never run).
    penalty = {(p["order"], p["kind"]): p["runs"] for p in higher["PENALTY"]["programs"]}
    assert penalty == {(1, "forward_with_residuals"): 1,
                       (2, "given apply forward_with_residuals"): 1,
                       (2, "given apply backward"): 1, (2, "given transpose forward"): 1}, penalty
    assert not results["shard"]  # its own run: _check_benchmark_shard


def _check_benchmark_shard(done, out) -> None:
    results = json.loads((out / "results.json").read_text())
    assert not results["workloads"] and not results["dp"], results
    (shard,) = results["shard"]  # 2 processes, four contestants and two in bfloat16
    assert shard["mismatch"] < 1e-4, shard["losses"]
    assert shard["mismatch_bf16"] < 2.0**-5, shard["losses"]
    assert set(shard["times"]) == {"sharded", "sharded remat_stack", "fully_shard whole",
                                   "pure JAX SPMD", "sharded remat_stack bf16",
                                   "fully_shard whole bf16"}
    # remat_stack's loops: one collective per forward iteration (the packed gather).
    stack = shard["programs"][0]["sharded remat_stack"]
    assert stack["forward_with_residuals"]["in_loops"] == 1, stack


def _check_pinn(done, out) -> None:
    """Third derivatives through the Flax trunk train it: the error against the exact
    solution falls, and the plot is written."""
    start = float(re.search(r"relative error at start ([\d.]+)", done.stdout).group(1))
    final = float(re.search(r"final relative L2 error ([\d.]+)", done.stdout).group(1))
    assert final < 0.5 * start, done.stdout
    assert (out / "pinn.png").exists()


def _check_collectives(done, out) -> None:
    """Every way of moving a layer was timed, twice."""
    rows = re.findall(r"^  (\S.*?\S) +(\d+\.\d+) +(\d+\.\d+)$", done.stdout, re.M)
    assert [name for name, _, _ in rows] == [
        "no collective", "tuple all-reduce", "packed all-reduce", "packed reduce-scatter",
        "all-to-all + sum", "all-gather", "all-to-all gather"], done.stdout


def _check_shard2d(done, out) -> None:
    """The four contestants agree on two steps' losses and each has a row and programs."""
    assert float(re.search(r"max relative difference ([\d.e+-]+)", done.stdout).group(1)) <= 1e-4
    for name in ("sharded 2-D", "sharded remat_stack 2-D", "fully_shard whole",
                 "pure JAX SPMD 2-D"):
        assert re.search(rf"^\| {name} \| [\d.]+ [mu]?s \|", done.stdout, re.M), done.stdout
        assert re.search(rf"^\| {name} \| (forward_with_residuals|step) \|", done.stdout,
                         re.M), done.stdout


def _check_train_sharded(done, out) -> None:
    """Both ranks hold at most half the block plus one layer, the loss is printed per
    step, and the DCP checkpoint reloads into a model that computes the same."""
    assert len(re.findall(r"^step +\d+/3  loss [\d.]+$", done.stdout, re.M)) == 3, done.stdout
    for rank in (0, 1):
        assert re.search(rf"^rank {rank}: block parameters .*one layer, .*: yes\)",
                         done.stdout, re.M), done.stdout
    assert "reloaded: the reloaded model computes the same outputs on every rank" in done.stdout
    assert (out / "checkpoint" / ".metadata").exists()


def _check_exit_aborts(done, out) -> None:
    assert "exit handler registered: 0 of 1 exits aborted" in done.stdout, done.stdout


def _check_shared_linearization(done, out) -> None:
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+\(.*?\)\s+([\d.e+]+)\s+([\d.]+)ms\s+([\d.]+)ms"
                      r"\s+([\d.]+)x", done.stdout, re.M)
    assert len(rows) == 1, done.stdout  # the smoke size, timed split and whole
    (_, _, work, whole, split, ratio), = rows
    assert float(work) > 0 and abs(float(split) / float(whole) - float(ratio)) < 0.01, rows


def _check_packing(done, out) -> None:
    rows = {(r[0], r[1]): int(r[2]) for r in re.findall(
        r"^\| (TINY|16 kernels) \| (CPU|DLPack) \(.*?\) \| \d+ \| (\d+) \|", done.stdout, re.M)}
    assert len(rows) == 4, done.stdout
    # The DLPack route packs the kernels' gradients, which cross alone on the CPU route.
    assert rows["16 kernels", "DLPack"] <= 8 < rows["16 kernels", "CPU"], done.stdout


def _check_dp_norms(done, out) -> None:
    temps = dict(re.findall(
        r"(ghost norms|summed where made|reduced after)\s+temporaries\s+([\d.]+) MiB",
        done.stdout))
    assert float(temps["ghost norms"]) < float(temps["reduced after"]), done.stdout
    assert float(temps["summed where made"]) < float(temps["reduced after"]), done.stdout
    worst = re.findall(r"largest relative difference from the sums after: (\S+)", done.stdout)
    assert len(worst) == 2 and max(map(float, worst)) < 1e-4, done.stdout


CHECKS = {
    "train_digits.py": _check_train_digits,
    "train_dp.py": _check_train_dp,
    "bench/benchmark.py": _check_benchmark,
    "bench/benchmark.py:shard": _check_benchmark_shard,
    "train_lm.py": _check_train_lm,
    "exit_aborts.py": _check_exit_aborts,
    "pinn.py": _check_pinn,
    "train_sharded.py": _check_train_sharded,
    "bench/collectives.py": _check_collectives,
    "bench/shard2d.py": _check_shard2d,
    "bench/dp_norms.py": _check_dp_norms,
    "bench/packing.py": _check_packing,
    "bench/shared_linearization.py": _check_shared_linearization,
}


# Examples that start ranks over gloo (torchrun's, the benchmark's sharded part).
PROCESSES = {"train_sharded.py", "bench/benchmark.py:shard", "bench/collectives.py",
             "bench/shard2d.py"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.processes) if n in PROCESSES
                                  else n for n in [*_scripts(), "bench/benchmark.py:shard"]])
def test_example_runs(name, tmp_path):
    assert name in TINY_ARGS, f"add tiny-size arguments for {name} to TINY_ARGS in this file"
    done = _run(name, tmp_path)
    assert done.stdout.strip(), f"{name} printed nothing"
    if name in CHECKS:
        CHECKS[name](done, tmp_path)


class _Sleeper:
    """A benchmark contestant whose call lasts ``seconds[torch's thread count]``."""

    def __init__(self, name, seconds):
        self.name, self.seconds = name, seconds

    def call(self):
        import time

        import torch

        time.sleep(self.seconds[torch.get_num_threads()])

    def reset(self):
        pass


def test_race_reports_each_contestant_at_its_faster_thread_count(monkeypatch):
    """NOTE [Torch threads] (examples/bench/_measure.py): a race times each contestant at
    torch's default thread count and at one, gives its faster median, names who was
    faster on one, and leaves torch's thread count as it found it."""
    import torch

    monkeypatch.syspath_prepend(str(EXAMPLES / "bench"))
    import _measure

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the default under test, whatever this machine's cores
    try:
        racers = [_Sleeper("faster on one", {2: 0.010, 1: 0.001}),
                  _Sleeper("faster on two", {2: 0.001, 1: 0.010})]
        times, rounds = _measure.race(racers, budget=0.05, min_repeats=3, warmup=0,
                                      label="sleepers")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert rounds >= 3
    assert max(times.values()) < 0.005, times  # each at its 1 ms count, not its 10 ms one
    assert _measure.ONE_THREAD["sleepers"] == ["faster on one"]
