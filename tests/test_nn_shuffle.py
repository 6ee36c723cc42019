"""PixelShuffle, PixelUnshuffle, ChannelShuffle, Unflatten against torch; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functree as ft


def _torch_layout(x):
    return torch.from_numpy(np.moveaxis(x, -1, 1).copy())


def test_pixel_and_channel_shuffles_match_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 2, 18)).astype(np.float32)
    y = ft.nn.PixelShuffle(3)(jnp.asarray(x))
    np.testing.assert_array_equal(y, np.moveaxis(torch.nn.PixelShuffle(3)(_torch_layout(x)).numpy(), 1, -1))
    np.testing.assert_array_equal(ft.nn.PixelUnshuffle(3)(y), x)  # the inverse
    x = rng.standard_normal((2, 4, 6, 3)).astype(np.float32)
    expected = np.moveaxis(torch.nn.PixelUnshuffle(2)(_torch_layout(x)).numpy(), 1, -1)
    np.testing.assert_array_equal(ft.nn.PixelUnshuffle(2)(jnp.asarray(x)), expected)
    x = rng.standard_normal((3, 2, 5, 6)).astype(np.float32)  # two leading axes, 6 channels
    expected = np.moveaxis(torch.nn.ChannelShuffle(3)(_torch_layout(x.reshape(6, 5, 6))).numpy(), 1, -1)
    np.testing.assert_array_equal(jax.jit(ft.nn.ChannelShuffle(3))(jnp.asarray(x)).reshape(6, 5, 6), expected)


def test_unflatten_matches_torch_with_an_inferred_size():
    x = np.arange(2 * 12 * 3, dtype=np.float32).reshape(2, 12, 3)
    expected = torch.nn.Unflatten(1, (2, -1, 3))(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(ft.nn.Unflatten(1, (2, -1, 3))(jnp.asarray(x)), expected)
    assert ft.nn.Unflatten(-1, (3, 1))(jnp.ones((2, 3))).shape == (2, 3, 1)


@pytest.mark.parametrize("make,match", [
    (lambda: ft.nn.PixelShuffle(0), r"upscale_factor=0; it is an int >= 1"),
    (lambda: ft.nn.PixelUnshuffle(1.5), r"downscale_factor=1.5"),  # pyright: ignore[reportArgumentType]
    (lambda: ft.nn.ChannelShuffle(-2), r"groups=-2"),
    (lambda: ft.nn.Unflatten(0, (2, -1, -1)), r"at most one -1"),
    (lambda: ft.nn.Unflatten(0, "ab"), r"shape='ab'"),  # pyright: ignore[reportArgumentType]
])
def test_bad_arguments_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("layer,shape,match", [
    (ft.nn.PixelShuffle(2), (1, 2, 2, 6), r"channels \(6\) is not a multiple of 4.*\[\.\.\., H, W, C \* 4\]"),
    (ft.nn.PixelUnshuffle(2), (1, 3, 4, 1), r"height \(3\) is not a multiple of 2"),
    (ft.nn.ChannelShuffle(4), (2, 6), r"channels \(6\) is not a multiple of 4"),
    (ft.nn.Unflatten(-1, (4, 2)), (2, 6), r"does not split into \(4, 2\): their product is 8"),
    (ft.nn.Unflatten(-1, (4, -1)), (2, 6), r"6 is not a multiple of 4"),
    (ft.nn.Unflatten(2, (1, 1)), (2, 6), r"axis 2 is outside an input of 2 axes.*Unflatten\(-1, \(1, 1\)\)"),
])
def test_bad_inputs_are_refused(layer, shape, match):
    with pytest.raises(ft.nn.LayerInputError, match=f"(?s){match}"):
        layer(jnp.ones(shape))
