"""Pooling over channels-last inputs, and ``Flatten``.

``MaxPool1D/2D`` and ``AvgPool1D/2D`` slide a window over the spatial axes of
``[..., *spatial, channels]`` (``lax.reduce_window``); ``strides`` default to the window
(swift-apis' defaults take them explicitly). ``GlobalMaxPool*`` / ``GlobalAvgPool*`` reduce
every spatial axis. Average pooling with ``"SAME"`` padding divides by the number of
real (unpadded) elements in each window; it sums and counts in float32 for bfloat16 and
float16 inputs (``statistics_dtype``), the output keeps the input's dtype.

An int or per-axis ``(low, high)`` ``padding`` is torch's ``padding=p``: max pooling pads with
``-inf``, average pooling with zeros that count in the mean (``count_include_pad=True``,
torch's default; ``False`` divides by the real elements, as ``"SAME"`` always does). torch's
``MaxPool2d(3, 2, padding=1)`` (ResNet's stem) is ``padding=1`` here, not ``"SAME"``, which
pads ``(0, 1)`` at stride 2 on an even size: same shape, other windows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import field
from functree._repr import short_array
from functree.nn import _window as window
from functree.nn._check import LayerInputError, check_input
from functree.nn._conv import check_window_fits
from functree.nn._mode import Layer
from functree.nn._normalization import statistics_dtype

__all__ = [
    "MaxPool1D",
    "MaxPool2D",
    "AvgPool1D",
    "AvgPool2D",
    "GlobalMaxPool1D",
    "GlobalMaxPool2D",
    "GlobalAvgPool1D",
    "GlobalAvgPool2D",
    "Flatten",
]


EMPTY_MAX = """\
Its {axis} is empty: a maximum over no values has none (torch's AdaptiveMaxPool raises here \
too; a global average is NaN in both).

    wrong:  ft.nn.{cls}()(x)     # x: {given}
    right:  ft.nn.{cls}()(x)     # x with {axis} >= 1 (the layer before keeps an axis: padding="SAME")"""


POOL_PAD_TOO_LARGE = """\
{cls}: padding={padding!r} is more than half the pool ({size}): a window could lie wholly in the \
padding (torch's "pad should be at most half of effective kernel size").

    wrong:  {cls}({size}, padding={padding!r})
    right:  {cls}({size}, padding={most!r})     # or padding="SAME"
"""


def _show(values: tuple[int, ...]) -> Any:
    """Sizes as a user writes them: one int where every axis has it."""
    return values[0] if len(set(values)) == 1 else values


def _spatial(n: int) -> tuple[str, ...]:
    return ("length", "channels") if n == 1 else ("height", "width", "channels")


class _Pool(Layer):
    pool_size: tuple[int, ...] = field(static=True, default=(2,))
    strides: tuple[int, ...] = field(static=True, default=(2,))
    padding: Any = field(static=True, default="VALID")

    _rank: ClassVar[int] = 1

    def __init__(
        self,
        pool_size: int | Sequence[int] = 2,
        strides: int | Sequence[int] | None = None,
        padding: Any = "VALID",
    ):
        name = type(self).__name__
        self.pool_size = window.sizes(name, "pool_size", pool_size, self._rank)
        self.strides = self.pool_size if strides is None else window.sizes(name, "strides", strides, self._rank)
        self.padding = window.padding(name, padding, self._rank)  # a name, or torch's padding=p as (low, high) pairs
        if not isinstance(self.padding, str) and any(max(pair) > k // 2 for pair, k in zip(self.padding, self.pool_size)):
            # a window wholly in the padding: -inf (max), 0 or NaN (average); torch refuses it too
            raise ValueError(POOL_PAD_TOO_LARGE.format(cls=name, padding=padding, size=_show(self.pool_size),
                                                       most=_show(tuple(k // 2 for k in self.pool_size))))

    def _window(self, x: jax.Array, init: Any, op: Any) -> jax.Array:
        check_input(self, x, _spatial(self._rank))
        check_window_fits(self, x, _spatial(self._rank)[:-1], self.pool_size, self.strides, (1,) * self._rank,
                          self.padding, kernel_name="pool_size")
        lead = x.ndim - self._rank - 1
        dims = (1,) * lead + self.pool_size + (1,)
        strides = (1,) * lead + self.strides + (1,)
        pads = self.padding if isinstance(self.padding, str) else ((0, 0),) * lead + self.padding + ((0, 0),)
        return jax.lax.reduce_window(x, init, op, dims, strides, pads)  # padded with init: -inf for max, 0 for sums


class _MaxPool(_Pool):
    def __call__(self, x: jax.Array) -> jax.Array:
        return self._window(x, -jnp.inf, jax.lax.max)  # a Python scalar: lax sees the monoid


class _AvgPool(_Pool):
    count_include_pad: bool = field(static=True, default=True)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("count_include_pad",)  # files written before it: True

    def __init__(
        self,
        pool_size: int | Sequence[int] = 2,
        strides: int | Sequence[int] | None = None,
        padding: Any = "VALID",
        count_include_pad: bool = True,
    ):
        super().__init__(pool_size, strides, padding)
        self.count_include_pad = bool(count_include_pad)  # torch's; read for int / pair padding ("SAME": real counts)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``sum(window) / count`` with both in ``statistics_dtype`` (float32 for bfloat16 and
        float16: a bfloat16 sum of 32x32 ones stalls at 256, a mean of 0.25), cast back."""
        check_input(self, x, _spatial(self._rank))  # before the cast hides an integer input
        wide = statistics_dtype(x.dtype)
        total = self._window(x.astype(wide), 0.0, jax.lax.add)
        if self.padding == "VALID" or (not isinstance(self.padding, str) and self.count_include_pad):
            return (total / jnp.array(math.prod(self.pool_size), wide)).astype(x.dtype)
        # "SAME" (or count_include_pad=False): the real elements in each window, counted in the same dtype.
        counts = self._window(jnp.ones(x.shape[-self._rank - 1:], wide), 0.0, jax.lax.add)
        return (total / counts).astype(x.dtype)


_POOL_DOC = """{op} pooling over ``[..., {spatial}, channels]`` (``pool_size=2``, ``strides=pool_size``, ``padding="VALID"``).

    ``y[..., i, c] = {formula}`` over the window ``x[..., i*stride : i*stride + pool_size, c]``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.arange({n}.0).reshape({shape})
      >>> ft.nn.{name}({size})(x){out}
    """


class MaxPool1D(_MaxPool):
    _rank: ClassVar[int] = 1
    __doc__ = _POOL_DOC.format(
        op="1-D max", spatial="length", formula="max(window)", n=4, shape="1, 4, 1",
        name="MaxPool1D", size=2, out=".ravel()\n      Array([1., 3.], dtype=float32)",
    )


class MaxPool2D(_MaxPool):
    _rank: ClassVar[int] = 2
    __doc__ = _POOL_DOC.format(
        op="2-D max", spatial="height, width", formula="max(window)", n=16, shape="1, 4, 4, 1",
        name="MaxPool2D", size="(2, 2)", out=".ravel()\n      Array([ 5.,  7., 13., 15.], dtype=float32)",
    )


class AvgPool1D(_AvgPool):
    _rank: ClassVar[int] = 1
    __doc__ = _POOL_DOC.format(
        op="1-D average", spatial="length", formula="mean(window)", n=4, shape="1, 4, 1",
        name="AvgPool1D", size=2, out=".ravel()\n      Array([0.5, 2.5], dtype=float32)",
    )


class AvgPool2D(_AvgPool):
    _rank: ClassVar[int] = 2
    __doc__ = _POOL_DOC.format(
        op="2-D average", spatial="height, width", formula="mean(window)", n=16, shape="1, 4, 4, 1",
        name="AvgPool2D", size="(2, 2)", out=".ravel()\n      Array([ 2.5,  4.5, 10.5, 12.5], dtype=float32)",
    )


class _GlobalPool(Layer):
    _rank: ClassVar[int] = 1
    _max: ClassVar[bool] = False

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, _spatial(self._rank))
        axes = tuple(range(x.ndim - self._rank - 1, x.ndim - 1))
        empty = [name for name, a in zip(_spatial(self._rank), axes) if x.shape[a] == 0]
        if self._max and empty:  # jnp.max raised "zero-size array to reduction operation max", naming no layer
            pattern = "[..., " + ", ".join(_spatial(self._rank)) + "]"
            raise LayerInputError(self, f"{pattern} (float) with {empty[0]} >= 1", short_array(x),
                                  EMPTY_MAX.format(axis=empty[0], cls=type(self).__name__, given=short_array(x)))
        return jnp.max(x, axis=axes) if self._max else jnp.mean(x, axis=axes)


_GLOBAL_DOC = """Global {op} pooling: ``[..., {spatial}, channels] -> [..., channels]``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.{name}()(jnp.arange({n}.0).reshape({shape}))
      {out}
    """


class GlobalMaxPool1D(_GlobalPool):
    _rank: ClassVar[int] = 1
    _max: ClassVar[bool] = True
    __doc__ = _GLOBAL_DOC.format(
        op="max", spatial="length", name="GlobalMaxPool1D", n=6, shape="1, 3, 2",
        out="Array([[4., 5.]], dtype=float32)",
    )


class GlobalMaxPool2D(_GlobalPool):
    _rank: ClassVar[int] = 2
    _max: ClassVar[bool] = True
    __doc__ = _GLOBAL_DOC.format(
        op="max", spatial="height, width", name="GlobalMaxPool2D", n=8, shape="1, 2, 2, 2",
        out="Array([[6., 7.]], dtype=float32)",
    )


class GlobalAvgPool1D(_GlobalPool):
    _rank: ClassVar[int] = 1
    __doc__ = _GLOBAL_DOC.format(
        op="average", spatial="length", name="GlobalAvgPool1D", n=6, shape="1, 3, 2",
        out="Array([[2., 3.]], dtype=float32)",
    )


class GlobalAvgPool2D(_GlobalPool):
    _rank: ClassVar[int] = 2
    __doc__ = _GLOBAL_DOC.format(
        op="average", spatial="height, width", name="GlobalAvgPool2D", n=8, shape="1, 2, 2, 2",
        out="Array([[3., 4.]], dtype=float32)",
    )


class Flatten(Layer):
    """``[batch, d1, d2, ...] -> [batch, d1 * d2 * ...]`` (swift-apis' ``Flatten``).

    ``batch_dims`` (static, default 1) leading axes are kept.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.Flatten()(jnp.ones((2, 3, 4))).shape
      (2, 12)
      >>> ft.nn.Flatten()(jnp.ones((0, 3, 4))).shape  # no rows: still (rows, features)
      (0, 12)
    """

    batch_dims: int = field(static=True, default=1)

    def __call__(self, x: jax.Array) -> jax.Array:
        # The size, not -1: a minibatch of 0 rows has no size to infer it from.
        return x.reshape((*x.shape[: self.batch_dims], math.prod(x.shape[self.batch_dims:])))
