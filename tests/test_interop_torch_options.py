"""ft.nn.load_torch_state_dict(model, module): the torch module's options that no tensor
holds, compared with the model's layers (functree.interop._options).

Each case is a real torch module with options set away from their defaults. The ft.nn model
built with the matching arguments loads from the module and gives torch's outputs in
float64 (measured: at most 3.3e-16 of the outputs' magnitude, at least 1; tolerance 2e-14 of it). The
model built with ft.nn's defaults is refused, naming each option; from the state dict alone
it loads without an error and its outputs differ (what the check prevents).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.interop._options import (
    FIX_LINE,
    FUNCTION_LINE,
    NO_COUNTERPART_LINE,
    NO_MAX_NORM,
    NO_ZERO_ATTN,
    NONE_LINE,
    OPTION_LINE,
    OPTIONS_DIFFER,
)

torch = pytest.importorskip("torch")
nn = torch.nn

K = jax.random.key(0)
F64 = {"dtype": jnp.float64}
RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _channels_last(x):
    return np.moveaxis(x, 1, -1)


def _run_torch(module, *xs):
    with torch.no_grad():
        out = module(*(torch.from_numpy(x) for x in xs))
    return (out[0] if isinstance(out, tuple) else out).numpy()


# name: (torch module, the matching ft model, ft.nn's defaults, inputs, the options the error names,
#        the right: line, a layout of the ft inputs and outputs (channels last) or None)
def _cases():
    x_seq = RNG.normal(size=(3, 5, 8))
    return {
        "encoder layer": (
            lambda: nn.TransformerEncoderLayer(8, 4, 16, dropout=0.0, activation="gelu", layer_norm_eps=1e-6,
                                               batch_first=True, norm_first=True),
            lambda: ft.nn.TransformerEncoderLayer(8, 4, 16, dropout=0.0, activation="gelu", layer_norm_eps=1e-6,
                                                  batch_first=True, norm_first=True, key=K, **F64),
            lambda: ft.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, key=K, **F64),
            (x_seq,), ["norm_first", "layer_norm_eps", "self_attn.num_heads", "activation"],
            'ft.nn.TransformerEncoderLayer(..., norm_first=True, layer_norm_eps=1e-06, nhead=4, activation="gelu")',
            None),
        "decoder layer": (
            lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation="gelu", norm_first=True),
            lambda: ft.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation="gelu", norm_first=True, key=K,
                                                  **F64),
            lambda: ft.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, key=K, **F64),
            (x_seq, RNG.normal(size=(4, 5, 8))), ["norm_first", "activation"],
            'ft.nn.TransformerDecoderLayer(..., norm_first=True, activation="gelu")', None),
        "conv": (
            lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, padding_mode="circular"),
            lambda: ft.nn.Conv1D(4, 6, 3, strides=2, padding=2, dilation=2, padding_mode="circular", key=K, **F64),
            lambda: ft.nn.Conv1D(4, 6, 3, strides=2, dilation=2, key=K, **F64),
            (RNG.normal(size=(2, 4, 9)),), ["padding_mode", "padding"],
            "ft.nn.Conv1D(..., padding_mode='circular', padding=2)", _channels_last),
        "conv transpose": (
            lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1),
            lambda: ft.nn.Conv2DTranspose(4, 6, 3, strides=2, padding=((1, 2), (1, 2)), key=K, **F64),
            lambda: ft.nn.Conv2DTranspose(4, 6, 3, strides=2, key=K, **F64),
            (RNG.normal(size=(2, 4, 3, 3)),), ["padding, output_padding"],
            "ft.nn.Conv2DTranspose(..., padding=((1, 2), (1, 2)))", _channels_last),
        "norms and activations": (
            lambda: nn.Sequential(nn.Linear(4, 6), nn.GroupNorm(3, 6, eps=1e-3), nn.GELU(), nn.LayerNorm(6, eps=1e-6),
                                  nn.RMSNorm(6), nn.BatchNorm1d(6, eps=1e-4, momentum=0.2)),
            lambda: ft.nn.Sequential(ft.nn.Dense(4, 6, key=K, **F64), ft.nn.GroupNorm(3, 6, 1e-3, **F64), ft.nn.gelu_exact,
                                     ft.nn.LayerNorm(6, 1e-6, **F64), ft.nn.RMSNorm(6, epsilon=None, **F64),
                                     ft.nn.BatchNorm(6, epsilon=1e-4, momentum=0.8, unbiased_running_variance=True, **F64)),
            lambda: ft.nn.Sequential(ft.nn.Dense(4, 6, key=K, **F64), ft.nn.GroupNorm(1, 6, 1e-3, **F64), ft.nn.gelu,
                                     ft.nn.LayerNorm(6, **F64), ft.nn.RMSNorm(6, **F64), ft.nn.BatchNorm(6, **F64)),
            (RNG.normal(size=(3, 4)),), ["num_groups", "function", "eps", "momentum", "running_var (unbiased)"],
            "ft.nn.BatchNorm(..., epsilon=0.0001, momentum=0.8, unbiased_running_variance=True)", None),
        "rnn": (
            lambda: nn.RNN(3, 4, num_layers=2, nonlinearity="relu"),
            lambda: ft.nn.SimpleRNN(3, 4, num_layers=2, nonlinearity="relu", batch_first=False, key=K, **F64),
            lambda: ft.nn.SimpleRNN(3, 4, num_layers=2, batch_first=True, key=K, **F64),
            (RNG.normal(size=(5, 2, 3)),), ["batch_first", "nonlinearity"],
            "ft.nn.SimpleRNN(..., batch_first=False, nonlinearity='relu')", None),
        "attention": (  # torch's default batch_first=False: x_seq read as [L, N, E]
            lambda: nn.MultiheadAttention(8, 4, add_zero_attn=True),
            lambda: ft.nn.MultiheadAttention(8, 4, batch_first=False, add_zero_attn=True, key=K, **F64),
            lambda: ft.nn.MultiheadAttention(8, 2, key=K, **F64),
            (x_seq, x_seq, x_seq), ["num_heads", "num_heads (key and value heads)", "add_zero_attn", "batch_first"],
            "ft.nn.MultiheadAttention(..., num_heads=4, num_kv_heads=4, add_zero_attn=True, batch_first=False)", None),
        "bag": (
            lambda: nn.EmbeddingBag(7, 3, mode="max", padding_idx=2),
            lambda: ft.nn.EmbeddingBag(7, 3, mode="max", padding_index=2, key=K, **F64),
            lambda: ft.nn.EmbeddingBag(7, 3, key=K, **F64),
            (np.array([[0, 1, 2], [3, 2, 6]]),), ["padding_idx", "mode"],
            "ft.nn.EmbeddingBag(..., padding_index=2, mode='max')", None),
        "pools": (
            lambda: nn.Sequential(nn.MaxPool1d(3, 2, 1), nn.AvgPool1d(3, 1, 1, count_include_pad=False)),
            lambda: ft.nn.Sequential(ft.nn.MaxPool1D(3, 2, 1), ft.nn.AvgPool1D(3, 1, 1, count_include_pad=False)),
            lambda: ft.nn.Sequential(ft.nn.MaxPool1D(3, 2, 1), ft.nn.AvgPool1D(3, 1, 1)),
            (RNG.normal(size=(2, 3, 8)),), ["count_include_pad"],
            "ft.nn.AvgPool1D(..., count_include_pad=False)", _channels_last),
    }


CASES = _cases()


@jax.jit
def _forward(model, *xs):  # one compile per model, where op by op compiled each operation (seconds)
    return model(*xs)


def _ft_outputs(model, layout, xs):
    if layout is None:
        ins = xs
    else:
        ins = (layout(xs[0]),)
    if isinstance(model, ft.nn.MultiheadAttention):
        ins = xs[:1]
    out = np.asarray(_forward(model, *ins))
    return out if layout is None else np.moveaxis(out, -1, 1)


@pytest.mark.parametrize("case", list(CASES))
def test_the_modules_options_load_into_the_matching_model_and_refuse_the_defaults(case):
    make, good, default, xs, options, right, layout = CASES[case]
    torch.manual_seed(0)
    module = make().double().eval()
    if isinstance(module, nn.Sequential) and isinstance(module[-1], nn.BatchNorm1d):  # statistics of their own
        module[-1].running_mean.uniform_(-1, 1)
        module[-1].running_var.uniform_(0.5, 2)
    expected = _run_torch(module, *xs)
    atol = 2e-14 * max(1.0, float(np.abs(expected).max()))
    loaded = ft.nn.load_torch_state_dict(jax.eval_shape(good), module)  # a template: no initializers run
    np.testing.assert_allclose(_ft_outputs(loaded, layout, xs), expected, rtol=0, atol=atol)

    template = jax.eval_shape(default)
    with pytest.raises(ValueError) as e:
        ft.nn.load_torch_state_dict(template, module)
    message = str(e.value)
    assert message.startswith(OPTIONS_DIFFER.split("{", 1)[0])
    for option in options:
        assert f"torch's {option}=" in message, option
    assert FIX_LINE.format(call=right) in message
    silent = ft.nn.load_torch_state_dict(template, module.state_dict())  # no tensor shows these options
    assert np.abs(_ft_outputs(silent, layout, xs) - expected).max() > 0.1  # measured 0.2 to 1.9


def test_each_option_is_named_by_torch_name_and_key_path_strict_false_too():
    class Net(nn.Module):  # a user's module, walked through
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, stride=2), nn.SiLU())
            self.blocks = nn.ModuleList([nn.LayerNorm(4, eps=1e-3) for _ in range(2)])

    class Model(ft.Module):
        body: ft.nn.Sequential
        blocks: ft.nn.Stack

        def __init__(self, body, blocks):
            self.body, self.blocks = body, blocks

    net = Net()
    model = Model(ft.nn.Sequential(ft.nn.Conv2D(3, 4, 3, strides=2, key=K), ft.nn.relu),
                  ft.nn.Stack(lambda k: ft.nn.LayerNorm(4), 2, key=K))
    for strict in (True, False):  # the report lists tensors: a wrong option is refused either way
        with pytest.raises(ValueError) as e:
            ft.nn.load_torch_state_dict(model, net, rename={"features": "body"}, strict=strict)
        lines = [OPTION_LINE.format(torch="features.0", torch_class="Conv2d", ft="body.layers.0", ft_class="Conv2D",
                                    option="padding", torch_value="(1, 1)", ft_option="padding", ft_value="'SAME'"),
                 OPTION_LINE.format(torch="features.1", torch_class="SiLU", ft="body.layers.1", ft_class="Lambda",
                                    option="function", torch_value="SiLU()", ft_option="function", ft_value="relu"),
                 *(OPTION_LINE.format(torch=f"blocks.{i}", torch_class="LayerNorm", ft=f"blocks.{i}",
                                      ft_class="LayerNorm", option="eps", torch_value="0.001", ft_option="epsilon",
                                      ft_value="1e-05") for i in range(2))]
        fixes = [FIX_LINE.format(call="ft.nn.Conv2D(..., padding=1)") + "   # at body.layers.0",
                 FUNCTION_LINE.format(function="ft.nn.silu") + "   # at body.layers.1",
                 FIX_LINE.format(call="ft.nn.LayerNorm(..., epsilon=0.001)") + "   # at blocks.0, blocks.1"]
        assert str(e.value) == OPTIONS_DIFFER.format(lines="\n".join(lines), fixes="\n".join(fixes))
    fixed = Model(ft.nn.Sequential(ft.nn.Conv2D(3, 4, 3, strides=2, padding=1, key=K), ft.nn.silu),
                  ft.nn.Stack(lambda k: ft.nn.LayerNorm(4, 1e-3), 2, key=K))
    loaded = ft.nn.load_torch_state_dict(fixed, net, rename={"features": "body"})
    np.testing.assert_array_equal(np.asarray(loaded.body.layers[0].bias), net.features[0].bias.detach().numpy())


def test_options_without_an_ft_counterpart_are_refused_by_name():
    emb = nn.Embedding(10, 4, max_norm=1.0, scale_grad_by_freq=True)
    with pytest.raises(ValueError) as e:
        ft.nn.load_torch_state_dict(ft.nn.Embedding(10, 4, key=K), emb)
    shown = dict(torch="(the module)", torch_class="Embedding", ft="(the model)", ft_class="Embedding")
    assert NO_COUNTERPART_LINE.format(option="max_norm", torch_value="1.0", **shown) in str(e.value)
    assert NONE_LINE.format(none=NO_MAX_NORM, option="max_norm") + "   # at (the model)" in str(e.value)
    assert FIX_LINE.format(call="ft.nn.Embedding(..., scale_grad_by_freq=True)") + "   # at (the model)" in str(e.value)
    ft.nn.load_torch_state_dict(ft.nn.Embedding(10, 4, scale_grad_by_freq=True, key=K), nn.Embedding(10, 4, scale_grad_by_freq=True))
    with pytest.raises(ValueError) as e:  # a Dense with an activation of its own where torch's Linear has none
        ft.nn.load_torch_state_dict(ft.nn.Dense(4, 2, ft.nn.relu, key=K), nn.Linear(4, 2))
    assert FIX_LINE.format(call="ft.nn.Dense(..., activation=None)") + "   # at (the model)" in str(e.value)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    layer.self_attn.add_zero_attn = True  # a transformer layer's attention: no argument of ft's layer sets it
    with pytest.raises(ValueError) as e:
        ft.nn.load_torch_state_dict(ft.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, key=K), layer)
    assert NONE_LINE.format(none=NO_ZERO_ATTN, option="self_attn.add_zero_attn") + "   # at (the model)" in str(e.value)
    model = ft.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, key=K, **F64)
    model = ft.nn.load_torch_state_dict(model.replace(self_attn=model.self_attn.replace(add_zero_attn=True)),
                                        layer.double().train())  # the fix NO_ZERO_ATTN names: torch's numbers (eval: its
    # fast path, which leaves add_zero_attn out)
    x = RNG.normal(size=(2, 5, 8))
    expected = _run_torch(layer, x)
    np.testing.assert_allclose(_forward(model, jnp.asarray(x)), expected, rtol=0,
                               atol=2e-14 * max(1.0, float(np.abs(expected).max())))
