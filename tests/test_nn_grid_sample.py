"""ft.nn.grid_sample and ft.nn.affine_grid against torch's F.grid_sample / F.affine_grid
(float64: outputs and gradients for x, grid and theta; float32 outputs), every mode,
padding mode and align_corners, on channels-last inputs; their argument errors."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _errors import raises_named
from _tolerance import needs_float16_conversions
from jax.test_util import check_grads

import functree as ft
from functree.nn import _grid_sample

F = torch.nn.functional
PADDINGS = ("zeros", "border", "reflection")


def _torch_sample(x, grid, cotangent=None, **kw):
    """torch's output (channels last) and, given a cotangent, its gradients for x and grid."""
    xt = torch.tensor(np.moveaxis(x, -1, 1), requires_grad=True)
    gt = torch.tensor(grid, requires_grad=True)
    y = F.grid_sample(xt, gt, **kw)
    if cotangent is None:
        return np.moveaxis(y.detach().numpy(), 1, -1)
    (y * torch.tensor(np.moveaxis(cotangent, -1, 1))).sum().backward()
    return np.moveaxis(y.detach().numpy(), 1, -1), np.moveaxis(_grad(xt), 1, -1), _grad(gt)


def _grad(t: Any) -> np.ndarray:
    return t.grad.numpy()


# each padding mode with align_corners both ways, for the interpolating modes in 2-D and in 3-D
# (nearest: every padding and align_corners in the ties test)
CASES = [(2, "bilinear", "zeros", False), (2, "bilinear", "border", True), (2, "bilinear", "reflection", False),
         (2, "bilinear", "reflection", True), (2, "bicubic", "zeros", True), (2, "bicubic", "border", False),
         (2, "bicubic", "reflection", False), (2, "bicubic", "reflection", True), (2, "nearest", "border", True),
         (3, "bilinear", "reflection", True), (3, "bilinear", "zeros", False), (3, "nearest", "reflection", False)]


def test_grid_sample_matches_torch_in_float64():
    """Outputs and both gradients of CASES, the grid reaching past the edges (several
    reflections at +-5) and a size-one axis in 3-D; one compiled program for all."""
    rng = np.random.default_rng(0)
    data = {}
    for n, spatial, out in ((2, (4, 5), (3, 4)), (3, (3, 1, 4), (2, 3, 2))):
        grid = rng.uniform(-1.6, 1.6, (2, *out, n))
        grid[0, 0, :2] = rng.uniform(-5, 5, grid[0, 0, :2].shape)
        data[n] = rng.standard_normal((2, *spatial, 3)), grid, rng.standard_normal((2, *out, 3))

    def all_cases(data):
        results = []
        for n, mode, padding, align in CASES:
            x, grid, cotangent = data[n]

            def loss(x, grid, cotangent=cotangent, mode=mode, padding=padding, align=align):
                y = ft.nn.grid_sample(x, grid, mode, padding, align)
                return (y * cotangent).sum(), y

            (_, y), (dx, dgrid) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, grid)
            results.append((y, dx, dgrid))
        return results

    with jax.enable_x64(True):
        results = jax.jit(all_cases)({n: tuple(map(jnp.asarray, d)) for n, d in data.items()})
    worst = {}
    for (n, mode, padding, align), ours in zip(CASES, results):
        x, grid, cotangent = data[n]
        expected = _torch_sample(x, grid, cotangent, mode=mode, padding_mode=padding, align_corners=align)
        errors = [float(np.abs(np.asarray(a) - b).max()) for a, b in zip(ours, expected)]
        if mode == "nearest":  # the same element, no grid gradient
            assert errors == [0.0, 0.0, 0.0], (n, mode, padding, align, errors)
        worst[mode] = np.maximum(worst.get(mode, 0.0), errors)
    # measured (|x| ~ 1; output, dx, dgrid): bilinear 4e-16, 4e-16, 7e-15; bicubic 5e-15, 3e-15,
    # 1.4e-14; about 8x
    assert np.all(worst["bilinear"] <= [4e-15, 4e-15, 6e-14]), worst
    assert np.all(worst["bicubic"] <= [4e-14, 3e-14, 1.2e-13]), worst


def test_nearest_rounds_half_to_even_as_torch():
    """Positions 0, 0.5, 1, ... (and past both edges) exactly: torch's nearbyint rounds
    0.5 to 0 and 1.5 to 2, in every padding mode, either align_corners."""
    x = np.random.default_rng(1).standard_normal((1, 2, 6, 2))
    position = np.arange(-3, 14) / 2.0
    grids = {}
    for align in (False, True):
        coordinate = position / 5 * 2 - 1 if align else (2 * position + 1) / 6 - 1
        grids[align] = np.stack(np.broadcast_arrays(coordinate[None, :], np.array([[-1.0], [1.0]])), -1)[None]
    cases = [(padding, align) for padding in PADDINGS for align in (False, True)]

    def sample(x, grids):
        return [ft.nn.grid_sample(x, grids[align], "nearest", padding, align) for padding, align in cases]

    with jax.enable_x64(True):
        ys = jax.jit(sample)(jnp.asarray(x), {a: jnp.asarray(g) for a, g in grids.items()})
    for (padding, align), y in zip(cases, ys):
        expected = _torch_sample(x, grids[align], mode="nearest", padding_mode=padding, align_corners=align)
        assert np.array_equal(y, expected), (padding, align)


def test_nan_and_infinite_coordinates_read_as_torch():
    """torch's clamp gives NaN as 0: border and reflection read a NaN (reflection: an infinite)
    coordinate at the first element, zeros padding reads 0; a huge one is clamped."""
    x = np.arange(1.0, 13.0).reshape(1, 3, 4, 1)
    grid = np.array([[[[np.nan, 0.2], [0.3, np.inf], [-np.inf, -0.4], [1e12, -1e12]]]])
    cases = [(mode, padding) for mode in ("bilinear", "nearest", "bicubic") for padding in PADDINGS]
    with jax.enable_x64(True):
        ys = jax.jit(lambda x, g: [ft.nn.grid_sample(x, g, mode, padding) for mode, padding in cases])(
            jnp.asarray(x), jnp.asarray(grid))
    for (mode, padding), y in zip(cases, ys):
        expected = _torch_sample(x, grid, mode=mode, padding_mode=padding, align_corners=False)
        assert np.allclose(y, expected, rtol=0, atol=1e-12, equal_nan=True), (mode, padding)


def test_grid_sample_float32_and_check_grads():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 6, 3)).astype(np.float32)
    grid = rng.uniform(-1.2, 1.2, (2, 3, 4, 2)).astype(np.float32)
    y = jax.jit(ft.nn.grid_sample, static_argnums=(2, 3))(jnp.asarray(x), jnp.asarray(grid), "bicubic", "reflection")
    assert y.dtype == jnp.float32
    expected = _torch_sample(x, grid, mode="bicubic", padding_mode="reflection", align_corners=False)
    assert np.abs(y - expected).max() <= 5e-6  # measured 6.6e-7 (|x| ~ 1)
    with jax.enable_x64(True):
        x64, grid64 = jnp.asarray(x[:1, :4, :5, :2], jnp.float64), jnp.asarray(grid[:1, :2, :3], jnp.float64)
        sample = jax.jit(lambda x, g: ft.nn.grid_sample(x, g, "bicubic", "reflection", align_corners=True))
        check_grads(sample, (x64, grid64), order=1, modes=("rev",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=needs_float16_conversions)])
def test_low_precision_positions_are_computed_in_float32(dtype):
    # A bfloat16 position of 200 (a row of 256) has a spacing of 1: computed in bfloat16 the
    # bilinear fraction was lost and the read landed up to 2 elements away (0.47 of the
    # largest value off; float16: spacing 0.125). torch's reference in float64 on the same
    # rounded inputs; only the output's rounding to the dtype is left (measured 2e-3 bf16).
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 2, 256, 2)), dtype)
    grid = jnp.asarray(np.stack([rng.uniform(0.5, 1.0, (1, 2, 8)), rng.uniform(-1, 1, (1, 2, 8))], -1), dtype)
    x64, grid64 = np.asarray(x, np.float64), np.asarray(grid, np.float64)
    for mode in ("bilinear", "bicubic"):
        y = ft.nn.grid_sample(x, grid, mode)
        assert y.dtype == dtype
        expected = _torch_sample(x64, grid64, mode=mode, padding_mode="zeros", align_corners=False)
        bound = float(jnp.finfo(dtype).eps) * np.abs(expected).max()  # one unit of the output's rounding
        np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=0, atol=bound)


@pytest.mark.filterwarnings("ignore:Since version 1.3.0, affine_grid:UserWarning")  # torch's, a size-one axis
def test_affine_grid_matches_torch_and_samples_the_identity():
    """2-D and 3-D, either align_corners, a size-one axis; theta's gradient; the identity
    theta's grid reads x back (bilinear, either align_corners)."""
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        for size, align in (((2, 1, 5, 3), True), ((2, 3, 4, 2, 1), False)):
            n = len(size) - 2
            theta = rng.standard_normal((2, n, n + 1))
            theta_t = torch.tensor(theta, requires_grad=True)
            grid_t = F.affine_grid(theta_t, [size[0], size[-1], *size[1:-1]], align_corners=align)
            cotangent = rng.standard_normal(grid_t.shape)
            (grid_t * torch.tensor(cotangent)).sum().backward()

            def loss(theta, size=size, align=align, cotangent=cotangent):
                grid = ft.nn.affine_grid(theta, size, align)
                return (grid * cotangent).sum(), grid

            (_, grid), dtheta = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(theta))
            assert grid.shape == grid_t.shape
            assert np.abs(grid - grid_t.detach().numpy()).max() <= 1e-14  # measured 8.9e-16
            assert np.abs(dtheta - _grad(theta_t)).max() <= 1e-13  # |dtheta| ~ 10
        x = jnp.asarray(rng.standard_normal((1, 3, 4, 2)))
        identity = jnp.asarray([[[1.0, 0, 0], [0, 1, 0]]])
        for align in (False, True):
            y = jax.jit(lambda x, t, align=align: ft.nn.grid_sample(
                x, ft.nn.affine_grid(t, x.shape, align), align_corners=align))(x, identity)
            assert np.abs(y - x).max() <= 1e-15


ERRORS = [
    (lambda: ft.nn.grid_sample(jnp.ones((4, 5, 3)), jnp.zeros((2, 2, 2))), ValueError, _grid_sample.GRID_AXES,
     "x[None], grid[None]"),
    (lambda: ft.nn.grid_sample(jnp.ones((1, 4, 5, 3)), jnp.zeros((1, 2, 2, 3))), ValueError,
     _grid_sample.GRID_AXES, "coordinates last"),
    (lambda: ft.nn.grid_sample(jnp.ones((1, 4, 5, 3), jnp.int32), jnp.zeros((1, 2, 2, 2))), TypeError,
     _grid_sample.GRID_DTYPE, "jnp.float32"),
    (lambda: ft.nn.grid_sample(jnp.ones((1, 2, 4, 5, 3)), jnp.zeros((1, 1, 2, 2, 3)), mode="bicubic"), ValueError,
     _grid_sample.GRID_MODE, "'bicubic' is 2-D only"),
    (lambda: ft.nn.grid_sample(jnp.ones((1, 4, 5, 3)), jnp.zeros((1, 2, 2, 2)), padding_mode="reflect"), ValueError,
     _grid_sample.GRID_PADDING, "padding_mode='reflection'"),
    (lambda: ft.nn.affine_grid(jnp.zeros((2, 3)), (1, 4, 4, 3)), ValueError, _grid_sample.AFFINE_THETA,
     "theta[None]"),
    (lambda: ft.nn.affine_grid(jnp.zeros((2, 2, 3)), (1, 3, 4, 4)), ValueError, _grid_sample.AFFINE_SIZE,
     "(2, 3, 4, 4)"),
    (lambda: ft.nn.affine_grid(jnp.zeros((2, 2, 3)), (2, 4, 4)), ValueError, _grid_sample.AFFINE_SIZE,
     "(N, H, W, C)"),
]


@pytest.mark.parametrize("call, kind, constant, fix", ERRORS)
def test_errors_name_the_fix(call, kind, constant, fix):
    raises_named(call, kind, constant, fix)


def test_grid_dtype_mismatch_is_refused():
    with jax.enable_x64(True), pytest.raises(TypeError, match="same floating dtype") as info:
        ft.nn.grid_sample(jnp.ones((1, 4, 5, 3), jnp.float32), jnp.zeros((1, 2, 2, 2), jnp.float64))
    assert "x.astype(jnp.float32), grid.astype(jnp.float32)" in str(info.value)
