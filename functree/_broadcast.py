"""Elementwise sums and products with the leading axes broadcast by hand.

JAX's default adds the missing leading axes of the operand with fewer (``[N, F] + [F]``); a
user's ``jax.config.update("jax_numpy_rank_promotion", "raise")`` refuses that, so functree's
own code writes them out (``jax.lax.broadcast_to_rank``: the same axes, the same numbers). On
the eager path of a layer (a notebook cell) each operation outside a program is a dispatch of
its own and a compile at each new shape: :func:`plus` and :func:`times` are one program each
(inlined where they are traced), as ``jnp.add`` and ``jnp.multiply`` are; :func:`both`, two
masks' ``a & b``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> with jax.numpy_rank_promotion("raise"):
  ...     print(plus(jnp.ones((2, 3)), jnp.arange(3.0)).tolist())
  [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
"""

from __future__ import annotations

import functools

import jax

__all__ = ["plus", "times", "both", "ranked"]


def ranked(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a`` and ``b`` with the leading axes the one of fewer lacks (JAX's rank promotion)."""
    rank = max(a.ndim, b.ndim)
    return jax.lax.broadcast_to_rank(a, rank), jax.lax.broadcast_to_rank(b, rank)


@functools.partial(jax.jit, inline=True)
def plus(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b``, the leading axes broadcast by hand."""
    a, b = ranked(a, b)
    return a + b


@functools.partial(jax.jit, inline=True)
def times(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b``, the leading axes broadcast by hand."""
    a, b = ranked(a, b)
    return a * b


@functools.partial(jax.jit, inline=True)
def both(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a & b`` of two masks, the leading axes broadcast by hand."""
    a, b = ranked(a, b)
    return a & b
