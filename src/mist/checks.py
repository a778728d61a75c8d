"""Type tests that input checks share. Python's `bool` is a subclass of `int`, so `True` passes
`isinstance(v, int)`; a count, a size or a ratio written as `true` in a plan or a spec must not."""

from __future__ import annotations


def is_int(v) -> bool:
    """Whether `v` is an integer and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """Whether `v` is an int or a float and not a bool (NaN and infinities included)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
