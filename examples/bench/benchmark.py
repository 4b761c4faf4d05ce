"""How close is FlaxModule to pure JAX, and how does it compare with native torch?

What this shows:
    One run measures, side by side on the same inputs and weights (medians over repeated
    forward+backward calls after warm-up, contestants interleaved so machine noise hits
    them alike):

    * workloads TINY (2-layer MLP, width 64, batch 8: the fixed cost of one call), MEDIUM
      (16 unrolled residual MLP blocks, width 512, batch 128), DEEP (128 blocks under a
      2-level remat-scan: ``flaxside.remat_stack``, and again as Flax's stock
      ``nn.remat_scan(nn.remat(Block))``) and LEAVES (128 unrolled blocks: 768 parameter
      leaves), each run through ``FlaxModule``, as pure JAX ``jit(value_and_grad)`` (the
      limit), and as the torch twin eager, with and without per-layer
      ``torch.utils.checkpoint``;
    * for depths 16 ... 1024: bytes held for backward, time per call and compile seconds of
      ``nn.scan``, ``nn.scan(nn.remat)``, and ``nn.remat_scan`` with 2 and 3 levels, against
      the torch twin with no checkpoint, per-layer checkpoint and ``checkpoint_sequential``;
    * for 1 ... 4,096 parameter leaves at a fixed total size: time per call of the bridge,
      pure JAX and torch eager, and each one's fitted cost per extra leaf
      (``_leaves.py``).

    * for a GPT-2-shaped model trained from torch (``_lm.py``): the bridge with the
      loss in torch and inside the Flax module against pure JAX fused and split, and
      against the torch twin.

    * for steps that differentiate a Flax block again from torch (``_higher.py``): a
      WGAN-GP gradient-penalty step and the PINN step of ``examples/pinn.py`` (third
      derivatives), the bridge against pure JAX ``jit(grad)``, the same JAX programs run
      without the bridge, and the torch twin; per order, the programs compiled and run,
      their times and the bytes held for backward.

    * for a DP-SGD step through Opacus (``_dp.py``): a model holding a Flax trunk against
      its torch twin (hooks and ghost clipping) and pure JAX DP-SGD in one ``jit``.

    * for a deep ``nn.remat_scan`` block trained over 2 torch processes (gloo, CPU;
      ``_shard.py``): ``torchside.shard`` against FSDP2's ``fully_shard`` of the whole
      block and pure JAX SPMD on the same mesh; per rank, the step time, the parameter and
      AdamW bytes held between steps, and each XLA program's peak bytes and collectives.

    It prints a table of ratios with PASS/MISS against the project's targets and writes
    four PNG plots (held bytes, time and compile seconds against depth; time against
    leaves). With ``--docs PATH`` it also writes every printed table, the date, the machine
    and the command as the ``benchmark`` block of a markdown file; docs/benchmarks.md (whose
    prose says how to read the tables) takes full runs only.

How to run:
    pip install -e '.[examples]'
    python examples/bench/benchmark.py             # full run, several minutes on 2 CPU cores
    python examples/bench/benchmark.py --quick     # reduced sizes, about a minute on an idle
                                                   # 2-core machine (MEDIUM width 256, LEAVES
                                                   # 32 blocks, depths 16 and 1024, fewer
                                                   # repeats)
    python examples/bench/benchmark.py --out plots # where the PNGs and results.json go
    python examples/bench/benchmark.py --docs docs/benchmarks.md  # full run, updates the docs
"""

from __future__ import annotations

import os

# Set before torch is imported: torch's OpenMP threads otherwise spin after each parallel
# region and steal the cores XLA's threads need (both runtimes share the CPU here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced run, under a minute")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, to check the script runs (for tests)"
    )
    parser.add_argument("--out", default="benchmark_out", help="folder for plots and json")
    parser.add_argument(
        "--only",
        default="tiny,medium,deep,leaves,lm,higher,dp,shard,sweep,leafsweep",
        help="comma-separated parts to run: tiny, medium, deep, leaves, lm (real models), "
             "higher (gradient penalty, PINN), dp (DP-SGD through Opacus), shard (sharded "
             "training over 2 processes), sweep, leafsweep",
    )
    parser.add_argument(
        "--cpu-dispatch",
        choices=("async", "sync"),
        default="async",
        help="JAX's CPU dispatch (jax_cpu_enable_async_dispatch); async is JAX's default",
    )
    parser.add_argument(
        "--no-sync-row",
        action="store_true",
        help="skip the extra TINY row measured in a child process with sync CPU dispatch",
    )
    parser.add_argument(
        "--docs",
        default=None,
        metavar="PATH",
        help="also write the tables as the benchmark block of this markdown file "
             "(docs/benchmarks.md: full runs of every part only)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where torch tensors and pure JAX run: cuda times the workloads, the depth sweep "
             "and the leaf sweep on GPU 0 (lm, higher and shard run on CPU only)",
    )
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)  # child -> parent
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_dispatch == "sync":
    import jax

    # Must precede the first use of the CPU backend: the client is created with it.
    jax.config.update("jax_cpu_enable_async_dispatch", False)

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _docs  # noqa: E402
from _dp import dp_rows, print_dp  # noqa: E402
from _higher import higher_rows  # noqa: E402
from _leaves import leaf_sweep, plot_leaf_sweep, print_leaf_sweep  # noqa: E402
from _lm import lm_rows, print_lm  # noqa: E402
from _measure import (  # noqa: E402
    ONE_THREAD,
    Bridge,
    PureJax,
    TorchEager,
    one_thread_line,
    race,
    set_device,
)
from _report import (  # noqa: E402
    fmt_time,
    plot_sweep,
    print_higher,
    print_sweep,
    print_targets,
    print_workloads,
)
from _shard import shard_rows  # noqa: E402
from _shard_report import print_shard  # noqa: E402
from _sizes import SIZES  # noqa: E402
from _workloads import (  # noqa: E402
    FLAX_VARIANTS,
    RematScan,
    RematStack,
    TinyMLP,
    Unrolled,
    Workload,
    restack,
    scan_lengths,
    stack,
    torch_twin,
)


def run_workload(workload: Workload, size: dict) -> dict:
    """One row of the workloads table: first calls, agreement, the race, held bytes.

    call_costs.py measures its per-call rows with this function too (TINY at full size), so
    that those rows and this table's TINY row differ only by the run they come from.
    """
    layers = torch_twin(workload.module, workload.variables["params"])
    bridge = Bridge(workload)
    contestants = [
        bridge,
        PureJax(workload),
        TorchEager(workload, layers, "none"),
        TorchEager(workload, layers, "per-layer"),
    ]
    first, compile_s = {}, {}
    for c in contestants:
        first[c.name], compile_s[c.name] = c.first_call()
    reference = contestants[1].output()
    scale = float(np.abs(reference).max())
    mismatch = {c.name: float(np.abs(c.output() - reference).max()) / scale for c in contestants}
    times, rounds = race(
        contestants, budget=size["budget"], min_repeats=size["min_repeats"], warmup=size["warmup"],
        label=workload.name,
    )
    held = {c.name: c.held() for c in contestants}
    return dict(
        name=workload.name,
        describe=workload.describe(),
        leaves=workload.n_leaves,
        times=times,
        rounds=rounds,
        held=held,
        first_call=first,
        compile=compile_s,
        mismatch=mismatch,
        one_thread=ONE_THREAD.get(workload.name, []),
    )


def workloads(parts: list[str], size: dict) -> list[Workload]:
    deep_depth, deep_width, deep_batch = size["deep"]
    out = []
    if "tiny" in parts:
        out.append(Workload("TINY", TinyMLP(64), batch=8, width=64, depth=2))
    if "medium" in parts:
        w = size["medium_width"]
        out.append(Workload("MEDIUM", Unrolled(w, 16), batch=128, width=w, depth=16))
    if "deep" in parts:
        # Both stacks have the same parameters and compute the same function; each
        # contestant runs the same one (pure JAX differentiates flaxside.remat_stack too).
        lengths = scan_lengths(deep_depth, 2)
        for name, module in (
            ("DEEP", RematStack(deep_width, lengths)),
            ("DEEP nn.remat_scan", RematScan(deep_width, lengths)),
        ):
            out.append(
                Workload(name, module, batch=deep_batch, width=deep_width, depth=deep_depth)
            )
    if "leaves" in parts:
        d = size["leaves"]
        out.append(Workload("LEAVES", Unrolled(64, d), batch=16, width=64, depth=d))
    return out


def sweep(depths, size: dict, width: int = 64, batch: int = 32) -> list[dict]:
    """Held bytes, time per call and compile seconds per depth, Flax stacks and torch twins."""
    rows = []
    # One small compile first, so one-time start-up costs of tracing land on no depth.
    Bridge(Workload("warm-up", stack("scan", width, 2), batch=batch, width=width, depth=2)).call()
    for depth in depths:
        start = time.perf_counter()
        row = {"depth": depth, "held": {}, "time": {}, "compile": {}, "lengths": {}}
        contestants = []
        base = None
        for kind in FLAX_VARIANTS:
            module = stack(kind, width, depth)
            variables = None if base is None else restack(base.variables, module)
            w = Workload(kind, module, batch=batch, width=width, depth=depth, variables=variables)
            base = base or w
            b = Bridge(w)
            b.name = kind
            _, row["compile"][kind] = b.first_call()
            row["held"][kind] = b.held()
            row["lengths"][kind] = getattr(w.module, "lengths", None)
            contestants.append(b)
        layers = torch_twin(base.module, base.variables["params"])
        for mode in TorchEager.MODES:
            t = TorchEager(base, layers, mode)
            row["held"][t.name] = t.held()
            contestants.append(t)
        # No warm-up: the first call (Flax) and held() (torch) already ran each once.
        row["time"], _ = race(
            contestants, budget=size["budget"], min_repeats=size["sweep_repeats"], warmup=0,
            label=f"sweep depth {depth}",
        )
        reference = contestants[-1].output()  # torch, checkpointed: same values as plain
        scale = float(np.abs(reference).max())
        row["mismatch"] = max(
            float(np.abs(c.output() - reference).max()) / scale for c in contestants
        )
        rows.append(row)
        print(f"    depth {depth}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def sync_tiny_row(size_name: str) -> dict | None:
    """TINY measured again in a child process whose JAX CPU client dispatches synchronously."""
    path = os.path.join(ARGS.out, "tiny_sync.json")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--only",
        "tiny",
        "--cpu-dispatch",
        "sync",
        "--json",
        path,
        "--out",
        ARGS.out,
        "--no-sync-row",
    ]
    if size_name != "full":
        cmd.append(f"--{size_name}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"(sync-dispatch TINY row failed:\n{done.stderr[-2000:]})")
        return None
    with open(path) as f:
        row = json.load(f)["workloads"][0]
    row["name"] = "TINY sync"
    ONE_THREAD[row["name"]] = row.get("one_thread", [])  # the child's race, named here
    return row


def main() -> None:
    args = ARGS
    size_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    size = SIZES[size_name]
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if args.device == "cuda":
        cpu_only = sorted(set(parts) & {"lm", "higher", "dp", "shard"})
        if cpu_only:
            raise SystemExit(f"benchmark.py: --device cuda got --only parts {cpu_only}, which "
                             f"run on CPU only; leave them out (e.g. --only "
                             f"tiny,medium,deep,leaves,sweep,leafsweep).")
        set_device("cuda")
    if args.docs:
        # The CPU block takes every part; the GPU block the workloads that compile there in
        # the time a lent GPU gives (LEAVES' first compile outlasted 100 s on an H200).
        every = set(parts) >= (set(parse_args([]).only.split(",")) if args.device == "cpu"
                               else {"tiny", "medium", "deep"})
        _docs.check_target(args.docs, script="benchmark.py",
                           full=size_name == "full" and every and args.cpu_dispatch == "async")
    os.makedirs(args.out, exist_ok=True)
    print(
        f"flaxtorch benchmark ({size_name}): jax {jax.__version__}, flax {flax.__version__}, "
        f"torch {torch.__version__}, numpy {np.__version__}; {os.cpu_count()} CPU cores, "
        f"torch threads {torch.get_num_threads()} and 1 (each contestant's faster), "
        f"OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}, JAX CPU dispatch {args.cpu_dispatch}, "
        f"device {args.device}"
        + (", float32 matmuls in full float32 on both (no TF32)" if args.device == "cuda"
           else ""),
        flush=True,
    )
    start = time.perf_counter()
    results = {"size": size_name, "workloads": [], "lm": [], "higher": [], "dp": [], "shard": [],
               "sweep": [], "leaf_sweep": None}
    for w in workloads(parts, size):
        t0 = time.perf_counter()
        results["workloads"].append(run_workload(w, size))
        print(f"  {w.name}: {w.describe()}: {time.perf_counter() - t0:.0f} s", flush=True)
    sync_row = (size["sync_row"] and not args.no_sync_row and args.cpu_dispatch == "async"
                and args.device == "cpu")
    if "tiny" in parts and sync_row:
        row = sync_tiny_row(size_name)
        if row is not None:
            results["workloads"].append(row)
    if "lm" in parts:
        t0 = time.perf_counter()
        results["lm"] = lm_rows(size)
        print(f"  LM: GPT-2-shaped models: {time.perf_counter() - t0:.0f} s", flush=True)
    if "higher" in parts:
        results["higher"] = higher_rows(size_name, size)
    if "dp" in parts:
        results["dp"] = dp_rows(size_name, size)
    if "shard" in parts:
        results["shard"] = shard_rows(size_name, size)
    if "sweep" in parts:
        print(f"  sweep over depths {size['depths']} (width 64, batch 32)", flush=True)
        results["sweep"] = sweep(size["depths"], size)
    if "leafsweep" in parts:
        print(f"  leaf-count sweep over {size['leaf_counts']}", flush=True)
        results["leaf_sweep"] = leaf_sweep(
            size["leaf_counts"], budget=size["budget"] / 2, min_repeats=size["min_repeats"],
            device=args.device,
        )
    print(f"measured in {time.perf_counter() - start:.0f} s\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, default=str)
        return
    tables = [print_workloads(results["workloads"])]
    if results["sweep"]:
        tables.append(print_sweep(results["sweep"]))
        for path in plot_sweep(results["sweep"], args.out):
            print(f"wrote {path}")
    if results["leaf_sweep"]:
        tables.append(print_leaf_sweep(results["leaf_sweep"], fmt_time))
        path = os.path.join(args.out, "time_vs_leaves.png")
        print(f"wrote {plot_leaf_sweep(results['leaf_sweep'], path)}")
    lm_targets, lm_tables = print_lm(results["lm"], fmt_time) if results["lm"] else ([], "")
    higher_targets, higher_tables = (print_higher(results["higher"]) if results["higher"]
                                     else ([], ""))
    dp_targets, dp_tables = print_dp(results["dp"]) if results["dp"] else ([], "")
    shard_targets, shard_tables = (print_shard(results["shard"]) if results["shard"]
                                   else ([], ""))
    tables[1:1] = [lm_tables, higher_tables, dp_tables, shard_tables]
    tables.append(print_targets(results, lm_targets + higher_targets + dp_targets
                                + shard_targets))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    if args.docs:
        body = [f"Produced by `{_docs.command()}` ({size_name} size, measured in "
                f"{time.perf_counter() - start:.0f} s).", "", *_docs.machine(),
                *filter(None, [one_thread_line()]), "",
                *(t.strip() + "\n" for t in tables if t)]
        block = "benchmark" if args.device == "cpu" else f"benchmark_{args.device}"
        _docs.write_block(args.docs, block, "\n".join(body))
        print(f"wrote the benchmark block of {args.docs}")


if __name__ == "__main__":
    main()
