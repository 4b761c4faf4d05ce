"""GPU check: runs flaxtorch's CUDA tests and a memory comparison, prints a pass/fail table.

What this shows: on a machine with a CUDA GPU (and a CUDA build of jaxlib), that the
bridge follows the device, orders DLPack exchanges on torch's and JAX's streams, does not
let JAX preallocate the GPU, and how many bytes a deep remat-scan block holds for backward
on the GPU next to the same depth without remat, and what a call costs per parameter
tensor on the GPU (the benchmark's leaf-count sweep: bridge, pure JAX and torch eager,
1 to 4,096 leaves at a fixed total size). The ``gpu``-marked tests include the stream
ordering rules of ``tests/test_exchange_ordering.py``. Without a GPU it says so and exits 0.

How to run:
    python examples/gpu_check.py
"""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _collector(store: list):
    def pack(t):
        store.append(t)
        return t

    return pack


def memory_comparison() -> list[tuple[str, str]]:
    import flax.linen as nn

    import bridge  # noqa: F401 - keeps JAX from preallocating
    from torchside import FlaxModule

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(x)))

    class Remat(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat_scan(nn.remat(Block), lengths=(16, 16))(name="s")(x)

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(lambda m, c, _: (m(c), None), variable_axes={"params": 0},
                           split_rngs={"params": True}, length=256)
            return scan(Block(name="s"), x, None)[0]

    rows = []
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    for name, module in (("remat_scan (16,16)", Remat()), ("scan, no remat", Plain())):
        m = FlaxModule(module, example_args=(x.detach().cpu(),)).cuda()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(_collector(packed), lambda t: t):
            y = m(x)
        skip = {p.data_ptr() for p in m.parameters()} | {x.data_ptr()}
        held = sum(t.numel() * t.element_size() for t in packed if t.data_ptr() not in skip)
        y.sum().backward()
        rows.append((f"held bytes, depth 256, {name}", f"{held:,}"))
    return rows


def main() -> int:
    if not gpu_available():
        print("gpu_check: no CUDA GPU visible to both torch and JAX here; nothing to check.")
        return 0
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
         str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True,
    )
    rows = []
    for line in result.stdout.splitlines():
        for status in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            if line.startswith(status + " "):
                rows.append((line[len(status) + 1:].split(" - ")[0], status))
    rows += memory_comparison()
    width = max(len(r[0]) for r in rows)
    print(f"{'check'.ljust(width)}  result")
    for name, status in rows:
        print(f"{name.ljust(width)}  {status}")
    print()
    from _bench_leaves import leaf_sweep, print_leaf_sweep
    from _bench_report import fmt_time

    print_leaf_sweep(leaf_sweep((1, 16, 256, 1024, 4096), budget=2.0, min_repeats=7,
                                device="cuda"), fmt_time)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
