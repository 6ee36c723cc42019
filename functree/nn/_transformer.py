"""torch's ``nn.Transformer`` family: encoder and decoder layers, their stacks, the whole model.

Vaswani et al. (2017), as torch builds it. An encoder layer is, post-norm (torch's default)::

    x = norm1(x + dropout1(self_attn(x, x, x)))
    x = norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))

and pre-norm (``norm_first=True``) ``x = x + dropout1(self_attn(norm1(x)))``, then
``x = x + dropout2(ff(norm2(x)))``. A decoder layer adds, between the two, attention over
the encoder's output ``memory`` (``multihead_attn``, ``norm2``, ``dropout2``; its
feed-forward's norm and dropout are ``norm3`` and ``dropout3``). The fields carry torch's
names, so a torch state dict's names are the model's key paths (``layers.0.self_attn.in_proj_weight``,
``layers.0.linear1.weight``, ``norm.weight``): ``ft.nn.load_torch_state_dict`` reads one and
``ft.nn.torch_state_dict`` writes one torch loads strictly. The stacks are ``ft.nn.Stack``s
(one compiled layer, ``lax.scan`` over the members).

Masks as torch takes them: ``*_mask`` is ``[L, S]`` or ``[N * nhead, L, S]`` and a
``*_key_padding_mask`` ``[N, S]``; boolean ones are True where attention is *not* allowed
(torch's sense, the opposite of ``ft.nn.MultiheadAttention``'s ``mask``), floating ones are
added to the scaled logits (``generate_square_subsequent_mask``'s ``-inf``). ``is_causal=True``
applies the causal mask along with the mask given (torch takes it as a hint that the mask is
that one); without the mask it is refused, as torch 2.13 refuses it (:data:`CAUSAL_NEEDS_MASK`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functree._activations import activation_argument, gelu_exact, relu
from functree._module import Module, field
from functree._random import one_key
from functree._repr import short_array
from functree.nn._attention import MultiheadAttention
from functree.nn._check import LayerInputError, check_unbatched, size_argument, size_arguments
from functree.nn._dropout import Dropout
from functree.nn._linear import Dense
from functree.nn._mode import Layer
from functree.nn._normalization import LayerNorm
from functree.nn._stack import Stack
from functree.nn._window import is_int

__all__ = [
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "generate_square_subsequent_mask",
]

BAD_NHEAD = """\
{cls}: d_model ({d_model}) must be divisible by nhead ({nhead}): each head attends over \
d_model // nhead features.

    wrong:  ft.nn.{cls}(d_model={d_model}, nhead={nhead}, key=k)
    right:  ft.nn.{cls}(d_model={d_model}, nhead={right}, key=k)"""

BAD_ACTIVATION = """\
{cls}: activation must be "relu", "gelu" (torch's exact GELU: ft.nn.gelu_exact) or a \
function, got {given!r}.

    wrong:  ft.nn.{cls}(..., activation={given!r})
    right:  ft.nn.{cls}(..., activation="gelu")        # or activation=ft.nn.silu"""

BAD_RANK = ("Pass [L, N, E] (batch_first=False, torch's default), [N, L, E] (batch_first=True) or one "
            "unbatched sequence [L, E], E = d_model.")

BAD_ATTN_MASK = ("Pass {name} as torch takes it: [L, S] (one for every sequence and head) or [N * nhead, L, S] "
                 "(sequence n's head h at n * nhead + h); bool (True: not attended) or float (added to the "
                 "logits), e.g. {name}=ft.nn.Transformer.generate_square_subsequent_mask(L).")

BAD_PADDING_MASK = ("Pass {name} [N, S] (one row per sequence; [S] for an unbatched one): bool (True: "
                    "the key is padding, never attended) or float (added to the logits).")

BATCH_MISMATCH = """\
{cls}: the batch of {first} ({a}) differs from that of {second} ({b}) (batch_first={batch_first}: \
the batch is axis {axis}).

    wrong:  model(src, tgt)     # src {src_shape}, tgt {tgt_shape}
    right:  model(src, tgt)     # both [{layout}] with one N"""

CAUSAL_NEEDS_MASK = """\
{cls}: {flag}=True is torch's hint that {name} is the causal mask, and {name} is not given; torch \
2.13 raises there ("Need attn_mask if specifying the is_causal hint") rather than guess. Pass the \
mask itself (the hint may stay):

    wrong:  {call}({flag}=True)
    right:  {call}({name}=ft.nn.Transformer.generate_square_subsequent_mask(L), {flag}=True)   # L: {what}"""

_CALLS = {"TransformerEncoder": "encoder(src, ", "TransformerDecoderLayer": "layer(tgt, memory, ",
          "TransformerDecoder": "decoder(tgt, memory, ", "Transformer": "model(src, tgt, "}

_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {"relu": relu, "gelu": gelu_exact}


def generate_square_subsequent_mask(size: int, dtype: Any = jnp.float32) -> jax.Array:
    """torch's causal mask: ``[size, size]`` floats, ``-inf`` above the diagonal, 0 on and below.

    Query ``i`` attends keys ``j <= i`` (``nn.Transformer.generate_square_subsequent_mask``).

    Example:
      >>> import functree as ft
      >>> ft.nn.Transformer.generate_square_subsequent_mask(3)
      Array([[  0., -inf, -inf],
             [  0.,   0., -inf],
             [  0.,   0.,   0.]], dtype=float32)
    """
    return jnp.triu(jnp.full((size, size), -jnp.inf, dtype), k=1)


def _activation(cls: str, activation: Any) -> Callable[[Any], Any]:
    """torch's two names (:data:`BAD_ACTIVATION` for another), else every layer's rule
    (:func:`~functree._activations.activation_argument`: a function, or None for none)."""
    if isinstance(activation, str):
        if activation in _ACTIVATIONS:
            return _ACTIVATIONS[activation]
        raise ValueError(BAD_ACTIVATION.format(cls=cls, given=activation))
    return activation_argument(cls, activation)


def _causal_needs_mask(module: Any, flag: str, name: str, is_causal: Any, mask: Any, what: str) -> None:
    """Refuse ``flag=True`` without the mask ``name`` (torch's hint with nothing to hint at)."""
    if is_causal and mask is None:
        cls = type(module).__name__
        call = _CALLS.get(cls, "layer(src, ")
        raise ValueError(CAUSAL_NEEDS_MASK.format(cls=cls, flag=flag, name=name, call=call, what=what))


def _decoder_hints(module: Any, tgt_mask: Any, memory_mask: Any, tgt_is_causal: Any, memory_is_causal: Any) -> None:
    _causal_needs_mask(module, "tgt_is_causal", "tgt_mask", tgt_is_causal, tgt_mask, "the target's length")
    _causal_needs_mask(module, "memory_is_causal", "memory_mask", memory_is_causal, memory_mask,
                       "the target's length; memory_mask is [L, S]")


def _checked_sizes(cls: str, d_model: Any, nhead: Any, dim_feedforward: Any) -> tuple[int, int, int]:
    """The sizes as Python ints, each named at the call when it is none
    (:data:`BAD_SIZE_ARGUMENT`, :data:`BAD_NHEAD`)."""
    d_model, dim_feedforward = size_arguments(cls, d_model=d_model, dim_feedforward=dim_feedforward)
    _check_heads(cls, d_model, nhead)
    return d_model, int(nhead), dim_feedforward


def _check_heads(cls: str, d_model: int, nhead: Any) -> None:
    if not is_int(nhead) or nhead < 1 or d_model % nhead:
        right = max(h for h in range(1, d_model + 1) if d_model % h == 0 and h <= max(int(nhead) if is_int(nhead) else 1, 1))
        raise ValueError(BAD_NHEAD.format(cls=cls, d_model=d_model, nhead=nhead, right=right))


def _batch_major(layer: Any, x: Any, batch_first: bool, d_model: int) -> jax.Array:
    """``x`` as ``[N, L, E]``: torch's ``[L, N, E]`` transposed, an unbatched ``[L, E]`` one
    sequence."""
    x = jnp.asarray(x)
    if x.ndim not in (2, 3) or x.shape[-1] != d_model or not jnp.issubdtype(x.dtype, jnp.floating):
        layout = "N, L" if batch_first else "L, N"
        raise LayerInputError(layer, f"[{layout}, {d_model}] or [L, {d_model}] (float)", short_array(x), BAD_RANK)
    if x.ndim == 2:
        return x[None]
    return x if batch_first else jnp.swapaxes(x, 0, 1)


def _batch_back(y: jax.Array, like: jax.Array, batch_first: bool) -> jax.Array:
    if jnp.ndim(like) == 2:
        return y[0]
    return y if batch_first else jnp.swapaxes(y, 0, 1)


def attention_masks(
    layer: Any, names: tuple[str, str], attn_mask: Any, key_padding_mask: Any, is_causal: bool | None,
    batch: int, heads: int, queries: int, keys: int,
) -> tuple[jax.Array | None, jax.Array | None]:
    """torch's masks as ``(mask, bias)`` for ``ft.nn.MultiheadAttention``: the boolean ones
    and the causal band joined into one ``mask`` (True = attend), the floating ones summed
    into one additive ``bias``, each ``[N, nhead or 1, L, S]`` or None."""
    allowed: list[jax.Array] = []
    added: list[jax.Array] = []

    def take(m: jax.Array) -> None:
        if m.dtype == jnp.bool_:
            allowed.append(~m)  # torch's True: not attended
        else:
            added.append(m)

    if attn_mask is not None:
        m = jnp.asarray(attn_mask)
        fits = {(queries, keys): lambda a: a, (batch * heads, queries, keys): lambda a: a.reshape(batch, heads, queries, keys)}
        if not _mask_dtype(m) or m.shape not in fits:
            expected = f"{names[0]} [{queries}, {keys}] or [{batch * heads}, {queries}, {keys}] (bool or float)"
            raise LayerInputError(layer, expected, short_array(m), BAD_ATTN_MASK.format(name=names[0]))
        take(fits[m.shape](m))
    if key_padding_mask is not None:
        m = jnp.asarray(key_padding_mask)
        if not _mask_dtype(m) or m.shape not in [(batch, keys)] + ([(keys,)] if batch == 1 else []):
            expected = f"{names[1]} [{batch}, {keys}] (bool or float)"
            raise LayerInputError(layer, expected, short_array(m), BAD_PADDING_MASK.format(name=names[1]))
        take(m.reshape(batch, 1, 1, keys))
    if is_causal:
        allowed.append(jnp.tril(jnp.ones((queries, keys), bool)))
    mask = None
    for a in allowed:  # (each [L, S] or [N, nhead or 1, L, S]: broadcast by hand, rank promotion may raise)
        a = jax.lax.broadcast_to_rank(a, 4)
        mask = a if mask is None else mask & a
    bias = None
    if added:  # summed in their widest dtype, as torch's type promotion (a float16 mask kept a float32 one's digits)
        with jax.numpy_dtype_promotion("standard"):  # the type lattice, named here; nothing is added implicitly
            dtype = functools.reduce(jnp.promote_types, [b.dtype for b in added])
        bias = functools.reduce(jnp.add, [jax.lax.broadcast_to_rank(b.astype(dtype), 4) for b in added])
    return mask, bias


def _mask_dtype(m: jax.Array) -> bool:
    return m.dtype == jnp.bool_ or jnp.issubdtype(m.dtype, jnp.floating)


def _keys(key: jax.Array | None, n: int) -> tuple[jax.Array | None, ...]:
    """``n`` keys for the dropouts (None without a key: inference needs none)."""
    return (None,) * n if key is None else tuple(jax.random.split(one_key(key), n))


class TransformerEncoderLayer(Layer):
    """torch's ``nn.TransformerEncoderLayer``: self-attention, then a feed-forward block.

    Post-norm (``norm_first=False``, torch's default)::

        x = norm1(x + dropout1(self_attn(x)))
        x = norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))

    pre-norm: ``x = x + dropout1(self_attn(norm1(x)))``, ``x = x + dropout2(ff(norm2(x)))``.
    Arguments as torch's (``d_model``, ``nhead``, ``dim_feedforward=2048``, ``dropout=0.1``,
    ``activation="relu"`` or ``"gelu"`` (exact, torch's) or a function, ``layer_norm_eps``,
    ``batch_first=False``, ``norm_first``, ``bias``), and ``key=``. Inputs are ``[L, N, E]``
    (``batch_first=False``, torch's default), ``[N, L, E]`` or ``[L, E]``. The call is torch's
    ``layer(src, src_mask, src_key_padding_mask, is_causal)`` (masks: the module docstring),
    with ``key=`` for the dropouts in training mode (``ft.nn.training``). Fields and state-dict
    names are torch's (``self_attn``, ``linear1``, ``norm1`` ...). A query whose every key is
    masked by boolean masks attends all keys evenly (``ft.nn.MultiheadAttention``'s
    convention; torch gives NaN there); by a float ``-inf`` mask, NaN as torch.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> layer = ft.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, key=jax.random.key(0))
      >>> x = jnp.ones((3, 5, 8))                          # 3 sequences of 5 tokens
      >>> padding = jnp.array([5, 4, 2])[:, None] <= jnp.arange(5)[None]   # True: padding
      >>> layer(x, src_key_padding_mask=padding).shape
      (3, 5, 8)
      >>> sorted(ft.nn.torch_state_dict(layer, numpy=True))[:3]
      ['linear1.bias', 'linear1.weight', 'linear2.bias']
    """

    self_attn: MultiheadAttention
    linear1: Dense
    dropout: Dropout
    linear2: Dense
    norm1: LayerNorm
    norm2: LayerNorm
    dropout1: Dropout
    dropout2: Dropout
    activation: Callable[[Any], Any] = field(static=True, default=relu)
    norm_first: bool = field(static=True, default=False)
    batch_first: bool = field(static=True, default=False)

    def __init__(
        self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: str | Callable[[Any], Any] = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
        norm_first: bool = False, bias: bool = True, *, key: jax.Array, dtype: Any = jnp.float32,
    ):
        d_model, nhead, dim_feedforward = _checked_sizes(type(self).__name__, d_model, nhead, dim_feedforward)
        ka, k1, k2 = jax.random.split(one_key(key), 3)
        self.self_attn = MultiheadAttention(d_model, nhead, use_bias=bias, dropout=dropout, key=ka, dtype=dtype)
        self.linear1 = Dense(d_model, dim_feedforward, use_bias=bias, key=k1, dtype=dtype)
        self.linear2 = Dense(dim_feedforward, d_model, use_bias=bias, key=k2, dtype=dtype)
        self.norm1, self.norm2 = (LayerNorm(d_model, layer_norm_eps, use_offset=bias, dtype=dtype) for _ in range(2))
        self.dropout, self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout), Dropout(dropout)
        self.activation = _activation(type(self).__name__, activation)
        self.norm_first, self.batch_first = bool(norm_first), bool(batch_first)

    def __call__(
        self, src: Any, src_mask: Any | None = None, src_key_padding_mask: Any | None = None,
        is_causal: bool | None = False, *, key: jax.Array | None = None,
    ) -> jax.Array:
        check_unbatched(self.linear1, weight=2)  # an ensemble's layer outside jax.vmap (d_model read below)
        _causal_needs_mask(self, "is_causal", "src_mask", is_causal, src_mask, "the source's length")
        x = _batch_major(self, src, self.batch_first, self.linear1.weight.shape[0])
        n, length = x.shape[:2]
        mask, bias = attention_masks(self, ("src_mask", "src_key_padding_mask"), src_mask, src_key_padding_mask,
                                     is_causal, n, self.self_attn.num_heads, length, length)
        ka, k0, k1, k2 = _keys(key, 4)

        def attend(h: jax.Array) -> jax.Array:
            return self.dropout1(self.self_attn(h, mask=mask, bias=bias, key=ka), key=k1)

        def feed_forward(h: jax.Array) -> jax.Array:
            return self.dropout2(_feed_forward(self, h, k0), key=k2)

        if self.norm_first:
            x = x + attend(self.norm1(x))
            x = x + feed_forward(self.norm2(x))
        else:
            x = self.norm1(x + attend(x))
            x = self.norm2(x + feed_forward(x))
        return _batch_back(x, src, self.batch_first)


def _feed_forward(layer: Any, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """``linear2(dropout(activation(linear1(x))))``."""
    return layer.linear2(layer.dropout(layer.activation(layer.linear1(x)), key=key))


class TransformerDecoderLayer(Layer):
    """torch's ``nn.TransformerDecoderLayer``: self-attention, attention over ``memory``, feed-forward.

    Post-norm (torch's default)::

        x = norm1(x + dropout1(self_attn(x)))
        x = norm2(x + dropout2(multihead_attn(x, memory)))
        x = norm3(x + dropout3(linear2(dropout(activation(linear1(x))))))

    pre-norm (``norm_first=True``): ``x = x + dropout1(self_attn(norm1(x)))`` and so on.
    Arguments as :class:`TransformerEncoderLayer`'s; the call is torch's ``layer(tgt, memory,
    tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal,
    memory_is_causal)``, ``memory`` in ``tgt``'s layout (``[S, N, E]``, ``[N, S, E]`` or ``[S, E]``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> layer = ft.nn.TransformerDecoderLayer(8, 2, dim_feedforward=16, key=jax.random.key(0))
      >>> tgt, memory = jnp.ones((4, 3, 8)), jnp.ones((6, 3, 8))   # [L, N, E], [S, N, E]
      >>> layer(tgt, memory, tgt_mask=ft.nn.Transformer.generate_square_subsequent_mask(4), tgt_is_causal=True).shape
      (4, 3, 8)
    """

    self_attn: MultiheadAttention
    multihead_attn: MultiheadAttention
    linear1: Dense
    dropout: Dropout
    linear2: Dense
    norm1: LayerNorm
    norm2: LayerNorm
    norm3: LayerNorm
    dropout1: Dropout
    dropout2: Dropout
    dropout3: Dropout
    activation: Callable[[Any], Any] = field(static=True, default=relu)
    norm_first: bool = field(static=True, default=False)
    batch_first: bool = field(static=True, default=False)

    def __init__(
        self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: str | Callable[[Any], Any] = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
        norm_first: bool = False, bias: bool = True, *, key: jax.Array, dtype: Any = jnp.float32,
    ):
        d_model, nhead, dim_feedforward = _checked_sizes(type(self).__name__, d_model, nhead, dim_feedforward)
        ks, km, k1, k2 = jax.random.split(one_key(key), 4)
        self.self_attn = MultiheadAttention(d_model, nhead, use_bias=bias, dropout=dropout, key=ks, dtype=dtype)
        self.multihead_attn = MultiheadAttention(d_model, nhead, use_bias=bias, dropout=dropout, key=km, dtype=dtype)
        self.linear1 = Dense(d_model, dim_feedforward, use_bias=bias, key=k1, dtype=dtype)
        self.linear2 = Dense(dim_feedforward, d_model, use_bias=bias, key=k2, dtype=dtype)
        self.norm1, self.norm2, self.norm3 = (LayerNorm(d_model, layer_norm_eps, use_offset=bias, dtype=dtype)
                                              for _ in range(3))
        self.dropout, self.dropout1, self.dropout2, self.dropout3 = (Dropout(dropout) for _ in range(4))
        self.activation = _activation(type(self).__name__, activation)
        self.norm_first, self.batch_first = bool(norm_first), bool(batch_first)

    def __call__(
        self, tgt: Any, memory: Any, tgt_mask: Any | None = None,
        memory_mask: Any | None = None, tgt_key_padding_mask: Any | None = None,
        memory_key_padding_mask: Any | None = None, tgt_is_causal: bool | None = False,
        memory_is_causal: bool = False, *, key: jax.Array | None = None,
    ) -> jax.Array:
        check_unbatched(self.linear1, weight=2)  # an ensemble's layer outside jax.vmap
        d_model = self.linear1.weight.shape[0]
        _decoder_hints(self, tgt_mask, memory_mask, tgt_is_causal, memory_is_causal)
        x = _batch_major(self, tgt, self.batch_first, d_model)
        mem = _batch_major(self, memory, self.batch_first, d_model)
        (n, length), source = x.shape[:2], mem.shape[1]
        if mem.shape[0] != n:
            raise ValueError(_mismatch(self, "tgt", "memory", tgt, memory))
        heads = self.self_attn.num_heads
        self_masks = attention_masks(self, ("tgt_mask", "tgt_key_padding_mask"), tgt_mask, tgt_key_padding_mask,
                                     tgt_is_causal, n, heads, length, length)
        cross_masks = attention_masks(self, ("memory_mask", "memory_key_padding_mask"), memory_mask,
                                      memory_key_padding_mask, memory_is_causal, n, heads, length, source)
        ks, km, k0, k1, k2, k3 = _keys(key, 6)

        def attend(h: jax.Array) -> jax.Array:
            mask, bias = self_masks
            return self.dropout1(self.self_attn(h, mask=mask, bias=bias, key=ks), key=k1)

        def attend_memory(h: jax.Array) -> jax.Array:
            mask, bias = cross_masks
            return self.dropout2(self.multihead_attn(h, mem, mask=mask, bias=bias, key=km), key=k2)

        def feed_forward(h: jax.Array) -> jax.Array:
            return self.dropout3(_feed_forward(self, h, k0), key=k3)

        if self.norm_first:
            x = x + attend(self.norm1(x))
            x = x + attend_memory(self.norm2(x))
            x = x + feed_forward(self.norm3(x))
        else:
            x = self.norm1(x + attend(x))
            x = self.norm2(x + attend_memory(x))
            x = self.norm3(x + feed_forward(x))
        return _batch_back(x, tgt, self.batch_first)


def _mismatch(layer: Any, first: str, second: str, a: jax.Array, b: jax.Array) -> str:
    batch_first = getattr(layer, "batch_first", False)
    axis = 0 if batch_first or a.ndim == 2 else 1
    return BATCH_MISMATCH.format(cls=type(layer).__name__, first=first, second=second,
                                 a=a.shape[axis] if a.ndim == 3 else 1, b=b.shape[axis] if b.ndim == 3 else 1,
                                 batch_first=batch_first, axis=axis, src_shape=list(a.shape), tgt_shape=list(b.shape),
                                 layout="N, L, E" if batch_first else "L, N, E")


def _stacked(cls: str, layer: Any, num_layers: int, key: jax.Array | None) -> Stack:
    """``num_layers`` members: copies of ``layer`` (torch's clones: equal weights), or
    ``layer(k)`` for ``num_layers`` keys split from ``key`` (a function: drawn apart)."""
    num_layers = size_argument(cls, "num_layers", num_layers, 1)
    if isinstance(layer, Module):
        return Stack.from_layers([layer] * num_layers)
    if key is None:
        raise ValueError(NEEDS_KEY)
    return Stack(layer, num_layers, key=key)


NEEDS_KEY = """\
ft.nn.TransformerEncoder / TransformerDecoder: a function making a layer needs key= (split into \
one key per member).

    wrong:  ft.nn.TransformerEncoder(lambda k: ft.nn.TransformerEncoderLayer(64, 4, key=k), 6)
    right:  ft.nn.TransformerEncoder(lambda k: ft.nn.TransformerEncoderLayer(64, 4, key=k), 6, key=key)
       or:  ft.nn.TransformerEncoder(layer, 6)     # 6 copies of one layer, as torch's clones"""


class TransformerEncoder(Layer):
    """torch's ``nn.TransformerEncoder``: ``num_layers`` encoder layers in turn, then ``norm``.

    ``TransformerEncoder(encoder_layer, num_layers, norm=None)``: ``encoder_layer`` is copied
    ``num_layers`` times, as torch clones it (equal initial weights); a function
    ``make(key)`` with ``key=`` draws each member apart instead. ``layers`` is an
    ``ft.nn.Stack`` (torch's ``layers.0``, ``layers.1`` ...). The call is torch's
    ``encoder(src, mask, src_key_padding_mask, is_causal)``; ``key=`` for dropout (one key
    per member, split from it). Padded positions' outputs are computed as torch's reference
    path computes them; torch's inference fast path (eval mode without gradients, nested
    tensors) returns zeros there instead: positions no loss should read.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> make = lambda k: ft.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, key=k)
      >>> encoder = ft.nn.TransformerEncoder(make, 2, ft.nn.LayerNorm(8), key=jax.random.key(0))
      >>> encoder(jnp.ones((3, 5, 8)), ft.nn.Transformer.generate_square_subsequent_mask(5), is_causal=True).shape
      (3, 5, 8)
      >>> ft.nn.torch_state_dict(encoder, numpy=True)["layers.1.self_attn.in_proj_weight"].shape
      (24, 8)
    """

    layers: Stack
    norm: Any = None

    def __init__(self, encoder_layer: Any, num_layers: int, norm: Any = None, *, key: jax.Array | None = None):
        self.layers = _stacked("TransformerEncoder", encoder_layer, num_layers, key)
        self.norm = norm

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __call__(
        self, src: Any, mask: Any | None = None, src_key_padding_mask: Any | None = None,
        is_causal: bool | None = None, *, key: jax.Array | None = None,
    ) -> jax.Array:
        _causal_needs_mask(self, "is_causal", "mask", is_causal, mask, "the source's length")
        x = self.layers(src, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal),
                        key=key)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(Layer):
    """torch's ``nn.TransformerDecoder``: ``num_layers`` decoder layers in turn, then ``norm``.

    Built as :class:`TransformerEncoder` (a layer copied, or ``make(key)`` with ``key=``); the
    call is torch's ``decoder(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
    memory_key_padding_mask, tgt_is_causal, memory_is_causal)``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> layer = ft.nn.TransformerDecoderLayer(8, 2, 16, norm_first=True, key=jax.random.key(0))
      >>> decoder = ft.nn.TransformerDecoder(layer, 2, ft.nn.LayerNorm(8))
      >>> causal = ft.nn.Transformer.generate_square_subsequent_mask(4)
      >>> decoder(jnp.ones((4, 3, 8)), jnp.ones((6, 3, 8)), tgt_mask=causal, tgt_is_causal=True).shape
      (4, 3, 8)
    """

    layers: Stack
    norm: Any = None

    def __init__(self, decoder_layer: Any, num_layers: int, norm: Any = None, *, key: jax.Array | None = None):
        self.layers = _stacked("TransformerDecoder", decoder_layer, num_layers, key)
        self.norm = norm

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __call__(
        self, tgt: Any, memory: Any, tgt_mask: Any | None = None,
        memory_mask: Any | None = None, tgt_key_padding_mask: Any | None = None,
        memory_key_padding_mask: Any | None = None, tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False, *, key: jax.Array | None = None,
    ) -> jax.Array:
        _decoder_hints(self, tgt_mask, memory_mask, tgt_is_causal, memory_is_causal)
        x = self.layers(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                        tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                        tgt_is_causal=bool(tgt_is_causal), memory_is_causal=bool(memory_is_causal), key=key)
        return x if self.norm is None else self.norm(x)


class Transformer(Layer):
    """torch's ``nn.Transformer``: an encoder of ``src`` and a decoder of ``tgt`` attending to it.

    ``memory = encoder(src)``, ``out = decoder(tgt, memory)``; each stack ends with a
    ``LayerNorm`` (``encoder.norm``, ``decoder.norm``), as torch's. Arguments as torch's
    (``d_model=512``, ``nhead=8``, ``num_encoder_layers=6``, ``num_decoder_layers=6``,
    ``dim_feedforward=2048``, ``dropout=0.1``, ``activation``, ``custom_encoder``,
    ``custom_decoder``, ``layer_norm_eps``, ``batch_first=False``, ``norm_first``, ``bias``)
    and ``key=``; the layers are drawn apart (glorot-uniform weights, as ``ft.nn.Dense``'s,
    not torch's draws: a torch model's numbers come with its state dict). The call is
    torch's ``model(src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask,
    tgt_key_padding_mask, memory_key_padding_mask, src_is_causal, tgt_is_causal,
    memory_is_causal)``. ``batch_first=False`` (torch's default) reads ``[L, N, E]``: a
    batch-first array given to it is read as sequences of the batch's length, with no error
    where the shapes allow it.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Transformer(8, 2, 1, 1, dim_feedforward=16, batch_first=True, key=jax.random.key(0))
      >>> src, tgt = jnp.ones((3, 6, 8)), jnp.ones((3, 4, 8))
      >>> causal = ft.nn.Transformer.generate_square_subsequent_mask(4)
      >>> model(src, tgt, tgt_mask=causal).shape
      (3, 4, 8)
    """

    encoder: Any
    decoder: Any
    d_model: int = field(static=True, default=512)
    nhead: int = field(static=True, default=8)
    batch_first: bool = field(static=True, default=False)

    generate_square_subsequent_mask = staticmethod(generate_square_subsequent_mask)

    def __init__(
        self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
        dim_feedforward: int = 2048, dropout: float = 0.1, activation: str | Callable[[Any], Any] = "relu",
        custom_encoder: Any = None, custom_decoder: Any = None, layer_norm_eps: float = 1e-5,
        batch_first: bool = False, norm_first: bool = False, bias: bool = True, *, key: jax.Array,
        dtype: Any = jnp.float32,
    ):
        d_model, nhead, dim_feedforward = _checked_sizes("Transformer", d_model, nhead, dim_feedforward)
        num_encoder_layers, num_decoder_layers = size_arguments(
            "Transformer", least=1, num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers)
        config: dict[str, Any] = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                      layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first, bias=bias,
                      dtype=dtype)
        ke, kd = jax.random.split(one_key(key))

        def norm() -> LayerNorm:
            return LayerNorm(d_model, layer_norm_eps, use_offset=bias, dtype=dtype)

        self.encoder = custom_encoder if custom_encoder is not None else TransformerEncoder(
            lambda k: TransformerEncoderLayer(d_model, nhead, key=k, **config), num_encoder_layers, norm(), key=ke)
        self.decoder = custom_decoder if custom_decoder is not None else TransformerDecoder(
            lambda k: TransformerDecoderLayer(d_model, nhead, key=k, **config), num_decoder_layers, norm(), key=kd)
        self.d_model, self.nhead, self.batch_first = d_model, nhead, bool(batch_first)

    def __call__(
        self, src: Any, tgt: Any, src_mask: Any | None = None, tgt_mask: Any | None = None,
        memory_mask: Any | None = None, src_key_padding_mask: Any | None = None,
        tgt_key_padding_mask: Any | None = None, memory_key_padding_mask: Any | None = None,
        src_is_causal: bool | None = None, tgt_is_causal: bool | None = None, memory_is_causal: bool = False,
        *, key: jax.Array | None = None,
    ) -> jax.Array:
        _causal_needs_mask(self, "src_is_causal", "src_mask", src_is_causal, src_mask, "the source's length")
        _decoder_hints(self, tgt_mask, memory_mask, tgt_is_causal, memory_is_causal)
        axis = 0 if self.batch_first else 1
        src, tgt = jnp.asarray(src), jnp.asarray(tgt)
        if src.ndim == 3 and jnp.ndim(tgt) == 3 and src.shape[axis] != tgt.shape[axis]:
            raise ValueError(_mismatch(self, "src", "tgt", src, tgt))
        ke, kd = ({"key": k} if k is not None else {} for k in _keys(key, 2))  # a custom stack may take none
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal, **ke)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                            memory_is_causal=memory_is_causal, **kd)
