"""Checkpoints: types rebuilt without a template, templates checked, retention, atomicity."""

import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _errors import raises_named

import functree as ft
from functree.train import CheckpointError, CheckpointManager
from functree.train.checkpoint._treespec import SpecError


class Block(ft.Module):
    layers: list
    scale: float
    mean: jax.Array = ft.field(no_derivative=True)
    count: jax.Array = ft.field(no_derivative=True)
    activation: object = ft.field(static=True, default=jax.nn.relu)
    sizes: tuple = ft.field(static=True, default=(2, 3))


def make_block(seed=0, width=3):
    keys = jax.random.split(jax.random.key(seed), 2)
    layers = [ft.nn.Dense(2, width, key=keys[0]), ft.nn.Dense(width, 1, key=keys[1])]
    return Block(layers, 0.5, jnp.zeros(width), jnp.array(7, jnp.int32))


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_roundtrip_rebuilds_types_without_template(tmp_path):
    model = make_block()
    opt_state = optax.adam(1e-3).init(ft.parameters(model))
    extra = {"key": jax.random.key(3), "epoch": 4, "lr": np.float32(0.1)}
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(5, model, opt_state, metrics={"loss": jnp.array(0.25)},
                 config={"optimizer": "adam", "betas": (0.9, 0.999)}, extra=extra)
    ckpt = manager.restore()
    assert ckpt.step == 5 and ckpt.metrics == {"loss": 0.25}
    assert ckpt.config == {"optimizer": "adam", "betas": [0.9, 0.999]}
    assert type(ckpt.model) is Block and ckpt.model.activation is jax.nn.relu
    assert ckpt.model.sizes == (2, 3) and isinstance(ckpt.model.scale, float)
    assert type(ckpt.opt_state[0]) is type(opt_state[0])  # ScaleByAdamState, not a dict
    assert_same(ckpt.model, model)
    assert_same(ckpt.opt_state, opt_state)
    assert_same(ckpt.extra, extra)
    manager.close()


def test_functree_optimizer_state_roundtrip(tmp_path):
    model = ft.nn.Sequential(ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.BatchNorm(3))
    state = ft.optim.Optimizer(ft.optim.adamw(1e-3)).init(model)
    ft.train.save(tmp_path / "s", (model, state))
    loaded_model, loaded_state = ft.train.load(tmp_path / "s")
    assert type(loaded_state) is type(state)
    assert_same(loaded_state, state)
    assert_same(loaded_model, model)


def test_template_restore_reports_every_mismatch_by_key_path(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, make_block(width=3), None)
    good = manager.restore(template=make_block(seed=9, width=3))
    assert_same(good.model, make_block(width=3))
    with pytest.raises(CheckpointError) as info:
        manager.restore(template=make_block(width=4))
    message = str(info.value)
    for name in ("layers.0.weight", "layers.0.bias", "layers.1.weight", "mean"):
        assert f"{name}: expected shape" in message
    assert "(2, 4)" in message and "(2, 3)" in message


def test_template_dtype_mismatch_and_missing_keys(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"w": jnp.ones(2), "b": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=r"w: expected shape \(2,\) dtype bfloat16"):
        manager.restore(template={"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=r"missing keys:\s+\['c'\]"):
        manager.restore(template={"w": jnp.ones(2), "b": jnp.ones(1), "c": jnp.ones(1)})


def test_keeps_last_k_and_the_best(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=2, best_metric="loss")
    for step, loss in zip(range(1, 4), [0.5, 0.1, 0.4]):
        manager.save(step, {"w": jnp.full(2, float(step))}, metrics={"loss": loss})
        manager.all_steps()
    assert manager.all_steps() == [2, 3]
    # a new process (manager) keeps ranking by the metrics stored in the checkpoints
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=2, best_metric="loss")
    for step, loss in zip(range(4, 6), [0.3, 0.2]):
        manager.save(step, {"w": jnp.full(2, float(step))}, metrics={"loss": loss})
    assert manager.all_steps() == [2, 4, 5]
    assert manager.best_step() == 2 and manager.latest_step() == 5
    assert float(manager.restore(manager.best_step()).model["w"][0]) == 2.0


def test_best_mode_max(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=1, best_metric="acc", mode="max")
    for step, acc in zip(range(1, 4), [0.5, 0.9, 0.7]):
        manager.save(step, {"w": jnp.ones(1)}, metrics={"acc": acc})
    assert manager.all_steps() == [2, 3] and manager.best_step() == 2


@pytest.mark.parametrize("mode", ["min", "max"])
def test_tied_best_is_the_first_step_to_reach_it(tmp_path, mode):
    # issue 27: mode="max" kept the latest of tied steps, mode="min" the earliest
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=1, best_metric="m", mode=mode)
    for step, m in zip(range(1, 6), [0.5, 0.7, 0.7, 0.6, 0.4] if mode == "max" else [0.5, 0.2, 0.2, 0.3, 0.6]):
        manager.save(step, {"w": jnp.ones(1)}, metrics={"m": m})
    assert manager.best_step() == 2 and manager.all_steps() == [2, 5]


@pytest.mark.parametrize("mode, diverged", [("min", -math.inf), ("max", math.inf), ("min", math.nan)])
def test_a_non_finite_metric_never_displaces_the_best(tmp_path, mode, diverged):
    # a diverged -inf loss was kept as the best and the best finite checkpoint deleted
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=1, best_metric="m", mode=mode)
    good, worse = (0.2, 0.5) if mode == "min" else (0.9, 0.5)
    for step, m in zip(range(1, 5), [worse, good, diverged, worse]):
        manager.save(step, {"w": jnp.ones(1)}, metrics={"m": m})
    assert manager.best_step() == 2 and manager.all_steps() == [2, 4]
    assert CheckpointManager(tmp_path / "ckpt", best_metric="m", mode=mode).best_step() == 2  # read from the files


def test_a_linked_step_folder_is_pruned_as_a_link_and_what_it_points_to_stays(tmp_path):
    # pruning a step folder that is a symlink raised OSError("Cannot call rmtree on a
    # symbolic link") from orbax, in the middle of a save (and of fit)
    with CheckpointManager(tmp_path / "elsewhere") as other:
        other.save(1, {"w": jnp.full(2, 7.0)})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "1").symlink_to(tmp_path / "elsewhere" / "1")
    manager = CheckpointManager(tmp_path / "run", max_to_keep=1)
    assert float(manager.restore(1).model["w"][0]) == 7.0
    manager.save(2, {"w": jnp.ones(2)})
    assert manager.all_steps() == [2] and not os.path.lexists(tmp_path / "run" / "1")
    assert CheckpointManager(tmp_path / "elsewhere").all_steps() == [1]  # the linked checkpoint is intact


def test_missing_best_metric_and_bad_mode(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", best_metric="val_loss")
    with pytest.raises(CheckpointError, match=r'metrics=\{"val_loss": value\}'):
        manager.save(1, {"w": jnp.ones(1)}, metrics={"loss": 1.0})
    with pytest.raises(ValueError, match=r'right:  CheckpointManager\(best_metric=\'val_loss\', mode="min"\)'):
        CheckpointManager(tmp_path / "other", mode="lowest")


def test_directory_that_is_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"not a checkpoint directory.*'notes.txt'"):
        CheckpointManager(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    with pytest.raises(CheckpointError, match=r"is a file, not a directory"):
        CheckpointManager(tmp_path / "notes.txt")


def test_existing_step_is_not_overwritten(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"w": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=r"already holds a checkpoint at step 1"):
        manager.save(1, {"w": jnp.zeros(1)})
    np.testing.assert_array_equal(manager.restore(1).model["w"], np.ones(1))
    manager.delete(1)
    manager.save(1, {"w": jnp.zeros(1)})
    np.testing.assert_array_equal(manager.restore(1).model["w"], np.zeros(1))


def test_no_checkpoint_and_unknown_step(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.latest_step() is None
    with pytest.raises(CheckpointError, match=r"No checkpoint at all"):
        manager.restore()
    manager.save(3, {"w": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=r"No checkpoint at step 7.*steps present: \[3\]"):
        manager.restore(7)


def test_corrupted_checkpoint_is_reported_and_nothing_is_changed(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"w": jnp.ones(3)})
    manager.save(2, {"w": jnp.full(3, 2.0)})
    step_dir = tmp_path / "ckpt" / "2"
    for root, _, files in os.walk(step_dir / "arrays"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    before = sorted(os.listdir(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"corrupted.*\n.*steps \[1\]") as info:
        manager.restore()
    assert "manager.restore(1)" in str(info.value)
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    np.testing.assert_array_equal(manager.restore(1).model["w"], np.ones(3))


def test_unregistered_class_needs_registering_or_a_template(tmp_path):
    class Local(ft.Module):
        w: jax.Array

    class State(NamedTuple):
        count: jax.Array

    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, Local(jnp.ones(2)), State(jnp.array(3)))
    with pytest.raises(SpecError, match=r"step 1 .*\n.*at 'opt_state'.*State is not a registered type") as info:
        manager.restore()
    assert "ft.train.register(MyClass)" in str(info.value) and "template=" in str(info.value)
    # a Module subclass defined in this process is found without importing anything
    assert type(manager.restore(include=("model",)).model) is Local
    ckpt = manager.restore(opt_state_template=State(jnp.array(0)))
    assert type(ckpt.opt_state) is State and int(ckpt.opt_state.count) == 3
    ft.train.register(State, name="tests.checkpoint.State")
    manager.save(2, Local(jnp.ones(2)), State(jnp.array(4)))
    assert type(manager.restore(2).opt_state) is State


def test_single_tree_save_and_load(tmp_path):
    model = make_block()
    ft.train.save(tmp_path / "m", model)
    assert_same(ft.train.load(tmp_path / "m"), model)
    assert_same(ft.train.load(tmp_path / "m", template=make_block(seed=2)), model)
    with pytest.raises(CheckpointError, match=r"already exists. Nothing was overwritten"):
        ft.train.save(tmp_path / "m", model)
    ft.train.save(tmp_path / "m", make_block(seed=1), overwrite=True)
    assert_same(ft.train.load(tmp_path / "m"), make_block(seed=1))
    with pytest.raises(CheckpointError, match=r"layers.1.weight: expected shape"):
        ft.train.load(tmp_path / "m", template=make_block(width=5))
    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointError, match=r"not a readable functree checkpoint"):
        ft.train.load(tmp_path / "junk")


def test_a_managers_directory_and_a_saved_tree_name_each_other(tmp_path):
    """ft.train.load of a manager's directory (or a template for its step's model), and a
    manager over one ft.train.save tree, name the reader that fits."""
    model = make_block()
    manager = CheckpointManager(tmp_path / "run")
    manager.save(2, model, optax.sgd(0.1).init(model))
    manager.save(4, model, optax.sgd(0.1).init(model))
    with pytest.raises(CheckpointError, match=r"(?s)CheckpointManager's directory.*steps \[2, 4\].*"
                                              r"restore\(template=model\).model.*/run/4\"\)"):
        ft.train.load(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"(?s)does not fit the template.*CheckpointManager\(.*/run"
                                              r"\"\).restore\(4, template=template\).model"):
        ft.train.load(tmp_path / "run" / "4", make_block())
    assert_same(ft.train.load(tmp_path / "run" / "4")["model"], model)
    ft.train.save(tmp_path / "tree", model)
    with pytest.raises(CheckpointError, match=r"one tree written by ft.train.save.*\n.*\n.*\n.*ft.train.load"):
        CheckpointManager(tmp_path / "tree")
    # A step's folder given for the manager's directory: the directory and the step, both ways in
    with pytest.raises(CheckpointError, match=r"(?s)run/4 is step 4 of the checkpoints in .*/run, not a directory"
                                              r".*right:  trainer.restore\(\".*/run\", step=4\)"
                                              r".*right:  ft.train.CheckpointManager\(\".*/run\"\).restore\(4, "):
        CheckpointManager(tmp_path / "run" / "4")
    assert_same(CheckpointManager(tmp_path / "run").restore(4, template=model).model, model)  # the call it shows
    (tmp_path / "saves").mkdir()
    ft.train.save(tmp_path / "saves" / "3", model)
    (tmp_path / "saves" / "notes.txt").write_text("not a manager's")  # numbered saves beside other files
    with pytest.raises(CheckpointError, match=r"one tree written by ft.train.save"):
        CheckpointManager(tmp_path / "saves" / "3")


KILLED_SAVE = textwrap.dedent(
    """
    import sys, threading, time
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    import functree as ft

    manager = ft.train.CheckpointManager(sys.argv[1])
    manager.save(1, {"w": jnp.ones(1000)})
    original = atomicity.AtomicRenameTemporaryPath.finalize
    stalled = threading.Event()

    def stall(self, *args, **kwargs):
        if threading.current_thread().name == "midsave":  # the save of step 2 only
            print("MIDSAVE", flush=True)
            stalled.set()
            time.sleep(120)
        return original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = stall
    threading.Thread(target=lambda: manager.save(2, {"w": jnp.zeros(1000)}), name="midsave", daemon=True).start()
    stalled.wait(60)
    """
)

SAVE_LOOP = textwrap.dedent(
    """
    manager = ft.train.CheckpointManager(sys.argv[2], max_to_keep=2, best_metric="loss")
    for step in range(1, 10_000):
        loss = 1.0 / step if step % 7 == 3 else 5.0 + (step % 5)  # best so far at steps 3, 10, ...
        manager.save(step, {"w": jnp.full(5000, float(step))}, metrics={"loss": loss})
        print("ACK", step, flush=True)
    """
)


def _loss(step):
    return 1.0 / step if step % 7 == 3 else 5.0 + (step % 5)


@pytest.fixture(scope="module")
def killed_process(tmp_path_factory):
    """One process SIGKILLed (its start-up and imports are most of its time) for two
    scenarios: a save of step 2 stalled in its final rename (a thread, after step 1 was
    saved) at ``midsave``, and a loop of saves (the main thread, after the stall began)
    at ``loop``, killed at a random moment after 4-15 acknowledged saves. Returns the two
    directories and the last acknowledged step of the loop."""
    root = tmp_path_factory.mktemp("killed")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE + SAVE_LOOP, str(root / "midsave"), str(root / "loop")],
                            stdout=subprocess.PIPE, text=True)
    acked = 0
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "MIDSAVE" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "MIDSAVE" in line
        kill_after = 4 + np.random.default_rng().integers(0, 12)  # saves to wait for
        while acked < kill_after:
            line = proc.stdout.readline()
            assert line, "the saving process ended early"
            acked = int(line.split()[1])
        time.sleep(np.random.default_rng().uniform(0, 0.05))  # somewhere inside a save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        acked = max([acked] + [int(x.split()[1]) for x in proc.stdout.read().split("\n") if x])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    return root / "midsave", root / "loop", acked


def test_process_killed_mid_save_leaves_previous_checkpoint(killed_process):
    directory = killed_process[0]
    leftovers = [n for n in os.listdir(directory) if n != "1"]
    assert leftovers, "the interrupted save should have left its temporary directory"
    manager = CheckpointManager(directory)
    assert manager.all_steps() == [1]
    np.testing.assert_array_equal(manager.restore().model["w"], np.ones(1000))
    manager.save(2, {"w": jnp.zeros(1000)})
    assert manager.all_steps() == [1, 2]


def test_asynchronous_save(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", asynchronous=True) as manager:
        model = make_block()
        manager.save(1, model)
        manager.wait_until_finished()
        assert_same(manager.restore(1).model, model)
        assert manager.restore(1, include=("extra",)).model is None


UNWAITED_SAVES = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    from functree.train import CheckpointManager
    kept = CheckpointManager(sys.argv[1], asynchronous=True)
    kept.save(1, {"w": jnp.arange(300_000.0)})
    CheckpointManager(sys.argv[2], asynchronous=True).save(1, {"w": jnp.ones(3)})  # dropped at once
    failing = CheckpointManager(sys.argv[3], asynchronous=True)
    failing.save(1, {"w": jnp.ones(3)})
    written = failing._mngr.wait_until_finished
    def disk_full():  # orbax's wait raises once its background write has failed
        written()
        raise OSError("No space left on device")
    failing._mngr.wait_until_finished = disk_full
    print("STARTED", flush=True)      # and the script ends without waiting for any of them
""")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="from 3.12 no thread starts after the main thread ends: "
                    "functree never waits there, and orbax's own unfinished threads may hold the exit (seen 2 in 9)")
def test_an_asynchronous_save_not_waited_for_is_written_when_the_script_ends(tmp_path):
    # It was lost: Python stopped orbax's thread pools before atexit ran, the step stayed a
    # temporary directory and orbax printed "cannot schedule new futures after shutdown". From
    # Python 3.12 no thread starts after the main thread ends: a write still under way then
    # cannot finish, and is named as lost (waiting for it hung the script).
    dirs = [tmp_path / name for name in ("kept", "dropped", "failing")]
    out = subprocess.run([sys.executable, "-c", UNWAITED_SAVES, *map(str, dirs)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "STARTED" in out.stdout, out.stderr
    lost = "an asynchronous save was still being written when the script ended, and this Python (3.12 or later)"
    for directory, values in zip(dirs, (np.arange(300_000.0), np.ones(3))):
        named = f"CheckpointManager({str(directory)!r}): {lost}"
        if sys.version_info < (3, 12) or named not in out.stderr:
            np.testing.assert_array_equal(CheckpointManager(directory).restore(1).model["w"], values)
        else:
            assert "manager.wait_until_finished()" in out.stderr
    if sys.version_info < (3, 12):
        assert "cannot schedule new futures" not in out.stderr and lost not in out.stderr
    failed = f"CheckpointManager({str(dirs[2])!r}): the asynchronous save under way when the script ended failed: " \
             "No space left on device"
    assert failed in out.stderr or f"CheckpointManager({str(dirs[2])!r}): {lost}" in out.stderr


def test_sigkill_at_a_random_moment_keeps_the_last_acknowledged_and_the_best(killed_process):
    _, directory, acked = killed_process
    manager = CheckpointManager(directory, max_to_keep=2, best_metric="loss")
    latest = manager.latest_step()
    assert latest in (acked, acked + 1)  # a save may finish just before its ACK is printed
    np.testing.assert_array_equal(np.asarray(manager.restore().model["w"]), np.full(5000, float(latest)))
    best = min(range(1, latest + 1), key=_loss)
    assert best in manager.all_steps()
    assert float(manager.restore(best).model["w"][0]) == best
    manager.save(latest + 1, {"w": jnp.zeros(1)}, metrics={"loss": 9.0})  # takes the stale lock
    left = [n for n in os.listdir(directory) if "tmp" in n or "lock" in n]
    assert not left, left


def test_a_writer_killed_while_taking_or_breaking_the_lock_leaves_nothing_behind(tmp_path):
    # A SIGKILL between creating the lock's temporary file and linking it into place (or
    # between renaming a stale lock and removing it) left ".functree-writer.lock.<token>"
    # for good, empty where the kill came before its content (CI's random-moment kill, and
    # 1 in 8 kills in a loop). Its name now says whose it is; the next writer removes what
    # a dead process left, and leaves a live writer's file (one taking the lock now).
    from functree.train.checkpoint import _directory as policy

    directory = tmp_path / "ckpt"
    CheckpointManager(directory).save(1, {"w": jnp.ones(2)})
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)
    me, now = os.getpid(), policy.started(os.getpid())

    def temporary(pid, start, token, content=""):
        path = directory / policy._temporary_name(pid, start, token * 32)
        path.write_text(content)
        return path.name

    killed_before_content = temporary(dead_pid, 1, "a")
    killed_after_content = temporary(dead_pid, 1, "b", json.dumps({"pid": dead_pid, "host": socket.gethostname()}))
    predecessor = temporary(me, (now or 0) + 1, "c")  # a restarted container's job had this pid (its token is no WriterLock's here)
    (directory / f"{policy.LOCK_NAME}.stale-{'d' * 32}").write_text("{}")
    old_release = directory / f"{policy.LOCK_NAME}.{'e' * 32}"  # an older release's name, two minutes old
    old_release.write_text("")
    os.utime(old_release, (time.time() - 120, time.time() - 120))
    kept = [temporary(me, now, "f"),  # this process's, another WriterLock taking the lock now
            f"{policy.LOCK_NAME}.{'0' * 32}"]  # an older release's name, being written now
    (directory / kept[1]).write_text("")
    elsewhere = directory / policy._temporary_name(dead_pid, 1, "1" * 32).replace(policy._host_tag(), "0" * 12)
    elsewhere.write_text("")  # another host's writer (a shared file system): its pid says nothing here
    kept.append(elsewhere.name)
    assert {killed_before_content, killed_after_content, predecessor} <= set(os.listdir(directory))
    policy._HELD.add("f" * 32)  # as WriterLock.acquire does while it takes the lock
    try:
        CheckpointManager(directory).save(2, {"w": jnp.ones(2)})
    finally:
        policy._HELD.discard("f" * 32)
    assert not policy._HELD  # the save's own token released
    assert sorted(n for n in os.listdir(directory) if "lock" in n) == sorted(kept)
    assert CheckpointManager(directory).all_steps() == [1, 2]


def _failing(monkeypatch, error):
    from orbax.checkpoint._src.path import atomicity

    def fail(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", fail)


def _trainer(steps=3):
    model = ft.nn.Sequential(ft.nn.Dense(2, 3, jax.nn.relu, key=jax.random.key(0)), ft.nn.Dropout(0.2),
                             ft.nn.Dense(3, 1, key=jax.random.key(1)))

    def loss_fn(model, batch, *, key=None):
        x, y = batch
        return jnp.mean((model(x, key=key) - y) ** 2)

    trainer = ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.adam(0.01)), loss_fn, key=jax.random.key(2))
    x = np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32)
    if steps:
        trainer.fit((x, x[:, :1] * 2), steps=steps, batch_size=8, progress=False)
    return trainer


def _snapshot(trainer):
    leaves = jax.tree.leaves((trainer.model, trainer.opt_state))
    return [np.asarray(x).copy() for x in leaves], (trainer.steps_run, trainer.epoch, trainer.batch_in_epoch)


def test_full_or_read_only_disk_raises_and_changes_nothing(tmp_path, monkeypatch):
    trainer = _trainer()
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, trainer.model, trainer.opt_state)
    before = _snapshot(trainer)
    for error in [OSError(28, "No space left on device"), OSError(30, "Read-only file system")]:
        _failing(monkeypatch, error)
        with pytest.raises(OSError, match=error.strerror):
            trainer.save(manager, metrics={"loss": 1.0})
        monkeypatch.undo()
        after = _snapshot(trainer)
        assert after[1] == before[1]
        for a, b in zip(after[0], before[0]):
            np.testing.assert_array_equal(a, b)
        assert manager.all_steps() == [1] and not (tmp_path / "ckpt" / ".functree-writer.lock").exists()
    # the writer lock itself cannot be created on a read-only directory
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if ".functree-writer.lock" in str(path):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError, match="Read-only"):
        manager.save(99, trainer.model)
    monkeypatch.undo()
    assert manager.all_steps() == [1]
    fresh = _trainer(steps=0)  # step 1 is a model's checkpoint (no job position): read as one
    restored = manager.restore(1, template=fresh.model, opt_state_template=fresh.opt_state)
    for a, b in zip(jax.tree.leaves((restored.model, restored.opt_state)), before[0]):
        np.testing.assert_array_equal(a, b)


FRESH_RESUME = """
import sys
sys.path.insert(0, sys.argv[2])
import test_train_checkpoint as t
import functree as ft
trainer = t._trainer(steps=0)  # a new, untrained Trainer: all it has comes from the files
trainer.restore(sys.argv[1])
trainer.fit(t._data(), steps=10, progress=False)  # steps= counts the whole job
ft.train.save(sys.argv[1] + "_resumed", (trainer.model, trainer.opt_state))
"""


def _data():
    x = np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32)
    return ft.train.batches((x, x[:, :1] * 2), 8, key=jax.random.key(5))


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """One fresh process for two scenarios (its start-up and imports are most of each):
    resume the job checkpointed at ``resume/ckpt``, then die (``os._exit(9)``) between the
    renames of an overwrite of the tree at ``overwrite/m``. Returns the two directories and
    the process's exit status."""
    root = tmp_path_factory.mktemp("fresh")
    first = _trainer()
    first.fit(_data(), steps=5, progress=False)
    first.save(root / "resume" / "ckpt")
    (root / "overwrite").mkdir()
    ft.train.save(root / "overwrite" / "m", {"w": np.full(4, 1.0, np.float32)})
    proc = subprocess.run([sys.executable, "-c", FRESH_RESUME + KILLED_OVERWRITE, str(root / "resume" / "ckpt"), os.path.dirname(__file__),
                           str(root / "overwrite" / "m")], timeout=300, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return root / "resume", root / "overwrite", proc


def test_resume_in_a_fresh_process_is_bit_identical(fresh_process):
    tmp_path, _, proc = fresh_process
    assert proc.returncode == 9, proc.stderr[-3000:]  # the resume ran whole, then the overwrite's death
    straight = _trainer()
    straight.fit(_data(), steps=10, progress=False)
    model, opt_state = ft.train.load(tmp_path / "ckpt_resumed")
    for a, b in zip(jax.tree.leaves((straight.model, straight.opt_state)), jax.tree.leaves((model, opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_pre_redesign_optimizer_state_says_how_to_convert_and_converts(tmp_path):
    """Checkpoints written before the one-context optimizer state (format 1) still load."""
    import json

    from functree.train.checkpoint._checkpoint import CheckpointManager
    from functree.train.checkpoint._registry import lookup_type

    model = ft.nn.Dense(2, 3, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    new = opt.init(model)
    old = new.inner.replace(context=new.context.replace(step=9, samples_seen=90))  # the old layout
    with CheckpointManager(tmp_path / "ck") as manager:
        manager.save(1, model, old)

    def private_names(node):  # as format 1 wrote them: module:qualname
        if isinstance(node, dict):
            if "class" in node:
                found = lookup_type(node["class"])[0]
                node["class"] = f"{found.__module__}:{found.__qualname__}"
            for value in node.values():
                private_names(value)
        elif isinstance(node, list):
            for value in node:
                private_names(value)

    path = tmp_path / "ck" / "1" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    private_names(meta["spec"])
    meta["format"] = "functree-checkpoint-1"
    del meta["checksums"], meta["digest"]
    path.write_text(json.dumps(meta))
    ft.train.migrate(tmp_path / "ck", tmp_path / "ck2")
    manager = CheckpointManager(tmp_path / "ck2")
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)before functree's one-context.*upgrade_state"):
        manager.restore(template=model, opt_state_template=new)
    trainer = ft.train.Trainer(model, opt, lambda m, x: jnp.mean(m(x)))
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)before functree's one-context.*upgrade_state") as info:
        trainer.restore(manager)
    assert "optimizer changed" not in str(info.value)  # the old layout's own fix, not a changed optimizer's
    restored = manager.restore(template=model)
    state = ft.optim.upgrade_state(restored.opt_state, opt, restored.model)
    assert int(ft.optim.context(state).step) == 9
    assert jax.tree.structure(state) == jax.tree.structure(new)
    manager.close()


def test_a_checkpoint_records_the_mesh_it_was_written_from(tmp_path):
    import json

    mesh = jax.make_mesh((1,), ("data",))
    model = ft.shard(ft.nn.Dense(2, 3, key=jax.random.key(0)), mesh, "fsdp")
    ft.train.save(tmp_path / "sharded", model)
    ft.train.save(tmp_path / "plain", ft.nn.Dense(2, 3, key=jax.random.key(0)))
    meta = lambda name: json.loads((tmp_path / name / "meta" / "metadata").read_text())  # noqa: E731
    assert meta("sharded")["mesh"] == {"data": 1} and meta("plain")["mesh"] == {}
    back = ft.train.load(tmp_path / "sharded", model, mesh=mesh, sharding="fsdp")
    np.testing.assert_array_equal(back.weight, model.weight)


def test_a_template_with_other_static_configuration_is_refused_naming_each_field(tmp_path):
    """The template's static fields replaced the saved ones silently: 4 heads restored as 2,
    a relu as the identity, a scale of 5 as 2 (outputs 1.4-2.3 off). Every differing field is
    named with both values; the fields a template decides (mode, dropout rate, kernel) are not."""
    attention = ft.nn.MultiheadAttention(8, 4, key=jax.random.key(0))
    ft.train.save(tmp_path / "attention", attention)
    with pytest.raises(CheckpointError) as info:
        ft.train.load(tmp_path / "attention", ft.nn.MultiheadAttention(8, 2, key=jax.random.key(1)))
    message = str(info.value)
    assert "num_heads: saved 4, the template's 2" in message and "num_kv_heads: saved 4, the template's 2" in message
    assert "right:  ft.train.load(path)" in message
    assert ft.train.load(tmp_path / "attention").num_heads == 4
    chosen = ft.train.load(tmp_path / "attention", ft.nn.training(ft.nn.MultiheadAttention(
        8, 4, dropout=0.3, implementation="xla", key=jax.random.key(1))))
    assert (chosen.training, chosen.dropout, chosen.implementation) == (True, 0.3, "xla")  # the template's choices

    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, make_block(), None)
    other = make_block(seed=3).replace(activation=jax.nn.tanh, sizes=(2, 4))
    with pytest.raises(CheckpointError) as info:
        manager.restore(template=other)
    message = str(info.value)
    assert "The checkpoint's model at step 1 was saved with other static configuration" in message
    assert "activation: saved jax.nn.relu, the template's jax.nn.tanh" in message
    assert "sizes: saved (2, 3), the template's (2, 4)" in message and "manager.restore(1).model" in message
    assert_same(manager.restore(template=make_block(seed=3)).model, make_block())

    trainer = _trainer(steps=2)
    trainer.save(tmp_path / "job")
    relu_free = ft.nn.Sequential(ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.Dropout(0.5),
                                 ft.nn.Dense(3, 1, key=jax.random.key(1)))
    later = _trainer(steps=0)
    later.model = relu_free
    with pytest.raises(CheckpointError, match=r"layers\.0\.activation: saved jax\.nn\.relu, the template's"):
        later.restore(tmp_path / "job")


class WithBuffer(ft.Module):
    dense: ft.nn.Dense
    cache: jax.Array = ft.field(no_derivative=True)


def test_zero_size_arrays_and_trees_without_arrays_save_and_load(tmp_path):
    """orbax refuses an array of size 0 and an item with no array ("Cannot save arrays with
    zero size", "Found empty item", from deep inside it); such an array is its shape and
    dtype, kept in the checksummed metadata, and a tree with no array saves a placeholder."""
    model = WithBuffer(ft.nn.Dense(2, 1, key=jax.random.key(0)), jnp.zeros((0, 4), jnp.bfloat16))
    tree = {"model": model, "ids": np.zeros((3, 0), np.int32), "none": None}
    ft.train.save(tmp_path / "tree", tree)
    for back in (ft.train.load(tmp_path / "tree"), ft.train.load(tmp_path / "tree", tree)):
        assert back["model"].cache.shape == (0, 4) and back["model"].cache.dtype == jnp.bfloat16
        assert back["ids"].shape == (3, 0) and back["ids"].dtype == np.int32 and back["none"] is None
        np.testing.assert_array_equal(back["model"].dense.weight, model.dense.weight)
    for nothing in ({"a": None}, {"steps": 3, "name": None}, optax.sgd(0.1).init({"w": jnp.ones(2)})):
        ft.train.save(tmp_path / f"nothing{len(str(nothing))}", nothing)
        assert ft.train.load(tmp_path / f"nothing{len(str(nothing))}") == nothing
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, model, optax.adam(0.1).init(ft.parameters(model)))
    restored = manager.restore(template=model)
    assert restored.model.cache.shape == (0, 4) and jnp.all(restored.model.dense.bias == model.dense.bias)
    meta = tmp_path / "tree" / "meta" / "metadata"
    text = meta.read_text()
    meta.write_text(text.replace('"empty": {"model.cache": [[0, 4], "bfloat16"]', '"empty": {"model.cache": [[0, 5], "bfloat16"]'))
    with pytest.raises(CheckpointError, match=r"damaged metadata: its CRC-32 does not match"):
        ft.train.load(tmp_path / "tree")


def test_a_zero_size_numpy_array_comes_back_as_numpy(tmp_path):
    """A zero-size NumPy leaf (stored by its shape and dtype in the metadata) came back as a
    jax array, where a NumPy leaf of any other size comes back as NumPy (the guide's rule).
    It comes back as NumPy, by every reader; a zero-size jax array stays a jax array, and
    sharding= places both as it places arrays of other sizes."""
    tree = {"a": np.zeros(0, np.float32), "b": np.zeros((0, 3), np.int32), "c": np.ones(2, np.float32),
            "j": jnp.zeros((0, 2))}
    ft.train.save(tmp_path / "tree", tree)
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"w": jnp.ones(2)}, extra=tree)
    for back in (ft.train.load(tmp_path / "tree"), ft.train.load(tmp_path / "tree", tree),
                 CheckpointManager(tmp_path / "run").restore().extra):
        assert {k: type(x) for k, x in back.items()} == {"a": np.ndarray, "b": np.ndarray, "c": np.ndarray,
                                                          "j": type(tree["j"])}
        assert [(x.shape, x.dtype) for x in back.values()] == [(x.shape, x.dtype) for x in tree.values()]
    placed = ft.train.load(tmp_path / "tree", sharding=jax.devices()[0])  # a NumPy leaf of any size alike
    assert type(placed["a"]) is type(placed["b"]) is type(placed["c"]) and isinstance(placed["j"], jax.Array)


def test_a_load_template_that_does_not_fit_names_the_load_without_one(tmp_path):
    """ft.train.load's mismatch said "at step -" and "manager.restore(step).tree": the user
    of save/load has no manager."""
    ft.train.save(tmp_path / "dense", ft.nn.Dense(2, 16, key=jax.random.key(0)))
    with pytest.raises(ft.train.CheckpointError) as info:
        ft.train.load(tmp_path / "dense", ft.nn.Dense(2, 32, key=jax.random.key(0)))
    message = str(info.value)
    assert "ft.train.load(path)" in message and "step -" not in message and "manager" not in message
    assert "weight: expected shape (2, 32) dtype float32, given shape (2, 16)" in message


def test_an_untied_tree_into_a_tied_template_is_a_checkpoint_error(tmp_path):
    """Two different saved arrays where the template ties one (ft.nn.Shared) raised
    from_flat_dict's ValueError (not a CheckpointError) with its fix for a flat dict,
    ``flat.pop(...)``; an untied tree whose arrays agree loads into the tie."""
    embed, head = ft.nn.Embedding(10, 4, key=jax.random.key(0)), ft.nn.Dense(4, 10, key=jax.random.key(1))
    untied = {"embed": embed, "head": head}
    tie = {"head.weight": ("embed.embeddings", jnp.transpose)}
    ft.train.save(tmp_path / "untied", untied)
    with pytest.raises(CheckpointError, match=r"(?s)does not fit the template:\n  'head.weight' and 'embed.embeddings' "
                       r"name one tied parameter .* hold different values: the tree was saved without the tie.*"
                       r"ft.train.load\(path\)") as info:
        ft.train.load(tmp_path / "untied", ft.nn.Shared(untied, tie))
    assert "flat.pop" not in str(info.value)
    agreeing = ft.nn.Shared(untied, tie)
    ft.train.save(tmp_path / "agreeing", agreeing.resolve())
    loaded = ft.train.load(tmp_path / "agreeing", ft.nn.Shared(untied, tie))
    np.testing.assert_array_equal(loaded.resolve()["head"].weight, agreeing.resolve()["head"].weight)


def test_a_floating_dtype_mismatch_hints_code_that_casts_on_load(tmp_path):
    """A float64 checkpoint (written with x64) into a float32 template: the hint was
    from_flat_dict's "pass cast=True", which no loader takes; it now gives code that runs."""
    template = ft.nn.Dense(3, 2, key=jax.random.key(0))
    wide = jax.tree.map(lambda x: np.asarray(x, np.float64) + 0.25, template)
    path = tmp_path / "wide"
    ft.train.save(path, wide)
    manager = CheckpointManager(tmp_path / "run")
    manager.save(4, wide)
    for restore in (lambda: ft.train.load(path, template), lambda: manager.restore(template=template)):
        with pytest.raises(CheckpointError, match=r"weight: expected shape \(3, 2\) dtype float32, given shape "
                                                  r"\(3, 2\) dtype float64") as info:
            restore()
        message = str(info.value)
        assert "pass cast=True" not in message and "the loader never casts" in message
        code = message.split("cast it into the template: ")[1].split("   #")[0]
        cast = eval(code, {"ft": ft, "template": template, "path": path, "manager": manager})
        for name, leaf in ft.to_flat_dict(cast).items():
            assert leaf.dtype == jnp.float32
            np.testing.assert_allclose(leaf, ft.to_flat_dict(wide)[name], rtol=0, atol=1e-7)
    assert "ft.to_flat_dict(manager.restore(4).model)" in message
    manager.close()


def test_an_int64_count_into_an_int32_template_hints_code_that_casts_on_load(tmp_path):
    """An int64 count saved (a NumPy array, or written under x64) into an int32 template: the
    hint is the loader's cast code, which runs (from_flat_dict's "pass cast=True" is no loader's);
    a count past int32's range is told the template's dtype, not a flat dict's clip."""
    template, path = {"n": jnp.zeros((), jnp.int32), "big": jnp.zeros((), jnp.int32)}, tmp_path / "counts"
    ft.train.save(path, {"n": np.array(7, np.int64), "big": np.array(2**40, np.int64)})
    with pytest.raises(CheckpointError, match=r"n: expected shape \(\) dtype int32, given shape \(\) dtype int64") as info:
        ft.train.load(path, template)
    message = str(info.value)
    assert "hint: big: the checkpoint holds integers beyond the template's integer dtypes" in message
    assert "pass cast=True" not in message and "np.clip(flat" not in message
    assert "hint: integer dtypes differ (n): the loader never casts" in message
    code = message.split("cast it into the template: ")[1].split("   #")[0]
    ft.train.save(tmp_path / "n", {"n": np.array(7, np.int64)})  # the code, run where it fits (n alone)
    cast = eval(code, {"ft": ft, "template": {"n": template["n"]}, "path": tmp_path / "n"})
    assert cast["n"].dtype == jnp.int32 and int(cast["n"]) == 7


def test_a_checkpoint_value_of_another_kind_is_told_the_loader_s_way_not_a_flat_dict_s(tmp_path):
    """An int32 leaf saved, a float32 template: from_flat_dict's hint for another kind shows its
    own call on a flat dict, which no loader takes; the loader names the leaf and its way."""
    path = tmp_path / "counts"
    ft.train.save(path, {"w": jnp.ones(3, jnp.int32)})
    with pytest.raises(CheckpointError, match=r"w: expected shape \(3,\) dtype float32, given shape \(3,\) dtype "
                                              r"int32") as info:
        ft.train.load(path, {"w": jnp.zeros(3, jnp.float32)})
    message = str(info.value)
    assert "hint: w: the checkpoint holds values of another kind than the template's leaves" in message
    assert "ft.from_flat_dict(model" not in message


def test_narrow_dtypes_round_trip_bit_for_bit_and_uint4_is_refused_naming_the_leaf(tmp_path):
    """int4, int2 and the float8 and float4 types round-trip exactly; uint4 (and uint2),
    which tensorstore has no type for, failed with 'Error parsing object member "dtype":
    Unsupported data type' from orbax's writer; they are refused before anything is
    written, naming the leaf and the widening fix (an empty one is stored by its shape)."""
    names = [n for n in ("int4", "int2", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn")
             if hasattr(jnp, n)]
    tree = {n: jax.device_put(np.array([0.5, 1.0, 2.0, -1.0] if "float" in n else [0, 1, -1, 1],  # numpy's casts
                                       np.float32 if "float" in n else np.int32).astype(getattr(jnp, n)))  # no program
            for n in names}
    ft.train.save(tmp_path / "narrow", tree)
    back = ft.train.load(tmp_path / "narrow")
    for n, x in tree.items():
        assert back[n].dtype == x.dtype, n
        np.testing.assert_array_equal(np.asarray(back[n]).view(np.uint8), np.asarray(x).view(np.uint8))
    codes = jnp.arange(4).astype(jnp.uint4)
    with pytest.raises(CheckpointError, match=r"(?s)The leaf 'model\.codes' is a uint4\[4\] array: .*no uint4 type.*"
                                              r"Nothing was written.*codes\.astype\(jnp\.uint8\)"):
        ft.train.save(tmp_path / "u4", {"model": {"codes": codes}})
    assert not (tmp_path / "u4").exists()
    ft.train.save(tmp_path / "u4", {"model": {"codes": codes.astype(jnp.uint8)}})  # the fix
    widened = ft.train.load(tmp_path / "u4")["model"]["codes"].astype(jnp.uint4)
    np.testing.assert_array_equal(np.asarray(widened).view(np.uint8), np.asarray(codes).view(np.uint8))
    ft.train.save(tmp_path / "empty", {"codes": jnp.zeros((0, 3), jnp.uint4)})  # no array file: its shape
    assert ft.train.load(tmp_path / "empty")["codes"].dtype == jnp.uint4


def test_a_narrow_float_tensorstore_lacks_is_refused_before_anything_is_written(tmp_path):
    """float8_e4m3 (every supported JAX) and float6_e2m3fn (jax 0.12 makes arrays of it)
    have no tensorstore type: orbax's writer failed with 'Error parsing object member
    "dtype": Unsupported data type' and left ``<path>.orbax-checkpoint-tmp`` behind. Both
    are refused first, naming the leaf and the exact float32 widening."""
    import ml_dtypes

    values = np.array([0.5, 1.0, 2.0, -1.0], np.float32)
    trees = {"e4m3": {"model": {"w": jax.device_put(values.astype(ml_dtypes.float8_e4m3))}},
             "f6": {"model": {"w": values.astype(ml_dtypes.float6_e2m3fn)}}}  # NumPy: any JAX
    for name, tree in trees.items():
        dtype = tree["model"]["w"].dtype.name
        with pytest.raises(CheckpointError) as info:
            ft.train.save(tmp_path / name, tree)
        message = str(info.value)
        assert f"The leaf 'model.w' is a {dtype}[4] array: orbax's files (tensorstore) have no {dtype} type" in message
        assert "Nothing was written" in message and f"every {dtype} value is a float32" in message
        assert f'weights.astype(jnp.float32)}})    # loaded["weights"].astype(jnp.{dtype})' in message
    with pytest.raises(CheckpointError, match=r"The leaf 'raw' is ndarray .*not text or objects"):
        ft.train.save(tmp_path / "raw", {"raw": np.zeros(3, "V4")})  # raw bytes: no widening
    assert sorted(os.listdir(tmp_path)) == []  # no temporary directory either
    ft.train.save(tmp_path / "e4m3", {"w": trees["e4m3"]["model"]["w"].astype(jnp.float32)})  # the fix
    back = ft.train.load(tmp_path / "e4m3")["w"].astype(ml_dtypes.float8_e4m3)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(trees["e4m3"]["model"]["w"]).view(np.uint8))


def test_python_ints_of_64_bits_round_trip_and_a_larger_one_is_refused_naming_it(tmp_path):
    """int64's and uint64's ranges come back as the ints they were; past them NumPy holds an
    object, refused as "not text or objects" with a fix about text (now BIG_INT, with a split)."""
    from functree.train.checkpoint import _treespec

    tree = {"run": {"low": -(2**63), "high": 2**64 - 1, "flag": True}}
    ft.train.save(tmp_path / "ok", tree)
    back = ft.train.load(tmp_path / "ok")
    assert back == tree and type(back["run"]["high"]) is int and type(back["run"]["flag"]) is bool
    for seed in (2**64 + 5, -(2**63) - 1):
        raises_named(lambda seed=seed: ft.train.save(tmp_path / "big", {"run": {"seed": seed}}), CheckpointError,
                     _treespec.BIG_INT, f"The leaf 'run.seed' is the Python int {seed}, beyond 64 bits")
    assert "[seed >> 64, seed & (2**64 - 1)]" in _treespec.BIG_INT and not (tmp_path / "big").exists()


# --- functions at leaves (Equinox models: activations, pooling operations, jax.nn.relu in a list) ---

@pytest.fixture
def registry_restored():
    """The checkpoint registry as it was before the test (a test registering functions)."""
    from functree.train.checkpoint import _registry
    _registry._load_builtins()
    functions, names = dict(_registry._functions), dict(_registry._names)
    yield
    _registry._functions.clear(), _registry._functions.update(functions)
    _registry._names.clear(), _registry._names.update(names)


def test_known_functions_at_leaves_round_trip_by_name(tmp_path):
    tree = {"layers": [jnp.arange(3.0), jax.nn.relu, jnp.ravel], "act": ft.nn.gelu, "pool": jax.lax.max}
    ft.train.save(tmp_path / "f", tree)  # was CheckpointError "not text or objects"
    for back in (ft.train.load(tmp_path / "f"), ft.train.load(tmp_path / "f", tree)):
        assert back["layers"][1] is jax.nn.relu and back["layers"][2] is jnp.ravel and back["act"] is ft.nn.gelu
        assert back["pool"] is jax.lax.max  # an Equinox MaxPool2d's operation
        np.testing.assert_array_equal(np.asarray(back["layers"][0]), np.arange(3.0))
    with pytest.raises(CheckpointError, match=r"layers\.1"):  # another function in the template: refused
        ft.train.load(tmp_path / "f", {**tree, "layers": [jnp.arange(3.0), jax.nn.gelu, jnp.ravel]})


def test_an_unknown_function_at_a_leaf_names_the_key_path_and_working_fixes(tmp_path, registry_restored):
    def my_act(x):
        return x * 2

    tree = {"w": jnp.ones(2), "block": {"act": my_act}, "pool": jax.lax.sub}
    with pytest.raises(CheckpointError, match=r"'block.act' is the function .*my_act") as info:
        ft.train.save(tmp_path / "u", tree)
    assert 'ft.train.register(my_function, name="mymodule.my_function")' in str(info.value)
    assert "eqx.filter(model, eqx.is_array)" in str(info.value) and not (tmp_path / "u").exists()
    with pytest.raises(CheckpointError, match=r'register\(jax.lax.sub, name="jax.lax.sub"\)'):
        ft.train.save(tmp_path / "u", {"w": jnp.ones(2), "pool": jax.lax.sub})
    ft.train.register(jax.lax.sub, name="jax.lax.sub")  # the message's fix works
    ft.train.save(tmp_path / "v", {"w": jnp.ones(2), "pool": jax.lax.sub})
    assert ft.train.load(tmp_path / "v")["pool"] is jax.lax.sub


def test_equinox_mlp_saves_with_the_messages_fixes(tmp_path, registry_restored):
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.relu, key=jax.random.key(3))
    with pytest.raises(CheckpointError, match="final_activation"):  # equinox's own identity lambda
        ft.train.save(tmp_path / "m", mlp)
    ft.train.save(tmp_path / "a", eqx.filter(mlp, eqx.is_array))
    back = eqx.combine(ft.train.load(tmp_path / "a", eqx.filter(mlp, eqx.is_array)), mlp)
    call = eqx.filter_jit(lambda net: net(np.ones(2, np.float32)))  # one program, not one per eager operation
    np.testing.assert_array_equal(np.asarray(call(back)), np.asarray(call(mlp)))
    ft.train.register(mlp.final_activation, name="equinox.nn._mlp.identity")
    ft.train.save(tmp_path / "m", mlp)
    back = ft.train.load(tmp_path / "m", mlp)
    assert back.activation is jax.nn.relu
    np.testing.assert_array_equal(np.asarray(call(back)), np.asarray(call(mlp)))


@pytest.mark.parametrize("tree", [jnp.arange(3.0), 2.5, np.float32(1.5), jnp.array(7, jnp.int32)],
                         ids=["array", "float", "numpy-scalar", "int-array"])
def test_a_bare_leaf_loads_with_a_template(tmp_path, tree):
    """A tree that is one leaf is stored as "value" (a manager's part as "model"); with a
    template, from_flat_dict names the root "": load said "missing keys: [''] unexpected
    keys: ['value']"."""
    ft.train.save(tmp_path / "leaf", tree)
    for back in (ft.train.load(tmp_path / "leaf"), ft.train.load(tmp_path / "leaf", tree)):
        assert type(back) is type(tree) or isinstance(back, jax.Array)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(tree))
    with pytest.raises(CheckpointError, match=r"shape"):
        ft.train.load(tmp_path / "leaf", jnp.zeros((5,)))
    manager = CheckpointManager(tmp_path / "run")
    manager.save(1, tree, extra=tree)
    restored = manager.restore(template=tree, extra_template=tree)
    np.testing.assert_array_equal(np.asarray(restored.model), np.asarray(tree))
    np.testing.assert_array_equal(np.asarray(restored.extra), np.asarray(tree))


def test_save_of_a_donated_tree_names_the_call_and_writes_nothing(tmp_path):
    # JAX said only "Array has been deleted with shape=float32[3,1]".
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    step = ft.train.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), opt)
    state = opt.init(model)
    new_model, new_state, _ = step(model, state, (jnp.ones((4, 3)), jnp.ones((4, 1))))
    stale = r"holds a deleted array at {}: call 1 of the train step donated it(.|\n)*Use what the step returns"
    with pytest.raises(ValueError, match=r"The input of ft\.train\.save\(path, tree\) " + stale.format(r"tree\.old\.weight")):
        ft.train.save(tmp_path / "x", {"new": new_model, "old": model})
    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(ValueError, match=r"The input of CheckpointManager\.save\(step, model, opt_state\) "
                                         + stale.format(r"opt_state\..*")):
        manager.save(1, new_model, state)
    assert not (tmp_path / "x").exists() and not (tmp_path / "run" / "1").exists()
    manager.save(1, new_model, new_state)  # the step's returned values: saved
    ft.train.save(tmp_path / "x", new_model)
    np.testing.assert_array_equal(np.asarray(ft.train.load(tmp_path / "x").weight), np.asarray(new_model.weight))


# --- extra_template entry by entry --------------------------------------------------------------

def _extra_job(directory):
    """A Dense and a checkpoint of it whose extra holds an EMA of it (an exact copy, halved),
    a Python int and an int32 array: ``(model, ema, manager)``."""
    model = ft.nn.Dense(3, 2, key=jax.random.key(0))
    ema = model.replace(weight=model.weight * 0.5)
    manager = CheckpointManager(directory)
    manager.save(1, model, extra={"ema": ema, "rounds": 3, "seen": np.arange(4, dtype=np.int32)})
    return model, ema, manager


def test_extra_template_checks_the_entry_it_names_and_reads_the_others_as_saved(tmp_path):
    """main: extra_template was the whole extra's template only: naming one entry refused
    the others ("unexpected keys: rounds, seen.")."""
    model, ema, manager = _extra_job(tmp_path / "run")
    with manager:
        ckpt = manager.restore(template=model, extra_template={"ema": model})
    assert list(ckpt.extra) == ["ema", "rounds", "seen"]  # the saved order
    assert type(ckpt.extra["ema"]) is ft.nn.Dense and type(ckpt.extra["rounds"]) is int and ckpt.extra["rounds"] == 3
    np.testing.assert_array_equal(np.asarray(ckpt.extra["ema"].weight), np.asarray(ema.weight))  # stored bits
    np.testing.assert_array_equal(np.asarray(ckpt.extra["ema"].bias), np.asarray(ema.bias))
    np.testing.assert_array_equal(np.asarray(ckpt.extra["seen"]), np.arange(4, dtype=np.int32))
    assert np.asarray(ckpt.extra["seen"]).dtype == np.int32


def test_extra_template_skips_an_entry_unread(tmp_path):
    """main: no way to leave an entry of extra unread: one whose class was edited since the
    save failed the whole restore (SpecError at extra.probe), with nothing to skip it by."""
    cells = sys.modules.setdefault("checkpoint_extra_cells", types.ModuleType("checkpoint_extra_cells"))
    ns = cells.__dict__
    ns.update(ft=ft, jax=jax)
    exec("class Probe(ft.Module):\n    w: jax.Array\n", ns)
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"w": jnp.ones(2)}, extra={"keep": jnp.arange(3.0), "probe": ns["Probe"](jnp.ones(2))})
        exec("class Probe(ft.Module):\n    v: jax.Array\n", ns)  # the field renamed: no longer readable
        with pytest.raises(SpecError, match=r"extra\.probe"):
            manager.restore()  # read, the entry fails
        ckpt = manager.restore(extra_template={"probe": CheckpointManager.SKIP, "absent": CheckpointManager.SKIP})
    assert list(ckpt.extra) == ["keep"]
    np.testing.assert_array_equal(np.asarray(ckpt.extra["keep"]), np.arange(3.0, dtype=np.float32))
    assert repr(CheckpointManager.SKIP) == "CheckpointManager.SKIP"


def test_a_wrong_extra_entry_template_is_refused_naming_its_key_path(tmp_path):
    """main: a template for one entry was refused as the whole extra's ("The checkpoint's
    extra ... does not fit": missing and unexpected keys), never naming extra.ema or its shape."""
    model, _, manager = _extra_job(tmp_path / "run")
    with manager:
        with pytest.raises(CheckpointError, match=r"(?s)The checkpoint's extra\.ema at step 1 does not fit the "
                                                  r"template:\n  weight: expected shape \(2, 2\) dtype float32, given "
                                                  r"shape \(3, 2\).*extra_template=\{'ema': None\}\)\.extra\['ema'\]"):
            manager.restore(extra_template={"ema": ft.nn.Dense(2, 2, key=jax.random.key(0))})
        half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model)
        with pytest.raises(CheckpointError, match=r"(?s)extra\.ema at step 1 does not fit.*weight: expected shape "
                                                  r"\(3, 2\) dtype bfloat16, given shape \(3, 2\) dtype float32.*"
                                                  r"ft\.to_flat_dict\(manager\.restore\(1, extra_template=\{'ema': "
                                                  r"None\}\)\.extra\['ema'\]\), cast=True\)"):
            manager.restore(extra_template={"ema": half})  # the cast hint: the entry's call, braces and all
        relu = ft.nn.Dense(3, 2, jax.nn.relu, key=jax.random.key(0))
        with pytest.raises(CheckpointError, match=r"extra\.ema\.activation: saved functree\.nn\.identity, the "
                                                  r"template's jax\.nn\.relu(.|\n)*wrong:  manager\.restore\(1, "
                                                  r"extra_template=\.\.\.\)"):
            manager.restore(extra_template={"ema": relu})
        with pytest.raises(CheckpointError, match=r"(?s)template for extra\.emma, but the checkpoint's extra at step 1 "
                                                  r"has no entry 'emma': its entries are \['ema', 'rounds', 'seen'\].*"
                                                  r"right:  manager\.restore\(1, extra_template=\{'ema': template\}\)"):
            manager.restore(extra_template={"emma": model})


_CELL = "class Net(ft.Module):\n    w: jax.Array\n    b: jax.Array\n"
_CELL_EDITED = _CELL + "    scale: float = ft.field(static=True, default=1.0)\n"


def _pool_net(pool: Any, key: jax.Array) -> Any:
    a, b = jax.random.split(key)
    return ft.nn.Sequential([ft.nn.Conv2D(1, 4, 3, key=a), pool, ft.nn.Flatten(), ft.nn.Dense(64, 2, key=b)])


def test_a_teacher_of_the_models_class_with_other_layers_inside_is_read_as_saved(tmp_path):
    """A Sequential teacher in extra with a MaxPool2D where the model has an AvgPool2D (no
    leaves, no statics: the same key paths, shapes and dtypes): reading every Module of the
    model's class with the model as template swapped the pool in (outputs off by 0.49)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    model, teacher = _pool_net(ft.nn.AvgPool2D(2), k1), _pool_net(ft.nn.MaxPool2D(2), k2)
    x = jax.random.normal(jax.random.key(3), (2, 8, 8, 1))
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, model, extra={"teacher": teacher})
        back = manager.restore(template=model).extra["teacher"]
    assert type(back.layers[1]) is ft.nn.MaxPool2D
    call = jax.jit(lambda net: net(x))  # one program for both (same layers), not an eager one per operation
    np.testing.assert_array_equal(np.asarray(call(back)), np.asarray(call(teacher)))


_HOLDER = "class Holder(ft.Module):\n    pool: ft.Module\n    w: jax.Array\n"


def test_an_edited_class_in_extra_with_other_layers_inside_keeps_its_error(tmp_path):
    """An edited class read with the model as its template must hold the model's classes
    at every key path: a saved MaxPool2D inside would be read as the model's AvgPool2D."""
    cells = sys.modules.setdefault("checkpoint_extra_holder", types.ModuleType("checkpoint_extra_holder"))
    ns = cells.__dict__
    ns.update(ft=ft, jax=jax)
    exec(_HOLDER, ns)
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, ns["Holder"](ft.nn.AvgPool2D(2), jnp.ones(2)),
                     extra={"teacher": ns["Holder"](ft.nn.MaxPool2D(2), jnp.ones(2))})
        exec(_HOLDER + "    scale: float = ft.field(static=True, default=1.0)\n", ns)
        template = ns["Holder"](ft.nn.AvgPool2D(2), jnp.zeros(2))
        with pytest.raises(SpecError, match=r"Holder` at 'extra\.teacher' was edited since this checkpoint was saved"):
            manager.restore(1, template=template)
        skipped = manager.restore(1, template=template, extra_template={"teacher": CheckpointManager.SKIP})
        assert type(skipped.model.pool) is ft.nn.AvgPool2D and "teacher" not in skipped.extra


def test_a_module_of_the_models_class_in_extra_is_read_like_the_model(tmp_path):
    """main: after a static field was added to the model's class, restore(template=model)
    read the model but failed at extra.best (the same class, decoded without a template:
    "Net was edited since this checkpoint was saved"). A Module of the class not edited is
    decoded as saved whatever its sizes; an edited one that does not fit keeps the error."""
    cells = sys.modules.setdefault("checkpoint_extra_net", types.ModuleType("checkpoint_extra_net"))
    ns = cells.__dict__
    ns.update(ft=ft, jax=jax)
    exec(_CELL, ns)
    rng = np.random.default_rng(0)
    w, b, w2 = (rng.normal(size=s).astype(np.float32) for s in ((3, 1), (1,), (3, 1)))
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, ns["Net"](jnp.asarray(w), jnp.asarray(b)), extra={"best": ns["Net"](jnp.asarray(w2), jnp.asarray(b))})
        manager.save(2, ns["Net"](jnp.asarray(w), jnp.asarray(b)), extra={"wide": ns["Net"](jnp.ones((5, 2)), jnp.ones(2))})
        wide = manager.restore(2, template=ns["Net"](jnp.zeros((3, 1)), jnp.zeros(1))).extra["wide"]
        assert type(wide) is ns["Net"] and wide.w.shape == (5, 2)  # other sizes: as saved
        exec(_CELL_EDITED, ns)
        template = ns["Net"](jnp.zeros((3, 1)), jnp.zeros(1))
        ckpt = manager.restore(1, template=template)
        with pytest.raises(SpecError, match=r"Net` at 'extra\.wide' was edited since this checkpoint was saved"):
            manager.restore(2, template=template)  # other sizes: the template does not fit
    best = ckpt.extra["best"]
    assert type(best) is ns["Net"] and best.scale == 1.0 and type(ckpt.model) is ns["Net"]
    np.testing.assert_array_equal(np.asarray(best.w), w2)
    np.testing.assert_array_equal(np.asarray(best.b), b)
    np.testing.assert_array_equal(np.asarray(ckpt.model.w), w)


class _ActNet(ft.Module):
    """A model whose static activation is a ``functools.partial``: stored as its text."""

    w: jax.Array
    act: Any = ft.field(static=True, default=None)

    def __call__(self, x):
        return self.act(x @ self.w)


def test_a_teacher_with_another_partial_activation_is_not_read_with_the_models(tmp_path):
    """A Module of the model's class in extra whose partial activation needs a template is
    read with the model as template only where the stored text is the model's (memory
    addresses aside): a teacher's negative_slope=0.1 under the model's 0.3 keeps its error
    (read with the model's, its outputs on negative inputs would be 3x the saved ones)."""
    def act(slope: float) -> Any:
        return functools.partial(jax.nn.leaky_relu, negative_slope=slope)

    w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)
    model = _ActNet(w=w, act=act(0.3))
    same, other = _ActNet(w=2 * w, act=act(0.3)), _ActNet(w=w, act=act(0.1))
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, model, extra={"teacher": same})
        manager.save(2, model, extra={"teacher": other})
        back = manager.restore(1, template=_ActNet(w=jnp.zeros((3, 4)), act=act(0.3))).extra["teacher"]
        z = np.asarray(x @ (2 * w))
        np.testing.assert_allclose(np.asarray(back(x)), np.where(z > 0, z, 0.3 * z), rtol=0, atol=1e-6)
        with pytest.raises(SpecError, match=r"static value at 'extra\.teacher\.act' without a template"):
            manager.restore(2, template=_ActNet(w=jnp.zeros((3, 4)), act=act(0.3)))


# --- save(overwrite=True) killed at each step: the old or the new tree loads -----------------

class _Killed(BaseException):
    """A save stopped dead at a chosen point (no handler catches a BaseException here)."""


def _kill_at(monkeypatch, path, point):
    """Stop ``ft.train.save(path, ..., overwrite=True)`` at ``point``: while orbax writes the
    new tree, or before, between or after the renames that swap it in."""
    from orbax.checkpoint._src.path import atomicity

    new, old = path.with_name("m.functree-new"), path.with_name("m.functree-old")
    rename, rmtree = os.rename, __import__("shutil").rmtree

    def killing_rename(src, dst, *args, **kwargs):
        if (point, os.fspath(src)) in (("before_swap", os.fspath(path)), ("old_moved", os.fspath(new))):
            raise _Killed
        return rename(src, dst, *args, **kwargs)

    def killing_rmtree(target, *args, **kwargs):
        if os.fspath(target) == os.fspath(old):
            if point == "mid_delete":  # half the old tree deleted
                files = sorted(os.path.join(r, f) for r, _, fs in os.walk(old) for f in fs)
                for f in files[: len(files) // 2]:
                    os.unlink(f)
            if point in ("new_moved", "mid_delete"):
                raise _Killed
        return rmtree(target, *args, **kwargs)

    def killing_finalize(self, *args, **kwargs):
        raise _Killed

    if point == "writing":
        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", killing_finalize)
    monkeypatch.setattr(os, "rename", killing_rename)
    monkeypatch.setattr("shutil.rmtree", killing_rmtree)


@pytest.mark.parametrize("point, survivor", [("writing", "old"), ("before_swap", "old"), ("old_moved", "old"),
                                             ("new_moved", "new"), ("mid_delete", "new")])
def test_an_overwrite_killed_at_any_step_leaves_the_old_or_the_new_tree(tmp_path, monkeypatch, point, survivor):
    """Before the fix save(overwrite=True) deleted the old tree first (orbax's force=True):
    killed while writing, neither tree loaded ("not found" or a truncated stream)."""
    path = tmp_path / "m"
    trees = {name: {"w": np.full((4,), value, np.float32), "big": np.full((64, 64), value, np.float32)}
             for name, value in (("old", 1.0), ("new", 2.0), ("third", 3.0))}
    ft.train.save(path, trees["old"])
    _kill_at(monkeypatch, path, point)
    with pytest.raises(_Killed):
        ft.train.save(path, trees["new"], overwrite=True)
    monkeypatch.undo()
    loaded = ft.train.load(path)
    for key in ("w", "big"):
        np.testing.assert_array_equal(np.asarray(loaded[key]), trees[survivor][key])
    # the next save settles what the killed one left: the survivor at path, nothing beside it
    with pytest.raises(CheckpointError, match=r"already exists. Nothing was overwritten"):
        ft.train.save(path, trees["third"])
    assert os.listdir(tmp_path) == ["m"]
    np.testing.assert_array_equal(np.asarray(ft.train.load(path)["w"]), trees[survivor]["w"])
    ft.train.save(path, trees["third"], overwrite=True)
    assert os.listdir(tmp_path) == ["m"]
    np.testing.assert_array_equal(np.asarray(ft.train.load(path)["big"]), trees["third"]["big"])


KILLED_OVERWRITE = """
import os, sys
import numpy as np
import functree as ft

path = sys.argv[3]  # after FRESH_RESUME's two (fresh_process runs both)
rename = os.rename

def die_between_the_renames(src, dst, *args, **kwargs):
    if os.fspath(src) == path + ".functree-new":  # the old tree is already moved aside
        os._exit(9)                                # dies as a SIGKILL does: no handler runs
    return rename(src, dst, *args, **kwargs)

os.rename = die_between_the_renames
ft.train.save(path, {"w": np.full(4, 2.0, np.float32)}, overwrite=True)
"""


def test_a_process_killed_between_the_renames_of_an_overwrite_leaves_the_old_tree(fresh_process):
    _, tmp_path, proc = fresh_process  # the process of KILLED_OVERWRITE (after a resume)
    path = tmp_path / "m"
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["m.functree-new", "m.functree-old"]  # path itself missing
    np.testing.assert_array_equal(np.asarray(ft.train.load(path)["w"]), np.full(4, 1.0, np.float32))
    ft.train.save(path, {"w": np.full(4, 3.0, np.float32)}, overwrite=True)
    assert os.listdir(tmp_path) == ["m"]
    np.testing.assert_array_equal(np.asarray(ft.train.load(path)["w"]), np.full(4, 3.0, np.float32))


def test_restoring_where_nothing_was_saved_shows_the_restart_guard(tmp_path):
    """It used to suggest the call that had just failed: "right: manager.restore() # the
    latest, or one of []"."""
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.adam(1e-2),
                               lambda m, b: jnp.mean(m(b[0]) ** 2))
    with pytest.raises(CheckpointError) as info:
        trainer.restore(tmp_path / "run")
    message = str(info.value)
    assert message.startswith(f"No checkpoint at all in {tmp_path / 'run'}: nothing has been saved there yet")
    assert "right:  if manager.latest_step() is not None:" in message and "one of []" not in message
    assert not (tmp_path / "run").exists()  # a restore writes nothing (the manager it opened created it)
    assert CheckpointManager(tmp_path / "run").latest_step() is None  # the guard the message shows


def test_loading_a_path_that_does_not_exist_says_so(tmp_path):
    """ft.train.load of a missing path said it "is corrupted or incomplete"."""
    with pytest.raises(CheckpointError, match=r"No checkpoint at .*missing: there is no such file or directory"):
        ft.train.load(tmp_path / "missing")


# --- save(overwrite=True) onto a symlink or a plain file; only functree's own names removed ----

def _w(value):
    return {"w": np.full(4, value, np.float32)}


def _loaded_w(path):
    return np.asarray(ft.train.load(path)["w"])


def test_an_overwrite_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path):
    """The link itself was swapped aside as `link.functree-old` (a symlink, which
    shutil.rmtree refuses: OSError), and every later save to it failed the same way."""
    real, link = tmp_path / "real", tmp_path / "link"
    ft.train.save(real, _w(1.0))
    os.symlink(real, link)
    for value in (2.0, 3.0):  # the second save found the first one's leftover
        ft.train.save(link, _w(value), overwrite=True)
        assert link.is_symlink() and os.readlink(link) == os.fspath(real)
        assert sorted(os.listdir(tmp_path)) == ["link", "real"]
        np.testing.assert_array_equal(_loaded_w(link), np.full(4, value, np.float32))
        np.testing.assert_array_equal(_loaded_w(real), np.full(4, value, np.float32))


def test_an_overwrite_of_a_plain_file_replaces_it(tmp_path):
    """The file was renamed aside, then shutil.rmtree(file) raised NotADirectoryError after the
    swap, and every later save to the path failed on the leftover."""
    path = tmp_path / "m"
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"already exists. Nothing was overwritten"):
        ft.train.save(path, _w(1.0))
    assert path.read_text() == "not a checkpoint"
    for value in (1.0, 2.0):
        ft.train.save(path, _w(value), overwrite=True)
        assert os.listdir(tmp_path) == ["m"]
        np.testing.assert_array_equal(_loaded_w(path), np.full(4, value, np.float32))


def test_settling_removes_only_the_names_functree_and_orbax_create(tmp_path):
    """`m.functree-new.backup` (a user's) was deleted with the leftovers. A leftover of the
    names functree writes is still removed: the new tree, orbax's temporary of it, an old
    tree that is a symlink or a file (from the bug above)."""
    path = tmp_path / "m"
    ft.train.save(path, _w(1.0))
    (tmp_path / "m.functree-new.backup").mkdir()
    (tmp_path / "m.functree-new.backup" / "notes.txt").write_text("keep")
    (tmp_path / "m.functree-new.orbax-checkpoint-tmp-1712").mkdir()
    (tmp_path / "m.functree-new").mkdir()
    os.symlink(path, tmp_path / "m.functree-old")
    ft.train.save(path, _w(2.0), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["m", "m.functree-new.backup"]
    assert (tmp_path / "m.functree-new.backup" / "notes.txt").read_text() == "keep"
    np.testing.assert_array_equal(_loaded_w(path), np.full(4, 2.0, np.float32))


def test_a_one_process_save_writes_jax_arrays_by_orbax_s_numpy_path(tmp_path):
    """Orbax's jax-array path (replica slices, a sharding record, array metadata merged and
    validated) cost twice the CPU of its NumPy path per save: a jax array the process holds
    whole is written as NumPy (``process_local``) and still comes back as a jax array on the
    reader's device, checked by its CRC-32; a NumPy leaf still comes back as NumPy."""
    tree = {"w": jnp.arange(3.0), "half": jnp.ones(2, jnp.bfloat16), "n": np.arange(2, dtype=np.int32)}
    ft.train.save(tmp_path / "t", tree)
    meta = json.loads((tmp_path / "t" / "meta" / "metadata").read_text())
    assert sorted(meta["process_local"]) == ["half", "w"] and not list((tmp_path / "t").rglob("_sharding"))
    assert meta["written_on"]["device_count"] == 1  # the writer's device, as information
    for out in (ft.train.load(tmp_path / "t"), ft.train.load(tmp_path / "t", tree)):
        assert isinstance(out["w"], jax.Array) and out["w"].committed and out["w"].devices() == {jax.devices()[0]}
        assert out["half"].dtype == jnp.bfloat16 and isinstance(out["n"], np.ndarray) and out["n"].dtype == np.int32
        np.testing.assert_array_equal(out["w"], np.arange(3.0, dtype=np.float32))


def test_all_steps_sees_what_another_writer_changed(tmp_path):
    """all_steps lists the step directories and asks orbax to read every step's metadata
    again only when the listing differs from what it knows: a step removed or added behind
    the manager's back is still seen, and the manager keeps saving and pruning."""
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory, max_to_keep=2)
    for step in (1, 2):
        manager.save(step, {"w": jnp.full(2, float(step))})
    shutil.rmtree(directory / "1")
    assert manager.all_steps() == [2]
    with CheckpointManager(directory, max_to_keep=None) as other:
        other.save(5, {"w": jnp.full(2, 5.0)})
    assert manager.all_steps() == [2, 5] and manager.latest_step() == 5
    np.testing.assert_array_equal(manager.restore().model["w"], np.full(2, 5.0, np.float32))
    manager.save(6, {"w": jnp.full(2, 6.0)})
    assert manager.all_steps() == [5, 6] and sorted(os.listdir(directory)) == ["5", "6"]
    manager.close()


# --- paths as a user writes them ---------------------------------------------------------------

def test_a_path_under_the_home_directory_is_read_and_written_there(tmp_path, monkeypatch, home_and_work):
    """``"~/runs/exp"`` made a directory named ``~`` in the working directory: a later load
    from another directory (or trainer.restore, whose existence check read the path apart)
    found no checkpoint, and `rm -rf ~` is how such a folder is usually removed."""
    home, work = home_and_work
    ft.train.save("~/tree", _w(1.0))
    with CheckpointManager("~/run") as manager:
        manager.save(1, _w(2.0))
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean(m(b) ** 2))
    trainer.save("~/job")
    assert sorted(os.listdir(home)) == ["job", "run", "tree"] and os.listdir(work) == []
    monkeypatch.chdir(tmp_path)  # read from another working directory
    np.testing.assert_array_equal(_loaded_w("~/tree"), np.full(4, 1.0, np.float32))
    np.testing.assert_array_equal(CheckpointManager("~/run").restore().model["w"], np.full(4, 2.0, np.float32))
    assert trainer.restore("~/job").steps_run == 0 and ft.train.JobState.restore("~/job").steps_run == 0
    assert sorted(os.listdir(tmp_path)) == ["home", "work"]


def test_a_file_on_the_path_is_named_with_the_directory_to_give(tmp_path):
    """A file where a checkpoint needs a folder above it raised orbax's bare
    NotADirectoryError (naming the step's path, not the file); a file given to ft.train.load,
    or a file or folder inside a checkpoint, was "corrupted or incomplete"."""
    from functree.train.checkpoint._checkpoint import A_FILE, INSIDE_A_TREE
    from functree.train.checkpoint._directory import FILE_ON_THE_PATH
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean(m(b) ** 2))
    fixed = tmp_path / "notes.txt_checkpoints" / "run" / "a"
    for call, right in ((lambda: ft.train.save(notes / "run" / "a", _w(1.0)), f'ft.train.save("{fixed}")'),
                        (lambda: CheckpointManager(notes / "run" / "a"), f'ft.train.CheckpointManager("{fixed}")'),
                        (lambda: trainer.save(notes / "run" / "a"), f'ft.train.CheckpointManager("{fixed}")')):
        raises_named(call, CheckpointError, FILE_ON_THE_PATH, f"{notes} is a file, not a directory")
        with pytest.raises(CheckpointError, match=re.escape(f"right:  {right}")):
            call()
    assert notes.read_text() == "not a folder" and os.listdir(tmp_path) == ["notes.txt"]
    ft.train.save(tmp_path / "model", _w(1.0))
    raises_named(lambda: ft.train.load(notes), CheckpointError, A_FILE, f'ft.nn.load_torch_state_dict(model, "{notes}")')
    for inside, what in ((tmp_path / "model" / "meta" / "metadata", "a file"), (tmp_path / "model" / "arrays", "a folder")):
        raises_named(functools.partial(ft.train.load, inside), CheckpointError, INSIDE_A_TREE,
                     f'{what} inside the checkpoint {tmp_path / "model"}')
        with pytest.raises(CheckpointError, match=re.escape(f'right:  ft.train.load("{tmp_path / "model"}")')):
            ft.train.load(inside)


def test_a_home_path_only_a_folder_named_tilde_here_holds_names_it(tmp_path, monkeypatch, home_and_work):
    """``CheckpointManager("~/run")`` / ``ft.train.load("~/run")`` where only ``./~/run`` holds
    the checkpoint (an older writer's folder named ``~``) said there was none, the manager
    making an empty ``~/run`` in the home; each checkpoint read is LITERAL_TILDE now, naming
    ``"./~/run"``, as the model readers (``from_hf``, ``load_torch_state_dict``) are."""
    from functree._files import LITERAL_TILDE
    home, _ = home_and_work
    ft.train.save("./~/tree", _w(1.0))
    with CheckpointManager("./~/run") as manager:
        manager.save(1, _w(2.0))
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean(m(b) ** 2))
    for call, name, given in ((ft.train.load, "ft.train.load", "~/tree"),
                              (CheckpointManager, "ft.train.CheckpointManager", "~/run"),
                              (trainer.restore, "ft.train.Trainer.restore", "~/run"),
                              (lambda p: ft.train.migrate(p, str(tmp_path / "out")), "ft.train.migrate", "~/run")):
        raises_named(functools.partial(call, given), FileNotFoundError, LITERAL_TILDE,
                     f"right:  {name}(... './{given}' ...)")
    assert os.listdir(home) == []  # no empty ~/run made
    np.testing.assert_array_equal(CheckpointManager("./~/run").restore().model["w"], np.full(4, 2.0, np.float32))


def test_a_dot_slash_tilde_path_is_the_folder_named_tilde_here(tmp_path, monkeypatch):
    """``"./~/old"`` (how a shell names a folder called ``~`` in the working directory, one an
    older save or transformers' ``save_pretrained("~/m")`` left) was read as ``~/old``, the
    home's: pathlib drops the ``./`` before ``expanduser``. An unknown ``~user`` raised
    RuntimeError; a shell leaves it as it is."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    ft.train.save("./~/old", _w(3.0))
    assert (tmp_path / "~" / "old").is_dir() and os.listdir(home) == []
    np.testing.assert_array_equal(_loaded_w(str(tmp_path / "~" / "old")), np.full(4, 3.0, np.float32))
    ft.train.save("~no-such-user-here/x", _w(4.0))
    np.testing.assert_array_equal(_loaded_w(str(tmp_path / "~no-such-user-here" / "x")), np.full(4, 4.0, np.float32))
