"""The job's running means (functree/train/_means.py): values, summed step by step."""

from __future__ import annotations

import math

import numpy as np

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
