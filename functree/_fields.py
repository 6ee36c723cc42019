"""Declaring a Module's fields: :func:`field` and the three kinds it gives, as in Swift.

* parameters (the default): differentiable data leaves;
* ``field(no_derivative=True)``: data leaves carried and traced but never
  differentiated (Swift's ``@noDerivative var``);
* ``field(static=True)``: configuration kept in the tree definition (Swift's ``let``).

:class:`functree.Module` (:mod:`functree._module`) reads each field's kind when a subclass is
defined.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from functree._field_checks import refuse_field_options

__all__ = ["field", "field_kind", "is_missing", "PARAMETER", "NO_DERIVATIVE", "STATIC"]

# The metadata key of a field's kind (read by field_kind).
_KIND = "functree.kind"

PARAMETER, NO_DERIVATIVE, STATIC = "parameter", "no_derivative", "static"


def field(
    *,
    static: bool = False,
    no_derivative: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    **metadata: Any,
) -> Any:
    """Declare a Module field of one of three kinds.

    Args:
      static: configuration kept in the tree definition (activation functions, flags,
        sizes). Must be hashable; arrays and modules holding arrays are rejected, also
        inside a tuple, list or dict (a submodule is a parameter field, trained).
      no_derivative: a data leaf that is carried and traced but never differentiated
        (running statistics, a step counter, a previous weight).
      default, default_factory: as in :func:`dataclasses.field`.
      **metadata: the field's metadata (``decay=False``: the decoupled weight decay of
        ``ft.optim.adamw``, ``ft.optim.lion`` and ``ft.optim.weight_decay`` skips it, by
        their default ``exclude``; the coupled ``weight_decay=`` of ``sgd``, ``adam``,
        ``rmsprop``, ``adagrad``, ``adadelta``, ``adamax``, ``amsgrad`` and ``radam`` is
        torch's L2 term ``g + λ w`` over every parameter, these too). The
        options of ``dataclasses.field`` and ``eqx.field`` that a Module's field cannot
        have (``converter``, ``init``, ``repr``, ``hash``, ``compare``, ``kw_only``,
        ``metadata``) are refused: they would be ignored.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Scaled(ft.Module):
      ...     weight: jnp.ndarray
      ...     steps: jnp.ndarray = ft.field(no_derivative=True, default=0)
      ...     name: str = ft.field(static=True, default="scaled")
      >>> Scaled(jnp.ones(2)).name
      'scaled'
    """
    if static and no_derivative:
        raise ValueError("A field is either static=True or no_derivative=True, not both.")
    refuse_field_options(metadata)
    kind = STATIC if static else NO_DERIVATIVE if no_derivative else PARAMETER
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={**metadata, _KIND: kind}
    )


def field_kind(f: dataclasses.Field) -> str:
    """The kind ('parameter', 'no_derivative', 'static') of a dataclass field."""
    return f.metadata.get(_KIND, PARAMETER)


def is_missing(value: Any) -> bool:
    """``value is dataclasses.MISSING``, by type: cloudpickle restores a ``__main__``
    class's fields by value, each with a copy of ``MISSING``."""
    return isinstance(value, type(dataclasses.MISSING))
