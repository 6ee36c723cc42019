"""Pooling and Flatten against numpy window loops; gradients; input errors."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _pool_reference(x, size, strides, op):
    x = np.asarray(x)
    n = len(size)
    out_shape = [(x.shape[1 + d] - size[d]) // strides[d] + 1 for d in range(n)]
    y = np.zeros((x.shape[0], *out_shape, x.shape[-1]))
    for pos in itertools.product(*map(range, out_shape)):
        window = tuple(slice(p * s, p * s + k) for p, s, k in zip(pos, strides, size))
        y[(slice(None), *pos)] = op(x[(slice(None), *window)], axis=tuple(range(1, n + 1)))
    return y


@pytest.mark.parametrize(
    "cls,op,size,strides,shape",
    [
        (ft.nn.MaxPool1D, np.max, (3,), (2,), (2, 9, 3)),
        (ft.nn.AvgPool1D, np.mean, (2,), (2,), (2, 8, 3)),
        (ft.nn.MaxPool2D, np.max, (2, 3), (2, 1), (2, 6, 7, 3)),
        (ft.nn.AvgPool2D, np.mean, (2, 2), (1, 2), (2, 5, 6, 3)),
    ],
)
def test_window_pooling_matches_loops(cls, op, size, strides, shape):
    x = jax.random.normal(jax.random.key(1), shape)
    layer = cls(size, strides)
    np.testing.assert_allclose(layer(x), _pool_reference(x, size, strides, op), rtol=1e-5, atol=1e-6)


def test_strides_default_to_pool_size_and_unbatched():
    assert ft.nn.MaxPool2D(2)(jnp.ones((6, 6, 1))).shape == (3, 3, 1)
    assert ft.nn.AvgPool1D(3)(jnp.ones((4, 2, 9, 1))).shape == (4, 2, 3, 1)


def test_same_average_divides_by_real_elements():
    x = jnp.arange(1.0, 6.0).reshape(1, 5, 1)
    y = ft.nn.AvgPool1D(2, padding="same")(x)
    # windows [1, 2], [3, 4], [5] (the padded element is not counted)
    np.testing.assert_allclose(y.ravel(), [1.5, 3.5, 5.0])


@pytest.mark.parametrize(
    "cls,op,shape",
    [
        (ft.nn.GlobalMaxPool1D, np.max, (2, 5, 3)),
        (ft.nn.GlobalAvgPool1D, np.mean, (2, 5, 3)),
        (ft.nn.GlobalMaxPool2D, np.max, (2, 4, 5, 3)),
        (ft.nn.GlobalAvgPool2D, np.mean, (2, 4, 5, 3)),
    ],
)
def test_global_pooling(cls, op, shape):
    x = jax.random.normal(jax.random.key(1), shape)
    axes = tuple(range(1, len(shape) - 1))
    np.testing.assert_allclose(cls()(x), op(np.asarray(x), axis=axes), rtol=1e-5, atol=1e-6)


def test_flatten():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(ft.nn.Flatten()(x), np.arange(24.0).reshape(2, 12))
    assert ft.nn.Flatten(batch_dims=2)(jnp.ones((2, 3, 4, 5))).shape == (2, 3, 20)


def test_flatten_of_no_rows():
    # issue 27: an empty minibatch gave ZeroDivisionError (reshape to -1 of 0 elements)
    assert ft.nn.Flatten()(jnp.ones((0, 3, 4))).shape == (0, 12)
    assert ft.nn.Flatten(batch_dims=2)(jnp.ones((2, 0, 4, 5))).shape == (2, 0, 20)
    assert jax.jit(ft.nn.Flatten())(jnp.ones((0, 7))).shape == (0, 7)


@pytest.mark.parametrize("layer", [ft.nn.MaxPool2D(2), ft.nn.AvgPool2D(2, padding="SAME"), ft.nn.GlobalAvgPool2D()])
def test_gradients_finite_differences(layer):
    with jax.enable_x64(True):
        # distinct values so max pooling is differentiable at the test point
        x = jax.random.permutation(jax.random.key(1), jnp.arange(1.0, 1.0 + 2 * 5 * 5 * 2, dtype=jnp.float64))
        check_grads(jax.jit(layer), (x.reshape(2, 5, 5, 2) / 7.0,), order=1, modes=["rev"])


def test_missing_spatial_axis_is_an_error():
    with pytest.raises(ft.nn.LayerInputError, match=r"MaxPool2D expects inputs \[\.\.\., height, width, channels\] \(float\), got f32\[4,4\]"):
        ft.nn.MaxPool2D(2)(jnp.ones((4, 4)))


@pytest.mark.parametrize("layer,op,size,length", [
    (ft.nn.MaxPool1D(3), "max_pool1d", 3, 2), (ft.nn.MaxPool1D(3), "max_pool1d", 3, 3),
    (ft.nn.AvgPool1D(4, 1), "avg_pool1d", 4, 3), (ft.nn.AvgPool1D(4, 1), "avg_pool1d", 4, 4),
])
def test_a_pool_longer_than_the_input_is_refused_as_torch_does(layer, op, size, length):
    """MaxPool1D(3) on length 2 gave shape (1, 0, 2) (then NaN through a mean); torch raises."""
    torch = pytest.importorskip("torch")
    x = np.ones((1, length, 2), np.float32)
    pool = getattr(torch.nn.functional, op)
    try:
        expected = pool(torch.tensor(x).transpose(1, 2), size, layer.strides[0]).transpose(1, 2).numpy()
    except RuntimeError as e:
        assert re.search("Output size is too small|Invalid computed output size: 0", str(e)), e
        with pytest.raises(ft.nn.LayerInputError, match=rf"with length >= {size}, got f32\[1,{length},2\]") as info:
            jax.jit(layer)(jnp.asarray(x))
        assert f'right:  {type(layer).__name__}(..., pool_size={size}, padding="SAME")' in str(info.value)
    else:
        np.testing.assert_allclose(layer(jnp.asarray(x)), expected, rtol=0, atol=1e-6)


def test_pool2d_names_the_short_axis_and_same_padding_still_fits():
    with pytest.raises(ft.nn.LayerInputError, match=r"with width >= 3(.|\n)*Its width \(2\)"):
        ft.nn.AvgPool2D((2, 3))(jnp.ones((1, 4, 2, 2)))
    assert ft.nn.AvgPool2D((2, 3), padding="SAME")(jnp.ones((1, 4, 2, 2))).shape == (1, 2, 1, 2)



@pytest.mark.parametrize("layer,size,window,padding", [
    (ft.nn.AvgPool2D(32), (64, 64), 32, 0),
    # "SAME" pads 100 each side: windows of 200 and 300 real elements, torch's count_include_pad=False
    (ft.nn.AvgPool1D(300, padding="SAME"), (1000,), 300, 100),
])
def test_a_bfloat16_average_sums_and_counts_in_float32(layer, size, window, padding):
    """AvgPool summed each window (and counted a "SAME" window's elements) in bfloat16, where
    a sum of values near 1 stops growing at 512: AvgPool2D(32) of values in [0.5, 1.5) gave about
    0.5 for 1.0 and AvgPool1D(300, "SAME") was 0.22 off, where torch's bfloat16 avg_pool is 3.7e-3
    off the float64 mean (its result's rounding)."""
    torch = pytest.importorskip("torch")
    pool = getattr(torch.nn.functional, f"avg_pool{len(size)}d")
    x = torch.tensor(np.random.default_rng(0).uniform(0.5, 1.5, (2, 3, *size)), dtype=torch.bfloat16)
    exact = pool(x.double(), window, padding=padding, count_include_pad=False).numpy()
    spread = np.abs(pool(x, window, padding=padding, count_include_pad=False).double().numpy() - exact).max()
    y = layer(jnp.moveaxis(jnp.asarray(x.float().numpy()), 1, -1).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.moveaxis(np.asarray(y.astype(jnp.float32)), -1, 1), exact, rtol=0, atol=10 * spread)


@pytest.mark.parametrize("layer,shape,axis", [(ft.nn.GlobalMaxPool1D(), (2, 0, 3), "length"),
                                              (ft.nn.GlobalMaxPool2D(), (2, 4, 0, 3), "width")])
def test_a_global_max_over_an_empty_axis_is_refused_naming_the_layer(layer, shape, axis):
    """jnp.max raised "zero-size array to reduction operation max which has no identity",
    naming no layer; torch's AdaptiveMaxPool refuses too."""
    with pytest.raises(ft.nn.LayerInputError, match=rf"{type(layer).__name__} expects .* with {axis} >= 1(.|\n)*"
                       rf"Its {axis} is empty"):
        layer(np.ones(shape, np.float32))
    assert layer(np.ones((2, *(1,) * (len(shape) - 2), 3), np.float32)).shape == (2, 3)


@pytest.mark.parametrize("make,torch_make", [
    (lambda: ft.nn.MaxPool2D(3, 2, 1), lambda nn: nn.MaxPool2d(3, 2, 1)),  # ResNet's stem
    (lambda: ft.nn.AvgPool2D(3, 2, 1), lambda nn: nn.AvgPool2d(3, 2, 1)),
    (lambda: ft.nn.AvgPool2D(3, 2, 1, count_include_pad=False), lambda nn: nn.AvgPool2d(3, 2, 1, count_include_pad=False)),
    (lambda: ft.nn.MaxPool1D(4, 3, ((2, 1),)), lambda nn: lambda x: nn.MaxPool1d(4, 3)(
        nn.functional.pad(x, (2, 1), value=-float("inf")))),
])
def test_int_padding_is_torchs_padding(make, torch_make):
    """Pooling padded by name only ("pooling pads by name"): torch's MaxPool2d(3, 2, padding=1)
    had no port but jnp.pad, and "SAME" pads (0, 1) at stride 2 on an even size (other windows,
    0.8 off here). An int or pairs pad now as torch's: -inf for max, zeros counted in the mean
    unless count_include_pad=False."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
    layer = make()
    if layer._rank == 1:
        x = x[:, 0]
    expected = np.moveaxis(torch_make(torch.nn)(torch.tensor(np.moveaxis(x, -1, 1))).numpy(), 1, -1)
    np.testing.assert_allclose(layer(x), expected, rtol=0, atol=1e-6 * float(np.abs(expected).max()))


def test_a_pad_over_half_the_pool_is_refused_as_torch_does():
    """A window could lie wholly in it (-inf, 0 or NaN); torch: "pad should be at most half"."""
    with pytest.raises(ValueError, match=r"MaxPool2D: padding=2 is more than half the pool \(3\)(.|\n)*"
                       r"right:  MaxPool2D\(3, padding=1\)"):
        ft.nn.MaxPool2D(3, 1, 2)
    assert ft.nn.AvgPool1D(4, 1, ((2, 2),)).padding == ((2, 2),)


def _against_torch(layer, torch_pool, x, atol):
    """``layer`` on channels-last ``x`` and ``torch_pool`` on it channels-first: outputs and input
    gradients (of one random cotangent), float32, within ``atol`` times their magnitude."""
    torch = pytest.importorskip("torch")
    xt = torch.tensor(np.moveaxis(x, -1, 1), requires_grad=True)
    yt = torch_pool(xt)
    expected = np.moveaxis(yt.detach().numpy(), 1, -1)
    g = np.random.default_rng(2).normal(size=expected.shape).astype(np.float32)
    y, vjp = jax.vjp(jax.jit(layer), jnp.asarray(x))
    (grad,) = vjp(jnp.asarray(g))
    yt.backward(torch.tensor(np.moveaxis(g, -1, 1)))
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=0, atol=atol * max(1.0, float(np.abs(expected).max())))
    expected_grad = np.moveaxis(xt.grad.numpy(), 1, -1)
    np.testing.assert_allclose(grad, expected_grad, rtol=0, atol=atol * max(1.0, float(np.abs(expected_grad).max())))


# Each case's last window is partial: kept (torch's ceil_mode) or dropped by torch's rule that it
# start inside the input or its left padding (length 7, pool 2, stride 2, padding 1: 4 starts,
# the 4th at 6 + 1 - 1 = 6, in the right padding: dropped).
CEIL_CASES = [
    (lambda: ft.nn.MaxPool1D(3, 2, ceil_mode=True), lambda F, x: F.max_pool1d(x, 3, 2, ceil_mode=True), (2, 8, 3)),
    (lambda: ft.nn.MaxPool1D(2, 2, 1, ceil_mode=True), lambda F, x: F.max_pool1d(x, 2, 2, 1, ceil_mode=True), (2, 7, 3)),
    (lambda: ft.nn.AvgPool1D(3, 2, ceil_mode=True), lambda F, x: F.avg_pool1d(x, 3, 2, ceil_mode=True), (2, 6, 3)),
    (lambda: ft.nn.AvgPool2D(3, 2, 1, ceil_mode=True),
     lambda F, x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), (2, 6, 5, 3)),
    (lambda: ft.nn.AvgPool2D(3, 2, 1, ceil_mode=True, count_include_pad=False),
     lambda F, x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 6, 5, 3)),
    (lambda: ft.nn.MaxPool2D(2, (1, 2), 1, dilation=(2, 3)),
     lambda F, x: F.max_pool2d(x, 2, (1, 2), 1, (2, 3)), (2, 6, 7, 3)),
    (lambda: ft.nn.MaxPool2D(3, 2, 1, ceil_mode=True, dilation=2),
     lambda F, x: F.max_pool2d(x, 3, 2, 1, 2, ceil_mode=True), (2, 8, 7, 3)),
]


@pytest.mark.parametrize("make,torch_pool,shape", CEIL_CASES)
def test_ceil_mode_and_dilation_match_torch(make, torch_pool, shape):
    """torch's ceil_mode (and max pooling's dilation) had no counterpart: MaxPool2d(3, 2,
    ceil_mode=True) on 8 x 8 maps gives 4 x 4, ft.nn's 3 x 3 (its last windows dropped), and
    a ceil-mode average divides a partial window by its positions inside the padding, not by
    the pool. Swept against torch in float64 (1386 settings: lengths 1-8, pools 1-4, strides
    1-3, every padding torch allows, dilation 1-2): 4.4e-16 apart, refusals alike; float32
    values here, 7.2e-8 of the values apart measured (outputs and input gradients, every case
    here; the mean's rounding): atol 10 times it, rounded up."""
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    torch = pytest.importorskip("torch")
    _against_torch(make(), lambda xt: torch_pool(torch.nn.functional, xt), x, 1e-6)


ADAPTIVE_CASES = [  # uneven and overlapping windows, an output longer than the input, None entries
    (lambda: ft.nn.AdaptiveAvgPool1D(3), lambda nn: nn.AdaptiveAvgPool1d(3), (2, 7, 3)),
    (lambda: ft.nn.AdaptiveMaxPool1D(5), lambda nn: nn.AdaptiveMaxPool1d(5), (2, 7, 3)),
    (lambda: ft.nn.AdaptiveAvgPool2D((4, None)), lambda nn: nn.AdaptiveAvgPool2d((4, None)), (2, 6, 5, 3)),
    (lambda: ft.nn.AdaptiveMaxPool2D((3, 7)), lambda nn: nn.AdaptiveMaxPool2d((3, 7)), (2, 5, 4, 3)),
    (lambda: ft.nn.AdaptiveAvgPool3D((2, None, 3)), lambda nn: nn.AdaptiveAvgPool3d((2, None, 3)), (2, 3, 4, 5, 2)),
    (lambda: ft.nn.AdaptiveMaxPool3D(2), lambda nn: nn.AdaptiveMaxPool3d(2), (2, 3, 4, 5, 2)),
]


@pytest.mark.parametrize("make,torch_make,shape", ADAPTIVE_CASES)
def test_adaptive_pooling_matches_torch(make, torch_make, shape):
    """torch's windows [floor(i L / o), ceil((i + 1) L / o)): 560 settings (lengths 1-7,
    outputs 1-8, 1-3 axes, None entries) 4.4e-16 apart in float64; float32 here."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    _against_torch(make(), torch_make(torch.nn), x, 1e-6)


def test_adaptive_windows_and_gradient():
    assert ft.nn._pooling.adaptive_windows(7, 3) == ((0, 3), (2, 5), (4, 7))
    assert ft.nn._pooling.adaptive_windows(2, 3) == ((0, 1), (0, 2), (1, 2))
    with jax.enable_x64(True):
        x = jax.random.permutation(jax.random.key(1), jnp.arange(1.0, 1.0 + 5 * 4 * 2, dtype=jnp.float64))
        check_grads(jax.jit(ft.nn.AdaptiveAvgPool2D((3, None))), (x.reshape(5, 4, 2) / 7.0,), order=1, modes=["rev"])


@pytest.mark.parametrize("given", [0, (2, 0), "2", (2,), (2, 2, 2), 1.5])
def test_a_bad_output_size_is_refused(given):
    with pytest.raises(ValueError, match=r"(?s)AdaptiveAvgPool2D: output_size=.* does not fit 2 spatial axes: an int "
                       r">= 1 .* or None .*right:  AdaptiveAvgPool2D\(\(2, None\)\)"):
        ft.nn.AdaptiveAvgPool2D(given)


def test_adaptive_pooling_of_an_empty_axis_is_refused():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)AdaptiveMaxPool2D expects .* with height >= 1, got "
                       r"f32\[1,0,5,2\].*Its height is empty"):
        ft.nn.AdaptiveMaxPool2D(2)(np.ones((1, 0, 5, 2), np.float32))


def test_ceil_mode_with_same_padding_is_refused():
    with pytest.raises(ValueError, match=r'(?s)MaxPool2D: ceil_mode=True with padding="SAME".*'
                       r"right:  MaxPool2D\(3, 2, padding=1, ceil_mode=True\)"):
        ft.nn.MaxPool2D(3, 2, "SAME", ceil_mode=True)


def test_unpool_gradient_is_the_derivative_where_two_windows_pick_one_element():
    """Overlapping windows (pool 3, stride 1) pick one element twice: unpooling writes it once
    and its gradient reaches one copy, the derivative (check_grads), where torch's gathers it
    for each (2 g through pool then unpool). Pooling then unpooling passes each picked
    element's gradient once."""
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 4, 1)))
        pool, unpool = ft.nn.MaxPool2D(3, 1, 1, return_indices=True), ft.nn.MaxUnpool2D(3, 1, 1)
        _, i = pool(x)
        assert len(set(np.asarray(i).ravel())) < i.size  # an element picked twice
        round_trip = jax.jit(lambda x: unpool(*pool(x)))
        check_grads(round_trip, (x,), order=1, modes=["rev"])
        g = jax.grad(lambda x: round_trip(x).sum())(x)
        np.testing.assert_array_equal(g, (round_trip(x) != 0).astype(g.dtype))  # 1 where kept, once


def test_unpool_and_divisor_errors_name_the_fix():
    from functree.nn._pooling import (
        BAD_DIVISOR,
        UNPOOL_INDEX_RANGE,
        UNPOOL_INDICES,
        UNPOOL_OUTPUT_SIZE,
    )

    assert "nonzero int" in BAD_DIVISOR and "Found an invalid max index" in UNPOOL_INDEX_RANGE
    assert "return_indices=True" in UNPOOL_INDICES and "exclusive" in UNPOOL_OUTPUT_SIZE
    with pytest.raises(ValueError, match=r"divisor_override=0; torch's is a nonzero int"):
        ft.nn.AvgPool2D(2, divisor_override=0)
    with pytest.raises(ValueError, match=r"divisor_override=2.5"):
        ft.nn.AvgPool2D(2, divisor_override=2.5)
    x = jnp.arange(30.0).reshape(1, 5, 6, 1)
    y, i = ft.nn.MaxPool2D(3, 2, 1, return_indices=True)(x)
    unpool = ft.nn.MaxUnpool2D(3, 2, 1)
    with pytest.raises(ValueError, match=r"(?s)index 25 .* outside the unpooled plane of 25 positions \(5, 5\).*"
                                         r"MaxUnpool2D\(3, 2, 1\)\(y, indices, output_size=x.shape\[-3:-1\]\)"):
        unpool(y, i)  # torch's default size, (3 - 1) 2 + 3 - 2 = 5 by 5: too small for indices of 5 x 6
    np.testing.assert_array_equal(unpool(y, i, output_size=(5, 6))[0, 4, 5], 29.0)
    assert jax.jit(lambda y, i: unpool(y, i))(y, i).shape == (1, 5, 5, 1)  # traced: its plane NaN
    with pytest.raises(ValueError, match=r"output_size=\(8, 6\) does not fit: .* are \(5, 5\) .* 4\.\.6, 4\.\.6"):
        unpool(y, i, output_size=(8, 6))
    with pytest.raises(ft.nn.LayerInputError, match=r"indices f32\[1,3,3,1\]; they are the indices"):
        unpool(y, y)
    with pytest.raises(ValueError, match=r"padding=\(\(0, 1\),\) does not fit"):
        ft.nn.MaxUnpool1D(2, padding=((0, 1),))


def test_indexed_max_pool_values_are_the_plain_pools():
    """return_indices=True gives the same maxima as the plain pool (reduce_window), dilated or not."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 5, 3)).astype(np.float32))
    for settings in [dict(pool_size=2), dict(pool_size=3, strides=2, padding=1, ceil_mode=True),
                     dict(pool_size=2, strides=1, dilation=2)]:
        (y, i), plain = jax.jit(lambda x, s=settings: (ft.nn.MaxPool2D(**s, return_indices=True)(x),
                                                       ft.nn.MaxPool2D(**s)(x)))(x)  # one program each
        np.testing.assert_array_equal(y, plain)
        assert i.dtype == jnp.int32 and i.shape == y.shape
        plane = np.asarray(x).reshape(2, -1, 3)
        np.testing.assert_array_equal(np.take_along_axis(plane, np.asarray(i).reshape(2, -1, 3), 1).reshape(y.shape), y)


def test_max_unpool_of_an_empty_batch():
    """Leading axes of size 0 (torch's MaxUnpool2d takes a batch of 0): the rows were reshaped
    with -1, which JAX refuses on an empty array."""
    import torch

    pool, unpool = ft.nn.MaxPool2D(2, return_indices=True), ft.nn.MaxUnpool2D(2)
    y, indices = pool(jnp.ones((0, 4, 4, 2)))
    expected = torch.nn.MaxUnpool2d(2)(*torch.nn.MaxPool2d(2, return_indices=True)(torch.ones(0, 2, 4, 4)))
    out = unpool(y, indices)
    assert out.shape == (0, 4, 4, 2) and tuple(expected.shape) == (0, 2, 4, 4)
    assert jax.grad(lambda y: unpool(y, indices).sum())(y).shape == y.shape


def test_traced_unpool_index_outside_the_plane_reads_nan():
    """Eagerly an index outside the unpooled plane is refused (torch raises); under jax.jit the
    scatter dropped it (a negative one too, sent past the end): the value vanished and its plane
    read zeros there, a valid-looking output. Now that channel's plane is NaN; the others exact."""
    unpool = ft.nn.MaxUnpool1D(2)
    x = jnp.array([[[1.0, 5.0], [2.0, 6.0]]])  # [1, 2, 2 channels]
    run = jax.jit(unpool)
    for bad in (9, -1):
        indices = jnp.array([[[1, 0], [bad, 3]]])  # channel 0's second index outside the 4 positions
        with pytest.raises(ValueError, match=rf"index {bad} \(at \[0, 1, 0\]\) is outside the unpooled plane"):
            unpool(x, indices)
        y = np.asarray(run(x, indices))
        assert np.isnan(y[0, :, 0]).all(), bad
        np.testing.assert_array_equal(y[0, :, 1], [5.0, 0.0, 0.0, 6.0])
