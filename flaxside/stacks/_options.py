"""Checking remat_stack's options: checkpoint policies by name, loop lengths."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import jax


def policy_names() -> tuple[str, ...]:
    """Names in ``jax.checkpoint_policies`` that are policies (not factories needing arguments).

    Returns:
        Sorted names, each valid as ``remat_stack(..., policy=name)``.

    Example:
        >>> "dots_saveable" in policy_names(), "save_only_these_names" in policy_names()
        (True, False)
    """
    names = []
    for name in dir(jax.checkpoint_policies):
        obj = getattr(jax.checkpoint_policies, name)
        if name.startswith("_") or not callable(obj):
            continue
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            continue
        # A policy is called as policy(prim, *args, **params); factories take names or sources.
        kinds = {p.kind for p in params}
        required_kw = any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params)
        if inspect.Parameter.VAR_KEYWORD in kinds and not required_kw:
            names.append(name)
    return tuple(sorted(names))


def resolve_policy(policy, *, where: str = "remat_stack") -> Callable | None:
    """A ``jax.checkpoint`` policy from a name in ``jax.checkpoint_policies`` or a callable.

    Raises:
        ValueError: an unknown name, or the name of a factory that needs arguments.
        TypeError: neither a string, a callable nor None.
    """
    if policy is None or callable(policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(
            f"{where}: argument 'policy' is a {type(policy).__name__}, but a name in "
            f"jax.checkpoint_policies, a callable or None was expected."
        )
    valid = policy_names()
    if policy in valid:
        return getattr(jax.checkpoint_policies, policy)
    if hasattr(jax.checkpoint_policies, policy):
        raise ValueError(
            f"{where}: policy {policy!r} is a factory that needs arguments; pass "
            f"policy=jax.checkpoint_policies.{policy}(...) instead, or one of {list(valid)}."
        )
    raise ValueError(
        f"{where}: unknown policy {policy!r}; expected one of {list(valid)} or a callable "
        f"from jax.checkpoint_policies."
    )


def check_lengths(lengths, depth: int, *, where: str = "remat_stack") -> tuple[int, ...]:
    """``lengths`` as a tuple of positive ints whose product is ``depth`` (None: one level).

    Raises:
        ValueError: a length below 1, or a product other than ``depth``.
        TypeError: lengths is not a sequence of ints.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(
            f"{where}: argument 'depth' is {depth!r}, but a positive int was expected."
        )
    if lengths is None:
        return (depth,)
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = (lengths,)
    if not isinstance(lengths, tuple | list) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in lengths
    ):
        raise TypeError(
            f"{where}: argument 'lengths' is {lengths!r}, but a tuple of ints, None or 'auto' "
            f"was expected."
        )
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(
            f"{where}: argument 'lengths' is {tuple(lengths)}, but every length must be at "
            f"least 1 and there must be at least one."
        )
    product = math.prod(lengths)
    if product != depth:
        a = max(k for k in range(1, math.isqrt(depth) + 1) if depth % k == 0)
        raise ValueError(
            f"{where}: lengths {tuple(lengths)} multiply to {product}, but depth is {depth}. "
            f"Pass lengths whose product is {depth}, e.g. ({a}, {depth // a}), or "
            f"lengths='auto'."
        )
    return tuple(lengths)
