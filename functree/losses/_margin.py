"""torch's margin losses: :func:`margin_ranking`, :func:`hinge_embedding`, :func:`soft_margin`
(labels in {-1, 1}), :func:`multi_margin`, :func:`multilabel_margin`,
:func:`multilabel_soft_margin` (classes on the last axis), with torch's numbers.

The losses of labels in {-1, 1} refuse concrete 0/1 labels (torch reads a 0 as neither side
and adds a constant, silently); traced labels that are neither make the loss NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree.losses._checks import (
    check_class_axis,
    check_indices,
    check_number,
    check_shape,
    check_signed,
    class_weight,
    element_weight,
)
from functree.losses._classification import _wide
from functree.losses._hinge import clamp_min_zero
from functree.losses._reduction import (
    _array,
    check_float,
    check_reduction,
    check_same_shape,
    first_outside,
    in_compute_dtype,
    reduce,
)

__all__ = ["margin_ranking", "hinge_embedding", "soft_margin", "multi_margin", "multilabel_margin",
           "multilabel_soft_margin"]

LABELS_OUTSIDE_UNIT = """\
multilabel_soft_margin: labels must be targets in [0, 1] (1: the class is present), but \
labels{where} is {value}. Outside [0, 1] the loss is unbounded below (torch returns it silently). \
Map them:

    wrong:  ft.losses.multilabel_soft_margin(logits, labels)               # -1/1 labels
    right:  ft.losses.multilabel_soft_margin(logits, (labels + 1) / 2)
"""


def _nan_unless_signed(values: jax.Array, y: jax.Array) -> jax.Array:
    """``values``, NaN where a (traced) label is neither -1 nor 1: never a plausible number."""
    bad = jnp.broadcast_to((y != 1) & (y != -1), values.shape)
    return jnp.where(bad, jnp.full((), jnp.nan, values.dtype), values)


def margin_ranking(x1: Any, x2: Any, y: Any, *, margin: float = 0.0, reduction: str = "mean") -> Any:
    """torch's ``margin_ranking_loss``: ``max(0, -y (x1 - x2) + margin)`` elementwise, ``y = 1``
    where ``x1`` should rank higher, ``-1`` where ``x2`` should.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.margin_ranking(jnp.array([2.0, 0.0]), jnp.array([1.0, 1.0]), jnp.array([1.0, 1.0]), margin=0.5)
      Array(0.75, dtype=float32)
    """
    name = "margin_ranking"
    x1, x2 = check_same_shape(name, x1, x2)
    check_reduction(name, reduction)
    margin = check_number(name, "margin", margin, "a number", 0.0, np.isfinite)
    y = check_shape(name, "y", y, x1.shape, call="x1, x2, y", fixed=f"x1, x2, y.reshape({list(x1.shape)})")
    y = check_signed(name, "y", y, torch="margin_ranking_loss", effect="a 0 adds max(0, margin) with no gradient",
                     call="x1, x2, y")
    return _margin_ranking(x1, x2, y, margin=margin, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("margin", "reduction"))
def _margin_ranking(x1: jax.Array, x2: jax.Array, y: jax.Array, *, margin: float, reduction: str) -> Any:
    x1 = in_compute_dtype(x1)
    values = clamp_min_zero(-y.astype(x1.dtype) * (x1 - x2.astype(x1.dtype)) + margin)  # torch's gradient at 0
    return reduce("margin_ranking", _nan_unless_signed(values, y), reduction)


def hinge_embedding(predicted: Any, expected: Any, *, margin: float = 1.0, reduction: str = "mean") -> Any:
    """torch's ``hinge_embedding_loss``: ``predicted`` (a distance) where ``expected = 1``,
    ``max(0, margin - predicted)`` where ``expected = -1``; elementwise.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.hinge_embedding(jnp.array([0.3, 0.4]), jnp.array([1.0, -1.0]))
      Array(0.45..., dtype=float32)
    """
    name = "hinge_embedding"
    predicted, expected = check_same_shape(name, predicted, expected)
    check_reduction(name, reduction)
    margin = check_number(name, "margin", margin, "a number", 1.0, np.isfinite)
    expected = check_signed(name, "expected", expected, torch="hinge_embedding_loss",
                            effect="a 0 adds predicted + max(0, margin - predicted)", call="predicted, expected")
    return _hinge_embedding(predicted, expected, margin=margin, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("margin", "reduction"))
def _hinge_embedding(predicted: jax.Array, expected: jax.Array, *, margin: float, reduction: str) -> Any:
    predicted = in_compute_dtype(predicted)
    values = jnp.where(expected == 1, predicted, clamp_min_zero(margin - predicted))  # torch's gradient at 0
    return reduce("hinge_embedding", _nan_unless_signed(values, expected), reduction)


def soft_margin(predicted: Any, expected: Any, *, reduction: str = "mean") -> Any:
    """torch's ``soft_margin_loss``: ``log(1 + exp(-expected * predicted))`` elementwise, labels
    in {-1, 1} (the logistic loss of a margin; ``sigmoid_cross_entropy`` of ``(expected + 1) / 2``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.soft_margin(jnp.array([0.0, 2.0]), jnp.array([1.0, -1.0]))
      Array(1.41003..., dtype=float32)
    """
    name = "soft_margin"
    predicted, expected = check_same_shape(name, predicted, expected)
    check_reduction(name, reduction)
    expected = check_signed(name, "expected", expected, torch="soft_margin_loss",
                            effect="a 0 adds log 2 with no gradient", call="predicted, expected")
    return _soft_margin(predicted, expected, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("reduction",))
def _soft_margin(predicted: jax.Array, expected: jax.Array, *, reduction: str) -> Any:
    predicted = in_compute_dtype(predicted)
    values = jax.nn.softplus(-expected.astype(predicted.dtype) * predicted)
    return reduce("soft_margin", _nan_unless_signed(values, expected), reduction)


def multi_margin(scores: Any, labels: Any, *, p: int = 1, margin: float = 1.0, weight: Any = None,
                 reduction: str = "mean") -> Any:
    """torch's ``multi_margin_loss``, the multi-class hinge: per example (classes last),
    ``sum_{i != y} w[y] max(0, margin - x[y] + x[i])^p / classes``, then the mean over
    examples (the weights scale; they do not normalize, as torch's). ``p`` is 1 or 2.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.multi_margin(jnp.array([[0.1, 0.2, 0.4, 0.8]]), jnp.array([3]))
      Array(0.325, dtype=float32)
    """
    name = "multi_margin"
    scores = check_float(name, "scores", scores)
    check_reduction(name, reduction)
    check_class_axis(name, "scores", scores)
    p = int(check_number(name, "p", p, "1 or 2 (torch's choices)", 1, lambda v: v in (1, 2)))
    margin = check_number(name, "margin", margin, "a number", 1.0, np.isfinite)
    labels = check_indices(name, "labels", labels, scores.shape[:-1], scores)
    w = class_weight(name, weight, scores, "MultiMarginLoss")
    return _multi_margin(scores, labels, w, p=p, margin=margin, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("p", "margin", "reduction"))
def _multi_margin(scores: jax.Array, labels: jax.Array, w: jax.Array | None, *, p: int, margin: float,
                  reduction: str) -> Any:
    scores = in_compute_dtype(scores)
    classes = scores.shape[-1]
    labels = _wide(labels)  # int64 under x64 (cast to int32, a traced 2**32 + 2 was class 2)
    inside = (labels >= 0) & (labels < classes)
    safe = jnp.where(inside, labels, 0)
    target = jnp.take_along_axis(scores, safe[..., None], axis=-1)
    hinge = jax.nn.relu(margin - target + scores) ** p
    if w is not None:
        hinge = hinge * w.astype(scores.dtype)[safe][..., None]
    others = jax.lax.broadcast_to_rank(jnp.arange(classes, dtype=safe.dtype), safe.ndim + 1) != safe[..., None]
    values = jnp.sum(jnp.where(others, hinge, jnp.zeros((), hinge.dtype)), axis=-1) / classes
    return reduce("multi_margin", jnp.where(inside, values, jnp.full((), jnp.nan, values.dtype)), reduction)


def multilabel_margin(scores: Any, labels: Any, *, reduction: str = "mean") -> Any:
    """torch's ``multilabel_margin_loss``: each example's ``labels`` (classes last, the scores'
    shape, integer) list its target classes up to the first -1; its loss is
    ``sum_{j targets} sum_{i not targets} max(0, 1 - (x[j] - x[i])) / classes`` (a class
    listed twice counts twice, as torch's), then the mean over examples.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.multilabel_margin(jnp.array([[0.0, 0.5, 1.0, 2.0]]), jnp.array([[3, 0, -1, 1]]))
      Array(0.875, dtype=float32)
    """
    name = "multilabel_margin"
    scores = check_float(name, "scores", scores)
    check_reduction(name, reduction)
    check_class_axis(name, "scores", scores)
    labels = check_indices(name, "labels", labels, scores.shape, scores, low=-1, allowed="; -1 ends the list",
                           fix=", -1 after an example's last target")
    return _multilabel_margin(scores, labels, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("reduction",))
def _multilabel_margin(scores: jax.Array, labels: jax.Array, *, reduction: str) -> Any:
    scores = in_compute_dtype(scores)
    classes = scores.shape[-1]
    labels = _wide(labels)  # int64 under x64 (cast to int32, a traced 2**32 - 1 ended the list: -1)
    listed = jnp.cumprod(labels >= 0, axis=-1).astype(bool)  # the targets before the first -1
    inside = (labels < classes) | ~listed
    safe = jnp.where(listed & inside, labels, 0)
    is_target = jnp.any((safe[..., :, None] == jax.lax.broadcast_to_rank(jnp.arange(classes, dtype=safe.dtype), safe.ndim + 1)) & listed[..., :, None], axis=-2)
    target = jnp.take_along_axis(scores, safe, axis=-1)  # x[y_s]
    hinge = jax.nn.relu(1 - target[..., :, None] + scores[..., None, :])  # [.., s, i]
    counted = listed[..., :, None] & ~is_target[..., None, :]
    values = jnp.sum(jnp.where(counted, hinge, jnp.zeros((), hinge.dtype)), axis=(-2, -1)) / classes
    ok = jnp.all(inside & (labels >= -1), axis=-1)
    return reduce("multilabel_margin", jnp.where(ok, values, jnp.full((), jnp.nan, values.dtype)), reduction)


def multilabel_soft_margin(logits: Any, labels: Any, *, weight: Any = None, reduction: str = "mean") -> Any:
    """torch's ``multilabel_soft_margin_loss``: per example, the mean over classes (last axis) of
    ``-w (y log sigmoid(x) + (1 - y) log sigmoid(-x))``, then the mean over examples:
    ``sigmoid_cross_entropy`` averaged per example (equal to it for ``reduction="mean"``
    without weights). ``weight`` broadcasts to the logits' shape (per class: ``[classes]``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.multilabel_soft_margin(jnp.array([[0.0, 2.0]]), jnp.array([[1.0, 0.0]]))
      Array(1.41003..., dtype=float32)
    """
    name = "multilabel_soft_margin"
    logits, labels = check_same_shape(name, logits, labels)
    check_reduction(name, reduction)
    check_float(name, "labels", labels)
    check_class_axis(name, "logits", logits)
    outside = first_outside(labels, 0, 1)
    if outside is not None:
        raise ValueError(LABELS_OUTSIDE_UNIT.format(where=outside[0], value=f"{outside[1]:g}"))
    w = element_weight(name, weight, logits.shape, "MultiLabelSoftMarginLoss")
    return _multilabel_soft_margin(logits, _array(labels), w, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("reduction",))
def _multilabel_soft_margin(logits: jax.Array, labels: jax.Array, w: jax.Array | None, *, reduction: str) -> Any:
    logits = in_compute_dtype(logits)
    y = labels.astype(logits.dtype)
    values = -(y * jax.nn.log_sigmoid(logits) + (1 - y) * jax.nn.log_sigmoid(-logits))
    if w is not None:
        values = values * jax.lax.broadcast_to_rank(w.astype(logits.dtype), values.ndim)
    values = jnp.where((y < 0) | (y > 1), jnp.full((), jnp.nan, values.dtype), values)
    return reduce("multilabel_soft_margin", jnp.mean(values, axis=-1), reduction)
