"""Sequential and Lambda: composition, key splitting, key paths in errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def _mlp(key):
    k1, k2 = jax.random.split(key)
    return ft.nn.Sequential(ft.nn.Dense(3, 8, key=k1), jax.nn.relu, ft.nn.Dropout(0.5), ft.nn.Dense(8, 2, key=k2))


def test_applies_layers_in_order(key):
    model = _mlp(key)
    x = jax.random.normal(jax.random.key(1), (4, 3))
    d0, _, _, d3 = model.layers
    np.testing.assert_allclose(model(x), d3(jax.nn.relu(d0(x))), rtol=1e-6)
    assert isinstance(model.layers[1], ft.nn.Lambda)
    assert len(model) == 4 and model[0] is d0 and len(model[:2]) == 2


def test_key_paths_and_jit(key):
    model = _mlp(key)
    names = list(ft.to_flat_dict(model))
    assert names == ["layers.0.weight", "layers.0.bias", "layers.3.weight", "layers.3.bias"]
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(model, x), model(x), rtol=1e-5, atol=1e-6)


def test_key_is_split_among_layers_that_take_one(key):
    model = ft.nn.training(ft.nn.Sequential(ft.nn.Dropout(0.5), ft.nn.Dropout(0.5)))
    x = jnp.ones(1000)
    a = model(x, key=jax.random.key(1))
    k1, _ = jax.random.split(jax.random.key(1))
    first = model.layers[0](x, key=k1)
    kept = first != 0
    # the second dropout uses a different key: its mask differs from the first one's
    assert not jnp.array_equal(a != 0, kept)
    assert jnp.all((a == 0) | (a == 4.0))


def test_dropout_in_training_without_key_is_an_error(key):
    model = ft.nn.training(_mlp(key))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        model(jnp.ones((2, 3)))


def test_input_error_carries_key_path(key):
    model = ft.nn.Sequential(ft.nn.Sequential(ft.nn.Dense(3, 4, key=key)))
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense at \.layers\[0\]\.layers\[0\] expects inputs \[\.\.\., 3\]"):
        model(jnp.ones((2, 5)))


def test_a_list_of_layers_is_accepted(key):
    model = ft.nn.Sequential([ft.nn.Dense(3, 2, key=key), jnp.tanh])
    assert len(model) == 2 and isinstance(model[1], ft.nn.Lambda)
    np.testing.assert_allclose(model(jnp.ones(3)), jnp.tanh(model[0](jnp.ones(3))), rtol=1e-6)


def test_non_callable_layer_is_an_error():
    with pytest.raises(TypeError, match="Sequential layer 0 is a int"):
        ft.nn.Sequential(3)


def test_gradient_through_sequential(key):
    model = _mlp(key)
    grads = ft.gradient(lambda m: jnp.sum(m(jnp.ones((2, 3)))), at=model)
    assert grads.layers[0].weight.shape == (3, 8)
    assert jax.tree.leaves(grads.layers[1]) == [] and isinstance(grads.layers[1], ft.nn.Lambda)


def test_gradient_finite_differences(key):
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        model = jax.tree.map(lambda a: a.astype(jnp.float64), _mlp(key))
        x = jax.random.normal(jax.random.key(1), (2, 3), jnp.float64)
        check_grads(jax.jit(lambda m, x: m(x)), (model, x), order=1, modes=["rev"])


def _double(x):  # takes no key
    return 2.0 * x


def _noisy(x, key=None):  # drops half the entries when given a key (dropout-like)
    return x if key is None else x * jax.random.bernoulli(key, 0.5, x.shape).astype(x.dtype) / 0.5


@pytest.mark.filterwarnings("ignore::functree.NonDifferentiableFieldWarning")  # Remat.layer a Partial without arrays
@pytest.mark.parametrize("order", [("double", "noisy"), ("noisy", "double")])
def test_whether_a_layer_takes_a_key_is_its_own_not_its_types(order):
    # takes_key was cached per type: every jax.tree_util.Partial shared the first one's answer
    # (the key then silently dropped, or passed to a function without one: a TypeError).
    x, k = jnp.ones(6), jax.random.key(0)
    functions = {"double": _double, "noisy": _noisy}
    for name in order:
        f = jax.tree_util.Partial(functions[name])
        expected = _noisy(x, key=k) if name == "noisy" else _double(x)  # the function called itself
        np.testing.assert_array_equal(np.asarray(ft.nn.Remat(f)(x, key=k)), np.asarray(expected))


def test_a_patched_call_is_asked_afresh_whether_it_takes_a_key(monkeypatch):
    class Plain(ft.nn.Layer):
        def __call__(self, x):
            return 2.0 * x

    x, k = jnp.ones(6), jax.random.key(0)
    np.testing.assert_array_equal(np.asarray(ft.nn.Sequential(Plain())(x, key=k)), np.full(6, 2.0))  # cached: no key
    monkeypatch.setattr(Plain, "__call__", lambda self, x, key=None: _noisy(x, key))
    expected = _noisy(x, jax.random.split(k, 1)[0])
    assert not np.all(np.asarray(expected) == 1.0)  # the key is used
    np.testing.assert_array_equal(np.asarray(ft.nn.Sequential(Plain())(x, key=k)), np.asarray(expected))


# --- foreign (Equinox) layers are children, trained and switched, given keys


def _eqx_model():
    eqx = pytest.importorskip("equinox")
    dense = ft.nn.Dense(4, 3, jnp.tanh, key=jax.random.key(0))
    return eqx, ft.nn.Sequential(dense, eqx.nn.Linear(3, 2, key=jax.random.key(1)), eqx.nn.Dropout(0.5))


def test_an_equinox_linear_is_trained_as_a_child():
    """It was wrapped in a static Lambda: 'Static field Lambda.fn holds an unhashable Linear'."""
    eqx, seq = _eqx_model()
    assert isinstance(seq.layers[1], eqx.nn.Linear)
    x = jnp.asarray(np.random.default_rng(0).normal(size=4).astype(np.float32))
    grads = ft.gradient(lambda m: jnp.sum(ft.nn.inference(m)(x) ** 2))(seq)

    def reference(w, b):  # the same function written out, differentiated by jax.grad
        h = jnp.tanh(x @ seq.layers[0].weight + seq.layers[0].bias)
        return jnp.sum((w @ h + b) ** 2)

    gw, gb = jax.grad(reference, argnums=(0, 1))(seq.layers[1].weight, seq.layers[1].bias)
    np.testing.assert_allclose(grads.layers[1].weight, gw, rtol=0, atol=1e-6)
    np.testing.assert_allclose(grads.layers[1].bias, gb, rtol=0, atol=1e-6)


def test_an_equinox_dropout_gets_a_key_and_follows_the_model_mode():
    _, seq = _eqx_model()
    x = jnp.arange(1.0, 5.0)
    hidden = seq[:2](x)
    run = jax.jit(lambda m, k: ft.nn.training(m)(x, key=k))
    outs = [np.asarray(run(seq, jax.random.key(i))) for i in range(8)]
    for out in outs:  # each element dropped or scaled by 1 / (1 - p)
        assert np.all(np.isclose(out, 0.0) | np.isclose(out, 2 * np.asarray(hidden), atol=1e-6))
    assert len({out.tobytes() for out in outs}) > 1  # keys differ, masks differ
    np.testing.assert_allclose(jax.jit(lambda m: ft.nn.inference(m)(x))(seq), hidden, rtol=0, atol=0)


class _Unhashable:
    """A callable that is no pytree and not hashable (defines __eq__ only)."""

    def __init__(self):
        self.weight = np.ones((2, 2), np.float32)

    def __eq__(self, other):
        return self is other

    def __call__(self, x):
        return x @ self.weight


def test_an_unhashable_callable_is_a_named_error():
    from functree.nn._sequential import UNHASHABLE_CALLABLE

    with pytest.raises(TypeError, match=r"(?s)Sequential layer 1 is a _Unhashable.*class Layer1\(ft.Module\)"):
        ft.nn.Sequential(jnp.tanh, _Unhashable())
    assert "right:" in UNHASHABLE_CALLABLE
