"""Dynamic loss scaling (Keras 3 ``LossScaleOptimizer``) as an :class:`OptimizerWrapper`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from functree._tree import all_finite
from functree.optim._optimizer import Optimizer, OptimizerWrapper
from functree.optim._skip import select

__all__ = ["LossScaleOptimizer", "LossScaleState"]

NEEDS_STATE = """\
LossScaleOptimizer.{method} needs the optimizer state (it holds the loss scale):

    wrong:  opt.compute_gradients(loss_fn, model, x)
    right:  opt.compute_gradients(loss_fn, model, x, state=state)
"""

BAD_SCALE = "LossScaleOptimizer: {name} must be positive, got {value!r}."


class LossScaleState(NamedTuple):
    """The loss scale, finite steps since it last changed, steps skipped, and the inner state.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1))).init({"w": jnp.ones(())})
      >>> state.scale, state.good_steps, state.skipped
      (Array(32768., dtype=float32), Array(0, dtype=int32), Array(0, dtype=int32))
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    inner: Any


def _unscaled(g: Any, inv: jax.Array) -> jax.Array:
    """``g * inv`` in float32 at least; a complex gradient stays complex (cast to float32 it
    would lose its imaginary part)."""
    wide = g.dtype if jnp.issubdtype(g.dtype, jnp.complexfloating) else jnp.float32
    return (g.astype(wide) * inv.astype(wide)).astype(g.dtype)


class LossScaleOptimizer(OptimizerWrapper):
    """Dynamic loss scaling for low-precision training.

    Each step differentiates ``scale · T(loss)`` (``T``: the inner optimizers'
    ``transform_loss``, so the scale comes last) and divides the gradients by ``scale``;
    a ``get_gradients`` hook gets the scale as ``scale=`` (``per_example_clipping`` clips
    at ``scale · t``, the same clip in the loss's units) and one without it is refused. If
    any gradient is not finite, the step is skipped (model and inner state unchanged,
    ``skipped`` counted) and ``scale`` is halved (down to 1); after ``growth_interval``
    consecutive finite steps it doubles. All of it is array arithmetic: it runs in one
    jitted step.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1)))
      >>> w = {"w": jnp.ones(())}
      >>> state = opt.init(w)
      >>> w, state, loss = opt.minimize(lambda p: p["w"] * 1e35, w, state)  # overflows
      >>> w["w"], state.scale, state.skipped
      (Array(1., dtype=float32), Array(16384., dtype=float32), Array(1, dtype=int32))
    """

    initial_scale: float
    growth_interval: int

    def __init__(self, inner: Optimizer, initial_scale: float = 2.0**15, growth_interval: int = 2000):
        super().__init__(inner)
        if not initial_scale > 0:
            raise ValueError(BAD_SCALE.format(name="initial_scale", value=initial_scale))
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(BAD_SCALE.format(name="growth_interval", value=growth_interval))
        object.__setattr__(self, "initial_scale", float(initial_scale))
        object.__setattr__(self, "growth_interval", growth_interval)

    def init(self, model: Any) -> LossScaleState:
        return LossScaleState(
            jnp.asarray(self.initial_scale, jnp.float32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            self.inner.init(model),
        )

    def get_gradients(self, loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                      state: Any = None, scale: Any = None) -> tuple[Any, Any]:
        if scale is not None:
            raise TypeError("LossScaleOptimizer.get_gradients: this optimizer applies its own loss scale; "
                            "another LossScaleOptimizer around it would scale twice.")
        if not isinstance(state, LossScaleState):
            raise ValueError(NEEDS_STATE.format(method="get_gradients"))
        # The scale multiplies the loss after every transform_loss (and a get_gradients hook
        # gets it as scale=): scaling first would give grad T(s L) / s, not grad T(L).
        out, grads = super().get_gradients(loss_fn, model, *batch, has_aux=has_aux, state=state.inner,
                                           scale=state.scale)
        inv = 1.0 / state.scale
        return out, jax.tree.map(lambda g: _unscaled(g, inv), grads)

    @property
    def handles_nonfinite(self) -> bool:
        return True  # an overflow is this optimizer's own business: skip, halve the scale

    def update(self, grads: Any, state: Any, model: Any = None, *, minibatch_size: Any = None,
               loss: Any = None, apply_if: Any = None, finite: Any = None, **extra: Any) -> tuple[Any, Any]:
        """The inner update when every gradient is ``finite`` (computed here unless the step
        gives it: one reduction), the scale adjusted; ``apply_if`` False returns ``state``
        unchanged, scale included."""
        if not isinstance(state, LossScaleState):
            raise ValueError(NEEDS_STATE.format(method="update"))
        if finite is None:
            finite = all_finite(grads)
        ok = finite if apply_if is None else finite & apply_if
        # The inner optimizer skips by its one rule: zero updates, its state (and the
        # learning context) unchanged. Zeroed gradients keep NaNs out of the math.
        safe = jax.tree.map(lambda g: None if g is None else jnp.where(finite, g, jnp.zeros_like(g)), grads,
                            is_leaf=lambda x: x is None)
        updates, inner = self.inner.update(safe, state.inner, model, minibatch_size=minibatch_size, loss=loss,
                                           apply_if=ok, **extra)
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(finite, jnp.where(grow, state.scale * 2.0, state.scale), jnp.maximum(state.scale / 2.0, 1.0))
        good = jnp.where(grow, 0, good).astype(jnp.int32)
        skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        if apply_if is not None:  # a step the caller's gate closed did not happen
            scale, good, skipped = select(apply_if, (scale, good, skipped), state[:3])
        return updates, LossScaleState(scale, good, skipped, inner)
