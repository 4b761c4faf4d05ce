"""Linen modules as adapters (``_adapt.py`` says what an adapter is).

The variables ``init``/``apply`` make, named by their dotted paths, and one apply per
training mode.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn

from flaxside.program._codecs import Leaves, WriteBack, dotted, key_name, snapshot, wrap_keys
from flaxside.program._compiling_for import compiling_for

jtu = jax.tree_util

INVERTED_TRAIN_KWARGS = frozenset({"deterministic", "use_running_average", "eval", "inference"})


def init_linen(module: nn.Module, rngs: dict, args: tuple, kwargs: dict, device=None):
    """``module.init(rngs, *args, **kwargs)`` compiled as one program, run on ``device``.

    Flax's ``init`` run op by op costs seconds for a scanned stack; jitted it is one
    compile. Array leaves of the arguments are traced; every other leaf stays static.
    ``device`` (``None``: JAX's default) is where the variables are computed: the caller
    picks it, so that a host whose default backend is a GPU does not decide for it.
    """
    leaves, treedef = jtu.tree_flatten((tuple(args), dict(kwargs)))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]

    def init(rngs, values):
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        a, k = jtu.tree_unflatten(treedef, full)
        return module.init(rngs, *a, **k)

    values = [leaves[i] for i in arrays]
    if device is not None:
        rngs, values = jax.device_put((rngs, values), device)
    with compiling_for(device):
        return jax.jit(init)(rngs, values)


class LinenAdapter(Leaves):
    """A ``flax.linen.Module`` and its variables dict (collection -> tree).

    Key-typed variables (``self.variable("state", "key", lambda: jax.random.key(0))``) are
    held as raw key data and wrapped inside the program.
    """

    kind = "linen"

    def __init__(self, module: nn.Module, variables, *, rng_streams=(), train_kwarg=None,
                 where: str = "FlaxModule"):
        self.module = module
        self.rng_streams = tuple(rng_streams)
        self.train_kwarg = train_kwarg
        path_leaves, self.treedef = jtu.tree_flatten_with_path(variables)

        def name(path):
            # A metadata box's leaf (``nn.Partitioned``: its ``value`` attribute) is named
            # as the variable; a dict key "value" is the user's own name.
            if path and isinstance(path[-1], jtu.GetAttrKey) and path[-1].name == "value":
                path = path[:-1]
            return dotted(path, where)

        super().__init__(
            [name(path) for path, _ in path_leaves],
            [key_name(path[0]) == "params" for path, _ in path_leaves],
            [leaf for _, leaf in path_leaves],
        )
        self._collections = tuple(key_name(p[0]) for p, _ in path_leaves)

    def mutable_collections(self, training: bool) -> tuple[str, ...]:
        """Collections applied as mutable: every non-params one, in training mode only."""
        if not training:
            return ()
        return tuple(dict.fromkeys(c for c in self._collections if c != "params"))

    def mutable_index(self, training: bool) -> tuple[int, ...]:
        """Indices of the leaves that ``updates`` replace, in order."""
        mutable = set(self.mutable_collections(training))
        return tuple(i for i, c in enumerate(self._collections) if c in mutable)

    def partition_names(self, axis_rules=None) -> list:
        """Per leaf, the mesh axis names ``nn.with_partitioning`` gives its dimensions.

        ``nn.with_logical_partitioning``'s names go through ``axis_rules`` (Flax's logical
        axis rules); ``None`` for a leaf without metadata.
        """
        n = len(self.names)
        tree = self.treedef.unflatten(list(range(n)))
        out = [None] * n

        def visit(x):
            if isinstance(x, nn.Partitioned):
                names = x.names
                if isinstance(x, nn.LogicallyPartitioned):
                    names = tuple(nn.logical_to_mesh_axes(names, axis_rules or ()))
                out[x.value] = tuple(names)
            return x

        jtu.tree_map(visit, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        return out

    def make_apply(self, training: bool):
        """``apply(state, *args, **kwargs) -> (outputs, updates, WriteBack)`` for one mode."""
        mutable = self.mutable_collections(training)
        index = self.mutable_index(training)
        names = [self.names[i] for i in index]
        module, streams, kwarg = self.module, self.rng_streams, self.train_kwarg
        write_back = WriteBack(index)

        def apply(state, *args, **kwargs):
            variables, raw = state
            if kwarg is not None:
                kwargs = {**kwargs, kwarg: training != (kwarg in INVERTED_TRAIN_KWARGS)}
            rngs = wrap_keys(raw, streams) if streams else None
            leaves, treedef = jtu.tree_flatten(variables)
            if mutable:
                leaves = snapshot(leaves, index)
            old = self.restore_all(leaves)
            variables = jtu.tree_unflatten(treedef, old)
            if not mutable:
                return module.apply(variables, *args, rngs=rngs, **kwargs), [], write_back
            out, new = module.apply(variables, *args, rngs=rngs, mutable=list(mutable), **kwargs)
            by_name = {
                ".".join(key_name(k) for k in path): leaf
                for path, leaf in jtu.tree_flatten_with_path(dict(new))[0]
            }
            updates = [self.store(i, by_name.get(n, old[i]))
                       for n, i in zip(names, index, strict=True)]
            return out, updates, write_back

        return apply
