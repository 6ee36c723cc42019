"""Normalization layers: ``LayerNorm`` and ``BatchNorm`` (with running statistics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from functree._display import short_array
from functree._module import field
from functree.nn._check import LayerInputError, check_input
from functree.nn._mode import Layer
from functree.nn._state import record_state

__all__ = ["LayerNorm", "BatchNorm"]


class LayerNorm(Layer):
    """Normalize over the trailing ``shape`` axes: ``y = (x - mean) / sqrt(var + epsilon) * scale + offset``.

    Mean and (biased) variance are taken per example over the last ``len(shape)`` axes;
    ``scale`` starts at one and ``offset`` at zero (swift-apis' names). Either can be
    turned off with ``use_scale=False`` / ``use_offset=False``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ln = ft.nn.LayerNorm(3)
      >>> ln(jnp.array([[1.0, 2.0, 3.0]])).round(3)
      Array([[-1.225,  0.   ,  1.225]], dtype=float32)
    """

    scale: jax.Array | None
    offset: jax.Array | None
    shape: tuple[int, ...] = field(static=True, default=())
    epsilon: float = field(static=True, default=1e-5)

    def __init__(
        self,
        shape: int | Sequence[int],
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_offset: bool = True,
        *,
        dtype: Any = jnp.float32,
    ):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.scale = jnp.ones(self.shape, dtype) if use_scale else None
        self.offset = jnp.zeros(self.shape, dtype) if use_offset else None
        self.epsilon = float(epsilon)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, self.shape)
        axes = tuple(range(x.ndim - len(self.shape), x.ndim))
        mean = jnp.mean(x, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, x.dtype))
        if self.scale is not None:
            y = y * self.scale
        if self.offset is not None:
            y = y + self.offset
        return y


class BatchNorm(Layer):
    """Batch normalization over every axis but ``axis`` (swift-apis' ``BatchNorm``).

    Training: ``y = (x - mean_B) / sqrt(var_B + epsilon) * scale + offset`` with the batch
    mean and biased variance, and new running statistics recorded for
    ``ft.nn.collect_state``::

        running_mean     <- momentum * running_mean     + (1 - momentum) * mean_B
        running_variance <- momentum * running_variance + (1 - momentum) * var_B

    Inference (the default): the running statistics replace the batch ones.
    ``running_mean`` / ``running_variance`` are ``no_derivative`` fields (carried, not
    trained); swift-apis' defaults ``momentum=0.99, epsilon=1e-3``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> bn = ft.nn.BatchNorm(2)
      >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
      >>> y, updates = ft.nn.collect_state(lambda m: m(x), ft.nn.training(bn))
      >>> y.round(3)
      Array([[-1., -1.],
             [ 1.,  1.]], dtype=float32)
      >>> [round(v, 3) for v in ft.nn.apply_state(bn, updates).running_variance.tolist()]
      [1.0, 1.03]
    """

    scale: jax.Array
    offset: jax.Array
    running_mean: jax.Array = field(no_derivative=True)
    running_variance: jax.Array = field(no_derivative=True)
    axis: int = field(static=True, default=-1)
    momentum: float = field(static=True, default=0.99)
    epsilon: float = field(static=True, default=1e-3)
    training: bool = field(static=True, default=False)

    def __init__(
        self,
        feature_count: int,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        *,
        dtype: Any = jnp.float32,
        training: bool = False,
    ):
        self.scale = jnp.ones((feature_count,), dtype)
        self.offset = jnp.zeros((feature_count,), dtype)
        self.running_mean = jnp.zeros((feature_count,), dtype)
        self.running_variance = jnp.ones((feature_count,), dtype)
        self.axis, self.momentum, self.epsilon = axis, float(momentum), float(epsilon)
        self.training = training

    def __call__(self, x: jax.Array) -> jax.Array:
        features = self.scale.shape[0]
        check_input(self, x, (features,) if self.axis == -1 else ())
        axis = self.axis % max(x.ndim, 1)
        if self.axis != -1 and (x.ndim <= self.axis or x.shape[axis] != features):
            raise LayerInputError(
                self, f"with {features} features at axis {self.axis} (float)", short_array(x),
                f"Build the layer for this size: ft.nn.BatchNorm({x.shape[axis] if x.ndim > axis else '...'}, axis={self.axis}).",
            )
        shape = [1] * x.ndim
        shape[axis] = features
        reduce = tuple(i for i in range(x.ndim) if i != axis)
        if self.training:
            mean = jnp.mean(x, axis=reduce)
            var = jnp.mean(jnp.square(x - mean.reshape(shape)), axis=reduce)
            m = self.momentum
            record_state(
                self,
                running_mean=m * self.running_mean + (1 - m) * mean.astype(self.running_mean.dtype),
                running_variance=m * self.running_variance + (1 - m) * var.astype(self.running_variance.dtype),
            )
        else:
            mean, var = self.running_mean.astype(x.dtype), self.running_variance.astype(x.dtype)
        inv = jax.lax.rsqrt(var + jnp.asarray(self.epsilon, x.dtype)) * self.scale.astype(x.dtype)
        return (x - mean.reshape(shape)) * inv.reshape(shape) + self.offset.astype(x.dtype).reshape(shape)
