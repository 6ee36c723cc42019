"""Checkpoints: types rebuilt without a template, templates checked, retention, atomicity."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.train import CheckpointError, CheckpointManager
from functree.train._treespec import SpecError


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


def test_missing_best_metric_and_bad_mode(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", best_metric="val_loss")
    with pytest.raises(CheckpointError, match=r'metrics=\{"val_loss": value\}'):
        manager.save(1, {"w": jnp.ones(1)}, metrics={"loss": 1.0})
    with pytest.raises(ValueError, match=r'mode="min"'):
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


KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    import functree as ft

    manager = ft.train.CheckpointManager(sys.argv[1])
    manager.save(1, {"w": jnp.ones(1000)})
    original = atomicity.AtomicRenameTemporaryPath.finalize

    def stall(self, *args, **kwargs):
        print("MIDSAVE", flush=True)
        time.sleep(120)
        return original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = stall
    manager.save(2, {"w": jnp.zeros(1000)})
    print("FINISHED", flush=True)
    """
)


def test_process_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "MIDSAVE" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "MIDSAVE" in line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
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
