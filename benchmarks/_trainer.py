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


def _table(spec: Spec, steps: int, rounds: int) -> Table:
    batch = data(spec)
    batches = [batch] * steps

    def loss_fn(model, batch):
        x, y = batch
        return loss_of(spec, model(x), y)

    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))
    trainer = ft.train.Trainer(functree_model(spec), opt, loss_fn)
    step = ft.train.train_step(loss_fn, opt)
    model = functree_model(spec)
    carry = [model, opt.init(model)]
    raw_runner = raw(spec)

    def fit() -> float:
        start = time.perf_counter()
        with contextlib.redirect_stderr(_Terminal()):
            trainer.fit(batches, epochs=trainer.epoch + 1)  # epochs= counts the whole job: one more
        return (time.perf_counter() - start) / steps

    class ReadsModel(ft.train.Callback):
        """An on_log that reads trainer.model (an EMA, a weight logger): each log interval
        is read as it ends, so that the model is the one of context.step."""

        def on_log(self, trainer, context):
            self.model = trainer.model

    reading = ft.train.Trainer(functree_model(spec), opt, loss_fn)
    callback = [ReadsModel()]

    def fit_reading() -> float:
        start = time.perf_counter()
        with contextlib.redirect_stderr(_Terminal()):
            reading.fit(batches, epochs=reading.epoch + 1, callbacks=callback)
        return (time.perf_counter() - start) / steps

    def bare() -> float:
        start = time.perf_counter()
        m, s = carry
        for b in batches:
            m, s, metrics = step(m, s, b)
        jax.block_until_ready(metrics)
        carry[:] = [m, s]
        return (time.perf_counter() - start) / steps

    def raw_loop() -> float:
        start = time.perf_counter()
        raw_runner.block(steps)
        return (time.perf_counter() - start) / steps

    blocks = {BARE: bare, "Trainer.fit (progress bar, log_every=50)": fit,
              "Trainer.fit + an on_log callback reading trainer.model": fit_reading,
              "raw jax.jit + optax loop (for scale)": raw_loop}
    for b in blocks.values():
        b()
    values = interleave(blocks, rounds)
    rows = paired_rows(values, BARE, scale=1e6)
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
    steps = 4 * epochs

    def loss_fn(model, batch):
        xb, yb = batch
        return loss_of(spec, model(xb), yb)

    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))
    step = ft.train.train_step(loss_fn, opt)
    model = functree_model(spec)
    carry = [model, opt.init(model)]

    def bare() -> float:
        start = time.perf_counter()
        m, s = carry
        for _ in range(epochs):
            for b in minibatches:
                m, s, metrics = step(m, s, b)
        jax.block_until_ready(metrics)
        carry[:] = [m, s]
        return (time.perf_counter() - start) / steps

    def fitting(make_data: Any) -> Any:
        trainer = ft.train.Trainer(functree_model(spec), opt, loss_fn)

        def fit() -> float:
            start = time.perf_counter()
            with contextlib.redirect_stderr(_Terminal()):
                trainer.fit(make_data(), epochs=trainer.epoch + epochs, batch_size=4)
            return (time.perf_counter() - start) / steps

        return fit

    blocks = {BARE: bare, "Trainer.fit, a list of minibatches": fitting(lambda: minibatches),
              "Trainer.fit, arrays (shuffled by ft.train.batches)": fitting(lambda: (x, y))}
    for b in blocks.values():
        b()
    rows = paired_rows(interleave(blocks, rounds), BARE, scale=1e6)
    table = Table("trainer-short-epochs", f"9. Trainer.fit overhead, epochs of 4 steps: {spec.label}, Adam",
                  "µs/step", "(informational: the per-epoch work)", rows, ratio_label="× bare loop")
    table.notes.append(f"median of {rounds} interleaved rounds × {epochs} epochs of 4 steps (one fit per "
                       "round, progress bar on)")
    return table


def trainer(quick: bool) -> list[Table]:
    if quick:
        return [_table(TINY, 100, 3), _table(MNIST_MLP, 20, 3), _short_epochs(20, 3)]
    return [_table(TINY, 500, 9), _table(MNIST_MLP, 100, 7), _short_epochs(100, 7)]
