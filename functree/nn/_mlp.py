"""``ft.nn.MLP``: a stack of fully connected layers (Equinox's and Flax's ``MLP``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from functree._activations import activation_argument, identity, relu
from functree._module import field
from functree._random import one_key
from functree.nn._check import size_argument, size_arguments
from functree.nn._dropout import Dropout
from functree.nn._linear import Dense, glorot_uniform
from functree.nn._mode import Layer

__all__ = ["MLP"]

BAD_WIDTHS = """\
ft.nn.MLP takes the hidden sizes either as widths=[...] or as width_size= and depth= \
(depth hidden layers of width_size each); got {given}.

    wrong:  ft.nn.MLP(2, 1, 32, key=key)                          # a width without a depth
    right:  ft.nn.MLP(2, 1, width_size=32, depth=2, key=key)      # Equinox's form
       or:  ft.nn.MLP(2, 1, widths=[32, 32], key=key)             # Flax's / Keras' form"""


class MLP(Layer):
    """A multilayer perceptron: ``Dense`` layers with ``activation`` (and dropout) between them.

    .. math::

        h_0 = x, \\quad h_{i+1} = \\mathrm{dropout}(\\mathrm{activation}(h_i W_i + b_i)),
        \\quad y = \\mathrm{final\\_activation}(h_n W_n + b_n)

    Hidden sizes are ``widths=[64, 64]`` or Equinox's ``width_size=64, depth=2`` (``depth``
    hidden layers; ``depth=0`` is one ``Dense``). ``dropout`` is the rate of the
    :class:`Dropout` after each hidden activation: it drops only in training mode
    (``ft.nn.training(model)``) and then needs ``key=``. Inputs are ``[..., in_size]``
    (no ``jax.vmap`` needed). Weights are glorot-uniform and biases zero, as in
    :class:`Dense` (Equinox and torch draw both from ``U(±1/√in_size)``: pass
    ``weight_initializer``/``bias_initializer`` to match them, see the defaults table).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> mlp = ft.nn.MLP(2, 1, width_size=8, depth=2, key=jax.random.key(0))
      >>> mlp
      MLP(
        layers=(
          Dense(weight=f32[2,8], bias=f32[8], activation=identity),
          Dense(weight=f32[8,8], bias=f32[8], activation=identity),
          Dense(weight=f32[8,1], bias=f32[1], activation=identity),
        ),
        dropout=Dropout(rate=0.0, training=False),
        activation=relu,
        final_activation=identity,
      )
      >>> mlp(jnp.ones((5, 2))).shape
      (5, 1)
      >>> [layer.weight.shape for layer in ft.nn.MLP(3, 2, widths=[4, 5], key=jax.random.key(0)).layers]
      [(3, 4), (4, 5), (5, 2)]
      >>> drop = ft.nn.training(ft.nn.MLP(2, 1, widths=[16], dropout=0.5, key=jax.random.key(0)))
      >>> drop(jnp.ones((3, 2)), key=jax.random.key(1)).shape
      (3, 1)
    """

    layers: tuple[Dense, ...]
    dropout: Dropout
    activation: Callable[[Any], Any] = field(static=True, default=relu)
    final_activation: Callable[[Any], Any] = field(static=True, default=identity)

    def __init__(
        self,
        in_size: int,
        out_size: int,
        width_size: int | None = None,
        depth: int | None = None,
        *,
        widths: Sequence[int] | None = None,
        activation: Callable[[Any], Any] = relu,
        final_activation: Callable[[Any], Any] = identity,
        dropout: float = 0.0,
        use_bias: bool = True,
        use_final_bias: bool = True,
        key: jax.Array,
        dtype: Any = jnp.float32,
        weight_initializer: Any = glorot_uniform,
        bias_initializer: Any = jax.nn.initializers.zeros,
    ):
        in_size, out_size = size_arguments("MLP", in_size=in_size, out_size=out_size)
        if widths is not None and width_size is None and depth is None:  # int() floored a width of 2.5 to 2
            hidden = [size_argument("MLP", "widths", w) for w in widths]
        elif widths is None and width_size is not None and depth is not None:
            width, depth = size_arguments("MLP", width_size=width_size, depth=depth)
            hidden = [width] * depth
        elif widths is None and depth == 0:
            hidden = []
        else:
            given = f"widths={widths!r}, width_size={width_size!r}, depth={depth!r}"
            raise ValueError(BAD_WIDTHS.format(given=given))
        sizes = [in_size, *hidden, out_size]
        keys = jax.random.split(one_key(key), len(sizes) - 1)
        last = len(sizes) - 2
        self.layers = tuple(
            Dense(sizes[i], sizes[i + 1], use_bias=use_bias if i < last else use_final_bias, key=keys[i],
                  dtype=dtype, weight_initializer=weight_initializer, bias_initializer=bias_initializer)
            for i in range(len(sizes) - 1)
        )
        self.dropout = Dropout(dropout)
        self.activation = activation_argument("MLP", activation)
        self.final_activation = activation_argument("MLP", final_activation, "final_activation")

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        hidden = len(self.layers) - 1
        drops = self.dropout.training and self.dropout.rate > 0.0 and hidden > 0
        keys = jax.random.split(one_key(key), hidden) if drops and key is not None else [None] * hidden
        for layer, k in zip(self.layers[:-1], keys):
            x = self.dropout(self.activation(layer(x)), key=k)
        return self.final_activation(self.layers[-1](x))
