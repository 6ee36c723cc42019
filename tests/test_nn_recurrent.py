"""GRUCell, LSTMCell and RNN against numpy step loops; gradients; errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import needs_float16_conversions
from jax.test_util import check_grads

import functree as ft
from functree import _compat as compat


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


def _normal(shape, seed, dtype=np.float32):
    """N(0, 1) drawn by NumPy (eager jax.random compiled a program per shape)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def _randomize(cell):
    """Every leaf of ``cell`` N(0, 0.5^2) in float32 (``cell`` may be abstract: jax.eval_shape)."""
    leaves, treedef = jax.tree.flatten(cell)
    return jax.tree.unflatten(treedef, [jax.device_put(0.5 * _normal(a.shape, 7 + i)) for i, a in enumerate(leaves)])


def test_gru_rnn_matches_step_loop(key):
    cell = _randomize(ft.nn.GRUCell(3, 4, key=key))
    xs = _normal((2, 6, 3), 1)
    ys, h_final = map(np.asarray, jax.jit(lambda m, x: m(x, return_state=True))(ft.nn.RNN(cell), xs))
    p = _numpy(cell)
    h = np.zeros((2, 4))
    for t in range(6):
        h = _gru_step(p, h, xs[:, t])
        np.testing.assert_allclose(ys[:, t], h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h_final, h, rtol=1e-4, atol=1e-5)


def test_lstm_rnn_reverse_and_initial_state(key):
    cell = _randomize(ft.nn.LSTMCell(3, 4, key=key))
    xs = _normal((5, 2, 3), 1)  # time-major
    h0 = _normal((2, 4), 2)
    rnn = ft.nn.RNN(cell, time_axis=0, reverse=True)
    ys, state = jax.jit(lambda m, x, s: m(x, s, return_state=True))(rnn, xs, ft.nn.LSTMState(h0, np.zeros((2, 4), np.float32)))
    ys = np.asarray(ys)
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
    # Every weight (random, the cell's shapes) and input in one float64 vector, cut apart inside
    # the jitted function: check_grads perturbs and multiplies its arguments eagerly, one
    # program per argument shape (a tree of them compiled ~25).
    rnn = _randomize(jax.eval_shape(lambda: ft.nn.RNN(cell_cls(2, 3, key=key))))
    leaves, treedef = jax.tree.flatten((rnn, _normal((1, 3, 2), 1)))
    flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in leaves])
    ends = np.cumsum([a.size for a in leaves])[:-1]

    def run(v):
        m, xs = jax.tree.unflatten(treedef, [p.reshape(a.shape) for p, a in zip(jnp.split(v, ends), leaves)])
        return m(xs)

    with jax.enable_x64(True):
        check_grads(jax.jit(run), (flat,), order=1, modes=["rev"])


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


@pytest.mark.parametrize("cell_cls", [ft.nn.SimpleRNNCell, ft.nn.GRUCell, ft.nn.LSTMCell])
def test_an_ensembles_cell_or_rnn_called_outside_vmap_is_refused(key, cell_cls):
    # 3 cells of 3 inputs and 3 hidden on a batch of 3: x @ input_weight [3, 3, 3] broadcast over
    # the models and the biases over the rows, a [3, 3, 3] state with no error (an LSTM: JAX's
    # dot_general error); the RNN's scan said the cell "maps f32[3,3] to f32[3,3,3]".
    cells = jax.vmap(lambda k: cell_cls(3, 3, key=k))(jax.random.split(key, 3))
    name = cell_cls.__name__
    with pytest.raises(ft.nn.LayerInputError, match=rf"{name} holds input_weight f32\[3,3,\d+\], but one {name}'s "
                                                    r"input_weight has 2 axes(.|\n)*jax.vmap\(lambda m: m\(x\)\)"):
        cells(jax.tree.map(lambda a: a[0], cells).zero_state((3,)), jnp.ones((3, 3)))
    # an RNN given one model's initial state: "expects initial_state [2, 3]", the models' count
    rnns = ft.nn.RNN(jax.vmap(lambda k: cell_cls(3, 4, key=k))(jax.random.split(key, 3)))
    one = ft.nn.RNN(jax.tree.map(lambda a: a[1], rnns.cell))
    xs, h0 = jnp.ones((2, 5, 3)), one.cell.zero_state((2,))
    for given in ((xs,), (xs, h0)):
        with pytest.raises(ft.nn.LayerInputError, match=rf"{name} at \.cell holds input_weight f32\[3,3,\d+\]"):
            rnns(*given)
    right = jax.vmap(lambda m: m(xs, h0))(rnns)       # the fix
    np.testing.assert_allclose(right[1], one(xs, h0), rtol=1e-5, atol=1e-6)


class _BNCell(ft.Module):
    """A GRU fed through a BatchNorm (layer state recorded at every step)."""

    gru: ft.nn.GRUCell
    bn: ft.nn.BatchNorm

    def zero_state(self, batch_shape=()):
        return self.gru.zero_state(batch_shape)

    def __call__(self, h, x):
        h, _ = self.gru(h, self.bn(x))
        return h, h


def _bn_rnn(reverse=False):
    cell = _BNCell(ft.nn.GRUCell(3, 4, key=jax.random.key(0)), ft.nn.BatchNorm(3, momentum=0.5))
    return ft.nn.training(ft.nn.RNN(cell, reverse=reverse))


def _bn_inputs():
    return jax.device_put(_normal((8, 4, 3), 3) + np.arange(1.0, 5.0, dtype=np.float32)[:, None])  # step means 1..4


@functools.partial(jax.jit, static_argnames="reverse")
def _loop_state(cell, xs, reverse):
    """The cell called step by step in a Python loop inside one collect_state (unrolled in one
    program: eagerly, the steps' GRU and BatchNorm operations compiled ~20)."""
    def run(c):
        h = c.zero_state(xs.shape[:1])
        for t in (reversed if reverse else iter)(range(xs.shape[1])):
            h, _ = c(h, xs[:, t])
        return h
    h, updates = ft.nn.collect_state(run, cell)
    return h, {"." + "cell" + str(k): v for k, v in updates.items()}


@pytest.mark.parametrize("reverse", [False, True])
def test_state_recorded_in_cell_is_the_last_steps_as_a_loop_records(reverse):
    # Before: the records escaped lax.scan (tracers), later calls recorded nothing; then each
    # step's record was computed from the statistics before the call (the last step's alone).
    rnn, xs = _bn_rnn(reverse), _bn_inputs()
    h_loop, expected = _loop_state(rnn.cell, xs, reverse)
    assert sorted(expected) == [".cell.bn.running_mean", ".cell.bn.running_variance"]
    collect = jax.jit(lambda m, x: ft.nn.collect_state(lambda m: m(x, return_state=True), m))
    for run in (lambda: ft.nn.collect_state(lambda m: m(xs, return_state=True), rnn), lambda: collect(rnn, xs)) * 2:
        (_, h), updates = run()
        assert sorted(map(str, updates)) == sorted(expected)
        for path, value in expected.items():
            np.testing.assert_allclose(updates[ft.key_path(rnn, path)], value, rtol=0, atol=1e-5)
        np.testing.assert_allclose(h, h_loop, rtol=0, atol=1e-5)
    # each step updates from the previous step's record, as torch's loop over the cell:
    # r_t = 0.5 r_{t-1} + 0.5 mean(x_t) from 0, in scan order (time 3 -> 0 backwards)
    mean = ft.nn.apply_state(rnn, updates).cell.bn.running_mean
    expected_mean = np.zeros(3, np.float32)
    for t in (reversed if reverse else iter)(range(xs.shape[1])):
        expected_mean = 0.5 * expected_mean + 0.5 * np.asarray(xs[:, t]).mean(0)
    np.testing.assert_allclose(mean, expected_mean, rtol=0, atol=1e-5)
    torch = pytest.importorskip("torch")
    bn = torch.nn.BatchNorm1d(3, momentum=0.5)
    for t in (reversed if reverse else iter)(range(xs.shape[1])):
        bn(torch.tensor(np.asarray(xs[:, t])))
    np.testing.assert_allclose(mean, bn.running_mean.detach().numpy(), rtol=0, atol=1e-5)


def test_state_recorded_in_cell_through_gradient_and_trainer():
    rnn, xs = _bn_rnn(), _bn_inputs()
    _, expected = _loop_state(rnn.cell, xs, False)
    model = ft.nn.Sequential(rnn, ft.nn.Dense(4, 1, key=jax.random.key(1)))

    def loss_fn(m, x, y):
        return ft.losses.mean_squared_error(m(x), y)

    y = jnp.zeros((8, 4, 1))
    step = jax.jit(lambda m: ft.nn.value_with_gradient_and_state(loss_fn, m, xs, y))
    _, grads, state = step(model)
    assert bool(jnp.all(jnp.isfinite(grads.layers[0].cell.gru.hidden_weight)))
    np.testing.assert_allclose(state[ft.key_path(model, ".layers[0].cell.bn.running_mean")],
                               expected[".cell.bn.running_mean"], rtol=0, atol=1e-5)
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.01), lambda m, b: loss_fn(m, *b))
    trainer.fit([(xs, y)], epochs=1, progress=False)  # the statistics depend on xs only
    np.testing.assert_allclose(trainer.model.layers[0].cell.bn.running_mean,
                               expected[".cell.bn.running_mean"], rtol=0, atol=1e-5)


class _DropCell(ft.Module):
    gru: ft.nn.GRUCell
    drop: ft.nn.Dropout

    def zero_state(self, batch_shape=()):
        return self.gru.zero_state(batch_shape)

    def __call__(self, h, x, *, key=None):
        h, _ = self.gru(h, self.drop(x, key=key))
        return h, h


def test_key_gives_each_step_its_own_key_for_a_cell_that_takes_one():
    cell = ft.nn.training(_DropCell(ft.nn.GRUCell(3, 4, key=jax.random.key(0)), ft.nn.Dropout(0.5)))
    xs, k = np.ones((2, 5, 3), np.float32), jax.random.key(9)
    ys = np.asarray(ft.nn.RNN(cell)(xs, key=k))  # before: TypeError (no key=)
    h, keys = cell.zero_state((2,)), jax.random.split(k, 5)
    step = jax.jit(lambda c, h, x, kt: c(h, x, key=kt)[0])  # each step the same program (eagerly ~15)
    for t in range(5):
        h = step(cell, h, xs[:, t], keys[t])
        np.testing.assert_allclose(ys[:, t], h, rtol=0, atol=1e-6)
    masks = [np.asarray(cell.drop(xs[:, 0], key=kt) != 0) for kt in keys]
    assert any((masks[0] != m).any() for m in masks[1:])  # not one mask for every step
    model = ft.nn.training(ft.nn.Sequential(ft.nn.RNN(cell), ft.nn.Dense(4, 1, key=jax.random.key(1))))
    assert model(xs, key=k).shape == (2, 5, 1)
    gru = ft.nn.RNN(ft.nn.GRUCell(3, 4, key=jax.random.key(0)))  # a cell without key=: ignored
    np.testing.assert_array_equal(gru(xs, key=k), gru(xs))


@pytest.mark.parametrize("cell_cls", [ft.nn.GRUCell, ft.nn.LSTMCell])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=needs_float16_conversions)])
def test_narrow_dtype_cells_are_the_float32_cell_rounded(key, cell_cls, dtype):
    narrow = cell_cls(3, 4, key=key, dtype=dtype)  # before: LAPACK has no bf16/f16 QR
    wide = cell_cls(3, 4, key=key)
    for name, value in ft.to_flat_dict(wide).items():
        got = ft.to_flat_dict(narrow)[name]
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(value.astype(dtype), np.float32))


def test_float32_initialisation_unchanged(key):
    cell = ft.nn.LSTMCell(3, 4, key=key)
    k_in, k_h = jax.random.split(key)
    np.testing.assert_array_equal(cell.input_weight, jax.nn.initializers.glorot_uniform()(k_in, (3, 16)))
    blocks = [jax.nn.initializers.orthogonal()(k, (4, 4)) for k in jax.random.split(k_h, 4)]
    np.testing.assert_array_equal(cell.hidden_weight, jnp.concatenate(blocks, axis=1))


@jax.jit
def _loop(cell, state, xs):
    """The cell called step by step in a Python loop (unrolled in one program: eagerly, each
    step's operations compiled ~20 programs per cell and dtype)."""
    ys = []
    for t in range(xs.shape[1]):
        state, y = cell(state, xs[:, t])
        ys.append(y)
    return jnp.stack(ys, 1), state


@pytest.mark.parametrize("cell_cls", [ft.nn.GRUCell, ft.nn.LSTMCell])
def test_mixed_dtypes_run_as_a_python_loop_does(key, cell_cls):
    cell = _randomize(cell_cls(3, 4, key=key))
    xs = _normal((2, 5, 3), 1)
    with jax.numpy_dtype_promotion("standard"):
        half = ft.cast(cell, jnp.bfloat16)  # bfloat16 weights on float32 data (before: scan carry error)
        ys = ft.nn.RNN(half)(xs)
        expected, _ = _loop(half, half.zero_state((2,)), xs)
        assert ys.dtype == expected.dtype == jnp.float32
        np.testing.assert_allclose(ys, expected, rtol=0, atol=1e-5)
        h0 = jax.tree.map(lambda a: (np.asarray(a) + 0.5).astype(jnp.bfloat16), cell.zero_state((2,)))  # bf16 state, f32 weights
        ys, final = ft.nn.RNN(cell)(xs, h0, return_state=True)
        expected, expected_final = _loop(cell, h0, xs)
        assert ys.dtype == jnp.float32 and jax.tree.leaves(final)[0].dtype == jnp.float32
        np.testing.assert_allclose(ys, expected, rtol=0, atol=1e-5)
        for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(expected_final)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    ys = ft.nn.RNN(half)(xs.astype(jnp.bfloat16))  # all bfloat16 stays bfloat16
    assert ys.dtype == jnp.bfloat16


class _NarrowingCell(ft.Module):
    w: jax.Array

    def zero_state(self, batch_shape=()):
        return jnp.zeros((*batch_shape, 2))

    def __call__(self, h, x):
        h = jnp.tanh(x @ self.w + h).astype(jnp.bfloat16)
        return h, h


def test_a_cell_changing_its_state_dtype_is_named():
    rnn = ft.nn.RNN(_NarrowingCell(jnp.ones((3, 2))))
    with pytest.raises(ValueError, match=r"_NarrowingCell maps f32\[2,2\] to bf16\[2,2\]"):
        rnn(jnp.ones((2, 5, 3)))


def test_initial_state_checked_against_zero_state(key):
    xs = jnp.ones((2, 5, 3))
    lstm = ft.nn.RNN(ft.nn.LSTMCell(3, 4, key=key))
    gru = ft.nn.RNN(ft.nn.GRUCell(3, 4, key=key))
    h = jnp.zeros((2, 4))
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)initial_state LSTMState\(hidden=f32\[2,4\], cell=f32\[2,4\]\)"
                       r".*got tuple\(f32\[2,4\], f32\[2,4\]\).*right:  rnn\(xs, ft.nn.LSTMState\(h0, c0\)\)"):
        lstm(xs, (h, h))
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)initial_state f32\[2,4\].*got f32\[1,2,4\].*h0\[0\]"):
        gru(xs, h[None])  # torch's [layers, batch, hidden]: before, broadcast to outputs [1, 5, 2, 4]
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)got f32\[2,5\].*cell.zero_state\(\(2,\)\)"):
        gru(xs, jnp.zeros((2, 5)))
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)got LSTMState\(hidden=f32\[2,5\], cell=f32\[2,5\]\)"):
        lstm(xs, ft.nn.LSTMState(jnp.zeros((2, 5)), jnp.zeros((2, 5))))
    model = ft.nn.Sequential(gru)
    with pytest.raises(ft.nn.LayerInputError, match=r"RNN at \.layers\[0\] expects inputs initial_state"):
        model(xs, h[None])


def test_eager_calls_compile_the_scan_once(key):
    """The scan body was cached per cell object and closed over the cell's arrays: every
    eager ft.gradient (the model rebuilt from new tracers) and the first call of a moved
    model traced and compiled the scan again (2 programs per layer and direction at each
    gradient: 8 and 6-9 s for a 2-layer bidirectional LSTM). Now the compiled scan of its
    signature, the cell passed in: nothing compiled after the first calls, same values."""
    from _compiles import compiled

    rnn = ft.nn.RNN(ft.nn.GRUCell(3, 4, key=key))
    xs, h0 = jnp.ones((2, 5, 3)), jnp.zeros((2, 4))
    loss = lambda m: jnp.sum(m(xs) ** 2)  # noqa: E731
    with compiled(clear=False) as names:
        first, grad = rnn(xs), ft.gradient(loss, at=rnn)
        rnn(xs, h0)
        moved = ft.move(rnn, along=grad)
        names.clear()
        for _ in range(3):
            again, grad_again = rnn(xs), ft.gradient(loss, at=rnn)
            rnn(xs, h0)
        jax.block_until_ready((moved(xs), again, grad_again))
    assert names == []
    np.testing.assert_array_equal(again, first)
    for a, b in zip(jax.tree.leaves(grad_again), jax.tree.leaves(grad), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cell_cls", [ft.nn.GRUCell, ft.nn.LSTMCell])
def test_bfloat16_bias_gradients_sum_the_batch_in_float32_as_torch_does(cell_cls):
    """A bias's gradient sums dL/dgates over every batch row; added in bfloat16, XLA:CPU summed
    it in bfloat16, 740-1530 off torch's float32 gradient (max 2600-5300; 27%) over 64x128
    rows. Added in float32 (add_bias, as Dense) it is 17 off (0.3%): the reference is
    torch.nn.GRU / LSTM in float32 on the same weights and inputs."""
    torch = pytest.importorskip("torch")
    batch, steps, n_in, n_hidden = (64, 128), 2, 16, 8
    cell = cell_cls(n_in, n_hidden, key=jax.random.key(0), dtype=jnp.bfloat16)
    xs = _normal((*batch, steps, n_in), 1, jnp.bfloat16)
    w = np.cos(np.arange(steps * n_hidden, dtype=np.float32)).reshape(steps, n_hidden)
    # jitted: one program (eagerly ~30; the scan, whose transpose sums the batch, is compiled either way)
    grads = jax.jit(jax.grad(lambda m, xs: jnp.sum(m(xs).astype(jnp.float32) * w[None, None])))(ft.nn.RNN(cell), xs).cell

    def t(a):
        return torch.tensor(np.asarray(a, np.float32))

    gru = cell_cls is ft.nn.GRUCell
    ref = (torch.nn.GRU if gru else torch.nn.LSTM)(n_in, n_hidden, batch_first=True)
    with torch.no_grad():  # torch's [gates * hidden, in] weights are ours transposed; an LSTM's two biases add
        ref.weight_ih_l0.copy_(t(cell.input_weight).T)
        ref.weight_hh_l0.copy_(t(cell.hidden_weight).T)
        ref.bias_ih_l0.copy_(t(cell.input_bias if gru else cell.bias))
        ref.bias_hh_l0.copy_(t(cell.hidden_bias) if gru else torch.zeros(4 * n_hidden))
    ys, _ = ref(t(xs).reshape(-1, steps, n_in))
    (ys * torch.tensor(w)).sum().backward()
    mine = (grads.input_bias, grads.hidden_bias) if gru else (grads.bias, grads.bias)
    for got, expected in zip(mine, (ref.bias_ih_l0.grad.numpy(), ref.bias_hh_l0.grad.numpy())):
        scale = np.max(np.abs(expected))
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=0, atol=0.03 * scale)


def _scans(jaxpr):
    """Every ``scan`` equation of ``jaxpr``, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _scans(inner)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cell_cls", [ft.nn.GRUCell, ft.nn.LSTMCell])
def test_bfloat16_leaves_gradients_are_summed_in_a_float32_carry(cell_cls, reverse):
    """What the numeric test below measures on one input, read off the program for any: the
    gradient's scan sums each bfloat16 weight's and bias's cotangent in a float32 carry (a
    closed-over bfloat16 leaf was summed in a bfloat16 carry, checked: this test then fails)."""
    cell = cell_cls(16, 8, key=jax.random.key(0), dtype=jnp.bfloat16)
    xs = jax.ShapeDtypeStruct((4, 8, 16), jnp.bfloat16)
    rnn = ft.nn.RNN(cell, reverse=reverse)
    jaxpr = jax.make_jaxpr(jax.grad(lambda m, xs: jnp.sum(m(xs).astype(jnp.float32))))(rnn, xs).jaxpr
    shapes = {leaf.shape for leaf in jax.tree.leaves(cell) if leaf.dtype == jnp.bfloat16}
    assert shapes, "the cell has bfloat16 leaves"
    carried = [v.aval for eqn in _scans(jaxpr) if eqn.params["reverse"] != reverse
               for v in _carry_inputs(eqn)]
    for shape in shapes:
        dtypes = sorted({a.dtype.name for a in carried if a.shape == shape})
        assert dtypes == ["float32"], (shape, dtypes)


def _carry_inputs(eqn):
    """A scan equation's carry inputs (its parameters name the counts otherwise from jax 0.11:
    functree's _compat reads both forms)."""
    consts, carry = compat.scan_counts(eqn.params)
    return eqn.invars[consts:consts + carry]


@pytest.mark.parametrize("cell_cls", [ft.nn.GRUCell, ft.nn.LSTMCell])
def test_bfloat16_weight_gradients_sum_the_steps_in_float32(cell_cls):
    """scan's transpose sums a closed-over weight's gradient over the steps in the weight's
    dtype: over 1024 steps a bfloat16 cell's hidden_weight and bias gradients were 3.8-4.0%
    (of the largest entry) off torch's float32 gradient, where torch's own bfloat16 GRU/LSTM
    is 0.7-3.8% off. The cell's bfloat16 leaves ride in the carry as float32: 0.7-1.2%."""
    torch = pytest.importorskip("torch")
    steps, batch, n_in, n_hidden = 1024, 4, 16, 8
    cell = cell_cls(n_in, n_hidden, key=jax.random.key(0), dtype=jnp.bfloat16)
    xs = jax.random.normal(jax.random.key(1), (batch, steps, n_in)).astype(jnp.bfloat16)
    w = np.cos(np.arange(steps * n_hidden, dtype=np.float32)).reshape(steps, n_hidden)
    rnn = ft.nn.RNN(cell)
    # compiled with LLVM's optimisations on (the suite's level 0 left 1024 steps of scalar-ish
    # loops: 2.3-3.1 CPU-s to run, 0.5-0.7 at level 2, for 1.2 CPU-s more compile; the same
    # gradients, bit for bit, measured)
    grad = jax.jit(jax.grad(lambda m, xs: jnp.sum(m(xs).astype(jnp.float32) * w[None]))).lower(rnn, xs)
    grads = grad.compile({"xla_backend_optimization_level": 2})(rnn, xs).cell
    assert grads.hidden_weight.dtype == jnp.bfloat16

    def t(a):
        return torch.tensor(np.asarray(a, np.float32))

    gru = cell_cls is ft.nn.GRUCell
    ref = (torch.nn.GRU if gru else torch.nn.LSTM)(n_in, n_hidden, batch_first=True)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(t(cell.input_weight).T)
        ref.weight_hh_l0.copy_(t(cell.hidden_weight).T)
        ref.bias_ih_l0.copy_(t(cell.input_bias if gru else cell.bias))
        ref.bias_hh_l0.copy_(t(cell.hidden_bias) if gru else torch.zeros(4 * n_hidden))
    ys, _ = ref(t(xs))
    (ys * torch.tensor(w)).sum().backward()
    mine = (grads.hidden_weight.T, grads.input_bias if gru else grads.bias)
    for got, expected in zip(mine, (ref.weight_hh_l0.grad.numpy(), ref.bias_ih_l0.grad.numpy())):
        scale = np.max(np.abs(expected))
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=0, atol=0.02 * scale)


class _Bidirectional(ft.Module):
    """torch's bidirectional=True layer: the two directions' outputs concatenated."""

    forward: ft.nn.RNN
    backward: ft.nn.RNN

    def __call__(self, xs):
        return jnp.concatenate([self.forward(xs), self.backward(xs)], axis=-1)


@pytest.mark.parametrize("nonlinearity,bidirectional", [("tanh", False), ("relu", True)])
def test_simple_rnn_matches_torchs_rnn_through_the_port(nonlinearity, bidirectional):
    """torch's nn.RNN (Elman: tanh or relu, two biases) had no cell. One layer batch-first,
    and bidirectional as two RNNs (the second reverse=True, torch's _l0_reverse): outputs and
    the gradients of the input and every torch parameter 1.8e-15 apart in float64 (tanh and
    relu, one and two directions); float32 here, 2.5e-7 of the values apart measured (every
    case): atol 10 times it, rounded up."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.RNN(3, 5, nonlinearity=nonlinearity, batch_first=True, bidirectional=bidirectional)
    activation = {"tanh": ft.nn.tanh, "relu": ft.nn.relu}[nonlinearity]
    rnn = lambda reverse: ft.nn.RNN(ft.nn.SimpleRNNCell(3, 5, key=jax.random.key(0), activation=activation),  # noqa: E731
                                    reverse=reverse)
    if bidirectional:  # torch's names, each direction under its field
        model = jax.eval_shape(lambda: _Bidirectional(rnn(False), rnn(True)))  # abstract: every leaf is torch's
        given = {("backward." if n.endswith("_reverse") else "forward.") + n: v for n, v in module.state_dict().items()}
    else:
        model, given = jax.eval_shape(lambda: rnn(False)), module.state_dict()
    model = ft.nn.load_torch_state_dict(model, given)
    x = np.random.default_rng(0).normal(size=(2, 6, 3)).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    yt, _ = module(xt)
    g = np.random.default_rng(1).normal(size=yt.shape).astype(np.float32)
    yt.backward(torch.tensor(g))
    y, vjp = jax.vjp(jax.jit(lambda m, x: m(x)), model, jnp.asarray(x))
    grad_model, grad_x = vjp(jnp.asarray(g))
    ours = {"output": np.asarray(y), "input": np.asarray(grad_x),
            **{n.removeprefix("forward.").removeprefix("backward."): v
               for n, v in ft.nn.torch_state_dict(grad_model, gradient=True, numpy=True).items()}}
    theirs = {"output": yt.detach().numpy(), "input": xt.grad.numpy(),
              **{n: p.grad.numpy() for n, p in module.named_parameters()}}
    assert set(ours) == set(theirs)
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=3e-6 * max(1.0, float(np.abs(want).max())),
                                   err_msg=name)


def test_simple_rnn_cell_is_torchs_rnn_cell_and_has_gradients(key):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.RNNCell(3, 4)
    cell = ft.nn.load_torch_state_dict(jax.eval_shape(lambda: ft.nn.SimpleRNNCell(3, 4, key=key)),  # torch's leaves
                                       module.state_dict())
    x, h = (np.random.default_rng(s).normal(size=(2, n)).astype(np.float32) for s, n in ((0, 3), (1, 4)))
    expected = module(torch.tensor(x), torch.tensor(h)).detach().numpy()
    new, y = cell(jnp.asarray(h), jnp.asarray(x))
    assert new is y
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-6)  # |y| <= 1 (tanh): 10 float32 roundings
    with jax.enable_x64(True):
        cell64 = jax.tree.map(lambda a: a.astype(jnp.float64), cell)
        check_grads(jax.jit(lambda c, h, x: c(h, x)[0]), (cell64, h.astype(np.float64), x.astype(np.float64)),
                    order=1, modes=["rev"])


def test_simple_rnn_cell_takes_the_activation_function_not_its_name(key):
    with pytest.raises(ValueError, match=r"(?s)SimpleRNNCell: activation='relu' is a name.*"
                       r"right:  ft.nn.SimpleRNNCell\(3, 5, activation=ft.nn.relu, key=k\)"):
        ft.nn.SimpleRNNCell(3, 5, activation="relu", key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"SimpleRNNCell expects inputs \[\.\.\., 3\] \(float\), got f32\[2,4\]"):
        ft.nn.SimpleRNNCell(3, 5, key=key)(jnp.zeros((2, 5)), jnp.ones((2, 4)))


def _drawn(make, dtype=np.float32):
    """The layer ``make()`` builds, its leaves N(0, 0.5^2) by NumPy: no eager initializers
    (an orthogonal draw is a QR per cell), abstract until filled."""
    return _randomize(jax.eval_shape(make)) if dtype == np.float32 else jax.tree.map(
        lambda a: jnp.asarray(a, dtype), _randomize(jax.eval_shape(make)))


def test_stacked_bidirectional_gradients_finite_differences():
    """A 2-layer bidirectional GRU (tiny, float64): reverse-mode gradients of the outputs and
    the final states with respect to the weights, the input and the initial state agree with
    finite differences (jax.test_util.check_grads)."""
    with jax.enable_x64(True):
        gru = _drawn(lambda: ft.nn.GRU(2, 2, num_layers=2, bidirectional=True, batch_first=True, key=jax.random.key(0)), np.float64)
        x = np.random.default_rng(0).normal(size=(1, 3, 2))
        h0 = np.random.default_rng(1).normal(size=(4, 1, 2))
        check_grads(jax.jit(lambda m, x, h0: m(x, h0, return_state=True)), (gru, x, h0), order=1, modes=["rev"])


def test_stacked_rnn_dropout_between_layers_only_in_training():
    """torch's dropout= drops every layer's outputs but the last's, in training only: a 1-layer
    stack trains as it infers, a 2-layer one in inference is its layers composed, and in
    training is layer 0, dropout (key split(key, 4)[3]), layer 1; with no key, Dropout's NO_KEY."""
    from functree.nn._dropout import NO_KEY

    x, key = jnp.ones((2, 3, 2)), jax.random.key(5)
    one = _drawn(lambda: ft.nn.LSTM(2, 3, dropout=0.5, batch_first=True, key=jax.random.key(0)))
    np.testing.assert_array_equal(ft.nn.training(one)(x, key=key), one(x))
    two = _drawn(lambda: ft.nn.LSTM(2, 3, num_layers=2, dropout=0.5, batch_first=True, key=jax.random.key(0)))
    first, second = two.layers
    np.testing.assert_array_equal(two(x), second(first(x)))
    trained = ft.nn.training(two)
    assert trained.dropout.training and not two.dropout.training
    dropped = ft.nn.Dropout(0.5, training=True)(first(x), key=jax.random.split(key, 4)[3])
    assert not np.array_equal(dropped, first(x))
    np.testing.assert_array_equal(trained(x, key=key), second(dropped))
    assert "needs a PRNG key" in NO_KEY
    with pytest.raises(ValueError, match="needs a PRNG key"):
        trained(x)


def test_stacked_rnn_states_in_torchs_order_and_time_major():
    """The final state is layer 0 forward, layer 0 backward, layer 1 ...; the initial state is
    taken as that tuple or stacked (torch's h_0); batch_first=False reads [time, batch, features]."""
    lstm = _drawn(lambda: ft.nn.LSTM(2, 3, num_layers=2, bidirectional=True, batch_first=True, key=jax.random.key(0)))
    x = jnp.asarray(_normal((2, 4, 2), 1))
    ys, final = lstm(x, return_state=True)
    bi = lstm.layers[1]
    mid = lstm.layers[0](x)
    _, (h_f, h_b) = bi(mid, return_state=True)
    np.testing.assert_array_equal(final[2].hidden, h_f.hidden)
    np.testing.assert_array_equal(final[3].cell, h_b.cell)
    h0 = ft.nn.LSTMState(jnp.asarray(_normal((4, 2, 3), 2)), jnp.asarray(_normal((4, 2, 3), 3)))
    stacked = lstm(x, h0)
    as_tuple = lstm(x, tuple(ft.nn.LSTMState(h0.hidden[i], h0.cell[i]) for i in range(4)))
    np.testing.assert_array_equal(stacked, as_tuple)
    built = jax.eval_shape(lambda: ft.nn.LSTM(2, 3, num_layers=2, bidirectional=True, batch_first=False,
                                              key=jax.random.key(0)))
    assert {r.time_axis for layer in built.layers for r in (layer.forward, layer.backward)} == {0}
    time_major = _time_major(lstm)
    np.testing.assert_allclose(time_major(jnp.swapaxes(x, 0, 1)), jnp.swapaxes(ys, 0, 1), rtol=0, atol=1e-6)


def test_stacked_rnn_errors_name_the_fix():
    from functree.nn import _recurrent_layers as R

    key = jax.random.key(0)
    cell = _drawn(lambda: ft.nn.GRUCell(2, 3, key=key))
    with pytest.raises(ValueError, match=r"(?s)the backward RNN has reverse=False.*reverse=True\)\)"):
        ft.nn.Bidirectional(ft.nn.RNN(cell), ft.nn.RNN(cell))
    with pytest.raises(ValueError, match=r"(?s)forward RNN reads time on axis -2, the backward one on axis 0"):
        ft.nn.Bidirectional(ft.nn.RNN(cell), ft.nn.RNN(cell, reverse=True, time_axis=0))
    with pytest.raises(ValueError, match=r"(?s)layer 1 reads 2 features, but layer 0 gives 6 \(hidden_size 3 x 2"
                                         r".*ft.nn.GRUCell\(6, hidden_size"):
        ft.nn.StackedRNN([ft.nn.Bidirectional(ft.nn.RNN(cell), ft.nn.RNN(cell, reverse=True)), ft.nn.RNN(cell)])
    with pytest.raises(ValueError, match=r"(?s)proj_size=3; .* 0 < proj_size < hidden_size \(3\).*"
                                         r"ft.nn.LSTMCell\(n_in, 3, proj_size=1, key=k\)"):
        ft.nn.LSTM(2, 3, proj_size=3, batch_first=True, key=key)  # torch: "proj_size has to be smaller"
    with pytest.raises(ValueError, match=r"nonlinearity='sigmoid'; torch's nn.RNN takes"):
        ft.nn.SimpleRNN(2, 3, nonlinearity="sigmoid", batch_first=True, key=key)
    with pytest.raises(ValueError, match=r"num_layers=0; a recurrent stack has at least one layer"):
        ft.nn.GRU(2, 3, num_layers=0, batch_first=True, key=key)
    gru = _drawn(lambda: ft.nn.GRU(2, 3, num_layers=2, bidirectional=True, batch_first=True, key=key))
    x = jnp.ones((5, 4, 2))
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)GRU expects inputs initial_state of 4 cell states.*got f32\[2,5,3\]"):
        gru(x, jnp.zeros((2, 5, 3)))  # a 1-layer torch h_0
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)RNN at \.layers\[0\]\.backward expects inputs initial_state f32\[5,3\]"):
        gru(x, (jnp.zeros((5, 3)), jnp.zeros((5, 4))) + (jnp.zeros((5, 3)),) * 2)
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)GRU expects inputs initial_state of 4 cell states.*"
                                                    r"got f32\[4,3\].*h0 \[4, \*batch, hidden\]"):
        gru(jnp.ones((4, 5, 2)), jnp.zeros((4, 3)))  # one cell's [batch, hidden], its batch the state count
    lstm = _drawn(lambda: ft.nn.LSTM(2, 3, bidirectional=True, batch_first=True, key=key))
    h0 = jnp.zeros((2, 5, 3))  # torch's (h_0, c_0) as a plain pair: read as two directions' states, before
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)LSTM expects inputs initial_state of 2 cell states.*"
                                                    r"right:  lstm\(xs, ft.nn.LSTMState\(h0, c0\)\)"):
        lstm(x, (h0, h0))
    assert "torch's order" in R.STATE_COUNT and "h0 [4, *batch, hidden]" in R.FIX_STATE_COUNT.format(count=4)
    assert "not a plain pair" in R.FIX_LSTM_PAIR
    assert "ft.nn.LSTM(n_in, n_hidden, num_layers=" in ft.nn._recurrent.FIX_TORCH_AXIS


def test_cells_without_bias(key):
    """use_bias=False (torch's bias=False): no bias leaves, the biased cell with zero biases."""
    for cls in (ft.nn.SimpleRNNCell, ft.nn.GRUCell, ft.nn.LSTMCell):
        plain = _drawn(lambda cls=cls: cls(2, 3, key=key, use_bias=False))
        assert not [k for k in ft.to_flat_dict(plain) if "bias" in k]
        zeroed = jax.tree.map(jnp.zeros_like, _drawn(lambda cls=cls: cls(2, 3, key=key)))
        zeroed = zeroed.replace(input_weight=plain.input_weight, hidden_weight=plain.hidden_weight)
        h = plain.zero_state((2,))
        same = jax.jit(lambda a, b, h, x: (a(h, x)[1], b(h, x)[1]))(plain, zeroed, h, jnp.ones((2, 2)))
        np.testing.assert_array_equal(*same)


def test_a_torch_stack_loaded_into_one_rnn_names_the_constructor():
    """torch's 2-layer bidirectional LSTM loaded into one ft.nn.RNN left 12 tensors
    unexpected with no word of what to build; RNN_STACK_HINT reads the module off the names
    and shapes (gates 4: an LSTM; a 3-layer RNN without biases under 'enc')."""
    torch = pytest.importorskip("torch")
    from functree.interop._recurrent_hint import RNN_STACK_HINT

    assert "an ft.nn.RNN is one layer, one direction" in RNN_STACK_HINT
    rnn = jax.eval_shape(lambda: ft.nn.RNN(ft.nn.LSTMCell(3, 4, key=jax.random.key(0))))
    with pytest.raises(ValueError, match=r"(?s)torch's 2-layer bidirectional nn.LSTM \(weight_ih_l0 \.\.\. "
                                         r"weight_ih_l1_reverse\).*ft.nn.LSTM\(3, 4, num_layers=2, bidirectional=True, batch_first=False, key=k\)"):
        ft.nn.load_torch_state_dict(rnn, torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True).state_dict())
    sd = {f"enc.{k}": v for k, v in torch.nn.RNN(3, 5, 3, bias=False).state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)3-layer nn.RNN under 'enc'.*ft.nn.SimpleRNN\(3, 5, num_layers=3, bias=False"):
        ft.nn.load_torch_state_dict({"enc": jax.eval_shape(lambda: ft.nn.GRU(3, 5, batch_first=True, key=jax.random.key(0)))}, sd)


def test_a_bidirectional_layer_alone_is_torchs_one_layer_bidirectional_module():
    """ft.nn.Bidirectional outside a stack reads and writes _l0 and _l0_reverse."""
    torch = pytest.importorskip("torch")
    module = torch.nn.GRU(2, 3, bidirectional=True)
    def build():  # abstract (every leaf is read from torch): eagerly, each initializer compiled apart
        cells = [ft.nn.GRUCell(2, 3, key=k) for k in jax.random.split(jax.random.key(0))]
        return ft.nn.Bidirectional(ft.nn.RNN(cells[0]), ft.nn.RNN(cells[1], reverse=True))

    bi = ft.nn.load_torch_state_dict(jax.eval_shape(build), module.state_dict())
    written = ft.nn.torch_state_dict(bi, numpy=True)
    assert set(written) == set(module.state_dict())
    for name, value in module.state_dict().items():
        np.testing.assert_array_equal(written[name], value.numpy(), err_msg=name)


def _time_major(stack):
    """``stack`` reading time on axis 0 (torch's batch_first=False), its weights kept."""
    def moved(rnn):
        return rnn.replace(time_axis=0)
    layers = tuple(ft.nn.Bidirectional(moved(layer.forward), moved(layer.backward))
                   if isinstance(layer, ft.nn.Bidirectional) else moved(layer) for layer in stack.layers)
    return ft.nn.StackedRNN(layers, stack.dropout)


@pytest.mark.parametrize("cls", ["LSTM", "GRU", "SimpleRNN"])
def test_torch_style_stacks_take_batch_first_explicitly(cls):
    """torch's nn.LSTM reads [time, batch, features] by default, ft's layers [batch, time,
    features]; with either default a port fed the other layout ran with the axes swapped and
    no error (the shapes fit). batch_first is required (BATCH_FIRST); both settings build."""
    from functree.nn._recurrent_layers import BATCH_FIRST

    with pytest.raises(ValueError, match=rf"(?s)ft.nn.{cls}: batch_first=None.*torch's nn.{'RNN' if cls == 'SimpleRNN' else cls} "
                                         r"reads \[time, batch, features\]"):
        getattr(ft.nn, cls)(2, 3, num_layers=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch_first=1;"):
        getattr(ft.nn, cls)(2, 3, batch_first=1, key=jax.random.key(0))
    assert "batch_first=False, key=k)   # xs [time, batch, features]" in BATCH_FIRST
    for batch_first, axis in ((True, -2), (False, 0)):
        built = jax.eval_shape(lambda b=batch_first: getattr(ft.nn, cls)(2, 3, batch_first=b, key=jax.random.key(0)))
        assert built.layers[0].time_axis == axis


# One case per row covers each setting both ways (layers 1-2, directions, bias, batch_first, h_0).
_PROJECTED = [(1, False, True, True, False), (2, True, False, False, True), (2, False, True, False, True),
              (1, True, False, True, False)]


@pytest.mark.parametrize("layers,bidirectional,bias,batch_first,with_h0", _PROJECTED)
def test_lstm_with_projections_matches_torch(layers, bidirectional, bias, batch_first, with_h0):
    """torch's nn.LSTM(proj_size=2) (Sak et al. 2014, h_t = W_hr (o_t * tanh(c_t))) was
    refused; ported through weight_hr_l{k}[_reverse], it matches torch in float64: outputs,
    h_n [layers * dirs, batch, 2] and c_n [.., hidden 5]. Over all 32 settings of this
    sweep the largest difference measured was 2.2e-16 (c_n, values up to 1.02): atol
    1e-14. The state dict written back has torch's keys and tensors."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(layers * 16 + bidirectional * 8 + bias * 4 + batch_first * 2 + with_h0)
    module = torch.nn.LSTM(3, 5, num_layers=layers, bias=bias, batch_first=batch_first,
                           bidirectional=bidirectional, proj_size=2).double()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 3) if batch_first else (6, 2, 3))
    d = layers * (2 if bidirectional else 1)
    h0, c0 = rng.normal(size=(d, 2, 2)), rng.normal(size=(d, 2, 5))
    with jax.enable_x64(True):
        model = jax.eval_shape(lambda: ft.nn.LSTM(3, 5, num_layers=layers, bias=bias, batch_first=batch_first,
                                                   bidirectional=bidirectional, proj_size=2, dtype=jnp.float64,
                                                   key=jax.random.key(0)))
        model = ft.nn.load_torch_state_dict(model, module.state_dict())
        start = ft.nn.LSTMState(h0, c0) if with_h0 else None
        ys, final = jax.jit(lambda m, x, s: m(x, s, return_state=True))(model, x, start)
        h_n, c_n = jax.tree.map(lambda *s: jnp.stack(s), *final)
        written = ft.nn.torch_state_dict(model, numpy=True)
    yt, (ht, ct) = module(torch.tensor(x), (torch.tensor(h0), torch.tensor(c0)) if with_h0 else None)
    for name, ours, theirs in (("output", ys, yt), ("h_n", h_n, ht), ("c_n", c_n, ct)):
        assert ours.shape == tuple(theirs.shape), name
        np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=0, atol=1e-14, err_msg=name)
    expected = module.state_dict()
    assert set(written) == set(expected) and f"weight_hr_l{layers - 1}" in written
    for name, value in expected.items():  # an LSTM's bias is held summed: written (b_ih + b_hh, 0)
        if not name.startswith("bias"):
            np.testing.assert_array_equal(written[name], value.numpy(), err_msg=name)


def test_lstm_cell_with_projection_shapes_gradients_and_older_files():
    """proj_size=p: hidden_weight [p, 4H], projection [H, p], zero_state (h [.., p], c [.., H]);
    a stack's layer k > 0 reads p * directions. Gradients of the outputs and final states
    (weights, input, initial state) agree with finite differences (check_grads, float64). A
    cell without projection keeps its leaves, and a pickle written before the field reads it
    as None (__ft_added_static__)."""
    key = jax.random.key(0)
    cell = jax.eval_shape(lambda: ft.nn.LSTMCell(3, 5, proj_size=2, key=key))
    assert (cell.hidden_weight.shape, cell.projection.shape, cell.hidden_size, cell.proj_size,
            cell.output_size) == ((2, 20), (5, 2), 5, 2, 2)
    state = jax.eval_shape(lambda: cell.zero_state((4,)))
    assert (state.hidden.shape, state.cell.shape) == ((4, 2), (4, 5))
    plain = jax.eval_shape(lambda: ft.nn.LSTMCell(3, 5, key=key))
    assert [a.shape for a in jax.tree.leaves(plain)] == [(3, 20), (5, 20), (20,)] and plain.proj_size == 0
    older = plain.__getstate__()
    del older["projection"]
    read = object.__new__(ft.nn.LSTMCell)
    read.__setstate__(older)
    assert read.projection is None and jax.tree.structure(read) == jax.tree.structure(plain)
    stack = jax.eval_shape(lambda: ft.nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2, batch_first=True,
                                              key=key))
    assert stack.layers[1].forward.cell.input_weight.shape == (4, 20)
    with jax.enable_x64(True):
        lstm = _drawn(lambda: ft.nn.LSTM(2, 3, bidirectional=True, proj_size=1, batch_first=True, key=key), np.float64)
        x = np.random.default_rng(0).normal(size=(1, 3, 2))
        h0 = ft.nn.LSTMState(*(np.random.default_rng(s).normal(size=(2, 1, n)) for s, n in ((1, 1), (2, 3))))
        check_grads(jax.jit(lambda m, x, h0: m(x, h0, return_state=True)), (lstm, x, h0), order=1, modes=["rev"])


def test_the_stack_hint_reads_torchs_projections():
    """A torch LSTM with proj_size (weight_hr_l0; weight_hh [4H, p]) loaded into one ft.nn.RNN
    got no hint (4H / p named no cell); RNN_STACK_HINT now names proj_size and the hidden size."""
    torch = pytest.importorskip("torch")
    rnn = jax.eval_shape(lambda: ft.nn.RNN(ft.nn.LSTMCell(3, 8, key=jax.random.key(0))))
    with pytest.raises(ValueError, match=r"ft.nn.LSTM\(3, 6, num_layers=2, bidirectional=True, proj_size=2, "
                                         r"batch_first=False, key=k\)"):
        ft.nn.load_torch_state_dict(rnn, torch.nn.LSTM(3, 6, num_layers=2, bidirectional=True, proj_size=2).state_dict())


class _GateCell(ft.Module):
    """A GRU cell recording its input's projection at every step (a recorded intermediate)."""

    gru: ft.nn.GRUCell

    def zero_state(self, batch_shape=()):
        return self.gru.zero_state(batch_shape)

    def __call__(self, h, x):
        ft.nn.record_intermediate(self, h_before=h)
        h, _ = self.gru(h, x)
        return h, h


@pytest.mark.parametrize("reverse", [False, True])
def test_a_cells_recorded_intermediates_are_every_steps(reverse):
    """An RNN's cell records per step; ``collect_intermediates`` gives every step's record,
    time on axis 0 in the inputs' order (backwards too), not the last step's alone (layer
    state's rule): the state each step started from, as a Python loop over the cell gives."""
    rnn = ft.nn.RNN(_GateCell(ft.nn.GRUCell(3, 4, key=jax.random.key(0))), reverse=reverse)
    xs = jnp.asarray(_normal((2, 5, 3), 1))
    ys, sown = ft.nn.collect_intermediates(lambda m: m(xs), rnn)
    h, before, after = rnn.cell.zero_state((2,)), [None] * 5, [None] * 5
    for t in (reversed if reverse else iter)(range(5)):
        before[t] = h
        h, after[t] = rnn.cell(h, xs[:, t])
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".cell.h_before")], jnp.stack(before), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ys, jnp.stack(after, axis=1), rtol=0, atol=1e-6)


# (torch class, layers, bidirectional, batch_first): each setting both ways over the rows.
_PACKED = [("LSTM", 2, True, True), ("GRU", 1, True, False), ("SimpleRNN", 2, False, True)]


@pytest.mark.parametrize("cls,layers,bidirectional,batch_first", _PACKED)
def test_lengths_run_each_sequence_as_torchs_packed_sequences(cls, layers, bidirectional, batch_first):
    """A padded batch (torch's pack_padded_sequence(xs, lengths, enforce_sorted=False)) had no
    form here: every step was read, padding included, so the final states were the padding's
    (Flax's seq_lengths, Keras's masks). lengths= runs each sequence over its real steps: the
    outputs are pad_packed_sequence's (0 at the padding) and h_n (c_n) each sequence's own,
    the backward direction starting at its own last step. float64, measured 4.4e-16 (values
    of about 1): atol 1e-14. The padded inputs get no gradient."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(layers + 2 * bidirectional)
    module = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "SimpleRNN": torch.nn.RNN}[cls](
        3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first).double()
    lengths = np.array([5, 2, 4])
    x = np.random.default_rng(1).normal(size=(3, 5, 3) if batch_first else (5, 3, 3))
    pack = torch.nn.utils.rnn
    out, h = module(pack.pack_padded_sequence(torch.tensor(x), torch.tensor(lengths), batch_first=batch_first,
                                              enforce_sorted=False))
    yt = pack.pad_packed_sequence(out, batch_first=batch_first, total_length=5)[0]
    with jax.enable_x64(True):
        model = jax.eval_shape(lambda: getattr(ft.nn, cls)(3, 4, num_layers=layers, bidirectional=bidirectional,
                                                           batch_first=batch_first, dtype=jnp.float64,
                                                           key=jax.random.key(0)))
        model = ft.nn.load_torch_state_dict(model, module)
        run = jax.jit(lambda m, x, n: m(x, lengths=n, return_state=True))
        ys, final = run(model, x, jnp.asarray(lengths))
        stacked = jax.tree.map(lambda *s: jnp.stack(s), *final)
        grad = jax.grad(lambda x: jnp.sum(run(model, x, jnp.asarray(lengths))[0] ** 2))(x)
    theirs = (yt, *(h if cls == "LSTM" else (h,)))
    ours = (ys, *(stacked if cls == "LSTM" else (stacked,)))
    for name, a, b in zip(("output", "h_n", "c_n"), ours, theirs):
        np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=0, atol=1e-14, err_msg=name)
    padded = np.arange(5)[None, :] >= lengths[:, None]  # [batch, time]
    assert not np.any(np.moveaxis(np.asarray(grad), 0 if batch_first else 1, 0)[padded])


def test_lengths_of_any_integer_type_run_under_x64_and_are_checked_without_compiling():
    """int32 lengths under x64 raised TypePromotionError (the step index was jnp.arange's
    int64), and each eager call's check compiled 4-5 programs per shape (>=, <=, &, all, <).
    The known lengths are now checked and compared on the host; traced ones in their own
    integer type."""
    from _compiles import compiled

    rnn = ft.nn.RNN(ft.nn.GRUCell(3, 4, key=jax.random.key(0)))
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3)), jnp.float32)
    expected = np.asarray(rnn(xs, lengths=jnp.array([5, 2])))
    with compiled() as with_lengths:
        rnn(xs, lengths=np.array([5, 2]))
    with compiled() as without:
        rnn(xs)
    assert with_lengths == without  # the same programs: the check adds none
    run = jax.jit(lambda m, x, n: m(x, lengths=n))
    with jax.enable_x64(True):
        for lengths in (jnp.array([5, 2], jnp.int32), np.array([5, 2]), [5, 2], jnp.array([5, 2], jnp.uint8)):
            np.testing.assert_array_equal(np.asarray(rnn(xs, lengths=lengths)), expected, err_msg=str(lengths))
            np.testing.assert_array_equal(np.asarray(run(rnn, xs, jnp.asarray(lengths))), expected)
    # narrow lengths under jit: the steps were counted in their type (uint8 wraps at 256, so
    # steps 256.. of a 300-step batch counted as real again: 0.34 off)
    long = jnp.asarray(np.random.default_rng(1).normal(size=(2, 300, 3)), jnp.float32)
    final = jax.jit(lambda m, x, n: m(x, lengths=n, return_state=True)[1])
    cut = np.asarray(rnn(long[:1, :200], return_state=True)[1])  # sequence 0 alone, its 200 steps
    for dtype in (jnp.uint8, jnp.int16):
        np.testing.assert_allclose(np.asarray(final(rnn, long, jnp.array([200, 10], dtype)))[:1], cut,
                                   rtol=0, atol=1e-6, err_msg=str(dtype))


def test_lengths_are_checked_and_a_recording_cell_is_refused():
    rnn = ft.nn.RNN(ft.nn.GRUCell(3, 4, key=jax.random.key(0)))
    xs = jnp.ones((2, 5, 3))
    for bad, shown in ((jnp.array([5, 2, 1]), "i32[3]"), (jnp.array([6, 2]), "(from 2 to 6)"),
                       (jnp.array([1.0, 2.0]), "f32[2]")):
        with pytest.raises(ft.nn.LayerInputError, match=r"lengths: integers of the batch's shape \(2,\), each in "
                                                        r"\[0, 5\]") as info:
            rnn(xs, lengths=bad)
        assert shown in str(info.value) and "pack_padded_sequence" in str(info.value)
    ys = rnn(xs, lengths=jnp.array([0, 5]))  # an empty sequence: zeros, its state the initial one
    assert not np.any(np.asarray(ys[0]))
    unbatched = rnn(xs[1], lengths=jnp.asarray(3))
    np.testing.assert_allclose(np.asarray(unbatched[:3]), np.asarray(rnn(xs[1, :3])), rtol=0, atol=1e-6)

    class Normed(ft.Module):
        cell: ft.nn.GRUCell
        norm: ft.nn.BatchNorm

        def zero_state(self, batch):
            return self.cell.zero_state(batch)

        def __call__(self, h, x):
            return self.cell(h, self.norm(x))

    normed = ft.nn.RNN(Normed(ft.nn.GRUCell(3, 4, key=jax.random.key(0)), ft.nn.training(ft.nn.BatchNorm(3))))
    with pytest.raises(ValueError, match=r"lengths= with a cell that records layer state"):
        ft.nn.collect_state(lambda m: m(xs, lengths=jnp.array([5, 2])), normed)


def test_traced_lengths_outside_the_time_axis_read_nan():
    """Under jax.jit (lengths unseen) a length above the time axis ran the whole sequence and
    a negative one none of it (outputs 0, the initial state): valid-looking numbers where torch's
    packed GRU raises (a crop of xs left lengths measured before it). Now that sequence's
    outputs and final state are NaN; the others' are unchanged (Bidirectional, StackedRNN too)."""
    key = jax.random.key(0)
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 2)), jnp.float32)
    for model in (ft.nn.RNN(ft.nn.LSTMCell(2, 3, key=key)), ft.nn.Bidirectional(ft.nn.RNN(ft.nn.GRUCell(2, 3, key=key)),
                                                                           ft.nn.RNN(ft.nn.GRUCell(2, 3, key=key), reverse=True))):
        run = jax.jit(lambda m, x, n: m(x, lengths=n, return_state=True))
        expected, _ = run(model, xs, jnp.array([4, 2, 3]))
        ys, final = run(model, xs, jnp.array([5, 2, -1]))
        ys, expected = np.asarray(ys), np.asarray(expected)
        assert np.isnan(ys[0]).all() and np.isnan(ys[2]).all(), type(model)
        np.testing.assert_allclose(ys[1], expected[1], rtol=0, atol=1e-6 * np.abs(expected).max())
        for leaf in jax.tree.leaves(final):
            leaf = np.asarray(leaf)
            assert np.isnan(leaf[..., 0, :]).all() and np.isnan(leaf[..., 2, :]).all() and not np.isnan(leaf[..., 1, :]).any()
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)from -1 to 5.*right:  rnn\(xs\[:, :T\], lengths=jnp.minimum"):
        model(xs, lengths=np.array([5, 2, -1]))  # concrete: refused, with the fix


def test_lengths_under_collect_state_with_a_cell_that_records_nothing(key):
    """ft.nn.RNN(lengths=) raised "a cell that records layer state" under collect_state for
    any cell: value_with_gradient_and_state on an LSTM over padded sequences, and
    opt.minimize on a model with a BatchNorm elsewhere, failed. A cell that records nothing
    now runs its masked scan there (the same numbers); one that records still raises."""
    xs, lengths = jax.random.normal(key, (2, 5, 3)), jnp.array([3, 5])
    rnn = ft.nn.RNN(ft.nn.LSTMCell(3, 4, key=key))
    loss = lambda m: jnp.sum(m(xs, lengths=lengths) ** 2)  # noqa: E731
    value, grads = ft.value_with_gradient(loss, at=rnn)
    value_s, grads_s, state = ft.nn.value_with_gradient_and_state(loss, rnn)
    assert state == {}
    np.testing.assert_array_equal(value_s, value)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads), strict=True):
        np.testing.assert_array_equal(a, b)

    class Normed(ft.Module):
        cell: ft.nn.LSTMCell
        norm: ft.nn.BatchNorm

        def zero_state(self, batch_shape=()):
            return self.cell.zero_state(batch_shape)

        def __call__(self, state, x):
            return self.cell(state, self.norm(x))

    recording = ft.nn.training(ft.nn.RNN(Normed(ft.nn.LSTMCell(3, 4, key=key), ft.nn.BatchNorm(3))))
    with pytest.raises(ValueError, match="records layer state"):
        ft.nn.value_with_gradient_and_state(loss, recording)
