"""ft.nn layers against torch's over hyperparameters hypothesis draws (the audit's fuzz, cut down).

Each test draws a layer's settings as a user would pass them to torch, builds both layers,
copies torch's weights in with ``ft.nn.load_torch_state_dict`` and compares the output and the
gradients with respect to the input and every parameter (``torch_state_dict(...,
gradient=True)`` gives ours in torch's names and layouts). float32; shapes stay small so a
draw costs a few compiles. The exploration behind them drew 200-300 examples a layer in
float64 (notes: audit24/layers).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import functree as ft

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _per_axis(draw, n, low, high):
    """An int (every axis) or one per axis, as torch takes them."""
    if draw(st.booleans()):
        return draw(st.integers(low, high))
    return tuple(draw(st.integers(low, high)) for _ in range(n))


def _both(v, n):
    return v if isinstance(v, tuple) else (v,) * n


def _compare(layer, module, x, torch_call, *, channels_first=True, call=lambda m, x: m(x), gradient_floor=0.0):
    """Forward and gradients (input and parameters) of ``layer`` and ``module`` on ``x`` [B, *S, C]
    (``gradient_floor``: the gradients' least absolute tolerance, where torch's rounding is amplified)."""
    layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(layer))  # a template is filled whole
    move, back = ((lambda a: np.moveaxis(a, -1, 1)), (lambda a: np.moveaxis(a, 1, -1))) if channels_first else (
        (lambda a: a), (lambda a: a))
    xt = torch.tensor(move(x), requires_grad=True)
    yt = torch_call(module, xt)
    g = np.random.default_rng(1).normal(size=jax.eval_shape(call, layer, x).shape).astype(np.float32)

    @jax.jit  # one program a draw (eager ops compile one by one)
    def forward_and_backward(layer, x, g):
        y, vjp = jax.vjp(call, layer, x)
        return y, vjp(g)

    y, (grad_layer, grad_x) = forward_and_backward(layer, jnp.asarray(x), jnp.asarray(g))
    expected = back(yt.detach().numpy())
    assert y.shape == expected.shape
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=0, atol=1e-5 * scale)
    yt.backward(torch.tensor(move(g)))
    ours = {"input": np.asarray(grad_x), **ft.nn.torch_state_dict(grad_layer, gradient=True, numpy=True)}
    theirs = {"input": back(xt.grad.numpy()), **{n: p.grad.numpy() for n, p in module.named_parameters()}}
    assert set(theirs) <= set(ours)  # ours also holds BatchNorm's running statistics (no gradient)
    for name, expected in theirs.items():
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=max(1e-5 * scale, gradient_floor), err_msg=name)


@st.composite
def _convolutions(draw):
    n, groups = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
    padding = draw(st.sampled_from(["int", "per axis", "valid", "same", "pairs"]))
    strides = 1 if padding == "same" else _per_axis(draw, n, 1, 2)
    if padding == "int":
        padding = draw(st.integers(0, 2))
    elif padding == "per axis":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(n))
    elif padding == "pairs":
        padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(n))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    lengths = tuple(draw(st.sampled_from([1, 2, 3, 5])) for _ in range(n)) if n == 3 else (
        tuple(draw(st.sampled_from([1, 2, 3, 7])) for _ in range(n)))
    return (n, groups, _per_axis(draw, n, 1, 3), strides, padding, _per_axis(draw, n, 1, 2), draw(st.booleans()),
            mode, lengths)


_TORCH_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")  # torch's, on speed
@settings(max_examples=examples(10), deadline=None)
@given(_convolutions())
@example((3, 2, (1, 2, 3), 1, "same", (1, 2, 1), True, "reflect", (3, 5, 2)))  # 3-D, grouped, reflected "same"
@example((2, 1, 3, 1, 2, 1, False, "circular", (1, 7)))  # circular wraps a pad of 2 round a length of 1: refused
def test_convolutions_match_torchs_over_drawn_settings(case):
    """Conv1d/2d/3d with int, per-axis, "valid", "same" and (by F.pad) asymmetric padding,
    strides, dilation, groups, bias and padding_mode (zeros, reflect, replicate, circular)
    over lengths down to 1: 151 drawn settings (1-D/2-D, zeros) matched in float64; torch's
    refusals (a window longer than the padded input, a reflect pad not shorter than the
    axis, a circular one longer) are refused alike, by name."""
    n, groups, k, s, p, d, bias, mode, lengths = case
    pairs = isinstance(p, tuple) and isinstance(p[0], tuple)
    torch.manual_seed(0)
    module = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[n - 1](
        2 * groups, 3 * groups, k, stride=s, padding=0 if pairs else p, dilation=d, groups=groups, bias=bias,
        padding_mode=mode)
    def make():
        return (ft.nn.Conv1D, ft.nn.Conv2D, ft.nn.Conv3D)[n - 1](
            2 * groups, 3 * groups, k, strides=s, dilation=d, groups=groups,
            padding=p.upper() if isinstance(p, str) else p, use_bias=bias, padding_mode=mode, key=jax.random.key(0))
    flat = [v for pair in reversed(p) for v in pair] if pairs else []
    x = np.random.default_rng(0).normal(size=(2, *lengths, 2 * groups)).astype(np.float32)

    def torch_call(m, x):
        return m(F.pad(x, flat, mode=_TORCH_PAD_MODES[mode]) if flat else x)

    try:
        torch_call(module, torch.tensor(np.moveaxis(x, -1, 1)))
    except RuntimeError:  # torch's refusal: ours is named
        event(f"{n}-D {mode}: refused")  # the draw counts --hypothesis-show-statistics reports
        with pytest.raises(ft.nn.LayerInputError, match=r"is shorter than the window needs|is too short for"):
            make()(x)
        return
    event(f"{n}-D {mode}: matched")
    # its shapes only (jax.eval_shape; _compare fills every leaf from torch's state dict): no
    # eager programs of an initialisation whose values are replaced
    _compare(jax.eval_shape(make), module, x, torch_call)


@settings(max_examples=examples(8), deadline=None)
@given(st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 3]), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2),
       st.integers(0, 2), st.integers(1, 2), st.booleans(),
       st.sampled_from(["zeros"] * 3 + ["reflect", "replicate", "circular"]))  # zeros mostly: the others are refused
@example(n=1, groups=2, k=3, s=2, p=1, op=1, d=1, bias=True, mode="zeros")  # grouped, as a depthwise upsampling layer
@example(n=2, groups=1, k=1, s=2, p=1, op=1, d=1, bias=False, mode="zeros")  # p > d*(k-1): a negative pad, cropping
@example(n=3, groups=3, k=2, s=2, p=0, op=1, d=2, bias=True, mode="zeros")  # 3-D: grouped, dilated, output_padding
@example(n=1, groups=1, k=1, s=1, p=2, op=0, d=2, bias=False, mode="zeros")  # cropped away: oneDNN's error in torch
def test_transposed_convolutions_match_torchs_by_the_documented_padding(n, groups, k, s, p, op, d, bias, mode):
    """ConvTranspose1d/2d/3d(padding=p, output_padding=op, groups=g) is padding=((d*(k-1)-p,
    d*(k-1)-p+op),) per axis here; groups were refused ("lax.conv_transpose has no feature
    groups") and so was p > d*(k-1) (its negative pad): both are torch's now (73 drawn
    grouped settings matched in float64). A padding_mode other than zeros is refused as
    torch refuses it (TRANSPOSE_PADDING_MODE)."""
    op = min(op, max(s, d) - 1)  # torch's limit
    torch_class = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)[n - 1]
    ft_class = (ft.nn.Conv1DTranspose, ft.nn.Conv2DTranspose, ft.nn.Conv3DTranspose)[n - 1]
    if mode != "zeros":
        event(f"{n}-D padding_mode {mode}: refused")
        with pytest.raises(ValueError, match='Only "zeros" padding mode is supported'):
            torch_class(2, 2, k, stride=s, padding_mode=mode)
        with pytest.raises(ValueError, match="a transposed convolution pads with zeros only"):
            ft_class(2, 2, k, strides=s, padding_mode=mode, key=jax.random.key(0))
        return
    torch.manual_seed(0)
    module = torch_class(2 * groups, 2 * groups, k, stride=s, padding=p, output_padding=op, groups=groups, bias=bias,
                         dilation=d)
    low = d * (k - 1) - p
    def make():
        return ft_class(2 * groups, 2 * groups, k, strides=s, dilation=d, groups=groups,
                        padding=((low, low + op),) * n, use_bias=bias, key=jax.random.key(0))

    layer = jax.eval_shape(make)  # shapes only: _compare fills every leaf from torch's state dict
    assert layer.in_channels == layer.out_channels == 2 * groups
    x = np.random.default_rng(0).normal(size=(2, *(3,) * n, 2 * groups)).astype(np.float32)
    if (3 - 1) * s - 2 * p + d * (k - 1) + op + 1 < 1:  # cropped away: refused (torch: an error or empty maps)
        event(f"{n}-D: cropped away, refused")
        try:
            assert module(torch.tensor(np.moveaxis(x, -1, 1))).numel() == 0
        except RuntimeError as e:
            # (torch's messages: its own check, or oneDNN's for a negative size: "could not
            # construct a memory descriptor", k=1, p=2, d=2 in 1-D)
            assert any(m in str(e) for m in ("Output size is too small", "overflow", "memory descriptor")), e
        with pytest.raises(ft.nn.LayerInputError, match="is shorter than the window needs"):
            make()(x)
        return
    event(f"{n}-D: matched")
    _compare(layer, module, x, lambda m, x: m(x))


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_a_transposes_named_padding_is_lax_conv_transposes(padding):
    """The grouped path pads by name itself (``transpose_padding``): groups=1 gives
    ``lax.conv_transpose``'s numbers, as before, over strides, dilations and kernels."""
    x = np.random.default_rng(0).normal(size=(1, 5, 4, 2)).astype(np.float32)
    for k, s, d in [((1, 4), (3, 1), (1, 2)), ((3, 2), (2, 2), (2, 1)), ((2, 5), (1, 3), (1, 1))]:
        layer = ft.nn.Conv2DTranspose(2, 3, k, strides=s, dilation=d, padding=padding, key=jax.random.key(0))
        expected = jax.lax.conv_transpose(x, jnp.flip(layer.weight, (0, 1)), s, padding, rhs_dilation=d,
                                          dimension_numbers=("NHWC", "HWIO", "NHWC")) + layer.bias[None, None, None, :]
        np.testing.assert_allclose(layer(x), expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


@st.composite
def _pools(draw):
    n, op = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from(["max", "avg"]))
    k, s = draw(st.integers(1, 3)), draw(st.none() | st.integers(1, 3))
    padding, count_pad = draw(st.sampled_from(["SAME", "VALID", 0, 1, 2])), draw(st.booleans())
    ceil_mode = draw(st.booleans()) and padding != "SAME"  # refused with "SAME" (CEIL_MODE_SAME): torch has no "SAME"
    dilation = draw(st.integers(1, 3)) if op == "max" else 1  # torch's avg_pool has none
    lengths = tuple(draw(st.integers(1, 5 if n == 3 else 6)) for _ in range(n))
    return n, op, k, s, padding, count_pad, ceil_mode, dilation, lengths


@settings(max_examples=examples(12), deadline=None)
@given(_pools())
@example((3, "max", 2, 1, 1, True, True, 2, (4, 2, 5)))  # 3-D, dilated, ceil_mode, a window in the padding's end
@example((2, "avg", 3, 2, 1, False, True, 1, (4, 5)))  # ceil_mode's overhang uncounted, the padding not counted
@example((1, "max", 2, None, 1, False, False, 3, (2,)))  # reads -1 and 2 of a length 2: -inf, refused (was silent)
@example((3, "avg", 2, None, "VALID", False, False, 1, (1, 1, 1)))  # too short: refused by both
@example((3, "avg", 2, None, 1, False, False, 1, (1, 1, 1)))  # torch's avg_pool3d refuses before padding; ours pools
@example((3, "avg", 2, None, "VALID", False, True, 1, (1, 1, 1)))  # ... and before ceil_mode's window: ours pools
def test_pooling_matches_torchs_over_drawn_settings(case):
    """MaxPool/AvgPool 1d/2d/3d against torch's: torch's padding=p (above k // 2 refused alike),
    count_include_pad either way, ceil_mode, max pooling's dilation, and the padding "SAME"
    stands for (-inf for max; the mean of the real elements): 261 drawn 1-D/2-D settings
    matched in float64, gradients too; inputs too short for the window refused alike."""
    n, op, k, s, padding, count_pad, ceil_mode, d, lengths = case
    strides = k if s is None else s
    span = d * (k - 1) + 1
    pool = getattr(F, f"{op}_pool{n}d")
    cls = getattr(ft.nn, f"{op.capitalize()}Pool{n}D")
    settings = {"dilation": d} if op == "max" else {"count_include_pad": count_pad}
    if isinstance(padding, int) and padding > k // 2:  # torch: "pad should be at most half of ... kernel size"
        event(f"{n}-D {op}: padding over half the pool, refused")
        with pytest.raises(RuntimeError, match=r"half of (effective )?kernel size"):
            pool(torch.zeros((1, 1, *(8,) * n)), k, strides, padding, ceil_mode=ceil_mode, **settings)
        with pytest.raises(ValueError, match="is more than half the pool"):
            cls(k, s, padding, ceil_mode=ceil_mode, **settings)
        return
    pads = [(0, 0)] * n
    if padding == "SAME":
        pads = [(total // 2, total - total // 2) for total in (max((math.ceil(length / strides) - 1) * strides + span
                                                                    - length, 0) for length in lengths)]
    flat = [v for pair in reversed(pads) for v in pair]

    def torch_pool(x):
        if isinstance(padding, int) or padding == "VALID":
            return pool(x, k, strides, padding if isinstance(padding, int) else 0, ceil_mode=ceil_mode, **settings)
        if op == "max":
            return pool(F.pad(x, flat, value=-math.inf), k, strides, dilation=d)
        return pool(F.pad(x, flat), k, strides) / pool(F.pad(torch.ones_like(x), flat), k, strides)

    layer = cls(k, s, padding, ceil_mode=ceil_mode, **settings)
    x = np.random.default_rng(0).normal(size=(2, *lengths, 3)).astype(np.float32)
    kind = f"{n}-D {op}" + (", ceil_mode" if ceil_mode else "") + (", dilated" if d > 1 else "")
    try:
        with torch.no_grad():
            forward = torch_pool(torch.tensor(np.moveaxis(x, -1, 1)))
    except RuntimeError as e:  # torch's refusal: ours is named
        if "smaller than kernel size" in str(e):
            # torch's avg_pool3d alone checks the unpadded input against the kernel; its max_pool3d
            # (and avg_pool1d/2d) pool such an input's padded windows, as ours do: their shape
            try:
                with torch.no_grad():
                    shape = F.max_pool3d(torch.tensor(np.moveaxis(x, -1, 1)), k, strides, padding if isinstance(
                        padding, int) else 0, ceil_mode=ceil_mode).shape
            except RuntimeError:
                pass
            else:
                event(f"{kind}: torch's avg_pool3d refuses the unpadded input, ours pools it")
                y = np.asarray(layer(x))
                assert np.moveaxis(y, -1, 1).shape == shape and np.isfinite(y).all()
                return
        event(f"{kind}: refused")
        with pytest.raises(ft.nn.LayerInputError, match="is shorter than the window needs"):
            layer(x)
        return
    if torch.isinf(forward).any():  # a dilated window wholly in the padding: torch's -inf, its backward out of bounds
        event(f"{kind}: a window in the padding, refused")
        with pytest.raises(ft.nn.LayerInputError, match="reading only padding"):
            layer(x)
        return
    event(f"{kind}: matched")
    _compare(layer, torch.nn.Identity(), x, lambda m, x: torch_pool(x))


@settings(max_examples=examples(8), deadline=None)
@given(st.sampled_from(["layer", "rms", "group", "batch_train", "batch_eval"]), st.sampled_from([1e-5, 0.1]),
       st.booleans(), st.sampled_from([2, 4]), st.integers(0, 2))
@example("group", 1e-5, False, 4, 0)  # groups of one value: torch's gradient is rounding times 1/sqrt(eps)
def test_normalizations_match_torchs_over_drawn_settings(kind, eps, affine, channels, spatial):
    """LayerNorm/RMSNorm over 1 or 2 trailing axes, GroupNorm (groups dividing the channels;
    channels groups is torch's InstanceNorm), BatchNorm in training (with torch's momentum
    and unbiased running variance) and in eval: 151 drawn settings matched in float64."""
    x = (np.random.default_rng(0).normal(size=(3, *(3,) * spatial, channels)) * 10 + 5).astype(np.float32)
    torch.manual_seed(0)
    if kind in ("layer", "rms"):
        shape = x.shape[-1 - (spatial > 0):]
        module = (torch.nn.LayerNorm if kind == "layer" else torch.nn.RMSNorm)(shape, eps=eps, elementwise_affine=affine)
        layer = (ft.nn.LayerNorm(shape, eps, affine, affine) if kind == "layer" else ft.nn.RMSNorm(shape, eps, affine))
        first = False
    elif kind == "group":
        groups = channels // 2 if affine else channels
        module, layer = torch.nn.GroupNorm(groups, channels, eps=eps, affine=affine), ft.nn.GroupNorm(
            groups, channels, eps, affine, affine)
        first = True
    else:
        module = torch.nn.BatchNorm1d(channels, eps=eps, momentum=0.3).train(kind == "batch_train")
        layer = ft.nn.BatchNorm(channels, momentum=0.7, epsilon=eps, unbiased_running_variance=True,
                                training=kind == "batch_train")
        first = True
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.add_(torch.rand(tensor.shape))  # off the ones and zeros they start at
    call = (lambda m, x: m(x.reshape(3, channels, -1)).reshape(x.shape)) if kind.startswith("batch") else (
        lambda m, x: m(x))
    loaded = ft.nn.load_torch_state_dict(layer, module.state_dict())
    # A group of one value (channels groups, no spatial axes: the explore profile drew it) has
    # x - mean = 0 and an input gradient of exactly 0; torch's float32 gradient there is its
    # rounding times 1/sqrt(eps) (measured 3.1e-5 at eps 1e-5, |g| < 5): 8 ulps of that bound.
    single = kind == "group" and not affine and spatial == 0
    floor = 8 * float(np.finfo(np.float32).eps) * 5 / np.sqrt(eps) if single else 0.0
    _compare(layer, module, x, call, channels_first=first,  # training records running statistics: collected
             call=lambda m, x: ft.nn.collect_state(lambda m: m(x), m)[0], gradient_floor=floor)
    if kind == "batch_train":  # the running statistics after torch's one step
        _, state = ft.nn.collect_state(lambda m: m(x), loaded)
        stepped = ft.nn.apply_state(loaded, state)
        np.testing.assert_allclose(stepped.running_mean, module.running_mean.numpy(), rtol=0, atol=1e-5 * 10)
        np.testing.assert_allclose(stepped.running_variance, module.running_var.numpy(), rtol=0, atol=1e-5 * 100)


@st.composite
def _attentions(draw):
    heads = draw(st.integers(1, 2))
    other = draw(st.booleans())  # kdim/vdim other than the embedding (torch's separate q/k/v weights)
    return (heads, 2 * heads, (3, 5) if other else (None, None), draw(st.booleans()), draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3])), draw(st.sets(st.sampled_from(["mask", "padding",
                                                                                          "causal"]))))


@settings(max_examples=examples(5), deadline=None)
@given(_attentions())
def test_multihead_attention_matches_torchs_over_drawn_masks(case):
    """torch's MultiheadAttention (dropout 0, batch_first) with kdim/vdim, bias, a boolean
    attn_mask (True = masked: ours is its negation), a key_padding_mask and a causal mask,
    batch 1 or 2: 114 drawn settings matched in float64 (rows with every key masked left
    out: documented to differ)."""
    heads, embed, (kdim, vdim), bias, batch, t, s, masks = case
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(embed, heads, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    allowed = np.ones((batch, 1, t, s), bool)
    if "mask" in masks:
        allowed &= rng.random((t, s)) < 0.7
    if "padding" in masks:
        allowed &= (rng.random((batch, s)) < 0.8)[:, None, None, :]
    if "causal" in masks:
        allowed &= np.tril(np.ones((t, s), bool))
    allowed[..., 0] = True  # every query keeps a key
    layer = jax.eval_shape(lambda: ft.nn.MultiheadAttention(  # shapes only: _compare fills them from torch's
        embed, heads, key_size=kdim, value_size=vdim, use_bias=bias, key=jax.random.key(0)))
    q = rng.normal(size=(batch, t, embed)).astype(np.float32)
    k = rng.normal(size=(batch, s, kdim or embed)).astype(np.float32)
    v = rng.normal(size=(batch, s, vdim or embed)).astype(np.float32)
    masked = torch.tensor(~allowed[:, 0]).repeat_interleave(heads, 0)  # torch's [batch * heads, T, S], True = masked
    _compare(layer, module, q, lambda m, q: m(q, torch.tensor(k), torch.tensor(v), need_weights=False,
                                              attn_mask=masked)[0],
             channels_first=False, call=lambda m, q: m(q, k, v, mask=allowed))


@settings(max_examples=examples(4), deadline=None)
@given(st.sampled_from(["GRU", "LSTM", "RNN tanh", "RNN relu"]), st.integers(1, 3), st.integers(1, 4),
       st.sampled_from([1, 2, 4]), st.sampled_from([(), (1,), (2,)]), st.booleans())
@example(kind="RNN relu", inputs=2, hidden=3, steps=4, batch=(2,), reverse=True)  # SimpleRNNCell, relu, reversed
def test_recurrent_layers_match_torchs_over_drawn_sizes(kind, inputs, hidden, steps, batch, reverse):
    """RNN(GRUCell / LSTMCell / SimpleRNNCell) against torch's one-layer GRU / LSTM / RNN
    (nonlinearity tanh or relu; batch_first, or unbatched), one step or several; reverse=True
    against a bidirectional layer's second half. The exploration drew 60 stacks of 1-3 layers,
    bidirectional or not, time-major or batch-first, with initial states: outputs, final
    states and every gradient matched in float64."""
    torch.manual_seed(0)
    kind, _, nonlinearity = kind.partition(" ")
    options = {"nonlinearity": nonlinearity} if nonlinearity else {}
    module = getattr(torch.nn, kind)(inputs, hidden, batch_first=True, bidirectional=reverse, **options)
    def make():
        cell = (ft.nn.SimpleRNNCell(inputs, hidden, key=jax.random.key(0), activation=getattr(ft.nn, nonlinearity))
                if kind == "RNN" else getattr(ft.nn, f"{kind}Cell")(inputs, hidden, key=jax.random.key(0)))
        return ft.nn.RNN(cell, reverse=reverse)

    event(f"{kind} {nonlinearity}".strip())
    layer = jax.eval_shape(make)  # shapes only: _compare fills every leaf from torch's state dict
    x = np.random.default_rng(0).normal(size=(*batch, steps, inputs)).astype(np.float32)
    half = slice(hidden, None) if reverse else slice(None)  # a bidirectional output's reverse half
    _compare(layer, _Direction(module, reverse), x, lambda m, x: m.module(x)[0][..., half], channels_first=False)


_STACKS = {"GRU": "GRU", "LSTM": "LSTM", "RNN": "SimpleRNN"}


@st.composite
def _stacked_rnns(draw):
    kind, _, nonlinearity = draw(st.sampled_from(["GRU", "LSTM", "RNN tanh", "RNN relu"])).partition(" ")
    return (kind, nonlinearity, draw(st.integers(1, 3)), draw(st.booleans()), draw(st.booleans()),
            draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([1, 3])),
            draw(st.sampled_from([(), (2,)])), draw(st.booleans()), draw(st.booleans()))


@settings(max_examples=examples(1), deadline=None)
@given(_stacked_rnns())
@example(("LSTM", "", 2, True, True, 2, 3, 3, (2,), True, True))  # 2 layers, bidirectional, torch's (h_0, c_0)
@example(("RNN", "relu", 2, True, False, 1, 2, 3, (), False, True))  # unbatched, time-major, no bias
def test_stacked_recurrent_layers_match_torchs_in_float64(case):
    """ft.nn.LSTM / GRU / SimpleRNN against torch's nn.LSTM / GRU / RNN (num_layers 1-3,
    bidirectional, bias on and off, batch_first or time-major, unbatched, a given h_0) in
    float64: torch's state dict loaded (weight_ih_l1_reverse...), outputs, the final state
    stacked as torch's h_n (c_n), the gradients of the input and every tensor, and the state
    dict written back equal to torch's. The exploration drew 200 cases: outputs and states
    at most 8.9e-16 off, gradients 1.2e-15 x max(1, |gradient|) (atol 1e-14 x scale)."""
    kind, nonlinearity, layers, bidirectional, bias, inputs, hidden, steps, batch, batch_first, given = case
    torch.manual_seed(0)
    options = {"nonlinearity": nonlinearity} if nonlinearity else {}
    module = getattr(torch.nn, kind)(inputs, hidden, layers, bias=bias, batch_first=batch_first,
                                     bidirectional=bidirectional, **options).double()
    event(kind)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(*batch, steps, inputs) if batch_first else (steps, *batch, inputs))
    states = layers * (2 if bidirectional else 1)
    h0 = [rng.normal(size=(states, *batch, hidden)) for _ in range(2 if kind == "LSTM" else 1)] if given else None
    with jax.enable_x64(True):
        layer = jax.eval_shape(lambda: getattr(ft.nn, _STACKS[kind])(  # shapes only: torch's tensors fill it
            inputs, hidden, layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional,
            dtype=jnp.float64, key=jax.random.key(0), **options))
        layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
        start = None if h0 is None else ft.nn.LSTMState(*h0) if kind == "LSTM" else h0[0]

        def run(layer, x):
            ys, final = layer(x, start, return_state=True)
            stacked = jax.tree.map(lambda *s: jnp.stack(s), *final)  # torch's h_n (an LSTM's (h_n, c_n))
            return ys, tuple(stacked) if kind == "LSTM" else (stacked,)

        @jax.jit  # one program a draw
        def forward_and_backward(layer, x, cotangents):
            out, vjp = jax.vjp(run, layer, x)
            return out, vjp(cotangents)

        shapes = jax.eval_shape(run, layer, x)
        cotangents = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), shapes)
        (ys, final), (grad_layer, grad_x) = forward_and_backward(layer, jnp.asarray(x), cotangents)
        xt = torch.tensor(x, requires_grad=True)
        start_t = None if h0 is None else tuple(map(torch.tensor, h0)) if kind == "LSTM" else torch.tensor(h0[0])
        yt, final_t = module(xt, start_t)
        final_t = final_t if kind == "LSTM" else (final_t,)
        for ours, theirs in zip((ys, *final), (yt, *final_t)):
            expected = theirs.detach().numpy()
            np.testing.assert_allclose(np.asarray(ours), expected, rtol=0,
                                       atol=1e-14 * max(1.0, float(np.abs(expected).max(initial=0))))
        torch.autograd.backward((yt, *final_t), [torch.tensor(np.asarray(c)) for c in (cotangents[0], *cotangents[1])])
        ours = {"input": np.asarray(grad_x), **ft.nn.torch_state_dict(grad_layer, gradient=True, numpy=True)}
        theirs = {"input": xt.grad.numpy(), **{n: p.grad.numpy() for n, p in module.named_parameters()}}
        assert set(ours) == set(theirs)
        for name, expected in theirs.items():
            scale = max(1.0, float(np.abs(expected).max()))
            np.testing.assert_allclose(ours[name], expected, rtol=0, atol=1e-14 * scale, err_msg=name)
        written = ft.nn.torch_state_dict(layer, numpy=True)
        summed = {k: v for k, v in module.state_dict().items()}
        if kind == "LSTM" and bias:  # one bias, written as (b_ih + b_hh, 0)
            summed = {k: (v + summed[k.replace("_ih", "_hh")] if "bias_ih" in k else 0 * v if "bias_hh" in k else v)
                      for k, v in summed.items()}
        assert set(written) == set(summed)
        for name, value in summed.items():
            np.testing.assert_array_equal(written[name], value.numpy(), err_msg=name)


class _Direction(torch.nn.Module):
    """torch's recurrent layer, its parameters named without (or only with) ``_reverse``: one direction's."""

    def __init__(self, module, reverse):
        super().__init__()
        self.module, self.reverse = module, reverse

    def state_dict(self, *args, **kwargs):
        return {k: v for k, v in self.module.state_dict().items() if k.endswith("_reverse") == self.reverse}

    def named_parameters(self, *args, **kwargs):
        return ((k, v) for k, v in self.module.named_parameters() if k.endswith("_reverse") == self.reverse)


def test_a_dilated_max_window_wholly_in_the_padding_is_refused():
    """torch's pad check reads the pool size, not the dilated span: MaxPool1d(2, padding=1,
    dilation=3) on a length 2 reads positions -1 and 2, both padding, and gives -inf (its
    backward then writes the gradient at index 2, past the input). Ours gave -inf without a
    word; now WINDOW_IN_PADDING, with "SAME" too. A length that puts an element in every window
    pools as before."""
    from functree.nn._pooling import WINDOW_IN_PADDING

    assert "reading only padding" in WINDOW_IN_PADDING
    x = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    with pytest.raises(ft.nn.LayerInputError, match=r"leaves window 0 reading only padding: .* positions \[0, 3\]"):
        ft.nn.MaxPool1D(2, None, 1, dilation=3)(x)
    with pytest.raises(ft.nn.LayerInputError, match="reading only padding"):
        ft.nn.MaxPool1D(2, 1, "SAME", dilation=3)(x[:, :1])
    np.testing.assert_array_equal(ft.nn.MaxPool1D(2, None, 1, dilation=3)(np.concatenate([x, x], 1))[0, 0], x[0, 0])


@st.composite
def _adaptive_pools(draw):
    n, op = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from(["max", "avg"]))
    lengths = tuple(draw(st.integers(0, 4 if n == 3 else 7)) for _ in range(n))
    size = draw(st.just("global") | st.integers(1, 5) | st.tuples(*(st.none() | st.integers(1, 5) for _ in range(n))))
    return n, op, lengths, size


@settings(max_examples=examples(8), deadline=None)
@given(_adaptive_pools())
@example((2, "max", (7, 3), (3, None)))  # uneven, overlapping windows; None keeps the width
@example((3, "avg", (2, 3, 4), "global"))  # GlobalAvgPool3D: torch's AdaptiveAvgPool3d(1), flattened
@example((1, "avg", (0,), 1))  # torch: NaN; ours refused
def test_adaptive_pools_match_torchs_over_drawn_sizes(case):
    """AdaptiveAvg/MaxPool1D/2D/3D against torch's (output sizes above, below and equal to the
    input's, None entries) and GlobalAvg/MaxPool3D against AdaptiveAvg/MaxPool3d(1); an empty
    axis is refused (EMPTY_ADAPTIVE, EMPTY_MAX) where torch raises or (an average to an int
    size) gives NaN; a global average is NaN in both."""
    n, op, lengths, size = case
    x = np.random.default_rng(0).normal(size=(2, *lengths, 3)).astype(np.float32)
    # torch's 1-D takes no None (2-D/3-D keep that axis's size): the length it stands for
    shown = size if n > 1 or not isinstance(size, tuple) or size[0] is not None else (lengths[0],)
    module = getattr(torch.nn, f"Adaptive{op.capitalize()}Pool{n}d")(1 if size == "global" else shown)
    if size == "global":
        layer, call = getattr(ft.nn, f"Global{op.capitalize()}Pool{n}D")(), lambda m, x: m(x).flatten(1)
    else:
        layer, call = getattr(ft.nn, f"Adaptive{op.capitalize()}Pool{n}D")(size), lambda m, x: m(x)
    kind = f"{n}-D {op} " + ("global" if size == "global" else "adaptive")
    if 0 in lengths:
        event(f"{kind}: an empty axis")
        if size == "global" and op == "avg":  # NaN in both
            with torch.no_grad():
                assert torch.isnan(call(module, torch.tensor(np.moveaxis(x, -1, 1)))).all()
            assert np.isnan(np.asarray(layer(x))).all()
            return
        try:  # torch's max raises; its average raises, or gives NaN for an int size
            with torch.no_grad():
                assert torch.isnan(call(module, torch.tensor(np.moveaxis(x, -1, 1)))).all() and op == "avg"
        except RuntimeError:
            pass
        with pytest.raises(ft.nn.LayerInputError, match="is empty"):
            layer(x)
        return
    event(f"{kind}: matched")
    _compare(layer, module, x, call)  # a global pool's [B, C]: moving axis 1 to the end leaves it


def _jitted_vjp(f, x, seed):
    """``f(x)``'s outputs (a tuple of arrays, integer ones without gradient) and the gradient
    of x for a cotangent drawn for the first, in one program."""
    shapes = jax.eval_shape(f, x)
    g = jnp.asarray(np.random.default_rng(seed).normal(size=shapes[0].shape))

    @jax.jit
    def run(x, g):
        out, vjp = jax.vjp(lambda x: f(x)[0], x)
        return (out, *f(x)[1:]), vjp(g)[0]

    outs, grad = run(x, g)
    return (*outs, grad, np.asarray(g))


def _first_class(x):
    return np.moveaxis(np.asarray(x), -1, 1)


@st.composite
def _indexed_pools(draw):
    n, k = draw(st.sampled_from([1, 2, 3])), draw(st.integers(1, 3))
    s, p, d = draw(st.integers(1, 3)), draw(st.integers(0, k // 2)), draw(st.integers(1, 2))
    lengths = tuple(draw(st.integers(1, 4 if n == 3 else 6)) for _ in range(n))
    return n, k, s, p, d, draw(st.booleans()), lengths, draw(st.booleans())


@settings(max_examples=examples(4), deadline=None)
@given(_indexed_pools())
@example((2, 3, 2, 1, 1, True, (5, 6), True))  # overlapping windows, ceil_mode, ties: unpool's output_size refused?
@example((2, 2, 2, 0, 1, False, (4, 6), True))  # SegNet's 2x2: ties, unpool and its gradient as torch's
def test_max_pools_return_indices_and_unpool_as_torchs_in_float64(case):
    """MaxPool{n}D(return_indices=True) against torch's in float64: the maxima, their flat
    per-plane indices (ties: the first; inputs rounded to draw them) and the input's gradient;
    MaxUnpool{n}D(output_size=the input's sizes) against torch's MaxUnpool{n}d: values, and
    the gradient of its input where no two windows picked one element (there torch's gathers
    the gradient for each, ours gives it once: _unpooled). An output_size torch refuses is
    refused alike (UNPOOL_OUTPUT_SIZE). 200 drawn cases passed (values, indices and unpooling
    equal; the pool's gradient within 1e-14, summed in another order where windows overlap)."""
    n, k, s, p, d, ceil_mode, lengths, ties = case
    x = np.random.default_rng(0).normal(size=(2, *lengths, 2))
    x = np.round(x) if ties else x
    module = getattr(torch.nn, f"MaxPool{n}d")(k, s, p, dilation=d, ceil_mode=ceil_mode, return_indices=True)
    xt = torch.tensor(_first_class(x), requires_grad=True)
    try:
        yt, it = module(xt)
    except RuntimeError:
        event("pool refused")
        return  # too short: refused alike (test_pooling_matches_torchs_over_drawn_settings)
    if torch.isinf(yt).any():
        event("a window in the padding")
        return  # refused (WINDOW_IN_PADDING, tested above)
    with jax.enable_x64(True):
        pool = getattr(ft.nn, f"MaxPool{n}D")(k, s, p, dilation=d, ceil_mode=ceil_mode, return_indices=True)
        y, i, gx, g = _jitted_vjp(pool, jnp.asarray(x), 1)
        np.testing.assert_array_equal(_first_class(y), yt.detach().numpy())
        np.testing.assert_array_equal(_first_class(i), it.numpy())
        yt.backward(torch.tensor(_first_class(g)))
        np.testing.assert_allclose(_first_class(gx), xt.grad.numpy(), rtol=0, atol=1e-14)
        unpool = getattr(ft.nn, f"MaxUnpool{n}D")(k, s, p)
        yt2 = yt.detach().requires_grad_()
        try:
            ut = getattr(torch.nn, f"MaxUnpool{n}d")(k, s, p)(yt2, it, output_size=lengths)
        except ValueError:
            event("unpool's output_size refused")
            with pytest.raises(ValueError, match="does not fit"):
                unpool(y, i, output_size=lengths)
            return
        u, gy, gu = _jitted_vjp(lambda y: (unpool(y, i, output_size=lengths),), y, 2)
        np.testing.assert_array_equal(_first_class(u), ut.detach().numpy())
        planes = np.asarray(i).reshape(2, -1, 2)
        if all(len(set(planes[b, :, c])) == planes.shape[1] for b in range(2) for c in range(2)):
            event("unpooled, indices unique")
            ut.backward(torch.tensor(_first_class(gu)))
            np.testing.assert_array_equal(_first_class(gy), yt2.grad.numpy())
        else:
            event("unpooled, an element picked twice")


@settings(max_examples=examples(4), deadline=None)
@given(st.sampled_from([2, 3]), st.integers(1, 3), st.integers(1, 3), st.integers(0, 1), st.booleans(), st.booleans(),
       st.sampled_from([-3, 1, 2, 5]))
@example(2, 3, 2, 1, True, False, 5)  # ceil_mode's partial window and the padding divided by 5 alike
def test_avg_pool_divisor_override_matches_torchs(n, k, s, p, ceil_mode, count_pad, divisor):
    """AvgPool{2,3}D(divisor_override=) against torch's (its 1-D has none) in float64: every
    window's sum divided by the divisor, whatever the padding, count_include_pad or ceil_mode.
    576 settings (a grid) were at most 8.9e-16 off, values and gradients (atol 9e-15); 200
    drawn cases passed."""
    p = min(p, k // 2)
    x = np.random.default_rng(0).normal(size=(2, *(5,) * n, 2))
    module = getattr(torch.nn, f"AvgPool{n}d")(k, s, p, ceil_mode, count_pad, divisor)
    with jax.enable_x64(True):
        layer = getattr(ft.nn, f"AvgPool{n}D")(k, s, p, count_include_pad=count_pad, ceil_mode=ceil_mode,
                                                divisor_override=divisor)
        xt = torch.tensor(_first_class(x), requires_grad=True)
        yt = module(xt)
        y, gx, g = _jitted_vjp(lambda x: (layer(x),), jnp.asarray(x), 1)
        np.testing.assert_allclose(_first_class(y), yt.detach().numpy(), rtol=0, atol=9e-15)
        yt.backward(torch.tensor(_first_class(g)))
        np.testing.assert_allclose(_first_class(gx), xt.grad.numpy(), rtol=0, atol=9e-15)


@settings(max_examples=examples(2), deadline=None)
@given(st.sampled_from([1, 2, 3]), st.data())
@example(2, None)  # uneven, overlapping windows of rounded (tied) values, one axis kept
def test_adaptive_max_pools_return_indices_as_torchs(n, data):
    """AdaptiveMaxPool{n}D(return_indices=True) against torch's in float64 over output sizes
    above, below and equal to the input's (None kept): the maxima, their flat per-plane
    indices (ties: the first in row-major order) and the input's gradient (an element two
    windows pick sums its two in another order: within 1e-14). 200 drawn cases passed."""
    if data is None:
        lengths, size = (7, 5), (3, None)
    else:
        lengths = tuple(data.draw(st.integers(1, 4 if n == 3 else 7)) for _ in range(n))
        size = tuple(data.draw(st.integers(1, 5) if n == 1 else st.none() | st.integers(1, 5)) for _ in range(n))
    x = np.round(np.random.default_rng(0).normal(size=(2, *lengths, 2)))
    shown = tuple(length if v is None else v for v, length in zip(size, lengths)) if n == 1 else size
    module = getattr(torch.nn, f"AdaptiveMaxPool{n}d")(shown, return_indices=True)
    xt = torch.tensor(_first_class(x), requires_grad=True)
    yt, it = module(xt)
    with jax.enable_x64(True):
        layer = getattr(ft.nn, f"AdaptiveMaxPool{n}D")(size, return_indices=True)
        y, i, gx, g = _jitted_vjp(layer, jnp.asarray(x), 1)
        np.testing.assert_array_equal(_first_class(y), yt.detach().numpy())
        np.testing.assert_array_equal(_first_class(i), it.numpy())
        yt.backward(torch.tensor(_first_class(g)))  # an element picked by several windows: summed in another order
        np.testing.assert_allclose(_first_class(gx), xt.grad.numpy(), rtol=0, atol=1e-14)


@settings(max_examples=examples(4), deadline=None)
@given(st.sampled_from([1, 2, 3]), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2), st.integers(1, 2),
       st.integers(-1, 3))
@example(2, 3, 2, 1, 1, 1)  # torch's output_padding 1 picked by output_size
@example(1, 2, 3, 0, 2, 3)  # past the stride: refused alike
def test_transposed_convolution_output_size_picks_torchs_output_padding(n, k, s, p, d, extra):
    """ConvTranspose{n}D(x, output_size=) against torch's forward(x, output_size) in float64:
    the sizes from the smallest (output_padding 0) up to the stride minus 1 above it match,
    values and gradients; others are refused alike (OUTPUT_SIZE). 216 settings (a grid) were
    at most 4.4e-16 x max(1, |y|) off (atol 5e-15 x that); 200 drawn cases passed."""
    p = min(p, d * (k - 1))
    torch.manual_seed(0)
    module = getattr(torch.nn, f"ConvTranspose{n}d")(2, 3, k, s, p, dilation=d).double()
    x = np.random.default_rng(0).normal(size=(2, *(3,) * n, 2))
    low = (3 - 1) * s - 2 * p + d * (k - 1) + 1
    size = (low + extra,) * n
    xt = torch.tensor(_first_class(x), requires_grad=True)
    with jax.enable_x64(True):
        low_pad = d * (k - 1) - p
        layer = jax.eval_shape(lambda: getattr(ft.nn, f"Conv{n}DTranspose")(
            2, 3, k, strides=s, dilation=d, padding=((low_pad, low_pad),) * n, key=jax.random.key(0),
            dtype=jnp.float64))
        layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
        try:
            yt = module(xt, output_size=size)
        except ValueError:
            event("refused")
            with pytest.raises(ValueError, match="does not fit"):
                layer(jnp.asarray(x), output_size=size)
            return
        event("matched")
        y, gx, g = _jitted_vjp(lambda x: (layer(x, output_size=size),), jnp.asarray(x), 1)
        scale = max(1.0, float(np.abs(yt.detach().numpy()).max()))
        np.testing.assert_allclose(_first_class(y), yt.detach().numpy(), rtol=0, atol=5e-15 * scale)
        yt.backward(torch.tensor(_first_class(g)))
        np.testing.assert_allclose(_first_class(gx), xt.grad.numpy(), rtol=0, atol=5e-15 * scale)
