"""copy.deepcopy and pickle of models: tree definitions stay equal, builtin functions
(jax.nn / ft.nn activations) stay the same objects, and a pickle names them publicly."""

from __future__ import annotations

import copy
import pickle
import pickletools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_module_construction import LAYER_CALLS

import functree as ft
from functree import _activations, _functions

K = jax.random.key(0)
ACTIVATIONS = [n for n in _activations.__all__ if n != "glu"]  # glu halves the features


def _with(name: str) -> ft.Module:
    return ft.nn.Dense(3, 4, getattr(ft.nn, name), key=K)


LAYERS = {
    **{cls.__name__: make for cls, (make, _) in LAYER_CALLS.items()},
    "Sequential": lambda: ft.nn.Sequential(ft.nn.Dense(2, 3, ft.nn.silu, key=K), jax.nn.gelu, jnp.tanh),
    "Dense(glu)": lambda: ft.nn.Dense(3, 4, ft.nn.glu, key=K),
}


def _same_model(copied: ft.Module, model: ft.Module) -> None:
    assert jax.tree.structure(copied) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)
    for (path, a), (_, b) in zip(ft._paths.walk(copied), ft._paths.walk(model)):
        if callable(a) and not isinstance(a, (ft.Module, jax.Array)):
            assert a is b, path  # functions and classes are the same objects


def test_every_layer_class_is_covered():
    layer_classes = {c for c in vars(ft.nn).values() if isinstance(c, type) and issubclass(c, ft.Module)}
    assert {c.__name__ for c in layer_classes - {ft.nn.Layer}} <= set(LAYERS)


@pytest.mark.parametrize("name", ACTIVATIONS + ["glu"])
def test_deepcopy_keeps_the_activation_and_copies_the_arrays(name):
    model = _with(name)
    copied = copy.deepcopy(model)
    assert copied.activation is model.activation
    assert jax.tree.structure(copied) == jax.tree.structure(model)
    assert copied.weight is not model.weight
    np.testing.assert_array_equal(copied.weight, model.weight)


@pytest.mark.parametrize("name", ACTIVATIONS + ["glu"])
def test_pickle_stores_the_activation_by_its_public_name(name):
    model = _with(name)
    data = pickle.dumps(model)
    fn = getattr(ft.nn, name)
    assert _functions.builtin_name(fn).encode() in data
    loaded = pickle.loads(data)
    assert loaded.activation is fn
    _same_model(loaded, model)
    if name != "glu":
        x = jnp.linspace(-2.0, 2.0, 6, dtype=jnp.float32).reshape(2, 3)
        np.testing.assert_array_equal(loaded(x), model(x))


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("clone", ["deepcopy", "pickle"])
def test_every_layer_copies_and_pickles_to_an_equal_tree(name, clone):
    model = LAYERS[name]()
    copied = copy.deepcopy(model) if clone == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert type(copied) is type(model)
    _same_model(copied, model)


def test_shallow_copy_shares_every_field():
    model = _with("relu")
    copied = copy.copy(model)
    assert copied is not model and all(copied.__dict__[k] is v for k, v in model.__dict__.items())


class Bag(ft.Module):
    fns: list = ft.field(no_derivative=True)
    table: dict = ft.field(no_derivative=True)


def test_functions_in_lists_and_dicts_pickle_by_name():
    bag = Bag([jax.nn.relu, (jax.nn.sigmoid,)], {"a": jnp.tanh})
    loaded = pickle.loads(pickle.dumps(bag))
    assert loaded.fns[0] is jax.nn.relu and loaded.fns[1][0] is jax.nn.sigmoid
    assert loaded.table["a"] is jnp.tanh
    copied = copy.deepcopy(bag)
    assert copied.fns[0] is jax.nn.relu and copied.fns is not bag.fns


def test_a_pickle_loads_only_registered_names():
    data = pickle.dumps(_functions.ByName("os.system"))
    globals_named = [arg for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE"]
    assert globals_named[:2] == ["functree._functions", "function"]
    with pytest.raises(ValueError) as info:
        pickle.loads(data)
    assert "names the function 'os.system', which is not among functree's registered" in str(info.value)


def test_registry_and_pickles_share_one_table():
    from functree.train.checkpoint import _registry

    for name, fn in _functions.builtin_functions().items():
        assert _registry.lookup_function(name) is fn
    assert _registry.function_name(ft.nn.relu) == _functions.builtin_name(ft.nn.relu) == "jax.nn.relu"


def _loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def test_a_deep_copy_trains_with_state_of_the_original():
    model = ft.nn.Sequential(ft.nn.Dense(3, 4, ft.nn.relu, key=K), ft.nn.Dense(4, 1, ft.nn.sigmoid, key=K))
    batch = (jnp.ones((4, 3)), jnp.zeros((4, 1)))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    state = opt.init(model)
    step = ft.jit(lambda m, s: opt.minimize(_loss, m, s, batch))
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        new, _, loss = step(copied, state)
        assert jax.tree.structure(new) == jax.tree.structure(model) and np.isfinite(float(loss))
    trainer = ft.train.Trainer(copy.deepcopy(model), opt, _loss)
    history = trainer.fit(batch, steps=3, progress=False)
    assert history["loss"][-1] < history["loss"][0]
