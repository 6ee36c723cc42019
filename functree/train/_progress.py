"""Progress output: a tqdm bar in terminals and notebooks, one line per epoch elsewhere.

It is updated only when the Trainer reads metrics from the device (log intervals), so it
never forces a synchronisation; tqdm computes steps per second and the ETA. Where the
output is neither a terminal nor a notebook (a log file, a batch job's captured stderr),
a bar would write a carriage-return update at every log interval into the file; there
each epoch end prints one line instead (as Keras's ``verbose=2``), and the end of a fit
one more for steps after the last epoch end.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["Progress", "format_value"]


def format_value(x: float) -> str:
    """A short human form of a metric: ``0.0123``, ``1.23e-05``, ``nan``; counts as ints."""
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.3g}"
    return f"{x:.4f}"


def _interactive(file: Any) -> bool:
    """A terminal, or a notebook's output stream (ipykernel's, which is no terminal)."""
    if type(file).__module__.split(".")[0] == "ipykernel":
        return True
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """A tqdm bar over training steps, epoch lines without a terminal, or nothing when
    ``enabled`` is False.

    The bar's postfix shows the latest log interval's means and learning rate(s) and,
    from the first epoch end on, that epoch's validation metrics (``val_*``). ``lines``
    chooses the form: None (default) a bar in a terminal or notebook, else lines; True
    lines; False a bar.

    Example:
      >>> import sys
      >>> from functree.train._progress import Progress
      >>> bar = Progress(total=10, enabled=False)
      >>> bar.update(5, {"loss": 0.25})
      >>> bar.close()
      >>> lines = Progress(total=4, file=sys.stdout, lines=True)
      >>> lines.set_description("epoch 1")
      >>> lines.update(4, {"loss": 0.25, "lr": 0.1})
      >>> lines.end_epoch({"loss": 0.3, "val_loss": 0.5})  # doctest: +ELLIPSIS
      epoch 1: 4/4 steps, loss=0.3000, val_loss=0.5000, lr=0.1000 (... s)
    """

    def __init__(self, total: int | None, *, enabled: bool = True, desc: str = "train",
                 file: Any = None, lines: bool | None = None):
        self._bar: Any = None
        self._lines = False
        self._file = file
        self._total, self._desc, self._done, self._printed = total, desc, 0, 0
        self._shown: dict[str, float] = {}
        self._validation: dict[str, float] = {}  # the last epoch's val_*: kept in the postfix
        self._start = time.monotonic()
        if not enabled:
            return
        if lines is None:
            lines = not _interactive(sys.stderr if file is None else file)
        self._lines = lines
        if not lines:
            tqdm = _tqdm_class()
            self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True,
                             file=file, leave=True)

    def update(self, steps: int, values: Mapping[str, float]) -> None:
        """Advance by ``steps`` and show ``values`` (loss, learning rate, metrics)."""
        self._done += steps
        self._shown = dict(values)
        bar = self._bar
        if bar is not None:
            # tqdm redraws at most every ``mininterval`` seconds (its own test, in update):
            # the postfix is formatted only when this update may redraw, not at every log
            # interval (a tiny step logs every few ms); close() shows the latest values.
            if self._due():
                self._post(refresh=False)
            bar.update(steps)

    def _due(self) -> bool:
        """Whether the bar's ``mininterval`` has passed since its last redraw."""
        bar = self._bar
        last = getattr(bar, "last_print_t", None)  # (a bar disabled by TQDM_DISABLE has none)
        return last is None or bar._time() - last >= bar.mininterval

    def _post(self, refresh: bool) -> None:
        postfix = {**self._shown, **self._validation}
        self._bar.set_postfix({k: format_value(v) for k, v in postfix.items()}, refresh=refresh)

    def end_epoch(self, values: Mapping[str, float]) -> None:
        """An epoch's means and validation metrics: the bar keeps the ``val_*`` ones in
        its postfix; without a terminal, one line."""
        self._validation = {k: v for k, v in values.items() if k.startswith("val_")}
        if self._bar is not None:
            if self._due():  # (epochs of a few steps end every few ms: later updates and close() show it)
                self._post(refresh=True)
        elif self._lines:
            self._line(values)

    def _line(self, values: Mapping[str, float]) -> None:
        rates = {k: v for k, v in self._shown.items() if k == "lr" or k.endswith("/lr")}
        shown = ", ".join(f"{k}={format_value(v)}" for k, v in {**values, **rates}.items())
        total = "" if self._total is None else f"/{self._total}"
        elapsed = time.monotonic() - self._start
        print(f"{self._desc}: {self._done}{total} steps, {shown} ({elapsed:.1f} s)",
              file=sys.stderr if self._file is None else self._file, flush=True)
        self._printed = self._done

    def set_description(self, text: str) -> None:
        """The text before the bar (``epoch 3``)."""
        self._desc = text
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def close(self, means: Mapping[str, float] | None = None) -> None:
        """Finish the bar; without a terminal, a line for the steps after the last epoch
        end with ``means``, theirs (the epoch's so far: the Trainer's running epoch means;
        None: the last log interval's, which may cover only the last of them)."""
        if self._bar is not None:
            if self._shown or self._validation:
                self._post(refresh=False)  # the last update may not have redrawn
            self._bar.close()
            self._bar = None
        elif self._lines and self._done > self._printed:
            self._line(self._shown if means is None else means)
        self._lines = False


@functools.cache
def _tqdm_class() -> Any:
    """``tqdm.auto``'s class: a widget in notebooks with ipywidgets, else the text bar.

    Without ipywidgets, tqdm.auto warns "IProgress not found" and then falls back to text
    anyway; choosing the text bar up front gives the same bar without the warning. Looked
    up once (the search for ipywidgets reads the file system).
    """
    import importlib.util

    if importlib.util.find_spec("ipywidgets") is None:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm
