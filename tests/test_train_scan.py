"""steps_per_call: k steps in one compiled call equal k single calls (structural tests only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close_trained

import functree as ft
from functree.train import NonFiniteError, Trainer, TrainStep, stack_batches
from functree.train._programs import forget_programs

K = 4


@pytest.fixture(autouse=True)
def _own_compiled_steps():
    """Overrides conftest.py's: this module's steps share their compiled programs across
    tests (the same mlp, losses and optimizers; the process-wide table of
    functree/train/_programs.py, as a user's process has it). A test that counts its own
    compilations calls ``forget_programs()`` first."""


def mlp(seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return ft.nn.Sequential([ft.nn.Dense(3, 8, jax.nn.relu, key=k[0]), ft.nn.Dense(8, 1, key=k[1])])


def minibatches(n=8, size=4, bad=None):
    rng = np.random.default_rng(0)
    out = [(rng.normal(size=(size, 3)).astype(np.float32), rng.normal(size=(size, 1)).astype(np.float32))
           for _ in range(n)]
    if bad is not None:
        out[bad - 1][0][0, 0] = np.nan
    return out


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def noisy(model, batch, *, key):  # the key folds per step: k steps must see k keys
    x, y = batch
    return jnp.mean((model(x) + 0.1 * jax.random.normal(key, y.shape) - y) ** 2)


def copy(tree):
    """A fresh device buffer per array (the steps donate theirs), through the host: no program."""
    return jax.tree.map(lambda x: jax.device_put(np.array(x)) if isinstance(x, jax.Array) else x, tree)


def single_and_scanned(loss_fn, opt, data, model, key=None, **options):
    """``(model, state, metrics)`` after len(data) single calls and after calls of K steps."""
    one = TrainStep(loss_fn, opt, **options)
    m, s, rows = copy(model), opt.init(model), []
    for b in data:
        m, s, metrics = one(m, s, b, key)
        rows.append(metrics)
    single = (m, s, jax.tree.map(lambda *x: np.stack(x), *rows))  # numpy: the rows' values, no program
    many = TrainStep(loss_fn, opt, steps_per_call=K, **options)
    m, s, rows = copy(model), opt.init(model), []
    for i in range(0, len(data), K):
        m, s, metrics = many(m, s, stack_batches(data[i:i + K]), key)
        rows.append(metrics)
    return single, (m, s, jax.tree.map(lambda *x: np.concatenate(x), *rows))


def assert_same(scanned, single):
    """Model and state within one float32 rounding at their scale (measured equal bit for
    bit: the same program per step); per-step metrics likewise (NaN where a step was not finite)."""
    assert_close_trained(scanned[:2], single[:2], spread=0)
    for name, values in single[2].items():
        atol = 1e-6 * float(np.nanmax(np.abs(values)))
        np.testing.assert_allclose(scanned[2][name], values, rtol=0, atol=atol, err_msg=name)


def test_k_steps_equal_k_single_calls_with_keys_and_metrics():
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    mae = {"mae": lambda out: jnp.mean(jnp.abs(out.model(out.batch[0]) - out.batch[1]))}
    single, scanned = single_and_scanned(noisy, opt, minibatches(), mlp(), jax.random.key(3), metrics=mae)
    assert scanned[2]["loss"].shape == (8,) and scanned[2]["mae"].shape == (8,)
    assert scanned[2]["nonfinite"].shape == (8,) and scanned[2]["nonfinite"].dtype == jnp.int32
    assert_same(scanned, single)
    assert int(ft.optim.context(scanned[1]).step) == 8


def test_metrics_of_one_call_have_the_leading_axis():
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(mse, opt, on_nan="ignore", steps_per_call=K)
    model = mlp()
    _, _, metrics = step(model, opt.init(model), stack_batches(minibatches(K)))
    assert list(metrics) == ["loss"] and metrics["loss"].shape == (K,)
    assert "steps_per_call=4" in repr(step)


@pytest.mark.parametrize("case", ["options", "skip"])
def test_optimizer_options_and_layer_state_keep_working(case):
    # "options": accumulate, wrt and average in one optimizer, on a model with BatchNorm (one
    # pair of programs to compile, not four); each changes the model or the state compared
    tx = ft.optim.adam(0.05)
    model = mlp()
    if case == "options":
        opt = ft.optim.Optimizer(tx, accumulate=2, wrt="layers.2.*", average=ft.optim.ema(0.9))
        model = ft.nn.training(ft.nn.Sequential([model.layers[0], ft.nn.BatchNorm(8), model.layers[1]]))
    else:
        opt = ft.optim.Optimizer(tx)
    data = minibatches(bad=6 if case == "skip" else None)
    options = {"on_nan": "skip"} if case == "skip" else {}
    single, scanned = single_and_scanned(mse, opt, data, model, **options)
    assert_same(scanned, single)
    if case == "skip":
        np.testing.assert_array_equal(scanned[2]["nonfinite"] != -1, np.arange(8) == 5)  # step 6 only
    else:
        assert not np.allclose(scanned[0].layers[1].running_mean, 0.0)  # statistics recorded
        np.testing.assert_array_equal(scanned[0].layers[0].weight, model.layers[0].weight)  # wrt: not trained
        assert not np.allclose(scanned[0].layers[2].weight, model.layers[2].weight)


def test_stop_acts_on_the_exact_step_inside_a_call_and_names_it():
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    data = minibatches(bad=6)  # call 2, its second step
    step = TrainStep(mse, opt, steps_per_call=K)
    m, s = mlp(), opt.init(mlp())
    m, s, _ = step(m, s, stack_batches(data[:4]))
    m, s, metrics = step(m, s, stack_batches(data[4:]))
    np.testing.assert_array_equal(metrics["nonfinite"], [-1, 0, -1, -1])
    with pytest.raises(NonFiniteError, match=r"Training stopped at step 6: the gradient of parameter "
                                             r"'layers\.0\.weight'") as info:
        step.check()
    error = info.value
    assert error.step == 6 and "(step 6 was step 2 of the 4 of call 2)" in str(error)
    np.testing.assert_array_equal(error.batch[0], data[5][0])  # that step's minibatch
    reference, s1 = mlp(), opt.init(mlp())
    one = TrainStep(mse, opt)
    for b in data[:5]:
        reference, s1, _ = one(reference, s1, b)
    assert_close_trained(m, reference, spread=0)  # steps 6, 7 and 8 not applied (measured equal)
    assert int(ft.optim.context(s).step) == 5


def test_one_device_mesh():
    mesh = jax.make_mesh((1,), ("data",))
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    single, scanned = single_and_scanned(mse, opt, minibatches(), mlp(), mesh=mesh, sharding="fsdp")
    assert_same(scanned, single)


def test_eight_devices(tmp_path):
    from _devices import run

    result = run("""
import functree as ft, jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
data = [(rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32)) for _ in range(8)]
loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
opt = ft.optim.Optimizer(ft.optim.adam(0.05))
mesh = jax.make_mesh((8,), ("data",))
model = ft.nn.Dense(3, 1, key=jax.random.key(0))
one = ft.train.TrainStep(loss, opt, mesh=mesh, donate=False)
m, s = model, opt.init(model)
losses = []
for b in data:
    m, s, metrics = one(m, s, b)
    losses.append(float(metrics["loss"]))
many = ft.train.TrainStep(loss, opt, mesh=mesh, donate=False, steps_per_call=4)
m4, s4, scanned = model, opt.init(model), []
for i in (0, 4):
    m4, s4, metrics = many(m4, s4, ft.train.stack_batches(data[i:i + 4]))
    scanned += [float(x) for x in metrics["loss"]]
report({"losses": losses, "scanned": scanned, "weight": np.asarray(m.weight).tolist(),
        "weight4": np.asarray(m4.weight).tolist()})
""", devices=8)
    np.testing.assert_allclose(result["scanned"], result["losses"], rtol=0, atol=1e-6 * max(result["losses"]))
    np.testing.assert_allclose(result["weight4"], result["weight"], rtol=0, atol=1e-6)  # weights ~1


def test_unstacked_batch_names_the_leaf_the_shapes_and_the_fix():
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = TrainStep(mse, opt, steps_per_call=K)
    x, y = minibatches(1, size=3)[0]
    with pytest.raises(ValueError) as info:
        step(mlp(), opt.init(mlp()), (np.stack([x] * K), y))  # y not stacked
    text = str(info.value)
    assert "batch leaf [1] has shape (3, 1); expected (4, ...)" in text
    assert "ft.train.stack_batches([batch_1, ..., batch_4])" in text
    with pytest.raises(ValueError, match=r"steps_per_call must be a positive int(.|\n)*steps_per_call=16"):
        TrainStep(mse, opt, steps_per_call=0)


def test_stack_batches_of_other_shapes_names_the_leaf_and_the_fix():
    group = minibatches(3)
    group[2] = (group[2][0][:2], group[2][1][:2])
    with pytest.raises(ValueError) as info:
        stack_batches(group)
    text = str(info.value)
    assert "leaf [0] has shape (4, 3) in minibatch 0 but (2, 3) in minibatch 2" in text
    assert "drop_last=True" in text
    with pytest.raises(ValueError, match="at least one minibatch"):
        stack_batches([])
    x = stack_batches([{"x": jnp.ones(2)}] * 3)["x"]
    assert isinstance(x, jax.Array) and x.shape == (3, 2)


def trainer_history(k, data, **fit):
    trainer = Trainer(mlp(), ft.optim.Optimizer(ft.optim.adam(0.05)), noisy, key=jax.random.key(1),
                      steps_per_call=k)
    seen = []
    history = trainer.fit(data, progress=False, callbacks=[seen.append], **fit)
    return trainer, history, [(c.event, c.step, c.samples_seen) for c in seen]


def test_trainer_stacks_k_batches_keeps_per_step_rows_and_runs_other_shapes_singly():
    forget_programs()  # the cache sizes below count this test's programs
    # One test, one log_every: the two data sets below have the same minibatch shapes, so the
    # second runs on the programs the first compiled (its cache-size check says so too).
    # 10 minibatches an epoch, the last one short: calls of 4, 4, then 2 single steps
    x, y = np.random.default_rng(1).normal(size=(2, 38, 3)).astype(np.float32)
    data = ft.train.batches((x, y[:, :1]), 4, shuffle=False)
    t1, h1, events1 = trainer_history(1, data, epochs=2, log_every=3)
    t4, h4, events4 = trainer_history(K, data, epochs=2, log_every=3)
    assert h4.steps["step"] == h1.steps["step"] == list(range(1, 21))
    np.testing.assert_allclose(h4.steps["loss"], h1.steps["loss"], rtol=0, atol=1e-6 * max(h1.steps["loss"]))
    assert_close_trained(t4.model, t1.model, spread=0)  # measured 0
    # logs at call boundaries: after the call that reaches 3 logged steps, counted over the
    # job (an interval runs on across an epoch end, as Lightning's log_every_n_steps)
    assert events1 == [("log", 3, 12), ("log", 6, 24), ("log", 9, 36), ("epoch", 10, 38),
                       ("log", 12, 46), ("log", 15, 58), ("log", 18, 70), ("epoch", 20, 76)]
    assert events4 == [("log", 4, 16), ("log", 8, 32), ("epoch", 10, 38),
                       ("log", 14, 54), ("log", 18, 70), ("epoch", 20, 76)]
    assert t4.train_step._scanned is not None and t4.train_step._scanned._cache_size() == 1

    # a minibatch of another shape runs as a single step:
    other = minibatches(9)
    other[3] = (other[3][0][:2], other[3][1][:2])  # [b × 3] single, [short] single, [b × 4] one call, [b] single
    o1, g1, _ = trainer_history(1, other, epochs=1, log_every=3)
    o4, g4, _ = trainer_history(K, other, epochs=1, log_every=3)  # no call takes the buffer past its rows
    assert g4.steps["step"] == list(range(1, 10))
    np.testing.assert_allclose(g4.steps["loss"], g1.steps["loss"], rtol=0, atol=1e-6 * max(g1.steps["loss"]))
    assert_close_trained(o4.model, o1.model, spread=0)  # measured 0
    assert o4.train_step._scanned._cache_size() == 1  # the one group of 4 (the program above)

    h = t4.fit(data, steps=26, steps_per_call=2, log_every=3, progress=False)  # fit's keyword: 3 calls of 2 (26 in all)
    assert h.steps["step"] == list(range(1, 27)) and t4.train_step._scanned._cache_size() == 2


def test_trainer_runs_a_minibatch_of_another_dtype_kind_in_a_call_of_its_own():
    """A loader whose labels are int in one minibatch and float in the others: that one runs
    alone (stack_batches refuses a stack that would promote it), the job equals k=1's."""
    def cast(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y.astype(jnp.float32)) ** 2)

    data = [(x, np.round(y).astype(np.int32) if i == 2 else y) for i, (x, y) in enumerate(minibatches(6))]
    trained = []
    for k in (1, K):
        trainer = Trainer(mlp(), ft.optim.Optimizer(ft.optim.sgd(0.05)), cast, steps_per_call=k)
        history = trainer.fit(data, epochs=1, progress=False)
        trained.append((trainer.model, history))
    (one, h1), (many, hk) = trained
    assert hk.steps["step"] == h1.steps["step"] == list(range(1, 7))
    np.testing.assert_allclose(hk.steps["loss"], h1.steps["loss"], rtol=0, atol=1e-6 * max(h1.steps["loss"]))
    assert_close_trained(many, one, spread=0)  # the same program per step


def test_trainer_stops_at_the_exact_step_inside_a_call():
    trainer = Trainer(mlp(), ft.optim.Optimizer(ft.optim.adam(0.05)), mse, steps_per_call=K)
    with pytest.raises(NonFiniteError, match=r"step 6: the gradient of parameter 'layers\.0\.weight'"):
        trainer.fit(minibatches(bad=6), epochs=1, progress=False, log_every=2)
    assert trainer.steps_run == 5 and int(ft.optim.context(trainer.opt_state).step) == 5
    reference = Trainer(mlp(), ft.optim.Optimizer(ft.optim.adam(0.05)), mse)
    reference.fit(minibatches()[:5], progress=False)
    for a, b in zip(jax.tree.leaves(trainer.model), jax.tree.leaves(reference.model)):
        np.testing.assert_array_equal(a, b)
