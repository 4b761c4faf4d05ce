"""jax_function: a plain JAX function as a torch callable with autograd."""

from __future__ import annotations

import functools as ft
from collections.abc import Callable

from torchside.call._call import Caller, function_settings
from torchside.call._owner import CallerOwner
from torchside.call._resolve import resolve
from torchside.edges._edges import EDGES


class JaxFunction(CallerOwner):
    """A JAX function called with torch tensors, as ``jax_function`` makes it.

    Args:
        fn: the JAX function.
        residuals: ``"save"``, ``"split"`` or ``"recompute"`` (see ``FlaxModule``).
        cache_size: how many call signatures keep their compiled programs (LRU).
        recompile_warning: warn once after this many distinct call signatures; ``None``
            never warns.

    Example:
        >>> import jax.numpy as jnp, torch
        >>> f = JaxFunction(lambda x: jnp.sin(x) * 2, cache_size=4)
        >>> f(torch.zeros(3)).tolist(), f.cache_size
        ([0.0, 0.0, 0.0], 4)
    """

    def __init__(self, fn: Callable, *, residuals: str = "save", cache_size: int = 32,
                 recompile_warning: int | None = 8):
        ft.update_wrapper(self, fn)
        self.fn = fn
        name = getattr(fn, "__name__", type(fn).__name__)
        self._caller = Caller(function_settings(f"jax_function({name})", fn), EDGES,
                              residuals=residuals, cache_size=cache_size,
                              recompile_warning=recompile_warning)

    def __call__(self, *args, **kwargs):
        """Runs ``fn`` on pytrees of tensors (and static values); returns tensors."""
        caller = self._caller
        return caller(resolve([], args, kwargs, mode=None, where=caller.where))


def jax_function(fn: Callable | None = None, *, residuals: str = "save", cache_size: int = 32,
                 recompile_warning: int | None = 8):
    """Turns ``fn(*pytrees, **kwargs)`` written in JAX into a torch callable with autograd.

    Every tensor leaf of the arguments becomes a JAX array without a copy; non-tensor leaves
    (numbers, strings, bools, None) are static and part of the compile key (``0.0`` and
    ``-0.0``, ``1``, ``1.0`` and ``True`` compile apart). Gradients flow to every tensor
    argument that requires grad, with torch's convention for complex tensors. Caching,
    residual handling and conversion rules are those of ``FlaxModule``.

    Args:
        fn: the JAX function; returns an array or a pytree of arrays. Usable as a decorator
            with or without arguments.
        residuals: ``"save"``, ``"split"`` or ``"recompute"`` (see ``FlaxModule``).
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
