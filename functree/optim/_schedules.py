"""Schedules: callables of the learning context, reusing optax's schedule numerics.

A schedule maps a :class:`~functree.optim.LearningContext` to a value. ``unit`` picks the
counter that drives it: ``"steps"`` (optimizer steps), ``"samples"`` (examples seen) or
``"sweeps"`` (epochs, advanced by :func:`~functree.optim.next_sweep`). A schedule in steps
also takes a plain step count, as optax's optimizers call one (``optax.sgd(ft.optim.cosine_decay(0.1, 1000))``):
``lr(n)`` is ``lr(initial_context().replace(step=n))`` (:func:`_as_context`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from functree.optim._arguments import check_argument
from functree.optim._context import (
    LOW_BITS,
    LearningContext,
    initial_context,
    samples_float32,
    samples_int64,
    x64,
)

__all__ = [
    "schedule",
    "constant",
    "piecewise",
    "exponential_decay",
    "cosine_decay",
    "linear_warmup",
    "warmup_cosine_decay",
    "inverse_time_decay",
    "one_cycle",
    "one_cycle_momentum",
    "cyclic",
    "cyclic_momentum",
    "cosine_warm_restarts",
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


FRACTIONAL_WARMUP = """\
ft.optim.{where}: warmup_steps={given!r} is not a whole number; the learning context counts \
{unit} in integers, so the rate is init_value at {one} 0 and reaches the peak only at \
{one} {ceil}, not after {given!r} {unit}{effect}.{hint} Give a whole count:

    wrong:  ft.optim.{where}({before}{given!r}{after})
    right:  {right}"""


NOT_A_COUNT = """\
{code} was called with {given}. A schedule takes a ft.optim.LearningContext or, as optax's \
schedules do, the count of steps taken: a whole number (a Python or NumPy int, an integer JAX \
array, traced too):

    wrong:  lr({wrong})
    right:  lr(100)                                                   # after 100 steps
       or:  lr(ft.optim.initial_context().replace(step=100))
"""

COUNT_OUT_OF_RANGE = """\
{code} was called with the step count {given}, outside the learning context's int32 steps \
[0, 2147483647] (it would wrap around, silently). Give the count of steps taken:

    right:  lr(100)
"""

COUNT_OF_ANOTHER_UNIT = """\
{code} counts {unit} (unit={unit!r}), and was called with a plain count ({given}), as optax's \
optimizers call a schedule: with the count of steps taken, not of {unit}; that count read as \
{unit} would give the wrong values, silently. Give the schedule to a functree optimizer, which \
passes the learning context (its {unit} counted), or count in steps:

    wrong:  optax.adam({code})
    right:  ft.optim.adam({code})
       or:  ft.optim.inject("adam", lambda learning_rate: optax.adam(learning_rate),
                            {{"learning_rate": {code}}})   # any optax optimizer
       or:  optax.adam(...)   # the schedule built in steps: its lengths in steps, unit="steps"{per}
"""

_PER_STEP = {"sweeps": " (a sweep is steps_per_sweep steps)", "samples": " (minibatch_size samples a step)"}


def _code(fn: Any) -> str:
    """``fn``'s constructor call as code (its recorded one, or :func:`schedule`'s name)."""
    recorded = values_of(fn)
    if recorded is not None:
        return recorded[1](repr)
    name = getattr(fn, "__qualname__", "lr")
    return f"ft.optim.{name}" if name.startswith("schedule(") else name


def _given(x: Any) -> str:
    """What a schedule was called with, in words (its type, and value or shape)."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is not None and shape is not None:
        return f"an array of dtype {dtype} and shape {tuple(shape)}"
    text = repr(x)
    kind = type(x).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({text if len(text) <= 60 else text[:57] + '...'})"


def _as_context(x: Any, unit: str, fn: Any) -> LearningContext:
    """``x`` if a learning context; an integer count (optax's call: the steps taken) as the
    context :func:`~functree.optim.initial_context` ``.replace(step=x)``, stacked along a
    count's axes. :data:`COUNT_OF_ANOTHER_UNIT` for a schedule in samples or sweeps (the
    count is of steps), :data:`NOT_A_COUNT` for anything else (a float, a dict), where the
    schedule failed deep inside with an attribute error."""
    if isinstance(x, LearningContext):
        return x
    dtype = np.dtype(np.int64) if isinstance(x, int) else getattr(x, "dtype", None)
    if isinstance(x, (bool, np.bool_)) or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(NOT_A_COUNT.format(code=_code(fn), given=_given(x), wrong=repr(x) if len(repr(x)) <= 30 else "..."))
    if unit != "steps":
        raise TypeError(COUNT_OF_ANOTHER_UNIT.format(code=_code(fn), unit=unit, given=_given(x), per=_PER_STEP[unit]))
    if not isinstance(x, Tracer):
        host = [x] if isinstance(x, int) else np.asarray(x).ravel().tolist()
        if any(not 0 <= n <= np.iinfo(np.int32).max for n in host):
            raise ValueError(COUNT_OUT_OF_RANGE.format(code=_code(fn), given=x))
    steps = jnp.asarray(x)
    start = initial_context()  # (its counters' layout and defaults, stacked along the count's axes)
    stacked = LearningContext(jnp.broadcast_to(start.counters, (*steps.shape, start.counters.shape[-1])),
                              jnp.broadcast_to(start.loss, steps.shape))
    return stacked.replace(step=steps)


def _check_warmup(where: str, warmup_steps: Any, unit: str, before: str, after: str,
                  swapped: str | None = None) -> None:
    """:data:`FRACTIONAL_WARMUP` for a warmup of a fraction of a sweep (``0.5`` sweeps held
    the rate at ``init_value``, 0.0 by default, through the whole first sweep: the context
    counts whole sweeps) or of less than one step or sample: :func:`linear_warmup` given
    ``optax.linear_schedule``'s order
    (``linear_warmup(0.0, 1e-3, 1000)``: a rate of 1000 at the first step, 0.0 after it),
    whose call in its own order is ``swapped``."""
    check_argument(where, "warmup_steps", warmup_steps, bool(np.isfinite(warmup_steps)), "finite",
                   "the count of steps (or samples, sweeps) before the peak", "1000", before)
    sweeps = unit == "sweeps"
    small = not sweeps and warmup_steps < 1
    if float(warmup_steps) == int(warmup_steps) or not (sweeps or small):
        return  # steps and samples past one: optax's ramp min(s, w) / w is continuous (HF's: 0.06 * total)
    effect = " (the whole first sweep at init_value)" if sweeps else ""
    if sweeps:
        hint = " A part of a sweep is a count of steps."
    elif small and where == "linear_warmup":
        hint = (" A warmup below one step looks like optax.linear_schedule's order (init_value, end_value, "
                "transition_steps); linear_warmup takes (peak_value, warmup_steps, init_value).")
    else:
        hint = ""
    if sweeps:
        right = (f"ft.optim.{where}({before}round({warmup_steps!r} * steps_per_sweep)"
                 f"{after.replace(f', unit={unit!r}', '')})   # the steps of that part of a pass over the data")
    elif small and swapped is not None:
        right = swapped
    else:
        right = f"ft.optim.{where}({before}{int(np.ceil(warmup_steps))}{after})"
    raise ValueError(FRACTIONAL_WARMUP.format(
        where=where, given=warmup_steps, unit=unit, one=unit[:-1], ceil=int(np.ceil(warmup_steps)), effect=effect,
        hint=hint, before=before, after=after, right=right))


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
    """The context's int32 count in ``unit``; samples_seen's low word for ``"samples"`` (its
    count below 2³¹; :func:`by_count` reads past it)."""
    if unit == "steps":
        return ctx.step
    if unit == "sweeps":
        return ctx.sweep
    return ctx.counters[..., 2]


def by_count(ctx: LearningContext, unit: str, f: Callable[[jax.Array], Any]) -> Any:
    """``f`` of the context's count in ``unit``, exact in integers as far as the context keeps it.

    Steps and sweeps are int32. samples_seen is two int32 words (``high · 2³¹ + low``): under
    ``jax_enable_x64`` ``f`` takes it as int64; without x64 ``f`` takes the int32 low word
    while the high word is 0 (every job below 2³¹ samples: exact, as a count in steps) and
    the float32 ``high · 2³¹ + low`` past it (to 7 digits: the schedule goes on, where an
    int32 count wrapped negative and started the schedule over). Both are traced; a select
    takes one."""
    if unit != "samples":
        return f(counter(ctx, unit))
    if x64():
        return f(samples_int64(ctx.counters))
    exact = jnp.asarray(f(ctx.counters[..., 2]))  # the low word: the count while the high word is 0
    beyond = jnp.asarray(f(samples_float32(ctx.counters)))
    return jnp.where(ctx.counters[..., 4] == 0, exact, beyond.astype(exact.dtype))


def _length(count: int) -> Any:  # optax annotates its lengths int; it computes in floats too
    """A schedule's length for optax: as given, or a float past int32 (a warmup of 3e9
    samples), which JAX refuses as an int without x64 (optax then computes in floats)."""
    return count if abs(count) <= np.iinfo(np.int32).max else float(count)


def _int() -> Any:
    """JAX's default int: int64 under ``jax_enable_x64``, else int32."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


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
        ctx = _as_context(ctx, unit, at)
        # JAX's default int (int64 under x64): optax divides the count by Python numbers,
        # in float32 from an int32 count, in float64 from an int64 one. Samples past 2³¹ − 1
        # come as float32 without x64 (by_count): optax's schedules are float arithmetic.
        with jax.numpy_dtype_promotion("standard"):  # optax schedules mix int counts and floats
            return by_count(ctx, unit, lambda count: fn(count if count.dtype == jnp.float32 else count.astype(_int())))

    at.__qualname__ = f"schedule({getattr(fn, '__name__', 'fn')}, unit={unit!r})"
    at.__ft_schedule__ = (fn, unit)  # type: ignore[attr-defined]  # what it wraps: the rate check reads it
    return at


def constant(value: float) -> Callable[[LearningContext], Any]:
    """``value`` at every step (a schedule; a plain number is settable instead).

    Example:
      >>> import functree as ft
      >>> lr = ft.optim.constant(0.1)
      >>> lr(ft.optim.initial_context().replace(step=1000))
      Array(0.1, dtype=float32)
    """
    def at(ctx: LearningContext) -> jax.Array:
        _as_context(ctx, "steps", at)
        return jnp.asarray(value, _float())

    return _recorded(at, (value,), lambda w: f"ft.optim.constant({w(value)})")


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
    ends = np.cumsum(np.asarray(counts, np.int64))[:-1]
    values = np.asarray([float(v) for _, v in pairs], np.float64)
    # Compared exactly, as the context keeps them: samples_seen in its two words (past 2³¹ − 1
    # a float32 count would switch up to 2⁸ samples early), steps and sweeps in int32 (an
    # end past 2³¹ − 1 is one they never reach: held at the largest int32).
    low_ends = (ends & (2**LOW_BITS - 1)).astype(np.int32)
    high_ends = (ends >> LOW_BITS).astype(np.int32)
    int_ends = np.minimum(ends, np.iinfo(np.int32).max).astype(np.int32)

    def at(ctx: LearningContext) -> jax.Array:
        ctx = _as_context(ctx, unit, at)
        if unit == "samples":
            low, high = ctx.counters[..., 2:3], ctx.counters[..., 4:5]
            reached = (high > high_ends) | ((high == high_ends) & (low >= low_ends))
        else:
            reached = counter(ctx, unit)[..., None] >= int_ends
        return jnp.asarray(values, _float())[jnp.sum(reached, axis=-1)]

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
        optax.exponential_decay(init_value, _length(transition_steps), decay_rate, staircase=staircase,
                                end_value=end_value),
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
    ``2 · decay_steps``; its warm restarts (``CosineAnnealingWarmRestarts``, ``T_mult`` too)
    are :func:`cosine_warm_restarts`.

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.cosine_decay(1.0, 100, alpha=0.1), ft.optim.initial_context()
      >>> [round(float(lr(ctx.replace(step=s))), 4) for s in (0, 50, 100, 150)]
      [1.0, 0.55, 0.1, 0.1]
    """
    at = schedule(optax.cosine_decay_schedule(init_value, _length(decay_steps), alpha), unit)
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
    transition steps stays at ``init_value``). A warmup of ``w`` steps (or samples) takes
    ``init + (peak - init) * min(s, w) / w`` at step ``s``, a fraction in ``w`` too (HF's
    ``0.06 * total_steps``). A fraction of a sweep and a warmup below one step are refused
    (:data:`FRACTIONAL_WARMUP`): the context counts whole sweeps, so ``0.5`` sweeps held
    ``init_value`` through the whole first sweep, and ``linear_warmup(0.0, 1e-3, 1000)``
    (``optax.linear_schedule``'s order) stepped at a rate of 1000, then 0.
    """
    check_argument("linear_warmup", "warmup_steps", warmup_steps, warmup_steps >= 0, ">= 0",
                 "the steps (or samples, sweeps) before the peak; 0 is no warmup", "0", f"{peak_value!r}, ")
    whole_init = bool(np.isfinite(init_value)) and init_value >= 1 and float(init_value) == int(init_value)
    swapped = (f"ft.optim.linear_warmup({warmup_steps!r}, {int(init_value)}"  # the arguments in optax's order
               + (f", init_value={peak_value!r}" if peak_value else "") + f"{_unit(unit)})") if whole_init else None
    _check_warmup("linear_warmup", warmup_steps, unit, f"{peak_value!r}, ",
                  (f", init_value={init_value!r}" if init_value else "") + _unit(unit), swapped)
    if warmup_steps == 0:
        at = schedule(optax.constant_schedule(peak_value), unit)
    else:
        at = schedule(optax.linear_schedule(init_value, peak_value, _length(warmup_steps)), unit)
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
    _check_warmup("warmup_cosine_decay", warmup_steps, unit, f"{init_value!r}, {peak_value!r}, ",
                  f", {decay_steps!r}" + (f", {end_value!r}" if end_value else "") + _unit(unit))
    at = schedule(
        optax.warmup_cosine_decay_schedule(init_value, peak_value, _length(warmup_steps), _length(decay_steps),
                                           end_value),
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
        ctx = _as_context(ctx, unit, rate)
        return by_count(ctx, unit, lambda count: init_value / (1.0 + decay * (count.astype(_float()) + ahead)))

    return _recorded(rate, (init_value,), lambda w: f"ft.optim.inverse_time_decay({w(init_value)}, {decay!r}{_unit(unit)})")


# torch.optim.lr_scheduler's cycles: OneCycleLR, CyclicLR, CosineAnnealingWarmRestarts.

ANNEALS = ("cos", "linear")


def _options(**given: tuple[Any, Any]) -> str:
    """The keyword arguments given other than their defaults, as code (``", pct_start=0.25"``;
    a function as ``...``)."""
    return "".join(f", {name}={'...' if callable(value) else repr(value)}"
                   for name, (value, default) in given.items() if value is not default and value != default)


def _anneal(strategy: str, start: Any, end: Any, pct: jax.Array) -> jax.Array:
    """From ``start`` at ``pct`` 0 to ``end`` at 1: half a cosine or a line (torch's
    ``OneCycleLR`` anneals, in its order of operations)."""
    if strategy == "cos":
        return end + (start - end) / 2.0 * (jnp.cos(jnp.pi * pct) + 1)
    return (end - start) * pct + start


def _one_cycle_phases(total_steps: int, pct_start: float, three_phase: bool) -> list[float]:
    """The last count of each phase, as torch's (fractional where ``pct_start · total_steps``
    is): up to the peak, down (to the start, then to the end with ``three_phase``)."""
    up = float(pct_start * total_steps) - 1
    if three_phase:
        return [up, float(2 * pct_start * total_steps) - 2, float(total_steps - 1)]
    return [up, float(total_steps - 1)]


def _check_one_cycle(where: str, total_steps: int, pct_start: float, anneal_strategy: str, call: str) -> None:
    whole = isinstance(total_steps, (int, np.integer)) and not isinstance(total_steps, bool)
    check_argument(where, "total_steps", total_steps, whole and total_steps > 0, "a whole number > 0",
                   "the count (in `unit`) the cycle lasts", "1000", call)
    check_argument(where, "pct_start", pct_start, 0 <= pct_start <= 1, "in [0, 1]",
                   "the part of the cycle spent rising", "0.3", f"{call}{total_steps!r}, ")
    check_argument(where, "pct_start", pct_start, pct_start * total_steps != 1,
                   "not 1 / total_steps", "the rise would last no step: the first value is 0 / 0 (torch's "
                   "OneCycleLR raises ZeroDivisionError)", "0.3", f"{call}{total_steps!r}, ")
    check_argument(where, "anneal_strategy", anneal_strategy, anneal_strategy in ANNEALS, f"one of {ANNEALS}",
                   "half a cosine or a line between the turns", "'linear'", f"{call}{total_steps!r}, ")


def _phased(ends: list[float], starts: list[Any], stops: list[Any], anneal_strategy: str, unit: str,
            total_steps: int) -> Callable[[LearningContext], jax.Array]:
    """The value at a count: the first phase whose last count it has not passed (the last
    phase past them all), annealed from its start to its stop over its counts, as torch's
    ``OneCycleLR.get_lr``; counts after ``total_steps - 1`` hold the last value."""
    dtype = _float()

    def at(ctx: LearningContext) -> jax.Array:
        return by_count(_as_context(ctx, unit, at), unit, value)

    def value(count: jax.Array) -> jax.Array:
        step = jnp.minimum(count.astype(dtype), total_steps - 1)
        last = jnp.asarray(ends, dtype)
        index = jnp.argmax(jnp.append(step <= last[:-1], True))
        first = jnp.asarray([0.0, *ends[:-1]], dtype)[index]
        pct = (step - first) / (last[index] - first)
        return _anneal(anneal_strategy, jnp.asarray(starts, dtype)[index], jnp.asarray(stops, dtype)[index], pct)

    return at


def one_cycle(
    max_value: float, total_steps: int, *, pct_start: float = 0.3, anneal_strategy: str = "cos",
    div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False, unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """torch's ``OneCycleLR`` learning rate: up from ``max_value / div_factor`` to
    ``max_value``, then down to ``max_value / div_factor / final_div_factor``.

    With ``v₀ = max_value / div_factor`` and ``v_min = v₀ / final_div_factor``, the rise
    ends at count ``e₁ = pct_start · total_steps − 1`` and the fall at ``total_steps − 1``;
    in each phase from ``a`` (at count ``s``) to ``b`` (at ``e``), with ``p = (c − s)/(e − s)``:

    .. math:: v(c) = b + \\tfrac{a - b}{2}(\\cos(\\pi p) + 1) \\quad\\text{("cos")}, \\qquad
              v(c) = (b - a) p + a \\quad\\text{("linear")}

    ``three_phase=True`` rises to ``max_value`` until ``e₁``, falls back to ``v₀`` at
    ``2 · pct_start · total_steps − 2``, then to ``v_min`` at ``total_steps − 1``. The
    phases end at torch's fractional counts, so the rates are torch's: the ``k``-th update
    (count ``k``, from 0) takes the rate torch's optimizer holds after ``k`` calls of
    ``scheduler.step()``. Counts from ``total_steps`` on hold ``v_min``: torch's rate after
    ``total_steps`` calls continues the last anneal past its end (back above ``v_min``), and
    one more call raises. ``OneCycleLR(..., epochs=e, steps_per_epoch=n)`` is
    ``total_steps=e · n``.

    torch's ``OneCycleLR`` also cycles the momentum (``cycle_momentum=True`` by default: an
    ``SGD(lr)`` of momentum 0 trains with momentum 0.95 → 0.85 → 0.95), which is
    :func:`one_cycle_momentum` given as ``momentum`` of :func:`~functree.optim.sgd` (``beta1``
    of :func:`~functree.optim.adam`, as torch's ``betas[0]``)::

        ft.optim.sgd(ft.optim.one_cycle(0.1, 1000), momentum=ft.optim.one_cycle_momentum(1000))

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.one_cycle(1.0, 10), ft.optim.initial_context()
      >>> [round(float(lr(ctx.replace(step=s))), 5) for s in range(10)]
      [0.04, 0.52, 1.0, 0.95048, 0.81175, 0.61126, 0.38874, 0.18826, 0.04952, 0.0]
    """
    _check_unit(unit)
    _check_one_cycle("one_cycle", total_steps, pct_start, anneal_strategy, f"{max_value!r}, ")
    for name, factor, example in (("div_factor", div_factor, "25.0"), ("final_div_factor", final_div_factor, "1e4")):
        check_argument("one_cycle", name, factor, bool(np.isfinite(factor)) and factor > 0, "finite and > 0",
                       "the rate starts at max_value / div_factor and ends at that / final_div_factor",
                       example, f"{max_value!r}, {total_steps!r}, ")
    low = max_value / div_factor
    end = low / final_div_factor
    starts, stops = ([low, max_value, low], [max_value, low, end]) if three_phase else ([low, max_value], [max_value, end])
    at = _phased(_one_cycle_phases(total_steps, pct_start, three_phase), starts, stops, anneal_strategy, unit,
                 total_steps)
    # its values lie between max_value and the positive fractions of it
    options = _options(pct_start=(pct_start, 0.3), anneal_strategy=(anneal_strategy, "cos"),
                       div_factor=(div_factor, 25.0), final_div_factor=(final_div_factor, 1e4),
                       three_phase=(three_phase, False), unit=(unit, "steps"))
    return _recorded(at, (max_value,), lambda w: f"ft.optim.one_cycle({w(max_value)}, {total_steps!r}{options})")


def one_cycle_momentum(
    total_steps: int, base_momentum: float = 0.85, max_momentum: float = 0.95, *, pct_start: float = 0.3,
    anneal_strategy: str = "cos", three_phase: bool = False, unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """torch's ``OneCycleLR`` momentum (``cycle_momentum=True``): against the rate of
    :func:`one_cycle` of the same ``total_steps``, ``pct_start``, ``anneal_strategy``,
    ``three_phase``: down from ``max_momentum`` to ``base_momentum`` while the rate rises, back
    up while it falls (``three_phase``: held at ``max_momentum`` in the third phase).

    Give it as ``momentum`` of :func:`~functree.optim.sgd` (torch's ``SGD`` momentum) or
    ``beta1`` of :func:`~functree.optim.adam` / :func:`~functree.optim.adamw` (torch's
    ``betas[0]``; the bias correction ``1 − β₁ᵗ`` takes the step's β₁, as torch's).

    Example:
      >>> import functree as ft
      >>> m, ctx = ft.optim.one_cycle_momentum(10), ft.optim.initial_context()
      >>> [round(float(m(ctx.replace(step=s))), 5) for s in (0, 1, 2, 6, 9)]
      [0.95, 0.9, 0.85, 0.91113, 0.95]
      >>> tx = ft.optim.sgd(ft.optim.one_cycle(0.1, 10), momentum=ft.optim.one_cycle_momentum(10))
    """
    _check_unit(unit)
    _check_one_cycle("one_cycle_momentum", total_steps, pct_start, anneal_strategy, "")
    hi, lo = max_momentum, base_momentum
    starts, stops = ([hi, lo, hi], [lo, hi, hi]) if three_phase else ([hi, lo], [lo, hi])
    at = _phased(_one_cycle_phases(total_steps, pct_start, three_phase), starts, stops, anneal_strategy, unit,
                 total_steps)
    options = _options(pct_start=(pct_start, 0.3), anneal_strategy=(anneal_strategy, "cos"),
                       three_phase=(three_phase, False), unit=(unit, "steps"))
    return _recorded(at, (base_momentum, max_momentum), lambda w: (
        f"ft.optim.one_cycle_momentum({total_steps!r}, {w(base_momentum)}, {w(max_momentum)}{options})"))


CYCLIC_MODES = ("triangular", "triangular2", "exp_range")


def _cycled(low: float, high: float, step_size_up: float, step_size_down: float | None, mode: str, gamma: float,
            scale_fn: Callable[[jax.Array], Any] | None, scale_mode: str, unit: str,
            falling: bool) -> Callable[[LearningContext], jax.Array]:
    """torch's ``CyclicLR``: a triangle of ``step_size_up`` counts up and ``step_size_down``
    down, its height scaled by the mode's function of the cycle (from 1) or of the count;
    ``falling``: from ``high`` down (the momentum), else from ``low`` up (the rate)."""
    up = float(step_size_up)
    total = up + (up if step_size_down is None else float(step_size_down))
    ratio = up / total
    scale: Callable[[jax.Array], Any]
    if scale_fn is None:
        scale_mode = "iterations" if mode == "exp_range" else "cycle"
        scale = {"triangular": lambda x: 1.0, "triangular2": lambda x: 1 / (2.0 ** (x - 1)),
                 "exp_range": lambda x: gamma ** x}[mode]
    else:
        scale = scale_fn
    dtype = _float()
    whole = total.is_integer()  # whole step sizes (torch's ints): the cycle and its position in integers

    def at(ctx: LearningContext) -> jax.Array:
        return by_count(_as_context(ctx, unit, at), unit, value)

    def value(raw: jax.Array) -> jax.Array:
        count = raw.astype(dtype)
        if whole:
            # count / total in float32 lost the position in a cycle once count passed 2**24
            # (or count / total reached thousands): 4e-4 of the rate at 3e7 samples.
            cycle = (raw // int(total) + 1).astype(dtype)
            x = (raw % int(total)).astype(dtype) / total
        else:
            cycle = jnp.floor(1 + count / total)
            x = 1.0 + count / total - cycle
        factor = jnp.where(x <= ratio, x / ratio, (x - 1) / (ratio - 1))
        height = (high - low) * factor * jnp.asarray(scale(cycle if scale_mode == "cycle" else count), dtype)
        return high - height if falling else low + height

    return at


def _check_cyclic(where: str, step_size_up: float, step_size_down: float | None, mode: str,
                  scale_fn: Any, scale_mode: str, call: str) -> None:
    check_argument(where, "step_size_up", step_size_up, step_size_up > 0, "> 0",
                   "the counts (in `unit`) of the rise; torch's CyclicLR divides by it", "2000", call)
    check_argument(where, "step_size_down", step_size_down, step_size_down is None or step_size_down > 0,
                   "> 0 or None (as step_size_up)", "the counts of the fall; 0 divides by 0 at every peak", "None",
                   f"{call}{step_size_up!r}, ")
    check_argument(where, "mode", mode, scale_fn is not None or mode in CYCLIC_MODES, f"one of {CYCLIC_MODES}",
                   "the height of each cycle (or give scale_fn=)", "'triangular2'", f"{call}{step_size_up!r}, ")
    check_argument(where, "scale_mode", scale_mode, scale_mode in ("cycle", "iterations"),
                   "'cycle' or 'iterations'", "what scale_fn is a function of", "'iterations'",
                   f"{call}{step_size_up!r}, scale_fn=..., ")


def cyclic(
    base_value: float, max_value: float, step_size_up: float = 2000, step_size_down: float | None = None,
    mode: str = "triangular", gamma: float = 1.0, *, scale_fn: Callable[[jax.Array], Any] | None = None,
    scale_mode: str = "cycle", unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """torch's ``CyclicLR`` learning rate: triangles from ``base_value`` up to ``max_value``
    in ``step_size_up`` counts and down in ``step_size_down`` (``None``: as up).

    With ``T = up + down``, the cycle ``k = ⌊1 + c/T⌋`` and ``x = 1 + c/T − k``:

    .. math:: v(c) = v_{base} + (v_{max} - v_{base})\\,h(x)\\,s, \\qquad
              h(x) = x / r \\text{ for } x \\le r = up/T, \\text{ else } (x - 1)/(r - 1)

    where ``s`` is 1 (``"triangular"``), ``1 / 2^{k−1}`` (``"triangular2"``: each cycle half as
    high) or ``gamma^c`` (``"exp_range"``). ``scale_fn`` replaces it, a function of ``k``
    (``scale_mode="cycle"``) or ``c`` (``"iterations"``) taking and returning arrays.

    torch's ``CyclicLR`` also cycles the momentum by default (``cycle_momentum=True``, 0.9 →
    0.8 → 0.9: an ``SGD(lr)`` of momentum 0 trains with momentum): that is
    :func:`cyclic_momentum`, as ``momentum`` of :func:`~functree.optim.sgd` or ``beta1`` of
    :func:`~functree.optim.adam`.

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.cyclic(0.1, 0.5, 2, mode="triangular2"), ft.optim.initial_context()
      >>> [round(float(lr(ctx.replace(step=s))), 4) for s in range(9)]
      [0.1, 0.3, 0.5, 0.3, 0.1, 0.2, 0.3, 0.2, 0.1]
    """
    _check_unit(unit)
    _check_cyclic("cyclic", step_size_up, step_size_down, mode, scale_fn, scale_mode,
                  f"{base_value!r}, {max_value!r}, ")
    at = _cycled(base_value, max_value, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode, unit,
                 falling=False)
    options = _options(step_size_up=(step_size_up, 2000), step_size_down=(step_size_down, None), mode=(mode, "triangular"),
                       gamma=(gamma, 1.0), scale_fn=(scale_fn, None), scale_mode=(scale_mode, "cycle"),
                       unit=(unit, "steps"))
    return _recorded(at, (base_value, max_value), lambda w: f"ft.optim.cyclic({w(base_value)}, {w(max_value)}{options})")


def cyclic_momentum(
    base_momentum: float = 0.8, max_momentum: float = 0.9, step_size_up: float = 2000,
    step_size_down: float | None = None, mode: str = "triangular", gamma: float = 1.0, *,
    scale_fn: Callable[[jax.Array], Any] | None = None, scale_mode: str = "cycle", unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """torch's ``CyclicLR`` momentum (``cycle_momentum=True``): against the rate of
    :func:`cyclic` of the same arguments, from ``max_momentum`` down to ``base_momentum``
    while the rate rises, back up while it falls (the same triangles, the same scaling).

    Example:
      >>> import functree as ft
      >>> m, ctx = ft.optim.cyclic_momentum(step_size_up=2), ft.optim.initial_context()
      >>> [round(float(m(ctx.replace(step=s))), 4) for s in range(5)]
      [0.9, 0.85, 0.8, 0.85, 0.9]
      >>> tx = ft.optim.sgd(ft.optim.cyclic(1e-3, 1e-2, 2), momentum=ft.optim.cyclic_momentum(step_size_up=2))
    """
    _check_unit(unit)
    _check_cyclic("cyclic_momentum", step_size_up, step_size_down, mode, scale_fn, scale_mode,
                  f"{base_momentum!r}, {max_momentum!r}, ")
    at = _cycled(base_momentum, max_momentum, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode,
                 unit, falling=True)
    options = _options(step_size_up=(step_size_up, 2000), step_size_down=(step_size_down, None), mode=(mode, "triangular"),
                       gamma=(gamma, 1.0), scale_fn=(scale_fn, None), scale_mode=(scale_mode, "cycle"),
                       unit=(unit, "steps"))
    return _recorded(at, (base_momentum, max_momentum), lambda w: (
        f"ft.optim.cyclic_momentum({w(base_momentum)}, {w(max_momentum)}{options})"))


def cosine_warm_restarts(
    init_value: float, period: int, period_mult: int = 1, end_value: float = 0.0, *, unit: str = "steps",
) -> Callable[[LearningContext], Any]:
    """torch's ``CosineAnnealingWarmRestarts(opt, T_0=period, T_mult=period_mult,
    eta_min=end_value)``: cosine decays from ``init_value`` towards ``end_value``, restarted
    after ``period`` counts, each period ``period_mult`` times the one before.

    With ``t`` the counts since the last restart and ``T`` the current period:

    .. math:: v(c) = v_{end} + (v_0 - v_{end})\\,\\tfrac{1}{2}(1 + \\cos(\\pi t / T))

    torch's per-batch ``scheduler.step(epoch + i / iters)`` is ``period = T_0 · iters`` in
    steps (the same restarts; its rates to rounding).

    Example:
      >>> import functree as ft
      >>> lr, ctx = ft.optim.cosine_warm_restarts(1.0, 2, period_mult=2), ft.optim.initial_context()
      >>> [round(float(lr(ctx.replace(step=s))), 5) for s in range(7)]
      [1.0, 0.5, 1.0, 0.85355, 0.5, 0.14645, 1.0]
    """
    _check_unit(unit)
    whole = isinstance(period, (int, np.integer)) and not isinstance(period, bool)
    check_argument("cosine_warm_restarts", "period", period, whole and period > 0, "a whole number > 0",
                   "the counts (in `unit`) before the first restart", "1000", f"{init_value!r}, ")
    whole = isinstance(period_mult, (int, np.integer)) and not isinstance(period_mult, bool)
    check_argument("cosine_warm_restarts", "period_mult", period_mult, whole and period_mult >= 1,
                   "a whole number >= 1", "each period is period_mult times the last (torch's T_mult)", "2",
                   f"{init_value!r}, {period!r}, ")
    dtype = _float()
    if period_mult == 1:
        def position(count: jax.Array) -> tuple[jax.Array, jax.Array]:
            return count % period, jnp.asarray(period, dtype)
    else:
        starts, lengths = [0], [period]  # every restart that a count reaches (samples: 2⁶²)
        while starts[-1] + lengths[-1] < 2**62:
            starts.append(starts[-1] + lengths[-1])
            lengths.append(lengths[-1] * period_mult)

        def position(count: jax.Array) -> tuple[jax.Array, jax.Array]:
            # the restarts an int32 count reaches, in its dtype; every one for int64 or float32
            bound = 2**31 if count.dtype == jnp.int32 else 2**62
            reached = [s for s in starts if s < bound]
            index = jnp.sum(count >= jnp.asarray(reached[1:], count.dtype))
            return count - jnp.asarray(reached, count.dtype)[index], jnp.asarray(lengths, dtype)[index]

    def at(ctx: LearningContext) -> jax.Array:
        return by_count(_as_context(ctx, unit, at), unit, value)

    def value(count: jax.Array) -> jax.Array:
        since, length = position(count)
        ratio = since.astype(dtype) / length
        return end_value + (init_value - end_value) * (1 + jnp.cos(jnp.pi * ratio)) / 2

    return _recorded(at, (init_value, end_value), lambda w: (
        f"ft.optim.cosine_warm_restarts({w(init_value)}, {period!r}"
        + (f", period_mult={period_mult!r}" if period_mult != 1 else "")
        + (f", end_value={w(end_value)}" if end_value else "") + f"{_unit(unit)})"))
