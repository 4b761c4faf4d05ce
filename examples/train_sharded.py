"""A deep Flax block sharded over torch's ranks, from meta-device construction to checkpoint.

What this shows: the recipe of README's "Blocks bigger than one device". A deep
``flaxside.remat_stack`` block (nested rematerialized scans, as ``nn.remat_scan``, whose
loop gathers each layer in one collective and whose layers' partition names carry through)
is built under ``torch.device("meta")`` (nothing allocated), sharded over every rank by
``torchside.shard`` (its parameters become DTensors), made real by ``to_empty`` and
``reset_parameters()`` (each rank initializes only its own shards), and trained between
two torch layers that FSDP2's ``fully_shard`` shards as usual, with AdamW and
gradient-norm clipping from a plain torch loop. Each step is one SPMD program that gathers
each layer's parameters inside the scan. With ``--tp 2`` the mesh has two dimensions,
``("fsdp", "tensor")``: each layer's hidden units are split over "tensor" as well
(Megatron's column then row split, from the kernels' logical names), the batch over
"fsdp". It prints the loss, then, per rank, the bytes it holds of the block's parameters
and of AdamW's state against the block unsharded, and saves the model with
``torch.distributed.checkpoint``, reloads it into a model built the same way and checks
that the two compute the same. The task is synthetic (no download): regress the outputs of
a fixed random teacher network.

How to run (a CPU-only machine: gloo; with GPUs: NCCL, one GPU per rank):
    torchrun --standalone --nproc_per_node 2 examples/train_sharded.py
    torchrun --standalone --nproc_per_node 2 examples/train_sharded.py --steps 5 --out /tmp/ck
    torchrun --standalone --nproc_per_node 4 examples/train_sharded.py --tp 2   # 2-D mesh
"""

import argparse
import math
import os
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import flaxside  # noqa: E402
from torchside import FlaxModule, shard  # noqa: E402


class Block(nn.Module):
    """A pre-LayerNorm residual MLP layer; its kernels' dimensions named for ``RULES``."""

    width: int

    @nn.compact
    def __call__(self, h):
        init = nn.initializers.lecun_normal()
        y = nn.Dense(2 * self.width, kernel_init=nn.with_logical_partitioning(
            init, ("embed", "mlp")))(nn.LayerNorm()(h))
        return h + nn.Dense(self.width, kernel_init=nn.with_logical_partitioning(
            init, ("mlp", "embed")))(nn.gelu(y))


# Logical names -> mesh axes: the model dimension over "fsdp"; the hidden units over
# "tensor" where the mesh has it (Megatron's column then row split), else not split.
RULES = (("embed", "fsdp"), ("mlp", "tensor"))


def build(args, device: torch.device, mesh) -> torch.nn.Sequential:
    """``Linear -> Deep -> Linear``: the block sharded by ``shard``, the rest by FSDP2.

    Every rank builds the same model: the torch layers from the same seed, the block's
    shards from the module's seed (``reset_parameters``).
    """
    with torch.device("meta"):  # shapes only; no JAX backend starts
        deep = flaxside.remat_stack(Block, math.prod(args.lengths),
                                    lengths=tuple(args.lengths), width=args.width)
        block = FlaxModule(deep,
                           example_args=(torch.zeros(args.batch, args.width),), seed=0)
    # Starts JAX's distributed runtime from torch's: before anything runs JAX.
    shard(block, mesh, axis_rules=RULES)
    block.to_empty(device=device)
    block.reset_parameters()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.features, args.width), block,
                                torch.nn.Linear(args.width, 1)).to(device)
    fully_shard(model[0], mesh=mesh["fsdp"] if args.tp > 1 else mesh)
    fully_shard(model[2], mesh=mesh["fsdp"] if args.tp > 1 else mesh)
    return model


def clip_grad_norm(model, max_norm: float) -> None:
    """``clip_grad_norm_`` over parameters on several meshes.

    On a 2-D mesh the block's DTensors live on ``("fsdp", "tensor")`` and the torch layers'
    on ``mesh["fsdp"]``, and torch's ``clip_grad_norm_`` refuses to stack norms of two
    meshes: each mesh's norm is taken apart, made whole, and the global one applied.
    """
    groups = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    scale = min(1.0, max_norm / (torch.linalg.vector_norm(torch.stack(norms)).item() + 1e-6))
    for grads in groups.values():
        for g in grads:
            g.mul_(scale)


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 4],
                        help="scan lengths per remat level: prod(lengths) layers")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="per rank (per fsdp rank)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks: a (world/tp, tp) mesh ('fsdp', 'tensor')")
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temp one)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)

    if args.tp == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    else:  # the batch over "fsdp"; each "tensor" group of ranks sees the same rows
        mesh = init_device_mesh(device.type, (world // args.tp, args.tp),
                                mesh_dim_names=("fsdp", "tensor"))
    model = build(args, device, mesh)
    block = model[1]
    teacher = torch.nn.Sequential(torch.nn.Linear(args.features, 32), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 1)).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Each "fsdp" rank its own batches (init_device_mesh lays ranks out row by row).
    data = torch.Generator().manual_seed(100 + rank // args.tp)
    layers = math.prod(args.lengths)
    say(f"{world} ranks, a {layers}-layer remat_stack block of width {args.width}, "
        f"batch {args.batch} per rank, on {device.type}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.features, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(x), teacher(x))
        opt.zero_grad()
        loss.backward()
        clip_grad_norm(model, 1.0)
        opt.step()
        if step == 1 or step % max(1, args.steps // 5) == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            say(f"step {step:4d}/{args.steps}  loss {mean.item() / world:.5f}")
    say(f"{args.steps} steps in {time.perf_counter() - start:.1f} s")

    # What each rank holds of the block: its shards of the parameters and of AdamW's state,
    # against the whole block (what fully_shard of the block gathers on every rank).
    params = list(block.parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    per_layer = whole // layers
    held = local_bytes(params)
    state = local_bytes([v for p in params for v in opt.state[p].values() if v.dim() > 0])
    bound = whole // world + per_layer
    line = (f"rank {rank}: block parameters {size(held)} (at most 1/{world} of the block plus "
            f"one layer, {size(bound)}: {'yes' if held <= bound else 'NO'}), AdamW state "
            f"{size(state)}; unsharded: block {size(whole)}, AdamW state {size(2 * whole)}, "
            f"one layer {size(per_layer)}")
    for r in range(world):  # in rank order
        if r == rank:
            print(line, flush=True)
        dist.barrier()

    # A checkpoint: every rank writes its shards; a model built the same way loads them.
    with tempfile.TemporaryDirectory() as scratch:
        path = args.out or os.path.join(scratch, "checkpoint")
        if args.out is None:  # one folder for every rank: rank 0's temporary one
            names = [path]
            dist.broadcast_object_list(names, src=0)
            path = names[0]
        dcp.save(model.state_dict(), checkpoint_id=path)
        fresh = build(args, device, mesh)
        state_dict = fresh.state_dict()
        dcp.load(state_dict, checkpoint_id=path)
        fresh.load_state_dict(state_dict)
        x = torch.randn(args.batch, args.features, generator=data).to(device)
        with torch.no_grad():
            same = torch.equal(fresh(x), model(x))
        flags = [None] * world
        dist.all_gather_object(flags, same)
        say(f"checkpoint saved to {path if args.out else 'a temporary folder'} and "
            f"reloaded: the reloaded model computes {'the same' if all(flags) else 'OTHER'} "
            f"outputs on every rank")
        dist.barrier()  # rank 0's folder outlives every rank's load
    dist.destroy_process_group()
    if not all(flags):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
