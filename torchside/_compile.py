"""The torch.compile edge: a FlaxModule call as two torch.library custom ops.

Dynamo cannot trace JAX, so under ``torch.compile`` step 3 of NOTE [Call path]
(``_call.py``) is two ops Dynamo treats as opaque (the PyTorch docs' way to wrap a foreign
library); every other step is the eager one:

* ``flaxtorch::forward(caller, training, graph, mask, leaves) -> results, residuals[, rng],
  key`` runs ``Caller.prepare`` and ``Entry.forward``;
* ``flaxtorch::backward(caller, key, saved, cotangents) -> gradient buffers`` runs
  ``Entry.backward``, and the traced autograd formula hands out ``Entry.gradients``;
* the last output of the forward op is an empty ``(0, key)`` tensor: its static shape
  tells the traced code which entry it called, so what it needs at trace time (how many
  outputs, their structure, what is written back: ``_facts``) is looked up from a value
  the op returned, not from state left behind by an earlier Dynamo callback.

Ops carry only ints, strings and tensors: a caller is named by its ``compile_id``
(``_call.CALLERS`` holds callers weakly, so nothing here outlives a module), an entry by
its key, the mode by ``training`` and the NNX ``graph`` (-1 for Linen). ``register_fake``
builds the entry from the fake tensors' metadata (shapes are specialized: JAX compiles per
shape anyway). RNG keys are drawn inside the op, from torch's generator, only when the
programs read them, and returned as one more output so that the backward can save them.
"""

from __future__ import annotations

import jax
import torch

import bridge
from flaxside.internal import ARRAY, WriteBack
from torchside._call import CALLERS
from torchside._entry import save_for_backward

jtu = jax.tree_util


def _caller(caller_id: int):
    caller = CALLERS.get(caller_id)
    if caller is None:
        raise RuntimeError(
            "flaxtorch: a compiled graph refers to a FlaxModule that no longer exists. "
            "Compile the module you call (torch.compile(model)) rather than reusing a graph."
        )
    return caller


def _mode(training: int, graph: int):
    return bool(training) if graph < 0 else (bool(training), graph)


def _positional(n: int):
    return jtu.tree_structure((tuple(range(n)), {}))


def _split(caller, mask: str, leaves):
    """``(variables, arguments, argument grads, variable grads)`` of an op's leaves."""
    n_vars = len(caller.settings.var_names)
    grads = tuple(m == "1" for m in mask)
    return leaves[:n_vars], leaves[n_vars:], grads[n_vars:], grads[:n_vars]


def _entry(caller_id: int, training: int, graph: int, mask: str, metas):
    """The entry of a call from its leaves' ``(shape, dtype, device)`` (the fake's)."""
    caller = _caller(caller_id)
    variables, args, grads, var_grads = _split(caller, mask, [_Meta(*m) for m in metas])
    sig = caller.signature(variables, args, _positional(len(args)), (ARRAY,) * len(args),
                           _mode(training, graph), grads, var_grads,
                           bridge.internal.exchange_for(metas[0][2] if metas
                                                        else torch.device("cpu")),
                           cached=False)
    return caller, caller.lookup(sig, [None] * len(args), remember=True)


class _Meta:
    """A tensor's metadata standing in for it where a signature is made."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device


def _metas(leaves) -> tuple:
    return tuple((tuple(int(d) for d in t.shape), t.dtype, t.device) for t in leaves)


@torch._dynamo.assume_constant_result
def _facts(caller_id: int, key: int) -> tuple:
    """``(outputs, output recipe, write-back targets, graph after)`` of entry ``key``."""
    entry = _caller(caller_id).entry(key)
    return (entry.n_out, _recipe(entry.out_treedef), entry.write_back.targets,
            entry.write_back.graph)


def _key_marker(entry) -> torch.Tensor:
    """An empty tensor whose shape carries the entry's key into the traced code."""
    return torch.empty((0, entry.key))


def _recipe(treedef):
    probe = jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    if isinstance(probe, int):
        return ("one",)
    if isinstance(probe, tuple | list) and all(isinstance(x, int) for x in probe):
        return ("tuple" if isinstance(probe, tuple) else "list", len(probe))
    if isinstance(probe, dict) and all(isinstance(x, int) for x in probe.values()):
        return ("dict", tuple(probe))
    raise TypeError(
        f"FlaxModule under torch.compile: the module returns {treedef}; the compiled path "
        f"supports one array, or a flat tuple, list or dict of arrays. Return one of those, "
        f"or call the module outside torch.compile."
    )


def _rebuild(recipe, outs):
    """The module's output structure from a flat list (traceable by Dynamo)."""
    if recipe[0] == "one":
        return outs[0]
    if recipe[0] == "tuple":
        return tuple(outs)
    if recipe[0] == "list":
        return list(outs)
    return dict(zip(recipe[1], outs, strict=True))


def _with_rng(entry, leaves, rng) -> list:
    """The entry's leaves: the op's, with the RNG leaf (if any) after the variables."""
    if rng is None:
        return list(leaves)
    return [*leaves[: entry.n_vars], rng, *leaves[entry.n_vars :]]


@torch.library.custom_op("flaxtorch::forward", mutates_args=())
def forward_op(caller_id: int, training: int, graph: int, mask: str,
               leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Steps 2 and 4 of NOTE [Call path]: results, residuals, and the drawn RNG leaf."""
    caller = _caller(caller_id)
    variables, args, grads, var_grads = _split(caller, mask, leaves)
    entry, state_arrays, full = caller.prepare(
        variables, args, _positional(len(args)), (ARRAY,) * len(args), [None] * len(args),
        _mode(training, graph), grads, var_grads, remember=True)
    results, residuals, _, _ = entry.forward(state_arrays, full)
    # The RNG leaf as a fresh tensor: an op may not return one of its inputs or a tensor it
    # returned before.
    rng = [full[entry.n_vars].clone()] if entry.n_state > entry.n_vars else []
    return [*results, *residuals, *rng, _key_marker(entry)]


@forward_op.register_fake
def _forward_fake(caller_id, training, graph, mask, leaves):
    caller, entry = _entry(caller_id, training, graph, mask, _metas(leaves))
    program = entry.program
    specs = list(program.out_specs)
    if entry.grad_slots and not entry.recompute:
        specs += program.residual_map().residual_specs
    out = [torch.empty(s.shape, dtype=bridge.torch_dtype(s.dtype), device=entry.device)
           for s in specs]
    if entry.n_state > entry.n_vars:
        out.append(torch.empty(caller.settings.rng_shape, dtype=torch.int32,
                               device=entry.device))
    return [*out, _key_marker(entry)]


@torch.library.custom_op("flaxtorch::backward", mutates_args=())
def backward_op(caller_id: int, key: int, saved: list[torch.Tensor],
                cots: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``Entry.backward``: the gradient buffers.

    Their views are taken in traced code (``Entry.gradients``), since an op's outputs may
    not alias one another.
    """
    caller = _caller(caller_id)
    return caller.entry(key).backward(caller.held, saved, None, cots)[0]


@backward_op.register_fake
def _backward_fake(caller_id, key, saved, cots):
    entry = _caller(caller_id).entry(key)
    return [torch.empty(s.shape, dtype=bridge.torch_dtype(s.dtype), device=entry.device)
            for s in entry.program.grad_specs]


def _setup_context(ctx, inputs, output):
    caller_id, _, _, _, leaves = inputs
    entry = _caller(caller_id).entry(int(output[-1].shape[1]))
    output = output[:-1]
    rng = output[-1] if entry.n_state > entry.n_vars else None
    output = output[:-1] if rng is not None else output
    results, residuals = output[: entry.n_results], output[entry.n_results :]
    ctx.mark_non_differentiable(*(results[k] for k in entry.nondiff_out), *residuals,
                                *([] if rng is None else [rng]))
    save_for_backward(ctx, entry, _with_rng(entry, leaves, rng), results, residuals)
    ctx.caller_id, ctx.key, ctx.rng = caller_id, entry.key, rng is not None


def _backward(ctx, grads):
    entry = _caller(ctx.caller_id).entry(ctx.key)
    cots = [grads[k] for k in entry.diff_out_index]
    buffers = backward_op(ctx.caller_id, ctx.key, list(ctx.saved_tensors),
                          [None if g is None else g.contiguous() for g in cots])
    grads = entry.gradients(buffers, cots)
    if ctx.rng:  # the op's leaves have no RNG leaf
        del grads[entry.n_vars]
    return None, None, None, None, grads


forward_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_call(caller, variables, args, kwargs, mode, write_back):
    """A call as Dynamo traces it: the custom ops in place of step 3 (NOTE [Call path]).

    Steps 1 and 5 happen here, in traced code: positional tensors only (no pytrees), and
    the owner's ``write_back`` with the updates the op returned.
    """
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError(
            f"{caller.where} under torch.compile takes tensors as positional arguments only "
            f"(got {len(args)} positional, {len(kwargs)} keyword). Pass static values "
            f"through the Flax module's attributes, or call it outside torch.compile."
        )
    leaves = list(variables) + list(args)
    grad = torch.is_grad_enabled()
    mask = "".join(
        "1" if grad and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
        else "0"
        for t in leaves
    )
    training, graph = mode if isinstance(mode, tuple) else (mode, -1)
    results = forward_op(caller.compile_id, int(training), graph, mask, leaves)
    n_out, recipe, targets, graph_after = _facts(caller.compile_id, results[-1].shape[1])
    if targets or graph_after is not None:
        write_back(WriteBack(targets, graph_after), results[n_out : n_out + len(targets)])
    return _rebuild(recipe, results[:n_out])
