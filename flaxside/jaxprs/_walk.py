"""Reading a jaxpr: its equations in order, the jaxprs inside them, and who makes or reads what.

Every analysis in flaxside reads equations through ``walk`` (NOTE [One interpreter] in
``_interpret.py``): what counts as a sub-jaxpr, and the forms JAX's releases give them, are
decided here once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal


def is_var(v) -> bool:
    """Whether an equation's operand is a variable (not a ``Literal``)."""
    return not isinstance(v, Literal)


def dropped(v) -> bool:
    """Whether an equation's output is dropped (``_``): nothing reads it.

    ``DropVar`` is public (``jax.extend.core``) from jax 0.9 only; its name is in every
    release the project admits.
    """
    return type(v).__name__ == "DropVar"


def sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (a scan's body, a call's, a cond's branches), open.

    A ``ClosedJaxpr`` is given by its ``jaxpr``; its constants are read with ``body_of``.
    """
    out = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if isinstance(sub, ClosedJaxpr):
                out.append(sub.jaxpr)
            elif isinstance(sub, Jaxpr):
                out.append(sub)
    return out


def walk(jaxpr, deep: bool = False) -> Iterator:
    """``jaxpr``'s equations in order; ``deep``: each followed by those of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        if deep:
            for sub in sub_jaxprs(eqn):
                yield from walk(sub, deep=True)


def primitives(jaxpr) -> set:
    """The names of the primitives ``jaxpr`` binds, at any depth."""
    return {eqn.primitive.name for eqn in walk(jaxpr, deep=True)}


def producers(jaxpr) -> dict:
    """``{var: the equation that makes it}`` over ``jaxpr``'s equations."""
    return {v: eqn for eqn in walk(jaxpr) for v in eqn.outvars if not dropped(v)}


def uses(jaxpr) -> Counter:
    """How many times each variable is read: by an equation (once per operand) or as an output."""
    count = Counter(v for eqn in walk(jaxpr) for v in eqn.invars if is_var(v))
    count.update(v for v in jaxpr.outvars if is_var(v))
    return count


def live(jaxpr, outvars, known=frozenset()) -> list:
    """The equations ``outvars`` need, ``known`` variables given: in order, the dead ones out.

    An equation with effects always stays; one whose every needed output is ``known`` goes.
    """
    needed = {v for v in outvars if is_var(v)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed and v not in known for v in eqn.outvars
                              if not dropped(v)):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if is_var(v))
    return kept[::-1]

