"""Dropout: inference identity, training statistics, keys, errors, gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def test_inference_is_identity_by_default():
    x = jax.random.normal(jax.random.key(0), (5, 4))
    np.testing.assert_array_equal(ft.nn.Dropout(0.9)(x), x)
    np.testing.assert_array_equal(ft.nn.Dropout(0.9)(x, key=jax.random.key(1)), x)


def test_training_drops_at_rate_and_rescales():
    drop = ft.nn.training(ft.nn.Dropout(0.3))
    y = drop(jnp.ones(100_000), key=jax.random.key(0))
    kept = y != 0
    assert float(jnp.mean(kept)) == pytest.approx(0.7, abs=0.01)
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    assert float(jnp.mean(y)) == pytest.approx(1.0, abs=0.02)


def test_same_key_same_mask_new_key_new_mask():
    drop = ft.nn.Dropout(0.5, training=True)
    x = jnp.ones(64)
    a, b = drop(x, key=jax.random.key(1)), drop(x, key=jax.random.key(1))
    c = drop(x, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not jnp.array_equal(a, c)


def test_gradient_is_the_mask_over_keep_probability():
    drop = ft.nn.Dropout(0.5, training=True)
    x = jnp.arange(1.0, 9.0)
    key = jax.random.key(3)
    grad = jax.grad(lambda x: jnp.sum(drop(x, key=key)))(x)
    np.testing.assert_allclose(grad, np.where(drop(x, key=key) != 0, 2.0, 0.0))


def test_training_without_key_is_an_error():
    with pytest.raises(ValueError, match=r"(?s)needs a PRNG key.*key=jax.random.key\(step\)"):
        ft.nn.Dropout(0.5, training=True)(jnp.ones(3))


@pytest.mark.parametrize("layer", [ft.nn.Dropout(0.5, training=True), ft.nn.RReLU(training=True),
                                   ft.nn.MultiheadAttention(4, 2, dropout=0.5, key=jax.random.key(0)).replace(training=True)])
def test_a_missing_key_names_the_trainers_key_not_a_constant_in_the_loss(layer):
    # a Trainer's user given only key=jax.random.key(step) wrote a constant there: one mask every step
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"(?s)lambda m, b, key: loss_fn\(m\(b\[0\], key=key\).*key=jax\.random\.key\(0\)\)"):
        layer(x) if not isinstance(layer, ft.nn.MultiheadAttention) else layer(x, x, x)


def test_bad_rate_is_an_error():
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\), got 1.5"):
        ft.nn.Dropout(1.5)


def test_mode_is_static_and_jit_compiles_once_per_mode():
    traces = []

    @jax.jit
    def f(m, x, key):
        traces.append(m.training)
        return m(x, key=key)

    drop, x, key = ft.nn.Dropout(0.5), jnp.ones(4), jax.random.key(0)
    f(drop, x, key)
    f(ft.nn.training(drop), x, key)
    f(ft.nn.training(drop), x, key)
    f(drop, x, key)
    assert traces == [False, True]
