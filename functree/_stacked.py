"""Stacked trees: the members of an ``ft.nn.Stack``, as one block or one by one.

A stacked node (``ft.nn.Stack``) holds ``n`` members of one structure as a single block
whose every leaf has a leading axis of size ``n``. Its JAX children are the stacked
leaves (``blocks.layers.up.weight``, shape ``(n, ...)``); key paths may also go through
a member index (``blocks.3.up.weight``, shape ``(...)``), which JAX never sees:

* :func:`is_stacked`: whether a node is a stack (``functree._paths`` addresses one member
  by key path: ``ft.get``/``ft.set``/``ft.key_path``, and imports this module, never the
  reverse);
* :func:`expand` / :func:`restack`: every stack as a tuple of its members and back
  (``ft.to_flat_dict(unstack=True)`` and ``ft.from_flat_dict`` of per-member names);
  :func:`members_like`: the same expansion of a tree shaped like a template (an optimizer's
  moments of it, ``ft.optim.per_member``);
* :func:`stack_depths`: how many leading stack axes each leaf has (sharding rules);
* :func:`outermost`: the dotted names of the outermost stacks (``ft.summary``).

A node is stacked when its class sets ``__ft_stacked__ = True`` and defines
``__len__``, ``_member(i)`` and ``_with_member(i, member, where)`` (``where``: its key path,
for errors); this module imports no layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from functree._naming import refuse_batched_members
from functree._tree import dotted_name, join_names

__all__ = ["is_stacked", "expand", "restack", "members_like", "stack_depths", "outermost", "wants_members"]

def is_stacked(x: Any) -> bool:
    """Whether ``x`` is a stacked node (an ``ft.nn.Stack``)."""
    return getattr(type(x), "__ft_stacked__", False) is True


def _is_stack(x: Any) -> bool:
    return is_stacked(x)


def expand(tree: Any) -> Any:
    """``tree`` with every stack replaced by the tuple of its (expanded) members.

    Example:
      >>> import functree as ft, jax
      >>> from functree._stacked import expand
      >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 3, key=jax.random.key(0))
      >>> sorted(ft.to_flat_dict(expand({"blocks": stack})))[:2]
      ['blocks.0.bias', 'blocks.0.weight']
    """
    def one(path: Any, x: Any) -> Any:
        if not is_stacked(x):
            return x
        refuse_batched_members(x, join_names(dotted_name(path), "0"), dotted_name(path))  # an ensemble
        return tuple(expand(x._member(i)) for i in range(len(x)))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_stack)


def restack(template: Any, expanded: Any) -> Any:
    """Inverse of :func:`expand`: ``expanded`` (stacks as member tuples) shaped like ``template``."""
    def one(t: Any, e: Any) -> Any:
        if not is_stacked(t):
            return e
        block = t._member(0)
        members = [restack(block, m) for m in e]
        leaves = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *members)
        return t._with_layers(leaves)

    return jax.tree.map(one, template, expanded, is_leaf=_is_stack)


def members_like(template: Any, tree: Any) -> Any:
    """``tree``, shaped like ``template`` down to its leaves (each leaf of ``template`` may
    be any subtree of ``tree``: an optimizer's moments, ``optax.MaskedNode``), with every
    stack replaced by the tuple of its members, as :func:`expand` replaces ``template``'s.

    Member ``i`` of a stack in ``tree`` is ``leaf[i]`` of each of its leaves, whatever their
    rank: a moment need not have its parameter's (adafactor's factored rows, one norm per
    tensor), which ``expand``'s ensemble check reads from the parameters' ranks.
    ``restack(template, members_like(template, tree))`` is ``tree``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree._stacked import members_like
      >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 3, key=jax.random.key(0))
      >>> norms = jax.tree.map(lambda a: jnp.linalg.norm(a, axis=tuple(range(1, a.ndim))), stack)
      >>> [m.weight.shape for m in members_like(stack, norms)]   # one norm per member
      [(), (), ()]
    """
    def one(t: Any, x: Any) -> Any:
        if not is_stacked(t):
            return x
        block = t._member(0)
        return tuple(members_like(block, jax.tree.map(lambda a, i=i: a[i], x.layers)) for i in range(len(t)))

    return jax.tree.map(one, template, tree, is_leaf=_is_stack)


def stack_depths(tree: Any) -> list[int]:
    """For each leaf of ``tree`` (JAX's flatten order), its number of leading stack axes."""
    def depths(x: Any, depth: int) -> Any:
        return jax.tree.map(lambda y: depths(y.layers, depth + 1) if is_stacked(y) else depth, x,
                            is_leaf=_is_stack)

    return jax.tree.leaves(depths(tree, 0))


def outermost(tree: Any) -> list[tuple[str, Any]]:
    """``[(dotted name, stack)]`` of the stacks of ``tree`` not inside another stack."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_stack)
    return [(dotted_name(p), x) for p, x in pairs if is_stacked(x)]


def wants_members(template: Any, flat: Mapping[str, Any], names: Any) -> bool:
    """Whether ``flat`` names members of ``template``'s stacks (``blocks.3.up.weight``)
    rather than stacked leaves: ``template`` has a stack and ``flat`` a name not in ``names``."""
    return any(k not in names for k in flat) and bool(outermost(template))
