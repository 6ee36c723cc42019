"""CSVLogger and TensorBoardLogger: files that read back to the history, resumed runs."""

import csv
import importlib
import itertools
import os
import struct
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train import _loggers

RNG = np.random.default_rng(3)
X = RNG.normal(size=(24, 2)).astype(np.float32)
Y = (X @ np.array([[2.0], [-1.0]], np.float32)).astype(np.float32)


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((x @ model["w"] - y) ** 2)


def make():
    return ft.train.Trainer({"w": jnp.zeros((2, 1))}, ft.optim.Optimizer(ft.optim.sgd(0.1)), loss_fn)


def data():
    return ft.train.batches((X, Y), 8, key=jax.random.key(2))  # 3 steps per epoch


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_events(directory):
    """``{tag: [(step, value)]}`` from TensorBoard event files (TFRecords of Event protos)."""
    event_pb2: Any = importlib.import_module("tensorboardX.proto.event_pb2")  # generated: no stubs

    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        raw = path.read_bytes()
        at = 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at : at + 8])
            event = event_pb2.Event.FromString(raw[at + 12 : at + 12 + length])
            at += 12 + length + 4  # length, its crc, the record, its crc
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_csv_and_tensorboard_logs_read_back_to_the_history(tmp_path):
    pytest.importorskip("tensorboardX")
    trainer = make()
    epochs = ft.train.CSVLogger(tmp_path / "epochs.csv")
    logs = ft.train.CSVLogger(tmp_path / "logs.csv", every="log")
    board = ft.train.TensorBoardLogger(tmp_path / "runs")
    callbacks = [epochs, logs, board]
    trainer.fit(data(), epochs=1, log_every=1, progress=False, callbacks=callbacks)  # no validation yet
    trainer.save(tmp_path / "ckpt")
    history = trainer.fit(data(), epochs=2, log_every=1, validation_data=(X, Y), progress=False,
                          callbacks=callbacks)  # epochs= counts the whole job: one more
    rows = read_csv(tmp_path / "epochs.csv")
    assert list(rows[0]) == ["epoch", "step", "learning_rate", "loss", "val_loss"]  # header extended
    assert rows[0]["val_loss"] == "" and [int(r["step"]) for r in rows] == history.epochs["last_step"]
    for name in ("loss", "val_loss"):  # exact: read back, the history's numbers
        assert [float(r[name]) for r in rows[1:]] == history.epochs[name][1:]
    steps = read_csv(tmp_path / "logs.csv")
    assert [int(r["step"]) for r in steps] == history.steps["step"] == list(range(1, 7))
    assert [float(r["loss"]) for r in steps] == history.steps["loss"]
    assert [float(r["learning_rate"]) for r in steps] == history.steps["learning_rate"]

    scalars = read_events(tmp_path / "runs")
    assert sorted(scalars) == ["epoch/learning_rate", "epoch/loss", "epoch/val_loss", "step/learning_rate", "step/loss"]
    assert [s for s, _ in scalars["step/loss"]] == list(range(1, 7))
    np.testing.assert_array_equal([v for _, v in scalars["step/loss"]], np.asarray(history.steps["loss"], np.float32))
    assert scalars["epoch/val_loss"] == [(6, np.float32(history.epochs["val_loss"][1]))]

    # A restarted job: the steps past the checkpoint are dropped and written again, equal,
    # with append=True and with the default (a restored trainer's first fit continues the file).
    before = (tmp_path / "epochs.csv").read_text()
    for append in (True, False):
        restarted = make().restore(tmp_path / "ckpt")
        resumed = ft.train.CSVLogger(tmp_path / "epochs.csv", append=append)
        restarted.fit(data(), epochs=2, log_every=1, validation_data=(X, Y), progress=False, callbacks=[resumed])
        assert (tmp_path / "epochs.csv").read_text() == before


_FIT_CELL = """
history = trainer.fit(ft.train.batches((X, Y), 8, key=jax.random.key(2)), epochs={epochs}, progress=False,
                      callbacks=[ft.train.CSVLogger(path)])
"""


def test_a_fit_cell_run_again_with_more_epochs_keeps_the_first_fits_rows(tmp_path):
    """A notebook: the cell making the logger and fitting, run again with ``epochs=2``. The new
    logger wiped the file (the trainer was not restored), so it held epoch 2's row alone while
    the history held both. A job that has run steps continues the file, as a restored one."""
    ns = {"ft": ft, "jax": jax, "X": X, "Y": Y, "trainer": make(), "path": tmp_path / "new" / "log.csv"}
    for epochs in (1, 2):
        exec(compile(_FIT_CELL.format(epochs=epochs), "<cell>", "exec"), ns)
    rows = read_csv(ns["path"])
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert [float(r["loss"]) for r in rows] == ns["history"].epochs["loss"]
    # a new job (a fresh trainer at step 0) starts the file anew
    ns["trainer"] = make()
    exec(compile(_FIT_CELL.format(epochs=1), "<cell>", "exec"), ns)
    assert [int(r["epoch"]) for r in read_csv(ns["path"])] == [1]
    # append=True into a folder not made yet (its first row failed: FileNotFoundError on log.csv.tmp)
    ns["path"] = tmp_path / "other" / "log.csv"
    exec(compile(_FIT_CELL.format(epochs=2).replace("CSVLogger(path)", "CSVLogger(path, append=True)"), "<cell>", "exec"), ns)
    assert [int(r["epoch"]) for r in read_csv(ns["path"])] == [2]


def test_logger_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r'every is "epoch" \(a row per epoch end\) or "log"'):
        ft.train.CSVLogger(tmp_path / "log.csv", every="step")
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    trainer = make()
    with pytest.raises(ValueError, match=r'the file exists but is not a CSV log with a "step" column '
                                         r"\(its header is \['a', 'b'\]\)"):
        ft.train.CSVLogger(tmp_path / "data.csv", append=True).on_train_begin(trainer)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(ImportError, match=r'(?s)tensorboardX, which is not installed .*pip install "functree\[tensorboard\]"'):
        ft.train.TensorBoardLogger(tmp_path / "runs")


def tensorboard_scalars(directory):
    """``{tag: [(step, value)]}`` as TensorBoard shows ``directory``: its own
    ``EventAccumulator`` where installed, else its rule on the event protos read in file
    name order (a ``SessionLog.START`` at step ``p``, a writer's ``purge_step``, drops the
    points read before it at steps >= ``p``; ``event_accumulator._Purge``)."""
    try:
        event_accumulator: Any = importlib.import_module("tensorboard.backend.event_processing.event_accumulator")
    except ImportError:
        event_accumulator = None
    if event_accumulator is not None:
        acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    event_pb2: Any = importlib.import_module("tensorboardX.proto.event_pb2")

    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at : at + 8])
            event = event_pb2.Event.FromString(raw[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [p for p in points if p[0] < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_a_new_jobs_tensorboard_log_hides_the_earlier_jobs_points(tmp_path):
    """A notebook's Trainer cell run again with ``TensorBoardLogger(logdir)``: the new job's
    points were written beside the old job's at the same steps, and TensorBoard drew both, one
    zigzag line of two jobs, where a CSVLogger starts its file anew. A new job's writer purges
    from step 1 (tensorboardX's purge_step): TensorBoard shows the new job's points alone."""
    pytest.importorskip("tensorboardX")
    losses = []
    for lr in (0.1, 0.3):  # the cell edited and run again
        trainer = ft.train.Trainer({"w": jnp.zeros((2, 1))}, ft.optim.Optimizer(ft.optim.sgd(lr)), loss_fn)
        history = trainer.fit(data(), epochs=1, log_every=1, progress=False,
                              callbacks=[ft.train.TensorBoardLogger(tmp_path / "runs")])
        losses.append(np.asarray(history.steps["loss"], np.float32))
    assert not np.array_equal(*losses)
    scalars = tensorboard_scalars(tmp_path / "runs")
    assert [s for s, _ in scalars["step/loss"]] == [1, 2, 3]
    np.testing.assert_array_equal([v for _, v in scalars["step/loss"]], losses[1])


@pytest.mark.parametrize("stop, log_every, first_every", [
    (3, 1, None),   # a checkpoint at epoch 1's last step (3, a log point): its end runs again
    (6, 2, None),   # at epoch 2's last step (6, no log point there)
    (3, 1, "log"),  # the first run wrote no epoch record: the resumed one writes it once
    (2, 1, None),   # mid-epoch
    (4, 2, None),
])
def test_a_resumed_tensorboard_log_equals_the_uninterrupted_one(tmp_path, monkeypatch, stop, log_every, first_every):
    """A job stopped after its checkpoint at step ``stop`` (``fit(steps=stop)``, then its
    process gone) and resumed from it into the same logdir shows what the uninterrupted
    job shows: each tag one point per step, the same values. The old logger purged from
    ``stop + 1`` only: a checkpoint at an epoch's last step (written before the epoch's
    end) left the earlier run's epoch record at ``stop``, and the resumed run, ending that
    epoch again, wrote a second point there (epoch/loss at step 3: two points). Every
    file is named in one second and the writers are numbered from 8 (the first run's
    file is 9, the resumed one's 10): TensorBoard reads them in name order, and the old
    names (".10" before ".9") put the resumed run's purge before the run it purges."""
    pytest.importorskip("tensorboardX")
    from tensorboardX import event_file_writer

    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1.7e9))
    monkeypatch.setattr(_loggers, "_WRITERS", itertools.count(8))
    fit = {"epochs": 3, "log_every": log_every, "progress": False}
    make().fit(data(), **fit, callbacks=[ft.train.TensorBoardLogger(tmp_path / "straight")])
    first = [ft.train.TensorBoardLogger(tmp_path / "run", every=first_every),
             ft.train.ModelCheckpoint(tmp_path / "ckpt", every_steps=stop)]
    make().fit(data(), **{**fit, "epochs": None}, steps=stop, callbacks=first)
    resumed = make().restore(tmp_path / "ckpt")
    assert resumed.steps_run == stop
    resumed.fit(data(), **fit, callbacks=[ft.train.TensorBoardLogger(tmp_path / "run")])

    want, got = tensorboard_scalars(tmp_path / "straight"), tensorboard_scalars(tmp_path / "run")
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        steps = [s for s, _ in got[tag]]
        assert steps == [s for s, _ in points] and len(set(steps)) == len(steps), tag
        # the same job resumed bit for bit (measured spread: 0.0), the carried points as written
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in points], rtol=0, atol=0)


def test_a_log_under_home_or_relative_is_written_where_the_call_said(tmp_path, monkeypatch, home_and_work):
    """``CSVLogger("~/runs/log.csv")`` wrote ``./~/runs/log.csv`` (a folder named ``~``, often
    removed with ``rm -rf ~``), and a relative path given before a notebook's ``os.chdir``
    was written under the new working directory: each is read at the constructor now."""
    pytest.importorskip("tensorboardX")
    (home, work), other = home_and_work, tmp_path / "other"
    other.mkdir()
    callbacks = [ft.train.CSVLogger("~/runs/log.csv"), ft.train.TensorBoardLogger("~/board"),
                 ft.train.CSVLogger("relative.csv")]
    monkeypatch.chdir(other)  # after the loggers were made, before fit writes
    history = make().fit(data(), epochs=1, log_every=1, progress=False, callbacks=callbacks)
    assert sorted(os.listdir(home)) == ["board", "runs"] and os.listdir(other) == []
    assert os.listdir(work) == ["relative.csv"]
    for path in (home / "runs" / "log.csv", work / "relative.csv"):
        assert [float(r["loss"]) for r in read_csv(path)] == history.epochs["loss"]
    assert read_events(home / "board")["epoch/loss"] == [(3, np.float32(history.epochs["loss"][0]))]


def test_an_epoch_row_names_the_rate_its_last_step_applied_not_one_a_callback_set_after(tmp_path):
    pytest.importorskip("tensorboardX")

    class Halve(ft.train.Callback):  # a per-step schedule ported from on_batch_end: the next step's rate
        def on_log(self, trainer, context):
            rate = ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]
            trainer.opt_state = ft.optim.set_hyperparameters(trainer.opt_state, learning_rate=rate / 2)

    seen = []
    trainer = make()
    csv_log = ft.train.CSVLogger(tmp_path / "epochs.csv")
    history = trainer.fit(data(), epochs=2, log_every=1, progress=False,
                          callbacks=[Halve(), csv_log, ft.train.TensorBoardLogger(tmp_path / "runs"), seen.append])
    applied = dict(zip(history.steps["step"], history.steps["learning_rate"]))
    np.testing.assert_allclose(history.steps["learning_rate"], [0.1 / 2**i for i in range(6)], rtol=1e-6)
    rows = read_csv(tmp_path / "epochs.csv")
    assert [float(r["learning_rate"]) for r in rows] == [applied[3], applied[6]]  # 0.025, 0.003125: steps 3, 6
    scalars = read_events(tmp_path / "runs")
    assert scalars["epoch/learning_rate"] == [(s, v) for s, v in scalars["step/learning_rate"] if s in (3, 6)]
    assert [(c.event, c.step, c.learning_rate) for c in seen if c.event != "log"] == [
        ("epoch", 3, applied[3]), ("epoch", 6, applied[6])]


def test_an_interrupted_fit_leaves_its_tensorboard_steps_on_disk(tmp_path):
    """Ctrl-C in a notebook, then a look at TensorBoard: the event file stayed open and
    tensorboardX flushes every 2 minutes, so the steps since the last epoch end (here both
    steps of the interrupted fit) were not on disk. A fit ended by an exception closes its
    event files; the next fit writes on in another."""
    pytest.importorskip("tensorboardX")

    class Interrupt(ft.train.Callback):
        def on_log(self, trainer, context):
            if context.step == 2:
                raise KeyboardInterrupt

    trainer, board = make(), ft.train.TensorBoardLogger(tmp_path / "runs")
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data(), epochs=1, log_every=1, progress=False, callbacks=[board, Interrupt()])
    assert [s for s, _ in read_events(tmp_path / "runs")["step/loss"]] == [1, 2]  # main: no scalar
    history = trainer.fit(data(), epochs=1, log_every=1, progress=False, callbacks=[board])
    scalars = read_events(tmp_path / "runs")
    assert [s for s, _ in scalars["step/loss"]] == [1, 2, 3] and [s for s, _ in scalars["epoch/loss"]] == [3]
    np.testing.assert_array_equal([v for _, v in scalars["step/loss"]], np.asarray(history.steps["loss"], np.float32))
