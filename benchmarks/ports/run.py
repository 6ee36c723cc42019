"""Ports of an Equinox CNN and a Flax NNX MLP (BatchNorm + Dropout) to functree.

    python benchmarks/ports/run.py [--steps 300] [--rounds 5]

Prints each program's lines (non-blank, without comments) and its steps/s on the same
batches (sklearn's bundled 8x8 digits), interleaved round by round; the median round.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np

PROGRAMS = {"eqx_cnn": "cnn_first", "ft_cnn": "cnn_last", "ft_eqx_cnn": "cnn_first",
            "nnx_mlp": "flat", "ft_mlp": "flat"}


def lines(name: str) -> int:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    with open(path) as f:
        return sum(1 for line in f if line.strip() and not line.strip().startswith("#"))


def batches(layout: str, steps: int, size: int = 32) -> list:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    shape = {"cnn_first": (-1, 1, 8, 8), "cnn_last": (-1, 8, 8, 1), "flat": (-1, 64)}[layout]
    out = []
    for i in range(steps):
        idx = np.arange(i * size, (i + 1) * size) % len(x)
        out.append((jax.numpy.asarray(x[idx].reshape(shape)), jax.numpy.asarray(y[idx].astype(np.int32))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    modules = {name: importlib.import_module(name) for name in PROGRAMS}
    data = {name: batches(layout, args.steps) for name, layout in PROGRAMS.items()}
    key = jax.random.key(1)
    times: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    for _ in range(args.rounds):
        for name, module in modules.items():
            clock = _Clock(data[name])
            jax.block_until_ready(module.train(clock, key))
            times[name].append(time.perf_counter() - clock.start)
    for name in PROGRAMS:
        rate = (args.steps - 1) / statistics.median(times[name])
        print(f"{name:12s} {lines(name):3d} lines  {rate:9.0f} steps/s")


class _Clock:
    """The batches, timing from the second one on: the first step (its compilation, if
    the program compiles inside ``train``) is not counted."""

    def __init__(self, batches: list) -> None:
        self.batches, self.start = batches, 0.0

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == 1:
                self.start = time.perf_counter()
            yield batch


if __name__ == "__main__":
    main()
