"""The traced bodies of ``Program``'s executables (``_program.py``): what each computes.

``TracedBodies`` is ``Program``'s base: its methods are traced by ``jax.jit`` when a
program is lowered, and read the attributes ``Program.__init__`` sets (``fn``, ``name``,
``diff_index``, ``n_out``, ``grad_pack``, ``trace_count``, the traced specs and shardings,
the first trace's structure and the residual map). What depends on where the program runs
(packing, the results' shardings, FSDP's mean in the pull) is asked of ``placement``
(NOTE [Placement] in ``_placement.py``), so the same bodies run on one device and over a
mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxside.program._codecs import is_key
from flaxside.program._conventions import check_output_leaf, conj, distinct, memory_space
from flaxside.program._pack import pack, unpack
from flaxside.program._residual_labels import label_leaves
from flaxside.program._specs import Carrying, LeafSpec, Learned, ResidualMap, is_differentiable

jtu = jax.tree_util


def replaced(leaves, index, values) -> list:
    """``leaves`` with ``values`` at ``index`` (the differentiated ones, inside a VJP)."""
    full = list(leaves)
    for i, x in zip(index, values, strict=True):
        full[i] = x
    return full


@dataclasses.dataclass(frozen=True)
class Structure:
    """What one trace of ``fn`` returns besides arrays; equal for every trace."""

    out_treedef: Any
    n_out: int
    write_back: Hashable

    def check_again(self, again: Structure, name: str) -> None:
        """Refuses another trace's structure that differs from this, the first trace's."""
        if again != self:
            raise NotImplementedError(
                f"{name}: the function returned {again} when traced again, but {self} when "
                f"first traced; its outputs and the state it writes back must depend on the "
                f"shapes and dtypes of its inputs alone (no Python state that changes "
                f"between traces).")


def vjp_sources(leaves, results, vjp_leaves) -> tuple[tuple, list, dict]:
    """``(sources, residuals, saved)`` of a traced VJP's leaves, as ``ResidualMap`` has them.

    Each leaf is an input, a result or a true residual (``label_leaves``); ``saved``
    maps the inputs' and results' indices to their positions among what is passed again.
    """
    known = {id(x): ("in", j) for j, x in enumerate(leaves)}
    for k, x in enumerate(results):
        known.setdefault(id(x), ("out", k))
    labels, residuals = label_leaves(vjp_leaves, known)
    saved = {"in": {}, "out": {}}  # leaf index -> position among what is passed again
    sources = tuple(
        (kind, i) if kind == "res" else (kind, saved[kind].setdefault(i, len(saved[kind])))
        for kind, i in labels
    )
    return sources, residuals, saved


class TracedBodies:
    """The bodies ``Program`` lowers, one per program kind, and the hooks they share."""

    def _results(self, leaves, unreduced=None) -> tuple[list, Structure]:
        """``fn`` on the leaves: results (outputs then aux, never aliasing an input).

        Traced at the precision the program was built with (NOTE [Precision of a
        program]): every body, derived ones included, computes what the first computed.
        ``unreduced``: as ``OnMesh.tracing`` takes it (the first trace checks it).
        """
        with (self.placement.tracing(list(leaves), unreduced) as read,  # NOTE [Mixed precision]
              jax.default_matmul_precision(self.precision)):
            out, aux, write_back = self.placement.call(self.fn, read)
        out_leaves, out_treedef = jtu.tree_flatten(out)
        for i, leaf in enumerate(out_leaves):
            check_output_leaf(leaf, out_treedef, i, self.name)
        results = distinct([jnp.asarray(x) for x in out_leaves + list(aux)], leaves)
        return results, Structure(out_treedef, len(out_leaves), write_back)

    def pull(self, vjp, cotangents, index=None) -> list:
        """The gradients for ``cotangents`` (torch's convention) of the leaves at ``index``.

        ``vjp`` differentiates the leaves at ``index`` (``None``: every ``diff`` leaf).
        Each gradient has its leaf's sharding; over a mesh, FSDP's mean for leaves not in
        the batch.
        """
        placement = self.placement
        index = self.diff_index if index is None else index

        def pull(cots):
            return [conj(g) for g in vjp(self._cotangents(cots))]

        grads = placement.pull(pull, list(cotangents), self._sharded_diff_outputs, index)
        return [placement.constrain(g, self._in_shardings[i])
                for g, i in zip(grads, index, strict=True)]

    def traced_results(self, leaves) -> list:
        results, structure = self._results(leaves)
        self._structure.check_again(structure, self.name)
        constrain = self.placement.constrain
        return [constrain(r, s) for r, s in zip(results, self._out_shardings, strict=True)]

    def traced_vjp(self, leaves):
        """``jax.vjp`` over the diff leaves: ``(results, vjp)``."""

        def differentiated(*diff):
            results = self.traced_results(replaced(leaves, self.diff_index, diff))
            return results[: self.n_out], results[self.n_out :]

        outs, vjp, aux = jax.vjp(
            differentiated, *[leaves[i] for i in self.diff_index], has_aux=True
        )
        return list(outs) + list(aux), vjp

    def _cotangents(self, cotangents):
        """Full cotangents for the outputs (traced shapes) from the differentiable ones'."""
        cots = iter(cotangents)
        full = []
        for s in self._traced_out[: self.n_out]:
            if s.diff:
                full.append(conj(next(cots)))
            elif is_differentiable(s.dtype):
                full.append(jnp.zeros(s.shape, s.dtype))
            else:
                full.append(np.zeros(s.shape, jax.dtypes.float0))
        return full

    def _forward_body(self, leaves, *fence):
        self.trace_count += 1
        return self.traced_results(leaves)

    def _forward_res_body(self, leaves, *fence) -> Carrying:
        """Results then residual buffers, carrying the ``ResidualMap`` this trace learned."""
        self.trace_count += 1
        leaves = list(leaves)
        results, vjp = self.traced_vjp(leaves)
        vjp_leaves, vjp_treedef = jtu.tree_flatten(vjp)
        sources, residuals, saved = vjp_sources(leaves, results, vjp_leaves)
        # Typed PRNG keys (a remat'd dropout keeps its key) cannot cross to torch: they
        # leave as raw key data and are wrapped again, with the same implementation.
        key_impls = tuple(jax.random.key_impl(r) if is_key(r) else None for r in residuals)
        residuals = [jax.random.key_data(r) if is_key(r) else r for r in residuals]
        packing, _ = self.placement.pack_plan(
            residuals, [memory_space(r) != "device" for r in residuals])
        buffers = pack(residuals, packing)
        residual_map = ResidualMap(
            vjp_treedef=vjp_treedef, sources=sources, saved_inputs=tuple(saved["in"]),
            saved_outputs=tuple(saved["out"]), key_impls=key_impls, pack=packing,
            residual_specs=tuple(LeafSpec(tuple(b.shape), np.dtype(b.dtype)) for b in buffers),
            offloaded=tuple(memory_space(b) != "device" for b in buffers),
        )
        return Carrying(results + buffers, Learned(residual_map))

    def _backward_body(self, saved_inputs, saved_outputs, residuals, cotangents, *fence):
        self.trace_count += 1
        rmap = self._residual_map
        residuals = [
            r if impl is None else jax.random.wrap_key_data(r, impl=impl)
            for r, impl in zip(unpack(list(residuals), rmap.pack), rmap.key_impls, strict=True)
        ]
        pools = {"in": saved_inputs, "out": saved_outputs, "res": residuals}
        vjp = jtu.tree_unflatten(rmap.vjp_treedef, [pools[k][i] for k, i in rmap.sources])
        grads = self.pull(vjp, cotangents)
        return pack(distinct(grads, list(cotangents) + list(saved_inputs)
                              + list(saved_outputs) + list(residuals)), self.grad_pack)

    def _backward_recompute_body(self, leaves, cotangents, *fence):
        self.trace_count += 1
        _, vjp = self.traced_vjp(list(leaves))
        grads = self.pull(vjp, cotangents)
        return pack(distinct(grads, list(cotangents) + list(leaves)), self.grad_pack)

    def _value_and_grad_body(self, leaves, *fence):
        self.trace_count += 1
        results, vjp = self.traced_vjp(list(leaves))
        spec = self._traced_out[self.diff_out_index[0]]
        grads = self.pull(vjp, [jnp.ones(spec.shape, spec.dtype)])
        return results + pack(distinct(grads, list(leaves) + results), self.grad_pack)
