"""One process of the mixed-precision test: ``shard(mp_policy=...)`` against FSDP2's.

Run by tests/trainers/test_shard.py as ``python tests/support/mp_worker.py RANK 2 PORT
OUT``. A ``flaxside.remat_stack`` of ``ReadmeBlock`` layers is sharded four ways from
the same weights and trained ``STEPS`` AdamW steps on the same rows: ``bf16`` (``shard``
with ``POLICY``), ``f32`` (``shard`` without a policy), ``twin`` (its torch twin,
``fully_shard`` per layer and whole with ``POLICY``), and ``bf16_reduce32`` with
``twin_reduce32`` (both with ``REDUCE32``: gradients summed in float32). Saves to
``OUT.RANK.pt`` per run the global losses, the first step's gradients and the trained
parameters (gathered), and the dtypes of the output, the shards, the gradients and AdamW's
state; what ``shard`` raises for bad policies (``refused``: message, and whether the module
stayed unsharded); and what the first call of a stock ``nn.remat_scan`` block sharded with
``REDUCE32`` raises (``refused_call``: message, and whether its parameters stayed as
they were).
"""

import datetime
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import flaxside  # noqa: E402
from tests.support.twins import ReadmeBlock, ReadmeDeep, load_residual_block  # noqa: E402
from torchside import FlaxModule, shard  # noqa: E402

STEPS, BATCH, WIDTH, LENGTHS = 3, 16, 16, (2, 2)
# Gradients reduced in the compute dtype, on both sides; then in float32, on both sides.
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
REDUCE32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class TorchReadmeBlock(torch.nn.Module):
    """``ReadmeBlock``'s torch twin: LayerNorm eps 1e-6, gelu's tanh approximation."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH, eps=1e-6)
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def make(stock: bool = False) -> FlaxModule:
    block = (ReadmeDeep(WIDTH, LENGTHS) if stock
             else flaxside.remat_stack(ReadmeBlock, 4, lengths=LENGTHS, width=WIDTH))
    return FlaxModule(block, example_args=(torch.zeros(BATCH, WIDTH),), seed=11)


def sharded(policy, stock: bool = False) -> FlaxModule:
    with torch.device("meta"):
        module = make(stock)
    shard(module, mp_policy=policy)
    module.to_empty(device="cpu")
    module.reset_parameters()
    return module


def full(named) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in named}


def twin_of(params: dict, policy=POLICY) -> torch.nn.Sequential:
    """The torch twin holding ``params`` (the Flax stack's, whole), under FSDP2's ``policy``."""
    layers = torch.nn.Sequential(*[TorchReadmeBlock() for _ in range(4)])
    flat = {n: v.reshape(4, *v.shape[len(LENGTHS):]) for n, v in params.items()}
    # ReadmeBlock makes its outer Dense (fc2) first: Dense_0 is fc2, Dense_1 fc1.
    swap = {"Dense_0": "Dense_1", "Dense_1": "Dense_0", "LayerNorm_0": "LayerNorm_0"}
    for i, layer in enumerate(layers):
        p = {}
        for name, v in flat.items():
            _, module, leaf = name.split(".")
            p.setdefault(swap[module], {})[leaf] = v[i].numpy()
        load_residual_block(layer, p)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(layers, mp_policy=policy)


def train(model, rank: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    out = {"losses": []}
    for step in range(STEPS):
        x, y = (torch.randn(BATCH, WIDTH, generator=gen) for _ in range(2))
        opt.zero_grad()
        pred = model(x[rows])
        loss = F.mse_loss(pred.float(), y[rows])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total / 2)
        if step == 0:
            out["output"], out["y"] = pred.dtype, pred.detach().float()
            out["grads"] = full((n, p.grad) for n, p in model.named_parameters())
            out["grad_dtypes"] = {p.grad.to_local().dtype for p in model.parameters()}
        opt.step()
    out["final"] = full(model.named_parameters())
    out["shards"] = {p.to_local().dtype for p in model.parameters()}
    out["state"] = {v.to_local().dtype for s in opt.state.values() for v in s.values()
                    if v.dim() > 0}
    return out


def refused(policy) -> tuple:
    """What ``shard(make(), mp_policy=policy)`` raises, and whether it left the module
    as it was (no DTensor)."""
    module = make()
    try:
        shard(module, mp_policy=policy)
        return "ran", False
    except (TypeError, ValueError) as e:
        from torch.distributed.tensor import DTensor

        return str(e), not any(isinstance(p, DTensor) for p in module.parameters())


def refused_call(rank: int) -> tuple:
    """What the first call of a stock ``nn.remat_scan`` block sharded with ``REDUCE32``
    raises (XLA's partitioner would sum in bfloat16), and whether its parameters stayed."""
    module = sharded(REDUCE32, stock=True)
    before = full(module.named_parameters())
    try:
        module(torch.randn(BATCH // 2, WIDTH, generator=torch.Generator().manual_seed(rank)))
        return "ran", False
    except ValueError as e:
        after = full(module.named_parameters())
        return str(e), all(torch.equal(after[n], v) for n, v in before.items())


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    report = {}
    bf16 = sharded(POLICY)
    initial = full(bf16.named_parameters())
    twin = twin_of(initial)
    report["twin"] = train(twin, rank)
    report["bf16"] = train(bf16, rank)
    f32 = sharded(None)  # the same seed: the same initial values (checked)
    report["same_start"] = all(torch.equal(v, initial[n])
                               for n, v in full(f32.named_parameters()).items())
    report["f32"] = train(f32, rank)
    report["twin_reduce32"] = train(twin_of(initial, REDUCE32), rank)
    report["bf16_reduce32"] = train(sharded(REDUCE32), rank)
    report["refused_call"] = refused_call(rank)
    report["names"] = list(initial)
    report["refused"] = {
        "float64": refused(MixedPrecisionPolicy(param_dtype=torch.float64)),
        "int8": refused(MixedPrecisionPolicy(reduce_dtype=torch.int8)),
        "string": refused("bfloat16"),
    }
    torch.save(report, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
