"""Logging callbacks: the training record to a CSV file or to TensorBoard event files.

Both write what callbacks see (:class:`TrainingContext`): the metric means of a log
interval or an epoch (``val_*`` at epoch ends, ``skipped`` under ``on_nan="skip"``) and
the learning rates (``learning_rate``, or one ``"<group>/learning_rate"`` per parameter
group), against the training step. In a multi-process job only process 0 writes. A run
resumed from a checkpoint at step ``s`` first drops what an earlier run wrote past ``s``
(that work was lost with the interruption and is done again), so the file equals the
uninterrupted run's.
"""

from __future__ import annotations

import csv
import importlib
import itertools
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from functree._files import local_path
from functree.train._built import Settings
from functree.train._callbacks import REQUIRED, Callback, TrainingContext, foreign_keyword, missing

if TYPE_CHECKING:
    from functree.train._trainer import Trainer

__all__ = ["CSVLogger", "TensorBoardLogger", "close_event_files"]

BAD_EVERY = """\
{who}(every={every!r}): every is "epoch" (a row per epoch end) or "log" (a row per log interval).
    right:  ft.train.{who}(path, every="epoch")"""

NO_TENSORBOARDX = """\
ft.train.TensorBoardLogger writes event files with tensorboardX, which is not installed \
({error}).

    right:  pip install "functree[tensorboard]"       # or: pip install tensorboardX"""

NOT_A_LOG = """\
CSVLogger({path!s}, append=True): the file exists but is not a CSV log with a "step" \
column (its header is {header}).

    wrong:  ft.train.CSVLogger("data.csv", append=True)
    right:  ft.train.CSVLogger("log.csv", append=True)    # a file a CSVLogger wrote
       or:  ft.train.CSVLogger("data.csv")                # append=False: start it anew"""


_WRITERS = itertools.count()
"""Numbers the event files this process opens: tensorboardX names a file by the second
and the host, so two opened within a second in one directory would be one file. Written
zero-padded: TensorBoard reads a directory's files in name order, and a purge applies to
the files read before it (".10" would sort before ".9")."""


def _epoch_end_pending(trainer: Trainer) -> bool:
    """Whether ``trainer``'s next fit first ends the epoch whose last step it is at (its
    checkpoint was written at that step, before the epoch's end: ``Trainer.fit``'s
    ``end_pending``), writing that epoch's record at ``trainer.steps_run`` again."""
    job = trainer.state
    return job.epoch_length is not None and 0 < job.epoch_length <= job.batch_in_epoch and not job.stopped


def _records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (an event file): each is an 8-byte length, its
    4-byte checksum, the record and its 4-byte checksum; a record cut short (a writer
    killed mid-write) ends the file, as TensorBoard reads it."""
    raw, at = path.read_bytes(), 0
    while at + 12 <= len(raw):
        (length,) = struct.unpack_from("<Q", raw, at)
        if at + 16 + length > len(raw):
            return
        yield raw[at + 12:at + 12 + length]
        at += 16 + length


def scalars_at(logdir: Path, step: int) -> list[tuple[str, float, float]]:
    """``(tag, value, wall_time)`` of each scalar at ``step`` that TensorBoard shows from
    ``logdir``'s event files: read in name order (as TensorBoard does), a
    ``SessionLog.START`` event at step ``p`` (a writer's ``purge_step``) dropping every
    point read before it at steps >= ``p``."""
    from google.protobuf.message import DecodeError

    event_pb2: Any = importlib.import_module("tensorboardX.proto.event_pb2")  # generated: no stubs

    points: dict[str, tuple[float, float]] = {}
    for path in sorted(logdir.glob("*tfevents*")):
        try:
            for record in _records(path):
                event = event_pb2.Event.FromString(record)
                if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                    if event.step <= step:
                        points.clear()
                elif event.step == step:
                    points.update({v.tag: (v.simple_value, event.wall_time) for v in event.summary.value
                                   if v.WhichOneof("value") == "simple_value"})
        except (OSError, DecodeError):  # unreadable: TensorBoard shows nothing of it either
            continue
    return [(tag, value, wall) for tag, (value, wall) in points.items()]


def _check_every(who: str, every: str) -> str:
    if every not in ("epoch", "log"):
        raise ValueError(BAD_EVERY.format(who=who, every=every))
    return every


def _record(context: TrainingContext) -> dict[str, Any]:
    """The values of one row: epoch, step, learning rates, metrics (in that order)."""
    return {"epoch": context.sweep, "step": context.step, **context.learning_rates, **context.metrics}


class CSVLogger(Settings, Callback):
    """Write a CSV row at every epoch end (``every="epoch"``, default) or log interval
    (``every="log"``): ``epoch``, ``step``, the learning rate(s), then the metrics.

    Values are written exactly (Python's shortest round-tripping form), so reading the
    file back gives the history's numbers. A column first seen later (``val_*`` of a
    first validation) extends the header; earlier rows leave it empty. ``append=False``
    (default) starts the file anew at this logger's first ``fit`` of a new job (a trainer
    that has run no step and was not restored); ``append=True``, or a first ``fit`` of a
    job that has run steps (after ``trainer.restore``, the restart recipe, or after a fit
    before it: a notebook cell run again makes a new logger), continues an existing file,
    first dropping rows past the trainer's step, so the file holds each of the job's rows
    once, as the uninterrupted job's does.

    Example:
      >>> import csv, tempfile, functree as ft, jax.numpy as jnp, numpy as np
      >>> x = np.linspace(-1, 1, 8, dtype=np.float32)[:, None]
      >>> loss_fn = lambda m, b: jnp.mean((b[0] * m["w"] - b[1]) ** 2)
      >>> trainer = ft.train.Trainer({"w": jnp.zeros(1)}, ft.optim.sgd(0.5), loss_fn)
      >>> path = tempfile.mkdtemp() + "/log.csv"
      >>> h = trainer.fit(ft.train.batches((x, 2 * x), 4), epochs=2, progress=False,
      ...                 callbacks=[ft.train.CSVLogger(path)])
      >>> with open(path) as f:
      ...     rows = list(csv.DictReader(f))
      >>> list(rows[0]), [float(r["loss"]) for r in rows] == h["loss"]
      (['epoch', 'step', 'learning_rate', 'loss'], True)
    """

    reads_model = False  # the context alone: the Trainer keeps its one-interval-late read
    # What it reads as set; any other name assigned is refused (Settings), its constructor's named.
    path: Path
    every: str
    append: bool
    _NAMED = "callback"
    _ARGUMENTS = (("__init__", "callback = ft.train.CSVLogger(path, {})"),)

    def __init__(self, path: str | os.PathLike[str] = REQUIRED, *, every: str = "epoch", append: bool = False,
                 **unknown: Any):
        if unknown:
            raise foreign_keyword("CSVLogger", unknown, CSVLogger.__init__)
        if path is REQUIRED:
            raise missing("CSVLogger", "path")
        self.path = local_path(path)  # ~ expanded; a later chdir moves nothing
        self.every = _check_every("CSVLogger", every)
        self.append = append
        self._columns: list[str] | None = None
        self._started = False

    def on_train_begin(self, trainer: Trainer) -> None:
        if jax.process_index() != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A new job starts the file anew; one that has run steps (restored, or fit before:
        # a notebook cell that makes its logger run again) continues it, as its history does.
        if not self._started and not self.append and trainer.checkpoint is None and not trainer.steps_run:
            self.path.write_text("")
            self._columns = None
        elif self.path.exists():
            columns, rows = self._read()
            # Rows past the trainer's step, and an epoch's record the restored job has still
            # to write (a checkpoint at an epoch's last step is written before its end).
            kept = [r for r in rows if int(r["step"]) <= trainer.steps_run
                    and not (r.get("epoch") and int(r["epoch"]) > trainer.epoch)]
            if len(kept) < len(rows):
                self._rewrite(columns, kept)
            self._columns = columns
        self._started = True

    def _read(self) -> tuple[list[str] | None, list[dict[str, str]]]:
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = None if reader.fieldnames is None else list(reader.fieldnames)
        if columns is not None and "step" not in columns:
            raise ValueError(NOT_A_LOG.format(path=self.path, header=columns))
        return columns, rows

    def _rewrite(self, columns: list[str] | None, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            if columns is not None:
                writer = csv.DictWriter(f, columns, restval="")
                writer.writeheader()
                writer.writerows(rows)
        os.replace(tmp, self.path)  # atomic: an interruption leaves the old file or the new

    def _write(self, context: TrainingContext) -> None:
        if jax.process_index() != 0:
            return
        row = _record(context)
        if self._columns is None or any(k not in self._columns for k in row):
            columns = list(self._columns or []) + [k for k in row if k not in (self._columns or [])]
            rows = self._read()[1] if self._columns is not None and self.path.exists() else []
            self._rewrite(columns, rows)
            self._columns = columns
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self._columns, restval="").writerow(row)

    def on_log(self, trainer: Trainer, context: TrainingContext) -> None:
        if self.every == "log":
            self._write(context)

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        if self.every == "epoch":
            self._write(context)


class TensorBoardLogger(Settings, Callback):
    """Scalars to TensorBoard event files in ``logdir`` (through ``tensorboardX``, the
    ``tensorboard`` extra: imported when a logger is made).

    At every log interval each metric mean and learning rate is written as
    ``"step/<name>"``, at every epoch end each epoch mean and validation metric as
    ``"epoch/<name>"`` (``"step/head/learning_rate"`` for a parameter group), all
    against the training step. A fit that starts at step ``s`` tells TensorBoard to drop
    what an earlier run wrote past ``s`` (tensorboardX's ``purge_step``): a restored job's
    later steps, and at ``s = 0`` (a new job in a used ``logdir``: a notebook's Trainer cell
    run again) every point, as a CSVLogger starts its file anew; one that first ends the epoch whose last step is ``s`` (a checkpoint
    written at that step, before the epoch's end) drops ``s``'s points too and writes
    them again (the epoch's anew, the others as the earlier run wrote them), so each tag
    has one point per step, as in the uninterrupted run. ``every`` limits it to ``"log"``
    or ``"epoch"`` records.

    Example:
      >>> import functree as ft, tempfile
      >>> logger = ft.train.TensorBoardLogger(tempfile.mkdtemp() + "/runs/exp1")
    """

    reads_model = False  # the context alone: the Trainer keeps its one-interval-late read
    # What it reads as set; any other name assigned is refused (Settings), its constructor's named.
    logdir: Path
    every: str | None
    _NAMED = "callback"
    _ARGUMENTS = (("__init__", "callback = ft.train.TensorBoardLogger(logdir, {})"),)

    def __init__(self, logdir: str | os.PathLike[str] = REQUIRED, *, every: str | None = None, **unknown: Any):
        if unknown:
            raise foreign_keyword("TensorBoardLogger", unknown, TensorBoardLogger.__init__)
        if logdir is REQUIRED:
            raise missing("TensorBoardLogger", "logdir")
        try:
            import tensorboardX
        except ImportError as e:
            raise ImportError(NO_TENSORBOARDX.format(error=e)) from None
        self._writer_class = tensorboardX.SummaryWriter
        self.logdir = local_path(logdir)
        self.every = None if every is None else _check_every("TensorBoardLogger", every)
        self._writer: Any = None
        self._purge: int | None = None
        self._carried: list[tuple[str, float, float]] = []  # written first by the next writer

    def on_train_begin(self, trainer: Trainer) -> None:
        self.close()
        step = trainer.steps_run
        # What an earlier run wrote past `step` is dropped; at step 0 (a new job: a notebook's
        # Trainer cell run again) all of it, as a CSVLogger starts its file anew.
        self._purge, self._carried = step + 1, []
        if step and self.every != "log" and jax.process_index() == 0 and _epoch_end_pending(trainer):
            # TensorBoard purges by step, all tags at once: to replace the epoch's points at
            # `step` (which the earlier run may have written) the purge starts at `step`,
            # and the other points there (the log interval's) are written again as they were.
            self._purge = step
            self._carried = [p for p in scalars_at(self.logdir, step) if not p[0].startswith("epoch/")]

    def _write(self, prefix: str, context: TrainingContext) -> None:
        if jax.process_index() != 0 or self.every not in (None, context.event):
            return
        if self._writer is None:
            suffix = f".{os.getpid()}.{next(_WRITERS):09d}"
            self._writer = self._writer_class(str(self.logdir), purge_step=self._purge, filename_suffix=suffix)
            for tag, value, wall_time in self._carried:
                self._writer.add_scalar(tag, value, self._purge, walltime=wall_time)
            self._carried = []
        for name, value in {**context.metrics, **context.learning_rates}.items():
            self._writer.add_scalar(f"{prefix}/{name}", float(value), context.step)

    def on_log(self, trainer: Trainer, context: TrainingContext) -> None:
        self._write("step", context)

    def on_epoch_end(self, trainer: Trainer, context: TrainingContext) -> None:
        self._write("epoch", context)
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, trainer: Trainer, context: TrainingContext) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the event file (the next fit opens another in ``logdir``)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def close_event_files(callbacks: list[Callback]) -> None:
    """Close the event files of the :class:`TensorBoardLogger` s among ``callbacks`` (``fit``
    ended by an exception or a Ctrl-C): tensorboardX flushes a writer every 2 minutes, so a
    notebook's TensorBoard showed nothing of the interrupted steps since the last epoch end
    until then (or the next fit). The next fit opens another file, as after a finished one."""
    for cb in callbacks:
        if isinstance(cb, TensorBoardLogger):
            cb.close()
