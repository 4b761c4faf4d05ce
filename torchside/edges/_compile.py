"""The torch.compile edge: an owner's call as two torch.library custom ops.

Dynamo cannot trace JAX, so under ``torch.compile`` step 3 of NOTE [Call path]
(``call/_call.py``) is two ops Dynamo treats as opaque (the PyTorch docs' way to wrap a foreign
library); every other step is the eager one, through the same functions:

* step 1, ``resolve``, runs in traced code before ``compiled_call`` (autocast included);
* ``flaxtorch::forward(caller, training, graph, mask, leaves) -> results, buffers[, rng],
  key`` runs ``Caller.prepare`` (step 2) and ``Entry.forward`` (step 4) on the entry's
  ``COMPILED`` route;
* ``flaxtorch::backward(caller, key, saved, cotangents) -> gradient buffers`` runs
  ``Entry.backward``; the traced autograd formula hands out ``Entry.gradients``;
* step 5, ``apply_write_back``, runs in traced code after the forward op.

The last output of the forward op is an empty ``(0, key)`` tensor: its static shape tells
the traced code which entry it called, so what it needs at trace time (how many outputs,
their structure, what is written back: ``_facts``) is looked up from a value the op
returned, not from state left behind by an earlier Dynamo callback. ``OpOutputs`` names
the parts of the op's outputs.

Ops carry only ints, strings and tensors: a caller is named by its ``compile_id``
(``CALLERS`` in ``call/_call.py`` holds callers weakly, so nothing here outlives its owner), an
entry by its key, the owner's mode by ``training`` (-1:
none) and the NNX graph's ``key`` (-1: none). ``register_fake`` builds the entry from the
fake tensors' metadata (shapes are specialized: JAX compiles per shape anyway). RNG keys
are drawn inside the op, from torch's generator, only when the programs read them, and
returned as one more output so that the backward can save them.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import torch

import bridge
from bridge.internal import stored_array
from flaxside.internal import ARRAY, Graph
from torchside import _errors
from torchside.call._call import CALLERS
from torchside.call._eager import save
from torchside.call._entry import Reusable
from torchside.call._resolve import lead_device
from torchside.call._routes import COMPILED, FAKE
from torchside.call._values import Call, TensorMeta, positional

jtu = jax.tree_util

def caller_of(caller_id: int):
    """The ``Caller`` an op names by its ``compile_id``."""
    caller = CALLERS.get(caller_id)
    if caller is None:
        raise _errors.owner_gone()
    return caller


def _decode_mode(training: int, graph: int):
    if graph >= 0:
        return bool(training), Graph.find(graph)
    return None if training < 0 else bool(training)


def _op_call(caller, training: int, graph: int, mask: str, leaves) -> tuple[Call, tuple, tuple]:
    """``(call, argument grads, variable grads)`` of an op's leaves (tensors or metas)."""
    variables, tensors = caller.settings.split_leaves(leaves)
    var_grads, grads = caller.settings.split_leaves([m == "1" for m in mask])
    n = len(tensors)
    call = Call(variables, tensors, positional(n), (ARRAY,) * n, [None] * n,
                _decode_mode(training, graph), lead_device(variables, tensors), None)
    return call, tuple(grads), tuple(var_grads)


class OpOutputs(NamedTuple):
    """The forward op's outputs, by part: ``results | buffers | rng? | key marker``."""

    results: list
    buffers: list
    rng: torch.Tensor | None

    @classmethod
    def of(cls, entry, outputs) -> OpOutputs:
        """The parts of ``outputs`` (the key marker, the last, already read)."""
        n, end = entry.n_results, len(outputs) - 1
        rng = None
        if entry.layout.rng is not None:
            end, rng = end - 1, outputs[end - 1]
        return cls(list(outputs[:n]), list(outputs[n:end]), rng)


def _key_marker(entry) -> torch.Tensor:
    """An empty tensor whose shape carries the entry's key into the traced code."""
    return torch.empty((0, entry.key))


@torch.library.custom_op("flaxtorch::forward", mutates_args=())
def forward_op(caller_id: int, training: int, graph: int, mask: str,
               leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Steps 2 and 4 of NOTE [Call path]: results, residuals, and the drawn RNG leaf."""
    caller = caller_of(caller_id)
    call, grads, var_grads = _op_call(caller, training, graph, mask, leaves)
    entry, state_arrays, full = caller.prepare(call, grads, var_grads, COMPILED)
    fwd = entry.forward(state_arrays, full, entry.routes[COMPILED])
    entry.exchange.wait(fwd.pending)
    # The RNG slot as a fresh tensor: an op may not return one of its inputs or a tensor it
    # returned before.
    rng = [] if entry.layout.rng is None else [full[entry.layout.rng].clone()]
    return [*fwd.results, *fwd.buffers, *rng, _key_marker(entry)]


@forward_op.register_fake
def _forward_fake(caller_id, training, graph, mask, leaves):
    caller = caller_of(caller_id)
    metas = [TensorMeta(tuple(int(d) for d in t.shape), t.dtype, t.device) for t in leaves]
    call, grads, var_grads = _op_call(caller, training, graph, mask, metas)
    entry = caller.prepare(call, grads, var_grads, FAKE)[0]
    holds = entry.holding(entry.routes[COMPILED])
    device = entry.exchange.torch_device
    out = [torch.empty(s.shape, dtype=bridge.torch_dtype(s.dtype), device=device)
           for s in (*entry.program.out_specs, *holds.buffers)]
    if entry.layout.rng is not None:
        out.append(torch.empty(caller.settings.rng_shape, dtype=torch.int32, device=device))
    return [*out, _key_marker(entry)]


@torch.library.custom_op("flaxtorch::backward", mutates_args=())
def backward_op(caller_id: int, key: int, saved: list[torch.Tensor],
                cots: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``Entry.backward``: the gradient buffers.

    Their views are taken in traced code (``Entry.gradients``), since an op's outputs may
    not alias one another.
    """
    caller = caller_of(caller_id)
    entry = caller.entry(key)
    route = entry.routes[COMPILED]
    reuse = _reuse(entry, route, saved)
    buffers, pending = entry.backward(caller.held, route, saved, reuse, cots)
    entry.exchange.wait(pending)
    return buffers


@backward_op.register_fake
def _backward_fake(caller_id, key, saved, cots):
    entry = caller_of(caller_id).entry(key)
    return [torch.empty(s.shape, dtype=bridge.torch_dtype(s.dtype),
                        device=entry.exchange.torch_device) for s in entry.program.grad_specs]


def _setup_context(ctx, inputs, output):
    caller_id, _, _, _, leaves = inputs
    caller = caller_of(caller_id)
    entry = caller.entry(int(output[-1].shape[1]))
    out = OpOutputs.of(entry, output)
    ctx.mark_non_differentiable(*(out.results[k] for k in entry.nondiff_out), *out.buffers,
                                *([] if out.rng is None else [out.rng]))
    variables, arguments = caller.settings.split_leaves(leaves)
    full = entry.layout.of_leaves(variables, out.rng, arguments)
    save(ctx, entry.holding(entry.routes[COMPILED]), full, out.results, out.buffers)
    ctx.caller_id, ctx.key = caller_id, entry.key


def _backward(ctx, grads):
    entry = caller_of(ctx.caller_id).entry(ctx.key)
    cots = [grads[k] for k in entry.diff_out_index]
    buffers = backward_op(ctx.caller_id, ctx.key, list(ctx.saved_tensors),
                          [None if g is None else g.contiguous() for g in cots])
    # The op's leaves have no RNG slot.
    return None, None, None, None, entry.layout.without_rng(entry.gradients(buffers, cots))


forward_op.register_autograd(_backward, setup_context=_setup_context)


def _reuse(entry, route, saved) -> tuple | None:
    """``Entry.saved_arrays``' ``reuse`` for ``backward_op`` (``None`` on the CPU route).

    The arrays the forward op's results own (``bridge.internal.own_arrays``): a compiled
    graph hands the backward op its saved tensors and nothing else of the call.
    """
    if not entry.exchange.dlpack:
        return None
    holds = entry.holding(route)
    skip = (False,) * len(holds.outputs) + holds.offloaded  # as ``Entry.forward``'s
    out = []
    for t, off in zip(saved[holds.bounds[0]:], skip, strict=True):
        array = None if off else stored_array(t)
        out.append(None if array is None else
                   Reusable(weakref.ref(array), array.unsafe_buffer_pointer()))
    return tuple(out)
