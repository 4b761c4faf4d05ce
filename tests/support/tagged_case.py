"""The sharded-block test's modules whose kernels carry Flax partitioning metadata.

``tagged`` is run by ``shard_worker.py`` (one process whole, two ranks sharded): Linen's
boxes and NNX's Variable metadata name the dimensions ``shard`` must split.
"""

import flax.linen as nn
import jax.numpy as jnp
import torch
from flax import nnx

from torchside import FlaxModule, shard

BATCH, WIDTH = 8, 16  # the sharded-block test's batch and width (shard_worker imports them)


class Tagged(nn.Module):
    """Kernels whose Flax partitioning metadata names their first dimension for the mesh's
    axis, once directly and once through logical axis rules (``TAGGED_RULES``); without
    it both would be sharded on their last."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(WIDTH, kernel_init=nn.with_partitioning(init, ("shard", None)))(x)
        return nn.Dense(2 * WIDTH, kernel_init=nn.with_logical_partitioning(
            init, ("embed", "mlp")))(jnp.tanh(h))


TAGGED_RULES = (("embed", "shard"), ("mlp", None))


class NnxTagged(nnx.Module):
    """``Tagged`` in NNX: the same metadata on ``nnx.Linear`` kernels (``(in, out)``)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.fc1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs,
                              kernel_init=nnx.with_partitioning(init, ("shard", None)))
        self.fc2 = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs,
                              kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def tagged(sharded: bool, device: str, x: torch.Tensor) -> dict:
    """``Tagged``'s and ``NnxTagged``'s local shapes and outputs for ``x`` (this rank's rows).

    The NNX module is built from its factory, as on meta it must be: an NNX module made
    directly runs JAX, and flax 0.12 would need a mesh in context for its metadata."""
    out = {}
    for prefix, make in (("", lambda: FlaxModule(Tagged(), example_args=(
            torch.zeros(BATCH, WIDTH),), seed=3)), ("nnx_", lambda: FlaxModule(NnxTagged,
                                                                             seed=3))):
        with torch.device("meta" if sharded else device):
            module = make()
        if sharded:
            shard(module, axis_rules=TAGGED_RULES)
            module.to_empty(device=device)
            module.reset_parameters()
        out[f"{prefix}local"] = {n: tuple(p.to_local().shape) if hasattr(p, "to_local")
                                 else tuple(p.shape) for n, p in module.named_parameters()}
        out[f"{prefix}out"] = module(x).detach().cpu()
    return out
