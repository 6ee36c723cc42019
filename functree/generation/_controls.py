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
processors, then the warpers, which run only when sampling), plus its test; a new keyword of
``generate`` also goes in its signature and docstring.

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

from functree.generation._logits import (
    bad_word_ends,
    check_in_vocabulary,
    ngram_completions,
    prompt_tokens,
    real_before,
)

BAD_TOP_K = """\
generate: top_k must be an int >= 0 (k: keep the k most likely tokens, all of them when k is \
past the vocabulary; 0 or None: no top-k), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, temperature=1.0, top_k=50, key=key)"""

BAD_NGRAM = """\
generate: no_repeat_ngram_size must be an int >= 0 (n: no n-gram appears twice in a row; 0: \
none), got {given!r}.

    right:  ft.nn.generate(model, input_ids, 8, no_repeat_ngram_size=3)"""

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

LOWEST = -jnp.inf  # a token a control removes


def _removed(mask: jax.Array, scores: jax.Array) -> jax.Array:
    """``scores`` with the tokens where ``mask`` is True removed (:data:`LOWEST`)."""
    return jnp.where(mask, jnp.asarray(LOWEST, jnp.float32), scores)


class Loop(NamedTuple):
    """What a control's ``init`` and ``apply`` may read of the running loop: the prompt ``ids``
    and ``prompt_mask`` ``[batch, W]`` (bucket-padded), its real length ``prompt`` (traced),
    the bucket's ``new`` tokens, the vocabulary size, and the ``beams`` per prompt (rows =
    batch * beams)."""

    ids: jax.Array
    prompt_mask: jax.Array
    prompt: Any
    new: int
    vocab: int
    beams: int = 1


class Now(NamedTuple):
    """A step of the loop: new token ``t`` is being chosen after ``tokens [rows, W + new]``."""

    loop: Loop
    t: Any
    tokens: jax.Array

    def real(self) -> jax.Array:
        """bool ``[rows, W + new]``: the real tokens before new token ``t``."""
        made = real_before(self.loop.prompt_mask, self.loop.new, self.loop.prompt, self.t)
        return made if self.loop.beams == 1 else jnp.repeat(made, self.loop.beams, axis=0)


class Options(NamedTuple):
    """What ``build`` reads: ``generate``'s options by keyword (checkpoint defaults applied),
    ``max_new_tokens``, the EOS ids and whether the loop is greedy."""

    given: Mapping[str, Any]
    new: int
    eos: tuple[int, ...]
    greedy: bool


T = TypeVar("T")


def record(*data: str) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a pytree whose fields ``data`` are its (traced) leaves and
    the others its (static, hashable) structure: the key of the compiled loop."""
    def make(cls: type[T]) -> type[T]:
        meta = [f.name for f in dataclasses.fields(cls) if f.name not in data]  # type: ignore[arg-type]
        jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=meta)
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


@record("penalty")
@dataclass(frozen=True)
class RepetitionPenalty(Control):
    """``repetition_penalty=r``: a seen token's score ``l`` becomes ``l / r`` if ``l > 0``, else
    ``l * r``; the state is bool ``[rows, vocab]``, the tokens in the row (real prompt ones)."""

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
        return prompt_tokens(loop.ids, loop.prompt_mask, loop.vocab)

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        return jnp.where(state, jnp.where(scores < 0, scores * self.penalty, scores / self.penalty), scores)

    def update(self, state: Any, token: jax.Array, now: Now) -> Any:
        return state.at[jnp.arange(token.shape[0]), token].set(True)


@record()
@dataclass(frozen=True)
class NoRepeatNGram(Control):
    """``no_repeat_ngram_size=n``: a token completing an ``n``-gram already in the row is removed."""

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
        banned = ngram_completions(now.tokens, now.real(), now.loop.prompt + now.t, self.n, now.loop.vocab)
        return _removed(banned, scores)


@record()
@dataclass(frozen=True)
class BadWords(Control):
    """``bad_words_ids``: the last token of a sequence whose others end the row is removed (a
    one-token sequence that is an EOS id is ignored, as HF does)."""

    words: tuple[tuple[int, ...], ...]
    keywords = ("bad_words_ids",)

    @classmethod
    def build(cls, o: Options) -> Control | None:
        words = token_sequences(o.given["bad_words_ids"], "bad_words_ids")
        words = tuple(w for w in words if not (len(w) == 1 and w[0] in o.eos))
        return cls(words) if words else None

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        banned = bad_word_ends(now.tokens, now.real(), now.loop.prompt + now.t, self.words, now.loop.vocab)
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

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        is_eos = jnp.isin(jnp.arange(scores.shape[-1]), self.eos_ids)
        return _removed(is_eos & (now.t < self.n), scores)


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


@record("temperature")
@dataclass(frozen=True)
class Temperature(Control):
    """Sampling: ``scores / temperature`` (its value checked by ``generate``, which decides greedy)."""

    temperature: Any
    keywords = ("temperature",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        return None if o.greedy else cls(np.float32(o.given["temperature"]))

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
        if o.greedy or k is None or (isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k == 0):
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


@record("p")
@dataclass(frozen=True)
class TopP(Control):
    """``top_p=p`` (nucleus): only the smallest set of most likely tokens whose probability
    reaches ``p`` is kept (``p = 1``: absent)."""

    p: Any
    keywords = ("top_p",)
    warper = True

    @classmethod
    def build(cls, o: Options) -> Control | None:
        p = o.given["top_p"]
        return None if o.greedy or p is None or p >= 1.0 else cls(np.float32(p))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        ordered = -jnp.sort(-scores, axis=-1)  # descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
        kept = jnp.sum(before < self.p, axis=-1, keepdims=True)  # >= 1: the first has 0 before it
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        return _removed(scores < threshold, scores)


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
        p = o.given["min_p"]
        return None if o.greedy or p is None or p <= 0.0 else cls(np.float32(p))

    def apply(self, scores: jax.Array, state: Any, now: Any) -> jax.Array:
        probs = jax.nn.softmax(scores, axis=-1)  # p < q * p_max (the most likely token stays)
        return _removed(probs < self.p * jnp.max(probs, axis=-1, keepdims=True), scores)


# Every control, in the order its scores pass them (HF's: processors, then warpers).
CONTROLS: tuple[type[Control], ...] = (RepetitionPenalty, NoRepeatNGram, BadWords, MinNewTokens, SuppressTokens,
                                       Temperature, TopK, TopP, MinP)


def active(o: Options) -> tuple[Control, ...]:
    """The controls the options turn on, in :data:`CONTROLS`' order (checked here, once)."""
    built = (cls.build(o) for cls in CONTROLS)
    return tuple(c for c in built if c is not None)


def applied(controls: Sequence[Control], states: Sequence[Any], scores: jax.Array, now: Any) -> jax.Array:
    """``scores`` through every control in turn."""
    for control, state in zip(controls, states):
        scores = control.apply(scores, state, now)
    return scores


def updated(controls: Sequence[Control], states: Sequence[Any], token: jax.Array, now: Now) -> tuple[Any, ...]:
    return tuple(c.update(s, token, now) for c, s in zip(controls, states))


def filtered(logits: jax.Array, temperature: Any, top_k: int | None, top_p: Any, min_p: Any = None) -> jax.Array:
    """Sampling's warpers on ``logits`` (float32): ``/ temperature``, then ``top_k``, ``top_p``
    and ``min_p`` (None: that filter is off)."""
    o = Options({"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}, 1, (), False)
    warpers = [cls.build(o) for cls in CONTROLS if cls.warper]
    return applied([w for w in warpers if w is not None], [None] * 4, logits.astype(jnp.float32), None)


# ---- option checks shared with generate ---------------------------------------------------------

def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


def token_ids(value: Any, name: str, single: bool = False) -> tuple[int, ...]:
    """``value`` (an id or a list of ids; None: none) as a tuple, or :data:`BAD_TOKEN_ID`."""
    if value is None:
        return ()
    values = [value] if single or isinstance(value, (int, np.integer)) else value
    try:
        ok = (len(values) >= 1 or not single) and all(is_int(v) and v >= 0 for v in values)
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
            not isinstance(s, (str, bytes)) and len(s) >= 1 and all(is_int(i) and i >= 0 for i in s) for s in value
        )
    except TypeError:  # an int where a sequence belongs
        ok = False
    if not ok:
        raise ValueError(BAD_STOP.format(name=name, given=value))
    sequences: Any = value
    return tuple(tuple(int(i) for i in s) for s in sequences)
