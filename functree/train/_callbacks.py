"""Callbacks: seed 003's progress callback, called with the learning context.

A callback sees a :class:`TrainingContext` (step, sweep, samples seen, minibatch size,
learning rate, metrics) at every log interval (``on_log``), at the end of every epoch
(``on_epoch_end``, with epoch means and validation metrics) and at the end of training.
It may read and replace ``trainer.model`` / ``trainer.opt_state`` and set
``trainer.stop_training = True``. A plain function ``fn(context)`` is called at every log
interval and epoch end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from functree.optim import hyperparameters, set_hyperparameters
from functree.optim._hyper import group_learning_rate, learning_rate_names
from functree.train._checkpoint import CheckpointManager

if TYPE_CHECKING:  # annotations only: the Trainer imports this module, never the reverse
    from functree.train._trainer import Trainer

__all__ = [
    "TrainingContext",
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

BAD_MODE = """\
{who}: mode must be "min" or "max", got {mode!r}.
    right:  {who}(monitor="val_accuracy", mode="max")"""

NO_LEARNING_RATE = """\
ReduceLROnPlateau sets the learning rate through ft.optim.set_hyperparameters, but this \
optimizer state has no settable learning rate ({error}).

    wrong:  Trainer(model, optax.adam(1e-3), loss_fn)
    right:  Trainer(model, ft.optim.Optimizer(ft.optim.adam(1e-3)), loss_fn)"""

UNKNOWN_GROUP = """\
ReduceLROnPlateau(group={group!r}): the optimizer has no parameter group {group!r} with a \
learning rate; its learning rates are {names}.

    wrong:  ReduceLROnPlateau(group="classifier")
    right:  ReduceLROnPlateau(group="head")     # a pattern given to ft.optim.groups({{"head": ...}})"""

NOT_A_CALLBACK = """\
A callback is a ft.train.Callback or a function of the TrainingContext, got {given}.
    right:  callbacks=[ft.train.EarlyStopping(patience=3), lambda ctx: print(ctx.step)]"""


@dataclasses.dataclass(frozen=True)
class TrainingContext:
    """What callbacks see (host values, read at a log interval or an epoch end).

    Attributes:
      event: ``"log"``, ``"epoch"`` or ``"end"``.
      step: training steps run by the Trainer (all ``fit`` calls).
      sweep: the epoch (the learning context's sweep).
      samples_seen: examples consumed by the optimizer steps taken.
      minibatch_size: the size of the latest minibatch.
      learning_rate: the current learning rate (None if the state has none, or has one
        per parameter group: see ``learning_rates``).
      metrics: means over the interval (``"log"``) or the epoch (``"epoch"``), with
        ``val_*`` validation metrics at epoch ends. Under ``on_nan="skip"`` the means
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


class Callback:
    """Base class: override any of the hooks (each does nothing by default).

    Hooks get the :class:`Trainer` (``trainer.model``, ``trainer.opt_state`` and
    ``trainer.stop_training`` may be set) and, but for ``on_train_begin``, the
    :class:`TrainingContext`.

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

    def on_train_begin(self, trainer: Trainer) -> None:
        """Before the first step of ``fit``."""

    def on_log(self, trainer: Trainer, context: TrainingContext) -> None:
        """At every log interval."""

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        """At the end of every epoch (after validation)."""

    def on_train_end(self, trainer: Trainer, context: TrainingContext) -> None:
        """When ``fit`` ends (also when stopped early)."""


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable[[TrainingContext], Any]):
        self.fn = fn

    def on_log(self, trainer: Trainer, context: TrainingContext) -> None:
        self.fn(context)

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        self.fn(context)


def as_callback(cb: Any) -> Callback:
    """A :class:`Callback` from itself or from a function of the context."""
    if isinstance(cb, Callback):
        return cb
    if callable(cb):
        return _FunctionCallback(cb)
    raise TypeError(NOT_A_CALLBACK.format(given=repr(cb)[:80]))


class _Monitor:
    """Tracks the best value of one metric and the epochs since it improved.

    Tie-breaking (as CheckpointManager's ``best_metric``): a value improves only when it
    beats the best by more than ``min_delta``, so of tied values the first to reach the
    best stays the best."""

    def __init__(self, who: str, monitor: str, mode: str, min_delta: float):
        if mode not in ("min", "max"):
            raise ValueError(BAD_MODE.format(who=who, mode=mode))
        self.who, self.monitor, self.mode, self.min_delta = who, monitor, mode, abs(min_delta)
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0

    def value(self, context: TrainingContext) -> float:
        if self.monitor not in context.metrics:
            raise ValueError(
                MISSING_MONITOR.format(who=self.who, monitor=self.monitor, given=sorted(context.metrics))
            )
        return context.metrics[self.monitor]

    def improved(self, value: float) -> bool:
        """Record ``value``; True when it beats the best by more than ``min_delta``."""
        better = (value < self.best - self.min_delta) if self.mode == "min" else (
            value > self.best + self.min_delta
        )
        if better:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return better


def _copy(tree: Any) -> Any:
    # The training step donates the model's buffers; a kept copy must own its own.
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved for ``patience`` epochs.

    An epoch improves when its value beats the best by more than ``min_delta``: of tied
    values, the first epoch to reach the best is the best.

    With ``restore_best=True`` the model of the best epoch is kept (a copy) and set back
    as ``trainer.model`` at the end of every ``fit``, whether it stopped early or ran all
    its epochs (Keras's ``restore_best_weights`` restores only when it stops early, so a
    run that uses all its epochs keeps the last model there). The optimizer state is the
    last step's.

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

    def __init__(self, monitor: str = "val_loss", patience: int = 5, *, mode: str = "min",
                 min_delta: float = 0.0, restore_best: bool = False):
        self._monitor = _Monitor("EarlyStopping", monitor, mode, min_delta)
        self.patience, self.restore_best = patience, restore_best
        self.best_model: Any = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        if self._monitor.improved(self._monitor.value(context)):
            self.best_epoch = context.sweep
            if self.restore_best:
                self.best_model = _copy(trainer.model)
        elif self._monitor.wait >= self.patience:
            trainer.stop_training = True
            self.stopped_epoch = context.sweep

    def on_train_end(self, trainer: Trainer, context: TrainingContext) -> None:
        if self.restore_best and self.best_model is not None:
            trainer.model = _copy(self.best_model)  # a copy: the next fit's steps donate it


class ReduceLROnPlateau(Callback):
    """Multiply the learning rate by ``factor`` when ``monitor`` stalls for ``patience`` epochs.

    The rate lives in the optimizer state (``ft.optim.set_hyperparameters``), so the
    compiled step is reused: no recompilation. With ``ft.optim.groups``, every group's
    rate is multiplied, or only ``group``'s (a pattern given to ``groups``; the history
    column ``"<group>/learning_rate"`` shows it). Of tied values the first epoch to reach
    the best is the best (a value improves only by more than ``min_delta``).

    Example:
      >>> import functree as ft
      >>> reduce = ft.train.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1)
      >>> head_only = ft.train.ReduceLROnPlateau(monitor="val_loss", group="head")
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 2, *,
                 mode: str = "min", min_delta: float = 0.0, min_lr: float = 0.0, cooldown: int = 0,
                 group: str | None = None):
        if not 0 < factor < 1:
            raise ValueError(f"ReduceLROnPlateau factor must be in (0, 1), got {factor!r}; e.g. factor=0.5.")
        self._monitor = _Monitor("ReduceLROnPlateau", monitor, mode, min_delta)
        self.factor, self.patience, self.min_lr, self.cooldown = factor, patience, min_lr, cooldown
        self.group = group
        self._cooling = 0

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        improved = self._monitor.improved(self._monitor.value(context))
        if self._cooling > 0:
            self._cooling -= 1
            self._monitor.wait = 0
            return
        if improved or self._monitor.wait < self.patience:
            return
        trainer.opt_state = self._reduced(trainer.opt_state)
        self._monitor.wait, self._cooling = 0, self.cooldown

    def _reduced(self, opt_state: Any) -> Any:
        """``opt_state`` with the learning rate(s) multiplied by ``factor`` (at least ``min_lr``)."""
        names = learning_rate_names(opt_state)
        if self.group is not None:
            name = group_learning_rate(opt_state, self.group)
            if name is None:
                raise ValueError(UNKNOWN_GROUP.format(group=self.group, names=names))
            names = [name]
        if not names:
            raise ValueError(NO_LEARNING_RATE.format(error="no hyperparameter named learning_rate"))
        now = hyperparameters(opt_state)
        try:
            return set_hyperparameters(opt_state, {n: max(float(now[n]) * self.factor, self.min_lr) for n in names})
        except (KeyError, ValueError) as e:
            raise ValueError(NO_LEARNING_RATE.format(error=e)) from None


class ModelCheckpoint(Callback):
    """Save the trainer (model, optimizer state, position, config) through a
    :class:`CheckpointManager`: every epoch, or every ``every_steps`` steps at log
    intervals, and at the end of training.

    ``directory`` is a path or a :class:`CheckpointManager`; ``max_to_keep`` (a positive
    int, or None to keep all), ``best_metric`` and ``mode`` configure a manager built from
    a path. In a multi-process job every process runs it (each writes its shards; the
    primary process holds the directory's lock); another job writing the same directory
    gets a CheckpointError.

    Example:
      >>> import functree as ft, tempfile
      >>> save = ft.train.ModelCheckpoint(tempfile.mkdtemp() + "/ckpt", best_metric="val_loss")
    """

    def __init__(self, directory: str | os.PathLike[str] | CheckpointManager, *,
                 every_steps: int | None = None, max_to_keep: int | None = 3,
                 best_metric: str | None = None, mode: str = "min"):
        if isinstance(directory, CheckpointManager):
            self.manager = directory
        else:
            self.manager = CheckpointManager(directory, max_to_keep, best_metric, mode)
        self.every_steps = every_steps
        self._last_saved: int | None = None

    def _save(self, trainer: Trainer, context: TrainingContext) -> None:
        if self._last_saved == trainer.steps_run:
            return
        # The Trainer reads a log interval one interval late (its steps stay queued), so a
        # log's metrics may belong to an earlier step than the model saved now: they are
        # stored only with the step they describe, never under another step's number.
        current = context.step == trainer.steps_run
        best = self.manager.best_metric
        if best is not None and (best not in context.metrics or not current):
            return  # ranked checkpoints are written where the metric is the model's (epoch ends)
        trainer.save(self.manager, metrics=context.metrics if current else None)
        self._last_saved = trainer.steps_run

    def on_log(self, trainer: Trainer, context: TrainingContext) -> None:
        if self.every_steps and (self._last_saved is None or context.step - self._last_saved >= self.every_steps):
            self._save(trainer, context)

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        if not self.every_steps:
            self._save(trainer, context)

    def on_train_end(self, trainer: Trainer, context: TrainingContext) -> None:
        if self.manager.best_metric is None:
            self._save(trainer, context)
        self.manager.wait_until_finished()


class HistoryLogger(Callback):
    """Append every log and epoch record to a JSON-lines file (one object per line).

    Example:
      >>> import functree as ft, tempfile
      >>> logger = ft.train.HistoryLogger(tempfile.mkdtemp() + "/history.jsonl")
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def _write(self, context: TrainingContext) -> None:
        if jax.process_index() != 0:  # one history file for all processes
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(dataclasses.asdict(context)) + "\n")

    def on_log(self, trainer: Trainer, context: TrainingContext) -> None:
        self._write(context)

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        self._write(context)
