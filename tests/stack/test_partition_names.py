"""A stack's partition names name its dimensions, layer axes first (named by none).

``remat_stack`` stacks one layer's parameters on leading layer axes; Flax's partitioning
metadata (``nn.with_logical_partitioning``, ``nnx.with_partitioning``) names one layer's
dimensions. Kept as they were, the names would fall on the layer axes, and a rule for the
first name (``("embed", "shard")``) would shard the layer axis instead of the embedding
(what ``torchside.shard`` reads: ``FlaxModule._shard_targets``). Compared with the names
Flax's own ``nn.scan`` gives with ``metadata_params={nn.PARTITION_NAME: None}``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from flaxside import remat_stack
from torchside import FlaxModule

RULES = (("embed", "shard"), ("mlp", None))
init = nn.initializers.lecun_normal()


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(x)
        return x + nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(
            jnp.tanh(h))


class NnxLayer(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, P("mlp")),
                             rngs=rngs)
        self.down = nnx.Linear(8, 4, kernel_init=nnx.with_partitioning(init, P("mlp", "embed")),
                               rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def _scanned(n: int, inner):
    """``inner`` (a module class called on the carry) under one level of Flax's nn.scan."""

    class Level(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return inner()(c), None

    scan = nn.scan(Level, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=n, metadata_params={nn.PARTITION_NAME: None})

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, c):
            return scan()(c, None)[0]

    return Scanned


def _names(module) -> dict:
    """Per parameter (its last two path keys), the partition names of its dimensions."""
    boxed = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((2, 4)))["params"]
    flat = jax.tree_util.tree_flatten_with_path(
        nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, P))[0]
    return {tuple(getattr(k, "key", k) for k in path)[-2:]: tuple(spec)
            for path, spec in flat}


@pytest.mark.parametrize("lengths", [(4,), (2, 2)])
def test_linen_stack_names_its_layer_axes_none_like_nn_scan(lengths):
    stack = remat_stack(LinenLayer, 4, lengths=lengths)
    flax_scan = LinenLayer
    for n in reversed(lengths):  # one nn.scan per layer axis, the outermost first
        flax_scan = _scanned(n, flax_scan)
    got = _names(stack)
    assert got == _names(flax_scan())
    pad = (None,) * len(lengths)
    assert got[("Dense_0", "kernel")] == (*pad, "embed", "mlp")

    m = FlaxModule(stack, example_args=(torch.zeros(2, 4),))
    names = {n: names for (_, _, names), n in zip(m._shard_targets(RULES), m._adapter.names,
                                                   strict=True)}
    kernel = next(v for k, v in names.items() if k.endswith("Dense_0.kernel"))
    assert kernel == (*pad, "shard", None)  # the embedding, not the layer axis


@pytest.mark.parametrize("lengths", [(4,), (2, 2)])
def test_nnx_stack_names_its_layer_axes_none(lengths):
    with nnx.use_eager_sharding(False):
        stack = remat_stack(NnxLayer, 4, lengths=lengths, rngs=nnx.Rngs(0))
    pad = (None,) * len(lengths)
    m = FlaxModule(stack)
    names = dict(zip(m._adapter.names, (n for _, _, n in m._shard_targets(RULES)),
                     strict=True))
    by_end = {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1]: v for k, v in names.items()}
    assert by_end == {"up.kernel": (*pad, "shard", None), "up.bias": (*pad, None),
                      "down.kernel": (*pad, None, "shard"), "down.bias": None}


def test_nnx_partition_spec_names_count_as_names():
    """``nnx.with_partitioning(init, P(...))``: a PartitionSpec is no tuple in jax 0.10,
    and was read as no names at all."""
    with nnx.use_eager_sharding(False):
        layer = NnxLayer(nnx.Rngs(0))
    m = FlaxModule(layer)
    names = dict(zip(m._adapter.names, (n for _, _, n in m._shard_targets(RULES)),
                     strict=True))
    assert names["down.kernel"] == (None, "shard") and names["up.bias"] == (None,)


@pytest.mark.parametrize("spec, want", [
    (P(("shard",), None), ("shard", None)),  # one axis in a tuple: that axis
    (P(("shard", "x"), None), (("shard", "x"), None)),  # several: that dimension over each
])
def test_nnx_partition_spec_entries_of_several_axes_are_kept(spec, want):
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(init, spec),
                           rngs=nnx.Rngs(0))
    m = FlaxModule(layer)
    names = dict(zip(m._adapter.names, (n for _, _, n in m._shard_targets(RULES)),
                     strict=True))
    assert names["kernel"] == want
