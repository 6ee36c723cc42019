"""training / inference / inferring: one static switch for a whole model."""

import jax
import jax.numpy as jnp
import numpy as np

import functree as ft


class Net(ft.nn.Layer):
    body: ft.nn.Sequential
    extra: dict

    def __call__(self, x, *, key=None):
        return self.extra["drop"](self.body(x, key=key), key=key)


def _net(key):
    body = ft.nn.Sequential(ft.nn.Dense(2, 4, key=key), ft.nn.BatchNorm(4), ft.nn.Dropout(0.5))
    return Net(body, {"drop": ft.nn.Dropout(0.2)})


def test_switches_every_flag_and_keeps_parameters(key):
    net = _net(key)
    assert not ft.nn.is_training(net)
    t = ft.nn.training(net)
    assert t.body.layers[1].training and t.body.layers[2].training and t.extra["drop"].training
    assert t.body.layers[0].weight is net.body.layers[0].weight
    back = ft.nn.inference(t)
    assert not ft.nn.is_training(back)
    assert jax.tree.structure(back) == jax.tree.structure(net)


def test_inferring_function_and_method(key):
    t = ft.nn.training(_net(key))
    x = jax.random.normal(jax.random.key(1), (3, 2))
    expected = ft.nn.inference(t)(x)
    np.testing.assert_array_equal(ft.nn.inferring(t, x), expected)
    np.testing.assert_array_equal(t.inferring(x), expected)
    assert ft.nn.is_training(t)  # the model itself is unchanged


def test_switching_costs_no_recompilation_per_call(key):
    traces = []

    @jax.jit
    def f(m, x):
        traces.append(1)
        return ft.nn.collect_state(lambda m: m(x, key=jax.random.key(0)), m)

    net, x = _net(key), jnp.ones((3, 2))
    for _ in range(3):
        f(ft.nn.training(net), x)
        f(ft.nn.inference(net), x)
    assert len(traces) == 2


def test_models_without_flags_are_unchanged(key):
    dense = ft.nn.Dense(2, 2, key=key)
    assert jax.tree.structure(ft.nn.training(dense)) == jax.tree.structure(dense)
    assert ft.nn.training({"a": [dense]})["a"][0].weight is dense.weight
