"""Owners of programs derived from an entry's (its VJP, its JVP...), made once per entry.

A ``Derived`` owner is a ``jax_function``-like owner of one JAX function derived from an
entry's program; its calls go through a ``Caller`` of their own, with the edges of the
call it derives from, so they too can be compiled, transformed and differentiated again
(NOTE [Higher order] in ``_higher.py``). The owners of an entry are values of the entry
(``Entry.derived``): nothing outlives its owner.
"""

from __future__ import annotations

import jax
import torch

from flaxside.internal import Batched
from torchside.call._call import Caller, function_settings
from torchside.call._owner import CallerOwner
from torchside.call._resolve import resolve
from torchside.call._routes import EAGER


class Derived(CallerOwner):
    """A ``jax_function``-like owner of one program derived from an entry's (its VJP...).

    Args:
        settings: the derived function's ``Settings`` (``function_settings``).
        edges: the edges of the call it derives from, so that it too can be compiled,
            transformed and differentiated again.
    """

    def __init__(self, settings, edges):
        self._caller = Caller(settings, edges, residuals="save", recompile_warning=None)
        self.batch_axes = None  # set by ``derived``

    def __call__(self, *args):
        """Calls the derived function with positional pytrees of tensors, like any owner.

        Outside a transform, tensors a finished transform left wrapped (``torch.func.vjp``'s
        pull runs after its level ended) are unwrapped first, as torch's ``Function.apply``
        does for its own.
        """
        if not torch._C._are_functorch_transforms_active():
            unwrap = torch._C._functorch.unwrap_if_dead
            args = jax.tree_util.tree_map(
                lambda t: unwrap(t) if isinstance(t, torch.Tensor) else t, args)
        caller = self._caller
        return caller(resolve([], args, {}, mode=None, where=caller.where))


def derived(edges, entry, kind: str, make, key=None) -> Derived:
    """The entry's owner of one derived function (``kind``: "vjp", "jvp"), made once.

    ``key``: what else the function depends on (the gradients a VJP returns). The owners
    live as long as the entry (``Entry.derived``: nothing outlives its owner).
    """
    owners = owners_of(entry)
    owner = owners.get((kind, key))
    if owner is None:
        order = entry.routes[EAGER].order + 1
        fn = make(entry.program)
        settings = function_settings(f"{entry.program.name} ({kind})", fn, order)
        owner = owners[kind, key] = Derived(settings, edges)
        # Per result, the axis its batch lies on, where the function says (per-sample
        # gradients stacked by a scan: flaxside's per_sample_axes); None: axis 0 or none.
        owner.batch_axes = fn.batch_axes if isinstance(fn, Batched) else None
    return owner


class CallDerivatives:
    """What the derivatives of one eager call share, on its autograd context.

    ``BridgeFunction`` leaves ``ctx.derivatives = None``; the first derivative of the call
    makes this (``shared_by``), and it lives exactly as long as the call's node: another
    step's call, even on the same tensors, shares nothing with it.

    Attributes:
        given: the ``GivenResiduals`` outputs (NOTE [Given residuals] in ``_given.py``),
            made once, or ``None``.
        linearized: per set of wanted gradients, ``[None]`` until its residuals are
            computed, then ``[(identities, residuals)]`` (NOTE [Shared linearization]).
    """

    __slots__ = ("given", "linearized")

    def __init__(self):
        self.given, self.linearized = None, {}


def shared_by(ctx) -> CallDerivatives:
    """The ``CallDerivatives`` of the eager call whose autograd context is ``ctx``."""
    shared = ctx.derivatives
    if shared is None:
        shared = ctx.derivatives = CallDerivatives()
    return shared


def owners_of(entry) -> dict:
    """``entry``'s derived owners, by kind: a value of the entry, living as long as it."""
    return entry.derived


def derived_owners(entry) -> list[Derived]:
    """The owners derived from ``entry`` so far (for tests and the benchmark)."""
    return [o for o in entry.derived.values() if isinstance(o, Derived)]


def executes(node) -> bool:
    """Whether the running backward executes ``node`` (and so reads the gradient sent to it).

    torch refuses the question for a node ``autograd.grad`` captures its result at (one of
    its ``inputs``): that gradient is read.
    """
    if node is None:
        return True
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True
