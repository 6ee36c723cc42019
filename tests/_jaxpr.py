"""Counting a program's size: equations of a jaxpr, nested ones included."""

from __future__ import annotations

from typing import Any


def all_equations(jaxpr: Any) -> int:
    """Equations of ``jaxpr`` and of every jaxpr inside them (cond branches, scan bodies)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr itself
                if hasattr(inner, "eqns"):
                    total += all_equations(inner)
    return total
