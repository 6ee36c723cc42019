"""Dense (fully connected) layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functree._activations import activation_argument, identity
from functree._broadcast import plus
from functree._module import field
from functree.nn._abstract import initialized
from functree.nn._check import check_input, check_unbatched, size_arguments
from functree.nn._mode import Layer
from functree.nn._precision import statistics_dtype

__all__ = ["Dense", "add_bias", "identity"]

Initializer = Callable[..., jax.Array]
glorot_uniform = jax.nn.initializers.glorot_uniform()


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    """``y + bias``, added in float32 where the sum's dtype is bfloat16 or float16.

    The gradient of a broadcast add is ``d bias = sum_{rows} dy``: a ``reduce_sum`` over every
    leading axis, in the cotangent's dtype, and XLA:CPU accumulates a bfloat16 reduction in
    bfloat16 (a Conv2D bias's gradient over 8x32x32 positions came back 0.94 off; torch's
    bfloat16 one is 3e-3 off). Added in float32, the sum is float32 and only its result is
    rounded (:func:`~functree.nn._precision.statistics_dtype`); float32 and float64 add as before.
    """
    dtype = jnp.result_type(y, bias)
    if not jnp.issubdtype(dtype, jnp.floating) or statistics_dtype(dtype) == dtype:
        return plus(y, bias)  # (the leading axes by hand: a user's rank promotion may raise)
    wide = statistics_dtype(dtype)
    return plus(y.astype(wide), bias.astype(wide)).astype(dtype)


class Dense(Layer):
    """``y = activation(x @ weight + bias)``: a fully connected layer (swift-apis' ``Dense``).

    ``weight`` is ``[input_size, output_size]``, glorot-uniform by default; ``bias`` is zero.
    ``activation`` is static configuration. Inputs are ``[..., input_size]``. In bfloat16 and
    float16 the bias is added in float32 (:func:`add_bias`: its gradient sums every row).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> layer = ft.nn.Dense(2, 4, jax.nn.relu, key=jax.random.key(0))
      >>> layer
      Dense(weight=f32[2,4], bias=f32[4], activation=relu)
      >>> layer(jnp.ones((3, 2))).shape
      (3, 4)
    """

    weight: jax.Array
    bias: jax.Array | None = field(decay=False)
    activation: Callable[[Any], Any] = field(static=True, default=identity)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        activation: Callable[[Any], Any] = identity,
        use_bias: bool = True,
        *,
        key: jax.Array,
        dtype: Any = jnp.float32,
        weight_initializer: Initializer = glorot_uniform,
        bias_initializer: Initializer = jax.nn.initializers.zeros,
    ):
        input_size, output_size = size_arguments("Dense", input_size=input_size, output_size=output_size)
        self.weight = initialized(weight_initializer, key, (input_size, output_size), dtype)
        bias_key = jax.random.fold_in(key, 1)
        self.bias = initialized(bias_initializer, bias_key, (output_size,), dtype) if use_bias else None
        self.activation = activation_argument("Dense", activation)  # None: none (Keras's)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_unbatched(self, weight=2, bias=1)  # an ensemble's layer outside jax.vmap
        check_input(self, x, (self.weight.shape[0],))
        y = x @ self.weight
        if self.bias is not None:
            y = add_bias(y, self.bias)
        return self.activation(y)
