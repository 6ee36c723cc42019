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
``top_p`` and by ``min_p``, whether it stops at EOS and how many EOS ids, the stop sequences'
count and length, which of the repetition penalty, ``min_new_tokens`` and scores are on,
``no_repeat_ngram_size``, the ``suppress_tokens`` and ``bad_words_ids`` ids, whether a streamer is given, the
number of beams and of returned sequences); the temperature, the ``top_p`` and ``min_p`` values, the key, the EOS, pad and
stop ids, the penalty, ``min_new_tokens``, ``length_penalty``, ``early_stopping`` and the
tokens are traced. Options that are off add nothing to the compiled loop: plain
greedy decoding is the same program with or without the controls' code.

Beam search (``_beam_search``) is Hugging Face's: the beams are ``batch * num_beams`` rows of
one batch in the same kind of loop; each step keeps the best continuations of all beams of a
prompt, moves the ended ones into a sorted set of finished sequences, and gathers the cache
rows of the beams that go on (each cache leaf's batch axis is found from ``init_cache``'s
shapes for two batch sizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

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

BAD_MIN_P = """\
generate: min_p must be a number in [0, 1] (tokens less likely than min_p times the most \
likely one are dropped; 0: none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, min_p=0.05, key=key)"""

BAD_NGRAM = """\
generate: no_repeat_ngram_size must be an int >= 0 (n: no n-gram appears twice in a row; 0: \
none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, no_repeat_ngram_size=3)"""

OUTSIDE_VOCAB = """\
generate: {name} {ids} are not ids of this model's vocabulary ({vocab} tokens: 0 to {last}).

    right:  ft.nn.generate(model, input_ids, 8, {name}=[{example}])"""

BAD_TOKEN_ID = """\
generate: {name} must be a token id (an int >= 0){plural}, got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, {name}={example})"""

BAD_REPETITION_PENALTY = """\
generate: repetition_penalty must be a number > 0 (1.0: none; above 1 discourages the tokens \
already in the row), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, repetition_penalty=1.2)"""

BAD_MIN_NEW_TOKENS = """\
generate: min_new_tokens must be an int from 0 to max_new_tokens ({new}), got {given!r}.

    right:  ft.nn.generate(model, input_ids, {new}, eos_token_id=eos, min_new_tokens={fit})"""

MIN_NEEDS_EOS = """\
generate: min_new_tokens={given} keeps eos_token_id from being chosen for the first {given} \
new tokens, but no eos_token_id is given (nothing to hold back).

    wrong:  ft.nn.generate(model, input_ids, 8, min_new_tokens={given})
    right:  ft.nn.generate(model, input_ids, 8, min_new_tokens={given}, eos_token_id=eos)"""

BAD_STOP = """\
generate: {name} must be a list of token-id sequences, each a non-empty list of token ids (ints \
>= 0), got {given!r}.

    wrong:  ft.nn.generate(model, input_ids, 8, {name}=[13, 198])      # one sequence or two?
    right:  ft.nn.generate(model, input_ids, 8, {name}=[[13, 198]])    # the pair 13, 198
    right:  ft.nn.generate(model, input_ids, 8, {name}=[[13], [198]])  # either token"""

STOP_NEEDS_PAD = """\
generate: a row that emits a stop sequence is finished and emits pad_token_id afterwards, but \
neither pad_token_id nor eos_token_id (its default) is given.

    wrong:  ft.nn.generate(model, input_ids, 8, stop={stop!r})
    right:  ft.nn.generate(model, input_ids, 8, stop={stop!r}, pad_token_id=0)"""

BAD_NUM_BEAMS = """\
generate: num_beams must be an int >= 1 (1: no beam search), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams=4)"""

BAD_STREAMER = """\
generate: streamer must have put(token_ids) and end() (Hugging Face's streamer protocol), got \
a {given}.

    right:  ft.nn.generate(model, input_ids, 32, streamer=transformers.TextStreamer(tokenizer))"""

STREAMER_WITH = """\
generate: streamer= prints tokens as each step makes them; {why}

    wrong:  {wrong}
    right:  {right}"""

BEAMS_SAMPLE = """\
generate: beam search (num_beams={beams}) keeps the most likely continuations; it does not \
sample (temperature={temperature}{rest}).

    wrong:  ft.nn.generate(model, input_ids, 8, num_beams={beams}, temperature={temperature}, key=key)
    right:  ft.nn.generate(model, input_ids, 8, num_beams={beams})                  # beams
    right:  ft.nn.generate(model, input_ids, 8, temperature={temperature}, key=key)  # sampling"""

BEAM_OPTION = """\
generate: {name}={value!r} is an option of beam search, but num_beams=1.

    wrong:  ft.nn.generate(model, input_ids, 8, {name}={value!r})
    right:  ft.nn.generate(model, input_ids, 8, num_beams=4, {name}={value!r})"""

BAD_RETURN_SEQUENCES = """\
generate: num_return_sequences must be an int from 1 to num_beams ({beams}): the best beams of \
each prompt, got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams={fit}, num_return_sequences={fit})"""

BAD_LENGTH_PENALTY = """\
generate: length_penalty must be a finite number (a finished beam's score is its summed \
log-probability / new_tokens ** length_penalty), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams=4, length_penalty=1.0)"""

BAD_EARLY_STOPPING = """\
generate: early_stopping must be False (Hugging Face's heuristic), True (stop once num_beams \
sequences are finished) or "never" (only when no beam can improve), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams=4, early_stopping=True)"""

UNBATCHED_CACHE = """\
generate: beam search reorders the cache along its batch axis, but the cache leaf at {path} \
{shapes} (from model.init_cache with batch sizes {small} and {large}) has no single such axis.

    right:  every cache leaf is [..., batch, ...] (one axis of size batch_size), or has no batch axis"""

NEG = -1.0e9  # Hugging Face's "no score": a beam slot that cannot win


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
    min_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    bad_words_ids: Sequence[Sequence[int]] | None = None,
    min_new_tokens: int | None = None,
    suppress_tokens: int | Sequence[int] | None = None,
    stop: Sequence[Sequence[int]] | None = None,
    num_beams: int = 1,
    num_return_sequences: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    return_scores: bool = False,
    streamer: Any = None,
) -> Any:
    """``input_ids [batch, P]`` followed by ``max_new_tokens`` generated tokens: ``[batch, P + N]``.

    Each new token is drawn from the model's next-token distribution given everything before
    it: with ``temperature=0.0`` the most likely token (greedy); otherwise a sample of
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and then
    to the smallest set whose probability reaches ``top_p`` (nucleus sampling; the order and
    rules of Hugging Face's ``generate``). Step ``t`` draws with ``jax.random.fold_in(key, t)``:
    the same key gives the same tokens. A row that emits ``eos_token_id`` (an id or a list of
    ids) is finished: its later tokens are ``pad_token_id`` (default: the first EOS id), and
    the loop stops early once every row is finished.

    Before choosing, the logits pass Hugging Face's processors in its order:

    - ``repetition_penalty=r``: the logit ``l`` of every token already in the row (the real
      prompt tokens, left padding excluded, and the tokens generated so far) becomes ``l / r``
      if ``l > 0``, else ``l * r`` (``r > 1`` discourages repeats);
    - ``no_repeat_ngram_size=n``: a token that would complete an ``n``-gram already in the
      row (real prompt tokens and generated ones; left padding is not part of any) is
      ``-inf``;
    - ``bad_words_ids`` (token-id sequences, e.g. ``[[13], [7, 8]]``): the last token of a
      sequence is ``-inf`` wherever the row ends with the tokens before it (a one-token
      sequence: always); a sequence that is just an EOS id is ignored, as HF does;
    - ``min_new_tokens=m``: the EOS ids' logits are ``-inf`` for the first ``m`` new tokens;
    - ``suppress_tokens`` (an id or a list): these ids' logits are ``-inf`` at every step;
    - then ``temperature``, ``top_k``, ``top_p`` and ``min_p`` (sampling only; ``min_p=q``
      drops the tokens whose probability is below ``q`` times the most likely token's).

    ``stop`` (a list of token-id sequences, e.g. ``[[13, 198], [50256]]``) ends a row right
    after it emits any of them in full (the last tokens of the row, real prompt tokens included,
    equal the sequence); the stop tokens stay in the output and the row is padded like after EOS.

    ``num_beams=k > 1`` is Hugging Face's beam search (greedy only): ``k`` running beams per
    prompt, the ``max(2, 1 + len(eos)) * k`` best continuations by summed log-probability each
    step, a continuation that ends (EOS, a stop sequence or the last step) scored
    ``sum / new_tokens ** length_penalty`` (default 1.0) among the ``k`` finished ones, and
    ``early_stopping`` (False: HF's heuristic, the default; True: once ``k`` are finished;
    ``"never"``) deciding when to stop. The result has ``num_return_sequences`` (default 1,
    at most ``k``) rows per prompt, best first: ``[batch * num_return_sequences, P + N]``,
    padded with ``pad_token_id`` after each sequence's end. The beams are rows of one batch in
    the same compiled loop, the key-value cache reordered by each step's chosen beams.

    ``return_scores=True`` returns ``(tokens, scores)``, ``scores`` float32 ``[rows, N]``: each
    chosen token's log-probability, 0.0 where a row had already finished. Greedy and sampling:
    ``log_softmax`` of the processed logits it was chosen from (penalty, EOS held back,
    temperature, ``top_k``, ``top_p``), Hugging Face's ``compute_transition_scores(sequences,
    scores, normalize_logits=True)``. Beams: the processors applied to ``log_softmax(logits)``
    (what the beam scores sum), HF's ``compute_transition_scores(sequences, scores,
    beam_indices)``; a sequence's sum over ``new_tokens ** length_penalty`` is its beam score.

    ``streamer`` (Hugging Face's protocol: ``put(token_ids)`` and ``end()``, e.g.
    ``transformers.TextStreamer(tokenizer)``) gets what HF's ``generate`` gives it: the
    prompt ``[batch, P]``, then each step's tokens ``[batch]`` as the step makes them (a
    finished row's pad ids included), then ``end()``; the call then waits for the loop to end.
    Greedy and sampling, called eagerly (not inside a ``jax.jit`` of your own). Without it
    the loop has no host callback at all.

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
      >>> beams, scores = ft.nn.generate(lm, prompt, 4, attention_mask=mask, num_beams=3,
      ...                                num_return_sequences=2, repetition_penalty=1.3,
      ...                                return_scores=True)
      >>> beams.shape, scores.shape                  # two sequences per prompt, best first
      ((4, 7), (4, 4))
    """
    if not callable(getattr(model, "init_cache", None)):
        raise TypeError(NOT_A_GENERATOR.format(type=type(model).__name__))
    ids = input_ids if isinstance(input_ids, jax.Array) else np.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] < 1:
        raise ValueError(BAD_INPUT_IDS.format(given=short_array(ids)))
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(BAD_NEW_TOKENS.format(given=max_new_tokens))
    new, prompt = int(max_new_tokens), ids.shape[1]
    limit = getattr(model.model if isinstance(model, Shared) else model, "max_positions", None)
    if isinstance(limit, int) and prompt + new > limit:
        raise ValueError(TOO_LONG.format(prompt=prompt, new=new, total=prompt + new, limit=limit,
                                         fit=max(limit - prompt, 1)))
    check = getattr(model.model if isinstance(model, Shared) else model, "check_token_ids", None)
    if callable(check):  # the prompt's ids against the vocabulary, once, here where they are concrete
        check(ids)
    mask = _attention_mask(attention_mask, ids.shape)
    greedy = _greedy(temperature, key, top_k, top_p, min_p)
    ngram = _ngram_size(no_repeat_ngram_size)
    suppress = _token_ids(suppress_tokens, "suppress_tokens")
    eos = _token_ids(eos_token_id, "eos_token_id")
    bad = tuple(w for w in _stop(bad_words_ids, "bad_words_ids") if not (len(w) == 1 and w[0] in eos))  # as HF
    pad = _token_ids(pad_token_id, "pad_token_id", single=True)
    penalty = _repetition_penalty(repetition_penalty)
    hold = _min_new_tokens(min_new_tokens, new, eos)
    stops = _stop(stop)
    if stops and not (eos or pad):
        raise ValueError(STOP_NEEDS_PAD.format(stop=stop))
    beams, returns, lp, early = _beam_options(num_beams, num_return_sequences, length_penalty, early_stopping,
                                              greedy, temperature, top_k, top_p)
    _check_streamer(streamer, beams, ids)
    fill = pad[0] if pad else (eos[0] if eos else 0)
    width = max((len(s) for s in stops), default=1)
    stop_ids = np.full((len(stops), width), -1, np.int32)  # right-aligned, -1: no token there
    for row, sequence in zip(stop_ids, stops):
        row[width - len(sequence):] = sequence
    common = (jnp.asarray(ids, jnp.int32), mask, jnp.asarray(eos or (-1,), jnp.int32), jnp.asarray(fill, jnp.int32),
              jnp.asarray(1.0 if penalty is None else penalty, jnp.float32), jnp.asarray(hold, jnp.int32),
              jnp.asarray(stop_ids))
    options = {"new": new, "penalize": penalty is not None, "hold": hold > 0, "scores": bool(return_scores),
               "ngram": ngram, "suppress": suppress, "bad": bad}
    if beams > 1:
        tokens, scores = _beam_search(model, *common, jnp.asarray(lp, jnp.float32), jnp.asarray(early is True),
                                      jnp.asarray(early == "never"), beams=beams, returns=returns,
                                      eos_count=len(eos), **options)
    else:
        run = partial(
            _generate, model, *common, key, jnp.asarray(temperature if not greedy else 1.0, jnp.float32),
            jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
            jnp.asarray(0.0 if min_p is None else min_p, jnp.float32),
            greedy=greedy, top_k=top_k, use_top_p=top_p is not None and top_p < 1.0,
            use_min_p=min_p is not None and min_p > 0.0, ends=bool(eos or stops), stream=streamer is not None,
            **options,
        )
        tokens, scores = run() if streamer is None else _streaming(run, streamer, ids)
    return (tokens, scores) if return_scores else tokens


# The streamer of the generate call running: the compiled loop's host callback hands it each
# step's tokens (a module slot, not an argument: a new streamer must not compile the loop again).
_STREAMERS: list[Any] = []


def _put(tokens: Any) -> None:
    _STREAMERS[-1].put(np.asarray(tokens))


def _streaming(run: Any, streamer: Any, ids: Any) -> tuple[jax.Array, Any]:
    streamer.put(np.asarray(ids))
    _STREAMERS.append(streamer)
    try:
        tokens, scores = jax.block_until_ready(run())  # every step's callback has run
    finally:
        _STREAMERS.pop()
    streamer.end()
    return tokens, scores


def _check_streamer(streamer: Any, beams: int, ids: Any) -> None:
    if streamer is None:
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(BAD_STREAMER.format(given=type(streamer).__name__))
    if beams > 1:  # as HF: which beam's tokens would it print?
        raise ValueError(STREAMER_WITH.format(
            why="beam search only knows its best sequences at the end.",
            wrong=f"ft.nn.generate(model, input_ids, 32, num_beams={beams}, streamer=streamer)",
            right=f"print(decode(ft.nn.generate(model, input_ids, 32, num_beams={beams})))"))
    try:
        np.asarray(ids)  # the prompt the streamer gets first
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError(STREAMER_WITH.format(
            why="inside a jax.jit of your own the steps run after generate has returned.",
            wrong="jax.jit(lambda ids: ft.nn.generate(model, ids, 32, streamer=streamer))(ids)",
            right="ft.nn.generate(model, ids, 32, streamer=streamer)       # itself one compiled loop")) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


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


def _greedy(temperature: Any, key: Any, top_k: Any, top_p: Any, min_p: Any = None) -> bool:
    if not _is_number(temperature) or not temperature >= 0:
        raise ValueError(BAD_TEMPERATURE.format(given=temperature))
    if min_p is not None and (not _is_number(min_p) or not 0.0 <= min_p <= 1.0):
        raise ValueError(BAD_MIN_P.format(given=min_p))
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(BAD_TOP_K.format(vocab="vocab", given=top_k))
    if top_p is not None and (not _is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(BAD_TOP_P.format(given=top_p))
    if temperature == 0:
        for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
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
        ok = len(values) >= 1 and all(_is_int(v) and v >= 0 for v in values)
    except TypeError:
        ok = False
    if not ok:
        plural = "" if single else " or a list of them"
        raise ValueError(BAD_TOKEN_ID.format(name=name, plural=plural, given=value, example=2))
    return tuple(int(v) for v in values)


def _repetition_penalty(value: Any) -> float | None:
    """The penalty, or None where there is none (None or 1.0: the logits are untouched)."""
    if value is None:
        return None
    if not _is_number(value) or not (0.0 < value < np.inf):
        raise ValueError(BAD_REPETITION_PENALTY.format(given=value))
    return None if value == 1.0 else float(value)


def _ngram_size(value: Any) -> int:
    if value is None:
        return 0
    if not _is_int(value) or value < 0:
        raise ValueError(BAD_NGRAM.format(given=value))
    return int(value)


def _min_new_tokens(value: Any, new: int, eos: tuple[int, ...]) -> int:
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value <= new:
        raise ValueError(BAD_MIN_NEW_TOKENS.format(new=new, given=value, fit=max(new // 2, 1)))
    if value > 0 and not eos:
        raise ValueError(MIN_NEEDS_EOS.format(given=value))
    return int(value)


def _stop(value: Any, name: str = "stop") -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    try:
        ok = not isinstance(value, (str, bytes)) and len(value) >= 1 and all(
            not isinstance(s, (str, bytes)) and len(s) >= 1 and all(_is_int(i) and i >= 0 for i in s) for s in value
        )
    except TypeError:  # an int where a sequence belongs
        ok = False
    if not ok:
        raise ValueError(BAD_STOP.format(name=name, given=value))
    sequences: Any = value
    return tuple(tuple(int(i) for i in s) for s in sequences)


def _beam_options(beams: Any, returns: Any, length_penalty: Any, early: Any, greedy: bool, temperature: Any,
                  top_k: Any, top_p: Any) -> tuple[int, int, float, bool | str]:
    if not _is_int(beams) or beams < 1:
        raise ValueError(BAD_NUM_BEAMS.format(given=beams))
    if beams == 1:  # HF's defaults say nothing; any other value would be ignored, so it is refused
        for name, value, default in (("num_return_sequences", returns, 1), ("length_penalty", length_penalty, 1.0),
                                     ("early_stopping", early, False)):
            same = value is False if default is False else _is_number(value) and value == default
            if value is not None and not same:
                raise ValueError(BEAM_OPTION.format(name=name, value=value))
        return 1, 1, 1.0, False
    if not greedy:
        rest = "".join(f", {n}={v!r}" for n, v in (("top_k", top_k), ("top_p", top_p)) if v is not None)
        raise ValueError(BEAMS_SAMPLE.format(beams=beams, temperature=temperature, rest=rest))
    if returns is not None and (not _is_int(returns) or not 1 <= returns <= beams):
        raise ValueError(BAD_RETURN_SEQUENCES.format(beams=beams, given=returns,
                                                     fit=returns if _is_int(returns) and returns > 1 else beams))
    if length_penalty is not None and (not _is_number(length_penalty) or not np.isfinite(length_penalty)):
        raise ValueError(BAD_LENGTH_PENALTY.format(given=length_penalty))
    if early is not None and early is not True and early is not False and early != "never":
        raise ValueError(BAD_EARLY_STOPPING.format(given=early))
    return (int(beams), 1 if returns is None else int(returns), 1.0 if length_penalty is None else float(length_penalty),
            False if early is None else early)


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


def _made(prompt_mask: jax.Array, new: int, t: Any) -> jax.Array:
    """bool ``[batch, P + new]``: the real tokens before new token ``t`` (the prompt's
    unpadded ones, then the ``t`` generated)."""
    generated = jnp.broadcast_to(jnp.arange(new) < t, (prompt_mask.shape[0], new))
    return jnp.concatenate([prompt_mask != 0, generated], axis=1)


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


def _window(ids: jax.Array, mask: jax.Array, width: int) -> jax.Array:
    """The last ``width - 1`` real prompt tokens of each row, -2 where padding or before the prompt."""
    return _last(ids, mask != 0, ids.shape[1], width - 1)


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


@partial(jax.jit, static_argnames=("new", "greedy", "top_k", "use_top_p", "use_min_p", "ends", "penalize", "hold",
                                   "scores", "ngram", "suppress", "bad", "stream"))
def _generate(model: Any, ids: jax.Array, prompt_mask: jax.Array, eos_ids: jax.Array, fill: jax.Array,
              penalty: jax.Array, min_new: jax.Array, stop_ids: jax.Array, key: Any, temperature: jax.Array,
              top_p: jax.Array, min_p: jax.Array, *, new: int, greedy: bool, top_k: int | None, use_top_p: bool,
              use_min_p: bool, ends: bool, penalize: bool, hold: bool, scores: bool, ngram: int,
              suppress: tuple[int, ...], bad: tuple[tuple[int, ...], ...] = (),
              stream: bool = False) -> tuple[jax.Array, jax.Array | None]:
    batch, prompt = ids.shape
    cache = model.init_cache(batch, prompt + new)
    am = jnp.concatenate([prompt_mask, jnp.zeros((batch, new), jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (batch, prompt))
    logits, cache = _call(model, ids, am, positions, cache)
    vocab = logits.shape[-1]
    if top_k is not None and top_k > vocab:
        raise ValueError(BAD_TOP_K.format(vocab=vocab, given=top_k))
    stopping = stop_ids.shape[0] > 0
    is_eos = jnp.isin(jnp.arange(vocab), eos_ids) if hold else None
    suppressed = _suppressed(suppress, vocab) if suppress else None
    rows = jnp.arange(batch)

    def choose(logits: jax.Array, state: dict[str, Any], t: Any) -> tuple[jax.Array, Any]:
        if not (penalize or hold or scores or ngram or suppress or bad):  # the plain loop: nothing else traced
            return _choose(logits, key, t, temperature, top_p, min_p, greedy=greedy, top_k=top_k,
                           use_top_p=use_top_p, use_min_p=use_min_p), None
        banned = _banned(state["tokens"], _made(prompt_mask, new, t), prompt + t, ngram, bad, vocab)
        x = _processed(logits.astype(jnp.float32), state.get("seen"), t, penalty, min_new, is_eos,
                       penalize=penalize, holding=hold, banned=banned, suppressed=suppressed)
        if greedy:
            token = jnp.argmax(x, axis=-1).astype(jnp.int32)
        else:
            x = _filtered(x, temperature, top_k, top_p if use_top_p else None, min_p if use_min_p else None)
            token = jax.random.categorical(jax.random.fold_in(key, t), x, axis=-1).astype(jnp.int32)
        if not scores:
            return token, None
        return token, jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), token[:, None], axis=-1)[:, 0]

    def emit(state: dict[str, Any], token: jax.Array, score: Any, t: Any) -> dict[str, Any]:
        state = dict(state)
        if ends:
            done = state["done"]
            token = jnp.where(done, fill, token)
            finished = jnp.isin(token, eos_ids)
            if stopping:
                hit, state["window"] = _stopped(state["window"], token, stop_ids)
                finished = finished | hit
            if scores:
                score = jnp.where(done, jnp.float32(0.0), score)
            state["done"] = done | finished
        state["tokens"] = jax.lax.dynamic_update_slice(state["tokens"], token[:, None], (jnp.int32(0), prompt + t))
        if scores:
            state["scores"] = jax.lax.dynamic_update_slice(state["scores"], score[:, None], (jnp.int32(0), t))
        if penalize:
            state["seen"] = state["seen"].at[rows, token].set(True)
        if stream:  # in step order (ordered): the streamer prints as the loop runs
            io_callback(_put, None, token, ordered=True)
        state["token"] = token
        return state

    state: dict[str, Any] = {
        "tokens": jnp.concatenate([ids, jnp.broadcast_to(fill, (batch, new))], axis=1),
        "done": jnp.zeros((batch,), bool),
    }
    if penalize:
        state["seen"] = _seen(ids, prompt_mask, vocab)
    if stopping:
        state["window"] = _window(ids, prompt_mask, stop_ids.shape[1])
    if scores:
        state["scores"] = jnp.zeros((batch, new), jnp.float32)
    state = emit(state, *choose(logits[:, -1], state, 0), 0)
    state.update(t=jnp.int32(1), cache=cache, am=am)

    def more(state: dict[str, Any]) -> jax.Array:
        return (state["t"] < new) & ~jnp.all(state["done"]) if ends else state["t"] < new

    def step(state: dict[str, Any]) -> dict[str, Any]:
        t = state["t"]
        slot = prompt + t - 1  # the slot of `token`, the last one emitted
        am = jax.lax.dynamic_update_slice(state["am"], jnp.ones((batch, 1), jnp.int32), (jnp.int32(0), slot))
        positions = jnp.full((batch, 1), slot, jnp.int32)
        logits, cache = _call(model, state["token"][:, None], am, positions, state["cache"])
        state = emit({**state, "am": am, "cache": cache}, *choose(logits[:, -1], state, t), t)
        return {**state, "t": t + 1}

    state = jax.lax.while_loop(more, step, state)
    return state["tokens"], state.get("scores")


# ---- beam search ------------------------------------------------------------------------------

def _batch_axes(model: Any, batch: int, rows: int, length: int) -> list[int | None]:
    """Each cache leaf's batch axis (None: a leaf without one), found by making the cache's
    shapes for ``batch`` and ``rows`` sequences (no arrays are made)."""
    small = jax.tree.leaves_with_path(jax.eval_shape(lambda: model.init_cache(batch, length)))
    large = jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(rows, length)))
    axes: list[int | None] = []
    for (path, a), b in zip(small, large):
        differ = [i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        if a.ndim != b.ndim or len(differ) > 1 or (differ and (a.shape[differ[0]], b.shape[differ[0]]) != (batch, rows)):
            raise ValueError(UNBATCHED_CACHE.format(path=jax.tree_util.keystr(path) or "(root)",
                                                    shapes=f"is {a.shape} and {b.shape}", small=batch, large=rows))
        axes.append(differ[0] if differ else None)
    return axes


def _on_axes(cache: Any, axes: list[int | None], f: Any) -> Any:
    leaves, treedef = jax.tree.flatten(cache)
    return jax.tree.unflatten(treedef, [leaf if ax is None else f(leaf, ax) for leaf, ax in zip(leaves, axes)])


def _beams_of(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x [batch, beams, ...]`` at the beams ``index [batch, k]``: ``[batch, k, ...]``."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@partial(jax.jit, static_argnames=("new", "penalize", "hold", "scores", "ngram", "suppress", "bad", "beams",
                                   "returns", "eos_count"))
def _beam_search(model: Any, ids: jax.Array, prompt_mask: jax.Array, eos_ids: jax.Array, fill: jax.Array,
                 penalty: jax.Array, min_new: jax.Array, stop_ids: jax.Array, length_penalty: jax.Array,
                 early: jax.Array, never: jax.Array, *, new: int, penalize: bool, hold: bool, scores: bool,
                 ngram: int, suppress: tuple[int, ...], beams: int, returns: int, eos_count: int,
                 bad: tuple[tuple[int, ...], ...] = ()) -> tuple[jax.Array, jax.Array | None]:
    """Hugging Face's beam search; ``early`` (bool): early_stopping=True, ``never`` (bool):
    early_stopping="never" (both False: HF's default heuristic)."""
    batch, prompt = ids.shape
    rows, total = batch * beams, prompt + new
    axes = _batch_axes(model, batch, rows, total)
    am = jnp.concatenate([prompt_mask, jnp.zeros((batch, new), jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (batch, prompt))
    logits, cache = _call(model, ids, am, positions, model.init_cache(batch, total))  # prefill once per prompt
    cache = _on_axes(cache, axes, lambda leaf, ax: jnp.repeat(leaf, beams, axis=ax))  # row b * beams + k: prompt b
    vocab = logits.shape[-1]
    keep = max(2, 1 + eos_count) * beams  # HF's candidates per prompt: enough for `beams` that do not end
    stopping = stop_ids.shape[0] > 0
    is_eos = jnp.isin(jnp.arange(vocab), eos_ids) if hold else None
    suppressed = _suppressed(suppress, vocab) if suppress else None
    first_k = jnp.arange(keep) < beams
    lowest = jnp.float32(NEG)

    def select(state: dict[str, Any], logits: jax.Array, t: Any, reorder: bool) -> dict[str, Any]:
        s = dict(state)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        banned = _banned(s["sequences"].reshape(rows, total), jnp.repeat(_made(prompt_mask, new, t), beams, axis=0),
                         prompt + t, ngram, bad, vocab)
        logp = _processed(logp, s.get("seen"), t, penalty, min_new, is_eos, penalize=penalize, holding=hold,
                          banned=banned, suppressed=suppressed)
        flat = logp.reshape(batch, beams * vocab)
        top, index = jax.lax.top_k((logp.reshape(batch, beams, vocab) + s["running"][..., None]).reshape(batch, -1),
                                   keep)
        parent, token = index // vocab, (index % vocab).astype(jnp.int32)  # [batch, keep]
        sequences = jax.lax.dynamic_update_slice(_beams_of(s["sequences"], parent), token[..., None],
                                                 (jnp.int32(0), jnp.int32(0), prompt + t))
        ends = jnp.isin(token, eos_ids) | (t == new - 1)
        if stopping:
            hit, window = _stopped(_beams_of(s["window"].reshape(batch, beams, -1), parent), token, stop_ids)
            ends = ends | hit
        if scores:
            own = jnp.take_along_axis(flat, index, axis=1)
            token_scores = jax.lax.dynamic_update_slice(_beams_of(s["token_scores"], parent), own[..., None],
                                                        (jnp.int32(0), jnp.int32(0), t))
        # the best `beams` candidates that go on
        going = top + ends.astype(jnp.float32) * lowest
        pick = jax.lax.top_k(going, beams)[1]
        s["sequences"], s["running"] = _beams_of(sequences, pick), _beams_of(going, pick)
        if scores:
            s["token_scores"] = _beams_of(token_scores, pick)
        # the finished ones: the best `beams` so far, old and new (only the first `beams` candidates may enter)
        just = ends & first_k
        candidate = top / ((t + 1).astype(jnp.float32) ** length_penalty)
        full = jnp.all(s["finished"], axis=1, keepdims=True) & early  # early_stopping=True: no more once full
        candidate = candidate + full.astype(jnp.float32) * lowest
        candidate = candidate + (~s["improvable"]).astype(jnp.float32) * lowest
        candidate = candidate + (~just).astype(jnp.float32) * lowest
        best = jax.lax.top_k(jnp.concatenate([s["final"], candidate], axis=1), beams)[1]
        merge = lambda old, fresh: _beams_of(jnp.concatenate([old, fresh], axis=1), best)  # noqa: E731
        s["final_sequences"] = merge(s["final_sequences"], sequences)
        s["final"] = merge(s["final"], candidate)
        s["finished"] = merge(s["finished"], just)
        if scores:
            s["final_scores"] = merge(s["final_scores"], token_scores)
        # the next step's inputs: the going beams' tokens, their parents' caches
        s["token"] = _beams_of(token, pick).reshape(rows)
        source = (jnp.arange(batch)[:, None] * beams + _beams_of(parent, pick)).reshape(rows)
        if reorder:  # (at the first step every beam of a prompt is the same)
            s["cache"] = _on_axes(s["cache"], axes, lambda leaf, ax: jnp.take(leaf, source, axis=ax))
            if penalize:
                s["seen"] = s["seen"][source]
        if penalize:
            s["seen"] = s["seen"].at[jnp.arange(rows), s["token"]].set(True)
        if stopping:
            s["window"] = _beams_of(window, pick).reshape(rows, -1)
        # whether a running beam can still beat a finished one (HF's heuristic), and whether to go on
        length = jnp.where(never & (length_penalty > 0), new, t + 1)  # the best length a running beam may reach
        hope = s["running"][:, :1] / (length.astype(jnp.float32) ** length_penalty)
        worst = jnp.where(s["finished"], jnp.min(s["final"], axis=1, keepdims=True), lowest)
        s["improvable"] = s["improvable"] & jnp.any(hope > worst, axis=-1, keepdims=True)
        s["go"] = jnp.any(s["improvable"]) & ~jnp.all(ends) & ~(jnp.all(s["finished"]) & early)
        return s

    start = jnp.concatenate([ids, jnp.broadcast_to(fill, (batch, new))], axis=1)
    start = jnp.broadcast_to(start[:, None], (batch, beams, total))
    state: dict[str, Any] = {
        "sequences": start, "final_sequences": start,
        "running": jnp.where(jnp.arange(beams) == 0, 0.0, lowest)[None].repeat(batch, 0).astype(jnp.float32),
        "final": jnp.full((batch, beams), lowest), "finished": jnp.zeros((batch, beams), bool),
        "improvable": jnp.ones((batch, 1), bool), "cache": cache,
    }
    if penalize:
        state["seen"] = jnp.repeat(_seen(ids, prompt_mask, vocab), beams, axis=0)
    if stopping:
        state["window"] = jnp.repeat(_window(ids, prompt_mask, stop_ids.shape[1]), beams, axis=0)
    if scores:
        state["token_scores"] = state["final_scores"] = jnp.zeros((batch, beams, new), jnp.float32)
    state = select(state, jnp.repeat(logits[:, -1], beams, axis=0), jnp.int32(0), reorder=False)
    state.update(t=jnp.int32(1), am=jnp.repeat(am, beams, axis=0))

    def more(state: dict[str, Any]) -> jax.Array:
        return (state["t"] < new) & state["go"]

    def step(state: dict[str, Any]) -> dict[str, Any]:
        t = state["t"]
        slot = prompt + t - 1
        am = jax.lax.dynamic_update_slice(state["am"], jnp.ones((rows, 1), jnp.int32), (jnp.int32(0), slot))
        logits, cache = _call(model, state["token"][:, None], am, jnp.full((rows, 1), slot, jnp.int32),
                              state["cache"])
        state = select({**state, "am": am, "cache": cache}, logits[:, -1], t, reorder=True)
        return {**state, "t": t + 1}

    state = jax.lax.while_loop(more, step, state)
    tokens = state["final_sequences"][:, :returns].reshape(batch * returns, total)
    return tokens, state["final_scores"][:, :returns].reshape(batch * returns, new) if scores else None
