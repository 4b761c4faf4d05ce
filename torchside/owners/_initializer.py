"""How a ``FlaxModule``'s first variables are made, and made again by ``reset_parameters``.

A Linen module's are ``module.init`` on the example arguments; an NNX module's, when the
``FlaxModule`` is given a factory (a function of ``nnx.Rngs`` that returns the module),
are what the factory builds. Either runs on the JAX device of the module's torch device,
so a host whose default JAX device is a GPU does not decide for it. On torch's ``meta``
device nothing is computed: ``jax.eval_shape`` gives the shapes and dtypes, and
``reset_parameters`` computes the values once the module has memory (``to_empty``).

Example tensors cross as call arguments do (int64 narrowed to int32 after a range check).
What is kept to make the variables again is the example arguments' shapes and dtypes,
never their values: ``reset_parameters`` runs ``init`` on zeros of those shapes, which
equals the first init for every module whose parameters do not depend on its inputs'
values (Flax's layers, whose initializers read shapes only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

import bridge
from flaxside.internal import build_nnx, init_linen, nnx_shapes, nnx_state
from torchside import _errors

jtu = jax.tree_util


class Initializer:
    """Makes a module's Flax variables: its Linen init or its NNX factory, with its seed.

    Args:
        module: a Linen module, or an NNX factory (``factory(rngs) -> nnx.Module``).
        seed: the seed of the ``params`` key (Linen; the RNG streams get ``seed + 1 + i``)
            or of ``nnx.Rngs(seed)`` (NNX).
        rngs: the Linen RNG stream names.
        args: Linen example arguments (tensors or static values).
        kwargs: Linen example keyword arguments.
        where: the owner's name for messages.
    """

    def __init__(self, module, seed: int, rngs: tuple = (), args: tuple = (),
                 kwargs: dict | None = None, where: str = "FlaxModule"):
        self.module, self.seed, self.rngs, self.where = module, seed, tuple(rngs), where
        self.nnx = not hasattr(module, "init")
        self.args = _abstract(tuple(args), "example_args", where)
        self.kwargs = _abstract(dict(kwargs or {}), "example_kwargs", where)

    def shapes(self):
        """The variables as ``jax.ShapeDtypeStruct``s, computing nothing (``meta``)."""
        if self.nnx:
            return nnx_shapes(self.module, self.seed)
        leaves, treedef = jtu.tree_flatten((self.args, self.kwargs))
        shaped = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]

        def init(arrays):  # static example values stay Python values
            full = list(leaves)
            for i, a in zip(shaped, arrays, strict=True):
                full[i] = a
            return self._init(*jtu.tree_unflatten(treedef, full), None)

        return jax.eval_shape(init, [leaves[i] for i in shaped])

    def values(self, device: torch.device, args=None, kwargs=None):
        """The variables computed on the JAX device of ``device``.

        Linen: ``args``/``kwargs`` are the example arguments as given (their values);
        ``None`` runs init on zeros of the kept shapes. NNX: the module the factory builds.
        """
        target = bridge.jax_device(device, name="variables")
        if self.nnx:
            with jax.default_device(target):
                return build_nnx(self.module, self.seed)
        if args is None:
            args, kwargs = _zeros(self.args), _zeros(self.kwargs)
        else:
            args = _examples(tuple(args), "example_args", self.where)
            kwargs = _examples(dict(kwargs or {}), "example_kwargs", self.where)
        return self._init(args, kwargs, target)

    def sharded_values(self, out_shardings):
        """The variables, computed by one jitted program with sharded outputs.

        ``out_shardings`` is a tree like the variables: over a mesh of processes
        each process computes only its own shards (NOTE [Sharded blocks] in
        ``integrations/_shard.py``). The values are those of ``values``: JAX's
        random bits do not depend on the sharding.
        """
        if self.nnx:
            return jax.jit(lambda: nnx_state(build_nnx(self.module, self.seed)),
                           out_shardings=out_shardings)()
        leaves, treedef = jtu.tree_flatten((self.args, self.kwargs))

        def init():  # no array arguments: each process makes its inputs inside
            full = [jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct)
                    else x for x in leaves]
            return self._init(*jtu.tree_unflatten(treedef, full), None)

        return jax.jit(init, out_shardings=out_shardings)()

    def _init(self, args, kwargs, device):
        init_rngs = {"params": jax.random.key(self.seed)}
        init_rngs.update({name: jax.random.key(self.seed + 1 + i)
                          for i, name in enumerate(self.rngs)})
        try:
            return init_linen(self.module, init_rngs, args, kwargs, device=device)
        except TypeError as e:
            if args or kwargs or "argument" not in str(e):
                raise
            raise _errors.no_example_args(self.where, e) from e


def _map_tensors(tree, fn, label: str):
    paths, treedef = jtu.tree_flatten_with_path(tree)
    return jtu.tree_unflatten(treedef, [
        fn(x, f"{label}{jtu.keystr(p)}") if isinstance(x, torch.Tensor) else x
        for p, x in paths])


def _abstract(tree, label: str, where: str):
    """Example tensors as the shapes and dtypes JAX sees (int64 as int32); statics as given."""
    def shape(t, name):
        dtype = torch.int32 if bridge.internal.narrows_to_int32(t.dtype) else t.dtype
        try:
            np_dtype = bridge.numpy_dtype(dtype, name=name)
        except TypeError as e:
            raise _errors.for_owner(e, where) from None
        return jax.ShapeDtypeStruct(tuple(t.shape), np_dtype)

    return _map_tensors(tree, shape, label)


def _examples(tree, label: str, where: str):
    """Example tensors as JAX arrays, int64 narrowed as calls narrow it."""
    def example(t, name):
        if bridge.internal.narrows_to_int32(t.dtype):
            try:
                t = bridge.internal.narrow_to_int32(t, name=name)
            except TypeError as e:
                raise _errors.for_owner(e, where) from None
        return bridge.to_jax(t, name=name)

    return _map_tensors(tree, example, label)


def _zeros(tree):
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(
        s, jax.ShapeDtypeStruct) else s, tree)
