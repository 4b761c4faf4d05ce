"""A Linen module's first variables, from torch example arguments (``FlaxModule(example_args=)``).

Example tensors cross as call arguments do (int64 narrowed to int32 after a range check),
and ``init`` runs on the JAX device of the module's torch device.
"""

from __future__ import annotations

import jax
import torch

import bridge
from flaxside.internal import init_linen
from torchside import _errors

jtu = jax.tree_util


def init_linen_from_torch(module, seed: int, rngs: tuple, args: tuple, kwargs: dict,
                          where: str, device: torch.device):
    """Linen ``module.init`` on the example arguments, run on the JAX device of ``device``.

    Errors say what to pass.
    """
    def convert(tree, label):
        paths, treedef = jtu.tree_flatten_with_path(tree)
        return jtu.tree_unflatten(treedef, [
            _example(x, f"{label}{jtu.keystr(p)}", where) if isinstance(x, torch.Tensor)
            else x for p, x in paths])

    init_rngs = {"params": jax.random.key(seed)}
    init_rngs.update({name: jax.random.key(seed + 1 + i) for i, name in enumerate(rngs)})
    args, kwargs = convert(args, "example_args"), convert(kwargs, "example_kwargs")
    try:
        return init_linen(module, init_rngs, args, kwargs,
                          device=bridge.jax_device(device, name="example_args"))
    except TypeError as e:
        if args or kwargs or "argument" not in str(e):
            raise
        raise _errors.no_example_args(where, e) from e


def _example(tensor: torch.Tensor, name: str, where: str):
    """An example argument for ``init`` as JAX sees it: int64 narrowed as calls narrow it."""
    if bridge.internal.narrows_to_int32(tensor.dtype):
        try:
            tensor = bridge.internal.narrow_to_int32(tensor, name=name)
        except TypeError as e:
            raise _errors.for_owner(e, where) from None
    return bridge.to_jax(tensor, name=name)
