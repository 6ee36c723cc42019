"""A model trains where it lives (issue 44 item 2): ``functree/_where.py``.

A model committed to device 2 of 8, or to a mesh of devices 4-7, goes through
``opt.init``, ``train_step``, ``ft.jit(donate=...)`` and the Trainer (fit with validation,
checkpoints, restore and continue) with every array the library makes for it on its
devices. Before, the trainer's own arrays (key, metric buffer, learning context) were
committed to the default device and the first step failed: "Received incompatible devices
for jitted computation".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import compiled
from _devices import part, selected_scenarios

import functree as ft
from functree._where import placement_of, put

COMMON = """
import tempfile
import jax, jax.numpy as jnp, numpy as np, optax
import functree as ft
from jax.sharding import NamedSharding, PartitionSpec as P

X = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
DEVICE = jax.devices()[2]

def loss_fn(model, batch, *, key):
    x, y = batch
    return jnp.mean((model(x, key=key) - y) ** 2)

def plain_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)

def new_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(3, 4, key=k1), ft.nn.Dropout(0.25), ft.nn.Dense(4, 1, key=k2))

def devices_of(tree):
    return sorted({d.id for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()})

def messages_of(calls):
    # each call's ValueError message, or "no error"
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    return messages

def trainer(where=None):
    model = new_model() if where is None else jax.device_put(new_model(), where)
    return ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn, key=jax.random.key(7))

def leaves(t):
    return [np.asarray(x) for x in jax.tree.leaves((t.model, t.opt_state))]

def fit(t, directory=None, k=1):
    callbacks = [] if directory is None else [ft.train.ModelCheckpoint(directory, every_steps=5, max_to_keep=None)]
    t.fit(ft.train.batches((X, Y), 8, key=jax.random.key(3)), epochs=3, validation_data=(X, Y), log_every=2,
          progress=False, callbacks=callbacks, steps_per_call=k)
    return t
"""

SCENARIOS = {
    "trainer_on_device_two": """
directory = tempfile.mkdtemp() + "/job"
t = fit(trainer(DEVICE), directory)
straight = fit(trainer())  # the same job on the default device
on = {"model": devices_of(t.model), "opt_state": devices_of(t.opt_state), "key": devices_of(t.key),
      "log": devices_of(t._reader.log.buffer)}
resumed = trainer(DEVICE).restore(directory, step=10)
restored_on = devices_of((resumed.model, resumed.opt_state, resumed.key))
fit(resumed, tempfile.mkdtemp() + "/again")
scanned = fit(trainer(DEVICE), k=2)  # two steps per call: the scanned program there too
report({"on": on, "restored_on": restored_on, "resumed_on": devices_of((resumed.model, resumed.opt_state)),
        "same": all(np.array_equal(a, b) for a, b in zip(leaves(t), leaves(straight))),
        "resumed_same": all(np.array_equal(a, b) for a, b in zip(leaves(resumed), leaves(t))),
        "scanned_on": devices_of((scanned.model, scanned.opt_state)),
        "scanned_same": all(np.array_equal(a, b) for a, b in zip(leaves(scanned), leaves(t))),
        "val": [round(v, 6) for v in t.history.epochs["val_loss"]] ==
               [round(v, 6) for v in straight.history.epochs["val_loss"]],
        "steps": resumed.steps_run, "evaluated": sorted(t.evaluate((X, Y)))})
""",
    "optimizer_step_and_jit_on_device_two": """
model = jax.device_put(ft.nn.Dense(3, 1, key=jax.random.key(0)), DEVICE)
opt = ft.optim.Optimizer(ft.optim.adam(0.1))
state = opt.init(model)
init_on = devices_of((state, ft.optim.adam(0.1).init(model), ft.optim.Optimizer(optax.adam(0.1)).init(model)))
step = ft.train.train_step(plain_loss, opt)
m, s = jax.tree.map(jnp.copy, (model, state))
for _ in range(3):
    m, s, metrics = step(m, s, (X[:8], Y[:8]))
step.check()

@ft.jit(donate=(0, 1))
def minimize(m, s, batch):
    return opt.minimize(plain_loss, m, s, batch)[:2]

j, js = jax.tree.map(jnp.copy, (model, state))
for _ in range(3):
    j, js = minimize(j, js, (X[:8], Y[:8]))
report({"init": init_on, "step": devices_of((m, s, metrics)), "compiles": step._compiled._cache_size(),
        "jit": devices_of((j, js)), "jit_compiles": minimize._cache_size()})
""",
    "trainer_on_a_mesh_it_was_not_given": """
mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[4:])
t = fit(trainer(NamedSharding(mesh, P())))
straight = fit(trainer())
report({"on": devices_of((t.model, t.opt_state, t.key, t._reader.log.buffer)),
        "same": all(np.array_equal(a, b) for a, b in zip(leaves(t), leaves(straight)))})
""",
    "a_batch_committed_elsewhere": """
model = jax.device_put(ft.nn.Dense(3, 1, key=jax.random.key(0)), DEVICE)
opt = ft.optim.Optimizer(ft.optim.adam(0.1))
batch = jax.device_put((X[:8], Y[:8]), jax.devices()[0])
calls = {"train_step": lambda: ft.train.train_step(plain_loss, opt)(model, opt.init(model), batch),
         "jit_donating": lambda: ft.jit(lambda m, s, b: opt.minimize(plain_loss, m, s, b), donate=(0, 1))(
             model, opt.init(model), batch),
         "jit": lambda: ft.jit(lambda m, b: plain_loss(m, b))(model, batch),
         "trainer": lambda: ft.train.Trainer(model, opt, plain_loss).fit([batch], steps=1, progress=False)}
report(messages_of(calls))
""",
    "arrays_made_for_a_model_where_it_lives": """
mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])
model = jax.device_put(new_model(), DEVICE)
adapted = ft.nn.lora(model, "layers.0", rank=2, key=jax.random.key(1), dropout=0.1)
directory = tempfile.mkdtemp()
ft.nn.save_lora(adapted, directory)
loaded = ft.nn.load_lora(model, directory)
state = {"0.weight": np.ones((4, 3), np.float32), "0.bias": np.zeros(4, np.float32),
         "2.weight": np.ones((1, 4), np.float32), "2.bias": np.zeros(1, np.float32)}
sharded = ft.shard(new_model(), mesh, {"layers.0.weight": P(None, "data")})
on_mesh = ft.nn.load_torch_state_dict(sharded, state)
committed = lambda t: all(x.committed for x in jax.tree.leaves(t) if isinstance(x, jax.Array))  # noqa: E731
report({"lora": devices_of(adapted), "lora_committed": committed(adapted), "loaded": devices_of(loaded),
        "torch": devices_of(ft.nn.load_torch_state_dict(model, state)),
        "torch_on_mesh": [str(x.sharding.spec) for x in jax.tree.leaves(on_mesh)],
        "zeros": devices_of(ft.zero_tangent_vector(model)),
        "zeros_later": devices_of(ft.zero_tangent_vector_initializer(model)()),
        "zeros_on_mesh": [str(x.sharding.spec) for x in jax.tree.leaves(ft.zero_tangent_vector(sharded))],
        "loss_scale": devices_of(ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1))).init(model))})
""",
    "a_batch_on_the_explicit_twin_of_the_mesh": """
mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])  # Explicit axes; ft.shard places on the Auto twin
model = ft.shard(ft.nn.Dense(3, 1, key=jax.random.key(0)), mesh)
opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
batch = jax.device_put((X[:8], Y[:8]), NamedSharding(mesh, P("data")))
on_two = jax.device_put(ft.nn.Dense(3, 1, key=jax.random.key(0)), DEVICE)
calls = {"train_step": lambda: ft.train.train_step(plain_loss, opt, donate=False)(model, opt.init(model), batch),
         "jit": lambda: ft.jit(plain_loss)(model, batch),
         "eval_step": lambda: ft.train.eval_step(plain_loss)(model, batch),
         "evaluate": lambda: ft.train.Trainer(model, opt, plain_loss).evaluate([batch]),
         "eval_step_devices": lambda: ft.train.eval_step(plain_loss)(on_two, jax.device_put((X[:8], Y[:8]), jax.devices()[0]))}
report(messages_of(calls))
""",
}


@pytest.fixture(scope="module")
def eight_devices(request):
    """The reports of this run's selected scenarios, from one 8-device subprocess."""
    return selected_scenarios(request, COMMON, SCENARIOS)


@pytest.mark.slow
def test_trainer_on_device_two(eight_devices):
    """Fit with validation and checkpoints, restore and continue, two steps per call: every
    array on device 2, the numbers those of the same job on the default device, bit for bit."""
    got = part(eight_devices, "trainer_on_device_two")
    assert got["on"] == {"model": [2], "opt_state": [2], "key": [2], "log": [2]}
    assert got["restored_on"] == [2] and got["resumed_on"] == [2] and got["scanned_on"] == [2]
    assert got["scanned_same"]
    assert got["same"] and got["val"] and got["resumed_same"] and got["steps"] == 18
    assert got["evaluated"] == ["loss"]


@pytest.mark.slow
def test_optimizer_step_and_jit_on_device_two(eight_devices):
    """``opt.init`` of params on device 2 gives a state there (an ``Optimizer``'s, and a
    functree transformation's own, with its context and hyperparameters); ``train_step`` and
    ``ft.jit(donate=...)`` run there, each one program for the loop."""
    got = part(eight_devices, "optimizer_step_and_jit_on_device_two")
    assert got["init"] == [2] and got["step"] == [2] and got["jit"] == [2]
    assert got["compiles"] == 1 and got["jit_compiles"] == 1


@pytest.mark.slow
def test_trainer_on_a_mesh_it_was_not_given(eight_devices):
    """A model replicated on a mesh of devices 4-7 (no ``mesh=`` to the Trainer) trains
    there, as on one device."""
    got = part(eight_devices, "trainer_on_a_mesh_it_was_not_given")
    assert got["on"] == [4, 5, 6, 7] and got["same"]


def test_placement_of_and_put_on_the_default_device():
    """Uncommitted or default-device models need no move: None; ``put`` commits in place."""
    model = {"w": jnp.ones(2)}
    assert placement_of(model) is None
    assert placement_of(jax.device_put(model, jax.devices()[0])) is None
    state = put({"n": jnp.zeros(())}, None)
    assert state["n"].committed and state["n"].devices() == {jax.devices()[0]}


def test_an_evaluation_compiles_its_program_once():
    """The first sums are committed where the model lives, as those the program returns:
    one compiled program per evaluation's shapes (uncommitted first sums compiled two)."""
    x = np.ones((24, 3), np.float32)
    trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2 + 0.5))  # a new program
    # JAX's caches kept (clear=False): the claim counts jit(run) alone, and a new loss function
    # is a new jit(run), compiled in this block whatever the worker ran before; a clear cost a
    # long-lived worker seconds (freeing its compiled programs) and every later test its
    # eager operations' traces and lowerings again.
    with compiled(clear=False) as names:
        first = trainer.evaluate((x, x[:, :1]), batch_size=8)
        again = trainer.evaluate((x, x[:, :1]), batch_size=8)
    assert [n for n in names if n == "jit(run)"] == ["jit(run)"] and first == again


def test_a_batch_committed_elsewhere(eight_devices):
    """A model on device 2 and a batch committed to device 0: JAX's "Received incompatible
    devices ... argument donated[0] of _Program.__init__.<locals>.flat" became an error naming
    the two key paths, their devices and the device_put that fixes it."""
    got = part(eight_devices, "a_batch_committed_elsewhere")
    for name, message in got.items():
        assert "is on ['TFRT_CPU_2']" in message or "is on ['cpu:2']" in message, (name, message)
        assert "batch[0] on" in message or "b[0] on" in message, (name, message)
        assert "= jax.device_put(" in message and "jax.devices()[2])    # or pass NumPy arrays" in message
    assert got["train_step"].startswith("the train step: its arguments are committed to different devices: "
                                        "model.weight is on")
    assert "the train step: its arguments are committed" in got["trainer"]



def test_arrays_made_for_a_model_where_it_lives(eight_devices):
    """LoRA adapters (``ft.nn.lora``, ``load_lora``), a torch state dict's weights, zero
    tangents and a ``LossScaleOptimizer``'s scale and counters go where the model lives (device 2, or its shards on a mesh), committed; they
    were made on the default device (a model on two devices, one more compile and a copy
    at the first step; a whole checkpoint's weights on GPU 0)."""
    got = part(eight_devices, "arrays_made_for_a_model_where_it_lives")
    assert got["lora"] == [2] and got["lora_committed"] and got["loaded"] == [2] and got["torch"] == [2]
    assert got["zeros"] == [2] and got["zeros_later"] == [2] and got["loss_scale"] == [2]
    assert got["torch_on_mesh"] == ["P(None, 'data')", "P()", "P()", "P()"]  # layers.0.weight first
    assert got["zeros_on_mesh"] == got["torch_on_mesh"]


def test_a_batch_on_the_explicit_twin_of_the_mesh(eight_devices):
    """A model placed by ``ft.shard`` (the Auto twin of ``jax.make_mesh``'s mesh) and a batch
    put on the mesh itself (Explicit axes): JAX's bare "Mesh for all inputs should be equal"
    became an error naming both key paths and the placement that fixes it; an eval step's
    arguments on two devices get the train step's error."""
    got = part(eight_devices, "a_batch_on_the_explicit_twin_of_the_mesh")
    for name in ("train_step", "jit", "eval_step", "evaluate"):
        message = got[name]
        assert "on two meshes of the same devices that differ in their axis types" in message, (name, message)
        assert ".weight is on the mesh with Auto axes, " in message and "[0] on the one with Explicit axes" in message
        assert "NamedSharding(ft.parallel.auto_mesh(mesh), P('data',)))" in message, (name, message)
    assert got["eval_step_devices"].startswith("the eval step: its arguments are committed to different devices: "
                                               "model.weight is on")
