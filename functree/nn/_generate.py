"""Autoregressive generation with a key-value cache: prefill and decode in one compiled call.

``generate`` drives any model that follows the cache protocol::

    cache = model.init_cache(batch_size, max_length, dtype=None)
    logits, cache = model(input_ids, attention_mask=am, positions=pos, cache=cache)

with ``input_ids`` int32 ``[batch, T]``, ``pos`` int32 ``[batch, T]`` (the cache slots of the
tokens: ``0 .. P-1`` for a prompt of length ``P``, then ``P, P+1, ...``), ``am`` int32
``[batch, max_length]`` (1 at the slots that hold a real token: the prompt without its left
padding and everything generated so far, the current tokens included) and ``logits``
``[batch, T, vocab]``. A model may define ``max_positions`` (an int: the longest sequence
it takes, e.g. the size of a learned position embedding); ``generate`` then refuses to go
past it.

One ``jax.jit``-compiled function runs the prompt through the model once (prefill), then a
``lax.while_loop`` feeds one token per step until ``max_new_tokens`` are made or every row has
emitted an end-of-sequence token. It compiles once per model structure, input shape and
static option (``max_new_tokens``, ``top_k``, whether it samples, whether it filters by
``top_p``, whether it stops at EOS and how many EOS ids); the temperature, the ``top_p``
value, the key, the EOS and pad ids and the tokens are traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import short_array
from functree.nn._shared import Shared

__all__ = ["generate"]

NOT_A_GENERATOR = """\
generate: the model must follow the cache protocol; a {type} has no init_cache(batch_size, \
max_length, dtype=None).

    right:  class LM(ft.Module):
                def init_cache(self, batch_size, max_length, dtype=None):
                    return self.blocks.init_cache(batch_size, max_length, dtype)
                def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None):
                    ...                       # with a cache: return logits, cache
    (see docs/guides/generation.md)"""

BAD_MODEL_OUTPUT = """\
generate: model(input_ids, attention_mask=am, positions=pos, cache=cache) must return \
(logits [batch, T, vocab] float, cache of the same structure), got {given} for input_ids \
{ids}.

    right:  return self.head(x), cache"""

BAD_INPUT_IDS = """\
generate: input_ids must be integer token ids [batch, prompt_length], got {given}.

    wrong:  ft.nn.generate(model, jnp.array([5, 7, 9]), 8)
    right:  ft.nn.generate(model, jnp.array([[5, 7, 9]], jnp.int32), 8)   # a batch of one"""

BAD_NEW_TOKENS = """\
generate: max_new_tokens must be an int >= 1, got {given!r}.

    right:  ft.nn.generate(model, input_ids, 32)"""

TOO_LONG = """\
generate: the prompt ({prompt} tokens) plus max_new_tokens ({new}) is {total} positions, but \
the model takes at most max_positions = {limit}.

    wrong:  ft.nn.generate(model, input_ids, {new})
    right:  ft.nn.generate(model, input_ids, {fit})      # or a shorter prompt"""

BAD_ATTENTION_MASK = """\
generate: attention_mask must be bool or 0/1 integers with input_ids' shape {shape} (1 = a real \
token, 0 = left padding), got {given}.

    right:  ft.nn.generate(model, input_ids, 8, attention_mask=input_ids != pad_id)"""

RIGHT_PADDED = """\
generate: row {row} of attention_mask ends in padding; pad prompts on the left so that \
every row's last token is real (new tokens follow it).

    wrong:  attention_mask = [[1, 1, 0, 0]]            # tokenizer(..., padding_side="right")
    right:  attention_mask = [[0, 0, 1, 1]]            # tokenizer(..., padding_side="left")"""

BAD_TEMPERATURE = """\
generate: temperature must be a number >= 0 (0: greedy), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=0.7, key=jax.random.key(0))"""

NEEDS_KEY = """\
generate: sampling (temperature={temperature}) needs key= (a jax.random key); the same key \
gives the same tokens.

    wrong:  ft.nn.generate(model, input_ids, 8, temperature={temperature})
    right:  ft.nn.generate(model, input_ids, 8, temperature={temperature}, key=jax.random.key(0))"""

GREEDY_OPTIONS = """\
generate: {name}= filters the tokens that sampling draws from, but temperature=0.0 is greedy \
(the most likely token, whatever {name} says).

    wrong:  ft.nn.generate(model, input_ids, 8, {name}={value!r})
    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, {name}={value!r}, key=key)"""

BAD_TOP_K = """\
generate: top_k must be an int from 1 to the vocabulary size ({vocab}), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, top_k=50, key=key)"""

BAD_TOP_P = """\
generate: top_p must be a number in (0, 1] (the probability mass kept), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, top_p=0.9, key=key)"""

BAD_TOKEN_ID = """\
generate: {name} must be a token id (an int >= 0){plural}, got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, {name}={example})"""


def generate(
    model: Any,
    input_ids: Any,
    max_new_tokens: int,
    *,
    attention_mask: Any = None,
    key: jax.Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> jax.Array:
    """``input_ids [batch, P]`` followed by ``max_new_tokens`` generated tokens: ``[batch, P + N]``.

    Each new token is drawn from the model's next-token distribution given everything before
    it: with ``temperature=0.0`` the most likely token (greedy); otherwise a sample of
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and then
    to the smallest set whose probability reaches ``top_p`` (nucleus sampling; the order and
    rules of Hugging Face's ``generate``). Step ``t`` draws with ``jax.random.fold_in(key, t)``:
    the same key gives the same tokens. A row that emits ``eos_token_id`` (an id or a list of
    ids) is finished: its later tokens are ``pad_token_id`` (default: the first EOS id), and
    the loop stops early once every row is finished.

    ``attention_mask`` (bool or 0/1, ``[batch, P]``) marks the real tokens of left-padded
    prompts (0 = padding, at the start of a row). ``model`` follows the cache protocol (see
    the module, and ``docs/guides/generation.md``): ``model.init_cache(batch, P + N)`` and
    ``model(ids, attention_mask=am, positions=pos, cache=cache) -> (logits, cache)``. The
    prompt is one call (prefill), then one token per step in a ``lax.while_loop``, all in one
    compiled function: the same shapes and options compile once.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> class TinyLM(ft.Module):
      ...     embed: ft.nn.Embedding
      ...     attn: ft.nn.MultiheadAttention
      ...     head: ft.nn.Dense
      ...     def __init__(self, vocab, d, *, key):
      ...         k1, k2, k3 = jax.random.split(key, 3)
      ...         self.embed = ft.nn.Embedding(vocab, d, key=k1)
      ...         self.attn = ft.nn.MultiheadAttention(d, 2, rotary=True, causal=True, key=k2)
      ...         self.head = ft.nn.Dense(d, vocab, key=k3)
      ...     def init_cache(self, batch_size, max_length, dtype=None):
      ...         return self.attn.init_cache(batch_size, max_length, dtype)
      ...     def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None):
      ...         x = self.embed(input_ids)
      ...         y, cache = self.attn(x, mask=attention_mask, positions=positions, cache=cache)
      ...         return self.head(x + y), cache
      >>> lm = TinyLM(11, 8, key=jax.random.key(0))
      >>> prompt = jnp.array([[3, 4, 5], [0, 6, 7]], jnp.int32)   # row 1 is left-padded
      >>> mask = jnp.array([[1, 1, 1], [0, 1, 1]], jnp.int32)
      >>> out = ft.nn.generate(lm, prompt, 4, attention_mask=mask)
      >>> out.shape, out.dtype
      ((2, 7), dtype('int32'))
      >>> sampled = ft.nn.generate(lm, prompt, 4, attention_mask=mask, temperature=0.8, top_k=3,
      ...                          key=jax.random.key(1))
      >>> bool((sampled == ft.nn.generate(lm, prompt, 4, attention_mask=mask, temperature=0.8,
      ...                                 top_k=3, key=jax.random.key(1))).all())
      True
    """
    if not callable(getattr(model, "init_cache", None)):
        raise TypeError(NOT_A_GENERATOR.format(type=type(model).__name__))
    ids = input_ids if isinstance(input_ids, jax.Array) else np.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] < 1:
        raise ValueError(BAD_INPUT_IDS.format(given=short_array(ids)))
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(BAD_NEW_TOKENS.format(given=max_new_tokens))
    new, prompt = int(max_new_tokens), ids.shape[1]
    limit = getattr(model.model if isinstance(model, Shared) else model, "max_positions", None)
    if isinstance(limit, int) and prompt + new > limit:
        raise ValueError(TOO_LONG.format(prompt=prompt, new=new, total=prompt + new, limit=limit,
                                         fit=max(limit - prompt, 1)))
    mask = _attention_mask(attention_mask, ids.shape)
    greedy = _greedy(temperature, key, top_k, top_p)
    eos = _token_ids(eos_token_id, "eos_token_id")
    pad = _token_ids(pad_token_id, "pad_token_id", single=True)
    fill = pad[0] if pad else (eos[0] if eos else 0)
    return _generate(
        model, jnp.asarray(ids, jnp.int32), mask, key, jnp.asarray(temperature if not greedy else 1.0, jnp.float32),
        jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), jnp.asarray(eos or (-1,), jnp.int32),
        jnp.asarray(fill, jnp.int32),
        new=new, greedy=greedy, top_k=top_k, use_top_p=top_p is not None and top_p < 1.0, stops=bool(eos),
    )


def _attention_mask(mask: Any, shape: tuple[int, ...]) -> jax.Array:
    if mask is None:
        return jnp.ones(shape, jnp.int32)
    m = mask if isinstance(mask, jax.Array) else np.asarray(mask)
    kind = jnp.issubdtype(m.dtype, jnp.bool_) or jnp.issubdtype(m.dtype, jnp.integer)
    if not kind or tuple(m.shape) != tuple(shape):
        raise ValueError(BAD_ATTENTION_MASK.format(shape=list(shape), given=short_array(m)))
    try:
        last = np.asarray(m)[:, -1]  # a concrete mask (a traced one is not checked)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        last = None
    if last is not None and not last.all():
        raise ValueError(RIGHT_PADDED.format(row=int(np.argmin(last != 0))))
    return jnp.asarray(m != 0 if m.dtype != jnp.bool_ else m, jnp.int32)


def _greedy(temperature: Any, key: Any, top_k: Any, top_p: Any) -> bool:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)) \
            or not temperature >= 0:
        raise ValueError(BAD_TEMPERATURE.format(given=temperature))
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(BAD_TOP_K.format(vocab="vocab", given=top_k))
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating))
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(BAD_TOP_P.format(given=top_p))
    if temperature == 0:
        for name, value in (("top_k", top_k), ("top_p", top_p)):
            if value is not None:
                raise ValueError(GREEDY_OPTIONS.format(name=name, value=value))
        return True
    if key is None:
        raise ValueError(NEEDS_KEY.format(temperature=temperature))
    return False


def _token_ids(value: Any, name: str, single: bool = False) -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if single or isinstance(value, (int, np.integer)) else value
    try:
        ok = len(values) >= 1 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in values
        )
    except TypeError:
        ok = False
    if not ok:
        plural = "" if single else " or a list of them"
        raise ValueError(BAD_TOKEN_ID.format(name=name, plural=plural, given=value, example=2))
    return tuple(int(v) for v in values)


def _call(model: Any, ids: jax.Array, am: jax.Array, pos: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    out = model(ids, attention_mask=am, positions=pos, cache=cache)
    ok = isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape")
    if ok:
        logits, new = out
        ok = (logits.ndim == 3 and logits.shape[:2] == ids.shape and jnp.issubdtype(logits.dtype, jnp.floating)
              and jax.tree.structure(new) == jax.tree.structure(cache))
    if not ok:
        if hasattr(out, "shape") and hasattr(out, "dtype"):
            given = f"an array {short_array(out)}"
        elif isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape"):
            given = f"({short_array(out[0])}, a {type(out[1]).__name__})"
        else:
            given = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(BAD_MODEL_OUTPUT.format(given=given, ids=short_array(ids)))
    return out


def _filtered(logits: jax.Array, temperature: Any, top_k: int | None, top_p: Any) -> jax.Array:
    """``logits / temperature`` with ``-inf`` outside the ``top_k`` most likely tokens, then
    outside the smallest set whose probability reaches ``top_p`` (None: no filter)."""
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
    return logits


def _choose(logits: jax.Array, key: Any, step: Any, temperature: jax.Array, top_p: jax.Array, *,
            greedy: bool, top_k: int | None, use_top_p: bool) -> jax.Array:
    """The next token of every row from its logits ``[batch, vocab]``."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = _filtered(logits, temperature, top_k, top_p if use_top_p else None)
    return jax.random.categorical(jax.random.fold_in(key, step), logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("new", "greedy", "top_k", "use_top_p", "stops"))
def _generate(model: Any, ids: jax.Array, prompt_mask: jax.Array, key: Any, temperature: jax.Array,
              top_p: jax.Array, eos_ids: jax.Array, fill: jax.Array, *, new: int, greedy: bool,
              top_k: int | None, use_top_p: bool, stops: bool) -> jax.Array:
    batch, prompt = ids.shape
    cache = model.init_cache(batch, prompt + new)
    am = jnp.concatenate([prompt_mask, jnp.zeros((batch, new), jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (batch, prompt))
    logits, cache = _call(model, ids, am, positions, cache)
    vocab = logits.shape[-1]
    if top_k is not None and top_k > vocab:
        raise ValueError(BAD_TOP_K.format(vocab=vocab, given=top_k))
    choose = partial(_choose, key=key, temperature=temperature, top_p=top_p, greedy=greedy, top_k=top_k,
                     use_top_p=use_top_p)

    def emit(tokens: jax.Array, done: jax.Array, token: jax.Array, t: Any) -> tuple[jax.Array, ...]:
        if stops:
            token = jnp.where(done, fill, token)
            done = done | jnp.isin(token, eos_ids)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (jnp.int32(0), prompt + t))
        return tokens, done, token

    tokens = jnp.concatenate([ids, jnp.broadcast_to(fill, (batch, new))], axis=1)
    tokens, done, token = emit(tokens, jnp.zeros((batch,), bool), choose(logits[:, -1], step=0), 0)

    def more(carry: tuple[Any, ...]) -> jax.Array:
        t, done = carry[0], carry[-1]
        return (t < new) & ~jnp.all(done) if stops else t < new

    def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        t, tokens, token, cache, am, done = carry
        slot = prompt + t - 1  # the slot of `token`, the last one emitted
        am = jax.lax.dynamic_update_slice(am, jnp.ones((batch, 1), jnp.int32), (jnp.int32(0), slot))
        positions = jnp.full((batch, 1), slot, jnp.int32)
        logits, cache = _call(model, token[:, None], am, positions, cache)
        tokens, done, token = emit(tokens, done, choose(logits[:, -1], step=t), t)
        return t + 1, tokens, token, cache, am, done

    carry = (jnp.int32(1), tokens, token, cache, am, done)
    return jax.lax.while_loop(more, step, carry)[1]
