"""Every example of seeds 000, 001 and 002, written with functree.

Seed 000: hierarchical parameter iteration (KeyPathIterable), SGD/Adam over key paths, XOR.
Seed 001: parameter aggregates, Parameterized, heterogeneous types, groups, the enum case.
Seed 002: the Swift differentiable-programming proposal's examples.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft

# optax's bias correction computes `float ** int32`, which JAX's strict promotion (turned on
# by conftest.py) rejects; optax itself is run under standard promotion here.
standard_promotion = jax.numpy_dtype_promotion("standard")


# --------------------------------------------------------------------------- seed 000


class DenseLayer(ft.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable[[jax.Array], jax.Array] = ft.field(static=True, default=jax.nn.relu)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.activation(x @ self.weight + jax.lax.broadcast_to_rank(self.bias, x.ndim))


def dense() -> DenseLayer:
    return DenseLayer(weight=jnp.ones((2, 2)), bias=jnp.ones(1))


def test_dense_layer_all_key_paths_include_the_activation():
    layer = dense()
    paths = ft.all_key_paths(layer)
    assert [str(p) for p in paths] == [".weight", ".bias", ".activation"]
    values = [p.get(layer) for p in paths]
    np.testing.assert_array_equal(values[0], [[1.0, 1.0], [1.0, 1.0]])
    np.testing.assert_array_equal(values[1], [1.0])
    assert values[2] is jax.nn.relu


def test_dense_layer_writable_key_path_update_gives_0_95():
    parameters = dense()
    gradient = DenseLayer(weight=jnp.full((2, 2), 0.5), bias=jnp.full(1, 0.5))
    paths = ft.all_writable_key_paths(parameters, to=jax.Array)
    assert [str(p) for p in paths] == [".weight", ".bias"]
    for kp in paths:
        parameters = kp.set(parameters, kp.get(parameters) - 0.1 * kp.get(gradient))
    np.testing.assert_allclose(parameters.weight, np.full((2, 2), 0.95))
    np.testing.assert_allclose(parameters.bias, [0.95])
    assert parameters.activation is jax.nn.relu


class MyMLModel(ft.Module):
    layers: list[DenseLayer]
    final_weight: jax.Array
    is_training: bool = ft.field(static=True, default=True)


def test_nested_update_over_recursively_all_writable_key_paths_gives_0_9():
    layer = dense()
    model = MyMLModel(layers=[layer, layer], final_weight=jnp.ones((2, 2)))
    paths = ft.recursively_all_writable_key_paths(model, to=jax.Array)
    assert [str(p) for p in paths] == [
        ".layers[0].weight",
        ".layers[0].bias",
        ".layers[1].weight",
        ".layers[1].bias",
        ".final_weight",
    ]
    for kp in paths:
        model = kp.set(model, kp.get(model) - 0.1 * kp.get(model))
    for leaf in jax.tree.leaves(model):
        np.testing.assert_allclose(leaf, np.full(leaf.shape, 0.9), rtol=1e-6)
    # The two layers were one value: updating one copy did not touch the other.
    np.testing.assert_array_equal(layer.weight, np.ones((2, 2)))
    assert model.is_training is True
    # Static fields, and everything under them, are not writable.
    assert ".is_training" in [str(p) for p in ft.recursively_all_key_paths(model)]


class SGD:
    """Seed 000's SGD: iterate writable key paths of the parameter view."""

    learning_rate = 0.01

    def update(self, parameters: Any, gradient: Any) -> Any:
        for kp in ft.recursively_all_writable_key_paths(parameters, to=jnp.float32):
            parameters = kp.set(parameters, kp.get(parameters) - self.learning_rate * kp.get(gradient))
        return parameters


def test_full_fledged_sgd_over_the_parameter_view_gives_0_98():
    layer = DenseLayer(weight=jnp.ones((2, 2)), bias=jnp.ones(2))
    x = jnp.ones((2, 2))
    grad = ft.gradient(lambda d: d(x).sum(), at=layer)
    np.testing.assert_allclose(grad.weight, [[2.0, 2.0], [2.0, 2.0]])
    params = SGD().update(ft.parameters(layer), grad)
    layer = ft.with_parameters(layer, params)
    np.testing.assert_allclose(layer.weight, np.full((2, 2), 0.98))
    np.testing.assert_allclose(layer.bias, [0.98, 0.98])


class KeyPathAdam:
    """Seed 000's Adam: moments are trees shaped like the parameters, read by key path."""

    def __init__(self, params: Any, learning_rate: float = 1e-3):
        self.learning_rate, self.beta1, self.beta2, self.epsilon = learning_rate, 0.9, 0.999, 1e-8
        self.step = 0
        self.first = ft.zero_tangent_vector(params)
        self.second = ft.zero_tangent_vector(params)

    def update(self, model: Any, direction: Any) -> Any:
        self.step += 1
        b1, b2 = self.beta1, self.beta2
        step_size = self.learning_rate * (np.sqrt(1 - b2**self.step) / (1 - b1**self.step))
        for kp in ft.recursively_all_writable_key_paths(model, to=jnp.float32):
            d = kp.get(direction)
            self.first = kp.set(self.first, kp.get(self.first) * b1 + (1 - b1) * d)
            self.second = kp.set(self.second, kp.get(self.second) * b2 + (1 - b2) * d * d)
            new = kp.get(model) - step_size * kp.get(self.first) / (
                jnp.sqrt(kp.get(self.second)) + self.epsilon
            )
            model = kp.set(model, new.astype(jnp.float32))
        return model


def test_adam_with_auxiliary_variables_by_key_path_matches_optax():
    layer = DenseLayer(
        weight=jnp.array([[0.3, -0.2], [0.5, 0.1]]), bias=jnp.array([0.1, -0.1])
    )
    x = jnp.array([[1.0, 2.0], [-1.0, 0.5]])

    def loss(d: DenseLayer) -> jax.Array:
        return jnp.mean((d(x) - 1.0) ** 2)

    ours = KeyPathAdam(ft.parameters(layer), learning_rate=0.05)
    params = ft.parameters(layer)
    opt = optax.adam(0.05, eps=1e-8)
    with standard_promotion:
        state = opt.init(params)
        theirs = layer
        for _ in range(5):
            params = ours.update(params, ft.gradient(loss, at=ft.with_parameters(layer, params)))
            g = ft.gradient(loss, at=theirs)
            updates, state = opt.update(g, state, ft.parameters(theirs))
            theirs = ft.move(theirs, along=updates)
    # The same key paths address the parameters, the gradient and both moment trees.
    np.testing.assert_allclose(params.weight, theirs.weight, atol=1e-5)
    np.testing.assert_allclose(params.bias, theirs.bias, atol=1e-5)
    kp = ft.key_path(None, ".weight")
    assert kp.get(ours.first).shape == kp.get(state[0].mu).shape == (2, 2)


class MixedParameters(ft.Module):
    weight: jax.Array
    bias: jax.Array


def test_mixed_parameters_float32_and_float64_in_one_update_call():
    with jax.enable_x64(True):
        parameters = MixedParameters(weight=jnp.ones((2, 2), jnp.float32), bias=jnp.ones((), jnp.float64))
        gradient = MixedParameters(
            weight=jnp.full((2, 2), 0.5, jnp.float32), bias=jnp.asarray(0.5, jnp.float64)
        )
        parameters = ft.update(parameters, with_gradients=gradient, updater=lambda p, g: p - 0.01 * g)
        assert parameters.weight.dtype == jnp.float32
        assert parameters.bias.dtype == jnp.float64
        np.testing.assert_allclose(parameters.weight, np.full((2, 2), 0.995))
        np.testing.assert_allclose(parameters.bias, 0.995)


class Dense(ft.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable[[jax.Array], jax.Array] = ft.field(static=True, default=jax.nn.relu)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.activation(x @ self.weight + jax.lax.broadcast_to_rank(self.bias, x.ndim))


class Classifier(ft.Module):
    """Seed 000's XOR classifier: relu on both layers, as in the seed."""

    l1: ft.nn.Dense
    l2: ft.nn.Dense

    def __init__(self, hidden_size: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.l1 = ft.nn.Dense(2, hidden_size, jax.nn.relu, key=k1)
        self.l2 = ft.nn.Dense(hidden_size, 1, jax.nn.relu, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.l1(x))


XOR_X = jnp.array([[0, 0], [0, 1], [1, 0], [1, 1]], jnp.float32)
XOR_Y = jnp.array([[0], [1], [1], [0]], jnp.float32)


def test_xor_classifier_trains_with_adam_for_3000_jitted_steps():
    # With relu on the output layer (the seed's architecture) training depends on the
    # initialisation: a dead output unit never recovers. Keys 4, 7 and 8 of 0..9 train;
    # key 4 is used here.
    classifier = Classifier(hidden_size=4, key=jax.random.key(4))
    optimizer = optax.adam(0.02)

    def loss(model: Classifier) -> jax.Array:
        return jnp.mean((model(XOR_X) - XOR_Y) ** 2)

    @ft.jit(donate=(0, 1))
    def step(model: Classifier, state: Any) -> tuple[Classifier, Any]:
        grads = ft.gradient(loss, at=model)
        updates, state = optimizer.update(grads, state, ft.parameters(model))
        return ft.move(model, along=updates), state

    with standard_promotion:
        state = optimizer.init(ft.parameters(classifier))
        for _ in range(3000):
            classifier, state = step(classifier, state)
    prediction = classifier(XOR_X)
    np.testing.assert_allclose(prediction, XOR_Y, atol=0.1)
    assert step._cache_size() == 1


# --------------------------------------------------------------------------- seed 001


class Parameters(ft.Module):
    w: jax.Array
    b: jax.Array


def test_parameter_aggregate_update_with_gradients_gives_0_95():
    parameters = Parameters(w=jnp.ones((2, 2)), b=jnp.ones(()))
    gradients = Parameters(w=jnp.full((2, 2), 0.5), b=jnp.asarray(0.5))
    parameters = ft.update(parameters, with_gradients=gradients, updater=lambda p, g: p - 0.1 * g)
    np.testing.assert_allclose(parameters.w, np.full((2, 2), 0.95))
    np.testing.assert_allclose(parameters.b, 0.95)


class MNISTParameters(ft.Module):
    w1: jax.Array
    w2: jax.Array
    b1: jax.Array
    b2: jax.Array

    def __init__(self, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.uniform(k1, (784, 30))
        self.w2 = jax.random.uniform(k2, (30, 10))
        self.b1 = jnp.zeros((1, 30))
        self.b2 = jnp.zeros((1, 10))


def inference(images: jax.Array, parameters: MNISTParameters) -> jax.Array:
    h1 = jax.nn.sigmoid(images @ parameters.w1 + parameters.b1)
    return jax.nn.sigmoid(h1 @ parameters.w2 + parameters.b2)


def test_differentiating_with_respect_to_a_parameter_struct():
    images = jax.random.uniform(jax.random.key(1), (8, 784))
    params = MNISTParameters(key=jax.random.key(0))
    d_inference = ft.gradient(lambda p, x: inference(x, p).sum())
    grads = jax.jit(d_inference)(params, images)
    assert isinstance(grads, MNISTParameters)
    expected = jax.grad(lambda p: inference(images, p).sum())(params)
    for kp in ft.recursively_all_writable_key_paths(params, to=jax.Array):
        np.testing.assert_allclose(kp.get(grads), kp.get(expected), rtol=1e-5, atol=1e-6)


class ParamDense(ft.Module):
    w: jax.Array
    b: jax.Array


class ParameterizedModel(ft.Module):
    """Seed 001's Parameterized model: a nested layer, a tensor, and non-parameters."""

    layer: ParamDense
    tensor: jax.Array
    use_bias: bool = ft.field(static=True, default=True)
    previous_weight: jax.Array = ft.field(no_derivative=True, default=None)


def test_parameterized_all_parameters_get_and_set():
    model = ParameterizedModel(
        layer=ParamDense(w=jnp.ones(2), b=jnp.zeros(2)),
        tensor=jnp.ones(3),
        previous_weight=jnp.full(2, 7.0),
    )
    params = ft.parameters(model)
    assert params.previous_weight is None
    assert params.use_bias is True
    assert sorted(ft.to_flat_dict(params)) == ["layer.b", "layer.w", "tensor"]
    gradients = jax.tree.map(jnp.ones_like, params)
    params = ft.update(params, with_gradients=gradients, updater=lambda p, g: p - 0.5 * g)
    model = ft.with_parameters(model, params)
    np.testing.assert_allclose(model.layer.w, [0.5, 0.5])
    np.testing.assert_allclose(model.tensor, [0.5, 0.5, 0.5])
    np.testing.assert_allclose(model.previous_weight, [7.0, 7.0])


class FloatBiasModel(ft.Module):
    """Seed 001's MyMLModel with ``bias1, bias2: Float``: Python floats are parameters."""

    weight1: jax.Array
    weight2: jax.Array
    bias1: float
    bias2: float

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(x @ self.weight1 + self.bias1)
        return jax.nn.sigmoid(h @ self.weight2 + self.bias2)


def test_python_float_parameters_are_differentiated_and_zipped_with_gradients():
    model = FloatBiasModel(jnp.ones((2, 3)) * 0.1, jnp.ones((3, 1)) * 0.1, 0.5, -0.5)
    x = jnp.array([[0.2, 0.4]])
    grads = ft.gradient(lambda m: m(x).sum(), at=model)
    expected = jax.grad(lambda b1, b2: model.replace(bias1=b1, bias2=b2)(x).sum(), argnums=(0, 1))(
        0.5, -0.5
    )
    np.testing.assert_allclose(grads.bias1, expected[0], rtol=1e-6)
    np.testing.assert_allclose(grads.bias2, expected[1], rtol=1e-6)
    # The #forZippedParameters macro: one closure for every (parameter, gradient) pair,
    # whatever each parameter's type.
    seen: list[tuple[Any, Any]] = []
    updated = ft.tree_map(lambda p, g: seen.append((type(p), g.shape)) or p - 0.1 * g, model, grads)
    assert len(seen) == 4
    np.testing.assert_allclose(updated.bias1, 0.5 - 0.1 * expected[0], rtol=1e-6)


def test_parameter_groups_by_name_with_different_learning_rates():
    class Net(ft.Module):
        base: ParamDense
        classifier: ParamDense

    net = Net(ParamDense(jnp.ones(2), jnp.ones(2)), ParamDense(jnp.ones(2), jnp.ones(2)))
    groups = ft.select(net, "classifier")
    labels = jax.tree.map(lambda chosen: "classifier" if chosen else "base", groups)
    optimizer = optax.multi_transform({"base": optax.sgd(1e-2), "classifier": optax.sgd(1e-3)}, labels)
    grads = jax.tree.map(jnp.ones_like, ft.parameters(net))
    with standard_promotion:
        updates, _ = optimizer.update(grads, optimizer.init(ft.parameters(net)), ft.parameters(net))
    net = ft.move(net, along=updates)
    np.testing.assert_allclose(net.base.w, [0.99, 0.99])
    np.testing.assert_allclose(net.classifier.w, [0.999, 0.999])


class ResNetModel(ft.Module):
    conv: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.conv


class RNNModel(ft.Module):
    cell: jax.Array
    hidden: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ self.cell + self.hidden)


class ToyParameters(ft.Module):
    """Seed 001's enum ``ResNetOrRNNParameters``: a field holding one of several modules."""

    resnet_or_rnn: ResNetModel | RNNModel

    def __init__(self, resnet: ResNetModel, rnn: RNNModel, use_resnet: bool):
        self.resnet_or_rnn = resnet if use_resnet else rnn

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.resnet_or_rnn(x)


@pytest.mark.parametrize("use_resnet", [True, False])
def test_a_field_holding_one_of_several_module_types(use_resnet: bool):
    resnet = ResNetModel(conv=jnp.full(2, 2.0))
    rnn = RNNModel(cell=jnp.eye(2), hidden=jnp.zeros(2))
    toy = ToyParameters(resnet, rnn, use_resnet=use_resnet)
    chosen = resnet if use_resnet else rnn
    names = sorted(ft.to_flat_dict(ft.parameters(toy)))
    assert names == sorted("resnet_or_rnn." + n for n in ft.to_flat_dict(chosen))
    x = jnp.array([0.5, -1.0])
    grads = ft.gradient(lambda m: m(x).sum(), at=toy)
    assert type(grads.resnet_or_rnn) is type(chosen)
    trained = jax.jit(lambda m: ft.move(m, along=ft.tangent_scale(grads, -0.1)))(toy)
    assert type(trained.resnet_or_rnn) is type(chosen)


def test_for_parameters_visits_every_parameter_once():
    model = Parameters(w=jnp.ones((2, 2)), b=jnp.ones(()))
    visited: list[tuple[int, ...]] = []
    ft.tree_map(lambda p: visited.append(p.shape), ft.parameters(model))
    assert sorted(visited) == [(), (2, 2)]


# --------------------------------------------------------------------------- seed 002


def test_gradient_of_sum_of_squares_is_6_at_3():
    def f(x: jax.Array) -> jax.Array:
        return (x * x).sum()

    dfdx = ft.gradient(f)
    np.testing.assert_allclose(dfdx(jnp.full(32, 3.0)), np.full(32, 6.0))


class Perceptron(ft.Module):
    weight: jax.Array
    bias: float = 0.0

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight * x).sum() + self.bias


AND_GATE = [
    (jnp.array([0.0, 0.0]), 0.0),
    (jnp.array([0.0, 1.0]), 0.0),
    (jnp.array([1.0, 0.0]), 0.0),
    (jnp.array([1.0, 1.0]), 1.0),
]


def test_perceptron_learns_the_and_gate():
    model = Perceptron(weight=jax.random.uniform(jax.random.key(0), (2,), minval=-1, maxval=1))

    def total_loss(model: Perceptron) -> jax.Array:
        loss = jnp.zeros(())
        for x, y in AND_GATE:
            error = y - model(x)
            loss = loss + error * error / 2
        return loss

    step = jax.jit(ft.value_with_gradient(total_loss))
    losses = []
    for _ in range(100):
        loss, grad = step(model)
        losses.append(float(loss))
        model = model.replace(
            weight=model.weight - grad.weight * 0.02, bias=model.bias - grad.bias * 0.02
        )
    assert losses[-1] < 0.5 * losses[0]
    assert all(b <= a + 1e-6 for a, b in itertools.pairwise(losses))
    # Trained longer, it reaches the least-squares fit: w = (0.5, 0.5), b = -0.25.
    for _ in range(3000):
        _, grad = step(model)
        model = ft.move(model, along=ft.tangent_scale(grad, -0.05))
    np.testing.assert_allclose(model.weight, [0.5, 0.5], atol=1e-3)
    np.testing.assert_allclose(model.bias, -0.25, atol=1e-3)


class PodcastCategory(enum.IntEnum):
    COMEDY = 0
    NEWS = 1
    SCIENCE = 2


class PodcastSection(enum.IntEnum):
    ADVERTISEMENT = 0
    INTRODUCTION = 1
    BODY = 2
    CONCLUSION = 3


class PodcastSpeedModel(ft.Module):
    min_speed: jax.Array
    max_speed: jax.Array
    category_multipliers: jax.Array
    section_multipliers: jax.Array

    def prediction(self, category: jax.Array, section: jax.Array) -> jax.Array:
        speed = self.category_multipliers[category] * self.section_multipliers[section]
        speed = jnp.where(speed < self.min_speed, self.min_speed, speed)
        return jnp.where(speed > self.max_speed, self.max_speed, speed)


def mean_error(model: PodcastSpeedModel, observations: dict[str, jax.Array]) -> jax.Array:
    predicted = model.prediction(observations["category"], observations["section"])
    return jnp.mean(jnp.abs(predicted - observations["user_speed"]))


def test_podcast_speed_model_learns_by_gradient_descent():
    true_category = jnp.array([1.0, 1.4, 1.2])
    true_section = jnp.array([2.0, 1.1, 1.0, 0.9])
    states = [(c, s) for c in PodcastCategory for s in PodcastSection]
    category = jnp.array([int(c) for c, _ in states], jnp.int32)
    section = jnp.array([int(s) for _, s in states], jnp.int32)
    observations = {
        "category": category,
        "section": section,
        "user_speed": jnp.clip(true_category[category] * true_section[section], 0.8, 2.5),
    }
    model = PodcastSpeedModel(
        min_speed=jnp.asarray(0.5),
        max_speed=jnp.asarray(3.0),
        category_multipliers=jnp.ones(len(PodcastCategory)),
        section_multipliers=jnp.ones(len(PodcastSection)),
    )
    # A single prediction with the enums themselves, as in the seed.
    assert model.prediction(PodcastCategory.NEWS, PodcastSection.BODY).shape == ()
    before = mean_error(model, observations)

    @jax.jit
    def step(model: PodcastSpeedModel) -> PodcastSpeedModel:
        model_gradient = ft.gradient(lambda m: mean_error(m, observations), at=model)
        learning_rate = 0.01
        return model.replace(
            min_speed=model.min_speed - learning_rate * model_gradient.min_speed,
            max_speed=model.max_speed - learning_rate * model_gradient.max_speed,
            category_multipliers=model.category_multipliers
            - learning_rate * model_gradient.category_multipliers,
            section_multipliers=model.section_multipliers
            - learning_rate * model_gradient.section_multipliers,
        )

    for _ in range(1000):
        model = step(model)
    after = mean_error(model, observations)
    assert float(after) < 0.25 * float(before)
    assert float(after) < 0.05


@ft.differentiable
def cubed(x: jax.Array) -> jax.Array:
    return x * x * x


def test_differentiable_cubed_and_perceptron_call():
    assert float(ft.gradient(cubed, at=2.0)) == pytest.approx(12.0)
    model = Perceptron(weight=jnp.ones(64), bias=1.0)
    grads = ft.gradient(lambda m: m(jnp.arange(64.0)), at=model)
    np.testing.assert_allclose(grads.weight, np.arange(64.0))
    assert float(grads.bias) == 1.0


def test_derivative_of_expf_registers_a_custom_pullback():
    calls = []

    @ft.derivative(of=jnp.exp)
    def exp(x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
        y = jnp.exp(x)
        calls.append("fwd")
        return y, lambda v: v * y

    np.testing.assert_allclose(exp(1.0), np.exp(1.0), rtol=1e-6)
    np.testing.assert_allclose(ft.gradient(lambda x: exp(x) * 2.0, at=1.0), 2 * np.exp(1.0), rtol=1e-6)
    assert "fwd" in calls


def test_add_one_converts_to_a_differentiable_function():
    def add_one(x: jax.Array) -> jax.Array:
        return x + 1

    f = ft.differentiable(add_one)
    assert float(f(1.0)) == 2.0
    assert float(ft.gradient(f, at=3.0)) == 1.0
    assert ft.differentiable(f) is f


def test_zero_derivative_example_returns_zero():
    def body(x: jax.Array) -> jax.Array:
        return jnp.sqrt(3.0)

    if hasattr(ft, "ZeroDerivativeWarning"):
        with pytest.warns(ft.ZeroDerivativeWarning):
            g = ft.gradient(body, at=1.0)
    else:
        g = ft.gradient(body, at=1.0)
    assert float(g) == 0.0
    # The fix the diagnostic suggests is silent:
    g = ft.gradient(lambda x: jnp.sqrt(ft.without_derivative(at=x) * 3.0), at=1.0)
    assert float(g) == 0.0


def test_gradient_training_loop_with_softmax_cross_entropy():
    classifier = ft.nn.Dense(4, 3, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 4))
    y = jnp.argmax(x[:, :3], axis=1)

    def loss_fn(classifier: ft.nn.Dense) -> jax.Array:
        prediction = classifier(x)
        return optax.softmax_cross_entropy_with_integer_labels(prediction, y).mean()

    step = jax.jit(ft.value_with_gradient(loss_fn))
    losses = []
    for _ in range(30):
        loss, model_gradient = step(classifier)
        losses.append(float(loss))
        classifier = ft.move(classifier, along=ft.tangent_scale(model_gradient, -0.5))
    assert losses[-1] < 0.7 * losses[0]


def test_value_with_gradient_of_foo_is_the_efficient_way():
    def foo(x: jax.Array) -> jax.Array:
        return jnp.tanh(jnp.tanh(jnp.exp(x)))

    x = 0.2
    y, dydx = ft.value_with_gradient(foo, at=x)
    np.testing.assert_allclose(y, foo(x), rtol=1e-6)
    np.testing.assert_allclose(dydx, ft.gradient(foo, at=x), rtol=1e-6)
    np.testing.assert_allclose(dydx, jax.grad(foo)(x), rtol=1e-6)


def test_value_with_pullback_is_the_general_form():
    def body(x: jax.Array) -> jax.Array:
        return jnp.stack([jnp.sin(x[0]) * x[1], x[0] ** 2])

    x = jnp.array([0.3, 2.0])
    value, pullback = ft.value_with_pullback(body, at=x)
    np.testing.assert_allclose(value, body(x))
    v = jnp.array([1.0, -2.0])
    np.testing.assert_allclose(pullback(v), jax.vjp(body, x)[1](v)[0], rtol=1e-6)


def test_zero_tangent_vector_initializer_for_a_counted_vector():
    class Vector(ft.Module):
        scalars: jax.Array

    v = Vector(jnp.arange(5.0))
    init = ft.zero_tangent_vector_initializer(v)
    zero = init()
    assert isinstance(zero, Vector)
    np.testing.assert_array_equal(zero.scalars, np.zeros(5))
    np.testing.assert_array_equal(ft.move(v, along=ft.zero_tangent_vector(v)).scalars, v.scalars)


def some_function(x: jax.Array) -> jax.Array:
    """R^2 -> R^4."""
    return jnp.stack([x[0] * x[1], jnp.sin(x[0]), x[1] ** 3, x[0] + 2 * x[1]])


def jacobian_from_pullbacks(f: Callable[..., Any], at: Any, basis_vectors: list[Any]) -> list[Any]:
    pb = ft.pullback(f, at=at)
    return [pb(v) for v in basis_vectors]


def jacobian_from_differentials(f: Callable[..., Any], at: Any, basis_vectors: list[Any]) -> list[Any]:
    df = ft.differential(f, at=at)
    return [df(v) for v in basis_vectors]


def test_jacobian_from_pullbacks_of_basis_vectors_matches_jacrev():
    x = jnp.array([1.0, 2.0])
    rows = jacobian_from_pullbacks(some_function, x, list(jnp.eye(4)))
    expected = jax.jacrev(some_function)(x)
    np.testing.assert_allclose(jnp.stack(rows), expected, rtol=1e-6)
    np.testing.assert_allclose(ft.jacobian(some_function, at=x), expected, rtol=1e-6)
    # pb([0, 0, 0, 1]) => [dy4/dx1, dy4/dx2]
    np.testing.assert_allclose(rows[3], [1.0, 2.0])


def test_jacobian_from_differentials_of_basis_vectors_matches_jacfwd():
    x = jnp.array([1.0, 2.0])
    columns = jacobian_from_differentials(some_function, x, list(jnp.eye(2)))
    expected = jax.jacfwd(some_function)(x)
    np.testing.assert_allclose(jnp.stack(columns, axis=1), expected, rtol=1e-6)
    np.testing.assert_allclose(ft.jacobian(some_function, at=x, mode="forward"), expected, rtol=1e-6)


def count_primitive(f: Callable[..., Any], x: Any, name: str) -> int:
    """How often primitive ``name`` appears in the jaxpr of ``f(x)``, nested jaxprs included."""
    return len(re.findall(rf"\b{name}\b", str(jax.make_jaxpr(f)(x))))


def test_discarding_checkpoints_recomputes_in_the_pullback():
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(jnp.sin(x)).sum()

    discarding = ft.with_recomputation_in_pullbacks(f)
    x = jnp.linspace(0.0, 1.0, 5)
    np.testing.assert_allclose(ft.gradient(discarding, at=x), jax.grad(f)(x), rtol=1e-6)
    plain = count_primitive(ft.gradient(f), x, "sin")
    recomputed = count_primitive(ft.gradient(discarding), x, "sin")
    assert plain == 2
    assert recomputed > plain


def test_derivative_with_respect_to_some_parameters():
    @ft.differentiable
    def foo(x: jax.Array, y: jax.Array, z: jax.Array) -> jax.Array:
        return x * y * z

    @ft.derivative(of=foo, wrt=(0, 2))
    def d_foo(x: jax.Array, y: jax.Array, z: jax.Array) -> Any:
        return foo.fn(x, y, z), lambda v: (v * y * z, v * x * y)

    dx, dz = ft.gradient(foo, wrt=(0, 2))(2.0, 3.0, 5.0)
    assert (float(dx), float(dz)) == (15.0, 6.0)


class TwoDense(ft.Module):
    """Seed 002's ``MyModel: Layer`` made of two Dense layers."""

    dense1: ft.nn.Dense
    dense2: ft.nn.Dense

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense2(self.dense1(x))


def test_layers_compose_into_a_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = TwoDense(ft.nn.Dense(3, 5, jax.nn.tanh, key=k1), ft.nn.Dense(5, 2, key=k2))
    x = jnp.ones((4, 3))
    assert model(x).shape == (4, 2)
    grads = ft.gradient(lambda m: m(x).sum(), at=model)
    assert [str(p) for p in ft.recursively_all_writable_key_paths(grads, to=jax.Array)] == [
        ".dense1.weight",
        ".dense1.bias",
        ".dense2.weight",
        ".dense2.bias",
    ]
