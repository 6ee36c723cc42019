"""``Unfold`` (im2col) and ``Fold`` (col2im), torch's, over channels-last images.

``Unfold`` takes ``[..., H, W, C]`` to the sliding blocks ``[..., L, C * kh * kw]``: block
``l`` (row-major over the ``oh x ow`` window positions) holds its window's values, channel
first, then the kernel row and column, ``f = (c kh + i) kw + j``, torch's order; torch's
``[N, C * kh * kw, L]`` is this transposed (``y.swapaxes(-1, -2)``), so a torch weight of
shape ``[out, C * kh * kw]`` multiplies it as ``y @ weight.T``. ``Fold`` is its adjoint:
``[..., L, C * kh * kw] -> [..., H, W, C]``, each block added back at its window (overlaps
sum), ``output_size=(H, W)``. ``Fold(Unfold(x))`` is ``x`` times how many windows cover
each position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import field
from functree._repr import short_array
from functree.nn import _window as window
from functree.nn._check import LayerInputError, check_input
from functree.nn._conv import check_window_fits
from functree.nn._mode import Layer
from functree.nn._xla_conv import pads_at_risk

__all__ = ["Unfold", "Fold"]

FOLD_BLOCKS = """\
Its {given_blocks} blocks of {given_features} features do not fit output_size={size}: \
kernel_size {k}, strides {s}, dilation {d} and padding {p} give {blocks} blocks ({grid}) of \
C * {kk} features ({features_note}).

    wrong:  ft.nn.Fold({size}, {k})(x)     # x: {given}
    right:  ft.nn.Fold({size}, {k})(x)     # x: [..., {blocks}, C * {kk}], Unfold({k})'s output of a [..., {h}, {w}, C] image"""

FOLD_NO_BLOCKS = """\
Fold: output_size={size} holds no block: kernel_size {k} with dilation {d} spans {spans}, \
more than the padded output {padded} (torch: "calculated shape of the array of sliding \
blocks ... must be at least one").

    wrong:  ft.nn.Fold({size}, {k})
    right:  ft.nn.Fold({size}, {k}, padding={pad})     # or an output_size of at least the span"""


class _Blocks(Layer):
    kernel_size: tuple[int, ...] = field(static=True, default=(1, 1))
    dilation: tuple[int, ...] = field(static=True, default=(1, 1))
    padding: Any = field(static=True, default=((0, 0), (0, 0)))
    strides: tuple[int, ...] = field(static=True, default=(1, 1))

    def _settings(self, kernel_size: Any, dilation: Any, padding: Any, strides: Any) -> None:
        name = type(self).__name__
        self.kernel_size = window.sizes(name, "kernel_size", kernel_size, 2)
        self.dilation = window.sizes(name, "dilation", dilation, 2)
        self.padding = window.padding(name, padding, 2)
        self.strides = window.sizes(name, "strides", strides, 2)

    def _unfold(self, x: jax.Array) -> jax.Array:
        """``[..., H, W, C] -> [..., L, C * kh * kw]`` (``lax.conv_general_dilated_patches``,
        whose features are channel-major, torch's order)."""
        lead = x.shape[:-3]
        flat = x.reshape((math.prod(lead), *x.shape[-3:]))
        padding = self.padding
        if not isinstance(padding, str) and pads_at_risk(self.kernel_size, self.strides, self.dilation, padding):
            # padded by hand where XLA would abort compiling Fold and this gradient (_xla_conv)
            flat, padding = jnp.pad(flat, ((0, 0), *padding, (0, 0))), "VALID"
        patches = jax.lax.conv_general_dilated_patches(
            flat, self.kernel_size, self.strides, padding, rhs_dilation=self.dilation,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=jax.lax.Precision.HIGHEST)
        return patches.reshape((*lead, patches.shape[1] * patches.shape[2], patches.shape[3]))


class Unfold(_Blocks):
    """torch's ``nn.Unfold``: the sliding blocks of ``[..., H, W, C]`` as ``[..., L, C * kh * kw]``.

    ``y[..., l, (c kh + i) kw + j] = x_padded[..., a s_h + i d_h, b s_w + j d_w, c]`` for block
    ``l = a ow + b``; ``L = oh ow``, ``oh = floor((H + pads - d (kh - 1) - 1) / s) + 1``.
    torch's ``[N, C kh kw, L]`` is ``y.swapaxes(-1, -2)`` (module doc). Args: ``kernel_size``,
    ``dilation=1``, ``padding=0`` (an int, one per axis, or ``(low, high)`` pairs),
    ``strides=1`` (torch's ``stride``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.arange(6.0).reshape(1, 2, 3, 1)     # [[0 1 2] [3 4 5]]
      >>> ft.nn.Unfold((2, 2))(x)
      Array([[[0., 1., 3., 4.],
              [1., 2., 4., 5.]]], dtype=float32)
    """

    def __init__(self, kernel_size: int | Sequence[int], dilation: int | Sequence[int] = 1,
                 padding: Any = 0, strides: int | Sequence[int] = 1):
        self._settings(kernel_size, dilation, padding, strides)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, ("height", "width", "channels"))
        check_window_fits(self, x, ("height", "width"), self.kernel_size, self.strides, self.dilation, self.padding)
        return self._unfold(x)


class Fold(_Blocks):
    """torch's ``nn.Fold``: ``[..., L, C * kh * kw]`` blocks summed back into ``[..., H, W, C]``.

    The adjoint of :class:`Unfold` with the same settings (``jax.linear_transpose`` of it):
    ``y[..., h, w, c] = sum`` over the blocks ``l`` and kernel offsets ``(i, j)`` whose window
    puts them at ``(h, w)`` of ``x[..., l, (c kh + i) kw + j]``; ``output_size=(H, W)``
    (torch's). Args as ``Unfold``'s after ``output_size``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> blocks = ft.nn.Unfold((2, 2))(jnp.ones((1, 2, 3, 1)))
      >>> ft.nn.Fold((2, 3), (2, 2))(blocks)[0, ..., 0]     # each position counted per window
      Array([[1., 2., 1.],
             [1., 2., 1.]], dtype=float32)
    """

    output_size: tuple[int, ...] = field(static=True, default=(1, 1))

    def __init__(self, output_size: int | Sequence[int], kernel_size: int | Sequence[int],
                 dilation: int | Sequence[int] = 1, padding: Any = 0, strides: int | Sequence[int] = 1):
        self.output_size = window.sizes("Fold", "output_size", output_size, 2)
        self._settings(kernel_size, dilation, padding, strides)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, ("blocks", "features"))
        h, w = self.output_size
        probe = jax.ShapeDtypeStruct((1, h, w, 1), x.dtype)
        try:
            blocks = jax.eval_shape(self._unfold, probe).shape[-2]
        except TypeError:  # a window larger than the padded output: no block
            blocks = 0
        kk = math.prod(self.kernel_size)
        if blocks == 0:
            spans = tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))
            pads = ((0, 0), (0, 0)) if isinstance(self.padding, str) else self.padding
            padded = tuple(n + lo + hi for n, (lo, hi) in zip(self.output_size, pads))
            pad = max(max(0, -(-(s - n) // 2)) for s, n in zip(spans, self.output_size))
            raise LayerInputError(self, f"[..., L, C * {kk}] (float)", short_array(x), FOLD_NO_BLOCKS.format(
                size=self.output_size, k=self.kernel_size, d=self.dilation, spans=spans, padded=padded, pad=pad))
        if x.shape[-2] != blocks or x.shape[-1] % kk:
            pads = self.padding if isinstance(self.padding, str) else tuple(self.padding)
            grid = f"{blocks} positions"
            fix = FOLD_BLOCKS.format(given_blocks=x.shape[-2], given_features=x.shape[-1], size=self.output_size,
                                     k=self.kernel_size, s=self.strides, d=self.dilation, p=pads, blocks=blocks,
                                     grid=grid, kk=kk, features_note=f"{x.shape[-1]} is not a multiple of {kk}"
                                     if x.shape[-1] % kk else f"{x.shape[-1]} = {x.shape[-1] // kk} x {kk}",
                                     given=short_array(x), h=h, w=w)
            raise LayerInputError(self, f"[..., {blocks}, C * {kk}] (float)", short_array(x), fix)
        channels = x.shape[-1] // kk
        lead = x.shape[:-2]
        flat = x.reshape((math.prod(lead), *x.shape[-2:]))
        image = jax.ShapeDtypeStruct((flat.shape[0], h, w, channels), x.dtype)
        (y,) = jax.linear_transpose(self._unfold, image)(flat)
        return y.reshape((*lead, h, w, channels))
