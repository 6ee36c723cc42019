"""One home for the small tree helpers every module needs.

* :func:`is_none`: the ``is_leaf`` that keeps ``None`` (a parameter view's non-parameters)
  as a leaf;
* :func:`dotted_name`: the dotted name of a JAX key path (``layers.0.weight``), the names
  of ``ft.to_flat_dict`` and of every glob pattern;
* :func:`bounded_put`: the one cache policy (caches keyed by tree definitions are bounded,
  because static values change tree definitions); :func:`cached` looks one up;
* :func:`all_finite`: whether every element of a tree is finite (non-finite steps);
* what a leaf is, one predicate per meaning: :func:`is_array_value` (a JAX or NumPy
  array), :func:`is_array_or_numpy_scalar` (that, or a NumPy scalar),
  :func:`has_shape_and_dtype` (anything shaped, a ``jax.ShapeDtypeStruct`` too);
* dotted names built from parts: :func:`join_names` (empty parts skipped: the root) and
  :func:`child_name` (a child's name under a prefix, an empty key kept);
* :func:`bound`: the object a module's name means now (a notebook cell run again rebinds it).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "is_none",
    "dotted_name",
    "join_names",
    "child_name",
    "bounded_put",
    "cached",
    "CACHE_LIMIT",
    "all_finite",
    "is_array_value",
    "is_array_or_numpy_scalar",
    "has_shape_and_dtype",
    "bound",
    "abstract_leaf",
]

CACHE_LIMIT = 4096
"""Entries a tree-definition cache holds before it is cleared (one policy for all)."""


def is_none(x: Any) -> bool:
    """``x is None``: pass as ``is_leaf`` to keep a parameter view's ``None`` leaves."""
    return x is None


def dotted_name(path: Sequence[Any]) -> str:
    """The dotted name of a JAX key path: ``(GetAttrKey('layers'), SequenceKey(0))`` → ``layers.0``.

    Example:
      >>> import jax
      >>> from functree._tree import dotted_name
      >>> [dotted_name(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
      ['a.0', 'a.1']
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def join_names(*parts: str) -> str:
    """Dotted name of the parts, empty ones skipped (an empty prefix is the root).

    Example:
      >>> from functree._tree import join_names
      >>> join_names("", "layers", "0.weight"), join_names("")
      ('layers.0.weight', '')
    """
    return ".".join(p for p in parts if p)


def child_name(prefix: str, part: Any) -> str:
    """The name of child ``part`` under ``prefix`` (the root: ``""``); unlike
    :func:`join_names`, an empty part is a key of its own and keeps its dot.

    Example:
      >>> from functree._tree import child_name
      >>> child_name("", 0), child_name("layers", 0), child_name("d", "")
      ('0', 'layers.0', 'd.')
    """
    return f"{prefix}.{part}" if prefix else str(part)


def is_array_value(x: Any) -> bool:
    """A JAX array (a tracer too) or a NumPy array: not a Python or NumPy scalar.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from functree._tree import is_array_value
      >>> is_array_value(jnp.ones(2)), is_array_value(np.zeros(())), is_array_value(np.float32(1)), is_array_value(1.0)
      (True, True, False, False)
    """
    return isinstance(x, (jax.Array, np.ndarray))


def is_array_or_numpy_scalar(x: Any) -> bool:
    """An :func:`is_array_value`, or a NumPy scalar (``np.float32(1)``): a value with a dtype
    of its own, unlike a Python number.

    Example:
      >>> import numpy as np
      >>> from functree._tree import is_array_or_numpy_scalar
      >>> is_array_or_numpy_scalar(np.float32(1)), is_array_or_numpy_scalar(1.0)
      (True, False)
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def has_shape_and_dtype(x: Any) -> bool:
    """Anything shaped: an array, a NumPy scalar, a ``jax.ShapeDtypeStruct`` (an abstract
    leaf), or another array type; not a Python number or None. A leaf that takes a sharding.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._tree import has_shape_and_dtype
      >>> has_shape_and_dtype(jax.ShapeDtypeStruct((2,), jnp.float32)), has_shape_and_dtype(1.0)
      (True, False)
    """
    return hasattr(x, "shape") and hasattr(x, "dtype")


def abstract_leaf(tree: Any) -> tuple[str, Any] | None:
    """``(dotted name, leaf)`` of the first ``jax.ShapeDtypeStruct`` leaf of ``tree`` (a
    ``jax.eval_shape`` template's), or None: for the error paths of a call given a template
    where values are needed (JAX names only an operand type).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> abstract_leaf({"w": jnp.ones(2), "b": jax.ShapeDtypeStruct((2,), jnp.float32)})[0]
      'b'
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    return next(((dotted_name(p), x) for p, x in pairs if isinstance(x, jax.ShapeDtypeStruct)), None)


def bounded_put(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value``, clearing the cache first when it holds ``CACHE_LIMIT`` entries."""
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value


class WeakIdentity:
    """A cache key's part for an object compared by identity, held weakly: a cache must not
    keep alive what it keys (a train step, and its last model and state in device memory).
    Equal to another only while both refer to the same live object; ``callback(ref)`` runs
    when the object dies (``weakref.ref``'s). Raises ``TypeError`` for an object that
    takes no weak reference.

    Example:
      >>> class Step: ...
      >>> step = Step()
      >>> key = WeakIdentity(step)
      >>> key == WeakIdentity(step), key == WeakIdentity(Step())
      (True, False)
    """

    __slots__ = ("_hash", "_ref")

    def __init__(self, obj: Any, callback: Any = None):
        self._ref = weakref.ref(obj, callback)
        self._hash = id(obj)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WeakIdentity):
            return NotImplemented
        mine = self._ref()
        return mine is not None and mine is other._ref()


def bound(module: str | None, qualname: str | None) -> Any:
    """The object bound now at ``sys.modules[module].<qualname>`` (pickle's rule for what a
    name means), or None: the module is not imported, the name is unbound, or it is local
    (``f.<locals>.C``). Looks up attributes only; imports and calls nothing."""
    obj: Any = sys.modules.get(module or "")
    for part in (qualname or "<locals>").split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, "__dict__", {}).get(part)
    return obj


def cached(cache: dict[Any, Any], key: Any) -> tuple[Any, Any]:
    """``(key, cache.get(key))``, or ``(None, None)`` where ``key`` cannot be hashed or
    compared (a tree definition holding such auxiliary data): then nothing is cached."""
    try:
        return key, cache.get(key)
    except (TypeError, ValueError):
        return None, None


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every array leaf of ``tree`` is finite (a scalar bool array).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.optim.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])})
      Array(False, dtype=bool)
      >>> ft.optim.all_finite({"a": jnp.ones(2), "n": None})
      Array(True, dtype=bool)
    """
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


RECORD_FIELDS = """\
register_record({cls}): the data fields {data} and static fields {meta} must split the \
dataclass's fields {fields}, each field once:

    wrong:  register_record(Count, ["n"], [])               # a field left out
    right:  register_record(Count, ["n"], ["name"])         # leaves: n; static: name"""


def register_record(cls: type, data_fields: Sequence[str], meta_fields: Sequence[str] = ()) -> type:
    """Register a frozen dataclass of state (an optimizer state, the learning context, a
    generation control) as a pytree whose tree definition names its class.

    Not ``jax.tree_util.register_dataclass``: from jaxlib 0.10 on (0.10.2 and 0.12.0.1
    measured; 0.9.2 is right), two tree definitions of such dataclasses compare equal when
    their arity and static values agree, whatever their classes or field names
    (``TopP(p) == MinP(p)``), while their hashes differ. ``jax.jit``'s C++ cache compares the
    definitions of its arguments only when their hashes share a table slot's few bits, so a
    call with one class ran the program compiled for the other about once in a hundred
    lookups: a silently wrong result (``generate(eta_cutoff=...)`` ran the
    ``epsilon_cutoff`` loop with the eta value). A node registered with functions of its
    own compares by its class, so its flattening is a Python function here (about 1 µs a
    record; a training step passes its optimizer state by leaves, ``functree._flat``, and
    rebuilds it inline, so its loop pays none of it). Key paths are ``GetAttrKey`` entries of
    the field names; unflattening calls ``cls(**fields)``, as JAX's dataclass path does.

    Example:
      >>> import dataclasses, jax
      >>> from functree._tree import register_record
      >>> @dataclasses.dataclass(frozen=True)
      ... class Count:
      ...     n: jax.Array
      ...     name: str = "steps"
      >>> _ = register_record(Count, ["n"], ["name"])
      >>> jax.tree.map(lambda n: n + 1, Count(1))
      Count(n=2, name='steps')
      >>> @dataclasses.dataclass(frozen=True)
      ... class Total:
      ...     m: jax.Array
      ...     name: str = "steps"
      >>> _ = register_record(Total, ["m"], ["name"])
      >>> jax.tree.structure(Count(1)) == jax.tree.structure(Total(1))
      False
    """
    data, meta = tuple(data_fields), tuple(meta_fields)
    declared = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(data) | set(meta) != declared or set(data) & set(meta):
        raise ValueError(RECORD_FIELDS.format(cls=cls.__name__, data=data, meta=meta, fields=tuple(sorted(declared))))
    cls.__ft_record__ = (data, meta)  # rebuilt inline by functree._flat
    get_data = _getter(data)
    get_meta = _getter(meta)
    keys = tuple(jax.tree_util.GetAttrKey(n) for n in data)

    def flatten(x: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return get_data(x), get_meta(x)

    def flatten_with_keys(x: Any) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, ...]]:
        return tuple(zip(keys, get_data(x))), get_meta(x)

    def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
        return cls(**dict(zip(meta, aux)), **dict(zip(data, children)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _getter(names: tuple[str, ...]) -> Any:
    """``x -> tuple(getattr(x, n) for n in names)`` as one C call where it can be."""
    if not names:
        return lambda x: ()
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda x: (get(x),)
    return operator.attrgetter(*names)  # a tuple already


def written_dtype(dtype: Any) -> str:
    """``dtype`` as a user writes it, for error messages: ``jnp.int8``, not ``<class
    'jax.numpy.int8'>``; a string (``'bf16'``) or another library's (``torch.bfloat16``) as given.

    Example:
      >>> import jax.numpy as jnp
      >>> written_dtype(jnp.int8), written_dtype("bf16")
      ('jnp.int8', "'bf16'")
    """
    if isinstance(dtype, str):
        return repr(dtype)
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        return repr(dtype)
    if dt.kind == "O":  # any other class is NumPy's object dtype: name the class
        return dtype.__name__ if isinstance(dtype, type) else repr(dtype)
    return f"jnp.{dt.name}"
