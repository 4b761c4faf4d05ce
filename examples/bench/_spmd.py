"""What the sharded benchmarks' workers share (``_shard.py``'s 2 ranks, ``shard2d.py``'s 2x2).

Data, the torch and pure JAX steps, the timed rounds, the launcher and the readings of a
program (peak bytes, collectives in and out of loop bodies) and of what a rank holds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LR, WEIGHT_DECAY = 1e-3, 1e-2  # torch.optim.AdamW and optax.adamw, same betas and eps


def data(blocks: int, block: int, batch: int, width: int):
    """``(x_all, y_all, rows)``: the global inputs and targets, ``blocks`` blocks of
    ``batch`` rows, the same on every rank, and the slice of this rank's block."""
    import numpy as np

    rng = np.random.default_rng(1)
    x_all, y_all = (rng.standard_normal((blocks * batch, width), dtype=np.float32)
                    for _ in range(2))
    return x_all, y_all, slice(block * batch, (block + 1) * batch)


def torch_steps(x, y, opts: dict):
    """``torch_step(name, model)``: a step of ``model`` (MSE on ``x``, ``y``, backward,
    ``torch.optim.AdamW`` with optax's settings, kept in ``opts[name]``); the loss."""
    import torch
    import torch.nn.functional as F

    def torch_step(name, model):
        opt = opts[name] = torch.optim.AdamW(model.parameters(), lr=LR,
                                             weight_decay=WEIGHT_DECAY)

        def step():
            loss = F.mse_loss(model(x).float(), y)  # a bfloat16 output's loss in float32
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    return torch_step


def pure_jax_step(apply, variables, xg, yg, jax_mesh):
    """Pure JAX's contestant: ``(step, box, compiled)``, one jitted AdamW step of the mean
    squared error of ``apply(variables, xg)`` against ``yg`` over ``jax_mesh``.

    Each moment is sharded as its parameter, the step counter replicated; the step's
    outputs are pinned to its inputs' shardings, so that donation reuses every buffer.
    ``box`` holds the parameters and the state, ``compiled`` the program once run (compiled
    ahead: its memory analysis is that of the program run).
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)  # betas (0.9, 0.999), eps 1e-8: torch's

    def train_step(v, state, x, y):
        loss, grads = jax.value_and_grad(lambda v: jnp.mean((apply(v, x) - y) ** 2))(v)
        updates, state = tx.update(grads, state, v)
        return optax.apply_updates(v, updates), state, loss

    replicated = NamedSharding(jax_mesh, P())
    state_shardings = optax.tree_map_params(
        tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, variables), variables,
        transform_non_params=lambda _: replicated)
    box = [variables, jax.jit(tx.init, out_shardings=state_shardings)(variables)]
    jitted = jax.jit(train_step, donate_argnums=(0, 1),
                     out_shardings=(jax.tree.map(lambda a: a.sharding, variables),
                                    state_shardings, replicated))
    compiled = []

    def step():
        if not compiled:
            compiled.append(jitted.lower(*box, xg, yg).compile())
        box[0], box[1], loss = compiled[0](box[0], box[1], xg, yg)
        jax.block_until_ready((box, loss))
        return loss

    return step, box, compiled


def measure(steps: dict, spec: dict) -> dict:
    """Each contestant's two checked steps (the first compiling), warmup, then ``spec``'s
    rounds, interleaved (machine noise hits every contestant alike), every rank starting
    each step together; ``{"first", "losses", "times"}``. A loss is the global mean: a JAX
    one replicated, a torch one each rank's mean over its rows averaged over the ranks
    (equal row counts; ranks of a tensor axis, on the same rows, count alike)."""
    import jax
    import torch.distributed as dist

    world = dist.get_world_size()

    def global_loss(loss) -> float:
        if isinstance(loss, jax.Array):
            return float(loss.addressable_data(0))
        loss = loss.clone()
        dist.all_reduce(loss)
        return float(loss) / world

    report = {"first": {}, "losses": {}, "times": {n: [] for n in steps}}
    for name, step in steps.items():
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        report["first"][name] = time.perf_counter() - start
        report["losses"][name] = [global_loss(loss), global_loss(step())]
        for _ in range(spec["warmup"]):
            step()
    for _ in range(spec["rounds"]):
        for name, step in steps.items():
            dist.barrier()  # a round's time is the slowest rank's
            start = time.perf_counter()
            step()
            report["times"][name].append(time.perf_counter() - start)
    return report


def _addressable(tree) -> int:
    """Bytes this process holds of ``tree``'s arrays (their addressable shard), 0-d aside."""
    import jax

    return sum(a.addressable_data(0).nbytes for a in jax.tree.leaves(tree) if a.ndim)


def launch(script: str, args: list[str], world: int, env: dict, tmp: str, what: str,
           timeout: float = 600) -> None:
    """Runs ``python script --worker RANK *args`` for every rank and waits.

    Output goes to files, not pipes: a rank blocked on a full pipe would hang the others.

    Raises:
        RuntimeError: a worker failed or ran past ``timeout`` (its log's tail says why).
    """
    logs = [Path(tmp) / f"rank{r}.log" for r in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen([sys.executable, script, "--worker", str(rank),
                                           *args], env=env, stdout=sink,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # killed below: its exit code says so
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        tails = "\n".join(f"rank {r} exited with {p.returncode}:\n{log.read_text()[-3000:]}"
                          for r, (p, log) in enumerate(zip(procs, logs, strict=True)))
        raise RuntimeError(f"{what}: a worker failed\n{tails}")


def worker_env() -> dict:
    """The workers' environment: JAX on the CPU, torch's idle threads passive, the repo
    root importable."""
    return dict(os.environ, JAX_PLATFORMS="cpu", OMP_WAIT_POLICY=os.environ.get(
        "OMP_WAIT_POLICY", "PASSIVE"), PYTHONPATH=os.pathsep.join(
        p for p in (str(HERE.parents[1]), os.environ.get("PYTHONPATH")) if p))


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


_COLLECTIVE = re.compile(
    r"\b(?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _program(compiled) -> dict:
    """An executable's peak bytes (XLA: arguments + outputs + temporaries - donated) and its
    collective ops (static counts) in while-loop bodies (run per iteration) and elsewhere."""
    m = compiled.memory_analysis()
    text = compiled.as_text()
    bodies = set(re.findall(r"\bbody=%([\w.\-]+)", text))
    counts = [0, 0]
    for computation in re.split(r"\n(?=[%A-Z])", text):
        name = re.match(r"(?:ENTRY )?%([\w.\-]+)", computation)
        inside = bool(name) and name.group(1) in bodies
        counts[0 if inside else 1] += len(_COLLECTIVE.findall(computation))
    return dict(peak=m.argument_size_in_bytes + m.output_size_in_bytes
                + m.temp_size_in_bytes - m.alias_size_in_bytes,
                in_loops=counts[0], elsewhere=counts[1])


def _bridge_programs(module) -> dict:
    """Per program kind a ``FlaxModule``'s calls ran, its ``_program`` figures.

    Reads the module's call cache, read only, as ``tests/support/pipeline.py`` does
    (internals: no public API lists the executables a call ran).
    """
    return {kind: _program(e.program.compiled(kind))
            for e in module._caller.entries for kind in e._executables}
