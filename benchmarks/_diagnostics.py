"""Family 7: functree's differentiation diagnostics cost nothing in the steady state.

The diagnostics analyse a differentiated function's jaxpr once per traced signature. Three
pairs, each interleaved with ``ft.config.diagnostics`` on and off: a jitted step after its
first trace (the target), eager ``ft.value_with_gradient`` calls (each computes the cache
key), and the first call of a fresh jitted step (where the analysis runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
from _harness import Row, Table, interleave, paired_rows, timed
from _impls import functree_minimize, functree_model
from _models import TINY, data, loss_of

import functree as ft


def _pair(label: str, on: Callable[[], float], off: Callable[[], float], rounds: int,
          scale: float) -> list[Row]:
    def under(flag: bool, fn: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            with ft.config.override(diagnostics=flag):
                return fn()
        return run

    values = interleave({f"{label}, diagnostics off": under(False, off),
                         f"{label}, diagnostics on": under(True, on)}, rounds)
    return paired_rows(values, f"{label}, diagnostics off", scale=scale)


def diagnostics(quick: bool) -> list[Table]:
    rounds, calls = (5, 50) if quick else (25, 300)
    runners = {}
    for flag in (False, True):
        with ft.config.override(diagnostics=flag):
            runners[flag] = functree_minimize(TINY)
            runners[flag].block(calls)
    rows = _pair("ft.jit step (after its first trace)",
                 lambda: timed(lambda: runners[True].block(calls)) / calls,
                 lambda: timed(lambda: runners[False].block(calls)) / calls, rounds, 1e6)
    rows[-1].ok = rows[-1].ratio is not None and rows[-1].ratio <= 1.02

    model, (x, y) = functree_model(TINY), data(TINY)
    grad = ft.value_with_gradient(lambda m, x, y: loss_of(TINY, m(x), y))
    eager_calls = 3 if quick else 10

    def eager_block() -> float:
        start = time.perf_counter()
        out = None
        for _ in range(eager_calls):
            out = grad(model, x, y)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / eager_calls

    for flag in (False, True):
        with ft.config.override(diagnostics=flag):
            eager_block()
    rows += _pair("eager ft.value_with_gradient", eager_block, eager_block, rounds, 1e6)

    def first_call() -> float:
        return timed(functree_minimize(TINY).call)

    rows += _pair("first call of a fresh ft.jit step (ms)", first_call, first_call,
                  2 if quick else 5, 1e3)
    table = Table("diagnostics", f"7. Diagnostics: {TINY.label}, Adam", "µs (ms where marked)",
                  "zero steady-state cost after the first trace (on/off ≤ 1.02)", rows,
                  ratio_label="ratio on/off")
    table.notes.append(f"median of {rounds} interleaved rounds; ratio = per-round on/off; "
                       "only the jitted step after its first trace carries the target")
    return [table]
