"""functree under concurrency, as users write it: steps, trainers and checkpoint managers
called from several Python threads at once. Each interleaving that matters is forced with
events (or by calling internals in a chosen order), never left to timing; every result is
compared with the same sequence run alone."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np

import functree as ft
from functree.train.checkpoint import _checkpoint

WAIT = 60  # seconds an event may take: a safety net against a hung test, never reached when it passes


def in_threads(*targets):
    """Run each target in its own thread; re-raise the first error any of them raised."""
    errors = []

    def run(target):
        try:
            target()
        except BaseException as e:  # (handed back to the test)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    if errors:
        raise errors[0]


def test_two_async_managers_saving_from_two_threads_at_once_both_complete(tmp_path, monkeypatch):
    """Orbax numbers a save by a process-wide operation id, incremented when a save starts
    and read back later in the same call: a second manager's save started in between made
    the first one wait for the second's signals (a 300 s hang, then a TimeoutError). Forced
    here: the first save stops right after taking its id until the second one has started."""
    from orbax.checkpoint._src.futures import synchronization

    ids = synchronization.OperationIdGenerator
    next_id, current_id = ids.next_operation_id, ids.get_current_operation_id
    own = threading.local()  # the id this thread's save took
    first_has_id, second_arrived = threading.Event(), threading.Event()
    second: list[int] = []  # the second saver's thread
    read_wrong: list[tuple[str, str]] = []

    def next_operation_id(cls):
        value = next_id()
        own.id = str(value)
        if threading.get_ident() in second:
            second_arrived.set()
        elif not first_has_id.is_set():
            first_has_id.set()
            assert second_arrived.wait(WAIT)  # the second save began (or waits for this one)
        return value

    def get_current_operation_id(cls):
        value = current_id()
        if value != getattr(own, "id", value):
            read_wrong.append((own.id, value))
            raise RuntimeError("this save read another save's operation id")
        return value

    class Watched:  # the lock, telling when the second saver reaches it
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.get_ident() in second:
                second_arrived.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(ids, "next_operation_id", classmethod(next_operation_id))
    monkeypatch.setattr(ids, "get_current_operation_id", classmethod(get_current_operation_id))
    monkeypatch.setattr(_checkpoint, "_ORBAX_SAVE", Watched(getattr(_checkpoint, "_ORBAX_SAVE", threading.Lock())),
                        raising=False)
    managers = [ft.train.CheckpointManager(tmp_path / name, asynchronous=True) for name in "ab"]

    def save(i):
        if i:
            second.append(threading.get_ident())
        managers[i].save(1, {"w": jnp.full(3, 10.0 * (i + 1))})
        managers[i].wait_until_finished()

    def first():
        save(0)

    def later():
        assert first_has_id.wait(WAIT)
        save(1)

    in_threads(first, later)
    assert read_wrong == []
    for i, manager in enumerate(managers):
        assert manager.all_steps() == [1]
        np.testing.assert_array_equal(manager.restore(1).model["w"], np.full(3, 10.0 * (i + 1)))
