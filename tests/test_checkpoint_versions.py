"""Checkpoints across JAX versions: what the oldest supported JAX wrote reads and continues
under this one (issue 44, item 5).

``tests/data/jax_floor_checkpoint/`` was written by ``tests/data/make_jax_floor_checkpoint.py``
under jax 0.9.2 (the floor of ``pyproject.toml``, ``.ci/run``'s floor leg): a tree of every
leaf kind and a Trainer job saved after 3 steps. This file runs in the floor environment, in
the main one and in the newest (jax 0.11.2): the arrays read back bit for bit, and the job
continues to step 10 as it did under jax 0.9.2 (to rounding: another XLA may sum in
another order).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "jax_floor_checkpoint"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def _writer():
    """The script that wrote the fixture: its model, loss and data, as it defines them."""
    spec = importlib.util.spec_from_file_location("make_jax_floor_checkpoint", DATA / "make_jax_floor_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _writer()


def test_the_fixture_was_written_by_the_oldest_supported_jax():
    meta = json.loads((FIXTURE / "tree" / "meta" / "metadata").read_text())
    assert EXPECTED["jax"] == meta["written_on"]["jax"] == "0.9.2"


def test_a_tree_written_under_the_oldest_jax_reads_bit_for_bit():
    for tree in (ft.train.load(FIXTURE / "tree"), ft.train.load(FIXTURE / "tree", make.tree())):
        assert make.leaves(tree) == EXPECTED["tree"]
        assert isinstance(tree["model"], ft.nn.Sequential) and tree["model"].layers[0].activation is jax.nn.tanh
        assert tree["half"].dtype == jnp.bfloat16 and jnp.issubdtype(tree["key"].dtype, jax.dtypes.prng_key)
        assert isinstance(tree["counts"], np.ndarray) and tree["counts"].dtype == np.int32
        assert (tree["rounds"], tree["rate"]) == (3, 0.25) and type(tree["rounds"]) is int


def test_a_job_written_under_the_oldest_jax_continues_here(tmp_path):
    shutil.copytree(FIXTURE / "job", tmp_path / "job")  # a manager may write to its directory
    state = ft.train.JobState.restore(tmp_path / "job")
    assert (state.steps_run, state.epoch, state.batch_in_epoch) == (3, 0, 3)
    assert make.leaves(state.model) == EXPECTED["job_at_3"]
    trainer = make.trainer().restore(tmp_path / "job")
    assert make.leaves(trainer.model) == EXPECTED["job_at_3"] and trainer.steps_run == 3
    trainer.fit(make.data(), steps=10, progress=False, log_every=1)
    assert (trainer.steps_run, trainer.epoch, trainer.batch_in_epoch) == (10, 2, 0)
    for got, want in zip(make.leaves(trainer.model), EXPECTED["job_at_10"], strict=True):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.max(np.abs(want)))))
    loss = EXPECTED["loss_at_10"]
    np.testing.assert_allclose(trainer.history.steps["loss"][-1], loss, rtol=0, atol=1e-5 * max(1.0, abs(loss)))
    assert trainer.history.steps["step"] == list(range(1, 11))


def _context_loss(state):
    return ft.optim.context(state.opt_state if hasattr(state, "opt_state") else state).loss


def test_a_float32_loss_of_an_older_job_restores_under_x64_and_back(tmp_path):
    # The fixture's learning context holds a float32 loss (x64 off; also what any job wrote
    # before 83bcd87). Under jax_enable_x64 the template's loss is float64: Trainer.restore
    # refused the job (context.loss: expected float64, given float32), and a job saved under
    # x64 refused to restore without it. The loss is a running value: it is cast both ways;
    # the job then continues to step 10 as the floor JAX continued it.
    shutil.copytree(FIXTURE / "job", tmp_path / "job")
    saved = ft.train.CheckpointManager(tmp_path / "job").restore(3).opt_state  # as written: no template
    assert _context_loss(saved).dtype == jnp.float32
    with jax.enable_x64(True):
        trainer = make.trainer().restore(tmp_path / "job")
        loss = _context_loss(trainer)
        assert loss.dtype == jnp.float64 and float(loss) == float(_context_loss(saved))  # exact: float32 ⊂ float64
        assert make.leaves(trainer.model) == EXPECTED["job_at_3"]
        trainer.save(tmp_path / "x64")  # a float64 loss on file
    assert ft.train.CheckpointManager(tmp_path / "x64").restore().opt_state.context.loss.dtype == jnp.float64
    trainer = make.trainer().restore(tmp_path / "x64")
    assert _context_loss(trainer).dtype == jnp.float32 and float(_context_loss(trainer)) == float(_context_loss(saved))
    trainer.fit(make.data(), steps=10, progress=False, log_every=1)
    for got, want in zip(make.leaves(trainer.model), EXPECTED["job_at_10"], strict=True):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.max(np.abs(want)))))


def test_a_parameter_of_another_float_dtype_is_still_refused(tmp_path):
    # Only the loss, a running value, is cast: float64 parameters are no template for the
    # float32 ones on file.
    shutil.copytree(FIXTURE / "job", tmp_path / "job")
    with jax.enable_x64(True):
        wide = make.trainer()
        wide = ft.train.Trainer(jax.tree.map(lambda w: w.astype(jnp.float64), wide.model),
                                ft.optim.Optimizer(ft.optim.adam(0.05)), make.loss_fn)
        with pytest.raises(ft.train.CheckpointError) as e:
            wide.restore(tmp_path / "job")
    assert "expected shape (3, 4) dtype float64, given shape (3, 4) dtype float32" in str(e.value)
    assert "context.loss" not in str(e.value)


def test_an_older_jobs_four_counters_read_as_todays_five_with_and_without_a_template(tmp_path):
    # The fixture's learning context holds four int32 counters (before samples_seen took two
    # words, high · 2^31 + low): both readers widen it, the high word 0, and the job's counts
    # read as written (the trainer's own template holds five: a plain read refused it).
    shutil.copytree(FIXTURE / "job", tmp_path / "job")
    on_file = ft.train.CheckpointManager(tmp_path / "job").restore(3).opt_state
    trainer = make.trainer().restore(tmp_path / "job")
    for state in (on_file, trainer.opt_state):
        ctx = ft.optim.context(state)
        assert ctx.counters.shape == (5,) and int(ctx.counters[4]) == 0
        assert (int(ctx.step), int(ctx.samples_seen)) == (3, 3 * int(ctx.minibatch_size)) and int(ctx.minibatch_size) > 0
    trainer.fit(make.data(), steps=4, progress=False, log_every=1)
    assert int(ft.optim.context(trainer.opt_state).step) == 4


def _as_if_written_by_a_newer_functree(meta_file: Path) -> None:
    from functree.train.checkpoint._checkpoint import metadata_digest
    meta = json.loads(meta_file.read_text())
    meta["format"], meta["written_on"]["functree"] = "functree-checkpoint-3", "9.0.0"
    meta["digest"] = metadata_digest(meta)
    meta_file.write_text(json.dumps(meta))


def test_a_checkpoint_of_a_newer_format_is_named_so_not_damaged(tmp_path):
    # A format from the future was "damaged metadata: no functree-checkpoint-2 metadata",
    # "Pass the directory written by ft.train.save" (a manager's step: "restore another step").
    ft.train.save(tmp_path / "tree", {"w": jnp.ones(2)})
    with ft.train.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"w": jnp.ones(2)})
        manager.save(2, {"w": jnp.ones(2)})
    for meta_file in (tmp_path / "tree" / "meta" / "metadata", tmp_path / "run" / "2" / "meta" / "metadata"):
        _as_if_written_by_a_newer_functree(meta_file)
    assert json.loads((tmp_path / "run" / "1" / "meta" / "metadata").read_text())["written_on"]["functree"] == ft.__version__
    for call, shown in ((lambda: ft.train.load(tmp_path / "tree"), f'ft.train.load("{tmp_path / "tree"}")'),
                        (lambda: ft.train.CheckpointManager(tmp_path / "run").restore(), "manager.restore(2)")):
        with pytest.raises(ft.train.CheckpointError) as info:
            call()
        message = str(info.value)
        assert "was written by a newer functree (9.0.0): its format is 'functree-checkpoint-3'" in message
        assert f"this functree ({ft.__version__}) reads 'functree-checkpoint-2'" in message
        assert "not damaged" in message and f"wrong:  {shown}" in message and "pip install -U" in message
        assert "damaged metadata" not in message and "another step" not in message


def _a_dtype_this_jax_cannot_hold():
    import ml_dtypes
    for name in ("float6_e2m3fn", "float6_e3m2fn", "float8_e5m3fnu"):
        dtype = np.dtype(getattr(ml_dtypes, name, np.float32))
        try:
            jax.device_put(np.zeros(0, dtype))
        except Exception:
            return dtype
    pytest.skip("this JAX holds every ml_dtypes type")


def test_an_array_of_a_dtype_this_jax_cannot_hold_comes_back_as_numpy(tmp_path):
    # jax 0.12 makes float6_e2m3fn arrays; 0.9.2 and 0.10.2 do not (a TypeError, XLA's
    # "Unknown NumPy dtype"), and none makes float8_e5m3fnu (ml_dtypes 0.7). A zero-size
    # leaf of one (stored by its shape) read back, under the JAX that wrote it or an older
    # one, failed inside JAX's device_put; it comes back on the host, as a 64-bit array
    # does without x64.
    dtype = _a_dtype_this_jax_cannot_hold()
    tree = {"x": np.zeros((0, 2), dtype), "w": jnp.arange(2.0)}
    ft.train.save(tmp_path / "tree", tree)
    with ft.train.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, tree)
    for back in (ft.train.load(tmp_path / "tree"), ft.train.load(tmp_path / "tree", tree),
                 ft.train.CheckpointManager(tmp_path / "run").restore().model):
        assert type(back["x"]) is np.ndarray and (back["x"].dtype, back["x"].shape) == (dtype, (0, 2))
        assert isinstance(back["w"], jax.Array) and back["w"].tolist() == [0.0, 1.0]


def _as_if_of_a_dtype_unknown_here(meta_file: Path, key: str) -> None:
    from functree.train.checkpoint._checkpoint import metadata_digest
    meta = json.loads(meta_file.read_text())
    meta["empty"][key][1], meta["written_on"]["jax"] = "float5_e9m9", "9.0.0"  # (no ml_dtypes has it)
    meta["digest"] = metadata_digest(meta)
    meta_file.write_text(json.dumps(meta))


def test_a_zero_size_array_of_a_dtype_unknown_here_is_named_so_not_damaged(tmp_path):
    # A zero-size array's dtype (stored by its name in the metadata) that this ml_dtypes and
    # JAX do not know, written by newer ones, was "damaged metadata" ("restore another step"):
    # the message names the dtype, the installed versions, the writer's JAX and the upgrade.
    import ml_dtypes
    tree = {"x": np.zeros((0, 2), np.float32), "w": jnp.ones(2)}
    ft.train.save(tmp_path / "tree", tree)
    with ft.train.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"w": jnp.ones(2)}, extra=tree)
        manager.save(2, {"w": jnp.ones(2)}, extra=tree)
    _as_if_of_a_dtype_unknown_here(tmp_path / "tree" / "meta" / "metadata", "x")
    _as_if_of_a_dtype_unknown_here(tmp_path / "run" / "2" / "meta" / "metadata", "extra.x")
    for call, key, shown in ((lambda: ft.train.load(tmp_path / "tree"), "x", f'ft.train.load("{tmp_path / "tree"}")'),
                             (lambda: ft.train.CheckpointManager(tmp_path / "run").restore(), "extra.x",
                              "manager.restore(2)")):
        with pytest.raises(ft.train.CheckpointError) as info:
            call()
        message = str(info.value)
        assert (f"holds the zero-size array {key!r} of dtype 'float5_e9m9', a type this installation does not know "
                f"(ml_dtypes {ml_dtypes.__version__}, jax {jax.__version__}; the checkpoint was written under jax "
                "9.0.0)") in message
        assert "not damaged" in message and f"wrong:  {shown}" in message
        assert "right:  pip install -U ml_dtypes jax jaxlib" in message
        assert "damaged metadata" not in message and "another step" not in message
