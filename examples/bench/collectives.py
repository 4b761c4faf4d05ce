"""What one layer's collectives cost on a 2-process CPU mesh (gloo), each way XLA can move it.

The figures behind NOTE [Per-rank stacks] (``flaxside/mesh/_per_rank.py``): one layer of the
benchmark's sharded block (``_workloads.Block``, width 256: six parameters, 1 MiB in
float32) moved inside a ``lax.scan`` of 8 iterations under ``shard_map``, per iteration:

* ``tuple all-reduce``: the six gradients reduced as the partitioner leaves them (one
  all-reduce of six operands once XLA's combiner merged them);
* ``packed all-reduce`` / ``packed reduce-scatter``: the same bytes as one buffer;
* ``all-to-all + sum``: each rank sends each rank its part and sums what it receives
  (a reduce-scatter's bytes, ``_per_rank.scattered``);
* ``all-gather`` / ``all-to-all gather``: half a layer per rank gathered to the whole
  (``_per_rank.gathered``).

How to run: ``python examples/bench/collectives.py`` (about 30 s); it starts both processes
and prints the median milliseconds per iteration of two rounds, minus nothing (the
``no collective`` row is the loop's own cost).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

WIDTH, LAYERS = 256, 8
SHAPES = [(WIDTH,), (WIDTH, 2 * WIDTH), (2 * WIDTH,), (2 * WIDTH, WIDTH), (WIDTH,), (WIDTH,)]


def _worker(rank: int, port: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("s",))
    total = sum(int(np.prod(s)) for s in SHAPES)
    # Per rank and iteration, a full layer's worth of partial gradients (total floats).
    x = jax.make_array_from_callback(
        (LAYERS, 2 * total), NamedSharding(mesh, P(None, "s")),
        lambda index: np.ones((LAYERS, 2 * total), np.float32)[index])

    def parts(row):
        out, offset = [], 0
        for s in SHAPES:
            size = int(np.prod(s))
            out.append(row[offset: offset + size].reshape(s))
            offset += size
        return out

    def gather_half(row):
        return row[: total // 2]

    ways = {
        "no collective": lambda r: r.sum(),
        "tuple all-reduce": lambda r: sum(a.sum() for a in jax.lax.psum(parts(r), "s")),
        "packed all-reduce": lambda r: jax.lax.psum(r, "s").sum(),
        "packed reduce-scatter": lambda r: jax.lax.psum_scatter(r, "s", tiled=True).sum(),
        "all-to-all + sum": lambda r: jax.lax.all_to_all(
            r.reshape(2, -1), "s", 0, 0, tiled=True).sum(0).sum(),
        "all-gather": lambda r: jax.lax.all_gather(gather_half(r), "s", tiled=True).sum(),
        "all-to-all gather": lambda r: jax.lax.all_to_all(
            jnp.broadcast_to(gather_half(r), (2, total // 2)), "s", 0, 0, tiled=True).sum(),
    }

    def program(way):
        def body(c, row):
            return c + way(row), None

        return jax.jit(jax.shard_map(
            lambda x: jax.lax.scan(body, jnp.zeros(()), x)[0][None], mesh=mesh,
            in_specs=P(None, "s"), out_specs=P("s"), check_vma=False))

    def per_iteration(f) -> float:
        for _ in range(3):
            jax.block_until_ready(f(x))
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - start)
        return float(np.median(times)) * 1e3 / LAYERS

    programs = {name: program(way) for name, way in ways.items()}
    rounds = [{name: per_iteration(f) for name, f in programs.items()} for _ in range(2)]
    if rank == 0:
        print(f"one layer ({total * 4 / 2**20:.2f} MiB float32), 2 processes, gloo: "
              "ms per scan iteration, two rounds")
        for name in ways:
            print(f"  {name:24s} " + "  ".join(f"{r[name]:6.2f}" for r in rounds))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port)],
                                env=env, stdout=None if r == 0 else subprocess.DEVNULL)
               for r in range(2)]
    codes = [w.wait(timeout=600) for w in workers]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    main()
