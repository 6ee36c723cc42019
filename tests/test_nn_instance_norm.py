"""InstanceNorm1D/2D/3D against torch (affine, track_running_stats, training and inference,
running statistics), its state dict port both ways; LocalResponseNorm against torch; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads

import functree as ft


def _torch_layout(x):
    return torch.from_numpy(np.moveaxis(np.asarray(x), -1, 1).copy())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_torch_in_both_modes_with_its_state_dict(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, *(4, 3, 2)[:n], 5)) * 2 + 1
    with jax.enable_x64(True):
        for affine, track in ((True, True), (False, True), (True, False), (False, False)):
            module = getattr(torch.nn, f"InstanceNorm{n}d")(5, affine=affine, track_running_stats=track).double()
            with torch.no_grad():
                for tensor in (*module.parameters(), *(() if not track else (module.running_mean,))):
                    tensor.uniform_()
                if track:
                    module.running_var.uniform_(0.5, 2.0)
            layer = getattr(ft.nn, f"InstanceNorm{n}D")(5, affine=affine, track_running_stats=track, dtype=jnp.float64)
            layer = ft.nn.load_torch_state_dict(layer, module.state_dict())  # num_batches_tracked dropped
            written = ft.nn.torch_state_dict(layer)
            assert sorted(written) == sorted(k for k in module.state_dict() if k != "num_batches_tracked")
            for name, value in written.items():
                np.testing.assert_array_equal(value, module.state_dict()[name].numpy())
            y, updates = ft.nn.collect_state(lambda m: m(jnp.asarray(x)), ft.nn.training(layer))
            expected = module.train()(_torch_layout(x)).detach().numpy()
            np.testing.assert_allclose(y, np.moveaxis(expected, 1, -1), rtol=0, atol=1e-14)  # measured 1.8e-15
            layer = ft.nn.apply_state(layer, updates)
            if track:
                np.testing.assert_allclose(layer.running_mean, module.running_mean.numpy(), rtol=0, atol=1e-15)
                np.testing.assert_allclose(layer.running_variance, module.running_var.numpy(), rtol=0, atol=1e-14)
            expected = module.eval()(_torch_layout(x)).detach().numpy()
            np.testing.assert_allclose(layer(jnp.asarray(x)), np.moveaxis(expected, 1, -1), rtol=0, atol=1e-14)


def test_unbatched_bfloat16_gradient_and_jit():
    norm = ft.nn.InstanceNorm2D(2, affine=True)
    x = jax.random.normal(jax.random.key(0), (3, 4, 2))  # no batch axis: one instance
    np.testing.assert_allclose(jnp.mean(norm(x), axis=(0, 1)), 0.0, atol=1e-6)
    assert norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    check_grads(norm, (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(jax.jit(norm)(x), norm(x), rtol=0, atol=1e-6)


def test_one_position_is_refused():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)2 positions or more.*Expected more than 1 spatial element"):
        ft.nn.InstanceNorm2D(3)(jnp.ones((2, 1, 1, 3)))


def test_channels_first_input_names_the_move():
    with pytest.raises(ft.nn.LayerInputError, match=r"jnp.moveaxis\(x, -3, -1\)"):
        ft.nn.InstanceNorm2D(3)(jnp.ones((2, 3, 4, 5)))


def test_parameter_view_is_refused_with_running_statistics():
    norm = ft.nn.InstanceNorm1D(2, track_running_stats=True)
    with pytest.raises(TypeError, match=r"running_mean"):
        ft.parameters(norm)(jnp.ones((1, 3, 2)))


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_local_response_norm_matches_torch(size):
    x = np.random.default_rng(size).standard_normal((2, 3, 4, 7)).astype(np.float32) * 3
    y = ft.nn.LocalResponseNorm(size, alpha=1e-2, beta=0.8, k=1.5)(jnp.asarray(x))
    expected = torch.nn.LocalResponseNorm(size, 1e-2, 0.8, 1.5)(_torch_layout(x)).numpy()
    np.testing.assert_allclose(y, np.moveaxis(expected, 1, -1), rtol=0, atol=1e-6)  # measured 2.4e-7 (|y| ~ 8): 4x


def test_local_response_norm_refuses_a_bad_size():
    with pytest.raises(ValueError, match=r"size=0; it is an int >= 1"):
        ft.nn.LocalResponseNorm(0)


@pytest.mark.parametrize("track", [False, True])
def test_an_ensembles_instance_norm_called_outside_vmap_is_refused(track):
    # scale [3, 4] on x [2, 3, 4] (3 positions): position i scaled by model i's, silently
    norms = jax.vmap(lambda s: ft.nn.InstanceNorm1D(4, affine=True, track_running_stats=track).replace(scale=s))(
        jnp.arange(1.0, 13.0).reshape(3, 4))
    x = jnp.arange(24.0).reshape(2, 3, 4)
    with pytest.raises(ft.nn.LayerInputError, match=r"InstanceNorm1D holds scale f32\[3,4\], but one "
                                                    r"InstanceNorm1D's scale has 1 axis"):
        norms(x)
    right = jax.vmap(lambda m: m(x))(norms)       # the fix
    one = ft.nn.InstanceNorm1D(4, affine=True, track_running_stats=track).replace(scale=norms.scale[2])
    np.testing.assert_allclose(right[2], one(x), rtol=1e-6, atol=1e-5)
