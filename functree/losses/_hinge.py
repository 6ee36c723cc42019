"""torch's ``clamp_min(x, 0)`` for the margin losses, with torch's gradient at the margin.

``max(x, 0)`` has a kink at 0. ``jax.nn.relu`` takes the derivative there as 0; torch's
``clamp_min`` backward passes the gradient where ``x >= 0``, so a pair exactly at the margin
(``margin_ranking`` of tied scores with ``margin=0``, a triplet whose distances differ by
exactly the margin) still learns in torch. The losses ported from torch take torch's choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["clamp_min_zero"]


def clamp_min_zero(x: jax.Array) -> jax.Array:
    """``max(x, 0)`` with the derivative 1 at ``x = 0`` (torch's ``clamp_min``; relu's is 0).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree.losses._hinge import clamp_min_zero
      >>> jax.grad(lambda x: clamp_min_zero(x))(0.0), jax.grad(jax.nn.relu)(0.0)
      (Array(1., dtype=float32, weak_type=True), Array(0., dtype=float32, weak_type=True))
    """
    return jnp.where(x >= 0, x, jnp.zeros((), x.dtype))
