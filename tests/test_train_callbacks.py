"""Callbacks: the learning context they see, early stopping, plateau, checkpoints, logs."""

import json
import logging
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train import Trainer

RNG = np.random.default_rng(1)
X = RNG.normal(size=(48, 2)).astype(np.float32)
Y = (X @ np.array([[2.0], [-1.0]], np.float32)).astype(np.float32)


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def make(lr=0.05):
    return Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)),
                   ft.optim.Optimizer(ft.optim.sgd(lr)), loss_fn)


def data():
    return ft.train.batches((X, Y), 16, key=jax.random.key(2))  # 3 steps per epoch


def test_function_callback_sees_the_learning_context():
    seen = []
    make().fit(data(), epochs=2, log_every=2, progress=False, callbacks=[seen.append])
    events = [(c.event, c.step, c.sweep, c.samples_seen) for c in seen]
    # log_every counts the job's steps, across epoch ends (Lightning's log_every_n_steps)
    assert events == [("log", 2, 0, 32), ("epoch", 3, 1, 48), ("log", 4, 1, 64), ("log", 6, 1, 96),
                      ("epoch", 6, 2, 96)]
    assert all(c.minibatch_size == 16 and c.learning_rate == pytest.approx(0.05) for c in seen)
    assert set(seen[1].metrics) == {"loss"}


def test_early_stopping_restores_best():
    trainer = make(lr=0.0)  # nothing improves after the first epoch (but for rounding: the
    # epoch means are sums in float64 over another shuffle each epoch, ~1e-8 apart)
    stop = ft.train.EarlyStopping(monitor="loss", patience=2, restore_best=True, min_delta=1e-6)
    history = trainer.fit(data(), epochs=20, progress=False, callbacks=[stop])
    assert len(history.epochs["epoch"]) == 3 and stop.stopped_epoch == 3
    assert trainer.stop_training and stop.best_model is not None


def test_a_monitoring_callback_of_another_trainers_job_is_refused_not_carried_into_the_new_job(tmp_path):
    """A notebook: ``stop`` and ``reduce`` made in one cell, the Trainer cell run again with a
    slower rate. The callbacks kept the first job's best loss: the new job stopped after 2
    epochs, its rate cut twice to 0.0125, and it ended with the first job's best model as its
    own, silently. Refused before any step; the same trainer's later fit, a new callback and
    a restored job's state go on."""
    from functree.train._callbacks import ANOTHER_JOB

    def callbacks():
        return [ft.train.EarlyStopping(monitor="loss", patience=2, restore_best=True),
                ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1)]

    first, used = make(lr=0.1), callbacks()
    first.fit(data(), epochs=2, progress=False, callbacks=[*used, ft.train.ModelCheckpoint(tmp_path / "run")])
    first.fit(data(), epochs=3, progress=False, callbacks=used)  # the same job goes on
    assert "wrong:" in ANOTHER_JOB and "right:" in ANOTHER_JOB
    for cb, effect in zip(used, ("given that job's best model", "its learning rate cut")):
        again = make(lr=0.01)
        with pytest.raises(ValueError, match=rf"(?s){type(cb).__name__}\(monitor='loss'\) was given to the fit of a "
                                             rf"Trainer other than.*best loss [0-9.]+.*{effect}"):
            again.fit(data(), epochs=3, progress=False, callbacks=[cb])
        assert again.steps_run == 0
    fresh = make(lr=0.01)
    fresh.fit(data(), epochs=3, progress=False, callbacks=callbacks())
    assert fresh.epoch == 3 and float(ft.optim.hyperparameters(fresh.opt_state)["learning_rate"]) == pytest.approx(0.01)
    restored = make(lr=0.1).restore(tmp_path / "run")  # the saved states are loaded into them: the job's own
    restored.fit(data(), epochs=3, progress=False, callbacks=used)
    assert restored.epoch == 3


def test_an_unknown_attribute_of_a_callback_is_refused_and_its_right_line_stops_early(tmp_path):
    # stop.min_delta = ... (the monitor's, read from its own record) and a typo made attributes
    # nothing read: the run went on as if neither was set
    stop = ft.train.EarlyStopping(monitor="loss", patience=1)
    with pytest.raises(AttributeError, match=r"(?s)EarlyStopping has no setting 'min_delta': it is an argument of "
                                             r"ft\.train\.EarlyStopping\(\.\.\.\).*right:  callback = "
                                             r"ft\.train\.EarlyStopping\(monitor, min_delta=10\.0\)$"):
        stop.min_delta = 10.0
    with pytest.raises(AttributeError, match=r"(?s)no setting 'patiance' \(did you mean 'patience'\?\).*"
                                             r"right:  callback\.patience = 1$"):
        stop.patiance = 1
    stop.patience = 1  # its settings take values
    trainer = make()
    monitor = "loss"  # the right line's placeholder, as the user's code names it
    callback = eval("ft.train.EarlyStopping(monitor, min_delta=10.0)", {"ft": ft, "monitor": monitor})
    trainer.fit(data(), epochs=7, progress=False, callbacks=[callback])
    assert trainer.epoch == 6 and callback.stopped_epoch == 6  # none improves on the first by 10: 5 waited
    save = ft.train.ModelCheckpoint(tmp_path / "ckpt")
    with pytest.raises(AttributeError, match=r"right:  callback = ft\.train\.ModelCheckpoint\(directory, "
                                             r"max_to_keep=5\)$"):
        save.max_to_keep = 5

    class Mine(ft.train.EarlyStopping):  # a user's subclass: its names are its own
        pass

    mine = Mine(monitor="loss")
    mine.seen = []


def test_reduce_lr_on_plateau_without_recompiling():
    trainer = make(lr=0.0)
    reduce = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1)
    trainer.fit(data(), epochs=5, progress=False, callbacks=[reduce])
    lr = float(ft.optim.hyperparameters(trainer.opt_state)["learning_rate"])
    assert lr == 0.0  # 0 * 0.5
    trainer = make(lr=0.4)
    reduce = ft.train.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_delta=1e9)
    history = trainer.fit(data(), epochs=3, validation_data=(X, Y), progress=False, callbacks=[reduce])
    assert history.steps["learning_rate"][0] == pytest.approx(0.4)
    # epoch 1 improves (from inf), epochs 2 and 3 do not: halved after each
    assert history.steps["learning_rate"][3:6] == [pytest.approx(0.4)] * 3
    assert history.steps["learning_rate"][-1] == pytest.approx(0.2)
    assert float(ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]) == pytest.approx(0.1)
    assert trainer.train_step._compiled._cache_size() == 1


def test_reduce_lr_on_plateau_counts_the_epoch_that_ends_the_cooldown_as_keras():
    """Keras decrements the cooldown and then counts the same epoch toward patience: with
    patience 1 and cooldown 1 on a loss that never improves after epoch 1, the rate halves
    after epochs 2 and 3 (functree waited one epoch more: after 2 and 4)."""
    trainer = make(lr=0.4)
    reduce = ft.train.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, cooldown=1, min_delta=1e9)
    history = trainer.fit(data(), epochs=4, validation_data=(X, Y), progress=False, callbacks=[reduce])
    per_epoch = history.steps["learning_rate"][::3]  # 3 steps an epoch: each epoch's first step
    assert per_epoch == [pytest.approx(r) for r in (0.4, 0.4, 0.2, 0.1)]
    assert float(ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]) == pytest.approx(0.05)


def test_reduce_lr_on_plateau_never_raises_a_rate_below_min_lr():
    """A rate already below min_lr was set to max(rate * factor, min_lr): min_lr=1e-3 on
    sgd(1e-5) multiplied it by 100 at the first plateau. Keras reduces only a rate above
    min_lr (torch: only where it falls); a group below it keeps its rate, the others halve."""
    model = {"body": jnp.zeros((2, 1)), "head": jnp.zeros(1)}
    tx = ft.optim.groups({"body": ft.optim.sgd(1e-5), "head": ft.optim.sgd(0.4)})
    trainer = Trainer(model, ft.optim.Optimizer(tx), lambda m, b: jnp.mean((b[0] @ m["body"] + m["head"][None, :] - b[1]) ** 2))
    reduce = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=1e-3)
    history = trainer.fit(data(), epochs=3, progress=False, callbacks=[reduce])
    assert history.steps["body/learning_rate"] == [pytest.approx(1e-5, rel=1e-6)] * 9
    assert history.steps["head/learning_rate"] == [pytest.approx(r) for r in [0.4] * 6 + [0.2] * 3]
    single = make(lr=1e-5)
    floor = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=1e-3)
    history = single.fit(data(), epochs=3, progress=False, callbacks=[floor])
    assert history.steps["learning_rate"] == [pytest.approx(1e-5, rel=1e-6)] * 9
    assert floor.state_dict()["wait"] == 2  # Keras: no reduction, so no reset of the wait


def test_model_checkpoint_keeps_best_and_history_logger(tmp_path):
    trainer = make()
    save = ft.train.ModelCheckpoint(tmp_path / "ckpt", max_to_keep=1, best_metric="val_loss")
    log = ft.train.HistoryLogger(tmp_path / "log.jsonl")
    trainer.fit(data(), epochs=3, validation_data=(X, Y), progress=False, callbacks=[save, log])
    assert save.manager.all_steps() == [9]  # improving: the best is the last
    ckpt = save.manager.restore()
    assert ckpt.config["trainer"]["epoch"] == 3 and "val_loss" in ckpt.metrics
    np.testing.assert_array_equal(ckpt.model.weight, trainer.model.weight)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["epoch"] * 3
    assert records[-1]["samples_seen"] == 144


def test_a_history_logger_of_a_new_job_starts_its_file_anew_as_the_csv_logger(tmp_path):
    """A notebook's Trainer cell run again with ``HistoryLogger(path)``: the new job's records
    followed the old job's in the file (steps 3, 6, 3 read as one history), where a CSVLogger
    starts anew. A new job starts it anew; a restored job, the same job's next fit and
    append=True continue it."""
    path = tmp_path / "log.jsonl"

    def fit(trainer, epochs, **options):
        trainer.fit(data(), epochs=epochs, progress=False, callbacks=[ft.train.HistoryLogger(path, **options)])
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    make().fit(data(), epochs=1, progress=False,
               callbacks=[ft.train.HistoryLogger(path), ft.train.ModelCheckpoint(tmp_path / "run")])
    assert fit(make().restore(tmp_path / "run"), 2) == [3, 6]  # the restored job goes on
    again = make()  # the Trainer cell run again: a new job
    assert fit(again, 1) == [3]
    assert fit(again, 2) == [3, 6]  # its next fit goes on
    assert fit(make(), 1, append=True) == [3, 6, 3]


def test_model_checkpoint_from_a_path_writes_asynchronously_and_every_step_restores(tmp_path):
    # ModelCheckpoint(path, asynchronous=True) was a TypeError: an asynchronous manager had to
    # be built by hand. Each checkpoint, written while the next steps ran, holds its own step.
    save = ft.train.ModelCheckpoint(tmp_path / "ckpt", every_steps=2, max_to_keep=None, asynchronous=True)
    make().fit(data(), epochs=2, progress=False, callbacks=[save])
    save.manager.wait_until_finished()
    assert save.manager._asynchronous and save.manager.all_steps() == [2, 4, 6]
    for step in (2, 4, 6):  # the same job run to that step alone
        alone = make()
        alone.fit(data(), steps=step, progress=False)
        np.testing.assert_array_equal(save.manager.restore(step).model.weight, alone.model.weight)
    with pytest.raises(ValueError, match=r"(?s)manager given writes synchronously.*CheckpointManager\(path, asynchronous=True\)"):
        ft.train.ModelCheckpoint(ft.train.CheckpointManager(tmp_path / "sync"), asynchronous=True)


def test_every_steps_ranked_by_val_loss_saves_the_epoch_ends_among_its_steps(tmp_path):
    # The step save point ran before validation: val_loss was missing and every step was
    # skipped; the epoch end's was not used with every_steps: the directory stayed empty.
    trainer = make()  # 3 steps an epoch, 12 in all
    saves = {k: ft.train.ModelCheckpoint(tmp_path / f"best{k}", every_steps=k, best_metric="val_loss",
                                         max_to_keep=None) for k in (2, 3)}
    trainer.fit(data(), epochs=4, validation_data=(X, Y), progress=False, callbacks=list(saves.values()))
    assert saves[2].manager.all_steps() == [6, 12] and saves[3].manager.all_steps() == [3, 6, 9, 12]
    val = dict(zip(trainer.history.epochs["last_step"], trainer.history.epochs["val_loss"]))
    for step in (3, 6, 9, 12):  # each ranked by its own model's validation, after the epoch's end
        ckpt = saves[3].manager.restore(step)
        assert ckpt.metrics["val_loss"] == val[step] and ckpt.config["trainer"]["epoch"] == step // 3
    for every in (2, None):  # no validation data: an error at the first epoch end, not an empty directory
        save = ft.train.ModelCheckpoint(tmp_path / f"none{every}", every_steps=every, best_metric="val_loss")
        with pytest.raises(ValueError, match=r"(?s)best_metric='val_loss'.*end of epoch 1 \(step 3\) are "
                                             r"\['loss'\].*right:  trainer.fit\(data, validation_data=val"):
            make().fit(data(), epochs=2, progress=False, callbacks=[save])
        assert save.manager.all_steps() == []


def test_a_ranked_directory_a_fit_wrote_nothing_to_is_logged(tmp_path, caplog):
    # Before: silently empty (val_loss ranks epoch ends; this fit of 2 steps reached none,
    # and with every_steps=2 on 3-step epochs step 6 is the first that ends one).
    saves = [ft.train.ModelCheckpoint(tmp_path / "a", best_metric="val_loss"),
             ft.train.ModelCheckpoint(tmp_path / "b", every_steps=2, best_metric="val_loss")]
    with caplog.at_level(logging.WARNING, logger="functree.train"):
        make().fit(data(), steps=2, validation_data=(X, Y), progress=False, callbacks=saves)
    for name, where in (("a", "epoch ends"), ("b", "the steps 2, 4, ... that end an epoch")):
        assert f"wrote no checkpoint to {tmp_path / name}: a best_metric='val_loss' directory holds the " \
               f"checkpoints whose metric is known ({where}), and this fit reached none (it ended at step 2)" in caplog.text


def test_callback_errors():
    with pytest.raises(ValueError, match=r"(?s)EarlyStopping monitors 'val_loss'.*validation_data=val"):
        make().fit(data(), epochs=1, progress=False, callbacks=[ft.train.EarlyStopping()])
    with pytest.raises(ValueError, match=r'mode must be "min", "max" or None'):
        ft.train.EarlyStopping(mode="lowest")
    with pytest.raises(TypeError, match=r"A callback is a ft.train.Callback"):
        make().fit(data(), epochs=1, progress=False, callbacks=[3])
    trainer = Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)),
                      ft.optim.Optimizer(__import__("optax").sgd(0.1)),
                      loss_fn)
    reduce = ft.train.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=1e9)
    with pytest.raises(ValueError, match=r"no settable learning rate"):
        trainer.fit(data(), epochs=2, progress=False, callbacks=[reduce])


def test_model_checkpoint_every_steps_stores_the_means_of_its_epoch_so_far(tmp_path):
    """A checkpoint at step s carries the means of its epoch's steps up to s (Keras's logs
    there), never another step's, and the same numbers whatever log_every: they were the log
    window's, so a best_metric="loss" directory ranked windows of other lengths and kept
    another best step for each log_every (2 epochs of 8 steps, every_steps=4: step 4 for
    log_every=50, 16 for 3 and 5, where the epochs' means pick 12)."""
    runs = {}
    for every in (2, 3, 50):
        trainer = make()
        save = ft.train.ModelCheckpoint(tmp_path / f"ckpt{every}", every_steps=2, max_to_keep=None)
        history = trainer.fit(data(), epochs=3, log_every=every, progress=False, callbacks=[save])
        steps = save.manager.all_steps()
        assert steps == [2, 4, 6, 8, 9]
        loss = history.steps["loss"]  # 3 minibatches of 16 an epoch: steps 1-3, 4-6, 7-9
        for step in steps:
            first = 3 * ((step - 1) // 3)
            np.testing.assert_allclose(save.manager.restore(step).metrics["loss"], np.mean(loss[first:step]),
                                       rtol=0, atol=1e-6)
        runs[every] = [save.manager.restore(step).metrics for step in steps]
        final = save.manager.restore(9)
        np.testing.assert_array_equal(final.model.weight, trainer.model.weight)
    assert runs[2] == runs[3] == runs[50]


def test_early_stopping_restores_the_best_after_a_full_run(tmp_path):
    # issue 27: restore_best restored only when stopping early; a run that used all its
    # epochs kept the last model
    trainer = make(lr=1.5)  # too large: the loss grows after the first epoch
    models = []

    class Keep(ft.train.Callback):
        def on_epoch_end(self, trainer, context):
            models.append(jax.tree.map(np.asarray, trainer.model))

    stop = ft.train.EarlyStopping(monitor="loss", patience=10, restore_best=True)
    save = ft.train.ModelCheckpoint(tmp_path / "ckpt", every_steps=5, max_to_keep=None)  # after EarlyStopping
    history = trainer.fit(data(), epochs=3, progress=False, callbacks=[Keep(), stop, save])
    best = int(np.argmin(history["loss"]))
    assert stop.stopped_epoch is None and stop.best_epoch == best + 1 and best != 2
    for a, b in zip(jax.tree.leaves(trainer.model), jax.tree.leaves(models[best])):
        np.testing.assert_array_equal(a, b)
    # The final checkpoint holds its own step's model, not the restored best one (the end
    # save runs before every on_train_end; it used to save the best under the last step).
    assert save.manager.all_steps() == [5, trainer.steps_run] and trainer.steps_run % 5
    last = save.manager.restore(trainer.steps_run)
    for a, b in zip(jax.tree.leaves(last.model), jax.tree.leaves(models[-1])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("patience", [1, 10])  # stopped early; all epochs used
def test_restart_recipe_ends_with_the_best_model(tmp_path, patience):
    # D6: the last checkpoint is written before on_train_end sets the best model; a rerun of
    # the restart recipe (restore, then a fit with nothing to train) skipped on_train_end and
    # ended with the last step's model
    def run(trainer):
        stop = ft.train.EarlyStopping(monitor="loss", patience=patience, restore_best=True)
        trainer.fit(data(), epochs=4, progress=False, callbacks=[stop, ft.train.ModelCheckpoint(tmp_path / "run")])
        return stop

    job = make(lr=1.5)  # too large: the loss grows after the first epoch
    stop = run(job)
    assert stop.best_epoch == 1 and job.epoch == (2 if patience == 1 else 4)
    rerun = make(lr=1.5).restore(tmp_path / "run")
    assert not np.array_equal(rerun.model.weight, job.model.weight)  # the checkpoint: the last step's model
    again = run(rerun)
    assert rerun.steps_run == job.steps_run and again.best_epoch == 1
    for a, b in zip(jax.tree.leaves(rerun.model), jax.tree.leaves(job.model)):
        np.testing.assert_array_equal(a, b)


def _leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_restore_best_weights_is_keras_rule():
    # audit 27: EarlyStopping(restore_best_weights=True) was Python's unexpected-keyword error
    best = make(lr=1.5)  # too large: the loss grows after the first epoch
    best.fit(data(), epochs=1, progress=False)  # the run stopped at epoch 1 by hand
    stop = ft.train.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    trainer = make(lr=1.5)
    trainer.fit(data(), epochs=4, progress=False, callbacks=[stop])
    assert (stop.stopped_epoch, stop.best_epoch, trainer.epoch) == (2, 1, 2)
    assert _leaves_equal(trainer.model, best.model)  # epoch 1's model, bit for bit
    # Keras 3's rule (its on_train_end; tf-keras 2.16's): a run that used all its epochs is
    # restored too. Audit 27 (operators): this kept the last model, Keras 2's rule, where a
    # Keras 3 program ends with the best epoch's.
    for keyword in ("restore_best_weights", "restore_best"):
        stop = ft.train.EarlyStopping(monitor="loss", patience=10, **{keyword: True})
        run = make(lr=1.5)
        run.fit(data(), epochs=3, progress=False, callbacks=[stop])
        assert stop.stopped_epoch is None and stop.best_epoch == 1
        assert _leaves_equal(run.model, best.model)


@pytest.mark.parametrize("patience", [1, 10])  # stopped early; all epochs used
def test_restore_best_weights_restart_recipe_ends_as_the_job(tmp_path, patience):
    def run(trainer, directory):
        stop = ft.train.EarlyStopping(monitor="loss", patience=patience, restore_best_weights=True)
        trainer.fit(data(), epochs=4, progress=False,
                    callbacks=[stop, ft.train.ModelCheckpoint(directory, max_to_keep=None)])
        return stop

    job = make(lr=1.5)
    stop = run(job, tmp_path / "run")
    assert stop.best_epoch == 1 and stop.stopped_epoch == (2 if patience == 1 else None)
    # restarted after its end (a fit with nothing to train), and from its first epoch's
    # checkpoint (writing elsewhere: the directory holds that run's later steps)
    for step, directory in ((job.steps_run, tmp_path / "run"), (3, tmp_path / "again")):
        rerun = make(lr=1.5).restore(tmp_path / "run", step=step)
        again = run(rerun, directory)
        assert rerun.steps_run == job.steps_run and again.stopped_epoch == stop.stopped_epoch
        assert _leaves_equal(rerun.model, job.model)


def test_tied_values_keep_the_first_epoch_to_reach_the_best():
    trainer = types.SimpleNamespace(stop_training=False, model=None, opt_state=None)
    stop = ft.train.EarlyStopping(monitor="m", mode="min", patience=9)
    for epoch, value in enumerate([0.5, 0.3, 0.3, 0.4], start=1):
        stop.on_epoch_end(trainer, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"m": value}))
    assert stop.best_epoch == 2
    rising = ft.train.EarlyStopping(monitor="m", patience=9, mode="max")
    for epoch, value in enumerate([0.5, 0.7, 0.7, 0.6], start=1):
        rising.on_epoch_end(trainer, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"m": value}))
    assert rising.best_epoch == 2
    trainer.opt_state = ft.optim.sgd(1.0).init({"w": jnp.ones(1)})
    reduce = ft.train.ReduceLROnPlateau(monitor="m", mode="min", factor=0.5, patience=1)
    for epoch, value in enumerate([0.5, 0.3, 0.3], start=1):  # epoch 3 ties: no improvement
        reduce.on_epoch_end(trainer, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"m": value}))
    assert float(ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]) == 0.5


def test_per_group_learning_rates_in_history_context_and_plateau():
    # issue 27: with ft.optim.groups no learning rate was recorded, and ReduceLROnPlateau failed
    model = {"body": jnp.zeros((2, 1)), "head": jnp.zeros(1)}
    tx = ft.optim.groups({"body": ft.optim.sgd(0.1), "head": ft.optim.sgd(0.4)})
    trainer = Trainer(model, ft.optim.Optimizer(tx), lambda m, b: jnp.mean((b[0] @ m["body"] + m["head"][None, :] - b[1]) ** 2))
    seen = []
    reduce = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9, group="head")
    history = trainer.fit(data(), epochs=3, log_every=3, progress=False, callbacks=[reduce, seen.append])
    # epoch 1 improves (from inf), epochs 2 and 3 do not: head's rate halved after each
    assert history.steps["body/learning_rate"] == [pytest.approx(0.1)] * 9
    assert history.steps["head/learning_rate"] == [pytest.approx(r) for r in [0.4] * 6 + [0.2] * 3]
    assert [c.learning_rates for c in seen[:2]] == [{"body/learning_rate": pytest.approx(0.1),
                                                     "head/learning_rate": pytest.approx(0.4)}] * 2
    assert seen[0].learning_rate is None  # several: no single rate
    assert float(ft.optim.hyperparameters(trainer.opt_state)["head/learning_rate"]) == pytest.approx(0.1)
    every = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5)
    halved = every._reduced(trainer.opt_state)  # without group=: every group's rate
    assert ft.optim.hyperparameters(halved)["body/learning_rate"] == pytest.approx(0.05)
    wrong = ft.train.ReduceLROnPlateau(monitor="loss", group="classifier")
    with pytest.raises(ValueError, match=r"no parameter group 'classifier' with a learning rate; its learning "
                                         r"rates are \['body/learning_rate', 'head/learning_rate'\]") as info:
        wrong._reduced(trainer.opt_state)
    assert "right:  ReduceLROnPlateau(group='head')" in str(info.value)  # the closest group's name
    with pytest.raises(ValueError, match=r"right:  ReduceLROnPlateau\(group='head'\)"):
        ft.train.ReduceLROnPlateau(monitor="loss", group="heed")._reduced(trainer.opt_state)  # a typo: was 'body'
    # no groups: the fix drops group= (it suggested group="head", which fails the same way)
    model = {"w": jnp.ones(2)}
    state = ft.optim.Optimizer(ft.optim.sgd(0.4)).init(model)
    with pytest.raises(ValueError, match=r"no parameter group 'classifier'(.|\n)*rates are \['learning_rate'\]") as info:
        wrong._reduced(state)
    right = next(line.split("right:")[1].split("#")[0].strip() for line in str(info.value).splitlines()
                 if "right:" in line)
    fixed = eval("ft.train." + right, {"ft": ft})
    assert ft.optim.hyperparameters(fixed._reduced(state))["learning_rate"] == pytest.approx(0.04)


def test_callbacks_do_not_import_the_trainer():
    # Issue 38: no circle between _callbacks.py and _trainer.py, not even for type checking:
    # callbacks see the Trainer through the TrainerView protocol.
    import ast
    import inspect

    import functree.train._callbacks as callbacks_module

    tree = ast.parse(inspect.getsource(callbacks_module))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "functree.train._trainer" not in imported and "functree.train._job" in imported
    assert isinstance(ft.train.Trainer({"w": jnp.zeros(1)}, ft.optim.sgd(0.1), lambda m, b: 0.0).state,
                      ft.train.JobState)


def test_a_run_rolled_back_to_an_older_step_is_refused_until_the_later_steps_go(tmp_path):
    """A job restored at step 6 of a directory holding 9 and 12 (another run's) skipped its
    own saves at 9 and 12 silently, and a later restore continued the abandoned run. Now fit
    refuses to start, naming the steps; deleting them (the fix it names) lets this run replace them."""
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    data = ft.train.batches((x, x.sum(1, keepdims=True)), 8, key=jax.random.key(1))
    loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731

    def make(lr):
        return Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.adam(lr)), loss)

    directory = tmp_path / "run"
    first = make(0.5)
    first.fit(data, steps=12, progress=False, callbacks=[ft.train.ModelCheckpoint(directory, every_steps=3,
                                                                                  max_to_keep=None)])
    rolled = make(0.01).restore(directory, step=6, optimizer_state=False)
    with pytest.raises(ValueError, match=r"holds checkpoints past this trainer's step 6 \(\[9, 12\]\)") as info:
        rolled.fit(data, steps=12, progress=False, callbacks=[ft.train.ModelCheckpoint(directory, every_steps=3)])
    assert "for step in [9, 12]: manager.delete(step)" in str(info.value) and rolled.steps_run == 6
    with pytest.raises(ValueError, match=r"past this trainer's step 0 \(\[3, 6, 9, 12\]\)"):  # a new job, a used directory
        make(0.01).fit(data, steps=3, progress=False, callbacks=[ft.train.ModelCheckpoint(directory, every_steps=3)])
    manager = ft.train.CheckpointManager(directory, max_to_keep=None)
    for step in [9, 12]:
        manager.delete(step)
    rolled.fit(data, steps=12, progress=False, callbacks=[ft.train.ModelCheckpoint(manager, every_steps=3)])
    again = make(0.01).restore(directory)
    assert again.steps_run == 12 and manager.all_steps() == [3, 6, 9, 12]
    np.testing.assert_array_equal(again.model.weight, rolled.model.weight)  # the latest is this run's
    assert not np.array_equal(np.asarray(again.model.weight), np.asarray(first.model.weight))
    make(0.01).restore(directory).fit(data, steps=15, progress=False,  # the usual resume: nothing ahead
                                      callbacks=[ft.train.ModelCheckpoint(directory, every_steps=3)])


class _NormNet(ft.Module):
    d1: ft.nn.Dense
    bn: ft.nn.BatchNorm
    d2: ft.nn.Dense

    def __call__(self, x):
        return self.d2(jax.nn.relu(self.bn(self.d1(x))))


def test_restore_best_restores_the_best_epochs_averaged_parameters_too():
    # The averaged model after restore_best was the last step's average over the best epoch's
    # BatchNorm statistics: a model that never existed (its validation loss none of the history's).
    net = _NormNet(ft.nn.Dense(2, 8, key=jax.random.key(0)), ft.nn.BatchNorm(8, momentum=0.5),
                   ft.nn.Dense(8, 1, key=jax.random.key(1)))
    optimizer = ft.optim.Optimizer(ft.optim.sgd(0.3), average=ft.optim.ema(0.5))
    trainer = Trainer(net, optimizer, loss_fn)
    stop = ft.train.EarlyStopping(monitor="val_averaged_loss", patience=2, restore_best=True)
    val = (X[:16] * 3.0, Y[:16] * 3.0)  # other statistics than the training data's: BatchNorm matters
    history = trainer.fit(data(), epochs=12, validation_data=val, progress=False, callbacks=[stop])
    losses = history.epochs["val_averaged_loss"]
    assert stop.best_epoch is not None and stop.best_epoch < len(losses)  # the best is not the last epoch
    expected = losses[stop.best_epoch - 1]
    np.testing.assert_allclose(trainer.evaluate(val, averaged=True)["loss"], expected, rtol=0, atol=1e-5 * expected)
    np.testing.assert_allclose(trainer.evaluate(val)["loss"], history.epochs["val_loss"][stop.best_epoch - 1],
                               rtol=0, atol=1e-5 * expected)
    assert stop.state_dict()["best_average"] is not None


def test_early_stopping_never_stops_at_the_first_epoch_as_keras():
    # A NaN first value (no best yet) with patience 0 or 1 stopped after epoch 1; Keras's
    # EarlyStopping never stops at its first epoch (`epoch > 0`).
    trainer = types.SimpleNamespace(stop_training=False, model=None, opt_state=None)
    for patience in (0, 1):
        stop = ft.train.EarlyStopping(monitor="m", mode="min", patience=patience)
        for epoch, value in enumerate([float("nan"), 1.0, 2.0, 3.0], start=1):
            if stop.stopped_epoch is None:
                stop.on_epoch_end(trainer, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"m": value}))
        assert stop.stopped_epoch == 3 and stop.best_epoch == 2


def test_early_stopping_never_stops_at_its_first_monitored_epoch_as_keras():
    # With start_from_epoch=2 a NaN at epoch 3, the first monitored, stopped the run there
    # (patience 0 or 1): the `epoch > 0` rule covered epoch 1 only. Keras's first monitored
    # epoch is always its best (none before), so it never stops there.
    trainer = types.SimpleNamespace(stop_training=False, model=None, opt_state=None)
    for patience in (0, 1):
        stop = ft.train.EarlyStopping(monitor="m", mode="min", patience=patience, start_from_epoch=2)
        for epoch, value in enumerate([5.0, 5.0, float("nan"), 1.0, 2.0, 3.0], start=1):
            if stop.stopped_epoch is None:
                stop.on_epoch_end(trainer, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"m": value}))
        assert stop.stopped_epoch == 5 and stop.best_epoch == 4


def test_a_diverged_minus_inf_never_improves_as_the_best_checkpoint_skips_it(tmp_path):
    """A -inf loss beat every finite one: EarlyStopping(restore_best=True) restored the
    diverged epoch's model (and no later epoch could improve), ReduceLROnPlateau cut the
    rate of a run improving after it, while ModelCheckpoint(best_metric=) ranked the best
    finite epoch. Each now skips a value that is not finite, as the checkpoint manager."""
    values = [1.0, -np.inf, 0.5, 0.4, 0.45, 0.6]
    manager = ft.train.CheckpointManager(tmp_path / "best", max_to_keep=None, best_metric="val_loss")
    stop = ft.train.EarlyStopping(monitor="val_loss", patience=2, restore_best=True)
    reduce = ft.train.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2)
    trainer = types.SimpleNamespace(stop_training=False, model=None,
                                    opt_state=ft.optim.Optimizer(ft.optim.sgd(0.4)).init({"w": jnp.zeros(1)}))
    for epoch, value in enumerate(values, start=1):
        trainer.model = {"w": jnp.full(1, float(epoch))}
        context = ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"val_loss": value})
        reduce.on_epoch_end(trainer, context)
        stop.on_epoch_end(trainer, context)
        if epoch <= 4:  # up to the best: four checkpoints
            manager.save(epoch, trainer.model, metrics={"val_loss": value})
    assert manager.best_step() == 4 and stop.best_epoch == 4 and stop.stopped_epoch == 6
    assert float(ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]) == pytest.approx(0.2)  # after epoch 6 only
    stop.on_train_end(trainer, context)
    assert float(trainer.model["w"][0]) == 4.0


def test_an_early_stopping_state_saved_without_the_best_average_loads():
    stop = ft.train.EarlyStopping(monitor="m", mode="min", restore_best=True)
    older = {k: v for k, v in stop.state_dict().items() if k != "best_average"}
    stop.load_state_dict({**older, "best": 0.5, "best_epoch": 2})
    assert stop.best_epoch == 2 and stop.best_average is None


def test_the_restart_recipe_with_a_periodic_and_a_best_directory(tmp_path):
    # A crash after the best directory's epoch-end save (step 9) and before the periodic one's
    # next (12): restored from the periodic directory (8), fit refused to start ("best holds
    # checkpoints past this trainer's step 8"). The best directory's later checkpoints of the
    # same run are allowed now; the restarted job ends as the uninterrupted one. (Two epochs:
    # the crash, the restart and the other run all fall in them; a third added 7 saves.)
    x = np.random.default_rng(0).normal(size=(36, 2)).astype(np.float32)
    y = x @ np.array([[2.0], [-1.0]], np.float32)
    val = (X[:8], Y[:8])

    def make():
        return Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn)

    def batches():
        return ft.train.batches((x, y), 4, key=jax.random.key(3))  # 9 steps per epoch

    def cbs(root, *more):
        return [ft.train.ModelCheckpoint(root / "run", every_steps=4, max_to_keep=None),
                ft.train.ModelCheckpoint(root / "best", best_metric="val_loss", max_to_keep=1), *more]

    class Crash(ft.train.Callback):
        reads_model = False

        def on_log(self, trainer, context):
            if context.step >= 11:
                raise RuntimeError("crash")

    straight = make()
    straight.fit(batches(), epochs=2, validation_data=val, progress=False, callbacks=cbs(tmp_path / "a"), log_every=1)
    with pytest.raises(RuntimeError, match="crash"):
        make().fit(batches(), epochs=2, validation_data=val, progress=False, callbacks=cbs(tmp_path / "b", Crash()),
                   log_every=1)
    assert ft.train.CheckpointManager(tmp_path / "b" / "best").all_steps() == [9]
    restarted = make().restore(tmp_path / "b" / "run")
    assert restarted.steps_run == 8
    restarted.fit(batches(), epochs=2, validation_data=val, progress=False, callbacks=cbs(tmp_path / "b"), log_every=1)
    np.testing.assert_array_equal(restarted.model.weight, straight.model.weight)
    for part in ("run", "best"):
        assert (ft.train.CheckpointManager(tmp_path / "b" / part).all_steps()
                == ft.train.CheckpointManager(tmp_path / "a" / part).all_steps())
    # Another run (another learning rate from step 8 on): its history begins as the best
    # directory's later checkpoint's, until its first save point shows it went another way.
    other = Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.adam(0.01)), loss_fn)
    other.restore(tmp_path / "a" / "run", step=8, optimizer_state=False)
    with pytest.raises(ValueError, match=r"past this trainer's step 8"):  # the periodic directory still refuses
        other.fit(batches(), epochs=2, validation_data=val, progress=False, callbacks=cbs(tmp_path / "a"))
    best = ft.train.ModelCheckpoint(tmp_path / "a" / "best", best_metric="val_loss", max_to_keep=None)
    assert best.manager.all_steps() == [18]
    with pytest.raises(ValueError, match=r"holds checkpoints past step 9 \(\[18\]\) of the run this job was restored"):
        other.fit(batches(), epochs=2, validation_data=val, progress=False, callbacks=[best])
    assert best.manager.all_steps() == [18] and other.steps_run == 9
    best.manager.delete(18)  # the fix it names: this run's checkpoints replace the other's
    other.fit(batches(), epochs=2, validation_data=val, progress=False, callbacks=[best])
    assert best.manager.all_steps() == [9, 18]
    with pytest.raises(ValueError, match=r"past this trainer's step 0"):  # a new job: not this run's
        make().fit(batches(), epochs=1, validation_data=val, progress=False,
                   callbacks=[ft.train.ModelCheckpoint(tmp_path / "a" / "best", best_metric="val_loss")])


def test_a_hook_that_cannot_take_the_trainers_arguments_is_refused_before_training():
    """`def on_epoch_end(self, ctx)` failed at the first epoch's end with Python's "takes 2
    positional arguments but 3 were given", after an epoch of training."""
    class OneArgument(ft.train.Callback):
        def on_epoch_end(self, ctx):
            pass

    trainer = make()
    with pytest.raises(TypeError, match=r"(?s)OneArgument.on_epoch_end takes \(ctx\); the Trainer calls it as "
                                        r"on_epoch_end\(trainer, context\).*right:  def on_epoch_end\(self, trainer, "
                                        r"context\)"):
        trainer.fit(data(), epochs=1, progress=False, callbacks=[OneArgument()])
    assert trainer.steps_run == 0  # refused before the first step

    seen = []

    class Flexible(ft.train.Callback):  # *args and extra defaults bind: accepted
        def on_epoch_end(self, *args):
            seen.append(args[1].epoch)

        def on_log(self, trainer, context, extra=None):
            pass

    trainer.fit(data(), epochs=2, progress=False, callbacks=[Flexible()])
    assert seen == [1, 2]  # context.epoch: sweep's other name, the epochs completed


def test_a_hook_set_to_none_is_left_as_before():
    """`on_log = None` on a Callback subclass ran at df00849; the new signature check crashed
    with UnboundLocalError reading it."""
    class Quiet(ft.train.Callback):
        on_log = None

    trainer = make()
    trainer.fit(data(), epochs=1, progress=False, log_every=1, callbacks=[Quiet()])
    assert trainer.steps_run == 3


@pytest.mark.parametrize("hook", ["on_train_begin", "on_log", "on_epoch_end", "on_train_end"])
def test_each_hook_set_to_none_is_skipped(hook):
    """`on_train_begin = None` / `on_train_end = None` in a subclass crashed with "'NoneType'
    object is not callable" (on_train_end after the whole fit); on_log/on_epoch_end were
    skipped. Every hook set to None is now skipped, the others run as in the parent."""
    class Record(ft.train.Callback):
        def __init__(self):
            self.calls = []

        def on_train_begin(self, trainer):
            self.calls.append(("on_train_begin", trainer.steps_run))

        def on_log(self, trainer, context):
            self.calls.append(("on_log", context.step))

        def on_epoch_end(self, trainer, context):
            self.calls.append(("on_epoch_end", context.step))

        def on_train_end(self, trainer, context):
            self.calls.append(("on_train_end", context.step))

    off = type("Off", (Record,), {hook: None})()
    full, plain = Record(), make()
    trainer = make()
    for t, cbs in ((trainer, [off, full]), (plain, [])):
        t.fit(data(), epochs=2, log_every=2, progress=False, callbacks=cbs)
        t.fit(data(), epochs=2, log_every=2, progress=False, callbacks=cbs)  # already done: the end again
    assert full.calls == [("on_train_begin", 0), ("on_log", 2), ("on_epoch_end", 3), ("on_log", 4), ("on_log", 6),
                          ("on_epoch_end", 6), ("on_train_end", 6), ("on_train_end", 6)]  # (no step: no begin)
    assert off.calls == [c for c in full.calls if c[0] != hook]
    np.testing.assert_allclose(trainer.history.steps["loss"], plain.history.steps["loss"], rtol=0, atol=0)


def test_reduce_lr_on_plateau_refuses_a_scheduled_rate_before_the_first_step():
    """On ft.optim.adam(cosine_decay(...)) it failed at the first plateau, epochs in, with the
    fix for an optax transformation (wrap optax.adam in ft.optim.Optimizer), which was
    already done. Refused in on_train_begin, naming the schedule and the one right fix."""
    from functree.train._callbacks import NO_LEARNING_RATE, SCHEDULED_LEARNING_RATE

    trainer = Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.adam(ft.optim.cosine_decay(0.1, 100)),
                      loss_fn)
    with pytest.raises(ValueError) as info:
        trainer.fit(data(), epochs=5, progress=False, callbacks=[ft.train.ReduceLROnPlateau(monitor="loss")])
    assert str(info.value) == SCHEDULED_LEARNING_RATE.format(names="'learning_rate'")
    assert "optax.adam" not in str(info.value) and trainer.steps_run == 0
    plain = Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.adam(0.1), loss_fn)  # the fix: it runs
    plain.fit(data(), epochs=1, progress=False, callbacks=[ft.train.ReduceLROnPlateau(monitor="loss")])
    import optax  # an optax transformation without hyperparameters: the other fix, also up front

    raw = Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), optax.adam(0.1), loss_fn)
    with pytest.raises(ValueError) as info:
        raw.fit(data(), epochs=5, progress=False, callbacks=[ft.train.ReduceLROnPlateau(monitor="loss")])
    assert str(info.value) == NO_LEARNING_RATE.format(error="no hyperparameter named learning_rate")
    assert raw.steps_run == 0


def test_the_logged_learning_rate_of_per_samples_is_the_documented_one():
    """per_samples(0.1, 10) on minibatches of 5 logs 0.1 (the rate per 10 samples, as
    documented: TrainingContext.learning_rate, docs/guides/logging.md) while each step
    applies 0.05; a per_samples schedule logs the rate applied. Both against NumPy SGD."""
    x, y = X[:20], Y[:20, 0]

    def fit(rate):
        seen = []
        trainer = Trainer({"w": jnp.zeros(2)}, ft.optim.Optimizer(ft.optim.sgd(rate)),
                          lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2))
        history = trainer.fit(ft.train.batches((x, y), 5, shuffle=False), epochs=1, progress=False,
                              callbacks=[seen.append])
        return trainer, history.steps["learning_rate"], seen[-1].learning_rate

    def sgd(rates):  # NumPy reference: w -= rate * grad, minibatches of 5 in order
        w = np.zeros(2)
        for i, rate in zip(range(0, 20, 5), rates):
            xb = x[i:i + 5].astype(np.float64)
            w = w - rate * 2 * xb.T @ (xb @ w - y[i:i + 5]) / 5
        return w

    trainer, column, context = fit(ft.optim.per_samples(0.1, 10))
    np.testing.assert_allclose(column + [context], 0.1, rtol=0, atol=1e-8)  # float32 0.1
    np.testing.assert_allclose(np.asarray(trainer.model["w"]), sgd([0.05] * 4), rtol=0, atol=1e-6)
    schedule = ft.optim.cosine_decay(0.1, 100)
    trainer, column, _ = fit(ft.optim.per_samples(schedule, 10))
    applied = [float(schedule(ft.optim.initial_context().replace(step=s))) * 5 / 10 for s in range(4)]
    np.testing.assert_allclose(column, applied, rtol=0, atol=1e-8)
    np.testing.assert_allclose(np.asarray(trainer.model["w"]), sgd(applied), rtol=0, atol=1e-6)


class _End(ft.train.Callback):
    reads_model = False

    def __init__(self):
        self.metrics = None

    def on_train_end(self, trainer, context):
        self.metrics = context.metrics


def test_the_end_of_fit_sees_the_last_epochs_metrics_whatever_log_every():
    """on_train_end's context.metrics were the last log window's: {} where fit ended at a log
    point (log_every=3, 3 steps an epoch), the last 2 steps' mean for log_every=4 instead of
    the epoch's. They are now the last epoch's row (Keras's on_train_end logs), val_*
    included; a fit ending between epoch ends (steps=) sees the means of the steps after the
    last one, each minibatch weighed by its examples."""
    for every in (3, 4, 50):
        end = _End()
        history = make().fit(data(), epochs=2, progress=False, log_every=every, validation_data=(X, Y), callbacks=[end])
        want = {k: v[-1] for k, v in history.epochs.items() if k not in ("epoch", "last_step")}
        assert end.metrics == want and set(want) == {"loss", "val_loss"}
    end = _End()
    minibatches = [(X[:16], Y[:16]), (X[16:24], Y[16:24]), (X[24:40], Y[24:40])]
    history = make().fit(minibatches, steps=5, progress=False, log_every=1, callbacks=[end])
    steps = history.steps["loss"]  # epoch 2: a minibatch of 16, then one of 8
    np.testing.assert_allclose(end.metrics["loss"], (16 * steps[3] + 8 * steps[4]) / 24, rtol=0, atol=1e-7)


def _stops(values, **keywords):
    """(stopped_epoch, best_epoch) of an EarlyStopping fed ``values`` as epochs 1, 2, ..."""
    trainer = types.SimpleNamespace(stop_training=False, model=None, opt_state=None)
    stop = ft.train.EarlyStopping(monitor="m", **{"mode": "min", **keywords})
    for epoch, value in enumerate(values, start=1):
        stop.on_epoch_end(trainer, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"m": value}))
        if trainer.stop_training:
            break
    return stop.stopped_epoch, stop.best_epoch


def test_keras_baseline_and_start_from_epoch():
    # audit 27: Keras's baseline= and start_from_epoch= were Python's unexpected-keyword
    # error. Stopping epochs computed by hand with Keras's on_epoch_end (its epochs from 0):
    # - baseline 0.5, patience 2: epochs 1-2 improve the best (1.0, 0.9) without beating the
    #   baseline, so the wait is not restarted (1, 2); epoch 3 does not improve and the wait
    #   (3) is past the patience: stop at 3, best 2. Without the baseline epoch 2 restarts the
    #   wait, and the run stops at 4.
    assert _stops([1.0, 0.9, 0.95, 0.97, 0.99], patience=2, baseline=0.5) == (3, 2)
    assert _stops([1.0, 0.9, 0.95, 0.97, 0.99], patience=2) == (4, 2)
    # - improving every epoch never stops, baseline or not (Keras returns on an improvement);
    #   epoch 6 beats the baseline (0.5 < 0.55) and restarts the wait.
    assert _stops([1.0, 0.9, 0.8, 0.7, 0.6, 0.5], patience=2, baseline=0.55) == (None, 6)
    # - mode="max", baseline 0.9 (values exact in binary): epoch 3's 1.0 beats it and
    #   restarts the wait, the run stops at 5; with min_delta 0.125 it must beat 1.025, does
    #   not, and the run stops at 4 (waits 1, 2, 3, 4).
    values = [0.5, 0.75, 1.0, 0.875, 0.8125]
    assert _stops(values, patience=2, mode="max", baseline=0.9) == (5, 3)
    assert _stops(values, patience=2, mode="max", min_delta=0.125, baseline=0.9) == (4, 3)
    # - start_from_epoch 3, patience 1: epochs 1-3 (Keras's 0-2) are not monitored; epoch 4
    #   is the first best (3.5, though epoch 3's 3.0 was lower), epoch 5 stops. Without it:
    #   best 3 (3.0), stop at 4.
    assert _stops([5.0, 4.0, 3.0, 3.5, 3.6, 3.7, 2.0], patience=1, start_from_epoch=3) == (5, 4)
    assert _stops([5.0, 4.0, 3.0, 3.5, 3.6, 3.7, 2.0], patience=1) == (4, 3)


def test_keras_verbose_prints_keras_lines(capsys):
    # audit 27: verbose=1 was Python's unexpected-keyword error; it prints Keras's two lines
    stop = ft.train.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True, verbose=1)
    make(lr=1.5).fit(data(), epochs=4, progress=False, callbacks=[stop])
    assert capsys.readouterr().err == ("Epoch 2: early stopping\n"
                                       "Restoring model weights from the end of the best epoch: 1.\n")
    quiet = ft.train.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)  # verbose=0
    quiet.load_state_dict(stop.state_dict())  # stopped at 2, best 1: the same end of fit, silent
    trainer = types.SimpleNamespace(model=None, opt_state=None)
    quiet.on_train_end(trainer, ft.train.TrainingContext("end", 6, 2, 0, 1, None, {}))
    assert capsys.readouterr().err == "" and trainer.model is not None


class _KeepModels(ft.train.Callback):
    """Keeps a copy of the model at each epoch's end (before the callbacks after it)."""

    def __init__(self):
        self.models = []

    def on_epoch_end(self, trainer, context):
        self.models.append(jax.tree.map(np.asarray, trainer.model))


@pytest.mark.parametrize("start_from_epoch", [0, 2])
def test_restore_best_weights_when_no_epoch_improves_is_keras_3(start_from_epoch):
    # audit 27 (keras3): every monitored value NaN, no epoch ever improves; Keras 3's
    # on_epoch_end keeps the first monitored epoch's weights ("if best weights were never
    # set, then the current weights are the best") and restores them. functree restored
    # nothing: the run ended with the last epoch's model.
    keep = _KeepModels()
    stop = ft.train.EarlyStopping(monitor="nan", mode="min", patience=10, restore_best_weights=True,
                                  start_from_epoch=start_from_epoch)
    trainer = Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.sgd(0.05)), loss_fn,
                      metrics={"nan": lambda out: out.loss * jnp.nan})
    history = trainer.fit(data(), epochs=4, progress=False, callbacks=[keep, stop])
    assert all(np.isnan(history["nan"])) and stop.stopped_epoch is None
    first = start_from_epoch + 1  # Keras's `epoch < start_from_epoch`, from 0
    assert stop.best_epoch == first and not _leaves_equal(keep.models[first - 1], keep.models[-1])
    assert _leaves_equal(trainer.model, keep.models[first - 1])  # bit for bit


def test_keras_verbose_prints_the_stop_in_the_fit_it_ended_only(capsys):
    # audit 27 (keras3): the state outlives fit (the restart recipe), and a later fit's end
    # printed "Epoch 2: early stopping" again; Keras's on_train_begin resets stopped_epoch.
    stop = ft.train.EarlyStopping(monitor="loss", patience=0, verbose=1)
    stop.load_state_dict({**stop.state_dict(), "stopped_epoch": 2, "best_epoch": 1})  # an earlier fit stopped
    trainer = types.SimpleNamespace(model=None, opt_state=None)
    stop.on_train_end(trainer, ft.train.TrainingContext("end", 6, 2, 0, 1, None, {}))
    assert capsys.readouterr().err == "" and stop.stopped_epoch == 2  # kept for the restart recipe
    for epoch, value in enumerate([1.0, 2.0], start=3):  # this fit stops at 4
        stop.on_epoch_end(types.SimpleNamespace(stop_training=False, model=None, opt_state=None),
                          ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {"loss": value}))
    stop.on_train_end(trainer, ft.train.TrainingContext("end", 12, 4, 0, 1, None, {}))
    stop.on_train_end(trainer, ft.train.TrainingContext("end", 12, 4, 0, 1, None, {}))  # a later fit, no epoch
    assert capsys.readouterr().err == "Epoch 4: early stopping\n" and stop.stopped_epoch == 4


@pytest.mark.parametrize("grouped", [False, True])
def test_the_logged_learning_rate_is_the_one_reduce_on_plateau_applied(grouped):
    """The history, callbacks and loggers read hyperparameters(), which leaves out the scale
    of an optax reduce_on_plateau in the chain: on a plateau they logged 0.1 at every step
    while the steps applied 0.1, 0.05, 0.025, 0.0125. Within groups too."""
    import optax

    x = np.ones((8, 1), np.float32)

    def flat_loss(m, batch):  # a constant loss with a unit gradient: the step is the rate
        return jnp.mean(batch[0] @ m["w"]) - jnp.mean(batch[0] @ jax.lax.stop_gradient(m["w"])) + 1.0

    plateau = ft.optim.reduce_on_plateau(factor=0.5, patience=1)
    tx = (ft.optim.groups({"w": optax.chain(ft.optim.sgd(0.1), plateau)}) if grouped
          else optax.chain(ft.optim.sgd(0.1), plateau))
    trainer = ft.train.Trainer({"w": jnp.ones((1, 1))}, ft.optim.Optimizer(tx), flat_loss)
    history = trainer.fit(ft.train.batches((x,), 2, shuffle=False), epochs=1, progress=False)
    opt = ft.optim.Optimizer(tx)
    model, state, applied = {"w": jnp.ones((1, 1))}, opt.init({"w": jnp.ones((1, 1))}), []
    # one program for the step (eager, each of its operations compiled apart)
    by_hand = jax.jit(lambda m, s: opt.minimize(flat_loss, m, s, (x[:2],)))
    for _ in range(4):  # the same steps by hand: what each applied
        new, state, _ = by_hand(model, state)
        applied.append(float(np.asarray(model["w"])[0, 0] - np.asarray(new["w"])[0, 0]))  # (float32, as before)
        model = new
    np.testing.assert_allclose(applied, [0.1, 0.05, 0.025, 0.0125], rtol=0, atol=1e-7)
    assert [n for n in history.steps if "learning_rate" in n] == ["learning_rate"]  # (one group: its rate's name)
    np.testing.assert_allclose(history.steps["learning_rate"], applied, rtol=0, atol=1e-7)  # (was 0.1 four times)


@pytest.mark.parametrize(("name", "right", "says"), [
    ("on_step_end", "on_log(self, trainer, context)", "another library's hook; on_log does its job here.*log_every=1"),
    ("on_train_batch_end", "on_log(self, trainer, context)", "another library's hook"),
    ("on_evaluate", "on_epoch_end(self, trainer, context)", "after the epoch's validation"),
    ("on_fit_start", "on_train_begin(self, trainer)", "another library's hook"),
    ("on_epoch_ends", "on_epoch_end(self, trainer, context)", "never calls it"),
])
def test_a_method_named_as_a_hook_that_is_none_is_refused_before_training(name, right, says):
    """A callback ported from Hugging Face (`on_step_end`), Keras (`on_train_batch_end`) or
    Lightning (`on_fit_start`), or with a misspelt hook, ran a whole fit without the Trainer
    ever calling it, silently: the user's logging or stopping never happened."""
    calls = []
    Ported = type("Ported", (ft.train.Callback,), {name: lambda self, *a: calls.append(a)})
    trainer = make()
    with pytest.raises(TypeError, match=rf"Ported.{name} is no hook of ft.train.Callback") as info:
        trainer.fit(data(), epochs=1, progress=False, log_every=1, callbacks=[Ported()])
    assert re.search(says, str(info.value), re.S) and f"right:  def {right}" in str(info.value)
    assert trainer.steps_run == 0 and calls == []

    class Helper(ft.train.Callback):  # a method of its own, without the prefix: accepted
        def __init__(self):
            self.seen = []

        def record(self, step):
            self.seen.append(step)

        def on_log(self, trainer, context):
            self.record(context.step)

    helper = Helper()
    trainer.fit(data(), epochs=1, progress=False, log_every=1, callbacks=[helper])
    assert helper.seen == [1, 2, 3]


def _classifier(metrics):
    """A Trainer of a 2-class linear classifier on separable data (val accuracy rises)."""
    def ce(model, batch):
        logits = model(batch[0])
        return ft.losses.softmax_cross_entropy(logits, batch[1]), {"logits": logits}
    return Trainer(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.optim.sgd(0.05), ce, metrics=metrics)


CLASSES = (X @ np.array([1.0, -2.0], np.float32) > 0).astype(np.int32)


def test_a_monitor_without_mode_improves_the_way_its_metric_does():
    """EarlyStopping(monitor="val_accuracy") took the default mode "min": a run whose
    accuracy rose 0.61 -> 0.70 -> 0.84 stopped at epoch 3 and restored epoch 1's model, the
    worst (ReduceLROnPlateau cut the rate of an improving run; ModelCheckpoint ranked the
    worst checkpoint best). A loss falls; ft.train's metrics rise, by their own names or
    renamed in Trainer(metrics=) (their functions say: higher_is_better)."""
    trainer = _classifier({"acc": ft.train.accuracy})
    stop = ft.train.EarlyStopping(monitor="val_acc", patience=1, restore_best=True)
    h = trainer.fit(ft.train.batches((X, CLASSES), 16), epochs=4, progress=False,
                    validation_data=(X, CLASSES), callbacks=[stop])
    accuracy = h["val_acc"]
    assert accuracy[-1] > accuracy[0] and stop.stopped_epoch is None  # it rose: no stop
    assert stop.best_epoch == 1 + int(np.argmax(accuracy))  # the first epoch of the highest
    fake = types.SimpleNamespace(stop_training=False, model=None, opt_state=None, train_step=None)
    for monitor, values, best in (("val_accuracy", [0.5, 0.7, 0.9], 3), ("val_loss", [0.9, 0.7, 0.8], 2),
                                  ("val_averaged_f1", [0.2, 0.4, 0.3], 2), ("top_5_accuracy", [0.1, 0.3, 0.2], 2)):
        stop = ft.train.EarlyStopping(monitor=monitor, patience=5)
        stop.on_train_begin(fake)
        for epoch, value in enumerate(values, start=1):
            stop.on_epoch_end(fake, ft.train.TrainingContext("epoch", epoch, epoch, 0, 1, None, {monitor: value}))
        assert stop.best_epoch == best, monitor
    plateau = ft.train.ReduceLROnPlateau(monitor="val_precision", patience=0)
    assert plateau._monitor.mode == "max" and ft.train.EarlyStopping(mode="auto")._monitor.mode == "min"


def test_a_monitor_whose_metric_does_not_say_is_refused_before_the_first_step(tmp_path):
    """A metric functree cannot read a direction from (a user's mean) is refused before any
    step, naming the monitor and both modes, never ranked as "min" silently; a mean of a
    function that says keeps its word; mode= given is taken as given."""
    mae = ft.train.mean(lambda out: jnp.abs(out.aux["logits"][:, 0]))
    trainer = _classifier({"acc": ft.train.accuracy, "mae": mae})
    for callback in (ft.train.EarlyStopping(monitor="val_mae"), ft.train.ReduceLROnPlateau(monitor="val_mae"),
                     ft.train.ModelCheckpoint(tmp_path / "c", best_metric="val_mae")):
        with pytest.raises(ValueError, match=r"(?s)cannot tell whether .*'val_mae'.*has no higher_is_better.*"
                                             r'right:  \w+\((monitor|best_metric)=\'val_mae\', mode="min"\)'):
            trainer.fit(ft.train.batches((X, CLASSES), 16), epochs=1, progress=False,
                        validation_data=(X, CLASSES), callbacks=[callback])
        assert trainer.steps_run == 0
    assert ft.train.EarlyStopping(monitor="val_mae", mode="max")._monitor.mode == "max"
    rising = ft.train.mean(ft.train.accuracy)
    assert rising.higher_is_better is True
    with pytest.raises(ValueError, match=r"'m' is none of them\. Say which"):
        ft.train.CheckpointManager(tmp_path / "m", best_metric="m")


def test_a_checkpoint_ranked_by_accuracy_keeps_the_highest(tmp_path):
    """CheckpointManager(best_metric="val_accuracy") kept the lowest (mode "min" by default);
    ModelCheckpoint ranks a renamed metric by its function's direction."""
    manager = ft.train.CheckpointManager(tmp_path / "a", max_to_keep=1, best_metric="val_accuracy")
    for step, value in ((1, 0.5), (2, 0.9), (3, 0.7)):
        manager.save(step, {"w": jnp.ones(1)}, metrics={"val_accuracy": value})
    assert manager.best_step() == 2 and manager.all_steps() == [2, 3]
    save = ft.train.ModelCheckpoint(tmp_path / "b", best_metric="val_acc")
    save.on_train_begin(types.SimpleNamespace(steps_run=0, train_step=types.SimpleNamespace(
        metrics={"acc": ft.train.accuracy})))
    assert save.manager.mode == "max"
    assert ft.train.ModelCheckpoint(tmp_path / "c", best_metric="val_loss").manager.mode == "min"


@pytest.mark.parametrize(("make", "right"), [
    (lambda: ft.train.ModelCheckpoint("ckpt", monitor="val_loss", save_best_only=True),
     "ft.train.ModelCheckpoint(directory, best_metric='val_loss')"),
    (lambda: ft.train.ModelCheckpoint(filepath="model.keras"), "ft.train.ModelCheckpoint('model.keras')"),
    (lambda: ft.train.ModelCheckpoint("ckpt", every_n_train_steps=500), "ft.train.ModelCheckpoint(directory, every_steps=500)"),
    (lambda: ft.train.ModelCheckpoint("ckpt", save_top_k=2),
     "ft.train.ModelCheckpoint(directory, best_metric=\"val_loss\", max_to_keep=2)"),
    (lambda: ft.train.TensorBoardLogger(log_dir="runs/1"), "ft.train.TensorBoardLogger('runs/1')"),
    (lambda: ft.train.CSVLogger(filename="log.csv"), "ft.train.CSVLogger('log.csv')"),
])
def test_keras_and_lightning_callback_keywords_name_functrees_call(make, right):
    """Keras's ``ModelCheckpoint(filepath, monitor=, save_best_only=)``, Lightning's
    ``every_n_train_steps=``/``save_top_k=`` and Keras's ``TensorBoard(log_dir=)`` were
    Python's bare "unexpected keyword argument" (or "missing 1 required positional
    argument" where the path itself was a keyword): the error names the call to write."""
    with pytest.raises(TypeError) as info:
        make()
    message = str(info.value)
    assert "name)." in message.splitlines()[0] and message.splitlines()[-1].strip().startswith(f"right:  {right}")


def test_a_misspelt_callback_keyword_names_the_closest_and_a_missing_path_is_pythons_error():
    with pytest.raises(TypeError, match=r"^ModelCheckpoint\(\) got an unexpected keyword argument 'max_to_kep' "
                                        r"\(did you mean 'max_to_keep'\?\)$"):
        ft.train.ModelCheckpoint("ckpt", max_to_kep=2)
    with pytest.raises(TypeError, match=r"^CSVLogger\(\) missing 1 required positional argument: 'path'$"):
        ft.train.CSVLogger()
    with pytest.raises(TypeError, match=r"^ModelCheckpoint\(\) missing 1 required positional argument: 'directory'$"):
        ft.train.ModelCheckpoint()


def test_a_history_logger_under_home_or_relative_writes_where_the_call_said(tmp_path, monkeypatch, home_and_work):
    """``HistoryLogger("~/log.jsonl")`` wrote ``./~/log.jsonl``, and a relative path given
    before an ``os.chdir`` was written under the new working directory."""
    (home, work), other = home_and_work, tmp_path / "other"
    other.mkdir()
    logs = [ft.train.HistoryLogger("~/log.jsonl"), ft.train.HistoryLogger("relative.jsonl")]
    monkeypatch.chdir(other)
    make().fit(data(), epochs=1, progress=False, callbacks=logs)
    assert os.listdir(home) == ["log.jsonl"] and os.listdir(work) == ["relative.jsonl"] and os.listdir(other) == []
    for path in (home / "log.jsonl", work / "relative.jsonl"):
        assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["epoch"]


def test_a_callback_reading_the_context_as_keras_s_logs_dict_is_told_context_metrics():
    # session 60: Keras's on_epoch_end(self, epoch, logs) with logs["loss"] (here given the
    # context) or a function's ctx.get("val_loss") failed with Python's "'TrainingContext'
    # object is not subscriptable" / "has no attribute 'get'", naming no context.metrics
    from functree.train._callbacks import CONTEXT_NOT_LOGS

    assert "context.metrics" in CONTEXT_NOT_LOGS
    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731

    class KerasHabit(ft.train.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["loss"]

    def fit(callback):
        trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.0), loss_fn)
        return trainer.fit([(x, x[:, :1])], epochs=1, progress=False, callbacks=[callback])

    with pytest.raises(TypeError) as e:
        fit(KerasHabit())
    assert "wrong:  context['loss']\n    right:  context.metrics['loss']" in str(e.value)
    assert "context.metrics ('loss')" in str(e.value)
    with pytest.raises(AttributeError, match=r"right:  context\.metrics\.get\(\.\.\.\)"):
        fit(lambda ctx: ctx.get("val_loss"))
    with pytest.raises(TypeError, match=r"right:  context\.step"):
        fit(lambda ctx: ctx["step"])
    seen = []
    history = fit(lambda ctx: seen.append(ctx.metrics["loss"]))  # the right line runs
    np.testing.assert_allclose(seen[-1], history.epochs["loss"][-1], rtol=0, atol=1e-7)
