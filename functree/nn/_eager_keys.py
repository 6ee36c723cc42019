"""The key an eager compiled call is cached under: an ``ft.nn.Stack``'s or ``ft.nn.RNN``'s
scan, an accumulated optimizer step (``functree.nn._stack._eager_scan``,
``functree.nn._recurrent._eager_scan``, ``functree.optim._accumulate``).

An eager call whose program is traced from a fresh closure (a scan's body over this call's
arrays) compiles again at every call. These calls run a ``jax.jit`` made once per key
instead: the tree definition and abstract signature of the arrays (``jax.jit`` keys those),
the exact static values (:func:`static_values_key`: the tree definition compares them with
``==``, which calls ``-0.0`` ``0.0``), and the code the call runs (:func:`code_roots`, whose
reads :func:`functree.nn._reads.reads_key` keys: a notebook's global, a patched method).
:data:`UNKEYED` says a value has no such key: the call is traced afresh, never stale.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from functree._module import Module
from functree._paths import walk
from functree._tree import bounded_put, cached, is_array_value
from functree.nn._reads import carries_rules, library_class, reads_key

__all__ = ["UNKEYED", "static_key", "exact_key", "static_values_key", "code_roots", "eager_program",
           "model_reads", "traced_afresh"]

READS_LIMIT = 16  # programs kept per signature: a notebook's old values of its globals

# Values keyed by type and exact value (an extra argument's, compiled into a scan as the
# constant a closure over it made; a static field's).
_PLAIN = (bool, int, float, complex, str, bytes, np.generic, np.dtype, type)


def static_key(v: Any) -> Any:
    """``v``'s key as a constant of the scan, keyed by type and exact value (``1``, ``1.0``
    and ``True`` are equal in Python, not in a jaxpr; ``-0.0`` is not ``0.0``); None for
    another kind of value."""
    if not isinstance(v, _PLAIN):
        return None
    if isinstance(v, np.generic):
        return type(v), v, v.tobytes()
    if isinstance(v, (float, complex)):
        return type(v), v, repr(v)
    return type(v), v


UNKEYED = object()  # a static value keyed by neither type and value nor code: no compiled scan


def exact_key(v: Any) -> Any:
    """A static value's key by exact type and value, recursively (``0.0`` and ``-0.0``,
    ``0.5`` and ``np.float32(0.5)``, a dataclass field with ``compare=False`` differ, as in
    the program they make); a callable by itself (its code is keyed by ``reads_key``); or
    :data:`UNKEYED` for a plain object compared by identity (a mutable ``Knobs()``: edited
    in place it would keep the program its old state made)."""
    if v is None or v is Ellipsis:
        return v
    if (k := static_key(v)) is not None:
        return k
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(v, key=repr) if isinstance(v, (frozenset, set)) else v
        return _exact_parts(type(v), items)
    if isinstance(v, dict):
        return _exact_parts(type(v), [x for pair in v.items() for x in pair])
    if isinstance(v, Module):
        return _exact_parts(type(v), [v.__dict__.get(n) for n in type(v).__ft_fields__])  # type: ignore[attr-defined]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _exact_parts(type(v), [getattr(v, f.name) for f in dataclasses.fields(v)])
    if callable(v) or type(v).__eq__ is not object.__eq__:
        return type(v), v  # code (keyed by reads_key), or a value type with its own equality
    if isinstance(v, enum.Enum) or type(v) is object:
        return type(v), v  # a member or a sentinel: one object, never edited (identity is its value)
    return UNKEYED


def _exact_parts(kind: type, parts: Sequence[Any]) -> Any:
    keys = tuple(exact_key(x) for x in parts)
    return UNKEYED if any(k is UNKEYED for k in keys) else (kind, keys)


def static_values_key(tree: Any) -> Any:
    """The exact keys (:func:`exact_key`) of the static fields of ``tree`` (a Module) and
    of every module in it, in walk order; :data:`UNKEYED` if one has none. The tree
    definition compares static values with ``==``, which calls ``-0.0`` ``0.0``."""
    nodes = [tree, *(v for _, v in walk(tree))]
    return _exact_parts(tuple, [m.__dict__.get(n) for m in nodes if isinstance(m, Module)
                                for n in type(m).__ft_static__])  # type: ignore[attr-defined]


_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def code_roots(layers: Any) -> tuple[tuple[type, ...], tuple[Any, ...]]:
    """``(classes, functions)`` whose Python an eager scan of ``layers`` runs: the user
    classes of its modules (library classes are fixed code, compared through the tree
    definition), the functions held as static values (an activation; an ``ft.differentiable``
    one or a ``jax.custom_vjp``, whose rules are set in place, too) and the user classes
    of the callable objects held as static values (``act=Scaled()``: the block runs
    ``type(act).__call__``, which may read a global the notebook changes)."""
    nodes = [layers, *(v for _, v in walk(layers))]
    classes = {type(v): None for v in nodes if _user_code_object(v)}
    functions = {id(v): v for v in nodes if isinstance(v, _FUNCTIONS) or carries_rules(v)}
    return tuple(classes), tuple(functions.values())


_ROOTS: dict[int, tuple[weakref.ref[Any], Any]] = {}  # id(model) -> (model, its code_roots)


def model_reads(model: Any, functions: Sequence[Any] = ()) -> Any:
    """What the Python run on ``model`` reads now: :func:`reads_key` of its :func:`code_roots`
    (kept per Module: frozen, its classes never change; a walk of a Llama's modules is ~1 ms)
    and of ``functions``; None where a read cannot be keyed (then :func:`traced_afresh`). A
    static argument of a module-level ``jax.jit`` taking the model (``ft.nn.generate``'s loops,
    ``ft.nn.update_bn``), so a notebook's ``G = 2.0`` read by its ``__call__`` traces again."""
    entry = _ROOTS.get(id(model))
    if entry is not None and entry[0]() is model:
        roots = entry[1]
    else:
        roots = code_roots(model)
        if isinstance(model, Module):
            bounded_put(_ROOTS, id(model), (weakref.ref(model), roots))
    return reads_key(roots[0], (*roots[1], *functions))


def traced_afresh(compiled: Any, **options: Any) -> Callable[..., Any]:
    """``compiled``'s function (a ``jax.jit``'s) jitted with ``options`` for one call, traced
    afresh: a new function, as JAX's trace caches are keyed by the function (a new ``jax.jit``
    of the same one found its old trace); dropped after the call, nothing kept."""
    raw = compiled.__wrapped__  # (jax.jit keeps the function it compiles)

    @functools.wraps(raw)  # (its name and signature: static_argnames, the compile's name)
    def afresh(*args: Any, **kwargs: Any) -> Any:
        return raw(*args, **kwargs)

    return jax.jit(afresh, **options)


def _user_code_object(v: Any) -> bool:
    """Whether ``v`` is a Module or a callable object (not a function, a class or an array)
    of a user class: its class's Python runs when the block calls it."""
    if isinstance(v, Module):
        return not library_class(type(v))
    kind = type(v)  # (builtin functions' classes are library code not bound by their names)
    return (callable(v) and not isinstance(v, (type, *_FUNCTIONS)) and kind.__module__ != "builtins"
            and not library_class(kind))


def eager_program(cache: dict[Any, Any], module: Any, arguments: Any, flags: Any,
                  make: Callable[[], Callable[..., Any]]) -> Callable[..., Any] | None:
    """The program ``make()`` built for ``module``'s eager call on ``arguments`` (a tree
    holding ``module``), found in ``cache`` by its key: the tree definition and abstract
    signature of ``arguments``' arrays, ``module``'s exact static values (:func:`static_values_key`),
    ``flags`` (hashable) and what the code it runs reads (:func:`code_roots`, ``reads_key``).
    None where no key holds: a leaf that is not an array, a static value or a read that
    cannot be keyed (the caller then traces afresh: never stale)."""
    leaves, treedef = jax.tree.flatten(arguments)
    if not all(map(is_array_value, leaves)):
        return None
    statics = static_values_key(module)
    if statics is UNKEYED:  # a mutable object as a static value
        return None
    key, entry = cached(cache, (treedef, statics, flags, tuple(jax.typeof(a) for a in leaves)))
    if key is None:
        return None
    if entry is None:
        entry = code_roots(module), {}
        bounded_put(cache, key, entry)
    (classes, functions), programs = entry
    reads, program = cached(programs, reads_key(classes, functions))
    if reads is None:
        return None
    if program is None:
        program = make()
        if len(programs) >= READS_LIMIT:
            programs.clear()
        programs[reads] = program
    return program
