"""Comparing trained results: an atol scaled to each leaf's magnitude, from a measured spread.

The rule (conftest.py): two computations of the same numbers in another order differ by
rounding relative to the *magnitude of the values*, not to each element. So a leaf is
compared with ``assert_allclose(rtol=0, atol=margin * spread * max|leaf|)``, where
``spread`` is the largest :func:`scaled_error` measured between the two computations under
every XLA CPU instruction set (``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 | AVX | AVX2 | AVX512``,
each sums in another order), and ``margin`` (10) covers machines not measured.

``FUNCTREE_SPREAD_LOG=path`` appends each comparison's measured error to ``path`` (JSON
lines, with the test's id): run the test under each instruction set, take the largest.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import pytest

MARGIN = 10.0
FLOAT32_EPS = float(np.finfo(np.float32).eps)

needs_float16_conversions = pytest.mark.skipif(
    "--xla_cpu_max_isa=SSE" in os.environ.get("XLA_FLAGS", ""),
    reason="XLA:CPU below AVX (no F16C) calls __extendhfsf2/__truncsfhf2 for some float16 "
    "fusions and its JIT links neither (LLVM: 'Symbols not found'): an XLA bug, seen under "
    "isa-sweep's SSE4_2 run",
)
"""For a test whose float16 step XLA:CPU cannot compile under ``--xla_cpu_max_isa=SSE4_2``."""


def _pairs(actual: Any, expected: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    leaves = jax.tree.leaves(actual)
    assert len(leaves) == len(paths), f"{len(leaves)} leaves, expected {len(paths)}"
    return [(jax.tree_util.keystr(p), _floats(a), _floats(e)) for (p, e), a in zip(paths, leaves)]


def _floats(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype.kind == "V" or x.dtype.itemsize < 4 else x  # bfloat16


def scaled_error(actual: Any, expected: Any) -> float:
    """``max over leaves of max|a - e| / max(|a|, |e|)``: the error in units of each leaf's size.

    Example:
      >>> scaled_error({"w": np.array([100.0, 1e-3])}, {"w": np.array([100.0, 0.0])})  # not 1e-3 / 0
      1e-05
    """
    errors = [0.0]
    for _, a, e in _pairs(actual, expected):
        scale = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(e), initial=0.0)))
        if scale > 0:
            errors.append(float(np.max(np.abs(a - e))) / scale)
    return max(errors)


def assert_close_trained(actual: Any, expected: Any, *, spread: float, margin: float = MARGIN,
                         err_msg: str = "") -> None:
    """Every leaf of ``actual`` within ``margin * spread * max|leaf|`` of ``expected``'s.

    ``spread`` is the measured :func:`scaled_error` between the two computations, at least
    one float32 rounding (the library computes in float32 even where the values compared
    are Python floats or float64; wider for bfloat16). Trees, arrays and scalars.
    """
    _log(actual, expected, spread, err_msg)
    for name, a, e in _pairs(actual, expected):
        floor = max(float(np.finfo(e.dtype).eps), FLOAT32_EPS) if e.dtype.kind == "f" else 0.0
        scale = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(e), initial=0.0)))
        atol = margin * max(spread, floor) * scale
        np.testing.assert_allclose(a, e, rtol=0, atol=atol, err_msg=f"{name} {err_msg}".strip())


def _log(actual: Any, expected: Any, spread: float, err_msg: str) -> None:
    path = os.environ.get("FUNCTREE_SPREAD_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "what": err_msg,
                                "measured": scaled_error(actual, expected), "spread": spread,
                                "isa": os.environ.get("XLA_FLAGS", "")}) + "\n")
