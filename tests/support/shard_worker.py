"""One process of the sharded-block test: ``torchside.shard`` over gloo ranks.

Run by tests/trainers/test_shard.py as ``python tests/support/shard_worker.py RANK WORLD
PORT OUT``. The model is ``Sequential(Linear, FlaxModule(deep nn.remat_scan stack),
Linear)``; the torch layers are built directly from a seed, the Flax block under
``torch.device("meta")``. With WORLD 1 (the reference) nothing is sharded: the block is
built directly and trained on the full batch. With two ranks the block is sharded
(``shard``), materialized (``to_empty``, ``reset_parameters``: each rank initializes its
own shards), the torch layers are ``fully_shard``-ed, and each rank trains on its half of
the batch. Each process saves to ``OUT.RANK.pt`` (the reference: ``OUT.ref.pt``) the full
(gathered) parameters before and after training, the block's local shard shapes, what its
compiled programs gather (the number of all-gathers inside a loop body and outside any)
and their peak bytes, and the bytes it holds of the block's parameters and of AdamW's
state of them, a module whose kernels carry Flax partitioning metadata (``tagged``), and
a ``remat_scan`` Transformer block trained beside its torch twin (``transformer``), and
what a second derivative and ``vmap`` of the block raise (``refusals``), and whether its
deep copy computes the same and what a pickled copy raises (``copies``), and what
``torch.compile``, ``load_state_dict(assign=True)`` and in-place writes give (``habits``),
and a ``flaxside.remat_stack`` block of the same layers trained alone, with the collectives
of each loop body of its programs and of the ``remat_scan`` block's (``stack``); then
it saves the trained model with
torch.distributed.checkpoint to ``OUT.dcp``, and loads ``OUT.ref-dcp`` (written by the
reference) into a fresh model, saving what it loaded to ``OUT.RANK.loaded.pt``. With
``FLAXTORCH_TEST_SHARD_BACKEND=nccl`` rank ``r`` runs on ``cuda:r`` over NCCL.
"""

import copy
import datetime
import io
import math
import os
import re
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import flaxside  # noqa: E402
from tests.support import pipeline  # noqa: E402
from tests.support.tagged_case import BATCH, WIDTH, tagged  # noqa: E402
from tests.support.twins import ReadmeBlock, ReadmeDeep  # noqa: E402
from tests.support.twins_parity import TWINS  # noqa: E402
from torchside import FlaxModule, shard  # noqa: E402
from torchside.parity import copy_weights  # noqa: E402

STEPS, LENGTHS = 3, (4, 2)  # BATCH and WIDTH: tagged_case, which shares them


TWIN = TWINS["transformer"]  # pre-LayerNorm causal attention + MLP, width 16, 2 heads
T_LENGTHS, T_SHAPE = (4, 2), (BATCH, 6, 16)


def _transformer_block() -> FlaxModule:
    return FlaxModule(TWIN.flax_stack("remat_scan", T_LENGTHS, "float32"),
                      example_args=(torch.zeros(T_SHAPE),), seed=5)


def transformer(sharded: bool, device: str, rank: int, world: int) -> dict:
    """A ``remat_scan`` Transformer block of 8 layers, sharded (``shard``) or whole, and its
    torch twin (the same initial weights), under ``fully_shard`` per layer when sharded,
    each trained 3 AdamW steps on this rank's rows; returns their parameters (gathered)
    before and after, the Flax block's by its torch twin's names too.

    AdamW's ``eps`` is 1e-4 rather than 1e-8: an update of ``lr * m / (sqrt(v) + eps)``
    then moves with the gradient by at most ``lr / eps`` where the gradient is small, so two
    libraries' float32 rounding cannot flip an update from ``+lr`` to ``-lr``.
    """
    from torch.distributed.fsdp import fully_shard

    mapping = TWIN.stack_mapping("remat_scan", T_LENGTHS)
    flax = materialized(_transformer_block, sharded, device)
    twin = TWIN.torch_stack(int(math.prod(T_LENGTHS)), "float32")
    copy_weights(_transformer_block().flax_variables(), twin, mapping)
    twin.to(device)
    if sharded:
        for layer in twin.blocks:
            fully_shard(layer)
        fully_shard(twin)
    out = {"flax_initial": full(flax), "twin_initial": full(twin)}
    gen = torch.Generator().manual_seed(2)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    batches = [(torch.randn(T_SHAPE, generator=gen).to(device)[rows],
                torch.randn(T_SHAPE, generator=gen).to(device)[rows]) for _ in range(STEPS)]
    for name, model in (("flax", flax), ("twin", twin)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[f"{name}_final"] = full(model)
    whole = _transformer_block()  # the trained values, by the twin's names
    whole.load_state_dict(out["flax_final"])
    as_twin = TWIN.torch_stack(int(math.prod(T_LENGTHS)), "float32")
    copy_weights(whole.flax_variables(), as_twin, mapping)
    out["flax_as_twin"] = {n: p.detach().clone() for n, p in as_twin.named_parameters()}
    return out


def refusals(module, x: torch.Tensor) -> dict:
    """What a second derivative, ``torch.func.vmap`` and ``flax_variable_tensors()`` of
    ``module`` raise ("ran" if nothing)."""
    out = {}
    x = x.detach().requires_grad_()
    try:
        torch.autograd.grad(module(x).sum(), x, create_graph=True)
        out["create_graph"] = "ran"
    except NotImplementedError as e:
        out["create_graph"] = str(e)
    try:
        torch.func.vmap(module)(x.detach()[None])
        out["vmap"] = "ran"
    except NotImplementedError as e:
        out["vmap"] = str(e)
    try:  # the fast path's variables: the shards would pass for the parameters
        module.flax_variable_tensors()
        out["variable_tensors"] = "ran"
    except NotImplementedError as e:
        out["variable_tensors"] = str(e)
    return out


def copies(module, x: torch.Tensor) -> dict:
    """Whether ``copy.deepcopy(module)`` (an EMA's habit) computes what ``module`` does, and
    what a ``torch.save``/``torch.load`` copy raises ("ran" if nothing)."""
    want = module(x).detach()
    out = {"deepcopy": torch.equal(copy.deepcopy(module)(x).detach(), want)}
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    try:
        loaded(x)
        out["pickled"] = "ran"
    except RuntimeError as e:
        out["pickled"] = str(e)
    return out


def habits(model, sharded: bool, device: str, x: torch.Tensor) -> dict:
    """What users' habits give on ``model``: its gradients under ``torch.compile`` (the
    largest difference from eager, relative to the largest gradient),
    ``load_state_dict(assign=True)`` into a fresh build (whether it computes the same),
    and an in-place write into each block parameter's local shard (whether it computes
    what a fresh build loaded with those values computes). Leaves ``model`` as it was."""

    def gradients(run) -> dict:
        model.zero_grad(set_to_none=True)
        run(x).square().mean().backward()
        return full({n: p.grad for n, p in model.named_parameters()})

    eager = gradients(model)
    compiled = gradients(torch.compile(model))
    model.zero_grad(set_to_none=True)
    scale = max(g.abs().max().item() for g in eager.values())
    out = {"compiled": max((compiled[n] - g).abs().max().item() for n, g in eager.items())
           / scale}
    with torch.no_grad():
        want = model(x)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assigned = build(sharded, device)
        assigned.load_state_dict(state, assign=True)
        out["assign"] = torch.equal(assigned(x), want)
        for p in model[1].parameters():
            (p.to_local() if sharded else p).mul_(2)
        doubled = model(x)
        loaded = build(sharded, device)
        loaded.load_state_dict({k: 2 * v if k.startswith("1.") else v
                                for k, v in state.items()})
        out["in_place"] = torch.equal(loaded(x), doubled) and not torch.equal(doubled, want)
        for p in model[1].parameters():
            (p.to_local() if sharded else p).div_(2)
        out["restored"] = torch.equal(model(x), want)
    return out


def block() -> FlaxModule:
    return FlaxModule(ReadmeDeep(width=WIDTH, lengths=LENGTHS),
                      example_args=(torch.zeros(BATCH, WIDTH),), seed=7)


def torch_layers():
    torch.manual_seed(0)
    return torch.nn.Linear(4, WIDTH), torch.nn.Linear(WIDTH, 1)


def materialized(make, sharded: bool, device: str) -> FlaxModule:
    """``make()`` built on ``device``; sharded: built on meta, ``shard``-ed, then each
    rank's shards initialized (``to_empty``, ``reset_parameters``)."""
    if not sharded:
        return make().to(device)
    with torch.device("meta"):
        module = make()
    shard(module)
    module.to_empty(device=device)
    module.reset_parameters()
    return module


def build(sharded: bool, device: str = "cpu") -> torch.nn.Sequential:
    first, last = torch_layers()
    if not sharded:
        return torch.nn.Sequential(first, block(), last).to(device)
    flax = materialized(block, sharded, device)
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(first.to(device), flax, last.to(device))
    fully_shard(model[0])
    fully_shard(model[2])
    return model


def full(model) -> dict:
    """Every parameter of ``model`` (or a dict of tensors), whole, on the CPU."""
    out = {}
    named = model.items() if isinstance(model, dict) else model.named_parameters()
    for name, p in named:
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().cpu().clone()
    return out


def gathers(owner) -> dict:
    """Per executable the block ran: gathers inside loop bodies, gathers elsewhere, and its
    peak bytes by XLA's memory analysis (arguments, outputs and temporaries: this rank's
    shards, its batch, residuals and whatever it gathers). A gather is an all-gather (the
    partitioner's) or an all-to-all (per rank: NOTE [Per-rank scans])."""
    counts = {}
    for _, kind, compiled in pipeline.executables_run(owner):
        text = compiled.as_text()
        bodies = set(re.findall(r"\bbody=%([\w.\-]+)", text))
        inside = outside = 0
        for computation in re.split(r"\n(?=[%A-Z])", text):
            header = computation.split("\n", 1)[0]
            name = re.match(r"(?:ENTRY )?%([\w.\-]+)", header)
            n = len(re.findall(r"\b(?:all-gather|all-to-all)(?:-start)?\(", computation))
            if name and name.group(1) in bodies:
                inside += n
            else:
                outside += n
        memory = compiled.memory_analysis()
        peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
        counts[kind] = (inside, outside, peak)
    return counts


def loop_collectives(owner) -> dict:
    """Per executable the block ran: per loop body, ``(all-gathers, reductions, all-to-alls)``
    in it (a per-rank stack moves a layer both ways by all-to-all: NOTE [Per-rank stacks])."""
    counts = {}
    for _, kind, compiled in pipeline.executables_run(owner):
        text = compiled.as_text()
        bodies = set(re.findall(r"\bbody=%([\w.\-]+)", text))
        found = []
        for computation in re.split(r"\n(?=[%A-Z])", text):
            name = re.match(r"(?:ENTRY )?%([\w.\-]+)", computation.split("\n", 1)[0])
            if name and name.group(1) in bodies:
                found.append((
                    len(re.findall(r"\ball-gather(?:-start)?\(", computation)),
                    len(re.findall(r"\b(?:all-reduce|reduce-scatter)(?:-start)?\(",
                                   computation)),
                    len(re.findall(r"\ball-to-all(?:-start)?\(", computation))))
        counts[kind] = found
    return counts


def stack(sharded: bool, device: str, rank: int, world: int, remat_scan_block) -> dict:
    """A ``flaxside.remat_stack`` of the same 8 layers as ``block()``, sharded or whole,
    trained 3 SGD steps on this rank's rows; its parameters (gathered) before and after,
    and the collectives of each loop body of its programs and of ``remat_scan_block``'s
    (NOTE [One collective per layer] in ``flaxside/mesh/_on_mesh.py``)."""

    def make():
        return FlaxModule(flaxside.remat_stack(ReadmeBlock, 8, lengths=LENGTHS, width=WIDTH),
                          example_args=(torch.zeros(BATCH, WIDTH),), seed=11)

    module = materialized(make, sharded, device)
    out = {"initial": full(module)}
    gen = torch.Generator().manual_seed(4)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=gen).to(device)
        opt.zero_grad()
        module(x[rows]).square().mean().backward()
        opt.step()
    out["final"] = full(module)
    out["loops"] = loop_collectives(module)
    out["remat_scan_loops"] = loop_collectives(remat_scan_block)
    return out


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def main(rank: int, world: int, port: str, out: str) -> None:
    sharded = world > 1
    backend = os.environ.get("FLAXTORCH_TEST_SHARD_BACKEND", "gloo")
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"  # as torchrun places ranks
    if backend == "nccl":
        torch.cuda.set_device(device)
    if sharded:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    report = {}
    if sharded:  # a dimension of a larger mesh: over this rank only, refused by name
        from torch.distributed.device_mesh import init_device_mesh

        own = init_device_mesh(device.split(":")[0], (world, 1), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):  # nothing may run JAX before shard() starts it
            module = block()
        try:
            shard(module, own["tp"])
            report["submesh"] = "ran"
        except ValueError as e:
            report["submesh"] = str(e)
    model = build(sharded, device)
    report["initial"] = full(model)
    report["local"] = {n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
                       for n, p in model[1].named_parameters()}
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 4, generator=gen).to(device)
        y = torch.randn(BATCH, 1, generator=gen).to(device)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        # The global gradient norm, over DTensor gradients of two meshes on the sharded run.
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor()
                     if sharded else torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
    report["final"] = full(model)
    report["norms"] = torch.stack(norms).cpu()
    report["gathers"] = gathers(model[1])
    block_params = list(model[1].parameters())
    report["bytes"] = {"params": local_bytes(block_params), "optimizer": local_bytes(
        [v for p in block_params for v in opt.state[p].values() if v.dim() > 0])}
    x = torch.randn(BATCH, WIDTH, generator=gen).to(device)
    report["tagged"] = tagged(sharded, device, x[rank * BATCH // world:][: BATCH // world])
    report["transformer"] = transformer(sharded, device, rank, world)
    report["stack"] = stack(sharded, device, rank, world, model[1])
    before = full(model)
    report["refusals"] = refusals(model[1], torch.randn(BATCH // world, WIDTH).to(device))
    report["unchanged"] = all(torch.equal(v, before[n]) for n, v in full(model).items())
    report["copies"] = copies(model[1], torch.randn(BATCH // world, WIDTH).to(device))
    if sharded:  # the reference's habits are the unsharded module's, tested elsewhere
        report["habits"] = habits(model, sharded, device,
                                  torch.randn(BATCH // world, 4).to(device))
    torch.save(report, f"{out}.{rank if sharded else 'ref'}.pt")
    # Checkpoints: this run's, and the reference's loaded into this run's layout.
    dcp.save(model.state_dict(), checkpoint_id=f"{out}.{'dcp' if sharded else 'ref-dcp'}",
             no_dist=not sharded)
    if sharded:
        dist.barrier()
        fresh = build(sharded, device)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=f"{out}.ref-dcp")
        fresh.load_state_dict(state)
        torch.save(full(fresh), f"{out}.{rank}.loaded.pt")
        dist.barrier()
        del model, fresh
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
