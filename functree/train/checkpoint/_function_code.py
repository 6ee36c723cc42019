"""A lambda's or a local function's identity in a checkpoint: its name and its code.

A static function (an activation, a ``Lambda``'s function) is stored by its qualified name,
which names a module-level ``def`` (as pickle names it: a definition edited under its name is
the same function). Every lambda of a module has one name (``__main__.<lambda>``) and every
function a factory returns one too (``make.<locals>.act``), so a template's ``lambda v: v * 5``
took the place of a saved ``lambda v: v * 2`` unnoticed: outputs 5.15 off, no message. Their
names carry a digest of what they compute (``__main__.<lambda>@py311:3f2a9c0b1d7e``): the
bytecode, constants and names, the defaults and the captured values, with the Python version
whose bytecode it is. Loading compares digests of one Python version; across versions (other
bytecode for the same source) and for files written before digests, the name alone, as before.
"""

from __future__ import annotations

import hashlib
import sys
import types
from typing import Any

import numpy as np

_PYTHON = f"py{sys.version_info[0]}{sys.version_info[1]}"


def with_code(fn: Any, name: str) -> str:
    """``name`` (``fn``'s ``module.qualname``), with ``@py3XY:digest`` where the name does
    not tell one function from another (a lambda, a function defined inside a function).

    Example:
      >>> double, triple = (lambda v: v * 2), (lambda v: v * 3)
      >>> with_code(double, "m.<lambda>") != with_code(triple, "m.<lambda>")
      True
      >>> with_code(double, "m.<lambda>") == with_code(lambda v: v * 2, "m.<lambda>")
      True
    """
    if "<lambda>" not in name and "<locals>" not in name:
        return name
    digest = code_digest(fn)
    return name if digest is None else f"{name}@{_PYTHON}:{digest}"


def code_digest(fn: Any, seen: frozenset[int] = frozenset()) -> str | None:
    """12 hex digits of sha256 over ``fn``'s code (bytecode, constants, names, nested code)
    and its defaults and captured values; None for a callable with no code (a builtin).
    ``seen``: the objects being described (a local function that calls itself captures
    itself: described once)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    seen = seen | {id(fn)}
    h = hashlib.sha256()
    _feed_code(h, code)
    h.update(_value_text(getattr(fn, "__defaults__", None), seen).encode())
    h.update(_value_text(getattr(fn, "__kwdefaults__", None), seen).encode())
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            h.update(_value_text(cell.cell_contents, seen).encode())
        except ValueError:  # an empty cell (a name bound later)
            h.update(b"<empty>")
    return h.hexdigest()[:12]


def _feed_code(h: Any, code: types.CodeType) -> None:
    # (no file name, no line numbers: the same lambda moved in its file is the same function)
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const)
        else:
            h.update(repr(const).encode())


def _value_text(value: Any, seen: frozenset[int]) -> str:
    """A captured value as text that differs where the value does: plain data by ``repr``,
    functions by their name and code, arrays by dtype, shape and bytes; other objects by
    type (what their state is cannot be read safely); an object met again, by its place."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if id(value) in seen:
        return "<itself>"
    inner = seen | {id(value)}
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + "(" + ",".join(_value_text(v, inner) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_value_text(k, inner)}:{_value_text(v, inner)}" for k, v in value.items()) + "}"
    if isinstance(value, types.FunctionType):
        return f"{value.__module__}.{value.__qualname__}:{code_digest(value, inner)}"
    if isinstance(value, np.generic) or (hasattr(value, "__array__") and hasattr(value, "dtype")):
        array = np.asarray(value)
        return f"array({array.dtype},{array.shape},{hashlib.sha256(array.tobytes()).hexdigest()[:16]})"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def same_function(saved: Any, mine: Any) -> bool:
    """Whether two stored function names are one function: equal, or equal names where one
    has no digest (a file from before digests) or the digests are of two Python versions."""
    if saved == mine:
        return True
    if not (isinstance(saved, str) and isinstance(mine, str)):
        return False
    (a, _, code_a), (b, _, code_b) = saved.partition("@"), mine.partition("@")
    if a != b:
        return False
    return not code_a or not code_b or code_a.split(":")[0] != code_b.split(":")[0]


def shown(name: str) -> str:
    """A stored function name as a message shows it: ``__main__.<lambda> (code 3f2a9c0b1d7e)``."""
    base, _, code = name.partition("@")
    return f"{base} (code {code.split(':')[-1]})" if code else base
