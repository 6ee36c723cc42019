"""Bilinear: ``y = x1^T A x2 + b``, one bilinear form per output feature (torch's ``nn.Bilinear``)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import field
from functree._random import one_key
from functree._repr import short_array
from functree.nn._abstract import initialized
from functree.nn._check import LayerInputError, check_input, check_unbatched, size_arguments
from functree.nn._linear import Initializer, add_bias
from functree.nn._mode import Layer

__all__ = ["Bilinear"]

BAD_BATCH = ("Pass x1 and x2 with the same leading (batch) axes, one pair of vectors per example: "
             "layer(x1, x2) with x1 [..., {in1}] and x2 [..., {in2}].")


class Bilinear(Layer):
    """``y_o = sum_ij x1_i A_ijo x2_j + b_o``: ``[..., in1], [..., in2] -> [..., out]``.

    torch's ``nn.Bilinear(in1_features, in2_features, out_features, bias=True)``. ``weight``
    is ``[in1, in2, out]`` (functree's inputs-first layout, as ``Dense``'s ``[in, out]``;
    torch's is ``[out, in1, in2]``, converted by the state-dict port); weight and bias start
    uniform in ``±1 / sqrt(in1)``, as torch's. The two inputs share their leading axes.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> layer = ft.nn.Bilinear(3, 2, 4, key=jax.random.key(0))
      >>> layer.weight.shape, layer(jnp.ones((5, 3)), jnp.ones((5, 2))).shape
      ((3, 2, 4), (5, 4))
    """

    weight: jax.Array
    bias: jax.Array | None = field(decay=False)

    def __init__(self, in1_features: int, in2_features: int, out_features: int, bias: bool = True, *,
                 key: jax.Array, dtype: Any = jnp.float32, weight_initializer: Initializer | None = None,
                 bias_initializer: Initializer | None = None):
        in1_features, = size_arguments("Bilinear", least=1, in1_features=in1_features)  # 0: torch's 1 / sqrt(0)
        in2_features, out_features = size_arguments("Bilinear", in2_features=in2_features, out_features=out_features)
        bound = 1 / math.sqrt(in1_features)
        torch_uniform = jax.nn.initializers.uniform(2 * bound)  # [0, 2b), shifted to [-b, b) below
        kw, kb = jax.random.split(one_key(key))

        def shifted(k: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
            return torch_uniform(k, shape, dtype) - jnp.asarray(bound, dtype)

        self.weight = initialized(weight_initializer or shifted, kw, (in1_features, in2_features, out_features), dtype)
        self.bias = initialized(bias_initializer or shifted, kb, (out_features,), dtype) if bias else None

    def __call__(self, x1: jax.Array, x2: jax.Array) -> jax.Array:
        check_unbatched(self, weight=3, bias=1)  # an ensemble's layer outside jax.vmap
        in1, in2 = self.weight.shape[:2]
        check_input(self, x1, (in1,))
        check_input(self, x2, (in2,))
        if x1.shape[:-1] != x2.shape[:-1]:
            raise LayerInputError(self, f"x1 [..., {in1}] and x2 [..., {in2}] with one batch shape",
                                  f"{short_array(x1)} and {short_array(x2)}", BAD_BATCH.format(in1=in1, in2=in2))
        y = jnp.einsum("...i,ijo,...j->...o", x1, self.weight, x2)
        return y if self.bias is None else add_bias(y, self.bias)
