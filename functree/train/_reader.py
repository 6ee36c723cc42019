"""Reading the steps' metrics into the job: log intervals, means, stops and skips.

The steps write their metrics into a device buffer (:class:`MetricLog`, ``_intervals.py``).
:class:`Reader` closes it every ``log_every`` steps and reads the interval closed before
(one interval late: the read never waits for queued steps), or all of them at save
points, epoch ends and the end of ``fit``. Each interval read is committed into the
trainer's :class:`JobState`: its rows into the history, its stopped or skipped steps
checked (``on_nan``), its terms into the running means; then the progress bar and each
callback's ``on_log`` get its means.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from functree._jit import eval_shape
from functree._warnings import warn
from functree.train._callbacks import Callback, TrainingContext
from functree.train._dispatch import call_hooks
from functree.train._evaluation import NO_METRIC_LABEL, NoLabelWarning
from functree.train._intervals import MetricLog, Reading, snapshot, to_host
from functree.train._means import Means
from functree.train._metrics import part_names, step_names
from functree.train._nonfinite import NONFINITE, nonfinite_error, parameter_names, step_provenance
from functree.train._progress import Progress
from functree.train._step import TrainStep

__all__ = ["Reader", "reads_model", "warn_no_label", "NO_TRAINING_LABEL"]

NO_TRAINING_LABEL = """\
Training's {what}: the loss is a ft.losses.WeightedMean (reduction="weighted") whose count is 0 \
over every step: no position was scored (every label is ignore_index, -100: a collator that \
truncated each response away, or labels shifted off the end). Its mean is 0/0, logged as NaN \
(torch's mean over no label), not its steps' 0s, which would read as a perfect loss. Each of \
those steps took no gradient (its loss is 0): no divergence, which on_nan neither stops nor \
skips. Give data with labels to score:

    wrong:  labels = np.full_like(input_ids, -100)            # every position ignored
    right:  labels = np.where(response_mask, input_ids, -100)  # the response's tokens scored"""


def warn_no_label(means: Means, what: str) -> None:
    """:data:`NO_TRAINING_LABEL` (a :class:`NoLabelWarning`) where ``means`` (a log window's,
    an epoch's) scored no label: its loss is NaN (:meth:`Means.no_label`); and
    :data:`NO_METRIC_LABEL` for each ``WeightedMean`` metric that scored none (:meth:`Means.unscored`)."""
    for name in means.unscored():
        if name == "loss":
            warn(NO_TRAINING_LABEL.format(what=what), NoLabelWarning)
        else:
            warn(NO_METRIC_LABEL.format(what=f"Training's {what}", name=name), NoLabelWarning)

_NO_BAR = Progress(None, enabled=False)


def reads_model(cb: Callback) -> bool:
    """A callback whose ``on_log`` may read ``trainer.model`` (:attr:`Callback.reads_model`):
    the reader then reads each log interval as it ends. ``on_log = None`` (switched off:
    ``call_hooks`` skips it) overrides nothing."""
    if getattr(cb, "on_log", None) is None or type(cb).on_log is Callback.on_log:
        return False
    return bool(getattr(cb, "reads_model", True))


class Reader:
    """The trainer's metric buffer and its reads into ``trainer``'s job (a component of
    the Trainer: it reads and commits the trainer's state, the driver never reads the
    buffer itself)."""

    def __init__(self, trainer: Any) -> None:
        # Weakly: the trainer holds its reader, so a dropped trainer (its model, state and
        # buffer: device memory) is freed at once, not at the collector's next full pass.
        self._trainer = weakref.ref(trainer)
        self.log = MetricLog(NONFINITE)
        self.param_names: list[str] | None = None  # for the names of skipped steps' gradients

    @property
    def trainer(self) -> Any:
        return self._trainer()

    def metric_names(self, batch: Any) -> list[str]:
        """The step's metrics in the order it records them (the counting metrics' parts and
        ``nonfinite`` included)."""
        t = self.trainer
        cls = type(t.train_step)
        if cls.compute_metrics is TrainStep.compute_metrics and cls.step is TrainStep.step:
            return [*step_names(t.train_step.metrics), *([NONFINITE] if t.on_nan != "ignore" else [])]
        # An overridden compute_metrics or step() (which may add, drop or rename keys): trace
        # once (no compilation) to learn its names, in the dict's own order, which record()
        # writes the row in (eval_shape's result has its keys sorted: read from it, a column
        # got another metric's values).
        names: list[str] = []

        def metrics(*args: Any) -> Any:
            out = t.train_step.step(*args)[2]
            names.extend(out)
            return out

        eval_shape(metrics, t.model, t.opt_state, batch, t.key)
        return names

    def close(self, log: bool) -> None:
        """The open buffer's steps become a pending interval (the learning context
        snapshotted only for callbacks: without any, the dispatch passes the buffer alone)."""
        t = self.trainer
        t._guard.critical = True  # the steps move to the pending interval at once: a Ctrl-C waits
        self.log.close(t.steps_run, t.opt_state if t._callbacks else None, log)
        t._guard.critical = False
        t._guard.safe_point()

    def log_point(self, sync: bool, bar: Progress, cbs: Sequence[Callback]) -> None:
        """Every ``log_every`` steps: close the open interval and read the ones before it
        (one interval late: nothing waits), or all of them when a callback reads the model
        in ``on_log`` (``sync``: it then sees the model after ``context.step``)."""
        self.close(log=True)
        self.trainer._job = self.trainer._job.replace(since_log=0)
        keep = 0 if sync else 1
        while len(self.log.pending) > keep:
            self.read_interval(bar, cbs)

    def read_all(self, bar: Progress | None, cbs: Sequence[Callback] = ()) -> None:
        """Read every interval, the open buffer last (save points, epoch ends, fit ends)."""
        if self.log.buffered:
            self.close(log=False)
        while self.log.pending:
            self.read_interval(bar or _NO_BAR, cbs)

    def read_interval(self, bar: Progress, cbs: Sequence[Callback]) -> None:
        """The oldest pending interval into the job: its rows into the history, its
        stops and skips checked, its terms into the means; then the bar and ``on_log``."""
        t, log = self.trainer, self.log
        guard, on_nan = t._guard, t.on_nan
        r = log.read()
        # Under "stop", the rows before the stopped step are the applied ones: they go into
        # the history and the means, the stopped step and the gated steps after it do not
        # (a fit after the error continues from the step before it).
        keep = int(r.halt[1]) if on_nan == "stop" and int(r.halt[1]) >= 0 else len(r.steps)
        values = {k: v[:keep] for k, v in r.values.items()}
        parts = part_names(values)  # a counting metric's parts: into the means, not the history
        guard.critical = True  # the interval is read once: a Ctrl-C waits for the bookkeeping
        log.pending.pop(0)
        t._job.history.add_steps(r.steps[:keep], {**{k: v.tolist() for k, v in values.items() if k not in parts},
                                                  **_applied_rates(r, keep, on_nan)})
        log.last_context = None if log.pending or log.buffered else r.context  # the current one
        if keep:
            log.last_rates = {name: column[keep - 1] for name, column in r.rates.items()}
        terms = Means.terms(values, r.weights[:keep], r.nonfinite[:keep] == -1 if on_nan == "skip" else None)
        job = t._job
        t._job = job = job.replace(window=job.window.plus(terms), epoch_means=job.epoch_means.plus(terms))
        guard.critical = False
        skipped = self.check_finite(r)  # raises at a stopped step, its applied rows counted
        if skipped:
            t._job = job = job.replace(skipped=job.skipped + skipped)
        guard.safe_point()
        means = job.window.means(on_nan)
        shown = dict(means)
        if on_nan == "skip":
            shown["skipped"] = job.epoch_means.skipped  # the epoch's so far
        for name, column in r.rates.items():
            shown[name.replace("learning_rate", "lr")] = column[-1]
        bar.update(len(r.steps), shown)
        if r.log:
            warn_no_label(job.window, f"log window ending at step {r.first + len(r.steps) - 1}")
            t._job = job.replace(window=Means())
            if cbs:
                ctx = self.context("log", means, r.context, step=r.first + len(r.steps) - 1)
                call_hooks(t, cbs, "on_log", ctx)  # one that raises: the rest at the next fit

    def check_finite(self, r: Reading) -> tuple[tuple[int, str], ...]:
        """The steps of ``r`` skipped under ``on_nan="skip"`` (the first one's provenance
        kept as ``trainer.nan_report``); a stopped step (``"stop"``) rewinds the job to the
        step before it and raises :class:`NonFiniteError`."""
        t = self.trainer
        if t.on_nan == "skip":
            bad = np.flatnonzero(r.nonfinite != -1)
            if not len(bad):
                return ()
            if self.param_names is None:
                self.param_names = parameter_names(t.model, t.optimizer.wrt)
            if t.nan_report is None:  # the first skipped step's provenance
                after = int(np.sum(r.nonfinite[bad[0]:] == -1)) + self.log.applied_later()
                t.nan_report = step_provenance(t.train_step, r.steps[bad[0]], t.model, t.opt_state,
                                               r.inflight[bad[0]][0], t.key, applied_after=after)
            names = self.param_names
            return tuple((r.steps[i], "the loss" if r.nonfinite[i] < 0 else
                          f"the gradient of parameter {names[int(r.nonfinite[i])]!r}") for i in bad)
        stopped = int(r.halt[1])
        if stopped < 0:
            return ()
        step, job = r.steps[stopped], t._job
        t._job = job.replace(steps_run=step - 1, batch_in_epoch=job.batch_in_epoch - (job.steps_run - (step - 1)))
        self.log.drop()
        error = nonfinite_error(step, int(r.halt[2]), train_step=t.train_step, model=t.model,
                                opt_state=t.opt_state, batch=r.inflight[stopped][0], key=t.key,
                                holder="trainer.model and trainer.opt_state are",
                                history=", and trainer.history holds the values up to here")
        t.nan_report = error.report
        raise error

    def context(self, event: str, metrics: Mapping[str, float], arrays: Any = None,
                step: int | None = None) -> TrainingContext:
        """The :class:`TrainingContext` callbacks get: ``arrays`` (an interval's learning
        context and rates), else the current state's (read once until the next step) with
        the rates the last step read applied, its history row's: a rate a callback set
        since (a per-step schedule's ``on_log`` at an epoch's last step) is the next step's,
        and the epoch's row, the progress line and ``step/learning_rate`` name the same."""
        t, log = self.trainer, self.log
        if arrays is None and log.last_context is None:  # valid until the next step
            log.last_context = to_host(snapshot(t.opt_state))
        ctx, rates = arrays or log.last_context
        if arrays is None and log.last_rates is not None:
            rates = log.last_rates
        rates = {name: float(v) for name, v in rates.items()}
        return TrainingContext(event=event, step=t.steps_run if step is None else step, sweep=int(ctx.sweep),
                               samples_seen=int(ctx.samples_seen), minibatch_size=int(ctx.minibatch_size),
                               learning_rate=rates.get("learning_rate"), metrics=dict(metrics),
                               learning_rates=rates)


def _applied_rates(r: Reading, keep: int, on_nan: str) -> dict[str, list[float]]:
    """The learning-rate columns of ``r``'s first ``keep`` rows: each step's rate as
    ``ft.optim.hyperparameters`` reports it (a number in the unit it was given:
    ``per_samples(v, n)`` logs ``v`` while a minibatch of M applies ``v · M / n``; a
    schedule's value as applied), NaN at a step ``on_nan="skip"`` left out (it applied
    none; the optimizer state it leaves holds the rate of the applied step before it)."""
    rates = {name: column[:keep] for name, column in r.rates.items()}
    if on_nan != "skip" or not rates:
        return rates
    left_out = (r.nonfinite[:keep] != -1).tolist()
    if not any(left_out):
        return rates
    return {name: [math.nan if out else v for v, out in zip(column, left_out)] for name, column in rates.items()}
