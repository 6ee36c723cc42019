"""The training step: one jitted, donated, non-blocking call per minibatch.

``ft.train.train_step(loss_fn, optimizer)`` builds a :class:`TrainStep`; calling it runs

    result = optimizer.step(loss_fn, model, opt_state, batch)   # hooks (RFC 234), optax update,
                                                                 # ft.move, BatchNorm statistics
    metrics = {"loss": loss, name: metric(out) ...}

inside one ``ft.jit`` program that donates the model and the optimizer state. Like Keras'
``Model.train_step``, each stage is a method a subclass may override: ``compute_loss``,
``compute_metrics``, ``apply``, ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from functree._alias import DonationGuard, copy_aliases, warn_aliases
from functree._jit import has_untraceable_leaves, unchecked_jit
from functree._parameters import parameters
from functree._tree import is_none
from functree.optim import Optimizer, context
from functree.train._metrics import StepOutput, batch_size_of, evaluate_metrics, resolve_metrics

__all__ = ["TrainStep", "EvalStep", "train_step", "eval_step", "NONFINITE"]

NONFINITE = "nonfinite"
"""Metrics key of the non-finite report: -1 finite, -2 the loss only, else the index of
the first parameter leaf (flatten order) whose gradient was not finite."""

BAD_OPTIMIZER = """\
train_step needs a ft.optim.Optimizer or an optax GradientTransformation, got {given}.

    wrong:  ft.train.train_step(loss_fn, 1e-3)
    right:  ft.train.train_step(loss_fn, ft.optim.Optimizer(ft.optim.adam(1e-3)))
       or:  ft.train.train_step(loss_fn, optax.adam(1e-3))"""

BAD_ON_NAN = """\
on_nan must be "stop", "skip" or None, got {given!r}.

    right:  ft.train.train_step(loss_fn, opt, on_nan="skip")   # keep the last finite model"""

LOSS_NOT_SCALAR = """\
The loss function must return a scalar loss (or (loss, aux)); got a loss of shape {shape}.

    wrong:  return (model(x) - y) ** 2
    right:  return jnp.mean((model(x) - y) ** 2)"""


def as_optimizer(optimizer: Any) -> Optimizer:
    """An :class:`ft.optim.Optimizer` from itself or from an optax transformation."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, optax.GradientTransformation) or (
        hasattr(optimizer, "init") and hasattr(optimizer, "update")
    ):
        return Optimizer(optimizer)
    raise TypeError(BAD_OPTIMIZER.format(given=repr(optimizer)[:80]))


def _split_output(out: Any) -> tuple[Any, Any]:
    loss, aux = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, None)
    loss = cast(Any, loss)
    if jnp.shape(loss) != ():
        raise ValueError(LOSS_NOT_SCALAR.format(shape=jnp.shape(loss)))
    return loss, aux


def _first_nonfinite(loss: jax.Array, grads: Any) -> jax.Array:
    """-1 when all finite, -2 when only the loss is not, else the first bad leaf's index."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return jnp.where(jnp.isfinite(loss), -1, -2).astype(jnp.int32)
    bad = jnp.stack([~jnp.all(jnp.isfinite(g)) for g in leaves])
    first = jnp.where(jnp.any(bad), jnp.argmax(bad), -1)
    return jnp.where((first == -1) & ~jnp.isfinite(loss), -2, first).astype(jnp.int32)


def _merge_microbatches(x: jax.Array) -> jax.Array:
    return x.reshape(-1, *x.shape[2:]) if x.ndim >= 2 else x


def parameter_names(model: Any) -> list[str]:
    """Dotted names of the parameter leaves, in the order gradients flatten."""
    from functree._parameters import _leaf_names

    view = parameters(model)
    names = _leaf_names(view)
    leaves = jax.tree.leaves(view, is_leaf=is_none)
    return [n for n, leaf in zip(names, leaves) if leaf is not None]


class TrainStep:
    """``step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)``, jitted.

    Args:
      loss_fn: ``loss_fn(model, batch)`` (or ``loss_fn(model, batch, *, key)`` when the
        step is called with a key) returning a scalar loss or ``(loss, aux)``.
      optimizer: a :class:`ft.optim.Optimizer` or an optax transformation.
      metrics: ``{name: fn(StepOutput) -> scalar}`` or a list of such functions.
      on_nan: ``None`` (update whatever happens) or ``"skip"``/``"stop"``: a step whose
        loss or gradient is not finite leaves model and optimizer state unchanged and
        reports ``metrics["nonfinite"]`` (see :data:`NONFINITE`).
      donate: donate the model and optimizer state buffers (default True): the arrays
        passed in are invalid afterwards; use the returned ones.

    With a ``key``, the loss function gets ``jax.random.fold_in(key, step)`` where
    ``step`` is the learning context's step: one base key reproduces every step, also
    after restoring a checkpoint. Layers that record state (BatchNorm) are run under
    ``ft.nn.collect_state`` and their no_derivative fields updated. With an optimizer
    that accumulates ``k`` microbatches, aux arrays are merged back to one row per
    example and layer state comes from the last microbatch.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> def loss_fn(model, batch):
      ...     x, y = batch
      ...     return jnp.mean((model(x) - y) ** 2)
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
      >>> step = ft.train.train_step(loss_fn, opt)
      >>> state = opt.init(model)
      >>> batch = (jnp.ones((4, 2)), jnp.zeros((4, 1)))
      >>> for _ in range(100):
      ...     model, state, metrics = step(model, state, batch)
      >>> bool(metrics["loss"] < 1e-6)
      True

    Override a stage by subclassing, e.g. an L1 penalty in ``compute_loss``:

      >>> class L1Step(ft.train.TrainStep):
      ...     def compute_loss(self, model, batch, key=None):
      ...         loss, aux = super().compute_loss(model, batch, key)
      ...         return loss + 1e-3 * jnp.abs(model.weight).sum(), aux
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: Any,
        *,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
        on_nan: str | None = None,
        donate: bool = True,
    ):
        if on_nan not in (None, "stop", "skip"):
            raise ValueError(BAD_ON_NAN.format(given=on_nan))
        self.loss_fn = loss_fn
        self.optimizer = as_optimizer(optimizer)
        self.metrics = resolve_metrics(metrics)
        self.on_nan = on_nan
        self._compiled: Any = None
        self._donate = donate
        self._guard = DonationGuard()

    # --- stages a subclass may override ------------------------------------------------
    def compute_loss(self, model: Any, batch: Any, key: jax.Array | None = None) -> tuple[Any, Any]:
        """``(loss, aux)`` of ``loss_fn`` on one minibatch (aux is None without one)."""
        out = self.loss_fn(model, batch) if key is None else self.loss_fn(model, batch, key=key)
        return _split_output(out)

    def compute_metrics(self, out: StepOutput) -> dict[str, jax.Array]:
        """``{"loss": ..., name: metric(out)}`` as float32 scalars."""
        return evaluate_metrics(self.metrics, out)

    def apply(
        self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None,
        enabled: jax.Array | None = None,
    ) -> tuple[Any, Any, Any, Any, jax.Array | None]:
        """One optimizer step: ``(model, opt_state, loss, aux, nonfinite)``.

        ``nonfinite`` is None unless ``on_nan`` is set; then a non-finite step, or one
        with ``enabled`` False, leaves ``model`` and ``opt_state`` as they were (the
        optimizer's one skipping rule: :meth:`ft.optim.Optimizer.step`).
        """
        size = batch_size_of(batch)
        guarded = self.on_nan is not None
        result = self.optimizer.step(
            lambda m, b: self.compute_loss(m, b, key), model, opt_state, (batch,), has_aux=True,
            minibatch_size=size, skip_non_finite=guarded, enabled=enabled,
        )
        loss, aux = result.out
        if self.optimizer.accumulate > 1:  # microbatch outputs come stacked: (k, n / k, ...)
            aux = jax.tree.map(_merge_microbatches, aux)
        if not guarded and enabled is None:
            return result.model, result.state, loss, aux, None
        return result.model, result.state, loss, aux, _first_nonfinite(loss, result.grads)

    def step(
        self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None,
        enabled: jax.Array | None = None,
    ) -> tuple[Any, Any, dict[str, jax.Array]]:
        """The whole step, unjitted (``__call__`` is this under ``ft.jit``)."""
        if key is not None:
            key = jax.random.fold_in(key, context(opt_state).step)
        new_model, new_state, loss, aux, nonfinite = self.apply(model, opt_state, batch, key, enabled)
        metrics = self.compute_metrics(StepOutput(loss, aux, batch, model))
        if nonfinite is not None:
            metrics[NONFINITE] = nonfinite
        return new_model, new_state, metrics

    def _program(self, model: Any) -> Any:
        if self._compiled is None:  # built on first use: Equinox submodules need static leaves
            static = has_untraceable_leaves(model)
            self._compiled = unchecked_jit(self.step, donate=(0, 1) if self._donate else None, static_leaves=static)
        return self._compiled

    def lower(self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None) -> Any:
        """The jitted step lowered for these arguments (``jax.stages.Lowered``): read its
        ``.compile().cost_analysis()`` or ``memory_analysis()``. Nothing runs or is donated.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp
          >>> model, opt = ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.sgd(0.1))
          >>> step = ft.train.train_step(lambda m, b: jnp.mean(m(b) ** 2), opt)
          >>> compiled = step.lower(model, opt.init(model), jnp.ones((4, 2))).compile()
          >>> compiled.cost_analysis()["flops"] > 0
          True
        """
        program = self._program(model)
        return program.lower(model, opt_state, batch) if key is None else program.lower(model, opt_state, batch, key)

    def __call__(self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None) -> Any:
        self._program(model)
        if self._donate and self._guard.fresh(model, opt_state):
            # Donation needs distinct buffers: one array at two leaves is copied apart, with
            # a warning naming both key paths.
            warn_aliases(model, what="The model given to the train step")
            model, opt_state = copy_aliases((model, opt_state))
        out = self._compiled(model, opt_state, batch, key)
        self._guard.remember(out)
        return out

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        return (f"{type(self).__name__}({name}, {self.optimizer!r}, metrics={list(self.metrics)}, "
                f"on_nan={self.on_nan!r})")


class EvalStep:
    """``step(model, batch, key=None) -> metrics``: the loss and metrics, jitted, no update.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> evaluate = ft.train.eval_step(lambda m, b: jnp.mean(m(b[0]) ** 2))
      >>> sorted(evaluate(model, (jnp.zeros((3, 2)), None)))
      ['loss']
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
    ):
        self.loss_fn = loss_fn
        self.metrics = resolve_metrics(metrics)
        self._compiled: Any = None

    def compute_loss(self, model: Any, batch: Any, key: jax.Array | None = None) -> tuple[Any, Any]:
        """``(loss, aux)`` of ``loss_fn`` on one minibatch."""
        out = self.loss_fn(model, batch) if key is None else self.loss_fn(model, batch, key=key)
        return _split_output(out)

    def step(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, jax.Array]:
        """The loss and metrics of ``model`` on ``batch``, unjitted."""
        loss, aux = self.compute_loss(model, batch, key)
        return evaluate_metrics(self.metrics, StepOutput(loss, aux, batch, model))

    def __call__(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, jax.Array]:
        if self._compiled is None:  # built on first use: Equinox submodules need static leaves
            self._compiled = unchecked_jit(self.step, static_leaves=has_untraceable_leaves(model))
        return self._compiled(model, batch, key)


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    *,
    metrics: Mapping[str, Any] | Sequence[Any] | None = None,
    on_nan: str | None = None,
    donate: bool = True,
    mesh: Any = None,
    data_axis: str = "data",
    sharding: Any = None,
    compute_dtype: Any = None,
) -> TrainStep:
    """A jitted training step; see :class:`TrainStep`.

    ``step(model, opt_state, batch)`` computes ``g = ∇ loss_fn(model, batch)``, applies
    one optimizer update and returns ``(model, opt_state, metrics)`` with
    ``metrics = {"loss": loss, name: metric(out), ...}`` (float32 scalars, on device).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
      >>> step, model = ft.train.train_step(loss_fn, opt), {"w": jnp.zeros(2)}
      >>> model, state, metrics = step(model, opt.init(model), (jnp.eye(2), jnp.array([1.0, 2.0])))
      >>> round(float(metrics["loss"]), 4), model["w"]  # (1² + 2²) / 2; w ← 0 - 0.1·(-1, -2)
      (2.5, Array([0.1, 0.2], dtype=float32))
    """
    if mesh is not None or sharding is not None or compute_dtype is not None:
        from functree.parallel import DataParallelStep  # functree.parallel imports this module

        return DataParallelStep(loss_fn, optimizer, mesh=mesh, data_axis=data_axis, sharding=sharding,
                                compute_dtype=compute_dtype, metrics=metrics, on_nan=on_nan, donate=donate)
    return TrainStep(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, donate=donate)


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
    if mesh is not None or sharding is not None or compute_dtype is not None:
        from functree.parallel import DataParallelEvalStep

        return DataParallelEvalStep(loss_fn, mesh=mesh, data_axis=data_axis, sharding=sharding,
                                    compute_dtype=compute_dtype, metrics=metrics)
    return EvalStep(loss_fn, metrics=metrics)
