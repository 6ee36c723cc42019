"""Multi-head scaled dot-product attention (Vaswani et al. 2017).

The attention itself is ``jax.nn.dot_product_attention``, with the kernel chosen by
:mod:`functree.nn._attention_kernel` (``implementation="auto"``: cuDNN's flash attention on
NVIDIA GPUs where it applies, XLA elsewhere); the explicit softmax path below is used only
where that function cannot be: attention dropout in training, per-head value sizes that
differ from the query/key ones, and float64 (where JAX's function failed a float64
finite-difference gradient check at 1.3e-5 relative).
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar, Literal

import jax
import jax.core
import jax.numpy as jnp

from functree._broadcast import both
from functree._module import Module, field
from functree._random import TRAINER_KEY, flat_key, one_key
from functree._repr import short_array
from functree._traces import staged
from functree.nn._attention_kernel import CUDNN_DOES_NOT_APPLY, check_implementation, choose
from functree.nn._check import (
    LayerInputError,
    check_input,
    check_unbatched,
    concrete,
    optional_sizes,
    size_arguments,
)
from functree.nn._linear import Dense
from functree.nn._mode import Layer
from functree.nn._normalization import statistics_dtype
from functree.nn._rotary import RopeScaling, apply_rotary, check_base
from functree.nn._window import is_int

__all__ = ["MultiheadAttention", "KVCache"]

BAD_HEADS = """\
MultiheadAttention: query_size ({size}) must be divisible by num_heads ({heads}), or pass \
qk_size= and vo_size= (the per-head sizes) explicitly.

    wrong:  ft.nn.MultiheadAttention({size}, {heads}, key=k)
    right:  ft.nn.MultiheadAttention({size}, {heads}, qk_size=16, vo_size=16, key=k)
"""

BAD_NUM_HEADS = """\
MultiheadAttention: num_heads must be an int >= 1, got {heads!r}.

    wrong:  ft.nn.MultiheadAttention({size}, {heads!r}, key=k)
    right:  ft.nn.MultiheadAttention({size}, 1, key=k)   # one head of size {size}
"""

BAD_KV_HEADS = """\
MultiheadAttention: num_kv_heads ({kv}) must divide num_heads ({heads}): each key/value head \
serves num_heads // num_kv_heads query heads (grouped-query attention).

    wrong:  ft.nn.MultiheadAttention(d, {heads}, num_kv_heads={kv}, key=k)
    right:  ft.nn.MultiheadAttention(d, {heads}, num_kv_heads={right}, key=k)   # 1: multi-query
"""

BAD_WINDOW = """\
MultiheadAttention: window must be an int >= 1 (each query attends the `window` latest \
keys up to its own position) or None, got {given!r}.

    right:  ft.nn.MultiheadAttention(d, heads, causal=True, window=4096, key=k)   # Mistral's
"""

BAD_MASK = "Pass a boolean mask broadcastable to [..., num_heads, queries, keys] (True = attend)."

BAD_BIAS = ("Pass a floating bias broadcastable to [..., num_heads, queries, keys], added to the scaled logits "
            "(-inf: never attend).")

BIAS_WITH_CACHE = """\
MultiheadAttention: bias= (an additive bias on the logits) is not taken with cache=: the cache's \
logits are over its slots, not over the given keys.

    wrong:  out, cache = attn(x, cache=cache, positions=pos, bias=b)
    right:  out = attn(x, bias=b)        # without a cache; or a boolean mask= over the cache's slots
"""

POSITIONS_SELF_ONLY = """\
MultiheadAttention: positions= (without a cache) rotates self-attention's queries and keys; \
with keys= or values= the keys' positions are unknown.

    wrong:  attn(x, memory, positions=pos)
    right:  attn(x, positions=pos)          # self-attention; or leave positions out
"""

NO_KEY = """\
MultiheadAttention (dropout={rate}) is in training mode and needs a PRNG key for its \
attention-dropout mask.

    wrong:  model(x)
    right:  model(x, key=jax.random.key(step))       # a fresh key every step
""" + TRAINER_KEY + """\
       or:  ft.nn.inferring(model, x)                 # no dropout at inference
"""

BAD_DROPOUT = """\
MultiheadAttention dropout must be in [0, 1), got {rate}.

    wrong:  ft.nn.MultiheadAttention(..., dropout={rate}, key=k)
    right:  ft.nn.MultiheadAttention(..., dropout=0.1, key=k)
"""

CACHE_SELF_ONLY = """\
MultiheadAttention: a cache holds the layer's own past keys and values (self-attention), so \
keys= and values= cannot be passed with cache=.

    wrong:  out, cache = attn(x, memory, cache=cache, positions=pos)
    right:  out, cache = attn(x, cache=cache, positions=pos)
"""

CACHE_OPTION = """\
MultiheadAttention({option}) has no cache: the cached call reads x as [batch, T, features] and \
attends the cache's slots only.

    wrong:  out, cache = attn.replace({option})(x, cache=cache, positions=pos)
    right:  out, cache = attn.replace({right})(x, cache=cache, positions=pos)   # x: [batch, T, features]
"""

NEEDS_POSITIONS = """\
MultiheadAttention: cache= needs positions= (int32 [batch, T]: the absolute position of each \
token of x; its keys and values are written into the cache at those slots).

    wrong:  out, cache = attn(x, cache=cache)
    right:  out, cache = attn(x, cache=cache, positions=jnp.broadcast_to(jnp.arange(T), (batch, T)))
"""

POSITIONS_OUTSIDE_CACHE = """\
{who}: the positions given run from {low} to {high}, but the cache has {length} slots (0 to \
{last}). Keys and values written outside it are dropped (a negative position wraps to the \
last slots), so the output would attend to other tokens than those given.

{fix}"""

WEIGHTS_WITH_CACHE = """\
ft.nn.MultiheadAttention: return_weights=True with a cache: a cached call (generation) runs the \
fused kernel over the cache's slots, and returns no attention weights. Call it without the \
cache, over the whole sequence, to read them:

    wrong:  out, weights = attn(x, cache=cache, return_weights=True)
    right:  out, weights = attn(x, return_weights=True)     # [..., num_heads, queries, keys]"""

TORCH_CALL_ARGUMENT = """\
ft.nn.MultiheadAttention: {names} {are} torch's nn.MultiheadAttention.forward's; here {what}

{fixes}"""

# torch's forward keyword -> (what it is here, wrong, right). torch's boolean masks are True where
# a key is NOT attended, ft's `mask` True where it is: a mask passed over unchanged inverts it.
_TORCH_CALL: dict[str, tuple[str, str, str]] = {
    "key_padding_mask": (
        "mask= is True where attention is allowed (torch's bool masks: True where it is not), "
        "[..., num_heads, queries, keys]; a float one is bias=",
        "attn(q, k, v, key_padding_mask=pad)",
        "attn(q, k, v, mask=~pad[:, None, None, :])     # pad [N, S] bool, True at padding\n"
        "       or:  attn(q, k, v, bias=pad[:, None, None, :])      # pad [N, S] float, added to the logits"),
    "attn_mask": (
        "mask= is True where attention is allowed (torch's bool masks: True where it is not); "
        "a float one is bias=",
        "attn(q, k, v, attn_mask=m)",
        "attn(q, k, v, mask=~m)    # m [L, S] bool; [N * heads, L, S]: ~m.reshape(N, heads, L, S)\n"
        "       or:  attn(q, k, v, bias=m)     # m float, added to the scaled logits"),
    "is_causal": (
        "the causal band is an option of the layer",
        "attn(q, k, v, attn_mask=causal_mask, is_causal=True)",
        "ft.nn.MultiheadAttention(..., causal=True)(q, k, v)"),
    "need_weights": (
        "the call returns the output alone (torch's need_weights=False), or (output, weights) with "
        "return_weights=True, the weights per head [..., num_heads, queries, keys] (torch's "
        "average_attn_weights=False; its default averages them: weights.mean(-3))",
        "out, weights = attn(q, k, v, need_weights=True)",
        "out, weights = attn(q, k, v, return_weights=True)     # torch's average: weights.mean(-3)\n"
        "       or:  out = attn(q, k, v)      # need_weights=False (not `out, _ = attn(...)`: that unpacks the batch)"),
    "average_attn_weights": (
        "the call returns the output alone (torch's need_weights=False), or (output, weights) with "
        "return_weights=True, the weights per head [..., num_heads, queries, keys] (torch's "
        "average_attn_weights=False; its default averages them: weights.mean(-3))",
        "out, weights = attn(q, k, v, average_attn_weights=True)",
        "out, weights = attn(q, k, v, return_weights=True)     # torch's average: weights.mean(-3)\n"
        "       or:  out = attn(q, k, v)      # need_weights=False (not `out, _ = attn(...)`: that unpacks the batch)"),
}


def _torch_call_error(given: dict[str, Any]) -> TypeError:
    """The error of torch's forward keywords given to :meth:`MultiheadAttention.__call__`
    (:data:`TORCH_CALL_ARGUMENT`), or Python's own for another unexpected keyword."""
    unknown = [n for n in given if n not in _TORCH_CALL]
    if unknown:
        return TypeError(f"MultiheadAttention.__call__() got an unexpected keyword argument {unknown[0]!r}")
    rows = [_TORCH_CALL[n] for n in given]
    what = "; ".join(dict.fromkeys(r[0] for r in rows))
    fixes = "\n".join(f"    wrong:  {wrong}\n    right:  {right}" for _, wrong, right in dict.fromkeys(rows))
    names = ", ".join(f"{n}=" for n in given)
    return TypeError(TORCH_CALL_ARGUMENT.format(names=names, are="is" if len(given) == 1 else "are",
                                                what=what, fixes=fixes))


_LONGER_CACHE = """\
Make the cache long enough for the last position (ft.nn.generate sizes its own):
    wrong:  cache = model.init_cache({batch}, {length})      # positions up to {high}
    right:  cache = model.init_cache({batch}, {needed})"""

_SLOTS_FROM_ZERO = """\
Positions are cache slots, counted from 0 (the first token of a prompt at slot 0):
    wrong:  positions = jnp.arange(T) - 1
    right:  positions = jnp.broadcast_to(jnp.arange(T), (batch, T))      # the next call's from T on"""


def check_cache_positions(who: str, positions: jax.Array, length: int) -> None:
    """Refuse cache slots ``positions [batch, T]`` outside ``0 .. length - 1``
    (:data:`POSITIONS_OUTSIDE_CACHE`): the cache's scatter drops a write past its end and
    wraps a negative slot, silently. Concrete positions only: under a trace the values are
    unknown (``generate`` sizes its cache from the prompt and ``max_new_tokens``), and
    ``MultiheadAttention`` gives such a token a NaN output instead (:func:`_inside_cache`)."""
    given = concrete(positions)  # (NumPy's min: under another function's trace jnp's would be traced)
    if given is None or given.size == 0:
        return
    low, high = int(given.min()), int(given.max())
    if low < 0 or high >= length:
        fix = _SLOTS_FROM_ZERO if low < 0 else _LONGER_CACHE.format(batch=positions.shape[0], length=length,
                                                                    high=high, needed=high + 1)
        raise ValueError(POSITIONS_OUTSIDE_CACHE.format(who=who, low=low, high=high, length=length,
                                                        last=length - 1, fix=fix))


BAD_CACHE_INPUT = "With cache=, pass x as [batch, T, {size}] (one batch axis: the cache's)."

BAD_POSITIONS = "Pass integer positions [batch, T] (int32), one absolute position per token of x."

BAD_CACHE_MASK = """\
With cache=, mask= is over the cache's slots: bool (or 0/1 integers) [batch, max_length], \
True where a slot holds a real token; causality by position is added to it."""

BAD_CACHE = """\
Pass the cache this layer made for inputs of this batch size: keys [batch, max_length, \
num_kv_heads, qk_size], values [batch, max_length, num_kv_heads, vo_size].
    wrong:  out, cache = attn(x, cache=attn.init_cache({other}, 64), positions=pos)   # x: batch {batch}
    right:  out, cache = attn(x, cache=attn.init_cache({batch}, 64), positions=pos)"""

BAD_CACHE_SIZE = """\
{what}.init_cache(batch_size, max_length) takes positive ints, got batch_size={batch!r}, \
max_length={length!r}.

    right:  cache = {what_lower}.init_cache(8, 128)              # 8 sequences of up to 128 tokens
"""


class KVCache(Module):
    """One attention layer's keys and values by position: the key-value cache of decoding.

    ``keys`` is ``[batch, max_length, num_kv_heads, qk_size]`` and ``values`` ``[batch,
    max_length, num_kv_heads, vo_size]``; slot ``s`` holds the (rotated) key and the value of
    the token at absolute position ``s``. A Module, so it passes through ``jax.jit``,
    ``lax.scan`` (``ft.nn.Stack`` stacks one per member) and sharding like the model. Make one
    with :meth:`MultiheadAttention.init_cache`; ``attn(x, cache=cache, positions=pos)``
    returns the output and the cache with ``x``'s keys and values written at ``pos``.

    Example:
      >>> import functree as ft, jax
      >>> attn = ft.nn.MultiheadAttention(8, 4, num_kv_heads=2, key=jax.random.key(0))
      >>> cache = attn.init_cache(3, 16)              # 3 sequences of up to 16 tokens
      >>> cache.keys.shape, cache.values.dtype
      ((3, 16, 2, 2), dtype('float32'))
    """

    keys: jax.Array
    values: jax.Array

    def __init__(self, keys: jax.Array, values: jax.Array):
        self.keys, self.values = keys, values


class MultiheadAttention(Layer):
    """``softmax(Q K^T / sqrt(d) + mask) V`` per head, then an output projection.

    For each head ``h``: ``Q_h = query W_q[h]``, ``K_h = keys W_k[h]``, ``V_h = values W_v[h]``,
    ``A_h = softmax(Q_h K_h^T / sqrt(qk_size))`` (masked logits get a large finite negative,
    not ``-inf``: see below), and the result is ``concat_h(A_h V_h) W_o``. ``query`` is ``[..., queries, query_size]``,
    ``keys`` ``[..., keys, key_size]`` and ``values`` ``[..., keys, value_size]`` (both
    default to ``query``: self-attention). ``mask`` is boolean, broadcastable to
    ``[..., num_heads, queries, keys]``, True where attention is allowed; ``bias`` (floating,
    broadcastable to the same shape) is added to the scaled logits (torch's float ``attn_mask``:
    ``-inf`` never attends; computed with the explicit softmax, in float32 or wider).

    ``num_kv_heads=K`` (grouped-query attention, Ainslie et al. 2023; ``K = 1`` is
    multi-query attention) projects keys and values to ``K`` heads only; query head ``h``
    attends with key/value head ``h // (num_heads // K)`` (Hugging Face's ``repeat_kv``
    order). The default ``K = num_heads`` is ordinary multi-head attention.
    ``rotary=base`` (``True``: 10000) rotates each head's queries and keys by their
    positions ``0 .. T-1`` (:func:`ft.nn.apply_rotary`, the LLaMA / GPT-NeoX layout);
    ``rotary=ft.nn.RopeScaling(...)`` with scaled frequencies (Llama 3, YaRN, ...);
    ``rotary=(rope_0, rope_1, ...)`` (a tuple of RopeScalings) with the one each ``Stack``
    member's ``member_rope`` (a ``no_derivative`` int32 index, one per member) picks: Gemma
    3's local and global layers, each its own base and scaling. ``member_rotates`` (a
    ``no_derivative`` int32 scalar per member) leaves a member's queries and keys unrotated
    where 0 (SmolLM3's NoPE layers; the rotation computed and not selected, so the
    Stack's members stay one program).

    ``causal=True`` lets query ``i`` attend to keys ``j <= i`` only (combined with
    ``mask``). ``window=W`` (sliding-window attention, Mistral's) also drops keys ``j <= i - W``
    (by position in the sequence; with a cache, by slot): each query sees at most ``W`` keys.
    A query whose keys are all masked (its ``mask`` row all False, with the ``causal`` and
    ``window`` bands applied) is neither NaN nor zero: its logits are all the same large
    negative (JAX's convention; Hugging Face's eager attention in float32 does the same, and
    ports match it), so its weights are uniform and its output is ``W_o`` applied to the
    mean of *all* its keys' values, which also get its gradients. (HF's own attentions disagree
    there: its float64 eager gives NaN, its default ``sdpa`` other values; so a loss that reads
    a left-padded row's pad positions, a first real label predicted from a pad, is HF eager's
    float32 one.) torch's ``nn.MultiheadAttention`` gives the
    output bias there (NaN on its inference fast path). To zero such rows, with a ``mask``
    ``[batch, 1, queries, keys]`` shared by the heads (the bands applied to it first):
    ``y = jnp.where(mask.any(-1).swapaxes(-1, -2), y, 0.0)``; ``attn.output_projection.bias``
    in place of ``0.0`` gives torch's numbers.

    ``attn(q, k, v, return_weights=True)`` returns ``(output, weights)``: the attention
    weights per head, ``[..., num_heads, queries, keys]`` in float32 or wider, as they meet the
    values (torch's ``need_weights=True, average_attn_weights=False``; its default average
    over the heads is ``weights.mean(-3)``), from the explicit softmax; a cached call returns
    none (:data:`WEIGHTS_WITH_CACHE`).

    ``dropout=p`` drops attention weights with probability ``p`` (scaling the rest by ``1 / (1 - p)``) in training mode (``ft.nn.training``), which then needs
    ``key=``. Computed with ``jax.nn.dot_product_attention``; ``implementation="auto"`` (the
    default) runs cuDNN's flash attention on NVIDIA GPUs where it applies (bf16/fp16, head
    size a multiple of 8 up to 128, or 256 on Hopper; more than one query) and XLA's
    elsewhere; ``"xla"`` or ``"cudnn"`` force one (``"cudnn"`` where it cannot run is an
    error naming the constraint); None is JAX's own default (XLA).

    ``batch_first=False`` (torch's ``nn.MultiheadAttention`` default) reads ``query``,
    ``keys`` and ``values`` as ``[queries, *batch, features]`` (torch's ``[L, N, E]``; ``[L,
    E]`` unbatched is the same either way) and returns ``[queries, *batch, output_size]``: the
    sequence axis moved behind the batch axes and back, nothing else (``mask``, ``bias`` and
    ``positions`` keep their batch-first shapes, as torch's ``attn_mask`` ``[N * heads, L, S]``
    and ``key_padding_mask`` ``[N, S]`` do). ``add_zero_attn=True`` (torch's) appends a key
    and a value of zeros after the projections (after ``clip``, the norms and the rotation):
    every query also attends it, with logit 0, whatever ``mask``, ``bias``, ``causal`` or
    ``window`` say (their last key column padded with True / 0, the causal band made an
    explicit mask first), so ``softmax([l_1 .. l_S, 0])`` weighs ``V`` extended by a zero row.
    Neither is taken with a cache (:data:`CACHE_OPTION`).

    Decoding with a key-value cache (:class:`KVCache`): ``out, cache = attn(x, mask=m,
    cache=cache, positions=pos)`` with ``x [batch, T, query_size]`` and ``pos`` int32
    ``[batch, T]``, the absolute positions of ``x``'s tokens. Queries and keys are rotated
    by ``pos`` (with ``rotary``), ``x``'s keys and values are written into the cache at
    slots ``pos``, and each query attends the cache's slots ``s <= p`` (its own position
    ``p``; causal whatever ``causal`` says), restricted by ``mask`` (bool or 0/1 integers
    ``[batch, max_length]`` over slots, True where a slot holds a real token: left padding).
    A position outside the cache's slots ``0 .. max_length - 1`` is refused where it is
    concrete (:data:`POSITIONS_OUTSIDE_CACHE`); under ``jax.jit`` its query's output is NaN
    and its key and value are written nowhere (never an output over a cache that lacks its
    token, nor a write into another slot).
    ``rotary_positions=`` (with a cache) rotates by other positions than the slots (Hugging
    Face's ``cumsum(mask) - 1`` of a left-padded row: what dynamic NTK rope needs to equal it).
    ``attn.init_cache(batch_size, max_length)`` makes an empty cache (a worked example:
    ``docs/guides/generation.md``). Without a cache,
    ``positions=`` rotates self-attention's queries and keys by the given positions instead
    of ``0 .. T-1``.

    Options of the Hugging Face ports, None by default (none of them; set with
    ``attn.replace(...)``): ``logit_scale`` (a ``no_derivative`` float32 scalar, one per
    ``Stack`` member) gives the logits ``s q k^T`` in place of ``q k^T / sqrt(qk_size)``
    (GPT-2's ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx``; in the float32
    logits, except on cuDNN's kernel, which takes a Python float: there ``s`` is folded into
    the queries, in their dtype); ``member_window`` (a ``no_derivative`` int32 scalar per
    member) is a sliding window held as data, in place of ``window``, so that a Stack's
    members differ (Qwen2's mixed sliding and full layers; below 1: no window);
    ``clip=c`` (static) clamps the query, key and value projections' outputs to
    ``[-c, c]`` before the rotation (OLMo's ``clip_qkv``). None of them is a weight: a torch
    state dict has none. ``q_norm`` and ``k_norm`` (layers, e.g. ``ft.nn.RMSNorm``; weights,
    HF's ``self_attn.q_norm`` / ``k_norm``) normalize the queries and the keys after their
    projection, before the rotation: each head's ``qk_size`` features where
    ``qk_norm_per_head`` (the default: Qwen3, ``RMSNorm(qk_size)``), else the whole
    projection before it is split into heads (OLMo2, ``RMSNorm(num_heads * qk_size)`` and
    ``RMSNorm(num_kv_heads * qk_size)``); the values are not normalized. ``logit_softcap=c``
    (static; Gemma 2's ``attn_logit_softcapping``) caps the scaled logits ``l`` smoothly,
    ``c * tanh(l / c)``, before the mask: ``jax.nn.dot_product_attention`` (XLA's and
    cuDNN's kernels) has no soft-cap, so a capped attention always runs the explicit softmax
    (``implementation="cudnn"`` is refused there, never run without the cap).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> mha = ft.nn.MultiheadAttention(8, num_heads=2, causal=True, key=jax.random.key(0))
      >>> x = jnp.ones((3, 5, 8))                       # batch 3, 5 tokens
      >>> mha(x).shape
      (3, 5, 8)
      >>> causal = jnp.tril(jnp.ones((5, 5), bool))    # the same as an explicit mask
      >>> bool(jnp.allclose(mha(x), mha.replace(causal=False)(x, mask=causal)))
      True
      >>> gqa = ft.nn.MultiheadAttention(8, num_heads=4, num_kv_heads=2, key=jax.random.key(0))
      >>> gqa.key_projection.weight.shape, gqa(x).shape  # 2 key heads of size 2
      ((8, 4), (3, 5, 8))
      >>> seq_first = ft.nn.MultiheadAttention(8, 2, batch_first=False, key=jax.random.key(0))
      >>> y = seq_first(jnp.swapaxes(x, 0, 1))             # torch's [L, N, E]: 5 tokens, batch 3
      >>> y.shape, bool(jnp.allclose(jnp.swapaxes(y, 0, 1), seq_first.replace(batch_first=True)(x)))
      ((5, 3, 8), True)
    """

    query_projection: Dense
    key_projection: Dense
    value_projection: Dense
    output_projection: Dense
    num_heads: int = field(static=True, default=1)
    num_kv_heads: int = field(static=True, default=1)
    rotary: float | RopeScaling | tuple[RopeScaling, ...] | None = field(static=True, default=None)
    causal: bool = field(static=True, default=False)
    window: int | None = field(static=True, default=None)
    dropout: float = field(static=True, default=0.0)
    implementation: Literal["auto", "xla", "cudnn"] | None = field(static=True, default="auto")
    training: bool = field(static=True, default=False)
    # The no_derivative fields below are per-layer configuration (a Stack member's logit
    # scale, window, rope), never recorded in training mode: no running state for the
    # Trainer's FrozenStateWarning to name (ft.train._setup._records_state reads this).
    records_no_state: ClassVar[bool] = True
    logit_scale: jax.Array | None = field(no_derivative=True, default=None)
    member_window: jax.Array | None = field(no_derivative=True, default=None)
    member_rope: jax.Array | None = field(no_derivative=True, default=None)
    member_rotates: jax.Array | None = field(no_derivative=True, default=None)
    clip: float | None = field(static=True, default=None)
    q_norm: Any = None
    k_norm: Any = None
    qk_norm_per_head: bool = field(static=True, default=True)
    logit_softcap: float | None = field(static=True, default=None)
    batch_first: bool = field(static=True, default=True)
    add_zero_attn: bool = field(static=True, default=False)
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("dropout", "implementation")  # a restore's template decides them (how it trains, its kernel)
    # Fields added after checkpoints and pickles were written without them: read at their default (None).
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("logit_scale", "member_window", "clip", "q_norm", "k_norm",
                                                      "qk_norm_per_head", "logit_softcap", "member_rope",
                                                      "member_rotates", "batch_first", "add_zero_attn")

    def __init__(
        self,
        query_size: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        rotary: float | bool | RopeScaling | tuple[RopeScaling, ...] | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        implementation: Literal["auto", "xla", "cudnn"] | None = "auto",
        key: jax.Array,
        dtype: Any = jnp.float32,
        training: bool = False,
        window: int | None = None,
        batch_first: bool = True,
        add_zero_attn: bool = False,
    ):
        if window is not None and (not is_int(window) or window < 1):
            raise ValueError(BAD_WINDOW.format(given=window))
        query_size, = size_arguments("MultiheadAttention", query_size=query_size)
        key_size, value_size, output_size, qk_size, vo_size = optional_sizes(
            "MultiheadAttention", key_size=key_size, value_size=value_size, output_size=output_size, qk_size=qk_size,
            vo_size=vo_size)
        if not is_int(num_heads) or num_heads < 1:  # 0: ZeroDivisionError
            raise ValueError(BAD_NUM_HEADS.format(heads=num_heads, size=query_size))
        num_heads = int(num_heads)
        if (qk_size is None or vo_size is None) and query_size % num_heads:
            raise ValueError(BAD_HEADS.format(size=query_size, heads=num_heads))
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not is_int(kv_heads) or kv_heads < 1 or num_heads % kv_heads:
            wanted = kv_heads if is_int(kv_heads) else 1
            right = max(d for d in range(1, num_heads + 1) if num_heads % d == 0 and d <= max(wanted, 1))
            raise ValueError(BAD_KV_HEADS.format(kv=kv_heads, heads=num_heads, right=right))
        if not 0.0 <= dropout < 1.0:
            raise ValueError(BAD_DROPOUT.format(rate=dropout))
        key_size = query_size if key_size is None else key_size
        value_size = key_size if value_size is None else value_size
        output_size = query_size if output_size is None else output_size
        qk = query_size // num_heads if qk_size is None else qk_size
        vo = query_size // num_heads if vo_size is None else vo_size
        kq, kk, kv, ko = jax.random.split(one_key(key), 4)
        self.query_projection = Dense(query_size, num_heads * qk, use_bias=use_bias, key=kq, dtype=dtype)
        self.key_projection = Dense(key_size, kv_heads * qk, use_bias=use_bias, key=kk, dtype=dtype)
        self.value_projection = Dense(value_size, kv_heads * vo, use_bias=use_bias, key=kv, dtype=dtype)
        self.output_projection = Dense(num_heads * vo, output_size, use_bias=use_bias, key=ko, dtype=dtype)
        self.num_heads, self.num_kv_heads = num_heads, int(kv_heads)
        self.rotary = 10000.0 if rotary is True else (None if rotary is None or rotary is False else
                                                      tuple(rotary) if isinstance(rotary, (tuple, list)) else
                                                      rotary if isinstance(rotary, RopeScaling) else float(rotary))
        check_base(self.rotary, "ft.nn.MultiheadAttention", f"ft.nn.MultiheadAttention(..., rotary={rotary!r})",
                   "ft.nn.MultiheadAttention(..., rotary=10000.0)   # or rotary=True")
        self.causal, self.dropout = bool(causal), float(dropout)
        self.implementation = check_implementation(implementation)
        self.training = training
        self.window = None if window is None else int(window)
        self.batch_first, self.add_zero_attn = bool(batch_first), bool(add_zero_attn)

    def __call__(
        self,
        query: jax.Array,
        keys: jax.Array | None = None,
        values: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        key: jax.Array | None = None,
        cache: KVCache | None = None,
        positions: jax.Array | None = None,
        rotary_positions: jax.Array | None = None,
        bias: jax.Array | None = None,
        return_weights: bool = False,
        **torch_arguments: Any,
    ) -> Any:
        if torch_arguments:  # torch's forward keywords (key_padding_mask=, need_weights=...): named, translated
            raise _torch_call_error(torch_arguments)
        check_unbatched(self.query_projection, weight=2)  # an ensemble's layer outside jax.vmap (a cache's call too)
        if cache is not None:
            if return_weights:
                raise ValueError(WEIGHTS_WITH_CACHE)
            if bias is not None:
                raise ValueError(BIAS_WITH_CACHE)
            if not self.batch_first or self.add_zero_attn:
                option = "batch_first=False" if not self.batch_first else "add_zero_attn=True"
                right = "batch_first=True" if not self.batch_first else "add_zero_attn=False"
                raise ValueError(CACHE_OPTION.format(option=option, right=right))
            return self._cached(query, keys, values, mask, key, cache, positions, rotary_positions)
        self_attention = keys is None and values is None
        keys = query if keys is None else keys
        values = keys if values is None else values
        check_input(self, query, ("queries", self.query_projection.weight.shape[0]))
        check_input(self, keys, ("keys", self.key_projection.weight.shape[0]))
        check_input(self, values, ("keys", self.value_projection.weight.shape[0]))
        if not self.batch_first:  # torch's [L, *batch, E]: the sequence axis behind the batch axes
            query, keys, values = (jnp.moveaxis(a, 0, -2) for a in (query, keys, values))
        if positions is not None:
            if not self_attention:
                raise ValueError(POSITIONS_SELF_ONLY)
            positions = self._positions(positions, query.shape[:-1])
        q = self._project(query, self.query_projection, self.num_heads, self.q_norm)
        k = self._project(keys, self.key_projection, self.num_kv_heads, self.k_norm)
        v = self._heads(self.value_projection(values), self.num_kv_heads)
        if self.clip is not None:
            q, k, v = _clipped((q, k, v), self.clip)
        if self.rotary is not None:
            at = jnp.arange(q.shape[-3])[:, None] if positions is None else positions[..., None]
            q, k = self._rotated(q, k, at)
        lead = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        q, k, v = (jnp.broadcast_to(a, (*lead, *a.shape[-3:])) for a in (q, k, v))
        if mask is not None:
            self._check_mask(mask, (*lead, self.num_heads, q.shape[-3], k.shape[-3]))
        if bias is not None:
            self._check_mask(bias, (*lead, self.num_heads, q.shape[-3], k.shape[-3]), additive=True)
        if self.member_window is not None:  # a window held as data (a Stack member's own)
            band = _band(jnp.arange(k.shape[-3])[None], jnp.arange(q.shape[-3])[:, None], self.member_window)
            mask = band if mask is None else both(mask, band)
        elif self.window is not None:  # keys j > i - window (indices in the sequence)
            band = jnp.arange(k.shape[-3])[None] > jnp.arange(q.shape[-3])[:, None] - self.window
            mask = band if mask is None else both(mask, band)
        causal = self.causal
        if self.add_zero_attn:  # torch's: a zero key and value every query attends
            k, v, mask, bias = _zero_attention(k, v, mask, bias, q.shape[-3], causal)
            causal = False
        out, weights = self._attend(q, k, v, mask, causal, key, bias, return_weights)
        out = out if self.batch_first else jnp.moveaxis(out, -2, 0)
        return (out, weights) if return_weights else out

    def _rotated(self, q: jax.Array, k: jax.Array, at: jax.Array,
                 per_slot: bool = False) -> tuple[jax.Array, jax.Array]:
        """``q`` and ``k`` rotated at positions ``at`` (``per_slot``: ``at[..., None]``, the
        cached call's, taken per operand as before); a member whose ``member_rotates`` is
        0 keeps its own (a select: the unrotated values exactly)."""
        rotary = self.rotary
        assert rotary is not None  # (called where the attention rotates)
        rotated = tuple(apply_rotary(a, at[..., None] if per_slot else at, base=rotary, choice=self.member_rope)
                        for a in (q, k))
        if self.member_rotates is None:
            return rotated[0], rotated[1]
        rotates = self.member_rotates != 0
        return jnp.where(rotates, rotated[0], q), jnp.where(rotates, rotated[1], k)

    def _attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool,
        key: jax.Array | None, bias: jax.Array | None = None, return_weights: bool = False,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The projected output, and the attention weights where asked (the explicit softmax's)."""
        dropping = self.training and self.dropout > 0.0
        if dropping and key is None:
            raise ValueError(NO_KEY.format(rate=self.dropout))
        capped = self.logit_softcap is not None  # no kernel caps its logits: the explicit softmax
        biased = bias is not None  # the explicit softmax adds it in the logits' float32 (or float64)
        weights = None
        if (dropping or capped or biased or return_weights or q.shape[-1] != v.shape[-1]
                or q.dtype == jnp.float64):
            if self.implementation == "cudnn":
                why = ("attention dropout in training" if dropping else "a logit soft-cap (logit_softcap)" if capped
                       else "an additive bias (bias=)" if biased
                       else "the attention weights returned (return_weights=True)" if return_weights
                       else "float64 inputs" if q.dtype == jnp.float64 else "the value size differs from the query size")
                raise ValueError(CUDNN_DOES_NOT_APPLY.format(reason=why))
            out, weights = attention_weights_times_values(
                q, k, v, mask, causal, self.dropout if dropping else 0.0, key, self.logit_scale,
                bias=bias, **({"softcap": self.logit_softcap} if capped else {}), return_weights=True,
            )
        else:
            out = _fused_attention(q, k, v, mask, causal, self.implementation, self.logit_scale)
        out = self.output_projection(out.reshape((*out.shape[:-2], out.shape[-2] * out.shape[-1])))  # no -1: a batch may be empty
        return out, weights

    def _cached(
        self, query: jax.Array, keys: Any, values: Any, mask: Any, key: Any, cache: Any,
        positions: Any, rotary_positions: Any = None,
    ) -> tuple[jax.Array, KVCache]:
        if keys is not None or values is not None:
            raise ValueError(CACHE_SELF_ONLY)
        size = self.query_projection.weight.shape[0]
        check_input(self, query, ("batch", "T", size), leading="")
        if jnp.ndim(query) != 3:
            raise LayerInputError(self, f"[batch, T, {size}] (float)", short_array(query),
                                  BAD_CACHE_INPUT.format(size=size))
        batch, t = query.shape[:2]
        self._check_cache(cache, batch)
        length = cache.keys.shape[1]
        if positions is None:
            raise ValueError(NEEDS_POSITIONS)
        positions = self._positions(positions, (batch, t))
        check_cache_positions(type(self).__name__, positions, length)
        q = self._project(query, self.query_projection, self.num_heads, self.q_norm)
        k = self._project(query, self.key_projection, self.num_kv_heads, self.k_norm)
        v = self._heads(self.value_projection(query), self.num_kv_heads)
        if self.clip is not None:
            q, k, v = _clipped((q, k, v), self.clip)
        if self.rotary is not None:
            at = positions if rotary_positions is None else self._positions(rotary_positions, (batch, t))
            q, k = self._rotated(q, k, at, per_slot=True)
        inside = _inside_cache(positions, length)
        slots = positions if inside is None else jnp.where(inside, positions, length)  # outside: dropped, never wrapped
        cache = KVCache(_write(cache.keys, k, slots), _write(cache.values, v, slots))
        slot = jax.lax.broadcast_to_rank(jnp.arange(length, dtype=positions.dtype), positions.ndim + 1)  # (by hand: rank promotion may raise)
        allowed = slot <= positions[..., None]  # [batch, T, slots]
        if self.member_window is not None:  # a window held as data (a Stack member's own)
            allowed = allowed & _band(slot, positions[..., None], self.member_window)
        elif self.window is not None:
            allowed = allowed & (slot > positions[..., None] - self.window)
        if mask is not None:
            allowed = allowed & self._slot_mask(mask, batch, length)[:, None, :]
        ck, cv = (a.astype(q.dtype) for a in (cache.keys, cache.values))
        out = self._attend(q, ck, cv, allowed[:, None], False, key)[0]
        if inside is not None:  # a traced position outside the cache: NaN, never a valid-looking output
            out = jnp.where(inside[..., None], out, jnp.asarray(jnp.nan, out.dtype))
        return out, cache

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_length``
        tokens (``dtype``: the key projection's by default)."""
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (batch_size, max_length)):
            raise ValueError(BAD_CACHE_SIZE.format(what=type(self).__name__, what_lower="attn",
                                                   batch=batch_size, length=max_length))
        dtype = self.key_projection.weight.dtype if dtype is None else dtype
        kv = self.num_kv_heads
        qk = self.key_projection.weight.shape[-1] // kv
        vo = self.value_projection.weight.shape[-1] // kv
        return KVCache(jnp.zeros((batch_size, max_length, kv, qk), dtype),
                       jnp.zeros((batch_size, max_length, kv, vo), dtype))

    def _positions(self, positions: Any, shape: tuple[int, ...]) -> jax.Array:
        positions = jnp.asarray(positions)
        try:
            ok = jnp.issubdtype(positions.dtype, jnp.integer) and jnp.broadcast_shapes(positions.shape, shape) == shape
        except ValueError:
            ok = False
        if not ok:
            raise LayerInputError(self, f"positions {list(shape)} (int)", short_array(positions), BAD_POSITIONS)
        if positions.dtype.itemsize < 4 or jnp.issubdtype(positions.dtype, jnp.unsignedinteger):
            # int32: the cache's slots (jnp.arange(length, dtype=positions.dtype)) and a window's
            # positions - window would wrap in uint8 (slot 256 is slot 0; 1 - 2 is 255)
            positions = positions.astype(jnp.int32)
        return jnp.broadcast_to(positions, shape)

    def _check_cache(self, cache: Any, batch: int) -> None:
        kv = self.num_kv_heads
        qk = self.key_projection.weight.shape[-1] // kv
        vo = self.value_projection.weight.shape[-1] // kv
        ok = isinstance(cache, KVCache) and all(hasattr(a, "shape") for a in (cache.keys, cache.values))
        if ok:
            length = cache.keys.shape[1] if cache.keys.ndim == 4 else -1
            ok = (cache.keys.shape == (batch, length, kv, qk) and cache.values.shape == (batch, length, kv, vo)
                  and length >= 1)
        if not ok:
            given = (f"KVCache(keys={short_array(cache.keys)}, values={short_array(cache.values)})"
                     if isinstance(cache, KVCache) else f"a {type(cache).__name__}")
            expected = f"cache KVCache(keys [{batch}, max_length, {kv}, {qk}], values [{batch}, max_length, {kv}, {vo}])"
            raise LayerInputError(self, expected, given, BAD_CACHE.format(batch=batch, other=batch + 1))

    def _slot_mask(self, mask: Any, batch: int, length: int) -> jax.Array:
        mask = jnp.asarray(mask)
        kind = jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.integer)
        try:
            ok = kind and mask.ndim == 2 and jnp.broadcast_shapes(mask.shape, (batch, length)) == (batch, length)
        except ValueError:
            ok = False
        if not ok:
            raise LayerInputError(self, f"mask [{batch}, {length}] (bool)", short_array(mask), BAD_CACHE_MASK)
        return jnp.broadcast_to(mask if mask.dtype == jnp.bool_ else mask != 0, (batch, length))

    def _project(self, x: jax.Array, projection: Any, heads: int, norm: Any) -> jax.Array:
        """``projection(x)`` split into ``heads`` heads, ``norm`` applied (where not None)
        before the split or to each head (``qk_norm_per_head``); without a norm, the split alone."""
        y = projection(x)
        if norm is not None and not self.qk_norm_per_head:  # OLMo2: over the whole projection
            y = norm(y)
        y = self._heads(y, heads)
        if norm is not None and self.qk_norm_per_head:  # Qwen3: over each head's features
            y = norm(y)
        return y

    def _heads(self, x: jax.Array, heads: int | None = None) -> jax.Array:
        heads = self.num_heads if heads is None else heads
        return x.reshape((*x.shape[:-1], heads, x.shape[-1] // heads))  # no -1: a batch may be empty

    def _check_mask(self, mask: jax.Array, shape: tuple[int, ...], additive: bool = False) -> None:
        """A boolean ``mask`` (or, ``additive``, a floating ``bias``) broadcastable to ``shape``."""
        mask = jnp.asarray(mask)
        kind = jnp.floating if additive else jnp.bool_
        try:
            ok = jnp.issubdtype(mask.dtype, kind) and jnp.broadcast_shapes(mask.shape, shape) == shape
        except ValueError:
            ok = False
        if not ok:
            name, dtype = ("bias", "float") if additive else ("mask", "bool")
            raise LayerInputError(self, f"{name} broadcastable to {list(shape)} ({dtype})", short_array(mask),
                                  BAD_BIAS if additive else BAD_MASK)


def _zero_attention(k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None, queries: int,
                    causal: bool) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """torch's ``add_zero_attn``: ``k`` and ``v`` (``[..., keys, heads, size]``) with a key and
    a value of zeros appended, and the ``mask`` (the ``causal`` band made explicit first) and
    ``bias`` padded so that every query attends it (True; 0)."""
    keys = k.shape[-3]
    k, v = (jnp.concatenate([a, jnp.zeros((*a.shape[:-3], 1, *a.shape[-2:]), a.dtype)], axis=-3) for a in (k, v))
    if causal:  # JAX's band (key j <= query i), made a mask: the appended key lies outside it
        band = jnp.arange(keys)[None] <= jnp.arange(queries)[:, None]
        mask = band if mask is None else both(mask, band)
    padded = []
    for a, value in ((mask, True), (bias, 0)):
        if a is not None:
            a = jnp.broadcast_to(a, jnp.broadcast_shapes(jnp.shape(a), (queries, keys)))
            a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, 1)], constant_values=value)
        padded.append(a)
    return k, v, padded[0], padded[1]


def _clipped(arrays: tuple[jax.Array, ...], clip: float) -> tuple[jax.Array, ...]:
    """Each array clamped to ``[-clip, clip]`` (OLMo's ``clip_qkv``: torch's ``clamp_``)."""
    return tuple(jnp.clip(a, -jnp.asarray(clip, a.dtype), jnp.asarray(clip, a.dtype)) for a in arrays)


def _band(keys: jax.Array, queries: jax.Array, window: Any) -> jax.Array:
    """Keys ``j > i - window`` of query ``i`` (``window`` an int32 array: a Stack member's);
    a window below 1 allows every key (a full-attention member of a Stack whose other members
    slide)."""
    window = jnp.asarray(window, queries.dtype)
    return (keys > queries - window) | (window < 1)


def _inside_cache(positions: jax.Array, length: int) -> jax.Array | None:
    """``[batch, T]``: whether each traced position is a slot of a cache of ``length``; None
    for concrete ones (:func:`check_cache_positions` refused any outside). Under ``jax.jit``
    the scatter would drop a write past the end (the query then attends a cache without its
    own token) and wrap a negative slot onto the last ones, both silently: such a query's
    output is made NaN and its write dropped instead."""
    if not isinstance(positions, jax.core.Tracer):
        return None
    return (positions >= 0) & (positions < length)


def _write(buffer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """``buffer [batch, slots, ...]`` with ``new [batch, T, ...]`` written at slots ``positions``
    (a slot past the end: written nowhere, which :func:`_inside_cache` relies on)."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, positions].set(new.astype(buffer.dtype), mode="drop")


def _fused_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool,
    implementation: Any, scale: Any = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` on ``[..., T, N, H]`` heads (leading axes folded);
    ``scale``: the logits' factor (None: ``1 / sqrt(H)``).

    Called eagerly (no jaxpr built around: a notebook cell, an eager ``jax.grad``), its ~20
    operations were as many programs, each compiled again at every new length: there it
    runs as one compiled program per shapes and options (:func:`_fused_compiled`). Inside a
    caller's trace the operations are traced in place (the caller's program unchanged).
    cuDNN's kernel stays eager: a refusal while it compiles falls back to XLA's below."""
    if not staged() and choose(implementation, q, k, v, mask) != "cudnn":
        python_scale = scale is None or is_int(scale) or isinstance(scale, float)
        return _fused_compiled(q, k, v, mask, None if python_scale else scale, causal=causal,
                               implementation=implementation, python_scale=scale if python_scale else None)
    return _fused_traced(q, k, v, mask, causal, implementation, scale)


@functools.partial(jax.jit, static_argnames=("causal", "implementation", "python_scale"))
def _fused_compiled(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: Any, *, causal: bool,
                    implementation: Any, python_scale: Any) -> jax.Array:
    """:func:`_fused_traced` as one program per shapes (a Python ``scale`` compiled in, as
    the traced path sees it; an array one passed in)."""
    return _fused_traced(q, k, v, mask, causal, implementation, python_scale if scale is None else scale)


def _fused_traced(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool,
    implementation: Any, scale: Any = None,
) -> jax.Array:
    """The operations of :func:`_fused_attention`, traced (or run) where they are called."""
    lead, (t, n), s = q.shape[:-3], q.shape[-3:-1], k.shape[-3]
    batch = math.prod(lead)
    q4, k4, v4 = (a.reshape((batch, *a.shape[-3:])) for a in (q, k, v))
    if mask is not None and mask.ndim > 3:
        mask = jnp.broadcast_to(mask, (*lead, n, t, s)).reshape((batch, n, t, s))
    chosen = choose(implementation, q4, k4, v4, mask)
    if q4.dtype == jnp.float16 and chosen != "cudnn" and jax.default_backend() == "cpu":
        # XLA's CPU dot has no F16_F16_F32 algorithm (what JAX asks for float16): products of
        # float16 values are exact in float32, so float32 inputs compute the same logits.
        out = _fused_traced(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask, causal,
                            "xla", scale)
        return out.astype(q.dtype)
    one_row = batch * t * k4.shape[-2] == 1
    # Strict promotion: jax.nn.dot_product_attention's backward pass, lowered outside the
    # "standard" block below, has a float32-by-bfloat16 dot that strict promotion refuses.
    strict = jax.config.jax_numpy_dtype_promotion == "strict"  # pyright: ignore[reportAttributeAccessIssue]
    if q4.dtype == jnp.bfloat16 and chosen != "cudnn" and ((jax.default_backend() == "cpu" and one_row) or strict):
        # One query row per key/value head (batch, length and key/value heads all 1): XLA's
        # CPU compiler lowers the logits' dot with an emitter that has no BF16_BF16_F32
        # algorithm (what JAX asks for bfloat16) and refuses the program (raw
        # jax.nn.dot_product_attention too). The explicit computation is the same math:
        # float32 logits of exact bf16 products, a float32 softmax, bf16 weights against v.
        return attention_weights_times_values(q, k, v, mask, causal, scale=scale)
    if scale is not None and not is_int(scale) and not isinstance(scale, float) and chosen == "cudnn":
        # cuDNN's kernel takes a Python float: a traced scale goes into the queries (their dtype)
        q4, scale = (q4.astype(jnp.float32) * scale).astype(q4.dtype), 1.0
    # JAX promotes to float32 logits internally; allow that under the strict promotion
    # users may set (bfloat16 and float64 inputs would fail there otherwise).
    with jax.numpy_dtype_promotion("standard"):
        try:
            out = jax.nn.dot_product_attention(q4, k4, v4, mask=mask, is_causal=causal, implementation=chosen,
                                               scale=scale)
        except (NotImplementedError, ValueError, RuntimeError):
            if implementation != "auto" or chosen != "cudnn":
                raise
            # cuDNN refused while tracing (its version, a GPU rule not checked above): XLA.
            out = jax.nn.dot_product_attention(q4, k4, v4, mask=mask, is_causal=causal, implementation="xla",
                                               scale=scale)
    return out.reshape((*lead, t, n, v.shape[-1]))


def attention_weights_times_values(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool,
    dropout: float = 0.0, key: jax.Array | None = None, scale: Any = None, softcap: float | None = None,
    bias: jax.Array | None = None, return_weights: bool = False,
) -> Any:
    """The explicit computation ``softmax(q k^T / sqrt(d), masked) v`` on ``[..., T, N, H]``
    (``scale``: ``softmax(scale q k^T)``; ``softcap=c``: the scaled logits ``l`` capped to
    ``c * tanh(l / c)`` in float32 before the mask, Gemma 2's ``attn_logit_softcapping``;
    ``bias``: added to the scaled (capped) logits, broadcast to ``[..., heads, queries, keys]``:
    torch's float ``attn_mask``).

    With ``dropout > 0`` the attention weights are dropped (probability ``dropout``) and
    the rest scaled by ``1 / (1 - dropout)``. Masked logits get the logits dtype's lowest
    value. As ``jax.nn.dot_product_attention`` (the fused path): the logits accumulate, and
    the softmax and dropout run, in float32 or wider (bfloat16 logits and softmax were 3x
    further from float32's output); the weights meet ``v`` in ``v``'s dtype. With
    ``return_weights=True``: ``(out, weights)``, the weights ``[..., heads, queries, keys]``
    as they meet ``v`` (dropped where dropout drops them, as torch's), in float32 or wider.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = k = v = jax.random.normal(jax.random.key(0), (4, 2, 3))   # T=4, N=2, H=3
      >>> out = attention_weights_times_values(q, k, v, None, causal=True)
      >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-6))
      True
    """
    if k.shape[-2] != q.shape[-2]:  # grouped-query: each key/value head serves a group of queries
        k, v = (jnp.repeat(a, q.shape[-2] // a.shape[-2], axis=-2) for a in (k, v))
    wide = statistics_dtype(q.dtype)  # float32, or float64 for float64
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=wide)
    if scale is None:
        logits = logits / jnp.sqrt(jnp.asarray(q.shape[-1], logits.dtype))
    else:
        logits = logits * jnp.asarray(scale, logits.dtype)
    if softcap is not None:  # smooth cap: |logits| < c, unchanged near 0 (slope 1)
        cap = jnp.asarray(softcap, logits.dtype)
        logits = cap * jnp.tanh(logits / cap)
    if bias is not None:
        logits = logits + jax.lax.broadcast_to_rank(bias.astype(logits.dtype), logits.ndim)
    allowed = None if mask is None else jax.lax.broadcast_to_rank(mask, logits.ndim)
    if causal:
        tril = jax.lax.broadcast_to_rank(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits.ndim)
        allowed = tril if allowed is None else allowed & tril
    if allowed is not None:
        logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if dropout > 0.0:
        assert key is not None
        keep = jax.random.bernoulli(flat_key(key), 1.0 - dropout, weights.shape)  # functree/_random.py
        weights = jnp.where(keep, weights / jnp.asarray(1.0 - dropout, weights.dtype), jnp.zeros((), weights.dtype))
    out = jnp.einsum("...hqk,...khd->...qhd", weights.astype(v.dtype), v)
    return (out, weights) if return_weights else out
