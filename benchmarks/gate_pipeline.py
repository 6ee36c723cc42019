"""The NaN gate on an accelerator: does a gated step keep the asynchronous pipeline full?

    python benchmarks/gate_pipeline.py [--quick] [--out DIR]

A gated step (``on_nan="stop"``, functree's default) applies its update only when the loss
and every gradient are finite. Written as ``lax.cond`` the branch needs its predicate; on a
GPU, XLA's runtime may read that predicate back to the host before it launches the branch
(unless the conditional runs inside a CUDA graph), which would make every ``step()`` call
wait for the forward and backward pass: the host could no longer queue step ``n + 1``
while the device runs step ``n``. Written as ``where(ok, new, old)`` the gate is
arithmetic fused into the update's kernels, with no predicate read on the host.

Measured, each variant interleaved round by round against raw JAX's ungated step, on two
models (a compute-bound MLP 4096-4096-4096-4096, batch 4096, and the dispatch-bound MLP
8-16-16-1, batch 4), Adam:

- ``step ms``: time per step over a block of calls (the pipeline full);
- ``returned at``: time until one ``step(...)`` call returns, as a share of its step, the
  call started with every input ready (family 5's measure; < 5% keeps the pipeline full);
- ``program``: the train steps' compiled programs called directly on their leaves, to
  split a step's time between functree's Python wrapper and the program;
- ``queued``: time until the last of 20 back-to-back calls returns, as a share of the 20
  steps' time (near 100% when every call waits for its step).

Also written under ``--out``: each gated variant's compiled HLO and the counts of its
conditionals, copies, host transfers and custom calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _impls import Runner, functree_train_step, raw
from _models import TINY, WIDE_MLP, Spec

QUEUE = 20
SMOKE = Spec("mlp-256x3", "mlp", 256, (256, 256, 256, 256), loss="mse")


class Direct(Runner):
    """A train step's compiled flat program called with the leaves of its last results:
    the program's time without functree's Python around it (the wrapper's share is the
    difference to the step's own row)."""

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner.step, runner.carry, runner.args)
        runner.block(2)  # through the step itself, then its program
        step = runner.step
        self.program, _, self.leaves = step._compiled._last
        self.logged = step.on_nan == "stop"
        self.others = jax.tree.leaves([runner.args[0], None] if self.logged else [runner.args[0], None, None])
        self.carry = (self.leaves,)

    def call(self) -> Any:
        p, leaves = self.program, self.leaves
        donated = leaves[p.spans[0][0]:p.spans[1][1]]
        if self.logged:  # the halt log, passed back
            donated = donated + leaves[p.spans[3][0]:p.spans[3][1]]
        self.leaves = p.jitted(donated, self.others)
        self.carry = (self.leaves,)
        return self.leaves


def _ready(r: Runner) -> None:
    jax.block_until_ready(r.carry)


def per_call(r: Runner, n: int) -> float:
    """Seconds per call over ``n`` calls, blocked on the last."""
    _ready(r)
    start = time.perf_counter()
    for _ in range(n):
        out = r.call()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n


def returned(r: Runner, n: int = 1) -> float:
    """Time until the last of ``n`` calls returned, as a share of the time until it was done."""
    _ready(r)
    start = time.perf_counter()
    for _ in range(n):
        out = r.call()
    back = time.perf_counter() - start
    jax.block_until_ready(out)
    return back / (time.perf_counter() - start)


def build(spec: Spec) -> dict[str, Runner]:
    out = {f"raw, {'ungated' if gate is None else 'gated: ' + gate}": raw(spec, gate)
           for gate in (None, "cond", "where")}
    for on_nan in ("ignore", "stop"):
        out[f"functree train_step, on_nan={on_nan!r}"] = functree_train_step(spec, on_nan)
    for on_nan in ("ignore", "stop"):
        out[f"functree train_step, on_nan={on_nan!r}: its compiled program alone"] = Direct(
            functree_train_step(spec, on_nan))
    return out


HOST = ("send", "recv", "infeed", "outfeed", "custom-call", "host", "copy-start", "conditional", "copy(",
        "command_buffer", "while")


def hlo(runners: dict[str, Runner], tag: str, out: Path) -> dict[str, dict[str, int]]:
    counts = {}
    with open(out / "hlo.txt", "a") as f:  # one file: the device tool brings back few
        for name, r in runners.items():
            text = r.lower().as_text()
            f.write(f"\n\n######## {tag}: {name}\n\n{text}")
            counts[name] = {k: text.count(k) for k in HOST}
    return counts


def measure(runners: dict[str, Runner], rounds: int, calls: int) -> list[dict]:
    names = list(runners)
    for r in runners.values():
        per_call(r, calls)
    res: dict[str, dict[str, list[float]]] = {n: {"step": [], "ratio": [], "returned": [], "queued": []}
                                               for n in names}
    for k in range(rounds):
        times = {}
        for name in names[k % len(names):] + names[:k % len(names)]:
            r = runners[name]
            times[name] = per_call(r, calls)
            res[name]["returned"].append(returned(r))
            res[name]["queued"].append(returned(r, QUEUE))
        for name in names:
            res[name]["step"].append(times[name])
            res[name]["ratio"].append(times[name] / times[names[0]])
    rows = []
    for name in names:
        m = {k: statistics.median(x) for k, x in res[name].items()}
        rows.append({"variant": name, "step ms": m["step"] * 1e3, "ratio": m["ratio"],
                     "returned at %": 100 * m["returned"], "queued %": 100 * m["queued"]})
    return rows


def table(title: str, rows: list[dict]) -> str:
    lines = [f"### {title}", "", "| variant | step ms | ratio to raw ungated | returned at (% of step) "
             "| 20 queued calls returned at (% of their time) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['step ms']:.3f} | {r['ratio']:.2f} | {r['returned at %']:.1f} "
                     f"| {r['queued %']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="gate_pipeline_results")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hlo.txt").write_text("")
    dev = jax.devices()[0]
    head = f"Device: {dev.device_kind} ({jax.default_backend()}); jax {jax.__version__}, optax {optax.__version__}\n"
    print(head, flush=True)
    report, payload = [head], {"device": dev.device_kind, "jax": jax.__version__}
    configs = ((f"compute-bound: {WIDE_MLP.label}", WIDE_MLP, 10), (f"dispatch-bound: {TINY.label}", TINY, 200))
    if jax.default_backend() == "cpu":  # a smoke run of the script itself
        configs = ((f"compute-bound (CPU smoke run): {SMOKE.label}", SMOKE, 5), configs[1])
    for title, spec, calls in configs:
        runners = build(spec)
        tag = "tiny" if spec is TINY else "big"
        payload[tag + " hlo"] = counts = hlo(dict(list(runners.items())[:5]), tag, out)
        rows = measure(runners, 3 if args.quick else 9, calls)
        payload[tag] = rows
        text = table(title, rows) + "\nHLO counts: " + json.dumps(counts) + "\n"
        report.append(text)
        print(text, flush=True)
    (out / "gate_pipeline.md").write_text("\n".join(report))
    (out / "gate_pipeline.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
