"""Family 9: ``Trainer.fit`` per-step overhead over a bare loop of jitted steps.

``Trainer(model, Optimizer(adam), loss_fn).fit(batches, epochs=1)`` with its defaults
(progress bar on, ``log_every=50``, ``on_nan="stop"``), its bar written to a buffer
instead of the terminal, against ``for batch in batches: model, state, m =
step(model, state, batch)`` with ``step = ft.train.train_step(loss_fn, opt)``, blocking
at the end. Raw JAX's loop is shown for scale.

A third table runs epochs of 4 steps (16 examples, batch 4, 100 epochs a fit), where the
per-epoch work (the epoch's read, its end, the shuffle of ``ft.train.batches``) is the
Trainer's cost: a list of minibatches and the arrays cut by ``batches``.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from _harness import Table, interleave, paired_rows
from _impls import functree_model, raw
from _models import LEARNING_RATE, MNIST_MLP, TINY, Spec, data, loss_of

import functree as ft

BARE = "bare loop of ft.train.train_step"


class _Terminal(io.StringIO):
    """A buffer that says it is a terminal: the Trainer draws its tqdm bar there (into any
    other non-terminal stream it writes one line per epoch instead)."""

    def isatty(self) -> bool:
        return True


def _loss(spec: Spec) -> Any:
    def loss_fn(model, batch):
        x, y = batch
        return loss_of(spec, model(x), y)

    return loss_fn


def _bare(spec: Spec, opt: Any, minibatches: list[Any], epochs: int) -> Callable[[], float]:
    """A timed block: ``for batch: model, state, metrics = step(...)`` over ``epochs`` passes
    of ``minibatches``, blocking at the end; seconds per step."""
    step = ft.train.train_step(_loss(spec), opt)
    model = functree_model(spec)
    carry = [model, opt.init(model)]

    def block() -> float:
        start = time.perf_counter()
        m, s = carry
        for _ in range(epochs):
            for b in minibatches:
                m, s, metrics = step(m, s, b)
        jax.block_until_ready(metrics)
        carry[:] = [m, s]
        return (time.perf_counter() - start) / (epochs * len(minibatches))

    return block


def _fit(spec: Spec, opt: Any, data: Any, epochs: int, steps: int, **kwargs: Any) -> Callable[[], float]:
    """A timed block: one ``Trainer.fit`` of ``epochs`` more epochs (``fit(epochs=N)`` counts
    the whole job), its bar drawn into a buffer that says it is a terminal; seconds per step."""
    trainer = ft.train.Trainer(functree_model(spec), opt, _loss(spec))

    def block() -> float:
        start = time.perf_counter()
        with contextlib.redirect_stderr(_Terminal()):
            trainer.fit(data, epochs=trainer.epoch + epochs, **kwargs)
        return (time.perf_counter() - start) / steps

    return block


def _rows(blocks: dict[str, Callable[[], float]], rounds: int) -> list[Any]:
    for b in blocks.values():
        b()
    return paired_rows(interleave(blocks, rounds), BARE, scale=1e6)


class ReadsModel(ft.train.Callback):
    """An on_log that reads trainer.model (an EMA, a weight logger): each log interval is
    read as it ends, so that the model is the one of context.step."""

    def on_log(self, trainer, context):
        self.model = trainer.model


def _table(spec: Spec, steps: int, rounds: int) -> Table:
    batches = [data(spec)] * steps
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))
    raw_runner = raw(spec)

    def raw_loop() -> float:
        start = time.perf_counter()
        raw_runner.block(steps)
        return (time.perf_counter() - start) / steps

    rows = _rows({BARE: _bare(spec, opt, batches, 1),
                  "Trainer.fit (progress bar, log_every=50)": _fit(spec, opt, batches, 1, steps),
                  "Trainer.fit + an on_log callback reading trainer.model":
                      _fit(spec, opt, batches, 1, steps, callbacks=[ReadsModel()]),
                  "raw jax.jit + optax loop (for scale)": raw_loop}, rounds)
    rows[1].ok = rows[1].ratio is not None and rows[1].ratio <= 1.05
    table = Table(f"trainer-{spec.name}", f"9. Trainer.fit overhead: {spec.label}, Adam",
                  "µs/step", "Trainer.fit ≤ 1.05× the bare loop", rows, ratio_label="× bare loop")
    table.notes.append(f"median of {rounds} interleaved rounds × {steps} steps (one fit, one "
                       "epoch, per round); the Trainer's defaults include on_nan=\"stop\"")
    return table


def _short_epochs(epochs: int, rounds: int) -> Table:
    spec = TINY
    x, y = data(spec)
    rng = np.random.default_rng(0)
    x = np.asarray(rng.normal(size=(16, x.shape[1])), np.float32)
    y = np.asarray(rng.normal(size=(16, y.shape[1])), np.float32)
    minibatches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))
    steps = epochs * len(minibatches)
    rows = _rows({BARE: _bare(spec, opt, minibatches, epochs),
                  "Trainer.fit, a list of minibatches": _fit(spec, opt, minibatches, epochs, steps),
                  "Trainer.fit, arrays (shuffled by ft.train.batches)":
                      _fit(spec, opt, (x, y), epochs, steps, batch_size=4)}, rounds)
    table = Table("trainer-short-epochs", f"9. Trainer.fit overhead, epochs of 4 steps: {spec.label}, Adam",
                  "µs/step", "(informational: the per-epoch work)", rows, ratio_label="× bare loop")
    table.notes.append(f"median of {rounds} interleaved rounds × {epochs} epochs of 4 steps (one fit per "
                       "round, progress bar on)")
    return table


def trainer(quick: bool) -> list[Table]:
    if quick:
        return [_table(TINY, 100, 3), _table(MNIST_MLP, 20, 3), _short_epochs(20, 3)]
    return [_table(TINY, 500, 9), _table(MNIST_MLP, 100, 7), _short_epochs(100, 7)]
