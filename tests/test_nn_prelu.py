"""ft.nn.PReLU against torch's nn.PReLU: outputs and gradients (input and slope) in float64,
one slope or one per channel (channels last, or torch's axis 1), the state dict both ways."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("num_parameters, shape, channel_axis, to_torch", [
    (1, (4, 3, 5), -1, None),
    (3, (4, 3), -1, None),                    # [N, C]: the last axis is torch's axis 1
    (5, (4, 3, 5), -1, (0, 2, 1)),            # channels last; torch's input channels first
    (3, (4, 3, 2, 2), 1, None),               # channel_axis=1: torch's layout
])
def test_prelu_matches_torchs_in_float64(num_parameters, shape, channel_axis, to_torch):
    rng = np.random.default_rng(num_parameters)
    module = torch.nn.PReLU(num_parameters, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, num_parameters)))
    x = rng.standard_normal(shape)
    x.flat[0] = 0.0  # torch's gradient at 0 is the slope's
    xt = torch.from_numpy(x if to_torch is None else x.transpose(to_torch)).requires_grad_()
    yt = module(xt)
    yt.backward(torch.from_numpy(np.cos(yt.detach().numpy())))
    with jax.enable_x64(True):
        layer = ft.nn.load_torch_state_dict(ft.nn.PReLU(num_parameters, channel_axis=channel_axis,
                                                        dtype=jnp.float64), module.state_dict())
        y, pull = jax.vjp(lambda m, x: m(x), layer, jnp.asarray(x))
        back = tuple(to_torch) if to_torch is not None else None
        expected = yt.detach().numpy() if back is None else yt.detach().numpy().transpose(np.argsort(back))
        np.testing.assert_allclose(y, expected, rtol=0, atol=1e-15)
        grad_layer, grad_x = pull(jnp.cos(y))
    gx = xt.grad.numpy() if back is None else xt.grad.numpy().transpose(np.argsort(back))
    np.testing.assert_allclose(grad_x, gx, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(grad_layer.slope, module.weight.grad.numpy(), rtol=1e-12, atol=1e-13)
    assert set(ft.nn.torch_state_dict(layer, numpy=True)) == {"weight"}


def test_prelu_refuses_other_channel_counts():
    with pytest.raises(ft.nn.LayerInputError, match=r"\[\.\.\., 3\] on axis -1 \(float\), got f32\[2,4\]"):
        ft.nn.PReLU(3)(jnp.ones((2, 4)))
    np.testing.assert_array_equal(ft.nn.PReLU()(jnp.array([-4.0, 2.0])), [-1.0, 2.0])  # init 0.25


def test_one_slope_keeps_a_scalar_a_scalar():
    """One slope was a [1] array, broadcasting a scalar input to [1]; torch's keeps it []."""
    act = ft.nn.PReLU(init=0.5)
    assert act(jnp.asarray(-2.0)).shape == ()
    assert float(act(jnp.asarray(-2.0))) == float(torch.nn.PReLU(init=0.5)(torch.tensor(-2.0)).detach())


@pytest.mark.parametrize("num_parameters", [0, -1, 2.0, True])
def test_a_slope_count_that_is_no_positive_int_is_a_named_error(num_parameters):
    """PReLU(0) failed at its call inside jnp's reshape ("cannot reshape array of shape (0,)"),
    PReLU(-1) inside jnp.full; a count computed with `/` (2.0) was operator.index's TypeError."""
    from functree.nn._prelu import BAD_NUM_PARAMETERS

    with pytest.raises(ValueError) as caught:
        ft.nn.PReLU(num_parameters)(jnp.ones((2, 3)))
    assert str(caught.value) == BAD_NUM_PARAMETERS.format(given=num_parameters)
    assert "int >= 1" in str(caught.value) and "ft.nn.PReLU(1)" in str(caught.value)
    assert ft.nn.PReLU(np.int64(3)).slope.shape == (3,)  # NumPy ints are ints


def test_an_ensembles_prelu_called_outside_vmap_is_refused():
    # 3 one-slope PReLUs ([3, 1]) on x [2, 3]: read as one slope per channel, channel i given
    # model i's, silently; 3 of 3 slopes failed in JAX's reshape
    prelus = jax.vmap(lambda s: ft.nn.PReLU(1, init=s))(jnp.array([0.1, 0.2, 0.3]))
    x = -jnp.ones((2, 3))
    with pytest.raises(ft.nn.LayerInputError, match=r"PReLU holds slope f32\[3,1\], but one PReLU's slope has 1 "
                                                    r"axis(.|\n)*jax.vmap\(lambda m: m\(x\)\)\(models\)"):
        prelus(x)
    np.testing.assert_allclose(jax.vmap(lambda m: m(x))(prelus)[2], jnp.full((2, 3), -0.3), rtol=1e-6)  # the fix
