"""The benchmark's leaf-count sweep: what a call costs per parameter tensor.

One model per leaf count ``n``: ``y = x * concat(p_1, ..., p_n)`` with ``n`` parameter
vectors whose sizes add up to a fixed total, so the arithmetic is the same at every ``n``
and only the number of tensors changes. Each ``n`` runs as ``FlaxModule``, as pure JAX
``jit(value_and_grad)`` and as the torch twin (a ``ParameterList`` and ``torch.cat``),
interleaved; a least-squares line through time against ``n`` gives each contestant's cost
per extra leaf. ``device="cuda"`` runs the same sweep on a GPU (``examples/gpu_check.py``).
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from _docs import md_table
from _measure import best_of_threads, thread_counts

from torchside import FlaxModule

TOTAL = 1 << 14  # parameter elements at every leaf count
BATCH = 4


class Leaves(nn.Module):
    """``x * concat(p_0 .. p_{n-1})``: ``n`` parameter vectors of ``TOTAL // n`` elements."""

    n: int

    @nn.compact
    def __call__(self, x):
        size = TOTAL // self.n
        ps = [self.param(f"p{i}", nn.initializers.normal(1.0), (size,)) for i in range(self.n)]
        return x * jnp.concatenate(ps)


def leaf_variables(n: int) -> dict:
    """``Leaves(n)``'s variables, drawn directly (Flax's ``init`` with thousands of
    ``self.param`` calls takes minutes to trace)."""
    rng = np.random.default_rng(n)
    size = TOTAL // n
    return {"params": {f"p{i}": jnp.asarray(rng.standard_normal(size, dtype=np.float32))
                       for i in range(n)}}


class _Contestant:
    name = ""

    def __init__(self, device: str):
        self.device = device

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


class _Bridge(_Contestant):
    name = "bridge"

    def __init__(self, variables, x, ct, n, device):
        super().__init__(device)
        self.module = FlaxModule(Leaves(n), variables=variables).to(device)
        self.x = torch.from_numpy(x).to(device).requires_grad_()
        self.ct = torch.from_numpy(ct).to(device)
        self.params = [*self.module.parameters(), self.x]

    def call(self):
        y = self.module(self.x)
        y.backward(self.ct)
        self.sync()
        self.out = y.detach()
        for p in self.params:
            p.grad = None


class _PureJax(_Contestant):
    name = "pure JAX"

    def __init__(self, variables, x, ct, n, device):
        super().__init__(device)
        apply = Leaves(n).apply
        self.step = jax.jit(jax.value_and_grad(
            lambda v, x, c: jnp.vdot(apply(v, x), c), argnums=(0, 1)))
        self.forward = jax.jit(apply)
        jax_device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        self.args = jax.device_put((variables, x, ct), jax_device)

    def call(self):
        jax.block_until_ready(self.step(*self.args))
        self.out = self.forward(*self.args[:2])


class _Torch(_Contestant):
    name = "torch"

    def __init__(self, variables, x, ct, n, device):
        super().__init__(device)
        ps = [np.asarray(variables["params"][f"p{i}"]) for i in range(n)]
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.from_numpy(p.copy()))
                                          for p in ps]).to(device)
        self.x = torch.from_numpy(x).to(device).requires_grad_()
        self.ct = torch.from_numpy(ct).to(device)
        self.params = [*self.ps, self.x]

    def call(self):
        y = self.x * torch.cat(list(self.ps))
        y.backward(self.ct)
        self.sync()
        self.out = y.detach()
        for p in self.params:
            p.grad = None


def _race(contestants, budget: float, min_repeats: int, label: str) -> dict:
    """Median seconds per call, contestants interleaved round by round, each at its faster
    torch thread count (``_measure.race``)."""
    for c in contestants:
        c.call()  # compile and warm up
        c.call()
    start = time.perf_counter()
    for c in contestants:
        c.call()
    one = time.perf_counter() - start
    rounds = max(min_repeats, min(500, int(budget / max(len(thread_counts()) * one, 1e-6))))
    return best_of_threads(contestants, rounds, label, reset=False)


def leaf_sweep(counts, *, budget: float, min_repeats: int, device: str = "cpu") -> dict:
    """Time per call against the number of parameter leaves, for each contestant.

    Returns:
        ``{"counts": [...], "time": {name: [seconds per count]}, "per_leaf": {name:
        seconds per extra leaf}, "mismatch": max relative output difference}``.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, TOTAL), dtype=np.float32)
    ct = rng.standard_normal((BATCH, TOTAL), dtype=np.float32)
    times = {"bridge": [], "pure JAX": [], "torch": []}
    mismatch = 0.0
    for n in counts:
        variables = leaf_variables(n)
        contestants = [cls(variables, x, ct, n, device) for cls in (_Bridge, _PureJax, _Torch)]
        t = _race(contestants, budget, min_repeats, f"leaf sweep {n}")
        for name in times:
            times[name].append(t[name])
        outs = [np.asarray(c.out.cpu() if isinstance(c.out, torch.Tensor) else c.out)
                for c in contestants]
        scale = float(np.abs(outs[1]).max())
        mismatch = max(mismatch, *(float(np.abs(o - outs[1]).max()) / scale for o in outs))
    per_leaf = {name: float(np.polyfit(np.asarray(counts, float), np.asarray(ts), 1)[0])
                for name, ts in times.items()}
    return {"counts": list(counts), "time": times, "per_leaf": per_leaf,
            "mismatch": mismatch, "device": device}


def print_leaf_sweep(result: dict, fmt_time) -> str:
    """Prints the sweep as a table, then each contestant's fitted cost per extra leaf.

    Returns:
        The same as markdown.
    """
    names = list(result["time"])
    header = ["leaves", *names, "bridge/JAX", "bridge/torch"]
    rows = []
    for k, n in enumerate(result["counts"]):
        t = {name: result["time"][name][k] for name in names}
        rows.append([str(n), *(fmt_time(t[name]) for name in names),
                     f"{t['bridge'] / t['pure JAX']:.2f}x", f"{t['bridge'] / t['torch']:.2f}x"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    title = (f"Forward+backward per call against parameter leaves ({TOTAL} parameter elements "
             f"in all, batch {BATCH}, {result['device']})")
    print(title)
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    slope = "cost per extra leaf (least-squares slope): " + ", ".join(
        f"{name} {result['per_leaf'][name] * 1e6:.2f} us" for name in names)
    print(slope)
    print()
    return f"### {title}\n\n{md_table(header, rows)}\n\n{slope[0].upper()}{slope[1:]}."


def plot_leaf_sweep(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ts in result["time"].items():
        ax.plot(result["counts"], ts, "--" if name == "torch" else "-", marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"parameter leaves ({TOTAL} elements in all, batch {BATCH})")
    ax.set_ylabel("seconds per forward+backward")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
