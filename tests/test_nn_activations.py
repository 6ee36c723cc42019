"""ft.nn activations: identity plus jax.nn's functions under one namespace."""

import jax
import jax.numpy as jnp
import numpy as np

import functree as ft


def test_identity_and_reexports():
    x = jnp.linspace(-2.0, 2.0, 5)
    assert ft.nn.identity(x) is x
    np.testing.assert_allclose(ft.nn.relu(x), np.maximum(np.asarray(x), 0))
    np.testing.assert_allclose(ft.nn.tanh(x), np.tanh(np.asarray(x)), rtol=1e-5, atol=1e-6)
    assert ft.nn.gelu is jax.nn.gelu and ft.nn.softmax is jax.nn.softmax


def test_activation_is_static_configuration(key):
    layer = ft.nn.Dense(2, 2, ft.nn.leaky_relu, key=key)
    assert jax.tree.leaves(layer) == [layer.weight, layer.bias]
    assert layer(jnp.array([[-1.0, -1.0]])).shape == (1, 2)
