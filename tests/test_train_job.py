"""A training job you can trust (issue 27, items 1-4): checkpoints at exactly the steps
asked holding exactly that step, resume bit for bit from any of them (in-process kills and
a SIGKILL'd subprocess), callback and user state in the checkpoint, fit(epochs/steps) as
the job's total, and interrupts (Ctrl-C, exceptions, SIGTERM) that never lose the model."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import _train_job as job
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import functree as ft

HERE = Path(__file__).parent

# Every job of this file trains on minibatches of 10 examples and logs every LOG steps: the
# programs (one per configuration, batch shape and log buffer, which holds log_every +
# steps_per_call - 1 rows) compile once for the whole file (_train_job shares its TrainSteps),
# not once per test. Epochs of 2, 3 or 4 minibatches take the first 20, 30 or 40 examples.
SIZE, LOG = 10, 2


def data(kind: str, n_batches: int, kill_after: int | None = None):
    """``job.data`` with minibatches of SIZE examples whatever ``n_batches`` (for 4, the
    same data as ``job.data``: the subprocess jobs of this file are resumed here)."""
    bomb = job.Bomb(kill_after)
    x, y = job.X[:n_batches * SIZE], job.Y[:n_batches * SIZE]
    if kind == "batches":
        return job.KilledBatches(bomb, (x, y), SIZE, shuffle=True, key=jax.random.key(3), drop_last=True)
    items = [(x[i * SIZE:(i + 1) * SIZE], y[i * SIZE:(i + 1) * SIZE]) for i in range(n_batches)]
    return {"list": job.KilledList, "reiterable": job.Reiterable, "positioned": job.Positioned}[kind](items, bomb)


def fit(t, config, directory, kill_after=None):
    """``job.fit`` (its checkpoint, early stopping and history log) on :func:`data`."""
    with mock.patch.object(job, "data", data):
        return job.fit(t, config, directory, kill_after)


def leaves(t):
    return [np.asarray(x) for x in jax.tree.leaves((t.model, t.opt_state))]


def assert_same_job(a, b, stop_a=None, stop_b=None):
    """Model, optimizer state, history and position equal bit for bit."""
    assert (a.steps_run, a.epoch, a.batch_in_epoch) == (b.steps_run, b.epoch, b.batch_in_epoch)
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert json.dumps(a.history.steps) == json.dumps(b.history.steps)
    assert json.dumps(a.history.epochs) == json.dumps(b.history.epochs)
    if stop_a is not None:
        assert stop_a.state_dict() == stop_b.state_dict()


def resume(config, directory):
    """A fresh trainer restored from the latest checkpoint (if any), run to the end."""
    t = job.trainer(config["accumulate"], config["steps_per_call"])
    if ft.train.CheckpointManager(directory).latest_step() is not None:
        assert t.restore(directory) is t
    else:  # killed before its first checkpoint: the job starts again, with a new log
        Path(str(directory) + "-log.jsonl").unlink(missing_ok=True)
    callbacks = fit(t, config, directory)
    return t, callbacks


@pytest.fixture(scope="module")
def straight_job(tmp_path_factory):
    """``run(config) -> (trainer, callbacks, directory)``: the job run straight through,
    once per configuration for the module (its kill points all compare with it)."""
    done = {}

    def run(config):
        name = json.dumps(config, sort_keys=True)
        if name not in done:
            directory = tmp_path_factory.mktemp("straight") / "job"
            t = job.trainer(config["accumulate"], config["steps_per_call"])
            done[name] = t, fit(t, config, directory), directory
        return done[name]

    return run


CONFIGS = st.fixed_dictionaries({
    "every_steps": st.integers(1, 4), "log_every": st.just(LOG),
    "steps_per_call": st.sampled_from([1, 2]), "accumulate": st.sampled_from([1, 2]), "n_batches": st.integers(2, 4),
    "kind": st.sampled_from(["batches", "list", "reiterable", "positioned"]),
    "epochs": st.just(3), "min_delta": st.sampled_from([0.0, 0.05]),
})
"""log_every is LOG (2) alone: a log window that a checkpoint can cut (log_every=1 has none)
and each value compiles its own programs; checkpoints every 1-4 steps fall before, at and
after log points, epochs of 2, 3 or 4 steps on and off them."""


# Explicit examples: the (2, 2) configuration for certain (the 4 derandomized draws before
# were all (1, 1), two of them killed before the first step), kills mid-epoch and just before
# the end; each drawn example adds one more.
@example(config={"every_steps": 3, "log_every": LOG, "steps_per_call": 2, "accumulate": 2, "n_batches": 3,
                 "kind": "positioned", "epochs": 3, "min_delta": 0.0}, kill=0.5)
@example(config={"every_steps": 2, "log_every": LOG, "steps_per_call": 2, "accumulate": 2, "n_batches": 4,
                 "kind": "reiterable", "epochs": 3, "min_delta": 0.05}, kill=0.7)
@example(config={"every_steps": 3, "log_every": LOG, "steps_per_call": 1, "accumulate": 1, "n_batches": 3,
                 "kind": "list", "epochs": 3, "min_delta": 0.0}, kill=1.0)
@settings(max_examples=examples(2), deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(config=CONFIGS, kill=st.floats(0, 1))
def test_kill_anywhere_then_resume_equals_the_uninterrupted_job(tmp_path_factory, straight_job, config, kill):
    config["accumulate"] = config["steps_per_call"]  # two compiled configurations: (1, 1) and (2, 2)
    root = tmp_path_factory.mktemp("job")
    straight, straight_cbs, straight_dir = straight_job(config)  # shared by the kill points of one config
    total = straight.steps_run
    killed = job.trainer(config["accumulate"], config["steps_per_call"])
    with pytest.raises(RuntimeError, match="killed"):
        fit(killed, config, root / "run", kill_after=int(kill * (total - 1)))
    resumed, cbs = resume(config, root / "run")
    assert_same_job(straight, resumed, straight_cbs[1], cbs[1])
    # checkpoints at exactly k, 2k, ... (and the end), the same in both directories
    steps = ft.train.CheckpointManager(straight_dir).all_steps()
    k = config["every_steps"]
    assert steps == sorted({*range(k, total + 1, k), total})
    assert ft.train.CheckpointManager(root / "run").all_steps() == steps
    # the HistoryLogger's file continues exactly (its state cut off what came after the checkpoint)
    assert (root / "run-log.jsonl").read_text() == Path(str(straight_dir) + "-log.jsonl").read_text()


def test_checkpoint_labelled_s_holds_exactly_step_s(tmp_path):
    """Regression: every_steps=8, log_every=8 saved [16, 32, 48]; each checkpoint now holds
    the model after its own step (compared with a run stopped there)."""
    config = {"every_steps": 3, "log_every": 2, "steps_per_call": 2, "accumulate": 2, "n_batches": 4,
              "kind": "batches", "epochs": 3, "min_delta": 0.0}
    t = job.trainer(2, 2)
    fit(t, config, tmp_path / "a")
    manager = ft.train.CheckpointManager(tmp_path / "a")
    assert manager.all_steps() == [3, 6, 9, 12]
    for step in (3, 6, 9):
        short = job.trainer(2, 2)
        short.fit(data("batches", 4), steps=step, log_every=LOG, progress=False, steps_per_call=2)
        saved = manager.restore(step)
        for x, y in zip(jax.tree.leaves(saved.model), jax.tree.leaves(short.model)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert (saved.config["trainer"]["epoch"], saved.config["trainer"]["batch_in_epoch"]) == (
            short.epoch, short.batch_in_epoch)


def test_callbacks_see_the_model_of_their_step():
    """Regression: with log_every=1, on_log for step 1 saw the model after step 2."""
    seen = []

    class Weights(ft.train.Callback):
        def on_log(self, trainer, context):
            seen.append((context.step, trainer.steps_run, np.asarray(trainer.model.layers[0].weight)))

    t = job.trainer()
    t.fit(job.data("list", 4), epochs=1, log_every=1, progress=False, callbacks=[Weights()])
    assert [s for s, _, _ in seen] == [1, 2, 3, 4] and all(s == r for s, r, _ in seen)
    short = job.trainer()
    short.fit(job.data("list", 4), steps=2, log_every=1, progress=False)  # the programs of the fit above
    np.testing.assert_array_equal(seen[1][2], np.asarray(short.model.layers[0].weight))


def test_nothing_is_written_past_a_nan_stop(tmp_path):
    """Regression: NaN at step 7 left a checkpoint labelled 8 holding step 6's model."""
    x = np.ones((8, 3), np.float32)
    y = np.ones((8, 1), np.float32)
    y[6] = np.nan  # the 7th minibatch of 1 example
    t = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                         lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    save = ft.train.ModelCheckpoint(tmp_path / "c", every_steps=2, max_to_keep=None)
    with pytest.raises(ft.train.NonFiniteError, match="step 7"):
        t.fit(ft.train.batches((x, y), 1, shuffle=False), epochs=1, log_every=4, progress=False,
              callbacks=[save])
    assert save.manager.all_steps() == [2, 4, 6] and t.steps_run == 6
    for a, b in zip(jax.tree.leaves(save.manager.restore(6).model), jax.tree.leaves(t.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_at_an_epochs_last_step_and_fit_counts_the_whole_job(tmp_path, caplog):
    """Regressions: a checkpoint at an epoch's last step could not be resumed ("no
    minibatch"); restore + fit(epochs=N) trained N more epochs; a re-iterable replayed the
    epoch from batch 0; iter(data) was called N + 1 times."""
    calls = []

    class Counted(list):
        def __iter__(self):
            calls.append(1)
            return super().__iter__()

    data = Counted(job._list(4))
    straight = job.trainer()
    straight.fit(data, epochs=3, log_every=LOG, progress=False)
    assert len(calls) == 3
    first = job.trainer()
    first.fit(data, steps=4, log_every=LOG, progress=False)  # the end of epoch 1's steps
    first.save(tmp_path / "end")
    first.fit(data, steps=6, log_every=LOG, progress=False)  # mid-epoch
    first.save(tmp_path / "mid")
    for name in ("end", "mid"):
        for run in range(2):  # the restart recipe, run twice, ends where the job ends
            t = job.trainer().restore(tmp_path / name)
            t.fit(data, epochs=3, log_every=LOG, progress=False)
            assert_same_job(straight, t)
            t.save(tmp_path / f"{name}{run}")
    with caplog.at_level(logging.WARNING, logger="functree.train"):
        t = job.trainer().restore(tmp_path / "mid0")
        t.fit(data, epochs=3, log_every=LOG, progress=False)
    assert "nothing to train, the job has already run 3 epochs" in caplog.text
    assert t.steps_run == 12


def test_positioned_iterator_and_one_shot_generator(tmp_path):
    items = job._list(4)
    straight = job.trainer()
    straight.fit(iter(items * 3), steps=12, log_every=LOG, progress=False)
    t = job.trainer()
    stream = job.PositionedIterator(items * 3, job.Bomb(None))
    t.fit(stream, steps=5, log_every=LOG, progress=False)
    t.save(tmp_path / "c")
    assert t.checkpoint is None and job.trainer().restore(tmp_path / "c").checkpoint.step == 5
    resumed = job.trainer().restore(tmp_path / "c")
    resumed.fit(job.PositionedIterator(items * 3, job.Bomb(None)), steps=12, log_every=LOG, progress=False)
    for x, y in zip(leaves(straight), leaves(resumed)):
        np.testing.assert_array_equal(x, y)
    with pytest.warns(UserWarning, match=r"one-shot iterator that cannot report(.|\n)*islice"):
        job.trainer().restore(tmp_path / "c").fit(iter(items * 3), steps=12, log_every=LOG, progress=False)


def test_callback_state_and_extra_in_the_checkpoint(tmp_path):
    """Regression: callback state was not saved (EarlyStopping restarted its patience)."""
    t = job.trainer()
    stop = ft.train.EarlyStopping(monitor="loss", patience=3)
    save = ft.train.ModelCheckpoint(tmp_path / "c", extra=lambda tr: {"seen": tr.steps_run * 2, "w": jnp.ones(2)})
    t.fit(job.data("list", 4), epochs=2, log_every=LOG, progress=False, callbacks=[stop, save])
    back = job.trainer().restore(tmp_path / "c")
    assert back.extra["seen"] == 16 and back.checkpoint.step == 8
    np.testing.assert_array_equal(back.extra["w"], np.ones(2))
    fresh = ft.train.EarlyStopping(monitor="loss", patience=3)
    back.fit(job.data("list", 4), epochs=2, log_every=LOG, progress=False, callbacks=[fresh, save])  # already done
    assert fresh.state_dict() == stop.state_dict()
    with pytest.raises(ValueError, match=r"(?s)callback 'EarlyStopping\[0\]' \(EarlyStopping\).*"
                                          r"callbacks=False"):
        job.trainer().restore(tmp_path / "c").fit(job.data("list", 4), epochs=3, log_every=LOG, progress=False,
                                                   callbacks=[save, ft.train.ReduceLROnPlateau("loss")])
    named = ft.train.EarlyStopping(monitor="loss", patience=3)
    named.name = "EarlyStopping[0]"
    job.trainer().restore(tmp_path / "c").fit(job.data("list", 4), epochs=2, log_every=LOG, progress=False,
                                             callbacks=[save, named])
    assert named.state_dict() == stop.state_dict()
    job.trainer().restore(str(tmp_path / "c"), callbacks=False).fit(job.data("list", 4), epochs=3, log_every=LOG,
                                                             progress=False)
    with pytest.raises(TypeError, match=r"extra\['note'\] is str"):
        t.save(tmp_path / "d", extra={"note": "hi"})
    with pytest.raises(ValueError, match=r"EarlyStopping.load_state_dict got \['x'\]"):
        stop.load_state_dict({"x": 1})
    with pytest.raises(ValueError, match=r"every_steps=0"):
        ft.train.ModelCheckpoint(tmp_path / "e", every_steps=0)
    with pytest.raises(ValueError, match=r"every_epochs=0"):
        ft.train.ModelCheckpoint(tmp_path / "e", every_epochs=0)
    epochs = ft.train.ModelCheckpoint(tmp_path / "f", every_epochs=2, max_to_keep=None)
    job.trainer().fit(job.data("list", 4), epochs=3, log_every=LOG, progress=False, callbacks=[epochs])
    assert epochs.manager.all_steps() == [8, 12]  # the end of epoch 2, the end of training


def test_restored_data_must_keep_its_length(tmp_path):
    t = job.trainer()
    t.fit(job.data("list", 4), steps=2, log_every=LOG, progress=False)
    t.save(tmp_path / "c")
    with pytest.raises(ValueError, match=r"4 minibatches per epoch, but fit was given 5"):
        job.trainer().restore(tmp_path / "c").fit(job.data("list", 5), epochs=2, log_every=LOG, progress=False)


def test_exceptions_leave_a_trainer_that_continues(tmp_path):
    """Regression: an exception at an epoch's end (bad validation data, a failing callback)
    left a trainer that could not fit again ("no minibatch")."""
    data = job.data("batches", 4)
    straight = job.trainer()
    straight.fit(data, epochs=2, log_every=LOG, progress=False)

    class Fails(ft.train.Callback):
        def on_epoch_end(self, trainer, context):
            raise RuntimeError("callback failed")

    t = job.trainer()
    with pytest.raises(ValueError):
        t.fit(data, epochs=2, log_every=LOG, progress=False, validation_data=(np.ones((2, 5), np.float32),))
    assert (t.steps_run, t.epoch) == (4, 0)
    t.save(tmp_path / "c")
    ended = job.trainer().restore(tmp_path / "c")
    ended.fit(data, steps=4, log_every=LOG, progress=False)  # the job's steps all ran, but not its epoch's end
    assert (ended.steps_run, ended.epoch) == (4, 1)
    with pytest.raises(RuntimeError, match="callback failed"):
        t.fit(data, epochs=2, log_every=LOG, progress=False, callbacks=[Fails()])
    assert (t.steps_run, t.epoch) == (4, 1)
    t.fit(data, epochs=2, log_every=LOG, progress=False)
    for x, y in zip(leaves(straight), leaves(t)):
        np.testing.assert_array_equal(x, y)
    resumed = job.trainer().restore(tmp_path / "c")
    resumed.fit(data, epochs=2, log_every=LOG, progress=False)
    for x, y in zip(leaves(straight), leaves(resumed)):
        np.testing.assert_array_equal(x, y)


def test_sigterm_saves_at_the_current_step_and_stops(tmp_path):
    class Preempt(ft.train.Callback):
        reads_model = False

        def on_log(self, trainer, context):
            if context.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    t = job.trainer()
    save = ft.train.ModelCheckpoint(tmp_path / "c", every_steps=100)
    t.fit(job.data("batches", 4), epochs=3, log_every=1, progress=False, callbacks=[Preempt(), save])
    assert t.preempted and signal.getsignal(signal.SIGTERM) is before
    assert save.manager.all_steps() == [t.steps_run] and 3 <= t.steps_run < 12
    straight = job.trainer()
    straight.fit(job.data("batches", 4), epochs=3, log_every=LOG, progress=False)
    resumed = job.trainer().restore(tmp_path / "c")
    resumed.fit(job.data("batches", 4), epochs=3, log_every=LOG, progress=False, callbacks=[save])
    for x, y in zip(leaves(straight), leaves(resumed)):
        np.testing.assert_array_equal(x, y)


# One child for the subprocess scenarios (each new process starts JAX and compiles again,
# ~4 CPU-s): the digests of PROGRAM_CONFIG's step program first (written to a file, for
# test_a_restored_job_runs_the_very_program_of_the_uninterrupted_one); then, once told "go"
# on its stdin (only the SIGKILL test asks), the Ctrl-C trials, then two checkpointing jobs
# side by side in threads, so that one SIGKILL lands at a random moment of each.
CHILD = """
import json, sys, threading
import _train_job as job

job._program(json.loads(sys.argv[1]), sys.argv[2], out=sys.argv[3])
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
job._sigint(int(sys.argv[4]), int(sys.argv[5]))  # first, in the main thread (where signals land)
runs = json.loads(sys.argv[6])
for _, config in runs:  # compile each job's programs before either job starts
    spc = config["steps_per_call"]
    job.trainer(config["accumulate"], spc).fit(job.data(config["kind"], config["n_batches"]), steps=2 * spc,
                                               log_every=config["log_every"], steps_per_call=spc, progress=False)
jobs = [threading.Thread(target=job._sigkill, args=run) for run in runs]
for thread in jobs:
    thread.start()
for thread in jobs:
    thread.join()
"""

PROGRAM_CONFIG = {"every_steps": 3, "log_every": LOG, "steps_per_call": 1, "accumulate": 2, "n_batches": 4,
                  "kind": "positioned", "epochs": 3, "min_delta": 0.0}

KILLED_CONFIGS = [  # minibatches of 10 (n_batches=4: the same data here and in the child)
    {"every_steps": 3, "log_every": LOG, "steps_per_call": 1, "accumulate": 1, "n_batches": 4,
     "kind": "batches", "epochs": 6, "min_delta": 0.0},
    {"every_steps": 4, "log_every": LOG, "steps_per_call": 2, "accumulate": 2, "n_batches": 4,
     "kind": "positioned", "epochs": 6, "min_delta": 0.0},
]


class Child(NamedTuple):
    process: subprocess.Popen
    program: Path  # where the child writes its step program's digests
    runs: list  # (directory, config) of the jobs it runs once told "go"


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """The subprocess of :data:`CHILD`, another PYTHONHASHSEED than this process's (its
    programs must not depend on the process), killed at the module's end."""
    root = tmp_path_factory.mktemp("child")
    runs = [(str(root / f"run{i}"), c) for i, c in enumerate(KILLED_CONFIGS)]
    env = dict(job.child_env(str(HERE.parent), str(HERE)), PYTHONHASHSEED="7")  # the child's programs are ours
    args = [json.dumps(PROGRAM_CONFIG), str(root / "program-job"), str(root / "program.json"), 20, 0, json.dumps(runs)]
    process = subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield Child(process, root / "program.json", runs)
    if process.poll() is None:
        process.kill()
    process.communicate()


def _has_checkpoint(directory: str) -> bool:
    """Whether the job at ``directory`` has saved a checkpoint: its manager says so (opened
    only once a step's folder is there: a manager per poll cost ~0.7 CPU-s a test)."""
    steps = os.listdir(directory) if os.path.isdir(directory) else []
    return any(name.isdigit() for name in steps) and ft.train.CheckpointManager(directory).latest_step() is not None


@pytest.mark.slow
def test_sigkill_and_sigint_in_subprocesses(child, straight_job):
    """A real SIGKILL at a random moment of two jobs, resumed here bit for bit; and 20
    Ctrl-Cs at random moments of a dispatch-bound fit: no lost model, no stuck trainer."""
    process, _, runs = child
    process.stdin.write("go\n")
    process.stdin.flush()
    deadline = time.monotonic() + 300
    while not all(_has_checkpoint(d) for d, _ in runs):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the jobs never saved a checkpoint: {process.communicate()}")
        time.sleep(0.05)
    time.sleep(float(np.random.default_rng(1).uniform(0, 0.3)))
    process.send_signal(signal.SIGKILL)
    out, err = process.communicate()  # waits, and closes its pipes
    for directory, config in runs:
        resumed, cbs = resume(config, directory)
        straight, straight_cbs, _ = straight_job(config)
        assert_same_job(straight, resumed, straight_cbs[1], cbs[1])
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert report == {"trials": 20, "interrupted": report["interrupted"], "lost": 0, "stuck": 0,
                      "equal": 20}, err
    assert report["interrupted"] >= 5, report  # the others landed after fit (timing varies with load)


class _Compiles(logging.Handler):
    """The programs XLA compiles while attached to JAX's logger (caches kept)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Compiling"):
            self.names.append(record.getMessage()[:120])


def test_a_restored_job_runs_the_very_program_of_the_uninterrupted_one(tmp_path, child):
    """Resume is bit for bit on every backend only if the restored job runs the program the
    uninterrupted one runs (issue 44 item 3: on a GPU another program is compiled and
    autotuned again, and may round otherwise). The restored arrays are keyed as the
    step's own outputs (dtype, shape, weak type, sharding, committed), the resumed fit
    compiles nothing, and the step program's lowered and compiled text is the same here,
    after the restore, and in a fresh process (another PYTHONHASHSEED: the module's child)."""
    config = PROGRAM_CONFIG
    straight = job.trainer(config["accumulate"], config["steps_per_call"])
    job.fit(straight, config, tmp_path / "straight")
    resumed = job.trainer(config["accumulate"], config["steps_per_call"]).restore(tmp_path / "straight", step=6)
    assert job.signature((resumed.model, resumed.opt_state, resumed.key)) == job.signature(
        (straight.model, straight.opt_state, straight.key))
    handler, logger = _Compiles(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            job.fit(resumed, config, tmp_path / "resumed")
    finally:
        logger.removeHandler(handler)
    assert handler.names == []
    assert_same_job(straight, resumed)
    batch = (job.X[:SIZE], job.Y[:SIZE])
    here = job.step_program(straight, batch)
    assert job.step_program(resumed, batch) == here
    deadline = time.monotonic() + 300
    while not child.program.exists():  # written whole (a rename) by the child's first scenario
        if child.process.poll() is not None or time.monotonic() > deadline:
            child.process.kill()
            pytest.fail(f"the child wrote no program: {child.process.communicate()}")
        time.sleep(0.05)
    assert json.loads(child.program.read_text()) == here


# --- the job's state (issue 38): one record, saved and restored as it is ------------------------

OLD_CHECKPOINT = HERE / "data" / "trainer_checkpoint_v2"
"""Written by the Trainer before issue 38 (commit 1af39ba), which gathered the job from its
attributes: ``job.trainer()`` fit on ``ft.train.batches((job.X, job.Y), 10, key=key(3))``
with ``steps=7, log_every=2`` and ``[EarlyStopping(monitor="loss", patience=5),
ModelCheckpoint(dir, every_steps=3, max_to_keep=1, extra=lambda t: {"rounds": 3, "w":
np.arange(2.0)})]``: step 7, mid-epoch 2, with a window mean and a callback state."""


def test_a_checkpoint_written_before_job_state_restores_and_continues_bit_for_bit(tmp_path):
    import shutil

    directory = tmp_path / "old"
    shutil.copytree(OLD_CHECKPOINT, directory)  # a manager may write to its directory
    state = ft.train.JobState.restore(directory)
    assert (state.steps_run, state.epoch, state.batch_in_epoch, state.since_log) == (7, 1, 3, 1)
    assert state.window.weight == 10.0 and state.epoch_means.weight == 30.0 and state.epoch_length == 4
    assert state.extra["rounds"] == 3 and [c[:2] for c in state.callbacks] == [("EarlyStopping[0]", "EarlyStopping")]
    assert state.history.steps["step"] == list(range(1, 8)) and state.history.epochs["last_step"] == [4]
    data = ft.train.batches((job.X, job.Y), 10, key=jax.random.key(3))
    straight, stop_a = job.trainer(), ft.train.EarlyStopping(monitor="loss", patience=5)
    straight.fit(data, epochs=3, progress=False, log_every=2, callbacks=[stop_a])
    resumed, stop_b = job.trainer().restore(directory), ft.train.EarlyStopping(monitor="loss", patience=5)
    assert resumed.checkpoint.step == 7
    resumed.save(tmp_path / "new")  # the old job in today's format, at step 7
    again, stop_c = job.trainer().restore(tmp_path / "new"), ft.train.EarlyStopping(monitor="loss", patience=5)
    for t, stop in ((resumed, stop_b), (again, stop_c)):
        t.fit(data, epochs=3, progress=False, log_every=2, callbacks=[stop])
    # Bit for bit: the old checkpoint continues exactly as the same job saved today does
    # (nothing of the job is lost reading the old format) ...
    assert_same_job(again, resumed, stop_c, stop_b)
    # ... and as the job run straight through here. The fixture's first 7 steps ran on the
    # machine that wrote it (another CPU sums in another order), so the numbers agree to
    # rounding, the job's position, history's steps and callbacks exactly.
    assert (straight.steps_run, straight.epoch, straight.batch_in_epoch) == (resumed.steps_run, resumed.epoch,
                                                                            resumed.batch_in_epoch)
    for x, y in zip(leaves(straight), leaves(resumed), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.inexact):
            np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * max(1.0, float(np.max(np.abs(x), initial=0))))
        else:
            np.testing.assert_array_equal(y, x)
    assert straight.history.steps["step"] == resumed.history.steps["step"]
    assert stop_a.state_dict().keys() == stop_b.state_dict().keys()
    # the format is the one the old writer wrote: the same configuration layout
    # (the old keys first, in their order; after them only the keys of position fields added since)
    from functree.train._job import STORED

    old, new = (ft.train.CheckpointManager(d).restore() for d in (directory, tmp_path / "new"))
    old_keys, new_keys = list(old.config["trainer"]), list(new.config["trainer"])
    assert list(new.config) == list(old.config) and new_keys[:len(old_keys)] == old_keys
    assert set(new_keys[len(old_keys):]) <= {path[0] for path, _, _ in STORED.values()}


def test_job_state_is_one_value_that_fit_advances():
    t = job.trainer()
    first = t.state
    assert (first.steps_run, first.epoch, first.history.steps["step"]) == (0, 0, [])
    t.fit(job.data("list", 4), steps=3, progress=False, log_every=2)
    state = t.state
    assert state is not first and first.steps_run == 0  # a value: the old record is unchanged
    assert (state.steps_run, state.batch_in_epoch, state.since_log) == (3, 3, 1)
    assert state.model is t.model and state.opt_state is t.opt_state and state.key is t.key
    with pytest.raises(AttributeError):
        state.steps_run = 5  # type: ignore[misc]
    t.stop_training = True  # what a callback sets: a new record
    assert t.state.stopped and not state.stopped
    stepped = state.stepped(state.model, state.opt_state, 2)
    assert (stepped.steps_run, stepped.batch_in_epoch, stepped.since_log, stepped.epoch) == (5, 5, 3, 0)
    assert stepped.history is state.history and stepped.window == state.window


def test_job_state_restore_of_a_model_checkpoint_is_an_error(tmp_path):
    with ft.train.CheckpointManager(tmp_path / "m") as manager:
        manager.save(1, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"(?s)step 1 is a checkpoint of a model, not of a training job.*"
                                         r"CheckpointManager\(path\).restore\(\)"):
        ft.train.JobState.restore(tmp_path / "m")


@pytest.mark.parametrize("changed", ["adamw", "wrt"])
def test_a_changed_optimizer_is_refused_with_the_trainer_s_fix_which_runs(tmp_path, changed):
    """A trainer whose optimizer changed since the save was told to read the state with
    ``manager.restore(3).opt_state`` (no manager in hand, and not what continues the job)."""
    loss = lambda m, x: jnp.mean((m(x) - x) ** 2)  # noqa: E731
    make = lambda opt: ft.train.Trainer(ft.nn.Dense(3, 3, key=jax.random.key(0)), opt, loss)  # noqa: E731
    saved = make(ft.optim.adam(0.1))
    saved.save(tmp_path / "job")
    other = ft.optim.adamw(0.1) if changed == "adamw" else ft.optim.Optimizer(ft.optim.adam(0.1), wrt="weight")
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)The checkpoint's opt_state at step 0 does not fit.*"
                       r"its optimizer changed.*right:  trainer.restore\(path, optimizer_state=False\)"):
        make(other).restore(tmp_path / "job")
    restored = make(other).restore(tmp_path / "job", optimizer_state=False)
    assert bool(jnp.all(restored.model.weight == saved.model.weight)) and restored.steps_run == 0


def test_a_model_checkpoint_s_fixes_run(tmp_path):
    """NOT_A_JOB's "or: trainer.restore(path)" failed on a model-only checkpoint (no optimizer
    state in it); each fix of the message now runs, pasted."""
    path = str(tmp_path / "m")
    saved = ft.nn.Dense(3, 2, key=jax.random.key(7))
    with ft.train.CheckpointManager(path) as manager:
        manager.save(1, saved)
    with pytest.raises(ValueError, match="not of a training job") as info:
        ft.train.JobState.restore(path)
    fixes = [line.split(":", 1)[1].split("#")[0].strip() for line in str(info.value).splitlines()
             if line.strip().startswith(("right:", "or:"))]
    assert fixes[1] == "trainer.restore(path, optimizer_state=False)"
    restored = eval(fixes[0], {"ft": ft, "path": path})
    np.testing.assert_array_equal(restored.weight, saved.weight)
    trainer = ft.train.Trainer(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.optim.adam(1e-2),
                               lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    eval(fixes[1], {"trainer": trainer, "path": path})
    np.testing.assert_array_equal(trainer.model.weight, saved.weight)
    np.testing.assert_array_equal(trainer.model.bias, saved.bias)


def test_a_model_and_optimizer_checkpoint_is_no_job_for_a_trainer(tmp_path):
    """A user's loop saved model and optimizer state by epoch (manager.save(epoch, m, s));
    trainer.restore(path) read the step label 2 as steps_run and stood at step 2 of epoch 1
    (the optimizer's context at step 12): fit(epochs=3) trained 3 more epochs. Refused now;
    optimizer_state=False continues the model in a fresh job."""
    loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731
    x = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
    batches = [(x, x[:, :2])] * 6
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    model = ft.nn.Dense(3, 2, key=jax.random.key(7))
    state = opt.init(model)
    step = jax.jit(lambda m, s, b: opt.minimize(loss, m, s, b)[:2])  # one program (eager: one per operation)
    with ft.train.CheckpointManager(tmp_path / "plain") as manager:
        for epoch in (1, 2):
            for batch in batches:
                model, state = step(model, state, batch)
            manager.save(epoch, model, state)
    make = lambda: ft.train.Trainer(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.optim.adam(1e-2), loss)  # noqa: E731
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)step 2 is a checkpoint of a model .*no job position.*"
                                                       r"right:  trainer.restore\(path, optimizer_state=False\)"):
        make().restore(tmp_path / "plain")
    trainer = make().restore(tmp_path / "plain", optimizer_state=False)
    np.testing.assert_array_equal(trainer.model.weight, model.weight)
    assert (trainer.steps_run, trainer.epoch, trainer.batch_in_epoch) == (0, 0, 0)
    assert int(ft.optim.context(trainer.opt_state).step) == 0  # this trainer's optimizer state
    trainer.fit(batches, epochs=1, progress=False)
    assert trainer.steps_run == 6


def test_restoring_a_step_folder_names_the_directory_and_the_step(tmp_path):
    """trainer.restore("run/3") (a step's folder, as `ls run` shows it) said the folder was one
    tree written by ft.train.save and pointed at ft.train.load: the job's fix is the manager's
    directory and the step, which then restores step 3."""
    t = job.trainer()
    t.fit(job.data("list", 4), steps=6, log_every=LOG, progress=False,
          callbacks=[ft.train.ModelCheckpoint(tmp_path / "run", every_steps=3)])
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)run/3 is step 3 of the checkpoints in .*/run"
                                                       r".*right:  trainer.restore\(\".*/run\", step=3\)"):
        job.trainer().restore(tmp_path / "run" / "3")
    assert job.trainer().restore(tmp_path / "run", step=3).steps_run == 3


def test_callbacks_see_the_job_state_read_only():
    seen = []

    class Reads(ft.train.Callback):
        def on_epoch_end(self, trainer, context):
            seen.append(trainer.state)

    t = job.trainer()
    t.fit(job.data("list", 4), epochs=2, log_every=LOG, progress=False, callbacks=[Reads()])
    assert [(s.steps_run, s.epoch) for s in seen] == [(4, 1), (8, 2)]
    assert seen[0].history is seen[1].history  # the one member that grows in place
    assert isinstance(seen[0], ft.train.JobState) and seen[0].model is not seen[1].model


def test_job_position_round_trips_by_name_every_field_distinct(tmp_path):
    """Issue 46: the position is a record saved by field name and read by name. Every field
    set to a value no other field has comes back in its own field (a field inserted in the
    record cannot shift another's meaning), under format 2's keys."""
    from functree.train._job import STORED, JobState, Position, read_job, save_job
    from functree.train._means import Means

    assert set(STORED) == set(Position._fields)  # each field has its place on disk
    position = Position(steps_run=11, epoch=3, batch_in_epoch=5, stopped=True, since_log=2,
                        window=Means({"loss": 1.5}, 2.0, 1), epoch_means=Means({"loss": 4.25}, 3.0, 0),
                        skipped=((7, "loss"),), data_state={"pos": 13}, epoch_length=17)
    assert len(set(map(repr, position))) == len(position)
    model = {"w": jnp.arange(2.0)}
    job = JobState(model, None, None, ft.train.History(), position, extra={"rounds": 19})
    with ft.train.CheckpointManager(tmp_path / "c") as manager:
        save_job(manager, job, about={"on_nan": "skip"})
        back, ckpt = read_job(manager, None, JobState.start(model, None))
    assert back.position == position and back.extra == {"rounds": 19}
    assert (back.steps_run, back.epoch, back.batch_in_epoch, back.since_log, back.epoch_length) == (11, 3, 5, 2, 17)
    assert ckpt.config["trainer"].keys() == {"on_nan", "history", *(path[0] for path, _, _ in STORED.values())}
    assert ckpt.config["trainer"].keys() >= {"steps_run", "epoch", "batch_in_epoch", "on_nan", "stopped",
                                             "epoch_length", "since_log", "data_state", "means", "history",
                                             "skipped"}  # format 2's keys, as before the record
    assert ckpt.config["trainer"]["means"]["epoch"]["sums"] == {"loss": 4.25}


def test_job_position_fields_a_checkpoint_lacks_take_their_defaults():
    """An older checkpoint's ``trainer`` config lacks newer fields: each is its default
    (``steps_run`` the checkpoint's step), the others are read by name."""
    from functree.train._job import Position, read_position

    assert read_position({}, step=4) == Position(steps_run=4)
    assert read_position({"epoch": 2, "means": {"epoch": {"sums": {"a": 1.0}, "weight": 1.0}}}, step=4) == Position(
        steps_run=4, epoch=2, epoch_means=read_position({"means": {"epoch": {"sums": {"a": 1.0}, "weight": 1.0}}},
                                                       step=0).epoch_means)
    assert read_position({"epoch": 2}, step=4).epoch_means.weight == 0.0


def test_job_replace_by_name():
    from functree.train._job import JobState

    job = JobState.start(None, None)
    moved = job.replace(epoch=2, since_log=1, extra={"a": 1})
    assert (moved.epoch, moved.since_log, moved.extra, moved.steps_run) == (2, 1, {"a": 1}, 0)
    assert job.epoch == 0  # a value: the old record is unchanged
    with pytest.raises(ValueError, match="unexpected field names"):
        job.replace(epochs=2)


def test_job_stepped_is_replace_by_name():
    """``stepped`` (the loop's fast commit) is ``replace`` of the same fields by name."""
    from functree.train._job import JobState, Position
    from functree.train._means import Means

    position = Position(steps_run=11, epoch=3, batch_in_epoch=5, stopped=True, since_log=2,
                        window=Means({"loss": 1.5}, 2.0, 1), skipped=((7, "loss"),), data_state=13, epoch_length=17)
    job = JobState("m", "o", "k", ft.train.History(), position, extra=19, callbacks=())
    stepped = job.stepped("m2", "o2", 4)
    assert type(stepped) is JobState and type(stepped.position) is Position
    assert stepped == job.replace(model="m2", opt_state="o2", steps_run=15, batch_in_epoch=9, since_log=6)


def test_a_position_field_without_its_stored_entry_is_an_error():
    from functree.train._job import Position, check_stored

    check_stored(Position._fields)
    with pytest.raises(TypeError, match=r"(?s)fields \['lr_scale'\] have no entry in STORED.*right:  STORED"):
        check_stored((*Position._fields, "lr_scale"))


def test_own_copy_copies_buffers_without_compiling():
    """The Trainer's start and EarlyStopping's best copied each leaf with ``jnp.copy``: one
    compiled program per leaf shape (8 on a tiny Llama)."""
    from functree.train._job import own_copy

    compiles = []

    def listen(event, duration, **kwargs):
        if "backend_compile" in event:
            compiles.append(event)

    tree = {"w": jnp.arange(6.0).reshape(2, 3), "steps": jax.device_put(np.arange(5, dtype=np.int32), jax.devices()[0]),
            "key": jax.random.key(0), "scale": 0.5, "none": None}
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        copy = own_copy(tree)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    for name in ("w", "steps"):
        assert copy[name].unsafe_buffer_pointer() != tree[name].unsafe_buffer_pointer()  # its own buffer
        assert copy[name].committed == tree[name].committed and copy[name].sharding == tree[name].sharding
        np.testing.assert_array_equal(copy[name], tree[name])
    np.testing.assert_array_equal(jax.random.key_data(copy["key"]), jax.random.key_data(tree["key"]))
    assert copy["scale"] == 0.5 and copy["none"] is None


def test_every_position_field_is_an_attribute_of_the_job_and_of_the_trainer():
    """Made from ``Position._fields`` (no property written per field): ``job.<field>`` and
    ``trainer.<field>`` read the current record's position; a class's own definition wins
    (``trainer.skipped``: a list); a field named as a job's attribute is refused at import."""
    from functree.train._job import JobState, Position, add_readers, refuse_taken

    t = job.trainer()
    t.fit(job.data("list", 4), steps=3, progress=False, log_every=LOG)
    for name in Position._fields:
        value = getattr(t.state.position, name)
        assert getattr(t.state, name) is value, name
        assert getattr(t, name) == (list(value) if name == "skipped" else value), name
        assert name not in JobState.__annotations__  # not a field of the job: read through the position
    assert (t.since_log, t.epoch_length, t.stopped) == (1, 4, False)

    class Job(NamedTuple):  # a record with one more field: it becomes an attribute alike
        position: Any

    add_readers(Job, ("steps_run", "fit_calls", "count"), lambda name: property(lambda self: ("read", name)))
    assert Job(None).fit_calls == ("read", "fit_calls") and Job(None).count("x") == 0  # tuple's count kept
    with pytest.raises(TypeError, match=r"(?s)\['model'\] would be attributes of JobState twice.*"
                                        r"right:  class Position\(NamedTuple\): ...; model_version"):
        refuse_taken(("epoch", "model"), JobState._fields)


RECIPE = """
import pathlib, shutil, sys, tempfile
import numpy as np, jax, jax.numpy as jnp
import functree as ft
assert ft.__file__.startswith(sys.argv[1]), ft.__file__
devices = jax.devices()
make = lambda: ft.train.Trainer(jax.device_put(ft.nn.Dense(2, 1, key=jax.random.key(0)), devices[1]),
                                ft.optim.sgd(0.1), lambda m, b: jnp.mean(m(b) ** 2))
t = make()
t.fit(ft.train.batches(np.ones((8, 2), np.float32), 4), steps=2, progress=False)
t._job = t._job.replace(fit_calls=2, data_key=jax.random.key(42))  # what the driver would commit
path = tempfile.mkdtemp() + "/ck"
t.save(path)
r = make().restore(path)
s = ft.train.JobState.restore(path)
old = tempfile.mkdtemp() + "/old"
shutil.copytree(sys.argv[2], old)
o = ft.train.JobState.restore(old)
report({"trainer": [t.fit_calls, t.state.fit_calls, t.data_key is t.state.data_key],
        "restored": [r.fit_calls, jax.random.key_data(r.data_key).tolist(), str(r.data_key.devices()),
                     jax.random.key_data(s.data_key).tolist()],
        "expected": [jax.random.key_data(jax.random.key(42)).tolist(), str({devices[1]})],
        "old": [o.fit_calls, o.data_key], "keys": list(ft.train.CheckpointManager(path).restore().config["trainer"]),
        "old_keys": list(ft.train.CheckpointManager(old).restore().config["trainer"])})
"""


def test_a_piece_of_job_state_is_its_record_alone(tmp_path):
    """The layout's recipe, applied to a copy of functree: a Position field with its default
    and its STORED entry, and a JobState field with its default, nothing else edited. Both
    are attributes of the job and the trainer, saved and restored (the new array placed where
    the model lives, device 1 of 2), and an older checkpoint reads their defaults."""
    import shutil

    import _devices

    package = Path(ft.__file__).parent
    # with its bytecode (the child imports ~200 modules: compiled from source, ~1 CPU-s more),
    # but for the edited module's: Python compiles the edited source, whatever the cache holds
    shutil.copytree(package, tmp_path / "functree")
    source = tmp_path / "functree" / "train" / "_job.py"
    for stale in (source.parent / "__pycache__").glob("_job.*.pyc"):
        stale.unlink()
    text = source.read_text()
    for anchor, added in [("    epoch_length: int | None = None\n", "    fit_calls: int = 0\n"),
                          ('    "epoch_length": (("epoch_length",), lambda n: n, _length),\n',
                           '    "fit_calls": (("fit_calls",), int, _count),\n'),
                          ("    callbacks: tuple[tuple[str, str, Any], ...] | None = None\n",
                           "    data_key: Any = None\n")]:
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, anchor + added)
    source.write_text(text)
    env = _devices.env_with_devices(2)
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    proc = subprocess.Popen([sys.executable, *_devices.WARNINGS, "-c", _devices.PRELUDE + RECIPE, str(tmp_path),
                             str(OLD_CHECKPOINT)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out = _devices.result(proc, timeout=600)
    assert out["trainer"] == [2, 2, True]
    assert out["restored"] == [2, out["expected"][0], out["expected"][1], out["expected"][0]]
    assert out["old"] == [0, None]
    keys = out["keys"]
    assert keys[:len(out["old_keys"])] == out["old_keys"] and "fit_calls" in keys[len(out["old_keys"]):]


@pytest.fixture(scope="module")
def small_job(tmp_path_factory):
    """``(directory, trainer)``: a Trainer checkpoint (2 steps, 1 epoch), trained and saved
    once for the module; each test tampers with its own copy (:func:`_small_checkpoint`)."""
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean(m(b) ** 2))
    trainer.fit(ft.train.batches(x, 4), epochs=1, progress=False)
    directory = tmp_path_factory.mktemp("small") / "ck"
    trainer.save(directory)
    return directory, trainer


def _small_checkpoint(tmp_path, small_job, change):
    """A copy of ``small_job``'s checkpoint whose "trainer" config ``change`` edits, its
    metadata digest recomputed (as an attacker would): files are data."""
    import shutil

    from functree.train.checkpoint._checkpoint import metadata_digest

    source, trainer = small_job
    shutil.copytree(source, tmp_path / "ck")
    meta_file = tmp_path / "ck" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    change(meta["config"])
    meta["digest"] = metadata_digest(meta)
    meta_file.write_text(json.dumps(meta))
    return tmp_path / "ck", trainer


def _put(*path_and_value):
    *path, key, value = path_and_value

    def change(config):
        node = config["trainer"]
        for name in path:
            node = node[name]
        node[key] = value
    return change


@pytest.mark.parametrize("key, change", [
    ("stopped", _put("stopped", "false")), ("stopped", _put("stopped", 0)),
    ("epoch", _put("epoch", 1.7)), ("epoch", _put("epoch", True)), ("epoch", _put("epoch", -3)),
    ("epoch", _put("epoch", None)), ("epoch", _put("epoch", float("nan"))), ("epoch", _put("epoch", [1])),
    ("epoch", _put("epoch", 10**30)), ("since_log", _put("since_log", 1.5)),
    ("batch_in_epoch", _put("batch_in_epoch", "0")), ("steps_run", _put("steps_run", 5)),
    ("epoch_length", _put("epoch_length", "2")), ("epoch_length", _put("epoch_length", -1)),
    ("epoch_length", _put("epoch_length", 2.5)), ("epoch_length", _put("epoch_length", 0)),
    ("epoch_length", _put("epoch_length", {})),
    ("skipped", _put("skipped", [[1.9, "x"]])), ("skipped", _put("skipped", [[1]])), ("skipped", _put("skipped", "ab")),
    ("means.window", _put("means", "window", "x")), ("means.window", _put("means", "window", {"weight": "1"})),
    ("means.epoch", _put("means", "epoch", {"sums": {"loss": "1"}, "weight": 1.0, "skipped": 0})),
    ("means.epoch", _put("means", "epoch", {"sums": {}, "weight": 1.0, "skipped": 0, "x": 1})),
    ("means.epoch", _put("means", "epoch", {"sums": {}, "weight": -1.0, "skipped": 0})),
    ("means", _put("means", [1])),  # the old reader: both means silently empty
])
def test_a_tampered_position_value_is_refused_not_converted(tmp_path, small_job, key, change):
    # The old readers converted: "false" -> True, 1.7 -> 1, True -> 1, [[1.9, "x"]] -> step 1;
    # -3 restored (fit's IndexError later), NaN/None/[1] crashed with a bare ValueError/TypeError.
    path, _ = _small_checkpoint(tmp_path, small_job, change)
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean(m(b) ** 2))
    with pytest.raises(ft.train.CheckpointError, match=rf"ck step 2: trainer\.{key} is"):
        trainer.restore(path)


@pytest.mark.parametrize("column, change", [
    ("steps\\['loss'\\]", lambda c: c["trainer"]["history"]["steps"]["loss"].pop()),  # ragged
    ("steps\\['loss'\\]", lambda c: c["trainer"]["history"]["steps"].__setitem__("loss", "ab")),
    ("steps\\['loss'\\]", lambda c: c["trainer"]["history"]["steps"]["loss"].__setitem__(0, "1.0")),
    ("epochs.epoch", lambda c: c["trainer"]["history"]["epochs"].__setitem__("epoch", [1.5])),
    ("epochs", lambda c: c["trainer"]["history"]["epochs"].pop("epoch")),
    ("", lambda c: c["trainer"].__setitem__("history", [])),
])
def test_a_tampered_history_column_is_refused(tmp_path, small_job, column, change):
    # The old reader took a short column as it was: the next fit's losses landed on the
    # wrong steps (a string column: an AttributeError in History._append).
    path, _ = _small_checkpoint(tmp_path, small_job, change)
    with pytest.raises(ft.train.CheckpointError, match=rf"ck step 2: trainer\.history\.?{column} is"):
        ft.train.JobState.restore(path)


def test_a_trainer_config_that_is_not_an_object_is_refused(tmp_path, small_job):
    path, _ = _small_checkpoint(tmp_path, small_job, lambda c: c.__setitem__("trainer", [1, 2]))
    with pytest.raises(ft.train.CheckpointError, match="ck step 2: trainer is \\[1, 2\\], not a JSON object"):
        ft.train.JobState.restore(path)  # the old reader: AttributeError ('list' has no 'get')


def test_a_resealed_untampered_checkpoint_restores_exactly(tmp_path, small_job):
    path, saved = _small_checkpoint(tmp_path, small_job, lambda c: None)
    back = ft.train.JobState.restore(path)
    assert back.position == saved.state.position and back.history == saved.history


_NET_CELL = '''
class Net(ft.Module):
    w: jax.Array
    b: jax.Array
    def __call__(self, x):
        return x @ self.w + jax.lax.broadcast_to_rank(self.b, x.ndim)
'''
_NET_EDITED = '''
class Net(ft.Module):             # the cell edited: a static field added
    w: jax.Array
    b: jax.Array
    scale: float = ft.field(static=True, default=1.0)
    def __call__(self, x):
        return self.scale * (x @ self.w + jax.lax.broadcast_to_rank(self.b, x.ndim))
'''


def _notebook_net_job(directory: Path) -> tuple[dict[str, Any], Any, Any]:
    """A notebook's ``Net`` trained two epochs with EarlyStopping(restore_best=True) and
    saved; then its class cell edited. ``(namespace, saved model, saved best model)``."""
    # a notebook's cells, under a module name of their own: a __main__.Net left alive here made
    # an unregistered __main__.Net of a later doc page ambiguous to load without a template
    # (a module in sys.modules, as __main__ is: dataclasses reads string annotations there)
    cells = sys.modules.setdefault("notebook_job_cells", types.ModuleType("notebook_job_cells"))
    ns: dict[str, Any] = cells.__dict__
    ns.update(ft=ft, jax=jax)
    exec(_NET_CELL, ns)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    ns["data"] = ft.train.batches((x, x @ np.array([[1.0], [2.0], [-1.0]], np.float32)), batch_size=16,
                                  key=jax.random.key(1))
    ns["loss"] = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
    t = ft.train.Trainer(ns["Net"](jnp.zeros((3, 1)), jnp.zeros(1)), ft.optim.adam(0.05), ns["loss"])
    stop = ft.train.EarlyStopping(monitor="loss", patience=100, restore_best=True)
    t.fit(ns["data"], epochs=2, callbacks=[stop], progress=False)
    t.save(str(directory))
    exec(_NET_EDITED, ns)
    return ns, t.model, stop.best_model


def test_restore_after_a_field_is_added_to_the_model_class_reads_the_callbacks_best_model_by_the_template(tmp_path):
    """main: after a static field was added to the notebook's model class, restore failed
    even with callbacks=False: EarlyStopping's stored best model was decoded without a
    template ("Net was edited since this checkpoint was saved" at extra.callbacks.0.best_model)."""
    ns, saved, best = _notebook_net_job(tmp_path / "c")
    template = ns["Net"](jnp.zeros((3, 1)), jnp.zeros(1))
    dropped = ft.train.Trainer(template, ft.optim.adam(0.05), ns["loss"]).restore(str(tmp_path / "c"), callbacks=False)
    assert dropped.state.callbacks is None and type(dropped.model) is ns["Net"]
    for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(getattr(dropped.model, name)), np.asarray(getattr(saved, name)))
    kept = ft.train.Trainer(template, ft.optim.adam(0.05), ns["loss"]).restore(str(tmp_path / "c"))
    assert kept.state.callbacks is not None
    ((_, cls, state),) = kept.state.callbacks
    assert cls == "EarlyStopping" and type(state["best_model"]) is ns["Net"] and state["best_model"].scale == 1.0
    for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(getattr(state["best_model"], name)), np.asarray(getattr(best, name)))
    stop = ft.train.EarlyStopping(monitor="loss", patience=100, restore_best=True)
    kept.fit(ns["data"], epochs=3, callbacks=[stop], progress=False)  # the state loads into the callback
    assert type(stop.best_model) is ns["Net"]



def test_restore_with_two_live_classes_of_one_name_reads_the_best_model_by_the_template(tmp_path):
    """A model class defined inside a function called twice (or by a cell exec'd outside
    sys.modules): two live classes share the stored name and neither is bound at it. The
    model part reads by its template; EarlyStopping's best model in ``extra`` was decoded by
    name and failed ("2 different Module classes named ... are defined in this process")."""
    def make_net_class() -> Any:
        class Net(ft.Module):
            w: jax.Array
            b: jax.Array

            def __call__(self, x):
                return x @ self.w + jax.lax.broadcast_to_rank(self.b, x.ndim)

        return Net

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    data = ft.train.batches((x, x @ np.array([[1.0], [2.0], [-1.0]], np.float32)), batch_size=16,
                            key=jax.random.key(1))

    def loss(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    def trainer(net: Any) -> Any:
        return ft.train.Trainer(net(jnp.zeros((3, 1)), jnp.zeros(1)), ft.optim.adam(0.05), loss)

    def stop() -> Any:
        return ft.train.EarlyStopping(monitor="loss", patience=100, restore_best=True)

    first, second = make_net_class(), make_net_class()
    full, half = trainer(first), trainer(first)
    full.fit(data, epochs=4, callbacks=[stop()], progress=False)
    half.fit(data, epochs=2, callbacks=[stop()], progress=False)
    half.save(str(tmp_path / "job"))
    again = trainer(second).restore(str(tmp_path / "job"))
    ((_, _, state),) = again.state.callbacks
    assert type(state["best_model"]) is second
    again.fit(data, epochs=4, callbacks=[stop()], progress=False)
    for name in ("w", "b"):  # continued as if never interrupted
        np.testing.assert_array_equal(np.asarray(getattr(again.model, name)), np.asarray(getattr(full.model, name)))
    assert again.history.epochs["loss"] == full.history.epochs["loss"]


def _leaky(x: jax.Array) -> jax.Array:
    """An activation defined in the program, never registered: stored by a name that a
    checkpoint cannot look up."""
    return jax.nn.leaky_relu(x, negative_slope=0.3)


@pytest.mark.parametrize("activation", [functools.partial(jax.nn.leaky_relu, negative_slope=0.3), _leaky],
                         ids=["partial", "own_function"])
def test_restore_reads_the_best_model_with_an_unregistered_static_activation_by_the_template(tmp_path, activation):
    """b4c4945..1f3ea16: a model whose static activation is a functools.partial (stored as
    its text) or the program's own function (not registered) restored its model part by
    the template, but EarlyStopping's best model in ``extra`` was decoded alone: "Cannot
    rebuild a static value at 'extra.callbacks.0.best_model.act' without a template"."""
    class Net(ft.Module):
        l1: ft.nn.Dense
        l2: ft.nn.Dense
        act: Any = ft.field(static=True, default=activation)

        def __call__(self, x):
            return self.l2(self.act(self.l1(x)))

    def net(seed: int) -> Any:
        return Net(l1=ft.nn.Dense(3, 8, key=jax.random.key(seed)), l2=ft.nn.Dense(8, 1, key=jax.random.key(seed + 1)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)

    def loss(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    def data() -> Any:
        return ft.train.batches((x, y), 8, shuffle=False)

    def stop() -> Any:
        return ft.train.EarlyStopping(monitor="loss", patience=100, restore_best=True)

    full, half = (ft.train.Trainer(net(0), ft.optim.adam(0.01), loss) for _ in range(2))
    full.fit(data(), epochs=5, callbacks=[stop()], progress=False)
    saved_stop = stop()
    half.fit(data(), epochs=3, callbacks=[saved_stop], progress=False)
    half.save(str(tmp_path / "job"))
    again = ft.train.Trainer(net(5), ft.optim.adam(0.01), loss).restore(str(tmp_path / "job"))
    assert again.state.callbacks is not None
    ((_, _, state),) = again.state.callbacks
    best = state["best_model"]
    assert type(best) is Net and best.act is activation
    for got, want in zip(jax.tree.leaves(best), jax.tree.leaves(saved_stop.best_model), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    again.fit(data(), epochs=5, callbacks=[stop()], progress=False)
    assert again.history.epochs["loss"] == full.history.epochs["loss"]  # continued as if never interrupted
    for got, want in zip(jax.tree.leaves(again.model), jax.tree.leaves(full.model), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
