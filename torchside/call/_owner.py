"""What every owner of a ``Caller`` (``FlaxModule``, ``jax_function``) offers its users."""

from __future__ import annotations


class CallerOwner:
    """What every owner of a ``Caller`` (at ``self._caller``) offers its users."""

    def clear_caches(self) -> None:
        """Drops every compiled program and held array; the next call compiles again."""
        self._caller.clear()

    @property
    def cache_size(self) -> int:
        """How many call signatures keep their compiled programs."""
        return self._caller.cache_size

    @property
    def trace_count(self) -> int:
        """How many times the cached programs were traced (for tests of the cache)."""
        return sum(e.program.trace_count for e in self._caller.entries)
