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
import functools
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import functree as ft

LR = 1e-3
QUEUE = 20


def _params(widths: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        out[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        out[f"b{i}"] = np.zeros(b, np.float32)
    return out


def _batch(widths: tuple[int, ...], n: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((n, widths[0])), jnp.float32),
            jnp.asarray(rng.standard_normal((n, widths[-1])), jnp.float32))


def _forward(params: dict, x: jax.Array, depth: int) -> jax.Array:
    for i in range(depth):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < depth - 1:
            x = jax.nn.relu(x)
    return x


def raw(widths: tuple[int, ...], gate: str | None) -> tuple[Any, Any]:
    """Raw JAX + optax; ``gate``: None (ungated), "cond" or "where"."""
    tx, depth = optax.adam(LR), len(widths) - 1

    def loss_fn(p, x, y):
        return jnp.mean((_forward(p, x, depth) - y) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)

        def apply(ps):
            u, s2 = tx.update(g, ps[1], ps[0])
            return optax.apply_updates(ps[0], u), s2

        if gate is None:
            return (*apply((p, s)), loss)
        ok = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(g)]))
        if gate == "cond":
            p, s = jax.lax.cond(ok, apply, lambda ps: ps, (p, s))
        else:
            p, s = jax.tree.map(lambda n, o: jnp.where(ok, n, o), apply((p, s)), (p, s))
        return p, s, loss

    p = {k: jnp.asarray(v) for k, v in _params(widths).items()}
    return step, (p, tx.init(p))


def functree(widths: tuple[int, ...], on_nan: str) -> tuple[Any, Any]:
    """``ft.train.train_step``."""
    params = _params(widths)
    model = ft.nn.Sequential([
        ft.nn.Dense(params[f"w{i}"].shape[0], params[f"w{i}"].shape[1],
                    jax.nn.relu if i < len(widths) - 2 else ft.nn.identity, key=jax.random.key(0),
                    weight_initializer=lambda k, s, d, v=params[f"w{i}"]: jnp.asarray(v, d),
                    bias_initializer=lambda k, s, d, v=params[f"b{i}"]: jnp.asarray(v, d))
        for i in range(len(widths) - 1)])
    opt = ft.optim.Optimizer(ft.optim.adam(LR))

    def loss_fn(m, batch):  # a new function per variant: no shared compiled program
        x, y = batch
        return jnp.mean((m(x) - y) ** 2)

    step = ft.train.train_step(loss_fn, opt, on_nan=on_nan)
    return step, (model, opt.init(model))


class Variant:
    def __init__(self, name: str, step: Any, carry: tuple, batch: tuple, packed_batch: bool) -> None:
        self.name, self.step, self.carry, self.batch, self.packed = name, step, carry, batch, packed_batch

    def call(self) -> Any:
        out = self.step(*self.carry, self.batch) if self.packed else self.step(*self.carry, *self.batch)
        self.carry = tuple(out[:2])
        return out

    def block(self, n: int) -> float:
        jax.block_until_ready(self.carry)
        start = time.perf_counter()
        for _ in range(n):
            out = self.call()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    def returned(self) -> float:
        jax.block_until_ready(self.carry)
        start = time.perf_counter()
        out = self.call()
        back = time.perf_counter() - start
        jax.block_until_ready(out)
        return back / (time.perf_counter() - start)

    def queued(self) -> float:
        jax.block_until_ready(self.carry)
        start = time.perf_counter()
        for _ in range(QUEUE):
            out = self.call()
        back = time.perf_counter() - start
        jax.block_until_ready(out)
        return back / (time.perf_counter() - start)


class Direct(Variant):
    """A train step's compiled flat program called with the leaves of its last results:
    the program's time without functree's Python around it (the wrapper's share is the
    difference to the step's own row)."""

    def __init__(self, name: str, step: Any, carry: tuple, batch: tuple) -> None:
        super().__init__(name, step, carry, batch, False)
        Variant.block(self, 2)  # through the step itself, then its program
        self.program, _, self.leaves = step._compiled._last
        self.logged = step.on_nan == "stop"
        self.others = jax.tree.leaves([batch[0], None] if self.logged else [batch[0], None, None])

    def call(self) -> Any:
        if not hasattr(self, "program"):
            return super().call()
        p, leaves = self.program, self.leaves
        donated = leaves[p.spans[0][0]:p.spans[1][1]]
        if self.logged:  # the halt log, passed back
            donated = donated + leaves[p.spans[3][0]:p.spans[3][1]]
        self.leaves = p.jitted(donated, self.others)
        self.carry = (self.leaves,)
        return self.leaves


def build(widths: tuple[int, ...], n: int) -> list[Variant]:
    batch = _batch(widths, n)
    out = []
    for gate in (None, "cond", "where"):
        step, carry = raw(widths, gate)
        out.append(Variant(f"raw, {'ungated' if gate is None else 'gated: ' + gate}", step, carry, batch, False))
    for on_nan in ("ignore", "stop"):
        step, carry = functree(widths, on_nan)
        out.append(Variant(f"functree train_step, on_nan={on_nan!r}", step, carry, (batch,), False))
    for on_nan in ("ignore", "stop"):
        step, carry = functree(widths, on_nan)
        out.append(Direct(f"functree train_step, on_nan={on_nan!r}: its compiled program alone", step, carry,
                          (batch,)))
    return out


HOST = ("send", "recv", "infeed", "outfeed", "custom-call", "host", "copy-start", "conditional", "copy(",
        "command_buffer", "while")


def hlo(variants: list[Variant], tag: str, out: Path) -> dict[str, dict[str, int]]:
    counts = {}
    with open(out / "hlo.txt", "a") as f:  # one file: the device tool brings back few
        for v in variants:
            args = (*v.carry, *v.batch)
            text = v.step.lower(*args).compile().as_text()
            f.write(f"\n\n######## {tag}: {v.name}\n\n{text}")
            counts[v.name] = {k: text.count(k) for k in HOST}
    return counts


def measure(variants: list[Variant], rounds: int, calls: int) -> list[dict]:
    for v in variants:
        v.block(calls)
    res: dict[str, dict[str, list[float]]] = {v.name: {"step": [], "ratio": [], "returned": [], "queued": []}
                                               for v in variants}
    for r in range(rounds):
        shift = r % len(variants)
        order = variants[shift:] + variants[:shift]
        times = {}
        for v in order:
            times[v.name] = v.block(calls)
            res[v.name]["returned"].append(v.returned())
            res[v.name]["queued"].append(v.queued())
        for v in variants:
            res[v.name]["step"].append(times[v.name])
            res[v.name]["ratio"].append(times[v.name] / times[variants[0].name])
    rows = []
    for v in variants:
        m = {k: statistics.median(x) for k, x in res[v.name].items()}
        rows.append({"variant": v.name, "step ms": m["step"] * 1e3, "ratio": m["ratio"],
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
    configs = (("compute-bound: MLP 4096-4096-4096-4096, batch 4096", (4096, 4096, 4096, 4096), 4096, 10),
               ("dispatch-bound: MLP 8-16-16-1, batch 4", (8, 16, 16, 1), 4, 200))
    if jax.default_backend() == "cpu":  # a smoke run of the script itself
        configs = (("compute-bound (CPU smoke run): MLP 256-256-256-256, batch 256", (256,) * 4, 256, 5),
                   configs[1])
    for title, widths, n, calls in configs:
        variants = build(widths, n)
        tag = "big" if n > 4 else "tiny"
        payload[tag + " hlo"] = counts = hlo(variants[:5], tag, out)
        rows = measure(variants, 3 if args.quick else 9, calls)
        payload[tag] = rows
        text = table(title, rows) + "\nHLO counts: " + json.dumps(counts) + "\n"
        report.append(text)
        print(text, flush=True)
    (out / "gate_pipeline.md").write_text("\n".join(report))
    (out / "gate_pipeline.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
