"""Writing measured figures into docs/benchmarks.md: markdown tables, the machine, the command.

docs/benchmarks.md is hand-written prose around generated blocks. Each block lies between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` and belongs to one script (``benchmark``
to ``examples/bench/benchmark.py``, ``call_costs`` to ``examples/bench/call_costs.py``),
which replaces it whole with the date, the machine, the exact command and its tables. The
committed file takes only full-size runs: a reduced run (``--quick``, ``--smoke``, the
tests' tiny sizes) would replace the figures with meaningless ones, so it is refused there
and may write to any other path.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # examples/bench/ -> the repository root
COMMITTED = ROOT / "docs" / "benchmarks.md"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table; columns whose cells all start with a number are right-aligned."""
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    def numeric(i):
        return all(r[i][:1].isdigit() or r[i][:1] == "-" for r in rows)

    rule = "|" + "|".join("---:" if i and numeric(i) else "---" for i in range(len(header))) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def cpu_model() -> str:
    """The CPU's model name, as the kernel reports it (``platform`` as a fallback)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _commit() -> str:
    """The code measured: the commit, and whether the work tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        # docs/ is not code: a run right after another's (the benchmark's, then
        # call_costs'), or beside an edit of the prose, measured the same code.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!docs"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with local changes" if dirty else "")


def machine() -> list[str]:
    """Markdown bullet lines: date, code, CPU, cores, threads and library versions."""
    import torch

    versions = ", ".join(f"{name} {v}" for name in
                         ("torch", "jax", "jaxlib", "flax", "numpy", "transformers")
                         if (v := _version(name)) is not None)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    gpus = []
    if torch.cuda.is_available():
        import jax

        precision = jax.config.jax_default_matmul_precision or "default (TF32 on recent GPUs)"
        gpus = [f"- GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), "
                f"CUDA {torch.version.cuda}; float32 matmuls: JAX precision {precision}, "
                f"torch allow_tf32={torch.backends.cuda.matmul.allow_tf32}"]
    return [
        f"- date: {now}",
        f"- code: {_commit()}",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        f"- versions: {versions}",
        *gpus,
    ]


def command() -> str:
    """The command line that ran this script, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def check_target(path: str, *, full: bool, script: str) -> None:
    """Refuses a reduced run's figures for the committed docs/benchmarks.md."""
    if Path(path).resolve() == COMMITTED and not full:
        raise SystemExit(
            f"{script}: --docs {path} is the committed docs/benchmarks.md, which takes only "
            f"the figures of a full run (the script's default sizes and parts); run it "
            f"without --quick, --smoke, --only or size options, or pass another path (e.g. "
            f"--docs /tmp/benchmarks.md) to check the output."
        )


def write_block(path: str, name: str, body: str) -> None:
    """Replaces the ``name`` block of the markdown file at ``path`` with ``body``.

    A file that does not exist is created holding the block alone; an existing file must
    have both markers.
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    target = Path(path)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block + "\n")
        return
    text = target.read_text()
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{path} has no {begin} ... {end} block to replace; add the two "
                         f"markers where the generated figures belong.")
    target.write_text(text[:start] + block + text[stop + len(end):])
