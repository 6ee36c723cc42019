"""Names a pattern cannot tell apart: two leaves of one dotted name, one leaf's name a dotted
prefix of another's, twins through the dict key ``""``. The naming layer
(:mod:`functree._naming`) refuses such a tree before a pattern selects in it, once per tree
definition; a flat dict (:func:`ft.to_flat_dict`) refuses only equal names, which it
cannot hold twice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from functree._tree import bounded_put, cached, is_none

__all__ = ["NAMES_COLLIDE", "refuse_collisions", "str_keys_only"]


def str_keys_only(tree: Any) -> bool:
    """Whether every dict key of ``tree`` is a ``str`` (``{1: x}`` and ``{"1": x}`` have
    equal tree definitions but different names: only such trees are cached by definition)."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)
    return all(type(k.key) is str for p, _ in pairs for k in p if isinstance(k, jax.tree_util.DictKey))


NAMES_COLLIDE = """\
{what}: the leaf at {first} is named {name!r} and the leaf at {second} {relation} {other!r}, \
so a pattern cannot tell them apart ({pattern!r} selects both): a dict key containing "." \
reads as a nested path, an int key as the str key of its digits, the key "" as a leading \
"." (which a pattern may also write). Rename the key:
    wrong:  {{{key!r}: ...}}
    right:  {{{fixed!r}: ...}}"""

_COLLISIONS: dict[Any, bool] = {}  # tree definition -> its names were found distinct


def refuse_collisions(tree: Any, names: Sequence[Sequence[str]], what: str) -> None:
    """Raise :data:`NAMES_COLLIDE` when two leaves of ``tree`` answer to one name, one
    leaf's name is a dotted prefix of another's (``{"a": x, "a.b": y}``: the pattern ``"a"``
    would select both), or a node's name is another's with a leading ``.`` (the key ``""``:
    ``.layers`` and ``layers``). ``names``: every name of each leaf (JAX order, ``None``
    leaves included; member names and tie names too). Once per tree definition.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree._collisions import refuse_collisions
      >>> refuse_collisions({"a": jnp.ones(2), "ab": jnp.ones(2)}, [["a"], ["ab"]], "ft.select")
      >>> refuse_collisions({"a": jnp.ones(2), "a.b": jnp.ones(2)}, [["a"], ["a.b"]], "ft.select")
      Traceback (most recent call last):
      ...
      ValueError: ft.select: the leaf at ['a'] is named 'a' and the leaf at ['a.b'] is named 'a.b', ...
    """
    treedef = jax.tree.structure(tree, is_leaf=is_none)
    key, seen = cached(_COLLISIONS, treedef)
    if seen:
        return
    owner: dict[str, int] = {}  # every name of a leaf -> its leaf
    for j, own in enumerate(names):
        for name in own:
            if owner.setdefault(name, j) != j:
                _raise_collision(tree, what, owner[name], j, name, name, name)
    nodes: dict[str, dict[int, str]] = {}  # every dotted prefix -> the leaves under it, a name of each
    for name, j in owner.items():
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            k = owner.get(prefix, j) if end < len(parts) else j
            if k != j:
                _raise_collision(tree, what, k, j, prefix, name, prefix)
            nodes.setdefault(prefix, {}).setdefault(j, name)
    for prefix, under in nodes.items():
        # The pattern "." + prefix names both this node and the node "." + prefix (the key
        # ""): one selection only where the two hold the same leaves ({"": {"": x, "a": y}}:
        # "." is the leaf x and the node holding x and y).
        dotted = nodes.get("." + prefix, under)
        if dotted.keys() != under.keys():
            j = next((i for i in under if i not in dotted), next(iter(under)))
            k = next((i for i in dotted if i not in under and i != j), next(i for i in dotted if i != j))
            _raise_collision(tree, what, j, k, under[j], dotted[k], "." + prefix)
    if key is not None and str_keys_only(tree):
        bounded_put(_COLLISIONS, key, True)


def _raise_collision(tree: Any, what: str, first: int, second: int, name: str, other: str, pattern: str) -> None:
    """Raise :data:`NAMES_COLLIDE` for leaves ``first`` and ``second`` (JAX order), by key
    path, with the key to rename: one containing ``.``, the key ``""`` or an int key."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0]]
    keys = [k.key for i in (first, second) for k in paths[i] if isinstance(k, jax.tree_util.DictKey)]
    culprit = next((k for k in keys if not isinstance(k, str) or "." in k or not k), keys[-1] if keys else name)
    fixed = (culprit.replace(".", "_") or "_") if isinstance(culprit, str) else f"k{culprit}"
    raise ValueError(NAMES_COLLIDE.format(
        what=what, first=jax.tree_util.keystr(paths[first]) or "<root>", name=name,
        second=jax.tree_util.keystr(paths[second]) or "<root>", other=other, pattern=pattern,
        relation="is also named" if name == other else "is named", key=culprit, fixed=fixed))
