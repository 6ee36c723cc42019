"""A user's optax transformation as one that takes optax's extra arguments.

functree's optimizers receive their learning context (and a loss, for a schedule that
reads it) as extra arguments of ``update``. ``optax.with_extra_args_support`` passes them
only to a ``GradientTransformationExtraArgs``; a transformation of another class whose
``update`` takes them anyway (``optax.MultiSteps``: ``update(updates, state, params,
**extra_args)``, forwarded to the optimizer it wraps) lost them, and a functree optimizer
inside refused its state.
"""

from __future__ import annotations

import inspect
from typing import Any

import optax

__all__ = ["with_extra_args"]


def with_extra_args(transform: Any) -> optax.GradientTransformationExtraArgs:
    """``transform`` taking ``update``'s extra keyword arguments where its ``update`` does.

    Example:
      >>> import optax, functree as ft
      >>> from functree.optim._extra_args import with_extra_args
      >>> isinstance(with_extra_args(optax.MultiSteps(ft.optim.adam(0.1), 2)), optax.GradientTransformationExtraArgs)
      True
    """
    if isinstance(transform, optax.GradientTransformationExtraArgs):
        return transform
    if not isinstance(transform, optax.GradientTransformation) and _takes_extra_args(transform.update):
        return optax.GradientTransformationExtraArgs(transform.init, transform.update)
    return optax.with_extra_args_support(transform)


def _takes_extra_args(update: Any) -> bool:
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
