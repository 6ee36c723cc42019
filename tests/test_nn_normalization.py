"""LayerNorm and BatchNorm: references, running statistics, gradients, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def test_layer_norm_matches_reference():
    ln = ft.nn.LayerNorm((3, 4), epsilon=1e-5)
    ln = ln.replace(scale=jnp.arange(12.0).reshape(3, 4), offset=jnp.ones((3, 4)))
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 4)))
    mean = x.mean(axis=(1, 2), keepdims=True)
    var = x.var(axis=(1, 2), keepdims=True)
    expected = (x - mean) / np.sqrt(var + 1e-5) * np.arange(12.0).reshape(3, 4) + 1
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-5)


def test_layer_norm_without_scale_and_offset():
    ln = ft.nn.LayerNorm(4, use_scale=False, use_offset=False)
    assert ln.scale is None and ln.offset is None and ft.to_flat_dict(ln) == {}
    y = ln(jax.random.normal(jax.random.key(0), (3, 4)))
    np.testing.assert_allclose(jnp.mean(y, -1), 0, atol=1e-6)


def test_layer_norm_gradient_and_error():
    with jax.enable_x64(True):
        ln = _x64(ft.nn.LayerNorm(3))
        ln = ln.replace(scale=jnp.array([1.0, 2.0, 3.0]))
        check_grads(jax.jit(lambda m, x: m(x)), (ln, jax.random.normal(jax.random.key(0), (2, 3), jnp.float64)),
                    order=1, modes=["rev"])
    with pytest.raises(ft.nn.LayerInputError, match=r"LayerNorm expects inputs \[\.\.\., 3\] \(float\), got f32\[2,4\]"):
        ft.nn.LayerNorm(3)(jnp.ones((2, 4)))


def test_batch_norm_training_matches_reference_and_records_statistics():
    bn = ft.nn.BatchNorm(3, momentum=0.9, epsilon=1e-3)
    bn = bn.replace(scale=jnp.array([1.0, 2.0, 3.0]), offset=jnp.array([0.0, 1.0, -1.0]))
    x = np.asarray(jax.random.normal(jax.random.key(0), (4, 5, 3))) * 2 + 1
    y, updates = ft.nn.collect_state(lambda m: m(x), ft.nn.training(bn))
    mean, var = x.mean(axis=(0, 1)), x.var(axis=(0, 1))
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-3) * [1, 2, 3] + [0, 1, -1], rtol=1e-4, atol=1e-4)
    new = ft.nn.apply_state(bn, updates)
    np.testing.assert_allclose(new.running_mean, 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(new.running_variance, 0.9 + 0.1 * var, rtol=1e-5)
    assert set(map(str, updates)) == {".running_mean", ".running_variance"}


def test_batch_norm_inference_uses_running_statistics():
    bn = ft.nn.BatchNorm(2, epsilon=0.0).replace(
        running_mean=jnp.array([1.0, -1.0]), running_variance=jnp.array([4.0, 0.25]))
    x = jnp.array([[3.0, 0.0]])
    np.testing.assert_allclose(bn(x), [[1.0, 2.0]], rtol=1e-6)
    _y, updates = ft.nn.collect_state(lambda m: m(x), bn)
    assert updates == {}


def test_batch_norm_other_axis():
    bn = ft.nn.training(ft.nn.BatchNorm(3, axis=1))
    x = jax.random.normal(jax.random.key(0), (4, 3, 5))
    y, _ = ft.nn.collect_state(lambda m: m(x), bn)
    np.testing.assert_allclose(jnp.mean(y, axis=(0, 2)), 0, atol=1e-5)
    with pytest.raises(ft.nn.LayerInputError, match=r"BatchNorm expects inputs with 3 features at axis 1 \(float\), got f32\[4,2,5\]"):
        ft.nn.inference(bn)(jnp.ones((4, 2, 5)))


def test_running_statistics_are_not_parameters():
    bn = ft.nn.BatchNorm(2)
    view = ft.parameters(bn)
    assert view.running_mean is None and view.running_variance is None
    x = jnp.array([[1.0, 2.0], [3.0, 5.0]])
    grads = ft.gradient(lambda m: jnp.sum(ft.nn.collect_state(lambda t: t(x), ft.nn.training(m))[0] ** 3), at=bn)
    assert grads.running_mean is None and grads.scale.shape == (2,)


def test_batch_norm_training_gradient_finite_differences():
    with jax.enable_x64(True):
        bn = _x64(ft.nn.training(ft.nn.BatchNorm(2)))
        bn = bn.replace(scale=jnp.array([1.5, 0.5]), offset=jnp.array([0.1, 0.2]))
        x = jax.random.normal(jax.random.key(0), (4, 2), jnp.float64)
        check_grads(jax.jit(lambda m, x: jnp.sum(jnp.sin(ft.nn.collect_state(lambda t: t(x), m)[0]))), (bn, x),
                    order=1, modes=["rev"])


def test_batch_norm_wrong_features_is_an_error():
    with pytest.raises(ft.nn.LayerInputError, match=r"BatchNorm expects inputs \[\.\.\., 3\] \(float\), got f32\[8,2\]"):
        ft.nn.BatchNorm(3)(jnp.ones((8, 2)))
