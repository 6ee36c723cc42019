"""Counting a program's size: equations of a jaxpr, nested ones included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of every jaxpr inside them (cond branches, scan bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr itself
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def all_equations(jaxpr: Any) -> int:
    """Equations of ``jaxpr`` and of every jaxpr inside them (cond branches, scan bodies)."""
    return sum(1 for _ in equations(jaxpr))
