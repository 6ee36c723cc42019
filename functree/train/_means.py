"""The job's running means: the log window's and the epoch's, weighted by minibatch size,
and a counting metric's (accuracy) by its counted labels: Σ hits / Σ counted, from the
sums of its two parts (``_metrics.with_parts``), which every train step records beside it,
whoever built the step.

A :class:`Means` is a value: :meth:`Means.plus` returns a new one, so the job's record
(:class:`~functree.train._job.JobState`) holds its means as it holds its step count. The
sums are added step by step in float64, so they do not depend on where the intervals
were cut: a resumed job's means equal the uninterrupted job's bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from functree.train._metrics import (
    PART_COUNT,
    PART_RATIO,
    PART_SUM,
    InexactMeanWarning,
    combine_parts,
)

__all__ = ["Means", "Terms", "RESTORED_WITHOUT_PARTS"]

RESTORED_WITHOUT_PARTS = """\
The running mean of {name!r} was restored from a checkpoint that summed it without its parts \
(hits, counted labels): the functree that wrote it recorded them for counting metrics only, \
not for a value computed from one (100 * accuracy). Its mean over the steps of this epoch (and \
log window) stays weighted by minibatch size, Σ n_b·v_b / Σ n_b, as that functree computed it, \
not Σ hits / Σ counted, which the steps before the checkpoint cannot give; from the next epoch \
on it is Σ hits / Σ counted.

    wrong:  trainer.restore(path)                  # a checkpoint written mid-epoch by an older functree
    right:  trainer.restore(path, step=<a step at an epoch's end>)   # its running means are empty
       or:  finish the epoch with the functree that wrote it, then continue here"""

Terms = tuple[dict[str, list[float]], list[float], int]
"""``(n·v per name, n per step, steps skipped)`` of an interval's steps."""


@dataclasses.dataclass(frozen=True)
class Means:
    """Weighted means Σ n·v / Σ n over the steps applied. A step skipped under
    ``on_nan="skip"`` is left out and counted in ``skipped``; a non-finite value of an
    applied step (``on_nan="ignore"``) makes its mean NaN.

    Each name's mean is over the steps that recorded it: a metric added (or removed) when a
    job was restored from a checkpoint with these means begins (or ends) within them, and
    has its own Σ n in ``weights`` (an empty mapping while every name has ``weight``: no
    work per interval then). One weight for all gave the log window's mean of a metric
    added at a restore Σ over its 2 steps / Σ n over the window's 4.

    Example:
      >>> from functree.train._means import Means
      >>> import numpy as np
      >>> m = Means().plus(Means.terms({"loss": np.array([1.0, 4.0])}, np.array([1.0, 3.0])))
      >>> m.means(), Means.from_json(m.to_json()) == m
      ({'loss': 3.25}, True)
      >>> added = m.plus(Means.terms({"loss": np.array([1.0]), "mae": np.array([0.5])}, np.array([4.0])))
      >>> added.means(), added.weights   # "mae" over its step alone
      ({'loss': 2.125, 'mae': 0.5}, {'loss': 8.0, 'mae': 4.0})
    """

    sums: Mapping[str, float] = dataclasses.field(default_factory=dict)
    weight: float = 0.0
    skipped: int = 0
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @staticmethod
    def terms(values: Mapping[str, np.ndarray], weights: np.ndarray, applied: np.ndarray | None = None) -> Terms:
        """The :data:`Terms` of an interval's steps (computed once, added to the window's
        and the epoch's means); ``applied``: which steps count (None: all)."""
        skipped = 0
        if applied is not None and not applied.all():
            skipped = int(np.sum(~applied))
            values = {k: v[applied] for k, v in values.items()}
            weights = weights[applied]
        return {name: (column * weights).tolist() for name, column in values.items()}, weights.tolist(), skipped

    def plus(self, terms: Terms) -> Means:
        """These means with an interval's terms added, step by step in float64. (A plain
        loop, not ``sum()``: Python 3.12's ``sum()`` of floats compensates: another result.)

        A metric whose sum holds steps without its parts (an older functree's checkpoint,
        which recorded them for counting metrics only: ``100 * accuracy`` had none) keeps
        no parts in these means: its mean stays Σ n·v / Σ n over all of their steps, with
        an :class:`InexactMeanWarning` where the new steps counted labels. Parts of the
        new steps alone, divided (:func:`combine_parts`), gave the new steps' mean as the
        epoch's: 27.27 for a size-weighted 17.35 (per token: 19.15)."""
        products, weights, skipped = terms
        unparted = self._unparted(products)
        products = {k: v for k, v in products.items() if k == _whole(k) or _whole(k) not in unparted}
        sums = dict(self.sums)
        for name, column in products.items():
            total = sums.get(name, 0.0)
            for x in column:
                total += x
            sums[name] = total if math.isfinite(total) else math.nan
        weight = self.weight
        for w in weights:
            weight += w
        own = self.weights
        if own or (self.weight and products.keys() != self.sums.keys()):  # a metric added or removed
            own = self._own_weights(products, weights)
        return Means(sums, weight, self.skipped + skipped, own)

    def _own_weights(self, products: Mapping[str, list[float]], weights: list[float]) -> dict[str, float]:
        """Each name's Σ n with an interval's ``weights`` added to the names it records:
        a name new to these means starts at 0, one it does not record keeps its own."""
        own = {name: self.weights.get(name, self.weight) for name in self.sums}
        for name in products:
            total = own.get(name, 0.0)
            for w in weights:
                total += w
            own[name] = total
        return own

    def _unparted(self, products: Mapping[str, list[float]]) -> set[str]:
        """The names whose parts ``products`` brings while these sums hold steps of theirs
        without parts: their parts stay out (:meth:`plus`), with a warning where they
        count labels (a metric that turned out plain records parts of 0)."""
        names = {_whole(k) for k in products if k != _whole(k)}
        unparted = {n for n in names if self.weight and n in self.sums
                    and not (n + PART_SUM in self.sums and n + PART_COUNT in self.sums)}
        for name in sorted(unparted):
            if any(products.get(name + PART_COUNT, ())):
                warnings.warn(RESTORED_WITHOUT_PARTS.format(name=name), InexactMeanWarning, stacklevel=3)
        return unparted

    def means(self, on_nan: str | None = None) -> dict[str, float]:
        """The means (NaN where every step added was skipped), with ``skipped`` (the steps
        left out) under ``on_nan="skip"``. A counting metric's is Σ hits / Σ counted, its
        parts' sums' ratio (:func:`~functree.train._metrics.combine_parts`), not its
        minibatch values' size-weighted mean; a ``WeightedMean`` loss or metric that counted
        nothing here is NaN (:meth:`unscored`)."""
        own = self.weights
        values = {k: v / w if (w := own.get(k, self.weight)) else math.nan for k, v in self.sums.items()}
        values = combine_parts(values, self.sums if self.weight else values)
        for name in self.unscored():
            values[name] = math.nan
        if on_nan == "skip":
            values["skipped"] = self.skipped
        return values

    def no_label(self) -> bool:
        """Whether the loss is a ``ft.losses.WeightedMean`` (its mark, :data:`PART_RATIO`)
        whose count summed to 0 over these steps: nothing scored (every label -100), a mean
        of 0/0, where each step's loss is 0 (no gradient) and combine_parts would give
        those 0s as a perfect loss. A NaN total (a divergence) is not one."""
        return self._scored_nothing("loss")

    def unscored(self) -> list[str]:
        """The loss (:meth:`no_label`) and the metrics whose value is a ``ft.losses.WeightedMean``'s
        (a token-level metric: their mark, :data:`PART_RATIO`) that counted nothing over these
        steps: their means are 0/0, NaN, not their steps' 0s (a perfect-looking metric)."""
        return [name for name in (k[: -len(PART_RATIO)] for k in self.sums if k.endswith(PART_RATIO))
                if self._scored_nothing(name)]

    def _scored_nothing(self, name: str) -> bool:
        sums = self.sums
        return (sums.get(name + PART_RATIO, 0.0) > 0 and sums.get(name + PART_COUNT) == 0.0
                and sums.get(name + PART_SUM) == 0.0)

    def to_json(self) -> dict[str, Any]:
        """The means as JSON values (``weights`` only where a name has its own)."""
        state = {"sums": dict(self.sums), "weight": self.weight, "skipped": self.skipped}
        if self.weights:
            state["weights"] = dict(self.weights)
        return state

    FORM = ('a JSON object {"sums": {name: number}, "weight": a number >= 0, "skipped": an int >= 0, '
            'optionally "weights": {name of sums: a number >= 0}}')
    """What :meth:`from_json` reads (what :meth:`to_json` writes)."""

    @staticmethod
    def from_json(state: Any) -> Means:
        """The means :meth:`to_json` wrote, exactly (``None``: no means yet). Anything not
        of that form (:attr:`FORM`) is a ``ValueError``: nothing is converted."""
        if state is None:
            return Means()
        if not isinstance(state, Mapping) or not set(state) <= {"sums", "weight", "skipped", "weights"}:
            raise ValueError(f"means {repr(state)[:120]} are not {Means.FORM}")
        sums, weight, skipped = state.get("sums", {}), state.get("weight", 0.0), state.get("skipped", 0)
        own = state.get("weights", {})
        if not (isinstance(sums, Mapping) and all(isinstance(k, str) and _number(v) for k, v in sums.items())
                and _number(weight) and weight >= 0 and type(skipped) is int and skipped >= 0
                and isinstance(own, Mapping) and set(own) <= set(sums)
                and all(_number(v) and v >= 0 for v in own.values())):
            raise ValueError(f"means {repr(state)[:120]} are not {Means.FORM}")
        return Means({str(k): v for k, v in sums.items()}, weight, skipped, {str(k): v for k, v in own.items()})


    def names(self) -> set[str]:
        """The metrics these means hold (a counting metric's parts under its name)."""
        return {_whole(k) for k in self.sums}

    def inexact(self, names: Any) -> list[str]:
        """The counting metrics among ``names`` whose mean these sums hold without its
        parts (written before they were recorded): their size-weighted mean, which no
        sum can turn into Σ hits / Σ counted (an empty mean has nothing to misread)."""
        return [n for n in names if self.weight and n in self.sums
                and not (n + PART_SUM in self.sums and n + PART_COUNT in self.sums)]


def _whole(name: str) -> str:
    """The metric a part's name belongs to (``"pct#sum"`` -> ``"pct"``); a metric's own name."""
    for suffix in (PART_SUM, PART_COUNT, PART_RATIO):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _number(value: Any) -> bool:
    """An int or float, not a bool (a NaN sum is a mean under ``on_nan="ignore"``)."""
    return type(value) in (int, float)
