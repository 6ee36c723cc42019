"""Which way a monitored metric improves: the ``mode`` of ``EarlyStopping``,
``ReduceLROnPlateau``, ``ModelCheckpoint`` and ``CheckpointManager`` when it is not given.

A loss falls as a model gets better; an accuracy rises. With ``mode="min"`` as every
monitor's default (torch's and Lightning's), ``EarlyStopping(monitor="val_accuracy",
restore_best=True)`` counted each better epoch as a worse one: it stopped a run whose
accuracy rose 0.61 -> 0.70 -> 0.84 at epoch 3 and set epoch 1's model back, with no error
(``ReduceLROnPlateau`` cut the rate of a run that was improving, ``ModelCheckpoint`` kept
the worst checkpoint as the best). Keras 3's ``mode="auto"`` reads the direction from the
metric and raises where it cannot; so does ``mode=None`` (the default; ``"auto"`` is the same):

* ``"loss"`` and names ending in ``"_loss"`` fall (``"val_loss"``, ``"val_averaged_loss"``,
  an ``"lm_loss"``);
* a metric function that says (``fn.higher_is_better = True``, torchmetrics' attribute; every
  ``ft.train`` counting metric has it) is read by the name the Trainer gives it
  (``metrics={"acc": ft.train.accuracy}`` -> ``"val_acc"`` rises);
* ``ft.train``'s metrics by their own names rise (``"accuracy"``, ``"binary_accuracy"``,
  ``"precision"``, ``"recall"``, ``"f1"``, ``"top_5_accuracy"``): what a
  ``CheckpointManager`` without a Trainer can know;
* any other name raises :data:`UNKNOWN_DIRECTION`, naming the monitor and both fixes.

Example:
  >>> from functree.train._direction import direction
  >>> direction("val_loss"), direction("val_accuracy"), direction("val_mae")
  ('min', 'max', None)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["HIGHER_IS_BETTER", "direction", "check_mode", "resolve_mode", "rises", "trainer_metrics", "UNKNOWN_DIRECTION",
           "BAD_MODE"]

HIGHER_IS_BETTER = "higher_is_better"
"""The attribute a metric function sets to say which way it improves (torchmetrics' name)."""

_RISING = frozenset({"accuracy", "binary_accuracy", "precision", "recall", "f1"})
_TOP_K = re.compile(r"top_\d+_accuracy")
_PREFIXES = ("val_", "averaged_")  # a validation metric, an averaged model's (the same metric)

UNKNOWN_DIRECTION = """\
{who} cannot tell whether {keyword}={monitor!r} gets better as it falls or as it rises: \
functree knows the loss (falls) and its own metrics (ft.train.accuracy, binary_accuracy, precision, \
recall, f1, top_k_accuracy: rise), and {name!r} is none of them{why}. Say which:

    wrong:  {call}
    right:  {right_min}     # lower is better (an error, a distance)
       or:  {right_max}     # higher is better (a score)
       or:  my_metric.higher_is_better = True                  # on the metric function itself"""

BAD_MODE = """\
{who}: mode must be "min", "max" or None (left out: read from the metric, Keras's "auto"), \
got {mode!r}.

    wrong:  {call}
    right:  {right}     # lower is better; mode="max": higher is better"""


def base_name(monitor: str) -> str:
    """The metric's own name: ``"val_averaged_acc"`` -> ``"acc"``."""
    name = monitor
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    return name


def rises(fn: Any) -> bool | None:
    """A metric function's ``higher_is_better`` (None where it does not say)."""
    while isinstance(fn, functools.partial):  # functools.partial(ft.train.accuracy, ignore_index=0)
        fn = fn.func
    flag = getattr(fn, HIGHER_IS_BETTER, None)
    return flag if isinstance(flag, bool) else None


def trainer_metrics(trainer: Any) -> Mapping[str, Any] | None:
    """A Trainer's ``{name: metric function}`` (its step's), or None (no Trainer, or a
    stand-in without one: a callback driven by hand)."""
    metrics = getattr(getattr(trainer, "train_step", None), "metrics", None)
    return metrics if isinstance(metrics, Mapping) else None


def direction(monitor: str, metrics: Mapping[str, Any] | None = None) -> str | None:
    """``"min"``, ``"max"``, or None where neither the name nor the metric function
    (``metrics``: the Trainer's ``{name: fn}``) says which way ``monitor`` improves."""
    name = base_name(monitor)
    if name == "loss" or name.endswith("_loss"):
        return "min"
    flag = rises((metrics or {}).get(name))
    if flag is not None:
        return "max" if flag else "min"
    if name in _RISING or _TOP_K.fullmatch(name):
        return "max"
    return None


def check_mode(who: str, keyword: str, monitor: Any, mode: Any) -> None:
    """Raise :data:`BAD_MODE` unless ``mode`` is ``"min"``, ``"max"``, None or ``"auto"``."""
    if mode is None or (isinstance(mode, str) and mode in ("min", "max", "auto")):
        return
    shown = "val_loss" if monitor is None else monitor
    raise ValueError(BAD_MODE.format(who=who, mode=mode, call=f"{who}({keyword}={shown!r}, mode={mode!r})",
                                     right=f'{who}({keyword}={shown!r}, mode="min")'))


def resolve_mode(who: str, keyword: str, monitor: str, mode: str | None,
                 metrics: Mapping[str, Any] | None = None, *, known: bool = False) -> str:
    """``mode`` if given, else :func:`direction`'s; raises :data:`UNKNOWN_DIRECTION` if that
    is None (``known``: ``metrics`` are the Trainer's, so its message says the function
    does not say either)."""
    check_mode(who, keyword, monitor, mode)
    if mode in ("min", "max"):
        return mode  # type: ignore[return-value]
    found = direction(monitor, metrics)
    if found is not None:
        return found
    name = base_name(monitor)
    why = (f" (the Trainer's metric {name!r} has no higher_is_better)" if known and metrics and name in metrics
           else "")
    call = f"{who}({keyword}={monitor!r})"
    raise ValueError(UNKNOWN_DIRECTION.format(
        who=who, keyword=keyword, monitor=monitor, name=name, why=why, call=call,
        right_min=f'{who}({keyword}={monitor!r}, mode="min")', right_max=f'{who}({keyword}={monitor!r}, mode="max")'))
