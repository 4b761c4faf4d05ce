"""Sharded training of a deep Flax block over 2 torch processes (gloo, CPU), four ways.

One ``_workloads.RematScan`` stack, the same weights and data, trained with AdamW on
one 2-process mesh as ``sharded`` (``torchside.shard(FlaxModule(...))``: DTensor shards,
one program per call; its layers compute the same on each rank's rows, so it runs per rank
and moves each layer by one all-to-all each way, NOTE [Per-rank scans]),
``sharded remat_stack`` (the same block as ``_workloads.RematStack``: the same parameters
and function through ``flaxside.remat_stack``, whose loops gather each layer as one buffer,
NOTE [One collective per layer]), ``fully_shard whole`` (the same ``FlaxModule``
unsharded under FSDP2's ``fully_shard`` as one unit: each rank gathers and holds every
layer for the step) and ``pure JAX SPMD`` (the Flax block on the JAX distributed runtime
``shard`` brought up, parameters sharded on the dimensions ``shard`` chose, one jitted step
of ``value_and_grad`` and ``optax.adamw``, parameters and state donated). Two more in
bfloat16, with FSDP2's usual ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` on both sides (compute in bfloat16, gradients summed over the
ranks in float32): ``sharded remat_stack bf16`` (``shard(..., mp_policy=...)``) and
``fully_shard whole bf16``. The torch contestants use ``torch.optim.AdamW``.

A step: forward on the rank's half of the batch, MSE loss, backward, update. Each contestant
first runs two checked steps: the global losses of step 1 (the forward, same weights) and
step 2 (after one AdamW update, which a gradient's scale barely moves: the tests compare
gradients themselves) must agree, or no times are printed.

How to run: ``python examples/bench/benchmark.py --only shard --quick``; it starts the
workers, ``python examples/bench/_shard.py --worker RANK WORLD PORT OUT SPEC``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _spmd import (  # noqa: E402
    _addressable,
    _bridge_programs,
    _local_bytes,
    _program,
    data,
    launch,
    measure,
    pure_jax_step,
    torch_steps,
    worker_env,
)

FLOAT32 = ("sharded", "sharded remat_stack", "fully_shard whole", "pure JAX SPMD")
BF16 = ("sharded remat_stack bf16", "fully_shard whole bf16")
NAMES = FLOAT32 + BF16
SHARDED = ("sharded", "sharded remat_stack", "sharded remat_stack bf16")
WORLD = 2
# Sharded step <= this x pure JAX SPMD. The bridge runs a step as two SPMD programs (forward
# with residuals, backward; between them the collectives per layer of the fused program)
# with torch's autograd between them, then torch's AdamW over DTensors, op by op; pure JAX
# fuses forward, backward and update into one program. On one process the split costs a
# few percent against jit(value_and_grad) (the DEEP rows); AdamW's per-op dispatch over
# DTensors is the rest, a fixed cost per leaf that a deep block's step should dwarf.
TARGET = 1.5
# Sharded step <= this x fully_shard of the whole block: FSDP2's speed, within the cost of
# holding 1/N of the block (a gather per layer where FSDP2 gathers the block once).
FSDP_TARGET = 1.3
AGREE = 1e-4  # relative difference of the checked losses, float32 sums in three orders
BF16_AGREE = 2.0**-5  # the bfloat16 contestants' losses against pure JAX's float32 ones


# -- one worker process ---------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, out: str, spec: dict) -> None:
    import jax
    import numpy as np
    import torch
    import torch.distributed as dist
    from flax.traverse_util import unflatten_dict
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    sys.path.insert(0, str(HERE))
    from _workloads import RematScan, RematStack
    from torch.distributed.tensor import distribute_tensor

    from torchside import FlaxModule, shard

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # one core per rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    lengths, width, batch = tuple(spec["lengths"]), spec["width"], spec["batch"]
    flax_block = RematScan(width, lengths)

    def build():  # on meta: nothing allocated, no JAX backend started (NOTE [Sharded blocks])
        with torch.device("meta"):
            return FlaxModule(flax_block, example_args=(torch.zeros(batch, width),), seed=0)

    mesh = init_device_mesh("cpu", (world,))  # the CPU, even where CUDA is available
    sharded = build()
    shard(sharded, mesh)  # JAX's distributed runtime starts here
    sharded.to_empty(device="cpu")
    sharded.reset_parameters()  # each rank computes its own shards
    initial = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build_stacked(mp_policy=None):
        with torch.device("meta"):  # the same parameters (names, shapes), the same function
            module = FlaxModule(RematStack(width, lengths),
                                example_args=(torch.zeros(batch, width),))
        shard(module, mesh, mp_policy=mp_policy)
        module.to_empty(device="cpu")
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.to_local().copy_(distribute_tensor(initial[n].detach(), mesh, p.placements,
                                                     src_data_rank=None).to_local())
        return module

    def build_whole(mp_policy=None):
        module = build()
        module.to_empty(device="cpu")
        module.load_state_dict(initial)
        # One FSDP2 unit: the whole block gathered for each step.
        fully_shard(module, mesh=mesh, **({} if mp_policy is None else {"mp_policy": mp_policy}))
        return module

    stacked, whole = build_stacked(), build_whole()
    stacked_bf16, whole_bf16 = build_stacked(bf16), build_whole(bf16)

    x_all, y_all, rows = data(world, rank, batch, width)
    x, y = torch.from_numpy(x_all[rows]), torch.from_numpy(y_all[rows])
    opts = {}
    torch_step = torch_steps(x, y, opts)

    # Pure JAX on the mesh shard() made: one device per process, in process order.
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    jax_mesh = jax.sharding.Mesh(np.array(devices), ("ranks",))
    local = jax.local_devices()[0]

    def global_array(value: np.ndarray, shape: tuple, dim: int | None):
        """The global array whose shard on this process is ``value`` (sharded on ``dim``)."""
        sharding = NamedSharding(jax_mesh, P(*("ranks" if d == dim else None
                                               for d in range(len(shape)))))
        # A copy: the step donates its parameters; torch's storage stays the torch side's.
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [jax.device_put(np.array(value, copy=True), local)])

    dims = {n: p.placements[0].dim if isinstance(p.placements[0], Shard) else None
            for n, p in sharded.named_parameters()}
    variables = unflatten_dict({  # "params.stack.Dense_0.bias": Flax's path, dotted
        tuple(n.split(".")): global_array(p.to_local().detach().numpy(), tuple(p.shape),
                                          dims[n]) for n, p in sharded.named_parameters()})
    xg, yg = (global_array(a[rows], a.shape, 0) for a in (x_all, y_all))
    jax_step, box, compiled = pure_jax_step(flax_block.apply, variables, xg, yg, jax_mesh)

    steps = {"sharded": torch_step("sharded", sharded),
             "sharded remat_stack": torch_step("sharded remat_stack", stacked),
             "fully_shard whole": torch_step("fully_shard whole", whole),
             "pure JAX SPMD": jax_step,
             "sharded remat_stack bf16": torch_step("sharded remat_stack bf16", stacked_bf16),
             "fully_shard whole bf16": torch_step("fully_shard whole bf16", whole_bf16)}

    report = dict(measure(steps, spec), dims=dims)

    report["held"] = {
        name: {"params": _local_bytes(module.parameters()),
               "optimizer": _local_bytes(v for p in module.parameters()  # 0-d steps aside
                                         for v in opts[name].state[p].values() if v.dim())}
        for name, module in (("sharded", sharded), ("sharded remat_stack", stacked),
                             ("fully_shard whole", whole),
                             ("sharded remat_stack bf16", stacked_bf16),
                             ("fully_shard whole bf16", whole_bf16))}
    report["held"]["pure JAX SPMD"] = {"params": _addressable(box[0]),
                                       "optimizer": _addressable(box[1])}
    report["programs"] = {
        "sharded": _bridge_programs(sharded),
        "sharded remat_stack": _bridge_programs(stacked),
        "fully_shard whole": _bridge_programs(whole),
        "pure JAX SPMD": {"step": _program(compiled[0])},
        "sharded remat_stack bf16": _bridge_programs(stacked_bf16),
        "fully_shard whole bf16": _bridge_programs(whole_bf16)}
    report["whole_params"] = sum(p.numel() * p.element_size() for p in initial.values())
    report["depth"] = math.prod(lengths)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the parent: launch, wait, combine --------------------------------------------------------
def shard_rows(size_name: str, size: dict) -> list[dict]:
    """Runs the 2 worker processes at ``size["shard"]`` and returns the table's one row.

    ``size``'s ``warmup`` steps follow the two checked ones; ``min_repeats`` rounds are timed.

    Raises:
        RuntimeError: a worker failed or ran past its time (its log's tail says why).
    """
    spec = dict(size["shard"], warmup=size["warmup"], rounds=size["min_repeats"])
    lengths, width, batch = spec["lengths"], spec["width"], spec["batch"]
    describe = (f"RematScan: {math.prod(lengths)} layers, nn.remat_scan{tuple(lengths)}, "
                f"width {width}, batch {batch} per rank x {WORLD} ranks (gloo, CPU)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "shard")
        with socket.socket() as sock:  # a free port for torch's rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        launch(__file__, [str(WORLD), str(port), out, json.dumps(spec)], WORLD, worker_env(),
               tmp, f"shard_rows({size_name!r})")
        ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(WORLD)]
    # A round's time is its slower rank's (the ranks wait for each other at every gather).
    times = {n: statistics.median(map(max, zip(*(r["times"][n] for r in ranks), strict=True)))
             for n in NAMES}
    losses, reference = ranks[0]["losses"], ranks[0]["losses"]["pure JAX SPMD"]
    def mismatch_of(names):
        return max(abs(v - r) / abs(r) for n in names
                   for v, r in zip(losses[n], reference, strict=True))

    mismatch, mismatch_bf16 = mismatch_of(FLOAT32), mismatch_of(BF16)
    print(f"  SHARD: {describe}: {time.perf_counter() - t0:.0f} s", flush=True)
    return [dict(name="SHARD", describe=describe, times=times, rounds=spec["rounds"],
                 rank_medians={n: [statistics.median(r["times"][n]) for r in ranks]
                               for n in NAMES},
                 first={n: max(r["first"][n] for r in ranks) for n in NAMES},
                 losses=losses, mismatch=mismatch, mismatch_bf16=mismatch_bf16,
                 held=[r["held"] for r in ranks],
                 programs=[r["programs"] for r in ranks], dims=ranks[0]["dims"],
                 whole_params=ranks[0]["whole_params"], depth=ranks[0]["depth"])]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    rank_, world_, port_, out_, spec_ = sys.argv[2:7]
    _worker(int(rank_), int(world_), int(port_), out_, json.loads(spec_))
