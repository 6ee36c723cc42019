"""The cross entropy of a linear head's logits, computed a chunk of positions at a time.

A language model's last step, ``softmax_cross_entropy(hidden @ W, labels)``, holds the logits
``[positions, vocabulary]`` (and their softmax, for the gradient) in memory at once: 8192
tokens of a 128k vocabulary are 4 GiB in float32 before any weight or activation. Here the
positions are cut into chunks; each chunk's logits are computed, reduced to the chunk's loss
parts and dropped, and the backward pass computes them again chunk by chunk (``jax.checkpoint``
inside a ``lax.scan``), so at most one chunk's logits are alive. The numbers are those of
:func:`~functree.losses.softmax_cross_entropy` on the whole logits (the same per-position
arithmetic; only the order of the final sum differs), for one more head matmul in the
backward pass. torch's ``F.linear_cross_entropy`` / ``nn.LinearCrossEntropyLoss`` compute the
same loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import short_array
from functree.losses._classification import (
    NOT_INTEGER_LABELS,
    _check_labels,
    _class_weights,
    _ignore_index,
    _smoothing,
    _softmax_cross_entropy,
)
from functree.losses._reduction import check_float, check_reduction
from functree.losses._weighted import WeightedMean, ratio

__all__ = ["linear_cross_entropy", "AUTO_CHUNK_ELEMENTS", "chunk_positions"]

AUTO_CHUNK_ELEMENTS = 2**25
"""``chunk_size="auto"``: as many positions per chunk as keep one chunk's logits within this
many elements (128 MiB in float32): 256 positions of a 128k vocabulary, 1024 of 32k. Fewer
positions than that are one chunk, computed as the unchunked loss is."""

HEAD_NOT_A_HEAD = """\
linear_cross_entropy: head must map hidden states [positions, {width}] to logits \
[positions, classes]: a layer or function (ft.nn.Dense, a model's lm_logits), or a weight \
array [{width}, classes] (ft.nn.Dense's layout), got {given}.

    right:  ft.losses.linear_cross_entropy(hidden, model.lm_head, labels)
       or:  ft.losses.linear_cross_entropy(hidden, dense.weight, labels, bias=dense.bias)"""

TORCH_LAYOUT_WEIGHT = """\
linear_cross_entropy: the weight {given} is [classes, {width}], torch's nn.Linear layout \
(F.linear_cross_entropy's linear_weight); here a weight array is [{width}, classes], \
ft.nn.Dense's layout.

    wrong:  ft.losses.linear_cross_entropy(hidden, linear_weight, labels)
    right:  ft.losses.linear_cross_entropy(hidden, linear_weight.T, labels)"""

WEIGHT_SHAPE = """\
linear_cross_entropy: a weight array must be [{width}, classes] for hidden states {hidden} \
(the width of their last axis first), got {given}."""

BIAS_SHAPE = """\
linear_cross_entropy: bias must be [{classes}] (one per class of the weight {weight}), got {given}."""

BIAS_WITH_A_LAYER = """\
linear_cross_entropy: bias= goes with a weight array; the head {head} is a layer or function, \
which adds its own bias.

    wrong:  ft.losses.linear_cross_entropy(hidden, dense, labels, bias=dense.bias)
    right:  ft.losses.linear_cross_entropy(hidden, dense, labels)"""

HEAD_DTYPE = """\
linear_cross_entropy: the weight {weight} and the hidden states {hidden} have other dtypes; \
the head's matmul takes one.

    right:  ft.losses.linear_cross_entropy(hidden, weight.astype(hidden.dtype), labels)"""

HEAD_OUTPUT = """\
linear_cross_entropy: the head maps hidden states {given} to {out}; it must return logits \
[positions, classes] (classes on the last axis, one row per position, at least 2 classes)."""

LABELS_NOT_INDICES = """\
linear_cross_entropy: labels must be integer class indices of shape {index_shape} (the hidden \
states' {hidden} without their last axis), got {given}. Probabilities over the classes would be \
[positions, classes] themselves: compute the logits and take softmax_cross_entropy.

    right:  ft.losses.linear_cross_entropy(hidden, head, labels.reshape({index_shape}).astype(jnp.int32))
       or:  ft.losses.softmax_cross_entropy(head(hidden), probabilities)"""

BAD_CHUNK = """\
linear_cross_entropy: chunk_size must be a positive number of positions or "auto", got {given!r}.

    right:  ft.losses.linear_cross_entropy(hidden, head, labels, chunk_size=1024)"""


def linear_cross_entropy(hidden: Any, head: Any, labels: Any, *, bias: Any = None, chunk_size: int | str = "auto",
                         label_smoothing: float = 0.0, ignore_index: int | None = -100, weight: Any = None,
                         reduction: str = "mean") -> Any:
    """``softmax_cross_entropy(head(hidden), labels)`` without the whole logits in memory.

    ``hidden`` ``[..., width]``; ``head`` maps ``[n, width]`` rows to ``[n, classes]`` logits
    (an :class:`ft.nn.Dense`, a causal LM's ``lm_logits``, any function of the rows), or is a
    weight array ``[width, classes]`` (``ft.nn.Dense``'s layout; torch's ``[classes, width]``
    is refused, naming ``.T``) with ``bias=`` ``[classes]``; ``labels`` integer class indices
    ``[...]``. The positions are flattened and cut into chunks of ``chunk_size`` (``"auto"``:
    :data:`AUTO_CHUNK_ELEMENTS` logits a chunk); per chunk the logits are made, reduced to
    the loss's parts ``(Σ loss, Σ count)`` and dropped, and the gradient makes them again
    (``jax.checkpoint`` in a ``lax.scan``): the most logits alive at once is one chunk's.

    ``label_smoothing``, ``ignore_index``, ``weight`` (class weights) and ``reduction`` are
    :func:`~functree.losses.softmax_cross_entropy`'s, with its numbers: the mean over kept
    positions (weighted by ``weight[label]``), ``"sum"``, ``"none"`` (per position),
    ``"weighted"`` (:class:`~functree.losses.WeightedMean`, for ``accumulate=k``). torch's
    ``F.linear_cross_entropy(x, W, y, linear_bias=b)`` is
    ``linear_cross_entropy(x, W.T, y, bias=b)``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> head = ft.nn.Dense(8, 50, key=jax.random.key(0))
      >>> hidden = jax.random.normal(jax.random.key(1), (4, 6, 8))
      >>> labels = jax.random.randint(jax.random.key(2), (4, 6), 0, 50)
      >>> chunked = ft.losses.linear_cross_entropy(hidden, head, labels, chunk_size=5)
      >>> whole = ft.losses.softmax_cross_entropy(head(hidden), labels)
      >>> bool(jnp.abs(chunked - whole) < 1e-6)
      True
    """
    name = "linear_cross_entropy"
    hidden = check_float(name, "hidden", hidden)
    smoothing = _smoothing(label_smoothing)
    check_reduction(name, reduction)
    ignore_index = _ignore_index(name, ignore_index, "hidden, head, labels")
    if hidden.ndim < 1:
        raise ValueError(HEAD_OUTPUT.format(given=short_array(hidden), out="nothing: hidden has no width axis"))
    width = hidden.shape[-1]
    fn = _head_function(head, bias, hidden)
    classes = _classes(fn, hidden)
    labels = _labels(labels, hidden, classes, ignore_index)
    logits_like = jax.ShapeDtypeStruct((*hidden.shape[:-1], classes), hidden.dtype)
    w = None if weight is None else _class_weights(weight, logits_like)
    rows = hidden.reshape(-1, width)
    flat = labels.reshape(-1)
    chunk = chunk_positions(chunk_size, classes, rows.shape[0])
    parts = _chunked(fn, rows, flat, w, chunk=chunk, ignore_index=ignore_index, smoothing=smoothing,
                     unreduced=reduction == "none")
    if reduction == "none":
        return parts.reshape(labels.shape)
    if reduction == "sum":
        return parts.total
    if reduction == "weighted":
        return parts
    return ratio(parts.total, parts.count)


def chunk_positions(chunk_size: Any, classes: int, positions: int) -> int:
    """The positions a chunk holds: ``chunk_size``; for ``"auto"``, ``positions`` cut into as
    few equal chunks as keep each within :data:`AUTO_CHUNK_ELEMENTS` logits (8192 positions
    of 32000 classes: 8 chunks of 1024, where chunks of 1048 would leave a ninth of 856)."""
    if isinstance(chunk_size, str) and chunk_size == "auto":
        most = max(1, AUTO_CHUNK_ELEMENTS // classes)
        pieces = -(-positions // most)
        return -(-positions // max(pieces, 1))
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(BAD_CHUNK.format(given=chunk_size))
    return int(chunk_size)


def _head_function(head: Any, bias: Any, hidden: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """``head`` as a function of ``[n, width]`` rows: a layer or function as it is, a weight
    array (and ``bias``) as ``rows @ weight (+ bias)``."""
    width = hidden.shape[-1]
    if isinstance(head, (jax.Array, np.ndarray)):
        return _matmul_head(jnp.asarray(head), bias, hidden)
    if not callable(head):
        raise TypeError(HEAD_NOT_A_HEAD.format(width=width, given=_given(head)))
    if bias is not None:
        raise TypeError(BIAS_WITH_A_LAYER.format(head=type(head).__name__))
    return cast(Callable[[jax.Array], jax.Array], head)


def _matmul_head(w: jax.Array, bias: Any, hidden: jax.Array) -> Callable[[jax.Array], jax.Array]:
    width = hidden.shape[-1]
    if w.ndim != 2 or w.shape[0] != width:
        if w.ndim == 2 and w.shape[1] == width:
            raise ValueError(TORCH_LAYOUT_WEIGHT.format(given=short_array(w), width=width))
        raise ValueError(WEIGHT_SHAPE.format(width=width, hidden=short_array(hidden), given=short_array(w)))
    if w.dtype != hidden.dtype:
        raise TypeError(HEAD_DTYPE.format(weight=short_array(w), hidden=short_array(hidden)))
    if bias is None:
        return lambda rows: rows @ w
    b = jnp.asarray(bias)
    if b.shape != (w.shape[1],):
        raise ValueError(BIAS_SHAPE.format(classes=w.shape[1], weight=short_array(w), given=short_array(b)))
    return lambda rows: rows @ w + jax.lax.broadcast_to_rank(b.astype(rows.dtype), rows.ndim)


def _given(x: Any) -> str:
    return short_array(x) if hasattr(x, "shape") and hasattr(x, "dtype") else f"{type(x).__name__} {x!r:.60}"


def _classes(fn: Callable[[jax.Array], jax.Array], hidden: jax.Array) -> int:
    """The number of classes ``fn`` maps a row to (its abstract evaluation on two rows)."""
    rows = jax.ShapeDtypeStruct((2, hidden.shape[-1]), hidden.dtype)
    out = jax.eval_shape(fn, rows)
    shape = getattr(out, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != 2 or shape[1] < 2 or not jnp.issubdtype(out.dtype, jnp.inexact):
        raise ValueError(HEAD_OUTPUT.format(given=short_array(rows), out=_given(out) if shape is not None else repr(out)))
    return int(shape[1])


def _labels(labels: Any, hidden: jax.Array, classes: int, ignore_index: int | None) -> jax.Array:
    """``labels`` checked (integer class indices of ``hidden``'s positions, each a class or
    ``ignore_index``: concrete ones read on the host), as an array."""
    host = None if isinstance(labels, jax.Array) else np.asarray(labels)
    given = labels if host is None else host
    index_shape = list(hidden.shape[:-1])
    if given.shape != hidden.shape[:-1]:
        raise ValueError(LABELS_NOT_INDICES.format(index_shape=index_shape, hidden=short_array(hidden),
                                                   given=short_array(given)))
    if not jnp.issubdtype(given.dtype, jnp.integer):
        raise TypeError(NOT_INTEGER_LABELS.format(given=short_array(given), index_shape=index_shape,
                                                  prob_shape=[*index_shape, classes], classes=classes,
                                                  dtype=given.dtype))
    _check_labels(given, classes, ignore_index, jax.ShapeDtypeStruct((*hidden.shape[:-1], classes), hidden.dtype))
    return jnp.asarray(given)


def _chunked(fn: Callable[[jax.Array], jax.Array], rows: jax.Array, labels: jax.Array, w: Any, *, chunk: int,
             ignore_index: int | None, smoothing: float, unreduced: bool) -> Any:
    """The loss's parts over ``rows`` (``WeightedMean(Σ loss, Σ count)``), or its per-row
    values (``unreduced``), a chunk of ``chunk`` rows at a time: full chunks in a scan, the
    rest as one more chunk."""
    options = {"ignore_index": ignore_index, "smoothing": smoothing, "indices": True,
               "reduction": "none" if unreduced else "weighted"}

    def part(x: jax.Array, y: jax.Array) -> Any:
        return _softmax_cross_entropy(fn(x), y, w, **options)

    n = rows.shape[0]
    if n <= chunk:  # one chunk: the unchunked computation
        return part(rows, labels)
    recomputed = jax.checkpoint(part, prevent_cse=False)  # the backward pass makes the logits again
    full = n // chunk
    xs = (rows[:full * chunk].reshape(full, chunk, rows.shape[1]), labels[:full * chunk].reshape(full, chunk))
    _, each = jax.lax.scan(lambda carry, xy: (carry, recomputed(*xy)), None, xs)  # per chunk: values or parts
    rest = recomputed(rows[full * chunk:], labels[full * chunk:]) if n > full * chunk else None
    if unreduced:
        values = each.reshape(-1)
        return values if rest is None else jnp.concatenate([values, rest])
    total, count = jnp.sum(each.total), jnp.sum(each.count)
    return WeightedMean(total, count) if rest is None else WeightedMean(total + rest.total, count + rest.count)
