"""When sharing a VJP's linearization pays: the PINN step split and whole, by size.

The figures behind ``VjpCalls.SPLIT_MIN_WORK`` (NOTE [Shared linearization] in
``torchside/edges/_higher.py``). For ``examples/pinn.py``'s model at several sizes (points,
width, scan lengths), the bridge's step with the linearization shared (every leaf set
with several calls split, whatever its work) and with every VJP whole, in interleaved
rounds, median per step; and ``vjp_work`` of the trunk's VJP (order 2: what the gate
reads). Splitting adds a call and its dispatch per leaf set and saves the linearization
of every call after the first: it pays once the VJP's work outweighs the dispatch.

How to run:
    python examples/bench/shared_linearization.py            # the sizes below
    python examples/bench/shared_linearization.py --smoke    # one tiny size, to check it runs
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _higher import _torch_pinn  # noqa: E402
from pinn import PINN  # noqa: E402

from flaxside.internal import vjp_work  # noqa: E402
from torchside.edges._higher import VjpCalls  # noqa: E402

SIZES = [(16, 8, (2, 2)), (64, 16, (2, 2)), (64, 32, (2, 4)), (128, 32, (2, 4)),
         (256, 32, (2, 4)), (1024, 32, (2, 4))]
SMOKE = [(16, 8, (2, 2))]


def step(model, xy, split: bool) -> None:
    share, least = VjpCalls.SHARE_AFTER, VjpCalls.SPLIT_MIN_WORK
    VjpCalls.SHARE_AFTER, VjpCalls.SPLIT_MIN_WORK = (2, 0.0) if split else (math.inf, least)
    try:
        _torch_pinn(model, xy)
    finally:
        VjpCalls.SHARE_AFTER, VjpCalls.SPLIT_MIN_WORK = share, least
    for p in (*model.parameters(), xy):
        p.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    print(f"{'points':>6} {'width':>5} {'lengths':>8} {'vjp_work':>10} {'whole':>9} "
          f"{'split':>9} {'split/whole':>11}")
    for points, width, lengths in SMOKE if args.smoke else SIZES:
        torch.manual_seed(0)
        models = {k: PINN(width, lengths) for k in ("whole", "split")}
        models["split"].load_state_dict(models["whole"].state_dict())
        xy = {k: torch.rand(points, 2, generator=torch.Generator().manual_seed(1))
              .requires_grad_() for k in models}
        for k, m in models.items():
            for _ in range(3):  # the first step runs whole VJPs; the second compiles the split
                step(m, xy[k], k == "split")
        times = {k: [] for k in models}
        for _ in range(3 if args.smoke else args.rounds):
            for k, m in models.items():
                start = time.perf_counter()
                step(m, xy[k], k == "split")
                times[k].append(time.perf_counter() - start)
        whole, split = (1e3 * float(np.median(times[k])) for k in ("whole", "split"))
        entry = models["whole"].trunk._caller.entries[0]
        work = vjp_work(entry.program, (len(entry.program.diff_index) - 1,))
        print(f"{points:6d} {width:5d} {str(lengths):>8} {work:10.3g} {whole:7.2f}ms "
              f"{split:7.2f}ms {split / whole:10.2f}x", flush=True)


if __name__ == "__main__":
    main()
