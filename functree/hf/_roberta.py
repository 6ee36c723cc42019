"""RoBERTa as a functree model: Hugging Face's ``RobertaModel`` (``roberta``) and
``XLMRobertaModel`` (``xlm-roberta``, the same architecture under another name), encoders.

transformers writes RoBERTa as BERT (``RobertaLayer(BertLayer)``, ``RobertaModel`` BERT's
forward) but for its embeddings' positions, and so does functree: :class:`RobertaModel`
subclasses :class:`~functree.hf._bert.BertModel` and overrides the embeddings' sum. A
position is counted from the token ids, never from the attention mask (HF's
``create_position_ids_from_input_ids``)::

    real = input_ids != pad_token_id
    position = pad_token_id + cumsum(real) * real      # a padding token: pad_token_id

so a row's first real token sits at ``pad_token_id + 1`` (2 for ``pad_token_id`` 1) wherever
the row's padding is (left padding shifts nothing), and the table needs ``pad_token_id + 1``
rows more than a row's real tokens (checkpoints: ``max_position_embeddings`` 514, 512 tokens).
The position table's row ``pad_token_id`` is torch's ``padding_idx``: it passes no gradient.
Segment ids default to zeros (HF gathers them from a zero buffer); checkpoints have
``type_vocab_size`` 1. HF's ``inputs_embeds=`` path (no ids to count) takes positions
``pad_token_id + 1 .. pad_token_id + T`` for every row; functree's call takes ids only.

The task heads (``RobertaForSequenceClassification``: ``classifier.dense``, tanh,
``classifier.out_proj`` on the ``<s>`` token; ``RobertaForMaskedLM``: ``lm_head``) are
:mod:`functree.hf._roberta_heads`; token classification and question answering are
:mod:`functree.hf._heads`' own, as BERT's.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._random import one_key
from functree.hf._bert import BertEmbeddings, BertModel, _norm_name, _token_types
from functree.hf._causal import lookup_rows, padding_index, padding_row
from functree.hf._family import renamed
from functree.nn._check import concrete

__all__ = ["RobertaModel", "XLMRobertaModel", "RobertaEmbeddings", "roberta_positions"]

NO_PAD_TOKEN = """\
ft.nn.from_hf: the {model_type} config's pad_token_id is {given!r}; RoBERTa counts each token's \
position from the ids (pad_token_id + 1 for the first token that is not pad_token_id), so it \
needs an integer pad id inside the position table ({rows} rows). Hugging Face's forward fails \
on this config.

    wrong:  "pad_token_id": {given_json}
    right:  "pad_token_id": 1        # the checkpoints' (<pad>), as the tokenizer pads
"""

POSITION_PAST_TABLE = """\
{model}: row {row} has {count} tokens that are not pad_token_id ({pad}); RoBERTa gives them \
positions {pad} + 1 to {pad} + {count} = {high}, but the learned position embedding has {rows} \
rows (max_position_embeddings {rows}: at most {fit} such tokens a row). Hugging Face fails \
here too (index out of bounds).

    wrong:  model(input_ids)                                           # a row of {count} tokens
    right:  model(input_ids[:, :{fit}], attention_mask[:, :{fit}])     # at most {fit} tokens a row
"""

_ROBERTA_BUFFER = re.compile(r"(roberta\.)?embeddings\.(position_ids|token_type_ids)")


def roberta_positions(ids: jax.Array, pad: int) -> jax.Array:
    """HF's ``create_position_ids_from_input_ids``: ``pad + cumsum(real) * real`` with
    ``real = ids != pad`` (a padding token at ``pad``, the first real token at ``pad + 1``).

    Example:
      >>> import jax.numpy as jnp
      >>> roberta_positions(jnp.array([[0, 5, 2, 1, 1], [1, 1, 0, 5, 2]]), 1).tolist()
      [[2, 3, 4, 1, 1], [1, 1, 2, 3, 4]]
    """
    real = (ids != pad).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + pad


class RobertaEmbeddings(BertEmbeddings):
    """BERT's embeddings with HF's ``padding_idx`` (the config's ``pad_token_id``): the id
    whose tokens take no position of their own, and the position table's row without gradient."""

    padding_idx: int = field(static=True, default=1)

    def __init__(self, vocab: int, positions: int, types: int, d: int, epsilon: float, padding_idx: int = 1, *,
                 key: jax.Array, dtype: Any = jnp.float32):
        super().__init__(vocab, positions, types, d, epsilon, key=key, dtype=dtype)
        self.padding_idx = padding_idx


class RobertaModel(BertModel):
    """Hugging Face's ``RobertaModel`` as a functree model (built by :func:`ft.nn.from_hf`):
    :class:`~functree.hf._bert.BertModel` with RoBERTa's positions (module docstring).

    ``model(input_ids, attention_mask=None, token_type_ids=None)`` is the last hidden state
    ``[batch, T, hidden]``; ``pooler`` (None without one: HF's task classes build the body
    without it) gives HF's ``pooler_output``. Parameters keep HF's names.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "roberta", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
      ...           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 10,
      ...           "type_vocab_size": 1}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> ids = np.array([[0, 5, 6, 2, 1], [1, 0, 7, 8, 2]], np.int32)     # right and left padding (pad id 1)
      >>> model(ids, ids != 1).shape
      (2, 5, 8)
    """

    embeddings: RobertaEmbeddings  # type: ignore[assignment]  # (BERT's, with its padding_idx)
    model_type = "roberta"
    hf_padded_also = ("embeddings.position_embeddings.weight",)  # HF's padding_idx there too: zeroed at init
    # roberta-base's and xlm-roberta-base's masked-LM files hold the body's pooler, which HF's
    # RobertaForMaskedLM (no pooler) leaves unread; RobertaModel leaves the LM head unread
    hf_unread = ("roberta.pooler.", "lm_head.")

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *,
                 padding_idx: int = 1, types: int = 2, activation: Any = None, epsilon: float = 1e-12,
                 pooler: bool = True, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        super().__init__(vocab, positions, d, heads, hidden, layers, types=types, activation=activation,
                         epsilon=epsilon, pooler=pooler, key=key, dtype=dtype, attention=attention)
        # BERT's embeddings drawn from the same key, with the padding id
        self.embeddings = RobertaEmbeddings(vocab, positions, types, d, epsilon, padding_idx,
                                            key=jax.random.split(one_key(key), 3)[0], dtype=dtype)

    def _embed(self, ids: jax.Array, token_type_ids: Any) -> jax.Array:
        """HF's ``RobertaEmbeddings``' sum before its LayerNorm: ``(word + segment) + position``,
        the positions counted from the ids (:func:`roberta_positions`)."""
        e = self.embeddings
        rows = e.position_embeddings.embeddings.shape[0]
        positions = roberta_positions(ids, e.padding_idx)
        _check_positions(self, ids, positions, rows)
        types = _token_types(self, ids, token_type_ids, e.token_type_embeddings.embeddings.shape[0])
        words = lookup_rows(e.word_embeddings, ids, padding_row(self, e.word_embeddings.embeddings.shape[0]))
        x = words + lookup_rows(e.token_type_embeddings, types)
        # (traced ids past the table read NaN rows: lookup_rows)
        return x + lookup_rows(e.position_embeddings, positions, padding_index(e.padding_idx, rows))

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        from functree.hf._options import activation, require

        c = config
        require(c, "position_embedding_type", "absolute", "absolute")
        require(c, "is_decoder", False, False)
        require(c, "add_cross_attention", False, False)
        pad = getattr(c, "pad_token_id", None)
        row = padding_index(pad, c.max_position_embeddings)
        if row is None or row != pad:  # (torch wraps a negative id; the positions would start below 0)
            import json

            raise ValueError(NO_PAD_TOKEN.format(model_type=c.model_type, given=pad, rows=c.max_position_embeddings,
                                                 given_json=json.dumps(pad)))
        return cls(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads, c.intermediate_size,
                   c.num_hidden_layers, padding_idx=row, types=c.type_vocab_size,
                   activation=activation(c, "hidden_act"), epsilon=c.layer_norm_eps,
                   pooler="pooler.dense.weight" in names, key=key, dtype=dtype, attention=attention)

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """A task checkpoint's body under ``roberta.`` read as the model's; the embeddings'
        ``position_ids`` / ``token_type_ids`` buffers (older files) dropped, as HF's loader
        ignores them."""
        out = {k: v for k, v in weights.items() if not _ROBERTA_BUFFER.fullmatch(k)}
        if any(k.startswith("roberta.") for k in out) and not any(k.startswith("embeddings.") for k in out):
            out = renamed(out, lambda k: k.removeprefix("roberta."), cls.hf_class)
        return renamed(out, _norm_name, cls.hf_class)


class XLMRobertaModel(RobertaModel):
    """Hugging Face's ``XLMRobertaModel``: :class:`RobertaModel` under model type ``xlm-roberta``."""

    model_type = "xlm-roberta"


def _check_positions(model: Any, ids: jax.Array, positions: jax.Array, rows: int) -> None:
    """Refuse concrete ids whose positions pass the table (:data:`POSITION_PAST_TABLE`)."""
    host = concrete(positions)
    if host is None or host.size == 0 or host.max() < rows:
        return
    row = int(np.argmax(host.max(axis=1)))
    pad = model.embeddings.padding_idx
    high = int(host[row].max())
    raise ValueError(POSITION_PAST_TABLE.format(model=type(model).__name__, row=row, count=high - pad, pad=pad,
                                                high=high, rows=rows, fit=rows - pad - 1))
