"""What crossing the bridge costs: per tensor, and per call of a small block.

What this shows, on this machine, through flaxtorch's public API:

* per tensor: ``bridge.to_jax`` and ``bridge.to_torch`` (zero-copy on CPU), a forced copy,
  JAX's and torch's public DLPack import and export, and the import and the export a call
  itself makes on each route (the CPU route's pointer views; the DLPack route's crossings,
  lean and through the public calls: NOTE [Lean crossing]), each the median of repeated
  runs over many 64-element tensors;
* per call: the benchmark's TINY row (one forward+backward of a 2-layer MLP, width 64,
  batch 8, where the fixed cost of a call dominates), measured by the benchmark's own code
  at its full size (``benchmark.run_workload``: the same model, weights, inputs and four
  contestants, ``FlaxModule``, pure JAX ``jit(value_and_grad)``, and the torch twin without
  and with per-layer checkpoint, in interleaved rounds filling the same time budget), so
  that its figures and the benchmark's TINY row differ only by the run they come from;
* how many Python function calls one cached forward+backward of that ``FlaxModule``
  makes (cProfile): a count, not a time, so it compares versions of the bridge on any
  machine;
* what ``import torchside`` costs in a fresh interpreter after torch, JAX and Flax, and
  whether it loads Dynamo (which loads on the first compiled call instead), beside what
  importing Dynamo costs there.

With ``--device cuda`` (a CUDA machine) the per-tensor rows are the DLPack route's steps on
the GPU, each timing ended by a synchronize, with one more: exporting the results of a
program just dispatched (what every call does with its outputs and gradients) against
exporting ready arrays; the TINY row runs on the GPU; and a host profile of one cached
forward+backward of the benchmark's MEDIUM block (96 parameter tensors) lists where the
host's time per call goes (cProfile, own time), which says whether a per-tensor cost on the
GPU is a wait or Python work.

With ``--docs PATH`` it also writes the per-tensor table, the Python call count, the
machine and the command as the ``call_costs`` block of a markdown file (docs/benchmarks.md
takes default-size runs only); the time per call stays the benchmark block's TINY row.

How to run:
    python examples/bench/call_costs.py                             # about 20 s
    python examples/bench/call_costs.py --docs docs/benchmarks.md   # and update the docs
    python examples/bench/call_costs.py --device cuda --docs docs/benchmarks.md  # on a GPU
"""

from __future__ import annotations

import os

# Set before torch is imported: torch's OpenMP threads otherwise spin after each parallel
# region and steal the cores XLA's threads need.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
from bridge import _dlpack as bridge_dlpack  # noqa: E402
from bridge import _exchange as bridge_exchange  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _docs  # noqa: E402
from _call_profile import host_profile, python_calls_per_call, time_breakdown  # noqa: E402
from _measure import set_device, sync  # noqa: E402
from _sizes import SIZES  # noqa: E402
from benchmark import run_workload, workloads  # noqa: E402

DEFAULTS = {"tensors": 768, "repeats": 30}


def per_item(fn, n: int, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, divided by ``n``."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n


def tensor_rows(n: int, repeats: int) -> list[tuple[str, float, str]]:
    """(step, seconds per tensor, zero-copy) for each public conversion."""
    tensors = [torch.randn(64) for _ in range(n)]
    arrays = [jnp.asarray(np.asarray(t)) + 1 for t in tensors]  # JAX's own buffers
    jax.block_until_ready(arrays)
    shared = sum(bridge.is_zero_copy(t) for t in tensors)
    return [
        ("bridge.to_jax (CPU)", per_item(lambda: [bridge.to_jax(t) for t in tensors], n,
                                         repeats), f"yes ({shared} of {n} aligned)"),
        ("bridge.to_jax(copy=True)",
         per_item(lambda: [bridge.to_jax(t, copy=True) for t in tensors], n, repeats),
         "a copy"),
        ("bridge.to_torch, after waiting (CPU)",
         per_item(lambda: [bridge.to_torch(a) for a in arrays], n, repeats), "yes"),
        ("DLPack import, jax.dlpack.from_dlpack (public)",
         per_item(lambda: [jax.dlpack.from_dlpack(t) for t in tensors], n, repeats), "yes"),
        ("DLPack export, torch.from_dlpack (public)",
         per_item(lambda: [torch.from_dlpack(a) for a in arrays], n, repeats), "yes"),
        *call_rows(tensors, arrays, n, repeats),
    ]


def call_rows(tensors, arrays, n: int, repeats: int) -> list[tuple[str, float, str]]:
    """The import and the export a call itself makes per tensor, on each route.

    Import: what a program takes for an argument (``exchange.view``: a pointer view on the
    CPU route, a DLPack import on the DLPack route, its arrays dropped as a call drops
    them); export: a torch tensor over a result (``cpu_tensor``; the DLPack route's
    ``Crossing.results``, lean where this jax allows it: NOTE [Lean crossing]).
    """
    device = tensors[0].device
    cpu = bridge_exchange.CpuExchange(bridge.jax_device(device), device) if device.type == (
        "cpu") else None
    rows = []
    if cpu is not None:
        rows += [("a call's import, CPU route (pointer view)",
                  per_item(lambda: [cpu.view(t) for t in tensors], n, repeats), "yes"),
                 ("a call's export, CPU route (tensor over the result)",
                  per_item(lambda: [bridge_exchange.cpu_tensor(a) for a in arrays], n,
                           repeats), "yes")]
    for lean in sorted({bridge_dlpack.LEAN, False}, reverse=True):
        dl = bridge_exchange.DlpackExchange(bridge.jax_device(device), device, lean)
        path = "lean" if lean else "public calls"
        rows += [(f"a call's import, DLPack route ({path})",
                  per_item(lambda dl=dl: [dl.view(t) for t in tensors], n, repeats), "yes"),
                 (f"a call's export, DLPack route ({path})",
                  per_item(lambda dl=dl: dl.crossing.results(arrays), n, repeats), "yes")]
    return rows


def cuda_tensor_rows(n: int, repeats: int) -> list[tuple[str, float, str]]:
    """The DLPack route's steps on ``cuda:0``, per tensor; each timing ends synchronized."""
    device = torch.device("cuda", 0)
    gpu = bridge.jax_device(device)
    tensors = [torch.randn(64, device=device) for _ in range(n)]
    arrays = jax.block_until_ready(
        [jax.device_put(np.full(64, i, np.float32), gpu) + 1 for i in range(n)])
    program = jax.jit(lambda xs: [x * 2.0 for x in xs])
    jax.block_until_ready(program(arrays))  # compiled outside the timings

    def synced(fn):
        def run():
            fn()
            sync()
            jax.block_until_ready(arrays)
        return run

    def exported(outs):
        return [torch.from_dlpack(o) for o in outs]

    run_only = per_item(synced(lambda: jax.block_until_ready(program(arrays))), n, repeats)
    run_and_export = per_item(synced(lambda: exported(program(arrays))), n, repeats)
    return [
        ("bridge.to_jax (CUDA: a DLPack import)",
         per_item(synced(lambda: [bridge.to_jax(t) for t in tensors]), n, repeats), "yes"),
        ("bridge.to_torch, ready arrays (CUDA: a DLPack export)",
         per_item(synced(lambda: [bridge.to_torch(a) for a in arrays]), n, repeats), "yes"),
        ("DLPack import, jax.dlpack.from_dlpack",
         per_item(synced(lambda: [jax.dlpack.from_dlpack(t) for t in tensors]), n, repeats),
         "yes"),
        ("DLPack export, torch.from_dlpack, ready arrays",
         per_item(synced(lambda: exported(arrays)), n, repeats), "yes"),
        (f"a program over the {n} arrays, run and waited for", run_only, "-"),
        ("DLPack export, torch.from_dlpack, of the results of that program just dispatched "
         "(run + export - run)", run_and_export - run_only, "yes"),
        *call_rows(tensors, arrays, n, repeats),
    ]


def tiny_workload():
    """The benchmark's TINY workload: its model, weights, input and cotangent."""
    (tiny,) = workloads(["tiny"], SIZES["full"])
    return tiny


def call_row(tiny) -> dict:
    """The benchmark's TINY row, measured as the benchmark measures it at its full size."""
    return run_workload(tiny, SIZES["full"])


# A fresh interpreter: torch, JAX and Flax first (any user of the bridge imports them),
# then the bridge, then Dynamo, each timed; and whether the bridge had loaded Dynamo.
_IMPORTS = """
import sys, time
t0 = time.perf_counter()
import torch, jax, flax.linen
t1 = time.perf_counter()
import torchside
t2 = time.perf_counter()
loaded = "torch._dynamo" in sys.modules
import torch._dynamo
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, loaded)
"""


def import_costs(runs: int) -> dict:
    """Medians over ``runs`` fresh interpreters of what ``_IMPORTS`` times."""
    out = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True,
                              text=True, check=True)
        *times, loaded = done.stdout.split()
        out.append([float(t) for t in times] + [loaded == "True"])
    frameworks, bridge_s, dynamo = (statistics.median(r[k] for r in out) for k in range(3))
    return {"frameworks": frameworks, "torchside": bridge_s, "dynamo": dynamo,
            "loads_dynamo": any(r[3] for r in out), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=DEFAULTS["tensors"],
                        help="tensors per measurement (768: the benchmark's LEAVES workload)")
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"],
                        help="runs per median of the per-tensor rows (the per-call rows "
                             "take the benchmark's rounds)")
    parser.add_argument("--docs", default=None, metavar="PATH",
                        help="also write the tables as the call_costs block of this "
                             "markdown file (docs/benchmarks.md: default sizes only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the DLPack route's steps on the GPU, TINY on the GPU, "
                             "and a host profile of MEDIUM's call there")
    args = parser.parse_args()
    n, repeats = args.tensors, args.repeats
    set_device(args.device)
    if args.docs:
        full = (n, repeats) == (DEFAULTS["tensors"], DEFAULTS["repeats"])
        _docs.check_target(args.docs, full=full, script="call_costs.py")
    tensors = cuda_tensor_rows(n, repeats) if args.device == "cuda" else tensor_rows(n, repeats)
    profiled = host_profile(12, repeats) if args.device == "cuda" else None
    tiny = tiny_workload()
    breakdown = (time_breakdown(tiny, max(40 * repeats, 200)) if args.device == "cpu"
                 else [])
    row = call_row(tiny)
    python_calls = python_calls_per_call(tiny, max(repeats, 10))
    imports = import_costs(max(1, min(5, repeats // 6)))
    import_line = (
        f"`import torchside` in a fresh interpreter, after torch, JAX and Flax "
        f"({imports['frameworks']:.2f} s): {imports['torchside']:.2f} s; Dynamo "
        f"{'loaded' if imports['loads_dynamo'] else 'not loaded'} by it (importing it there "
        f"takes {imports['dynamo']:.2f} s; the first compiled call loads it). Median of "
        f"{imports['runs']} interpreters.")
    times, base = row["times"], row["times"]["torch"]
    diff = max(row["mismatch"].values())
    call_title = (f"the benchmark's TINY row ({row['describe']}), measured by its own code at "
                  f"full size (benchmark.run_workload): median of {row['rounds']} interleaved "
                  f"rounds; outputs agree with pure JAX to {diff:.1e}")

    print(f"jax {jax.__version__}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    width = max(len(r[0]) for r in tensors)
    print(f"Per tensor (64 float32 elements; median of {repeats} runs over {n} tensors)")
    print(f"{'step'.ljust(width)}  {'cost':>9}  zero-copy")
    for name, seconds, zero_copy in tensors:
        print(f"{name.ljust(width)}  {seconds * 1e6:7.1f} us  {zero_copy}")
    print(f"\nPer call, forward+backward: {call_title}")
    for name, seconds in times.items():
        print(f"{name.ljust(width)}  {seconds * 1e6:7.0f} us  {seconds / base:.2f}x torch eager")
    print(f"Python function calls per cached forward+backward of TINY's FlaxModule: "
          f"{python_calls:.0f}")
    print(import_line)
    breakdown_lines = []
    if breakdown:
        breakdown_lines = [
            "Where a cached forward+backward of TINY's FlaxModule spends its time (CPU "
            "route, one torch thread, each step timed by a wrapper; median per occurrence):",
            "", _docs.md_table(["step", "time", "per call"],
                               [[s, f"{t * 1e6:.1f} us", str(n)] for s, t, n in breakdown]),
            ""]
        print("\n".join(breakdown_lines))
    profile_lines = []
    if profiled is not None:
        describe, per_call, rows = profiled
        profile_lines = [
            f"Host time per cached forward+backward of MEDIUM ({describe}) on the GPU, "
            f"synchronized: {per_call * 1e3:.2f} ms; the {len(rows)} functions with the most "
            f"own time per call (cProfile, which slows Python work):", "",
            _docs.md_table(["function", "own time per call"],
                           [[name, f"{t * 1e6:.0f} us"] for name, t in rows]), ""]
        print("\n".join(profile_lines))

    if args.docs:
        body = "\n".join([
            f"Produced by `{_docs.command()}`.", "", *_docs.machine(), "",
            f"Per tensor (64 float32 elements; median of {repeats} runs over {n} tensors):",
            "",
            _docs.md_table(["step", "cost", "zero-copy"],
                           [[s, f"{t * 1e6:.1f} us", z] for s, t, z in tensors]),
            "",
            # One table per figure: the time per call is the benchmark block's TINY row
            # (the same code measures it there); this block keeps what only it measures.
            "Per call, forward+backward: the TINY row of the benchmark block above (this "
            "script times it again with the same code, printed but not written here, so "
            "that each figure has one table).",
            "",
            f"Python function calls per cached forward+backward of TINY's FlaxModule "
            f"(cProfile): {python_calls:.0f}.",
            "", import_line, "", *breakdown_lines, *profile_lines,
        ])
        block = "call_costs" if args.device == "cpu" else f"call_costs_{args.device}"
        _docs.write_block(args.docs, block, body)
        print(f"wrote the {block} block of {args.docs}")


if __name__ == "__main__":
    main()
