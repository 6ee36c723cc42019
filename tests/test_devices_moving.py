"""Work that moves between devices, written as a user writes it (audit 34).

One 8-device subprocess (``tests/_devices.py``: the device count appended to the inherited
XLA_FLAGS) runs the scenarios this run selected: a model on device 2 trained by
``train_step``, ``ft.jit`` + ``opt.minimize`` and ``Trainer.fit`` (the numbers of device 0,
bit for bit, every result on device 2); a model moved to another device between two calls of
one step; a model whose leaves lie on two devices; ``trainer.model`` set to a model on another
device; checkpoints written on device 3 and on a mesh of 4 read onto a template on device 5
(and here, on one device); a job written on a mesh of 8 resumed on 2 devices and on 1; a
Llama of ``ft.nn.from_hf`` on device 2 generating and training LoRA adapters; a model
trained data parallel over 4 of the 8 devices continued on one; eager optimizer calls given
a state, gradients or a batch on another device than the model's; a learning rate read on
another device set into a state; ``ft.nn.update_bn`` over batches on another device;
``ft.nn.generate`` of a model whose head lies on another device than its body.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _devices import part, selected_scenarios

import functree as ft

COMMON = """
import tempfile
import jax, jax.numpy as jnp, numpy as np
import functree as ft
from jax.sharding import NamedSharding, PartitionSpec as P

D = jax.devices()
X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
BATCHES = [(X[i * 8:(i + 1) * 8], Y[i * 8:(i + 1) * 8]) for i in range(4)]

def make():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(3, 8, key=k1), ft.nn.Dense(8, 1, key=k2))

def loss_fn(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)

def on(tree):
    return sorted({d.id for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()})

def values(tree):
    return [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]

def error_of(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"
"""

SCENARIOS = {
    "device_two_trains": """
def by_train_step(where, batches=BATCHES):
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    model = jax.device_put(make(), where)
    state, step = opt.init(model), ft.train.train_step(loss_fn, opt)
    for b in batches:
        model, state, metrics = step(model, state, b)
    return model, state, metrics

def by_minimize(where, batches=BATCHES):
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    model = jax.device_put(make(), where)
    state = opt.init(model)
    step = ft.jit(lambda m, s, b: opt.minimize(loss_fn, m, s, b))
    for b in batches:
        model, state, loss = step(model, state, b)
    return model, state, loss

def by_fit(where, batches=BATCHES):
    t = ft.train.Trainer(jax.device_put(make(), where), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn)
    t.fit(batches, epochs=1, progress=False, log_every=1)
    return t.model, t.opt_state, t.history.steps["loss"]

out = {}
on_zero = [jax.device_put(b, D[0]) for b in BATCHES]
for name, run in (("train_step", by_train_step), ("minimize", by_minimize), ("fit", by_fit)):
    zero, two = run(D[0]), run(D[2])
    out[name] = {"on": [on(x) for x in two], "same": values(zero) == values(two),
                 "batch_on_zero": error_of(lambda: run(D[2], on_zero))}
report(out)
""",
    "a_model_moved_between_calls_of_one_step": """
# A step that donates nothing (donate=False) or whose model moves while its state follows:
# the step's own stop log (on_nan="stop") stayed on the first call's device.
# the numbers of one device (whatever the donation): computed once for both
opt = ft.optim.Optimizer(ft.optim.adam(0.05))
ref = ft.train.train_step(loss_fn, opt)
m, s = make(), opt.init(make())
for b in BATCHES[:3]:
    m, s, ref_metrics = ref(m, s, b)
out = {}
for donate in (False, True):
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    step = ft.train.train_step(loss_fn, opt, donate=donate)
    model = jax.device_put(make(), D[2])
    state = opt.init(model)
    for b in BATCHES[:2]:
        model, state, _ = step(model, state, b)
    model, state = jax.device_put(model, D[5]), jax.device_put(state, D[5])
    model, state, metrics = step(model, state, BATCHES[2])
    out[str(donate)] = {"on": [on(model), on(state), on(metrics)], "same": values(m) == values(model)}
report(out)
""",
    "leaves_on_two_devices_are_named": """
opt = ft.optim.Optimizer(ft.optim.adam(0.05))
model = jax.device_put(make(), D[2])
model = ft.set(model, "layers.1.bias", jax.device_put(model.layers[1].bias, D[1]))
state = opt.init(jax.device_put(make(), D[2]))
report({
    "train_step": error_of(lambda: ft.train.train_step(loss_fn, opt)(model, state, BATCHES[0])),
    "minimize": error_of(lambda: ft.jit(lambda m, s, b: opt.minimize(loss_fn, m, s, b))(model, state, BATCHES[0])),
    "trainer": error_of(lambda: ft.train.Trainer(model, opt, loss_fn)),
    "init": error_of(lambda: opt.init(model)),
})
""",
    "trainer_model_set_on_another_device_is_refused": """
t = ft.train.Trainer(jax.device_put(make(), D[2]), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn)
t.fit(BATCHES[:2], epochs=1, progress=False)
def move():
    t.model = jax.device_put(t.model, D[5])
refused = error_of(move)
still = on(t.state)
t.model = jax.tree.map(np.asarray, t.model)  # NumPy goes where the job is
t.fit(BATCHES[:2], epochs=2, progress=False)
saved = tempfile.mkdtemp() + "/model"
ft.train.save(saved, t.model)
t.model = ft.train.load(saved)  # on the default device (no template): goes where the job is too
loaded = on(t.model)
path = tempfile.mkdtemp() + "/job"
t.save(path)
moved = ft.train.Trainer(jax.device_put(make(), D[5]), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn).restore(path)
moved.fit(BATCHES[:2], epochs=3, progress=False)
report({"refused": refused, "still": still, "after": on(t.state), "loaded": loaded, "moved": on(moved.state),
        "steps": moved.steps_run})
""",
    "checkpoints_of_device_3_and_a_mesh_of_4_land_on_the_template": """
import json
out = OUT
m3 = jax.device_put(make(), D[3])
ft.train.save(out + "/tree3", m3)
mesh4 = jax.make_mesh((4,), ("data",), devices=D[:4])
wide = ft.nn.Dense(8, 64, key=jax.random.key(1))
wide = jax.device_put(wide, jax.tree.map(lambda x: NamedSharding(mesh4, P(*([None] * (x.ndim - 1)), "data")), wide))
ft.train.save(out + "/mesh4", wide)
t = ft.train.Trainer(jax.device_put(make(), D[3]), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn)
t.fit(BATCHES, epochs=1, progress=False, callbacks=[ft.train.ModelCheckpoint(out + "/run3")])
five = D[5]
tree = ft.train.load(out + "/tree3", jax.device_put(make(), five))
wide_back = ft.train.load(out + "/mesh4", jax.device_put(ft.nn.Dense(8, 64, key=jax.random.key(9)), five))
r = ft.train.Trainer(jax.device_put(make(), five), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn).restore(out + "/run3")
r.fit(BATCHES, epochs=2, progress=False)
report({"written": [on(m3), on(wide), on(t.state)], "spec": str(wide.weight.sharding.spec),
        "tree": on(tree), "tree_same": values(tree) == values(m3),
        "wide": on(wide_back), "wide_same": values(wide_back) == values(wide),
        "restored": on(r.state), "steps": r.steps_run, "m3": values(m3), "wide_values": values(wide),
        "job": values(t.model)})
""",
    "a_job_of_a_mesh_of_8_resumes_on_two_devices_and_on_one": """
def trainer(**kw):
    return ft.train.Trainer(make(), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn, **kw)
def data():
    return ft.train.batches((X, Y), 8, key=jax.random.key(3))
mesh8 = jax.make_mesh((8,), ("data",))
full = trainer(mesh=mesh8)
full.fit(data(), epochs=4, progress=False, log_every=1)
part = trainer(mesh=mesh8)
part.fit(data(), epochs=2, progress=False, log_every=1, callbacks=[ft.train.ModelCheckpoint(OUT + "/run8")])
losses = {}
for name, kw in (("two", {"mesh": jax.make_mesh((2,), ("data",), devices=D[:2])}), ("one", {}),
                 ("five", {"model": jax.device_put(make(), D[5])})):
    kw = dict(kw)
    r = ft.train.Trainer(kw.pop("model", make()), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn, **kw)
    r.restore(OUT + "/run8")
    r.fit(data(), epochs=4, progress=False, log_every=1)
    losses[name] = {"loss": r.history.steps["loss"], "on": on(r.state)}
report({"full": full.history.steps["loss"], "resumed": losses})
""",
    "a_llama_on_device_two_generates_and_trains_lora": """
config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 64}
ids = np.random.default_rng(0).integers(2, 64, (2, 7)).astype(np.int32)

def lm_loss(m, x):
    logits = m(x[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], axis=-1))

def run(where):
    model = jax.device_put(ft.nn.from_hf(config, key=jax.random.key(0)), where)
    greedy = ft.nn.generate(model, ids, 4, temperature=0.0)
    sampled = ft.nn.generate(model, ids, 4, temperature=1.0, top_k=10, key=jax.random.key(1))
    # a key and ids made on device 0 (committed there): moved to the model's device, as ids are
    key0 = ft.nn.generate(model, jax.device_put(ids, D[0]), 4, temperature=1.0, top_k=10,
                          key=jax.device_put(jax.random.key(1), D[0]))
    lm = ft.nn.lora(model, "model.layers.*.self_attn.[qv]_proj", rank=4, alpha=8, key=jax.random.key(2))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), wrt="*.lora_*")
    state, step = opt.init(lm), ft.train.train_step(lm_loss, opt)
    for _ in range(2):
        lm, state, metrics = step(lm, state, ids)
    return {"on": [on(greedy), on(sampled), on(key0), on(lm), on(state), on(metrics)],
            "greedy": np.asarray(greedy).tolist(), "sampled": np.asarray(sampled).tolist(),
            "key0": np.asarray(key0).tolist(),
            "loss": float(metrics["loss"]), "lora": values(jax.tree.leaves(lm)[:0] or lm.model.layers)}

zero, two = run(D[0]), run(D[2])
report({"on": two["on"], "same": {k: zero[k] == two[k] for k in ("greedy", "sampled", "key0", "loss", "lora")}
        | {"key0 is sampled": two["key0"] == zero["sampled"]}})
""",
    "data_parallel_over_4_of_8_then_one_device": """
W = np.random.default_rng(1).normal(size=(32, 16)).astype(np.float32)
batches = [(W[i * 8:(i + 1) * 8], W[i * 8:(i + 1) * 8, :2] * 2.0) for i in range(4)]
def wide():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(16, 256, key=k1), ft.nn.Dense(256, 2, key=k2))
mesh = jax.make_mesh((4,), ("data",), devices=D[:4])
# the reference, one device throughout (the same numbers for both rules): computed once
opt = ft.optim.Optimizer(ft.optim.adam(0.01))
ref_model, ref_state = wide(), opt.init(wide())
plain = ft.train.train_step(loss_fn, opt)
ref = []
for b in batches + batches[:1]:
    ref_model, ref_state, m = plain(ref_model, ref_state, b)
    ref.append(float(m["loss"]))
out = {}
for rules in (None, "fsdp"):
    opt = ft.optim.Optimizer(ft.optim.adam(0.01))
    model = ft.shard(wide(), mesh, rules)
    state = ft.shard(opt.init(model), mesh, rules)
    on_mesh = ft.train.train_step(loss_fn, opt, mesh=mesh, sharding=rules)
    for b in batches[:2]:
        model, state, _ = on_mesh(model, state, b)
    single = ft.train.train_step(loss_fn, opt, donate=False)
    model, state, first = single(model, state, batches[2])          # on the mesh still
    model, state = jax.device_put(model, D[6]), jax.device_put(state, D[6])
    model, state, second = single(model, state, batches[3])         # on device 6
    t = ft.train.Trainer(model, opt, loss_fn, opt_state=state)
    t.fit(batches[:1], epochs=1, progress=False)
    out[str(rules)] = {"on": [on(model), on(second), on(t.state)], "sharding": type(model.layers[0].weight.sharding).__name__,
                       "losses": [float(first["loss"]), float(second["loss"]), t.history.steps["loss"][0]],
                       "reference": ref[2:]}
report(out)
""",
    "an_eager_optimizer_names_a_state_on_another_device": """
# Eager optimizer calls (no jit): the state, gradients or batch on another device than the model's
opt = ft.optim.Optimizer(ft.optim.adam(0.05))
model = jax.device_put(make(), D[2])
state = opt.init(model)
grads = jax.tree.map(jnp.ones_like, model)
elsewhere = jax.device_put(state, D[1])
batch = (jax.device_put(X[:8], D[1]), jax.device_put(Y[:8], D[1]))
report({
    "update": error_of(lambda: opt.update(grads, elsewhere, model)),
    "grads": error_of(lambda: opt.update(jax.device_put(grads, D[1]), state, model)),
    "minimize": error_of(lambda: opt.minimize(loss_fn, model, state, batch)),
})
""",
    "a_learning_rate_from_another_device_is_set": """
# A rate read from another job's state (on device 1) set into this job's (on device 2)
opt = ft.optim.Optimizer(ft.optim.adam(0.05))
model = jax.device_put(make(), D[2])
state = opt.init(model)
rate = ft.optim.hyperparameters(opt.init(jax.device_put(make(), D[1])))["learning_rate"] * 0.5
step = ft.train.train_step(loss_fn, opt, donate=False)
out = {}
for name, value in (("committed", rate), ("number", 0.025)):
    try:
        new = ft.optim.set_hyperparameters(state, learning_rate=value)
    except ValueError as e:
        out[name] = str(e)
        continue
    stepped, new, _ = step(model, new, BATCHES[0])
    out[name] = {"on": [on(new), on(stepped)], "values": values(stepped)}
report(out)
""",
    "update_bn_of_a_model_on_device_two_over_batches_on_device_one": """
k1, k2 = jax.random.split(jax.random.key(0))
model = jax.device_put(ft.nn.Sequential(ft.nn.Dense(3, 8, key=k1), ft.nn.BatchNorm(8), ft.nn.Dense(8, 1, key=k2)), D[2])
out = {}
for name, batches in (("committed", [jax.device_put(b, D[1]) for b in BATCHES[:2]]), ("numpy", BATCHES[:2])):
    try:
        fresh = ft.nn.update_bn(model, batches)
    except ValueError as e:
        out[name] = str(e)
        continue
    out[name] = {"on": on(fresh), "values": values(fresh)}
report(out)
""",
    "generate_names_a_model_on_two_devices": """
config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 64}
model = jax.device_put(ft.nn.from_hf(config, key=jax.random.key(0)), D[2])
model = ft.set(model, "lm_head.weight", jax.device_put(model.lm_head.weight, D[1]))  # the head put apart
ids = np.random.default_rng(0).integers(2, 64, (2, 5)).astype(np.int32)
report({"greedy": error_of(lambda: ft.nn.generate(model, ids, 3, temperature=0.0)),
        "beams": error_of(lambda: ft.nn.generate(model, ids, 3, num_beams=2))})
""",
    "a_head_for_a_body_on_device_two_is_drawn_there": """
llama = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0}
bert = {"model_type": "bert", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 4}
ids = np.ones((2, 5), np.int32)
got = {}
for config, head in [(llama, "ForSequenceClassification"), (bert, "ForSequenceClassification"), (bert, "ForMaskedLM")]:
    body = jax.device_put(ft.nn.from_hf(config, key=jax.random.key(0)), D[2])
    if config is bert:  # a BertModel without its pooler: with_head draws one for the classifier
        body = body.replace(pooler=None)
    task = ft.hf.with_head(body, head, key=jax.random.key(1))
    path = tempfile.mkdtemp() + "/task"
    ft.train.save(path, task)
    back = ft.train.load(path, task)  # each array where the template's is
    got[config["model_type"] + head] = {"on": on(task), "restored": on(back),
                                        "jit": error_of(lambda: ft.jit(lambda m, x: m(x))(back, ids))}
report(got)
""",
}

NEEDS_DIRECTORY = {"checkpoints_of_device_3_and_a_mesh_of_4_land_on_the_template", "a_job_of_a_mesh_of_8_resumes_on_two_devices_and_on_one"}


@pytest.fixture(scope="module")
def eight(request, tmp_path_factory):
    """The reports of this run's selected scenarios (one 8-device subprocess), and the
    directory the checkpoint scenarios wrote into."""
    out = tmp_path_factory.mktemp("moving")
    sources = {name: (f"OUT = {str(out)!r}\n" if name in NEEDS_DIRECTORY else "") + src for name, src in SCENARIOS.items()}
    return selected_scenarios(request, COMMON, sources), out


def _flat(values):
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])


@pytest.mark.slow
def test_device_two_trains(eight):
    """train_step, ft.jit + opt.minimize and Trainer.fit on device 2: every result there,
    the numbers of device 0 bit for bit; a batch committed to device 0 is refused naming its
    key path and the device_put that fixes it."""
    got = part(eight[0], "device_two_trains")
    for name, run in got.items():
        assert run["same"], name
        assert all(where in ([2], []) for where in run["on"]) and run["on"][0] == [2], (name, run["on"])
        message = run["batch_on_zero"]
        assert "batch[0] on ['cpu:0']" in message or "b[0] on ['cpu:0']" in message, (name, message)
        assert "right:  " in message and "jax.devices()[2])" in message, (name, message)


@pytest.mark.slow
def test_a_model_moved_between_calls_of_one_step(eight):
    """A step called on device 2, then with the model and state put on device 5: it runs
    there, with the numbers of one device throughout. Without donation the step's own stop
    log stayed on device 2 (the loop's fast path checks only the donated arguments) and JAX's
    bare "incompatible devices ... donated[0] of _Program.__init__.<locals>.flat" came out."""
    got = part(eight[0], "a_model_moved_between_calls_of_one_step")
    for donate, run in got.items():
        assert run["on"] == [[5], [5], [5]] and run["same"], (donate, run)


@pytest.mark.slow
def test_leaves_on_two_devices_are_named(eight):
    """One leaf on device 1, the others on device 2: the step names both key paths as the
    model's own (it said the *arguments* differ, and showed a device_put of the whole model to
    device 1 as the wrong code); the Trainer refuses it (it moved the leaf to device 2 without a
    word, where the model's first leaf on the default device gave the step's error instead), and
    so does the optimizer's init."""
    got = part(eight[0], "leaves_on_two_devices_are_named")
    for name, message in got.items():
        assert "own arrays are committed to different devices" in message, (name, message)
        assert "layers[0].weight is on ['cpu:2']" in message and "layers[1].bias on ['cpu:1']" in message, message
        assert "'layers.1.bias'" in message and "jax.device_put(" in message, message
    assert got["trainer"].startswith("ft.train.Trainer: model's own arrays")
    assert "right:  model = jax.device_put(model, jax.devices()[2])" in got["trainer"]
    # the optimizer's init too (it put the stray leaf's moments on the first leaf's device: the
    # step refused them later)
    assert got["init"].startswith("ft.optim.Optimizer.init: model's own arrays"), got["init"]


@pytest.mark.slow
def test_trainer_model_set_on_another_device_is_refused(eight):
    """``trainer.model = jax.device_put(trainer.model, D[5])`` on a trainer of device 2 was
    put back on device 2 without a word; it is refused naming both devices and the move that
    works (save, restore into a trainer whose model is on device 5). NumPy, and a model read
    by ``ft.train.load`` without a template (on the default device), go where the job is."""
    got = part(eight[0], "trainer_model_set_on_another_device_is_refused")
    assert got["refused"].startswith("trainer.model = ...: its array model.layers[0].weight is committed to ['cpu:5']")
    assert "lives on ['cpu:2']" in got["refused"] and ".restore(path)" in got["refused"]
    assert "ft.train.load(path, trainer.model)" in got["refused"]
    assert got["still"] == [2] and got["after"] == [2] and got["loaded"] == [2]
    assert got["moved"] == [5] and got["steps"] == 6


@pytest.mark.slow
def test_checkpoints_of_device_3_and_a_mesh_of_4_land_on_the_template(eight):
    """Written on device 3, on a mesh of 4 (sharded) and by a Trainer's ModelCheckpoint on
    device 3: read onto a template on device 5 (and a trainer there) and here, on one device;
    the values bit for bit."""
    got, out = eight[0], eight[1]
    wrote = part(got, "checkpoints_of_device_3_and_a_mesh_of_4_land_on_the_template")
    assert wrote["written"] == [[3], [0, 1, 2, 3], [3]] and wrote["spec"] != "P()"
    assert wrote["tree"] == [5] and wrote["tree_same"] and wrote["wide"] == [5] and wrote["wide_same"]
    assert wrote["restored"] == [5] and wrote["steps"] == 8
    here = {jax.devices()[0]}
    k1, k2 = jax.random.split(jax.random.key(0))
    template = ft.nn.Sequential(ft.nn.Dense(3, 8, key=k1), ft.nn.Dense(8, 1, key=k2))
    for tree, want in ((ft.train.load(out / "tree3"), wrote["m3"]), (ft.train.load(out / "tree3", template), wrote["m3"]),
                       (ft.train.load(out / "mesh4"), wrote["wide_values"]),
                       (ft.train.CheckpointManager(out / "run3").restore(template=template).model, wrote["job"])):
        assert all(x.devices() == here for x in jax.tree.leaves(tree))
        np.testing.assert_array_equal(_flat(jax.tree.leaves(tree)), _flat(want))


@pytest.mark.slow
def test_a_job_of_a_mesh_of_8_resumes_on_two_devices_and_on_one(eight):
    """A job written on a mesh of 8 at step 8 and continued to step 16 on a mesh of 2, on the
    default device, and on device 5: the first 8 losses are the run's own (its history), the
    rest those of the uninterrupted run, to rounding (a mean over 8 shards against 2 or 1);
    the job here on one device too."""
    got, out = eight[0], eight[1]
    run = part(got, "a_job_of_a_mesh_of_8_resumes_on_two_devices_and_on_one")
    full = np.asarray(run["full"])
    assert len(full) == 16
    for name, resumed in run["resumed"].items():
        assert resumed["on"] == {"two": [0, 1], "one": [0], "five": [5]}[name], (name, resumed["on"])
        np.testing.assert_array_equal(resumed["loss"][:8], full[:8])
        np.testing.assert_allclose(resumed["loss"], full, rtol=0, atol=1e-5 * float(np.max(full)))
    trainer = ft.train.Trainer(_model(), ft.optim.Optimizer(ft.optim.adam(0.05)), _loss).restore(str(out / "run8"))
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    trainer.fit(ft.train.batches((x, y), 8, key=jax.random.key(3)), epochs=4, progress=False, log_every=1)
    np.testing.assert_allclose(trainer.history.steps["loss"], full, rtol=0, atol=1e-5 * float(np.max(full)))


def _model():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(3, 8, key=k1), ft.nn.Dense(8, 1, key=k2))


def _loss(model, batch):
    return jax.numpy.mean((model(batch[0]) - batch[1]) ** 2)


@pytest.mark.slow
def test_a_llama_on_device_two_generates_and_trains_lora(eight):
    """ft.nn.from_hf of a config, put on device 2: greedy and sampled generation (also with a key
    and ids committed to device 0, which JAX refused as incompatible devices) and two LoRA train
    steps run there, with device 0's tokens, loss and adapters bit for bit."""
    got = part(eight[0], "a_llama_on_device_two_generates_and_trains_lora")
    assert all(where == [2] for where in got["on"]), got["on"]
    assert all(got["same"].values()), got["same"]


@pytest.mark.slow
def test_data_parallel_over_4_of_8_then_one_device(eight):
    """Two steps data parallel over devices 0-3 (replicated and fsdp), a step of a plain
    train_step on the mesh's arrays, one more after putting model and state on device 6, and a
    Trainer there: the plain run's losses to rounding, every result on device 6 (a step whose
    program another step of this loss had made, donating only its stop log, raised JAX's bare
    "incompatible devices" error after the move: the log stayed on the mesh)."""
    got = part(eight[0], "data_parallel_over_4_of_8_then_one_device")
    for rules, run in got.items():
        assert run["on"] == [[6], [6], [6]], (rules, run["on"])
        np.testing.assert_allclose(run["losses"], run["reference"], rtol=0, atol=1e-5 * max(run["reference"]))
    assert got["fsdp"]["sharding"] == "SingleDeviceSharding"  # (it was P(None, 'data') on the mesh)


@pytest.mark.slow
def test_an_eager_optimizer_names_a_state_on_another_device(eight):
    """``opt.update`` / ``opt.minimize`` called eagerly with the state, the gradients or the
    batch committed to device 1 and the model to device 2 name the argument's key path and the
    ``jax.device_put`` that fixes it (they raised JAX's bare "Received incompatible devices for
    jitted computation" of a ``multiply`` or a ``matmul`` inside the optimizer or the loss)."""
    got = part(eight[0], "an_eager_optimizer_names_a_state_on_another_device")
    for name, other in (("update", "state.context.counters"), ("grads", "grads.layers[0].weight"), ("minimize", "batch[0]")):
        message = got[name]
        call = "minimize" if name == "minimize" else "update"
        assert message.startswith(f"ft.optim.Optimizer.{call}: its arguments are committed to different devices"), message
        assert f"model.layers[0].weight is on ['cpu:2'], {other} on ['cpu:1']" in message, message
        argument = other.split(".")[0].split("[")[0]
        assert f"right:  {argument} = jax.device_put({argument}, jax.devices()[2])" in message, message


@pytest.mark.slow
def test_a_learning_rate_from_another_device_is_set(eight):
    """``ft.optim.set_hyperparameters(state, learning_rate=rate)`` with the state on device 2 and
    ``rate`` an array committed to device 1 (read from another job's state): the rate goes to
    the state's device and the step's numbers are those of the same rate given as a number (it
    raised JAX's bare "Received incompatible devices for jitted computation" of
    ``_set_columns``, where an ``optax.inject_hyperparams`` state took the value)."""
    got = part(eight[0], "a_learning_rate_from_another_device_is_set")
    assert isinstance(got["committed"], dict), got["committed"]
    assert got["committed"]["on"] == got["number"]["on"] == [[2], [2]]
    assert got["committed"]["values"] == got["number"]["values"]


@pytest.mark.slow
def test_update_bn_of_a_model_on_device_two_over_batches_on_device_one(eight):
    """``ft.nn.update_bn(model, batches)`` of a model on device 2 over ``(x, y)`` batches
    committed to device 1 (torch's ``update_bn(loader, model, device=)`` moves them): the
    statistics of the same batches given as NumPy, on device 2 (it raised JAX's bare "Received
    incompatible devices for jitted computation" of ``_recorded``)."""
    got = part(eight[0], "update_bn_of_a_model_on_device_two_over_batches_on_device_one")
    assert isinstance(got["committed"], dict), got["committed"]
    assert got["committed"]["on"] == got["numpy"]["on"] == [2]
    assert got["committed"]["values"] == got["numpy"]["values"]


@pytest.mark.slow
def test_generate_names_a_model_on_two_devices(eight):
    """``ft.nn.generate`` of a Llama on device 2 whose ``lm_head`` was set from an array on
    device 1 names both key paths and the ``jax.device_put`` of the whole model
    (``LEAVES_ON_DEVICES``, as ``ft.jit``, the train step and the Trainer do); it raised JAX's
    bare "Received incompatible devices for jitted computation" of ``generate_loop``."""
    got = part(eight[0], "generate_names_a_model_on_two_devices")
    for name, message in got.items():
        assert message.startswith("ft.nn.generate: model's own arrays are committed to different devices"), (name, message)
        assert "model.model.embed_tokens.embeddings is on ['cpu:2'], model.lm_head.weight on ['cpu:1']" in message, message
        assert "right:  model = jax.device_put(model, jax.devices()[2])" in message, message


@pytest.mark.slow
def test_a_head_for_a_body_on_device_two_is_drawn_there(eight):
    """``ft.hf.with_head`` of a body on device 2 (a Llama's score, BERT's classifier with the
    pooler it draws, BERT's masked-LM head): the new head was made on the default device, so
    a checkpoint restored onto the task model put it on device 0 beside a body on device 2,
    and ``ft.jit`` refused the model as split over two devices. Now the head is drawn where
    the body lives."""
    got = part(eight[0], "a_head_for_a_body_on_device_two_is_drawn_there")
    for name, run in got.items():
        assert run == {"on": [2], "restored": [2], "jit": "no error"}, (name, run)
