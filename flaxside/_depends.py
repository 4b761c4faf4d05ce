"""Which inputs of a jaxpr each output depends on (gradients, unused outputs and inputs)."""

from __future__ import annotations

try:  # jax >= 0.4.36
    from jax.extend.core import Var
except ImportError:  # pragma: no cover - older jax
    from jax.core import Var


def input_masks(jaxpr) -> list[int]:
    """For each output of ``jaxpr``, a bitmask of the inputs it depends on (bit i: input i).

    Conservative: an equation's outputs all depend on every input of the equation (so a
    scan or a nested call never under-reports). An output that depends on no
    differentiated input carries no gradient; a differentiated input that no used output
    depends on gets ``None`` from torch, and an input no output depends on is never read.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> j = jax.make_jaxpr(lambda a, b: (a * 2, b + a))(1.0, 2.0).jaxpr
        >>> input_masks(j)
        [1, 3]
    """
    masks = {v: 1 << i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        m = 0
        for v in eqn.invars:
            if isinstance(v, Var):
                m |= masks.get(v, 0)
        if m:
            for v in eqn.outvars:
                masks[v] = m
    return [masks.get(v, 0) if isinstance(v, Var) else 0 for v in jaxpr.outvars]
