"""What packing residuals and gradients buys in crossings and costs in program memory.

What this shows, per exchange route (NOTE [Packing per route] in ``bridge/_exchange.py``):
the CPU route (pointer views, arrays up to 64 KiB packed) and the DLPack route (a GPU's,
forced on this CPU; arrays up to 4 MiB packed), for the benchmark's TINY, MEDIUM and DEEP
blocks and for blocks of 16 and 128 unrolled 256 x 256 kernels (256 KiB each):

* crossings per cached forward+backward: torch's own DLPack conversions on the DLPack
  route (``torch._C._to_dlpack``, ``_to_dlpack_versioned``, ``_from_dlpack``, counted as
  ``tests/exchange/test_crossings.py`` counts them), and on the CPU route the pointer
  views and tensors over results the exchange makes;
* how many buffers each program returns and its peak (XLA's ``memory_analysis``:
  arguments + outputs + temporaries - aliased), which packing raises by up to the bytes it
  copies into a buffer.

How to run:
    python examples/bench/packing.py                            # about a minute
    python examples/bench/packing.py --docs docs/benchmarks.md  # and update the docs
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
from bridge import _exchange as bridge_exchange  # noqa: E402
from torchside import FlaxModule  # noqa: E402
from torchside.call._routes import EAGER  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _docs  # noqa: E402
from _workloads import RematStack, TinyMLP, Unrolled, scan_lengths  # noqa: E402

CONVERSIONS = ("_to_dlpack", "_to_dlpack_versioned", "_from_dlpack")
ROUTES = ("auto", "dlpack")  # bridge.EXCHANGE_MODES: the CPU route, the DLPack route


class Kernels(nn.Module):
    """``n`` unrolled 256 x 256 kernels without biases (``tests/exchange/test_crossings.py``)."""

    n: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.n):
            x = jnp.tanh(nn.Dense(256, use_bias=False)(x))
        return x


def blocks(smoke: bool) -> list[tuple[str, nn.Module, int, int]]:
    """``(name, module, batch, width)`` per block measured."""
    out = [("TINY", TinyMLP(64), 8, 64), ("16 kernels", Kernels(16), 8, 256)]
    if not smoke:
        out += [("128 kernels", Kernels(128), 8, 256), ("MEDIUM", Unrolled(512, 16), 128, 512),
                ("DEEP", RematStack(256, scan_lengths(128, 2)), 64, 256)]
    return out


def _counting(counts: dict):
    """Wraps torch's DLPack conversions and the CPU route's views and result tensors."""
    originals = {name: getattr(torch._C, name) for name in CONVERSIONS}
    view, run = bridge_exchange.CpuExchange.view, bridge_exchange.CpuExchange.run

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    def counted_run(self, *args):  # each result a tensor over a JAX buffer
        arrays, tensors = run(self, *args)
        counts["views"] += len(tensors)
        return arrays, tensors

    for name, fn in originals.items():
        setattr(torch._C, name, counted("dlpack", fn))
    bridge_exchange.CpuExchange.view = counted("views", view)
    bridge_exchange.CpuExchange.run = counted_run

    def restore():
        for name, fn in originals.items():
            setattr(torch._C, name, fn)
        bridge_exchange.CpuExchange.view, bridge_exchange.CpuExchange.run = view, run

    return restore


def measure(name: str, module: nn.Module, batch: int, width: int, route: str) -> dict:
    """Crossings of one cached forward+backward and each program's buffers and peak."""
    previous = bridge.set_exchange_mode(route)
    try:
        torch.manual_seed(0)
        m = FlaxModule(module, example_args=(torch.zeros(batch, width),))
        x = torch.randn(batch, width, requires_grad=True)
        ct = torch.randn(batch, width)
        m(x).backward(ct)  # compiles
        counts = {"dlpack": 0, "views": 0}
        restore = _counting(counts)
        try:
            m(x).backward(ct)
        finally:
            restore()
        entry = m._caller.entries[-1]
        programs = {}
        for kind in ("forward_with_residuals", "backward"):
            analysis = entry.program.compiled(kind).memory_analysis()
            peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                    + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
            programs[kind] = (peak, analysis.temp_size_in_bytes)
        holds = entry.holding(entry.routes[EAGER])
        return dict(name=name, route=route, params=len(list(m.parameters())),
                    crossings=counts["dlpack"] if route == "dlpack" else counts["views"],
                    residual_buffers=len(holds.buffers), grad_buffers=len(entry.program.grad_specs),
                    programs=programs)
    finally:
        bridge.set_exchange_mode(previous)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(rows: list[dict]) -> str:
    header = ["block", "route", "parameter tensors", "crossings per call", "residual buffers",
              "gradient buffers", "forward peak (temporaries)", "backward peak (temporaries)"]
    label = {"auto": "CPU (64 KiB)", "dlpack": "DLPack (4 MiB)"}
    body = [[r["name"], label[r["route"]], str(r["params"]), str(r["crossings"]),
             str(r["residual_buffers"]), str(r["grad_buffers"]),
             *(f"{mib(p)} ({mib(t)})" for p, t in r["programs"].values())] for r in rows]
    return _docs.md_table(header, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="two small blocks (for tests)")
    parser.add_argument("--docs", default=None, metavar="PATH",
                        help="also write the table as the packing block of this markdown file")
    args = parser.parse_args()
    if args.docs:
        _docs.check_target(args.docs, full=not args.smoke, script="packing.py")
    rows = [measure(*b, route) for b in blocks(args.smoke) for route in ROUTES]
    text = table(rows)
    print(f"jax {jax.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    print(text)
    if args.docs:
        body = "\n".join([
            f"Produced by `{_docs.command()}`.", "", *_docs.machine(), "",
            "One cached forward+backward per block and route, x and every parameter "
            "requiring grad. Crossings: torch's DLPack conversions on the DLPack route, "
            "pointer views and result tensors on the CPU route. Peak: XLA's memory analysis "
            "of the program (arguments + outputs + temporaries - aliased).", "", text, ""])
        _docs.write_block(args.docs, "packing", body)
        print(f"wrote the packing block of {args.docs}")


if __name__ == "__main__":
    main()
