"""Generation's logits controls: Hugging Face's processors (repetition penalty, n-grams, bad
words, EOS held back, suppressed tokens) and warpers (temperature, top-k, top-p, min-p), the
stop-sequence windows, and the choice of the next token. Pure functions of arrays, traced
inside the decode loops (``_decode.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BAD_TOP_K = """\
generate: top_k must be an int from 1 to the vocabulary size ({vocab}), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, top_k=50, key=key)"""

OUTSIDE_VOCAB = """\
generate: {name} {ids} are not ids of this model's vocabulary ({vocab} tokens: 0 to {last}).

    right:  ft.nn.generate(model, input_ids, 8, {name}=[{example}])"""


def _filtered(logits: jax.Array, temperature: Any, top_k: int | None, top_p: Any, min_p: Any = None) -> jax.Array:
    """``logits / temperature`` with ``-inf`` outside the ``top_k`` most likely tokens, then
    outside the smallest set whose probability reaches ``top_p``, then where the probability
    is below ``min_p`` times the largest (None: no filter)."""
    logits = logits.astype(jnp.float32) / temperature
    lowest = jnp.asarray(-jnp.inf, jnp.float32)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, lowest, logits)
    if top_p is not None:
        ordered = -jnp.sort(-logits, axis=-1)  # descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
        kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the first has 0 before it
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, lowest, logits)
    if min_p is not None:  # p < q * p_max, i.e. l < l_max + log q (the most likely token stays)
        probs = jax.nn.softmax(logits, axis=-1)
        logits = jnp.where(probs < min_p * jnp.max(probs, axis=-1, keepdims=True), lowest, logits)
    return logits


def _processed(logits: jax.Array, seen: Any, t: Any, penalty: jax.Array, hold: jax.Array, is_eos: Any, *,
               penalize: bool, holding: bool, banned: Any = None, suppressed: Any = None) -> jax.Array:
    """HF's processors in its order on float32 logits (or log-probabilities) ``[rows, vocab]``:
    the repetition penalty over the tokens ``seen`` (bool ``[rows, vocab]``), the ``banned``
    tokens (bool ``[rows, vocab]``: n-grams, bad words), EOS held back while ``t < hold``, the
    ``suppressed`` tokens (bool ``[vocab]``); each removed token is ``-inf``."""
    lowest = jnp.asarray(-jnp.inf, jnp.float32)
    if penalize:
        logits = jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)
    if banned is not None:
        logits = jnp.where(banned, lowest, logits)
    if holding:
        logits = jnp.where(is_eos & (t < hold), lowest, logits)
    if suppressed is not None:
        logits = jnp.where(suppressed, lowest, logits)
    return logits


def _banned(tokens: jax.Array, real: jax.Array, length: Any, ngram: int, bad: tuple[tuple[int, ...], ...],
            vocab: int) -> jax.Array | None:
    """bool ``[rows, vocab]``: the tokens ``no_repeat_ngram_size`` and ``bad_words_ids`` forbid
    next (None: neither is on)."""
    found = [_repeated_ngrams(tokens, real, length, ngram, vocab)] if ngram else []
    if bad:
        found.append(_bad_words(tokens, real, length, bad, vocab))
    return None if not found else found[0] if len(found) == 1 else found[0] | found[1]


def _bad_words(tokens: jax.Array, real: jax.Array, length: Any, bad: tuple[tuple[int, ...], ...],
               vocab: int) -> jax.Array:
    """bool ``[rows, vocab]``: the last token of each ``bad`` sequence whose other tokens end
    the first ``length`` real tokens of the row (HF's ``bad_words_ids``)."""
    _in_vocabulary("bad_words_ids", [i for word in bad for i in word], vocab)
    rows = tokens.shape[0]
    width = max(len(word) for word in bad) - 1
    prefixes = np.full((len(bad), max(width, 1)), -1, np.int32)  # right-aligned, -1: any token
    for row, word in zip(prefixes, bad):
        if len(word) > 1:
            row[prefixes.shape[1] - (len(word) - 1):] = word[:-1]
    if width == 0:
        match = jnp.ones((rows, len(bad)), bool)
    else:
        tail = _last(tokens, real, length, width)
        match = jnp.all((tail[:, None, :] == prefixes) | (prefixes < 0), axis=-1)  # [rows, words]
    last = np.asarray([word[-1] for word in bad])
    counts = jnp.zeros((rows, vocab), jnp.int32).at[:, last].add(match.astype(jnp.int32))
    return counts > 0


def _made(prompt_mask: jax.Array, new: int, prompt: Any, t: Any) -> jax.Array:
    """bool ``[batch, W + new]`` (``prompt_mask [batch, W]``: the prompt's real tokens, 0 from
    slot ``prompt`` on, the bucket's padding): the real tokens before new token ``t`` (the
    prompt's unpadded ones, then the ``t`` generated at slots ``prompt .. prompt + t - 1``)."""
    slots = jnp.arange(prompt_mask.shape[1] + new)
    generated = (slots >= prompt) & (slots < prompt + t)
    padded = jnp.concatenate([prompt_mask != 0, jnp.zeros((prompt_mask.shape[0], new), bool)], axis=1)
    return padded | generated


def _repeated_ngrams(tokens: jax.Array, real: jax.Array, length: Any, n: int, vocab: int) -> jax.Array:
    """bool ``[rows, vocab]``: the tokens that would complete an ``n``-gram already among the
    first ``length`` tokens of each row (``tokens``/``real`` ``[rows, total]``; padding, not
    ``real``, is part of no n-gram): Hugging Face's ``no_repeat_ngram_size``."""
    rows, total = tokens.shape
    if total < n:
        return jnp.zeros((rows, vocab), bool)
    starts = total - n + 1
    grams = jnp.stack([tokens[:, i:starts + i] for i in range(n)], axis=-1)  # [rows, starts, n]
    whole = jnp.stack([real[:, i:starts + i] for i in range(n)], axis=-1).all(-1)
    whole = whole & (jnp.arange(starts) + n <= length)  # n-grams that end before the next token
    if n > 1:  # (a -2 in the tail, padding or before the row, equals no token)
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


def _in_vocabulary(name: str, ids: Sequence[int], vocab: int) -> None:
    """Raise :data:`OUTSIDE_VOCAB` for the ``ids`` of option ``name`` that are ``>= vocab``."""
    outside = sorted({i for i in ids if i >= vocab})
    if outside:
        raise ValueError(OUTSIDE_VOCAB.format(name=name, ids=outside, vocab=vocab, last=vocab - 1,
                                              example=min(outside[0], vocab - 1)))


def _seen(ids: jax.Array, mask: jax.Array, vocab: int) -> jax.Array:
    """bool ``[batch, vocab]``: the tokens among the real (unpadded) prompt tokens."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, ids].add(mask) > 0  # ids >= vocab: dropped


def _suppressed(ids: tuple[int, ...], vocab: int) -> jax.Array:
    """bool ``[vocab]``: True at ``ids`` (checked against the vocabulary, known once traced)."""
    _in_vocabulary("suppress_tokens", ids, vocab)
    return jnp.zeros((vocab,), bool).at[np.asarray(ids)].set(True)


def _window(ids: jax.Array, mask: jax.Array, prompt: Any, width: int) -> jax.Array:
    """The last ``width - 1`` real tokens of each row's prompt (its first ``prompt`` slots),
    -2 where padding or before the prompt."""
    return _last(ids, mask != 0, prompt, width - 1)


def _stopped(window: jax.Array, token: jax.Array, stop_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Whether ``window`` ``[..., L-1]`` then ``token`` ``[...]`` ends in a stop sequence (the
    rows of ``stop_ids`` ``[S, L]``, right-aligned, -1 before a shorter one); the next window."""
    full = jnp.concatenate([window, token[..., None]], axis=-1)
    hit = jnp.all((full[..., None, :] == stop_ids) | (stop_ids < 0), axis=-1).any(axis=-1)
    return hit, full[..., 1:]


def _choose(logits: jax.Array, key: Any, step: Any, temperature: jax.Array, top_p: jax.Array, min_p: jax.Array, *,
            greedy: bool, top_k: int | None, use_top_p: bool, use_min_p: bool) -> jax.Array:
    """The next token of every row from its logits ``[batch, vocab]``."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = _filtered(logits, temperature, top_k, top_p if use_top_p else None, min_p if use_min_p else None)
    return jax.random.categorical(jax.random.fold_in(key, step), logits, axis=-1).astype(jnp.int32)
