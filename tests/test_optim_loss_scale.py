"""Dynamic loss scaling: overflow skips the step and halves the scale; growth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
import functree.optim as fo


def _model():
    return ft.nn.Dense(3, 2, key=jax.random.key(0))


X = jnp.ones((8, 3))


def test_loss_scaling_overflow_skips_and_halves():
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.adam(0.1)), initial_scale=2.0**15, growth_interval=3)
    model = _model()
    state = opt.init(model)
    step = ft.jit(lambda m, s, x: opt.minimize(lambda m, x: jnp.mean(m(x)) * x[0, 0], m, s, x))
    model1, state1, _ = step(model, state, X)
    assert float(state1.scale) == 2.0**15
    big = jnp.full((8, 3), 1e36)
    model2, state2, _ = step(model1, state1, big)
    np.testing.assert_array_equal(model2.weight, model1.weight)
    np.testing.assert_array_equal(model2.bias, model1.bias)
    assert float(state2.scale) == 2.0**14 and int(state2.skipped) == 1
    assert int(fo.context(state2).step) == 1
    np.testing.assert_array_equal(fo.moments(state2)["mu"].weight, fo.moments(state1)["mu"].weight)
    m, s = model2, state2
    for _ in range(3):
        m, s, _ = step(m, s, X)
    assert float(s.scale) == 2.0**15 and int(s.good_steps) == 0


def test_loss_scaling_gives_unscaled_gradients():
    inner = fo.Optimizer(fo.sgd(1.0))
    opt = fo.LossScaleOptimizer(inner, initial_scale=1024.0)
    p = {"w": jnp.zeros(())}
    state = opt.init(p)
    loss, grads = opt.compute_gradients(lambda p: 3.0 * p["w"] + 1.0, p, state=state)
    assert float(grads["w"]) == 3.0 and float(loss) == 1.0
    with pytest.raises(ValueError, match="needs the optimizer state"):
        opt.compute_gradients(lambda p: p["w"], p)
    with pytest.raises(ValueError, match="initial_scale must be positive"):
        fo.LossScaleOptimizer(inner, initial_scale=0.0)


def test_loss_scale_argument_and_state_errors():
    inner = fo.Optimizer(fo.sgd(1.0))
    with pytest.raises(ValueError, match="growth_interval must be positive, got 0"):
        fo.LossScaleOptimizer(inner, growth_interval=0)
    opt = fo.LossScaleOptimizer(inner)
    p = {"w": jnp.zeros(())}
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\.update needs the optimizer state"):
        opt.update(p, inner.init(p), p)


class _Complex(ft.Module):
    z: jax.Array


def test_loss_scaling_keeps_complex_gradients_complex():
    """The unscaling ran in float32, which dropped a complex gradient's imaginary part: the
    scaled step must equal the unscaled one (scale 2**10 is exact in binary)."""
    target = jnp.asarray([0.5 - 0.2j, -0.4j], jnp.complex64)

    def loss(m):
        return jnp.sum(jnp.abs(m.z - target) ** 2)

    model = _Complex(jnp.zeros(2, jnp.complex64))
    plain = fo.Optimizer(fo.sgd(0.1))
    scaled = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)), initial_scale=2.0**10)
    m1, s1 = model, plain.init(model)
    m2, s2 = model, scaled.init(model)
    for _ in range(3):
        m1, s1, _ = plain.minimize(loss, m1, s1)
        m2, s2, _ = scaled.minimize(loss, m2, s2)
    assert m2.z.dtype == jnp.complex64
    np.testing.assert_array_equal(np.asarray(m2.z), np.asarray(m1.z))
    assert float(jnp.abs(m2.z - target).max()) < float(jnp.abs(target).max())


@pytest.mark.parametrize("scale", [8.0, 1024.0, 2.0**15])
def test_the_scale_comes_after_transform_loss_and_reaches_a_gradient_hook(scale):
    """The scale multiplied the loss before the inner optimizer's transform_loss, giving
    grad T(s L) / s (T = l**2: s times too large; w = -183.3 where 0.82 is right), and a
    get_gradients hook saw scaled gradients (per-example clipping at t / s). Now the loss
    scale is applied last: the same step as without it."""
    w = {"w": jnp.ones(())}
    loss = lambda p, x: 3.0 * p["w"] * jnp.mean(x)  # noqa: E731
    squared = fo.Optimizer(fo.sgd(0.01), transform_loss=lambda v: v**2)
    plain, _, _ = squared.minimize(loss, w, squared.init(w), jnp.ones(2))
    scaled_opt = fo.LossScaleOptimizer(squared, initial_scale=scale)
    scaled, _, reported = scaled_opt.minimize(loss, w, scaled_opt.init(w), jnp.ones(2))
    np.testing.assert_allclose(float(plain["w"]), 0.82, rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(scaled["w"]), float(plain["w"]), rtol=0, atol=1e-6)
    assert float(reported) == 3.0  # the loss as the loss function returned it

    clip = fo.Optimizer(fo.sgd(1.0), get_gradients=fo.per_example_clipping(1.0))
    scaled_clip = fo.LossScaleOptimizer(clip, initial_scale=scale)
    x = jnp.array([1.0, 100.0])  # example gradients -1 and -100: both clipped to 1
    by_example = lambda p, x: -(p["w"] * x).mean()  # noqa: E731
    zero = {"w": jnp.zeros(())}
    expected, _, _ = clip.minimize(by_example, zero, clip.init(zero), x)
    got, _, _ = scaled_clip.minimize(by_example, zero, scaled_clip.init(zero), x)
    assert float(expected["w"]) == 1.0 and float(got["w"]) == 1.0


def test_a_hook_without_scale_and_a_hook_beside_transform_loss_are_refused():
    w = {"w": jnp.ones(())}

    def hook(loss_fn, model, *batch, has_aux=False):
        return ft.value_with_gradient(lambda m: loss_fn(m, *batch), at=model, has_aux=has_aux)

    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1), get_gradients=hook))
    with pytest.raises(TypeError, match=r"The get_gradients hook .*hook takes no scale=") as info:
        opt.minimize(lambda p, x: p["w"] * x, w, opt.init(w), jnp.float32(2.0))
    assert "def hook(loss_fn, model, *batch, has_aux=False, scale=None)" in str(info.value)
    unscaled = fo.Optimizer(fo.sgd(0.1), get_gradients=hook)  # without loss scaling the hook is used as it is
    moved, _, _ = unscaled.minimize(lambda p, x: p["w"] * x, w, unscaled.init(w), jnp.float32(2.0))
    np.testing.assert_allclose(float(moved["w"]), 0.8, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"a get_gradients hook computes the gradients itself and would ignore"):
        fo.Optimizer(fo.sgd(0.1), transform_loss=lambda v: v**2, get_gradients=hook)
