"""A multi-process job checkpoints as one writer: 2 processes x 2 simulated CPU devices.

Every process calls save (the Trainer and ModelCheckpoint do), the primary process holds
the directory's lock, each process writes and checksums its shards. The checkpoint then
restores in one process (equal to a one-process run) and resumes on two processes to the
uninterrupted result. A second job on the same directory is refused on every process.
"""

import json
import os
import socket
import time

import jax
import numpy as np
import pytest
from _devices import free_port, results, start
from _digits import digits, loss_fn, mlp

import functree as ft
from functree.train.checkpoint._checkpoint import metadata_digest
from functree.train.checkpoint._directory import LOCK_NAME

WORKER = """
import sys, os
import numpy as np
process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=120)
import jax.numpy as jnp
import functree as ft
from jax.experimental import multihost_utils
sys.path.insert(0, "tests")
from _digits import loss_fn, mlp

with np.load(out + "/digits.npz") as arrays:  # written by the test process: no scikit-learn import here
    x, y = arrays["x"], arrays["y"]
model = mlp()

mesh = jax.make_mesh((4,), ("data",))


def job(model):
    trainer = ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.adam(1e-2)), loss_fn, mesh=mesh, sharding="fsdp")
    data = ft.train.batches((x, y), 64, key=jax.random.key(3), shard=(jax.process_index(), jax.process_count()))
    return trainer, data


def gathered(tree):
    return [multihost_utils.process_allgather(w, tiled=True).tolist() for w in jax.tree.leaves(tree)]


trainer, data = job(model)
directory = out + "/ckpt"
refused = ""
try:  # the test process holds the directory's lock: another job
    trainer.save(directory)
except ft.train.CheckpointError as e:
    refused = str(e)
multihost_utils.sync_global_devices("refused")
if jax.process_index() == 0:
    os.remove(directory + "/.functree-writer.lock")
multihost_utils.sync_global_devices("lock removed")
save = ft.train.ModelCheckpoint(directory, max_to_keep=2, best_metric="loss")
trainer.fit(data, epochs=2, progress=False, callbacks=[save])
files = sorted(os.listdir(directory))

# The job again from its step-8 checkpoint: a new Trainer of a new model on both processes,
# restored from the files alone (the first Trainer is never read again). A failure here is
# reported to the test of resuming, not to the fit's.
try:
    resumed, data = job(mlp())
    resumed.restore(directory, step=8)
    resumed.fit(data, epochs=2, progress=False)  # epochs= counts the whole job: the second epoch
    # written whole by one process (the test's, before this job), verified here across two
    single = ft.train.load(out + "/single", model, mesh=mesh, sharding="fsdp")  # each weight gathered once
    again = {"params": gathered(resumed.model), "steps": resumed.steps_run, "single": gathered(single)}
except Exception:
    import traceback
    again = {"error": traceback.format_exc()}
report({"params": gathered(trainer.model), "refused": refused, "steps": trainer.steps_run, "files": files,
        "resumed": again})
"""


def run_job(out):
    port = free_port()
    return results([start(WORKER, devices=2, args=(str(i), str(port), str(out))) for i in range(2)])


def one_process_trainer():
    x, y = digits(512)
    trainer = ft.train.Trainer(mlp(), ft.optim.Optimizer(ft.optim.adam(1e-2)), loss_fn)
    return trainer, ft.train.batches((x, y), 64, key=jax.random.key(3))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two processes train 2 epochs (8 steps each) with ModelCheckpoint, after a refused save;
    then, in the same two processes, a new Trainer resumes the job from its step-8 checkpoint
    and loads a model this process wrote whole (one start-up and compilation for both)."""
    out = tmp_path_factory.mktemp("job")
    # the workers read the digits from a file: importing scikit-learn costs each ~2 CPU-s
    x, y = digits(512)
    np.savez(out / "digits.npz", x=x, y=y)
    (out / "ckpt").mkdir()
    (out / "ckpt" / LOCK_NAME).write_text(json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": "other job"}))
    model = one_process_trainer()[0].model
    ft.train.save(out / "single", model)
    return out, run_job(out), model


@pytest.mark.slow
def test_two_processes_save_as_one_and_restore_in_one_process(job):
    out, outs, _ = job
    for o in outs:  # the other job's lock: refused on both processes, nothing written
        assert "Another writer" in o["refused"] and o["files"] == ["16", "8"]
    assert "pid" in outs[0]["refused"] and "primary process" in outs[1]["refused"]
    meta = json.loads((out / "ckpt" / "16" / "meta" / "metadata").read_text())
    shards = meta["checksums"]["model.layers.0.weight"]["shards"]  # 64x128 split 4 ways by FSDP
    assert sorted(shards) == ["0:64,0:32", "0:64,32:64", "0:64,64:96", "0:64,96:128"]

    trainer, data = one_process_trainer()
    trainer.restore(out / "ckpt")  # 4 devices of 2 processes -> this process's one device
    assert trainer.steps_run == outs[0]["steps"] == 16
    for a, b in zip(outs[0]["params"], jax.tree.leaves(trainer.model)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    alone, data = one_process_trainer()
    alone.fit(data, epochs=2, progress=False)
    for a, b in zip(jax.tree.leaves(alone.model), jax.tree.leaves(trainer.model)):
        # measured: max |difference| 1.2e-7 on values up to 0.35 (the 2 processes' shares
        # summed in another order); 1e-6 leaves an 8x margin
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_two_processes_resume_to_the_uninterrupted_result(job):
    _, outs, model = job
    resumed = [o["resumed"] for o in outs]
    for o in resumed:
        assert "error" not in o, o["error"]
    assert all(o["steps"] == 16 for o in resumed)
    for a, b in zip(resumed[1]["single"], jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    for a, b in zip(outs[0]["params"], resumed[0]["params"], strict=True):  # the same program: bit-identical
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_damaged_shard_checksum_is_named_with_its_shard(job):
    out, _, _ = job
    path = out / "ckpt" / "8" / "meta" / "metadata"
    original = path.read_text()
    meta = json.loads(original)
    meta["checksums"]["model.layers.0.weight"]["shards"]["0:64,32:64"] += 1
    meta["digest"] = metadata_digest(meta)
    path.write_text(json.dumps(meta))
    try:
        with pytest.raises(ft.train.CheckpointError,
                           match=r"'model.layers.0.weight' fails its CRC-32 check \(shard 0:64,32:64\)"):
            ft.train.CheckpointManager(out / "ckpt").restore(8)
    finally:
        path.write_text(original)
