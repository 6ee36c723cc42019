"""The evaluation step: the loss and metrics of a model on one minibatch, jitted, no update.

:class:`EvalStep` (``ft.train.eval_step``; the Trainer's ``evaluate`` and validation) and
the loss stage it shares with :class:`functree.train._step.TrainStep`
(:func:`loss_and_aux`). This module imports nothing of the train step's, which imports it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from functree._alias import is_deletion_error, stale_error
from functree._host_buffers import private_arrays
from functree._jit import _hide, _show, has_untraceable_leaves, unchecked_jit
from functree._where import devices_error
from functree.losses._weighted import WeightedMean, loss_value
from functree.nn._precision import statistics_dtype
from functree.parallel._cast import cast as cast_to
from functree.parallel._cast import cast_floating
from functree.parallel._placement import Placement
from functree.parallel._rules import check_compute_dtype
from functree.train._built import BuiltWith, Settings
from functree.train._metrics import (
    StepOutput,
    evaluate_metrics,
    measured,
    resolve_metrics,
    shared_batch_size,
    without_parts,
)
from functree.train._programs import NO_MODEL, program_key, shared, trampoline

__all__ = ["EvalStep", "loss_and_aux", "placement_of_step", "check_batch_argument", "LOSS_UNPACKS_BATCH",
           "LOSS_TAKES_NO_BATCH", "EVAL_STEP_BUILT_WITH"]

EVAL_STEP_BUILT_WITH = """\
{cls}.{name} cannot be set after the step has run: its compiled programs were built with \
its {name}, and the next calls of the same shapes would run them as they are (the assignment \
ignored, silently). Build another step with the new {name}:

    wrong:  step.{name} = ...
    right:  step = ft.train.eval_step(loss_fn, metrics=..., compute_dtype=...)"""

LOSS_UNPACKS_BATCH = """\
The step calls loss_fn(model, batch) with the minibatch as one argument (the tuple (x, y) \
for arrays), but the loss function {name}{signature} takes {count} required positional \
arguments, as in Equinox's and optax's examples (loss(model, x, y)). Unpack the batch:

    wrong:  {wrong}   # loss_fn(model, x, y)
    right:  {right}"""


LOSS_TAKES_NO_BATCH = """\
The step calls loss_fn(model, batch) with each minibatch, but the loss function \
{name}{signature} takes {count} positional argument{s}: no batch (Optimizer.minimize(loss_fn, \
model, state) calls loss_fn(model) when given no batch; a step always gives one). It would \
fail at the first step with Python's "takes {count} positional argument{s} but 2 were given". \
Take the minibatch as the second argument, in place of the data the loss reads now:

    wrong:  {wrong}   # def loss_fn(model): ...
    right:  {wrong}   # def loss_fn(model, batch): x, y = batch; ..."""

LOSS_NOT_SCALAR = """\
The loss function must return a scalar loss (or (loss, aux)); got a loss of shape {shape}.

    wrong:  return (model(x) - y) ** 2
    right:  return jnp.mean((model(x) - y) ** 2)
       or:  return jax.vmap(loss, in_axes=(0, None))(models, batch).sum()   # one loss per model of a \
jax.vmap ensemble: summed, each model's gradient its own (a mean divides each by the number of models)"""


def _split_output(out: Any) -> tuple[Any, Any]:
    """``(loss, aux)`` of a loss function's output: ``loss`` or ``(loss, aux)``; a loss that is
    not a scalar refused by name."""
    loss: Any
    loss, aux = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(loss, WeightedMean) and jnp.shape(loss) != ():  # a WeightedMean's parts are scalars
        raise ValueError(LOSS_NOT_SCALAR.format(shape=jnp.shape(loss)))
    return loss, aux


def check_batch_argument(loss_fn: Callable[..., Any], call: str) -> None:
    """Refuse a loss that takes the batch unpacked (``loss(model, x, y)``): called as
    ``loss_fn(model, batch)`` it fails at the first step with Python's "missing 1 required
    positional argument: 'y'", wrapped in the step's context (:data:`LOSS_UNPACKS_BATCH`);
    and one that takes no batch (``loss(model)``, ``Optimizer.minimize``'s), which fails there
    with "takes 1 positional argument but 2 were given" (:data:`LOSS_TAKES_NO_BATCH`).
    ``call``: the caller's spelling, ``{loss}`` where the loss goes (the error's lines)."""
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to read: the call tells
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:  # loss_fn(model): Optimizer.minimize's loss without a batch
        raise TypeError(LOSS_TAKES_NO_BATCH.format(
            name=getattr(loss_fn, "__name__", "loss_fn"), signature=inspect.signature(loss_fn),
            count=len(positional), s="" if len(positional) == 1 else "s", wrong=call.format(loss="loss_fn")))
    required = [p for p in positional if p.default is p.empty and p.name != "key"]
    if len(required) <= 2:
        return
    takes_key = any(p.name == "key" for p in params)
    unpacked = ("lambda model, batch, *, key: loss_fn(model, *batch, key=key)" if takes_key
                else "lambda model, batch: loss_fn(model, *batch)")
    raise TypeError(LOSS_UNPACKS_BATCH.format(
        name=getattr(loss_fn, "__name__", "loss_fn"), signature=inspect.signature(loss_fn), count=len(required),
        wrong=call.format(loss="loss_fn"), right=call.format(loss=unpacked)))


def loss_and_aux(loss_fn: Callable[..., Any], compute_dtype: Any, model: Any, batch: Any,
                 key: jax.Array | None = None) -> tuple[Any, Any]:
    """``(loss, aux)`` of ``loss_fn`` on one minibatch (aux is None without one): under a
    ``compute_dtype``, the model (``ft.cast``) and the floating inputs cast to it, the loss
    returned in float32 at least (the means and the optimizer's scale read it there; a float64
    ``compute_dtype``'s under x64 in float64, not rounded to float32's 7 digits).

    Example:
      >>> import jax.numpy as jnp
      >>> loss_and_aux(lambda m, b: (jnp.sum(b * m), b), jnp.bfloat16, jnp.float32(0.5), jnp.ones(3))
      (Array(1.5, dtype=float32), Array([1, 1, 1], dtype=bfloat16))
    """
    if compute_dtype is not None:
        model, batch = cast_to(model, compute_dtype), cast_floating(batch, compute_dtype)
    out = loss_fn(model, batch) if key is None else loss_fn(model, batch, key=key)
    loss, aux = _split_output(out)
    if compute_dtype is None:
        return loss, aux
    if isinstance(loss, WeightedMean):  # its parts in float32 at least, as a scalar loss
        return WeightedMean(_at_least_float32(loss.total), _at_least_float32(loss.count)), aux
    return _at_least_float32(loss), aux


def _at_least_float32(x: Any) -> jax.Array:
    """``x`` in float32, or in its own floating dtype from 32 bits up (float64 under x64)."""
    dtype = jnp.result_type(x)
    return jnp.asarray(x).astype(statistics_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.float32)


def placement_of_step(mesh: Any, data_axis: str, sharding: Any, call: str) -> Placement | None:
    """The step's :class:`Placement` over ``mesh`` (None: no mesh and no sharding)."""
    return None if mesh is None and sharding is None else Placement(mesh, data_axis, sharding, call)


class EvalStep(Settings):
    """``step(model, batch, key=None) -> metrics``: the loss and metrics, jitted, no update.

    With a ``mesh`` the batch is split over ``data_axis`` and the model placed by
    ``sharding``; XLA partitions the forward pass (metrics are over the global batch).
    ``compute_dtype`` casts the model and floating inputs as :class:`TrainStep` does.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> evaluate = ft.train.eval_step(lambda m, b: jnp.mean(m(b[0]) ** 2))
      >>> sorted(evaluate(model, (jnp.zeros((3, 2)), None)))
      ['loss']
    """

    loss_fn: Any = BuiltWith()
    metrics: Any = BuiltWith()
    compute_dtype: Any = BuiltWith()
    placement: Any = BuiltWith()  # (read per minibatch through its slot, _placement)
    _placement: Placement | None
    # Any other name assigned is refused (Settings); the constructor's keywords with the call.
    _NAMED = "evaluate"
    _ARGUMENTS = (("__init__", "evaluate = ft.train.eval_step(loss_fn, {})"),)

    def _built_error(self, name: str, value: Any) -> AttributeError | None:
        """:data:`EVAL_STEP_BUILT_WITH` once the step's programs exist (:class:`BuiltWith`)."""
        if self.__dict__.get("_shared") is None:
            return None
        return AttributeError(EVAL_STEP_BUILT_WITH.format(cls=type(self).__name__, name=name))

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
        mesh: Any = None,
        data_axis: str = "data",
        sharding: Any = None,
        compute_dtype: Any = None,
    ):
        self.placement = placement_of_step(mesh, data_axis, sharding, "ft.train.eval_step")
        self.compute_dtype = None if compute_dtype is None else check_compute_dtype(compute_dtype)
        self.loss_fn = loss_fn
        self.metrics = resolve_metrics(metrics)
        self._compiled: Any = None
        self._shared: Any = None  # as TrainStep's: one program per configuration in the process
        self._ref = weakref.ref(self)

    _RUNTIME = ("_compiled", "_shared", "_ref")

    def compute_loss(self, model: Any, batch: Any, key: jax.Array | None = None) -> tuple[Any, Any]:
        """``(loss, aux)`` of ``loss_fn`` on one minibatch."""
        return loss_and_aux(self.loss_fn, self.compute_dtype, model, batch, key)

    def step(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, jax.Array]:
        """The loss and metrics of ``model`` on ``batch``, unjitted, with each counting
        value's parts (``_metrics.measured``: the sums of :meth:`summed` divide them,
        Σ hits / Σ counted; a lambda of ``accuracy.of`` too); a call returns the metrics
        without them."""
        if self.placement is not None:
            batch, _ = self.placement.constrain_batch(batch, whole=True)  # a short last batch too
        loss, aux = self.compute_loss(model, batch, key)
        out = StepOutput(loss_value(loss), aux, batch, model, loss if isinstance(loss, WeightedMean) else None)
        return measured(lambda: evaluate_metrics(self.metrics, out), self.metrics, out, listed=False)

    def metric_shapes(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, Any]:
        """The metrics :meth:`step` returns for these arguments, as ``jax.ShapeDtypeStruct``
        by name, nothing computed. Traced once per configuration and signature (the
        evaluation sums' structure: a second evaluation traces the loss no more).

        Example:
          >>> import functree as ft, jax.numpy as jnp
          >>> evaluate = ft.train.eval_step(lambda m, b: jnp.mean(b * m["w"]))
          >>> evaluate.metric_shapes({"w": jnp.ones(())}, jnp.arange(4.0))
          {'loss': ShapeDtypeStruct(shape=(), dtype=float32)}
        """
        entry = self._entry(model)
        table = entry.programs.setdefault("shapes", {})
        shapes = table.get(None)
        if shapes is None:  # one function per configuration: jax.eval_shape keeps its traces
            call = trampoline(entry, "step")

            def shapes(*args: Any) -> Any:
                return _hide(call()(*_show(args)))

            table[None] = shapes
        entry.owner = self._ref  # a trace runs this step's stages
        return _show(jax.eval_shape(shapes, *_hide((model, batch, key))))

    def summed(self, model: Any, sums: Any, batch: Any, key: Any = None) -> Any:
        """``sums`` after one more minibatch, unjitted: ``{"values": {name: Σ w·metric},
        "weight": Σ w, "count": minibatches}`` with ``w`` the minibatch's size (the
        Trainer's validation; ``key`` is folded with the minibatch's index).

        With ``"compensation"`` (``{"values": {name: ...}, "weight": ...}``, zeros at
        first: what the Trainer's ``evaluate`` passes) the sums are compensated
        (Neumaier's): each add's rounding error is summed apart, and ``values +
        compensation`` read in float64 is the sum to float32's precision of each term,
        however many minibatches. Without it the sums are plain float32 sums: past 2²⁴
        an add rounds to the sum's spacing, the same way each minibatch where the terms
        repeat (a causal LM's 16 rows of 2047 labels: 20000 minibatches, 6.5e8 tokens,
        counted 2.9e-4 too many, an accuracy 0.59984 for 0.60001)."""
        if key is not None:
            key = jax.random.fold_in(key, sums["count"])
        metrics = self.step(model, batch, key)
        w = float(shared_batch_size(batch))
        terms = {"values": {k: w * v for k, v in metrics.items()}, "weight": w}
        out = {"values": {k: sums["values"][k] + x for k, x in terms["values"].items()},
               "weight": sums["weight"] + w, "count": sums["count"] + 1}
        if "compensation" in sums:
            old = {"values": sums["values"], "weight": sums["weight"]}
            new = {"values": out["values"], "weight": out["weight"]}
            out["compensation"] = jax.tree.map(_compensated, sums["compensation"], old, terms, new)
        return out

    def summing(self, static_leaves: bool = False, model: Any = NO_MODEL) -> Callable[..., Any]:
        """:meth:`summed` jitted (``sums`` donated), its programs shared by every EvalStep
        of this configuration in the process (a new Trainer's validation compiles nothing)
        whose code reads the same values (``model``: the model it will sum over, whose
        user classes' reads are keyed too).

        Example: a weighted sum over minibatches, here one of 4 examples
          >>> import functree as ft, jax.numpy as jnp
          >>> evaluate = ft.train.eval_step(lambda m, b: jnp.mean(b * m["w"]))
          >>> sums = {"values": {"loss": jnp.zeros(())}, "weight": jnp.zeros(()), "count": jnp.zeros((), jnp.int32)}
          >>> sums = evaluate.summing()({"w": jnp.ones(())}, sums, jnp.arange(4.0), None)
          >>> sums["values"]["loss"], sums["weight"], sums["count"]  # 4 · mean(0, 1, 2, 3)
          (Array(6., dtype=float32), Array(4., dtype=float32), Array(1, dtype=int32))
        """
        entry = self._entry(model)
        table = entry.programs.setdefault("summed", {})
        run = table.get(static_leaves)
        if run is None:
            call = trampoline(entry, "summed")

            def run(model: Any, sums: Any, batch: Any, key: Any) -> Any:
                return call()(model, sums, batch, key)

            table[static_leaves] = run
        jitted = unchecked_jit(run, donate=(1,), static_leaves=static_leaves)
        ref = self._ref

        def summing(model: Any, sums: Any, batch: Any, key: Any) -> Any:
            entry.owner = ref  # a retrace (new shapes) runs this step's stages
            return jitted(model, sums, private_arrays(batch), key)

        return summing

    def _entry(self, model: Any = NO_MODEL) -> Any:
        """The shared programs, keyed at the first use (with what the user's code run on
        ``model`` reads: :func:`functree.train._programs.code_reads`)."""
        if self._shared is None:
            self._shared = shared(program_key("EvalStep", self, self._RUNTIME, model))
        return self._shared

    def shard_batch(self, batch: Any) -> Any:
        """The global batch from this process's share, on the step's mesh (else the batch)."""
        return batch if self._placement is None else self._placement.shard_batch(batch, whole=True)

    def __call__(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, jax.Array]:
        if self._compiled is None:  # built on first use: Equinox submodules need static leaves
            self._entry(model)
            static = has_untraceable_leaves(model)
            # One function per configuration: ft.jit's and JAX's caches key on it (a new
            # Trainer's validation compiles nothing); a trace runs the calling step's stages.
            run = self._shared.programs.setdefault("eval", {}).get(static)
            if run is None:
                run = self._shared.programs["eval"][static] = _calling(self._shared, "step")
            self._compiled = unchecked_jit(run, static_leaves=static)
        self._shared.owner = self._ref
        batch = private_arrays(batch)  # runs after the call returns: not from a buffer the caller refills
        if self._placement is not None:
            model, batch = self._placement.place(model), self._placement.shard_batch(batch, whole=True)
        try:
            return self._compiled(model, batch, key)
        except (RuntimeError, ValueError) as e:  # a donated model evaluated, or arguments apart: name the key paths
            named = [("model", model), ("batch", batch), ("key", key)]
            better = stale_error(named[:2]) if is_deletion_error(e) else devices_error("the eval step", e, named)
            if better is None:
                raise
            raise better from None


def _compensated(lost: jax.Array, total: jax.Array, term: Any, new_total: jax.Array) -> jax.Array:
    """``lost`` plus the rounding error of ``new_total = total + term`` (Neumaier's
    compensated sum: the error of the smaller one's low bits, exact in the dtype). An add
    that is not finite (a NaN or infinite metric) adds no error: the sum holds it."""
    term = jnp.asarray(term, new_total.dtype)
    error = jnp.where(jnp.abs(total) >= jnp.abs(term), (total - new_total) + term, (term - new_total) + total)
    return lost + jnp.where(jnp.isfinite(new_total), error, jnp.zeros((), new_total.dtype))


def _calling(entry: Any, method: str) -> Callable[..., Any]:
    """A function that calls ``method`` of the eval step now running ``entry``'s program,
    its metrics without the counting metrics' parts (a call's result)."""
    call = trampoline(entry, method)

    def run(model: Any, batch: Any, key: Any = None) -> Any:
        return without_parts(call()(model, batch, key))

    return run
