"""ft.train.Trainer: fit/evaluate/predict, no per-step sync, exact resume, NaN handling."""

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close_trained, needs_float16_conversions

import functree as ft
import functree.train._intervals as intervals_module
import functree.train._reader as reader_module
from functree.train import NonFiniteError, Trainer
from functree.train._programs import forget_programs

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
LABELS = (Y[:, 0] > 0).astype(np.int32)


def mlp(seed=0, dropout=0.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    layers = [ft.nn.Dense(3, 8, jax.nn.relu, key=k1)]
    if dropout:
        layers.append(ft.nn.Dropout(dropout))
    layers.append(ft.nn.Dense(8, 2, key=k2))
    return ft.nn.Sequential(*layers)


def classify(model, batch, *, key=None):
    x, labels = batch
    logits = model(x, key=key)
    loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))
    return loss, logits


def regress(model, batch):
    x, y = batch
    return jnp.mean((model(x)[:, :1] - y) ** 2)


def adam(lr=0.05):
    return ft.optim.Optimizer(ft.optim.adam(lr))


@pytest.fixture(autouse=True)
def _own_compiled_steps():
    """Overrides conftest.py's: this module's Trainers share their compiled programs across
    tests (most train the same mlp with the same loss and optimizer; the process-wide table
    of functree/train/_programs.py, as a user's process has it). A test that counts its own
    compilations calls ``forget_programs()`` first."""


def test_fit_records_steps_and_epochs_and_learns():
    trainer = Trainer(mlp(), adam(), classify, metrics=[ft.train.accuracy])
    data = ft.train.batches((X, LABELS), 16, key=jax.random.key(1))
    history = trainer.fit(data, epochs=10, validation_data=(X, LABELS), progress=False, log_every=3)
    assert history.steps["step"] == list(range(1, 41))
    assert len(history.steps["loss"]) == 40 and len(history.steps["accuracy"]) == 40
    assert history.steps["learning_rate"][0] == pytest.approx(0.05)
    assert history.epochs["epoch"] == list(range(1, 11))
    assert history["val_accuracy"][-1] > 0.9 and history["loss"][-1] < history["loss"][0]
    ctx = ft.optim.context(trainer.opt_state)
    assert (int(ctx.step), int(ctx.sweep), int(ctx.samples_seen)) == (40, 10, 640)
    # the epoch mean is the size-weighted mean of the step values
    assert_close_trained(history.epochs["loss"][0], np.mean(history.steps["loss"][:4]), spread=2e-8)  # measured max 1.9e-8
    result = trainer.evaluate((X, LABELS), batch_size=20)
    assert result["accuracy"] == pytest.approx(history["val_accuracy"][-1], abs=1e-6)
    logits = trainer.predict(X, batch_size=10)
    assert logits.shape == (64, 2)
    acc = float(np.mean(np.argmax(np.asarray(logits), -1) == LABELS))
    assert acc == pytest.approx(result["accuracy"], abs=1e-6)


def test_callers_model_stays_valid():
    model = mlp()
    trainer = Trainer(model, adam(), classify)
    trainer.fit((X, LABELS), steps=3, progress=False)
    assert not model.layers[0].weight.is_deleted()
    assert not np.allclose(model.layers[0].weight, trainer.model.layers[0].weight)


def test_loop_reads_the_device_only_at_log_intervals(monkeypatch):
    forget_programs()  # the cache size below counts this test's programs
    trainer = Trainer(mlp(), adam(), classify)
    data = ft.train.batches((X, LABELS), 4, key=jax.random.key(1))  # 16 steps per epoch
    trainer.fit(data, steps=2, progress=False, log_every=10)  # compile outside the count
    calls = []
    original, to_host = jax.device_get, intervals_module.to_host
    monkeypatch.setattr(jax, "device_get", lambda x: calls.append(1) or original(x))
    monkeypatch.setattr(intervals_module, "to_host", lambda x: calls.append(1) or to_host(x))  # the interval reads
    monkeypatch.setattr(reader_module, "to_host", lambda x: calls.append(1) or to_host(x))  # contexts

    def no_blocking(*args, **kwargs):
        raise AssertionError("block_until_ready inside the training loop")

    monkeypatch.setattr(jax, "block_until_ready", no_blocking)
    trainer.fit(data, steps=40, progress=False, log_every=10)
    # 4 log reads + 2 epoch ends (reads + context) + the final read: far fewer than 40
    assert len(calls) <= 10
    assert trainer.train_step._compiled._cache_size() == 1  # the TrainStep's own program, once


def _weighted_mean(values, sizes):
    """The Trainer's mean of step values: float32 products summed step by step in float64."""
    total = 0.0
    for v, n in zip(values, sizes):
        total += float(np.float32(v) * np.float32(n))
    return total / sum(sizes)


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_means_weigh_each_step_by_its_minibatch_size(steps_per_call):
    # The sizes are recorded when each step runs (not looked up again at the read): a last
    # minibatch of 2 weighs half of one of 4, in single steps and in stacked calls.
    batches = [(X[0:4], LABELS[0:4]), (X[4:8], LABELS[4:8]), (X[8:10], LABELS[8:10])]
    seen = []
    trainer = Trainer(mlp(), adam(), classify)
    history = trainer.fit(batches, epochs=2, progress=False, log_every=2, steps_per_call=steps_per_call,
                          callbacks=[lambda ctx: seen.append((ctx.event, ctx.step, dict(ctx.metrics)))])
    steps = history.steps["loss"]
    assert len(steps) == 6
    assert history.epochs["loss"] == [_weighted_mean(steps[:3], [4, 4, 2]), _weighted_mean(steps[3:], [4, 4, 2])]
    logs = [(step, m["loss"]) for event, step, m in seen if event == "log"]
    assert logs[0] == (2, _weighted_mean(steps[:2], [4, 4]))


def test_a_fit_without_callbacks_reads_no_learning_context(monkeypatch):
    # Nobody receives a TrainingContext: the log points pass the buffer alone (no snapshot
    # of the optimizer state), and epoch and fit ends read no context from the device.
    snapshots = []
    original = intervals_module.next_buffer
    monkeypatch.setattr(intervals_module, "next_buffer",
                        lambda halt, rows, state=None: snapshots.append(state is not None) or original(halt, rows, state))
    monkeypatch.setattr(reader_module, "snapshot", lambda state: pytest.fail("a context was read"))
    trainer = Trainer(mlp(), adam(), classify)
    data = ft.train.batches((X, LABELS), 4, key=jax.random.key(1))  # 16 steps per epoch
    history = trainer.fit(data, epochs=2, progress=False, log_every=5)
    assert snapshots and not any(snapshots)
    assert len(history.steps["loss"]) == 32 and history.epochs["epoch"] == [1, 2]
    contexts = []  # with a callback, each log's context is the state's after its step
    monkeypatch.undo()
    trainer.fit(data, epochs=3, progress=False, log_every=5,
                callbacks=[lambda ctx: contexts.append((ctx.event, ctx.step, ctx.samples_seen, ctx.sweep))])
    # log_every counts the job's steps (Lightning's log_every_n_steps): at 35, 40, 45
    assert [c for c in contexts if c[0] == "log"] == [("log", s, 4 * s, 2) for s in (35, 40, 45)]
    assert ("epoch", 48, 4 * 48, 3) in contexts


def test_a_trainer_whose_model_was_donated_elsewhere_names_the_array():
    # The Trainer's own arrays are not looked through before each call (an epoch end
    # passes a new optimizer state every epoch): a deleted one is named when the call fails.
    trainer = Trainer(mlp(), adam(), classify)
    data = [(X[:16], LABELS[:16]), (X[16:32], LABELS[16:32])]
    trainer.fit(data, epochs=1, progress=False)
    trainer.model.layers[0].weight.delete()  # donated by the user's own ft.jit, say
    with pytest.raises(ValueError, match=r"'model' holds a deleted array at layers\.0\.weight"):
        trainer.fit(data, epochs=2, progress=False)


def test_steps_cross_epochs_and_generic_iterables():
    batches = [(X[i : i + 16], LABELS[i : i + 16]) for i in range(0, 64, 16)]
    trainer = Trainer(mlp(), adam(), classify)
    history = trainer.fit(batches, steps=10, progress=False)
    assert len(history.steps["loss"]) == 10 and history.epochs["epoch"] == [1, 2]
    one_shot = iter(batches)
    with pytest.warns(UserWarning, match=r"stopped short of steps=20, at step 14"):
        history = trainer.fit(one_shot, steps=20, progress=False)  # steps= counts the whole job
    assert len(history.steps["loss"]) == 14  # the iterator ran out after 4 steps
    with pytest.raises(ValueError, match=r"gave no minibatch"):
        Trainer(mlp(), adam(), classify).fit([], epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"epochs must be a positive int"):
        trainer.fit(batches, epochs=0, progress=False)


def test_bad_batch_surfaces_the_layer_error_unchanged():
    trainer = Trainer(mlp(), adam(), classify)
    wrong = (np.zeros((8, 5), np.float32), np.zeros(8, np.int32))
    with pytest.raises(ft.nn.LayerInputError) as info:
        trainer.fit([wrong], progress=False)
    assert "Dense at .layers[0] expects inputs [..., 3]" in str(info.value)
    assert "f32[8,5]" in str(info.value)


def nan_data(bad_step):
    batches = [(X[i : i + 8].copy(), Y[i : i + 8]) for i in range(0, 64, 8)]
    batches[bad_step - 1][0][0, 0] = np.nan
    return batches


def test_nan_stops_with_step_and_parameter_and_keeps_last_finite_model():
    trainer = Trainer(mlp(), adam(0.01), regress)
    with pytest.raises(NonFiniteError, match=r"step 6: the gradient of parameter 'layers.0.weight'"):
        trainer.fit(nan_data(6), epochs=1, progress=False, log_every=4)
    assert trainer.steps_run == 5 and int(ft.optim.context(trainer.opt_state).step) == 5
    reference = Trainer(mlp(), adam(0.01), regress)
    reference.fit(nan_data(6)[:5], epochs=1, progress=False)
    for a, b in zip(jax.tree.leaves(trainer.model), jax.tree.leaves(reference.model)):
        np.testing.assert_array_equal(a, b)
    # the applied steps: the stopped one and those its gate closed after it are not history
    assert trainer.history.steps["step"] == [1, 2, 3, 4, 5]


def test_nan_skip_continues():
    trainer = Trainer(mlp(), adam(0.01), regress, on_nan="skip")
    trainer.fit(nan_data(3), epochs=2, progress=False, log_every=4)
    assert trainer.skipped == [(3, "the gradient of parameter 'layers.0.weight'"),
                               (11, "the gradient of parameter 'layers.0.weight'")]
    assert int(ft.optim.context(trainer.opt_state).step) == 14
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(trainer.model))
    # issue 27: the epoch means are over the applied steps (one skipped step made them NaN),
    # and the history and the context count the skipped ones
    losses = np.array(trainer.history.steps["loss"])
    assert np.isnan(losses[[2, 10]]).all()
    applied = np.delete(losses, [2, 10]).reshape(2, 7)  # minibatches of 8: plain means
    # float32 sums on the host, values ~4: measured 1.5e-7
    np.testing.assert_allclose(trainer.history.epochs["loss"], applied.mean(axis=1), rtol=0, atol=2e-6)
    assert trainer.history.epochs["skipped"] == [1, 1]


def test_empty_and_malformed_minibatches_name_the_step():
    # issue 27: an empty minibatch gave a NaN stop (or ZeroDivisionError in ft.nn.Flatten), a
    # malformed one named the layer and shapes but not the step or the minibatch
    good = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 64, 8)]
    empty = good[:2] + [(X[:0], Y[:0])] + good[3:]
    trainer = Trainer(mlp(), adam(0.01), regress)
    with pytest.raises(ValueError, match=r"^step 3: minibatch 2 of epoch 0 is empty \(0 examples; .*"
                                         r"float32\[0, 3\]"):
        trainer.fit(empty, epochs=1, progress=False)
    wide = good[:4] + [(np.ones((8, 4), np.float32), Y[:8])] + good[5:]
    trainer = Trainer(mlp(), adam(0.01), regress)
    with pytest.raises(ValueError, match=r"(?s)^step 5: minibatch 4 of epoch 0 \(counted from 0\) failed in the "
                                        r"training step. Its shapes: \('float32\[8, 4\]', 'float32\[8, 1\]'\); the "
                                        r"trainer's first minibatch had \('float32\[8, 3\]', 'float32\[8, 1\]'\)"
                                        r"\. The error:\nDense at .layers\[0\] expects inputs \[..., 3\]"):
        trainer.fit(wide, epochs=1, progress=False)


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path):
    def make():
        return Trainer(mlp(dropout=0.2), adam(0.01), classify, key=jax.random.key(3))

    data = ft.train.batches((X, LABELS), 12, key=jax.random.key(4))  # 6 steps per epoch
    straight = make()  # 30 steps, resumed from step 15 (mid-epoch 3): 100 and 50 showed no more
    straight.fit(data, steps=30, progress=False)
    first = make()
    first.fit(data, steps=15, progress=False)
    first.save(tmp_path / "ckpt")
    second = make()
    second.restore(tmp_path / "ckpt")
    assert (second.steps_run, second.epoch, second.batch_in_epoch) == (15, 2, 3)
    second.fit(data, steps=30, progress=False)  # steps= counts the whole job
    for a, b in zip(jax.tree.leaves(straight.model), jax.tree.leaves(second.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(straight.opt_state), jax.tree.leaves(second.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_checks_the_template(tmp_path):
    trainer = Trainer(mlp(), adam(), classify)
    trainer.save(tmp_path / "ckpt")
    other = Trainer(ft.nn.Sequential(ft.nn.Dense(3, 4, key=jax.random.key(0)),
                                     ft.nn.Dense(4, 2, key=jax.random.key(1))), adam(), classify)
    with pytest.raises(ft.train.CheckpointError, match=r"layers.0.weight: expected shape \(3, 4\)"):
        other.restore(tmp_path / "ckpt")


def test_other_metrics_mid_epoch_are_refused_and_added_at_an_epoch_end_mean_their_own_steps(tmp_path):
    # Before: one weight for every metric's running mean: a metric added on a restore
    # inside an epoch was Σ over the steps after it / Σ n over the epoch's (0.42 for 0.87),
    # and one added at an epoch's end, in a log window spanning it, / Σ n over the window's.
    def mae(out):
        return jnp.mean(jnp.abs(out.model(out.batch[0]) - out.batch[1]))

    def make(metrics=None):
        return Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), adam(), regress, metrics=metrics)

    def data():
        return ft.train.batches((X, Y), 16, key=jax.random.key(1))  # 4 steps an epoch

    for change, saved, ours in (("added", None, {"mae": mae}), ("removed", {"mae": mae}, None)):
        old = make(saved)
        old.fit(data(), steps=2, progress=False)
        old.save(tmp_path / change)
        with pytest.raises(ft.train.CheckpointError, match=r"(?s)step 2 .* inside epoch 1: .*\(" + change +
                           r" \['mae'\]\).*right:  trainer.restore\(path, step="):
            make(ours).restore(tmp_path / change)
    path = tmp_path / "added"  # the error's other fix: the epoch finished with the saved metrics
    old = make().restore(path)
    old.fit(data(), epochs=old.epoch + 1, progress=False)
    old.save(path)
    new = make({"mae": mae}).restore(path)
    seen = []
    new.fit(data(), epochs=2, log_every=3, progress=False, callbacks=[seen.append])
    first = next(c for c in seen if c.event == "log")  # the window of steps 1-5 (since_log 4 restored)
    assert first.step == 5 and new.history.steps["step"][4] == 5
    assert first.metrics["mae"] == new.history.steps["mae"][4]  # step 5's alone: Σ n·v / n, exact


class _MaeStep(ft.train.TrainStep):
    def compute_metrics(self, out):
        return {**super().compute_metrics(out), "mae": jnp.mean(jnp.abs(out.model(out.batch[0]) - out.batch[1]))}


class _RmseStep(ft.train.TrainStep):
    def compute_metrics(self, out):
        return {**super().compute_metrics(out), "rmse": jnp.sqrt(jnp.mean((out.model(out.batch[0]) - out.batch[1]) ** 2))}


def test_an_overridden_compute_metrics_of_other_names_mid_epoch_is_refused_when_it_traces(tmp_path):
    # Its names are known only when the step traces, so the restore's check let it pass:
    # epoch 1's rmse was the mean of its last 2 of 4 steps (2.67), mae of its first 2, both
    # reported as the epoch's. Refused at fit's first minibatch, before any step runs (the
    # restore forgets the names an earlier fit read). The same names continue the epoch; an
    # epoch that ends before the step traces (a loader without len()) has nothing to mix.
    def make(step):
        opt = ft.optim.sgd(0.01)
        return Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), opt, regress, train_step=step(regress, opt))

    class Loader:  # no len(): its epoch ends when its iterator does
        def __iter__(self):
            return iter(list(ft.train.batches((X, Y), 16, key=jax.random.key(1))))  # 4 steps an epoch

    old = make(_MaeStep)
    for steps in (2, 4):
        old.fit(Loader(), steps=steps, progress=False)
        old.save(tmp_path / "ck")  # steps 2 and 4 (its epoch end not yet met)
    changed = (r"(?s)^The checkpoint at step 2 .* inside epoch 1: .* for \['loss', 'mae'\], but this trainer records "
               r"\['loss', 'rmse'\] \(added \['rmse'\], removed \['mae'\]\); the step's compute_metrics .*"
               r"wrong:  Trainer\(model, opt, loss_fn, train_step=OtherStep\(\.\.\.\)\)\.restore\(path\)\.fit\(data\)"
               r".*right:  trainer\.restore\(path, step=")
    new = make(_RmseStep).restore(tmp_path / "ck", 2)
    for _ in range(2):  # and again: nothing ran
        with pytest.raises(ft.train.CheckpointError, match=changed):
            new.fit(Loader(), epochs=1, progress=False)
        assert new.steps_run == 2 and new.history.steps["step"] == [1, 2]
    old.restore(tmp_path / "ck", 2).fit(Loader(), epochs=1, progress=False)  # traced again: the same names
    mae = old.history.steps["mae"]
    assert len(mae) == 4 and old.history.epochs["mae"][0] == pytest.approx(np.mean(mae), abs=1e-6 * max(mae))
    new.restore(tmp_path / "ck", 4).fit(Loader(), epochs=2, progress=False)
    assert new.history.epochs["mae"] == [old.history.epochs["mae"][0], None] and new.history.epochs["rmse"][0] is None


def test_progress_bar(capsys):
    trainer = Trainer(mlp(), adam(), classify, metrics={"acc": ft.train.accuracy})
    trainer.fit((X, LABELS), epochs=2, batch_size=16, log_every=2, progress=True, validation_data=(X, LABELS))
    err = capsys.readouterr().err
    assert "8/8" in err and "loss=" in err and "lr=0.0500" in err and "acc=" in err
    # issue 27: no terminal (captured): one line per epoch, with the validation metrics
    lines = err.strip().splitlines()
    assert len(lines) == 2 and all(" steps, loss=" in line and ", val_loss=" in line for line in lines)
    assert lines[0].startswith("epoch 1: 4/8 steps, ") and lines[1].startswith("epoch 2: 8/8 steps, ")
    trainer.fit((X, LABELS), epochs=3, progress=False)  # one more epoch: epochs= counts the whole job
    assert capsys.readouterr().err == ""


def test_custom_train_step_class():
    class Frozen(ft.train.TrainStep):
        def apply(self, model, opt_state, batch, key=None, enabled=None):
            loss, aux = self.compute_loss(model, batch, key)
            return model, opt_state, loss, aux, None

    model = mlp()
    trainer = Trainer(model, adam(), classify, train_step=Frozen, on_nan=None)
    trainer.fit((X, LABELS), steps=3, progress=False)
    np.testing.assert_array_equal(trainer.model.layers[0].weight, model.layers[0].weight)
    with pytest.raises(TypeError, match=r"train_step= takes a ft.train.TrainStep"):
        Trainer(model, adam(), classify, train_step=lambda *a: None)


def test_a_given_step_and_other_trainer_arguments_are_refused():
    """A ready-made step trains with its own loss, optimizer, metrics and on_nan; the
    Trainer's were silently ignored (another loss: training minimized the step's while
    evaluate reported the Trainer's; metrics=[accuracy]: no accuracy logged at all)."""
    opt = adam()
    step = ft.train.train_step(classify, opt, metrics=[ft.train.accuracy])
    trainer = Trainer(mlp(), opt, classify, train_step=step)  # the step's own: accepted
    assert list(trainer.train_step.metrics) == ["accuracy"]
    Trainer(mlp(), step.optimizer, classify, metrics=[ft.train.accuracy], on_nan="stop", train_step=step)
    ignoring = ft.train.train_step(classify, opt, metrics={"m": "logits"}, on_nan=None)
    Trainer(mlp(), opt, classify, metrics={"m": "logits"}, on_nan=None, train_step=ignoring)  # None: "ignore"
    with pytest.raises(ValueError, match=r"computes 'm' with another function than the Trainer's 'm'"):
        Trainer(mlp(), opt, classify, metrics={"m": "labels"}, train_step=ignoring)  # another aux key

    def other_loss(model, batch):
        return 2.0 * classify(model, batch)[0]

    refused = {"loss function": dict(loss_fn=other_loss), "optimizer": dict(optimizer=adam()),
               "metrics": dict(metrics=[ft.train.binary_accuracy]), "on_nan": dict(on_nan="skip")}
    refused["metrics "] = dict(metrics={"accuracy": ft.train.mean("logits")})  # the same name, another function
    for what, changed in refused.items():
        what = what.strip()
        given = {"optimizer": opt, "loss_fn": classify, **changed}
        with pytest.raises(ValueError, match=rf"trains with the step's own {what}, but the Trainer was given another"):
            Trainer(mlp(), train_step=step, **given)


class _Threshold:
    """A metric as a bound method: its threshold lives on the instance."""

    def __init__(self, t):
        self.t = t

    def rate(self, out):
        return jnp.mean(jax.nn.softmax(out.aux).max(-1) > self.t)


def _threshold(t):
    return lambda out: jnp.mean(jax.nn.softmax(out.aux).max(-1) > t)


def test_a_given_steps_metrics_are_compared_by_instance_value_and_name():
    """Bound methods of two instances passed as one function (``Thresh(0.4).rate`` for the
    Trainer's ``Thresh(0.9).rate``: fit logged the t=0.4 rate, 0.875 where t=0.9 gives 0);
    the same metrics in another dict order, and closures over equal numpy scalars, were
    refused ("would log the step's ['a', 'c'], not ['a', 'c']")."""
    opt = adam()
    step = ft.train.train_step(classify, opt, metrics={"thr": _Threshold(0.4).rate})
    with pytest.raises(ValueError, match=r"computes 'thr' with another function than the Trainer's 'thr'"):
        Trainer(mlp(), opt, classify, metrics={"thr": _Threshold(0.9).rate}, train_step=step)
    same = _Threshold(0.4)
    Trainer(mlp(), opt, classify, metrics={"thr": same.rate},
            train_step=ft.train.train_step(classify, opt, metrics={"thr": same.rate}))
    ordered = ft.train.train_step(classify, opt, metrics={"a": ft.train.accuracy, "c": _threshold(0.5)})
    trainer = Trainer(mlp(), opt, classify, metrics={"c": ordered.metrics["c"], "a": ft.train.accuracy},
                      train_step=ordered)
    assert list(trainer.train_step.metrics) == ["a", "c"]  # the step's order: the history's columns
    history = trainer.fit(ft.train.batches((X, LABELS), 16, shuffle=False), epochs=1, progress=False)
    assert [k for k in history.epochs if k in ("a", "c")] == ["a", "c"]
    numpy_step = ft.train.train_step(classify, opt, metrics={"thr": _threshold(np.float32(0.4))})
    Trainer(mlp(), opt, classify, metrics={"thr": _threshold(np.float32(0.4))}, train_step=numpy_step)
    for other in (np.float32(0.9), np.float64(0.4), np.array([0.4], np.float32)):  # value, dtype, shape
        with pytest.raises(ValueError, match=r"computes 'thr' with another function"):
            Trainer(mlp(), opt, classify, metrics={"thr": _threshold(other)}, train_step=numpy_step)


def test_restore_model_with_new_optimizer_options(tmp_path):
    trainer = Trainer(mlp(), adam(), classify)
    trainer.fit((X, LABELS), steps=4, progress=False)
    trainer.save(tmp_path / "ckpt")
    sgd = Trainer(mlp(seed=5), ft.optim.Optimizer(ft.optim.sgd(0.1)), classify)
    with pytest.raises(ft.train.CheckpointError, match=r"optimizer|opt_state"):
        sgd.restore(tmp_path / "ckpt")
    sgd.restore(tmp_path / "ckpt", optimizer_state=False)
    np.testing.assert_array_equal(sgd.model.layers[0].weight, trainer.model.layers[0].weight)
    assert sgd.steps_run == 4
    sgd.fit((X, LABELS), steps=6, progress=False)  # two more steps: steps= counts the whole job
    assert int(ft.optim.context(sgd.opt_state).step) == 2


def test_setting_the_optimizer_or_wrt_mid_run_is_refused_and_the_printed_fix_runs(tmp_path):
    trainer = Trainer(mlp(), adam(), classify)
    trainer.fit((X, LABELS), steps=2, progress=False)
    # Each was ignored: sgd(0.0) assigned, the next fit trained on with adam (wrt= likewise).
    with pytest.raises(AttributeError, match=r"trainer.optimizer cannot be set(.|\n)*set_hyperparameters"):
        trainer.optimizer = ft.optim.Optimizer(ft.optim.sgd(0.0))
    with pytest.raises(AttributeError, match=r"wrt='layers.1.\*'\)\.restore\(path, optimizer_state=False\)"):
        trainer.wrt = "layers.1.*"
    for name, value in [("loss_fn", classify), ("on_nan", "skip"), ("learning_rate", 1e-4)]:
        with pytest.raises(AttributeError, match=f"trainer.{name} cannot be set"):
            setattr(trainer, name, value)
    trainer.steps_per_call = 2  # read by each fit: still set
    before = trainer.model
    trainer.save(tmp_path / "ckpt")  # the printed fix: the job continued with wrt=
    frozen = Trainer(trainer.model, adam(), classify, wrt="layers.1.*").restore(tmp_path / "ckpt", optimizer_state=False)
    frozen.fit((X, LABELS), steps=4, progress=False)
    assert frozen.steps_run == 4
    np.testing.assert_array_equal(frozen.model.layers[0].weight, before.layers[0].weight)
    assert not np.array_equal(frozen.model.layers[1].weight, before.layers[1].weight)


def test_freezing_mid_run_by_the_printed_fix_keeps_the_trained_parameters_moments_and_step_count(tmp_path):
    """trainer.wrt = ... printed one fix, restore(path, optimizer_state=False), as the way to
    continue the job: the optimizer state restarted (Adam's moments of the layer still trained
    from zero, its step count from 0, so a warmup ran again) with no word of it. The message
    says so and prints, for the same optimizer, the fix that keeps the step count and the
    moments of the parameters trained before and now; followed, the next step is the old
    optimizer's given a partial gradient (torch's requires_grad_(False))."""
    opt = ft.optim.Optimizer(ft.optim.adam(ft.optim.linear_warmup(0.05, 10)))
    trainer = Trainer(mlp(), opt, classify)
    trainer.fit([(X, LABELS)], epochs=2, progress=False)  # two steps of one minibatch
    with pytest.raises(AttributeError) as e:
        trainer.wrt = "layers.1.*"
    assert "# the optimizer state starts afresh: moments from zero, its step count (a schedule's place) from 0" in str(e.value)
    fix = ("            kept = trainer.opt_state\n            trainer.save(path)\n            trainer = ft.train.Trainer("
           "trainer.model, optimizer, loss_fn, wrt='layers.1.*').restore(path, optimizer_state=False)\n"
           "            trainer.opt_state = jax.tree.map(lambda new, old: new if new is None or old is None else old,\n"
           "                                             trainer.opt_state, kept, is_leaf=lambda x: x is None)")
    assert fix in str(e.value)
    model, state = jax.tree.map(jnp.copy, (trainer.model, trainer.opt_state))  # (the fit donates the kept state)
    kept = trainer.opt_state  # the printed fix
    trainer.save(tmp_path / "ckpt")
    trainer = Trainer(trainer.model, opt, classify, wrt="layers.1.*").restore(tmp_path / "ckpt", optimizer_state=False)
    trainer.opt_state = jax.tree.map(lambda new, old: new if new is None or old is None else old,
                                     trainer.opt_state, kept, is_leaf=lambda x: x is None)
    assert int(ft.optim.context(trainer.opt_state).step) == 2
    trainer.fit([(X, LABELS)], epochs=3, progress=False)  # one more
    @jax.jit  # (one program: eager, each operation compiles apart)
    def partial_step(model, state):
        grads = ft.gradient(lambda m: classify(m, (X, LABELS))[0], at=model, wrt="layers.1.*")
        return opt.apply_gradients(grads, model, state)[0]

    expected = partial_step(model, state)
    np.testing.assert_array_equal(trainer.model.layers[0].weight, model.layers[0].weight)
    np.testing.assert_allclose(trainer.model.layers[1].weight, expected.layers[1].weight, rtol=0, atol=1e-6)


def keyed_loss(model, batch, *, key):
    """A loss written as documented: ``loss_fn(model, batch, *, key)`` (key required)."""
    x, labels = batch
    logits = model(x, key=key)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)), logits


def test_evaluate_and_predict_name_the_minibatch_that_failed():
    trainer = Trainer(mlp(), adam(), classify)
    good = [(X[i : i + 16], LABELS[i : i + 16]) for i in range(0, 48, 16)]
    wrong = (np.zeros((16, 5), np.float32), LABELS[:16])  # 5 features where the model takes 3
    with pytest.raises(ft.nn.LayerInputError) as info:
        trainer.evaluate([*good, wrong])
    text = str(info.value)
    assert "evaluate: minibatch 3 (counted from 0) failed" in text and "float32[16, 5]" in text
    assert "the first minibatch had ('float32[16, 3]', 'int32[16]')" in text
    assert "Dense at .layers[0] expects inputs [..., 3]" in text  # the layer's own error kept
    with pytest.raises(ft.nn.LayerInputError, match=r"predict: minibatch 0 \(counted from 0\) failed"):
        trainer.predict([wrong, *good])


def test_predict_and_evaluate_read_the_training_batches_in_order():
    """The training data object passed back (shuffled, drop_last) gave predict epoch 0's
    permutation of the rows and evaluate a subset; both now read every example in order.
    An empty minibatch (np.array_split past len(x)) made evaluate NaN; it is named."""
    trainer = Trainer(mlp(), adam(), classify)
    data = ft.train.batches((X, LABELS), 16, key=jax.random.key(3), drop_last=True)
    expected = trainer.inference_model(X)
    np.testing.assert_allclose(trainer.predict(data), expected, rtol=0, atol=1e-6)
    whole = trainer.evaluate((X, LABELS), batch_size=64)
    assert trainer.evaluate(data)["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    parts = list(zip(np.array_split(X[:5], 6), np.array_split(LABELS[:5], 6)))
    with pytest.raises(ValueError, match=r"evaluate: minibatch 5 \(counted from 0\) is empty"):
        trainer.evaluate(parts)
    with pytest.raises(ValueError, match=r"(?s)the default fn calls model\(inputs\).*\['attention_mask', 'input_ids'\]"):
        trainer.predict([{"input_ids": X, "attention_mask": X}])


def test_a_second_evaluation_or_validation_traces_the_loss_no_more():
    """The sums' structure (the metrics' names) is traced once per signature: main traced
    the loss and every metric again (jax.eval_shape of a new function) on each evaluate
    and each validation pass, a whole forward pass in Python (0.2 s on a tiny Llama)."""
    traced = {"loss": 0, "metric": 0}

    def counted(model, batch):
        traced["loss"] += 1
        return regress(model, batch)

    def mae(out):
        traced["metric"] += 1
        return jnp.mean(jnp.abs(out.model(out.batch[0])[:, :1] - out.batch[1]))

    trainer = Trainer(mlp(), adam(), counted, metrics={"mae": mae})
    first = trainer.evaluate((X, Y), batch_size=32)  # traced twice: the sums' structure, the summing program
    data = ft.train.batches((X, Y), 16, key=jax.random.key(0))
    trainer.fit(data, epochs=1, validation_data=(X, Y), batch_size=32, progress=False)  # traces the train step
    traced.update(loss=0, metric=0)
    trainer.fit(data, epochs=3, validation_data=(X, Y), batch_size=32, progress=False)
    again = trainer.evaluate((X, Y), batch_size=32)
    assert traced == {"loss": 0, "metric": 0}  # main: 3 each (two validation passes, one evaluate)
    assert sorted(again) == sorted(first) == ["loss", "mae"]
    expected = float(regress(trainer.inference_model, (X, Y)))
    np.testing.assert_allclose(again["loss"], expected, rtol=0, atol=1e-5 * max(1.0, expected))


def test_nothing_to_train_names_the_epochs_and_steps_the_job_has_run(caplog):
    # main formatted the argument: "has already run 1 epochs" after 4 epochs
    trainer = Trainer(mlp(), adam(), regress)
    data = ft.train.batches((X, Y), 16, key=jax.random.key(0))  # 4 steps an epoch
    trainer.fit(data, epochs=4, progress=False)
    with caplog.at_level(logging.WARNING, logger="functree.train"):
        trainer.fit(data, epochs=1, progress=False)
        trainer.fit(data, steps=3, progress=False)
    assert "nothing to train, the job has already run 4 epochs (" in caplog.text  # main: "1 epochs"
    assert "nothing to train, the job has already run 16 steps (" in caplog.text  # main: "3 steps"
    assert "e.g. trainer.fit(data, epochs=5)" in caplog.text and "trainer.fit(data, steps=116)" in caplog.text
    assert (trainer.epoch, trainer.steps_run) == (4, 16)


def test_a_loss_that_requires_a_key_evaluates_and_validates():
    trainer = Trainer(mlp(dropout=0.3), adam(), keyed_loss, metrics=[ft.train.accuracy], key=jax.random.key(2))
    history = trainer.fit((X, LABELS), epochs=2, batch_size=16, validation_data=(X, LABELS), progress=False)
    assert len(history.epochs["val_loss"]) == 2
    first, again = trainer.evaluate((X, LABELS)), trainer.evaluate((X, LABELS), batch_size=64)
    assert_close_trained(first["loss"], again["loss"], spread=2e-7)  # inference: the key changes nothing
    logits = trainer.inference_model(X)
    expected = float(keyed_loss(trainer.inference_model, (X, LABELS), key=jax.random.key(9))[0])
    assert_close_trained(first["loss"], expected, spread=2e-7)  # these three: measured max 1.1e-7
    assert_close_trained(trainer.predict(X, batch_size=16), logits, spread=2e-7)


def test_evaluate_and_predict_pass_a_fixed_key_to_functions_that_take_one():
    seen = []

    def noisy_loss(model, batch, key=None):  # a key used beyond Dropout: evaluation is reproducible
        seen.append(key is not None)
        return jnp.mean(model(batch[0])[:, :1] - batch[1]) + jax.random.normal(key, ())

    trainer = Trainer(mlp(), adam(), noisy_loss, key=jax.random.key(0))
    a, b = trainer.evaluate((X, Y), batch_size=16), trainer.evaluate((X, Y), batch_size=16)
    assert a == b and all(seen)
    other = Trainer(mlp(), adam(), noisy_loss, key=jax.random.key(1)).evaluate((X, Y), batch_size=16)
    assert other != a
    sample = trainer.predict(X, lambda m, batch, *, key: jax.random.normal(key, (batch.shape[0],)), batch_size=16)
    assert sample.shape == (64,) and len(np.unique(np.asarray(sample))) == 64  # a key per batch


def test_a_loss_that_requires_a_key_needs_the_trainers_key():
    with pytest.raises(ValueError, match=r"keyed_loss\(model, batch, \*, key\) requires a PRNG key") as info:
        Trainer(mlp(dropout=0.3), adam(), keyed_loss)
    assert "key=jax.random.key(0)" in str(info.value)


def test_a_trainer_key_with_a_loss_that_takes_none_is_named_at_construction():
    def mse(model, batch):
        return jnp.mean((model(batch[0])[:, :1] - batch[1]) ** 2)

    with pytest.raises(ValueError, match=r"the loss function mse\(model, batch\) takes no key") as info:
        Trainer(mlp(), adam(), mse, key=jax.random.key(0))
    assert "lambda m, b, key=None:" in str(info.value) and "give the Trainer none" in str(info.value)
    Trainer(mlp(), adam(), mse).fit((X, Y), steps=1, progress=False)  # without a key: trains
    Trainer(mlp(), adam(), lambda m, b, **kw: mse(m, b), key=jax.random.key(0)).fit((X, Y), steps=1, progress=False)


def test_the_trained_model_for_inference():
    # test_resume_is_bit_exact's model, optimizer and minibatches of 12: its compiled step
    trainer = Trainer(mlp(dropout=0.2), adam(0.01), classify, key=jax.random.key(0))
    trainer.fit(ft.train.batches((X, LABELS), 12, key=jax.random.key(4)), steps=2, progress=False)
    with pytest.raises(ValueError, match=r"needs a PRNG key"):
        trainer.model(X)  # trainer.model is the training-mode model
    out = trainer.inference_model(X)
    np.testing.assert_array_equal(out, trainer.inference_model(X))  # deterministic
    np.testing.assert_allclose(trainer.predict(X), out, rtol=1e-6, atol=1e-6)
    assert ft.nn.is_training(trainer.model) and not ft.nn.is_training(trainer.inference_model)


@needs_float16_conversions
def test_float16_with_loss_scaling_trains_through_overflows_with_the_default_on_nan():
    def loss16(model, batch):
        x, y = batch
        pred = ft.parallel.cast(model, jnp.float16)(x.astype(jnp.float16))
        return jnp.mean((pred[:, :1] - y.astype(jnp.float16)) ** 2).astype(jnp.float32)

    opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(1e-2)), initial_scale=2.0**24)
    trainer = Trainer(mlp(), opt, loss16)  # on_nan: the default "stop"
    history = trainer.fit((X, Y), batch_size=16, epochs=8, progress=False)
    state = trainer.opt_state
    assert int(state.skipped) >= 9  # 2^24 .. 2^16 overflow float16: skipped by the optimizer itself
    assert float(state.scale) <= 2.0**15 and trainer.skipped == []  # the scale came down; no NaN stop
    loss = history.epochs["loss"]
    assert loss[-1] < 0.8 * loss[2]  # it trains: the epochs after the overflows lower the loss


def test_a_one_shot_iterator_for_several_epochs_names_the_fix():
    trainer = Trainer(mlp(), adam(), classify)
    generator = ((X[i : i + 16], LABELS[i : i + 16]) for i in range(0, 64, 16))
    with pytest.raises(ValueError, match=r"one-shot iterator(.|\n)*ft.train.batches(.|\n)*steps=1000"):
        trainer.fit(generator, epochs=3, progress=False)
    trainer.fit(generator, epochs=1, progress=False)  # one epoch, or steps=, is fine
    assert trainer.steps_run == 4


def test_a_stop_error_holds_the_failing_steps_inputs():
    batches = nan_data(3)
    trainer = Trainer(mlp(), adam(0.01), regress)
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(batches, epochs=1, progress=False, log_every=4)
    error = info.value
    assert error.step == 3 and error.parameter == "layers.0.weight" and error.loss_fn is regress
    np.testing.assert_array_equal(error.batch[0], batches[2][0])  # the failing batch, as given
    assert error.model is trainer.model  # the model from before step 3


def test_a_model_donated_before_the_trainer_is_named_from_the_trainers_argument():
    # Issue 37 item 4, through the Trainer: the path of the donated array from the model given.
    class Net(ft.Module):
        conv: ft.nn.Conv2D

        def __call__(self, x):
            return self.conv(x)

    net = Net(ft.nn.Conv2D(1, 2, 3, key=jax.random.key(0)))
    donate = ft.jit(lambda model, x: model, donate="model")
    donate(net, np.ones((1, 5, 5, 1), np.float32))
    with pytest.raises(ValueError, match=r"deleted array at model\.conv\.weight"):
        Trainer(net, adam(), classify)


def test_a_dropped_trainer_is_freed_at_once_with_its_model_and_state():
    # No reference cycle (its metric reader holds it weakly): the model, optimizer state
    # and log buffer (device memory) go when the trainer goes, not at the next full pass
    # of the collector.
    import gc
    import weakref

    # the nan tests' model, loss, optimizer and minibatches of 8: their compiled step, reused
    data = [(X[:8], Y[:8])] * 4
    trainer = ft.train.Trainer(mlp(), adam(0.01), regress)
    trainer.fit(data, epochs=2, progress=False, validation_data=data,
                callbacks=[ft.train.EarlyStopping(patience=3)])
    dropped = weakref.ref(trainer)
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert dropped() is None
    finally:
        gc.enable()


def test_saving_to_a_path_adds_a_checkpoint_and_deletes_none(tmp_path):
    # trainer.save(path) once built CheckpointManager(path) with max_to_keep=3 and pruned the
    # directory: a ModelCheckpoint's kept checkpoints, and its best one, were deleted.
    x, y = X[:32], Y[:32]

    def make():  # the rate is too large: the loss grows, epoch 1 is the best
        return Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(1.05), regress)

    run, best = tmp_path / "run", tmp_path / "best"
    trainer = make()
    trainer.fit(ft.train.batches((x, y), 8), epochs=3, progress=False, callbacks=[
        ft.train.ModelCheckpoint(run, max_to_keep=None), ft.train.ModelCheckpoint(best, best_metric="loss",
                                                                                max_to_keep=1)])
    assert ft.train.CheckpointManager(run).all_steps() == [4, 8, 12]
    assert ft.train.CheckpointManager(best, best_metric="loss").all_steps() == [4, 12]
    for steps in (14, 15, 16):
        trainer.fit(ft.train.batches((x, y), 8), steps=steps, progress=False)
        trainer.save(run)
        trainer.save(best)
    assert ft.train.CheckpointManager(run).all_steps() == [4, 8, 12, 14, 15, 16]
    ranked = ft.train.CheckpointManager(best, best_metric="loss")
    assert ranked.all_steps() == [4, 12, 14, 15, 16] and ranked.best_step() == 4
    # The directory already holds the trainer's step (its ModelCheckpoint wrote it at the end
    # of fit): the error names trainer.save, not manager.save, and its fix runs.
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)^trainer.save: .*already holds a checkpoint at step 16"
                                                       r".*right:  trainer.save\(\".*run-final\"\)"):
        trainer.save(run)
    trainer.save(f"{run}-final")
    assert ft.train.CheckpointManager(f"{run}-final").all_steps() == [16]


def test_a_skipped_steps_learning_rate_row_is_nan():
    # The row of a step left out under on_nan="skip" repeated the rate of the applied step
    # before it (the optimizer state it leaves); it applied none.
    x = X[:48].copy()
    x[13, 1] = np.nan  # minibatch 1 of 6 (8 examples each): the loss is NaN, the step skipped
    batches = [(x[i:i + 8], LABELS[i:i + 8]) for i in range(0, 48, 8)]
    schedule = ft.optim.warmup_cosine_decay(0.0, 0.05, warmup_steps=4, decay_steps=12, end_value=0.001)
    trainer = Trainer(mlp(), ft.optim.Optimizer(ft.optim.adam(schedule)), lambda m, b: classify(m, b)[0],
                      on_nan="skip")
    history = trainer.fit(batches, epochs=2, progress=False, log_every=4)
    rows = np.asarray(history.steps["learning_rate"])
    left_out = [s - 1 for s, _ in trainer.skipped]
    assert left_out == [1, 7]
    assert np.isnan(rows[left_out]).all()
    applied = np.delete(np.arange(len(rows)), left_out)
    # optax's schedule at every applied step in one compiled call (step by step: ~20 eager compiles)
    reference = jax.jit(optax.warmup_cosine_decay_schedule(0.0, 0.05, 4, 12, 0.001))
    expected = np.asarray(reference(jnp.arange(len(applied), dtype=jnp.float32)), np.float64)
    np.testing.assert_allclose(rows[applied], expected, rtol=0, atol=1e-8)


class _LongerThanLen:
    """len() ``n``, but ``n + 1`` minibatches an epoch (a __len__ counting something else)."""

    def __init__(self, n):
        rng = np.random.default_rng(3)
        self.n = n
        self.batches = [(rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 1)).astype(np.float32))
                        for _ in range(n + 1)]

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("k, n", [(1, 2), (2, 3)], ids=["one-step-calls", "steps_per_call=2"])
def test_data_yielding_more_minibatches_than_its_len_is_an_error_before_the_step(tmp_path, k, n):
    # Before: step n + 1 ran, and its checkpoint stored batch_in_epoch n + 1 of an epoch of n,
    # which the restore refuses (PAST_EPOCH_END). With k = 2 the n-th minibatch waits in a
    # group of one when the (n+1)-th comes: it runs first, the job ends at its epoch's end.
    def loss_fn(model, batch):
        return jnp.mean((model(batch[0]) - batch[1]) ** 2)

    def make():
        return ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(0.1), loss_fn)

    t = make()
    saves = [ft.train.ModelCheckpoint(tmp_path / "ck", every_steps=1, max_to_keep=None)] if k == 1 else []
    with pytest.raises(ValueError, match=rf"(?s)step {n + 1}: the data \(_LongerThanLen\) gave minibatch {n} of "
                                         rf"epoch 0 \(counted from 0\), but its len\(\) is {n}.*stopped at step {n}.*"
                                         r"right:  def __len__.*or:  no __len__"):
        t.fit(_LongerThanLen(n), epochs=2, progress=False, steps_per_call=k, callbacks=saves)
    assert (t.steps_run, t.epoch, t.batch_in_epoch) == (n, 0, n)
    if k != 1:
        t.save(tmp_path / "ck")  # the job at the epoch's last step
    with ft.train.CheckpointManager(tmp_path / "ck") as manager:
        assert manager.all_steps() == (list(range(1, n + 1)) if k == 1 else [n])
    for step in range(1, n + 1) if k == 1 else [n]:  # every checkpoint written restores
        assert make().restore(tmp_path / "ck", step=step).batch_in_epoch == step


def test_a_callback_whose_on_log_is_none_does_not_read_the_model():
    # Before: `on_log = None` (switched off) counted as an override: the Trainer read every
    # log interval as it ended (waiting for the device) for a hook that is never called.
    from functree.train._reader import reads_model

    class Off(ft.train.Callback):
        on_log = None

    class Reads(ft.train.Callback):
        def on_log(self, trainer, context):
            pass

    off = Reads()
    off.on_log = None  # switched off on the instance
    assert not reads_model(Off()) and not reads_model(off)
    assert reads_model(Reads()) and not reads_model(ft.train.Callback())


class _TenStep(ft.train.TrainStep):
    """compute_metrics overridden: metrics added after super()'s, named to sort before "loss"
    and after "nonfinite"."""

    def compute_metrics(self, out):
        return {**super().compute_metrics(out), "a_ten": jnp.full((), 10.0, jnp.float32),
                "z_twenty": jnp.full((), 20.0, jnp.float32)}


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_an_overridden_compute_metrics_fills_its_own_columns(on_nan):
    """The reader named the buffer's columns by eval_shape's result, whose dict keys are
    sorted, while the step writes each row in its dict's order: "loss" showed a_ten's 10,
    "a_ten" the loss, and the nonfinite column read z_twenty's 20 (under on_nan="skip": every
    step taken as skipped at parameter 20 of one, an IndexError). The columns are named in
    the dict's own order now."""
    def loss_fn(m, b):
        return jnp.mean((b * m["w"] - 1.0) ** 2)

    opt = ft.optim.sgd(0.0)
    t = Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=_TenStep(loss_fn, opt, on_nan=on_nan))
    t.fit([np.ones(4, np.float32)] * 3, epochs=1, progress=False)
    steps = t.history.steps
    assert (steps["loss"], steps["a_ten"], steps["z_twenty"]) == ([1.0] * 3, [10.0] * 3, [20.0] * 3)
    assert (t.history.epochs["loss"], t.history.epochs["a_ten"]) == ([1.0], [10.0])
    assert t.skipped == []


# --- other libraries' constructor calls, named with the fix --------------------------------


def _mse(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def test_keras_loss_keyword_is_named_with_the_fix():
    """Before: Trainer(model, opt, loss=fn) was Python's "missing 1 required positional
    argument: 'loss_fn'"; now the error shows the positional (or loss_fn=) call, which trains."""
    from functree.train._setup import KERAS_LOSS, KERAS_NAMED_LOSS

    model, opt = ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(0.1)
    with pytest.raises(TypeError) as info:
        Trainer(model, opt, loss=_mse)
    assert str(info.value) == KERAS_LOSS.format(given="_mse", right="_mse", note="")
    assert "wrong:  ft.train.Trainer(model, optimizer, loss=_mse)" in str(info.value)
    assert "right:  ft.train.Trainer(model, optimizer, _mse)" in str(info.value)
    with pytest.raises(TypeError) as info:
        Trainer(model, opt, loss="mse")
    assert str(info.value) == KERAS_LOSS.format(given="'mse'", right="loss_fn", note=KERAS_NAMED_LOSS)
    trainer = Trainer(model, opt, loss_fn=_mse)  # the right code trains: the loss numpy computes
    trainer.fit(ft.train.batches((X, Y[:, :1]), 64, shuffle=False), epochs=1, progress=False)
    w, b = np.asarray(model.weight), np.asarray(model.bias)
    expected = np.mean((X @ w.reshape(3, 1) + b - Y[:, :1]) ** 2, dtype=np.float64)
    np.testing.assert_allclose(trainer.history.epochs["loss"][0], expected, rtol=0, atol=1e-5)


def test_hugging_face_training_arguments_are_named_with_the_fix(tmp_path):
    """Before: Trainer(model, args) was Python's "missing 1 required positional argument";
    now the error names TrainingArguments and writes its settings into functree code."""
    transformers = pytest.importorskip("transformers")
    from functree.train._setup import HF_ARGS, _hf_recipe

    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=2e-5, num_train_epochs=3,
                                          per_device_train_batch_size=16, report_to=[])
    want = HF_ARGS.format(given="TrainingArguments", **_hf_recipe(args))
    for call in (lambda: Trainer(model, args), lambda: Trainer(model=model, args=args),
                 lambda: Trainer(model, args, _mse)):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == want
    assert "wrong:  ft.train.Trainer(model, args)" in want
    assert "weight_decay=0.0" in want and "ft.train.batches(train_arrays, 16), epochs=3" in want


def _hf_right_code(message):
    """The code after ``right:`` in HF_ARGS, up to the fit() call."""
    lines = message.split("\n")
    start = next(i for i, line in enumerate(lines) if "right:" in line)
    end = next(i for i in range(start, len(lines)) if ".fit(" in lines[i])
    return "\n".join([lines[start].split("right:")[1].strip()] + [line[12:] for line in lines[start + 1:end + 1]])


@pytest.mark.parametrize("kind, extra, n, steps, warm", [
    ("linear", {"num_train_epochs": 2, "warmup_steps": 3}, 40, 2 * math.ceil(math.ceil(40 / 4) / 2), 3),
    # 43 rows: a last minibatch of 3, which accumulate=2 cannot split (it crashed at step 6):
    # drop_last, 2 x 5 whole minibatches of 8 (HF: 2 x 6, its last one of 3 rows)
    ("linear", {"num_train_epochs": 2, "warmup_steps": 3}, 43, 2 * (43 // 8), 3),
    ("cosine", {"max_steps": 6, "warmup_steps": 0.25}, 40, 6, math.ceil(6 * 0.25)),  # a ratio below 1
])
def test_the_printed_hugging_face_recipe_runs_with_hfs_settings(tmp_path, kind, extra, n, steps, warm):
    """The recipe was ``ft.optim.adamw(0.0003)``: functree's weight decay 0.01 for the
    user's 0.1, no warmup or decay, no accumulation, no clipping. Run as printed on 40
    examples, it takes HF's optimizer steps (epochs x ceil(ceil(40 / 4) / 2), or
    max_steps) at the rates of transformers' own ``get_scheduler``, with
    AdamW(weight_decay=0.1), clipping at max_grad_norm and 2 microbatches a step."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, per_device_train_batch_size=4,
                                          weight_decay=0.1, gradient_accumulation_steps=2, lr_scheduler_type=kind,
                                          report_to=[], **extra)
    with pytest.raises(TypeError) as info:
        Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), args)
    code = _hf_right_code(str(info.value))
    assert "weight_decay=0.1" in code and "accumulate=2" in code and "clip_by_global_norm(1.0)" in code
    rng = np.random.default_rng(0)
    train_arrays = (rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32))
    scope = {"ft": ft, "model": ft.nn.Dense(3, 1, key=jax.random.key(0)), "loss_fn": _mse,
             "train_arrays": train_arrays, "eval_data": None}
    exec(code.replace(".fit(", ".fit(progress=False, data=", 1), scope)
    history = scope["trainer"].history
    assert scope["steps"] == steps == len(history.steps["loss"])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    schedule = transformers.get_scheduler(kind, sgd, num_warmup_steps=warm, num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(schedule.get_last_lr()[0])
        sgd.step()
        schedule.step()
    # float32 rates against Python floats (measured 2.1e-11 on 3e-4, linear)
    np.testing.assert_allclose(history.steps["learning_rate"], rates, rtol=0, atol=2e-10)


def test_a_missing_optimizer_or_loss_is_named():
    from functree.train._setup import MISSING_ARGUMENT

    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    with pytest.raises(TypeError) as info:
        Trainer(model, ft.optim.sgd(0.1))
    assert str(info.value) == MISSING_ARGUMENT.format(what="loss function", wrong="model, optimizer")
    with pytest.raises(TypeError) as info:
        Trainer(model)
    assert str(info.value) == MISSING_ARGUMENT.format(what="optimizer", wrong="model")


class _Frozen(ft.Module):
    """A backbone (Dense, BatchNorm) under a head (BatchNorm, Dense)."""

    backbone: ft.nn.Sequential
    head: ft.nn.Sequential

    def __call__(self, x):
        return self.head(self.backbone(x))


def test_a_submodule_put_in_inference_mode_stays_there_as_torchs_eval():
    """torch's ``model.train(); model.backbone.eval()``: the frozen backbone's BatchNorm
    normalizes with its running statistics and never updates them. The Trainer switched
    every layer back to training (the backbone's running_mean drifted to [1.777 ...] from
    torch's 0); a model with some layer in training mode now trains as given. One wholly in
    inference mode (a fresh one) is still switched to training, as documented."""
    torch = pytest.importorskip("torch")
    k = jax.random.split(jax.random.key(0), 2)
    net = _Frozen(ft.nn.Sequential(ft.nn.Dense(3, 4, key=k[0]), ft.nn.BatchNorm(4, momentum=0.9)),
                  ft.nn.Sequential(ft.nn.BatchNorm(4, momentum=0.9), ft.nn.Dense(4, 1, key=k[1])))
    net = ft.nn.training(net)
    net = net.replace(backbone=ft.nn.inference(net.backbone))
    x = np.random.default_rng(0).normal(size=(3, 8, 3)).astype(np.float32) * 3 + 5
    y = np.zeros((3, 8, 1), np.float32)

    def loss_fn(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    from functree.train._setup import MIXED_MODES

    with pytest.warns(ft.train.TrainingModeWarning) as record:  # kept as given, but a fresh layer looks alike
        Trainer(net, ft.optim.sgd(0.1), loss_fn, wrt="head.*")
    assert str(record[0].message) == MIXED_MODES.format(paths="backbone.layers.1 (BatchNorm)", are="is", them="it",
                                                        wrt_arg=", wrt='head.*'")
    trainer = Trainer(net, ft.optim.sgd(0.1), loss_fn, wrt="head.*", training=False)  # the modes as given
    trainer.fit([(x[i], y[i]) for i in range(3)], epochs=1, progress=False)

    dense, bn_b, bn_h = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, eps=1e-3, momentum=0.1), torch.nn.BatchNorm1d(
        4, eps=1e-3, momentum=0.1)
    with torch.no_grad():
        dense.weight.copy_(torch.tensor(np.asarray(net.backbone.layers[0].weight).T))
        dense.bias.copy_(torch.tensor(np.asarray(net.backbone.layers[0].bias)))
    model = torch.nn.Sequential(torch.nn.Sequential(dense, bn_b), bn_h)  # the head's Dense does not move the stats
    model.train()
    model[0].eval()
    with torch.no_grad():
        for i in range(3):
            model(torch.tensor(x[i]))
    got = trainer.model
    np.testing.assert_allclose(got.backbone.layers[1].running_mean, bn_b.running_mean.numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(got.backbone.layers[1].running_variance, bn_b.running_var.numpy(), rtol=0, atol=0)
    # torch's running_var is unbiased (n / (n - 1)); the means agree to float32 rounding (measured 2.4e-7)
    np.testing.assert_allclose(got.head.layers[0].running_mean, bn_h.running_mean.numpy(), rtol=0, atol=2.4e-6)
    assert not got.backbone.layers[1].training and got.head.layers[0].training
    fresh = Trainer(_Frozen(net.backbone, ft.nn.inference(net.head)), ft.optim.sgd(0.1), loss_fn)
    assert fresh.model.backbone.layers[1].training and fresh.model.head.layers[0].training


class _WeightSumStep(ft.train.TrainStep):
    """step() overridden through super(), adding a key: the weights' sum before the step."""

    def step(self, model, opt_state, batch, key=None, enabled=None):
        new, state, metrics = super().step(model, opt_state, batch, key, enabled)
        return new, state, {**metrics, "wsum": jnp.sum(model["w"])}


class _RenamedStep(ft.train.TrainStep):
    """step() overridden, its keys renamed: as many as the step's own, other names."""

    def step(self, model, opt_state, batch, key=None, enabled=None):
        new, state, metrics = super().step(model, opt_state, batch, key, enabled)
        return new, state, {"double": 2.0 * metrics["loss"], "loss": metrics["loss"],
                            "nonfinite": metrics["nonfinite"]}


def test_an_overridden_step_fills_its_own_columns():
    """The reader traced the step to learn its names only where compute_metrics was
    overridden: a step() adding a key failed with a bare broadcasting error (float32[7] vs
    [6]), one renaming keys wrote its values under the Trainer's names (here "mae" and
    "loss" got double the loss and the loss). Against numpy: the model does not move (lr 0)."""
    x = np.random.default_rng(0).normal(size=(3, 4, 2)).astype(np.float32)
    w = np.array([0.5, -1.0], np.float32)

    def loss_fn(m, b):
        return jnp.mean((b @ m["w"] - 1.0) ** 2)

    losses = [np.mean((x[i] @ w - 1.0) ** 2) for i in range(3)]
    opt = ft.optim.sgd(0.0)
    t = Trainer({"w": jnp.asarray(w)}, opt, loss_fn, train_step=_WeightSumStep(loss_fn, opt))
    t.fit([x[i] for i in range(3)], epochs=1, progress=False)
    np.testing.assert_allclose(t.history.steps["loss"], losses, rtol=0, atol=1e-6)
    np.testing.assert_allclose(t.history.steps["wsum"], [w.sum()] * 3, rtol=0, atol=0)
    mae = {"mae": lambda out: jnp.mean(jnp.abs(out.batch @ out.model["w"] - 1.0))}
    t = Trainer({"w": jnp.asarray(w)}, opt, loss_fn, train_step=_RenamedStep(loss_fn, opt, metrics=mae))
    t.fit([x[i] for i in range(3)], epochs=1, progress=False)
    np.testing.assert_allclose(t.history.steps["loss"], losses, rtol=0, atol=1e-6)
    np.testing.assert_allclose(t.history.steps["double"], np.multiply(losses, 2), rtol=0, atol=2e-6)
    assert "mae" not in t.history.steps


class _Head(ft.Module):
    """A backbone (Dense, BatchNorm) under a Dense head: no layer of the head has a mode."""

    backbone: ft.nn.Sequential
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.backbone(x))


def _head_only():
    """The user's ``model.train(); model.backbone.eval()`` in functree: wholly in inference
    mode (the head has no mode), so it looks like a freshly built model."""
    backbone = ft.nn.Sequential(ft.nn.Dense(3, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4, momentum=0.9))
    net = _Head(backbone, ft.nn.Dense(4, 1, key=jax.random.key(1)))  # pyright: ignore[reportCallIssue]
    net = ft.nn.training(net)
    return net.replace(backbone=ft.nn.inference(net.backbone))


def _torch_head_only(torch, net, x, y, backbone_eval):
    """torch's fine-tuning of the head with SGD(0.01), the backbone in eval or train mode."""
    dense, bn, head = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, eps=1e-3, momentum=0.1), torch.nn.Linear(4, 1)
    with torch.no_grad():
        for t, f in ((dense, net.backbone.layers[0]), (head, net.head)):
            t.weight.copy_(torch.tensor(np.asarray(f.weight).T))
            t.bias.copy_(torch.tensor(np.asarray(f.bias)))
    model = torch.nn.Sequential(dense, bn, head)
    model.train()
    if backbone_eval:
        dense.eval()
        bn.eval()
    for p in (*dense.parameters(), *bn.parameters()):
        p.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    for i in range(len(x)):
        opt.zero_grad()
        torch.mean((model(torch.tensor(x[i])) - torch.tensor(y[i])) ** 2).backward()
        opt.step()
    return bn, head


def test_training_false_trains_a_model_wholly_in_inference_as_given_as_torchs_backbone_eval():
    """``ft.nn.training(net).replace(backbone=ft.nn.inference(net.backbone))`` with a Dense
    head is wholly in inference mode, so the Trainer switched it to training and the frozen
    backbone's running_mean drifted to [1.653 -0.923 ...] where torch's ``backbone.eval()``
    keeps 0. ``training=False`` trains it in the modes given: the statistics stay 0 bit for
    bit and the head trains as torch's."""
    torch = pytest.importorskip("torch")
    net = _head_only()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8, 3)).astype(np.float32) * 3 + 5
    y = rng.normal(size=(3, 8, 1)).astype(np.float32)
    trainer = Trainer(net, ft.optim.sgd(0.01), _mse, wrt="head.*", training=False)
    trainer.fit([(x[i], y[i]) for i in range(3)], epochs=1, progress=False)
    bn, head = _torch_head_only(torch, net, x, y, backbone_eval=True)
    got = trainer.model
    assert not got.backbone.layers[1].training
    np.testing.assert_array_equal(got.backbone.layers[1].running_mean, bn.running_mean.numpy())  # 0 both
    np.testing.assert_array_equal(got.backbone.layers[1].running_mean, np.zeros(4, np.float32))
    np.testing.assert_array_equal(got.backbone.layers[1].running_variance, bn.running_var.numpy())  # 1 both
    moved = np.abs(np.asarray(got.head.weight) - np.asarray(net.head.weight)).max()
    assert moved > 1e-3  # the head trained
    # float32 rounding of two implementations of one computation (measured 3.2e-8, weights ~0.5)
    np.testing.assert_allclose(got.head.weight, head.weight.detach().numpy().T, rtol=0, atol=3e-7)
    np.testing.assert_allclose(got.head.bias, head.bias.detach().numpy(), rtol=0, atol=3e-7)


def test_switching_a_model_whose_frozen_batchnorm_records_state_warns_with_both_fixes():
    """The default switch of a model wholly in inference mode, with a BatchNorm outside
    ``wrt``, names the layer and the two fixes; the explicit ``ft.nn.training(model)``
    (torch's ``model.train()``: the statistics update) is silent and matches torch."""
    from functree.train._setup import FROZEN_STATE_SWITCHED, FrozenStateWarning

    torch = pytest.importorskip("torch")
    net = _head_only()
    with pytest.warns(FrozenStateWarning) as record:
        Trainer(net, ft.optim.sgd(0.01), _mse, wrt="head.*")
    keep = ("            model = ft.nn.training(model)\n"
            "            model = ft.set(model, 'backbone', ft.nn.inference(ft.get(model, 'backbone')))\n"
            "            ft.train.Trainer(model, opt, loss_fn, wrt='head.*', training=False)")
    assert str(record[0].message) == FROZEN_STATE_SWITCHED.format(
        paths="backbone.layers.1 (BatchNorm)", its="its", wrt="head.*", parts="backbone",
        torch_eval="model.backbone.eval()", keep=keep, wrt_arg=", wrt='head.*'")
    assert issubclass(FrozenStateWarning, ft.train.TrainingModeWarning)  # one filter silences every mode guess
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 8, 3)).astype(np.float32) * 3 + 5
    y = rng.normal(size=(3, 8, 1)).astype(np.float32)
    trainer = Trainer(ft.nn.training(net), ft.optim.sgd(0.01), _mse, wrt="head.*")  # silent (filterwarnings=error)
    trainer.fit([(x[i], y[i]) for i in range(3)], epochs=1, progress=False)
    bn, _ = _torch_head_only(torch, net, x, y, backbone_eval=False)
    # float32 rounding of the batch means (measured 1.2e-7 on values up to 1.8)
    np.testing.assert_allclose(trainer.model.backbone.layers[1].running_mean, bn.running_mean.numpy(), rtol=0,
                               atol=1.2e-6)
    Trainer(net, ft.optim.sgd(0.01), _mse, wrt=("head.*", "backbone.layers.1.*"))  # the BatchNorm trained
    Trainer(net, ft.optim.sgd(0.01), _mse, wrt="head.*", training=True)  # said explicitly


def test_training_takes_none_or_a_bool():
    from functree.train._setup import BAD_TRAINING

    with pytest.raises(TypeError) as info:
        Trainer(_head_only(), ft.optim.sgd(0.01), _mse, training="eval")  # pyright: ignore[reportArgumentType]
    assert str(info.value) == BAD_TRAINING.format(given="eval")


class _Tuned(ft.Module):
    """A backbone (Dense, BatchNorm) under a head that takes the Dropout key."""

    backbone: ft.nn.Sequential
    head: ft.nn.Sequential

    def __call__(self, x, *, key=None):
        return self.head(self.backbone(x), key=key)


def _tuned(head_dropout=0.5):
    backbone = ft.nn.Sequential(ft.nn.Dense(3, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4, momentum=0.9))
    head = ft.nn.Sequential(ft.nn.Dropout(head_dropout), ft.nn.Dense(4, 1, key=jax.random.key(1)))
    return _Tuned(backbone, head)  # pyright: ignore[reportCallIssue]


def _keyed_mse(m, b, key):
    return jnp.mean((m(b[0], key=key) - b[1]) ** 2)


def _numpy_forward(net, x, batch_statistics):
    """Dense -> BatchNorm (batch or running statistics, eps 1e-3) -> Dense, no dropout."""
    dense, bn, head = net.backbone.layers[0], net.backbone.layers[1], net.head.layers[1]
    h = x @ np.asarray(dense.weight) + np.asarray(dense.bias)
    mean, var = (h.mean(0), h.var(0)) if batch_statistics else (np.asarray(bn.running_mean),
                                                                 np.asarray(bn.running_variance))
    h = (h - mean) / np.sqrt(var + 1e-3) * np.asarray(bn.scale) + np.asarray(bn.offset)
    return h @ np.asarray(head.weight) + np.asarray(head.bias)


def _torch_tuned(torch, net, backbone_eval, dropout):
    """torch's copy of ``_tuned()``: ``model.train()``, optionally ``model[1].eval()``
    (the BatchNorm), its statistics and parameters copied."""
    dense, bn, head = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, eps=1e-3, momentum=0.1), torch.nn.Linear(4, 1)
    f_dense, f_bn, f_head = net.backbone.layers[0], net.backbone.layers[1], net.head.layers[1]
    with torch.no_grad():
        for t, f in ((dense, f_dense), (head, f_head)):
            t.weight.copy_(torch.tensor(np.asarray(f.weight).T))
            t.bias.copy_(torch.tensor(np.asarray(f.bias)))
        bn.weight.copy_(torch.tensor(np.asarray(f_bn.scale)))
        bn.bias.copy_(torch.tensor(np.asarray(f_bn.offset)))
        bn.running_mean.copy_(torch.tensor(np.asarray(f_bn.running_mean)))
        bn.running_var.copy_(torch.tensor(np.asarray(f_bn.running_variance)))
    model = torch.nn.Sequential(dense, bn, torch.nn.Dropout(dropout), head)
    model.train()
    if backbone_eval:
        bn.eval()
    return model


def _printed_fix(message, first, model, **names):
    """Run the fix a warning prints, from the line after ``first`` to its Trainer call,
    with ``model`` and the names it uses (the user's own ``key=`` added to the call): the
    trainer it builds."""
    lines = message.split("\n")
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(first)) + 1
    end = next(i for i in range(start, len(lines)) if "ft.train.Trainer(" in lines[i])
    code = "\n".join(line[12:] for line in lines[start:end + 1])  # the block's 12-space indent
    code = code.replace("ft.train.Trainer(", "trainer = ft.train.Trainer(", 1)[:-1] + ", key=jax.random.key(2))"
    scope = {"ft": ft, "jax": jax, "model": model, **names}
    exec(code, scope)
    return scope["trainer"]


def _loaded(net, mean, variance):
    """``net`` with its backbone BatchNorm's statistics loaded (a pretrained model's)."""
    bn = net.backbone.layers[1].replace(running_mean=jnp.asarray(mean), running_variance=jnp.asarray(variance))
    return ft.set(net, "backbone.layers.1", bn)


def test_a_fresh_head_on_a_trained_backbone_warns_with_both_fixes():
    """Transfer learning: ``Tuned(trained.backbone, fresh_head)``, the backbone from a
    Trainer (training mode), the head built fresh (inference mode). The Trainer kept the
    modes as given and the head's Dropout was silently off (torch's fresh Dropout trains).
    It now warns, naming the layer, and both fixes do what they say: ``training=True``
    trains the Dropout (the loss moves off the no-dropout loss numpy computes),
    ``training=False`` keeps it off (the loss is numpy's)."""
    from functree.train._setup import MIXED_MODES

    net = _tuned()
    net = net.replace(backbone=ft.nn.training(net.backbone))  # as a previous Trainer's model holds it
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32) * 2 + 1
    y = rng.normal(size=(64, 1)).astype(np.float32)
    with pytest.warns(ft.train.TrainingModeWarning) as record:
        Trainer(net, ft.optim.sgd(0.0), _keyed_mse, key=jax.random.key(3))
    assert str(record[0].message) == MIXED_MODES.format(paths="head.layers.0 (Dropout)", are="is", them="it",
                                                        wrt_arg="")
    assert "training=True" in str(record[0].message) and "training=False" in str(record[0].message)
    expected = np.mean((_numpy_forward(net, x, batch_statistics=True) - y) ** 2)
    losses = {}
    for training in (True, False):
        trainer = Trainer(net, ft.optim.sgd(0.0), _keyed_mse, key=jax.random.key(3), training=training)
        assert trainer.model.head.layers[0].training is training
        losses[training] = trainer.fit([(x, y)], epochs=1, progress=False).steps["loss"][0]
    # float32 rounding of one computation (measured 1.2e-7 on a loss ~1.2)
    np.testing.assert_allclose(losses[False], expected, rtol=0, atol=1e-6)
    assert abs(losses[True] - expected) > 1e-3  # half the head's inputs dropped (measured 0.046 off)


def test_the_printed_frozen_state_fix_keeps_the_statistics_and_trains_the_dropout():
    """FrozenStateWarning's fix was ``training=False``, which also left a fresh head's
    Dropout in inference (torch's ``model.train(); backbone.eval()`` trains it). The fix
    it prints now builds that: run as printed, the head's Dropout trains and the backbone's
    loaded BatchNorm statistics stay bit for bit, as torch's."""
    from functree.train._setup import FrozenStateWarning

    torch = pytest.importorskip("torch")
    net = _loaded(_tuned(), [1.0, -2.0, 0.5, 3.0], [2.0, 0.5, 1.5, 4.0])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 16, 3)).astype(np.float32) * 2 + 1
    y = rng.normal(size=(3, 16, 1)).astype(np.float32)
    opt = ft.optim.sgd(0.1)
    with pytest.warns(FrozenStateWarning) as record:  # one warning: the loaded statistics are its layer's
        Trainer(net, opt, _keyed_mse, wrt="head.*", key=jax.random.key(2))
    assert len(record) == 1
    trainer = _printed_fix(str(record[0].message), "keep them", net, opt=opt, loss_fn=_keyed_mse)  # silent
    assert trainer.model.head.layers[0].training and not trainer.model.backbone.layers[1].training
    history = trainer.fit([(x[i], y[i]) for i in range(3)], epochs=1, progress=False)
    model = _torch_tuned(torch, net, backbone_eval=True, dropout=0.5)
    with torch.no_grad():
        for i in range(3):
            model(torch.tensor(x[i]))
    bn = trainer.model.backbone.layers[1]
    np.testing.assert_array_equal(bn.running_mean, model[1].running_mean.numpy())  # the loaded values, both
    np.testing.assert_array_equal(bn.running_variance, model[1].running_var.numpy())
    no_dropout = np.mean((_numpy_forward(net, x[0], batch_statistics=False) - y[0]) ** 2)
    assert abs(history.steps["loss"][0] - no_dropout) > 1e-3  # the head's Dropout trained


def test_switching_a_model_with_loaded_batchnorm_statistics_warns_and_the_fixes_match_torch():
    """``model.train(); model.backbone.eval()`` of a pretrained net with a Dense head is
    wholly in inference mode; the Trainer switched it to training silently and the loaded
    running_mean drifted where torch's ``eval()`` keeps it. Loaded (not 0 / 1) statistics
    now warn; a fresh model does not. The printed fix trains as torch's
    ``model.train(); bn.eval()`` (every parameter, statistics kept bit for bit);
    ``training=True`` as torch's ``model.train()``."""
    import warnings

    from functree.train._setup import LOADED_STATE_SWITCHED

    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(_head_only(), ft.optim.sgd(0.01), _mse)  # fresh statistics: no warning
    net = _loaded(_tuned(0.0), [1.0, -2.0, 0.5, 3.0], [2.0, 0.5, 1.5, 4.0])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 16, 3)).astype(np.float32) * 2 + 1
    y = rng.normal(size=(3, 16, 1)).astype(np.float32)
    opt = ft.optim.sgd(0.05)
    with pytest.warns(ft.train.TrainingModeWarning) as record:
        Trainer(net, opt, _keyed_mse, key=jax.random.key(2))
    message = str(record[0].message)
    assert message.startswith(LOADED_STATE_SWITCHED.split("{")[0] + "backbone.layers.1 (BatchNorm) holds")
    for backbone_eval in (True, False):
        if backbone_eval:
            trainer = _printed_fix(message, "keep them", net, opt=opt, loss_fn=_keyed_mse)
        else:
            trainer = _printed_fix(message, "update them", net, opt=opt, loss_fn=_keyed_mse)
        trainer.fit([(x[i], y[i]) for i in range(3)], epochs=1, progress=False)
        model = _torch_tuned(torch, net, backbone_eval, dropout=0.0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        for i in range(3):
            sgd.zero_grad()
            torch.mean((model(torch.tensor(x[i])) - torch.tensor(y[i])) ** 2).backward()
            sgd.step()
        got = trainer.model
        bn = got.backbone.layers[1]
        assert bn.training is not backbone_eval
        if backbone_eval:
            np.testing.assert_array_equal(bn.running_mean, model[1].running_mean.numpy())  # as loaded
            np.testing.assert_array_equal(bn.running_variance, model[1].running_var.numpy())
        else:  # torch's running_var is unbiased; the means agree to float32 rounding (measured 2.4e-7)
            np.testing.assert_allclose(bn.running_mean, model[1].running_mean.numpy(), rtol=0, atol=2.4e-6)
        # float32 rounding of two implementations of three SGD steps (measured <= 2.6e-8 on weights <= 1)
        np.testing.assert_allclose(got.backbone.layers[0].weight, model[0].weight.detach().numpy().T, rtol=0,
                                   atol=1e-6)
        np.testing.assert_allclose(bn.scale, model[1].weight.detach().numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.head.layers[1].weight, model[3].weight.detach().numpy().T, rtol=0, atol=1e-6)


# --- log_every across epochs, accumulate with a short last minibatch -------------------
LX = RNG.normal(size=(22, 2)).astype(np.float32)  # minibatches of 5: 5, 5, 5, 5, 2 per epoch
LY = (LX @ np.array([1.0, -1.0], np.float32)).astype(np.float32)


def _linear(model, batch):
    return jnp.mean((batch[0] @ model["w"] - batch[1]) ** 2)


def _log_run(trainer, epochs, logs, **fit):
    data = ft.train.batches((LX, LY), 5, key=jax.random.key(0))
    return trainer.fit(data, epochs=epochs, log_every=7, progress=False, **fit,
                       callbacks=[lambda c: logs.append((c.step, c.metrics["loss"])) if c.event == "log" else None])


def test_log_every_counts_the_jobs_steps_across_epoch_ends_and_resumes_exactly(tmp_path):
    """log_every=7 with 5 steps per epoch: the count restarted at every epoch end, so on_log
    never fired (CSV every="log", TensorBoard step/*: empty). It now counts the job's steps
    (Lightning's log_every_n_steps, HF's logging_steps): steps 7, 14, 21, 28, each the
    size-weighted mean of its 7 steps (a window spanning epoch ends); a job saved at step
    12 and restored logs the same steps with the same values."""
    logs = []
    history = _log_run(Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), _linear), 6, logs)
    assert [s for s, _ in logs] == [7, 14, 21, 28]
    sizes, losses = np.tile([5, 5, 5, 5, 2], 6), np.array(history.steps["loss"])
    expected = [np.dot(sizes[s - 7:s], losses[s - 7:s]) / sizes[s - 7:s].sum() for s in (7, 14, 21, 28)]
    # products n·v in float32 (measured 2.2e-8 off on 0.87)
    np.testing.assert_allclose([v for _, v in logs], expected, rtol=0, atol=2e-7)
    first, resumed = [], []
    trainer = Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), _linear)
    trainer.fit(ft.train.batches((LX, LY), 5, key=jax.random.key(0)), steps=12, log_every=7, progress=False,
                callbacks=[lambda c: first.append((c.step, c.metrics["loss"])) if c.event == "log" else None])
    assert trainer.since_log == 5  # (steps 8-12: the window spans the epoch end at step 10)
    trainer.save(str(tmp_path / "ckpt"))
    _log_run(Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), _linear).restore(str(tmp_path / "ckpt")), 6, resumed)
    assert first + resumed == logs  # the same steps, bit for bit


def test_accumulate_with_a_short_last_minibatch_is_refused_with_the_trainers_fix():
    """Optimizer(accumulate=4), 70 rows in minibatches of 16: the last of 6 rows crashed at
    the end of epoch 1 with opt.minimize's fix. Refused before the first step (the data's
    sizes are known), with drop_last=True; minibatches of unknown sizes at their step."""
    from functree.train._epochs import ACCUMULATE_UNEVEN

    x = np.random.default_rng(3).normal(size=(70, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0], np.float32)).astype(np.float32)

    def make():
        return Trainer({"w": jnp.zeros(2)}, ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=4), _linear)

    trainer = make()
    with pytest.raises(ValueError) as info:
        trainer.fit(ft.train.batches((x, y), 16), epochs=2, progress=False)
    assert str(info.value) == ACCUMULATE_UNEVEN.format(
        k=4, which="the last minibatch of each epoch (70 examples in minibatches of 16)", rows=6,
        when=" (refused before the first step)", wrong="ft.train.batches(data, 16)",
        right="ft.train.batches(data, 16, drop_last=True)",
        note="   # the last 6 examples of each shuffled epoch left out")
    assert trainer.steps_run == 0
    trainer.fit(ft.train.batches((x, y), 16), steps=4, progress=False)  # steps= short of the 6 rows: runs
    assert trainer.steps_run == 4
    trainer = make()
    with pytest.raises(ValueError, match=r"each minibatch \(batch_size=6\) has 6 examples"):
        trainer.fit(ft.train.batches((x, y), 6, drop_last=True), epochs=2, progress=False)
    data = ft.train.batches((x, y), 16, drop_last=True, key=jax.random.key(1))  # the fix, run
    trainer.fit(data, epochs=2, progress=False)
    w = np.zeros(2)  # reference: SGD on the mean gradient of each whole minibatch
    for epoch in range(2):
        for xb, yb in data.iterate(epoch):
            w = w - 0.1 * 2 * xb.T.astype(np.float64) @ (xb @ w - yb) / len(xb)
    np.testing.assert_allclose(np.asarray(trainer.model["w"]), w, rtol=0, atol=1e-6)
    listed = make()  # sizes known only as they come: the step that would fail
    with pytest.raises(ValueError, match=r"minibatch 2 of epoch 0 \(counted from 0\) has 6 examples.*step 3 was not"):
        listed.fit([(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:38], y[32:38])], epochs=1, progress=False)
    assert listed.steps_run == 2


def test_a_frozen_attention_is_not_named_as_running_statistics_that_training_changes():
    """session 60: a head fine-tuned on a frozen backbone with attention (every HF port, from
    with_head's documented recipe) warned FrozenStateWarning that "the running statistics of
    ...attn (MultiheadAttention) will change at every step": its no_derivative fields are
    per-layer configuration (logit scale, window), never recorded; only a BatchNorm is named."""
    import warnings

    from functree.train._setup import FrozenStateWarning

    class Backbone(ft.Module):
        attn: ft.nn.MultiheadAttention
        norm: Any

        def __call__(self, x):
            h = self.attn(x, x, x)
            return h if self.norm is None else self.norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)

    class Net(ft.Module):
        backbone: Backbone
        head: ft.nn.Dense

        def __call__(self, x):
            return self.head(self.backbone(x))

    attn = ft.nn.MultiheadAttention(4, 2, key=jax.random.key(0))
    attn = attn.replace(logit_scale=jnp.float32(0.5))  # a per-layer scale leaf, as GPT-2's
    head = ft.nn.Dense(4, 1, key=jax.random.key(1))
    loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = Trainer(Net(Backbone(attn, None), head), ft.optim.sgd(0.1), loss, wrt="head.*")
    x, y = np.ones((2, 3, 4), np.float32), np.zeros((2, 3, 1), np.float32)
    trainer.fit([(x, y)], epochs=1, progress=False)
    assert float(trainer.model.backbone.attn.logit_scale) == 0.5  # nothing recorded into it
    with pytest.warns(FrozenStateWarning) as record:
        Trainer(Net(Backbone(attn, ft.nn.BatchNorm(4)), head), ft.optim.sgd(0.1), loss, wrt="head.*")
    assert "the running statistics of backbone.norm (BatchNorm) will change" in str(record[0].message)


def test_a_model_of_other_arrays_assigned_between_fits_is_refused_at_the_assignment():
    """A notebook: ``trainer.model = Other(...)`` between fits. The next fit failed at its
    first step with the optimizer's state error prefixed as "minibatch 0 ... failed in the
    training step" (the data was fine), one of them saying "The model did not change". A model
    of the job's arrays, its values changed, is taken as before."""
    trainer = Trainer(mlp(), adam(), regress)
    trainer.fit((X, Y), steps=1, batch_size=16, progress=False)
    wider = ft.nn.Sequential(ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(1)), ft.nn.Dense(4, 2, key=jax.random.key(2)))
    others = {"model.layers[0].weight has shape (3, 4), the job's (3, 8)": wider,
              "the job's model.layers[0].weight, model.layers[0].bias, model.layers[1].weight ... missing; "
              "model.weight, model.bias added": ft.nn.Dense(3, 2, key=jax.random.key(1))}
    for detail, other in others.items():
        with pytest.raises(ValueError) as info:
            trainer.model = other
        assert f"the new model's arrays are not the job's: {detail}" in str(info.value)
        assert "right:  trainer = ft.train.Trainer(new_model, optimizer, loss_fn)" in str(info.value)
    trainer.model = jax.tree.map(lambda w: 0.5 * w, trainer.model)  # the same arrays
    trainer.fit((X, Y), steps=2, batch_size=16, progress=False)
    assert trainer.steps_run == 2


def test_a_model_with_a_static_value_changed_between_fits_trains_on_with_the_jobs_moments():
    """``trainer.model = trainer.model.replace(activation=jnp.tanh)`` between fits: the next
    fit failed at its first step, as "minibatch 0 ... failed in the training step", with the
    optimizer's state error and a hand loop's fix (the state holds the old structure). The
    assignment now carries the state over (the same arrays under the new structure): the
    next steps are a hand loop's that carries the moments over as that error says."""
    model = ft.nn.MLP(3, 1, 8, 1, key=jax.random.key(0))
    trainer = Trainer(model, adam(), regress)
    trainer.fit((X, Y), steps=2, batch_size=64, progress=False)
    before = jax.tree.leaves(trainer.opt_state)
    trainer.model = trainer.model.replace(activation=jnp.tanh)
    assert all(a is b for a, b in zip(jax.tree.leaves(trainer.opt_state), before, strict=True))
    start, state = jax.tree.map(jnp.copy, (trainer.model, trainer.opt_state))  # (fit donates them)
    trainer.fit((X, Y), steps=4, batch_size=64, progress=False)
    opt = trainer.optimizer  # the hand loop: the same steps from the same moments
    for _ in range(2):
        start, state, _ = opt.minimize(regress, start, state, (X, Y))  # (a whole epoch: its order sums alike)
    for got, want in zip(jax.tree.leaves(trainer.model), jax.tree.leaves(start), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
