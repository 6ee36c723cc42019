"""The model classes :func:`ft.nn.from_hf` builds: GPT-2, Llama and BERT out of ``ft.nn`` layers.

Each class mirrors its Hugging Face counterpart's module tree, so a parameter's key path
is HF's name (``model.layers.3.mlp.up_proj.weight``) except inside the layers ``ft.nn``
names itself: an attention's ``query_projection`` / ``key_projection`` /
``value_projection`` / ``output_projection`` (HF's ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``; GPT-2's fused ``c_attn`` / ``c_proj``; BERT's ``self.query`` ... ``output.dense``),
a norm's ``scale`` / ``offset`` (HF's ``weight`` / ``bias``), an embedding's
``embeddings`` (``weight``) and BERT's renamed sublayers (:data:`BERT_RENAME`). The
blocks are an ``ft.nn.Stack`` (one scanned block; ``model.layers.2`` is member 2).

Calls follow the cache protocol of ``ft.nn.generate``::

    logits = model(input_ids, attention_mask=None)             # no cache
    cache = model.init_cache(batch_size, max_length, dtype=None)
    logits, cache = model(input_ids, attention_mask=am, positions=pos, cache=cache)

``attention_mask`` is ``[batch, T]`` without a cache (1 = a real token, 0 = padding) and
``[batch, max_length]`` with one (1 = a filled slot, the current tokens included);
``positions`` is int32 ``[batch, T]`` (with a cache: the cache slots). Each block passes
``mask``, ``cache`` and ``positions`` to its attention.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module
from functree._repr import short_array
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm, RMSNorm
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack

__all__ = ["GPT2LMHeadModel", "LlamaForCausalLM", "BertModel"]

BAD_INPUT_IDS = """\
{model}: input_ids must be integer token ids [batch, T], got {given}.

    wrong:  model(jnp.asarray(tokens, jnp.float32))
    right:  model(jnp.asarray(tokens, jnp.int32))     # [batch, T]
"""

BAD_ATTENTION_MASK = """\
{model}: attention_mask must be [batch, {length}] of 0/1 (or bool): 1 marks a real token{slots}; \
got {given} for input_ids {ids}.

    wrong:  model(input_ids, attention_mask=mask[:, None, None, :])
    right:  model(input_ids, attention_mask=mask)      # mask [batch, {length}]
"""

NEEDS_POSITIONS = """\
{model}: with a cache, pass the positions of the new tokens (int32 [batch, T]); the model \
cannot tell where in the cache they go.

    wrong:  model(input_ids, attention_mask=am, cache=cache)
    right:  model(input_ids, attention_mask=am, positions=pos, cache=cache)
       or:  ft.nn.generate(model, input_ids, max_new_tokens)   # does this for you
"""

BAD_POSITIONS = """\
{model}: positions must be integers [batch, T] broadcastable to input_ids {ids}, got {given}.

    right:  model(input_ids, positions=jnp.cumsum(mask, axis=-1) - 1)
"""


def _check_ids(model: Any, input_ids: Any) -> jax.Array:
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(BAD_INPUT_IDS.format(model=type(model).__name__, given=short_array(ids)))
    return ids


def _padding(model: Any, ids: jax.Array, attention_mask: Any, cached: bool) -> jax.Array | None:
    """The mask as bool ``[batch, T]`` (``[batch, max_length]`` with a cache), checked."""
    if attention_mask is None:
        return None
    mask = jnp.asarray(attention_mask)
    kind_ok = mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)
    shape_ok = mask.ndim == 2 and mask.shape[0] == ids.shape[0] and (cached or mask.shape[1] == ids.shape[1])
    if not (kind_ok and shape_ok):
        length = "max_length" if cached else ids.shape[1]
        slots = " at that cache slot" if cached else ""
        raise ValueError(BAD_ATTENTION_MASK.format(model=type(model).__name__, length=length, slots=slots,
                                                   given=short_array(mask), ids=short_array(ids)))
    return mask.astype(jnp.bool_)


def _positions(model: Any, ids: jax.Array, mask: jax.Array | None, positions: Any, cached: bool) -> jax.Array:
    """Given positions (checked), else ``cumsum(mask) - 1`` (Hugging Face's for left padding), else ``0..T-1``."""
    if positions is not None:
        pos = jnp.asarray(positions)
        try:
            ok = jnp.issubdtype(pos.dtype, jnp.integer) and jnp.broadcast_shapes(pos.shape, ids.shape) == ids.shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(BAD_POSITIONS.format(model=type(model).__name__, ids=short_array(ids),
                                                  given=short_array(pos)))
        return pos
    if cached:
        raise ValueError(NEEDS_POSITIONS.format(model=type(model).__name__))
    if mask is None:
        return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _attention_mask(mask: jax.Array | None, cached: bool) -> jax.Array | None:
    """The attention's mask: ``[batch, 1, 1, T]`` without a cache, the slots' ``[batch, max_length]`` with one."""
    if mask is None or cached:
        return mask
    return mask[:, None, None, :]


def _pre_norm(x: jax.Array, norm1: Any, attention: MultiheadAttention, norm2: Any, mlp: Any, mask: Any,
              cache: Any, positions: Any) -> Any:
    """One pre-norm block, GPT-2's and Llama's: ``x + attention(norm1(x))``, then
    ``x + mlp(norm2(x))``; with a cache, ``(x, cache)`` (the cache protocol)."""
    out = attention(norm1(x), mask=mask, cache=cache, positions=positions)
    h, cache = (out, None) if cache is None else out
    x = x + h
    x = x + mlp(norm2(x))
    return x if cache is None else (x, cache)


def _blocks(stack: Stack, x: jax.Array, cache: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
    """``stack(x, **kwargs)`` as ``(x, cache)``; the cache None without one."""
    out = stack(x, cache=cache, **kwargs)
    return (out, None) if cache is None else out


def _ties(x: jax.Array, embeddings: jax.Array) -> jax.Array:
    """Logits from a head tied to the input embedding: ``x E^T``."""
    return x @ embeddings.T.astype(x.dtype)


# ---- GPT-2 ------------------------------------------------------------------------------------

class GPT2MLP(Module):
    """``c_proj(activation(c_fc(x)))`` (HF's ``Conv1D`` layers as ``Dense``)."""

    c_fc: Dense
    c_proj: Dense

    def __init__(self, d: int, hidden: int, activation: Any, *, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(key)
        self.c_fc = Dense(d, hidden, activation, key=k1, dtype=dtype)
        self.c_proj = Dense(hidden, d, key=k2, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(self.c_fc(x))


class GPT2Block(Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    ln_1: LayerNorm
    attn: MultiheadAttention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(key)
        self.ln_1 = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.attn = MultiheadAttention(d, heads, causal=True, key=k1, dtype=dtype)
        self.ln_2 = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.mlp = GPT2MLP(d, hidden, activation, key=k2, dtype=dtype)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """This block's attention cache (``MultiheadAttention.init_cache``)."""
        return self.attn.init_cache(batch_size, max_length, dtype)

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None) -> Any:
        return _pre_norm(x, self.ln_1, self.attn, self.ln_2, self.mlp, mask, cache, positions)


class GPT2Model(Module):
    """GPT-2's body: token and position embeddings, the blocks ``h``, the final norm ``ln_f``."""

    wte: Embedding
    wpe: Embedding
    h: Stack
    ln_f: LayerNorm

    def __init__(self, vocab: int, positions: int, d: int, heads: int, layers: int, hidden: int, activation: Any,
                 epsilon: float, *, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(key, 3)
        self.wte = Embedding(vocab, d, key=k1, dtype=dtype)
        self.wpe = Embedding(positions, d, key=k2, dtype=dtype)
        self.h = Stack(lambda k: GPT2Block(d, heads, hidden, activation, epsilon, key=k, dtype=dtype), layers, key=k3)
        self.ln_f = LayerNorm(d, epsilon=epsilon, dtype=dtype)


class GPT2LMHeadModel(Module):
    """Hugging Face's ``GPT2LMHeadModel`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``logits = lm_head(ln_f(h(wte(ids) + wpe(positions))))``, the head tied to ``wte``
    (``lm_head`` is None: ``x wte^T``). Positions are ``cumsum(attention_mask) - 1`` with a
    mask (left padding as HF's ``generate``), else ``0..T-1``. Parameters keep HF's names
    under ``transformer`` (module docstring for the layers' own).
    """

    transformer: GPT2Model
    lm_head: Dense | None
    hf_layouts: ClassVar[dict[str, Any]] = {"transformer.h.*": "conv1d"}
    hf_rename: ClassVar[dict[str, str]] = {}

    def __init__(self, vocab: int, positions: int, d: int, heads: int, layers: int, *, hidden: int | None = None,
                 activation: Any = None, epsilon: float = 1e-5, tied: bool = True, key: jax.Array,
                 dtype: Any = jnp.float32):
        from functree._activations import gelu

        k1, k2 = jax.random.split(key)
        self.transformer = GPT2Model(vocab, positions, d, heads, layers, 4 * d if hidden is None else hidden,
                                     gelu if activation is None else activation, epsilon, key=k1, dtype=dtype)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    @property
    def max_positions(self) -> int:
        """The longest sequence the learned position embedding covers (``n_positions``):
        ``ft.nn.generate`` refuses a longer prompt plus ``max_new_tokens``."""
        return int(self.transformer.wpe.embeddings.shape[0])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return self.transformer.h.init_cache(batch_size, max_length, dtype=dtype)  # type: ignore[attr-defined]

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None) -> Any:
        ids = _check_ids(self, input_ids)
        cached = cache is not None
        mask = _padding(self, ids, attention_mask, cached)
        pos = _positions(self, ids, mask, positions, cached)
        t = self.transformer
        # With a cache, `pos` are cache slots (rotary-free attention needs only their order);
        # the learned position embedding counts the real tokens before each slot, as HF's
        # cumsum(mask) - 1 (left padding).
        real = pos if not cached or mask is None else jnp.maximum(
            jnp.take_along_axis(jnp.cumsum(mask.astype(jnp.int32), axis=1), pos, axis=1) - 1, 0)
        x = t.wte(ids) + t.wpe(real)
        x, cache = _blocks(t.h, x, cache, mask=_attention_mask(mask, cached), positions=pos if cached else None)
        x = t.ln_f(x)
        logits = _ties(x, t.wte.embeddings) if self.lm_head is None else self.lm_head(x)
        return logits if cache is None else (logits, cache)


# ---- Llama ------------------------------------------------------------------------------------

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


class LlamaDecoderLayer(Module):
    """Pre-norm block with RMSNorm, rotary grouped-query attention and a SwiGLU MLP."""

    input_layernorm: RMSNorm
    self_attn: MultiheadAttention
    post_attention_layernorm: RMSNorm
    mlp: LlamaMLP

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, hidden: int, activation: Any,
                 epsilon: float, rotary: RopeScaling, attention_bias: bool, mlp_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(key)
        self.input_layernorm = RMSNorm(d, epsilon=epsilon, dtype=dtype)
        self.self_attn = MultiheadAttention(d, heads, num_kv_heads=kv_heads, qk_size=head_dim, vo_size=head_dim,
                                            rotary=rotary, causal=True, use_bias=attention_bias, key=k1, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, epsilon=epsilon, dtype=dtype)
        self.mlp = LlamaMLP(d, hidden, activation, mlp_bias, key=k2, dtype=dtype)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """This block's attention cache (``MultiheadAttention.init_cache``)."""
        return self.self_attn.init_cache(batch_size, max_length, dtype)

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None) -> Any:
        return _pre_norm(x, self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp, mask,
                         cache, positions)


class LlamaModel(Module):
    """Llama's body: ``embed_tokens``, the blocks ``layers``, the final ``norm``."""

    embed_tokens: Embedding
    layers: Stack
    norm: RMSNorm

    def __init__(self, vocab: int, d: int, layers: int, make: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(key)
        self.embed_tokens = Embedding(vocab, d, key=k1, dtype=dtype)
        self.layers = Stack(make, layers, key=k2)
        self.norm = RMSNorm(d, epsilon=epsilon, dtype=dtype)


class LlamaForCausalLM(Module):
    """Hugging Face's ``LlamaForCausalLM`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``logits = lm_head(norm(layers(embed_tokens(ids))))``; ``lm_head`` is None for a head
    tied to the embedding (``x E^T``). Rotary positions are relative, so without a cache a
    left-padded row's real tokens see the same scores as HF's ``cumsum(mask) - 1``
    positions; with a cache, ``positions=`` go to each attention. Parameters keep HF's
    names (module docstring for the layers' own).
    """

    model: LlamaModel
    lm_head: Dense | None
    hf_layouts: ClassVar[dict[str, Any]] = {"model.layers.*.self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}
    hf_rename: ClassVar[dict[str, str]] = {}

    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, hidden: int, layers: int, *,
                 head_dim: int | None = None, activation: Any = None, epsilon: float = 1e-6,
                 rotary: RopeScaling | None = None, attention_bias: bool = False, mlp_bias: bool = False,
                 tied: bool = False, key: jax.Array, dtype: Any = jnp.float32):
        from functree._activations import silu

        k1, k2 = jax.random.split(key)
        head_dim = d // heads if head_dim is None else head_dim
        rotary = RopeScaling() if rotary is None else rotary
        act = silu if activation is None else activation

        def make(k: jax.Array) -> LlamaDecoderLayer:
            return LlamaDecoderLayer(d, heads, kv_heads, head_dim, hidden, act, epsilon, rotary, attention_bias,
                                     mlp_bias, key=k, dtype=dtype)

        self.model = LlamaModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return self.model.layers.init_cache(batch_size, max_length, dtype=dtype)  # type: ignore[attr-defined]

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None) -> Any:
        ids = _check_ids(self, input_ids)
        cached = cache is not None
        mask = _padding(self, ids, attention_mask, cached)
        pos = _positions(self, ids, mask, positions, cached) if cached or positions is not None else None
        m = self.model
        x, cache = _blocks(m.layers, m.embed_tokens(ids), cache, mask=_attention_mask(mask, cached), positions=pos)
        x = m.norm(x)
        logits = _ties(x, m.embed_tokens.embeddings) if self.lm_head is None else self.lm_head(x)
        return logits if cache is None else (logits, cache)


# ---- BERT -------------------------------------------------------------------------------------

# HF's names of BERT's sublayers that ft.nn names differently (``*``: the layer number).
BERT_RENAME = {
    "encoder.layer.*.attention.output.LayerNorm": "encoder.layer.*.attention_norm",
    "encoder.layer.*.intermediate.dense": "encoder.layer.*.intermediate",
    "encoder.layer.*.output.dense": "encoder.layer.*.output",
    "encoder.layer.*.output.LayerNorm": "encoder.layer.*.output_norm",
    "pooler.dense": "pooler",
}


class BertEmbeddings(Module):
    """``LayerNorm(word + position + token_type embeddings)``."""

    word_embeddings: Embedding
    position_embeddings: Embedding
    token_type_embeddings: Embedding
    LayerNorm: LayerNorm

    def __init__(self, vocab: int, positions: int, types: int, d: int, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(key, 3)
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
                 dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = MultiheadAttention(d, heads, key=k1, dtype=dtype)
        self.attention_norm = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.intermediate = Dense(d, hidden, activation, key=k2, dtype=dtype)
        self.output = Dense(hidden, d, key=k3, dtype=dtype)
        self.output_norm = LayerNorm(d, epsilon=epsilon, dtype=dtype)

    def __call__(self, x: jax.Array, *, mask: Any = None) -> jax.Array:
        x = self.attention_norm(x + self.attention(x, mask=mask))
        return self.output_norm(x + self.output(self.intermediate(x)))


class BertEncoder(Module):
    """The blocks, ``layer`` (a Stack)."""

    layer: Stack

    def __init__(self, layer: Stack):
        self.layer = layer


class BertModel(Module):
    """Hugging Face's ``BertModel`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``model(input_ids, attention_mask=None, token_type_ids=None)`` is the last hidden
    state ``[batch, T, hidden]`` (positions ``0..T-1``, as HF); ``pooler`` (None without
    one) gives HF's ``pooler_output`` as ``pooler(hidden[:, 0])``. Parameters keep HF's
    names but for :data:`BERT_RENAME` (module docstring for the layers' own).
    """

    embeddings: BertEmbeddings
    encoder: BertEncoder
    pooler: Dense | None
    hf_layouts: ClassVar[dict[str, Any]] = {
        "encoder.layer.*.attention": ("self.query", "self.key", "self.value", "output.dense")}
    hf_rename: ClassVar[dict[str, str]] = BERT_RENAME

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *, types: int = 2,
                 activation: Any = None, epsilon: float = 1e-12, pooler: bool = True, key: jax.Array,
                 dtype: Any = jnp.float32):
        from functree._activations import gelu_exact, tanh

        k1, k2, k3 = jax.random.split(key, 3)
        act = gelu_exact if activation is None else activation
        self.embeddings = BertEmbeddings(vocab, positions, types, d, epsilon, key=k1, dtype=dtype)
        self.encoder = BertEncoder(Stack(lambda k: BertLayer(d, heads, hidden, act, epsilon, key=k,
                                                                   dtype=dtype), layers, key=k2))
        self.pooler = Dense(d, d, tanh, key=k3, dtype=dtype) if pooler else None

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> jax.Array:
        ids = _check_ids(self, input_ids)
        mask = _padding(self, ids, attention_mask, False)
        types = jnp.zeros_like(ids) if token_type_ids is None else jnp.asarray(token_type_ids)
        e = self.embeddings
        x = e.word_embeddings(ids) + e.position_embeddings(jnp.arange(ids.shape[1])) + e.token_type_embeddings(types)
        x = e.LayerNorm(x)
        extra = {} if mask is None else {"mask": mask[:, None, None, :]}
        return self.encoder.layer(x, **extra)

