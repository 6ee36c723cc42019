"""Llama and the families built like it, each a subclass overriding its difference
(:meth:`LlamaForCausalLM.hf_options`): Qwen2 (biases, windows by layer type), Mistral (sliding
window), Gemma (norm, embedding scale), Phi-3 (fused projections, partial rotary), OLMo
(parameter-free LayerNorm), Qwen3 (Qwen2's windows, RMSNorm over each head's queries and
keys), OLMo2 (norms after the sublayers, RMSNorm over the whole q and k projections), Gemma 2
(Gemma's with sandwich norms, soft-capped attention and final logits, alternating windows),
Gemma 3 (Gemma 2's blocks, Qwen3's per-head q/k norms, each layer type its own rope)."""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree._random import one_key
from functree.hf._causal import (
    Block,
    CausalLM,
    check_longrope,
    longrope_crossing,
    lookup_rows,
    with_member_values,
)
from functree.hf._config import HFConfig
from functree.hf._dropout import block_keys, decoding, drop, rate
from functree.hf._family import renamed
from functree.hf._options import activation, layer_type_ropes, require, rope, window
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm, RMSNorm, statistics_dtype
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack

__all__ = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM", "Phi3ForCausalLM",
           "OlmoForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
           "LlamaModel",
           "LlamaDecoderLayer", "Olmo2DecoderLayer", "Gemma2DecoderLayer", "soft_cap", "LlamaMLP", "Phi3MLP", "GemmaRMSNorm", "rotary_names", "sandwich_outputs", "key_value_heads", "sublayers", "model_names"]

KV_HEADS = """\
ft.nn.from_hf: the {model_type} config has num_attention_heads={heads} and \
num_key_value_heads={kv} (the config's, or the family's default where it gives none): each key/value head serves num_attention_heads / \
num_key_value_heads query heads, so the second must divide the first (Hugging Face's \
{hf_class} fails on this config too).

    wrong:  "num_attention_heads": {heads}, "num_key_value_heads": {kv}
    right:  "num_key_value_heads": {fix}     # a divisor of {heads}: the checkpoint's own (1: multi-query)
"""

SOFTCAP = """\
ft.nn.from_hf: the {model_type} config sets {option}={value!r}; a soft-cap c maps logits l to \
c * tanh(l / c), so c must be a positive finite number (or null: no cap). Hugging Face's \
{hf_class} would compute {outcome} with this value.

    wrong:  "{option}": {value_json}
    right:  "{option}": {example}     # the checkpoint's own (null: uncapped)
"""

QUERY_SCALAR = """\
ft.nn.from_hf: the {model_type} config sets query_pre_attn_scalar={value!r}; the attention \
logits are scaled by query_pre_attn_scalar ** -0.5, so it must be a positive finite number \
(Hugging Face's {hf_class} would compute {outcome}).

    wrong:  "query_pre_attn_scalar": {value_json}
    right:  "query_pre_attn_scalar": {example}     # the checkpoint's own: its head_dim for Gemma 2's 2B and 9B
"""

_LLAMA_HEAD = ("lm_head.weight", "model.embed_tokens.weight")
Rotary = RopeScaling | tuple[RopeScaling, ...]  # one rope, or one per layer type (each member's member_rope picks)
_ROTARY_BUFFER = re.compile(r".*\.rotary_emb\.inv_freq|.*\.attention\.(bias|masked_bias)")


def key_value_heads(config: Any, hf_class: str) -> int:
    """The config's key/value heads (``num_key_value_heads``, else one per query head): a
    divisor of ``num_attention_heads`` (else :data:`KV_HEADS`)."""
    kv = config.num_key_value_heads or config.num_attention_heads
    if kv <= 0 or config.num_attention_heads % kv:
        raise ValueError(KV_HEADS.format(model_type=config.model_type, heads=config.num_attention_heads, kv=kv,
                                         hf_class=hf_class, fix=config.num_attention_heads))
    return kv


def rotary_names(weights: dict[str, Any]) -> dict[str, Any]:
    """Older files' rotary ``inv_freq`` and GPT-NeoX's mask buffers dropped (HF's loader ignores them)."""
    return {k: v for k, v in weights.items() if not _ROTARY_BUFFER.fullmatch(k)}


def _body_name(key: str) -> str:
    return key if key.startswith(("model.", "lm_head.")) else "model." + key


class LlamaMLP(Module):
    """SwiGLU: ``down_proj(activation(gate_proj(x)) * up_proj(x))``."""

    gate_proj: Dense
    up_proj: Dense
    down_proj: Dense

    def __init__(self, d: int, hidden: int, activation: Any, use_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(one_key(key), 3)
        self.gate_proj = Dense(d, hidden, activation, use_bias=use_bias, key=k1, dtype=dtype)
        self.up_proj = Dense(d, hidden, use_bias=use_bias, key=k2, dtype=dtype)
        self.down_proj = Dense(hidden, d, use_bias=use_bias, key=k3, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class Phi3MLP(Module):
    """Phi-3's SwiGLU with the gate and up projections in one: ``[gate | up] = gate_up_proj(x)``,
    ``down_proj(activation(gate) * up)``."""

    gate_up_proj: Dense
    down_proj: Dense
    activation: Any = field(static=True, default=None)

    def __init__(self, d: int, hidden: int, activation: Any, use_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.gate_up_proj = Dense(d, 2 * hidden, use_bias=use_bias, key=k1, dtype=dtype)
        self.down_proj = Dense(hidden, d, use_bias=use_bias, key=k2, dtype=dtype)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.activation(gate) * up)


class GemmaRMSNorm(Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32 (HF's ``weight`` starts at 0)."""

    weight: jax.Array = field(decay=False)  # a norm's weight: no weight decay (HF's Trainer and torch recipes)
    epsilon: float = field(static=True, default=1e-6)

    def __init__(self, d: int, *, epsilon: float = 1e-6, dtype: Any = jnp.float32):
        self.weight, self.epsilon = jnp.zeros((d,), dtype), float(epsilon)

    def __call__(self, x: jax.Array) -> jax.Array:
        xs = x.astype(jnp.float32)
        y = xs * jax.lax.rsqrt(jnp.mean(jnp.square(xs), axis=-1, keepdims=True) + jnp.float32(self.epsilon))
        return (y * jax.lax.broadcast_to_rank(1.0 + self.weight.astype(jnp.float32), y.ndim)).astype(x.dtype)


def _self_attention(d: int, heads: int, kv_heads: int, head_dim: int, epsilon: float, rotary: Rotary,
                    attention_bias: bool, *, key: jax.Array, output_key: jax.Array, dtype: Any,
                    output_bias: bool | None, window: int | None, norm: Any, attention: Any,
                    qk_norm: str | None) -> MultiheadAttention:
    """A Llama-like block's ``self_attn``: rotary grouped-query attention, biased as the
    family's config says; ``qk_norm`` ("head": Qwen3, "projection": OLMo2) adds ``norm``
    layers over the queries and keys (:class:`~functree.nn.MultiheadAttention`'s ``q_norm``)."""
    attn = MultiheadAttention(d, heads, num_kv_heads=kv_heads, qk_size=head_dim, vo_size=head_dim, rotary=rotary,
                              causal=True, use_bias=attention_bias, window=window, implementation=attention,
                              key=key, dtype=dtype)
    if output_bias is not None and output_bias != attention_bias:  # Qwen2: biased q, k, v; o_proj without
        attn = attn.replace(output_projection=Dense(heads * head_dim, d, use_bias=output_bias, key=output_key,
                                                    dtype=dtype))
    if qk_norm is not None:
        per_head = qk_norm == "head"
        q_size, k_size = (head_dim, head_dim) if per_head else (heads * head_dim, kv_heads * head_dim)
        attn = attn.replace(q_norm=norm(q_size, epsilon=epsilon, dtype=dtype),
                            k_norm=norm(k_size, epsilon=epsilon, dtype=dtype), qk_norm_per_head=per_head)
    return attn


def sublayers(d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any, epsilon: float,
              rotary: Rotary, attention_bias: bool, mlp_bias: bool, key: jax.Array, dtype: Any,
              output_bias: bool | None, window: int | None, norm: Any, mlp: Any, attention: Any,
              qk_norm: str | None) -> tuple[MultiheadAttention, Any]:
    """A decoder block's attention and MLP (every block class of this module builds them alike,
    and Phi's, :mod:`functree.hf._phi`; the key split is the checkpoints' and HF
    initialization's: attention, MLP, output projection)."""
    k1, k2, k3 = jax.random.split(one_key(key), 3)
    attn = _self_attention(d, heads, kv_heads, head_dim, epsilon, rotary, attention_bias, key=k1, output_key=k3,
                           dtype=dtype, output_bias=output_bias, window=window, norm=norm, attention=attention,
                           qk_norm=qk_norm)
    return attn, mlp(d, hidden, activation, mlp_bias, key=k2, dtype=dtype)


class LlamaDecoderLayer(Block):
    """Pre-norm block with RMSNorm, rotary grouped-query attention and a SwiGLU MLP."""

    input_layernorm: Any
    self_attn: MultiheadAttention
    post_attention_layernorm: Any
    mlp: Any

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any,
                 epsilon: float, rotary: Rotary, attention_bias: bool, mlp_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, output_bias: bool | None = None, window: int | None = None,
                 norm: Any = RMSNorm, mlp: Any = LlamaMLP, attention: Any = "auto", qk_norm: str | None = None):
        self.input_layernorm = norm(d, epsilon=epsilon, dtype=dtype)
        self.self_attn, self.mlp = sublayers(d, heads, kv_heads, head_dim, hidden, activation, epsilon, rotary,
                                             attention_bias, mlp_bias, key, dtype, output_bias, window, norm, mlp,
                                             attention, qk_norm)
        self.post_attention_layernorm = norm(d, epsilon=epsilon, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp


class Olmo2DecoderLayer(Block):
    """OLMo2's block: no input norm; each sublayer's output normalized before its residual
    sum, ``x = x + post_attention_layernorm(self_attn(x))``, then ``x = x +
    post_feedforward_layernorm(mlp(x))`` (HF's ``Olmo2DecoderLayer``); the attention's
    queries and keys RMS-normalized over their whole projections (``qk_norm="projection"``)."""

    self_attn: MultiheadAttention
    mlp: Any
    post_attention_layernorm: Any
    post_feedforward_layernorm: Any

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any,
                 epsilon: float, rotary: Rotary, attention_bias: bool, mlp_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, output_bias: bool | None = None, window: int | None = None,
                 norm: Any = RMSNorm, mlp: Any = LlamaMLP, attention: Any = "auto", qk_norm: str | None = None):
        self.self_attn, self.mlp = sublayers(d, heads, kv_heads, head_dim, hidden, activation, epsilon, rotary,
                                             attention_bias, mlp_bias, key, dtype, output_bias, window, norm, mlp,
                                             attention, qk_norm)
        self.post_attention_layernorm = norm(d, epsilon=epsilon, dtype=dtype)
        self.post_feedforward_layernorm = norm(d, epsilon=epsilon, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.post_attention_layernorm, self.self_attn, self.post_feedforward_layernorm, self.mlp

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None,
                 rotary_positions: Any = None, key: jax.Array | None = None) -> Any:
        norms = (_as_is, self.post_attention_layernorm, _as_is, self.post_feedforward_layernorm)  # outputs only
        return sandwich_outputs(x, norms, self.self_attn, self.mlp, mask, cache, positions, rotary_positions, key)


def _as_is(x: jax.Array) -> jax.Array:
    """No norm: OLMo2's sublayers read their inputs as they are (:func:`sandwich_outputs`)."""
    return x


class Gemma2DecoderLayer(Block):
    """Gemma 2's block, "sandwich" norms: each sublayer's input and output normalized,
    ``x = x + post_attention_layernorm(self_attn(input_layernorm(x)))``, then ``x = x +
    post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (HF's ``Gemma2DecoderLayer``;
    fields in its order)."""

    self_attn: MultiheadAttention
    mlp: Any
    input_layernorm: Any
    post_attention_layernorm: Any
    pre_feedforward_layernorm: Any
    post_feedforward_layernorm: Any

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any,
                 epsilon: float, rotary: Rotary, attention_bias: bool, mlp_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, output_bias: bool | None = None, window: int | None = None,
                 norm: Any = RMSNorm, mlp: Any = LlamaMLP, attention: Any = "auto", qk_norm: str | None = None):
        self.self_attn, self.mlp = sublayers(d, heads, kv_heads, head_dim, hidden, activation, epsilon, rotary,
                                             attention_bias, mlp_bias, key, dtype, output_bias, window, norm, mlp,
                                             attention, qk_norm)
        self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm, \
            self.post_feedforward_layernorm = (norm(d, epsilon=epsilon, dtype=dtype) for _ in range(4))

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.input_layernorm, self.self_attn, self.pre_feedforward_layernorm, self.mlp

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None,
                 rotary_positions: Any = None, key: jax.Array | None = None) -> Any:
        sandwich = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                    self.post_feedforward_layernorm)
        return sandwich_outputs(x, sandwich, self.self_attn, self.mlp, mask, cache, positions, rotary_positions, key)


def sandwich_outputs(x: jax.Array, norms: tuple[Any, Any, Any, Any], attention: MultiheadAttention, mlp: Any,
                     mask: Any, cache: Any, positions: Any, rotary_positions: Any = None,
                     key: jax.Array | None = None) -> Any:
    """One block whose sublayers' inputs and outputs are normalized (Gemma 2; OLMo2 its outputs
    only, ``n1`` and ``n3`` the identity): with ``norms`` ``(n1, n2, n3, n4)``, ``x +
    n2(attention(n1(x)))``, then ``x + n4(mlp(n3(x)))``; with a cache, ``(x, cache)``. With
    HF's dropout (``dropout=True``, training mode) the attention weights drop as HF's; the
    sublayers' outputs at their block's rates (OLMo2's and Gemma 2's are 0)."""
    n1, n2, n3, n4 = norms
    extra = {} if rotary_positions is None else {"rotary_positions": rotary_positions}
    keys = block_keys(attention, key) if cache is None else None  # decoding with a cache never drops
    if keys is None:
        attention = decoding(attention) if cache is not None else attention
        out = attention(n1(x), mask=mask, cache=cache, positions=positions, **extra)
        h, cache = (out, None) if cache is None else out
        x = x + n2(h)
        x = x + n4(mlp(n3(x)))
        return x if cache is None else (x, cache)
    rates = attention.rates  # type: ignore[attr-defined]  # a DropoutAttention (block_keys checked)
    h = attention(n1(x), mask=mask, cache=None, positions=positions, key=keys[0], **extra)
    x = x + drop(n2(h), rates[1], keys[1])
    return x + drop(n4(mlp(n3(x))), rates[2], keys[2])


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(x / cap)`` computed in float32 (or wider), in ``x``'s dtype: a smooth
    clamp to ``(-cap, cap)``, slope 1 at 0 (Gemma 2's final logits)."""
    wide = statistics_dtype(x.dtype)  # float32, float64 for float64 (strict promotion allows no promote_types)
    c = jnp.asarray(cap, wide)
    return (c * jnp.tanh(x.astype(wide) / c)).astype(x.dtype)


class LlamaModel(Module):
    """Llama's body: ``embed_tokens``, the blocks ``layers``, the final ``norm`` (Gemma: the
    embedding times ``embed_scale``, sqrt(hidden_size) in the embedding's dtype)."""

    embed_tokens: Embedding
    layers: Stack
    norm: Any
    embed_scale: float | None = field(static=True, default=None)

    def __init__(self, vocab: int, d: int, layers: int, make: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32, norm: Any = RMSNorm, embed_scale: float | None = None):
        k1, k2 = jax.random.split(one_key(key))
        self.embed_tokens = Embedding(vocab, d, key=k1, dtype=dtype)
        self.layers = Stack(make, layers, key=k2)
        self.norm = norm(d, epsilon=epsilon, dtype=dtype)
        self.embed_scale = embed_scale

    def embed(self, ids: jax.Array, padding: int | None = None) -> jax.Array:
        x = lookup_rows(self.embed_tokens, ids, padding)
        return x if self.embed_scale is None else x * jnp.asarray(self.embed_scale, x.dtype)




def _with_layer_options(model: LlamaModel, windows: tuple[int, ...] | None, clip: float | None,
                        query_scale: float | None = None, softcap: float | None = None,
                        ropes: tuple[int, ...] | None = None) -> LlamaModel:
    """``model`` with its layers' attention options: one window per layer (``member_window``,
    int32, 0: full attention), one logit factor per layer (``logit_scale``, float32, float64
    for float64 weights: Gemma 2's ``query_pre_attn_scalar ** -0.5``, HF's Python float), one rope per layer (``member_rope``, int32: the entry
    of the attention's tuple ``rotary``, Gemma 3's), the ``clip`` and the logit ``softcap`` of
    every layer; none given: ``model`` itself."""
    layers = model.layers
    if windows is not None:
        layers = with_member_values(layers, "self_attn", member_window=jnp.asarray(windows, jnp.int32))
    if ropes is not None:
        layers = with_member_values(layers, "self_attn", member_rope=jnp.asarray(ropes, jnp.int32))
    if query_scale is not None:
        wide = statistics_dtype(model.embed_tokens.embeddings.dtype)
        layers = with_member_values(layers, "self_attn", logit_scale=jnp.full((layers.n,), query_scale, wide))
    if clip is not None or softcap is not None:
        block = layers.layers
        static = {"clip": None if clip is None else float(clip), "logit_softcap": None if softcap is None else float(softcap)}
        attention = block.self_attn.replace(**{k: v for k, v in static.items() if v is not None})
        layers = layers.replace(layers=block.replace(self_attn=attention))
    return model if layers is model.layers else model.replace(layers=layers)


class LlamaForCausalLM(CausalLM):
    """Hugging Face's ``LlamaForCausalLM`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``logits = lm_head(norm(layers(embed_tokens(ids))))``; ``lm_head`` is None for a head
    tied to the embedding (``x E^T``). Queries and keys are rotated at HF's positions
    (``cumsum(attention_mask) - 1`` in a left-padded row, with or without a cache: dynamic
    NTK rope equals HF's too). Parameters keep HF's names (:mod:`functree.hf._causal` for the layers'
    own). The options cover the families built like Llama: ``output_bias`` (Qwen2's biased
    q/k/v and unbiased o_proj), ``window`` (sliding-window attention: Mistral, Qwen2, Phi-3),
    ``norm`` and ``embed_scale`` (Gemma), ``mlp`` (Phi-3's fused ``gate_up_proj``),
    ``epsilon`` (the norms'; the config's ``rms_norm_eps`` unless ``hf_options`` gives it),
    ``windows`` (one sliding window per layer, 0 for full attention: Qwen2's mixed layers,
    each attention's ``member_window``), ``clip`` (OLMo's ``clip_qkv``: the attention's ``clip``),
    ``qk_norm`` (RMSNorm over each head's queries and keys, ``"head"``: Qwen3; over the whole
    q and k projections, ``"projection"``: OLMo2), ``layer`` (the block's class: OLMo2's
    :class:`Olmo2DecoderLayer`, its norms after the sublayers; Gemma 2's
    :class:`Gemma2DecoderLayer`), ``query_scale`` (the attention logits' factor in place of
    ``1 / sqrt(head_dim)``: each attention's ``logit_scale``), ``attention_softcap`` (the
    attention's ``logit_softcap``: ``c * tanh(l / c)`` on its logits), ``ropes`` (with a
    tuple ``rotary``, each layer's entry of it: Gemma 3's, each attention's ``member_rope``).
    """

    model: LlamaModel
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    model_type = "llama"
    hf_head = _LLAMA_HEAD
    hf_padded = _LLAMA_HEAD[1]
    hf_layouts: ClassVar[dict[str, Any]] = {"model.layers.*.self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}
    # The config's bias switches this HF class reads (Mistral, Qwen2 and Phi-3 fix their
    # biases whatever the config says, and a file saved from them has none).
    hf_biases: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")

    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, hidden: int, layers: int, *,
                 head_dim: int | None = None, activation: Any = None, epsilon: float = 1e-6,
                 rotary: Rotary | None = None, attention_bias: bool = False, mlp_bias: bool = False,
                 tied: bool = False, key: jax.Array, dtype: Any = jnp.float32, output_bias: bool | None = None,
                 window: int | None = None, norm: Any = RMSNorm, mlp: Any = LlamaMLP,
                 embed_scale: float | None = None, attention: Any = "auto", windows: tuple[int, ...] | None = None,
                 clip: float | None = None, qk_norm: str | None = None, layer: Any = LlamaDecoderLayer,
                 query_scale: float | None = None, attention_softcap: float | None = None,
                 ropes: tuple[int, ...] | None = None):
        from functree._activations import silu

        k1, k2 = jax.random.split(one_key(key))
        head_dim = d // heads if head_dim is None else head_dim
        rotary = RopeScaling() if rotary is None else rotary
        act = silu if activation is None else activation

        def make(k: jax.Array) -> Any:
            return layer(d, heads, kv_heads, head_dim, hidden, act, epsilon, rotary, attention_bias, mlp_bias, key=k,
                         dtype=dtype, output_bias=output_bias, window=window, norm=norm, mlp=mlp, attention=attention,
                         qk_norm=qk_norm)

        model = LlamaModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype, norm=norm, embed_scale=embed_scale)
        self.model = _with_layer_options(model, windows, clip, query_scale, attention_softcap, ropes)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    def _tokens(self) -> Embedding:
        return self.model.embed_tokens

    def _blocks(self) -> Stack:
        return self.model.layers

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.norm(x)

    def _embed(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        return self.model.embed(ids, self._padding())

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        """How this family differs from Llama: keyword arguments of :class:`LlamaForCausalLM`
        read from the config (``rotary`` given here replaces the whole-head rope)."""
        return {}

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        c = config
        kv = key_value_heads(c, cls.hf_class)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        biases = {name: name in cls.hf_biases and bool(getattr(c, name, False)) for name in ("attention_bias", "mlp_bias")}
        options = {**biases, **cls.hf_options(c)}
        if "rotary" not in options:  # Llama rotates the whole head (hf.rope's head_dim)
            options["rotary"] = rope(c, head_dim, cls.hf_class)
        if "epsilon" not in options:  # a family whose config has no rms_norm_eps gives its own (OLMo)
            options["epsilon"] = c.rms_norm_eps
        if "activation" not in options:  # a family whose config names it otherwise gives it (Gemma 2)
            options["activation"] = activation(c, "hidden_act")
        return cls(c.vocab_size, c.hidden_size, c.num_attention_heads, kv,
                   c.intermediate_size, c.num_hidden_layers, head_dim=head_dim,
                   tied=bool(getattr(c, "tie_word_embeddings", False)), key=key, dtype=dtype, attention=attention,
                   **options)

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        """Each layer's sliding window where the config's layers differ (Qwen2's ``windows``),
        logit factor (Gemma 2's ``query_scale``) and rope (Gemma 3's ``ropes``): the data
        fields a state dict has none of."""
        options = cls.hf_options(config)
        windows, scale, ropes = options.get("windows"), options.get("query_scale"), options.get("ropes")
        if windows is None and scale is None and ropes is None:
            return model
        return model.replace(model=_with_layer_options(model.model, windows, None, scale, ropes=ropes))

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``attention_dropout`` on the attention weights, the only dropout of Llama, Mistral,
        Qwen2 and Gemma (their ``modeling_*.py``)."""
        return {"attention": rate(config, "attention_dropout")}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Older files' rotary ``inv_freq`` buffers dropped (HF's loader ignores them); a
        base model's body (``LlamaModel``: ``embed_tokens.weight``, no ``model.``) under
        ``model.``, as HF's loader adds its base model's prefix (a rename onto a name the
        weights hold already refused: :data:`~functree.hf._family.RENAME_COLLIDES`)."""
        return model_names(weights, cls.hf_class)


def model_names(weights: dict[str, Any], hf_class: str) -> dict[str, Any]:
    """A causal LM whose body is ``model``'s checkpoint names (Llama's, Phi's): older files'
    rotary buffers dropped, a base model's body (``embed_tokens.weight``) under ``model.``."""
    weights = rotary_names(weights)
    if "embed_tokens.weight" in weights and "model.embed_tokens.weight" not in weights:
        weights = renamed(weights, _body_name, hf_class)
    return weights


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5): Llama with biased q/k/v projections
    (an unbiased ``o_proj``), sliding windows where the config's ``layer_types`` set them: the
    attention's static ``window`` where every layer slides, one window per layer where they
    mix (``use_sliding_window`` with ``max_window_layers`` above 0: the first layers full),
    held as each member's ``member_window``."""

    model_type = "qwen2"
    hf_biases = ()

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        sizes = window(config, layer_types=True)
        windows = {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}
        return {"attention_bias": True, "output_bias": False, **windows}


class MistralForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``MistralForCausalLM``: Llama with sliding-window attention (``window``:
    the config's ``sliding_window``, in the forward and in the KV cache's mask).

    A ``config.json`` (or its dict) with ``layer_types`` is read as transformers'
    ``AutoConfig`` reads it: as Ministral's, each layer its type's mask (HF's
    ``MinistralForCausalLM``: the same weights, the window on ``"sliding_attention"`` layers
    only; where the types mix, one window per layer, each member's ``member_window``, as
    Qwen2's). HF's own ``MistralConfig`` object keeps the key but its ``MistralForCausalLM``
    ignores it (every layer slides), so that config builds Mistral's one window."""

    model_type = "mistral"
    hf_biases = ()

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        if type(config).__name__ == "MistralConfig" or getattr(config, "layer_types", None) is None:
            return {"window": window(config)}
        sizes = window(config, layer_types=True)  # AutoConfig: "treating as ministral"
        return {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}


class MinistralForCausalLM(MistralForCausalLM):
    """Hugging Face's ``MinistralForCausalLM`` (``model_type: "ministral"``): Mistral's
    weights, each layer its ``layer_types`` entry's mask, always (``MinistralConfig``
    defaults them from ``sliding_window``: every layer sliding, or every layer full where the
    window is null). Where the types mix, one window per layer (each member's
    ``member_window``); ``save_hf`` writes ``"model_type": "ministral"`` back."""

    model_type = "ministral"

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        sizes = window(config, layer_types=True)
        return {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}


class GemmaForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``GemmaForCausalLM``: Llama with ``GemmaRMSNorm`` (``1 + weight``), the
    embedding scaled by sqrt(hidden_size), GeGLU (the config's tanh GELU) and a tied head."""

    model_type = "gemma"
    hf_biases = ("attention_bias",)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        if getattr(config, "use_bidirectional_attention", None):  # HF's sdpa then attends both ways
            require(config, "use_bidirectional_attention", False, False)
        return {"norm": GemmaRMSNorm, "embed_scale": float(config.hidden_size) ** 0.5}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Phi3ForCausalLM``: Llama with fused ``qkv_proj`` and ``gate_up_proj``
    (:class:`Phi3MLP`), rotary on the first ``partial_rotary_factor`` of each head and sliding
    windows as the config sets them."""

    model_type = "phi3"
    hf_biases = ()
    hf_layouts: ClassVar[dict[str, Any]] = {"model.layers.*.self_attn": ("qkv_proj", "o_proj")}

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        return {"mlp": Phi3MLP, "window": window(config), "rotary": rope(config, None, cls.hf_class)}

    def _check_call(self, input_ids: Any, cache: Any) -> None:
        check_longrope(self, self.model.layers.layers.self_attn, input_ids, cache)

    def check_generation(self, prompt_length: int, new_tokens: int) -> None:
        """Phi-3's longrope: a generation whose prompt uses the short factors and whose new
        tokens pass ``original_max_position_embeddings`` raises (HF's ``generate`` recomputes
        its cache there; :func:`~functree.hf._causal.longrope_crossing`). A one-token prompt
        included: its prefill is a call of one token, which the call's own check lets pass.
        Phi-3's alone: HF's other families (a Llama config with longrope rope) keep their
        cache across the switch, as a KV cache does, so they generate as HF's."""
        rotary = self.model.layers.layers.self_attn.rotary
        longrope_crossing(self, rotary, prompt_length, prompt_length + new_tokens)

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``attention_dropout`` on the attention weights, ``resid_pdrop`` after the attention
        and the MLP (``resid_attn_dropout``, ``resid_mlp_dropout``); HF's Phi-3 does not apply
        its config's ``embd_pdrop`` (``modeling_phi3.py``), nor does this."""
        resid = rate(config, "resid_pdrop")
        return {"attention": rate(config, "attention_dropout"), "attention_output": resid, "mlp_output": resid}


class OlmoForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``OlmoForCausalLM`` (OLMo): Llama with a parameter-free LayerNorm,
    ``(x - mean(x)) / sqrt(var(x) + 1e-5)`` in float32 (HF's ``OlmoLayerNorm``: no weight, no
    bias, its epsilon fixed: the config has no norm epsilon); ``clip_qkv`` clamps the q, k, v
    projections' outputs to ``[-clip_qkv, clip_qkv]`` before the rotation, as HF's
    ``OlmoAttention`` (the attention's static ``clip``)."""

    model_type = "olmo"
    hf_biases = ("attention_bias",)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        clip = getattr(config, "clip_qkv", None)
        return {"norm": functools.partial(LayerNorm, use_scale=False, use_offset=False), "epsilon": 1e-5,
                **({} if clip is None else {"clip": float(clip)})}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Qwen3ForCausalLM``: Llama with an RMSNorm over each head's queries and
    keys (``self_attn.q_norm`` / ``k_norm``, of size ``head_dim``, before the rotation), every
    attention projection biased or none (``attention_bias``: ``o_proj`` too, unlike Qwen2) and
    Qwen2's sliding windows (``use_sliding_window``; one window per layer where
    ``layer_types`` mix: each member's ``member_window``)."""

    model_type = "qwen3"
    hf_biases = ("attention_bias",)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        # HF's Qwen3Config drops sliding_window unless use_sliding_window (an older one kept it)
        sizes = window(config, layer_types=True, enabled=bool(getattr(config, "use_sliding_window", False)))
        windows = {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}
        return {"qk_norm": "head", **windows}


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Olmo2ForCausalLM`` (OLMo 2): Llama whose blocks normalize their
    sublayers' outputs instead of their inputs (:class:`Olmo2DecoderLayer`: no
    ``input_layernorm``; ``post_attention_layernorm`` and ``post_feedforward_layernorm``
    applied before the residual sums), with an RMSNorm over the whole query and key
    projections (``q_norm`` of size heads * head_dim, ``k_norm`` kv_heads * head_dim) before
    they are split into heads and rotated; every attention projection biased or none."""

    model_type = "olmo2"
    hf_biases = ("attention_bias",)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        return {"qk_norm": "projection", "layer": Olmo2DecoderLayer}


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Hugging Face's ``Gemma2ForCausalLM`` (Gemma 2): Gemma (``1 + weight`` RMSNorm, the
    embedding scaled by sqrt(hidden_size), GeGLU from ``hidden_activation``, a tied head) with

    * sandwich norms (:class:`Gemma2DecoderLayer`: ``pre_feedforward_layernorm``,
      ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on the sublayers'
      outputs and the MLP's input);
    * attention logits ``l = q k^T / sqrt(query_pre_attn_scalar)`` (each attention's
      ``logit_scale`` where the scalar is not ``head_dim``) soft-capped to
      ``c * tanh(l / c)`` before the mask, ``c = attn_logit_softcapping`` (the attention's
      ``logit_softcap``: the explicit softmax path, no fused kernel has the cap);
    * sliding-window and full layers as ``layer_types`` say (HF's default: the even layers
      slide), each member's ``member_window``;
    * the logits soft-capped the same way by ``final_logit_softcapping``
      (``final_logit_softcapping``, a static field; None: uncapped), in float32.
    """

    final_logit_softcapping: float | None = field(static=True, default=None)
    model_type = "gemma2"

    def __init__(self, *args: Any, final_softcap: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.final_logit_softcapping = None if final_softcap is None else float(final_softcap)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        logits = super().lm_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else soft_cap(logits, cap)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        options = super().hf_options(config)  # Gemma's norm and embedding scale; its bidirectional refusal
        attention_cap = _cap(config, "attn_logit_softcapping", cls.hf_class)
        final_cap = _cap(config, "final_logit_softcapping", cls.hf_class)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        scalar = _query_scalar(config, cls.hf_class)
        sizes = window(config, layer_types=True)
        windows = {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}
        scale = None if scalar == head_dim else float(scalar) ** -0.5  # head_dim: the attention's own 1/sqrt
        return {**options, "layer": Gemma2DecoderLayer, "activation": activation(config, "hidden_activation"),
                "attention_softcap": attention_cap, "final_softcap": final_cap, "query_scale": scale, **windows}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Hugging Face's ``Gemma3ForCausalLM`` (Gemma 3's text model, ``model_type:
    "gemma3_text"``): Gemma 2's blocks (sandwich norms, GeGLU, ``1 + weight`` RMSNorm, the
    embedding times sqrt(hidden_size) in the parameters' dtype, a tied head, logits scaled by
    ``query_pre_attn_scalar ** -0.5``, sliding and full layers as ``layer_types`` say: HF's
    default slides every layer but each sixth, ``sliding_window_pattern``; the final logits
    soft-capped where ``final_logit_softcapping`` is set) with

    * an RMSNorm (Gemma's) over each head's queries and keys before the rotation
      (``self_attn.q_norm`` / ``k_norm``, of size ``head_dim``, as Qwen3's);
    * each layer type its own rope: ``rope_parameters`` nested by layer type (older files:
      ``rope_local_base_freq`` for the sliding layers, ``rope_theta`` and ``rope_scaling``
      for the full ones, e.g. linear with factor 8), the attention's tuple ``rotary`` and
      each member's ``member_rope`` (:func:`~functree.hf._options.layer_type_ropes`);
    * no attention soft-cap: HF's ``Gemma3Attention`` passes no ``softcap`` to its attention
      (``attn_logit_softcapping`` is kept in the config and computes nothing), nor does this.
    """

    model_type = "gemma3_text"

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        options = GemmaForCausalLM.hf_options(config)  # Gemma's norm and embedding scale; its bidirectional refusal
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        scalar = _query_scalar(config, cls.hf_class)
        sizes = window(config, layer_types=True)
        windows = {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}
        rotary, ropes = layer_type_ropes(config, head_dim, cls.hf_class)
        return {**options, "layer": Gemma2DecoderLayer, "activation": activation(config, "hidden_activation"),
                "qk_norm": "head", "final_softcap": _cap(config, "final_logit_softcapping", cls.hf_class),
                "query_scale": None if scalar == head_dim else float(scalar) ** -0.5, "rotary": rotary,
                "ropes": ropes, **windows}


def _cap(config: Any, option: str, hf_class: str) -> float | None:
    """The config's soft-cap ``option``: None or a positive finite float (else :data:`SOFTCAP`)."""
    value = getattr(config, option, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        outcome = "NaN logits (0 / 0)" if value == 0 else "logits capped with the sign flipped" if (
            isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0) else "no model"
        raise ValueError(SOFTCAP.format(model_type=config.model_type, option=option, value=value, hf_class=hf_class,
                                        outcome=outcome, value_json=json.dumps(value, default=str),
                                        example={"attn_logit_softcapping": 50.0}.get(option, 30.0)))
    return float(value)


def _query_scalar(config: Any, hf_class: str) -> float:
    """The config's ``query_pre_attn_scalar``: a positive finite number (else :data:`QUERY_SCALAR`)."""
    value = getattr(config, "query_pre_attn_scalar", None)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    if not ok:
        outcome = "infinite or NaN logits" if isinstance(value, (int, float)) and not isinstance(value, bool) else "no model"
        raise ValueError(QUERY_SCALAR.format(model_type=config.model_type, value=value, hf_class=hf_class,
                                             outcome=outcome, value_json=json.dumps(value, default=str), example=256))
    return float(value)  # type: ignore[arg-type]  # checked above

