"""The Trainer's log intervals (functree/train/_intervals.py): the next buffer and the
snapshot of the learning context, from only the optimizer state's leaves they read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import compiled

import functree as ft
from functree.train import _intervals
from functree.train._intervals import STOPPED_EARLIER, next_buffer, snapshot, to_host


def _state(tx):
    """The optimizer state after one step, built in one compiled program (eagerly, adam's
    init and update were ~50 programs of one operation each; the same values, bit for bit)."""
    opt = ft.optim.Optimizer(tx)

    def build():
        model = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3), "head": {"v": jnp.ones(2)}}
        state = opt.init(model)
        grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), model)
        return opt.apply_gradients(grads, model, state, minibatch_size=4)[1]

    return jax.jit(build)()


TRANSFORMS = {
    "adam": lambda: ft.optim.adam(1e-3),
    "sgd momentum, scheduled": lambda: ft.optim.sgd(ft.optim.cosine_decay(0.1, 100), momentum=0.9),
    "groups": lambda: ft.optim.groups({"head.*": ft.optim.sgd(0.1), "[wb]": ft.optim.adam(1e-3)}),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_next_buffer_reads_only_the_context_and_hyperparameters_and_equals_the_whole_state_snapshot(name):
    state = _state(TRANSFORMS[name]())
    halt, rows = jnp.array([7, 3, 1], jnp.int32), jnp.arange(12.0).reshape(4, 3)
    buffer, ctx = next_buffer(halt, rows, state)
    leaves, treedef = jax.tree.flatten(state)
    used, _ = _intervals._NEXT[treedef]
    assert 0 < len(used) < len(leaves)  # not the moments
    expected = jax.device_get(snapshot(state))
    got = to_host(ctx)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(buffer["halt"], [0, STOPPED_EARLIER, 1])  # the stop carried
    np.testing.assert_array_equal(buffer["rows"], np.zeros((4, 3)))
    buffer, _ = next_buffer(jnp.array([7, -1, -1], jnp.int32), rows, state)
    np.testing.assert_array_equal(buffer["halt"], [0, -1, -1])


def test_next_buffer_without_a_state_opens_the_buffer_alone():
    rows = jnp.arange(12.0).reshape(4, 3)
    buffer, ctx = next_buffer(jnp.array([7, 3, 1], jnp.int32), rows)
    assert ctx is None
    np.testing.assert_array_equal(buffer["halt"], [0, STOPPED_EARLIER, 1])  # the stop carried
    np.testing.assert_array_equal(buffer["rows"], np.zeros((4, 3)))
    buffer, _ = next_buffer(jnp.array([7, -1, -1], jnp.int32), rows)
    np.testing.assert_array_equal(buffer["halt"], [0, -1, -1])


def test_next_buffer_compiles_once_per_state_structure():
    state = _state(ft.optim.adam(1e-3))
    rows = jnp.zeros((4, 3))
    halts = jnp.array([1, -1, -1], jnp.int32)
    with compiled() as names:  # (not _cache_size(): another test's compiled() block adds an entry)
        for _ in range(3):
            next_buffer(halts, rows, state)
    assert names == ["jit(_next_buffer)"], names


def test_to_host_equals_device_get():
    tree = {"a": jnp.arange(3), "b": (jnp.float32(2.5), None)}
    got, expected = to_host(tree), jax.device_get(tree)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mesh", [False, True])
def test_opening_the_metric_buffer_compiles_nothing(mesh):
    """The buffer comes from the host, committed where the step returns it: main's eager
    ``jnp.array`` and ``jnp.zeros`` compiled two programs before the first step."""

    state = _state(ft.optim.adam(1e-3))
    log = _intervals.MetricLog("nonfinite")
    log.names = ["loss", "nonfinite"]
    log.resize(10)
    place = None
    if mesh:
        step = ft.train.train_step(lambda m, b: jnp.sum(m["w"]), ft.optim.adam(1e-3), mesh=jax.make_mesh((1,), ("data",)))
        place = step._place_log
    with compiled() as names:
        buffer = jax.block_until_ready(log.open(state, place))
    assert names == []  # main: ["jit(convert_element_type)", "jit(broadcast_in_dim)"]
    assert buffer["halt"].dtype == jnp.int32 and buffer["rows"].dtype == jnp.float32
    assert buffer["halt"].committed and buffer["rows"].committed
    np.testing.assert_array_equal(buffer["halt"], [0, -1, -1])
    np.testing.assert_array_equal(buffer["rows"], np.zeros((16, 3)))  # loss, nonfinite, learning_rate
