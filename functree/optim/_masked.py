"""Masks that may select part of a stacked leaf: ``ft.optim.masked`` and member-split groups.

``optax.masked`` takes one bool per leaf. :func:`ft.select` gives, for a leaf of an
``ft.nn.Stack`` partly selected (``"h.2.*"``), a boolean array over the members. Here
such a leaf goes to the inner transform whole, with zero gradients at the members not
selected; afterwards those members get the incoming update back (``optax.masked``'s
pass-through) and their per-parameter state (moments) is restored bit for bit:

    u_i = inner(g ⊙ m)_i  where m_i,   u_i = g_i  elsewhere;   s_i unchanged where not m_i.

Elementwise transforms (sgd, adam, ...) then give the selected members exactly the
numbers of a hand-masked update.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._module import Module
from functree._naming import broadcast
from functree._parameters import mask as select
from functree._tree import dotted_name, is_none
from functree.optim._average import averages_in, is_slot
from functree.optim._lookahead import SlowState

__all__ = ["masked", "partition_members", "restore_members", "is_partial", "MEMBER_MASK_IN_OPTAX",
           "AVERAGE_ON_MEMBERS", "named_member_masks", "declare_frozen", "frozen_leaves"]

MEMBER_MASK_IN_OPTAX = """\
An optax transformation tested a mask entry that is an array with more than one element \
(numpy: {error}). optax.masked (and adamw(mask=...), which is one) takes one bool per \
leaf; ft.select / ft.mask give a boolean array over an ft.nn.Stack's members for a leaf \
that member patterns select in part ("h.[0-1].*"). ft.optim.masked takes such a mask:

    wrong:  optax.adamw(1e-3, weight_decay=0.1, mask=ft.select(model, "h.[0-1].*"))
    right:  optax.chain(optax.scale_by_adam(),
                        ft.optim.masked(optax.add_decayed_weights(0.1), ft.select(model, "h.[0-1].*")),
                        optax.scale(-1e-3))
       or:  optax.masked(tx, ft.select(model, "h.*"))       # whole stacked leaves: one bool each
"""

AVERAGE_ON_MEMBERS = """\
{kind} is given part of the ft.nn.Stack leaf {leaf!r}: members {members} of its {n}, by a member \
pattern of ft.optim.groups (or an ft.optim.masked member mask). Its state holds the average of \
those members only and zeros at the others, so ft.optim.averaged (the Trainer's averaged_model \
and val_averaged_loss) would give a model whose other members are 0, with no error. Give the \
average whole stacked leaves, or average every parameter with the Optimizer:

    wrong:  ft.optim.groups({{"h.[0-1].*": ft.optim.asgd(0.01)}}, default=ft.optim.adam(1e-3))
    right:  ft.optim.groups({{"h.*": ft.optim.asgd(0.01)}}, default=ft.optim.adam(1e-3))     # whole stacked leaves
       or:  ft.optim.Optimizer(ft.optim.groups({{"h.[0-1].*": ft.optim.sgd(0.01)}}, default=ft.optim.adam(1e-3)),
                               average=ft.optim.uniform_average())                         # every parameter averaged
"""

_AMBIGUOUS = "truth value of an array with more than one element is ambiguous"


@contextlib.contextmanager
def named_member_masks() -> Iterator[None]:
    """Raise :data:`MEMBER_MASK_IN_OPTAX` for numpy's and JAX's "truth value ... ambiguous"
    inside (``optax.masked``'s ``p if m else MaskedNode()`` on a member array: a crash in
    optax that names neither the mask nor ``ft.optim.masked``)."""
    try:
        yield
    except ValueError as e:
        if _AMBIGUOUS not in str(e):
            raise
        raise ValueError(MEMBER_MASK_IN_OPTAX.format(error=str(e).splitlines()[0])) from e


# The transforms that say which parameters they never move (update function -> a function of
# the parameters giving, per leaf of jax.tree.leaves(params, is_leaf=is_none), whether every
# update is zero): ft.optim.freeze, and ft.optim.groups and masked around one. Declared,
# never guessed (as _leafwise.separable): any other transform or chain moves every leaf.
_FREEZES: weakref.WeakKeyDictionary[Any, Callable[[Any], list[bool]]] = weakref.WeakKeyDictionary()

# optax.set_to_zero()'s update, known by its code: a new closure per call, so never declared,
# but the same function as the one freeze() declares (a group given it bare freezes as freeze()).
_SET_TO_ZERO = getattr(optax.set_to_zero().update, "__code__", None)


# optax.partition's (and multi_transform's) update, known by its code: its groups are read as
# ft.optim.groups' are (a label given optax.set_to_zero() freezes its parameters).
_PARTITION = getattr(optax.partition({}, {}).update, "__code__", None)
# optax.with_extra_args_support's wrapper of a plain transform: read as the transform it wraps.
_EXTRA_ARGS = getattr(optax.with_extra_args_support(optax.GradientTransformation(*optax.identity())).update,
                      "__code__", None)


def _closed_over(update: Any) -> dict[str, Any]:
    """The variables an optax ``update`` closes over (empty where none can be read)."""
    try:
        return dict(inspect.getclosurevars(update).nonlocals)
    except (TypeError, ValueError):
        return {}


def _partition_frozen(update: Any, params: Any) -> list[bool]:
    """:func:`frozen_leaves` of an ``optax.partition``: a leaf is frozen where its label's
    transform freezes it (its labels read as optax reads them, from ``params``); every
    leaf taken as moved where the labels cannot be read here (optax's init then says why)."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
    out = [False] * len(leaves)
    try:
        env = _closed_over(update)
        given = env["param_labels"]
        labels = given(params) if callable(given) else given
        by_group = {k: frozen_leaves(tx, params) for k, tx in env["transforms"].items()}

        def mark(label: Any, index: Any) -> None:
            for i in jax.tree.leaves(index):
                out[i] = label in by_group and by_group[label][i]
        jax.tree.map(mark, labels, treedef.unflatten(range(len(leaves))), is_leaf=is_none)
    except (KeyError, TypeError, ValueError):
        return [False] * len(leaves)
    return out


def declare_frozen(transform: Any, frozen: Callable[[Any], list[bool]]) -> Any:
    """``transform``, declared to leave the leaves ``frozen(params)`` marks unchanged (zero
    updates, read by key path from the parameters); returns ``transform``."""
    _FREEZES[transform.update] = frozen
    return transform


def frozen_leaves(transform: Any, params: Any) -> list[bool]:
    """Per leaf of ``params`` (``None`` counted), whether ``transform`` declares its updates
    always zero (:func:`declare_frozen`; a bare ``optax.set_to_zero()``, which is what
    ``freeze()`` declares, too); all False for a transform that declares nothing.
    For :class:`~functree.AliasWarning`: a tie that nothing moves stays one value."""
    update = getattr(transform, "update", None)
    try:
        frozen = _FREEZES.get(update)
    except TypeError:  # not weakly referenceable: never declared
        frozen = None
    if frozen is None and _SET_TO_ZERO is not None and getattr(update, "__code__", None) is _SET_TO_ZERO:
        return [True] * len(jax.tree.leaves(params, is_leaf=is_none))
    code = getattr(update, "__code__", None)
    if frozen is None and code is _PARTITION:
        return _partition_frozen(update, params)
    if frozen is None and code is _EXTRA_ARGS:  # (optax.partition wraps each group's transform so)
        return frozen_leaves(_closed_over(update).get("tx"), params)
    if frozen is None:
        return [False] * len(jax.tree.leaves(params, is_leaf=is_none))
    return frozen(params)


def is_whole(m: Any) -> bool:
    """Whether a mask entry selects its whole leaf (True, or a member array of all True)."""
    return m is not None and not isinstance(m, optax.MaskedNode) and bool(np.all(m))


def is_partial(m: Any) -> bool:
    """Whether a mask leaf selects part of a stacked leaf (a member array)."""
    return isinstance(m, np.ndarray) and m.ndim > 0


def _leaves(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=is_slot)


def _is_mark(x: Any) -> bool:
    return x is None or is_partial(x) or isinstance(x, (bool, np.bool_, optax.MaskedNode))


def _mask_leaves(mask: Any, params: Any) -> list[Any]:
    """One mask entry per leaf of ``params`` as :func:`_leaves` counts them (a prefix mask's
    entries repeated). A ``MaskedNode`` (a parameter of another group, inside
    ``ft.optim.groups`` or ``optax.multi_transform``) has no leaves but takes a slot: its
    entry is the mask's ``MaskedNode``, which marks nothing (left out of ``adamw``'s decay
    mask, it had shifted every later entry: a crash in unflatten)."""
    full = jax.tree.map(lambda m, p: jax.tree.map(lambda _: m, p, is_leaf=is_slot), mask, params, is_leaf=_is_mark)
    return jax.tree.leaves(full, is_leaf=_is_mark)


def _masked_tree(tree: Any, marks: list[Any]) -> Any:
    leaves, treedef = _leaves(tree)
    return treedef.unflatten([
        x if x is None else (jnp.where(broadcast(m, x), x, jnp.zeros_like(x)) if is_partial(m)
                             else (x if m else optax.MaskedNode()))
        for x, m in zip(leaves, marks)
    ])


def restore_members(new_state: Any, old_state: Any, template: Any, marks: list[Any]) -> Any:
    """``new_state`` with each per-parameter subtree (one shaped like ``template``) taking
    ``old_state``'s values at members a partial mark does not select."""
    treedef = jax.tree.structure(template)
    partial = [is_partial(m) for m in marks]
    if not any(partial):
        return new_state
    t_leaves = jax.tree.leaves(template)
    p_marks = [m for m, x in zip(marks, _leaves(template)[0]) if x is not None and not isinstance(x, optax.MaskedNode)]

    def per_parameter(x: Any) -> bool:
        return jax.tree.structure(x) == treedef

    def keep(new: Any, old: Any) -> Any:
        if not per_parameter(new):
            return new
        news, olds = jax.tree.leaves(new), jax.tree.leaves(old)
        out = [
            jnp.where(broadcast(m, n), n, o) if is_partial(m) and np.shape(n) == np.shape(t) else n
            for n, o, m, t in zip(news, olds, p_marks, t_leaves)
        ]
        return treedef.unflatten(out)

    return jax.tree.map(keep, new_state, old_state, is_leaf=per_parameter)


def masked(inner: optax.GradientTransformation, mask: Any) -> optax.GradientTransformationExtraArgs:
    """``optax.masked`` for masks that may select members of stacked leaves (``ft.mask``).

    ``mask`` is a key-path pattern or a sequence of them (``"head.*"``: ``ft.mask`` of the
    parameters), or a tree (or a function of the parameters giving one) of bools and, for
    leaves partly selected, boolean member arrays. Whole leaves behave as in
    ``optax.masked``; a partial leaf is transformed whole with zero gradients at the
    unselected members, which then keep the incoming update and their state.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, optax
      >>> h = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 3, key=jax.random.key(0))
      >>> params = ft.parameters({"h": h})
      >>> tx = ft.optim.masked(optax.set_to_zero(), ft.mask(params, "h.0.*"))
      >>> g = jax.tree.map(jnp.ones_like, params)
      >>> tx.update(g, tx.init(params), params)[0]["h"].layers.bias
      Array([[0., 0.],
             [1., 1.],
             [1., 1.]], dtype=float32)
    """
    given, inner = inner, optax.with_extra_args_support(inner)  # (given: a bare set_to_zero() read as frozen)
    patterns = (mask,) if isinstance(mask, str) else None
    if isinstance(mask, (tuple, list)) and mask and all(isinstance(m, str) for m in mask):
        patterns = tuple(mask)
    if patterns is not None:
        # Key-path patterns, as freeze() and wrt= take them: a string given as the mask tree
        # was one truthy leaf, a prefix selecting every parameter, silently (a tuple of them:
        # a pytree structure error inside JAX).
        mask = lambda tree: select(tree, *patterns)  # noqa: E731

    as_function = callable(mask) and not isinstance(mask, Module)  # a mask tree of a model is callable too

    def marks_of(tree: Any) -> list[Any]:
        return _mask_leaves(cast(Callable[[Any], Any], mask)(tree) if as_function else mask, tree)

    def init(params: Any) -> optax.MaskedState:
        marks = marks_of(params)
        state = inner.init(_masked_tree(params, marks))
        _refuse_member_average(state, params, marks)
        return optax.MaskedState(state)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        marks = marks_of(updates)
        masked_updates = _masked_tree(updates, marks)
        masked_params = None if params is None else _masked_tree(params, marks)
        new_updates, new_inner = inner.update(masked_updates, state.inner_state, masked_params, **extra)
        new_inner = restore_members(new_inner, state.inner_state, masked_updates, marks)
        olds, treedef = _leaves(updates)
        news = _leaves(new_updates)[0]
        out = [
            o if o is None else (jnp.where(broadcast(m, o), n, o) if is_partial(m) else (n if m else o))
            for o, n, m in zip(olds, news, marks)
        ]
        return treedef.unflatten(out), optax.MaskedState(new_inner)

    def frozen(params: Any) -> list[bool]:  # the unselected leaves get the incoming update: moved
        inner_frozen = frozen_leaves(given, params)
        if not any(inner_frozen):
            return inner_frozen
        return [f and is_whole(m) for f, m in zip(inner_frozen, marks_of(params))]

    return declare_frozen(optax.GradientTransformationExtraArgs(init, update), frozen)


def _refuse_member_average(state: Any, params: Any, marks: list[Any]) -> None:
    """:data:`AVERAGE_ON_MEMBERS` where ``state`` keeps an average of the parameters (an
    :class:`AverageState`: ema, uniform_average, ASGD's; a lookahead's :class:`SlowState`)
    and a mark selects part of a stacked leaf: the average would hold zeros at the other
    members (the masked parameters it starts from), which :func:`ft.optim.averaged` returns."""
    found = averages_in(state)
    if not found:
        return
    named = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_slot)[0]
    for (path, _), m in zip(named, marks):
        if is_partial(m):
            kind = ("ft.optim.lookahead (its slow weights)" if isinstance(found[0], SlowState)
                    else "An average of the parameters (ft.optim.ema, uniform_average, asgd)")
            members = ", ".join(str(i) for i in np.flatnonzero(np.ravel(m)))
            raise ValueError(AVERAGE_ON_MEMBERS.format(kind=kind, leaf=dotted_name(path), members=members,
                                                       n=np.size(m)))


def partition_members(transforms: Mapping[Any, optax.GradientTransformation],
                      labels: Callable[[Any], Mapping[Any, Any]]) -> optax.GradientTransformationExtraArgs:
    """``optax.partition`` where a group may hold part of a stacked leaf: ``labels(params)``
    gives each label's mask (:func:`masked` masks); the state is an
    ``optax.PartitionState`` keyed by label, as optax's."""
    def init(params: Any) -> Any:
        masks = labels(params)
        return optax.PartitionState({k: masked(tx, masks[k]).init(params) for k, tx in transforms.items()})

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        masks = labels(updates)
        inner = {}
        for k, tx in transforms.items():
            updates, inner[k] = masked(tx, masks[k]).update(updates, state.inner_states[k], params, **extra)
        return updates, optax.PartitionState(inner)

    return optax.GradientTransformationExtraArgs(init, update)
