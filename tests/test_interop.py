"""Interop: Equinox modules inside functree Modules; optax label trees and apply_updates."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import compiled
from _tolerance import assert_close_trained

import functree as ft
from functree._labels import is_label_tree, label_aware

X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)

LABEL_HOOK = getattr(ft.nn.Dense.__call__, "__ft_label_aware__", False)
needs_label_hook = pytest.mark.skipif(
    not LABEL_HOOK, reason="needs Module.__init_subclass__ to wrap __call__ with functree._labels.label_aware"
)


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


# --- Equinox inside functree ----------------------------------------------------------
def mixed_model():
    eqx = pytest.importorskip("equinox")

    class Mixed(ft.Module):
        mlp: eqx.nn.MLP
        head: ft.nn.Dense

        def __call__(self, x):
            return self.head(jax.vmap(self.mlp)(x))

    k1, k2 = jax.random.split(jax.random.key(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Mixed(eqx.nn.MLP(3, 4, 8, 1, key=k1), ft.nn.Dense(4, 1, key=k2))
    return model, [w for w in caught if issubclass(w.category, ft.NonDifferentiableFieldWarning)]


def test_equinox_submodule_gives_no_false_warning():
    _, caught = mixed_model()
    if caught and "callable" in str(caught[0].message):
        pytest.skip("needs functree/_module.py: a callable pytree with array leaves is a submodule")
    assert caught == []


def test_equinox_submodule_jits_behind_static_leaves_and_differentiates():
    model, _ = mixed_model()
    with pytest.raises(TypeError, match=r"custom_jvp|PjitFunction|function"):
        ft.jit(lambda m, x: m(x))(model, X)  # plain jax.jit rules: functions are not arrays
    forward = ft.jit(lambda m, x: m(x), static_leaves=True)
    assert_close_trained(forward(model, X), model(X), spread=2e-7)  # jitted vs eager: measured max 1.4e-7
    with compiled() as names:  # (not _cache_size(): JAX's C++ cache is one LRU a process shares)
        forward(model, X)
        forward(model, X)
    assert len(names) == 1  # the second call reuses the first's program
    grad = ft.gradient(lambda m: mse(m, (X, Y)), at=model)
    assert grad.mlp.activation is None and grad.mlp.layers[0].weight.shape == (8, 3)

    def step(m, x):  # a function returning the model: its function leaves come back
        g = ft.gradient(lambda mm: jnp.mean(mm(x) ** 2), at=m)
        return ft.move(m, along=ft.tangent_scale(g, -0.1))

    activation, before = model.mlp.activation, jnp.copy(model.head.weight)
    new = ft.jit(step, static_leaves=True, donate=0)(model, X)
    assert new.mlp.activation is activation
    assert not np.allclose(new.head.weight, before)


def test_equinox_submodule_summary_and_repr():
    model, _ = mixed_model()
    text = str(ft.summary(model))
    assert "mlp.layers.0.weight" in text and "activation" not in text
    assert ft.summary(model).parameter_count == 8 * 3 + 8 + 4 * 8 + 4 + 4 + 1
    lines = repr(model).splitlines()
    assert lines[0] == "Mixed(" and lines[1].startswith("  mlp=MLP(")
    assert all(line.startswith("    ") for line in lines[2:5])  # indented under its field


@pytest.mark.parametrize("on_nan", [None, "stop"])
def test_trainer_trains_a_model_with_an_equinox_submodule(on_nan):
    model, _ = mixed_model()
    trainer = ft.train.Trainer(model, ft.optim.adam(0.02), mse, on_nan=on_nan)
    history = trainer.fit((X, Y), epochs=15, batch_size=8, progress=False)
    assert history.epochs["loss"][-1] < 0.5 * history.epochs["loss"][0]
    assert_close_trained(trainer.evaluate((X, Y))["loss"], mse(trainer.inference_model, (X, Y)),
                         spread=1e-6)  # batched evaluate vs one call: measured max 5.4e-7
    assert trainer.predict(X).shape == (32, 1)


# --- optax label trees ------------------------------------------------------------------
def two_layer():
    k1, k2 = jax.random.split(jax.random.key(1))
    return ft.nn.Sequential(ft.nn.Dense(3, 4, jax.nn.relu, key=k1), ft.nn.Dense(4, 1, key=k2))


def test_label_aware_call_returns_the_labels_only_for_a_label_tree():
    class Scale(ft.Module):
        w: jax.Array
        __call__ = label_aware(lambda self, x: self.w * x)

    model = Scale(jnp.ones(2))
    labels = jax.tree.map(lambda p: "adam", model)
    tx = optax.multi_transform({"adam": optax.sgd(0.5)}, labels)  # optax calls labels(params): the labels
    np.testing.assert_array_equal(tx.update(ft.parameters(model), tx.init(model))[0].w, [-0.5, -0.5])
    np.testing.assert_array_equal(model(jnp.full(2, 3.0)), [3.0, 3.0])
    assert label_aware(Scale.__call__) is Scale.__call__  # wrapped once
    assert is_label_tree(labels) and not is_label_tree(model) and not is_label_tree(Scale(None))


@needs_label_hook
@pytest.mark.parametrize("combine", [optax.multi_transform, optax.partition])
def test_optax_partition_with_a_label_tree_shaped_like_the_model(combine):
    model = two_layer()
    labels = jax.tree.map(lambda p: "fast" if p.ndim == 2 else "frozen", model)
    tx = combine({"fast": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
    state = tx.init(model)
    grads = ft.gradient(lambda m: mse(m, (X, Y)), at=model)
    updates, state = tx.update(grads, state, model)
    new = ft.move(model, along=updates)
    np.testing.assert_allclose(new.layers[0].weight, model.layers[0].weight - 0.1 * grads.layers[0].weight,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(new.layers[1].bias, model.layers[1].bias)


@needs_label_hook
def test_optax_masked_with_ft_mask():
    model = two_layer()
    tx = optax.masked(optax.sgd(1.0), ft.mask(model, "*.weight"))
    grads = ft.gradient(lambda m: mse(m, (X, Y)), at=model)
    updates, _ = tx.update(grads, tx.init(ft.parameters(model)), ft.parameters(model))
    np.testing.assert_allclose(updates.layers[1].weight, -grads.layers[1].weight, rtol=1e-6)
    np.testing.assert_array_equal(updates.layers[1].bias, grads.layers[1].bias)  # masked: passed through


# --- optax.apply_updates vs ft.move -----------------------------------------------------
def test_apply_updates_needs_the_parameter_view_and_ft_move_takes_the_model():
    model = ft.nn.Sequential(ft.nn.Dense(3, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4))
    tx = optax.sgd(0.1)
    grads = ft.gradient(lambda m: jnp.sum(m(X)), at=model)
    updates, _ = tx.update(grads, tx.init(ft.parameters(model)))
    with pytest.raises(TypeError, match=r"NoneType"):  # running statistics have no update
        optax.apply_updates(model, updates)
    moved = ft.move(model, along=updates)
    by_view = ft.with_parameters(model, optax.apply_updates(ft.parameters(model), updates))
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(by_view)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(moved.layers[1].running_mean, model.layers[1].running_mean)


# --- foreign pytrees train (issue 29): Equinox modules and Flax NNX state ---------------
class _EqxCNN:
    """An eqx.nn CNN with MaxPool2d (init=-inf) and Dropout (p=0.5): Python floats that
    are static data, never parameters."""

    @staticmethod
    def make(key):
        import equinox as eqx

        class CNN(eqx.Module):
            layers: list

            def __init__(self, key):
                a, b = jax.random.split(key)
                self.layers = [eqx.nn.Conv2d(1, 3, 3, key=a), jax.nn.relu, eqx.nn.MaxPool2d(2, 2),
                               eqx.nn.Dropout(0.5), jnp.ravel, eqx.nn.Linear(3 * 3 * 3, 4, key=b)]

            def __call__(self, x, key):
                for layer in self.layers:
                    x = layer(x, key=key) if isinstance(layer, eqx.nn.Dropout) else layer(x)
                return x

        return CNN(key)

    @staticmethod
    def loss(model, batch, *, key):
        x, y = batch
        logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


CNN_X = np.random.default_rng(1).normal(size=(6, 1, 8, 8)).astype(np.float32)
CNN_Y = np.arange(6, dtype=np.int32) % 4


def test_equinox_cnn_with_maxpool_and_dropout_trains_in_train_step_as_optax_does():
    import equinox as eqx

    key = jax.random.key(3)
    model = _EqxCNN.make(jax.random.key(0))
    params = ft.parameters(model)
    assert params.layers[2].init is None and params.layers[3].p is None  # static data
    # The reference: eqx.filter_value_and_grad + optax.adam, the step's keys folded as it folds them.
    tx = optax.adam(1e-2)

    @eqx.filter_jit
    def ref_step(ref, ref_state, key):
        grads = eqx.filter_grad(_EqxCNN.loss)(ref, (CNN_X, CNN_Y), key=key)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int counts
            updates, ref_state = tx.update(grads, ref_state)
        return eqx.apply_updates(ref, updates), ref_state

    ref, ref_state = model, tx.init(eqx.filter(model, eqx.is_inexact_array))
    for t in range(3):
        ref, ref_state = ref_step(ref, ref_state, jax.random.fold_in(key, t))
    opt = ft.optim.Optimizer(optax.adam(1e-2))
    state = opt.init(model)
    step = ft.train.train_step(_EqxCNN.loss, opt, donate=False)
    for _ in range(3):
        model, state, _ = step(model, state, (CNN_X, CNN_Y), key=key)
    assert model.layers[2].init == -np.inf and model.layers[3].p == 0.5  # still Python floats
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(eqx.filter(ref, eqx.is_array))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # The Trainer runs the same step (its compiled program) and keeps the floats static.
    trainer = ft.train.Trainer(_EqxCNN.make(jax.random.key(0)), opt, _EqxCNN.loss, train_step=step, key=key)
    trainer.fit([(CNN_X, CNN_Y)] * 2, epochs=1, progress=False)
    assert trainer.steps_run == 2 and trainer.model.layers[3].p == 0.5
    assert np.isfinite(trainer.history.steps["loss"][-1])


def test_flax_nnx_state_trains_in_train_step_as_optax_does():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(3, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))

    def loss(p, batch):
        return mse(nnx.merge(graphdef, p), batch)

    tx = optax.adam(1e-2)

    @jax.jit
    def ref_step(ref, ref_state):
        grads = jax.grad(loss)(ref, (X, Y))
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int counts
            updates, ref_state = tx.update(grads, ref_state)
        return optax.apply_updates(ref, updates), ref_state

    ref, ref_state = params, tx.init(params)
    for _ in range(3):
        ref, ref_state = ref_step(ref, ref_state)
    opt = ft.optim.Optimizer(optax.adam(1e-2))
    state = opt.init(params)
    step = ft.train.train_step(loss, opt)
    for _ in range(3):
        params, state, _ = step(params, state, (X, Y))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_python_float_to_train_is_explained_make_it_an_array():
    with pytest.raises(TypeError, match=r"Python numbers in a tree are static data.*\['scale'\] = 0\.5.*jnp\.asarray\(0\.5\)"):
        ft.gradient(lambda m: m["scale"] * 2.0, at={"scale": 0.5})
    grads = ft.gradient(lambda m: m["scale"] * m["w"].sum(), at={"scale": 0.5, "w": jnp.ones(2)})
    assert grads["scale"] is None  # carried, not differentiated
