"""Argument checks shared by the public API, so every entry point words the same
mistake the same way (the argument's name, what was expected, what was given)."""

from __future__ import annotations


def require_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an int (bools rejected), at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)
