"""Building one signature's entry, on a cache miss (never on the per-call path).

``build`` makes the ``Entry`` (NOTE [Call path] in ``_call.py``) and the values it keeps:
its ``Layout``, its ``Route`` per edge, how its gradients are viewed (``_routes.py``). The
checks it runs are in ``_checks.py``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import jax
import numpy as np
import torch

import bridge.internal as bi
from flaxside.internal import (
    ARRAY,
    Alone,
    LeafSpec,
    OnDevice,
    Program,
    flat_apply,
    is_differentiable,
)
from torchside.call import _checks
from torchside.call._entry import Entry
from torchside.call._routes import (
    ALL_EDGES,
    FUSED,
    PLAIN,
    RECOMPUTE,
    RESIDUALS,
    Edge,
    GradientViews,
    Layout,
    Route,
)
from torchside.call._values import TensorMeta, arg_names

jtu = jax.tree_util


def build(settings, sig, values, monitor, plan, residuals: str, key: int) -> Entry:
    """Compiles the programs for one signature; returns its ``Entry``.

    Reads only the signature (shapes, dtypes, devices, grad flags) besides the static
    ``values``, so an entry evicted from the cache can be rebuilt from it.

    Args:
        settings: the owner's ``Settings``.
        sig: the call's ``Signature``.
        values: every leaf of ``(args, kwargs)``; the static ones are baked in.
        monitor: the owner's ``RecompileMonitor``, told about the new signature.
        plan: the owner's ``torchside.integrations._shard.ShardPlan`` when it is sharded: the
            programs are then SPMD over its mesh (NOTE [Sharded blocks]); else ``None``.
        residuals: the owner's boundary mode (``RESIDUAL_MODES``).
        key: the entry's number inside its caller.
    """
    where = settings.where
    device = sig.exchange.torch_device
    arg_slot_names = [n for n, s in zip(arg_names(sig.arg_treedef), sig.statics, strict=True)
                      if s is ARRAY]
    # int64 arguments (token ids, masks) cross as int32 while JAX runs 32-bit, each value
    # checked at every call (bridge.internal.narrow_to_int32); the program sees int32.
    narrowed = [k for k, t in enumerate(sig.tensors) if bi.narrows_to_int32(t.dtype)]
    layout = Layout.of(settings.var_names, None if settings.rng_shape is None else "rngs",
                       arg_slot_names, narrowed)
    metas = layout.of_leaves(
        [TensorMeta(k.shape, k.dtype, k.device) for k in sig.variables.keys],
        TensorMeta(settings.rng_shape, torch.int32, device),
        [TensorMeta(t.shape, torch.int32 if k in narrowed else t.dtype, t.device)
         for k, t in enumerate(sig.tensors)])
    grads = layout.of_leaves([k.needs_grad for k in sig.variables.keys], False,
                             [t.needs_grad for t in sig.tensors])
    try:
        checked, checked_names = layout.without_rng(metas), layout.without_rng(layout.names)
        _checks.check_devices(checked, checked_names, device,
                              None if sig.variables.keys else (checked_names or [None])[0],
                              where)
        var_dtypes, arg_dtypes = settings.split_leaves(
            _checks.numpy_dtypes(checked, checked_names, where))
        dtypes = layout.of_leaves(var_dtypes, np.dtype("int32"), arg_dtypes)
        jax_device = _checks.jax_device_for(device, layout.names[0] if layout.names
                                            else "input", where)
        specs = [LeafSpec(tuple(m.shape), dt, bool(g) and is_differentiable(dt))
                 for m, dt, g in zip(metas, dtypes, grads, strict=True)]
        slots = tuple(ARRAY if s is ARRAY else v
                      for s, v in zip(sig.statics, values, strict=True))
        fn = flat_apply(settings.make_apply(sig.mode), settings.state_treedef, sig.arg_treedef,
                        slots)
        # Where it runs; on one device, what leaves a program packed is the exchange
        # route's choice (NOTE [Packing per route] in bridge/_exchange.py).
        placement = (OnDevice(jax_device, sig.exchange.pack_bytes) if plan is None else
                     plan.placement(layout, [len(t.shape) for t in sig.tensors]))
        program = Program(fn, specs, placement=placement, name=where,
                          fence=sig.exchange.dlpack)
        _checks.check_output_dtypes(program, where)
        _checks.check_updates(program, layout.names, where)
    except Exception as e:
        shapes = ", ".join(f"{n}: {t.dtype}{list(t.shape)}"
                           for n, t in zip(arg_slot_names, sig.tensors, strict=True))
        e.add_note(f"{where} was called with {shapes or 'no tensors'}.")  # type kept
        raise
    _record(monitor, sig, arg_slot_names, values)
    routes = {edge: _route(program, residuals, edge, plan is not None, settings.order)
              for edge in ALL_EDGES}
    return Entry(program, sig.exchange, layout,
                 gradient_views(program.grad_pack, len(specs), program.diff_index),
                 routes, key)


def _route(program: Program, residuals: str, edge: Edge, mesh: bool, order: int) -> Route:
    """The route ``edge`` takes through ``program``'s programs (NOTE [Routes]).

    ``residuals`` is the owner's option, a user's string checked against
    ``RESIDUAL_MODES`` when the owner was made.
    """
    if not program.diff_index or not edge.differentiated:
        programs = PLAIN
    elif residuals == "recompute":
        programs = RECOMPUTE
    elif residuals == "save" and program.scalar_loss and edge.fuses:
        programs = FUSED
    else:
        programs = RESIDUALS
    return Route.of(programs, edge, mesh, order)


def gradient_views(packing, n_leaves: int, diff_index) -> GradientViews:
    """How ``Entry.gradients`` views the gradients out of the backward's buffers.

    A packed buffer of many gradients of few shapes is viewed run by run (an ``unbind``
    per run of one shape); one of mostly distinct shapes at once, by torch's
    ``unflatten_dense_tensors``, one C++ call for the buffer, where runs of one gradient
    would each cost a Python-level view (timed by hand when this was written; no
    committed script re-measures the crossover).
    """
    runs, view_of = [], {}  # view_of: diff position -> index among the runs' gradients
    for p, entry in enumerate(packing):
        if type(entry) is Alone:
            view_of[p] = len(view_of)
            runs.append((entry.buffer, 0, 0, None, 0))
    by_buffer: dict = {}
    for p, entry in enumerate(packing):
        if type(entry) is not Alone:
            by_buffer.setdefault(entry.buffer, []).append((entry.offset, p, tuple(entry.shape)))
    for buffer, items in by_buffer.items():
        items.sort()
        runs_of_buffer = []
        i = 0
        while i < len(items):  # a run: gradients of one shape, side by side
            start, _, shape = items[i]
            size = math.prod(shape)
            j = i + 1
            while j < len(items) and items[j][2] == shape and items[j][0] == start + (j - i) * size:
                j += 1
            runs_of_buffer.append((buffer, start, start + (j - i) * size, shape, j - i))
            i = j
        if 2 * len(runs_of_buffer) > len(items):
            # Mostly one of a shape: one call views them all (torch's C++
            # unflatten_dense_tensors), cheaper here than a view or an unbind per run.
            runs_of_buffer = [(buffer, 0, 0, tuple(torch.empty(shape, device="meta")
                                                   for _, _, shape in items), -1)]
        runs += runs_of_buffer
        for _, p, _ in items:
            view_of[p] = len(view_of)
    position = {slot: p for p, slot in enumerate(diff_index)}
    order = [view_of[position[slot]] if slot in position else len(view_of)
             for slot in range(n_leaves)]
    return GradientViews(tuple(runs), _picker(order))


def _picker(order: list[int]) -> Callable:
    """``parts -> tuple(parts[i] for i in order)``, an ``itemgetter`` (in C) where it can."""
    if len(order) >= 2:
        return operator.itemgetter(*order)
    return lambda parts: tuple(parts[i] for i in order)


def _record(monitor, sig, names, values) -> None:
    """Tells the recompile monitor about a new signature, with readable names."""
    if monitor.done:
        return
    all_names = arg_names(sig.arg_treedef)
    monitor.record(
        sig._replace(exchange=None),
        [(n, tuple(t.shape), t.dtype) for n, t in zip(names, sig.tensors, strict=True)],
        [(n, v) for n, s, v in zip(all_names, sig.statics, values, strict=True) if s is not ARRAY],
        [("the argument structure", sig.arg_treedef),
         ("which arguments require grad", tuple(t.needs_grad for t in sig.tensors)),
         ("which parameters require grad", tuple(k.needs_grad for k in sig.variables.keys)),
         ("parameter dtypes", tuple(str(k.dtype) for k in sig.variables.keys)),
         ("train/eval mode", sig.mode),
         ("jax_enable_x64", sig.x64)],
    )
