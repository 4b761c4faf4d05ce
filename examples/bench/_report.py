"""The benchmark's printed tables, its PASS/MISS targets, and its plots.

Each ``print_*`` function prints its tables and returns them as markdown, which
``benchmark.py --docs`` writes into docs/benchmarks.md.
"""

from __future__ import annotations

import os

from _docs import md_table


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Prints ``rows`` under ``header`` as aligned text; returns them as a markdown table."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(
        h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
    )
    print(line)
    print("-" * len(line))
    for r in rows:
        cells = enumerate(zip(r, widths, strict=True))
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in cells))
    print()
    return md_table(header, rows)


def print_workloads(results: list[dict]) -> str:
    if not results:
        return ""
    title = "Forward+backward per call (median), bytes held for backward, agreement with pure JAX"
    print(title)
    header = [
        "workload",
        "leaves",
        "bridge",
        "pure JAX",
        "torch",
        "torch ckpt",
        "bridge/JAX",
        "bridge/torch",
        "held bridge",
        "held torch",
        "held ckpt",
        "max rel diff",
        "calls",
    ]
    rows = []
    for r in results:
        t, h = r["times"], r["held"]
        rows.append(
            [
                r["name"],
                str(r["leaves"]),
                fmt_time(t["bridge"]),
                fmt_time(t["pure JAX"]),
                fmt_time(t["torch"]),
                fmt_time(t["torch ckpt"]),
                f"{t['bridge'] / t['pure JAX']:.2f}x",
                f"{t['bridge'] / t['torch']:.2f}x",
                fmt_bytes(h["bridge"]),
                fmt_bytes(h["torch"]),
                fmt_bytes(h["torch ckpt"]),
                f"{max(r['mismatch'].values()):.1e}",
                str(r["rounds"]),
            ]
        )
    md = [f"### {title}", "", _table(header, rows), ""]
    first = "First call, wall (of which JAX trace+lower+compile)"
    print(f"{first}:")
    md += [f"{first}:", ""]
    for r in results:
        f, c = r["first_call"], r["compile"]
        line = (f"{r['name']} bridge {fmt_time(f['bridge'])} ({fmt_time(c['bridge'])}), "
                f"pure JAX {fmt_time(f['pure JAX'])} ({fmt_time(c['pure JAX'])}), "
                f"torch {fmt_time(f['torch'])}")
        print(f"  {line}")
        md.append(f"- {line}")
    print()
    return "\n".join(md)


def _sweep_names(rows: list[dict], key: str) -> list[str]:
    return list(rows[0][key])


def print_sweep(rows: list[dict]) -> str:
    md = []
    for key, title, fmt in (
        ("held", "Bytes held for backward (beyond parameters and input)", fmt_bytes),
        ("time", "Forward+backward per call (median)", fmt_time),
        ("compile", "Compile seconds (JAX trace+lower+compile in the first call)", fmt_time),
    ):
        names = _sweep_names(rows, key)
        print(f"{title}, by depth (width 64, batch 32)")
        md += [f"### {title}, by depth (width 64, batch 32)", "", _table(
            ["depth", *names], [[str(r["depth"]), *(fmt(r[key][n]) for n in names)] for r in rows]
        ), ""]
    lengths = {k: v for k, v in rows[-1]["lengths"].items() if v}
    line = (
        "remat_scan lengths at depth "
        + f"{rows[-1]['depth']}: "
        + ", ".join(f"{k} {tuple(v)}" for k, v in lengths.items())
    )
    print(line)
    print()
    return "\n".join([*md, line])


def plot_sweep(rows: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [r["depth"] for r in rows]
    paths = []
    for key, ylabel, fname in (
        ("held", "bytes held for backward", "held_bytes_vs_depth.png"),
        ("time", "seconds per forward+backward", "time_vs_depth.png"),
        ("compile", "compile seconds", "compile_vs_depth.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in _sweep_names(rows, key):
            values = [r[key][name] for r in rows]
            style = "--" if name.startswith("torch") else "-"
            ax.plot(depths, [max(v, 1e-9) for v in values], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("depth (residual MLP blocks, width 64, batch 32)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_targets(results: dict, extra: list | None = None) -> str:
    """The table of targets; ``extra`` rows (the real-model ones) come first."""
    rows = list(extra or [])
    by_name = {r["name"]: r for r in results["workloads"]}
    for name, other, label in (
        ("TINY", "torch", "TINY bridge <= torch eager"),
        ("TINY sync", "torch", "TINY bridge <= torch eager (JAX CPU dispatch sync)"),
        ("MEDIUM", "pure JAX", "MEDIUM bridge <= pure JAX jit(value_and_grad)"),
        ("DEEP", "pure JAX", "DEEP bridge <= pure JAX jit(value_and_grad)"),
        ("DEEP nn.remat_scan", "pure JAX", "DEEP (nn.remat_scan) bridge <= pure JAX"),
        ("LEAVES", "pure JAX", "LEAVES bridge <= pure JAX jit(value_and_grad)"),
    ):
        if name in by_name:
            t = by_name[name]["times"]
            ratio = t["bridge"] / t[other]
            rows.append(
                [
                    label,
                    f"{fmt_time(t['bridge'])} vs {fmt_time(t[other])}",
                    f"{ratio:.2f}x",
                    _verdict(ratio <= 1.0),
                ]
            )
    for r in results["workloads"]:
        worst = max(r["mismatch"].values())
        rows.append(
            [
                f"{r['name']}: all contestants compute the same function",
                "max |out - pure JAX| / max |out|",
                f"{worst:.1e}",
                _verdict(worst <= 1e-4),
            ]
        )
    sweep = results["sweep"]
    if sweep:
        first, last = sweep[0], sweep[-1]
        d = last["depth"]
        held = last["held"]
        for kind in ("remat_scan x2", "remat_scan x3"):
            ratio = held[kind] / held["torch ckpt"]
            rows.append(
                [
                    f"held @{d}: {kind} <= torch ckpt / 20",
                    f"{fmt_bytes(held[kind])} vs {fmt_bytes(held['torch ckpt'])}",
                    f"1/{1 / max(ratio, 1e-12):.0f}",
                    _verdict(ratio <= 1 / 20),
                ]
            )
            rows.append(
                [
                    f"held @{d}: {kind} <= checkpoint_sequential",
                    f"{fmt_bytes(held[kind])} vs {fmt_bytes(held['torch ckpt_seq'])}",
                    f"{held[kind] / held['torch ckpt_seq']:.2f}x",
                    _verdict(held[kind] <= held["torch ckpt_seq"]),
                ]
            )
        worst = max(r["mismatch"] for r in sweep)
        rows.append(
            [
                "sweep: every stack computes the same function",
                "max |out - torch| / max |out|",
                f"{worst:.1e}",
                _verdict(worst <= 1e-4),
            ]
        )
        for kind in first["compile"]:
            a, b = first["compile"][kind], last["compile"][kind]
            rows.append(
                [
                    f"compile @{d} <= 2x @{first['depth']}: {kind}",
                    f"{fmt_time(b)} vs {fmt_time(a)}",
                    f"{b / max(a, 1e-9):.2f}x",
                    _verdict(b <= 2 * a),
                ]
            )
    leaves = results.get("leaf_sweep")
    if leaves:
        per_leaf = leaves["per_leaf"]
        rows.append(
            [
                "per extra leaf <= 1 us (bridge, fitted slope)",
                f"pure JAX {per_leaf['pure JAX'] * 1e6:.2f} us, torch "
                f"{per_leaf['torch'] * 1e6:.2f} us",
                f"{per_leaf['bridge'] * 1e6:.2f} us",
                _verdict(per_leaf["bridge"] <= 1e-6),
            ]
        )
        rows.append(
            [
                "leaf sweep: all contestants compute the same function",
                "max |out - pure JAX| / max |out|",
                f"{leaves['mismatch']:.1e}",
                _verdict(leaves["mismatch"] <= 1e-4),
            ]
        )
    if not rows:
        return ""
    title = "Targets (printed, never asserted: timings on a shared machine are noisy)"
    print(title)
    return f"### {title}\n\n" + _table(["target", "measured", "ratio", "verdict"], rows)


_KINDS = {f"{role}{kind}": f"{role.strip()}: {what}" if role else what
          for role in ("", "linearize ", "apply ", "given apply ", "given transpose ")
          for kind, what in (("forward_with_residuals", "forward with residuals"),
                             ("forward", "forward"), ("backward", "backward"))}


def ratio_targets(row: dict, limits, agreement: tuple[str, str]) -> list[list[str]]:
    """Target rows of one workload: ``who <= limit x other`` for each ``(label, other,
    limit)`` of ``limits`` (``who``: "bridge", or a 4th item), then the agreement row
    (``(what, measured as)``) of its worst ``mismatch``, at most 1e-4."""
    t, rows = row["times"], []
    for label, other, limit, *who in limits:
        who = who[0] if who else "bridge"
        ratio = t[who] / t[other]
        rows.append([f"{row['name']}: {who} <= {limit}x {label}",
                     f"{fmt_time(t[who])} vs {fmt_time(t[other])}",
                     f"{ratio:.2f}x", _verdict(ratio <= limit)])
    worst = max(row["mismatch"].values())
    return [*rows, [f"{row['name']}: {agreement[0]}", agreement[1], f"{worst:.1e}",
                    _verdict(worst <= 1e-4)]]


def print_higher(rows: list[dict]) -> tuple[list[list[str]], str]:
    """Prints the higher-order tables (``_higher.py``).

    Returns:
        The target rows for the summary, and the printed tables as markdown.
    """
    from _higher import FLOOR_TARGET, TARGETS, WHOLE

    title = ("Higher-order steps (median per step), agreement of the parameter gradients "
             "with pure JAX")
    print(title)
    names = ("bridge", "pure JAX", "no bridge", "torch", "fast path")
    header = ["workload", *names, "bridge/JAX", "bridge/no bridge", "no bridge/JAX", "fast/JAX",
              "max rel diff", "rounds"]
    table = []
    for r in rows:
        t = r["times"]
        table.append([r["name"], *(fmt_time(t[n]) for n in names),
                      f"{t['bridge'] / t['pure JAX']:.2f}x",
                      f"{t['bridge'] / t['no bridge']:.2f}x",
                      f"{t['no bridge'] / t['pure JAX']:.2f}x",
                      f"{t['fast path'] / t['pure JAX']:.2f}x",
                      f"{max(r['mismatch'].values()):.1e}", str(r["rounds"])])
    md = [f"### {title}", "", _table(header, table), ""]
    for r in rows:
        f, c = r["first_call"], r["compile"]
        line = (f"{r['name']}: {r['describe']}; first call, wall (of which JAX compile): "
                + ", ".join(f"{n} {fmt_time(f[n])} ({fmt_time(c[n])})" for n in names[:3])
                + "; the bridge's second call {} ({})".format(*map(fmt_time, r["second_call"])))
        if WHOLE in r["times"]:
            t = r["times"]
            line += (f"; {WHOLE} (no linearization shared, no residuals given) "
                     f"{fmt_time(t[WHOLE])}, "
                     f"the bridge {t['bridge'] / t[WHOLE]:.2f}x of it")
        print(f"  {line}")
        md.append(f"- {line}")
    print()
    md.append("")
    targets = []
    for r in rows:
        sub = (f"{r['name']}: each order's programs (compiled by the bridge; arrays each "
               f"returns, runs per step and time per run on the no-bridge floor, which runs "
               f"the same schedule), bytes the bridge's step saves for backward, by the order "
               f"whose call saves them")
        print(sub)
        held, seen, lines = r["held"], set(), []
        for p in r["programs"]:
            first = p["order"] not in seen
            seen.add(p["order"])
            lines.append([str(p["order"]), _KINDS.get(p["kind"], p["kind"]), str(p["compiled"]),
                          str(p["arrays"]), f"{p['runs']:g}", fmt_time(p["seconds"]),
                          fmt_time(p["runs"] * p["seconds"]),
                          fmt_bytes(held.get(p["order"], 0)) if first else ""])
        lines.append(["torch", "its own ops", "-", "-", "-", "-", "-",
                      fmt_bytes(held.get("torch", 0))])
        md += [f"#### {sub}", "", _table(["order", "program", "compiled", "arrays out",
                                          "runs/step", "time/run", "time/step", "held"], lines),
               ""]
        for order, what in r["computes"].items():
            print(f"  order {order}: {what}")
            md.append(f"- Order {order}: {what}.")
        t = r["times"]
        rest = r["floor_seconds"] - r["program_seconds"] - r["dlpack_seconds"]
        split = (f"{r['name']}: a floor step timed apart, {fmt_time(r['floor_seconds'])} = JAX "
                 f"programs {fmt_time(r['program_seconds'])} + DLPack "
                 f"{fmt_time(r['dlpack_seconds'])} + torch's ops, autograd and Python "
                 f"{fmt_time(rest)}; in the race the bridge took "
                 f"{(t['bridge'] - t['no bridge']) * 1e3:+.2f} ms per step vs the floor")
        print(split)
        print()
        md += ["", f"- {split}", ""]
        targets += ratio_targets(r, (("pure JAX jit(grad)", "pure JAX", TARGETS[r["name"]]),
                                     ("the no-bridge floor", "no bridge", FLOOR_TARGET),
                                     ("pure JAX jit(grad)", "pure JAX", TARGETS[r["name"]],
                                      "fast path"),
                                     *([("its VJPs whole", WHOLE, 1.0)]
                                       if WHOLE in r["times"] else ())),
                                 ("every contestant computes the same parameter gradients",
                                  "worst leaf: max |g - pure JAX| / max |pure JAX|"))
    return targets, "\n".join(md)
