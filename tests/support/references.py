"""Conversions to compare torch results with pure JAX, and the pure-NNX training step.

The reference side of a test computes on JAX copies of the tensors' current values, never
on memory the bridge shares with torch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx


def to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX copy of a CPU tensor's values (detached)."""
    return jnp.asarray(t.detach().numpy())


def to_torch(a) -> torch.Tensor:
    """A torch copy of a JAX or numpy array."""
    return torch.from_numpy(np.array(a))


def _grads_by_name(state) -> dict:
    return {".".join(str(k) for k in path): v.get_value()
            for path, v in nnx.to_flat_state(state)}


def nnx_step(module: nnx.Module, x, ct):
    """Output and gradients (Params by dotted name, x) of ``sum(module(x) * ct)`` in NNX.

    ``nnx.value_and_grad`` propagates what the forward changes in ``module`` (its graph,
    its RNG counts) as ``nnx.jit`` does.
    """
    def loss(m, x):
        y = m(x)
        return jnp.sum(y * ct), y

    (_, y), (g_m, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(module, x)
    return y, _grads_by_name(g_m), g_x
