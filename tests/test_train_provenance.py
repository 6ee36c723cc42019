"""functree.train._provenance: where a failed training step's loss turned non-finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train._provenance import provenance_for_step


def _data(classes=10, bad=None):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 6, 8)).astype(np.float32)
    y = rng.integers(0, classes, size=(4, 6))
    if bad is not None:
        y[2, 3] = bad
    return jnp.asarray(x), jnp.asarray(y)


def _loss_fn(model, batch):
    return ft.losses.softmax_cross_entropy(model(batch[0]), batch[1])


def test_a_label_outside_the_classes_under_fit_names_the_label_not_the_learning_rate():
    """The issue: a label equal to the class count (10 of 10), NaN under the jitted step, was
    reported as "Try a lower learning rate..." with provenance "`broadcast_in_dim` first
    produced nan ... inside jit(_where)". The loss run eagerly on that batch raises its own
    error, as torch's cross_entropy does for that label; the report shows it."""
    torch = pytest.importorskip("torch")
    x, y = _data(bad=10)
    with pytest.raises(IndexError, match="Target 10 is out of bounds"):  # torch refuses this batch too
        torch.nn.functional.cross_entropy(torch.zeros(24, 10), torch.tensor(np.asarray(y), dtype=torch.int64).reshape(-1))
    trainer = ft.train.Trainer(ft.nn.Dense(8, 10, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.sgd(1.0)),
                               _loss_fn)
    with pytest.raises(ft.train.NonFiniteError, match=r"(?s)step 1: the loss was not finite.*"
                       r"run eagerly on this step's batch \(outside jit\), _loss_fn raises the error below: "
                       r"the likely cause, not the learning rate.*ValueError: softmax_cross_entropy: label 10 "
                       r"at labels\[2, 3\] is not a class of logits f32\[4,6,10\]") as info:
        trainer.fit([(x, y)], epochs=1, progress=False)
    assert "label 10 at labels[2, 3]" in info.value.report.note
    # The headline's advice names the data, not the learning rate; the loss's error is chained.
    headline = str(info.value).split(":\n")[0]
    assert "Run eagerly on this step's batch, the loss raises ValueError: softmax_cross_entropy" in headline
    assert "Try a lower learning rate" not in headline
    assert isinstance(info.value.__cause__, ValueError) and "label 10" in str(info.value.__cause__)


def test_a_nan_without_an_eager_error_keeps_the_learning_rate_advice_and_no_cause():
    x, y = _data()
    x = x.at[0, 0, 0].set(jnp.inf)  # inf * 0 weights: the data's NaN, no error raised eagerly
    model = ft.nn.Dense(8, 10, key=jax.random.key(0))
    trainer = ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.sgd(1.0)), _loss_fn)
    with pytest.raises(ft.train.NonFiniteError, match="Try a lower learning rate") as info:
        trainer.fit([(x, y)], epochs=1, progress=False)
    assert info.value.__cause__ is None and info.value.report.cause is None


def test_a_finite_batch_or_a_nan_without_an_eager_error_keeps_the_equation_report():
    model = ft.nn.Dense(8, 10, key=jax.random.key(0))
    assert provenance_for_step(_loss_fn, model, _data()) is None  # finite: nothing to report
    x, y = _data()
    report = provenance_for_step(_loss_fn, model, (x.at[0, 0, 0].set(jnp.nan), y))  # a NaN input, no error
    assert report is not None and report.kind == "input" and "run eagerly" not in report.note
