"""Flat state dicts: ``{"layers.0.weight": array, ...}`` and back, checked by key path."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from functree._parameters import _jax_path_name

__all__ = ["to_flat_dict", "from_flat_dict", "FlatDictReport"]

DUPLICATE_NAME = """\
ft.to_flat_dict: two leaves share the dotted name {name!r} ({first} and {second}); a dict key \
containing "." collides with a nested path. Rename the key, e.g. {fixed!r}."""

FLAT_DICT_MISMATCH = """\
ft.from_flat_dict: the flat dict does not fit the template.
{report}
Pass strict=False to fill what matches and get this report back instead."""


def _is_none(x: Any) -> bool:
    return x is None


def _spec(x: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(x, (float, int, complex)) and not hasattr(x, "dtype"):
        return (), type(x).__name__
    return tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))


def to_flat_dict(tree: Any) -> dict[str, Any]:
    """A flat dict from dotted key-path names to leaves (``None`` leaves skipped).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.to_flat_dict({"layers": [{"w": jnp.ones(2)}], "b": 0.5})
      {'b': 0.5, 'layers.0.w': Array([1., 1.], dtype=float32)}
    """
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = {_jax_path_name(p): leaf for p, leaf in path_leaves}
    if len(flat) != len(path_leaves):
        _raise_duplicate(path_leaves)
    return flat


def _raise_duplicate(path_leaves: list[tuple[Any, Any]]) -> None:
    seen: dict[str, Any] = {}
    for path, _ in path_leaves:
        name = _jax_path_name(path)
        if name in seen:
            raise ValueError(
                DUPLICATE_NAME.format(
                    name=name,
                    first=jax.tree_util.keystr(seen[name]),
                    second=jax.tree_util.keystr(path),
                    fixed=name.replace(".", "_"),
                )
            )
        seen[name] = path


@dataclasses.dataclass(frozen=True)
class FlatDictReport:
    """What did not fit in :func:`from_flat_dict`: names missing, unexpected and mismatched."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str, str], ...] = ()  # (name, expected, given)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = []
        if self.missing:
            lines.append(f"  missing keys:    {list(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected keys: {list(self.unexpected)}")
        for name, expected, given in self.mismatched:
            lines.append(f"  {name}: expected {expected}, given {given}")
        return "\n".join(lines) or "  everything matched"


def from_flat_dict(template: Any, flat: Mapping[str, Any], *, strict: bool = True) -> Any:
    """Rebuild a tree shaped like ``template`` from a flat dict made by :func:`to_flat_dict`.

    Every leaf's shape and dtype is checked against the template. With ``strict=True`` any
    mismatch raises one error listing missing keys, unexpected keys and shape/dtype
    mismatches by name; with ``strict=False`` the template's leaf is kept wherever the
    flat dict does not fit, and ``(tree, report)`` is returned.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> template = {"w": jnp.zeros(2)}
      >>> ft.from_flat_dict(template, {"w": jnp.ones(2)})["w"]
      Array([1., 1.], dtype=float32)
    """
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [_jax_path_name(p) for p, _ in path_leaves]
    missing, mismatched, leaves = [], [], []
    for name, (_, old) in zip(names, path_leaves):
        if name not in flat:
            missing.append(name)
            leaves.append(old)
            continue
        new = flat[name]
        if _spec(old) != _spec(new) and not _python_scalar_fits(old, new):
            mismatched.append((name, _fmt(_spec(old)), _fmt(_spec(new))))
            leaves.append(old)
        else:
            leaves.append(new)
    known = frozenset(names)
    unexpected = tuple(k for k in flat if k not in known)
    report = FlatDictReport(tuple(missing), unexpected, tuple(mismatched))
    if strict and not report.ok:
        raise ValueError(FLAT_DICT_MISMATCH.format(report=report))
    tree = jax.tree.unflatten(treedef, leaves)
    return tree if strict else (tree, report)


def _python_scalar_fits(old: Any, new: Any) -> bool:
    """A Python scalar leaf (Swift's ``bias: Float``) accepts a scalar array of its kind.

    Checkpoints store Python floats, ints and bools as 0-d arrays (float32, int32, bool).
    """
    if not isinstance(old, (bool, int, float)) or np.shape(new) != ():
        return False
    kind = np.dtype(getattr(new, "dtype", type(new))).kind
    if isinstance(old, bool):
        return kind == "b"
    return kind in ("i", "u") if isinstance(old, int) else kind == "f"


def _fmt(spec: tuple[tuple[int, ...], str]) -> str:
    return f"shape {spec[0]} dtype {spec[1]}"
