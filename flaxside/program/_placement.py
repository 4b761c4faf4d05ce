"""Where a ``Program`` runs, given as a value (NOTE [Placement]).

NOTE [Placement]. A ``Program`` (``_program.py``) is given its placement as a value and
asks it everything that depends on where the arrays live; the traced bodies are the same
for both. Every array that crosses a program's boundary (an argument, a result, a
residual, a gradient) is described by its *traced* spec (the shape the bodies see) and
its sharding; what the caller passes or receives is the *local* spec, the shard this
process holds (``local_spec``):

* ``OnDevice(device)``: everything on one device (``None``: JAX's default placement).
  Local and traced specs are the same; small arrays cross packed, one buffer per dtype
  (``_pack.py``); an executable is the compiled program itself.
* ``OnMesh(mesh, batch_axes, specs, batch)``: an SPMD program over a mesh of processes of
  one or more axes, one device each (NOTE [SPMD programs] in ``mesh/_on_mesh.py``). Traced
  specs are global; each process passes its local shards and receives its own.

A ``Program`` imports only this file and ``OnDevice`` (``_one_device.py``); ``OnMesh``
(``flaxside/mesh/``) is handed in by its caller.
"""

from __future__ import annotations

import dataclasses

import jax

from flaxside.program._specs import LeafSpec


def local_spec(traced: LeafSpec, sharding) -> LeafSpec:
    """What one process holds of an array of spec ``traced`` placed by ``sharding``."""
    if sharding is None:
        return traced
    return dataclasses.replace(traced, shape=tuple(sharding.shard_shape(traced.shape)))


def placed(traced: LeafSpec, sharding) -> jax.ShapeDtypeStruct:
    """The abstract value a program is lowered with (unplaced where ``sharding`` is None)."""
    return jax.ShapeDtypeStruct(traced.shape, traced.dtype, sharding=sharding)
