"""Arithmetic that reads the same on Python numbers and on numpy arrays.

A rule written with these helpers gives, for a Python int or float, the Python result (an int
where the rule counts elements) and, for a numpy array or scalar, numpy's result of the same
operations in the same order: the runtime and the simulator then agree to the bit.
"""

from __future__ import annotations

import math

import numpy as np


def is_python(x) -> bool:
    """Whether `x` is a plain Python number or bool (not a numpy scalar or array)."""
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


def round_half_even(x):
    """`x` rounded to the nearest integer, halves to even (Python's `round`, numpy's `round`)."""
    return round(x) if is_python(x) else np.round(x)


def ceil(x):
    """The smallest integer ≥ `x` (an int for a Python number)."""
    return math.ceil(x) if is_python(x) else np.ceil(x)


def where(cond, a, b):
    """`a` where `cond` holds, else `b` (element-wise for arrays)."""
    if is_python(cond):
        return a if cond else b
    return np.where(cond, a, b)


def logical_not(x):
    """`not x` (element-wise for arrays)."""
    return (not x) if is_python(x) else np.logical_not(x)


def minimum(a, b):
    """The smaller of `a` and `b` (element-wise for arrays)."""
    return min(a, b) if is_python(a) and is_python(b) else np.minimum(a, b)


def maximum(a, b):
    """The larger of `a` and `b` (element-wise for arrays)."""
    return max(a, b) if is_python(a) and is_python(b) else np.maximum(a, b)
