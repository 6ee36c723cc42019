"""Interrupts inside ``Trainer.fit``: Ctrl-C never lands between a step and its commit.

A training step donates the model's buffers: between the call that consumed them and the
commit of its outputs into the job's state, a ``KeyboardInterrupt`` would lose the model.
The driver marks those few bytecodes :attr:`Interrupts.critical`; a SIGINT arriving there
is deferred to the next :meth:`Interrupts.safe_point`. SIGTERM (a preemption) only asks the
loop to save and stop after the current step (:attr:`Interrupts.terminate`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupts"]


class Interrupts:
    """The fit's signal state: ``critical`` (a commit in progress: a Ctrl-C waits),
    ``deferred`` (a Ctrl-C arrived during one) and ``terminate`` (SIGTERM: stop after
    this step).

    Example:
      >>> from functree.train._interrupts import Interrupts
      >>> guard = Interrupts()
      >>> with guard.signals():
      ...     guard.critical = True   # a step's call and commit: a Ctrl-C here is deferred
      ...     guard.critical = False
      ...     guard.safe_point()      # where a deferred Ctrl-C is raised (none came)
      >>> guard.deferred, guard.terminate
      (False, False)
    """

    __slots__ = ("critical", "deferred", "terminate")

    def __init__(self) -> None:
        self.critical = self.deferred = self.terminate = False

    def safe_point(self) -> None:
        """Raise a KeyboardInterrupt that arrived inside a critical section."""
        if self.deferred:
            self.deferred = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """Inside ``fit`` (main thread only): SIGINT raises KeyboardInterrupt at once, but
        inside a critical section it waits for its end; SIGTERM sets :attr:`terminate`.
        The previous handlers are put back afterwards; a Ctrl-C deferred in the last
        commit is delivered then."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous_int, previous_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

        def on_int(signum: int, frame: Any) -> None:
            if self.critical:
                self.deferred = True
            elif callable(previous_int):
                previous_int(signum, frame)
            else:
                raise KeyboardInterrupt

        def on_term(signum: int, frame: Any) -> None:
            self.terminate = True

        self.critical = self.deferred = self.terminate = False
        if previous_int is signal.default_int_handler or (callable(previous_int) and previous_int is not on_int):
            signal.signal(signal.SIGINT, on_int)
        if previous_term in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.SIG_DFL)
            signal.signal(signal.SIGTERM, previous_term if previous_term is not None else signal.SIG_DFL)
            self.critical = self.terminate = False
            if self.deferred:  # arrived in the last commit: delivered now
                self.deferred = False
                raise KeyboardInterrupt
