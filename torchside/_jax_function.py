"""jax_function: a plain JAX function as a torch callable with autograd."""

from __future__ import annotations

import functools as ft
from collections.abc import Callable

import jax

from torchside._caller import Caller

_NO_STATE = jax.tree_util.tree_structure(((), None))


class JaxFunction:
    """A JAX function called with torch tensors; see ``jax_function``."""

    def __init__(self, fn: Callable, *, residuals: str = "save", cache_size: int = 32,
                 recompile_warning: int | None = 8):
        ft.update_wrapper(self, fn)
        self.fn = fn
        name = getattr(fn, "__name__", type(fn).__name__)

        def make_apply(_context):
            return (lambda _state, *args, **kwargs: (fn(*args, **kwargs), [])), True, ()

        self._caller = Caller(make_apply, where=f"jax_function({name})", residuals=residuals,
                              cache_size=cache_size, recompile_warning=recompile_warning)

    def __call__(self, *args, **kwargs):
        """Runs ``fn`` on pytrees of tensors (and static values); returns tensors."""
        outs, _, _ = self._caller([], _NO_STATE, (), args, kwargs)
        return outs

    def clear_caches(self) -> None:
        """Drops every compiled program; the next call compiles again."""
        self._caller.clear()

    @property
    def trace_count(self) -> int:
        """How many times the cached programs were traced."""
        return sum(e.program.trace_count for e in self._caller.entries)


def jax_function(fn: Callable | None = None, *, residuals: str = "save", cache_size: int = 32,
                 recompile_warning: int | None = 8):
    """Turns ``fn(*pytrees, **kwargs)`` written in JAX into a torch callable with autograd.

    Every tensor leaf of the arguments becomes a JAX array without a copy; non-tensor leaves
    (numbers, strings, bools, None) are static and part of the compile key. Gradients flow
    to every tensor argument that requires grad. Caching, residual handling and conversion
    rules are those of ``FlaxModule``.

    Args:
        fn: the JAX function; returns an array or a pytree of arrays. Usable as a decorator
            with or without arguments.
        residuals: ``"save"`` or ``"recompute"`` (see ``FlaxModule``).
        cache_size: how many call signatures keep their compiled programs (LRU).
        recompile_warning: after this many distinct call signatures, warn once with a
            ``RecompileWarning`` naming what changes; ``None`` never warns.

    Returns:
        A ``JaxFunction``, callable like ``fn`` but with torch tensors.

    Example:
        >>> import jax.numpy as jnp, torch
        >>> @jax_function
        ... def f(x, w):
        ...     return jnp.tanh(x @ w)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> f(x, torch.randn(3, 4)).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 3])
    """
    if fn is None:
        return ft.partial(jax_function, residuals=residuals, cache_size=cache_size,
                          recompile_warning=recompile_warning)
    return JaxFunction(fn, residuals=residuals, cache_size=cache_size,
                       recompile_warning=recompile_warning)
