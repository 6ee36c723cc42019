"""History: per-step and per-epoch columns stay aligned; plotting."""

import matplotlib
import pytest

from functree.train import History

matplotlib.use("Agg")


def test_columns_stay_aligned():
    h = History()
    h.add_steps([1, 2], {"loss": [0.5, 0.4]})
    h.add_steps([3], {"loss": [0.3], "learning_rate": [0.1]})
    assert h.steps["learning_rate"] == [None, None, 0.1]
    h.add_epoch(1, {"loss": 0.4, "last_step": 3})
    h.add_epoch(2, {"loss": 0.2, "val_loss": 0.25, "last_step": 6})
    assert h.epochs["val_loss"] == [None, 0.25] and h["loss"] == [0.4, 0.2]
    with pytest.raises(KeyError, match=r"per-epoch names are"):
        h["accuracy"]


def test_plot():
    h = History()
    h.add_steps([1, 2, 3], {"loss": [0.5, 0.4, 0.3]})
    h.add_epoch(1, {"val_loss": 0.35, "last_step": 3})
    ax = h.plot("loss")
    assert [line.get_label() for line in ax.get_lines()] == ["loss", "val_loss"]


def test_the_repr_counts_the_rows_and_shows_the_last():
    """``fit`` returns the history and a notebook shows a cell's last value: the dataclass repr
    printed every value (590 KB for 20,000 steps of two columns)."""
    h = History()
    assert repr(h) == "History(no steps; no epochs)"
    n = 20_000
    h.add_steps(list(range(1, n + 1)), {"loss": [1 / (i + 1) for i in range(n)], "learning_rate": [1e-3] * n})
    h.add_epoch(1, {"loss": 0.4, "last_step": n, "per_class": list(range(100))})
    assert repr(h) == ("History(20000 steps of loss, learning_rate (step 20000: loss=5e-05, learning_rate=0.001); "
                       "1 epoch of loss, last_step, per_class (epoch 1: loss=0.4, last_step=20000, "
                       "per_class=[0, 1, 2, 3, 4, 5, ...]))")
