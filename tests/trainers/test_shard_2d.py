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
"""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support import ROOT
from tests.support.closeness import close_dicts, close_steps
from tests.support.ranks import run_ranks, run_reference
from tests.support.tp_block import TPStack, twin_state
from torchside import FlaxModule

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
