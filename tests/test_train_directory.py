"""A checkpoint directory's writer lock, with real processes, and failed saves.

Two writer processes: the second is refused while the first saves. A writer killed
mid-save leaves a whole lock (never an empty one) that the next writer takes over. A lock
from another host is respected even when its process is gone. A save that fails leaves
no lock and no partial step, and the same manager saves the next step.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from functree.train import CheckpointError, CheckpointManager
from functree.train.checkpoint._directory import LOCK_NAME

WRITER = """
import socket, sys, time, pathlib
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
import functree as ft

directory, release, step, host = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if host != "-":
    socket.gethostname = lambda: host  # this process runs "on another host"
original = atomicity.AtomicRenameTemporaryPath.finalize

def stall(self, *args, **kwargs):
    print("MIDSAVE", flush=True)
    while not release.exists():
        time.sleep(0.05)
    return original(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = stall
try:
    ft.train.CheckpointManager(directory).save(step, {"w": jnp.full(4, float(step))})
    print("SAVED", flush=True)
except ft.train.CheckpointError as e:
    print("REFUSED", " ".join(str(e).split()), flush=True)
"""


def writer(tmp_path, step, host="-"):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "ckpt"), str(tmp_path / "release"),
                             str(step), host], stdout=subprocess.PIPE, text=True)


def wait_for(proc, word):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if word in line or (not line and proc.poll() is not None):
            return line
    return ""


def leftovers(directory):
    return sorted(n for n in os.listdir(directory) if not n.isdigit())


def test_two_writer_processes(tmp_path):
    first = writer(tmp_path, 1)
    try:
        assert "MIDSAVE" in wait_for(first, "MIDSAVE")
        second = writer(tmp_path, 2)
        line = second.communicate(timeout=120)[0]
        assert f"REFUSED Another writer is saving checkpoints into {tmp_path / 'ckpt'}" in line
        assert f"pid {first.pid} on host" in line
        (tmp_path / "release").touch()
        assert "SAVED" in wait_for(first, "SAVED")
    finally:
        first.kill()
        first.wait()
        first.stdout.close()
    assert CheckpointManager(tmp_path / "ckpt").all_steps() == [1] and leftovers(tmp_path / "ckpt") == []


def test_writer_killed_mid_save_leaves_a_whole_lock_that_is_taken_over(tmp_path):
    proc = writer(tmp_path, 1)
    try:
        assert "MIDSAVE" in wait_for(proc, "MIDSAVE")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdout.close()
    lock = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())  # whole, never empty
    assert lock["pid"] == proc.pid and len(leftovers(tmp_path / "ckpt")) == 2  # the lock, the partial step
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(2, {"w": jnp.ones(4)})
    assert os.listdir(tmp_path / "ckpt") == ["2"]


def test_lock_of_another_host_is_respected_after_its_process_ends(tmp_path):
    proc = writer(tmp_path, 1, host="gpu-node-7")
    try:
        assert "MIDSAVE" in wait_for(proc, "MIDSAVE")
        proc.send_signal(signal.SIGKILL)  # gone, but this host cannot know that
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdout.close()
    manager = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=rf"pid {proc.pid} on host 'gpu-node-7'(?s:.*)delete .*{LOCK_NAME}"):
        manager.save(2, {"w": jnp.ones(4)})
    assert manager.all_steps() == []
    (tmp_path / "ckpt" / LOCK_NAME).unlink()  # what the message says to do
    manager.save(2, {"w": jnp.ones(4)})
    assert os.listdir(tmp_path / "ckpt") == ["2"]


def test_failed_save_leaves_nothing_and_the_same_manager_saves_next(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"w": jnp.ones(4)})

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    with pytest.raises(OSError, match="No space left"):
        manager.save(2, {"w": jnp.zeros(4)})
    assert os.listdir(tmp_path / "ckpt") == ["1"]  # no lock, no partial step
    monkeypatch.undo()
    manager.save(2, {"w": jnp.zeros(4)})
    assert manager.all_steps() == [1, 2] and leftovers(tmp_path / "ckpt") == []
    np.testing.assert_array_equal(manager.restore(2).model["w"], np.zeros(4))


def test_a_lock_that_cannot_be_written_never_exists_empty(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "ckpt")
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, *args):
            self.file = real_fdopen(fd, *args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", Full)
    with pytest.raises(OSError, match="No space left"):
        manager.save(1, {"w": jnp.ones(4)})
    monkeypatch.undo()
    assert os.listdir(tmp_path / "ckpt") == []
    manager.save(1, {"w": jnp.ones(4)})
    assert os.listdir(tmp_path / "ckpt") == ["1"]


def proc_start(pid):
    """Field 22 of /proc/<pid>/stat, for a process whose command name has no spaces."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split()[21])


def write_lock(directory, pid, start, token="0" * 32):
    import socket

    directory.mkdir(parents=True, exist_ok=True)
    owner = {"pid": pid, "host": socket.gethostname(), "time": time.time(), "token": token}
    (directory / LOCK_NAME).write_text(json.dumps(owner if start is None else {**owner, "start": start}))


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="start times are read from /proc")


@needs_proc
@pytest.mark.parametrize("start", ["wrong", "right", None])
def test_a_lock_naming_this_process_that_it_does_not_hold_is_stale(tmp_path, start):
    """A restarted container's job gets its killed predecessor's pid (pid 2 again): the lock
    it left names this process. Before the fix the job was refused as "another writer"
    (os.kill(pid, 0) succeeds for oneself) until the lock was deleted by hand."""
    recorded = {"wrong": proc_start(os.getpid()) + 1, "right": proc_start(os.getpid()), None: None}[start]
    write_lock(tmp_path / "ckpt", os.getpid(), recorded)
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"w": jnp.ones(4)})
    assert os.listdir(tmp_path / "ckpt") == ["1"]


def test_a_lock_held_by_another_manager_of_this_process_is_respected(tmp_path):
    first = CheckpointManager(tmp_path / "ckpt", asynchronous=True)
    first.save(1, {"w": jnp.ones(4)})  # the lock is held until the save is waited for
    try:
        with pytest.raises(CheckpointError, match=rf"Another writer .*names pid {os.getpid()} on host"):
            CheckpointManager(tmp_path / "ckpt").save(2, {"w": jnp.zeros(4)})
    finally:
        first.wait_until_finished()
    CheckpointManager(tmp_path / "ckpt").save(2, {"w": jnp.zeros(4)})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]


@needs_proc
def test_a_lock_naming_a_live_pid_is_respected_only_with_that_processs_start_time(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = proc_start(sleeper.pid)
        write_lock(tmp_path / "ckpt", sleeper.pid, start)
        manager = CheckpointManager(tmp_path / "ckpt")
        with pytest.raises(CheckpointError, match=rf"Another writer .*names pid {sleeper.pid} on host"):
            manager.save(1, {"w": jnp.ones(4)})
        write_lock(tmp_path / "ckpt", sleeper.pid, start - 1)  # the pid, reused by another process
        manager.save(1, {"w": jnp.ones(4)})
        assert os.listdir(tmp_path / "ckpt") == ["1"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_lock_records_its_process_start_time(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", asynchronous=True)
    manager.save(1, {"w": jnp.ones(4)})
    try:
        lock = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())
    finally:
        manager.wait_until_finished()
    assert lock["pid"] == os.getpid()
    assert lock["start"] == (proc_start(os.getpid()) if os.path.exists("/proc/self/stat") else None)
