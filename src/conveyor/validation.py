"""Checks of user-given settings, with one message format: `{name} must be {rule}, got {value}.`

Every message starts with the field's name: the HTTP server reads it back to name the 400's
`param`. A choice reads `{name} must be one of a, b; got {value!r}.` (a semicolon, since the
choices are separated by commas). Plain Python, importable from anywhere (core/ included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def check_int(
    name: str, value: object, lo: int | None = None, hi: int | None = None, hint: str = ""
) -> None:
    """An integer (a bool is not one) within [lo, hi]; either bound may be None.

    Args:
        name: the field, as the user wrote it.
        value: what the user gave.
        lo: the smallest allowed value, or None.
        hi: the largest allowed value, or None.
        hint: said in parentheses after the range, e.g. what a special value means.
    Raises:
        ValueError: not an integer, or outside the range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hi is None:
            rule = f">= {lo}"
        elif lo is None:
            rule = f"<= {hi}"
        else:
            rule = f"in [{lo}, {hi}]"
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{name} must be {rule}{extra}, got {value}.")


def check_positive_int(name: str, value: object) -> None:
    """ValueError unless `value` is an integer >= 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def check_number(name: str, value: object, rule: str, ok: Callable[[float], bool]) -> None:
    """ValueError unless `value` is an int or float (not a bool, not NaN) that `ok` accepts;
    `rule` says in words what `ok` accepts ("in (0, 1]")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if value != value or not ok(value):  # value != value: NaN, which no range holds
        raise ValueError(f"{name} must be {rule}, got {value}.")


def check_choice(name: str, value: object, allowed: Iterable[object]) -> None:
    """ValueError, listing the choices, unless `value` is one of `allowed` (==)."""
    allowed = tuple(allowed)
    if value not in allowed:
        choices = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{name} must be one of {choices}; got {value!r}.")
