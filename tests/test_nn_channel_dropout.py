"""Dropout1D/2D/3D (whole channels), AlphaDropout and FeatureAlphaDropout: inference identity,
masks shared over the spatial axes, rates, SELU's statistics, torch's values; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


@pytest.mark.parametrize("n", [1, 2, 3])
def test_channel_dropout_drops_whole_channels_at_rate(n):
    layer = getattr(ft.nn, f"Dropout{n}D")(0.25)
    x = jnp.ones((40, *(2,) * n, 50))
    np.testing.assert_array_equal(layer(x), x)  # inference: the identity
    y = ft.nn.training(layer)(x, key=jax.random.key(n))
    first = y[(slice(None), *(slice(0, 1),) * n)]
    np.testing.assert_array_equal(y, jnp.broadcast_to(first, y.shape))  # one value per (example, channel)
    np.testing.assert_allclose(np.unique(np.asarray(y)), [0.0, 1 / 0.75], rtol=1e-7)
    assert float(jnp.mean(first == 0)) == pytest.approx(0.25, abs=0.03)  # 2000 channels: sd 0.01


def test_channel_dropout_needs_its_spatial_axes_and_a_key():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)an input of 3 axes or more.*ft.nn.Dropout1D"):
        ft.nn.Dropout2D(0.5)(jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"needs a PRNG key"):
        ft.nn.training(ft.nn.Dropout2D(0.5))(jnp.ones((1, 2, 2, 3)))


def test_alpha_dropout_keeps_selu_statistics_and_torch_values():
    x = jax.random.normal(jax.random.key(1), (200_000,))
    rate = 0.3
    y = ft.nn.training(ft.nn.AlphaDropout(rate))(x, key=jax.random.key(0))
    assert abs(float(y.mean())) < 0.01 and abs(float(y.std()) - 1) < 0.01  # sd of each: 2.2e-3
    # torch's: a = ((1 - p)(1 + p a'^2))^-1/2, a dropped unit -a a' (1 - p) with a' = 1.7581
    a = ((1 - rate) * (1 + rate * 1.7580993408473766 ** 2)) ** -0.5
    dropped = np.isclose(np.asarray(y), -a * 1.7580993408473766 * (1 - rate), rtol=0, atol=1e-6)
    assert float(dropped.mean()) == pytest.approx(rate, abs=0.005)
    kept = ~dropped
    np.testing.assert_allclose(np.asarray(y)[kept], a * np.asarray(x)[kept] + 1.7580993408473766 * a * rate,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ft.nn.AlphaDropout(rate)(x), x)


def test_feature_alpha_dropout_shares_a_mask_over_the_middle_axes():
    y = ft.nn.training(ft.nn.FeatureAlphaDropout(0.5))(jnp.zeros((3, 4, 5, 6)), key=jax.random.key(2))
    np.testing.assert_array_equal(y, jnp.broadcast_to(y[:, :1, :1], y.shape))
    assert len(np.unique(np.asarray(y))) == 2
    with pytest.raises(ft.nn.LayerInputError, match=r"x\[None\]"):
        ft.nn.FeatureAlphaDropout(0.5)(jnp.zeros(3))


def test_alpha_dropout_gradient_is_the_scaled_mask():
    drop = ft.nn.AlphaDropout(0.5, training=True)
    x = jnp.arange(1.0, 9.0)
    key = jax.random.key(3)
    grad = jax.grad(lambda x: jnp.sum(drop(x, key=key)))(x)
    a = (0.5 * (1 + 0.5 * 1.7580993408473766 ** 2)) ** -0.5
    kept = jax.random.bernoulli(jax.random.key(3), 0.5, (8,))
    np.testing.assert_allclose(grad, np.where(kept, a, 0.0), rtol=1e-6)
