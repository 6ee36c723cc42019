"""The job's state: one immutable record of everything a training job is at a step boundary.

:class:`JobState` is what a checkpoint holds and what ``trainer.restore`` reads back:
model, optimizer state (with its learning context and layer state), PRNG key, position
(steps, epoch, minibatch in the epoch, the data iterator's own position), the running
means, the history, the steps skipped, the stop flag, the callbacks' states and the
user's ``extra``. ``Trainer.fit`` advances it step by step, each step's results committed
in one assignment; callbacks read it as ``trainer.state``. Its checkpoint layout (format
2, written by :func:`save_job`, read by :func:`read_job`) is the one functree has written
since checkpoints carried the job: older Trainer checkpoints restore as they are.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from functree._alias import copy_aliases
from functree.train._history import History
from functree.train._means import Means
from functree.train._pending import check_pending, is_count
from functree.train.checkpoint._checkpoint import (
    OLD_OPTIMIZER_LAYOUT,
    Checkpoint,
    CheckpointManager,
)
from functree.train.checkpoint._frozen import frozen_keys
from functree.train.checkpoint._position import decode, encode
from functree.train.checkpoint._template import TemplateMismatch
from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["JobState", "Position", "ADDED", "OPTIMIZER_CHANGED", "is_count", "PLACED", "JOB_ATTRIBUTES", "add_readers", "refuse_taken", "position_json", "read_position", "save_job", "read_job", "callback_keys", "check_extra", "load_callbacks"]

BAD_EXTRA = """\
extra= must be a tree (dicts, lists, tuples, None) of arrays and plain numbers, but \
{path} is {given}.

    wrong:  trainer.save(path, extra={{"note": object()}})
    right:  trainer.save(path, extra={{"rounds": 3, "ema": ema_params, "data": np.asarray(position)}})"""

CALLBACK_MISMATCH = """\
The restored checkpoint holds the state of callback {key!r} ({cls}), but this fit's \
callbacks are {given}; the checkpoint's stateful callbacks are {saved}.
Pass the same callbacks as the run that saved it (in the same order, or each with the \
same callback.name), or restore without their states:

    right:  trainer.fit(data, epochs=10, callbacks=[ft.train.EarlyStopping(patience=6), checkpoints])
       or:  trainer.restore(path, callbacks=False)"""

OPTIMIZER_CHANGED = """\

This trainer's optimizer state is not the saved job's: its optimizer changed (another \
transform, schedule, wrt=, freeze or groups). Continue the saved model with this \
optimizer's fresh state, or build the trainer with the saved job's optimizer to continue \
its moments:

    wrong:  trainer.restore(path)                           # another optimizer than the job's
    right:  trainer.restore(path, optimizer_state=False)    # model, position and key; this optimizer's state"""

NOT_A_JOB = """\
{path} step {step} is a checkpoint of a model, not of a training job (it has no job \
position: it was written by CheckpointManager.save or ft.train.save, not by a Trainer).
Read it as a checkpoint, or continue its model in a Trainer:

    wrong:  ft.train.JobState.restore(path)
    right:  ft.train.CheckpointManager(path).restore().model
       or:  trainer.restore(path, optimizer_state=False)   # a Trainer continues its model (a fresh optimizer state)"""

MODEL_NOT_A_JOB = """\
{path} step {step} is a checkpoint of a model (written by CheckpointManager.save or \
ft.train.save, not by a Trainer): it holds no job position, and its step label {step} may \
count steps, epochs or anything. Restored with its optimizer state, the trainer would stand \
at step {step} of epoch 1 while the optimizer's own count says otherwise, and fit(epochs=N) \
would train N more epochs. Continue its model in a fresh job, or keep the loop that wrote it:

    wrong:  trainer.restore(path)
    right:  trainer.restore(path, optimizer_state=False)   # its model; this trainer's optimizer state, from step 0
       or:  ckpt = ft.train.CheckpointManager(path).restore(template=model, opt_state_template=opt_state)"""

UNSTORED_FIELD = """\
functree.train._job: Position's fields {missing} have no entry in STORED (and STORED's \
{extra} name no field). Each field of the position needs its key in a checkpoint's \
"trainer" config, its JSON form and its reader:

    wrong:  class Position(NamedTuple): ...; fit_calls: int = 0      # and nothing in STORED
    right:  STORED["fit_calls"] = (("fit_calls",), int, _count)   # a typed reader: converts nothing"""


NAME_TAKEN = """\
functree.train._job: {names} would be attributes of JobState twice: each Position field \
(and each field of JobState) is also an attribute of the job and of the Trainer, read from \
the record, so its name is not another field's, method's or stored key's ({taken}).

    wrong:  class Position(NamedTuple): ...; model: Any = None
    right:  class Position(NamedTuple): ...; model_version: int = 0"""


class Position(NamedTuple):
    """Where a job is: the half of :class:`JobState` a checkpoint stores as JSON, by name.

    ``steps_run``, ``epoch`` (completed), ``batch_in_epoch`` (minibatches of the current
    epoch consumed), ``stopped`` (a callback set ``trainer.stop_training``), ``since_log``
    (steps since the last log point), ``window`` and ``epoch_means`` (the running weighted
    means of the log window and of the epoch), ``skipped`` (``(step, what)`` of the steps
    ``on_nan="skip"`` left out), ``data_state`` (a positioned data iterator's
    ``get_state()``), ``epoch_length`` (minibatches per epoch, when known) and ``pending``
    (the rest of a round of callback hooks that one of them cut short by raising:
    ``_dispatch.py``).

    Written field by field from ``_asdict()`` (each under its key of :data:`STORED`) and
    read back by name, a field a checkpoint lacks taking its default: a field added here
    shifts no other's meaning, and older checkpoints (which lack it) still restore.

    Example:
      >>> from functree.train._job import Position, position_json, read_position
      >>> p = Position(steps_run=7, epoch=1, batch_in_epoch=3, since_log=2)
      >>> stored = position_json(p)
      >>> stored["steps_run"], stored["means"]["window"]["weight"]
      (7, 0.0)
      >>> read_position(stored, step=7) == p, read_position({}, step=5).steps_run
      (True, 5)
    """

    steps_run: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    stopped: bool = False
    since_log: int = 0
    window: Means = Means()
    epoch_means: Means = Means()
    skipped: tuple[tuple[int, str], ...] = ()
    data_state: Any = None
    epoch_length: int | None = None
    pending: Any = None


BAD_POSITION = """\
{where} is {given}, not {expected}: a Trainer writes {expected} there, so the checkpoint's \
metadata was changed after it was written. Nothing is converted: restore another checkpoint.

    wrong:  "epoch": 1.7   (or "stopped": "false", "epoch": -3, ...)
    right:  trainer.restore(manager, step=manager.all_steps()[-2])"""

PAST_EPOCH_END = """\
{where}: trainer.batch_in_epoch is {batch}, more than {limits}: past the end of its epoch \
or of its job. A Trainer's position has 0 <= batch_in_epoch <= epoch_length and \
batch_in_epoch <= steps_run, so the checkpoint's metadata was changed after it was \
written (or, past epoch_length only, the data's len() said fewer minibatches than it gave). \
Nothing is restored: the next fit would end the epoch at once, its other minibatches unseen.

    wrong:  "batch_in_epoch": 5, "epoch_length": 2
    right:  trainer.restore(manager, step=manager.all_steps()[-2])
       or:  data whose len() is the number of minibatches it gives, for the next job"""

UNKNOWN_KEYS = """\
{where}: {paths} {are} not part of a Trainer checkpoint that functree {version} reads: the \
checkpoint was written by a newer functree (a field this version does not know, which \
restoring without it would silently drop), or its metadata was changed after it was \
written. Nothing is restored with it ignored.

    wrong:  trainer.restore(path)   # a newer functree's checkpoint, with functree {version}
    right:  pip install --upgrade functree   # then trainer.restore(path)
       or:  trainer.restore(manager, step=manager.all_steps()[-2])   # another checkpoint"""


def refuse(where: str, value: Any, expected: str) -> CheckpointError:
    """:data:`BAD_POSITION` for a tampered value of a checkpoint's ``"trainer"`` config."""
    return CheckpointError(BAD_POSITION.format(where=where, given=repr(value)[:120], expected=expected))


def _count(saved: Any, where: str) -> int:
    if not is_count(saved):
        raise refuse(where, saved, "an int, 0 <= n < 2**63")
    return saved


def _flag(saved: Any, where: str) -> bool:
    if type(saved) is not bool:
        raise refuse(where, saved, "true or false")
    return saved


def _length(saved: Any, where: str) -> int | None:
    if saved is not None and not (is_count(saved) and saved > 0):
        raise refuse(where, saved, "an int > 0 or null")
    return saved


def _means(saved: Any, where: str) -> Means:
    try:
        return Means.from_json(saved)
    except ValueError:
        raise refuse(where, saved, Means.FORM) from None


def _skipped(saved: Any, where: str) -> tuple[tuple[int, str], ...]:
    if not isinstance(saved, list) or not all(
            isinstance(x, list) and len(x) == 2 and is_count(x[0]) and isinstance(x[1], str) for x in saved):
        raise refuse(where, saved, "a list of [step (an int >= 0), what (a string)] pairs")
    return tuple((s, w) for s, w in saved)


def _same(saved: Any, where: str) -> Any:
    return saved


def _data_state(saved: Any, where: str) -> Any:
    # decode names a damaged tag as "<checkpoint>: data_state[...]" (its wording since tags existed)
    return decode(saved, where.replace(": trainer.data_state", ": data_state"))


# Each Position field's key path in a checkpoint's "trainer" config (format 2's keys, as
# the Trainer has always written them), its JSON form and its reader (typed: a value the
# Trainer would not have written is refused, never converted).
STORED: dict[str, tuple[tuple[str, ...], Callable[[Any], Any], Callable[[Any, str], Any]]] = {
    "steps_run": (("steps_run",), int, _count),
    "epoch": (("epoch",), int, _count),
    "batch_in_epoch": (("batch_in_epoch",), int, _count),
    "stopped": (("stopped",), bool, _flag),
    "since_log": (("since_log",), int, _count),
    "window": (("means", "window"), Means.to_json, _means),
    "epoch_means": (("means", "epoch"), Means.to_json, _means),
    "skipped": (("skipped",), lambda s: [list(x) for x in s], _skipped),
    "data_state": (("data_state",), encode, _data_state),
    "epoch_length": (("epoch_length",), lambda n: n, _length),
    "pending": (("pending",), lambda p: p, check_pending),
}


def _known_keys() -> dict[str, Any]:
    """The keys of a checkpoint's ``"trainer"`` config a Trainer writes, as a tree (None:
    a value): :data:`STORED`'s paths, with ``on_nan`` and ``history`` (read by read_job)."""
    tree: dict[str, Any] = dict.fromkeys(("on_nan", "history"))
    for path, _, _ in STORED.values():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = None
    return tree


KNOWN_KEYS = _known_keys()


def unknown_keys(saved: Mapping[str, Any], known: Mapping[str, Any] = KNOWN_KEYS, at: str = "trainer") -> list[str]:
    """The key paths of ``saved`` (a ``"trainer"`` config) that :data:`KNOWN_KEYS` lacks,
    nested objects included (a value of the wrong type is read_position's to name)."""
    found = [f"{at}.{key}" for key in saved if key not in known]
    for key, inner in known.items():
        if inner is not None and isinstance(saved.get(key), Mapping):
            found += unknown_keys(saved[key], inner, f"{at}.{key}")
    return found


def check_known(saved: Mapping[str, Any], where: str) -> None:
    """:data:`UNKNOWN_KEYS` for a ``"trainer"`` config with a key this version does not
    read: its value would be dropped, and the job it belongs to restored without it."""
    paths = unknown_keys(saved)
    if paths:
        raise CheckpointError(UNKNOWN_KEYS.format(where=where, paths=", ".join(paths),
                                                  are="is" if len(paths) == 1 else "are", version=_version()))


def _version() -> str:
    """functree's installed version (its distribution's metadata: importing the package from
    here would make a circle, ``functree`` imports this module)."""
    try:
        return importlib.metadata.version("functree")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def check_in_epoch(position: Position, where: str) -> None:
    """:data:`PAST_EPOCH_END` for a position past its epoch's end (``batch_in_epoch >
    epoch_length``) or with more minibatches in its epoch than steps in its job."""
    batch, length, steps = position.batch_in_epoch, position.epoch_length, position.steps_run
    limits = [f"trainer.{name} ({n})" for name, n in (("epoch_length", length), ("steps_run", steps))
              if n is not None and batch > n]
    if limits:
        raise CheckpointError(PAST_EPOCH_END.format(where=where, batch=batch, limits=" and ".join(limits)))


def check_stored(fields: Sequence[str]) -> None:
    """Every position field has its place in a checkpoint (checked at import: a field
    added without one would be silently dropped by every save)."""
    if set(STORED) != set(fields):
        raise TypeError(UNSTORED_FIELD.format(missing=sorted(set(fields) - set(STORED)),
                                              extra=sorted(set(STORED) - set(fields))))


check_stored(Position._fields)


# The order of format 2's "trainer" keys as the Trainer wrote them before the record
# existed (the JSON keeps it: a checkpoint written now lists them as an older one does).
FORMAT_2_ORDER = ("steps_run", "epoch", "batch_in_epoch", "on_nan", "stopped", "epoch_length", "since_log",
                  "data_state", "means", "history", "skipped")


def position_json(position: Position) -> dict[str, Any]:
    """``position`` as the JSON of a checkpoint's ``"trainer"`` config, field by field."""
    out: dict[str, Any] = {}
    for name, value in position._asdict().items():
        path, to_json, _ = STORED[name]
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = to_json(value)
    return out


def read_position(saved: Mapping[str, Any], step: int, where: str = "the checkpoint") -> Position:
    """The :class:`Position` :func:`position_json` wrote, by name; a field ``saved`` lacks
    takes its default (``steps_run``: the checkpoint's ``step``, which a stored one must
    equal). A value of the wrong type or range, a key this version does not know (a newer
    functree's field) or a position past its epoch's end is a :class:`CheckpointError`
    naming ``where`` (the checkpoint) and its key (``trainer.<key>``)."""
    if not isinstance(saved, Mapping):
        raise refuse(f"{where}: trainer", saved, "a JSON object")
    check_known(saved, where)
    read: dict[str, Any] = {"steps_run": step}
    for name, (path, _, from_json) in STORED.items():
        node: Any = saved
        for depth, key in enumerate(path):
            if not isinstance(node, Mapping):  # e.g. "means": [] (a missing "means" reads the defaults)
                raise refuse(f"{where}: trainer.{'.'.join(path[:depth])}", node, "a JSON object")
            node = node.get(key, _MISSING)
            if node is _MISSING:
                break
        if node is not _MISSING:
            read[name] = from_json(node, f"{where}: trainer.{'.'.join(path)}")
    if read["steps_run"] != step:
        raise refuse(f"{where}: trainer.steps_run", read["steps_run"], f"the checkpoint's step ({step})")
    position = Position(**read)
    check_in_epoch(position, where)
    return position


_MISSING = object()


class JobState(NamedTuple):
    """A training job at a step boundary: ``trainer.state``, and what a checkpoint holds.

    A value (a named tuple, replaced, never changed): ``Trainer.fit`` commits each step's
    outputs as a new record (``steps_run``, ``batch_in_epoch`` and ``since_log`` advanced),
    each log interval's means as another; ``trainer.model``, ``trainer.epoch``, ... read the
    current one. ``history`` is the one member that grows in place (a row per step; copying
    it every read would cost O(steps)). The history and the means lag the steps by up to
    two log intervals between reads; at save points, epoch ends and the end of ``fit``
    everything has been read.

    Fields: ``model``, ``opt_state`` (with the learning context), ``key``, ``history``,
    ``position`` (a :class:`Position`: ``steps_run``, ``epoch``, ``batch_in_epoch``,
    ``stopped``, ``since_log``, ``window``, ``epoch_means``, ``skipped``, ``data_state``,
    ``epoch_length``, each also readable as an attribute of the job), ``extra`` (the user's
    tree) and ``callbacks`` (``(name, class, state)`` of each stateful callback: filled by
    a save and a restore, handed to the next ``fit``'s callbacks). ``job.replace(**changes)``
    changes fields of either by name.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, numpy as np, tempfile
      >>> x = np.ones((8, 2), np.float32)
      >>> trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
      ...                            lambda m, b: jnp.mean(m(b) ** 2))
      >>> _ = trainer.fit(ft.train.batches(x, 4), steps=3, progress=False)
      >>> state = trainer.state
      >>> state.steps_run, state.epoch, state.batch_in_epoch, len(state.history.steps["loss"])
      (3, 1, 1, 3)
      >>> state.replace(epoch=5, extra=1).position.epoch
      5
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> trainer.save(path, extra={"rounds": 3})
      >>> saved = ft.train.JobState.restore(path)  # a checkpoint is a JobState
      >>> saved.steps_run, saved.extra, saved.model.weight.shape
      (3, {'rounds': 3}, (2, 1))
    """

    model: Any
    opt_state: Any
    key: Any
    history: History
    position: Position = Position()
    extra: Any = None
    callbacks: tuple[tuple[str, str, Any], ...] | None = None

    if TYPE_CHECKING:  # the position's fields, read from the job: properties made from Position._fields below
        def __getattr__(self, name: str) -> Any: ...

    @staticmethod
    def start(model: Any, opt_state: Any, key: Any = None) -> JobState:
        """A job before its first step (with its own empty history)."""
        return JobState(model, opt_state, key, History())

    def replace(self, **changes: Any) -> JobState:
        """This job with the named fields changed: the job's own (``model``, ``extra``, ...)
        and its position's (``steps_run``, ``window``, ...); an unknown name is an error."""
        moved = {name: changes.pop(name) for name in Position._fields if name in changes}
        if moved:
            changes["position"] = self.position._replace(**moved)
        return self._replace(**changes)

    def stepped(self, model: Any, opt_state: Any, n: int) -> JobState:
        """The commit of ``n`` steps: their outputs, the position ``n`` further (as
        ``replace(model=, opt_state=, steps_run=+n, batch_in_epoch=+n, since_log=+n)``;
        the loop's one per-call cost, so built from the fields' indices, found by name
        once: about 0.9 us, as the positional tuple it replaces (0.8 us), where ``_replace``
        calls take several)."""
        position: list[Any] = list(self.position)
        position[_STEPS] += n
        position[_BATCH] += n
        position[_SINCE_LOG] += n
        job = list(self)
        job[_MODEL], job[_OPT_STATE], job[_POSITION] = model, opt_state, tuple.__new__(Position, position)
        return tuple.__new__(JobState, job)

    @staticmethod
    def restore(source: CheckpointManager | str, step: int | None = None, *, like: JobState | None = None) -> JobState:
        """The job a Trainer checkpoint holds (default: the latest step of ``source``, a
        path or a :class:`CheckpointManager`). ``like`` (a job, e.g. ``trainer.state``)
        gives the templates its model and optimizer state are checked against; without
        it they are rebuilt from the checkpoint's type information."""
        if not isinstance(source, CheckpointManager):
            with CheckpointManager(source) as owned:
                return JobState.restore(owned, step, like=like)
        job, ckpt = read_job(source, step, like or JobState.start(None, None))
        if "trainer" not in ckpt.config:
            raise ValueError(NOT_A_JOB.format(path=source.directory, step=ckpt.step))
        return job


# The fields format 2 stores in places of their own (the model's and optimizer state's
# arrays, the key, the user's extra, the callbacks' states; history and position as JSON).
# Any other field of JobState is stored by name among the checkpoint's arrays (save_job's
# extra, next to "key", "user" and "callbacks") and read back by name, a checkpoint without
# it giving like's value: a field added to JobState is its one line.
FORMAT_2_FIELDS = ("model", "opt_state", "key", "history", "position", "extra", "callbacks")
ADDED = tuple(name for name in JobState._fields if name not in FORMAT_2_FIELDS)
# The fields that are host values (JSON, the user's and the callbacks' trees as given): the
# others are the job's arrays, committed where the model lives (a restore places them).
HOST_FIELDS = ("history", "position", "extra", "callbacks")
PLACED = tuple(name for name in JobState._fields if name not in HOST_FIELDS)
# The names a job exposes read from the record (JobState's properties, the Trainer's job_field).
JOB_ATTRIBUTES = Position._fields + ADDED


def refuse_taken(names: Sequence[str], taken: Sequence[str]) -> None:
    """:data:`NAME_TAKEN` for the names of ``names`` in ``taken`` (checked at import)."""
    clash = sorted(set(names) & set(taken))
    if clash:
        raise TypeError(NAME_TAKEN.format(names=clash, taken=", ".join(sorted(taken))))


def add_readers(cls: type, names: Sequence[str], reader: Callable[[str], Any]) -> None:
    """Give ``cls`` one property ``reader(name)`` per name of ``names`` that ``cls`` does
    not define itself (its own definition, with its doc or its form, wins)."""
    for name in names:
        if not any(name in vars(base) for base in cls.__mro__ if base is not object):
            setattr(cls, name, reader(name))


def _position_reader(name: str) -> property:
    return property(attrgetter(f"position.{name}"), doc=f"``position.{name}`` (:class:`Position`).")


# Each position field read from the job, as before the record existed (one attrgetter each).
refuse_taken(Position._fields, [name for name in dir(JobState) if not name.startswith("_")])
refuse_taken(ADDED, ("user",))  # save_job's key of the user's extra
add_readers(JobState, Position._fields, _position_reader)


# The fields stepped() writes, by name (a field inserted anywhere moves these with it).
_STEPS, _BATCH, _SINCE_LOG = map(Position._fields.index, ("steps_run", "batch_in_epoch", "since_log"))
_MODEL, _OPT_STATE, _POSITION = map(JobState._fields.index, ("model", "opt_state", "position"))


SAVED_ALREADY = """\
trainer.save: {path} already holds a checkpoint at step {step} (a ModelCheckpoint of this \
run, or an earlier save, wrote it). Nothing was overwritten. The trainer's job may differ \
from it (EarlyStopping(restore_best=True) sets the best epoch's model back at the end of \
fit; a callback may have changed the model): save it beside the run's checkpoints.

    wrong:  trainer.save("{path}")
    right:  trainer.save("{path}-final")
       or:  ft.train.CheckpointManager("{path}").delete({step}); trainer.save("{path}")   # replace it
"""


def check_new_step(manager: CheckpointManager, step: int) -> None:
    """:data:`SAVED_ALREADY` when ``manager``'s directory holds ``step`` (``trainer.save``)."""
    if step in manager.all_steps():
        raise CheckpointError(SAVED_ALREADY.format(path=os.fspath(manager.directory), step=step))


def save_job(manager: CheckpointManager, job: JobState, callbacks: Sequence[Any] | None = None, *,
             metrics: Mapping[str, Any] | None = None, about: Mapping[str, Any] | None = None,
             trained: Sequence[str] | None = None) -> None:
    """Write ``job`` as the checkpoint labelled ``job.steps_run`` (format 2: the arrays of
    model, optimizer state, key, ``extra`` and callback states; the position (by name,
    :func:`position_json`), the history and ``about`` as JSON in its config), with the
    states of ``callbacks`` (default: ``job.callbacks``). ``about``: ``on_nan`` and
    descriptions of the optimizer and the step. ``trained``: the optimizer's ``wrt=``
    patterns; the parameters they leave frozen are stored as fingerprints only
    (``functree.train.checkpoint._frozen``)."""
    about = dict(about or {})
    saved = callback_states(callbacks) if callbacks is not None else job.callbacks or ()
    history = job.history
    stored = {**position_json(job.position), "on_nan": about.pop("on_nan", None),
              "history": {"steps": history.steps, "epochs": history.epochs}}
    trainer = {key: stored.pop(key) for key in FORMAT_2_ORDER} | stored  # a new field: last
    config = {"trainer": trainer, "callbacks": [[key, cls] for key, cls, _ in saved], **about}
    manager.save(job.steps_run, job.model, job.opt_state, metrics=metrics, config=config,
                 frozen=frozen_keys(job.model, trained),  # wrt= trains a subset: the base stays out
                 extra={"key": job.key, "user": job.extra, "callbacks": [state for _, _, state in saved],
                        **{name: getattr(job, name) for name in ADDED}})


def read_job(manager: CheckpointManager, step: int | None, like: JobState, *, optimizer_state: bool = True,
             callbacks: bool = True, placement: Any = None) -> tuple[JobState, Checkpoint]:
    """``(job, checkpoint)`` read from ``manager`` at ``step`` (default: the latest).

    The model and optimizer state are checked against ``like``'s (key path, shape,
    dtype); ``optimizer_state=False`` keeps ``like``'s optimizer state; ``callbacks=False``
    leaves the saved callback states unread (``extra_template={"callbacks":
    CheckpointManager.SKIP}``). A Module of the model's class in ``extra`` (the best model
    of ``EarlyStopping(restore_best=True)``) is read with ``like``'s model as its template,
    as the model is (``CheckpointManager.restore``): a class edited since the save reads in
    both. What a checkpoint lacks (the key, the history of a checkpoint written without
    one, a position field) is ``like``'s or the default. ``placement``: a step's mesh
    placement (arrays read straight into their shards)."""
    include = ("model", "opt_state", "extra") if optimizer_state else ("model", "extra")
    placed = {} if placement is None else {"mesh": placement.mesh, "sharding": placement.sharding,
                                           "data_axis": placement.data_axis}
    try:
        ckpt = manager.restore(step, template=like.model, opt_state_template=like.opt_state,
                               extra_template=None if callbacks else {"callbacks": CheckpointManager.SKIP},
                               include=include, **placed)
    except TemplateMismatch as e:  # the optimizer changed: the trainer's own fix, after the reader's
        if e.part != "opt_state" or OLD_OPTIMIZER_LAYOUT in str(e):  # an older layout: its own fix
            raise
        raise TemplateMismatch(str(e) + OPTIMIZER_CHANGED, e.part) from None
    opt_state = ckpt.opt_state if optimizer_state else like.opt_state
    model, opt_state = copy_aliases((ckpt.model, opt_state))
    where = f"{manager.directory} step {ckpt.step}"
    trainer = ckpt.config.get("trainer", {}) if isinstance(ckpt.config, Mapping) else None
    if not isinstance(trainer, Mapping):
        raise refuse(f"{where}: trainer", trainer, "a JSON object")
    history = read_history(trainer["history"], where) if "history" in trainer else like.history
    extra = ckpt.extra if isinstance(ckpt.extra, Mapping) else {}
    names = ckpt.config.get("callbacks", [])
    states = tuple((key, cls, state) for (key, cls), state in zip(names, extra.get("callbacks", [])))
    position = read_position(trainer, ckpt.step, where)
    added = {name: extra[name] if extra.get(name) is not None else getattr(like, name) for name in ADDED}
    job = JobState(model, opt_state, extra["key"] if extra.get("key") is not None else like.key, history,
                   position, extra=extra.get("user"), callbacks=states if callbacks else None, **added)
    return job, ckpt


def read_history(saved: Any, where: str) -> History:
    """The :class:`History` of a checkpoint's ``trainer.history``: per table (``steps``,
    ``epochs``) columns that are lists of numbers or nulls, each as long as its index
    column (``step``, ``epoch``: ints); anything else is refused (a short column would
    put the next values on the wrong steps)."""
    if not isinstance(saved, Mapping) or set(saved) != {"steps", "epochs"}:
        raise refuse(f"{where}: trainer.history", saved, 'a JSON object {"steps": {...}, "epochs": {...}}')
    return History(steps=_table(saved["steps"], "step", f"{where}: trainer.history.steps"),
                   epochs=_table(saved["epochs"], "epoch", f"{where}: trainer.history.epochs"))


def _table(saved: Any, index: str, where: str) -> dict[str, list[Any]]:
    if not isinstance(saved, Mapping) or not isinstance(saved.get(index), list):
        raise refuse(where, saved, f'a JSON object of columns with an index column "{index}"')
    if not all(is_count(i) for i in saved[index]):
        raise refuse(f"{where}.{index}", saved[index], "a list of ints >= 0")
    rows = len(saved[index])
    for name, column in saved.items():
        if not (isinstance(column, list) and len(column) == rows and all(
                v is None or type(v) in (int, float) for v in column)):
            raise refuse(f"{where}[{name!r}]", column, f"a list of {rows} numbers or nulls (one per {index})")
    return {str(name): list(column) for name, column in saved.items()}


def callback_keys(cbs: Sequence[Any]) -> list[str]:
    """Each callback's name for its saved state: ``name``, else ``Class[i]`` (the i-th of its class)."""
    counts: dict[str, int] = {}
    keys = []
    for cb in cbs:
        cls = type(cb).__name__
        if cb.name:
            keys.append(str(cb.name))
        else:
            keys.append(f"{cls}[{counts.get(cls, 0)}]")
            counts[cls] = counts.get(cls, 0) + 1
    return keys


def callback_states(cbs: Sequence[Any]) -> tuple[tuple[str, str, Any], ...]:
    """``(name, class, state)`` of each callback with a state (for a checkpoint)."""
    return tuple((key, type(cb).__name__, state) for key, cb in zip(callback_keys(cbs), cbs)
                 if (state := cb.state_dict()))


def load_callbacks(saved: Sequence[tuple[str, str, Any]], cbs: Sequence[Any]) -> None:
    """Every saved callback state to its callback (matched by name, else class and
    position); a saved state with no such callback is an error naming both lists."""
    given = dict(zip(callback_keys(cbs), cbs))
    for key, cls, _ in saved:
        cb = given.get(key)
        if cb is None or type(cb).__name__ != cls:
            raise ValueError(CALLBACK_MISMATCH.format(
                key=key, cls=cls, saved=[f"{k} ({c})" for k, c, _ in saved],
                given=[f"{k} ({type(c).__name__})" for k, c in given.items()] or "none"))
    for key, _, state in saved:
        given[key].load_state_dict(state)


_PLAIN = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def check_extra(extra: Any) -> None:
    """``extra`` is a tree of arrays and plain numbers (what a checkpoint can hold)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(extra)[0]:
        if not isinstance(leaf, _PLAIN) or (isinstance(leaf, np.ndarray) and leaf.dtype.hasobject):
            where = f"extra{jax.tree_util.keystr(path)}" if path else "extra"
            raise TypeError(BAD_EXTRA.format(path=where, given=f"{type(leaf).__name__} {repr(leaf)[:60]}"))


def own_copy(tree: Any) -> Any:
    """A copy whose arrays are its own (the training step donates the job's buffers): a
    buffer copy in place, committed as the original (``jnp.copy`` compiled one program per
    leaf shape: 8 on a tiny Llama at a Trainer's start and again at EarlyStopping's first
    best)."""
    return jax.tree.map(lambda x: jax.device_put(x, may_alias=False) if isinstance(x, jax.Array) else x, tree)
