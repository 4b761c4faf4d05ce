"""The one jaxpr interpreter: equations bound in order, a meaning's rules where it has them.

NOTE [One interpreter]. Several of flaxside's programs are a function traced once to a
jaxpr and evaluated again with one thing changed: where a mesh gathers a layer (NOTE
[Packed scans], NOTE [Per-rank scans]), where a per-sample sum of squares is taken (NOTE
[Summed squares]), what a VJP is given instead of computing (NOTE [Given VJP]).
Each is a *meaning*: a table ``{primitive name: rule}``, the way JAX keeps one rule per
primitive per transformation (``ad.primitive_jvps``, ``batching.primitive_batchers``;
those tables are private and change between releases, so the pattern is borrowed, not the
tables). ``evaluate`` is the only code that binds equations:

* an equation whose primitive has a rule is given to it, ``rule(state, eqn, invals)``,
  which returns the outputs or ``None`` (bound as traced); the ``ANY`` entry, where a
  table has one, takes every other primitive;
* every other equation is bound as traced (``bind``), under its own context (its name
  stack, its source), so the function computes what it computed.

A rule that runs a loop, a checkpoint or a call again with its body evaluated its own way
rebuilds it with ``again``: the scan's and the checkpoint's parameters are carried over
there only. What a meaning reads of a jaxpr beforehand (which inputs a body reads, what is
reduced where) it reads with ``walk`` and its helpers (``_walk.py``). Nothing is kept
between evaluations: each returns values of the trace it runs in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from flaxside.jaxprs._walk import ClosedJaxpr, dropped, is_var

ANY = "*"  # a table's rule for every primitive it names no rule for

# Calls of a closed jaxpr, and the parameter that holds it.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr"}


def bind(eqn, invals) -> list:
    """``eqn`` bound on ``invals`` as traced (as ``jax.core.eval_jaxpr`` binds it)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    # jax >= 0.9 returns the parameters (sub-functions among them), older releases
    # ``(sub-functions, parameters)``.
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def evaluate(jaxpr, consts, args, rules: Mapping[str, Callable] | None = None, state=None, *,
             eqns=None, given: Mapping | None = None, outvars=None) -> list:
    """``jaxpr`` on ``args``, each equation through its rule in ``rules`` or bound as traced.

    Args:
        jaxpr: an open jaxpr.
        consts: the values of its constants (``jaxpr.constvars``).
        args: the values of its inputs (``jaxpr.invars``).
        rules: ``{primitive name: rule}`` (``ANY``: every other); ``rule(state, eqn,
            invals)`` returns the equation's outputs, or ``None`` to bind it as traced.
        state: what the rules read (the meaning's marks, what it gathers with).
        eqns: the equations to run (``live``'s), in order; all of ``jaxpr``'s by default.
        given: ``{var: value}`` known already, never computed again (NOTE [Given VJP] in
            ``flaxside/derivatives/_given.py``).
        outvars: the variables to return; ``jaxpr``'s outputs by default.

    Returns:
        The values of ``outvars``.
    """
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    if given:
        env.update(given)
    rules = rules or {}
    otherwise = rules.get(ANY)

    def read(v):
        return env[v] if is_var(v) else v.val

    for eqn in jaxpr.eqns if eqns is None else eqns:
        invals = [read(v) for v in eqn.invars]
        rule = rules.get(eqn.primitive.name, otherwise)
        outs = None if rule is None else rule(state, eqn, invals)
        if outs is None:
            outs = bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not dropped(v) and v not in env:  # a given value stays
                env[v] = x
    return [read(v) for v in (jaxpr.outvars if outvars is None else outvars)]


def body_of(eqn) -> tuple:
    """``(jaxpr, consts)``: the body a scan, a checkpoint (``remat2``) or a call runs."""
    name = eqn.primitive.name
    body = eqn.params[_CALLS.get(name, "jaxpr")]
    return (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())


def runs_again(eqn) -> bool:
    """Whether ``again`` rebuilds ``eqn``: a scan, a call, or a checkpoint closing over nothing."""
    name = eqn.primitive.name
    return (name == "scan" or name in _CALLS
            or (name == "remat2" and not eqn.params["jaxpr"].constvars))


_SAME = object()


def again(eqn, invals, body: Callable, policy=_SAME) -> list:
    """``eqn`` (``runs_again``) run on ``invals``, its body ``body(args) -> outputs``.

    ``policy``: for a checkpoint, what it saves in place of its own policy; for a scan, a
    ``jax.checkpoint`` policy its body is run under (the same body, a backward that saves
    only what the policy allows). A call's body runs inline.
    """
    name, p = eqn.primitive.name, eqn.params
    if name == "remat2":
        return jax.checkpoint(lambda *args: body(list(args)), prevent_cse=p["prevent_cse"],
                              policy=p["policy"] if policy is _SAME else policy)(*invals)
    if name in _CALLS:
        return body(list(invals))
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts = invals[:n_consts]
    run = body if policy is _SAME else jax.checkpoint(body, prevent_cse=False, policy=policy)

    def step(carry, xs):
        out = run([*consts, *carry, *xs])
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(step, invals[n_consts : n_consts + n_carry],
                             invals[n_consts + n_carry :], length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]
