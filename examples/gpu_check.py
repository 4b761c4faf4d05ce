"""GPU check: every device, ordering, DDP and allocator check flaxtorch has, as one table.

What this shows, on a machine with a CUDA GPU and a CUDA build of jaxlib:

* the ``gpu``-marked tests: the module follows its device and matches the CPU, DLPack
  exchanges are ordered on torch's and JAX's streams (``tests/exchange/test_ordering.py``
  records one fence per program run and checks the streams it names), round trips are
  zero-copy, JAX does not preallocate beside torch, and, with two or more GPUs, 2-rank DDP
  over NCCL on ``cuda:0`` / ``cuda:1`` equals one process (``tests/trainers/test_ddp.py``),
  and so does a block sharded over those two ranks (``tests/trainers/test_shard.py``);
* ``tests/devices/cases.py`` (FlaxModule Linen and NNX, jax_function, remat_stack,
  recompute, torch.compile, memory_report, each against pure JAX on the right device) with
  CUDA tensors while JAX's default device is the CPU, with CPU tensors while it is the GPU,
  and with two GPUs, with tensors on ``cuda:1`` while it is GPU 0 (the ``torchrun`` case);
* two allocators on one GPU: torch's and JAX's peak pool bytes over a training step of a
  deep remat-scan block (torch layers around it), and the bytes that block holds for
  backward next to the same depth without remat;
* the benchmark's leaf-count sweep on the GPU: what a call costs per parameter tensor;
* with two or more GPUs, ``examples/train_sharded.py`` under torchrun over NCCL (one GPU
  per rank): it trains, holds at most half the block plus a layer per rank, and reloads its
  DCP checkpoint into a model that computes the same.

Without a GPU it says so and exits 0.

Each part prints its rows as it finishes; a part that runs past ``--timeout`` seconds is
stopped and reported as such, so that one hang does not hide the rest. ``--log DIR`` keeps
each part's whole output (tracebacks included) in DIR.

How to run:
    python examples/gpu_check.py
    python examples/gpu_check.py --log gpu_logs --timeout 240 --skip leaves
"""

import argparse
import json
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


def _env(extra: dict) -> dict:
    return {**os.environ, **extra,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


LOG_DIR: Path | None = None  # --log: each part's whole output is kept there
TIMEOUT = 900.0  # --timeout: seconds for one part, so that one hang cannot eat the rest


def _keep(name: str, text: str) -> None:
    if LOG_DIR is not None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        (LOG_DIR / name).write_text(text)


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _show(rows: list) -> None:
    """Prints rows as soon as a part has them: a run cut short still shows what it got."""
    for name, status in rows:
        print(f"  {status:8}  {name}", flush=True)


def pytest_rows(args: list[str], label: str = "", env: dict | None = None,
                log: str = "pytest.txt") -> tuple[list, int]:
    """Runs pytest in a subprocess; a ``(test, status)`` row per test, and the exit code.

    Verbose, so that a part stopped at ``TIMEOUT`` still names each test it finished; the
    failures' short tracebacks are printed, and everything is kept under ``--log``.
    """
    command = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider",
               *args]
    try:
        result = subprocess.run(command, cwd=ROOT, env=_env(env or {}), capture_output=True,
                                text=True, timeout=TIMEOUT)
        out, err, code = result.stdout, result.stderr, result.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = _text(e.stdout), _text(e.stderr), None
    _keep(log, out + "\n" + err)
    rows = []
    for line in out.splitlines():
        test, _, rest = line.partition(" ")
        status = rest.split(" ")[0]
        if "::" in test and status in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"):
            rows.append((f"{test}{f' [{label}]' if label else ''}", status))
    if code is None:
        rows.append((f"pytest {' '.join(args)} {label}", f"timed out after {TIMEOUT:.0f} s"))
    elif code not in (0, 5) and not rows:  # 5: nothing collected
        rows.append((f"pytest {' '.join(args)} {label}", f"exit {code}"))
    if code != 0 and code != 5:
        failures = out[out.find("= FAILURES ="):] if "= FAILURES =" in out else out
        print(failures[-6000:], err[-2000:], sep="\n", flush=True)
    _show(rows)
    return rows, 1 if code is None else code


_STEP = r"""
import json, sys
import flax.linen as nn
import jax
import torch
import bridge  # before JAX starts its GPU backend: no preallocation
from torchside import FlaxModule

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(x)))

class Deep(nn.Module):
    remat: bool
    @nn.compact
    def __call__(self, x):
        if self.remat:
            return nn.remat_scan(nn.remat(Block), lengths=(16, 16))(name="s")(x)
        scan = nn.scan(lambda m, c, _: (m(c), None), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=256)
        return scan(Block(name="s"), x, None)[0]

remat = sys.argv[1] == "remat"
width, batch = 256, 256
model = torch.nn.Sequential(torch.nn.Linear(width, width),
                            FlaxModule(Deep(remat), example_args=(torch.zeros(batch, width),)),
                            torch.nn.Linear(width, 1)).cuda()
opt = torch.optim.AdamW(model.parameters())
x, y = torch.randn(batch, width, device="cuda"), torch.randn(batch, 1, device="cuda")

def step():
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

step()  # compiles; the measured step follows
torch.cuda.synchronize()
gpu = bridge.jax_device(torch.device("cuda", 0))
torch.cuda.reset_peak_memory_stats()
packed = []
h = model[0](x).detach().requires_grad_()
with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
    out = model[1](h)  # the block alone: what it holds beyond its parameters and input
skip = {p.data_ptr() for p in model.parameters()} | {h.data_ptr()}
held = sum(t.numel() * t.element_size() for t in packed if t.data_ptr() not in skip)
del out, packed, h
step()
torch.cuda.synchronize()
after = gpu.memory_stats() or {}
print(json.dumps({
    "held": held,
    "torch_peak_allocated": torch.cuda.max_memory_allocated(),
    "torch_peak_reserved": torch.cuda.max_memory_reserved(),
    "jax_peak_in_use": after.get("peak_bytes_in_use"),
    "jax_pool": after.get("pool_bytes", after.get("bytes_reserved")),
    "gpu_used": torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0],
}))
"""


def allocator_rows() -> list[tuple[str, str]]:
    """Both allocators over one training step, each variant in a fresh process.

    torch's peaks are reset before the measured step; JAX's ``peak_bytes_in_use`` cannot
    be reset, so it covers the whole process (the compiling step included).
    """
    rows = []
    for variant in ("remat", "plain"):
        try:
            result = subprocess.run([sys.executable, "-c", _STEP, variant], cwd=ROOT,
                                    env=_env({}), capture_output=True, text=True,
                                    timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            rows.append((f"training step, {variant}", f"timed out after {TIMEOUT:.0f} s"))
            continue
        _keep(f"step_{variant}.txt", result.stdout + "\n" + result.stderr)
        if result.returncode != 0:
            rows.append((f"training step, {variant}", f"exit {result.returncode}"))
            print(result.stderr[-3000:])
            continue
        m = json.loads(result.stdout.strip().splitlines()[-1])
        name = "remat_scan (16,16)" if variant == "remat" else "scan, no remat"
        mb = lambda n: "n/a" if n is None else f"{n / 2**20:,.1f} MiB"  # noqa: E731
        rows += [
            (f"depth 256, {name}: held for backward", f"{m['held']:,} B"),
            (f"depth 256, {name}: torch peak allocated / reserved (step)",
             f"{mb(m['torch_peak_allocated'])} / {mb(m['torch_peak_reserved'])}"),
            (f"depth 256, {name}: JAX peak in use (process) / pool",
             f"{mb(m['jax_peak_in_use'])} / {mb(m['jax_pool'])}"),
            (f"depth 256, {name}: GPU memory in use after the step", mb(m["gpu_used"])),
        ]
    _show(rows)
    return rows


def sharded_example_rows() -> list:
    """``examples/train_sharded.py`` on two GPUs over NCCL, as its docstring runs it."""
    name = "examples/train_sharded.py, torchrun on 2 GPUs (NCCL)"
    if torch.cuda.device_count() < 2:
        return [(name, "SKIPPED (needs two GPUs)")]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "2", str(ROOT / "examples" / "train_sharded.py"), "--steps", "20"],
            env=_env({}), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return [(name, f"timed out after {TIMEOUT:.0f} s")]
    _keep("train_sharded.txt", done.stdout + "\n" + done.stderr)
    bounded = len([line for line in done.stdout.splitlines()
                   if line.startswith("rank ") and ": yes)" in line]) == 2
    same = "computes the same outputs on every rank" in done.stdout
    if done.returncode == 0 and bounded and same:
        return [(name, "PASSED")]
    print(f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [(name, f"exit {done.returncode}" if done.returncode else "FAILED")]


def main(argv=None) -> int:
    global LOG_DIR, TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", default=None, metavar="DIR",
                        help="keep each part's whole output in this folder")
    parser.add_argument("--timeout", type=float, default=TIMEOUT,
                        help="seconds one part may run before it is stopped and reported")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: "
                        "tests, cases, allocators, sharded, leaves")
    args = parser.parse_args(argv)
    LOG_DIR = Path(args.log) if args.log else None
    TIMEOUT = args.timeout
    skip = {p.strip() for p in args.skip.split(",") if p.strip()}
    if not gpu_available():
        print("gpu_check: no CUDA GPU visible to both torch and JAX here; nothing to check.")
        return 0
    codes, rows = [], []
    if "tests" not in skip:
        print("gpu-marked tests:", flush=True)
        more, code = pytest_rows(["-m", "gpu", str(ROOT / "tests")], log="gpu_tests.txt")
        rows += more
        codes.append(code)
    cases = str(ROOT / "tests" / "devices" / "cases.py")
    variants = [("cuda tensors, JAX default cpu", {"FLAXTORCH_TEST_TORCH_DEVICE": "cuda:0",
                                                   "FLAXTORCH_TEST_JAX_DEFAULT": "cpu:0"}),
                ("cpu tensors, JAX default gpu", {"FLAXTORCH_TEST_TORCH_DEVICE": "cpu",
                                                  "FLAXTORCH_TEST_JAX_DEFAULT": "gpu:0"})]
    if torch.cuda.device_count() >= 2:
        variants.append(("cuda:1 tensors, JAX default gpu:0",
                         {"FLAXTORCH_TEST_TORCH_DEVICE": "cuda:1",
                          "FLAXTORCH_TEST_JAX_DEFAULT": "gpu:0"}))
    for k, (label, env) in enumerate(variants if "cases" not in skip else []):
        print(f"tests/devices/cases.py, {label}:", flush=True)
        more, code = pytest_rows([cases], label, env, log=f"cases_{k}.txt")
        rows += more
        codes.append(code)
    if "allocators" not in skip:
        print("allocators:", flush=True)
        rows += allocator_rows()
    if "sharded" not in skip:
        rows += sharded_example_rows()
    width = max((len(r[0]) for r in rows), default=5)
    print(f"\n{'check'.ljust(width)}  result")
    for name, status in rows:
        print(f"{name.ljust(width)}  {status}")
    print(flush=True)
    if "leaves" not in skip:
        sys.path.insert(0, str(ROOT / "examples" / "bench"))  # the benchmark's leaf sweep
        from _leaves import leaf_sweep, print_leaf_sweep
        from _report import fmt_time

        print_leaf_sweep(leaf_sweep((1, 16, 256, 1024, 4096), budget=2.0, min_repeats=7,
                                    device="cuda"), fmt_time)
    failed = [c for c in codes if c not in (0, 5)] or [
        1 for _, s in rows if s in ("FAILED", "ERROR") or s.startswith(("exit", "timed out"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
