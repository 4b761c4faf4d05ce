"""Which outputs of a jaxpr depend on which inputs (for outputs that need no gradient)."""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend import core as jex_core


def depends_on(jaxpr, mask: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether it depends on an input marked in ``mask``.

    Conservative: an equation's outputs all depend on any of its inputs that does (so a
    scan or a nested call never under-reports). An output that does not depend on any
    marked input carries no gradient and torch can treat it as non-differentiable.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> j = jax.make_jaxpr(lambda a, b: (a * 2, b + 1))(1.0, 2.0).jaxpr
        >>> depends_on(j, [True, False])
        [True, False]
    """
    Var = jex_core.Var
    dep = {v for v, m in zip(jaxpr.invars, mask, strict=True) if m}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return [isinstance(v, Var) and v in dep for v in jaxpr.outvars]
