"""One process of the 2-D mesh test: ``torchside.shard`` over a 2x2 ``("fsdp", "tensor")``.

Run by tests/trainers/test_shard_2d.py as ``python tests/support/shard2d_worker.py RANK
WORLD PORT OUT``. With WORLD 1 (the reference) ``TPStack`` (tests/support/tp_block.py) is
built directly and trained on the full batch. With 4 ranks the mesh is ``[[0, 2], [1,
3]]`` (transposed against rank order, so that a JAX device placed by rank order rather than
by torch's mesh would put shards on the wrong processes): the block is built on meta,
sharded with ``RULES`` (model dimension over "fsdp", heads and MLP units over "tensor"),
materialized rank by rank, and trained on the rows of its "fsdp" coordinate (both
"tensor" ranks of a coordinate see the same rows); its torch twin, from the same weights,
runs Megatron-style tensor parallelism (``parallelize_module`` on ``mesh["tensor"]``) under
FSDP2 (``fully_shard`` on ``mesh["fsdp"]``) on the same rows. An NNX module whose
``nnx.with_partitioning`` names go through the same rules is sharded and called too, and
the same layer stacked by ``flaxside.remat_stack`` (which owns its loop: a layer's shards
over "fsdp" alone gathered packed, the rest left to XLA's partitioner) is trained like the
scan. Each process saves ``OUT.RANK.pt`` (the reference ``OUT.ref.pt``): per block
(``scan``, ``stack``, the ``twin``) its parameters (whole) before and after 2 AdamW steps,
the first step's gradients (the input's too) and the local shapes and placements, whether
a deep copy of the scan block computes the same, and the NNX module's local shapes, whole
initial values and output; the trained scan block is saved with
``torch.distributed.checkpoint`` to ``OUT.dcp`` (the reference: ``OUT.ref-dcp``); what
``shard`` warns when no parameter is split over "tensor" (no ``axis_rules``), and what it
raises for FSDP2's usual ``MixedPrecisionPolicy`` on this mesh.
"""

import copy
import datetime
import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from flax import nnx  # noqa: E402

import flaxside  # noqa: E402
from tests.support.tp_block import (  # noqa: E402
    LAYERS,
    RULES,
    TP_PLAN,
    WIDTH,
    TorchTPStack,
    TPLayer,
    TPStack,
    twin_state,
)
from torchside import FlaxModule, shard  # noqa: E402

BATCH, TOKENS, STEPS = 8, 6, 2
MESH = [[0, 2], [1, 3]]  # position (fsdp, tensor) -> rank


class NnxMlp(nnx.Module):
    """An MLP with NNX partitioning names: ``mix``'s first dimension over both mesh axes."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.mix = nnx.Linear(WIDTH, WIDTH, rngs=rngs, kernel_init=nnx.with_partitioning(
            init, (("embed", "mlp"), None)))
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(self.mix(x))))


def full(named) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in named}


def local(module) -> dict:
    return {n: (tuple(p.to_local().shape), tuple(str(x) for x in p.placements))
            if hasattr(p, "to_local") else (tuple(p.shape), ()) for n, p in
            module.named_parameters()}


def train(model, batches) -> dict:
    """``batches`` of AdamW steps on ``model``; the first step's gradients (whole), the
    input's among them (``"input"``: this rank's rows).

    AdamW's ``eps`` is 1e-4: two libraries' float32 rounding of a gradient near zero
    cannot flip its update's sign (tests/support/shard_worker.py's ``transformer``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    first = None
    for x, y in batches:
        opt.zero_grad()
        x = x.clone().requires_grad_(first is None)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if first is None:
            first = full((n, p.grad) for n, p in model.named_parameters())
            first["input"] = x.grad
        opt.step()
    return first


def main(rank: int, world: int, port: str, out: str) -> None:
    torch.set_num_threads(1)
    sharded = world > 1
    report = {}
    example = (torch.zeros(BATCH, TOKENS, WIDTH),)
    makers = {  # the same layers through nn.scan(nn.remat) and through remat_stack
        "scan": lambda: FlaxModule(TPStack(), example_args=example, seed=5),
        "stack": lambda: FlaxModule(flaxside.remat_stack(TPLayer, LAYERS, lengths=(LAYERS,)),
                                    example_args=example, seed=6),
        "nnx": lambda: FlaxModule(NnxMlp, seed=3),
    }
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(BATCH, TOKENS, WIDTH, generator=gen),
                torch.randn(BATCH, TOKENS, WIDTH, generator=gen)) for _ in range(STEPS)]
    probe = torch.randn(BATCH, WIDTH, generator=gen)
    if sharded:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        mesh = DeviceMesh("cpu", MESH, mesh_dim_names=("fsdp", "tensor"))
        with torch.device("meta"):  # nothing may run JAX before shard() starts it
            blocks = {kind: make() for kind, make in makers.items()}
        for block in blocks.values():
            shard(block, mesh, axis_rules=RULES)
            block.to_empty(device="cpu")
            block.reset_parameters()
        with torch.device("meta"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # without rules Linen's names map to nothing
            shard(makers["scan"](), mesh)
        report["idle_warning"] = [str(w.message) for w in caught]
        # FSDP2's usual policy sums in float32 per rank only, on one batch axis: refused on
        # this mesh by name; a reduce_dtype that is the parameters' own dtype asks nothing.
        from torch.distributed.fsdp import MixedPrecisionPolicy

        with torch.device("meta"):
            refused, accepted = makers["scan"](), makers["scan"]()
        try:
            shard(refused, mesh, axis_rules=RULES, mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            report["reduce_dtype"] = "ran"
        except ValueError as e:
            report["reduce_dtype"] = str(e)
        report["reduce_dtype_unchanged"] = refused._caller.plan is None
        shard(accepted, mesh, axis_rules=RULES,
              mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        row = next(i for i, ranks in enumerate(MESH) if rank in ranks)
        rows = slice(row * BATCH // 2, (row + 1) * BATCH // 2)
    else:
        blocks, rows = {kind: make() for kind, make in makers.items()}, slice(None)
    mine = [(x[rows], y[rows]) for x, y in batches]
    nnx_module = blocks.pop("nnx")
    report["nnx_local"] = local(nnx_module)
    report["nnx_initial"] = full(nnx_module.named_parameters())
    with torch.no_grad():
        report["nnx_out"] = nnx_module(probe[rows])
    for kind, block in blocks.items():
        initial, shapes = full(block.named_parameters()), local(block)
        grads = train(block, mine)
        report[kind] = {"initial": initial, "local": shapes, "grads": grads,
                        "final": full(block.named_parameters())}
    with torch.no_grad():  # a deep copy (an EMA's) computes what the block computes
        x = mine[0][0]
        report["deepcopy"] = torch.equal(copy.deepcopy(blocks["scan"])(x), blocks["scan"](x))
    dcp.save(blocks["scan"].state_dict(), checkpoint_id=f"{out}.{'dcp' if sharded else 'ref-dcp'}",
             no_dist=not sharded)
    twin = TorchTPStack()
    twin.load_state_dict(twin_state(report["scan"]["initial"]))
    if sharded:
        style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in twin.blocks:
            parallelize_module(layer, mesh["tensor"], {n: style[s]() for n, s in TP_PLAN.items()})
            fully_shard(layer, mesh=mesh["fsdp"])
        fully_shard(twin, mesh=mesh["fsdp"])
    initial = full(twin.named_parameters())
    grads = train(twin, mine)
    report["twin"] = {"initial": initial, "grads": grads, "final": full(twin.named_parameters())}
    torch.save(report, f"{out}.{rank if sharded else 'ref'}.pt")
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
