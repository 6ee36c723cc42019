"""Skipping a step: one mechanism for non-finite gradients, loss-scale overflow and ``on_nan``.

A skipped step returns zero updates and the state it was given, bit for bit; the learning
context does not advance. :func:`guard` is the one place that does this;
:func:`ft.optim.skip_non_finite` (a transformation), ``LossScaleOptimizer`` (on overflow)
and ``ft.train.train_step(on_nan="skip")`` all use it, with :func:`all_finite` as the one
finiteness test.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from functree._tree import all_finite, is_none

__all__ = ["guard", "select", "all_finite", "SkipState", "skip_non_finite", "applied_in"]


def select(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf; leaves that are not arrays (``None``,
    an Equinox module's functions) come from ``new``."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o) if isinstance(n, jax.Array) else n, new, old,
                        is_leaf=is_none)


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
