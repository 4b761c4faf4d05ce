"""Warns once when a module keeps compiling for new call signatures, and says what changes."""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from torchside.call._options import check_positive_int


class RecompileWarning(UserWarning):
    """A ``FlaxModule`` or ``jax_function`` compiled for more call signatures than expected.

    Each new signature (a new shape, dtype, static value, ...) traces and compiles the
    programs again, which can cost more than the step itself. Silence it per module with
    ``recompile_warning=None``, or filter this class with ``warnings.filterwarnings``.

    Example:
        >>> import warnings
        >>> from torchside import jax_function
        >>> double = jax_function(lambda x: 2 * x, recompile_warning=2)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for n in (1, 2, 3):  # a new length is a new signature: a new compile
        ...         _ = double(torch.ones(n))
        >>> caught[0].category is RecompileWarning
        True
        >>> print(caught[0].message)
        jax_function(<lambda>) has compiled for 3 distinct call signatures ... What changed:
        args[0] dimension 0 (sizes 1, 2, 3). To fix it, pad or bucket the changing dimension ...
    """


# Frames in these directories are ours (the whole torchside package, this file's folder's
# parent) or torch's module-call machinery: the warning points at the first frame outside
# them, the user's call.
_INTERNAL = (os.path.dirname(os.path.dirname(__file__)) + os.sep,
             os.path.dirname(torch.__file__) + os.sep)


def _user_stacklevel() -> int:
    frame, level = sys._getframe(2), 2  # 1 is RecompileMonitor.record
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


class RecompileMonitor:
    """Counts the distinct call signatures one owner compiled for; warns once past a limit.

    Signatures are remembered only until the warning fires, so a storm costs no memory
    here after it has been reported.

    Args:
        threshold: warn when more than this many distinct signatures were compiled; ``None``
            never warns.
        where: the owner's name for the message.
    """

    def __init__(self, threshold: int | None, where: str):
        self.threshold = check_positive_int(
            threshold, option="recompile_warning", where=where, none_ok=True,
            meaning="warn once after that many distinct call signatures, or never")
        self.where = where
        self._seen: dict = {}
        self._done = threshold is None
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        """Whether nothing more is recorded (warned already, or never warns)."""
        return self._done

    def record(self, signature, tensors, static, other) -> None:
        """Notes one compiled signature.

        Args:
            signature: hashable; equal for calls that would share a compiled program.
            tensors: ``(name, shape, dtype)`` per tensor argument.
            static: ``(name, value)`` per static (non-tensor) argument.
            other: ``(label, value)`` pairs for the rest of the key (mode, grad flags).
        """
        if self._done:
            return
        with self._lock:
            if self._done or signature in self._seen:
                return
            self._seen[signature] = (tensors, static, other)
            if len(self._seen) <= self.threshold:
                return
            seen, self._seen, self._done = list(self._seen.values()), {}, True
        warnings.warn(self._message(seen), RecompileWarning, stacklevel=_user_stacklevel())

    def _message(self, seen) -> str:
        dims, statics, others = describe_changes(seen)
        changed = dims + statics + others or ["the argument structure"]
        advice = []
        if dims:
            advice.append("pad or bucket the changing dimension to a few sizes (e.g. round "
                          "the batch up to a multiple of 8 and mask the padding)")
        if statics:
            advice.append("pass numbers that change every call as tensors (non-tensor "
                          "arguments are part of the compile key)")
        advice = "; ".join(advice) or "call with fewer distinct signatures"
        return (
            f"{self.where} has compiled for {len(seen)} distinct call signatures "
            f"(recompile_warning={self.threshold}); each new one traces and compiles again. "
            f"What changed: {'; '.join(changed)}. To fix it, {advice}. Pass a larger "
            f"recompile_warning to allow more signatures, or None to silence this warning."
        )


def _values(values) -> str:
    shown = sorted(set(values), key=lambda v: (len(v), v))
    text = ", ".join(shown[:6])
    return text + (", ..." if len(shown) > 6 else "")


def describe_changes(seen) -> tuple[list[str], list[str], list[str]]:
    """What differs between recorded signatures, as readable phrases.

    Returns:
        ``(dimensions, static values, other)``: e.g. ``"args[0] dimension 0 (sizes 1, 2,
        3)"``, ``"kwargs['scale'] (static value: 0.1, 0.2)"``, ``"args[0] dtype"``.
    """
    shapes: dict[str, list] = {}
    changes: dict[str, set] = {}
    statics: dict[str, set] = {}
    for tensors, static, other in seen:
        for name, shape, dtype in tensors:
            shapes.setdefault(name, []).append(tuple(shape))
            changes.setdefault(f"{name} dtype", set()).add(str(dtype).replace("torch.", ""))
        for name, value in static:
            statics.setdefault(name, set()).add(f"{value!r}")
        for label, value in other:
            changes.setdefault(label, set()).add(repr(value))
    dims = []
    for name, shape_list in shapes.items():
        ranks = {len(s) for s in shape_list}
        if len(ranks) > 1:
            dims.append(f"{name} rank ({_values(str(r) for r in ranks)})")
            continue
        for d in range(ranks.pop()):
            sizes = {str(s[d]) for s in shape_list}
            if len(sizes) > 1:
                dims.append(f"{name} dimension {d} (sizes {_values(sizes)})")
    static_changes = [f"{name} (static value: {_values(values)})"
                      for name, values in statics.items() if len(values) > 1]
    other_changes = [label for label, values in changes.items() if len(values) > 1]
    return dims, static_changes, other_changes
