"""Generation's array helpers: the n-grams and bad words a row forbids next, the tokens seen,
and the stop-sequence windows. Pure functions of arrays, traced
inside the decode loops (``_decode.py``) and the controls' records (``_controls.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

OUTSIDE_VOCAB = """\
generate: {name} {ids} are not ids of this model's vocabulary ({vocab} tokens: 0 to {last}).

    right:  ft.nn.generate(model, input_ids, 8, {name}={example})"""


def bad_word_ends(tokens: jax.Array, real: jax.Array, length: Any, bad: tuple[tuple[int, ...], ...],
                  vocab: int) -> jax.Array:
    """bool ``[rows, vocab]``: the last token of each ``bad`` sequence whose other tokens end
    the first ``length`` real tokens of the row (HF's ``bad_words_ids``)."""
    check_in_vocabulary("bad_words_ids", [i for word in bad for i in word], vocab, nested=True)
    match = word_matches(tokens, real, length, bad)
    last = np.asarray([word[-1] for word in bad])
    counts = jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[:, last].add(match.astype(jnp.int32))
    return counts > 0


def word_matches(tokens: jax.Array, real: jax.Array, length: Any, words: tuple[tuple[int, ...], ...]) -> jax.Array:
    """bool ``[rows, words]``: whether each sequence's tokens but its last end the first
    ``length`` real tokens of the row (a one-token sequence: always)."""
    rows = tokens.shape[0]
    width = max(len(word) for word in words) - 1
    if width == 0:
        return jnp.ones((rows, len(words)), bool)
    prefixes = np.full((len(words), width), -1, np.int32)  # right-aligned, -1: any token
    for row, word in zip(prefixes, words):
        if len(word) > 1:
            row[width - (len(word) - 1):] = word[:-1]
    tail = _last(tokens, real, length, width)
    prefixes = prefixes[None]  # [1, words, width] (by hand: rank promotion may raise)
    return jnp.all((tail[:, None, :] == prefixes) | (prefixes < 0), axis=-1)


def ngram_completions(tokens: jax.Array, real: jax.Array, length: Any, n: int, vocab: int) -> jax.Array:
    """bool ``[rows, vocab]``: the tokens that would complete an ``n``-gram already among the
    first ``length`` tokens of each row (``tokens``/``real`` ``[rows, total]``; a token not
    ``real`` is part of no n-gram): Hugging Face's ``no_repeat_ngram_size``, whose rows are
    ``Now.row()``, the left padding's ids included as HF's ``input_ids`` hold them."""
    rows, total = tokens.shape
    if total < n:
        return jnp.zeros((rows, vocab), bool)
    starts = total - n + 1
    grams = jnp.stack([tokens[:, i:starts + i] for i in range(n)], axis=-1)  # [rows, starts, n]
    whole = jnp.stack([real[:, i:starts + i] for i in range(n)], axis=-1).all(-1)
    whole = whole & (jax.lax.broadcast_to_rank(jnp.arange(starts) + n, whole.ndim) <= length)  # n-grams that end before the next token
    if n > 1:  # (a -2 in the tail, not real or before the row, equals no token)
        whole = whole & jnp.all(grams[..., :-1] == _last(tokens, real, length, n - 1)[:, None, :], axis=-1)
    counts = jnp.zeros((rows, vocab), jnp.int32)
    counts = counts.at[jnp.arange(rows)[:, None], grams[..., -1]].add(whole.astype(jnp.int32))
    return counts > 0


def _last(tokens: jax.Array, real: jax.Array, length: Any, width: int) -> jax.Array:
    """``[rows, width]``: the tokens just before position ``length`` of each row (``tokens``,
    ``real`` ``[rows, total]``), -2 where a token is not ``real`` (padding) or before the row."""
    known = jnp.where(real, tokens, -2)
    known = jnp.concatenate([jnp.full((tokens.shape[0], width), -2, known.dtype), known], axis=1)
    return jax.lax.dynamic_slice_in_dim(known, length, width, axis=1)


def check_in_vocabulary(name: str, ids: Sequence[int], vocab: int, nested: bool = False) -> None:
    """Raise :data:`OUTSIDE_VOCAB` for the ``ids`` of option ``name`` that are ``>= vocab``
    (``nested``: the option is a list of id lists, as ``stop``, and its example one)."""
    outside = sorted({i for i in ids if i >= vocab})
    if outside:
        example = f"[{min(outside[0], vocab - 1)}]"
        raise ValueError(OUTSIDE_VOCAB.format(name=name, ids=outside, vocab=vocab, last=vocab - 1,
                                              example=f"[{example}]" if nested else example))


def prompt_tokens(ids: jax.Array, mask: jax.Array, vocab: int) -> jax.Array:
    """bool ``[batch, vocab]``: the tokens among the real (unpadded) prompt tokens."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, ids].add(mask) > 0  # ids >= vocab: dropped


def stop_window(ids: jax.Array, mask: jax.Array, prompt: Any, width: int) -> jax.Array:
    """The last ``width - 1`` real tokens of each row's prompt (its first ``prompt`` slots),
    -2 where padding or before the prompt."""
    return _last(ids, mask != 0, prompt, width - 1)


def stop_hit(window: jax.Array, token: jax.Array, stop_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Whether ``window`` ``[..., L-1]`` then ``token`` ``[...]`` ends in a stop sequence (the
    rows of ``stop_ids`` ``[S, L]``, right-aligned, -1 before a shorter one); the next window."""
    full = jnp.concatenate([window, token[..., None]], axis=-1)
    stops = jax.lax.broadcast_to_rank(stop_ids, full.ndim + 1)  # [..., S, L] (by hand: rank promotion may raise)
    hit = jnp.all((full[..., None, :] == stops) | (stops < 0), axis=-1).any(axis=-1)
    return hit, full[..., 1:]
