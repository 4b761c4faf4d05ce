"""FlaxModule: a Flax (Linen or NNX) module as a torch.nn.Module."""

from __future__ import annotations

import jax
import torch

import bridge
import flaxside
from flaxside import adapter_for, init_linen, key_data_shape
from torchside._caller import Caller
from torchside._compile import compiled_call, register_module
from torchside._variables import attach_variables, current_tensors

jtu = jax.tree_util


class FlaxModule(torch.nn.Module):
    """Runs a Flax Linen or NNX module inside PyTorch; torch owns its variables.

    Parameters (Linen's ``params`` collection, NNX's ``nnx.Param``) become
    ``nn.Parameter``s and all other state persistent buffers, with ``state_dict`` keys equal
    to the Flax path joined by ``.`` (``params.Dense_0.kernel`` for Linen,
    ``layers.0.kernel`` for NNX; stacked scan parameters keep their leading axes). A call
    converts tensors to JAX without copying, runs a program compiled once per call
    signature, and converts results back; gradients reach every parameter and every input
    that requires grad.

    Train and eval: in ``train()`` mode non-parameter state (``batch_stats``, counters) is
    applied as mutable and the buffers are updated after each forward; in ``eval()`` mode it
    is read-only. ``train_kwarg`` names the Linen keyword that receives the mode
    (``"train"`` gets ``self.training``; ``"deterministic"`` and ``"use_running_average"``
    get its negation). NNX modules follow ``.train()``/``.eval()`` by themselves.

    Args:
        module: a ``flax.linen.Module`` or ``flax.nnx.Module``.
        example_args: positional arguments for Linen ``module.init`` (tensors or static values).
        example_kwargs: keyword arguments for Linen ``module.init``.
        seed: the seed of ``jax.random.key`` used by Linen ``module.init``.
        variables: initial Linen variables; when given, ``module.init`` is not called.
        rngs: RNG stream names (e.g. ``("dropout",)``); each forward draws their keys from
            torch's default generator, so ``torch.manual_seed`` makes runs reproducible, and
            the backward (and any recompute) reuses the forward's keys.
        train_kwarg: the Linen keyword argument that receives the train/eval mode.
        residuals: ``"save"`` holds exactly what the Flax remat policy keeps between forward
            and backward; ``"recompute"`` holds only the inputs and reruns the forward in the
            backward, like ``torch.utils.checkpoint`` around the whole block.
        autocast: behaviour under ``torch.autocast``: ``"outputs"`` (default) runs the
            block in its parameters' dtype and casts floating outputs to the autocast dtype,
            as torch casts a Linear's output; ``"inputs"`` casts floating inputs and
            parameters to the autocast dtype (gradients flow back to the full-precision
            parameters, as with torch's own autocast) and runs the block in it; ``"off"``
            ignores autocast.
        cache_size: how many call signatures keep their compiled programs (LRU).
        recompile_warning: after this many distinct call signatures, warn once with a
            ``RecompileWarning`` naming the changing dimension; ``None`` never warns.

    Example:
        >>> import flax.linen as nn
        >>> layer = FlaxModule(nn.Dense(3), example_args=(torch.zeros(2, 4),))
        >>> sorted(k for k, _ in layer.named_parameters())
        ['params.bias', 'params.kernel']
        >>> layer(torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        module,
        example_args=(),
        example_kwargs=None,
        *,
        seed: int = 0,
        variables=None,
        rngs: tuple[str, ...] | str = (),
        train_kwarg: str | None = None,
        residuals: str = "save",
        autocast: str = "outputs",
        cache_size: int = 32,
        recompile_warning: int | None = 8,
    ):
        super().__init__()
        if autocast not in AUTOCAST_MODES:
            raise ValueError(
                f"FlaxModule: autocast={autocast!r} is not one of {AUTOCAST_MODES}: 'outputs' "
                f"runs the block in its own dtype and casts its floating outputs to the "
                f"autocast dtype, 'inputs' runs it in the autocast dtype, 'off' ignores "
                f"autocast."
            )
        self.autocast = autocast
        rngs = (rngs,) if isinstance(rngs, str) else tuple(rngs)
        if not isinstance(example_args, tuple | list):
            example_args = (example_args,)
        if variables is None and hasattr(module, "init") and not _is_nnx(module):
            init_rngs = {"params": jax.random.key(seed)}
            init_rngs.update({name: jax.random.key(seed + 1 + i) for i, name in enumerate(rngs)})
            variables = init_linen(module, init_rngs, bridge.tree_to_jax(tuple(example_args)),
                                   bridge.tree_to_jax(dict(example_kwargs or {})))
        self.flax_module = module
        self._adapter = adapter_for(module, variables, rng_streams=rngs, train_kwarg=train_kwarg)
        self._refs, self._var_names = attach_variables(self, self._adapter.leaves)
        self._var_treedef = self._adapter.treedef
        self._state_treedef = jtu.tree_structure((self._var_treedef.unflatten(
            [0] * len(self._refs)), None if not rngs else 0))
        self._rng_shape = (len(rngs), *key_data_shape()) if rngs else None
        self._leaf_names = self._var_names + ("rngs",) * bool(rngs)
        self._leaf_is_param = tuple(p for _, _, p in self._refs) + (False,) * bool(rngs)
        where = f"FlaxModule({type(module).__name__})"
        self._caller = Caller(self._make_apply, where=where, residuals=residuals,
                              cache_size=cache_size, recompile_warning=recompile_warning)
        self._bridge_id = register_module(self)

    # -- torch hooks that replace or re-type the variables ------------------------------
    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.clear_caches()
        return out

    def load_state_dict(self, *args, **kwargs):  # noqa: D102
        result = super().load_state_dict(*args, **kwargs)
        self.clear_caches()
        return result

    def clear_caches(self) -> None:
        """Drops every compiled program; the next call compiles again."""
        self._caller.clear()

    @property
    def cache_size(self) -> int:
        """How many call signatures keep their compiled programs."""
        return self._caller.cache_size

    @property
    def trace_count(self) -> int:
        """How many times the cached programs were traced (for tests of the cache)."""
        return sum(e.program.trace_count for e in self._caller.entries)

    def memory_report(self, *example_args, **example_kwargs):
        """What a training call with these arguments holds and needs; nothing runs.

        Delegates to ``flaxside.memory_report`` with the shapes of the current variables
        and of the tensor arguments (every floating one is differentiated).

        Returns:
            A ``flaxside.MemoryReport``; ``print`` it for a table.

        Example:
            >>> import flax.linen as nn
            >>> layer = FlaxModule(nn.Dense(3), example_args=(torch.zeros(2, 4),))
            >>> layer.memory_report(torch.zeros(2, 4)).param_bytes
            60
        """
        def shape(t):
            if not isinstance(t, torch.Tensor):
                return t
            return jax.ShapeDtypeStruct(tuple(t.shape), bridge.numpy_dtype(t.dtype))

        args, kwargs = jtu.tree_map(shape, (example_args, example_kwargs))
        if self._adapter.kind == "nnx":  # the module carries its state; only shapes matter
            return flaxside.memory_report(self.flax_module, *args, **kwargs)
        variables = jtu.tree_unflatten(self._var_treedef, map(shape, current_tensors(self._refs)))
        return flaxside.memory_report(self.flax_module, *args, variables=variables, **kwargs)

    # -- the call -----------------------------------------------------------------------
    def _make_apply(self, training: bool):
        # apply returns (outputs, updates); updates replace these variable leaves
        apply, targets = self._adapter.make_apply(training)
        return apply, True, targets

    def _call_variables(self) -> list[torch.Tensor]:
        variables = current_tensors(self._refs)
        if self._rng_shape is not None:
            # From torch's default generator: torch.manual_seed reproduces the run, and
            # torch.utils.checkpoint's RNG-state replay reproduces the key on recompute.
            variables.append(torch.randint(-(2**31), 2**31 - 1, self._rng_shape,
                                           dtype=torch.int32))
        return variables

    def forward(self, *args, **kwargs):
        """Applies the Flax module to pytrees of tensors and returns a pytree of tensors."""
        if torch.compiler.is_compiling():
            return compiled_call(self, args, kwargs)
        variables = self._call_variables()
        leaves = variables
        cast = self._autocast_dtype(variables)
        if cast is not None and self.autocast == "inputs":
            leaves = [_cast(v, cast) if is_param else v
                      for v, is_param in zip(variables, self._leaf_is_param, strict=True)]
            args, kwargs = jtu.tree_map(lambda t: _cast(t, cast), (args, kwargs),
                                        is_leaf=lambda x: isinstance(x, torch.Tensor))
        outs, updates, entry = self._caller(
            leaves, self._state_treedef, self._leaf_names, args, kwargs,
            context=self.training,
        )
        if updates:
            with torch.no_grad():
                for i, new in zip(entry.aux_targets, updates, strict=True):
                    variables[i].copy_(new)
        if cast is not None and self.autocast == "outputs":
            outs = jtu.tree_map(lambda t: _cast(t, cast), outs)
        return outs

    def _autocast_dtype(self, variables):
        if self.autocast == "off":
            return None
        device_type = variables[0].device.type if variables else "cpu"
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)

    # -- dtype and device moves ---------------------------------------------------------
    def to(self, *args, **kwargs):  # noqa: D102
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        _check_wide(dtype, "to")
        return super().to(*args, **kwargs)

    def double(self):  # noqa: D102
        _check_wide(torch.float64, "double")
        return super().double()

    # -- moving weights between worlds --------------------------------------------------
    def flax_variables(self):
        """The current parameters and buffers as Flax state (zero-copy views).

        Linen: the variables dict (``{"params": ..., "batch_stats": ...}``). NNX: a
        ``(params, rest)`` pair of ``nnx.State`` to pass to ``nnx.merge(graphdef, ...)``;
        keys are raw key data. The arrays share memory with the torch tensors.

        Example:
            >>> import flax.linen as nn
            >>> m = FlaxModule(nn.Dense(3), example_args=(torch.zeros(1, 2),))
            >>> m.flax_variables()["params"]["kernel"].shape
            (2, 3)
        """
        return self._adapter.variables(
            [bridge.to_jax(t, name=n) for t, n in
             zip(current_tensors(self._refs), self._var_names, strict=True)]
        )

    def load_flax_variables(self, variables) -> None:
        """Copies Flax variables (same structure as ``flax_variables()``) into the module.

        Raises:
            ValueError: the structure differs, or a leaf's shape differs (names the path).
        """
        leaves, treedef = jtu.tree_flatten(variables)
        if treedef != self._var_treedef:
            raise ValueError(
                f"load_flax_variables: the variables have structure {treedef}, expected "
                f"{self._var_treedef}. Pass what flax_variables() returns for this module."
            )
        targets = current_tensors(self._refs)
        for name, t, leaf in zip(self._var_names, targets, leaves, strict=True):
            if tuple(leaf.shape) != tuple(t.shape):
                raise ValueError(
                    f"load_flax_variables: '{name}' has shape {tuple(leaf.shape)}, expected "
                    f"{tuple(t.shape)}."
                )
        with torch.no_grad():
            for name, t, leaf in zip(self._var_names, targets, leaves, strict=True):
                t.copy_(bridge.to_torch(jax.numpy.asarray(leaf), name=name))


AUTOCAST_MODES = ("outputs", "inputs", "off")


def _cast(t, dtype):
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def _check_wide(dtype, method: str) -> None:
    if dtype in (torch.float64, torch.complex128) and not jax.config.jax_enable_x64:
        raise TypeError(
            f"FlaxModule.{method}: moving to {dtype} needs JAX's 64-bit mode, which is off, "
            f"so JAX would silently compute in 32 bits. Enable it before the first call with "
            f"jax.config.update('jax_enable_x64', True), or keep the module in float32."
        )


def _is_nnx(module) -> bool:
    from flax import nnx

    return isinstance(module, nnx.Module)
