"""The progress bar: ``tqdm.auto`` (a widget in notebooks, a text bar in terminals).

It is updated only when the Trainer reads metrics from the device (log intervals), so it
never forces a synchronisation; tqdm computes steps per second and the ETA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["Progress", "format_value"]


def format_value(x: float) -> str:
    """A short human form of a metric: ``0.0123``, ``1.23e-05``, ``nan``."""
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.3g}"
    return f"{x:.4f}"


class Progress:
    """A tqdm bar over training steps, or nothing when ``enabled`` is False.

    Example:
      >>> from functree.train._progress import Progress
      >>> bar = Progress(total=10, enabled=False)
      >>> bar.update(5, {"loss": 0.25})
      >>> bar.close()
    """

    def __init__(self, total: int | None, *, enabled: bool = True, desc: str = "train",
                 file: Any = None):
        self._bar = None
        if enabled:
            tqdm = _tqdm_class()
            self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True,
                             file=file, leave=True)

    def update(self, steps: int, values: Mapping[str, float]) -> None:
        """Advance by ``steps`` and show ``values`` (loss, learning rate, metrics)."""
        if self._bar is None:
            return
        self._bar.set_postfix({k: format_value(v) for k, v in values.items()}, refresh=False)
        self._bar.update(steps)

    def set_description(self, text: str) -> None:
        """The text before the bar (``epoch 3/10``)."""
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


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
