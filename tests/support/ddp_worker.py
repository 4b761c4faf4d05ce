"""One process of the DDP test: trains a model holding a FlaxModule on its shard of a batch.

Run by tests/trainers/test_ddp.py as ``python tests/support/ddp_worker.py RANK WORLD PORT
OUT``; with WORLD 1 it trains on the full batch without torch.distributed (the reference).
It trains a second model after the first: the same function and weights with the loss inside
one FlaxModule (the scalar-loss route hands the gradients JAX computed in the forward to
``.grad``), under DDP with ``gradient_as_bucket_view=True`` (DDP replaces each ``.grad`` by
a view of its bucket); its state goes to ``OUT.loss``.
``FLAXTORCH_TEST_DDP_BACKEND=nccl`` trains rank ``r`` on ``cuda:r`` as ``torchrun`` would
(JAX's default device stays GPU 0 in every rank); ``FLAXTORCH_TEST_JAX_DEFAULT`` moves JAX's
default device elsewhere (``tests/support/devices_env.py``).
"""

import datetime
import faulthandler
import gc
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.support.devices_env import apply_default_device  # noqa: E402
from tests.support.loss_inside import save_routes, sgd_steps, with_loss  # noqa: E402
from torchside import FlaxModule  # noqa: E402

STEPS, BATCH = 3, 16


class Block(nn.Module):
    """The smallest remat_scan stack (a Dense per layer, tanh after): three processes, the
    reference and two ranks, compile it on two cores."""

    @nn.compact
    def __call__(self, x):
        body = nn.remat_scan(nn.remat(nn.Dense), lengths=(2, 2))
        return nn.tanh(body(8, name="stack")(x))


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        FlaxModule(Block(), example_args=(torch.zeros(2, 8),), seed=0),
        torch.nn.Linear(8, 2),
    )


def main(rank: int, world: int, port: int, out: str) -> None:
    # A stalled rank prints where every thread is and exits, instead of hanging the test.
    faulthandler.dump_traceback_later(240, exit=True)
    apply_default_device()
    backend = os.environ.get("FLAXTORCH_TEST_DDP_BACKEND", "gloo")
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    for loss_inside, path in ((False, out), (True, f"{out}.loss")):
        model = (with_loss(build(), Block()) if loss_inside else build()).to(device)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[rank] if device.type == "cuda" else None,
                gradient_as_bucket_view=loss_inside)
        sgd_steps(model, rank, world, steps=STEPS, batch=BATCH, sizes=(5, 2),
                  loss_inside=loss_inside, device=device)
        owner = model.module if world > 1 else model
        if loss_inside:
            save_routes(owner, f"{path}.routes.{rank}.json")
        state = {k: v.cpu() for k, v in owner.state_dict().items()}
        if rank == 0:
            torch.save(state, path)
    if world > 1:
        dist.barrier()  # neither rank leaves while the other still talks to it
        # Free DDP's Reducer while the process group is still registered, then destroy the
        # group: a Reducer holding the last reference destroys the group with the GIL held,
        # whose gloo thread may need the GIL to free a finished work, and both wait for
        # ever (torch's own deadlock: 1 run in ~10 hung here, pure-torch DDP included;
        # pytorch/pytorch#56297, #190489). destroy_process_group releases the GIL.
        del model
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
