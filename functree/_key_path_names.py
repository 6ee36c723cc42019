"""Key paths from strings: a printed key path or a dotted flat-dict name, resolved in a tree.

``ft.key_path(tree, text)`` reads ``text`` both ways and refuses an ambiguous string
(naming every value it could mean); a string neither reading finds raises with the
closest names (did you mean). :func:`get` and :func:`set` take either form.
"""

from __future__ import annotations

import difflib
from typing import Any

from functree._key_entries import ATTR, INDEX, Entry, parse_printed
from functree._module import Module
from functree._naming import is_tied
from functree._paths import (
    BAD_PATH,
    MEMBER_NUMBER,
    KeyPath,
    children,
    is_namedtuple,
    stack_member_children,
    walk,
)

__all__ = ["key_path", "get", "set"]

NO_SUCH_NAME = """\
No value in this {root} has the dotted name {text!r}: {where} has no child named {part!r} \
(its children: {children}). Closest names: {close}.
    right:  ft.get(tree, {suggestion!r})"""

AMBIGUOUS_NAME = """\
{text!r} names {count} different values in this tree: {candidates}. {reason} \
Pass the key path itself, not a string:
    right:  ft.get(tree, ft.KeyPath.parse({printed!r}))   # {printed}"""

AS_PRINTED = """\
It reads both as a printed key path and as a dotted flat-dict name (a dict key holds \
brackets, quotes or a leading ".")."""

AS_DOTTED = """\
Several dotted flat-dict names spell it (a dict key holding "." reads like a nested path; \
an int key reads like a str key of the same digits)."""


def _printed(text: str) -> KeyPath | None:
    entries = parse_printed(text)
    return None if entries is None else KeyPath(entries)


def _named_children(node: Any, rest: str) -> list[tuple[Entry, Any]]:
    """The children of ``node`` whose dotted name may start ``rest``, in children order.

    A field's name and an index's digits hold no ".", so a Module, a namedtuple or a
    sequence has at most one such child, found without listing the others; a mapping's
    keys may hold dots, so every child of any other node is a candidate.
    """
    head = rest.partition(".")[0]
    if is_tied(node) and head not in type(node).__ft_field_set__:
        return _named_children(node.resolve(), rest)
    if isinstance(node, Module):
        fields = type(node).__ft_field_set__
        return [(Entry(ATTR, head), node.__dict__[head])] if head in fields else []
    if is_namedtuple(node):
        return [(Entry(ATTR, head), getattr(node, head))] if head in node._fields else []
    if isinstance(node, (list, tuple)):  # [-1] counts from the end, as in a key path
        i = int(head) if MEMBER_NUMBER.fullmatch(head) else len(node)
        return [(Entry(INDEX, i), node[i])] if -len(node) <= i < len(node) and str(i) == head else []
    return children(node)


def _dotted_search(tree: Any, text: str) -> tuple[list[KeyPath], tuple[KeyPath, Any, str]]:
    """Every key path whose dotted name is ``text``, and the deepest prefix reached.

    A dict key may itself hold dots (``{"a.b": ...}``), so each child whose name is a
    prefix of the rest (followed by ``.`` or the end) is tried. The deepest prefix is
    ``(path, node, rest)``, for the error when nothing matches.
    """
    found: list[KeyPath] = []
    deepest: tuple[KeyPath, Any, str] = (KeyPath(), tree, text)
    stack = [(KeyPath(), tree, text)]
    while stack:
        path, node, rest = stack.pop()
        if len(path) > len(deepest[0]):
            deepest = (path, node, rest)
        for entry, value in _named_children(node, rest) + stack_member_children(node, rest, path):
            name = entry.name
            if rest == name:
                found.append(path + (entry,))
            elif rest.startswith(name + "."):
                stack.append((path + (entry,), value, rest[len(name) + 1 :]))
    return sorted(dict.fromkeys(found), key=len), deepest


def _exists(tree: Any, path: KeyPath) -> bool:
    try:
        path.get(tree)
    except KeyError:
        return False
    return True


def _ambiguous(text: str, candidates: list[KeyPath], printed_too: bool) -> ValueError:
    listed = ", ".join(f"{kp} (dotted name {kp.name!r})" for kp in candidates)
    return ValueError(
        AMBIGUOUS_NAME.format(
            text=text, count=len(candidates), candidates=listed, printed=str(candidates[-1]),
            reason=AS_PRINTED if printed_too else AS_DOTTED,
        )
    )


def _no_such_name(tree: Any, text: str, deepest: tuple[KeyPath, Any, str]) -> KeyError:
    path, node, rest = deepest
    try:
        names = [kp.name for kp, _ in walk(tree)]
    except ValueError:  # a cycle: no list of names
        names = []
    close = difflib.get_close_matches(text, names, n=3, cutoff=0.5)
    where = f"the {type(node).__name__} at {path}" if path else f"the {type(tree).__name__}"
    return KeyError(
        NO_SUCH_NAME.format(
            root=type(tree).__name__, text=text, where=where, part=rest.split(".")[0],
            children=[e.name for e, _ in children(node)], close=close or "none",
            suggestion=close[0] if close else (names[0] if names else "<root>"),
        )
    )


def key_path(tree: Any, path: KeyPath | str) -> KeyPath:
    """A :class:`KeyPath` from a key path or its string (``".layers[0].w"`` or ``"layers.0.w"``).

    An index, of a list or tuple or of an ``ft.nn.Stack``'s members, counts from the end
    when negative, in both forms: ``"layers.-1.w"`` is ``".layers[-1].w"``.

    A string is read two ways: as a printed key path (``str(kp)``, which starts with ``.``
    or ``[``) and as a dotted flat-dict name (``kp.name``, the keys of
    :func:`to_flat_dict`), resolved against ``tree``. A printed key path's keys are Python
    literals in any quoting, as written in code: ``["a"]`` and ``['a']`` are the same path
    (:meth:`KeyPath.parse` reads both; ``str(kp)`` prints the second). When the readings
    name different values in ``tree`` (``{"a": x, '["a"]': y}``: ``'["a"]'`` prints
    ``['a']`` and is the dotted name of the other key) the string is ambiguous and this
    raises, naming both, instead of picking one; pass a :class:`KeyPath` then. A string
    neither reading finds raises naming the closest names. Without a tree
    (``tree=None``) a printed key path parses as is.

    Example:
      >>> import functree as ft
      >>> ft.key_path(None, ".layers[0].w")
      KeyPath('.layers[0].w')
      >>> ft.key_path({"layers": [{"w": 1.0}]}, "layers.0.w").name
      'layers.0.w'
      >>> ft.key_path({"a.b": 1.0}, "a.b")
      KeyPath("['a.b']")
      >>> ft.key_path({"a": 1.0}, '["a"]')
      KeyPath("['a']")
      >>> ft.key_path({"a": 1.0, '["a"]': 2.0}, '["a"]')
      Traceback (most recent call last):
      ValueError: '["a"]' names 2 different values in this tree: ['a'] (dotted name 'a'), ...
    """
    if isinstance(path, KeyPath):
        return path
    if not isinstance(path, str):
        raise TypeError(f"A key path is a ft.KeyPath or a string, got {type(path).__name__}.")
    parsed = _printed(path) if path[:1] in ("", ".", "[", "<") else None
    dotted, deepest = _dotted_search(tree, path)
    if parsed is not None and (not dotted or _exists(tree, parsed)):
        if any(kp != parsed for kp in dotted):
            raise _ambiguous(path, [parsed] + [kp for kp in dotted if kp != parsed], printed_too=True)
        return parsed
    if len(dotted) == 1:
        return dotted[0]
    if dotted:
        raise _ambiguous(path, dotted, printed_too=False)
    if path[:1] in (".", "["):
        raise ValueError(BAD_PATH.format(text=path))
    raise _no_such_name(tree, path, deepest)


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

    Only writable key paths take a value: a static field (``ft.field(static=True)``) is
    part of the model's structure, and setting it (or anything under it) raises with the
    fix, ``model.replace(activation=...)``, as assigning a Swift ``let`` is an error.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.set({"w": jnp.zeros(2)}, "w", jnp.ones(2))["w"]
      Array([1., 1.], dtype=float32)
    """
    return key_path(tree, path).set(tree, value)
