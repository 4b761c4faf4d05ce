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


def linear_in_cotangent(jaxpr) -> bool:
    """Whether the VJP of ``jaxpr`` is linear in its cotangent, and safe to scale after.

    JAX's own rules are: a VJP is the transpose of a linear map. A ``custom_vjp`` rule may
    be anything (``jnp.sign`` of the gradient, clipping), and float16 values may underflow
    for a cotangent of one that a scaled loss (``torch.amp.GradScaler``) would keep. Either,
    anywhere in ``jaxpr`` or the jaxprs its equations call, answers ``False``.
    """
    for v in jaxpr.invars:
        if getattr(v.aval, "dtype", None) == "float16":
            return False
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("custom_vjp"):
            return False
        if any(getattr(v.aval, "dtype", None) == "float16" for v in eqn.outvars):
            return False
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns") and not linear_in_cotangent(sub):
                    return False
    return True
