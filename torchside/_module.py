"""FlaxModule: a Flax Linen module as a torch.nn.Module."""

from __future__ import annotations

import collections
import threading

import jax
import torch

import bridge
import flaxside
from flaxside import LeafSpec, Program, StaleSignature, flat_apply, is_differentiable
from torchside._function import BridgeFunction, Entry
from torchside._signature import arg_names, arg_slots, leaf_dtypes, split_args
from torchside._variables import attach_variables, current_tensors

jtu = jax.tree_util


class FlaxModule(torch.nn.Module):
    """Runs a Flax Linen module inside PyTorch; torch owns its variables.

    ``params`` become ``nn.Parameter``s and every other collection persistent buffers, with
    ``state_dict`` keys equal to the Flax path joined by ``.`` (``params.Dense_0.kernel``;
    stacked scan parameters keep their leading axes). A call converts tensors to JAX without
    copying, runs a jitted program compiled once per call signature, and converts results
    back; gradients reach every parameter and every input that requires grad.

    Args:
        module: a ``flax.linen.Module``.
        example_args: positional arguments for ``module.init`` (tensors or static values).
        example_kwargs: keyword arguments for ``module.init``.
        seed: the seed of ``jax.random.key`` used by ``module.init``.
        variables: initial Flax variables; when given, ``module.init`` is not called.
        cache_size: how many call signatures keep their compiled programs (LRU).

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
        cache_size: int = 32,
    ):
        super().__init__()
        if not isinstance(example_args, tuple | list):
            example_args = (example_args,)
        if variables is None:
            variables = module.init(
                jax.random.key(seed),
                *bridge.tree_to_jax(tuple(example_args)),
                **bridge.tree_to_jax(dict(example_kwargs or {})),
            )
        self.flax_module = module
        self._var_treedef, self._refs, self._var_names = attach_variables(self, variables)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self.cache_size = cache_size
        self._epoch = 0

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
        with self._cache_lock:
            self._cache.clear()
            self._epoch += 1

    @property
    def trace_count(self) -> int:
        """How many times the cached programs were traced (for tests of the cache)."""
        return sum(e.program.trace_count for e in list(self._cache.values()))

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

        variables = jtu.tree_unflatten(self._var_treedef, map(shape, current_tensors(self._refs)))
        args, kwargs = jtu.tree_map(shape, (example_args, example_kwargs))
        return flaxside.memory_report(self.flax_module, *args, variables=variables, **kwargs)

    # -- the call -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Applies the Flax module to pytrees of tensors and returns a pytree of tensors."""
        try:
            return self._call(args, kwargs)
        except StaleSignature:
            # A variable was re-typed behind torch's back (``p.data = ...``): rebuild once.
            self.clear_caches()
            return self._call(args, kwargs)

    def _call(self, args, kwargs):
        tensors, treedef, static_key = split_args(args, kwargs, self._where)
        variables = current_tensors(self._refs)
        grad_on = torch.is_grad_enabled()
        key = (
            treedef,
            static_key,
            tuple((t.shape, t.dtype, t.device, grad_on and t.requires_grad) for t in tensors),
            tuple(v.requires_grad for v in variables) if grad_on else None,
            self._epoch,
            jax.config.jax_enable_x64,
        )
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(key, variables, tensors, treedef, static_key, grad_on)
        leaves = variables + tensors
        if entry.program.diff_index:
            outs = BridgeFunction.apply(entry, *leaves)[: entry.n_out]
        else:
            outs = entry.run(leaves)
        return jtu.tree_unflatten(entry.out_treedef, outs)

    @property
    def _where(self) -> str:
        return f"FlaxModule({type(self.flax_module).__name__})"

    def _build(self, key, variables, tensors, treedef, static_key, grad_on) -> Entry:
        if variables:
            device = variables[0].device
        elif tensors:
            device = tensors[0].device
        else:
            device = torch.device("cpu")
        names = list(self._var_names) + arg_names_of_tensors(treedef, static_key)
        leaves = variables + tensors
        np_dtypes = leaf_dtypes(leaves, names, device, self._where)
        specs = [
            LeafSpec(tuple(t.shape), d, grad_on and t.requires_grad and is_differentiable(d))
            for t, d in zip(leaves, np_dtypes, strict=True)
        ]
        fn = flat_apply(self.flax_module.apply, self._var_treedef, treedef, arg_slots(static_key))
        try:
            program = Program(fn, specs, name=self._where)
        except StaleSignature:
            raise
        except Exception as e:
            if hasattr(e, "add_note"):
                shapes = ", ".join(
                    f"{n}: {t.dtype}{list(t.shape)}"
                    for n, t in zip(names[len(variables) :], tensors, strict=True)
                )
                e.add_note(f"{self._where} was called with {shapes or 'no tensors'}.")
            raise
        entry = Entry(program, np_dtypes, device)
        with self._cache_lock:
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return entry


def arg_names_of_tensors(treedef, static_key) -> list[str]:
    """Names of the tensor leaves only, in order."""
    from flaxside import ARRAY

    return [n for n, s in zip(arg_names(treedef), static_key, strict=True) if s is ARRAY]
