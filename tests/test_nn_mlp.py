"""ft.nn.MLP against Equinox's eqx.nn.MLP (the same weights) and its argument errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def test_mlp_matches_equinox_mlp_with_the_same_weights():
    ref = eqx.nn.MLP(3, 2, width_size=5, depth=2, activation=jax.nn.tanh, final_activation=jax.nn.sigmoid,
                     key=jax.random.key(0))
    mlp = ft.nn.MLP(3, 2, width_size=5, depth=2, activation=jax.nn.tanh, final_activation=jax.nn.sigmoid,
                    key=jax.random.key(1))
    layers = tuple(d.replace(weight=r.weight.T, bias=r.bias) for d, r in zip(mlp.layers, ref.layers))
    mlp = mlp.replace(layers=layers)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_allclose(mlp(x), jax.vmap(ref)(x), rtol=0, atol=1e-6)
    assert [layer.weight.shape for layer in ft.nn.MLP(3, 2, widths=[5, 5], key=jax.random.key(0)).layers] == [
        (3, 5), (5, 5), (5, 2)]
    assert len(ft.nn.MLP(3, 2, depth=0, key=jax.random.key(0)).layers) == 1


def test_mlp_dropout_drops_only_in_training_mode_with_a_key():
    mlp = ft.nn.MLP(4, 4, widths=[64], dropout=0.5, key=jax.random.key(0))
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal(mlp(x), mlp(x, key=jax.random.key(1)))  # inference: no dropout
    train = ft.nn.training(mlp)
    a, b = train(x, key=jax.random.key(1)), train(x, key=jax.random.key(2))
    assert not np.allclose(a, b)
    with pytest.raises(ValueError, match="key"):
        train(x)


def test_mlp_width_arguments_are_checked():
    with pytest.raises(ValueError, match=r"widths=\[\.\.\.\] or as width_size= and depth=") as info:
        ft.nn.MLP(2, 1, 32, key=jax.random.key(0))
    assert "ft.nn.MLP(2, 1, width_size=32, depth=2, key=key)" in str(info.value)
    with pytest.raises(ValueError, match="width_size=None, depth=None"):
        ft.nn.MLP(2, 1, key=jax.random.key(0))
