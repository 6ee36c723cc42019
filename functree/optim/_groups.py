"""Parameter groups by name: a different optimizer for each glob over dotted names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

from functree._parameters import _leaf_names, _matches
from functree._tree import is_none

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


def _label_tree(params: Any, patterns: tuple[str, ...], has_default: bool) -> Any:
    names = _leaf_names(params)
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
    labels = []
    for name, leaf in zip(names, leaves):
        if leaf is None:
            labels.append(None)
            continue
        hits = [p for p in patterns if _matches(name, (p,))]
        if len(hits) > 1:
            raise ValueError(AMBIGUOUS.format(name=name, first=hits[0], second=hits[1]))
        if not hits and not has_default:
            raise ValueError(UNMATCHED.format(name=name, patterns=", ".join(map(repr, patterns))))
        labels.append(hits[0] if hits else DEFAULT_LABEL)
    return jax.tree.unflatten(treedef, labels)


def groups(
    transforms: Mapping[str, optax.GradientTransformation],
    default: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
    """One optimizer per parameter group, chosen by globs over ``ft.to_flat_dict`` names.

    Patterns work as in :func:`ft.select` (``"encoder.*"``, ``"*.bias"``,
    ``"layers.[01].*"``). Each parameter must match exactly one pattern, or none when
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
        return _label_tree(params, patterns, default is not None)

    return optax.partition(table, labels)
