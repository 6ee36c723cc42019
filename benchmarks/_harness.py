"""Timing harness: interleaved rounds, medians, spread, paired ratios, machine description.

Every benchmark family measures its variants in one process, round by round: a round runs
each variant's timed block once, in an order that rotates from round to round, so slow
drift and load from other processes hit every variant alike. A block ends with
``jax.block_until_ready`` on its last output (never inside the per-step loop). The
reported value is the median over rounds; the spread is the interquartile range; the
ratio to the reference is the median of the per-round ratios (paired, so a round that
was slow for everyone does not move it).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of ``values`` (inclusive method; one value gives it three times)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def interleave(blocks: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every block once per round in a rotating order; each block returns its value."""
    names = list(blocks)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            out[name].append(blocks[name]())
    return out


def timed(fn: Callable[[], Any]) -> float:
    """Seconds that ``fn()`` takes, its result blocked on."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def carried_updates(variants: Mapping[str, tuple[Callable[..., Any], Any, Any]], grads: Any,
                    calls: int) -> Callable[[str], Callable[[], float]]:
    """``block(name)``: a timed block of ``calls`` updates of variant ``name`` (``update(p, s,
    grads) -> (p, s)``, first values ``p, s``), each block carrying on from the last (the
    buffers are donated); the block returns seconds per update."""
    carries = {name: (p, s) for name, (_, p, s) in variants.items()}

    def block(name: str) -> Callable[[], float]:
        update = variants[name][0]

        def run() -> float:
            def go() -> Any:
                p, s = carries[name]
                for _ in range(calls):
                    p, s = update(p, s, grads)
                carries[name] = (p, s)
                return p, s

            return timed(go) / calls

        return run

    return block


@dataclass
class Row:
    name: str
    values: list[float]
    ratio: float | None = None
    ratio_spread: tuple[float, float] | None = None
    ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return quantiles(self.values)[1]

    def as_json(self) -> dict[str, Any]:
        q1, q2, q3 = quantiles(self.values)
        return {
            "name": self.name, "median": q2, "q1": q1, "q3": q3,
            "min": min(self.values), "max": max(self.values), "n": len(self.values),
            "ratio": self.ratio, "ratio_q1_q3": self.ratio_spread, "meets_target": self.ok,
            **self.extra,
        }


@dataclass
class Table:
    """One benchmark family's result: rows of values in ``unit`` plus notes and checks."""

    key: str
    title: str
    unit: str
    target: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    columns: tuple[str, ...] = ()  # names in Row.extra shown as extra columns
    ratio_label: str = "ratio"
    plain: bool = False  # a table of checks: only the extra columns, no timing columns

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "unit": self.unit, "target": self.target,
                "rows": [r.as_json() for r in self.rows], "notes": self.notes,
                "checks": self.checks}

    def markdown(self) -> str:
        timing = [] if self.plain else [f"median {self.unit}", "IQR", self.ratio_label]
        head = ["variant", *timing, *self.columns, "target"]
        lines = [f"### {self.title}", "", f"Target: {self.target}", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            q1, q2, q3 = quantiles(r.values)
            ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
            if r.ratio_spread is not None:
                ratio += f" ({r.ratio_spread[0]:.2f}–{r.ratio_spread[1]:.2f})"
            mark = {True: "✓", False: "✗", None: ""}[r.ok]
            timing = [] if self.plain else [fmt(q2), f"{fmt(q1)}–{fmt(q3)}", ratio]
            cells = [r.name, *timing, *(str(r.extra.get(c, "")) for c in self.columns), mark]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"


def fmt(x: float) -> str:
    """Three significant digits, no exponent for the ranges seen here."""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def paired_rows(values: dict[str, list[float]], reference: str, *, scale: float = 1.0,
                higher_is_better: bool = False) -> list[Row]:
    """Rows with per-round ratios to ``reference`` (value / reference, or its inverse
    when ``higher_is_better`` so that a ratio above 1 always means "slower")."""
    ref = values[reference]
    rows = []
    for name, vs in values.items():
        per_round = [(r / v if higher_is_better else v / r) for v, r in zip(vs, ref)]
        q1, q2, q3 = quantiles(per_round)
        rows.append(Row(name, [v * scale for v in vs], ratio=q2, ratio_spread=(q1, q3)))
    return rows


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    import optax

    versions = {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "optax": optax.__version__}
    for name in ("equinox", "flax", "functree"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    device = jax.devices()[0]
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "device": f"{device.platform} ({device.device_kind})",
        "python": platform.python_version(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(sys.argv),
    }
