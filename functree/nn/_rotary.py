"""Rotary position embeddings (Su et al. 2021, RoFormer).

Position ``p`` rotates each pair of features ``(x_i, x_{i + d/2})`` (the "half" layout
of GPT-NeoX and LLaMA) by the angle ``p * theta_i`` with ``theta_i = base^(-2i / d)``::

    y_i         = x_i * cos(p theta_i) - x_{i+d/2} * sin(p theta_i)
    y_{i+d/2}   = x_{i+d/2} * cos(p theta_i) + x_i * sin(p theta_i)

so ``<rotate(q, m), rotate(k, n)>`` depends on the positions only through ``m - n``.
Angles and rotation are computed in float32 (or wider) and returned in the input dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from functree._module import field
from functree._repr import short_array
from functree.nn._check import check_input
from functree.nn._mode import Layer
from functree.nn._normalization import statistics_dtype

__all__ = ["apply_rotary", "RotaryEmbedding"]

ODD_SIZE = """\
apply_rotary expects x [..., size] with an even size (features are rotated in pairs), \
got {given}.

    wrong:  ft.nn.apply_rotary(x, positions)            # x.shape[-1] == {size}
    right:  ft.nn.apply_rotary(x[..., :{even}], positions)   # or project to an even size
"""

BAD_POSITIONS = """\
apply_rotary: positions {given} must broadcast against x's leading axes {lead} (one \
position per vector x[..., :]).

    wrong:  ft.nn.apply_rotary(q, jnp.arange(T))            # q: [batch, T, heads, head_size]
    right:  ft.nn.apply_rotary(q, jnp.arange(T)[:, None])   # positions [T, 1] -> [batch, T, heads]
"""

BAD_SEQ_AXIS = """\
RotaryEmbedding: seq_axis must count from the end and precede the feature axis (-2, -3, \
...), got {axis}.

    wrong:  ft.nn.RotaryEmbedding({size}, seq_axis={axis})
    right:  ft.nn.RotaryEmbedding({size}, seq_axis=-3)     # x: [batch, T, heads, {size}]
"""


def apply_rotary(x: Any, positions: Any, *, base: float = 10000.0) -> jax.Array:
    """Rotate ``x [..., size]`` by the rotary embedding of ``positions`` (see the module).

    ``positions`` (integers or floats) broadcast against ``x.shape[:-1]``: one position per
    feature vector. For per-head queries ``[batch, T, heads, head_size]`` pass
    ``jnp.arange(T)[:, None]``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([[1.0, 0.0], [1.0, 0.0]])       # two tokens, size 2: theta = 1
      >>> ft.nn.apply_rotary(x, jnp.array([0, 1])).round(3)   # (cos p, sin p)
      Array([[1.   , 0.   ],
             [0.54 , 0.841]], dtype=float32)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"apply_rotary expects a floating x, got {short_array(x)}; pass x.astype(jnp.float32).")
    size = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or size % 2:
        raise ValueError(ODD_SIZE.format(given=short_array(x), size=size, even=max(size - 1, 0)))
    positions = jnp.asarray(positions)
    try:
        jnp.broadcast_shapes(positions.shape, x.shape[:-1])
    except ValueError:
        raise ValueError(BAD_POSITIONS.format(given=short_array(positions), lead=list(x.shape[:-1]))) from None
    dtype = statistics_dtype(x.dtype)
    half = size // 2
    theta = jnp.asarray(base, dtype) ** (-jnp.arange(half, dtype=dtype) * 2 / size)
    angle = positions.astype(dtype)[..., None] * theta
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xs = x.astype(dtype)
    first, second = xs[..., :half], xs[..., half:]
    y = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return y.astype(x.dtype)


class RotaryEmbedding(Layer):
    """Rotary position embedding of inputs ``[..., T, size]`` or ``[..., T, heads, size]``.

    ``layer(x)`` applies :func:`apply_rotary` with positions ``0 .. T-1`` along
    ``seq_axis`` (``-2`` for ``[..., T, size]``, ``-3`` for per-head ``[..., T, heads,
    size]``), or with the given ``positions`` (e.g. an offset when decoding with a cache).
    It has no parameters; apply it to the queries and keys of attention, not the values.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> rope = ft.nn.RotaryEmbedding(4)
      >>> q = jax.random.normal(jax.random.key(0), (2, 6, 4))   # batch 2, 6 tokens
      >>> rope(q).shape
      (2, 6, 4)
      >>> bool(jnp.allclose(rope(q)[:, 0], q[:, 0]))            # position 0: no rotation
      True
    """

    size: int = field(static=True, default=2)
    base: float = field(static=True, default=10000.0)
    seq_axis: int = field(static=True, default=-2)

    def __init__(self, size: int, base: float = 10000.0, *, seq_axis: int = -2):
        if size % 2:
            raise ValueError(ODD_SIZE.format(given=f"size={size}", size=size, even=size - 1))
        if seq_axis > -2:
            raise ValueError(BAD_SEQ_AXIS.format(axis=seq_axis, size=size))
        self.size, self.base, self.seq_axis = size, float(base), seq_axis

    def __call__(self, x: jax.Array, positions: Any = None) -> jax.Array:
        need = -self.seq_axis
        check_input(self, x, ("T",) + (None,) * (need - 2) + (self.size,), min_rank=need)
        if positions is None:
            length = x.shape[self.seq_axis]
            positions = jnp.arange(length).reshape((length,) + (1,) * (need - 2))
        return apply_rotary(x, positions, base=self.base)
