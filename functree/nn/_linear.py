"""Dense (fully connected) layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import Module, field

__all__ = ["Dense", "identity"]


def identity(x: Any) -> Any:
    """The identity activation (swift-apis' default)."""
    return x


class Dense(Module):
    """``y = activation(x @ weight + bias)``: a fully connected layer (swift-apis' ``Dense``).

    Weights are glorot-uniform, biases zero. ``activation`` is static configuration.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> layer = ft.nn.Dense(2, 4, jax.nn.relu, key=jax.random.key(0))
      >>> layer
      Dense(weight=f32[2,4], bias=f32[4], activation=relu)
      >>> layer(jnp.ones((3, 2))).shape
      (3, 4)
    """

    weight: jax.Array
    bias: jax.Array | None
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
    ):
        self.weight = jax.nn.initializers.glorot_uniform()(key, (input_size, output_size), dtype)
        self.bias = jnp.zeros((output_size,), dtype) if use_bias else None
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)
