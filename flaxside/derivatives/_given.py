"""A first-order call's VJP from what its forward saved, as functions one can differentiate.

NOTE [Given VJP]. The first order's forward returns, besides the results, what its
backward reads: some results (``saved_outputs``) and the residual buffers, together
``z``. Both are functions of the leaves, ``z = Z(leaves)``, computed already. A derivative
of the backward (``create_graph``) used to call the VJP as a whole (``vjp_function``),
which reruns the forward. Here it is two functions of ``z`` instead:

* ``apply(leaves, z, cotangents) -> gradients``: the first order's own backward body, its
  VJP rebuilt from ``z`` (no forward at all);
* ``transpose(leaves, z, cotangents of z) -> gradients``: the VJP of ``Z`` itself, traced
  once as ``jax.vjp`` of ``Z`` with the operations that produce ``z`` taken out (``z`` is
  given) and what is then dead removed: for a plain MLP the forward's matmuls go, and what
  is left is elementwise work on ``z`` and the transposed products.

``apply(leaves, Z(leaves), c)`` is the VJP, so torch differentiates it through ``z`` into
``transpose``. ``given_vjp`` returns ``None`` where an operation producing part of ``z``
produces something else the VJP reads (a ``scan`` whose residuals ``z`` holds only the
carries of: ``remat`` reruns each layer anyway), and for what it does not handle (typed
keys, offloaded residuals, a mesh, complex leaves or residuals). What ``transpose`` still
computes of the forward depends on the functions: ``tanh``'s derivative is a function of
its output, which ``z`` holds, so nothing of the forward is left; ``sin``'s is a function
of its input, whose matmul ``transpose`` then computes again (speed, not results).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxside import jaxprs
from flaxside.program._one_device import OnDevice
from flaxside.program._pack import unpack
from flaxside.program._program import Program
from flaxside.program._traced_bodies import replaced, vjp_sources

jtu = jax.tree_util


def given_vjp(program: Program, wanted: tuple[int, ...] | None = None):
    """``(apply, transpose)`` (NOTE [Given VJP]), or ``None`` where it does not apply.

    ``wanted``: positions in ``diff_index`` whose gradients both return, in that order
    (``None``: all), as ``vjp_function`` takes them.
    """
    rmap = program.residual_map()
    if (type(program.placement) is not OnDevice or any(i is not None for i in rmap.key_impls)
            or any(rmap.offloaded)
            or not all(jnp.issubdtype(d, jnp.floating) for d in _z_dtypes(program, rmap))
            or any(jnp.issubdtype(program.specs[i].dtype, jnp.complexfloating)
                   for i in program.diff_index)):
        return None
    wanted = tuple(range(len(program.diff_index))) if wanted is None else tuple(wanted)
    n_saved = len(rmap.saved_outputs)

    def z_of(leaves) -> list:
        """``Z``: the saved results, then the residuals unpacked, as the forward made them."""
        results, vjp = program.traced_vjp(list(leaves))
        sources, residuals, _ = vjp_sources(list(leaves), results, jtu.tree_leaves(vjp))
        if sources != rmap.sources:  # another trace would disagree with the compiled one
            raise AssertionError(f"{program.name}: the VJP's leaves differ between two "
                                 f"traces: {sources} and {rmap.sources}")
        return [results[k] for k in rmap.saved_outputs] + residuals

    def unpacked(z) -> list:
        return list(z[:n_saved]) + unpack(list(z[n_saved:]), rmap.pack)

    def apply(leaves, z, cotangents):
        z = unpacked(z)
        pools = {"in": [leaves[j] for j in rmap.saved_inputs], "out": z[:n_saved],
                 "res": z[n_saved:]}
        vjp = jtu.tree_unflatten(rmap.vjp_treedef, [pools[k][i] for k, i in rmap.sources])
        grads = program.pull(vjp, list(cotangents))
        return [grads[p] for p in wanted]

    index = tuple(program.diff_index[p] for p in wanted)
    avals = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in program.specs]

    def traced(leaves, z_cotangents):
        def z_only(*diff):
            return z_of(replaced(leaves, index, diff))

        z, pull = jax.vjp(z_only, *[leaves[i] for i in index])
        return [*z, *pull(list(z_cotangents))]

    z_shapes = jax.eval_shape(z_of, avals)
    closed = jax.make_jaxpr(traced)(avals, z_shapes)
    jaxpr, n_z = closed.jaxpr, len(z_shapes)
    given_vars = jaxpr.outvars[:n_z]
    if not all(map(jaxprs.is_var, given_vars)) or len(set(given_vars)) != n_z:
        return None  # a constant, or one value twice: nothing the forward made alone
    given = set(given_vars)
    for eqn in jaxprs.walk(jaxpr):  # the forward goes only where z's producers make nothing else
        made = [v for v in eqn.outvars if not jaxprs.dropped(v)]
        if any(v in given for v in made) and not all(v in given for v in made):
            return None
    live = jaxprs.live(jaxpr, jaxpr.outvars[n_z:], given)

    def transpose(leaves, z, z_cotangents):
        return jaxprs.evaluate(jaxpr, closed.consts, [*leaves, *unpacked(z_cotangents)],
                               eqns=live, given=dict(zip(given_vars, unpacked(z), strict=True)),
                               outvars=jaxpr.outvars[n_z:])

    return apply, transpose


def _z_dtypes(program: Program, rmap) -> list:
    return ([program.out_specs[k].dtype for k in rmap.saved_outputs]
            + [s.dtype for s in rmap.residual_specs])
