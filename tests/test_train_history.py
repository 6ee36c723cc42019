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
