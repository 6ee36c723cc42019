"""RoBERTa's own task heads (``modeling_roberta.py``), the two it does not share with BERT:

* :class:`FirstTokenClassifier` (``RobertaForSequenceClassification``: HF's
  ``RobertaClassificationHead``): ``out_proj(dropout(tanh(dense(dropout(h[:, 0])))))``, the
  ``<s>`` token's hidden state through a hidden layer of the head's own (HF builds the body
  without a pooler: ``RobertaModel(config, add_pooling_layer=False)``);
* :class:`LMHeadMaskedLM` (``RobertaForMaskedLM``: HF's ``RobertaLMHead``):
  ``layer_norm(gelu(dense(h))) E^T + bias`` at every token, ``gelu`` the exact one whatever
  the config's ``hidden_act`` (HF's head calls ``gelu`` itself), ``lm_head.decoder`` tied to
  the word embedding ``E`` and its bias to ``lm_head.bias`` (``tie_word_embeddings=false``:
  a decoder of its own, as HF unties both).

Token classification and question answering are :mod:`functree.hf._heads`' own heads (as
BERT's: ``classifier``, ``qa_outputs`` with ``num_labels`` outputs). Importing this module
adds the ``roberta`` and ``xlm-roberta`` rows to :data:`~functree.hf._heads.HEADS` and
registers their classes (``RobertaForMaskedLM``, ``XLMRobertaForSequenceClassification``, ...).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._activations import gelu_exact, tanh
from functree._module import Module, field
from functree._random import one_key
from functree.hf._config import HFConfig
from functree.hf._dropout import drop
from functree.hf._heads import (
    HEADS,
    PooledMultipleChoice,
    QuestionAnswering,
    TaskModel,
    TokenClassifier,
    _classifier_rate,
    _sequence_loss,
    _token_loss,
    _tokens,
    num_labels,
    register_heads,
)
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm

__all__ = ["FirstTokenClassifier", "LMHeadMaskedLM", "RobertaClassificationHead", "RobertaLMHead"]


class RobertaClassificationHead(Module):
    """HF's ``classifier``: ``dense`` (``d -> d``, tanh after it) and ``out_proj`` (``d -> num_labels``)."""

    dense: Dense
    out_proj: Dense

    def __init__(self, dense: Dense, out_proj: Dense):
        self.dense, self.out_proj = dense, out_proj


class FirstTokenClassifier(TaskModel):
    """``RobertaForSequenceClassification``: ``out_proj(tanh(dense(h[:, 0])))``, ``[batch,
    num_labels]``, a dropout before each of the two layers in training (HF's
    ``classifier_dropout``, else ``hidden_dropout_prob``).

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "roberta", "architectures": ["RobertaForSequenceClassification"],
      ...           "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
      ...           "num_attention_heads": 2, "max_position_embeddings": 10, "num_labels": 3}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> ids = np.array([[0, 5, 6, 2, 1], [1, 0, 7, 8, 2]], np.int32)
      >>> model(ids, ids != 1).shape
      (2, 3)
    """

    body: Any
    classifier: RobertaClassificationHead
    hf_config: HFConfig | None = field(static=True, default=None)
    dropout: float = field(static=True, default=0.0)
    suffix = "ForSequenceClassification"
    head_roots = ("classifier",)

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        k1, k2 = jax.random.split(one_key(key))
        return cls(body, RobertaClassificationHead(Dense(width, width, tanh, key=k1, dtype=dtype),
                                                   Dense(width, num_labels(config), key=k2, dtype=dtype)))

    @classmethod
    def head_dropout(cls, config: Any) -> float:
        return _classifier_rate(config, "classifier_dropout", "hidden_dropout_prob", default=0.1)

    def __init__(self, body: Any, classifier: RobertaClassificationHead, hf_config: HFConfig | None = None,
                 dropout: float = 0.0):
        self.body, self.classifier, self.hf_config, self.dropout = body, classifier, hf_config, dropout

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        body_key, head_key = self._keys(key)
        x = self._hidden(input_ids, attention_mask, token_type_ids, body_key)[:, 0]  # <s>
        head = self.classifier
        if head_key is None:
            return head.out_proj(head.dense(x))
        first, second = jax.random.split(head_key)  # HF's one Dropout module, called twice
        return head.out_proj(drop(head.dense(drop(x, self.dropout, first)), self.dropout, second))

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _sequence_loss(self, logits, labels)


class RobertaLMHead(Module):
    """HF's ``lm_head``: ``dense`` (gelu after it), ``layer_norm``, the output ``bias``, and
    with ``tie_word_embeddings=false`` a ``decoder`` of its own (tied: None, the word embedding)."""

    dense: Dense
    layer_norm: LayerNorm
    bias: jax.Array
    decoder: Dense | None = None

    def __init__(self, dense: Dense, layer_norm: LayerNorm, bias: jax.Array, decoder: Dense | None = None):
        self.dense, self.layer_norm, self.bias, self.decoder = dense, layer_norm, bias, decoder


class LMHeadMaskedLM(TaskModel):
    """``RobertaForMaskedLM``: ``layer_norm(gelu(dense(h))) E^T + bias`` at every token,
    ``[batch, T, vocab]`` (module docstring); untied: ``decoder(layer_norm(gelu(dense(h))))``,
    ``lm_head.bias`` kept as HF keeps it, unread."""

    body: Any
    lm_head: RobertaLMHead
    hf_config: HFConfig | None = field(static=True, default=None)
    suffix = "ForMaskedLM"
    head_roots = ("lm_head",)
    hf_ties: ClassVar[tuple[tuple[str, str], ...]] = (
        ("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"),
        ("lm_head.decoder.bias", "lm_head.bias"))

    @classmethod
    def build(cls, body: Any, width: int, config: Any, dtype: Any, key: jax.Array) -> Any:
        vocab = int(_tokens(body).embeddings.shape[0])
        k1, k2 = jax.random.split(one_key(key))
        decoder = None if getattr(config, "tie_word_embeddings", True) else Dense(width, vocab, key=k2, dtype=dtype)
        return cls(body, RobertaLMHead(Dense(width, width, gelu_exact, key=k1, dtype=dtype),
                                       LayerNorm(width, epsilon=config.layer_norm_eps, dtype=dtype),
                                       jnp.zeros((vocab,), dtype), decoder))

    def __init__(self, body: Any, lm_head: RobertaLMHead, hf_config: HFConfig | None = None):
        self.body, self.lm_head, self.hf_config = body, lm_head, hf_config

    def hf_tied(self) -> tuple[tuple[str, str], ...]:
        """Both ties of ``hf_ties``, or none where the decoder is its own."""
        return () if self.lm_head.decoder is not None else type(self).hf_ties

    def hf_output_head(self) -> str | None:
        """An untied decoder (PEFT's ``"all-linear"`` leaves it out); a tied one is the embedding."""
        return "lm_head.decoder" if self.lm_head.decoder is not None else None

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        h = self._hidden(input_ids, attention_mask, token_type_ids, key)
        head = self.lm_head
        x = head.layer_norm(head.dense(h))
        if head.decoder is not None:
            return head.decoder(x)
        table = self.body.embeddings.word_embeddings.embeddings
        return x @ table.T.astype(x.dtype) + jax.lax.broadcast_to_rank(head.bias.astype(x.dtype), x.ndim)

    def _loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return _token_loss(self, logits, labels)


_ROBERTA: dict[str, type[TaskModel]] = {"ForSequenceClassification": FirstTokenClassifier,
                                        "ForTokenClassification": TokenClassifier, "ForMaskedLM": LMHeadMaskedLM,
                                        "ForQuestionAnswering": QuestionAnswering,
                                        "ForMultipleChoice": PooledMultipleChoice}
for _model_type in ("roberta", "xlm-roberta"):
    HEADS[_model_type] = _ROBERTA
    register_heads(_model_type)
