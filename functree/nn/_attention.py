"""Multi-head scaled dot-product attention (Vaswani et al. 2017)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from functree._display import short_array
from functree._module import field
from functree.nn._check import LayerInputError, check_input
from functree.nn._linear import Dense
from functree.nn._mode import Layer

__all__ = ["MultiheadAttention"]

BAD_HEADS = """\
MultiheadAttention: query_size ({size}) must be divisible by num_heads ({heads}), or pass \
qk_size= and vo_size= (the per-head sizes) explicitly.

    wrong:  ft.nn.MultiheadAttention({size}, {heads}, key=k)
    right:  ft.nn.MultiheadAttention({size}, {heads}, qk_size=16, vo_size=16, key=k)
"""

BAD_MASK = "Pass a boolean mask broadcastable to [..., num_heads, queries, keys] (True = attend)."


class MultiheadAttention(Layer):
    """``softmax(Q K^T / sqrt(d) + mask) V`` per head, then an output projection.

    For each head ``h``: ``Q_h = query W_q[h]``, ``K_h = keys W_k[h]``, ``V_h = values W_v[h]``,
    ``A_h = softmax(Q_h K_h^T / sqrt(qk_size))`` (masked entries get ``-inf``), and the
    result is ``concat_h(A_h V_h) W_o``. ``query`` is ``[..., queries, query_size]``,
    ``keys`` ``[..., keys, key_size]`` and ``values`` ``[..., keys, value_size]`` (both
    default to ``query``: self-attention). ``mask`` is boolean, broadcastable to
    ``[..., num_heads, queries, keys]``, True where attention is allowed.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> mha = ft.nn.MultiheadAttention(8, num_heads=2, key=jax.random.key(0))
      >>> x = jnp.ones((3, 5, 8))                       # batch 3, 5 tokens
      >>> causal = jnp.tril(jnp.ones((5, 5), bool))
      >>> mha(x, mask=causal).shape
      (3, 5, 8)
    """

    query_projection: Dense
    key_projection: Dense
    value_projection: Dense
    output_projection: Dense
    num_heads: int = field(static=True, default=1)

    def __init__(
        self,
        query_size: int,
        num_heads: int,
        *,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_bias: bool = True,
        key: jax.Array,
        dtype: Any = jnp.float32,
    ):
        if (qk_size is None or vo_size is None) and query_size % num_heads:
            raise ValueError(BAD_HEADS.format(size=query_size, heads=num_heads))
        key_size = query_size if key_size is None else key_size
        value_size = key_size if value_size is None else value_size
        output_size = query_size if output_size is None else output_size
        qk = query_size // num_heads if qk_size is None else qk_size
        vo = query_size // num_heads if vo_size is None else vo_size
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query_projection = Dense(query_size, num_heads * qk, use_bias=use_bias, key=kq, dtype=dtype)
        self.key_projection = Dense(key_size, num_heads * qk, use_bias=use_bias, key=kk, dtype=dtype)
        self.value_projection = Dense(value_size, num_heads * vo, use_bias=use_bias, key=kv, dtype=dtype)
        self.output_projection = Dense(num_heads * vo, output_size, use_bias=use_bias, key=ko, dtype=dtype)
        self.num_heads = num_heads

    def __call__(
        self,
        query: jax.Array,
        keys: jax.Array | None = None,
        values: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        keys = query if keys is None else keys
        values = keys if values is None else values
        check_input(self, query, ("queries", self.query_projection.weight.shape[0]))
        check_input(self, keys, ("keys", self.key_projection.weight.shape[0]))
        check_input(self, values, ("keys", self.value_projection.weight.shape[0]))
        q = self._heads(self.query_projection(query))
        k = self._heads(self.key_projection(keys))
        v = self._heads(self.value_projection(values))
        logits = jnp.einsum("...qhd,...khd->...hqk", q, k)
        logits = logits / jnp.sqrt(jnp.asarray(q.shape[-1], logits.dtype))
        if mask is not None:
            self._check_mask(mask, logits.shape)
            logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.output_projection(out.reshape((*out.shape[:-2], -1)))

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape((*x.shape[:-1], self.num_heads, -1))

    def _check_mask(self, mask: jax.Array, shape: tuple[int, ...]) -> None:
        try:
            ok = jnp.issubdtype(mask.dtype, jnp.bool_) and jnp.broadcast_shapes(mask.shape, shape) == shape
        except ValueError:
            ok = False
        if not ok:
            raise LayerInputError(
                self, f"mask broadcastable to {list(shape)} (bool)", short_array(mask), BAD_MASK
            )
