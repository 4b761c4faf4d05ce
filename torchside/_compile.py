"""The torch.compile path: a FlaxModule call as two torch.library custom ops.

Dynamo cannot trace JAX, so under ``torch.compile`` a call becomes two ops Dynamo treats as
opaque (the PyTorch docs' way to wrap a foreign library):

* ``flaxtorch::call(caller, mode, mask, leaves) -> results (+ residuals) (+ rng key data)``
* ``flaxtorch::backward(caller, call, saved, cotangents) -> gradients``

Both go through the module's ``Caller``: the same signatures, the same LRU cache and held
arrays as eager calls, and the same ``save_for_backward`` / ``scatter_grads`` as
``BridgeFunction`` (NOTE [Call path] in ``_caller.py``). Ops can carry only ints and strings:
a caller is named by its ``compile_id`` (``_caller.CALLERS`` holds callers weakly, so nothing
here outlives a module), a compiled call by its key. ``register_fake`` builds the call from
the fake tensors' metadata (shapes are specialized: JAX compiles per shape anyway); the
output structure is read after it, from the call it built (``_layout``). RNG keys are
drawn inside the op, from torch's generator, only when the program reads them, and
returned as one more output so that the backward can save them.
"""

from __future__ import annotations

import jax
import torch

import bridge
from torchside._call import save_for_backward, scatter_grads
from torchside._caller import CALLERS

jtu = jax.tree_util


def _caller(caller_id: int):
    caller = CALLERS.get(caller_id)
    if caller is None:
        raise RuntimeError(
            "flaxtorch: a compiled graph refers to a FlaxModule that no longer exists. "
            "Compile the module you call (torch.compile(model)) rather than reusing a graph."
        )
    return caller


def _call_for(caller_id: int, mode_id: int, mask: str, leaves):
    """The caller and compiled call for the op's leaves (variables, then arguments)."""
    caller = _caller(caller_id)
    metas = tuple((tuple(int(d) for d in t.shape), t.dtype, t.device) for t in leaves)
    sig = caller.signature_of(metas, caller.mode_of(mode_id), mask)
    call = caller.lookup(sig, [None] * len(sig.statics), remember=True)
    caller.traced[(mode_id, mask)] = call.key
    return caller, call


@torch._dynamo.assume_constant_result
def _mode_id(caller_id: int, training: bool, graph: int) -> int:
    """The caller's number for a mode (``graph``: the NNX graph id, -1 for Linen)."""
    return _caller(caller_id).mode_id(training if graph < 0 else (training, graph))


@torch._dynamo.assume_constant_result
def _layout(caller_id: int, mode_id: int, mask: str) -> tuple:
    """``(outputs, output recipe, write-back targets, graph after)`` of the call just traced.

    Runs at trace time, after the op's fake implementation built (or found) that call.
    """
    caller = _caller(caller_id)
    call = caller.compiled(caller.traced[(mode_id, mask)])
    return (call.n_out, _recipe(call.program.out_treedef), call.write_back.targets,
            call.write_back.graph)


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


def _full(call, leaves, rng) -> list:
    """The call's leaves: the op's, with the rng leaf (if any) after the variables."""
    if rng is None:
        return list(leaves)
    return [*leaves[: call.n_vars], rng, *leaves[call.n_vars :]]


@torch.library.custom_op("flaxtorch::call", mutates_args=())
def call_op(caller_id: int, mode_id: int, mask: str, leaves: list[torch.Tensor]) \
        -> list[torch.Tensor]:
    """Runs the compiled forward (with residuals when a gradient is needed)."""
    caller, call = _call_for(caller_id, mode_id, mask, leaves)
    shape = caller.owner.rng_shape
    rng = None if shape is None else call.rng(shape)
    head, _ = caller.held.arrays(leaves[: call.n_vars], call.exchange,
                                 [m == "1" for m in mask[: call.n_vars]])
    if rng is not None:
        head.append(call.exchange.view(rng))
    full = _full(call, leaves, rng)
    if not call.grad_slots:
        out = call.run(head, full)
    else:
        results, residuals, _ = call.forward(head, full)
        out = results + residuals
    # A fresh tensor: an op may not return one of its inputs or a tensor it returned before.
    return out if rng is None else [*out, rng.clone()]


@call_op.register_fake
def _call_fake(caller_id, mode_id, mask, leaves):
    caller, call = _call_for(caller_id, mode_id, mask, leaves)
    program = call.program
    specs = [(s.shape, bridge.torch_dtype(s.dtype)) for s in program.out_specs]
    if call.grad_slots and not call.recompute:
        specs += [(s.shape, bridge.torch_dtype(s.dtype))
                  for s in program.residual_map().residual_specs]
    if caller.owner.rng_shape is not None:
        specs.append((caller.owner.rng_shape, torch.int32))
    return [torch.empty(shape, dtype=dtype, device=call.device) for shape, dtype in specs]


@torch.library.custom_op("flaxtorch::backward", mutates_args=())
def backward_op(caller_id: int, key: int, saved: list[torch.Tensor],
                cots: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Runs the compiled backward of the call numbered ``key``: gradient buffers.

    Small gradients come back packed (``Program.grad_pack``); ``_backward`` takes views of
    them in traced code, since an op's outputs may not alias one another.
    """
    return _caller(caller_id).compiled(key).backward(saved, None, cots)


@backward_op.register_fake
def _backward_fake(caller_id, key, saved, cots):
    call = _caller(caller_id).compiled(key)
    return [torch.empty(s.shape, dtype=bridge.torch_dtype(s.dtype), device=call.device)
            for s in call.program.grad_specs]


def _setup_context(ctx, inputs, output):
    caller_id, mode_id, mask, leaves = inputs
    caller, call = _call_for(caller_id, mode_id, mask, leaves)
    rng = output[-1] if caller.owner.rng_shape is not None else None
    output = output[:-1] if rng is not None else output
    results, residuals = output[: call.n_results], output[call.n_results :]
    ctx.mark_non_differentiable(*(results[k] for k in call.nondiff_out), *residuals,
                                *([] if rng is None else [rng]))
    save_for_backward(ctx, call, _full(call, leaves, rng), results, residuals)
    ctx.caller_id, ctx.key, ctx.rng = caller_id, call.key, rng is not None


def _backward(ctx, grads):
    call = _caller(ctx.caller_id).compiled(ctx.key)
    cots = [grads[k] for k in call.program.diff_out_index]
    computed = backward_op(ctx.caller_id, ctx.key, list(ctx.saved_tensors),
                           [None if g is None else g.contiguous() for g in cots])
    grads = scatter_grads(call, call.unpack_grads(computed), cots)
    if ctx.rng:  # the op's leaves have no rng leaf
        del grads[call.n_vars]
    return None, None, None, grads


call_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_call(module, args, kwargs):
    """``FlaxModule.forward`` as Dynamo traces it: tensors in, the custom ops, tensors out."""
    caller = module._caller
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError(
            f"{caller.where} under torch.compile takes tensors as positional arguments only "
            f"(got {len(args)} positional, {len(kwargs)} keyword). Pass static values "
            f"through the Flax module's attributes, or call it outside torch.compile."
        )
    variables = module._variables()
    leaves = list(variables) + list(args)
    grad = torch.is_grad_enabled()
    mask = "".join(
        "1" if grad and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
        else "0"
        for t in leaves
    )
    mode_id = _mode_id(caller.compile_id, module.training, module._graph if module._nnx else -1)
    results = call_op(caller.compile_id, mode_id, mask, leaves)
    n_out, recipe, targets, graph = _layout(caller.compile_id, mode_id, mask)
    if targets:
        with torch.no_grad():
            for i, new in zip(targets, results[n_out : n_out + len(targets)], strict=True):
                variables[i].copy_(new)
    if graph is not None and graph != module._graph:
        module._graph = graph
    return _rebuild(recipe, results[:n_out])
