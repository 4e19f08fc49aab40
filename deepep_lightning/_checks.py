"""Argument validators shared by every constructor and entry point of the package.

Each validator takes the owner's name (the class or function the argument belongs to, e.g.
``"NumericalHealthCallback"``; ``None`` for a bare argument name), the argument's name and its value,
raises with a message that names the argument, shows the value (``!r``) and says what is allowed,
and returns the normalised value. The subject of the message is ```Owner(name=...)``` with an
owner and ```name``` without one, so that messages read the same wherever the argument is checked.

The exception type defaults to Lightning's ``MisconfigurationException`` (bad configuration);
pass ``error=ValueError`` (or another type) for runtime values. Lightning is imported only when the
default exception is raised, so the light entry points (``deepep-compare``) can use these too.

Example::

    from deepep_lightning import _checks

    self.check_every_n_steps = _checks.int_at_least("NumericalHealthCallback", "check_every_n_steps", value, 1)
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "choice",
    "int_at_least",
    "int_in_range",
    "non_empty_str",
    "non_negative_int",
    "number",
    "path",
    "positive_int",
    "str_sequence",
    "strict_bool",
]


def _subject(owner: str | None, name: str) -> str:
    return f"`{owner}({name}=...)`" if owner else f"`{name}`"


def _fail(
    owner: str | None, name: str, allowed: str, value: Any, error: type[Exception] | None, hint: str | None = None
) -> NoReturn:
    message = f"{_subject(owner, name)} must be {allowed}, got {value!r}"
    if hint:
        message += f" (HINT: {hint})"
    if error is None:
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        error = MisconfigurationException
    raise error(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _or_none(allowed: str, allow_none: bool) -> str:
    return f"{allowed} or None" if allow_none else allowed


def positive_int(
    owner: str | None,
    name: str,
    value: Any,
    *,
    maximum: int | None = None,
    allow_none: bool = False,
    error: type[Exception] | None = None,
) -> Any:
    """An int ``>= 1`` (and ``<= maximum`` when given); ``True``/``False`` are refused.

    Returns the value (``None`` when ``allow_none`` and it is ``None``).
    """
    if allow_none and value is None:
        return None
    if not _is_int(value) or value < 1 or (maximum is not None and value > maximum):
        allowed = "a positive int" if maximum is None else f"a positive int <= {maximum}"
        _fail(owner, name, _or_none(allowed, allow_none), value, error)
    return value


def non_negative_int(
    owner: str | None, name: str, value: Any, *, allow_none: bool = False, error: type[Exception] | None = None
) -> Any:
    """An int ``>= 0`` (a seed, a step); ``True``/``False`` are refused."""
    if allow_none and value is None:
        return None
    if not _is_int(value) or value < 0:
        _fail(owner, name, _or_none("a non-negative int", allow_none), value, error)
    return value


def int_at_least(
    owner: str | None,
    name: str,
    value: Any,
    minimum: int,
    *,
    allow_none: bool = False,
    error: type[Exception] | None = None,
) -> Any:
    """An int ``>= minimum``; ``True``/``False`` are refused."""
    if allow_none and value is None:
        return None
    if not _is_int(value) or value < minimum:
        _fail(owner, name, _or_none(f"an int >= {minimum}", allow_none), value, error)
    return value


def int_in_range(
    owner: str | None,
    name: str,
    value: Any,
    low: int,
    high: int,
    *,
    high_inclusive: bool = True,
    error: type[Exception] | None = None,
) -> int:
    """An int in ``[low, high]`` (``[low, high)`` with ``high_inclusive=False``)."""
    above = value > high if high_inclusive else value >= high
    if not _is_int(value) or value < low or above:
        _fail(owner, name, f"an int in [{low}, {high}{']' if high_inclusive else ')'}", value, error)
    return value


def number(
    owner: str | None,
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    finite: bool = False,
    allow_none: bool = False,
    error: type[Exception] | None = None,
) -> Any:
    """An int or float within the given bounds (``finite``: NaN and infinities refused).

    The message states the bounds: ``a number in [0.0, 1.0]``, ``a number in (0, 1)``,
    ``a number > 0``, ``a finite number >= 0``.
    """
    if allow_none and value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok and finite and not math.isfinite(value):
        ok = False
    if ok and minimum is not None:
        ok = value > minimum if exclusive_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if exclusive_maximum else value <= maximum
    if not ok:
        kind = "a finite number" if finite else "a number"
        if minimum is not None and maximum is not None:
            left, right = "(" if exclusive_minimum else "[", ")" if exclusive_maximum else "]"
            allowed = f"{kind} in {left}{minimum}, {maximum}{right}"
        elif minimum is not None:
            allowed = f"{kind} {'>' if exclusive_minimum else '>='} {minimum}"
        elif maximum is not None:
            allowed = f"{kind} {'<' if exclusive_maximum else '<='} {maximum}"
        else:
            allowed = kind
        _fail(owner, name, _or_none(allowed, allow_none), value, error)
    return value


def strict_bool(owner: str | None, name: str, value: Any, *, error: type[Exception] | None = None) -> bool:
    """``True`` or ``False`` only (``0``, ``1``, ``"yes"`` are refused: a typo must not pass as a switch)."""
    if not isinstance(value, bool):
        _fail(owner, name, "a bool", value, error)
    return value


def choice(
    owner: str | None,
    name: str,
    value: Any,
    choices: Collection[Any],
    *,
    allow_none: bool = False,
    hint: str | None = None,
    error: type[Exception] | None = None,
) -> Any:
    """One of ``choices`` (e.g. the values of a ``Literal``); the message lists them as given."""
    if allow_none and value is None:
        return None
    if value not in choices:
        _fail(owner, name, _or_none(f"one of {choices}", allow_none), value, error, hint)
    return value


def str_sequence(owner: str | None, name: str, value: Any, *, error: type[Exception] | None = None) -> tuple[str, ...]:
    """A list or tuple of str (a bare str is refused: it would be read as its characters); returns a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        _fail(owner, name, "a sequence of str", value, error)
    return tuple(value)


def path(
    owner: str | None,
    name: str,
    value: Any,
    *,
    writable_parent: bool = False,
    allow_none: bool = False,
    error: type[Exception] | None = None,
) -> Path | None:
    """A ``str`` or ``os.PathLike``; with ``writable_parent``, the nearest existing ancestor is writable.

    Returns a :class:`~pathlib.Path` (``None`` when ``allow_none`` and it is ``None``).
    """
    if allow_none and value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        _fail(owner, name, _or_none("a path", allow_none), value, error)
    result = Path(value)
    if writable_parent:
        parent = result.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            _fail(owner, name, f"a path in a writable directory ({str(parent)!r} is not writable)", value, error)
    return result


def non_empty_str(owner: str | None, name: str, value: Any, *, error: type[Exception] | None = None) -> str:
    """A ``str`` with at least one non-blank character (a metric's or a file's name)."""
    if not isinstance(value, str) or not value.strip():
        _fail(owner, name, "a non-empty str", value, error)
    return value
