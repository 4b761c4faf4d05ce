"""``remat_stack``: a deep stack of one block, rematerialized at every level (Linen side)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.core.meta
import flax.linen as nn
import jax
from flax import nnx
from jax import lax

from flaxside.stacks._core import stack_apply
from flaxside.stacks._lengths import LengthsChoice, choose_stack_lengths, signature
from flaxside.stacks._nnx import NnxRematStack
from flaxside.stacks._options import check_lengths, resolve_policy

jtu = jax.tree_util


def _block_kwargs(block) -> tuple[type, dict]:
    """A Linen block class and its arguments, from the class or an unbound instance."""
    if isinstance(block, nn.Module):
        fields = [f for f in dataclasses.fields(block)
                  if f.init and f.name not in ("parent", "name")]
        return type(block), {f.name: getattr(block, f.name) for f in fields}
    return block, {}


class RematStack(nn.Module):
    """``depth`` copies of a Linen block applied in sequence, rematerialized at every level.

    Built by ``remat_stack``; see there. Parameters are the block's, stacked with leading
    axes ``lengths`` (``(depth,)`` for ``lengths="auto"``), named as ``nn.remat_scan``
    (one level: ``nn.scan``) would name them. Layer ``i`` draws from RNG stream ``name``
    with ``fold_in(make_rng(name), i)``, so a recomputation sees the same dropout masks.

    Example:
        >>> stack = remat_stack(nn.Dense, 4, lengths=(2, 2), features=3)
        >>> isinstance(stack, RematStack), stack.depth, stack.lengths
        (True, 4, (2, 2))
        >>> x = jnp.ones((2, 3))
        >>> variables = stack.init(jax.random.key(0), x)
        >>> jax.tree.map(jnp.shape, variables["params"])  # leading axes: the lengths
        {'bias': (2, 2, 3), 'kernel': (2, 2, 3, 3)}
        >>> grads = jax.grad(lambda v: stack.apply(v, x).sum())(variables)
        >>> grads["params"]["kernel"].shape
        (2, 2, 3, 3)
    """

    block: Any
    depth: int
    lengths: Any = None
    policy: Any = None
    memory_budget: int | None = None
    block_kwargs: tuple = ()

    def _layer(self) -> nn.Module:
        return self.block(**dict(self.block_kwargs), parent=None)

    def _layer_fn(self):
        layer = self._layer()

        def layer_fn(p, c, keys, i):
            # Keys cross the stack as raw key data: extended dtypes stay out of residuals.
            rngs = {n: jax.random.fold_in(jax.random.wrap_key_data(k), i) for n, k in keys.items()}
            return layer.apply({"params": p}, c, rngs=rngs)

        return layer_fn

    def _layer_shapes(self, x, streams) -> dict:
        carry = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        rngs = {n: jax.random.key(0) for n in ["params", *streams]}
        shapes = jax.eval_shape(self._layer().init, rngs, carry)
        extra = sorted(set(shapes) - {"params"})
        if extra:
            raise NotImplementedError(
                f"remat_stack: the block {self.block.__name__} creates the variable "
                f"collections {extra} besides 'params'; only parameters can be stacked so far. "
                f"Keep such state outside the stack."
            )
        return shapes["params"]

    def choose_lengths(self, x, rng_streams=()) -> LengthsChoice:
        """What ``lengths="auto"`` picks for carries shaped like ``x``; no binding needed.

        Args:
            x: the carry (arrays or shape structs).
            rng_streams: names of the RNG streams the block uses (e.g. ``("dropout",)``).

        Returns:
            A ``LengthsChoice`` (measured once per configuration and shape); ``print`` it
            for the table of measured candidates.

        Example:
            >>> stack = remat_stack(nn.Dense, 4, lengths="auto", features=3)
            >>> choice = stack.choose_lengths(jax.ShapeDtypeStruct((2, 3), "float32"))
            >>> choice.lengths in [(4,), (2, 2)]
            True
        """
        streams = tuple(rng_streams)
        one = self._layer_shapes(x, streams)
        carry = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        keys = {n: jax.random.key_data(jax.random.key(0)) for n in streams}
        key = ("linen", self.block, self.block_kwargs, self.depth, self.policy, streams,
               signature(carry))
        return choose_stack_lengths(
            self._layer_fn(), one, carry, keys, depth=self.depth,
            policy=resolve_policy(self.policy), memory_budget=self.memory_budget, cache_key=key)

    @nn.compact
    def __call__(self, x):
        """Applies the stack to the carry ``x``; returns the carry after the last layer."""
        auto = isinstance(self.lengths, str)
        layout = (self.depth,) if auto else check_lengths(self.lengths, self.depth)
        streams = tuple(n for n in self.scope.rngs if n != "params")
        one = self._layer_shapes(x, streams)
        layer = self._layer()

        def init_stack(rng, name):
            # Flax calls this once per top-level name (and under eval_shape at apply, to
            # check shapes), each with its own key; layer i gets split(rng, depth)[i].
            def init_one(key):
                keys = jax.random.split(key, 1 + len(streams))
                return layer.init(dict(zip(("params", *streams), keys, strict=True)), x)

            stacked = lax.map(init_one, jax.random.split(rng, self.depth))["params"][name]
            stacked = jtu.tree_map(lambda a: a.reshape(layout + a.shape[1:]), stacked)
            return jtu.tree_map(layer_axes, stacked, is_leaf=_is_boxed)

        def layer_axes(x):
            # A layer's partition names (nn.with_logical_partitioning) name one layer's
            # dimensions; the layer axes come first and are named by none (as nn.scan's
            # metadata_params={nn.PARTITION_NAME: None}), else a rule for the first name
            # would shard the layer axis.
            for _ in layout:
                x = x.add_axis(0, {nn.PARTITION_NAME: None}) if _is_boxed(x) else x
            return x

        # Flax checks stored shapes against init_stack's (ScopeParamShapeError).
        params = {n: self.param(n, init_stack, n) for n in one}
        keys = {n: jax.random.key_data(self.make_rng(n)) for n in streams}
        lengths = self.choose_lengths(x, streams).lengths if auto else layout
        return stack_apply(self._layer_fn(), params, x, keys, lengths=lengths,
                           policy=resolve_policy(self.policy), layout=layout)


def _is_boxed(x) -> bool:
    return isinstance(x, flax.core.meta.AxisMetadata)


def _is_nnx(block) -> bool:
    return isinstance(block, type) and issubclass(block, nnx.Module)


def _is_linen(block) -> bool:
    return isinstance(block, nn.Module) or (isinstance(block, type)
                                            and issubclass(block, nn.Module))


def remat_stack(block, depth: int, /, *, lengths=None, policy=None, memory_budget=None,
                rngs=None, name=None, block_kwargs=None, **more_block_kwargs):
    """A module applying ``block`` ``depth`` times with stacked parameters, carry in, carry out.

    Activations are rematerialized at every level of a nested loop: with
    ``lengths=(a, b)`` the forward keeps ``a`` carries, the backward of each outer step
    recomputes its ``b`` carries and then each layer's internals, so held memory grows like
    ``depth ** (1 / len(lengths))`` for one more forward pass per level, and compile time
    does not grow with depth. Unlike ``nn.remat_scan``, the innermost loop body is
    checkpointed too (``nn.remat_scan(Block)`` keeps every internal of the innermost loop's
    layers), and the stack is built from ``jax.lax.scan`` with its own VJP, which reads and
    writes the stacked parameters and gradients in place instead of copying a slice per
    outer step (``examples/stack_speed.py`` measures both). Parameter names and shapes are
    those of ``nn.remat_scan`` (``nn.scan`` for one level). Forward-mode AD (``jax.jvp``)
    is not supported.

    Args:
        block: a ``flax.linen.Module`` class (or an unbound instance) or an ``nnx.Module``
            class, whose ``__call__`` maps a carry to a carry of the same structure.
        depth: the number of layers.
        lengths: loop lengths per level, outermost first, with product ``depth``;
            ``None`` or ``(depth,)`` is one level (``scan`` over a checkpointed block);
            ``"auto"`` measures 1-, 2- and 3-level factorizations with ``memory_report``
            at the first call per input shape and picks the least held + backward temp
            memory (see ``choose_stack_lengths``; ``.choose_lengths(x)`` shows the table);
            parameters then have leading axis ``(depth,)``.
        policy: what each layer keeps for its own backward: a name in
            ``jax.checkpoint_policies`` (``"nothing_saveable"``, ``"dots_saveable"``, ...)
            or a policy callable; default: nothing but its input. The outer levels always
            keep only carries (``nn.remat_scan(policy=...)`` applies it at every level,
            where ``"dots_saveable"`` keeps every layer's dots).
        memory_budget: with ``lengths="auto"``: bytes of held + backward temp memory;
            picks the fewest levels that fit.
        rngs: ``nnx.Rngs`` for NNX blocks (split across layers); unused for Linen.
        name: the Linen module's name.
        block_kwargs: arguments of ``block``'s constructor, as a dict: for a block field
            that shares a name with an argument of ``remat_stack`` (``lengths``,
            ``policy``, ``memory_budget``, ``rngs``, ``name``, ``block_kwargs``).
        **more_block_kwargs: arguments of ``block``'s constructor (a field named
            ``depth`` or ``block`` too: those two arguments are positional).

    Returns:
        A Linen ``RematStack`` or an ``NnxRematStack``.

    Raises:
        ValueError: lengths whose product is not ``depth``, an unknown policy name,
            ``memory_budget`` without ``lengths="auto"``, or an NNX block without ``rngs``.
        TypeError: ``block`` is neither a Linen nor an NNX module.

    Example:
        >>> import jax.numpy as jnp
        >>> stack = remat_stack(nn.Dense, 16, lengths=(4, 4), features=8)
        >>> x = jnp.ones((2, 8))
        >>> variables = stack.init(jax.random.key(0), x)
        >>> variables["params"]["kernel"].shape
        (4, 4, 8, 8)
        >>> stack.apply(variables, x).shape
        (2, 8)
    """
    block_kwargs = {**(block_kwargs or {}), **more_block_kwargs}
    if memory_budget is not None and lengths != "auto":
        raise ValueError(
            f"remat_stack: memory_budget={memory_budget} is only used with lengths='auto', "
            f"but lengths is {lengths!r}. Pass lengths='auto' or drop memory_budget."
        )
    if isinstance(lengths, str) and lengths != "auto":
        raise ValueError(
            f"remat_stack: lengths={lengths!r} is not an option; pass 'auto', None or a tuple "
            f"of ints whose product is {depth}."
        )
    if not isinstance(lengths, str):
        check_lengths(lengths, depth)
    resolve_policy(policy)
    if _is_nnx(block):
        if rngs is None:
            raise ValueError(
                f"remat_stack: block {block.__name__} is an NNX module, so rngs= is needed "
                f"(e.g. rngs=nnx.Rngs(0)) to initialize its {depth} layers."
            )
        return NnxRematStack(block, depth, lengths=lengths, policy=policy,
                             memory_budget=memory_budget, rngs=rngs, block_kwargs=block_kwargs)
    if _is_linen(block):
        cls, kwargs = _block_kwargs(block)
        kwargs.update(block_kwargs)
        return RematStack(cls, depth, lengths=lengths, policy=policy,
                          memory_budget=memory_budget, block_kwargs=tuple(sorted(kwargs.items())),
                          name=name)
    raise TypeError(
        f"remat_stack: argument 'block' is {block!r}, but a flax.linen.Module class or "
        f"instance, or an nnx.Module class was expected."
    )
