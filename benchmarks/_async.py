"""Family 5: asynchronous dispatch — a ~10 ms step returns long before its result is ready."""

from __future__ import annotations

import time

import jax
from _harness import Row, Table, interleave, quantiles
from _impls import FUNCTREE, RAW, Runner, available
from _models import MNIST_MLP, WIDE_MLP


def _one(runner: Runner) -> tuple[float, float]:
    """``(seconds until step(...) returned, seconds until its result was ready)``."""
    jax.block_until_ready(runner.carry)
    start = time.perf_counter()
    out = runner.call()
    returned = time.perf_counter()
    jax.block_until_ready((out, runner.carry))
    return returned - start, time.perf_counter() - start


def asynchronous(quick: bool) -> list[Table]:
    rounds = 5 if quick else 31
    spec = MNIST_MLP if jax.default_backend() == "cpu" else WIDE_MLP  # ~10 ms on the CPU, ~4 ms on an H100
    runners = {name: build(spec) for name, build in available((RAW, *FUNCTREE)).items()}
    for r in runners.values():
        r.block(2)
    pairs = interleave({name: (lambda r=r: _one(r)) for name, r in runners.items()}, rounds)
    rows = []
    for name, ps in pairs.items():
        returned = [p[0] * 1e6 for p in ps]
        fractions = [p[0] / p[1] for p in ps]
        step_ms = quantiles([p[1] * 1e3 for p in ps])[1]
        fraction = quantiles(fractions)[1]
        rows.append(Row(name, returned, ok=fraction < 0.05 if name in FUNCTREE else None,
                        extra={"step ms": f"{step_ms:.2f}", "returned at": f"{100 * fraction:.2f}% of step"}))
    table = Table("async", f"5. Asynchronous dispatch: {spec.label}",
                  "µs until step() returns", "step(...) returns in under 5% of the step time", rows,
                  columns=("step ms", "returned at"), ratio_label="—")
    table.notes.append(f"median of {rounds} interleaved single calls, each started with every "
                       "input ready; 'step ms' is the time until the result is ready")
    return [table]
