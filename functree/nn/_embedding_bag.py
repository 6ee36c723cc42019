"""EmbeddingBag: each bag of indices reduced to one vector (torch's ``nn.EmbeddingBag``)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._module import field
from functree._repr import short_array
from functree.nn._check import LayerInputError, check_input, concrete
from functree.nn._embedding import (
    check_rows,
    embedding_table,
    frequency_scaled,
    renormalized_rows,
    table_rows,
)
from functree.nn._linear import Initializer
from functree.nn._mode import Layer

__all__ = ["EmbeddingBag"]

_standard_normal = jax.nn.initializers.normal(1.0)

BAD_MODE = """\
ft.nn.EmbeddingBag: mode must be "sum", "mean" or "max", got {mode!r}.

    right:  ft.nn.EmbeddingBag(n, d, mode="mean", key=key)   # torch's default"""

MAX_FREQUENCY = """\
ft.nn.EmbeddingBag: scale_grad_by_freq=True divides each entry's gradient by its index's count; \
mode="max" passes the gradient to one entry per feature, and takes no such scaling (torch's rule: \
"max mode does not support scaling the gradient by the frequency").

    wrong:  ft.nn.EmbeddingBag(n, d, mode="max", scale_grad_by_freq=True, key=key)
    right:  ft.nn.EmbeddingBag(n, d, mode="max", key=key)"""

BAGS = """\
ft.nn.EmbeddingBag: {why}

    right:  bag(indices_2d)                        # [B, N]: each row a bag of N indices
       or:  bag(indices_1d, offsets)               # [n] and int [B]: bag b is indices[offsets[b]:offsets[b + 1]]"""

NEEDS_OFFSETS = "1-D indices need offsets= (where each bag starts); a [B, N] array needs none."
OFFSETS_WITH_2D = "offsets= is for 1-D indices; the rows of a 2-D [B, N] array are its bags already."
BAD_OFFSETS = ("offsets must be 1-D integers starting at 0, nondecreasing, at most len(indices) = {n} "
               "(with include_last_offset=True: at least two, B + 1 for B bags), got {given}.")

TRACED_OFFSETS = """\
Offsets that do not start at 0, decrease, or pass len(indices) do not cut the indices into bags: \
torch raises ("offsets[0] has to be 0", "offsets[-1] can not be greater than input's length"), and \
JAX's segment sums would drop the entries before offsets[0] and shift the bags silently. Under \
jax.jit, where the values are not seen, the output is NaN; make offsets the bags' starts:
    wrong:  bag(indices, jnp.array([1, 3]))      # indices [0] belongs to no bag
    right:  bag(indices, jnp.array([0, 1, 3]))   # bag 0 is indices[0:1]"""

SUM_ONLY = """\
ft.nn.EmbeddingBag: per_sample_weights= weighs each index's row in a sum; mode={mode!r} takes none \
(torch's rule).

    wrong:  ft.nn.EmbeddingBag(n, d, mode={mode!r}, key=key)(indices, offsets, per_sample_weights=w)
    right:  ft.nn.EmbeddingBag(n, d, mode="sum", key=key)(indices, offsets, per_sample_weights=w)"""

BAD_WEIGHTS = "Pass per_sample_weights of the indices' shape {shape}, floating: one weight per index."

MAX_NORM = """\
ft.nn.EmbeddingBag: max_norm={max_norm!r} is torch's in-place side effect: each forward of torch's \
EmbeddingBag(..., max_norm=m) rescales the rows its indices look up inside the weight itself \
(under no_grad), and the optimizer then steps from the rescaled rows; a forward here changes no \
table. Make the change explicit, before each step (as ft.nn.Embedding's):

    wrong:  bag = ft.nn.EmbeddingBag(n, d, key=key, max_norm={max_norm!r})
    right:  bag = ft.nn.EmbeddingBag(n, d, key=key)
            bag = bag.renormalized(indices, {max_norm!r})    # torch's renorm of the rows the indices look up
            loss, grads = ...(bag, indices, offsets)     # then the step, from the renormalized table"""


def _broken(offsets: Any, n: int) -> Any:
    """Whether ``offsets`` (1-D integers, at least one) fail :data:`BAD_OFFSETS`: a first entry
    other than 0, a decrease, or an entry past ``n``. The one rule for both: NumPy offsets
    (concrete: refused) and traced ones (:data:`TRACED_OFFSETS`: a NaN output)."""
    wide = offsets.astype(np.int32) if offsets.dtype.itemsize < 4 else offsets  # uint8 cannot hold 300
    return (wide[0] != 0) | (wide[1:] < wide[:-1]).any() | (wide[-1] > n)


class EmbeddingBag(Layer):
    """Each bag of indices as the ``"sum"``, ``"mean"`` (the default) or ``"max"`` of its rows.

    ``bag(indices)`` with ``[B, N]`` integer indices: row ``b`` is a bag. ``bag(indices,
    offsets)`` with 1-D indices and ``offsets [B]``: bag ``b`` is ``indices[offsets[b]:
    offsets[b + 1]]`` (the last to the end; ``include_last_offset=True``: ``offsets`` has
    ``B + 1`` entries, the last normally ``len(indices)``; as torch's, a last entry below it is
    read as ``len(indices)``: the last bag still runs to the end). Returns ``[B, embedding_size]``; an
    empty bag is zeros. ``"max"`` takes each feature's first maximum in the bag, which alone
    gets its gradient (torch's; a NaN propagates). ``per_sample_weights`` (the indices' shape;
    ``"sum"`` only) weighs each row. ``padding_index=p`` (torch's ``padding_idx``): row ``p`` starts at zeros, and its
    entries are left out of their bags (not counted by the mean, never the max) and get no
    gradient. ``embeddings`` is torch's ``weight``. As ``ft.nn.Embedding``, an index outside the
    table is refused where the indices are concrete and reads a NaN row under ``jax.jit``
    (never another index's row); offsets are checked eagerly (:data:`BAD_OFFSETS`), and under
    ``jax.jit`` (their values unknown) offsets that do not start at 0, decrease or pass
    ``len(indices)`` make the whole output NaN (:data:`TRACED_OFFSETS`: never bags that
    silently drop or shift entries).
    torch's ``max_norm=m`` (an in-place change of the weight at each forward) is
    :meth:`renormalized`, called before each step; ``max_norm=`` here is refused
    (:data:`MAX_NORM`). ``scale_grad_by_freq=True`` (torch's) divides the gradient each entry
    passes back to its row by the number of times its index occurs in the call's ``indices``
    (all bags; padding entries counted too, as torch's): row ``r`` gets ``sum_{i: idx_i = r}
    g_i / count(r)`` (``g_i``: entry ``i``'s share of its bag's cotangent, weighted or
    averaged); ``per_sample_weights``' gradient is unscaled; ``mode="max"`` refuses it
    (torch's rule, :data:`MAX_FREQUENCY`). This is torch's documented gradient, its CUDA one,
    and ``nn.Embedding``'s; torch 2.13's CPU ``EmbeddingBag`` divides a row by another row's
    count where an index occurring once sorts after a repeated one (pytorch#190063).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> bag = ft.nn.EmbeddingBag(10, 3, mode="sum", key=jax.random.key(0))
      >>> out = bag(jnp.array([1, 2, 4, 5, 4]), jnp.array([0, 2]))     # bags [1, 2] and [4, 5, 4]
      >>> bool(jnp.allclose(out[1], bag.embeddings[jnp.array([4, 5, 4])].sum(0)))
      True
    """

    embeddings: jax.Array
    mode: str = field(static=True, default="mean")
    padding_index: int | None = field(static=True, default=None)
    include_last_offset: bool = field(static=True, default=False)
    scale_grad_by_freq: bool = field(static=True, default=False)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("scale_grad_by_freq",)  # files written before it: False

    def __init__(
        self, vocabulary_size: int, embedding_size: int, mode: str = "mean", *, key: jax.Array,
        dtype: Any = jnp.float32, initializer: Initializer = _standard_normal, padding_index: int | None = None,
        include_last_offset: bool = False, max_norm: None = None, scale_grad_by_freq: bool = False,
    ):
        if max_norm is not None:  # torch's argument: no counterpart in a forward (MAX_NORM says why)
            raise ValueError(MAX_NORM.format(max_norm=max_norm))
        if mode not in ("sum", "mean", "max"):
            raise ValueError(BAD_MODE.format(mode=mode))
        if mode == "max" and scale_grad_by_freq:
            raise ValueError(MAX_FREQUENCY)
        self.embeddings, self.padding_index = embedding_table("EmbeddingBag", initializer, key, vocabulary_size,
                                                              embedding_size, dtype, padding_index)
        self.mode, self.include_last_offset = mode, bool(include_last_offset)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)

    def __call__(self, indices: Any, offsets: Any = None, per_sample_weights: Any = None) -> jax.Array:
        indices = jnp.asarray(indices)
        check_input(self, indices, (), kind="int")
        if indices.ndim == 2 and offsets is not None:
            raise ValueError(BAGS.format(why=OFFSETS_WITH_2D))
        if indices.ndim == 1 and offsets is None:
            raise ValueError(BAGS.format(why=NEEDS_OFFSETS))
        if indices.ndim not in (1, 2):
            raise LayerInputError(self, "indices [B, N] or [n] with offsets (int)", short_array(indices),
                                  BAGS.format(why=NEEDS_OFFSETS))
        check_rows(self, indices)
        weights = self._weights(indices, per_sample_weights)
        if indices.ndim == 2:  # each row a bag
            bags, n = jnp.broadcast_to(jnp.arange(indices.shape[0])[:, None], indices.shape), indices.shape[0]
        else:
            bags, n = self._bags(indices, offsets)
        out = self._reduce(indices.ravel(), bags.ravel(), n, None if weights is None else weights.ravel())
        if isinstance(offsets, Tracer):  # traced offsets, unchecked (_bags): NaN if they are not bags
            out = jnp.where(_broken(jnp.asarray(offsets), indices.shape[0]), jnp.asarray(jnp.nan, out.dtype), out)
        return out

    def renormalized(self, indices: Any, max_norm: float, norm_type: float = 2.0) -> EmbeddingBag:
        """This layer with torch's ``max_norm`` renormalization of the rows ``indices`` look up
        (all of them, 1-D or ``[B, N]``, padding entries included: torch's ``embedding_bag``
        calls ``embedding_renorm_`` on its input before reducing)::

            w[r] <- w[r] * m / (||w[r]||_p + 1e-7)   for each distinct row r looked up with ||w[r]||_p > m

        the gradient passed through unscaled, as ``ft.nn.Embedding.renormalized``: call it on
        the batch before each step and step from the layer it returns, torch's training step
        for step.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp
          >>> bag = ft.nn.EmbeddingBag(4, 2, "sum", key=jax.random.key(0),
          ...                          initializer=jax.nn.initializers.constant(3.0))
          >>> bag = bag.renormalized(jnp.array([1, 2, 2]), max_norm=1.0)   # rows 1 and 2 to norm 1
          >>> jnp.linalg.norm(bag.embeddings, axis=-1).round(4)
          Array([4.2426, 1.    , 1.    , 4.2426], dtype=float32)
        """
        indices = jnp.asarray(indices)
        check_input(self, indices, (), kind="int")
        check_rows(self, indices)
        return self.replace(embeddings=renormalized_rows(self.embeddings, indices, max_norm, norm_type))

    def _weights(self, indices: jax.Array, weights: Any) -> jax.Array | None:
        if weights is None:
            return None
        if self.mode != "sum":
            raise ValueError(SUM_ONLY.format(mode=self.mode))
        weights = jnp.asarray(weights)
        if weights.shape != indices.shape or not jnp.issubdtype(weights.dtype, jnp.floating):
            raise LayerInputError(self, f"per_sample_weights {list(indices.shape)} (float)", short_array(weights),
                                  BAD_WEIGHTS.format(shape=list(indices.shape)))
        return weights

    def _bags(self, indices: jax.Array, offsets: Any) -> tuple[jax.Array, int]:
        """Each index's bag number and the number of bags."""
        offsets = jnp.asarray(offsets)
        n = indices.shape[0]
        given = concrete(offsets)
        least = 2 if self.include_last_offset else 1  # torch 2.13 crashes on include_last_offset with [0]
        ok = offsets.ndim == 1 and jnp.issubdtype(offsets.dtype, jnp.integer) and offsets.shape[0] >= least
        if ok and given is not None:
            ok = not _broken(given, n)
        if not ok:
            raise ValueError(BAGS.format(why=BAD_OFFSETS.format(n=n, given=short_array(offsets) if given is None
                                                                 else given.tolist())))
        if self.include_last_offset:  # torch 2.13 ignores the last entry: the last bag runs to the end
            offsets = offsets[:-1]
        # the positions 0..n-1 in a type that holds them (an 8- or 16-bit offsets' own wraps at 256 / 65536)
        wide = jnp.dtype(jnp.int32) if offsets.dtype.itemsize < 4 else offsets.dtype
        bags = jnp.searchsorted(offsets.astype(wide), jnp.arange(n, dtype=wide), side="right") - 1
        return bags, offsets.shape[0]

    def _reduce(self, indices: jax.Array, bags: jax.Array, n: int, weights: jax.Array | None) -> jax.Array:
        w = self.embeddings
        rows = table_rows(w, indices)  # NaN for an index outside (traced: check_rows could not see it)
        if self.scale_grad_by_freq:
            rows = frequency_scaled(rows, indices, w.shape[0])
        kept = jnp.ones(indices.shape, bool) if self.padding_index is None else indices != self.padding_index
        if self.mode == "max":  # torch's: each feature's first maximum in the bag, where the gradient goes
            # (segment_max's split it between equal maxima); a NaN propagates (the first NaN picked)
            count = indices.shape[0]
            masked = jnp.where(kept[:, None], rows, jnp.asarray(-jnp.inf, rows.dtype))
            found = jax.ops.segment_max(jax.lax.stop_gradient(masked), bags, n)  # [n, d]
            hit = kept[:, None] & ((masked == found[bags]) | jnp.isnan(masked))
            first = jax.ops.segment_min(jnp.where(hit, jnp.arange(count)[:, None], count), bags, n)
            picked = jnp.take_along_axis(masked, jnp.minimum(first, max(count - 1, 0)), axis=0)
            return jnp.where(first >= count, jnp.zeros((), rows.dtype), picked)  # an empty bag: zeros
        scale = kept.astype(rows.dtype) if weights is None else jnp.where(kept, weights.astype(rows.dtype), 0)
        total = jax.ops.segment_sum(rows * scale[:, None], bags, n)
        if self.mode == "sum":
            return total
        count = jax.ops.segment_sum(kept.astype(rows.dtype), bags, n)
        return total / jnp.maximum(count, 1)[:, None]
