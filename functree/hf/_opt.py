"""OPT as a functree model: Hugging Face's ``OPTForCausalLM`` (``opt``)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree._random import one_key
from functree.hf._causal import Block, CausalLM, lookup_rows, post_norm
from functree.hf._config import HFConfig
from functree.hf._dropout import check_layerdrop, rate
from functree.hf._options import activation
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm
from functree.nn._stack import Stack

__all__ = ["OPTForCausalLM", "OPTModel", "OPTDecoder", "OPTDecoderLayer", "OPT_OFFSET"]


def _norm(d: int, affine: bool, dtype: Any) -> LayerNorm:
    """torch's ``nn.LayerNorm(d)``; ``affine=False`` (``layer_norm_elementwise_affine: false``)
    without weight or bias, as ``elementwise_affine=False``."""
    return LayerNorm(d, dtype=dtype) if affine else LayerNorm(d, use_scale=False, use_offset=False, dtype=dtype)


class OPTDecoderLayer(Block):
    """Pre-norm block: ``x + self_attn(self_attn_layer_norm(x))``, then
    ``x + fc2(relu(fc1(final_layer_norm(x))))``; with ``do_layer_norm_before=False``
    (OPT-350m) post-norm: ``self_attn_layer_norm(x + self_attn(x))``, then
    ``final_layer_norm(x + fc2(relu(fc1(x))))``."""

    # A static field added after checkpoints were written without it: read at its default.
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("do_layer_norm_before",)

    self_attn: MultiheadAttention
    self_attn_layer_norm: LayerNorm
    fc1: Dense
    fc2: Dense
    final_layer_norm: LayerNorm
    do_layer_norm_before: bool = field(static=True, default=True)

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, use_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto", pre_norm: bool = True, affine: bool = True):
        k1, k2, k3 = jax.random.split(one_key(key), 3)
        self.self_attn = MultiheadAttention(d, heads, causal=True, use_bias=use_bias, implementation=attention,
                                            key=k1, dtype=dtype)
        self.self_attn_layer_norm = _norm(d, affine, dtype)
        self.fc1 = Dense(d, hidden, activation, use_bias=use_bias, key=k2, dtype=dtype)
        self.fc2 = Dense(hidden, d, use_bias=use_bias, key=k3, dtype=dtype)
        self.final_layer_norm = _norm(d, affine, dtype)
        self.do_layer_norm_before = bool(pre_norm)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.self_attn_layer_norm, self.self_attn, self.final_layer_norm, lambda x: self.fc2(self.fc1(x))

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None,
                 rotary_positions: Any = None, key: jax.Array | None = None) -> Any:
        if self.do_layer_norm_before:
            return super().__call__(x, mask=mask, cache=cache, positions=positions, rotary_positions=rotary_positions,
                                    key=key)
        return post_norm(x, *self._parts(), mask, cache, positions, key)


class OPTDecoder(Module):
    """OPT's body: ``embed_tokens``, ``embed_positions`` (position ``p`` at row ``p + 2``), the
    blocks ``layers``, ``final_layer_norm`` (None: a post-norm OPT, or
    ``_remove_final_layer_norm``). Where ``word_embed_proj_dim`` (``e``) is not
    ``hidden_size`` (OPT-350m: 512 and 1024) the token embedding is ``[vocab, e]``,
    ``project_in`` maps it to ``hidden_size`` before the positions are added and
    ``project_out`` maps the blocks' output back to ``e`` for the head (both without bias;
    None otherwise)."""

    # Data fields added after checkpoints were written without them: read as None.
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("project_out", "project_in")

    embed_tokens: Embedding
    embed_positions: Embedding
    layers: Stack
    final_layer_norm: LayerNorm | None
    project_out: Dense | None = None
    project_in: Dense | None = None

    def __init__(self, vocab: int, positions: int, d: int, layers: int, make: Any, *, key: jax.Array,
                 dtype: Any = jnp.float32, projection: int | None = None, final_norm: bool = True,
                 affine: bool = True):
        k1, k2, k3, k4, k5 = jax.random.split(one_key(key), 5)
        e = d if projection is None else projection
        self.embed_tokens = Embedding(vocab, e, key=k1, dtype=dtype)
        self.embed_positions = Embedding(positions + OPT_OFFSET, d, key=k2, dtype=dtype)
        self.layers = Stack(make, layers, key=k3)
        self.final_layer_norm = _norm(d, affine, dtype) if final_norm else None
        projected = e != d
        self.project_out = Dense(d, e, use_bias=False, key=k4, dtype=dtype) if projected else None
        self.project_in = Dense(e, d, use_bias=False, key=k5, dtype=dtype) if projected else None


class OPTModel(Module):
    """``decoder`` (HF's module tree)."""

    decoder: OPTDecoder

    def __init__(self, decoder: OPTDecoder):
        self.decoder = decoder


OPT_OFFSET = 2  # OPT's learned positions start at row 2 of embed_positions


class OPTForCausalLM(CausalLM):
    """Hugging Face's ``OPTForCausalLM`` as a functree model (built by :func:`ft.nn.from_hf`).

    Learned positions (``cumsum(attention_mask) - 1``, row ``p + 2``; a padding token at
    -1, row 1, as HF's forward; more than
    ``max_position_embeddings`` tokens raise), pre-norm blocks (:class:`OPTDecoderLayer`;
    post-norm with ``pre_norm=False``: ``do_layer_norm_before: false``, OPT-350m, which has no
    final layer norm), a head tied to ``embed_tokens`` (``lm_head`` None) or not;
    ``projection`` (``word_embed_proj_dim``) other than ``d``: the embedding's width, with
    ``project_in`` / ``project_out`` (:class:`OPTDecoder`); ``affine=False``
    (``layer_norm_elementwise_affine: false``): layer norms without weight or bias.
    """

    model: OPTModel
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    model_type = "opt"
    hf_head = ("lm_head.weight", "model.decoder.embed_tokens.weight")
    hf_padded = "model.decoder.embed_tokens.weight"
    hf_layouts: ClassVar[dict[str, Any]] = {
        "model.decoder.layers.*.self_attn": ("q_proj", "k_proj", "v_proj", "out_proj")}
    rotates = False
    padding_position = -1  # HF's cumsum(mask) * mask - 1: a padding token reads row 1 of embed_positions

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *,
                 activation: Any, use_bias: bool = True, tied: bool = True, key: jax.Array, dtype: Any = jnp.float32,
                 attention: Any = "auto", pre_norm: bool = True, final_norm: bool = True,
                 projection: int | None = None, affine: bool = True):
        k1, k2 = jax.random.split(one_key(key))

        def make(k: jax.Array) -> OPTDecoderLayer:
            return OPTDecoderLayer(d, heads, hidden, activation, use_bias, key=k, dtype=dtype, attention=attention,
                                   pre_norm=pre_norm, affine=affine)

        self.model = OPTModel(OPTDecoder(vocab, positions, d, layers, make, key=k1, dtype=dtype,
                                         projection=projection, final_norm=pre_norm and final_norm, affine=affine))
        e = d if projection is None else projection
        self.lm_head = None if tied else Dense(e, vocab, use_bias=False, key=k2, dtype=dtype)

    @property
    def max_positions(self) -> int:
        """``max_position_embeddings`` (``ft.nn.generate`` refuses to go past it, counting each
        row's real tokens: left padding takes no position, HF's ``cumsum(mask) - 1``)."""
        return int(self.model.decoder.embed_positions.embeddings.shape[0]) - OPT_OFFSET

    def _tokens(self) -> Embedding:
        return self.model.decoder.embed_tokens

    def _blocks(self) -> Stack:
        return self.model.decoder.layers

    def _final_norm(self, x: jax.Array) -> jax.Array:
        m = self.model.decoder
        x = x if m.final_layer_norm is None else m.final_layer_norm(x)
        return x if m.project_out is None else m.project_out(x)

    def _embed(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        m = self.model.decoder
        tokens = lookup_rows(m.embed_tokens, ids, self._padding())
        tokens = tokens if m.project_in is None else m.project_in(tokens)
        return tokens + lookup_rows(m.embed_positions, real + OPT_OFFSET)

    def _limit(self) -> tuple[int, str] | None:
        return self.max_positions, "max_position_embeddings"

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        c = config
        projection = getattr(c, "word_embed_proj_dim", None) or c.hidden_size
        return cls(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads, c.ffn_dim,
                   c.num_hidden_layers, activation=activation(c, "activation_function"),
                   use_bias=bool(getattr(c, "enable_bias", True)), tied=bool(getattr(c, "tie_word_embeddings", True)),
                   key=key, dtype=dtype, attention=attention, pre_norm=bool(getattr(c, "do_layer_norm_before", True)),
                   final_norm=not getattr(c, "_remove_final_layer_norm", False), projection=int(projection),
                   affine=bool(getattr(c, "layer_norm_elementwise_affine", True)))

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``attention_dropout`` on the attention weights, ``dropout`` after ``self_attn`` and
        ``fc2`` (``modeling_opt.py``: no embedding dropout, ``activation_dropout`` not applied);
        ``layerdrop`` above 0 is refused."""
        check_layerdrop(config)
        hidden = rate(config, "dropout")
        return {"attention": rate(config, "attention_dropout"), "attention_output": hidden, "mlp_output": hidden}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """OPT saved without ``model.`` (``decoder.layers...``, as the hub's files)."""
        if any(k.startswith("decoder.") for k in weights) and not any(k.startswith("model.") for k in weights):
            return {("model." + k if k.startswith("decoder.") else k): v for k, v in weights.items()}
        return weights
