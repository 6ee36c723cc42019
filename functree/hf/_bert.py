"""BERT as a functree model: Hugging Face's ``BertModel`` (``bert``), an encoder (no cache)."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree._random import one_key
from functree._repr import first_index, short_array
from functree.hf._causal import (
    check_ids,
    check_length,
    lookup_rows,
    padding_mask,
    padding_row,
)
from functree.hf._config import HFConfig
from functree.hf._dropout import block_keys, drop, rate, top_keys
from functree.hf._family import HFModel, renamed
from functree.hf._options import activation, require
from functree.nn._attention import MultiheadAttention
from functree.nn._check import concrete as concrete_values
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm
from functree.nn._stack import Stack

__all__ = ["BertModel", "BertEmbeddings", "BertLayer", "BertEncoder", "BERT_RENAME"]

BAD_TOKEN_TYPES = """\
{model}: token_type_ids must be integer segment ids shaped like input_ids {shape}, each in \
[0, {types}) (type_vocab_size {types}); got {given}. Hugging Face raises here (IndexError); \
another id would read another segment's row.

    wrong:  model(ids, token_type_ids=jnp.full_like(ids, {types}))
    right:  model(ids, token_type_ids=jnp.zeros_like(ids))      # 0: the first segment, 1: the second
"""


# HF's names of BERT's sublayers that ft.nn names differently (``*``: the layer number).
BERT_RENAME = {
    "encoder.layer.*.attention.output.LayerNorm": "encoder.layer.*.attention_norm",
    "encoder.layer.*.intermediate.dense": "encoder.layer.*.intermediate",
    "encoder.layer.*.output.dense": "encoder.layer.*.output",
    "encoder.layer.*.output.LayerNorm": "encoder.layer.*.output_norm",
    "pooler.dense": "pooler",
}


_BERT_BUFFER = re.compile(r"(bert\.)?embeddings\.(position_ids|token_type_ids)")


class BertEmbeddings(Module):
    """``LayerNorm(word + position + token_type embeddings)``."""

    word_embeddings: Embedding
    position_embeddings: Embedding
    token_type_embeddings: Embedding
    LayerNorm: LayerNorm

    def __init__(self, vocab: int, positions: int, types: int, d: int, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(one_key(key), 3)
        self.word_embeddings = Embedding(vocab, d, key=k1, dtype=dtype)
        self.position_embeddings = Embedding(positions, d, key=k2, dtype=dtype)
        self.token_type_embeddings = Embedding(types, d, key=k3, dtype=dtype)
        self.LayerNorm = LayerNorm(d, epsilon=epsilon, dtype=dtype)


class BertLayer(Module):
    """Post-norm block: ``attention_norm(x + attention(x))``, then ``output_norm(x + output(intermediate(x)))``."""

    attention: MultiheadAttention
    attention_norm: LayerNorm
    intermediate: Dense
    output: Dense
    output_norm: LayerNorm

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2, k3 = jax.random.split(one_key(key), 3)
        self.attention = MultiheadAttention(d, heads, implementation=attention, key=k1, dtype=dtype)
        self.attention_norm = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.intermediate = Dense(d, hidden, activation, key=k2, dtype=dtype)
        self.output = Dense(hidden, d, key=k3, dtype=dtype)
        self.output_norm = LayerNorm(d, epsilon=epsilon, dtype=dtype)

    def __call__(self, x: jax.Array, *, mask: Any = None, key: jax.Array | None = None) -> jax.Array:
        keys = block_keys(self.attention, key)
        if keys is None:  # no dropout: today's computation, op for op
            x = self.attention_norm(x + self.attention(x, mask=mask))
            return self.output_norm(x + self.output(self.intermediate(x)))
        # HF's BertSelfOutput / BertOutput: dense, dropout, LayerNorm(h + input)
        rates = self.attention.rates  # type: ignore[attr-defined]  # a DropoutAttention (block_keys checked)
        x = self.attention_norm(x + drop(self.attention(x, mask=mask, key=keys[0]), rates[1], keys[1]))
        return self.output_norm(x + drop(self.output(self.intermediate(x)), rates[2], keys[2]))


class BertEncoder(Module):
    """The blocks, ``layer`` (a Stack)."""

    layer: Stack

    def __init__(self, layer: Stack):
        self.layer = layer


class BertModel(HFModel):
    """Hugging Face's ``BertModel`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``model(input_ids, attention_mask=None, token_type_ids=None)`` is the last hidden
    state ``[batch, T, hidden]`` (positions ``0..T-1``, as HF); ``pooler`` (None without
    one) gives HF's ``pooler_output`` as ``pooler(hidden[:, 0])``. Parameters keep HF's
    names but for :data:`BERT_RENAME` (:mod:`functree.hf._causal` for the layers' own).
    ``key=`` gives the dropout masks of a port built with ``dropout=True`` in training mode
    (:mod:`functree.hf._dropout`); else unused.
    """

    embeddings: BertEmbeddings
    encoder: BertEncoder
    pooler: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    model_type = "bert"
    hf_padded = "embeddings.word_embeddings.weight"
    hf_layouts: ClassVar[dict[str, Any]] = {
        "encoder.layer.*.attention": ("self.query", "self.key", "self.value", "output.dense")}
    hf_rename: ClassVar[dict[str, str]] = BERT_RENAME
    # BertForPreTraining's heads (bert-base-uncased's file, whose config names BertForMaskedLM): HF's
    # classes without them leave them unread
    hf_unread: ClassVar[tuple[str, ...]] = ("cls.predictions.", "cls.seq_relationship.", "bert.pooler.")

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *, types: int = 2,
                 activation: Any = None, epsilon: float = 1e-12, pooler: bool = True, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        from functree._activations import gelu_exact, tanh

        k1, k2, k3 = jax.random.split(one_key(key), 3)
        act = gelu_exact if activation is None else activation
        self.embeddings = BertEmbeddings(vocab, positions, types, d, epsilon, key=k1, dtype=dtype)
        self.encoder = BertEncoder(Stack(lambda k: BertLayer(d, heads, hidden, act, epsilon, key=k,
                                                                   dtype=dtype, attention=attention), layers, key=k2))
        self.pooler = Dense(d, d, tanh, key=k3, dtype=dtype) if pooler else None

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        e = self.embeddings
        ids = check_ids(self, input_ids, e.word_embeddings.embeddings.shape[0])
        mask, ids = padding_mask(self, ids, attention_mask, False)  # a traced mask's bad rows: ids -1, NaN rows
        x = self._embed(ids, token_type_ids)
        x = e.LayerNorm(x)
        extra: dict[str, Any] = {} if mask is None else {"mask": mask[:, None, None, :]}
        dropping = top_keys(self.encoder.layer, key)
        if dropping is not None:  # HF's dropout (opt-in): BertEmbeddings' after its LayerNorm
            x = drop(x, dropping[0], dropping[1])
            if dropping[2] is not None:
                extra["key"] = dropping[2]
        return self.encoder.layer(x, **extra)

    def _embed(self, ids: jax.Array, token_type_ids: Any) -> jax.Array:
        """The embeddings' sum before their LayerNorm: word, position ``0..T-1`` and segment
        rows (RoBERTa's positions: :meth:`functree.hf._roberta.RobertaModel._embed`)."""
        e = self.embeddings
        check_length(self, ids.shape[1], e.position_embeddings.embeddings.shape[0], "max_position_embeddings")
        types = _token_types(self, ids, token_type_ids, e.token_type_embeddings.embeddings.shape[0])
        pad = padding_row(self, e.word_embeddings.embeddings.shape[0])
        return (lookup_rows(e.word_embeddings, ids, pad) + e.position_embeddings(jnp.arange(ids.shape[1]))[None]
                + lookup_rows(e.token_type_embeddings, types))

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        c = config
        require(c, "position_embedding_type", "absolute", "absolute")
        require(c, "is_decoder", False, False)
        require(c, "add_cross_attention", False, False)
        return cls(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads, c.intermediate_size,
                   c.num_hidden_layers, types=c.type_vocab_size, activation=activation(c, "hidden_act"),
                   epsilon=c.layer_norm_eps, pooler="pooler.dense.weight" in names, key=key, dtype=dtype,
                   attention=attention)

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``hidden_dropout_prob`` after the embeddings' LayerNorm and each output's dense,
        ``attention_probs_dropout_prob`` on the attention weights (``modeling_bert.py``)."""
        hidden = rate(config, "hidden_dropout_prob")
        return {"embedding": hidden, "attention": rate(config, "attention_probs_dropout_prob"),
                "attention_output": hidden, "mlp_output": hidden}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """BERT saved with ``bert.`` and LayerNorm's ``gamma``/``beta``; the embeddings'
        ``position_ids`` / ``token_type_ids`` buffers (files of transformers 3.0-4.30) dropped,
        as HF's loader ignores them."""
        out = {k: v for k, v in weights.items() if not _BERT_BUFFER.fullmatch(k)}
        if any(k.startswith("bert.") for k in out) and not any(k.startswith("embeddings.") for k in out):
            out = renamed(out, _unprefixed, cls.hf_class)
        return renamed(out, _norm_name, cls.hf_class)  # a rename onto a held name: refused (RENAME_COLLIDES)


def _unprefixed(key: str) -> str:
    return key[len("bert."):] if key.startswith("bert.") else key


def _norm_name(key: str) -> str:
    """LayerNorm's TensorFlow-era ``gamma`` / ``beta`` as torch's ``weight`` / ``bias``."""
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))


def _token_types(model: Any, ids: jax.Array, token_type_ids: Any, types: int) -> jax.Array:
    """The segment ids (zeros when not given), checked: an integer array that broadcasts to
    ``ids``'s shape, and (when concrete) each id in ``[0, types)``. Traced ids out of range
    read NaN rows (:func:`lookup_rows`), never another segment's."""
    if token_type_ids is None:
        return jnp.zeros_like(ids)
    given = token_type_ids if isinstance(token_type_ids, jax.Array) else jnp.asarray(token_type_ids)

    def bad(what: str) -> ValueError:
        return ValueError(BAD_TOKEN_TYPES.format(model=type(model).__name__, shape=list(ids.shape), types=types,
                                                 given=what))

    try:
        shape_ok = jnp.broadcast_shapes(given.shape, ids.shape) == ids.shape
    except ValueError:
        shape_ok = False
    if not shape_ok or not jnp.issubdtype(given.dtype, jnp.integer):
        raise bad(short_array(given))
    concrete = concrete_values(token_type_ids)
    if concrete is not None and concrete.size:
        outside = (concrete < 0) | (concrete >= types)
        if outside.any():
            where = list(first_index(outside))
            raise bad(f"{int(concrete[tuple(where)])} at token_type_ids{where}")
    return jnp.broadcast_to(given, ids.shape)
