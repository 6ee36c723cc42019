"""Checkpoints move between device counts: 8-device FSDP → 1 device → 8 devices.

An 8-device FSDP run saves (model, Adam state) at step 10 and trains on to step 20; this
(1-device) process restores step 10, trains 5 steps and saves; a fresh 8-device process
restores that onto the 8-device mesh, sharded again, and trains the last 5 steps. The end
equals the uninterrupted run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import run
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


@pytest.mark.slow
def test_fsdp_checkpoint_restores_on_one_device_and_back_onto_eight(tmp_path):
    first = run(SETUP + f"""
mesh = jax.make_mesh((8,), ("data",))
step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
model = mlp()
state = opt.init(model)
for i in range(20):
    if i == 10:
        assert not model.layers[0].weight.sharding.is_fully_replicated
        ft.train.save({str(tmp_path / "step10")!r}, (model, state))
    model, state, _ = step(model, state, (xs[i], ys[i]))
report([np.asarray(x).tolist() for x in jax.tree.leaves(model)])
""")
    s = _setup()
    template = (s["mlp"](), s["opt"].init(s["mlp"]()))
    one = jax.make_mesh((1,), ("data",))
    model, state = ft.train.load(tmp_path / "step10", template, mesh=one, sharding="fsdp")
    assert int(ft.optim.context(state).step) == 10
    step = DataParallelStep(s["loss_fn"], s["opt"], mesh=one, sharding="fsdp")
    for i in range(10, 15):
        model, state, _ = step(model, state, (s["xs"][i], s["ys"][i]))
    ft.train.save(tmp_path / "step15", (model, state))

    last = run(SETUP + f"""
mesh = jax.make_mesh((8,), ("data",))
template = (mlp(), opt.init(mlp()))
model, state = ft.train.load({str(tmp_path / "step15")!r}, template, mesh=mesh, sharding="fsdp")
sharded = not model.layers[0].weight.sharding.is_fully_replicated
moment = any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state))  # Adam moments
step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
for i in range(15, 20):
    model, state, _ = step(model, state, (xs[i], ys[i]))
report({{"sharded": sharded, "moment": moment, "steps": int(ft.optim.context(state).step),
        "params": [np.asarray(x).tolist() for x in jax.tree.leaves(model)]}})
""")
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
def test_checkpoint_manager_restores_onto_a_mesh_in_shards(tmp_path):
    """CheckpointManager.restore(mesh=, sharding=): a 4-device FSDP save restored onto 2
    devices sharded again (and onto the default device without a mesh); a part without a
    template (extra) comes back on the host. One 4-device process: it saves on all 4, then a
    fresh manager restores onto a mesh of 2 of them."""
    out = run(SETUP + f"""
from jax.sharding import NamedSharding
mesh = jax.make_mesh((4,), ("data",))
model = ft.shard(mlp(), mesh, "fsdp")
state = ft.shard(opt.init(mlp()), mesh, "fsdp")
with ft.train.CheckpointManager({str(tmp_path / "ck")!r}) as manager:
    manager.save(3, model, state, extra={{"note": np.arange(3.0)}})
written = [str(model.layers[0].weight.sharding.spec)]
del model, state
mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
manager = ft.train.CheckpointManager({str(tmp_path / "ck")!r})
ck = manager.restore(template=mlp(), opt_state_template=opt.init(mlp()), mesh=mesh, sharding="fsdp")
w = ck.model.layers[0].weight
mu = ft.optim.moments(ck.opt_state)["mu"].layers[0].weight
plain = manager.restore(template=mlp(), opt_state_template=opt.init(mlp()))
report({{"w": [len(w.sharding.device_set), w.sharding.is_fully_replicated],
        "mu": [len(mu.sharding.device_set), mu.sharding.is_fully_replicated],
        "extra": [type(ck.extra["note"]).__name__, np.asarray(ck.extra["note"]).tolist()],
        "same": bool(np.array_equal(np.asarray(w), np.asarray(plain.model.layers[0].weight))),
        "plain": len(plain.model.layers[0].weight.sharding.device_set), "written": written}})
manager.close()
""", devices=4)
    assert out["written"] == ["P(None, 'data')"]
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
def test_bfloat16_checkpoint_restores_split_by_the_rules(tmp_path):
    """A bfloat16 model is split by "fsdp" and by rules when restored onto a mesh, as a
    float32 one (its leaves used to come back replicated on every device)."""
    out = run(SETUP + f"""
from jax.sharding import PartitionSpec as P
mesh = jax.make_mesh((2,), ("data",))
model = ft.cast(mlp(), jnp.bfloat16)
ft.train.save({str(tmp_path / "m")!r}, (model, opt.init(model)))
specs = {{}}
for name, rules in (("fsdp", "fsdp"), ("rule", {{"layers.1.weight": P("data"), "*": "fsdp"}})):
    m, state = ft.train.load({str(tmp_path / "m")!r}, (model, opt.init(model)), mesh=mesh, sharding=rules)
    specs[name] = {{k: [str(v.dtype), str(v.sharding.spec), v.addressable_shards[0].data.size]
                   for k, v in ft.to_flat_dict(m).items()}}
    specs[name + " mu"] = str(ft.optim.moments(state)["mu"].layers[0].weight.sharding.spec)
report(specs)
""", devices=2)
    assert out["fsdp"]["layers.0.weight"] == ["bfloat16", "P(None, 'data')", 16 * 64]
    assert out["fsdp"]["layers.0.bias"] == ["bfloat16", "P()", 128]  # under FSDP_MIN_SIZE
    assert out["fsdp mu"] == "P(None, 'data')"
    assert out["rule"]["layers.1.weight"] == ["bfloat16", "P('data',)", 64 * 4]
    assert out["rule"]["layers.0.weight"] == ["bfloat16", "P(None, 'data')", 16 * 64]
