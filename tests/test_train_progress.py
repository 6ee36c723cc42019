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
