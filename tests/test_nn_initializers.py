"""ft.nn.initializers: the jax.nn factories, usable as layer initializers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def test_every_exported_initializer_builds_an_array():
    key = jax.random.key(0)
    for name in ft.nn.initializers.__all__:
        if name == "calculate_gain":  # a number, not an initializer
            continue
        factory = getattr(ft.nn.initializers, name)
        init = factory if name in ("zeros", "ones") else (factory(0.5) if name == "constant" else
                                                         factory(1.0, "fan_in", "normal") if name == "variance_scaling" else factory())
        assert init(key, (8, 4), jnp.float32).shape == (8, 4), name


def test_he_normal_statistics_in_a_conv(key):
    conv = ft.nn.Conv2D(16, 32, 3, key=key, weight_initializer=ft.nn.initializers.he_normal())
    fan_in = 3 * 3 * 16
    assert float(jnp.std(conv.weight)) == pytest.approx(np.sqrt(2 / fan_in), rel=0.05)


def test_bias_initializer(key):
    dense = ft.nn.Dense(2, 3, key=key, bias_initializer=ft.nn.initializers.constant(0.1))
    np.testing.assert_allclose(dense.bias, 0.1)


def _torch_drawn(torch, init, shape, **kw):
    torch.manual_seed(0)
    w = torch.empty(shape, dtype=torch.float64)
    init(w, **kw)
    return w.numpy()


# (ours, torch's nn.init function, keywords, ft kernel shape, torch's weight shape of the same layer)
_TORCH_INITS = [
    ("kaiming_normal", "kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}, (3, 3, 16, 64), (64, 16, 3, 3)),
    ("kaiming_normal", "kaiming_normal_", {"a": 0.2}, (300, 200), (200, 300)),
    ("kaiming_uniform", "kaiming_uniform_", {"nonlinearity": "tanh"}, (300, 200), (200, 300)),
    ("xavier_uniform", "xavier_uniform_", {"gain": 2.0}, (3, 3, 16, 64), (64, 16, 3, 3)),
    ("xavier_normal", "xavier_normal_", {}, (300, 200), (200, 300)),
    ("trunc_normal", "trunc_normal_", {"std": 0.5, "a": -0.4, "b": 0.9}, (300, 200), (200, 300)),
]


@pytest.mark.parametrize("ours,theirs,kw,shape,torch_shape", _TORCH_INITS, ids=[f"{c[0]}-{i}" for i, c in enumerate(_TORCH_INITS)])
def test_torchs_init_functions_draw_torchs_distributions_on_functrees_layouts(ours, theirs, kw, shape, torch_shape):
    """torch's nn.init.kaiming_normal_ (a plain normal: 4.6% of its draws beyond two
    deviations, where JAX's he_normal, truncated, has 3.4%), xavier_*, trunc_normal_ (bounds in
    the values' units) had no counterpart here. The same layer's weights drawn by both: their
    deviation, mean, extremes and the share beyond two deviations agree to sampling error
    (9k-60k draws: deviations 0.06-0.9% apart, means 0.05-1.8% of the deviation, measured;
    4% allowed)."""
    torch = pytest.importorskip("torch")
    mine = np.asarray(getattr(ft.nn.initializers, ours)(**kw)(jax.random.key(0), shape, jnp.float32), np.float64)
    expected = _torch_drawn(torch, getattr(torch.nn.init, theirs), torch_shape, **kw)
    scale = expected.std()
    assert abs(mine.std() - scale) <= 0.04 * scale
    assert abs(mine.mean() - expected.mean()) <= 0.04 * scale
    assert abs(np.abs(mine).max() - np.abs(expected).max()) <= 0.1 * scale or ours.endswith("normal")
    tails = [np.mean(np.abs(w - w.mean()) > 2 * scale) for w in (mine, expected)]
    assert abs(tails[0] - tails[1]) <= 0.01, tails  # a truncated draw has none; a normal 4.6%
    if ours == "trunc_normal":
        assert mine.min() >= kw["a"] and mine.max() <= kw["b"]


def test_torch_default_and_a_transposes_fans():
    """torch's Linear/Conv weights are kaiming_uniform_(a=√5): U(±1/√fan_in). A ConvTranspose's
    fan_in in torch is its weight's size(1), the outputs: here the kernel's fan_out."""
    torch = pytest.importorskip("torch")
    w = np.asarray(ft.nn.Dense(400, 50, key=jax.random.key(0), weight_initializer=ft.nn.initializers.torch_default()).weight)
    bound = 1 / np.sqrt(400)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    t = torch.nn.ConvTranspose2d(16, 64, 3)
    torch_std = _torch_drawn(torch, torch.nn.init.kaiming_normal_, tuple(t.weight.shape)).std()  # fan_in = 64 · 9
    transpose = ft.nn.Conv2DTranspose(16, 64, 3, key=jax.random.key(0),
                                      weight_initializer=ft.nn.initializers.kaiming_normal(mode="fan_out"))
    assert abs(float(np.std(np.asarray(transpose.weight))) - torch_std) <= 0.05 * torch_std
    for bad, match in ((lambda: ft.nn.initializers.kaiming_normal(nonlinearity="gelu"), "nonlinearity='gelu' is not one of torch's"),
                       (lambda: ft.nn.initializers.kaiming_uniform(mode="fan_avg"), "mode='fan_avg'; torch's modes")):
        with pytest.raises(ValueError, match=match):
            bad()


def test_torchs_in_place_names_name_the_function():
    with pytest.raises(AttributeError, match=r"torch's nn.init.kaiming_normal_\(tensor\) fills a tensor in place") as info:
        ft.nn.initializers.kaiming_normal_  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]
    assert "weight_initializer=ft.nn.initializers.kaiming_normal())" in str(info.value)
    with pytest.raises(AttributeError, match=r"JAX's uniform\(scale\) here draws U\[0, scale\)"):
        ft.nn.initializers.uniform_  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(AttributeError, match=r"^module 'functree.nn.initializers' has no attribute 'nothing_'$"):
        ft.nn.initializers.nothing_  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]


def test_torchs_initializers_draw_float64_in_float64_under_x64():
    """A float64 model's init under jax_enable_x64: trunc_normal drew in float32 and cast, so
    every weight was a float32 number (float32's resolution); each of functree's torch-style
    initializers' float64 values now are not all float32 numbers (JAX's own draw in the dtype
    asked for), and a bfloat16 one still draws in float32 and rounds once."""
    ours = ("kaiming_normal", "kaiming_uniform", "xavier_normal", "xavier_uniform", "trunc_normal", "torch_default")
    with jax.enable_x64(True):
        for name in ours:
            w = getattr(ft.nn.initializers, name)()(jax.random.key(0), (8, 4), jnp.float64)
            assert w.dtype == jnp.float64, name
            assert np.any(np.asarray(w) != np.asarray(w.astype(jnp.float32), np.float64)), name
        low = ft.nn.initializers.trunc_normal()(jax.random.key(0), (8, 4), jnp.bfloat16)
    assert low.dtype == jnp.bfloat16
