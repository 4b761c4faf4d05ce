"""One device as a ``Program``'s placement (NOTE [Placement] in ``_placement.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from jax.sharding import SingleDeviceSharding

from flaxside.program._compiling_for import compiling_for
from flaxside.program._pack import PACK_BYTES, pack_plan
from flaxside.program._specs import LeafSpec


class OnDevice:
    """One device: every argument placed there, every result coming back there.

    Args:
        device: the JAX device; ``None`` leaves placement to JAX (its default device), as a
            plain ``jax.jit`` would.
        pack_bytes: residuals and gradients up to this many bytes leave a program packed,
            one buffer per dtype; ``None``: all of them (``pack_plan``'s ``limit``).
    """

    __slots__ = ("device", "pack_bytes")

    def __init__(self, device=None, pack_bytes: int | None = PACK_BYTES):
        self.device = device
        self.pack_bytes = pack_bytes

    def __repr__(self):
        return f"OnDevice({self.device}, pack_bytes={self.pack_bytes})"

    def compiling(self):
        """Traces and lowerings inside it are for this device (``_compiling_for.py``)."""
        return compiling_for(self.device)

    def tracing(self, leaves, unreduced=None):
        """While the program's function is traced: the leaves it is called on, as given."""
        return contextlib.nullcontext(leaves)

    def call(self, fn: Callable, read: list):
        """``fn(read)`` inside ``tracing`` (``OnMesh.call`` moves a stock scan's gathers)."""
        return fn(read)

    def check_reduced(self, jaxpr, unreduced: list, wanted: list) -> None:
        """Nothing to check: no leaf is summed over ranks (``OnMesh.check_reduced``)."""

    def leaf_specs(self, n: int) -> tuple:
        """Per leaf, its ``PartitionSpec`` over a mesh: none here."""
        return (None,) * n

    def traced(self, local: LeafSpec, spec) -> LeafSpec:
        """The spec the bodies trace for an argument of spec ``local``: the same."""
        return local

    def sharding(self, spec=None):
        """Where an array lives: the device (``None``: JAX decides)."""
        return None if self.device is None else SingleDeviceSharding(self.device)

    def result_specs(self, traced_out, n_out: int, traced_specs) -> tuple:
        """Per result, its ``PartitionSpec`` over a mesh: none here."""
        return (None,) * len(traced_out)

    def pack_plan(self, avals, alone=None):
        """Arrays up to ``pack_bytes`` cross packed, one buffer per dtype (``_pack.py``)."""
        return pack_plan(avals, alone, self.pack_bytes)

    def constrain(self, x, sharding):
        """``x`` as a traced result leaves the program: as it is."""
        return x

    def pull(self, pull: Callable, cotangents, sharded_outputs, index) -> list:
        """The gradients for ``cotangents`` (``pull``: the VJP in torch's convention)."""
        return pull(cotangents)

    def residual_shardings(self, compiled, n_results: int, count: int) -> list:
        """Where the forward's residuals live: the device."""
        return [self.sharding()] * count

    def executable(self, compiled, in_avals) -> Callable[..., list]:
        """What the torch side calls: the compiled program itself, no wrapper."""
        return compiled
