"""The block form of a fused projection's LoRA adapter (GPT-2's ``c_attn``, GPT-NeoX's
``query_key_value``, Phi-3's ``qkv_proj``): which of ``lora_B``'s rank columns belong to
which member, so :func:`functree.hf.load_lora` gives each member trained apart its own
``A`` and ``B`` back (its rank ``r_i``, not the module's ``Σr``). :func:`save_lora`
records the columns in the weights' metadata (:data:`BLOCKS`, which PEFT ignores); files
without the record show them in ``B``'s zero blocks (:func:`_own_columns`)."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import numpy as np

__all__ = ["BLOCKS", "read_blocks", "member_columns"]

# In the weights' metadata: the block form's columns of each member, {module: [[member, start,
# stop], ...]}, so load_lora gives each member its own A and B back (PEFT ignores it).
BLOCKS = "functree.fused_blocks"


def read_blocks(text: Any) -> dict[str, Any]:
    """The weights' record of the block form (:data:`BLOCKS`), or {} when absent or not of
    its shape (a hint only: :func:`member_columns` uses it where the tensors agree)."""
    try:
        value = json.loads(text) if isinstance(text, str) else {}
    except (ValueError, RecursionError):  # (nested past the JSON reader's depth: a damaged hint)
        return {}
    return value if isinstance(value, dict) else {}


def member_columns(recorded: Any, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Each member's own columns of ``lora_B`` (``rows``: each member's rows of it) in the
    block form: as recorded where the record fits the tensors, else as ``B`` shows them;
    None for any other adapter (PEFT's shared ``A``)."""
    return _recorded_columns(recorded, rows) or _own_columns(rows)


def _recorded_columns(recorded: Any, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The columns save_lora recorded for each member, where the record names exactly these
    members, its ranges tile ``B``'s columns, and each member's rows of ``B`` are zero
    outside its range (so the split is exact); None otherwise."""
    width = next(iter(rows.values())).shape[1]
    try:
        spans = {str(m): (int(start), int(stop)) for m, start, stop in recorded}
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an Infinity, which JSON's reader takes)
        return None
    if set(spans) != set(rows) or sorted(spans.values())[0][0] != 0:
        return None
    ordered = sorted(spans.values())
    if any(a[1] != b[0] for a, b in pairwise(ordered)) or ordered[-1][1] != width or any(
            start >= stop for start, stop in ordered):
        return None
    out = {m: np.arange(*spans[m]) for m in rows}
    outside = [np.delete(rows[m], out[m], axis=1) for m in rows]
    return out if not any(np.any(o != 0) for o in outside) else None


def _own_columns(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Each fused member's own rank columns when ``lora_B`` is block-diagonal over the
    members (every column nonzero in exactly one member's rows, every member owning one):
    the form :func:`save_lora` writes for members trained apart. Loading each member with
    only its columns is exact (the others' B rows there are zero) and keeps its rank; with a
    shared ``A`` each member would train a rank-``Σr`` adapter, ``Σr`` growing at every
    save and load. None for any other B (PEFT's shared A, a fresh zero B)."""
    used = {m: np.flatnonzero(np.any(rows_m != 0, axis=0)) for m, rows_m in rows.items()}
    owners = np.zeros(next(iter(rows.values())).shape[1], np.int64)
    for columns in used.values():
        owners[columns] += 1
    if len(rows) < 2 or not (owners == 1).all() or any(columns.size == 0 for columns in used.values()):
        return None
    return used
