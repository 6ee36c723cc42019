"""The tqdm progress bar."""

import io

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
