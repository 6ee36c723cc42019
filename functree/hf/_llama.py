"""Llama and the families built like it, each a subclass overriding its difference
(:meth:`LlamaForCausalLM.hf_options`): Qwen2 (biases, windows by layer type), Mistral (sliding
window), Gemma (norm, embedding scale), Phi-3 (fused projections, partial rotary), OLMo
(parameter-free LayerNorm)."""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree.hf._causal import (
    Block,
    CausalLM,
    check_longrope,
    longrope_crossing,
    lookup_rows,
    with_member_values,
)
from functree.hf._config import HFConfig
from functree.hf._dropout import rate
from functree.hf._family import renamed
from functree.hf._options import activation, require, rope, window
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm, RMSNorm
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack

__all__ = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM", "Phi3ForCausalLM",
           "OlmoForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaMLP", "Phi3MLP", "GemmaRMSNorm", "rotary_names"]

KV_HEADS = """\
ft.nn.from_hf: the {model_type} config has num_attention_heads={heads} and \
num_key_value_heads={kv} (the config's, or the family's default where it gives none): each key/value head serves num_attention_heads / \
num_key_value_heads query heads, so the second must divide the first (Hugging Face's \
{hf_class} fails on this config too).

    wrong:  "num_attention_heads": {heads}, "num_key_value_heads": {kv}
    right:  "num_key_value_heads": {fix}     # a divisor of {heads}: the checkpoint's own (1: multi-query)
"""

_LLAMA_HEAD = ("lm_head.weight", "model.embed_tokens.weight")
_ROTARY_BUFFER = re.compile(r".*\.rotary_emb\.inv_freq|.*\.attention\.(bias|masked_bias)")


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
        k1, k2, k3 = jax.random.split(key, 3)
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
        k1, k2 = jax.random.split(key)
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
        return (y * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)


class LlamaDecoderLayer(Block):
    """Pre-norm block with RMSNorm, rotary grouped-query attention and a SwiGLU MLP."""

    input_layernorm: Any
    self_attn: MultiheadAttention
    post_attention_layernorm: Any
    mlp: Any

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any,
                 epsilon: float, rotary: RopeScaling, attention_bias: bool, mlp_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, output_bias: bool | None = None, window: int | None = None,
                 norm: Any = RMSNorm, mlp: Any = LlamaMLP, attention: Any = "auto"):
        k1, k2, k3 = jax.random.split(key, 3)
        self.input_layernorm = norm(d, epsilon=epsilon, dtype=dtype)
        attn = MultiheadAttention(d, heads, num_kv_heads=kv_heads, qk_size=head_dim, vo_size=head_dim, rotary=rotary,
                                  causal=True, use_bias=attention_bias, window=window, implementation=attention,
                                  key=k1, dtype=dtype)
        if output_bias is not None and output_bias != attention_bias:  # Qwen2: biased q, k, v; o_proj without
            attn = attn.replace(output_projection=Dense(heads * head_dim, d, use_bias=output_bias, key=k3, dtype=dtype))
        self.self_attn = attn
        self.post_attention_layernorm = norm(d, epsilon=epsilon, dtype=dtype)
        self.mlp = mlp(d, hidden, activation, mlp_bias, key=k2, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp


class LlamaModel(Module):
    """Llama's body: ``embed_tokens``, the blocks ``layers``, the final ``norm`` (Gemma: the
    embedding times ``embed_scale``, sqrt(hidden_size) in the embedding's dtype)."""

    embed_tokens: Embedding
    layers: Stack
    norm: Any
    embed_scale: float | None = field(static=True, default=None)

    def __init__(self, vocab: int, d: int, layers: int, make: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32, norm: Any = RMSNorm, embed_scale: float | None = None):
        k1, k2 = jax.random.split(key)
        self.embed_tokens = Embedding(vocab, d, key=k1, dtype=dtype)
        self.layers = Stack(make, layers, key=k2)
        self.norm = norm(d, epsilon=epsilon, dtype=dtype)
        self.embed_scale = embed_scale

    def embed(self, ids: jax.Array, padding: int | None = None) -> jax.Array:
        x = lookup_rows(self.embed_tokens, ids, padding)
        return x if self.embed_scale is None else x * jnp.asarray(self.embed_scale, x.dtype)




def _with_layer_options(model: LlamaModel, windows: tuple[int, ...] | None, clip: float | None) -> LlamaModel:
    """``model`` with its layers' attention options: one window per layer (``member_window``,
    int32, 0: full attention) and the ``clip`` of every layer; none given: ``model`` itself."""
    layers = model.layers
    if windows is not None:
        layers = with_member_values(layers, "self_attn", member_window=jnp.asarray(windows, jnp.int32))
    if clip is not None:
        block = layers.layers
        layers = layers.replace(layers=block.replace(self_attn=block.self_attn.replace(clip=float(clip))))
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
    each attention's ``member_window``), ``clip`` (OLMo's ``clip_qkv``: the attention's ``clip``).
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
                 rotary: RopeScaling | None = None, attention_bias: bool = False, mlp_bias: bool = False,
                 tied: bool = False, key: jax.Array, dtype: Any = jnp.float32, output_bias: bool | None = None,
                 window: int | None = None, norm: Any = RMSNorm, mlp: Any = LlamaMLP,
                 embed_scale: float | None = None, attention: Any = "auto", windows: tuple[int, ...] | None = None,
                 clip: float | None = None):
        from functree._activations import silu

        k1, k2 = jax.random.split(key)
        head_dim = d // heads if head_dim is None else head_dim
        rotary = RopeScaling() if rotary is None else rotary
        act = silu if activation is None else activation

        def make(k: jax.Array) -> LlamaDecoderLayer:
            return LlamaDecoderLayer(d, heads, kv_heads, head_dim, hidden, act, epsilon, rotary, attention_bias,
                                     mlp_bias, key=k, dtype=dtype, output_bias=output_bias, window=window, norm=norm,
                                     mlp=mlp, attention=attention)

        model = LlamaModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype, norm=norm, embed_scale=embed_scale)
        self.model = _with_layer_options(model, windows, clip)
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
        kv = c.num_key_value_heads or c.num_attention_heads
        if kv <= 0 or c.num_attention_heads % kv:
            raise ValueError(KV_HEADS.format(model_type=c.model_type, heads=c.num_attention_heads, kv=kv,
                                             hf_class=cls.hf_class, fix=c.num_attention_heads))
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        biases = {name: name in cls.hf_biases and bool(getattr(c, name, False)) for name in ("attention_bias", "mlp_bias")}
        options = {**biases, **cls.hf_options(c)}
        if "rotary" not in options:  # Llama rotates the whole head (hf.rope's head_dim)
            options["rotary"] = rope(c, head_dim, cls.hf_class)
        if "epsilon" not in options:  # a family whose config has no rms_norm_eps gives its own (OLMo)
            options["epsilon"] = c.rms_norm_eps
        return cls(c.vocab_size, c.hidden_size, c.num_attention_heads, kv,
                   c.intermediate_size, c.num_hidden_layers, head_dim=head_dim, activation=activation(c, "hidden_act"),
                   tied=bool(getattr(c, "tie_word_embeddings", False)), key=key, dtype=dtype, attention=attention,
                   **options)

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        """Each layer's sliding window where the config's layers differ (Qwen2's ``windows``)."""
        windows = cls.hf_options(config).get("windows")
        return model if windows is None else model.replace(model=_with_layer_options(model.model, windows, None))

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
        weights = rotary_names(weights)
        if "embed_tokens.weight" in weights and "model.embed_tokens.weight" not in weights:
            weights = renamed(weights, _body_name, cls.hf_class)
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
    the config's ``sliding_window``, in the forward and in the KV cache's mask)."""

    model_type = "mistral"
    hf_biases = ()

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        return {"window": window(config)}


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
