"""Linen and NNX modules seen the same way: named leaves, an apply per mode, state updates.

An adapter turns a Flax module into what the torch side needs and nothing torch-specific:

* ``leaves``: ``(name, value, is_param)`` per variable leaf, in a fixed order;
* ``treedef``: how those leaves rebuild the module's state;
* ``make_apply(training)``: ``(apply, targets)``, where ``apply(state, *args, **kwargs)``
  returns ``(outputs, updates)``, ``state = (variable leaves tree, raw key data or None)``,
  and ``updates`` are the new values of the leaves at ``targets()``, which is final once
  ``apply`` has been traced (an NNX forward may assign a Param: found by tracing it).

RNG streams get their keys as raw key data (an integer array) so that the key can cross to
torch, be saved for the backward, and be drawn from torch's generator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

jtu = jax.tree_util

INVERTED_TRAIN_KWARGS = frozenset({"deterministic", "use_running_average", "eval", "inference"})


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data_shape() -> tuple[int, ...]:
    """Shape of one key's raw data under the default PRNG implementation."""
    return tuple(jax.random.key_data(jax.random.key(0)).shape)


def _snapshot(leaves: list, index) -> list:
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


def init_linen(module: nn.Module, rngs: dict, args: tuple, kwargs: dict):
    """``module.init(rngs, *args, **kwargs)`` compiled as one program.

    Flax's ``init`` run op by op costs seconds for a scanned stack; jitted it is one
    compile. Array leaves of the arguments are traced; every other leaf stays static.
    """
    leaves, treedef = jtu.tree_flatten((tuple(args), dict(kwargs)))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]

    def init(rngs, values):
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        a, k = jtu.tree_unflatten(treedef, full)
        return module.init(rngs, *a, **k)

    return jax.jit(init)(rngs, [leaves[i] for i in arrays])


class LinenAdapter:
    """A ``flax.linen.Module`` and its variables dict (collection -> tree)."""

    kind = "linen"

    def __init__(self, module: nn.Module, variables, *, rng_streams=(), train_kwarg=None):
        self.module = module
        self.rng_streams = tuple(rng_streams)
        self.train_kwarg = train_kwarg
        path_leaves, self.treedef = jtu.tree_flatten_with_path(variables)
        self.leaves = tuple(
            (".".join(map(_key_name, path)), jnp.asarray(leaf), _key_name(path[0]) == "params")
            for path, leaf in path_leaves
        )
        self._collections = tuple(_key_name(p[0]) for p, _ in path_leaves)

    def mutable_collections(self, training: bool) -> tuple[str, ...]:
        """Collections applied as mutable: every non-params one, in training mode only."""
        if not training:
            return ()
        return tuple(dict.fromkeys(c for c in self._collections if c != "params"))

    def mutable_index(self, training: bool) -> tuple[int, ...]:
        """Indices of the leaves that ``updates`` replace, in order."""
        mutable = set(self.mutable_collections(training))
        return tuple(i for i, c in enumerate(self._collections) if c in mutable)

    def make_apply(self, training: bool):
        """``apply(state, *args, **kwargs) -> (outputs, updates)`` for one mode."""
        mutable = self.mutable_collections(training)
        index = self.mutable_index(training)
        names = [self.leaves[i][0] for i in index]
        module, streams, kwarg = self.module, self.rng_streams, self.train_kwarg

        def apply(state, *args, **kwargs):
            variables, raw = state
            if kwarg is not None:
                kwargs = {**kwargs, kwarg: training != (kwarg in INVERTED_TRAIN_KWARGS)}
            rngs = wrap_keys(raw, streams) if streams else None
            if not mutable:
                return module.apply(variables, *args, rngs=rngs, **kwargs), []
            leaves, treedef = jtu.tree_flatten(variables)
            old = _snapshot(leaves, index)
            variables = jtu.tree_unflatten(treedef, old)
            out, new = module.apply(variables, *args, rngs=rngs, mutable=list(mutable), **kwargs)
            by_name = {
                ".".join(_key_name(k) for k in path): leaf
                for path, leaf in jtu.tree_flatten_with_path(dict(new))[0]
            }
            return out, [by_name.get(n, old[i]) for n, i in zip(names, index, strict=True)]

        return apply, lambda: index

    def variables(self, leaves):
        """The Flax variables dict for a list of leaf values."""
        return jtu.tree_unflatten(self.treedef, list(leaves))


class NNXAdapter:
    """An ``nnx.Module``: ``nnx.Param`` leaves are parameters, every other state a buffer.

    Key-typed state (``nnx.RngKey``) is held as raw key data and wrapped inside the program.
    """

    kind = "nnx"

    def __init__(self, module: nnx.Module, *, rng_streams=(), train_kwarg=None):
        if train_kwarg is not None:
            raise ValueError(
                f"FlaxModule: train_kwarg={train_kwarg!r} is for Linen modules; an NNX module's "
                f"train/eval behaviour follows module.train()/module.eval() automatically. "
                f"Drop the train_kwarg argument."
            )
        self.graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        self.rng_streams = tuple(rng_streams)
        p_leaves, p_def = jtu.tree_flatten_with_path(params)
        r_leaves, r_def = jtu.tree_flatten_with_path(rest)
        self.treedef = jtu.tree_structure((params, rest))
        self._n_params = len(p_leaves)
        self._rest_def = r_def
        self._key_index = tuple(i for i, (_, leaf) in enumerate(r_leaves) if _is_key(leaf))
        flat_rest = nnx.to_flat_state(rest)
        tags = [getattr(v, "tag", None) for _, v in flat_rest]
        self._stream_keys = tuple(
            (i, tags[i]) for i in self._key_index
            if i < len(tags) and tags[i] in self.rng_streams
        )
        # A stream's count is reset with its key, so masks depend on torch's draw alone.
        self._stream_counts = tuple(
            i for i, (_, v) in enumerate(flat_rest)
            if isinstance(v, nnx.RngCount) and getattr(v, "tag", None) in self.rng_streams
        )

        def name(path):
            parts = [_key_name(k) for k in path]
            return ".".join(parts[:-1] if parts and parts[-1] == "value" else parts)

        self.leaves = tuple(
            [(name(p), jnp.asarray(leaf), True) for p, leaf in p_leaves]
            + [(name(p), jax.random.key_data(leaf) if _is_key(leaf) else jnp.asarray(leaf), False)
               for p, leaf in r_leaves]
        )

    def mutable_index(self, training: bool) -> tuple[int, ...]:
        """Every non-Param leaf is written back in training mode; none in eval mode.

        Params the forward itself assigns are written back too, in both modes; they are
        known only once the forward is traced (see ``make_apply``).
        """
        if not training:
            return ()
        return tuple(range(self._n_params, len(self.leaves)))

    def make_apply(self, training: bool):
        """``(apply, targets)`` for one mode; see the module docstring.

        Besides the non-Param state (training mode), the forward's own Param assignments
        (``m.kernel[...] = ...``, as in the ``nnx.fori_loop`` docstring) are written back in
        both modes, as pure NNX would keep them. Which Params a forward assigns is found by
        identity when it is first traced; later traces copy those Params on entry, so the
        backward reads the copy and never the torch parameter that is then overwritten.
        """
        graphdef, key_index = self.graphdef, set(self._key_index)
        stream_keys, streams = self._stream_keys, self.rng_streams
        stream_counts = self._stream_counts
        rest_index = self.mutable_index(training)
        write_back = bool(rest_index)
        assigned = None  # Param leaves the forward assigns: found by the first trace

        def apply(state, *args, **kwargs):
            nonlocal assigned
            (params, rest), raw = state
            p_leaves, p_def = jtu.tree_flatten(params)
            if assigned:
                p_leaves = _snapshot(p_leaves, assigned)
                params = jtu.tree_unflatten(p_def, p_leaves)
            r_leaves, r_def = jtu.tree_flatten(rest)
            if write_back:  # see _snapshot: every non-Param leaf is written back
                r_leaves = _snapshot(r_leaves, range(len(r_leaves)))
            r_leaves = [jax.random.wrap_key_data(x) if i in key_index else x
                        for i, x in enumerate(r_leaves)]
            if streams:
                drawn = wrap_keys(raw, streams)
                for n, (i, tag) in enumerate(stream_keys):
                    r_leaves[i] = jax.random.fold_in(drawn[tag], n)
                for i in stream_counts:
                    r_leaves[i] = jnp.zeros_like(r_leaves[i])
            model = nnx.merge(graphdef, params, jtu.tree_unflatten(r_def, r_leaves))
            if training:
                model.train()
            else:
                model.eval()
            out = model(*args, **kwargs)
            _, new_params, new_rest = nnx.split(model, nnx.Param, ...)
            new_p = jtu.tree_leaves(new_params)
            if jtu.tree_structure(new_params) != p_def:
                raise NotImplementedError(
                    f"FlaxModule: the NNX module's forward adds or removes nnx.Param "
                    f"variables ({p_def.num_leaves} before the call, {len(new_p)} after); "
                    f"torch owns a fixed set of parameters. Create every Param in __init__."
                )
            changed = [i for i, (a, b) in enumerate(zip(p_leaves, new_p, strict=True))
                       if a is not b]
            if assigned is None:
                assigned = changed
            elif changed != assigned:
                raise NotImplementedError(
                    f"FlaxModule: the NNX module's forward assigned the Params at "
                    f"{changed} in one trace and {assigned} in another; it must assign the "
                    f"same Params on every call."
                )
            updates = [new_p[i] for i in assigned]
            if write_back:
                updates = [jax.random.key_data(x) if i in key_index else x
                           for i, x in enumerate(jtu.tree_leaves(new_rest))] + updates
            return out, updates

        return apply, lambda: rest_index + tuple(assigned or ())

    def variables(self, leaves):
        """``(params State, rest State)`` for a list of leaf values (keys as raw data)."""
        return jtu.tree_unflatten(self.treedef, list(leaves))


def adapter_for(module, variables=None, **options):
    """The adapter for a Linen or NNX module.

    Raises:
        TypeError: ``module`` is neither.
    """
    if isinstance(module, nnx.Module):
        if variables is not None:
            raise ValueError("FlaxModule: variables= is for Linen modules; an NNX module "
                             "carries its own state. Load weights into it before wrapping.")
        return NNXAdapter(module, **options)
    if isinstance(module, nn.Module):
        return LinenAdapter(module, variables, **options)
    raise TypeError(
        f"FlaxModule: module must be a flax.linen.Module or a flax.nnx.Module, got "
        f"{type(module).__name__}. Wrap a plain JAX function with torchside.jax_function."
    )
