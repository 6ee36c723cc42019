"""Upsample1D/2D/3D against torch's F.interpolate over modes, align_corners, sizes and scale
factors (float32 and float64); gradients, jit, argument and input errors. The area mode,
antialias, recompute_scale_factor and ft.nn.interpolate: tests/test_nn_resample_modes.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads

import functree as ft

MODES = {1: ("nearest", "nearest-exact", "linear"), 2: ("nearest", "nearest-exact", "bilinear", "bicubic"),
         3: ("nearest", "nearest-exact", "trilinear")}
# scale factors up, down, fractional (torch reads 1 / scale_factor, not in / out), 1.2 (2-D
# nearest's and every linear kernel's identity shortcut), 2.3 on 3 elements (2-D nearest's
# halving shortcut); sizes up, down, to 1
SETTINGS = [{"scale_factor": 2}, {"scale_factor": 1.5}, {"scale_factor": 1.2}, {"scale_factor": 2.3},
            {"size": 7}, {"size": 2}]


def _torch(x, **kw):
    xt = torch.from_numpy(np.moveaxis(x, -1, 1).copy())
    return np.moveaxis(torch.nn.functional.interpolate(xt, **kw).numpy(), 1, -1)


def test_taps_match_torch_over_modes_and_sizes():
    """Each axis's taps (NumPy, no compile) against torch on one axis: 1-D kernels for
    nearest and linear, the 2-D kernels on a [1, L] image for bicubic and 2-D nearest's shortcuts."""
    from functree.nn._resample import resample_taps

    rng = np.random.default_rng(0)
    worst = {}
    for length in (1, 3, 5):
        x = rng.standard_normal((length, 2)).astype(np.float32)
        for rank, mode, torch_mode in ((1, "nearest", "nearest"), (1, "nearest-exact", "nearest-exact"),
                                       (1, "linear", "linear"), (2, "bicubic", "bicubic"), (2, "nearest", "nearest")):
            for align in ([None] if mode.startswith("nearest") else [False, True]):
                for setting in SETTINGS + [{"scale_factor": 0.6}, {"size": 1}]:
                    kw = {k: (v if rank == 1 else (1, v)) for k, v in setting.items()}
                    try:
                        expected = _torch(x.reshape((1,) * rank + x.shape), mode=torch_mode, align_corners=align, **kw)
                    except RuntimeError:  # an empty output: refused (test_empty_output_is_refused)
                        continue
                    out = expected.shape[-2]
                    scale = setting.get("scale_factor")
                    index, weight = resample_taps(length, out, mode, bool(align), None if scale is None else 1 / scale,
                                                  shortcuts=rank == 2)
                    y = np.einsum("otc,ot->oc", x[index], weight)
                    err = float(np.abs(y - expected.reshape(out, 2)).max())
                    if mode.startswith("nearest"):  # the same element picked
                        assert err == 0, (rank, mode, length, setting)
                    worst[mode] = max(worst.get(mode, 0.0), err)
    # measured: linear 3.0e-7, bicubic 1.7e-6 (|x| ~ 3; torch's sums in another order); 4x margin
    assert worst["linear"] <= 1.2e-6 and worst["bicubic"] <= 7e-6, worst


@pytest.mark.parametrize("n", [1, 2, 3])
def test_layers_match_torch(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((2, *(3, 5, 4)[:n], 2)).astype(np.float32)
    for mode in MODES[n]:
        align = None if mode.startswith("nearest") else mode == "bicubic"
        for setting in ({"scale_factor": (1.5, 2, 0.6)[:n]}, {"size": (2, 7, 4)[:n]}):
            layer = getattr(ft.nn, f"Upsample{n}D")(mode=mode, align_corners=align, **setting)
            expected = _torch(x, mode=mode, align_corners=align, **setting)
            # measured: 4.8e-7 (bilinear), 1.2e-6 (bicubic): 4x
            np.testing.assert_allclose(layer(jnp.asarray(x)), expected, rtol=0, atol=5e-6, err_msg=f"{mode} {setting}")


def test_float64_matches_torch_to_rounding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 5, 2))
    with jax.enable_x64(True):
        for mode, align in (("bilinear", False), ("bicubic", True), ("nearest", None)):
            y = ft.nn.Upsample2D(scale_factor=(1.7, 0.8), mode=mode, align_corners=align)(jnp.asarray(x))
            assert y.dtype == jnp.float64
            expected = _torch(x, scale_factor=(1.7, 0.8), mode=mode, align_corners=align)
            np.testing.assert_allclose(y, expected, rtol=0, atol=1e-14)  # measured 1.3e-15


def test_named_layers_and_leading_axes():
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5, 2)).astype(np.float32)  # two leading axes
    y = ft.nn.UpsamplingBilinear2D(scale_factor=2)(jnp.asarray(x))
    expected = _torch(x.reshape(6, 4, 5, 2), scale_factor=2, mode="bilinear", align_corners=True)
    np.testing.assert_allclose(y.reshape(expected.shape), expected, rtol=0, atol=4e-6)
    y = ft.nn.UpsamplingNearest2D(size=(1, 9))(jnp.asarray(x))
    np.testing.assert_array_equal(y.reshape(6, 1, 9, 2), _torch(x.reshape(6, 4, 5, 2), size=(1, 9)))
    assert ft.nn.Upsample1D(scale_factor=2, mode="linear")(jnp.ones((3, 2), jnp.bfloat16)).dtype == jnp.bfloat16


def test_gradients_and_jit():
    x = jax.random.normal(jax.random.key(0), (1, 3, 4, 2))
    for mode in ("bicubic", "nearest"):
        layer = ft.nn.Upsample2D(size=(5, 3), mode=mode, align_corners=None if mode == "nearest" else False)
        check_grads(layer, (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
        np.testing.assert_allclose(jax.jit(layer)(x), layer(x), rtol=0, atol=1e-6)


def test_size_or_scale_factor_exactly_one():
    with pytest.raises(ValueError, match=r"(?s)exactly one of size= and scale_factor= \(got neither\)"):
        ft.nn.Upsample2D()
    with pytest.raises(ValueError, match=r"got both"):
        ft.nn.Upsample1D(size=3, scale_factor=2)


@pytest.mark.parametrize("name,given,match", [
    ("size", 0, r"size=0 does not fit 2 spatial axes: an int >= 1"),
    ("size", (2, 2, 2), r"size=\(2, 2, 2\) does not fit 2"),
    ("scale_factor", -1.0, r"scale_factor=-1.0 does not fit 2 spatial axes: a number > 0"),
    ("scale_factor", "2", r"scale_factor='2'"),
])
def test_bad_size_and_scale_are_refused(name, given, match):
    with pytest.raises(ValueError, match=match):
        ft.nn.Upsample2D(**{name: given})


def test_mode_of_other_rank_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"(?s)mode='linear'.*is for 1 spatial axes, Upsample1D.*mode='bilinear'"):
        ft.nn.Upsample2D(scale_factor=2, mode="linear")
    with pytest.raises(ValueError, match=r"(?s)mode='lanczos' is not one of.*is for 2 spatial axes, Upsample2D"):
        ft.nn.Upsample3D(scale_factor=2, mode="lanczos")
    with pytest.raises(ValueError, match=r"mode='box' is not one of"):
        ft.nn.Upsample1D(scale_factor=2, mode="box")


def test_align_corners_with_nearest_is_refused():
    with pytest.raises(ValueError, match=r"align_corners is read by the linear and cubic modes only"):
        ft.nn.Upsample1D(scale_factor=2, align_corners=True)


def test_empty_output_is_refused():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)length >= 4.*times scale_factor 0.3 is 0.9:.*size=1"):
        ft.nn.Upsample1D(scale_factor=0.3)(jnp.ones((1, 3, 2)))


@pytest.mark.parametrize(("n", "mode", "shape"), [(1, "nearest-exact", (2, 0, 2)), (2, "bicubic", (2, 0, 3, 1)),
                                                  (3, "area", (2, 0, 1, 6, 2))])
def test_an_empty_axis_resized_to_a_size_is_refused_as_torch_does(n, mode, shape):
    """torch raises on an empty spatial axis ("Input and output sizes should be greater than 0");
    with size= the layer failed inside jnp.take (IndexError) or a broadcast (TypeError)."""
    size = (4,) * n
    x = jnp.zeros(shape)
    with pytest.raises(RuntimeError, match=r"greater than 0|non-zero size"):
        torch.nn.functional.interpolate(torch.zeros(shape[0], shape[-1], *shape[1:-1]), size=size, mode=mode)
    with pytest.raises(ft.nn.LayerInputError, match=r"is 0: an empty axis has nothing to resample(.|\n)*right: "):
        getattr(ft.nn, f"Upsample{n}D")(size=size, mode=mode)(x)
    with pytest.raises(ft.nn.LayerInputError, match="nothing to resample"):
        ft.nn.interpolate(x, size=size, mode=mode)
