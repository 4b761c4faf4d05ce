"""Calls under ``torch.func`` transforms: grad, vjp, jacrev, hessian, vmap, jvp, jacfwd.

NOTE [torch.func]. torch's function transforms accept only an autograd Function in the
``setup_context`` form, and hand it plain tensors only in ``forward`` and in its ``vmap``
rule; ``backward`` and ``jvp`` see wrapped tensors with no memory JAX could read. So a
call made while a transform is active (``Caller.__call__``) takes ``TransformedCall``
instead of the eager ``BridgeFunction``, and:

* ``forward`` runs the plain forward program on views of the leaves (no residuals);
* ``backward`` is always the differentiable call of the VJP (NOTE [Higher order] in
  ``_higher.py``): ``torch.func.grad`` runs every backward with ``create_graph``;
* ``jvp`` is the differentiable call of ``jax.jvp`` (forward mode);
* ``vmap`` runs ``jax.vmap`` of the program, torch's ``in_dims`` as ``in_axes``, every
  result batched on dimension 0. torch's ``randomness`` reaches the RNG streams through
  the key torch draws: "different" draws a key per batch entry (the key is batched),
  "same" one key, "error" refuses a call that draws one. State a call writes back
  (batch statistics) cannot be written from a batch of calls and is refused.

Nothing here runs unless a transform is active; the eager path is unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flaxside.internal import batched_function
from torchside import _errors


class Bundle(NamedTuple):
    """What a transformed call passes besides its leaves (not a tensor: torch ignores it)."""

    entry: object


class TransformedCall(torch.autograd.Function):
    """``apply(bundle, *leaves) -> results``: one call of an entry under torch.func."""

    @staticmethod
    def forward(bundle: Bundle, *leaves):
        entry = bundle.entry
        view = entry.exchange.view
        arrays = [view(t) for t in leaves[: entry.n_state]]
        return tuple(entry.forward(arrays, leaves, fuse=False, plain=True).results)

    @staticmethod
    def setup_context(ctx, inputs, output):
        bundle, *leaves = inputs
        entry = bundle.entry
        ctx.mark_non_differentiable(*(output[k] for k in entry.nondiff_out))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*leaves)
        ctx.save_for_forward(*leaves)
        ctx.entry = entry

    @staticmethod
    def backward(ctx, *grads):
        from torchside._higher import differentiable_backward  # _higher imports _call

        entry = ctx.entry
        cots = [grads[k] for k in entry.diff_out_index]
        nodes = [node for node, _ in ctx.next_functions]  # the leaves' (the only tensors)
        return (None, *differentiable_backward(entry, list(ctx.saved_tensors), cots, nodes))

    @staticmethod
    def jvp(ctx, _bundle, *tangents):
        from torchside._higher import forward_tangents

        entry = ctx.entry
        out = forward_tangents(entry, list(ctx.saved_tensors), list(tangents))
        results = [None] * entry.n_results
        for k, t in zip(entry.diff_out_index, out, strict=True):
            results[k] = t
        return tuple(results)

    @staticmethod
    def vmap(info, in_dims, bundle, *leaves):
        from torchside._higher import derived, run

        entry = bundle.entry
        dims = in_dims[1:]
        if entry.write_back.targets:
            raise _errors.write_back_under_transform(
                entry.program.name, [entry.names[i] for i in entry.write_back.targets])
        caller = derived(entry, f"vmap over {dims}", lambda program: _batched(program, dims))
        results = run(caller, list(leaves))
        return tuple(results), (0,) * len(results)


def _batched(program, dims):
    fn = batched_function(program, tuple(dims))
    return lambda leaves: fn(list(leaves))


def apply_transformed(entry, leaves: list) -> tuple:
    """The results of one call under an active transform (NOTE above)."""
    return TransformedCall.apply(Bundle(entry), *leaves)
