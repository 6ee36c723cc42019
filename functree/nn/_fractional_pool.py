"""Fractional max pooling (Graham 2014): torch's ``nn.FractionalMaxPool2d`` / ``3d``, channels last."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._random import flat_key
from functree._repr import first_index, short_array
from functree.nn import _window as window
from functree.nn._check import LayerInputError, check_input, concrete
from functree.nn._mode import Layer

__all__ = ["FractionalMaxPool2D", "FractionalMaxPool3D", "fractional_intervals", "SAMPLES_OUTSIDE"]

ONE_SIZE = """\
{cls} takes exactly one of output_size and output_ratio, got {given}.

    wrong:  ft.nn.{cls}(3{wrong})
    right:  ft.nn.{cls}(3, output_size={size})        # or output_ratio=0.5: each axis int(length * 0.5)"""

BAD_RATIO = """\
{cls}: output_ratio={given!r} must be {n} numbers in (0, 1) (torch's range), one per axis, or one for all.

    wrong:  ft.nn.{cls}(3, output_ratio={given!r})
    right:  ft.nn.{cls}(3, output_ratio=0.5)"""

TOO_SMALL = """\
{cls}: the {axis} axis has {length} entries, too few for {out} outputs of pool size {k}: it needs \
output_size + pool_size - 1 = {need} (torch refuses it too: "pool ... too large relative to input").

    wrong:  ft.nn.{cls}({k_arg}, output_size={out_arg})(x)     # x: {given}
    right:  ft.nn.{cls}({k_arg}, output_size={fix})(x)"""

NO_SAMPLES = """\
{cls} draws its windows at random on every call (as torch's, in training and evaluation alike): \
pass a PRNG key, or the uniform samples themselves.

    wrong:  pool(x)
    right:  pool(x, key=jax.random.key(step))
       or:  pool(x, samples=u)     # u: [..., channels, {n}] in [0, 1), one per axis in x's order"""

BAD_SAMPLES = """\
{cls}: samples must be [..., channels, {n}] floats (x's leading axes, its channels, one per spatial axis \
in x's order: {axes}), got {given} for x {x}.

    wrong:  pool(x, samples=u)          # u: {given}
    right:  pool(x, samples=u)          # u: {right}
    torch:  F.fractional_max_pool{n}d(..., _random_samples=t) is samples={torch}"""

SAMPLES_OUTSIDE = """\
{cls}: samples{where} is {value}{cast}: the {axis} axis's sample of that channel. A sample is a \
uniform draw in [0, 1) placing its plane's windows; outside it the windows are no draw's (torch \
computes them unchecked: u = 1.0 gives other windows than every u in [0, 1), a negative u or NaN \
others again), so it is refused here; under jax.jit, where the values are not seen, that \
channel's plane is NaN (its indices -1).

    wrong:  pool(x, samples=u)          # u{where}: {value}{cast}
    right:  pool(x, samples=jax.random.uniform(key, {shape}, x.dtype))      # or pool(x, key=key)"""

_AXES = {2: ("height", "width"), 3: ("depth", "height", "width")}


def fractional_intervals(u: jax.Array, length: int, size: int, k: int) -> jax.Array:
    """The ``size`` window starts along an axis of ``length`` for each sample ``u`` (torch's).

    ``alpha = (length - k) / (size - 1)`` and ``start_i = floor((i + u) alpha) - floor(u alpha)``
    for ``i < size - 1``, the last start ``length - k`` (so the last window ends on the last
    element), computed in ``u``'s dtype as torch computes in the input's: the same starts bit
    for bit. ``u`` has any shape; the starts are ``[*u.shape, size]`` int32.

    Example:
      >>> import jax.numpy as jnp
      >>> import functree as ft
      >>> ft.nn.fractional_intervals(jnp.array(0.5), 10, 4, 2)
      Array([0, 3, 5, 8], dtype=int32)
    """
    u = jnp.asarray(u)
    last = jnp.full((*u.shape, 1), length - k, jnp.int32)
    if size == 1:
        return last
    alpha = jnp.asarray(length - k, u.dtype) / jnp.asarray(size - 1, u.dtype)
    i = jax.lax.broadcast_to_rank(jnp.arange(size - 1, dtype=u.dtype), u.ndim + 1)
    # floor of a value >= 0: torch's static_cast<int64_t> truncates, the same
    starts = jnp.floor((i + u[..., None]) * alpha) - jnp.floor(u[..., None] * alpha)
    return jnp.concatenate([starts.astype(jnp.int32), last], axis=-1)


class _FractionalMaxPool(Layer):
    pool_size: tuple[int, ...] = field(static=True, default=(2, 2))
    output_size: tuple[int, ...] | None = field(static=True, default=None)
    output_ratio: tuple[float, ...] | None = field(static=True, default=None)
    return_indices: bool = field(static=True, default=False)

    _rank: ClassVar[int] = 2

    def __init__(
        self,
        pool_size: int | Sequence[int],
        output_size: int | Sequence[int] | None = None,
        output_ratio: float | Sequence[float] | None = None,
        return_indices: bool = False,
    ):
        name, n = type(self).__name__, self._rank
        self.pool_size = window.sizes(name, "pool_size", pool_size, n)
        if (output_size is None) == (output_ratio is None):
            given = "neither" if output_size is None else f"output_size={output_size!r}, output_ratio={output_ratio!r}"
            wrong = "" if output_size is None else f", output_size={output_size!r}, output_ratio={output_ratio!r}"
            raise ValueError(ONE_SIZE.format(cls=name, given=given, wrong=wrong, size=(4,) * n))
        self.output_size = None if output_size is None else window.sizes(name, "output_size", output_size, n)
        self.output_ratio = None if output_ratio is None else _ratios(name, output_ratio, n)
        self.return_indices = bool(return_indices)

    def _sizes(self, x: jax.Array) -> tuple[int, ...]:
        """Each spatial axis's output size (``int(length * ratio)`` for a ratio, torch's), checked
        against the input: :data:`TOO_SMALL`."""
        n = self._rank
        lengths = x.shape[x.ndim - n - 1:-1]
        sizes = self.output_size or tuple(int(length * r) for length, r in zip(lengths, self.output_ratio or ()))
        for axis, length, out, k in zip(_AXES[n], lengths, sizes, self.pool_size):
            if out < 1 or out + k - 1 > length:
                fix = tuple(max(1, length - kk + 1) for length, kk in zip(lengths, self.pool_size))
                raise LayerInputError(self, f"[..., {', '.join(_AXES[n])}, channels] (float), {axis} >= {out + k - 1}",
                                      short_array(x), TOO_SMALL.format(
                                          cls=type(self).__name__, axis=axis, length=length, out=out, k=k,
                                          need=out + k - 1, k_arg=_show(self.pool_size), out_arg=_show(sizes),
                                          fix=_show(fix), given=short_array(x)))
        return sizes

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None,
                 samples: jax.Array | None = None) -> Any:
        """The pooled ``[..., *output_size, channels]`` (and with ``return_indices`` each
        maximum's flat index in its channel's plane, int32: torch's indices)."""
        n = self._rank
        check_input(self, x, (*_AXES[n], "channels"))
        sizes = self._sizes(x)
        u, outside = self._samples(x, key, samples)
        plane = x.shape[x.ndim - n - 1:-1]
        # the flat plane index of each window's element: [..., C, *sizes, prod(pool_size)]
        starts = [fractional_intervals(u[..., a], plane[a], sizes[a], self.pool_size[a]) for a in range(n)]
        strides = [math.prod(plane[a + 1:]) for a in range(n)]
        offsets = np.array(list(itertools.product(*(range(k) for k in self.pool_size))))  # torch's loop order
        flat = jnp.zeros((*u.shape[:-1], *sizes, len(offsets)), jnp.int32)
        for a in range(n):
            at = starts[a].reshape((*u.shape[:-1],) + tuple(sizes[a] if b == a else 1 for b in range(n)) + (1,))
            flat = flat + (at + jax.lax.broadcast_to_rank(jnp.asarray(offsets[:, a], jnp.int32), at.ndim)) * strides[a]
        lead = x.ndim - n - 1
        planes = jnp.moveaxis(x, -1, lead).reshape((*x.shape[:lead], x.shape[-1], -1))  # [..., C, H W]
        values = jnp.take_along_axis(planes, flat.reshape((*flat.shape[:lead + 1], -1)), axis=-1).reshape(flat.shape)
        y, index = values[..., 0], flat[..., 0]
        for j in range(1, len(offsets)):
            # torch's loop: greater than the maximum so far, or NaN (the first of equal maxima, the
            # last NaN); the gradient reaches the element taken alone
            part, at = values[..., j], flat[..., j]
            take = (part > y) | jnp.isnan(part)
            y, index = jnp.where(take, part, y), jnp.where(take, at, index)
        if outside is not None:  # traced samples outside [0, 1): their planes NaN (SAMPLES_OUTSIDE)
            at = outside.reshape(outside.shape + (1,) * n)
            y = jnp.where(at, jnp.asarray(jnp.nan, y.dtype), y)
            index = jnp.where(at, jnp.asarray(-1, index.dtype), index)
        y, index = jnp.moveaxis(y, lead, -1), jnp.moveaxis(index, lead, -1)
        return (y, index) if self.return_indices else y

    def _samples(self, x: jax.Array, key: jax.Array | None,
                 samples: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """The samples ``[..., C, n]`` in ``x``'s dtype, and None, or for traced ``samples``
        whether each plane ``[..., C]`` has one outside ``[0, 1)`` (concrete ones there are
        refused: :data:`SAMPLES_OUTSIDE`)."""
        n, name = self._rank, type(self).__name__
        shape = (*x.shape[:x.ndim - n - 1], x.shape[-1], n)
        if samples is None:
            if key is None:
                raise ValueError(NO_SAMPLES.format(cls=name, n=n))
            return jax.random.uniform(flat_key(key), shape, x.dtype), None
        if jnp.shape(samples) != shape or not jnp.issubdtype(jnp.result_type(samples), jnp.floating):
            given = short_array(samples) if hasattr(samples, "shape") else repr(samples)
            right = f"{jnp.dtype(x.dtype).name}{list(shape)}"
            torch = "t[..., ::-1] (torch's 2-D samples are (width, height))" if n == 2 else "t (the same order)"
            raise ValueError(BAD_SAMPLES.format(cls=name, n=n, axes=", ".join(_AXES[n]), given=given,
                                                x=short_array(x), right=right, torch=torch))
        u = jnp.asarray(samples, x.dtype)
        host = concrete(u)
        if host is None:
            return u, jnp.any(~((u >= 0) & (u < 1)), axis=-1)  # (NaN is neither)
        outside = ~((host >= 0) & (host < 1))
        if outside.any():
            where = first_index(outside)
            raw, value = np.asarray(samples)[where], host[where]  # (NumPy scalars: their dtype's shortest digits)
            same = raw.item() == value.item() or np.isnan(value)
            cast = "" if same else f", {value!s} in {jnp.dtype(x.dtype).name}"
            raise ValueError(SAMPLES_OUTSIDE.format(cls=name, where=list(where), value=str(raw), cast=cast,
                                                    axis=_AXES[n][where[-1]], shape=shape))
        return u, None


def _ratios(name: str, value: Any, n: int) -> tuple[float, ...]:
    entries = (value,) * n if isinstance(value, (int, float)) and not isinstance(value, bool) else (
        tuple(value) if isinstance(value, Sequence) else ())
    if len(entries) != n or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < 1
                                    for r in entries):
        raise ValueError(BAD_RATIO.format(cls=name, given=value, n=n))
    return tuple(float(r) for r in entries)


def _show(values: tuple[int, ...]) -> Any:
    return values[0] if len(set(values)) == 1 else values


_DOC = """Fractional max pooling (Graham 2014): torch's ``nn.FractionalMaxPool{n}d``, channels last.

    Over ``[..., {spatial}, channels]``, each output ``o`` is the max of the ``pool_size``
    window starting at ``start_o = floor((o + u) alpha) - floor(u alpha)`` on each axis,
    ``alpha = (length - k) / (size - 1)``, the last window ending on the last element
    (:func:`fractional_intervals`). ``u`` is one uniform sample per leading index, channel and
    axis, drawn from ``key=`` on every call (torch draws in evaluation too), or given as
    ``samples=`` ``[..., channels, {n}]`` in the axes' order ({spatial}): torch's
    ``F.fractional_max_pool{n}d(..., _random_samples=t)`` is ``samples={torch}``, and then the
    output equals torch's bit for bit. A sample outside ``[0, 1)`` (or NaN) places no draw's
    windows (torch computes them unchecked): concrete ``samples=`` holding one are refused
    (:data:`SAMPLES_OUTSIDE`); traced, under ``jax.jit``, its channel's plane is NaN (indices
    -1), with no gradient. Exactly one of ``output_size`` and ``output_ratio``
    (each axis ``int(length * ratio)``). ``return_indices=True`` also returns each maximum's
    flat index in its channel's plane (int32), as ``MaxPool{n}D``'s. Equal maxima: the first;
    the gradient reaches the element taken alone, as torch's.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> pool = ft.nn.{name}(2, output_size={out})
      >>> x = jnp.arange({count}.0).reshape({shape})
      >>> pool(x, key=jax.random.key(0)).shape
      {result}
    """


class FractionalMaxPool2D(_FractionalMaxPool):
    _rank: ClassVar[int] = 2
    __doc__ = _DOC.format(name="FractionalMaxPool2D", n=2, spatial="height, width", torch="t[..., ::-1]", out=3, count=50,
                          shape="(1, 5, 5, 2)", result="(1, 3, 3, 2)")


class FractionalMaxPool3D(_FractionalMaxPool):
    _rank: ClassVar[int] = 3
    __doc__ = _DOC.format(name="FractionalMaxPool3D", n=3, spatial="depth, height, width", torch="t", out=3, count=250,
                          shape="(1, 5, 5, 5, 2)", result="(1, 3, 3, 3, 2)")
