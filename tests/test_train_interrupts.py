"""Interrupts inside fit (functree/train/_interrupts.py): a Ctrl-C waits for a commit.

The SIGINT disposition is the process's: a suite started as a shell's background job
(``pytest ... &`` in a script, ``nohup``) inherits SIGINT ignored, and Python keeps it so.
Each test sets the disposition it is about (:func:`sigint`) and puts the previous one back.
"""

from __future__ import annotations

import os
import signal

import pytest

from functree.train._interrupts import Interrupts


@pytest.fixture
def sigint():
    """Python's Ctrl-C handler while the test runs (whatever the process inherited); the
    test may set another one. The previous handlers are put back after it."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before[0] if before[0] is not None else signal.SIG_DFL)
    signal.signal(signal.SIGTERM, before[1] if before[1] is not None else signal.SIG_DFL)


def handlers():
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_a_ctrl_c_inside_a_commit_waits_for_its_end(sigint):
    guard = Interrupts()
    before = handlers()
    committed = []
    with pytest.raises(KeyboardInterrupt), guard.signals():
        guard.critical = True
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode: deferred
        committed.append(1)
        guard.critical = False
        committed.append(2)
        guard.safe_point()  # raised here
        committed.append(3)
    assert committed == [1, 2] and not guard.deferred
    assert handlers() == before


def test_sigterm_asks_to_stop_and_a_deferred_ctrl_c_is_delivered_on_exit(sigint):
    guard = Interrupts()
    with guard.signals():
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.terminate  # the loop stops after this step
    assert not guard.terminate
    with pytest.raises(KeyboardInterrupt), guard.signals():
        guard.critical = True
        os.kill(os.getpid(), signal.SIGINT)
        guard.critical = False  # the last commit ended: fit returns, the Ctrl-C is raised
    with pytest.raises(KeyboardInterrupt), guard.signals():
        os.kill(os.getpid(), signal.SIGINT)  # outside a commit: at once
        pytest.fail("not interrupted")


def test_a_process_that_ignores_ctrl_c_keeps_ignoring_it(sigint):
    """A background job's SIGINT is ignored: fit does not turn Ctrl-C on (SIG_DFL, no
    Python handler, is kept too: a Ctrl-C then ends the process as it did before fit)."""
    guard = Interrupts()
    for disposition in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, disposition)
        with guard.signals():
            assert signal.getsignal(signal.SIGINT) is disposition
            if disposition is signal.SIG_IGN:
                os.kill(os.getpid(), signal.SIGINT)
                guard.critical = True
                os.kill(os.getpid(), signal.SIGINT)
                guard.critical = False
                guard.safe_point()
        assert signal.getsignal(signal.SIGINT) is disposition and not guard.deferred


def test_your_own_ctrl_c_handler_is_called_and_after_a_commit_ends(sigint):
    """A SIGINT handler installed before fit gets each Ctrl-C (one inside a commit once
    the commit ended), not a KeyboardInterrupt; Python's raises one as usual."""
    calls = []
    signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    mine = signal.getsignal(signal.SIGINT)
    guard = Interrupts()
    with guard.signals():
        os.kill(os.getpid(), signal.SIGINT)  # outside a commit: yours, at once
        assert calls == [signal.SIGINT]
        guard.critical = True
        os.kill(os.getpid(), signal.SIGINT)  # inside one: deferred
        assert calls == [signal.SIGINT]
        guard.critical = False
        guard.safe_point()
        assert calls == [signal.SIGINT] * 2
        guard.critical = True
        os.kill(os.getpid(), signal.SIGINT)  # in the last commit: delivered on exit
        guard.critical = False
    assert calls == [signal.SIGINT] * 3 and signal.getsignal(signal.SIGINT) is mine
    assert guard.on_ctrl_c is None and not guard.deferred


def _kill_on(monkeypatch, when):
    """``signal.signal`` that sends this process a SIGINT just before or just after the
    call for which ``when(signum, handler)`` says ``"before"`` or ``"after"``: a Ctrl-C at
    that moment."""
    real = signal.signal

    def patched(signum, handler):
        moment = when(signum, handler)
        if moment == "before":
            os.kill(os.getpid(), signal.SIGINT)
        result = real(signum, handler)
        if moment == "after":
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(signal, "signal", patched)


def test_a_ctrl_c_while_the_handlers_are_installed_leaves_none_behind(sigint, monkeypatch):
    """A Ctrl-C just after fit's SIGINT handler is installed (outside a commit: raised at
    once) still puts back both handlers (else fit's handler stayed installed)."""
    before = handlers()
    _kill_on(monkeypatch, lambda signum, handler: "after" if signum == signal.SIGINT and handler not in before else None)
    with pytest.raises(KeyboardInterrupt), Interrupts().signals():
        pytest.fail("not interrupted")
    monkeypatch.undo()
    assert handlers() == before


def test_a_ctrl_c_while_the_handlers_are_put_back_leaves_none_behind(sigint, monkeypatch):
    """The restore of SIGTERM's handler with a Ctrl-C just before it: the Ctrl-C waits
    until both handlers are back (else Python's handler raised between the two restores
    and fit's SIGTERM handler stayed installed: a later SIGTERM only set a flag)."""
    before = handlers()
    guard = Interrupts()
    _kill_on(monkeypatch, lambda signum, handler: "before" if signum == signal.SIGTERM and handler == before[1] else None)
    with pytest.raises(KeyboardInterrupt), guard.signals():
        pass
    monkeypatch.undo()
    assert handlers() == before and not guard.deferred
