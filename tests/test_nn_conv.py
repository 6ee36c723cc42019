"""Conv1D/Conv2D and transposes against direct loops, gradients and input errors."""

import itertools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _normal(seed, shape, dtype=np.float32):
    """Standard-normal input drawn by NumPy (a jax.random draw compiles programs per shape)."""
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _conv_reference(x, w, b, strides, pads):
    """Cross-correlation by explicit loops over output positions (channels last, batch first)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n = w.ndim - 2
    x = np.pad(x, [(0, 0), *pads, (0, 0)])
    out_shape = [(x.shape[1 + d] - w.shape[d]) // strides[d] + 1 for d in range(n)]
    y = np.zeros((x.shape[0], *out_shape, w.shape[-1]))
    for pos in itertools.product(*map(range, out_shape)):
        window = tuple(slice(p * s, p * s + k) for p, s, k in zip(pos, strides, w.shape[:n]))
        patch = x[(slice(None), *window)]  # [batch, *kernel, cin]
        y[(slice(None), *pos)] = np.tensordot(patch, w, axes=(list(range(1, n + 2)), list(range(n + 1))))
    return y + np.asarray(b)


def _transpose_reference(x, w, b, strides):
    """y[i*s + k] += x[i] @ w[k] (VALID padding)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n = w.ndim - 2
    out_shape = [(x.shape[1 + d] - 1) * strides[d] + w.shape[d] for d in range(n)]
    y = np.zeros((x.shape[0], *out_shape, w.shape[-1]))
    for pos in itertools.product(*map(range, x.shape[1:1 + n])):
        for k in itertools.product(*map(range, w.shape[:n])):
            target = tuple(p * s + kk for p, s, kk in zip(pos, strides, k))
            y[(slice(None), *target)] += x[(slice(None), *pos)] @ w[k]
    return y + np.asarray(b)


@pytest.mark.parametrize("strides,padding,pads", [(1, "VALID", [(0, 0)]), (2, "SAME", [(1, 1)]), (1, 2, [(2, 2)])])
def test_conv1d_matches_loops(key, strides, padding, pads):
    conv = ft.nn.Conv1D(2, 3, 3, strides=strides, padding=padding, key=key,
                        bias_initializer=ft.nn.initializers.normal(1.0))
    x = _normal(1, (2, 7, 2))
    expected = _conv_reference(x, conv.weight, conv.bias, (strides,), pads)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


def test_an_ensembles_conv_called_outside_vmap_is_refused(key):
    convs = jax.vmap(lambda k: ft.nn.Conv2D(3, 4, 3, key=k))(jax.random.split(key, 2))
    with pytest.raises(ft.nn.LayerInputError, match=r"Conv2D holds weight f32\[2,3,3,3,4\], but one Conv2D's weight has 4"):
        convs(jnp.ones((1, 8, 8, 3)))          # was JAX's "lhs and rhs ndim to be equal"


def test_conv2d_matches_loops_with_strides(key):
    conv = ft.nn.Conv2D(2, 4, (3, 2), strides=(2, 1), padding="VALID", activation=jax.nn.relu, key=key)
    x = _normal(1, (2, 7, 5, 2))
    expected = np.maximum(_conv_reference(x, conv.weight, conv.bias, (2, 1), [(0, 0), (0, 0)]), 0)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


def test_grouped_conv_is_per_group_conv(key):
    conv = ft.nn.Conv1D(4, 6, 3, groups=2, padding="VALID", key=key)
    assert conv.weight.shape == (3, 2, 6)
    x = _normal(1, (1, 6, 4))
    w = np.asarray(conv.weight)
    first = _conv_reference(x[..., :2], w[..., :3], np.zeros(3), (1,), [(0, 0)])
    second = _conv_reference(x[..., 2:], w[..., 3:], np.zeros(3), (1,), [(0, 0)])
    np.testing.assert_allclose(conv(x), np.concatenate([first, second], -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls,shape", [(ft.nn.Conv1DTranspose, (2, 4, 2)), (ft.nn.Conv2DTranspose, (2, 3, 2, 2))])
def test_transposed_conv_matches_scatter(key, cls, shape):
    conv = cls(2, 3, 3, strides=2, padding="VALID", key=key)
    x = jax.random.normal(jax.random.key(1), shape)
    expected = _transpose_reference(x, conv.weight, conv.bias, (2,) * (len(shape) - 2))
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


def test_transposed_conv_is_adjoint_of_conv(key):
    """<conv(x), y> == <x, conv_T(y)> with the same weight (SAME padding, stride 1, no bias)."""
    conv = ft.nn.Conv1D(2, 3, 3, use_bias=False, key=key)
    convt = ft.nn.Conv1DTranspose(3, 2, 3, use_bias=False, key=key)
    convt = convt.replace(weight=conv.weight.transpose(0, 2, 1))
    x = _normal(1, (1, 6, 2))
    y = _normal(2, (1, 6, 3))
    np.testing.assert_allclose(np.vdot(np.asarray(conv(x), np.float64), y), np.vdot(x, np.asarray(convt(y), np.float64)),
                               rtol=1e-5, atol=1e-5)


def test_same_padding_shapes_and_unbatched_inputs(key):
    assert ft.nn.Conv2D(3, 5, 3, strides=2, key=key)(np.ones((9, 9, 3), np.float32)).shape == (5, 5, 5)
    assert ft.nn.Conv2DTranspose(3, 5, 3, strides=2, key=key)(np.ones((2, 2, 4, 4, 3), np.float32)).shape == (2, 2, 8, 8, 5)
    assert ft.nn.Conv1D(3, 5, 3, dilation=2, padding="VALID", key=key)(np.ones((10, 3), np.float32)).shape == (6, 5)


@pytest.mark.parametrize("cls", [ft.nn.Conv1D, ft.nn.Conv1DTranspose])
def test_gradients_finite_differences(key, cls):
    with jax.enable_x64(True):
        conv = _x64(cls(2, 2, 3, strides=2, key=key, activation=jnp.tanh))
        x = _normal(1, (1, 5, 2), np.float64)
        check_grads(jax.jit(lambda m, x: m(x)), (conv, x), order=1, modes=["rev"])


def test_conv2d_gradient_finite_differences(key):
    with jax.enable_x64(True):
        conv = _x64(ft.nn.Conv2D(2, 2, 2, key=key))
        x = _normal(1, (1, 3, 3, 2), np.float64)
        check_grads(jax.jit(lambda m, x: m(x)), (conv, x), order=1, modes=["rev"])


def test_wrong_channels_is_an_error(key):
    conv = ft.nn.Conv2D(3, 8, 3, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"Conv2D expects inputs \[\.\.\., height, width, 3\] \(float\), got f32\[2,8,8,1\]"):
        conv(np.ones((2, 8, 8, 1), np.float32))
    with pytest.raises(ft.nn.LayerInputError, match=r"got f32\[3\]"):
        conv(np.ones(3, np.float32))


def test_bad_groups_are_errors(key):
    with pytest.raises(ValueError, match=r"divisible by groups \(2\)"):
        ft.nn.Conv1D(3, 8, 3, groups=2, key=key)
    with pytest.raises(ValueError, match=r"divisible by groups \(2\)"):
        ft.nn.Conv1DTranspose(4, 7, 3, groups=2, key=key)


@pytest.mark.parametrize(("build", "shown"), [
    (lambda k: ft.nn.Conv1D(2, 3, 3, padding=(2, 1), key=k), "padding=(2, 1) does not fit 1 spatial axis"),
    (lambda k: ft.nn.Conv2D(2, 3, 3, padding=(1, 2, 3), key=k), "padding=(1, 2, 3) does not fit 2 spatial axes"),
    (lambda k: ft.nn.Conv2D(2, 3, 3, padding="causal", key=k), "a padding string is one of ('SAME', 'VALID')"),
    (lambda k: ft.nn.Conv2D(2, 3, 3, padding=-1, key=k), "padding=-1 does not fit"),
    (lambda k: ft.nn.Conv2D(2, 3, 3, strides=(1, 2, 3), key=k), "strides=(1, 2, 3) does not fit 2 spatial axes"),
    (lambda k: ft.nn.Conv2D(2, 3, (3,), key=k), "kernel_size=(3,) does not fit 2 spatial axes"),
    (lambda k: ft.nn.Conv2D(2, 3, 3, dilation=0, key=k), "dilation=0 does not fit"),
    (lambda k: ft.nn.MaxPool2D(3, 1, padding=(1, 2, 3)), "MaxPool2D: padding=(1, 2, 3) does not fit 2 spatial axes"),
    (lambda k: ft.nn.AvgPool2D((2, 2, 2)), "AvgPool2D: pool_size=(2, 2, 2) does not fit 2 spatial axes"),
])
def test_window_settings_that_do_not_fit_the_axes_are_refused_when_built(build, shown):
    """They were accepted and failed at the first call inside lax (a TypeError on explicit
    pads, XLA's 'Unrecognized padding type', an AttributeError on an int)."""
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        build(jax.random.key(0))
    assert "right:" in str(info.value)


def test_window_settings_in_every_accepted_form_compute_alike():
    key, x = jax.random.key(0), np.ones((1, 9, 9, 2), np.float32)
    forms = [ft.nn.Conv2D(2, 3, 3, strides=s, padding=p, key=key) for s, p in
             ((2, 1), ([2, 2], (1, 1)), (np.int64(2), ((1, 1), (1, 1))), ((2, 2), [(1, 1), 1]))]
    for conv in forms[1:]:
        assert conv.strides == forms[0].strides and conv.padding == forms[0].padding
        np.testing.assert_array_equal(conv(x), forms[0](x))
    assert ft.nn.Conv1D(2, 3, 3, padding=((2, 1),), key=key)(np.ones((1, 5, 2), np.float32)).shape == (1, 6, 3)
    assert ft.nn.MaxPool2D(2, padding="same").padding == "SAME"


def test_a_channels_first_batch_gets_the_move_not_another_layer_size():
    """torch's NCHW batch: the fix read the image width (16) as channels ("build the layer for
    the size you have (last axis 16)")."""
    conv = ft.nn.Conv2D(3, 8, 3, key=jax.random.key(0))
    with pytest.raises(ft.nn.LayerInputError, match=r"\(torch's NCHW\).*jnp.moveaxis\(x, -3, -1\)"):
        conv(np.ones((2, 3, 16, 16), np.float32))
    assert conv(np.moveaxis(np.ones((2, 3, 16, 16), np.float32), -3, -1)).shape == (2, 16, 16, 8)
    with pytest.raises(ft.nn.LayerInputError, match=r"build the layer for the size you have"):
        conv(np.ones((2, 16, 16, 4), np.float32))  # channels last, just another count: the old fix stands


@pytest.mark.parametrize("k,s,p,op,d", [(2, 3, 1, 2, 1), (4, 4, 2, 2, 1), (3, 2, 1, 1, 2)])
def test_torchs_transposed_padding_is_the_documented_formula(key, k, s, p, op, d):
    """torch's ConvTranspose1d(padding=p, output_padding=op) is padding=((d*(k-1)-p,
    d*(k-1)-p+op),) here: passing torch's p gave the same output shape with other numbers
    (k=2, s=3, p=1, op=2: 0.60 off), which the docstring now says."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.ConvTranspose1d(3, 2, k, stride=s, padding=p, output_padding=op, dilation=d)
    x = np.random.default_rng(0).normal(size=(1, 5, 3)).astype(np.float32)
    expected = module(torch.tensor(x).transpose(1, 2)).transpose(1, 2).detach().numpy()
    low = d * (k - 1) - p
    layer = ft.nn.load_torch_state_dict(
        ft.nn.Conv1DTranspose(3, 2, k, strides=s, dilation=d, padding=((low, low + op),), key=key),
        module.state_dict())
    actual = np.asarray(layer(jnp.asarray(x)))
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def _torch_raises(make):
    try:
        make()
    except RuntimeError as e:
        assert "Output size is too small" in str(e) or "Kernel size can't be greater" in str(e), e
        return True
    return False


@pytest.mark.parametrize("k,d,p,length", [(5, 1, 0, 3), (5, 1, 0, 4), (5, 1, 0, 5), (3, 2, 0, 4), (3, 2, 1, 3),
                                          (4, 1, 1, 1), (5, 1, 1, 2)])
def test_a_window_longer_than_the_padded_input_is_refused_as_torch_does(k, d, p, length):
    """Conv1D(4, 8, 5, padding="VALID") on length 3 gave shape (2, 0, 8), then NaN values and
    gradients through GlobalAvgPool1D and Dense; torch's Conv1d raises. It raises here too
    where torch does, naming the window and the fix, and keeps torch's shape otherwise."""
    torch = pytest.importorskip("torch")
    conv = ft.nn.Conv1D(2, 3, k, dilation=d, padding=p if p else "VALID", key=jax.random.key(0))
    module = torch.nn.Conv1d(2, 3, k, dilation=d, padding=p)
    x = np.ones((2, length, 2), np.float32)
    if _torch_raises(lambda: module(torch.tensor(x).transpose(1, 2))):
        need = d * (k - 1) + 1 - 2 * p
        with pytest.raises(ft.nn.LayerInputError, match=rf"with length >= {need}, got f32\[2,{length},2\]") as info:
            jax.jit(conv)(jnp.asarray(x))
        assert f"Its length ({length}) is shorter" in str(info.value)
        assert re.search(r'right:  Conv1D\(\.\.\., kernel_size=\d, .*padding="SAME"\)', str(info.value))
    else:
        expected = module(torch.tensor(x).transpose(1, 2)).transpose(1, 2)
        assert conv(jnp.asarray(x)).shape == tuple(expected.shape)


def test_an_empty_convolution_no_longer_reaches_nan():
    """The audit's model: the empty axis's mean was NaN in the output and the gradients."""
    key = jax.random.key(0)
    model = ft.nn.Sequential([ft.nn.Conv1D(4, 8, 5, padding="VALID", key=key), ft.nn.GlobalAvgPool1D(),
                              ft.nn.Dense(8, 2, key=key)])
    with pytest.raises(ft.nn.LayerInputError, match=r"Conv1D at \.layers\[0\] expects .* with length >= 5"):
        model(np.ones((2, 3, 4), np.float32))
    assert np.isfinite(np.asarray(model(np.ones((2, 5, 4), np.float32)))).all()


@pytest.mark.parametrize("k,s,p,length", [(5, 2, 4, 1), (5, 2, 4, 2), (5, 2, 4, 3), (5, 1, 4, 4), (5, 1, 4, 5),
                                          (3, 3, 2, 1), (3, 3, 2, 2)])
def test_a_transposed_convolution_with_no_output_is_refused_as_torch_does(key, k, s, p, length):
    """torch's ConvTranspose1d(padding=p) is padding=((k-1-p, k-1-p),) here (the documented
    formula); where its output would be empty torch raises, and this layer gave shape (1, 0, 3)."""
    torch = pytest.importorskip("torch")
    module = torch.nn.ConvTranspose1d(2, 3, k, stride=s, padding=p)
    layer = ft.nn.Conv1DTranspose(2, 3, k, strides=s, padding=((k - 1 - p, k - 1 - p),), key=key)
    x = np.ones((1, length, 2), np.float32)
    if _torch_raises(lambda: module(torch.tensor(x).transpose(1, 2))):
        with pytest.raises(ft.nn.LayerInputError, match=r'is shorter than the window needs(.|\n)*padding="VALID"'):
            layer(jnp.asarray(x))
    else:
        assert layer(jnp.asarray(x)).shape == tuple(module(torch.tensor(x).transpose(1, 2)).transpose(1, 2).shape)


def test_conv2d_names_the_axis_too_short_and_empty_inputs_keep_their_shape(key):
    conv = ft.nn.Conv2D(2, 3, (3, 5), padding="VALID", key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"with width >= 5, got f32\[1,9,4,2\](.|\n)*Its width \(4\)"):
        conv(np.ones((1, 9, 4, 2), np.float32))
    assert conv(np.ones((1, 3, 5, 2), np.float32)).shape == (1, 1, 1, 3)
    # SAME on an empty axis is empty, as the input: not refused (reshape's -1 raised ZeroDivisionError).
    assert ft.nn.Conv1D(2, 3, 3, key=key)(np.ones((2, 0, 2), np.float32)).shape == (2, 0, 3)


@pytest.mark.parametrize("rank,k", [(1, 5), (2, (3, 4))])
def test_the_documented_torch_init_of_a_transposed_conv_is_torchs(rank, k):
    """docs/migration/defaults.md gave variance_scaling(1/3, "fan_in", "uniform") for every
    Conv*: for a transpose that is U(±1/√(in·k)), 0.112 where torch's ConvTranspose1d(16, 32, 5)
    is U(±1/√(out·k)) = 0.079 (its fan_in reads weight.size(1), the output channels). The
    page says "fan_out" for the transposes now, which is torch's bound."""
    torch = pytest.importorskip("torch")
    page = (pathlib.Path(__file__).parents[1] / "docs" / "migration" / "defaults.md").read_text(encoding="utf-8")
    assert 'for `Conv1DTranspose`/`Conv2DTranspose` (torch\'s): `variance_scaling(1/3, "fan_out", "uniform")`' in page
    cls = (ft.nn.Conv1DTranspose, ft.nn.Conv2DTranspose)[rank - 1]
    initializer = ft.nn.initializers.variance_scaling(1 / 3, "fan_out", "uniform")
    ours = np.abs(np.asarray(cls(16, 32, k, key=jax.random.key(0), weight_initializer=initializer).weight))
    theirs = np.abs((torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d)[rank - 1](16, 32, k).weight.detach().numpy())
    bound = 1 / np.sqrt(32 * np.prod(k))
    for w in (ours, theirs):  # both U(±bound): the max within 1% below it, the mean |w| bound/2
        assert 0.99 * bound < w.max() <= bound
        np.testing.assert_allclose(w.mean(), bound / 2, rtol=0.03)


def test_a_bfloat16_bias_gradient_is_summed_in_float32():
    """The gradient of Conv2D's bias is the cotangent summed over every position, and XLA:CPU
    summed it in bfloat16: over 8x16x16 positions of U(0, 1) cotangents it came back 0.75 off the
    float64 sum, where torch's bfloat16 Conv2d is 3.6e-3 off (the rounding of its result). The
    bias is added in float32 now, which makes that sum float32."""
    torch = pytest.importorskip("torch")
    dy = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (8, 16, 16, 16)), jnp.bfloat16)
    dy32 = np.asarray(dy.astype(jnp.float32))
    exact = dy32.astype(np.float64).sum((0, 1, 2))
    module = torch.nn.Conv2d(4, 16, 1).bfloat16()
    module(torch.ones(8, 4, 16, 16, dtype=torch.bfloat16)).backward(torch.tensor(dy32.transpose(0, 3, 1, 2)).bfloat16())
    spread = np.abs(module.bias.grad.float().numpy() - exact).max()  # 3.7 of 1029: bfloat16's rounding
    conv = ft.cast(ft.nn.Conv2D(4, 16, 1, key=jax.random.key(0)), jnp.bfloat16)
    x = jnp.ones((8, 16, 16, 4), jnp.bfloat16)
    grad, = jax.jit(lambda m, dy: jax.vjp(lambda m: m(x), m)[1](dy))(conv, dy)
    assert grad.bias.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad.bias.astype(jnp.float32)), exact, rtol=0, atol=10 * spread)


@pytest.mark.parametrize("cls", [ft.nn.Conv1D, ft.nn.Conv2D, ft.nn.Conv1DTranspose])
@pytest.mark.parametrize("groups", [0, -1, 2.0])
def test_groups_that_are_not_a_positive_int_are_refused_when_built(cls, groups):
    """groups=0 raised ZeroDivisionError and groups=-1 an MLIRError from inside XLA at the
    first call (torch: "groups must be a positive integer"); now a ValueError naming it."""
    with pytest.raises(ValueError, match=rf"{cls.__name__}: groups must be an int >= 1 .*got {groups!r}") as info:
        jax.eval_shape(lambda x: cls(4, 8, 3, groups=groups, key=jax.random.key(0))(x),
                       jax.ShapeDtypeStruct((1, *(5,) * cls._rank, 4), jnp.float32))
    assert "right:" in str(info.value)


def _against_torch(layer, module, x, call_torch, atol):
    """``layer`` loaded from ``module``'s state dict (the torch port) on channels-last ``x``
    and ``call_torch(module, x)`` on it channels-first: outputs, and the gradients of one random
    cotangent with respect to the input and every parameter (in torch's names), float32, within
    ``atol`` times each one's magnitude."""
    torch = pytest.importorskip("torch")
    layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
    xt = torch.tensor(np.moveaxis(x, -1, 1), requires_grad=True)
    yt = call_torch(module, xt)
    expected = np.moveaxis(yt.detach().numpy(), 1, -1)
    g = _normal(2, expected.shape)
    y, vjp = jax.vjp(jax.jit(lambda m, x: m(x)), layer, jnp.asarray(x))
    grad_layer, grad_x = vjp(jnp.asarray(g))
    yt.backward(torch.tensor(np.moveaxis(g, -1, 1)))
    assert y.shape == expected.shape
    ours = {"output": np.asarray(y), "input": np.asarray(grad_x),
            **ft.nn.torch_state_dict(grad_layer, gradient=True, numpy=True)}
    theirs = {"output": expected, "input": np.moveaxis(xt.grad.numpy(), 1, -1),
              **{n: p.grad.numpy() for n, p in module.named_parameters()}}
    assert set(theirs) == set(ours)
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=atol * max(1.0, float(np.abs(want).max())),
                                   err_msg=name)


@pytest.mark.parametrize("padding", [1, (0, 2, 1), ((1, 0), (2, 1), (0, 1)), "same", "valid"])
def test_conv3d_matches_torch_through_the_port(padding):
    """Conv3d had no counterpart (Conv1D/2D only). Grouped, dilated, strided where torch allows
    (its "same" takes stride 1), every padding form (pairs by F.pad); float32, the port's
    layout [out, in/g, *k] -> [*k, in/g, out]. Measured 6.8e-7 of the values apart at most
    (the sums' order): atol 10 times it, rounded up."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    pairs = isinstance(padding, tuple) and isinstance(padding[0], tuple)
    strides = 1 if isinstance(padding, str) else (1, 2, 1)
    torch.manual_seed(0)
    module = torch.nn.Conv3d(4, 6, (3, 2, 3), stride=strides, padding=0 if pairs else padding, dilation=(1, 2, 1),
                             groups=2)
    layer = ft.nn.Conv3D(4, 6, (3, 2, 3), strides=strides, padding=padding, dilation=(1, 2, 1), groups=2,
                         key=jax.random.key(0))
    flat = [v for pair in reversed(padding) for v in pair] if pairs else []
    _against_torch(layer, module, _normal(0, (2, 5, 6, 5, 4)), lambda m, x: m(F.pad(x, flat) if flat else x), 7e-6)


def test_conv3d_transpose_matches_torch_by_the_documented_padding():
    """ConvTranspose3d(padding=p, output_padding=op, groups, dilation) is padding=((d*(k-1)-p,
    d*(k-1)-p+op),) per axis here, as in 1-D and 2-D."""
    torch = pytest.importorskip("torch")
    k, s, p, op, d = (3, 2, 2), (2, 1, 2), (1, 0, 1), (1, 0, 0), (1, 1, 2)
    torch.manual_seed(0)
    module = torch.nn.ConvTranspose3d(4, 6, k, stride=s, padding=p, output_padding=op, groups=2, dilation=d)
    pads = tuple((di * (ki - 1) - pi, di * (ki - 1) - pi + oi) for ki, pi, oi, di in zip(k, p, op, d))
    layer = ft.nn.Conv3DTranspose(4, 6, k, strides=s, padding=pads, dilation=d, groups=2, key=jax.random.key(0))
    _against_torch(layer, module, _normal(0, (2, 3, 4, 3, 4)), lambda m, x: m(x), 7e-6)


@pytest.mark.parametrize("make,torch_make", [
    (lambda: ft.nn.MaxPool3D((2, 3, 2), (1, 2, 2), 1, ceil_mode=True, dilation=(1, 1, 2)),
     lambda nn: nn.MaxPool3d((2, 3, 2), (1, 2, 2), 1, (1, 1, 2), ceil_mode=True)),
    (lambda: ft.nn.AvgPool3D(3, 2, 1, count_include_pad=False), lambda nn: nn.AvgPool3d(3, 2, 1, count_include_pad=False)),
    (lambda: ft.nn.GlobalMaxPool3D(), lambda nn: lambda x: nn.AdaptiveMaxPool3d(1)(x)[..., 0, 0, 0, None, None, None]),
    (lambda: ft.nn.GlobalAvgPool3D(), lambda nn: lambda x: nn.AdaptiveAvgPool3d(1)(x)[..., 0, 0, 0, None, None, None]),
])
def test_3d_pooling_matches_torch(make, torch_make):
    torch = pytest.importorskip("torch")
    x = _normal(0, (2, 4, 5, 6, 3))
    expected = np.moveaxis(torch_make(torch.nn)(torch.tensor(np.moveaxis(x, -1, 1))).numpy(), 1, -1)
    y = np.asarray(make()(x))
    np.testing.assert_allclose(y, expected.reshape(y.shape), rtol=0, atol=1e-6 * float(np.abs(expected).max()))


def test_conv3d_gradient_and_axis_names(key):
    conv = ft.nn.Conv3D(2, 3, 2, strides=(1, 2, 1), padding="VALID", key=key)
    with jax.enable_x64(True):
        check_grads(jax.jit(lambda c, x: c(x)), (_x64(conv), _normal(1, (1, 3, 4, 3, 2), np.float64)), order=1,
                    modes=["rev"])
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)Conv3D expects inputs \[\.\.\., depth, height, width, 2\].*"
                       r"channels \(2\) are on axis -4: a channels-first batch \(torch's NCDHW\)"):
        conv(jnp.ones((1, 2, 4, 4, 5)))


@pytest.mark.parametrize("mode,n,padding", [("reflect", 1, 2), ("replicate", 2, (1, 2)), ("circular", 2, "same"),
                                            ("reflect", 3, (1, 0, 2)), ("circular", 1, 3)])
def test_padding_mode_matches_torch(mode, n, padding):
    """torch's padding_mode had no counterpart (zeros only): 1951 settings (1-3 axes, lengths
    1-5, kernels 1-4, int and "same" padding, dilation and strides 1-2) matched torch in
    float64 (2.2e-15 apart) and its 689 refusals were refused alike; float32 here, outputs and
    gradients 2.0e-7 of the values apart measured: atol 10 times it."""
    torch = pytest.importorskip("torch")
    strides = 1 if padding == "same" else 2
    torch.manual_seed(0)
    module = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[n - 1](
        2, 3, 3, stride=strides, padding=padding, dilation=2 if n == 1 else 1, padding_mode=mode)
    layer = (ft.nn.Conv1D, ft.nn.Conv2D, ft.nn.Conv3D)[n - 1](
        2, 3, 3, strides=strides, padding=padding.upper() if isinstance(padding, str) else padding,
        dilation=2 if n == 1 else 1, padding_mode=mode, key=jax.random.key(0))
    _against_torch(layer, module, _normal(0, (2, *(5, 4, 3)[:n], 2)), lambda m, x: m(x), 2e-6)


@pytest.mark.parametrize("mode,length,message", [
    ("reflect", 3, r"Its length \(3\) is too short for reflect padding \(3, 3\) \(3 before, 3 after\): a reflection "
                   r".*each pad must be less than the length"),
    ("circular", 2, r"Its length \(2\) is too short for circular padding \(3, 3\).*wraps the axis around at most once"),
])
def test_a_pad_too_long_for_its_mode_is_refused_as_torch_does(mode, length, message):
    """jnp.pad reflects and wraps any length (torch: "Padding size should be less than the
    corresponding input dimension", "Padding value causes wrapping around more than once")."""
    conv = ft.nn.Conv1D(1, 1, 7, padding=3, padding_mode=mode, key=jax.random.key(0))
    with pytest.raises(ft.nn.LayerInputError, match=rf"(?s)Conv1D expects inputs \[\.\.\., length, 1\] \(float\) with "
                       rf"length >= {length + 1}, got f32\[1,{length},1\].*{message}.*"
                       r'right:  Conv1D\(\.\.\., padding=3, padding_mode="replicate"\)'):
        conv(jnp.ones((1, length, 1)))
    assert conv(jnp.ones((1, length + 1, 1))).shape == (1, length + 1, 1)


def test_a_bad_padding_mode_is_refused_when_built():
    with pytest.raises(ValueError, match=r"(?s)Conv2D: padding_mode='mirror' is not one of torch's \('zeros', "
                       r"'reflect', 'replicate', 'circular'\)"):
        ft.nn.Conv2D(4, 8, 3, padding_mode="mirror", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"(?s)Conv1DTranspose: padding_mode='reflect'; a transposed convolution pads "
                       r"with zeros only"):
        ft.nn.Conv1DTranspose(4, 8, 3, padding_mode="reflect", key=jax.random.key(0))



def test_a_window_longer_than_a_mode_padded_input_names_the_input_as_given():
    """The window check read the input after padding_mode's padding: "Its length (5)" for
    an input of length 3."""
    conv = ft.nn.Conv1D(1, 1, 7, padding=1, padding_mode="replicate", key=jax.random.key(0))
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)with length >= 5, got f32\[1,3,1\].*Its length \(3\) is "
                       r"shorter than the window needs: kernel_size 7, padding \(\(1, 1\),\) adds 2"):
        conv(jnp.ones((1, 3, 1)))


def test_transpose_output_size_is_checked_and_picks_the_high_padding():
    from functree.nn._conv import OUTPUT_SIZE

    assert "output_padding" in OUTPUT_SIZE
    conv = ft.nn.Conv2DTranspose(2, 3, 3, strides=2, padding=1, key=jax.random.key(0))  # torch's p = 1
    x = jnp.ones((1, 4, 3, 2))
    assert conv(x).shape == (1, 7, 5, 3)  # (L - 1) 2 + 2 - 3 + 1 + 1... the layer's own padding
    assert conv(x, output_size=(8, 6)).shape == (1, 8, 6, 3)
    wider = ft.nn.Conv2DTranspose(2, 3, 3, strides=2, padding=((1, 2), (1, 2)), key=jax.random.key(0))
    np.testing.assert_array_equal(conv(x, output_size=(8, 6)), wider(x))
    with pytest.raises(ValueError, match=r"output_size=\(9, 6\) does not fit: .* are \(7, 5\) .* 7\.\.8, 5\.\.6"):
        conv(x, output_size=(9, 6))
    with pytest.raises(ValueError, match=r"not torch's \[N, C, \.\.\.\]"):
        conv(x, output_size=(1, 3, 8, 6))


# Settings whose compile made XLA abort the process (functree/nn/_xla_conv.py): the input
# gradient of a strided convolution with a filter of 2, strides 2 and padding 1 before on one
# axis, a transposed convolution's own forward with a filter of 2, strides 2 and no padding of
# its dilated input on one axis, each beside an axis whose input is smaller than its filter.
ABORTED = [  # cls, input sizes, kernel, strides, dilation, padding
    (ft.nn.Conv2D, (4, 4), (3, 2), 2, 1, ((1, 1), (1, 1))),
    (ft.nn.Conv2D, (1, 4), (2, 2), 2, 1, ((1, 1), (1, 1))),
    (ft.nn.Conv2D, (6, 4), (2, 2), 2, (1, 2), ((1, 1), (0, 0))),
    (ft.nn.Conv3D, (4, 5, 6), (2, 3, 3), 2, (1, 2, 1), ((1, 1), (0, 0), (0, 0))),
    (ft.nn.Conv2DTranspose, (4, 1), (2, 3), (2, 1), 1, ((0, 0), (1, 1))),
    (ft.nn.Conv2DTranspose, (3, 1), (2, 3), (2, 2), 1, ((0, 0), (1, 1))),
]


def _torch_conv(layer, x, pads):
    """torch's convolution (or transposed one) of NumPy ``x`` with ``layer``'s weight and
    bias, float64, channels last in and out; the input and weight gradients of ``sum(y * t)``
    for a fixed ``t``."""
    import torch

    n = layer.weight.ndim - 2
    w = torch.tensor(np.moveaxis(np.asarray(layer.weight, np.float64), (n, n + 1), (1, 0) if not layer._transpose
                                 else (0, 1)).copy(), requires_grad=True)
    xt = torch.tensor(np.moveaxis(x, -1, 1).copy(), requires_grad=True)
    b = torch.tensor(np.asarray(layer.bias, np.float64))
    if layer._transpose:  # lax's pads of the dilated input are torch's d (k - 1) - p, p + output_padding
        k = layer.weight.shape[:n]
        p = [d * (kk - 1) - lo for kk, d, (lo, _) in zip(k, layer.dilation, pads)]
        extra = [hi - lo for lo, hi in pads]
        y = getattr(torch.nn.functional, f"conv_transpose{n}d")(xt, w, b, layer.strides, p, extra, 1, layer.dilation)
    else:
        assert all(lo == hi for lo, hi in pads)
        y = getattr(torch.nn.functional, f"conv{n}d")(xt, w, b, layer.strides, [lo for lo, _ in pads], layer.dilation)
    t = torch.tensor(np.random.default_rng(3).normal(size=y.shape))
    (y * t).sum().backward()
    assert xt.grad is not None and w.grad is not None
    back = np.moveaxis(w.grad.numpy(), (1, 0) if not layer._transpose else (0, 1), (n, n + 1))
    return np.moveaxis(y.detach().numpy(), 1, -1), np.moveaxis(t.numpy(), 1, -1), np.moveaxis(xt.grad.numpy(), 1, -1), back


@pytest.mark.parametrize(("cls", "sizes", "k", "s", "d", "pads"), ABORTED,
                         ids=[f"{c.__name__}-{k}-{s}-{sz}" for c, sz, k, s, _, _ in ABORTED])
def test_settings_xla_aborted_on_compile_and_equal_torchs(key, cls, sizes, k, s, d, pads):
    """These compiled to an abort of the whole process (XLA's `Check failed: ... Window
    dimensions do not match RHS shape`), raw JAX's too; the layers lay them out otherwise:
    the values and both gradients are torch's."""
    with jax.enable_x64(True):
        layer = _x64(cls(2, 3, k, strides=s, dilation=d, padding=pads, key=key,
                         bias_initializer=ft.nn.initializers.normal(1.0)))
        x = _normal(1, (2, *sizes, 2), np.float64)
        expected, t, dx, dw = _torch_conv(layer, x, pads)
        y, pullback = jax.vjp(lambda m, x: m(x), layer, x)
        grad_layer, grad_x = pullback(jnp.asarray(t))
        scale = np.abs(expected).max()
        np.testing.assert_allclose(y, expected, rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(grad_x, dx, rtol=0, atol=1e-12 * np.abs(dx).max())
        np.testing.assert_allclose(grad_layer.weight, dw, rtol=0, atol=1e-12 * np.abs(dw).max())
        jax.jit(jax.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1)))(layer, x)  # the compiled step too


@pytest.mark.parametrize("cls", ["Conv2D", "Conv2DTranspose"])
def test_an_input_of_another_float_dtype_is_promoted_as_dense_does(cls):
    """lax's convolution takes one dtype: a float32 layer given bfloat16 images (or the
    reverse) raised "lax.conv_general_dilated requires arguments to have the same dtypes"
    with no layer named. Both operands are promoted now, as Dense's x @ weight is (strict
    promotion refuses the mix, naming the dtypes)."""
    layer = getattr(ft.nn, cls)(4, 3, 3, key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 5, 4)), jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        y = layer(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layer(x.astype(jnp.float32))))
    with pytest.raises(jax.dtypes.TypePromotionError):
        layer(x)
