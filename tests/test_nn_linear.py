"""Dense: reference computation, gradients, initialisation and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def test_matches_reference(key):
    layer = ft.nn.Dense(3, 4, jax.nn.tanh, key=key)
    x = jax.random.normal(jax.random.key(1), (5, 3))
    expected = np.tanh(np.asarray(x) @ np.asarray(layer.weight) + np.asarray(layer.bias))
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_initialisation_is_glorot_uniform_with_zero_bias(key):
    layer = ft.nn.Dense(300, 200, key=key)
    limit = np.sqrt(6 / (300 + 200))
    assert float(jnp.max(jnp.abs(layer.weight))) <= limit
    assert float(jnp.std(layer.weight)) == pytest.approx(limit / np.sqrt(3), rel=0.02)
    assert not jnp.any(layer.bias)


def test_no_bias_custom_initializer_and_dtype(key):
    layer = ft.nn.Dense(2, 3, use_bias=False, key=key, dtype=jnp.bfloat16,
                        weight_initializer=ft.nn.initializers.ones)
    assert layer.bias is None and layer.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(layer(jnp.ones((1, 2), jnp.bfloat16)).astype(jnp.float32), 2.0)


def test_unbatched_and_many_batch_axes(key):
    layer = ft.nn.Dense(3, 2, key=key)
    assert layer(jnp.ones(3)).shape == (2,)
    assert layer(jnp.ones((4, 5, 3))).shape == (4, 5, 2)


def test_gradient_finite_differences(key):
    with jax.enable_x64(True):
        layer = _x64(ft.nn.Dense(3, 2, jax.nn.sigmoid, key=key))
        x = jax.random.normal(jax.random.key(1), (4, 3), jnp.float64)
        check_grads(jax.jit(lambda m, x: m(x)), (layer, x), order=1, modes=["rev"])


def test_wrong_trailing_shape_names_layer_and_shapes(key):
    layer = ft.nn.Dense(2, 4, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense expects inputs \[\.\.\., 2\] \(float\), got f32\[4,3\]"):
        layer(jnp.ones((4, 3)))


def test_wrong_dtype_is_an_error_at_trace_time(key):
    layer = ft.nn.Dense(2, 4, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)got i32\[4,2\].*astype\(jnp.float32\)"):
        jax.jit(layer)(jnp.ones((4, 2), jnp.int32))


def test_repr_and_parameter_view(key):
    layer = ft.nn.Dense(2, 4, jax.nn.relu, key=key)
    assert repr(layer) == "Dense(weight=f32[2,4], bias=f32[4], activation=relu)"
    assert ft.parameters(layer).weight.shape == (2, 4)


def test_a_bfloat16_bias_gradient_over_a_sequence_is_summed_in_float32(key):
    """Dense on [batch, tokens, features]: the bias's gradient sums the cotangent over 32x256
    rows, which XLA:CPU did in bfloat16 (0.50 off the float64 sum; torch's bfloat16 Linear is
    3.8e-3 off). The bias is added in float32 now; a float32 Dense adds as before (no casts)."""
    torch = pytest.importorskip("torch")
    dy = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (32, 256, 16)), jnp.bfloat16)
    dy32 = np.asarray(dy.astype(jnp.float32))
    exact = dy32.astype(np.float64).sum((0, 1))
    module = torch.nn.Linear(4, 16).bfloat16()
    module(torch.ones(32, 256, 4, dtype=torch.bfloat16)).backward(torch.tensor(dy32).bfloat16())
    spread = np.abs(module.bias.grad.float().numpy() - exact).max()  # 16 of 4121: bfloat16's rounding
    layer = ft.cast(ft.nn.Dense(4, 16, key=key), jnp.bfloat16)
    x = jnp.ones((32, 256, 4), jnp.bfloat16)
    grad, = jax.jit(lambda m, dy: jax.vjp(lambda m: m(x), m)[1](dy))(layer, dy)
    assert grad.bias.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad.bias.astype(jnp.float32)), exact, rtol=0, atol=10 * spread)
    program = str(jax.make_jaxpr(ft.nn.Dense(4, 16, key=key))(jnp.ones((2, 3, 4))))
    assert "convert_element_type" not in program


def test_layers_with_no_input_features_build_as_torch_does(key):
    """``Dense(0, 3)`` (torch's ``Linear(0, 3)``: an empty feature set) raised JAX's
    ZeroDivisionError from the zero fan of its variance-scaling initializer; an array of no
    values draws nothing. The output is the bias; a layer with values draws as before."""
    dense = ft.nn.Dense(0, 3, key=key)
    assert dense.weight.shape == (0, 3)
    np.testing.assert_array_equal(dense(np.ones((2, 0), np.float32)), np.zeros((2, 3), np.float32))
    assert ft.nn.Conv2D(0, 4, 3, key=key).weight.shape == (3, 3, 0, 4)
    assert ft.nn.LSTMCell(0, 4, key=key).input_weight.shape == (0, 16)
    np.testing.assert_array_equal(ft.nn.Dense(2, 3, key=key).weight,
                                  jax.nn.initializers.glorot_uniform()(key, (2, 3), jnp.float32))
