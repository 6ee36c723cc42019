"""Resampling (torch's ``nn.Upsample`` / ``F.interpolate``) over channels-last inputs.

``Upsample1D/2D/3D`` resize the ``n`` spatial axes of ``[..., *spatial, channels]`` to
``size`` or by ``scale_factor`` (output ``floor(L * scale_factor)``), one axis at a time: an
axis's output ``i`` reads input taps at static indices with static weights (NumPy, once a
shape), so a layer is a few gathers and sums under ``jit`` and differentiable. The source
coordinate of output ``i`` is torch's: with ``align_corners=True`` ``i (L - 1) / (O - 1)``,
otherwise ``(i + 1/2) r - 1/2`` with ``r = 1 / scale_factor`` where one is given (torch's
``recompute_scale_factor=None``: ``5 * 1.5 = 7`` outputs read at steps of ``2/3``, not
``5/7``), else ``L / O`` (``recompute_scale_factor=True``: ``L / O`` whatever the scale).
Indices and weights are computed in float32 as torch computes them for float32 inputs
(float64 inputs: float64), so ``nearest`` picks the same element at every boundary.

Modes: ``nearest`` (``floor(i r)``; torch's legacy rule, shifted half a pixel from OpenCV's),
``nearest-exact`` (``floor((i + 1/2) r)``), ``linear`` (1-D) / ``bilinear`` (2-D) /
``trilinear`` (3-D) (two taps, the source clamped at 0), ``bicubic`` (2-D; Keys' cubic
with ``A = -0.75``, four taps clamped to the edge, as torch's) and ``area`` (torch's adaptive
average pooling: output ``i`` is the mean of elements ``floor(i L / O)`` to
``ceil((i + 1) L / O) - 1``). ``antialias=True`` (2-D, torch's ``_upsample_*2d_aa``):
``bilinear`` / ``bicubic`` (Keys' cubic with ``A = -0.5`` there, PIL's) / ``lanczos``
(``sinc(x) sinc(x / 3)``) as filters stretched by ``r`` when downsampling (``r >= 1``),
output ``i`` the normalized sum over the elements ``j`` within ``r`` times the filter's
support of its centre ``(i + 1/2) r``, each weighted ``filter((j + 1/2 - centre) / r)``.
``jax.image.resize`` is another function: its ``"linear"`` is ``align_corners=False``
without the clamp at 0 for downsampling (it antialiases) and its ``"cubic"`` uses ``A = -0.5``.

Layers, as ``ft.nn``'s pooling, one class per number of spatial axes (a channels-last
input's leading axes are any, so the layer says which axes it resizes), the settings
static; ``ft.nn.Upsample2D(scale_factor=2)(x)`` is the one-line call, and
``ft.nn.interpolate(x, ...)`` torch's function on ``[N, *spatial, channels]`` (the same
layers, the number of spatial axes ``x.ndim - 2`` as torch's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._repr import short_array
from functree.nn._check import LayerInputError, check_input
from functree.nn._mode import Layer
from functree.nn._window import is_int

__all__ = ["Upsample1D", "Upsample2D", "Upsample3D", "UpsamplingNearest2D", "UpsamplingBilinear2D",
           "interpolate", "resample_taps"]

SIZE_OR_SCALE = """\
{cls}: give exactly one of size= and scale_factor= (got {given}), as torch's Upsample.

    wrong:  ft.nn.{cls}({wrong})
    right:  ft.nn.{cls}(scale_factor=2)     # or size={size}"""

BAD_SIZE = """\
{cls}: {name}={given!r} does not fit {n} spatial {axes}: {what}, or {n} of them (one per axis: \
{names}).

    wrong:  ft.nn.{cls}({name}={given!r})
    right:  ft.nn.{cls}({name}={right!r})"""

BAD_MODE = """\
{cls}: mode={given!r} is not one of {modes} (torch's modes for {n} spatial {axes}{other}).

    wrong:  ft.nn.{cls}(scale_factor=2, mode={given!r})
    right:  ft.nn.{cls}(scale_factor=2, mode={right!r})"""

ALIGN_NEAREST = """\
{cls}: align_corners={given!r} with mode={mode!r}; align_corners is read by the linear and \
cubic modes only (torch: "align_corners option can only be set with the interpolating modes").

    wrong:  ft.nn.{cls}(scale_factor=2, mode={mode!r}, align_corners={given!r})
    right:  ft.nn.{cls}(scale_factor=2, mode={mode!r})"""

EMPTY_OUTPUT = """\
Its {axis} ({size}) times scale_factor {scale} is {out}: an empty output (torch raises \
"Input and output sizes should be greater than 0"; its mode="area" returns an empty tensor).

    wrong:  ft.nn.{cls}(scale_factor={given!r})(x)     # x's {axis}: {size}
    right:  ft.nn.{cls}(size={right!r})(x)     # or a scale_factor whose output keeps one element"""

EMPTY_INPUT = """\
Its {axis} is 0: an empty axis has nothing to resample (torch raises "Input and output sizes \
should be greater than 0" for size=, "Expected input to have non-zero size" for mode='area').

    wrong:  ft.nn.{cls}({setting})(x)     # x's {axis}: 0
    right:  ft.nn.{cls}({setting})(x)     # x with {axis} >= 1; or resample only the non-empty inputs"""

ANTIALIAS = """\
{cls}: antialias=True with mode={mode!r}: torch antialiases the 2-D modes 'bilinear', 'bicubic' \
and 'lanczos' only (torch: "Anti-alias option is restricted to bilinear, bicubic, and lanczos \
modes and requires a 4-D tensor as input").

    wrong:  ft.nn.{cls}(scale_factor=0.5, mode={mode!r}, antialias=True)
    right:  ft.nn.Upsample2D(scale_factor=0.5, mode="bilinear", antialias=True)     # or mode="area": the mean"""

LANCZOS = """\
{cls}: mode='lanczos' is torch's antialiased Lanczos filter (a = 3): it takes antialias=True \
and align_corners=False (torch: "Lanczos mode requires antialias=True", "Lanczos mode does not \
support align_corners=True"), got antialias={antialias!r}, align_corners={align!r}.

    wrong:  ft.nn.{cls}(size=(4, 4), mode="lanczos"{wrong})
    right:  ft.nn.{cls}(size=(4, 4), mode="lanczos", antialias=True)"""

RECOMPUTE_WITH_SIZE = """\
{cls}: recompute_scale_factor=True with size={size!r}: it recomputes the scale from an output \
size that scale_factor gives (floor(L * scale_factor)); a size is read as L / size already \
(torch: "recompute_scale_factor is not meaningful with an explicit size").

    wrong:  ft.nn.{cls}(size={size!r}, recompute_scale_factor=True)
    right:  ft.nn.{cls}(size={size!r})     # or scale_factor=..., recompute_scale_factor=True"""

INTERPOLATE_AXES = """\
ft.nn.interpolate reads x as torch's F.interpolate does, with a batch axis and channels last: \
[N, length, C], [N, height, width, C] or [N, depth, height, width, C] (3 to 5 axes), got {shape}.

    wrong:  ft.nn.interpolate(x, scale_factor=2)     # x: {shape}
    right:  ft.nn.interpolate(x[None], scale_factor=2)[0]     # one image: a batch of one
       or:  ft.nn.{layer}(scale_factor=2)(x)     # any leading axes: the layer names its spatial axes"""

_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}
_MODES = {1: ("nearest", "nearest-exact", "linear", "area"),
          2: ("nearest", "nearest-exact", "bilinear", "bicubic", "area", "lanczos"),
          3: ("nearest", "nearest-exact", "trilinear", "area")}
_INTERPOLATING = ("linear", "bilinear", "trilinear", "bicubic", "lanczos")
_ANTIALIASED = ("bilinear", "bicubic", "lanczos")
_CUBIC_A = -0.75  # torch's (and TensorFlow's legacy): Keys' cubic with a = -0.75
_AA_CUBIC_A = -0.5  # torch's antialiased bicubic: PIL's a = -0.5
_AA_SIZE = {"linear": 2, "bicubic": 4, "lanczos": 6}  # each filter's width at r = 1 (torch's interp_size)


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution weights of the taps at ``-1, 0, 1, 2`` for a fraction ``t``
    (torch's ``get_cubic_upsample_coefficients``): ``|s| <= 1: (a+2)|s|^3 - (a+3)|s|^2 + 1``,
    ``1 < |s| < 2: a|s|^3 - 5a|s|^2 + 8a|s| - 4a``."""
    a = t.dtype.type(_CUBIC_A)

    def near(s: np.ndarray) -> np.ndarray:
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s: np.ndarray) -> np.ndarray:
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    one = t.dtype.type(1)
    return np.stack([far(t + one), near(t), near(one - t), far(one - t + one)], axis=-1)


def _aa_filter(mode: str, x: np.ndarray) -> np.ndarray:
    """torch's antialiasing filters at offsets ``x`` (in input elements over ``r``):
    ``linear`` ``max(1 - |x|, 0)``, ``bicubic`` Keys' cubic with ``A = -0.5`` (zero past 2),
    ``lanczos`` ``sinc(x) sinc(x / 3)`` (zero past 3)."""
    x = np.abs(x)
    one = x.dtype.type(1)
    if mode == "linear":
        return np.where(x < one, one - x, 0).astype(x.dtype)
    if mode == "lanczos":
        return np.where(x < 3, np.sinc(x) * np.sinc(x / x.dtype.type(3)), 0).astype(x.dtype)
    a = x.dtype.type(_AA_CUBIC_A)
    near = ((a + 2) * x - (a + 3)) * x * x + one
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < one, near, np.where(x < 2, far, 0)).astype(x.dtype)


def _antialias_taps(length: int, out: int, mode: str, r: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """torch's ``_compute_weights_aa``: output ``i``'s elements ``[xmin, xmin + xsize)``
    around the centre ``(i + 1/2) r``, within ``support = r * size / 2`` (``r >= 1``; else
    ``size / 2``), each weighted ``filter((j + 1/2 - centre) / r)``, normalized to sum 1.
    torch's intermediate sums in double are kept (its ``+ 0.5`` is a double literal)."""
    f = np.dtype(dtype).type
    support = f(_AA_SIZE[mode] * 0.5) * r if r >= 1 else f(_AA_SIZE[mode] * 0.5)
    invscale = np.float64(f(1) / r) if r >= 1 else np.float64(1)
    centre = (np.float64(r) * (np.arange(out) + 0.5)).astype(dtype)
    low = np.maximum((centre - np.float64(support) + 0.5).astype(np.int64), 0)  # C++'s cast truncates
    size = np.minimum((centre + np.float64(support) + 0.5).astype(np.int64), length) - low
    j = np.arange(math.ceil(support) * 2 + 1)  # torch's max_interp_size
    offset = ((low[:, None] + j).astype(dtype) - centre[:, None]).astype(np.float64) + 0.5
    w = np.where(j < size[:, None], _aa_filter(mode, (offset * invscale).astype(dtype)), f(0)).astype(dtype)
    total = w.sum(axis=1, keepdims=True, dtype=dtype)
    w = np.where(total != 0, w / np.where(total != 0, total, f(1)), w).astype(dtype)
    return np.minimum(low[:, None] + j, length - 1).astype(np.int32), w


def _area_taps(length: int, out: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive average pooling: output ``i`` the mean of the elements
    ``floor(i L / O)`` to ``ceil((i + 1) L / O) - 1`` (integer arithmetic, exact)."""
    i = np.arange(out)
    start, end = i * length // out, ((i + 1) * length + out - 1) // out
    count = end - start
    j = np.arange(int(count.max()))
    w = np.where(j < count[:, None], (1 / count[:, None]).astype(dtype), 0).astype(dtype)
    return np.minimum(start[:, None] + j, length - 1).astype(np.int32), w


@functools.lru_cache(maxsize=256)
def resample_taps(length: int, out: int, mode: str, align_corners: bool, scale: float | None,
                  dtype: str = "float32", shortcuts: bool = False,
                  antialias: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Output ``i``'s input indices ``[out, taps]`` and weights ``[out, taps]`` along one axis
    of ``length``, as torch's CPU kernels compute them in ``dtype`` (float32 for float32,
    bfloat16 and float16 inputs). ``scale``: torch's ``1 / scale_factor`` where one was given.
    ``shortcuts``: torch's 2-D ``nearest`` kernel, which reads an axis kept at its length as
    the identity and one doubled as ``i // 2`` whatever ``scale_factor`` says (its 1-D and 3-D
    kernels do not: ``scale_factor=1.2`` on 3 elements reads ``0, 0, 1`` there, ``0, 1, 2`` in 2-D).
    The linear modes copy an axis kept at its length whatever ``scale_factor`` says (all of
    torch's linear kernels do; its bicubic does not). ``mode="area"``: torch's adaptive
    average pooling (``scale`` unread); ``antialias``: torch's antialiased ``linear``,
    ``bicubic`` and ``lanczos`` filters (any number of taps, the unused ones weighted 0).

    Example:
      >>> index, weight = resample_taps(2, 4, "linear", False, None)
      >>> index.tolist(), weight.tolist()
      ([[0, 1], [0, 1], [0, 1], [1, 1]], [[1.0, 0.0], [0.75, 0.25], [0.25, 0.75], [0.75, 0.25]])
    """
    f = np.dtype(dtype).type
    i = np.arange(out, dtype=dtype)
    if mode == "area":
        return _area_taps(length, out, dtype)
    if antialias:  # torch's scale: (L - 1) / (O - 1) aligned (0 for one output), else 1 / scale_factor or L / O
        r = (f(length - 1) / f(out - 1) if out > 1 else f(0)) if align_corners else (
            f(scale) if scale is not None else f(length) / f(out))
        return _antialias_taps(length, out, mode, r, dtype)
    if mode in ("nearest", "nearest-exact"):
        r = f(scale) if scale is not None else f(length) / f(out)
        if shortcuts and mode == "nearest" and out == length:
            index = np.arange(out)
        elif shortcuts and mode == "nearest" and out == 2 * length:
            index = np.arange(out) >> 1  # torch's fast path: exact halves
        else:
            shift = f(0.5) if mode == "nearest-exact" else f(0)
            index = np.minimum(np.floor((i + shift) * r).astype(np.int64), length - 1)
        return index[:, None].astype(np.int32), np.ones((out, 1), dtype)
    if mode == "linear" and out == length:  # torch's linear kernels copy an axis kept at its length
        return np.stack([np.arange(out), np.arange(out)], axis=-1).astype(np.int32), np.stack(
            [np.ones(out, dtype), np.zeros(out, dtype)], axis=-1)
    if align_corners:
        r = f(length - 1) / f(out - 1) if out > 1 else f(0)
        source = i * r
    else:
        r = f(scale) if scale is not None else f(length) / f(out)
        source = r * (i + f(0.5)) - f(0.5)
    if mode == "bicubic":
        # torch's guard_index_and_lambda: floor, at most the last index; the fraction in [0, 1]
        start = np.minimum(np.floor(source).astype(np.int64), length - 1)
        t = np.clip(source - start.astype(dtype), f(0), f(1)).astype(dtype)
        index = np.clip(start[:, None] + np.arange(-1, 3), 0, length - 1)
        return index.astype(np.int32), _cubic_weights(t)
    source = np.maximum(source, f(0))  # linear: a source left of the first centre reads the first element
    start = source.astype(np.int64)
    high = np.minimum(source - start.astype(dtype), f(1)).astype(dtype)
    index = np.stack([start, start + (start < length - 1)], axis=-1)
    return index.astype(np.int32), np.stack([f(1) - high, high], axis=-1)


def _resize_axis(x: jax.Array, axis: int, index: np.ndarray, weight: np.ndarray) -> jax.Array:
    """``y[..., i, ...] = sum_t weight[i, t] x[..., index[i, t], ...]`` along ``axis``."""
    if weight.shape[1] == 1:
        return jnp.take(x, jnp.asarray(index[:, 0]), axis=axis)
    gathered = jnp.take(x, jnp.asarray(index), axis=axis)  # [..., out, taps, ...]
    w = jax.lax.broadcast_to_rank(jnp.asarray(weight, x.dtype).reshape(weight.shape + (1,) * (x.ndim - axis - 1)), gathered.ndim)
    return jnp.sum(gathered * w, axis=axis + 1)


def _per_axis(cls: str, name: str, value: Any, n: int, ok: Any, what: str, right: Any) -> tuple[Any, ...]:
    entries = (value,) * n if ok(value) else (
        tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None)
    if entries is None or len(entries) != n or not all(ok(v) for v in entries):
        raise ValueError(BAD_SIZE.format(cls=cls, name=name, given=value, n=n, axes="axis" if n == 1 else "axes",
                                         what=what, names=", ".join(_AXES[n]), right=right))
    return entries


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and bool(v > 0)


class _Upsample(Layer):
    size: tuple[int, ...] | None = field(static=True, default=None)
    scale_factor: tuple[float, ...] | None = field(static=True, default=None)
    mode: str = field(static=True, default="nearest")
    align_corners: bool = field(static=True, default=False)
    recompute_scale_factor: bool = field(static=True, default=False)
    antialias: bool = field(static=True, default=False)

    _rank: ClassVar[int] = 1

    def __init__(
        self,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
        antialias: bool = False,
    ):
        n, cls = self._rank, type(self).__name__
        if (size is None) == (scale_factor is None):
            given = "both" if size is not None else "neither"
            raise ValueError(SIZE_OR_SCALE.format(cls=cls, given=given, size=(4,) * n if n > 1 else 4,
                                                  wrong="" if size is None else f"size={size!r}, scale_factor="
                                                  f"{scale_factor!r}"))
        if mode not in _MODES[n]:
            other = next((f"; mode={mode!r} is for {k} spatial axes, Upsample{k}D" for k, modes in _MODES.items()
                          if mode in modes), "")
            right = next((m for m in _MODES[n] if m in _INTERPOLATING), "nearest") if mode in _INTERPOLATING else (
                "nearest")
            raise ValueError(BAD_MODE.format(cls=cls, given=mode, modes=_MODES[n], n=n,
                                             axes="axis" if n == 1 else "axes", other=other, right=right))
        if align_corners and mode not in _INTERPOLATING:  # False: the default reading, as a rebuild passes it
            raise ValueError(ALIGN_NEAREST.format(cls=cls, given=align_corners, mode=mode))
        if antialias and mode not in _ANTIALIASED:
            raise ValueError(ANTIALIAS.format(cls=cls, mode=mode))
        if mode == "lanczos" and (not antialias or align_corners):
            wrong = "".join(f", {k}={v!r}" for k, v in (("antialias", antialias), ("align_corners", align_corners))
                            if v is not None)
            raise ValueError(LANCZOS.format(cls=cls, antialias=antialias, align=align_corners, wrong=wrong))
        if recompute_scale_factor and size is not None:
            raise ValueError(RECOMPUTE_WITH_SIZE.format(cls=cls, size=size))
        self.mode, self.align_corners = mode, bool(align_corners)
        self.recompute_scale_factor, self.antialias = bool(recompute_scale_factor), bool(antialias)
        right = (4,) * n if n > 1 else 4
        self.size = None if size is None else tuple(int(v) for v in _per_axis(
            cls, "size", size, n, lambda v: is_int(v) and v >= 1, "an int >= 1", right))
        self.scale_factor = None if scale_factor is None else tuple(float(v) for v in _per_axis(
            cls, "scale_factor", scale_factor, n, _positive_number, "a number > 0", (2.0,) * n if n > 1 else 2.0))

    def _outputs(self, x: jax.Array, lengths: tuple[int, ...]) -> tuple[int, ...]:
        if self.size is not None:
            for axis, length in zip(_AXES[self._rank], lengths):
                if length == 0:  # no taps to read: refused here, not in jnp.take
                    raise LayerInputError(self, f"[..., {', '.join(_AXES[self._rank])}, channels] with {axis} >= 1",
                                          short_array(x), EMPTY_INPUT.format(axis=axis, cls=type(self).__name__,
                                                                             setting=f"size={_show(self.size)}"))
            return self.size
        assert self.scale_factor is not None
        outs = tuple(math.floor(length * s) for length, s in zip(lengths, self.scale_factor))
        for axis, length, s, out in zip(_AXES[self._rank], lengths, self.scale_factor, outs):
            if out < 1:
                raise LayerInputError(self, f"[..., {', '.join(_AXES[self._rank])}, channels] with {axis} >= "
                                      f"{math.ceil(1 / s)}", short_array(x),
                                      EMPTY_OUTPUT.format(axis=axis, size=length, scale=f"{s:g}", out=f"{length * s:g}", cls=type(
                                          self).__name__, given=_show(self.scale_factor), right=_show(
                                          tuple(max(o, 1) for o in outs))))
        return outs

    def __call__(self, x: jax.Array) -> jax.Array:
        n = self._rank
        check_input(self, x, (*_AXES[n], "channels"))
        lead = x.ndim - n - 1
        lengths = tuple(x.shape[lead:-1])
        outs = self._outputs(x, lengths)
        dtype = "float64" if x.dtype == jnp.float64 else "float32"  # torch's opmath: float32 for halves
        # recompute_scale_factor=True (and area, which reads sizes only): the source reads L / O
        scales = self.scale_factor if self.scale_factor is not None and not self.recompute_scale_factor else (
            (None,) * n)
        # sums of bfloat16 / float16 taps in float32, as torch's opmath
        y = x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) and not self.mode.startswith(
            "nearest") else x
        mode = self.mode if self.mode in ("bicubic", "lanczos", "area") or self.mode.startswith("nearest") else "linear"
        axes = list(enumerate(zip(lengths, outs, scales)))
        for k, (length, out, s) in reversed(axes) if self.antialias else axes:  # torch's aa: the width first
            if self.antialias and out == length:
                continue  # torch's antialiased kernels skip an axis kept at its length
            index, weight = resample_taps(length, out, mode, self.align_corners, None if s is None else 1.0 / s,
                                          dtype, shortcuts=n == 2, antialias=self.antialias)
            if out == length and (index[:, 0] == np.arange(out)).all() and (weight[:, 0] == 1).all():
                continue  # the identity
            y = _resize_axis(y, lead + k, index, weight)
        return y.astype(x.dtype)


def _show(values: tuple[Any, ...]) -> Any:
    return values[0] if len(set(values)) == 1 else values


_DOC = """Upsample the {n}-D spatial axes of ``[..., {spatial}, channels]`` (torch's ``nn.Upsample`` on {torch} inputs, channels last).

    Args: ``size`` (an int or one per axis) or ``scale_factor`` (a number or one per axis;
    output ``floor(L * scale_factor)``), ``mode`` one of {modes}, ``align_corners`` (the
    interpolating modes; False by default, torch's), ``recompute_scale_factor`` (True: the
    output size from ``scale_factor``, then ``r = L / O``, torch's){antialias}. Output ``i``
    reads the source coordinate ``(i + 1/2) r - 1/2`` (``r = 1 / scale_factor`` where given,
    else ``L / O``; ``align_corners=True``: ``i (L - 1) / (O - 1)``), ``nearest`` the element
    ``floor(i r)``, ``area`` the mean of elements ``floor(i L / O)`` to ``ceil((i + 1) L / O) - 1``
    (torch's adaptive average pooling); module :mod:`functree.nn._resample` gives each mode's taps.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([0., 1.]).reshape({shape})
      >>> ft.nn.{name}(scale_factor=2, mode={mode!r})(x).ravel()
      Array([0.  , 0.25, 0.75, 1.  ], dtype=float32)
    """

_AA_DOC = """, ``antialias``
    (``bilinear`` / ``bicubic`` / ``lanczos``, the last antialiased only: torch's antialiased
    filters, each stretched by ``r`` when downsampling)"""


class Upsample1D(_Upsample):
    _rank: ClassVar[int] = 1
    __doc__ = _DOC.format(n=1, spatial="length", torch="[N, C, L]", modes=_MODES[1], shape="1, 2, 1", name="Upsample1D",
                          mode="linear", antialias="")


class Upsample2D(_Upsample):
    _rank: ClassVar[int] = 2
    __doc__ = _DOC.format(n=2, spatial="height, width", torch="[N, C, H, W]", modes=_MODES[2], shape="1, 1, 2, 1",
                          name="Upsample2D", mode="bilinear", antialias=_AA_DOC).replace("scale_factor=2,", "scale_factor=(1, 2),")


class Upsample3D(_Upsample):
    _rank: ClassVar[int] = 3
    __doc__ = _DOC.format(n=3, spatial="depth, height, width", torch="[N, C, D, H, W]", modes=_MODES[3],
                          shape="1, 1, 1, 2, 1", name="Upsample3D", mode="trilinear", antialias="").replace(
        "scale_factor=2,", "scale_factor=(1, 1, 2),")


class UpsamplingNearest2D(Upsample2D):
    """torch's ``nn.UpsamplingNearest2d``: ``Upsample2D(size, scale_factor, mode="nearest")``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.UpsamplingNearest2D(scale_factor=2)(jnp.ones((1, 2, 3, 4))).shape
      (1, 4, 6, 4)
    """

    def __init__(self, size: int | Sequence[int] | None = None, scale_factor: float | Sequence[float] | None = None):
        super().__init__(size, scale_factor, "nearest")


class UpsamplingBilinear2D(Upsample2D):
    """torch's ``nn.UpsamplingBilinear2d``: ``Upsample2D(size, scale_factor, mode="bilinear",
    align_corners=True)`` (the corners kept: output ``i`` reads ``i (L - 1) / (O - 1)``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([0., 1.]).reshape(1, 1, 2, 1)
      >>> ft.nn.UpsamplingBilinear2D(size=(1, 4))(x).ravel() * 3
      Array([0., 1., 2., 3.], dtype=float32)
    """

    def __init__(self, size: int | Sequence[int] | None = None, scale_factor: float | Sequence[float] | None = None):
        super().__init__(size, scale_factor, "bilinear", align_corners=True)


_LAYERS: dict[int, type[_Upsample]] = {1: Upsample1D, 2: Upsample2D, 3: Upsample3D}


def interpolate(
    x: jax.Array,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> jax.Array:
    """torch's ``F.interpolate`` on ``[N, *spatial, channels]`` (channels last): ``x.ndim - 2``
    spatial axes, as torch's ``[N, C, *spatial]``, resized by :class:`Upsample1D` /
    :class:`Upsample2D` / :class:`Upsample3D` with these settings (the same numbers; their
    errors name the layer). Inputs of other leading axes: the layers, which name their
    spatial axes; other numbers of axes: :data:`INTERPOLATE_AXES`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.arange(4.).reshape(1, 4, 1)     # [N, length, C]
      >>> ft.nn.interpolate(x, scale_factor=0.5, mode="area").ravel()
      Array([0.5, 2.5], dtype=float32)
    """
    x = jnp.asarray(x)
    n = x.ndim - 2
    if n not in _LAYERS:
        shape = short_array(x)
        raise ValueError(INTERPOLATE_AXES.format(shape=shape, layer=f"Upsample{min(max(x.ndim - 1, 1), 3)}D"))
    return _LAYERS[n](size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)(x)
