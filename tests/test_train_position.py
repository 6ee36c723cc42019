"""The data pipeline travels with the job (issue 44 item 6): ``functree/train/checkpoint/_position.py``.

grain's ``DataLoader`` iterator returns its position from ``get_state()`` as bytes (JSON
text); a job over it saved mid-epoch failed at the first save ("is not JSON"). Positions
are now JSON values or bytes, written as tagged base64 (data: never unpickled), and a job
over a grain ``DataLoader`` resumes to the same minibatches, bit for bit.
"""

from __future__ import annotations

import importlib
import json
import re
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train.checkpoint._position import decode, encode, storable


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


grain: Any = _optional("grain.python")  # the DataLoader API
grain_datasets: Any = _optional("grain")  # the dataset API (MapDataset, IterDataset)
# (the checks of a tampered position need no grain: only the tests over grain's data skip)
needs_grain = pytest.mark.skipif(grain is None or grain_datasets is None, reason="grain is not installed")

X = np.random.default_rng(0).normal(size=(24, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


class Source:
    """24 records of (x, y), random access (grain's data source protocol)."""

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int):
        return X[i], Y[i]

    def __repr__(self) -> str:  # grain checks a restored position's source by its repr
        return "Source(24)"


def loader(num_epochs: int | None) -> Any:
    sampler = grain.IndexSampler(len(X), shard_options=grain.NoSharding(), shuffle=True, num_epochs=num_epochs,
                                 seed=5)
    return grain.DataLoader(data_source=Source(), sampler=sampler, operations=[grain.Batch(4)], worker_count=0)


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def trainer() -> ft.train.Trainer:
    return ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.adam(0.05), loss_fn)


def fit(t, data, directory, **counts):
    t.fit(data, progress=False, log_every=2, **counts,
          callbacks=[ft.train.ModelCheckpoint(directory, every_steps=4, max_to_keep=None)])
    return t


def assert_same(a, b):
    assert (a.steps_run, a.epoch, a.batch_in_epoch) == (b.steps_run, b.epoch, b.batch_in_epoch)
    for x, y in zip(jax.tree.leaves((a.model, a.opt_state)), jax.tree.leaves((b.model, b.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert json.dumps(a.history.steps) == json.dumps(b.history.steps)  # the same minibatches, step by step


@needs_grain
def test_a_job_over_a_grain_dataloader_iterator_saves_mid_epoch_and_resumes_bit_for_bit(tmp_path):
    """``fit(iter(loader), steps=18)`` over 3 epochs of 6 minibatches, checkpoints every 4
    steps; restored at step 8 (the middle of the second epoch) with a fresh iterator, set
    to the saved position: the same job."""
    straight = fit(trainer(), iter(loader(3)), tmp_path / "straight", steps=18)
    meta = json.loads((tmp_path / "straight" / "8" / "meta" / "metadata").read_text())
    saved = meta["config"]["trainer"]["data_state"]
    assert saved["__functree__"] == "bytes"  # grain's bytes, as tagged base64
    assert isinstance(json.loads(decode(saved)), dict)  # grain's JSON text, given back as bytes
    resumed = trainer().restore(tmp_path / "straight", step=8)
    assert isinstance(resumed.state.data_state, bytes)
    fit(resumed, iter(loader(3)), tmp_path / "resumed", steps=18)
    assert_same(straight, resumed)


@needs_grain
def test_a_job_over_a_reiterable_grain_dataloader_resumes_mid_epoch(tmp_path):
    """``fit(loader, epochs=3)``: ``iter(loader)`` once per epoch (one epoch each); restored
    at step 8 (epoch 1, minibatch 2), the epoch's new iterator is set to the position."""
    straight = fit(trainer(), loader(1), tmp_path / "straight", epochs=3)
    resumed = trainer().restore(tmp_path / "straight", step=8)
    assert (resumed.epoch, resumed.batch_in_epoch) == (1, 2)
    fit(resumed, loader(1), tmp_path / "resumed", epochs=3)
    assert_same(straight, resumed)


@needs_grain
def test_a_job_over_a_grain_dataset_resumes_mid_epoch(tmp_path):
    """grain's dataset API: ``iter(dataset)`` per epoch, a dict position (``next_index``)."""
    dataset = grain_datasets.MapDataset.source(Source()).shuffle(seed=3).batch(4).to_iter_dataset()
    straight = fit(trainer(), dataset, tmp_path / "straight", epochs=3)
    resumed = trainer().restore(tmp_path / "straight", step=8)
    assert (resumed.epoch, resumed.batch_in_epoch, resumed.state.data_state) == (1, 2, {"next_index": 2})
    fit(resumed, dataset, tmp_path / "resumed", epochs=3)
    assert_same(straight, resumed)


def test_positions_round_trip_as_json():
    given = {"loader": b"\x00\xff{}", "parts": [b"", 3, "a", None, {"x": [1.5, True]}],
             "__functree__": "the iterator's own key"}
    saved = encode(given)
    assert json.loads(json.dumps(saved)) == saved
    assert decode(saved) == given
    assert decode(encode((1, b"a"))) == [1, b"a"]  # a tuple comes back as JSON's list
    assert storable(b"x") and storable({"a": [b"x"]}) and not storable(object()) and not storable({"a": {1, 2}})


@pytest.mark.parametrize("saved, why", [
    ({"__functree__": "bytes", "base64": "not base64!"}, r"data_state\['p'\]: its bytes are not base64"),
    ({"__functree__": "bytes", "base64": 3}, r"data_state\['p'\]: an unknown or malformed tag"),
    ({"__functree__": "pickle", "data": "gASVAAAA"}, r"data_state\['p'\]: an unknown or malformed tag"),
    ({"__functree__": "dict", "items": [[1, 2]]}, r"data_state\['p'\]: an unknown or malformed tag"),
])
def test_a_corrupt_position_is_named(saved, why):
    with pytest.raises(ValueError, match=r"(?s)data position is corrupt at " + why + r".*restore\(path, step="):
        decode({"p": saved})


@needs_grain
def test_a_checkpoint_whose_position_was_tampered_with_is_refused(tmp_path):
    """The position's bytes changed in the metadata (its checksum made again to match): the
    restore names the checkpoint, its step and the position; nothing is decoded but base64."""
    fit(trainer(), iter(loader(1)), tmp_path / "job", steps=4)
    path = tmp_path / "job" / "4" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["config"]["trainer"]["data_state"] = {"__functree__": "pickle", "data": "gASVAAAA"}
    body = {k: v for k, v in meta.items() if k != "digest"}
    meta["digest"] = zlib.crc32(json.dumps(body, sort_keys=True, allow_nan=True).encode())
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"(?s)corrupt at .*job step 4: data_state: an unknown or malformed tag"):
        trainer().restore(tmp_path / "job")


def test_an_unstorable_position_is_named_at_the_save(tmp_path):
    class Odd:
        def __init__(self):
            self.items = iter([(X[:4], Y[:4])] * 4)  # the save at step 4 reads its position

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

        def get_state(self):
            return {"where": object()}

        def set_state(self, state):
            raise AssertionError("not called")

    t = trainer()
    with pytest.raises(ValueError, match=r"(?s)Odd\) reports its position.*not JSON .* or bytes"):
        fit(t, Odd(), tmp_path / "odd", steps=4)
    assert Path(tmp_path / "odd").exists()


def _tampered(tmp_path, steps, change):
    """A Trainer checkpoint after ``steps`` steps over 2 minibatches per epoch (saved by
    ``trainer.save``), its "trainer" config edited by ``change`` and its metadata digest
    recomputed, as an attacker (or a newer functree) would write it."""
    from functree.train.checkpoint._checkpoint import metadata_digest

    t = trainer()
    t.fit(ft.train.batches((X, Y), 12), steps=steps, progress=False)
    t.save(tmp_path / "ck")
    path = tmp_path / "ck" / str(steps) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    change(meta["config"]["trainer"])
    meta["digest"] = metadata_digest(meta)
    path.write_text(json.dumps(meta))
    return tmp_path / "ck"


@pytest.mark.parametrize("steps, stored, limits", [
    (1, {"batch_in_epoch": 5}, r"trainer\.epoch_length \(2\) and trainer\.steps_run \(1\)"),
    (3, {"batch_in_epoch": 3}, r"trainer\.epoch_length \(2\)"),  # epoch 1, its 1st minibatch: 3 <= steps
    (1, {"batch_in_epoch": 2, "epoch_length": None}, r"trainer\.steps_run \(1\)"),
], ids=["past-both", "past-epoch", "past-steps"])
def test_a_position_past_its_epoch_end_is_refused(tmp_path, steps, stored, limits):
    # The old reader restored batch_in_epoch 5 of an epoch of 2 at step 1: the next
    # fit(epochs=2) ended epoch 1 at once (after 1 of its 2 minibatches, its bar at -1 left).
    path = _tampered(tmp_path, steps, lambda config: config.update(stored))
    why = rf"(?s)ck step {steps}: trainer\.batch_in_epoch is {stored['batch_in_epoch']}, more than {limits}: past"
    with pytest.raises(ft.train.CheckpointError, match=why + r".*metadata was changed.*all_steps\(\)\[-2\]"):
        trainer().restore(path)
    with pytest.raises(ft.train.CheckpointError, match=why):
        ft.train.JobState.restore(path)


def test_a_position_at_its_epoch_end_restores_and_ends_the_epoch(tmp_path):
    """batch_in_epoch == epoch_length is a Trainer's own position (a checkpoint at an
    epoch's last step, written before its end): it restores, and the next fit ends that
    epoch without a step, as the uninterrupted job did."""
    t = trainer()
    t.fit(ft.train.batches((X, Y), 12), epochs=2, progress=False,
          callbacks=[ft.train.ModelCheckpoint(tmp_path / "ck", every_steps=2, max_to_keep=None)])
    resumed = trainer().restore(tmp_path / "ck", step=2)
    assert (resumed.steps_run, resumed.epoch, resumed.batch_in_epoch, resumed.state.epoch_length) == (2, 0, 2, 2)
    resumed.fit(ft.train.batches((X, Y), 12), epochs=2, progress=False)
    assert resumed.history.epochs["last_step"] == t.history.epochs["last_step"] == [2, 4]
    np.testing.assert_allclose(resumed.history.epochs["loss"], t.history.epochs["loss"], rtol=0, atol=0)


@pytest.mark.parametrize("change, paths", [
    (lambda c: c.update(fit_calls=3), r"trainer\.fit_calls is"),  # a newer functree's field
    (lambda c: c["means"].update(ema={"sums": {}, "weight": 0.0, "skipped": 0}), r"trainer\.means\.ema is"),
    (lambda c: c.update(a=1, b=None), r"trainer\.a, trainer\.b are"),
], ids=["top-level", "nested", "two"])
def test_a_trainer_config_with_a_key_this_version_does_not_know_is_refused(tmp_path, change, paths):
    # The old reader read the keys it knew and dropped the rest: a newer functree's field
    # (its job state) was lost without a word, the job restored as if it had none.
    path = _tampered(tmp_path, 1, change)
    why = (rf"(?s)ck step 1: {paths} not part of a Trainer checkpoint that functree "
           rf"{re.escape(ft.__version__)} reads: the checkpoint was written by a newer functree.*or its "
           r"metadata was changed.*pip install --upgrade functree")
    with pytest.raises(ft.train.CheckpointError, match=why):
        trainer().restore(path)
    with pytest.raises(ft.train.CheckpointError, match=why):
        ft.train.JobState.restore(path)


def test_every_key_a_trainer_writes_is_one_it_reads(tmp_path):
    """A checkpoint as written (its "trainer" config untouched, every position field set)
    has no key the check refuses, and restores to the same position."""
    from functree.train._job import unknown_keys

    path = _tampered(tmp_path, 3, lambda config: None)
    meta = json.loads((path / "3" / "meta" / "metadata").read_text())
    assert unknown_keys(meta["config"]["trainer"]) == []
    assert set(meta["config"]["trainer"]) >= {"steps_run", "means", "history", "on_nan", "pending"}
    assert trainer().restore(path).state.position == ft.train.JobState.restore(path).position
