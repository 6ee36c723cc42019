"""Sharding rules (ft.partition_specs), ft.shard and ft.cast, on one process.

The rules only read the mesh's axis names and sizes, so an ``AbstractMesh`` of 8 (or
8 x 2) devices checks them without devices; placement runs on a 1-device mesh here and
on 8 simulated devices in test_parallel_step.py (and, for rules with an FSDP fallback, in
a subprocess here).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import part, scenarios
from _tolerance import MARGIN
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_nn_stack import Block as Residual  # the residual block of the Stack tests

import functree as ft
from functree._tree import dotted_name
from functree.parallel import FSDP_MIN_SIZE

MESH = AbstractMesh((8,), ("data",))
# The largest scaled_error (tests/_tolerance.py) measured between one Adam step on a (4, 2)
# mesh by TP_AND_FSDP and on one device, under the four XLA CPU instruction sets.
SPREAD_RULES_8_VS_1 = 7e-7  # measured 6.7e-7
MESH2 = AbstractMesh((8, 2), ("data", "model"))


class Block(ft.Module):
    weight: jax.Array
    bias: jax.Array
    steps: jax.Array
    mean: jax.Array = ft.field(no_derivative=True)
    name: str = ft.field(static=True, default="block")


def block(n_in=64, n_out=32):
    return Block(jnp.ones((n_in, n_out)), jnp.ones(n_out), jnp.zeros((), jnp.int32), jnp.zeros(n_out))


def model():
    return {"encoder": [block(), block(32, 16)], "head": block(16, 8)}


def test_none_replicates_every_array_leaf():
    specs = ft.partition_specs(model(), None, mesh=MESH)
    assert all(s == P() for s in jax.tree.leaves(specs))
    assert specs["head"].name == "block"  # static fields stay


def test_fsdp_shards_large_floating_leaves_along_largest_divisible_dimension():
    tree = {"wide": jnp.ones((30, 64)), "tall": jnp.ones((64, 32)), "odd": jnp.ones((33, 35)),
            "small": jnp.ones((8, 8)), "ints": jnp.ones((64, 32), jnp.int32)}
    specs = ft.partition_specs(tree, "fsdp", mesh=MESH)
    assert specs["wide"] == P(None, "data")  # 30 is not divisible by 8: dimension 1
    assert specs["tall"] == P("data")  # the largest divisible dimension
    assert specs["odd"] == P()  # 33 x 35 = 1155 elements, no dimension divisible by 8
    assert specs["small"] == P()  # fewer than FSDP_MIN_SIZE elements
    assert 8 * 8 < FSDP_MIN_SIZE <= 30 * 64
    assert specs["ints"] == P()  # never sharded


def test_fsdp_moments_follow_their_parameters():
    m = model()
    state = ft.optim.Optimizer(ft.optim.adam(1e-3)).init(m)
    specs = ft.partition_specs(state, "fsdp", mesh=MESH)
    moments = [s for s in jax.tree.leaves(specs) if s != P()]
    assert moments == [P("data")] * 2  # mu and nu of encoder.0.weight (encoder.1.weight is small)


def test_rules_first_match_wins_and_unmatched_leaves_are_replicated():
    rules = {"encoder.0.weight": P("data", "model"), "encoder.*.weight": P(None, "model"), "*.bias": P("model")}
    specs = ft.partition_specs(model(), rules, mesh=MESH2)
    assert specs["encoder"][0].weight == P("data", "model")
    assert specs["encoder"][1].weight == P(None, "model")
    assert specs["encoder"][0].bias == P("model")
    assert specs["head"].weight == P()  # no rule
    assert specs["head"].mean == P()  # "*.bias" does not match "head.mean"


def test_rules_reach_the_optimizer_moments_by_dotted_suffix():
    m = model()
    state = ft.optim.Optimizer(ft.optim.adam(1e-3)).init(m)
    specs = ft.partition_specs(state, {"encoder.*.weight": P(None, "model")}, mesh=MESH2, strict=False)
    flat = {dotted_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]}
    sharded = sorted(n for n, s in flat.items() if s == P(None, "model"))
    assert len(sharded) == 4 and all(n.endswith(("encoder.0.weight", "encoder.1.weight")) for n in sharded)
    assert any(".mu." in n for n in sharded) and any(".nu." in n for n in sharded)


def test_rule_matching_no_parameter_names_the_pattern_and_closest_names():
    with pytest.raises(ValueError, match=r"'encoder\.\*\.weights' matches no parameter") as e:
        ft.partition_specs(model(), {"encoder.*.weights": P("data")}, mesh=MESH)
    assert "'encoder.0.weight'" in str(e.value) or "'encoder.1.weight'" in str(e.value)


def test_rule_spec_that_does_not_divide_the_shape_names_path_shape_and_axis_size():
    with pytest.raises(ValueError, match=r"head\.weight, of shape \(16, 8\)") as e:
        ft.partition_specs(model(), {"head.weight": P("data", "model")}, mesh=AbstractMesh((32, 2), ("data", "model")))
    assert "not divisible by mesh axis 'data' of size 32" in str(e.value)
    with pytest.raises(ValueError, match="has no axis 'tensor'"):
        ft.partition_specs(model(), {"head.weight": P("tensor")}, mesh=MESH)
    with pytest.raises(ValueError, match="3 entries and the leaf 2 dimensions"):
        ft.partition_specs(model(), {"head.weight": P(None, None, "data")}, mesh=MESH)


def test_missing_data_axis_names_the_mesh_axes():
    with pytest.raises(ValueError, match=r"no axis 'data'; its axes are \('batch',\)"):
        ft.partition_specs(model(), "fsdp", mesh=AbstractMesh((8,), ("batch",)))


def test_missing_data_axis_names_the_call_the_user_made():
    """ft.shard's error shows ft.shard's call, not ft.partition_specs' (which it calls)."""
    mesh = jax.make_mesh((1,), ("batch",))
    for tree in (model(), lambda: model()):
        with pytest.raises(ValueError, match=r"(?s)no axis 'data'.*right:  ft\.shard\(.*"
                                             r"or:  ft\.shard\(\.\.\., mesh=mesh, data_axis='batch'\)") as e:
            ft.shard(tree, mesh, "fsdp")
        assert "partition_specs" not in str(e.value)


def test_bad_rules_type():
    with pytest.raises(TypeError, match='sharding= takes None, "fsdp"'):
        ft.partition_specs(model(), "zero3", mesh=MESH)


def test_shard_places_and_builds_in_shards_on_a_one_device_mesh():
    mesh = jax.make_mesh((1,), ("data",))
    placed = ft.shard(model(), mesh, "fsdp")
    weight = placed["encoder"][0].weight
    assert isinstance(weight.sharding, NamedSharding) and weight.sharding.mesh.axis_names == ("data",)
    built = ft.shard(lambda: ft.nn.Dense(64, 32, key=jax.random.key(0)), mesh, {"weight": P(None, "data")})
    assert isinstance(built, ft.nn.Dense) and built.weight.sharding.spec == P(None, "data")
    np.testing.assert_array_equal(built.weight, ft.nn.Dense(64, 32, key=jax.random.key(0)).weight)
    dense = ft.nn.Dense(2, 2, key=jax.random.key(0))  # a callable Module is a tree, not a builder
    assert isinstance(ft.shard(dense, mesh), ft.nn.Dense)


def test_shard_takes_a_callable_foreign_module_for_a_tree():
    eqx = pytest.importorskip("equinox")
    mesh = jax.make_mesh((1,), ("data",))
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))  # callable, but a pytree node: data
    placed = ft.shard(linear, mesh, {"weight": P(None, "data")})
    assert isinstance(placed, eqx.nn.Linear) and placed.weight.sharding.spec == P(None, "data")
    np.testing.assert_array_equal(placed.weight, linear.weight)
    built = ft.shard(functools.partial(ft.nn.Dense, 4, 2, key=jax.random.key(0)), mesh)  # a leaf: builds
    assert isinstance(built, ft.nn.Dense)
    # A builder of a tree holding functions at leaves (Equinox's activations): was a crash in
    # jax.eval_shape ("returned a value of type custom_jvp"); its arrays are built in shards.
    mlp = ft.shard(lambda: eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), mesh, {"layers.0.weight": P("data", None)})
    reference = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    assert mlp.layers[0].weight.sharding.spec == P("data", None) and mlp.activation is reference.activation
    np.testing.assert_array_equal(mlp(jnp.ones(3)), reference(jnp.ones(3)))


def test_cast_touches_floating_parameters_only():
    m = model()
    half = ft.cast(m, jnp.bfloat16)
    assert half["head"].weight.dtype == jnp.bfloat16 and half["head"].bias.dtype == jnp.bfloat16
    assert half["head"].steps.dtype == jnp.int32  # integer leaf
    assert half["head"].mean.dtype == jnp.float32  # no_derivative statistic
    assert half["head"].name == "block"  # static field
    # a complex parameter keeps its dtype and its imaginary part (astype to bfloat16 dropped it)
    z = np.array([1 + 2j, 3 - 1j], np.complex64)
    cast = ft.cast({"z": z, "w": np.ones(2, np.float32)}, jnp.bfloat16)
    assert cast["z"].dtype == np.complex64 and cast["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(cast["z"], z)


def test_cast_of_a_python_float_field_trained_as_a_parameter():
    # session 60: a Module field declared `bias: float = 0.0` is a parameter (it trains), and
    # ft.cast(model, jnp.bfloat16) failed with "'float' object has no attribute 'dtype'"
    class Affine(ft.Module):
        w: jax.Array
        bias: float = 0.5

        def __call__(self, x):
            return x @ self.w + self.bias

    model, x = Affine(jnp.ones((2, 1))), jnp.array([[1.0, 2.0]], jnp.bfloat16)
    half = ft.cast(model, jnp.bfloat16)
    assert half.w.dtype == jnp.bfloat16 and half.bias.dtype == jnp.bfloat16 and float(half.bias) == 0.5
    np.testing.assert_allclose(np.asarray(half(x), np.float32), [[3.5]], rtol=0, atol=1e-2)
    grads = ft.gradient(lambda m: jnp.sum(ft.cast(m, jnp.bfloat16)(x)).astype(jnp.float32), at=model)
    assert float(grads.bias) == 1.0  # the master copy's gradient, as for its array parameters

def test_cast_gradients_come_back_in_the_master_dtype():
    w = {"w": jnp.arange(3.0)}
    g = ft.gradient(lambda p: jnp.sum(ft.cast(p, jnp.bfloat16)["w"] ** 2).astype(jnp.float32), at=w)
    assert g["w"].dtype == jnp.float32
    np.testing.assert_allclose(g["w"], [0.0, 2.0, 4.0])


def test_compute_dtype_must_be_floating():
    with pytest.raises(TypeError, match=r"(?s)ft.cast's dtype must be a floating dtype \(the parameters are cast to "
                                        r"it\), got jnp.int8\..*wrong:  ft.cast\(model, jnp.int8\)\n"
                                        r"    right:  ft.cast\(model, jnp.bfloat16\)"):
        ft.cast(model(), jnp.int8)  # (once: "<class 'jax.numpy.int8'>", and compute_dtype's call)
    with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
        ft.parallel.DataParallelStep(lambda m, b: 0.0, ft.optim.sgd(0.1), mesh=jax.make_mesh((1,), ("data",)),
                                     compute_dtype=jnp.int32)


# Rules composed with FSDP: {"...": spec, "*": "fsdp"}

class Net(ft.Module):
    embed: ft.nn.Dense
    blocks: ft.nn.Stack
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.blocks(self.embed(x)))


def net(d=32, n=2, n_in=64, n_out=64):
    k = jax.random.split(jax.random.key(0), 3)
    return Net(ft.nn.Dense(n_in, d, key=k[0]), ft.nn.Stack(lambda key: Residual(d, key=key), n, key=k[1]),
               ft.nn.Dense(d, n_out, key=k[2]))


def net_shapes(**kwargs):
    """``net(**kwargs)`` built abstractly: the rules read shapes only, and building the
    arrays would compile each initializer per shape (seconds)."""
    return jax.eval_shape(lambda: net(**kwargs))


TP_AND_FSDP = {"*.up.weight": P(None, "model"), "*.down.weight": P("model", "data"), "*": "fsdp"}


def test_fsdp_rule_takes_every_leaf_no_earlier_rule_names():
    specs = ft.to_flat_dict(ft.partition_specs(net_shapes(), TP_AND_FSDP, mesh=MESH2))
    assert specs == {
        "embed.weight": P("data"),  # (64, 32): FSDP along the largest divisible dimension
        "embed.bias": P(),  # too small for FSDP
        "blocks.layers.norm.scale": P(), "blocks.layers.norm.offset": P(),
        "blocks.layers.up.weight": P(None, None, "model"),  # the rule, layer axis prepended whole
        "blocks.layers.up.bias": P(),  # (2, 128): 256 elements, replicated by "fsdp"
        "blocks.layers.down.weight": P(None, "model", "data"),  # a rule that already splits over "data"
        "blocks.layers.down.bias": P(),
        "head.weight": P(None, "data"),
        "head.bias": P(),
    }


def test_fsdp_rule_never_splits_the_layer_axis_and_equals_sharding_fsdp():
    tree = {"blocks": net_shapes(d=64, n=8).blocks}  # every dimension divisible by 8, the layer axis too
    alone = ft.to_flat_dict(ft.partition_specs(tree, "fsdp", mesh=MESH))
    assert ft.to_flat_dict(ft.partition_specs(tree, {"*": "fsdp"}, mesh=MESH)) == alone
    flat = ft.to_flat_dict(ft.partition_specs(tree, {"*.norm.*": P(), "*": "fsdp"}, mesh=MESH))
    assert flat["blocks.layers.up.weight"] == P(None, None, "data")  # (8, 64, 256): the 256, never the 8
    assert flat["blocks.layers.down.weight"] == P(None, "data")
    assert flat["blocks.layers.norm.scale"] == P(None)  # the rule's P(), the layer axis prepended


def test_fsdp_rule_for_part_of_the_model_and_its_moments():
    m = net_shapes()
    rules = {"embed.*": "fsdp", "*.up.weight": P(None, "model")}  # the rest replicated
    flat = ft.to_flat_dict(ft.partition_specs(m, rules, mesh=MESH2))
    assert flat["embed.weight"] == P("data") and flat["head.weight"] == P()
    state = jax.eval_shape(ft.optim.Optimizer(ft.optim.adam(1e-3)).init, m)
    moments = ft.to_flat_dict(ft.partition_specs(state, TP_AND_FSDP, mesh=MESH2, strict=False))
    assert [s for n, s in moments.items() if n.endswith("embed.weight")] == [P("data")] * 2  # mu, nu
    assert [s for n, s in moments.items() if n.endswith("up.weight")] == [P(None, None, "model")] * 2
    assert all(s == P() for n, s in moments.items() if "count" in n)


def test_unknown_rule_value_names_the_choices():
    for bad in ("fdsp", None, 3):
        with pytest.raises(TypeError, match=r"rule '\*' gives .*PartitionSpec.* or \"fsdp\"") as e:
            ft.partition_specs(net_shapes(), {"*.up.weight": P(None, "model"), "*": bad}, mesh=MESH2)
        assert 'right:  sharding={\'*\': "fsdp"}' in str(e.value)
    with pytest.raises(TypeError, match=r'sharding= takes None, "fsdp"'):
        ft.train.TrainStep(lambda m, b: 0.0, ft.optim.sgd(0.1), mesh=jax.make_mesh((1,), ("data",)), sharding="FSDP")
    with pytest.raises(TypeError, match=r"rule 'head\.weight' gives 'replicate'"):
        ft.shard(net_shapes(), jax.make_mesh((1,), ("data",)), {"head.weight": "replicate"})


def test_rule_after_the_fallback_is_shadowed_and_says_to_move_it():
    with pytest.raises(ValueError, match=r"'\*\.up\.weight' is never used: 'blocks\.layers\.up\.weight'.*"
                                         r"earlier rule '\*'") as e:
        ft.partition_specs(net_shapes(), {"*": "fsdp", "*.up.weight": P(None, "model")}, mesh=MESH2)
    assert "right:  sharding={'*.up.weight': ..., '*': ...}" in str(e.value)


def test_rule_naming_one_stack_member_keeps_its_message_beside_the_fallback():
    with pytest.raises(ValueError, match=r"'blocks\.1\.up\.weight' matches no parameter") as e:
        ft.partition_specs(net_shapes(), {"blocks.1.up.weight": P(None, "model"), "*": "fsdp"}, mesh=MESH2)
    assert "'blocks.layers.up.weight'" in str(e.value)


FALLBACK = """
import sys; sys.path.insert(0, "tests")
import numpy as np, jax.numpy as jnp, functree as ft
from jax.sharding import PartitionSpec as P
from _tolerance import scaled_error
from test_parallel_rules import TP_AND_FSDP as rules, net
net = jax.jit(net)  # one program builds each fresh copy (eager, every initializer compiles apart)
mesh = jax.make_mesh((4, 2), ("data", "model"))
rng = np.random.default_rng(0)
batch = (rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(16, 64)).astype(np.float32))
loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
ref, ref_state, ref_metrics = ft.train.train_step(loss_fn, opt)(net(), opt.init(net()), batch)
step = ft.train.TrainStep(loss_fn, opt, mesh=mesh, sharding=rules)
model, state, metrics = step(net(), opt.init(net()), batch)
report({"error": scaled_error((model, state), (ref, ref_state)),
        "loss": [float(metrics["loss"]), float(ref_metrics["loss"])],
        "specs": {n: str(x.sharding.spec) for n, x in ft.to_flat_dict(model).items()},
        "mu": str(ft.optim.moments(state)["mu"].blocks.layers.down.weight.sharding.spec)})
"""


@pytest.mark.slow
def test_rules_with_fsdp_fallback_train_on_eight_devices_as_on_one(eight_devices):
    """One Adam step on a (4, 2) mesh, tensor parallel by rules and FSDP for the rest,
    equals one device's step; the arrays are where the rules say."""
    out = part(eight_devices, "fallback")
    assert out["error"] < MARGIN * SPREAD_RULES_8_VS_1
    assert out["loss"][0] == pytest.approx(out["loss"][1], rel=1e-6)
    assert out["specs"]["blocks.layers.up.weight"] == "P(None, None, 'model')"
    assert out["specs"]["blocks.layers.down.weight"] == "P(None, 'model', 'data')"
    assert out["specs"]["embed.weight"] == "P('data',)" and out["specs"]["head.weight"] == "P(None, 'data')"
    assert out["mu"] == "P(None, 'model', 'data')"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_low_precision_floating_leaves_are_split_as_float32_ones(dtype):
    """bfloat16 and the float8 types are no np.floating (ml_dtypes): the rules used to
    replicate them silently, and a rule naming one matched "no parameter"."""
    def flat(specs):
        return {dotted_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]}

    low = jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, model())
    for rules in ("fsdp", {"*": "fsdp"}, {"*.weight": P(None, "data")}):
        assert flat(ft.partition_specs(low, rules, mesh=MESH)) == flat(ft.partition_specs(model(), rules, mesh=MESH))
    assert ft.partition_specs(low, "fsdp", mesh=MESH)["encoder"][0].weight == P("data")
    mixed = {"low": ft.nn.Dense(64, 32, key=jax.random.key(0)).weight.astype(dtype), "high": jnp.ones((64, 32))}
    specs = ft.partition_specs(mixed, {"low": P(None, "data"), "*": "fsdp"}, mesh=MESH)
    assert specs == {"low": P(None, "data"), "high": P("data")}


def test_spec_naming_one_mesh_axis_twice_names_the_rule_and_the_leaf():
    with pytest.raises(ValueError, match=r"'head\.weight' gives P\('model', 'model'\) to head\.weight, which names "
                                         r"the mesh axis 'model' for more than one dimension") as e:
        ft.partition_specs(model(), {"head.weight": P("model", "model")}, mesh=MESH2)
    assert "right:  sharding={'head.weight': P('model', None)}" in str(e.value)
    with pytest.raises(ValueError, match=r"'\*\.weight' gives P\(\('data', 'model'\), 'data'\) to encoder\.0\.weight"
                                         r".* axis 'data'") as e:
        ft.partition_specs(model(), {"*.weight": P(("data", "model"), "data")}, mesh=MESH2)
    assert "P(('data', 'model'), None)" in str(e.value)
    with pytest.raises(ValueError, match="names the mesh axis 'model' for more than one dimension"):
        ft.shard(model(), jax.make_mesh((1, 1), ("data", "model")), {"head.weight": ("model", "model")})


# The batch and placement scenarios below, on 8 devices (each test reads its part); one process runs
# them and FALLBACK.
EIGHT_DEVICES = """
import tempfile
import numpy as np, jax.numpy as jnp, functree as ft
from jax.sharding import PartitionSpec as P
from functree.parallel import shard_batch
mesh = jax.make_mesh((8,), ("data",))
D = jax.devices()

def message(f):
    try:
        f()
    except Exception as e:
        return str(e)

out = {"batches": [message(lambda: shard_batch({"x": x, "y": y}, mesh)) for x, y in [
    (np.zeros((12, 3), np.float32), np.zeros(12, np.int32)),
    (np.zeros((16, 3), np.float32), np.zeros((12, 2), np.float32)),
    (np.zeros((16, 3), np.float32), jnp.zeros((12, 2))),
    (np.zeros((16, 3), np.float32), np.zeros(8, np.int32))]]}

# 44 rows in batches of 16 on 8 devices: the last has 12. Then the fix the message prints.
rng = np.random.default_rng(0)
X, Y = rng.normal(size=(44, 3)).astype(np.float32), rng.normal(size=(44, 1)).astype(np.float32)
loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
trainer = lambda: ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.sgd(0.1)),
                                   loss_fn, mesh=mesh)
t = trainer()
out["fit"] = message(lambda: t.fit(ft.train.batches((X, Y), 16, shuffle=False), epochs=1, progress=False))
right = out["fit"].split("right:  ")[1].split("   #")[0]
t = trainer()
t.fit(eval(right, {"ft": ft, "data": (X, Y)}), epochs=1, progress=False)
out["fixed"] = [t.steps_run, int(t.model.weight.sharding.num_devices)]

# A checkpoint of float32 arrays read into a bfloat16 template on device 2 (BatchNorm's
# statistics float32): the printed cast code, run as printed, from ft.train.load and from trainer.restore.
@jax.jit  # one program builds it (eager, every initializer compiles apart)
def model():
    k = jax.random.split(jax.random.key(0), 2)
    return ft.nn.Sequential(ft.nn.Dense(6, 32, jax.nn.relu, key=k[0]), ft.nn.BatchNorm(32), ft.nn.Dense(32, 3, key=k[1]))
saved = model()
template = jax.device_put(ft.cast(saved, jnp.bfloat16), D[2])
d = tempfile.mkdtemp()
ft.train.save(d + "/f32", saved)
with ft.train.CheckpointManager(d + "/run") as manager:
    manager.save(1, saved)
out["cast"] = {}
for name, restore in [("load", lambda: ft.train.load(d + "/f32", template)),
                      ("trainer", lambda: ft.train.Trainer(template, ft.optim.adam(1e-3), loss_fn).restore(d + "/run"))]:
    printed = message(restore)
    code = printed.split("cast it into the template")[1].split(": ", 1)[1].split("   #")[0]
    with ft.train.CheckpointManager(d + "/run") as manager:  # as the note says for trainer.restore(path)
        cast = eval(code, {"ft": ft, "template": template, "path": d + "/f32", "manager": manager})
    out["cast"][name] = {"printed": printed, "devices": sorted({f"{dv.platform}:{dv.id}"  # (str(device) is TFRT_CPU_2 on jax 0.9)
                                                                  for x in jax.tree.leaves(cast) for dv in x.devices()}),
                         "leaves": [[str(x.dtype), np.asarray(x.astype(jnp.float32)).tolist()]
                                    for x in jax.tree.leaves(cast)]}
out["saved"] = [np.asarray(x).tolist() for x in jax.tree.leaves(saved)]

# generate's cache check (tests/test_generation_memory.py): 500 bytes free on device 2 alone.
from functree.generation import _memory
class Cached(ft.Module):
    w: jax.Array
    def init_cache(self, rows, length):
        return jnp.zeros((rows, length), jnp.float32)
_memory.available_bytes = lambda d: (500 if d.id == 2 else 10**9, f"{d}'s memory")
out["cache"] = [message(lambda: _memory.checked_cache(jax.device_put(Cached(jnp.ones(2)), devices), 16, 16,
                                                      abstract=True))
                for devices in (D[0], D[2], jax.sharding.NamedSharding(jax.make_mesh((2,), ("x",), devices=D[1:3]),
                                                                      P()))]
out["template"] = [str(x.dtype) for x in jax.tree.leaves(template)]
report(out)
"""


PLACEMENT_TESTS = ("test_a_batch_the_mesh_cannot_split_names_its_leaf",
                   "test_a_short_last_batch_on_a_mesh_is_named_with_the_users_batch_size",
                   "test_the_cast_hint_of_a_checkpoint_of_another_dtype_keeps_the_templates_device",
                   "test_the_generation_cache_is_checked_on_the_models_devices")


# The README's `--dist loadfile` runs a module's tests on one pytest-xdist worker, so this
# module fixture starts its subprocess once per run.
@pytest.fixture(scope="module")
def eight_devices(request):
    """One 8-device subprocess for the selected tests: FALLBACK (the rules' training step) and
    EIGHT_DEVICES (the batch and placement scenarios), each in its own copy of the globals."""
    here = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    sources = {"fallback": FALLBACK} if "test_rules_with_fsdp_fallback_train_on_eight_devices_as_on_one" in here else {}
    if here & set(PLACEMENT_TESTS):
        sources["placement"] = EIGHT_DEVICES  # after FALLBACK: it replaces _memory.available_bytes
    return scenarios("", sources)


@pytest.fixture(scope="module")
def eight(eight_devices):
    """EIGHT_DEVICES's report."""
    return part(eight_devices, "placement")


def test_a_batch_the_mesh_cannot_split_names_its_leaf(eight):
    """A batch whose leaves all have 12 rows, on 8 devices: BATCH_NOT_DIVISIBLE names the
    first leaf, ['x'] (12 % 8 = 4, right: 8). Leaves of different lengths ({"x": 16 rows, "y":
    12 rows}) said "The batch has 12 examples" and suggested batch_size=8, which the 16 rows
    of ['x'] already are; the error is the disagreement, naming both leaves and their rows
    (MIXED_EXAMPLE_AXIS), for a NumPy leaf and a jax.Array leaf alike. {"x": 16 rows, "y": 8}
    split on 8 devices too (2 rows of x and 1 of y on each, no longer pairing up) and
    shard_batch placed it silently: it is refused the same way."""
    out = eight["batches"]
    assert out[0].startswith("The batch has 12 examples (leading axis of ['x']), which the 8 devices")
    assert "right:  ft.train.batches(data, batch_size=8, drop_last=True)" in out[0]
    assert "12 examples may also be the short last minibatch" in out[0]
    for message, rows in zip(out[1:], (12, 12, 8), strict=True):
        assert message.startswith(f"The batch's leaves do not share one example axis: ['x'] has 16 rows, ['y'] has "
                                  f"{rows}. Split over the 8 devices of mesh axis 'data'")
        assert "batch_size" not in message


def test_a_short_last_batch_on_a_mesh_is_named_with_the_users_batch_size(eight):
    """44 rows in batches of 16 on 8 devices: step 3's 12 rows failed with "wrong:
    batch_size=12 / right: batch_size=8, drop_last=True", though the user wrote 16. The
    placement remembers the batches before (16), names the short last minibatch and the fix at
    the user's size, which, run as printed, trains the 2 full batches on the 8 devices."""
    message = eight["fit"]
    assert "The batch has 12 examples (leading axis of [0])" in message
    assert "The batches before it had 16: this is most likely the data's short last minibatch" in message
    assert "wrong:  ft.train.batches(data, batch_size=16)\n" in message
    assert "right:  ft.train.batches(data, batch_size=16, drop_last=True)" in message
    assert eight["fixed"] == [2, 8]


def test_the_cast_hint_of_a_checkpoint_of_another_dtype_keeps_the_templates_device(eight):
    """A float32 checkpoint read into a bfloat16 template on device 2: the printed cast code
    put every array on device 0 (from_flat_dict casts through NumPy), and from trainer.restore
    it named a ``manager`` the user never made. Run as printed, it now gives the template's
    dtypes on device 2, each value the float32 one rounded to the template's dtype (NumPy's
    ml_dtypes cast, exact), and the message says what ``manager`` is."""
    saved = [np.asarray(x, np.float32) for x in eight["saved"]]
    for name in ("load", "trainer"):
        got = eight["cast"][name]
        assert got["devices"] == ["cpu:2"]
        assert [dtype for dtype, _ in got["leaves"]] == eight["template"]
        for (dtype, value), want in zip(got["leaves"], saved, strict=True):
            expected = want.astype(jnp.dtype(dtype)).astype(np.float32)
            np.testing.assert_allclose(np.asarray(value, np.float32), expected, rtol=0, atol=0)
    assert "ft.to_flat_dict(ft.train.load(path))" in eight["cast"]["load"]["printed"]
    printed = eight["cast"]["trainer"]["printed"]
    assert "ft.to_flat_dict(manager.restore(1).model)" in printed
    assert "manager: your CheckpointManager, or ft.train.CheckpointManager(path) for trainer.restore(path)" in printed


def test_the_generation_cache_is_checked_on_the_models_devices(eight):
    """generate's cache check read device 0's free memory whatever the model's devices: a
    model on device 2, or on a mesh of devices 1 and 2, with 500 bytes free on device 2, was
    let through (1024 bytes of cache). The check now reads the model's devices (the least
    free of them); device 0's model, with room there, still passes."""
    on0, on2, mesh12 = eight["cache"]
    assert on0 is None
    assert "the cache needs 1024 bytes, 500 are available (cpu:2's memory)" in on2
    assert "the cache needs 1024 bytes, 500 are available (cpu:2's memory (the least of the model's 2 devices))" in mesh12


def test_an_unmatched_glob_keeps_the_parts_that_fit_in_its_fix():
    """``layers.1.kernel*`` (Flax's name) on torch-named Dense layers suggested ``*.weight``,
    which shards every layer's weight; the fix keeps the parts that fit, ``layers.1.weight``
    (and ``layers.*.kernel`` gives ``layers.*.weight``). Each suggested rule, applied, gives
    its spec to the leaves the rule meant and no other."""
    net = ft.nn.Sequential(ft.nn.Dense(4, 8, key=jax.random.key(0)), ft.nn.Dense(8, 16, key=jax.random.key(1)))
    meant = {"layers.1.kernel*": ["layers.1.weight"], "layers.*.kernel": ["layers.0.weight", "layers.1.weight"],
             "*.w": ["layers.0.weight", "layers.1.weight"]}
    fixes = {"layers.1.kernel*": "layers.1.weight", "layers.*.kernel": "layers.*.weight", "*.w": "*.weight"}
    for pattern, names in meant.items():
        with pytest.raises(ValueError, match="matches no parameter") as e:
            ft.partition_specs(net, {pattern: P(None, "data")}, mesh=MESH)
        assert f"right:  sharding={{{fixes[pattern]!r}: P(...)}}" in str(e.value)
        specs = ft.to_flat_dict(ft.partition_specs(net, {fixes[pattern]: P(None, "data")}, mesh=MESH))
        assert sorted(n for n, spec in specs.items() if spec == P(None, "data")) == names


def test_a_rule_that_cannot_split_a_models_leaf_beside_its_state_is_refused():
    """A (model, state) template named the model's leaves 0.layers.1.weight: a rule for
    layers.1.weight matched them only as a suffix, as it matches a moment's name, and a rule
    that could not split the leaf replicated it silently (a full copy on every device). A
    model's leaf is refused as it is alone; a factored moment of another shape is still
    replicated."""
    model = ft.nn.Sequential([ft.nn.Dense(4, 64, key=jax.random.key(0)), ft.nn.Dense(64, 64, key=jax.random.key(1))])
    mesh = AbstractMesh((3,), ("data",))
    bad = {"layers.1.weight": P("data", None)}  # 64 rows on 3 devices
    for tree in (model, (model, ft.optim.Optimizer(ft.optim.adam(1e-3)).init(model)), {"model": model}):
        with pytest.raises(ValueError, match=r"layers\.1\.weight.*\(64, 64\).*not divisible by mesh axis 'data' of size 3"):
            ft.partition_specs(tree, bad, mesh=mesh)
    factored = ft.optim.Optimizer(optax.adafactor(1e-3, min_dim_size_to_factor=8)).init(model)
    specs = ft.to_flat_dict(ft.partition_specs(factored, bad, mesh=mesh))  # v_row (64,), v_col (64,)
    assert {spec for name, spec in specs.items() if name.endswith("layers.1.weight")} == {P()}, specs
    fits = {"layers.1.weight": P(None, "data")}
    specs = ft.to_flat_dict(ft.partition_specs((model, factored), fits, mesh=AbstractMesh((8,), ("data",))))
    assert specs.pop("0.layers.1.weight") == P(None, "data")
    assert {spec for name, spec in specs.items() if name.endswith("layers.1.weight")} == {P()}, specs


def test_a_rule_pattern_is_checked_as_every_key_path_pattern():
    """Sharding rules skipped check_patterns: ``"layers.[^0].weight"`` (a regex's "every layer
    but 0") split layer 0 alone, fnmatch reading ``[^0]`` as "^ or 0", and left layer 1's
    weight whole on every device; a printed key path got "matches no parameter" with
    ``*.weight`` as its fix, which splits every weight. Both are refused at the call (ft.shard
    and a TrainStep's sharding= alike), and each printed fix, applied, splits the leaf meant."""
    net = ft.nn.Sequential(ft.nn.Dense(4, 8, key=jax.random.key(0)), ft.nn.Dense(8, 16, key=jax.random.key(1)))
    mesh = jax.make_mesh((1,), ("data",))
    for pattern, code in [("layers.[^0].weight", "CARET_CLASS"), ("['layers'][1].weight", "KEY_PATH_STRING"),
                          (ft.key_path(net, "layers.1.weight"), "KEY_PATH_AS_PATTERN")]:
        rules = {pattern: P(None, "data")}
        with pytest.raises((ValueError, TypeError)) as e:
            ft.partition_specs(net, rules, mesh=MESH)
        with pytest.raises(type(e.value), match="layers"):
            ft.shard(net, mesh, rules)
        with pytest.raises(type(e.value), match="layers"):
            ft.train.TrainStep(lambda m, b: 0.0, ft.optim.sgd(0.1), mesh=mesh, sharding=rules)
        message = str(e.value)
        right = message.split("right:  ")[1] if code != "KEY_PATH_AS_PATTERN" else message.split("here ")[1].rstrip(".")
        specs = ft.to_flat_dict(ft.partition_specs(net, {eval(right): P(None, "data")}, mesh=MESH))
        assert [n for n, s in specs.items() if s == P(None, "data")] == ["layers.1.weight"], (code, message)


def test_a_rule_for_an_integer_leaf_says_to_drop_it():
    """A rule naming an integer leaf (head.steps, int32) said "matches no parameter" and
    suggested '*.head.steps', which matches the same leaf and failed the same way: a
    non-floating leaf is always replicated, so no pattern places it. The error names the
    leaf and its dtype, and its fix, the rules without it, applied, places the rest."""
    rules = {"*.weight": P(None, "model"), "head.steps": P("data")}
    with pytest.raises(ValueError, match=r"'head\.steps' names no floating leaf, only head\.steps \(int32, shape \(\)\)"
                       ) as e:
        ft.partition_specs(model(), rules, mesh=MESH2)
    right = str(e.value).split("right:  sharding=")[1]
    assert right == "{'*.weight': P(None, 'model')}"
    specs = ft.partition_specs(model(), eval(right, {"P": P}), mesh=MESH2)
    assert specs["head"].weight == P(None, "model") and specs["head"].steps == P()
    with pytest.raises(ValueError, match=r"(?s)'\*\.steps' names no floating leaf.*right:  sharding=None$") as e:
        ft.partition_specs(model(), {"*.steps": P()}, mesh=MESH)
    assert "encoder.0.steps (int32, shape ()), encoder.1.steps (int32, shape ()), head.steps" in str(e.value)


def test_a_rule_that_cannot_split_a_leaf_prints_a_fix_that_places_it():
    """BAD_SPEC's fix was always ``{pattern: P()}``: for a glob that also splits other leaves
    it replicated all of them (``*.weight``: every weight of the model on every device), for
    a misspelt mesh axis it dropped the split meant, and for a Stack's leaf its ``wrong:``
    showed the spec with the layer axis prepended, not the one written. Each printed fix,
    applied, now places the leaf and keeps the rule's spec wherever it fits."""
    net = {"layers": [{"weight": jnp.ones((4, 8))}, {"weight": jnp.ones((8, 6)), "ids": jnp.zeros(8, jnp.int32)}]}
    mesh = AbstractMesh((4, 2), ("data", "model"))
    cases = [  # rules, the printed fix, the specs it gives the two weights
        ({"*.weight": P(None, "data")}, {"layers.1.weight": P(), "*.weight": P(None, "data")}, [P(None, "data"), P()]),
        ({"*.weight": P(None, "modle")}, {"*.weight": P(None, "model")}, [P(None, "model")] * 2),
        ({"layers.0.weight": P(None, ("data", "mdl"))}, {"layers.0.weight": P(None, ("data", "model"))},
         [P(None, ("data", "model")), P()]),
        ({"layers.0.weight": P("data", None, None)}, {"layers.0.weight": P("data")}, [P("data"), P()]),
        ({"layers.1.weight": P(None, "tensor")}, {"layers.1.weight": P()}, [P(), P()]),
        ({"layers.1.*": P(None, "data")}, {"layers.1.*": P()}, [P(), P()]),  # not for layers.1.ids, an integer
    ]
    for rules, fix, want in cases:
        with pytest.raises(ValueError, match="which it cannot split") as e:
            ft.partition_specs(net, rules, mesh=mesh)
        printed = str(e.value).split("right:  sharding=")[1].split("   #")[0]
        assert eval(printed, {"P": P}) == fix, str(e.value)
        specs = ft.partition_specs(net, fix, mesh=mesh)
        assert [specs["layers"][0]["weight"], specs["layers"][1]["weight"]] == want
    stack = {"blocks": net_shapes(d=6, n=3).blocks}  # up.weight (3, 6, 24): 6 rows on 4 devices
    with pytest.raises(ValueError, match=r"gives P\(None, 'data'\) \(the rule's P\('data',\), the layer "
                                         r"axes of the stack prepended\)") as e:
        ft.partition_specs(stack, {"*.up.weight": P("data")}, mesh=mesh)
    assert "wrong:  sharding={'*.up.weight': P('data',)}\n" in str(e.value)


def test_a_glob_rule_replicates_a_factored_moment_as_a_named_rule_does():
    """``{"*.weight": P(None, "data")}`` with Adafactor was refused (a Trainer or TrainStep
    with mesh= failed at its first step, even on one device): the glob matched the factored
    moment ``inner.0.v_row.encoder.0.weight`` from its start, which was read as the pattern
    naming the moment itself, so v_row's one dimension had to take a two-entry spec, while
    ``encoder.*.weight`` replicated it. A state's leaf matched through its parameter's name is
    replicated when the spec does not fit, however the pattern is written; one the pattern
    names by its own path must fit, and a mesh axis the mesh lacks is refused for every leaf."""
    m = model()
    state = ft.optim.Optimizer(optax.adafactor(1e-3, min_dim_size_to_factor=8)).init(m)
    for rules in ({"*.weight": P(None, "data")}, {"encoder.*.weight": P(None, "data")}):
        for tree, prefix in ((state, ""), ((m, state), "1.")):
            specs = ft.to_flat_dict(ft.partition_specs(tree, rules, mesh=MESH, strict=False))
            for moment in ("v_row", "v_col", "v"):  # v: a (1,) placeholder for a factored leaf
                assert specs[f"{prefix}inner.0.{moment}.encoder.0.weight"] == P()
            if prefix:
                assert specs["0.encoder.0.weight"] == P(None, "data")
    with pytest.raises(ValueError, match=r"'inner\.0\.v_row\.\*' gives P\(None, 'data'\) to inner\.0\.v_row\."):
        ft.partition_specs(state, {"inner.0.v_row.*": P(None, "data")}, mesh=MESH, strict=False)
    with pytest.raises(ValueError, match=r"to inner\.0\.v_row\.encoder\.0\.weight, of shape .*no axis 'modle'"):
        ft.partition_specs(state, {"encoder.0.weight": P("modle")}, mesh=MESH2, strict=False)
