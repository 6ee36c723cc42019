"""The first call of ``ft.nn.generate`` against a raw-JAX KV-cache loop, each in a fresh process.

A notebook's first ``generate`` pays for tracing and compiling; so does its next prompt of
another length unless the compiled loop is reused. Each variant runs in its own Python
process (nothing cached in memory; JAX's persistent compilation cache is off by default) on
the family-12 Llama of ``_generate.py`` (4 layers, d 256, 8 heads / 4 KV heads, vocab 2000),
batch 4, greedy:

- the first call (prompt ``PROMPT``, ``NEW`` new tokens): wall time from the call to the
  tokens on the host, and the programs XLA compiled;
- a second call with a prompt one token shorter (the next prompt of a notebook): its time and
  compiles (functree: the same bucket, nothing compiles; the raw loop compiles again).

Run: ``python benchmarks/generate_startup.py [--runs 3] [--new 8]``. Prints a table and the
first-call ratio functree / raw (medians over the runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = 32


def _child(variant: str, new: int) -> dict[str, Any]:
    compiles: list[str] = []

    class Names(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.match(r"Compiling (\S+)", record.getMessage())
            if found:
                compiles.append(found.group(1))

    import jax
    import numpy as np

    logger = logging.getLogger("jax")
    logger.addHandler(Names(logging.DEBUG))
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    sys.path.insert(0, os.path.dirname(__file__))
    import _generate as family

    import functree as ft

    family.NEW = new  # the raw loop reads it while tracing
    model = family.Llama(key=jax.random.key(0))
    model = jax.block_until_ready(jax.tree.map(lambda a: a * 2.0 if a.ndim >= 2 else a, model))
    params = jax.block_until_ready(family.raw_params(model))
    rng = np.random.default_rng(0)
    first_ids = rng.integers(1, family.VOCAB, (family.BATCH, PROMPT)).astype(np.int32)
    next_ids = first_ids[:, 1:].copy()
    if variant == "raw":
        call = lambda ids: np.asarray(family.raw_generate(params, jax.numpy.asarray(ids)))  # noqa: E731
    else:
        call = lambda ids: np.asarray(ft.nn.generate(model, ids, new))  # noqa: E731
    out: dict[str, Any] = {}
    with jax.log_compiles(True):
        for name, ids in (("first", first_ids), ("next", next_ids)):
            before = len(compiles)
            start = time.perf_counter()
            tokens = call(ids)
            out[name] = time.perf_counter() - start
            out[f"{name}_compiles"] = compiles[before:]
            out[f"{name}_tokens"] = tokens[:, ids.shape[1]:].tolist()
    return out


def _run(variant: str, new: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--child", variant, "--new", str(new)], capture_output=True,
                          text=True, check=True, env=dict(os.environ))
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=("raw", "functree"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new", type=int, default=8)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.new)))
        return
    results: dict[str, list[dict[str, Any]]] = {"raw": [], "functree": []}
    for _ in range(args.runs):  # interleaved: a slow spell of the machine hits both
        for variant in results:
            results[variant].append(_run(variant, args.new))
    same = results["raw"][0]["first_tokens"] == results["functree"][0]["first_tokens"]
    print(f"generate startup: batch 4, prompt {PROMPT} then {PROMPT - 1}, {args.new} new tokens, "
          f"{args.runs} fresh processes each (medians); the same tokens: {same}")
    print(f"{'variant':<10} {'first call s':>13} {'next prompt s':>14}  compiles (first | next)")
    medians = {}
    for variant, runs in results.items():
        first = statistics.median(r["first"] for r in runs)
        nxt = statistics.median(r["next"] for r in runs)
        medians[variant] = first
        print(f"{variant:<10} {first:>13.3f} {nxt:>14.3f}  {runs[0]['first_compiles']} | {runs[0]['next_compiles']}")
    print(f"first-call ratio functree / raw: {medians['functree'] / medians['raw']:.2f}x")


if __name__ == "__main__":
    main()
