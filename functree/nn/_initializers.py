"""Initializers: ``init(key, shape, dtype) -> array``, jax.nn.initializers re-exported.

Layers take them as ``weight_initializer=`` / ``bias_initializer=``; the factories
(``glorot_uniform()``, ``normal(0.02)``...) return such functions.

Example:
  >>> import functree as ft, jax
  >>> layer = ft.nn.Dense(4, 2, key=jax.random.key(0),
  ...                     weight_initializer=ft.nn.initializers.he_normal())
  >>> layer.weight.shape
  (4, 2)
"""

from __future__ import annotations

from jax.nn.initializers import (
    constant,
    glorot_normal,
    glorot_uniform,
    he_normal,
    he_uniform,
    lecun_normal,
    lecun_uniform,
    normal,
    ones,
    orthogonal,
    truncated_normal,
    uniform,
    variance_scaling,
    zeros,
)

__all__ = [
    "constant",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "zeros",
]
