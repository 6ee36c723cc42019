"""Dynamic loss scaling (Keras 3 ``LossScaleOptimizer``) as an :class:`OptimizerWrapper`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree._tree import all_finite, dotted_name, is_none
from functree._warnings import warn
from functree._where import placement_of
from functree.nn._precision import statistics_dtype
from functree.optim._optimizer import SCALED_HOOK, OptimizerWrapper
from functree.optim._skip import select
from functree.optim._subset import trained_view

__all__ = ["LossScaleOptimizer", "LossScaleState", "UnscaledFloat16Warning", "warn_unscaled_float16"]

NEEDS_STATE = """\
LossScaleOptimizer.{method} needs the optimizer state (it holds the loss scale):

    wrong:  opt.{method}(loss_fn, model, x)
    right:  opt.{method}(loss_fn, model, x, state=state)      # state = opt.init(model)
"""

HOOK_RESULT = """\
LossScaleOptimizer: the get_gradients hook {hook} returned {given}; it must return the pair \
(unscaled loss, grads of scale * loss) ({loss_kind}), as jax.value_and_grad does:

    wrong:  return jax.grad(lambda m, *b: scale * loss_fn(m, *b))(model, *batch)       # grads only
    wrong:  return jax.value_and_grad(lambda m, *b: scale * loss_fn(m, *b))(model, *batch)  # loss scaled
{scaled_hook}
"""

BAD_SCALE = "LossScaleOptimizer: {name} must be positive, got {value!r}."

BAD_FACTOR = """\
LossScaleOptimizer: {name} must be a finite number {rule} (torch's GradScaler's {name} too); \
got {value!r}. {why}

    wrong:  ft.optim.LossScaleOptimizer(opt, {name}={value!r})
    right:  ft.optim.LossScaleOptimizer(opt, growth_factor=2.0, backoff_factor=0.5)   # torch's defaults
"""

TORCH_KEYWORD = """\
LossScaleOptimizer() got an unexpected keyword argument {name!r}{why}. Its options: \
initial_scale, growth_interval, growth_factor, backoff_factor (torch's GradScaler's init_scale, \
growth_interval, growth_factor, backoff_factor).

    wrong:  ft.optim.LossScaleOptimizer(opt, {name}={value!r})
    right:  {right}
"""

# torch's GradScaler keywords: (why, the right code); {value} is the value given.
_TORCH_KEYWORDS = {
    "init_scale": (" (torch's GradScaler's name of initial_scale)",
                   "ft.optim.LossScaleOptimizer(opt, initial_scale={value!r})"),
    "enabled": (" (torch's GradScaler(enabled=False) scales nothing: leave the wrapper out)",
                "opt      # the inner optimizer alone, or LossScaleOptimizer(opt) to scale"),
}

_FACTOR_RULES = {
    # name: (the range's test, the range in words, what a value outside it would do)
    "growth_factor": (lambda f: f > 1.0, "greater than 1",
                      "At most 1, a growth would keep or shrink the scale: after an overflow it could never "
                      "climb back, and the small gradients it exists to keep would underflow."),
    "backoff_factor": (lambda f: 0.0 < f < 1.0, "between 0 and 1 (exclusive)",
                       "At 1 or more an overflowed step would be retried at the same scale or a larger one "
                       "and be skipped again, every step: training would silently stop."),
}

BAD_INITIAL_SCALE = """\
LossScaleOptimizer: initial_scale must be a finite positive number that float32 (the scale's \
dtype) holds, at most {largest:.4g}; got {value!r}. An infinite scale makes every step \
overflow and be skipped, and inf / 2 is inf: training would silently never move.

    wrong:  ft.optim.LossScaleOptimizer(opt, initial_scale={value!r})
    right:  ft.optim.LossScaleOptimizer(opt, initial_scale=2.0**16)   # torch's GradScaler's init_scale
"""

FLOAT16_PARAMETER = """\
LossScaleOptimizer: the parameter at {path} is float16. Its gradient would be unscaled in \
float16 too, where every value below 6e-8 (float16's smallest) comes out 0: the small \
gradients the scale exists to keep are lost, silently (torch's GradScaler refuses it: \
"Attempting to unscale FP16 gradients."). Keep the parameters in float32 and compute in float16:

    wrong:  opt.init(ft.cast(model, jnp.float16))
    right:  ft.train.train_step(loss_fn, opt, compute_dtype=jnp.float16)     # float32 master parameters
       or:  loss_fn(ft.cast(model, jnp.float16), batch)   # inside the loss, model kept float32
"""

UNSCALED_FLOAT16 = """\
compute_dtype=float16 with {optimizer}, which scales no loss: the gradients flow back \
through the model in float16, where every value below 6e-8 (float16's smallest) is 0, so \
small gradients are lost, silently (torch's autocast(float16) goes with a GradScaler; Keras's \
mixed_float16 policy wraps the optimizer in a LossScaleOptimizer). Scale the loss, or compute \
in bfloat16 (float32's range, no scale needed):

    wrong:  ft.train.Trainer(model, opt, loss_fn, compute_dtype=jnp.float16)
    right:  ft.train.Trainer(model, ft.optim.LossScaleOptimizer(opt), loss_fn, compute_dtype=jnp.float16)
       or:  ft.train.Trainer(model, opt, loss_fn, compute_dtype=jnp.bfloat16)
"""

_LARGEST = float(np.finfo(np.float32).max)


class UnscaledFloat16Warning(UserWarning):
    """A training step computes in float16 and no :class:`LossScaleOptimizer` scales its
    loss: gradients below float16's smallest value come out 0 (:data:`UNSCALED_FLOAT16`)."""


def _check_no_float16(model: Any, wrt: Any) -> None:
    """:data:`FLOAT16_PARAMETER` naming the first trained float16 parameter of ``model``."""
    for path, p in jax.tree_util.tree_flatten_with_path(trained_view(model, wrt), is_leaf=is_none)[0]:
        if p is not None and jnp.result_type(p) == jnp.float16:
            raise ValueError(FLOAT16_PARAMETER.format(path=dotted_name(path) or "<root>"))


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


def _checked_factor(name: str, value: Any) -> float:
    """``value`` as a float, or :data:`BAD_FACTOR` for ``name`` (its range in :data:`_FACTOR_RULES`)."""
    test, rule, why = _FACTOR_RULES[name]
    if not (_finite_positive(value) and test(float(value))):
        raise ValueError(BAD_FACTOR.format(name=name, rule=rule, value=value, why=why))
    return float(value)


def _finite_positive(value: Any) -> bool:
    """Whether ``value`` is a real number (a 0-d array too) in ``(0, float32's largest]``
    (NaN and inf are not; nor a bool or a string)."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or jnp.iscomplexobj(value):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return 0 < number <= _LARGEST


def _unscaled(g: Any, scale: jax.Array) -> jax.Array:
    """``g / scale`` in float32 at least: a float64 gradient (under x64) in float64 (in
    float32 it lost its low bits, and from 3.4e38 on it overflowed: a skipped step); a
    complex gradient stays complex (cast to float32 it would lose its imaginary part).

    XLA computes a division by a scalar as a product with its reciprocal, and from a scale
    of 2**127 on that reciprocal is subnormal, which XLA flushes to zero: every gradient came
    out 0. Above 2**126 the reciprocal is taken in two normal factors, ``2**-64`` and
    ``2**64 / scale`` (both exact for a power of two; a gradient that the first one
    flushes is below float32's range once divided by the scale anyway)."""
    wide = g.dtype if jnp.issubdtype(g.dtype, jnp.complexfloating) else statistics_dtype(g.dtype)
    big = scale > 2.0**126
    first = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
    # The reciprocal in the gradient's (wide) dtype: a float32 1 / (scale / k) (accumulate=k,
    # k no power of two) put float32's rounding, 6e-8, into every float64 gradient.
    second = jnp.where(big, jnp.float32(2.0**64), jnp.float32(1.0)).astype(wide) / scale.astype(wide)
    return (g.astype(wide) * first.astype(wide) * second).astype(g.dtype)


def _is_scalar(x: Any) -> bool:
    """A 0-d array or a Python number (a dict of gradients is not, though ``np.shape`` of
    one is ``()``)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    return getattr(x, "shape", None) == ()


def _checked_pair(result: Any, has_aux: bool, hook: Any) -> tuple[Any, Any]:
    """``result`` as ``(out, grads)``, or a HOOK_RESULT error: a get_gradients hook that
    returned the gradients alone (a dict of two would unpack silently) or another shape.
    ``out`` is the loss (a scalar), or ``(loss, aux)`` with ``has_aux``."""
    if hook is None:
        return result  # functree's own differentiation: the pair by construction
    pair = isinstance(result, tuple) and len(result) == 2
    out = result[0] if pair else None
    if has_aux:
        ok = isinstance(out, (tuple, list)) and len(out) == 2 and _is_scalar(out[0])
    else:
        ok = _is_scalar(out)
    if not (pair and ok):
        given = f"a {type(result).__name__}" if not pair else "a pair whose first item is not the loss"
        kind = "with has_aux=True: ((loss, aux), grads)" if has_aux else "the loss: a scalar"
        raise TypeError(HOOK_RESULT.format(hook=getattr(hook, "__qualname__", "hook"), given=given, loss_kind=kind,
                                           scaled_hook=SCALED_HOOK))
    return result


class LossScaleOptimizer(OptimizerWrapper):
    """Dynamic loss scaling for low-precision training.

    Each step differentiates ``scale · T(loss)`` (``T``: the inner optimizers'
    ``transform_loss``, so the scale comes last) and divides the gradients by ``scale``;
    a ``get_gradients`` hook gets the scale as ``scale=`` (``per_example_clipping`` clips
    at ``scale · t``, the same clip in the loss's units) and one without it is refused. If
    any gradient is not finite, the step is skipped (model and inner state unchanged,
    ``skipped`` counted) and ``scale`` is multiplied by ``backoff_factor`` (halved by
    default; down to 1, where torch's ``GradScaler`` goes on below it); after
    ``growth_interval`` consecutive finite steps it is multiplied by ``growth_factor``
    (doubled by default), unless the grown scale is not finite in float32 (torch's
    ``GradScaler``: it stays at ``2**127``). torch's ``GradScaler(init_scale=s,
    growth_factor=g, backoff_factor=b, growth_interval=n)`` is
    ``LossScaleOptimizer(opt, initial_scale=s, growth_factor=g, backoff_factor=b,
    growth_interval=n)``, scale for scale (checked against torch, overflows included). A
    skipped step does not advance the learning context: a schedule gives the next step the
    rate the skipped one would have taken (Hugging Face's Trainer skips its
    ``lr_scheduler.step()`` there; a torch loop stepping its scheduler after every
    ``scaler.step`` moves on). All of it is array arithmetic: it runs in one jitted step. ``inner`` is an :class:`Optimizer` or an optax transformation
    (``LossScaleOptimizer(ft.optim.adam(1e-3))``), wrapped in one as the Trainer does.

    The overflow check is on the unscaled gradients *before* the ``transform_gradients``
    hooks (an elementwise clip would turn an overflowed ``inf`` into a plausible 1), as
    torch's ``scaler.unscale_(opt)`` comes before ``clip_grad_value_``. With
    ``accumulate=k`` each microbatch's loss is scaled by ``scale / k``, as torch's
    ``scaler.scale(loss / k)``: an overflow comes at the same scale as there (exactly
    when ``k`` is a power of two; otherwise the unscaled gradients carry one float32
    rounding of ``scale / k``). The loss is multiplied by the scale in float32 (a float16
    product is ``inf`` from 65536 on); a loss function returning float16 still caps the
    scale at 32768, as its cotangent is float16: compute the loss in float32 (the
    ``ft.losses`` do). float16 *parameters* are refused at :meth:`init`
    (:data:`FLOAT16_PARAMETER`, torch's "Attempting to unscale FP16 gradients."): their
    unscaled gradients would be float16, where those below ``6e-8`` are 0; keep float32
    master parameters and compute in float16 (``train_step(compute_dtype=jnp.float16)``).

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
    # Class defaults: an optimizer pickled before these options existed reads torch's.
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __init__(self, inner: Any, initial_scale: float = 2.0**15, growth_interval: int = 2000, *,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, **unknown: Any):
        if unknown:  # Python's bare "unexpected keyword" would not say that init_scale is initial_scale
            name, value = next(iter(unknown.items()))
            why, right = _TORCH_KEYWORDS.get(name, ("", "ft.optim.LossScaleOptimizer(opt, initial_scale=2.0**16)"))
            raise TypeError(TORCH_KEYWORD.format(name=name, value=value, why=why, right=right.format(value=value)))
        super().__init__(inner)
        if not _finite_positive(initial_scale):
            raise ValueError(BAD_INITIAL_SCALE.format(value=initial_scale, largest=_LARGEST))
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(BAD_SCALE.format(name="growth_interval", value=growth_interval))
        object.__setattr__(self, "initial_scale", float(initial_scale))
        object.__setattr__(self, "growth_interval", growth_interval)
        object.__setattr__(self, "growth_factor", _checked_factor("growth_factor", growth_factor))
        object.__setattr__(self, "backoff_factor", _checked_factor("backoff_factor", backoff_factor))

    def init(self, model: Any) -> LossScaleState:
        _check_no_float16(model, self.wrt)
        # From the host, on the model's devices (a model on device 3 or a mesh), as the inner
        # state's context: not on the default device, and no compile for a zero.
        scale, good, skipped = jax.device_put(
            (np.asarray(self.initial_scale, np.float32), np.zeros((), np.int32), np.zeros((), np.int32)),
            placement_of(model))
        return LossScaleState(scale, good, skipped, self.inner.init(model))

    def compute_gradients(self, loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                          state: Any = None, key: Any = None, checked: bool | None = None) -> tuple[Any, Any]:
        # Checked here too, so that the error names the method the user called.
        if not isinstance(state, LossScaleState):
            raise ValueError(NEEDS_STATE.format(method="compute_gradients"))
        return super().compute_gradients(loss_fn, model, *batch, has_aux=has_aux, state=state, key=key,
                                         checked=checked)

    def get_gradients(self, loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                      state: Any = None, scale: Any = None) -> tuple[Any, Any]:
        if scale is not None:
            raise TypeError("LossScaleOptimizer.get_gradients: this optimizer applies its own loss scale; "
                            "another LossScaleOptimizer around it would scale twice.")
        if not isinstance(state, LossScaleState):
            raise ValueError(NEEDS_STATE.format(method="get_gradients"))
        # The scale multiplies the loss after every transform_loss (and a get_gradients hook
        # gets it as scale=): scaling first would give grad T(s L) / s, not grad T(L).
        # With accumulate=k this runs once per microbatch and the step averages their mean
        # gradients: scale / k per microbatch is torch's scaler.scale(loss / k), the same
        # cotangent, so an overflow comes at the same scale.
        scale = state.scale / self.accumulate if self.accumulate > 1 else state.scale
        result = super().get_gradients(loss_fn, model, *batch, has_aux=has_aux, state=state.inner, scale=scale)
        out, grads = _checked_pair(result, has_aux, self._hook())
        return out, jax.tree.map(lambda g: _unscaled(g, scale), grads)

    def _hook(self) -> Any:
        """The innermost Optimizer's get_gradients hook (``None``: its own differentiation)."""
        inner = self.inner
        while isinstance(inner, OptimizerWrapper):
            inner = inner.inner
        return getattr(inner, "_get_gradients", None)

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
        # In float32, as torch's scale tensor: 2**127 * 2 is inf there, and the scale stays.
        larger = state.scale * jnp.float32(self.growth_factor)
        grown = jnp.where(grow & jnp.isfinite(larger), larger, state.scale)
        scale = jnp.where(finite, grown, jnp.maximum(state.scale * jnp.float32(self.backoff_factor), 1.0))
        good = jnp.where(grow, 0, good).astype(jnp.int32)
        skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        if apply_if is not None:  # a step the caller's gate closed did not happen
            scale, good, skipped = select(apply_if, (scale, good, skipped), state[:3])
        return updates, LossScaleState(scale, good, skipped, inner)


def _scales_loss(optimizer: Any) -> bool:
    """Whether ``optimizer`` or an optimizer it wraps is a :class:`LossScaleOptimizer`."""
    while isinstance(optimizer, OptimizerWrapper):
        if isinstance(optimizer, LossScaleOptimizer):
            return True
        optimizer = optimizer.inner
    return False


def warn_unscaled_float16(optimizer: Any, compute_dtype: Any) -> None:
    """:class:`UnscaledFloat16Warning` for a training step that computes in float16 with an
    ``optimizer`` that scales no loss: the step's gradients underflow to 0 silently (a
    bfloat16 step, with float32's range, needs no scale)."""
    if compute_dtype is None or np.dtype(compute_dtype) != np.float16 or _scales_loss(optimizer):
        return
    warn(UNSCALED_FLOAT16.format(optimizer=type(optimizer).__name__), UnscaledFloat16Warning)
