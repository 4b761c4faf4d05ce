"""``lengths="auto"``: pick the loop nesting of a stack by measuring compiled memory."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax

from flaxside.program._compiling_for import jax_default_device, target_device
from flaxside.stacks._core import stack_apply
from flaxside.stacks._memory import format_bytes, memory_report

jtu = jax.tree_util
logger = logging.getLogger("flaxside")

#: Factorizations measured per level count (2 and 3 levels): those with the smallest sum
#: of lengths. Memory grows roughly with that sum (lengths[0] carries held, then one inner
#: segment's carries rebuilt per level in the backward); the rest are not worth a compile.
CANDIDATES_PER_LEVEL = 4

_MEASURED: dict = {}  # lengths="auto" tables, per stack configuration and input signature


def cached(key, compute):
    """``compute()`` once per hashable ``key``; compiling every candidate is not cheap."""
    try:
        hash(key)
    except TypeError:  # an unhashable block argument: measure again
        return compute()
    if key not in _MEASURED:
        _MEASURED[key] = compute()
    return _MEASURED[key]


def _measuring_device():
    """Where the stack will run, so that memory is measured for that backend.

    The device of the program being traced (``Program``), else JAX's default device (a
    stack used from plain JAX).
    """
    return target_device() or jax_default_device()


def signature(tree) -> tuple:
    """A hashable summary of a pytree of arrays: structure, shapes, dtypes, platform."""
    leaves, treedef = jtu.tree_flatten(tree)
    return (treedef, tuple((a.shape, str(a.dtype)) for a in leaves),
            _measuring_device().platform)


def factorizations(depth: int, levels: int) -> list[tuple[int, ...]]:
    """Ordered factorizations of ``depth`` into ``levels`` factors, each at least 2."""
    if levels == 1:
        return [(depth,)]
    out = []
    for a in range(2, depth // 2 + 1):
        if depth % a == 0:
            out += [(a, *rest) for rest in factorizations(depth // a, levels - 1)
                    if all(r >= 2 for r in rest)]
    return out


def candidate_lengths(depth: int) -> list[tuple[int, ...]]:
    """One level, then the few 2- and 3-level factorizations worth measuring."""
    out = [(depth,)]
    for levels in (2, 3):
        ranked = sorted(factorizations(depth, levels), key=lambda f: (sum(f), f))
        out += ranked[:CANDIDATES_PER_LEVEL]
    return out


@dataclasses.dataclass(frozen=True)
class LengthsChoice:
    """The lengths ``lengths="auto"`` chose, why, and every candidate it measured.

    Attributes:
        lengths: the chosen loop lengths, outermost first.
        reason: one sentence saying why.
        table: ``(lengths, held_bytes, backward_temp_bytes, compile_seconds)`` per candidate.

    Example:
        >>> layer = lambda p, c, keys, i: c + jnp.tanh(c @ p)
        >>> kernel = jax.ShapeDtypeStruct((4, 4), "float32")
        >>> carry = jax.ShapeDtypeStruct((2, 4), "float32")
        >>> choice = choose_stack_lengths(layer, kernel, carry, (), depth=4)
        >>> [row[0] for row in choice.table]  # the candidates measured
        [(4,), (2, 2)]
        >>> print(choice)
        lengths=...: least held + backward temp bytes (...) of 2 measured factorizations of
        depth 4.
        lengths                held   backward temp   compile
        (4,)   ...
        (2, 2) ...
    """

    lengths: tuple[int, ...]
    reason: str
    table: tuple[tuple[tuple[int, ...], int, int, float], ...]

    def __str__(self) -> str:
        lines = [f"{'lengths':<14}{'held':>13}{'backward temp':>16}{'compile':>10}"]
        for lengths, held, temp, secs in self.table:
            mark = "  <- chosen" if lengths == self.lengths else ""
            lines.append(f"{str(lengths):<14}{format_bytes(held)}{format_bytes(temp):>16}"
                         f"{secs:>8.2f} s{mark}")
        return self.reason + "\n" + "\n".join(lines)


def pick_lengths(table, depth: int, *, memory_budget: int | None = None,
                 where: str = "remat_stack") -> LengthsChoice:
    """Picks lengths from measured rows; the rule ``lengths="auto"`` follows.

    Without a budget: the least held + backward temp bytes (ties: fewer levels). With
    ``memory_budget``: the fewest levels whose held + backward temp bytes fit (each level
    recomputes the forward once more, so fewer levels run faster), then the least memory.

    Args:
        table: ``(lengths, held_bytes, backward_temp_bytes, compile_seconds)`` rows.
        depth: the number of layers (for messages).
        memory_budget: bytes, or None.
        where: the public function named in errors.

    Returns:
        A ``LengthsChoice`` with a one-sentence reason.

    Raises:
        ValueError: no row fits ``memory_budget``.
    """
    rows = list(table)
    cost = {r[0]: r[1] + r[2] for r in rows}
    n = f"{len(rows)} measured factorizations of depth {depth}"
    if memory_budget is None:
        best = min(cost, key=lambda f: (cost[f], len(f)))
        reason = (f"lengths={best}: least held + backward temp bytes "
                  f"({format_bytes(cost[best]).strip()}) of {n}.")
    else:
        fits = [f for f in cost if cost[f] <= memory_budget]
        if not fits:
            least = min(cost, key=cost.get)
            raise ValueError(
                f"{where}: no nesting of depth {depth} fits memory_budget={memory_budget} "
                f"bytes; the least held + backward temp is {cost[least]} bytes with lengths "
                f"{least}. Raise the budget, lower the batch size, or pass a policy that "
                f"saves less."
            )
        best = min(fits, key=lambda f: (len(f), cost[f]))
        reason = (f"lengths={best}: fewest levels ({len(best)}; each level recomputes the "
                  f"forward once more) whose held + backward temp bytes "
                  f"({format_bytes(cost[best]).strip()}) fit memory_budget "
                  f"({format_bytes(memory_budget).strip()}), of {n}.")
    return LengthsChoice(best, reason, tuple(rows))


def choose_stack_lengths(
    layer_fn: Callable, layer_params, carry, consts, *, depth: int, policy=None,
    memory_budget: int | None = None, where: str = "remat_stack", cache_key=None,
) -> LengthsChoice:
    """Measures ``stack_apply`` with ``memory_report`` per candidate nesting; picks one.

    The candidates are ``candidate_lengths(depth)``; the rule is ``pick_lengths``'s. The
    choice is logged at INFO level on the ``flaxside`` logger with the measured table.

    Args:
        layer_fn: as for ``stack_apply``.
        layer_params: one layer's parameters (arrays or shape structs).
        carry: the stack's input (array or shape struct).
        consts: as for ``stack_apply``.
        depth: the number of layers.
        policy: the per-layer checkpoint policy (a callable or None).
        memory_budget: bytes, or None.
        where: the public function named in errors.
        cache_key: if given (hashable, covering everything but the budget), the measured
            table is kept under it, so another budget or call does not compile again.

    Returns:
        A ``LengthsChoice``; ``print`` it for the table.

    Raises:
        ValueError: no candidate fits ``memory_budget``.

    Example:
        >>> f = lambda p, c, k, i: c + jax.numpy.tanh(c @ p)
        >>> one = jax.ShapeDtypeStruct((4, 4), "float32")
        >>> x = jax.ShapeDtypeStruct((2, 4), "float32")
        >>> choose_stack_lengths(f, one, x, (), depth=4).lengths in [(4,), (2, 2)]
        True
    """
    shape = jax.ShapeDtypeStruct
    stacked = jtu.tree_map(lambda a: shape((depth, *a.shape), a.dtype), layer_params)
    device = _measuring_device()  # memory differs between backends: measure where it runs

    def measure():
        rows = []
        for lengths in candidate_lengths(depth):
            def fn(params, carry, consts, lengths=lengths):
                return stack_apply(layer_fn, params, carry, consts, lengths=lengths,
                                   policy=policy, layout=(depth,))

            report = memory_report(fn, stacked, carry, consts, device=device)
            rows.append((lengths, report.held_bytes, report.backward_temp_bytes or 0,
                         report.compile_seconds))
        return tuple(rows)

    rows = measure() if cache_key is None else cached(cache_key, measure)
    choice = pick_lengths(rows, depth, memory_budget=memory_budget, where=where)
    logger.info("%s chose %s", where, choice)
    return choice
