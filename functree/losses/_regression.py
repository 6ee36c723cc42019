"""Regression losses with swift-apis' names and argument order ``(predicted, expected)``.

Every loss reduces with the mean by default (as optax users and Keras expect;
swift-apis summed ``l1``, ``l2`` and ``huber``: pass ``reduction="sum"`` for that).
``reduction="none"`` returns the elementwise values. float16 and bfloat16 inputs are
computed in float32, and the loss is float32 (torch's autocast; see :mod:`functree.losses`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree.losses._reduction import check_same_shape, first_outside, reduced

__all__ = [
    "mean_squared_error",
    "mean_absolute_error",
    "mean_squared_logarithmic_error",
    "mean_absolute_percentage_error",
    "l1",
    "l2",
    "huber",
    "smooth_l1",
    "log_cosh",
    "poisson",
]

BAD_DELTA = """\
huber: delta must be a positive number (the error at which the loss turns from quadratic to \
linear), got {given!r}: delta=0 made the loss 0 whatever the error and a negative delta a \
negative loss (torch's huber_loss refuses both). torch's smooth_l1_loss with beta=0 is the L1 \
loss:

    wrong:  ft.losses.huber(predicted, expected, delta={given!r})
    right:  ft.losses.huber(predicted, expected, delta=1.0)
       or:  ft.losses.l1(predicted, expected)
"""


NEGATIVE_RATES = """\
poisson: predicted must be rates (non-negative), but predicted{where} is {value}: log-rates, \
as torch's poisson_nll_loss takes them by default (log_input=True). The loss would be NaN, and \
log-rates that happen to be positive a silently wrong number. Give the rates:

    wrong:  ft.losses.poisson(log_rate, target)            # torch: F.poisson_nll_loss(log_rate, target)
    right:  ft.losses.poisson(jnp.exp(log_rate), target)
"""


def mean_squared_error(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean((predicted - expected)^2)``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.mean_squared_error(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]))
      Array(2.5, dtype=float32)
    """
    predicted, expected = check_same_shape("mean_squared_error", predicted, expected)
    return reduced("mean_squared_error", optax.squared_error, reduction, predicted, expected)


def mean_absolute_error(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(|predicted - expected|)``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.mean_absolute_error(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]))
      Array(1.5, dtype=float32)
    """
    predicted, expected = check_same_shape("mean_absolute_error", predicted, expected)
    return reduced("mean_absolute_error", _absolute_error, reduction, predicted, expected)


def l1(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(|predicted - expected|)``; swift-apis' ``l1Loss`` sums (``reduction="sum"``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.l1(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]))
      Array(1.5, dtype=float32)
      >>> ft.losses.l1(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]), reduction="sum")
      Array(3., dtype=float32)
    """
    predicted, expected = check_same_shape("l1", predicted, expected)
    return reduced("l1", _absolute_error, reduction, predicted, expected)


def l2(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean((predicted - expected)^2)`` (no factor 1/2, unlike ``optax.l2_loss``);
    swift-apis' ``l2Loss`` sums (``reduction="sum"``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.l2(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]))
      Array(2.5, dtype=float32)
      >>> ft.losses.l2(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]), reduction="sum")
      Array(5., dtype=float32)
    """
    predicted, expected = check_same_shape("l2", predicted, expected)
    return reduced("l2", optax.squared_error, reduction, predicted, expected)


def huber(predicted: Any, expected: Any, *, delta: float = 1.0, reduction: str = "mean") -> jax.Array:
    """Huber loss: with ``e = |predicted - expected|``, ``e^2 / 2`` if ``e <= delta`` else
    ``delta * (e - delta / 2)``, averaged (``optax.huber_loss``; swift-apis' ``huberLoss``
    sums: ``reduction="sum"``).

    ``delta`` must be positive (torch's ``huber_loss`` refuses the others; a delta of 0
    would make every loss 0). torch's ``smooth_l1_loss`` is ``huber(delta=beta) / beta``
    for ``beta > 0`` and ``l1`` for ``beta=0``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.huber(jnp.array([0.5, 3.0]), jnp.array([0.0, 0.0]))
      Array(1.3125, dtype=float32)
    """
    _check_delta(delta)
    predicted, expected = check_same_shape("huber", predicted, expected)
    return reduced("huber", _huber, reduction, predicted, expected, delta)


def _check_delta(delta: Any) -> None:
    """Raise :data:`BAD_DELTA` unless ``delta > 0``: at 0 every error is on the linear side,
    ``delta * (e - delta / 2) = 0``, and below it that is negative. A traced ``delta``
    cannot be read and is left as given."""
    try:
        value = float(np.asarray(delta))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if not value > 0:  # NaN too
        raise ValueError(BAD_DELTA.format(given=delta))


BAD_BETA = """\
smooth_l1: beta must be a non-negative Python number (the error below which the loss is \
quadratic), got {given!r} (torch refuses a negative beta too).

    wrong:  ft.losses.smooth_l1(predicted, expected, beta={given!r})
    right:  ft.losses.smooth_l1(predicted, expected, beta=1.0)      # beta=0: the L1 loss
"""


def smooth_l1(predicted: Any, expected: Any, *, beta: float = 1.0, reduction: str = "mean") -> jax.Array:
    """torch's ``smooth_l1_loss``: with ``e = |predicted - expected|``, ``e^2 / (2 beta)`` if
    ``e < beta`` else ``e - beta / 2``, averaged. It is ``huber(delta=beta) / beta`` for
    ``beta > 0`` and the L1 loss for ``beta = 0`` (torch's gradient there: ``sign(e)``, 0 at
    ``e = 0``). ``beta`` is a Python number (static), refused below 0 (:data:`BAD_BETA`).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.smooth_l1(jnp.array([0.5, 3.0]), jnp.array([0.0, 0.0]))
      Array(1.3125, dtype=float32)
      >>> ft.losses.smooth_l1(jnp.array([0.5, 3.0]), jnp.array([0.0, 0.0]), beta=2.0)
      Array(1.03125, dtype=float32)
    """
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, (int, float, np.integer, np.floating)) \
            or not beta >= 0:
        raise ValueError(BAD_BETA.format(given=beta))
    predicted, expected = check_same_shape("smooth_l1", predicted, expected)
    if not beta:
        return reduced("smooth_l1", _signed_absolute, reduction, predicted, expected)
    return reduced("smooth_l1", _smooth_l1, reduction, predicted, expected, float(beta))


def mean_squared_logarithmic_error(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean((log(1 + max(predicted, 0)) - log(1 + max(expected, 0)))^2)``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.mean_squared_logarithmic_error(jnp.array([0.0, 3.0]), jnp.array([0.0, 0.0]))
      Array(0.96090..., dtype=float32)
    """
    predicted, expected = check_same_shape("mean_squared_logarithmic_error", predicted, expected)
    return reduced("mean_squared_logarithmic_error", _squared_log_error, reduction, predicted, expected)


def mean_absolute_percentage_error(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """Keras's ``100 * mean(|expected - predicted| / max(|expected|, 1e-7))`` (``1e-7``:
    Keras's ``epsilon()``, in every dtype). The gradient at a zero error is 0 (``sign(0)``, as
    :func:`mean_absolute_error`'s and Keras's on TensorFlow or torch; ``jnp.abs``'s would be 1).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.mean_absolute_percentage_error(jnp.array([1.5, 1.0]), jnp.array([1.0, 2.0]))
      Array(50., dtype=float32)
    """
    predicted, expected = check_same_shape("mean_absolute_percentage_error", predicted, expected)
    return reduced("mean_absolute_percentage_error", _percentage_error, reduction, predicted, expected)


def log_cosh(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(log(cosh(predicted - expected)))``, computed stably (``optax.log_cosh``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.log_cosh(jnp.array([0.0, 1.0]), jnp.array([0.0, 0.0]))
      Array(0.21689..., dtype=float32)
    """
    predicted, expected = check_same_shape("log_cosh", predicted, expected)
    return reduced("log_cosh", optax.log_cosh, reduction, predicted, expected)


def poisson(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(predicted - expected * log(predicted))`` for positive rates ``predicted``.

    Concrete negative rates raise :data:`NEGATIVE_RATES` (log-rates, torch's default input);
    traced ones are not checked.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.poisson(jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]))
      Array(1.5, dtype=float32)
    """
    predicted, expected = check_same_shape("poisson", predicted, expected)
    negative = first_outside(predicted, 0, np.inf)
    if negative is not None:
        raise ValueError(NEGATIVE_RATES.format(where=negative[0], value=f"{negative[1]:g}"))
    return reduced("poisson", _poisson, reduction, predicted, expected)


# The losses' elementwise terms (module-level: each is the key of its compiled program, see
# functree/losses/_reduction.py's reduced), in the compute dtype.
def _absolute_error(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    return _signed_absolute(predicted, expected)  # torch's L1Loss gradient: 0 at a zero error (jnp.abs's is 1)


def _huber(predicted: jax.Array, expected: jax.Array, delta: Any) -> jax.Array:
    return optax.huber_loss(predicted, expected, delta=delta)


def _signed_absolute(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    error = predicted - expected
    return error * jnp.sign(error)  # |e| with torch's gradient sign(e): 0 at e = 0


def _smooth_l1(predicted: jax.Array, expected: jax.Array, beta: Any) -> jax.Array:
    error = predicted - expected
    absolute = _signed_absolute(predicted, expected)
    return jnp.where(absolute < beta, 0.5 * jnp.square(error) / beta, absolute - 0.5 * beta)


def _squared_log_error(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    return jnp.square(jnp.log1p(jnp.maximum(predicted, 0)) - jnp.log1p(jnp.maximum(expected, 0)))


def _percentage_error(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    floor = jnp.asarray(1e-7, predicted.dtype)  # Keras's backend.epsilon(), in every dtype (not finfo's eps)
    return 100 * _signed_absolute(predicted, expected) / jnp.maximum(jnp.abs(expected), floor)  # 0 grad at 0 error


def _poisson(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    return predicted - jax.scipy.special.xlogy(expected, predicted)
