"""``remat_stack`` over a mesh: one collective per layer, run by test_mesh_collectives.py.

Not collected by the main run (no ``test_`` prefix): ``test_mesh_collectives.py`` runs this
file with pytest in a subprocess with two host devices, which JAX takes only at start.
Each case builds a ``flaxside`` program of a stack placed ``OnMesh`` over the two devices
(parameters sharded FSDP-style on their last dimension that divides, the batch on its
first), runs its compiled programs on global arrays, and checks them against the same
program on one device, and each loop body's collectives (NOTE [One collective per layer]
in ``flaxside/mesh/_on_mesh.py``).
"""

import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxside
from flaxside.internal import ARRAY, LeafSpec, OnMesh, Program, flat_apply, unpack
from tests.support.twins import ReadmeBlock

jtu = jax.tree_util
N = 2
LOOP_COLLECTIVES = (r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                    r"(?:-start)?\(")


class NnxBlock(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


def _fsdp_dim(shape):
    """The dimension ``torchside.shard`` picks without metadata: the last that divides."""
    for d in reversed(range(len(shape))):
        if shape[d] % N == 0 and shape[d] >= N:
            return d
    return None


def _spec(ndim: int, dim):
    """The ``PartitionSpec`` of an array of ``ndim`` dimensions sharded over "s" on ``dim``."""
    return None if dim is None else P(*("s" if k == dim else None for k in range(ndim)))


def _programs(fn, leaves, batch_leaves: int, dims=None, diff=None, **precision):
    """The program ``OnMesh`` (local specs) and on one device, and the leaves' dims.

    ``dims``: per variable leaf its sharded dimension (default: ``_fsdp_dim``'s).
    ``diff``: per leaf, whether its gradient is asked for (default: every leaf's).
    ``precision``: ``OnMesh``'s ``cast`` and ``reduce`` (NOTE [Mixed precision]).
    """
    mesh = Mesh(np.array(jax.devices()[:N]), ("s",))
    n_vars = len(leaves) - batch_leaves
    if dims is None:
        dims = [_fsdp_dim(x.shape) for x in leaves[:n_vars]]
    dims = tuple(dims) + (0,) * batch_leaves
    batch = (False,) * n_vars + (True,) * batch_leaves

    diff = (True,) * len(leaves) if diff is None else diff

    def local(x, d, g):
        shape = list(x.shape)
        if d is not None:
            shape[d] //= N
        return LeafSpec(tuple(shape), np.dtype(x.dtype), g)

    sharded = Program(fn, [local(x, d, g) for x, d, g in zip(leaves, dims, diff, strict=True)],
                      placement=OnMesh(mesh, ("s",), tuple(_spec(x.ndim, d) for x, d in zip(
                          leaves, dims, strict=True)), batch, **precision))
    whole = Program(fn, [LeafSpec(x.shape, np.dtype(x.dtype), True) for x in leaves])
    placed = [jax.device_put(x, NamedSharding(mesh, P(*[("s" if k == d else None)
                                                         for k in range(x.ndim)])))
              for x, d in zip(leaves, dims, strict=True)]
    return sharded, whole, placed, mesh, batch, dims


def _run(program, leaves, ct, call):
    out = call(program, "forward_with_residuals")(leaves)
    n, rmap = len(program.out_specs), program.residual_map()
    buffers = call(program, "backward")([leaves[j] for j in rmap.saved_inputs],
                                         [out[k] for k in rmap.saved_outputs], out[n:], [ct])
    return out[0], unpack(buffers, program.grad_pack)


def _loop_collectives(program) -> dict:
    """Per program kind, per while-loop body, the collective ops in it."""
    counts = {}
    for kind in ("forward_with_residuals", "backward"):
        text = program.compiled(kind).as_text()
        bodies = set(re.findall(r"\bbody=%([\w.\-]+)", text))
        counts[kind] = [
            re.findall(LOOP_COLLECTIVES, c) for c in re.split(r"\n(?=[%A-Z])", text)
            if (m := re.match(r"(?:ENTRY )?%([\w.\-]+)", c)) and m.group(1) in bodies]
    return counts


def _check(fn, leaves, batch_leaves: int = 1, dims=None, rtol: float = 1e-5):
    """Results and gradients equal to one device's (``rtol``: float32's sums in another
    order; a block computing in bfloat16 rounds differently per shape), and the loop bodies'
    collectives."""
    sharded, whole, placed, mesh, batch, _ = _programs(fn, leaves, batch_leaves, dims)
    rng = np.random.default_rng(1)
    out_shape = jax.eval_shape(lambda ls: fn(ls)[0], leaves)
    ct = jnp.asarray(rng.standard_normal(out_shape.shape), jnp.float32)
    got_y, got_g = _run(sharded, placed, jax.device_put(ct, NamedSharding(mesh, P("s"))),
                        lambda p, kind: p.compiled(kind))
    want_y, want_g = _run(whole, leaves, ct, lambda p, kind: p.executable(kind))
    # One program partitioned two ways: float32 sums in another order, scaled.
    np.testing.assert_allclose(got_y, want_y, rtol=rtol,
                               atol=rtol / 10 * float(jnp.abs(want_y).max()))
    for g, w, b in zip(got_g, want_g, batch, strict=True):
        g = g if b else g * N  # FSDP's mean over ranks for what is not in the batch
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(jnp.abs(w).max()))
    return _loop_collectives(sharded)


def _linen(width: int, lengths, policy=None):
    return applied(flaxside.remat_stack(ReadmeBlock, int(np.prod(lengths)), lengths=lengths,
                                        policy=policy, width=width), width)


def applied(module: nn.Module, width: int):
    """A Linen module's program function over ``(*variables, x)``, and those leaves (its
    dropout drawn from a fixed key)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4 * N, width)), jnp.float32)
    variables = module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    leaves, treedef = jtu.tree_flatten(variables)
    _, args = jtu.tree_flatten(((x,), {}))
    key = jax.random.key(2)
    fn = flat_apply(lambda v, *a: (module.apply(v, *a, rngs={"dropout": key}), [], None),
                    treedef, args, (ARRAY,))
    return fn, [*leaves, x]


def partitioners_route(counts, own: int = 0) -> None:
    """The partitioner's route: per loop body at most one packed all-gather and no
    all-to-all; its reductions are the layer's own (``own`` per body: a batch mean's, its
    transpose in the backward) and, in a backward body, one for the layer's gradients
    (XLA's combiner joins them). Mutation: the packed gradients reduced one by one."""
    for kind, bodies in counts.items():
        assert any("all-gather" in ops for ops in bodies), (kind, bodies)
        for ops in bodies:
            assert ops.count("all-gather") <= 1, (kind, bodies)
            assert not set(ops) - {"all-gather", "all-reduce", "reduce-scatter"}, (kind, ops)
            reductions = ops.count("all-reduce") + ops.count("reduce-scatter")
            assert reductions <= own + (kind == "backward"), (kind, bodies)


def _per_rank(counts) -> None:
    """Per rank (NOTE [Per-rank stacks]): a forward body gathers its layer in one
    all-to-all; a backward body holds at most that and the gradient's one all-to-all, and
    one body does both (the layer's VJP)."""
    for kind, bodies in counts.items():
        assert all(set(ops) <= {"all-to-all"} for ops in bodies), (kind, bodies)
        most = 1 if kind == "forward_with_residuals" else 2
        assert max(len(ops) for ops in bodies) == most, (kind, bodies)


@pytest.mark.parametrize(("lengths", "policy"), [((2, 4), None), ((8,), "dots_saveable")],
                         ids=["two-levels", "one-level-dots"])
def test_a_linen_stack_gathers_each_layer_in_one_collective(lengths, policy):
    _per_rank(_check(*_linen(16, lengths, policy)))


def test_an_nnx_stack_gathers_each_layer_in_one_collective():
    stack = flaxside.remat_stack(NnxBlock, 4, lengths=(2, 2), rngs=nnx.Rngs(0), width=16)
    graphdef, state = nnx.split(stack)
    leaves, treedef = jtu.tree_flatten(state)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4 * N, 16)), jnp.float32)

    def fn(ls):
        model = nnx.merge(graphdef, jtu.tree_unflatten(treedef, ls[:-1]))
        return model(ls[-1]), [], None

    _per_rank(_check(fn, [*leaves, x]))


class BatchCentered(nn.Module):
    """Mixes the batch: each row minus the batch's mean, which per rank would be its half's."""

    width: int

    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(self.width)(x - x.mean(axis=0)))


class Dropped(nn.Module):
    """Draws dropout bits for the carry's global shape: per rank, each would draw its own
    half's bits from the start of the stream instead of from its rows' offset."""

    width: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(self.width)(x)))


@pytest.mark.parametrize(("block", "own"), [(BatchCentered, 1), (Dropped, 0)],
                         ids=["batch-mean", "dropout"])
def test_a_layer_that_is_not_the_same_per_rank_keeps_the_partitioners_route(block, own):
    """Run per rank, these would compute something else; ``_check`` compares them with the
    program on one device (it fails with the per-rank probe bypassed)."""
    partitioners_route(_check(*applied(flaxside.remat_stack(block, 4, lengths=(2, 2),
                                                            width=16), 16)), own)


def test_a_parameter_sharded_on_a_layer_axis_is_left_to_xla():
    """A leaf sharded on a layer axis (as ``torchside.shard`` does where no other dimension
    divides): a layer is one rank's, so XLA moves it; the rest is still packed."""
    fn, leaves = _linen(16, (2, 4))
    dims = [_fsdp_dim(x.shape) for x in leaves[:-1]]
    dims[0] = 1  # the first leaf, (2, 4, 16), on its inner layer axis
    counts = _check(fn, leaves, dims=dims)
    # One packed gather per loop body, and XLA's own moves of the layer-sharded leaf.
    assert all(ops.count("all-gather") <= 2 for bodies in counts.values() for ops in bodies)
    assert any(ops.count("all-gather") == 1 for bodies in counts.values() for ops in bodies)


def _tanh(p, c):
    return jnp.tanh(c @ p)


LAYERS = {  # stack_apply layers a per-rank run would compute otherwise
    "batch-size": lambda p, c, k, i: _tanh(p, c) * (8.0 / c.shape[0]),
    "index": lambda p, c, k, i: jnp.where(i % 2 == 1, _tanh(p, c) - _tanh(p, c).mean(0),
                                          _tanh(p, c)),
    "groups": lambda p, c, k, i: (lambda g: (g - g.mean(1, keepdims=True)).reshape(c.shape))(
        _tanh(p, c).reshape(2, -1, c.shape[-1])),
}


def _functional(layer, consts=()):
    """A ``flaxside.stack_apply`` of ``layer`` over 4 layers of (16, 16) weights, on 8 rows."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 16, 16)) / 4, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4 * N, 16)), jnp.float32)

    def fn(ls):
        return flaxside.stack_apply(layer, ls[0], ls[1], consts, lengths=(2, 2),
                                    layout=(4,)), [], None

    return fn, [w, x]


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layer_that_reads_the_batch_size_or_its_index_keeps_the_partitioners_route(name):
    """Python code that reads the batch's size (a scale, a fixed number of groups), or a
    batch mean behind the layer index (which a probe at index 0 alone would miss): the
    partitioner's route, and its results (the per-rank route computes others)."""
    partitioners_route(_check(*_functional(LAYERS[name])), own=int(name == "index"))


def test_a_python_scalar_among_the_consts_runs_per_rank():
    _per_rank(_check(*_functional(lambda p, c, k, i: _tanh(p, c) * k, consts=0.5)))


def test_a_sum_in_another_dtype_is_refused_only_where_a_gradient_is_summed_elsewhere():
    """``OnMesh.reduce`` on a stacked leaf: refused where the leaf is also read outside its
    per-rank stack (the partitioner would sum that part in bfloat16); taken where the
    gradient is not asked for, or where the leaf is not read at all."""
    bf16, f32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)

    def stacked(ls):
        return flaxside.stack_apply(lambda p, c, k, i: _tanh(p, c), ls[0], ls[1],
                                    lengths=(2, 2), layout=(4,)), [], None

    def also_outside(ls):
        y, _, _ = stacked(ls)
        return y + ls[1] @ ls[0][0], [], None

    def unread(ls):
        return jnp.tanh(ls[1]), [], None

    _, leaves = _functional(None)
    precision = {"cast": (bf16, bf16), "reduce": (f32, None)}
    with pytest.raises(ValueError, match=r"leaves \[0\].*reduce_dtype"):
        _programs(also_outside, leaves, 1, **precision)
    _programs(also_outside, leaves, 1, diff=(False, True), **precision)  # no gradient asked
    _programs(unread, leaves, 1, **precision)  # nothing reads it
    sharded, _, _, _, _, _ = _programs(stacked, leaves, 1, **precision)  # per rank
    _per_rank(_loop_collectives(sharded))


# -- mixed precision (NOTE [Mixed precision] in flaxside/mesh/_on_mesh.py) -----------------------
def _partitioned(dump, program) -> dict:
    """Per program kind, per while-loop body, ``(op, element type)`` of each collective as
    XLA's SPMD partitioner emitted it: read from the module XLA_FLAGS dumps after the
    pass, since the CPU backend widens bfloat16 collectives to float32 later on."""
    counts = {}
    program.compiled("backward")  # and the forward
    for kind, body in (("forward_with_residuals", "_forward_res_body"),
                       ("backward", "_backward_body")):
        text = sorted(dump.glob(f"*jit_{body}.*after_spmd-partitioning*"))[-1].read_text()
        bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))
        counts[kind] = [
            re.findall(r"= \(?(\w+)\[[^=]*? " + LOOP_COLLECTIVES[2:], c)
            for c in re.split(r"\n(?=[%A-Z])", text)
            if (m := re.match(r"(?:ENTRY )?%?([\w.\-]+)", c)) and m.group(1) in bodies]
    return counts


@pytest.mark.skipif("--xla_dump_to" not in os.environ.get("XLA_FLAGS", ""),
                    reason="test_mesh_collectives.py runs it with XLA's dump")
@pytest.mark.parametrize("reduce", [None, np.dtype(np.float32)], ids=["bf16-sum", "f32-sum"])
def test_a_bfloat16_policy_gathers_each_layer_cast_in_one_collective(reduce):
    """``OnMesh(cast=bfloat16)`` on the parameters and the batch (as ``torchside.shard``'s
    ``mp_policy`` reads them): per rank, each loop body's all-to-alls as the partitioner
    emits them, at most one per direction: the gather of bfloat16 (cast before it), the
    gradient's in the dtype it is summed in, bfloat16 as computed or float32 where
    ``OnMesh.reduce`` asks (FSDP2's ``reduce_dtype``).

    The CPU backend then promotes bfloat16 collectives to float32 (NOTE [Mixed precision]).
    """
    fn, leaves = _linen(16, (2, 4))
    n_vars = len(leaves) - 1
    cast = (np.dtype(jnp.bfloat16),) * len(leaves)
    more = {} if reduce is None else {"reduce": (reduce,) * n_vars + (None,)}
    sharded, _, _, _, _, _ = _programs(fn, leaves, 1, cast=cast, **more)
    dump = Path(os.environ["XLA_FLAGS"].split("--xla_dump_to=")[1].split()[0])
    counts = _partitioned(dump, sharded)
    assert {t for ops in counts["forward_with_residuals"] for t, _ in ops} == {"bf16"}, counts
    # The backward's bodies: the segment's gather, and the VJP's gather and reduction.
    want = [["bf16"], ["bf16", "bf16" if reduce is None else "f32"]]
    assert sorted(sorted(t for t, _ in ops) for ops in counts["backward"] if ops) == sorted(
        sorted(w) for w in want), counts
    _per_rank(_loop_collectives(sharded))


def test_a_sum_in_another_dtype_is_refused_where_the_partitioner_reduces():
    """``OnMesh.reduce`` on a layer that keeps the partitioner's route (a batch mean): the
    partitioner sums in the compute dtype, so the program refuses to trace."""
    stack = flaxside.remat_stack(BatchCentered, 4, lengths=(2, 2), width=16)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4 * N, 16)), jnp.float32)
    leaves, treedef = jtu.tree_flatten(stack.init(jax.random.key(0), x))
    _, args = jtu.tree_flatten(((x,), {}))
    fn = flat_apply(lambda v, *a: (stack.apply(v, *a), [], None), treedef, args, (ARRAY,))
    n = len(leaves)
    with pytest.raises(ValueError, match=r"reduce_dtype.*flaxside\.remat_stack that runs per"):
        _programs(fn, [*leaves, x], 1, cast=(np.dtype(jnp.bfloat16),) * (n + 1),
                  reduce=(np.dtype(np.float32),) * n + (None,))  # traced where it is built
