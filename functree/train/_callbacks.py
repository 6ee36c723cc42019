"""Callbacks: CNTK's progress writers, called with the learning context.

A callback sees a :class:`TrainingContext` (step, sweep, samples seen, minibatch size,
learning rate, metrics) at every log interval (``on_log``), at the end of every epoch
(``on_epoch_end``, with epoch means and validation metrics) and at the end of training.
It may read and replace ``trainer.model`` / ``trainer.opt_state`` and set
``trainer.stop_training = True``. A plain function ``fn(context)`` is called at every log
interval and epoch end.

A callback's state (``state_dict()``/``load_state_dict()``: EarlyStopping's best value and
patience, ModelCheckpoint's last save, ...) is part of every checkpoint the Trainer writes;
``trainer.restore`` hands it back to the callbacks of the next ``fit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import json
import logging
import math
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from functree._files import local_path
from functree.optim import hyperparameters, set_hyperparameters
from functree.optim._average import AverageState, averages_in, is_average, keeps_average
from functree.optim._hyper import _entries, _keys, group_learning_rate, learning_rate_names
from functree.optim._lookahead import SlowState
from functree.train._built import Settings
from functree.train._direction import check_mode, direction, resolve_mode, trainer_metrics
from functree.train._job import JobState, own_copy
from functree.train.checkpoint._checkpoint import CheckpointManager, metadata_digest

__all__ = [
    "TrainingContext",
    "TrainerView",
    "Callback",
    "EarlyStopping",
    "ReduceLROnPlateau",
    "ModelCheckpoint",
    "HistoryLogger",
    "as_callback",
]

MISSING_MONITOR = """\
{who} monitors {monitor!r}, but the metrics at this point are {given}.
Validation metrics need validation data; metric names come from Trainer(metrics=...):

    wrong:  trainer.fit(data, callbacks=[{who}(monitor="val_loss")])
    right:  trainer.fit(data, validation_data=val, callbacks=[{who}(monitor="val_loss")])"""

ANOTHER_JOB = """\
{who}(monitor={monitor!r}) was given to the fit of a Trainer other than the one whose epochs \
it monitored (best {monitor} {best:.6g}, {wait} epoch(s) waited since): a callback made in an \
earlier notebook cell, with the cell making the Trainer run again. Its state is that job's, and \
this job would be measured against that job's best{effect}.

    wrong:  {name} = ft.train.{who}(...)  # a cell run once
            trainer = ft.train.Trainer(...)  # a cell run again
            trainer.fit(data, callbacks=[{name}])
    right:  trainer.fit(data, callbacks=[ft.train.{who}(...)])  # a new one for each Trainer
       or:  trainer.restore(path)  # the job its checkpoints hold: their {who} state is loaded"""

NO_LEARNING_RATE = """\
ReduceLROnPlateau sets the learning rate through ft.optim.set_hyperparameters, but this \
optimizer state has no settable learning rate ({error}).

    wrong:  Trainer(model, optax.adam(1e-3), loss_fn)
    right:  Trainer(model, ft.optim.Optimizer(ft.optim.adam(1e-3)), loss_fn)"""

SCHEDULED_LEARNING_RATE = """\
ReduceLROnPlateau lowers the learning rate when its monitor stalls, but {names} follows a \
schedule, which sets the rate at every step (a lowered value would be overwritten at the \
next one): the two cannot both set it. Give the optimizer a number for ReduceLROnPlateau to \
lower, or keep the schedule without ReduceLROnPlateau:

    wrong:  trainer = ft.train.Trainer(model, ft.optim.adam(ft.optim.cosine_decay(1e-3, 1000)), loss_fn)
            trainer.fit(data, callbacks=[ft.train.ReduceLROnPlateau(...)])
    right:  trainer = ft.train.Trainer(model, ft.optim.adam(1e-3), loss_fn)
            trainer.fit(data, callbacks=[ft.train.ReduceLROnPlateau(...)])
       or:  trainer.fit(data)      # the schedule alone, with the Trainer above"""

UNKNOWN_GROUP = """\
ReduceLROnPlateau(group={group!r}): the optimizer has no parameter group {group!r} with a \
learning rate; its learning rates are {names}.

    wrong:  ReduceLROnPlateau(group={group!r})
    right:  {right}"""

BAD_EVERY = """\
ModelCheckpoint({what}=...) takes a positive int (save after k, 2k, 3k, ...), got {value!r}.

    wrong:  ft.train.ModelCheckpoint(path, {what}={value!r})
    right:  ft.train.ModelCheckpoint(path, {what}=5)"""

BAD_CALLBACK_STATE = """\
{who}.load_state_dict got {given}, which is not a state this callback saved (keys {expected}).

    wrong:  {who}(...).load_state_dict(other_callback.state_dict())
    right:  callback.load_state_dict(callback_of_the_same_class.state_dict())"""

STEPS_AHEAD = """\
ModelCheckpoint: {directory} holds checkpoints past this trainer's step {step} ({ahead}), \
written by another run: a job restored at an older step, or a new job in a used directory. \
This run's checkpoints at those steps would not be written, and a later restore would \
continue the other run.
    right:  trainer.restore(directory)                      # continue the run that wrote them
       or:  ft.train.ModelCheckpoint(another_directory, ...)    # keep both runs
       or:  manager = ft.train.CheckpointManager(directory)    # this run replaces them:
            for step in {ahead}: manager.delete(step)
            trainer.fit(..., callbacks=[ft.train.ModelCheckpoint(manager, ...)])"""

BEST_METRIC_MISSING = """\
ModelCheckpoint ranks {directory} by best_metric={metric!r}, but the metrics at the end of \
epoch {epoch} (step {step}) are {given}: no checkpoint would ever be written there. \
Validation metrics (val_*) need validation data; metric names come from Trainer(metrics=...):

    wrong:  trainer.fit(data, callbacks=[ft.train.ModelCheckpoint(path, best_metric="val_loss")])
    right:  trainer.fit(data, validation_data=val, callbacks=[ft.train.ModelCheckpoint(path, best_metric="val_loss")])
       or:  ft.train.ModelCheckpoint(path, best_metric="loss")     # the epoch's mean training loss"""

NOTHING_RANKED = """\
ModelCheckpoint wrote no checkpoint to {directory}: a best_metric={metric!r} directory holds \
the checkpoints whose metric is known ({where}), and this fit reached none (it ended at step {step}).
    right:  trainer.fit(data, epochs=N, validation_data=val, callbacks=[...])   # to an epoch's end
       or:  ft.train.ModelCheckpoint(path, best_metric={metric!r}, every_steps=<one that divides the epoch's steps>)"""

_LOG = logging.getLogger("functree.train")

REPLAY_DIVERGED = """\
ModelCheckpoint: {directory} holds checkpoints past step {step} ({ahead}) of the run this \
job was restored from (their history began with this job's), but this run has gone another \
way since (other options or data after the restore): ranked with this run's, they would be \
taken for its best. The run stops here, its state saved up to the step before (fit again \
after either fix continues it):
    right:  ft.train.ModelCheckpoint(another_directory, best_metric=...)   # keep both runs
       or:  manager = ft.train.CheckpointManager(directory)    # this run replaces them:
            for step in {ahead}: manager.delete(step)"""

BAD_HOOK = """\
{who}.{hook} takes {given}; the Trainer calls it as {hook}({args}) (Keras's hooks take \
(epoch, logs): here the context holds both, context.sweep and context.metrics).

    wrong:  def {hook}(self, {wrong_args}): ...
    right:  def {hook}(self, {args}): ...
"""

UNKNOWN_HOOK = """\
{who}.{name} is no hook of ft.train.Callback: the Trainer never calls it, so the callback \
would do nothing there, silently. The hooks: on_train_begin(trainer), on_log(trainer, \
context), on_epoch_end(trainer, context), on_train_end(trainer, context).{why}

    wrong:  def {name}(self, ...): ...
    right:  def {right}(self, {args}): ...{note}

(A method of the callback's own, not a hook, is named without the on_ prefix.)"""

# Other libraries' hooks, by the hook that does their job here (Hugging Face's TrainerCallback,
# Keras's and PyTorch Lightning's callbacks): (functree's hook, a note on its right line).
_EVERY_STEP = "   # at each log interval: fit(..., log_every=1) for every step"
FOREIGN_HOOKS = {
    **dict.fromkeys(("on_step_end", "on_step_begin", "on_substep_end", "on_batch_end", "on_batch_begin",
                     "on_train_batch_end", "on_train_batch_begin", "on_optimizer_step"), ("on_log", _EVERY_STEP)),
    **dict.fromkeys(("on_evaluate", "on_validation_end", "on_validation_epoch_end", "on_train_epoch_end",
                     "on_test_end", "on_epoch_begin", "on_train_epoch_start", "on_epoch_start"),
                    ("on_epoch_end", "   # after the epoch's validation: context.metrics holds it")),
    **dict.fromkeys(("on_train_start", "on_fit_start", "on_init_end"), ("on_train_begin", "")),
    **dict.fromkeys(("on_fit_end",), ("on_train_end", "")),
    **dict.fromkeys(("on_save", "on_save_checkpoint"),
                    ("on_epoch_end", "   # the Trainer saves through fit(..., checkpoint=manager)")),
}

NOT_A_CALLBACK = """\
A callback is a ft.train.Callback or a function of the TrainingContext, got {given}.
    right:  callbacks=[ft.train.EarlyStopping(patience=3), lambda ctx: print(ctx.step)]"""


CONTEXT_NOT_LOGS = """\
{wrong} reads a callback's context as Keras's logs dict, but it is a ft.train.TrainingContext: \
the metrics are its dict context.metrics ({metrics}), the step, epoch and learning rate its \
attributes. A Callback's hooks are on_epoch_end(self, trainer, context): a Keras method's \
(epoch, logs) are the trainer and this context here.

    wrong:  {wrong}
    right:  {right}"""

_ATTRIBUTES = ("step", "epoch", "sweep", "samples_seen", "minibatch_size", "learning_rate", "event")


@dataclasses.dataclass(frozen=True)
class TrainingContext:
    """What callbacks see (host values, read at a log interval or an epoch end).

    Attributes:
      event: ``"log"``, ``"epoch"``, ``"end"``, or ``"step"`` (a checkpoint's save point).
      step: training steps run by the Trainer (all ``fit`` calls).
      sweep: the epochs completed (the learning context's sweep; also ``context.epoch``):
        1 at the first epoch's end, where Keras's 0-based ``on_epoch_end(epoch)`` passes 0.
      samples_seen: examples consumed by the optimizer steps taken.
      minibatch_size: the size of the latest minibatch.
      learning_rate: the learning rate step ``step`` applied, its history row's (None if
        the state has none, or has one per parameter group: see ``learning_rates``); a
        rate a callback set since (``ReduceLROnPlateau``, an ``on_log`` schedule) shows
        from the next step's. As ``ft.optim.hyperparameters``
        reports it: a number in the unit it was given (``per_samples(0.1, 10)``: 0.1, the
        rate per 10 samples, as CNTK prints "learning rate per 10 samples"; a step on a
        minibatch of M applies ``0.1 · M / 10``), a schedule's value as the step applied
        it (``per_samples(schedule, 10)``: ``schedule · M / 10``).
      metrics: means over the interval (``"log"``) or the epoch (``"epoch"``), with
        ``val_*`` validation metrics at epoch ends; at the end of ``fit`` (``"end"``) the
        last epoch's (with its ``val_*``, Keras's ``on_train_end`` logs), or where fit
        ended between epoch ends the means of the steps after the last one. Under ``on_nan="skip"`` the means
        are over the applied steps and ``skipped`` counts the steps left out.
      learning_rates: every learning rate by name: ``{"learning_rate": ...}``, or with
        ``ft.optim.groups`` one per group, ``{"<group>/learning_rate": ...}`` (the
        history's per-step columns of the same names).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), loss_fn)
      >>> seen = []  # a plain function is a callback too
      >>> _ = trainer.fit((jnp.eye(2), jnp.array([1.0, 2.0])), epochs=1, progress=False,
      ...                 callbacks=[seen.append])
      >>> c = seen[-1]  # the end of epoch 1: one step of 2 examples
      >>> c.event, c.step, c.sweep, c.samples_seen, round(c.learning_rate, 6), c.metrics
      ('epoch', 1, 1, 2, 0.1, {'loss': 2.5})
    """

    event: str
    step: int
    sweep: int
    samples_seen: int
    minibatch_size: int
    learning_rate: float | None
    metrics: dict[str, float]
    learning_rates: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def epoch(self) -> int:
        """``sweep`` under ``trainer.epoch``'s name: the epochs completed, so 1 at the first
        epoch's end. Not Keras's numbering: Keras's ``on_epoch_end(epoch, logs)`` passes the
        0-based index (0 at the first epoch's end), one less; a ported ``if epoch == 0:`` is
        ``if context.epoch == 1:`` here (``epoch + 1`` of Keras is ``context.epoch``)."""
        return self.sweep

    def __getitem__(self, name: Any) -> Any:
        """:data:`CONTEXT_NOT_LOGS`: Keras's ``logs["val_loss"]`` failed with Python's "object
        is not subscriptable", which named neither ``context.metrics`` nor the hooks' order."""
        right = f"context.{name}" if name in _ATTRIBUTES else f"context.metrics[{name!r}]"
        raise TypeError(self._not_logs(f"context[{name!r}]", right))

    def __getattr__(self, name: str) -> Any:
        """:data:`CONTEXT_NOT_LOGS` for a dict's methods (Keras's ``logs.get("val_loss")``);
        any other missing attribute is Python's error."""
        if name in ("get", "keys", "items", "values"):
            raise AttributeError(self._not_logs(f"context.{name}(...)", f"context.metrics.{name}(...)"))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _not_logs(self, wrong: str, right: str) -> str:
        metrics = ", ".join(map(repr, self.metrics)) or "none yet"
        return CONTEXT_NOT_LOGS.format(wrong=wrong, right=right, metrics=metrics)


class TrainerView(Protocol):
    """The :class:`Trainer` as callbacks see it: the job's state (:attr:`state`, a
    read-only :class:`JobState`, and its fields ``steps_run``, ``epoch``, ...) and what a
    callback may change: ``model``, ``opt_state``, ``stop_training``, ``extra`` (each
    assignment commits a new job state), and :meth:`save`. (A protocol: this module does
    not import the Trainer, which imports it.)

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Halve(ft.train.Callback):
      ...     def on_epoch_end(self, trainer: ft.train.TrainerView, context):
      ...         print(trainer.state.steps_run, trainer.state.epoch)
      ...         trainer.model = {"w": trainer.model["w"] / 2}  # a new job state
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), loss_fn)
      >>> _ = trainer.fit((jnp.eye(2), jnp.array([1.0, 2.0])), epochs=1, progress=False, callbacks=[Halve()])
      1 1
      >>> trainer.state.model["w"].tolist()
      [0.05000000074505806, 0.10000000149011612]
    """

    model: Any
    opt_state: Any
    stop_training: bool
    extra: Any

    @property
    def state(self) -> JobState: ...

    @property
    def steps_run(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    def save(self, manager: Any, *, metrics: Any = None, extra: Any = ...) -> None: ...


class Callback:
    """Base class: override any of the hooks (each does nothing by default).

    Hooks get the :class:`Trainer` (``trainer.model``, ``trainer.opt_state`` and
    ``trainer.stop_training`` may be set) and, but for ``on_train_begin``, the
    :class:`TrainingContext`. A hook set to None (``on_train_end = None`` in a subclass,
    switching off an inherited one) is not called.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class PrintLoss(ft.train.Callback):
      ...     def on_epoch_end(self, trainer, context):
      ...         print(context.event, context.step, round(context.metrics["loss"], 4))
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), loss_fn)
      >>> _ = trainer.fit((jnp.eye(2), jnp.array([1.0, 2.0])), epochs=2, progress=False,
      ...                 callbacks=[PrintLoss()])
      epoch 1 2.5
      epoch 2 2.025
    """

    name: str | None = None
    """Matches this callback to its saved state on resume (default: its class and its
    position among the callbacks of that class)."""

    reads_model: bool = True
    """Whether :meth:`on_log` reads ``trainer.model``/``trainer.opt_state``. When a callback
    that overrides ``on_log`` reads them, the Trainer reads each log interval as soon as
    it ends (waiting for its steps), so that the model is the one after ``context.step``;
    set ``reads_model = False`` on a callback that reads only the context to keep the
    faster read one interval late (``context`` is always right)."""

    def state_dict(self) -> dict[str, Any]:
        """What :meth:`load_state_dict` needs to continue where this callback stopped: a
        dict of arrays and plain values, saved in every checkpoint. Default: ``{}``.

        Example:
          >>> import functree as ft
          >>> stop = ft.train.EarlyStopping(monitor="loss", patience=2)
          >>> stop.state_dict()
          {'best': inf, 'wait': 0, 'stopped_epoch': None, 'best_epoch': None, 'best_model': None, 'best_average': None}
          >>> again = ft.train.EarlyStopping(monitor="loss", patience=2)
          >>> again.load_state_dict({**stop.state_dict(), "wait": 1})
          >>> again.state_dict()["wait"]
          1
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (called by the first ``fit`` after
        ``trainer.restore``)."""
        _check_state(self, state)

    def on_train_begin(self, trainer: TrainerView) -> None:
        """Before the first step of ``fit``."""

    def on_log(self, trainer: TrainerView, context: TrainingContext) -> None:
        """At every log interval."""

    def on_epoch_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        """At the end of every epoch (after validation)."""

    def on_train_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        """When ``fit`` ends (also when stopped early)."""


def _check_state(cb: Callback, state: Any) -> None:
    expected = sorted(cb.state_dict())
    if not isinstance(state, dict) or sorted(state) != expected:
        given = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(BAD_CALLBACK_STATE.format(who=type(cb).__name__, given=given, expected=expected))


class _FunctionCallback(Callback):
    reads_model = False  # a function of the context alone

    def __init__(self, fn: Callable[[TrainingContext], Any]):
        self.fn = fn

    def on_log(self, trainer: TrainerView, context: TrainingContext) -> None:
        self.fn(context)

    def on_epoch_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        self.fn(context)


_HOOKS = {"on_train_begin": "trainer", "on_log": "trainer, context", "on_epoch_end": "trainer, context",
          "on_train_end": "trainer, context"}


def as_callback(cb: Any) -> Callback:
    """A :class:`Callback` from itself or from a function of the context; a hook that
    cannot take the Trainer's arguments is :data:`BAD_HOOK` here, not at the first epoch's end."""
    if isinstance(cb, Callback):
        _check_hooks(cb)
        return cb
    if callable(cb):
        return _FunctionCallback(cb)
    raise TypeError(NOT_A_CALLBACK.format(given=repr(cb)[:80]))


def _check_hooks(cb: Callback) -> None:
    _check_names(cb)
    for hook, args in _HOOKS.items():
        method = getattr(cb, hook, None)
        if getattr(type(cb), hook, None) is getattr(Callback, hook) or not callable(method):
            continue  # not overridden (or not a function: left to fail where it is called, as before)
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):  # no signature to read (a builtin): called as it is
            continue
        parameters = signature.parameters
        try:
            signature.bind(*args.split(", "))
        except TypeError:
            given = "(" + ", ".join(parameters) + ")"
            raise TypeError(BAD_HOOK.format(who=type(cb).__name__, hook=hook, given=given, args=args,
                                            wrong_args=", ".join(parameters))) from None


def _check_names(cb: Callback) -> None:
    """:data:`UNKNOWN_HOOK` for a method named ``on_...`` that is no hook (another library's
    ``on_step_end``, a misspelt ``on_epoch_ends``): the Trainer would never call it."""
    for name in dir(type(cb)):
        if not name.startswith("on_") or name in _HOOKS or not callable(getattr(type(cb), name, None)):
            continue
        right, note = FOREIGN_HOOKS.get(name, (None, ""))
        why = f" {name} is another library's hook; {right} does its job here." if right else ""
        if right is None:
            close = difflib.get_close_matches(name, list(_HOOKS), n=1, cutoff=0.6)
            right = close[0] if close else "on_log"
        raise TypeError(UNKNOWN_HOOK.format(who=type(cb).__name__, name=name, why=why, right=right,
                                            args=_HOOKS[right], note=note))


class _Monitor:
    """Tracks the best value of one metric and the epochs since it improved.

    Tie-breaking (as CheckpointManager's ``best_metric``): a value improves only when it
    beats the best by more than ``min_delta``, so of tied values the first to reach the
    best stays the best; a value that is not finite (NaN, a diverged -inf) never improves. ``mode=None`` reads the direction from the monitor's name, or at
    ``on_train_begin`` from the Trainer's metric function (``functree/train/_direction.py``),
    and raises where neither says."""

    def __init__(self, who: str, monitor: str, mode: str | None, min_delta: float):
        check_mode(who, "monitor", monitor, mode)
        self.who, self.monitor, self.min_delta = who, monitor, abs(min_delta)
        self.given = mode if mode in ("min", "max") else None
        self.mode: str | None = None
        self.best: float | None = None  # None: no direction yet (a name that does not say)
        self.wait = 0
        self.job: Callable[[], Any] | None = None  # the trainer whose epochs the state records
        with contextlib.suppress(ValueError):  # a name that does not say: read at on_train_begin
            self.resolve()

    def resolve(self, trainer: TrainerView | None = None) -> str:
        """The direction, fixed on first success (``trainer``: its metric functions say)."""
        if self.mode is None:
            self.mode = resolve_mode(self.who, "monitor", self.monitor, self.given, trainer_metrics(trainer),
                                     known=trainer is not None)
        if self.best is None:  # (also a state saved before its direction was known)
            self.best = math.inf if self.mode == "min" else -math.inf
        return self.mode

    def state(self) -> dict[str, Any]:
        return {"best": None if self.best is None else float(self.best), "wait": int(self.wait)}

    def load(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.wait = int(state["wait"])
        self.job = None  # a restored job's state: the trainer that restored it goes on with it

    def begin(self, trainer: TrainerView, effect: str) -> None:
        """Refuse (:data:`ANOTHER_JOB`) a state recorded over another Trainer's epochs: kept
        across ``fit`` calls for one job (the restart recipe), it would measure a new job
        (a notebook's Trainer cell run again) against the old job's best, silently."""
        if self.job is not None and self.job() is not trainer:
            who = self.who
            raise ValueError(ANOTHER_JOB.format(who=who, monitor=self.monitor, best=self.best, wait=self.wait,
                                                effect=effect, name="stop" if who == "EarlyStopping" else "reduce"))

    def record(self, trainer: TrainerView) -> None:
        """The state is of ``trainer``'s job from now on (held weakly where it allows)."""
        try:
            self.job = weakref.ref(trainer)
        except TypeError:  # a stand-in trainer (a namespace): held as it is
            self.job = lambda: trainer

    def value(self, context: TrainingContext) -> float:
        if self.monitor not in context.metrics:
            raise ValueError(
                MISSING_MONITOR.format(who=self.who, monitor=self.monitor, given=sorted(context.metrics))
            )
        return context.metrics[self.monitor]

    def beats(self, value: float, reference: float) -> bool:
        """Whether ``value`` beats ``reference`` by more than ``min_delta``. A value that is
        not finite never does: NaN, and a diverged loss's -inf, which would be the best for
        good (every later epoch a wait) and the model restored, where ModelCheckpoint's
        ``best_metric`` skips it (``CheckpointManager.best_step``)."""
        if not math.isfinite(value):
            return False
        if self.resolve() == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    def improved(self, value: float) -> bool:
        """Record ``value``; True when it beats the best by more than ``min_delta``."""
        self.resolve()
        better = self.beats(value, self.best)  # type: ignore[arg-type]  # (resolved: a number)
        if better:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return better


class EarlyStopping(Settings, Callback):
    """Stop when ``monitor`` has not improved for ``patience`` epochs.

    An epoch improves when its value beats the best by more than ``min_delta``: of tied
    values, the first epoch to reach the best is the best. A value that is not finite
    never improves (NaN, a diverged loss's -inf: Keras takes -inf as the best and restores
    that model; ``ModelCheckpoint(best_metric=)`` skips it, and so does this).

    With ``restore_best=True`` the model of the best epoch is kept (a copy) and set back
    as ``trainer.model`` at the end of every ``fit``, whether it stopped early or ran all
    its epochs. The optimizer state is the
    last step's, but for the averaged parameters it keeps (``Optimizer(average=)``,
    lookahead's slow weights): those are the best epoch's too, so that
    ``trainer.averaged_model`` is the best epoch's averaged model (its parameters and the
    model's BatchNorm statistics of one epoch, as validated then), not the last step's
    average over the best epoch's statistics.

    ``restore_best_weights=True`` is Keras's name for it, with Keras 3's rule (and tf-keras
    2.16's): ``on_train_end`` restores the best weights whether or not the callback stopped
    the run. Keras 2 (up to 2.15) restored them only when it stopped the run, so a Keras 2
    run that used all its epochs kept its last weights; there, check ``stop.stopped_epoch``
    (None: it did not stop the run) and keep the last model by leaving the keyword out.
    As Keras 3's, when no monitored epoch improves (every value NaN or inf) the first monitored
    epoch (past ``start_from_epoch``) counts as the best: its model is the one restored.
    Keras resets the kept weights at each ``fit``; here all state lasts across ``fit``
    calls (the restart recipe), so a later ``fit`` that never improves restores the
    earlier best. It is one job's: given to another Trainer's ``fit`` (a notebook's Trainer
    cell run again with a callback made in an earlier cell) it is refused
    (:data:`ANOTHER_JOB`), as is a :class:`ReduceLROnPlateau`'s; a restored job's saved
    state is loaded into it.

    As Keras's, it never stops at the first epoch, nor at the first monitored one (past
    ``start_from_epoch``): a first value that is NaN (no best yet) with ``patience`` 0 or
    1 waits for the next.

    ``mode`` says which way ``monitor`` improves: ``"min"`` (a loss, an error) or ``"max"``
    (an accuracy, a score). Left out (None, Keras's ``"auto"``), it is read from the metric:
    a loss falls, ``ft.train``'s counting metrics rise (also renamed:
    ``metrics={"acc": ft.train.accuracy}`` makes ``"val_acc"`` rise), and a metric that
    does not say is refused before the first step (``UNKNOWN_DIRECTION``), never taken as
    ``"min"``: that stopped a run whose accuracy was rising and restored its worst epoch.

    Keras's other keywords, with Keras's rules:

    - ``baseline``: an epoch that improves on the best but not on ``baseline`` (by more
      than ``min_delta``) is still the best epoch (its model is the one restored), but it
      does not restart the wait: a run that never beats the baseline stops after
      ``patience`` epochs (at the first epoch that does not improve on the best once they
      have passed; an improving epoch never stops the run).
    - ``start_from_epoch``: the first ``start_from_epoch`` epochs are not monitored (a
      warm-up: no best, no wait, no stop). Keras's ``epoch < start_from_epoch`` with its
      epochs counted from 0, so ``start_from_epoch=2`` first monitors the 3rd epoch.
    - ``verbose=1``: at the end of ``fit`` it prints Keras's lines, "Epoch N: early
      stopping" when it stopped the run and "Restoring model weights from the end of the
      best epoch: N." when it sets the best model back (to standard error, where the
      progress line goes); 0 (the default) is silent. The stop is printed by the ``fit``
      it ended only, as Keras's (whose ``on_train_begin`` resets ``stopped_epoch``), though
      ``stopped_epoch`` itself is kept for the restart recipe.

    Example:
      >>> import functree as ft, jax.numpy as jnp, numpy as np
      >>> x = np.linspace(-1, 1, 8, dtype=np.float32)[:, None]
      >>> loss_fn = lambda m, b: jnp.mean((b[0] * m["w"] - b[1]) ** 2)
      >>> trainer = ft.train.Trainer({"w": jnp.zeros(1)}, ft.optim.sgd(3.0), loss_fn)
      >>> stop = ft.train.EarlyStopping(monitor="loss", patience=10, restore_best=True)
      >>> h = trainer.fit(ft.train.batches((x, 2 * x), 8), epochs=4, progress=False, callbacks=[stop])
      >>> [round(v, 3) for v in h["loss"]]  # the rate is too large: diverges after epoch 1
      [1.714, 4.233, 10.454, 25.814]
      >>> stop.stopped_epoch, stop.best_epoch  # ran all 4 epochs; the best was the first
      (None, 1)
      >>> round(float(trainer.model["w"][0]), 3)  # epoch 1's model, restored at the end
      5.143
    """

    # What it reads as set; any other name assigned is refused (Settings: `stop.min_delta = 0.1`
    # was an attribute nothing read, the monitor's is its own), its constructor's named.
    patience: int
    restore_best: bool
    restore_best_weights: bool
    baseline: float | None
    start_from_epoch: int
    verbose: int
    best_model: Any
    best_average: Any  # the best epoch's averaged parameters (restore_best, an averaging optimizer)
    best_epoch: int | None
    stopped_epoch: int | None
    _NAMED = "callback"
    _ARGUMENTS = (("__init__", "callback = ft.train.EarlyStopping(monitor, {})"),)

    def __init__(self, monitor: str = "val_loss", patience: int = 5, *, mode: str | None = None,
                 min_delta: float = 0.0, restore_best: bool = False, restore_best_weights: bool = False,
                 baseline: float | None = None, start_from_epoch: int = 0, verbose: int = 0):
        self._monitor = _Monitor("EarlyStopping", monitor, mode, min_delta)
        self.patience, self.restore_best = patience, restore_best
        self.baseline, self.start_from_epoch, self.verbose = baseline, start_from_epoch, verbose
        self.restore_best_weights = restore_best_weights  # Keras's name for restore_best (Keras 3's rule)
        self.best_model = None
        self.best_average = None
        self.best_epoch = None
        self.stopped_epoch = None
        self._stopped_now: int | None = None  # the epoch this fit stopped at (verbose's line), not saved

    def state_dict(self) -> dict[str, Any]:
        """The best value, the epochs waited, the stopping epoch and (``restore_best``)
        the best model and its averaged parameters."""
        return {**self._monitor.state(), "stopped_epoch": self.stopped_epoch, "best_epoch": self.best_epoch,
                "best_model": self.best_model, "best_average": self.best_average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and set(state) == set(self.state_dict()) - {"best_average"}:
            state = {**state, "best_average": None}  # saved before it was kept
        _check_state(self, state)
        self._monitor.load(state)
        self.stopped_epoch = None if state["stopped_epoch"] is None else int(state["stopped_epoch"])
        self.best_epoch = None if state.get("best_epoch") is None else int(state["best_epoch"])
        self.best_model = state["best_model"]
        self.best_average = state["best_average"]

    def on_train_begin(self, trainer: TrainerView) -> None:
        """Refuse the state of another Trainer's job (:data:`ANOTHER_JOB`); read which way the
        monitor improves (:data:`UNKNOWN_DIRECTION` before any step)."""
        self._monitor.begin(trainer, ": stopped after `patience` epochs that do not beat it" + (
            ", then given that job's best model as this trainer's model" if self.best_model is not None else ""))
        self._monitor.resolve(trainer)

    def on_epoch_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        value = self._monitor.value(context)  # read first: a missing monitor is named at once
        if context.sweep <= self.start_from_epoch:  # Keras's `epoch < start_from_epoch`, from 0
            return
        self._monitor.record(trainer)
        waited = self._monitor.wait
        restores = self.restore_best or self.restore_best_weights
        if self._monitor.improved(value):
            self.best_epoch = context.sweep
            if restores:
                self._keep(trainer)
            if self.baseline is not None and not self._monitor.beats(value, self.baseline):
                self._monitor.wait = waited + 1  # Keras: the wait restarts only past the baseline too
        else:
            if restores and self.best_model is None:  # Keras 3: never improved (NaN), the first monitored epoch's
                self.best_epoch = context.sweep
                self._keep(trainer)
            # Keras's `epoch > 0`, and never its first monitored epoch (always its best: no best before)
            if self._monitor.wait >= self.patience and context.sweep > max(1, self.start_from_epoch + 1):
                trainer.stop_training = True
                self.stopped_epoch = self._stopped_now = context.sweep

    def _keep(self, trainer: TrainerView) -> None:
        """Keep copies of the model and its averaged parameters, to restore at the end."""
        self.best_model = own_copy(trainer.model)
        self.best_average = own_copy(average_of(trainer.opt_state))

    def on_train_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        stopped_now, self._stopped_now = self._stopped_now, None  # printed once: the state outlives the fit
        if self.verbose and stopped_now is not None:
            print(f"Epoch {stopped_now}: early stopping", file=sys.stderr, flush=True)
        restores = self.restore_best or self.restore_best_weights  # Keras 3: whether or not it stopped the run
        if restores and self.best_model is not None:
            if self.verbose:
                print(f"Restoring model weights from the end of the best epoch: {self.best_epoch}.",
                      file=sys.stderr, flush=True)
            trainer.model = own_copy(self.best_model)  # a copy: the next fit's steps donate it
            if self.best_average is not None:  # the averaged model of the same epoch
                trainer.opt_state = with_average_of(trainer.opt_state, own_copy(self.best_average))


def average_of(opt_state: Any) -> Any:
    """The averaged parameters ``opt_state`` keeps (:func:`ft.optim.averaged` reads them),
    or None."""
    if not keeps_average(opt_state):
        return None
    (node,) = averages_in(opt_state)
    return node.average if isinstance(node, AverageState) else node.slow


def with_average_of(opt_state: Any, average: Any) -> Any:
    """``opt_state`` with ``average`` as its averaged parameters (:func:`average_of`)."""
    def put(node: Any) -> Any:
        if isinstance(node, AverageState):
            return node.replace(average=average)
        return node.replace(slow=average) if isinstance(node, SlowState) else node
    return jax.tree.map(put, opt_state, is_leaf=is_average)


class ReduceLROnPlateau(Settings, Callback):
    """Multiply the learning rate by ``factor`` when ``monitor`` stalls for ``patience`` epochs.

    The rate lives in the optimizer state (``ft.optim.set_hyperparameters``), so the
    compiled step is reused: no recompilation. With ``ft.optim.groups``, every group's
    rate is multiplied, or only ``group``'s (a pattern given to ``groups``; the history
    column ``"<group>/learning_rate"`` shows it). Of tied values the first epoch to reach
    the best is the best (a value improves only by more than ``min_delta``). ``mode`` is
    :class:`EarlyStopping`'s: left out, read from the metric (a loss falls, an accuracy
    rises), refused before the first step where the metric does not say. ``min_lr`` is a
    floor, as Keras's: a rate is lowered to no less than it, and one already at or below it
    is left as it is (never raised to it).

    Example:
      >>> import functree as ft
      >>> reduce = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1)
      >>> head_only = ft.train.ReduceLROnPlateau(monitor="val_loss", group="head")
    """

    # What it reads as set; any other name assigned is refused (Settings), its constructor's named.
    factor: float
    patience: int
    min_lr: float
    cooldown: int
    group: str | None
    _NAMED = "callback"
    _ARGUMENTS = (("__init__", "callback = ft.train.ReduceLROnPlateau(monitor, {})"),)

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 2, *,
                 mode: str | None = None, min_delta: float = 0.0, min_lr: float = 0.0, cooldown: int = 0,
                 group: str | None = None):
        if not 0 < factor < 1:
            raise ValueError(f"ReduceLROnPlateau factor must be in (0, 1), got {factor!r}; e.g. factor=0.5.")
        self._monitor = _Monitor("ReduceLROnPlateau", monitor, mode, min_delta)
        self.factor, self.patience, self.min_lr, self.cooldown = factor, patience, min_lr, cooldown
        self.group = group
        self._cooling = 0

    def state_dict(self) -> dict[str, Any]:
        """The best value, the epochs waited and the cooldown left."""
        return {**self._monitor.state(), "cooling": int(self._cooling)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state)
        self._monitor.load(state)
        self._cooling = int(state["cooling"])

    def on_train_begin(self, trainer: TrainerView) -> None:
        """Refuse, before any step, a learning rate it could not set (a schedule's, or an
        optimizer state with none): found at the first plateau, that was epochs in; a
        monitor whose direction no one gave (:data:`UNKNOWN_DIRECTION`); and the state of
        another Trainer's job (:data:`ANOTHER_JOB`)."""
        self._monitor.begin(trainer, ": its learning rate cut after epochs that do not beat it")
        self._monitor.resolve(trainer)
        names = self._names(trainer.opt_state)
        entries = _entries(trainer.opt_state, values=False)
        scheduled = [k for k, (_, _, settable, _) in zip(_keys(entries), entries) if k in names and not settable]
        if scheduled:
            raise ValueError(SCHEDULED_LEARNING_RATE.format(names=" and ".join(map(repr, scheduled))))

    def on_epoch_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        improved = self._monitor.improved(self._monitor.value(context))
        self._monitor.record(trainer)
        if self._cooling > 0:
            self._cooling -= 1
            self._monitor.wait = 0
            if self._cooling > 0 or improved:
                return
            self._monitor.wait = 1  # the epoch that ends the cooldown counts (Keras' order)
        if improved or self._monitor.wait < self.patience:
            return
        reduced = self._reduced(trainer.opt_state)
        if reduced is None:  # every rate at min_lr already: Keras neither resets the wait nor cools down
            return
        trainer.opt_state = reduced
        self._monitor.wait, self._cooling = 0, self.cooldown

    def _reduced(self, opt_state: Any) -> Any:
        """``opt_state`` with the learning rate(s) above ``min_lr`` multiplied by ``factor``
        (at least ``min_lr``), or None where none is above it. A rate at or below ``min_lr``
        is left as it is (Keras's ``old_lr > min_lr``, torch's ``old_lr - new_lr > eps``): a
        floor, never a rate to raise (``max(1e-5 * factor, min_lr=1e-3)`` multiplied it by 100)."""
        names = self._names(opt_state)
        now = hyperparameters(opt_state)
        try:
            above = [n for n in names if float(now[n]) > float(np.asarray(self.min_lr, np.asarray(now[n]).dtype))]
            if not above:
                return None
            return set_hyperparameters(opt_state, {n: max(float(now[n]) * self.factor, self.min_lr) for n in above})
        except (KeyError, ValueError) as e:
            raise ValueError(NO_LEARNING_RATE.format(error=e)) from None

    def _names(self, opt_state: Any) -> list[str]:
        """The learning rates it sets: every group's, or ``group``'s (errors name the fix)."""
        names = learning_rate_names(opt_state)
        if self.group is not None:
            name = group_learning_rate(opt_state, self.group)
            if name is None:
                groups = [n.rsplit("/", 1)[0] for n in names if "/" in n]
                named = [g for g in groups if g != "<default>"] or groups  # the default group last
                close = difflib.get_close_matches(str(self.group), named, n=1, cutoff=0.0)  # 'head' -> 'head.*'
                right = (f"ReduceLROnPlateau(group={close[0]!r})     # a pattern given to ft.optim.groups"
                         if close else "ReduceLROnPlateau()     # no groups: the optimizer's one learning rate")
                raise ValueError(UNKNOWN_GROUP.format(group=self.group, names=names, right=right))
            names = [name]
        if not names:
            raise ValueError(NO_LEARNING_RATE.format(error="no hyperparameter named learning_rate"))
        return names


ASYNCHRONOUS_OF_MANAGER = """\
ft.train.ModelCheckpoint(manager, asynchronous=True): the manager given writes synchronously; \
how a manager writes is set where it is built.

    wrong:  ft.train.ModelCheckpoint(ft.train.CheckpointManager(path), asynchronous=True)
    right:  ft.train.ModelCheckpoint(ft.train.CheckpointManager(path, asynchronous=True))
       or:  ft.train.ModelCheckpoint(path, asynchronous=True)"""


class Required:
    """The default of an argument Python would report missing (a callback's ``directory``,
    ``fit``'s ``data``): a default, so that Keras's ``ModelCheckpoint(filepath=...)`` or
    ``fit(x=X, y=Y)`` reaches the error naming functree's call instead of Python's
    "missing 1 required positional argument"."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = Required()


def missing(cls: str, argument: str) -> TypeError:
    """Python's own error for a required ``argument`` not given (no other keyword either)."""
    return TypeError(f"{cls}() missing 1 required positional argument: {argument!r}")


FOREIGN_KEYWORD = """\
{cls}() got an unexpected keyword argument {name!r} ({library} name).

    wrong:  ft.train.{cls}(..., {name}={value})
    right:  {right}{note}"""

CALLBACK_SPELLINGS: dict[str, dict[str, tuple[str, str, str]]] = {
    "ModelCheckpoint": {
        "filepath": ("Keras's", "ft.train.ModelCheckpoint({value})", "a directory: each checkpoint is a step's folder"),
        "dirpath": ("Lightning's", "ft.train.ModelCheckpoint({value})", ""),
        "monitor": ("Keras's and Lightning's", "ft.train.ModelCheckpoint(directory, best_metric={value})",
                    "ranks the checkpoints kept; the best is never deleted"),
        "save_best_only": ("Keras's", 'ft.train.ModelCheckpoint(directory, best_metric="val_loss", max_to_keep=1)',
                           "keeps the best and the latest (the one a preempted job resumes from)"),
        "save_top_k": ("Lightning's", 'ft.train.ModelCheckpoint(directory, best_metric="val_loss", max_to_keep={value})',
                       "keeps the latest max_to_keep and the best"),
        "save_last": ("Lightning's", "ft.train.ModelCheckpoint(directory)", "the latest is always kept"),
        "save_weights_only": ("Keras's and Lightning's", "ft.train.save(path, trainer.model)",
                              "a ModelCheckpoint saves the whole job (optimizer, data position, history); "
                              "ft.train.save writes a model alone"),
        "save_freq": ("Keras's", "ft.train.ModelCheckpoint(directory, every_steps={value})",
                      'save_freq="epoch" is the default: ft.train.ModelCheckpoint(directory)'),
        "every_n_train_steps": ("Lightning's", "ft.train.ModelCheckpoint(directory, every_steps={value})", ""),
        "every_n_epochs": ("Lightning's", "ft.train.ModelCheckpoint(directory, every_epochs={value})", ""),
        "period": ("tf.keras's", "ft.train.ModelCheckpoint(directory, every_epochs={value})", ""),
        "verbose": ("Keras's and Lightning's", "ft.train.ModelCheckpoint(directory)",
                    "saves are logged to the 'functree' logger"),
    },
    "TensorBoardLogger": {
        "log_dir": ("Keras's and Lightning's", "ft.train.TensorBoardLogger({value})", ""),
        "save_dir": ("Lightning's", "ft.train.TensorBoardLogger({value})", ""),
        "update_freq": ("Keras's", 'ft.train.TensorBoardLogger(logdir, every="log")',
                        'every="log": each log interval (fit\'s log_every=), "epoch": epoch ends; None: both'),
    },
    "CSVLogger": {
        "filename": ("Keras's", "ft.train.CSVLogger({value})", ""),
        "separator": ("Keras's", "ft.train.CSVLogger(path)", "the file is comma-separated (Python's csv module)"),
    },
}
"""Other libraries' keywords for functree's callbacks (Keras's, Lightning's): ``(library,
the call to write here, a note)``, for :func:`foreign_keyword`."""


def foreign_keyword(cls: str, unknown: dict[str, Any], init: Callable[..., Any]) -> TypeError:
    """The error for the first of ``unknown`` (keywords ``cls`` does not take): another
    library's name (:data:`CALLBACK_SPELLINGS`) with the call to write here, else
    Python's own message with the closest of ``init``'s parameters."""
    name, value = next(iter(unknown.items()))
    if name in CALLBACK_SPELLINGS[cls]:
        library, right, note = CALLBACK_SPELLINGS[cls][name]
        shown = repr(value) if len(repr(value)) <= 60 else type(value).__name__
        return TypeError(FOREIGN_KEYWORD.format(cls=cls, name=name, library=library, value=shown,
                                                right=right.format(value=shown), note=f"   # {note}" if note else ""))
    close = closest_parameter(name, init)
    hint = f" (did you mean {close!r}?)" if close else ""
    return TypeError(f"{cls}() got an unexpected keyword argument {name!r}{hint}")


def closest_parameter(name: str, fn: Callable[..., Any]) -> str | None:
    """The parameter of ``fn`` (not ``self``, not its ``**kwargs``) closest to a misspelt
    keyword ``name`` (``difflib``), or None."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


class ModelCheckpoint(Settings, Callback):
    """Save the trainer (model, optimizer state with its learning context, layer state,
    PRNG key, position in the data, history, the callbacks' states and ``extra``) through
    a :class:`CheckpointManager`: after every ``every_steps`` steps (steps k, 2k, 3k, ...
    of the job, whatever ``log_every`` and ``steps_per_call``), else at the end of every
    ``every_epochs``-th epoch (default 1: each; after all callbacks' ``on_epoch_end``),
    and at the end of training.

    The checkpoint labelled ``s`` holds the state after exactly ``s`` steps; a stop
    (``on_nan="stop"``) is found before any save, so nothing is written past it. Its
    metrics (what ``best_metric`` ranks) are those of step ``s``: at an epoch's end the
    epoch's means and ``val_*``, elsewhere the means of its epoch's steps up to ``s``
    (Keras's logs there), whatever ``log_every``; a checkpoint without ``best_metric``
    among them (``val_loss`` between epoch ends) is not written to a ranked directory: with
    ``every_steps``, a ``val_*`` metric ranks the steps k, 2k, ... that end an epoch, written
    after its validation and every ``on_epoch_end`` (ranked by another step's validation,
    a checkpoint would carry a number never measured on its model). A ``best_metric``
    missing at an epoch's end (no ``validation_data``, a misspelt name) is an error
    (:data:`BEST_METRIC_MISSING`), not a directory left empty, and a ``fit`` that ends with
    the ranked directory empty (no epoch end reached) logs :data:`NOTHING_RANKED`. When the
    process gets SIGTERM (preemption) during ``fit``, the Trainer saves at the current step
    and stops. ``extra`` is a function ``extra(trainer)`` whose tree (arrays and plain
    values: a data pipeline's state, a counter) is saved with every checkpoint and comes
    back as ``trainer.extra`` after ``trainer.restore``.

    ``directory`` is a path or a :class:`CheckpointManager`; ``max_to_keep`` (a positive
    int, or None to keep all), ``best_metric``, ``mode`` and ``asynchronous`` (write in the
    background while training goes on) configure a manager built from a path. ``mode`` left
    out is read from the metric as :class:`EarlyStopping`'s (``best_metric="val_acc"`` of
    ``metrics={"acc": ft.train.accuracy}`` keeps the highest), and refused before the
    first step where the metric does not say. In a
    multi-process job every process runs it (each writes its shards; the primary process
    holds the directory's lock); another job writing the same directory gets a
    CheckpointError.

    Example:
      >>> import functree as ft, tempfile
      >>> save = ft.train.ModelCheckpoint(tempfile.mkdtemp() + "/ckpt", best_metric="val_loss")
    """

    reads_model = True
    # What it reads as set; any other name assigned is refused (Settings: `save.max_to_keep = 5`
    # was an attribute nothing read, the manager's is its own), its constructor's named.
    manager: CheckpointManager
    every_steps: int | None
    every_epochs: int
    extra: Callable[[TrainerView], Any] | None
    _NAMED = "callback"
    _ARGUMENTS = (("__init__", "callback = ft.train.ModelCheckpoint(directory, {})"),)

    def __init__(self, directory: str | os.PathLike[str] | CheckpointManager = REQUIRED, *,
                 every_steps: int | None = None, max_to_keep: int | None = 3,
                 best_metric: str | None = None, mode: str | None = None,
                 extra: Callable[[TrainerView], Any] | None = None, every_epochs: int = 1,
                 asynchronous: bool = False, **unknown: Any):
        if unknown:
            raise foreign_keyword("ModelCheckpoint", unknown, ModelCheckpoint.__init__)
        if directory is REQUIRED:
            raise missing("ModelCheckpoint", "directory")
        for what, value in (("every_steps", every_steps), ("every_epochs", every_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(BAD_EVERY.format(what=what, value=value))
        if isinstance(directory, CheckpointManager):
            if asynchronous and not directory._asynchronous:
                raise ValueError(ASYNCHRONOUS_OF_MANAGER)
            self.manager = directory
            self._mode: str | None = directory.mode  # its own, resolved when it was built
        else:
            check_mode("ModelCheckpoint", "best_metric", best_metric, mode)
            # the name may not say (a metric renamed in Trainer(metrics=)): its function says at on_train_begin
            self._mode = mode if mode in ("min", "max") else None if best_metric is not None else "min"
            self.manager = CheckpointManager(directory, max_to_keep, best_metric,
                                             self._mode or direction(str(best_metric)) or "min",
                                             asynchronous=asynchronous)
        self.every_steps, self.every_epochs = every_steps, every_epochs
        self.extra = extra
        self._last_saved: int | None = None
        self._replayed: set[int] = set()  # later checkpoints of this run a best_metric directory held

    def on_train_begin(self, trainer: TrainerView) -> None:
        """Refuse a directory holding checkpoints past the trainer's step (:data:`STEPS_AHEAD`):
        this run would skip those steps, and a restore would continue the other run. A
        ``best_metric`` directory may hold later checkpoints of this very run (whose history
        begins with this trainer's): the best of a run restored from a periodic directory
        whose latest checkpoint is older than the best one. Ranked checkpoints are not
        where the run resumes, and the run writes the same ones again (skipped: present)."""
        if self._mode is None:  # no mode given, nor one its name says: the direction of the Trainer's metric
            self.manager.mode = self._mode = resolve_mode(
                "ModelCheckpoint", "best_metric", str(self.manager.best_metric), None, trainer_metrics(trainer), known=True)
        ahead = [s for s in self.manager.all_steps() if s > trainer.steps_run]
        self._replayed = set()
        if ahead and self.manager.best_metric is not None and all(
                _same_run(trainer, self.manager, s) for s in ahead):
            self._replayed = set(ahead)  # checked again when this run gets there (save)
            return
        if ahead:
            raise ValueError(STEPS_AHEAD.format(directory=self.manager.directory, step=trainer.steps_run,
                                                ahead=ahead))

    def save(self, trainer: TrainerView, context: TrainingContext) -> None:
        """Write a checkpoint of ``trainer`` now (once per step), with ``context.metrics``
        when they rank checkpoints. The Trainer calls it at save points, where
        ``trainer.model`` is the model after ``context.step``."""
        step = trainer.steps_run
        if self._replayed:  # a best_metric directory's later checkpoints of this run: still this run's?
            self._check_replayed(trainer)
        if self._last_saved == step or step in self.manager.all_steps():
            return  # saved already (by this callback, or by the run a restored trainer continues)
        best = self.manager.best_metric
        if best is not None and best not in context.metrics:
            return  # ranked checkpoints are written where the metric is known (epoch ends)
        self._last_saved = trainer.steps_run  # saved with the callbacks' states
        try:
            extra = self.extra(trainer) if self.extra is not None else trainer.extra
            trainer.save(self.manager, metrics=context.metrics, extra=extra)
        except BaseException:
            self._last_saved = None
            raise

    def _check_replayed(self, trainer: TrainerView) -> None:
        """:data:`REPLAY_DIVERGED` when the run no longer begins the history of the later
        checkpoints it was allowed (:meth:`on_train_begin`); those up to its step are done."""
        step, present = trainer.steps_run, self.manager.all_steps()
        later = sorted(s for s in self._replayed if s >= step and s in present)
        diverged = [s for s in later if not _same_run(trainer, self.manager, s)]
        if diverged:
            raise ValueError(REPLAY_DIVERGED.format(directory=self.manager.directory, step=step, ahead=diverged))
        self._replayed = set(s for s in later if s > step)

    def _save_point(self, trainer: TrainerView, context: TrainingContext, event: str) -> None:
        """The Trainer's save points: ``"step"`` (every ``every_steps``), ``"epoch"`` (after
        every callback's ``on_epoch_end``), ``"end"`` (the end of ``fit``, before every
        callback's ``on_train_end``: ``EarlyStopping(restore_best=True)`` may then set
        another epoch's model) and ``"terminate"`` (SIGTERM). A ranked step save at an epoch's
        last step waits for the ``"epoch"`` point, where its ``val_*`` are known."""
        ranked = self.manager.best_metric
        if event == "epoch" and ranked is not None and ranked not in context.metrics:
            raise ValueError(BEST_METRIC_MISSING.format(
                directory=self.manager.directory, metric=ranked, epoch=trainer.epoch, step=trainer.steps_run,
                given=sorted(context.metrics)))
        if event == "step" and self.every_steps and trainer.steps_run % self.every_steps:
            return
        if event == "epoch" and not self._saves_at_epoch_end(trainer):
            return
        if event == "end":  # the end of fit, before any callback's on_train_end
            if ranked is None:
                self.save(trainer, context)
            elif jax.process_index() == 0 and not self.manager.all_steps():
                where = "epoch ends" if not self.every_steps else (
                    f"the steps {self.every_steps}, {2 * self.every_steps}, ... that end an epoch"
                    if ranked.startswith("val_") else f"the steps {self.every_steps}, {2 * self.every_steps}, ...")
                _LOG.warning(NOTHING_RANKED.format(directory=self.manager.directory, metric=ranked, where=where,
                                                   step=trainer.steps_run))
        elif event != "step" or self.every_steps:
            self.save(trainer, context)

    def _saves_at_epoch_end(self, trainer: TrainerView) -> bool:
        """With ``every_steps``, a ranked directory's step saves that end an epoch (their
        ``val_*`` known now; one saved at the step already is skipped), no periodic one (saved
        at the step); without, every ``every_epochs``-th epoch."""
        if self.every_steps:
            return self.manager.best_metric is not None and trainer.steps_run % self.every_steps == 0
        return trainer.epoch % self.every_epochs == 0

    def on_train_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        self.manager.wait_until_finished()


def finish_saves(callbacks: list[Callback]) -> None:
    """Wait for the asynchronous checkpoints ``callbacks`` are writing (``fit`` ended by an
    exception or a Ctrl-C: the process may end with it, and orbax's writer thread, cut off
    at interpreter exit, would leave the step a temporary directory). A write that failed
    is left to the manager's next save: the error that ended ``fit`` is the one raised. One
    process only: in a job of several, waiting is a collective the others may never join."""
    if jax.process_count() != 1:
        return
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.manager._asynchronous:
            with contextlib.suppress(Exception):
                cb.manager.wait_until_finished()


def _same_run(trainer: TrainerView, manager: CheckpointManager, step: int) -> bool:
    """Whether the checkpoint at ``step`` is a later one of ``trainer``'s run: its history's
    step rows begin with all of the trainer's (at least one), value for value (NaN equal to
    NaN). Read from its metadata alone (JSON, its digest checked); an unreadable or changed
    one is not."""
    ours = trainer.state.history.steps
    if not ours.get("step"):
        return False
    try:
        meta = json.loads((Path(manager.directory) / str(step) / "meta" / "metadata").read_text())
        if meta.get("digest") != metadata_digest(meta):
            return False
        saved = meta["config"]["trainer"]["history"]["steps"]
        return all(_same_values(column, saved[name]) for name, column in ours.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _same_values(ours: list[Any], saved: list[Any]) -> bool:
    if len(saved) < len(ours):
        return False
    for a, b in zip(ours, saved):
        if a is None or b is None:
            if a is not b:
                return False
        elif float(a) != float(b) and not (math.isnan(float(a)) and math.isnan(float(b))):
            return False
    return True


class HistoryLogger(Settings, Callback):
    """Append every log and epoch record to a JSON-lines file (one object per line).

    Its state is the file's length: restored, it cuts off the records written after the
    checkpoint, so a resumed job's file equals the uninterrupted job's. As
    :class:`~functree.train.CSVLogger`'s, ``append=False`` (default) starts the file anew at
    a new job's first ``fit`` (a trainer that has run no step and was not restored: a
    notebook's Trainer cell run again, whose records followed the old job's, steps 1, 2, 1,
    2); a job that has run steps continues it, as does ``append=True``.

    Example:
      >>> import functree as ft, tempfile
      >>> logger = ft.train.HistoryLogger(tempfile.mkdtemp() + "/history.jsonl")
    """

    reads_model = False
    path: Path  # (any other name assigned is refused: Settings)
    append: bool
    _NAMED = "callback"
    _ARGUMENTS = (("__init__", "callback = ft.train.HistoryLogger(path, {})"),)

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False):
        self.path = local_path(path)  # ~ expanded; a later chdir moves nothing
        self.append = append

    def on_train_begin(self, trainer: TrainerView) -> None:
        """A new job (no step run, not restored) starts the file anew, unless ``append``."""
        new_job = getattr(trainer, "checkpoint", None) is None and not trainer.steps_run  # (Trainer.checkpoint: the restored one)
        if new_job and not self.append and jax.process_index() == 0 and self.path.exists():
            self.path.write_text("")

    def state_dict(self) -> dict[str, Any]:
        """The file's length in bytes."""
        return {"length": self.path.stat().st_size if self.path.exists() else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state)
        if jax.process_index() == 0 and self.path.exists() and self.path.stat().st_size > int(state["length"]):
            with self.path.open("r+b") as f:
                f.truncate(int(state["length"]))

    def _write(self, context: TrainingContext) -> None:
        if jax.process_index() != 0:  # one history file for all processes
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(dataclasses.asdict(context)) + "\n")

    def on_log(self, trainer: TrainerView, context: TrainingContext) -> None:
        self._write(context)

    def on_epoch_end(self, trainer: TrainerView, context: TrainingContext) -> None:
        self._write(context)
