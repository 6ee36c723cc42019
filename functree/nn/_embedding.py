"""Embedding: a lookup table from integer indices to vectors."""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import field
from functree.nn._abstract import initialized
from functree.nn._check import check_input
from functree.nn._linear import Initializer
from functree.nn._mode import Layer

__all__ = ["Embedding"]

_standard_normal = jax.nn.initializers.normal(1.0)

PADDING_INDEX = """\
ft.nn.Embedding: padding_index={index} is outside the vocabulary of {size} rows.
    right:  ft.nn.Embedding({size}, d, key=key, padding_index=0)"""


class Embedding(Layer):
    """``y[..., :] = embeddings[indices[...], :]``: ``[...] int -> [..., embedding_size]``.

    ``embeddings`` is ``[vocabulary_size, embedding_size]``, standard normal by default.
    Out-of-range indices are clamped (JAX's gather semantics). The gradient is
    a scatter-add into the looked-up rows.

    ``padding_index=p`` is torch's ``padding_idx``: row ``p`` starts at zeros and gets no
    gradient (it is looked up as stored). A torch state dict does not carry it: give it
    when porting a torch ``Embedding(..., padding_idx=p)``, or the padding row trains.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> emb = ft.nn.Embedding(10, 4, key=jax.random.key(0))
      >>> emb(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)
      >>> padded = ft.nn.Embedding(10, 4, key=jax.random.key(0), padding_index=0)
      >>> grad = ft.gradient(lambda e: e(jnp.array([0, 0, 5])).sum(), at=padded)
      >>> grad.embeddings[0].tolist(), grad.embeddings[5].tolist()
      ([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])
    """

    embeddings: jax.Array
    padding_index: int | None = field(static=True, default=None)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("padding_index",)  # files written before it read as None

    def __init__(
        self,
        vocabulary_size: int,
        embedding_size: int,
        *,
        key: jax.Array,
        dtype: Any = jnp.float32,
        initializer: Initializer = _standard_normal,
        padding_index: int | None = None,
    ):
        self.embeddings = initialized(initializer, key, (vocabulary_size, embedding_size), dtype)
        if padding_index is not None:
            padding_index = operator.index(padding_index)
            if not -vocabulary_size <= padding_index < vocabulary_size:
                raise ValueError(PADDING_INDEX.format(index=padding_index, size=vocabulary_size))
            padding_index %= vocabulary_size
            self.embeddings = self.embeddings.at[padding_index].set(0)  # torch's padding row
        self.padding_index = padding_index

    def __call__(self, indices: jax.Array) -> jax.Array:
        check_input(self, indices, (), kind="int")
        read = jnp.clip(indices, 0, self.embeddings.shape[0] - 1)  # the rows jnp.take's "clip" reads
        return without_padding_gradient(jnp.take(self.embeddings, read, axis=0), read, self.padding_index)


def without_padding_gradient(rows: jax.Array, indices: jax.Array, padding: int | None) -> jax.Array:
    """Looked-up ``rows`` whose lookups of the ``padding`` row pass no cotangent back (its
    gradient from them is zero: torch's ``padding_idx``); ``rows`` as they are for None."""
    if padding is None:
        return rows
    return jnp.where((indices == padding)[..., None], jax.lax.stop_gradient(rows), rows)
