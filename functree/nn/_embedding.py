"""Embedding: a lookup table from integer indices to vectors."""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import field
from functree._repr import first_index
from functree.nn._abstract import initialized
from functree.nn._check import (
    LayerInputError,
    check_input,
    check_unbatched,
    concrete,
    size_arguments,
)
from functree.nn._linear import Initializer
from functree.nn._mode import Layer

__all__ = ["Embedding"]

_standard_normal = jax.nn.initializers.normal(1.0)

MAX_NORM = """\
ft.nn.Embedding: max_norm={max_norm!r} is torch's in-place side effect: each forward of torch's \
Embedding(..., max_norm=m) rescales the rows it looks up inside the weight itself (under \
no_grad), and the optimizer then steps from the rescaled rows. A layer whose forward only \
scaled its output would give torch's first output and gradient and drift from it after the \
first step (its table never rescaled). Make the change explicit, before each step:

    wrong:  emb = ft.nn.Embedding(n, d, key=key, max_norm={max_norm!r})
    right:  emb = ft.nn.Embedding(n, d, key=key)
            emb = emb.renormalized(tokens, {max_norm!r})   # torch's renorm of the rows tokens look up
            loss, grads = ...(emb, tokens)                 # then the step, from the renormalized table"""

PADDING_INDEX = """\
ft.nn.Embedding: padding_index={index} is outside the vocabulary of {size} rows.
    right:  ft.nn.Embedding({size}, d, key=key, padding_index=0)"""

OUTSIDE_TABLE = """\
An index outside the table has no row: torch raises here, JAX's gather would read row {clamped} in \
its place (another token's row, silently), and under jax.jit, where the values are not seen, the \
lookup reads a NaN row. Build the table with a row for every index, or map the indices into it:
    wrong:  {wrong}
    right:  {right}"""


class Embedding(Layer):
    """``y[..., :] = embeddings[indices[...], :]``: ``[...] int -> [..., embedding_size]``.

    ``embeddings`` is ``[vocabulary_size, embedding_size]``, standard normal by default.
    An index outside ``[0, vocabulary_size)`` is refused where the indices are concrete
    (:data:`OUTSIDE_TABLE`, as torch raises) and reads a NaN row under ``jax.jit`` (never
    another index's row, which JAX's gather would clamp to); it passes no gradient back. The
    gradient is a scatter-add into the looked-up rows.

    ``padding_index=p`` is torch's ``padding_idx``: row ``p`` starts at zeros and gets no
    gradient (it is looked up as stored). A torch state dict does not carry it: give it
    when porting a torch ``Embedding(..., padding_idx=p)``, or the padding row trains.
    torch's ``max_norm=m`` (an in-place change of the weight at each forward) is
    :meth:`renormalized`, called before each step; ``max_norm=`` here is refused
    (:data:`MAX_NORM`).

    ``scale_grad_by_freq=True`` (torch's) divides the gradient each lookup passes back by
    the number of times its index occurs in ``indices`` (the whole call's: torch's batch), so
    row ``r`` gets ``sum_{i: idx_i = r} g_i / count(r)``, the mean of its cotangents, not their
    sum. The output is unchanged; the scaling is a custom JVP (forward and reverse mode).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> emb = ft.nn.Embedding(10, 4, key=jax.random.key(0))
      >>> emb(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)
      >>> padded = ft.nn.Embedding(10, 4, key=jax.random.key(0), padding_index=0)
      >>> grad = ft.gradient(lambda e: e(jnp.array([0, 0, 5])).sum(), at=padded)
      >>> grad.embeddings[0].tolist(), grad.embeddings[5].tolist()
      ([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])
      >>> freq = ft.nn.Embedding(10, 2, key=jax.random.key(0), scale_grad_by_freq=True)
      >>> ft.gradient(lambda e: e(jnp.array([3, 3, 3, 5])).sum(), at=freq).embeddings[jnp.array([3, 5])].tolist()
      [[1.0, 1.0], [1.0, 1.0]]
    """

    embeddings: jax.Array
    padding_index: int | None = field(static=True, default=None)
    scale_grad_by_freq: bool = field(static=True, default=False)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("padding_index", "scale_grad_by_freq")  # files written before them: None, False

    def __init__(
        self,
        vocabulary_size: int,
        embedding_size: int,
        *,
        key: jax.Array,
        dtype: Any = jnp.float32,
        initializer: Initializer = _standard_normal,
        padding_index: int | None = None,
        max_norm: None = None,
        scale_grad_by_freq: bool = False,
    ):
        if max_norm is not None:  # torch's argument: no counterpart in a forward (MAX_NORM says why)
            raise ValueError(MAX_NORM.format(max_norm=max_norm))
        self.embeddings, self.padding_index = embedding_table("Embedding", initializer, key, vocabulary_size,
                                                              embedding_size, dtype, padding_index)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)

    def __call__(self, indices: jax.Array) -> jax.Array:
        check_input(self, indices, (), kind="int")
        check_rows(self, indices)
        rows = table_rows(self.embeddings, indices)
        if self.scale_grad_by_freq:
            rows = frequency_scaled(rows, indices, self.embeddings.shape[0])
        return without_padding_gradient(rows, indices, self.padding_index)

    def renormalized(self, indices: jax.Array, max_norm: float, norm_type: float = 2.0) -> Embedding:
        """This layer with torch's ``max_norm`` renormalization of the rows ``indices`` look up
        (``torch.embedding_renorm_``, which torch's ``Embedding(..., max_norm=m)`` applies to its
        weight in place at every forward)::

            w[r] <- w[r] * m / (||w[r]||_p + 1e-7)   for each distinct row r looked up with ||w[r]||_p > m

        Other rows are unchanged. torch rescales under ``no_grad``: the rescaling passes
        gradients through unscaled (``w - stop_gradient(w) + stop_gradient(w')``), so a gradient taken through
        this call is torch's ``weight.grad``. torch's training is matched step for step by calling it
        on the batch before each step and stepping from the model it returns (torch's
        optimizer steps from the rescaled rows); scaling only a forward's output would drift
        after the first step.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp
          >>> emb = ft.nn.Embedding(4, 2, key=jax.random.key(0), initializer=jax.nn.initializers.constant(3.0))
          >>> tokens = jnp.array([1, 1, 2])
          >>> emb = emb.renormalized(tokens, max_norm=1.0)   # rows 1 and 2 to norm 1, rows 0 and 3 kept
          >>> jnp.linalg.norm(emb.embeddings, axis=-1).round(4)
          Array([4.2426, 1.    , 1.    , 4.2426], dtype=float32)
        """
        check_input(self, indices, (), kind="int")
        check_rows(self, indices)
        return self.replace(embeddings=renormalized_rows(self.embeddings, indices, max_norm, norm_type))


def check_rows(layer: Any, indices: Any) -> None:
    """Raise :class:`LayerInputError` (:data:`OUTSIDE_TABLE`) if concrete ``indices`` hold one
    outside ``[0, rows)`` of ``layer.embeddings``; traced ones are not seen (:func:`table_rows`
    reads NaN rows for them). First, :class:`BatchedLayerError` for an ensemble's table
    ``[models, rows, width]`` (``jax.vmap``-built) outside ``jax.vmap``: Embedding's and
    EmbeddingBag's calls and ``renormalized`` unpacked its shape ("too many values to unpack")."""
    check_unbatched(layer, embeddings=2)
    ids = concrete(indices)
    rows, width = layer.embeddings.shape
    if ids is None or ids.size == 0:
        return
    bad = (ids < 0) | (ids >= rows)
    if not bad.any():
        return
    where = first_index(bad)
    value = int(ids[where])
    name = f"ft.nn.{type(layer).__name__}"
    wrong = f"{name}({rows}, {width}, key=key)(indices)"
    if value < 0:  # torch refuses a negative index too: no count from the end
        codes = ((wrong, f"indices down to {int(ids.min())}"),
                 (f"{name}({rows}, {width}, key=key)(jnp.where(indices < 0, 0, indices))", "the row you mean (0 here)"))
    else:
        codes = ((wrong, f"indices up to {int(ids.max())}"),
                 (f"{name}({int(ids.max()) + 1}, {width}, key=key)(indices)", "vocabulary_size > every index"))
    pad = max(len(code) for code, _ in codes) + 3
    wrong, right = (f"{code:<{pad}}# {note}" for code, note in codes)
    fix = OUTSIDE_TABLE.format(clamped=min(max(value, 0), rows - 1), wrong=wrong, right=right)
    raise LayerInputError(layer, f"indices in [0, {rows}) (int)", f"{value} at indices{list(where)}", fix)


def table_rows(table: jax.Array, indices: jax.Array) -> jax.Array:
    """``table[indices]`` along its first axis; a NaN row for an index outside it (where a
    traced call could not be checked: the wrong index shows as NaN, never as another
    row), which passes no gradient back.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.nn._embedding import table_rows
      >>> table_rows(jnp.arange(4.0).reshape(2, 2), jnp.array([1, 2, -1]))
      Array([[ 2.,  3.],
             [nan, nan],
             [nan, nan]], dtype=float32)
    """
    return jnp.take(table, unwrapped(indices, table.shape[0]), axis=0, mode="fill", fill_value=jnp.nan)


def unwrapped(indices: jax.Array, size: int) -> jax.Array:
    """``indices`` (:func:`_wide`) with each one outside ``[0, size)`` replaced by ``size``,
    just past the end, where a fill-mode gather reads its fill value and a drop-mode scatter
    writes nothing. JAX's gathers and scatters count a negative index from the end (``take``'s
    fill mode too; torch refuses it), and XLA:CPU bounds-checks an int64 index (under
    ``jax_enable_x64``) in its low 32 bits: ``2**32 + 1`` read row 1. In int8, ``size`` 300
    wrapped to 44, so ``-1`` read row 44."""
    indices = _wide(indices)
    return jnp.where((indices < 0) | (indices >= size), size, indices)


def renormalized_rows(w: jax.Array, indices: jax.Array, max_norm: float, norm_type: float) -> jax.Array:
    """``w`` with torch's ``embedding_renorm_`` of the rows ``indices`` look up (an index
    outside the table, seen only where traced, rescales none): each distinct one of ``p``-norm
    above ``max_norm`` scaled to ``max_norm / (norm + 1e-7)`` of itself; the gradient passed
    through unscaled (torch's ``no_grad``). ``Embedding.renormalized`` and
    ``EmbeddingBag.renormalized``."""
    read = unwrapped(indices.ravel(), w.shape[0])
    looked = jnp.zeros(w.shape[0], bool).at[read].set(True, mode="drop")
    norms = jnp.linalg.norm(w, ord=norm_type, axis=-1)
    scale = jnp.where(looked & (norms > max_norm), max_norm / (norms + 1e-7), 1.0).astype(w.dtype)
    rescaled = w * scale[:, None]
    # torch's no_grad: the value rescaled exactly (w - w is 0), the gradient passed through unscaled
    stop = jax.lax.stop_gradient
    return w - stop(w) + stop(rescaled)


def embedding_table(layer: str, initializer: Initializer, key: jax.Array, vocabulary_size: int,
                    embedding_size: int, dtype: Any, padding_index: int | None) -> tuple[jax.Array, int | None]:
    """A ``[vocabulary_size, embedding_size]`` table drawn by ``initializer``, its
    ``padding_index`` row zero (torch's ``padding_idx``; negative counts from the end, as
    torch's), and that index in ``[0, vocabulary_size)``; out of range: :data:`PADDING_INDEX`.
    ``layer`` (``Embedding``, ``EmbeddingBag``) is named by a size that is no int."""
    vocabulary_size, embedding_size = size_arguments(layer, vocabulary_size=vocabulary_size,
                                                     embedding_size=embedding_size)
    table = initialized(initializer, key, (vocabulary_size, embedding_size), dtype)
    if padding_index is None:
        return table, None
    padding_index = operator.index(padding_index)
    if not -vocabulary_size <= padding_index < vocabulary_size:
        raise ValueError(PADDING_INDEX.format(index=padding_index, size=vocabulary_size))
    padding_index %= vocabulary_size
    return table.at[padding_index].set(0), padding_index  # torch's padding row


def _wide(indices: jax.Array) -> jax.Array:
    """Integer ``indices`` of fewer than 32 bits as int32: JAX's scatter normalizes negative
    indices against the table's length in the indices' own type (int8 cannot hold 300)."""
    return indices.astype(jnp.int32) if jnp.dtype(indices.dtype).itemsize < 4 else indices


def frequency_scaled(rows: jax.Array, read: jax.Array, vocabulary_size: int) -> jax.Array:
    """``rows [..., d]`` (looked up at ``read [...]``) as they are, the cotangent of each
    divided by its index's count in ``read`` (torch's ``scale_grad_by_freq``); an index
    outside the table (a NaN row, no gradient) counts for none."""
    read = unwrapped(read, vocabulary_size)
    counts = jnp.zeros((vocabulary_size,), jnp.int32).at[read.ravel()].add(1, mode="drop")
    seen = jnp.take(counts, read, mode="fill", fill_value=1)
    return _tangent_scaled(rows, (1 / seen.astype(rows.dtype))[..., None])


@jax.custom_jvp
def _tangent_scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x``, its tangent (and so its cotangent) times ``scale`` (constant: its tangent unused)."""
    del scale
    return x


@_tangent_scaled.defjvp
def _tangent_scaled_jvp(primals: tuple[jax.Array, jax.Array], tangents: tuple[Any, Any]) -> tuple[jax.Array, Any]:
    x, scale = primals
    return x, tangents[0] * scale


def without_padding_gradient(rows: jax.Array, indices: jax.Array, padding: int | None) -> jax.Array:
    """Looked-up ``rows`` whose lookups of the ``padding`` row pass no cotangent back (its
    gradient from them is zero: torch's ``padding_idx``); ``rows`` as they are for None."""
    if padding is None:
        return rows
    return jnp.where((indices == padding)[..., None], jax.lax.stop_gradient(rows), rows)
