"""Schedules: callables of the learning context, reusing optax's schedule numerics.

A schedule maps a :class:`~functree.optim.LearningContext` to a value. ``unit`` picks the
counter that drives it: ``"steps"`` (optimizer steps), ``"samples"`` (examples seen) or
``"sweeps"`` (epochs, advanced by :func:`~functree.optim.next_sweep`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree.optim._arguments import check_argument
from functree.optim._context import LearningContext

__all__ = [
    "schedule",
    "constant",
    "piecewise",
    "exponential_decay",
    "cosine_decay",
    "linear_warmup",
    "warmup_cosine_decay",
    "inverse_time_decay",
]

UNITS = ("steps", "samples", "sweeps")

BAD_UNIT = """\
unit={unit!r} is not a learning-context counter; use one of {units}:

    right:  ft.optim.piecewise([(100, 1e-2), (1, 1e-3)], unit="sweeps")
"""

BAD_PIECEWISE = """\
ft.optim.piecewise takes (count, value) pairs with positive counts; got {pairs!r}.
Each pair holds its value for `count` units; the last value holds afterwards:

    right:  ft.optim.piecewise([(1000, 1e-2), (1000, 1e-3), (1, 1e-4)], unit="samples")
"""

FRACTIONAL_COUNT = """\
ft.optim.piecewise: pair {index} holds its value for {count!r} {unit}, not a whole number; the \
learning context counts {unit} in integers, and {count!r} was read as {whole} (the value after \
it came {early} {unit} early).{hint} Give whole counts:

    wrong:  ft.optim.piecewise([..., ({count!r}, {value!r}), ...], unit={unit!r})
    right:  ft.optim.piecewise([..., ({fix}, {value!r}), ...], unit={right_unit!r}){comment}
"""


def _count(pairs: list[Any], index: int, unit: str) -> int:
    """The count of ``pairs[index]`` as an int: :data:`BAD_PIECEWISE` for one that is no
    positive number (a bool, a string), :data:`FRACTIONAL_COUNT` for one with a fraction
    (``int`` truncated 1.5 sweeps to 1, silently)."""
    count, value = pairs[index]
    number = isinstance(count, (int, float, np.integer, np.floating)) and not isinstance(count, (bool, np.bool_))
    if not number or not np.isfinite(count) or int(count) <= 0:
        raise ValueError(BAD_PIECEWISE.format(pairs=pairs))
    if count != int(count):
        sweeps = unit == "sweeps"
        raise ValueError(FRACTIONAL_COUNT.format(
            index=index, count=count, unit=unit, whole=int(count), early=round(float(count) - int(count), 6),
            value=value, hint=" A part of a sweep is a count of steps." if sweeps else "",
            fix=f"{count!r} * steps_per_sweep" if sweeps else round(float(count)),
            right_unit="steps" if sweeps else unit,
            comment="   # the steps of one pass over the data" if sweeps else ""))
    return int(count)


def counter(ctx: LearningContext, unit: str) -> jax.Array:
    """The context's count in ``unit``."""
    if unit == "steps":
        return ctx.step
    if unit == "samples":
        return ctx.samples_seen
    return ctx.sweep


def _float() -> Any:
    """JAX's default float: float64 under ``jax_enable_x64`` (the hyperparameters of float64
    parameters are float64, :mod:`functree.optim._hyper`), else float32. A schedule's values
    are computed in it, so a float64 model's rates are torch's to the last bit, not float32's
    0.1 (1.49e-9 off)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


Render = Callable[[Callable[[Any], str]], str]
"""A schedule's constructor call as code, each of its values written by the function given."""

_VALUES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], Render]] = weakref.WeakKeyDictionary()


def _recorded(fn: Any, values: Sequence[Any], code: Render) -> Any:
    """``fn``, with the values its constructor was given (every one it takes at a turn or an
    end) and its call as code: an optimizer checks them against the hyperparameter's range
    (:func:`values_of`). Returns ``fn``."""
    _VALUES[fn] = (tuple(values), code)
    return fn


def values_of(fn: Any) -> tuple[tuple[Any, ...], Render] | None:
    """The values one of functree's schedules was built with (a piecewise list's values, a
    ramp's or a decay's start, peak and end: it takes no value outside them but the decays'
    limit 0) and its constructor call as code; None for any other callable, whose values
    are known only when it runs.

    Example:
      >>> import functree as ft
      >>> values, code = values_of(ft.optim.piecewise([(3, 0.1), (1, 0.01)]))
      >>> values, code(repr)
      ((0.1, 0.01), 'ft.optim.piecewise([(3, 0.1), (1, 0.01)])')
    """
    try:
        return _VALUES.get(fn)
    except TypeError:  # an unhashable callable
        return None


def _unit(unit: str) -> str:
    return "" if unit == "steps" else f", unit={unit!r}"


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(BAD_UNIT.format(unit=unit, units=UNITS))


def schedule(fn: Callable[[Any], Any], unit: str = "steps") -> Callable[[LearningContext], Any]:
    """Drive a count-based schedule (any optax schedule) by a learning-context counter.

    Example:
      >>> import functree as ft, optax
      >>> lr = ft.optim.schedule(optax.linear_schedule(1.0, 0.0, 10), unit="sweeps")
      >>> tx = ft.optim.sgd(lr)
    """
    _check_unit(unit)

    def at(ctx: LearningContext) -> Any:
        # JAX's default int (int64 under x64): optax divides the count by Python numbers,
        # in float32 from an int32 count, in float64 from an int64 one.
        count = counter(ctx, unit).astype(jax.dtypes.canonicalize_dtype(jnp.int64))
        with jax.numpy_dtype_promotion("standard"):  # optax schedules mix int counts and floats
            return fn(count)

    at.__qualname__ = f"schedule({getattr(fn, '__name__', 'fn')}, unit={unit!r})"
    return at


def constant(value: float) -> Callable[[LearningContext], Any]:
    """``value`` at every step (a schedule; a plain number is settable instead).

    Example:
      >>> import functree as ft
      >>> lr = ft.optim.constant(0.1)
      >>> lr(ft.optim.initial_context().replace(step=1000))
      Array(0.1, dtype=float32)
    """
    return _recorded(lambda ctx: jnp.asarray(value, _float()), (value,), lambda w: f"ft.optim.constant({w(value)})")


def piecewise(pairs: Sequence[tuple[int, float]], unit: str = "steps") -> Callable[[LearningContext], Any]:
    """CNTK's schedule list: each ``(count, value)`` holds for ``count`` units, in order.

    .. math:: v(c) = v_i \\text{ for } \\textstyle\\sum_{j<i} n_j \\le c < \\sum_{j\\le i} n_j,
       \\text{ the last } v \\text{ afterwards}

    Example:
      >>> import functree as ft
      >>> lr = ft.optim.piecewise([(2, 0.1), (3, 0.01), (1, 0.001)], unit="steps")
      >>> ctx = ft.optim.initial_context()
      >>> [round(float(lr(ctx.replace(step=s))), 6) for s in range(7)]
      [0.1, 0.1, 0.01, 0.01, 0.01, 0.001, 0.001]
    """
    _check_unit(unit)
    pairs = list(pairs)
    if not pairs or any(not isinstance(p, (tuple, list)) or len(p) != 2 for p in pairs):
        raise ValueError(BAD_PIECEWISE.format(pairs=pairs))
    counts = [_count(pairs, i, unit) for i in range(len(pairs))]
    ends = jnp.asarray(np.cumsum(counts)[:-1], jnp.int32)
    values = np.asarray([float(v) for _, v in pairs], np.float64)

    def at(ctx: LearningContext) -> jax.Array:
        index = jnp.sum(counter(ctx, unit) >= ends)
        return jnp.asarray(values, _float())[index]

    return _recorded(at, [v for _, v in pairs], lambda w: "ft.optim.piecewise([" + ", ".join(
        f"({c!r}, {w(v)})" for c, v in pairs) + f"]{_unit(unit)})")


def exponential_decay(
    init_value: float, transition_steps: int, decay_rate: float, *, staircase: bool = False,
    end_value: float | None = None, unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """``init_value · decay_rate^(c / transition_steps)`` (``optax.exponential_decay``).

    With ``staircase=True`` the exponent is ``⌊c / transition_steps⌋``.

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.exponential_decay(1.0, 10, 0.5), ft.optim.initial_context()
      >>> [float(lr(ctx.replace(step=s))) for s in (0, 10, 20)]
      [1.0, 0.5, 0.25]
      >>> lr = ft.optim.exponential_decay(1.0, 10, 0.5, staircase=True)
      >>> [float(lr(ctx.replace(step=s))) for s in (0, 5, 10, 15, 20)]
      [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    check_argument("exponential_decay", "transition_steps", transition_steps, transition_steps > 0, "> 0",
                 f"optax reads {transition_steps!r} as no decay at all (init_value at every step)", "1000",
                 f"{init_value!r}, ")
    check_argument("exponential_decay", "decay_rate", decay_rate,
                   np.isfinite(decay_rate) and decay_rate >= 0, "finite and >= 0",
                   "a negative base's fractional powers are NaN (without staircase: every rate after the "
                   "first, silently) and its whole powers alternate in sign (staircase=True: a rate that "
                   "climbs the loss every other transition)", "0.5", f"{init_value!r}, {transition_steps!r}, ")
    at = schedule(
        optax.exponential_decay(init_value, transition_steps, decay_rate, staircase=staircase, end_value=end_value),
        unit,
    )
    ends = (init_value,) if end_value is None else (init_value, end_value)
    return _recorded(at, ends, lambda w: (
        f"ft.optim.exponential_decay({w(init_value)}, {transition_steps!r}, {decay_rate!r}"
        + (", staircase=True" if staircase else "") + ("" if end_value is None else f", end_value={w(end_value)}")
        + f"{_unit(unit)})"))


def cosine_decay(
    init_value: float, decay_steps: int, alpha: float = 0.0, *, unit: str = "steps"
) -> Callable[[LearningContext], Any]:
    """``init · ((1-α)·½(1 + cos(π c / decay_steps)) + α)`` (``optax.cosine_decay_schedule``).

    ``c`` is capped at ``decay_steps``: the value stays at ``α · init`` afterwards. torch's
    ``CosineAnnealingLR(opt, T_max=decay_steps, eta_min=α · init)`` gives the same rates up
    to ``decay_steps`` and then keeps following the cosine, back up to ``init`` at
    ``2 · decay_steps``; its warm restarts (``CosineAnnealingWarmRestarts``) are
    ``optax.sgdr_schedule`` or ``optax.join_schedules`` of cosine decays, through
    :func:`schedule`.

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.cosine_decay(1.0, 100, alpha=0.1), ft.optim.initial_context()
      >>> [round(float(lr(ctx.replace(step=s))), 4) for s in (0, 50, 100, 150)]
      [1.0, 0.55, 0.1, 0.1]
    """
    at = schedule(optax.cosine_decay_schedule(init_value, decay_steps, alpha), unit)
    return _recorded(at, (init_value,), lambda w: (
        f"ft.optim.cosine_decay({w(init_value)}, {decay_steps!r}" + (f", alpha={alpha!r}" if alpha else "")
        + f"{_unit(unit)})"))


def linear_warmup(
    peak_value: float, warmup_steps: int, init_value: float = 0.0, *, unit: str = "steps"
) -> Callable[[LearningContext], Any]:
    """Linear from ``init_value`` to ``peak_value`` over ``warmup_steps``, then constant.

    .. math:: v(c) = v_0 + (v_{peak} - v_0) \\min(c / \\text{warmup\\_steps}, 1)

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.linear_warmup(1.0, 4), ft.optim.initial_context()
      >>> [float(lr(ctx.replace(step=s))) for s in range(6)]
      [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]

    ``warmup_steps=0`` is no warmup: ``peak_value`` from the first step (Hugging Face's
    ``get_constant_schedule_with_warmup(opt, 0)``; optax's ``linear_schedule`` with no
    transition steps stays at ``init_value``).
    """
    check_argument("linear_warmup", "warmup_steps", warmup_steps, warmup_steps >= 0, ">= 0",
                 "the steps (or samples, sweeps) before the peak; 0 is no warmup", "0", f"{peak_value!r}, ")
    if warmup_steps == 0:
        at = schedule(optax.constant_schedule(peak_value), unit)
    else:
        at = schedule(optax.linear_schedule(init_value, peak_value, warmup_steps), unit)
    return _recorded(at, (init_value, peak_value), lambda w: (
        f"ft.optim.linear_warmup({w(peak_value)}, {warmup_steps!r}"
        + (f", init_value={w(init_value)}" if init_value else "") + f"{_unit(unit)})"))


def warmup_cosine_decay(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
    end_value: float = 0.0, *, unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """Linear warmup to ``peak_value``, then cosine decay to ``end_value`` at ``decay_steps``.

    Example:
      >>> import functree as ft
      >>> lr = ft.optim.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=100)
      >>> float(lr(ft.optim.initial_context().replace(step=10)))
      1.0
    """
    at = schedule(
        optax.warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value),
        unit,
    )
    return _recorded(at, (init_value, peak_value, end_value), lambda w: (
        f"ft.optim.warmup_cosine_decay({w(init_value)}, {w(peak_value)}, {warmup_steps!r}, {decay_steps!r}"
        + (f", {w(end_value)}" if end_value else "") + f"{_unit(unit)})"))


def inverse_time_decay(init_value: float, decay: float, *, unit: str = "steps") -> Callable[[LearningContext], Any]:
    """swift-apis' learning-rate ``decay``: ``init_value / (1 + decay · c)``.

    With ``unit="steps"``, ``c`` is the number of the update being made, 1 for the first:
    swift-apis (and seed 000's Adam) increment the step before reading the rate, so the
    first three updates take ``η/2, η/3, η/4`` at ``decay=1``. With ``"sweeps"`` or
    ``"samples"`` it is the count so far (0 in the first sweep).

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.inverse_time_decay(1.0, 1.0), ft.optim.initial_context()
      >>> [float(lr(ctx.replace(step=s))) for s in (0, 1, 2)]     # updates 1, 2, 3
      [0.5, 0.3333333432674408, 0.25]
      >>> lr = ft.optim.inverse_time_decay(1.0, 1.0, unit="sweeps")
      >>> [float(lr(ctx.replace(sweep=s))) for s in (0, 1, 3)]
      [1.0, 0.5, 0.25]
    """
    _check_unit(unit)
    check_argument("inverse_time_decay", "decay", decay, decay >= 0, ">= 0",
                 f"1 + {decay!r}·c reaches 0 at c = {(-1 / decay) if decay < 0 else 0:.4g}, an infinite rate, "
                 "and is negative after it (a rate that climbs the loss)", "1e-4", f"{init_value!r}, ")
    ahead = 1.0 if unit == "steps" else 0.0

    def rate(ctx: LearningContext) -> jax.Array:
        return init_value / (1.0 + decay * (counter(ctx, unit).astype(_float()) + ahead))

    return _recorded(rate, (init_value,), lambda w: f"ft.optim.inverse_time_decay({w(init_value)}, {decay!r}{_unit(unit)})")
