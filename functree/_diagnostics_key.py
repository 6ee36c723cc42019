"""The cache key of the differentiation check: a function and its abstract signature.

``cache_key(kind, f, plan)`` is what decides whether ``functree._diagnostics.check`` has
analysed this call already: the operator's kind, the function object (by identity, weakly
held: a new function of the same code, from a re-run cell or a factory, is analysed
afresh, as its closure's or globals' values may differ) with its code and closure (cells,
defaults, ``functools.partial`` arguments, a method's ``self``, recursively to depth 3),
the plan's indices and patterns, and each argument's tree definition with its leaves'
abstract values (shape, dtype, weak type unless differentiated; a Python scalar's value
unless differentiated).
Objects equal only to themselves are held weakly (:class:`WeakIdentity`), so the bounded
cache keeps no user's arrays alive. ``None`` when the key cannot be made (never raises).

Example:
  >>> import jax.numpy as jnp
  >>> from functree._diagnostics_key import cache_key
  >>> from functree._plan import Plan
  >>> f = lambda x: x * 2.0
  >>> key = lambda x: cache_key("gradient", f, Plan("gradient", f, (x,), 0))
  >>> key(jnp.ones(3)) == key(jnp.zeros(3)), key(jnp.ones(3)) == key(jnp.ones(4))
  (True, False)
  >>> g = lambda x: x * 2.0                  # the same code, another function object
  >>> key(jnp.ones(3)) == cache_key("gradient", g, Plan("gradient", g, (jnp.ones(3),), 0))
  False
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.core
import numpy as np

from functree._module import Module
from functree._plan import Plan
from functree._source import USER_FUNCTION
from functree._tree import WeakIdentity, bounded_put

__all__ = ["cache_key"]

_TRACER, _ARRAY, _NUMPY, _PYTHON, _OTHER = range(5)
_KINDS: dict[type, int] = {}  # a leaf's type -> how its key is made (one isinstance per type)


def _kind(t: type) -> int:
    kind = _KINDS.get(t)
    if kind is None:
        if issubclass(t, jax.core.Tracer):
            kind = _TRACER
        elif issubclass(t, jax.Array):
            kind = _ARRAY
        elif issubclass(t, (np.ndarray, np.generic)):
            kind = _NUMPY
        elif t in (bool, int, float, complex, str, type(None)):
            kind = _PYTHON
        else:
            kind = _OTHER
        bounded_put(_KINDS, t, kind)
    return kind


def _leaf_key(x: Any, depth: int, baked: bool = True) -> Any:
    """A leaf's part of the signature: its abstract value (arrays; a tracer's differs from a
    concrete array's, whose zeros the analysis can see) or its value (Python scalars)."""
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _kind(type(x))
    if kind <= _ARRAY:
        aval = x.aval
        # A differentiated argument's weak type is no part of it: a parameter made by
        # ``jnp.asarray(0.1)`` loses it at the first ``ft.move``, and the same findings would
        # be made, and warned, again at the second step.
        return (kind, aval.shape, aval.dtype, getattr(aval, "weak_type", False) and baked)
    if kind == _NUMPY:
        return (kind, x.shape, x.dtype)
    if kind == _PYTHON:
        # Python values are baked into the trace, except where they are differentiated.
        return (type(x), x) if baked else type(x)
    if callable(x) and not isinstance(x, type):
        return _callable_key(x, depth + 1)
    try:
        hash(x)
    except TypeError:
        return ("id", type(x), id(x))
    return _held(x)


def _held(x: Any) -> Any:
    """``x`` as a key part, held weakly if it is equal only to itself (a ``TrainStep`` in a
    loss function's closure: the bounded cache of checks kept it, and its last model and
    state, alive after the user dropped it)."""
    if type(x).__hash__ is object.__hash__:
        try:
            return WeakIdentity(x)
        except TypeError:  # no weak references to it
            pass
    return x


def _value_key(v: Any, depth: int, baked: bool = True) -> Any:
    leaves, treedef = jax.tree.flatten(v)
    return (treedef, tuple([_leaf_key(x, depth, baked) for x in leaves]))


def _callable_key(f: Any, depth: int = 0) -> Any:
    if depth > 3:
        return ("deep", _held(f)) if _hashable(f) else ("id", id(f))
    if isinstance(f, functools.partial):
        keywords = tuple(sorted(f.keywords.items()))
        return ("partial", _callable_key(f.func, depth + 1), _value_key((f.args, keywords), depth))
    if inspect.ismethod(f):
        return ("method", _callable_key(f.__func__, depth + 1), _value_key(f.__self__, depth))
    if inspect.isfunction(f):
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        # The function object itself, weakly held: a re-run cell's or a factory's new function
        # of the same code may read other values (a closure's zero mask, a changed global), so
        # it is analysed (and warns) afresh; one kept and called again is analysed once. A
        # library's wrapper of the user's function (USER_FUNCTION: an optimizer's objective
        # around the loss, made at each call) reads no globals of the user's, so its code and
        # its closure (the user's function among its cells) are what it computes: keyed by
        # them, an eager `minimize` loop is analysed once, not traced twice at every step.
        who = None if getattr(f, USER_FUNCTION, None) is not None else WeakIdentity(f)
        return (who, f.__code__, _value_key((cells, f.__defaults__, f.__kwdefaults__), depth))
    if isinstance(f, Module):
        return ("module", _value_key(f, depth))
    return _held(f) if _hashable(f) else ("id", id(f))


def _hashable(x: Any) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _signature(kind: str, f: Any, plan: Plan) -> Any:
    differentiated = {i % len(plan.args) for i in plan.indices}
    return (
        kind,
        _callable_key(f),
        plan.indices,
        plan.patterns,  # with the arguments' signature, fixes the primals' structure
        tuple(_value_key(a, 0, i not in differentiated) for i, a in enumerate(plan.args)),
    )


def cache_key(kind: str, f: Any, plan: Plan) -> Any:
    try:
        key = _signature(kind, f, plan)
        hash(key)
        return key
    except Exception:
        return None
