"""Family 6: donation — the compiled step aliases parameters and optimizer state to its outputs.

Read from the compiled program's ``memory_analysis()`` (``alias_size_in_bytes``: input
bytes XLA writes the outputs into) against the bytes of the donated carry, and checked
at run time: after one call every donated input buffer is deleted.
"""

from __future__ import annotations

import jax
from _harness import Row, Table
from _impls import FUNCTREE, Runner, available
from _models import MNIST_MLP


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _row(name: str, runner: Runner) -> Row:
    carry_bytes = _nbytes(runner.carry)
    try:
        compiled = runner.lower()
    except Exception:
        compiled = None
    aliased = None if compiled is None else compiled.memory_analysis().alias_size_in_bytes
    before = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(runner.carry)[0]
              if isinstance(x, jax.Array)]
    if compiled is None or runner.stateful:
        jax.block_until_ready(runner.call())
    else:  # run the program just compiled: one compilation per variant
        try:
            out = compiled(*runner.carry, *runner.args)
        except TypeError:  # lowered with more arguments (TrainStep.lower: its key and halt log)
            out = runner.call()
        jax.block_until_ready(out)
    kept = [jax.tree_util.keystr(path) for path, x in before if not x.is_deleted()]
    deleted = len(before) - len(kept)
    ok = aliased is not None and aliased >= carry_bytes and not kept
    return Row(name, [float(carry_bytes)], ok=ok if name in FUNCTREE else None, extra={
        "params + state bytes": carry_bytes,
        "aliased bytes": "—" if aliased is None else aliased,
        "inputs deleted after a call": f"{deleted}/{len(before)}",
        "not donated": ", ".join(f"`{k}`" for k in kept[:3]) + (" ..." if len(kept) > 3 else ""),
    })


def donation(quick: bool) -> list[Table]:
    rows = [_row(name, build(MNIST_MLP)) for name, build in available().items()]
    table = Table("donation", f"6. Donation: {MNIST_MLP.label}", "bytes",
                  "parameters and optimizer state aliased to outputs", rows, plain=True,
                  columns=("params + state bytes", "aliased bytes", "inputs deleted after a call",
                           "not donated"))
    table.notes.append("aliased bytes: compiled.memory_analysis().alias_size_in_bytes "
                       "(ft.train.train_step through TrainStep.lower); Equinox filter_jit and "
                       "nnx.jit do not donate by default")
    return [table]
