"""Key paths: hashable, printable addresses of values inside models and pytrees.

Swift's KeyPathIterable, for JAX pytrees. A key path is a tuple of entries, each an
attribute (``.weight``), a sequence index (``[0]``) or a mapping key (``["w"]``). It
prints as ``.layers[0].weight``, reads with ``kp.get(tree)`` and writes with
``kp.set(tree, value)``, which returns a new tree. The same key path works on a model,
its parameter view, its gradient and any optimizer-state tree shaped like them.

This module reads, writes and iterates key paths (and walks trees, refusing cycles); the
entries and the printed grammar are :mod:`functree._key_entries`, what ``ft.set`` checks
at a leaf :mod:`functree._leaf_checks`, and strings resolved in a tree (``ft.key_path``,
``ft.get``, ``ft.set``, with did-you-mean errors) :mod:`functree._key_path_names`.
"""

from __future__ import annotations

import operator
import re
import types
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree import _compat as compat
from functree import _stacked
from functree._key_entries import ATTR, INDEX, Entry, mapping_entry, parse_printed
from functree._leaf_checks import check_leaf, leaf_spec, quoted
from functree._module import STATIC, Module
from functree._naming import is_tied, refuse_batched_members
from functree._tree import bounded_put, cached, dotted_name

__all__ = [
    "KeyPath",
    "all_key_paths",
    "recursively_all_key_paths",
    "all_writable_key_paths",
    "recursively_all_writable_key_paths",
]

BAD_PATH = """\
Cannot parse key path {text!r}. Write it as printed by functree (".layers[0].weight", \
'["name"]') or as a dotted flat-dict name ("layers.0.weight")."""

NO_SUCH_PATH = """\
Key path {path} does not exist: {where} has no {entry}. {children}"""

CYCLE = """\
The tree contains itself: the {type} at {path} is the same object as its ancestor at \
{ancestor}, so a walk over it would never end. A pytree must be a tree: build a new \
{type} instead of putting a value inside itself (e.g. a list field that holds its own module)."""

BAD_TO = """\
to={to!r} ({type}) is neither a type nor a dtype.
    right:  ft.recursively_all_key_paths(model, to=jax.Array)     # by type
       or:  ft.recursively_all_key_paths(model, to=jnp.float32)   # by dtype"""

STATIC_FIELD = """\
ft.set({path}): {field!r} is a static field of {cls} (ft.field(static=True)): part of the \
model's structure, which key paths read but do not write (Swift's `let`; \
ft.recursively_all_writable_key_paths leaves it out). Build the module anew with it{shared}:
    wrong:  ft.set(model, {quoted}, value)
    right:  {fix}"""

MEMBERS_SHARE_STATIC = """. The members of the {cls} at {stack} share their static fields (one structure, stacked): \
it is set on the {cls}'s block, for every member (a member of its own would be refused)"""

class KeyPath(tuple):
    """A path from a root value to a nested value: ``.layers[0].weight``.

    Hashable and comparable (a tuple of entries), so it can key dicts and be stored.
    ``str(kp)`` parses back exactly with :meth:`KeyPath.parse`, whatever its dict keys
    hold (quotes, backslashes, control characters, ints).

    Example:
      >>> import functree as ft
      >>> kp = ft.key_path({"layers": [{"w": 1.0}]}, "layers.0.w")
      >>> kp
      KeyPath("['layers'][0]['w']")
      >>> kp.get({"layers": [{"w": 1.0}]})
      1.0
      >>> ft.KeyPath.parse(str(kp)) == kp
      True
    """

    def __new__(cls, entries: Any = ()) -> KeyPath:
        return super().__new__(cls, tuple(entries))

    @classmethod
    def parse(cls, text: str) -> KeyPath:
        """The key path ``text`` prints (``".layers[0]['w']"``), without a tree to resolve names.

        Example:
          >>> import functree as ft
          >>> kp = ft.recursively_all_key_paths({'say "hi"': [1.0, 2.0]})[-1]
          >>> print(kp)
          ['say "hi"'][1]
          >>> ft.KeyPath.parse(str(kp)) == kp
          True
        """
        parsed = parse_printed(text) if isinstance(text, str) else None
        if parsed is None:
            raise ValueError(BAD_PATH.format(text=text))
        return cls(parsed)

    def __str__(self) -> str:
        return "".join(str(e) for e in self) or "<root>"

    def __repr__(self) -> str:
        return f"KeyPath({str(self)!r})"

    def __add__(self, other: Any) -> KeyPath:  # type: ignore[override]
        return KeyPath(tuple(self) + tuple(other))

    @property
    def name(self) -> str:
        """Dotted flat-dict name: ``layers.0.weight``."""
        return dotted_name(tuple(e.jax_key() for e in self))

    def get(self, tree: Any) -> Any:
        """The value at this path in ``tree``."""
        for i, entry in enumerate(self):
            tree = _child(tree, entry, KeyPath(self[:i]), self)
        return tree

    def set(self, tree: Any, value: Any) -> Any:
        """A new tree with ``value`` at this path (shape and dtype checked; a static
        field refuses, see :func:`set`)."""
        return _set(tree, self, 0, value)


# Members of a stacked node (ft.nn.Stack): key paths through a member index, which JAX
# never sees (functree._stacked).

OUT_OF_RANGE = """\
Key path {path}: member {index} does not exist; the {cls} holds {n} members (0 to {last}, \
or -{n} to -1 from the end, in a key path or a dotted name: {example!r}).
    wrong:  ft.get(model, {wrong!r})
    right:  ft.get(model, {right!r})"""


def check_member_index(node: Any, index: int, where: Any = (), after: Any = ()) -> int:
    """``index`` as a member number in ``range(len(node))`` (negative counts from the end);
    ``where`` is the key path of ``node`` and ``after`` what follows the member (entries or a
    dotted name), for the error."""
    n = len(node)
    if not isinstance(index, int) or isinstance(index, bool) or not -n <= index < n:
        prefix = KeyPath(where).name
        dotted = (prefix + "." if prefix else "")
        suffix = after if isinstance(after, str) else KeyPath(after).name
        suffix = "." + suffix if suffix else ""
        valid = n - 1 if isinstance(index, int) and index >= 0 else -n
        raise IndexError(OUT_OF_RANGE.format(path=f"{KeyPath(where)}[{index}]".replace("<root>", ""), index=index,
                                             cls=type(node).__name__, n=n, last=n - 1,
                                             example=f"{dotted}-1{suffix}", wrong=f"{dotted}{index}{suffix}",
                                             right=f"{dotted}{valid}{suffix}"))
    return index % n


def stack_member(node: Any, index: int, where: Any = (), after: Any = ()) -> Any:
    """Member ``index`` of the stacked ``node`` (an ``ft.nn.Stack``) (``where`` is its key
    path and ``after`` the rest of the path, for the error)."""
    index = check_member_index(node, index, where, after)
    _refuse_batched(node, index, where, after)
    return node._member(index)


def with_stack_member(node: Any, index: int, value: Any, where: Any = ()) -> Any:
    """A copy of the stacked ``node`` with member ``index`` replaced by ``value``."""
    index = check_member_index(node, index, where)
    _refuse_batched(node, index, where, ())
    return node._with_member(index, value, where)


def _refuse_batched(node: Any, index: int, where: Any, after: Any) -> None:
    """A member of a batch of stacks (a jax.vmap-ed ensemble) refused, named by its key path."""
    prefix = KeyPath(where).name
    suffix = after if isinstance(after, str) else KeyPath(after).name
    path = ".".join(p for p in (prefix, str(index), suffix) if p)
    refuse_batched_members(node, path, prefix)


# An index in a dotted name, spelled as str(int) does: ASCII digits, negative from the end
# ("-1"); no "01", "+1" or "-0".
MEMBER_NUMBER = re.compile(r"0|-?[1-9][0-9]*")


def stack_member_children(node: Any, rest: str, where: Any = ()) -> list[tuple[Any, Any]]:
    """``[(Entry(INDEX, i), member i)]`` when the dotted name ``rest`` starts with a member
    number ``i`` of the stacked ``node``, negative from the end as in a key path
    (``h.-1.bias`` is ``['h'][-1].bias``); ``[]`` otherwise (only that member is sliced)."""
    if not _stacked.is_stacked(node):
        return []
    head, _, after = rest.partition(".")
    if not MEMBER_NUMBER.fullmatch(head):
        return []
    index = int(head)
    return [(Entry(INDEX, index), stack_member(node, index, where, after))]


def _child(node: Any, entry: Entry, prefix: KeyPath, whole: Any = ()) -> Any:
    """The child ``entry`` of ``node`` at ``prefix`` (``whole``: the path read, for errors)."""
    if entry.kind == INDEX and _stacked.is_stacked(node):  # a member of an ft.nn.Stack
        return stack_member(node, entry.key, prefix, whole[len(prefix) + 1 :])
    if _through_tie(node, entry):  # ft.nn.Shared answers to its resolved model's names
        return _child(node.resolve(), entry, prefix, whole)
    try:
        if isinstance(node, Module):
            if entry.kind == ATTR and entry.key in type(node).__ft_field_set__:
                return node.__dict__[entry.key]
        elif is_namedtuple(node) and entry.kind == ATTR:
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


def _through_tie(node: Any, entry: Entry) -> bool:
    """Whether ``entry`` names a child of a tied node's resolved model, not a field of it."""
    return is_tied(node) and not (entry.kind == ATTR and entry.key in type(node).__ft_field_set__)


def _no_such_path(path: Any, prefix: KeyPath, node: Any, entry: Entry) -> str:
    kids = [str(e) for e, _ in children(node)]
    children_text = f"Its children are {kids}." if kids else "It has no children."
    where = f"{type(node).__name__} at {prefix}"
    if node is None:
        children_text += " (None here usually means a non-parameter in a parameter view.)"
    return NO_SUCH_PATH.format(path=KeyPath(path), where=where, entry=entry, children=children_text)

def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _set(tree: Any, path: KeyPath, depth: int, value: Any, stacks: tuple[tuple[int, Any], ...] = ()) -> Any:
    """``tree`` (at ``path[:depth]``) with ``value`` at ``path``; ``stacks``: the depth and
    the node of each stack whose member the path went through (for a static field's fix)."""
    if depth == len(path):
        return check_leaf(path, tree, value)
    entry = path[depth]
    if _through_tie(tree, entry):  # a name of the resolved model: the stored value it comes from
        return tree.set_resolved(KeyPath(path[depth:]), value)
    if isinstance(tree, Module) and entry.kind == ATTR and entry.key in type(tree).__ft_static__:
        raise ValueError(_static_field(tree, path, depth, stacks))
    child = _child(tree, entry, KeyPath(path[:depth]), path)
    member = entry.kind == INDEX and _stacked.is_stacked(tree)
    new_child = _set(child, path, depth + 1, value, (*stacks, (depth, tree)) if member else stacks)
    if member:
        return with_stack_member(tree, entry.key, new_child, KeyPath(path[:depth]))
    if isinstance(tree, Module):
        return tree.replace(**{entry.key: new_child})
    if is_namedtuple(tree):
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


def _static_field(module: Module, path: KeyPath, depth: int, stacks: tuple[tuple[int, Any], ...] = ()) -> str:
    """The error of ``ft.set`` at or below the static field ``path[depth]`` of ``module``.

    Under a stack's member (``h.1.activation``) the owner is the stack's block, whose
    static fields every member shares: its member index becomes the stack's block field
    (``h.layers``), since a member whose static field differs is refused."""
    field, owner = path[depth].key, list(path[:depth])
    for at, stack in stacks:
        owner[at] = Entry(ATTR, type(stack).__ft_stacked_block__)
    owner = KeyPath(owner)
    value = "value" if depth + 1 == len(path) else "..."
    fix = f"model = model.replace({field}={value})"
    if owner:
        fix = f"model = ft.set(model, {quoted(owner)}, ft.get(model, {quoted(owner)}).replace({field}={value}))"
    shared = ""
    if stacks:
        at, stack = stacks[-1]
        shared = MEMBERS_SHARE_STATIC.format(cls=type(stack).__name__, stack=KeyPath(path[:at]))
    return STATIC_FIELD.format(
        path=path, field=field, cls=type(module).__name__, quoted=quoted(path), fix=fix, shared=shared
    )


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
    if is_namedtuple(node):
        return [(Entry(ATTR, n), getattr(node, n)) for n in node._fields]
    if isinstance(node, (list, tuple)):
        return [(Entry(INDEX, i), v) for i, v in enumerate(node)]
    if isinstance(node, Mapping):
        return [(mapping_entry(k), v) for k, v in node.items()]
    if node is None or leaf_spec(node) is not None or isinstance(node, (int, float, complex, str)):
        return []
    return _generic_children(node)


def _generic_children(node: Any) -> list[tuple[Entry, Any]]:
    """Children of any other registered pytree node, through JAX's own key paths."""
    leaves = jax.tree_util.tree_leaves(node, is_leaf=lambda x: x is not node)
    if len(leaves) == 1 and leaves[0] is node:
        return []
    try:
        pairs, _ = compat.flatten_one_level_with_keys(node)
    except ValueError:
        return []
    out = []
    for key, value in pairs:
        if isinstance(key, jax.tree_util.GetAttrKey):
            out.append((Entry(ATTR, key.name), value))
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append((Entry(INDEX, key.idx), value))
        elif isinstance(key, jax.tree_util.DictKey):
            out.append((mapping_entry(key.key), value))
        else:
            out.append((Entry(INDEX, getattr(key, "key", len(out))), value))
    return out


def _static_names(node: Any) -> frozenset[str]:
    if isinstance(node, Module):
        kinds = type(node).__ft_kinds__
        return frozenset(n for n, k in kinds.items() if k == STATIC)
    return frozenset()


def walk(tree: Any, *, writable: bool = False) -> Iterator[tuple[KeyPath, Any]]:
    """Pre-order walk over every nested value (interior nodes included), root excluded.

    Raises ``ValueError`` naming the key path where a value contains itself (a cycle):
    the ids of the nodes on the current path are tracked, so shared subtrees are fine.
    """
    on_path: dict[int, KeyPath] = {}  # id of each interior node on the current path
    stack: list[tuple[KeyPath | None, Any]] = [(KeyPath(), tree)]
    while stack:
        path, node = stack.pop()
        if path is None:  # every child of this node is done
            del on_path[node]
            continue
        static = _static_names(node) if writable else frozenset()
        kids = [(e, v) for e, v in children(node) if not (e.kind == ATTR and e.key in static)]
        if kids:
            if id(node) in on_path:
                raise ValueError(
                    CYCLE.format(type=type(node).__name__, path=path, ancestor=on_path[id(node)])
                )
            on_path[id(node)] = path
            stack.append((None, id(node)))
            for entry, value in reversed(kids):
                stack.append((path + (entry,), value))
        if path:
            yield path, node


def has_cycle(tree: Any) -> bool:
    """Whether ``tree`` contains itself: a lean walk (one-level flattens, ids on the current
    path, no key paths). Run it before JAX's C++ flatten, which on a cycle through a
    Python-registered node (every Module) leaves the interpreter's recursion count broken."""
    on_path: dict[int, None] = {}  # (this module's `set` is ft.set)
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:
        node, done = stack.pop()
        if done:
            on_path.pop(id(node), None)
            continue
        if node is None or isinstance(node, (jax.Array, np.ndarray, float, int, complex, str)):
            continue
        try:
            kids, _ = compat.flatten_one_level(node)
        except ValueError:  # a leaf
            continue
        if id(node) in on_path:
            return True
        on_path[id(node)] = None
        stack.append((node, True))
        stack.extend((k, False) for k in kids)
    return False


def check_acyclic(tree: Any) -> None:
    """Raise ``ValueError`` naming the key path where ``tree`` contains itself, if it does.

    Example:
      >>> from functree._paths import check_acyclic
      >>> loop = [1.0]
      >>> loop.append(loop)
      >>> check_acyclic([1.0, [2.0]])
      >>> check_acyclic(loop)
      Traceback (most recent call last):
      ValueError: The tree contains itself: the list at [1] is the same object as its ancestor at <root>, ...
    """
    for _ in walk(tree):
        pass


# Leaf types. JAX's array type joins on first sight (see _frozen_tree): building an array
# here would start JAX's backend at `import functree` (then jax.distributed.initialize()
# raises and XLA_FLAGS set after the import are ignored).
_ATOMS = {np.ndarray, float, int, bool, complex, str, type(None)}
_DATA: dict[type, Any] = {}  # Module class -> a function from its __dict__ to its data fields
_CHECKED: dict[int, weakref.ref] = {}  # id -> the Module root whose tree is known acyclic


def _data_getter(cls: type) -> Any:
    names = [n for n in cls.__ft_fields__ if n not in cls.__ft_static__]  # type: ignore[attr-defined]
    if len(names) == 1:
        name = names[0]
        return lambda d: (d[name],)
    return operator.itemgetter(*names) if names else (lambda d: ())


def _frozen_tree(tree: Any) -> bool:
    """Whether every node JAX would walk into is a Module, a tuple or None, and no Module
    with such nodes in it is met twice: such a tree has no cycle, and cannot get one
    (nothing in it is mutable). One pass at C speed per node where it can be."""
    inner: dict[int, None] = {}  # Modules holding more than leaves (a cycle passes one)
    stack = [tree]
    pop, push, push_all = stack.pop, stack.append, stack.extend
    only_atoms, data = _ATOMS.issuperset, _DATA
    while stack:
        node = pop()
        kind = type(node)
        getter = data.get(kind)
        if getter is not None:
            kids = getter(node.__dict__)
            if not only_atoms(map(type, kids)):
                if id(node) in inner:  # shared, or a module built holding itself
                    return False
                inner[id(node)] = None
                push_all(kids)
        elif kind is tuple:
            push_all(node)
        elif kind in _ATOMS:
            continue
        elif isinstance(node, Module):
            data[kind] = _data_getter(kind)
            push(node)
        elif isinstance(node, tuple):  # a namedtuple
            push_all(node)
        elif isinstance(node, (jax.Array, np.generic)):
            _ATOMS.add(kind)  # a leaf type (JAX's array, a tracer, a NumPy scalar)
        else:
            return False  # a list, a dict, another node: the full check
    return True


def ensure_acyclic(tree: Any) -> None:
    """:func:`check_acyclic`, at no cost for a Module root already found frozen and acyclic.

    Run before any JAX flatten (see :func:`has_cycle`). A Module whose nodes are Modules
    and tuples is immutable, so its verdict is kept (by identity, weakly).
    """
    ref = _CHECKED.get(id(tree))
    if ref is not None and ref() is tree:
        return
    if _frozen_tree(tree):
        if isinstance(tree, Module):
            bounded_put(_CHECKED, id(tree), weakref.ref(tree))
        return
    if has_cycle(tree):
        check_acyclic(tree)  # raises, naming where


class _Walk(NamedTuple):
    """One tree definition's :func:`walk`: its key paths and what a hit must re-check."""

    paths: tuple[KeyPath, ...]
    parents: tuple[int, ...]  # position of each path's parent (-1: the root)
    mappings: tuple[tuple[int, tuple[Any, ...]], ...]  # (position, its keys with their types)


_WALKS: dict[Any, _Walk] = {}
_LEAF_OK: dict[type, bool] = {}  # JAX leaf types that walk() does not enter either


def _walk_leaf(kind: type) -> bool:
    ok = _LEAF_OK.get(kind)
    if ok is None:
        ok = not issubclass(kind, (list, tuple, Mapping))
        _LEAF_OK[kind] = ok
    return ok


def _key_signature(mapping: Mapping) -> tuple[Any, ...]:
    """A mapping's keys in order with their types: ``{1: x}`` and ``{True: x}`` differ here,
    though their JAX tree definitions are equal (as are ``{"a", "b"}`` in either order)."""
    return tuple((type(k), k) for k in mapping)


def _same_mappings(tree: Any, walked: _Walk) -> bool:
    """Whether each mapping ``walked`` met is in ``tree`` too, with the same key signature."""
    try:
        return all(
            _key_signature(tree if i < 0 else walked.paths[i].get(tree)) == keys
            for i, keys in walked.mappings
        )
    except (KeyError, TypeError):  # not there, or no longer a mapping
        return False


def _cached_walk(tree: Any, writable: bool) -> tuple[_Walk, list[Any] | None]:
    """``walk(tree)`` as a :class:`_Walk`, cached per tree definition; the values too
    when it was walked now (else None: a hit has only the paths).

    The cache is keyed by JAX's tree definition. Where walk() and JAX may see equal tree
    definitions differently, a hit re-checks: every JAX leaf is a leaf of walk() too
    (not an unregistered list or mapping), and every mapping has the same keys in the
    same order, of the same types.
    """
    ensure_acyclic(tree)
    try:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
    except (TypeError, ValueError):  # a tree JAX cannot flatten (dict keys int and str)
        leaves, treedef = [], None
    fits = treedef is not None and all(_walk_leaf(t) for t in {type(x) for x in leaves})
    key, walked = cached(_WALKS, (treedef, writable)) if fits else (None, None)
    if walked is not None and _same_mappings(tree, walked):
        return walked, None
    items = list(walk(tree, writable=writable))
    paths = tuple(p for p, _ in items)
    index = {p: i for i, p in enumerate(paths)}
    parents = tuple(index.get(KeyPath(p[:-1]), -1) for p in paths)
    nodes = [(-1, tree)] + list(enumerate(v for _, v in items))
    mappings = tuple((i, _key_signature(v)) for i, v in nodes if isinstance(v, Mapping))
    walked = _Walk(paths, parents, mappings)
    if key is not None:
        bounded_put(_WALKS, key, walked)
    return walked, [v for _, v in items]


def _walk_values(tree: Any, walked: _Walk) -> list[Any]:
    """The value at each of ``walked.paths`` in ``tree``, each read from its parent's."""
    values: list[Any] = []
    append = values.append
    for path, parent in zip(walked.paths, walked.parents):
        node = tree if parent < 0 else values[parent]
        kind, key = path[-1]
        if kind == ATTR and isinstance(node, Module):  # the common cases first, inline
            append(node.__dict__[key])
        elif kind == INDEX and type(node) in (list, tuple):
            append(node[key])
        else:
            append(_child(node, path[-1], path))
    return values


def _cached_key_paths(x: Any, to: Any, writable: bool) -> list[KeyPath]:
    keep = None if to is None else _type_filter(to)
    walked, values = _cached_walk(x, writable)
    if keep is None:
        return list(walked.paths)
    if values is None:
        values = _walk_values(x, walked)
    return [p for p, v in zip(walked.paths, values) if keep(v)]


def _type_filter(to: Any) -> Any:
    """A predicate for ``to=``: a Python class (isinstance), a dtype (leaf dtype) or a kind
    of dtypes (``jnp.floating``, ``jnp.integer``: ``jnp.issubdtype`` of the leaf's dtype)."""
    if to is None:
        return lambda v: True
    if _dtype_kind(to):
        def of_kind(v: Any) -> bool:
            if isinstance(v, float):
                return bool(jnp.issubdtype(jnp.asarray(v).dtype, to))
            return leaf_spec(v) is not None and bool(jnp.issubdtype(v.dtype, to))
        return of_kind
    dtype = _as_dtype(to)
    if dtype is not None:
        def has_dtype(v: Any) -> bool:
            if isinstance(v, float):
                return jnp.asarray(v).dtype == dtype
            return leaf_spec(v) is not None and v.dtype == dtype
        return has_dtype
    return lambda v: isinstance(v, to)


def _dtype_kind(to: Any) -> bool:
    """Whether ``to`` is a kind of dtypes, no dtype itself (``jnp.floating``, ``np.inexact``,
    ``jnp.integer``, ``np.number``): NumPy's abstract scalar classes, which no leaf is an
    instance of (``isinstance`` would select nothing) and no dtype names."""
    if not (isinstance(to, type) and issubclass(to, np.generic)):
        return False
    try:
        np.dtype(to)
    except TypeError:
        return True
    return False


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
        except TypeError:  # no dtype's name ("float33"): isinstance of a string would fail later
            raise TypeError(BAD_TO.format(to=to, type=type(to).__name__)) from None
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

    ``to=`` filters by type (``jax.Array``, a Module class), by dtype (``jnp.float32``) or by
    a kind of dtypes (``jnp.floating``: bfloat16 to float64; ``jnp.integer``).
    The key paths are computed once per tree definition (for a model, per architecture):
    a later call on any tree of that definition costs about one JAX flatten.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> tree = {"inner": {"w": jnp.ones(2)}, "b": jnp.zeros((), jnp.int32)}
      >>> [str(p) for p in ft.recursively_all_key_paths(tree)]
      ["['inner']", "['inner']['w']", "['b']"]
      >>> [str(p) for p in ft.recursively_all_key_paths(tree, to=jnp.float32)]
      ["['inner']['w']"]
      >>> [str(p) for p in ft.recursively_all_key_paths(tree, to=jnp.integer)]
      ["['b']"]
    """
    return _cached_key_paths(x, to, writable=False)


def recursively_all_writable_key_paths(x: Any, to: Any = None) -> list[KeyPath]:
    """Like :func:`recursively_all_key_paths`, without static fields or anything under them.

    Example (the nested update of Swift's ``KeyPathIterable``):
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = {"layers": [jnp.ones(2), jnp.ones(2)]}
      >>> for kp in ft.recursively_all_writable_key_paths(model, to=jax.Array):
      ...     model = kp.set(model, kp.get(model) - 0.1 * kp.get(model))
      >>> model["layers"][0]
      Array([0.9, 0.9], dtype=float32)
    """
    return _cached_key_paths(x, to, writable=True)
