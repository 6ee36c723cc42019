"""ft.nn.initializers: the jax.nn factories, usable as layer initializers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def test_every_exported_initializer_builds_an_array():
    key = jax.random.key(0)
    for name in ft.nn.initializers.__all__:
        factory = getattr(ft.nn.initializers, name)
        init = factory if name in ("zeros", "ones") else (factory(0.5) if name == "constant" else
                                                         factory(1.0, "fan_in", "normal") if name == "variance_scaling" else factory())
        assert init(key, (8, 4), jnp.float32).shape == (8, 4), name


def test_he_normal_statistics_in_a_conv(key):
    conv = ft.nn.Conv2D(16, 32, 3, key=key, weight_initializer=ft.nn.initializers.he_normal())
    fan_in = 3 * 3 * 16
    assert float(jnp.std(conv.weight)) == pytest.approx(np.sqrt(2 / fan_in), rel=0.05)


def test_bias_initializer(key):
    dense = ft.nn.Dense(2, 3, key=key, bias_initializer=ft.nn.initializers.constant(0.1))
    np.testing.assert_allclose(dense.bias, 0.1)
