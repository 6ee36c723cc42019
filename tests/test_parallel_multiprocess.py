"""Several processes: each its share of every batch (batches(shard=)), one global step.

The two-process test starts two Python processes on localhost (``jax.distributed`` with
gloo collectives on CPU), 2 simulated devices each: a 4-device mesh over 2 processes. One
pair of processes runs the parts of both two-process tests (one start-up and one
``jax.distributed`` rendezvous); each test asserts on its own part.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import free_port, results, start
from _digits import digits, loss_fn, mlp
from _tolerance import assert_close_trained

import functree as ft


def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(256, 16)).astype(np.float32), rng.integers(0, 4, 256).astype(np.int32)


def test_shares_concatenate_to_the_same_shuffled_batches():
    x, y = data()
    whole = list(ft.train.batches((x, y), 32, key=jax.random.key(3)))
    shares = [list(ft.train.batches((x, y), 32, key=jax.random.key(3), shard=(i, 4))) for i in range(4)]
    assert len(whole) == 8 and all(len(s) == 8 for s in shares)
    for b, parts in zip(whole, zip(*shares)):
        assert all(p[0].shape == (8, 16) for p in parts)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), b[0])
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), b[1])
    unshuffled = ft.train.batches(np.arange(12), 6, shuffle=False, shard=(1, 3))
    assert [b.tolist() for b in unshuffled] == [[2, 3], [8, 9]]


def test_bad_shard_and_indivisible_minibatch():
    with pytest.raises(ValueError, match=r"got shard=\(2, 2\)"):
        ft.train.batches(np.arange(8), 4, shard=(2, 2))
    data = ft.train.batches(np.arange(10), 4, shuffle=False, shard=(0, 2))
    with pytest.raises(ValueError, match="a minibatch of 2 examples does not split evenly into 4 shares "
                                         r"\(use a batch size that is a multiple of 4, and drop_last=True\)"):
        list(ft.train.batches(np.arange(10), 4, shuffle=False, shard=(0, 4)))
    assert [b.tolist() for b in data] == [[0, 1], [4, 5], [8]]  # the last minibatch has 2: one each
    assert [b.tolist() for b in ft.train.batches(np.arange(10), 4, shuffle=False, shard=(1, 2))] == [
        [2, 3], [6, 7], [9]]


HEADER = """
import sys, traceback
import numpy as np
process_id, port, out, parts = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=120)
reports = {}
def report_part(name, source):
    if name in parts:
        scope = dict(globals(), report=lambda obj: reports.__setitem__(name, {"result": obj}))
        try:
            exec(source, scope)
        except BaseException:
            reports[name] = {"error": traceback.format_exc()}
"""

WORKER = """
import jax.numpy as jnp
import functree as ft
from jax.experimental import multihost_utils
from functree.parallel import DataParallelStep

rng = np.random.default_rng(1)
x, y = rng.normal(size=(256, 16)).astype(np.float32), rng.integers(0, 4, 256).astype(np.int32)
mesh = jax.make_mesh((4,), ("data",))
k = jax.random.split(jax.random.key(0), 2)
model = ft.nn.Sequential(ft.nn.Dense(16, 128, jax.nn.relu, key=k[0]), ft.nn.Dense(128, 4, key=k[1]))

def loss_fn(model, batch):
    x, y = batch
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(model(x)), y[:, None], axis=1))

opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
state = opt.init(model)
data = ft.train.batches((x, y), 32, key=jax.random.key(3), shard=(jax.process_index(), jax.process_count()))
for epoch in range(2):
    for batch in data:
        model, state, metrics = step(model, state, batch)
sharded = [not w.sharding.is_fully_replicated for w in jax.tree.leaves(model)]
params = [multihost_utils.process_allgather(w, tiled=True).tolist() for w in jax.tree.leaves(model)]
report({"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count(),
        "params": params, "sharded": sharded, "samples": int(ft.optim.context(state).samples_seen)})
"""


PARTS = {"step": "WORKER", "trainer": "TRAINER_WORKER"}  # defined below


def _trainer_takes_a_mesh():
    import inspect

    return "mesh" in inspect.signature(ft.train.Trainer).parameters


# The README's `--dist loadfile` runs a module's tests on one pytest-xdist worker, so this
# module fixture starts its subprocess once per run.
@pytest.fixture(scope="module")
def two_processes(request, tmp_path_factory):
    """Each process's reports of the parts of this run's selected tests, and its stderr."""
    here = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    parts = [name for name, test in [("step", "test_two_processes_train_like_one"),
                                     ("trainer", "test_two_processes_trainer_fit_like_one_process")]
             if test in here and (name != "trainer" or _trainer_takes_a_mesh())]

    def produce():
        out = tmp_path_factory.mktemp("two_processes")
        if "trainer" in parts:  # the workers read the digits from a file: scikit-learn costs each ~2 CPU-s
            x, y = digits(1024)
            np.savez(out / "digits.npz", x=x, y=y)
        code = HEADER + "".join(f"report_part({n!r}, {globals()[PARTS[n]]!r})\n" for n in parts) + "report(reports)\n"
        port = free_port()
        procs = [start(code, devices=2, args=(str(i), str(port), str(out), ",".join(parts))) for i in range(2)]
        reports = results(procs)
        return {"reports": reports, "stderr": [p.stderr_text for p in procs], "out": str(out)}

    return produce()


def _part(two_processes, name):
    """Both processes' reports of part ``name`` (raises with a process's traceback)."""
    outs = []
    for got in two_processes["reports"]:
        if "error" in got[name]:
            raise AssertionError(f"part {name!r} failed in a process:\n{got[name]['error']}")
        outs.append(got[name]["result"])
    return outs


@pytest.mark.slow
def test_two_processes_train_like_one(two_processes):
    outs = _part(two_processes, "step")
    assert [o["process"] for o in outs] == [0, 1]
    assert all(o["devices"] == 4 and o["local"] == 2 for o in outs)
    assert outs[0]["sharded"] == [True, False, False, False]  # the 16x128 weight is split over 4
    assert all(o["samples"] == 2 * 256 for o in outs)  # the global batches were counted
    for a, b in zip(outs[0]["params"], outs[1]["params"]):
        np.testing.assert_array_equal(a, b)  # identical in both processes

    # one process, one device, the whole batches
    x, y = data()
    k = jax.random.split(jax.random.key(0), 2)
    model = ft.nn.Sequential(ft.nn.Dense(16, 128, jax.nn.relu, key=k[0]), ft.nn.Dense(128, 4, key=k[1]))

    def loss_fn(model, batch):
        x, y = batch
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(model(x)), y[:, None], axis=1))

    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    step, state = ft.train.train_step(loss_fn, opt), opt.init(model)
    data_ = ft.train.batches((x, y), 32, key=jax.random.key(3))
    for _ in range(2):
        for batch in data_:
            model, state, _ = step(model, state, batch)
    assert_close_trained([np.float32(a) for a in outs[0]["params"]], jax.tree.leaves(model),
                         spread=5e-7)  # 2 processes vs 1: measured max 3.4e-7


TRAINER_WORKER = """
import jax.numpy as jnp
import functree as ft
from jax.experimental import multihost_utils
sys.path.insert(0, "tests")
from _digits import loss_fn, mlp

with np.load(out + "/digits.npz") as arrays:  # written by the test process: no scikit-learn import here
    x, y = arrays["x"], arrays["y"]
model = mlp()

mesh = jax.make_mesh((4,), ("data",))
trainer = ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.sgd(0.1, momentum=0.9)), loss_fn, mesh=mesh,
                           sharding="fsdp")
data = ft.train.batches((x, y), 64, key=jax.random.key(3), shard=(jax.process_index(), jax.process_count()))
trainer.fit(data, epochs=2, callbacks=[ft.train.HistoryLogger(out + "/history.jsonl")])
params = [multihost_utils.process_allgather(w, tiled=True).tolist() for w in jax.tree.leaves(trainer.model)]
report({"params": params})
"""


@pytest.mark.slow
def test_two_processes_trainer_fit_like_one_process(two_processes):
    from pathlib import Path

    if not _trainer_takes_a_mesh():
        pytest.skip("Trainer(mesh=...) is wired into ft.train at merge (see functree.parallel)")
    outs = _part(two_processes, "trainer")
    bars = [stderr.count("epoch 2") > 0 for stderr in two_processes["stderr"]]
    assert bars == [True, False]  # one progress bar: process 0's
    history = Path(two_processes["out"]) / "history.jsonl"
    assert len(history.read_text().splitlines()) == 2  # one history file, 2 epochs
    for a, b in zip(outs[0]["params"], outs[1]["params"]):
        np.testing.assert_array_equal(a, b)

    x, y = digits(1024)
    trainer = ft.train.Trainer(mlp(), ft.optim.Optimizer(ft.optim.sgd(0.1, momentum=0.9)), loss_fn)
    trainer.fit(ft.train.batches((x, y), 64, key=jax.random.key(3)), epochs=2, progress=False)
    assert_close_trained([np.float32(a) for a in outs[0]["params"]], jax.tree.leaves(trainer.model),
                         spread=5e-7)  # measured max 3.4e-7
