"""Torch state dicts ↔ ft.nn layers: real torch modules give the same outputs both ways.

Each model is built in torch and in ft.nn, torch's weights loaded into the ft model (and the
ft model's own random weights saved into the torch module), and their outputs compared in
eval mode with an atol of 1e-5 times the outputs' magnitude: float32 rounding of the same
sums in two libraries' kernels (measured spreads up to ~1e-6 of the magnitude).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
nn = torch.nn

K = jax.random.split(jax.random.key(0), 8)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def build(make):
    """``make()``'s model with random NumPy values: no initializer compiled per shape (fast)."""
    rng = np.random.default_rng(2)

    def fill(path, leaf):
        value = rng.uniform(0.5, 1.5, leaf.shape) if "variance" in jax.tree_util.keystr(path) else \
            rng.normal(0.0, 0.5, leaf.shape)
        return jnp.asarray(value.astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(fill, jax.eval_shape(make))


def close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def run_torch(module, x):
    with torch.no_grad():
        out = module.eval()(*(torch.from_numpy(np.asarray(a)) for a in x))
    return (out[0] if isinstance(out, tuple) else out).numpy()


def both_ways(torch_module, ft_model, x_torch, x_ft=None, ft_call=None, **options):
    """torch → ft and ft → torch: the same outputs; returns the loaded ft model."""
    x_ft = x_torch if x_ft is None else x_ft
    call = jax.jit(ft_call or (lambda m, *a: m(*a)))  # one compile per model, not one per op
    loaded = ft.nn.load_torch_state_dict(ft_model, torch_module.state_dict(), **options)
    close(call(loaded, *(jnp.asarray(a) for a in x_ft)), to_ft_layout(run_torch(torch_module, x_torch), x_torch, x_ft))
    # the other way: the ft model's own (different) weights into the torch module
    torch_module.load_state_dict(ft.nn.torch_state_dict(ft_model, **options))
    close(to_ft_layout(run_torch(torch_module, x_torch), x_torch, x_ft), call(ft_model, *(jnp.asarray(a) for a in x_ft)))
    return loaded


def to_ft_layout(y, x_torch, x_ft):
    return np.moveaxis(y, 1, -1) if x_ft is not x_torch and y.ndim > 2 else y


def nchw(shape):
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    return x, np.ascontiguousarray(np.moveaxis(x, 1, -1))


def randomize_batch_norms(module):
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)


def test_cnn_conv_batch_norm_pool_flatten_linear():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 6, 3, stride=2, groups=2), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Flatten(), nn.Linear(6 * 3 * 3, 10),
    )
    randomize_batch_norms(net)
    model = build(lambda: ft.nn.Sequential(
        ft.nn.Conv2D(3, 8, 3, padding=1, key=K[0]), ft.nn.BatchNorm(8, epsilon=1e-5), ft.nn.relu,
        ft.nn.MaxPool2D(2), ft.nn.Conv2D(8, 6, 3, strides=2, padding="VALID", groups=2, key=K[1]),
        ft.nn.BatchNorm(6, epsilon=1e-5), ft.nn.relu, ft.nn.Flatten(), ft.nn.Dense(54, 10, key=K[2]),
    ))
    x, x_ft = nchw((4, 3, 16, 16))
    running_var = net[1].running_var.numpy().copy()
    loaded = both_ways(net, model, (x,), (x_ft,), flattened={"8": (6, 3, 3)})
    np.testing.assert_array_equal(loaded.layers[1].running_variance, running_var)


def test_mlp_with_exact_and_tanh_gelu_and_prefix_rename():
    class Wrapped(nn.Module):  # DataParallel-like "module." prefix and torch names
        def __init__(self):
            super().__init__()
            self.module = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU("tanh"),
                                        nn.Linear(16, 2, bias=False))

        def forward(self, x):
            return self.module(x)

    model = build(lambda: ft.nn.Sequential(
        ft.nn.Dense(5, 16, ft.nn.gelu_exact, key=K[0]), ft.nn.Dense(16, 16, ft.nn.gelu, key=K[1]),
        ft.nn.Dense(16, 2, use_bias=False, key=K[2]),
    ))
    rename = {"module.0": "0", "module.2": "1", "module.4": "2"}
    x = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    both_ways(Wrapped(), model, (x,), rename=rename)


class Encoder(ft.Module):
    embed: ft.nn.Embedding
    norm: ft.nn.LayerNorm
    attention: ft.nn.MultiheadAttention
    out: ft.nn.RMSNorm
    position: jax.Array

    def __call__(self, tokens, mask):
        h = self.norm(self.embed(tokens) + self.position)
        return self.out(self.attention(h, mask=mask[:, None, None, :]))


class TorchEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.RMSNorm(8, eps=1e-6)
        self.position = nn.Parameter(torch.randn(6, 8))

    def forward(self, tokens, mask):
        h = self.norm(self.embed(tokens.long()) + self.position)
        return self.out(self.attention(h, h, h, key_padding_mask=~mask, need_weights=False)[0])


def test_embedding_layer_norm_attention_rms_norm_and_a_parameter():
    model = build(lambda: Encoder(
        ft.nn.Embedding(11, 8, key=K[0]), ft.nn.LayerNorm(8), ft.nn.MultiheadAttention(8, 2, key=K[1]),
        ft.nn.RMSNorm(8), jax.random.normal(K[2], (6, 8)),
    ))
    tokens = np.random.default_rng(0).integers(0, 11, size=(3, 6)).astype(np.int32)
    mask = np.ones((3, 6), bool)
    mask[1, 4:] = False
    both_ways(TorchEncoder(), model, (tokens, mask))


def test_attention_with_other_key_and_value_sizes():
    mha = nn.MultiheadAttention(8, 4, kdim=5, vdim=3, batch_first=True)
    model = build(lambda: ft.nn.MultiheadAttention(8, 4, key_size=5, value_size=3, key=K[0]))
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, n, d)).astype(np.float32) for n, d in [(4, 8), (6, 5), (6, 3)])
    both_ways(mha, model, (q, k, v))
    assert {"q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"} <= set(ft.nn.torch_state_dict(model))


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_recurrent_layers_and_cells(kind):
    cell = build(lambda: getattr(ft.nn, f"{kind}Cell")(4, 6, key=K[0]))
    x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
    both_ways(getattr(nn, kind)(4, 6, batch_first=True), ft.nn.RNN(cell), (x,))
    both_ways(getattr(nn, f"{kind}Cell")(4, 6), cell, (x[:, 0],), ft_call=lambda m, x: m(m.zero_state((2,)), x)[1])


def test_conv1d_transposed_convolutions_group_norm_batch_norm_1d():
    net = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.BatchNorm1d(4))
    randomize_batch_norms(net)
    model = build(lambda: ft.nn.Sequential(ft.nn.Conv1D(3, 4, 3, padding=1, key=K[0]), ft.nn.GroupNorm(2, 4),
                                           ft.nn.BatchNorm(4, epsilon=1e-5)))
    x, x_ft = nchw((2, 3, 9))
    both_ways(net, model, (x,), (x_ft,))
    up = nn.ConvTranspose2d(3, 5, 3, stride=2)
    x, x_ft = nchw((2, 3, 4, 4))
    both_ways(up, build(lambda: ft.nn.Conv2DTranspose(3, 5, 3, strides=2, padding="VALID", key=K[1])), (x,), (x_ft,))


def test_state_dict_round_trip_keeps_every_value_and_dtype():
    model = build(lambda: ft.nn.Sequential(ft.nn.Dense(3, 4, key=K[0], dtype=jnp.bfloat16), ft.nn.BatchNorm(4)))
    sd = ft.nn.torch_state_dict(model)
    assert sd["0.weight"].dtype == torch.bfloat16 and tuple(sd["0.weight"].shape) == (4, 3)
    back = ft.nn.load_torch_state_dict(jax.tree.map(jnp.zeros_like, model), sd)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_num_batches_tracked_dropped_and_float64_cast():
    bn = nn.BatchNorm1d(3).double()
    assert "num_batches_tracked" in bn.state_dict()
    loaded = ft.nn.load_torch_state_dict(ft.nn.BatchNorm(3), bn.state_dict())
    assert loaded.running_variance.dtype == jnp.float32


def test_strict_error_names_missing_unexpected_and_mis_shaped_torch_keys():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(5), nn.Linear(4, 2))
    model = build(lambda: ft.nn.Sequential(ft.nn.Dense(3, 4, key=K[0]), ft.nn.LayerNorm(4),
                                           ft.nn.Dense(4, 2, key=K[1]), ft.nn.Dense(2, 2, key=K[2])))
    sd = {**net.state_dict(), "extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError) as e:
        ft.nn.load_torch_state_dict(model, sd)
    message = str(e.value)
    assert "missing keys:    ['3.weight', '3.bias']" in message
    assert "unexpected keys: ['extra.weight']" in message
    assert "1.weight: expected shape (4,) (for layers.1.scale), given shape (5,)" in message
    assert "layers.0.weight -> 0.weight" in message and "rename=" in message and "strict=False" in message
    loaded, report = ft.nn.load_torch_state_dict(model, sd, strict=False)
    assert report.missing == ("3.weight", "3.bias") and report.unexpected == ("extra.weight",)
    assert [m[0] for m in report.mismatched] == ["1.weight", "1.bias"]
    np.testing.assert_array_equal(loaded.layers[0].weight, net[0].weight.detach().numpy().T)  # what fits
    np.testing.assert_array_equal(loaded.layers[1].scale, model.layers[1].scale)  # kept


def test_lstm_of_other_layers_and_directions_reported():
    lstm = nn.LSTM(4, 6, num_layers=2, bidirectional=True)
    _, report = ft.nn.load_torch_state_dict(build(lambda: ft.nn.RNN(ft.nn.LSTMCell(4, 6, key=K[0]))),
                                            lstm.state_dict(), strict=False)
    assert not report.missing and "weight_ih_l1" in report.unexpected and "weight_ih_l0_reverse" in report.unexpected


def test_rename_by_a_function_both_ways():
    model = build(lambda: {"encoder": ft.nn.LayerNorm(3)})
    sd = ft.nn.torch_state_dict(model, rename=lambda name: "backbone." + name, numpy=True)
    assert set(sd) == {"backbone.encoder.weight", "backbone.encoder.bias"}
    back = ft.nn.load_torch_state_dict(jax.tree.map(jnp.zeros_like, model), sd, rename=lambda name: name[9:])
    np.testing.assert_array_equal(back["encoder"].scale, model["encoder"].scale)


def test_flattened_errors():
    model = build(lambda: ft.nn.Sequential(ft.nn.Flatten(), ft.nn.Dense(12, 2, key=K[0])))
    with pytest.raises(ValueError, match=r"flattened= names \['fc'\], which are not Dense layers.*\['1'\]"):
        ft.nn.torch_state_dict(model, flattened={"fc": (3, 2, 2)})
    with pytest.raises(ValueError, match=r"has 18 values per example; the Dense layer takes 12"):
        ft.nn.torch_state_dict(model, flattened={"1": (3, 2, 3)})
    both = [ft.nn.torch_state_dict(model, flattened={name: (3, 2, 2)}, numpy=True) for name in ("1", "layers.1")]
    np.testing.assert_array_equal(both[0]["1.weight"], both[1]["1.weight"])


def test_torch_state_dict_without_torch_names_the_fix(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)
    with pytest.raises(ImportError, match="numpy=True"):
        ft.nn.torch_state_dict(ft.nn.LayerNorm(2))
    assert set(ft.nn.torch_state_dict(ft.nn.LayerNorm(2), numpy=True)) == {"weight", "bias"}


def test_gelu_and_gelu_exact_are_torchs_two_gelus():
    x = np.linspace(-4, 4, 101, dtype=np.float32)
    with torch.no_grad():
        exact, tanh = nn.GELU()(torch.from_numpy(x)).numpy(), nn.GELU("tanh")(torch.from_numpy(x)).numpy()
    close(ft.nn.gelu_exact(jnp.asarray(x)), exact)
    close(ft.nn.gelu(jnp.asarray(x)), tanh)
    assert np.abs(exact - tanh).max() > 1e-4  # the two differ: the choice matters
