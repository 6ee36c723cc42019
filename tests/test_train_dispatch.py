"""Rounds of callback hooks: a callback that raises leaves the rest of its round to the next fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
Y = X @ np.ones((3, 1), np.float32)


def loss_fn(m, b):
    return jnp.mean((m(b[0]) - b[1]) ** 2)


def make():  # the rate is too large: the loss grows, epoch 1 is the best
    return ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(1.05), loss_fn)


def data():
    return ft.train.batches((X, Y), 8)  # 4 steps per epoch


class RaiseOnce(ft.train.Callback):
    reads_model = False

    def __init__(self, hook, at):
        self.hook, self.at, self.done = hook, at, False

    def _maybe(self, c):
        if c.step == self.at and not self.done:
            self.done = True
            raise RuntimeError("transient failure")

    def on_log(self, trainer, c):
        if self.hook == "on_log":
            self._maybe(c)

    def on_epoch_end(self, trainer, c):
        if self.hook == "on_epoch_end":
            self._maybe(c)


class Seen(ft.train.Callback):
    reads_model = False

    def __init__(self):
        self.events = []

    def on_log(self, trainer, c):
        self.events.append(("log", c.step))

    def on_epoch_end(self, trainer, c):
        self.events.append(("epoch", c.step))


def run(tmp_path, raiser, *, through_checkpoint=False):
    trainer, seen = make(), Seen()
    best = ft.train.ModelCheckpoint(tmp_path / "best", best_metric="loss", max_to_keep=1)
    cbs = [*raiser, seen, best]
    try:
        trainer.fit(data(), epochs=4, callbacks=cbs, progress=False, log_every=2)
    except RuntimeError:
        if through_checkpoint:  # the guide's advice after an exception: save, and continue later
            trainer.save(tmp_path / "saved")
            trainer = make().restore(tmp_path / "saved")
        trainer.fit(data(), epochs=4, callbacks=cbs, progress=False, log_every=2)
    return trainer, seen, best.manager


@pytest.mark.parametrize("through_checkpoint", [False, True])
def test_a_callback_raising_at_an_epoch_end_leaves_the_rest_of_that_end_to_the_next_fit(tmp_path, through_checkpoint):
    # The old Trainer committed the epoch and lost the rest: the callbacks after the one that
    # raised never saw epoch 1 and its checkpoint was never written (best [8, 16], step 8).
    _, straight, manager = run(tmp_path / "a", [])
    assert manager.all_steps() == [4, 16] and manager.best_step() == 4
    trainer, seen, manager = run(tmp_path / "b", [RaiseOnce("on_epoch_end", 4)], through_checkpoint=through_checkpoint)
    assert seen.events == straight.events
    assert manager.all_steps() == [4, 16] and manager.best_step() == 4
    assert trainer.state.position.pending is None


def test_a_callback_raising_in_on_log_leaves_that_interval_to_the_callbacks_after_it(tmp_path):
    _, straight, _ = run(tmp_path / "a", [])
    _, seen, _ = run(tmp_path / "b", [RaiseOnce("on_log", 4)])
    assert ("log", 4) in straight.events
    assert seen.events == straight.events  # the old Trainer: ("log", 4) missing


def test_a_failed_epoch_save_is_written_by_the_next_fit(tmp_path):
    class FailOnce(ft.train.ModelCheckpoint):
        failed = False

        def save(self, trainer, context):
            if not self.failed:
                self.failed = True
                raise OSError("disk full")
            super().save(trainer, context)

    trainer, save = make(), FailOnce(tmp_path / "run", max_to_keep=None)
    with pytest.raises(OSError, match="disk full"):
        trainer.fit(data(), epochs=2, callbacks=[save], progress=False)
    trainer.fit(data(), epochs=2, callbacks=[save], progress=False)
    assert save.manager.all_steps() == [4, 8]


def test_a_tampered_pending_round_is_named():
    trainer = make()
    trainer._job = trainer._job.replace(pending={"hook": "on_epoch_end", "context": {"step": 1}, "done": []})
    with pytest.raises(ValueError, match="unfinished round of callback hooks"):
        trainer.fit(data(), epochs=1, callbacks=[Seen()], progress=False)


def test_a_run_without_a_raise_is_unchanged(tmp_path):
    trainer, seen, _ = run(tmp_path, [])
    np.testing.assert_allclose(trainer.history.epochs["loss"][0], 12.948, rtol=0, atol=1e-3)
    assert seen.events[:3] == [("log", 2), ("log", 4), ("epoch", 4)]


def _tampered_pending(tmp_path, change):
    """A checkpoint holding a pending on_epoch_end round, its context changed by ``change``
    and its metadata digest recomputed (as an attacker would)."""
    import json

    from functree.train.checkpoint._checkpoint import metadata_digest

    trainer = make()
    with pytest.raises(RuntimeError):
        trainer.fit(data(), epochs=2, callbacks=[RaiseOnce("on_epoch_end", 4), Seen()], progress=False)
    trainer.save(tmp_path / "ck")
    meta_file = tmp_path / "ck" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    change(meta["config"]["trainer"]["pending"])
    meta["digest"] = metadata_digest(meta)
    meta_file.write_text(json.dumps(meta))
    return tmp_path / "ck"


def _set(field, value):
    return lambda pending: pending["context"].__setitem__(field, value)


@pytest.mark.parametrize("field, change", [
    ("step", _set("step", "2")), ("step", _set("step", float("nan"))), ("step", _set("step", 10**30)),
    ("step", _set("step", True)), ("sweep", _set("sweep", -5)), ("samples_seen", _set("samples_seen", 1.5)),
    ("minibatch_size", _set("minibatch_size", None)), ("metrics", _set("metrics", {"loss": "abc"})),
    ("metrics", _set("metrics", [1.0])), ("learning_rate", _set("learning_rate", "0.1")),
    ("learning_rate", _set("learning_rate", float("inf"))), ("learning_rates", _set("learning_rates", [0.1])),
    ("learning_rates", _set("learning_rates", {"learning_rate": "0.1"})), ("event", _set("event", "log")),
    ("event", _set("event", "boom")),
])
def test_a_tampered_pending_context_field_is_refused_at_restore_naming_the_checkpoint(tmp_path, field, change):
    # The old reader checked only the context's keys: these reached the callbacks (a list of
    # learning_rates: a bare TypeError in _read).
    path = _tampered_pending(tmp_path, change)
    with pytest.raises(ft.train.CheckpointError, match=rf"(?s)ck step 4: trainer\.pending\.context\.{field} is"):
        make().restore(path)


def test_a_tampered_pending_form_is_refused_at_restore(tmp_path):
    path = _tampered_pending(tmp_path, lambda pending: pending.__setitem__("hook", "on_train_end"))
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)ck step 4: trainer\.pending: the restored job's unfinished"):
        make().restore(path)


def test_an_untampered_pending_round_restores_and_finishes(tmp_path):
    path = _tampered_pending(tmp_path, lambda pending: None)  # resealed, unchanged
    trainer, seen = make().restore(path), Seen()
    trainer.fit(data(), epochs=2, callbacks=[RaiseOnce("on_epoch_end", -1), seen], progress=False)
    assert ("epoch", 4) in seen.events and trainer.state.position.pending is None


def test_the_pending_checks_name_every_field_of_the_context():
    """functree/train/_pending.py names TrainingContext's fields without importing it (the
    callbacks import the job, which reads the entry): the two lists stay equal."""
    import dataclasses

    from functree.train._pending import CONTEXT_FIELDS

    assert {f.name for f in dataclasses.fields(ft.train.TrainingContext)} == CONTEXT_FIELDS
