"""functree under concurrency, as users write it: steps, trainers and checkpoint managers
called from several Python threads at once. Each interleaving that matters is forced with
events (or by calling internals in a chosen order), never left to timing; every result is
compared with the same sequence run alone."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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

    threads = [threading.Thread(target=run, args=(t,), name=t.__name__) for t in targets]
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


def squares(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


OPT = ft.optim.Optimizer(ft.optim.adam(1e-2))


def job(seed):
    """A model, its optimizer state and a minibatch of their own."""
    model = ft.nn.Dense(4, 2, key=jax.random.key(seed))
    return model, OPT.init(model), (jax.random.normal(jax.random.key(10 + seed), (3, 4)), jnp.ones((3, 2)))


def leaves(*trees):
    return [np.asarray(x) for x in jax.tree.leaves(trees)]


def same(a, b):
    """Every leaf of ``a`` equal to ``b``'s, bit for bit."""
    return all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))


def test_one_stop_step_called_from_two_threads_at_once_names_the_fix():
    """A step with on_nan="stop" keeps one stop log, donated and replaced by each call: a
    second thread's call given the log the first one's had just consumed failed with XLA's
    "Buffer has been deleted or donated" (argument 10). Forced here: the second thread reads
    the log before the first call returns, and runs after it."""
    step = ft.train.train_step(squares, OPT)
    model, state, batch = job(0)
    model, state, _ = step(model, state, batch)  # the loop's direct call is set
    direct = step._direct
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()

    def held(*args):
        if threading.current_thread().name == "first":
            first_in.set()
            assert second_in.wait(WAIT)
            try:
                return direct(*args)
            finally:
                first_done.set()
        second_in.set()
        assert first_done.wait(WAIT)
        return direct(*args)

    step._direct = held
    got = {}
    other = job(1)

    def first():
        got["first"] = step(model, state, batch)

    def second():
        assert first_in.wait(WAIT)
        got["second"] = step(*other)

    with pytest.raises(RuntimeError, match="called from two threads at once") as caught:
        in_threads(first, second)
    assert "second" not in got and "right:" in str(caught.value)
    alone = ft.train.train_step(squares, OPT)  # the fix: a step of its own (its inputs intact)
    expected = alone(*alone(*job(0))[:2], batch)
    assert same(got["first"], expected)
    own = ft.train.train_step(squares, OPT)
    assert same(own(*other), alone(*job(1)))


def test_a_stop_check_reading_a_log_another_thread_consumed_names_the_fix():
    """The same misuse met where a call looks at the stop log (every 16 calls, and
    ``step.check()``): the log it read was donated by another thread's call since. Forced
    by handing the check the log a call has consumed (JAX said "Array has been deleted")."""
    step = ft.train.train_step(squares, OPT)
    model, state, batch = job(0)
    model, state, _ = step(model, state, batch)
    read = step._loop.halt  # what a thread's check read ...
    model, state, _ = step(model, state, batch)  # ... before another thread's call donated it
    step._loop.halt = read
    with pytest.raises(RuntimeError, match="called from two threads at once"):
        step.check()


def test_an_error_inside_fit_lets_the_asynchronous_checkpoint_under_way_finish(tmp_path, monkeypatch):
    """An exception from the data (or a Ctrl-C) ending fit while an asynchronous checkpoint
    was being written left it unwritten when the process then ended: orbax's writer thread,
    cut off at interpreter exit ("cannot schedule new futures after interpreter shutdown"),
    left step 3 a temporary directory. fit now waits for it before the error leaves. Forced:
    step 3's write is held until someone waits for it."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize
    started, release = threading.Event(), threading.Event()

    async def held(self, *args, **kwargs):
        if self.get_final().name == "3":
            assert release.wait(WAIT)
        return await finalize(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held)
    manager = ft.train.CheckpointManager(tmp_path / "run", max_to_keep=None, asynchronous=True)
    save, wait = manager.save, manager._mngr.wait_until_finished

    def saving(step, *args, **kwargs):
        save(step, *args, **kwargs)
        if step == 3:
            started.set()

    def waiting():
        if started.is_set():
            release.set()
        return wait()

    monkeypatch.setattr(manager, "save", saving)
    monkeypatch.setattr(manager._mngr, "wait_until_finished", waiting)
    model, _, (x, y) = job(0)

    def data():
        for i in range(6):
            if i == 3:
                raise OSError("the data's disk is gone")
            yield x, y

    trainer = ft.train.Trainer(model, OPT, squares)
    try:
        with pytest.raises(OSError, match="disk is gone"):
            trainer.fit(data(), steps=6, callbacks=[ft.train.ModelCheckpoint(manager, every_steps=1)], progress=False)
        assert manager.all_steps() == [1, 2, 3]  # written before the error left fit
    finally:
        release.set()
        manager.wait_until_finished()
    assert same(manager.restore(3).model, trainer.model)


def test_a_model_another_thread_donates_after_the_check_is_named():
    """Two threads starting from one model: the second thread's call checked its model (not
    yet donated), then the first thread's call donated it before the second one ran, and JAX
    said only "Array has been deleted with shape=float32[3,2]". Forced: the other call runs
    right after this call's check."""
    step, other = (ft.train.train_step(squares, OPT, on_nan="skip") for _ in range(2))
    model, state, batch = job(0)
    check = step._before

    def checked_then_donated(args, kwargs):
        out = check(args, kwargs)
        other(model, state, batch)  # the other thread's call, on the same model
        return out

    step._before = checked_then_donated
    with pytest.raises(ValueError, match="'model' holds a deleted array at weight"):
        step(model, state, batch)


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_an_evaluation_whose_model_a_training_thread_donates_midway_names_it(method):
    """``trainer.evaluate`` (or ``predict``) in one thread while ``trainer.fit`` runs in
    another: a step donated the model between two of the evaluation's minibatches, and the
    error blamed the minibatch ("evaluate: minibatch 1 (counted from 0) failed. Its shapes:
    ... Buffer has been deleted or donated"). Forced: the data runs the other thread's step
    after its first minibatch."""
    model, _, (x, y) = job(0)
    trainer = ft.train.Trainer(model, OPT, squares)
    given = (x, y) if method == "evaluate" else x

    def data():
        yield given
        trainer.train_step(trainer.model, trainer.opt_state, (x, y))  # the training thread's step
        yield given

    with pytest.raises(ValueError, match=r"deleted array at model\.weight") as caught:
        getattr(trainer, method)(data())
    assert "minibatch" not in str(caught.value)
