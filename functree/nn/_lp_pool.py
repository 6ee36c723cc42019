"""Power-average pooling, torch's ``LPPool1d/2d/3d``, over channels-last inputs.

``y = (sum_{window} x^p)^{1/p}``: ``p = 1`` sum pooling, ``p = 2`` the window's Euclidean
norm, ``p -> inf`` max pooling of ``|x|`` (``p = inf``; ``-inf``: the minimum of ``|x|``).
As torch's, ``x^p`` is the plain power (a negative element to a fractional ``p`` is NaN: pool
``|x|`` for a norm) and there is no padding. ``ceil_mode=True`` keeps the last partial window;
torch computes every window as its mean times ``prod(pool_size)``, so a partial window of
``m`` elements is its sum scaled by ``prod(pool_size) / m``: kept here, for torch's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp

from functree._module import field
from functree._repr import short_array
from functree.nn import _window as window
from functree.nn._check import LayerInputError
from functree.nn._mode import Layer
from functree.nn._pooling import AvgPool1D, AvgPool2D, AvgPool3D, MaxPool1D, MaxPool2D, MaxPool3D

__all__ = ["LPPool1D", "LPPool2D", "LPPool3D"]

BAD_NORM = """\
{cls}: norm_type={given!r}; it is a nonzero number (the power p; float("inf") pools max |x|).

    wrong:  ft.nn.{cls}({given!r}, 2)
    right:  ft.nn.{cls}(2, 2)     # the Euclidean norm of each window"""

WINDOW_TOO_LARGE = """\
Its {axis} ({size}) is shorter than the window, pool_size {pool}, and LPPool has no padding \
(torch's neither): no window fits, and torch raises here.

    wrong:  ft.nn.{cls}({p}, {pool})(x)     # x's {axis}: {size}
    right:  ft.nn.{cls}({p}, {pool}, ceil_mode=True)(x)     # one partial window, as torch's ceil_mode
       or:  an input whose {axis} is >= {need}"""

_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}
_MAX = {1: MaxPool1D, 2: MaxPool2D, 3: MaxPool3D}
_AVG = {1: AvgPool1D, 2: AvgPool2D, 3: AvgPool3D}


class _LPPool(Layer):
    norm_type: float = field(static=True, default=2.0)
    pool_size: tuple[int, ...] = field(static=True, default=(2,))
    strides: tuple[int, ...] = field(static=True, default=(2,))
    ceil_mode: bool = field(static=True, default=False)

    _rank: ClassVar[int] = 1

    def __init__(self, norm_type: float, pool_size: int | Sequence[int], strides: int | Sequence[int] | None = None,
                 ceil_mode: bool = False):
        name = type(self).__name__
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type == 0 or (
                norm_type != norm_type):
            raise ValueError(BAD_NORM.format(cls=name, given=norm_type))
        self.norm_type = float(norm_type)
        self.pool_size = window.sizes(name, "pool_size", pool_size, self._rank)
        self.strides = self.pool_size if strides is None else window.sizes(name, "strides", strides, self._rank)
        self.ceil_mode = bool(ceil_mode)

    def __call__(self, x: jax.Array) -> jax.Array:
        p, n = self.norm_type, self._rank
        self._check_fits(x)
        if math.isinf(p):
            pool = _MAX[n](self.pool_size, self.strides, 0, ceil_mode=self.ceil_mode)
            magnitude = x * jnp.sign(x)  # |x| with torch's gradient sign(x): 0 at 0 (jnp.abs's is 1 there)
            return pool(magnitude) if p > 0 else -pool(-magnitude)
        mean = _AVG[n](self.pool_size, self.strides, 0, ceil_mode=self.ceil_mode)(jnp.power(x, jnp.asarray(p, x.dtype)))
        total = mean * jnp.asarray(math.prod(self.pool_size), x.dtype)
        zero = total == 0  # torch's: a window of zeros has gradient 0 (its root's derivative is infinite there)
        root = jnp.power(jnp.where(zero, jnp.ones_like(total), total), jnp.asarray(1.0 / p, x.dtype))
        return jnp.where(zero, jnp.zeros_like(total), root)

    def _check_fits(self, x: jax.Array) -> None:
        """:data:`WINDOW_TOO_LARGE` for an input shorter than the window without ``ceil_mode``
        (the pooling it delegates to would name itself and its padding, which LPPool lacks)."""
        n, shape = self._rank, jnp.shape(x)
        if self.ceil_mode or len(shape) < n + 1:
            return  # (too few axes: the pooling's own error names the layout)
        for axis, size, need in zip(_AXES[n], shape[-1 - n:-1], self.pool_size):
            if size < need:
                pool = self.pool_size[0] if n == 1 else self.pool_size
                p = (('-' if self.norm_type < 0 else '') + 'float("inf")' if math.isinf(self.norm_type)
                     else int(self.norm_type) if self.norm_type.is_integer() else self.norm_type)
                fix = WINDOW_TOO_LARGE.format(axis=axis, size=size, pool=pool, cls=type(self).__name__, p=p, need=need)
                spatial = ", ".join(_AXES[n])
                raise LayerInputError(self, f"[..., {spatial}, {shape[-1]}] (float) with {axis} >= {need}",
                                      short_array(x), fix)


_DOC = """Power-average pooling over ``[..., {spatial}, channels]`` (torch's ``LPPool{n}d``, channels last).

    ``y = (sum_window x^p)^(1/p)`` (``norm_type=p``; ``inf``: the max of ``|x|``); ``pool_size``,
    ``strides=pool_size``, ``ceil_mode=False`` as :class:`MaxPool{n}D`'s, no padding (torch has none).
    A window of zeros is 0 with gradient 0 (``inf`` too: torch's ``abs`` has gradient 0 at 0).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([3., 4., 1., 0.]).reshape({shape})
      >>> ft.nn.{name}(2, {size})(x).ravel()
      Array([5., 1.], dtype=float32)
    """


class LPPool1D(_LPPool):
    _rank: ClassVar[int] = 1
    __doc__ = _DOC.format(n=1, name="LPPool1D", spatial="length", shape="1, 4, 1", size=2)


class LPPool2D(_LPPool):
    _rank: ClassVar[int] = 2
    __doc__ = _DOC.format(n=2, name="LPPool2D", spatial="height, width", shape="1, 1, 4, 1", size="(1, 2)")


class LPPool3D(_LPPool):
    _rank: ClassVar[int] = 3
    __doc__ = _DOC.format(n=3, name="LPPool3D", spatial="depth, height, width", shape="1, 1, 1, 4, 1", size="(1, 1, 2)")
