"""Variable leaves as torch holds them: names, kinds, key and unsigned-dtype codecs.

Shared by the Linen and NNX adapters (``adapters/_linen.py``, ``adapters/_nnx.py``). Typed
PRNG keys cross as raw key data so that torch can hold, save and draw them, and unsigned
16/32/64-bit state as the signed dtype of its width (``Leaves``); both are restored, bit for
bit, inside the program.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

jtu = jax.tree_util


class WriteBack(NamedTuple):
    """What a call returns besides arrays: which leaves its updates replace, and the graph.

    Attributes:
        targets: indices of the variable leaves that the call's ``updates`` replace, in order.
        graph: for NNX, the module graph after the call (``Graph``: a forward that changes
            a Python attribute changes it, as under ``nnx.jit``); ``None`` otherwise.
    """

    targets: tuple[int, ...] = ()
    graph: Hashable = None


def key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def dotted(path, where: str) -> str:
    parts = [key_name(k) for k in path]
    for part in parts:
        if "." in part or not part:
            raise ValueError(
                f"{where}: the Flax variable path {tuple(parts)} has the name {part!r}. torch "
                f"joins state_dict names with '.', so this path would read as "
                f"{'.'.join(parts)!r} and could collide with another variable (e.g. "
                f"params['a.kernel'] and params['a']['kernel']); an empty name cannot be a "
                f"torch name at all. Rename the Flax variable or submodule (e.g. 'a_kernel')."
            )
    return ".".join(parts)


def is_key(x) -> bool:
    """Whether ``x`` is a typed PRNG key array."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data_shape() -> tuple[int, ...]:
    """Shape of one key's raw data under the default PRNG implementation.

    Traced, not computed: building a module on the meta device starts no JAX backend.
    """
    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def snapshot(leaves: list, index) -> list:
    """Copies the leaves at ``index`` inside the traced program.

    The torch side writes updated state back into its buffers in place after the forward.
    A state leaf the backward needs (a counter or broadcast variable that enters the math)
    would otherwise be saved for the backward as that very buffer, and the write-back then
    trips torch's version check. Used through a copy, the residual map sees the copy, not
    the input, and the forward returns it as a residual of its own; copies that the
    backward does not need are dead code. (``residuals="recompute"`` saves the inputs
    themselves; the torch side saves clones of the written-back leaves for that mode.)
    """
    index = set(index)
    return [jnp.array(x, copy=True) if i in index else x for i, x in enumerate(leaves)]


def wrap_keys(raw, streams: tuple[str, ...]) -> dict:
    """``{stream: key}`` from raw key data of shape ``(len(streams), *key_data_shape())``."""
    keys = jax.random.wrap_key_data(jax.lax.bitcast_convert_type(raw, jnp.uint32))
    return {name: keys[i] for i, name in enumerate(streams)}


def split_to(key, shape: tuple[int, ...]):
    """Keys of ``shape`` from one key (a stacked stream key: one key per layer)."""
    if not shape:
        return key
    return jax.random.split(key, math.prod(shape)).reshape(shape)


def _abstract_key_impl(x: jax.ShapeDtypeStruct):
    """The PRNG implementation of an abstract key array (read while tracing it)."""
    found = []

    def read(key):
        found.append(jax.random.key_impl(key))
        return key

    jax.eval_shape(read, x)
    return found[0]


# Same-width signed dtypes for unsigned ones. torch's unsigned 16/32/64-bit dtypes are
# barely supported (a plain pickle of such a tensor fails to load, gloo cannot broadcast
# one): torch holds those bits as the signed dtype, bitcast back inside the program.
_SIGNED = {np.dtype(np.uint16): jnp.int16, np.dtype(np.uint32): jnp.int32,
           np.dtype(np.uint64): jnp.int64}


class Leaves:
    """Names, kinds and (once) values of an adapter's variable leaves, in torch's storage.

    What torch holds differs from the Flax value in two cases, undone inside the program
    (``restore``) and redone for state written back (``store``): a typed PRNG key is held
    as its raw key data, and unsigned 16/32/64-bit data as the signed dtype of its width.
    """

    def __init__(self, names, is_param, values):
        self.names = tuple(names)
        self.is_param = tuple(is_param)
        self._codecs = {}  # leaf index -> (unsigned dtype or None, key impl or None)
        stored = []
        for i, x in enumerate(values):
            # Abstract values (jax.ShapeDtypeStruct, from jax.eval_shape) describe variables
            # that are never computed here (a torch module built on the meta device).
            abstract = isinstance(x, jax.ShapeDtypeStruct)
            impl = (_abstract_key_impl(x) if abstract else jax.random.key_impl(x)
                    ) if is_key(x) else None
            x = x if impl is not None or abstract else jnp.asarray(x)
            data = x if impl is None else (jax.eval_shape(jax.random.key_data, x) if abstract
                                           else jax.random.key_data(x))
            unsigned = np.dtype(data.dtype) if np.dtype(data.dtype) in _SIGNED else None
            if impl is not None or unsigned is not None:
                self._codecs[i] = (unsigned, impl)
            stored.append(jax.eval_shape(lambda v, i=i: self.store(i, v), x) if abstract
                          else self.store(i, x))
        self._values = stored

    def take_initial_values(self) -> list:
        """The initial values, once: the new owner keeps them, the adapter does not."""
        values, self._values = self._values, None
        if values is None:
            raise RuntimeError("take_initial_values: the values were already taken.")
        return values

    def store(self, i: int, x):
        """Leaf ``i``'s Flax value (a typed key too) as torch holds it."""
        codec = self._codecs.get(i)
        if codec is None:
            return x
        unsigned, impl = codec
        if impl is not None and is_key(x):
            x = jax.random.key_data(x)
        if unsigned is not None and np.dtype(x.dtype) == unsigned:
            x = jax.lax.bitcast_convert_type(x, _SIGNED[unsigned])
        return x

    def restore(self, i: int, x, keys: bool = True):
        """Leaf ``i`` as Flax uses it, from what torch holds (``keys=False``: raw key data)."""
        codec = self._codecs.get(i)
        if codec is None:
            return x
        unsigned, impl = codec
        if unsigned is not None and np.dtype(x.dtype) == np.dtype(_SIGNED[unsigned]):
            x = jax.lax.bitcast_convert_type(x, unsigned)
        if impl is not None and keys:
            x = jax.random.wrap_key_data(x, impl=impl)
        return x

    def restore_all(self, leaves, keys: bool = True) -> list:
        """``restore`` on every leaf."""
        return [self.restore(i, x, keys) for i, x in enumerate(leaves)]

    def leaf_values(self, variables) -> list:
        """Leaf values as torch holds them, of variables shaped like ``variables()``."""
        leaves, treedef = jtu.tree_flatten(variables)
        if treedef != self.treedef:
            raise ValueError(
                f"load_flax_variables: the variables have structure {treedef}, expected "
                f"{self.treedef}. Pass what flax_variables() returns for this module."
            )
        return [self.store(i, jnp.asarray(x) if not is_key(x) else x)
                for i, x in enumerate(leaves)]

    def variables(self, leaves):
        """The Flax state for a list of leaf values as torch holds them (typed keys)."""
        return jtu.tree_unflatten(self.treedef, self.restore_all(list(leaves)))

    def partition_names(self, axis_rules=None) -> list:
        """Per leaf, the mesh axis names its partitioning metadata gives its dimensions.

        ``None`` for a leaf without metadata (every leaf here; Linen reads its boxes).
        """
        return [None] * len(self.names)
