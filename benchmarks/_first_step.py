"""Family 17 (``first_step``): where the time to the first training step goes, functree
against raw JAX in the same fresh processes, both orders.

Each probe is a fresh Python process that times, in order: ``import jax``, ``import
functree`` (and optax), the backend's start (``jax.devices()``), then for each step of its
order (``ft`` then ``raw``, or ``raw`` then ``ft``; the first pays the process's first
compile: XLA's own one-time set-up) the model's build (random weights, the optimizer
state: host-to-device copies and the small eager programs of initialisation) and the first
call to its result, split by JAX's own events: tracing (``jaxpr_trace_duration``, and how
many traces), lowering to MLIR, XLA compiles (how many, and their seconds); for functree
also the differentiation check's own trace of the loss (``functree._diagnostics._run``,
inside the step's trace: the re-trace the issue names) and what is left (Python around the
call, the run itself), and the process's CPU seconds over the call (all threads: XLA's
compile runs on several). The model is family 15's Llama (``_lm.size()``: the 220M model on
an accelerator, a tiny one on a CPU) with the same raw-JAX step.

Target (issue 47 item 3): functree's first step ≤ 1.2× raw's in either order.

Run alone: ``python benchmarks/run.py --only first_step``; ``python benchmarks/_first_step.py
probe ft,raw`` is one probe (prints its JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
          "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "compile": "/jax/core/compile/backend_compile_duration"}


def _recorder() -> dict[str, list[float]]:
    """JAX's compile events as they come: ``{event name: [seconds, ...]}``."""
    import jax

    events: dict[str, list[float]] = {}
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: events.setdefault(name, []).append(secs))
    return events


def _diagnostics_timer() -> list[float]:
    """Seconds spent in the differentiation check's trace and analysis, call by call."""
    from functree import _diagnostics

    spent: list[float] = []
    inner = _diagnostics._run

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    _diagnostics._run = timed
    return spent


def _split(events: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for short, name in EVENTS.items():
        found = events.get(name, [])
        out[f"{short}_s"], out[f"{short}s"] = round(sum(found), 3), len(found)
    return out


def one_step(which: str, events: dict[str, list[float]], diagnostics: list[float]) -> dict[str, Any]:
    """Build ``which``'s model and step, then time its first call, split by event."""
    import _lm
    import jax

    events.clear()
    start = time.perf_counter()
    step, params, state = (_lm.functree_step if which == "ft" else _lm.raw_step)("auto")
    batch = _lm.batch_of(_lm.size())
    jax.block_until_ready((params, state, batch))
    build = {"build_s": round(time.perf_counter() - start, 3), **{f"build_{k}": v for k, v in _split(events).items()}}
    events.clear()
    del diagnostics[:]
    start, cpu = time.perf_counter(), time.process_time()
    out = step(params, state, batch)
    jax.block_until_ready(out)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    split = _split(events)
    rest = seconds - split["trace_s"] - split["lower_s"] - split["compile_s"]
    loss = out[2]["loss"] if which == "ft" else out[2]
    return {"which": which, "seconds": round(seconds, 3), "cpu_s": round(cpu, 3), **split, "diagnostics_s": round(sum(diagnostics), 3),
            "diagnostics_calls": len(diagnostics), "rest_s": round(rest, 3), **build, "loss": float(loss)}


def probe(order: list[str]) -> dict[str, Any]:
    """One fresh process's imports, backend start and first steps of ``order``."""
    start = time.perf_counter()
    import jax

    jax_s = time.perf_counter() - start
    start = time.perf_counter()
    import optax  # noqa: F401

    import functree  # noqa: F401

    functree_s = time.perf_counter() - start
    events = _recorder()
    diagnostics = _diagnostics_timer()
    start = time.perf_counter()
    jax.devices()
    backend_s = time.perf_counter() - start
    sys.path.insert(0, HERE)
    steps = [one_step(which, events, diagnostics) for which in order]
    cache = jax.config.jax_compilation_cache_dir
    return {"import_jax_s": round(jax_s, 3), "import_functree_s": round(functree_s, 3),
            "backend_s": round(backend_s, 3), "persistent_cache": cache, "steps": steps}


def _run_probe(order: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.join(HERE, "_first_step.py"), "probe", ",".join(order)],
                         capture_output=True, text=True, check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_step(quick: bool = False) -> Any:
    import _lm
    import numpy as np
    from _harness import Row, Table

    s = _lm.size()
    table = Table("first_step", f"17. time to the first training step, split (Llama d {s.d}, {s.layers} layers, "
                  f"seq {s.seq}, batch {s.batch}, bf16, AdamW), fresh processes, both orders",
                  "ms", "functree ≤ 1.2× raw in either order")
    seconds: dict[tuple[str, int], list[float]] = {}
    splits: dict[str, list[dict[str, Any]]] = {}
    imports: list[dict[str, float]] = []
    for order in (["ft", "raw"], ["raw", "ft"]) * (1 if quick else 3):
        result = _run_probe(order)
        imports.append({k: result[k] for k in ("import_jax_s", "import_functree_s", "backend_s")})
        for position, step in enumerate(result["steps"]):
            seconds.setdefault((step["which"], position), []).append(step["seconds"])
            splits.setdefault(f"{step['which']} ({'first' if position == 0 else 'second'} in its process)",
                              []).append(step)
    for position, label in ((0, "first compile of its process"), (1, "after the other's")):
        ft_row = Row(f"functree train_step, {label}", [v * 1e3 for v in seconds[("ft", position)]])
        raw_row = Row(f"raw JAX step, {label}", [v * 1e3 for v in seconds[("raw", position)]])
        ratio = float(np.median(seconds[("ft", position)]) / np.median(seconds[("raw", position)]))
        ft_row.ratio, ft_row.ok = ratio, ratio <= 1.2
        raw_row.ratio = 1.0
        for row, which in ((ft_row, "ft"), (raw_row, "raw")):
            runs = splits[f"{which} ({'first' if position == 0 else 'second'} in its process)"]
            for part in ("cpu_s", "trace_s", "diagnostics_s", "lower_s", "compile_s", "rest_s", "build_s"):
                row.extra[part[:-2]] = f"{1e3 * float(np.median([r[part] for r in runs])):.0f}"
            row.extra["traces/compiles"] = f"{runs[0]['traces']}/{runs[0]['compiles']}"
        table.rows += [ft_row, raw_row]
    table.columns = ("cpu", "trace", "diagnostics", "lower", "compile", "rest", "build", "traces/compiles")
    table.checks["imports and backend start (s, per probe)"] = imports
    table.checks["split per probe"] = splits
    table.notes.append("cpu = the process's CPU seconds over the call, all threads (XLA compiles on several: "
                       "steadier than the wall time on a loaded machine); "
                       "trace includes diagnostics (the check traces the loss inside the step's trace); "
                       "rest = the call's seconds less trace, lower and compile (Python around the call, the run); "
                       "build = model and optimizer state built and on the device, before the timed call")
    return [table]


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        print(json.dumps(probe(sys.argv[2].split(","))))
    else:
        sys.path.insert(0, HERE)
        print(first_step(quick="--quick" in sys.argv)[0].markdown())
