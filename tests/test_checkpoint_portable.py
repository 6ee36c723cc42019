"""Checkpoints load anywhere: the reader places arrays, never the writer's device ids.

Simulated CPU devices stand in for machines (``tests/_devices.py``: a subprocess with
``--xla_force_host_platform_device_count=8`` appended to the inherited XLA_FLAGS). A
checkpoint written on device 5 of 8, or on a mesh of 8, is read in this 1-device process
by every reader; one written here is read in an 8-device process onto device 3 (as the
default device, as a template's device, as ``sharding=``) and onto a mesh of 8. A
checkpoint whose orbax metadata names devices this machine lacks (``cuda:5``: what a GPU
writes) reads here. The writes on 8 devices and the reads there run in one 8-device subprocess
(one start-up, ~4 CPU-s). A multi-process job saves what each process made and refuses a
leaf no checkpoint can hold on every process before writing anything: tests/test_train_processes.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _train_job as job
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import part, scenarios

import functree as ft

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "trainer_checkpoint_v2"

COMMON = """
import functree as ft, jax, jax.numpy as jnp, numpy as np, os, sys
sys.path.insert(0, "tests")
import _train_job as job
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
D = jax.devices()
# The job's model (its Trainers' too) built in one program: eagerly each initializer compiled
# apart, again on each default device the scenarios set (~20 programs a device). What a
# scenario builds here is compared only with what it wrote or read here.
job.model = jax.jit(job.model)

def on(tree):
    return sorted({str(d) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()})

def values(tree):
    return [np.asarray(x).tolist() for x in jax.tree.leaves(tree) if not jax.dtypes.issubdtype(
        getattr(x, "dtype", np.float32), jax.dtypes.prng_key)]

@jax.jit  # one program (see job.model)
def wide():  # big enough for the fsdp rules to shard over 8 devices
    return ft.nn.Dense(8, 256, key=jax.random.key(1))

def data():
    return ft.train.batches((job.X, job.Y), 10, key=jax.random.key(3))
"""


def _devices(tree):
    return sorted({str(d) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()})


def _values(tree):
    return [np.asarray(x).tolist() for x in jax.tree.leaves(tree)
            if not jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)]


# --- written on device 5 of 8 (and on a mesh of 8), read here on 1 device -----------------------

WRITE_ON_EIGHT = {
    "device5": """
opt = ft.optim.Optimizer(ft.optim.adam(0.1))
model = jax.device_put(job.model(), D[5])
state = jax.device_put(opt.init(job.model()), D[5])
ft.train.save(OUT + "/tree5", model)
with ft.train.CheckpointManager(OUT + "/mgr5") as m:
    m.save(1, model, state, extra={"e": jax.device_put(jnp.arange(2.0), D[5])})
with jax.default_device(D[5]):
    t = job.trainer()
    t.fit(data(), steps=3, progress=False, log_every=1)
t.save(OUT + "/job5")
report({"on": on((model, state, t.model, t.opt_state)), "model": values(model), "job": values(t.model)})
""",
    "mesh": """
mesh = jax.make_mesh((8,), ("data",))
model = ft.shard(wide(), mesh, "fsdp")
ft.train.save(OUT + "/mesh", model)
with ft.train.CheckpointManager(OUT + "/mgr_mesh") as m:
    m.save(1, model, extra={"e": jnp.arange(2.0)})
report({"spec": str(model.weight.sharding.spec), "model": values(model)})
""",
    "zero-size": """
mesh = jax.make_mesh((8,), ("data",))
tree = {"w": jnp.arange(8.0), "empty": jnp.zeros((0, 8)), "ids": np.zeros((8, 0), np.int32)}
ft.train.save(OUT + "/zero", tree)
on5 = ft.train.load(OUT + "/zero", jax.device_put(tree, D[5]))
split = {k: NamedSharding(mesh, P(None, "data") if k == "empty" else P()) for k in tree}
spread = ft.train.load(OUT + "/zero", jax.device_put(tree, split))
report({"on5": {k: on(x) for k, x in on5.items()}, "spread": str(getattr(spread["empty"].sharding, "spec", None)),
        "spread_on": len(on(spread["empty"]))})
""",
}


@pytest.fixture(scope="module")
def written_on_eight(on_eight):
    """The WRITE_ON_EIGHT reports, and the directory they wrote."""
    return on_eight[0], on_eight[1]


@pytest.mark.slow
def test_device_5_of_8_reads_on_one_device_by_every_reader(written_on_eight):
    out, got = written_on_eight
    wrote = part(got, "device5")
    assert wrote["on"] == ["TFRT_CPU_5"] or wrote["on"] == ["cpu:5"], wrote["on"]
    here = [str(jax.devices()[0])]
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    template, state = job.model(), opt.init(job.model())
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for tree in (ft.train.load(out / "tree5"), ft.train.load(out / "tree5", template),
                 ft.train.load(out / "tree5", template, sharding=one),
                 ft.train.load(out / "tree5", sharding=jax.devices()[0])):
        assert _devices(tree) == here and _values(tree) == wrote["model"]
    manager = ft.train.CheckpointManager(out / "mgr5")
    for ck in (manager.restore(), manager.restore(template=template, opt_state_template=state)):
        assert _devices((ck.model, ck.opt_state, ck.extra)) == here and _values(ck.model) == wrote["model"]
        np.testing.assert_array_equal(ck.extra["e"], [0.0, 1.0])
    saved = ft.train.JobState.restore(out / "job5")
    assert saved.steps_run == 3 and _devices(saved) == here and _values(saved.model) == wrote["job"]
    trainer = job.trainer().restore(out / "job5")
    assert _values(trainer.model) == wrote["job"]
    trainer.fit(ft.train.batches((job.X, job.Y), 10, key=jax.random.key(3)), steps=5, progress=False)
    assert trainer.steps_run == 5 and _devices(trainer.state) == here  # it continues here


@pytest.mark.slow
def test_a_zero_size_array_goes_where_the_template_places_it(written_on_eight):
    """A zero-size array (stored as its shape and dtype alone) came back on the default
    device (jnp.zeros) whatever the template's device or sharding; it goes where a stored
    array would, and one written on 8 devices reads here."""
    out, got = written_on_eight
    wrote = part(got, "zero-size")
    assert all(on in (["TFRT_CPU_5"], ["cpu:5"]) for on in wrote["on5"].values()), wrote["on5"]
    assert "None, 'data'" in wrote["spread"] and wrote["spread_on"] == 8, wrote
    back = ft.train.load(out / "zero")
    assert _devices(back) == [str(jax.devices()[0])] and back["empty"].shape == (0, 8) and back["ids"].dtype == np.int32


@pytest.mark.slow
def test_a_mesh_of_8_reads_on_one_device_by_every_reader(written_on_eight):
    out, got = written_on_eight
    wrote = part(got, "mesh")
    assert wrote["spec"] != "P()"  # really sharded when written
    here = [str(jax.devices()[0])]
    template = ft.nn.Dense(8, 256, key=jax.random.key(1))
    for tree in (ft.train.load(out / "mesh"), ft.train.load(out / "mesh", template),
                 ft.train.load(out / "mesh", template, sharding=jax.devices()[0])):
        assert _devices(tree) == here and _values(tree) == wrote["model"]
    manager = ft.train.CheckpointManager(out / "mgr_mesh")
    for ck in (manager.restore(), manager.restore(template=template)):
        assert _devices(ck.model) == here and _values(ck.model) == wrote["model"]


# --- written here on 1 device, read on device 3 of 8 and onto a mesh of 8 -----------------------

READ_ON_EIGHT = {
    "default device 3": """
jax.config.update("jax_default_device", D[3])
tree = ft.train.load(OUT + "/tree")
ck = ft.train.CheckpointManager(OUT + "/mgr").restore()
state = ft.train.JobState.restore(OUT + "/job")
t = job.trainer().restore(OUT + "/job")
t.fit(data(), steps=5, progress=False)
jax.config.update("jax_default_device", None)
report({"load": on(tree), "manager": on((ck.model, ck.opt_state, ck.extra)), "job": on(state),
        "trainer": on(t.state), "steps": t.steps_run, "values": values(tree)})
""",
    "template on device 3": """
opt = ft.optim.Optimizer(ft.optim.adam(0.1))
template = jax.device_put(job.model(), D[3])
state = jax.device_put(opt.init(job.model()), D[3])
tree = ft.train.load(OUT + "/tree", template)
ck = ft.train.CheckpointManager(OUT + "/mgr").restore(template=template, opt_state_template=state)
with jax.default_device(D[3]):  # a trainer living on device 3 (its step's buffers too)
    t = job.trainer().restore(OUT + "/job")
    t.fit(data(), steps=5, progress=False)
report({"load": on(tree), "manager": on((ck.model, ck.opt_state, ck.extra)), "trainer": on(t.state),
        "steps": t.steps_run, "values": values(tree)})
""",
    "sharding device 6": """
tree = ft.train.load(OUT + "/tree", job.model(), sharding=D[6])
ck = ft.train.CheckpointManager(OUT + "/mgr").restore(sharding=SingleDeviceSharding(D[6]))
report({"load": on(tree), "manager": on((ck.model, ck.opt_state, ck.extra)), "values": values(tree)})
""",
    "mesh of 8": """
mesh = jax.make_mesh((8,), ("data",))
tree = ft.train.load(OUT + "/wide", wide(), mesh=mesh, sharding="fsdp")
ck = ft.train.CheckpointManager(OUT + "/mgr").restore(template=job.model(), mesh=mesh, sharding="fsdp")
two = jax.make_mesh((2,), ("data",), devices=D[:2])  # the job's minibatches of 10 split over 2
t = ft.train.Trainer(job.model(), ft.optim.Optimizer(ft.optim.adam(0.05)), job.loss_fn, key=jax.random.key(7),
                     mesh=two, sharding="fsdp")
t.restore(OUT + "/job")
t.fit(data(), steps=5, progress=False)
report({"load": on(tree), "spec": str(tree.weight.sharding.spec), "manager": on(ck.model),
        "trainer": on(t.model), "steps": t.steps_run, "values": values(tree)})
""",
    "a sharding that cannot hold it": """
mesh = jax.make_mesh((8,), ("data",))
try:
    ft.train.load(OUT + "/tree", job.model(), sharding=NamedSharding(mesh, P("data")))
    report("loaded")
except ft.train.CheckpointError as e:
    report(str(e))
""",
    "the committed fixture, default device 3": """
import shutil, tempfile
copy = tempfile.mkdtemp() + "/old"
shutil.copytree(FIXTURE, copy)
jax.config.update("jax_default_device", D[3])
state = ft.train.JobState.restore(copy)
t = job.trainer().restore(copy, callbacks=False)
t.fit(data(), epochs=3, progress=False, log_every=2)
jax.config.update("jax_default_device", None)
report({"job": on(state), "trainer": on(t.state), "steps": t.steps_run})
""",
}


@pytest.fixture(scope="module")
def on_eight(tmp_path_factory):
    """One 8-device subprocess writes (WRITE_ON_EIGHT, into its own directory) and reads what
    this process wrote (READ_ON_EIGHT); returns the former's directory, the reports, and the
    values this process saved."""
    eight, out = tmp_path_factory.mktemp("eight"), tmp_path_factory.mktemp("one")
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    model = job.model()
    ft.train.save(out / "tree", model)
    ft.train.save(out / "wide", ft.nn.Dense(8, 256, key=jax.random.key(1)))
    with ft.train.CheckpointManager(out / "mgr") as m:
        m.save(1, model, opt.init(model), extra={"e": jnp.arange(2.0)})
    t = job.trainer()
    t.fit(ft.train.batches((job.X, job.Y), 10, key=jax.random.key(3)), steps=3, progress=False)
    t.save(out / "job")
    # each scenario names its own directory: the writes and the reads never share one
    sources = {**{name: f"OUT = {str(eight)!r}\n" + src for name, src in WRITE_ON_EIGHT.items()},
               **{name: f"OUT, FIXTURE = {str(out)!r}, {str(FIXTURE)!r}\n" + src for name, src in READ_ON_EIGHT.items()}}
    return eight, scenarios(COMMON, sources), _values(model)


@pytest.fixture(scope="module")
def read_on_eight(on_eight):
    """The values this process saved, and the READ_ON_EIGHT reports."""
    return on_eight[2], on_eight[1]


@pytest.mark.slow
def test_one_device_reads_on_device_3_of_8_by_every_reader(read_on_eight):
    values, got = read_on_eight
    three, six = ["TFRT_CPU_3", "cpu:3"], ["TFRT_CPU_6", "cpu:6"]
    default, template, sharding = (part(got, k) for k in ("default device 3", "template on device 3",
                                                            "sharding device 6"))
    for out in (default, template):
        assert out["values"] == values and out["steps"] == 5
        for reader in ("load", "manager", "trainer") + (("job",) if "job" in out else ()):
            assert len(out[reader]) == 1 and out[reader][0] in three, (reader, out[reader])
    assert sharding["values"] == values
    assert len(sharding["load"]) == 1 and sharding["load"][0] in six and sharding["manager"] == sharding["load"]


@pytest.mark.slow
def test_one_device_reads_onto_a_mesh_of_8(read_on_eight):
    out = part(read_on_eight[1], "mesh of 8")
    assert len(out["load"]) == 8 and out["spec"] != "P()" and len(out["trainer"]) == 2 and out["steps"] == 5
    assert len(out["manager"]) == 8


@pytest.mark.slow
def test_a_sharding_that_cannot_hold_an_array_names_both_sides(read_on_eight):
    message = part(read_on_eight[1], "a sharding that cannot hold it")
    assert "array 'layers.0.bias' (float32[4]) cannot be placed by NamedSharding" in message, message
    assert "partitioned 8 times" in message and "It was written on cpu:0" in message and "corrupted" not in message


@pytest.mark.slow
def test_the_committed_fixture_restores_where_its_device_is_not_the_default(read_on_eight):
    out = part(read_on_eight[1], "the committed fixture, default device 3")
    assert len(out["job"]) == 1 and out["job"][0] in ["TFRT_CPU_3", "cpu:3"]
    assert out["trainer"] == out["job"] and out["steps"] == 12


# --- devices this machine lacks (a GPU's), in this process ---------------------------------------

def _as_if_written_on(directory: Path, device: str) -> None:
    """Rewrite orbax's record of the writer's devices (``arrays/_sharding``) to ``device``."""
    for sharding in directory.rglob("_sharding"):
        entries = json.loads(sharding.read_text())
        for key, value in entries.items():
            about = json.loads(value)
            about["device_str"] = device
            entries[key] = json.dumps(about)
        sharding.write_text(json.dumps(entries))


def test_a_checkpoint_written_on_a_gpu_reads_on_this_cpu(tmp_path):
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    model = job.model()
    ft.train.save(tmp_path / "tree", model)
    with ft.train.CheckpointManager(tmp_path / "mgr") as m:
        m.save(1, model, opt.init(model), extra={"e": jnp.arange(2.0)})
    shutil.copytree(FIXTURE, tmp_path / "job")
    for d in ("tree", "mgr", "job"):
        _as_if_written_on(tmp_path / d, "cuda:5")
    here = [str(jax.devices()[0])]
    assert _values(ft.train.load(tmp_path / "tree")) == _values(model)
    assert _devices(ft.train.load(tmp_path / "tree", model)) == here
    ck = ft.train.CheckpointManager(tmp_path / "mgr").restore(template=model)
    assert _devices((ck.model, ck.opt_state, ck.extra)) == here and _values(ck.model) == _values(model)
    state = ft.train.JobState.restore(tmp_path / "job")
    assert state.steps_run == 7 and _devices(state) == here
    trainer = job.trainer().restore(tmp_path / "job", callbacks=False)
    trainer.fit(ft.train.batches((job.X, job.Y), 10, key=jax.random.key(3)), steps=9, progress=False)
    assert trainer.steps_run == 9


def test_the_writer_s_devices_stay_in_the_metadata_as_information(tmp_path):
    ft.train.save(tmp_path / "tree", {"w": jnp.ones(2), "n": np.arange(3)})
    meta = json.loads((tmp_path / "tree" / "meta" / "metadata").read_text())
    assert meta["written_on"] == {"functree": ft.__version__, "jax": jax.__version__, "processes": 1, "device_count": 1,
                                  "devices": [str(jax.devices()[0])]}
    restored = ft.train.load(tmp_path / "tree")  # a NumPy array comes back as one
    assert isinstance(restored["w"], jax.Array) and isinstance(restored["n"], np.ndarray)


def test_sharding_rules_without_a_mesh_are_refused(tmp_path):
    ft.train.save(tmp_path / "tree", {"w": jnp.ones(2)})
    with pytest.raises(ft.train.CheckpointError, match=r"sharding='fsdp' names sharding rules, which need a mesh"):
        ft.train.load(tmp_path / "tree", {"w": jnp.ones(2)}, sharding="fsdp")
    with pytest.raises(ft.train.CheckpointError, match=r"mesh=mesh, sharding='fsdp'"):
        ft.train.CheckpointManager(tmp_path / "m").restore(sharding="fsdp")


@pytest.mark.parametrize("leaf", ["warm start", object()], ids=["str", "object"])
def test_a_leaf_no_checkpoint_can_hold_is_refused_before_anything_is_written(tmp_path, leaf):
    with pytest.raises(ft.train.CheckpointError, match=r"The leaf 'extra.note' is (str 'warm start'|object <object)"):
        ft.train.save(tmp_path / "tree", {"w": jnp.ones(2), "extra": {"note": leaf}})
    assert list(tmp_path.iterdir()) == []  # no folder, no orbax temporary folder
    with ft.train.CheckpointManager(tmp_path / "mgr") as m:
        with pytest.raises(ft.train.CheckpointError, match=r"(?s)The leaf 'extra.note' is .*Nothing was written"):
            m.save(1, {"w": jnp.ones(2)}, extra={"note": leaf})
        assert sorted(p.name for p in (tmp_path / "mgr").iterdir() if not p.name.startswith(".")) == []
        m.save(1, {"w": jnp.ones(2)})  # the same manager saves that step
        assert m.all_steps() == [1]


# --- several processes: tests/test_train_processes.py's two worker processes save what each
# made and refuse text on every process (no start-up of their own) ---------------------------


def test_a_template_that_does_not_fit_is_reported_as_such_onto_a_mesh_too(tmp_path):
    """The target's shapes and dtypes are the saved ones: a template of another shape or
    dtype is reported by the template check (it was "corrupted" onto a mesh; a dtype was
    cast by orbax before the check caught it)."""
    ft.train.save(tmp_path / "tree", {"w": jnp.ones((2, 3))})
    mesh = jax.make_mesh((1,), ("data",))
    for wrong in ({"w": jnp.ones((3, 2))}, {"w": jnp.ones((2, 3), jnp.bfloat16)}):
        for kwargs in ({}, {"mesh": mesh}):
            with pytest.raises(ft.train.CheckpointError, match="does not fit the template") as e:
                ft.train.load(tmp_path / "tree", wrong, **kwargs)
            assert "corrupted" not in str(e.value)
