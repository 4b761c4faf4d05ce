"""``flaxside.jaxprs``: the one interpreter (NOTE [One interpreter]) and its walks.

Each meaning (packed scans, summed squares, given residuals) has its own suite; these test
what they all stand on, against the function JAX traced: evaluated with no rule, a jaxpr
is the function; a rule changes its primitive and nothing else; ``again`` rebuilds a scan
and a checkpoint with their parameters; given values are never computed again.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxside import jaxprs


def _f(w, xs, x0):
    """A scan over a checkpointed step, a nested jit and a cond: what the meanings meet."""
    @jax.checkpoint
    def step(h, x):
        return jnp.tanh(h @ w + x), jnp.sin(h)

    h, ys = jax.lax.scan(step, x0, xs, reverse=True, unroll=2)
    h = jax.jit(lambda h: h * 2.0 + 1.0)(h)
    return jax.lax.cond(h.sum() > 0, jnp.cos, jnp.exp, h), ys


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (8, 8)) / 3, jax.random.normal(k[1], (5, 4, 8)),
            jax.random.normal(k[2], (4, 8)))


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_evaluated_without_rules_a_jaxpr_is_its_function():
    args = _args()
    closed = jax.make_jaxpr(_f)(*args)
    got = jax.jit(lambda *a: jaxprs.evaluate(closed.jaxpr, closed.consts, list(a)))(*args)
    _close(got, list(_f(*args)))


def test_a_rule_replaces_its_primitive_and_nothing_else():
    """``sin`` made ``cos`` by a rule, at the top level: the result is the function with
    ``cos``; a rule returning ``None`` binds as traced; ``ANY`` takes every other one."""
    args = _args()

    def f(x):
        return jnp.sin(x) * jnp.exp(x)

    closed = jax.make_jaxpr(f)(args[2])
    rules = {"sin": lambda state, eqn, invals: [jnp.cos(invals[0])],
             "exp": lambda state, eqn, invals: None}
    got = jaxprs.evaluate(closed.jaxpr, closed.consts, [args[2]], rules)
    _close(got, [jnp.cos(args[2]) * jnp.exp(args[2])])
    seen = []

    def every(state, eqn, invals):
        state.append(eqn.primitive.name)

    jaxprs.evaluate(closed.jaxpr, closed.consts, [args[2]], {jaxprs.ANY: every}, seen)
    assert seen == [e.primitive.name for e in closed.jaxpr.eqns]


def _first(jaxpr, name):
    return next(e for e in jaxprs.walk(jaxpr, deep=True) if e.primitive.name == name)


def test_again_rebuilds_a_scan_and_a_checkpoint_with_their_parameters():
    """Each body evaluated plainly by ``again``: the same results, and the scan's length,
    direction and unrolling and the checkpoint's policy carried over; a policy given to
    ``again`` replaces the checkpoint's and wraps the scan's body in one."""
    args = _args()
    closed = jax.make_jaxpr(_f)(*args)
    scan = _first(closed.jaxpr, "scan")

    def rebuilt(policy, *a):
        def rule(state, eqn, invals):
            body, consts = jaxprs.body_of(eqn)
            return jaxprs.again(eqn, invals,
                                lambda b: jaxprs.evaluate(body, consts, b, {"remat2": rule}),
                                **({} if policy is None else {"policy": policy}))

        return jaxprs.evaluate(closed.jaxpr, closed.consts, list(a),
                               {"scan": rule, "remat2": rule})

    _close(jax.jit(lambda *a: rebuilt(None, *a))(*args), list(_f(*args)))
    again = _first(jax.make_jaxpr(lambda *a: rebuilt(None, *a))(*args).jaxpr, "scan")
    for key in ("length", "reverse", "unroll", "num_consts", "num_carry"):
        assert again.params[key] == scan.params[key], key
    inner = _first(again.params["jaxpr"].jaxpr, "remat2")
    assert inner.params["policy"] is _first(scan.params["jaxpr"].jaxpr, "remat2").params["policy"]

    def saves_nothing(*_, **__):
        return False

    again = _first(jax.make_jaxpr(lambda *a: rebuilt(saves_nothing, *a))(*args).jaxpr, "scan")
    wrapped = [e for e in jaxprs.walk(again.params["jaxpr"].jaxpr) if e.primitive.name == "remat2"]
    assert [e.params["policy"] for e in wrapped] == [saves_nothing]
    _close(jax.jit(lambda *a: rebuilt(saves_nothing, *a))(*args), list(_f(*args)))


def test_given_values_are_never_computed_again():
    """``live`` drops what only makes given values, and ``evaluate`` reads them as given:
    a rule on the dropped producer would raise if it ran."""
    def f(w, x):
        z = jnp.tanh(x @ w)
        return z, (1 - z * z) * 3.0

    args = _args()
    closed = jax.make_jaxpr(f)(args[0], args[2])
    jaxpr = closed.jaxpr
    z_var = jaxpr.outvars[0]
    live = jaxprs.live(jaxpr, jaxpr.outvars[1:], {z_var})
    assert "tanh" not in {e.primitive.name for e in live}
    assert "dot_general" not in {e.primitive.name for e in live}

    def refuse(state, eqn, invals):
        raise AssertionError(f"{eqn.primitive.name} ran though its output was given")

    z = jnp.full((4, 8), 0.5)
    (got,) = jaxprs.evaluate(jaxpr, closed.consts, [args[0], args[2]],
                             {"tanh": refuse, "dot_general": refuse}, eqns=live,
                             given={z_var: z}, outvars=jaxpr.outvars[1:])
    _close(got, (1 - z * z) * 3.0)


def test_the_walks_read_the_jaxpr():
    closed = jax.make_jaxpr(_f)(*_args())
    names = jaxprs.primitives(closed.jaxpr)
    assert {"scan", "remat2", "tanh", "sin", "dot_general", "cond", "cos", "exp"} <= names
    top = [e.primitive.name for e in jaxprs.walk(closed.jaxpr)]
    assert "tanh" not in top and "scan" in top  # not deep: the body's equations stay inside
    made = jaxprs.producers(closed.jaxpr)
    assert made[closed.jaxpr.outvars[1]].primitive.name == "scan"
    uses = jaxprs.uses(closed.jaxpr)
    assert all(uses[v] >= 1 for v in closed.jaxpr.outvars if jaxprs.is_var(v))


@pytest.mark.parametrize("name", ["scan", "remat2", "pjit"])
def test_runs_again_and_body_of(name):
    closed = jax.make_jaxpr(_f)(*_args())
    eqn = _first(closed.jaxpr, name if name != "pjit" else next(
        n for n in ("pjit", "jit") if n in jaxprs.primitives(closed.jaxpr)))
    assert jaxprs.runs_again(eqn)
    body, consts = jaxprs.body_of(eqn)
    assert len(body.invars) == len(eqn.invars) and len(body.constvars) == len(consts)
