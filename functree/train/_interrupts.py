"""Interrupts inside ``Trainer.fit``: Ctrl-C never lands between a step and its commit.

A training step donates the model's buffers: between the call that consumed them and the
commit of its outputs into the job's state, a ``KeyboardInterrupt`` would lose the model.
The driver marks those few bytecodes :attr:`Interrupts.critical`; a SIGINT arriving there
is deferred to the next :meth:`Interrupts.safe_point`, which hands it to the SIGINT handler
that was there before ``fit`` (Python's raises KeyboardInterrupt). SIGTERM (a preemption) only asks the
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
    ``deferred`` (a Ctrl-C arrived during one), ``terminate`` (SIGTERM: stop after this
    step) and ``on_ctrl_c`` (the SIGINT handler from before the fit: a deferred Ctrl-C
    goes there; None: KeyboardInterrupt).

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

    __slots__ = ("critical", "deferred", "on_ctrl_c", "terminate")

    def __init__(self) -> None:
        self.critical = self.deferred = self.terminate = False
        self.on_ctrl_c: Any = None

    def safe_point(self) -> None:
        """Deliver a Ctrl-C that arrived inside a critical section: to the handler from
        before the fit (Python's raises KeyboardInterrupt), else KeyboardInterrupt."""
        if self.deferred:
            self.deferred = False
            if self.on_ctrl_c is None:
                raise KeyboardInterrupt
            self.on_ctrl_c(signal.SIGINT, None)  # a handler's frame may be None

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """Inside ``fit`` (main thread only): SIGINT raises KeyboardInterrupt at once, but
        inside a critical section it waits for its end; SIGTERM sets :attr:`terminate`.
        The previous handlers are put back afterwards, also when an exception (a Ctrl-C
        included) ends the block; a Ctrl-C deferred in the last commit, or arriving while
        the handlers are put back, is delivered then.

        The process's own choices stay: a SIGINT that is ignored (``SIG_IGN``: a shell's
        background job, ``nohup``) stays ignored and one with the default action
        (``SIG_DFL``: no Python handler) stays so; a Python handler (Python's
        ``default_int_handler``, or yours) is called for a Ctrl-C outside a commit. A
        SIGTERM handler already installed is left in place (and :attr:`terminate` unset).
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous_int, previous_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

        def on_int(signum: int, frame: Any) -> None:
            if self.critical:
                self.deferred = True
            elif callable(previous_int):  # always (installed only then): narrows the type
                previous_int(signum, frame)

        def on_term(signum: int, frame: Any) -> None:
            self.terminate = True

        self.critical = self.deferred = self.terminate = False
        self.on_ctrl_c = previous_int if callable(previous_int) else None
        try:  # installed inside: a Ctrl-C right after the first install still restores both
            if previous_term in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, on_term)
            if callable(previous_int):
                signal.signal(signal.SIGINT, on_int)
            yield
        finally:
            self.critical = True  # a Ctrl-C while the handlers are put back waits for the end
            signal.signal(signal.SIGTERM, previous_term if previous_term is not None else signal.SIG_DFL)
            signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.SIG_DFL)
            self.critical = self.terminate = False
            try:
                self.safe_point()  # a Ctrl-C that arrived in the last commit: delivered now
            finally:
                self.on_ctrl_c = None
