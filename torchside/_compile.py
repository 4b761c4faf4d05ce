"""The torch.compile path: the bridge call as torch.library custom ops.

Dynamo cannot trace JAX, so under ``torch.compile`` a ``FlaxModule`` call becomes two
custom ops that Dynamo treats as opaque (the PyTorch docs' way to wrap a foreign library):

* ``flaxtorch::forward(spec, leaves) -> outputs + aux (+ residuals when grad is needed)``
* ``flaxtorch::backward(entry, saved, cotangents) -> gradients of the differentiated leaves``

``register_fake`` derives output shapes and dtypes from the same compiled ``Program`` the
eager path uses (built from the fake tensors' metadata with ``jax.make_jaxpr``), and
``register_autograd`` saves exactly what the eager ``BridgeFunction`` saves. A *spec*
fixes everything Dynamo sees as constant (module, train mode, which leaves need grad);
shapes select the compiled program at run time. Shapes are specialized: JAX compiles per
shape anyway.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import jax
import torch

import bridge
from flaxside import ARRAY

jtu = jax.tree_util

_MODULES: dict[int, weakref.ref] = {}
_SPECS: dict[int, _Spec] = {}
_ENTRIES: dict[int, object] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register_module(module) -> int:
    """A process-unique id for a FlaxModule, valid as a constant in compiled graphs."""
    bid = next(_ids)
    _MODULES[bid] = weakref.ref(module)
    return bid


class _Spec:
    """What is constant for one compiled call site: module, mode, arity, grad mask."""

    def __init__(self, module, training: bool, n_args: int, mask: str):
        self.module = weakref.ref(module)
        self.training = training
        self.mask = [c == "1" for c in mask]
        self.n_args = n_args
        self.treedef = jtu.tree_structure((tuple(range(n_args)), {}))
        self.static_key = (ARRAY,) * n_args
        self.entries: dict[tuple, object] = {}
        self.last = None

    def entry(self, leaves):
        key = tuple((tuple(int(d) for d in t.shape), t.dtype, t.device) for t in leaves)
        entry = self.entries.get(key)
        if entry is None:
            module = self.module()
            entry = module._caller.build_entry(
                leaves, self.mask, module._state_treedef, module._leaf_names,
                len(leaves) - self.n_args, self.treedef, self.static_key, self.training,
            )
            entry.compile_id = next(_ids)
            with _lock:
                self.entries[key] = entry
                _ENTRIES[entry.compile_id] = entry
        self.last = entry
        return entry


@torch._dynamo.assume_constant_result
def spec_id(bridge_id: int, training: bool, n_args: int, mask: str) -> int:
    """The id of a call spec, created on first use (runs at trace time only)."""
    key = (bridge_id, training, n_args, mask)
    with _lock:
        for sid, spec in _SPECS.items():
            if spec.key == key:
                return sid
        sid = next(_ids)
        spec = _Spec(_MODULES[bridge_id](), training, n_args, mask)
        spec.key = key
        _SPECS[sid] = spec
    return sid


@torch._dynamo.assume_constant_result
def layout(sid: int) -> tuple:
    """``(n_out, n_aux, output recipe, aux targets)`` of the spec's last traced call."""
    entry = _SPECS[sid].last
    treedef = entry.program.out_treedef
    n_aux = entry.n_results - entry.n_out
    return entry.n_out, n_aux, _recipe(treedef), entry.aux_targets


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


def rebuild(recipe, outs):
    """The module's output structure from a flat list (traceable by Dynamo)."""
    if recipe[0] == "one":
        return outs[0]
    if recipe[0] == "tuple":
        return tuple(outs)
    if recipe[0] == "list":
        return list(outs)
    return dict(zip(recipe[1], outs, strict=True))


@torch.library.custom_op("flaxtorch::forward", mutates_args=())
def forward_op(sid: int, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs the compiled forward (with residuals when a gradient is needed)."""
    entry = _SPECS[sid].entry(leaves)
    if not entry.program.diff_index:
        return entry.run(leaves)
    return entry.forward(leaves)


@forward_op.register_fake
def _forward_fake(sid, leaves):
    entry = _SPECS[sid].entry(leaves)
    program = entry.program
    specs = list(program.out_specs)
    if program.diff_index and not entry.recompute:
        if not entry.traced:
            jax.eval_shape(program._forward_res, [s.aval for s in program.specs])
            entry.finish_trace()
        specs += list(program.residual_specs)
    return [torch.empty(s.shape, dtype=bridge.torch_dtype(s.dtype), device=entry.device)
            for s in specs]


@torch.library.custom_op("flaxtorch::backward", mutates_args=())
def backward_op(eid: int, saved: list[torch.Tensor], cots: list[torch.Tensor]) \
        -> list[torch.Tensor]:
    """Runs the compiled backward for the entry ``eid``."""
    return _ENTRIES[eid].backward(saved, cots)


@backward_op.register_fake
def _backward_fake(eid, saved, cots):
    entry = _ENTRIES[eid]
    return [torch.empty(entry.program.specs[i].shape,
                        dtype=bridge.torch_dtype(entry.program.specs[i].dtype), device=entry.device)
            for i in entry.program.diff_index]


def _setup_context(ctx, inputs, output):
    sid, leaves = inputs
    entry = _SPECS[sid].entry(leaves)
    n = entry.n_results
    outs, res = output[:n], output[n:]
    ctx.mark_non_differentiable(*(outs[k] for k in entry.nondiff_out), *res)
    ctx.save_for_backward(*entry.to_save(leaves, outs, res))
    ctx.eid = entry.compile_id
    ctx.n_leaves = len(leaves)


def _backward(ctx, grads):
    entry = _ENTRIES[ctx.eid]
    program = entry.program
    cots = [entry.zeros(k) if grads[k] is None else grads[k].contiguous()
            for k in program.diff_out_index]
    computed = backward_op(ctx.eid, list(ctx.saved_tensors), cots)
    result = [None] * ctx.n_leaves
    for i, g in zip(program.diff_index, computed, strict=True):
        result[i] = g
    return None, result


forward_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_call(module, args, kwargs):
    """``FlaxModule.forward`` as Dynamo traces it: tensors in, the custom op, tensors out."""
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError(
            f"{module._caller.where} under torch.compile takes tensors as positional "
            f"arguments only (got {len(args)} positional, {len(kwargs)} keyword). Pass static "
            f"values through the Flax module's attributes, or call it outside torch.compile."
        )
    leaves = module._call_variables() + list(args)
    grad = torch.is_grad_enabled()
    mask = "".join(
        "1" if grad and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
        else "0"
        for t in leaves
    )
    sid = spec_id(module._bridge_id, module.training, len(args), mask)
    results = forward_op(sid, leaves)
    n_out, n_aux, recipe, targets = layout(sid)
    if n_aux:
        with torch.no_grad():
            for i, new in zip(targets, results[n_out : n_out + n_aux], strict=True):
                leaves[i].copy_(new)
    return rebuild(recipe, results[:n_out])
