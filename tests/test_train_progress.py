"""The tqdm progress bar."""

import io

import pytest

from functree.train._progress import Progress, format_value


def test_bar_shows_values_and_silences():
    stream = io.StringIO()
    bar = Progress(total=4, file=stream)
    bar.update(2, {"loss": 0.123456, "lr": 1e-5})
    bar.set_description("epoch 2")
    bar.close()
    text = stream.getvalue()
    assert "2/4" in text and "loss=0.1235" in text and "lr=1e-05" in text and "epoch 2" in text
    quiet = Progress(total=4, enabled=False)
    quiet.update(4, {"loss": 1.0})
    quiet.close()


def test_format_value():
    assert [format_value(v) for v in (0.5, 123456.0, float("nan"), 0.0)] == [
        "0.5000", "1.23e+05", "nan", "0.0000"
    ]


def test_bar_keeps_the_validation_metrics_and_lines_without_a_terminal():
    # issue 27: validation metrics never appeared in the progress output
    stream = io.StringIO()
    bar = Progress(total=4, file=stream, lines=False)
    bar.update(2, {"loss": 0.5, "lr": 0.1})
    bar.end_epoch({"loss": 0.5, "val_loss": 0.25, "val_acc": 0.75})
    bar.update(2, {"loss": 0.125, "lr": 0.1})  # the next epoch's interval: val_* stay shown
    bar.close()
    last = stream.getvalue().split("\r")[-1]
    assert "4/4" in last and "loss=0.1250" in last and "val_loss=0.2500" in last and "val_acc=0.7500" in last
    stream = io.StringIO()  # not a terminal: one line per epoch, and one for the steps after
    lines = Progress(total=6, file=stream)
    lines.set_description("epoch 1")
    lines.update(4, {"loss": 0.5, "skipped": 1, "head/lr": 0.1})
    lines.end_epoch({"loss": 0.5, "skipped": 1, "val_loss": 0.25})
    lines.update(2, {"loss": 0.125})
    lines.close()
    first, second = stream.getvalue().splitlines()
    assert first.startswith("epoch 1: 4/6 steps, loss=0.5000, skipped=1, val_loss=0.2500, head/lr=0.1000 (")
    assert second.startswith("epoch 1: 6/6 steps, loss=0.1250 (")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("mininterval", [0.0, 3600.0])
def test_the_postfix_is_formatted_only_for_a_redraw_and_the_bar_ends_on_the_latest_values(mininterval, monkeypatch):
    # tqdm redraws at most every mininterval seconds: formatting the postfix at every log
    # interval (every few ms for a tiny step) was half the Trainer's log point.
    stream = _Terminal()
    bar = Progress(total=40, file=stream)
    bar._bar.mininterval = mininterval
    posted = []
    original = bar._bar.set_postfix
    monkeypatch.setattr(bar._bar, "set_postfix", lambda *a, **k: posted.append(1) or original(*a, **k))
    for i in range(20):
        bar.update(2, {"loss": float(i)})
    assert len(posted) == (20 if mininterval == 0 else 0)
    bar.close()
    last = stream.getvalue().split("\r")[-1]
    assert "40/40" in last and "loss=19.0000" in last


def test_an_epoch_end_between_redraws_shows_its_validation_metrics_at_the_next_one(monkeypatch):
    stream = _Terminal()
    bar = Progress(total=8, file=stream)
    bar._bar.mininterval = 3600.0  # no redraw is due
    redraws = []
    original = bar._bar.refresh
    monkeypatch.setattr(bar._bar, "refresh", lambda *a, **k: redraws.append(1) or original(*a, **k))
    bar.update(4, {"loss": 0.5})
    bar.end_epoch({"loss": 0.5, "val_loss": 0.25})
    assert redraws == []  # epochs of a few steps end every few ms: no redraw for each
    bar.update(4, {"loss": 0.125})
    bar.close()
    last = stream.getvalue().split("\r")[-1]
    assert "8/8" in last and "loss=0.1250" in last and "val_loss=0.2500" in last


def test_the_last_line_of_a_fit_that_ends_mid_epoch_holds_the_means_of_its_steps(capsys):
    """fit(steps=8) with epochs of 5 steps printed "epoch 2: 8/8 steps, loss=..." with the
    last log interval's mean (step 8's alone, or steps 7-8), where the guide says the line
    covers the steps after the last epoch end: it now holds steps 6-8's size-weighted mean."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import functree as ft

    rng = np.random.default_rng(2)
    x = rng.normal(size=(22, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0], np.float32)).astype(np.float32)
    trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2))
    capsys.readouterr()
    history = trainer.fit(ft.train.batches((x, y), 5, key=jax.random.key(0)), steps=8, log_every=2)  # stderr: lines
    last = capsys.readouterr().err.strip().splitlines()[-1]
    mean = np.dot([5, 5, 5], history.steps["loss"][5:8]) / 15  # steps 6-8, minibatches of 5
    assert last.startswith(f"epoch 2: 8/8 steps, loss={format_value(float(mean))}, lr=0.1000 (")
