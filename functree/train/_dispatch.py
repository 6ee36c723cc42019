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
from collections.abc import Sequence
from typing import Any

from functree.train._callbacks import Callback, TrainingContext
from functree.train._job import callback_keys
from functree.train._pending import check_pending

__all__ = ["call_hooks", "check_pending", "end_epoch", "finish_pending"]

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
