"""Autoregressive generation with a key-value cache: prefill and decode in one compiled call.

``generate`` drives any model that follows the cache protocol::

    cache = model.init_cache(batch_size, max_length, dtype=None)
    logits, cache = model(input_ids, attention_mask=am, positions=pos, cache=cache)

with ``input_ids`` int32 ``[batch, T]``, ``pos`` int32 ``[batch, T]`` (the cache slots of the
tokens: ``0 .. P-1`` for a prompt of length ``P``, then ``P, P+1, ...``), ``am`` int32
``[batch, max_length]`` (1 at the slots that hold a real token: the prompt without its left
padding and everything generated so far, the current tokens included) and ``logits``
``[batch, T, vocab]``. A model may define ``max_positions`` (an int: the longest sequence
it takes, e.g. the size of a learned position embedding); ``generate`` then refuses to feed
it more (the prompt and every new token but the last, which is never fed back: a prompt of
``max_positions`` tokens gets one new token, as in Hugging Face's ``generate``). The prompt's
positions are its width, left padding included (a model's positions may be its cache slots),
unless the model sets ``positions_count_real_tokens = True`` (its positions count each row's
real tokens, HF's ``cumsum(mask) - 1``, as ``from_hf``'s GPT-2 and OPT): then the longest
row's real tokens, where the attention mask is concrete (a traced one's width: its values are
not known). A model may define ``check_generation(prompt_length, new_tokens)``: ``generate``
calls it with the exact sizes before compiling anything, and it raises for sizes the model
cannot generate as its reference does (Phi-3's longrope switch point: a bucket or a
one-token prefill hides it from the model's own call).

The loops are in ``_decode.py``, the logits controls (one record each) in ``_controls.py``;
this module checks the arguments, builds the active controls and picks the loop. One
``jax.jit``-compiled function runs the prompt through the model once (prefill), then one
token per step in a ``lax.while_loop``. It compiles once
per model structure, input shape and static option (``max_new_tokens``, ``top_k``, whether it
samples, whether it filters by ``top_p`` and by ``min_p``, whether it stops at EOS and how
many EOS ids, the stop sequences' count and length, which of the repetition penalty,
``min_new_tokens`` and scores are on, ``no_repeat_ngram_size``, the ``suppress_tokens`` and
``bad_words_ids`` ids, whether a streamer is given, the number of beams and of returned
sequences, which other controls are on, and what the model's Python reads: a notebook's
global its ``__call__`` reads, as :func:`functree.nn._reads.reads_key` keys it); the temperature, the ``top_p``, ``min_p``,
``typical_p``, ``epsilon_cutoff`` and ``eta_cutoff`` values, the key, the EOS, pad and stop
ids, the penalty, ``min_new_tokens``, ``exponential_decay_length_penalty``'s pair,
``length_penalty``, ``early_stopping`` and the tokens are traced. Options that are off add nothing to the compiled loop: plain greedy
decoding is the same program with or without the controls' code.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._alias import is_deletion_error, is_stale_error, stale_error
from functree._random import key_batch
from functree._repr import first_index, short_array
from functree._where import devices_error, following
from functree.generation import _decode, _memory
from functree.generation._controls import (
    CONTROLS,
    Control,
    Options,
    active,
    token_ids,
    token_sequences,
)
from functree.generation._controls import is_number as _is_number
from functree.generation._decode import beam_search, generate_loop
from functree.generation._defaults import (
    SAMPLING_DEFAULTS,
    SUPPORTED,
    WARPER_OPTIONS,
    bad_value,
    checkpoint_defaults,
    inferred_mask,
    unknown_option,
    warn_eos_outside,
)
from functree.generation._logits import check_in_vocabulary
from functree.nn._eager_keys import model_reads
from functree.nn._shared import Shared
from functree.nn._window import is_int as _is_int

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

HF_NOT_A_GENERATOR = """\
generate: a {type} (ft.nn.from_hf's port of Hugging Face's {hf_class}) does not generate text: {why}. \
Hugging Face's {hf_class} has no generate either.

    wrong:  ft.nn.generate(model, input_ids, max_new_tokens)        # model: a {type}
    right:  {right}"""

# HF_NOT_A_GENERATOR's reason and fix: a task head on a causal LM's body, and an encoder (BERT, RoBERTa)
_TASK_HEAD_WHY = ("it is a task head on {body}'s body, which scores the input in one call and has no "
                  "language-model head to predict a next token")
_TASK_HEAD_RIGHT = ("lm = ft.nn.from_hf(causal_lm)   # a {body} checkpoint (config.architectures: [\"{body}\"]), "
                    "then ft.nn.generate(lm, input_ids, max_new_tokens)\n"
                    "       or:  out = model(input_ids, attention_mask=mask)   # the {hf_class}'s own output, one call")
_ENCODER_WHY = ("it is an encoder: every token attends to the whole input both ways and it keeps no "
                "key-value cache, so it predicts no next token left to right")
_ENCODER_RIGHT = ("{out} = model(input_ids, attention_mask=mask)   # one call{fill}\n"
                  "       or:  ft.nn.generate(ft.nn.from_hf(causal_lm), input_ids, max_new_tokens)   "
                  "# a decoder: GPT-2, Llama, Qwen2, ...")


def not_a_generator(model: Any) -> TypeError:
    """:data:`HF_NOT_A_GENERATOR` for an ``ft.nn.from_hf`` model without ``init_cache`` (an
    encoder, a task head), naming what it is and the fix; :data:`NOT_A_GENERATOR` otherwise."""
    hf_class = getattr(type(model), "hf_class", None)
    if not isinstance(hf_class, str) or not hf_class or getattr(type(model), "model_type", None) is None:
        return TypeError(NOT_A_GENERATOR.format(type=type(model).__name__))
    body = getattr(type(model), "body_class", None)
    if body is not None and callable(getattr(body, "init_cache", None)):  # a causal LM's body under a task head
        name = getattr(body, "hf_class", None) or body.__name__
        why, right = _TASK_HEAD_WHY.format(body=name), _TASK_HEAD_RIGHT.format(body=name, hf_class=hf_class)
    else:
        masked = hf_class.endswith("ForMaskedLM")  # its fix: fill the masks from one call's logits
        fill = "; logits.argmax(-1) at the [MASK] positions fills them" if masked else ""
        why, right = _ENCODER_WHY, _ENCODER_RIGHT.format(out="logits" if masked else "out", fill=fill)
    return TypeError(HF_NOT_A_GENERATOR.format(type=type(model).__name__, hf_class=hf_class, why=why, right=right))


BAD_INPUT_IDS = """\
generate: input_ids must be integer token ids [batch, prompt_length], got {given}.

    wrong:  ft.nn.generate(model, jnp.array([5, 7, 9]), 8)
    right:  ft.nn.generate(model, jnp.array([[5, 7, 9]], jnp.int32), 8)   # a batch of one"""

BAD_NEW_TOKENS = """\
generate: max_new_tokens must be an int >= 1, got {given!r}.

    right:  ft.nn.generate(model, input_ids, 32)"""

TOO_LONG = """\
generate: the prompt ({what}) plus max_new_tokens ({new}) feeds the model {fed} \
positions (every token but the last new one, which is never fed back), but it takes at most \
max_positions = {limit}.

    wrong:  ft.nn.generate(model, input_ids, {new})
    right:  ft.nn.generate(model, input_ids, {fit})      # or a shorter prompt"""

PROMPT_TOO_LONG = """\
generate: the prompt ({what}) alone is longer than the model's max_positions = {limit}, \
whatever max_new_tokens ({new}) is.

    wrong:  ft.nn.generate(model, input_ids, {new})                 # input_ids [batch, {width}]
    right:  ft.nn.generate(model, input_ids[:, -{keep}:], {fit})    # the prompt's last {keep} tokens \
(and attention_mask[:, -{keep}:] if given)"""

BAD_ATTENTION_MASK = """\
generate: attention_mask must be bool or 0/1 integers with input_ids' shape {shape} (1 = a real \
token, 0 = left padding), got {given}.

    right:  ft.nn.generate(model, input_ids, 8, attention_mask=input_ids != pad_id)"""

MASK_NOT_ZERO_ONE = """\
generate: attention_mask[{row}, {column}] is {value}; a mask holds 1 (or True) for a real token \
and 0 (or False) for left padding, nothing else (Hugging Face counts positions with \
cumsum(mask): a 2 moves them, a -1 meant as padding would be read as a real token).

    wrong:  ft.nn.generate(model, input_ids, 8, attention_mask=mask)     # mask[{row}, {column}] == {value}
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

NOT_ONE_KEY = """\
generate: key= takes one JAX PRNG key (step t samples with jax.random.fold_in(key, t)); \
got {given}.

    wrong:  ft.nn.generate(model, input_ids, 8, temperature=0.7, key={wrong})
    right:  ft.nn.generate(model, input_ids, 8, temperature=0.7, key={right})"""


def _check_key(key: Any) -> None:
    """Refuse :data:`NOT_ONE_KEY` at the call what the sampling loop's ``fold_in`` would refuse
    inside JAX, naming no argument: an integer seed (torch's ``manual_seed``), several keys."""
    batch = key_batch(key)
    if batch == ():
        return
    if batch is not None:
        n = int(np.prod(batch))
        raise ValueError(NOT_ONE_KEY.format(given=f"{n} keys (an array of shape {np.shape(key)})",
                                            wrong=f"jax.random.split(key, {n})",
                                            right=f"jax.random.split(key, {n})[0]"))
    seed = int(key) if isinstance(key, (int, np.integer)) and not isinstance(key, bool) else 0
    given = repr(key)[:60]
    raise TypeError(NOT_ONE_KEY.format(given=f"{given} ({type(key).__name__})", wrong=given,
                                       right=f"jax.random.key({seed})"))


EOS_OUTSIDE_VOCAB = """\
generate: eos_token_id {ids} are not ids of this model's vocabulary ({vocab} tokens: 0 to {last}): \
no row could ever end. (A list with some ids inside the vocabulary is accepted, as Hugging Face's \
generate does: rows end on those.)

    wrong:  ft.nn.generate(model, input_ids, 8, eos_token_id={given})
    right:  ft.nn.generate(model, input_ids, 8, eos_token_id={example})     # an id of the vocabulary
    right:  ft.nn.generate(model, input_ids, 8, eos_token_id=[])     # no EOS: every row runs to the end"""

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
each prompt (sampling: any int >= 1, the samples of each prompt), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams={fit}, num_return_sequences={fit})"""

GREEDY_RETURNS = """\
generate: num_return_sequences={given} asks for {given} sequences per prompt, but greedy decoding \
(temperature=0.0, num_beams=1) makes one: they would all be equal (Hugging Face's generate \
raises too).

    wrong:  ft.nn.generate(model, input_ids, 8, num_return_sequences={given})
    right:  ft.nn.generate(model, input_ids, 8, num_return_sequences={given}, temperature=1.0, key=key)  # samples
    right:  ft.nn.generate(model, input_ids, 8, num_return_sequences={given}, num_beams={given})        # beams"""

CHECKPOINT_RETURNS = """\
generate: the model's generation config (hf_config.generation: generation_config.json) sets \
num_return_sequences={given}, but this call decodes greedily (temperature=0.0, num_beams=1), which \
makes one sequence per prompt: they would all be equal (Hugging Face's generate raises too).

    wrong:  ft.nn.generate(model, input_ids, 8{call})
    right:  ft.nn.generate(model, input_ids, 8{call}, num_return_sequences=1)   # one sequence per prompt
    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, key=key)   # {given} samples per prompt
    right:  ft.nn.generate(model, input_ids, 8{call}, num_beams={given})   # the {given} best beams"""


class _GreedyReturns(ValueError):
    """GREEDY_RETURNS: told apart from other num_return_sequences errors where the number came
    from the checkpoint (:func:`_sourced`)."""


CHECKPOINT_SAMPLES = """\
generate: the model's generation config (hf_config.generation: generation_config.json) sets \
do_sample=True ({values}): Hugging Face's generate samples by default here, which needs key= \
(a jax.random key). Pass one to sample as HF does, or temperature=0.0 for greedy decoding.

    wrong:  ft.nn.generate(model, input_ids, 32)
    right:  ft.nn.generate(model, input_ids, 32, key=jax.random.key(0))      # HF's sampling defaults
    right:  ft.nn.generate(model, input_ids, 32, temperature=0.0)            # greedy"""

CHECKPOINT_BEAM_SAMPLES = """\
generate: the model's generation config (hf_config.generation: generation_config.json) sets \
do_sample=True, with num_beams={beams} ({whose}): Hugging Face's generate then runs beam-search \
sampling (each beam's next tokens drawn at random), which ft.nn.generate does not do. Say which \
decoding you mean:

    wrong:  ft.nn.generate(model, input_ids, 32{call})
    right:  ft.nn.generate(model, input_ids, 32, num_beams={beams}, temperature=0.0)   # beam search
    right:  ft.nn.generate(model, input_ids, 32, num_beams=1, key=key)                 # sampling"""

CHECKPOINT_ZERO_TEMPERATURE = """\
generate: the model's generation config (hf_config.generation: generation_config.json) sets \
do_sample=True with temperature={temperature!r}: Hugging Face's generate refuses it (sampling \
takes a temperature > 0; a 0 divides the logits by zero). Say which decoding you mean.

    wrong:  ft.nn.generate(model, input_ids, 32, key=key)
    right:  ft.nn.generate(model, input_ids, 32, temperature=0.0)            # greedy
    right:  ft.nn.generate(model, input_ids, 32, temperature=1.0, key=key)   # sampling"""

BAD_LENGTH_PENALTY = """\
generate: length_penalty must be a finite number (a finished beam's score is its summed \
log-probability / new_tokens ** length_penalty), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams=4, length_penalty=1.0)"""

BAD_EARLY_STOPPING = """\
generate: early_stopping must be False (Hugging Face's heuristic), True (stop once num_beams \
sequences are finished) or "never" (only when no beam can improve), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams=4, early_stopping=True)"""



def generate(
    model: Any,
    input_ids: Any,
    max_new_tokens: int,
    *,
    attention_mask: Any = None,
    key: jax.Array | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    epsilon_cutoff: float | None = None,
    eta_cutoff: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    sequence_bias: Any = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    bad_words_ids: Sequence[Sequence[int]] | None = None,
    min_new_tokens: int | None = None,
    min_length: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | Sequence[int] | None = None,
    suppress_tokens: int | Sequence[int] | None = None,
    begin_suppress_tokens: int | Sequence[int] | None = None,
    exponential_decay_length_penalty: tuple[int, float] | None = None,
    renormalize_logits: bool | None = None,
    stop: Sequence[Sequence[int]] | None = None,
    num_beams: int | None = None,
    num_return_sequences: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    return_scores: bool = False,
    streamer: Any = None,
    **unknown: Any,
) -> Any:
    """``input_ids [batch, P]`` followed by ``max_new_tokens`` generated tokens: ``[batch, P + N]``.

    Each new token is drawn from the model's next-token distribution given everything before
    it: with ``temperature=0.0`` the most likely token (greedy); otherwise a sample of
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and then
    to the smallest set whose probability reaches ``top_p`` (nucleus sampling; the order and
    rules of Hugging Face's ``generate``). Step ``t`` draws with ``jax.random.fold_in(key, t)``:
    the same key gives the same tokens. A row that emits ``eos_token_id`` (an id or a list of
    ids; ``[]``: none) is finished: its later tokens are ``pad_token_id`` (default: the first
    EOS id), and the loop stops early once every row is finished. EOS ids outside the
    vocabulary never end a row: a caller's value with none inside is refused, a checkpoint's
    are dropped with ``CheckpointEosWarning`` (HF's ``generate`` runs on). With sampling,
    ``num_return_sequences=n`` draws ``n`` sequences per prompt: rows ``i * n .. i * n + n - 1``
    continue prompt ``i`` (HF's order; greedy refuses ``n > 1``, as HF does).

    Defaults from the checkpoint: an option left at None takes the value of the model's
    ``hf_config`` (a model ported by ``ft.nn.from_hf``: generation_config.json's values, else
    config.json's), then Hugging Face's global default, as HF's ``generate`` does: its EOS ids
    and pad id, its processors (``repetition_penalty``, ``no_repeat_ngram_size``, ...), beams,
    and ``do_sample``: a checkpoint that samples samples here too when ``key=`` is given (its
    ``temperature``, ``top_k`` (HF's default 50; 0: none) and ``top_p``) and asks for a key
    without one; ``temperature=0.0`` is greedy. An explicit argument always wins. A model
    without ``hf_config`` has no defaults (greedy, no EOS). As HF's, a prompt given without
    ``attention_mask`` to such a model is masked where it holds the pad id (when that id is no
    EOS id).

    Before choosing, the logits pass Hugging Face's processors in its order:

    - ``sequence_bias`` (HF's ``{(ids...): bias}`` or ``[[ids, bias], ...]``): each bias is added to
      its sequence's last token wherever the row ends with the others (a one-token sequence:
      always; the row is HF's ``input_ids``: a prefix may match the left padding's pad ids);
    - ``repetition_penalty=r``: the logit ``l`` of every token already in the row (the
      prompt's tokens from its first real one on, left padding excluded: as HF, a masked token
      after a real one counts; and the tokens generated so far) becomes ``l / r`` if ``l > 0``,
      else ``l * r`` (``r > 1`` discourages repeats);
    - ``no_repeat_ngram_size=n``: a token that would complete an ``n``-gram already in the
      row (the prompt and generated tokens; as HF, the left padding's pad ids form n-grams
      too) is ``-inf``;
    - ``bad_words_ids`` (token-id sequences, e.g. ``[[13], [7, 8]]``): the last token of a
      sequence is ``-inf`` wherever the row ends with the tokens before it (a one-token
      sequence: always; as HF, a prefix may match the left padding's pad ids); a sequence
      that is just an EOS id is ignored, as HF does;
    - ``min_length=m``: the EOS ids' logits are ``-inf`` while the row (the whole prompt, its
      left padding included, as HF counts ``input_ids``) holds fewer than ``m`` tokens;
    - ``min_new_tokens=m``: the EOS ids' logits are ``-inf`` for the first ``m`` new tokens;
    - ``forced_bos_token_id=b``: after a one-token prompt the first new token is ``b`` (every
      other logit ``-inf``); ``forced_eos_token_id`` (an id or a list): the last new token is
      one of these;
    - ``exponential_decay_length_penalty=(start, factor)``: at new token ``t > start`` the
      EOS ids' logits ``l`` become ``l + |l| * (factor ** (t - start) - 1)`` (needs EOS);
    - ``suppress_tokens`` (an id or a list): these ids' logits are ``-inf`` at every step;
    - ``begin_suppress_tokens`` (an id or a list): these ids' logits are ``-inf`` at the first new
      token (the second after a one-token prompt with ``forced_bos_token_id``, as HF);
    - then the warpers (sampling only; with greedy decoding or beams each is refused, but
      for Hugging Face's defaults ``top_k=50`` and ``top_p=1.0``, taken and ignored as HF's
      greedy ``generate`` ignores them):
      ``temperature``, ``top_k``, ``top_p``, ``min_p=q`` (drops the tokens whose probability
      is below ``q`` times the most likely token's), ``typical_p=m`` (keeps the fewest tokens
      whose surprisal ``-log p`` lies closest to the entropy with probability ``>= m``),
      ``epsilon_cutoff=e`` (drops the tokens of probability ``< e``) and ``eta_cutoff=e``
      (drops those below ``min(e, sqrt(e) * exp(-entropy))``), the most likely token always kept.
    - ``renormalize_logits=True`` (last, HF's ``LogitNormalization``): the processed scores are
      ``log_softmax``-ed again; it changes only beam search (each beam's kept mass is raised
      back to 1 before the beams are compared), as in HF.

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
    padded with ``pad_token_id`` after each sequence's end (as HF's beam search: the first EOS
    id where the pad id is 0 or unset, HF's ``pad_token_id or eos_token_id[0]``). The beams are rows of one batch in
    the same compiled loop, the key-value cache reordered by each step's chosen beams.

    ``return_scores=True`` returns ``(tokens, scores)``, ``scores`` float32 ``[rows, N]``: each
    chosen token's log-probability, 0.0 where a row had already finished. Greedy and sampling:
    ``log_softmax`` of the processed logits it was chosen from (penalty, EOS held back,
    temperature, ``top_k``, ``top_p``), Hugging Face's ``compute_transition_scores(sequences,
    scores, normalize_logits=True)``. Beams: the processors applied to ``log_softmax(logits)``
    (what the beam scores sum), HF's ``compute_transition_scores(sequences, scores,
    beam_indices)``; a sequence's sum over ``new_tokens ** length_penalty`` is its beam score.

    The tokens (and scores) live where the model computed them: its device, or replicated
    over its mesh (``ft.shard``), so that every process of a multi-process job can read them.

    ``streamer`` (Hugging Face's protocol: ``put(token_ids)`` and ``end()``, e.g.
    ``transformers.TextStreamer(tokenizer)``) gets what HF's ``generate`` gives it: the
    prompt ``[batch, P]``, then each step's tokens ``[batch]`` as the step makes them (a
    finished row's pad ids included), then ``end()``; the call then waits for the loop to end.
    Greedy and sampling, called eagerly (not inside a ``jax.jit`` of your own). Without it
    the loop has no host callback at all.

    ``attention_mask`` (bool or 0/1, ``[batch, P]``) marks the real tokens of left-padded
    prompts (0 = padding, at the start of a row); a right-padded one, or one holding another
    value (2, -1: HF's positions ``cumsum(mask) - 1`` would move), is refused where it is
    concrete, naming the entry. Traced, inside a ``jax.jit`` of your own, the output rows of
    a prompt whose mask ends in padding (its last entry 0) or holds a value other than 0 or 1
    are -1 (no token id) with NaN scores: pad on the left. ``model`` follows the cache protocol (see
    the module, and ``docs/guides/generation.md``): ``model.init_cache(batch, P + N)`` and
    ``model(ids, attention_mask=am, positions=pos, cache=cache) -> (logits, cache)``. The
    prompt is one call (prefill), then one token per step in a ``lax.while_loop``, all in one
    compiled function: the same shapes and options compile once. The prompt length and
    ``max_new_tokens`` are compiled as buckets (each rounded up to a power of two, at least 8;
    exact where the rounded sizes would pass ``model.max_positions``; sizes past it are
    refused: the prompt's width, or its longest row's real tokens where the model sets
    ``positions_count_real_tokens``, plus ``max_new_tokens - 1``): the prompt is padded after its last
    token (slots the new tokens overwrite; no real token ever sees them) and the loop stops
    after ``max_new_tokens``, so a next prompt of another length in the same bucket reuses the
    program, with the tokens of exact sizes. The result is cut back on the host (it is ready
    when ``generate`` returns). Sizes whose bucket the model refuses while traced (e.g.
    longrope's switch point inside the larger cache) run at their exact sizes.

    Memory: the key-value cache (``init_cache(rows, bucketed P + N)``) is allocated up front,
    whole. Its bytes are checked before, against the device's free memory (its
    ``memory_stats()``; on the CPU the host's available memory): a cache that does not fit
    raises a ``ValueError`` naming both, instead of aborting the process. A model whose arrays
    a donating step deleted raises naming the key path of the deleted array.

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
    # the options HF's generation config also sets, by keyword in the signature's order (a new
    # control's keyword is picked up here from its record's `keywords`)
    if unknown:  # HF's spellings (output_scores=, do_sample=) and typos, named with the fix
        raise unknown_option(unknown, list(inspect.signature(generate).parameters)[3:-1])
    given = {name: _as_number(value) for name, value in locals().items() if name in SUPPORTED}
    inner = model.model if isinstance(model, Shared) else model
    if not callable(getattr(inner, "init_cache", None)):  # (a Shared has one: its tied model's is asked)
        raise not_a_generator(inner)
    ids = input_ids if isinstance(input_ids, jax.Array) else np.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] < 1:
        raise ValueError(BAD_INPUT_IDS.format(given=short_array(ids)))
    max_new_tokens = _as_number(max_new_tokens)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(BAD_NEW_TOKENS.format(given=max_new_tokens))
    new, prompt = int(max_new_tokens), ids.shape[1]
    limit = getattr(inner, "max_positions", None)
    check = getattr(inner, "check_token_ids", None)
    if callable(check):  # the prompt's ids against the vocabulary, once, here where they are concrete
        check(ids)
    sizes = getattr(inner, "check_generation", None)
    if callable(sizes):  # the model's own limits on these exact sizes (Phi-3's longrope switch point)
        sizes(prompt, new)
    if key is not None:
        _check_key(key)
    checkpoint = checkpoint_defaults(inner)
    options, sourced = _with_defaults(given, checkpoint, key)
    if attention_mask is None and checkpoint is not None:  # HF's mask from the pad id
        attention_mask = inferred_mask(ids, options["pad_token_id"], options["eos_token_id"])
    given_mask = attention_mask
    attention_mask = _attention_mask(attention_mask, ids.shape)  # checked once: the limit's and the loop's
    if isinstance(limit, int):
        _check_positions(inner, ids, new, attention_mask, limit)
    plan = partial(_plan, model, ids, new, attention_mask, key, options, stop, return_scores, streamer, limit,
                   eos_default="eos_token_id" in sourced)
    exact = (type(inner), prompt, new) in _EXACT
    try:
        run = plan(exact=exact)
    except ValueError as error:  # a checkpoint's value: say that it came from there
        raise _sourced(error, sourced, given) from None
    try:
        tokens, scores = _running(run, model, prompt, new)
    except ValueError as error:
        # the model's own leaves on different devices (ids, mask and key follow it): named
        if (apart := devices_error("ft.nn.generate", error, [("model", model)])) is not None:
            raise apart from None
        if exact or run.exact or is_stale_error(error):
            raise
        # the model refused the bucket's sizes while tracing (e.g. longrope's switch point
        # inside the larger cache): these sizes run exact from now on, or raise as exact ones do
        _EXACT.add((type(inner), prompt, new))
        if streamer is not None:  # the refused plan gave the streamer the prompt already
            plan = partial(_plan, model, ids, new, attention_mask, key, options, stop, return_scores,
                           _PromptGiven(streamer), limit, eos_default="eos_token_id" in sourced)
        tokens, scores = _running(plan(exact=True), model, prompt, new)
    if isinstance(given_mask, Tracer):
        tokens, scores = _unmasked_rows(given_mask, tokens, scores)
    return (tokens, scores) if return_scores else tokens


UNLISTED_KEYWORD = """\
{record} ({module}) reads generate's keyword {name!r}, which generate's {where}. Each \
record of CONTROLS is a keyword of ft.nn.generate, written out where users read it: add it \
to functree/generation/_generate.py:

    right:  def generate(..., {name}: <type> | None = None, ...)    # keyword-only, default None
    right:  the docstring's list of controls: ``{name}=...``: what it does to the logits"""


def check_keywords(function: Callable[..., Any], controls: Sequence[type[Control]]) -> None:
    """Raise :data:`UNLISTED_KEYWORD` for a record of ``controls`` whose keyword ``function``'s
    signature lacks (keyword-only, default None) or its docstring does not name (skipped
    when docstrings are stripped, ``python -OO``). Run on ``generate`` at import: a record
    added to :data:`CONTROLS` without its keyword fails there, naming the record."""
    parameters = inspect.signature(function).parameters
    doc = function.__doc__
    for record in controls:
        for name in record.keywords:
            p = parameters.get(name)
            where = None
            if p is None or p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is not None:
                where = "signature lacks (a keyword-only parameter, default None)"
            elif doc is not None and re.search(rf"``{re.escape(name)}\b", doc) is None:
                where = "docstring does not name (as ``" + name + "``)"
            if where is not None:
                raise TypeError(UNLISTED_KEYWORD.format(record=record.__name__, module=record.__module__,
                                                        name=name, where=where))


check_keywords(generate, CONTROLS)


def _as_number(value: Any) -> Any:
    """A concrete 0-d floating or integer array (``jnp.float32(0.9)``, ``np.array(0.9)``,
    ``jnp.int32(4)``) as the Python number it holds: options are read on the host (greedy or
    sampling, HF's checks, a static ``top_k``), and the compiled loop takes the traced ones'
    values as arguments either way. Anything else as it is."""
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and not isinstance(value, Tracer):
        if jnp.issubdtype(value.dtype, jnp.floating):
            return float(value)
        if jnp.issubdtype(value.dtype, jnp.integer):
            return int(value)
    return value


# (model type, prompt length, max_new_tokens) whose bucketed loop the model refused: run exact.
_EXACT: set[tuple[type, int, int]] = set()


def _running(run: Any, model: Any, prompt: int, new: int) -> tuple[Any, Any]:
    """``run()``, with the errors of a cache too large and of a donated model named."""
    try:
        return run()
    except _memory.CacheTooLarge as error:  # raised while tracing: nothing was allocated
        raise error.explained(prompt, new) from None
    except (RuntimeError, ValueError) as error:
        stale = stale_error([("model", model)]) if is_deletion_error(error) else None
        if stale is None:
            raise
        raise stale from None  # a donating step deleted the model's arrays: name the key path


def _with_defaults(given: dict[str, Any], checkpoint: dict[str, Any] | None,
                   key: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The options: each one the caller gave, else the checkpoint's (HF's names; None: a model
    without ``hf_config``), else HF's global default where the model has a checkpoint config,
    as HF's ``generate`` does; and the ones taken from the checkpoint. Sampling's options only
    when sampling."""
    options, sourced = dict(given), {}
    defaults = {} if checkpoint is None else checkpoint
    if options["temperature"] is None:  # HF: do_sample decides; its temperature then applies
        sample = bool(defaults.get("do_sample", False))
        if sample and _beams(options, defaults):  # HF's beam-search sampling: named, not blamed on a temperature
            beams = options["num_beams"] if options["num_beams"] is not None else defaults["num_beams"]
            call = ("" if options["num_beams"] is None else f", num_beams={beams}") + ("" if key is None else ", key=key")
            whose = "the checkpoint's" if options["num_beams"] is None else "given to generate"
            raise ValueError(CHECKPOINT_BEAM_SAMPLES.format(beams=beams, whose=whose, call=call))
        if sample and _is_number(defaults.get("temperature")) and defaults["temperature"] == 0:
            raise ValueError(CHECKPOINT_ZERO_TEMPERATURE.format(temperature=defaults["temperature"]))
        if sample and key is None:
            raise ValueError(CHECKPOINT_SAMPLES.format(values=_sampling_values(defaults)))
        options["temperature"] = defaults.get("temperature", 1.0) if sample else 0.0
        if sample:
            sourced["temperature"] = options["temperature"]
    sampling = _is_number(options["temperature"]) and options["temperature"] > 0
    for name in given:
        if options[name] is not None or name == "temperature":
            continue
        if name in WARPER_OPTIONS and not sampling:
            continue  # greedy: HF's warpers do not run
        if name in ("length_penalty", "early_stopping") and not _beams(options, defaults):
            continue  # beam options without beams: HF ignores them
        value = defaults.get(name, None if checkpoint is None else SAMPLING_DEFAULTS.get(name))
        if value is not None:
            options[name], sourced[name] = value, value
    if options["top_k"] == 0 and "top_k" in sourced:
        options["top_k"] = None  # HF's top_k=0: no filter
    if options["num_beams"] is None:
        options["num_beams"] = 1
    return options, sourced


def _beams(options: dict[str, Any], defaults: dict[str, Any]) -> bool:
    beams = options["num_beams"] if options["num_beams"] is not None else defaults.get("num_beams", 1)
    return _is_int(beams) and beams > 1


def _sampling_values(defaults: dict[str, Any]) -> str:
    """The checkpoint's sampling options (every warper's keyword it sets), for CHECKPOINT_SAMPLES."""
    return ", ".join(f"{k}={defaults[k]!r}" for k in ("temperature", *WARPER_OPTIONS) if k in defaults)


def _sourced(error: ValueError, sourced: dict[str, Any], given: dict[str, Any]) -> ValueError:
    """``error``, or the error naming the checkpoint when the option it is about (named on its
    first line) came from the model's ``hf_config``. An option the caller gave, named there,
    is the caller's to change: ``num_beams=3, temperature=0.7`` is refused for the caller's
    temperature, not for the checkpoint's ``top_k=50`` beside it."""
    if isinstance(error, _GreedyReturns) and "num_return_sequences" in sourced:
        # the caller asked for greedy decoding (or left the checkpoint's greedy); the number of
        # sequences is the checkpoint's: its wrong: line must not show the caller writing it
        call = "" if given.get("temperature") is None else f", temperature={given['temperature']!r}"
        return ValueError(CHECKPOINT_RETURNS.format(given=sourced["num_return_sequences"], call=call))
    first = str(error).split("\n")[0]

    def named(name: str) -> bool:  # as a word: top_k is not named by "top_k_ids"
        return re.search(rf"\b{re.escape(name)}\b", first) is not None

    if any(value is not None and named(name) for name, value in given.items()):
        return error
    for name, value in sourced.items():
        if named(name):
            return bad_value(name, value, error)
    return error


def _plan(model: Any, ids: Any, new: int, attention_mask: Any, key: Any, o: dict[str, Any], stop: Any,
          return_scores: bool, streamer: Any, limit: Any, *, exact: bool = False, eos_default: bool = False) -> Any:
    """Check the options and return the call that runs the compiled loop (and crops its
    bucket back to the prompt and ``new``; ``exact``: no buckets), with ``.exact`` (whether
    its sizes are the exact ones); ``eos_default``: the EOS ids are the checkpoint's."""
    mask = attention_mask  # checked by generate (_attention_mask)
    greedy = _greedy(o["temperature"])
    given_eos = token_ids(o["eos_token_id"], "eos_token_id")
    stops = token_sequences(stop)
    _check_stops(model, stops)
    eos = _ending_ids(model, given_eos, o["eos_token_id"], eos_default)  # those a row can end on
    controls = active(Options(o, new, eos, greedy))  # every record checks its option; warpers only sampling
    if not greedy and key is None:
        raise ValueError(NEEDS_KEY.format(temperature=o["temperature"]))
    pad = token_ids(o["pad_token_id"], "pad_token_id", single=True)
    if stops and not (given_eos or pad):
        raise ValueError(STOP_NEEDS_PAD.format(stop=stop))
    beams, returns, lp, early = _beam_options(o["num_beams"], o["num_return_sequences"], o["length_penalty"],
                                              o["early_stopping"], greedy, o)
    # HF's fill is pad, else the first EOS id even outside the vocabulary (its pad = eos[0]);
    # its beam search fills with `pad or eos[0]`: pad id 0 is falsy there, the EOS fills
    fill = pad[0] if pad and (pad[0] != 0 or beams == 1) else (given_eos[0] if given_eos else 0)
    if beams == 1 and returns > 1:  # sampling: each prompt `returns` times, HF's order (repeat_interleave)
        ids, mask = _repeated(ids, returns), _repeated(mask, returns)
    _check_streamer(streamer, beams, ids)
    prompt = ids.shape[1]
    width, bucket = (prompt, new) if exact else _buckets(prompt, new, limit)
    sizes = np.asarray([prompt, new], np.int32)
    # The bucket's columns after the prompt hold id 0, masked, until new tokens overwrite
    # them: the fill id may lie outside the vocabulary (HF takes pad_token_id=vocab_size as
    # the output's fill), and the prefill embeds every column (NaN keys there made every
    # row's logits NaN through the mask's 0 * NaN).
    # ids, mask or key made on another device than the model's (committed there): moved to it
    padded_ids, padded_mask, key = following(model, (_padded(ids, width, 0, jnp.int32), _padded(mask, width, 0, jnp.int32), key))
    common = (padded_ids, padded_mask, sizes, np.asarray(eos or (-1,), np.int32), np.int32(fill), _stop_ids(stops))
    options = {"new": bucket, "scores": bool(return_scores)}
    reads = model_reads(model)  # a notebook's global the model reads: a key of the loops
    compiled = beam_search if beams > 1 else generate_loop
    compiled = compiled if reads is not None else _decode.traced_afresh(compiled)
    if beams > 1:
        loop = partial(compiled, model, *common, np.float32(lp), np.bool_(early is True),
                       np.bool_(early == "never"), controls, beams=beams, returns=returns, eos_count=len(eos),
                       reads=reads, **options)
    else:
        loop = partial(compiled, model, *common, key, controls, greedy=greedy, ends=bool(eos or stops),
                       stream=streamer is not None, reads=reads, **options)
    run = loop if streamer is None else partial(_streaming, loop, streamer, ids)

    def cropped() -> tuple[Any, Any]:
        tokens, scores = run()
        return _cropped(tokens, scores, prompt + new, new)

    cropped.exact = (width, bucket) == (prompt, new)  # type: ignore[attr-defined]
    return cropped


def _check_positions(model: Any, ids: Any, new: int, mask: Any, limit: int) -> None:
    """Raise :data:`TOO_LONG` or :data:`PROMPT_TOO_LONG` where the model would be fed a
    position past ``max_positions = limit``: ``P + new - 1 > limit`` for the prompt's ``P``
    positions (:func:`_prompt_positions`); the last new token is never fed back (HF's
    ``generate`` makes a prompt of ``max_positions`` tokens one more)."""
    prompt, what = _prompt_positions(model, ids, mask)
    if prompt + new - 1 > limit:
        _too_long(prompt, what, ids.shape[1], new, limit)


def _prompt_positions(model: Any, ids: Any, mask: Any) -> tuple[int, str]:
    """The positions a prompt takes and their description. A model whose positions count
    each row's real tokens (``positions_count_real_tokens = True``: HF's ``cumsum(mask) - 1``,
    as ``from_hf``'s GPT-2 and OPT) is fed ``max_r sum(mask[r])``: its left padding takes
    none. Any other model (its positions may be cache slots), or a traced mask (its real
    tokens are not known here), counts the prompt's width ``P``, left padding included."""
    width = ids.shape[1]
    if getattr(model, "positions_count_real_tokens", False) is not True:
        return width, f"{width} tokens"
    host = mask  # checked (_attention_mask): int32 0/1, NumPy where concrete
    if isinstance(host, Tracer):
        return width, f"{width} tokens, left padding included: a traced attention_mask's real tokens are not counted"
    counts = host.sum(axis=1)
    row = int(np.argmax(counts))
    return int(counts[row]), f"{int(counts[row])} real tokens in row {row}, its longest; left padding takes no position"


def _too_long(prompt: int, what: str, width: int, new: int, limit: int) -> None:
    """Raise :data:`TOO_LONG` (fewer new tokens fit) or :data:`PROMPT_TOO_LONG` (none does:
    keep the last ``limit + 1 - fit`` columns of a prompt of ``width``, ``fit = min(new,
    limit)``) for a prompt that takes ``prompt`` positions (``what``)."""
    if prompt <= limit:
        raise ValueError(TOO_LONG.format(what=what, new=new, fed=prompt + new - 1, limit=limit,
                                         fit=limit + 1 - prompt))
    fit = min(new, limit)
    raise ValueError(PROMPT_TOO_LONG.format(what=what, width=width, new=new, limit=limit, keep=limit + 1 - fit,
                                            fit=fit))


def _check_stops(model: Any, stops: tuple[tuple[int, ...], ...]) -> None:
    """Raise :data:`OUTSIDE_VOCAB` for a stop id the model never emits (the sequence could never
    match). The pad id is not checked: HF's fill may lie outside the vocabulary on purpose."""
    if stops:
        check_in_vocabulary("stop", [i for s in stops for i in s], _decode.vocabulary(model), nested=True)


def _ending_ids(model: Any, eos: tuple[int, ...], given: Any, default: bool) -> tuple[int, ...]:
    """The EOS ids a row can end on: those inside the vocabulary, as HF's ``generate`` (whose
    stopping check compares the chosen token, always ``< vocab``, with every id). Ids outside
    are dropped: a checkpoint's (``default``) with :class:`CheckpointEosWarning`, a caller's
    list silently where some id lies inside; a caller's value with none inside raises
    :data:`EOS_OUTSIDE_VOCAB` (no row could ever end: a typo, or another model's id)."""
    if not eos:
        return eos
    vocab = _decode.vocabulary(model)
    kept = tuple(i for i in eos if i < vocab)
    if len(kept) == len(eos):
        return eos
    outside = sorted({i for i in eos if i >= vocab})
    if default:
        warn_eos_outside(outside, kept, vocab)
    elif not kept:
        raise ValueError(EOS_OUTSIDE_VOCAB.format(ids=outside, vocab=vocab, last=vocab - 1, given=given,
                                                  example=[vocab - 1]))
    return kept


class _PromptGiven:
    """A streamer that has had the prompt: its first ``put`` (the prompt, again) is dropped."""

    def __init__(self, streamer: Any):
        self.streamer, self.given = streamer, False

    def put(self, value: Any) -> None:
        if self.given:
            self.streamer.put(value)
        self.given = True

    def end(self) -> None:
        self.streamer.end()


def _streaming(run: Any, streamer: Any, ids: Any) -> tuple[jax.Array, Any]:
    streamer.put(np.asarray(ids))
    _decode.STREAMERS.append(streamer)
    try:
        tokens, scores = jax.block_until_ready(run())  # every step's callback has run
    finally:
        _decode.STREAMERS.pop()
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


def _attention_mask(mask: Any, shape: tuple[int, ...]) -> Any:
    """int32 0/1 ``[batch, P]``: a numpy array where the mask is concrete (passed to the
    compiled loop as it is: no eager operation compiles per prompt length)."""
    if mask is None:
        return np.ones(shape, np.int32)
    m = mask if isinstance(mask, jax.Array) else np.asarray(mask)
    kind = jnp.issubdtype(m.dtype, jnp.bool_) or jnp.issubdtype(m.dtype, jnp.integer)
    if not kind or tuple(m.shape) != tuple(shape):
        raise ValueError(BAD_ATTENTION_MASK.format(shape=list(shape), given=short_array(m)))
    try:
        host = np.asarray(m)  # a concrete mask (a traced one: _unmasked_rows)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return (m if m.dtype == jnp.bool_ else m != 0).astype(jnp.int32)  # (bool != 0: refused by strict promotion)
    bad = (host != 0) & (host != 1)
    if bad.any():
        row, column = first_index(bad)
        raise ValueError(MASK_NOT_ZERO_ONE.format(row=row, column=column, value=host[row, column].item()))
    last = host[:, -1]
    if not last.all():
        raise ValueError(RIGHT_PADDED.format(row=int(np.argmin(last != 0))))
    return (host != 0).astype(np.int32)


def _unmasked_rows(mask: jax.Array, tokens: Any, scores: Any) -> tuple[Any, Any]:
    """A traced ``mask`` (not read on the host, so not refused by :data:`MASK_NOT_ZERO_ONE`
    or :data:`RIGHT_PADDED`): every output row of a prompt whose mask holds a value other
    than 0 or 1, or ends in padding (its last entry 0: right padding, or none real), is -1
    (no token id: a tokenizer refuses it), its scores NaN, never tokens of a guessed mask or
    tokens that follow padding. One select on the output."""
    if mask.dtype == jnp.bool_:
        bad = ~mask[:, -1]
    else:
        bad = (mask[:, -1] == 0) | jnp.any((mask != 0) & (mask != 1), axis=1)
    bad = jnp.repeat(bad, tokens.shape[0] // mask.shape[0])  # each prompt's returned sequences (HF's order)
    tokens = jnp.where(bad[:, None], jnp.asarray(-1, tokens.dtype), tokens)
    if scores is not None:
        scores = jnp.where(bad[:, None], jnp.asarray(jnp.nan, scores.dtype), scores)
    return tokens, scores


def _buckets(prompt: int, new: int, limit: Any) -> tuple[int, int]:
    """The compiled loop's prompt width and new-token count for ``prompt`` and ``new``: each
    rounded up to a power of two (at least 8), so that the next prompt of a notebook reuses
    the program; exact where the rounded sizes would pass the model's ``max_positions``."""
    width, count = _memory.bucket(prompt), _memory.bucket(new)
    if isinstance(limit, int) and width + count > limit:
        return prompt, new
    return width, count


def _padded(x: Any, width: int, value: int, dtype: Any) -> Any:
    """``x [rows, P]`` with ``value`` in the columns ``P .. width - 1`` (the bucket's padding,
    after the prompt: its slots are overwritten by the new tokens); numpy where ``x`` is
    concrete (no eager operation to compile), traced otherwise."""
    if isinstance(x, Tracer):
        return jnp.pad(x.astype(dtype), ((0, 0), (0, width - x.shape[1])), constant_values=value)
    if isinstance(x, jax.Array) and x.shape[1] == width and x.dtype == dtype:
        return x  # already on the device as the loop takes it
    x = np.asarray(x).astype(dtype)
    return np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value) if x.shape[1] < width else x


def _repeated(x: Any, times: int) -> Any:
    """Each row of ``x`` ``times`` times in a row (HF's ``repeat_interleave``)."""
    return jnp.repeat(x, times, axis=0) if isinstance(x, Tracer) else np.repeat(np.asarray(x), times, axis=0)


def _stop_ids(stops: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """The stop sequences as int32 ``[S, L]``, right-aligned, -1 where a shorter one has no token."""
    width = max((len(s) for s in stops), default=1)
    stop_ids = np.full((len(stops), width), -1, np.int32)
    for row, sequence in zip(stop_ids, stops):
        row[width - len(sequence):] = sequence
    return stop_ids


def _cropped(tokens: Any, scores: Any, length: int, new: int) -> tuple[Any, Any]:
    """The loop's bucket cut back to ``length`` tokens and ``new`` scores per row: on the
    host (a device slice would compile once per size, which the bucket is there to avoid)."""
    if tokens.shape[1] == length and (scores is None or scores.shape[1] == new):
        return tokens, scores
    if isinstance(tokens, Tracer):
        return tokens[:, :length], None if scores is None else scores[:, :new]
    crop = lambda x, n: _placed_as(np.ascontiguousarray(np.asarray(x)[:, :n]), x.sharding)  # noqa: E731
    return crop(tokens, length), None if scores is None else crop(scores, new)


def _placed_as(host: np.ndarray, sharding: Any) -> jax.Array:
    """``host`` where the loop left its output (a device, or replicated over a mesh), as the
    uncropped output is returned: never one device of a mesh that another process of a
    multi-process job owns (that process could not read it)."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])  # this process's shards


def _greedy(temperature: Any) -> bool:
    """Whether ``temperature`` (checked) is greedy decoding's 0 (the warpers' options are
    checked by their records, and refused with greedy decoding by ``active`` but at HF's
    defaults ``top_k=50``, ``top_p=1.0``, which it drops)."""
    if not _is_number(temperature) or not temperature >= 0:
        raise ValueError(BAD_TEMPERATURE.format(given=temperature))
    return temperature == 0


def _beam_options(beams: Any, returns: Any, length_penalty: Any, early: Any, greedy: bool,
                  o: dict[str, Any]) -> tuple[int, int, float, bool | str]:
    if not _is_int(beams) or beams < 1:
        raise ValueError(BAD_NUM_BEAMS.format(given=beams))
    if beams == 1:  # HF's defaults say nothing; any other value would be ignored, so it is refused
        for name, value, default in (("length_penalty", length_penalty, 1.0), ("early_stopping", early, False)):
            same = value is False if default is False else _is_number(value) and value == default
            if value is not None and not same:
                raise ValueError(BEAM_OPTION.format(name=name, value=value))
        if returns is not None and (not _is_int(returns) or returns < 1):
            raise ValueError(BAD_RETURN_SEQUENCES.format(beams="num_beams", given=returns, fit=2))
        if greedy and returns not in (None, 1):  # HF raises too: greedy rows would be copies
            raise _GreedyReturns(GREEDY_RETURNS.format(given=returns))
        return 1, 1 if returns is None else int(returns), 1.0, False
    if not greedy:
        rest = "".join(f", {n}={o[n]!r}" for n in WARPER_OPTIONS if o[n] is not None)  # every warper's
        raise ValueError(BEAMS_SAMPLE.format(beams=beams, temperature=o["temperature"], rest=rest))
    if returns is not None and (not _is_int(returns) or not 1 <= returns <= beams):
        raise ValueError(BAD_RETURN_SEQUENCES.format(beams=beams, given=returns,
                                                     fit=returns if _is_int(returns) and returns > 1 else beams))
    if length_penalty is not None and (not _is_number(length_penalty) or not np.isfinite(length_penalty)):
        raise ValueError(BAD_LENGTH_PENALTY.format(given=length_penalty))
    if early is not None and early is not True and early is not False and early != "never":
        raise ValueError(BAD_EARLY_STOPPING.format(given=early))
    return (int(beams), 1 if returns is None else int(returns), 1.0 if length_penalty is None else float(length_penalty),
            False if early is None else early)


