"""Each sample's sum of squares of a function's outputs, summed where they are computed.

NOTE [Summed squares]. Fast gradient clipping needs each sample's gradient norm only
(``per_sample_norms_function`` in ``_higher.py``). Computed as written, the batched VJP
stacks every sample's gradient of every layer (a scan's outputs are stacked) and the norm
reduces the stack afterwards: the per-sample gradients exist in full, as XLA temporaries,
as large as the per-sample gradients torch would hold. ``summed_squares`` traces the
function once to a jaxpr and evaluates it again, equation by equation, moving each
output's sum of squares (over every axis but the batch's) to where its value is made:

* into a ``scan`` that stacks it: the body returns its slice's sums (the batch one axis
  lower there, behind the stacked axis; a batch on the stacked axis itself stays), and the
  stacked sums are added up after the loop;
* into a checkpoint (``remat2``, with its own policy) or a nested ``jit`` that returns it;
* through a ``transpose`` (the sum of squares ignores the order of the other axes);
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

from collections import Counter
from collections.abc import Callable

import jax
import jax.numpy as jnp

try:  # jax >= 0.4.36
    from jax.extend.core import Literal, Var
except ImportError:  # pragma: no cover - older jax
    from jax.core import Literal, Var

from flaxside._packed_scans import _bind

# Calls of a closed jaxpr, and the parameter that holds it.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr"}


def summed_squares(f: Callable, args: list, axes: tuple[int, ...]) -> tuple[list, list]:
    """Per output ``k`` of ``f(*args)``, its sum of squares over every axis but ``axes[k]``.

    Equal to ``sum(|f(*args)[k]| ** 2)`` over those axes, without storing an output that
    a scan stacks (NOTE [Summed squares]). Returns the sums (float32 or float64 vectors)
    and the outputs' avals.
    """
    closed = jax.make_jaxpr(f)(*args)
    sums = _evaluate(closed.jaxpr, closed.consts, list(jax.tree_util.tree_leaves(args)),
                     dict(enumerate(axes)))
    return sums, closed.out_avals


def squares(x, axis: int):
    """The sum of ``|x| ** 2`` over every axis but ``axis``, in float32 at least."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    sq = wide.real * wide.real + wide.imag * wide.imag if jnp.iscomplexobj(wide) else wide * wide
    return jnp.sum(sq, axis=tuple(a for a in range(x.ndim) if a != axis))


def _evaluate(jaxpr, consts, args, want: dict) -> list:
    """``jaxpr``'s outputs, the ones in ``want`` (``{position: batch axis}``) as summed squares."""
    uses = Counter(v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var))
    uses.update(v for v in jaxpr.outvars if isinstance(v, Var))
    # Backward: which values are carried reduced ({var: batch axis}), and how each
    # equation making one reduces it (``moves``: {equation index: {output: axis}}).
    reduced = {v: want[k] for k, v in enumerate(jaxpr.outvars)
               if k in want and isinstance(v, Var) and uses[v] == 1}
    moves = {}
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        at = {k: reduced[v] for k, v in enumerate(eqn.outvars) if v in reduced}
        if not at:
            continue
        name, p = eqn.primitive.name, eqn.params
        if name == "transpose":
            src = eqn.invars[0]
            if isinstance(src, Var) and uses[src] == 1:
                reduced[src] = p["permutation"][at[0]]
                moves[i] = at
        elif name == "scan":
            moves[i] = {k: a for k, a in at.items() if k >= p["num_carry"] and a >= 1}
        elif (name == "remat2" and not p["jaxpr"].constvars) or name in _CALLS:
            moves[i] = at
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for v in (*jaxpr.constvars, *jaxpr.invars):
        if v in reduced:
            env[v] = squares(env[v], reduced[v])

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        at = moves.get(i, {})
        name = eqn.primitive.name
        if not at:
            outs = _bind(eqn, invals)
        elif name == "transpose":
            outs = invals  # its operand is carried reduced already
        elif name == "scan":
            outs = _scan(eqn, invals, at)
        elif name == "remat2":
            outs = _remat(eqn, invals, at)
        else:
            closed = eqn.params[_CALLS[name]]
            outs = _evaluate(closed.jaxpr, closed.consts, invals, at)
        for k, v in enumerate(eqn.outvars):
            env[v] = outs[k]
            if v in reduced and k not in at:
                env[v] = squares(outs[k], reduced[v])
    # An output carried reduced is read as it is; any other wanted one is reduced here.
    return [squares(read(v), want[k]) if k in want and (isinstance(v, Literal)
                                                       or v not in reduced) else read(v)
            for k, v in enumerate(jaxpr.outvars)]


def _scan(eqn, invals, at: dict) -> list:
    """A scan whose stacked outputs at ``at`` come back as summed squares, summed over it."""
    p = eqn.params
    closed, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts = invals[:n_consts]
    inner = {k: a - 1 for k, a in at.items()}  # the body's slice: one axis fewer

    def step(carry, xs):
        out = _evaluate(closed.jaxpr, closed.consts, [*consts, *carry, *xs], inner)
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(step, invals[n_consts : n_consts + n_carry],
                             invals[n_consts + n_carry :], length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *(jnp.sum(y, axis=0) if k + n_carry in at else y
                      for k, y in enumerate(ys))]


def _remat(eqn, invals, at: dict) -> list:
    """A checkpoint returning summed squares at ``at``, with its own policy."""
    p = eqn.params

    def run(*args):
        return _evaluate(p["jaxpr"], (), list(args), at)

    return jax.checkpoint(run, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals)
