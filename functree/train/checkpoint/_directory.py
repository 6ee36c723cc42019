"""A checkpoint directory's policy: what it may hold, who writes it, which steps stay.

One *job* writes a directory at a time. Its primary process holds ``.functree-writer.lock``
(pid, host, time, a token) while it saves; the job's other processes join that save
without touching the lock; another job (or manager) gets a :class:`CheckpointError`.
The lock appears with its content whole: it is written to a temporary file and then
linked into place, which fails when a lock exists. A lock whose process is gone from this
host is taken over; one from another host is respected. Leftovers of failed or killed
saves are removed by the next writer, under the lock. Retention keeps the last
``max_to_keep`` steps and the best by a metric.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["LOCK_NAME", "WriterLock", "check_directory", "remove_leftovers", "to_delete", "best"]

LOCK_NAME = ".functree-writer.lock"
STEP_DIR = re.compile(r"^\d+$")
TMP = ".orbax-checkpoint-tmp"

NOT_A_CHECKPOINT_DIRECTORY = """\
{path} is not a checkpoint directory: it holds {entries}, which are not checkpoint steps.
Nothing was written. Give the checkpoints a directory of their own:

    wrong:  ft.train.CheckpointManager("{path}")
    right:  ft.train.CheckpointManager("{path}/checkpoints")"""

SAVED_TREE = """\
{path} is one tree written by ft.train.save, not a CheckpointManager's directory of steps: \
read it with ft.train.load:

    wrong:  ft.train.CheckpointManager("{path}").restore()
    right:  ft.train.load("{path}", template)      # or without a template: the tree as saved"""

NOT_A_DIRECTORY = """\
{path} exists and is a file, not a directory. Nothing was written.

    wrong:  ft.train.CheckpointManager("{path}")
    right:  ft.train.CheckpointManager("{path}_checkpoints")"""

WRITER_ACTIVE = """\
Another writer is saving checkpoints into {path}: {lock} names pid {pid} on host {host!r}
(since {since}). Two writers in one directory would delete each other's checkpoints, so
nothing was written. Give each run its own directory:

    wrong:  CheckpointManager("{path}")                 # in two jobs at once
    right:  CheckpointManager("{path}/run_2")
If that process is gone (e.g. it ran on another host and was killed), delete {lock}."""


def check_directory(path: Path) -> None:
    """Refuse a file, or a directory holding anything but steps, locks and leftovers."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(NOT_A_DIRECTORY.format(path=path))
    foreign = sorted(e.name for e in path.iterdir() if not (
        STEP_DIR.match(e.name) or TMP in e.name or e.name.startswith(LOCK_NAME))) if path.exists() else []
    if (path / "meta").is_dir() and (path / "arrays").is_dir():
        raise CheckpointError(SAVED_TREE.format(path=path))
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(NOT_A_CHECKPOINT_DIRECTORY.format(path=path, entries=shown))


def remove_leftovers(directory: Path) -> None:
    """Temporary directories of failed or killed saves (only called under the lock)."""
    for entry in directory.iterdir() if directory.exists() else ():
        if TMP in entry.name:
            shutil.rmtree(entry, ignore_errors=True)


class WriterLock:
    """``LOCK_NAME`` in ``directory``, held by this object while ``token`` is set."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        self.token: str | None = None

    def acquire(self) -> bool:
        """Take the lock; False if this object already held it."""
        if self.token is not None:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        whole = self.path.with_name(f"{LOCK_NAME}.{token}")
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": token}
        fd = os.open(whole, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(owner))
            for _ in range(3):
                try:
                    os.link(whole, self.path)  # fails if a lock exists: never a half-written one
                except FileExistsError:
                    self._break_stale()
                    continue
                self.token = token
                return True
        finally:
            whole.unlink(missing_ok=True)
        raise CheckpointError(f"Could not take the writer lock {self.path}; retry the save.")

    def _break_stale(self) -> None:
        """Remove a lock whose process is gone from this host; raise for a live one."""
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            owner = None  # gone meanwhile, or not a lock this code wrote: taken over
        if isinstance(owner, dict) and not _dead(owner):
            raise CheckpointError(WRITER_ACTIVE.format(
                path=self.path.parent, lock=self.path, pid=owner.get("pid", "?"), host=owner.get("host", "?"),
                since=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner.get("time", 0)))),
            ))
        moved = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex}")
        try:  # rename first: two breakers never remove a fresh lock
            os.rename(self.path, moved)
            os.unlink(moved)
        except OSError:
            pass

    def release(self) -> None:
        token, self.token = self.token, None
        try:
            if token is not None and json.loads(self.path.read_text()).get("token") == token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _dead(owner: dict[str, Any]) -> bool:
    """Whether the lock's process is known to be gone (only knowable on this host)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def best(scored: Iterable[tuple[Any, int]], mode: str) -> int | None:
    """The step with the best finite score, ``(score, step)`` pairs, by ``mode``; of tied
    scores the first step to reach it (the rule of EarlyStopping and ReduceLROnPlateau)."""
    sign = 1 if mode == "min" else -1
    valid = [(sign * v, s) for v, s in scored
             if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
    return None if not valid else min(valid)[1]


def to_delete(steps: list[int], max_to_keep: int | None, best_step: int | None) -> list[int]:
    """The steps to delete: all but the last ``max_to_keep`` and the best."""
    keep = set(steps if max_to_keep is None else steps[-max_to_keep:]) | {best_step}
    return [s for s in steps if s not in keep]
