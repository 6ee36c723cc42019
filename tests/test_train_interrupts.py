"""Interrupts inside fit (functree/train/_interrupts.py): a Ctrl-C waits for a commit."""

from __future__ import annotations

import os
import signal

import pytest

from functree.train._interrupts import Interrupts


def test_a_ctrl_c_inside_a_commit_waits_for_its_end():
    guard = Interrupts()
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
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
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_sigterm_asks_to_stop_and_a_deferred_ctrl_c_is_delivered_on_exit():
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
