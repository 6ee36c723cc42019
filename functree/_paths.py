"""Key paths: hashable, printable addresses of values inside models and pytrees.

Swift's KeyPathIterable, for JAX pytrees. A key path is a tuple of entries, each an
attribute (``.weight``), a sequence index (``[0]``) or a mapping key (``["w"]``). It
prints as ``.layers[0].weight``, reads with ``kp.get(tree)`` and writes with
``kp.set(tree, value)``, which returns a new tree. The same key path works on a model,
its parameter view, its gradient and any optimizer-state tree shaped like them.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import STATIC, Module

__all__ = [
    "KeyPath",
    "key_path",
    "get",
    "set",
    "all_key_paths",
    "recursively_all_key_paths",
    "all_writable_key_paths",
    "recursively_all_writable_key_paths",
]

ATTR, INDEX, KEY = "attr", "index", "key"

BAD_PATH = """\
Cannot parse key path {text!r}. Write it as printed by functree (".layers[0].weight", \
'["name"]') or as a dotted flat-dict name ("layers.0.weight")."""

NO_SUCH_PATH = """\
Key path {path} does not exist: {where} has no {entry}. {children}"""

BAD_TO = """\
to={to!r} ({type}) is neither a type nor a dtype.
    right:  ft.recursively_all_key_paths(model, to=jax.Array)     # by type
       or:  ft.recursively_all_key_paths(model, to=jnp.float32)   # by dtype"""

SHAPE_MISMATCH = """\
ft.set({path}): expected shape {expected_shape} and dtype {expected_dtype}, \
got shape {given_shape} and dtype {given_dtype}.
Convert first, e.g. ft.set(tree, "{path}", value.astype(jnp.{expected_dtype}).reshape({expected_shape}))."""


class Entry(NamedTuple):
    kind: str  # ATTR, INDEX or KEY
    key: Any

    def __str__(self) -> str:
        if self.kind == ATTR:
            return f".{self.key}"
        return f"[{self.key!r}]" if self.kind == KEY else f"[{self.key}]"

    @property
    def name(self) -> str:
        """This entry in a dotted flat-dict name."""
        return str(self.key)


class KeyPath(tuple):
    """A path from a root value to a nested value: ``.layers[0].weight``.

    Hashable and comparable (a tuple of entries), so it can key dicts and be stored.

    Example:
      >>> import functree as ft
      >>> kp = ft.key_path({"layers": [{"w": 1.0}]}, "layers.0.w")
      >>> kp
      KeyPath("['layers'][0]['w']")
      >>> kp.get({"layers": [{"w": 1.0}]})
      1.0
    """

    def __new__(cls, entries: Any = ()) -> KeyPath:
        return super().__new__(cls, tuple(entries))

    def __str__(self) -> str:
        return "".join(str(e) for e in self) or "<root>"

    def __repr__(self) -> str:
        return f"KeyPath({str(self)!r})"

    def __add__(self, other: Any) -> KeyPath:  # type: ignore[override]
        return KeyPath(tuple(self) + tuple(other))

    @property
    def name(self) -> str:
        """Dotted flat-dict name: ``layers.0.weight``."""
        return ".".join(e.name for e in self)

    def get(self, tree: Any) -> Any:
        """The value at this path in ``tree``."""
        for i, entry in enumerate(self):
            tree = _child(tree, entry, KeyPath(self[:i]))
        return tree

    def set(self, tree: Any, value: Any) -> Any:
        """A new tree with ``value`` at this path (shape and dtype checked)."""
        return _set(tree, self, 0, value)


def _child(node: Any, entry: Entry, prefix: KeyPath) -> Any:
    try:
        if isinstance(node, Module):
            if entry.kind == ATTR and entry.key in type(node).__ft_field_set__:
                return node.__dict__[entry.key]
        elif _is_namedtuple(node) and entry.kind == ATTR:
            return getattr(node, entry.key)
        elif isinstance(node, (list, tuple)):
            if entry.kind == INDEX:
                return node[entry.key]
        elif isinstance(node, Mapping):
            if entry.kind != ATTR:  # an int dict key prints as [0], like an index
                return node[entry.key]
        elif node is not None:
            for e, value in _generic_children(node):
                if e == entry:
                    return value
    except (LookupError, AttributeError, TypeError):
        pass
    raise KeyError(_no_such_path(prefix + (entry,), prefix, node, entry))


def _no_such_path(path: Any, prefix: KeyPath, node: Any, entry: Entry) -> str:
    kids = [str(e) for e, _ in children(node)]
    children_text = f"Its children are {kids}." if kids else "It has no children."
    where = f"{type(node).__name__} at {prefix}"
    if node is None:
        children_text += " (None here usually means a non-parameter in a parameter view.)"
    return NO_SUCH_PATH.format(path=KeyPath(path), where=where, entry=entry, children=children_text)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], Any] | None:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return tuple(x.shape), x.dtype
    if isinstance(x, jax.ShapeDtypeStruct):
        return tuple(x.shape), x.dtype
    return None


def _check_leaf(path: KeyPath, old: Any, new: Any) -> None:
    old_spec, new_spec = _leaf_spec(old), _leaf_spec(new)
    if old_spec is None:
        return
    if new_spec is None:
        if isinstance(new, (int, float, complex)) and not isinstance(new, bool) and old_spec[0] == ():
            return
        new_spec = (jnp.shape(new), type(new).__name__) if not isinstance(new, Module) else ("-", type(new).__name__)
    if old_spec[0] != new_spec[0] or old_spec[1] != new_spec[1]:
        raise ValueError(
            SHAPE_MISMATCH.format(
                path=path,
                expected_shape=old_spec[0],
                expected_dtype=old_spec[1],
                given_shape=new_spec[0],
                given_dtype=new_spec[1],
            )
        )


def _set(tree: Any, path: KeyPath, depth: int, value: Any) -> Any:
    if depth == len(path):
        _check_leaf(path, tree, value)
        return value
    entry = path[depth]
    child = _child(tree, entry, KeyPath(path[:depth]))
    new_child = _set(child, path, depth + 1, value)
    if isinstance(tree, Module):
        return tree.replace(**{entry.key: new_child})
    if _is_namedtuple(tree):
        return tree._replace(**{entry.key: new_child})
    if isinstance(tree, list):
        out = list(tree)
        out[entry.key] = new_child
        return out
    if isinstance(tree, tuple):
        index = entry.key % len(tree)  # [-1] addresses the last element
        return tuple(new_child if i == index else v for i, v in enumerate(tree))
    if isinstance(tree, Mapping):
        out = dict(tree)
        out[entry.key] = new_child
        return out if type(tree) is dict else type(tree)(out)  # pyright: ignore[reportCallIssue]
    return _set_generic_child(tree, entry, new_child)


def _set_generic_child(tree: Any, entry: Entry, new_child: Any) -> Any:
    """Replace one child of any other registered pytree node, through its flatten."""
    kids, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    position = [e for e, _ in children(tree)].index(entry)
    kids[position] = new_child
    return jax.tree_util.tree_unflatten(treedef, kids)


def children(node: Any) -> list[tuple[Entry, Any]]:
    """Direct children of a node with their entries, in declaration/insertion order."""
    if isinstance(node, Module):
        return [(Entry(ATTR, n), node.__dict__[n]) for n in type(node).__ft_fields__]
    if _is_namedtuple(node):
        return [(Entry(ATTR, n), getattr(node, n)) for n in node._fields]
    if isinstance(node, (list, tuple)):
        return [(Entry(INDEX, i), v) for i, v in enumerate(node)]
    if isinstance(node, Mapping):
        return [(Entry(KEY, k), v) for k, v in node.items()]
    if node is None or _leaf_spec(node) is not None or isinstance(node, (int, float, complex, str)):
        return []
    return _generic_children(node)


def _generic_children(node: Any) -> list[tuple[Entry, Any]]:
    """Children of any other registered pytree node, through JAX's own key paths."""
    leaves = jax.tree_util.tree_leaves(node, is_leaf=lambda x: x is not node)
    if len(leaves) == 1 and leaves[0] is node:
        return []
    from jax._src.tree_util import flatten_one_level_with_keys

    try:
        pairs, _ = flatten_one_level_with_keys(node)
    except ValueError:
        return []
    out = []
    for key, value in pairs:
        if isinstance(key, jax.tree_util.GetAttrKey):
            out.append((Entry(ATTR, key.name), value))
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append((Entry(INDEX, key.idx), value))
        elif isinstance(key, jax.tree_util.DictKey):
            out.append((Entry(KEY, key.key), value))
        else:
            out.append((Entry(INDEX, getattr(key, "key", len(out))), value))
    return out


def _static_names(node: Any) -> frozenset[str]:
    if isinstance(node, Module):
        kinds = type(node).__ft_kinds__
        return frozenset(n for n, k in kinds.items() if k == STATIC)
    return frozenset()


def walk(tree: Any, *, writable: bool = False) -> Iterator[tuple[KeyPath, Any]]:
    """Pre-order walk over every nested value (interior nodes included), root excluded."""
    stack: list[tuple[KeyPath, Any]] = [(KeyPath(), tree)]
    while stack:
        path, node = stack.pop()
        static = _static_names(node) if writable else frozenset()
        kids = [(e, v) for e, v in children(node) if not (e.kind == ATTR and e.key in static)]
        for entry, value in reversed(kids):
            stack.append((path + (entry,), value))
        if path:
            yield path, node


def _type_filter(to: Any) -> Any:
    """A predicate for ``to=``: a Python class (isinstance) or a dtype (leaf dtype)."""
    if to is None:
        return lambda v: True
    dtype = _as_dtype(to)
    if dtype is not None:
        def has_dtype(v: Any) -> bool:
            if isinstance(v, float):
                return jnp.asarray(v).dtype == dtype
            return _leaf_spec(v) is not None and v.dtype == dtype
        return has_dtype
    return lambda v: isinstance(v, to)


def _as_dtype(to: Any) -> np.dtype | None:
    """The dtype ``to`` names (``jnp.float32``, ``np.float32``, ``"bfloat16"``), else None."""
    if isinstance(to, np.dtype):
        return to
    if isinstance(to, type) and issubclass(to, np.generic):
        return np.dtype(to)
    if isinstance(getattr(to, "dtype", None), np.dtype):  # jnp.float32 and friends
        return np.dtype(to.dtype)
    if isinstance(to, str):
        try:
            return np.dtype(jnp.dtype(to))
        except TypeError:
            return None
    if not isinstance(to, (type, tuple, types.UnionType)):
        raise TypeError(BAD_TO.format(to=to, type=type(to).__name__))
    return None


def all_key_paths(x: Any) -> list[KeyPath]:
    """Key paths to the direct children of ``x`` in declaration order, static fields included.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.all_key_paths({"w": jnp.ones(2), "b": 1.0})
      [KeyPath("['w']"), KeyPath("['b']")]
    """
    return [KeyPath((e,)) for e, _ in children(x)]


def all_writable_key_paths(x: Any, to: Any = None) -> list[KeyPath]:
    """Like :func:`all_key_paths` but only data fields (no static fields), filtered by ``to``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Affine(ft.Module):
      ...     w: jnp.ndarray
      ...     act: str = ft.field(static=True, default="relu")
      >>> ft.all_writable_key_paths(Affine(jnp.ones(2)))
      [KeyPath('.w')]
    """
    keep = _type_filter(to)
    static = _static_names(x)
    return [
        KeyPath((e,))
        for e, v in children(x)
        if not (e.kind == ATTR and e.key in static) and keep(v)
    ]


def recursively_all_key_paths(x: Any, to: Any = None) -> list[KeyPath]:
    """Every nested key path in pre-order, interior nodes first (``.inner`` before ``.inner.w``).

    ``to=`` filters by type (``jax.Array``, a Module class) or by dtype (``jnp.float32``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> tree = {"inner": {"w": jnp.ones(2)}, "b": jnp.zeros((), jnp.int32)}
      >>> [str(p) for p in ft.recursively_all_key_paths(tree)]
      ["['inner']", "['inner']['w']", "['b']"]
      >>> [str(p) for p in ft.recursively_all_key_paths(tree, to=jnp.float32)]
      ["['inner']['w']"]
    """
    keep = _type_filter(to)
    return [p for p, v in walk(x) if keep(v)]


def recursively_all_writable_key_paths(x: Any, to: Any = None) -> list[KeyPath]:
    """Like :func:`recursively_all_key_paths`, without static fields or anything under them.

    Example (seed 000's nested update):
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = {"layers": [jnp.ones(2), jnp.ones(2)]}
      >>> for kp in ft.recursively_all_writable_key_paths(model, to=jax.Array):
      ...     model = kp.set(model, kp.get(model) - 0.1 * kp.get(model))
      >>> model["layers"][0]
      Array([0.9, 0.9], dtype=float32)
    """
    keep = _type_filter(to)
    return [p for p, v in walk(x, writable=True) if keep(v)]


_TOKEN = re.compile(r"""\.([A-Za-z_][A-Za-z0-9_]*)|\[(-?\d+)\]|\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""")


def _parse_canonical(text: str) -> KeyPath | None:
    entries, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        if m.group(1) is not None:
            entries.append(Entry(ATTR, m.group(1)))
        elif m.group(2) is not None:
            entries.append(Entry(INDEX, int(m.group(2))))
        else:
            entries.append(Entry(KEY, m.group(3)[1:-1]))
        pos = m.end()
    return KeyPath(entries)


def _resolve_dotted(tree: Any, text: str) -> KeyPath:
    entries: list[Entry] = []
    node = tree
    for part in text.split("."):
        match = None
        for entry, value in children(node):
            if entry.name == part:
                match = (entry, value)
                break
        if match is None:
            raise KeyError(
                _no_such_path(KeyPath(entries) + (Entry(KEY, part),), KeyPath(entries), node, Entry(KEY, part))
            )
        entries.append(match[0])
        node = match[1]
    return KeyPath(entries)


def key_path(tree: Any, path: KeyPath | str) -> KeyPath:
    """A :class:`KeyPath` from a key path or its string (``".layers[0].w"`` or ``"layers.0.w"``).

    Canonical strings (starting with ``.`` or ``[``) parse without a tree; dotted names are
    resolved against ``tree``.

    Example:
      >>> import functree as ft
      >>> ft.key_path(None, ".layers[0].w")
      KeyPath('.layers[0].w')
      >>> ft.key_path({"layers": [{"w": 1.0}]}, "layers.0.w").name
      'layers.0.w'
    """
    if isinstance(path, KeyPath):
        return path
    if not isinstance(path, str):
        raise TypeError(f"A key path is a ft.KeyPath or a string, got {type(path).__name__}.")
    if path in ("", "<root>"):
        return KeyPath()
    if path[0] in ".[":
        parsed = _parse_canonical(path)
        if parsed is None:
            raise ValueError(BAD_PATH.format(text=path))
        return parsed
    return _resolve_dotted(tree, path)


def get(tree: Any, path: KeyPath | str) -> Any:
    """The value at ``path`` in ``tree``: ``ft.get(model, ".layers[0].weight")``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.get({"layers": [jnp.ones(2), jnp.zeros(1)]}, "layers.1")
      Array([0.], dtype=float32)
    """
    return key_path(tree, path).get(tree)


def set(tree: Any, path: KeyPath | str, value: Any) -> Any:  # noqa: A001 - Swift's name
    """A new tree with ``value`` at ``path``; shape and dtype must match the old value.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.set({"w": jnp.zeros(2)}, "w", jnp.ones(2))["w"]
      Array([1., 1.], dtype=float32)
    """
    return key_path(tree, path).set(tree, value)
