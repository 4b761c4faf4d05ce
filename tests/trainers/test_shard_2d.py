"""A Flax block sharded over a 2x2 ``("fsdp", "tensor")`` mesh of 4 gloo ranks.

``tests/support/shard2d_worker.py`` builds ``TPStack`` (a 2-layer ``nn.scan(nn.remat)``
Transformer whose parameters carry logical names) once in one process on the full batch,
and once on 4 ranks over the mesh ``[[0, 2], [1, 3]]`` with ``RULES``: model dimension
over "fsdp", attention heads and MLP units over "tensor", the batch over "fsdp". Checked:
the sharded init equals a direct build bit for bit; every parameter's DTensor placements
are the rules' (a kernel a quarter per rank, a LayerNorm or bias half); the first step's
gradients equal one process's on the full batch (FSDP's mean over the "fsdp" ranks only:
the "tensor" ranks compute one loss together) and the torch twin's under
``parallelize_module`` (Megatron-style column/row splits on ``mesh["tensor"]``) plus
``fully_shard`` on ``mesh["fsdp"]``; two AdamW steps end where both end; the same layer
stacked by ``flaxside.remat_stack`` (its own loop) does the same against one process; input
gradients are each rank's own, whole over the "tensor" ranks; a deep copy computes the
same; the 2x2 ``torch.distributed.checkpoint`` loads into one process; an NNX module's
``nnx.with_partitioning`` names go through the same rules (one dimension over both axes).
Then, in this process: the specs, DTensor placements and JAX mesh ``shard`` derives
(``torchside/integrations/_shard_specs.py``) and its refusals.
"""

import os
import subprocess
import sys
import warnings

import flax.linen as nn
import pytest
import torch
import torch.distributed.checkpoint as dcp
from jax.sharding import PartitionSpec as P
from torch.distributed.tensor import DTensor

from tests.support import ROOT
from tests.support.closeness import close_dicts, close_steps
from tests.support.ranks import run_ranks, run_reference
from tests.support.tp_block import TPStack, twin_state
from tests.support.twins import ReadmeDeep
from torchside import FlaxModule, shard
from torchside.integrations._shard_specs import batch_axes_on as _batch_axes
from torchside.integrations._shard_specs import leaf_spec as _leaf_spec

pytestmark = pytest.mark.processes  # gloo ranks: alone under pytest-xdist (conftest)

WORKER = ROOT / "tests" / "support" / "shard2d_worker.py"

# RULES's placements, per mesh dimension ("fsdp", "tensor"); stacked leaves lead with the
# layer axis (named "layers", mapped to no mesh axis).
PLACEMENTS = {
    "attn.query.kernel": ("S(1)", "S(2)"),  # (layers, embed, heads, kv)
    "attn.key.kernel": ("S(1)", "S(2)"),
    "attn.value.kernel": ("S(1)", "S(2)"),
    "attn.query.bias": ("R", "S(1)"),  # (layers, heads, kv)
    "attn.key.bias": ("R", "S(1)"),
    "attn.value.bias": ("R", "S(1)"),
    "attn.out.kernel": ("S(3)", "S(1)"),  # (layers, heads, kv, embed)
    "attn.out.bias": ("S(1)", "R"),  # (layers, embed)
    "fc1.kernel": ("S(1)", "S(2)"),  # (layers, embed, mlp)
    "fc1.bias": ("R", "S(1)"),  # (layers, mlp)
    "fc2.kernel": ("S(2)", "S(1)"),  # (layers, mlp, embed)
    "fc2.bias": ("S(1)", "R"),
    "ln1.scale": ("S(1)", "R"), "ln1.bias": ("S(1)", "R"),
    "ln2.scale": ("S(1)", "R"), "ln2.bias": ("S(1)", "R"),
}


def _local_shape(whole: tuple, placements: tuple) -> tuple:
    shape = list(whole)
    for p in placements:
        if p.startswith("S("):
            shape[int(p[2:-1])] //= 2
    return tuple(shape)


def _trained(grads: dict) -> dict:
    """``grads`` but the attention key's bias, whose gradient is zero but for rounding (a
    constant added to a query's logits, which softmax ignores): checked to be so."""
    scale = max(float(g.abs().max()) for g in grads.values())
    keys = [n for n in grads if n.endswith(("key.bias", "wk.bias"))]
    assert len(keys) in (1, 2)  # Flax's one stacked leaf, or the twin's per layer
    for n in keys:
        assert float(grads[n].abs().max()) <= 1e-6 * scale, (n, scale)
    return {n: g for n, g in grads.items() if n not in keys}


def test_a_block_on_a_2x2_mesh_trains_like_one_process_and_like_tp_plus_fsdp2(tmp_path):
    out = tmp_path / "run"
    ref = run_reference(WORKER, out)
    assert ref.returncode == 0, ref.stderr[-3000:]
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    codes = run_ranks(WORKER, out, logs)
    assert codes == [0] * 4, "\n".join(log.read_text()[-3000:] for log in logs)
    reference = torch.load(f"{out}.ref.pt")
    ranks = [torch.load(f"{out}.{r}.pt") for r in range(4)]
    for kind, prefix in (("scan", "params.stack.layer."), ("stack", "params.")):
        names = {n.removeprefix(prefix): n for n in reference[kind]["initial"]}
        assert set(names) == set(PLACEMENTS), kind
        want = reference[kind]
        for r, report in enumerate(ranks):
            got, what = report[kind], f"{kind} on rank {r}"
            for name, value in want["initial"].items():  # the sharded init, bit for bit
                assert torch.equal(got["initial"][name], value), (what, name)
            for short, placements in PLACEMENTS.items():
                whole = tuple(want["initial"][names[short]].shape)
                assert got["local"][names[short]] == (_local_shape(whole, placements),
                                                      placements), (what, short)
            # One process's gradients on the full batch, and where two steps end. The
            # input's are this rank's own loss's (a mean over half the rows: twice the
            # full batch's), whole over the "tensor" ranks, as ColwiseParallel's are.
            got_grads, want_grads = dict(got["grads"]), dict(want["grads"])
            rows = slice(0, 4) if r in (0, 2) else slice(4, 8)
            close_dicts({"input": got_grads.pop("input")},
                        {"input": 2 * want_grads.pop("input")[rows]}, f"{what}: input grad")
            close_dicts(_trained(got_grads), _trained(want_grads), f"{what}: gradients")
            close_steps(got["final"], want["final"], want["initial"], 1e-3, f"{what}: trained")
    for r, report in enumerate(ranks):  # the torch twin under TP + FSDP2, from the scan's
        twin, flax = report["twin"], report["scan"]  # weights, on the same rows
        flax_grads, twin_grads = dict(flax["grads"]), dict(twin["grads"])
        close_dicts({"input": flax_grads.pop("input")}, {"input": twin_grads.pop("input")},
                    f"input gradients vs the twin, rank {r}")
        close_dicts(_trained(twin_state(flax_grads)), _trained(twin_grads),
                    f"gradients vs the twin, rank {r}")
        close_steps(twin_state(flax["final"]), twin["final"], twin["initial"], 1e-2,
                    f"trained vs the twin, rank {r}", untrained=("wk.bias",))
        # NNX: the rules map its names; a kernel a quarter per rank, mix's first dimension
        # over both axes (torch splits it in mesh order, as JAX's ("fsdp", "tensor")).
        assert report["nnx_local"]["up.kernel"] == ((8, 32), ("S(0)", "S(1)"))
        assert report["nnx_local"]["down.kernel"] == ((32, 8), ("S(1)", "S(0)"))
        assert report["nnx_local"]["mix.kernel"] == ((4, 16), ("S(0)", "S(0)"))
        for name, value in reference["nnx_initial"].items():
            assert torch.equal(report["nnx_initial"][name], value), (r, name)
        assert report["deepcopy"]
        # Without axis_rules no parameter is split over "tensor": said, not left silent.
        assert any("no parameter is split over mesh dimension(s) ['tensor']" in w
                   and "axis_rules" in w for w in report["idle_warning"]), report["idle_warning"]
        # reduce_dtype other than the compute dtype: only per rank, on one batch axis.
        assert ("reduce_dtype=torch.float32 differs from the compute dtype" in
                report["reduce_dtype"] and "Pass reduce_dtype=None" in report["reduce_dtype"]
                and report["reduce_dtype_unchanged"]), report["reduce_dtype"]
    # Each "fsdp" coordinate's rows (ranks 0 and 2, then 1 and 3), the same on its
    # "tensor" ranks.
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(ranks[a]["nnx_out"], ranks[b]["nnx_out"])
    close_dicts({"out": torch.cat([ranks[0]["nnx_out"], ranks[1]["nnx_out"]])},
                {"out": reference["nnx_out"]}, "the NNX module's output")
    # The 2x2 checkpoint, loaded into one process's block (a user evaluating on one device).
    single = FlaxModule(TPStack(), example_args=(torch.zeros(8, 6, 16),), seed=0)
    state = single.state_dict()
    with warnings.catch_warnings():  # DCP says it loads in one process, as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=f"{out}.dcp", no_dist=True)
    single.load_state_dict(state)
    assert not torch.equal(state["params.stack.layer.fc1.kernel"],
                           ranks[0]["scan"]["initial"]["params.stack.layer.fc1.kernel"])
    close_dicts({k: v.detach() for k, v in single.named_parameters()}, ranks[0]["scan"]["final"],
                "the 2x2 checkpoint loaded in one process")


class _TwiceOnOneAxis(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, kernel_init=nn.with_partitioning(
            nn.initializers.lecun_normal(), ("fsdp", "fsdp")))(x)


def test_a_mesh_shard_cannot_follow_is_refused_by_name_before_anything_changes(one_rank):
    """A mesh of several dimensions needs names (which splits the batch, which Flax's names
    mean); ``batch_axes`` must name a dimension; an axis shards one dimension of a
    parameter. Each refused before JAX's runtime starts, the module left as it was."""
    from torch.distributed.device_mesh import DeviceMesh

    with torch.device("meta"):
        m = FlaxModule(ReadmeDeep(width=8), example_args=(torch.zeros(2, 8),))
        twice = FlaxModule(_TwiceOnOneAxis(), example_args=(torch.zeros(2, 8),))
    with pytest.raises(ValueError, match=r"mesh has 2 dimensions \(1, 1\) and no names.*"
                                         r"mesh_dim_names=\('fsdp', 'tensor'\)"):
        shard(m, DeviceMesh("cpu", [[0]]))
    named = DeviceMesh("cpu", [[0]], mesh_dim_names=("fsdp", "tensor"))
    with pytest.raises(ValueError, match=r"batch_axes='dp', but the mesh's dimensions "
                                         r"are \('fsdp', 'tensor'\)"):
        shard(m, named, batch_axes="dp")
    with pytest.raises(ValueError, match=r"batch_axes=\('fsdp', 'fsdp'\).*a tuple of "
                                         r"distinct ones"):
        shard(m, named, batch_axes=("fsdp", "fsdp"))
    with pytest.raises(ValueError, match=r"'params.Dense_0.kernel' has partition names "
                                         r"\('fsdp', 'fsdp'\).*over the mesh axis 'fsdp'"):
        shard(twice, named)
    # Batch axes of one rank split nothing: dropped (the first kept), so an (N, 1) mesh runs
    # as the one-dimensional one it is (per-rank stacks, reduce_dtype).
    assert _batch_axes(("fsdp", "tensor"), ("fsdp", "tensor"), (1, 1), "M") == ("fsdp",)
    assert _batch_axes(("fsdp", "tensor"), ("fsdp", "tensor"), (4, 1), "M") == ("fsdp",)
    assert _batch_axes(("fsdp", "tensor"), ("fsdp", "tensor"), (2, 2), "M") == (
        "fsdp", "tensor")
    for module in (m, twice):
        assert module._caller.plan is None
        assert not any(isinstance(p, DTensor) for p in module.parameters())


@pytest.mark.parametrize("shape, names, tensor, want", [
    ((2, 8, 64), (None, "fsdp", "tensor"), 2, P(None, "fsdp", "tensor")),
    ((2, 8, 64), (None, ("tensor", "fsdp"), None), 2, P(None, ("fsdp", "tensor"), None)),
    ((2, 6, 64), (None, ("fsdp", "tensor"), "x"), 2, None),  # 6 % 4: none; "x": no such axis
    ((2, 8), (None, "tensor"), 2, P(None, "tensor")),  # named for "tensor" only: not fsdp
    ((4, 3), None, 2, P("fsdp", None)),  # no names: FSDP-style, the last that divides by 2
    ((3,), None, 2, None),
    # An axis of one rank shards nothing: dropped, so the leaf is split over the batch
    # axis alone (else remat_stack's per-rank route gathered it whole before its loop).
    ((2, 8, 64), (None, "fsdp", "tensor"), 1, P(None, "fsdp", None)),
])
def test_a_parameters_spec_on_a_2d_mesh(shape, names, tensor, want):
    """Flax's names in mesh order (torch splits a dimension sharded twice in mesh order)."""
    sizes = {"fsdp": 2, "tensor": tensor}
    assert _leaf_spec("w", shape, sizes, names, ("fsdp",), "M") == want


_PLACEMENTS = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np, torch, torch.distributed as dist
from jax.sharding import NamedSharding, PartitionSpec as P
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchside.integrations._shard_specs import batch_axes_on as _batch_axes, jax_mesh as _jax_mesh
from torchside.integrations._shard_specs import dtensor_placements as _placements
from torchside.integrations._shard_specs import leaf_spec as _leaf_spec

devices = jax.devices()
checked = 0
for ranks in ([[0, 2], [1, 3]], [[0, 1], [2, 3]]):
    for names in (("fsdp", "tensor"), ("tensor", "fsdp")):
        jax_mesh = _jax_mesh(np.array(ranks), names, dict(enumerate(devices)))
        for shape, flax_names, batch in [
                ((2, 8, 64), (None, "fsdp", "tensor"), None),
                ((2, 8, 64), (None, "tensor", "fsdp"), None),
                ((2, 8, 6), (None, ("fsdp", "tensor"), None), None),
                ((2, 8, 6), (None, ("tensor", "fsdp"), None), None),
                ((2, 8), (None, "tensor"), None), ((4, 3), None, None),
                ((4, 3), None, "tensor"), ((8, 3), None, ("tensor", "fsdp"))]:
            axes = _batch_axes(batch, names, (2, 2), "M")
            spec = _leaf_spec("w", shape, dict(zip(names, (2, 2))), flax_names, axes, "M")
            where = NamedSharding(jax_mesh, P() if spec is None else spec)
            blocks = where.devices_indices_map(shape)
            whole = torch.arange(int(np.prod(shape))).reshape(shape)
            for rank in range(4):
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
                try:
                    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=names)
                    mine = distribute_tensor(whole, mesh, _placements(spec, names),
                                             src_data_rank=None).to_local()
                finally:
                    dist.destroy_process_group()
                want = whole[blocks[devices[rank]]]
                assert torch.equal(mine, want), (ranks, names, shape, flax_names, batch, rank)
                checked += 1
print("checked", checked)
"""


def test_dtensor_shards_are_the_blocks_jax_gives_each_process_on_a_2d_mesh():
    """For each kind of spec (an axis per dimension, two on one dimension in either order,
    the tensor axis only, FSDP-style over one or two batch axes), on meshes in and out of
    rank order with either dimension first: rank r's local shard of ``distribute_tensor``
    with ``shard``'s placements is the block JAX's sharding gives process r on the mesh
    ``shard`` builds. A fake process group per rank; four host devices in a subprocess."""
    done = subprocess.run([sys.executable, "-c", _PLACEMENTS], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(2 * 2 * 8 * 4), done.stdout
