"""The data-parallel step on 8 simulated CPU devices (each test runs in a subprocess).

8 devices = 1 device: the same MLP trained STEPS Adam steps on batches of 64 ends with the
same parameters as one device on the full batch, with parameters and optimizer state
replicated, sharded by "fsdp", or sharded by a rules mapping (and STEPS SGD steps, its
momentum sharded by "fsdp").

Also here, so that no file starts an 8-device process of its own: an ft.nn.Stack trained
under FSDP and tensor parallel (from test_nn_stack.py) and a Trainer's short last minibatch
named at any steps_per_call (from test_train_short_batches.py).

The 8-device scenarios are independent claims; one subprocess (one start-up, shared compiled
programs) computes those of the selected tests, each test asserts on its own part.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import part, selected_scenarios
from _tolerance import assert_close_trained, needs_float16_conversions

import functree as ft
from functree.parallel import DataParallelStep
from functree.parallel._placement import SHORT_LAST_BATCH

# The largest scaled_error (tests/_tolerance.py) measured between 8 devices and 1 under the four
# XLA CPU instruction sets (6.8e-7 over STEPS = 5 steps, 8.4e-7 over 20); the comparisons allow
# MARGIN times it.
SPREAD_8_VS_1 = 1e-6
# Training steps of the 8-vs-1 comparisons: a few show the claim as well as 20 (each step on 8
# simulated devices is most of a scenario's time).
STEPS = 5

COMMON = f"SPREAD_8_VS_1 = {SPREAD_8_VS_1!r}\nSTEPS = {STEPS!r}\n" + """
import sys; sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
import functree as ft
from _tolerance import assert_close_trained, scaled_error
from jax.sharding import PartitionSpec as P
from functree.parallel import DataParallelStep

assert len(jax.devices()) == 8
mesh = jax.make_mesh((8,), ("data",))

@jax.jit  # one program builds each fresh copy (eager, every initializer compiles apart)
def mlp():
    k = jax.random.split(jax.random.key(0), 3)
    return ft.nn.Sequential(ft.nn.Dense(16, 128, jax.nn.relu, key=k[0]),
                            ft.nn.Dense(128, 64, jax.nn.relu, key=k[1]), ft.nn.Dense(64, 4, key=k[2]))

def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)), logits

rng = np.random.default_rng(0)
xs = rng.normal(size=(20, 64, 16)).astype(np.float32)
ys = rng.integers(0, 4, size=(20, 64)).astype(np.int32)

def train(step, opt, steps=STEPS):
    model = mlp()
    state = opt.init(model)
    for i in range(steps):
        model, state, metrics = step(model, state, (xs[i], ys[i]))
    return model, state, metrics
"""


# The 8-device scenarios, by test name (without test_); each ends with report(...).
SCENARIOS = {
    'aux_rows_merge_and_what_cannot_be_combined_is_refused': """
def aux_loss(kind):
    def loss(model, batch):
        x, y = batch
        logits = model(x)
        per = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]
        aux = {"rows": per, "mean": jnp.mean(jnp.abs(logits))}
        if kind == "count":
            aux["correct"] = jnp.sum(jnp.argmax(logits, -1) == y)
        if kind == "table":  # per-class summed loss: 4 numbers, whatever the batch
            aux["table"] = jax.ops.segment_sum(per, y, num_segments=4)
        return jnp.mean(per), aux
    return loss

metrics = {"rows": lambda o: jnp.mean(o.aux["rows"]), "mean": lambda o: o.aux["mean"]}
res = {}
for name, where in (("one", None), ("eight", mesh)):
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(aux_loss("plain"), opt, metrics=metrics, mesh=where, on_nan="ignore")
    res[name] = {k: float(v) for k, v in step(mlp(), opt.init(mlp()), (xs[0], ys[0]))[2].items()}
for kind, rows in (("count", 64), ("table", 64), ("table", 32)):  # 32 rows: 4 per device, as the table's 4
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(aux_loss(kind), opt, mesh=mesh, on_nan="ignore")
    try:
        step(mlp(), opt.init(mlp()), (xs[0][:rows], ys[0][:rows]))
        res[f"{kind}{rows}"] = "no error"
    except ValueError as e:
        res[f"{kind}{rows}"] = str(e)
weighted = lambda m, b: jnp.mean(aux_loss("plain")(m, b[:2])[1]["rows"] * b[2][b[1]])
opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
try:  # per-class weights (4,) beside 64 examples: each device read a slice of them
    ft.train.train_step(weighted, opt, mesh=mesh, on_nan="ignore")(mlp(), opt.init(mlp()), (xs[0], ys[0], np.ones(4, np.float32)))
    res["mixed"] = "no error"
except ValueError as e:
    res["mixed"] = str(e)
report(res)
""",
    'an_equinox_model_trains_on_a_mesh_and_with_accumulation': """
import jax, numpy as np, equinox as eqx
import functree as ft
mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
# holds jax.nn.relu as a leaf; built in one program (eagerly, each initializer compiled apart)
model = eqx.filter_jit(lambda: eqx.nn.MLP(4, 3, 16, 1, key=jax.random.key(1)))()
def loss_fn(m, b):
    return ft.losses.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])
rng = np.random.default_rng(0)
xs, ys = rng.normal(size=(3, 8, 4)).astype(np.float32), rng.integers(0, 3, size=(3, 8)).astype(np.int32)
res = {}
for name, where, k in (("plain", None, 1), ("mesh", mesh, 1), ("accumulate", None, 2), ("both", mesh, 2)):
    opt = ft.optim.Optimizer(ft.optim.sgd(0.5), accumulate=k)
    step = ft.train.train_step(loss_fn, opt, donate=False, mesh=where)
    m, s, losses = model, opt.init(model), []
    for i in range(3):
        m, s, metrics = step(m, s, (xs[i], ys[i]))
        losses.append(float(metrics["loss"]))
    res[name] = {"losses": losses, "weights": [np.asarray(layer.weight).ravel().tolist() for layer in m.layers]}
report(res)
""",
    'eight_devices_equal_one_device_replicated_fsdp_and_rules': """
rules = {"layers.1.weight": P("data", None), "layers.0.weight": P(None, "data"), "layers.2.weight": P("data"),
         "layers.*": P()}
res = {}
# Adam under each sharding; SGD's momentum (another state) under "fsdp", where it is sharded
# (each pair compiles its own 8-device step, the most of this scenario's time).
for name, make, shardings in [("sgd", lambda: ft.optim.sgd(0.1, momentum=0.9), ["fsdp"]),
                              ("adam", lambda: ft.optim.adam(1e-2), [None, "fsdp", rules])]:
    opt = ft.optim.Optimizer(make())
    ref, ref_state, ref_metrics = train(ft.train.train_step(loss_fn, opt), opt)
    for sharding in shardings:
        step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding=sharding)
        model, state, metrics = train(step, opt)
        assert_close_trained(model, ref, spread=SPREAD_8_VS_1)
        assert_close_trained(metrics["loss"], ref_metrics["loss"], spread=SPREAD_8_VS_1)
        ctx = ft.optim.context(state)
        res[f"{name}-{sharding if isinstance(sharding, (str, type(None))) else 'rules'}"] = {
            "samples": int(ctx.samples_seen),
            "sharded": [not x.sharding.is_fully_replicated for x in jax.tree.leaves(model)],
            "moments_sharded": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state)),
        }
report(res)
""",
    'custom_sum_aggregator_and_per_replica_clipping': """
model = mlp()
batch = (xs[0], ys[0])
def one_step(opt, model=model):
    step = DataParallelStep(loss_fn, opt, mesh=mesh, donate=False)
    new, _, _ = step(model, opt.init(model), batch)
    return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, model)

psum = lambda g: jax.tree.map(lambda x: jax.lax.psum(x, "data"), g)
seen = []
def spy(g):
    seen.append(str(jax.typeof(jax.tree.leaves(g)[0])))
    return psum(g)
default = one_step(ft.optim.Optimizer(ft.optim.sgd(0.1)))
named = one_step(ft.optim.Optimizer(ft.optim.sgd(0.1), axis_name="data"))
summed = one_step(ft.optim.Optimizer(ft.optim.sgd(0.1), aggregate_gradients=spy))
ratio = [float(np.max(np.abs(s - 8 * d))) for s, d in zip(jax.tree.leaves(summed), jax.tree.leaves(default))]
same = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(default))]

# per-replica clipping: each device clips its own gradient before the mean
c = 1e-3
clip = lambda g: jax.tree.map(lambda x: jnp.clip(x, -c, c), g)
clipped = one_step(ft.optim.Optimizer(ft.optim.sgd(1.0), transform_unaggregated_gradients=clip))
# clipped in the gradient's program and averaged in NumPy (the same float32 operations): eager
# JAX compiled a clip, add, negative and divide for each leaf's shape, 30 programs
clipped_grad = jax.jit(lambda b: clip(ft.gradient(lambda m: loss_fn(m, b)[0], at=model)))
numpy = lambda tree: jax.tree.map(np.asarray, tree)
per_device = [numpy(clipped_grad((xs[0][8 * i: 8 * i + 8], ys[0][8 * i: 8 * i + 8]))) for i in range(8)]
expected = jax.tree.map(lambda *g: -sum(g) / np.float32(8), *per_device)
after_mean = jax.tree.map(lambda g: -g, numpy(clipped_grad(batch)))
err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(expected)))
differs = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(after_mean)))
report({"ratio": ratio, "same": same, "seen": seen[0], "clip_err": err, "clip_differs": differs,
        "scale": max(float(np.max(np.abs(d))) for d in jax.tree.leaves(default))})
""",
    'indivisible_batch_bfloat16_master_parameters_eval_and_trainer': """
opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
step = DataParallelStep(loss_fn, opt, mesh=mesh)
model = mlp()
try:
    step(model, opt.init(model), (xs[0][:60], ys[0][:60]))
    error = ""
except ValueError as e:
    error = str(e)
# accumulate=8 on 8 devices: 32 examples split over the devices (4 each), not into 8 microbatches
eight = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=8)
try:
    DataParallelStep(loss_fn, eight, mesh=mesh)(model, eight.init(model), (xs[0][:32], ys[0][:32]))
    accumulate_error = ""
except ValueError as e:
    accumulate_error = str(e)
half = DataParallelStep(loss_fn, opt, mesh=mesh, compute_dtype=jnp.bfloat16)
m16, s16, metrics16 = train(half, opt)
m32, s32, metrics32 = train(DataParallelStep(loss_fn, opt, mesh=mesh), opt)
# evaluation and the Trainer on the mesh: the same numbers as on one device
evaluate = ft.parallel.DataParallelEvalStep(loss_fn, mesh=mesh, sharding="fsdp", metrics=[ft.train.accuracy])
plain = ft.train.eval_step(loss_fn, metrics=[ft.train.accuracy])
ev8, ev1 = evaluate(m32, (xs[1], ys[1])), plain(m32, (xs[1], ys[1]))
trainers = [ft.train.Trainer(mlp(), opt, loss_fn, train_step=s) for s in
            (None, DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp"))]
for t in trainers:
    t.fit((xs[:4].reshape(-1, 16), ys[:4].reshape(-1)), batch_size=64, epochs=2, progress=False)
assert_close_trained(trainers[1].model, trainers[0].model, spread=SPREAD_8_VS_1, err_msg="Trainer")
# a dataset whose last batch the 8 devices cannot split (100 = 64 + 36): evaluated whole
val = (xs[1:3].reshape(-1, 16)[:100], ys[1:3].reshape(-1)[:100])
short8 = ft.train.Trainer(m32, opt, loss_fn, mesh=mesh, sharding="fsdp").evaluate(val, batch_size=64)
short1 = ft.train.Trainer(m32, opt, loss_fn).evaluate(val, batch_size=64)
assert_close_trained(short8["loss"], short1["loss"], spread=SPREAD_8_VS_1, err_msg="short last batch")
assert_close_trained(evaluate(m32, (xs[1][:60], ys[1][:60]))["loss"], plain(m32, (xs[1][:60], ys[1][:60]))["loss"],
                     spread=SPREAD_8_VS_1, err_msg="eval step, 60 examples")
report({"error": error, "accumulate_error": accumulate_error,
        "eval": [float(ev8["loss"]), float(ev1["loss"]), float(ev8["accuracy"]), float(ev1["accuracy"])],
        "trainer_sharded": not trainers[1].model.layers[0].weight.sharding.is_fully_replicated,
        "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves((m16, s16)) if jnp.issubdtype(x.dtype, jnp.floating)}),
        "loss16": float(metrics16["loss"]), "loss32": float(metrics32["loss"]),
        "rel": scaled_error(m16, m32)})
""",
    'two_dimensional_mesh_data_and_tensor_parallel_equals_one_device': """
mesh2 = jax.make_mesh((4, 2), ("data", "model"))
rules = {"layers.0.weight": P("data", "model"), "layers.0.bias": P("model"),   # column-parallel
         "layers.1.weight": P("model", "data"), "layers.*": P()}               # row-parallel
opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
ref, _, ref_metrics = train(ft.train.train_step(loss_fn, opt), opt)
step = ft.train.TrainStep(loss_fn, opt, mesh=mesh2, sharding=rules)
model, state, metrics = train(step, opt)
report({"diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref))),
        "loss": [float(metrics["loss"]), float(ref_metrics["loss"])],
        "specs": [str(x.sharding.spec) for x in jax.tree.leaves(model)],
        "samples": int(ft.optim.context(state).samples_seen)})
""",
    'several_keys_on_a_mesh_differ_per_device_where_documented_and_match_the_step_by_hand': """
import jax, jax.numpy as jnp, numpy as np
import functree as ft

@jax.jit  # one program builds each fresh copy (eager, every initializer compiles apart)
def make():
    k = jax.random.split(jax.random.key(0), 3)
    lora = ft.nn.LoraDense(ft.nn.Dense(8, 1, key=k[1]), rank=2, dropout=0.5, key=k[2])
    lora = lora.replace(lora_b=jnp.full((2, 1), 0.5))  # the adapter (its stored-key dropout) counts from step 1
    return ft.nn.training(ft.nn.Sequential(ft.nn.Dense(3, 8, jax.nn.relu, key=k[0]), ft.nn.Dropout(0.5), lora))

def noise(keys):  # each example's augmentation noise, from its own key in the batch
    return jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys)

def loss_fn(model, batch, *, key, lora_key=None):
    x, y, keys = batch
    h = model.layers[0](x + 0.1 * noise(keys))
    mask = model.layers[1](jnp.ones_like(h), key=key)  # the step key's dropout mask (0 or 2)
    out = model.layers[2](h * mask, key=lora_key)  # the adapter's mask: from its stored dropout_key
    return jnp.mean((out - y) ** 2), {"mask": mask, "noise": noise(keys), "out": out}

def by_hand(devices, k):
    # The mesh step's loss, unmeshed: microbatch j of device i's share with the step key
    # fold_in(fold_in(key, j), i) and the adapter's stored key salted with j, then i (on one
    # device the step key with 0, the stored key not at all); the key it records, unsalted.
    def loss(model, batch, *, key):
        lora = model.layers[2]
        drawn, following = jax.random.split(jax.random.wrap_key_data(lora.dropout_key))
        ft.nn.record_state(lora, dropout_key=jax.random.key_data(following))
        n, parts = batch[0].shape[0] // (devices * k), []
        for i in range(devices):
            for j in range(k):
                part = jax.tree.map(lambda a: a[(i * k + j) * n:(i * k + j + 1) * n], batch)
                step_key, stored = (key, drawn) if k == 1 else (jax.random.fold_in(key, j), jax.random.fold_in(drawn, j))
                stored = stored if devices == 1 else jax.random.fold_in(stored, i)
                parts.append(loss_fn(model, part, key=jax.random.fold_in(step_key, i), lora_key=stored))
        return (sum(p[0] for p in parts) / len(parts), jax.tree.map(lambda *a: jnp.concatenate(a), *[p[1] for p in parts]))
    return loss

def fingerprint(a):  # one number per minibatch that tells its rows apart
    return jnp.sum(a * jnp.arange(1, a.size + 1, dtype=a.dtype).reshape(a.shape))

half = lambda a, i: a[i * (len(a) // 2):(i + 1) * (len(a) // 2)]
METRICS = {name: (lambda o, name=name: fingerprint(o.aux[name])) for name in ("mask", "noise", "out")}
METRICS.update({name + "_alike": (lambda o, name=name: jnp.all(half(o.aux[name], 0) == half(o.aux[name], 1)).astype(jnp.float32))
                for name in ("mask", "noise", "out")})

rng = np.random.default_rng(0)
rows = rng.normal(size=(4, 3)).astype(np.float32)
x = np.concatenate([rows, rows])  # the replicas' rows alike: only their keys tell their masks apart
y = rng.normal(size=(8, 1)).astype(np.float32)
row_keys = jax.random.split(jax.random.key(7), 4)
keys = jnp.concatenate([row_keys, row_keys])  # each example's own key: the same wherever it lands
res = {}
for devices, sharding, k in ((1, None, 1), (2, None, 1), (2, "fsdp", 2)):
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=k, wrt="*")
    ref_opt = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="*")
    step = ft.train.TrainStep(loss_fn, opt, mesh=mesh, sharding=sharding, donate=False, metrics=METRICS)
    plain = ft.train.TrainStep(by_hand(devices, k), ref_opt, donate=False, metrics=METRICS)
    a = b = make()
    sa, sb = opt.init(a), ref_opt.init(b)
    got = []
    for _ in range(2):  # the second step draws from the stored key the first recorded
        a, sa, ma = step(a, sa, (x, y, keys), jax.random.key(3))
        b, sb, mb = plain(b, sb, (x, y, keys), jax.random.key(3))
        got.append({n: [float(ma[n]), float(mb[n])] for n in ma})
    res[f"{devices}-{sharding}-{k}"] = {
        "metrics": got, "stored": [np.asarray(m.layers[2].dropout_key).tolist() for m in (a, b)],
        "params": [[np.asarray(u, np.float32).tolist(), np.asarray(v, np.float32).tolist()]
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if jnp.issubdtype(u.dtype, jnp.floating)]}
report(res)
""",
    'a_data_axis_of_one_device_beside_a_model_axis_trains_as_one_device': """
import numpy as np, jax.numpy as jnp, functree as ft
from jax.sharding import PartitionSpec as P
@jax.jit  # one program builds each fresh copy (eager, every initializer compiles apart)
def make():
    k = jax.random.split(jax.random.key(0), 2)
    return ft.nn.training(ft.nn.Sequential(ft.nn.Dense(6, 8, jax.nn.relu, key=k[0]), ft.nn.BatchNorm(8),
                                           ft.nn.Dropout(0.25), ft.nn.Dense(8, 2, key=k[1])))
def loss_fn(model, batch, *, key):
    return jnp.mean((model(batch[0], key=key) - batch[1]) ** 2)
rules = {"layers.0.weight": P(None, "model"), "layers.0.bias": P("model"), "layers.3.weight": P("model", None),
         "layers.*": P()}
rng = np.random.default_rng(0)
batches = [(rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)) for _ in range(2)]
opt = ft.optim.Optimizer(ft.optim.adam(1e-2), accumulate=2)
models = []
for mesh, sharding in [(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), None),
                       (jax.make_mesh((1, 2), ("data", "model"), devices=jax.devices()[:2]), rules)]:
    step = ft.train.TrainStep(loss_fn, opt, mesh=mesh, sharding=sharding)
    model = make()
    state = opt.init(model)
    for b in batches:
        model, state, metrics = step(model, state, b, jax.random.key(3))
    models.append(model)
report({"diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(models[0]), jax.tree.leaves(models[1]))),
        "spec": str(models[1].layers[0].weight.sharding.spec),
        "moved": float(np.max(np.abs(np.asarray(models[1].layers[1].running_mean))))})
""",
    'short_last_minibatch_named_at_any_steps_per_call': """
rng = np.random.default_rng(0)
x = rng.normal(size=(44, 3)).astype(np.float32)
y = rng.normal(size=(44, 1)).astype(np.float32)
loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
out = {"x": x.tolist(), "y": y.tolist()}
for k in (1, 2):
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    out["start"] = [np.asarray(model.weight).tolist(), np.asarray(model.bias).tolist()]
    t = ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.sgd(0.1)), loss_fn, mesh=mesh, steps_per_call=k)
    try:
        t.fit([(x[i:i + 16], y[i:i + 16]) for i in range(0, 44, 16)], 1, progress=False)
        out[k] = None
    except ValueError as e:
        out[k] = [str(e), t.steps_run, np.asarray(t.model.weight).tolist(), np.asarray(t.model.bias).tolist()]
report(out)
""",
    'a_stack_on_fsdp_and_tensor_parallel_meshes_equals_one_device': """
import jax.numpy as jnp, numpy as np
import functree as ft
from jax.sharding import PartitionSpec as P

import sys; sys.path.insert(0, "tests")
from test_nn_stack import Block  # the Stack tests' residual block

def loss_fn(m, batch):
    x, y = batch
    return jnp.mean((m(x) - y) ** 2)

rng = np.random.default_rng(0)
xs = rng.normal(size=(4, 64, 32)).astype(np.float32)
ys = rng.normal(size=(4, 64, 32)).astype(np.float32)

# one program builds each fresh copy (eager, every initializer compiles apart)
build = jax.jit(lambda: ft.nn.Stack(lambda k: Block(32, key=k), 8, key=jax.random.key(0), remat=True))

def train(**kw):
    m = build()
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    step, s = ft.train.train_step(loss_fn, opt, **kw), opt.init(m)
    for i in range(4):
        m, s, _ = step(m, s, (xs[i], ys[i]))
    return m

one = train()
fsdp = train(mesh=jax.make_mesh((8,), ("data",)), sharding="fsdp")
tp = train(mesh=jax.make_mesh((4, 2), ("data", "model")),
           sharding={"*.up.weight": P(None, "model"), "*.down.weight": P("model", None)})
def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
report({"fsdp": diff(fsdp, one), "tp": diff(tp, one),
        "scale": max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(one)),
        "fsdp_spec": str(fsdp.layers.up.weight.sharding.spec), "tp_spec": str(tp.layers.up.weight.sharding.spec)})
""",
    'a_global_norm_clip_sees_the_whole_batchs_gradient_and_weighted_counts_once': """
import optax
mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
def clip(g):  # torch's clip_grad_norm_(params, 0.05) after DDP's all-reduce
    factor = jnp.minimum(1.0, 0.05 / optax.tree.norm(g))
    return jax.tree.map(lambda x: x * factor, g)
pad = ys[:4].copy()
pad[:, ::3] = -100  # padding: 6, 5, 5, 6 of each device's 16 labels
losses = {"mean": lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1]),
          "weighted": lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1], reduction="weighted")}
res = {}
class Logged(ft.optim.Optimizer):  # an override that keeps the default aggregation
    def aggregate_gradients(self, grads):
        return super().aggregate_gradients(jax.tree.map(lambda g: g * 1.0, grads))
kinds = {None: ft.optim.Optimizer, "data": ft.optim.Optimizer, "super": Logged, "as_given": ft.optim.Optimizer}
for name, where, axis in (("mean", None, None), ("mean", mesh4, None), ("weighted", None, None),
                          ("weighted", mesh4, None), ("weighted", mesh4, "data"), ("mean", mesh4, "super"),
                          ("weighted", mesh4, "super"), ("mean", mesh4, "as_given"), ("weighted", mesh4, "as_given")):
    given = {"aggregate_gradients": lambda g: g} if axis == "as_given" else {}  # left to the step
    opt = kinds[axis](ft.optim.sgd(0.5), transform_gradients=clip, axis_name="data" if axis == "data" else None,
                      **given)
    step = ft.train.train_step(losses[name], opt, mesh=where, donate=False)
    labels = pad if name == "weighted" else ys  # (a mean over padded labels weighs each device's own count)
    model, state = mlp(), opt.init(mlp())
    for i in range(3):
        model, state, _ = step(model, state, (xs[i], labels[i]))
    # the weighted loss's count (a program of its own: compiled for the weighted cases alone)
    count = (float(jax.jit(lambda m, s, b: step.apply(m, s, b)[2])(model, state, (xs[3], labels[3])).count)
             if name == "weighted" else None)
    res[f"{name}-{where is not None}-{axis}"] = {
        "weights": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(model)], "count": count}
# In a user's own shard_map the custom aggregation is trusted: what it leaves varying may be a
# shard (FSDP's psum_scatter), and reaches transform_gradients as it is.
from functree.optim._replicas import varying_axes
seen = []
def spy(g):
    seen.append(all("data" in varying_axes(x) for x in jax.tree.leaves(g)))
    return g
own = ft.optim.Optimizer(ft.optim.sgd(0.5), axis_name="data", aggregate_gradients=lambda g: g, transform_gradients=spy)
m0 = mlp()
def per_device(xb, yb):
    m = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), m0)
    return own.compute_gradients(losses["mean"], m, (xb, yb))[1]
split = lambda a: jax.device_put(a, jax.NamedSharding(mesh4, jax.P("data")))
# jitted: one program (eager, shard_map ran each of the step's operations as a program of its own,
# 81 of them); the spy sees the same traced gradients either way
jax.jit(jax.shard_map(per_device, mesh=mesh4, in_specs=(jax.P("data"), jax.P("data")), out_specs=jax.P("data")))(
    split(xs[0]), split(ys[0]))
res["own_shard_map_varying"] = seen
report(res)
""",
}


# The README's `--dist loadfile` runs a module's tests on one pytest-xdist worker, so this
# module fixture starts its subprocess once per run.
@pytest.fixture(scope="module")
def eight_devices(request):
    """The reports of this run's selected scenarios, from one 8-device subprocess."""
    return selected_scenarios(request, COMMON, SCENARIOS)


@pytest.mark.slow
def test_eight_devices_equal_one_device_replicated_fsdp_and_rules(eight_devices):
    out = part(eight_devices, 'eight_devices_equal_one_device_replicated_fsdp_and_rules')
    for key, r in out.items():
        assert r["samples"] == STEPS * 64, key  # the learning context counts the global batch
    assert not any(out["adam-None"]["sharded"]) and out["adam-None"]["moments_sharded"] == 0
    # fsdp: 16x128 and 128x64 weights sharded, the 64x4 weight and the biases replicated
    assert out["adam-fsdp"]["sharded"] == [True, False, True, False, False, False]  # (weight, bias) x 3
    assert out["adam-fsdp"]["moments_sharded"] == 4  # mu and nu of both large weights
    assert out["sgd-fsdp"]["moments_sharded"] == 2  # the momentum of both
    assert out["adam-rules"]["sharded"] == [True, False, True, False, True, False]
    assert out["adam-rules"]["moments_sharded"] == 6


@pytest.mark.slow
def test_custom_sum_aggregator_and_per_replica_clipping(eight_devices):
    out = part(eight_devices, 'custom_sum_aggregator_and_per_replica_clipping')
    assert max(out["ratio"]) <= 1e-6 * max(out["scale"], 1.0) * 8  # summed = 8 x mean, to rounding
    assert max(out["same"]) == 0.0  # axis_name="data" or None: the same mean
    assert "{V:data}" in out["seen"]  # the aggregator saw per-device (varying) gradients
    assert out["clip_err"] < 1e-6  # clip threshold 1e-3: every update is at most 1e-3
    assert out["clip_differs"] > 1e-4  # clipping before the mean is not clipping after it


@pytest.mark.slow
def test_indivisible_batch_bfloat16_master_parameters_eval_and_trainer(eight_devices):
    out = part(eight_devices, 'indivisible_batch_bfloat16_master_parameters_eval_and_trainer')
    assert "60 examples" in out["error"] and "8 devices of mesh axis 'data'" in out["error"]
    assert "batch_size=56, drop_last=True" in out["error"]
    # accumulate on a mesh: named by the global batch and devices x k (it named one device's
    # share, (4, 16), and a fix that kept the 32 examples)
    assert "multiple of 8 x 8 = 64" in out["accumulate_error"] and "has 32 examples" in out["accumulate_error"]
    assert "batch_size=64, drop_last=True" in out["accumulate_error"] and "accumulate=4" in out["accumulate_error"]
    assert out["dtypes"] == ["float32"]  # master parameters and Adam state stay float32
    assert abs(out["loss16"] - out["loss32"]) < 0.05 * out["loss32"]
    assert out["rel"] > 0  # it did compute in bfloat16
    loss8, loss1, acc8, acc1 = out["eval"]
    assert_close_trained(loss8, loss1, spread=SPREAD_8_VS_1)
    assert acc8 == acc1
    assert out["trainer_sharded"]  # Trainer(train_step=DataParallelStep): compared in the subprocess


def test_missing_data_axis_names_the_mesh_axes():
    mesh = jax.make_mesh((1,), ("batch",))
    with pytest.raises(ValueError, match=r"no axis 'data'; its axes are \('batch',\)"):
        DataParallelStep(lambda m, b: jnp.mean(b), ft.optim.sgd(0.1), mesh=mesh)
    step = DataParallelStep(lambda m, b: jnp.mean(b * m["w"]), ft.optim.sgd(0.1), mesh=mesh, data_axis="batch")
    model, _, metrics = step({"w": jnp.ones(())}, ft.optim.Optimizer(ft.optim.sgd(0.1)).init({"w": jnp.ones(())}),
                             jnp.arange(4.0))
    assert float(metrics["loss"]) == 1.5 and float(model["w"]) == pytest.approx(1 - 0.1 * 1.5)


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    return (x[:1440], y[:1440]), (x[1440:], y[1440:])


def _digits_run(opt, compute_dtype):
    (xtr, ytr), (xte, yte) = _digits()
    model = _digits_mlp()

    def loss_fn(model, batch):
        x, y = batch
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(model(x)), y[:, None], axis=1))

    step = DataParallelStep(loss_fn, opt, mesh=jax.make_mesh((1,), ("data",)), compute_dtype=compute_dtype)
    state = opt.init(model)
    for _ in range(8):
        for batch in ft.train.batches((xtr, ytr), 64, drop_last=True):
            model, state, _ = step(model, state, batch)
    accuracy = float(_test_accuracy(model, xte, yte))
    return model, state, accuracy


# The model built and the test set scored in one program each (eager, each of their
# operations compiled apart): the same operations on the same arrays.
@jax.jit
def _digits_mlp():
    k = jax.random.split(jax.random.key(0), 2)
    return ft.nn.Sequential(ft.nn.Dense(64, 128, jax.nn.relu, key=k[0]), ft.nn.Dense(128, 10, key=k[1]))


@jax.jit
def _test_accuracy(model, x, y):
    return jnp.mean(jnp.argmax(model(x), -1) == y)


@pytest.mark.slow
@needs_float16_conversions
def test_bfloat16_digits_within_one_point_and_float16_with_loss_scaling():
    _, _, acc32 = _digits_run(ft.optim.Optimizer(ft.optim.adam(3e-3)), None)
    model, state, acc16 = _digits_run(ft.optim.Optimizer(ft.optim.adam(3e-3)), jnp.bfloat16)
    assert acc32 > 0.85 and abs(acc16 - acc32) <= 0.01
    floats = [x for x in jax.tree.leaves((model, state)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.adam(3e-3)), initial_scale=2.0**20)
    model, state, acc_half = _digits_run(opt, jnp.float16)
    assert int(state.skipped) >= 1  # 2^20 overflows float16 at first: those steps were skipped
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(model))  # (NumPy: no program per shape)
    assert acc_half > 0.85


def test_layer_state_and_keys_on_a_one_device_mesh():
    @jax.jit  # one program (eager, each initializer's operations compiled apart)
    def build():
        k = jax.random.split(jax.random.key(0), 2)
        return ft.nn.training(ft.nn.Sequential(ft.nn.Dense(4, 8, key=k[0]), ft.nn.BatchNorm(8), ft.nn.Dropout(0.5),
                                               ft.nn.Dense(8, 1, key=k[1])))

    model = build()

    def loss_fn(model, batch, *, key=None):
        return jnp.mean((model(batch[0], key=key) - batch[1]) ** 2)

    # NumPy builds the batch (the same float32 numbers as jnp's: no program per operation)
    x, y = np.arange(32.0, dtype=np.float32).reshape(8, 4) / np.float32(32), np.ones((8, 1), np.float32)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = DataParallelStep(loss_fn, opt, donate=False)  # mesh=None: the default device
    new, _, metrics = step(model, opt.init(model), (x, y), key=jax.random.key(1))
    assert np.isfinite(float(metrics["loss"]))
    # the expected statistics in one program (eager: a matmul, add, mean, multiply... each compiled apart)
    expected = jax.jit(lambda m: 0.99 * m.layers[1].running_mean + 0.01 * m.layers[0](x).mean(0))(model)
    np.testing.assert_allclose(new.layers[1].running_mean, expected,
                               rtol=1e-5, atol=1e-7)  # BatchNorm statistics recorded and applied
    again, _, _ = DataParallelStep(loss_fn, opt, donate=False)(model, opt.init(model), (x, y), key=jax.random.key(1))
    np.testing.assert_array_equal(again.layers[0].weight, new.layers[0].weight)  # one key, one result


def test_accumulation_and_on_nan_skip_match_the_plain_step():
    def loss_fn(model, batch):
        return jnp.mean((batch[0] @ model["w"] - batch[1]) ** 2), batch[0] @ model["w"]

    # NumPy builds the batch (the same float32 numbers as jnp's: no program per operation)
    x, y = np.arange(24.0, dtype=np.float32).reshape(8, 3) / np.float32(24), np.arange(8.0, dtype=np.float32)
    nan_x = x.copy()
    nan_x[0, 0] = np.nan
    for opt in (ft.optim.Optimizer(ft.optim.adam(0.1), accumulate=2), ft.optim.Optimizer(ft.optim.sgd(0.1))):
        plain = ft.train.train_step(loss_fn, opt, on_nan="skip", donate=False)
        parallel = DataParallelStep(loss_fn, opt, on_nan="skip", donate=False, metrics={"aux_rows": lambda o: o.aux.shape[0] * 1.0})
        model = {"w": jax.device_put(np.ones(3, np.float32))}
        a, sa, _ = plain(model, opt.init(model), (x, y))
        b, sb, mb = parallel(model, opt.init(model), (x, y))
        assert_close_trained(b, a, spread=0)  # measured 0: one rounding allowed
        assert int(mb["nonfinite"]) == -1 and float(mb["aux_rows"]) == 8.0  # aux: one row per example
        assert int(ft.optim.context(sb).samples_seen) == int(ft.optim.context(sa).samples_seen) == 8
        bad, _, mbad = parallel(model, opt.init(model), (nan_x, y))
        assert int(mbad["nonfinite"]) == 0  # the gradient of leaf 0 (w) was not finite
        np.testing.assert_array_equal(bad["w"], model["w"])  # the non-finite step was skipped


@pytest.mark.slow
def test_two_dimensional_mesh_data_and_tensor_parallel_equals_one_device(eight_devices):
    """A ("data", "model") mesh: the batch split over "data" (shard_map manual over it alone),
    parameters split over "model" by Megatron-style rules (and over "data" by FSDP-style
    ones), left to the compiler; STEPS Adam steps equal one device's."""
    out = part(eight_devices, 'two_dimensional_mesh_data_and_tensor_parallel_equals_one_device')
    assert out["diff"] < 2e-6  # parameters of magnitude < 1: float32 rounding of the sharded sums
    assert out["loss"][0] == pytest.approx(out["loss"][1], abs=1e-5)
    assert out["specs"][:3] == ["P('data', 'model')", "P('model',)",
                                "P('model', 'data')"]
    assert out["samples"] == STEPS * 64


def test_a_data_axis_of_one_device_beside_a_model_axis_trains_as_one_device(eight_devices):
    """Issue 27 item 9: on a (1, 2) ("data", "model") mesh, XLA's SPMD partitioner rejects
    the data axis' collectives (main: "Cross-partition allreduce must be in (partial)
    manual partitioning mode", also in plain JAX: shard_map over "data" with pcast + pmean
    on such a mesh). A data axis of one device needs none: the step skips them and
    equals a one-device mesh (BatchNorm, dropout keys, accumulation, tensor-parallel rules)."""
    out = part(eight_devices, 'a_data_axis_of_one_device_beside_a_model_axis_trains_as_one_device')
    assert out["spec"] == "P(None, 'model')"  # tensor parallel as the rules asked
    assert out["moved"] > 0  # the BatchNorm statistics were recorded
    assert out["diff"] < 2e-6, out  # parameters of magnitude < 1: float32 rounding of the sharded sums


def test_aux_rows_merge_and_what_cannot_be_combined_is_refused(eight_devices):
    """On a mesh each device's aux was merged by a guess: an int count kept device 0's (5 of
    16 correct read as 1), a per-class table was averaged, or concatenated when its length
    matched the examples per device. Per-example rows and floating means merge exactly;
    anything else is refused, naming it (the shapes on the whole batch decide, not sizes
    that happen to coincide)."""
    out = part(eight_devices, "aux_rows_merge_and_what_cannot_be_combined_is_refused")
    for name in ("loss", "rows", "mean"):
        assert abs(out["eight"][name] - out["one"][name]) <= 1e-5 * max(1.0, abs(out["one"][name])), name
    assert "aux['correct'] has shape () (int32) per device" in out["count64"]
    assert "on a mesh of 8 devices" in out["count64"] and '"correct": pred == y' in out["count64"]
    for key in ("table64", "table32"):
        assert "aux['table'] has shape (4,) (float32) per device" in out[key], out[key]
    assert "[0] has 64 rows, [2] has 4. Split over the 8 devices of mesh axis 'data'" in out["mixed"], out["mixed"]


def test_several_keys_on_a_mesh_differ_per_device_where_documented_and_match_the_step_by_hand(eight_devices):
    """A step with three PRNG keys (a Dropout's key= from the step's key, a LoRA adapter's
    stored dropout_key, a key per example in the batch for augmentation noise) on a 1- and
    a 2-device mesh (replicated; fsdp with accumulate=2) was untested. It equals the
    unmeshed step of a loss that does by hand what docs/guides/scale.md says: device i's
    share gets fold_in(key, i) (a 1-device mesh 0), stored keys salted with i (not on one
    device), microbatch j folded in before; each example's own key is used as it is; the
    recorded dropout_key is not salted. Rows alike on both devices show it: the step key's
    masks differ between the devices, the batch keys' noise does not."""
    out = part(eight_devices, "several_keys_on_a_mesh_differ_per_device_where_documented_and_match_the_step_by_hand")
    for name, r in out.items():
        for got in r["metrics"]:
            for metric, (mesh, hand) in got.items():  # a loss near 10, fingerprints near 100
                np.testing.assert_allclose(mesh, hand, rtol=0, atol=1e-6 * max(1.0, abs(hand)), err_msg=f"{name} {metric}")
            assert got["noise_alike"] == [1.0, 1.0], name  # each example's key, wherever it lands
            assert got["mask_alike"] == [0.0, 0.0] and got["out_alike"] == [0.0, 0.0], name  # (rows alike)
        assert r["stored"][0] == r["stored"][1], name  # the next stored key: unsalted, as unmeshed
        for mesh, hand in r["params"]:  # parameters of magnitude < 2 after two steps of 0.1
            np.testing.assert_allclose(mesh, hand, rtol=0, atol=1e-6, err_msg=name)


# The largest difference measured between the Equinox MLP's losses and weights trained on a
# 2-device mesh, with accumulate=2, or both, and on one device (1.2e-7 for losses near 1.2,
# 3e-8 for the weights): the comparison allows ten times it.
SPREAD_EQX = 1.2e-7


def test_an_equinox_model_trains_on_a_mesh_and_with_accumulation(eight_devices):
    """An eqx.nn.MLP holds jax.nn.relu as a leaf: the step passed the whole model to
    jax.eval_shape (accumulate=2, a mesh) and to shard_map (a mesh), which take arrays
    alone, and failed deep in JAX ("custom_jvp ... as an abstract array"). Three SGD steps
    on a 2-device mesh, with accumulate=2, and both, equal the one-device step's (a mesh of
    2 of the 8-device subprocess's devices: its own start-up cost ~2.5 CPU-s more)."""
    pytest.importorskip("equinox")  # before part(): without Equinox its scenario failed to import it
    res = part(eight_devices, "an_equinox_model_trains_on_a_mesh_and_with_accumulation")
    ref = res["plain"]
    for name in ("mesh", "accumulate", "both"):
        np.testing.assert_allclose(res[name]["losses"], ref["losses"], rtol=0, atol=10 * SPREAD_EQX, err_msg=name)
        for got, want in zip(res[name]["weights"], ref["weights"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=10 * SPREAD_EQX, err_msg=name)


def _sgd_reference(x, y, w, b, steps, rate=0.1, size=16):
    """``steps`` SGD steps on mean((x w + b - y)^2) over minibatches of ``size``:
    dL/dw = 2/n x^T r, dL/db = 2/n Σ r, r = x w + b - y (n the minibatch's rows)."""
    for i in range(steps):
        xb, yb = x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]
        r = xb @ w + b - yb
        w, b = w - rate * 2 / len(xb) * xb.T @ r, b - rate * 2 / len(xb) * r.sum(0)
    return w, b


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_short_last_minibatch_named_at_any_steps_per_call(eight_devices, steps_per_call):
    """A Trainer on the 8-device mesh (moved from tests/test_train_short_batches.py, whose
    own 8-device subprocess cost ~16 s): the data's short last minibatch is named whatever
    ``steps_per_call``."""
    # 44 examples in minibatches of 16: the third has 12, which 8 devices cannot share. With
    # steps_per_call=2 the first two ran stacked, which once left `earlier` at 0: the message
    # then told the user to use batch_size=8 instead of dropping the short last minibatch.
    short_last = part(eight_devices, "short_last_minibatch_named_at_any_steps_per_call")
    text, steps, weight, bias = short_last[str(steps_per_call)]
    right = SHORT_LAST_BATCH.format(size=12, path="[0]", n=8, axis="data", earlier=16, right=8)
    assert right in text
    assert "batch_size=16, drop_last=True" in text and "batch_size=12" not in text
    # The two full minibatches ran (before the short one stopped the epoch), as plain SGD.
    x, y = np.asarray(short_last["x"], np.float64), np.asarray(short_last["y"], np.float64)
    w, b = _sgd_reference(x, y, np.asarray(short_last["start"][0]), np.asarray(short_last["start"][1]), 2)
    assert steps == 2
    np.testing.assert_allclose(np.asarray(weight), w, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bias), b, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_stack_on_fsdp_and_tensor_parallel_meshes_equals_one_device(eight_devices):
    """An ft.nn.Stack of 8 remat blocks trained 4 Adam steps under FSDP (8 devices) and tensor
    parallel (4 x 2) equals one device, never splitting the layer axis (moved from
    tests/test_nn_stack.py, whose own 8-device subprocess cost a start-up)."""
    out = part(eight_devices, "a_stack_on_fsdp_and_tensor_parallel_meshes_equals_one_device")
    # 4 Adam steps (lr 1e-2), 8 devices vs 1: the sums differ in order only, and Adam's
    # normalisation carries that into the parameters. Measured (fraction of the largest
    # parameter) under the four XLA CPU instruction sets: FSDP 4.6e-7 to 4.7e-6, tensor
    # parallel 1.37e-5 to 1.42e-5 (once 3.4e-5 while the tests were being reworked); 3e-4 is
    # ~10x the largest; a wrongly split or unsynchronised update is off by ~lr = 1e-2.
    assert out["fsdp"] <= 3e-4 * out["scale"] and out["tp"] <= 3e-4 * out["scale"], out
    assert out["fsdp_spec"] == "P(None, None, 'data')"  # never the layer axis
    assert out["tp_spec"] == "P(None, None, 'model')"  # the member's rule, layer axis prepended


# The largest difference measured between the clipped MLP's weights after 3 SGD steps on 4
# devices and on one (float32; leaves of magnitude < 1): 1.5e-8. A clip of each device's own
# gradient before the mean was 2.7e-3 off.
SPREAD_CLIPPED = 1.5e-8


def test_a_global_norm_clip_sees_the_whole_batchs_gradient_and_weighted_counts_once(eight_devices):
    """On a mesh the optimizer's transform_gradients (torch's clip_grad_norm_ after DDP's
    all-reduce) ran on each device's own gradient before the mean: the global norm was each
    device's, and 3 clipped SGD steps on 4 devices ended 2.7e-3 from one device's (mean and
    weighted losses alike; 4.6e-2 of the largest weight on 8 devices in float64). The step
    binds its data axis to the optimizer, whose default aggregation then runs before the
    hook, as on one device. A weighted loss under an
    optimizer naming axis_name="data" itself was weighed twice: its count came back 4 times
    the batch's kept labels. An override of aggregate_gradients calling super(), and an
    aggregate_gradients= that leaves the gradients to the step, still clipped each device's
    own (2.7e-3 / 2.5e-3 off): the axis is bound for them too, super() weighs by the counts,
    and what a custom aggregation leaves varying is averaged before the hook."""
    out = part(eight_devices, "a_global_norm_clip_sees_the_whole_batchs_gradient_and_weighted_counts_once")
    assert out.pop("own_shard_map_varying") == [True]
    for case, got in out.items():
        ref = out[case.split("-")[0] + "-False-None"]
        err = max(np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in zip(got["weights"], ref["weights"]))
        assert err <= 10 * SPREAD_CLIPPED, (case, err)
        assert got["count"] == ref["count"], case
    assert out["weighted-False-None"]["count"] == 64 - 22  # the kept labels of the whole batch
