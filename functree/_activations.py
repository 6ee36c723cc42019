"""Activation functions: jax.nn's, re-exported under swift-apis' names where they differ.

These are plain functions (pass them as ``activation=`` or put them in ``Sequential``),
public as ``functree.nn.<name>``. They live in the core, below ``functree.nn``, because the
core's table of static functions (``functree._functions``: pickles, copies, checkpoints)
names them; ``functree.nn`` re-exports them.
"""

from __future__ import annotations

from typing import Any

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

__all__ = [
    "identity",
    "relu",
    "relu6",
    "leaky_relu",
    "elu",
    "celu",
    "selu",
    "gelu",
    "gelu_exact",
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


def identity(x: Any) -> Any:
    """The identity activation (swift-apis' default).

    Example:
      >>> import functree as ft
      >>> ft.nn.identity(3.0)
      3.0
    """
    return x


def gelu_exact(x: Any) -> Any:
    """``x * Φ(x)`` with the exact normal CDF ``Φ(x) = (1 + erf(x / √2)) / 2``: torch's ``nn.GELU()``.

    ``ft.nn.gelu`` (jax's default) is the tanh approximation, torch's
    ``nn.GELU(approximate="tanh")``; they differ by up to about 5e-4.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> [round(v, 4) for v in ft.nn.gelu_exact(jnp.array([-1.0, 0.0, 1.0])).tolist()]
      [-0.1587, 0.0, 0.8413]
    """
    return gelu(x, approximate=False)
