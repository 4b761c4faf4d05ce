"""The torch caller's conventions at a program's boundary, applied inside traced bodies.

No two results share a buffer (``distinct``), complex gradients are torch's (``conj``),
residuals an offloading policy put in host memory are told apart (``memory_space``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

jtu = jax.tree_util


def distinct(results: list, inputs: Sequence) -> list:
    """Copies results that are an input or repeat another result, at trace time.

    JAX may hand an input that a jitted function returns unchanged back as the same buffer,
    and a gradient that is the cotangent itself (or shared by two leaves) as one buffer.
    Exchanged zero-copy, torch would then see two tensors over one memory, and an in-place
    update of one (a gradient accumulation, say) would silently change the other.
    """
    seen = {id(x) for x in inputs}
    out = []
    for r in results:
        if id(r) in seen:
            r = jnp.array(r, copy=True)
        seen.add(id(r))
        out.append(r)
    return out


def memory_space(x) -> str:
    """``"device"``, or the memory an offloading policy put ``x`` in (``"pinned_host"``)."""
    abstract = jax.typeof(x) if hasattr(jax, "typeof") else getattr(x, "aval", None)
    space = getattr(abstract, "memory_space", None)
    return "device" if space is None else str(getattr(space, "name", space)).lower()


def conj(x):
    """Torch's complex convention at the boundary (identity for real dtypes)."""
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


def output_name(treedef, index: int) -> str:
    """``output ['y']``: how messages name output ``index`` of ``treedef``."""
    paths = jtu.tree_flatten_with_path(jtu.tree_unflatten(treedef, range(treedef.num_leaves)))[0]
    path = jtu.keystr(paths[index][0])
    return f"output {path}" if path else "the output"


def check_output_leaf(leaf, treedef, index: int, name: str) -> None:
    """Refuses an output leaf torch cannot hold: not an array, or a typed PRNG key."""
    if not isinstance(leaf, jax.Array | np.ndarray | bool | int | float | complex):
        raise TypeError(
            f"{name}: {output_name(treedef, index)} of the function is a "
            f"{type(leaf).__name__}, which is not an array: only arrays can cross to "
            f"torch. Return arrays (or a tuple/list/dict of arrays), or register "
            f"{type(leaf).__name__} as a pytree (flax.struct.dataclass, "
            f"jax.tree_util.register_dataclass)."
        )
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"{name}: {output_name(treedef, index)} of the function is a typed PRNG key "
            f"array ({leaf.dtype}), which torch cannot hold. Return jax.random.key_data(key) "
            f"instead."
        )


def internal_assert(condition: bool, message: str) -> None:
    """Raises when flaxtorch's own invariant breaks: a bug of ours, never the user's."""
    if not condition:
        raise AssertionError(
            f"flaxtorch internal error: {message}. This is a bug in flaxtorch; please report it."
        )
