"""Activation functions: jax.nn's, re-exported under swift-apis' names where they differ.

These are plain functions (pass them as ``activation=`` or put them in ``Sequential``).
"""

from __future__ import annotations

from jax.nn import (
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    mish,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    softmax,
    softplus,
    swish,
)
from jax.numpy import tanh

from functree.nn._linear import identity

__all__ = [
    "identity",
    "relu",
    "relu6",
    "leaky_relu",
    "elu",
    "celu",
    "selu",
    "gelu",
    "glu",
    "sigmoid",
    "log_sigmoid",
    "hard_sigmoid",
    "hard_swish",
    "hard_tanh",
    "silu",
    "swish",
    "mish",
    "softplus",
    "softmax",
    "log_softmax",
    "tanh",
]
