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
dispatches), the program and the generated builder of its results (``program.build``: the
rest of the call is the call path's own Python) and raw JAX's step.

``--callgrind`` runs the same stages under ``valgrind --tool=callgrind`` (instrumentation
switched on only around them) and prints the main thread's machine instructions per call:
deterministic, so it resolves on a shared machine what wall-clock time cannot (each stage
is measured at 50 and 250 calls and differenced: no fixed cost left in). It needs valgrind,
its ``callgrind.h`` and a C compiler (a two-line helper is compiled into a temporary folder).

``--leaves N`` takes an MLP of ``N / 2`` dense layers of width 16 instead (``N`` parameter
leaves, ``3 N`` Adam moment and parameter leaves donated): the cost that grows with the
leaves, e.g. ``--leaves 200``.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _impls
import jax
from _models import TINY, Spec

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


def spec_of(leaves: int | None) -> Spec:
    """TINY, or an MLP 8-16-...-16-1 of ``leaves / 2`` dense layers (``leaves`` parameters)."""
    if leaves is None:
        return TINY
    if leaves < 2 or leaves % 2:
        raise SystemExit(f"--leaves takes an even number >= 2 (a weight and a bias per layer), got {leaves}")
    return Spec(f"mlp-{leaves}-leaves", "mlp", 4, (8,) + (16,) * (leaves // 2 - 1) + (1,), loss="mse")


def program_alone(runner: Any, build: bool = False) -> Any:
    """``block(n)``: ``n`` calls of ``runner``'s compiled flat program alone, carrying its
    leaves; with ``build``, each call's results rebuilt by the program's generated builder too."""
    runner.block(8)
    step = runner.step
    direct = getattr(step, "_direct", None)  # a TrainStep's program's bound __call__
    flat = step if direct is None else direct.__self__  # its FlatJit, or ft.jit's
    program, _, leaves = flat._last
    others = program.others((*runner.carry, *runner.args, None, None)[:program.nargs])
    state = {"leaves": leaves}

    def block(n: int) -> None:
        leaves, jitted, gather = state["leaves"], program.jitted, program.gather
        for _ in range(n):
            leaves = jitted(gather(leaves), others)
        jax.block_until_ready(leaves)
        state["leaves"] = leaves

    def built(n: int) -> None:
        leaves, jitted, gather, builder = state["leaves"], program.jitted, program.gather, program.build
        for _ in range(n):
            leaves = jitted(gather(leaves), others)
            builder(leaves)  # the results (and the previous call's, freed)
        jax.block_until_ready(leaves)
        state["leaves"] = leaves

    return built if build else block


def stages(spec: Spec) -> dict[str, Any]:
    """``{name: block}``: raw JAX's step, then each functree step whole, its program alone and
    its program with the builder (each on its own buffers: they are donated)."""
    blocks = {"raw jax.jit + optax": _impls.raw(spec).block}
    makers = {"ft.jit + opt.minimize": lambda: _impls.functree_minimize(spec),
              "ft.train.train_step (gated)": lambda: _impls.functree_train_step(spec),
              'train_step(on_nan="ignore")': lambda: _impls.functree_train_step(spec, on_nan="ignore")}
    for name, make in makers.items():
        blocks[name] = make().block
        blocks[f"{name}: its program alone"] = program_alone(make())
        blocks[f"{name}: its program + builder"] = program_alone(make(), build=True)
    return blocks


def split(spec: Spec, rounds: int = 21, calls: int = 300) -> None:
    """Interleaved µs per call: raw, each functree step, its flat program alone and with the builder."""
    blocks = stages(spec)
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


_HELPER = """#include <valgrind/callgrind.h>
void measure(void (*block)(void), const char *name) {
    CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; block(); CALLGRIND_DUMP_STATS_AT(name);
}
"""


def callgrind(leaves: int | None) -> None:
    """Run :func:`callgrind_child` under callgrind and print instructions per call per stage."""
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "helper.c"), "w") as f:
            f.write(_HELPER)
        subprocess.run(["cc", "-O0", "-shared", "-fPIC", "-o", os.path.join(folder, "helper.so"),
                        os.path.join(folder, "helper.c")], check=True)
        out = os.path.join(folder, "cg.out")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                   f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__), "--callgrind-child",
                   os.path.join(folder, "helper.so"), *(["--leaves", str(leaves)] if leaves else [])]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        totals: dict[str, int] = {}
        dumps = glob.glob(out + ".*-01")  # the main thread's dumps, in the order they were made
        for path in sorted(dumps, key=lambda p: int(p[len(out) + 1:].split("-")[0])):
            with open(path) as f:
                text = f.read()
            name = re.search(r"Client Request: (.+)$", text, re.M)
            if name:
                totals[name.group(1)] = int(re.search(r"^totals: (\d+)", text, re.M).group(1))
    per_call = {}
    for key in totals:
        name, _, n = key.rpartition("@")
        if n == "50":
            per_call[name] = (totals[f"{name}@250"] - totals[key]) / 200
    raw = per_call["raw jax.jit + optax"]
    print("\n| step | main-thread instructions per call | ratio to raw |")
    print("|---|---|---|")
    for name, value in per_call.items():
        print(f"| {name} | {value / 1e3:.1f}k | {value / raw:.3f} |")


def callgrind_child(helper: str, spec: Spec) -> None:
    """Each stage at 50 and 250 calls, each measured between callgrind client requests."""
    blocks = stages(spec)
    for block in blocks.values():
        block(20)
    measure = ctypes.CDLL(helper).measure
    callback = ctypes.CFUNCTYPE(None)
    keep = []
    for name, block in blocks.items():
        for n in (50, 250):
            keep.append(callback(lambda block=block, n=n: block(n)))
            measure(keep[-1], f"{name}@{n}".encode())


def main() -> None:
    leaves = int(sys.argv[sys.argv.index("--leaves") + 1]) if "--leaves" in sys.argv else None
    spec = spec_of(leaves)
    if "--callgrind-child" in sys.argv:
        callgrind_child(sys.argv[sys.argv.index("--callgrind-child") + 1], spec)
        return
    variants = {
        "raw jax.jit + optax": _impls.raw(spec),
        "ft.jit + opt.minimize": _impls.functree_minimize(spec),
        "ft.train.train_step (gated)": _impls.functree_train_step(spec),
        'ft.train.train_step(on_nan="ignore")': _impls.functree_train_step(spec, on_nan="ignore"),
    }
    print(f"{spec.label}, {len(jax.tree.leaves(variants['raw jax.jit + optax'].carry[0]))} parameter leaves\n")
    print("| step | Python bytecodes per call | where | kernels in its program |")
    print("|---|---|---|---|")
    for name, runner in variants.items():
        total, per = count(runner)
        where = ", ".join(f"{k} {v:.0f}" for k, v in per.items() if v >= 1)
        n, ops = kernels(runner)
        print(f"| {name} | {total:.0f} | {where} | {n}: {', '.join(f'{k} {v}' for k, v in ops.items())} |")
    if "--time" in sys.argv:
        split(spec)
    if "--callgrind" in sys.argv:
        callgrind(leaves)


if __name__ == "__main__":
    main()
