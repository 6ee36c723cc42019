"""The rest of a round of callback hooks that one of them cut short, as a checkpoint stores
it (a job's ``pending`` entry): its check when a job is read (every field of the form a
Trainer writes, nothing converted). :mod:`._dispatch` runs the round; this module is what
:mod:`._job` reads it with (it imports neither the callbacks nor the job).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["check_pending", "is_count", "CONTEXT_FIELDS"]

_INT64 = 2**63


def is_count(value: Any) -> bool:
    """``value`` is an int (not a bool), ``0 <= value < 2**63``: a step, an epoch, a count."""
    return type(value) is int and 0 <= value < _INT64


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
# TrainingContext's fields (named, not imported: _callbacks imports _job, which reads this;
# tests/test_train_dispatch.py keeps the two equal).
CONTEXT_FIELDS = frozenset({"event", "step", "sweep", "samples_seen", "minibatch_size", "learning_rate",
                            "metrics", "learning_rates"})
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
          and set(pending["context"]) == CONTEXT_FIELDS)
    if not ok:
        raise CheckpointError(BAD_PENDING.format(where=where, given=repr(pending)[:200]))
    hook, context = pending["hook"], pending["context"]
    checks = {"event": (lambda v: v == _EVENTS[hook], repr(_EVENTS[hook])), **_CHECKS}
    for field, (check, expected) in checks.items():
        if not check(context[field]):
            raise CheckpointError(BAD_PENDING_FIELD.format(where=where, field=field, hook=hook,
                                                           given=repr(context[field])[:120], expected=expected))
    return pending
