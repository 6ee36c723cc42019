"""ft.nn activations: identity plus jax.nn's functions under one namespace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_activation_none_is_no_activation_and_a_name_is_refused_when_built():
    """Keras's activation=None (none) was called at the first step ("'NoneType' object is
    not callable"), as was a name ("relu": "'str' object is not callable"): None is the
    identity now, and a name is refused when the layer is built, with the function to pass."""
    key = jax.random.key(0)
    x = jnp.ones((2, 3))
    plain = ft.nn.Dense(3, 4, key=key)
    np.testing.assert_array_equal(ft.nn.Dense(3, 4, None, key=key)(x), plain(x))
    assert ft.nn.Conv1D(3, 4, 2, activation=None, key=key).activation is ft.nn.identity
    mlp = ft.nn.MLP(3, 1, widths=[4], activation=None, final_activation=None, key=key)
    assert mlp.activation is ft.nn.identity and mlp.final_activation is ft.nn.identity
    for given, right in [("relu", r"activation=ft\.nn\.relu\)"), ("linear", r"activation=None\)"),
                         ("gelu", r"activation=ft\.nn\.gelu_exact\)   # the exact GELU"), (3, r"activation=ft\.nn\.relu\)")]:
        with pytest.raises(ValueError, match=rf"(?s)Dense: activation must be a function .* got {given!r}.*right: .*{right}"):
            ft.nn.Dense(3, 4, given, key=key)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"MLP: final_activation must be a function"):
        ft.nn.MLP(3, 1, widths=[4], final_activation="sigmoid", key=key)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"Conv2D: activation must be a function"):
        ft.nn.Conv2D(3, 4, 2, activation="relu", key=key)  # pyright: ignore[reportArgumentType]
    # the transformer layers take torch's two names and otherwise the same rule
    assert ft.nn.TransformerEncoderLayer(8, 2, 16, activation=None, key=key).activation is ft.nn.identity
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer: activation must be a function"):
        ft.nn.TransformerEncoderLayer(8, 2, 16, activation=3, key=key)  # pyright: ignore[reportArgumentType]
