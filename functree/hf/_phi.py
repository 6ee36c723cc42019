"""Microsoft's Phi (``model_type: "phi"``: phi-1, phi-1_5, phi-2) as a functree model: Hugging
Face's ``PhiForCausalLM``.

Each block has one LayerNorm, ``input_layernorm``, whose output feeds the attention and the
MLP in parallel: ``x + attention(ln(x)) + mlp(ln(x))`` (the shared pre-norm block's
``parallel`` sum, GPT-NeoX's, with both norms the same layer). The attention is Llama's
grouped-query attention (:func:`functree.hf._llama.sublayers`) with biased ``q_proj``,
``k_proj``, ``v_proj`` and ``dense``, rotary on the first ``partial_rotary_factor`` of each
head (0.5 by default: ``RopeScaling(partial=...)``, any rope type of the shared rotary code)
and, with ``qk_layernorm``, a LayerNorm over each head's queries and keys before the rotation
(``q_layernorm`` / ``k_layernorm``: the attention's per-head ``q_norm`` / ``k_norm``). The
MLP is ``fc2(gelu_new(fc1(x)))`` (:class:`PhiMLP`), the body ends in ``final_layernorm`` and
``lm_head`` is biased. With ``tie_word_embeddings`` HF ties the head's weight alone: the
head is then a :class:`~functree.hf._causal.TiedBias`, ``x E^T + lm_head.bias``.

Dropout (``from_hf(..., dropout=True)``): ``embd_pdrop`` on the embedding, ``attention_dropout``
on the attention weights, ``resid_pdrop`` on the attention's and the MLP's outputs, as HF's
``PhiModel`` and ``PhiDecoderLayer`` apply them.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree._random import one_key
from functree.hf._causal import Block, CausalLM, TiedBias, lookup_rows
from functree.hf._config import HFConfig
from functree.hf._dropout import rate
from functree.hf._llama import key_value_heads, model_names, sublayers
from functree.hf._options import activation, rope
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack

__all__ = ["PhiForCausalLM", "PhiModel", "PhiDecoderLayer", "PhiMLP", "QK_LAYERNORM_HEAD_DIM"]

QK_LAYERNORM_HEAD_DIM = """\
ft.nn.from_hf: the phi config sets qk_layernorm=true with head_dim={head_dim}, but Hugging \
Face's PhiAttention builds q_layernorm and k_layernorm over hidden_size // \
num_attention_heads = {norm} features and applies them to heads of {head_dim} (its forward \
fails on the size mismatch), so no checkpoint has this model.

    wrong:  "qk_layernorm": true, "head_dim": {head_dim_json}
    right:  "qk_layernorm": true                 # no head_dim: hidden_size // num_attention_heads = {norm}
       or:  "qk_layernorm": false, "head_dim": {head_dim_json}
"""

_HEAD = ("lm_head.weight", "model.embed_tokens.weight")


class PhiMLP(Module):
    """``fc2(activation(fc1(x)))``, both biased (HF's ``PhiMLP``; ``gelu_new`` by default)."""

    fc1: Dense
    fc2: Dense

    def __init__(self, d: int, hidden: int, activation: Any, use_bias: bool = True, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.fc1 = Dense(d, hidden, activation, use_bias=use_bias, key=k1, dtype=dtype)
        self.fc2 = Dense(hidden, d, use_bias=use_bias, key=k2, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.fc1(x))


class PhiDecoderLayer(Block):
    """``x + self_attn(input_layernorm(x)) + mlp(input_layernorm(x))``: one norm, the two
    sublayers in parallel (HF's ``PhiDecoderLayer``; fields in its order)."""

    self_attn: MultiheadAttention
    mlp: PhiMLP
    input_layernorm: LayerNorm
    parallel: ClassVar[bool] = True  # Block's call: the attention and the MLP both read the norm of x

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any,
                 epsilon: float, rotary: RopeScaling, qk_layernorm: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        self.self_attn, self.mlp = sublayers(d, heads, kv_heads, head_dim, hidden, activation, epsilon, rotary,
                                             True, True, key, dtype, None, None, LayerNorm, PhiMLP, attention,
                                             "head" if qk_layernorm else None)
        self.input_layernorm = LayerNorm(d, epsilon=epsilon, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.input_layernorm, self.self_attn, self.input_layernorm, self.mlp


class PhiModel(Module):
    """Phi's body: ``embed_tokens``, the blocks ``layers``, ``final_layernorm``."""

    embed_tokens: Embedding
    layers: Stack
    final_layernorm: LayerNorm

    def __init__(self, vocab: int, d: int, layers: int, make: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.embed_tokens = Embedding(vocab, d, key=k1, dtype=dtype)
        self.layers = Stack(make, layers, key=k2)
        self.final_layernorm = LayerNorm(d, epsilon=epsilon, dtype=dtype)


class PhiForCausalLM(CausalLM):
    """Hugging Face's ``PhiForCausalLM`` (phi-1, phi-1_5, phi-2) as a functree model
    (:func:`ft.nn.from_hf`; module docstring).

    ``logits = lm_head(final_layernorm(layers(embed_tokens(ids))))``, ``lm_head`` a biased
    Dense, or with ``tie_word_embeddings`` a :class:`~functree.hf._causal.TiedBias` (the
    embedding's transpose and the head's own bias, as HF ties the weight alone).

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "phi", "vocab_size": 11, "hidden_size": 16, "intermediate_size": 32,
      ...           "num_hidden_layers": 2, "num_attention_heads": 2, "qk_layernorm": True}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> attention = model.model.layers.layers.self_attn
      >>> attention.rotary.partial, type(attention.q_norm).__name__, model.lm_head.bias.shape
      (0.5, 'LayerNorm', (11,))
      >>> model(np.zeros((1, 3), np.int32)).shape
      (1, 3, 11)
    """

    model: PhiModel
    lm_head: Dense | TiedBias
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    model_type = "phi"
    hf_head = _HEAD
    hf_padded = _HEAD[1]  # HF's embedding: padding_idx = pad_token_id
    hf_layouts: ClassVar[dict[str, Any]] = {"model.layers.*.self_attn": ("q_proj", "k_proj", "v_proj", "dense")}
    hf_rename: ClassVar[dict[str, str]] = {"model.layers.*.self_attn.q_layernorm": "model.layers.*.self_attn.q_norm",
                                           "model.layers.*.self_attn.k_layernorm": "model.layers.*.self_attn.k_norm"}

    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, hidden: int, layers: int, *,
                 head_dim: int | None = None, activation: Any, epsilon: float = 1e-5, rotary: RopeScaling,
                 qk_layernorm: bool = False, tied: bool = False, key: jax.Array, dtype: Any = jnp.float32,
                 attention: Any = "auto"):
        k1, k2 = jax.random.split(one_key(key))
        head_dim = d // heads if head_dim is None else head_dim

        def make(k: jax.Array) -> PhiDecoderLayer:
            return PhiDecoderLayer(d, heads, kv_heads, head_dim, hidden, activation, epsilon, rotary, qk_layernorm,
                                   key=k, dtype=dtype, attention=attention)

        self.model = PhiModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype)
        self.lm_head = TiedBias(vocab, dtype=dtype) if tied else Dense(d, vocab, key=k2, dtype=dtype)

    def _tokens(self) -> Embedding:
        return self.model.embed_tokens

    def _blocks(self) -> Stack:
        return self.model.layers

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.final_layernorm(x)

    def _embed(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        return lookup_rows(self.model.embed_tokens, ids, self._padding())

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        c = config
        kv = key_value_heads(c, cls.hf_class)
        norm_size = c.hidden_size // c.num_attention_heads  # HF's q/k LayerNorms' size, whatever head_dim
        head_dim = getattr(c, "head_dim", None) or norm_size
        qk_layernorm = bool(getattr(c, "qk_layernorm", False))
        if qk_layernorm and head_dim != norm_size:
            raise ValueError(QK_LAYERNORM_HEAD_DIM.format(head_dim=head_dim, norm=norm_size,
                                                          head_dim_json=json.dumps(head_dim)))
        return cls(c.vocab_size, c.hidden_size, c.num_attention_heads, kv, c.intermediate_size, c.num_hidden_layers,
                   head_dim=head_dim, activation=activation(c, "hidden_act"), epsilon=c.layer_norm_eps,
                   rotary=rope(c, None, cls.hf_class), qk_layernorm=qk_layernorm,
                   tied=bool(getattr(c, "tie_word_embeddings", False)), key=key, dtype=dtype, attention=attention)

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``embd_pdrop`` on the embedding, ``attention_dropout`` on the attention weights,
        ``resid_pdrop`` on the attention's and the MLP's outputs (``modeling_phi.py``)."""
        resid = rate(config, "resid_pdrop")
        return {"embedding": rate(config, "embd_pdrop"), "attention": rate(config, "attention_dropout"),
                "attention_output": resid, "mlp_output": resid}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Older files' rotary ``inv_freq`` buffers dropped; a ``PhiModel``'s body
        (``embed_tokens.weight``, no ``model.``) under ``model.``, as HF's loader adds its base
        model's prefix (Llama's names: :func:`~functree.hf._llama.model_names`)."""
        return model_names(weights, cls.hf_class)
