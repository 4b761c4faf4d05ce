"""Nested rematerialized stacks built from ``jax.lax.scan`` and a hand-written VJP.

Why not autodiff of nested ``scan(checkpoint(scan(...)))`` (what ``nn.remat_scan`` lowers
to)? Its transpose hands each outer iteration a *slice* of the stacked parameters
(``P[i]``, ``l1`` layers) and returns that iteration's gradients as a fresh ``l1``-layer
stack that is then written into the full one. On CPU, XLA materializes all of it: per
step, one copy of every parameter in the forward and in the backward, a zero fill and a
copy of every gradient, which made stock ``nn.remat_scan`` much slower than the one more
forward per level it should cost (``examples/stack_speed.py`` measures both). Here every
level reads layer ``i`` straight from the one flat parameter stack and writes its gradient
straight into one flat gradient stack that the nested loops carry, so no level copies a
segment of parameters or gradients.

Memory is the same as nested remat-scan: the forward keeps ``lengths[0]`` carries; the
backward of one outer segment recomputes its ``lengths[1]`` carries, and so on; the
innermost level keeps, per layer, what ``policy`` saves (the carry alone by default).

Over a mesh (a program placed ``OnMesh`` whose parameter leaves are sharded), every level
reads layer ``i`` gathered as one buffer and reduces its gradient as one buffer: one
collective per layer and direction, where XLA's partitioner would gather and reduce each
parameter on its own (NOTE [One collective per layer] in ``mesh/_on_mesh.py``), cast before
the gather where its leaves are read in another dtype (NOTE [Mixed precision]).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from flaxside.mesh import _per_rank as per_rank
from flaxside.mesh._traced_leaves import program_leaves, reduced_per_rank
from flaxside.program._residual_labels import label_leaves
from flaxside.program._specs import Learned

jtu = jax.tree_util


def _take(stack, i):
    return jtu.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), stack)


def _put(stack, i, value):
    return jtu.tree_map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), stack, value)


def _layer_access(layer_fn, params, n_layout: int, carry, consts) -> tuple:
    """``(params, layer, layer_grads, plan)``: what the stack runs on and how it reads layer i.

    ``plan``: how to run it per rank, or ``None`` (as one program).

    ``layer(flat, i)`` reads layer ``i``, ``layer_grads`` hands back its gradient. Off a
    mesh: ``params``, the slice and the identity. Inside a program over a mesh,
    each leaf of ``params`` that is one of its leaves as read (``program_leaves``) is
    replaced by the leaf the program received (a float32 shard where the function reads a
    bfloat16 cast): the slice is cast and gathered as one buffer, the gradient reduced
    and cast back to the leaf's dtype (NOTE [One collective per layer], NOTE [Mixed
    precision]), per rank with an all-to-all each where the layer allows it (NOTE
    [Per-rank stacks]); a leaf sharded on a layer axis, or not known, is left to XLA.
    """
    leaves, treedef = jtu.tree_flatten(params)
    placement, found = program_leaves(leaves)
    if placement is None or all(f is None for f in found):
        return params, _take, lambda g: g, None
    sources = [x if f is None else f.source for x, f in zip(leaves, found, strict=True)]
    dtypes = [x.dtype for x in sources]
    plan = per_rank.plan(layer_fn, placement, found, sources, treedef, n_layout, carry,
                         consts)
    if plan is not None:
        reduced_per_rank(leaves)

        def gather(xs):
            return per_rank.gathered(plan, xs)

        def scatter(gs):
            return per_rank.scattered(plan, gs, dtypes)
    else:
        dims = [None if f is None or f.dim is None or f.dim < n_layout else f.dim - n_layout
                for f in found]
        reads = [None if f is None else f.dtype for f in found]

        def gather(xs):
            return placement.gathered(xs, dims, reads)

        def scatter(gs):
            return placement.scattered(gs, dims, dtypes)

    def layer(flat, i):
        return jtu.tree_unflatten(treedef, gather(jtu.tree_leaves(_take(flat, i))))

    def layer_grads(g):
        return jtu.tree_unflatten(treedef, scatter(jtu.tree_leaves(g)))

    return jtu.tree_unflatten(treedef, sources), layer, layer_grads, plan


def stack_apply(layer_fn: Callable, params, carry, consts=(), *, lengths, policy=None,
                layout=None):
    """Applies ``layer_fn`` ``prod(lengths)`` times with nested rematerialization.

    Layer ``i`` (row-major over ``lengths``) computes
    ``carry = layer_fn(params_i, carry, consts, i)`` where ``params_i`` indexes the leading
    axes of every leaf of ``params`` (``layout``, by default ``lengths``). ``consts`` (e.g.
    RNG keys) reach every layer unchanged and get no gradient; ``i`` is a traced int scalar
    (fold it into keys).

    Args:
        layer_fn: ``(params_i, carry, consts, i) -> carry``, a pure function.
        params: pytree whose leaves have leading axes ``layout``.
        carry: pytree of arrays, the input of layer 0.
        consts: pytree passed to every layer, not differentiated.
        lengths: loop lengths per level, outermost first.
        policy: ``jax.checkpoint`` policy for what each layer keeps for its own backward.
        layout: the leading axes of ``params`` if not ``lengths`` (e.g. ``(depth,)``); any
            with product ``prod(lengths)``. Reshaping here, not before the call, keeps the
            parameters recognizable as inputs, so they are never saved as residuals.

    Returns:
        The carry after the last layer. Reverse-mode differentiable (``jax.vjp``,
        ``jax.grad``); forward mode (``jax.jvp``) is not supported (``jax.custom_vjp``).

    Example:
        >>> f = lambda p, c, k, i: jnp.tanh(c @ p)
        >>> w = jnp.ones((2, 3, 4, 4)) / 4
        >>> stack_apply(f, w, jnp.ones((1, 4)), lengths=(2, 3)).shape
        (1, 4)
    """
    lengths = tuple(lengths)
    layout = lengths if layout is None else tuple(layout)
    levels, depth = len(lengths), math.prod(lengths)
    # Layers per child segment at each level; the innermost level's children are layers.
    child = tuple(math.prod(lengths[k + 1 :]) for k in range(levels))
    checkpointed = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)
    params, layer, layer_grads, plan = _layer_access(layer_fn, params, len(layout), carry,
                                                     consts)

    def run(flat, consts, start, count, c):
        def body(t, c):
            return layer_fn(layer(flat, start + t), c, consts, start + t)

        return lax.fori_loop(0, count, body, c)

    def save_layers(flat, consts, start, c):
        # Per layer, what jax.vjp of the checkpointed layer keeps, minus the leaves that are
        # the layer's parameter slice, the consts or the index: those are re-read in the
        # backward instead of being stacked (a stacked copy of parameters is what we avoid).
        # Returns the carry and (residuals stacked per layer, Learned((treedef, sources))):
        # how to rebuild a layer's VJP from them, as the trace of one layer learned it.
        def body(c, t):
            i = start + t
            p = layer(flat, i)
            out, vjp = jax.vjp(lambda p, c: checkpointed(p, c, consts, i), p, c)
            leaves, treedef = jtu.tree_flatten(vjp)
            known = {id(i): ("i", 0)}
            known.update({id(x): ("p", k) for k, x in enumerate(jtu.tree_leaves(p))})
            known.update({id(x): ("k", k) for k, x in enumerate(jtu.tree_leaves(consts))})
            sources, residuals = label_leaves(leaves, known)
            return out, (residuals, Learned((treedef, sources)))

        return lax.scan(body, c, jnp.arange(lengths[-1]))

    def backward_layers(flat, consts, start, saved, ct, grads):
        saved, learned = saved
        treedef, sources = learned.value

        def body(state, xs):
            ct, grads = state
            t, residuals = xs
            i = start + t
            pools = {"i": [i], "p": jtu.tree_leaves(layer(flat, i)), "res": residuals,
                     "k": jtu.tree_leaves(consts)}
            leaves = [pools[kind][k] for kind, k in sources]
            g, ct = jtu.tree_unflatten(treedef, leaves)(ct)
            return (ct, _put(grads, i, layer_grads(g))), None

        xs = (jnp.arange(lengths[-1]), saved)
        return lax.scan(body, (ct, grads), xs, reverse=True)[0]

    def forward_level(k, flat, consts, start, c):
        """Runs level k's segment at ``start``; returns the carry and what it saves."""
        if k == levels - 1:
            return save_layers(flat, consts, start, c)
        m = child[k]
        return lax.scan(lambda c, j: (run(flat, consts, start + j * m, m, c), c), c,
                        jnp.arange(lengths[k]))

    def backward_level(k, flat, consts, start, saved, ct, grads):
        if k == levels - 1:
            return backward_layers(flat, consts, start, saved, ct, grads)
        m = child[k]

        def body(state, xs):
            j, c = xs
            _, inner = forward_level(k + 1, flat, consts, start + j * m, c)
            return backward_level(k + 1, flat, consts, start + j * m, inner, *state), None

        return lax.scan(body, (ct, grads), (jnp.arange(lengths[k]), saved), reverse=True)[0]

    def flatten(params):
        return jtu.tree_map(lambda a: a.reshape((depth,) + a.shape[len(layout):]), params)

    @jax.custom_vjp
    def stack(params, carry, consts):
        return run(flatten(params), consts, 0, depth, carry)

    def stack_fwd(params, carry, consts):
        out, saved = forward_level(0, flatten(params), consts, 0, carry)
        # params and consts are returned as given so that jax recognizes them as inputs
        # and keeps no copy (custom_vjp forwards residuals that are inputs).
        return out, (params, consts, saved)

    def stack_bwd(residuals, ct):
        params, consts, saved = residuals
        flat = flatten(params)
        grads = jtu.tree_map(jnp.zeros_like, flat)
        ct, grads = backward_level(0, flat, consts, 0, saved, ct, grads)
        grads = jtu.tree_map(lambda g, p: g.reshape(p.shape), grads, params)
        return grads, ct, None

    stack.defvjp(stack_fwd, stack_bwd)
    if math.prod(layout) != depth:
        raise ValueError(f"stack_apply: layout {layout} does not multiply to depth {depth}.")
    for leaf in jtu.tree_leaves(params):
        if tuple(leaf.shape[: len(layout)]) != layout:
            raise ValueError(
                f"stack_apply: a parameter has shape {tuple(leaf.shape)}, but its leading axes "
                f"must be {layout}. Stack the layers' parameters with leading axes {layout}."
            )
    if plan is not None:
        return per_rank.apply(stack, plan, params, carry, consts)
    return stack(params, carry, consts)
