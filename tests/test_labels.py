"""Label trees shaped like a model, given to optax (functree/_labels.py)."""

import abc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree._labels import label_aware


def _net():
    return ft.nn.Sequential(ft.nn.Dense(2, 4, key=jax.random.key(0)), ft.nn.Dropout(0.1),
                            ft.nn.Dense(4, 1, key=jax.random.key(1)))


def test_labels_from_a_training_mode_model_meet_the_optimizers_mode_free_parameters():
    net = ft.nn.training(_net())
    labels = jax.tree.map(lambda v: "adam" if v.ndim > 1 else "sgd", net)  # training-mode definition
    tx = optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-1)}, labels)
    opt = ft.optim.Optimizer(tx)
    state = opt.init(net)  # was: ValueError "pytree structure error: different pytree metadata"
    grads = jax.tree.map(jnp.ones_like, ft.parameters(net))
    updates, _ = opt.update(grads, state, net)
    # optax on the inference-mode trees, where the definitions agree: the reference
    plain = ft.nn.inference(net)
    ref_tx = optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-1)},
                                   jax.tree.map(lambda v: "adam" if v.ndim > 1 else "sgd", plain))
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float rates and int counts
        ref, _ = ref_tx.update(ft.nn.inference(grads), ref_tx.init(ft.parameters(plain)), ft.parameters(plain))
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


def test_label_tree_called_by_optax_takes_the_parameters_mode():
    net = ft.nn.training(_net())
    labels = jax.tree.map(lambda v: "zero" if v.ndim > 1 else "keep", net)  # training-mode definition
    params = ft.parameters(ft.nn.inference(net))  # optax calls labels(params) with these
    tx = optax.multi_transform({"zero": optax.set_to_zero(), "keep": optax.identity()}, labels)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params))
    assert updates.layers[1].training is False  # the parameters' mode
    np.testing.assert_array_equal(updates.layers[0].weight, np.zeros((2, 4)))  # masked: zeroed
    np.testing.assert_array_equal(updates.layers[0].bias, np.ones(4))  # not masked: passed through


class Offset(ft.Module):
    """A module whose leaves are Python ints, as a label tree's are."""

    k: int = ft.field(no_derivative=True)

    def __call__(self, other):
        return Offset(self.k + other.k)


def test_a_users_call_with_its_own_class_runs_the_users_code():
    # was: Offset(2) returned (label_aware took the call for optax's label call)
    assert Offset(2)(Offset(3)).k == 5
    assert Offset.__call__(Offset(2), Offset(3)).k == 5
    assert Offset(2)(jax.jit(lambda o: o)(Offset(3))).k == 5  # an array leaf: the same
    labels = jax.tree.map(lambda _: "sgd", Offset(1))  # called by optax, it is still the labels
    tx = optax.multi_transform({"sgd": optax.sgd(1.0)}, labels)
    assert tx.update(Offset(jnp.float32(2.0)), tx.init(Offset(jnp.float32(1.0))))[0].k == -2.0


def test_labels_at_batchnorm_statistics_meet_the_parameter_views_none():
    net = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(2, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4),
                                          ft.nn.Dense(4, 1, key=jax.random.key(1))))
    x = jax.random.normal(jax.random.key(2), (8, 2))
    batch = (x, jnp.ones((8, 1)))

    def loss_fn(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    def make():  # labels at every leaf of the model, running statistics included
        labels = jax.tree.map(lambda v: "a" if v.ndim > 1 else "b", net)
        return optax.multi_transform({"a": optax.adam(1e-2), "b": optax.sgd(0.1)}, labels)

    opt = ft.optim.Optimizer(make())
    step = ft.train.train_step(loss_fn, opt, donate=False)
    model, state = net, opt.init(net)  # was: ValueError "different pytree metadata"
    ref_tx, ref = make(), net
    ref_state = ref_tx.init(ft.parameters(ref))
    for _ in range(3):
        model, state, _ = step(model, state, batch)
        _, g, layer_state = ft.nn.value_with_gradient_and_state(loss_fn, ref, batch)
        with jax.numpy_dtype_promotion("standard"):
            u, ref_state = ref_tx.update(g, ref_state, ft.parameters(ref))
        ref = ft.nn.apply_state(ft.move(ref, along=u), layer_state)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)  # values ~1


class _Mixin:
    """A forward pass from a class that is not a Module."""

    def __call__(self, x):
        return jnp.tanh(x @ self.w) @ self.v


def _two(cls):
    return cls(jnp.asarray(np.linspace(-1, 1, 12).reshape(3, 4), jnp.float32),
               jnp.asarray(np.linspace(0, 2, 8).reshape(4, 2), jnp.float32))


def _updates_match_optax_on_a_dict(model):
    """multi_transform, partition and masked with a label tree of ``model``'s class, against
    the same transformation on a dict of its leaves."""
    lab = lambda a: "a" if a.shape == (3, 4) else "b"  # noqa: E731
    makes = [lambda L: optax.multi_transform({"a": optax.sgd(1.0), "b": optax.adam(0.1)}, L),
             lambda L: optax.partition({"a": optax.sgd(1.0), "b": optax.sgd(2.0)}, L),
             lambda L: optax.masked(optax.sgd(1.0), L)]
    for make, label in zip(makes, [lab, lab, lambda a: a.shape == (3, 4)]):
        plain = {"w": model.w, "v": model.v}
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float rates and int counts
            tx = make(jax.tree.map(label, model))
            updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, model), tx.init(model), model)
            ref_tx = make(jax.tree.map(label, plain))
            ref, _ = ref_tx.update(jax.tree.map(jnp.ones_like, plain), ref_tx.init(plain), plain)
        np.testing.assert_allclose(updates.w, ref["w"], rtol=0, atol=1e-7)
        np.testing.assert_allclose(updates.v, ref["v"], rtol=0, atol=1e-7)


def test_a_label_tree_whose_call_comes_from_a_mixin_is_not_run_on_its_labels():
    """Before: only a ``__call__`` in the class body was wrapped, so optax ran the mixin's
    forward pass on the label strings (TypeError inside the user's ``x @ self.w``)."""

    class MixNet(_Mixin, ft.Module):
        w: jax.Array
        v: jax.Array

    class Sub(MixNet):
        pass

    for cls in (MixNet, Sub):
        model = _two(cls)
        _updates_match_optax_on_a_dict(model)
        x = jnp.ones((1, 3))
        np.testing.assert_allclose(model(x), jnp.tanh(x @ model.w) @ model.v, rtol=0, atol=1e-6)
    # the mixin's later patch is run, as Python runs it (the forwarder reads it at each call)
    _Mixin.__call__, old = (lambda self, x: x @ self.w), _Mixin.__call__
    try:
        np.testing.assert_allclose(model(x), x @ model.w, rtol=0, atol=1e-6)
    finally:
        _Mixin.__call__ = old


def test_a_module_can_also_be_an_abstract_base_class():
    """A metaclass seeing ``Net.__call__ = patched`` made ``class M(ft.Module, abc.ABC)`` a
    metaclass conflict: Modules keep ``type`` as their metaclass, and a call assigned later
    is made label-aware by hand (the module docstring)."""

    class Base(ft.Module, abc.ABC):
        w: jax.Array
        v: jax.Array

        @abc.abstractmethod
        def __call__(self, x): ...

    class Net(Base):
        def __call__(self, x):
            return jnp.tanh(x @ self.w) @ self.v

    with pytest.raises(TypeError, match="abstract"):
        Base(jnp.ones((3, 2)), jnp.ones((2, 1)))
    model, x = _two(Net), jnp.ones((1, 3))
    _updates_match_optax_on_a_dict(model)
    Net.__call__ = label_aware(lambda self, x: (x @ self.w) @ self.v)  # a later cell's call, by hand
    _updates_match_optax_on_a_dict(model)
    np.testing.assert_allclose(model(x), (x @ model.w) @ model.v, rtol=0, atol=1e-6)


def test_calling_an_abstract_template_names_the_leaf_and_the_fixes():
    # jax.eval_shape's template called: JAX said "unsupported operand type(s) for @:
    # 'ArrayImpl' and 'ShapeDtypeStruct'" from inside the first Dense.
    class Net(ft.Module):
        body: ft.nn.Sequential

        def __call__(self, x):
            return self.body(x)

    template = jax.eval_shape(lambda: Net(_net()))
    x = jnp.ones((3, 2))
    with pytest.raises(TypeError, match=r"Net called with abstract leaves: body.layers.0.weight is f32\[2,4\], a "
                                        r"jax.ShapeDtypeStruct(.|\n)*jax.eval_shape\(lambda m, x: m\(x\), template, x\)"):
        template(x)
    assert jax.eval_shape(lambda m, x: m(x), template, x).shape == (3, 1)   # the fix

    class Picky(ft.Module):
        w: jax.Array

        def __call__(self, x):
            raise TypeError("the user's own")

    with pytest.raises(TypeError, match="the user's own"):      # a model with values: its error as it was
        Picky(jnp.ones(2))(x)
