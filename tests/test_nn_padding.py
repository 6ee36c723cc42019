"""Padding layers against torch's ZeroPad/ConstantPad/ReflectionPad/ReplicationPad/CircularPad;
argument and input errors; a gradient and a jit check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads

import functree as ft

KINDS = {"ZeroPad": "ZeroPad", "ConstantPad": "ConstantPad", "ReflectionPad": "ReflectionPad",
         "ReplicationPad": "ReplicationPad", "CircularPad": "CircularPad"}
# per-axis (low, high) pads in axis order, and torch's flat tuple (last axis first)
PADS = {1: [(1, 2)], 2: [(0, 2), (3, 1)], 3: [(1, 0), (0, 2), (2, 2)]}


def _torch_flat(pairs):
    return tuple(v for pair in reversed(pairs) for v in pair)


def _channels_first(x):
    return torch.from_numpy(np.moveaxis(np.asarray(x), -1, 1).copy())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_mode_matches_torch(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((2, *(3, 4, 5)[:n], 3)).astype(np.float32)
    for kind, torch_name in KINDS.items():
        for pairs in (PADS[n], [(1, 1)] * n, [(0, 0)] * n):
            extra = (-0.5,) if kind == "ConstantPad" else ()
            y = getattr(ft.nn, f"{kind}{n}D")(tuple(pairs), *extra)(jnp.asarray(x))
            expected = getattr(torch.nn, f"{torch_name}{n}d")(_torch_flat(pairs), *extra)(_channels_first(x))
            np.testing.assert_array_equal(np.asarray(y), np.moveaxis(expected.numpy(), 1, -1), err_msg=f"{kind} {pairs}")


def test_int_padding_negative_crops_and_leading_axes():
    x = np.arange(2 * 3 * 5 * 6 * 1, dtype=np.float32).reshape(2, 3, 5, 6, 1)
    np.testing.assert_array_equal(ft.nn.ZeroPad2D(-1)(jnp.asarray(x)), x[:, :, 1:-1, 1:-1])  # two leading axes
    y = ft.nn.ConstantPad1D(((-2, 1),), 7.0)(jnp.asarray(x[0, 0, 0]))
    expected = torch.nn.ConstantPad1d((-2, 1), 7.0)(torch.from_numpy(x[0, 0, 0].T.copy())).numpy().T
    np.testing.assert_array_equal(y, expected)
    assert ft.nn.ZeroPad1D((1, 2)).padding == ((1, 2),)  # torch's (left, right): one axis, read as it is
    assert ft.nn.ReplicationPad3D(1)(jnp.ones((2, 2, 2, 3), jnp.bfloat16)).dtype == jnp.bfloat16


def test_gradient_and_jit():
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 2))
    for layer in (ft.nn.ReflectionPad2D(((1, 2), (2, 0))), ft.nn.CircularPad2D(1), ft.nn.ZeroPad2D(((-1, 1), (1, 0)))):
        check_grads(layer, (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(jax.jit(layer)(x), layer(x))


def test_torch_flat_order_is_refused_with_the_pairs():
    with pytest.raises(ValueError, match=r"(?s)torch's flat order.*right:  ZeroPad2D\(\(\(3, 4\), \(1, 2\)\)\)"):
        ft.nn.ZeroPad2D((1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"(?s)left, right, top, bottom, front, back.*\(\(5, 6\), \(3, 4\), \(1, 2\)\)"):
        ft.nn.ReflectionPad3D((1, 2, 3, 4, 5, 6))


@pytest.mark.parametrize("bad", ["same", (1, 2, 3), ((1, 2, 3),), 1.5, True])
def test_bad_padding_is_refused(bad):
    with pytest.raises(ValueError, match=r"does not fit 2 spatial axes"):
        ft.nn.ZeroPad2D(bad)


def test_negative_pad_is_refused_where_it_cannot_crop():
    with pytest.raises(ValueError, match=r"(?s)only ZeroPad and ConstantPad crop.*right:  ZeroPad1D\(-1\)"):
        ft.nn.ReflectionPad1D(-1)


def test_bad_value_is_refused():
    with pytest.raises(TypeError, match=r"value='x' is not a number"):
        ft.nn.ConstantPad2D(1, "x")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("layer,size,match", [
    (ft.nn.ReflectionPad1D(3), 3, r"length >= 4.*too short for ReflectionPad1D's pad \(3, 3\)"),
    (ft.nn.CircularPad1D(4), 3, r"length >= 4.*wraps the axis around at most once"),
    (ft.nn.ReplicationPad1D(1), 0, r"no edge to repeat"),
    (ft.nn.ZeroPad1D(-2), 3, r"length >= 4.*cropped by 4 by the negative pads of \(-2, -2\)"),
])
def test_too_short_axis_is_refused(layer, size, match):
    with pytest.raises(ft.nn.LayerInputError, match=f"(?s){match}"):
        layer(jnp.ones((1, size, 2)))


@pytest.mark.parametrize("kind", ["ZeroPad", "ConstantPad"])
def test_over_crop_is_refused_as_torch_refuses_it(kind):
    """torch crops (narrow) before it pads: a negative pad beyond the axis raises even where the
    other side's pad would leave a length >= 0 ((-4, 1), (2, -4) on 3); ours padded then cropped
    into the padding ([0, 0] for (-5, 4)). Cropping exactly all of it is torch's empty axis;
    (-3, 3) is three fills. In 1-D, 2-D (height) and 3-D (depth)."""
    for n in (1, 2, 3):
        shape = (1, *(3, 2, 2)[:n], 1)
        x = np.arange(1.0, 1.0 + np.prod(shape)).reshape(shape)
        for lo, hi in [(-4, 1), (2, -4), (-5, 4), (-2, -2), (-3, 3), (-3, 0), (-1, -2), (-1, -1)]:
            pads = ((lo, hi),) + ((0, 0),) * (n - 1)
            flat = _torch_flat(pads)
            extra = (2.0,) if kind == "ConstantPad" else ()
            layer = getattr(ft.nn, f"{kind}{n}D")(pads if n > 1 else (lo, hi), *extra)
            try:
                expected = np.moveaxis(getattr(torch.nn, f"{kind}{n}d")(flat, *extra)(_channels_first(x)).numpy(), 1, -1)
            except RuntimeError as e:
                assert "narrow(): length must be non-negative" in str(e)
                with pytest.raises(ft.nn.LayerInputError, match=rf"(?s)cropped by {-min(lo, 0) - min(hi, 0)} by"):
                    layer(jnp.asarray(x))
                continue
            np.testing.assert_array_equal(np.asarray(layer(jnp.asarray(x))), expected, err_msg=f"{n}-D {(lo, hi)}")


def test_missing_channel_axis_is_refused():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)an input of 3 axes or more.*x\[\.\.\., None\]"):
        ft.nn.ZeroPad2D(1)(jnp.ones((4, 4)))


def test_torch_class_names_point_to_the_layers():
    """ft.nn.ZeroPad2d, ft.nn.Upsample, ft.nn.InstanceNorm2d... (torch's names) were bare
    AttributeErrors; each names ft.nn's layer and its right line builds one."""
    from functree._foreign_methods import FOREIGN_FUNCTIONS

    for name in ("ZeroPad2d", "ReflectionPad1d", "CircularPad3d", "ConstantPad2d", "ReplicationPad2d",
                 "InstanceNorm3d", "Dropout2d", "LPPool1d", "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d",
                 "pad"):
        with pytest.raises(AttributeError, match=f"torch's (nn|F).{name} is "):
            getattr(ft.nn, name)
        _, right = FOREIGN_FUNCTIONS["functree.nn"][name]
        assert isinstance(eval(right, {"ft": ft}), ft.nn.Layer)


@pytest.mark.parametrize("value, dtype, shown", [(0.5, jnp.int32, "it would pad with 0"),
                                                 (300.0, jnp.uint8, "it would pad with 44"),
                                                 (-1.0, jnp.uint8, "it would pad with 255"),
                                                 (float("inf"), jnp.int32, "no such value"),
                                                 (2.0, jnp.bool_, "it would pad with True")])
def test_a_fill_the_integer_input_cannot_hold_is_refused(value, dtype, shown):
    # torch's F.pad(int_tensor, value=0.5) pads with 0 without a word.
    x = jnp.arange(3).reshape(3, 1).astype(dtype)
    with pytest.raises(ValueError, match="does not fit the input's dtype") as info:
        ft.nn.ConstantPad1D(1, value)(x)
    assert shown in str(info.value)
    assert f"right:  ft.nn.ConstantPad1D(1, {value!r})(x.astype(jnp.float32))" in str(info.value)


def test_a_fill_the_integer_input_holds_pads_exactly():
    x = jnp.arange(3, dtype=jnp.int32).reshape(3, 1)
    out = ft.nn.ConstantPad1D((1, 2), -7.0)(x)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out).ravel(), [-7, 0, 1, 2, -7, -7])
