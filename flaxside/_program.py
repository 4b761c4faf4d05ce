"""Compiled forward / residual / backward programs for one call signature.

``Program`` turns a function of a flat list of array leaves into three jitted programs:

* ``forward(leaves) -> outputs``
* ``forward_with_residuals(leaves) -> (outputs, residuals)``
* ``backward(saved_inputs, saved_outputs, residuals, cotangents) -> grads``
* ``backward_recompute(leaves, cotangents) -> grads`` (forward rerun inside the backward)

A jitted ``jax.vjp`` would return the VJP's leaves as fresh output buffers, and those
include the primal inputs themselves (every parameter): for a 64-layer stack, 129 MB held
instead of 1 MB. While tracing the forward we therefore map each VJP leaf, by identity, to
an input leaf, an output leaf or a true residual; only true residuals leave the forward,
and the backward rebuilds the VJP from the arrays the caller passes again (see
``flaxside/README.md``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxside._depends import depends_on

jtu = jax.tree_util


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Shape, dtype and whether a gradient is wanted, for one array leaf of a call."""

    shape: tuple[int, ...]
    dtype: np.dtype
    diff: bool = False

    @property
    def aval(self) -> jax.ShapeDtypeStruct:
        """The abstract value JAX traces with."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype)


def is_differentiable(dtype) -> bool:
    """Whether a dtype carries gradients (floating or complex)."""
    return jnp.issubdtype(dtype, jnp.inexact)


class StaleSignature(ValueError):
    """A leaf reached a compiled program with another shape or dtype than it was built for."""


def _leaf_path(treedef, index: int):
    paths = jtu.tree_flatten_with_path(jtu.tree_unflatten(treedef, range(treedef.num_leaves)))[0]
    return paths[index][0]


def _distinct(results: list, inputs: Sequence) -> list:
    """Copies results that are an input or repeat another result, at trace time.

    JAX may hand an input that a jitted function returns unchanged back as the same buffer,
    and a gradient that is the cotangent itself (or shared by two leaves) as one buffer.
    Exchanged zero-copy, torch would then see two tensors over one memory, and an in-place
    update of one (a gradient accumulation, say) would silently change the other.
    """
    seen = {id(x) for x in inputs}
    out = []
    for r in results:
        if id(r) in seen:
            r = jnp.array(r, copy=True)
        seen.add(id(r))
        out.append(r)
    return out


PACK_BYTES = 64 * 1024  # residuals this small cross the boundary packed, one buffer per dtype


def _pack(residuals: list):
    """Concatenates small residuals into one flat buffer per dtype, inside the program.

    Every residual crosses to torch as a tensor and back (converted, saved, unpacked,
    converted again): on a 64-block unrolled stack that was 896 tensors per call and half
    of the call's time. Packed, the small ones cross as one buffer per dtype and are sliced
    back inside the backward; large ones still cross alone, without a copy.

    Returns:
        ``(buffers, layout)``: the residuals as they leave the program, and per original
        residual ``("alone", i)`` or ``("packed", i, offset, shape)`` into ``buffers``.
    """
    alone, groups, layout = [], {}, []
    for r in residuals:
        # Residuals an offloading policy put in host memory stay alone (and stay there).
        if r.size * r.dtype.itemsize > PACK_BYTES or _memory_space(r) != "device":
            layout.append(("alone", len(alone)))
            alone.append(r)
        else:
            group = groups.setdefault(np.dtype(r.dtype), [])
            offset = sum(x.size for x in group)
            layout.append(("packed", np.dtype(r.dtype), offset, r.shape))
            group.append(r)
    if sum(len(g) for g in groups.values()) < 2:  # nothing to gain: keep them as they are
        return list(residuals), tuple(("alone", i) for i in range(len(residuals)))
    order = {dt: len(alone) + i for i, dt in enumerate(groups)}
    buffers = alone + [jnp.concatenate([x.reshape(-1) for x in g]) for g in groups.values()]
    layout = tuple(
        entry if entry[0] == "alone" else ("packed", order[entry[1]], entry[2], entry[3])
        for entry in layout
    )
    return buffers, layout


def _memory_space(x) -> str:
    space = getattr(jax.typeof(x), "memory_space", None)
    return "device" if space is None else str(getattr(space, "name", space)).lower()


def _unpack(buffers: list, layout) -> list:
    """The residuals ``_pack`` was given, sliced back out of its buffers."""
    out = []
    for entry in layout:
        if entry[0] == "alone":
            out.append(buffers[entry[1]])
        else:
            _, i, offset, shape = entry
            size = int(np.prod(shape, dtype=np.int64))
            out.append(buffers[i][offset : offset + size].reshape(shape))
    return out


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _internal_assert(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(
            f"flaxtorch internal error: {message}. This is a bug in flaxtorch; please report it."
        )


class Program:
    """The compiled programs for one function and one call signature.

    Built once per signature; everything that depends only on the signature (treedefs,
    which leaves are differentiated, which outputs carry gradients, the residual map) is
    fixed here or during the first trace, so a call does only the dispatch itself.

    Args:
        fn: a function of the flat list of leaves returning a pytree of arrays, or
            ``(outputs, aux)`` with ``has_aux``: aux leaves (e.g. updated Flax
            collections) come after the outputs and never carry gradients.
        specs: one ``LeafSpec`` per leaf; ``diff`` marks the leaves to differentiate.
        has_aux: whether ``fn`` returns ``(outputs, aux)``.
        name: used in error messages.

    Attributes:
        out_specs: one ``LeafSpec`` per output then aux leaf; ``diff`` marks the outputs
            that depend on a differentiated leaf (the only ones that take a cotangent).
        n_out: how many of ``out_specs`` are outputs (the rest are aux).

    Example:
        >>> p = Program(lambda xs: xs[0] * xs[1], [LeafSpec((2,), np.float32, True)] * 2)
        >>> out, res = p.forward_with_residuals([np.ones(2, np.float32)] * 2)
    """

    def __init__(self, fn: Callable, specs: Sequence[LeafSpec], *, has_aux: bool = False,
                 name: str = "program"):
        self.fn = fn
        self.specs = tuple(specs)
        self.has_aux = has_aux
        self.name = name
        self.diff_index = tuple(i for i, s in enumerate(self.specs) if s.diff)
        self.trace_count = 0
        self._lock = threading.Lock()
        closed = jax.make_jaxpr(self._flat_fn)([s.aval for s in self.specs])
        self.trace_count = 0  # shape and dependency bookkeeping, not a compile
        depends = depends_on(closed.jaxpr, [s.diff for s in self.specs])
        self.out_specs = tuple(
            LeafSpec(o.shape, np.dtype(o.dtype), k < self.n_out and dep
                     and is_differentiable(o.dtype))
            for k, (o, dep) in enumerate(zip(closed.out_avals, depends, strict=True))
        )
        self.diff_out_index = tuple(k for k, s in enumerate(self.out_specs) if s.diff)
        # Filled by the first trace of forward_with_residuals.
        self._vjp_treedef = None
        self._vjp_sources: tuple[tuple[str, int], ...] = ()
        self.saved_input_index: tuple[int, ...] = ()
        self.saved_output_index: tuple[int, ...] = ()
        self.residual_specs: tuple[LeafSpec, ...] = ()
        self._forward = jax.jit(self._flat_fn)
        self._forward_res = jax.jit(self._fwd_res)
        self._backward = jax.jit(self._bwd)
        self._backward_re = jax.jit(self._bwd_recompute)

    # -- traced bodies -----------------------------------------------------------------
    def _flat_fn(self, leaves):
        self.trace_count += 1
        for spec, leaf in zip(self.specs, leaves, strict=True):
            if leaf.shape != spec.shape or leaf.dtype != spec.dtype:
                raise StaleSignature(
                    f"{self.name}: compiled for {spec.dtype}{list(spec.shape)} but called "
                    f"with {leaf.dtype}{list(leaf.shape)}"
                )
        result = self.fn(list(leaves))
        out, aux = result if self.has_aux else (result, ())
        out_leaves, self.out_treedef = jtu.tree_flatten(out)
        aux_leaves, self.aux_treedef = jtu.tree_flatten(aux)
        self.n_out = len(out_leaves)
        for i, leaf in enumerate(out_leaves):
            if not isinstance(leaf, jax.Array | np.ndarray | bool | int | float | complex):
                raise TypeError(
                    f"{self.name}: output {jtu.keystr(_leaf_path(self.out_treedef, i))} of "
                    f"the function is a {type(leaf).__name__}, but only arrays can cross to "
                    f"torch. Return arrays (or a tuple/list/dict of arrays) from the module."
                )
            if isinstance(leaf, jax.Array) and _is_key(leaf):
                raise TypeError(
                    f"{self.name}: output {jtu.keystr(_leaf_path(self.out_treedef, i))} of "
                    f"the function is a typed PRNG key array ({leaf.dtype}), which torch "
                    f"cannot hold. Return jax.random.key_data(key) instead."
                )
        return _distinct([jnp.asarray(x) for x in out_leaves + aux_leaves], leaves)

    def _vjp(self, leaves):
        """``jax.vjp`` over the diff leaves: ``(outputs + aux, vjp)``."""

        def differentiated(*diff):
            full = list(leaves)
            for i, x in zip(self.diff_index, diff, strict=True):
                full[i] = x
            results = self._flat_fn(full)
            return results[: self.n_out], results[self.n_out :]

        outs, vjp, aux = jax.vjp(
            differentiated, *[leaves[i] for i in self.diff_index], has_aux=True
        )
        return list(outs) + list(aux), vjp

    def _cotangents(self, cotangents):
        cots = iter(cotangents)
        full = []
        for s in self.out_specs[: self.n_out]:
            if s.diff:
                full.append(next(cots))
            elif is_differentiable(s.dtype):
                full.append(jnp.zeros(s.shape, s.dtype))
            else:
                full.append(np.zeros(s.shape, jax.dtypes.float0))
        return full

    def _fwd_res(self, leaves):
        leaves = list(leaves)
        outs, vjp = self._vjp(leaves)
        vjp_leaves, vjp_treedef = jtu.tree_flatten(vjp)
        by_id_in = {id(x): j for j, x in enumerate(leaves)}
        by_id_out = {id(x): k for k, x in enumerate(outs)}
        sources, residuals, saved_in, saved_out, by_id_res = [], [], {}, {}, {}
        for leaf in vjp_leaves:
            if id(leaf) in by_id_res:
                sources.append(("res", by_id_res[id(leaf)]))
            elif id(leaf) in by_id_in:
                j = by_id_in[id(leaf)]
                sources.append(("in", saved_in.setdefault(j, len(saved_in))))
            elif id(leaf) in by_id_out:
                k = by_id_out[id(leaf)]
                sources.append(("out", saved_out.setdefault(k, len(saved_out))))
            else:
                by_id_res[id(leaf)] = len(residuals)
                sources.append(("res", len(residuals)))
                residuals.append(jnp.asarray(leaf))
        # Typed PRNG keys (a remat'd dropout keeps its key) cannot cross to torch: they
        # leave as raw key data and are wrapped again, with the same implementation, inside
        # the backward.
        self._key_impls = tuple(
            jax.random.key_impl(r) if _is_key(r) else None for r in residuals
        )
        residuals = [jax.random.key_data(r) if _is_key(r) else r for r in residuals]
        self._vjp_treedef = vjp_treedef
        self._vjp_sources = tuple(sources)
        self.saved_input_index = tuple(saved_in)
        self.saved_output_index = tuple(saved_out)
        residuals, self._pack_layout = _pack(residuals)
        self.residual_specs = tuple(LeafSpec(r.shape, np.dtype(r.dtype)) for r in residuals)
        return outs, residuals

    def _bwd(self, saved_inputs, saved_outputs, residuals, cotangents):
        self.trace_count += 1
        residuals = _unpack(list(residuals), self._pack_layout)
        residuals = [
            r if impl is None else jax.random.wrap_key_data(r, impl=impl)
            for r, impl in zip(residuals, self._key_impls, strict=True)
        ]
        pools = {"in": saved_inputs, "out": saved_outputs, "res": residuals}
        vjp_leaves = [pools[kind][i] for kind, i in self._vjp_sources]
        vjp = jtu.tree_unflatten(self._vjp_treedef, vjp_leaves)
        grads = vjp(self._cotangents(cotangents))
        return _distinct(list(grads), list(cotangents) + list(saved_inputs)
                         + list(saved_outputs) + list(residuals))

    def _bwd_recompute(self, leaves, cotangents):
        _, vjp = self._vjp(list(leaves))
        grads = vjp(self._cotangents(cotangents))
        return _distinct(list(grads), list(cotangents) + list(leaves))

    # -- calls -------------------------------------------------------------------------
    def forward(self, leaves: Sequence) -> list[jax.Array]:
        """Outputs (then aux) only: nothing is kept for a backward."""
        return self._forward(leaves)

    def forward_with_residuals(self, leaves: Sequence) -> tuple[list, list]:
        """Outputs (then aux) and the residuals the backward needs beyond inputs and outputs."""
        if self._vjp_treedef is None:
            with self._lock:  # the residual map is written by the first trace only
                return self._forward_res(leaves)
        return self._forward_res(leaves)

    def compile_for_report(self) -> dict[str, tuple[jax.stages.Compiled, float]]:
        """Lowers and compiles ``forward_with_residuals`` and ``backward`` from the specs alone.

        No data is needed or allocated; the first lowering fixes the residual map, like a
        first call. Used by ``flaxside.memory_report``; calls still compile on their own.

        Returns:
            ``{"forward_with_residuals": (compiled, seconds), "backward": (compiled,
            seconds)}``, seconds covering trace, lowering and compilation.
        """
        start = time.perf_counter()
        with self._lock:
            fwd = self._forward_res.lower([s.aval for s in self.specs]).compile()
        mid = time.perf_counter()
        avals = (
            [self.specs[j].aval for j in self.saved_input_index],
            [self.out_specs[k].aval for k in self.saved_output_index],
            [s.aval for s in self.residual_specs],
            [self.out_specs[k].aval for k in self.diff_out_index],
        )
        bwd = self._backward.lower(*avals).compile()
        end = time.perf_counter()
        return {"forward_with_residuals": (fwd, mid - start), "backward": (bwd, end - mid)}

    def backward(self, saved_inputs, saved_outputs, residuals, cotangents) -> list[jax.Array]:
        """Gradients of the ``diff`` leaves, in order.

        Args:
            saved_inputs: the input leaves at ``saved_input_index``, passed again.
            saved_outputs: the output leaves at ``saved_output_index``.
            residuals: what ``forward_with_residuals`` returned as residuals.
            cotangents: one per differentiable output (``diff_out_index``).
        """
        _internal_assert(self._vjp_treedef is not None, "backward before forward_with_residuals")
        return self._backward(list(saved_inputs), list(saved_outputs), list(residuals),
                              list(cotangents))

    def backward_recompute(self, leaves: Sequence, cotangents: Sequence) -> list[jax.Array]:
        """Gradients of the ``diff`` leaves, rerunning the forward inside one program.

        Like ``torch.utils.checkpoint`` around the whole block: nothing but the inputs is
        held between ``forward`` and this call.
        """
        return self._backward_re(list(leaves), list(cotangents))
