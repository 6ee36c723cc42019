"""Dense: reference computation, gradients, initialisation and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def test_matches_reference(key):
    layer = ft.nn.Dense(3, 4, jax.nn.tanh, key=key)
    x = jax.random.normal(jax.random.key(1), (5, 3))
    expected = np.tanh(np.asarray(x) @ np.asarray(layer.weight) + np.asarray(layer.bias))
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_initialisation_is_glorot_uniform_with_zero_bias(key):
    layer = ft.nn.Dense(300, 200, key=key)
    limit = np.sqrt(6 / (300 + 200))
    assert float(jnp.max(jnp.abs(layer.weight))) <= limit
    assert float(jnp.std(layer.weight)) == pytest.approx(limit / np.sqrt(3), rel=0.02)
    assert not jnp.any(layer.bias)


def test_no_bias_custom_initializer_and_dtype(key):
    layer = ft.nn.Dense(2, 3, use_bias=False, key=key, dtype=jnp.bfloat16,
                        weight_initializer=ft.nn.initializers.ones)
    assert layer.bias is None and layer.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(layer(jnp.ones((1, 2), jnp.bfloat16)).astype(jnp.float32), 2.0)


def test_unbatched_and_many_batch_axes(key):
    layer = ft.nn.Dense(3, 2, key=key)
    assert layer(jnp.ones(3)).shape == (2,)
    assert layer(jnp.ones((4, 5, 3))).shape == (4, 5, 2)


def test_gradient_finite_differences(key):
    with jax.enable_x64(True):
        layer = _x64(ft.nn.Dense(3, 2, jax.nn.sigmoid, key=key))
        x = jax.random.normal(jax.random.key(1), (4, 3), jnp.float64)
        check_grads(jax.jit(lambda m, x: m(x)), (layer, x), order=1, modes=["rev"])


def test_wrong_trailing_shape_names_layer_and_shapes(key):
    layer = ft.nn.Dense(2, 4, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense expects inputs \[\.\.\., 2\] \(float\), got f32\[4,3\]"):
        layer(jnp.ones((4, 3)))


def test_an_ensemble_called_outside_vmap_is_refused_naming_the_fix(key):
    # 3 models of 3 inputs called on a batch of 3: x @ weight [3, 3, 4] broadcast over the
    # models and the biases over the rows, silently; 4 inputs read "expects inputs [..., 3]".
    models = jax.vmap(lambda k: ft.nn.Sequential(ft.nn.Dense(3, 4, key=k)))(jax.random.split(key, 3))
    x = jnp.ones((3, 3))
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense at .layers\[0\] holds weight f32\[3,3,4\], but one "
                                                    r"Dense's weight has 2 axes: the leading axes are a batch"):
        models(x)
    right = jax.vmap(lambda m: m(x))(models)       # the error's fix
    np.testing.assert_allclose(right[1], x @ models.layers[0].weight[1] + models.layers[0].bias[1][None, :], rtol=1e-6)


def test_wrong_dtype_is_an_error_at_trace_time(key):
    layer = ft.nn.Dense(2, 4, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)got i32\[4,2\].*astype\(jnp.float32\)"):
        jax.jit(layer)(jnp.ones((4, 2), jnp.int32))


def test_repr_and_parameter_view(key):
    layer = ft.nn.Dense(2, 4, jax.nn.relu, key=key)
    assert repr(layer) == "Dense(weight=f32[2,4], bias=f32[4], activation=relu)"
    assert ft.parameters(layer).weight.shape == (2, 4)


def test_a_bfloat16_bias_gradient_over_a_sequence_is_summed_in_float32(key):
    """Dense on [batch, tokens, features]: the bias's gradient sums the cotangent over 32x256
    rows, which XLA:CPU did in bfloat16 (0.50 off the float64 sum; torch's bfloat16 Linear is
    3.8e-3 off). The bias is added in float32 now; a float32 Dense adds as before (no casts)."""
    torch = pytest.importorskip("torch")
    dy = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (32, 256, 16)), jnp.bfloat16)
    dy32 = np.asarray(dy.astype(jnp.float32))
    exact = dy32.astype(np.float64).sum((0, 1))
    module = torch.nn.Linear(4, 16).bfloat16()
    module(torch.ones(32, 256, 4, dtype=torch.bfloat16)).backward(torch.tensor(dy32).bfloat16())
    spread = np.abs(module.bias.grad.float().numpy() - exact).max()  # 16 of 4121: bfloat16's rounding
    layer = ft.cast(ft.nn.Dense(4, 16, key=key), jnp.bfloat16)
    x = jnp.ones((32, 256, 4), jnp.bfloat16)
    grad, = jax.jit(lambda m, dy: jax.vjp(lambda m: m(x), m)[1](dy))(layer, dy)
    assert grad.bias.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad.bias.astype(jnp.float32)), exact, rtol=0, atol=10 * spread)
    program = str(jax.make_jaxpr(ft.nn.Dense(4, 16, key=key))(jnp.ones((2, 3, 4))))
    assert "convert_element_type" not in program


def test_layers_with_no_input_features_build_as_torch_does(key):
    """``Dense(0, 3)`` (torch's ``Linear(0, 3)``: an empty feature set) raised JAX's
    ZeroDivisionError from the zero fan of its variance-scaling initializer; an array of no
    values draws nothing. The output is the bias; a layer with values draws as before."""
    dense = ft.nn.Dense(0, 3, key=key)
    assert dense.weight.shape == (0, 3)
    np.testing.assert_array_equal(dense(np.ones((2, 0), np.float32)), np.zeros((2, 3), np.float32))
    assert ft.nn.Conv2D(0, 4, 3, key=key).weight.shape == (3, 3, 0, 4)
    assert ft.nn.LSTMCell(0, 4, key=key).input_weight.shape == (0, 16)
    np.testing.assert_array_equal(ft.nn.Dense(2, 3, key=key).weight,
                                  jax.nn.initializers.glorot_uniform()(key, (2, 3), jnp.float32))


# One argument of each layer: its size (Dense(3.0, 4), d / 2 in Python 3) failed deep inside
# jax.random's shape check, -2 in an MLIR error, True built a layer of size 1 and a JAX array a
# static field holding an array (GroupNorm, RotaryEmbedding).
SIZED_LAYERS = [
    ("Dense", "input_size", lambda v, k: ft.nn.Dense(v, 4, key=k)),
    ("Conv2D", "out_channels", lambda v, k: ft.nn.Conv2D(3, v, 3, key=k)),
    ("Conv1DTranspose", "in_channels", lambda v, k: ft.nn.Conv1DTranspose(v, 4, 3, key=k)),
    ("Embedding", "embedding_size", lambda v, k: ft.nn.Embedding(10, v, key=k)),
    ("EmbeddingBag", "vocabulary_size", lambda v, k: ft.nn.EmbeddingBag(v, 4, key=k)),
    ("MultiheadAttention", "query_size", lambda v, k: ft.nn.MultiheadAttention(v, 2, key=k)),
    ("MultiheadAttention", "qk_size", lambda v, k: ft.nn.MultiheadAttention(8, 2, qk_size=v, vo_size=4, key=k)),
    ("LayerNorm", "shape", lambda v, k: ft.nn.LayerNorm((3, v))),
    ("GroupNorm", "channels", lambda v, k: ft.nn.GroupNorm(2, v)),
    ("BatchNorm", "feature_count", lambda v, k: ft.nn.BatchNorm(v)),
    ("InstanceNorm2D", "channels", lambda v, k: ft.nn.InstanceNorm2D(v, affine=True)),
    ("LSTMCell", "hidden_size", lambda v, k: ft.nn.LSTMCell(3, v, key=k)),
    ("GRU", "input_size", lambda v, k: ft.nn.GRU(v, 4, batch_first=True, key=k)),
    ("MLP", "width_size", lambda v, k: ft.nn.MLP(3, 2, v, 1, key=k)),
    ("TransformerEncoderLayer", "dim_feedforward", lambda v, k: ft.nn.TransformerEncoderLayer(8, 2, v, key=k)),
    ("Bilinear", "out_features", lambda v, k: ft.nn.Bilinear(2, 3, v, key=k)),
    ("Experts", "hidden", lambda v, k: ft.nn.Experts(4, v, 2, key=k)),
    ("AdaptiveLogSoftmaxWithLoss", "in_features", lambda v, k: ft.nn.AdaptiveLogSoftmaxWithLoss(v, 10, [4], key=k)),
]

BAD_SIZES = [(3.0, TypeError, r"is a float", r"int\(d // 2\)"), (True, TypeError, r"is a bool", r"n\)"),
             (-2, ValueError, r"is below 0", r"n\)"), (jnp.asarray(4), TypeError, r"i32\[\] is an array", r"int\(n\)"),
             ((4,), TypeError, r"is not an int \(tuple\)", r"n\)")]


@pytest.mark.parametrize("layer, name, make", SIZED_LAYERS, ids=[f"{c}.{n}" for c, n, _ in SIZED_LAYERS])
@pytest.mark.parametrize("value, error, problem, right", BAD_SIZES, ids=["float", "bool", "negative", "array", "tuple"])
def test_a_layer_size_that_is_no_int_is_named_at_the_constructor(key, layer, name, make, value, error, problem,
                                                                  right):
    with pytest.raises(error, match=rf"(?s)^ft\.nn\.{layer}: {name}=.*{problem}; {name} is an int >= 0\..*"
                                    rf"wrong:  ft\.nn\.{layer}\(\.\.\., {name}=.*right:  ft\.nn\.{layer}\(\.\.\., "
                                    rf"{name}={right}"):
        make(value, key)


@pytest.mark.parametrize("layer, name, make", SIZED_LAYERS, ids=[f"{c}.{n}" for c, n, _ in SIZED_LAYERS])
def test_a_numpy_int_is_a_layer_size(key, layer, name, make):
    """A NumPy int (a size read from an array's shape or a config) builds the layer it names."""
    assert jax.tree.structure(make(np.int64(4), key)) == jax.tree.structure(make(4, key))


def test_numpy_int_counts_build_what_their_ints_build(key):
    """num_layers, num_heads, num_kv_heads, window, a Stack's n and a LoRA rank given as NumPy
    ints were refused as no ints (ft.nn.LSTM: "num_layers=2; a recurrent stack has at least one
    layer", MultiheadAttention: "num_kv_heads (2) must divide num_heads (2)")."""
    two = np.int64(2)
    assert len(ft.nn.LSTM(3, 4, two, batch_first=True, key=key).layers) == 2
    attention = ft.nn.MultiheadAttention(8, two, num_kv_heads=two, window=two, key=key)
    assert (attention.num_heads, attention.num_kv_heads, attention.window) == (2, 2, 2)
    assert type(attention.num_heads) is int and type(attention.window) is int  # static fields: Python ints
    assert len(ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), two, key=key)) == 2
    assert ft.nn.LoraDense(ft.nn.Dense(3, 4, key=key), two, key=key).lora_a.shape == (3, 2)
    assert ft.nn.TransformerEncoder(ft.nn.TransformerEncoderLayer(8, two, 8, key=key), two).num_layers == 2


@pytest.mark.parametrize("make, message", [
    (lambda k: ft.nn.GroupNorm(0, 4), r"ft\.nn\.GroupNorm: groups=0 is below 1; groups is an int >= 1"),
    (lambda k: ft.nn.Experts(4, 8, 2.0, key=k), r"ft\.nn\.Experts: num_experts=2\.0 is a float"),
    (lambda k: ft.nn.Transformer(8, 2, 1, 0.5, 8, key=k), r"ft\.nn\.Transformer: num_decoder_layers=0\.5 is a float"),
    (lambda k: ft.nn.TransformerEncoder(ft.nn.TransformerEncoderLayer(8, 2, 8, key=k), 2.0),
     r"ft\.nn\.TransformerEncoder: num_layers=2\.0 is a float"),
    (lambda k: ft.nn.MLP(3, 2, widths=[4, 2.5], key=k), r"ft\.nn\.MLP: widths=2\.5 is a float"),
    (lambda k: ft.nn.MLP(3, 2, 4, 1.5, key=k), r"ft\.nn\.MLP: depth=1\.5 is a float"),
    (lambda k: ft.nn.RotaryEmbedding(jnp.asarray(8)), r"ft\.nn\.RotaryEmbedding: size=i32\[\] is an array"),
    (lambda k: ft.nn.Bilinear(0, 3, 4, key=k), r"ft\.nn\.Bilinear: in1_features=0 is below 1"),
    (lambda k: ft.nn.LSTM(3, 4, 2.0, batch_first=True, key=k), r"ft\.nn\.LSTM: num_layers=2\.0 is a float"),
])
def test_counts_and_hidden_widths_that_are_no_ints_are_named(key, make, message):
    """A count below 1 or no int (MLP(3, 2, 4, 1.5) built one hidden layer, widths=[2.5] one
    of width 2: int() floored them) is named at the call."""
    with pytest.raises((TypeError, ValueError), match=message):
        make(key)
