"""torch's ``F.grid_sample`` and ``F.affine_grid`` over channels-last inputs.

``grid_sample(x, grid)`` reads ``x`` ``[N, H, W, C]`` (``[N, D, H, W, C]``) at the points of
``grid`` ``[N, H_out, W_out, 2]`` (``[N, D_out, H_out, W_out, 3]``), each point's coordinates
``(x, y)`` (``(x, y, z)``) in ``[-1, 1]`` as torch's: ``x`` runs along the width (the last
spatial axis), ``-1`` the left edge. A coordinate ``c`` of an axis of size ``L`` is the input
position ``((c + 1) / 2) (L - 1)`` with ``align_corners=True`` (``-1`` and ``1`` the centres of
the corner elements), ``((c + 1) L - 1) / 2`` otherwise (their outer edges). ``padding_mode``
says what a position outside ``[0, L - 1]`` reads: ``"zeros"`` zero for each tap outside,
``"border"`` the position clamped to the edge, ``"reflection"`` the position reflected at the
edges (``-1/2`` and ``L - 1/2`` without aligned corners, ``0`` and ``L - 1`` with) and then
clamped. Modes: ``"bilinear"`` (trilinear for 3-D: the ``2^n`` neighbours weighted by their
distances), ``"nearest"`` (the position rounded half to even, as torch's ``nearbyint``) and
``"bicubic"`` (2-D: the 4x4 neighbours with Keys' cubic, ``A = -0.75``, each tap's integer
position padded as above, the position itself unpadded, as torch's). Gradients reach ``x``
and, through the interpolation weights, ``grid`` (zero for ``"nearest"``; a clamped
coordinate's is zero, as torch's).

``affine_grid(theta, size)`` is the grid of ``theta @ (x, y, 1)`` over the output's points,
``x`` and ``y`` torch's ``linspace(-1, 1)`` of each axis (scaled by ``(L - 1) / L`` without
aligned corners); ``size`` is ft's layout ``(N, H, W, C)`` (``x.shape``), not torch's
``(N, C, H, W)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import short_array
from functree.nn._precision import statistics_dtype
from functree.nn._window import is_int

__all__ = ["grid_sample", "affine_grid"]

GRID_AXES = """\
ft.nn.grid_sample reads x as torch's F.grid_sample does, with a batch axis and channels last: \
[N, H, W, C] (2-D) or [N, D, H, W, C] (3-D), and a grid [N, H_out, W_out, 2] or \
[N, D_out, H_out, W_out, 3] (coordinates last, x first); got x {x} and grid {grid}.

    wrong:  ft.nn.grid_sample(x, grid)     # x: {x}, grid: {grid}
    right:  ft.nn.grid_sample(x[None], grid[None])[0]     # one image: a batch of one"""

GRID_DTYPE = """\
ft.nn.grid_sample takes a floating x and a grid of the same floating dtype (torch: "expected \
input and grid to have same dtype"); got x {x} and grid {grid}.

    wrong:  ft.nn.grid_sample(x, grid)     # x: {x}, grid: {grid}
    right:  ft.nn.grid_sample(x.astype({dtype}), grid.astype({dtype}))"""

GRID_MODE = """\
ft.nn.grid_sample: mode={given!r} is not one of {modes} (torch's modes for {n} spatial axes{other}).

    wrong:  ft.nn.grid_sample(x, grid, mode={given!r})
    right:  ft.nn.grid_sample(x, grid, mode="bilinear")"""

GRID_PADDING = """\
ft.nn.grid_sample: padding_mode={given!r} is not one of ('zeros', 'border', 'reflection') \
(torch's).

    wrong:  ft.nn.grid_sample(x, grid, padding_mode={given!r})
    right:  ft.nn.grid_sample(x, grid, padding_mode={right!r})"""

AFFINE_SIZE = """\
ft.nn.affine_grid: size={size!r} is not an output shape in ft's layout: (N, H, W, C) for a \
theta [N, 2, 3] or (N, D, H, W, C) for a theta [N, 3, 4], N theta's batch, every size >= 1 \
(x.shape of the channels-last input; torch's x.size() is (N, C, H, W): move C last); \
got theta {theta}.

    wrong:  ft.nn.affine_grid(theta, {size!r})
    right:  ft.nn.affine_grid(theta, {right!r})"""

AFFINE_THETA = """\
ft.nn.affine_grid takes a floating theta [N, 2, 3] (2-D) or [N, 3, 4] (3-D), the affine \
matrices of a batch, as torch's; got {theta}.

    wrong:  ft.nn.affine_grid(theta, size)     # theta: {theta}
    right:  ft.nn.affine_grid({right}, size)"""

_MODES = {2: ("bilinear", "nearest", "bicubic"), 3: ("bilinear", "nearest")}
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75  # torch's grid_sample bicubic: Keys' cubic with A = -0.75


def _unnormalize(c: jax.Array, size: int, align_corners: bool) -> jax.Array:
    """``[-1, 1]`` to the input position (torch's ``grid_sampler_unnormalize``)."""
    if align_corners:
        return (c + 1) / 2 * (size - 1)
    return ((c + 1) * size - 1) / 2


def _clamp(c: jax.Array, size: int) -> jax.Array:
    """``c`` clamped to ``[0, size - 1]``, its derivative 0 at and beyond the edges (torch's
    ``clip_coordinates_set_grad``); NaN is 0, as torch's clamp gives it (a NaN or, reflected,
    infinite coordinate reads the first element)."""
    high = jnp.asarray(size - 1, c.dtype)
    return jnp.where(c > 0, jnp.where(c < high, c, high), jnp.zeros_like(c))


def _reflect(c: jax.Array, twice_low: int, twice_high: int) -> jax.Array:
    """``c`` reflected at ``twice_low / 2`` and ``twice_high / 2`` until inside (torch's
    ``reflect_coordinates``): the distance from the low edge modulo the span, mirrored on odd
    crossings."""
    if twice_low == twice_high:
        return jnp.zeros_like(c)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    d = jnp.abs(c - low)
    extra = jnp.fmod(d, span)
    flips = jnp.floor(d / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad(c: jax.Array, size: int, padding_mode: str, align_corners: bool) -> jax.Array:
    """A position after ``padding_mode`` (torch's ``compute_coordinates``)."""
    if padding_mode == "border":
        return _clamp(c, size)
    if padding_mode == "reflection":
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        return _clamp(_reflect(c, *twice), size)
    return c


def _read(x: jax.Array, taps: jax.Array) -> jax.Array:
    """``x[n, *tap, :]`` for ``x`` ``[N, *S, C]`` and float tap positions ``taps`` ``[N, ..., n]``
    (integral, the spatial axes in order), zero where a tap is outside: ``[N, ..., C]``, one
    gather for every tap."""
    n_batch, spatial, channels = x.shape[0], x.shape[1:-1], x.shape[-1]
    high = jax.lax.broadcast_to_rank(jnp.asarray([size - 1 for size in spatial], taps.dtype), taps.ndim)
    inside = jnp.all((taps >= 0) & (taps <= high), axis=-1)
    flat = jnp.sum(jnp.clip(taps, 0, high).astype(jnp.int32) * jax.lax.broadcast_to_rank(jnp.asarray(_strides(spatial), jnp.int32), taps.ndim), axis=-1)
    values = jnp.take_along_axis(x.reshape(n_batch, -1, channels), flat.reshape(n_batch, -1, 1), axis=1)
    values = values.reshape((*flat.shape, channels))
    return jnp.where(inside[..., None], values, jnp.zeros((), x.dtype))


def _strides(spatial: Sequence[int]) -> list[int]:
    return [math.prod(spatial[i + 1:]) for i in range(len(spatial))]


def _cubic(t: jax.Array) -> list[jax.Array]:
    """Keys' cubic weights of the taps at ``-1, 0, 1, 2`` for a fraction ``t`` (torch's
    ``get_cubic_upsample_coefficients``, ``A = -0.75``)."""
    a = _CUBIC_A

    def near(s: jax.Array) -> jax.Array:
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s: jax.Array) -> jax.Array:
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def grid_sample(
    x: jax.Array,
    grid: jax.Array,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    align_corners: bool = False,
) -> jax.Array:
    """torch's ``F.grid_sample`` on channels-last ``x`` ``[N, H, W, C]`` / ``[N, D, H, W, C]``
    at ``grid`` ``[N, H_out, W_out, 2]`` / ``[N, D_out, H_out, W_out, 3]`` (coordinates ``(x, y)``
    / ``(x, y, z)`` in ``[-1, 1]``, ``x`` along the width): ``[N, H_out, W_out, C]`` /
    ``[N, D_out, H_out, W_out, C]``.

    A coordinate ``c`` of an axis of size ``L`` reads position ``((c + 1) / 2) (L - 1)``
    (``align_corners=True``) or ``((c + 1) L - 1) / 2``; ``mode`` ``"bilinear"`` (trilinear in
    3-D), ``"nearest"`` (rounded half to even) or ``"bicubic"`` (2-D, Keys' ``A = -0.75``);
    ``padding_mode`` ``"zeros"``, ``"border"`` or ``"reflection"``, as torch's (the module
    docstring has the rules). Differentiable in ``x`` and ``grid``. Batched only, as torch's:
    one image is ``grid_sample(x[None], grid[None])[0]``. bfloat16 and float16 inputs:
    positions and weights in float32, the output in ``x``'s dtype. Errors: :data:`GRID_AXES`,
    :data:`GRID_DTYPE`, :data:`GRID_MODE`, :data:`GRID_PADDING`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.arange(4.).reshape(1, 2, 2, 1)     # [[0, 1], [2, 3]]
      >>> grid = jnp.array([[[[0., 0.], [1., -1.]]]])     # the centre, the top right corner
      >>> ft.nn.grid_sample(x, grid, align_corners=True).ravel()
      Array([1.5, 1. ], dtype=float32)
    """
    x, grid = jnp.asarray(x), jnp.asarray(grid)
    n = x.ndim - 2
    if n not in _MODES or grid.ndim != x.ndim or grid.shape[-1] != n or grid.shape[0] != x.shape[0]:
        raise ValueError(GRID_AXES.format(x=short_array(x), grid=short_array(grid)))
    if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype == grid.dtype):
        dtype = x.dtype.name if jnp.issubdtype(x.dtype, jnp.floating) else "float32"
        raise TypeError(GRID_DTYPE.format(x=short_array(x), grid=short_array(grid), dtype=f"jnp.{dtype}"))
    if mode not in _MODES[n]:
        other = "; 'bicubic' is 2-D only" if mode == "bicubic" else ""
        raise ValueError(GRID_MODE.format(given=mode, modes=_MODES[n], n=n, other=other))
    if padding_mode not in _PADDINGS:
        right = {"reflect": "reflection", "replicate": "border", "constant": "zeros"}.get(padding_mode, "zeros")
        raise ValueError(GRID_PADDING.format(given=padding_mode, right=right))
    align = bool(align_corners)
    spatial = x.shape[1:-1]
    # Positions and weights in float32 for bfloat16/float16 grids (torch's opmath): a bfloat16
    # position of 200 has a spacing of 1, so its fraction, the bilinear weights, were lost and
    # it read up to 2 elements away. The output is rounded once, to x's dtype.
    wide = statistics_dtype(x.dtype)
    # grid's coordinates run (x, y, z): the last spatial axis first
    coords = [grid[..., n - 1 - d].astype(wide) for d in range(n)]
    if mode == "bicubic":
        return _bicubic(x, coords, padding_mode, align).astype(x.dtype)
    positions = jnp.stack([_pad(_unnormalize(c, size, align), size, padding_mode, align)
                           for c, size in zip(coords, spatial)], axis=-1)  # [N, *O, n]
    if mode == "nearest":
        return _read(x, jnp.round(positions))
    low = jnp.floor(positions)
    corners = jnp.asarray(list(itertools.product((0, 1), repeat=n)), positions.dtype)  # [2^n, n]
    corners = jax.lax.broadcast_to_rank(corners, low.ndim + 1)
    taps = low[..., None, :] + corners  # [N, *O, 2^n, n]
    # each corner's weight: the product over axes of 1 - distance, as torch's ((low + 1) - p or p - low)
    weights = jnp.where(corners == 1, (positions - low)[..., None, :], ((low + 1) - positions)[..., None, :])
    weight = weights[..., n - 1]
    for d in reversed(range(n - 1)):  # torch multiplies the x weight first, then y, then z
        weight = weight * weights[..., d]
    return jnp.einsum("...tc,...t->...c", _read(x, taps).astype(wide), weight).astype(x.dtype)


def _bicubic(x: jax.Array, coords: Sequence[jax.Array], padding_mode: str, align: bool) -> jax.Array:
    """torch's bicubic ``grid_sample``: the unpadded position's 4x4 integer neighbours, each
    padded, weighted by Keys' cubic of the fraction (along x, then along y)."""
    (height, width) = x.shape[1:3]
    iy, ix = (_unnormalize(c, size, align) for c, size in zip(coords, (height, width)))
    y0, x0 = jnp.floor(iy), jnp.floor(ix)
    steps = jax.lax.broadcast_to_rank(jnp.arange(-1, 3, dtype=iy.dtype), iy.ndim + 1)
    ty = _pad(y0[..., None] + steps, height, padding_mode, align)  # [N, *O, 4]
    tx = _pad(x0[..., None] + steps, width, padding_mode, align)
    taps = jnp.stack(jnp.broadcast_arrays(ty[..., :, None], tx[..., None, :]), axis=-1)  # [N, *O, 4, 4, 2]
    wy, wx = jnp.stack(_cubic(iy - y0), axis=-1), jnp.stack(_cubic(ix - x0), axis=-1)
    rows = jnp.einsum("...ijc,...j->...ic", _read(x, taps).astype(wx.dtype), wx)  # along x, then along y
    return jnp.einsum("...ic,...i->...c", rows, wy)


def affine_grid(theta: jax.Array, size: Sequence[int], align_corners: bool = False) -> jax.Array:
    """torch's ``F.affine_grid``: the sampling grid of the affine maps ``theta`` ``[N, 2, 3]``
    (``[N, 3, 4]``) over an output of ``size`` in ft's layout ``(N, H, W, C)``
    (``(N, D, H, W, C)``): ``grid[n, i, j] = theta[n] @ (x_j, y_i, 1)``, ``[N, H, W, 2]``
    (``[N, D, H, W, 3]``), for :func:`grid_sample`.

    ``x_j`` and ``y_i`` are ``linspace(-1, 1, L)`` of their axes, times ``(L - 1) / L`` unless
    ``align_corners`` (the centres of ``L`` elements spanning ``[-1, 1]``); an axis of one
    element reads 0. ``size`` is ``x.shape`` of the channels-last input, C not read (torch's
    ``x.size()`` is ``(N, C, H, W)``: a torch literal ``(N, C, H, W)`` needs C moved last).
    Errors: :data:`AFFINE_THETA`, :data:`AFFINE_SIZE`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> theta = jnp.array([[[1., 0., 0.], [0., 1., 0.]]])     # the identity
      >>> ft.nn.affine_grid(theta, (1, 2, 2, 3), align_corners=True)[0, :, :, 0]
      Array([[-1.,  1.],
             [-1.,  1.]], dtype=float32)
    """
    theta = jnp.asarray(theta)
    if theta.ndim != 3 or theta.shape[1:] not in ((2, 3), (3, 4)) or not jnp.issubdtype(theta.dtype, jnp.floating):
        fix = "theta.astype(jnp.float32)" if theta.shape[1:] in ((2, 3), (3, 4)) and theta.ndim == 3 else (
            "theta[None]" if theta.shape in ((2, 3), (3, 4)) else "theta.reshape(-1, 2, 3)")
        raise ValueError(AFFINE_THETA.format(theta=short_array(theta), right=fix))
    n = theta.shape[1]
    size = tuple(size)
    if len(size) != n + 2 or not all(is_int(s) and s >= 1 for s in size) or size[0] != theta.shape[0]:
        right: tuple[Any, ...] = (theta.shape[0], *(4,) * n, 3)
        if len(size) == n + 2 and all(is_int(s) and s >= 1 for s in size):  # another batch
            right = (theta.shape[0], *size[1:])
        raise ValueError(AFFINE_SIZE.format(size=size, theta=short_array(theta), right=right))
    axes = []  # NumPy, in float64, once a shape: the grid's one JAX operation is the product
    for length in size[1:-1]:
        a = np.linspace(-1, 1, length) if length > 1 else np.zeros(1)
        axes.append(a if align_corners or length <= 1 else a * (length - 1) / length)
    mesh = np.meshgrid(*axes, indexing="ij")  # [*spatial] each, the first spatial axis first
    base = np.stack([*reversed(mesh), np.ones_like(mesh[0])], axis=-1)  # (x, y[, z], 1)
    grid = jnp.asarray(base.reshape(1, -1, n + 1), theta.dtype) @ jnp.swapaxes(theta, 1, 2)  # torch's bmm
    return grid.reshape((theta.shape[0], *mesh[0].shape, n))
