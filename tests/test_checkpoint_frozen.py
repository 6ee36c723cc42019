"""A job whose optimizer trains a subset (LoRA) saves that subset, not its frozen base
(issue 45, item 12): the base is a fingerprint in the metadata, restored from the template
and refused, naming the key path, when it differs or is missing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train.checkpoint._frozen import _base, _fingerprints, frozen_keys

X = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)


def base(seed: int = 0) -> ft.nn.Sequential:
    k = jax.random.split(jax.random.key(seed), 2)
    return ft.nn.Sequential(ft.nn.Dense(64, 256, jax.nn.relu, key=k[0]), ft.nn.Dense(256, 64, key=k[1]))


def _loss(m, x):
    return jnp.mean((m(x) - x) ** 2)


def trainer(model: ft.nn.Sequential, wrt: str | None = "*.lora_*") -> ft.train.Trainer:
    # one loss function: the trainers of a configuration share its compiled step (a new lambda
    # each time compiled the same step again, functree/train/_programs.py)
    adapted = ft.nn.lora(model, "layers.*", rank=2, alpha=4, key=jax.random.key(2))
    return ft.train.Trainer(adapted, ft.optim.Optimizer(ft.optim.adam(1e-2), wrt=wrt), _loss)


def data() -> object:
    return ft.train.batches(X, 8, key=jax.random.key(3))


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def same(a, b) -> bool:
    return all(bool(jnp.all(x == y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_a_lora_job_saves_its_adapters_not_its_base_and_continues_bit_for_bit(tmp_path):
    straight = trainer(base())
    straight.fit(data(), steps=6, progress=False)
    t = trainer(base())
    t.fit(data(), steps=3, progress=False)
    t.save(tmp_path / "lora")
    whole = trainer(base(), wrt="*")  # everything, deliberately
    whole.save(tmp_path / "whole")
    lora, full = size(tmp_path / "lora"), size(tmp_path / "whole")
    # The base's bytes are what the LoRA job leaves out. orbax's own files move the sizes by
    # tens of KB from run to run (the LoRA job measured 24-51 KB, the whole 151 KB), so the
    # test bounds the difference: at least half the base (132 KB of float32), where a job
    # that saved its base would differ by those files' noise only.
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base()))
    assert full - lora > base_bytes / 2, (lora, full, base_bytes)
    meta = json.loads(next((tmp_path / "lora").rglob("meta/metadata")).read_text())
    assert sorted(meta["frozen"]["leaves"]) == ["model.layers.0.bias", "model.layers.0.weight",
                                                "model.layers.1.bias", "model.layers.1.weight"]
    assert not any(k in meta["checksums"] for k in meta["frozen"]["leaves"])
    resumed = trainer(base()).restore(tmp_path / "lora")
    assert same(resumed.model, t.model) and same(resumed.opt_state, t.opt_state) and resumed.steps_run == 3
    resumed.fit(data(), steps=6, progress=False)
    assert same(resumed.model, straight.model)  # bit for bit: the base came back exactly
    state = ft.train.JobState.restore(tmp_path / "lora", like=trainer(base()).state)
    assert same(state.model, t.model)


def test_a_different_base_is_refused_naming_the_leaf(tmp_path):
    t = trainer(base())
    t.fit(data(), steps=2, progress=False)
    t.save(tmp_path / "lora")
    with pytest.raises(ft.train.CheckpointError, match=r"trained on another base: its frozen leaf "
                       r"'model.layers.0.weight' \(float32\[64, 256\]\) holds other values in the template"):
        trainer(base(seed=1)).restore(tmp_path / "lora")
    small = ft.nn.Sequential(ft.nn.Dense(64, 128, jax.nn.relu, key=jax.random.key(0)),
                             ft.nn.Dense(128, 64, key=jax.random.key(1)))
    with pytest.raises(ft.train.CheckpointError, match=r"'model.layers.0.weight' \(float32\[64, 256\]\) is "
                       r"float32\[64, 128\] in the template"):
        ft.train.CheckpointManager(tmp_path / "lora").restore(template=ft.nn.lora(
            small, "layers.*", rank=2, alpha=4, key=jax.random.key(2)))


def test_restoring_without_the_base_is_refused_with_the_fix(tmp_path):
    t = trainer(base())
    t.save(tmp_path / "lora")
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)holds only what its job trained: the frozen base's 4 "
                       r"arrays \(model.layers.0.weight, ...\) were left out \(the base is not recorded in the "
                       r"checkpoint \(its fingerprints are\)\).*right:  trainer.restore\(path\)"):
        ft.train.JobState.restore(tmp_path / "lora")
    # A from_hf base is not named either (its config keeps no _name_or_path: one model read
    # from two paths compiles once); the message said "a model not built by ft.nn.from_hf".
    assert "not built by" not in str(_base(None))


def test_an_abstract_template_is_refused_naming_the_frozen_leaf(tmp_path):
    # jax.eval_shape's template restores a whole job; for a job without its base it failed
    # in NumPy: "float() argument must be a string or a real number, not 'ShapeDtypeStruct'"
    t = trainer(base())
    t.save(tmp_path / "lora")
    abstract = jax.eval_shape(lambda: t.model)
    with ft.train.CheckpointManager(tmp_path / "lora") as manager:
        with pytest.raises(ft.train.CheckpointError, match=r"(?s)its frozen leaf 'model.layers.0.weight' "
                           r"\(float32\[64, 256\]\) is not in it, and the template holds no values there "
                           r"\(ShapeDtypeStruct.*right:  manager.restore\(step, template=make_model\(\)\)"):
            manager.restore(template=abstract)
        assert same(manager.restore(template=t.model).model, t.model)  # a concrete base restores


def test_a_base_job_read_into_an_adapted_model_shows_the_lora_call_that_runs(tmp_path):
    """A base's checkpoint restored into ft.nn.lora(base) said only "build the template the
    same way"; the missing leaves are the adapters, and the fix adapts the restored model."""
    full = ft.train.Trainer(base(), ft.optim.adam(1e-2), lambda m, x: jnp.mean((m(x) - x) ** 2))
    full.save(tmp_path / "base")
    with pytest.raises(ft.train.CheckpointError, match=r"(?s)missing keys: +\['layers.0.lora_a'.*The missing leaves "
                       r"are LoRA adapters \(layers.0.lora_a, layers.0.lora_b, layers.1.lora_a, layers.1.lora_b\)") as info:
        trainer(base()).restore(tmp_path / "base")
    fix = next(line for line in str(info.value).splitlines() if "right:  ft.nn.lora(" in line)
    code = fix.split("right:", 1)[1].strip().replace("pattern", "'layers.*'")
    adapted = eval(code, {"ft": ft, "path": str(tmp_path / "base"), "key": jax.random.key(2)})
    assert same(adapted.layers[0].weight, full.model.layers[0].weight) and adapted.layers[0].lora_a.shape == (64, 8)


def test_what_a_subset_leaves_frozen():
    model = ft.nn.lora(base(), "layers.*", rank=2, alpha=4, key=jax.random.key(2))
    assert frozen_keys(model, None) == ()
    assert frozen_keys(model, ("*.lora_*",)) == ("model.layers.0.weight", "model.layers.0.bias",
                                                 "model.layers.1.weight", "model.layers.1.bias")
    assert frozen_keys(model, ("layers.1.*",)) == ("model.layers.0.weight", "model.layers.0.bias",
                                                   "model.layers.0.lora_a", "model.layers.0.lora_b")


def test_the_fingerprint_is_exact_and_placement_free():
    x = jax.random.normal(jax.random.key(0), (33, 7), jnp.bfloat16)
    y = x.at[5, 3].set(x[5, 3] + 1)
    swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
    got = _fingerprints({"x": x, "host": np.asarray(x), "y": y, "swapped": swapped,
                         "f32": np.arange(5, dtype=np.float32), "i8": np.arange(5, dtype=np.int8)})
    assert got["x"] == got["host"] and got["x"] != got["y"] and got["x"] != got["swapped"]
    bits = np.arange(5, dtype=np.float32).view(np.uint32).astype(np.uint64)
    i = np.arange(5, dtype=np.uint64)
    assert got["f32"] == [int(np.sum(bits * (2 * i + 1)) % 2**32), int(np.sum(bits ^ (i * 0x9E3779B9 % 2**32)) % 2**32)]


def test_the_fingerprint_is_one_across_x64_and_the_old_x64_form_restores():
    """jnp.sum of uint32 widened to uint64 under jax_enable_x64: one base's fingerprint was
    [858321213923, 827771298087] there and [3622722019, 3137577255] without, so a LoRA job
    restored across the flag was refused as "trained on another base". The sums are now
    taken in uint32 (mod 2**32) in both modes; an x64 job's old, unreduced sums (uint64)
    still restore, compared mod 2**32. (describe_frozen and restore_frozen are what
    trainer.save and trainer.restore call for the frozen base.)"""
    from functree.train.checkpoint import _frozen
    w = base().layers[0].weight
    bits = np.asarray(w).view(np.uint32).reshape(-1).astype(np.uint64)
    i = np.arange(bits.size, dtype=np.uint64)
    want = [int(np.sum(bits * (2 * i + 1)) % 2**32), int(np.sum(bits ^ (i * 0x9E3779B9 % 2**32)) % 2**32)]
    unreduced = [int(np.sum(bits * (2 * i + 1))), int(np.sum(bits ^ (i * 0x9E3779B9 % 2**32)))]
    assert unreduced[0] > 2**32  # the old form differs

    def written() -> dict:
        return _frozen.describe_frozen({"model.w": w}, ["model.w"], None)

    def restored(about: dict) -> jax.Array:
        arrays: dict = {}
        _frozen.restore_frozen(arrays, about, {"w": w}, step=3)
        return arrays["model.w"]

    x32 = written()
    with jax.enable_x64(True):
        x64 = written()
        assert restored(x32) is w
    old = {"source": None, "leaves": {"model.w": {**x64["leaves"]["model.w"], "fingerprint": unreduced}}}
    assert x32 == x64 and x32["leaves"]["model.w"]["fingerprint"] == want
    assert restored(x64) is w and restored(old) is w
    other = {"source": None, "leaves": {"model.w": {**old["leaves"]["model.w"], "fingerprint": [unreduced[0] + 1,
                                                                                              unreduced[1]]}}}
    with pytest.raises(ft.train.CheckpointError, match="holds other values in the template"):
        restored(other)
