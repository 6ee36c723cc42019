"""torch's pairwise distance, one implementation for ``ft.nn.pairwise_distance`` and the
triplet losses (``ft.losses.triplet_margin``).

Example:
  >>> import jax.numpy as jnp
  >>> from functree._distances import pairwise_distance_terms
  >>> pairwise_distance_terms(jnp.array([[0.0, 0.0]]), jnp.array([[3.0, 4.0]]), 2.0, 0.0)
  Array([5.], dtype=float32)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["pairwise_distance_terms"]


def _absolute(x: jax.Array) -> jax.Array:
    """``|x|`` with torch's gradient ``sign(x)`` (0 at 0; JAX's is 1)."""
    return x * jnp.sign(x)


def pairwise_distance_terms(x1: jax.Array, x2: jax.Array, p: float, eps: float) -> jax.Array:
    """torch's ``pairwise_distance``: ``||x1 - x2 + eps||_p`` over the last axis (the eps is
    added to the difference, as torch's), with a gradient of 0 where the norm is 0 (torch's;
    a square root's is inf there, ``jnp.linalg.norm``'s NaN) and ``sign`` per component (0 at
    0, as torch's ``p = 1``; JAX's ``|x|`` has 1 there; 0 at a zero component for ``p < 1``
    too). ``p = 0`` counts the nonzero components, as torch's."""
    x1, x2 = jnp.broadcast_arrays(x1, x2)  # torch's broadcasting of the two, by hand (rank promotion may raise)
    d = _absolute(x1 - x2 + jnp.asarray(eps, jnp.result_type(x1, x2)))
    if p == 0:  # torch's p = 0: the number of nonzero components, its gradient 0
        return jnp.sum(d != 0, axis=-1).astype(d.dtype)
    if math.isinf(p):
        return jnp.max(d, axis=-1)
    nonzero = d > 0  # p < 1: d**p's derivative is inf at 0 (NaN through sign's 0); torch's is 0 there
    powered = jnp.where(nonzero, jnp.where(nonzero, d, 1) ** p, jnp.zeros((), d.dtype))
    total = jnp.sum(powered, axis=-1)
    positive = total > 0
    root = jnp.where(positive, total, 1) ** (1 / p)
    return jnp.where(positive, root, jnp.zeros((), root.dtype))
