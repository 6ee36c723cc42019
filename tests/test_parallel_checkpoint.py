"""Checkpoints move between device counts: 8-device FSDP → 1 device → 8 devices.

An 8-device FSDP run saves (model, Adam state) at step 10 and trains on to step 20; this
(1-device) process restores step 10, trains 5 steps and saves; the 8-device process, which
waited for it, restores that onto its 8-device mesh, sharded again, and trains the last 5
steps. The end equals the uninterrupted run.

One 8-device subprocess serves the module (one start-up, ~3 CPU-s, instead of four): it runs
the selected tests' parts (each in its own copy of the globals: a failure fails its test
alone), reports them, then waits on its stdin for the directory this process saved step 15 in.
"""

import json
import queue
import subprocess
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import MARK, PRELUDE, ROOT, WARNINGS, env_with_devices
from _tolerance import assert_close_trained
from jax.sharding import PartitionSpec as P

import functree as ft
from functree.parallel import DataParallelStep
from functree.train import CheckpointManager

SETUP = """
import jax, jax.numpy as jnp, numpy as np
import functree as ft
from functree.parallel import DataParallelStep

@jax.jit  # one program builds each fresh copy (eager, every initializer compiles apart)
def mlp():
    k = jax.random.split(jax.random.key(0), 2)
    return ft.nn.Sequential(ft.nn.Dense(16, 128, jax.nn.relu, key=k[0]), ft.nn.Dense(128, 4, key=k[1]))

def loss_fn(model, batch):
    x, y = batch
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(model(x)), y[:, None], axis=1))

rng = np.random.default_rng(0)
xs = rng.normal(size=(20, 64, 16)).astype(np.float32)
ys = rng.integers(0, 4, size=(20, 64)).astype(np.int32)
opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
"""


def _setup():
    scope: dict = {}
    exec(SETUP, scope)
    return scope


# The subprocess: SETUP, then the selected parts (PARTS, by test name without test_; each
# writes under OUT + "/" + its name), one report; then a line on stdin: the directory of step
# 15 (RESUME runs on it, a second report), or nothing (end of input: the process ends).
CHILD = SETUP + """
import os, sys, traceback
assert len(jax.devices()) == 8
D = jax.devices()
OUT, parts = sys.argv[1], json.loads(sys.argv[2])

def run_parts(parts):
    base, out = dict(globals()), {}
    for name, source in parts.items():
        got, where = [], os.path.join(OUT, name)
        os.makedirs(where)
        try:
            exec(source, dict(base, report=got.append, OUT=where))
            out[name] = {"result": got[-1]}
        except BaseException:
            out[name] = {"error": traceback.format_exc()}
    return out

report(run_parts(parts))
step15 = sys.stdin.readline().strip()
if step15:
    report(run_parts({"resume": RESUME.replace("STEP15", repr(step15))}))
"""

PARTS = {
    "fsdp_checkpoint_restores_on_one_device_and_back_onto_eight": """
mesh = jax.make_mesh((8,), ("data",))
step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
model = mlp()
state = opt.init(model)
for i in range(20):
    if i == 10:
        assert not model.layers[0].weight.sharding.is_fully_replicated
        ft.train.save(OUT + "/step10", (model, state))
    model, state, _ = step(model, state, (xs[i], ys[i]))
report([np.asarray(x).tolist() for x in jax.tree.leaves(model)])
""",
    "checkpoint_manager_restores_onto_a_mesh_in_shards": """
mesh = jax.make_mesh((4,), ("data",), devices=D[:4])
model = ft.shard(mlp(), mesh, "fsdp")
state = ft.shard(opt.init(mlp()), mesh, "fsdp")
with ft.train.CheckpointManager(OUT + "/ck") as manager:
    manager.save(3, model, state, extra={"note": np.arange(3.0)})
written = [str(model.layers[0].weight.sharding.spec), len(model.layers[0].weight.sharding.device_set)]
del model, state
mesh = jax.make_mesh((2,), ("data",), devices=D[:2])
manager = ft.train.CheckpointManager(OUT + "/ck")
ck = manager.restore(template=mlp(), opt_state_template=opt.init(mlp()), mesh=mesh, sharding="fsdp")
w = ck.model.layers[0].weight
mu = ft.optim.moments(ck.opt_state)["mu"].layers[0].weight
plain = manager.restore(template=mlp(), opt_state_template=opt.init(mlp()))
report({"w": [len(w.sharding.device_set), w.sharding.is_fully_replicated],
        "mu": [len(mu.sharding.device_set), mu.sharding.is_fully_replicated],
        "extra": [type(ck.extra["note"]).__name__, np.asarray(ck.extra["note"]).tolist()],
        "same": bool(np.array_equal(np.asarray(w), np.asarray(plain.model.layers[0].weight))),
        "plain": len(plain.model.layers[0].weight.sharding.device_set), "written": written})
manager.close()
""",
    "bfloat16_checkpoint_restores_split_by_the_rules": """
from jax.sharding import PartitionSpec as P
mesh = jax.make_mesh((2,), ("data",), devices=D[:2])
model = ft.cast(mlp(), jnp.bfloat16)
ft.train.save(OUT + "/m", (model, opt.init(model)))
specs = {}
for name, rules in (("fsdp", "fsdp"), ("rule", {"layers.1.weight": P("data"), "*": "fsdp"})):
    m, state = ft.train.load(OUT + "/m", (model, opt.init(model)), mesh=mesh, sharding=rules)
    specs[name] = {k: [str(v.dtype), str(v.sharding.spec), v.addressable_shards[0].data.size]
                   for k, v in ft.to_flat_dict(m).items()}
    specs[name + " mu"] = str(ft.optim.moments(state)["mu"].layers[0].weight.sharding.spec)
report(specs)
""",
}

# Step 15 (saved by this process) onto the 8-device mesh, sharded again, and the last 5 steps.
RESUME = """
mesh = jax.make_mesh((8,), ("data",))
template = (mlp(), opt.init(mlp()))
model, state = ft.train.load(STEP15, template, mesh=mesh, sharding="fsdp")
sharded = not model.layers[0].weight.sharding.is_fully_replicated
moment = any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state))  # Adam moments
step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
for i in range(15, 20):
    model, state, _ = step(model, state, (xs[i], ys[i]))
report({"sharded": sharded, "moment": moment, "steps": int(ft.optim.context(state).step),
        "params": [np.asarray(x).tolist() for x in jax.tree.leaves(model)]})
"""


class _EightDevices:
    """The module's 8-device subprocess (CHILD): :meth:`report` reads its next report,
    :meth:`resume` hands it step 15's directory and returns RESUME's report. Its stderr goes
    to a file (a pipe read only at the end could fill up and stop it)."""

    def __init__(self, out, parts):
        self.out = out
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        code = PRELUDE + f"RESUME = {RESUME!r}\n" + CHILD
        self._proc = subprocess.Popen(
            [sys.executable, *WARNINGS, "-c", code, str(out), json.dumps(parts)], env=env_with_devices(8), cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._reports: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.parts = self.report(timeout=300 * max(1, len(parts)))  # 300 s a part, as _devices.scenarios

    def _read(self):
        for line in self._proc.stdout:
            if line.startswith(MARK):
                self._reports.put(json.loads(line[len(MARK):]))
        self._reports.put(None)  # the process closed its output: it ended

    def report(self, timeout=300):
        try:
            got = self._reports.get(timeout=timeout)
        except queue.Empty:
            got = None
        if got is None:
            self._end()
            self._stderr.seek(0)
            err = self._stderr.read()[-6000:]
            self._stderr.close()
            raise AssertionError(f"subprocess failed (exit {self._proc.returncode}):\n{err}")
        return got

    def resume(self, step15):
        try:
            self._proc.stdin.write(f"{step15}\n")
            self._proc.stdin.flush()
        except BrokenPipeError:  # it ended: report() raises with its stderr
            pass
        return part(self.report(), "resume")

    def close(self):
        self._end()
        self._stderr.close()

    def _end(self):
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()  # end of input: a process that did not resume ends
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=60)  # it reads to the end of the output, then the pipe closes
        self._proc.stdout.close()


def part(reports, name):
    """The result of part ``name`` (raises with its traceback in the subprocess)."""
    got = reports[name]
    if "error" in got:
        raise AssertionError(f"part {name!r} failed in the subprocess:\n{got['error']}")
    return got["result"]


# The README's `--dist loadfile` runs a module's tests on one pytest-xdist worker, so this
# module fixture starts its subprocess once per run.
@pytest.fixture(scope="module")
def eight(request, tmp_path_factory):
    """The 8-device subprocess, after it ran the parts of this run's selected tests."""
    here = {item.originalname[5:] for item in request.session.items if getattr(item, "module", None) is request.module}
    child = _EightDevices(tmp_path_factory.mktemp("eight"), {n: s for n, s in PARTS.items() if n in here})
    yield child
    child.close()



@pytest.mark.slow
def test_fsdp_checkpoint_restores_on_one_device_and_back_onto_eight(eight, tmp_path):
    first = part(eight.parts, "fsdp_checkpoint_restores_on_one_device_and_back_onto_eight")
    s = _setup()
    template = (s["mlp"](), s["opt"].init(s["mlp"]()))
    one = jax.make_mesh((1,), ("data",))
    step10 = eight.out / "fsdp_checkpoint_restores_on_one_device_and_back_onto_eight" / "step10"
    model, state = ft.train.load(step10, template, mesh=one, sharding="fsdp")
    assert int(ft.optim.context(state).step) == 10
    step = DataParallelStep(s["loss_fn"], s["opt"], mesh=one, sharding="fsdp")
    for i in range(10, 15):
        model, state, _ = step(model, state, (s["xs"][i], s["ys"][i]))
    ft.train.save(tmp_path / "step15", (model, state))

    last = eight.resume(tmp_path / "step15")
    assert last["sharded"] and last["moment"] and last["steps"] == 20
    assert_close_trained([np.float32(a) for a in last["params"]], [np.float32(b) for b in first],
                         spread=2e-6)  # resumed on 1 device vs on 8: measured max 1.0e-6


def test_load_onto_a_mesh_needs_a_template(tmp_path):
    ft.train.save(tmp_path / "m", {"w": jnp.ones(2)})
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)needs a template.*right:  ft.train.load\(path, model, "):
        ft.train.load(tmp_path / "m", mesh=jax.make_mesh((1,), ("data",)))  # (once: "(model, opt_state)")
    restored = ft.train.load(tmp_path / "m", {"w": jnp.zeros(2)}, mesh=jax.make_mesh((1,), ("data",)))
    np.testing.assert_array_equal(restored["w"], np.ones(2))


@pytest.mark.slow
def test_checkpoint_manager_restores_onto_a_mesh_in_shards(eight):
    """CheckpointManager.restore(mesh=, sharding=): a 4-device FSDP save restored onto 2
    devices sharded again (and onto the default device without a mesh); a part without a
    template (extra) comes back on the host. In the 8-device process: it saves on 4 of its
    devices, then a fresh manager restores onto a mesh of 2 of them."""
    out = part(eight.parts, "checkpoint_manager_restores_onto_a_mesh_in_shards")
    assert out["written"] == ["P(None, 'data')", 4]
    assert out["w"] == [2, False] and out["mu"] == [2, False]
    assert out["extra"] == ["ndarray", [0.0, 1.0, 2.0]] and out["same"] and out["plain"] == 1


def test_rules_that_match_nothing_are_refused_when_restoring_onto_a_mesh(tmp_path):
    """ft.train.load / CheckpointManager.restore(mesh=, sharding=rules) check the rules against
    the model's template as ft.shard and the Trainer do: a typo used to replicate the leaf
    silently, and a rule after "*" was never used."""
    s = _setup()
    model, opt = s["mlp"](), s["opt"]
    ft.train.save(tmp_path / "m", (model, opt.init(model)))
    one = jax.make_mesh((1,), ("data",))
    typo = {"*.wieght": P(None, "data")}
    with pytest.raises(ValueError, match=r"rule '\*\.wieght' matches no parameter\. Closest names: '0\.layers"):
        ft.train.load(tmp_path / "m", (model, opt.init(model)), mesh=one, sharding=typo)
    with pytest.raises(ValueError, match=r"'\*\.weight' is never used: .* earlier rule '\*'"):
        ft.train.load(tmp_path / "m", (model, opt.init(model)), mesh=one, sharding={"*": "fsdp", "*.weight": P("data")})
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, model, opt.init(model))
        with pytest.raises(ValueError, match=r"rule '\*\.wieght' matches no parameter\. Closest names: 'layers"):
            manager.restore(template=model, opt_state_template=opt.init(model), mesh=one, sharding=typo)
        with pytest.raises(ValueError, match=r"rule '\*\.wieght' matches no parameter"):  # the moments' names
            manager.restore(opt_state_template=opt.init(model), include=("opt_state",), mesh=one, sharding=typo)
        # right rules: the model's checked strictly, the optimizer state's moments follow them
        ck = manager.restore(template=model, opt_state_template=opt.init(model), mesh=one,
                             sharding={"layers.0.weight": P(None, "data"), "*": "fsdp"})
    assert ck.model.layers[0].weight.sharding.spec == P(None, "data")
    assert ft.optim.moments(ck.opt_state)["mu"].layers[0].weight.sharding.spec == P(None, "data")
    np.testing.assert_array_equal(ck.model.layers[0].weight, model.layers[0].weight)


@pytest.mark.slow
def test_bfloat16_checkpoint_restores_split_by_the_rules(eight):
    """A bfloat16 model is split by "fsdp" and by rules when restored onto a mesh (2 of the
    8-device process's devices), as a float32 one (its leaves used to come back replicated
    on every device)."""
    out = part(eight.parts, "bfloat16_checkpoint_restores_split_by_the_rules")
    assert out["fsdp"]["layers.0.weight"] == ["bfloat16", "P(None, 'data')", 16 * 64]
    assert out["fsdp"]["layers.0.bias"] == ["bfloat16", "P()", 128]  # under FSDP_MIN_SIZE
    assert out["fsdp mu"] == "P(None, 'data')"
    assert out["rule"]["layers.1.weight"] == ["bfloat16", "P('data',)", 64 * 4]
    assert out["rule"]["layers.0.weight"] == ["bfloat16", "P(None, 'data')", 16 * 64]
