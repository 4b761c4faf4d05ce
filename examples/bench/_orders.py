"""Per order, the programs the bridge compiled and the bytes its step holds for backward.

For the benchmark's higher-order rows (``_higher.py``): each derived program is named by
its role (NOTE [Shared linearization]'s split of a VJP, NOTE [Given residuals]' given
apply and transpose) and its kind; every saved tensor by the order of the call saving it.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from torchside.edges._derived import derived_owners

_KIND_ORDER = ("forward_with_residuals", "forward", "backward", "backward_recompute",
               "value_and_grad")
# A derived program's part: NOTE [Shared linearization]'s split of a VJP, NOTE [Given
# residuals]' first-order backward on the forward's residuals and their own VJP; by the
# suffix of the program's name.
_ROLES = ("", "linearize ", "apply ", "given apply ", "given transpose ")
_SUFFIX = {"linearize ": "(vjp linearize)", "apply ": "(vjp apply)",
           "given apply ": "(given apply)", "given transpose ": "(given transpose)"}


def bridge_programs(module) -> Counter:
    """``(order, kind) -> executables`` the bridge compiled for ``module``, its derivatives'.

    Reads the caches of the module's caller and of the callers of its derivatives, read
    only, as ``tests/support/pipeline.py`` does (internals: no public API lists them).
    """
    found = Counter()

    def walk(caller, order):
        for entry in caller.entries:
            name = entry.program.name
            role = next((r for r in _ROLES[1:] if name.endswith(_SUFFIX[r])), "")
            for kind in entry._executables:
                found[order, role + kind] += 1
            for derived in derived_owners(entry):
                walk(derived._caller, order + 1)

    walk(module._caller, 1)
    return found


def held_by_order(module, step, exclude: list[torch.Tensor]) -> dict:
    """Bytes the bridge's ``step`` saves for backward, by the order of the call saving them.

    Every tensor autograd saves passes through ``saved_tensors_hooks``. Inside ``module``'s
    forward it is order 1's; inside the backward of a bridge call it is the call of that
    call's VJP (one order up: the node is the bridge's ``autograd.Function`` context, whose
    ``entry`` names the program, one "(vjp)" per order); anything else is torch's own ops.
    Storages of ``exclude`` (parameters, inputs) are not counted; each other storage once.
    """
    known = {t.untyped_storage().data_ptr() for t in exclude}
    inside = [False]
    hooks = (module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
             module.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    held = defaultdict(int)

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            known.add(storage.data_ptr())
            entry = getattr(torch._C._current_autograd_node(), "entry", None)
            order = 1 if inside[0] else (
                "torch" if entry is None else entry.program.name.count("(vjp") + 2)
            held[order] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        for h in hooks:
            h.remove()
    return dict(held)


def kind_rank(kind: str) -> tuple[int, int]:
    """Where a program kind (with its role, if a VJP's part) sorts in its order's rows."""
    role = next((r for r in _ROLES[1:] if kind.startswith(r)), "")
    return _ROLES.index(role), _KIND_ORDER.index(kind[len(role):])
