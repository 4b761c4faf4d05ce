"""The sharded-training tables of the benchmark: what ``_shard.shard_rows`` measured, printed.

Split from ``_shard.py``, which runs the workers and measures; this file only formats.
"""

from __future__ import annotations

from _shard import AGREE, BF16, BF16_AGREE, FLOAT32, FSDP_TARGET, NAMES, SHARDED, TARGET, WORLD


def _ranks(values: list, fmt) -> str:
    """One figure if every rank has it, else each rank's, ``rank 0 / rank 1``."""
    return fmt(values[0]) if len(set(values)) == 1 else " / ".join(map(fmt, values))


def print_shard(rows: list[dict]) -> tuple[list[list[str]], str]:
    """Prints the sharded-training tables (``shard_rows``).

    Returns:
        The target rows for the summary, and the printed tables as markdown.
    """
    from _report import _table, _verdict, fmt_bytes, fmt_time

    targets, md = [], []
    for r in rows:
        title = (f"Sharded training over {WORLD} processes: median step (the slower rank's, "
                 f"per round), bytes per rank")
        print(title)
        losses = ", ".join(f"{n} {v[0]:.6g} then {v[1]:.6g}" for n, v in r["losses"].items())
        head = [f"{r['describe']}; {r['rounds']} rounds",
                f"global loss of step 1 and step 2: {losses}; max relative difference "
                f"{r['mismatch']:.1e} (float32), {r['mismatch_bf16']:.1e} (bfloat16 policy, "
                f"against pure JAX in float32)"]
        for line in head:
            print(f"  {line}")
        md += [f"### {title}", "", *(f"- {line[0].upper()}{line[1:]}." for line in head), ""]
        targets.append([f"{r['name']}: the {len(FLOAT32)} float32 contestants compute the "
                        f"same losses", "max |loss - pure JAX| / |loss|, steps 1 and 2",
                        f"{r['mismatch']:.1e}", _verdict(r["mismatch"] <= AGREE)])
        targets.append([f"{r['name']}: the bfloat16 contestants within bfloat16 of them",
                        "max |loss - pure JAX| / |loss|, steps 1 and 2",
                        f"{r['mismatch_bf16']:.1e}", _verdict(r["mismatch_bf16"] <= BF16_AGREE)])
        if r["mismatch"] > AGREE or r["mismatch_bf16"] > BF16_AGREE:  # times compare nothing
            print("  times not reported: the contestants disagree\n")
            md += ["- Times not reported: the contestants disagree.", ""]
            continue
        t, base, fsdp = r["times"], r["times"]["pure JAX SPMD"], r["times"]["fully_shard whole"]
        whole, layer = r["whole_params"], r["whole_params"] // r["depth"]
        table = []
        for n in NAMES:
            peaks = [max(p["peak"] for p in ranks[n].values()) for ranks in r["programs"]]
            against = t["fully_shard whole bf16"] if n in BF16 else fsdp
            table.append([n, fmt_time(t[n]), f"{t[n] / base:.2f}x", f"{t[n] / against:.2f}x",
                          " / ".join(fmt_time(s) for s in r["rank_medians"][n]),
                          _ranks([h[n]["params"] for h in r["held"]], fmt_bytes),
                          _ranks([h[n]["optimizer"] for h in r["held"]], fmt_bytes),
                          _ranks(peaks, fmt_bytes), fmt_time(r["first"][n])])
        md += [_table(["contestant", "step", "vs pure JAX", "vs fully_shard (same policy)",
                       "rank 0 / 1",
                       "params held", "AdamW state held", "largest program peak",
                       "first step"], table), ""]
        programs = [[n, kind, _ranks([ranks[n][kind]["peak"] for ranks in r["programs"]],
                                     fmt_bytes),
                     str(p["in_loops"]), str(p["elsewhere"])]
                    for n in NAMES for kind, p in r["programs"][0][n].items()]
        md += [_table(["contestant", "XLA program", "peak", "collectives in loop bodies",
                       "elsewhere"], programs), ""]
        notes = [
            "step: forward on the rank's half batch, MSE loss, backward, AdamW update; median "
            "over rounds of the slower rank's time (rank 0 / 1: each rank's median); first "
            "step: compiling included",
            f"held: a rank's parameters and AdamW moments between steps (local shards); the "
            f"whole block is {fmt_bytes(whole)} of parameters, {fmt_bytes(3 * whole)} with "
            f"the moments, one layer {fmt_bytes(layer)}",
            "peak: XLA's memory analysis of a program on that rank (arguments + outputs + "
            "temporaries - donated); collectives: its HLO's, static counts, those in loop "
            "bodies run once per scan iteration (per layer), the others once per call",
            f"the bridge's programs hold neither the AdamW state nor FSDP2's shards; for "
            f"fully_shard whole they take the gathered whole block ({fmt_bytes(whole)}) and "
            f"the backward returns full-size gradients ({fmt_bytes(whole)}) before FSDP2's "
            f"reduce-scatter; FSDP2's own collectives (torch gloo: one all-gather of the "
            f"block, kept through the backward as FSDP2 does for a root module, one "
            f"reduce-scatter) are not in them; pure JAX's one program takes and returns "
            f"(donated) the parameters and AdamW state: its peak includes what is held",
            "sharded on: " + ", ".join(f"{n.split('.', 2)[-1]} dim {d}"
                                       for n, d in r["dims"].items()),
        ]
        for note in notes:
            print(f"  {note}")
        print()
        md += [f"- {note[0].upper()}{note[1:]}." for note in notes] + [""]
        limit = 3 * whole // WORLD + 3 * layer  # parameters and two moments
        for n in SHARDED:
            held = max(h[n]["params"] + h[n]["optimizer"] for h in r["held"])
            targets.append([f"{r['name']}: {n} params + AdamW state per rank <= "
                            f"whole / {WORLD} + one layer",
                            f"{fmt_bytes(held)} vs {fmt_bytes(limit)}",
                            f"{held / (3 * whole):.2f} of whole", _verdict(held <= limit)])
        for n in (n for n in SHARDED if n not in BF16):  # pure JAX runs in float32
            ratio = t[n] / base
            targets.append([f"{r['name']}: {n} step <= {TARGET}x pure JAX SPMD",
                            f"{fmt_time(t[n])} vs {fmt_time(base)}", f"{ratio:.2f}x",
                            _verdict(ratio <= TARGET)])
        for n in SHARDED:
            against = "fully_shard whole bf16" if n in BF16 else "fully_shard whole"
            ratio = t[n] / t[against]
            targets.append([f"{r['name']}: {n} step <= {FSDP_TARGET}x {against}",
                            f"{fmt_time(t[n])} vs {fmt_time(t[against])}", f"{ratio:.2f}x",
                            _verdict(ratio <= FSDP_TARGET)])
    return targets, "\n".join(md)
