"""Accidental aliasing: one array object at several leaves of a model.

PyTorch ties weights by putting one layer object at two fields. In a pytree that is two
leaves that happen to hold the same array: the first gradient step writes two different
arrays back (the tie is gone), and a donated step fails because XLA cannot donate one
buffer twice. The supported tie is :class:`ft.nn.Shared` (one leaf, placed at every use);
an accidental alias is found here once, when a model or optimizer state is created for a
donated step, and copied so that each leaf owns its buffer. A hand-written loop
(``opt.init(model)``, ``ft.gradient``, ``ft.move``) is told at its optimizer's ``init`` (or
at the first ``ft.move`` of each model holding a tie): each tie is named once, by the
first of these calls that finds it (:func:`warn_aliases`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from functree._tree import bounded_put, dotted_name
from functree._warnings import user_stacklevel

__all__ = [
    "DonationGuard", "AliasWarning", "find_aliases", "alias_names", "warn_aliases", "copy_aliases", "check_stale",
    "is_donated_twice", "deleted_leaf", "is_deleted"]

ALIASED = """\
{what} holds one array object at several leaves: {pairs}. A gradient step gives each \
leaf its own new array, so the two are trained as independent copies from here on{copied}.
To tie them (one parameter used at both places, trained once with the summed gradient):

    wrong:  layer = ft.nn.Dense(4, 4, key=key); model = Model(a=layer, b=layer)
    right:  model = ft.nn.Shared(Model(a=layer, b=layer), {{"{second}": "{first}"}})

To keep them independent, build them apart (or copy one with jnp.copy) to silence this."""

# ALIASED's note where the call copies the repeated leaves (a donated step, ft.jit's donation).
COPIED = " (they have been copied now, so that donation can reuse each buffer)"

# The repeated arrays an AliasWarning named (id -> weak reference): a tie is named once, by
# the first call that finds it (an optimizer's init), not again by the step given that model.
_NAMED: dict[int, Any] = {}


DONATED = """\
{what} {name!r} holds a deleted array at {path}: {when} donated it (XLA reused its \
buffers for that call's outputs). Use the values the step returns:

    wrong:  new_model, new_state, out = step(model, state, batch)
            step(model, state, batch)                   # model and state were donated above
    right:  model, state, out = step(model, state, batch)
       or:  kept = jax.tree.map(jnp.copy, model)        # before the first step: a copy stays valid
       or:  {no_donation}"""


STALE = """\
{what} holds a deleted array at {path}: {when} donated it (XLA reused its buffers for \
that call's outputs). Every tree that shares those arrays is invalid since: a model kept \
as `best = model`, `ft.nn.inference(model)` (it shares the arrays, it copies none), the \
model given to the step. Use what the step returns, or keep a copy taken before it:

    wrong:  best = model                                   # the same arrays: donated below
            model, state, out = step(model, state, batch)
            evaluate(best)
    right:  best = jax.tree.map(jnp.copy, model)           # a copy stays valid
       or:  ft.train.train_step(loss_fn, optimizer, donate=False)    # inputs stay valid (more memory)"""

# The latest DonationGuard that ran a call: named in an error about a deleted array.
LAST_DONOR: list[Any] = [None]


class AliasWarning(UserWarning):
    """A model holds one array object at two leaves (PyTorch-style tying).

    Such a tie does not survive a training step; the message names both key paths and
    shows :class:`ft.nn.Shared`, the tie that does. It is raised once per tie, by the first
    call that finds it: an optimizer's ``init`` (a hand-written loop), the first ``ft.move``
    of each model holding it, a train step, the Trainer, a donating ``ft.jit``.
    Only a repeat that training moves is named: a buffer at several leaves (a ``no_derivative``
    table, an integer or bool mask) or a layer the optimizer's ``wrt=`` leaves frozen (or
    its ``ft.optim.groups``' ``ft.optim.freeze()`` or ``optax.set_to_zero()`` groups, an ``optax.partition``'s
    ``set_to_zero()`` labels: ``moved_view``) is trained by
    nothing, and a donated call copies it silently.

    Example:
      >>> import functree as ft, jax.numpy as jnp, warnings
      >>> w = jnp.ones(2)
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = ft.train.Trainer({"a": w, "b": w}, ft.optim.sgd(0.1), lambda m, b: 0.0)
      >>> caught[0].category.__name__, "'a' and 'b'" in str(caught[0].message)
      ('AliasWarning', True)
    """


def find_aliases(tree: Any) -> list[tuple[int, int]]:
    """``(first, repeat)`` leaf indices (flatten order) of every array seen twice.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.ones(2)
      >>> find_aliases({"a": w, "b": jnp.zeros(2), "c": w})
      [(0, 2)]
    """
    first: dict[int, int] = {}
    pairs = []
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        if isinstance(leaf, jax.Array):
            j = first.setdefault(id(leaf), i)
            if j != i:
                pairs.append((j, i))
    return pairs


def alias_names(tree: Any, pairs: Sequence[tuple[int, int]]) -> list[tuple[str, str]]:
    """The dotted key paths (``layers.0.weight``) of the leaves in ``pairs``."""
    paths = [dotted_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [(paths[a], paths[b]) for a, b in pairs]


def warn_aliases(tree: Any, *, what: str = "The model", rename: Callable[[str], str] | None = None,
                 copied: bool = True, trained: Callable[[], Any] | None = None) -> list[tuple[int, int]]:
    """Warn (:class:`AliasWarning`) naming both key paths of every aliased leaf of ``tree``;
    returns :func:`find_aliases`' pairs (empty, and no warning, when there are none).
    ``rename`` turns a dotted key path into the name shown (an argument's name); ``copied``
    says the caller copies the repeated leaves (:func:`copy_aliases`). ``trained`` gives
    ``tree``'s leaves that training moves, ``None`` elsewhere (an optimizer's ``moved_view``:
    ``wrt=`` and its freeze() groups; without it ``tree`` is taken for such a view),
    called only where there are repeats: a repeat that nothing moves stays one value.

    Call it where a model enters a donated step or an optimizer's ``init``, not per step
    (:class:`DonationGuard`). An array named by an earlier warning is not named again (the
    hand loop's ``opt.init(model)`` warns, its train step given that model does not).
    """
    pairs = find_aliases(tree)
    moved = _moved_pairs(tree, pairs, trained)  # a repeated buffer or frozen layer is never trained apart
    if moved and _first_named(tree, moved):
        names = alias_names(tree, moved)
        if rename is not None:
            names = [(rename(a), rename(b)) for a, b in names]
        listed = ", ".join(f"{a!r} and {b!r}" for a, b in names)
        warnings.warn(
            ALIASED.format(what=what, pairs=listed, first=names[0][0], second=names[0][1],
                           copied=COPIED if copied else ""),
            AliasWarning,
            stacklevel=user_stacklevel(),
        )
    return pairs


def _moved_pairs(tree: Any, pairs: Sequence[tuple[int, int]],
                 trained: Callable[[], Any] | None) -> list[tuple[int, int]]:
    """The ``pairs`` of which a leaf is trained (``trained``'s; ``tree`` itself is a
    parameter view without it: None at what nothing trains): a
    gradient step unties only those (a mask or a ``no_derivative`` table shared by every
    block, a frozen layer at two fields, stays one array; a donated step copies it apart
    silently)."""
    if not pairs:
        return []
    view = tree if trained is None else trained()
    kept = jax.tree.structure(tree).flatten_up_to(view)
    return [(a, b) for a, b in pairs if kept[a] is not None or kept[b] is not None]


def _first_named(tree: Any, pairs: Sequence[tuple[int, int]]) -> bool:
    """Whether an array of ``pairs`` was not named by an earlier :class:`AliasWarning` (all
    are remembered now)."""
    leaves = jax.tree.leaves(tree)
    new = False
    for _, repeat in pairs:
        x = leaves[repeat]
        ref = _NAMED.get(id(x))
        if ref is not None and ref() is x:
            continue
        new = True
        with contextlib.suppress(TypeError):  # no weak reference: named every time
            bounded_put(_NAMED, id(x), weakref.ref(x))
    return new


class DonationGuard:
    """When a donated call must look for aliased leaves: only for inputs that are not its
    previous call's outputs (outputs never share a buffer, and a training loop passes them
    back), so a steady loop pays a few identity checks and nothing else.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree._alias import DonationGuard
      >>> guard, w = DonationGuard(), jnp.ones(2)
      >>> guard.fresh(w)
      True
      >>> guard.remember((w,)); guard.fresh(w)
      False
    """

    __slots__ = ("_given", "_last", "calls", "name")

    def __init__(self, name: str = "a donating call") -> None:
        self._last: tuple[Any, ...] = ()
        self._given: Any = ()
        self.calls = 0
        self.name = name  # how an error names the calls this guard watches

    def fresh(self, *inputs: Any) -> bool:
        """Whether any of ``inputs`` is not one of the previous call's outputs."""
        return self.fresh_in(inputs, range(len(inputs)))

    def fresh_in(self, args: Sequence[Any], indices: Sequence[int]) -> bool:
        """:meth:`fresh` of ``args[i]`` for each ``i`` in ``indices`` (plain loops: the
        generator-based form costs a few µs per call)."""
        last = self._last
        for i in indices:
            x = args[i]
            for o in last:
                if x is o:
                    break
            else:
                return True
        return False

    def forget(self) -> bool:
        """Drop the previous call's outputs, so that the next call checks every input as a
        new one (:meth:`fresh`); whether there were any. For a call XLA refused because one
        of those outputs was passed at two places (:func:`is_donated_twice`)."""
        had = bool(self._last)
        self._last = ()
        return had

    def remember(self, outputs: Any, given: Any = ()) -> None:
        """Hold the call's outputs (held, so their ids stay unique until the next call) and
        its donated inputs ``given`` (to name the call that donated one, if reused)."""
        self._last = tuple(outputs) if isinstance(outputs, tuple) else (outputs,)
        self._given = given
        self.calls += 1
        LAST_DONOR[0] = self

    def check_donated(self, named: Sequence[tuple[str, Any]], *, what: str, step: str, no_donation: str) -> None:
        """Raise a ``ValueError`` naming the argument and key path of a deleted (donated)
        array among the ``(name, tree)`` inputs, the call of ``step`` that donated it (when
        it was this guard's previous one) and the fixes; XLA would only say "Buffer has
        been deleted or donated". Call it for fresh inputs only (:meth:`fresh`)."""
        given = self._given if isinstance(self._given, tuple) else (self._given,)
        for name, tree in named:
            path = deleted_leaf(tree)
            if path is None:
                continue
            if any(tree is g for g in given):
                when = f"the previous call of {step} (call {self.calls})"
            else:
                when = f"an earlier call of {step} (or another donating function)"
            raise ValueError(DONATED.format(what=what, name=name, path=path, when=when, no_donation=no_donation))


class _StaleArrayError(ValueError):
    """:func:`stale_error`'s error (a ``ValueError``), told apart by :func:`is_stale_error`."""


def stale_error(named: Sequence[tuple[str, Any]], what: str = "This call's input") -> ValueError | None:
    """The error for the first ``(name, tree)`` holding a deleted (donated) array: its key
    path, the donating call (the latest one, when that call took this array) and the
    fixes; None when no array is deleted. For the error paths of functree's entry points
    (a Module call, ``ft.jit``, an evaluation step), where JAX would only say "Array has
    been deleted"."""
    for name, tree in named:
        path = deleted_leaf(tree)
        if path is None:
            continue
        donor = LAST_DONOR[0]
        when = "a donating call (a train step, the Trainer, ft.jit(..., donate=...))"
        if donor is not None:
            given = {id(x) for x in jax.tree.leaves(donor._given)}
            if any(id(x) in given for x in jax.tree.leaves(tree) if is_deleted(x)):
                when = f"call {donor.calls} of {donor.name}"
            else:
                when = f"an earlier call of {donor.name} (or another donating function)"
        where = f"{name}.{path}" if path != "<root>" else name
        return _StaleArrayError(STALE.format(what=what, path=where, when=when))
    return None


def check_stale(named: Sequence[tuple[str, Any]], call: str) -> None:
    """Raise :func:`stale_error`'s error, naming the user's ``call``, when a ``(name, tree)``
    holds a deleted (donated) array. For host-side readers called between steps
    (``set_hyperparameters``, ``averaged``, ``save``): one ``is_deleted()`` walk over the
    leaves, never inside a jitted step; without it JAX says only "Array has been deleted"."""
    error = stale_error(named, what=f"The input of {call}")
    if error is not None:
        raise error


def is_stale_error(error: BaseException) -> bool:
    """Whether ``error`` is :func:`stale_error`'s (an inner layer's call raised it, naming the
    path from that layer: the caller's call names it again from its own model)."""
    return isinstance(error, _StaleArrayError)


# XLA's refusals of a call that donates a buffer it also takes elsewhere (raised before the
# program runs: nothing is deleted).
_DONATED_TWICE = ("donate the same buffer twice", "previously donated in the same call")


def is_donated_twice(error: BaseException) -> bool:
    """Whether ``error`` is XLA's refusal of one buffer passed donated and again (donated or
    not) in one call: a previous call's output given at two places, which the guard's
    shortcut for a loop's own outputs does not look at."""
    message = str(error)
    return any(part in message for part in _DONATED_TWICE)


def is_deletion_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's complaint about a deleted (donated) array."""
    message = str(error)  # (functree's own errors about it name the key path already)
    return isinstance(error, (RuntimeError, ValueError)) and "deleted" in message and "holds a deleted" not in message


def is_deleted(x: Any) -> bool:
    concrete = _CONCRETE.get(type(x))
    if concrete is None:  # once per type: isinstance(x, jax.Array) costs 0.3 us a leaf
        concrete = _CONCRETE[type(x)] = issubclass(type(x), jax.Array) and not issubclass(type(x), Tracer)
    return concrete and x.is_deleted()


# Whether a type is a concrete jax.Array (a tracer is not: it has no buffer to delete).
_CONCRETE: dict[type, bool] = {}


def deleted_leaf(tree: Any) -> str | None:
    """The dotted key path of the first deleted array in ``tree`` (``<root>`` for the tree
    itself), or None: one pass over the leaves, paths only when one is found."""
    if not any(is_deleted(x) for x in jax.tree.leaves(tree)):
        return None
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_deleted(x):
            return dotted_name(path) or "<root>"
    return None


def copy_aliases(tree: Any, pairs: Sequence[tuple[int, int]] | None = None) -> Any:
    """``tree`` with the repeated leaf of each pair copied (each leaf owns its buffer).

    ``pairs`` defaults to :func:`find_aliases` of ``tree``; with none the tree is returned
    as it is (no copy).

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.ones(2)
      >>> out = copy_aliases({"a": w, "b": w})
      >>> out["a"] is w, out["b"] is w
      (True, False)
    """
    if pairs is None:
        pairs = find_aliases(tree)
    if not pairs:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    for _, repeat in pairs:
        leaves[repeat] = jnp.copy(leaves[repeat])
    return jax.tree.unflatten(treedef, leaves)
