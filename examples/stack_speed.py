"""Speed and memory of a deep stack's training step: Flax's lifts vs ``flaxside.remat_stack``.

What this shows: one more level of remat should cost about one more forward pass (1.25x a
``scan(remat)`` step for two levels), but stock ``nn.remat_scan`` costs much more, because
the autodiff of nested scans copies a slice of the stacked parameters per outer step (in the
forward and again in the backward) and builds each outer step's gradients in a fresh stack
before copying them into the full one. ``remat_stack`` reads and writes the full stacks in
place (``flaxside/stacks/_core.py``). Every variant is compiled first, then timed in
interleaved rounds so that load on a shared machine hits all of them alike; ratios are to
``nn.scan(nn.remat(Block))``, minimum over rounds. "temp" is XLA's scratch memory for the
whole jitted step (where the copied slices live), "held" what a forward keeps for the
backward (``flaxside.memory_report``). A second table counts the bytes each step writes
into copied parameter slices, gradient slice updates and zero fills (read from the
compiled HLO, loops counted by their trip counts). XLA on CPU copies each layer's slice
before its matmuls, so one copy of all parameters per pass over the layers is the floor
(two passes for ``scan(remat)``, three for two levels); the autodiff of nested scans adds
about four parameter-sized copies, fills and updates more per step.

With ``--table``, it prints instead, per depth (16 to 1024), what a forward holds and how
long the step takes to compile, for two-level ``remat_stack`` and for ``nn.scan`` without
remat; nothing runs, so large batches cost only compile time.

How to run (CPU is fine; about two minutes at the defaults):
    python examples/stack_speed.py [--depth 64] [--width 512] [--batch 64]
    python examples/stack_speed.py --table [--width 512] [--batch 64]
"""

import argparse
import collections
import math
import os
import re
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import flaxside

# The benchmark's models and byte formatting (examples/bench/).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
from _report import fmt_bytes  # noqa: E402
from _workloads import Block, RematScan, Scan  # noqa: E402


class StockRematScan(nn.Module):
    """``nn.remat_scan(Block)`` as Flax documents it: the innermost loop is not remat'd."""

    width: int
    lengths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        return nn.remat_scan(Block, lengths=self.lengths)(self.width, name="stack")(x)


def fmt(n: int | None) -> str:
    """``n`` bytes (powers of 1024), right-aligned to 14 characters."""
    return f"{fmt_bytes(n):>13} "


def variants(depth: int, width: int):
    a = math.isqrt(depth)
    two = (a, depth // a) if a * (depth // a) == depth else None
    out = {"nn.scan(nn.remat)": Scan(width, depth, remat=True)}
    if two:
        out[f"nn.remat_scan {two}  [before]"] = StockRematScan(width, two)
        out[f"nn.remat_scan(nn.remat) {two}"] = RematScan(width, two)
    out[f"remat_stack ({depth},)"] = flaxside.remat_stack(Block, depth, width=width)
    if two:
        out[f"remat_stack {two}  [after]"] = flaxside.remat_stack(
            Block, depth, lengths=two, width=width)
        # Each layer keeps its internals while its segment is in the backward: no third
        # forward pass, for two levels' held memory plus one segment of internals.
        out["  same, everything_saveable"] = flaxside.remat_stack(
            Block, depth, lengths=two, width=width, policy="everything_saveable")
    c = round(depth ** (1 / 3))
    if c**3 == depth:
        out[f"remat_stack {(c, c, c)}"] = flaxside.remat_stack(
            Block, depth, lengths=(c, c, c), width=width)
    return out


def compiled_step(module: nn.Module, x, ct):
    params = jax.jit(module.init)(jax.random.key(0), x)["params"]

    def loss(p, x):
        return jnp.vdot(module.apply({"params": p}, x), ct)

    start = time.perf_counter()
    step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return step, params, time.perf_counter() - start


def depth_table(width: int, batch: int):
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    print(f"width {width}, batch {batch}: held bytes and compile seconds (forward+backward)")
    print(f"{'depth':>6}{'lengths':>12}{'held':>14}{'bwd temp':>14}{'compile':>9}"
          f"{'scan held':>14}{'compile':>9}")
    for depth in (16, 64, 256, 1024):
        a = math.isqrt(depth)
        ours = flaxside.memory_report(
            flaxside.remat_stack(Block, depth, lengths=(a, a), width=width), x)
        scan = flaxside.memory_report(Scan(width, depth), x)
        print(f"{depth:>6}{str((a, a)):>12}{fmt(ours.held_bytes)}{fmt(ours.backward_temp_bytes)}"
              f"{ours.compile_seconds:>7.2f} s{fmt(scan.held_bytes)}{scan.compile_seconds:>7.2f} s",
              flush=True)


# -- where the time goes: bytes written per step by slices, updates and fills ----------------
_DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}


def _bytes_of(shape: str) -> int:
    kind, dims = re.match(r"(\w+)\[([\d,]*)\]", shape).groups()
    return _DTYPE_BYTES.get(kind, 4) * math.prod(int(d) for d in dims.split(",") if d)


def copy_traffic(hlo: str, threshold: int = 1 << 20) -> dict[str, int]:
    """Bytes per step written by dynamic slices, slice updates and fills of >= 1 MiB.

    Reads the compiled (optimized) HLO text: each while body counts its known trip count
    times (nested loops multiply), each top-level fusion is classified by its root.
    """
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name and line.startswith("  "):
            comps[name].append(line.strip())
    runs: collections.Counter = collections.Counter()

    def walk(comp, times):
        runs[comp] += times
        for line in comps[comp]:
            body = re.search(r" while\(.*body=%([\w.\-]+)", line)
            if body:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                walk(body.group(1), times * int(trips.group(1) if trips else 1))

    walk(entry, 1)
    out: collections.Counter = collections.Counter()
    for comp, times in runs.items():
        for line in comps[comp]:
            fusion = re.search(r"= (\w+\[[\d,]*\])\S* fusion\(.*calls=%([\w.\-]+)", line)
            if not fusion:
                continue
            size, body = _bytes_of(fusion.group(1)), comps[fusion.group(2)]
            root = next(x for x in body if x.startswith("ROOT"))
            if " dynamic-update-slice(" in root:  # in place: writes the update only
                update = re.search(r"dynamic-update-slice\(%[\w.\-]+, %([\w.\-]+)", root).group(1)
                line = next(x for x in body if x.startswith(f"%{update} ="))
                kind, size = "update", _bytes_of(re.search(r"= (\w+\[[\d,]*\])", line).group(1))
            elif any(" dynamic-slice(" in x for x in body):
                kind = "slice"
            elif " broadcast(" in root:
                kind = "fill"
            else:
                continue
            if size >= threshold:
                out[kind] += size * times
    return dict(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--table", action="store_true", help="held bytes per depth")
    args = parser.parse_args()
    if args.table:
        return depth_table(args.width, args.batch)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, args.width)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(args.batch, args.width)), jnp.float32)
    print(f"depth {args.depth}, width {args.width}, batch {args.batch}, "
          f"{jax.devices()[0].device_kind}")
    runs, info = {}, {}
    for name, module in variants(args.depth, args.width).items():
        step, params, seconds = compiled_step(module, x, ct)
        report = flaxside.memory_report(module, jax.ShapeDtypeStruct(x.shape, x.dtype))
        jax.block_until_ready(step(params, x))  # warm up
        runs[name] = (step, params)
        info[name] = (seconds, step.memory_analysis().temp_size_in_bytes, report.held_bytes,
                      copy_traffic(step.as_text()))
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (step, params) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(step(params, x))
            times[name].append(time.perf_counter() - start)
    base = min(times["nn.scan(nn.remat)"])
    print(f"{'variant':<34}{'step min':>10}{'median':>9}{'ratio':>7}{'compile':>9}"
          f"{'step temp':>14}{'held':>14}")
    for name, ts in times.items():
        seconds, temp, held, _ = info[name]
        print(f"{name:<34}{min(ts) * 1e3:>7.1f} ms{np.median(ts) * 1e3:>6.0f} ms"
              f"{min(ts) / base:>6.2f}x{seconds:>7.2f} s{fmt(temp)}{fmt(held)}")
    print("\nwritten per step by slice copies, in-place slice updates and fills (>= 1 MiB each,"
          " from the compiled HLO)")
    print(f"{'variant':<34}{'slice':>14}{'update':>14}{'fill':>14}{'total':>14}")
    for name in times:
        traffic = info[name][3]
        parts = [traffic.get(k, 0) for k in ("slice", "update", "fill")]
        print(f"{name:<34}" + "".join(fmt(b) for b in [*parts, sum(parts)]))


if __name__ == "__main__":
    main()
