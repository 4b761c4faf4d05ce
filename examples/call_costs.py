"""What one call pays per tensor crossing the bridge, step by step (README "What a call costs").

What this shows: the per-tensor cost of each exchange step a call takes on this machine
(views of inputs, held parameter arrays, result views, gradient views, the forced DLPack
route) and what narrowing int64 token ids to int32 costs per argument (the range check
and the copy: in numpy on the CPU route, in torch on the DLPack route), each the median
of repeated runs over many tensors. On CUDA the int64 check also reads two numbers back
to the host, so it waits for the work that made the ids; this script measures the CPU.
Last, how many Python function calls one cached forward+backward of a small FlaxModule
makes (cProfile): a count, not a time, so it compares versions of the bridge on any
machine.

How to run:
    python examples/call_costs.py          # about 20 s
"""

import argparse
import cProfile
import pstats
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import torch

from bridge import set_exchange_mode
from bridge.internal import HeldArrays, exchange_for, narrow_to_int32


def per_item(fn, n: int, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, divided by ``n``."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n


class TinyMLP(nn.Module):
    """The benchmark's TINY workload: two Dense layers, width 64."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(jnp.tanh(nn.Dense(64)(x)))


def python_calls_per_call(repeats: int) -> float:
    """Python function calls per cached forward+backward of ``TinyMLP`` (batch 8)."""
    from torchside import FlaxModule

    layer = FlaxModule(TinyMLP(), example_args=(torch.zeros(8, 64),))
    x, ct = torch.randn(8, 64, requires_grad=True), torch.randn(8, 64)
    for _ in range(3):  # compile and settle
        layer(x).backward(ct)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(repeats):
        layer(x).backward(ct)
    profile.disable()
    return pstats.Stats(profile).total_calls / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=768,
                        help="tensors per measurement (768: the benchmark's LEAVES workload)")
    parser.add_argument("--repeats", type=int, default=30, help="runs per median")
    args = parser.parse_args()
    n, repeats = args.tensors, args.repeats
    tensors = [torch.randn(64) for _ in range(n)]
    cpu = exchange_for(torch.device("cpu"))
    held = HeldArrays()
    held.arrays(tensors, cpu)
    arrays = [jax.numpy.asarray(t.numpy()) + 1 for t in tensors]
    jax.block_until_ready(arrays)
    packed = torch.randn(n * 64)
    templates = [torch.empty(64, device="meta")] * n
    rows = [
        ("torch -> JAX: pointer view of an input or cotangent",
         per_item(lambda: [cpu.view(t) for t in tensors], n, repeats), "yes (aligned)"),
        ("torch -> JAX: a parameter's held array, checked and reused",
         per_item(lambda: held.arrays(tensors, cpu), n, repeats), "yes"),
        ("JAX -> torch: result view, after waiting for it",
         per_item(lambda: cpu.run("results", lambda: arrays), n, repeats), "yes"),
        ("a gradient's view of the packed gradient buffer",
         per_item(lambda: torch._C._nn.unflatten_dense_tensors(packed, templates), n,
                  repeats), "yes"),
    ]
    previous = set_exchange_mode("dlpack")
    try:
        rows += [
            ("forced DLPack route (FLAXTORCH_EXCHANGE=dlpack), import",
             per_item(lambda: [jax.dlpack.from_dlpack(t) for t in tensors], n, repeats), "yes"),
            ("forced DLPack route, export",
             per_item(lambda: [torch.from_dlpack(a) for a in arrays], n, repeats), "yes"),
        ]
    finally:
        set_exchange_mode(previous)
    for shape in ((8, 32), (64, 512)):
        ids = torch.randint(0, 50257, shape)
        rows.append((f"int64 ids {shape[0]}x{shape[1]} -> int32: range check and copy",
                     per_item(lambda ids=ids: cpu.narrowed(ids, "ids"), 1, 10 * repeats),
                     "a copy"))
        rows.append((f"int64 ids {shape[0]}x{shape[1]} -> int32: the same in torch "
                     f"(DLPack route)",
                     per_item(lambda ids=ids: narrow_to_int32(ids), 1, 10 * repeats), "a copy"))
        rows.append((f"int64 ids {shape[0]}x{shape[1]} -> int32: the copy alone",
                     per_item(lambda ids=ids: cpu.narrowed(ids, "ids", check=False), 1,
                              10 * repeats), "a copy"))
    width = max(len(r[0]) for r in rows)
    print(f"jax {jax.__version__}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'step'.ljust(width)}  {'cost':>9}  zero-copy")
    for name, seconds, zero_copy in rows:
        print(f"{name.ljust(width)}  {seconds * 1e6:7.1f} us  {zero_copy}")
    print(f"Python function calls per cached forward+backward of a 2-layer FlaxModule: "
          f"{python_calls_per_call(max(repeats, 10)):.0f}")


if __name__ == "__main__":
    main()
