"""Checkpoints are data: tampered, damaged or concurrent checkpoints never run code,
never load wrong values silently, and always raise a CheckpointError saying what is wrong."""

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functree as ft
from functree.train import CheckpointError, CheckpointManager
from functree.train.checkpoint._checkpoint import metadata_digest
from functree.train.checkpoint._directory import LOCK_NAME
from functree.train.checkpoint._treespec import SpecError

W = np.random.default_rng(0).normal(size=(32, 32)).astype(np.float32)  # incompressible


# Reading deliberately damaged files can leave tensorstore futures that complete after
# orbax closed their event loop; Python reports that as an unraisable exception when they
# are garbage-collected. It is orbax's background cleanup, never a wrong value (every test
# here asserts what was loaded): ignored in this module, and collected after each test so
# it never surfaces in another module's test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True, scope="module")
def _collect_orbax_leftovers():
    """Also the home of :func:`saved`'s written checkpoints (one per kind, copied per test).

    A full collection costs about as much as a test here, so it runs once, in the module's
    last teardown (still under this module's filter); tests that assert on what a collection
    finalises call gc.collect() themselves."""
    _SAVED["root"] = Path(tempfile.mkdtemp())
    yield
    shutil.rmtree(_SAVED.pop("root"), ignore_errors=True)
    _SAVED.clear()
    gc.collect()


def meta_path(directory, step=1):
    return Path(directory) / str(step) / "meta" / "metadata"


def rewrite_meta(directory, change, step=1, reseal=True):
    """Tamper with the stored JSON (and, like an attacker would, fix its digest)."""
    path = meta_path(directory, step)
    meta = json.loads(path.read_text())
    change(meta)
    if reseal:
        meta["digest"] = metadata_digest(meta)
    path.write_text(json.dumps(meta))


_SAVED: dict = {}  # the default model's checkpoints, written once per `extra` (a module fixture's)


def saved(tmp_path, model=None, opt_state=None, extra=None):
    """``tmp_path / "ckpt"``: a checkpoint of ``model`` (by default a Dense and a Lambda) at
    step 1. The default model's is written once per module and copied: each test tampers
    with its own copy of the same files."""
    directory = tmp_path / "ckpt"
    if model is None and opt_state is None:
        written = _SAVED["root"] / f"default-{len(_SAVED)}"
        written = _SAVED.setdefault(repr(extra), written)
        if not written.exists():
            _save(written, None, None, extra)
        shutil.copytree(written, directory)
        return directory
    return _save(directory, model, opt_state, extra)


def _save(directory, model, opt_state, extra):
    with CheckpointManager(directory) as manager:
        model = ft.nn.Sequential(ft.nn.Dense(2, 3, jax.nn.relu, key=jax.random.key(0)),
                                 ft.nn.Lambda(jnp.tanh)) if model is None else model
        manager.save(1, model, opt_state, extra=extra)
    return directory


def restore_error(directory, **kwargs):
    with CheckpointManager(directory) as manager, pytest.raises(CheckpointError) as info:
        manager.restore(**kwargs)
    return str(info.value)


# --- 1. nothing named by a checkpoint is imported, called or constructed ------------------

@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module on sys.path whose import, or any call into it, creates a marker file."""
    marker = tmp_path / "ran"
    (tmp_path / "evil_ckpt_mod.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('imported')\n"
        "def hook(*a, **k):\n"
        f"    pathlib.Path({str(marker)!r}).write_text('called')\n"
        "class Thing:\n"
        "    _fields = ('a',)\n"
        "    def __init__(self, *a): hook()\n"
        "    def __del__(self): hook()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    assert "evil_ckpt_mod" not in sys.modules


@pytest.mark.parametrize("name", ["evil_ckpt_mod:Thing", "evil_ckpt_mod.Thing", "evil_ckpt_mod:hook"])
@pytest.mark.parametrize("kind", ["module", "namedtuple", "dataclass"])
def test_named_classes_are_never_imported(tmp_path, evil_module, name, kind):
    directory = saved(tmp_path)

    def change(meta):
        meta["spec"]["items"][0] = {"kind": kind, "class": name, "static": {}, "fields": {},
                                    "items": [{"kind": "none"}]}

    rewrite_meta(directory, change)
    message = restore_error(directory)
    assert "step 1" in message and "is not a registered type" in message
    assert "ft.train.register(MyClass)" in message and "template=" in message
    gc.collect()
    assert not evil_module.exists()


def test_a_skipped_extra_entry_is_never_read_and_its_arrays_still_checked(tmp_path, evil_module):
    """extra_template={entry: CheckpointManager.SKIP} leaves the entry unread: a class its
    description names is never looked up, imported or built (read, it is refused); its
    arrays are checked with the others' (a changed CRC-32 still refuses the step). main had
    no way to skip an entry (CheckpointManager.SKIP did not exist)."""
    directory = saved(tmp_path, extra={"keep": np.arange(2, dtype=np.float32), "probe": {"x": np.ones(3, np.float32)}})

    def change(meta):
        meta["spec"]["items"][2]["items"][1] = {"kind": "module", "class": "evil_ckpt_mod.Thing", "static": {},
                                                "fields": {"x": {"kind": "leaf", "key": "extra.probe.x"}}}

    rewrite_meta(directory, change)
    assert "is not a registered type" in restore_error(directory)  # read: refused at the name
    with CheckpointManager(directory) as manager:
        ckpt = manager.restore(extra_template={"probe": CheckpointManager.SKIP})
    assert list(ckpt.extra) == ["keep"]
    np.testing.assert_array_equal(ckpt.extra["keep"], np.arange(2, dtype=np.float32))
    gc.collect()
    assert not evil_module.exists()
    rewrite_meta(directory, lambda m: m["checksums"]["extra.probe.x"].__setitem__("crc32", 1))
    message = restore_error(directory, extra_template={"probe": CheckpointManager.SKIP})
    assert "step 1" in message and "'extra.probe.x' fails its CRC-32 check" in message


@pytest.mark.parametrize("name", [
    "os:system", "os.system", "builtins:eval", "builtins.exec", "subprocess:getoutput",
    "subprocess.getoutput", "numpy:uint8", "builtins:bytes", "evil_ckpt_mod:hook",
    "evil_ckpt_mod.hook", "importlib:import_module",
])
@pytest.mark.parametrize("tag", ["function", "import"])
def test_static_functions_come_only_from_the_registry(tmp_path, evil_module, name, tag):
    directory = saved(tmp_path)

    def change(meta):
        dense, lam = meta["spec"]["items"][0]["fields"]["layers"]["items"]
        dense["static"]["activation"] = {tag: name}
        lam["static"]["fn"] = {tag: name}

    rewrite_meta(directory, change)
    message = restore_error(directory)
    why = f"the function {name!r} is not registered" if tag == "function" else "unknown static encoding 'import'"
    assert "step 1" in message and why in message  # "import" is format 1's: only ft.train.migrate reads it
    assert "model.layers.0.activation" in message
    assert not evil_module.exists()


@pytest.mark.parametrize("builtin", ["os.system", "builtins.print", "subprocess.getoutput"])
def test_callables_with_fields_are_not_called(tmp_path, builtin):
    directory = saved(tmp_path)
    rewrite_meta(directory, lambda meta: meta["spec"]["items"].__setitem__(
        1, {"kind": "namedtuple", "class": builtin, "items": [{"kind": "none"}]}))
    assert f"{builtin} is not a registered type" in restore_error(directory)


class Finaliser:
    """A class in this process with side effects in __init__ and __del__."""

    log: typing.ClassVar[list] = []

    def __init__(self):
        Finaliser.log.append("init")

    def __del__(self):
        Finaliser.log.append("del")


def test_unregistered_classes_in_this_process_are_not_built(tmp_path):
    directory = saved(tmp_path)
    name = f"{__name__}.Finaliser"
    for kind in ("dataclass", "namedtuple", "module"):
        rewrite_meta(directory, lambda meta, kind=kind: meta["spec"]["items"].__setitem__(
            0, {"kind": kind, "class": name, "static": {}, "fields": {}, "items": []}))
        assert "not a registered type" in restore_error(directory)
    gc.collect()
    assert Finaliser.log == []


def test_a_registered_name_of_the_wrong_kind_is_refused(tmp_path):
    directory = saved(tmp_path)
    rewrite_meta(directory, lambda meta: meta["spec"]["items"].__setitem__(
        0, {"kind": "module", "class": "optax.ScaleByAdamState", "static": {}, "fields": {}}))
    assert "stored as a module but is a ScaleByAdamState class" in restore_error(directory)


def test_register_rules():
    with pytest.raises(TypeError, match=r"takes a class .* or a function"):
        ft.train.register(3)
    with pytest.raises(TypeError, match=r"takes a class"):
        ft.train.register(Finaliser)  # not a NamedTuple, dataclass or Module
    with pytest.raises(TypeError, match=r"(?s)needs no registration.*template=tree"):  # a class: the other way named
        ft.train.register(Finaliser)
    with pytest.raises(ValueError, match=r"already registered"):
        ft.train.register(jnp.cos, name="jax.nn.relu")
    assert ft.train.register(jnp.sinc) is jnp.sinc


def test_registered_function_in_a_static_field(tmp_path):
    def swish2(x):
        return x * jax.nn.sigmoid(2 * x)

    model = ft.nn.Dense(2, 2, swish2, key=jax.random.key(0))
    ft.train.save(tmp_path / "m", model)
    with pytest.raises(SpecError, match=r"static value at 'activation'.*swish2"):
        ft.train.load(tmp_path / "m")
    ft.train.register(swish2)  # in the loading process: the stored name now resolves
    assert ft.train.load(tmp_path / "m").activation is swish2


def test_old_format_with_private_names_still_loads(tmp_path):
    model = ft.nn.Sequential(ft.nn.Dense(2, 3, jax.nn.relu, key=jax.random.key(0)),
                             ft.nn.Lambda(jnp.tanh))
    opt_state = ft.optim.Optimizer(ft.optim.adam(1e-3)).init(model)
    directory = saved(tmp_path, model, opt_state)

    def to_format_1(node):
        if isinstance(node, dict):
            cls = node.get("class")
            if cls is not None:
                found = ft.train.checkpoint._registry.lookup_type(cls)[0]
                node["class"] = f"{found.__module__}:{found.__qualname__}"
            for code in node.get("static", {}).values():
                if "function" in code:
                    fn = ft.train.checkpoint._registry.lookup_function(code.pop("function"))
                    code["import"] = f"{fn.__module__}:{fn.__qualname__}"
            for value in node.values():
                to_format_1(value)
        elif isinstance(node, list):
            for value in node:
                to_format_1(value)

    def change(meta):
        to_format_1(meta["spec"])
        meta["format"] = "functree-checkpoint-1"
        del meta["checksums"], meta["digest"]

    rewrite_meta(directory, change, reseal=False)
    text = meta_path(directory).read_text()
    assert "functree.nn._linear:Dense" in text and "optax._src.transform:ScaleByAdamState" in text
    assert "ft.train.migrate" in restore_error(directory)  # never on the normal read path
    ft.train.migrate(directory, tmp_path / "v2")
    ckpt = CheckpointManager(tmp_path / "v2").restore()
    assert ckpt.model.layers[0].activation is jax.nn.relu and ckpt.model.layers[1].fn is jnp.tanh
    assert jax.tree.structure(ckpt.opt_state) == jax.tree.structure(opt_state)


# --- 2. silent corruption -------------------------------------------------------------------

def _data_file(step_dir):
    files = [p for p in Path(step_dir, "arrays").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def pristine():
    directory = Path(tempfile.mkdtemp()) / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(7, {"w": W, "b": np.arange(3, dtype=np.float32)})
    yield directory
    shutil.rmtree(directory.parent, ignore_errors=True)


def _flip(path, offset, bit):
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_a_flipped_bit_never_loads_wrong_values(pristine, offset, bit):
    data = _data_file(pristine / "7")
    _flip(data, offset, bit)
    try:
        with CheckpointManager(pristine) as manager:
            ckpt = manager.restore()
    except CheckpointError as e:
        assert "step 7" in str(e) or "/7" in str(e)
    else:  # the flip hit bytes that do not matter: the values must be exact
        np.testing.assert_array_equal(np.asarray(ckpt.model["w"]), W)
    finally:
        _flip(data, offset, bit)


def test_checksum_mismatch_names_step_and_key_path(tmp_path):
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(3, {"w": W})
    rewrite_meta(directory, lambda m: m["checksums"]["model.w"].__setitem__("crc32", 1), step=3)
    message = restore_error(directory)
    assert "step 3" in message and "'model.w' fails its CRC-32 check" in message
    rewrite_meta(directory, lambda m: m["checksums"]["model.w"].__setitem__("shape", [4]), step=3)
    assert "'model.w' is float32[32, 32], written as float32[4]" in restore_error(directory)


def test_damaged_metadata_without_a_fixed_digest(tmp_path):
    directory = saved(tmp_path)
    rewrite_meta(directory, lambda m: m["metrics"].__setitem__("loss", 0.0), reseal=False)
    message = restore_error(directory)
    assert "step 1" in message and "damaged metadata" in message and "CRC-32" in message


@pytest.mark.parametrize("cut", [0, 1, 10, 0.5, -1])
def test_truncated_files(tmp_path, cut):
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(1, {"w": W})
    for path in [_data_file(directory / "1"), meta_path(directory)]:
        data = path.read_bytes()
        keep = int(len(data) * cut) if isinstance(cut, float) else cut % len(data)
        path.write_bytes(data[:keep])
        try:
            with CheckpointManager(directory) as manager:
                ckpt = manager.restore()
        except CheckpointError as e:
            assert "step 1" in str(e)
        else:  # a trailing byte the reader never uses: the values must be exact
            assert path.name != "metadata" and keep == len(data) - 1
            np.testing.assert_array_equal(np.asarray(ckpt.model["w"]), W)
        path.write_bytes(data)


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "emptied"])
def test_damaged_array_files_name_the_array_the_first_line_and_the_fix(tmp_path, damage):
    """ft.train.load of a tree whose array data file was truncated, zeroed or emptied after
    save: the error names the stored array (its key path), keeps TensorStore's first line
    (was: 300 characters cut inside orbax's dump of the TensorStore spec, no name) and says
    to restore or save again (was: "Pass the directory written by ft.train.save")."""
    ft.train.save(tmp_path / "m", {"w": W, "b": np.arange(3, dtype=np.float32)})
    data = _data_file(tmp_path / "m")
    size = data.stat().st_size
    data.write_bytes({"truncated": data.read_bytes()[: size // 2], "zeroed": bytes(size), "emptied": b""}[damage])
    with pytest.raises(CheckpointError) as caught:
        ft.train.load(tmp_path / "m")
    message = str(caught.value)
    first = message.splitlines()[0]
    assert "is damaged or incomplete: the stored array 'w' could not be read (ValueError: " in first
    assert 'Error reading "w/' in first and "TensorStore(" not in message and "Pass the directory" not in message
    assert f'or:  ft.train.save("{tmp_path / "m"}", tree, overwrite=True)' in message


def test_each_deleted_file(tmp_path):
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(1, {"w": W})
        manager.save(2, {"w": W + 1})
    files = sorted(p for p in (directory / "2").rglob("*") if p.is_file())
    for path in files:
        data = path.read_bytes()
        path.unlink()
        try:
            with CheckpointManager(directory) as manager:
                ckpt = manager.restore(2)
        except CheckpointError:
            pass
        else:  # only files that orbax never reads may go missing
            np.testing.assert_array_equal(np.asarray(ckpt.model["w"]), W + 1)
        path.write_bytes(data)
    np.testing.assert_array_equal(np.asarray(CheckpointManager(directory).restore(2).model["w"]), W + 1)


# --- 3. damaged type descriptions -------------------------------------------------------------

def _dense(meta):
    return meta["spec"]["items"][0]["fields"]["layers"]["items"][0]


DAMAGE = {
    "kind is unknown": (lambda m: _dense(m).__setitem__("kind", "pickle"), "unknown node kind 'pickle'"),
    "node is a list": (lambda m: m["spec"]["items"].__setitem__(0, [1]), "a node is list"),
    "no class": (lambda m: _dense(m).pop("class"), "class name None"),
    "class is a number": (lambda m: _dense(m).__setitem__("class", 5), "class name 5"),
    "missing field": (lambda m: _dense(m)["fields"].pop("bias"), "Dense has fields"),
    "extra field": (lambda m: _dense(m)["fields"].__setitem__("x", {"kind": "none"}), "Dense has fields"),
    "static as field": (lambda m: _dense(m)["fields"].__setitem__(
        "activation", _dense(m)["static"].pop("activation")), "static fields are ['activation']"),
    "unhashable static": (lambda m: _dense(m)["static"].__setitem__(
        "activation", {"json": [1, 2]}), "not a JSON scalar"),
    "unknown static tag": (lambda m: _dense(m)["static"].__setitem__(
        "activation", {"pickle": "x"}), "unknown static encoding 'pickle'"),
    "static not a dict": (lambda m: _dense(m).__setitem__("static", []), "'static' must be a dict"),
    "unknown leaf key": (lambda m: _dense(m)["fields"]["weight"].__setitem__("key", "nope"),
                         "no stored array named 'nope'"),
    "bad python scalar": (lambda m: _dense(m)["fields"]["weight"].__setitem__("python", "str"),
                          "Python 'str' scalar"),
    "bad prng": (lambda m: _dense(m)["fields"]["weight"].__setitem__("prng", "os"), "unknown PRNG"),
    "bad dict key type": (lambda m: m["spec"]["items"][2].update(
        {"kind": "dict", "keys": [["bytes", "k"]], "items": [{"kind": "none"}]}), "dict key"),
    "keys and items differ": (lambda m: m["spec"]["items"][2].update(
        {"kind": "dict", "keys": [], "items": [{"kind": "none"}]}), "0 keys for 1 items"),
    "items not a list": (lambda m: m["spec"]["items"][0]["fields"]["layers"].__setitem__("items", 3),
                         "'items' must be a list"),
    "object dtype": (lambda m: _dense(m)["static"].__setitem__("activation", {"dtype": "O"}),
                     "not a numeric dtype"),
    "opaque": (lambda m: m["spec"]["items"].__setitem__(2, {"kind": "opaque", "type": "X", "items": []}),
               "not a Module, dataclass"),
    "wrong part count": (lambda m: m["spec"]["items"].pop(), "does not hold model, opt_state"),
    "step not int": (lambda m: m.__setitem__("step", "1"), "the step is '1'"),
    "metrics not dict": (lambda m: m.__setitem__("metrics", [1]), "'metrics' is list"),
    "no checksums": (lambda m: m.pop("checksums"), "has no checksums"),
    "unknown format": (lambda m: m.__setitem__("format", "other"), "no functree-checkpoint-2 metadata"),
    "one array at two leaves": (lambda m: _dense(m)["fields"]["bias"].__setitem__("key", "model.layers.0.weight"),
                                "at 'model.layers.0.bias': it names the stored array 'model.layers.0.weight', "
                                "which 'model.layers.0.weight' names too"),
    "an array named nowhere": (lambda m: _dense(m)["fields"].__setitem__("bias", {"kind": "none"}),
                               "at 'model.layers.0.bias': the stored arrays ['model.layers.0.bias'] are named "
                               "by no leaf"),
    "relabelled format 1": (lambda m: (m.__setitem__("format", "functree-checkpoint-1"), m.pop("checksums")),
                            "format functree-checkpoint-1, without checksums); read it once through a migration"),
    "shards that do not cover": (lambda m: m["checksums"].__setitem__("model.layers.0.weight", {
        "dtype": "float32", "shape": [2, 3], "shards": {"0:1,0:3": 0}}), "shards in its checksum entry that do not"),
    "a damaged shard": (lambda m: m["checksums"].__setitem__("model.layers.0.weight", {
        "dtype": "float32", "shape": [2, 3], "shards": {"0:9": 0}}), "has a damaged checksum entry"),
}


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_damaged_spec_raises_a_checkpoint_error_naming_step_and_problem(tmp_path, what):
    change, problem = DAMAGE[what]
    directory = saved(tmp_path, extra={"e": None})
    rewrite_meta(directory, change)
    message = restore_error(directory)
    assert "step 1" in message and problem in message, message


_SCALARS = {"b": True, "i": 3, "f": 0.75, "c": 1.5 + 2j}
_TAGS = {"b": "bool", "i": "int", "f": "float", "c": "complex"}


def test_python_scalars_of_every_kind_load_exactly(tmp_path):
    directory = saved(tmp_path, model={"w": jnp.ones(2), **_SCALARS})
    with CheckpointManager(directory) as manager:
        model = manager.restore(1).model
    for name, value in _SCALARS.items():
        assert type(model[name]) is type(value) and model[name] == value, (name, model[name])


@pytest.mark.parametrize("stored, tag", [(s, t) for s in _TAGS for t in _TAGS.values() if t != _TAGS[s]])
def test_a_python_tag_never_converts_the_stored_dtype(tmp_path, stored, tag):
    # before: 0.75 tagged "int" loaded as 0, tagged "bool" as True, 3 tagged "complex" as 3+0j
    directory = saved(tmp_path, model={"w": jnp.ones(2), "x": _SCALARS[stored]})

    def retag(meta):
        for item, key in zip(meta["spec"]["items"][0]["items"], meta["spec"]["items"][0]["keys"]):
            if key[1] == "x":
                item["python"] = tag
    rewrite_meta(directory, retag)
    message = restore_error(directory)
    assert f"damaged at 'model.x': a Python {tag!r} scalar stored as dtype" in message, message


def test_a_flag_naming_a_memberless_class_is_refused_at_its_field(tmp_path):
    # before: "damaged at ''" quoting Python's TypeError ("<flag 'Flag'> has no members defined")
    directory = saved(tmp_path)
    rewrite_meta(directory, lambda m: _dense(m)["static"].__setitem__("activation", {"flag": ["enum.Flag", 0]}))
    message = restore_error(directory)
    assert "damaged at 'model.layers.0.activation': the Flag Flag has no members" in message, message


def test_format_1_is_read_only_by_an_explicit_migration(tmp_path):
    ft.train.save(tmp_path / "m", {"w": W})
    rewrite_meta(tmp_path, lambda m: None, step="m")  # resealed, still format 2
    with pytest.raises(CheckpointError, match=r"not a format-1 .*its format is 'functree-checkpoint-2'"):
        ft.train.migrate(tmp_path / "m", tmp_path / "m2")
    rewrite_meta(tmp_path, lambda m: (m.__setitem__("format", "functree-checkpoint-1"),
                                                   m.pop("checksums"), m.pop("digest")), step="m", reseal=False)
    with pytest.raises(CheckpointError, match=r"not a readable .*ft.train.migrate\("):
        ft.train.load(tmp_path / "m")  # relabelling never switches the checks off
    ft.train.migrate(tmp_path / "m", tmp_path / "m2")  # explicit: a checked copy
    np.testing.assert_array_equal(ft.train.load(tmp_path / "m2")["w"], W)
    with pytest.raises(CheckpointError, match=r"holds no checkpoint"):
        ft.train.migrate(tmp_path / "nothing", tmp_path / "m3")


def test_restored_modules_pass_the_static_checks(tmp_path):
    class Holder(ft.Module):
        w: jax.Array
        size: object = ft.field(static=True, default=2)

    directory = saved(tmp_path, model=Holder(jnp.ones(2)))
    rewrite_meta(directory, lambda m: m["spec"]["items"][0]["static"].__setitem__(
        "size", {"scalar_type": "float32"}))
    ckpt = CheckpointManager(directory).restore()  # a hashable scalar type is fine
    assert ckpt.model.size is np.float32
    rewrite_meta(directory, lambda m: m["spec"]["items"][0]["static"].__setitem__(
        "size", {"tuple": [{"json": 1}, {"json": {"a": 1}}]}))
    assert "not a JSON scalar" in restore_error(directory)


# --- 4. concurrency --------------------------------------------------------------------------

def _stall_finalize(monkeypatch, started, release):
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    def stall(self, *args, **kwargs):
        started.set()
        release.wait(30)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", stall)


def test_second_manager_during_a_save_destroys_nothing_and_cannot_write(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    first = CheckpointManager(directory)
    first.save(1, {"w": W})
    started, release = threading.Event(), threading.Event()
    _stall_finalize(monkeypatch, started, release)
    errors = []
    thread = threading.Thread(target=lambda: _run(errors, first.save, 2, {"w": W + 2}))
    thread.start()
    try:
        assert started.wait(30)
        tmp_before = sorted(n for n in os.listdir(directory) if "tmp" in n)
        assert tmp_before
        second = CheckpointManager(directory)  # opening it deletes nothing
        assert sorted(n for n in os.listdir(directory) if "tmp" in n) == tmp_before
        with pytest.raises(CheckpointError, match=rf"Another writer.*pid {os.getpid()}") as info:
            second.save(3, {"w": W})
        assert LOCK_NAME in str(info.value) and "run_2" in str(info.value)
        assert second.all_steps() == [1]
    finally:
        release.set()
        thread.join(60)
    assert errors == []
    assert second.all_steps() == [1, 2]
    np.testing.assert_array_equal(np.asarray(second.restore(2).model["w"]), W + 2)
    monkeypatch.undo()
    second.save(3, {"w": W})  # the lock was released when the save finished
    assert not (directory / LOCK_NAME).exists()


def _run(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # pragma: no cover - reported by the assertion above
        errors.append(e)


def test_two_writers_taking_turns_keep_max_to_keep(tmp_path):
    a = CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
    b = CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
    for step in range(1, 7):
        (a if step % 2 else b).save(step, {"w": jnp.full(2, float(step))})
    assert a.all_steps() == b.all_steps() == [5, 6]


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    (directory / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                                                    "time": time.time()}))
    (directory / "1.orbax-checkpoint-tmp-123").mkdir()  # what the killed save left
    manager = CheckpointManager(directory)
    manager.save(1, {"w": jnp.ones(1)})
    assert sorted(os.listdir(directory)) == ["1"]


def test_lock_of_another_host_is_respected(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    lock = directory / LOCK_NAME
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "time": time.time()}))
    with pytest.raises(CheckpointError, match=r"pid 1 on host 'elsewhere'.*\n.*delete"):
        CheckpointManager(directory).save(1, {"w": jnp.ones(1)})
    assert lock.exists() and CheckpointManager(directory).all_steps() == []


def test_asynchronous_save_holds_the_lock_until_finished(tmp_path):
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory, asynchronous=True)
    manager.save(1, {"w": W})
    manager.save(2, {"w": W})  # the same writer may continue
    manager.wait_until_finished()
    assert not (directory / LOCK_NAME).exists() and manager.all_steps() == [1, 2]
    manager.close()


# --- 5. bad arguments ------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, 0, True, 1.5, "3"])
def test_bad_max_to_keep(tmp_path, value):
    with pytest.raises(ValueError, match=rf"(?s)max_to_keep must be a positive int.*got {value!r}"):
        CheckpointManager(tmp_path / "ckpt", max_to_keep=value)
    with pytest.raises(ValueError, match=r"max_to_keep=None: keep all"):
        ft.train.ModelCheckpoint(tmp_path / "ckpt", max_to_keep=value)
    assert not (tmp_path / "ckpt").exists()


def test_max_to_keep_none_keeps_all(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=None)
    for step in range(1, 6):
        manager.save(step, {"w": jnp.ones(1)})
    assert manager.all_steps() == [1, 2, 3, 4, 5]


@pytest.fixture
def notebook(monkeypatch):
    """A simulated notebook kernel: ``run(cell)`` execs cells into one namespace that is
    ``sys.modules["__main__"]``, as IPython's user module is; the registry is restored after."""
    from functree.train.checkpoint import _registry

    _registry._load_builtins()
    saved_tables = [(t, dict(t)) for t in (_registry._types, _registry._functions, _registry._names)]
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)

    def run(cell):
        exec(compile(cell, "<cell>", "exec"), main.__dict__)
        return main.__dict__

    run("import jax, jax.numpy as jnp, numpy as np, typing, functree as ft\nx = jnp.ones((3, 2))\n")
    yield run
    for table, before in saved_tables:
        table.clear()
        table.update(before)


MLP_CELL = """
class MLP(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        return {body}
"""


def test_a_class_cell_run_again_loads_without_a_template_as_the_class_bound_now(tmp_path, notebook):
    """main: the old class stays alive (JAX's pytree registry holds it), so a template-less
    load raised "2 different Module classes named '__main__.MLP'" after a re-run cell; the
    class bound at ``__main__.MLP`` now is the one meant (pickle's rule)."""
    notebook(MLP_CELL.format(body="self.lin(x)"))
    notebook(f"model = MLP(ft.nn.Dense(2, 1, key=jax.random.key(0)))\nft.train.save({str(tmp_path / 'm')!r}, model)")
    for body in ("2.0 * self.lin(x)", "3.0 * self.lin(x)"):
        ns = notebook(MLP_CELL.format(body=body))
        restored = ft.train.load(tmp_path / "m")
        assert type(restored) is ns["MLP"]
        np.testing.assert_allclose(restored(ns["x"]), float(body[0]) * ns["model"].lin(ns["x"]), rtol=0, atol=1e-6)
        notebook('ft.train.register(MLP, name="__main__.MLP")')  # the MAIN_CLASS message's line, re-run
        assert type(ft.train.load(tmp_path / "m")) is ns["MLP"]
    # Classes no module binds (local to a function) stay ambiguous: no rule picks one.
    ns = notebook("def make():\n    class Local(ft.Module):\n        w: jax.Array\n    return Local\n"
                  "first, second = make(), make()\n")
    ft.train.save(tmp_path / "l", ns["first"](jnp.ones(2)))
    with pytest.raises(SpecError, match=r"2 different Module classes named '__main__.make.<locals>.Local'"):
        ft.train.load(tmp_path / "l")


ACT_CELL = """
def act(x):
    return {body}
ft.train.register(act, name="__main__.act")
"""


def test_register_in_a_cell_run_again_replaces_its_definition_and_refuses_another_object(tmp_path, notebook):
    """main: re-running a cell with ``ft.train.register`` raised "already registered", and a
    template-less load then used the OLD function (a wrong number, silently)."""
    notebook(ACT_CELL.format(body="jnp.tanh(x)"))
    notebook(f"model = ft.nn.Dense(2, 2, activation=act, key=jax.random.key(0))\n"
             f"ft.train.save({str(tmp_path / 'm')!r}, model)")
    ns = notebook(ACT_CELL.format(body="x * 100.0"))  # main: ValueError "already registered"
    restored = ft.train.load(tmp_path / "m")
    assert restored.activation is ns["act"]
    model, x = ns["model"], ns["x"]
    np.testing.assert_allclose(restored(x), (x @ model.weight + jax.lax.broadcast_to_rank(model.bias, x.ndim)) * 100.0, rtol=0, atol=1e-4)
    ns = notebook("def act(x):\n    return x * 0.5\n")  # re-run without its register line
    assert ft.train.load(tmp_path / "m").activation is ns["act"]
    ft.train.save(tmp_path / "m2", ft.nn.Dense(2, 2, activation=ns["act"], key=jax.random.key(0)))
    assert ft.train.load(tmp_path / "m2").activation is ns["act"]
    # Another object under a taken name is still refused, with a fix that works.
    with pytest.raises(ValueError, match=r"(?s)'__main__.act' is already registered .* another object.*"
                                         r"name=\"__main__.act_2\".*template=model"):
        notebook('def other(x):\n    return x\nft.train.register(other, name="__main__.act")')
    for _ in range(2):  # ft.train.register's docstring example, its cell run twice
        ns = notebook("@ft.train.register\nclass Counter(typing.NamedTuple):\n    count: jax.Array\n"
                      f"ft.train.save({str(tmp_path / 'c')!r}, Counter(jnp.array(3)), overwrite=True)\n")
        assert type(ft.train.load(tmp_path / "c")) is ns["Counter"]


def test_a_step_folder_copied_or_renamed_is_refused_not_restored_as_another_step(tmp_path):
    """`cp -r run/1 run/7` made restore(7) (and the latest restore) return step 1's arrays,
    silently: the metadata's step, under its CRC, was never compared with the folder's name."""
    directory = saved(tmp_path)
    shutil.copytree(directory / "1", directory / "7")
    for kwargs in ({"step": 7}, {}):
        message = restore_error(directory, **kwargs)
        assert "checkpoint at step 7" in message and "it holds step 1, but its folder is named 7" in message, message
        assert "restore step 1 from a folder of that name" in message
    shutil.rmtree(directory / "7")
    os.rename(directory / "1", directory / "5")
    assert "it holds step 1, but its folder is named 5" in restore_error(directory, step=5)
