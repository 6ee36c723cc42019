"""Rearranging layers: ``PixelShuffle`` / ``PixelUnshuffle`` (Shi et al. 2016),
``ChannelShuffle`` (ShuffleNet) and ``Unflatten``, torch's, over channels-last inputs.

The channel orders are torch's, so a torch convolution's weights ported by
``ft.nn.load_torch_state_dict`` feed them unchanged: ``PixelShuffle(r)`` reads channel
``c r^2 + i r + j`` of ``[..., H, W, C r^2]`` into pixel ``(h r + i, w r + j)`` of channel ``c``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import jax

from functree._module import field
from functree._repr import short_array
from functree.nn._check import LayerInputError, check_input
from functree.nn._mode import Layer
from functree.nn._window import is_int

__all__ = ["PixelShuffle", "PixelUnshuffle", "ChannelShuffle", "Unflatten"]

BAD_FACTOR = """\
{cls}: {name}={given!r}; it is an int >= 1 ({what}).

    wrong:  ft.nn.{cls}({given!r})
    right:  ft.nn.{cls}(2)"""

NOT_DIVISIBLE = """\
Its {axis} ({size}) is not a multiple of {need} ({why}).

    wrong:  ft.nn.{cls}({factor})(x)     # x: {given}
    right:  ft.nn.{cls}({factor})(x)     # x with {axis} a multiple of {need}{more}"""

BAD_UNFLATTEN = """\
Unflatten: shape={given!r}; it is a sequence of ints >= 0 with at most one -1 (inferred), \
torch's unflattened_size.

    wrong:  ft.nn.Unflatten(-1, {given!r})
    right:  ft.nn.Unflatten(-1, (4, 8))"""

UNFLATTEN_AXIS = """\
Unflatten: axis {axis} is outside an input of {ndim} axes (axes -{ndim} .. {last}).

    wrong:  ft.nn.Unflatten({axis}, {shape})(x)     # x: {given}
    right:  ft.nn.Unflatten(-1, {shape})(x)     # the last axis"""

UNFLATTEN_SIZE = """\
Its axis {axis} ({size}) does not split into {shape}: {why}.

    wrong:  ft.nn.Unflatten({axis}, {shape})(x)     # x: {given}
    right:  ft.nn.Unflatten({axis}, {right})(x)"""


def _factor(cls: str, name: str, value: Any, what: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(BAD_FACTOR.format(cls=cls, name=name, given=value, what=what))
    return int(value)


class _Pixels(Layer):
    factor: int = field(static=True, default=1)

    _unshuffle: ClassVar[bool] = False

    def __init__(self, factor: int):
        name = "downscale_factor" if self._unshuffle else "upscale_factor"
        self.factor = _factor(type(self).__name__, name, factor, "torch's " + name)

    def _refuse(self, x: jax.Array, axis: str, size: int, need: int, why: str, more: str = "") -> None:
        raise LayerInputError(self, f"[..., height, width, channels] with {axis} a multiple of {need}",
                              short_array(x), NOT_DIVISIBLE.format(axis=axis, size=size, need=need, why=why,
                                                                   cls=type(self).__name__, factor=self.factor,
                                                                   given=short_array(x), more=more))

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, ("height", "width", "channels"))
        r, (h, w, c), lead = self.factor, x.shape[-3:], x.shape[:-3]
        if not self._unshuffle:
            if c % (r * r):
                self._refuse(x, "channels", c, r * r, f"PixelShuffle({r}) makes each output channel of {r * r}",
                             f" (torch's [N, C * {r * r}, H, W] is [..., H, W, C * {r * r}] here)")
            y = x.reshape((*lead, h, w, c // (r * r), r, r))  # channel c r^2 + i r + j -> (c, i, j)
            k = len(lead)
            y = y.transpose((*range(k), k, k + 3, k + 1, k + 4, k + 2))  # [..., h, i, w, j, c]
            return y.reshape((*lead, h * r, w * r, c // (r * r)))
        for axis, size in (("height", h), ("width", w)):
            if size % r:
                self._refuse(x, axis, size, r, f"PixelUnshuffle({r}) takes {r} x {r} blocks")
        y = x.reshape((*lead, h // r, r, w // r, r, c))
        k = len(lead)
        y = y.transpose((*range(k), k, k + 2, k + 4, k + 1, k + 3))  # [..., h, w, c, i, j]
        return y.reshape((*lead, h // r, w // r, c * r * r))


class PixelShuffle(_Pixels):
    """torch's ``nn.PixelShuffle(r)``: ``[..., H, W, C r^2] -> [..., H r, W r, C]``.

    ``y[..., h r + i, w r + j, c] = x[..., h, w, c r^2 + i r + j]`` (torch's channel order, so
    a ported torch convolution before it needs nothing more); :class:`PixelUnshuffle` inverts it.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.PixelShuffle(2)(jnp.arange(4.0).reshape(1, 1, 1, 4))[0, ..., 0]
      Array([[0., 1.],
             [2., 3.]], dtype=float32)
    """


class PixelUnshuffle(_Pixels):
    """torch's ``nn.PixelUnshuffle(r)``: ``[..., H r, W r, C] -> [..., H, W, C r^2]``, the
    inverse of :class:`PixelShuffle` (``x[..., h, w, c r^2 + i r + j] = y[..., h r + i, w r + j, c]``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.PixelUnshuffle(2)(jnp.arange(4.0).reshape(1, 2, 2, 1)).ravel()
      Array([0., 1., 2., 3.], dtype=float32)
    """

    _unshuffle: ClassVar[bool] = True


class ChannelShuffle(Layer):
    """torch's ``nn.ChannelShuffle(groups)`` (ShuffleNet): the channels (last axis) read as
    ``[groups, C / groups]`` and transposed, ``y[..., j g + i] = x[..., i (C / g) + j]``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.ChannelShuffle(2)(jnp.arange(6.0))
      Array([0., 3., 1., 4., 2., 5.], dtype=float32)
    """

    groups: int = field(static=True, default=1)

    def __init__(self, groups: int):
        self.groups = _factor("ChannelShuffle", "groups", groups, "the number of channel groups")

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, ("channels",), kind="float")
        c, g = x.shape[-1], self.groups
        if c % g:
            raise LayerInputError(self, f"[..., channels] with channels a multiple of {g}", short_array(x),
                                  NOT_DIVISIBLE.format(axis="channels", size=c, need=g, cls="ChannelShuffle",
                                                       why=f"{g} groups of equal size", factor=g,
                                                       given=short_array(x), more=""))
        return x.reshape((*x.shape[:-1], g, c // g)).swapaxes(-1, -2).reshape(x.shape)


class Unflatten(Layer):
    """torch's ``nn.Unflatten(dim, unflattened_size)``: axis ``axis`` split into ``shape``
    (one entry may be -1, inferred), the other axes kept.

    A torch model's ``Linear -> Unflatten(1, (C, H, W))`` orders the features channel first;
    channels-last layers after it want ``ft.nn.Unflatten(-1, (C, H, W))`` followed by
    ``jnp.moveaxis(x, -3, -1)``, not ``Unflatten(-1, (H, W, C))`` (same shape, other numbers
    with torch's weights).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.Unflatten(-1, (2, -1))(jnp.ones((5, 6))).shape
      (5, 2, 3)
    """

    axis: int = field(static=True, default=-1)
    shape: tuple[int, ...] = field(static=True, default=())

    def __init__(self, axis: int, shape: Sequence[int]):
        try:
            entries = tuple(operator.index(v) for v in shape)
        except TypeError:
            raise ValueError(BAD_UNFLATTEN.format(given=shape)) from None
        if not entries or sum(v == -1 for v in entries) > 1 or any(v < -1 for v in entries):
            raise ValueError(BAD_UNFLATTEN.format(given=shape))
        self.axis, self.shape = operator.index(axis), entries

    def __call__(self, x: jax.Array) -> jax.Array:
        ndim = jax.numpy.ndim(x)
        if not -ndim <= self.axis < ndim:
            raise LayerInputError(self, f"an array with axis {self.axis}", short_array(x), UNFLATTEN_AXIS.format(
                axis=self.axis, ndim=ndim, last=ndim - 1, shape=self.shape, given=short_array(x)))
        axis = self.axis % ndim
        size, known = x.shape[axis], math.prod(v for v in self.shape if v != -1)
        fits = size % known == 0 if -1 in self.shape and known else size == known or (known == 0 and size == 0)
        if not fits:
            why = (f"{size} is not a multiple of {known}" if -1 in self.shape else
                   f"their product is {known}")
            right = tuple(-1 if i == 0 else v for i, v in enumerate(self.shape))
            raise LayerInputError(self, f"an array whose axis {self.axis} splits into {self.shape}", short_array(x),
                                  UNFLATTEN_SIZE.format(axis=self.axis, size=size, shape=self.shape, why=why,
                                                        given=short_array(x), right=right))
        shape = tuple(size // known if v == -1 else v for v in self.shape)
        return x.reshape((*x.shape[:axis], *shape, *x.shape[axis + 1:]))
