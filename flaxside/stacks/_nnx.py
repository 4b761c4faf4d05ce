"""``remat_stack`` for NNX blocks: layers made with ``nnx.vmap``, run by ``stack_apply``."""

from __future__ import annotations

import jax
from flax import nnx

from flaxside.adapters._nnx import partition_metadata
from flaxside.stacks._core import stack_apply
from flaxside.stacks._lengths import choose_stack_lengths, signature
from flaxside.stacks._options import check_lengths, resolve_policy

jtu = jax.tree_util


class NnxRematStack(nnx.Module):
    """``depth`` copies of an NNX block applied in sequence, rematerialized at every level.

    Built by ``remat_stack``; see there. ``self.layers`` is one block whose ``nnx.Param``s
    are stacked with leading axes ``lengths`` (``(depth,)`` for ``lengths="auto"``).

    Example:
        >>> from flaxside import remat_stack
        >>> stack = remat_stack(nnx.Linear, 4, in_features=3, out_features=3,
        ...                     rngs=nnx.Rngs(0))
        >>> type(stack).__name__, stack.layers.kernel.shape  # four (3, 3) kernels
        ('NnxRematStack', (4, 3, 3))
        >>> x = jnp.ones((2, 3))
        >>> stack(x).shape
        (2, 3)
        >>> grads = nnx.grad(lambda model: model(x).sum())(stack)
        >>> grads["layers"]["kernel"].shape
        (4, 3, 3)
    """

    def __init__(self, block: type, depth: int, /, *, lengths=None, policy=None,
                 memory_budget: int | None = None, rngs: nnx.Rngs, block_kwargs=None):
        block_kwargs = dict(block_kwargs or {})
        auto = isinstance(lengths, str)
        layout = (depth,) if auto else check_lengths(lengths, depth)
        resolve_policy(policy)  # fail at construction, not at the first call

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return block(**block_kwargs, rngs=rngs)

        layers = create(rngs)
        _, rest = nnx.state(layers, nnx.Param, ...)
        if jtu.tree_leaves(rest):
            names = sorted(".".join(map(str, path)) for path, _ in nnx.to_flat_state(rest))
            raise NotImplementedError(
                f"remat_stack: the NNX block {block.__name__} has state other than nnx.Param "
                f"({names}); only parameters can be stacked so far (nnx.Dropout's rngs and "
                f"BatchNorm statistics would not advance). Keep such state outside the stack."
            )
        state = nnx.state(layers)
        nnx.update(layers, jtu.tree_map(lambda a: a.reshape(layout + a.shape[1:]), state))
        # A layer's partition names name one layer's dimensions; the stack's layer axes
        # come first and are named by none (as nn.scan's metadata_params={PARTITION_NAME:
        # None} does), else a rule for the first name would shard the layer axis.
        for _, variable in nnx.to_flat_state(nnx.state(layers, nnx.Param)):
            found = partition_metadata(variable)
            if found is not None:
                key, names = found  # nnx.vmap (flax 0.12.1 to 0.12.8) adds no name
                variable.set_metadata(**{key: (None,) * len(layout) + names})
        self.layers = layers
        self.depth = depth
        self.lengths = lengths if auto else layout
        self.policy = policy
        self.memory_budget = memory_budget

    def __call__(self, x):
        """Applies the stack to the carry ``x``; returns the carry after the last layer."""
        graphdef, params = nnx.split(self.layers, nnx.Param)
        policy = resolve_policy(self.policy)

        def layer_fn(p, c, consts, i):
            return nnx.merge(graphdef, p)(c)

        lengths = layout = self.lengths
        if isinstance(lengths, str):
            lengths, layout = self.choose_lengths(x).lengths, (self.depth,)
        return stack_apply(layer_fn, params, x, (), lengths=lengths, policy=policy,
                           layout=layout)

    def choose_lengths(self, x):
        """What ``lengths="auto"`` picks for carries shaped like ``x`` (cached per shape)."""
        graphdef, params = nnx.split(self.layers, nnx.Param)
        one = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)

        def layer_fn(p, c, consts, i):
            return nnx.merge(graphdef, p)(c)

        carry = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        key = ("nnx", graphdef, signature(one), self.depth, self.policy, signature(x))
        return choose_stack_lengths(
            layer_fn, one, carry, (), depth=self.depth, policy=resolve_policy(self.policy),
            memory_budget=self.memory_budget, cache_key=key)
