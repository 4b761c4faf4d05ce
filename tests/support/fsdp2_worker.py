"""One process of the FSDP2 test: ``fully_shard`` over a model that holds a FlaxModule.

Run by tests/trainers/test_fsdp2.py as ``python tests/support/fsdp2_worker.py RANK WORLD
PORT OUT``. Each process trains three models in turn, from the same initial weights: the
pure-torch twin (the control), the model with the Flax block between torch layers, and the
whole model and its loss in one FlaxModule (the scalar-loss route: its gradients are
computed in the forward and handed to ``.grad`` in the backward, where FSDP2 reduce-scatters
them). With WORLD 1 it trains them on the full batch without torch.distributed (the
reference); rank 0 saves the full (unsharded) state dicts, initial and final, to
``OUT.KIND.pt``. With two ranks it also trains the three under FSDP2's
``MixedPrecisionPolicy`` (bfloat16 parameters and compute, float32 reduction): kinds
``KIND-bf16``.
"""

import datetime
import faulthandler
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.support.loss_inside import save_routes, sgd_steps, with_loss  # noqa: E402
from torchside import FlaxModule  # noqa: E402

STEPS, BATCH = 3, 8
KINDS = ("torch", "flax", "flax-loss")
BF16 = tuple(f"{kind}-bf16" for kind in KINDS)  # sharded runs only


class Block(nn.Module):
    """``x + Dense(tanh(Dense(x)))`` with no dtype of its own: under FSDP2's bfloat16 policy
    it computes in the gathered parameters' dtype, so its output feeds the next bfloat16
    torch layer (the twins' blocks compute in an explicit float32)."""

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(8)(x))  # Dense_0
        return x + nn.Dense(8)(h)  # Dense_1


class TorchBlock(torch.nn.Module):
    """``Block`` in torch: ``weight`` is Flax's ``kernel`` transposed."""

    def __init__(self, flax_block: FlaxModule):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        with torch.no_grad():
            for lin, dense in ((self.l1, flax_block.params.Dense_0),
                               (self.l2, flax_block.params.Dense_1)):
                lin.weight.copy_(dense.kernel.T)
                lin.bias.copy_(dense.bias)

    def forward(self, x):
        return x + self.l2(torch.tanh(self.l1(x)))


def build(kind: str) -> torch.nn.Module:
    if kind == "flax-loss":
        return with_loss(build("flax"), Block())
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        FlaxModule(Block(), example_args=(torch.zeros(2, 8),), seed=0),
        torch.nn.Linear(8, 1),
    )
    if kind == "torch":
        model[1] = TorchBlock(model[1])
    return model


def full_state(model) -> dict:
    """The state dict with every DTensor gathered (a collective: every rank calls it)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(kind: str, rank: int, world: int, out: str) -> tuple[dict, dict]:
    bf16 = kind.endswith("-bf16")
    kind = kind.removesuffix("-bf16")
    model = build(kind)
    initial = full_state(model)
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bfloat16: FSDP2 gathers bfloat16 copies of the parameters and casts the inputs
        # (the block's programs are specialized to them) and reduces gradients in float32.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        if kind != "flax-loss":
            # its own unit: freed with storage.resize_(0) after use
            fully_shard(model[1], mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    sgd_steps(model, rank, world, steps=STEPS, batch=BATCH, sizes=(4, 1),
              loss_inside=kind == "flax-loss")
    if kind == "flax-loss":
        save_routes(model, f"{out}.{kind}{'-bf16' if bf16 else ''}.routes.{rank}.json")
    return initial, full_state(model)


def main(rank: int, world: int, port: int, out: str) -> None:
    # A stalled rank prints where every thread is and exits, instead of hanging the test.
    faulthandler.dump_traceback_later(240, exit=True)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    # The control first: its result is saved even if the others fail.
    for kind in KINDS + (BF16 if world > 1 else ()):
        initial, final = train(kind, rank, world, out)
        if rank == 0:
            torch.save({"initial": initial, "final": final}, f"{out}.{kind}.pt")
    if world > 1:
        dist.barrier()  # neither rank leaves while the other still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
