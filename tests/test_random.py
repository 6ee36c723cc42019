"""functree/_random.py: a key whose draws are hashed flat gives the key's own values, bit for
bit, and the initializers and dropout masks functree draws hash only flat counters (XLA:CPU
compiled a 3x3 conv kernel's he_normal draw in 7.25 CPU-s, flat in 0.63)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from _jaxpr import equations
from hypothesis import given, settings
from hypothesis import strategies as st

import functree as ft
from functree._random import NOT_A_KEY, SEVERAL_KEYS, flat_key, normal_runs

DRAWS = {
    "normal": lambda k, s: jax.random.normal(k, s),
    "uniform": lambda k, s: jax.random.uniform(k, s, jnp.float32, -2.0, 3.0),
    "truncated_normal": lambda k, s: jax.random.truncated_normal(k, -2.0, 2.0, s),
    "bernoulli": lambda k, s: jax.random.bernoulli(k, 0.3, s),
    "bits": lambda k, s: jax.random.bits(k, s),
    "he_normal": lambda k, s: jax.nn.initializers.he_normal()(k, (*s, 3, 2)),
}


@settings(max_examples=examples(12))  # each example compiles its draws
@given(shape=st.lists(st.integers(1, 4), max_size=4).map(tuple), seed=st.integers(0, 2**31 - 1),
       draw=st.sampled_from(sorted(DRAWS)))
def test_a_flat_keys_draws_are_the_keys_own(shape, seed, draw):
    key = jax.random.key(seed)
    np.testing.assert_array_equal(DRAWS[draw](flat_key(key), shape), DRAWS[draw](key, shape))


@pytest.mark.parametrize("partitionable", [True, False])
def test_batched_raw_jitted_and_both_threefry_counters_give_the_keys_own(partitionable):
    with jax.threefry_partitionable(partitionable):
        keys = jax.random.split(jax.random.key(3), 5)
        batched = jax.vmap(lambda k: jax.random.normal(flat_key(k), (4, 3, 2)))(keys)
        np.testing.assert_array_equal(batched, jax.vmap(lambda k: jax.random.normal(k, (4, 3, 2)))(keys))
        raw = jax.random.PRNGKey(7)  # a legacy uint32 key
        jitted = jax.jit(lambda k: jax.random.uniform(flat_key(k), (2, 3, 4)))(raw)
        np.testing.assert_array_equal(jitted, jax.random.uniform(raw, (2, 3, 4)))
        folded = jax.random.fold_in(flat_key(keys[0]), 9), jax.random.fold_in(keys[0], 9)
        np.testing.assert_array_equal(jax.random.key_data(folded[0]), jax.random.key_data(folded[1]))


def test_another_generators_key_is_kept():
    key = jax.random.key(0, impl="rbg")
    assert flat_key(key) is key
    flat = flat_key(jax.random.key(0))
    assert flat_key(flat) is flat


def _draws(jaxpr: Any) -> list[tuple[str, int]]:
    """``(generator, rank)`` of every draw of bits in ``jaxpr``, nested ones included."""
    return [(str(eqn.invars[0].aval.dtype), len(eqn.params["shape"]))
            for eqn in equations(jaxpr) if eqn.primitive.name == "random_bits"]


BUILDS = {
    "Conv2D": lambda k: ft.nn.Conv2D(3, 8, (3, 3), key=k, weight_initializer=jax.nn.initializers.he_normal()),
    "Stack of Dense": lambda k: ft.nn.Stack(lambda kk: ft.nn.Dense(4, 4, key=kk), 3, key=k),
    "LSTM in a Stack": lambda k: ft.nn.Stack(lambda kk: ft.nn.LSTMCell(3, 4, key=kk), 2, key=k),
    "Dropout on [batch, time, features]": lambda k: ft.nn.Dropout(0.5, training=True)(jnp.ones((2, 3, 4)), key=k),
    "attention dropout": lambda k: ft.nn.training(ft.nn.MultiheadAttention(8, 2, dropout=0.5, key=k))(
        jnp.ones((2, 3, 8)), key=k),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_initializers_and_masks_hash_flat_counters(build):
    """main hashed a conv kernel's counters in 4 axes, a Stack's and a mask's in 3: every
    draw of two axes or more is now made with a flat key."""
    draws = _draws(jax.make_jaxpr(BUILDS[build])(jax.random.key(0)).jaxpr)
    assert any(rank >= 2 for _, rank in draws), draws
    assert all(generator == "key<fryf>" for generator, rank in draws if rank >= 2), draws


def test_a_conv_kernel_and_a_stack_are_what_their_keys_draw():
    key = jax.random.key(1)
    conv = BUILDS["Conv2D"](key)
    np.testing.assert_array_equal(conv.weight, jax.nn.initializers.he_normal()(key, (3, 3, 3, 8), jnp.float32))
    stack = BUILDS["Stack of Dense"](key)
    for i, k in enumerate(jax.random.split(key, 3)):
        np.testing.assert_array_equal(stack.layers.weight[i], ft.nn.Dense(4, 4, key=k).weight)
    assert not any(jnp.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(stack))


def test_normal_runs_slice_few_flat_runs_each_array_its_shape(monkeypatch):
    """normal_runs: the arrays in order, sliced from runs of at most RUN values drawn with
    fold_in(key, run); an array larger than RUN is a run of its own; one draw (one hash) a run."""
    from functree import _random

    key = jax.random.key(5)
    shapes = [(3, 4), (2, 2, 5), (7,), (1, 1)]
    drawn = _random.normal_runs(key, shapes)
    assert [a.shape for a in drawn] == shapes and all(a.dtype == jnp.float32 for a in drawn)
    flat = jax.random.normal(jax.random.fold_in(key, 0), (12 + 20 + 7 + 1,))
    np.testing.assert_array_equal(np.concatenate([np.ravel(a) for a in drawn]), flat)
    hashes = [e for e in equations(jax.make_jaxpr(lambda k: _random.normal_runs(k, shapes))(key))
              if str(e.primitive) == "random_bits"]
    assert len(hashes) == 1

    monkeypatch.setattr(_random, "RUN", 10)  # runs: [(3, 4)] (over RUN: alone), [(2, 2, 5)], [(7,), (1, 1)]
    runs = _random.normal_runs(key, shapes)
    np.testing.assert_array_equal(np.ravel(runs[0]), jax.random.normal(jax.random.fold_in(key, 0), (12,)))
    np.testing.assert_array_equal(np.ravel(runs[1]), jax.random.normal(jax.random.fold_in(key, 1), (20,)))
    np.testing.assert_array_equal(np.concatenate([np.ravel(runs[2]), np.ravel(runs[3])]),
                                  jax.random.normal(jax.random.fold_in(key, 2), (8,)))


def test_normal_runs_are_standard_normals():
    drawn = np.concatenate([np.ravel(a) for a in normal_runs(jax.random.key(0), [(300, 40), (50, 7, 9), (4000,)])])
    # 19150 standard normals: the mean's error has std 0.0072, the std's 0.0051 (margins ~5 sigma)
    assert abs(drawn.mean()) < 0.036 and abs(drawn.std() - 1) < 0.026


_K = jax.random.key(0)
_X = jnp.ones((2, 4))
_GPT2 = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2, "n_head": 2}
_KEY_TAKERS = {  # the containers and entry points that split or fold their key= before any draw
    "Sequential call": lambda k: ft.nn.Sequential(ft.nn.Dense(4, 4, key=_K), ft.nn.Dropout(0.5))(_X, key=k),
    "Stack call": lambda k: ft.nn.training(ft.nn.Stack(
        lambda kk: ft.nn.Sequential(ft.nn.Dense(4, 4, key=kk), ft.nn.Dropout(0.5)), 2, key=_K))(_X, key=k),
    "Stack": lambda k: ft.nn.Stack(lambda kk: ft.nn.Dense(4, 4, key=kk), 2, key=k),
    "MLP": lambda k: ft.nn.MLP(4, 3, 8, 2, key=k),
    "MultiheadAttention": lambda k: ft.nn.MultiheadAttention(4, 2, key=k),
    "TransformerEncoderLayer": lambda k: ft.nn.TransformerEncoderLayer(4, 2, 8, key=k),
    "LSTM": lambda k: ft.nn.LSTM(4, 4, batch_first=True, key=k),
    "lora": lambda k: ft.nn.lora(ft.nn.Sequential(ft.nn.Dense(4, 4, key=_K)), "*", rank=2, key=k),
    "from_hf": lambda k: ft.nn.from_hf(_GPT2, key=k),
    "jitted Sequential call": lambda k: jax.jit(lambda kk: ft.nn.Sequential(ft.nn.Dense(4, 4, key=_K))(_X, key=kk))(k),
}


@pytest.mark.parametrize("call", list(_KEY_TAKERS))
def test_an_integer_seed_or_several_keys_is_named_where_a_container_first_splits_it(call):
    """Sequential(...)(x, key=0), MLP(..., key=0), from_hf(config, key=0) failed inside JAX's
    split or fold_in ("invalid PRNG key data", "split accepts a single key"), naming no key=,
    while Dense(..., key=0) named it: every one now raises NOT_A_KEY or SEVERAL_KEYS."""
    make = _KEY_TAKERS[call]
    given = "an array of int32[]" if call.startswith("jitted") else "int 0"
    with pytest.raises(TypeError) as info:
        make(0)
    assert str(info.value) == NOT_A_KEY.format(given=given)
    for keys, what in ((jax.random.split(_K, 3), "a key array"), (jax.random.split(jax.random.PRNGKey(0), 3), "raw uint32 key data")):
        with pytest.raises(ValueError) as info:
            make(keys)
        assert str(info.value) == SEVERAL_KEYS.format(n=3, what=what, shape=tuple(keys.shape))


def test_one_key_is_refused_as_a_seed_and_a_batch_under_vmap_is_one_key_each():
    """A NumPy uint32 seed reached JAX's split as key data; a layer called under vmap over
    keys gets one key each, and Dense(..., key=split(k, 3)) names the three keys."""
    with pytest.raises(TypeError) as info:
        ft.nn.Dense(4, 3, key=np.uint32(7))
    assert str(info.value) == NOT_A_KEY.format(given="uint32 np.uint32(7)")
    with pytest.raises(ValueError, match=r"got 3 keys \(a key array of shape \(3,\)"):
        ft.nn.Dense(4, 3, key=jax.random.split(_K, 3))
    drop = ft.nn.training(ft.nn.Sequential(ft.nn.Dropout(0.5)))
    masks = jax.vmap(lambda k: drop(jnp.ones(8), key=k))(jax.random.split(_K, 3))
    assert masks.shape == (3, 8)
