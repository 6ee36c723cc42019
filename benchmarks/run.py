"""functree's benchmark suite: one command, a markdown table and a JSON file.

    python benchmarks/run.py [--quick] [--only NAMES] [--out benchmarks/results]

The same model and Adam step in raw JAX + optax, functree (``ft.jit`` by hand and
``ft.train.train_step``), Equinox, Flax linen and Flax NNX (the ``bench`` extra installs
the last two: ``pip install -e '.[bench]'``), measured in one process, interleaved round
by round; medians, interquartile ranges and ratios to raw JAX. Families (``--only``
takes a comma-separated list of these names):

    dispatch     1. MLP 8-16-16-1, batch 4: µs per call          functree ≤ 1.15× raw
    compute      2. MLP 784-512-512-10 (batch 128), small CNN     ≤ 1.03× raw, equal flops
    compile      3. first call (trace + compile)                  ≤ 1.2× raw
    optimizer    4. Adam over 16M parameters in 16 leaves, GB/s   functree ≥ optax
    async        5. a ~10 ms step returns before it finishes      < 5% of the step time
                    (MLP 4096x3, batch 4096 on an accelerator)
    donation     6. parameters and optimizer state aliased        all bytes aliased
    diagnostics  7. steady-state cost of ft.config.diagnostics     none
    keypaths     8. key paths on a 1000-leaf model                sub-millisecond
    trainer      9. Trainer.fit over a bare step loop             ≤ 1.05×
    depth       10. first call at 4/16/64 blocks: Stack, Sequential  Stack 64 ≤ 2× Stack 4,
                    and raw lax.scan                                 ≤ 1.3× raw scan at 64
    steps_per_call 11. TrainStep(steps_per_call=k), k = 1..64, vs   k=16 ≥ 2× raw per-step
                    raw per-step and raw's own lax.scan               steps/s
    many_leaves 12. Adam update of 150 small leaves (12-layer      gated functree ≤ 1× optax
                    transformer, d=64): gated and ungated             per-leaf
    generate    13. greedy decoding, Llama-style: ft.nn.generate    ≤ 1.0× raw's time
                    vs a raw-JAX KV-cache loop vs HF generate (torch)
    lora        14. a LoRA step (Adam on q, v adapters) vs the    ≤ 1.05× the merged step
                    merged model's step through the same blocks
    lm          15. a Llama training step (bf16, AdamW; 220M on   ≤ 1.02× raw, MFU ≥ 34% (H200),
                    a GPU, tiny on a CPU): tokens/s, MFU, memory,   first step ≤ 1.5× raw
                    time to the first step in fresh processes
    startup     16. loading a saved Llama: ft.nn.from_hf(dir)   ≤ 2× from_pretrained
                    vs transformers from_pretrained, fresh        at every size
                    processes, with the load's split
    first_step  17. the first training step's time, split:    ≤ 1.2× raw in either order
                    imports, build, trace (and the differentiation
                    check's), lowering, compiles; fresh processes,
                    both orders, family 15's Llama
    eager       18. first eager call of ft.nn layers at a new   ≤ 1.2× raw jnp
                    length vs raw jnp (fresh processes), with
                    the programs compiled and run

``benchmarks/gate_pipeline.py`` is the accelerator check of the NaN gate: whether a gated
step keeps the asynchronous pipeline full (raw JAX ungated, cond- and select-gated, and
functree's steps, compute-bound and dispatch-bound, with the compiled HLO's counts).

Run by hand on a quiet machine (``--quick`` for a one-minute smoke run); the tests never
assert wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _steps
from _async import asynchronous
from _depth import depth
from _diagnostics import diagnostics
from _donation import donation
from _eager import eager
from _first_step import first_step
from _generate import generation
from _harness import machine
from _keypaths import key_paths
from _lm import language_model
from _lora import lora_step
from _many_leaves import many_leaves
from _optimizer import optimizer_throughput
from _startup import startup
from _steps import compile_time, compute, dispatch
from _steps_per_call import steps_per_call
from _trainer import trainer

FAMILIES = {
    "dispatch": dispatch,
    "compute": compute,
    "compile": compile_time,
    "optimizer": optimizer_throughput,
    "async": asynchronous,
    "donation": donation,
    "diagnostics": diagnostics,
    "keypaths": key_paths,
    "trainer": trainer,
    "depth": depth,
    "steps_per_call": steps_per_call,
    "many_leaves": many_leaves,
    "generate": generation,
    "lora": lora_step,
    "lm": language_model,
    "startup": startup,
    "first_step": first_step,
    "eager": eager,
}

UNKNOWN = "--only: unknown benchmark {name!r}; the names are {names}.\n    right:  --only dispatch,compute"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: about a minute")
    parser.add_argument("--only", default=None, help="comma-separated families: " + ",".join(FAMILIES))
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of the dispatch family (a loaded machine needs many)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                        help="folder for results.md and results.json")
    args = parser.parse_args(argv)
    args.names = list(FAMILIES) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    for name in args.names:
        if name not in FAMILIES:
            parser.error(UNKNOWN.format(name=name, names=", ".join(FAMILIES)))
    return args


def header(info: dict) -> str:
    v = info["versions"]
    libs = ", ".join(f"{k} {v[k]}" for k in ("jax", "optax", "equinox", "flax") if v.get(k))
    load = info["load_average"]
    return (f"Machine: {info['cpu']}, {info['cores']} cores, {info['device']}; {libs}; "
            f"Python {info['python']}; load average at start "
            f"{'n/a' if load is None else ', '.join(f'{x:.1f}' for x in load)}; {info['date']}.\n\n"
            f"Command: `{info['command']}`\n")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    info = machine()
    info["quick"] = args.quick
    _steps.DISPATCH_ROUNDS = args.rounds
    print(header(info), flush=True)
    tables, seconds = [], {}
    for name in args.names:
        start = time.perf_counter()
        for table in FAMILIES[name](args.quick):
            tables.append(table)
            print(table.markdown(), flush=True)
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"({name}: {seconds[name]} s)\n", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = "## Benchmark results\n\n" + header(info) + "\n" + "\n".join(t.markdown() for t in tables)
    (out / "results.md").write_text(markdown)
    payload = {"machine": info, "seconds": seconds, "results": {t.key: t.as_json() for t in tables}}
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
