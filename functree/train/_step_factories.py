"""The step factories: ``ft.train.train_step``, ``ft.train.eval_step`` and the older
``DataParallelStep`` / ``DataParallelEvalStep`` names (a one-device mesh by default)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from functree.optim._skip import DEFAULT_ON_NAN
from functree.parallel._placement import one_device_mesh
from functree.train._step import EvalStep, TrainStep

__all__ = ["train_step", "eval_step", "DataParallelStep", "DataParallelEvalStep"]

def train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    *,
    metrics: Mapping[str, Any] | Sequence[Any] | None = None,
    on_nan: str | None = DEFAULT_ON_NAN,
    donate: bool = True,
    mesh: Any = None,
    data_axis: str = "data",
    sharding: Any = None,
    compute_dtype: Any = None,
    steps_per_call: int = 1,
    **options: Any,
) -> TrainStep:
    """A jitted training step; see :class:`TrainStep`.

    ``step(model, opt_state, batch)`` computes ``g = ∇ loss_fn(model, batch)``, applies
    one optimizer update and returns ``(model, opt_state, metrics)`` with
    ``metrics = {"loss": loss, name: metric(out), ...}`` (float32 scalars, float64 under ``jax_enable_x64``, on device).
    ``optimizer`` may be an optax transformation: the step wraps it in
    ``ft.optim.Optimizer`` (``step.optimizer``), whose state it takes:
    ``state = step.optimizer.init(model)`` (not ``tx.init(model)``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
      >>> step, model = ft.train.train_step(loss_fn, opt), {"w": jnp.zeros(2)}
      >>> model, state, metrics = step(model, opt.init(model), (jnp.eye(2), jnp.array([1.0, 2.0])))
      >>> round(float(metrics["loss"]), 4), model["w"]  # (1² + 2²) / 2; w ← 0 - 0.1·(-1, -2)
      (2.5, Array([0.1, 0.2], dtype=float32))
    """
    return TrainStep(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, donate=donate, mesh=mesh,
                     data_axis=data_axis, sharding=sharding, compute_dtype=compute_dtype,
                     steps_per_call=steps_per_call, **options)  # (an unknown option: named there)


def eval_step(
    loss_fn: Callable[..., Any],
    *,
    metrics: Mapping[str, Any] | Sequence[Any] | None = None,
    mesh: Any = None,
    data_axis: str = "data",
    sharding: Any = None,
    compute_dtype: Any = None,
) -> EvalStep:
    """A jitted evaluation step (loss and metrics, no update); see :class:`EvalStep`.

    ``evaluate(model, batch)`` returns ``{"loss": loss_fn(model, batch), name:
    metric(StepOutput(loss, aux, batch, model)), ...}``; the model is not changed.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> mae = lambda out: jnp.mean(jnp.abs(out.batch[0] @ out.model["w"] - out.batch[1]))
      >>> evaluate = ft.train.eval_step(loss_fn, metrics={"mae": mae})
      >>> evaluate({"w": jnp.zeros(2)}, (jnp.eye(2), jnp.array([1.0, 2.0])))
      {'loss': Array(2.5, dtype=float32), 'mae': Array(1.5, dtype=float32)}
    """
    return EvalStep(loss_fn, metrics=metrics, mesh=mesh, data_axis=data_axis, sharding=sharding,
                    compute_dtype=compute_dtype)


def DataParallelStep(loss_fn: Callable[..., Any], optimizer: Any, *, mesh: Any = None, data_axis: str = "data",
                     **options: Any) -> TrainStep:
    """The older name of ``TrainStep(loss_fn, optimizer, mesh=mesh, ...)``; ``mesh=None`` is
    the default device alone (``ft.parallel.DataParallelStep`` is this function)."""
    return TrainStep(loss_fn, optimizer, mesh=_one_device(mesh, data_axis), data_axis=data_axis, **options)


def DataParallelEvalStep(loss_fn: Callable[..., Any], *, mesh: Any = None, data_axis: str = "data",
                         **options: Any) -> EvalStep:
    """The older name of ``EvalStep(loss_fn, mesh=mesh, ...)``; ``mesh=None`` is the default
    device alone (``ft.parallel.DataParallelEvalStep`` is this function)."""
    return EvalStep(loss_fn, mesh=_one_device(mesh, data_axis), data_axis=data_axis, **options)


def _one_device(mesh: Any, data_axis: str) -> Any:
    return one_device_mesh(data_axis) if mesh is None else mesh
