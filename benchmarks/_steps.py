"""Families 1–3: a training step's per-call time (dispatch-bound and compute-bound) and
its first-call (trace + compile) time, every library interleaved against raw JAX."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
from _harness import Row, Table, interleave, paired_rows, timed
from _impls import FUNCTREE, RAW, Runner, available
from _models import CNN, MNIST_MLP, TINY, Spec


def _warm(runners: dict[str, Runner], calls: int, times: int = 2) -> None:
    for _ in range(times):
        for r in runners.values():
            r.block(calls)


def _per_call(runners: dict[str, Runner], calls: int, rounds: int, scale: float) -> list[Row]:
    """Wall time per call (the rows) and, in ``extra["cpu ratio"]``, the median per-round
    ratio of the process's CPU time per call: on a machine that other processes load, CPU
    time moves far less than wall time (it still counts XLA's worker threads)."""
    cpu: dict[str, list[float]] = {name: [] for name in runners}

    def block(name: str, r: Runner):
        def run() -> float:
            start = time.process_time()
            wall = timed(lambda: r.block(calls)) / calls
            cpu[name].append((time.process_time() - start) / calls)
            return wall
        return run

    values = interleave({name: block(name, r) for name, r in runners.items()}, rounds)
    rows = paired_rows(values, RAW, scale=scale)
    for row in rows:
        ratios = [v / r for v, r in zip(cpu[row.name], cpu[RAW])]
        row.extra["cpu ratio"] = f"{statistics.median(ratios):.2f}"
    return rows


def _judge(rows: list[Row], limit: float) -> None:
    for row in rows:
        if row.name in FUNCTREE and row.ratio is not None:
            row.ok = row.ratio <= limit


DISPATCH_ROUNDS: int | None = None
"""Rounds of the dispatch family when given (``run.py --rounds``): a loaded machine needs many."""


def dispatch(quick: bool) -> list[Table]:
    """1. MLP 8-16-16-1, batch 4, Adam: µs per call."""
    rounds, calls = (5, 50) if quick else (25, 300)
    rounds = DISPATCH_ROUNDS or rounds
    runners = {name: build(TINY) for name, build in available().items()}
    _warm(runners, calls // 2)
    rows = _per_call(runners, calls, rounds, 1e6)
    _judge(rows, 1.15)
    table = Table("dispatch", f"1. Dispatch-bound step: {TINY.label}, Adam", "µs/call",
                  "functree ≤ 1.15× raw, by hand and through train_step", rows, columns=("cpu ratio",))
    table.notes.append(f"median of {rounds} interleaved rounds × {calls} calls; ratio = median of "
                       "per-round ratios to raw (IQR in parentheses); cpu ratio: the same of the "
                       "process's CPU time per call")
    return [table]


def flops(runner: Runner) -> float | None:
    try:
        compiled = runner.lower()
    except Exception:
        return None
    if compiled is None:
        return None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", float("nan")))


def _compute_table(spec: Spec, quick: bool) -> Table:
    rounds, calls = (3, 2) if quick else (15, 6)
    runners = {name: build(spec) for name, build in available().items()}
    # Lowering compiles the step once more: in --quick, only where the target needs it.
    counts = {name: flops(r) if not quick or name in (RAW, *FUNCTREE) else None
              for name, r in runners.items()}
    _warm(runners, 1)
    rows = _per_call(runners, calls, rounds, 1e3)
    _judge(rows, 1.03)
    raw_flops = counts[RAW]
    for row in rows:
        n = counts[row.name]
        row.extra["flops"] = "—" if n is None else f"{n:.4g}"
        if row.name in FUNCTREE:
            same = n == raw_flops
            row.extra["flops = raw"] = "yes" if same else f"no ({n - raw_flops:+.0f})"
            row.ok = bool(row.ok) and same
    table = Table(f"compute-{spec.name}", f"2. Compute-bound step: {spec.label}, Adam", "ms/step",
                  "functree ≤ 1.03× raw, and cost_analysis() flops equal to raw's", rows,
                  columns=("flops", "flops = raw"))
    table.checks = {"flops": counts}
    table.notes.append(f"median of {rounds} interleaved rounds × {calls} steps; flops from the "
                       "compiled step's cost_analysis() (— where the library exposes no lowering)")
    return table


def compute(quick: bool) -> list[Table]:
    """2. MLP 784-512-512-10 at batch 128 and a small CNN (batch 32): ms per step and flops."""
    return [_compute_table(MNIST_MLP, quick), _compute_table(CNN, quick)]


def _compile_table(spec: Spec, rounds: int) -> Table:
    builders = available()

    def first_call(build: Any):
        def run() -> float:
            runner = build(spec)  # a fresh jitted function: its first call traces and compiles
            return timed(runner.call)
        return run

    values = interleave({name: first_call(b) for name, b in builders.items()}, rounds)
    rows = paired_rows(values, RAW, scale=1e3)
    _judge(rows, 1.2)
    table = Table(f"compile-{spec.name}", f"3. First call (trace + compile + run): {spec.label}",
                  "ms", "functree ≤ 1.2× raw", rows)
    table.notes.append(f"median of {rounds} interleaved rounds, each on a freshly built step "
                       "(model construction not timed); functree's differentiation diagnostics "
                       f"are {'on' if _diagnostics_on() else 'off'} (the default is on)")
    return table


def _diagnostics_on() -> bool:
    import functree as ft

    return bool(ft.config.diagnostics)


def compile_time(quick: bool) -> list[Table]:
    """3. First-call compile time."""
    jax.block_until_ready(jax.numpy.ones(1))  # backend up before any timing
    if quick:
        return [_compile_table(TINY, 2)]
    return [_compile_table(TINY, 5), _compile_table(MNIST_MLP, 3)]
