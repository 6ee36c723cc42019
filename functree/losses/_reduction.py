"""Reductions and input checks shared by the losses."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import first_index, short_array
from functree.losses._weighted import WeightedMean

__all__ = ["reduce", "check_same_shape", "check_float", "check_reduction", "first_outside", "in_compute_dtype", "reduced", "REDUCTIONS"]

HALF_PRECISION = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
"""The dtypes a loss computes in float32, returning a float32 loss (torch's autocast runs its
losses in float32; Hugging Face's loss functions take ``logits.float()``): a float16 loss
times a loss scale of 65536 is ``inf``, and bfloat16 sums lose the examples' small terms."""

REDUCTIONS = ("mean", "sum", "none", "weighted")
"""The ``reduction=`` every loss takes: ``"mean"`` (the default) over every element,
``"sum"``, ``"none"``: the per-element losses, shaped like the inputs (less a class axis),
or ``"weighted"``: the mean as its parts, ``ft.losses.WeightedMean(sum, count)`` (count:
the elements, or the kept positions of a loss that ignores some), which
``ft.optim.Optimizer(accumulate=k)`` combines exactly over microbatches.

Example:
  >>> import functree as ft, jax.numpy as jnp
  >>> ft.losses.REDUCTIONS
  ('mean', 'sum', 'none', 'weighted')
  >>> ft.losses.l1(jnp.array([1.0, 3.0]), jnp.zeros(2), reduction="none")
  Array([1., 3.], dtype=float32)
  >>> ft.losses.l1(jnp.array([1.0, 3.0]), jnp.zeros(2), reduction="weighted").value
  Array(2., dtype=float32)
"""

BAD_REDUCTION = """\
{loss}: reduction must be one of {choices}, got {given!r}.

    wrong:  ft.losses.{loss}(predicted, expected, reduction={given!r})
    right:  ft.losses.{loss}(predicted, expected, reduction="mean")
"""

SHAPE_MISMATCH = """\
{loss}: predicted and expected must have the same shape; expected {expected_shape}, got \
predicted {given}. Broadcasting them would silently compare every prediction with every \
target. Reshape one of them:

    wrong:  ft.losses.{loss}(model(x), y)               # e.g. f32[32,1] vs f32[32]
    right:  ft.losses.{loss}(model(x).reshape(y.shape), y)
"""

NOT_FLOAT = """\
{loss}: {what} must be a floating array, got {given}.

    wrong:  ft.losses.{loss}({example})
    right:  ft.losses.{loss}({fixed})
"""


def _describe(x: Any) -> str:
    return short_array(x) if hasattr(x, "dtype") else f"{type(x).__name__} {jnp.shape(x)}"


def _array(x: Any) -> Any:
    """``x`` as an array without a program: a JAX or NumPy array as it is, anything else
    through NumPy (``jnp.asarray`` of host data compiles one per new shape; the compiled
    kernels take NumPy arrays as JAX's own, float64 as float32 unless x64 is on)."""
    return x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)


def check_float(loss: str, what: str, x: Any) -> Any:
    """``x`` as an array (:func:`_array`) in its own dtype, or a clear error if it is not
    floating. The compiled kernel computes in :func:`in_compute_dtype` (float32 for float16
    and bfloat16; the gradient flows back through the cast in ``x``'s own dtype)."""
    x = _array(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            NOT_FLOAT.format(
                loss=loss, what=what, given=_describe(x),
                example=f"{what}, ..." if what == "predicted" else f"..., {what}",
                fixed=f"{what}.astype(jnp.float32), ..." if what == "predicted" else f"..., {what}.astype(jnp.float32)",
            )
        )
    return x


def in_compute_dtype(x: jax.Array) -> jax.Array:
    """``x`` in the dtype a loss computes in: float32 for float16 and bfloat16
    (:data:`HALF_PRECISION`), else its own."""
    return x.astype(jnp.float32) if x.dtype in HALF_PRECISION else x


def check_reduction(loss: str, reduction: Any) -> None:
    """:data:`BAD_REDUCTION` unless ``reduction`` is one of :data:`REDUCTIONS` (checked before
    a compiled kernel takes it as a static option)."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(BAD_REDUCTION.format(loss=loss, choices=list(REDUCTIONS), given=reduction))


def check_same_shape(loss: str, predicted: Any, expected: Any) -> tuple[Any, Any]:
    """Both as arrays, ``predicted`` floating (:func:`check_float`), or an error naming both
    shapes. Their dtypes as given: :func:`reduced` computes in ``predicted``'s (float32 for
    a half-precision one)."""
    predicted = check_float(loss, "predicted", predicted)
    expected = _array(expected)
    if predicted.shape != expected.shape:
        raise ValueError(
            SHAPE_MISMATCH.format(
                loss=loss,
                expected_shape=f"{_describe(expected)} ({list(expected.shape)})",
                given=_describe(predicted),
            )
        )
    return predicted, expected


def reduced(loss: str, terms: Callable[..., jax.Array], reduction: str, predicted: jax.Array, expected: jax.Array,
            *extra: Any) -> Any:
    """``reduce(loss, terms(p, e, *extra), reduction)`` with ``p`` ``predicted`` in its compute
    dtype (:func:`in_compute_dtype`) and ``e`` ``expected`` in ``p``'s: one compiled program
    per shapes, ``terms`` and ``reduction`` (called eagerly, each operation was a program of
    its own, compiled at each new shape), inlined into a caller's own ``jax.jit``. ``terms``
    is a module-level function (the compiled program's key); ``extra``, arrays or None.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.losses._reduction import reduced
      >>> def absolute(p, e):
      ...     return jnp.abs(p - e)
      >>> reduced("l1", absolute, "sum", jnp.array([1.0, -3.0]), jnp.array([0, 0]))
      Array(4., dtype=float32)
    """
    check_reduction(loss, reduction)
    return _reduced(loss, terms, reduction, predicted, expected, *extra)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _reduced(loss: str, terms: Callable[..., jax.Array], reduction: str, predicted: jax.Array, expected: jax.Array,
             *extra: Any) -> Any:
    predicted = in_compute_dtype(predicted)
    return reduce(loss, terms(predicted, expected.astype(predicted.dtype), *extra), reduction)


def reduce(loss: str, values: jax.Array, reduction: str) -> Any:
    """``mean``, ``sum``, ``none`` (the values unreduced) or ``weighted``
    (:class:`~functree.losses.WeightedMean` of their sum and number)."""
    if reduction == "mean":
        return jnp.mean(values)
    if reduction == "sum":
        return jnp.sum(values)
    if reduction == "none":
        return values
    if reduction == "weighted":
        return WeightedMean(jnp.sum(values), jnp.asarray(values.size, values.dtype))
    raise ValueError(BAD_REDUCTION.format(loss=loss, choices=list(REDUCTIONS), given=reduction))


def first_outside(x: Any, low: float, high: float) -> tuple[str, float] | None:
    """Where concrete ``x`` first holds a value outside ``[low, high]`` (``"[i, j]"``; ``""``
    for a scalar) and that value, or None (none, or ``x`` traced under ``jax.jit`` or
    ``jax.grad``: not checked)."""
    try:
        given = np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    bad = (given < low) | (given > high)
    if not bad.any():
        return None
    where = first_index(bad)
    return (str(list(where)) if where else ""), float(given[where])
