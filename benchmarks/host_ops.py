"""The host's Python work per training step, counted: deterministic on any machine.

    python benchmarks/host_ops.py            # the counts
    python benchmarks/host_ops.py --time     # and the wall-clock split, interleaved

For the dispatch family's step (MLP 8-16-16-1, batch 4, Adam): raw ``jax.jit`` + optax,
``ft.jit`` + ``opt.minimize``, ``ft.train.train_step`` (gated, the default) and
``train_step(on_nan="ignore")``, the Python bytecodes one loop call executes and the
Python functions it enters (C functions such as the compiled program's call are not
counted), and the work items of its compiled program (XLA's optimized entry computation:
fusions, copies, dots, conditionals; on a dispatch-bound GPU step each is a kernel launch,
so a program's extra items are its extra time there). Wall-clock ratios on a shared 2-core machine move by ±20% from run to run; these
counts do not, so they show a change to the host path that timing cannot resolve (on a
GPU the host's Python is the whole gap of a dispatch-bound step). Main-thread machine
instructions, the cost of the C side too, come from ``valgrind --tool=callgrind`` (see
``docs/guides/performance.md``).

``--time`` adds the wall-clock split of a loop call, measured in one process, interleaved
round by round (paired ratios to raw): each functree step against its own compiled flat
program called alone with the same leaves (``program.jitted(donated, others)``, what JAX
dispatches: the rest of the call is functree's Python, the builder's included) and against
raw JAX's step.
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _impls
import jax
from _models import TINY

CALLS = 32
_OPCODE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*?\s([a-z][a-z\-]*)\(", re.M)
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def kernels(runner: Any) -> tuple[int, dict[str, int]]:
    """The work items of ``runner``'s compiled step: the instructions of XLA's optimized
    entry computation that run (fusions, copies, dots, conditionals...; not parameters,
    constants, tuples or bitcasts), and their opcodes. On a dispatch-bound GPU step each
    is a kernel launch (a conditional's taken branch adds its own)."""
    text = runner.step.lower(*runner.carry, *runner.args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = collections.Counter(op for op in _OPCODE.findall(entry) if op not in _NO_KERNEL)
    return sum(ops.values()), dict(ops.most_common())


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


def program_alone(runner: Any) -> Any:
    """``block(n)``: ``n`` calls of ``runner``'s compiled flat program alone, carrying its leaves."""
    runner.block(8)
    step = runner.step
    flat = getattr(step, "_direct", None) or step  # a TrainStep's program, or ft.jit's FlatJit
    program, _, leaves = flat._last
    others = program.others((*runner.carry, *runner.args, None, None)[:program.nargs])
    state = {"leaves": leaves}

    def block(n: int) -> None:
        leaves, jitted, gather = state["leaves"], program.jitted, program.gather
        for _ in range(n):
            leaves = jitted(gather(leaves), others)
        jax.block_until_ready(leaves)
        state["leaves"] = leaves

    return block


def split(rounds: int = 21, calls: int = 300) -> None:
    """Interleaved µs per call: raw, each functree step, and its flat program alone."""
    blocks = {"raw jax.jit + optax": _impls.raw(TINY).block}
    makers = {"ft.jit + opt.minimize": lambda: _impls.functree_minimize(TINY),
              "ft.train.train_step (gated)": lambda: _impls.functree_train_step(TINY),
              'train_step(on_nan="ignore")': lambda: _impls.functree_train_step(TINY, on_nan="ignore")}
    for name, make in makers.items():
        blocks[name] = make().block
        blocks[f"{name}: its program alone"] = program_alone(make())  # its own buffers (donated)
    for block in blocks.values():
        block(50)
    times: dict[str, list[float]] = {name: [] for name in blocks}
    names = list(blocks)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            blocks[name](calls)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    raw = times["raw jax.jit + optax"]
    print("\n| step | µs per call (median) | ratio to raw (median of rounds) |")
    print("|---|---|---|")
    for name, values in times.items():
        ratio = statistics.median(v / r for v, r in zip(values, raw))
        print(f"| {name} | {statistics.median(values):.1f} | {ratio:.2f} |")


def main() -> None:
    variants = {
        "raw jax.jit + optax": _impls.raw(TINY),
        "ft.jit + opt.minimize": _impls.functree_minimize(TINY),
        "ft.train.train_step (gated)": _impls.functree_train_step(TINY),
        'ft.train.train_step(on_nan="ignore")': _impls.functree_train_step(TINY, on_nan="ignore"),
    }
    print("| step | Python bytecodes per call | where | kernels in its program |")
    print("|---|---|---|---|")
    for name, runner in variants.items():
        total, per = count(runner)
        where = ", ".join(f"{k} {v:.0f}" for k, v in per.items() if v >= 1)
        n, ops = kernels(runner)
        print(f"| {name} | {total:.0f} | {where} | {n}: {', '.join(f'{k} {v}' for k, v in ops.items())} |")
    if "--time" in sys.argv:
        split()


if __name__ == "__main__":
    main()
