"""torch's F.interpolate beyond the plain modes: mode="area" (adaptive average pooling, 1-3
D), antialias=True (bilinear, bicubic, lanczos; 2-D), recompute_scale_factor=True, and the
function ft.nn.interpolate sharing Upsample*D; against torch in float64 (taps in float32 too),
gradients, and the refusals."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft
from functree.nn._resample import resample_taps

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _torch(x, **kw):
    xt = torch.from_numpy(np.moveaxis(x, -1, 1).copy())
    return np.moveaxis(F.interpolate(xt, **kw).numpy(), 1, -1)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_area_and_antialias_taps_match_torch(dtype):
    """One axis's taps (NumPy, no compile) against torch on [1, L] rows (an axis kept at its
    length is copied by torch's antialiased kernels, so the height of 1 is read as is):
    downsampling and upsampling, sizes and scale factors, align_corners."""
    rng = np.random.default_rng(0)
    worst = {}
    for length in (1, 4, 9):
        x = rng.standard_normal((length, 2)).astype(dtype)
        for mode, aligns in (("area", [None]), ("bilinear", [False, True]), ("bicubic", [False, True]),
                             ("lanczos", [None])):
            for align in aligns:
                for setting in ({"size": 1}, {"size": 3}, {"size": 5}, {"size": 13}, {"scale_factor": 0.45},
                                {"scale_factor": 1.6}):
                    kw = {k: (1, v) for k, v in setting.items()}
                    try:
                        expected = _torch(x.reshape(1, 1, length, 2), mode=mode, align_corners=align,
                                          antialias=mode != "area", **kw)
                    except RuntimeError:  # an empty output
                        continue
                    out = expected.shape[-2]
                    if out == 0:  # torch's area gives an empty output; the layer refuses it (EMPTY_OUTPUT)
                        continue
                    if out == length and mode != "area":
                        continue  # torch copies the axis (Upsample2D does too, tested below)
                    scale = setting.get("scale_factor")
                    taps_mode = "linear" if mode == "bilinear" else mode
                    index, weight = resample_taps(length, out, taps_mode, bool(align),
                                                  None if scale is None else 1 / scale, dtype,
                                                  antialias=mode != "area")
                    y = np.einsum("otc,ot->oc", x[index], weight)
                    worst[mode] = max(worst.get(mode, 0.0), float(np.abs(y - expected.reshape(out, 2)).max()))
    # measured (|x| < 2.3): float32 area 6.0e-8, bilinear 1.2e-7, bicubic 6.6e-7, lanczos 1.8e-7;
    # float64 4.4e-16, 2.2e-16, 1.8e-15, 2.2e-16; 8 times the worst, rounded up
    bound = 6e-6 if dtype == "float32" else 1.5e-14
    assert max(worst.values()) <= bound, worst


def test_area_matches_torch_in_float64_over_ranks():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        cases: list[tuple[int, dict[str, Any]]] = [(1, {"scale_factor": 0.4}), (2, {"size": (3, 8)}),
                                                   (3, {"scale_factor": (0.5, 1.5, 0.7)})]
        for n, setting in cases:
            x = rng.standard_normal((2, *(7, 5, 6)[:n], 2))
            y = ft.nn.interpolate(jnp.asarray(x), mode="area", **setting)
            layer = getattr(ft.nn, f"Upsample{n}D")(mode="area", **setting)
            np.testing.assert_array_equal(y, layer(jnp.asarray(x)))  # the function is the layer
            # measured 2.2e-16 (|x| < 2.9): the sum per axis, torch's over the window at once; 20x
            np.testing.assert_allclose(y, _torch(x, mode="area", **setting), rtol=0, atol=4e-15, err_msg=str(n))


def test_antialias_matches_torch_in_float64():
    """Both axes resized (the width first, as torch), one kept (copied, as torch), upsampling
    (the filter unstretched) and align_corners."""
    x = np.random.default_rng(2).standard_normal((1, 9, 10, 2))
    with jax.enable_x64(True):
        cases: list[tuple[str, bool | None, dict[str, Any]]] = [
            ("bilinear", False, {"scale_factor": (0.5, 0.3)}), ("bicubic", True, {"size": (4, 13)}),
            ("bicubic", False, {"scale_factor": (1.05, 0.45)}),  # 9 * 1.05: 9, the height copied
            ("lanczos", None, {"size": (5, 3)})]
        for mode, align, setting in cases:
            y = ft.nn.interpolate(jnp.asarray(x), mode=mode, align_corners=align, antialias=True, **setting)
            expected = _torch(x, mode=mode, align_corners=align, antialias=True, **setting)
            # measured 1.1e-15 (|x| < 2.5): 10x, rounded up
            np.testing.assert_allclose(y, expected, rtol=0, atol=1e-14, err_msg=f"{mode} {setting}")
        plain = _torch(x, mode="bilinear", align_corners=False, scale_factor=(0.5, 0.3))
        assert np.abs(plain - _torch(x, mode="bilinear", align_corners=False, antialias=True,
                                     scale_factor=(0.5, 0.3))).max() > 0.1  # antialias is read


def test_recompute_scale_factor_matches_torch_in_float64():
    """The output size floor(L * scale_factor), then r = L / O: 5 * 1.7 = 8 outputs read at
    steps of 5/8, not 1/1.7 (2.6 to 4.0 apart in these values)."""
    x = np.random.default_rng(3).standard_normal((1, 5, 6, 2))
    with jax.enable_x64(True):
        for mode, align in (("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bicubic", False)):
            kw = {"scale_factor": (1.7, 0.45), "mode": mode, "align_corners": align}
            y = ft.nn.Upsample2D(recompute_scale_factor=True, **kw)(jnp.asarray(x))
            expected = _torch(x, recompute_scale_factor=True, **kw)
            if mode.startswith("nearest"):
                np.testing.assert_array_equal(y, expected)  # the same elements picked
            else:  # measured 2.2e-16 (|x| < 2.2): 50x
                np.testing.assert_allclose(y, expected, rtol=0, atol=1e-14, err_msg=mode)
            assert np.abs(expected - _torch(x, **kw)).max() > 0.1, mode  # it changes torch's numbers


def test_gradients():
    x = jax.random.normal(jax.random.key(0), (1, 5, 4, 2))
    for layer in (ft.nn.Upsample2D(size=(3, 2), mode="bicubic", antialias=True), ft.nn.Upsample2D(size=(2, 3), mode="area")):
        # jitted: check_grads calls it (and its vjp) many times, each op by op otherwise
        check_grads(jax.jit(layer), (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("make, match", [
    (lambda: ft.nn.Upsample2D(scale_factor=0.5, mode="nearest", antialias=True),
     r"(?s)antialias=True with mode='nearest': torch antialiases the 2-D modes.*right:  ft.nn.Upsample2D\("
     r"scale_factor=0.5, mode=\"bilinear\", antialias=True\)"),
    (lambda: ft.nn.Upsample1D(scale_factor=0.5, mode="linear", antialias=True), r"Upsample1D: antialias=True with mode='linear'"),
    (lambda: ft.nn.Upsample2D(size=2, mode="lanczos"), r"(?s)takes antialias=True and align_corners=False.*got "
     r"antialias=False, align_corners=None"),
    (lambda: ft.nn.Upsample2D(size=2, mode="lanczos", antialias=True, align_corners=True),
     r"(?s)got antialias=True, align_corners=True.*wrong:  .*antialias=True, align_corners=True\)"),
    (lambda: ft.nn.Upsample1D(size=3, recompute_scale_factor=True), r"(?s)recompute_scale_factor=True with size=3.*"
     r"right:  ft.nn.Upsample1D\(size=3\) "),
    (lambda: ft.nn.Upsample3D(scale_factor=0.5, mode="area", align_corners=True),
     r"align_corners is read by the linear and cubic modes only"),
])
def test_refusals(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_interpolate_needs_a_batch_axis():
    with pytest.raises(ValueError, match=r"(?s)\(3 to 5 axes\), got f32\[4,2\].*x\[None\].*ft.nn.Upsample1D"):
        ft.nn.interpolate(jnp.ones((4, 2)), scale_factor=2)
    with pytest.raises(ValueError, match=r"(?s)got f32\[1,1,1,1,1,1\].*ft.nn.Upsample3D"):
        ft.nn.interpolate(jnp.ones((1,) * 6), scale_factor=2)
