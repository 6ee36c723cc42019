"""Dropout with an explicit PRNG key."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from functree._module import field
from functree._random import flat_key
from functree.nn._mode import Layer

__all__ = ["Dropout"]

NO_KEY = """\
Dropout (rate={rate}) is in training mode and needs a PRNG key for its mask.

    wrong:  model(x)
    right:  model(x, key=jax.random.key(step))       # a fresh key every step
       or:  ft.nn.inferring(model, x)                 # no dropout at inference
"""

BAD_RATE = """\
Dropout rate must be in [0, 1), got {rate} (rate is the probability of zeroing an \
element; 1 would zero everything).

    wrong:  ft.nn.Dropout(rate={rate})
    right:  ft.nn.Dropout(rate=0.1)
"""


class Dropout(Layer):
    """Zero each element with probability ``rate`` and scale the rest by ``1 / (1 - rate)``.

    ``y = x * m / (1 - rate)``, ``m ~ Bernoulli(1 - rate)`` in training; ``y = x`` in
    inference (the default; see ``ft.nn.training``). ``rate`` and ``training`` are static.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> drop = ft.nn.Dropout(0.5)
      >>> drop(jnp.ones(4))
      Array([1., 1., 1., 1.], dtype=float32)
      >>> y = ft.nn.training(drop)(jnp.ones(1000), key=jax.random.key(0))
      >>> sorted(set(y.tolist()))
      [0.0, 2.0]
    """

    rate: float = field(static=True)
    training: bool = field(static=True, default=False)
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("rate",)  # a restore's template decides them (how it trains)

    def __init__(self, rate: float, *, training: bool = False):
        if not 0.0 <= rate < 1.0:
            raise ValueError(BAD_RATE.format(rate=rate))
        self.rate = float(rate)
        self.training = training

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        if not self.training or self.rate == 0.0:
            return x
        if key is None:
            raise ValueError(NO_KEY.format(rate=self.rate))
        keep = jax.random.bernoulli(flat_key(key), 1.0 - self.rate, jnp.shape(x))  # the key's mask (functree/_random.py)
        return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))
