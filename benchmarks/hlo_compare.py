"""The first step's program, functree against raw JAX: what each hands XLA (issue 47 item 3).

Lowers family 15's two training steps (``_lm.functree_step("auto")`` and
``_lm.raw_step("auto")``: the tiny Llama on a CPU) and prints, side by side, the StableHLO
(operations by name, functions, calls, parameters, results, converts, ``case``/``while``,
dots and their ``precision``, aliased outputs) and, unless ``--no-compile``, XLA's
optimized HLO (instructions by opcode, fusions, while loops, custom calls) with the
seconds of each compile.

Run: ``python benchmarks/hlo_compare.py [--no-compile] [--dump DIR] [--on-nan ignore]``.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
STABLEHLO_OP = re.compile(r"\b(stablehlo|chlo|func|sdy|mhlo)\.([a-z_]+)")
HLO_OP = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*?\s([a-z][a-z\-]*)\(", re.M)  # types may hold /*index=5*/


def lowered(which: str, on_nan: str | None = None) -> tuple[Any, float]:
    """``which``'s step (``"ft"`` or ``"raw"``) lowered for its model, state and batch, and
    the seconds of the trace and lowering alone (the model's build is not counted)."""
    import _lm

    import functree as ft

    batch = _lm.batch_of(_lm.size())
    if which == "raw":
        step, params, state = _lm.raw_step("auto")
    else:
        step, params, state = _lm.functree_step("auto")
        if on_nan is not None:
            step = ft.train.train_step(_lm.lm_loss, step.optimizer, compute_dtype=step.compute_dtype, on_nan=on_nan)
    start = time.perf_counter()
    low = step.lower(params, state, batch)
    return low, time.perf_counter() - start


def stablehlo_counts(text: str) -> dict[str, Any]:
    """Operations by name and the program's signature, from its StableHLO text."""
    ops = collections.Counter(f"{d}.{n}" for d, n in STABLEHLO_OP.findall(text))
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    results = main.split("->", 1)[1] if "->" in main else ""
    return {
        "operations": sum(ops.values()), "functions": ops.pop("func.func", 0), "calls": ops.get("func.call", 0),
        "main parameters": main.count("%arg"), "main results": results.count("tensor<"),
        "aliased (donated) outputs": main.count("tf.aliasing_output"),
        "precision=": len(re.findall(r"precision_config|precision = ", text)),
        "by op": dict(ops.most_common()),
    }


def hlo_counts(text: str) -> dict[str, Any]:
    """Instructions by opcode in XLA's optimized HLO, and its computations."""
    ops = collections.Counter(HLO_OP.findall(text))
    return {"instructions": sum(ops.values()), "computations": len(re.findall(r"^(?:ENTRY )?%[\w.\-]+ ", text, re.M)),
            "fusions": ops.get("fusion", 0), "while": ops.get("while", 0), "custom-call": ops.get("custom-call", 0),
            "convert": ops.get("convert", 0), "by op": dict(ops.most_common())}


def _table(title: str, a: dict[str, Any], b: dict[str, Any]) -> str:
    lines = [f"## {title}", "", "| | functree | raw |", "|---|---|---|"]
    for key in a:
        if key != "by op":
            lines.append(f"| {key} | {a[key]} | {b.get(key)} |")
    for op in sorted(set(a["by op"]) | set(b["by op"]), key=lambda o: -(a["by op"].get(o, 0) + b["by op"].get(o, 0))):
        x, y = a["by op"].get(op, 0), b["by op"].get(op, 0)
        lines.append(f"| {op} | {x} | {y} |" + (" ←" if x != y else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    sys.path.insert(0, HERE)
    compile_ = "--no-compile" not in argv
    dump = argv[argv.index("--dump") + 1] if "--dump" in argv else None
    on_nan = argv[argv.index("--on-nan") + 1] if "--on-nan" in argv else None
    texts, counts, compiled = {}, {}, {}
    import jax

    jax.jit(lambda x: x + 1).lower(1.0).compile()  # XLA's one-time set-up, outside the first row
    for which in ("ft", "raw"):
        low, seconds = lowered(which, on_nan)
        texts[which] = low.as_text()
        counts[which] = stablehlo_counts(texts[which])
        counts[which]["trace+lower s"] = round(seconds, 2)
        if compile_:
            start, cpu = time.perf_counter(), time.process_time()
            hlo = low.compile().as_text()
            compiled[which] = hlo_counts(hlo)
            compiled[which]["compile s"] = round(time.perf_counter() - start, 2)
            compiled[which]["compile CPU s (all threads)"] = round(time.process_time() - cpu, 2)
            texts[which + ".opt"] = hlo
    if dump:
        os.makedirs(dump, exist_ok=True)
        for name, text in texts.items():
            with open(os.path.join(dump, f"{name}.{'hlo' if name.endswith('.opt') else 'mlir'}"), "w") as f:
                f.write(text)
    print(_table("StableHLO", counts["ft"], counts["raw"]))
    if compile_:
        print()
        print(_table("optimized HLO", compiled["ft"], compiled["raw"]))


if __name__ == "__main__":
    main(sys.argv[1:])
