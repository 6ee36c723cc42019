"""DistilBERT's task heads (``modeling_distilbert.py``), those it does not share with BERT:

* :class:`PreClassifierClassifier` (``DistilBertForSequenceClassification``):
  ``classifier(dropout(relu(pre_classifier(h[:, 0]))))``, the first token's hidden state
  through a hidden layer of the head's own (DistilBERT has no pooler), the dropout
  ``seq_classif_dropout``; :class:`PreClassifierMultipleChoice` (``ForMultipleChoice``) is
  the same on each choice, ``classifier`` one output;
* :class:`VocabProjectorMaskedLM` (``DistilBertForMaskedLM``):
  ``vocab_layer_norm(act(vocab_transform(h))) E^T + vocab_projector.bias`` at every token,
  ``act`` the config's ``activation``, ``vocab_projector.weight`` tied to the word embedding
  ``E`` and its bias the head's own (HF ties the weight alone: a
  :class:`~functree.hf._causal.TiedBias`); ``tie_word_embeddings=false``: a projector of its own;
* :class:`DropoutQuestionAnswering` (``ForQuestionAnswering``): BERT's ``qa_outputs`` after
  a dropout of its own (``qa_dropout``).

Token classification is :mod:`functree.hf._heads`' own head (``classifier``, the dropout
``config.dropout``). Every head's body is HF's ``distilbert.``; importing this module adds
the ``distilbert`` row to :data:`~functree.hf._heads.HEADS` and registers its classes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax

from functree._activations import relu
from functree._module import field
from functree._random import one_key
from functree.hf import _models  # noqa: F401  (defines every family first: FAMILIES' order)
from functree.hf._causal import TiedBias, _head, is_tied
from functree.hf._config import HFConfig
from functree.hf._distilbert import EPSILON
from functree.hf._dropout import drop
from functree.hf._heads import (
    HEADS,
    PooledClassifier,
    PooledMultipleChoice,
    QuestionAnswering,
    SpanLogits,
    TaskModel,
    TokenClassifier,
    _classifier_rate,
    _token_loss,
    _tokens,
    num_labels,
    register_heads,
)
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm

__all__ = ["PreClassifierClassifier", "PreClassifierMultipleChoice", "VocabProjectorMaskedLM",
           "DropoutQuestionAnswering"]


class _PreClassified:
    """DistilBERT's first-token head (a mixin before BERT's pooled head): ``relu(pre_classifier(h[:, 0]))``
    in place of BERT's pooler, the dropout after it ``seq_classif_dropout`` (0.2 by default)."""

    pre_classifier: Dense
    pooled = False
    head_roots = ("classifier", "pre_classifier")  # (the first: PEFT's SEQ_CLS classifier, kept whole)

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        return _classifier_rate(config, "seq_classif_dropout", default=0.2)

    def __init__(self, body: Any, pre_classifier: Dense, classifier: Dense, hf_config: HFConfig | None = None,
                 dropout: float = 0.0):
        super().__init__(body, classifier, hf_config, dropout)  # type: ignore[call-arg]  # (the pooled head's)
        self.pre_classifier = pre_classifier

    def _pool(self, h: jax.Array) -> jax.Array:
        return self.pre_classifier(h[:, 0])


class PreClassifierClassifier(_PreClassified, PooledClassifier):
    """``DistilBertForSequenceClassification``: ``classifier(dropout(relu(pre_classifier(h[:, 0]))))``,
    ``[batch, num_labels]``; HF's ``problem_type`` losses (:func:`~functree.hf._heads.task_loss`).

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "distilbert", "architectures": ["DistilBertForSequenceClassification"],
      ...           "vocab_size": 11, "dim": 8, "hidden_dim": 16, "n_layers": 1, "n_heads": 2,
      ...           "max_position_embeddings": 10, "num_labels": 3}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> ids = np.array([[1, 5, 6, 2, 0], [1, 7, 8, 9, 2]], np.int32)
      >>> model(ids, ids != 0).shape
      (2, 3)
    """

    pre_classifier: Dense

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        k1, k2 = jax.random.split(one_key(key))
        return cls(body, Dense(width, width, relu, key=k1, dtype=dtype),
                   Dense(width, num_labels(config), key=k2, dtype=dtype))


class PreClassifierMultipleChoice(_PreClassified, PooledMultipleChoice):
    """``DistilBertForMultipleChoice``: each choice scored
    ``classifier(dropout(relu(pre_classifier(h[:, 0]))))`` (``classifier``: one output),
    ``[batch, num_choices]``; inputs ``[batch, num_choices, T]`` as
    :class:`~functree.hf._heads.PooledMultipleChoice`'s."""

    pre_classifier: Dense

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        k1, k2 = jax.random.split(one_key(key))
        return cls(body, Dense(width, width, relu, key=k1, dtype=dtype), Dense(width, 1, key=k2, dtype=dtype))


class DropoutQuestionAnswering(QuestionAnswering):
    """``DistilBertForQuestionAnswering``: ``qa_outputs(dropout(h))`` split into the span's
    start and end logits (:class:`~functree.hf._heads.SpanLogits`), the dropout ``qa_dropout``
    (in training, with ``from_hf(..., dropout=True)``); ``num_labels`` must be 2, as HF's."""

    dropout: float = field(static=True, default=0.0)

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        return _classifier_rate(config, "qa_dropout", default=0.1)

    def __init__(self, body: Any, qa_outputs: Dense, hf_config: HFConfig | None = None, dropout: float = 0.0):
        super().__init__(body, qa_outputs, hf_config)
        self.dropout = dropout

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> SpanLogits:
        body_key, head_key = self._keys(key)
        h = self._hidden(input_ids, attention_mask, token_type_ids, body_key)
        logits = self.qa_outputs(drop(h, self.dropout, head_key) if head_key is not None else h)
        return SpanLogits(logits[..., 0], logits[..., 1])


class VocabProjectorMaskedLM(TaskModel):
    """``DistilBertForMaskedLM``: ``vocab_layer_norm(act(vocab_transform(h))) E^T + bias`` at
    every token, ``[batch, T, vocab]`` (module docstring); untied:
    ``vocab_projector(vocab_layer_norm(act(vocab_transform(h))))``.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "distilbert", "architectures": ["DistilBertForMaskedLM"], "vocab_size": 11,
      ...           "dim": 8, "hidden_dim": 16, "n_layers": 1, "n_heads": 2, "max_position_embeddings": 10}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> sorted(k for k in ft.nn.to_hf_state_dict(model) if k.startswith("vocab_projector"))
      ['vocab_projector.bias', 'vocab_projector.weight']
    """

    body: Any
    vocab_transform: Dense
    vocab_layer_norm: LayerNorm
    vocab_projector: Dense | TiedBias
    hf_config: HFConfig | None = field(static=True, default=None)
    suffix = "ForMaskedLM"
    head_roots = ("vocab_transform", "vocab_layer_norm", "vocab_projector")
    hf_ties: ClassVar[tuple[tuple[str, str], ...]] = (
        ("vocab_projector.weight", "distilbert.embeddings.word_embeddings.weight"),)

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        from functree.hf._options import activation

        vocab = int(_tokens(body).embeddings.shape[0])
        k1, k2 = jax.random.split(one_key(key))
        tied = getattr(config, "tie_word_embeddings", True)
        projector = TiedBias(vocab, dtype=dtype) if tied else Dense(width, vocab, key=k2, dtype=dtype)
        return cls(body, Dense(width, width, activation(config, "activation"), key=k1, dtype=dtype),
                   LayerNorm(width, epsilon=EPSILON, dtype=dtype), projector)

    def __init__(self, body: Any, vocab_transform: Dense, vocab_layer_norm: LayerNorm,
                 vocab_projector: Dense | TiedBias, hf_config: HFConfig | None = None):
        self.body, self.vocab_transform, self.vocab_layer_norm = body, vocab_transform, vocab_layer_norm
        self.vocab_projector, self.hf_config = vocab_projector, hf_config

    def hf_tied(self) -> tuple[tuple[str, str], ...]:
        """The weight's tie, or none where the projector is its own."""
        return type(self).hf_ties if is_tied(self.vocab_projector) else ()

    def hf_output_head(self) -> str | None:
        """An untied projector (PEFT's ``"all-linear"`` leaves it out); a tied one is the embedding."""
        return None if is_tied(self.vocab_projector) else "vocab_projector"

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        h = self._hidden(input_ids, attention_mask, token_type_ids, key)
        x = self.vocab_layer_norm(self.vocab_transform(h))
        return _head(x, self.vocab_projector, self.body.embeddings.word_embeddings)  # (Phi's tied head with a bias)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _token_loss(self, logits, labels)


HEADS["distilbert"] = {"ForSequenceClassification": PreClassifierClassifier,
                       "ForTokenClassification": TokenClassifier, "ForMaskedLM": VocabProjectorMaskedLM,
                       "ForQuestionAnswering": DropoutQuestionAnswering,
                       "ForMultipleChoice": PreClassifierMultipleChoice}
register_heads("distilbert")
