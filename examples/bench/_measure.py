"""How the benchmark measures: timed calls, held bytes, compile seconds, one contestant each.

A "call" is one forward and one backward with a fixed random cotangent, gradients reaching
every parameter and the input. Times are medians over repeated calls after warm-up calls;
gradients are dropped between calls (``set_to_none``) outside the timed region.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from torchside import FlaxModule

# JAX reports how long each trace, lowering and backend compile took; their sum over a first
# call is its compile time, free of the time the call then spends computing.
_COMPILE_EVENTS = frozenset(
    (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )
)
_compile_seconds = [0.0]

# Where every contestant runs: "cpu", or "cuda" (``benchmark.py --device cuda``), set once
# before any contestant is built. On "cuda" a call ends with torch.cuda.synchronize(), so
# that the time of a call is the time of its kernels and not of their launch.
DEVICE = ["cpu"]


def set_device(device: str) -> None:
    """Where the contestants run. On CUDA, float32 matmuls run in full float32 on both
    frameworks: JAX's GPU default is TF32 and torch's is not, so their timings would compare
    different arithmetic, and their outputs differ by TF32's rounding (the first GPU run's
    agreement rows: 4e-4 to 1e-3)."""
    DEVICE[0] = device
    if device == "cuda":
        jax.config.update("jax_default_matmul_precision", "highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def sync() -> None:
    if DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


# NOTE [Torch threads]. torch's default intra-op thread count is the machine's cores. With
# OMP_WAIT_POLICY=PASSIVE (the scripts set it, so that torch's idle threads leave the cores
# to XLA's) a multi-threaded kernel wakes a sleeping thread, and on a 2-core machine a call
# made of small ops (TINY, the PINN's torch twin) runs several times slower on two threads
# than on one, while large ones (MEDIUM) run faster on two. Timed at the default alone,
# such a contestant, the torch twin above all, was compared at its worst. So every race
# times each contestant at the default count and at one thread, in the same rounds, and
# reports its faster median; ``ONE_THREAD`` records, per race, who was faster on one.
ONE_THREAD: dict[str, list[str]] = {}


def thread_counts() -> list[int]:
    """torch's intra-op thread counts a race times each contestant at (NOTE above)."""
    default = torch.get_num_threads()
    return [default, 1] if default > 1 else [default]


def best_of_threads(contestants, rounds: int, label: str, reset: bool = True) -> dict:
    """``{name: median seconds}`` over ``rounds`` interleaved rounds, each contestant at its
    faster thread count (NOTE [Torch threads]); ``label`` names the race in ``ONE_THREAD``."""
    counts, default = thread_counts(), torch.get_num_threads()
    times = {(c.name, n): [] for c in contestants for n in counts}
    try:
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                torch.ones(1 << 16).sum()  # wakes the pool: no contestant pays the switch
                for c in contestants:
                    start = time.perf_counter()
                    c.call()
                    times[c.name, n].append(time.perf_counter() - start)
                    if reset:
                        c.reset()
    finally:
        torch.set_num_threads(default)
    medians = {k: statistics.median(t) for k, t in times.items()}
    best = {c.name: min(counts, key=lambda n, c=c: medians[c.name, n]) for c in contestants}
    ONE_THREAD[label] = [name for name, n in best.items() if n == 1 and n != default]
    return {name: medians[name, n] for name, n in best.items()}


def race(contestants, *, budget: float, min_repeats: int, warmup: int = 1, label: str = ""):
    """Median seconds per call of each contestant, measured in interleaved rounds.

    Round-robin (one call of each contestant per round and thread count) so that load from
    other processes on a shared machine hits every contestant alike, each at its faster
    torch thread count (``best_of_threads``). The number of rounds fills ``budget`` seconds,
    at least ``min_repeats``.

    Returns:
        ``({name: median seconds}, rounds)``.
    """
    one = {}
    for c in contestants:
        for _ in range(warmup):
            c.call()
            c.reset()
        start = time.perf_counter()
        c.call()
        one[c.name] = time.perf_counter() - start
        c.reset()
    per_round = len(thread_counts()) * sum(one.values())
    rounds = max(min_repeats, min(1000, int(budget / max(per_round, 1e-6))))
    return best_of_threads(contestants, rounds, label), rounds


def one_thread_line() -> str | None:
    """A markdown bullet: per race, the contestants reported at one torch thread."""
    # Contestants' names hold commas ("pure JAX split, dots"): " / " between them.
    faster = [f"{label}: {' / '.join(names)}" for label, names in ONE_THREAD.items() if names]
    if len(thread_counts()) < 2:
        return None
    return (f"- torch threads: every contestant timed at {torch.get_num_threads()} and at 1 "
            f"in the same rounds, its faster median given (NOTE [Torch threads] in "
            f"examples/bench/_measure.py); faster on 1: "
            + ("; ".join(faster) if faster else "none"))


def held_bytes(call: Callable, exclude: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for backward during ``call()``, beyond the ``exclude`` storages.

    Every tensor autograd saves passes through ``saved_tensors_hooks`` (including inputs
    saved by non-reentrant ``torch.utils.checkpoint``). Storages of parameters and of the
    input are memory the model holds anyway, so they are excluded; each other storage is
    counted once, whole.
    """
    known = {t.untyped_storage().data_ptr() for t in exclude}
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(held.values())


def torch_inputs(workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The workload's input (requiring grad) and cotangent, in memory torch allocated.

    Copied by torch rather than wrapped with ``torch.from_numpy``: numpy aligns its buffers
    to 16 bytes only, and the bridge copies a tensor that is not 64-byte aligned where it
    shares a user's torch-allocated one (``bridge.is_zero_copy``), so a wrapped input would
    make the bridge's rows depend on where numpy happened to place it.
    """
    return (torch.tensor(workload.x, device=DEVICE[0], requires_grad=True),
            torch.tensor(workload.cotangent, device=DEVICE[0]))


class Contestant:
    """One way of running a workload: ``call()`` does forward+backward, ``reset()`` clears."""

    name: str
    params: list[torch.Tensor] = []

    def call(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        for t in self.params:
            t.grad = None

    def output(self) -> np.ndarray:
        raise NotImplementedError

    def held(self) -> int | None:
        return held_bytes(self.call_and_keep, [*self.params]) if self.params else None

    def call_and_keep(self) -> None:
        self.call()
        self.reset()

    def first_call(self) -> tuple[float, float]:
        """Wall seconds of the very first call, and the JAX compile seconds within it."""
        compiled = _compile_seconds[0]
        start = time.perf_counter()
        self.call()
        elapsed = time.perf_counter() - start
        self.reset()
        return elapsed, _compile_seconds[0] - compiled


class Bridge(Contestant):
    """torch -> ``FlaxModule`` -> torch, backward through torch autograd."""

    def __init__(self, workload):
        self.name = "bridge"
        self.module = FlaxModule(workload.module, variables=workload.variables).to(DEVICE[0])
        self.x, self.cotangent = torch_inputs(workload)
        self.params = [*self.module.parameters(), self.x]

    def call(self) -> None:
        y = self.module(self.x)
        y.backward(self.cotangent)
        sync()
        self.last = y.detach()

    def output(self) -> np.ndarray:
        """The output of the last call."""
        return self.last.cpu().numpy()


class PureJax(Contestant):
    """``jit(value_and_grad)`` of the same function: the limit a bridge can approach."""

    def __init__(self, workload):
        self.name = "pure JAX"
        apply = workload.module.apply

        def loss(variables, x, cotangent):
            return jnp.vdot(apply(variables, x), cotangent)

        self.step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        self.forward = jax.jit(apply)
        device = jax.devices("gpu" if DEVICE[0] == "cuda" else "cpu")[0]
        self.args = jax.device_put((workload.variables, workload.x, workload.cotangent), device)

    def call(self) -> None:
        jax.block_until_ready(self.step(*self.args))

    def output(self) -> np.ndarray:
        return np.asarray(self.forward(*self.args[:2]))

    def held(self) -> None:
        return None


class TorchEager(Contestant):
    """The torch twin, eager; ``mode`` is ``"none"``, ``"per-layer"`` or ``"sequential"``."""

    MODES = ("none", "per-layer", "sequential")

    def __init__(self, workload, layers: list[torch.nn.Module], mode: str = "none"):
        if mode not in self.MODES:
            raise ValueError(f"TorchEager: mode {mode!r} is not one of {self.MODES}.")
        self.name = {"none": "torch", "per-layer": "torch ckpt", "sequential": "torch ckpt_seq"}[
            mode
        ]
        self.mode = mode
        self.layers = torch.nn.Sequential(*layers).to(DEVICE[0])
        self.x, self.cotangent = torch_inputs(workload)
        self.params = [*self.layers.parameters(), self.x]
        # sqrt(depth) segments: the classic memory-optimal split (Chen et al. 2016).
        self.segments = max(1, round(len(layers) ** 0.5))

    def forward(self, x):
        if self.mode == "none":
            return self.layers(x)
        if self.mode == "sequential":
            return checkpoint_sequential(self.layers, self.segments, x, use_reentrant=False)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x

    def call(self) -> None:
        y = self.forward(self.x)
        y.backward(self.cotangent)
        sync()
        self.last = y.detach()

    def output(self) -> np.ndarray:
        """The output of the last call."""
        return self.last.cpu().numpy()
