"""GRUCell, LSTMCell and RNN against numpy step loops; gradients; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def _numpy(cell):
    return {k: np.asarray(v, np.float64) for k, v in ft.to_flat_dict(cell).items()}


def _gru_step(p, h, x):
    H = h.shape[-1]
    wi, wh, bi, bh = p["input_weight"], p["hidden_weight"], p["input_bias"], p["hidden_bias"]
    r = _sigmoid(x @ wi[:, :H] + bi[:H] + h @ wh[:, :H] + bh[:H])
    z = _sigmoid(x @ wi[:, H:2 * H] + bi[H:2 * H] + h @ wh[:, H:2 * H] + bh[H:2 * H])
    n = np.tanh(x @ wi[:, 2 * H:] + bi[2 * H:] + r * (h @ wh[:, 2 * H:] + bh[2 * H:]))
    return (1 - z) * n + z * h


def _lstm_step(p, h, c, x):
    H = h.shape[-1]
    g = x @ p["input_weight"] + h @ p["hidden_weight"] + p["bias"]
    i, f, gg, o = (g[..., k * H:(k + 1) * H] for k in range(4))
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(gg)
    return _sigmoid(o) * np.tanh(c), c


def _randomize(cell):
    leaves, treedef = jax.tree.flatten(cell)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(treedef, [0.5 * jax.random.normal(k, a.shape) for k, a in zip(keys, leaves)])


def test_gru_rnn_matches_step_loop(key):
    cell = _randomize(ft.nn.GRUCell(3, 4, key=key))
    xs = np.asarray(jax.random.normal(jax.random.key(1), (2, 6, 3)))
    ys, h_final = jax.jit(lambda m, x: m(x, return_state=True))(ft.nn.RNN(cell), xs)
    p = _numpy(cell)
    h = np.zeros((2, 4))
    for t in range(6):
        h = _gru_step(p, h, xs[:, t])
        np.testing.assert_allclose(ys[:, t], h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h_final, h, rtol=1e-4, atol=1e-5)


def test_lstm_rnn_reverse_and_initial_state(key):
    cell = _randomize(ft.nn.LSTMCell(3, 4, key=key))
    xs = np.asarray(jax.random.normal(jax.random.key(1), (5, 2, 3)))  # time-major
    h0 = np.asarray(jax.random.normal(jax.random.key(2), (2, 4)))
    rnn = ft.nn.RNN(cell, time_axis=0, reverse=True)
    ys, state = jax.jit(lambda m, x, s: m(x, s, return_state=True))(rnn, xs, ft.nn.LSTMState(jnp.asarray(h0), jnp.zeros((2, 4))))
    p = _numpy(cell)
    h, c = h0, np.zeros((2, 4))
    for t in reversed(range(5)):
        h, c = _lstm_step(p, h, c, xs[t])
        np.testing.assert_allclose(ys[t], h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.cell, c, rtol=1e-4, atol=1e-5)


def test_initialisation(key):
    cell = ft.nn.LSTMCell(3, 4, key=key)
    np.testing.assert_array_equal(cell.bias, [0] * 4 + [1] * 4 + [0] * 8)
    block = cell.hidden_weight[:, :4]
    np.testing.assert_allclose(block.T @ block, np.eye(4), atol=1e-5)
    gru = ft.nn.GRUCell(3, 4, key=key)
    assert gru.input_weight.shape == (3, 12) and gru.hidden_weight.shape == (4, 12)


@pytest.mark.parametrize("cell_cls", [ft.nn.GRUCell, ft.nn.LSTMCell])
def test_gradients_finite_differences(key, cell_cls):
    with jax.enable_x64(True):
        rnn = _x64(ft.nn.RNN(cell_cls(2, 3, key=key)))
        xs = jax.random.normal(jax.random.key(1), (1, 3, 2), jnp.float64)
        check_grads(jax.jit(lambda m, xs: m(xs)), (rnn, xs), order=1, modes=["rev"])


def test_jit_and_key_paths(key):
    rnn = ft.nn.RNN(ft.nn.GRUCell(3, 4, key=key))
    xs = jnp.ones((2, 5, 3))
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(rnn, xs), rnn(xs), rtol=1e-5, atol=1e-6)
    assert "cell.hidden_weight" in ft.to_flat_dict(rnn)


def test_wrong_feature_size_names_the_cell_path(key):
    rnn = ft.nn.RNN(ft.nn.LSTMCell(3, 4, key=key))
    with pytest.raises(ft.nn.LayerInputError, match=r"LSTMCell at \.cell expects inputs \[\.\.\., 3\] \(float\), got f32\[2,5\]"):
        rnn(jnp.ones((2, 7, 5)))
    with pytest.raises(ft.nn.LayerInputError, match=r"RNN expects inputs \[\.\.\., time, features\]"):
        rnn(jnp.ones(3))
