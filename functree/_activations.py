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
from jax.numpy import clip, tanh

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
    "gelu_10",
    "quick_gelu",
    "relu2",
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


ACTIVATION_NOT_A_FUNCTION = """\
{cls}: {name} must be a function (ft.nn.relu, jnp.tanh, ...) or None (none), got {given!r}{why}.

    wrong:  ft.nn.{cls}(..., {name}={given!r})
    right:  ft.nn.{cls}(..., {name}={right}){note}"""

# Keras's and torch's names whose function here has another name (or none at all).
_NAMED = {"linear": ("None", ""), "gelu": ("ft.nn.gelu_exact", "   # the exact GELU, Keras's and torch's "
                                                            "(ft.nn.gelu: the tanh approximation)")}


def activation_argument(cls: str, value: Any, name: str = "activation") -> Any:
    """A layer's ``activation=`` argument as the function it stores: None is no activation
    (:func:`identity`, Keras's ``activation=None``); a function is kept; anything else (a
    Keras name such as ``"relu"``, which was called at the first step: "'str' object is not
    callable") raises :data:`ACTIVATION_NOT_A_FUNCTION` with the function to pass.

    Example:
      >>> activation_argument("Dense", None) is identity
      True
    """
    if value is None:
        return identity
    if callable(value) and not isinstance(value, str):
        return value
    right, note, why = "ft.nn.relu", "", ""
    if isinstance(value, str):
        why = " (a name: functions are passed themselves here)"
        right, note = _NAMED.get(value, (f"ft.nn.{value}" if value in __all__ else right, ""))
    raise ValueError(ACTIVATION_NOT_A_FUNCTION.format(cls=cls, name=name, given=value, why=why, right=right,
                                                      note=note))


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


def gelu_10(x: Any) -> Any:
    """The exact GELU clipped to ``[-10, 10]``: Hugging Face's ``gelu_10`` activation.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> [round(v, 4) for v in ft.nn.gelu_10(jnp.array([-1.0, 20.0])).tolist()]
      [-0.1587, 10.0]
    """
    return clip(gelu_exact(x), -10.0, 10.0)


def quick_gelu(x: Any) -> Any:
    """``x * sigmoid(1.702 x)``: CLIP's and Hugging Face's ``quick_gelu``, a cheaper GELU.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> [round(v, 4) for v in ft.nn.quick_gelu(jnp.array([-1.0, 0.0, 1.0])).tolist()]
      [-0.1542, 0.0, 0.8458]
    """
    return x * sigmoid(1.702 * x)


def relu2(x: Any) -> Any:
    """``relu(x)²``: Primer's squared ReLU, Hugging Face's ``relu2``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.relu2(jnp.array([-2.0, 3.0])).tolist()
      [0.0, 9.0]
    """
    return relu(x) ** 2
