"""Torch state dicts a port cannot take as they are: the tensors of a torch option the ft.nn
layer was built without, a parametrized weight, a wrapper's prefix, lazy parameters. Each
mismatch error names the fix (strict=False would drop tensors and compute other numbers),
and following it loads the tensors torch computes with."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
nn = torch.nn

K = jax.random.key(0)


def _error(model, state_dict, **options):
    with pytest.raises(ValueError) as info:
        ft.nn.load_torch_state_dict(model, state_dict, **options)
    return str(info.value)


# (torch module of a non-default option, the ft.nn layer built without it, the layer built with it,
#  the "right:" line the error gives)
OPTIONS = [
    (lambda: nn.Linear(4, 3), lambda: ft.nn.Dense(4, 3, use_bias=False, key=K), lambda: ft.nn.Dense(4, 3, key=K),
     "ft.nn.Dense(..., use_bias=True)"),
    (lambda: nn.Bilinear(2, 3, 4), lambda: ft.nn.Bilinear(2, 3, 4, bias=False, key=K),
     lambda: ft.nn.Bilinear(2, 3, 4, key=K), "ft.nn.Bilinear(..., bias=True)"),
    (lambda: nn.LayerNorm(4), lambda: ft.nn.LayerNorm(4, use_offset=False), lambda: ft.nn.LayerNorm(4),
     "ft.nn.LayerNorm(..., use_offset=True)"),
    (lambda: nn.InstanceNorm2d(4, affine=True), lambda: ft.nn.InstanceNorm2D(4),
     lambda: ft.nn.InstanceNorm2D(4, affine=True), "ft.nn.InstanceNorm2D(..., affine=True)"),
    (lambda: nn.InstanceNorm1d(4, track_running_stats=True), lambda: ft.nn.InstanceNorm1D(4),
     lambda: ft.nn.InstanceNorm1D(4, track_running_stats=True), "ft.nn.InstanceNorm1D(..., track_running_stats=True)"),
    (lambda: nn.BatchNorm2d(4), lambda: ft.nn.BatchNorm(4, track_running_stats=False), lambda: ft.nn.BatchNorm(4),
     "ft.nn.BatchNorm(..., track_running_stats=True)"),
    (lambda: nn.MultiheadAttention(8, 2), lambda: ft.nn.MultiheadAttention(8, 2, use_bias=False, key=K),
     lambda: ft.nn.MultiheadAttention(8, 2, key=K), "ft.nn.MultiheadAttention(..., use_bias=True)"),
    (lambda: nn.LSTM(3, 4, 2), lambda: ft.nn.LSTM(3, 4, 2, bias=False, batch_first=False, key=K),
     lambda: ft.nn.LSTM(3, 4, 2, batch_first=False, key=K), "ft.nn.LSTM(..., bias=True)"),
    (lambda: nn.GRU(3, 4), lambda: ft.nn.RNN(ft.nn.GRUCell(3, 4, use_bias=False, key=K)),  # pyright: ignore[reportCallIssue]
     lambda: ft.nn.RNN(ft.nn.GRUCell(3, 4, key=K)),  # pyright: ignore[reportCallIssue]
     "ft.nn.RNN(ft.nn.GRUCell(..., use_bias=True))"),
    (lambda: nn.Sequential(nn.Conv2d(4, 3, 3)), lambda: ft.nn.Sequential(ft.nn.Conv2D(4, 3, 3, use_bias=False, key=K)),
     lambda: ft.nn.Sequential(ft.nn.Conv2D(4, 3, 3, key=K)), "ft.nn.Conv2D(..., use_bias=True)"),
]


@pytest.mark.parametrize("case", range(len(OPTIONS)))
def test_tensors_of_a_torch_option_the_layer_lacks_name_the_option_and_the_layer_with_it_loads(case):
    # Before: the error listed the unexpected tensors and suggested strict=False, which drops
    # them (a bias, an affine, the running statistics eval() normalizes with) without a word.
    make_torch, without, with_option, right = OPTIONS[case]
    state = make_torch().state_dict()
    message = _error(without(), state)
    assert "strict=False would drop" in message and f"right:  {right}" in message
    ft.nn.load_torch_state_dict(with_option(), state)  # the fix: every tensor taken


def test_add_bias_kv_is_named_as_having_no_port():
    message = _error(ft.nn.MultiheadAttention(8, 2, key=K), nn.MultiheadAttention(8, 2, add_bias_kv=True).state_dict())
    assert "add_bias_kv=True" in message and "bias_k, bias_v" in message and "no ft.nn port" in message


def _parametrized(kind):
    layer = nn.Linear(4, 3)
    if kind == "weight_norm":
        return nn.utils.parametrizations.weight_norm(layer)
    if kind == "spectral_norm":
        return nn.utils.parametrizations.spectral_norm(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the old form
        return nn.utils.weight_norm(layer)


@pytest.mark.parametrize("kind, removal", [
    ("weight_norm", "remove_parametrizations(layer, \"weight\")"),
    ("spectral_norm", "remove_parametrizations(layer, \"weight\")"),
    ("old_weight_norm", "remove_weight_norm(layer)"),
])
def test_a_parametrized_weight_names_torch_s_removal_and_the_removed_weight_loads(kind, removal):
    # Before: "missing weight, unexpected parametrizations.weight.original0 ...", fixed by
    # strict=False: the Dense kept its initial weight.
    torch.manual_seed(0)
    layer = _parametrized(kind)
    with torch.no_grad():
        layer(torch.ones(1, 4))  # spectral_norm's power iteration: its u, v
    message = _error(ft.nn.Dense(4, 3, key=K), layer.state_dict())
    assert removal in message and "keep the layer's initial weight" in message
    # torch's parametrizations load as they are into ft.nn's wrapper (the older names do not)
    assert ("ft.nn.WeightNorm(layer) / ft.nn.SpectralNorm(layer, key=k)" in message) == (kind != "old_weight_norm")
    layer.eval()
    if kind == "old_weight_norm":
        nn.utils.remove_weight_norm(layer)
    else:
        nn.utils.parametrize.remove_parametrizations(layer, "weight")
    model = ft.nn.load_torch_state_dict(ft.nn.Dense(4, 3, key=K), layer.state_dict())
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    expected = layer(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(model(x), expected, rtol=0, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("prefix, why", [("module", "DataParallel"), ("_orig_mod", "torch.compile")])
def test_a_wrapper_s_prefix_names_the_rename_that_strips_it(prefix, why):
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    state = {f"{prefix}.{k}": v for k, v in net.state_dict().items()}
    model = ft.nn.Sequential(ft.nn.Dense(4, 3, key=K), ft.nn.relu, ft.nn.Dense(3, 2, key=K))
    message = _error(model, state)
    assert why in message and f'rename={{"{prefix}": ""}}' in message
    loaded = ft.nn.load_torch_state_dict(model, state, rename={prefix: ""})
    np.testing.assert_array_equal(loaded.layers[2].bias, net[2].bias.detach().numpy())


def test_lazy_parameters_are_refused_by_name_and_load_once_materialized():
    # Before: torch's RuntimeError from reading a shape, naming no key.
    lazy = nn.LazyLinear(3)
    for call in (lambda: ft.nn.load_torch_state_dict(ft.nn.Dense(4, 3, key=K), lazy.state_dict(), strict=False),
                 lambda: ft.from_flat_dict(ft.nn.Dense(4, 3, key=K), lazy.state_dict(), cast=True)):
        with pytest.raises(ValueError, match=r"'weight', 'bias' are torch's uninitialized parameters"):
            call()
    lazy(torch.ones(1, 4))
    model = ft.nn.load_torch_state_dict(ft.nn.Dense(4, 3, key=K), lazy.state_dict())
    np.testing.assert_array_equal(model.weight, lazy.weight.detach().numpy().T)


def test_an_lstm_with_projections_into_one_without_names_proj_size():
    message = _error(ft.nn.LSTM(3, 4, batch_first=True, key=K), nn.LSTM(3, 4, proj_size=2).state_dict())
    assert "ft.nn.LSTM(3, 4, proj_size=2, batch_first=False, key=k)" in message


def test_nested_dicts_lists_a_tied_module_and_a_tied_parameter_are_torch_s_in_float64():
    """torch's ModuleDict of a ModuleList and a Sequential, a module under two names and an
    output layer tied to the embedding: outputs in float64 and every tensor back, dtype too."""
    torch.manual_seed(0)

    class Torch(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"a": nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4, bias=False)]),
                                         "b": nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 4))})
            self.shared = nn.Linear(4, 4)
            self.again = self.shared
            self.emb = nn.Embedding(7, 4, padding_idx=0)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            h = self.blocks["a"][1](self.blocks["a"][0](self.emb(ids)))
            return self.head(self.again(torch.tanh(self.shared(self.blocks["b"](h)))))

    class Ft(ft.Module):
        blocks: dict
        shared: ft.nn.Dense
        again: ft.nn.Dense
        emb: ft.nn.Embedding
        head: ft.nn.Dense

        def __call__(self, ids):
            h = self.blocks["a"][1](self.blocks["a"][0](self.emb(ids)))
            return self.head(self.again(jnp.tanh(self.shared(self.blocks["b"](h)))))

    keys = jax.random.split(K, 6)
    blocks = {"a": [ft.nn.Dense(4, 4, key=keys[0]), ft.nn.LayerNorm(4, use_offset=False)],
              "b": ft.nn.Sequential(ft.nn.Dense(4, 5, key=keys[1]), ft.nn.gelu_exact, ft.nn.Dense(5, 4, key=keys[2]))}
    model = Ft(blocks, ft.nn.Dense(4, 4, key=keys[3]), ft.nn.Dense(4, 4, key=keys[4]),  # pyright: ignore[reportCallIssue]
               ft.nn.Embedding(7, 4, padding_index=0, key=keys[5]), ft.nn.Dense(4, 7, use_bias=False, key=keys[5]))
    model = ft.nn.Shared(model, {"again": "shared", "head.weight": ("emb.embeddings", jnp.transpose)})
    net = Torch().double()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ids = np.array([[1, 2, 6], [0, 3, 3]])
    with jax.enable_x64(True):
        loaded = ft.nn.load_torch_state_dict(jax.tree.map(lambda a: a.astype(jnp.float64), model), state)
        actual = np.asarray(jax.jit(lambda m, i: m(i))(loaded, jnp.asarray(ids)))
        back = ft.nn.torch_state_dict(loaded)
    expected = net(torch.from_numpy(ids)).detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-14 * np.abs(expected).max())  # measured 2.2e-16
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


# (torch module without some tensors, the ft.nn layer holding them, the layer built without them,
#  the "right:" line the error gives)
WITHOUT = [
    (lambda: nn.Linear(4, 3, bias=False), lambda: ft.nn.Dense(4, 3, key=K),
     lambda: ft.nn.Dense(4, 3, use_bias=False, key=K), "ft.nn.Dense(..., use_bias=False)"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, elementwise_affine=False)),
     lambda: ft.nn.Sequential(ft.nn.Dense(4, 4, key=K), ft.nn.LayerNorm(4)),
     lambda: ft.nn.Sequential(ft.nn.Dense(4, 4, key=K), ft.nn.LayerNorm(4, use_scale=False, use_offset=False)),
     "ft.nn.LayerNorm(..., use_scale=False, use_offset=False)"),
    (lambda: nn.MultiheadAttention(8, 2, bias=False), lambda: ft.nn.MultiheadAttention(8, 2, key=K),
     lambda: ft.nn.MultiheadAttention(8, 2, use_bias=False, key=K), "ft.nn.MultiheadAttention(..., use_bias=False)"),
    (lambda: nn.GRU(3, 4, 2, bias=False, bidirectional=True),
     lambda: ft.nn.GRU(3, 4, 2, bidirectional=True, batch_first=False, key=K),
     lambda: ft.nn.GRU(3, 4, 2, bias=False, bidirectional=True, batch_first=False, key=K), "ft.nn.GRU(..., bias=False)"),
]


@pytest.mark.parametrize("case", range(len(WITHOUT)))
def test_tensors_a_torch_option_leaves_out_name_the_option_and_its_export_loads_into_torch(case):
    make_torch, holding, without, right = WITHOUT[case]
    module = make_torch()
    message = _error(holding(), module.state_dict())
    assert f"right:  {right}" in message
    loaded = ft.nn.load_torch_state_dict(without(), module.state_dict())
    module.load_state_dict(ft.nn.torch_state_dict(loaded))  # strict: the torch module's own keys


def test_a_batch_norm_without_affine_names_the_layer_without_its_scale_and_its_export():
    # torch's affine=False: the error names the layer built without scale and offset (it named
    # strict=False and a hand-filtered export before ft.nn.BatchNorm could be built so).
    module = nn.BatchNorm1d(4, affine=False)
    module.running_mean.normal_()
    message = _error(ft.nn.BatchNorm(4, epsilon=1e-5), module.state_dict())
    assert "affine=False" in message and "right:  ft.nn.BatchNorm(..., use_scale=False, use_offset=False)" in message
    model = ft.nn.load_torch_state_dict(ft.nn.BatchNorm(4, epsilon=1e-5, use_scale=False, use_offset=False),
                                        module.state_dict())
    written = ft.nn.torch_state_dict(model)
    assert "weight" not in written and "bias" not in written
    module.load_state_dict(written, strict=False)  # num_batches_tracked is not written
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    expected = module.eval()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(model(x), expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_a_layer_with_no_tensor_given_is_named_as_perhaps_absent_from_torch_s_model():
    # torch's model may lack the layer altogether: building it without its affine would load a
    # model of one more layer, so the hint says so.
    model = ft.nn.Sequential(ft.nn.Dense(4, 4, key=K), ft.nn.LayerNorm(4))
    message = _error(model, nn.Sequential(nn.Linear(4, 4)).state_dict())
    assert "use_scale=False, use_offset=False" in message and "if torch's model has no such layer" in message
    message = _error(ft.nn.Dense(4, 3, key=K), nn.Linear(4, 3, bias=False).state_dict())
    assert "use_bias=False" in message and "no such layer" not in message
