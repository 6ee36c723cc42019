"""Parameter groups by name: a different optimizer for each glob over dotted names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._naming import (
    TIE_SPLIT,
    broadcast,
    leaf_infos,
    matches,
    member_names,
    required_selection,
    selection,
    split_tie,
    tie_fix,
)
from functree._tree import bounded_put, cached, is_none
from functree.optim._checks import group_kinds
from functree.optim._masked import declare_frozen, frozen_leaves, partition_members

__all__ = ["groups", "merge_members", "GroupStateChanged", "GROUP_STATE_CHANGED", "GROUPS_CHANGED"]

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


GROUP_STATE_CHANGED = """\
ft.optim.groups: the state of group {group!r} was made by another optimizer than this group's: \
the state holds {given}, the group's optimizer makes {expected}. A group's state continues the \
optimizer that made it; after changing a group's optimizer (freeze() -> adam, sgd -> adam, a \
number -> a schedule), make a new state and carry the other groups' states over by key path\
{carry}:

    wrong:  {call}(grads, {model}, old_state)       # old_state: {group!r} had another optimizer
    right:  state = {init}
{recipe}"""


GROUPS_CHANGED = """\
ft.optim.groups: the state was made with other group patterns: it holds the groups {given}, \
this optimizer's are {expected}. A group's state holds the moments of the parameters its pattern \
selects; with other patterns parameters move between groups (the default's included), so make \
a new state{carry}:

    wrong:  {call}(grads, {model}, old_state)       # old_state: groups {given}
    right:  state = {init}
{recipe}"""


class GroupStateChanged(ValueError):
    """:data:`GROUP_STATE_CHANGED` (or :data:`GROUPS_CHANGED`, given ``patterns``), for the PartitionState at ``path`` (a dotted name, ``""``
    at the root); :meth:`at` words it for the state that holds it (an OptimizerState's
    ``inner``), with its learning context carried."""

    def __init__(self, group: str, given: str, expected: str, kept: list[str], labels: frozenset[str],
                 patterns: tuple[list[str], list[str]] | None = None):
        self.group, self.given, self.expected, self.kept, self.labels = group, given, expected, kept, labels
        self.patterns = patterns  # (the state's groups, this optimizer's) where they differ: GROUPS_CHANGED
        super().__init__(self.message())

    def message(self, path: str = "", optimizer: bool = False) -> str:
        """The message with the recipe's key paths under ``path``; ``optimizer``: the state
        is an ``ft.optim.Optimizer``'s (made by ``opt.init``, its learning context carried)."""
        prefix = f"{path}.inner_states." if path else "inner_states."
        lines = [f'            state = ft.set(state, "{prefix}{k}", ft.get(old_state, "{prefix}{k}"))'
                 for k in self.kept]
        if optimizer:  # a new state starts at step 0: schedules would restart
            lines.append("            state = state.replace(context=old_state.context)   # the step count, samples")
        if self.patterns is not None:
            given, expected = (", ".join(map(repr, names)) for names in self.patterns)
            carry = (" and carry over the states of the groups whose parameters stay the same, by key path"
                     if self.kept else " (here no group keeps its parameters: every moment starts from zero)")
            return GROUPS_CHANGED.format(
                given=given, expected=expected, carry=carry, call="opt.apply_gradients" if optimizer else "tx.update",
                model="model" if optimizer else "state", init="opt.init(model)" if optimizer else "tx.init(params)",
                recipe="\n".join(lines))
        carry = "" if self.kept else " (here no other group's state fits: a new state)"
        return GROUP_STATE_CHANGED.format(
            group=self.group, given=self.given, expected=self.expected, carry=carry,
            call="opt.apply_gradients" if optimizer else "tx.update", model="model" if optimizer else "state",
            init="opt.init(model)" if optimizer else "tx.init(params)", recipe="\n".join(lines))


def _describe_kind(kind: tuple[Any, ...]) -> str:
    if len(kind) == 1:
        return f"a {kind[0]}"
    parts = [f"hyperparameters {_listed(names)}, scheduled {_listed(scheduled)}" for _, names, scheduled in kind[1:]]
    return f"a {kind[0]} ({'; '.join(parts)})"


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


def check_group_states(init: Any, state: Any, params: Any, memo: dict[Any, Any]) -> None:
    """:data:`GROUP_STATE_CHANGED` for the first group whose state was not made by its
    optimizer; :data:`GROUPS_CHANGED` for a state of other group patterns (a group missing
    or one more: moments of parameters that changed group). The expected kinds come from ``jax.eval_shape(init, params)``, once per
    tree definition and shapes of ``params`` (kept in ``memo``, the transform's own;
    nothing runs on a device)."""
    inner_states = getattr(state, "inner_states", None)
    if not isinstance(inner_states, dict):
        return
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
    key, expected = cached(memo, (treedef, tuple(np.shape(x) for x in leaves if x is not None)))
    if expected is None:
        fresh = jax.eval_shape(init, params)
        expected = {k: (group_kinds(v), _held(v)) for k, v in fresh.inner_states.items()}
        if key is not None:
            bounded_put(memo, key, expected)
    given = {k: group_kinds(inner_states[k]) if k in inner_states else ("missing state",) for k in expected}
    if set(inner_states) != set(expected):  # other patterns: a group of each may hold other parameters
        raise GroupStateChanged("", "", "", _fitting(expected, given, inner_states), frozenset(inner_states),
                                (list(inner_states), list(expected)))
    for label, (kind, _) in expected.items():
        if given[label] != kind:
            kept = [k for k in _fitting(expected, given, inner_states) if k != label]
            raise GroupStateChanged(label, _describe_kind(given[label]), _describe_kind(kind), kept,
                                    frozenset(expected))


def _fitting(expected: dict[str, Any], given: dict[str, Any], inner_states: dict[str, Any]) -> list[str]:
    """The groups whose state the new one can take over: made by the group's optimizer, for
    the same parameters (:func:`_held`)."""
    return [k for k in expected if given[k] == expected[k][0] and _held(inner_states[k]) == expected[k][1]]


def _held(state: Any) -> tuple[str, ...]:
    """Where a group's state holds no parameter: the key paths of its ``optax.MaskedNode`` s
    (another group's parameters)."""
    def masked(x: Any) -> bool:
        return isinstance(x, optax.MaskedNode)

    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=masked)[0]
    return tuple(jax.tree_util.keystr(path) for path, x in flat if masked(x))


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
            raise ValueError(AMBIGUOUS.format(name=_where(info, count, at), first=both[0], second=both[1])
                             + _tie_names_hint(params, info, both[:2]))
        if np.any(count == 0) and not has_default:
            at = _where(info, count, int(np.argmax(np.ravel(count == 0))))
            raise ValueError(UNMATCHED.format(name=at, patterns=", ".join(map(repr, patterns))))
        whole = [p for p, h in hits if h.ndim == 0]
        labels.append(whole[0] if whole else DEFAULT_LABEL if not hits else None)
    _refuse_split_ties(params, patterns, [x is not None for x in leaves], has_default)
    return labels, treedef, picks


def _tie_names_hint(params: Any, info: Any, patterns: list[str]) -> str:
    """For a tied parameter (``ft.nn.Shared``) in two groups: the name each pattern selects
    it by (``'embed.*'`` by ``embed.embeddings``, ``'head.*'`` by ``head.weight``), one
    tensor under both, and the second glob kept off it; "" for other leaves."""
    if len(info.aliases) < 2 or info.sizes:
        return ""
    by = [next((n for n in (info.name, *info.aliases) if matches(n, p)), info.name) for p in patterns]
    kept = tie_fix(params, patterns[1])
    entries = ", ".join(f"{k!r}: ..." for k in (patterns[0], *kept[:3]))
    return (f"It is one tied tensor (ft.nn.Shared): {patterns[0]!r} selects it by its name {by[0]!r}, "
            f"{patterns[1]!r} by {by[1]!r}. One group holds it; keep the other's glob off it:\n"
            f"    right:  ft.optim.groups({{{entries}}}, ...)\n")


def _refuse_split_ties(params: Any, patterns: tuple[str, ...], only: list[bool], has_default: bool) -> None:
    """:data:`TIE_SPLIT` for a group pattern selecting a tied parameter by one of its names
    and not by another (``"head.*"``: ``head.weight``, not ``embed.embeddings``): torch's
    name filters put it where its first module's name goes, ``module.parameters()`` where
    the head's go; say which with an exact name."""
    for pattern in patterns:
        found = split_tie(params, (pattern,), only)
        if found is None:
            continue
        _, stored, hit, miss = found
        kept = tie_fix(params, pattern, only)
        rest = ", default=...)" if has_default else ", ...)"
        entries = "".join(f"{k!r}: tx, " for k in kept[:3]) + ("..., " if len(kept) > 3 else "")
        raise ValueError(TIE_SPLIT.format(
            what="ft.optim.groups", pattern=pattern, stored=stored, hit=hit, miss=miss,
            wrong=f"ft.optim.groups({{{pattern!r}: tx}}{rest}",
            right=f"ft.optim.groups({{{entries}{miss!r}: tx}}{rest}   # the tie in this group, by its own name",
            other=(f"ft.optim.groups({{{entries[:-2]}}}{rest}   # the tie in another group" if kept
                   else f"ft.optim.groups({{...}}{rest}   # no group of its own: the tie with the others")))


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
            # a leaf's picks are whole-leaf bools or member selections: broadcast, then any
            rest = [None if x is None else ~np.any(np.broadcast_arrays(*[np.asarray(s[k]) for s in picks]), axis=0)
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

    memo: dict[bool, dict[Any, Any]] = {False: {}, True: {}}  # expected group states per parameter signature

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        chosen = by_member if split(updates) else by_leaf
        check_group_states(chosen.init, state, updates if params is None else params, memo[chosen is by_member])
        return chosen.update(updates, state, params, **extra)

    def frozen(params: Any) -> list[bool]:
        """A leaf is frozen where its group's optimizer freezes it (a leaf whose members
        several groups hold is taken as moved)."""
        found, _, _ = _labels(params, patterns, default is not None)
        by_group = {k: frozen_leaves(tx, params) for k, tx in table.items()}
        return [label is not None and by_group[label][i] for i, label in enumerate(found)]

    return declare_frozen(optax.GradientTransformationExtraArgs(init, update), frozen)


def merge_members(leaves: list[list[Any]], labels: list[Any], treedef: Any, placeholder: Any) -> list[Any] | None:
    """One moment leaf per position from the groups' moment trees (``leaves[k]``: group
    ``labels[k]``'s flattened tree, ``placeholder(x)`` true at a position it does not hold),
    where groups split a Stack's members: at such a leaf every group holds the whole array,
    its own members' moments and the initial values elsewhere, so each member is taken from
    the group whose pattern selects it (the default group: the members no pattern selects).
    ``None`` when a position is held by several trees not told apart so (not groups)."""
    if any(not isinstance(label, str) for label in labels):
        return None
    template = treedef.unflatten([None if placeholder(x) else x for x in leaves[0]])
    patterns = [label for label in labels if label != DEFAULT_LABEL]
    picks = {p: selection(template, (p,), what="ft.optim.moments", strict=False) for p in patterns}
    out = []
    for i, values in enumerate(zip(*leaves)):
        held = [(label, v) for label, v in zip(labels, values) if not placeholder(v)]
        if len(held) < 2:
            out.append(held[0][1] if held else None)
            continue
        chosen = [np.asarray(picks[p][i]) for p in patterns]
        merged = jnp.zeros_like(held[0][1])
        for label, v in held:
            own = (~np.any(np.broadcast_arrays(*chosen), axis=0) if chosen else np.ones((), bool)) \
                if label == DEFAULT_LABEL else np.asarray(picks[label][i])
            if own.ndim == 0 or np.shape(v) != np.shape(merged):
                return None  # a whole leaf in two groups: not a member split
            merged = jnp.where(broadcast(own, v), v, merged)
        out.append(merged)
    return out
