"""A checkpoint directory's policy: what it may hold, who writes it, which steps stay.

One *job* writes a directory at a time. Its primary process holds ``.functree-writer.lock``
(pid, the process's start time, host, time, a token) while it saves; the job's other
processes join that save without touching the lock; another job (or manager) gets a
:class:`CheckpointError`. The lock appears with its content whole: it is written to a
temporary file and then linked into place, which fails when a lock exists. A lock whose
process is gone from this host is taken over: no process has its pid, or the one that has
it started at another time than the lock records (a restarted container's job gets its
killed predecessor's pid), or the pid is this process's own and none of its
:class:`WriterLock` objects holds the token. A lock from another host is respected.
Leftovers of failed or killed saves are removed by the next writer, under the lock.
Retention keeps the last ``max_to_keep`` steps and the best by a metric.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from functree._files import local_path, read_path
from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["LOCK_NAME", "WriterLock", "check_directory", "check_writable", "local_path", "read_path", "remove_leftovers", "step_names", "started", "to_delete",
           "best"]

LOCK_NAME = ".functree-writer.lock"
STEP_DIR = re.compile(r"^\d+$")
TMP = ".orbax-checkpoint-tmp"
_HELD: set[str] = set()  # the tokens of the locks this process's WriterLocks hold or are taking now

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

STEP_OF_A_MANAGER = """\
{path} is step {step} of the checkpoints in {parent}, not a directory of steps: give the
checkpoints' directory and the step.

    wrong:  trainer.restore("{path}")                       # or CheckpointManager("{path}")
    right:  trainer.restore("{parent}", step={step})
    right:  ft.train.CheckpointManager("{parent}").restore({step}, template=model)"""

NOT_A_DIRECTORY = """\
{path} exists and is a file, not a directory. Nothing was written.

    wrong:  ft.train.CheckpointManager("{path}")
    right:  ft.train.CheckpointManager("{path}_checkpoints")"""

FILE_ON_THE_PATH = """\
{path} cannot hold a checkpoint: {file} is a file, not a directory. Nothing was written.

    wrong:  {call}("{path}")
    right:  {call}("{fixed}")"""

WRITER_ACTIVE = """\
Another writer is saving checkpoints into {path}: {lock} names pid {pid} on host {host!r}
(since {since}). Two writers in one directory would delete each other's checkpoints, so
nothing was written. Give each run its own directory:

    wrong:  CheckpointManager("{path}")                 # in two jobs at once
    right:  CheckpointManager("{path}/run_2")
If that process is gone (e.g. it ran on another host and was killed), delete {lock}."""


def check_writable(path: Path, call: str) -> None:
    """:data:`FILE_ON_THE_PATH` where a file stands where ``path`` needs a directory above it
    (``"notes.txt/run"``): the save would fail in orbax's ``mkdir`` naming neither the file
    nor a fix. Only the nearest existing folder above ``path`` matters: the rest is created."""
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        fixed = above.with_name(above.name + "_checkpoints") / path.relative_to(above)
        raise CheckpointError(FILE_ON_THE_PATH.format(path=path, file=above, call=call, fixed=fixed))


def check_directory(path: Path) -> None:
    """Refuse a file, or a directory holding anything but steps, locks and leftovers."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(NOT_A_DIRECTORY.format(path=path))
    check_writable(path, "ft.train.CheckpointManager")
    foreign = sorted(e.name for e in path.iterdir() if not _written_by_a_manager(e.name)) if path.exists() else []
    if (path / "meta").is_dir() and (path / "arrays").is_dir():
        if STEP_DIR.match(path.name) and _holds_steps(path.parent):
            raise CheckpointError(STEP_OF_A_MANAGER.format(path=path, step=int(path.name), parent=path.parent))
        raise CheckpointError(SAVED_TREE.format(path=path))
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(NOT_A_CHECKPOINT_DIRECTORY.format(path=path, entries=shown))


def _written_by_a_manager(name: str) -> bool:
    """Whether an entry called ``name`` is what a CheckpointManager writes: a step, a lock, a leftover."""
    return bool(STEP_DIR.match(name)) or TMP in name or name.startswith(LOCK_NAME)


def _holds_steps(directory: Path) -> bool:
    """Whether ``directory`` holds only what a CheckpointManager writes."""
    return all(_written_by_a_manager(e.name) for e in directory.iterdir())


def remove_leftovers(directory: Path) -> None:
    """Temporary directories of failed or killed saves, and the lock's own leftovers of a
    killed writer (only called under the lock)."""
    for entry in directory.iterdir() if directory.exists() else ():
        if TMP in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(LOCK_NAME + ".") and _abandoned(entry):
            entry.unlink(missing_ok=True)


def _abandoned(path: Path) -> bool:
    """Whether a lock's temporary file was left by a writer killed while taking the lock
    (:func:`_temporary_name`: written whole, then linked into place) or while breaking a
    stale one (``LOCK_NAME.stale-<token>``: renamed, then removed). The file's name says
    whose it is, so a file killed before its content was written is known too; another
    writer's file is in use while its process lives."""
    if ".stale-" in path.name:
        return True
    named = _TEMPORARY.match(path.name)
    if named is None:  # not this code's name: an older release's, given a minute
        try:
            return time.time() - path.stat().st_mtime > 60
        except OSError:
            return False
    host, pid, start, token = named.groups()
    return _dead({"host": socket.gethostname() if host == _host_tag() else None, "pid": int(pid),
                  "start": int(start) if start != "-" else None, "token": token})


_TEMPORARY = re.compile(re.escape(LOCK_NAME) + r"\.([0-9a-f]{12})\.(\d+)\.(\d+|-)\.([0-9a-f]{32})$")


def _host_tag() -> str:
    """This host's name as 12 hex digits (a file name holds any host's name this way)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def _temporary_name(pid: int, start: int | None, token: str) -> str:
    """The lock's temporary file: its host, pid, start time and token in its name, so that
    the next writer knows whose it is even where a SIGKILL came before its content."""
    return f"{LOCK_NAME}.{_host_tag()}.{pid}.{'-' if start is None else start}.{token}"


def step_names(directory: Path, written: bool = False) -> list[int]:
    """The steps named by the directories in ``directory`` (a cheap listing: orbax renames
    a step's temporary directory to its step name when the step is complete, so the names
    agree with orbax's steps unless another writer changed the directory); with ``written``,
    those holding a checkpoint's ``meta``."""
    if not directory.is_dir():
        return []
    return sorted(int(e.name) for e in directory.iterdir()
                  if STEP_DIR.match(e.name) and ((e / "meta").is_dir() if written else e.is_dir()))


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
        _HELD.add(token)  # from its temporary file on: this process's file is in use, not a dead writer's
        whole = self.path.with_name(_temporary_name(os.getpid(), started(os.getpid()), token))
        owner = {"pid": os.getpid(), "start": started(os.getpid()), "host": socket.gethostname(),
                 "time": time.time(), "token": token}
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
            if self.token != token:
                _HELD.discard(token)
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
        if token is None:
            return
        _HELD.discard(token)
        try:
            if json.loads(self.path.read_text()).get("token") == token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (Linux: field 22 of
    ``/proc/<pid>/stat``); None where unknown (no ``/proc``: another OS, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces and ")"
    try:
        return int(fields[19])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _dead(owner: dict[str, Any]) -> bool:
    """Whether the lock's process is known to be gone (only knowable on this host).

    A pid alone does not name a process: a restarted container's job gets its killed
    predecessor's pid (pid 2 again in a fresh pid namespace). So a lock naming this
    process is live only while one of its ``WriterLock`` objects holds the token, and a
    lock naming another process is live only while that pid's start time is the recorded
    one (where both are known: Linux, and a lock that records it; else the pid decides)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
        return False
    if pid == os.getpid():
        return owner.get("token") not in _HELD
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # a process has the pid but is another user's: maybe a reuse, the start time says
    start, now = owner.get("start"), started(pid)
    return isinstance(start, int) and now is not None and now != start


def best(scored: Iterable[tuple[Any, int]], mode: str) -> int | None:
    """The step with the best finite score, ``(score, step)`` pairs, by ``mode``; of tied
    scores the first step to reach it (the rule of EarlyStopping and ReduceLROnPlateau)."""
    sign = 1 if mode == "min" else -1
    valid = [(sign * v, s) for v, s in scored  # a diverged -inf loss never displaces the best
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return None if not valid else min(valid)[1]


def to_delete(steps: list[int], max_to_keep: int | None, best_step: int | None) -> list[int]:
    """The steps to delete: all but the last ``max_to_keep`` and the best."""
    keep = set(steps if max_to_keep is None else steps[-max_to_keep:]) | {best_step}
    return [s for s in steps if s not in keep]
