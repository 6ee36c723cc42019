"""Dropout with an explicit PRNG key: elementwise (``Dropout``), of whole channels
(``Dropout1D/2D/3D``, torch's ``Dropout1d/2d/3d``) and SELU's (``AlphaDropout``,
``FeatureAlphaDropout``)."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from functree._module import field
from functree._random import TRAINER_KEY, flat_key
from functree._repr import short_array
from functree.nn._check import LayerInputError
from functree.nn._mode import Layer

__all__ = ["Dropout", "Dropout1D", "Dropout2D", "Dropout3D", "AlphaDropout", "FeatureAlphaDropout"]

NO_KEY = """\
Dropout (rate={rate}) is in training mode and needs a PRNG key for its mask.

    wrong:  model(x)
    right:  model(x, key=jax.random.key(step))       # a fresh key every step
""" + TRAINER_KEY + """\
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


CHANNEL_RANK = """\
{cls} drops whole channels of [..., {spatial}, channels]: an input of {need} axes or more, got {given}.

    wrong:  ft.nn.{cls}({rate})(x)     # x: {given}
    right:  ft.nn.{cls}({rate})(x)     # x: [..., {spatial}, channels]{hint}"""

_SPATIAL = {1: "length", 2: "height, width", 3: "depth, height, width"}


class _ChannelDropout(Dropout):
    """A mask of ``[..., 1 (each spatial axis), channels]`` broadcast over the spatial axes."""

    _rank: ClassVar[int] = 1

    def _mask_shape(self, x: jax.Array) -> tuple[int, ...]:
        n = self._rank
        if jnp.ndim(x) < n + 1:
            given = short_array(x) if hasattr(x, "shape") else repr(x)
            hint = "" if n == 1 else f" (or ft.nn.Dropout{jnp.ndim(x) - 1}D for {jnp.ndim(x) - 1} spatial axes)"
            raise LayerInputError(self, f"[..., {_SPATIAL[n]}, channels] (float)", given,
                                  CHANNEL_RANK.format(cls=type(self).__name__, spatial=_SPATIAL[n], need=n + 1,
                                                      given=given, rate=self.rate, hint=hint if jnp.ndim(x) > 1 else ""))
        return (*jnp.shape(x)[: jnp.ndim(x) - n - 1], *(1,) * n, jnp.shape(x)[-1])

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        shape = self._mask_shape(x)  # checked in inference too: a model is the same in both modes
        if not self.training or self.rate == 0.0:
            return x
        if key is None:
            raise ValueError(NO_KEY.format(rate=self.rate))
        keep = jax.random.bernoulli(flat_key(key), 1.0 - self.rate, shape)
        return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))


_CHANNEL_DOC = """Zero whole channels with probability ``rate`` (torch's ``Dropout{n}d``, channels last).

    ``y[..., {index}, c] = x[..., {index}, c] m[..., c] / (1 - rate)``, one ``m ~ Bernoulli(1 - rate)``
    per leading index and channel, shared by every position of the {n}-D ``[..., {spatial}, channels]``
    map (Tompson et al. 2015: neighbouring pixels are correlated, so elementwise dropout barely
    regularizes a convolution). Inference (the default) is the identity; in training it takes
    ``key=`` as ``Dropout``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> y = ft.nn.training(ft.nn.Dropout{n}D(0.5))(jnp.ones({shape}), key=jax.random.key(0))
      >>> bool((y == y[{first}]).all())     # each channel kept or zeroed whole
      True
    """


class Dropout1D(_ChannelDropout):
    _rank: ClassVar[int] = 1
    __doc__ = _CHANNEL_DOC.format(n=1, index="l", spatial="length", shape="(2, 5, 3)", first=":, :1")


class Dropout2D(_ChannelDropout):
    _rank: ClassVar[int] = 2
    __doc__ = _CHANNEL_DOC.format(n=2, index="h, w", spatial="height, width", shape="(2, 4, 4, 3)",
                                  first=":, :1, :1")


class Dropout3D(_ChannelDropout):
    _rank: ClassVar[int] = 3
    __doc__ = _CHANNEL_DOC.format(n=3, index="d, h, w", spatial="depth, height, width", shape="(2, 2, 3, 3, 3)",
                                  first=":, :1, :1, :1")


# SELU's -lambda * alpha (Klambauer et al. 2017): the value SELU saturates to, which a dropped unit takes
SELU_SATURATION = -1.7580993408473766


class AlphaDropout(Dropout):
    """Dropout that keeps SELU's zero mean and unit variance (Klambauer et al. 2017; torch's
    ``nn.AlphaDropout``).

    In training each element is kept with probability ``q = 1 - rate`` or set to SELU's
    saturation ``a' = -1.7581``, then ``y = a (x m + a' (1 - m)) + b`` with
    ``a = ((1 - rate) (1 + rate a'^2))^{-1/2}`` and ``b = -a a' rate``: for inputs of mean 0
    and variance 1, ``y`` keeps them. Inference (the default) is the identity.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> x = jax.random.normal(jax.random.key(1), (100_000,))
      >>> y = ft.nn.training(ft.nn.AlphaDropout(0.2))(x, key=jax.random.key(0))
      >>> abs(float(y.mean())) < 0.02, abs(float(y.std()) - 1) < 0.02
      (True, True)
    """

    _features: ClassVar[bool] = False

    def _mask_shape(self, x: jax.Array) -> tuple[int, ...]:
        return jnp.shape(x)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        shape = self._mask_shape(x)
        if not self.training or self.rate == 0.0:
            return x
        if key is None:
            raise ValueError(NO_KEY.format(rate=self.rate))
        keep = jax.random.bernoulli(flat_key(key), 1.0 - self.rate, shape)
        p = self.rate
        a = ((1.0 - p) * (1.0 + p * SELU_SATURATION ** 2)) ** -0.5
        b = -a * SELU_SATURATION * p
        kept = x * jnp.asarray(a, x.dtype) + jnp.asarray(b, x.dtype)
        return jnp.where(keep, kept, jnp.asarray(a * SELU_SATURATION + b, x.dtype))


FEATURE_RANK = """\
FeatureAlphaDropout drops whole channels of [batch, ..., channels]: an input of 2 axes or more, got {given}.

    wrong:  ft.nn.FeatureAlphaDropout({rate})(x)     # x: {given}
    right:  ft.nn.FeatureAlphaDropout({rate})(x[None])     # a batch of one"""


class FeatureAlphaDropout(AlphaDropout):
    """:class:`AlphaDropout` of whole channels (torch's ``nn.FeatureAlphaDropout``, channels
    last): one mask value per example (first axis) and channel (last axis) of
    ``[batch, ..., channels]``, shared by the axes between.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> y = ft.nn.training(ft.nn.FeatureAlphaDropout(0.5))(jnp.zeros((2, 4, 3)), key=jax.random.key(0))
      >>> bool((y == y[:, :1]).all())
      True
    """

    def _mask_shape(self, x: jax.Array) -> tuple[int, ...]:
        if jnp.ndim(x) < 2:
            given = short_array(x) if hasattr(x, "shape") else repr(x)
            raise LayerInputError(self, "[batch, ..., channels] (float)", given,
                                  FEATURE_RANK.format(given=given, rate=self.rate))
        return (jnp.shape(x)[0], *(1,) * (jnp.ndim(x) - 2), jnp.shape(x)[-1])
