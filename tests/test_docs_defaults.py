"""docs/migration/defaults.md, row by row, against the real libraries: each test measures
what Equinox, Flax NNX, PyTorch, optax and Keras (JAX backend) do by default, and what
functree does, so the table cannot drift from either. A row's test names the row."""

import inspect
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("KERAS_BACKEND", "jax")
# The five libraries, bound by _libraries when the module's first test runs: imported at
# collection they cost ~8 CPU-s in every xdist worker (each collects every file).
eqx: Any
nnx: Any
torch: Any
optax: Any
keras: Any


@pytest.fixture(scope="module", autouse=True)
def _libraries():
    """Import the libraries the table compares; a missing one (or Keras on another backend)
    skips every test of the module, as a module-level importorskip did."""
    global eqx, nnx, torch, optax, keras
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    torch = pytest.importorskip("torch")
    optax = pytest.importorskip("optax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs another backend (KERAS_BACKEND)")


@pytest.fixture(autouse=True)
def _keras_broadcasts():
    """Keras's own layers and initializers broadcast implicitly (a bias added to a batch):
    its calls run under JAX's default rank promotion, not the suite's "raise"."""
    with jax.numpy_rank_promotion("allow"):
        yield


KEY = jax.random.key(0)


def default(f, name):
    return inspect.signature(f).parameters[name].default


# ---- Layout and shapes ---------------------------------------------------------------
def test_convolution_input_layout():
    assert ft.nn.Conv2D(3, 4, 3, key=KEY)(jnp.ones((2, 8, 8, 3))).shape == (2, 8, 8, 4)  # channels last
    assert eqx.nn.Conv2d(3, 4, 3, key=KEY)(jnp.ones((3, 8, 8))).shape == (4, 6, 6)  # [C, H, W], one example
    assert nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))(jnp.ones((2, 8, 8, 3))).shape == (2, 8, 8, 4)
    assert torch.nn.Conv2d(3, 4, 3)(torch.ones(2, 3, 8, 8)).shape == (2, 4, 6, 6)  # [N, C, H, W]
    assert keras.layers.Conv2D(4, 3)(np.ones((2, 8, 8, 3), np.float32)).shape == (2, 6, 6, 4)  # channels_last


def test_dense_weight():
    assert ft.nn.Dense(2, 3, key=KEY).weight.shape == (2, 3)
    assert eqx.nn.Linear(2, 3, key=KEY).weight.shape == (3, 2)
    assert nnx.Linear(2, 3, rngs=nnx.Rngs(0)).kernel.shape == (2, 3)
    assert torch.nn.Linear(2, 3).weight.shape == (3, 2)
    dense = keras.layers.Dense(3)
    dense.build((None, 2))
    assert dense.kernel.shape == (2, 3)


def test_conv_filter():
    assert ft.nn.Conv2D(3, 4, (5, 6), key=KEY).weight.shape == (5, 6, 3, 4)  # HWIO
    assert eqx.nn.Conv2d(3, 4, (5, 6), key=KEY).weight.shape == (4, 3, 5, 6)
    assert nnx.Conv(3, 4, (5, 6), rngs=nnx.Rngs(0)).kernel.shape == (5, 6, 3, 4)
    assert torch.nn.Conv2d(3, 4, (5, 6)).weight.shape == (4, 3, 5, 6)
    conv = keras.layers.Conv2D(4, (5, 6))
    conv.build((None, 8, 8, 3))
    assert conv.kernel.shape == (5, 6, 3, 4)


def test_inputs_of_dense_and_norms():
    x = jnp.ones((5, 7, 2))  # two leading batch axes
    assert ft.nn.Dense(2, 3, key=KEY)(x).shape == (5, 7, 3)
    assert ft.nn.LayerNorm(2)(x).shape == x.shape
    with pytest.raises(Exception):  # noqa: B017  (Equinox: one example; jax.vmap for a batch)
        eqx.nn.Linear(2, 3, key=KEY)(x)
    assert jax.vmap(jax.vmap(eqx.nn.Linear(2, 3, key=KEY)))(x).shape == (5, 7, 3)
    assert nnx.Linear(2, 3, rngs=nnx.Rngs(0))(x).shape == (5, 7, 3)
    assert torch.nn.Linear(2, 3)(torch.ones(5, 7, 2)).shape == (5, 7, 3)
    assert keras.layers.Dense(3)(np.ones((5, 7, 2), np.float32)).shape == (5, 7, 3)


# ---- Padding and pooling -------------------------------------------------------------
def test_conv_padding():
    assert default(ft.nn.Conv2D, "padding") == "SAME"
    assert ft.nn.Conv1D(1, 1, 3, key=KEY)(jnp.ones((1, 8, 1))).shape == (1, 8, 1)
    assert eqx.nn.Conv1d(1, 1, 3, key=KEY)(jnp.ones((1, 8))).shape == (1, 6)  # padding=0: VALID
    assert nnx.Conv(1, 1, (3,), rngs=nnx.Rngs(0))(jnp.ones((1, 8, 1))).shape == (1, 8, 1)  # SAME
    assert torch.nn.Conv1d(1, 1, 3)(torch.ones(1, 1, 8)).shape == (1, 1, 6)
    assert keras.layers.Conv1D(1, 3)(np.ones((1, 8, 1), np.float32)).shape == (1, 6, 1)  # "valid"


def test_pool_stride_and_padding():
    x = jnp.arange(81.0).reshape(1, 9, 9, 1)
    assert ft.nn.MaxPool2D(2)(x).shape == (1, 4, 4, 1)  # stride = pool size, VALID
    assert ft.nn.AvgPool2D(2)(x).shape == (1, 4, 4, 1)
    assert eqx.nn.MaxPool2d(2)(jnp.ones((1, 9, 9))).shape == (1, 8, 8)  # stride=1, padding=0
    assert nnx.max_pool(x, (2, 2)).shape == (1, 8, 8, 1)  # strides=None -> 1, VALID
    assert torch.nn.MaxPool2d(2)(torch.ones(1, 1, 9, 9)).shape == (1, 1, 4, 4)  # stride = kernel
    assert keras.layers.MaxPooling2D(2)(np.ones((1, 9, 9, 1), np.float32)).shape == (1, 4, 4, 1)
    assert keras.layers.AveragePooling2D(2).padding == "valid"


# ---- Normalisation -------------------------------------------------------------------
def test_batchnorm_epsilon():
    assert ft.nn.BatchNorm(3).epsilon == 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Equinox warns that mode= is unspecified
        assert eqx.nn.BatchNorm(3, "batch", mode="batch").eps == 1e-5
    assert nnx.BatchNorm(3, rngs=nnx.Rngs(0)).epsilon == 1e-5
    assert torch.nn.BatchNorm1d(3).eps == 1e-5
    assert keras.layers.BatchNormalization().epsilon == 1e-3


def _batch(n=8, c=3):
    return np.random.default_rng(0).normal(2.0, 1.5, (n, c)).astype(np.float32)


def test_batchnorm_momentum_and_running_variance():
    """One training step from the initial statistics (mean 0, variance 1): the running
    statistics after it, and the training output."""
    x = _batch()
    mean, var, unbiased = x.mean(0), x.var(0), x.var(0, ddof=1)
    expected_mean, expected_var = 0.01 * mean, 0.99 + 0.01 * var  # running = 0.99·running + 0.01·batch

    bn = ft.nn.training(ft.nn.BatchNorm(3))
    new = _ft_batchnorm_step(bn, x)
    np.testing.assert_allclose(new.running_mean, expected_mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(new.running_variance, expected_var, rtol=0, atol=1e-6)  # biased batch variance

    model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))  # NNX: momentum 0.99, same convention, biased
    model(jnp.asarray(x))
    np.testing.assert_allclose(model.mean[...],
                               expected_mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.var[...], expected_var, rtol=0, atol=1e-6)

    bn_keras = keras.layers.BatchNormalization()  # Keras: momentum 0.99, same convention, biased
    bn_keras(x, training=True)
    np.testing.assert_allclose(np.asarray(bn_keras.moving_mean), expected_mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(bn_keras.moving_variance), expected_var, rtol=0, atol=1e-6)

    bn_torch = torch.nn.BatchNorm1d(3)  # torch: momentum=0.1 of the batch statistic, unbiased
    bn_torch.train()(torch.from_numpy(x))
    np.testing.assert_allclose(bn_torch.running_mean.numpy(), 0.1 * mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(bn_torch.running_var.numpy(), 0.9 + 0.1 * unbiased, rtol=0, atol=1e-6)
    # functree's momentum=0.9 is torch's 0.1 (the mean; the variance stays biased)
    np.testing.assert_allclose(_ft_batchnorm_step(ft.nn.training(ft.nn.BatchNorm(3, momentum=0.9)), x).running_mean,
                               0.1 * mean, rtol=0, atol=1e-6)


def test_equinox_batchnorm_default_is_another_algorithm():
    """Equinox's default (mode="ema", with a warning) copies the first batch's statistics
    and normalizes training batches with the running average; mode="batch" is the
    convention of functree, NNX, torch and Keras in training."""
    x = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ema, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", momentum=0.99, mode="batch")
        default_ema, default_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", momentum=0.99)
    assert default_ema.mode == "ema"
    _, default_state = jax.vmap(default_ema, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        jnp.asarray(x), default_state)
    running_mean, _ = default_state.get(default_ema.ema_state_index)
    np.testing.assert_allclose(running_mean, x.mean(0), rtol=0, atol=1e-6)  # the first batch, copied
    out, state = jax.vmap(ema, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(jnp.asarray(x), state)
    bn = ft.nn.training(ft.nn.BatchNorm(3, epsilon=1e-5))
    ours, _ = ft.nn.collect_state(lambda m: m(jnp.asarray(x)), bn)
    np.testing.assert_allclose(out, ours, rtol=0, atol=3e-6 * np.abs(out).max())
    hidden_mean, _ = state.get(ema.batch_state_index)
    np.testing.assert_allclose(hidden_mean, _ft_batchnorm_step(bn, x).running_mean, rtol=0, atol=1e-6)


def _ft_batchnorm_step(bn, x):
    """The BatchNorm after one training forward pass (its recorded state written back)."""
    _, _, state = ft.nn.value_with_gradient_and_state(lambda m: m(jnp.asarray(x)).sum(), bn)
    return ft.nn.apply_state(bn, state)


def test_norm_epsilons():
    assert (ft.nn.LayerNorm(3).epsilon, ft.nn.RMSNorm(3).epsilon, ft.nn.GroupNorm(1, 3).epsilon) == (1e-5, 1e-6, 1e-5)
    assert (eqx.nn.LayerNorm(3).eps, eqx.nn.RMSNorm(3).eps, eqx.nn.GroupNorm(1, 3).eps) == (1e-5, 1e-5, 1e-5)
    rngs = nnx.Rngs(0)
    assert (nnx.LayerNorm(3, rngs=rngs).epsilon, nnx.RMSNorm(3, rngs=rngs).epsilon,
            nnx.GroupNorm(3, num_groups=1, rngs=rngs).epsilon) == (1e-6, 1e-6, 1e-6)
    assert (torch.nn.LayerNorm(3).eps, torch.nn.RMSNorm(3).eps, torch.nn.GroupNorm(1, 3).eps) == (1e-5, None, 1e-5)
    assert (keras.layers.LayerNormalization().epsilon, keras.layers.RMSNormalization().epsilon,
            keras.layers.GroupNormalization(1).epsilon) == (1e-3, 1e-6, 1e-3)


# ---- Initialisers --------------------------------------------------------------------
FAN_IN, FAN_OUT = 400, 300
BOUND = 1 / np.sqrt(FAN_IN)  # U(±1/√in): Equinox, torch
GLOROT = np.sqrt(6 / (FAN_IN + FAN_OUT))  # functree, Keras


def _kind(w):
    """"uniform ±b" or "normal σ" of a large weight matrix, read off its samples."""
    w = np.asarray(w).ravel()
    bound = np.abs(w).max()
    uniform = abs(w.std() - bound / np.sqrt(3)) < 0.03 * bound  # U(±b) has σ = b/√3
    return ("uniform", bound) if uniform else ("normal", w.std())


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_dense_initializers(which):
    ft_dense = ft.nn.Dense(FAN_IN, FAN_OUT, key=KEY)
    eqx_dense = eqx.nn.Linear(FAN_IN, FAN_OUT, key=KEY)
    nnx_dense = nnx.Linear(FAN_IN, FAN_OUT, rngs=nnx.Rngs(0))
    torch_dense = torch.nn.Linear(FAN_IN, FAN_OUT)
    keras_dense = keras.layers.Dense(FAN_OUT)
    keras_dense.build((None, FAN_IN))
    if which == "bias":
        assert not np.any(ft_dense.bias) and not np.any(nnx_dense.bias[...]) and not np.any(keras_dense.bias)
        for b in (eqx_dense.bias, torch_dense.bias.detach().numpy()):
            assert 0.9 * BOUND < np.abs(b).max() <= BOUND  # U(±1/√in)
        return
    kind, size = _kind(ft_dense.weight)
    assert kind == "uniform" and size == pytest.approx(GLOROT, rel=0.02)
    kind, size = _kind(keras_dense.kernel)
    assert kind == "uniform" and size == pytest.approx(GLOROT, rel=0.02)
    for w in (eqx_dense.weight, torch_dense.weight.detach().numpy()):
        kind, size = _kind(w)
        assert kind == "uniform" and size == pytest.approx(BOUND, rel=0.02)
    kind, size = _kind(nnx_dense.kernel[...])  # lecun normal: truncated normal, σ = 1/√in
    assert kind == "normal" and size == pytest.approx(BOUND, rel=0.05)
    equinox_like = ft.nn.Dense(FAN_IN, FAN_OUT, key=KEY, weight_initializer=ft.nn.initializers.variance_scaling(
        1 / 3, "fan_in", "uniform"))
    assert _kind(equinox_like.weight)[1] == pytest.approx(BOUND, rel=0.02)


def test_conv_initializers():
    c_in, k = 16, 5  # fan_in = 16·5·5 = 400
    kind, size = _kind(ft.nn.Conv2D(c_in, 32, k, key=KEY).weight)
    assert kind == "uniform" and size == pytest.approx(np.sqrt(6 / (c_in * k * k + 32 * k * k)), rel=0.02)
    for w in (eqx.nn.Conv2d(c_in, 32, k, key=KEY).weight, torch.nn.Conv2d(c_in, 32, k).weight.detach().numpy()):
        kind, size = _kind(w)
        assert kind == "uniform" and size == pytest.approx(1 / np.sqrt(c_in * k * k), rel=0.02)
    conv = keras.layers.Conv2D(32, k)
    conv.build((None, 8, 8, c_in))
    kind, size = _kind(conv.kernel)
    assert kind == "uniform" and size == pytest.approx(np.sqrt(6 / (c_in * k * k + 32 * k * k)), rel=0.02)
    kind, size = _kind(nnx.Conv(c_in, 32, (k, k), rngs=nnx.Rngs(0)).kernel[...])
    assert kind == "normal" and size == pytest.approx(1 / np.sqrt(c_in * k * k), rel=0.05)


def test_recurrent_initializers_and_forget_bias():
    hidden = 64
    lstm = ft.nn.LSTMCell(hidden, hidden, key=KEY)
    assert np.asarray(lstm.forget_bias if hasattr(lstm, "forget_bias") else 1.0) == 1.0
    cell = eqx.nn.GRUCell(hidden, hidden, key=KEY)
    for w in (cell.weight_ih, cell.weight_hh):
        assert _kind(w) == ("uniform", pytest.approx(1 / np.sqrt(hidden), rel=0.02))
    for w in torch.nn.GRUCell(hidden, hidden).parameters():
        assert np.abs(w.detach().numpy()).max() <= 1 / np.sqrt(hidden)
    keras_lstm = keras.layers.LSTM(hidden)
    assert keras_lstm.cell.unit_forget_bias
    assert type(keras_lstm.cell.kernel_initializer).__name__ == "GlorotUniform"
    assert type(keras_lstm.cell.recurrent_initializer).__name__ == "Orthogonal"
    nnx_lstm = nnx.LSTMCell(hidden, hidden, rngs=nnx.Rngs(0))
    recurrent = np.asarray(nnx_lstm.hf.kernel[...])  # orthogonal: W Wᵀ = I
    np.testing.assert_allclose(recurrent @ recurrent.T, np.eye(hidden), rtol=0, atol=1e-5)
    torch_lstm = torch.nn.LSTMCell(hidden, hidden)
    assert np.any(torch_lstm.bias_ih.detach().numpy()[hidden:2 * hidden])  # forget gate: random


def test_parameter_dtype_under_x64():
    """With jax_enable_x64 on, Equinox's layers (dtype=None) are float64; functree's, NNX's,
    torch's and Keras' float32, as without it (the table's row; the fix converts)."""
    with jax.enable_x64(True):
        assert ft.nn.Dense(2, 3, key=KEY).weight.dtype == jnp.float32
        assert ft.nn.Dense(2, 3, key=KEY, dtype=jnp.float64).weight.dtype == jnp.float64
        assert ft.cast(ft.nn.Dense(2, 3, key=KEY), jnp.float64).weight.dtype == jnp.float64
        assert eqx.nn.Linear(2, 3, key=KEY).weight.dtype == jnp.float64
        assert nnx.Linear(2, 3, rngs=nnx.Rngs(0)).kernel[...].dtype == jnp.float32
        dense = keras.layers.Dense(3)
        dense.build((None, 2))
        assert dense.kernel.dtype == "float32"
    assert torch.nn.Linear(2, 3).weight.dtype == torch.float32


# ---- Recurrent cells -----------------------------------------------------------------
def test_gru_call_and_biases():
    hidden, x = 4, jnp.ones(3)
    state, out = ft.nn.GRUCell(3, hidden, key=KEY)(jnp.zeros(hidden), x)  # (state, x) -> (state, output)
    assert state.shape == out.shape == (hidden,)
    gru = eqx.nn.GRUCell(3, hidden, key=KEY)
    assert gru(x, jnp.zeros(hidden)).shape == (hidden,)  # (input, hidden) -> hidden
    assert gru.bias.shape == (3 * hidden,) and gru.bias_n.shape == (hidden,)
    carry, y = nnx.GRUCell(3, hidden, rngs=nnx.Rngs(0))(jnp.zeros(hidden), x)  # (carry, x) -> (carry, output)
    assert carry.shape == y.shape == (hidden,)
    torch_gru = torch.nn.GRUCell(3, hidden)
    assert torch_gru(torch.ones(1, 3), torch.zeros(1, hidden)).shape == (1, hidden)
    assert {n for n, _ in torch_gru.named_parameters() if "bias" in n} == {"bias_ih", "bias_hh"}
    keras_gru = keras.layers.GRUCell(hidden)  # reset_after=True: an input and a recurrent bias
    keras_gru.build((None, 3))
    assert keras_gru.bias.shape == (2, 3 * hidden)


# ---- Dropout and modes ---------------------------------------------------------------
def test_dropout_mode_and_argument():
    x = jnp.ones(1000)
    assert not ft.nn.Dropout(0.5).training and default(ft.nn.Dropout, "rate") is inspect.Parameter.empty
    assert not np.all(eqx.nn.Dropout(p=0.5)(x, key=KEY) == x)  # training: inference=False
    assert not np.all(nnx.Dropout(rate=0.5, rngs=nnx.Rngs(0))(x) == x)  # deterministic=False
    assert torch.nn.Dropout(p=0.5).training
    assert np.all(np.asarray(keras.layers.Dropout(rate=0.5)(np.ones(1000, np.float32))) == 1.0)  # a call: inference


# ---- Optimizers ----------------------------------------------------------------------
def test_adamw_weight_decay_and_decayed_leaves():
    assert default(ft.optim.adamw, "weight_decay") == 0.01
    assert default(optax.adamw, "weight_decay") == 1e-4 and default(optax.adamw, "mask") is None
    assert torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["weight_decay"] == 0.01
    assert keras.optimizers.AdamW().weight_decay == 0.004
    assert callable(keras.optimizers.AdamW().exclude_from_weight_decay)
    # functree decays weights, not biases; optax every leaf
    model = ft.nn.Dense(2, 2, key=KEY)
    grads = jax.tree.map(jnp.zeros_like, model)
    updates, _ = ft.optim.adamw(1.0).update(grads, ft.optim.adamw(1.0).init(model), model)
    assert np.any(updates.weight) and not np.any(updates.bias)
    params = {"weight": jnp.ones(2), "bias": jnp.ones(2)}
    tx = optax.adamw(1.0)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its float rate and int count
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    assert np.any(updates["weight"]) and np.any(updates["bias"])


def test_sgd_rmsprop_adagrad_adadelta_defaults():
    args = lambda f, *names: tuple(default(f, n) for n in names)  # noqa: E731
    torch_defaults = lambda cls: cls([torch.zeros(1, requires_grad=True)]).defaults  # noqa: E731
    assert default(ft.optim.sgd, "learning_rate") == 0.01 and torch_defaults(torch.optim.SGD)["lr"] == 1e-3
    assert default(optax.sgd, "learning_rate") is inspect.Parameter.empty
    assert float(keras.optimizers.SGD().learning_rate) == pytest.approx(0.01)
    assert args(ft.optim.rmsprop, "learning_rate", "rho", "epsilon") == (1e-3, 0.9, 1e-8)
    assert args(optax.rmsprop, "decay", "eps", "eps_in_sqrt") == (0.9, 1e-8, True)
    t = torch_defaults(torch.optim.RMSprop)
    assert (t["lr"], t["alpha"], t["eps"]) == (1e-2, 0.99, 1e-8)
    k = keras.optimizers.RMSprop()
    assert (k.rho, k.epsilon) == (0.9, 1e-7) and float(k.learning_rate) == pytest.approx(1e-3)
    assert args(ft.optim.adagrad, "learning_rate", "initial_accumulator_value", "epsilon") == (1e-3, 0.1, 1e-8)
    assert args(optax.adagrad, "initial_accumulator_value", "eps") == (0.1, 1e-7)
    t = torch_defaults(torch.optim.Adagrad)
    assert (t["lr"], t["initial_accumulator_value"], t["eps"]) == (1e-2, 0, 1e-10)
    k = keras.optimizers.Adagrad()
    assert (k.initial_accumulator_value, k.epsilon) == (0.1, 1e-7) and float(k.learning_rate) == pytest.approx(1e-3)
    assert args(ft.optim.adadelta, "learning_rate", "rho") == (1.0, 0.95)
    assert default(optax.adadelta, "rho") == 0.9 and default(optax.adadelta, "learning_rate") is None
    t = torch_defaults(torch.optim.Adadelta)
    assert (t["lr"], t["rho"]) == (1.0, 0.9)
    assert keras.optimizers.Adadelta().rho == 0.95 and float(keras.optimizers.Adadelta().learning_rate) == pytest.approx(1e-3)


def test_rmsprop_momentum_and_radam_epsilon():
    """Two steps of g = 1 at η 0.1 then 0.01 (momentum 0.9): η outside the buffer (torch,
    functree) moves −0.368, inside (optax, Keras) −0.624. RAdam on gradients of 1e-8:
    ε before the bias correction (torch, functree) against after it (optax)."""
    def ours_rms(tx):
        p = {"w": jnp.zeros(1)}
        state, w, update = tx.init(p), 0.0, jax.jit(tx.update)  # one program, not one per operation
        for rate in (0.1, 0.01):
            state = ft.optim.set_hyperparameters(state, learning_rate=rate)
            u, state = update({"w": jnp.ones(1)}, state, p)
            w += float(np.asarray(u["w"])[0])
        return w

    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.RMSprop([w], lr=0.1, alpha=0.9, momentum=0.9)
    for rate in (0.1, 0.01):
        opt.param_groups[0]["lr"] = rate
        w.grad = torch.ones(1)
        opt.step()
    with jax.numpy_dtype_promotion("standard"):
        tx = optax.inject_hyperparams(optax.rmsprop)(learning_rate=0.1, decay=0.9, momentum=0.9, eps_in_sqrt=False)
        state, p, update = tx.init({"w": jnp.zeros(1)}), 0.0, jax.jit(tx.update)
        for rate in (0.1, 0.01):
            state.hyperparams["learning_rate"] = jnp.asarray(rate)
            u, state = update({"w": jnp.ones(1)}, state)
            p += float(np.asarray(u["w"])[0])
    v = keras.Variable(np.zeros(1, np.float32))
    k = keras.optimizers.RMSprop(learning_rate=0.1, rho=0.9, momentum=0.9, epsilon=1e-8)
    for rate in (0.1, 0.01):
        k.learning_rate = rate
        k.apply([np.ones(1, np.float32)], [v])
    assert ours_rms(ft.optim.rmsprop(0.1, rho=0.9, momentum=0.9)) == pytest.approx(float(w.detach()[0]), abs=1e-6)
    assert float(w.detach()[0]) == pytest.approx(-0.3676, abs=1e-4)
    assert p == pytest.approx(-0.6238, abs=1e-4) and float(np.asarray(v)[0]) == pytest.approx(-0.6238, abs=1e-4)

    g = np.full(1, 1e-8, np.float32)
    ours = ft.optim.radam(1.0)
    with jax.numpy_dtype_promotion("standard"):
        theirs = optax.radam(1.0)
        steps = {}
        for name, tx in (("ours", ours), ("optax", theirs)):
            state, total, update = tx.init({"w": jnp.zeros(1)}), 0.0, jax.jit(tx.update)
            for _ in range(8):
                u, state = update({"w": jnp.asarray(g)}, state)
                total += float(np.asarray(u["w"])[0])
            steps[name] = total
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.RAdam([w], lr=1.0)
    for _ in range(8):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    assert steps["ours"] == pytest.approx(float(w.detach()[0]), rel=1e-4)
    assert abs(steps["optax"] - float(w.detach()[0])) > 0.5 * abs(float(w.detach()[0]))
    assert not hasattr(keras.optimizers, "RAdam")


def test_adam_epsilon():
    """functree, optax and torch: m̂/(√v̂ + ε) with ε 1e-8; Keras: ε 1e-7 before the bias
    correction. Eight steps of g = 1e-8 tell the placements apart."""
    assert default(ft.optim.adam, "epsilon") == 1e-8 == default(optax.adam, "eps")
    assert torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults["eps"] == 1e-8
    assert keras.optimizers.Adam().epsilon == 1e-7
    g = np.full(1, 1e-8, np.float32)
    tx, total = ft.optim.adam(1.0), 0.0
    state, update = tx.init({"w": jnp.zeros(1)}), jax.jit(tx.update)  # one program, not one per operation
    for _ in range(8):
        u, state = update({"w": jnp.asarray(g)}, state)
        total += float(np.asarray(u["w"])[0])
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([w], lr=1.0)
    for _ in range(8):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    v = keras.Variable(np.zeros(1, np.float32))
    k = keras.optimizers.Adam(learning_rate=1.0, epsilon=1e-8)
    for _ in range(8):
        k.apply([g], [v])
    assert total == pytest.approx(float(w.detach()[0]), rel=1e-4)
    assert abs(float(np.asarray(v)[0]) - total) > 0.5 * abs(total)  # ε before the correction: other steps
