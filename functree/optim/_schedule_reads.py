"""What the rate check (:mod:`functree.optim._rate`) reads of a learning-rate schedule: its
value at step 0 and the value it holds at its end.

optax's own schedule constructors (``constant_schedule``, ``polynomial_schedule`` and so
``linear_schedule`` and ``warmup_constant_schedule``, ``cosine_decay_schedule``,
``exponential_decay``, ``piecewise_constant_schedule``, ``piecewise_interpolate_schedule`` and
so the one-cycle schedules, ``join_schedules`` and so ``warmup_cosine_decay_schedule``,
``warmup_exponential_decay_schedule`` and ``sgdr_schedule``) are read from the numbers their
closures hold, with no program compiled: the first step of a model trained with
``optax.adam(optax.warmup_cosine_decay_schedule(...))`` pays nothing for the check. Only where
every number is >= 0 (the schedule is then >= 0 at every step: each of these lies between its
numbers) and the closure holds exactly the variables this optax's does; anything else (a
negative number, a sign that turns, another version's closure, a user's function) is
evaluated at :data:`COUNTS`, one program compiled for the CPU. The step a schedule turns at,
only in a refusal's message, is evaluated then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._tree import WeakIdentity, bounded_put, cached

# The step counts a schedule is read at: each of the first 4096, then spaced out to int32's
# largest (optax's counts saturate there), 5% apart; the last HELD (from 4e8 on) read whether
# it holds one value at its end (a line still falling there does not).
COUNTS = np.unique(np.concatenate([np.arange(4096), np.geomspace(4096, np.iinfo(np.int32).max, 256).astype(np.int64)]
                                  )).astype(np.int32)
HELD = 32
_HELD_FROM = int(COUNTS[-HELD])  # a schedule constant from this step on holds its end
ROUNDING = 1e-5  # a schedule's values this small next to its largest are 0 (float32's rounding)
_NEAR = (0.5 * ROUNDING, 2 * ROUNDING)  # a derived value this close to ROUNDING: float32 decides, evaluated
_DEPTH = 16  # join_schedules inside join_schedules ...
_READS: dict[Any, Any] = {}  # schedule -> (its Read, or None,)
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Read:
    """A schedule's value at step 0 and the value it holds at its end (None: still changing
    there, or 0), each 0 where it is within float32's rounding of 0 next to its largest
    (:data:`ROUNDING`); ``values``: at :data:`COUNTS` where it was evaluated."""

    start: float
    end: float | None
    values: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A derived schedule: its value at step 0, the value it is constant at from step
    ``held_from``, and its largest value (or a bound above it)."""

    start: float
    end: float
    held_from: float
    largest: float


def schedule_read(fn: Any) -> Read | None:
    """``fn``'s :class:`Read`, once per schedule: derived where it is one of optax's
    (:func:`_derived`), else evaluated (:func:`evaluated`); None where it cannot be evaluated
    on concrete counts or is not one finite number per count."""
    try:
        key, found = cached(_READS, WeakIdentity(fn))
    except TypeError:  # a schedule taking no weak reference: read, never cached
        key, found = None, None
    if found is None:
        found = (_read(fn),)
        if key is not None:
            bounded_put(_READS, key, found)
    return found[0]


def _read(fn: Any) -> Read | None:
    piece = _derived(fn, 0)
    if piece is not None and (read := _rounded(piece)) is not None:
        return read
    values = evaluated(fn)
    if values is None:
        return None
    held = bool(np.all(values[-HELD:] == values[-1])) and values[-1] != 0
    return Read(float(values[0]), float(values[-1]) if held else None, values)


def _rounded(piece: _Piece) -> Read | None:
    """The :class:`Read` of a derived schedule, its values within :data:`ROUNDING` of 0 as 0;
    None (evaluated) where one is so close to that bound that float32's rounding decides, or
    where it is still changing at the steps read for its end."""
    ratios = [value / piece.largest if piece.largest else 0.0 for value in (piece.start, piece.end)]
    if piece.held_from > _HELD_FROM or any(_NEAR[0] <= ratio <= _NEAR[1] for ratio in ratios):
        return None
    start, end = (value if ratio > ROUNDING else 0.0 for value, ratio in zip((piece.start, piece.end), ratios))
    return Read(start, end or None)


def evaluated(fn: Any) -> np.ndarray | None:
    """``fn`` at :data:`COUNTS` (int32, as optax counts), computed concretely (also while a
    step traces) as one program for the CPU (on a GPU machine too), vectorized over the
    counts; None where that fails (a Python condition on the count, a value closed over from
    a trace) or is not one finite number per count. A value within :data:`ROUNDING` of 0 next
    to the largest is 0 (float32's rounding of a line ending at 0)."""
    try:
        with jax.ensure_compile_time_eval(), jax.numpy_dtype_promotion("standard"):
            counts = jax.device_put(COUNTS, jax.devices("cpu")[0])
            values = np.asarray(jax.jit(jax.vmap(fn))(counts), dtype=float)
    except Exception:  # not a function of a traced count alone: no verdict
        return None
    if values.shape != COUNTS.shape or not np.all(np.isfinite(values)):
        return None
    # float32 rounding of a line ending at 0 (optax.linear_schedule(1e-2, 0, 10): -1.5e-10) is 0
    return np.where(np.abs(values) <= ROUNDING * np.max(np.abs(values)), 0.0, values)


def turning_step(read: Read, fn: Any, sign: int) -> int | None:
    """The step from which ``fn`` keeps the sign of its held end (``sign``), for a
    refusal's message: evaluated now where it was derived; None where that fails."""
    values = read.values if read.values is not None else evaluated(fn)
    if values is None:
        return None
    other = np.flatnonzero(np.sign(values) != sign)
    return 0 if other.size == 0 else int(COUNTS[min(other[-1] + 1, COUNTS.size - 1)])


def _cells(fn: Any) -> dict[str, Any]:
    """The variables ``fn`` closes over that hold a value (optax's ``exponential_decay``
    leaves ``clip_fn`` unset without an ``end_value``)."""
    found = {}
    for name, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):  # (an empty cell: left out)
            found[name] = cell.cell_contents
    return found


def _number(value: Any) -> float | None:
    """A number given to an optax schedule, >= 0 and finite, as a float (a Python or NumPy
    number, a concrete one-value array of float32 or wider); None for anything else."""
    if isinstance(value, (bool, np.bool_, Tracer)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # an outer trace's value: not a number here
        return None
    if array.shape != () or array.dtype.kind not in "iuf" or (array.dtype.kind == "f" and array.dtype.itemsize < 4):
        return None
    number = float(array)
    return number if math.isfinite(number) and number >= 0 else None


def _numbers(env: dict[str, Any], *names: str) -> list[float] | None:
    return _every([_number(env.get(name)) for name in names])


def _every(found: list[_T | None]) -> list[_T] | None:
    """``found`` where none of it is None, else None."""
    kept = [f for f in found if f is not None]
    return kept if len(kept) == len(found) else None


def _derived(fn: Any, depth: int) -> _Piece | None:
    """The :class:`_Piece` of one of optax's schedule constructors (:data:`_READERS`, by the
    function that made it) whose closure holds exactly its variables, every number >= 0;
    None for anything else."""
    if depth > _DEPTH or not str(getattr(fn, "__module__", "") or "").startswith("optax."):
        return None
    reader = _READERS.get(str(getattr(fn, "__qualname__", "")))
    env = _cells(fn)
    if reader is None or frozenset(env) not in reader[0]:
        return None
    try:
        return reader[1](env, depth)
    except (TypeError, ValueError, ArithmeticError):  # a value of another kind than optax's: evaluated
        return None


def _constant(env: dict[str, Any], depth: int) -> _Piece | None:
    """``constant_schedule``, and ``polynomial_schedule``'s and ``exponential_decay``'s
    constant (no steps, or no decay): the one number."""
    (value,) = _numbers(env, *env) or [None]
    return None if value is None else _Piece(value, value, 0, value)


def _polynomial(env: dict[str, Any], depth: int) -> _Piece | None:
    """``(init - end) * (1 - t)**power + end``, t from 0 to 1 over its steps, then held: its
    values lie between ``init`` and ``end`` (power > 0)."""
    numbers = _numbers(env, "init_value", "end_value", "power", "transition_steps", "transition_begin")
    if numbers is None or numbers[2] <= 0 or numbers[3] <= 0:
        return None
    init, end, _, steps, begin = numbers
    return _Piece(init, end, math.ceil(begin + steps), max(init, end))


def _cosine(env: dict[str, Any], depth: int) -> _Piece | None:
    """``init * ((1 - alpha) * c**exponent + alpha)``, c from 1 to 0 over its steps, then held:
    between ``init`` and ``init * alpha``."""
    numbers = _numbers(env, "init_value", "decay_steps", "alpha", "exponent")
    if numbers is None or numbers[1] <= 0 or numbers[3] <= 0:
        return None
    init, steps, alpha, _ = numbers
    return _Piece(init, init * alpha, math.ceil(steps), init * max(1.0, alpha))


def _exponential(env: dict[str, Any], depth: int) -> _Piece | None:
    """``max(init * rate**p, end_value)``, p the steps since its begin over its transition
    steps (floored with staircase), a rate in (0, 1): it falls from its start. Held at
    ``end_value`` from the step it is surely below half of it, else at 0 from the step it is
    surely within rounding of 0 (100 times under it; p taken one transition short, for
    float32's count and the floor)."""
    numbers = _numbers(env, "init_value", "transition_steps", "decay_rate", "transition_begin")
    floor = None if env["end_value"] is None else _number(env["end_value"])
    if numbers is None or not 0 < numbers[2] < 1 or numbers[1] <= 0 or not isinstance(env["staircase"], bool) or (
            env["end_value"] is not None and (floor is None or env.get("clip_fn") is not jnp.maximum)):
        return None
    init, steps, rate, begin = numbers
    start, rate = max(init, floor or 0.0), float(np.float32(rate))  # (as optax computes it: 1 - 1e-9 is 1)
    tiny = 1e-2 * ROUNDING * start
    end, below = (floor, 0.5 * floor) if floor and floor > tiny else (0.0, tiny)
    if rate >= 1:
        return None
    power = 0.0 if init <= below else math.log(below / init) / math.log(rate)  # init * rate**power == below
    return _Piece(start, end, math.ceil(begin + (power + 1) * steps / (1 - 1e-6)), start)


def _piecewise_constant(env: dict[str, Any], depth: int) -> _Piece | None:
    """``init`` times each scale (>= 0, optax checks) from its step on: at step 0 those at
    steps <= 0, held from the last."""
    init, given = _number(env["init_value"]), env["boundaries_and_scales"] or {}
    if init is None or not isinstance(given, dict) or not all(_is_step(step) for step in given):
        return None
    by_step = sorted((max(0, int(step)), scale) for step, scale in given.items())
    values = _running(init, [scale for _, scale in by_step])
    at_start = sum(1 for step, _ in by_step if step == 0)  # (those from step 0 on)
    return None if values is None else _Piece(values[at_start], values[-1], max([0] + [s for s, _ in by_step]),
                                              max(values[at_start:]))


def _piecewise_interpolated(env: dict[str, Any], depth: int) -> _Piece | None:
    """``init`` times the scales' running products at its steps (> 0), interpolated between
    them (linear or cosine: between the two), held from the last."""
    init, steps, scales = _number(env["init_value"]), list(env["boundaries"]), list(env["scales"])
    fn = str(getattr(env["interpolate_fn"], "__qualname__", ""))
    if init is None or len(steps) != len(scales) or fn not in ("_linear_interpolate", "_cosine_interpolate") or not all(
            _is_step(step) and step > 0 for step in steps) or steps != sorted(set(steps)):
        return None
    values = _running(init, scales)
    return None if values is None else _Piece(init, values[-1], max([0] + steps), max(values))


def _running(init: float, scales: list[Any]) -> list[float] | None:
    """``init`` and its running products with ``scales`` (numbers >= 0, else None)."""
    factors = _every([_number(scale) for scale in scales])
    return None if factors is None else [init * math.prod(factors[:k]) for k in range(len(factors) + 1)]


def _joined(env: dict[str, Any], depth: int) -> _Piece | None:
    """``join_schedules``: each schedule from its boundary on (counted from there), the last
    held where it holds; its largest bounded by the pieces' largest."""
    schedules, steps = list(env["schedules"]), list(env["boundaries"])
    if len(steps) != len(schedules) - 1 or not all(_is_step(s) and s >= 0 for s in steps) or steps != sorted(steps):
        return None
    pieces = _every([_derived(schedule, depth + 1) for schedule in schedules])
    if pieces is None:
        return None
    first, last = pieces[sum(1 for s in steps if s == 0)], pieces[-1]  # (at step 0: the last one starting there)
    return _Piece(first.start, last.end, last.held_from + max([0] + steps), max(p.largest for p in pieces))


def _is_step(value: Any) -> bool:
    """A step count as optax's constructors take one: an integer (a boundary, a threshold)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_CLIP = frozenset({"init_value", "end_value", "decay_rate", "transition_steps", "transition_begin", "staircase"})
# optax's constructors (the qualified name of the function each returns) -> (the variables its
# closure may hold, the reader)
_READERS = {
    "constant_schedule.<locals>.<lambda>": ({frozenset({"value"})}, _constant),
    "polynomial_schedule.<locals>.<lambda>": ({frozenset({"init_value"})}, _constant),
    "exponential_decay.<locals>.<lambda>": ({frozenset({"init_value"})}, _constant),
    "polynomial_schedule.<locals>.schedule": (
        {frozenset({"init_value", "end_value", "power", "transition_steps", "transition_begin"})}, _polynomial),
    "cosine_decay_schedule.<locals>.schedule": (
        {frozenset({"init_value", "decay_steps", "alpha", "exponent"})}, _cosine),
    "exponential_decay.<locals>.schedule": ({_CLIP, _CLIP | {"clip_fn"}}, _exponential),
    "piecewise_constant_schedule.<locals>.schedule": (
        {frozenset({"init_value", "boundaries_and_scales"})}, _piecewise_constant),
    "piecewise_interpolate_schedule.<locals>.schedule": (
        {frozenset({"init_value", "boundaries", "scales", "interpolate_fn"})}, _piecewise_interpolated),
    "join_schedules.<locals>.schedule": ({frozenset({"schedules", "boundaries"})}, _joined),
}
