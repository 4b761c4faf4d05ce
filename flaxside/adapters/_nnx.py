"""NNX modules as adapters (``_adapt.py`` says what an adapter is).

The graph split into parameters and the rest, merged again inside each program, and
what a forward assigns found by tracing.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from flaxside.program._codecs import (
    Leaves,
    WriteBack,
    dotted,
    is_key,
    key_name,
    snapshot,
    split_to,
    wrap_keys,
)
from flaxside.program._specs import spec_axes

jtu = jax.tree_util


def _train_mode_graph(graphdef, params, rest):
    """The graph with every train/eval flag in train mode.

    ``.train()`` / ``.eval()`` set plain attributes (``deterministic``,
    ``use_running_average``), which are part of an NNX graph. The torch side passes the
    mode separately, so graphs are kept and compared in one mode: a mode switch is not a
    graph change, and eval after train reuses the same graph.
    """
    model = nnx.merge(graphdef, params, rest)
    model.train()
    return nnx.split(model, nnx.Param, ...)[0]


def _paths(state) -> list[str]:
    names = []
    for path, _ in jtu.tree_flatten_with_path(state)[0]:
        parts = [key_name(k) for k in path]
        names.append(".".join(parts[:-1] if parts and parts[-1] == "value" else parts))
    return names


def _changed_paths(before, after) -> str:
    """The paths only one of two states has, for a message."""
    old, new = _paths(before), _paths(after)
    added = [p for p in new if p not in set(old)]
    removed = [p for p in old if p not in set(new)]
    return ", ".join([f"added {p!r}" for p in added] + [f"removed {p!r}" for p in removed]
                     + [f"{len(old)} before the call, {len(new)} after"])


class Graph:
    """An NNX module graph as a call signature holds it: compared by value, hashed once.

    A forward that changes a plain Python attribute returns a new ``Graph``, which the next
    call uses, as ``nnx.jit`` propagates it. A graph that holds an unhashable attribute
    hashes to 0 and is told apart by comparison alone. Nothing keeps a ``Graph`` but the
    module and the signatures that use it, so graphs are dropped with them. ``key``, an
    int unique in the process, names it where only ints can go (``Graph.find``).
    """

    __slots__ = ("graphdef", "key", "_hash", "__weakref__")
    _keys = itertools.count()
    _by_key: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self, graphdef):
        self.graphdef = graphdef
        try:
            self._hash = hash(graphdef)
        except TypeError:
            self._hash = 0
        self.key = next(Graph._keys)
        Graph._by_key[self.key] = self

    def __reduce__(self):  # a copy or an unpickled graph gets a key of its own
        return Graph, (self.graphdef,)

    @staticmethod
    def find(key: int) -> Graph:
        """The graph with this ``key``; ``KeyError`` if it was dropped."""
        return Graph._by_key[key]

    def __eq__(self, other):
        return self is other or (isinstance(other, Graph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"Graph({type(self.graphdef).__name__}, hash={self._hash})"


def _partition_names(params, n: int) -> list:
    """Per Param leaf, the names its partitioning metadata gives its dimensions, or None.

    The metadata key is ``out_sharding`` in flax 0.12.8 and ``sharding_names`` in 0.12.1;
    one leaf per Variable (else no names at all: nothing is guessed).
    """
    variables = jtu.tree_leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(variables) != n:
        return [None] * n
    out = []
    for v in variables:
        found = sharding_names(v) if isinstance(v, nnx.Variable) else None
        out.append(None if found is None else found[1])
    return out


# Where a Variable keeps the names ``nnx.with_partitioning`` gives: ``out_sharding`` in flax
# 0.12.8, ``sharding_names`` in 0.12.1.
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def partition_metadata(variable: nnx.Variable) -> tuple[str, tuple] | None:
    """Where ``variable`` keeps its per-dimension partition names, and the names.

    ``(metadata key, names as a tuple)`` (a ``PartitionSpec`` is no tuple in jax 0.10), or
    ``None``: no names, or a sharding object.
    """
    meta = variable.get_metadata()
    for key in _SHARDING_KEYS:
        names = meta.get(key)
        if names is not None:
            return ((key, tuple(names))
                    if isinstance(names, tuple | list | jax.sharding.PartitionSpec) else None)
    return None


def sharding_names(variable: nnx.Variable) -> tuple[str, tuple] | None:
    """``partition_metadata``, each dimension a name, a tuple of names, or ``None``.

    A tuple of one name is that name; one of several (``P(("fsdp", "tensor"))``) shards
    the dimension over each. ``None``: no names.
    """
    found = partition_metadata(variable)
    if found is None:
        return None
    key, names = found
    return key, tuple(n[0] if isinstance(n, tuple | list) and len(n) == 1
                      else tuple(n) if isinstance(n, list) else n for n in names)


class NNXAdapter(Leaves):
    """An ``nnx.Module``: ``nnx.Param`` leaves are parameters, every other state a buffer.

    Key-typed state (``nnx.RngKey``) is held as raw key data and wrapped inside the program.
    The module's structure and plain Python attributes are a ``Graph``, part of the mode.
    """

    kind = "nnx"

    def __init__(self, module: nnx.Module, *, rng_streams=(), train_kwarg=None,
                 where: str = "FlaxModule"):
        if train_kwarg is not None:
            raise ValueError(
                f"{where}: train_kwarg={train_kwarg!r} is for Linen modules; an NNX module's "
                f"train/eval behaviour follows module.train()/module.eval() automatically. "
                f"Drop the train_kwarg argument."
            )
        self.where = where
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        self.graph = Graph(_train_mode_graph(graphdef, params, rest))
        self.rng_streams = tuple(rng_streams)
        p_leaves, _ = jtu.tree_flatten_with_path(params)
        r_leaves, _ = jtu.tree_flatten_with_path(rest)
        self._param_names = _partition_names(params, len(p_leaves))
        self.treedef = jtu.tree_structure((params, rest))
        self._n_params = len(p_leaves)
        self._key_index = tuple(i for i, (_, leaf) in enumerate(r_leaves) if is_key(leaf))
        self._key_shapes = {i: tuple(r_leaves[i][1].shape) for i in self._key_index}
        flat_rest = nnx.to_flat_state(rest)
        tags = [getattr(v, "tag", None) for _, v in flat_rest]
        self._stream_keys = tuple(
            (i, tags[i]) for i in self._key_index
            if i < len(tags) and tags[i] in self.rng_streams
        )
        self._check_streams({tags[i] for i in self._key_index if i < len(tags)})
        # A stream's count is reset with its key, so masks depend on torch's draw alone.
        self._stream_counts = tuple(
            i for i, (_, v) in enumerate(flat_rest)
            if isinstance(v, nnx.RngCount) and getattr(v, "tag", None) in self.rng_streams
        )

        def name(path):
            if path and key_name(path[-1]) == "value":
                path = path[:-1]
            return dotted(path, where)

        super().__init__(
            [name(p) for p, _ in p_leaves] + [name(p) for p, _ in r_leaves],
            [True] * len(p_leaves) + [False] * len(r_leaves),
            [leaf for _, leaf in p_leaves] + [leaf for _, leaf in r_leaves],
        )

    def partition_names(self, axis_rules=None) -> list:
        """Per leaf, the mesh axis names ``nnx.with_partitioning`` gives its dimensions.

        NNX does not mark names as logical: a name that ``axis_rules`` (Flax's logical
        axis rules) has a rule for is mapped by its first rule, any other is a mesh axis
        name as it stands. ``None`` for a leaf without metadata (every non-Param leaf).
        """
        rules = {}
        for logical, mesh_axis in axis_rules or ():
            rules.setdefault(logical, mesh_axis)

        def mesh_axes(entry):
            if isinstance(entry, tuple):  # several names: each mapped, rules' tuples spread
                axes = tuple(a for n in entry for a in spec_axes(rules.get(n, n)))
                return None if not axes else axes[0] if len(axes) == 1 else axes
            return rules.get(entry, entry)

        def mesh_names(names):
            return None if names is None else tuple(mesh_axes(n) for n in names)

        return ([mesh_names(n) for n in self._param_names]
                + [None] * (len(self.names) - self._n_params))

    def _check_streams(self, held: set) -> None:
        """Refuses a requested stream that no RNG key of the module carries.

        Such a stream would draw no torch key at all: the module would keep drawing from its
        own key, and ``torch.manual_seed`` would not reproduce its masks.
        """
        missing = [s for s in self.rng_streams if s not in held]
        if not missing:
            return
        have = sorted(str(t) for t in held if t is not None)
        fix = f"pass rngs={tuple(have)!r}" if have else "drop rngs="
        if "default" in have:
            fix += (" (a module built with nnx.Rngs(0) has the one stream 'default', which "
                    "nnx.Dropout falls back to)")
        raise ValueError(
            f"{self.where}: rngs={self.rng_streams!r} asks for the RNG stream "
            f"{missing[0]!r}, but no RNG key of the NNX module belongs to it (its streams: "
            f"{have}), so torch's generator would not reach the module's randomness. Either "
            f"{fix}, or build the module with a key of that stream, e.g. "
            f"nnx.Rngs(0, {missing[0]}=1)."
        )

    def mutable_index(self, training: bool) -> tuple[int, ...]:
        """Every non-Param leaf is written back in training mode; none in eval mode.

        Params the forward itself assigns are written back too, in both modes; they are
        known only once the forward is traced (see ``make_apply``).
        """
        if not training:
            return ()
        return tuple(range(self._n_params, len(self.names)))

    def make_apply(self, mode):
        """``apply`` for ``mode = (training, Graph)``; see the module docstring.

        Besides the non-Param state (training mode), the forward's own Param assignments
        (``m.kernel[...] = ...``, as in the ``nnx.fori_loop`` docstring) are written back in
        both modes, as pure NNX would keep them. A trace that finds, by identity, that the
        forward assigns Params runs it a second time on copies of those (``snapshot``), so
        the backward reads the copies and never the torch parameter the write-back then
        overwrites; the first run is dead code. Each trace learns this for itself.
        """
        training, graph = mode
        graphdef, n_params = graph.graphdef, self._n_params
        stream_keys, streams = self._stream_keys, self.rng_streams
        stream_counts, key_shapes = self._stream_counts, self._key_shapes
        rest_index = self.mutable_index(training)
        write_back = bool(rest_index)

        def run(p_leaves, p_def, r_leaves, r_def, args, kwargs):
            """The forward on these leaves: outputs, new state, the Params it assigned.

            The state is rebuilt from leaves for each run: ``nnx.merge`` reuses the
            Variables it is given, and a run mutates them (BatchNorm's statistics).
            """
            params = jtu.tree_unflatten(p_def, p_leaves)
            rest = jtu.tree_unflatten(r_def, r_leaves)
            model = nnx.merge(graphdef, params, rest)
            if training:
                model.train()
            else:
                model.eval()
            out = model(*args, **kwargs)
            model.train()  # graphs are compared in one mode (see _train_mode_graph)
            new_graphdef, new_params, new_rest = nnx.split(model, nnx.Param, ...)
            self._check_same_state(params, new_params, rest, new_rest)
            new_p = jtu.tree_leaves(new_params)
            assigned = tuple(i for i, (a, b) in enumerate(zip(p_leaves, new_p, strict=True))
                             if a is not b)
            return out, new_graphdef, new_p, new_rest, assigned

        def apply(state, *args, **kwargs):
            (params, rest), raw = state
            p_leaves, p_def = jtu.tree_flatten(params)
            p_leaves = [self.restore(i, x) for i, x in enumerate(p_leaves)]
            r_leaves, r_def = jtu.tree_flatten(rest)
            if write_back:  # see snapshot: every non-Param leaf is written back
                r_leaves = snapshot(r_leaves, range(len(r_leaves)))
            r_leaves = [self.restore(n_params + i, x) for i, x in enumerate(r_leaves)]
            if streams:
                drawn = wrap_keys(raw, streams)
                for n, (i, tag) in enumerate(stream_keys):
                    r_leaves[i] = split_to(jax.random.fold_in(drawn[tag], n), key_shapes[i])
                for i in stream_counts:
                    r_leaves[i] = jnp.zeros_like(r_leaves[i])
            out, new_graphdef, new_p, new_rest, assigned = run(p_leaves, p_def, r_leaves,
                                                              r_def, args, kwargs)
            if assigned:
                copies = snapshot(p_leaves, assigned)
                out, new_graphdef, new_p, new_rest, again = run(copies, p_def, r_leaves,
                                                                r_def, args, kwargs)
                if again != assigned:
                    raise NotImplementedError(
                        f"{self.where}: the NNX module's forward assigned the Params at "
                        f"{list(assigned)} in one run and {list(again)} in another; it must "
                        f"assign the same Params on every call."
                    )
            updates = [self.store(i, new_p[i]) for i in assigned]
            if write_back:
                updates = [self.store(n_params + i, x)
                           for i, x in enumerate(jtu.tree_leaves(new_rest))] + updates
            new_graph = graph if new_graphdef == graphdef else Graph(new_graphdef)
            return out, updates, WriteBack(rest_index + assigned, new_graph)

        return apply

    def _check_same_state(self, params, new_params, rest, new_rest) -> None:
        """Refuses, while tracing (so before anything is written), a forward that adds state."""
        if jtu.tree_structure(new_params) != jtu.tree_structure(params):
            raise NotImplementedError(
                f"{self.where}: the NNX module's forward adds or removes nnx.Param "
                f"variables ({_changed_paths(params, new_params)}); torch owns a fixed set "
                f"of parameters. Create every Param in __init__."
            )
        if jtu.tree_structure(new_rest) != jtu.tree_structure(rest):
            raise NotImplementedError(
                f"{self.where}: the NNX module's forward creates or deletes state "
                f"({_changed_paths(rest, new_rest)}), e.g. with self.sow(nnx.Intermediate, "
                f"...); torch owns "
                f"a fixed set of buffers, so this state cannot be kept. Create the variable in "
                f"__init__ (e.g. nnx.Intermediate(jnp.zeros(...))) or drop it inside __call__ "
                f"(nnx.pop(self, nnx.Intermediate)). Nothing was written back."
            )


# -- an NNX factory's module, for its owner's initializer ---------------------------------------
def build_nnx(factory, seed: int) -> nnx.Module:
    """``factory(nnx.Rngs(seed))``, with its variables' partitioning kept as metadata.

    Flax 0.12's eager sharding would place a variable made with ``nnx.with_partitioning``
    on a mesh at creation and needs one in context; torch owns the values and
    ``torchside.shard`` reads the metadata, so it is off here.
    """
    off = getattr(nnx, "use_eager_sharding", None)
    with off(False) if off is not None else contextlib.nullcontext():
        return factory(nnx.Rngs(seed))


def nnx_shapes(factory, seed: int) -> nnx.Module:
    """The factory's module with ``jax.ShapeDtypeStruct`` variables, computing nothing."""
    return nnx.eval_shape(lambda: build_nnx(factory, seed))


def nnx_state(module: nnx.Module) -> tuple:
    """``module``'s state as its owner holds it: ``(params, rest)``, as ``nnx.split`` gives."""
    return tuple(nnx.split(module, nnx.Param, ...)[1:])


def nnx_merged(graphdef, state: tuple, training: bool) -> nnx.Module:
    """The module of ``graphdef`` over ``state`` (``(params, rest)``), in train or eval mode."""
    model = nnx.merge(graphdef, *state)
    model.train() if training else model.eval()
    return model
