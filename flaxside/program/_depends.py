"""What a jaxpr's outputs depend on, and whether two traces of a function are one program."""

from __future__ import annotations

import jax
import numpy as np

from flaxside import jaxprs


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
    for eqn in jaxprs.walk(jaxpr):
        m = 0
        for v in eqn.invars:
            if jaxprs.is_var(v):
                m |= masks.get(v, 0)
        if m:
            for v in eqn.outvars:
                masks[v] = m
    return [masks.get(v, 0) if jaxprs.is_var(v) else 0 for v in jaxpr.outvars]


def linear_in_cotangent(jaxpr) -> bool:
    """Whether the VJP of ``jaxpr`` is linear in its cotangent, and safe to scale after.

    JAX's own rules are: a VJP is the transpose of a linear map. A ``custom_vjp`` rule may
    be anything (``jnp.sign`` of the gradient, clipping), and float16 values may underflow
    for a cotangent of one that a scaled loss (``torch.amp.GradScaler``) would keep. Either,
    anywhere in ``jaxpr`` or the jaxprs its equations call, answers ``False``.
    """
    def float16(v) -> bool:
        return getattr(v.aval, "dtype", None) == "float16"

    # An equation's operands as well as its outputs: a float16 literal handed to a call is
    # a float16 input of the jaxpr it calls.
    return not (any(map(float16, jaxpr.invars))
                or any(eqn.primitive.name.startswith("custom_vjp")
                       or any(map(float16, eqn.invars)) or any(map(float16, eqn.outvars))
                       for eqn in jaxprs.walk(jaxpr, deep=True)))


def same_up_to_batch(big, small, n: int) -> bool:
    """Whether two traces of one function are one program, ``big``'s batch ``n`` times larger.

    Equations, parameters and literals equal, shapes equal but for a first dimension ``n``
    times as large.

    Tells a function that only carries its batch through (a layer run per rank on its
    rows computes what it computes on the whole batch) from one whose Python code reads the
    batch's size (``x * 8 / x.shape[0]``, a reshape into a fixed number of groups). A
    difference anywhere else, even a harmless one, answers ``False``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> t = lambda f, b: jax.make_jaxpr(f)(jnp.zeros((b, 3))).jaxpr
        >>> same_up_to_batch(t(jnp.tanh, 8), t(jnp.tanh, 4), 2)
        True
        >>> same_up_to_batch(t(lambda x: x / x.shape[0], 8), t(lambda x: x / x.shape[0], 4), 2)
        False
    """
    def shapes(a, b) -> bool:
        return len(a) == len(b) and all(
            x == y or (k == 0 and isinstance(x, int) and x == n * y)
            for k, (x, y) in enumerate(zip(a, b, strict=True)))

    def values(a, b) -> bool:
        if jaxprs.is_var(a) != jaxprs.is_var(b):
            return False
        if not jaxprs.is_var(a) and not np.array_equal(np.asarray(a.val), np.asarray(b.val)):
            return False
        ta, tb = a.aval, b.aval
        return (getattr(ta, "dtype", None) == getattr(tb, "dtype", None)
                and shapes(tuple(getattr(ta, "shape", ())), tuple(getattr(tb, "shape", ()))))

    def params(a, b) -> bool:
        if hasattr(a, "jaxpr") and hasattr(a, "consts"):  # a ClosedJaxpr
            return (hasattr(b, "jaxpr") and programs(a.jaxpr, b.jaxpr)
                    and len(a.consts) == len(b.consts)
                    and all(np.array_equal(x, y) for x, y in zip(a.consts, b.consts,
                                                                   strict=True)))
        if isinstance(a, jaxprs.Jaxpr):
            return isinstance(b, jaxprs.Jaxpr) and programs(a, b)
        if isinstance(a, tuple | list):
            if all(isinstance(x, int) for x in a) and all(isinstance(y, int) for y in b):
                return type(a) is type(b) and shapes(tuple(a), tuple(b))
            return (type(a) is type(b) and len(a) == len(b)
                    and all(params(x, y) for x, y in zip(a, b, strict=True)))
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and np.array_equal(a, b)
        if callable(a) and callable(b):  # a rule (a custom JVP's): its jaxpr is compared
            return True
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 a parameter that does not compare: not the same
            return False

    def programs(a, b) -> bool:
        eqns_a, eqns_b = list(jaxprs.walk(a)), list(jaxprs.walk(b))
        if (len(eqns_a), len(a.invars), len(a.outvars)) != (
                len(eqns_b), len(b.invars), len(b.outvars)):
            return False
        if not all(values(x, y) for x, y in zip(a.invars + a.outvars, b.invars + b.outvars,
                                                 strict=True)):
            return False
        for ea, eb in zip(eqns_a, eqns_b, strict=True):
            if (ea.primitive is not eb.primitive or ea.params.keys() != eb.params.keys()
                    or len(ea.invars) != len(eb.invars) or len(ea.outvars) != len(eb.outvars)):
                return False
            if not all(values(x, y) for x, y in zip(ea.invars + ea.outvars,
                                                     eb.invars + eb.outvars, strict=True)):
                return False
            if not all(params(ea.params[k], eb.params[k]) for k in ea.params):
                return False
        return True

    return programs(big, small)


def same_closed_up_to_batch(big, small, n: int) -> bool:
    """``same_up_to_batch`` of two closed jaxprs, their constants equal by value too.

    A constant computed in Python from the batch's size (``np.full(k, 8 / x.shape[0])``)
    becomes a constant of the jaxpr, which ``same_up_to_batch`` sees only by its shape.
    """
    if not same_up_to_batch(big.jaxpr, small.jaxpr, n) or len(big.consts) != len(small.consts):
        return False
    def value(x):  # a typed PRNG key by its bits (read now, not staged into a trace)
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            with jax.ensure_compile_time_eval():
                return np.asarray(jax.random.key_data(x))
        return np.asarray(x)

    try:
        return all(np.shape(x) == np.shape(y) and np.array_equal(value(x), value(y))
                   for x, y in zip(big.consts, small.consts, strict=True))
    except Exception:  # noqa: BLE001 a constant that does not compare (a tracer): not the same
        return False
