"""A deep Flax block sharded over torch's ranks, from meta-device construction to checkpoint.

What this shows: the recipe of README's "Blocks bigger than one device". A deep
``nn.remat_scan`` block is built under ``torch.device("meta")`` (nothing allocated),
sharded over every rank by ``torchside.shard`` (its parameters become DTensors), made real
by ``to_empty`` and ``reset_parameters()`` (each rank initializes only its own shards), and
trained between two torch layers that FSDP2's ``fully_shard`` shards as usual, with AdamW
and ``clip_grad_norm_`` from a plain torch loop. Each step is one SPMD program that gathers
each layer's parameters inside the scan. It prints the loss, then, per rank, the bytes it
holds of the block's parameters and of AdamW's state against the block unsharded, and
saves the model with ``torch.distributed.checkpoint``, reloads it into a model built the
same way and checks that the two compute the same. The task is synthetic (no download):
regress the outputs of a fixed random teacher network.

How to run (a CPU-only machine: gloo; with GPUs: NCCL, one GPU per rank):
    torchrun --standalone --nproc_per_node 2 examples/train_sharded.py
    torchrun --standalone --nproc_per_node 2 examples/train_sharded.py --steps 5 --out /tmp/ck
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
from torch.distributed.fsdp import fully_shard  # noqa: E402

from torchside import FlaxModule, shard  # noqa: E402


class Block(nn.Module):
    """A pre-LayerNorm residual MLP layer."""

    width: int

    @nn.compact
    def __call__(self, h):
        y = nn.Dense(2 * self.width)(nn.LayerNorm()(h))
        return h + nn.Dense(self.width)(nn.gelu(y))


class Deep(nn.Module):
    """``prod(lengths)`` layers under a nested, rematerialized scan."""

    width: int
    lengths: tuple

    @nn.compact
    def __call__(self, h):
        stack = nn.remat_scan(nn.remat(Block), lengths=self.lengths)
        return stack(self.width, name="stack")(h)


def build(args, device: torch.device) -> torch.nn.Sequential:
    """``Linear -> Deep -> Linear``: the block sharded by ``shard``, the rest by FSDP2.

    Every rank builds the same model: the torch layers from the same seed, the block's
    shards from the module's seed (``reset_parameters``).
    """
    with torch.device("meta"):  # shapes only; no JAX backend starts
        block = FlaxModule(Deep(args.width, tuple(args.lengths)),
                           example_args=(torch.zeros(args.batch, args.width),), seed=0)
    shard(block)  # starts JAX's distributed runtime from torch's: before anything runs JAX
    block.to_empty(device=device)
    block.reset_parameters()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.features, args.width), block,
                                torch.nn.Linear(args.width, 1)).to(device)
    fully_shard(model[0])
    fully_shard(model[2])
    return model


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
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temp one)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)

    model = build(args, device)
    block = model[1]
    teacher = torch.nn.Sequential(torch.nn.Linear(args.features, 32), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 1)).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    layers = math.prod(args.lengths)
    say(f"{world} ranks, a {layers}-layer remat_scan block of width {args.width}, "
        f"batch {args.batch} per rank, on {device.type}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.features, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(x), teacher(x))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
        fresh = build(args, device)
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
