"""The NaN provenance of a failed training step: its loss run again, eagerly, on its inputs.

``functree._nan`` finds where a function's value or gradient first turned non-finite; a
training step's loss also records layer state (``ft.nn.collect_state``) and may take a
key, which is why this piece lives with the step, above ``functree.nn``, and not in the
core.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from collections.abc import Callable
from typing import Any

import jax

from functree._nan import NaNReport, nan_report
from functree._source import function_name
from functree.nn._state import collect_state

__all__ = ["provenance_for_step", "step_report"]

ANALYSIS_FAILED = "the provenance analysis failed ({error}); the step's failure stands"
FINITE_AGAIN = ("run again eagerly, step {step}'s loss and gradient are finite (a failure "
                "of the compiled program only, or of a nondeterministic one)")
EAGER_ERROR = ("run eagerly on this step's batch (outside jit), {function} raises the error below: "
               "the likely cause, not the learning rate. Under jit a loss cannot read its inputs' "
               "values to check them (a label outside the classes, say) and returns NaN instead.\n"
               "{error}")
LATER_MODEL = ("analysed with the model after {count} later step(s): the model before a "
               "skipped step is not kept")


def provenance_for_step(loss_fn: Callable[..., Any], model: Any, batch: Any, key: Any = None,
                        *, has_aux: bool | None = None) -> NaNReport | None:
    """Where a training step's loss or gradient turned non-finite, or None if it did not.

    Runs :func:`nan_report` on ``loss_fn(model, batch)`` (``loss_fn(model, batch, key=key)``
    with a key: the step's folded key) with respect to the model's parameters, with layer
    state collected as the step does (``ft.nn.collect_state``). ``has_aux`` None reads the
    loss function's result: a pair is ``(loss, aux)``. Never raises: a failure of the
    analysis is reported in the returned report's ``note``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.mean(jnp.log(m["w"] * b))
      >>> provenance_for_step(loss_fn, {"w": jnp.ones(1)}, jnp.zeros(2)).primitive
      'log'
    """
    @functools.wraps(loss_fn)  # its name and its arguments' names for the report
    def loss(m: Any, b: Any, k: Any) -> Any:  # layer state recorded as the step records it
        out, _ = collect_state(lambda mm: loss_fn(mm, b) if k is None else loss_fn(mm, b, key=k), m)
        return out

    function = function_name(loss_fn)
    raised = _eager_error(loss, model, batch, key)
    try:
        if has_aux is None:
            shape = jax.eval_shape(loss, model, batch, key)
            has_aux = isinstance(shape, tuple) and len(shape) == 2
        report = nan_report(loss, (model, batch, key), has_aux=has_aux)
    except Exception as e:  # diagnostics after a failure must never hide the failure
        # The traced loss failed too: its eager error is that same failure, not a value check.
        return NaNReport(function, "unknown", note=ANALYSIS_FAILED.format(error=f"{type(e).__name__}: {e}"))
    if raised is not None:  # the loss's own message names the cause better than the equation it NaN-ed in
        error = textwrap.indent(f"{type(raised).__name__}: {raised}", "    ")
        note = EAGER_ERROR.format(function=function, error=error)
        return dataclasses.replace(report, function=function, kind=report.kind or "unknown", note=note,
                                   cause=raised)
    return None if report.ok else dataclasses.replace(report, function=function)


def _eager_error(loss: Callable[..., Any], model: Any, batch: Any, key: Any) -> Exception | None:
    """The error ``loss(model, batch, key)`` raises run eagerly on these concrete inputs (None
    if none): the nan_report analysis traces the loss, so a check of the inputs' values (a
    label outside the classes: ``ft.losses.softmax_cross_entropy`` raises on concrete labels,
    is NaN on traced ones) cannot run there."""
    try:  # not under jax.disable_jit: a scanned model would run its scan as a Python loop
        loss(model, batch, key)
    except Exception as e:  # any error: shown as the loss's own, never raised from a diagnosis
        return e
    return None


def step_report(loss_fn: Callable[..., Any], model: Any, batch: Any, key: Any, step: int,
                applied_after: int = 0) -> NaNReport:
    """The provenance of training step ``step`` (1-based), run again on its inputs: ``model``
    is the one before the step, or one ``applied_after`` steps later (said in the note when
    the step was skipped and training went on). Runs only after a failure.

    Example:
      >>> import jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.sum(jnp.log(m["w"] * b))
      >>> step_report(loss_fn, {"w": jnp.ones(2)}, jnp.zeros(2), None, step=3).step
      3
    """
    report = provenance_for_step(loss_fn, model, batch, key)
    if report is None:
        return NaNReport(function_name(loss_fn), "unknown", step=step, note=FINITE_AGAIN.format(step=step))
    note = report.note
    if applied_after and not report.note:
        note = LATER_MODEL.format(count=applied_after)
    return dataclasses.replace(report, step=step, note=note)
