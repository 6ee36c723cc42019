"""The job's running means (functree/train/_means.py): values, summed step by step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from functree.train._means import Means


def test_means_do_not_depend_on_where_the_intervals_were_cut():
    rng = np.random.default_rng(0)
    values = rng.normal(size=20).astype(np.float32) * 1e3
    weights = rng.integers(1, 9, size=20).astype(np.float32)
    whole = Means().plus(Means.terms({"loss": values}, weights))
    cut = Means()
    for a, b in ((0, 3), (3, 4), (4, 13), (13, 20)):
        cut = cut.plus(Means.terms({"loss": values[a:b]}, weights[a:b]))
    assert cut == whole  # bit for bit: float64 sums added in the same order
    assert whole.means()["loss"] == sum(float(v * w) for v, w in zip(values, weights)) / float(weights.sum())


def test_skipped_steps_are_left_out_and_counted():
    terms = Means.terms({"loss": np.array([1.0, np.nan, 3.0], np.float32)}, np.ones(3, np.float32),
                        applied=np.array([True, False, True]))
    m = Means().plus(terms)
    assert m.means("skip") == {"loss": 2.0, "skipped": 1} and m.means() == {"loss": 2.0}
    assert math.isnan(Means().plus(Means.terms({"loss": np.array([np.nan], np.float32)}, np.ones(1, np.float32)))
                      .means()["loss"])  # on_nan="ignore": a non-finite applied step makes the mean NaN
    assert math.isnan(Means({"loss": 0.0}).means()["loss"])  # no weight: NaN, not a ZeroDivisionError


def test_means_are_values_and_round_trip_through_json():
    first = Means()
    second = first.plus(Means.terms({"a": np.array([2.0], np.float32)}, np.array([3.0], np.float32)))
    assert first == Means() and second.sums == {"a": 6.0} and second.weight == 3.0
    assert Means.from_json(second.to_json()) == second and Means.from_json(None) == Means()


def _steps(sizes, seed=0):
    """Per step of a token-accuracy epoch: its size n, hits, counted labels (labels of -100
    left out) and an example mean x0, from random predictions; every other step has
    few labels and many hits (the size-weighted mean is not the per-token one)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(sizes):
        labels = rng.integers(0, 5, size=(n, 4))
        labels[rng.random((n, 4)) < (0.8 if i % 2 else 0.1)] = -100
        pred = np.where(rng.random((n, 4)) < (0.6 if i % 2 else 0.1), labels, rng.integers(0, 5, size=(n, 4)))
        counted = labels != -100
        rows.append((n, float(np.sum((pred == labels) & counted)), float(np.sum(counted)), float(rng.normal())))
    return rows


def _terms(rows, old=False):
    """The steps' terms as a step records them: acc (a counting metric) and pct = 100 * acc
    with their parts per example, x0 a plain metric (parts of 0); ``old``: as functree
    31096b0 recorded them, parts for the counting metric only."""
    n, hits, counted, x0 = (np.array(c, np.float64) for c in zip(*rows))
    acc = hits / np.maximum(counted, 1)
    values = {"acc": acc, "acc#sum": hits / n, "acc#count": counted / n, "pct": 100 * acc, "x0": x0}
    if not old:
        values.update({"pct#sum": 100 * hits / n, "pct#count": counted / n, "x0#sum": 0 * n, "x0#count": 0 * n})
    return Means.terms(values, n)


def test_a_mean_restored_without_its_parts_keeps_its_size_weighted_mean_for_the_whole_epoch():
    """Before: resumed mid-epoch from a checkpoint of functree 31096b0 (no parts for
    pct = 100 * accuracy), the new steps' parts were divided alone: pct 27.27 for the epoch's
    size-weighted 17.35 (and per-token 19.15). The epoch keeps the size-weighted mean of
    every step, as 31096b0 gave it, with an InexactMeanWarning; never a mix."""
    import pytest

    from functree.train._metrics import InexactMeanWarning

    sizes = (16, 16, 16, 16, 16, 8)
    rows = _steps(sizes)
    n, hits, counted, x0 = (np.array(c, np.float64) for c in zip(*rows))
    weighted = float(np.sum(n * 100 * hits / np.maximum(counted, 1)) / np.sum(n))
    per_token = float(100 * hits.sum() / counted.sum())
    assert abs(weighted - per_token) > 1.0  # the data tells the two means apart
    restored = Means.from_json(Means().plus(_terms(rows[:3], old=True)).to_json())  # the old checkpoint's
    with pytest.warns(InexactMeanWarning, match=r"'pct' was restored from a checkpoint that summed it without"):
        m = restored.plus(_terms(rows[3:5]))
    with pytest.warns(InexactMeanWarning):  # saved and restored again: still without parts, still warned
        m = Means.from_json(m.to_json()).plus(_terms(rows[5:]))
    got = m.means()
    atol = 1e-13  # measured: 0 (numpy sums the same float64 terms); ~10 ulp of the values allowed
    np.testing.assert_allclose(got["pct"], weighted, rtol=0, atol=100 * atol)
    np.testing.assert_allclose(got["acc"], per_token / 100, rtol=0, atol=atol)  # its parts span every step
    np.testing.assert_allclose(got["x0"], np.sum(n * x0) / np.sum(n), rtol=0, atol=atol)
    assert not any(k.startswith(("pct#", "x0#")) for k in m.sums)
    whole = Means().plus(_terms(rows))  # an epoch of this functree: exact, no warning
    np.testing.assert_allclose(whole.means()["pct"], per_token, rtol=0, atol=100 * atol)


def test_a_metric_added_or_removed_within_the_means_has_the_mean_of_the_steps_that_recorded_it():
    """Before: one weight for every name; a metric added at a restore (its first steps
    inside a log window) was Σ over its steps / Σ n over the window's: 1.5 for 2.0 here."""
    loss, mae, n = np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 2.0]), np.array([1.0, 1.0, 3.0, 3.0])
    before = Means().plus(Means.terms({"loss": loss[:2]}, n[:2]))
    added = before.plus(Means.terms({"loss": loss[2:], "mae": mae}, n[2:]))
    assert added.means() == {"loss": 24.0 / 8.0, "mae": 2.0}
    assert before.weights == {}  # while every name has the whole weight: none of its own
    assert Means.from_json(added.to_json()) == added
    removed = added.plus(Means.terms({"loss": np.array([5.0])}, np.array([2.0])))
    assert removed.means() == {"loss": 34.0 / 10.0, "mae": 2.0} and removed.weights == {"loss": 10.0, "mae": 6.0}
    for bad in ({"other": 1.0}, {"mae": -1.0}, [6.0]):
        with pytest.raises(ValueError, match="are not a JSON object"):
            Means.from_json({**added.to_json(), "weights": bad})


def test_a_log_window_or_epoch_that_scored_no_label_logs_nan_with_a_warning_not_a_perfect_loss():
    """A WeightedMean loss whose every label in a log window is -100: each step's loss is 0
    (0/0 given as 0: no gradient), and the window's mean of those 0s was logged as a
    perfect 0.0. It is NaN with a NoLabelWarning naming the window (or the epoch); the
    steps are no divergence (on_nan="stop" runs on), a window with a label is
    Σ total / Σ count over its steps, and a plain loss of 0 (no count) stays 0."""
    import jax

    import functree as ft
    from functree.train._reader import NO_TRAINING_LABEL

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=16).astype(np.int32)
    y[0], y[4:] = -100, -100  # step 1 scores 3 labels, steps 2-4 none: the window of steps 3-4 nothing
    model = ft.nn.Dense(4, 3, key=jax.random.key(0))

    def loss_fn(m, b):
        return ft.losses.softmax_cross_entropy(m(b[0]), b[1], reduction="weighted")

    logits = np.asarray(model(x[1:4]), np.float64)
    first = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(3), y[1:4]])
    logs = []
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn)
    with pytest.warns(ft.train.NoLabelWarning) as caught:
        history = trainer.fit(ft.train.batches((x, y), 4, shuffle=False), epochs=1, log_every=2, progress=False,
                              callbacks=[lambda c: logs.append((c.event, c.step, c.metrics["loss"]))])
    assert [str(w.message) for w in caught] == [NO_TRAINING_LABEL.format(what="log window ending at step 4")]
    assert caught[0].filename == __file__  # the user's fit line
    assert history.steps["loss"][1:] == [0.0, 0.0, 0.0] and trainer.steps_run == 4  # no NonFiniteError
    (_, _, window), (_, _, empty), (_, _, epoch) = logs
    np.testing.assert_allclose([window, epoch], first, rtol=0, atol=2e-6)  # step 1's 3 labels: not halved by step 2
    assert logs[1][:2] == ("log", 4) and math.isnan(empty)
    with pytest.warns(ft.train.NoLabelWarning, match=r"^Training's epoch 2: "):
        history = trainer.fit(ft.train.batches((x[8:], y[8:]), 4, shuffle=False), epochs=2, log_every=8,
                              progress=False)
    assert math.isnan(history.epochs["loss"][1])

    def terms(ratio, total=0.0):
        return Means.terms({"loss": np.zeros(2), "loss#sum": np.array([total, 0.0]), "loss#count": np.zeros(2),
                            "loss#ratio": np.full(2, ratio)}, np.ones(2))

    plain, diverged = Means().plus(terms(0.0)), Means().plus(terms(1.0, np.nan))
    assert plain.means() == {"loss": 0.0} and not plain.no_label()  # a plain loss's parts are (0, 0): no count
    assert not diverged.no_label() and math.isnan(diverged.means()["loss"])  # a NaN total: a divergence's NaN


def test_a_weighted_mean_metric_that_scored_no_label_logs_nan_with_a_warning_naming_it(tmp_path):
    """A metric returning a ft.losses.WeightedMean (a token-level cross-entropy) whose every
    label in a log window is -100: each step's value is 0 (0/0 given as 0), and the window's,
    the epoch's, the history's and the CSV's mean of those 0s was a perfect 0.0. Each is NaN
    with a NoLabelWarning naming the metric and the window; a window with labels is
    Σ total / Σ count over its steps, and an accuracy that counted nothing stays 0."""
    import csv

    import jax
    import jax.numpy as jnp

    import functree as ft
    from functree.train._evaluation import NO_METRIC_LABEL

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=16).astype(np.int32)
    y[0], y[4:] = -100, -100  # step 1 scores 3 labels, steps 2-4 none: the window of steps 3-4 nothing
    model = ft.nn.Dense(4, 3, key=jax.random.key(0))

    def loss_fn(m, b):
        out = m(b[0])
        return jnp.mean(out ** 2), out

    def tok(out):
        return ft.losses.softmax_cross_entropy(out.aux, out.batch[1], reduction="weighted")

    logits = np.asarray(model(x[1:4]), np.float64)
    first = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(3), y[1:4]])
    logs = []
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics={"tok": tok, "acc": ft.train.accuracy})
    with pytest.warns(ft.train.NoLabelWarning) as caught:
        history = trainer.fit(ft.train.batches((x, y), 4, shuffle=False), epochs=1, log_every=2, progress=False,
                              callbacks=[lambda c: logs.append((c.event, c.step, c.metrics["tok"]))])
    assert [str(w.message) for w in caught] == [
        NO_METRIC_LABEL.format(what="Training's log window ending at step 4", name="tok")]
    assert caught[0].filename == __file__  # the user's fit line
    (_, _, window), (_, _, empty), (_, _, epoch) = logs
    np.testing.assert_allclose([window, epoch], first, rtol=0, atol=2e-6)  # step 1's 3 labels alone
    assert logs[1][:2] == ("log", 4) and math.isnan(empty) and not math.isnan(history.epochs["loss"][0])
    path = tmp_path / "epochs.csv"
    with pytest.warns(ft.train.NoLabelWarning, match=r"^Training's epoch 2: the metric 'tok' "):
        history = trainer.fit(ft.train.batches((x[8:], y[8:]), 4, shuffle=False), epochs=2, log_every=8,
                              progress=False, callbacks=[ft.train.CSVLogger(path)])
    assert math.isnan(history.epochs["tok"][1]) and history.epochs["acc"][1] == 0.0  # a ratio over nothing: 0
    with open(path) as f:
        assert math.isnan(float(list(csv.DictReader(f))[-1]["tok"]))

    def terms(mark):
        return Means.terms({"tok": np.zeros(2), "tok#sum": np.zeros(2), "tok#count": np.zeros(2),
                            "tok#ratio": np.full(2, mark)}, np.ones(2))

    assert Means().plus(terms(0.0)).means() == {"tok": 0.0}  # a plain metric's parts are (0, 0): no count
    assert math.isnan(Means().plus(terms(1.0)).means()["tok"])
