"""A block sharded over a 2x2 ("fsdp", "tensor") mesh of 4 CPU processes (gloo), three ways.

The figures of docs/benchmarks.md "Sharded training on a 2-D mesh". ``TPScan``: a stack of
pre-LayerNorm residual MLP layers whose kernels carry logical names (``"embed"`` over
"fsdp", the hidden ``"mlp"`` units over "tensor", Megatron's column then row split), under
``nn.scan(nn.remat(...))``; ``TPStack`` the same layers through ``flaxside.remat_stack``.
Contestants, the same weights and data, trained with AdamW:

* ``sharded 2-D`` and ``sharded remat_stack 2-D``: ``torchside.shard(FlaxModule(...),
  mesh, axis_rules=RULES)``, the batch over "fsdp" (each "tensor" pair of ranks sees the
  same rows), a kernel a quarter per rank;
* ``fully_shard whole``: the ``TPScan`` ``FlaxModule`` unsharded under FSDP2's
  ``fully_shard`` over ``mesh["fsdp"]`` as one unit, on the same rows (each "tensor" pair
  computes the same: no tensor parallelism);
* ``pure JAX SPMD 2-D``: the Flax block on the JAX runtime ``shard`` started, parameters
  sharded as ``shard`` placed them, one jitted ``value_and_grad`` and ``optax.adamw``
  step, parameters and state donated.

Each runs two checked steps first (their global losses must agree: the forward, then
AdamW's update, which a gradient's scale barely moves; tests/trainers/test_shard_2d.py
compares the gradients themselves), then interleaved
timed rounds; a round's time is its slowest rank's. Printed: the median step, ratios to
pure JAX and to ``fully_shard``, what a rank holds (parameters, AdamW moments) and each XLA
program's peak (memory analysis) and collectives in and out of loop bodies.

How to run: ``python examples/bench/shard2d.py`` (it starts the 4 processes; under a
minute on 2 cores); ``--quick`` for a small one; ``--docs docs/benchmarks.md`` also writes the
tables there. Four processes on this 2-core machine
share the cores: the step times are each contestant's under the same contention, so only
the ratios of one run compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's idle threads must not spin
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _docs  # noqa: E402
from _report import fmt_bytes, fmt_time  # noqa: E402
from _spmd import launch, worker_env  # noqa: E402

NAMES = ("sharded 2-D", "sharded remat_stack 2-D", "fully_shard whole", "pure JAX SPMD 2-D")
WORLD, SHAPE = 4, (2, 2)
RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("layers", None))
AGREE = 1e-4  # relative difference of the checked losses, float32 sums in four orders


def _blocks():
    import flax.linen as nn

    import flaxside

    def named(init, *names):
        return nn.with_logical_partitioning(init, names)

    class TPLayer(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x):
            k = nn.initializers.lecun_normal()
            h = nn.LayerNorm(scale_init=named(nn.initializers.ones_init(), "embed"),
                             bias_init=named(nn.initializers.zeros_init(), "embed"))(x)
            h = nn.Dense(2 * self.width, kernel_init=named(k, "embed", "mlp"),
                         bias_init=named(nn.initializers.zeros_init(), "mlp"))(h)
            return x + nn.Dense(self.width, kernel_init=named(k, "mlp", "embed"),
                                bias_init=named(nn.initializers.zeros_init(), "embed"))(
                nn.gelu(h))

    class Scanned(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x, _):
            return TPLayer(self.width, name="layer")(x), None

    class TPScan(nn.Module):
        width: int
        depth: int

        @nn.compact
        def __call__(self, x):
            scan = nn.scan(nn.remat(Scanned), variable_axes={"params": 0},
                           split_rngs={"params": True}, length=self.depth,
                           metadata_params={nn.PARTITION_NAME: "layers"})
            return scan(self.width, name="stack")(x, None)[0]

    def tp_stack(width, depth):
        return flaxside.remat_stack(TPLayer, depth, lengths=(depth,), width=width)

    return TPScan, tp_stack


def _worker(rank: int, port: int, out: str, spec: dict) -> None:
    import jax
    import numpy as np
    import torch
    import torch.distributed as dist
    from _spmd import (
        _addressable,
        _bridge_programs,
        _local_bytes,
        _program,
        data,
        measure,
        pure_jax_step,
        torch_steps,
    )
    from flax.traverse_util import unflatten_dict
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchside import FlaxModule, shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    width, depth, batch = spec["width"], spec["depth"], spec["batch"]
    TPScan, tp_stack = _blocks()
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("fsdp", "tensor"))
    example = (torch.zeros(batch, width),)
    with torch.device("meta"):
        scanned = FlaxModule(TPScan(width, depth), example_args=example, seed=0)
        stacked = FlaxModule(tp_stack(width, depth), example_args=example)
    shard(scanned, mesh, axis_rules=RULES)  # JAX's distributed runtime starts here
    shard(stacked, mesh, axis_rules=RULES)
    scanned.to_empty(device="cpu")
    scanned.reset_parameters()
    initial = {n: p.full_tensor().detach() for n, p in scanned.named_parameters()}
    stacked.to_empty(device="cpu")
    with torch.no_grad():  # the same weights: "params.stack.layer.X" is remat_stack's "params.X"
        for n, p in stacked.named_parameters():
            whole = initial[n.replace("params.", "params.stack.layer.", 1)]
            p.to_local().copy_(distribute_tensor(whole, mesh, p.placements,
                                                 src_data_rank=None).to_local())
    whole_block = FlaxModule(TPScan(width, depth), example_args=example, seed=0)
    whole_block.load_state_dict(initial)
    fully_shard(whole_block, mesh=mesh["fsdp"])

    row = rank // SHAPE[1]  # init_device_mesh lays ranks out row by row: fsdp = rank // 2
    x_all, y_all, rows = data(SHAPE[0], row, batch, width)
    x, y = torch.from_numpy(x_all[rows]), torch.from_numpy(y_all[rows])
    opts = {}
    torch_step = torch_steps(x, y, opts)

    # Pure JAX on the JAX mesh shard() built: process mesh.mesh[i, j] at (i, j).
    by_process = {d.process_index: d for d in jax.devices()}
    jax_mesh = jax.sharding.Mesh(np.vectorize(by_process.__getitem__, otypes=[object])(
        mesh.mesh.numpy()), ("fsdp", "tensor"))
    local = jax.local_devices()[0]

    def spec_of(p):
        entries = [[] for _ in range(p.dim())]
        for name, placement in zip(("fsdp", "tensor"), p.placements, strict=True):
            if isinstance(placement, Shard):
                entries[placement.dim].append(name)
        return P(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))

    def global_array(value, shape, spec):
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(jax_mesh, spec), [jax.device_put(np.array(value), local)])

    specs = {n: spec_of(p) for n, p in scanned.named_parameters()}
    variables = unflatten_dict({tuple(n.split(".")): global_array(
        p.to_local().detach().numpy(), tuple(p.shape), specs[n])
        for n, p in scanned.named_parameters()})
    xg, yg = (global_array(a[rows], a.shape, P("fsdp")) for a in (x_all, y_all))
    jax_step, box, compiled = pure_jax_step(TPScan(width, depth).apply, variables, xg, yg,
                                            jax_mesh)

    steps = {"sharded 2-D": torch_step("sharded 2-D", scanned),
             "sharded remat_stack 2-D": torch_step("sharded remat_stack 2-D", stacked),
             "fully_shard whole": torch_step("fully_shard whole", whole_block),
             "pure JAX SPMD 2-D": jax_step}

    report = measure(steps, spec)
    report["held"] = {
        name: {"params": _local_bytes(m.parameters()),
               "optimizer": _local_bytes(v for p in m.parameters()
                                         for v in opts[name].state[p].values() if v.dim())}
        for name, m in (("sharded 2-D", scanned), ("sharded remat_stack 2-D", stacked),
                        ("fully_shard whole", whole_block))}
    report["held"]["pure JAX SPMD 2-D"] = {"params": _addressable(box[0]),
                                           "optimizer": _addressable(box[1])}
    report["programs"] = {"sharded 2-D": _bridge_programs(scanned),
                          "sharded remat_stack 2-D": _bridge_programs(stacked),
                          "fully_shard whole": _bridge_programs(whole_block),
                          "pure JAX SPMD 2-D": {"step": _program(compiled[0])}}
    report["whole_params"] = sum(p.numel() * p.element_size() for p in initial.values())
    report["specs"] = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]: str(s)
                       for n, s in specs.items()}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(spec: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "shard2d")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        launch(__file__, [str(port), out, json.dumps(spec)], WORLD, worker_env(), tmp,
               "shard2d.py", timeout=900)
        return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small block, 2 rounds")
    parser.add_argument("--docs", default=None, metavar="PATH",
                        help="also write the tables as the shard2d block of this markdown "
                             "file (docs/benchmarks.md: the default size only)")
    args = parser.parse_args()
    if args.docs:
        _docs.check_target(args.docs, full=not args.quick, script="shard2d.py")
    spec = (dict(width=32, depth=4, batch=8, warmup=0, rounds=2) if args.quick else
            dict(width=256, depth=16, batch=64, warmup=1, rounds=11))
    t0 = time.perf_counter()
    ranks = _run(spec)
    times = {n: statistics.median(map(max, zip(*(r["times"][n] for r in ranks), strict=True)))
             for n in NAMES}
    losses = ranks[0]["losses"]
    reference = losses["pure JAX SPMD 2-D"]
    mismatch = max(abs(v - r) / abs(r) for n in NAMES
                   for v, r in zip(losses[n], reference, strict=True))
    lines = [
        f"TPScan: {spec['depth']} layers, width {spec['width']}, batch {spec['batch']} per "
        f"'fsdp' rank; mesh ('fsdp', 'tensor') = {SHAPE}, 4 gloo processes on "
        f"{os.cpu_count()} CPU cores; {spec['rounds']} rounds; measured in "
        f"{time.perf_counter() - t0:.0f} s",
        "global loss of step 1 and step 2: " + ", ".join(
            f"{n} {v[0]:.6g} then {v[1]:.6g}" for n, v in losses.items())
        + f"; max relative difference {mismatch:.1e}"]
    if mismatch > AGREE:
        print("\n".join(lines))
        raise SystemExit("shard2d.py: the contestants disagree; no times")
    base, fsdp = times["pure JAX SPMD 2-D"], times["fully_shard whole"]
    steps = []
    for n in NAMES:
        peak = max(p["peak"] for r in ranks for p in r["programs"][n].values())
        steps.append([n, fmt_time(times[n]), f"{times[n] / base:.2f}x",
                      f"{times[n] / fsdp:.2f}x",
                      fmt_bytes(max(r["held"][n]["params"] for r in ranks)),
                      fmt_bytes(max(r["held"][n]["optimizer"] for r in ranks)), fmt_bytes(peak),
                      f"{max(r['first'][n] for r in ranks):.2f} s"])
    programs = [[n, kind, fmt_bytes(p["peak"]), str(p["in_loops"]), str(p["elsewhere"])]
                for n in NAMES for kind, p in ranks[0]["programs"][n].items()]
    tables = [
        _docs.md_table(["contestant", "step", "vs pure JAX", "vs fully_shard", "params held",
                        "AdamW state held", "largest program peak", "first step"], steps),
        _docs.md_table(["contestant", "XLA program", "peak", "collectives in loop bodies",
                        "elsewhere"], programs)]
    notes = [f"whole block {fmt_bytes(ranks[0]['whole_params'])} of parameters; sharded as: "
             + ", ".join(f"{k} {v}" for k, v in sorted(ranks[0]["specs"].items())),
             "held and peak: the largest rank's; step: median over rounds of the slowest "
             "rank's time; each worker runs torch on one thread"]
    out = "\n\n".join(["\n".join(f"- {line}" for line in lines), *tables,
                        "\n".join(f"- {note}" for note in notes)])
    print(out)
    if args.docs:
        _docs.write_block(args.docs, "shard2d", "\n".join(
            [f"Produced by `{_docs.command()}`.", "", *_docs.machine(), "", out]))
        print(f"wrote the shard2d block of {args.docs}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
    else:
        main()
