"""Trees as named arrays plus JSON type information, and back."""

import contextlib
import dataclasses
import enum
import functools
import json
import re
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hypothesis import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import functree as ft
from functree.train.checkpoint._treespec import SpecError, decode, encode


class Config(ft.Module):
    w: jax.Array
    dtype: object = ft.field(static=True, default=np.dtype("float32"))
    callback: object = ft.field(static=True, default=None)


def test_roundtrip_through_json():
    tree = {
        "state": optax.adam(0.1).init({"w": jnp.ones(2)}),
        "dense": ft.nn.Dense(2, 2, jax.nn.gelu, key=jax.random.key(0)),
        "numbers": [1, 2.5, True, np.float32(3)],
        "nothing": None,
        "keys": {3: jax.random.key(1), 4: jnp.zeros(1)},
    }
    arrays, spec = encode(tree)
    back = decode(json.loads(json.dumps(spec)), arrays)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert back["dense"].activation is jax.nn.gelu and 3 in back["keys"]
    assert back["numbers"][:3] == [1, 2.5, True] and isinstance(back["numbers"][3], np.float32)
    np.testing.assert_array_equal(jax.random.key_data(back["keys"][3]), jax.random.key_data(tree["keys"][3]))


def test_unrebuildable_static_value():
    arrays, spec = encode(Config(jnp.ones(1), callback=lambda x: x))
    with pytest.raises(SpecError, match=r"static value at 'callback'.*<lambda>"):
        decode(spec, arrays)
    arrays, spec = encode(Config(jnp.ones(1)))
    assert decode(spec, arrays).dtype == np.dtype("float32")


@ft.train.register
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Registered:
    counts: jax.Array
    name: str = dataclasses.field(metadata={"static": True}, default="ctx")


def test_registered_dataclass_roundtrip():
    tree = Registered(jnp.arange(3), "run")
    arrays, spec = encode(tree)
    assert spec["kind"] == "dataclass" and spec["static"] == {"name": {"json": "run"}}
    back = decode(json.loads(json.dumps(spec)), arrays)
    assert type(back) is Registered and back.name == "run"
    np.testing.assert_array_equal(back.counts, tree.counts)
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_every_name_in_the_functree_table_resolves():
    from functree.train.checkpoint import _registry

    for package, names in _registry.FUNCTREE_TYPES.items():
        for name in names:
            assert _registry.lookup_type(f"{package}.{name}"), f"{package}.{name} is gone"
    for name in _registry.OPTAX_STATES:
        assert _registry.lookup_type(f"optax.{name}"), name


@pytest.mark.parametrize("name", ["sgd", "rmsprop", "adagrad", "adadelta", "adam", "adamw",
                                  "adamax", "amsgrad", "radam", "lion", "nadam", "rprop", "asgd", "sgd_dampening"])
def test_every_functree_optimizer_state_rebuilds_without_a_template(name):
    """nadam, rprop, asgd and sgd(dampening=) states: "not a registered type" until 2026-12-05."""
    model = ft.nn.Sequential(ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.BatchNorm(3))
    tx = ft.optim.sgd(1e-3, 0.9, dampening=0.5) if name == "sgd_dampening" else getattr(ft.optim, name)(1e-3)
    optimizer = ft.optim.Optimizer(optax.chain(ft.optim.clip_by_global_norm(1.0), tx))
    state = optimizer.init(model)
    arrays, spec = encode(state)
    back = decode(json.loads(json.dumps(spec)), arrays)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert "_" not in "".join(c.split(".")[-2] for c in _classes(spec))  # public names only


def _classes(spec):
    if isinstance(spec, dict):
        return ([spec["class"]] if "class" in spec else []) + [
            c for v in spec.values() for c in _classes(v)]
    if isinstance(spec, list):
        return [c for v in spec for c in _classes(v)]
    return []


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.sampled_from(
        ["leaf", "module", "namedtuple", "dataclass", "dict", "list", "opaque", "os.system",
         "functree.nn.Dense", "optax.ScaleByAdamState", "builtins:eval", "weight", "O"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["kind", "class", "key", "items", "fields", "static", "keys", "json",
                         "function", "import", "dtype", "tuple", "python", "prng"]), inner, max_size=3),
    max_leaves=8,
)


def _nodes(spec, out):
    out.append(spec)
    if isinstance(spec, dict):
        for v in spec.values():
            _nodes(v, out)
    elif isinstance(spec, list):
        for v in spec:
            _nodes(v, out)
    return out


_ENCODED = encode({
    "model": ft.nn.Sequential(ft.nn.Dense(2, 2, jax.nn.relu, key=jax.random.key(0)), ft.nn.Lambda(jnp.tanh)),
    "state": optax.adam(0.1).init({"w": jnp.ones(2)}),
    "n": [1, 2.5],
})


@settings(max_examples=examples(150), deadline=None)
@given(where=st.integers(0, 10**6), key=st.sampled_from(["kind", "class", "key", "items", "fields",
                                                          "static", "keys", "activation", "fn"]),
       value=_JSON)
def test_any_damaged_spec_raises_only_spec_errors(where, key, value):
    arrays, spec = _ENCODED
    spec = json.loads(json.dumps(spec))
    dicts = [n for n in _nodes(spec, []) if isinstance(n, dict)]
    dicts[where % len(dicts)][key] = value
    with contextlib.suppress(SpecError):  # any other exception fails the test
        decode(spec, arrays)


def test_a_class_saved_from_main_names_the_registration_that_works_in_both_places(tmp_path):
    class NotebookMLP(ft.Module):
        w: jax.Array

    NotebookMLP.__module__, NotebookMLP.__qualname__ = "__main__", "NotebookMLP"  # defined in a notebook
    path = str(tmp_path / "ckpt")
    ft.train.save(path, NotebookMLP(jnp.ones(2)))
    NotebookMLP.__module__ = "mypackage.models"  # later imported from a module
    with pytest.raises(SpecError, match=r'ft\.train\.register\(NotebookMLP, name="__main__\.NotebookMLP"\)'):
        ft.train.load(path)
    ft.train.register(NotebookMLP, name="__main__.NotebookMLP")
    np.testing.assert_array_equal(ft.train.load(path).w, [1.0, 1.0])


@pytest.mark.parametrize("rotary", [
    ft.nn.RopeScaling("llama3", base=500000.0, factor=8.0, original_max_positions=64),
    ft.nn.RopeScaling("longrope", short_factor=(1.0, 1.5), long_factor=(4.0, 5.0), original_max_positions=32,
                      partial=0.5),
    10000.0,
], ids=["llama3", "longrope", "plain-base"])
def test_rotary_attention_rebuilds_without_a_template(rotary):
    """A rotary layer's RopeScaling (every from_hf Llama-like model has one) is stored as its
    fields and rebuilt as data: ft.train.load(path) needs no template for it."""
    layer = ft.nn.MultiheadAttention(8, 2, rotary=rotary, key=jax.random.key(0))
    arrays, spec = encode(layer)
    back = decode(json.loads(json.dumps(spec)), arrays)
    assert back.rotary == layer.rotary and type(back.rotary) is type(layer.rotary)
    assert jax.tree.structure(back) == jax.tree.structure(layer)


def _rope_code(spec):
    """The stored code of the first RopeScaling in ``spec`` (a dict to tamper with)."""
    if isinstance(spec, dict):
        if "record" in spec:
            return spec["record"][1]
        found = (_rope_code(v) for v in spec.values())
    elif isinstance(spec, list):
        found = (_rope_code(v) for v in spec)
    else:
        return None
    return next((f for f in found if f is not None), None)


@pytest.mark.parametrize(("change", "message"), [
    ({"kind": {"json": "ntk"}}, r"rope type .ntk. is not covered"),
    ({"factor": {"function": "jax.nn.relu"}}, r"RopeScaling.factor is .*not a number or a name"),
    ({"payload": {"json": 1}}, r"RopeScaling has no field \['payload'\]"),
    ({"short_factor": {"tuple": [{"json": "x"}]}}, r"RopeScaling.short_factor is \('x',\)"),
], ids=["bad-kind", "a-function", "unknown-field", "text-factors"])
def test_a_tampered_rope_scaling_is_refused(change, message):
    layer = ft.nn.MultiheadAttention(8, 2, rotary=ft.nn.RopeScaling("linear", factor=2.0), key=jax.random.key(0))
    arrays, spec = encode(layer)
    spec = json.loads(json.dumps(spec))
    _rope_code(spec).update(change)
    with pytest.raises(SpecError, match=message):
        decode(spec, arrays)


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A static configuration record of the user's (a layer's option)."""

    kind: str = "plain"
    factors: tuple[float, ...] = (1.0,)


class WithScaled(ft.Module):
    w: jax.Array
    scaled: object = ft.field(static=True, default=Scaled())


def test_a_registered_static_record_rebuilds_and_an_unregistered_one_needs_a_template():
    """The mechanism RopeScaling uses is every registered frozen dataclass's: stored as its
    fields, rebuilt by its registered class; unregistered, it is named and refused."""
    tree = WithScaled(jnp.ones(2), Scaled("wide", (2.0, 3.0)))
    arrays, spec = encode(tree)
    with pytest.raises(SpecError, match=r"(?s)stored as its text .*registering the class now cannot rebuild"):
        decode(json.loads(json.dumps(spec)), arrays)
    ft.train.register(Scaled, "tests.Scaled")
    arrays, spec = encode(tree)
    back = decode(json.loads(json.dumps(spec)), arrays)
    assert back.scaled == Scaled("wide", (2.0, 3.0)) and type(back.scaled) is Scaled


def test_a_static_field_added_since_reads_at_its_default_and_no_other_may_be_missing():
    # A LoraDense written before it had saved_modules (files of earlier versions) reads with
    # the field's default; a file missing any other static field (alpha) is refused.
    layer = ft.nn.LoraDense(ft.nn.Dense(3, 2, key=jax.random.key(0)), rank=2, alpha=4.0, key=jax.random.key(1))
    layer = layer.replace(saved_modules=("lm_head",))
    arrays, spec = encode(layer)
    assert decode(json.loads(json.dumps(spec)), arrays).saved_modules == ("lm_head",)
    older = json.loads(json.dumps(spec))
    del older["static"]["saved_modules"]
    back = decode(older, arrays)
    assert back.saved_modules == () and back.alpha == 4.0 and jnp.array_equal(back.lora_a, layer.lora_a)
    damaged = json.loads(json.dumps(spec))
    del damaged["static"]["alpha"]
    with pytest.raises(SpecError, match=r"LoraDense has fields \[.*'alpha'.*now, the checkpoint's had \['activation', "
                                        r"'bias'.*\(added: \['alpha'\]\)"):
        decode(damaged, arrays)


class TiedLM(ft.Module):
    embed: ft.nn.Embedding
    head: ft.nn.Dense

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def test_a_shared_model_tied_by_transpose_rebuilds_without_a_template():
    """ft.nn.Shared's ties hold key paths (a tuple subclass) and jnp.transpose: the key paths
    came back as plain tuples ("'tuple' object has no attribute 'get'" at the first call)
    and jnp.transpose was not a registered name. Both rebuild now; a damaged path is refused."""
    k1, k2 = jax.random.split(jax.random.key(0))
    lm = ft.nn.Shared(TiedLM(ft.nn.Embedding(10, 4, key=k1), ft.nn.Dense(4, 10, key=k2)),
                      {"head.weight": ("embed.embeddings", jnp.transpose)})
    arrays, spec = encode(lm)
    back = decode(json.loads(json.dumps(spec)), arrays)
    tokens = jnp.array([[1, 2, 3]])
    assert back.ties == lm.ties and all(isinstance(p, ft.KeyPath) for p in back.ties[0][:2])
    np.testing.assert_array_equal(back(tokens), lm(tokens))
    damaged = json.loads(json.dumps(spec).replace('"key_path": ".head.weight"', '"key_path": "][head"'))
    with pytest.raises(SpecError, match=r"key path '\]\[head'"):
        decode(damaged, arrays)


@jax.tree_util.register_pytree_with_keys_class
class _KeyedState:
    """A foreign pytree shaped like Flax NNX's State: a mapping whose children have keys
    (``kernel``), each a node with an attribute ``value``; neither is registered."""

    def __init__(self, items):
        self.items = dict(items)

    def tree_flatten_with_keys(self):
        return tuple((jax.tree_util.DictKey(k), v) for k, v in self.items.items()), tuple(self.items)

    @classmethod
    def tree_unflatten(cls, keys, children):
        return cls(zip(keys, children))


@jax.tree_util.register_pytree_with_keys_class
class _Variable:
    def __init__(self, value):
        self.value = value

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("value"), self.value),), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_opaque_nodes_are_named_by_key_path_and_restore_with_a_template(tmp_path):
    tree = _KeyedState({"kernel": _Variable(jnp.arange(6.0).reshape(2, 3)), "bias": _Variable(jnp.ones(3))})
    arrays, _ = encode(tree)
    assert sorted(arrays) == ["bias.value", "kernel.value"]  # was ['0.0', '1.0']: not the template's names
    ft.train.save(tmp_path / "c", tree)
    back = ft.train.load(tmp_path / "c", tree)  # was CheckpointError: missing ['bias.value', 'kernel.value']
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(SpecError, match=r"(?s)register_pytree_with_keys\), not a Module, dataclass.*"
                                        r"right:  ft.train.load\(path, template=tree\)"):  # no template: the fix
        ft.train.load(tmp_path / "c")


def test_nnx_state_round_trip(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    _, params = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Param)
    ft.train.save(tmp_path / "p", params)
    back = ft.train.load(tmp_path / "p", params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_function_leaf_is_stored_by_name_and_a_tampered_name_is_refused():
    arrays, spec = encode({"w": jnp.ones(2), "act": jax.nn.relu})
    assert sorted(arrays) == ["w"]  # no array for the function
    assert decode(spec, arrays)["act"] is jax.nn.relu
    node = spec["items"][spec["keys"].index(["str", "act"])]
    assert node == {"kind": "function", "name": "jax.nn.relu", "key": "act"}
    node["name"] = "os.system"  # a file names any function: nothing is imported
    with pytest.raises(SpecError, match=r"the function 'os\.system' is not registered"):
        decode(spec, arrays)
    node["key"] = "w"  # a function leaf claiming the stored array's name
    with pytest.raises(SpecError, match="names the stored array 'w'"):
        ft.train.checkpoint._treespec.check_names(spec, arrays)


def _trainer_on(params, tmp_path):
    def loss_fn(p, b):
        leaves = jax.tree.leaves(p)
        return sum(jnp.sum((leaf - b) ** 2) for leaf in leaves)

    trainer = ft.train.Trainer(params, optax.adam(1e-2), loss_fn)
    trainer.fit([jnp.float32(0.5)] * 2, epochs=1, progress=False)
    trainer.save(tmp_path / "job")
    trained = jax.tree.map(np.asarray, trainer.model)
    fresh = ft.train.Trainer(params, optax.adam(1e-2), loss_fn)
    fresh.restore(tmp_path / "job")  # was CheckpointError: missing ['bias.value', ...] unexpected ['0.0', ...]
    for a, b in zip(jax.tree.leaves(fresh.model), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert fresh.steps_run == 2


def test_trainer_save_and_restore_of_a_keyed_foreign_state(tmp_path):
    _trainer_on(_KeyedState({"kernel": _Variable(jnp.ones((2, 3))), "bias": _Variable(jnp.zeros(3))}), tmp_path)


def test_trainer_save_and_restore_of_an_nnx_state(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    _, params = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Param)
    _trainer_on(params, tmp_path)


# ---- static values stored as data: leafless Modules, Enum members, NumPy scalars ------------

class Mode(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Leaky(ft.Module):
    """An activation with a slope (docs/migration/equinox.md): a leafless Module in a static field."""

    slope: float = ft.field(static=True, default=0.1)

    def __call__(self, x):
        return jnp.where(x > 0, x, self.slope * x)


class Configured(ft.Module):
    w: jax.Array
    act: Leaky = ft.field(static=True, default=Leaky(0.2))
    mode: Mode = ft.field(static=True, default=Mode.SUM)
    level: Level = ft.field(static=True, default=Level.HIGH)
    eps: object = ft.field(static=True, default=np.float32(1e-3))
    wide: object = ft.field(static=True, default=np.float64(1e-7))
    size: object = ft.field(static=True, default=np.int64(6))
    flag: object = ft.field(static=True, default=np.bool_(True))
    half: object = ft.field(static=True, default=jnp.dtype("bfloat16").type(0.1))
    phase: object = ft.field(static=True, default=np.complex64(1 - 2j))

    def __call__(self, x):
        y = self.act(x * self.w) / jnp.sqrt(jnp.mean(x ** 2) + self.eps)
        return (jnp.sum(y) if self.mode is Mode.SUM else jnp.mean(y)) * int(self.size) * int(self.level)


_STATIC = ("act", "mode", "level", "eps", "wide", "size", "flag", "half", "phase")


def _tampered(path, change):
    """The saved metadata of ``path`` changed by ``change(meta)``, its CRC-32 recomputed (a file
    changed on purpose, not damage the checksum catches)."""
    from functree.train.checkpoint._checkpoint import metadata_digest
    file = path / "meta" / "metadata"
    meta = json.loads(file.read_text())
    change(meta)
    meta["digest"] = metadata_digest(meta)
    file.write_text(json.dumps(meta))


def test_leafless_modules_enum_members_and_numpy_scalars_load_without_a_template(tmp_path):
    """They were stored as their repr: ft.train.load(path) refused them ("register it"), and
    register(Enum) raised while register(Leaky) did not help. Now they are data, rebuilt as
    the same values of the same types, so the model computes what was saved."""
    model = Configured(jnp.array([1.0, -2.0]))
    ft.train.save(tmp_path / "c", model)
    back = ft.train.load(tmp_path / "c")
    for name in _STATIC:
        saved, loaded = getattr(model, name), getattr(back, name)
        assert type(loaded) is type(saved) and loaded == saved, name
    assert back.act == Leaky(0.2) and back.mode is Mode.SUM and back.level is Level.HIGH
    x = jnp.array([0.5, 3.0])
    np.testing.assert_allclose(back(x), model(x), rtol=0, atol=0)
    assert jax.tree.structure(back) == jax.tree.structure(model)  # the same static configuration
    assert ft.train.register(Mode) is Mode  # was TypeError: an Enum registers (a class saved from __main__)


def test_a_template_with_another_leafless_module_or_enum_member_is_refused(tmp_path):
    """Stored as reprs they were never compared: a template's Leaky(0.3) replaced the saved
    Leaky(0.2) silently. A file that stored an np.float64 as a JSON number still fits."""
    ft.train.save(tmp_path / "c", Configured(jnp.ones(2)))
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)act: saved Leaky\(slope=0.2\), the template's "
                                                        r"Leaky\(slope=0.3\).*mode: saved Mode.SUM, the template's Mode.MEAN"):
        ft.train.load(tmp_path / "c", Configured(jnp.ones(2), Leaky(0.3), Mode.MEAN))
    with pytest.raises(ft.train.CheckpointError, match=r"eps: saved np.float32\(0.0010000000474974513\)"):
        ft.train.load(tmp_path / "c", Configured(jnp.ones(2), eps=np.float32(1e-2)))

    def as_before(meta):  # how files written before stored an np.float64 and an IntEnum member
        static = meta["spec"]["static"]
        static["wide"], static["level"] = {"json": 1e-7}, {"json": 2}
    _tampered(tmp_path / "c", as_before)
    back = ft.train.load(tmp_path / "c", Configured(jnp.ones(2)))
    assert type(back.wide) is np.float64 and back.level is Level.HIGH  # the template's


@pytest.mark.parametrize(("field", "code", "message"), [
    ("mode", {"enum": ["tests.Missing", "SUM"]}, r"static value at 'mode'.*the Enum tests.Missing is not registered"),
    ("mode", {"enum": [None, "SUM"]}, r"damaged at 'mode'"),
    ("eps", {"numpy": ["float32", "1e-3"]}, r"damaged at 'eps': float32 scalar stored as 1e-3"),
    ("eps", {"numpy": ["object", 1]}, r"damaged at 'eps': dtype 'object' is not a numeric dtype"),
    ("size", {"numpy": ["int8", 300]}, r"damaged at 'size': int8 scalar stored as 300"),
    ("eps", {"numpy": ["float16", 1e300]}, r"damaged at 'eps': float16 scalar stored as 1e\+300"),
    ("flag", {"numpy": ["bool", 1]}, r"damaged at 'flag': bool scalar stored as 1"),
    ("act", {"module": {"kind": "module", "class": "os.system", "static": {}, "fields": {}}},
     r"a node at 'act'.*os.system is not a registered type"),
    ("act", {"module": {"kind": "module", "class": "tests.x.Leaky", "static": {}, "fields": {"w": {
        "kind": "leaf", "key": "w"}}}}, r"at 'act' was edited .*: Leaky has fields \['slope'\] now, the checkpoint's had \['w'\]"),
    ("act", {"module": {"kind": "module", "class": "tests.x.Leaky", "static": {"slope": {"repr": "x"}},
                        "fields": {}}}, r"static value at 'act.slope' without a template: it was stored as its text x"),
], ids=["unknown-enum", "enum-not-a-name", "text-value", "object-dtype", "out-of-range", "float-overflow",
        "bool-as-int", "unknown-module", "module-with-a-leaf", "module-repr-field"])
def test_a_tampered_static_value_is_refused_by_name(tmp_path, field, code, message):
    ft.train.save(tmp_path / "c", Configured(jnp.ones(2)))
    if code.get("module", {}).get("class") == "tests.x.Leaky":  # the saved class's real name
        code["module"]["class"] = json.loads((tmp_path / "c" / "meta" / "metadata").read_text()
                                             )["spec"]["static"]["act"]["module"]["class"]
    _tampered(tmp_path / "c", lambda meta: meta["spec"]["static"].update({field: code}))
    with pytest.raises(SpecError, match=message):
        ft.train.load(tmp_path / "c")


def test_an_enum_member_not_in_its_class_is_refused(tmp_path):
    ft.train.save(tmp_path / "c", Configured(jnp.ones(2)))
    _tampered(tmp_path / "c", lambda meta: meta["spec"]["static"]["mode"]["enum"].__setitem__(1, "__class__"))
    with pytest.raises(SpecError, match=r"damaged at 'mode': the Enum Mode has no member '__class__'"):
        ft.train.load(tmp_path / "c")


def test_an_enum_saved_from_main_names_the_registration_that_works(tmp_path):
    Color = enum.Enum("Color", {"RED": 1})
    Color.__module__, Color.__qualname__ = "__main__", "Color"  # defined in a notebook

    class Painted(ft.Module):
        w: jax.Array
        color: object = ft.field(static=True, default=Color.RED)

    ft.train.save(tmp_path / "c", Painted(jnp.ones(2)))
    Color.__module__ = "mypackage.colors"  # later imported from a module
    with pytest.raises(SpecError, match=r'ft\.train\.register\(Color, name="__main__\.Color"\)'):
        ft.train.load(tmp_path / "c")
    ft.train.register(Color, name="__main__.Color")
    assert ft.train.load(tmp_path / "c").color is Color.RED


class Color(enum.Flag):
    R = 1
    G = 2
    B = 4


class Perm(enum.IntFlag):
    READ = 4
    WRITE = 2


class Flagged(ft.Module):
    w: jax.Array
    color: Color = ft.field(static=True, default=Color.R | Color.G)
    rx: re.RegexFlag = ft.field(static=True, default=re.IGNORECASE | re.MULTILINE)
    perm: Perm = ft.field(static=True, default=Perm.READ | Perm.WRITE)
    none: Color = ft.field(static=True, default=Color(0))

    def __call__(self, x):
        return x * self.w * (self.color.value + int(self.rx) + int(self.perm))


_FLAGS = ("color", "rx", "perm", "none")


def test_a_flag_combination_loads_as_its_flag_with_and_without_a_template(tmp_path):
    """Before: ``re.IGNORECASE | re.MULTILINE`` (an IntFlag: an int) loaded as the plain int
    10, and ``Color.R | Color.G`` was stored as text, refused without a template. A Flag
    combination is stored as its class (resolved as an Enum member's) and its bits."""
    model = Flagged(jnp.array([1.0, -2.0]))
    ft.train.save(tmp_path / "c", model)
    x = jnp.array([0.5, 3.0])
    for back in (ft.train.load(tmp_path / "c"), ft.train.load(tmp_path / "c", Flagged(jnp.zeros(2)))):
        for name in _FLAGS:
            saved, loaded = getattr(model, name), getattr(back, name)
            assert type(loaded) is type(saved) and loaded == saved, name
        assert jax.tree.structure(back) == jax.tree.structure(model)
        np.testing.assert_allclose(back(x), model(x), rtol=0, atol=0)
    with pytest.raises(ft.train.CheckpointError, match=r"rx: saved RegexFlag\(10\), the template's RegexFlag.IGNORECASE"):
        ft.train.load(tmp_path / "c", Flagged(jnp.ones(2), rx=re.IGNORECASE))

    def as_before(meta):  # how files written before stored an IntFlag combination
        meta["spec"]["static"]["rx"] = {"json": 10}
    _tampered(tmp_path / "c", as_before)
    back = ft.train.load(tmp_path / "c", Flagged(jnp.ones(2)))
    assert type(back.rx) is re.RegexFlag and back.rx == re.IGNORECASE | re.MULTILINE  # the template's


@pytest.mark.parametrize(("field", "code", "message"), [
    ("rx", {"flag": ["re.RegexFlag", 1 << 20]}, r"damaged at 'rx': 1048576 is not a combination of the RegexFlag flags"),
    ("perm", {"flag": ["tests.x.Perm", 1]}, r"damaged at 'perm': 1 is not a combination of the Perm flags \(READ=4 \| WRITE=2\)"),
    ("color", {"flag": ["tests.x.Color", -1]}, r"damaged at 'color': -1 is not a combination of the Color flags"),
    ("color", {"flag": ["tests.x.Color", True]}, r"damaged at 'color': True is not an int"),
    ("color", {"flag": ["tests.x.Color", "3"]}, r"damaged at 'color': '3' is not an int"),  # was "3 is not a combination"
    ("color", {"flag": ["tests.x.Mode", 1]}, r"damaged at 'color': the Enum Mode is not a Flag"),
    ("color", {"flag": ["tests.Missing", 1]}, r"static value at 'color'.*the Enum tests.Missing is not registered"),
    ("color", {"flag": [None, 1]}, r"damaged at 'color'"),
], ids=["bits-outside", "intflag-bits-outside", "negative", "bool", "text", "not-a-flag", "unknown", "no-name"])
def test_a_tampered_flag_combination_is_refused_by_name(tmp_path, field, code, message):
    ft.train.save(tmp_path / "c", Flagged(jnp.ones(2)))
    stored = json.loads((tmp_path / "c" / "meta" / "metadata").read_text())["spec"]["static"]
    prefix = stored["color"]["flag"][0].rsplit(".", 1)[0]  # the saved classes' real module
    if isinstance(code["flag"][0], str) and code["flag"][0].startswith("tests.x."):
        code["flag"][0] = prefix + "." + code["flag"][0].rsplit(".", 1)[-1]
    _tampered(tmp_path / "c", lambda meta: meta["spec"]["static"].update({field: code}))
    with pytest.raises(SpecError, match=message):
        ft.train.load(tmp_path / "c")


# ---- dict keys ------------------------------------------------------------------------------

class Heads(ft.Module):
    heads: dict


@pytest.mark.parametrize("key", [(0, 1), 0.5, Mode.SUM, np.float32(2)], ids=["tuple", "float", "enum", "np-float"])
def test_a_dict_key_no_checkpoint_reads_back_is_refused_at_save(tmp_path, key):
    """Saved as [type, str(key)], such a file loaded as "damaged"; now nothing is written and
    the error names the dict, the key and a key that works."""
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)The dict at 'heads' has the key .*Nothing was "
                                                        r"written.*right:  \{\""):
        ft.train.save(tmp_path / "c", Heads({key: jnp.ones(2)}))
    assert not (tmp_path / "c").exists()
    with pytest.raises(ft.train.CheckpointError, match=r"The dict at the root has the key \(0, 1\)"):
        encode({(0, 1): jnp.ones(2)})


def test_a_numpy_text_keys_fix_keeps_its_trailing_nuls_and_collides_with_no_other_key(tmp_path):
    """The issue: an np.str_ key was named np.str_('a') and offered the fix {"a": value}
    (str() drops trailing NULs): on a dict that also held "a", the rename made the two keys
    one (2 keys became 1, the other array lost). Now it is shown and offered with its NULs
    ("a\\x00", escaped), the fix's dict saves both arrays; a text that another key of the
    dict is or is offered (two tuples joined to "a_b", a surrogate replaced onto a key there)
    gets "_2" and a note, and an np.str_ is not cut at 40 characters."""
    tree = {"a": jnp.ones(1), np.str_("a\x00"): jnp.zeros(1)}
    with pytest.raises(ft.train.CheckpointError, match=r"has the key np\.str_\('a\\x00'\), a str_") as info:
        ft.train.save(tmp_path / "c", tree)
    assert not (tmp_path / "c").exists() and info.value.key_text == "a\x00"  # pyright: ignore[reportAttributeAccessIssue]
    right = re.search(r"right:  (.*)", str(info.value)).group(1)
    assert right == '{"a\\x00": value}'
    fixed = {**{k: v for k, v in tree.items() if type(k) is str}, **eval(right, {"value": tree[np.str_("a\x00")]})}
    assert len(fixed) == 2
    ft.train.save(tmp_path / "c", fixed)
    back = ft.train.load(tmp_path / "c")
    assert sorted(back) == ["a", "a\x00"] and float(back["a\x00"][0]) == 0.0 and float(back["a"][0]) == 1.0
    cases = [({np.bytes_(b"b\x00"): 1}, r'\{"b\'b\\\\x00\'": value\}$'),
             ({np.str_("a" * 45): 1, "a" * 40: 2}, rf'\{{"{"a" * 45}": value\}}$'),
             ({("a_b",): 1, ("a", "b"): 2}, r'\{"a_b_2": value\}\n    \(not "a_b": another key of this dict is that text, '
                                          r'or is offered it, and the two would be one; any text of its own\)$'),
             ({"caf\udce9": 1, "caf?": 2}, r"\{'caf\?_2': value\}    # key.encode(.|\n)*\(not \"caf\?\": another key")]
    for keys, right in cases:
        with pytest.raises(ft.train.CheckpointError, match=r"(?s)Nothing was written.*right:  " + right):
            encode({k: jnp.full(1, v) for k, v in keys.items()})


def test_layer_state_keyed_by_key_paths_is_refused_naming_apply_state(tmp_path):
    """collect_state's updates ({KeyPath: value}): the fix offered the key ".layers_[0]_.running_mean"
    (the path's entries joined by "_"); now ft.nn.apply_state, or the paths' text, which
    KeyPath.parse reads back (that dict saves and loads)."""
    model = ft.nn.training(ft.nn.Sequential([ft.nn.BatchNorm(3)]))
    _, updates = ft.nn.collect_state(lambda m: m(jnp.ones((4, 3))), model)
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)has the key KeyPath\('\.layers\[0\]\.running_mean'\), "
                                                        r"a KeyPath.*ft\.nn\.apply_state\(model, updates\)") as info:
        ft.train.save(tmp_path / "c", updates)
    assert '{".layers[0].running_mean": value}' in str(info.value) and not (tmp_path / "c").exists()
    ft.train.save(tmp_path / "c", {str(k): v for k, v in updates.items()})
    back = {ft.KeyPath.parse(k): v for k, v in ft.train.load(tmp_path / "c").items()}
    assert back.keys() == updates.keys()
    assert all(np.array_equal(back[k], updates[k]) for k in updates)


@pytest.mark.parametrize("key", [True, np.int64(3), np.uint8(200), -4, "x"], ids=["bool", "int64", "uint8", "int", "str"])
def test_bool_and_numpy_integer_dict_keys_round_trip_exactly(tmp_path, key):
    tree = Heads({key: jnp.ones(2)})
    ft.train.save(tmp_path / "c", tree)
    for back in (ft.train.load(tmp_path / "c"), ft.train.load(tmp_path / "c", tree)):
        (loaded,) = back.heads
        assert type(loaded) is type(key) and loaded == key
        np.testing.assert_array_equal(back.heads[loaded], tree.heads[key])


@pytest.mark.parametrize("stored", [["bool", "yes"], ["int8", "300"], ["tuple", "(0, 1)"], ["float64", "1"]],
                         ids=["bool-text", "out-of-range", "tuple", "np-float"])
def test_a_tampered_dict_key_is_refused_as_damage(tmp_path, stored):
    ft.train.save(tmp_path / "c", Heads({True: jnp.ones(2)}))
    _tampered(tmp_path / "c", lambda meta: meta["spec"]["fields"]["heads"].update(keys=[stored]))
    with pytest.raises(SpecError, match=r"damaged at 'heads'"):
        ft.train.load(tmp_path / "c")


def test_a_dict_key_stored_twice_is_refused_as_damage(tmp_path):
    """A re-signed file whose dict names one key twice loaded with one entry silently dropped."""
    ft.train.save(tmp_path / "c", Heads({1: jnp.ones(2), 2: jnp.zeros(2)}))
    _tampered(tmp_path / "c", lambda meta: meta["spec"]["fields"]["heads"].update(keys=[["int", "1"], ["int", "1"]]))
    with pytest.raises(SpecError, match=r"damaged at 'heads': the key 1 appears twice"):
        ft.train.load(tmp_path / "c")


# --- classes edited between save and restore (a notebook cell run again) ----------------------

def _cell(cls, name):
    """``cls`` as a notebook cell defines it: module and qualified name those of a re-run of
    the same cell, registered under ``name`` (a re-run takes the name over)."""
    cls.__module__, cls.__qualname__, cls.__name__ = "edited_cells", name, name
    return ft.train.register(cls, name=f"edited_cells.{name}")


def test_a_namedtuple_with_reordered_fields_loads_each_value_into_its_saved_field(tmp_path):
    # Saved Stats(mean=[0, 1], var=[4, 9]); the class redefined as (var, mean) loaded them by
    # position before: var=[0, 1], mean=[4, 9]. Now by the saved field names.
    class Old(NamedTuple):
        mean: jax.Array
        var: jax.Array

    class New(NamedTuple):
        var: jax.Array
        mean: jax.Array

    _cell(Old, "Stats")
    ft.train.save(tmp_path / "s", {"stats": Old(jnp.array([0.0, 1.0]), jnp.array([4.0, 9.0]))})
    arrays, spec = encode({"stats": Old(jnp.array([0.0, 1.0]), jnp.array([4.0, 9.0]))})
    _cell(New, "Stats")
    back = ft.train.load(tmp_path / "s")["stats"]
    assert type(back) is New
    np.testing.assert_array_equal(np.asarray(back.mean), [0.0, 1.0])
    np.testing.assert_array_equal(np.asarray(back.var), [4.0, 9.0])
    # A file written before names were stored: the names come from the leaves' stored keys.
    older = json.loads(json.dumps(spec))
    del older["items"][0]["names"]
    back = decode(older, arrays)["stats"]
    np.testing.assert_array_equal(np.asarray(back.mean), [0.0, 1.0])
    np.testing.assert_array_equal(np.asarray(back.var), [4.0, 9.0])


def test_an_old_namedtuple_whose_keys_were_suffixed_twice_loads_by_its_field_names():
    """A file written before the names were stored, where two dict keys took the field's
    dotted name first ("x.a", "x.a_"): the writer suffixed the field's key twice ("x.a__");
    the reader stripped one "_" and refused the intact file as a class edit."""
    class P(NamedTuple):
        a: jax.Array
        b: jax.Array

    _cell(P, "P")
    tree = {"x.a": jnp.ones(1), "x.a_": jnp.zeros(1), "x": P(jnp.arange(2.0), jnp.arange(3.0))}
    arrays, spec = encode(tree)
    item = next(s for (_, key), s in zip(spec["keys"], spec["items"]) if key == "x")
    del item["names"]
    assert "x.a__" in arrays
    back = decode(spec, arrays)
    np.testing.assert_array_equal(np.asarray(back["x"].a), np.arange(2.0))
    np.testing.assert_array_equal(np.asarray(back["x"].b), np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(back["x.a_"]), np.zeros(1))


def test_an_old_namedtuple_spec_without_names_or_keys_loads_by_position():
    class Pair(NamedTuple):
        first: object
        second: jax.Array

    _cell(Pair, "Pair")
    arrays, spec = encode(Pair(None, jnp.array([2.0, 3.0])))  # item 0: a None, no leaf to name it
    assert spec["names"] == ["first", "second"]
    del spec["names"]
    back = decode(spec, arrays)
    assert back.first is None
    np.testing.assert_array_equal(np.asarray(back.second), [2.0, 3.0])
    # Keys of another prefix (a file whose keys do not start with the node's path): by position.
    arrays, spec = encode({"p": Pair(None, jnp.array([2.0, 3.0]))})
    del spec["items"][0]["names"]
    spec["items"][0]["items"][1]["key"] = "elsewhere"
    back = decode(spec, {"elsewhere": arrays["p.second"]})["p"]
    np.testing.assert_array_equal(np.asarray(back.second), [2.0, 3.0])


def test_a_namedtuple_with_renamed_fields_is_refused_as_an_edit_of_its_class(tmp_path):
    class Old(NamedTuple):
        mean: jax.Array
        var: jax.Array

    class New(NamedTuple):
        std: jax.Array
        mu: jax.Array

    _cell(Old, "Moments")
    ft.train.save(tmp_path / "s", {"stats": Old(jnp.array([0.0, 1.0]), jnp.array([4.0, 9.0]))})
    arrays, spec = encode(Old(jnp.array([0.0, 1.0]), jnp.array([4.0, 9.0])))
    _cell(New, "Moments")
    edited = r"class `edited_cells.Moments` at 'stats' was edited .*Moments has fields \['mu', 'std'\] now, " \
             r"the checkpoint's had \['mean', 'var'\]"
    with pytest.raises(SpecError, match=edited) as e:
        ft.train.load(tmp_path / "s")
    assert "damaged" not in str(e.value) and "template=model" in str(e.value)
    del spec["names"]  # an older file: the same refusal, from its stored keys
    with pytest.raises(SpecError, match=r"Moments has fields \['mu', 'std'\] now, the checkpoint's had \['mean', 'var'\]"):
        decode(spec, arrays)


class Net(ft.Module):
    l1: ft.nn.Dense
    l2: ft.nn.Dense

    def __call__(self, x):
        return self.l2(self.l1(x))


class MLP(ft.Module):  # Net renamed in a notebook
    l1: ft.nn.Dense
    l2: ft.nn.Dense

    def __call__(self, x):
        return self.l2(self.l1(x))


def _net_reference(net, x):
    """relu(x W1 + b1) W2 + b2 in NumPy, from the saved model's arrays."""
    w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in (net.l1.weight, net.l1.bias, net.l2.weight, net.l2.bias))
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def test_a_template_of_a_renamed_class_or_a_dict_is_checked_for_the_saved_static_fields(tmp_path):
    # A template MLP(Dense(tanh)) for a saved Net(Dense(relu)) loaded with tanh silently
    # (outputs [0.418, 0.049] for the saved [0.294, 0.056]): the classes differ by name, so
    # the static check stopped at the root. Children are now matched by field name.
    net = Net(l1=ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(0)), l2=ft.nn.Dense(4, 2, key=jax.random.key(1)))
    ft.train.save(tmp_path / "a", net)
    tanh = MLP(l1=ft.nn.Dense(3, 4, jax.nn.tanh, key=jax.random.key(2)), l2=ft.nn.Dense(4, 2, key=jax.random.key(2)))
    for template in (tanh, {"l1": tanh.l1, "l2": tanh.l2}):
        with pytest.raises(ft.train.CheckpointError, match=r"l1.activation: saved jax.nn.relu, the template's jax.nn.tanh"):
            ft.train.load(tmp_path / "a", template=template)
    relu = MLP(l1=ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(2)), l2=ft.nn.Dense(4, 2, key=jax.random.key(2)))
    back = ft.train.load(tmp_path / "a", template=relu)  # the same static fields: a legitimate restore
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    expected = _net_reference(net, x)
    np.testing.assert_allclose(np.asarray(back(jnp.asarray(x, jnp.float32))), expected, rtol=0,
                               atol=1e-5 * max(1.0, np.abs(expected).max()))


class ScaledLin(ft.Module):
    w: jax.Array
    b: jax.Array
    scale: float = ft.field(static=True, default=1.0)

    def __call__(self, x):
        return self.scale * (x @ self.w + jax.lax.broadcast_to_rank(self.b, x.ndim))


class UnscaledLin(ft.Module):  # ScaledLin with its static field removed
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return x @ self.w + self.b


def test_a_template_without_a_saved_static_field_is_refused(tmp_path):
    # Saved scale=3.0 computes [21, 30]; a template class without scale loaded silently and
    # computed [7, 10]. The saved value would be dropped: refused, naming the field and fix.
    old = ScaledLin(w=jnp.arange(6.0).reshape(3, 2), b=jnp.ones(2), scale=3.0)
    x = np.ones((1, 3))
    np.testing.assert_allclose(np.asarray(old(jnp.asarray(x))), 3.0 * (x @ np.arange(6.0).reshape(3, 2) + 1),
                               rtol=0, atol=1e-5)
    ft.train.save(tmp_path / "a", old)
    dropped = r"at '' was saved with the static field scale = 3.0, and the template's UnscaledLin has no field scale"
    with pytest.raises(SpecError, match=dropped) as e:
        ft.train.load(tmp_path / "a", template=UnscaledLin(w=jnp.zeros((3, 2)), b=jnp.zeros(2)))
    assert "scale: ... = ft.field(static=True, default=3.0)" in str(e.value)
    with ft.train.CheckpointManager(tmp_path / "m") as manager:
        manager.save(1, {"head": old})
        manager.wait_until_finished()
        with pytest.raises(SpecError, match=r"step 1 in .*\n.*'model.head' was saved with the static field scale = 3.0"):
            manager.restore(1, template={"head": UnscaledLin(w=jnp.zeros((3, 2)), b=jnp.zeros(2))})
    # A dict of the arrays alone holds no static configuration: it reads the arrays.
    back = ft.train.load(tmp_path / "a", template={"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)})
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(6.0).reshape(3, 2))


class _Relu(ft.Module):  # two leafless layers of the user's, both defined (no rename)
    def __call__(self, x):
        return jax.nn.relu(x)


class _Tanh(ft.Module):
    def __call__(self, x):
        return jnp.tanh(x)


def _layer_cases():
    """(saved, template, the refusal's line): templates that compute another function with
    every saved key path, shape and dtype (each loaded silently before; the measured
    difference of the outputs on one input: 0.62, 0.068, 0.20, 0.55, 0.73 and 4.4)."""
    k, s = jax.random.key(0), ft.nn.Sequential
    dense = ft.nn.Dense(3, 4, key=k)
    stack = ft.nn.Stack(lambda key: ft.nn.Dense(3, 3, key=key), 2, key=k)
    members = [jax.tree.map(lambda a, i=i: a[i], stack.layers) for i in range(2)]
    relu_stack = ft.nn.Stack(lambda key: ft.nn.Dense(3, 3, jax.nn.relu, key=key), 2, key=k)
    tie: dict[str | ft.KeyPath, object] = {"head.weight": ("embed.embeddings", jnp.transpose)}
    untied = ft.nn.Shared({"embed": ft.nn.Embedding(10, 4, key=k), "head": ft.nn.Dense(4, 10, key=k)}, tie).resolve()
    relu_head = ft.nn.Shared({"embed": untied["embed"], "head": ft.nn.Dense(4, 10, jax.nn.relu, key=k)}, tie)
    return [
        (s(dense), s(dense, ft.nn.Lambda(jax.nn.relu)), "layers.1: saved none, the template's Lambda(fn=jax.nn.relu)"),
        (s(dense, ft.nn.Lambda(jnp.tanh)), s(dense), "layers.1: saved Lambda(fn=jax.nn.tanh), the template's none"),
        (s(dense, ft.nn.GlobalMaxPool1D()), s(dense, ft.nn.GlobalAvgPool1D()),
         "layers.1: saved GlobalMaxPool1D(), the template's GlobalAvgPool1D()"),
        (s(dense, _Relu()), s(dense, _Tanh()), "layers.1: saved _Relu(), the template's _Tanh()"),
        ({"h": members}, {"h": relu_stack}, "h.0.activation: saved functree.nn.identity, the template's jax.nn.relu"),
        (untied, relu_head, "head.activation: saved functree.nn.identity, the template's jax.nn.relu"),
        # the same function: loads
        (s(dense, ft.nn.Dropout(0.1)), s(dense, ft.nn.Dropout(0.5)), None),   # a rate is the template's
        ({"h": members}, {"h": stack}, None),
        (untied, ft.nn.Shared(untied, tie), None),
    ]


def test_a_template_that_adds_drops_or_replaces_a_layer_without_arrays_is_refused(tmp_path):
    """A Lambda(relu) appended to a Sequential, a Lambda dropped, a GlobalMaxPool1D read as
    a GlobalAvgPool1D, a Stack of relu layers for members saved one by one, an untied tree
    into an ft.nn.Shared whose head has relu: every key path, shape and dtype is the saved
    one, and each loaded silently a model that computes something else (the doc promises
    an error for a changed layer count). Refused, naming the key path and both layers."""
    cases = _layer_cases()
    for message, lines in (("holds other layers than the template", slice(0, 4)),  # layers first
                           ("saved with other static configuration", slice(4, 6))):
        refused = {f"c{i}": case for i, case in enumerate(cases[lines])}
        ft.train.save(tmp_path / message[:5], {name: saved for name, (saved, _, _) in refused.items()})
        with pytest.raises(ft.train.CheckpointError, match=message) as info:
            ft.train.load(tmp_path / message[:5], {name: template for name, (_, template, _) in refused.items()})
        for name, (_, _, line) in refused.items():  # every one, by its key path
            assert f"    {name}.{line}\n" in str(info.value)
        assert "right:  ft.train.load(path)" in str(info.value)
    saved, template, line = cases[0]  # a job's model: the key path under its part, the manager's fix
    with ft.train.CheckpointManager(tmp_path / "job") as manager:
        manager.save(3, saved, optax.adam(0.1).init(saved))
        with pytest.raises(ft.train.CheckpointError, match=re.escape(f"    model.{line}\n")) as info:
            manager.restore(3, template=template)
    assert "right:  manager.restore(3).model" in str(info.value)
    kept = [(saved, template) for saved, template, line in cases if line is None]
    ft.train.save(tmp_path / "kept", [saved for saved, _ in kept])
    back = ft.train.load(tmp_path / "kept", [template for _, template in kept])
    assert jax.tree.structure(back) == jax.tree.structure([template for _, template in kept])


@pytest.mark.parametrize("edit, message", [
    ("field added", r"Lin has fields \['b', 'c', 'scale', 'w'\] now, the checkpoint's had \['b', 'scale', 'w'\] "
                    r"\(added: \['c'\]\)"),
    ("parameter made static", r"Lin's static fields are \['b', 'scale'\] now, the checkpoint's were \['scale'\] "
                              r"\(now static: \['b'\]\)"),
    ("static removed", r"Lin has fields \['b', 'w'\] now, the checkpoint's had \['b', 'scale', 'w'\] "
                       r"\(removed: \['scale'\]\)"),
])
def test_a_class_edited_since_the_save_is_named_as_an_edit_not_damage(tmp_path, edit, message):
    class Lin(ft.Module):
        w: jax.Array
        b: jax.Array
        scale: float = ft.field(static=True, default=1.0)

    class Added(ft.Module):
        w: jax.Array
        b: jax.Array
        c: jax.Array
        scale: float = ft.field(static=True, default=1.0)

    class MadeStatic(ft.Module):
        w: jax.Array
        b: float = ft.field(static=True, default=0.0)
        scale: float = ft.field(static=True, default=1.0)

    class Removed(ft.Module):
        w: jax.Array
        b: jax.Array

    _cell(Lin, "Lin")
    ft.train.save(tmp_path / "a", Lin(w=jnp.ones((3, 2)), b=jnp.ones(2), scale=3.0))
    _cell({"field added": Added, "parameter made static": MadeStatic, "static removed": Removed}[edit], "Lin")
    with pytest.raises(SpecError, match=r"The class `edited_cells.Lin` at '' was edited since this checkpoint was "
                                        r"saved: " + message) as e:
        ft.train.load(tmp_path / "a")
    assert "damaged" not in str(e.value) and "restore another step" not in str(e.value)
    assert "ft.train.load(path, template=model)" in str(e.value)


def _leaky_reference(model, x, slope):
    """NumPy's leaky ReLU of the Dense layer's affine map: max(z, 0) + slope * min(z, 0)."""
    flat = {k: np.asarray(v, np.float64) for k, v in ft.to_flat_dict(model).items()}
    z = np.asarray(x, np.float64) @ flat["weight"] + flat["bias"]
    return np.maximum(z, 0) + slope * np.minimum(z, 0)


def _leaky_dense(slope, seed=0, **keywords):
    return ft.nn.Dense(3, 4, functools.partial(jax.nn.leaky_relu, negative_slope=slope, **keywords),
                       key=jax.random.key(seed))


SAVE_IN_A_NEW_PROCESS = """
import functools, sys, jax, functree as ft
model = ft.nn.Dense(3, 4, functools.partial(jax.nn.leaky_relu, negative_slope=0.3), key=jax.random.key(0))
ft.train.save(sys.argv[1], model)
"""

SAVE_A_LAMBDA_LAYER = """
import functools, sys, jax, functree as ft
act = ft.nn.Lambda(functools.partial(jax.nn.leaky_relu, negative_slope=0.3))
ft.train.save(sys.argv[2], ft.nn.Dense(3, 4, act, key=jax.random.key(0)))
"""


@pytest.fixture(scope="module")
def saved_in_another_process(tmp_path_factory):
    """One fresh process (its start-up and imports are most of its time) saves both models
    of the two tests below: the Dense layer with a partial activation at ``partial``, the
    one whose activation is a Lambda layer holding that partial at ``lambda``."""
    root = tmp_path_factory.mktemp("another_process")
    subprocess.run([sys.executable, "-c", SAVE_IN_A_NEW_PROCESS + SAVE_A_LAMBDA_LAYER, str(root / "partial"),
                    str(root / "lambda")], check=True, timeout=240)
    return root


def test_a_partial_activation_saved_in_another_process_loads_into_the_same_partial(saved_in_another_process,
                                                                                    tmp_path):
    # a fresh process: another partial and function object at other addresses, the same text
    x = np.arange(3.0, dtype=np.float32)[None] - 2  # negative and positive pre-activations
    back = ft.train.load(saved_in_another_process / "partial", _leaky_dense(0.3, seed=1))
    np.testing.assert_allclose(back(x), _leaky_reference(back, x, 0.3), rtol=0, atol=1e-5)
    assert back.activation.keywords == {"negative_slope": 0.3}
    with ft.train.CheckpointManager(tmp_path / "run") as manager:  # and the template path of a restore
        manager.save(1, back)
        again = manager.restore(template=_leaky_dense(0.3, seed=2)).model
    np.testing.assert_allclose(again(x), _leaky_reference(back, x, 0.3), rtol=0, atol=1e-5)


@pytest.mark.parametrize("template", [
    lambda: _leaky_dense(0.01, seed=1),                                          # another slope
    lambda: ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(1)),                # a function instead
    lambda: ft.nn.Dense(3, 4, functools.partial(jax.nn.elu, alpha=0.3), key=jax.random.key(1)),  # another function
])
def test_a_template_with_another_partial_activation_is_refused(tmp_path, template):
    # before: loaded with the template's activation, silently (x = -2: saved -0.849, loaded -0.0283)
    ft.train.save(tmp_path / "m", _leaky_dense(0.3))
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)activation: saved functools\.partial\(.*leaky_relu>>, "
                                                       r"negative_slope=0\.3\), the template's .*right:  ft\.train"
                                                       r"\.load\(path, template\)   # the template built with "
                                                       r"activation=functools\.partial"):
        ft.train.load(tmp_path / "m", template())
    with ft.train.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, _leaky_dense(0.3))
        with pytest.raises(ft.train.CheckpointError, match=r"at step 1 .*(?s:.*)activation: saved functools"):
            manager.restore(template=template())


def test_a_template_partial_where_a_function_was_saved_is_refused(tmp_path):
    ft.train.save(tmp_path / "m", ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(0)))
    with pytest.raises(ft.train.CheckpointError, match=r"activation: saved jax\.nn\.relu, the template's functools"):
        ft.train.load(tmp_path / "m", _leaky_dense(0.3))


def test_a_partial_with_its_keywords_in_another_order_is_the_same_partial(tmp_path):
    def act(x, a, b):
        return jnp.where(x > 0, a * x, b * x)

    saved = ft.nn.Dense(3, 4, functools.partial(act, a=2.0, b=0.5), key=jax.random.key(0))
    ft.train.save(tmp_path / "m", saved)
    template = ft.nn.Dense(3, 4, functools.partial(act, b=0.5, a=2.0), key=jax.random.key(1))
    x = jnp.array([[-2.0, 1.0, 3.0]])
    z = np.asarray(x, np.float64) @ np.asarray(saved.weight, np.float64) + np.asarray(saved.bias, np.float64)
    expected = np.where(z > 0, 2.0 * z, 0.5 * z)
    np.testing.assert_allclose(ft.train.load(tmp_path / "m", template)(x), expected, rtol=0, atol=1e-5)
    other = ft.nn.Dense(3, 4, functools.partial(act, b=0.5, a=3.0), key=jax.random.key(1))
    with pytest.raises(ft.train.CheckpointError, match="activation: saved"):
        ft.train.load(tmp_path / "m", other)


def test_a_lambda_activation_is_stored_by_its_name_and_code_and_only_the_same_lambda_reads_it(tmp_path):
    # a lambda's name (...<lambda>) with its code's digest (2026-12-04; before, any lambda
    # template read it: tests/test_checkpoint_function_code.py)
    ft.train.save(tmp_path / "m", ft.nn.Dense(3, 4, lambda v: v * 3, key=jax.random.key(0)))
    with pytest.raises(ft.train.CheckpointError, match=r"activation: saved .*<lambda> \(code"):
        ft.train.load(tmp_path / "m", ft.nn.Dense(3, 4, lambda v: v * 5, key=jax.random.key(1)))
    back = ft.train.load(tmp_path / "m", ft.nn.Dense(3, 4, lambda v: v * 3, key=jax.random.key(1)))
    assert back.activation(1.0) == 3.0


def test_a_leafless_module_holding_a_partial_saved_in_another_process_loads_into_the_same_one(
        saved_in_another_process):
    # before: its stored description held the partial's text with a memory address, so the
    # same model built in another process was refused as "other static configuration"
    def template(slope):
        act = ft.nn.Lambda(functools.partial(jax.nn.leaky_relu, negative_slope=slope))
        return ft.nn.Dense(3, 4, act, key=jax.random.key(1))

    back = ft.train.load(saved_in_another_process / "lambda", template(0.3))
    x = np.array([[-2.0, 1.0, 3.0]], np.float32)
    np.testing.assert_allclose(back(x), _leaky_reference(back, x, 0.3), rtol=0, atol=1e-5)
    with pytest.raises(ft.train.CheckpointError, match=r"activation: saved Lambda\(fn=functools\.partial\(.*0\.3\)\)"):
        ft.train.load(saved_in_another_process / "lambda", template(0.01))
