"""Functions of one flat list of array leaves, built from a Flax apply and a call's structure."""

from __future__ import annotations

from collections.abc import Callable

import jax

jtu = jax.tree_util


class _ArraySlot:
    """Marks an argument leaf that is an array (dynamic) rather than a static value."""

    def __repr__(self) -> str:
        return "ARRAY"


ARRAY = _ArraySlot()


def flat_apply(
    apply: Callable, var_treedef, arg_treedef, arg_slots: tuple
) -> Callable[[list], object]:
    """``apply(variables, *args, **kwargs)`` as a function of ``var_leaves + array_leaves``.

    Args:
        apply: e.g. a Linen module's ``apply``.
        var_treedef: treedef of the variables dict (its leaves come first).
        arg_treedef: treedef of ``(args, kwargs)``.
        arg_slots: one entry per leaf of ``(args, kwargs)``: ``ARRAY`` for an array that
            comes from the flat list, or the static Python value itself.

    Returns:
        ``fn(leaves)``; static values are baked in at trace time.

    Example:
        >>> import flax.linen as nn, jax.numpy as jnp
        >>> m = nn.Dense(2); v = m.init(jax.random.key(0), jnp.ones((1, 3)))
        >>> vl, vt = jtu.tree_flatten(v)
        >>> _, at = jtu.tree_flatten(((jnp.ones((1, 3)),), {}))
        >>> fn = flat_apply(m.apply, vt, at, (ARRAY,))
        >>> fn(vl + [jnp.ones((1, 3))]).shape
        (1, 2)
    """
    n_vars = var_treedef.num_leaves

    def fn(leaves):
        variables = jtu.tree_unflatten(var_treedef, leaves[:n_vars])
        arrays = iter(leaves[n_vars:])
        full = [next(arrays) if slot is ARRAY else slot for slot in arg_slots]
        args, kwargs = jtu.tree_unflatten(arg_treedef, full)
        return apply(variables, *args, **kwargs)

    return fn
