"""The record of a run: per-step and per-epoch values, ready to plot."""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping
from typing import Any

__all__ = ["History"]

UNKNOWN_NAME = """\
History has no values named {name!r}; per-epoch names are {epochs}, per-step names are \
{steps}.
    right:  history.epochs["val_loss"], history.steps["loss"]"""


@dataclasses.dataclass(repr=False)
class History:
    """Values recorded by :meth:`Trainer.fit`.

    ``steps`` maps ``"step"`` and every per-step name (``loss``, metrics, ``learning_rate``,
    or with ``ft.optim.groups`` one ``"<group>/learning_rate"`` per group) to a list with
    one value per training step; ``epochs`` maps ``"epoch"`` and every per-epoch name
    (epoch means, ``val_*``, ``last_step``, and under ``on_nan="skip"`` ``skipped``: the
    steps left out of the means) to a list with one value per epoch.
    ``history["loss"]`` reads per-epoch values (per-step when no epoch finished).
    Its repr counts the rows and shows the last one's values: ``fit`` returns the history,
    and a notebook shows the last value of a cell (every value was 30 bytes a step and a
    column, 600 KB for a 20,000-step job).

    Example:
      >>> from functree.train import History
      >>> h = History()
      >>> h.add_steps([1, 2], {"loss": [0.5, 0.25]})
      >>> h.add_epoch(1, {"loss": 0.375})
      >>> h.steps["loss"], h["loss"]
      ([0.5, 0.25], [0.375])
      >>> h
      History(2 steps of loss (step 2: loss=0.25); 1 epoch of loss (epoch 1: loss=0.375))
    """

    steps: dict[str, list[Any]] = dataclasses.field(default_factory=lambda: {"step": []})
    epochs: dict[str, list[Any]] = dataclasses.field(default_factory=lambda: {"epoch": []})

    def add_steps(self, steps: list[int], values: Mapping[str, list[float]]) -> None:
        """Append several steps' values (missing names are padded with None)."""
        _append(self.steps, "step", steps, values)

    def add_epoch(self, epoch: int, values: Mapping[str, float]) -> None:
        """Append one epoch's values."""
        _append(self.epochs, "epoch", [epoch], {k: [v] for k, v in values.items()})

    def __getitem__(self, name: str) -> list[Any]:
        if name in self.epochs and self.epochs["epoch"]:
            return self.epochs[name]
        if name in self.steps:
            return self.steps[name]
        raise KeyError(UNKNOWN_NAME.format(name=name, epochs=list(self.epochs), steps=list(self.steps)))

    def __repr__(self) -> str:
        return f"History({_summary(self.steps, 'step')}; {_summary(self.epochs, 'epoch')})"

    def plot(self, *names: str, ax: Any = None) -> Any:
        """Plot per-step values (and ``val_*`` per epoch, at the epoch's last step)."""
        import matplotlib.pyplot as plt

        ax = ax or plt.gca()
        names = names or tuple(n for n in self.steps if n not in ("step", "nonfinite"))
        for name in names:
            if name in self.steps:
                ax.plot(self.steps["step"], self.steps[name], label=name)
            if f"val_{name}" in self.epochs and self.epochs.get("last_step"):
                ax.plot(self.epochs["last_step"], self.epochs[f"val_{name}"], "o-", label=f"val_{name}")
        ax.set_xlabel("step")
        ax.legend()
        return ax


def _summary(table: dict[str, list[Any]], index: str) -> str:
    """``"2 steps of loss (step 2: loss=0.25)"``: the row count, the names, the last row."""
    rows = len(table[index])
    names = [n for n in table if n != index]
    if not rows:
        return f"no {index}s"
    last = ", ".join(f"{n}={table[n][-1]:.6g}" if isinstance(table[n][-1], float) else f"{n}={reprlib.repr(table[n][-1])}"
                     for n in names if table[n][-1] is not None)
    return f"{rows} {index}{'s' if rows != 1 else ''} of {', '.join(names)} ({index} {table[index][-1]}: {last})"


def _append(table: dict[str, list[Any]], index: str, ids: list[int], values: Mapping[str, list[Any]]) -> None:
    before = len(table[index])
    table[index].extend(ids)
    for name, column in values.items():
        table.setdefault(name, [None] * before).extend(column)
    for column in table.values():
        if len(column) < len(table[index]):
            column.extend([None] * (len(table[index]) - len(column)))
