"""Each sample's sum of squares of a function's outputs, summed where they are computed.

NOTE [Summed squares]. Fast gradient clipping needs each sample's gradient norm only
(``per_sample_norms_function`` in ``_functions.py``). Computed as written, the batched VJP
stacks every sample's gradient of every layer (a scan's outputs are stacked) and the norm
reduces the stack afterwards: the per-sample gradients exist in full, as XLA temporaries,
as large as the per-sample gradients torch would hold. ``summed_squares`` traces the
function once to a jaxpr and evaluates it again by the one interpreter (NOTE [One
interpreter] in ``jaxprs/_interpret.py``; this meaning's rules are ``_RULES``), moving each
output's sum of squares (over every axis but the batch's) to where its value is made:

* into a ``scan`` that stacks it: the body returns its slice's sums (the batch one axis
  lower there, behind the stacked axis; a batch on the stacked axis itself stays), and the
  stacked sums are added up after the loop;
* into a checkpoint (``remat2``, with its own policy) or a nested ``jit`` that returns it;
* through a ``transpose`` (the sum of squares ignores the order of the other axes);
* into a ``dot_general`` that makes it from two operands batched by the sample (a layer's
  per-sample weight gradient, activations against backprops), where the sum is taken
  without forming the product (NOTE [Ghost norms]) wherever that costs fewer operations;
* down to the equation that computes it, where XLA fuses the square and the sum into the
  product that makes it: a layer's per-sample gradient is never stored, stacked or not.

A value also read elsewhere is computed as it was and reduced where it is; so is one a
loop writes into a buffer it carries, as ``remat_stack``'s own VJP writes each layer's
gradients (its per-sample norms still store them, as XLA temporaries). Every other
equation is bound as traced: the function computes what it computed, its checkpoints'
policies included; only where its outputs are reduced moves. The sums run in float32 at
least (``torch.linalg.vector_norm`` of a bfloat16 tensor does), layer by layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flaxside import jaxprs


def summed_squares(f: Callable, args: list, axes: tuple[int, ...], *,
                   ghost: bool = True) -> tuple[list, list]:
    """Per output ``k`` of ``f(*args)``, its sum of squares over every axis but ``axes[k]``.

    Equal to ``sum(|f(*args)[k]| ** 2)`` over those axes, without storing an output that
    a scan stacks (NOTE [Summed squares]). ``ghost``: a product of two batched operands is
    summed without forming it where that pays (NOTE [Ghost norms]; ``False``: formed, for
    comparison). Returns the sums (float32 or float64 vectors) and the outputs' avals.
    """
    closed = jax.make_jaxpr(f)(*args)
    sums = _evaluate(closed.jaxpr, closed.consts, list(jax.tree_util.tree_leaves(args)),
                     dict(enumerate(axes)), ghost)
    return sums, closed.out_avals


def squares(x, axis: int):
    """The sum of ``|x| ** 2`` over every axis but ``axis``, in float32 at least."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    sq = wide.real * wide.real + wide.imag * wide.imag if jnp.iscomplexobj(wide) else wide * wide
    return jnp.sum(sq, axis=tuple(a for a in range(x.ndim) if a != axis))


class _Reducing(NamedTuple):
    """What the rules read: which values are carried reduced, and where each is reduced.

    ``reduced``: ``{var: batch axis}``; ``moves``: per equation (by ``id``) that makes one
    as its own output, ``{output position: batch axis}``; ``ghost``: whether products are
    summed without being formed (NOTE [Ghost norms]), inside loops and calls too.
    """

    reduced: dict
    moves: dict
    ghost: bool


def _evaluate(jaxpr, consts, args, want: dict, ghost: bool) -> list:
    """``jaxpr``'s outputs, the ones in ``want`` (``{position: batch axis}``) as summed squares."""
    uses = jaxprs.uses(jaxpr)
    # Backward: which values are carried reduced, and how each equation making one
    # reduces it.
    reduced = {v: want[k] for k, v in enumerate(jaxpr.outvars)
               if k in want and jaxprs.is_var(v) and uses[v] == 1}
    moves = {}
    for eqn in reversed(list(jaxprs.walk(jaxpr))):
        at = {k: reduced[v] for k, v in enumerate(eqn.outvars) if v in reduced}
        if not at:
            continue
        name, p = eqn.primitive.name, eqn.params
        if name == "transpose":
            src = eqn.invars[0]
            if jaxprs.is_var(src) and uses[src] == 1:
                reduced[src] = p["permutation"][at[0]]
                moves[id(eqn)] = at
        elif name == "scan":
            moves[id(eqn)] = {k: a for k, a in at.items() if k >= p["num_carry"] and a >= 1}
        elif jaxprs.runs_again(eqn):
            moves[id(eqn)] = at
        elif name == "dot_general" and ghost and _ghost_pays(eqn, at[0]):
            moves[id(eqn)] = at
    values = [squares(x, reduced[v]) if v in reduced else x
              for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True)]
    n = len(jaxpr.constvars)
    outs = jaxprs.evaluate(jaxpr, values[:n], values[n:], _RULES,
                           _Reducing(reduced, moves, ghost))
    # An output carried reduced is read as it is; any other wanted one is reduced here.
    return [squares(x, want[k]) if k in want and not (jaxprs.is_var(v) and v in reduced)
            else x for k, (v, x) in enumerate(zip(jaxpr.outvars, outs, strict=True))]


def _rest(state: _Reducing, eqn, outs, at: dict) -> list:
    """``outs``, each output carried reduced that ``at`` did not reduce reduced here."""
    return [squares(x, state.reduced[v]) if v in state.reduced and k not in at else x
            for k, (v, x) in enumerate(zip(eqn.outvars, outs, strict=True))]


def _bound(state: _Reducing, eqn, invals) -> list:
    """Any equation: bound as traced, its outputs carried reduced reduced where made."""
    return _rest(state, eqn, jaxprs.bind(eqn, invals), {})


def _transpose(state: _Reducing, eqn, invals) -> list:
    """Moved: its operand is carried reduced already, and the sum ignores the axes' order."""
    return invals if id(eqn) in state.moves else _bound(state, eqn, invals)


def _again(state: _Reducing, eqn, invals) -> list:
    """A scan, a checkpoint (with its own policy) or a call, its outputs at ``at`` summed squares.

    A scan's body returns its slice's sums (one axis fewer), summed over the stack after.
    """
    at = state.moves.get(id(eqn))
    if not at:
        return _bound(state, eqn, invals)
    body, consts = jaxprs.body_of(eqn)
    scan = eqn.primitive.name == "scan"
    inner = {k: a - scan for k, a in at.items()}
    outs = jaxprs.again(eqn, invals,
                        lambda args: _evaluate(body, consts, args, inner, state.ghost))
    if scan:
        outs = [jnp.sum(y, axis=0) if k in at else y for k, y in enumerate(outs)]
    return _rest(state, eqn, outs, at)


# NOTE [Ghost norms]. A layer's per-sample weight gradient is a product of two operands that
# both carry the sample: ``out[b, l, r] = sum_c lhs[b, l, c] rhs[b, r, c]`` (activations
# against backprops, ``c`` the rows of one sample: one for a vector input, the positions
# of a sequence). Its sum of squares is ``sum_{c, c'} A[b, c, c'] G[b, c, c']`` with the
# Gram matrices ``A = sum_l lhs[b, l, c] lhs[b, l, c']`` and ``G`` the same of ``rhs``, and
# ``|lhs[b]|^2 |rhs[b]|^2`` for one row (Opacus's ghost clipping, after Goodfellow's
# per-example trick; Li et al. 2022 for sequences). It costs ``C^2 (L + R)`` operations
# a sample where the product costs ``L R C``: taken where that is fewer (a vector input's
# layer always), in the wider of the operands' dtype and float32, for real operands whose
# batch dimensions hold the sample. Other batch dimensions (a stack of layers) are summed
# over too.


def _ghost_pays(eqn, axis: int) -> bool:
    """Whether ``eqn`` (a ``dot_general``) is summed at ``axis`` cheaper by its Grams."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval for v in eqn.invars)
    if axis >= len(lb) or not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs)):
        return False
    c = math.prod(lhs.shape[d] for d in lc)
    left = math.prod(lhs.shape[d] for d in range(lhs.ndim) if d not in (*lc, *lb))
    right = math.prod(rhs.shape[d] for d in range(rhs.ndim) if d not in (*rc, *rb))
    return c * (left + right) < left * right


def _gram(x, contract, batch, dtype):
    """``x`` as ``(batch..., C, C)``: its rows against each other, summed over its free axes."""
    free = [d for d in range(x.ndim) if d not in (*contract, *batch)]
    x = jnp.transpose(x, (*batch, *free, *contract)).astype(dtype)
    n = len(batch)
    x = x.reshape(*x.shape[:n], math.prod(x.shape[n:n + len(free)]),
                  math.prod(x.shape[n + len(free):]))
    return jnp.einsum("...lc,...ld->...cd", x, x, precision=jax.lax.Precision.HIGHEST)


def _dot_general(state: _Reducing, eqn, invals) -> list:
    """Summed by its operands' Grams where moved (NOTE [Ghost norms]); else bound."""
    at = state.moves.get(id(eqn))
    if not at:
        return _bound(state, eqn, invals)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = invals
    dtype = jnp.promote_types(jnp.promote_types(lhs.dtype, rhs.dtype), jnp.float32)
    both = _gram(lhs, lc, lb, dtype) * _gram(rhs, rc, rb, dtype)
    sums = jnp.sum(both, axis=(-2, -1))
    return [jnp.sum(sums, axis=tuple(d for d in range(sums.ndim) if d != at[0]))]


# The meaning (NOTE [One interpreter]): each wanted output's sum of squares taken where the
# value is made, moved through transposes into the loops, checkpoints and calls that make it,
# and into the products of two batched operands (NOTE [Ghost norms]).
_RULES = {"transpose": _transpose, "scan": _again, "remat2": _again, "pjit": _again,
          "jit": _again, "closed_call": _again, "dot_general": _dot_general,
          jaxprs.ANY: _bound}
