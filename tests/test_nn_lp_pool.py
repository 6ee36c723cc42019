"""LPPool1D/2D/3D against torch's LPPool1d/2d/3d (p = 1, 2, 3, inf, -inf; ceil_mode); a
window of zeros has gradient 0; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functree as ft


@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_torch(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((2, *(5, 4, 5)[:n], 2)).astype(np.float32)
    xt = torch.from_numpy(np.moveaxis(x, -1, 1).copy())
    for p in (1.0, 2.0, 3.0, float("inf"), -float("inf")):
        for k, s, ceil in ((2, None, False), (3, 2, True)):
            data, given = (np.abs(x), xt.abs()) if p == 3.0 else (x, xt)  # torch's x^3: a negative odd power
            y = getattr(ft.nn, f"LPPool{n}D")(p, k, s, ceil)(jnp.asarray(data))
            expected = np.moveaxis(getattr(torch.nn, f"LPPool{n}d")(p, k, s, ceil)(given).numpy(), 1, -1)
            # measured 9.5e-7 (p = 3, sums of cubes ~ 20 rooted): 8x
            np.testing.assert_allclose(y, expected, rtol=0, atol=8e-6, err_msg=f"p={p} k={k} ceil={ceil}")


def test_window_of_zeros_has_zero_gradient_and_jit():
    pool = ft.nn.LPPool1D(2, 2)
    x = jnp.array([0.0, 0.0, 3.0, 4.0]).reshape(1, 4, 1)
    grad = jax.grad(lambda x: jnp.sum(pool(x)))(x)
    np.testing.assert_allclose(grad.ravel(), [0.0, 0.0, 0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(jax.jit(pool)(x).ravel(), [0.0, 5.0])


@pytest.mark.parametrize("bad", [0, float("nan"), "2", True])
def test_bad_norm_type_is_refused(bad):
    with pytest.raises(ValueError, match=r"norm_type=.*; it is a nonzero number"):
        ft.nn.LPPool2D(bad, 2)


def test_an_input_shorter_than_the_window_names_lppool_and_its_ceil_mode():
    """A length-6 input to LPPool1D(2, 7): torch raises ("Output size is too small"); the error
    named AvgPool1D (the pooling LPPool runs) and told to pass padding="SAME", which LPPool
    does not take. It names LPPool and ceil_mode=True, whose one partial window is torch's."""
    from functree.nn._lp_pool import WINDOW_TOO_LARGE

    x = np.random.default_rng(0).uniform(0.1, 1.0, (1, 6, 3)).astype(np.float32)
    with pytest.raises(ft.nn.LayerInputError) as info:
        ft.nn.LPPool1D(2, 7)(jnp.asarray(x))
    assert str(info.value).startswith("LPPool1D expects inputs [..., length, 3] (float) with length >= 7")
    assert str(info.value).endswith(WINDOW_TOO_LARGE.format(axis="length", size=6, pool=7, cls="LPPool1D", p=2, need=7))
    with pytest.raises(ft.nn.LayerInputError, match=r'ft\.nn\.LPPool2D\(float\("inf"\), \(3, 2\), ceil_mode=True\)'):
        ft.nn.LPPool2D(float("inf"), (3, 2))(jnp.ones((2, 5, 3)))
    ours = ft.nn.LPPool1D(2, 7, ceil_mode=True)(jnp.asarray(x))
    theirs = torch.nn.LPPool1d(2, 7, ceil_mode=True)(torch.from_numpy(x).permute(0, 2, 1)).permute(0, 2, 1)
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=0, atol=1e-6)
