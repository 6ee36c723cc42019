"""The host's Python work per training step, counted: deterministic on any machine.

    python benchmarks/host_ops.py

For the dispatch family's step (MLP 8-16-16-1, batch 4, Adam): raw ``jax.jit`` + optax,
``ft.jit`` + ``opt.minimize``, ``ft.train.train_step`` (gated, the default) and
``train_step(on_nan="ignore")``, the Python bytecodes one loop call executes and the
Python functions it enters (C functions such as the compiled program's call are not
counted). Wall-clock ratios on a shared 2-core machine move by ±20% from run to run; these
counts do not, so they show a change to the host path that timing cannot resolve (on a
GPU the host's Python is the whole gap of a dispatch-bound step). Main-thread machine
instructions, the cost of the C side too, come from ``valgrind --tool=callgrind`` (see
``docs/guides/performance.md``).
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _impls
from _models import TINY

CALLS = 32


def count(runner: Any, calls: int = CALLS) -> tuple[float, dict[str, float]]:
    """(bytecodes per call, {function: bytecodes per call}) of ``runner``'s loop calls."""
    runner.block(8)  # compiled, and the loop's fast path set
    ops: collections.Counter[str] = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            ops[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        return trace

    sys.settrace(trace)
    try:
        runner.block(calls)
    finally:
        sys.settrace(None)
    ops.pop("_impls.py:block", None)  # the benchmark's own loop
    per = {name: n / calls for name, n in ops.most_common()}
    return sum(per.values()), per


def main() -> None:
    variants = {
        "raw jax.jit + optax": _impls.raw(TINY),
        "ft.jit + opt.minimize": _impls.functree_minimize(TINY),
        "ft.train.train_step (gated)": _impls.functree_train_step(TINY),
        'ft.train.train_step(on_nan="ignore")': _impls.functree_train_step(TINY, on_nan="ignore"),
    }
    print("| step | Python bytecodes per call | where |")
    print("|---|---|---|")
    for name, runner in variants.items():
        total, per = count(runner)
        where = ", ".join(f"{k} {v:.0f}" for k, v in per.items() if v >= 1)
        print(f"| {name} | {total:.0f} | {where} |")


if __name__ == "__main__":
    main()
