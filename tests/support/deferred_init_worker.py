"""One process of the FSDP2 deferred-init test: build on meta, shard, ``to_empty``, reset.

Run by tests/trainers/test_fsdp2_deferred_init.py as ``python
tests/support/deferred_init_worker.py RANK WORLD PORT OUT``. The model (a torch Linear, a
FlaxModule holding a ``nn.remat_scan`` stack, a torch Linear) is built under
``torch.device("meta")``, sharded with ``fully_shard`` (the FlaxModule as its own unit),
moved to the CPU with ``to_empty`` and initialized by ``reset_parameters()`` on every
module that has it, FSDP2's recipe. Each rank writes to ``OUT.RANK.pt``: per Flax
parameter whether its gathered value equals the same FlaxModule built directly on this
rank, its local shard's shape, every parameter's initial value (gathered), the Flax
block's gradients (gathered) of one step on a batch of 8 split over the ranks, and the
parameters after that SGD step; the sharded model is then saved with
torch.distributed.checkpoint to ``OUT.dcp``.
"""

import datetime
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from tests.support.twins import ReadmeDeep  # noqa: E402
from torchside import FlaxModule  # noqa: E402


def flax_block() -> FlaxModule:
    return FlaxModule(ReadmeDeep(width=8, lengths=(2, 2)), example_args=(torch.zeros(4, 8),),
                      seed=7)


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    direct = flax_block()
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), flax_block(), torch.nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # torch's layers draw their init from it, the same on every rank
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    report = {"equal": {}, "local": {}}
    for (name, p), (_, q) in zip(model[1].named_parameters(), direct.named_parameters(),
                                 strict=True):
        report["equal"][name] = bool(torch.equal(p.full_tensor(), q.detach()))
        report["local"][name] = tuple(p.to_local().shape)
    report["initial"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    rows = x.chunk(world)[rank]
    loss = model(rows).square().mean()
    loss.backward()
    report["loss"] = loss.detach()
    report["grads"] = {n: p.grad.full_tensor() for n, p in model[1].named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    report["final"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    dcp.save(model.state_dict(), checkpoint_id=f"{out}.dcp")  # each rank its shards
    torch.save(report, f"{out}.{rank}.pt")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
