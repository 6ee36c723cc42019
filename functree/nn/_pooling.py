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

import itertools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._repr import short_array
from functree.nn import _window as window
from functree.nn._check import LayerInputError, check_input, concrete
from functree.nn._conv import check_window_fits
from functree.nn._mode import Layer
from functree.nn._normalization import statistics_dtype

__all__ = [
    "MaxPool1D",
    "MaxPool2D",
    "MaxPool3D",
    "AvgPool1D",
    "AvgPool2D",
    "AvgPool3D",
    "GlobalMaxPool1D",
    "GlobalMaxPool2D",
    "GlobalMaxPool3D",
    "GlobalAvgPool1D",
    "GlobalAvgPool2D",
    "GlobalAvgPool3D",
    "AdaptiveAvgPool1D",
    "AdaptiveAvgPool2D",
    "AdaptiveAvgPool3D",
    "AdaptiveMaxPool1D",
    "AdaptiveMaxPool2D",
    "AdaptiveMaxPool3D",
    "MaxUnpool1D",
    "MaxUnpool2D",
    "MaxUnpool3D",
    "adaptive_windows",
    "overhang",
    "Flatten",
]


EMPTY_MAX = """\
Its {axis} is empty: a maximum over no values has none (torch's AdaptiveMaxPool raises here \
too; a global average is NaN in both).

    wrong:  ft.nn.{cls}()(x)     # x: {given}
    right:  ft.nn.{cls}()(x)     # x with {axis} >= 1 (the layer before keeps an axis: padding="SAME")"""


CEIL_MODE_SAME = """\
{cls}: ceil_mode=True with padding="SAME": "SAME" already keeps every partial window \
(ceil(length / strides) outputs); ceil_mode is torch's, for an int padding or "VALID".

    wrong:  {cls}(3, 2, padding="SAME", ceil_mode=True)
    right:  {cls}(3, 2, padding=1, ceil_mode=True)     # torch's MaxPool(3, 2, padding=1, ceil_mode=True)
"""


POOL_PAD_TOO_LARGE = """\
{cls}: padding={padding!r} is more than half the pool ({size}): a window could lie wholly in the \
padding (torch's "pad should be at most half of effective kernel size").

    wrong:  {cls}({size}, padding={padding!r})
    right:  {cls}({size}, padding={most!r})     # or padding="SAME"
"""


WINDOW_IN_PADDING = """\
Its {axis} ({size}) leaves window {index} reading only padding: pool_size {k} with dilation {d} \
reads positions {positions} of the padded axis ({lo} padding before), none of them the input's, \
so its max is -inf (torch's too, its backward writing the gradient at an index past the input).

    wrong:  {cls}({settings})(x)     # x's {axis}: {size}
    right:  {cls}({fixed})(x)     # or an input whose {axis} puts an element in every window"""


BAD_DIVISOR = """\
{cls}: divisor_override={given!r}; torch's is a nonzero int that divides every window's sum \
(None: the window's count).

    wrong:  {cls}(2, divisor_override={given!r})
    right:  {cls}(2, divisor_override=3)"""


def _show(values: tuple[int, ...]) -> Any:
    """Sizes as a user writes them: one int where every axis has it."""
    return values[0] if len(set(values)) == 1 else values


def _spatial(n: int) -> tuple[str, ...]:
    return (("length",), ("height", "width"), ("depth", "height", "width"))[n - 1] + ("channels",)


def overhang(length: int, low: int, high: int, size: int, stride: int, dilation: int = 1) -> int:
    """The padding torch's ``ceil_mode=True`` adds after an axis's ``(low, high)`` padding
    for its last, partial window.

    With the window spanning ``e = d (k - 1) + 1`` over ``P = L + low + high`` positions there are
    ``ceil((P - e) / s) + 1`` windows, less one where the last would start at or past
    ``L + low`` (in the right padding: torch's rule, every window starts inside the input or
    its left padding); the last ends ``(n - 1) s + e - P`` past the padding (0 if none).
    ``floor`` division rounds toward minus infinity, as torch's ``div_rtn``: an axis shorter
    than the window still gets one window where ``P - e > -s``.
    """
    span = dilation * (size - 1) + 1
    padded = length + low + high
    count = (padded - span + stride - 1) // stride + 1
    if count >= 1 and (count - 1) * stride >= length + low:
        count -= 1
    return max(0, (count - 1) * stride + span - padded) if count >= 1 else 0


class _Pool(Layer):
    pool_size: tuple[int, ...] = field(static=True, default=(2,))
    strides: tuple[int, ...] = field(static=True, default=(2,))
    padding: Any = field(static=True, default="VALID")
    ceil_mode: bool = field(static=True, default=False)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("ceil_mode",)  # files written before it: False

    _rank: ClassVar[int] = 1

    def __init__(
        self,
        pool_size: int | Sequence[int] = 2,
        strides: int | Sequence[int] | None = None,
        padding: Any = "VALID",
        ceil_mode: bool = False,
    ):
        name = type(self).__name__
        self.pool_size = window.sizes(name, "pool_size", pool_size, self._rank)
        self.strides = self.pool_size if strides is None else window.sizes(name, "strides", strides, self._rank)
        self.padding = window.padding(name, padding, self._rank)  # a name, or torch's padding=p as (low, high) pairs
        if not isinstance(self.padding, str) and any(max(pair) > k // 2 for pair, k in zip(self.padding, self.pool_size)):
            # a window wholly in the padding: -inf (max), 0 or NaN (average); torch refuses it too
            raise ValueError(POOL_PAD_TOO_LARGE.format(cls=name, padding=padding, size=_show(self.pool_size),
                                                       most=_show(tuple(k // 2 for k in self.pool_size))))
        if ceil_mode and self.padding == "SAME":
            raise ValueError(CEIL_MODE_SAME.format(cls=name))
        self.ceil_mode = bool(ceil_mode)

    @property
    def _dilation(self) -> tuple[int, ...]:
        return (1,) * self._rank

    def _pads(self, x: jax.Array) -> Any:
        """The padding the window reads: ``padding``, and with ``ceil_mode`` each axis's
        :func:`overhang` after it (filled as the padding is: ``-inf`` for max, uncounted 0 for
        average)."""
        if not self.ceil_mode:
            return self.padding
        n = self._rank
        pads = ((0, 0),) * n if self.padding == "VALID" else self.padding
        lengths = x.shape[x.ndim - n - 1:-1]
        return tuple((lo, hi + overhang(length, lo, hi, k, s, d)) for (lo, hi), length, k, s, d in
                     zip(pads, lengths, self.pool_size, self.strides, self._dilation))

    def _window(self, x: jax.Array, init: Any, op: Any, pads: Any) -> jax.Array:
        check_input(self, x, _spatial(self._rank))
        check_window_fits(self, x, _spatial(self._rank)[:-1], self.pool_size, self.strides, self._dilation,
                          pads, kernel_name="pool_size")
        lead = x.ndim - self._rank - 1
        dims = (1,) * lead + self.pool_size + (1,)
        strides = (1,) * lead + self.strides + (1,)
        dilation = (1,) * lead + self._dilation + (1,)
        pads = pads if isinstance(pads, str) else ((0, 0),) * lead + tuple(pads) + ((0, 0),)
        # padded with init: -inf for max, 0 for sums
        return jax.lax.reduce_window(x, init, op, dims, strides, pads, window_dilation=dilation)


class _MaxPool(_Pool):
    dilation: tuple[int, ...] = field(static=True, default=(1,))
    return_indices: bool = field(static=True, default=False)
    # older files: 1s, False, False
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("ceil_mode", "dilation", "return_indices")

    def __init__(
        self,
        pool_size: int | Sequence[int] = 2,
        strides: int | Sequence[int] | None = None,
        padding: Any = "VALID",
        ceil_mode: bool = False,
        dilation: int | Sequence[int] = 1,
        return_indices: bool = False,
    ):
        super().__init__(pool_size, strides, padding, ceil_mode)
        self.dilation = window.sizes(type(self).__name__, "dilation", dilation, self._rank)
        self.return_indices = bool(return_indices)

    @property
    def _dilation(self) -> tuple[int, ...]:
        # a file written before the field read it as (1,): one per axis
        return self.dilation if len(self.dilation) == self._rank else (1,) * self._rank

    def __call__(self, x: jax.Array) -> Any:
        if not self.return_indices and self._dilation == (1,) * self._rank:
            return self._window(x, -jnp.inf, jax.lax.max, self._pads(x))  # a Python scalar: lax sees the monoid
        # dilated: torch's pick of one maximum (the gradient reaches the first of equal maxima;
        # jnp.maximum's split it evenly between them)
        y, indices = self._dilated(x, self._pads(x))
        return (y, indices) if self.return_indices else y

    def _dilated(self, x: jax.Array, pads: Any) -> tuple[jax.Array, jax.Array]:
        """A dilated window's max (or any window's, with its index) as the max of its
        ``prod(pool_size)`` strided slices of the ``-inf``-padded input, ``y[i] = max_j x[i s +
        j d]``: JAX has no gradient of a dilated ``reduce_window`` max ("VJP not implemented
        for select_and_gather").

        ``(y, indices)``, torch's ``return_indices=True``: each maximum's flat index in its
        channel's unpadded plane (``h W + w`` in 2-D; int32), found as torch's loop finds it,
        the window read in order, an element taken where it is greater than the maximum so far
        or NaN (the first of equal maxima, the last NaN) and the first element on the input
        taken over the padding; the gradient reaches that element alone, as torch's."""
        n = self._rank
        check_input(self, x, _spatial(n))
        check_window_fits(self, x, _spatial(n)[:-1], self.pool_size, self.strides, self._dilation, pads,
                          kernel_name="pool_size")
        lead = x.ndim - n - 1
        spans = [d * (k - 1) + 1 for k, d in zip(self.pool_size, self._dilation)]
        if isinstance(pads, str):
            pads = jax.lax.padtype_to_pads(x.shape[lead:-1], spans, self.strides, pads)
        self._check_windows_read_input(x, pads)
        padded = jnp.pad(x, ((0, 0),) * lead + tuple(pads) + ((0, 0),), constant_values=-jnp.inf)
        counts = [(length - span) // s + 1 for length, span, s in zip(padded.shape[lead:-1], spans, self.strides)]
        plane = x.shape[lead:-1]
        # each position's flat index in the unpadded plane; -1 in the padding
        flat = jnp.pad(jnp.arange(math.prod(plane), dtype=jnp.int32).reshape((*plane, 1)), (*pads, (0, 0)),
                       constant_values=-1)
        y = index = None
        for offset in itertools.product(*(range(k) for k in self.pool_size)):
            starts = [j * d for j, d in zip(offset, self._dilation)]
            ends = [b + (c - 1) * s + 1 for b, c, s in zip(starts, counts, self.strides)]
            part = jax.lax.slice(padded, (0,) * lead + tuple(starts) + (0,),
                                 padded.shape[:lead] + tuple(ends) + padded.shape[-1:],
                                 (1,) * lead + self.strides + (1,))
            at = jax.lax.broadcast_to_rank(jax.lax.slice(flat, (*starts, 0), (*ends, 1), (*self.strides, 1)), part.ndim)
            if y is None or index is None:
                y, index = part, jnp.broadcast_to(at, part.shape)
                continue
            take = (part > y) | jnp.isnan(part) | ((index < 0) & (at >= 0))  # torch's loop (above)
            y, index = jnp.where(take, part, y), jnp.where(take, at, index)
        assert y is not None and index is not None  # pool sizes are >= 1
        return y, index

    def _check_windows_read_input(self, x: jax.Array, pads: Any) -> None:
        """Refuse a window all of whose ``k`` positions ``i s - lo + j d`` fall in the padding
        (only dilation lets one: ``lo <= k // 2`` keeps a contiguous window on the input):
        :data:`WINDOW_IN_PADDING`. Static shapes only."""
        n = self._rank
        names = _spatial(n)[:-1]
        for axis, length, (lo, hi), k, s, d in zip(names, x.shape[x.ndim - n - 1:-1], pads, self.pool_size,
                                                  self.strides, self._dilation):
            span = d * (k - 1) + 1
            for i in range((length + lo + hi - span) // s + 1):
                positions = [i * s + j * d for j in range(k)]
                if all(not lo <= p < lo + length for p in positions):
                    given = self.padding if isinstance(self.padding, str) else (
                        self.padding[0][0] if len({v for pair in self.padding for v in pair}) == 1 else self.padding)
                    settings = f"{_show(self.pool_size)}, padding={given!r}, dilation={_show(self._dilation)}"
                    fixed = f"{_show(self.pool_size)}, padding=0, dilation={_show(self._dilation)}"
                    fix = WINDOW_IN_PADDING.format(axis=axis, size=length, index=i, k=k, d=d, positions=positions,
                                                   lo=lo, cls=type(self).__name__, settings=settings, fixed=fixed)
                    pattern = "[..., " + ", ".join(names) + f", {x.shape[-1]}]"
                    raise LayerInputError(self, f"{pattern} (float) with every window on the input", short_array(x),
                                          fix)


class _AvgPool(_Pool):
    count_include_pad: bool = field(static=True, default=True)
    divisor_override: int | None = field(static=True, default=None)
    # older files: True, False, None
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("count_include_pad", "ceil_mode", "divisor_override")

    def __init__(
        self,
        pool_size: int | Sequence[int] = 2,
        strides: int | Sequence[int] | None = None,
        padding: Any = "VALID",
        count_include_pad: bool = True,
        ceil_mode: bool = False,
        divisor_override: int | None = None,
    ):
        super().__init__(pool_size, strides, padding, ceil_mode)
        self.count_include_pad = bool(count_include_pad)  # torch's; read for int / pair padding ("SAME": real counts)
        if divisor_override is not None and (not window.is_int(divisor_override) or divisor_override == 0):
            # torch: "divisor must be not zero"; a float divides by what it rounds to
            raise ValueError(BAD_DIVISOR.format(cls=type(self).__name__, given=divisor_override))
        self.divisor_override = None if divisor_override is None else int(divisor_override)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``sum(window) / count`` with both in ``statistics_dtype`` (float32 for bfloat16 and
        float16: a bfloat16 sum of 32x32 ones stalls at 256, a mean of 0.25), cast back.

        ``count`` is the pool's size, or (``"SAME"``, ``count_include_pad=False``) the real
        elements in the window; with ``ceil_mode`` the positions past the padding never count
        (torch: ``min(start + k, L + pad) - start``), the padding counts as
        ``count_include_pad`` says. ``divisor_override`` replaces ``count`` (torch's: every
        window divided by it, whatever its padding)."""
        check_input(self, x, _spatial(self._rank))  # before the cast hides an integer input
        wide = statistics_dtype(x.dtype)
        pads = self._pads(x)
        total = self._window(x.astype(wide), 0.0, jax.lax.add, pads)
        if self.divisor_override is not None:
            return (total / jnp.array(self.divisor_override, wide)).astype(x.dtype)
        counted = not isinstance(self.padding, str) and self.count_include_pad
        if not self.ceil_mode and (self.padding == "VALID" or counted):
            return (total / jnp.array(math.prod(self.pool_size), wide)).astype(x.dtype)
        # The elements each window counts, summed by the same window in the same dtype.
        n = self._rank
        ones = jnp.ones(x.shape[-n - 1:], wide)
        if counted:  # the padding counts, the overhang does not: ones padded by ones, the window then pads 0s
            own: tuple[tuple[int, int], ...] = self.padding  # pyright: ignore[reportAssignmentType]  # pairs: counted
            ones = jnp.pad(ones, [*own, (0, 0)], constant_values=1)
            pads = tuple((0, hi - pad_hi) for (_, hi), (_, pad_hi) in zip(pads, own))
        counts = self._window(ones, 0.0, jax.lax.add, pads)
        return (total / jax.lax.broadcast_to_rank(counts, total.ndim)).astype(x.dtype)


_POOL_DOC = """{op} pooling over ``[..., {spatial}, channels]`` (``pool_size=2``, ``strides=pool_size``, ``padding="VALID"``).

    ``y[..., i, c] = {formula}`` over the window ``x[..., i*stride : i*stride + pool_size, c]``.

    Args: ``pool_size=2, strides=pool_size, padding="VALID"`` (``"SAME"``, or torch's int /
    per-axis ``(low, high)`` padding){extra_args}, ``ceil_mode=False``: torch's, the last
    partial window kept when it starts inside the input or its left padding
    (``ceil((L + 2p - e) / s) + 1`` outputs, ``e`` the window's span; :func:`overhang`).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.arange({n}.0).reshape({shape})
      >>> ft.nn.{name}({size})(x){out}
    """

_MAX_ARGS = (", ``dilation=1`` (torch's: the window reads every ``d``-th element, spanning "
             "``d (k - 1) + 1``; the padding is at most half the pool, as torch's; of equal maxima the "
             "first in the window, row-major, gets the gradient, as torch's)")
_AVG_ARGS = (", ``count_include_pad=True`` (torch's: int / pair padding's zeros count in the mean; "
             '``"SAME"`` counts the real elements), ``divisor_override=None`` (torch\'s: an int that divides '
             "every window's sum instead)")


class MaxPool1D(_MaxPool):
    _rank: ClassVar[int] = 1
    __doc__ = _POOL_DOC.format(
        op="1-D max", spatial="length", formula="max(window)", n=4, shape="1, 4, 1",
        extra_args=_MAX_ARGS, name="MaxPool1D", size=2, out=".ravel()\n      Array([1., 3.], dtype=float32)",
    )


class MaxPool2D(_MaxPool):
    _rank: ClassVar[int] = 2
    __doc__ = _POOL_DOC.format(
        op="2-D max", spatial="height, width", formula="max(window)", n=16, shape="1, 4, 4, 1",
        extra_args=_MAX_ARGS, name="MaxPool2D", size="(2, 2)", out=".ravel()\n      Array([ 5.,  7., 13., 15.], dtype=float32)",
    )


class AvgPool1D(_AvgPool):
    _rank: ClassVar[int] = 1
    __doc__ = _POOL_DOC.format(
        op="1-D average", spatial="length", formula="mean(window)", n=4, shape="1, 4, 1",
        extra_args=_AVG_ARGS, name="AvgPool1D", size=2, out=".ravel()\n      Array([0.5, 2.5], dtype=float32)",
    )


class AvgPool2D(_AvgPool):
    _rank: ClassVar[int] = 2
    __doc__ = _POOL_DOC.format(
        op="2-D average", spatial="height, width", formula="mean(window)", n=16, shape="1, 4, 4, 1",
        extra_args=_AVG_ARGS, name="AvgPool2D", size="(2, 2)", out=".ravel()\n      Array([ 2.5,  4.5, 10.5, 12.5], dtype=float32)",
    )


class MaxPool3D(_MaxPool):
    _rank: ClassVar[int] = 3
    __doc__ = _POOL_DOC.format(
        op="3-D max", spatial="depth, height, width", formula="max(window)", n=32, shape="1, 2, 4, 4, 1",
        extra_args=_MAX_ARGS, name="MaxPool3D", size="(2, 2, 2)",
        out=".ravel()\n      Array([21., 23., 29., 31.], dtype=float32)",
    )


class AvgPool3D(_AvgPool):
    _rank: ClassVar[int] = 3
    __doc__ = _POOL_DOC.format(
        op="3-D average", spatial="depth, height, width", formula="mean(window)", n=32, shape="1, 2, 4, 4, 1",
        extra_args=_AVG_ARGS, name="AvgPool3D", size="(2, 2, 2)",
        out=".ravel()\n      Array([10.5, 12.5, 18.5, 20.5], dtype=float32)",
    )


UNPOOL_INDICES = """\
{cls}: indices {given}; they are the indices {pool}(..., return_indices=True) returns \
beside x, integers of x's shape {shape}.

    right:  y, indices = ft.nn.{pool}(2, return_indices=True)(x)
            ft.nn.{cls}(2)(y, indices)"""

UNPOOL_OUTPUT_SIZE = """\
{cls}: output_size={given!r} does not fit: from {axes} {lengths} at pool_size {k}, strides {s}, padding \
{p} the unpooled {axes} are {default} (torch's (L - 1) s + k - 2 p), and torch's output_size picks \
each between that minus the stride and that plus it, exclusive: {ranges}.

    wrong:  ft.nn.{cls}({settings})(x, indices, output_size={given!r})
    right:  ft.nn.{cls}({settings})(x, indices, output_size={right!r})   # the pooled input's spatial shape"""

UNPOOL_INDEX_RANGE = """\
{cls}: index {index} (at {where}) is outside the unpooled plane of {size} positions {shape}; \
torch raises too ("Found an invalid max index"). Unpool with the output_size the indices were \
taken on (the pooled input's spatial shape), or the indices of a MaxPool of the same settings:

    right:  ft.nn.{cls}({settings})(y, indices, output_size=x.shape[-{n1}:-1])"""


class _MaxUnpool(Layer):
    """torch's ``MaxUnpool{n}d``: each input value written at its index in a zero plane."""

    pool_size: tuple[int, ...] = field(static=True, default=(2,))
    strides: tuple[int, ...] = field(static=True, default=(2,))
    padding: tuple[int, ...] = field(static=True, default=(0,))

    _rank: ClassVar[int] = 1

    def __init__(self, pool_size: int | Sequence[int] = 2, strides: int | Sequence[int] | None = None,
                 padding: int | Sequence[int] = 0):
        name, n = type(self).__name__, self._rank
        self.pool_size = window.sizes(name, "pool_size", pool_size, n)
        self.strides = self.pool_size if strides is None else window.sizes(name, "strides", strides, n)
        pairs = window.padding(name, padding, n)
        if isinstance(pairs, str) or any(lo != hi for lo, hi in pairs):
            raise ValueError(window.BAD_WINDOW.format(cls=name, name="padding", given=padding, n=n,
                                                      axes="axis" if n == 1 else "axes",
                                                      what=f"an int >= 0, or {n} of them (torch's padding=p)",
                                                      right=1 if n == 1 else (1,) * n))
        self.padding = tuple(lo for lo, _ in pairs)

    def __call__(self, x: jax.Array, indices: jax.Array, output_size: Sequence[int] | None = None) -> jax.Array:
        """``y[..., p, c] = x[..., i, c]`` where ``indices[..., i, c] = p`` (``p`` flat in the
        unpooled plane), 0 elsewhere. The gradient of ``x[i]`` is ``dy[indices[i]]``, torch's;
        where two inputs share an index (overlapping pool windows) only one gets it, the
        derivative of the function (torch gives it to each: :func:`_unpooled`)."""
        n, name = self._rank, type(self).__name__
        spatial = _spatial(n)
        check_input(self, x, spatial)
        if jnp.shape(indices) != x.shape or not jnp.issubdtype(jnp.result_type(indices), jnp.integer):
            raise LayerInputError(self, f"indices of x's shape {short_array(x)} (integer)", short_array(indices),
                                  UNPOOL_INDICES.format(cls=name, given=short_array(indices), shape=x.shape, pool=f"MaxPool{n}D"))
        lead = x.ndim - n - 1
        out = self._output_size(x.shape[lead:-1], output_size)
        size = math.prod(out)
        traced = not self._check_range(indices, size, out)
        rows, channels = math.prod(x.shape[:lead]), x.shape[-1]
        cells = math.prod(x.shape[lead:-1])  # not -1: the leading axes may be empty
        values = x.reshape((rows, cells, channels))
        at = jnp.asarray(indices).reshape((rows, cells, channels))
        outside = (at < 0) | (at >= size)  # traced indices only (_check_range refused concrete ones)
        at = jnp.where(at < 0, size, at)  # past the end, dropped (a negative index would wrap)
        y = _unpooled(values, at, size)
        if traced:  # an index outside the plane: the plane NaN, never zeros in its place
            y = jnp.where(outside.any(axis=1, keepdims=True), jnp.asarray(jnp.nan, y.dtype), y)
        return y.reshape((*x.shape[:lead], *out, channels))

    def _output_size(self, lengths: tuple[int, ...], output_size: Sequence[int] | None) -> tuple[int, ...]:
        n = self._rank
        default = tuple((length - 1) * s + k - 2 * p for length, s, k, p in
                        zip(lengths, self.strides, self.pool_size, self.padding))
        if output_size is None:
            return default
        given = tuple(output_size)[-n:] if isinstance(output_size, Sequence) else None
        if (given is None or len(tuple(output_size)) not in (n, n + 2) or not all(window.is_int(v) for v in given)
                or not all(d - s < v < d + s for v, d, s in zip(given, default, self.strides))):
            name = type(self).__name__
            ranges = ", ".join(f"{d - s + 1}..{d + s - 1}" for d, s in zip(default, self.strides))
            settings = self._settings()
            raise ValueError(UNPOOL_OUTPUT_SIZE.format(
                cls=name, given=output_size, axes="length" if n == 1 else "sizes", lengths=lengths,
                k=_show(self.pool_size), s=_show(self.strides), p=_show(self.padding), default=default,
                ranges=ranges, settings=settings, right=default))
        return tuple(int(v) for v in given)

    def _check_range(self, indices: jax.Array, size: int, out: tuple[int, ...]) -> bool:
        """:data:`UNPOOL_INDEX_RANGE` for an index outside ``[0, size)``, eagerly; whether the
        indices were seen (traced ones are not: such an index makes its channel's plane NaN)."""
        held = concrete(indices)
        if held is None or held.size == 0:
            return held is not None
        bad = np.argwhere((held < 0) | (held >= size))
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            raise ValueError(UNPOOL_INDEX_RANGE.format(
                cls=type(self).__name__, index=int(held[where]), where=list(where), size=size, shape=out,
                settings=self._settings(), n1=self._rank + 1))
        return True

    def _settings(self) -> str:
        return f"{_show(self.pool_size)}, {_show(self.strides)}, {_show(self.padding)}"


def _unpooled(values: jax.Array, at: jax.Array, size: int) -> jax.Array:
    """``values [rows, n, channels]`` written at ``at`` (flat positions, ``size`` past the
    end: dropped) of zeros ``[rows, size, channels]``. Two values at one index (overlapping
    windows picked one element twice: equal values) write it once, and its gradient reaches
    one of them: the derivative of this function, so pooling then unpooling passes an
    element's gradient once. torch's backward gathers the gradient for each, and twice
    through the pool (2 g where the element appears once in the output)."""
    row = jnp.arange(values.shape[0])[:, None, None]
    channel = jnp.arange(values.shape[2])[None, None, :]
    zeros = jnp.zeros((values.shape[0], size, values.shape[2]), values.dtype)
    return zeros.at[row, at, channel].set(values, mode="drop")


_UNPOOL_DOC = """The inverse of ``MaxPool{n}D(..., return_indices=True)`` (torch's ``MaxUnpool{n}d``):
    ``[..., {spatial}, channels]`` values and their indices into a zero plane of
    ``(L - 1) strides + pool_size - 2 padding`` per axis (or ``output_size=``, the pooled
    input's spatial shape, between that minus and plus the strides, as torch's).

    Each value goes to its flat index in its channel's plane; a gradient of an input is the
    output's gradient at its index. An index outside the plane is refused where the indices
    are concrete (torch raises) and, under ``jax.jit``, makes its channel's plane NaN (never
    a value dropped silently). Args: ``pool_size``, ``strides=pool_size``,
    ``padding=0`` (torch's ``padding=p``: an int or one per axis).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([1., 3., 2., 0.]).reshape({shape})
      >>> y, indices = ft.nn.{pool}({size}, return_indices=True)(x)
      >>> indices.ravel()
      Array([1, 2], dtype=int32)
      >>> ft.nn.{unpool}({size})(y, indices).ravel()
      Array([0., 3., 2., 0.], dtype=float32)
    """


class MaxUnpool1D(_MaxUnpool):
    _rank: ClassVar[int] = 1
    __doc__ = _UNPOOL_DOC.format(n=1, pool="MaxPool1D", unpool="MaxUnpool1D", spatial="length", shape="1, 4, 1",
                                 size=2)


class MaxUnpool2D(_MaxUnpool):
    _rank: ClassVar[int] = 2
    __doc__ = _UNPOOL_DOC.format(n=2, pool="MaxPool2D", unpool="MaxUnpool2D", spatial="height, width",
                                 shape="1, 1, 4, 1", size="(1, 2)")


class MaxUnpool3D(_MaxUnpool):
    _rank: ClassVar[int] = 3
    __doc__ = _UNPOOL_DOC.format(n=3, pool="MaxPool3D", unpool="MaxUnpool3D", spatial="depth, height, width",
                                 shape="1, 1, 1, 4, 1", size="(1, 1, 2)")


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


BAD_OUTPUT_SIZE = """\
{cls}: output_size={given!r} does not fit {n} spatial {axes}: an int >= 1 (every axis), or {n} \
entries (one per axis), each an int >= 1 or None (that axis keeps its input size).

    wrong:  {cls}({given!r})
    right:  {cls}({right})"""


def adaptive_windows(length: int, size: int) -> tuple[tuple[int, int], ...]:
    """torch's adaptive windows: output ``i`` of ``size`` reads ``[floor(i L / size),
    ceil((i + 1) L / size))`` of an axis of length ``L`` (uneven where ``size`` does not
    divide ``L``; overlapping, or repeated where ``size > L``).

    Example:
      >>> adaptive_windows(5, 3)
      ((0, 2), (1, 4), (3, 5))
    """
    return tuple((i * length // size, -(-(i + 1) * length // size)) for i in range(size))


def _adaptive_axis(x: jax.Array, axis: int, size: int, is_max: bool = False) -> jax.Array:
    """``x`` with ``axis`` reduced to ``size`` windows (:func:`adaptive_windows`): each
    window's elements gathered into a new axis (padded to the widest window by the last
    index, masked out) and reduced, sum / count or the max (the element ``argmax`` picks,
    so that the gradient reaches it alone: ``jnp.max``'s splits it between equal maxima). A
    box's mean or max is its axes' in turn: the windows are products of one window per axis
    (the max's last axis first, torch's row-major pick of equal maxima)."""
    length = x.shape[axis]
    bounds = adaptive_windows(length, size)
    if bounds == tuple((i, i + 1) for i in range(length)):
        return x  # one element a window: the identity
    width = max(end - start for start, end in bounds)
    index = np.array([[min(start + j, length - 1) for j in range(width)] for start, _ in bounds])
    real = np.array([[start + j < end for j in range(width)] for start, end in bounds])
    gathered = jnp.take(x, jnp.asarray(index), axis=axis)  # [..., size, width, ...]
    mask = jax.lax.broadcast_to_rank(jnp.asarray(real).reshape(real.shape + (1,) * (x.ndim - axis - 1)), gathered.ndim)
    if is_max:  # torch's one maximum (the first of equal ones, where the gradient goes; NaN: the first)
        first = jnp.argmax(jnp.where(mask, gathered, -jnp.inf), axis=axis + 1, keepdims=True)
        return jnp.squeeze(jnp.take_along_axis(gathered, first, axis=axis + 1), axis + 1)
    counts = np.array([end - start for start, end in bounds]).reshape((size,) + (1,) * (x.ndim - axis - 1))
    return jnp.sum(jnp.where(mask, gathered, 0), axis=axis + 1) / jax.lax.broadcast_to_rank(jnp.asarray(counts, x.dtype), x.ndim)


class _AdaptivePool(Layer):
    output_size: tuple[int | None, ...] = field(static=True, default=(1,))

    _rank: ClassVar[int] = 1

    def __init__(self, output_size: int | Sequence[int | None] | None):
        n, name = self._rank, type(self).__name__
        given: Any = output_size
        entries: tuple[Any, ...] | None = (given,) * n if given is None or window.is_int(given) else (
            tuple(given) if isinstance(given, Sequence) and not isinstance(given, str) else None)
        if entries is None or len(entries) != n or not all(e is None or (window.is_int(e) and e >= 1) for e in entries):
            right = 2 if n == 1 else (2,) * (n - 1) + (None,)
            raise ValueError(BAD_OUTPUT_SIZE.format(cls=name, given=output_size, n=n,
                                                    axes="axis" if n == 1 else "axes", right=right))
        self.output_size = tuple(None if e is None else int(e) for e in entries)

    def __call__(self, x: jax.Array) -> jax.Array:
        self._check(x)
        axes = range(x.ndim - self._rank - 1, x.ndim - 1)
        wide = statistics_dtype(x.dtype)  # sums of bfloat16 / float16 in float32, as AvgPool's
        y = x.astype(wide)  # (the maxima: _AdaptiveMaxPool's own call)
        for a, size in zip(axes, self.output_size):
            y = _adaptive_axis(y, a, x.shape[a] if size is None else size)
        return y.astype(x.dtype)

    def _check(self, x: jax.Array) -> None:
        names = _spatial(self._rank)
        check_input(self, x, names)
        axes = range(x.ndim - self._rank - 1, x.ndim - 1)
        empty = [name for name, a in zip(names, axes) if x.shape[a] == 0]
        if empty:  # windows of no elements: a max of none, a mean 0 / 0 (torch raises too)
            pattern = "[..., " + ", ".join(names) + "]"
            raise LayerInputError(self, f"{pattern} (float) with {empty[0]} >= 1", short_array(x),
                                  EMPTY_ADAPTIVE.format(axis=empty[0], cls=type(self).__name__,
                                                        size=_show_size(self.output_size), given=short_array(x)))


def _adaptive_axis_indexed(x: jax.Array, index: jax.Array, axis: int, size: int) -> tuple[jax.Array, jax.Array]:
    """:func:`_adaptive_axis`'s max with each maximum's ``index`` carried along: each window
    read in order, an element taken where it is greater than the maximum so far or NaN, as
    torch's loop takes it (the first of equal maxima, the last NaN)."""
    length = x.shape[axis]
    bounds = adaptive_windows(length, size)
    if bounds == tuple((i, i + 1) for i in range(length)):
        return x, index
    y = at = None
    for j in range(max(end - start for start, end in bounds)):
        picks = np.array([min(start + j, end - 1) for start, end in bounds])
        part, part_at = jnp.take(x, jnp.asarray(picks), axis=axis), jnp.take(index, jnp.asarray(picks), axis=axis)
        if y is None or at is None:
            y, at = part, part_at
            continue
        real = np.array([start + j < end for start, end in bounds]).reshape((size,) + (1,) * (x.ndim - axis - 1))
        take = jax.lax.broadcast_to_rank(jnp.asarray(real), part.ndim) & ((part > y) | jnp.isnan(part))
        y, at = jnp.where(take, part, y), jnp.where(take, part_at, at)
    assert y is not None and at is not None  # windows hold one element at least
    return y, at


def _show_size(size: tuple[int | None, ...]) -> Any:
    return size[0] if len(size) == 1 else size


EMPTY_ADAPTIVE = """\
Its {axis} is empty: an adaptive window of it holds no values (a max of none, a mean \
NaN); torch's max pool raises here too, its average to an int size gives NaN.

    wrong:  ft.nn.{cls}({size})(x)     # x: {given}
    right:  ft.nn.{cls}({size})(x)     # x with {axis} >= 1"""


_ADAPTIVE_DOC = """Adaptive {op} pooling to ``output_size``: ``[..., {spatial}, channels] -> [..., {out}, channels]``.

    torch's ``Adaptive{Op}Pool{n}d``: output ``i`` of ``o`` along an axis of length ``L``
    is the {op} of ``x[floor(i L / o) : ceil((i + 1) L / o)]`` (:func:`adaptive_windows`;
    uneven, overlapping windows where ``o`` does not divide ``L``). ``output_size`` is an int
    (every axis) or one entry per axis, None keeping that axis's length.{indices}

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.arange(5.0).reshape({shape})
      >>> ft.nn.{name}({size})(x).ravel()
      {result}
    """


_MAX_INDICES = """ ``return_indices=True``
    (torch's) returns ``(maxima, indices)``, each maximum's flat index in its channel's plane
    (``h W + w`` in 2-D, int32; the first of equal maxima, which alone gets the gradient,
    with or without it), which ``MaxUnpool*`` takes."""


class AdaptiveAvgPool1D(_AdaptivePool):
    _rank: ClassVar[int] = 1
    __doc__ = _ADAPTIVE_DOC.format(op="average", indices="", Op="Avg", n=1, spatial="length", out="o", shape="1, 5, 1",
                                   name="AdaptiveAvgPool1D", size=3,
                                   result="Array([0.5, 2. , 3.5], dtype=float32)")


class AdaptiveAvgPool2D(_AdaptivePool):
    _rank: ClassVar[int] = 2
    __doc__ = _ADAPTIVE_DOC.format(op="average", indices="", Op="Avg", n=2, spatial="height, width", out="o_h, o_w",
                                   shape="1, 5, 1, 1", name="AdaptiveAvgPool2D", size="(3, None)",
                                   result="Array([0.5, 2. , 3.5], dtype=float32)")


class _AdaptiveMaxPool(_AdaptivePool):
    return_indices: bool = field(static=True, default=False)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("return_indices",)  # files written before it: False

    def __init__(self, output_size: int | Sequence[int | None] | None, return_indices: bool = False):
        super().__init__(output_size)
        self.return_indices = bool(return_indices)

    def __call__(self, x: jax.Array) -> Any:
        """The maxima, and with ``return_indices`` their flat indices in each channel's
        plane (``h W + w`` in 2-D; int32), torch's: the last spatial axis reduced first, so
        equal maxima give the first in row-major order and NaNs the last, as torch's loop
        over each window."""
        self._check(x)
        n = self._rank
        if not self.return_indices:  # the gradient reaches torch's one element of equal maxima
            y = x
            for a, size in reversed(list(zip(range(x.ndim - n - 1, x.ndim - 1), self.output_size))):
                y = _adaptive_axis(y, a, x.shape[a] if size is None else size, is_max=True)
            return y
        lead = x.ndim - n - 1
        plane = x.shape[lead:-1]
        index = jnp.broadcast_to(jnp.arange(math.prod(plane), dtype=jnp.int32).reshape((*plane, 1)), x.shape)
        values = x
        for a, size in reversed(list(zip(range(lead, lead + n), self.output_size))):
            values, index = _adaptive_axis_indexed(values, index, a, x.shape[a] if size is None else size)
        return values, index


class AdaptiveMaxPool1D(_AdaptiveMaxPool):
    _rank: ClassVar[int] = 1
    __doc__ = _ADAPTIVE_DOC.format(op="max", indices=_MAX_INDICES, Op="Max", n=1, spatial="length", out="o", shape="1, 5, 1",
                                   name="AdaptiveMaxPool1D", size=3, result="Array([1., 3., 4.], dtype=float32)")


class AdaptiveMaxPool2D(_AdaptiveMaxPool):
    _rank: ClassVar[int] = 2
    __doc__ = _ADAPTIVE_DOC.format(op="max", indices=_MAX_INDICES, Op="Max", n=2, spatial="height, width", out="o_h, o_w",
                                   shape="1, 5, 1, 1", name="AdaptiveMaxPool2D", size="(3, 1)",
                                   result="Array([1., 3., 4.], dtype=float32)")


class AdaptiveAvgPool3D(_AdaptivePool):
    _rank: ClassVar[int] = 3
    __doc__ = _ADAPTIVE_DOC.format(op="average", indices="", Op="Avg", n=3, spatial="depth, height, width",
                                   out="o_d, o_h, o_w", shape="1, 1, 5, 1, 1", name="AdaptiveAvgPool3D",
                                   size="(None, 3, 1)", result="Array([0.5, 2. , 3.5], dtype=float32)")


class AdaptiveMaxPool3D(_AdaptiveMaxPool):
    _rank: ClassVar[int] = 3
    __doc__ = _ADAPTIVE_DOC.format(op="max", indices=_MAX_INDICES, Op="Max", n=3, spatial="depth, height, width",
                                   out="o_d, o_h, o_w", shape="1, 1, 5, 1, 1", name="AdaptiveMaxPool3D",
                                   size="(1, 3, None)", result="Array([1., 3., 4.], dtype=float32)")


class GlobalMaxPool3D(_GlobalPool):
    _rank: ClassVar[int] = 3
    _max: ClassVar[bool] = True
    __doc__ = _GLOBAL_DOC.format(
        op="max", spatial="depth, height, width", name="GlobalMaxPool3D", n=16, shape="1, 2, 2, 2, 2",
        out="Array([[14., 15.]], dtype=float32)",
    )


class GlobalAvgPool3D(_GlobalPool):
    _rank: ClassVar[int] = 3
    __doc__ = _GLOBAL_DOC.format(
        op="average", spatial="depth, height, width", name="GlobalAvgPool3D", n=16, shape="1, 2, 2, 2, 2",
        out="Array([[7., 8.]], dtype=float32)",
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
