"""Where a cached call's host work goes, for ``call_costs.py``: by function and by step.

* ``host_profile``: MEDIUM's forward+backward on ``DEVICE`` under cProfile, the functions
  with the most own time per call;
* ``python_calls_per_call``: how many Python function calls TINY's cached forward+backward
  makes (cProfile), a count that compares versions of the bridge on any machine;
* ``time_breakdown``: TINY's forward+backward on the CPU route with each step (program
  dispatch, views, the held arrays' check, waits) timed by a wrapper.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time

import torch
from _measure import DEVICE, sync, torch_inputs
from _sizes import SIZES
from benchmark import workloads

from bridge import _exchange as bridge_exchange
from torchside import FlaxModule


def host_profile(top: int, repeats: int) -> tuple[str, float, list[tuple[str, float]]]:
    """Host seconds per cached forward+backward of the benchmark's MEDIUM ``FlaxModule``
    on ``DEVICE``, and the ``top`` functions by own time per call (cProfile)."""
    (medium,) = workloads(["medium"], SIZES["full"])
    layer = FlaxModule(medium.module, variables=medium.variables).to(DEVICE[0])
    x, ct = torch_inputs(medium)
    for _ in range(3):  # compile and settle
        layer(x).backward(ct)
    sync()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(repeats):
        layer(x).backward(ct)
    sync()
    profile.disable()
    per_call = (time.perf_counter() - start) / repeats
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(((f"{os.path.basename(f)}:{line} {name} ({nc // repeats} calls)", tt / repeats)
                   for (f, line, name), (_, nc, tt, _, _) in stats.items()),
                  key=lambda r: -r[1])[:top]
    return medium.describe(), per_call, rows


def python_calls_per_call(tiny, repeats: int) -> float:
    """Python function calls per cached forward+backward of TINY through ``FlaxModule``."""
    layer = FlaxModule(tiny.module, variables=tiny.variables).to(DEVICE[0])
    x, ct = torch_inputs(tiny)
    for _ in range(3):  # compile and settle
        layer(x).backward(ct)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(repeats):
        layer(x).backward(ct)
    profile.disable()
    return pstats.Stats(profile).total_calls / repeats


def time_breakdown(tiny, calls: int) -> list[tuple[str, float, int]]:
    """Where a cached forward+backward of TINY's ``FlaxModule`` spends its time (CPU route).

    ``(step, median seconds per occurrence, occurrences per call)`` over ``calls`` calls
    at one torch thread, each step timed by a wrapper (which adds a little to each): the
    two program dispatches, the views of arguments and cotangents, the held arrays'
    check, the gradients' views, the waits, and the whole forward and backward.
    """
    from bridge import _held
    from torchside.call import _entry

    layer = FlaxModule(tiny.module, variables=tiny.variables)
    x, ct = torch_inputs(tiny)
    layer(x).backward(ct)  # compiles
    times: dict[str, list[float]] = {}

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            times.setdefault(label, []).append(time.perf_counter() - start)
            return out
        return wrapper

    entry = layer._caller.entries[-1]
    executables = dict(entry._executables)
    last_args = {}

    def keeping(kind, fn):
        def wrapper(*args):
            last_args[kind] = args
            return fn(*args)
        return wrapper

    for kind, (exe, templates) in executables.items():
        entry._executables[kind] = (timed(f"program dispatch: {kind}", keeping(kind, exe)),
                                    templates)
    patched = [(bridge_exchange.CpuExchange, "view", "a view of an argument or cotangent"),
               (bridge_exchange.CpuExchange, "wait", "a wait for a program's results"),
               (_held.HeldArrays, "arrays", "the held arrays' check (forward)"),
               (_held.HeldArrays, "gather", "the held arrays' check (backward)"),
               (_entry.Entry, "gradients", "the gradients viewed out of their buffer")]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patched]
    threads = torch.get_num_threads()
    try:
        for owner, name, label in patched:
            fn = getattr(owner, name)
            setattr(owner, name, staticmethod(timed(label, fn)) if isinstance(
                owner.__dict__[name], staticmethod) else timed(label, fn))
        torch.set_num_threads(1)
        for _ in range(calls):
            start = time.perf_counter()
            y = layer(x)
            mid = time.perf_counter()
            y.backward(ct)
            times.setdefault("forward, whole", []).append(mid - start)
            times.setdefault("backward, whole", []).append(time.perf_counter() - mid)
            layer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        entry._executables.update(executables)
    # The same dispatch back to back, nothing else run between (caches and JAX's threads
    # warm): what it costs in a tight loop, against its share of a real step above.
    exe, _ = executables["forward_with_residuals"]
    args = last_args["forward_with_residuals"]
    for _ in range(calls):
        start = time.perf_counter()
        out = exe(*args)
        times.setdefault("program dispatch: forward_with_residuals, back to back", []).append(
            time.perf_counter() - start)
        for a in out:
            a.block_until_ready()
    skip = calls // 4  # settling
    return [(label, statistics.median(t[skip * len(t) // calls:]), len(t) // calls)
            for label, t in times.items()]
