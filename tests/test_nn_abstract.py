"""Shapes only (functree/nn/_abstract.py): layers built inside shapes_only() skip their
initializers, and nothing else changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn._abstract import _SHAPES_ONLY, initialized, shapes_only


def counting():
    calls = []

    def init(key, shape, dtype):
        calls.append(shape)
        return jnp.ones(shape, dtype)

    return init, calls


def test_inside_shapes_only_no_initializer_runs_and_the_shapes_are_the_same():
    init, calls = counting()

    def build():
        return ft.nn.Sequential(ft.nn.Dense(3, 5, key=jax.random.key(0), weight_initializer=init, bias_initializer=init,
                                            dtype=jnp.bfloat16),
                                ft.nn.Embedding(7, 2, key=jax.random.key(1), initializer=init))

    with shapes_only():
        skipped = jax.eval_shape(lambda: build())
    assert calls == []
    traced = jax.eval_shape(lambda: build())  # another function: eval_shape caches a function's trace
    assert calls == [(3, 5), (5,), (7, 2)]
    assert jax.tree.structure(skipped) == jax.tree.structure(traced)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(skipped)] == [(x.shape, x.dtype) for x in jax.tree.leaves(traced)]


def test_outside_it_the_initializer_runs_and_the_flag_is_reset_after_an_error():
    init, calls = counting()
    with pytest.raises(KeyError), shapes_only():
        assert _SHAPES_ONLY.get() is True
        raise KeyError("a failed build")
    assert _SHAPES_ONLY.get() is False
    np.testing.assert_array_equal(initialized(init, jax.random.key(0), (2,), jnp.float32), [1.0, 1.0])
    assert calls == [(2,)]


def test_a_layer_built_eagerly_inside_shapes_only_is_refused_not_zeroed():
    """Outside a trace, shapes_only() would make a real model of zeros: an error instead."""
    with shapes_only(), pytest.raises(RuntimeError, match=r"(?s)built outside a trace.*jax.eval_shape"):
        ft.nn.Dense(3, 2, key=jax.random.key(0))
    assert float(jnp.abs(ft.nn.Dense(3, 2, key=jax.random.key(0)).weight).sum()) > 0
