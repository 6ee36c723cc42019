"""Generation's logits controls as records: one frozen class per control, folded over by the loops.

A control is Hugging Face's ``LogitsProcessor`` idea made a pytree record: its ``generate``
keyword(s) (also the name of its checkpoint default in ``generation_config.json``), a
``build`` that checks the options and returns the record (None: the option is unset, the
control is absent), and three traced steps::

    state  = control.init(loop)                    # per row: [rows, ...] (or None)
    scores = control.apply(scores, state, now)     # float32 [rows, vocab] -> [rows, vocab]
    state  = control.update(state, token, now)     # after the row's token [rows] is chosen

The loops (``_decode.py``) take the active controls as one tuple argument of their
``jax.jit``: a record's static fields (``n``, ids) are part of the compiled program's key, its
array fields (a penalty, a temperature) are traced, so a new value reuses the program. An
unset option adds nothing: plain greedy's tuple is empty and its program has no control's
operation. Beam search reorders every state's rows with the beams it keeps.

Adding a control is one record here and its place in :data:`CONTROLS` (HF's order: the
processors, then the warpers, which run only when sampling), plus its test. Everything else
follows from the record: its keyword is a checkpoint option (``_defaults.SUPPORTED``, and so
never named as unapplied), a warper is refused with greedy decoding and beams (at any value
but Hugging Face's default, :data:`SAMPLING_DEFAULTS`, which greedy ignores). Its keyword is
also written out in ``generate``'s signature and docstring (explicit, for users' tools): a
check at import names the record whose keyword is missing there.

Example:
    >>> import jax.numpy as jnp
    >>> c = SuppressTokens((1,))
    >>> c.apply(jnp.zeros((1, 3), jnp.float32), None, None).tolist()
    [[0.0, -inf, 0.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._tree import register_record
from functree.generation._logits import (
    bad_word_ends,
    check_in_vocabulary,
    ngram_completions,
    prompt_tokens,
    word_matches,
)
from functree.nn._window import is_int

BAD_TOP_K = """\
generate: top_k must be an int >= 0 (k: keep the k most likely tokens, all of them when k is \
past the vocabulary; 0 or None: no top-k), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, top_k=50, key=key)"""

BAD_NGRAM = """\
generate: no_repeat_ngram_size must be an int >= 0 (n: no n-gram appears twice in a row; 0: \
none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, no_repeat_ngram_size=3)"""

BAD_TOKEN_ID = """\
generate: {name} must be a token id (an int from 0 to 2**31 - 1: the tokens are int32){plural}, \
got {given!r}.

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
from 0 to 2**31 - 1), got {given!r}.

    wrong:  ft.nn.generate(model, input_ids, 8, {name}=[13, 198])      # one sequence or two?
    right:  ft.nn.generate(model, input_ids, 8, {name}=[[13, 198]])    # the pair 13, 198
    right:  ft.nn.generate(model, input_ids, 8, {name}=[[13], [198]])  # either token"""

BAD_TOP_P = """\
generate: top_p must be a number in [0, 1] (the probability mass kept; 0: the most likely token \
alone, as Hugging Face keeps it), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, top_p=0.9, key=key)"""

BAD_MIN_P = """\
generate: min_p must be a number in [0, 1] (tokens less likely than min_p times the most \
likely one are dropped; 0: none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, min_p=0.05, key=key)"""

BAD_TYPICAL_P = """\
generate: typical_p must be a number in (0, 1] (the probability mass of the tokens whose \
surprisal is closest to the entropy that is kept; 1: none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, typical_p=0.9, key=key)"""

BAD_CUTOFF = """\
generate: {name} must be a number in [0, 1) (tokens less likely than the cutoff are dropped; 0: \
none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, {name}={example}, key=key)"""

BAD_SEQUENCE_BIAS = """\
generate: sequence_bias must map token-id sequences to a number added to their last token's \
score where the row ends with the others (Hugging Face's {{(ids...): bias}} or [[ids, bias], ...]), \
each sequence a non-empty list of token ids (ints >= 0) and each bias a number (not NaN), got \
{given!r}.

    right:  ft.nn.generate(model, input_ids, 8, sequence_bias={{(13,): -2.0, (7, 8): 1.5}})
    right:  ft.nn.generate(model, input_ids, 8, sequence_bias=[[[13], -2.0], [[7, 8], 1.5]])"""

FORCED_SUPPRESSED = """\
generate: every id of {name} ({ids}) is also in suppress_tokens: the forced step would have no \
token left (every score -inf; Hugging Face's generate refuses this too).

    wrong:  ft.nn.generate(model, input_ids, 8, {name}={example}, suppress_tokens=[{first}])
    right:  ft.nn.generate(model, input_ids, 8, {name}={example})     # or suppress other ids"""

FORCED_AT_BEGIN_SUPPRESSED = """\
generate: every id of forced_eos_token_id ({ids}) is in begin_suppress_tokens, and with \
max_new_tokens=1 the forced last token is the first, where those ids are removed: no token is \
left (every score -inf: Hugging Face's greedy returns id 0 with a NaN score, its sampling fails).

    wrong:  ft.nn.generate(model, input_ids, 1, forced_eos_token_id={example}, begin_suppress_tokens=[{first}])
    right:  ft.nn.generate(model, input_ids, 2, forced_eos_token_id={example}, begin_suppress_tokens=[{first}])"""

BAD_MIN_LENGTH = """\
generate: min_length must be an int >= 0 (the EOS ids are held back while the row, prompt \
included with its left padding, is shorter: Hugging Face's min_length), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, eos_token_id=eos, min_length=input_ids.shape[1] + 4)"""

NEEDS_EOS = """\
generate: {name}={given!r} holds eos_token_id back, but no eos_token_id is given (nothing to \
hold back).

    wrong:  ft.nn.generate(model, input_ids, 8, {name}={given!r})
    right:  ft.nn.generate(model, input_ids, 8, {name}={given!r}, eos_token_id=eos)"""

BAD_DECAY = """\
generate: exponential_decay_length_penalty must be a pair (start, factor): an int start >= 0 \
(new tokens before the penalty) and a finite number factor > 0 (the EOS scores grow by \
|score| * (factor ** (t - start) - 1) at new token t), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 32, eos_token_id=eos, exponential_decay_length_penalty=(16, 1.1))"""

DECAY_NEEDS_EOS = """\
generate: exponential_decay_length_penalty={given!r} raises the EOS ids' scores after {start} \
new tokens, but no eos_token_id is given (nothing to raise).

    wrong:  ft.nn.generate(model, input_ids, 32, exponential_decay_length_penalty={given!r})
    right:  ft.nn.generate(model, input_ids, 32, exponential_decay_length_penalty={given!r}, eos_token_id=eos)"""

BAD_RENORMALIZE = """\
generate: renormalize_logits must be True or False (True: the processed scores are \
log-softmaxed again after every control, as Hugging Face's LogitNormalization; it changes which \
beams win when a control removes tokens), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, num_beams=4, renormalize_logits=True)"""

# Hugging Face's global defaults of the sampling options (GenerationConfig's): what its greedy
# generate is given when nobody sets them, so a greedy call may pass them (they change nothing).
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}

GREEDY_OPTIONS = """\
generate: {name}= filters the tokens that sampling draws from, but temperature=0.0 is greedy \
(the most likely token, whatever {name} says; beam search is greedy too). Only Hugging Face's \
defaults (top_k=50, top_p=1.0), which change nothing there, are taken without a key.

    wrong:  ft.nn.generate(model, input_ids, 8, {name}={value!r})
    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, {name}={value!r}, key=key)"""

LOWEST = -jnp.inf  # a token a control removes


def _removed(mask: jax.Array, scores: jax.Array) -> jax.Array:
    """``scores`` with the tokens where ``mask`` is True removed (:data:`LOWEST`)."""
    return jnp.where(jax.lax.broadcast_to_rank(mask, scores.ndim), jnp.asarray(LOWEST, jnp.float32), scores)


def _distribution(scores: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(p, log p, H)`` of ``softmax(scores)`` over the tokens still kept, ``H = -sum(p log p)``
    (``[rows, 1]``); a removed token has ``p = 0``, ``log p = 0`` and adds 0 to ``H``.

    No ``-inf`` enters ``exp``, ``log`` or a product: ``-inf * 0`` is NaN even in the branch a
    ``jnp.where`` does not take, and a CPU's vectorized ``exp(-inf)`` is the one input a
    polynomial kernel may get wrong."""
    kept = scores > LOWEST
    shifted = jnp.where(kept, scores - jnp.max(scores, axis=-1, keepdims=True), 0.0)
    e = jnp.where(kept, jnp.exp(shifted), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)  # >= 1: the most likely token adds exp(0)
    p = e / total
    logp = jnp.where(kept, shifted - jnp.log(total), 0.0)
    return p, logp, -jnp.sum(p * logp, axis=-1, keepdims=True)


class Loop(NamedTuple):
    """What a control's ``init`` and ``apply`` may read of the running loop: the prompt ``ids``
    and ``prompt_mask`` ``[batch, W]`` (bucket-padded), its real length ``prompt`` (traced),
    the bucket's ``new`` tokens, the vocabulary size, the ``beams`` per prompt (rows =
    batch * beams) and ``limit``, the call's ``max_new_tokens`` (traced)."""

    ids: jax.Array
    prompt_mask: jax.Array
    prompt: Any
    new: int
    vocab: int
    beams: int = 1
    limit: Any = None


class Now(NamedTuple):
    """A step of the loop: new token ``t`` is being chosen after ``tokens [rows, W + new]``."""

    loop: Loop
    t: Any
    tokens: jax.Array

    def row(self) -> jax.Array:
        """bool ``[rows, W + new]``: the row's tokens before new token ``t``, its left padding
        included: Hugging Face's ``input_ids``, which its n-grams, bad words and sequence biases
        are matched against (pad ids and all; its repetition penalty alone skips the padding)."""
        slots = jnp.arange(self.tokens.shape[1])[None]  # (a row: rank promotion may raise)
        return jnp.broadcast_to(slots < self.loop.prompt + self.t, self.tokens.shape)


class Options(NamedTuple):
    """What ``build`` reads: ``generate``'s options by keyword (checkpoint defaults applied:
    every record's keywords are there, None where unset), ``max_new_tokens``, the EOS ids and
    whether the loop is greedy (:func:`active` refuses a warper there; ``build`` need not
    look)."""

    given: Mapping[str, Any]
    new: int
    eos: tuple[int, ...]
    greedy: bool


T = TypeVar("T")


def record(*data: str) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a pytree whose fields ``data`` are its (traced) leaves and
    the others its (static, hashable) structure: the key of the compiled loop. Its tree
    definition names its class (``register_record``: ``TopP(p)`` and ``MinP(p)`` are two
    keys, which ``jax.tree_util.register_dataclass`` made one from jaxlib 0.10 on)."""
    def make(cls: type[T]) -> type[T]:
        meta = [f.name for f in dataclasses.fields(cls) if f.name not in data]  # type: ignore[arg-type]
        register_record(cls, data, meta)
        return cls
    return make


class Control:
    """A logits control: the default steps keep no state and change nothing.

    ``build(o)`` checks the options (raising a named error) and returns the record or None;
    ``init(loop)`` returns the state of each prompt, rows first (``[batch, ...]``: beam search
    repeats it per beam and reorders it with the beams it keeps; None: no state);
    ``apply(scores, state, now)`` returns the float32 scores ``[rows, vocab]`` (``now.tokens``:
    the rows so far); ``update(state, token, now)`` returns the state after the rows' tokens
    ``[rows]`` (a finished row's is its pad id)."""

    keywords: ClassVar[tuple[str, ...]] = ()  # generate's keywords (= HF's generation config names)
    warper: ClassVar[bool] = False  # applied only when sampling (HF's warpers)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        raise NotImplementedError

    def init(self, loop: Loop) -> Any:
        return None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        return scores

    def update(self, state: Any, token: jax.Array, now: Now) -> Any:
        return state


@record("biases")
@dataclass(frozen=True)
class SequenceBias(Control):
    """``sequence_bias`` (HF's ``SequenceBiasLogitsProcessor``, first of all): each sequence's
    bias is added to its last token's score where the row ends with the others (a one-token
    sequence: always; the row's left padding is matched too, its pad ids, as HF matches its
    ``input_ids``); biases of sequences ending in one token add up, and a sequence
    given twice keeps its last bias (HF's dict)."""

    words: tuple[tuple[int, ...], ...]
    biases: Any  # float32 [words]
    keywords = ("sequence_bias",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["sequence_bias"]
        if value is None:
            return None
        pairs = _bias_pairs(value)
        if pairs is None:
            raise ValueError(BAD_SEQUENCE_BIAS.format(given=value))
        table = dict(pairs)  # a sequence given twice: its last bias, as HF's dict
        return cls(tuple(table), np.asarray(list(table.values()), np.float32))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        check_in_vocabulary("sequence_bias", [i for word in self.words for i in word], scores.shape[-1], nested=True)
        match = word_matches(now.tokens, now.row(), now.loop.prompt + now.t, self.words)  # [rows, words]
        last = np.asarray([word[-1] for word in self.words])
        added = jnp.where(match, self.biases, jnp.float32(0.0))
        return scores + jnp.zeros_like(scores).at[:, last].add(added)


def _bias_pairs(value: Any) -> list[tuple[tuple[int, ...], float]] | None:
    """HF's two forms of ``sequence_bias`` as ``(ids, bias)`` pairs; None when malformed."""
    try:
        items = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
        pairs = []
        for ids, bias in items:
            ids = tuple(ids)
            if not ids or not all(is_int(i) and i >= 0 for i in ids) or not is_number(bias) or bias != bias:
                return None
            pairs.append((tuple(int(i) for i in ids), float(bias)))
    except (TypeError, ValueError):
        return None
    return pairs or None


@record("penalty")
@dataclass(frozen=True)
class RepetitionPenalty(Control):
    """``repetition_penalty=r``: a seen token's score ``l`` becomes ``l / r`` if ``l > 0``, else
    ``l * r``; the state is bool ``[rows, vocab]``, the tokens in the row: the prompt's from its
    first real token on (HF's ``prompt_ignore_length``, the left padding's width: a masked
    token after a real one counts, as in HF), then the generated ones."""

    penalty: Any
    keywords = ("repetition_penalty",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["repetition_penalty"]
        if value is None:
            return None
        if not is_number(value) or not (0.0 < value < np.inf):
            raise ValueError(BAD_REPETITION_PENALTY.format(given=value))
        return None if value == 1.0 else cls(np.float32(value))

    def init(self, loop: Loop) -> Any:
        # from the first real slot to the prompt's end (slot `prompt` on: the bucket's padding)
        slots = jnp.arange(loop.prompt_mask.shape[1])[None]  # (a row: rank promotion may raise)
        counted = (jnp.cumsum(loop.prompt_mask != 0, axis=1) > 0) & (slots < loop.prompt)
        return prompt_tokens(loop.ids, counted.astype(jnp.int32), loop.vocab)

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        return jnp.where(state, jnp.where(scores < 0, scores * self.penalty, scores / self.penalty), scores)

    def update(self, state: Any, token: jax.Array, now: Now) -> Any:
        return state.at[jnp.arange(token.shape[0]), token].set(True)


@record()
@dataclass(frozen=True)
class NoRepeatNGram(Control):
    """``no_repeat_ngram_size=n``: a token completing an ``n``-gram already in the row is
    removed (the row's left padding included, its pad ids forming n-grams, as in HF's
    ``input_ids``)."""

    n: int
    keywords = ("no_repeat_ngram_size",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["no_repeat_ngram_size"]
        if value is None:
            return None
        if not is_int(value) or value < 0:
            raise ValueError(BAD_NGRAM.format(given=value))
        return cls(int(value)) if value else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        banned = ngram_completions(now.tokens, now.row(), now.loop.prompt + now.t, self.n, now.loop.vocab)
        return _removed(banned, scores)


@record()
@dataclass(frozen=True)
class BadWords(Control):
    """``bad_words_ids``: the last token of a sequence whose others end the row is removed (a
    one-token sequence that is an EOS id is ignored, as HF does; a prefix may reach into the
    row's left padding, matching its pad ids, as HF's ``input_ids``)."""

    words: tuple[tuple[int, ...], ...]
    keywords = ("bad_words_ids",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        words = token_sequences(o.given["bad_words_ids"], "bad_words_ids")
        words = tuple(w for w in words if not (len(w) == 1 and w[0] in o.eos))
        return cls(words) if words else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        banned = bad_word_ends(now.tokens, now.row(), now.loop.prompt + now.t, self.words, now.loop.vocab)
        return _removed(banned, scores)


@record("n", "eos_ids")
@dataclass(frozen=True)
class MinNewTokens(Control):
    """``min_new_tokens=m``: the EOS ids are removed while fewer than ``m`` tokens are new."""

    n: Any
    eos_ids: Any
    keywords = ("min_new_tokens",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["min_new_tokens"]
        if value is None:
            return None
        if not is_int(value) or not 0 <= value <= o.new:
            raise ValueError(BAD_MIN_NEW_TOKENS.format(new=o.new, given=value, fit=max(o.new // 2, 1)))
        if value > 0 and not o.eos:
            raise ValueError(MIN_NEEDS_EOS.format(given=value))
        return cls(np.int32(value), np.asarray(o.eos, np.int32)) if value else None

    def length(self, now: Any) -> Any:
        """The count held against ``n``: the new tokens so far."""
        return now.t

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        is_eos = jnp.isin(jnp.arange(scores.shape[-1]), self.eos_ids)[None]  # (a row: rank promotion may raise)
        return _removed(is_eos & (self.length(now) < self.n), scores)


@record("n", "eos_ids")
@dataclass(frozen=True)
class MinLength(MinNewTokens):
    """``min_length=m`` (HF's ``MinLengthLogitsProcessor``): the EOS ids are removed while the
    row, its whole prompt included (left padding too, as HF counts ``input_ids``), holds fewer
    than ``m`` tokens: at new token ``t`` while ``prompt + t < m``. With ``min_new_tokens`` set
    (0 too, the caller's or the checkpoint's) it is not applied: HF's ``generate`` then
    overwrites ``min_length`` with ``prompt + min_new_tokens``. Its fields and step are
    :class:`MinNewTokens`'; only the length counted differs."""

    keywords = ("min_length",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["min_length"]
        if value is None:
            return None
        if not is_int(value) or value < 0:
            raise ValueError(BAD_MIN_LENGTH.format(given=value))
        if o.given["min_new_tokens"] is not None:  # HF: min_new_tokens wins
            return None
        if value > 0 and not o.eos:
            raise ValueError(NEEDS_EOS.format(name="min_length", given=value))
        return cls(np.int32(min(int(value), np.iinfo(np.int32).max)), np.asarray(o.eos, np.int32)) if value else None

    def length(self, now: Any) -> Any:
        """The count held against ``n``: the whole row, the prompt's width included."""
        return now.loop.prompt + now.t


def _forced(o: Options, name: str, single: bool) -> tuple[int, ...]:
    """Option ``name``'s forced ids, or :data:`FORCED_SUPPRESSED` where ``suppress_tokens``
    holds all of them (HF's GenerationConfig check)."""
    ids = token_ids(o.given[name], name, single=single)
    if ids and set(ids) <= set(token_ids(o.given["suppress_tokens"], "suppress_tokens")):
        raise ValueError(FORCED_SUPPRESSED.format(name=name, ids=sorted(set(ids)), example=o.given[name],
                                                  first=ids[0]))
    return ids


def _only(ids: Any, scores: jax.Array, now: jax.Array) -> jax.Array:
    """``scores`` where ``now`` is False; where True, 0 at ``ids`` and removed elsewhere (HF's
    forced tokens)."""
    forced = jnp.where(jnp.isin(jnp.arange(scores.shape[-1]), ids), jnp.float32(0.0), jnp.float32(LOWEST))
    return jnp.where(jax.lax.broadcast_to_rank(now, scores.ndim), jax.lax.broadcast_to_rank(forced, scores.ndim), scores)


@record()
@dataclass(frozen=True)
class ForcedBOS(Control):
    """``forced_bos_token_id=b`` (HF's ``ForcedBOSTokenLogitsProcessor``): when the row holds one
    token (a one-token prompt, at its first new token) every id but ``b`` is removed (``b``
    scores 0)."""

    id: int
    keywords = ("forced_bos_token_id",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        ids = _forced(o, "forced_bos_token_id", single=True)
        return cls(ids[0]) if ids else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        check_in_vocabulary("forced_bos_token_id", (self.id,), scores.shape[-1])
        return _only(np.asarray([self.id]), scores, (now.loop.prompt + now.t) == 1)


@record()
@dataclass(frozen=True)
class ForcedEOS(Control):
    """``forced_eos_token_id`` (an id or a list; HF's ``ForcedEOSTokenLogitsProcessor``): at the
    last new token (``t = max_new_tokens - 1``) every id but these is removed (they score 0)."""

    ids: tuple[int, ...]
    keywords = ("forced_eos_token_id",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        ids = _forced(o, "forced_eos_token_id", single=False)
        if ids and o.new == 1 and set(ids) <= set(token_ids(o.given["begin_suppress_tokens"], "begin_suppress_tokens")):
            raise ValueError(FORCED_AT_BEGIN_SUPPRESSED.format(ids=sorted(set(ids)), example=o.given["forced_eos_token_id"],
                                                               first=ids[0]))
        return cls(ids) if ids else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        check_in_vocabulary("forced_eos_token_id", self.ids, scores.shape[-1])
        return _only(np.asarray(self.ids), scores, now.t == now.loop.limit - 1)


@record("start", "factor", "eos_ids")
@dataclass(frozen=True)
class ExponentialDecayLengthPenalty(Control):
    """``exponential_decay_length_penalty=(start, factor)``: at new token ``t > start`` (``t``
    from 0: the ``(start + 2)``-th new token on) each
    EOS id's score ``l`` becomes ``l + |l| * (factor ** (t - start) - 1)`` (HF's
    ``ExponentialDecayLengthPenalty``; a removed EOS stays removed). Greedy, sampling and beams.
    A ``start`` past any reachable length (even past int32) never applies."""

    start: Any
    factor: Any
    eos_ids: Any
    keywords = ("exponential_decay_length_penalty",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["exponential_decay_length_penalty"]
        if value is None:
            return None
        pair = isinstance(value, (tuple, list)) and len(value) == 2
        if not (pair and is_int(value[0]) and value[0] >= 0 and is_number(value[1]) and 0 < value[1] < np.inf):
            raise ValueError(BAD_DECAY.format(given=value))
        if not o.eos:
            raise ValueError(DECAY_NEEDS_EOS.format(given=value, start=value[0]))
        # a start past any reachable length never applies (as in HF): clipped, not an int32 overflow
        start = min(int(value[0]), np.iinfo(np.int32).max)
        return cls(np.int32(start), np.float32(value[1]), np.asarray(o.eos, np.int32))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        steps = now.t - self.start  # HF: cur_len - (prompt + start)
        at = scores[:, self.eos_ids]
        grown = at + jnp.abs(at) * (jnp.power(self.factor, steps.astype(jnp.float32)) - 1.0)
        # .set, not .add: an EOS id listed twice is raised once, as HF's assignment does
        return scores.at[:, self.eos_ids].set(jnp.where((steps > 0) & jnp.isfinite(at), grown, at))


@record()
@dataclass(frozen=True)
class SuppressTokens(Control):
    """``suppress_tokens`` (an id or a list): these ids are removed at every step."""

    ids: tuple[int, ...]
    keywords = ("suppress_tokens",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        ids = token_ids(o.given["suppress_tokens"], "suppress_tokens")
        return cls(ids) if ids else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        vocab = scores.shape[-1]
        check_in_vocabulary("suppress_tokens", self.ids, vocab)  # known once traced
        suppressed = jnp.zeros((vocab,), bool).at[np.asarray(self.ids)].set(True)
        return _removed(suppressed, scores)


@record()
@dataclass(frozen=True)
class BeginSuppressTokens(Control):
    """``begin_suppress_tokens`` (an id or a list; HF's ``SuppressTokensAtBeginLogitsProcessor``):
    these ids are removed at the first new token (the second after a one-token prompt when
    ``forced_bos_token_id`` is set, as HF moves it)."""

    ids: tuple[int, ...]
    after_bos: bool
    keywords = ("begin_suppress_tokens",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        ids = token_ids(o.given["begin_suppress_tokens"], "begin_suppress_tokens")
        return cls(ids, o.given["forced_bos_token_id"] is not None) if ids else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        vocab = scores.shape[-1]
        check_in_vocabulary("begin_suppress_tokens", self.ids, vocab)
        suppressed = jnp.zeros((vocab,), bool).at[np.asarray(self.ids)].set(True)
        begin = jnp.where((now.loop.prompt == 1) & self.after_bos, 1, 0)
        return _removed(suppressed & (now.t == begin), scores)


@record("temperature")
@dataclass(frozen=True)
class Temperature(Control):
    """Sampling: ``scores / temperature`` (its value checked by ``generate``, which decides greedy)."""

    temperature: Any
    keywords = ("temperature",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        t = o.given["temperature"]  # checked by generate (its value decides greedy)
        return cls(np.float32(t)) if t else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        return scores / self.temperature


@record()
@dataclass(frozen=True)
class TopK(Control):
    """``top_k=k``: all but the ``k`` most likely tokens are removed."""

    k: int
    keywords = ("top_k",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        k = o.given["top_k"]
        if k is None or (isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k == 0):
            return None  # top_k=0: no top-k, as Hugging Face reads it
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(BAD_TOP_K.format(given=k))
        return cls(int(k))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        # Hugging Face's TopKLogitsWarper keeps min(k, vocab): a k past the vocabulary (its
        # default 50 on a small model) keeps every token.
        k = min(self.k, scores.shape[-1])
        kth = jax.lax.top_k(scores, k)[0][..., -1:]
        return _removed(scores < kth, scores)


@record("rest")
@dataclass(frozen=True)
class TopP(Control):
    """``top_p=p`` (nucleus): only the smallest set of most likely tokens whose probability
    reaches ``p`` is kept (``p = 1``: absent): Hugging Face's ``TopPLogitsWarper`` rule, the
    tokens in ascending order removed while their cumulative probability is ``<= 1 - p``, the
    most likely always kept. Of tied tokens at the cut the lower id is removed first (a stable
    sort; torch's unstable sort of a long row may keep another of them: the same number of
    tokens, the same kept scores). (A threshold on the scores kept every token tied with the last one:
    3 of ``[0.5, 0.25, 0.25]`` at ``p = 0.75`` where HF keeps 2; bf16 logits tie often.)"""

    rest: Any  # 1 - p, rounded once from Python's float as HF's comparison rounds it
    keywords = ("top_p",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        p = _fraction(o, "top_p", "[]", off=1.0, error=BAD_TOP_P)  # HF's range: 0 keeps the top token
        return None if p is None else cls(np.float32(1.0 - float(o.given["top_p"])))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        order = jnp.argsort(scores, axis=-1, stable=True)  # ascending; ties by id, as torch.sort's
        mass = jnp.cumsum(_distribution(jnp.take_along_axis(scores, order, axis=-1))[0], axis=-1)
        drop = (mass <= self.rest).at[..., -1].set(False)  # the most likely stays
        rows = jnp.arange(scores.shape[0])[:, None]
        return _removed(jnp.zeros_like(drop).at[rows, order].set(drop), scores)


@record("p")
@dataclass(frozen=True)
class MinP(Control):
    """``min_p=q``: tokens less likely than ``q`` times the most likely one are removed (``q =
    0``: absent)."""

    p: Any
    keywords = ("min_p",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        p = _fraction(o, "min_p", "[]", off=0.0, error=BAD_MIN_P)
        return None if p is None else cls(p)

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        probs = _distribution(scores)[0]  # p < q * p_max (the most likely token stays)
        return _removed(probs < self.p * jnp.max(probs, axis=-1, keepdims=True), scores)


@record("mass")
@dataclass(frozen=True)
class TypicalP(Control):
    """``typical_p=m`` (locally typical sampling, HF's ``TypicalLogitsWarper``): with
    ``H = -sum(p log p)``, the tokens ordered by ``|-log p - H|`` (surprisal's distance to the
    entropy); the fewest of the closest whose probability reaches ``m`` are kept, the closest
    always (``m = 1``: absent)."""

    mass: Any
    keywords = ("typical_p",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        m = _fraction(o, "typical_p", "(]", off=1.0, error=BAD_TYPICAL_P)
        return None if m is None else cls(m)

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        _, logp, entropy = _distribution(scores)
        distance = jnp.where(scores > LOWEST, jnp.abs(-logp - entropy), jnp.inf)  # a removed token: last
        order = jnp.argsort(distance, axis=-1, stable=True)
        ordered = jnp.take_along_axis(distance, order, axis=-1)
        mass = jnp.cumsum(_distribution(jnp.take_along_axis(scores, order, axis=-1))[0], axis=-1)  # HF's
        last = jnp.minimum(jnp.sum(mass < self.mass, axis=-1, keepdims=True), scores.shape[-1] - 1)
        return _removed(distance > jnp.take_along_axis(ordered, last, axis=-1), scores)


def _fraction(o: Options, option: str, bounds: str, *, off: float, error: str, **fmt: Any) -> Any:
    """Option ``option``, a probability in ``[0, 1]`` with the ends ``bounds`` says (``"(]"``:
    0 excluded, 1 included), as float32; None when absent or at ``off`` (the value that
    changes nothing); else ``error`` (formatted with ``given`` and ``fmt``)."""
    value = o.given[option]
    if value is None:
        return None
    low, high = bounds
    ok = is_number(value) and (value > 0.0 if low == "(" else value >= 0.0) and (
        value < 1.0 if high == ")" else value <= 1.0)
    if not ok:
        raise ValueError(error.format(given=value, **fmt))
    return None if value == off else np.float32(value)


def _below(probs: jax.Array, cutoff: jax.Array, scores: jax.Array) -> jax.Array:
    """``scores`` without the tokens whose probability (or its log, beside a log cutoff) is
    below ``cutoff``, the most likely kept."""
    top = jnp.max(scores, axis=-1, keepdims=True)
    return _removed((probs < cutoff) & (scores < top), scores)


@record("epsilon")
@dataclass(frozen=True)
class EpsilonCutoff(Control):
    """``epsilon_cutoff=e`` (HF's ``EpsilonLogitsWarper``): tokens of probability ``< e`` are
    removed, the most likely kept (``e = 0``: absent)."""

    epsilon: Any
    keywords = ("epsilon_cutoff",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        e = _fraction(o, "epsilon_cutoff", "[)", off=0.0, error=BAD_CUTOFF, name="epsilon_cutoff", example=3e-4)
        return None if e is None else cls(e)

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        return _below(_distribution(scores)[0], self.epsilon, scores)


@record("log_epsilon")
@dataclass(frozen=True)
class EtaCutoff(Control):
    """``eta_cutoff=e`` (HF's ``EtaLogitsWarper``): tokens of probability ``< min(e, sqrt(e) *
    exp(-H))`` (``H``: the entropy) are removed, the most likely kept (``e = 0``: absent).

    Compared in logs, ``log p < min(log e, log(e) / 2 - H)`` (``log e`` taken on the host): the
    same set, with no ``exp`` of ``H``. (Rare CI runs removed the tokens below ``e`` itself, as
    if ``H = 0``, or kept every token: ``jax.jit``'s cache had run the ``epsilon_cutoff``
    loop with this record's value, because ``register_dataclass`` gave the two records one
    tree definition; :func:`record` now registers each class as its own.)"""

    log_epsilon: Any
    keywords = ("eta_cutoff",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        e = _fraction(o, "eta_cutoff", "[)", off=0.0, error=BAD_CUTOFF, name="eta_cutoff", example=2e-3)
        return None if e is None else cls(np.log(e))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        _, logp, entropy = _distribution(scores)
        cutoff = jnp.minimum(self.log_epsilon, 0.5 * self.log_epsilon - entropy)
        return _below(logp, cutoff, scores)  # a removed token (log p = 0) stays removed


@record()
@dataclass(frozen=True)
class Renormalize(Control):
    """``renormalize_logits=True`` (HF's ``LogitNormalization``, always last): the scores become
    ``log_softmax`` over the tokens still kept (a removed token stays removed). Greedy and
    sampled tokens and their scores are unchanged (``log_softmax`` is a shift per row); beam
    search sums these scores across beams, so a beam whose controls removed probability mass
    is raised back by ``-log(kept mass)``, and other beams may win."""

    keywords = ("renormalize_logits",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        value = o.given["renormalize_logits"]
        if value is None or value is False or (isinstance(value, np.bool_) and not value):
            return None
        if not (value is True or isinstance(value, np.bool_)):
            raise ValueError(BAD_RENORMALIZE.format(given=value))
        return cls()

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        return jnp.where(scores > LOWEST, _distribution(scores)[1], LOWEST)


# Every control, in the order its scores pass them (HF's ``_get_logits_processor``: the
# processors, then the warpers, which run only when sampling; then LogitNormalization, last).
CONTROLS: tuple[type[Control], ...] = (SequenceBias, RepetitionPenalty, NoRepeatNGram, BadWords, MinLength, MinNewTokens,
                                       ForcedBOS, ForcedEOS, ExponentialDecayLengthPenalty, SuppressTokens,
                                       BeginSuppressTokens,
                                       Temperature, TopK, TopP, MinP, TypicalP, EpsilonCutoff, EtaCutoff,
                                       Renormalize)


def keywords(warper: bool | None = None) -> tuple[str, ...]:
    """The ``generate`` keywords of the controls of :data:`CONTROLS` (only the warpers' with
    ``warper=True``, the others' with False), in its order."""
    return tuple(k for c in CONTROLS if warper is None or c.warper == warper for k in c.keywords)


def active(o: Options) -> tuple[Control, ...]:
    """The controls the options turn on, in :data:`CONTROLS`' order (checked here, once). A
    warper turned on with greedy decoding (or beams) is refused, the same for every warper:
    the loop would ignore it. At Hugging Face's default (``top_k=50``) it is dropped instead,
    as HF's greedy generate ignores it: a call written for HF runs unchanged."""
    built = []
    for cls in CONTROLS:
        control = cls.build(o)  # checks the value first: a bad one is refused as such
        if control is None:
            continue
        if cls.warper and o.greedy:
            given = [k for k in cls.keywords if o.given[k] is not None]
            changed = [k for k in given if not _is_sampling_default(k, o.given[k])]
            if not changed:
                continue
            raise ValueError(GREEDY_OPTIONS.format(name=changed[0], value=o.given[changed[0]]))
        built.append(control)
    return tuple(built)


def _is_sampling_default(name: str, value: Any) -> bool:
    """Whether ``value`` (checked by its record) is HF's default of ``name``: ``50`` for top_k."""
    default = SAMPLING_DEFAULTS.get(name)
    return default is not None and not isinstance(value, bool) and value == default


def applied(controls: Sequence[Control], states: Sequence[Any], scores: jax.Array, now: Any) -> jax.Array:
    """``scores`` through every control in turn."""
    for control, state in zip(controls, states, strict=True):
        scores = control.apply(scores, state, now)
    return scores


def updated(controls: Sequence[Control], states: Sequence[Any], token: jax.Array, now: Now) -> tuple[Any, ...]:
    return tuple(c.update(s, token, now) for c, s in zip(controls, states, strict=True))


def filtered(logits: jax.Array, temperature: Any, **options: Any) -> jax.Array:
    """Sampling's warpers on ``logits`` (float32): ``/ temperature``, then every other warper
    of :data:`CONTROLS` given by keyword (``top_k=``, ``top_p=``, ``min_p=``, ``typical_p=``,
    ...; unset: off), in its order."""
    names = keywords(warper=True)
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"filtered: {unknown} are not warpers' keywords; they are {list(names)}.")
    o = Options({**dict.fromkeys(keywords()), **options, "temperature": temperature}, 1, (), False)  # no processor
    warpers = active(o)
    return applied(warpers, [None] * len(warpers), logits.astype(jnp.float32), None)  # warpers keep no state


# ---- option checks shared with generate ---------------------------------------------------------

def is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


def _is_token(v: Any) -> bool:
    """An int id an int32 token array holds (2**31 or more overflowed deep in the loop's set-up)."""
    return is_int(v) and 0 <= v < 2**31


def token_ids(value: Any, name: str, single: bool = False) -> tuple[int, ...]:
    """``value`` (an id or a list of ids; None: none) as a tuple, or :data:`BAD_TOKEN_ID`."""
    if value is None:
        return ()
    values = [value] if single or isinstance(value, (int, np.integer)) else value
    try:
        ok = (len(values) >= 1 or not single) and all(_is_token(v) for v in values)
    except TypeError:
        ok = False
    if not ok:
        plural = "" if single else " or a list of them"
        raise ValueError(BAD_TOKEN_ID.format(name=name, plural=plural, given=value, example=2))
    return tuple(int(v) for v in values)  # (an empty list: none, over the checkpoint's default)


def token_sequences(value: Any, name: str = "stop") -> tuple[tuple[int, ...], ...]:
    """``value`` (a list of non-empty token-id lists; None: none) as tuples, or :data:`BAD_STOP`."""
    if value is None:
        return ()
    try:
        ok = not isinstance(value, (str, bytes)) and len(value) >= 1 and all(
            not isinstance(s, (str, bytes)) and len(s) >= 1 and all(_is_token(i) for i in s) for s in value
        )
    except TypeError:  # an int where a sequence belongs
        ok = False
    if not ok:
        raise ValueError(BAD_STOP.format(name=name, given=value))
    sequences: Any = value
    return tuple(tuple(int(i) for i in s) for s in sequences)
