"""A multi-process job checkpoints as one writer: 2 processes x 2 simulated CPU devices.

Every process calls save (the Trainer and ModelCheckpoint do), the primary process holds
the directory's lock, each process writes and checksums its shards. The checkpoint then
restores in one process (equal to a one-process run) and resumes on two processes to the
uninterrupted result. A second job on the same directory is refused on every process.

Three more claims of a 2-process job run in the same two worker processes (each process's
start-up, JAX import and ``jax.distributed`` connection cost ~4 CPU-s, paid once here): a
checkpoint saves what each process made and refuses text on every process (from
tests/test_checkpoint_portable.py), generate on a model sharded over both processes
returns tokens each process reads (from tests/test_generation.py), and ``save_hf`` of a
model sharded over both processes is written by process 0 (from tests/test_hf_save.py);
so do two jobs of tests/test_parallel_multiprocess.py: a DataParallelStep and a Trainer fit
over both processes train as one process does. Each runs in its own copy of the worker's
globals and is reported to its own test.
"""

import json
import os
import socket
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import free_port, results, start
from _digits import digits, loss_fn, mlp
from _tolerance import assert_close_trained

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


def claim(source):  # what source leaves in `got`, run in a copy of these globals (or its traceback)
    scope = dict(globals())
    try:
        exec(source, scope)
        return scope["got"]
    except Exception:
        import traceback
        return {"error": traceback.format_exc()}


report({"params": gathered(trainer.model), "refused": refused, "steps": trainer.steps_run, "files": files,
        "resumed": again, "portable": claim(PORTABLE), "generate": claim(GENERATE), "save_hf": claim(SAVE_HF),
        "step": claim(STEP), "trainer": claim(TRAINER)})
"""


# A job on a mesh over both processes saves what each made; a leaf no checkpoint can hold is
# refused on every process before anything is written (from tests/test_checkpoint_portable.py).
PORTABLE = """
import glob
out = out + "/portable"
os.makedirs(out, exist_ok=True)
model = ft.shard(ft.nn.Dense(8, 256, key=jax.random.key(1)), mesh, "fsdp")  # global arrays
mine = jnp.full(2, float(1 + jax.process_index()))  # each process's own: process 0's is saved
got = {}
ft.train.save(out + "/tree", {"model": model, "ema": jnp.zeros(2), "mine": mine, "rounds": 3})
with ft.train.CheckpointManager(out + "/mgr") as m:
    m.save(1, model, extra={"ema": jnp.zeros(2), "mine": mine})
tree = ft.train.load(out + "/tree")
ck = ft.train.CheckpointManager(out + "/mgr").restore()
got["restored"] = [np.asarray(tree["mine"]).tolist(), type(tree["mine"]).__name__, tree["rounds"],
                   np.asarray(ck.extra["mine"]).tolist(), type(ck.extra["ema"]).__name__]
try:
    ft.train.save(out + "/bad", {"model": model, "note": "warm start"})
    got["bad"] = "saved"
except ft.train.CheckpointError as e:
    got["bad"] = str(e).splitlines()[0]
got["left"] = sorted(os.path.basename(p) for p in glob.glob(out + "/bad*"))
# the training-jobs guide's example: a job on a mesh over both processes, extra made by each
trainer = ft.train.Trainer(ft.nn.Dense(8, 256, key=jax.random.key(1)), ft.optim.adam(1e-2),
                           lambda m, x: jnp.mean(m(x) ** 2), mesh=mesh, sharding="fsdp")
trainer.save(out + "/job", extra={"rounds": 3, "ema": jnp.zeros(2)})
saved = ft.train.JobState.restore(out + "/job", like=trainer.state)
got["job"] = [saved.extra["rounds"], np.asarray(saved.extra["ema"]).tolist(), saved.steps_run]
"""

# The model of the 2-process generate, built alike in the workers and in the test's process.
GENERATE_MODEL = """
import functree as ft

def moved(model):  # every parameter off from_hf's small initial values: clear top-1 margins
    leaves, tree = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [w + 0.2 * jax.random.normal(k, w.shape, w.dtype) for w, k in zip(leaves, keys)])

CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0}
make = lambda: moved(ft.nn.from_hf(CONFIG, key=jax.random.key(0)))
PROMPT = np.array([[1, 5, 9, 3], [2, 7, 7, 4]], np.int32)  # 4 + 4 tokens: a larger bucket, cropped
"""

# generate on a model sharded over both processes' 4 devices (from tests/test_generation.py):
# the model the test's process built and saved, each process's copy sharded over the mesh
# (building it here compiled its initialisation in each process: ~3 CPU-s each)
GENERATE = GENERATE_MODEL + """
sharded = ft.shard(ft.train.load(out + "/generate_model"), mesh, "fsdp")
tokens, scores = ft.nn.generate(sharded, PROMPT, 4, return_scores=True)
got = {"local": sorted(d.id for d in jax.local_devices()), "mesh": sorted(d.id for d in mesh.devices.flat),
       "tokens_on": sorted(d.id for d in tokens.devices()), "scores_on": sorted(d.id for d in scores.devices()),
       "tokens": np.asarray(tokens).tolist(), "scores": np.asarray(scores).tolist()}
"""

# save_hf of a Llama port sharded (FSDP) over both processes' 4 devices (from
# tests/test_hf_save.py): process 0 writes the files, every process returns after them
TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False}
SAVE_HF = f"TINY_LLAMA = {TINY_LLAMA!r}\n" + """
out = out + "/save_hf"
model = ft.shard(lambda: ft.nn.from_hf(TINY_LLAMA, key=jax.random.key(0)), mesh, "fsdp")
spread = sum(not w.is_fully_addressable for w in jax.tree.leaves(model))
ft.nn.save_hf(model, out + "/hf")
try:
    ft.nn.save_hf(model, out + "/hf")  # process 0 finds the directory taken: every process raises
    again = None
except Exception as e:
    again = f"{type(e).__name__}: {e}"
got = {"spread": spread, "again": again, "written": sorted(os.listdir(out + "/hf"))}
"""

# A DataParallelStep with FSDP over both processes' 4 devices, each process its share of
# every batch (batches(shard=)): one global step (from tests/test_parallel_multiprocess.py)
# Its data, model, loss and optimizer: run here too, for the one-process reference.
STEP_SETUP = """
rng = np.random.default_rng(1)
x, y = rng.normal(size=(256, 16)).astype(np.float32), rng.integers(0, 4, 256).astype(np.int32)
k = jax.random.split(jax.random.key(0), 2)
model = ft.nn.Sequential(ft.nn.Dense(16, 128, jax.nn.relu, key=k[0]), ft.nn.Dense(128, 4, key=k[1]))

def loss_fn(model, batch):
    x, y = batch
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(model(x)), y[:, None], axis=1))

opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
"""

STEP = STEP_SETUP + """
step = ft.parallel.DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
state = opt.init(model)
data = ft.train.batches((x, y), 32, key=jax.random.key(3), shard=(jax.process_index(), jax.process_count()))
for epoch in range(2):
    for batch in data:
        model, state, metrics = step(model, state, batch)
got = {"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count(),
       "params": gathered(model), "sharded": [not w.sharding.is_fully_replicated for w in jax.tree.leaves(model)],
       "samples": int(ft.optim.context(state).samples_seen)}
"""

# Trainer(mesh=...).fit over both processes, its progress bar and history file process 0's
# (from tests/test_parallel_multiprocess.py): the worker's 512 digits (x, y: 8 steps an epoch;
# 1024 took twice the steps for the same claim)
TRAINER = """
trainer = ft.train.Trainer(mlp(), ft.optim.Optimizer(ft.optim.sgd(0.1, momentum=0.9)), loss_fn, mesh=mesh,
                           sharding="fsdp")
data = ft.train.batches((x, y), 64, key=jax.random.key(3), shard=(jax.process_index(), jax.process_count()))
trainer.fit(data, epochs=2, callbacks=[ft.train.HistoryLogger(out + "/history.jsonl")])
got = {"params": gathered(trainer.model)}
"""


def run_job(out):
    port = free_port()
    claims = {"PORTABLE": PORTABLE, "GENERATE": GENERATE, "SAVE_HF": SAVE_HF, "STEP": STEP, "TRAINER": TRAINER}
    source = "".join(f"{name} = {text!r}\n" for name, text in claims.items()) + WORKER
    procs = [start(source, devices=2, args=(str(i), str(port), str(out))) for i in range(2)]
    outs = results(procs)
    for o, p in zip(outs, procs):  # what each worker printed (the Trainer's progress bars)
        o["stderr"] = p.stderr_text
    return outs


def claimed(outs, name):
    """Each worker's report of claim ``name`` (raises with a worker's traceback)."""
    for o in outs:
        assert "error" not in o[name], o[name]["error"]
    return [o[name] for o in outs]


def one_process_trainer():
    x, y = digits(512)
    trainer = ft.train.Trainer(mlp(), ft.optim.Optimizer(ft.optim.adam(1e-2)), loss_fn)
    return trainer, ft.train.batches((x, y), 64, key=jax.random.key(3))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two processes train 2 epochs (8 steps each) with ModelCheckpoint, after a refused save;
    then, in the same two processes, a new Trainer resumes the job from its step-8 checkpoint
    and loads a model this process wrote whole (one start-up and compilation for both). The
    model of the 2-process generate is built here once and read by the workers."""
    out = tmp_path_factory.mktemp("job")
    # the workers read the digits from a file: importing scikit-learn costs each ~2 CPU-s
    x, y = digits(512)
    np.savez(out / "digits.npz", x=x, y=y)
    (out / "ckpt").mkdir()
    (out / "ckpt" / LOCK_NAME).write_text(json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": "other job"}))
    model = one_process_trainer()[0].model
    ft.train.save(out / "single", model)
    scope: dict[str, Any] = {"jax": jax, "np": np}
    exec(GENERATE_MODEL, scope)
    generating = jax.jit(scope["make"])()  # one program, not the eager initialisation's many
    ft.train.save(out / "generate_model", generating)
    return out, run_job(out), model, (generating, scope["PROMPT"])


@pytest.mark.slow
def test_two_processes_save_as_one_and_restore_in_one_process(job):
    out, outs, _, _ = job
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
    _, outs, model, _ = job
    resumed = [o["resumed"] for o in outs]
    for o in resumed:
        assert "error" not in o, o["error"]
    assert all(o["steps"] == 16 for o in resumed)
    for a, b in zip(resumed[1]["single"], jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    for a, b in zip(outs[0]["params"], resumed[0]["params"], strict=True):  # the same program: bit-identical
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_damaged_shard_checksum_is_named_with_its_shard(job):
    out, _, _, _ = job
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


@pytest.mark.slow
def test_two_processes_save_what_each_made_and_refuse_text_on_every_process(job):
    out, outs, _, _ = job
    for got in claimed(outs, "portable"):
        assert got["restored"] == [[1.0, 1.0], "ArrayImpl", 3, [1.0, 1.0], "ArrayImpl"], got
        assert got["bad"].startswith("The leaf 'note' is str 'warm start'"), got["bad"]
        assert got["left"] == [] and got["job"] == [3, [0.0, 0.0], 0]
    tree = ft.train.load(out / "portable" / "tree")  # and in one process
    np.testing.assert_array_equal(tree["mine"], [1.0, 1.0])
    assert tree["model"].weight.shape == (8, 256)


@pytest.mark.slow
def test_a_model_sharded_over_two_processes_returns_tokens_each_process_reads(job):
    # D9: the cropped tokens were committed to one device of the mesh, taken from a set: in
    # a 2-process job often another process's (np.asarray raised JAX's non-addressable
    # error); they now keep the loop's placement (replicated over the mesh), as uncropped ones
    model, prompt = job[3]  # the model the workers sharded, on this process's one device
    tokens, scores = ft.nn.generate(model, prompt, 4, return_scores=True)
    top2 = np.sort(np.asarray(scores), axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3  # clear top-1 margins: equal tokens are not luck
    for out in claimed(job[1], "generate"):
        assert out["tokens_on"] == out["scores_on"] == out["mesh"] and set(out["local"]) < set(out["mesh"])
        np.testing.assert_array_equal(out["tokens"], tokens)
        np.testing.assert_allclose(out["scores"], scores, rtol=0, atol=1e-5)  # magnitude 2.4: measured 9.5e-7


@pytest.mark.slow
def test_a_model_sharded_over_two_processes_is_saved_by_process_0(job, tmp_path):
    # D8: in a 2-process FSDP job save_hf raised JAX's "spans non-addressable devices"
    # (the state dict read every leaf with np.asarray); now the tensors are gathered and
    # process 0 writes the files every process returns after
    outs = claimed(job[1], "save_hf")
    assert all(o["spread"] > 0 for o in outs)  # some leaves split over both processes' devices
    assert all(o["written"] == ["config.json", "model.safetensors"] for o in outs)
    assert outs[0]["again"].startswith("ValueError: ft.nn.save_hf:") and "already holds" in outs[0]["again"]
    assert outs[1]["again"].startswith("RuntimeError: ft.nn.save_hf: process 0, which writes the files of this "
                                       "multi-process job, failed: ValueError: ft.nn.save_hf:")
    ft.nn.save_hf(ft.nn.from_hf(TINY_LLAMA, key=jax.random.key(0)), tmp_path / "one")  # one process, one device
    for name in ("config.json", "model.safetensors"):
        assert (job[0] / "save_hf" / "hf" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


@pytest.mark.slow
def test_two_processes_train_like_one(job):
    outs = claimed(job[1], "step")
    assert [o["process"] for o in outs] == [0, 1]
    assert all(o["devices"] == 4 and o["local"] == 2 for o in outs)
    assert outs[0]["sharded"] == [True, False, False, False]  # the 16x128 weight is split over 4
    assert all(o["samples"] == 2 * 256 for o in outs)  # the global batches were counted
    for a, b in zip(outs[0]["params"], outs[1]["params"]):
        np.testing.assert_array_equal(a, b)  # identical in both processes

    # one process, one device, the whole batches: the claim's own setup
    setup = {"np": np, "jax": jax, "jnp": jnp, "ft": ft}
    exec(STEP_SETUP, setup)
    model, opt = setup["model"], setup["opt"]
    step, state = ft.train.train_step(setup["loss_fn"], opt), opt.init(model)
    data_ = ft.train.batches((setup["x"], setup["y"]), 32, key=jax.random.key(3))
    for _ in range(2):
        for batch in data_:
            model, state, _ = step(model, state, batch)
    assert_close_trained([np.float32(a) for a in outs[0]["params"]], jax.tree.leaves(model),
                         spread=5e-7)  # 2 processes vs 1: measured max 3.4e-7


@pytest.mark.slow
def test_two_processes_trainer_fit_like_one_process(job):
    outs = claimed(job[1], "trainer")
    bars = [o["stderr"].count("epoch 2") > 0 for o in job[1]]
    assert bars == [True, False]  # one progress bar: process 0's
    history = job[0] / "history.jsonl"
    assert len(history.read_text().splitlines()) == 2  # one history file, 2 epochs
    for a, b in zip(outs[0]["params"], outs[1]["params"]):
        np.testing.assert_array_equal(a, b)

    x, y = digits(512)
    trainer = ft.train.Trainer(mlp(), ft.optim.Optimizer(ft.optim.sgd(0.1, momentum=0.9)), loss_fn)
    trainer.fit(ft.train.batches((x, y), 64, key=jax.random.key(3)), epochs=2, progress=False)
    assert_close_trained([np.float32(a) for a in outs[0]["params"]], jax.tree.leaves(trainer.model),
                         spread=5e-7)  # measured max 3.4e-7
