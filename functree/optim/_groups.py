"""Parameter groups by name: a different optimizer for each glob over dotted names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from functree._naming import leaf_infos, member_names, required_selection
from functree._tree import is_none
from functree.optim._masked import partition_members

__all__ = ["groups"]

DEFAULT_LABEL = "<default>"

UNMATCHED = """\
ft.optim.groups: parameter {name!r} matches no group pattern ({patterns}).
Add a pattern for it or a default optimizer:

    right:  ft.optim.groups({{..., "{name}": ft.optim.adam(1e-3)}})
       or:  ft.optim.groups({{...}}, default=ft.optim.adam(1e-3))
"""

AMBIGUOUS = """\
ft.optim.groups: parameter {name!r} matches two groups, {first!r} and {second!r}.
Each parameter must belong to exactly one group; narrow a pattern, e.g. with an explicit \
name or a character class ("layers.[01].*").
"""

EMPTY = "ft.optim.groups needs at least one {{pattern: transform}} entry, got {given!r}."


GROUP_SELECTS_NOTHING = """\
ft.optim.groups: the group pattern {pattern!r} matches no name in the model, so its optimizer
trains nothing (and what it meant trains with another group's). Closest names: {close}.
    wrong:  ft.optim.groups({{{pattern!r}: ...}}, default=...)
    right:  ft.optim.groups({{{right!r}: ...}}, default=...)"""


def _selections(params: Any, patterns: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Per pattern, what it selects of each leaf (bools, member arrays). A pattern matching
    no name of the tree is refused (a typo's parameters went to the default silently); one
    matching only non-parameters (a part frozen elsewhere) is not."""
    return [required_selection(params, p, "ft.optim.groups", GROUP_SELECTS_NOTHING, "*") for p in patterns]


def _where(info: Any, count: Any, at: int) -> str:
    """The name of a leaf, or of its member ``at`` where ``count`` is per member."""
    return info.name if np.ndim(count) == 0 else member_names(info)[at]


def _labels(params: Any, patterns: tuple[str, ...], has_default: bool) -> tuple[list[Any], Any, list[Any]]:
    """``(labels, treedef, picks)``: a label per leaf (None where split among groups by
    members), and per pattern its selection; an error for a parameter (or member) in two
    groups or in none without a default."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
    infos = leaf_infos(params)
    picks = _selections(params, patterns)
    labels: list[Any] = []
    for k, (info, leaf) in enumerate(zip(infos, leaves)):
        if leaf is None:
            labels.append(None)
            continue
        hits = [(p, np.asarray(s[k])) for p, s in zip(patterns, picks) if np.any(s[k])]
        count = sum((h.astype(int) for _, h in hits), np.zeros((), int))
        if np.any(count > 1):
            at = int(np.argmax(np.ravel(count > 1)))
            both = [p for p, h in hits if np.ravel(np.broadcast_to(h, np.shape(count)))[at]]
            raise ValueError(AMBIGUOUS.format(name=_where(info, count, at), first=both[0], second=both[1]))
        if np.any(count == 0) and not has_default:
            at = _where(info, count, int(np.argmax(np.ravel(count == 0))))
            raise ValueError(UNMATCHED.format(name=at, patterns=", ".join(map(repr, patterns))))
        whole = [p for p, h in hits if h.ndim == 0]
        labels.append(whole[0] if whole else DEFAULT_LABEL if not hits else None)
    return labels, treedef, picks


def groups(
    transforms: Mapping[str, optax.GradientTransformation],
    default: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
    """One optimizer per parameter group, chosen by globs over ``ft.to_flat_dict`` names.

    Patterns work as in :func:`ft.select` (``"encoder.*"``, ``"*.bias"``,
    ``"layers.[01].*"``), members of a Stack included (``"h.[0-5].*"``: a group may hold
    part of a stacked leaf; each member is then updated by its group's optimizer, and
    its moments live in that group's state). Each parameter (member) must match exactly one pattern, or none when
    ``default`` is given; otherwise an error names it. Map a group to
    ``ft.optim.freeze()`` to freeze it. Built on ``optax.partition``; the state's
    ``inner_states`` are keyed by pattern, and :func:`ft.optim.hyperparameters` names a
    hyperparameter found in several groups ``"pattern/name"``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.groups({"encoder.*": ft.optim.sgd(0.1), "head": ft.optim.sgd(1.0)})
      >>> p = {"encoder": {"w": jnp.ones(1)}, "head": jnp.ones(1)}
      >>> state = tx.init(p)
      >>> tx.update(p, state, p)[0]
      {'encoder': {'w': Array([-0.1], dtype=float32)}, 'head': Array([-1.], dtype=float32)}
      >>> sorted(ft.optim.hyperparameters(state))
      ['encoder.*/learning_rate', 'encoder.*/momentum', 'head/learning_rate', 'head/momentum']
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise ValueError(EMPTY.format(given=transforms))
    patterns = tuple(transforms)
    table: dict[Any, Any] = dict(transforms)
    if default is not None:
        table[DEFAULT_LABEL] = default

    def labels(params: Any) -> Any:
        found, treedef, _ = _labels(params, patterns, default is not None)
        return jax.tree.unflatten(treedef, found)

    def member_masks(params: Any) -> dict[Any, Any]:
        _, treedef, picks = _labels(params, patterns, default is not None)
        leaves = jax.tree.leaves(params, is_leaf=is_none)
        masks = {p: jax.tree.unflatten(treedef, [None if x is None else s for x, s in zip(leaves, sel)])
                 for p, sel in zip(patterns, picks)}
        if default is not None:
            rest = [None if x is None else ~np.any([np.asarray(s[k]) for s in picks], axis=0)
                    for k, x in enumerate(leaves)]
            masks[DEFAULT_LABEL] = jax.tree.unflatten(
                treedef, [r if r is None or np.ndim(r) else bool(r) for r in rest])
        return masks

    by_leaf = optax.partition(table, labels)
    by_member = partition_members(table, member_masks)

    def split(params: Any) -> bool:
        found, _, _ = _labels(params, patterns, default is not None)
        leaves = jax.tree.leaves(params, is_leaf=is_none)
        return any(lab is None and x is not None for lab, x in zip(found, leaves))

    def init(params: Any) -> Any:
        return (by_member if split(params) else by_leaf).init(params)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        return (by_member if split(updates) else by_leaf).update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)
