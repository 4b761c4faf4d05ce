"""A program's derivatives as plain JAX functions, for derivatives of any order.

NOTE [Derivative functions]. A torch caller that differentiates a call again (``create_graph``,
``torch.func``) needs the call's derivatives as functions it can call, and differentiate,
in turn. Each function here is built from a ``Program``'s own traced body, so it computes
exactly what the program's first-order executables compute:

* ``vjp_function(program, wanted)``: ``f(leaves, cotangents) -> gradients`` of the
  ``diff`` leaves the caller reads (torch's convention for complex leaves), the forward
  recomputed inside;
* ``linearized_vjp(program, wanted)``: ``vjp_function`` split into what does not depend
  on the cotangents and what does, so that calls differing only in them share the first;
* ``jvp_function(program)``: ``g(leaves, tangents) -> (outputs, output tangents)`` for the
  differentiable outputs (forward mode: ``jax.jvp``);
* ``batched_function(program, in_axes)``: the program's results under ``jax.vmap`` (for
  torch.func's ``vmap``; a batched RNG leaf gives each entry its own key);
* ``per_sample_vjp_function(program, batched)``: the gradients of each sample, for a
  program traced for one sample (a batch of one): ``jax.vmap`` over the batch of
  ``vjp_function`` (for Opacus's per-sample gradients, ``torchside/integrations/_opacus.py``);
* ``per_sample_norms_function(program, batched)``: the 2-norm of each of those gradients
  (for Opacus's fast gradient clipping, which needs the norms only).

Each is an ordinary JAX function: the torch side wraps it in a call of its own, whose
backward is the VJP of this one, and so on, to any order JAX can differentiate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from flaxside import jaxprs
from flaxside.derivatives._summed_squares import summed_squares
from flaxside.program._codecs import is_key
from flaxside.program._conventions import conj
from flaxside.program._program import Program
from flaxside.program._traced_bodies import replaced


def vjp_function(program: Program, wanted: tuple[int, ...] | None = None) -> Callable:
    """``f(leaves, cotangents)``: the gradients of ``program``'s ``diff`` leaves.

    ``cotangents`` holds one array per differentiable output (``diff_out_index``).
    ``wanted``: positions in ``diff_index`` whose gradients ``f`` returns, in that order
    (``None``: all). The other leaves are constants of ``f``, so that neither ``f`` nor
    its own VJP computes a gradient nobody reads (a gradient penalty reads the input's
    gradient, not the weights': their products are half the backward's work).
    """
    index = program.diff_index if wanted is None else tuple(
        program.diff_index[p] for p in wanted)
    n_out = program.n_out

    def f(leaves, cotangents):
        leaves = list(leaves)

        def differentiated(*diff):
            return program.traced_results(replaced(leaves, index, diff))[:n_out]

        _, vjp = jax.vjp(differentiated, *[leaves[i] for i in index])
        return program.pull(vjp, list(cotangents), index)

    return f


def jvp_function(program: Program) -> Callable:
    """``g(leaves, tangents)``: results and the tangents of the differentiable outputs.

    ``tangents`` holds one array per ``diff`` leaf (``diff_index``). Raises JAX's error
    where the function has no forward-mode rule (a ``jax.custom_vjp``).
    """

    def g(leaves, tangents):
        leaves = list(leaves)

        def diff_only(*diff):
            results = program.traced_results(replaced(leaves, program.diff_index, diff))
            return [results[k] for k in program.diff_out_index]

        primals = [leaves[i] for i in program.diff_index]
        outs, tangents_out = jax.jvp(diff_only, primals, [
            conj(t) for t in tangents])
        return list(outs), [conj(t) for t in tangents_out]

    return g


class Batched:
    """A function whose results come out batched on the axes ``batch_axes`` names.

    A value, not an attribute set on a closure: ``fn`` is what is called, ``batch_axes``
    (per result) where its batch lies.
    """

    __slots__ = ("batch_axes", "fn")

    def __init__(self, fn: Callable, batch_axes: tuple[int, ...]):
        self.fn, self.batch_axes = fn, batch_axes

    def __call__(self, *args):
        return self.fn(*args)


def batched_function(program: Program, in_axes: tuple) -> Batched:
    """``h(leaves)``: ``program``'s results under ``jax.vmap``.

    ``in_axes``: per leaf, its batch axis or ``None``. Each result is batched on axis
    ``h.batch_axes[k]``: where the batched program computes it (``_moved_axes``; 0 but for
    results stacked by a scan, such as a VJP's gradients of stacked parameters).
    """
    in_axes = tuple(None if a is None else a % (len(s.shape) + 1)
                    for a, s in zip(in_axes, program.specs, strict=True))

    def at(out_axes):
        def h(leaves):
            def one(*leaves):
                return program.traced_results(list(leaves))

            return jax.vmap(one, in_axes=in_axes, out_axes=out_axes)(*leaves)

        return h

    avals = [s.aval if a is None else jax.ShapeDtypeStruct((*s.shape[:a], 2, *s.shape[a:]),
                                                           s.dtype)
             for s, a in zip(program.specs, in_axes, strict=True)]
    axes = _moved_axes(jax.make_jaxpr(at(0))(avals).jaxpr)
    return Batched(at(list(axes)), axes)


def _moved_axes(jaxpr) -> tuple[int, ...]:
    """Per output of a ``jax.vmap`` jaxpr (batch first), where the computation put the batch.

    ``vmap`` moves each result's batch axis to the front; where the computation leaves it
    elsewhere (a leaf stacked by a scan, whose batched transpose computes it behind the
    layer axes), the move is a transpose that copies the whole result. Where an output is
    exactly that move (a ``transpose`` bringing one axis to the front), the axis it moves;
    else 0. Asking ``vmap`` for the batch there returns the result without the copy.
    """
    made = jaxprs.producers(jaxpr)
    axes = []
    for v in jaxpr.outvars:
        eqn, axis = made.get(v) if jaxprs.is_var(v) else None, 0
        if eqn is not None and eqn.primitive.name == "transpose":
            perm = tuple(eqn.params["permutation"])
            if perm == (perm[0], *range(perm[0]), *range(perm[0] + 1, len(perm))):
                axis = perm[0]
        axes.append(axis)
    return tuple(axes)


def _per_sample_vjp(program: Program, batched: tuple[bool, ...], out_axes) -> Callable:
    """``jax.vmap`` over the batch of ``vjp_function`` on one sample at a time."""
    vjp = vjp_function(program)
    axes = [0 if b else None for b in batched]

    def one(leaves, cotangents):
        leaves = [x[None] if b else x for x, b in zip(leaves, batched, strict=True)]
        return vjp(leaves, [c[None] for c in cotangents])

    def f(leaves, cotangents):
        return jax.vmap(one, in_axes=(axes, 0), out_axes=out_axes)(list(leaves),
                                                                   list(cotangents))

    return f


def per_sample_axes(program: Program, batched: tuple[bool, ...]) -> tuple[int, ...]:
    """Per ``diff`` leaf, the axis on which its per-sample gradients come out batched.

    ``jax.vmap`` puts each result's batch axis first by moving it there, and for a leaf
    stacked by a scan (``nn.scan``, ``nn.remat_scan``, ``remat_stack``) the batched VJP
    computes it behind the layer axes: the move is a transpose, a copy of every per-sample
    gradient, as large as the program's whole output (the DP-SGD rows of
    ``examples/bench/benchmark.py`` measure what it cost). Read from the batched VJP's
    jaxpr, traced once for a batch of two (``_moved_axes``). The gradients are then
    returned where they lie, and read through a view (torch) or reduced over the other
    axes (``per_sample_norms_function``).
    """
    leaves = [jax.ShapeDtypeStruct((2, *s.shape[1:]) if b else s.shape, s.dtype)
              for s, b in zip(program.specs, batched, strict=True)]
    cotangents = [jax.ShapeDtypeStruct((2, *program.out_specs[k].shape[1:]),
                                       program.out_specs[k].dtype)
                  for k in program.diff_out_index]
    return _moved_axes(jax.make_jaxpr(_per_sample_vjp(program, batched, 0))(
        leaves, cotangents).jaxpr)


def per_sample_vjp_function(program: Program, batched: tuple[bool, ...]) -> Batched:
    """``f(leaves, cotangents)``: per sample, the gradients of ``program``'s ``diff`` leaves.

    ``program`` is traced for one sample: every leaf marked in ``batched`` has a leading
    axis of size 1. ``f`` takes those leaves with the whole batch on axis 0 (the other
    leaves, the parameters, as they are) and one cotangent per differentiable output,
    batched the same way, and returns per ``diff`` leaf its gradients stacked on a new
    axis, ``f.batch_axes[i]`` (``per_sample_axes``: 0 but for leaves stacked by a scan):
    the gradient sample ``i``'s cotangent pulls through sample ``i``'s forward. One
    program for the batch: ``jax.vmap`` of ``vjp_function``, whose forward is the
    program's own traced body (its remat policy included). Exact for a block whose output
    for sample ``i`` depends only on input ``i``.
    """
    axes = per_sample_axes(program, batched)
    return Batched(_per_sample_vjp(program, batched, list(axes)), axes)


def per_sample_norms_function(program: Program, batched: tuple[bool, ...]) -> Callable:
    """``f(leaves, cotangents)``: per ``diff`` leaf, each sample's gradient's 2-norm.

    As ``per_sample_vjp_function``, reduced in the same program over every axis but the
    batch's: ``f`` returns a vector of the batch's length per leaf. Each sum of squares is
    taken where the gradient is computed, layer by layer inside the scans that would
    stack it (``summed_squares``, NOTE [Summed squares]): a per-sample gradient is never
    stored, not even as XLA's temporaries. In float32 at least, as
    ``torch.linalg.vector_norm`` of a bfloat16 tensor sums.
    """
    grads = per_sample_vjp_function(program, batched)
    n = len(program.specs)

    def f(leaves, cotangents):
        sums, avals = summed_squares(lambda *a: grads(a[:n], a[n:]), [*leaves, *cotangents],
                                     grads.batch_axes)
        return [jnp.sqrt(s).astype(jnp.finfo(a.dtype).dtype)
                for s, a in zip(sums, avals, strict=True)]

    return f


def linearized_vjp(program: Program, wanted: tuple[int, ...] | None = None):
    """``(linearize, apply)``: ``vjp_function(program, wanted)`` split where its cotangents enter.

    ``linearize(leaves) -> residuals`` computes everything the gradients need that does not
    depend on the cotangents (the forward and its linearization: ``jax.linearize`` of the
    VJP in its cotangents, at zero); ``apply(leaves, residuals, cotangents) -> gradients``
    the rest, exactly the VJP where it is linear in its cotangents (``program.linear_vjp``:
    JAX's own rules are; a ``custom_vjp`` rule need not be, and the caller must not split
    then): ``apply(leaves, linearize(leaves), c) == f(leaves, c)`` for
    ``f = vjp_function(program, wanted)``. Both are ordinary JAX functions of their
    arguments, so the composition differentiates as ``f`` does (torch's NOTE [Shared
    linearization]: calls that differ only in the cotangents run ``linearize`` once).
    Residuals that are leaves are read from ``leaves``, not returned (a parameter would be
    copied out); typed PRNG keys leave as their raw data and are wrapped again.
    """
    f = vjp_function(program, wanted)
    cot_specs = [program.out_specs[k] for k in program.diff_out_index]
    # The leaves' avals -> the linear map's treedef, and per residual: ("leaf", index),
    # ("key", implementation) or ("array", None). ``apply`` is traced after ``linearize``
    # for the same leaves: its residuals are what ``linearize`` returned.
    maps = {}

    def linearize(leaves):
        leaves = list(leaves)
        zeros = [jnp.zeros(s.shape, s.dtype) for s in cot_specs]
        _, linear = jax.linearize(lambda c: f(leaves, c), zeros)
        res, treedef = jax.tree_util.tree_flatten(linear)
        index = {id(x): i for i, x in enumerate(leaves)}
        labels = tuple(("leaf", index[id(r)]) if id(r) in index else
                       ("key", jax.random.key_impl(r)) if is_key(r) else ("array", None)
                       for r in res)
        known = maps.get(_avals(leaves))
        if known is not None and known[1] != labels:  # compiled programs would disagree
            raise AssertionError(f"{program.name}: the linearization's residuals differ "
                                 f"between two traces: {known[1]} and {labels}")
        maps[_avals(leaves)] = treedef, labels
        return [jax.random.key_data(r) if kind == "key" else r
                for r, (kind, _) in zip(res, labels, strict=True) if kind != "leaf"]

    def apply(leaves, residuals, cotangents):
        leaves = list(leaves)
        treedef, labels = maps[_avals(leaves)]
        own = iter(residuals)
        res = [leaves[x] if kind == "leaf" else
               jax.random.wrap_key_data(next(own), impl=x) if kind == "key" else next(own)
               for kind, x in labels]
        return list(jax.tree_util.tree_unflatten(treedef, res)(list(cotangents)))

    return linearize, apply


def vjp_work(program: Program, wanted: tuple[int, ...] | None = None) -> float:
    """About how many floating-point operations one call of ``vjp_function`` makes.

    Read from its jaxpr, traced once: two per multiply-add of each ``dot_general``, one per
    element of every other primitive's outputs, a scan's body counted once per iteration
    (XLA's own cost analysis counts a loop's body once), a ``cond``'s costliest branch.
    Deterministic, and the same on every device: what decides whether calls that share
    a linearization are worth a call more (torch's NOTE [Shared linearization]).
    """
    f = vjp_function(program, wanted)
    leaves = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in program.specs]
    cotangents = [jax.ShapeDtypeStruct(program.out_specs[k].shape, program.out_specs[k].dtype)
                  for k in program.diff_out_index]
    return _work(jax.make_jaxpr(f)(leaves, cotangents).jaxpr)


def _work(jaxpr) -> float:
    total = 0.0
    for eqn in jaxprs.walk(jaxpr):
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(eqn.invars[0].aval.shape[d] for d in contracted)
            total += 2 * k * math.prod(eqn.outvars[0].aval.shape)
            continue
        inner = [_work(j) for j in jaxprs.sub_jaxprs(eqn)]
        if eqn.primitive.name == "scan":
            total += eqn.params["length"] * sum(inner)
        elif eqn.primitive.name == "cond":
            total += max(inner, default=0.0)
        elif inner:
            total += sum(inner)
        else:
            total += sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    return total


def _avals(leaves) -> tuple:
    return tuple((tuple(x.shape), x.dtype) for x in leaves)
