"""The entries of a key path and the printed key path's grammar.

An entry is one step from a value to a child: an attribute (``.weight``), a sequence
index (``[0]``) or a mapping key (``["w"]``). A key path prints as its entries one after
the other (``.layers[0]['w']``) and :func:`parse_printed` reads that text back, whatever
the mapping keys hold (quotes, escapes, ints, floats, tuples; NumPy scalars print as their
Python values, equal to them; a NaN key, equal to nothing, is the one exception): the inverse
of ``str(kp)``.

Example:
  >>> from functree._key_entries import parse_printed
  >>> [str(e) for e in parse_printed(".layers[0]['w']")]
  ['.layers', '[0]', "['w']"]
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from functree._tree import dotted_name

__all__ = ["ATTR", "INDEX", "KEY", "Entry", "mapping_entry", "parse_printed"]

ATTR, INDEX, KEY = "attr", "index", "key"


class Entry(NamedTuple):
    kind: str  # ATTR, INDEX or KEY
    key: Any

    def __str__(self) -> str:
        if self.kind == ATTR:
            return f".{self.key}"
        key = _python_key(self.key) if isinstance(self.key, np.generic) else self.key
        return f"[{key!r}]" if self.kind == KEY else f"[{key}]"

    @property
    def name(self) -> str:
        """This entry in a dotted flat-dict name (the name ``ft.to_flat_dict`` gives it)."""
        return dotted_name((self.jax_key(),))

    def jax_key(self) -> Any:
        """The JAX key of this entry (``GetAttrKey``, ``SequenceKey`` or ``DictKey``)."""
        if self.kind == ATTR:
            return jax.tree_util.GetAttrKey(self.key)
        if self.kind == INDEX and isinstance(self.key, int):
            return jax.tree_util.SequenceKey(self.key)
        return jax.tree_util.DictKey(self.key)  # also any other node's key: its name is str(key)


def _python_key(key: np.generic) -> Any:
    """The Python value a NumPy scalar key equals, printed by :class:`Entry` (its repr,
    ``np.str_('a')``, is no literal). Text by its characters: ``.item()`` and ``str()`` drop
    an ``np.str_``'s or ``np.bytes_``'s trailing NULs, and ``np.str_('a\\x00')`` is the key
    ``'a\\x00'`` of its dict, not ``'a'`` (printed ``['a']``, the path read back another key)."""
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, bytes):
        return bytes(key)
    return key.item()


def mapping_entry(key: Any) -> Entry:
    """The entry of a mapping key: an ``int`` key is ``[0]``, like an index (and like JAX prints it);
    a NumPy integer too (it prints as ``[0]``, which reads back as an index)."""
    return Entry(INDEX, key) if type(key) is int or isinstance(key, np.integer) else Entry(KEY, key)


# An attribute (an identifier), an index, or a quoted string key in brackets (Python's repr).
_TOKEN = re.compile(
    r"""\.([^\W\d]\w*)|\[(-?[0-9]+)\]|\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""", re.DOTALL
)
_LITERAL_KEYS = (bool, int, float, complex, bytes, tuple, type(None))


# What repr prints for an infinite float or imaginary part: names, not literals.
_INFINITIES = {"inf": float("inf"), "infj": complex(0, float("inf"))}


class _Infinities(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _INFINITIES:
            return ast.copy_location(ast.Constant(_INFINITIES[node.id]), node)
        return node


def _literal(text: str) -> Any:
    """The Python literal ``text`` spells (``'a\\n'``, ``1.5``, ``(1, 'x')``); infinities as repr
    prints them, anywhere in it (``inf``, ``-inf``, ``(inf, 1)``, ``(1-infj)``); raises if none."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an invalid escape is no key, not a warning
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    return ast.literal_eval(_Infinities().visit(tree))


def parse_printed(text: str) -> tuple[Entry, ...] | None:
    """The entries of the key path ``text`` prints, or None: the inverse of ``str(kp)``."""
    if text in ("", "<root>"):
        return ()
    entries, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is not None and m.group(1) is not None:
            entries.append(Entry(ATTR, m.group(1)))
        elif m is not None and m.group(2) is not None:
            entries.append(Entry(INDEX, int(m.group(2))))
        elif m is not None:
            try:
                entries.append(Entry(KEY, _literal(m.group(3))))
            except (SyntaxError, ValueError, Warning):
                return None
        else:
            entry, end = _parse_other_key(text, pos)
            if entry is None:
                return None
            entries.append(entry)
            pos = end
            continue
        pos = m.end()
    return tuple(entries)


def _parse_other_key(text: str, pos: int) -> tuple[Entry | None, int]:
    """A ``[literal]`` entry at ``pos`` for keys other than strings and ints (``[1.5]``, ``[True]``)."""
    if not text.startswith("[", pos):
        return None, pos
    end = text.find("]", pos)
    while end != -1:
        try:
            key = _literal(text[pos + 1 : end])
            if isinstance(key, _LITERAL_KEYS):
                hash(key)
                return mapping_entry(key), end + 1
        except Exception:  # any text that is no literal key: try the next "]"
            pass
        end = text.find("]", end + 1)
    return None, pos
