"""ft.nn.FractionalMaxPool2D/3D against torch's F.fractional_max_pool2d/3d given the same uniform
samples: values and indices bit for bit (float64 and float32), gradients in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn._fractional_pool import (
    BAD_RATIO,
    BAD_SAMPLES,
    NO_SAMPLES,
    ONE_SIZE,
    SAMPLES_OUTSIDE,
    TOO_SMALL,
)
from tests._errors import raises_named

torch = pytest.importorskip("torch")
F = torch.nn.functional

CASES = [  # (n, x shape (channels last), pool_size, output_size, output_ratio)
    (2, (2, 11, 9, 3), (3, 2), (4, 5), None),
    (2, (11, 9, 3), 3, (5, 1), None),              # unbatched; one output on an axis: the last window
    (2, (2, 16, 13, 2), 2, None, (0.5, 0.7)),
    (2, (1, 30, 30, 1), 2, (15, 20), None),        # overlapping windows (alpha < k): gradients add up
    (3, (2, 7, 8, 9, 3), 2, (3, 4, 5), None),
    (3, (6, 7, 5, 2), (2, 3, 1), None, 0.6),        # unbatched
]


def _torch(n, x, u, k, size, ratio):
    """torch's pooled output, indices and input gradient (cotangent cos(y)), channels last."""
    lead = x.ndim - n - 1
    xt = torch.from_numpy(np.moveaxis(x, -1, lead).copy()).requires_grad_()
    ut = torch.from_numpy(np.ascontiguousarray(u[..., ::-1] if n == 2 else u))  # torch's 2-D order: (w, h)
    ut = ut[None] if lead == 0 else ut
    pool = F.fractional_max_pool2d if n == 2 else F.fractional_max_pool3d
    yt, it = pool(xt, k, output_size=size, output_ratio=ratio, return_indices=True, _random_samples=ut)
    yt.backward(torch.cos(yt.detach()))
    return tuple(np.moveaxis(t.detach().numpy(), lead, -1) for t in (yt, it, xt.grad))


def _layer(n, k, size, ratio):
    cls = ft.nn.FractionalMaxPool2D if n == 2 else ft.nn.FractionalMaxPool3D
    return cls(k, output_size=size, output_ratio=ratio, return_indices=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n, shape, k, size, ratio", CASES)
def test_values_and_indices_equal_torchs_bit_for_bit(n, shape, k, size, ratio, dtype):
    rng = np.random.default_rng(len(shape) * 10 + n)
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[1] = x.flat[0]  # equal maxima: torch takes the first
    lead = x.ndim - n - 1
    u = rng.uniform(size=(*shape[:lead], shape[-1], n)).astype(dtype)
    u.flat[0] = 0.0
    y_t, i_t, _ = _torch(n, x, u, k, size, ratio)
    with jax.enable_x64(True):
        # one compiled program per case (eager, each of the layer's ops compiled its own)
        layer = _layer(n, k, size, ratio)
        y, i = jax.jit(lambda v, s: layer(v, samples=s))(jnp.asarray(x), jnp.asarray(u))
        assert y.dtype == dtype and i.dtype == jnp.int32
    np.testing.assert_array_equal(y, y_t)
    np.testing.assert_array_equal(i, i_t)


@pytest.mark.parametrize("n, shape, k, size, ratio", CASES)
def test_gradients_match_torchs_in_float64(n, shape, k, size, ratio):
    """Each maximum's cotangent reaches its element alone; an element that is the maximum of
    several windows sums theirs (in another order than torch's: 1e-15 of the magnitude)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(shape)
    lead = x.ndim - n - 1
    u = rng.uniform(size=(*shape[:lead], shape[-1], n))
    _, _, g_t = _torch(n, x, u, k, size, ratio)
    with jax.enable_x64(True):
        layer = _layer(n, k, size, ratio)

        @jax.jit  # one compiled program per case
        def grad(v, s):
            y, pull = jax.vjp(lambda v: layer(v, samples=s)[0], v)
            return pull(jnp.cos(y))[0]

        g = grad(jnp.asarray(x), jnp.asarray(u))
    np.testing.assert_allclose(g, g_t, rtol=0, atol=1e-15 * np.abs(g_t).max())


def test_fractional_intervals_are_torchs():
    """Starts read off torch's indices on an arange plane (each window's max is its last element)."""
    for length, size, k, u in [(10, 4, 2, 0.9), (10, 4, 2, 0.0), (25, 7, 3, 0.37), (9, 1, 4, 0.5), (8, 8, 1, 0.99)]:
        x = torch.arange(float(length), dtype=torch.float64).reshape(1, 1, 1, length)
        _, idx = F.fractional_max_pool2d(x, (1, k), output_size=(1, size), return_indices=True,
                                         _random_samples=torch.tensor([[[u, 0.5]]], dtype=torch.float64))
        with jax.enable_x64(True):
            starts = ft.nn.fractional_intervals(jnp.asarray(u, jnp.float64), length, size, k)
        np.testing.assert_array_equal(starts, idx.numpy().ravel() - (k - 1))


def test_a_key_draws_uniform_samples_per_channel_and_jit_agrees():
    pool = ft.nn.FractionalMaxPool2D(2, output_ratio=0.45)  # 12 -> 5: alpha 2.5, the windows move with u
    x = jax.random.normal(jax.random.key(0), (2, 12, 12, 3))
    key = jax.random.key(1)
    y = pool(x, key=key)
    u = jax.random.uniform(key, (2, 3, 2))  # the layer's draw: [..., channels, axes]
    np.testing.assert_array_equal(y, pool(x, samples=u))
    np.testing.assert_array_equal(ft.jit(lambda p, x, k: p(x, key=k))(pool, x, key), y)
    assert y.shape == (2, 5, 5, 3)
    assert not np.array_equal(pool(x, key=jax.random.key(2)), y)  # another key, other windows


def test_errors_name_the_fix():
    cls = ft.nn.FractionalMaxPool2D
    raises_named(lambda: cls(2), ValueError, ONE_SIZE, "output_size=(4, 4)")
    raises_named(lambda: cls(2, output_size=3, output_ratio=0.5), ValueError, ONE_SIZE, "output_size=(4, 4)")
    raises_named(lambda: cls(2, output_ratio=1.5), ValueError, BAD_RATIO, "output_ratio=0.5")
    raises_named(lambda: ft.nn.FractionalMaxPool3D(2, output_ratio=(0.5, 0.5)), ValueError, BAD_RATIO,
                 "3 numbers in (0, 1)")
    x = jnp.ones((1, 6, 6, 2))
    raises_named(lambda: cls(3, output_size=5)(x, key=jax.random.key(0)), ft.nn.LayerInputError, TOO_SMALL,
                 "output_size=4")
    raises_named(lambda: cls(2, output_size=3)(x), ValueError, NO_SAMPLES, "pool(x, key=jax.random.key(step))")
    raises_named(lambda: cls(2, output_size=3)(x, samples=jnp.ones((1, 2))), ValueError, BAD_SAMPLES,
                 "u: float32[1, 2, 2]")
    raises_named(lambda: cls(2, output_size=3)(x, samples=jnp.ones((1, 2, 2), jnp.int32)), ValueError,
                 BAD_SAMPLES, "_random_samples=t) is samples=t[..., ::-1]")


@pytest.mark.parametrize("u", [1.0, 1.7, -0.5, float("nan"), float("inf")])
def test_samples_outside_0_1_are_refused_or_give_a_nan_plane_under_jit(u):
    """The issue: samples= outside [0, 1) (or NaN) ran, as torch's _random_samples do: on a
    7x7 plane, output_size 3, u = 1.0 took the windows of no u in [0, 1) ([[9, 12, 14], [30,
    33, 35], ...] where every draw gives [[9, 11, 14], [23, 25, 28], ...]), u = -0.5 took
    others than torch's (its truncation), NaN repeated the first window. Now concrete samples
    are refused naming the entry and its axis; under jax.jit that channel's plane is NaN, its
    indices -1, with no gradient, the other planes unchanged."""
    pool = ft.nn.FractionalMaxPool2D(2, output_size=3, return_indices=True)
    x = jnp.arange(1.0, 99.0).reshape(1, 2, 7, 7).transpose(0, 2, 3, 1)  # channels last: two planes
    good = jnp.array([[[0.5, 0.25], [0.75, 0.1]]])
    bad = good.at[0, 1, 1].set(u)
    value = "nan" if u != u else str(np.float32(u))
    raises_named(lambda: pool(x, samples=bad), ValueError, SAMPLES_OUTSIDE,
                 f"samples[0, 1, 1] is {value}: the width axis's sample of that channel")
    y, index = pool(x, samples=good)
    run = jax.jit(lambda x, s: pool(x, samples=s))
    yj, ij = run(x, bad)
    np.testing.assert_array_equal(yj[..., 0], y[..., 0])
    np.testing.assert_array_equal(ij[..., 0], index[..., 0])
    assert np.isnan(yj[..., 1]).all() and (np.asarray(ij[..., 1]) == -1).all()
    grad = jax.grad(lambda x: jnp.sum(jnp.nan_to_num(run(x, bad)[0], nan=0.0)))(x)
    assert np.isfinite(grad).all() and not np.any(grad[..., 1]) and np.any(grad[..., 0])
    raises_named(lambda: ft.nn.FractionalMaxPool3D(2, output_size=2)(jnp.ones((5, 5, 5, 1)), samples=jnp.array([[0.5, u, 0.5]])),
                 ValueError, SAMPLES_OUTSIDE, f"samples[0, 1] is {value}: the height axis's sample")


def test_a_sample_that_rounds_to_1_in_the_inputs_dtype_is_refused_naming_both():
    """0.999 is 1.0 in bfloat16 (the samples are cast to x's dtype, as torch computes in it):
    the windows of u = 1.0, refused naming the value given and the value used."""
    pool = ft.nn.FractionalMaxPool2D(2, output_size=3)
    x = jnp.ones((7, 7, 1), jnp.bfloat16)
    raises_named(lambda: pool(x, samples=np.full((1, 2), 0.999, np.float32)), ValueError, SAMPLES_OUTSIDE,
                 "samples[0, 0] is 0.999, 1 in bfloat16: the height axis's")
    fix = jax.random.uniform(jax.random.key(0), (1, 2), x.dtype)  # the right: line's draw in x's dtype
    assert pool(x, samples=fix).shape == (3, 3, 1)


def test_a_torch_modules_options_are_compared_on_load():
    """No tensor holds a fractional pool's window or an RReLU's range: ft.nn.load_torch_state_dict
    given the torch module compares them (it loaded a differing model silently before)."""
    from functree.interop._options import OPTIONS_DIFFER

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RReLU(0.1, 0.3),
                                 torch.nn.FractionalMaxPool2d(2, output_size=3))
    dense = ft.nn.Dense(4, 4, key=jax.random.key(0))
    wrong = ft.nn.Sequential(dense, ft.nn.RReLU(), ft.nn.FractionalMaxPool2D(2, output_ratio=0.5))
    raises_named(lambda: ft.nn.load_torch_state_dict(wrong, module), ValueError, OPTIONS_DIFFER,
                 "ft.nn.RReLU(..., lower=0.1, upper=0.3)")
    raises_named(lambda: ft.nn.load_torch_state_dict(wrong, module), ValueError, OPTIONS_DIFFER,
                 "ft.nn.FractionalMaxPool2D(..., output_size=(3, 3), output_ratio=None)")
    right = ft.nn.Sequential(dense, ft.nn.RReLU(0.1, 0.3), ft.nn.FractionalMaxPool2D(2, output_size=3))
    ft.nn.load_torch_state_dict(right, module)
