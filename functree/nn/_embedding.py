"""Embedding: a lookup table from integer indices to vectors."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from functree.nn._abstract import initialized
from functree.nn._check import check_input
from functree.nn._linear import Initializer
from functree.nn._mode import Layer

__all__ = ["Embedding"]

_standard_normal = jax.nn.initializers.normal(1.0)


class Embedding(Layer):
    """``y[..., :] = embeddings[indices[...], :]``: ``[...] int -> [..., embedding_size]``.

    ``embeddings`` is ``[vocabulary_size, embedding_size]``, standard normal by default.
    Out-of-range indices are clamped (JAX's gather semantics). The gradient is
    a scatter-add into the looked-up rows.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> emb = ft.nn.Embedding(10, 4, key=jax.random.key(0))
      >>> emb(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)
    """

    embeddings: jax.Array

    def __init__(
        self,
        vocabulary_size: int,
        embedding_size: int,
        *,
        key: jax.Array,
        dtype: Any = jnp.float32,
        initializer: Initializer = _standard_normal,
    ):
        self.embeddings = initialized(initializer, key, (vocabulary_size, embedding_size), dtype)

    def __call__(self, indices: jax.Array) -> jax.Array:
        check_input(self, indices, (), kind="int")
        return jnp.take(self.embeddings, indices, axis=0, mode="clip")
