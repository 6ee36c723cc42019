"""record_state / collect_state / apply_state: pure layer state through grad and jit."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn import _state


class Counter(ft.Module):
    count: jax.Array = ft.field(no_derivative=True)

    def __call__(self, x):
        ft.nn.record_state(self, count=self.count + 1)
        return x


def _model(key):
    k1, k2 = jax.random.split(key)
    return ft.nn.Sequential(
        ft.nn.Dense(2, 3, key=k1), ft.nn.BatchNorm(3, momentum=0.5), ft.nn.Dense(3, 1, key=k2)
    )


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which layers already warned (the warning is shown once per process)."""
    monkeypatch.setattr(_state, "_WARNED", set())
    monkeypatch.setattr(_state, "_SEARCHES", {})


def test_outside_collect_state_nothing_is_recorded_and_it_warns(fresh_warnings):
    c = Counter(jnp.zeros(()))
    with pytest.warns(ft.nn.UncollectedStateWarning, match=r"(?s)Counter ran in training mode and recorded new count.*"
                      r"right:  loss, grads, state = ft.nn.value_with_gradient_and_state"):
        assert c(1.0) == 1.0  # no effect
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c(1.0) == 1.0  # once per process


class Net(ft.Module):
    body: ft.nn.Sequential
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.body(x))


def _net(key):
    return ft.nn.training(Net(_model(key), ft.nn.Dense(1, 1, key=key)))


def test_hand_written_loop_without_state_warns_with_the_key_path(key, fresh_warnings):
    """The issue's loop: value_with_gradient + update + move drops BatchNorm statistics."""
    net, x = _net(key), jnp.ones((4, 2))

    def loss_fn(m, x):
        return jnp.mean(m(x) ** 2)

    with pytest.warns(ft.nn.UncollectedStateWarning, match=r"BatchNorm at \.body\.layers\[1\] ran in training mode"):
        jax.jit(ft.value_with_gradient(loss_fn, wrt=0))(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(ft.value_with_gradient(loss_fn, wrt=0))(net, x + 1)  # that path already warned
        jax.jit(lambda m, x: ft.nn.value_with_gradient_and_state(loss_fn, m, x))(net, x)  # collected
        jax.jit(lambda m, x: m(x))(ft.nn.inference(net), x)  # inference records nothing


def test_value_with_gradient_and_state_matches_collect_state(key):
    net, x = _net(key), jax.random.normal(jax.random.key(1), (8, 2))

    def loss_fn(m, x, *, scale):
        return scale * jnp.mean(m(x) ** 2)

    def by_hand(m):
        out, state = ft.nn.collect_state(lambda mm: loss_fn(mm, x, scale=2.0), m)
        return out, state

    (loss, state), grads = ft.value_with_gradient(by_hand, at=net, has_aux=True)
    loss2, grads2, state2 = ft.nn.value_with_gradient_and_state(loss_fn, net, x, scale=2.0)
    np.testing.assert_allclose(loss2, loss, rtol=1e-5, atol=1e-6)
    assert sorted(map(str, state2)) == [".body.layers[1].running_mean", ".body.layers[1].running_variance"]
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (_loss3, aux), _g, state3 = ft.nn.value_with_gradient_and_state(
        lambda m, x: (jnp.mean(m(x) ** 2), "aux"), net, x, has_aux=True)
    assert aux == "aux" and set(state3) == set(state)


def test_hand_written_loop_updates_batch_norm_statistics(key):
    """The issue's numbers: data with mean 5 left running_mean at 0 and inference loss 3322."""
    x = jax.random.normal(jax.random.key(1), (64, 4)) + 5.0
    y = jnp.sum(x, -1, keepdims=True)
    model = ft.nn.training(ft.nn.Sequential(ft.nn.BatchNorm(4, momentum=0.9), ft.nn.Dense(4, 1, key=key)))
    optimizer = ft.optim.adam(0.05)
    opt_state = optimizer.init(model)

    def loss_fn(m, x, y):
        return ft.losses.mean_squared_error(m(x), y)

    @jax.jit
    def step(model, opt_state):
        loss, grads, state = ft.nn.value_with_gradient_and_state(loss_fn, model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return ft.nn.apply_state(ft.move(model, along=updates), state), opt_state, loss

    for _ in range(300):
        model, opt_state, loss = step(model, opt_state)
    np.testing.assert_allclose(model.layers[0].running_mean, jnp.mean(x, 0), rtol=1e-3)
    assert float(loss_fn(ft.nn.inference(model), x, y)) < 10 * float(loss) + 1e-3


def test_updates_are_keyed_by_path_and_applied(key):
    model = ft.nn.training(_model(key))
    x = jax.random.normal(jax.random.key(1), (8, 2))
    _y, updates = ft.nn.collect_state(lambda m: m(x), model)
    assert sorted(map(str, updates)) == [".layers[1].running_mean", ".layers[1].running_variance"]
    h = model.layers[0](x)
    new = ft.nn.apply_state(model, updates)
    np.testing.assert_allclose(new.layers[1].running_mean, 0.5 * jnp.mean(h, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new.layers[0].weight, model.layers[0].weight)


def test_training_step_under_grad_and_jit(key):
    """The train engineer's pattern: (loss, updates) as aux of a gradient, then apply_state."""
    model = ft.nn.training(_model(key))
    x = jax.random.normal(jax.random.key(1), (8, 2))
    target = jnp.ones((8, 1))

    def loss(m, x):
        y, updates = ft.nn.collect_state(lambda m: m(x), m)
        return jnp.mean((y - target) ** 2), updates

    @jax.jit
    def step(m, x):
        (value, updates), grads = ft.value_with_gradient(loss, wrt=0, has_aux=True)(m, x)
        m = ft.move(m, along=jax.tree.map(lambda g: -0.1 * g, grads))
        return ft.nn.apply_state(m, updates), value

    m1, v1 = step(model, x)
    m2, v2 = step(m1, x)
    eager_value, eager_updates = loss(model, x)
    np.testing.assert_allclose(v1, eager_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1.layers[1].running_mean, eager_updates[ft.key_path(model, ".layers[1].running_mean")], rtol=1e-5, atol=1e-6)
    assert not jnp.allclose(m1.layers[1].running_mean, m2.layers[1].running_mean)
    assert float(v2) < float(v1)
    grads = jax.grad(lambda m: loss(m, x)[0])(model)
    assert grads.layers[1].running_mean is not None  # jax.grad differentiates every float leaf
    assert ft.gradient(lambda m: loss(m, x)[0], at=model).layers[1].running_mean is None


def test_shared_layer_updates_every_path():
    c = Counter(jnp.zeros(()))
    model = ft.nn.Sequential(c, c)
    _, updates = ft.nn.collect_state(lambda m: m(1.0), model)
    assert sorted(map(str, updates)) == [".layers[0].count", ".layers[1].count"]


def test_recording_a_non_state_field_is_an_error():
    class Bad(ft.Module):
        weight: jax.Array

        def __call__(self, x):
            ft.nn.record_state(self, weight=self.weight)
            return x

    with pytest.raises(TypeError, match=r"(?s)Bad.weight is not a no_derivative field.*ft.field\(no_derivative=True\)"):
        ft.nn.collect_state(lambda m: m(1.0), Bad(jnp.ones(2)))


def test_layer_outside_the_model_is_an_error():
    other = Counter(jnp.zeros(()))
    with pytest.raises(ValueError, match=r"(?s)Counter recorded state.*not part of the model"):
        ft.nn.collect_state(lambda m: other(1.0), Counter(jnp.zeros(())))


def test_jit_inside_collect_state_is_an_error_with_the_fix():
    with pytest.raises(ValueError, match=r"(?s)fn is jit-compiled.*right:  jax.jit\(lambda model: ft.nn.collect_state"):
        ft.nn.collect_state(jax.jit(lambda m: m(1.0)), Counter(jnp.zeros(())))


def test_input_errors_get_the_key_path_from_collect_state(key):
    class Net(ft.Module):
        encoder: ft.nn.Dense
        head: ft.nn.Dense

        def __call__(self, x):
            return self.head(self.encoder(x))

    net = Net(ft.nn.Dense(2, 3, key=key), ft.nn.Dense(4, 1, key=key))
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense at \.head expects inputs \[\.\.\., 4\] \(float\), got f32\[5,3\]"):
        ft.nn.collect_state(lambda m: m(jnp.ones((5, 2))), net)


def test_apply_state_checks_shapes():
    with pytest.raises(ValueError, match=r"expected shape \(\)"):
        ft.nn.apply_state(Counter(jnp.zeros(())), {ft.key_path(None, ".count"): jnp.ones(3)})


def test_the_warning_points_at_the_users_line_not_at_functree(fresh_warnings):
    model = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2)))
    with pytest.warns(ft.nn.UncollectedStateWarning) as caught:
        line = __import__("inspect").currentframe().f_lineno + 1
        model(jnp.ones((4, 2)))
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
