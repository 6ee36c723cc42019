"""The model classes :func:`ft.nn.from_hf` builds out of ``ft.nn`` layers: GPT-2, Llama (and
Qwen2, Mistral, Gemma, Phi-3, built like it), GPT-NeoX, OPT and BERT.

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

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import Module, field
from functree._repr import short_array
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._hf_config import HFConfig
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm, RMSNorm
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack

__all__ = ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM",
           "Phi3ForCausalLM", "GPTNeoXForCausalLM", "OPTForCausalLM", "BertModel"]

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


OUT_OF_VOCABULARY = """\
{model}: token id {token} at input_ids{where} is outside the vocabulary (ids 0 to {last}: \
vocab_size {vocab}). Hugging Face raises here (IndexError); the usual cause is a tokenizer \
with added tokens and an embedding that was not resized.

    wrong:  model(tokenizer(text_with_added_tokens))            # ids >= {vocab}
    right:  ids below {vocab} (or resize the embedding before porting: hf_model.resize_token_embeddings(len(tokenizer)))
"""

TOO_MANY_POSITIONS = """\
{model}: {given} positions, but the learned position embedding has {limit} \
({name} = {limit}); Hugging Face raises here too.

    wrong:  model(input_ids)                    # input_ids [batch, {given}]
    right:  model(input_ids[:, -{limit}:])      # at most {limit} tokens
"""


LONGROPE_CROSSING = """\
{model}: longrope switches from its short to its long factors past original_max_positions \
({original}), and this cache of {length} slots would cross that point after a prompt of {prompt} \
tokens. Hugging Face recomputes the whole cache with the long factors there (Phi-3's \
prepare_inputs_for_generation); a KV cache keeps the keys it has, so the answers would differ.

    right:  ft.nn.generate(model, input_ids, {fit})        # stay within {original} positions
       or:  model(all_tokens)                               # no cache: the long factors throughout, as HF
"""


def _check_longrope(model: Any, attention: MultiheadAttention, ids: Any, cache: Any) -> None:
    """A prefill (``T > 1`` tokens) into a cache that crosses longrope's switch point raises."""
    rotary = attention.rotary
    if cache is None or not isinstance(rotary, RopeScaling) or rotary.kind != "longrope":
        return
    original, length = rotary.original_max_positions or 0, jax.tree.leaves(cache)[0].shape[2]
    prompt = np.shape(ids)[1] if np.ndim(ids) == 2 else 0
    if 1 < prompt <= original < length:
        raise ValueError(LONGROPE_CROSSING.format(model=type(model).__name__, original=original, length=length,
                                                  prompt=prompt, fit=max(original - prompt, 1)))


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array, or None when it is traced (under ``jax.jit``)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_token_ids(model: Any, input_ids: Any, vocab: int) -> None:
    """Raise :data:`OUT_OF_VOCABULARY` if concrete ``input_ids`` hold an id outside ``[0, vocab)``
    (traced ids are not checked here: the embedding lookup makes their rows NaN instead)."""
    ids = _concrete(input_ids)
    if ids is None or ids.size == 0:
        return
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(OUT_OF_VOCABULARY.format(model=type(model).__name__, token=int(ids[where]),
                                                  where=list(where), last=vocab - 1, vocab=vocab))


def _lookup(embedding: Embedding, indices: jax.Array) -> jax.Array:
    """Rows of the embedding table; NaN for an index outside it (traced ids the entry check
    could not read: the wrong row shows as NaN logits, never as another token's row)."""
    table = embedding.embeddings
    inside = jnp.where(indices < 0, table.shape[0], indices)
    return jnp.take(table, inside, axis=0, mode="fill", fill_value=jnp.nan)


def _check_ids(model: Any, input_ids: Any, vocab: int | None = None) -> jax.Array:
    ids = input_ids if isinstance(input_ids, jax.Array) else jnp.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(BAD_INPUT_IDS.format(model=type(model).__name__, given=short_array(ids)))
    if vocab is not None:
        check_token_ids(model, input_ids, vocab)
    return ids


def _check_length(model: Any, length: int, limit: int, name: str) -> None:
    if length > limit:
        raise ValueError(TOO_MANY_POSITIONS.format(model=type(model).__name__, given=length, limit=limit, name=name))


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
        return jnp.broadcast_to(pos, ids.shape)
    if cached:
        raise ValueError(NEEDS_POSITIONS.format(model=type(model).__name__))
    if mask is None:
        return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _real_positions(pos: jax.Array, mask: jax.Array | None, cached: bool) -> jax.Array:
    """Each token's position among its row's real tokens (HF's ``cumsum(mask) - 1``): with a
    cache, ``pos`` are slots and the real tokens before each slot are counted."""
    if not cached or mask is None:
        return pos
    counts = jnp.cumsum(mask.astype(jnp.int32), axis=1)
    return jnp.maximum(jnp.take_along_axis(counts, pos, axis=1) - 1, 0)


def _attention_mask(mask: jax.Array | None, cached: bool) -> jax.Array | None:
    """The attention's mask: ``[batch, 1, 1, T]`` without a cache, the slots' ``[batch, max_length]`` with one."""
    if mask is None or cached:
        return mask
    return mask[:, None, None, :]


def _run(model: Any, input_ids: Any, attention_mask: Any, positions: Any, cache: Any, *, vocab: int,
         blocks: Stack, embed: Callable[[jax.Array, jax.Array], jax.Array], head: Callable[[jax.Array], jax.Array],
         rotary: bool, limit: tuple[int, str] | None = None) -> Any:
    """A decoder language model's call under the cache protocol (module docstring): inputs
    checked, positions made, ``embed(ids, real positions)``, the blocks, ``head``.

    ``rotary``: the blocks' attention rotates queries and keys, by the real positions (HF's)
    with or without a cache; otherwise (learned positions) the blocks get the slots only."""
    ids = _check_ids(model, input_ids, vocab)
    cached = cache is not None
    if limit is not None and not cached:
        _check_length(model, ids.shape[1], *limit)
    mask = _padding(model, ids, attention_mask, cached)
    if not cached and mask is None and positions is None:
        pos = real = None  # 0..T-1: the attention's own
    else:
        pos = _positions(model, ids, mask, positions, cached)
        real = _real_positions(pos, mask, cached)
    x = embed(ids, jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape) if real is None else real)
    kwargs: dict[str, Any] = {"mask": _attention_mask(mask, cached)}
    if cached:
        kwargs["positions"] = pos
        if rotary:
            kwargs["rotary_positions"] = real
    elif rotary and real is not None:
        kwargs["positions"] = real
    out = blocks(x, cache=cache, **kwargs)
    x, cache = (out, None) if cache is None else out
    logits = head(x)
    return logits if cache is None else (logits, cache)


def _pre_norm(x: jax.Array, norm1: Any, attention: MultiheadAttention, norm2: Any, mlp: Any, mask: Any,
              cache: Any, positions: Any, rotary_positions: Any = None, parallel: bool = False) -> Any:
    """One pre-norm block: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))`` (``parallel``:
    GPT-NeoX's ``x + attention(norm1(x)) + mlp(norm2(x))``); with a cache, ``(x, cache)``."""
    extra = {} if rotary_positions is None else {"rotary_positions": rotary_positions}
    out = attention(norm1(x), mask=mask, cache=cache, positions=positions, **extra)
    h, cache = (out, None) if cache is None else out
    x = x + h + mlp(norm2(x)) if parallel else x + h + mlp(norm2(x + h))
    return x if cache is None else (x, cache)


def _ties(x: jax.Array, embeddings: jax.Array) -> jax.Array:
    """Logits from a head tied to the input embedding: ``x E^T``."""
    return x @ embeddings.T.astype(x.dtype)


def _head(x: jax.Array, lm_head: Dense | None, embedding: Embedding) -> jax.Array:
    return _ties(x, embedding.embeddings) if lm_head is None else lm_head(x)


def _cache(blocks: Stack, batch_size: int, max_length: int, dtype: Any) -> Any:
    return blocks.init_cache(batch_size, max_length, dtype=dtype)  # type: ignore[attr-defined]


class _Block(Module):
    """A pre-norm block's call and cache, shared by the blocks below (their fields: HF's names)."""

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        raise NotImplementedError

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """This block's attention cache (``MultiheadAttention.init_cache``)."""
        return self._parts()[1].init_cache(batch_size, max_length, dtype)

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None,
                 rotary_positions: Any = None) -> Any:
        return _pre_norm(x, *self._parts(), mask, cache, positions, rotary_positions,
                         bool(getattr(self, "parallel", False)))


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


class GPT2Block(_Block):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    ln_1: LayerNorm
    attn: MultiheadAttention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2 = jax.random.split(key)
        self.ln_1 = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.attn = MultiheadAttention(d, heads, causal=True, implementation=attention, key=k1, dtype=dtype)
        self.ln_2 = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.mlp = GPT2MLP(d, hidden, activation, key=k2, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.ln_1, self.attn, self.ln_2, self.mlp


class GPT2Model(Module):
    """GPT-2's body: token and position embeddings, the blocks ``h``, the final norm ``ln_f``."""

    wte: Embedding
    wpe: Embedding
    h: Stack
    ln_f: LayerNorm

    def __init__(self, vocab: int, positions: int, d: int, heads: int, layers: int, hidden: int, activation: Any,
                 epsilon: float, *, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2, k3 = jax.random.split(key, 3)
        self.wte = Embedding(vocab, d, key=k1, dtype=dtype)
        self.wpe = Embedding(positions, d, key=k2, dtype=dtype)
        self.h = Stack(lambda k: GPT2Block(d, heads, hidden, activation, epsilon, key=k, dtype=dtype,
                                           attention=attention), layers, key=k3)
        self.ln_f = LayerNorm(d, epsilon=epsilon, dtype=dtype)


class GPT2LMHeadModel(Module):
    """Hugging Face's ``GPT2LMHeadModel`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``logits = lm_head(ln_f(h(wte(ids) + wpe(positions))))``, the head tied to ``wte``
    (``lm_head`` is None: ``x wte^T``). Positions are ``cumsum(attention_mask) - 1`` with a
    mask (left padding as HF's ``generate``), else ``0..T-1``; more than ``n_positions``
    tokens raise (a position past the table under a cache reads NaN). Parameters keep HF's
    names under ``transformer`` (module docstring for the layers' own).
    """

    transformer: GPT2Model
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    hf_layouts: ClassVar[dict[str, Any]] = {"transformer.h.*": "conv1d"}
    hf_rename: ClassVar[dict[str, str]] = {}

    def __init__(self, vocab: int, positions: int, d: int, heads: int, layers: int, *, hidden: int | None = None,
                 activation: Any = None, epsilon: float = 1e-5, tied: bool = True, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        from functree._activations import gelu

        k1, k2 = jax.random.split(key)
        self.transformer = GPT2Model(vocab, positions, d, heads, layers, 4 * d if hidden is None else hidden,
                                     gelu if activation is None else activation, epsilon, key=k1, dtype=dtype,
                                     attention=attention)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    @property
    def max_positions(self) -> int:
        """The longest sequence the learned position embedding covers (``n_positions``):
        ``ft.nn.generate`` refuses a longer prompt plus ``max_new_tokens``."""
        return int(self.transformer.wpe.embeddings.shape[0])

    def check_token_ids(self, input_ids: Any) -> None:
        """Raise if concrete ``input_ids`` hold an id outside the vocabulary (``ft.nn.generate`` calls it)."""
        check_token_ids(self, input_ids, self.transformer.wte.embeddings.shape[0])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return _cache(self.transformer.h, batch_size, max_length, dtype)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None) -> Any:
        t = self.transformer
        return _run(self, input_ids, attention_mask, positions, cache, vocab=t.wte.embeddings.shape[0],
                    blocks=t.h, embed=lambda ids, real: _lookup(t.wte, ids) + _lookup(t.wpe, real),
                    head=lambda x: _head(t.ln_f(x), self.lm_head, t.wte), rotary=False,
                    limit=(self.max_positions, "n_positions"))


# ---- Llama and the families built like it: Qwen2, Mistral, Gemma, Phi-3 ------------------------

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

    weight: jax.Array
    epsilon: float = field(static=True, default=1e-6)

    def __init__(self, d: int, *, epsilon: float = 1e-6, dtype: Any = jnp.float32):
        self.weight, self.epsilon = jnp.zeros((d,), dtype), float(epsilon)

    def __call__(self, x: jax.Array) -> jax.Array:
        xs = x.astype(jnp.float32)
        y = xs * jax.lax.rsqrt(jnp.mean(jnp.square(xs), axis=-1, keepdims=True) + jnp.float32(self.epsilon))
        return (y * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)


class LlamaDecoderLayer(_Block):
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

    def embed(self, ids: jax.Array) -> jax.Array:
        x = _lookup(self.embed_tokens, ids)
        return x if self.embed_scale is None else x * jnp.asarray(self.embed_scale, x.dtype)


class LlamaForCausalLM(Module):
    """Hugging Face's ``LlamaForCausalLM`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``logits = lm_head(norm(layers(embed_tokens(ids))))``; ``lm_head`` is None for a head
    tied to the embedding (``x E^T``). Queries and keys are rotated at HF's positions
    (``cumsum(attention_mask) - 1`` in a left-padded row, with or without a cache: dynamic
    NTK rope equals HF's too). Parameters keep HF's names (module docstring for the layers'
    own). The options cover the families built like Llama: ``output_bias`` (Qwen2's biased
    q/k/v and unbiased o_proj), ``window`` (sliding-window attention: Mistral, Qwen2, Phi-3),
    ``norm`` and ``embed_scale`` (Gemma), ``mlp`` (Phi-3's fused ``gate_up_proj``).
    """

    model: LlamaModel
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    hf_layouts: ClassVar[dict[str, Any]] = {"model.layers.*.self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}
    hf_rename: ClassVar[dict[str, str]] = {}

    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, hidden: int, layers: int, *,
                 head_dim: int | None = None, activation: Any = None, epsilon: float = 1e-6,
                 rotary: RopeScaling | None = None, attention_bias: bool = False, mlp_bias: bool = False,
                 tied: bool = False, key: jax.Array, dtype: Any = jnp.float32, output_bias: bool | None = None,
                 window: int | None = None, norm: Any = RMSNorm, mlp: Any = LlamaMLP,
                 embed_scale: float | None = None, attention: Any = "auto"):
        from functree._activations import silu

        k1, k2 = jax.random.split(key)
        head_dim = d // heads if head_dim is None else head_dim
        rotary = RopeScaling() if rotary is None else rotary
        act = silu if activation is None else activation

        def make(k: jax.Array) -> LlamaDecoderLayer:
            return LlamaDecoderLayer(d, heads, kv_heads, head_dim, hidden, act, epsilon, rotary, attention_bias,
                                     mlp_bias, key=k, dtype=dtype, output_bias=output_bias, window=window, norm=norm,
                                     mlp=mlp, attention=attention)

        self.model = LlamaModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype, norm=norm,
                                embed_scale=embed_scale)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    def check_token_ids(self, input_ids: Any) -> None:
        """Raise if concrete ``input_ids`` hold an id outside the vocabulary (``ft.nn.generate`` calls it)."""
        check_token_ids(self, input_ids, self.model.embed_tokens.embeddings.shape[0])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return _cache(self.model.layers, batch_size, max_length, dtype)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None) -> Any:
        m = self.model
        _check_longrope(self, m.layers.layers.self_attn, input_ids, cache)
        return _run(self, input_ids, attention_mask, positions, cache, vocab=m.embed_tokens.embeddings.shape[0],
                    blocks=m.layers, embed=lambda ids, real: m.embed(ids),
                    head=lambda x: _head(m.norm(x), self.lm_head, m.embed_tokens), rotary=True)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5): Llama with biased q/k/v projections
    (an unbiased ``o_proj``), sliding windows where the config sets them on every layer."""


class MistralForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``MistralForCausalLM``: Llama with sliding-window attention (``window``:
    the config's ``sliding_window``, in the forward and in the KV cache's mask)."""


class GemmaForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``GemmaForCausalLM``: Llama with ``GemmaRMSNorm`` (``1 + weight``), the
    embedding scaled by sqrt(hidden_size), GeGLU (tanh GELU) and a tied head."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Phi3ForCausalLM``: Llama with fused ``qkv_proj`` and ``gate_up_proj``
    (:class:`Phi3MLP`), partial rotary and sliding windows as the config sets them."""

    hf_layouts: ClassVar[dict[str, Any]] = {"model.layers.*.self_attn": ("qkv_proj", "o_proj")}


# ---- GPT-NeoX (Pythia) ------------------------------------------------------------------------

class GPTNeoXMLP(Module):
    """``dense_4h_to_h(activation(dense_h_to_4h(x)))``."""

    dense_h_to_4h: Dense
    dense_4h_to_h: Dense

    def __init__(self, d: int, hidden: int, activation: Any, *, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(key)
        self.dense_h_to_4h = Dense(d, hidden, activation, key=k1, dtype=dtype)
        self.dense_4h_to_h = Dense(hidden, d, key=k2, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense_4h_to_h(self.dense_h_to_4h(x))


class GPTNeoXLayer(_Block):
    """``x + attention(input_layernorm(x)) + mlp(post_attention_layernorm(x))`` (``parallel``;
    else sequential, as Llama)."""

    input_layernorm: LayerNorm
    post_attention_layernorm: LayerNorm
    attention: MultiheadAttention
    mlp: GPTNeoXMLP
    parallel: bool = field(static=True, default=True)

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, epsilon: float, rotary: RopeScaling,
                 use_bias: bool, parallel: bool, *, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2 = jax.random.split(key)
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
        k1, k2 = jax.random.split(key)
        self.embed_in = Embedding(vocab, d, key=k1, dtype=dtype)
        self.layers = Stack(make, layers, key=k2)
        self.final_layer_norm = LayerNorm(d, epsilon=epsilon, dtype=dtype)


class GPTNeoXForCausalLM(Module):
    """Hugging Face's ``GPTNeoXForCausalLM`` (Pythia) as a functree model (:func:`ft.nn.from_hf`).

    Parallel residual blocks (:class:`GPTNeoXLayer`), rotary attention on the first
    ``partial_rotary_factor`` of each head (``RopeScaling(partial=...)``), a fused
    ``query_key_value`` with each head's q, k, v rows in turn; ``lm_head`` (older files:
    ``embed_out``; None when tied).
    """

    gpt_neox: GPTNeoXModel
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    hf_layouts: ClassVar[dict[str, Any]] = {"gpt_neox.layers.*.attention": ("query_key_value", "dense", "per_head")}
    hf_rename: ClassVar[dict[str, str]] = {}

    def __init__(self, vocab: int, d: int, heads: int, hidden: int, layers: int, *, activation: Any,
                 epsilon: float = 1e-5, rotary: RopeScaling, use_bias: bool = True, parallel: bool = True,
                 tied: bool = False, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2 = jax.random.split(key)

        def make(k: jax.Array) -> GPTNeoXLayer:
            return GPTNeoXLayer(d, heads, hidden, activation, epsilon, rotary, use_bias, parallel, key=k, dtype=dtype,
                                attention=attention)

        self.gpt_neox = GPTNeoXModel(vocab, d, layers, make, epsilon, key=k1, dtype=dtype)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    def check_token_ids(self, input_ids: Any) -> None:
        """Raise if concrete ``input_ids`` hold an id outside the vocabulary (``ft.nn.generate`` calls it)."""
        check_token_ids(self, input_ids, self.gpt_neox.embed_in.embeddings.shape[0])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return _cache(self.gpt_neox.layers, batch_size, max_length, dtype)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None) -> Any:
        m = self.gpt_neox
        return _run(self, input_ids, attention_mask, positions, cache, vocab=m.embed_in.embeddings.shape[0],
                    blocks=m.layers, embed=lambda ids, real: _lookup(m.embed_in, ids),
                    head=lambda x: _head(m.final_layer_norm(x), self.lm_head, m.embed_in), rotary=True)


# ---- OPT --------------------------------------------------------------------------------------

class OPTDecoderLayer(_Block):
    """Pre-norm block: ``x + self_attn(self_attn_layer_norm(x))``, then
    ``x + fc2(relu(fc1(final_layer_norm(x))))``."""

    self_attn: MultiheadAttention
    self_attn_layer_norm: LayerNorm
    fc1: Dense
    fc2: Dense
    final_layer_norm: LayerNorm

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, use_bias: bool, *, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2, k3 = jax.random.split(key, 3)
        self.self_attn = MultiheadAttention(d, heads, causal=True, use_bias=use_bias, implementation=attention,
                                            key=k1, dtype=dtype)
        self.self_attn_layer_norm = LayerNorm(d, dtype=dtype)
        self.fc1 = Dense(d, hidden, activation, use_bias=use_bias, key=k2, dtype=dtype)
        self.fc2 = Dense(hidden, d, use_bias=use_bias, key=k3, dtype=dtype)
        self.final_layer_norm = LayerNorm(d, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.self_attn_layer_norm, self.self_attn, self.final_layer_norm, lambda x: self.fc2(self.fc1(x))


class OPTDecoder(Module):
    """OPT's body: ``embed_tokens``, ``embed_positions`` (position ``p`` at row ``p + 2``), the
    blocks ``layers``, ``final_layer_norm``."""

    embed_tokens: Embedding
    embed_positions: Embedding
    layers: Stack
    final_layer_norm: LayerNorm

    def __init__(self, vocab: int, positions: int, d: int, layers: int, make: Any, *, key: jax.Array,
                 dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed_tokens = Embedding(vocab, d, key=k1, dtype=dtype)
        self.embed_positions = Embedding(positions + OPT_OFFSET, d, key=k2, dtype=dtype)
        self.layers = Stack(make, layers, key=k3)
        self.final_layer_norm = LayerNorm(d, dtype=dtype)


class OPTModel(Module):
    """``decoder`` (HF's module tree)."""

    decoder: OPTDecoder

    def __init__(self, decoder: OPTDecoder):
        self.decoder = decoder


OPT_OFFSET = 2  # OPT's learned positions start at row 2 of embed_positions


class OPTForCausalLM(Module):
    """Hugging Face's ``OPTForCausalLM`` as a functree model (built by :func:`ft.nn.from_hf`).

    Learned positions (``cumsum(attention_mask) - 1``, row ``p + 2``; more than
    ``max_position_embeddings`` tokens raise), pre-norm blocks (:class:`OPTDecoderLayer`),
    a head tied to ``embed_tokens`` (``lm_head`` None) or not.
    """

    model: OPTModel
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    hf_layouts: ClassVar[dict[str, Any]] = {
        "model.decoder.layers.*.self_attn": ("q_proj", "k_proj", "v_proj", "out_proj")}
    hf_rename: ClassVar[dict[str, str]] = {}

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *,
                 activation: Any, use_bias: bool = True, tied: bool = True, key: jax.Array, dtype: Any = jnp.float32,
                 attention: Any = "auto"):
        k1, k2 = jax.random.split(key)

        def make(k: jax.Array) -> OPTDecoderLayer:
            return OPTDecoderLayer(d, heads, hidden, activation, use_bias, key=k, dtype=dtype, attention=attention)

        self.model = OPTModel(OPTDecoder(vocab, positions, d, layers, make, key=k1, dtype=dtype))
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    @property
    def max_positions(self) -> int:
        """``max_position_embeddings`` (``ft.nn.generate`` refuses to go past it)."""
        return int(self.model.decoder.embed_positions.embeddings.shape[0]) - OPT_OFFSET

    def check_token_ids(self, input_ids: Any) -> None:
        """Raise if concrete ``input_ids`` hold an id outside the vocabulary (``ft.nn.generate`` calls it)."""
        check_token_ids(self, input_ids, self.model.decoder.embed_tokens.embeddings.shape[0])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return _cache(self.model.decoder.layers, batch_size, max_length, dtype)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None) -> Any:
        m = self.model.decoder
        return _run(self, input_ids, attention_mask, positions, cache, vocab=m.embed_tokens.embeddings.shape[0],
                    blocks=m.layers,
                    embed=lambda ids, real: _lookup(m.embed_tokens, ids) + _lookup(m.embed_positions, real + OPT_OFFSET),
                    head=lambda x: _head(m.final_layer_norm(x), self.lm_head, m.embed_tokens), rotary=False,
                    limit=(self.max_positions, "max_position_embeddings"))


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
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = MultiheadAttention(d, heads, implementation=attention, key=k1, dtype=dtype)
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
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    hf_layouts: ClassVar[dict[str, Any]] = {
        "encoder.layer.*.attention": ("self.query", "self.key", "self.value", "output.dense")}
    hf_rename: ClassVar[dict[str, str]] = BERT_RENAME

    def __init__(self, vocab: int, positions: int, d: int, heads: int, hidden: int, layers: int, *, types: int = 2,
                 activation: Any = None, epsilon: float = 1e-12, pooler: bool = True, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        from functree._activations import gelu_exact, tanh

        k1, k2, k3 = jax.random.split(key, 3)
        act = gelu_exact if activation is None else activation
        self.embeddings = BertEmbeddings(vocab, positions, types, d, epsilon, key=k1, dtype=dtype)
        self.encoder = BertEncoder(Stack(lambda k: BertLayer(d, heads, hidden, act, epsilon, key=k,
                                                                   dtype=dtype, attention=attention), layers, key=k2))
        self.pooler = Dense(d, d, tanh, key=k3, dtype=dtype) if pooler else None

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> jax.Array:
        e = self.embeddings
        ids = _check_ids(self, input_ids, e.word_embeddings.embeddings.shape[0])
        _check_length(self, ids.shape[1], e.position_embeddings.embeddings.shape[0], "max_position_embeddings")
        mask = _padding(self, ids, attention_mask, False)
        types = jnp.zeros_like(ids) if token_type_ids is None else jnp.asarray(token_type_ids)
        x = _lookup(e.word_embeddings, ids) + e.position_embeddings(jnp.arange(ids.shape[1])) + e.token_type_embeddings(types)
        x = e.LayerNorm(x)
        extra = {} if mask is None else {"mask": mask[:, None, None, :]}
        return self.encoder.layer(x, **extra)

