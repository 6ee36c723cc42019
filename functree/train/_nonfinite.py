"""A training step that was not finite: the error it raises and where it turned non-finite.

``on_nan="stop"`` (the default) ends a job at the first step whose loss or gradient was
NaN/inf: :func:`nonfinite_error` builds the :class:`NonFiniteError` (the step, the first
parameter by name, the inputs), after running that step again equation by equation
(:func:`step_provenance`) for where the first non-finite value came from.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from functree._naming import names as _leaf_names
from functree._nan import NaNReport, provenance_text
from functree._tree import is_none
from functree.optim import context
from functree.optim._subset import trained_view
from functree.train._provenance import step_report

__all__ = ["NONFINITE", "NonFiniteError", "nonfinite_error", "step_provenance", "parameter_names"]

NONFINITE = "nonfinite"
"""Metrics key of the non-finite report: -1 finite, -2 the loss only (under an optimizer
that handles non-finite gradients itself, ``LossScaleOptimizer``: the loss, whatever the
gradients), else the index of the first parameter leaf (flatten order) whose gradient was
not finite."""


NONFINITE_STOP = """\
Training stopped at step {step}: {what} was not finite.
The step was not applied: {holder} those after step {previous}{history}. {advice}:

    ft.train.Trainer(model, optimizer, loss_fn, on_nan="skip")"""

NONFINITE_ADVICE = ("Try a lower learning rate, gradient clipping, checking the data for NaN/inf, "
                    "or skipping such steps")

# The loss raised run eagerly on the step's batch: the data, not the optimization, is at fault.
NONFINITE_DATA_ADVICE = ("Run eagerly on this step's batch, the loss raises {error} (the likely cause, "
                         "not the learning rate: below, and this error's __cause__). Fix the data, "
                         "or skip such steps")


NONFINITE_LOSS_SCALED = """

The optimizer's loss scale ({optimizer}) skips a step whose scaled gradients overflowed \
and lowers the scale; this loss was not finite before it was scaled (say, a float16 \
forward that overflowed: an input or activation above 65504, float16's largest), and no scale \
makes it finite, so the step is not the loss scale's to skip (torch's GradScaler, which \
checks only the gradients, skips it and halves the scale). Check the data, compute in \
bfloat16 (float32's range), or skip such steps with the scale kept:

    ft.train.Trainer(model, optimizer, loss_fn, compute_dtype=jnp.bfloat16)
    ft.train.Trainer(model, optimizer, loss_fn, compute_dtype=jnp.float16, on_nan="skip")
"""

NONFINITE_SELF_SKIPPING = """

The optimizer skips non-finite steps itself ({which}), but the training step checks \
first: under on_nan="stop" (the default) such a step stops the run before the optimizer \
sees it. Let the optimizer decide (its state counts the steps it skipped), or let the step \
skip them without it:

    ft.train.Trainer(model, optimizer, loss_fn, on_nan="ignore")   # {which} skips
    ft.train.Trainer(model, optimizer, loss_fn, on_nan="skip")     # the step skips
"""


_SELF_SKIPPING = {("optax", "ApplyIfFiniteState"): "optax.apply_if_finite",
                  ("functree", "SkipState"): "ft.optim.skip_non_finite"}


def _self_skipping(opt_state: Any) -> str | None:
    """The name of a transform in ``opt_state`` that skips non-finite updates by itself
    (its state's class, by library and name)."""
    def which(x: Any) -> str | None:
        return _SELF_SKIPPING.get(((type(x).__module__ or "").split(".", 1)[0], type(x).__name__))

    return next((which(x) for x in jax.tree.leaves(opt_state, is_leaf=lambda x: which(x) is not None)
                 if which(x) is not None), None)


class NonFiniteError(FloatingPointError):
    """The loss or a gradient became NaN/inf in a step with ``on_nan="stop"`` (the default).

    A ``FloatingPointError`` whose message names the step and the loss or the first
    parameter whose gradient was not finite; that step and any after it are not applied.
    ``step``, ``parameter`` (None: the loss), ``model`` (before the step), ``batch`` and
    ``key`` hold the failing step's inputs; ``report`` is the :class:`ft.NaNReport` of where
    the first non-finite value came from (the message ends with it).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.mean(jnp.log(-m["w"] * b))  # log(-1): NaN
      >>> trainer = ft.train.Trainer({"w": jnp.ones(1)}, ft.optim.sgd(0.1), loss_fn)
      >>> try:
      ...     trainer.fit(jnp.ones((4, 1)), progress=False)
      ... except ft.train.NonFiniteError as e:
      ...     print(str(e).splitlines()[0])
      Training stopped at step 1: the loss was not finite.
      >>> trainer.steps_run, trainer.model["w"]  # the model from before step 1
      (0, Array([1.], dtype=float32))
    """

    step: int = 0
    parameter: str | None = None
    loss_fn: Any = None
    model: Any = None
    batch: Any = None
    key: Any = None
    report: Any = None


def nonfinite_error(step: int, index: int, *, train_step: Any, model: Any, opt_state: Any, batch: Any,
                    key: Any = None, holder: str = "the model and optimizer state returned are",
                    history: str = "") -> NonFiniteError:
    """The one place a stop becomes an exception: step ``step`` (1-based) was not finite at
    gradient leaf ``index`` of ``model``'s parameters (-2: the loss). ``model`` and
    ``opt_state`` are those before that step, ``batch`` and ``key`` its inputs: the step is
    run again off the fast path, equation by equation (:func:`step_provenance`), and the
    message ends with where the first non-finite value came from (``error.report``)."""
    name = None if index < 0 else parameter_names(model, train_step.optimizer.wrt)[index]
    what = "the loss" if name is None else f"the gradient of parameter {name!r}"
    report = step_provenance(train_step, step, model, opt_state, batch, key)
    notes = ""  # what the optimizer does with non-finite steps itself
    if name is None and getattr(train_step.optimizer, "handles_nonfinite", False):
        notes = NONFINITE_LOSS_SCALED.format(optimizer=type(train_step.optimizer).__name__)
    which = _self_skipping(opt_state)
    if which is not None:
        notes += NONFINITE_SELF_SKIPPING.format(which=which)
    advice = NONFINITE_ADVICE
    if report.cause is not None:
        first = str(report.cause).splitlines()[0] if str(report.cause) else ""
        advice = NONFINITE_DATA_ADVICE.format(error=f"{type(report.cause).__name__}: {first}".rstrip(": "))
    error = NonFiniteError(NONFINITE_STOP.format(step=step, what=what, previous=step - 1, holder=holder,
                                                 history=history, advice=advice) + notes + provenance_text(report))
    error.__cause__ = report.cause
    error.step, error.parameter, error.loss_fn, error.model, error.batch, error.key, error.report = (
        step, name, train_step.loss_fn, model, batch, key, report)
    return error


def step_provenance(train_step: Any, step: int, model: Any, opt_state: Any, batch: Any, key: Any = None,
                    applied_after: int = 0) -> NaNReport:
    """Where step ``step`` of ``train_step`` on these inputs first turned non-finite
    (:func:`functree.train._provenance.step_report` on its ``compute_loss``).

    ``key`` is the base key the step was called with; it is folded as the step folds it,
    with the learning context's step ``applied_after`` steps before ``opt_state``'s.
    """
    if key is not None:
        key = jax.random.fold_in(key, context(opt_state).step - applied_after)

    @functools.wraps(train_step.loss_fn)  # the user's function name in the report
    def loss(m: Any, b: Any, key: Any = None) -> Any:
        return train_step.compute_loss(m, b, key)  # a subclass's compute_loss included

    return step_report(loss, model, batch, key, step, applied_after)


def parameter_names(model: Any, wrt: tuple[str, ...] | None = None) -> list[str]:
    """Dotted names of the parameter leaves, in the order gradients flatten (only those an
    ``Optimizer(wrt=)`` trains: its gradients hold no others)."""
    view = trained_view(model, wrt)
    names = _leaf_names(view)
    leaves = jax.tree.leaves(view, is_leaf=is_none)
    return [n for n, leaf in zip(names, leaves) if leaf is not None]
