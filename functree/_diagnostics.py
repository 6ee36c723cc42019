"""Differentiation diagnostics on the jaxpr (Swift's compiler checks).

Hook point used by the differential operators; the analysis lives here.
"""

from __future__ import annotations

from typing import Any


def check(kind: str, fn: Any, g: Any, plan: Any) -> None:
    """Analyse ``g`` (the function being differentiated) before differentiation."""
    del kind, fn, g, plan
