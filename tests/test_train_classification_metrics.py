"""Precision, recall, F1 and top-k accuracy: exact over an epoch (scikit-learn's numbers over
the epoch's predictions, from a Trainer's uneven minibatches with ignored labels), their
label forms, zero division and errors."""

import itertools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sklearn.metrics as skm
from sklearn.exceptions import UndefinedMetricWarning

import functree as ft
from functree.train import _classification_metrics as cm
from functree.train._metrics import (
    BINARY_LABEL_SIGNS,
    BINARY_LABEL_VALUE,
    FLOAT_CLASS_IDS,
    KERAS_METRIC_NAME,
    KERAS_NOT_PROVIDED,
    ONE_HOT_ROW,
    StepOutput,
    resolve_metrics,
)
from tests._errors import raises_named

_N, _T, _C = 13, 4, 6
_SIZES = (5, 5, 3)  # uneven minibatches: the last one short


def _loss(table):
    """A loss whose aux is the ``table``'s rows for the minibatch's example indices (a
    learning rate of 0 keeps the model, so the metrics depend on the table alone)."""
    table = jnp.asarray(table)

    def loss_fn(model, batch):
        return jnp.mean(model["w"] * jnp.ones(batch[0].shape)), table[batch[0]]

    return loss_fn


def _data(labels):
    idx = np.arange(_N, dtype=np.int32)
    cuts = np.cumsum((0, *_SIZES))
    return [(idx[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]


def _fit(table, labels, metrics):
    """The epoch's metrics in the history and by evaluate, over the uneven minibatches."""
    t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _loss(table), metrics=metrics)
    data = _data(labels)
    t.fit(data, epochs=1, progress=False)
    return t, {k: v[0] for k, v in t.history.epochs.items()}, t.evaluate(data)


def _binary_data(seed=0):
    """Per-token binary logits ``[N, T]`` and 0/1 labels with -100 (more in the last minibatch)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(_N, _T)).astype(np.float32)
    labels = (rng.random((_N, _T)) < 0.4).astype(np.int32)
    labels[rng.random((_N, _T)) < 0.25] = -100
    labels[-2:, 1:] = -100
    return logits, labels


def _class_data(seed=1):
    """Per-token logits ``[N, T, C]`` and class ids with -100."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(_N, _T, _C)).astype(np.float32)
    labels = rng.integers(0, _C, size=(_N, _T)).astype(np.int32)
    labels[rng.random((_N, _T)) < 0.3] = -100
    return logits, labels


SKLEARN = {"precision": skm.precision_score, "recall": skm.recall_score, "f1": skm.f1_score}


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_binary_precision_recall_f1_over_an_epoch_are_sklearns(x64):
    logits, labels = _binary_data()
    kept = labels != -100
    y, pred = labels[kept], (logits[kept] > 0).astype(np.int32)
    # float32: the parts per example (hits / n) in float32, times n: measured 6e-8, x10 and up;
    # float64: the parts in float64, 1e-12 on values of magnitude 1
    atol = 1e-12 if x64 else 1e-6
    with jax.enable_x64(x64):
        _, epoch, evaluated = _fit(logits, labels, [ft.train.precision, ft.train.recall, ft.train.f1])
    for name, score in SKLEARN.items():
        want = score(y, pred)
        np.testing.assert_allclose(epoch[name], want, rtol=0, atol=atol, err_msg=name)
        np.testing.assert_allclose(evaluated[name], want, rtol=0, atol=atol, err_msg=name)


def test_the_mean_of_per_minibatch_precision_is_not_the_epochs():
    """The torch habit, per-minibatch precision averaged (``ft.train.mean``): another number
    than scikit-learn's over the epoch's predictions, which ``ft.train.precision`` gives."""
    logits, labels = _binary_data()
    kept = labels != -100
    want = skm.precision_score(labels[kept], (logits[kept] > 0).astype(np.int32))

    def per_batch(out):
        y, keep = out.batch[-1], out.batch[-1] != -100
        predicted = (out.aux > 0) & keep
        return jnp.sum(predicted & (y == 1)) / jnp.maximum(jnp.sum(predicted), 1)

    _, epoch, _ = _fit(logits, labels, {"mean_of_batches": ft.train.mean(per_batch), "precision": ft.train.precision})
    np.testing.assert_allclose(epoch["precision"], want, rtol=0, atol=1e-6)
    assert abs(epoch["mean_of_batches"] - want) > 0.01  # measured: 0.2212 for sklearn's 0.2353


@pytest.mark.parametrize("positive", [0, 3])
def test_one_class_of_several_over_an_epoch_is_sklearns(positive):
    logits, labels = _class_data()
    kept = labels != -100
    y, pred = labels[kept], logits[kept].argmax(-1)
    metrics = {name: (lambda fn: lambda out: fn.of(out.aux, out.batch[-1], positive=positive))(getattr(ft.train, name))
               for name in SKLEARN}
    _, epoch, evaluated = _fit(logits, labels, metrics)
    for name, score in SKLEARN.items():
        want = score(y, pred, labels=[positive], average="micro")  # class `positive` against the rest
        np.testing.assert_allclose(epoch[name], want, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(evaluated[name], want, rtol=0, atol=1e-6, err_msg=name)
    # one-hot labels (no ignored label: every row counts) give the class ids' numbers
    one_hot = np.eye(_C, dtype=np.float32)[np.where(kept, labels, 0)]
    for name, score in SKLEARN.items():
        got = getattr(ft.train, name).of(logits, one_hot, positive=positive)
        want = score(np.where(kept, labels, 0).ravel(), logits.argmax(-1).ravel(), labels=[positive], average="micro")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_top_k_accuracy_over_an_epoch_is_sklearns(x64):
    logits, labels = _class_data()
    kept = labels != -100
    want = skm.top_k_accuracy_score(labels[kept], logits[kept], k=3, labels=np.arange(_C))
    atol = 1e-12 if x64 else 1e-6
    with jax.enable_x64(x64):
        _, epoch, evaluated = _fit(logits, labels, [ft.train.top_k_accuracy(3)])
    np.testing.assert_allclose(epoch["top_3_accuracy"], want, rtol=0, atol=atol)
    np.testing.assert_allclose(evaluated["top_3_accuracy"], want, rtol=0, atol=atol)
    # the recipe it replaces (KERAS_METRICS' before): a size-weighted mean of per-minibatch
    # means that scores -100 as a miss
    old = lambda out: jnp.any(jax.lax.top_k(out.aux, 3)[1] == out.batch[-1][..., None], axis=-1)  # noqa: E731
    _, before, _ = _fit(logits, labels, {"old": ft.train.mean(old)})
    assert abs(before["old"] - want) > 0.1  # measured: 0.3654 for sklearn's 0.475


def test_top_k_accuracy_label_forms_and_ties():
    logits, labels = _class_data()
    rows, ids = logits.reshape(-1, _C), np.where(labels == -100, 0, labels).ravel()
    one_hot = np.eye(_C, dtype=np.float32)[ids]
    for k in (1, 2, 5):
        want = skm.top_k_accuracy_score(ids, rows, k=k, labels=np.arange(_C))
        np.testing.assert_allclose(ft.train.top_k_accuracy.of(rows, ids, k=k), want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ft.train.top_k_accuracy.of(rows, one_hot, k=k), want, rtol=0, atol=1e-6)
        out = StepOutput(jnp.zeros(()), {"logits": rows}, {"label": one_hot}, None)
        np.testing.assert_allclose(ft.train.top_k_accuracy(k)(out), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ft.train.top_k_accuracy.of(rows, ids, k=1), ft.train.accuracy.of(rows, ids), rtol=0, atol=0)
    # ties with the label's logit count for it (Keras's in_top_k); a NaN there never does
    tied = jnp.array([[1.0, 1.0, 1.0, 0.0], [jnp.nan, 0.0, 0.0, 0.0]])
    assert float(ft.train.top_k_accuracy.of(tied, jnp.array([2, 0]), k=1)) == 0.5
    # another ignore label, or none
    marked = np.where(labels == -100, 255, labels)
    np.testing.assert_allclose(ft.train.top_k_accuracy.of(logits, marked, k=2, ignore_index=255),
                               ft.train.top_k_accuracy.of(logits, labels, k=2), rtol=0, atol=0)
    assert float(ft.train.top_k_accuracy.of(logits, jnp.full((_N, _T), -100), k=2)) == 0.0  # nothing counted


def test_a_top_k_label_outside_the_classes_is_refused_and_nan_under_jit():
    """A class id outside [0, C) not ignore_index: sklearn's top_k_accuracy_score raises; the
    gather read -1 as the last class (a hit where it ranked in the top k: 0.5 here, not 0)."""
    logits = jnp.array([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="labels not in"):
        skm.top_k_accuracy_score([-1, -1], np.asarray(logits), k=2, labels=np.arange(4))
    raises_named(lambda: ft.train.top_k_accuracy.of(logits, jnp.array([-1, -1]), k=2), ValueError,
                 cm.TOP_K_LABEL_OUTSIDE, "right:  ft.train.top_k_accuracy.of(logits, labels, k=2, ignore_index=-1)")
    out = StepOutput(jnp.zeros(()), logits, (None, jnp.array([0, 4])), None)
    raises_named(lambda: ft.train.top_k_accuracy(2)(out), ValueError, cm.TOP_K_LABEL_OUTSIDE,
                 "label 4 at labels[1]")
    traced = jax.jit(lambda logits, labels: ft.train.top_k_accuracy.of(logits, labels, k=2))
    assert np.isnan(float(traced(logits, jnp.array([-1, -1]))))
    assert np.isnan(float(traced(logits, jnp.array([0, 4]))))
    assert float(traced(logits, jnp.array([-100, 3]))) == 1.0  # ignore_index still left out
    assert float(ft.train.top_k_accuracy.of(logits, jnp.array([-1, 3]), k=2, ignore_index=-1)) == 1.0  # the fix


BINARY_LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
BINARY = np.array([1, 0, 0, 1, 0], np.int32)
NO_BINARY = [  # (labels, constant, what the error names): read as label > 0.5 before, with no error
    (np.array([2, 0, 1, 2, 0], np.int32), BINARY_LABEL_VALUE, ("label 2 at labels[0]", "of(logits, labels == 2)")),  # 3 classes: 1.0
    (np.array([0.7, 0.2, 0.6, 0.9, 0.4], np.float32), BINARY_LABEL_VALUE, ("label 0.7 at labels[0]", "of(logits, labels > 0.5)")),
    (np.array([255, 0, 0, 255, 0], np.uint8), BINARY_LABEL_VALUE, ("label 255 at labels[0]", "of(logits, labels, ignore_index=255)")),
    (np.array([1, 0, -1, 1, 0], np.int32), BINARY_LABEL_SIGNS, ("0 (at labels[1]) and -1 (at labels[2])",
                                                                "of(logits, labels, ignore_index=0)")),
    (np.array([1.0, np.nan, 0.0, 1.0, 0.0], np.float32), BINARY_LABEL_VALUE, ("label nan at labels[1]", "of(logits, labels > 0.5)")),
    (np.array([1.0, 2.0, 0.0, 1.0, 0.0], np.float32), BINARY_LABEL_VALUE, ("label 2 at labels[1]", "of(logits, labels, ignore_index=2)")),
]


@pytest.mark.parametrize("name", list(SKLEARN))
def test_labels_that_are_no_binary_labels_are_refused_and_nan_under_jit(name):
    """Binary labels were read as ``label > 0.5``: 3-class labels [2, 0, 1, 2, 0] gave
    precision, recall and F1 1.0 (2 and 1 positive), soft labels were thresholded, a mask's
    255 counted positive, -1/0/1 labels read -1 and 0 alike. 0/1 (int, bool, float) and -1/1
    are binary; another scored label raises naming it and the fix, and is NaN under jit."""
    fn, want = getattr(ft.train, name), SKLEARN[name](BINARY, BINARY_LOGITS > 0)
    traced = jax.jit(lambda z, y: fn.of(z, y))
    signed = 2 * BINARY - 1
    assert SKLEARN[name](signed, np.where(BINARY_LOGITS > 0, 1, -1)) == want  # sklearn's pos_label=1 reads -1/1 alike
    padded = np.where(np.arange(5) < 3, BINARY, -100)  # -100 no binary label, but left out
    for labels in (BINARY, BINARY.astype(bool), BINARY.astype(np.float32), BINARY.astype(np.uint8), signed):
        np.testing.assert_allclose(fn.of(BINARY_LOGITS, labels), want, rtol=0, atol=1e-6, err_msg=str(labels))
        np.testing.assert_allclose(traced(BINARY_LOGITS, labels), want, rtol=0, atol=1e-6, err_msg=str(labels))
    np.testing.assert_allclose(traced(BINARY_LOGITS, padded), SKLEARN[name](BINARY[:3], BINARY_LOGITS[:3] > 0),
                               rtol=0, atol=1e-6)
    for labels, constant, (named, fix) in NO_BINARY:
        raises_named(lambda labels=labels: fn.of(BINARY_LOGITS, labels), ValueError, constant, named)
        raises_named(lambda labels=labels: fn.of(BINARY_LOGITS, labels), ValueError, constant, f"ft.train.{name}.{fix}")
        assert np.isnan(float(traced(BINARY_LOGITS, labels))), labels
    out = StepOutput(jnp.zeros(()), {"logits": BINARY_LOGITS}, {"labels": NO_BINARY[0][0]}, None)
    raises_named(lambda: fn(out), ValueError, BINARY_LABEL_VALUE,
                 f'metrics={{"{name}": lambda out: ft.train.{name}.of(out.aux["logits"], out.batch["labels"] == 2)}}')
    # the fixes run: one class against the others, -1/1 with 0 left out
    three = NO_BINARY[0][0]
    np.testing.assert_allclose(fn.of(BINARY_LOGITS, three == 2), SKLEARN[name](three == 2, BINARY_LOGITS > 0), rtol=0, atol=1e-6)
    signs = NO_BINARY[3][0]
    np.testing.assert_allclose(fn.of(BINARY_LOGITS, signs, ignore_index=0), want, rtol=0, atol=1e-6)


def test_a_trainer_shows_no_binary_labels_as_nan():
    """The jitted step cannot read its labels: 3-class labels give NaN precision, recall and F1
    for the epoch and evaluate (1.0 / 0.x before), where -1/1 labels give sklearn's numbers."""
    logits, labels = _binary_data()
    metrics = [ft.train.precision, ft.train.recall, ft.train.f1]
    _, epoch, evaluated = _fit(logits, np.where(labels == -100, -100, 2 * labels - 1), metrics)
    kept = labels != -100
    for name, score in SKLEARN.items():
        want = score(labels[kept], (logits[kept] > 0).astype(np.int32))
        np.testing.assert_allclose(epoch[name], want, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(evaluated[name], want, rtol=0, atol=1e-6, err_msg=name)
    three = labels.copy()
    three[0, 0] = 2  # one label of another class, in the first minibatch
    t, epoch, evaluated = _fit(logits, three, metrics)
    for name in SKLEARN:
        assert np.isnan(epoch[name]) and np.isnan(evaluated[name]), name
    assert np.isnan(t.history.steps["precision"][0]) and not np.isnan(t.history.steps["precision"][1])


def test_one_hot_rows_that_hold_no_class_are_refused_and_nan_under_jit():
    """One-hot labels were read by argmax alone: jax.nn.one_hot of a -100 (a row of 0s) counted
    as class 0 (top-1 accuracy 0.75, recall of class 0 2/3, where the class ids with -100 give
    1.0), int rows of class ids broadcast to the logits' shape too. Such a row raises where
    concrete, naming the fix (class ids, -100 left out), and is NaN under jit."""
    logits = jnp.array([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    ids = jnp.array([0, 1, -100, -100])
    padded = jax.nn.one_hot(ids, 3)  # the -100 rows are all 0
    fixed = jnp.where(padded.max(-1) > 0, padded.argmax(-1), -100)
    assert float(ft.train.top_k_accuracy.of(logits, ids, k=1)) == float(ft.train.recall.of(logits, ids, positive=0)) == 1.0
    raises_named(lambda: ft.train.top_k_accuracy.of(logits, padded, k=1), ValueError, ONE_HOT_ROW,
                 "right:  ft.train.top_k_accuracy.of(logits, jnp.where(labels.max(-1) > 0, labels.argmax(-1), -100), k=1)")
    raises_named(lambda: ft.train.recall.of(logits, padded, positive=0), ValueError, ONE_HOT_ROW,
                 "the row at labels[2] is [0., 0., 0.]")
    out = StepOutput(jnp.zeros(()), logits, {"label": padded}, None)
    raises_named(lambda: ft.train.top_k_accuracy(2)(out), ValueError, ONE_HOT_ROW,
                 "wrong:  metrics=[ft.train.top_k_accuracy(2)]")
    raises_named(lambda: ft.train.top_k_accuracy(2)(out), ValueError, ONE_HOT_ROW,
                 'jnp.where(out.batch["label"].max(-1) > 0, out.batch["label"].argmax(-1), -100), k=2)}')
    assert float(ft.train.top_k_accuracy.of(logits, fixed, k=1)) == float(ft.train.recall.of(logits, fixed, positive=0)) == 1.0
    top_k = jax.jit(lambda z, y: ft.train.top_k_accuracy.of(z, y, k=1))
    for fn in (ft.train.precision, ft.train.recall, ft.train.f1):
        assert np.isnan(float(jax.jit(lambda z, y, fn=fn: fn.of(z, y, positive=0))(logits, padded)))
    assert np.isnan(float(top_k(logits, padded)))
    assert float(top_k(logits, jax.nn.one_hot(jnp.array([0, 1, 0, 2]), 3))) == 1.0  # one-hot rows as before
    assert float(top_k(logits, jax.nn.softmax(logits))) == 1.0  # probabilities as before
    # a Trainer: one-hot labels with a row of 0s in its first minibatch
    one_hot = np.eye(_C, dtype=np.float32)[np.where(_class_data()[1] == -100, 0, _class_data()[1])]
    one_hot[1, 2] = 0.0
    t, epoch, evaluated = _fit(_class_data()[0], one_hot, [ft.train.top_k_accuracy(3)])
    assert np.isnan(epoch["top_3_accuracy"]) and np.isnan(evaluated["top_3_accuracy"])
    assert np.isnan(t.history.steps["top_3_accuracy"][0]) and not np.isnan(t.history.steps["top_3_accuracy"][1])


def test_labels_of_the_logits_shape_are_multi_label_micro_averages():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 5)).astype(np.float32)
    labels = (rng.random((8, 5)) < 0.5).astype(np.float32)
    pred = (logits > 0).astype(np.int32)
    for name, score in SKLEARN.items():
        want = score(labels.astype(np.int32), pred, average="micro")
        out = StepOutput(jnp.zeros(()), logits, (None, labels), None)
        np.testing.assert_allclose(getattr(ft.train, name)(out), want, rtol=0, atol=1e-6, err_msg=name)
    # [N, 1] logits with [N] labels, and probabilities at threshold 0.5 (Keras's Precision)
    column, y = logits[:, :1], labels[:, 0]
    np.testing.assert_allclose(ft.train.precision.of(column, y), skm.precision_score(y, column[:, 0] > 0), rtol=0, atol=1e-6)
    probs = 1 / (1 + np.exp(-column))
    np.testing.assert_allclose(ft.train.recall.of(probs, y, threshold=0.5), skm.recall_score(y, column[:, 0] > 0),
                               rtol=0, atol=1e-6)


def test_nothing_counted_reports_0_as_sklearns_zero_division_default():
    """Precision with no predicted positive (0/0): 0, scikit-learn's ``zero_division``
    default (it warns; a step cannot). Over an epoch a minibatch with nothing to count adds
    nothing: the epoch's ratio stays the other minibatches'."""
    logits, labels = _binary_data()
    negative = -np.abs(logits) - 1  # no logit above 0: nothing predicted positive
    with pytest.warns(UndefinedMetricWarning, match="Precision is ill-defined"):
        want = skm.precision_score(labels[labels != -100], np.zeros(np.sum(labels != -100), np.int32))
    assert want == 0.0
    _, epoch, evaluated = _fit(negative, labels, [ft.train.precision, ft.train.recall, ft.train.f1])
    assert epoch["precision"] == evaluated["precision"] == 0.0
    assert epoch["recall"] == 0.0 and epoch["f1"] == 0.0  # TP 0 over a positive count
    no_labels = np.full_like(labels, -100)
    _, epoch, _ = _fit(logits, no_labels, [ft.train.precision, ft.train.recall, ft.train.f1])
    assert {k: epoch[k] for k in ("precision", "recall", "f1")} == {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    # one minibatch (the first) with no predicted positive: the epoch is the others' ratio
    mixed = logits.copy()
    mixed[: _SIZES[0]] = negative[: _SIZES[0]]
    kept = labels != -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UndefinedMetricWarning)  # (the first minibatch alone would warn)
        want = skm.precision_score(labels[kept], (mixed[kept] > 0).astype(np.int32))
    _, epoch, _ = _fit(mixed, labels, [ft.train.precision])
    np.testing.assert_allclose(epoch["precision"], want, rtol=0, atol=1e-6)


def test_a_step_records_them_as_counting_metrics():
    from functree.train._metrics import counting_names, with_parts

    metrics = resolve_metrics([ft.train.precision, ft.train.recall, ft.train.f1, ft.train.top_k_accuracy(5)])
    assert list(metrics) == ["precision", "recall", "f1", "top_5_accuracy"]
    assert counting_names(metrics) == list(metrics)
    assert "top_5_accuracy#count" in with_parts(metrics)
    logits, labels = _binary_data()
    t, _, _ = _fit(logits, labels, [ft.train.precision])
    assert set(t.history.steps) == {"step", "loss", "precision", "learning_rate"}  # the parts stay inside


def test_errors_name_the_fix():
    logits, labels = _class_data()
    out = StepOutput(jnp.zeros(()), logits, (None, labels), None)
    raises_named(lambda: ft.train.precision(out), ValueError, cm.NEEDS_POSITIVE,
                 'metrics={"precision_5": lambda out: ft.train.precision.of(out.aux, out.batch[-1], positive=5)}')
    raises_named(lambda: ft.train.recall.of(logits, labels[:, :2]), ValueError, cm.BINARY_SHAPES,
                 "ft.train.recall.of(logits, class_ids, positive=2)")
    raises_named(lambda: ft.train.f1.of(logits[:, 0, 0], labels[:, 0], positive=1), ValueError, cm.CLASS_SHAPES,
                 "ft.train.f1.of(binary_logits, labels)")
    raises_named(lambda: ft.train.f1.of(logits, labels, positive=_C), ValueError, cm.BAD_POSITIVE,
                 "(0 <= positive < 6)")
    raises_named(lambda: ft.train.f1.of(logits, labels, positive=1.0), TypeError, cm.BAD_POSITIVE, "positive=1)")
    raises_named(lambda: ft.train.precision.of(logits, labels.astype(np.float32), positive=1), ValueError,
                 FLOAT_CLASS_IDS, "float_ids.astype(jnp.int32), positive=1)")
    raises_named(lambda: ft.train.precision.of(logits, labels, positive=1, threshold=0.5), TypeError, cm.BAD_OPTION,
                 "a class is predicted by argmax")
    raises_named(lambda: ft.train.precision.of(logits[..., 0], labels, threshold="0.5"), TypeError, cm.BAD_OPTION,
                 "threshold=0.5)")
    raises_named(lambda: ft.train.recall.of(logits[..., 0], labels, ignore_index=-100.0), TypeError, cm.BAD_OPTION,
                 "ignore_index=255)")
    given: Any = out  # the metric builder given as the metric: called with the step output
    raises_named(lambda: ft.train.top_k_accuracy(given), TypeError, cm.BAD_K, "metrics=[ft.train.top_k_accuracy(5)]")
    raises_named(lambda: ft.train.top_k_accuracy(0), TypeError, cm.BAD_K, "got 0")
    raises_named(lambda: ft.train.top_k_accuracy(_C)(out), ValueError, cm.K_NOT_BELOW_CLASSES,
                 "right:  ft.train.top_k_accuracy(5)")
    raises_named(lambda: ft.train.top_k_accuracy.of(logits[:, 0, 0], labels[:, 0]), ValueError, cm.TOP_K_SHAPES,
                 "binary logits (one per label) have no top k")


def test_keras_names_point_at_them_and_auc_at_a_recipe():
    """Keras's metrics=["precision"] reached MISSING_AUX_KEY without a Keras hint."""
    y = np.array([1, 0, 1, 1, 0, 0, 1, 0])
    logits = np.array([2.0, 1.0, -1.0, 0.5, -2.0, 0.3, 3.0, -0.1], np.float32)
    for key, name in (("precision", "precision"), ("recall", "recall"), ("f1_score", "f1")):
        right, _, _ = __import__("functree.train._metrics", fromlist=["KERAS_METRICS"]).KERAS_METRICS[key]
        raises_named(lambda key=key: resolve_metrics([key])[key](StepOutput(jnp.zeros(()), None, None, None)),
                     ValueError, KERAS_METRIC_NAME, f"right:  metrics=[ft.train.{name}]")
        (fn,) = resolve_metrics(eval(right, {"ft": ft})).values()
        np.testing.assert_allclose(fn(StepOutput(jnp.zeros(()), logits, (None, y), None)),
                                   SKLEARN[name](y, logits > 0), rtol=0, atol=1e-6)
    raises_named(lambda: resolve_metrics(["auc"])["auc"](StepOutput(jnp.zeros(()), None, None, None)), ValueError,
                 KERAS_NOT_PROVIDED, "right:  sklearn.metrics.roc_auc_score(y_val, np.ravel(trainer.predict(val_data)))")
    # the recipe runs: a Trainer's predictions of [N, 1] logits
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), lambda m, b: jnp.mean(m(b[0]) ** 2))
    val_data, y_val = ft.train.batches((x, y), 3), y
    got = skm.roc_auc_score(y_val, np.ravel(trainer.predict(val_data)))
    np.testing.assert_allclose(got, skm.roc_auc_score(y, np.asarray(model(jnp.asarray(x)))[:, 0]), rtol=0, atol=0)


def test_accuracy_and_precision_parts_are_divided_in_float64_under_x64():
    """Under x64 the parts (hits / n per example) were divided in float32 before the cast:
    the epoch's accuracy was 3.7e-10 and precision 3.8e-9 from the exact ratio; and under
    strict promotion accuracy of class ids raised TypePromotionError (argmax's int64 against
    the int32 labels)."""
    logits, labels = _class_data()
    kept = labels != -100
    with jax.enable_x64(True):
        _, epoch, _ = _fit(logits, labels, [ft.train.accuracy])
    np.testing.assert_allclose(epoch["accuracy"], np.mean(logits[kept].argmax(-1) == labels[kept]), rtol=0, atol=1e-12)


def test_int64_labels_past_2_32_are_no_class_under_x64():
    """Under x64 the metrics cast int64 labels to int32: ``2**32 + 1`` was class 1 (a hit for
    accuracy and top-k, no TOP_K_LABEL_OUTSIDE, a true positive for precision) and
    ``2**32 - 100`` was -100, left out. They compare in JAX's widest int: a miss, refused,
    or NaN traced."""
    logits = np.array([[0.0, 1.0], [0.0, 1.0]])
    with jax.enable_x64(True):
        past = np.array([1, 2**32 + 1], np.int64)
        for labels in (past, np.array([1, 2**32 - 100], np.int64)):
            assert float(ft.train.accuracy.of(logits, labels)) == 0.5, labels
            assert float(jax.jit(ft.train.accuracy.of)(logits, labels)) == 0.5, labels
        assert float(ft.train.precision.of(logits, past, positive=1)) == 0.5  # two predicted, one label 1
        raises_named(lambda: ft.train.top_k_accuracy.of(logits, past, k=1), ValueError, cm.TOP_K_LABEL_OUTSIDE,
                     "label 4294967297 at labels[1]")
        assert np.isnan(float(jax.jit(lambda z, y: ft.train.top_k_accuracy.of(z, y, k=1))(logits, past)))
        raises_named(lambda: ft.train.binary_accuracy.of(logits[:, 1], np.array([1, 2**32 - 100], np.int64)),
                     ValueError, BINARY_LABEL_VALUE, "label 4294967196 at labels[1]")


def test_keras_precision_recall_and_top_k_give_these_numbers():
    """What Keras's metrics=["precision", "recall", "top_k_categorical_accuracy"] users get:
    probabilities at Keras's 0.5 (threshold=0.5 here), multi-label elements counted, ties
    in the top k."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs another backend (KERAS_BACKEND)")
    rng = np.random.default_rng(4)
    probs = rng.uniform(size=(12, 5)).astype(np.float32)
    labels = (rng.random((12, 5)) < 0.4).astype(np.float32)
    for cls, ours in ((keras.metrics.Precision, ft.train.precision), (keras.metrics.Recall, ft.train.recall)):
        metric = cls()
        metric.update_state(labels, probs)
        np.testing.assert_allclose(ours.of(probs, labels, threshold=0.5), float(metric.result()), rtol=0, atol=1e-6)
    scores = np.round(rng.normal(size=(12, 5)), 0).astype(np.float32)  # rounded: ties at the k-th place
    ids = rng.integers(0, 5, 12)
    metric = keras.metrics.SparseTopKCategoricalAccuracy(k=2)
    metric.update_state(ids, scores)
    np.testing.assert_allclose(ft.train.top_k_accuracy.of(scores, ids, k=2), float(metric.result()), rtol=0, atol=1e-6)
