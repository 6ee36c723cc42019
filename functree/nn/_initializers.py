"""Initializers: ``init(key, shape, dtype) -> array``, jax.nn.initializers re-exported, and
torch's ``nn.init`` functions under their names (``kaiming_normal``, ``xavier_uniform``,
``trunc_normal``...) with torch's distributions.

Layers take them as ``weight_initializer=`` / ``bias_initializer=``; the factories
(``glorot_uniform()``, ``normal(0.02)``...) return such functions. JAX's ``he_normal`` and
``lecun_normal`` draw from a truncated normal; torch's ``kaiming_normal_`` from a plain one
(:func:`kaiming_normal`). Fans are read from functree's layouts (``Dense`` ``[in, out]``,
``Conv`` ``[*k, in / groups, out]``): torch's fans of the same layers, except a
``ConvTranspose``'s, whose ``[*k, in, out / groups]`` kernel has torch's ``fan_out`` as its
``fan_in`` (torch reads its ``[in, out / groups, *k]`` weight's ``size(1)``): give the other
``mode`` there for torch's numbers.

Example:
  >>> import functree as ft, jax
  >>> layer = ft.nn.Dense(4, 2, key=jax.random.key(0),
  ...                     weight_initializer=ft.nn.initializers.he_normal())
  >>> layer.weight.shape
  (4, 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.nn.initializers import (
    constant,
    glorot_normal,
    glorot_uniform,
    he_normal,
    he_uniform,
    lecun_normal,
    lecun_uniform,
    normal,
    ones,
    orthogonal,
    truncated_normal,
    uniform,
    variance_scaling,
    zeros,
)

from functree.nn._precision import statistics_dtype

__all__ = [
    "calculate_gain",
    "kaiming_normal",
    "kaiming_uniform",
    "xavier_normal",
    "xavier_uniform",
    "trunc_normal",
    "torch_default",
    "constant",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "zeros",
]


GAINS = {"linear": 1.0, "identity": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3, "relu": math.sqrt(2.0), "selu": 0.75,
         **{f"conv{n}d": 1.0 for n in (1, 2, 3)}, **{f"conv_transpose{n}d": 1.0 for n in (1, 2, 3)}}

BAD_NONLINEARITY = """\
ft.nn.initializers.calculate_gain: nonlinearity={given!r} is not one of torch's ({names}, \
leaky_relu):

    wrong:  ft.nn.initializers.kaiming_normal(nonlinearity={given!r})
    right:  ft.nn.initializers.kaiming_normal(nonlinearity="relu")"""

BAD_MODE = """\
ft.nn.initializers.{name}: mode={given!r}; torch's modes are "fan_in" (the forward pass's \
variance kept) and "fan_out" (the backward pass's):

    wrong:  ft.nn.initializers.{name}(mode={given!r})
    right:  ft.nn.initializers.{name}(mode="fan_out")"""

Initializer = Callable[[jax.Array, Any, Any], jax.Array]


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """torch's ``nn.init.calculate_gain``: the gain that keeps the activations' variance
    through ``nonlinearity`` (``relu``: √2, ``tanh``: 5/3, ``selu``: 3/4,
    ``leaky_relu``: √(2 / (1 + a²)) with ``a = param`` (0.01 by default), linear ones 1).

    Example:
      >>> import functree as ft
      >>> round(ft.nn.initializers.calculate_gain("leaky_relu", 0.2), 6)
      1.38675
    """
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity not in GAINS:
        raise ValueError(BAD_NONLINEARITY.format(given=nonlinearity, names=", ".join(GAINS)))
    return GAINS[nonlinearity]


def _mode(name: str, mode: str) -> Literal["fan_in", "fan_out"]:
    if mode == "fan_in" or mode == "fan_out":
        return mode
    raise ValueError(BAD_MODE.format(name=name, given=mode))


def kaiming_normal(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """torch's ``nn.init.kaiming_normal_``: ``N(0, std²)``, ``std = gain / √fan`` (He et al.
    2015; a plain normal, where JAX's ``he_normal`` truncates at two deviations), ``gain =``
    :func:`calculate_gain` ``(nonlinearity, a)``, ``fan`` the kernel's ``mode``.

    Example:
      >>> import functree as ft, jax
      >>> conv = ft.nn.Conv2D(16, 32, 3, key=jax.random.key(0),
      ...                     weight_initializer=ft.nn.initializers.kaiming_normal(mode="fan_out", nonlinearity="relu"))
      >>> round(float(conv.weight.std()), 2)      # √2 / √(3 · 3 · 32) = 0.083
      0.08
    """
    gain = calculate_gain(nonlinearity, a)
    return variance_scaling(gain**2, _mode("kaiming_normal", mode), "normal")


def kaiming_uniform(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """torch's ``nn.init.kaiming_uniform_``: ``U(±bound)``, ``bound = gain · √(3 / fan)``
    (torch's ``Linear`` and ``Conv`` draw their weights with ``a = √5``: :func:`torch_default`).

    Example:
      >>> import functree as ft, jax
      >>> w = ft.nn.initializers.kaiming_uniform(nonlinearity="relu")(jax.random.key(0), (600, 10))
      >>> bool(abs(w).max() <= (2 * 3 / 600) ** 0.5)
      True
    """
    gain = calculate_gain(nonlinearity, a)
    return variance_scaling(gain**2, _mode("kaiming_uniform", mode), "uniform")


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """torch's ``nn.init.xavier_uniform_``: ``U(±gain · √(6 / (fan_in + fan_out)))`` (Glorot &
    Bengio 2010; ``gain=1`` is JAX's ``glorot_uniform``)."""
    return variance_scaling(gain**2, "fan_avg", "uniform")


def xavier_normal(gain: float = 1.0) -> Initializer:
    """torch's ``nn.init.xavier_normal_``: ``N(0, gain² · 2 / (fan_in + fan_out))``, a plain
    normal (JAX's ``glorot_normal`` truncates)."""
    return variance_scaling(gain**2, "fan_avg", "normal")


def trunc_normal(std: float = 1.0, mean: float = 0.0, a: float = -2.0, b: float = 2.0) -> Initializer:
    """torch's ``nn.init.trunc_normal_(mean, std, a, b)``: ``N(mean, std²)`` cut to ``[a, b]``,
    bounds in the values' units (torch's, and timm's ``trunc_normal_(std=.02)``: cut at ±2, not
    at two deviations as JAX's ``truncated_normal(0.02)`` is), ``std`` the parent normal's.

    Example:
      >>> import functree as ft, jax
      >>> w = ft.nn.initializers.trunc_normal(std=1.0, a=-0.5, b=0.5)(jax.random.key(0), (1000,))
      >>> bool(w.min() >= -0.5 and w.max() <= 0.5)
      True
    """
    def init(key: jax.Array, shape: Any, dtype: Any = jnp.float32) -> jax.Array:
        lower, upper = (a - mean) / std, (b - mean) / std
        draws = jax.random.truncated_normal(key, lower, upper, shape, _drawn_in(dtype))
        return (mean + std * draws).astype(dtype)

    return init


def _drawn_in(dtype: Any) -> Any:
    """The real dtype to draw ``dtype``'s values in: at least float32 (a bfloat16 weight's
    draws keep float32's resolution until the cast), float64 for a float64 or complex128 one
    (under x64 a float64 model's init has float64's resolution, not float32's)."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.dtype(jnp.float32)
    return statistics_dtype(jnp.finfo(dtype).dtype)


def torch_default() -> Initializer:
    """The weights of torch's ``nn.Linear`` and ``nn.Conv*d``: ``kaiming_uniform_(a=√5)``,
    that is ``U(±1/√fan_in)`` (a ``ConvTranspose``'s: ``mode="fan_out"`` here, see the module)."""
    return kaiming_uniform(a=math.sqrt(5.0))
