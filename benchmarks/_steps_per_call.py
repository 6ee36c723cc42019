"""Family 11: several steps per compiled call (``TrainStep(steps_per_call=k)``).

The tiny dispatch-bound step (MLP 8-16-16-1, batch 4, Adam): µs per *step* of

- raw JAX's per-step loop (``jax.jit`` + optax, donated), the reference;
- raw JAX with its own hand-written ``lax.scan`` over ``k`` steps per call (``k`` = 4, 16, 64);
- ``ft.train.TrainStep(loss_fn, opt, steps_per_call=k)`` (default ``on_nan="stop"``) for
  ``k`` = 1, 4, 16, 64, on batches stacked beforehand (``ft.train.stack_batches``);
- ``Trainer.fit(steps_per_call=16)`` over a list of minibatches (it stacks them itself).

Each timed block runs the same number of steps (64 calls of the largest ``k``); the
``× raw scan`` column is the median per-round ratio to raw's own scan at the same ``k``.
Goal: functree at ``k = 16`` at least 2× the steps per second of raw's per-step loop
(a ratio ≤ 0.5).
"""

from __future__ import annotations

import contextlib
import functools
import io
import time
from collections.abc import Callable

import jax
import optax
from _harness import Table, interleave, paired_rows, quantiles
from _impls import functree_model, raw_forward, raw_params
from _models import LEARNING_RATE, TINY, data, loss_of

import functree as ft

RAW_LOOP = "raw jax.jit + optax, one step per call"
KS = (1, 4, 16, 64)


def _raw(k: int) -> Callable[[int], None]:
    """Raw JAX: ``steps`` steps in calls of ``k`` (k = 1: the per-step loop; else its own scan)."""
    tx = optax.adam(LEARNING_RATE)

    def one(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_of(TINY, raw_forward(TINY, p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def scanned(params, opt_state, xs, ys):
        def body(carry, b):
            p, s, loss = one(*carry, *b)
            return (p, s), loss
        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
        return params, opt_state, losses

    step = jax.jit(one, donate_argnums=(0, 1)) if k == 1 else scanned
    x, y = data(TINY)
    args = (x, y) if k == 1 else ft.train.stack_batches([(x, y)] * k)
    params = raw_params(TINY)
    carry = [params, tx.init(params)]

    def run(steps: int) -> None:
        p, s = carry
        for _ in range(steps // k):
            p, s, out = step(p, s, *args)
        jax.block_until_ready(out)
        carry[:] = [p, s]

    return run


def _functree(k: int) -> Callable[[int], None]:
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    def loss_fn(model, batch):
        x, y = batch
        return loss_of(TINY, model(x), y)

    step = ft.train.TrainStep(loss_fn, opt, steps_per_call=k)
    batch = data(TINY) if k == 1 else ft.train.stack_batches([data(TINY)] * k)
    model = functree_model(TINY)
    carry = [model, opt.init(model)]

    def run(steps: int) -> None:
        m, s = carry
        for _ in range(steps // k):
            m, s, out = step(m, s, batch)
        jax.block_until_ready(out)
        carry[:] = [m, s]

    return run


def _trainer(k: int) -> Callable[[int], None]:
    def loss_fn(model, batch):
        x, y = batch
        return loss_of(TINY, model(x), y)

    trainer = ft.train.Trainer(functree_model(TINY), ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE)), loss_fn,
                               steps_per_call=k)
    batch = data(TINY)

    def run(steps: int) -> None:
        with contextlib.redirect_stderr(io.StringIO()):
            trainer.fit([batch] * steps, epochs=trainer.epoch + 1)  # epochs= counts the whole job

    return run


def steps_per_call(quick: bool) -> list[Table]:
    """11. µs per step with k steps per call, against raw per-step and raw's own scan."""
    rounds, steps = (5, 2 * max(KS)) if quick else (15, 8 * max(KS))
    runners: dict[str, Callable[[int], None]] = {RAW_LOOP: _raw(1)}
    scan_name = {k: f"raw jax.jit + optax, own lax.scan, k={k}" for k in KS[1:]}
    ft_name = {k: f"functree TrainStep(steps_per_call={k})" for k in KS}
    for k in KS[1:]:
        runners[scan_name[k]] = _raw(k)
    for k in KS:
        runners[ft_name[k]] = _functree(k)
    fit16 = "functree Trainer.fit(steps_per_call=16), list of minibatches"
    runners[fit16] = _trainer(16)
    for run in runners.values():  # compile and warm
        run(steps)

    def block(run: Callable[[int], None]) -> Callable[[], float]:
        def timed() -> float:
            start = time.perf_counter()
            run(steps)
            return (time.perf_counter() - start) / steps
        return timed

    values = interleave({name: block(run) for name, run in runners.items()}, rounds)
    rows = paired_rows(values, RAW_LOOP, scale=1e6)
    by_name = {r.name: r for r in rows}
    for k in KS:
        row = by_name[ft_name[k]]
        if k in scan_name:
            per_round = [a / b for a, b in zip(values[ft_name[k]], values[scan_name[k]])]
            row.extra["× raw scan"] = f"{quantiles(per_round)[1]:.2f}"
        if k == 16:
            row.ok = row.ratio is not None and row.ratio <= 0.5
    table = Table("steps-per-call", f"11. Steps per call: {TINY.label}, Adam", "µs/step",
                  "TrainStep(steps_per_call=16) ≥ 2× raw per-step steps/s (ratio ≤ 0.5)", rows,
                  columns=("× raw scan",), ratio_label="× raw per-step")
    table.notes.append(f"median of {rounds} interleaved rounds × {steps} steps per variant; batches "
                       "stacked beforehand except for Trainer.fit, which stacks each group of 16 itself; "
                       "functree with its default on_nan=\"stop\"")
    return [table]
