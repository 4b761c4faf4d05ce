"""Labelling the leaves of a traced VJP by identity: known values versus true residuals.

``jax.vjp`` returns a pytree whose leaves include values the caller has anyway (the primal
inputs, often the outputs). Returned from a jitted program each would become a fresh
buffer, a copy per call. While tracing, we compare every VJP leaf by identity with the
traced values the caller can pass again, and only the others (true residuals) leave the
program. ``Program`` labels against inputs and outputs, the stack core against a layer's
parameter slice, constants and index; both go through ``label_leaves``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def label_leaves(leaves: Sequence, known: dict[int, Hashable]) -> tuple[tuple, list]:
    """Labels each leaf with ``known[id(leaf)]``, or ``("res", i)`` for a true residual.

    Identity is what makes this exact: a traced value that is an input *is* that input's
    tracer. Every object whose id is in ``known`` must stay alive during the call (the
    caller holds them), so no id can be reused. A residual that appears twice is stacked
    once and labelled the same both times.

    Args:
        leaves: the VJP's leaves (tracers), in ``tree_flatten`` order.
        known: ``{id(value): label}`` for values the caller can supply again.

    Returns:
        ``(labels, residuals)``: one label per leaf, and the distinct residuals in order.

    Example:
        >>> a, b, r = object(), object(), object()
        >>> label_leaves([a, r, b, r], {id(a): ("in", 0), id(b): ("out", 0)})[0]
        (('in', 0), ('res', 0), ('out', 0), ('res', 0))
    """
    labels = dict(known)
    out, residuals = [], []
    for leaf in leaves:
        label = labels.get(id(leaf))
        if label is None:
            label = labels[id(leaf)] = ("res", len(residuals))
            residuals.append(leaf)
        out.append(label)
    return tuple(out), residuals
