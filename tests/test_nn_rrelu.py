"""ft.nn.RReLU against torch's nn.RReLU: inference outputs and gradients exactly (float64);
training's slopes by their distribution, and its gradient against torch's backward given the
same slopes (``aten.rrelu_with_noise_backward``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn._rrelu import BAD_BOUNDS, NO_KEY
from tests._errors import raises_named

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("lower, upper", [(1 / 8, 1 / 3), (0.0, 0.5), (0.2, 0.2)])
def test_inference_matches_torchs_eval_in_float64(lower, upper):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5))
    x.flat[0] = 0.0  # torch's gradient at 0 is the slope
    xt = torch.from_numpy(x).requires_grad_()
    yt = torch.nn.RReLU(lower, upper).eval()(xt)
    yt.backward(torch.from_numpy(np.cos(yt.detach().numpy())))
    with jax.enable_x64(True):
        y, pull = jax.vjp(ft.nn.RReLU(lower, upper), jnp.asarray(x))
        (gx,) = pull(jnp.cos(y))
        assert y.dtype == jnp.float64
    np.testing.assert_array_equal(y, yt.detach().numpy())       # one multiply: bit for bit
    np.testing.assert_array_equal(gx, xt.grad.numpy())


def test_training_slopes_are_uniform_in_the_range():
    """Each negative element scaled by its own slope in [lower, upper], positives unchanged.

    The mean of n = 200000 U[l, u] slopes has standard deviation (u - l) / sqrt(12 n) = 1.3e-4
    (l, u = 1/8, 1/3); the bound 6 of them (4.0e-4, a false failure below 2e-9; the key is fixed
    anyway). The variance's estimate has relative standard deviation sqrt(0.8 / n) = 0.2%: 2%
    is 10 of them. The extremes lie within (u - l) 1e-4 of the ends (a miss: e^-20 each)."""
    lower, upper, n = 1 / 8, 1 / 3, 200_000
    act = ft.nn.training(ft.nn.RReLU(lower, upper))
    with jax.enable_x64(True):
        x = -jnp.exp(jax.random.normal(jax.random.key(1), (n,), jnp.float64))  # negatives of every size
        slopes = np.asarray(act(x, key=jax.random.key(2)) / x)
        positives = jnp.abs(x)
        np.testing.assert_array_equal(act(positives, key=jax.random.key(2)), positives)
    assert lower <= slopes.min() and slopes.max() <= upper
    assert slopes.min() - lower < (upper - lower) * 1e-4 and upper - slopes.max() < (upper - lower) * 1e-4
    assert abs(slopes.mean() - (lower + upper) / 2) < 6 * (upper - lower) / np.sqrt(12 * n)
    assert abs(slopes.var() / ((upper - lower) ** 2 / 12) - 1) < 0.02
    assert len(np.unique(slopes)) > n * 0.99  # a slope per element, not one shared


def test_training_gradient_is_the_drawn_slope_as_torchs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 7))
    x.flat[:3] = 0.0  # torch draws a slope at 0 too: its gradient there is the slope
    act = ft.nn.training(ft.nn.RReLU(0.1, 0.4))
    key = jax.random.key(4)
    with jax.enable_x64(True):
        y, pull = jax.vjp(lambda v: act(v, key=key), jnp.asarray(x))
        cotangent = jnp.cos(jnp.arange(x.size, dtype=jnp.float64)).reshape(x.shape)
        (gx,) = pull(cotangent)
        # the slopes drawn: the same key's draws, read from the negatives' outputs
        drawn = np.asarray(jax.random.uniform(key, x.shape, jnp.float64, 0.1, 0.4))
    noise = np.where(x > 0, 1.0, drawn)  # torch's noise tensor: 1 at the positives
    np.testing.assert_array_equal(y, x * noise)
    expected = torch.ops.aten.rrelu_with_noise_backward(
        torch.from_numpy(np.array(cotangent)), torch.from_numpy(x), torch.from_numpy(noise), 0.1, 0.4, True, False)
    np.testing.assert_array_equal(gx, expected.numpy())


def test_training_is_the_same_under_jit_and_float32_stays_float32():
    act = ft.nn.training(ft.nn.RReLU())
    x = -jnp.ones((3, 4))
    key = jax.random.key(0)
    eager = act(x, key=key)
    np.testing.assert_array_equal(ft.jit(lambda m, x, k: m(x, key=k))(act, x, key), eager)
    assert eager.dtype == jnp.float32
    assert not bool((eager == eager[0, 0]).all())


def test_errors_name_the_fix():
    raises_named(lambda: ft.nn.RReLU(0.5, 0.1), ValueError, BAD_BOUNDS, "ft.nn.RReLU(lower=1 / 8, upper=1 / 3)")
    raises_named(lambda: ft.nn.RReLU(-0.1, 0.1), ValueError, BAD_BOUNDS, "lower=-0.1")
    raises_named(lambda: ft.nn.RReLU(float("nan")), ValueError, BAD_BOUNDS, "lower=nan")
    raises_named(lambda: ft.nn.training(ft.nn.RReLU())(jnp.ones(2)), ValueError, NO_KEY,
                 "model(x, key=jax.random.key(step))")
    with pytest.raises(ft.nn.LayerInputError):
        ft.nn.RReLU()(jnp.arange(3))  # integers: torch refuses them too
    # no parameters, and the repr names the range
    assert ft.to_flat_dict(ft.parameters(ft.nn.RReLU())) == {}
    assert ft.nn.torch_state_dict(ft.nn.RReLU(), numpy=True) == {}
