"""Hugging Face's task models: a family's body with a task head, each head one record.

transformers writes each task head once (``GenericForSequenceClassification``,
``GenericForTokenClassification``) and gives every family a class of it
(``LlamaForSequenceClassification``). So does functree: a head is one class here, a
:class:`TaskModel` that wraps the family's body in its field ``body`` (a decoder family's
causal LM without its ``lm_head``, whose calls are written once in
:mod:`functree.hf._causal`; BERT's :class:`BertModel`), and :data:`HEADS` says which heads
each model type has in transformers 5.24 (HF class suffix -> the head). At import, each
pair gets its class, made from the two records and named as HF names it
(``functree.hf._heads.Qwen2ForSequenceClassification``): its HF names, layouts, renames and
initialization derived from the family's (``body.`` before the family's key paths; BERT's
body under ``bert.``, as HF's ``base_model_prefix``), registered in
:data:`functree.hf._family.TASKS`, which ``from_hf``, ``to_hf_state_dict``, ``save_hf`` and
PEFT's names read as they read :data:`~functree.hf._family.FAMILIES`. A family is still one
record, and adds no class for its heads; a head for every family is one class and one
column of :data:`HEADS`.

The heads (``h`` the body's last hidden state ``[batch, T, d]``):

* :class:`LastTokenClassifier`, a decoder's ``ForSequenceClassification``:
  ``score(h[b, last_b])``, ``score`` without bias, ``last_b`` the row's rightmost token that
  is not ``pad_token_id`` (left or right padding; a row of pads: 0); no ``pad_token_id``:
  the last token, and a batch of more than one row is refused, as HF refuses it;
* :class:`TokenClassifier` (``ForTokenClassification``): ``classifier(dropout(h))`` at every
  token (HF's module is ``score`` for the generic class, ``classifier`` for GPT-2, GPT-NeoX
  and BERT);
* :class:`PooledClassifier` (BERT's ``ForSequenceClassification``):
  ``classifier(dropout(pooler(h[:, 0])))``;
* :class:`MaskedLM` (BERT's ``ForMaskedLM``): ``LayerNorm(act(dense(h))) E^T + bias``, the
  decoder tied to the word embedding and its bias to ``cls.predictions.bias`` (a config with
  ``tie_word_embeddings=false``: a decoder of its own, as HF unties both);
* :class:`QuestionAnswering` (``ForQuestionAnswering``): ``qa_outputs(h)`` at every token,
  its two outputs the answer span's start and end logits (:class:`SpanLogits`); HF's body
  under ``transformer.`` for Llama, Qwen2, Ministral and Qwen3 (their QA classes'
  ``base_model_prefix``), the family's own name elsewhere.

Their loss is :func:`task_loss` (also ``model.loss(logits, labels)``): HF's ``labels=``
loss exactly, ``problem_type`` as HF infers it (question answering: HF's
``start_positions=``, ``end_positions=`` loss). The dropout before a classifier applies in a
port built with ``dropout=True`` in training mode (HF's ``classifier_dropout``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import Module, field
from functree._random import one_key
from functree._repr import first_index, short_array
from functree.hf import _models  # noqa: F401  (defines every family first)
from functree.hf._bert import BertModel
from functree.hf._causal import CausalLM, _run, check_ids
from functree.hf._config import HFConfig
from functree.hf._dropout import NO_DROPOUT_KEY, _dropping, drop, dropout_attention
from functree.hf._family import FAMILIES, TASKS, HFModel
from functree.losses._classification import softmax_cross_entropy
from functree.nn._check import concrete
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm
from functree.nn._salt import salted
from functree.nn._stack import Stack
from functree.nn._state import record_state

__all__ = ["TaskModel", "LastTokenClassifier", "TokenClassifier", "PooledClassifier", "PooledMultipleChoice", "MaskedLM",
           "QuestionAnswering", "SpanLogits", "HEADS", "task_loss", "tied_copies", "check_tied_copies",
           "check_body_name", "task_class", "with_head_dropout", "check_head_tensors", "PROBLEM_TYPES",
           "check_head_missing", "HEAD_NOT_IN_WEIGHTS"]

NO_PAD_TOKEN = """\
{model}: the config has no pad_token_id, so the last token of each row is its class token, \
and a batch of {batch} rows cannot say where each row ends (Hugging Face raises "Cannot \
handle batch sizes > 1 if no padding token is defined").

    wrong:  model(input_ids)                                  # [{batch}, T], pad_token_id null
    right:  model = ft.nn.from_hf({{**config, "pad_token_id": tokenizer.pad_token_id}}, weights)
       or:  [model(row[None]) for row in input_ids]           # one row at a time
"""

LABELS_DIFFER = """\
ft.nn.from_hf: the config's {a} has {n} entries but its {b} {m}; {why}, so the two describe \
different heads and which one the checkpoint holds is not known.

    wrong:  {wrong}
    right:  "id2label": {{"0": "NEGATIVE", "1": "POSITIVE"}}, "label2id": {{"NEGATIVE": 0, "POSITIVE": 1}}   # one entry per label
"""

# (transformers warns "You passed `num_labels=...` which is incompatible", then num_labels' setter renames)
NUM_LABELS_WINS = ("Hugging Face's config warns and takes num_labels, naming its labels LABEL_0 .. "
                   "LABEL_{last} (id2label's names dropped)")

BAD_ID2LABEL = """\
ft.nn.from_hf: the config's id2label keys are label ids (strings of integers in config.json, \
as Hugging Face writes them: "0", "1", ...), got {given!r}.

    right:  "id2label": {{"0": "NEGATIVE", "1": "POSITIVE"}}
"""

BAD_PROBLEM_TYPE = """\
ft.nn.from_hf: problem_type is one of {types} (or null: inferred from num_labels and the \
labels' dtype, as Hugging Face does), got {given!r}{why}.

    wrong:  "problem_type": {given_json}
    right:  "problem_type": "single_label_classification"      # num_labels > 1, integer labels
       or:  "problem_type": "regression"                       # num_labels = 1: a single-output head
"""

TIED_COPY_DIFFERS = """\
ft.nn.from_hf: the weights' {copy!r} differs from {source!r} (by up to {difference:.3g}); \
{hf_class} ties them (one tensor), so the file holds two different models' values and \
neither is the model's.

    right:  del weights[{copy!r}]    # the tied tensor {source!r} for both, as save_pretrained writes it
"""

BAD_LABELS = """\
{model}.loss: labels for {problem} are {expected}; got {given} for logits {logits}.

    wrong:  {wrong}
    right:  {right}
"""

LABEL_OUTSIDE_CLASSES = """\
{model}.loss: label {label} at labels{where} is not a class of logits {logits} (classes 0 to \
{last}) nor the ignored label ({ignore}). torch's cross_entropy raises here (IndexError: Target \
{label} is out of bounds); a gather would read another class in its place (-1 the last), and \
under jax.jit, where the labels are not seen, the loss is NaN.

    wrong:  model.loss(logits, labels)                                     # labels hold {label}
    right:  model.loss(logits, jnp.where(labels == {label}, {ignore}, labels))   # to skip those positions
       or:  labels in 0 .. {last}, the {classes} classes of the logits' last axis (num_labels, or the choices)
"""

NOT_A_TASK_MODEL = """\
ft.hf.task_loss takes a task model of ft.nn.from_hf ({covered}), got {given}. A causal LM's \
loss is the next token's cross-entropy:

    wrong:  ft.hf.task_loss(causal_lm, logits, labels)
    right:  ft.losses.softmax_cross_entropy(logits[:, :-1], labels[:, 1:])
"""

DECODER_TOKEN_TYPES = """\
{model}: token_type_ids are BERT's segment ids; functree's decoder bodies take none (HF's \
GPT-2 classes add wte(token_type_ids) to the input, which is not ported; GPT-NeoX's \
question-answering class takes them and reads none; the others have no such input).

    wrong:  model(input_ids, attention_mask, token_type_ids)
    right:  model(input_ids, attention_mask)
"""

HEAD_TENSORS = """\
ft.nn.from_hf: the weights hold a task head's tensors ({extra}) beside the body, and the \
config names no task class (architectures: {listed}), so from_hf built the family's \
{hf_class}, which has no place for them. Name the class the weights are ({tasks}); an HF \
config object made in Python names none until it is saved.

    wrong:  ft.nn.from_hf(hf_model.config, hf_model.state_dict())
    right:  ft.nn.from_hf(hf_model)                                                # the model, its class
       or:  ft.nn.from_hf({{**hf_model.config.to_dict(), "architectures": [{task!r}]}}, weights)
"""

QA_LABELS = """\
ft.nn.from_hf: {hf_class}'s qa_outputs has num_labels outputs, and its forward splits them \
into the start and end logits, so it takes num_labels 2; the config gives {given} (Hugging \
Face's forward fails on it: "too many values to unpack" or "not enough values").

    wrong:  "num_labels": {given}
    right:  "num_labels": 2      # or no num_labels / id2label: 2 is the default
"""

BAD_SPANS = """\
{model}.loss: {what} {expected}; got {given}.

    wrong:  {wrong}
    right:  {right}
"""

BODY_NAMED_OTHERWISE = """\
ft.nn.from_hf: Hugging Face's {hf_class} keeps its body as {alias}.* (the class's \
base_model_prefix), but the weights name it {own}.* (a {family}'s checkpoint, or another task \
class's). transformers' {hf_class}.from_pretrained reads none of them into it: the body \
stays randomly initialized (a warning says so); functree does not build that model. To start \
from the checkpoint's body with a fresh head (HF's initialization):

    wrong:  ft.nn.from_hf(config, weights)                       # {own}.layers.0... beside no {alias}.*
    right:  model = ft.hf.with_head(ft.nn.from_hf({{**config, "architectures": [{family!r}]}}, weights),
                                    {suffix!r}, key=jax.random.key(0))   # the checkpoint's body, a fresh head
"""

HEAD_NOT_IN_WEIGHTS = """\
ft.nn.from_hf: the weights hold the body of the {hf_class} its config builds but not its \
head: missing {missing}. They are a pretrained model's (a {family}'s checkpoint{extra}); \
transformers' {hf_class}.from_pretrained draws a missing head at random (a warning says so). \
functree draws a new head where the code says so, with HF's initialization:

    wrong:  ft.nn.from_hf(config, weights)                       # a {suffix} whose head is not in them
    right:  model = ft.hf.with_head(ft.nn.from_hf({{**config, "architectures": [{family!r}]}}, weights),
                                    {suffix!r}, num_labels={labels}, key=jax.random.key(0))   # the body, a fresh head
"""

CHOICES_SHAPE = """\
{model}: {name} is {expected} (a row's choices, each a sequence of its own, as HF's \
multiple-choice classes take them), got {given}.

    wrong:  model(ids)                                     # ids [batch, T]: one sequence per row
    right:  model(jnp.stack([first, second, third], axis=1))   # [batch, num_choices, T], masks alike
"""

PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
_HEAD_STREAM = 2  # folded into the first member's dropout key: the head's mask without a call key (1: the embedding's)
IGNORE_INDEX = -100  # torch's CrossEntropyLoss default: HF's collators' label for tokens not scored


class TaskModel(HFModel):
    """A family's body with a task head (module docstring); its classes are made per family
    (:func:`task_class`), their class variables read from the family's."""

    body_class: ClassVar[type[HFModel]]  # the family whose body this wraps
    suffix: ClassVar[str] = ""  # HF's class name suffix: "ForSequenceClassification"
    body_prefix: ClassVar[str] = ""  # HF's names of the body: "" (a causal LM's own) or "bert."
    head_roots: ClassVar[tuple[str, ...]] = ()  # HF's top-level modules of the head ("score", "cls")
    head_rename: ClassVar[dict[str, str]] = {}  # HF's head names -> this class's key paths, where they differ
    pooled: ClassVar[bool] = False  # BERT's body keeps its pooler
    # HF's attribute of the body and the family's, where they differ (Llama's QA class keeps its
    # LlamaModel as "transformer", the causal LM as "model"): ("transformer", "model"); else None
    body_alias: ClassVar[tuple[str, str] | None] = None

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        k1, k2 = jax.random.split(one_key(key))
        body = cls.body_class.from_config(config, {"pooler.dense.weight"} if cls.pooled else set(), dtype, k1,
                                          attention)
        if isinstance(body, CausalLM):
            body = body.replace(lm_head=None)  # the head is this class's
        width = int(_tokens(body).embeddings.shape[1])  # OPT: word_embed_proj_dim, the blocks' output after project_out
        return cls.build(body, width, config, dtype, k2)

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        raise NotImplementedError

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        return model.replace(body=cls.body_class.hf_values(model.body, config))

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        return cls.body_class.hf_dropout(config)

    @classmethod
    def hf_initial(cls, model: Any, config: Any) -> Any:
        return model.replace(body=cls.body_class.hf_initial(model.body, config))

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        """The rate of the dropout before the classifier (0: none), as HF's class reads it."""
        return 0.0

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """The body's older names as its family reads them (BERT's under ``bert.``); the head's
        tensors as given (:class:`MaskedLM`: its tied copies checked and dropped)."""
        own = {k: v for k, v in weights.items() if k.split(".")[0] in cls.head_roots}
        rest = {k: v for k, v in weights.items() if k not in own}
        prefix = cls.body_prefix
        if prefix:
            rest = {k.removeprefix(prefix): v for k, v in rest.items()}
        alias = cls.body_alias
        # HF's body name read as the family's and written back (a file holding the family's own
        # name too is another model's: left as it is, its tensors refused as not this class's)
        if alias is not None and not any(k.startswith(alias[1] + ".") for k in rest):
            body = {_swapped(k, alias[1], alias[0]): v
                    for k, v in cls.body_class.hf_names({_swapped(k, *alias): v for k, v in rest.items()}).items()}
        else:
            body = cls.body_class.hf_names(rest)
        return {**{prefix + k: v for k, v in body.items()}, **own}

    @classmethod
    def _arrays(cls, logits: Any, labels: Any) -> tuple[Any, Any]:
        """:func:`task_loss`'s arguments as arrays (:class:`QuestionAnswering`: pairs of them)."""
        return jnp.asarray(logits), jnp.asarray(labels)

    def _body(self) -> Any:
        """The body carrying this model's config (its padding row and pad id read it)."""
        return self.body.replace(hf_config=self.hf_config)  # type: ignore[attr-defined]

    def _hidden(self, input_ids: Any, attention_mask: Any, token_type_ids: Any, key: jax.Array | None) -> jax.Array:
        """The body's last hidden state ``[batch, T, d]``."""
        body = self._body()
        if isinstance(body, BertModel):
            return body(input_ids, attention_mask, token_type_ids, key=key)
        if token_type_ids is not None:
            raise TypeError(DECODER_TOKEN_TYPES.format(model=type(self).__name__))
        body._check_call(input_ids, None)
        ids = check_ids(self, input_ids)
        # HF's forward without position_ids: 0..T-1 in every row, left padding too (GPT-2's
        # learned table reads them); OPT's counts each row's real tokens, as its causal LM's call
        positions = None if self.body_class.model_type in _COUNTED_POSITIONS else \
            jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        tokens = body._tokens()
        return _run(body, ids, attention_mask, positions, None, vocab=tokens.embeddings.shape[0],
                    blocks=body._blocks(), embed=body._embed, head=body._final_norm, rotary=body.rotates,
                    limit=body._limit(), key=key)

    def _keys(self, key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
        """(the body's key, the head dropout's key): the head's only where it drops (a rate
        above 0, a port built with ``dropout=True``, training mode), whether or not the
        body drops anything (HF's ``train()`` drops before the classifier whatever the
        body's rates: a Llama's default ``attention_dropout`` is 0)."""
        rate = float(getattr(self, "dropout", 0.0))
        attention = dropout_attention(_blocks(self.body).layers)  # type: ignore[attr-defined]
        if rate == 0.0 or attention is None or not attention.training:
            return key, None
        if key is not None:
            body, head = jax.random.split(one_key(key))
            return body, head
        if attention.dropout_key is None:
            if _dropping(attention):
                return None, None  # (the body's call names the missing key: NO_DROPOUT_KEY)
            raise ValueError(NO_DROPOUT_KEY.format(cls=type(attention).__name__))
        first = jax.random.wrap_key_data(attention.dropout_key[0])
        if _dropping(attention):  # the body's members draw from their own keys, advancing the first
            return None, salted(jax.random.fold_in(first, _HEAD_STREAM))
        # The body draws nothing, so nothing advances the first member's key: the head draws
        # from it and records its next value (layer state), fresh masks every step as above.
        drawn, following = jax.random.split(first)
        record_state(attention, dropout_key=attention.dropout_key.at[0].set(jax.random.key_data(following)))
        return None, salted(jax.random.fold_in(drawn, _HEAD_STREAM))

    def _pool(self, h: jax.Array) -> jax.Array:
        """The first token's hidden state through BERT's pooler (:class:`PooledClassifier`,
        :class:`PooledMultipleChoice`; DistilBERT's heads: their ``pre_classifier``)."""
        return self.body.pooler(h[:, 0])  # type: ignore[attr-defined]  # (the heads' field)

    def hf_tied(self) -> tuple[tuple[str, str], ...]:
        """The ``(copy, tensor)`` ties of ``hf_ties`` this model has (:func:`tied_copies`)."""
        return type(self).hf_ties

    def hf_output_head(self) -> str | None:
        """HF's output embedding where it is a Dense of this model (PEFT's ``"all-linear"`` leaves it out)."""
        return None

    def loss(self, logits: Any, labels: Any) -> jax.Array:
        """Hugging Face's ``outputs.loss`` for ``labels`` (:func:`task_loss`)."""
        return task_loss(self, logits, labels)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        raise NotImplementedError


def _swapped(name: str, old: str, new: str) -> str:
    """``name`` with its first part ``old`` as ``new`` (``transformer.norm.weight`` ->
    ``model.norm.weight``); another name as it is."""
    return new + name[len(old):] if name == old or name.startswith(old + ".") else name


def tied_copies(family: Any, model: Any) -> tuple[tuple[str, str], ...]:
    """The ``(copy, tensor)`` names HF's ``state_dict()`` holds twice for ``model`` (a
    family's ``hf_ties``, as the model has them: BERT's masked LM ties its decoder unless
    its config unties it)."""
    tied: Callable[[], tuple[tuple[str, str], ...]] | None = getattr(model, "hf_tied", None)
    return tied() if callable(tied) else tuple(family.hf_ties)


def check_tied_copies(family: Any, model: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without the copies of :func:`tied_copies` (``state_dict()`` holds them, a
    ``save_pretrained`` file does not): each checked equal to its tensor
    (:data:`TIED_COPY_DIFFERS`), or taken as it where the tensor is absent."""
    for copy, source in tied_copies(family, model):
        if copy not in weights:
            continue
        value = weights.pop(copy)
        if source not in weights:
            weights[source] = value
            continue
        a, b = _numpy(value), _numpy(weights[source])
        if a.shape != b.shape or not np.array_equal(a, b):
            difference = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) \
                if a.shape == b.shape else float("inf")
            raise ValueError(TIED_COPY_DIFFERS.format(copy=copy, source=source, difference=difference,
                                                      hf_class=family.hf_class))
    return weights


def _tokens(body: Any) -> Any:
    return body.embeddings.word_embeddings if isinstance(body, BertModel) else body._tokens()


def _blocks(body: Any) -> Stack:
    return body.encoder.layer if isinstance(body, BertModel) else body._blocks()


def _classifier_rate(config: Any, *names: str, default: float) -> float:
    """The first of ``names`` the config sets (not null), else ``default`` (HF's order)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    return default


class LastTokenClassifier(TaskModel):
    """A decoder's ``ForSequenceClassification``: ``score(h[b, last_b])`` (module docstring).

    ``model(input_ids, attention_mask=None, *, key=None)`` is ``[batch, num_labels]``.
    """

    body: Any
    score: Dense
    hf_config: HFConfig | None = field(static=True, default=None)
    suffix = "ForSequenceClassification"
    head_roots = ("score",)

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        return cls(body, Dense(width, num_labels(config), use_bias=False, key=key, dtype=dtype))

    def __init__(self, body: Any, score: Dense, hf_config: HFConfig | None = None):
        self.body, self.score, self.hf_config = body, score, hf_config

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, key: jax.Array | None = None) -> jax.Array:
        ids = check_ids(self, input_ids)
        h = self._hidden(ids, attention_mask, None, key)
        last = last_tokens(self, ids)
        return self.score(h[jnp.arange(ids.shape[0]), last])

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _sequence_loss(self, logits, labels)


def last_tokens(model: Any, ids: jax.Array) -> jax.Array:
    """Each row's class token as HF finds it: the rightmost token that is not ``pad_token_id``
    (``argmax(arange(T) * (ids != pad))``: 0 for a row of pads); without a pad id the last
    token, a batch of one row only (:data:`NO_PAD_TOKEN`)."""
    config = model.hf_config
    pad = None if config is None else config.get("pad_token_id")
    if pad is None:
        if ids.shape[0] != 1:
            raise ValueError(NO_PAD_TOKEN.format(model=type(model).__name__, batch=ids.shape[0]))
        return jnp.full((1,), ids.shape[1] - 1, jnp.int32)
    real = (ids != pad).astype(jnp.int32)
    return jnp.argmax(jax.lax.broadcast_to_rank(jnp.arange(ids.shape[1], dtype=jnp.int32), real.ndim) * real, axis=-1)


class TokenClassifier(TaskModel):
    """``ForTokenClassification``: ``classifier(dropout(h))`` at every token, ``[batch, T,
    num_labels]`` (HF's module ``score`` or ``classifier``: module docstring)."""

    body: Any
    classifier: Dense
    hf_config: HFConfig | None = field(static=True, default=None)
    dropout: float = field(static=True, default=0.0)
    suffix = "ForTokenClassification"
    head_roots = ("score",)
    head_rename: ClassVar[dict[str, str]] = {"score": "classifier"}

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        bias = "classifier" in cls.head_roots or bool(getattr(config, "token_classification_bias", True))
        return cls(body, Dense(width, num_labels(config), use_bias=bias, key=key, dtype=dtype))

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        """BERT: ``classifier_dropout`` or ``hidden_dropout_prob``; DistilBERT: ``dropout``; GPT-NeoX: its
        ``classifier_dropout``; the others ``classifier_dropout``, ``hidden_dropout`` or 0.1."""
        if cls.body_class.model_type == "distilbert":  # DistilBertForTokenClassification: config.dropout
            return _classifier_rate(config, "dropout", default=0.1)
        if issubclass(cls.body_class, BertModel):
            return _classifier_rate(config, "classifier_dropout", "hidden_dropout_prob", default=0.1)
        if cls.body_class.model_type == "gpt_neox":
            return _classifier_rate(config, "classifier_dropout", default=0.1)
        return _classifier_rate(config, "classifier_dropout", "hidden_dropout", default=0.1)

    def __init__(self, body: Any, classifier: Dense, hf_config: HFConfig | None = None, dropout: float = 0.0):
        self.body, self.classifier, self.hf_config, self.dropout = body, classifier, hf_config, dropout

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        body_key, head_key = self._keys(key)
        h = self._hidden(input_ids, attention_mask, token_type_ids, body_key)
        return self.classifier(drop(h, self.dropout, head_key) if head_key is not None else h)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _token_loss(self, logits, labels)


class PooledClassifier(TaskModel):
    """BERT's ``ForSequenceClassification``: ``classifier(dropout(pooler(h[:, 0])))``,
    ``[batch, num_labels]``; the pooler is the body's (``body.pooler``)."""

    body: Any
    classifier: Dense
    hf_config: HFConfig | None = field(static=True, default=None)
    dropout: float = field(static=True, default=0.0)
    suffix = "ForSequenceClassification"
    head_roots = ("classifier",)
    pooled = True

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        return cls(body, Dense(width, num_labels(config), key=key, dtype=dtype))

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        return _classifier_rate(config, "classifier_dropout", "hidden_dropout_prob", default=0.1)

    def __init__(self, body: Any, classifier: Dense, hf_config: HFConfig | None = None, dropout: float = 0.0):
        self.body, self.classifier, self.hf_config, self.dropout = body, classifier, hf_config, dropout

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        body_key, head_key = self._keys(key)
        h = self._hidden(input_ids, attention_mask, token_type_ids, body_key)
        pooled = self._pool(h)
        return self.classifier(drop(pooled, self.dropout, head_key) if head_key is not None else pooled)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _sequence_loss(self, logits, labels)


class PooledMultipleChoice(TaskModel):
    """BERT's and RoBERTa's ``ForMultipleChoice``: each of a row's choices a sequence of its
    own, scored ``classifier(dropout(pooler(h[:, 0])))`` (``classifier``: ``Dense(d, 1)``),
    ``[batch, num_choices]``. ``input_ids``, ``attention_mask`` and ``token_type_ids`` are
    ``[batch, num_choices, T]`` (:data:`CHOICES_SHAPE` otherwise), run as ``batch *
    num_choices`` sequences through the body (HF's ``view(-1, T)``). The dropout's rate is
    BERT's ``classifier_dropout`` (else ``hidden_dropout_prob``), RoBERTa's
    ``hidden_dropout_prob``. ``model.loss(logits, labels)`` is HF's: the softmax cross-entropy
    over the choices, ``labels`` the right choice per row, int ``[batch]`` (-100: ignored).

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "bert", "architectures": ["BertForMultipleChoice"], "vocab_size": 11,
      ...           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...           "max_position_embeddings": 8}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> ids = np.array([[[2, 5, 6, 3], [2, 5, 7, 3], [2, 5, 8, 3]]], np.int32)  # 1 row, 3 choices, T 4
      >>> logits = model(ids)
      >>> logits.shape, float(model.loss(logits, np.array([2]))) > 0
      ((1, 3), True)
    """

    body: Any
    classifier: Dense
    hf_config: HFConfig | None = field(static=True, default=None)
    dropout: float = field(static=True, default=0.0)
    suffix = "ForMultipleChoice"
    head_roots = ("classifier",)
    pooled = True

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        return cls(body, Dense(width, 1, key=key, dtype=dtype))

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        if cls.body_class.model_type in ("roberta", "xlm-roberta"):  # HF's RobertaForMultipleChoice reads no classifier_dropout
            return _classifier_rate(config, "hidden_dropout_prob", default=0.1)
        return _classifier_rate(config, "classifier_dropout", "hidden_dropout_prob", default=0.1)

    def __init__(self, body: Any, classifier: Dense, hf_config: HFConfig | None = None, dropout: float = 0.0):
        self.body, self.classifier, self.hf_config, self.dropout = body, classifier, hf_config, dropout

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        ids = _choices(self, input_ids, "input_ids", None)
        batch, choices, length = ids.shape
        mask = _choices(self, attention_mask, "attention_mask", ids.shape)
        types = _choices(self, token_type_ids, "token_type_ids", ids.shape)
        def flat(x: Any) -> Any:
            return None if x is None else x.reshape(batch * choices, length)

        body_key, head_key = self._keys(key)
        h = self._hidden(flat(ids), flat(mask), flat(types), body_key)
        pooled = self._pool(h)
        scores = self.classifier(drop(pooled, self.dropout, head_key) if head_key is not None else pooled)
        return scores.reshape(batch, choices)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        if logits.ndim != 2 or labels.shape != logits.shape[:1] or not jnp.issubdtype(labels.dtype, jnp.integer):
            raise _bad(self, "multiple choice", f"the right choice's index per row, int [{logits.shape[0]}] (-100: ignored), "
                       f"for logits [batch, num_choices]", labels, logits,
                       "model.loss(logits, jax.nn.one_hot(answers, num_choices))", "model.loss(logits, answers)   # int [batch]")
        return _cross_entropy(self, logits, labels)


def _choices(model: Any, given: Any, name: str, shape: tuple[int, ...] | None) -> Any:
    """``given`` as an array ``[batch, num_choices, T]`` (``shape``: input_ids', which the
    others must have); None stays None (:data:`CHOICES_SHAPE`)."""
    if given is None:
        return None
    x = jnp.asarray(given) if not hasattr(given, "shape") else given
    if x.ndim != 3 or (shape is not None and tuple(x.shape) != tuple(shape)):
        expected = "[batch, num_choices, T]" if shape is None else f"input_ids' shape {list(shape)}"
        raise ValueError(CHOICES_SHAPE.format(model=type(model).__name__, name=name, expected=expected,
                                              given=short_array(x)))
    return x


class BertPredictionHeadTransform(Module):
    """``LayerNorm(act(dense(h)))`` (HF's names)."""

    dense: Dense
    LayerNorm: LayerNorm

    def __init__(self, dense: Dense, norm: LayerNorm):
        self.dense, self.LayerNorm = dense, norm


class BertLMPredictionHead(Module):
    """The transform and the output bias; the decoder is the word embedding (tied), or with
    ``tie_word_embeddings=false`` a ``Dense(d, vocab)`` of its own (``decoder``), whose bias
    is the logits' (HF's untied model keeps ``bias`` too, unread by its forward)."""

    transform: BertPredictionHeadTransform
    bias: jax.Array
    decoder: Dense | None = None

    def __init__(self, transform: BertPredictionHeadTransform, bias: jax.Array, decoder: Dense | None = None):
        self.transform, self.bias, self.decoder = transform, bias, decoder


class BertOnlyMLMHead(Module):
    """HF's ``cls``: the prediction head."""

    predictions: BertLMPredictionHead

    def __init__(self, predictions: BertLMPredictionHead):
        self.predictions = predictions


class MaskedLM(TaskModel):
    """BERT's ``ForMaskedLM``: ``transform(h) E^T + bias`` at every token, ``[batch, T,
    vocab]``; ``E`` the body's word embedding (HF ties ``cls.predictions.decoder`` to it).
    A config with ``tie_word_embeddings=false`` unties both of HF's ties: the logits are
    ``decoder(transform(h))``, the decoder's weight and bias its own
    (``cls.predictions.decoder``), and ``cls.predictions.bias`` is kept as HF keeps it, unread."""

    body: Any
    cls: BertOnlyMLMHead
    hf_config: HFConfig | None = field(static=True, default=None)
    suffix = "ForMaskedLM"
    head_roots = ("cls",)
    hf_ties = (("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
               ("cls.predictions.decoder.bias", "cls.predictions.bias"))

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        from functree.hf._options import activation

        vocab = int(_tokens(body).embeddings.shape[0])
        k1, k2 = jax.random.split(one_key(key))
        transform = BertPredictionHeadTransform(Dense(width, width, activation(config, "hidden_act"), key=k1,
                                                      dtype=dtype),
                                                LayerNorm(width, epsilon=config.layer_norm_eps, dtype=dtype))
        # (transformers 5.24 unties the decoder's weight and its bias alike: both read the flag)
        decoder = None if getattr(config, "tie_word_embeddings", True) else Dense(width, vocab, key=k2, dtype=dtype)
        return cls(body, BertOnlyMLMHead(BertLMPredictionHead(transform, jnp.zeros((vocab,), dtype), decoder)))

    def __init__(self, body: Any, cls: BertOnlyMLMHead, hf_config: HFConfig | None = None):
        self.body, self.cls, self.hf_config = body, cls, hf_config

    def hf_tied(self) -> tuple[tuple[str, str], ...]:
        """The ties of ``hf_ties`` this model has: both, or none where its decoder is its own."""
        return () if self.cls.predictions.decoder is not None else type(self).hf_ties

    def hf_output_head(self) -> str | None:
        """HF's ``get_output_embeddings()`` where it is a layer of this model's (an untied
        decoder), which PEFT's ``"all-linear"`` leaves out; a tied one is the embedding."""
        return "cls.predictions.decoder" if self.cls.predictions.decoder is not None else None

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        h = self._hidden(input_ids, attention_mask, token_type_ids, key)
        head = self.cls.predictions
        x = head.transform.LayerNorm(head.transform.dense(h))
        if head.decoder is not None:
            return head.decoder(x)
        table = self.body.embeddings.word_embeddings.embeddings
        return x @ table.T.astype(x.dtype) + jax.lax.broadcast_to_rank(head.bias.astype(x.dtype), x.ndim)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _token_loss(self, logits, labels)


class SpanLogits(NamedTuple):
    """A question-answering model's output, as HF's ``QuestionAnsweringModelOutput`` names
    it: the logits of the answer's first and last token, ``[batch, T]`` each."""

    start_logits: jax.Array
    end_logits: jax.Array


class QuestionAnswering(TaskModel):
    """``ForQuestionAnswering``: ``qa_outputs(h)`` ``[batch, T, 2]`` at every token, split
    into the answer span's start and end logits (:class:`SpanLogits`, ``[batch, T]`` each),
    as HF's ``logits.split(1, dim=-1)``. ``qa_outputs`` is a biased ``Dense(d, 2)`` (OPT:
    ``d = word_embed_proj_dim``, after ``project_out``; BERT: ``num_labels`` outputs, which
    must be 2: :data:`QA_LABELS`); no dropout before it (HF's classes have none).

    ``model.loss(logits, (start_positions, end_positions))`` is HF's loss: each position
    ``[batch]`` (or ``[batch, 1]``) clamped to ``[0, T]``, ``T`` ignored (a span outside the
    input), the softmax cross-entropy of the start and of the end logits each the mean over
    the rows kept, and ``loss = (start_loss + end_loss) / 2`` (:func:`task_loss`).
    """

    body: Any
    qa_outputs: Dense
    hf_config: HFConfig | None = field(static=True, default=None)
    suffix = "ForQuestionAnswering"
    head_roots = ("qa_outputs",)

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        outputs = 2
        if issubclass(cls.body_class, BertModel):  # Linear(hidden, num_labels); the generic classes': 2
            outputs = num_labels(config)
            if outputs != 2:
                raise ValueError(QA_LABELS.format(hf_class=cls.hf_class, given=outputs))
        return cls(body, Dense(width, outputs, key=key, dtype=dtype))

    def __init__(self, body: Any, qa_outputs: Dense, hf_config: HFConfig | None = None):
        self.body, self.qa_outputs, self.hf_config = body, qa_outputs, hf_config

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> SpanLogits:
        h = self._hidden(input_ids, attention_mask, token_type_ids, key)
        logits = self.qa_outputs(h)
        return SpanLogits(logits[..., 0], logits[..., 1])

    @classmethod
    def _arrays(cls, logits: Any, labels: Any) -> tuple[Any, Any]:
        return _pair(cls, logits, "logits", "model.loss(logits.start_logits, positions)",
                     "model.loss(model(input_ids, attention_mask), positions)   # SpanLogits: (start, end)"), \
            _pair(cls, labels, "labels", "model.loss(logits, start_positions)",
                  "model.loss(logits, (start_positions, end_positions))   # int [batch] each")

    def _loss(self, logits: Any, labels: Any) -> jax.Array:
        return _span_loss(self, logits, labels)


def _pair(cls: type[TaskModel], given: Any, what: str, wrong: str, right: str) -> tuple[jax.Array, jax.Array]:
    """``given`` as two arrays, the start's and the end's (:data:`BAD_SPANS` otherwise)."""
    if not isinstance(given, (tuple, list)) or len(given) != 2:
        shown = short_array(given) if hasattr(given, "shape") else type(given).__name__
        raise ValueError(BAD_SPANS.format(model=cls.__name__, what=what, expected="are a pair: the start's and the end's",
                                          given=shown, wrong=wrong, right=right))
    return jnp.asarray(given[0]), jnp.asarray(given[1])


def _span_loss(model: Any, logits: tuple[jax.Array, jax.Array], positions: tuple[jax.Array, jax.Array]) -> jax.Array:
    """HF's question-answering loss (transformers' ``ForQuestionAnsweringLoss``, and BERT's,
    GPT-2's, OPT's own): each of ``positions`` squeezed on its last axis where it has more
    than one, clamped to ``[0, T]`` (a negative position counts as 0, as HF's clamp makes
    it), ``T`` ignored; the mean of the start's and the end's cross-entropy."""
    losses = []
    for x, p, which in zip(logits, positions, ("start", "end")):
        if p.ndim > 1:
            p = jnp.squeeze(p, -1) if p.shape[-1] == 1 else p  # HF's squeeze(-1): a no-op on a longer axis
        if x.ndim != 2 or p.shape != x.shape[:1] or not jnp.issubdtype(p.dtype, jnp.integer):
            raise ValueError(BAD_SPANS.format(
                model=type(model).__name__, what=f"{which} positions",
                expected=f"are integer token indices [batch] (or [batch, 1]) for {which} logits [batch, T]",
                given=f"{short_array(p)} for {short_array(x)}",
                wrong="model.loss(logits, (jax.nn.one_hot(starts, T), jax.nn.one_hot(ends, T)))",
                right="model.loss(logits, (starts, ends))   # int [batch] each; T or more: ignored"))
        length = x.shape[1]
        p = p.astype(jnp.int32) if p.dtype.itemsize < 4 else p  # (an int8 position clamped to T > 127)
        losses.append(_cross_entropy(model, x, jnp.clip(p, 0, length), ignore=length))
    return (losses[0] + losses[1]) / 2


def _numpy(x: Any) -> np.ndarray:
    from functree._state_dict import to_numpy

    converted = to_numpy(x)
    return np.asarray(x) if converted is None else converted


# ---- labels: the config's num_labels, id2label and problem_type, read as HF's config reads them


def num_labels(config: Any) -> int:
    """HF's ``config.num_labels``: ``len(id2label)`` where the config has one (config.json's
    keys are strings: ``int(key)``), else ``num_labels`` (2 where absent); a ``num_labels`` or
    a ``label2id`` of another length is refused (:data:`LABELS_DIFFER`; HF warns, then takes
    num_labels and renames the labels, or keeps id2label beside the other label2id), and so is a ``problem_type`` HF refuses (:data:`BAD_PROBLEM_TYPE`)."""
    id2label = getattr(config, "id2label", None)
    given = _given_num_labels(config)
    if id2label is None:
        count = 2 if given is None else given
    else:
        if not isinstance(id2label, dict) or not all(_label_id(k) for k in id2label):
            raise ValueError(BAD_ID2LABEL.format(given=id2label))
        count = len(id2label)
        if given is not None and given != count:
            raise ValueError(LABELS_DIFFER.format(a="id2label", n=count, b="num_labels", m=f"is {given}",
                                                  why=NUM_LABELS_WINS.format(given=given, last=given - 1),
                                                  wrong=f'"num_labels": {given}, "id2label": {{{count} entries}}'))
    label2id = getattr(config, "label2id", None)
    if isinstance(label2id, dict) and id2label is not None and len(label2id) != count:
        raise ValueError(LABELS_DIFFER.format(a="id2label", n=count, b="label2id", m=f"has {len(label2id)}",
                                              why="Hugging Face's config keeps id2label's labels and its label2id as given",
                                              wrong=f'"id2label": {{{count} entries}}, "label2id": '
                                                    f'{{{len(label2id)} entries}}'))
    problem = getattr(config, "problem_type", None)
    if problem is not None and problem not in PROBLEM_TYPES:
        raise ValueError(BAD_PROBLEM_TYPE.format(types=", ".join(PROBLEM_TYPES), given=problem, why="",
                                                 given_json=_json(problem)))
    if problem == "single_label_classification" and count == 1:
        raise ValueError(BAD_PROBLEM_TYPE.format(types=", ".join(PROBLEM_TYPES), given=problem, given_json=_json(problem),
                                                 why=" with num_labels 1 (HF refuses it: a softmax over one label)"))
    return count


def _given_num_labels(config: Any) -> int | None:
    """``num_labels`` as the config was given it: a config.json's key (HF's object derives it
    from id2label: None there)."""
    if hasattr(config, "to_dict") and not hasattr(config, "to_json_string"):  # functree's Config of a dict
        value = config.to_dict().get("num_labels")
        return None if value is None else int(value)
    return None


def _label_id(key: Any) -> bool:
    if isinstance(key, bool):
        return False
    if isinstance(key, int):
        return True
    try:
        int(key)
    except (TypeError, ValueError):
        return False
    return True


def _json(value: Any) -> str:
    import json

    return json.dumps(value, default=str)


# ---- the losses: HF's labels= loss


def task_loss(model: Any, logits: Any, labels: Any) -> jax.Array:
    """Hugging Face's ``outputs.loss`` of a task model's ``logits`` for ``labels``.

    Sequence classification (``problem_type`` the config's, else inferred as HF infers it:
    ``num_labels == 1`` regression; integer labels single-label; else multi-label):

    * ``"regression"``: mean squared error (one label: both squeezed, as HF);
    * ``"single_label_classification"``: softmax cross-entropy over ``[batch, num_labels]``,
      the mean over labels not ``-100``;
    * ``"multi_label_classification"``: sigmoid binary cross-entropy (float labels
      ``[batch, num_labels]``), the mean.

    Token classification and masked LM: softmax cross-entropy at every token in float32,
    the mean over labels not ``-100`` (torch's ``ignore_index``: padding, the unmasked
    tokens). ``model.loss(logits, labels)`` is the same. (HF records the inferred problem
    type on its config at the first call; this infers it at each call.) A class label
    outside ``0 .. classes - 1`` and not ``-100`` raises :data:`LABEL_OUTSIDE_CLASSES` (as
    torch's IndexError); under ``jax.jit`` it makes the loss NaN, never another class's.

    Question answering: ``logits`` the model's :class:`SpanLogits` (start, end), ``labels``
    the pair ``(start_positions, end_positions)``, int ``[batch]`` each; each position
    clamped to ``[0, T]`` and ``T`` ignored (HF's clamp: a position past the input is
    ignored, a negative one counts as token 0), ``loss = (CE(start) + CE(end)) / 2``, each
    the mean over its kept rows (NaN where none is, as torch).

    Cross-entropies are taken in float32 or wider: HF's sequence-classification and
    question-answering losses take them in the logits' dtype (the same in float32 and
    float64; a bfloat16 model's loss rounds otherwise). HF's ``num_items_in_batch`` (the
    Trainer's count of ``labels`` not ``-100``, for gradient accumulation) is not taken:
    HF's classification forwards pass it to no loss, and its Trainer counts none for a
    question-answering batch (which holds no ``labels``); for a token-weighted mean over
    microbatches see ``ft.losses.WeightedMean``.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], "vocab_size": 11,
      ...           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...           "pad_token_id": 0, "num_labels": 3}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> ids = np.array([[5, 6, 7, 0], [3, 4, 0, 0]], np.int32)       # right padding with pad id 0
      >>> logits = model(ids, ids != 0)
      >>> logits.shape, float(ft.hf.task_loss(model, logits, np.array([2, 0]))) > 0
      ((2, 3), True)
    """
    if not isinstance(model, TaskModel):
        raise TypeError(NOT_A_TASK_MODEL.format(covered=", ".join(TASKS), given=type(model).__name__))
    return model._loss(*model._arrays(logits, labels))


def _bad(model: Any, problem: str, expected: str, labels: jax.Array, logits: jax.Array, wrong: str,
         right: str) -> ValueError:
    return ValueError(BAD_LABELS.format(model=type(model).__name__, problem=problem, expected=expected,
                                        given=short_array(labels), logits=short_array(logits), wrong=wrong,
                                        right=right))


def problem_type(model: Any, logits: jax.Array, labels: jax.Array) -> str:
    """The config's ``problem_type``, else HF's inference from ``num_labels`` and the labels' dtype."""
    config = model.hf_config
    given = None if config is None else config.get("problem_type")
    if given is not None:
        return str(given)
    count = logits.shape[-1]
    if count == 1:
        return "regression"
    return "single_label_classification" if jnp.issubdtype(labels.dtype, jnp.integer) else "multi_label_classification"


def _sequence_loss(model: Any, logits: jax.Array, labels: jax.Array) -> jax.Array:
    problem = problem_type(model, logits, labels)
    count = logits.shape[-1]
    if problem == "regression":
        if not jnp.issubdtype(labels.dtype, jnp.floating):
            raise _bad(model, problem, "floating targets (HF's MSELoss regresses integer ones as floats; refused here: "
                       "integers are more likely class ids given to a one-output head)", labels, logits,
                       "model.loss(logits, jnp.array([1, 0]))", "model.loss(logits, jnp.array([1.0, 0.0]))")
        wide = _wide(logits.dtype)
        x, y = logits.astype(wide), labels.astype(wide)
        if count == 1:
            x, y = jnp.squeeze(x), jnp.squeeze(y)
        if x.shape != y.shape:
            raise _bad(model, problem, f"shaped like the logits {list(logits.shape)}", labels, logits,
                       "model.loss(logits, targets[:, None, None])", "model.loss(logits, targets)   # [batch] or [batch, 1]")
        return jnp.mean(jnp.square(x - y))
    if problem == "single_label_classification":
        flat = labels.reshape(-1)
        if not jnp.issubdtype(labels.dtype, jnp.integer) or flat.shape[0] * count != logits.size:
            raise _bad(model, problem, f"integer class ids [batch] (-100: ignored), one per row of {list(logits.shape)}",
                       labels, logits, "model.loss(logits, jax.nn.one_hot(classes, num_labels))",
                       "model.loss(logits, classes)      # int [batch]")
        return _cross_entropy(model, logits.reshape(-1, count), flat, shape=labels.shape)
    if labels.shape != logits.shape or not jnp.issubdtype(labels.dtype, jnp.floating):
        raise _bad(model, problem, f"floating 0/1 targets shaped like the logits {list(logits.shape)}", labels, logits,
                   "model.loss(logits, classes)", "model.loss(logits, targets.astype(jnp.float32))   # [batch, num_labels]")
    wide = _wide(logits.dtype)
    x, y = logits.astype(wide), labels.astype(wide)
    return jnp.mean(jnp.maximum(x, 0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x))))


def _token_loss(model: Any, logits: jax.Array, labels: jax.Array) -> jax.Array:
    if labels.shape != logits.shape[:-1] or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise _bad(model, "token classification", f"integer ids {list(logits.shape[:-1])} (-100: ignored)", labels,
                   logits, "model.loss(logits, labels[:, 1:])   # shifted, as a causal LM's",
                   "model.loss(logits, labels)           # one label per token")
    return _cross_entropy(model, logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), shape=labels.shape)


def _wide(dtype: Any) -> Any:
    """float32, or ``dtype`` where it is wider (float64: ``jnp.promote_types`` refuses the pair
    under strict promotion)."""
    return dtype if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)


def _cross_entropy(model: Any, logits: jax.Array, labels: jax.Array, ignore: int = IGNORE_INDEX,
                   shape: tuple[int, ...] | None = None) -> jax.Array:
    """torch's ``cross_entropy(logits, labels, ignore_index=ignore)`` in float32 (or wider):
    the mean over the labels kept (NaN where none is, as torch). A concrete label outside
    ``[0, classes)`` other than ``ignore`` raises :data:`LABEL_OUTSIDE_CLASSES` (torch's
    IndexError; ``shape``: the labels' own before they were flattened); a traced one makes
    the loss NaN, never another class's cross-entropy (a gather would wrap -1 to the last)."""
    count = logits.shape[-1]
    values = concrete(labels)
    if values is not None:
        outside = (values != ignore) & ((values < 0) | (values >= count))
        if outside.any():
            at = first_index(outside)[0]
            value = int(values[at])
            where = [int(i) for i in np.unravel_index(at, shape or values.shape)]
            raise ValueError(LABEL_OUTSIDE_CLASSES.format(
                model=type(model).__name__, label=value, where=where, classes=count, last=count - 1,
                logits=short_array(logits), ignore=ignore))
    wide = _wide(logits.dtype)
    # ft.losses' cross-entropy (a traced label outside the classes: NaN); torch's mean over
    # the labels kept, 0 / 0 = NaN where none is (the loss's own "mean" gives 0 there)
    total = softmax_cross_entropy(logits.astype(wide), labels, ignore_index=ignore, reduction="sum")
    return total / jnp.sum(labels != ignore).astype(wide)


def check_head_tensors(family: type[HFModel], config: Any, unexpected: Any,
                       fits: Callable[[type[HFModel]], bool] = lambda task: True) -> None:
    """Raise :data:`HEAD_TENSORS` where the tensors a family's model left over are all a task
    head's of that family (``score.*``, ``classifier.*``, ``cls.*``) and the weights load whole
    into that task's model (``fits``): the weights are that task model's, and the config (an HF
    object's, without ``architectures``) did not say so."""
    if not unexpected or family.__name__ in TASKS:
        return
    roots = {str(n).split(".")[0] for n in unexpected}
    tasks = [name for name, task in TASKS.items()
             if getattr(task, "body_class", None) is family and roots <= _roots(task) and fits(task)]
    if tasks:
        heads = set(getattr(TASKS[tasks[0]], "head_roots", ()))
        extra = sorted(n for n in unexpected if str(n).split(".")[0] in heads)[:3]
        raise ValueError(HEAD_TENSORS.format(extra=extra, listed=getattr(config, "architectures", None),
                                             hf_class=family.hf_class, tasks=" or ".join(tasks), task=tasks[0]))


def check_body_name(family: Any, weights: Mapping[str, Any]) -> None:
    """Raise :data:`BODY_NAMED_OTHERWISE` where ``family`` names its body otherwise than
    its family (``body_alias``: Llama's QA class, ``transformer``) and ``weights`` hold the
    family's name alone (``model.*``: a causal LM's checkpoint), which HF's loader leaves
    unread."""
    alias = getattr(family, "body_alias", None)
    if alias is None:
        return
    named, own = (any(str(k).startswith(n + ".") for k in weights) for n in alias)
    if own and not named:
        raise ValueError(BODY_NAMED_OTHERWISE.format(hf_class=family.hf_class, alias=alias[0], own=alias[1],
                                                     family=family.body_class.hf_class, suffix=family.suffix))


def check_head_missing(family: Any, config: Any, missing: Any, unexpected: Any) -> None:
    """Raise :data:`HEAD_NOT_IN_WEIGHTS` where a task model's weights lack exactly its head
    (every missing tensor under its ``head_roots``): a pretrained body's checkpoint (a causal
    LM's, bert-base-uncased's) read under a task class, whose fresh head is ``with_head``'s."""
    roots = tuple(f"{r}." for r in getattr(family, "head_roots", ()))
    # (a masked LM's file has no pooler: a classifier's from_pretrained draws it, as its head)
    pooler = f"{getattr(family, 'body_prefix', '')}pooler."
    if not roots or not missing or not all(str(n).startswith((*roots, pooler)) for n in missing) \
            or not any(str(n).startswith(roots) for n in missing):
        return
    owner, left = _head_owner(family, unexpected)
    if any(str(n).startswith(pooler) for n in missing) and owner == family.body_class.hf_class:
        return  # (a body's file without its pooler: not a pretrained body as saved)
    extra = f": {left[:2]} left over" if left else ""
    labels = num_labels(config)  # (id2label's count: a config.json gives no num_labels key)
    raise ValueError(HEAD_NOT_IN_WEIGHTS.format(hf_class=family.hf_class, missing=sorted(missing)[:3], extra=extra,
                                                family=owner, suffix=family.suffix, labels=labels))


def _head_owner(family: Any, unexpected: Any) -> tuple[str, list[str]]:
    """The class a task model's left-over tensors are, and their names as the file spells them:
    another task class of the same body whose head they all are (distilbert-base-uncased's
    masked-LM file read under a classifier: the file loads as that class, and ``with_head``
    takes its body), else the family's body class; ``hf_names`` put the body's prefix before
    names it did not know (``distilbert.vocab_projector.bias``, ``bert.cls.predictions.bias``):
    taken off where what is left is no module of the body."""
    names = sorted(str(n) for n in unexpected)
    prefix = getattr(family, "body_prefix", "")
    bare = [n.removeprefix(prefix) for n in names]
    for name, task in TASKS.items():
        if task is not family and getattr(task, "body_class", None) is family.body_class and bare \
                and all(n.split(".")[0] in getattr(task, "head_roots", ()) for n in bare):
            return name, bare
    body = set(getattr(family.body_class, "__ft_fields__", ()))  # (bert.cls.predictions.bias: the file's cls.*)
    return family.body_class.hf_class, [b if prefix and b.split(".")[0] not in body else n for n, b in zip(names, bare)]


def _roots(task: Any) -> set[str]:
    """The first name parts a task model's own tensors have beside its family's: its head's,
    and its body's where HF names it otherwise (Llama's QA class: ``transformer``)."""
    alias = getattr(task, "body_alias", None)
    return set(getattr(task, "head_roots", ())) | ({alias[0]} if alias else set())


def with_head_dropout(model: Any, config: Any, dropout: bool) -> Any:
    """``model`` with its classifier's dropout rate (HF's ``classifier_dropout``) where
    ``from_hf`` was asked for HF's dropout; any other model as it is."""
    if not dropout or not isinstance(model, TaskModel) or "dropout" not in type(model).__ft_fields__:
        return model
    return model.replace(dropout=type(model).head_dropout(config))


# ---- the table: which heads each model type has in transformers 5.24, and their classes

_DECODER: Mapping[str, type[TaskModel]] = {"ForSequenceClassification": LastTokenClassifier, "ForTokenClassification": TokenClassifier}
_DECODER_QA: Mapping[str, type[TaskModel]] = {**_DECODER, "ForQuestionAnswering": QuestionAnswering}
_SEQUENCE_ONLY: Mapping[str, type[TaskModel]] = {"ForSequenceClassification": LastTokenClassifier}

# model type -> HF class suffix -> the head. A family not listed has none yet (one row adds them).
HEADS: dict[str, Mapping[str, type[TaskModel]]] = {
    "gpt2": _DECODER_QA, "llama": _DECODER_QA, "qwen2": _DECODER_QA, "mistral": _DECODER_QA,
    "ministral": _DECODER_QA, "gemma": _DECODER, "phi3": _DECODER, "olmo": _SEQUENCE_ONLY, "qwen3": _DECODER_QA,
    "olmo2": _SEQUENCE_ONLY, "gemma2": _DECODER, "gemma3_text": _SEQUENCE_ONLY, "smollm3": _DECODER_QA, "gpt_neox": _DECODER_QA,
    "phi": _DECODER, "mixtral": _DECODER_QA, "qwen3_moe": _DECODER_QA, "qwen2_moe": _DECODER_QA,
    "opt": {**_SEQUENCE_ONLY, "ForQuestionAnswering": QuestionAnswering},
    "bert": {"ForSequenceClassification": PooledClassifier, "ForTokenClassification": TokenClassifier,
             "ForMaskedLM": MaskedLM, "ForQuestionAnswering": QuestionAnswering,
             "ForMultipleChoice": PooledMultipleChoice},
}
# HF's module name of a token classifier where it is not the generic class's "score".
_CLASSIFIER_NAMED = ("gpt2", "gpt_neox", "bert", "roberta", "xlm-roberta", "distilbert")
# The families whose HF forward counts each row's real tokens for positions (OPT's
# cumsum(attention_mask) - 1); the others take 0..T-1 whatever the mask.
_COUNTED_POSITIONS = ("opt",)
# HF's base_model_prefix of an encoder family (a decoder's causal LM names its body already).
_BODY_PREFIX = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta.", "distilbert": "distilbert."}
# (head, model type) -> HF's attribute of the body where it is not the causal LM's: transformers
# 5.24's Llama, Qwen2, Ministral, Qwen3 and SmolLM3 QA classes keep base_model_prefix "transformer" (their
# older checkpoints' name; Mistral's is "model").
_BODY_NAMED = {("ForQuestionAnswering", t): "transformer" for t in ("llama", "qwen2", "ministral", "qwen3", "smollm3",
                                                                               "qwen3_moe")}


# HF's name of a family's task classes where it is not its causal LM's (Gemma3ForSequenceClassification
# is Gemma 3's image-and-text model's).
_TASK_NAMES = {"gemma3_text": "Gemma3Text"}


def _family_name(family: type[HFModel]) -> str:
    if family.model_type in _TASK_NAMES:
        return _TASK_NAMES[family.model_type]
    name = family.hf_class
    for suffix in ("ForCausalLM", "LMHeadModel", "Model"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def task_class(head: type[TaskModel], family: type[HFModel]) -> type[TaskModel]:
    """The class of ``head`` on ``family``'s body, named as HF names it, its class variables
    the family's under the field ``body``: layouts, renames (HF's body names: the causal LM's
    own, or BERT's under ``bert.``), the padded embedding and residual projections of the
    initialization, and what PEFT's ``"all-linear"`` adds (``hf_all_linear``)."""
    name = _family_name(family) + head.suffix
    assert family.model_type is not None
    prefix = _BODY_PREFIX.get(family.model_type, "")
    roots = head.head_roots
    rename = dict(head.head_rename)
    if head is TokenClassifier and family.model_type in _CLASSIFIER_NAMED:
        roots, rename = ("classifier",), {}
    named = _BODY_NAMED.get((head.suffix, family.model_type))
    alias = None if named is None else (named, "model")
    if prefix:
        rename[prefix[:-1]] = "body"
    else:  # the causal LM's own modules (model, transformer, gpt_neox) under body
        rename.update({_swapped(f, "model", named) if named else f: f"body.{f}" for f in family.__ft_fields__
                       if f not in ("lm_head", "hf_config") and f not in family.__ft_static__})
    rename.update({prefix + (_swapped(k, "model", named) if named else k): f"body.{v}"
                   for k, v in family.hf_rename.items()})
    namespace = {
        "__module__": __name__, "__qualname__": name, "hf_class": name, "body_class": family,
        "body_prefix": prefix, "body_alias": alias, "head_roots": roots, "hf_rename": rename,
        "hf_layouts": {f"body.{k}": v for k, v in family.hf_layouts.items()},
        "hf_padded": None if family.hf_padded is None else f"body.{family.hf_padded}",
        "hf_padded_also": tuple(f"body.{p}" for p in family.hf_padded_also),
        "hf_residual": family.hf_residual,
        "hf_all_linear": family.hf_all_linear,  # (PEFT converts by the config's model type, the body's)
        "__doc__": f"Hugging Face's ``{name}``: :class:`{head.__name__}` on ``{family.__name__}``'s body.",
    }
    cls = type(name, (head,), namespace)
    cls.model_type = family.model_type  # set after: a task class joins TASKS, never FAMILIES
    return cls  # type: ignore[return-value]


def register_heads(model_type: str) -> None:
    """Make and register the class of each of ``HEADS[model_type]``'s heads on the family
    (:data:`TASKS`, and this module's attribute: pickles and checkpoints name it here)."""
    module = sys.modules[__name__]
    family = FAMILIES.get(model_type)
    if family is None:
        return
    for head in HEADS[model_type].values():
        cls = task_class(head, family)
        TASKS[cls.hf_class] = cls
        setattr(module, cls.__name__, cls)


for _model_type in list(HEADS):
    register_heads(_model_type)

# The heads written for one family (RoBERTa's classifier and LM head) are modules of their
# own that subclass TaskModel above and add their HEADS rows (registering them) when imported:
# functree/hf/__init__.py imports them after this module.
