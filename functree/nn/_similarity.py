"""torch's ``nn.CosineSimilarity``, ``nn.PairwiseDistance`` and ``F.normalize``, as functions."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from functree._distances import pairwise_distance_terms

__all__ = ["cosine_similarity", "normalize", "pairwise_distance"]

BAD_P = """\
pairwise_distance: p must be a number >= 0 (the norm's order: 1, 2, float("inf"); 0 counts the \
components that differ), got {given!r}. torch returns a number for a negative p that is no distance.

    wrong:  ft.nn.pairwise_distance(x1, x2, p={given!r})
    right:  ft.nn.pairwise_distance(x1, x2, p=2.0)
"""


EMPTY_MAX_NORM = """\
pairwise_distance: p={given!r} is the max of |x1 - x2 + eps| over the last axis, which is empty \
here (x1 {x1}, x2 {x2}): a max of nothing (torch: "cannot compute the inf norm on the dimension \
... because this dimension is empty").

    wrong:  ft.nn.pairwise_distance(x1, x2, p={given!r})     # last axis 0
    right:  ft.nn.pairwise_distance(x1, x2, p=2.0)     # 0.0 on an empty axis; or vectors of >= 1 component
"""


def cosine_similarity(x1: Any, x2: Any, axis: int = -1, eps: float = 1e-8) -> jax.Array:
    """``x1 . x2 / (max(||x1||, eps) * max(||x2||, eps))`` along ``axis`` (torch's
    ``F.cosine_similarity``; its default ``dim=1`` is the last axis of ``[N, D]``, here the
    last axis whatever the rank). The inputs broadcast; ``axis`` is dropped.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.cosine_similarity(jnp.array([[1.0, 0.0], [1.0, 1.0]]), jnp.array([1.0, 1.0])).round(4)
      Array([0.7071, 1.    ], dtype=float32)
    """
    x1, x2 = jnp.broadcast_arrays(jnp.asarray(x1), jnp.asarray(x2))
    eps_ = jnp.asarray(eps, x1.dtype)
    n1 = jnp.maximum(_norm(x1, axis), eps_)
    n2 = jnp.maximum(_norm(x2, axis), eps_)
    return jnp.sum((x1 / n1) * (x2 / n2), axis=axis)


BAD_NORM_ORDER = """\
normalize: p must be a number > 0 (the norm's order: 1, 2, float("inf")), got {given!r}.

    wrong:  ft.nn.normalize(x, p={given!r})
    right:  ft.nn.normalize(x, p=2.0)
"""


def normalize(x: Any, p: float = 2.0, axis: int = -1, eps: float = 1e-12) -> jax.Array:
    """``x / max(||x||_p, eps)`` along ``axis`` (torch's ``F.normalize``; its default ``dim=1``
    is the features of ``[N, D]`` and the channels of ``NCHW``: here the last axis, functree's
    features and channels). Its gradient is torch's: 0 through the norm where the norm is
    below ``eps`` (a zero vector's gradient is ``1 / eps``, not NaN).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.normalize(jnp.array([[3.0, 4.0], [0.0, 0.0]]))
      Array([[0.6, 0.8],
             [0. , 0. ]], dtype=float32)
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        raise ValueError(BAD_NORM_ORDER.format(given=p))
    x = jnp.asarray(x)
    if p == 2:
        norm = _norm(x, axis)
    elif math.isinf(p):
        norm = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    else:
        total = jnp.sum(jnp.abs(x) ** p, axis=axis, keepdims=True)
        positive = total > 0
        norm = jnp.where(positive, jnp.where(positive, total, 1) ** (1 / p), 0)
    return x / jnp.maximum(norm, jnp.asarray(eps, x.dtype))


def _norm(x: jax.Array, axis: int) -> jax.Array:
    """``||x||_2`` along ``axis`` (kept), its gradient 0 at a zero vector (torch's: NaN otherwise)."""
    square = jnp.sum(x * x, axis=axis, keepdims=True)
    positive = square > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, square, 1)), 0)


def pairwise_distance(x1: Any, x2: Any, p: float = 2.0, eps: float = 1e-6, keepdims: bool = False) -> jax.Array:
    """``||x1 - x2 + eps||_p`` over the last axis (torch's ``F.pairwise_distance`` /
    ``nn.PairwiseDistance``, and its gradients: 0 where the distance is 0, ``sign`` per
    component; the triplet losses' distance). ``p = 0`` counts the components that differ
    (torch's); a negative ``p`` raises :data:`BAD_P`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.pairwise_distance(jnp.array([[0.0, 0.0]]), jnp.array([[3.0, 4.0]]), eps=0.0)
      Array([5.], dtype=float32)
    """
    try:
        order = float(p)
    except (TypeError, ValueError):
        order = math.nan
    if isinstance(p, bool) or not order >= 0:  # (NaN fails too)
        raise ValueError(BAD_P.format(given=p))
    x1, x2 = jnp.asarray(x1), jnp.asarray(x2)
    if math.isinf(order) and jnp.broadcast_shapes(jnp.shape(x1)[-1:], jnp.shape(x2)[-1:]) == (0,):
        raise ValueError(EMPTY_MAX_NORM.format(given=p, x1=list(jnp.shape(x1)), x2=list(jnp.shape(x2))))
    distance = pairwise_distance_terms(x1, x2, order, eps)  # torch's gradients too
    return distance[..., None] if keepdims else distance
