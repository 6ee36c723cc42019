"""Metrics: accuracy in its label forms, aux means, and their errors."""

import jax.numpy as jnp
import pytest

import functree as ft
from functree.train import StepOutput
from functree.train._metrics import evaluate_metrics, resolve_metrics

LOGITS = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])


def out(aux, batch):
    return StepOutput(jnp.zeros(()), aux, batch, None)


def test_accuracy_label_forms():
    ints = jnp.array([0, 1, 1, 0])
    assert float(ft.train.accuracy(out(LOGITS, (None, ints)))) == 0.75
    onehot = jnp.eye(3)[ints]
    assert float(ft.train.accuracy(out({"logits": LOGITS}, {"label": onehot}))) == 0.75
    binary = jnp.array([1.0, 0.0, 1.0])
    assert float(ft.train.accuracy.of(jnp.array([[2.0], [-1.0], [-0.5]]), binary)) == pytest.approx(2 / 3)


def test_accuracy_errors_say_what_to_return():
    with pytest.raises(ValueError, match=r"return ft.losses.softmax_cross_entropy\(logits, y\), logits"):
        ft.train.accuracy(out(None, (None, jnp.zeros(4))))
    with pytest.raises(ValueError, match=r"could not find the labels"):
        ft.train.accuracy(out(LOGITS, {"image": jnp.zeros(4)}))
    with pytest.raises(ValueError, match=r"shape \(4, 3\) do not fit labels of shape \(5,\)"):
        ft.train.accuracy(out(LOGITS, (None, jnp.zeros(5, jnp.int32))))


def test_mean_and_resolution():
    fns = resolve_metrics(["mse", ft.train.accuracy])
    assert list(fns) == ["mse", "accuracy"]
    values = evaluate_metrics(fns, out({"mse": jnp.array([1.0, 2.0]), "logits": LOGITS},
                                       (None, jnp.array([0, 1, 2, 0]))))
    assert {k: float(v) for k, v in values.items()} == {"loss": 0.0, "mse": 1.5, "accuracy": 1.0}
    doubled = ft.train.mean(lambda o: 2 * o.loss)
    assert float(doubled(out(None, None))) == 0.0


def test_metric_errors():
    with pytest.raises(TypeError, match=r'right:  metrics=\{"accuracy": ft.train.accuracy'):
        resolve_metrics({"accuracy": 0.5})
    with pytest.raises(ValueError, match=r"reads aux\['mse'\]"):
        ft.train.mean("mse")(out(jnp.ones(2), None))
    with pytest.raises(ValueError, match=r"returned shape \(2,\)"):
        evaluate_metrics({"raw": lambda o: jnp.ones(2)}, out(None, None))
