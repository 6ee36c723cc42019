"""Skipping a step: one mechanism for non-finite gradients, loss-scale overflow and ``on_nan``.

A skipped step returns zero updates and the state it was given, bit for bit; the learning
context does not advance. :func:`guard` is the one place that does this;
:func:`ft.optim.skip_non_finite` (a transformation), ``LossScaleOptimizer`` (on overflow)
and ``ft.train.train_step(on_nan="skip")`` all use it.

:func:`gate` is the one decision "apply this step?" of :meth:`ft.optim.Optimizer.step`:
``on_nan``, ``enabled`` and an optimizer that handles overflow itself fold into one
``apply_if`` scalar, from one finiteness reduction (:func:`first_nonfinite`) that also
names the first parameter whose gradient was not finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._tree import all_finite, is_none

__all__ = ["guard", "select", "all_finite", "SkipState", "skip_non_finite", "applied_in", "Gate", "gate",
           "first_nonfinite", "ON_NAN", "DEFAULT_ON_NAN", "check_on_nan", "apply_or_keep", "keep_nonfinite"]

ON_NAN = ("stop", "skip", "ignore")
DEFAULT_ON_NAN = "stop"
"""What a step does when its loss or a gradient is not finite: ``"stop"`` (not applied;
the training stops with ``ft.train.NonFiniteError``), ``"skip"`` (not applied; training
goes on) or ``"ignore"`` (applied as it is). One default for ``TrainStep`` and ``Trainer``."""

BAD_ON_NAN = """\
on_nan must be "stop", "skip" or "ignore", got {given!r}.

    right:  ft.train.train_step(loss_fn, opt, on_nan="skip")   # keep the last finite model"""


CHANGED_TREE = """\
A gated step (on_nan="stop"/"skip", or a closed gate) needs an update that returns the \
model and optimizer state with the tree structure they came in with; got
    before: {before}
    after:  {after}
An apply_updates or update hook changed it. Return the same structure:

    wrong:  apply_updates=lambda model, updates: {{"new": ft.move(model, along=updates)}}
    right:  apply_updates=lambda model, updates: ft.move(model, along=updates)"""


def check_on_nan(on_nan: Any) -> str:
    """``on_nan`` checked (``None`` is the older spelling of ``"ignore"``)."""
    if on_nan is None:
        return "ignore"
    if on_nan not in ON_NAN:
        raise ValueError(BAD_ON_NAN.format(given=on_nan))
    return on_nan


def _leaf_finite(x: Any) -> jax.Array:
    """``all(isfinite(x))`` as ``isfinite(sum(x - x))``: ``x - x`` is +0 for a finite
    element and NaN for ±inf or NaN, so the sum (of zeros and NaNs: it cannot overflow) is
    NaN exactly when an element is not finite. XLA compiles that float sum into one
    reduction per leaf; ``all(isfinite(x))`` wrote a boolean array the size of the
    gradient and tree-reduced it (four kernels per leaf, 0.59 s against 0.15 s of compile
    for the 12 gradients of benchmarks/_lm.py's tiny Llama, and slower to run)."""
    if jnp.ndim(x) == 0 or not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.all(jnp.isfinite(x))
    return jnp.isfinite(jnp.sum(x - x))


def _finiteness(loss: Any, grads: Any) -> tuple[jax.Array, jax.Array]:
    """``(index, loss_ok)`` from one reduction: per-leaf finiteness stacked, then argmin."""
    leaves = jax.tree.leaves(grads)
    ok = jnp.stack([_leaf_finite(x) for x in (*leaves, loss)])
    first = jnp.argmin(ok)  # the first False; 0 when all are True
    index = jnp.where(ok[first], -1, jnp.where(first == len(leaves), -2, first)).astype(jnp.int32)
    return index, ok[len(leaves)]


def first_nonfinite(loss: Any, grads: Any) -> jax.Array:
    """-1 when ``loss`` and every gradient are finite, else the flatten-order index of the
    first gradient leaf that is not, or -2 when only the loss is not (an int32 scalar).

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.optim._skip import first_nonfinite
      >>> int(first_nonfinite(jnp.float32(1), {"a": jnp.ones(2), "b": jnp.array([jnp.nan])}))
      1
      >>> int(first_nonfinite(jnp.float32(jnp.inf), {"a": jnp.ones(2)}))
      -2
    """
    return _finiteness(loss, grads)[0]


def keep_nonfinite(before: Any, after: Any) -> Any:
    """``after`` (what a gradient hook made of ``before``) with every leaf NaN whose
    ``before`` leaf was not finite: the finiteness checked later (the step's gate,
    ``LossScaleOptimizer``) is the gradients' own, whatever the hook did.

    An elementwise clip turns an overflowed ``inf`` into 1 (``jnp.clip``, torch's
    ``clip_grad_value_``): checked after the hook, the overflow step was applied and the
    loss scale kept; torch's ``GradScaler`` checks in ``unscale_``, before the clip. A leaf
    the hook returned as it was (the same array) is not checked again: without hooks this
    is free. A hook that changed the tree's structure gets every floating leaf NaN when any
    gradient was not finite.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.optim._skip import keep_nonfinite
      >>> g = {"a": jnp.array([jnp.inf, 0.5]), "b": jnp.ones(2)}
      >>> keep_nonfinite(g, {k: jnp.clip(v, -1, 1) for k, v in g.items()})
      {'a': Array([nan, nan], dtype=float32), 'b': Array([1., 1.], dtype=float32)}
    """
    old, old_def = jax.tree.flatten(before)
    new, new_def = jax.tree.flatten(after)
    if old_def != new_def:
        ok = all_finite(before)
        return jax.tree.map(lambda x: _nan_unless(ok, x), after)
    if all(a is b for a, b in zip(old, new)):
        return after
    leaves = [b if a is b or not _floating(b) else _nan_unless(_leaf_finite(a), b) for a, b in zip(old, new)]
    return new_def.unflatten(leaves)


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _nan_unless(ok: jax.Array, x: Any) -> Any:
    """``x`` where ``ok``, else NaN of ``x``'s dtype (leaves that are not floating: as they are)."""
    if not _floating(x):
        return x
    return jnp.where(ok, x, jnp.full((), jnp.nan, x.dtype))


class Gate(NamedTuple):
    """The step's one decision. ``apply``: apply the step (None: always); ``finite``: the
    loss and every gradient finite (None: not asked); ``nonfinite``: the report, -1 unless
    the gate closed on a non-finite value, then :func:`first_nonfinite` (None: not asked)."""

    apply: Any
    finite: Any
    nonfinite: Any


def gate(loss: Any, grads: Any, *, on_nan: str = "ignore", enabled: Any = None, handled: bool = False) -> Gate:
    """Whether to apply a step, from one finiteness reduction.

    ``on_nan`` "stop"/"skip" close the gate on a non-finite loss or gradient; ``enabled``
    (a bool array) closes it regardless. An optimizer that ``handled`` non-finite
    gradients itself (loss scaling: its own skip, a smaller scale) gets ``finite``, whether
    every gradient is finite (the loss aside: torch's ``GradScaler`` checks the gradients
    alone, so under "ignore" a non-finite loss with finite gradients is a step, not an
    overflow), and the gate stays open for them; only a non-finite loss closes it then, and ``nonfinite``
    reports the loss (-2) as the cause, whatever the gradients: a smaller scale cannot make
    a loss finite that is not finite before it is scaled (a float16 forward overflowing),
    so neither is the step the loss scale's skip (torch's ``GradScaler``, which checks only
    the gradients, skips it and halves the scale).

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.optim._skip import gate
      >>> g = gate(jnp.float32(1), {"w": jnp.array([jnp.nan])}, on_nan="skip")
      >>> bool(g.apply), int(g.nonfinite)
      (False, 0)
      >>> g = gate(jnp.float32(1), {"w": jnp.array([jnp.nan])}, on_nan="stop", handled=True)
      >>> bool(g.apply), bool(g.finite), int(g.nonfinite)
      (True, False, -1)
      >>> g = gate(jnp.float32(jnp.inf), {"w": jnp.array([jnp.nan])}, on_nan="stop", handled=True)
      >>> bool(g.apply), int(g.nonfinite)
      (False, -2)
      >>> g = gate(jnp.float32(jnp.inf), {"w": jnp.ones(1)}, handled=True)   # "ignore": the gradients'
      >>> bool(g.finite)
      True
    """
    if on_nan == "ignore" and not handled:
        return Gate(enabled, None, None)
    index, loss_ok = _finiteness(loss, grads)
    finite = index == -1
    gradients_ok = index < 0  # every gradient (-2: the loss alone is not): the handler's check
    if on_nan == "ignore":  # (handled: see above)
        return Gate(enabled, gradients_ok, None)
    closed = ~loss_ok if handled else ~finite
    apply = ~closed if enabled is None else ~closed & enabled
    cause = jnp.int32(-2) if handled else index  # handled: only the loss closes the gate
    return Gate(apply, gradients_ok if handled else finite, jnp.where(closed, cause, -1))


def select(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf; leaves that are not arrays (``None``,
    an Equinox module's functions) come from ``new``."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o) if isinstance(n, jax.Array) else n, new, old,
                        is_leaf=is_none)


def apply_or_keep(ok: jax.Array, fn: Callable[[Any, Any], tuple[Any, Any]], model: Any, state: Any) -> tuple[Any, Any]:
    """``fn(model, state)`` when ``ok``, else ``(model, state)`` as given, bit for bit.

    One ``lax.cond`` around the whole update: the taken branch writes the donated buffers
    in place, the other passes them through. Selecting leaf by leaf between old and new
    values (:func:`select`) computes the same thing, but XLA then keeps each old moment
    alive next to its new value and copies every donated buffer first (15 copies against
    5 on a tiny Adam step). Leaves that are not arrays (an Equinox module's functions)
    stay out of the branches; they come from ``fn``'s result. ``fn`` sees Python numbers
    as they are: one it returns unchanged stays that Python number (an Equinox
    ``Dropout``'s ``p``), one it changes (an ``ft.Module``'s float field, trained) comes
    out of the branches as an array. Under ``vmap`` of ``ok``
    the cond becomes that select.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.optim._skip import apply_or_keep
      >>> add = lambda m, s: (m + 1, s + 1)
      >>> apply_or_keep(jnp.array(False), add, jnp.zeros(2), jnp.int32(0))
      (Array([0., 0.], dtype=float32), Array(0, dtype=int32))
    """
    old, treedef = jax.tree.flatten((model, state))
    arrays = [i for i, x in enumerate(old) if _is_traceable(x)]
    traced = set(arrays)
    shape: list[Any] = []  # the applied branch's tree and leaves that are not arrays (trace time)
    kept: list[int] = []  # Python numbers fn passed through: they stay Python numbers (static data)

    def apply(xs: list[Any]) -> list[Any]:
        leaves = list(old)
        for i, x in zip(arrays, xs):
            if not isinstance(old[i], _NUMBERS):  # fn sees Python numbers as they are
                leaves[i] = x
        new, new_treedef = jax.tree.flatten(fn(*treedef.unflatten(leaves)))
        if new_treedef != treedef:
            raise TypeError(CHANGED_TREE.format(before=treedef, after=new_treedef))
        # the branch's arrays leave through its outputs only: a tracer kept here outlives the
        # cond's trace (jax.checking_leaks refuses the step)
        shape[:] = [new_treedef, [None if i in traced else x for i, x in enumerate(new)]]
        kept[:] = [i for i in arrays if isinstance(old[i], _NUMBERS) and new[i] is old[i]]
        return [x if i in kept else new[i] for i, x in zip(arrays, xs)]

    def keep(xs: list[Any]) -> list[Any]:
        return xs

    out = jax.lax.cond(ok, apply, keep, [old[i] for i in arrays])
    new_treedef, new = shape
    new = list(new)
    for i, x in zip(arrays, out):
        new[i] = x
    for i in kept:  # (an Equinox Dropout's p: a float its code branches on, never a traced array)
        new[i] = old[i]
    return new_treedef.unflatten(new)


_NUMBERS = (int, float, complex)  # bool too


def _is_traceable(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def guard(ok: jax.Array, updates: Any, new_state: Any, old_state: Any) -> tuple[Any, Any]:
    """``(updates, new_state)`` when ``ok``, else ``(zeros, old_state)``: a step that did not happen."""
    zeros = jax.tree.map(lambda u: None if u is None else jnp.where(ok, u, jnp.zeros_like(u)), updates,
                         is_leaf=is_none)
    return zeros, select(ok, new_state, old_state)


class SkipState(NamedTuple):
    """State of :func:`skip_non_finite`.

    Attributes:
      skipped: steps skipped so far (non-finite gradients).
      consecutive: non-finite steps in a row, up to the latest.
      applied: whether the latest step was applied (a bool array).
      inner: the wrapped transformation's state (unchanged by skipped steps).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.skip_non_finite(ft.optim.sgd(0.1)).init({"w": jnp.zeros(2)})
      >>> int(state.skipped), bool(state.applied)
      (0, True)
    """

    skipped: jax.Array
    consecutive: jax.Array
    applied: jax.Array
    inner: Any


def skip_non_finite(transform: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Skip steps with a NaN/Inf gradient: zero updates, ``transform``'s state kept.

    Without it, non-finite gradients propagate into the parameters and the moments.
    ``state.skipped`` counts the skipped steps, ``state.consecutive`` those in a row.
    Inside an :class:`ft.optim.Optimizer` the learning context does not advance on a
    skipped step; used alone, the wrapped functree transform's own context does not.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.skip_non_finite(ft.optim.sgd(1.0))
      >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, tx.init({"w": jnp.ones(2)}))
      >>> updates["w"], int(state.skipped), int(ft.optim.context(state).step)
      (Array([0., 0.], dtype=float32), 1, 0)
      >>> opt = ft.optim.Optimizer(ft.optim.skip_non_finite(ft.optim.adam()))
      >>> w = {"w": jnp.ones(2)}
      >>> _, state = opt.update({"w": jnp.array([jnp.inf, 0.0])}, opt.init(w), w)
      >>> int(ft.optim.context(state).step)
      0
    """
    inner = optax.with_extra_args_support(transform)

    def init(params: Any) -> SkipState:
        zero = jnp.zeros((), jnp.int32)
        return SkipState(zero, zero.copy(), jnp.ones((), bool), inner.init(params))

    def update(updates: Any, state: SkipState, params: Any = None, **extra: Any) -> tuple[Any, SkipState]:
        ok = all_finite(updates)
        safe = jax.tree.map(lambda g: None if g is None else jnp.where(ok, g, jnp.zeros_like(g)), updates,
                            is_leaf=is_none)
        new_updates, new_inner = inner.update(safe, state.inner, params, **extra)
        new_updates, new_inner = guard(ok, new_updates, new_inner, state.inner)
        bad = (~ok).astype(jnp.int32)
        return new_updates, SkipState(state.skipped + bad, (state.consecutive + bad) * bad, ok, new_inner)

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def _is_skip(x: Any) -> bool:
    return isinstance(x, SkipState)


def applied_in(state: Any) -> jax.Array | None:
    """Whether every :func:`skip_non_finite` in ``state`` applied its latest step (None: none there)."""
    flags = [x.applied for x in jax.tree.leaves(state, is_leaf=_is_skip) if _is_skip(x)]
    if not flags:
        return None
    return jnp.stack(flags).all() if len(flags) > 1 else flags[0]
