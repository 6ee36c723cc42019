"""Callback hooks called in turn, and the rest of a round that one of them cut short.

A round is one hook (``on_log`` of an interval, ``on_epoch_end`` of an epoch, which is
followed by the epoch's checkpoints) called on every callback of the fit in order. When a
callback raises, the round stops there; the job records it as ``pending`` (the hook, the
context and the names of the callbacks that completed it, all JSON: a checkpoint keeps it)
and the next ``fit`` finishes it first: the callback that raised and those after it get
the same context, then the epoch's checkpoints are written. So a transient failure (a
logger's network write) costs no callback an epoch, and no checkpoint is skipped.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from functree.train._callbacks import Callback, TrainingContext
from functree.train._job import callback_keys, is_count
from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["call_hooks", "check_pending", "end_epoch", "finish_pending"]

BAD_PENDING = """\
{where}: the restored job's unfinished round of callback hooks (the "pending" entry of its \
checkpoint's "trainer" config) is {given}, not what a Trainer writes ({{"hook": \
"on_log" or "on_epoch_end", "context": a TrainingContext's fields, "done": [callback names]}}): \
the checkpoint was changed after it was written. Restore another checkpoint, or drop the \
entry to skip the rest of that round:

    right:  trainer.restore(manager, step=manager.all_steps()[-2])"""

BAD_PENDING_FIELD = """\
{where}.context.{field} is {given}, not {expected} (what a Trainer writes \
for a pending {hook} round): the checkpoint was changed after it was written. Nothing reaches \
a callback; restore another checkpoint:

    right:  trainer.restore(manager, step=manager.all_steps()[-2])"""

_HOOKS = ("on_log", "on_epoch_end")
_EVENTS = {"on_log": "log", "on_epoch_end": "epoch"}  # the context's event of each hook's round
_FIELDS = {f.name for f in dataclasses.fields(TrainingContext)}
_COUNT = "an int, 0 <= n < 2**63"


def _rate(v: Any) -> bool:
    return type(v) is float and math.isfinite(v)


def _rates(v: Any) -> bool:
    return isinstance(v, Mapping) and all(isinstance(k, str) and _rate(x) for k, x in v.items())


def _metrics(v: Any) -> bool:  # means may be NaN (on_nan="ignore"); "skipped" is a count
    return isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(x, numbers.Real)
                                          and not isinstance(x, bool) for k, x in v.items())


# Each TrainingContext field's check and what it expects (the types the Trainer writes).
_CHECKS: dict[str, tuple[Any, str]] = {
    "step": (is_count, _COUNT), "sweep": (is_count, _COUNT),
    "samples_seen": (is_count, _COUNT), "minibatch_size": (is_count, _COUNT),
    "learning_rate": (lambda v: v is None or _rate(v), "a finite float or null"),
    "metrics": (_metrics, "an object of name: number"),
    "learning_rates": (_rates, "an object of name: finite float"),
}


def check_pending(pending: Any, where: str = "the restored job's trainer.pending") -> Any:
    """``pending`` (a checkpoint's ``trainer.pending``: JSON), checked field by field:
    :data:`BAD_PENDING` when its form is not a Trainer's, :data:`BAD_PENDING_FIELD` naming
    a context field of the wrong type or range (``where``: the checkpoint and its key)."""
    if pending is None:
        return None
    ok = (isinstance(pending, Mapping) and set(pending) == {"hook", "context", "done"}
          and pending["hook"] in _HOOKS and isinstance(pending["done"], list)
          and all(isinstance(k, str) for k in pending["done"]) and isinstance(pending["context"], Mapping)
          and set(pending["context"]) == _FIELDS)
    if not ok:
        raise CheckpointError(BAD_PENDING.format(where=where, given=repr(pending)[:200]))
    hook, context = pending["hook"], pending["context"]
    checks = {"event": (lambda v: v == _EVENTS[hook], repr(_EVENTS[hook])), **_CHECKS}
    for field, (check, expected) in checks.items():
        if not check(context[field]):
            raise CheckpointError(BAD_PENDING_FIELD.format(where=where, field=field, hook=hook,
                                                           given=repr(context[field])[:120], expected=expected))
    return pending


def _record(hook: str, ctx: TrainingContext, done: Sequence[str]) -> dict[str, Any]:
    return {"hook": hook, "context": dataclasses.asdict(ctx), "done": list(done)}


def call_hooks(trainer: Any, cbs: Sequence[Callback], hook: str, ctx: TrainingContext,
               done: Sequence[str] = ()) -> list[str]:
    """``hook(trainer, ctx)`` of each callback of ``cbs`` not named in ``done``
    (:func:`callback_keys`), in order; the names of those that completed it. A callback
    that raises leaves the round in ``trainer``'s job as ``pending``."""
    ran = list(done)
    if not cbs:
        return ran
    for key, cb in zip(callback_keys(cbs), cbs):
        if key in done:
            continue
        method = getattr(cb, hook)
        try:
            if method is not None:  # `on_log = None` in a subclass: the hook switched off
                method(trainer, ctx)
        except BaseException:
            trainer._job = trainer._job.replace(pending=_record(hook, ctx, ran))
            raise
        ran.append(key)
    return ran


def end_epoch(trainer: Any, cbs: Sequence[Callback], ctx: TrainingContext, done: Sequence[str] = ()) -> None:
    """The epoch's ``on_epoch_end`` round, then its checkpoints (a failed save is pending
    too: the next ``fit`` writes it)."""
    ran = call_hooks(trainer, cbs, "on_epoch_end", ctx, done)
    try:
        trainer._save_point("epoch", ctx)
    except BaseException:
        trainer._job = trainer._job.replace(pending=_record("on_epoch_end", ctx, ran))
        raise


def finish_pending(trainer: Any, cbs: Sequence[Callback]) -> None:
    """The rest of the round the job's ``pending`` records, with ``cbs`` (the fit's
    callbacks, matched by name as their saved states are)."""
    pending = trainer._job.position.pending
    if pending is None:
        return
    hook, ctx, done = _read(pending)
    trainer._job = trainer._job.replace(pending=None)  # (a checkpoint written from here on is past it)
    if hook == "on_epoch_end":
        end_epoch(trainer, cbs, ctx, done)
    else:
        call_hooks(trainer, cbs, hook, ctx, done)


def _read(pending: Any) -> tuple[str, TrainingContext, list[str]]:
    """``(hook, context, done)`` of a pending record (JSON read from a checkpoint: checked)."""
    check_pending(pending)
    ctx = TrainingContext(**{**pending["context"], "metrics": dict(pending["context"]["metrics"]),
                             "learning_rates": dict(pending["context"].get("learning_rates") or {})})
    return str(pending["hook"]), ctx, list(pending["done"])
