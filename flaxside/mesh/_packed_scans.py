"""Stock scans over a mesh gather each layer as one buffer (NOTE [Packed scans]).

NOTE [Packed scans]. A stock ``nn.scan``, ``nn.remat_scan`` or ``nnx.scan`` block reads
each layer's parameters as the scan's slices of the stacked leaves, and over a mesh XLA's
partitioner gathers each slice separately where it is used: one collective, a round trip,
per parameter per iteration and per use, forward and backward. ``remat_stack`` owns its
loops and packs a layer instead (NOTE [One collective per layer] in ``_on_mesh.py``); a
stock block's loops are Flax's, so ``packed_scans`` reaches them through the jaxpr: the
function is traced once and that jaxpr evaluated again by the one interpreter (NOTE [One
interpreter] in ``jaxprs/_interpret.py``; this meaning's rules are ``_RULES``), following
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
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

from flaxside import jaxprs
from flaxside.mesh._traced_leaves import traced_again

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
    for eqn in jaxprs.walk(jaxpr):
        down = handed_down(eqn)
        used.update(v for k, v in enumerate(eqn.invars)
                    if jaxprs.is_var(v) and v in marks and k not in down)
    used.update(v for v in jaxpr.outvars if jaxprs.is_var(v) and v in marks)
    return [v for v in jaxpr.invars if v in used]


def reached_in_loops(jaxpr, marks: dict, in_loop: bool) -> bool:
    """Whether each marked input is read inside loops only, on a dimension a gather splits.

    Handed down by scans (never sliced on its split dimension: a slice on one rank) and
    checkpoints; outside every loop, read by nothing else.
    """
    for eqn in jaxprs.walk(jaxpr):
        down = handed_down(eqn)
        for k, v in enumerate(eqn.invars):
            if not (jaxprs.is_var(v) and v in marks):
                continue
            if k not in down:
                if not in_loop:
                    return False
                continue
            body, _ = jaxprs.body_of(eqn)
            if eqn.primitive.name == "scan":
                if not marks[v] or not reached_in_loops(
                        body, {body.invars[k]: marks[v] - 1}, in_loop=True):
                    return False
            elif not reached_in_loops(body, {body.invars[k]: marks[v]}, in_loop):
                return False
    return in_loop or not any(jaxprs.is_var(v) and v in marks for v in jaxpr.outvars)


def handed_down(eqn) -> range:
    """Positions of ``eqn``'s inputs that reach its body sliced (a scan) or as they are."""
    name = eqn.primitive.name
    if name == "scan":
        return range(eqn.params["num_consts"] + eqn.params["num_carry"], len(eqn.invars))
    if name == "remat2" and jaxprs.runs_again(eqn):
        return range(len(eqn.invars))
    return range(0)


class _Gathering(NamedTuple):
    """What the rules read: the split inputs (``{var: dim}``), the gather, inside a loop."""

    marks: dict
    gather: Callable
    in_loop: bool


def evaluate(jaxpr, consts, args, marks: dict, gather, in_loop) -> list:
    """``jaxpr`` on ``args``, the marked inputs (``{var: dim}``) gathered where read.

    ``in_loop``: whether ``jaxpr`` runs inside a scan's body (outside every loop, nothing
    is gathered: the partitioner gathers such a read once).
    """
    direct = _direct(jaxpr, marks) if in_loop else []
    if direct:  # read here: gathered once, before anything else; handed down no further
        at = {v: k for k, v in enumerate(jaxpr.invars)}
        gathered = gather([args[at[v]] for v in direct], [marks[v] for v in direct])
        args = list(args)
        for v, x in zip(direct, gathered, strict=True):
            args[at[v]] = checkpoint_name(x, GATHERED)
        marks = {v: d for v, d in marks.items() if v not in direct}
    return jaxprs.evaluate(jaxpr, consts, args, _RULES, _Gathering(marks, gather, in_loop))


def _down(state: _Gathering, eqn) -> dict:
    """``{position: dim}``: which of ``eqn``'s inputs are split leaves."""
    return {k: state.marks[v] for k, v in enumerate(eqn.invars)
            if jaxprs.is_var(v) and v in state.marks}


def _scan(state: _Gathering, eqn, invals) -> list | None:
    """A scan whose scanned inputs are split leaves: its body gathers each layer."""
    n_sliced = eqn.params["num_consts"] + eqn.params["num_carry"]
    body, consts = jaxprs.body_of(eqn)
    # The body's slice of a leaf split on dim d is split on d - 1; on the scanned axis
    # itself (d == 0) each slice lives on one rank: left to the partitioner.
    marks = {body.invars[k]: d - 1 for k, d in _down(state, eqn).items() if k >= n_sliced and d}
    if not marks:
        return None

    def run(args):
        return evaluate(body, consts, args, marks, state.gather, True)

    direct = _direct(body, marks)
    if not direct:
        return jaxprs.again(eqn, invals, run)
    # Gathered here: not kept for the backward (NOTE above).
    refused = _refused(body, direct, state.gather, [marks[v] for v in direct])
    return jaxprs.again(eqn, invals, run,
                        policy=lambda prim, *_, **__: prim.name not in refused)


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
    names = jaxprs.primitives(jax.make_jaxpr(lambda xs: gather(xs, dims))(
        [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in direct]).jaxpr)
    layer = set(direct) | set(body.constvars)
    for eqn in jaxprs.walk(body):
        if all(not jaxprs.is_var(v) or v in layer for v in eqn.invars):
            layer.update(eqn.outvars)
            names.add(eqn.primitive.name)
            names.update(*map(jaxprs.primitives, jaxprs.sub_jaxprs(eqn)))
    return frozenset(names | {"name"})


def _remat(state: _Gathering, eqn, invals) -> list | None:
    """A checkpoint whose arguments are split leaves, with its own policy."""
    down = _down(state, eqn)
    if not down or not jaxprs.runs_again(eqn):
        return None
    body, _ = jaxprs.body_of(eqn)
    marks = {body.invars[k]: d for k, d in down.items()}

    def run(args):
        return evaluate(body, (), args, marks, state.gather, state.in_loop)

    policy = eqn.params["policy"]
    direct = _direct(body, marks) if state.in_loop else []
    if not direct or policy is None:  # a policy that may save anything saves no layer
        return jaxprs.again(eqn, invals, run)
    refused = _refused(body, direct, state.gather, [marks[v] for v in direct])

    def refusing(prim, *args, **params) -> bool:
        return prim.name not in refused and policy(prim, *args, **params)

    return jaxprs.again(eqn, invals, run, policy=refusing)


# The meaning (NOTE [One interpreter]): loops that slice a split leaf gather it in the body.
_RULES = {"scan": _scan, "remat2": _remat}
