"""Stock scans over a mesh gather each layer as one buffer (NOTE [Packed scans]).

NOTE [Packed scans]. A stock ``nn.scan``, ``nn.remat_scan`` or ``nnx.scan`` block reads
each layer's parameters as the scan's slices of the stacked leaves, and over a mesh XLA's
partitioner gathers each slice separately where it is used: one collective, a round trip,
per parameter per iteration and per use, forward and backward. ``remat_stack`` owns its
loops and packs a layer instead (NOTE [One collective per layer] in ``_placement.py``); a
stock block's loops are Flax's, so ``packed_scans`` reaches them through the jaxpr: the
function is traced once and that jaxpr evaluated again, equation by equation, following
each leaf split over the batch axes (``ProgramLeaf.dim``) into the loops that slice it:

* into a ``scan`` that takes it as a scanned input, its dimension one lower in the body (a
  leaf split on the scanned axis itself is left to the partitioner: each of its slices
  lives on one rank);
* into a ``checkpoint`` (``remat2``: ``nn.remat``, ``remat_scan``'s levels) that takes it
  as an argument;
* down to the body that reads it. There, before anything else, every leaf the body reads
  is gathered in one collective per dtype (``gather``: ``OnMesh.gathered``'s pack, rank
  by rank, constrained replicated), and the body reads the gathered arrays.

What the backward keeps is the block's promise, one layer gathered at a time. A gather
inside a checkpoint is recomputed as the checkpoint recomputes (its policy, which may save
anything else, never saves what ``_refused`` names). A gather directly in a scan body is
put, with the rest of that body, in a ``jax.checkpoint`` whose policy refuses every
primitive the gather is made of and every primitive the body computes from the layer
alone (``_refused``: packing, unpacking, a cast to the compute dtype, a weight norm) and
saves every other value: the scan's backward gathers each layer again instead of stacking
every layer's gathered parameters, as FSDP2 reshards after the forward. Refusing the
gathered arrays alone (a name) would not do: a refused value is recomputed from the values
it came from, and the step before it would be saved. (JAX's remat3, the default to come,
recognises name and dot policies only and recomputes everything under other callables:
the same results, that body recomputed.) The gradients take the gather's transpose: the
partitioner's reductions, as on ``remat_stack``'s partitioner route.

Where the whole function computes the same on each rank's rows, it runs per rank instead,
the gathers all-to-alls whose transpose reduce-scatters (``per_rank``: NOTE [Per-rank
scans] in ``_per_rank_scans.py``).

A leaf read anywhere else (outside every loop, as a scan's constant, by a ``custom_vjp``
such as ``remat_stack``'s own loops, which gather for themselves, by a nested ``jit``) is
left as it was, to the partitioner. Every other equation is bound as traced, so the
function computes what it computed; only where its stacked parameters are gathered moves.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

try:  # jax >= 0.4.36
    from jax.extend.core import Literal, Var
except ImportError:  # pragma: no cover - older jax
    from jax.core import Literal, Var

from flaxside._mesh_leaves import traced_again

jtu = jax.tree_util

GATHERED = "flaxside_gathered"  # the name a gathered layer's arrays carry (checkpoint_name)


def packed_scans(fn: Callable, read: list, dims: list, gather: Callable,
                 per_rank: Callable | None = None):
    """``fn(read)``, the scans that slice a split leaf gathering a layer as one buffer.

    Args:
        fn: the program's function, ``fn(leaves) -> (outputs, aux, write_back)``.
        read: the leaves it is called on (tracers of the program's trace).
        dims: per leaf, the dimension it is split on over the batch axes, or ``None``.
        gather: ``gather(arrays, dims) -> arrays``, one layer's slices replicated.
        per_rank: ``per_rank(arrays, closed, read, dims)``: the results run per rank
            (NOTE [Per-rank scans] in ``_per_rank_scans.py``), or ``None`` where they
            cannot be; tried first where every split leaf is read in loops only.

    Returns:
        What ``fn`` returns, computed from the same equations (NOTE [Packed scans]).
    """
    if all(d is None for d in dims):
        return fn(read)
    box = {}

    def arrays(leaves):
        with traced_again(read, leaves):  # a remat_stack inside finds its leaves
            out, aux, write_back = fn(leaves)
        flat, treedef = jtu.tree_flatten(out)
        array = [isinstance(x, jax.Array) for x in flat]
        box.update(treedef=treedef, write_back=write_back, array=array, n_aux=len(aux),
                   others=[x for x, a in zip(flat, array, strict=True) if not a])
        return [x for x, a in zip(flat, array, strict=True) if a], list(aux)

    closed = jax.make_jaxpr(arrays)(list(read))
    jaxpr = closed.jaxpr
    marks = {v: d for v, d in zip(jaxpr.invars, dims, strict=True) if d is not None}
    results = None
    # Per rank only where nothing closes over the program's trace (a remat_stack's own
    # loops do: they read the leaves themselves, NOTE [One collective per layer]).
    if (per_rank is not None and reached_in_loops(jaxpr, marks, in_loop=False)
            and not any(isinstance(c, jax.core.Tracer) for c in closed.consts)):
        first = dict(box)
        results = per_rank(arrays, closed, list(read), dims)
        # The Python values the whole batch's trace returned, not one rank's rows' (a
        # batch size read into one would be the rank's).
        box.update(first)
    if results is None:
        results = evaluate(jaxpr, closed.consts, list(read), marks, gather, in_loop=False)
    n_aux = box["n_aux"]
    outs, aux = iter(results[: len(results) - n_aux]), results[len(results) - n_aux :]
    others = iter(box["others"])
    flat = [next(outs) if a else next(others) for a in box["array"]]
    return jtu.tree_unflatten(box["treedef"], flat), aux, box["write_back"]


def _direct(jaxpr, marks: dict) -> list:
    """The marked inputs of ``jaxpr`` read other than by handing them down to a loop."""
    used = set()
    for eqn in jaxpr.eqns:
        down = handed_down(eqn)
        used.update(v for k, v in enumerate(eqn.invars)
                    if isinstance(v, Var) and v in marks and k not in down)
    used.update(v for v in jaxpr.outvars if isinstance(v, Var) and v in marks)
    return [v for v in jaxpr.invars if v in used]


def reached_in_loops(jaxpr, marks: dict, in_loop: bool) -> bool:
    """Whether each marked input is read inside loops only, on a dimension a gather splits.

    Handed down by scans (never sliced on its split dimension: a slice on one rank) and
    checkpoints; outside every loop, read by nothing else.
    """
    for eqn in jaxpr.eqns:
        down = handed_down(eqn)
        for k, v in enumerate(eqn.invars):
            if not (isinstance(v, Var) and v in marks):
                continue
            if k not in down:
                if not in_loop:
                    return False
                continue
            if eqn.primitive.name == "scan":
                body = eqn.params["jaxpr"].jaxpr
                if not marks[v] or not reached_in_loops(
                        body, {body.invars[k]: marks[v] - 1}, in_loop=True):
                    return False
            else:
                body = eqn.params["jaxpr"]
                if not reached_in_loops(body, {body.invars[k]: marks[v]}, in_loop):
                    return False
    return in_loop or not any(isinstance(v, Var) and v in marks for v in jaxpr.outvars)


def handed_down(eqn) -> range:
    """Positions of ``eqn``'s inputs that reach its body sliced (a scan) or as they are."""
    name = eqn.primitive.name
    if name == "scan":
        return range(eqn.params["num_consts"] + eqn.params["num_carry"], len(eqn.invars))
    if name == "remat2" and not eqn.params["jaxpr"].constvars:
        return range(len(eqn.invars))
    return range(0)


def evaluate(jaxpr, consts, args, marks: dict, gather, in_loop) -> list:
    """``jaxpr`` on ``args``, the marked inputs (``{var: dim}``) gathered where read.

    ``in_loop``: whether ``jaxpr`` runs inside a scan's body (outside every loop, nothing
    is gathered: the partitioner gathers such a read once).
    """
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    direct = _direct(jaxpr, marks) if in_loop else []
    if direct:  # read here: gathered once, before anything else; handed down no further
        gathered = gather([env[v] for v in direct], [marks[v] for v in direct])
        env.update((v, checkpoint_name(x, GATHERED))
                   for v, x in zip(direct, gathered, strict=True))
        marks = {v: d for v, d in marks.items() if v not in direct}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        down = {k: marks[v] for k, v in enumerate(eqn.invars)
                if isinstance(v, Var) and v in marks}
        name = eqn.primitive.name
        if down and name == "scan":
            outs = _scan(eqn, invals, down, gather)
        elif down and name == "remat2" and not eqn.params["jaxpr"].constvars:
            outs = _remat(eqn, invals, down, gather, in_loop)
        else:
            outs = _bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals) -> list:
    """``eqn`` bound on ``invals`` as traced (as ``jax.core.eval_jaxpr`` binds it)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # jax < 0.9
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def _scan(eqn, invals, down: dict, gather) -> list:
    """A scan whose scanned inputs at ``down`` (``{position: dim}``) are split leaves."""
    p = eqn.params
    closed, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    body = closed.jaxpr
    # The body's slice of a leaf split on dim d is split on d - 1; on the scanned axis
    # itself (d == 0) each slice lives on one rank: left to the partitioner.
    marks = {body.invars[k]: d - 1 for k, d in down.items() if k >= n_consts + n_carry and d}
    if not marks:
        return _bind(eqn, invals)
    consts = invals[:n_consts]

    def run(consts, carry, xs):
        return evaluate(body, closed.consts, [*consts, *carry, *xs], marks, gather, True)

    direct = _direct(body, marks)
    if direct:  # gathered here: not kept for the backward (NOTE above)
        refused = _refused(body, direct, gather, [marks[v] for v in direct])
        run = jax.checkpoint(run, prevent_cse=False,
                             policy=lambda prim, *_, **__: prim.name not in refused)

    def step(carry, xs):
        out = run(consts, carry, xs)
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(step, invals[n_consts : n_consts + n_carry],
                             invals[n_consts + n_carry :], length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _refused(body, direct: list, gather, dims) -> frozenset:
    """The primitives a checkpoint around ``body`` must not save: the layer stays sharded.

    A value a policy refuses is recomputed from the values it was computed from, which are
    saved where the policy allows: refusing the gathered arrays alone (a name) would save
    the step before them. So the policy refuses every primitive the gather is made of
    (packing, sharding constraints, unpacking) and every primitive ``body`` computes from
    the gathered arrays and constants alone (a cast to the compute dtype, a weight norm:
    layer-sized too), and saves every other value; what it refuses is recomputed in the
    backward, from the layer gathered again.
    """
    names = set(_primitives(jax.make_jaxpr(lambda xs: gather(xs, dims))(
        [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in direct]).jaxpr))
    layer = set(direct) | set(body.constvars)
    for eqn in body.eqns:
        if all(not isinstance(v, Var) or v in layer for v in eqn.invars):
            layer.update(eqn.outvars)
            names.add(eqn.primitive.name)
            names.update(_primitives(eqn))
    return frozenset(names | {"name"})


def _primitives(node) -> set:
    """The names of the primitives in a jaxpr, or in an equation's inner jaxprs, at any depth."""
    if hasattr(node, "eqns"):
        out = set()
        for eqn in node.eqns:
            out.add(eqn.primitive.name)
            out |= _primitives(eqn)
        return out
    out = set()
    for value in getattr(node, "params", {}).values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if hasattr(sub, "eqns"):
                out |= _primitives(sub)
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                out |= _primitives(sub.jaxpr)
    return out


def _remat(eqn, invals, down: dict, gather, in_loop) -> list:
    """A checkpoint whose arguments at ``down`` are split leaves, with its own policy."""
    p = eqn.params
    body = p["jaxpr"]
    marks = {body.invars[k]: d for k, d in down.items()}

    def run(*args):
        return evaluate(body, (), list(args), marks, gather, in_loop)

    policy = p["policy"]
    direct = _direct(body, marks) if in_loop else []
    if direct and policy is not None:  # a policy that may save anything saves no layer
        refused = _refused(body, direct, gather, [marks[v] for v in direct])
        saves = policy

        def policy(prim, *args, **params) -> bool:
            return prim.name not in refused and saves(prim, *args, **params)

    return jax.checkpoint(run, prevent_cse=p["prevent_cse"], policy=policy)(*invals)
