"""torch's embedding losses: :func:`cosine_embedding`, :func:`triplet_margin`,
:func:`triplet_margin_with_distance`, on vectors along the last axis, with torch's
distances (its ``eps`` placed where torch places it) and gradients (0 where a norm is 0).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._distances import pairwise_distance_terms
from functree.losses._checks import check_class_axis, check_number, check_shape, check_signed
from functree.losses._hinge import clamp_min_zero
from functree.losses._reduction import (
    _describe,
    check_float,
    check_reduction,
    check_same_shape,
    in_compute_dtype,
    reduce,
)

__all__ = ["cosine_embedding", "triplet_margin", "triplet_margin_with_distance", "DISTANCE_SHAPE"]

DISTANCE_SHAPE = """\
triplet_margin_with_distance: distance(anchor, {which}) must return one distance per triplet, \
shape {expected}, got {given}. A distance that keeps the vector axis (or reduces the batch) \
makes the loss silently another number.

    wrong:  distance=lambda a, b: jnp.abs(a - b)                  # [..., D]
    right:  distance=lambda a, b: jnp.sum(jnp.abs(a - b), -1)     # [...]
"""


def cosine_embedding(x1: Any, x2: Any, y: Any, *, margin: float = 0.0, reduction: str = "mean") -> Any:
    """torch's ``cosine_embedding_loss``: with ``cos`` the cosine of ``x1`` and ``x2`` along the
    last axis (torch's: ``x1 . x2 / sqrt((|x1|^2 + 1e-12)(|x2|^2 + 1e-12))``), ``1 - cos`` where
    ``y = 1`` and ``max(0, cos - margin)`` where ``y = -1``; ``y`` has the shape less the last axis.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x1, x2 = jnp.array([[1.0, 0.0], [1.0, 1.0]]), jnp.array([[0.0, 1.0], [1.0, 1.0]])
      >>> ft.losses.cosine_embedding(x1, x2, jnp.array([1.0, -1.0]))
      Array(1., dtype=float32)
    """
    name = "cosine_embedding"
    x1, x2 = check_same_shape(name, x1, x2)
    check_reduction(name, reduction)
    check_class_axis(name, "x1", x1)
    margin = check_number(name, "margin", margin, "a number in [-1, 1]", 0.0, lambda m: -1 <= m <= 1)
    y = check_shape(name, "y", y, x1.shape[:-1], call="x1, x2, y",
                    fixed=f"x1, x2, y.reshape({list(x1.shape[:-1])})   # one label per pair of vectors")
    y = check_signed(name, "y", y, torch="cosine_embedding_loss", effect="a 0 gives a loss of 0 and no gradient",
                     call="x1, x2, y")
    return _cosine_embedding(x1, x2, y, margin=margin, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("margin", "reduction"))
def _cosine_embedding(x1: jax.Array, x2: jax.Array, y: jax.Array, *, margin: float, reduction: str) -> Any:
    x1 = in_compute_dtype(x1)
    x2 = x2.astype(x1.dtype)
    eps = float(np.float32(1e-12))  # torch's EPSILON, a float (9.99999996e-13), added to each squared norm
    cos = jnp.sum(x1 * x2, axis=-1) / jnp.sqrt((jnp.sum(x1 * x1, axis=-1) + eps) * (jnp.sum(x2 * x2, axis=-1) + eps))
    values = jnp.where(y == 1, 1 - cos, clamp_min_zero(cos - margin))  # torch's gradient at cos = margin
    values = jnp.where((y != 1) & (y != -1), jnp.full((), jnp.nan, values.dtype), values)
    return reduce("cosine_embedding", values, reduction)


def _check_triplet(loss: str, anchor: Any, positive: Any, negative: Any) -> tuple[Any, Any, Any]:
    """The three as arrays of one shape ``[..., D]`` (:data:`~functree.losses._reduction.SHAPE_MISMATCH`)."""
    anchor, positive = check_same_shape(loss, anchor, positive)
    _, negative = check_same_shape(loss, anchor, negative)
    check_float(loss, "negative", negative)
    return anchor, positive, negative


def triplet_margin(anchor: Any, positive: Any, negative: Any, *, margin: float = 1.0, p: float = 2.0,
                   eps: float = 1e-6, swap: bool = False, reduction: str = "mean") -> Any:
    """torch's ``triplet_margin_loss``: ``max(0, d(a, p) - d(a, n) + margin)`` per triplet of
    vectors (last axis), ``d`` torch's ``pairwise_distance`` ``||x1 - x2 + eps||_p`` (``ft.nn.pairwise_distance``);
    ``swap=True`` takes ``min(d(a, n), d(p, n))`` as the negative's distance (Balntas et al. 2016).
    ``margin > 0``, torch's rule (it refuses 0 and below).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> a, pos, neg = jnp.array([[0.0, 0.0]]), jnp.array([[3.0, 4.0]]), jnp.array([[1.0, 0.0]])
      >>> ft.losses.triplet_margin(a, pos, neg, eps=0.0)
      Array(5., dtype=float32)
    """
    name = "triplet_margin"
    anchor, positive, negative = _check_triplet(name, anchor, positive, negative)
    check_reduction(name, reduction)
    check_class_axis(name, "anchor", anchor)
    margin = check_number(name, "margin", margin, "a positive number (torch's rule)", 1.0, lambda m: 0 < m < math.inf)
    p = check_number(name, "p", p, "a positive norm order (inf: the largest)", 2.0, lambda v: v > 0)
    eps = check_number(name, "eps", eps, "a non-negative number", 1e-6, lambda v: v >= 0)
    return _triplet_margin(anchor, positive, negative, margin=margin, p=p, eps=eps, swap=bool(swap),
                           reduction=reduction)


@functools.partial(jax.jit, static_argnames=("margin", "p", "eps", "swap", "reduction"))
def _triplet_margin(anchor: jax.Array, positive: jax.Array, negative: jax.Array, *, margin: float, p: float,
                    eps: float, swap: bool, reduction: str) -> Any:
    anchor = in_compute_dtype(anchor)
    positive, negative = positive.astype(anchor.dtype), negative.astype(anchor.dtype)
    far = pairwise_distance_terms(anchor, negative, p, eps)
    if swap:
        far = jnp.minimum(far, pairwise_distance_terms(positive, negative, p, eps))
    return _triplet(pairwise_distance_terms(anchor, positive, p, eps), far, margin=margin, reduction=reduction)


def _triplet(near: jax.Array, far: jax.Array, *, margin: float, reduction: str) -> Any:
    return reduce("triplet_margin", clamp_min_zero(margin + near - far), reduction)  # torch's gradient at 0


def triplet_margin_with_distance(anchor: Any, positive: Any, negative: Any, *,
                                 distance: Callable[[Any, Any], Any] | None = None, margin: float = 1.0,
                                 swap: bool = False, reduction: str = "mean") -> Any:
    """torch's ``triplet_margin_with_distance_loss``: ``max(0, d(a, p) - d(a, n) + margin)``
    with your ``distance(x1, x2)`` (one distance per triplet: the shape less the last axis,
    else :data:`DISTANCE_SHAPE`; None: torch's ``pairwise_distance``, p=2, eps=1e-6) and
    ``margin > 0`` (torch's rule). ``swap=True`` as :func:`triplet_margin`'s.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> a, pos, neg = jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 1.0]]), jnp.array([[1.0, 0.1]])
      >>> cosine = lambda x, y: 1 - jnp.sum(x * y, -1) / (jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(y, axis=-1))
      >>> ft.losses.triplet_margin_with_distance(a, pos, neg, distance=cosine, margin=0.5)
      Array(1.49503..., dtype=float32)
    """
    name = "triplet_margin_with_distance"
    anchor, positive, negative = _check_triplet(name, anchor, positive, negative)
    check_reduction(name, reduction)
    check_class_axis(name, "anchor", anchor)
    margin = check_number(name, "margin", margin, "a positive number (torch's rule)", 1.0, lambda m: 0 < m < math.inf)
    if distance is None:
        return _triplet_margin(anchor, positive, negative, margin=margin, p=2.0, eps=1e-6, swap=bool(swap),
                               reduction=reduction)
    near, far = distance(anchor, positive), distance(anchor, negative)
    pairs = [("positive", near), ("negative", far)]
    if swap:
        pairs.append(("negative) and distance(positive, negative", distance(positive, negative)))
    for which, d in pairs:
        if jnp.shape(d) != anchor.shape[:-1]:
            raise ValueError(DISTANCE_SHAPE.format(which=which, expected=list(anchor.shape[:-1]), given=_describe(d)))
    if swap:
        far = jnp.minimum(far, pairs[2][1])
    return _triplet_kernel(jnp.asarray(near), jnp.asarray(far), margin=margin, reduction=reduction)


@functools.partial(jax.jit, static_argnames=("margin", "reduction"))
def _triplet_kernel(near: jax.Array, far: jax.Array, *, margin: float, reduction: str) -> Any:
    near = in_compute_dtype(near)
    return _triplet(near, far.astype(near.dtype), margin=margin, reduction=reduction)
