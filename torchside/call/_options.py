"""Checks of the options an owner (``FlaxModule``, ``jax_function``) is constructed with."""

from __future__ import annotations

from torchside import _errors


def check_choice(value, choices: tuple, *, option: str, where: str, meaning: str) -> str:
    """``value`` if it is one of ``choices``; else a ``ValueError`` naming all of them.

    Options are lower-case strings checked against a set, as torch's
    ``determinism_check="default"``.
    """
    if value not in choices:
        raise _errors.bad_choice(value, choices, option=option, where=where, meaning=meaning)
    return value


def check_positive_int(value, *, option: str, where: str, meaning: str,
                       none_ok: bool = False):
    """``value`` if it is a positive int (or ``None`` where ``none_ok``); else a ``ValueError``."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _errors.not_positive_int(value, option=option, where=where, meaning=meaning,
                                       none_ok=none_ok)
    return value
