"""Autocast's casts of a call (NOTE [Resolve] in ``_resolve.py``), run only under autocast.

``resolve`` asks torch for the autocast dtype where the owner's ``autocast`` is not
``"off"``; what follows runs only when autocast is on: the inputs and parameters cast to
its dtype (``autocast="inputs"``), or the inputs to the parameters' own dtype and the
outputs to autocast's (``"outputs"``).
"""

from __future__ import annotations

import jax
import torch

jtu = jax.tree_util


def compute_dtype(variables, is_param):
    """The dtype of the floating parameters (``None`` if they have several or none)."""
    dtypes = {v.dtype for v, p in zip(variables, is_param, strict=True)
              if p and v.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def cast(t, dtype):
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def cast_tree(tree, dtype):
    if isinstance(tree, torch.Tensor):  # the common case, and traceable by Dynamo
        return cast(tree, dtype)
    if type(tree) in (tuple, list):
        return type(tree)(cast_tree(t, dtype) for t in tree)
    if type(tree) is dict:
        return {k: cast_tree(v, dtype) for k, v in tree.items()}
    return jtu.tree_map(lambda t: cast(t, dtype), tree,
                        is_leaf=lambda x: isinstance(x, torch.Tensor))
