"""GPT-NeoX (Pythia) as a functree model: Hugging Face's ``GPTNeoXForCausalLM`` (``gpt_neox``)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree._random import one_key
from functree.hf._causal import Block, CausalLM
from functree.hf._config import HFConfig
from functree.hf._dropout import rate
from functree.hf._family import renamed
from functree.hf._llama import rotary_names
from functree.hf._options import activation, require, rope
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack

__all__ = ["GPTNeoXForCausalLM", "GPTNeoXModel", "GPTNeoXLayer", "GPTNeoXMLP"]


class GPTNeoXMLP(Module):
    """``dense_4h_to_h(activation(dense_h_to_4h(x)))``."""

    dense_h_to_4h: Dense
    dense_4h_to_h: Dense

    def __init__(self, d: int, hidden: int, activation: Any, *, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.dense_h_to_4h = Dense(d, hidden, activation, key=k1, dtype=dtype)
        self.dense_4h_to_h = Dense(hidden, d, key=k2, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense_4h_to_h(self.dense_h_to_4h(x))


class GPTNeoXLayer(Block):
    """``x + attention(input_layernorm(x)) + mlp(post_attention_layernorm(x))`` (``parallel``;
    else sequential, as Llama)."""

    input_layernorm: LayerNorm
    post_attention_layernorm: LayerNorm
    attention: MultiheadAttention
    mlp: GPTNeoXMLP
    parallel: bool = field(static=True, default=True)

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, epsilon: float, rotary: RopeScaling,
                 use_bias: bool, parallel: bool, *, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2 = jax.random.split(one_key(key))
        self.input_layernorm = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.post_attention_layernorm = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.attention = MultiheadAttention(d, heads, rotary=rotary, causal=True, use_bias=use_bias,
                                            implementation=attention, key=k1, dtype=dtype)
        self.mlp = GPTNeoXMLP(d, hidden, activation, key=k2, dtype=dtype)
        self.parallel = bool(parallel)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.input_layernorm, self.attention, self.post_attention_layernorm, self.mlp


class GPTNeoXModel(Module):
    """GPT-NeoX's body: ``embed_in``, the blocks ``layers``, ``final_layer_norm``."""

    embed_in: Embedding
    layers: Stack
    final_layer_norm: LayerNorm

    def __init__(self, vocab: int, d: int, layers: int, make: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.embed_in = Embedding(vocab, d, key=k1, dtype=dtype)
        self.layers = Stack(make, layers, key=k2)
        self.final_layer_norm = LayerNorm(d, epsilon=epsilon, dtype=dtype)


class GPTNeoXForCausalLM(CausalLM):
    """Hugging Face's ``GPTNeoXForCausalLM`` (Pythia) as a functree model (:func:`ft.nn.from_hf`).

    Parallel residual blocks (:class:`GPTNeoXLayer`), rotary attention on the first
    ``partial_rotary_factor`` of each head (``RopeScaling(partial=...)``), a fused
    ``query_key_value`` with each head's q, k, v rows in turn; ``lm_head`` (older files:
    ``embed_out``; None when tied).
    """

    gpt_neox: GPTNeoXModel
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    model_type = "gpt_neox"
    hf_head = ("lm_head.weight", "gpt_neox.embed_in.weight")
    hf_layouts: ClassVar[dict[str, Any]] = {"gpt_neox.layers.*.attention": ("query_key_value", "dense", "per_head")}

    def __init__(self, vocab: int, d: int, heads: int, hidden: int, layers: int, *, activation: Any,
                 epsilon: float = 1e-5, rotary: RopeScaling, use_bias: bool = True, parallel: bool = True,
                 tied: bool = False, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2 = jax.random.split(one_key(key))

        def make(k: jax.Array) -> GPTNeoXLayer:
            return GPTNeoXLayer(d, heads, hidden, activation, epsilon, rotary, use_bias, parallel, key=k, dtype=dtype,
                                attention=attention)

        self.gpt_neox = GPTNeoXModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    def _tokens(self) -> Embedding:
        return self.gpt_neox.embed_in

    def _blocks(self) -> Stack:
        return self.gpt_neox.layers

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return self.gpt_neox.final_layer_norm(x)

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        c = config
        # HF's rotary reads head_dim, its attention hidden_size / heads: another head_dim
        # rotates another number of features than the heads have.
        if getattr(c, "head_dim", None) is not None:
            require(c, "head_dim", c.hidden_size // c.num_attention_heads, None)
        return cls(c.vocab_size, c.hidden_size, c.num_attention_heads, c.intermediate_size, c.num_hidden_layers,
                   activation=activation(c, "hidden_act"), epsilon=c.layer_norm_eps, rotary=rope(c, None, cls.hf_class),
                   use_bias=bool(getattr(c, "attention_bias", True)), parallel=bool(c.use_parallel_residual),
                   tied=bool(getattr(c, "tie_word_embeddings", False)), key=key, dtype=dtype, attention=attention)

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``hidden_dropout`` on the embedding (``emb_dropout``) and after the attention and the
        MLP (``post_attention_dropout``, ``post_mlp_dropout``), ``attention_dropout`` on the
        attention weights (``modeling_gpt_neox.py``)."""
        hidden = rate(config, "hidden_dropout")
        return {"embedding": hidden, "attention": rate(config, "attention_dropout"),
                "attention_output": hidden, "mlp_output": hidden}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """GPT-NeoX's head saved as ``embed_out`` (HF renames it ``lm_head``), its mask buffers
        dropped; a ``GPTNeoXModel``'s body (``embed_in.weight``, no ``gpt_neox.``) under
        ``gpt_neox.``, as HF's loader adds its base model's prefix. A rename onto a name the
        weights hold already is refused (:data:`~functree.hf._family.RENAME_COLLIDES`)."""
        weights = rotary_names(weights)
        if "embed_in.weight" in weights and "gpt_neox.embed_in.weight" not in weights:
            weights = renamed(weights, _body_name, cls.hf_class)
        return renamed(weights, _head_name, cls.hf_class)


def _body_name(key: str) -> str:
    return key if key.startswith(("gpt_neox.", "embed_out.", "lm_head.")) else "gpt_neox." + key


def _head_name(key: str) -> str:
    return "lm_head." + key[len("embed_out."):] if key.startswith("embed_out.") else key
