"""torch's negative log-likelihood losses: :func:`nll` (of log-probabilities),
:func:`binary_cross_entropy` (of probabilities), :func:`gaussian_nll`, :func:`poisson_nll`,
each with torch's number (its clamps, its eps, its weighted mean) in ``(predicted,
expected)`` order, float16 and bfloat16 computed in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import short_array
from functree.losses._checks import check_indices, check_number, class_weight, element_weight
from functree.losses._classification import _ignore_index, _wide
from functree.losses._reduction import (
    _array,
    _describe,
    check_float,
    check_reduction,
    check_same_shape,
    first_outside,
    in_compute_dtype,
    reduce,
)
from functree.losses._weighted import WeightedMean, ratio

__all__ = ["nll", "binary_cross_entropy", "gaussian_nll", "poisson_nll"]

NOT_LOG_PROBABILITIES = """\
nll: log_probs must be log-probabilities (at most 0: log_softmax's output), but \
log_probs{where} is {value}: probabilities or logits. -log_probs[label] of them is silently \
another number (negative for probabilities). Take the log, or give the logits to the cross \
entropy:

    wrong:  ft.losses.nll(probs, labels)                         # or nll(logits, labels)
    right:  ft.losses.nll(jnp.log(probs), labels)
       or:  ft.losses.softmax_cross_entropy(logits, labels)    # = nll(jax.nn.log_softmax(logits), labels)
"""

NLL_LABEL_SHAPE = """\
nll: for log_probs {scores} (classes on the last axis), expected integer labels of shape \
{index_shape}, got {given}.{torch_layout}

    wrong:  ft.losses.nll(log_probs, labels)
    right:  {right}
"""

PROBABILITIES_OUTSIDE_UNIT = """\
binary_cross_entropy: {what} must be {rule} in [0, 1], but {what}{where} is {value}. {why}

    wrong:  ft.losses.binary_cross_entropy({wrong})
    right:  {right}
"""

VARIANCE_SHAPE = """\
gaussian_nll: variance {given} does not fit predicted {predicted}. torch's rules: the \
predicted shape {shape} (one variance each), that shape less its last axis {short} (one per \
row), the same rank with one axis of size 1 (shared along it), or a Python number (one for all).

    wrong:  ft.losses.gaussian_nll(mean, target, variance)          # variance {given}
    right:  ft.losses.gaussian_nll(mean, target, variance.reshape({shape}))
"""

NEGATIVE_VARIANCE = """\
gaussian_nll: variance must be non-negative (torch refuses a negative one too), but \
variance{where} is {value}: a log-variance or a standard deviation's raw output. Make it \
positive:

    wrong:  ft.losses.gaussian_nll(mean, target, raw)
    right:  ft.losses.gaussian_nll(mean, target, jax.nn.softplus(raw))     # or jnp.exp(log_variance)
"""

NEGATIVE_COUNTS = """\
poisson_nll: {what} must be {rule}, but {what}{where} is {value}. {why}

    wrong:  ft.losses.poisson_nll({wrong})
    right:  ft.losses.poisson_nll({right})
"""


def nll(log_probs: Any, labels: Any, *, weight: Any = None, ignore_index: int | None = -100,
        reduction: str = "mean") -> Any:
    """torch's ``nll_loss``: ``-w[y] * log_probs[..., y]`` per position, of log-probabilities
    ``[..., classes]`` (classes last) and integer labels ``[...]``.

    ``weight`` (``[classes]``) weighs each class; ``ignore_index`` (``-100`` as torch's; None
    for none) gives a position a loss of 0. The mean is torch's weighted mean over the kept
    positions, ``sum_i w[y_i] (-log p_i[y_i]) / sum_i w[y_i]`` (0 where nothing is kept, where
    torch's is NaN); ``"weighted"`` returns it as ``WeightedMean(total, sum of w[y])``. With
    ``log_probs = jax.nn.log_softmax(logits)`` this is ``softmax_cross_entropy(logits, labels,
    weight=weight)``. Concrete log-probabilities above 0 (probabilities, logits) raise
    :data:`NOT_LOG_PROBABILITIES`; a label outside the classes raises (traced: its loss is NaN).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> log_p = jnp.log(jnp.array([[0.5, 0.5], [0.9, 0.1]]))
      >>> ft.losses.nll(log_p, jnp.array([0, 0]))
      Array(0.39925..., dtype=float32)
      >>> ft.losses.nll(log_p, jnp.array([0, -100]))        # -100: ignored
      Array(0.69314..., dtype=float32)
      >>> ft.losses.nll(log_p, jnp.array([0, 1]), weight=jnp.array([1.0, 3.0]))   # (0.69 + 3 * 2.30) / 4
      Array(1.90022..., dtype=float32)
    """
    name = "nll"
    log_probs = check_float(name, "log_probs", log_probs)
    check_reduction(name, reduction)
    ignore_index = _ignore_index(name, ignore_index, "log_probs, labels")
    if not log_probs.ndim:
        raise ValueError(NLL_LABEL_SHAPE.format(scores=short_array(log_probs), index_shape="[]",
                                                given=_describe(labels), torch_layout="",
                                                right="ft.losses.nll(log_probs[None], labels)   # one class axis"))
    labels = _array(labels)
    index_shape = log_probs.shape[:-1]
    if labels.shape != index_shape:
        torch_layout = log_probs.ndim >= 3 and labels.shape == log_probs.shape[:1] + log_probs.shape[2:]
        raise ValueError(NLL_LABEL_SHAPE.format(
            scores=short_array(log_probs), index_shape=list(index_shape), given=_describe(labels),
            torch_layout=" These are torch's layout, classes on axis 1 ([N, C, d1, ...]): move them last."
            if torch_layout else "",
            right="ft.losses.nll(jnp.moveaxis(log_probs, 1, -1), labels)" if torch_layout
            else f"ft.losses.nll(log_probs, labels.reshape({list(index_shape)}))"))
    check_indices(name, "labels", labels, index_shape, log_probs, ignore=ignore_index,
                  allowed="" if ignore_index is None else f", or ignore_index {ignore_index}",
                  fix="" if ignore_index is None else f", or {ignore_index} (ignore_index) to skip a position")
    positive = first_outside(log_probs, -np.inf, 0)
    if positive is not None:
        raise ValueError(NOT_LOG_PROBABILITIES.format(where=positive[0], value=f"{positive[1]:g}"))
    w = class_weight(name, weight, log_probs, "NLLLoss")
    return _nll(log_probs, labels, w, ignore_index=ignore_index, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("ignore_index", "reduction"))
def _nll(log_probs: jax.Array, labels: jax.Array, w: jax.Array | None, *, ignore_index: int | None,
         reduction: str) -> Any:
    log_probs = in_compute_dtype(log_probs)
    labels = _wide(labels)
    classes = log_probs.shape[-1]
    keep = jnp.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    inside = (labels >= 0) & (labels < classes)
    safe = jnp.where(inside, labels, 0)
    picked = jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    counted = jnp.ones_like(picked) if w is None else w.astype(log_probs.dtype)[safe]
    zero = jnp.zeros((), picked.dtype)
    values = jnp.where(keep, -counted * picked, zero)
    # A traced label outside the classes (the check could not read it): NaN, never a class.
    values = jnp.where(keep & ~inside, jnp.full((), jnp.nan, values.dtype), values)
    counted = jnp.where(keep, counted, zero)
    if reduction == "mean":
        return ratio(jnp.sum(values), jnp.sum(counted))
    if reduction == "weighted":
        return WeightedMean(jnp.sum(values), jnp.sum(counted))
    return reduce("nll", values, reduction)


def binary_cross_entropy(probs: Any, labels: Any, *, weight: Any = None, reduction: str = "mean") -> Any:
    """torch's ``binary_cross_entropy`` of probabilities: ``-w (y log p + (1 - y) log(1 - p))``
    elementwise, each log clamped at -100 as torch's (a saturated probability of 0 or 1 gives
    100, not inf), and torch's gradient ``w (p - y) / max(p (1 - p), 1e-12)`` (the
    unclamped loss's, so a saturated wrong prediction still learns).

    ``weight`` broadcasts to the inputs' shape (torch's ``BCELoss(weight=)``); the mean is
    over elements. From logits, ``ft.losses.sigmoid_cross_entropy`` is the stable one.
    Concrete probabilities or labels outside [0, 1] raise :data:`PROBABILITIES_OUTSIDE_UNIT`
    (logits given as probabilities; torch refuses them too); traced ones make the loss NaN.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.binary_cross_entropy(jnp.array([0.9, 0.2]), jnp.array([1.0, 0.0]))
      Array(0.16425..., dtype=float32)
      >>> ft.losses.binary_cross_entropy(jnp.array([0.0]), jnp.array([1.0]))    # log 0 clamped at -100
      Array(100., dtype=float32)
    """
    name = "binary_cross_entropy"
    probs, labels = check_same_shape(name, probs, labels)
    check_reduction(name, reduction)
    check_float(name, "labels", labels)
    outside = first_outside(probs, 0, 1)
    if outside is not None:
        raise ValueError(PROBABILITIES_OUTSIDE_UNIT.format(
            what="probs", rule="probabilities", where=outside[0], value=f"{outside[1]:g}",
            why="These are logits: the cross entropy of logits is sigmoid_cross_entropy (stable, and "
                "torch's binary_cross_entropy_with_logits).",
            wrong="logits, labels", right="ft.losses.sigmoid_cross_entropy(logits, labels)"))
    outside = first_outside(labels, 0, 1)
    if outside is not None:
        raise ValueError(PROBABILITIES_OUTSIDE_UNIT.format(
            what="labels", rule="targets", where=outside[0], value=f"{outside[1]:g}",
            why="Outside [0, 1] the loss is unbounded below (torch returns it silently): map -1/1 labels "
                "or a 0/255 mask to [0, 1].",
            wrong="probs, labels", right="ft.losses.binary_cross_entropy(probs, (labels + 1) / 2)   # -1/1 labels"))
    w = element_weight(name, weight, probs.shape, "BCELoss")
    return _binary_cross_entropy(probs, labels, w, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("reduction",))
def _binary_cross_entropy(probs: jax.Array, labels: jax.Array, w: jax.Array | None, *, reduction: str) -> Any:
    probs = in_compute_dtype(probs)
    labels = labels.astype(probs.dtype)
    values = _bce_terms(probs, labels)
    if w is not None:
        values = values * jax.lax.broadcast_to_rank(w.astype(probs.dtype), values.ndim)
    bad = (probs < 0) | (probs > 1) | (labels < 0) | (labels > 1)  # traced: the checks could not read them
    return reduce("binary_cross_entropy", jnp.where(bad, jnp.full((), jnp.nan, values.dtype), values), reduction)


def _clamped_log(p: jax.Array) -> jax.Array:
    """``max(log p, -100)``, torch's clamp (``log 0 = -100``)."""
    positive = p > 0
    return jnp.where(positive, jnp.maximum(jnp.log(jnp.where(positive, p, 1)), -100), -100).astype(p.dtype)


@jax.custom_jvp
def _bce_terms(p: jax.Array, y: jax.Array) -> jax.Array:
    return -(y * _clamped_log(p) + (1 - y) * _clamped_log(1 - p))


@_bce_terms.defjvp
def _bce_terms_jvp(primals: tuple[jax.Array, jax.Array], tangents: tuple[jax.Array, jax.Array]) -> Any:
    """torch's derivatives: ``(p - y) / max(p (1 - p), 1e-12)`` in ``p`` (the unclamped loss's,
    its denominator floored), ``log(1 - p) - log p`` in ``y`` (unclamped, as torch's: +-inf
    at a saturated probability)."""
    p, y = primals
    dp, dy = tangents
    # torch's EPSILON is the float 1e-12 (9.99999996e-13 read in float64)
    slope = (p - y) / jnp.maximum(p * (1 - p), jnp.asarray(np.float32(1e-12), p.dtype))
    return _bce_terms(p, y), dp * slope + dy * (jnp.log1p(-p) - jnp.log(p))


def gaussian_nll(predicted: Any, expected: Any, variance: Any, *, full: bool = False, eps: float = 1e-6,
                 reduction: str = "mean") -> Any:
    """torch's ``gaussian_nll_loss``: ``(log v + (predicted - expected)^2 / v) / 2`` elementwise
    (plus ``log(2 pi) / 2`` with ``full=True``), ``v = max(variance, eps)``: the clamp is
    torch's, whose gradient passes to ``variance`` unchanged (it is made without a tape).

    ``variance`` has ``predicted``'s shape (one each), that shape less the last axis (one per
    row: it broadcasts over the last), the same rank with one axis of size 1 (shared), or is a
    Python number: torch's rules, any other shape raises :data:`VARIANCE_SHAPE`. A concrete
    negative variance raises :data:`NEGATIVE_VARIANCE`, as torch.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.gaussian_nll(jnp.array([0.0, 1.0]), jnp.array([1.0, 1.0]), jnp.array([1.0, 2.0]))
      Array(0.42328..., dtype=float32)
      >>> ft.losses.gaussian_nll(jnp.array([[0.0, 1.0]]), jnp.array([[1.0, 1.0]]), 1.0, full=True)
      Array(1.16893..., dtype=float32)
    """
    name = "gaussian_nll"
    predicted, expected = check_same_shape(name, predicted, expected)
    check_reduction(name, reduction)
    eps = check_number(name, "eps", eps, "a positive number", 1e-6, lambda e: e > 0)
    number = isinstance(variance, (int, float, np.integer, np.floating)) and not isinstance(variance, bool)
    variance = np.asarray(float(variance)) if number else check_float(name, "variance", variance)
    negative = first_outside(variance, 0, np.inf)  # (where in the variance as given)
    if negative is not None:
        raise ValueError(NEGATIVE_VARIANCE.format(where=negative[0], value=f"{negative[1]:g}"))
    shape, short = list(predicted.shape), list(predicted.shape[:-1])
    if not number and variance.shape != predicted.shape:
        if variance.shape == predicted.shape[:-1] and predicted.ndim:
            variance = variance[..., None]
        elif not (variance.ndim == predicted.ndim and sum(
                v for p, v in zip(predicted.shape, variance.shape, strict=True) if p != v) == 1):
            raise ValueError(VARIANCE_SHAPE.format(given=_describe(variance), predicted=_describe(predicted),
                                                   shape=shape, short=short))
    return _gaussian_nll(predicted, expected, variance, full=bool(full), eps=eps, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("full", "eps", "reduction"))
def _gaussian_nll(predicted: jax.Array, expected: jax.Array, variance: jax.Array, *, full: bool, eps: float,
                  reduction: str) -> Any:
    predicted = in_compute_dtype(predicted)
    variance = variance.astype(predicted.dtype)
    # torch clamps in place under no_grad: the value is clamped, the gradient flows through unchanged
    variance = variance + jax.lax.stop_gradient(jnp.maximum(variance, eps) - variance)
    values = 0.5 * (jnp.log(variance) + jnp.square(predicted - expected.astype(predicted.dtype)) / variance)
    if full:
        values = values + 0.5 * math.log(2 * math.pi)
    bad = jnp.broadcast_to(variance < 0, values.shape)  # traced: the check could not read it
    return reduce("gaussian_nll", jnp.where(bad, jnp.full((), jnp.nan, values.dtype), values), reduction)


def poisson_nll(predicted: Any, expected: Any, *, log_input: bool = True, full: bool = False, eps: float = 1e-8,
                reduction: str = "mean") -> Any:
    """torch's ``poisson_nll_loss``: ``exp(predicted) - expected * predicted`` of log-rates
    (``log_input=True``, torch's default), ``predicted - expected * log(predicted + eps)`` of
    rates; ``full=True`` adds Stirling's ``y log y - y + log(2 pi y) / 2`` where ``y > 1``
    (0 elsewhere, as torch's). Elementwise, mean over elements.

    ``ft.losses.poisson(rate, y)`` is ``poisson_nll(rate, y, log_input=False)`` without the
    eps (and ``poisson_nll(log_rate, y)`` is ``poisson(exp(log_rate), y)``). Concrete
    negative counts (and, with ``log_input=False``, negative rates) raise :data:`NEGATIVE_COUNTS`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.poisson_nll(jnp.array([0.0, 1.0]), jnp.array([1.0, 2.0]))     # log-rates
      Array(0.85914..., dtype=float32)
      >>> ft.losses.poisson_nll(jnp.array([1.0, 2.0]), jnp.array([1.0, 3.0]), log_input=False, full=True)
      Array(1.34232..., dtype=float32)
    """
    name = "poisson_nll"
    predicted, expected = check_same_shape(name, predicted, expected)
    check_reduction(name, reduction)
    eps = check_number(name, "eps", eps, "a non-negative number", 1e-8, lambda e: e >= 0)
    negative = first_outside(expected, 0, np.inf)
    if negative is not None:
        raise ValueError(NEGATIVE_COUNTS.format(
            what="expected", rule="counts (non-negative)", where=negative[0], value=f"{negative[1]:g}",
            why="A Poisson target is a count; a negative one makes the loss unbounded below.",
            wrong="log_rate, target", right="log_rate, target   # target >= 0"))
    if not log_input:
        negative = first_outside(predicted, 0, np.inf)
        if negative is not None:
            raise ValueError(NEGATIVE_COUNTS.format(
                what="predicted", rule="rates (non-negative) with log_input=False", where=negative[0],
                value=f"{negative[1]:g}", why="These are log-rates: torch's default log_input=True takes them.",
                wrong="log_rate, target, log_input=False", right="log_rate, target   # log_input=True"))
    return _poisson_nll(predicted, expected, log_input=bool(log_input), full=bool(full), eps=eps, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("log_input", "full", "eps", "reduction"))
def _poisson_nll(predicted: jax.Array, expected: jax.Array, *, log_input: bool, full: bool, eps: float,
                 reduction: str) -> Any:
    predicted = in_compute_dtype(predicted)
    y = expected.astype(predicted.dtype)
    if log_input:
        values = jnp.exp(predicted) - y * predicted
    else:
        values = predicted - y * jnp.log(predicted + eps)
    if full:
        big = y > 1
        safe = jnp.where(big, y, 1)  # log of the masked targets never runs (0 * log 0 = NaN in the gradient)
        stirling = safe * jnp.log(safe) - safe + 0.5 * jnp.log(2 * math.pi * safe)
        values = values + jnp.where(big, stirling, jnp.zeros((), values.dtype))
    return reduce("poisson_nll", values, reduction)
