"""NumPy evaluators of a layer analysis's sympy expressions in (B, S), kept as source text.

`sympy.lambdify` prints an expression list to Python source and compiles it: about 3 ms for the
list of a block's operators, paid again by every process that reads the analysis from the disk
cache (about a thousand times in a warm `mist tune` of a 7B model). An analysis keeps the printed
source (text pickles; functions do not), so a later process compiles that text instead of
printing the expressions again: the same function, the same values.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from types import CodeType

import sympy

from mist.analysis.records import B, S


def make(exprs: Iterable) -> tuple[Callable, str | None]:
    """(f(b, s) -> [value of each expression], f's source, or None where `load` could not rebuild
    it: a name outside the namespace every evaluator gets)."""
    # (docstring_limit=0: no docstring, which would print every expression once more)
    fn = sympy.lambdify((B, S), list(exprs), modules="numpy", docstring_limit=0)
    return fn, inspect.getsource(fn) if _names(fn.__code__) <= _namespace().keys() else None


def load(source: str) -> Callable:
    """The evaluator `make` printed as `source`."""
    defined: dict = {}
    exec(compile(source, "<mist-lambdified>", "exec"), _namespace(), defined)  # noqa: S102 - our own text
    (fn,) = defined.values()
    return fn


def _names(code: CodeType) -> set[str]:
    """The global names a function's code (and any code nested in it) reads."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, CodeType):
            names |= _names(c)
    return names


@functools.lru_cache(maxsize=1)
def _namespace() -> dict:
    """What lambdify's NumPy printer gives a function (numpy's names, and `reduce`, which it
    imports for Max and Min)."""
    ns = dict(sympy.lambdify((B, S), [B], modules="numpy").__globals__)
    ns["reduce"] = functools.reduce
    return ns
