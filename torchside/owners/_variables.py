"""Flax variables as torch parameters and buffers, named by their Flax path."""

from __future__ import annotations

import jax
import torch

import bridge
from flaxside.internal import nnx_merged, nnx_state
from torchside import _errors
from torchside.owners._sharded import assign, assign_shard


class FlaxScope(torch.nn.Module):
    """A namespace for the variables of one Flax scope; it has no forward of its own.

    Its forward pre-hooks run before every forward of the ``FlaxModule`` that owns it, as
    if it were called: hook-based weight transforms (``torch.nn.utils.prune``, the older
    ``weight_norm`` and ``spectral_norm``) recompute the weight there.
    """

    def forward(self, *args, **kwargs):  # noqa: D102
        raise _errors.scope_called()


def attach_variables(root: torch.nn.Module, names, is_param, values, device: torch.device):
    """Registers variable leaves on ``root`` under their Flax paths.

    Parameters become ``nn.Parameter``s, the rest persistent buffers; both own a copy of
    the values (torch owns the state, JAX only borrows it for a call). Entries are written
    straight into ``_parameters``/``_modules``/``_buffers`` so that a Flax name such as
    ``train`` or ``to`` cannot collide with a torch attribute.

    Args:
        root: the module to attach to.
        names: the dotted Flax path of each leaf (no part contains a dot).
        is_param: per leaf, whether it is a parameter.
        values: per leaf, its JAX array (on any device), or its ``jax.ShapeDtypeStruct``
            where ``device`` is ``meta``.
        device: the torch device the tensors are made on.

    Returns:
        ``(refs, scopes)``: per leaf ``(scope, name, is_param)``, and every scope made.
    """
    refs, scopes = [], []
    # On the meta device nothing is computed or copied: the values may be abstract.
    target = None if device.type == "meta" else bridge.jax_device(device, name="variables")
    for dotted, param, value in zip(names, is_param, values, strict=True):
        keys = dotted.split(".")
        scope = root
        for k in keys[:-1]:
            child = scope._modules.get(k)
            if child is None:
                child = FlaxScope()
                scope._modules[k] = child
                scopes.append(child)
            scope = child
        if target is None:
            tensor = torch.empty(value.shape, dtype=bridge.torch_dtype(value.dtype),
                                 device=device)
        else:
            tensor = bridge.to_torch(jax.device_put(value, target), copy=True, name=dotted)
        if param:
            scope._parameters[keys[-1]] = torch.nn.Parameter(
                tensor, requires_grad=bool(tensor.is_floating_point() or tensor.is_complex())
            )
        else:
            scope._buffers[keys[-1]] = tensor
        refs.append((scope, keys[-1], param))
    return tuple(refs), tuple(scopes)


class FlaxVariables:
    """What a ``FlaxModule`` offers for its Flax variables (mixed into it).

    Zero-copy views as Flax state, loading Flax state, running the init again. It reads
    the module's adapter (``_adapter``), variable references (``_refs``), initializer and
    caller. What sharding adds is ``ShardedVariables`` (``_sharded.py``).
    """

    @property
    def flax_module(self):
        """The Flax module: the Linen module given, or an NNX module over torch's state.

        For NNX it is merged from the current parameters and buffers (zero-copy views), in
        the graph and train/eval mode a call would use; the module given to the constructor
        is not kept (its arrays would be a second copy of every parameter).
        """
        if not self._nnx:
            return self._linen
        return nnx_merged(self._graph.graphdef, self.flax_variables(), self.training)

    # -- moving weights between worlds --------------------------------------------------
    def flax_variables(self):
        """The current parameters and buffers as Flax state (zero-copy views).

        Linen: the variables dict (``{"params": ..., "batch_stats": ...}``). NNX: a
        ``(params, rest)`` pair of ``nnx.State`` to pass to ``nnx.merge(graphdef, ...)``.
        Key-typed state comes back as typed keys and unsigned state in its own dtype (torch
        holds them as raw int32 data); other arrays share memory with the torch tensors.

        Example:
            >>> import flax.linen as nn
            >>> m = FlaxModule(nn.Dense(3), example_args=(torch.zeros(1, 2),))
            >>> m.flax_variables()["params"]["kernel"].shape
            (2, 3)
        """
        return self._adapter.variables(
            [bridge.to_jax(t.detach(), name=n) for t, n in
             zip(self._current_tensors(), self._adapter.names, strict=True)]
        )

    def flax_variable_tensors(self):
        """The parameters and buffers themselves, as torch tensors in Flax's structure.

        The structure of ``flax_variables()`` (Linen: the variables dict; NNX: the
        ``(params, rest)`` pair), with the module's own tensors as leaves: pass it to a
        ``jax_function``, which sees Flax variables and sends the gradients to these
        parameters. This is the fast path where torch would differentiate a block again
        and again for one loss (a PINN's residual, a gradient penalty): the whole loss,
        its derivatives included, is one JAX function, one program that
        ``jit(value_and_grad)`` would compile. Key-typed and unsigned state come as torch
        holds them (raw ``int32`` data), not as typed keys. A weight that a forward pre-hook
        of its scope recomputes (pruning, the older ``weight_norm``) comes as a call reads it.

        Raises:
            NotImplementedError: the module is sharded (``torchside.shard``): a
                ``jax_function`` would see each rank's shards, not the block's parameters.

        Example:
            >>> import flax.linen as nn, jax, jax.numpy as jnp
            >>> from torchside import jax_function
            >>> dense = nn.Dense(1)
            >>> m = FlaxModule(dense, example_args=(torch.zeros(1, 2),))
            >>> @jax_function
            ... def input_gradient_penalty(variables, x):
            ...     gx = jax.grad(lambda x: dense.apply(variables, x).sum())(x)
            ...     return jnp.mean((jnp.linalg.norm(gx, axis=1) - 1) ** 2)
            >>> input_gradient_penalty(m.flax_variable_tensors(), torch.randn(4, 2)).backward()
            >>> m.params.kernel.grad.shape
            torch.Size([2, 1])
        """
        if self._caller.plan is not None:
            raise _errors.sharded_variable_tensors(self._caller.where)
        return jax.tree_util.tree_unflatten(self._adapter.treedef, self._variables())

    def load_flax_variables(self, variables) -> None:
        """Copies Flax variables (same structure as ``flax_variables()``) into the module.

        Raises:
            ValueError: the structure differs, or a leaf's shape differs (names the path).
        """
        leaves = self._adapter.leaf_values(variables)
        targets = self._current_tensors()
        for name, t, leaf in zip(self._adapter.names, targets, leaves, strict=True):
            if tuple(leaf.shape) != tuple(t.shape):
                raise _errors.flax_shape(name, tuple(leaf.shape), tuple(t.shape))
        with torch.no_grad():
            for name, t, leaf in zip(self._adapter.names, targets, leaves, strict=True):
                assign(t, leaf, name)

    def reset_parameters(self) -> None:
        """Computes the initial parameters and buffers again, in place, with the module's seed.

        The values equal those of a module built directly with the same arguments, bit for
        bit (a Linen module's init runs on zeros shaped like ``example_args``: see
        ``_initializer.py``), computed on the device the variables are on. This is the
        deferred-init recipe of PyTorch and FSDP2: build under ``torch.device("meta")``
        (nothing is allocated), shard, ``to_empty(device=...)``, then ``reset_parameters()``
        on every module that has it. Parameters sharded as DTensors (FSDP2) get their own
        shard of the values.

        Raises:
            RuntimeError: the variables are still on the meta device (call ``to_empty``
                first), or the module was built from ``variables=`` or an NNX module
                instance, whose init cannot be run again.
        """
        where = self._caller.where
        if self._initializer is None:
            raise _errors.no_initializer(where, self._nnx)
        targets = self._current_tensors()
        device = next((t.device for t in targets), torch.device("cpu"))
        if device.type == "meta":
            raise _errors.reset_on_meta(where)
        plan = self._caller.plan
        if plan is not None:  # each rank computes its own shards only
            shardings = [plan.sharding(spec) for spec in plan.specs]
            values = self._initializer.sharded_values(
                self._adapter.treedef.unflatten(shardings))
            leaves = [x.addressable_data(0) for x in self._adapter.leaf_values(values)]
        else:
            values = self._initializer.values(device)
            if self._nnx:
                values = nnx_state(values)
            leaves = self._adapter.leaf_values(values)
        put = assign if plan is None else assign_shard
        with torch.no_grad():
            for name, t, leaf in zip(self._adapter.names, targets, leaves, strict=True):
                put(t, leaf, name)
