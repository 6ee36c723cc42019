"""DistilBERT as a functree model: Hugging Face's ``DistilBertModel`` (``distilbert``), an encoder.

transformers writes DistilBERT as a BERT of other names (``modeling_distilbert.py``): the
embeddings are ``LayerNorm(word + position)`` (positions ``0..T-1``, no segment table; the
LayerNorm's epsilon 1e-12 whatever the config), each block is BERT's post-norm block
(``sa_layer_norm(x + out_lin(attention(q_lin, k_lin, v_lin)))``, then
``output_layer_norm(x + lin2(act(lin1(x))))``, ``act`` the config's ``activation``, "gelu"
or "relu"), and there is no pooler. So is functree's: :class:`DistilBertModel` subclasses
:class:`~functree.hf._bert.BertModel`, its blocks are :class:`~functree.hf._bert.BertLayer`,
and HF's names are read through :data:`DISTILBERT_RENAME` (``transformer`` is the encoder;
``ffn.lin1`` BERT's ``intermediate``, ...). The config's own names (``dim``, ``n_heads``,
``n_layers``, ``hidden_dim``) are read as HF's ``DistilBertConfig`` keeps them.

``sinusoidal_pos_embds`` decides the position table's initialization alone (HF's
``_init_weights`` copies the sinusoids, rounded to float32, into a trainable table, which
``save_pretrained`` writes like any weight): :func:`ft.nn.from_hf` from a config draws them
too (:meth:`DistilBertModel.hf_initial`); weights loaded are read as they are.

HF's dropout (``from_hf(..., dropout=True)``): ``dropout`` after the embeddings' LayerNorm
and after ``lin2``, ``attention_dropout`` on the attention weights, none after ``out_lin``
(HF has none there). The task heads are :mod:`functree.hf._distilbert_heads`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import Module
from functree._random import one_key
from functree.hf._bert import BertEncoder, BertLayer, BertModel, _norm_name
from functree.hf._causal import check_length, lookup_rows, padding_row
from functree.hf._dropout import rate
from functree.hf._family import renamed
from functree.nn._embedding import Embedding
from functree.nn._normalization import LayerNorm
from functree.nn._stack import Stack

__all__ = ["DistilBertModel", "DistilBertEmbeddings", "DISTILBERT_RENAME", "sinusoids"]

NO_TOKEN_TYPES = """\
{model}: DistilBERT has no segment embedding (its embeddings are the word and position \
tables alone), so token_type_ids would change nothing; Hugging Face's forward takes them \
and ignores them. Its tokenizer gives none.

    wrong:  model(input_ids, attention_mask, token_type_ids)
    right:  model(input_ids, attention_mask)
"""

EPSILON = 1e-12  # HF's nn.LayerNorm(dim, eps=1e-12) everywhere: the config has no layer_norm_eps

# HF's names of DistilBERT's modules where functree's (BERT's) differ (``*``: the layer number).
DISTILBERT_RENAME = {
    "transformer.layer.*.sa_layer_norm": "encoder.layer.*.attention_norm",
    "transformer.layer.*.ffn.lin1": "encoder.layer.*.intermediate",
    "transformer.layer.*.ffn.lin2": "encoder.layer.*.output",
    "transformer.layer.*.output_layer_norm": "encoder.layer.*.output_norm",
    "transformer": "encoder",
}

_BUFFER = re.compile(r"(distilbert\.)?embeddings\.position_ids")


def sinusoids(positions: int, dim: int) -> np.ndarray:
    """HF's ``create_sinusoidal_embeddings``: ``sin(p / 10000^(2 * (j // 2) / dim))`` at even
    ``j``, ``cos`` at odd, in float64 and then rounded to float32 as HF's table holds them.

    Example:
      >>> [round(float(v), 3) for v in sinusoids(2, 4)[1]]
      [0.841, 0.54, 0.01, 1.0]
    """
    p = np.arange(positions, dtype=np.float64)[:, None]
    j = np.arange(dim)
    angle = p / np.power(10000.0, 2 * (j // 2) / dim)
    return np.where(j % 2 == 0, np.sin(angle), np.cos(angle)).astype(np.float32)


class DistilBertEmbeddings(Module):
    """``LayerNorm(word + position embeddings)`` (HF's ``Embeddings``)."""

    word_embeddings: Embedding
    position_embeddings: Embedding
    LayerNorm: LayerNorm

    def __init__(self, vocab: int, positions: int, d: int, *, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.word_embeddings = Embedding(vocab, d, key=k1, dtype=dtype)
        self.position_embeddings = Embedding(positions, d, key=k2, dtype=dtype)
        self.LayerNorm = LayerNorm(d, epsilon=EPSILON, dtype=dtype)


class DistilBertModel(BertModel):
    """Hugging Face's ``DistilBertModel`` as a functree model (built by :func:`ft.nn.from_hf`):
    BERT's blocks under DistilBERT's names (module docstring).

    ``model(input_ids, attention_mask=None)`` is the last hidden state ``[batch, T, dim]``
    (positions ``0..T-1``; the mask a padding mask, 1 for a real token, as HF's).

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "distilbert", "vocab_size": 11, "dim": 8, "hidden_dim": 16, "n_layers": 1,
      ...           "n_heads": 2, "max_position_embeddings": 10}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> ids = np.array([[101, 5, 6, 102, 0], [101, 7, 8, 9, 102]], np.int32) % 11
      >>> model(ids, ids != 0).shape
      (2, 5, 8)
    """

    embeddings: DistilBertEmbeddings  # type: ignore[assignment]  # (no segment table)
    model_type = "distilbert"
    hf_padded = "embeddings.word_embeddings.weight"
    hf_layouts: ClassVar[dict[str, Any]] = {"encoder.layer.*.attention": ("q_lin", "k_lin", "v_lin", "out_lin")}
    hf_rename: ClassVar[dict[str, str]] = DISTILBERT_RENAME
    hf_unread: ClassVar[tuple[str, ...]] = ()  # (a masked LM's file, as distilbert-base-uncased's, is its class's)

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *,
                 activation: Any = None, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        from functree._activations import gelu_exact

        k1, k2 = jax.random.split(one_key(key))
        act = gelu_exact if activation is None else activation
        self.embeddings = DistilBertEmbeddings(vocab, positions, d, key=k1, dtype=dtype)
        self.encoder = BertEncoder(Stack(lambda k: BertLayer(d, heads, hidden, act, EPSILON, key=k, dtype=dtype,
                                                             attention=attention), layers, key=k2))
        self.pooler = None

    def _embed(self, ids: jax.Array, token_type_ids: Any) -> jax.Array:
        """HF's ``Embeddings``' sum before its LayerNorm: ``word + position``, positions ``0..T-1``."""
        if token_type_ids is not None:
            raise ValueError(NO_TOKEN_TYPES.format(model=type(self).__name__))
        e = self.embeddings
        check_length(self, ids.shape[1], e.position_embeddings.embeddings.shape[0], "max_position_embeddings")
        pad = padding_row(self, e.word_embeddings.embeddings.shape[0])
        return lookup_rows(e.word_embeddings, ids, pad) + e.position_embeddings(jnp.arange(ids.shape[1]))[None]

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        from functree.hf._options import activation

        c = config
        # (dim, n_heads, n_layers under HF's standard names: DistilBertConfig's attribute_map, ALIASES)
        return cls(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads, c.hidden_dim,
                   c.num_hidden_layers, activation=activation(c, "activation"), key=key, dtype=dtype,
                   attention=attention)

    @classmethod
    def hf_initial(cls, model: Any, config: Any) -> Any:
        """HF's ``_init_weights`` past the drawn ones: with ``sinusoidal_pos_embds`` the
        position table holds the sinusoids (:func:`sinusoids`)."""
        if not getattr(config, "sinusoidal_pos_embds", False):
            return model
        table = model.embeddings.position_embeddings
        values = jnp.asarray(sinusoids(*table.embeddings.shape), table.embeddings.dtype)
        return model.replace(embeddings=model.embeddings.replace(position_embeddings=table.replace(embeddings=values)))

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``dropout`` after the embeddings' LayerNorm and after ``lin2``, ``attention_dropout``
        on the attention weights, none after ``out_lin`` (``modeling_distilbert.py``)."""
        hidden = rate(config, "dropout")
        return {"embedding": hidden, "attention": rate(config, "attention_dropout"), "attention_output": 0.0,
                "mlp_output": hidden}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """A task checkpoint's body under ``distilbert.`` read as the model's; the embeddings'
        ``position_ids`` buffer (older files) dropped and LayerNorm's ``gamma`` / ``beta`` read
        as ``weight`` / ``bias``, as HF's loader does."""
        out = {k: v for k, v in weights.items() if not _BUFFER.fullmatch(k)}
        if any(k.startswith("distilbert.") for k in out) and not any(k.startswith("embeddings.") for k in out):
            out = renamed(out, lambda k: k.removeprefix("distilbert."), cls.hf_class)
        return renamed(out, _norm_name, cls.hf_class)
