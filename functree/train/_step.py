"""The training step: one jitted, donated, non-blocking call per minibatch.

``ft.train.train_step(loss_fn, optimizer)`` builds a :class:`TrainStep`; calling it runs

    result = optimizer.step(loss_fn, model, opt_state, batch, on_nan=..)  # hooks (RFC 234), the
                                                  # gate, optax update, ft.move, BatchNorm statistics
    metrics = {"loss": loss, name: metric(out) ...}

inside one jitted program that donates the model and the optimizer state. With a mesh it
is the same program: the optimizer's gradient half runs inside ``jax.shard_map`` over the
data axis (one shard of the batch per device), its update half once, on the parameters
and moments placed by the sharding rules. Like Keras' ``Model.train_step``, each stage is
a method a subclass may override: ``compute_loss``, ``compute_metrics``, ``apply``,
``step``. ``ft.train.Trainer`` runs this same program, with a log buffer.

Around it: :class:`EvalStep` and the loss stage both share in ``_eval_step.py``; the
factories (``train_step``, ``eval_step``, the ``DataParallel*`` names) in
``_step_factories.py``; an ``on_nan="stop"`` stop's error and provenance in
``_nonfinite.py``; the step's partition specs and per-device outputs over a mesh's data
axis in ``functree/parallel/_step_specs.py``.
"""

from __future__ import annotations

import bisect
import difflib
import functools
import inspect
import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from functree._alias import (
    AliasWarning,
    DonationGuard,
    alias_names,
    copy_aliases,
    deleted_leaf,
    find_aliases,
    is_deletion_error,
    warn_aliases,
)
from functree._compat import NOT_A_JAX_TYPE
from functree._flat import FlatJit, flat_jit
from functree._host_buffers import JAX_ARRAYS, private_arrays
from functree._jit import (
    _argument_name,
    explain_control_flow,
    has_untraceable_leaves,
    unchecked_jit,
)
from functree._random import key_batch
from functree._repr import short_array
from functree._source import USER_FUNCTION
from functree._traces import CURRENT, TOP
from functree._tree import abstract_leaf
from functree._warnings import warn
from functree._where import devices_error
from functree.losses._weighted import WeightedMean, loss_value
from functree.nn._salt import salted_keys
from functree.nn._state import collect_state
from functree.optim import Optimizer, OptimizerState, context
from functree.optim._accumulate import check_accumulation
from functree.optim._hyper import applied_learning_rates, learning_rate_names
from functree.optim._loss_scale import warn_unscaled_float16
from functree.optim._optimizer import Gradients, moved_view, with_axis_name
from functree.optim._replicas import all_varying, as_varying, replica_mean, replica_weighted_mean
from functree.optim._skip import DEFAULT_ON_NAN, check_on_nan
from functree.optim._subset import trained_view
from functree.parallel._mesh import is_array
from functree.parallel._placement import Placement
from functree.parallel._rules import check_compute_dtype, partition_specs
from functree.parallel._step_specs import (
    is_spec,
    merge_aux,
    merge_devices,
    only_axis,
    stack_devices,
    without_axis,
)
from functree.train._built import BuiltWith, Settings
from functree.train._data import several_keys
from functree.train._eval_step import (
    EvalStep,
    check_batch_argument,
    loss_and_aux,
    placement_of_step,
)
from functree.train._halt import new_halt_log, placed_as
from functree.train._metrics import (
    PART_COUNT,
    PART_SUM,
    StepOutput,
    batch_size_of,
    counting_names,
    describe_batch,
    evaluate_metrics,
    measured,
    resolve_metrics,
    warn_unrecorded_aux,
    without_parts,
)
from functree.train._modes import warn_step_in_inference
from functree.train._nonfinite import NONFINITE, nonfinite_error
from functree.train._programs import program_key, shared, trampoline
from functree.train._scan import (
    check_stacked,
    check_steps_per_call,
    scan_steps,
    shard_stacked,
    step_slice,
)
from functree.train._traced import traced_call

__all__ = ["TrainStep", "EvalStep"]


BAD_OPTIMIZER = """\
train_step needs a ft.optim.Optimizer or an optax GradientTransformation, got {given}.

    wrong:  ft.train.train_step(loss_fn, 1e-3)
    right:  ft.train.train_step(loss_fn, ft.optim.Optimizer(ft.optim.adam(1e-3)))
       or:  ft.train.train_step(loss_fn, optax.adam(1e-3))"""


OPTIMIZER_OPTION = """\
ft.train.train_step got {name}=, an option of the optimizer: the step trains what its \
optimizer's wrt= selects and applies the optimizer's hooks, so it is given to \
ft.optim.Optimizer.

    wrong:  ft.train.train_step(loss_fn, tx, {name}={value})
    right:  ft.train.train_step(loss_fn, ft.optim.Optimizer(tx, {name}={value}))
            # tx: the optax transformation, e.g. ft.optim.adam(1e-3)"""

ABSTRACT_STEP_INPUT = """\
The train step's {arg} holds abstract leaves: {path} is {leaf}, a jax.ShapeDtypeStruct \
(jax.eval_shape's template), which has a shape and dtype but no values to train. Fill the \
template first (or build the model):
    wrong:  step(template, jax.eval_shape(opt.init, template), batch)
    right:  model = ft.train.load(path, template); step(model, opt.init(model), batch)   # or trainer.restore(path)
       or:  model = jax.jit(build)(key); step(model, opt.init(model), batch)"""

UNKNOWN_STEP_OPTION = """\
ft.train.train_step got an unexpected keyword argument {name!r}{why}.

    right:  ft.train.train_step(loss_fn, optimizer, {right})"""


def misplaced_options(options: Mapping[str, Any]) -> TypeError:
    """The error for the first of ``options``, keywords ``train_step`` does not take:
    :data:`OPTIMIZER_OPTION` for one of ``ft.optim.Optimizer``'s (``wrt=``, ``accumulate=``,
    ``transform_gradients=``...), else :data:`UNKNOWN_STEP_OPTION` with the closest name."""
    name, value = next(iter(options.items()))
    theirs = [p for p in inspect.signature(Optimizer).parameters if p not in ("transform", "misplaced")]
    if name in theirs:
        text = repr(value)
        return TypeError(OPTIMIZER_OPTION.format(name=name, value=text if len(text) <= 40 else "..."))
    ours = [p for p in inspect.signature(TrainStep).parameters if p not in ("loss_fn", "optimizer", "options")]
    close = difflib.get_close_matches(name, ours, n=1, cutoff=0.6)
    why, right = (f" (did you mean {close[0]!r}?)", f"{close[0]}=...") if close else (
        "", "...)   # help(ft.train.train_step")
    return TypeError(UNKNOWN_STEP_OPTION.format(name=name, why=why, right=right))


NOT_STEP_STATE = """\
The step's optimizer state must be the one its ft.optim.Optimizer made (an \
ft.optim.OptimizerState: optax's state plus a learning context), got {given}. A step \
given an optax transformation wraps it in ft.optim.Optimizer, reachable as step.optimizer:

    wrong:  step = ft.train.train_step(loss_fn, tx);  state = tx.init(model)
    right:  step = ft.train.train_step(loss_fn, tx);  state = step.optimizer.init(model)
       or:  opt = ft.optim.Optimizer(tx);  step = ft.train.train_step(loss_fn, opt);  state = opt.init(model)"""


NO_DONATION = "ft.train.train_step(loss_fn, optimizer, donate=False)    # the inputs stay valid (more memory)"


BATCH_ALIASES = """\
The batch given to the train step holds an array of the model or optimizer state it \
donates: {pairs}. XLA refuses a call that reads a buffer it reuses for the step's outputs, \
so the batch's array was copied for this call, as it will be at every such call. Pass a \
copy, or a step that donates nothing:

    wrong:  step(model, state, batch)                           # {example}
    right:  step(model, state, jax.tree.map(jnp.copy, batch))
       or:  {no_donation}"""

_ARGUMENTS = ["model", "opt_state", "batch", "key"]


SHARED_STOP_LOG = """\
One ft.train.train_step was called from two threads at once. With on_nan="stop" (the \
default) a step keeps one stop log for all its calls (a stop gates every later call), which \
each call donates and replaces: this call was given the log another thread's call had just \
consumed. Its model and optimizer state were not donated: they are still valid. A step with \
on_nan="stop" is one training run; give each thread its own (steps of one configuration share \
their compiled programs: nothing compiles again), or share a step that keeps no log:

    wrong:  step = ft.train.train_step(loss_fn, opt)       # one step, called by every thread
    right:  step = ft.train.train_step(loss_fn, opt)       # made in each thread: its own
       or:  step = ft.train.train_step(loss_fn, opt, on_nan="skip")    # no stop log: one for all"""


STOPPED_CALL = """\
The train step's {name!r} holds a deleted array at {path}: call {call} of the train step took \
it and was stopped before it returned (a Ctrl-C, or an exception), after XLA had donated its \
buffers, so that call's results were lost with it and this {name} (and every tree sharing its \
arrays) cannot be used again. Start again from a copy or a checkpoint. To keep the model \
across a Ctrl-C, train with ft.train.Trainer (fit defers a Ctrl-C to the end of a step: \
trainer.model stays valid), or keep copies as you go:

    wrong:  for batch in data:
                model, state, out = step(model, state, batch)    # a Ctrl-C here: model lost
    right:  trainer = ft.train.Trainer(model, optimizer, loss_fn);  trainer.fit(data)
       or:  kept = jax.tree.map(jnp.copy, (model, state))       # now and then: a copy stays valid
       or:  {no_donation}"""


STEP_WITHOUT_PARTS = """\
{cls}.step returned the counting metric {name!r} without its parts ({name}#sum, {name}#count: \
its hits and counted labels), so the Trainer's means of it would weigh each minibatch's \
accuracy by its size (Σ n_b·acc_b / Σ n_b) instead of Σ hits / Σ counted. A step() that \
builds its metrics itself cannot be completed (the loss's output it read is not the step's \
to see): report them through compute_metrics, which the step completes, or keep super()'s.

    wrong:  def step(self, model, opt_state, batch, key=None, enabled=None):
                new, state, loss, aux, _ = self.apply(model, opt_state, batch, key, enabled)
                return new, state, {{"loss": loss, {name!r}: ft.train.accuracy(StepOutput(loss, aux, batch, model))}}
    right:  def compute_metrics(self, out):    # override this stage instead of step()
                return {{"loss": out.loss, {name!r}: ft.train.accuracy(out)}}
       or:  new, state, metrics = super().step(model, opt_state, batch, key, enabled)    # in step()"""


STEP_CHANGED_PARTS = """\
{cls}.step changed the metric {name!r} after TrainStep.step measured it: its parts \
({name}#sum, {name}#count: the hits and counted labels behind it) are still those of the value \
super().step() returned, so the Trainer's means of it would be the old value's (Σ hits / \
Σ counted), not what the steps report. A change made in compute_metrics is measured \
(a rescaled accuracy's parts rescaled: exact means); one made in step() cannot be.

    wrong:  def step(self, model, opt_state, batch, key=None, enabled=None):
                new, state, metrics = super().step(model, opt_state, batch, key, enabled)
                return new, state, {{**metrics, {name!r}: 100 * metrics[{name!r}]}}
    right:  def compute_metrics(self, out):
                metrics = super().compute_metrics(out)
                return {{**metrics, {name!r}: 100 * metrics[{name!r}]}}"""


_MEASURED = threading.local()  # .values: {name: (value, sum part)} TrainStep.step returned last


def check_parts(step: Any, metrics: Mapping[str, Any]) -> None:
    """Refuse ``metrics`` (what ``step.step`` returned) holding a counting metric of the
    step without its parts (an override of ``step()`` that built them itself, whose
    Trainer means would be size-weighted: ``TrainStep.step`` always adds them), or a
    value changed after ``TrainStep.step`` measured it, its parts left as they were
    (``STEP_CHANGED_PARTS``: the means would be the old value's). Checked by identity,
    at trace time."""
    for name in counting_names(step.metrics):
        if name in metrics and name + PART_SUM not in metrics:
            raise ValueError(STEP_WITHOUT_PARTS.format(cls=type(step).__name__, name=name))
    given = getattr(_MEASURED, "values", None) or {}
    for name, (value, part) in given.items():
        if name in metrics and metrics[name] is not value and metrics.get(name + PART_SUM) is part:
            raise ValueError(STEP_CHANGED_PARTS.format(cls=type(step).__name__, name=name))


_FIRST = operator.itemgetter(0)  # an in-flight call's first step (bisect's key: one C call)


def as_optimizer(optimizer: Any) -> Optimizer:
    """An :class:`ft.optim.Optimizer` from itself or from an optax transformation."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, optax.GradientTransformation) or (
        hasattr(optimizer, "init") and hasattr(optimizer, "update")
    ):
        return Optimizer(optimizer)
    raise TypeError(BAD_OPTIMIZER.format(given=repr(optimizer)[:80]))


def _merge_microbatches(aux: Any, size: int, accumulate: int, rows: Any) -> Any:
    """The aux outputs of ``accumulate`` microbatches of a batch of ``size`` examples as one."""
    return merge_aux(aux, size // accumulate, "microbatch", f"with accumulate={accumulate}", rows)


def _weakly(ref: Callable[[], Any], method: str) -> Callable[..., Any]:
    """``method`` of the step ``ref`` refers to, looked up at each call: the step holds its
    program, so the program must not hold the step (a dropped step and its last model and
    state are freed at once, not at the collector's next full pass)."""

    def call(*args: Any) -> Any:
        return getattr(ref(), method)(*args)

    return call


NOT_A_KEY = """\
the train step's fourth argument is its PRNG key, and {given} is none: the batch is one
argument (a tuple or dict of arrays), as the loss function takes it.
    wrong:  step(model, state, x, y)
    right:  step(model, state, (x, y))            # or step(model, state, batch, jax.random.key(0))"""


STEP_BUILT_WITH = """\
{cls}.{name} cannot be set after the step has run: its compiled programs were built with \
its {name}, and the next calls of the same shapes would run them as they are (the assignment \
ignored, silently). Build another step with the new {name}:

    wrong:  step.{name} = ...
    right:  step = ft.train.train_step(loss_fn, optimizer, ...)   # a new optimizer: opt_state = optimizer.init(model)"""


class Loop:
    """What a train step's calls change under ``on_nan="stop"``, kept apart from the step:
    its stop log (``[calls, call that stopped (-1), its nonfinite]``; None before the first
    call and after a stop, ``calls`` 0 then), the calls since that log was made and the calls
    in flight (``(first step, batch, key)``: references only; ``add`` appends one, an
    attribute read less per call).
    A step's own attributes are assigned through :class:`~functree.train._built.Settings`'
    check (a Python call, on assignment); these, written on every call, are plain slots."""

    __slots__ = ("add", "calls", "halt", "inflight")

    def __init__(self) -> None:
        self.halt: Any = None
        self.calls = 0
        self.inflight: list[tuple[int, Any, Any]] = []
        self.add = self.inflight.append


class TrainStep(Settings):
    """``step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)``, jitted.

    Args:
      loss_fn: ``loss_fn(model, batch)`` (or ``loss_fn(model, batch, *, key)`` when the
        step is called with a key) returning a scalar loss or ``(loss, aux)``.
      optimizer: a :class:`ft.optim.Optimizer` or an optax transformation (wrapped in
        ``ft.optim.Optimizer``, available as ``step.optimizer``). The ``opt_state`` a step
        takes is the Optimizer's: ``step.optimizer.init(model)``, not ``tx.init(model)``.
      metrics: ``{name: fn(StepOutput) -> scalar}`` or a list of such functions. A
        counting metric (``ft.train.accuracy``, ``ft.train.binary_accuracy``) also
        records its parts (hits and counted labels: ``_metrics.measured``) for the
        Trainer's exact means over minibatches, Σ hits / Σ counted, as does any value
        computed from one (a lambda of ``accuracy.of``, ``100 * accuracy(out)``); the
        metrics a call returns leave them out.
      on_nan: what a step whose loss or gradient is not finite does (``metrics["nonfinite"]``
        reports it, see :data:`NONFINITE`): ``"stop"`` (default, as in the Trainer): it
        and every later step are not applied (model and optimizer state unchanged, bit
        for bit) and :class:`NonFiniteError` is raised by a later call (at most 16 calls
        on) or by :meth:`check`; ``"skip"``: not applied, training goes on; ``"ignore"``
        (or ``None``): applied as it is. An optimizer that handles overflow itself
        (``LossScaleOptimizer``) skips a step whose gradients overflowed on its own (never
        a stop), but not one whose loss is not finite (no scale makes it finite): that
        one stops or is skipped as ``on_nan`` says, reported as the loss (-2). A call inside
        your own ``jax.jit``/``jax.vmap``/``lax.scan`` runs the same program without the
        stop's bookkeeping (which keeps concrete values across calls): the numbers of a
        plain call, but "stop" there skips a non-finite step (``metrics["nonfinite"]``
        reports it) and raises nothing later; later calls are unaffected. A step under
        "stop" is one training run (one stop log: a stop gates all its later calls), so two
        threads training at once each make their own step (steps of one configuration share
        their compiled programs); "skip" and "ignore" keep no state and may be shared.
      donate: donate the model and optimizer state buffers (default True): the arrays
        passed in are invalid afterwards; use the returned ones.
      mesh: a ``jax.sharding.Mesh``: the same step over its ``data_axis``. The batch is
        split along its leading axis (one shard per device), the gradient half of
        :meth:`ft.optim.Optimizer.step` runs per device inside ``jax.shard_map`` (manual
        over ``data_axis`` only; other mesh axes are left to the compiler) with the
        optimizer's ``axis_name`` bound to ``data_axis`` (unless it names one itself), so
        ``aggregate_gradients`` averages before ``transform_gradients`` (a global-norm clip
        sees the whole batch's gradient, as on one device; gradients a custom aggregator
        leaves varying over the axis are averaged before it too), and the update
        half runs once on the parameters and moments placed by ``sharding``. The loss and
        gradients are the mean of the devices' own: the whole batch's for a mean over
        examples; a mean over a variable count (unmasked tokens) weights each device's
        tokens by its own count, as torch's DDP does (docs/guides/scale.md: pass a count
        per example for the exact whole-batch mean).
      data_axis: the mesh axis the batch is split over.
      sharding: ``None`` (replicated), ``"fsdp"`` or ``{pattern: PartitionSpec}`` (see
        :func:`ft.partition_specs`); without a mesh, on the default device alone.
      compute_dtype: a floating dtype the loss runs in (``jnp.bfloat16``): the model
        (``ft.cast``) and the floating inputs are cast inside the differentiated function;
        master parameters, gradients and optimizer state keep their dtype. float16
        without a ``LossScaleOptimizer`` warns (``ft.optim.UnscaledFloat16Warning``).
      steps_per_call: ``k`` steps per compiled call (default 1): the batch's leaves are
        ``k`` minibatches stacked along a new leading axis (:func:`ft.train.stack_batches`),
        the program is ``lax.scan`` of the one-step program over them (the same numbers
        as ``k`` calls; keys folded per step; ``on_nan`` acts on the exact step), and every
        metric comes back with a leading axis of size ``k``. On small, dispatch-bound
        steps this divides the per-call cost by ``k``.

    With a ``key``, the loss function gets ``jax.random.fold_in(key, step)`` where
    ``step`` is the learning context's step; with an optimizer that accumulates ``k``
    microbatches, microbatch ``i`` gets ``fold_in(fold_in(key, step), i)`` (its own
    dropout masks); on a mesh, that is folded again with the device index. One base key
    reproduces every step, also after restoring a checkpoint.
    Layers that record state (BatchNorm) are run under ``ft.nn.collect_state`` and their
    no_derivative fields updated (on a mesh, averaged over devices). With an optimizer
    that accumulates ``k`` microbatches, the floating layer state is threaded through
    them: microbatch ``i`` starts from the running statistics microbatch ``i - 1``
    recorded, so one step updates them ``k`` times, as torch's ``k`` forwards do (with
    ``momentum=m``, ``r_k = m^k r_0 + Σ_i (1 - m) m^(k-1-i) s_i`` for microbatch
    statistics ``s_i``), and the step keeps the state after the ``k``-th; stored PRNG keys
    advance once per step (microbatch ``i`` salts them with ``i``). On a mesh and with
    accumulation, the loss's aux is merged back to the whole batch's: per-example rows
    concatenated, floating scalars meaned (a floating maximum too: return per-example
    values for any other reduction), anything else (an integer count, a per-class table)
    refused by name (which leaves are per-example is read from the loss's output shapes
    on the whole batch). Every batch leaf must then have one row per example.

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

    The same step over a mesh (here of one device), parameters sharded by FSDP rules:

      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> sharded = ft.train.TrainStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
      >>> model, state, metrics = sharded(model, state, batch)
      >>> int(ft.optim.context(state).samples_seen)
      404

    Sixteen steps per call, on sixteen minibatches stacked along a new leading axis:

      >>> step16 = ft.train.TrainStep(loss_fn, opt, steps_per_call=16)
      >>> model, state, metrics = step16(model, state, ft.train.stack_batches([batch] * 16))
      >>> metrics["loss"].shape, int(ft.optim.context(state).step)
      ((16,), 117)

    Override a stage by subclassing, e.g. an L1 penalty in ``compute_loss``:

      >>> class L1Step(ft.train.TrainStep):
      ...     def compute_loss(self, model, batch, key=None):
      ...         loss, aux = super().compute_loss(model, batch, key)
      ...         return loss + 1e-3 * jnp.abs(model.weight).sum(), aux
    """

    optimizer: Any = BuiltWith()
    loss_fn: Any = BuiltWith()
    metrics: Any = BuiltWith()
    compute_dtype: Any = BuiltWith()
    # Also read per call (__call__, run, _check): there through their slots, _on_nan,
    # _steps_per_call and _placement, a plain attribute read (a descriptor's __get__ is a
    # Python call).
    on_nan: Any = BuiltWith()
    steps_per_call: Any = BuiltWith()
    placement: Any = BuiltWith()
    _on_nan: str
    _steps_per_call: int
    _placement: Placement | None
    # Any other name assigned is refused (Settings: `step.donate = False` was an attribute
    # nothing read); the keywords of the step's constructor are named with the call.
    _NAMED = "step"
    _ARGUMENTS = (("__init__", "step = ft.train.train_step(loss_fn, optimizer, {})"),)

    def _built_error(self, name: str, value: Any) -> AttributeError | None:
        """:data:`STEP_BUILT_WITH` once the step has built a program (:class:`BuiltWith`)."""
        if self.__dict__.get("_shared") is None:
            return None
        return AttributeError(STEP_BUILT_WITH.format(cls=type(self).__name__, name=name))

    def __init__(
        self,
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
    ):
        if options:  # an optimizer's option (wrt=, accumulate=) or a typo, named with the fix
            raise misplaced_options(options)
        self.on_nan = check_on_nan(on_nan)
        self.steps_per_call = check_steps_per_call(steps_per_call)
        self._scanned: Any = None  # the k-steps program (_scan.py), built on first use
        self.placement = placement_of_step(mesh, data_axis, sharding, "ft.train.train_step")
        self.compute_dtype = None if compute_dtype is None else check_compute_dtype(compute_dtype)
        cls = type(self)  # a stage overridden may call loss_fn its own way (loss_fn(model, *batch))
        if cls.compute_loss is TrainStep.compute_loss and cls.apply is TrainStep.apply and cls.step is TrainStep.step:
            check_batch_argument(loss_fn, "ft.train.train_step({loss}, optimizer)")
        self.loss_fn = loss_fn
        self.optimizer = as_optimizer(optimizer)
        warn_unscaled_float16(self.optimizer, self.compute_dtype)  # its gradients would underflow silently
        self.metrics = resolve_metrics(metrics)
        self._compiled: Any = None
        self._donate = donate
        self._guard = DonationGuard("the train step")
        self._modes_checked = False  # STEP_IN_INFERENCE looked for (first call; the Trainer chooses modes itself)
        self._loop = Loop()  # the stop log, the calls in flight ...: written on every call
        self._owned_call = False  # run(owned=...) of the calls running (written when it changes)
        self._shared: Any = None  # the process-wide programs of this configuration (_programs.py)
        self._ref = weakref.ref(self)
        # The flat program a plain call runs without run()'s Python frame: set by run() once
        # the step is one step per call, without placement, over flat leaves (a loop's case).
        self._direct: Any = None
        self._directable = False  # one step per call, no placement, run() not overridden (set when built)
        self._stopped: Any = None  # (number, inputs) of a call stopped after donating (a Ctrl-C)

    @property
    def mesh(self) -> Any:
        """The mesh the step runs over (None: one device, no mesh)."""
        return None if self.placement is None else self.placement.mesh

    @property
    def data_axis(self) -> str | None:
        return None if self.placement is None else self.placement.data_axis

    @property
    def sharding(self) -> Any:
        return None if self.placement is None else self.placement.sharding

    # --- stages a subclass may override ------------------------------------------------
    def compute_loss(self, model: Any, batch: Any, key: jax.Array | None = None) -> tuple[Any, Any]:
        """``(loss, aux)`` of ``loss_fn`` on one minibatch (aux is None without one)."""
        return loss_and_aux(self.loss_fn, self.compute_dtype, model, batch, key)

    def compute_metrics(self, out: StepOutput) -> dict[str, jax.Array]:
        """``{"loss": ..., name: metric(out)}`` as float32 scalars (float64 under
        ``jax_enable_x64``). :meth:`step` adds each counting value's parts ``name#sum``,
        ``name#count`` (``_metrics.measured``), whatever an override returns: the
        Trainer's means of a counting metric (or of ``100 * acc``) are Σ hits / Σ counted
        (a mean of the minibatch accuracies weighted by minibatch size is another number
        once labels are -100). An override is traced a few more times to tell how a value
        it reports depends on the counting metrics it called (at trace time only)."""
        return evaluate_metrics(self.metrics, out)

    def apply(
        self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None,
        enabled: jax.Array | None = None,
    ) -> tuple[Any, Any, Any, Any, jax.Array | None]:
        """One optimizer step: ``(model, opt_state, loss, aux, nonfinite)``.

        :meth:`ft.optim.Optimizer.step` (an override of it is honoured, with and without a
        mesh) with this step's ``on_nan`` and ``enabled``: a step its gate closes leaves
        ``model`` and ``opt_state`` as they were. ``nonfinite`` is None with
        ``on_nan="ignore"``. A loss function returning ``ft.losses.WeightedMean``
        (``reduction="weighted"``) gives ``loss`` as that record, the whole minibatch's
        (microbatches and devices summed); its ``.value`` is the loss.
        """
        if type(self.optimizer) is Optimizer and not isinstance(opt_state, OptimizerState):  # at trace only
            raise TypeError(NOT_STEP_STATE.format(given=type(opt_state).__name__))
        where = self.placement
        size = batch_size_of(batch)
        # The optimizer hands the loss function the key (one per microbatch when it accumulates).
        if where is None:
            def loss_fn(m: Any, b: Any, key: Any = None) -> Any:
                return self.compute_loss(m, b, key)
        else:
            axis, alone = where.data_axis, where.devices == 1

            def loss_fn(m: Any, b: Any, key: Any = None) -> Any:  # runs per device, inside shard_map
                # One device on the data axis: its index is 0 (no axis_index: see _replicas).
                if alone:
                    return self.compute_loss(m, b, None if key is None else jax.random.fold_in(key, 0))
                index = jax.lax.axis_index(axis)
                with salted_keys(index):  # masks drawn from layers' stored keys: each device its own
                    return self.compute_loss(m, b, None if key is None else jax.random.fold_in(key, index))

        # The diagnostics' warnings name the user's function and line: an overridden
        # compute_loss, else the loss function.
        overridden = type(self).compute_loss is not TrainStep.compute_loss
        setattr(loss_fn, USER_FUNCTION, self.compute_loss if overridden else self.loss_fn)
        rows = self._per_example(model, batch, key) if where is not None or self.optimizer.accumulate > 1 else None
        # On a mesh the optimizer aggregates over the data axis itself, before its
        # transform_gradients (one device on the axis: nothing to aggregate, no collective).
        optimizer = self.optimizer if where is None or where.devices == 1 else with_axis_name(self.optimizer, where.data_axis)
        result = optimizer.step(
            loss_fn, model, opt_state, (batch,), has_aux=True, minibatch_size=size, on_nan=self.on_nan,
            enabled=enabled, replicas=None if where is None else functools.partial(self._replicas, rows=rows), key=key,
        )
        loss, aux = result.out
        new_model, new_state = result.model, result.state
        if where is None:
            if self.optimizer.accumulate > 1:  # microbatch outputs come stacked: (k, n / k, ...)
                aux = _merge_microbatches(aux, size, self.optimizer.accumulate, rows)
        else:
            new_model = where.constrain(new_model, where.model_specs(model))
            new_state = where.constrain(new_state, where.state_specs(opt_state))
        return new_model, new_state, loss, aux, result.nonfinite

    def _per_example(self, model: Any, batch: Any, key: Any) -> Any:
        """Which leaves of the loss's aux hold one row per example: those whose leading axis
        is the batch's when the loss runs on the whole batch (``jax.eval_shape``: a trace at
        compile time, no computation). A step split over devices or microbatches merges
        those rows and refuses what it cannot combine, whatever sizes coincide (a per-class
        table of 4 rows and 4 examples per device)."""
        size = batch_size_of(batch)
        # The model is closed over, not passed: eval_shape takes arrays, and a model may hold
        # functions as leaves (an Equinox MLP's activation).
        _, aux = jax.eval_shape(lambda b, k: collect_state(lambda mm: self.compute_loss(mm, b, k), model)[0],
                                batch, key)
        return jax.tree.map(lambda s: s.ndim >= 1 and s.shape[0] == size, aux)

    def _replicas(self, half: Callable[..., Gradients], model: Any, opt_state: Any, batch: tuple, *,
                  rows: Any) -> Gradients:
        """``half`` (the optimizer's gradient half) once per device of the data axis."""
        where = self.placement
        assert where is not None
        axis, accumulate = where.data_axis, self.optimizer.accumulate
        batch, in_batch = where.constrain_batch(batch)
        if accumulate > 1:  # named by the global batch, before each device splits its share
            check_accumulation(batch, where.devices, accumulate, axis)
        # One device on the data axis (a (1, n) mesh): nothing varies over it, so no value is
        # marked varying and no collective over it is emitted; XLA's SPMD partitioner rejects
        # such an all-reduce beside a model axis ("Cross-partition allreduce must be in
        # (partial) manual partitioning mode"). P() and P(data) are one layout there.
        alone = where.devices == 1
        if alone:
            in_batch = jax.tree.map(lambda _: PartitionSpec(), in_batch, is_leaf=is_spec)
        state_specs = where.state_specs(opt_state)
        opt_state = where.constrain(opt_state, state_specs)
        # shard_map names the manual (data) axis alone; other axes stay with the compiler.
        state_in = jax.tree.map(lambda p: PartitionSpec() if alone else only_axis(p, axis), state_specs,
                                is_leaf=is_spec)
        # FSDP: the all-gather over the data axis; other axes (tensor parallel) stay as placed.
        gathered = where.constrain(model, jax.tree.map(lambda p: without_axis(p, axis), where.model_specs(model),
                                                       is_leaf=is_spec))

        # Only the model's arrays enter shard_map; its other leaves (an Equinox MLP's
        # activation function) are closed over, as shard_map takes arrays alone.
        leaves, treedef = jax.tree.flatten(gathered)
        held = [is_array(x) for x in leaves]

        def per_device(arrays: list, s: Any, b: tuple) -> Gradients:
            given = iter(arrays)
            m = treedef.unflatten([next(given) if a else x for x, a in zip(leaves, held)])
            # Varying over the data axis: each device differentiates its own shard, and the
            # aggregator sees per-device gradients (a custom one may psum/pmean/all_gather).
            if not alone:
                m = as_varying(m, axis)
            g = half(m, s, b)
            record = g.out[0]
            weighted = isinstance(record, WeightedMean)
            # Each device weighed by its count (kept tokens), unless the optimizer's own
            # aggregation did (an optimizer naming another axis leaves the record per device).
            if weighted and (alone or all_varying(record, axis)):
                record, grads = replica_weighted_mean(record, g.grads, axis)
            else:  # what the optimizer's aggregation left varying, meaned
                grads = replica_mean(g.grads, axis, reduced="value")
                record = record if weighted else replica_mean(g.loss, axis, reduced="value")
            loss = loss_value(record)
            aux = g.out[1]
            if accumulate > 1:  # microbatch outputs come stacked: (k, n / k, ...)
                aux = _merge_microbatches(aux, batch_size_of(b), accumulate, rows)
            return Gradients(loss, (record, jax.tree.map(stack_devices, aux)), grads, jax.tree.map(stack_devices, g.layer_state))

        stacked = PartitionSpec(axis)  # apply() asks the optimizer for (loss, aux)
        g = jax.shard_map(
            per_device, mesh=where.mesh, in_specs=(PartitionSpec(), state_in, in_batch),
            out_specs=Gradients(PartitionSpec(), (PartitionSpec(), stacked), PartitionSpec(), stacked),
            axis_names={axis},
        )([x for x, a in zip(leaves, held) if a], opt_state, batch)
        local = batch_size_of(batch) // where.devices
        out = (g.out[0], merge_aux(g.out[1], local, "device", f"on a mesh of {where.devices} devices", rows))
        layer_state = jax.tree.map(merge_devices, g.layer_state)
        grad_specs = partition_specs(trained_view(model, self.optimizer.wrt), where.sharding, mesh=where.mesh, data_axis=axis, strict=False)
        return Gradients(g.loss, out, where.constrain(g.grads, grad_specs), layer_state)

    def step(
        self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None,
        enabled: jax.Array | None = None,
    ) -> tuple[Any, Any, dict[str, jax.Array]]:
        """The whole step, unjitted (``__call__`` runs it under ``jax.jit``)."""
        if key is not None:
            key = jax.random.fold_in(key, context(opt_state).step)
        new_model, new_state, loss, aux, nonfinite = self.apply(model, opt_state, batch, key, enabled)
        # A WeightedMean loss: the metrics' loss is its value, its parts weigh the means.
        out = StepOutput(loss_value(loss), aux, batch, model, loss if isinstance(loss, WeightedMean) else None)
        # Here, not in compute_metrics: an override that does not call super() still gets
        # the parts of the counting values it reports (their epoch means Σ hits / Σ counted).
        metrics = measured(lambda: self.compute_metrics(out), self.metrics, out)
        if not self.metrics and type(self).compute_metrics is TrainStep.compute_metrics:
            warn_unrecorded_aux(aux)  # scalars returned in the aux, and nothing records them
        # What check_parts compares an override of step() against (a value changed after).
        _MEASURED.values = {k: (metrics[k], metrics[k + PART_SUM]) for k in metrics
                            if k != "loss" and k + PART_SUM in metrics and k + PART_COUNT in metrics}
        if nonfinite is not None:
            metrics[NONFINITE] = nonfinite
        return new_model, new_state, metrics

    def record(self, log: dict[str, Any], metrics: Mapping[str, Any], batch: Any, opt_state: Any) -> dict[str, Any]:
        """``log`` after one step, on device: ``halt = [steps, step that stopped (-1), its
        nonfinite]``; with ``rows`` (the Trainer's buffer) row ``steps`` set to the metrics
        in their order (``nonfinite`` among them) and the learning rate, if the optimizer
        has one (one per group of ``ft.optim.groups``, in ``learning_rate_names``' order):
        one write per step."""
        count, stopped, index = log["halt"][0], log["halt"][1], log["halt"][2]
        bad = metrics.get(NONFINITE)
        if bad is not None and self.on_nan == "stop":
            first = (stopped < 0) & (bad != -1)
            stopped, index = jnp.where(first, count, stopped), jnp.where(first, bad, index)
        new = {**log, "halt": jnp.stack([count + 1, stopped, index])}
        if "rows" in log:
            dtype = log["rows"].dtype  # metric_dtype(): float64 under jax_enable_x64
            row = [jnp.asarray(v).astype(dtype) for v in metrics.values()]
            rates = learning_rate_names(opt_state)  # one, or one per ft.optim.groups group
            if rates:  # as applied: a reduce_on_plateau's scale included
                values = applied_learning_rates(opt_state, rates)
                row.extend(jnp.asarray(values[name]).astype(dtype) for name in rates)
            new["rows"] = log["rows"].at[count].set(jnp.stack(row))
        return new

    def _logged(self, model: Any, opt_state: Any, batch: Any, key: Any, log: Any) -> Any:
        """The jitted program: :meth:`step` (gated by ``log``'s stop under "stop") and :meth:`record`.
        The Trainer's rows hold every metric with the counting metrics' parts; a caller
        gets the metrics without them."""
        enabled = None if log is None or self.on_nan != "stop" else log["halt"][1] < 0
        _MEASURED.values = None  # (set by TrainStep.step, if the step calls it)
        model, opt_state, metrics = self.step(model, opt_state, batch, key, enabled)
        if log is None:
            return model, opt_state, without_parts(metrics), None
        if "rows" in log:  # the Trainer's means read the parts (at trace time: costs nothing)
            check_parts(self, metrics)
        _MEASURED.values = None  # (no tracer kept past its trace)
        log = self.record(log, metrics, batch, opt_state)
        return model, opt_state, (None if "rows" in log else without_parts(metrics)), log  # rows hold them

    _RUNTIME = ("_scanned", "_compiled", "_guard", "_loop", "_shared", "_ref", "_owned_call", "_directable",
                "_direct", "_stopped")
    """Instance attributes that are run-time state; every other one is configuration: a
    step equal to another in all of them (and in class) shares its compiled programs."""

    def _shared_program(self, kind: str, method: str, model: Any) -> Any:
        """``method`` jitted, its compiled programs shared by every step of this
        configuration in the process (as ``jax.jit`` of one function shares them): a new
        Trainer with the same loss function, optimizer configuration and shapes compiles
        nothing (see :mod:`functree.train._programs`). Over flat leaves (the model and
        state a loop passes back are not flattened again), or with static leaves for
        Equinox submodules."""
        if self._shared is None:
            self._shared = shared(program_key("TrainStep", self, self._RUNTIME, model))
            self._shared.owner = self._ref
            # (the settings are fixed from now on: BuiltWith)
            self._directable = self._steps_per_call == 1 and self._placement is None and type(self).run is TrainStep.run
        entry = self._shared
        donate = (0, 1, 4) if self._donate else (4,)
        if has_untraceable_leaves(model):  # one function per configuration: JAX's caches key on it
            run = entry.programs.setdefault(kind + " static", {}).get(method)
            if run is None:
                run = entry.programs[kind + " static"][method] = _calling_train(entry, method)
            return unchecked_jit(run, donate=donate, static_leaves=True)
        # The wrapper names the class's function (never this instance: the shared table must
        # not keep a step alive); a retrace calls the step whose call is running.
        traced = explain_control_flow(getattr(type(self), method), trampoline(entry, method))
        return flat_jit(traced, donate=donate, owned=(4,), programs=entry.programs.setdefault(kind, {}),
                        guard=self._guard, before=_weakly(self._ref, "_before"),
                        explain=_weakly(self._ref, "_explain"))

    def _program(self, model: Any) -> Any:
        if self._compiled is None:  # built on first use: Equinox submodules need static leaves
            self._compiled = self._shared_program("one", "_logged", model)
        return self._compiled

    def _scanned_logged(self, model: Any, opt_state: Any, batch: Any, key: Any, log: Any) -> Any:
        """:meth:`_logged` once per leading slice of ``batch``, under ``lax.scan``."""
        return scan_steps(self._logged, model, opt_state, batch, key, log)

    def _scan_program(self, model: Any) -> Any:
        """The program of several steps per call (any leading size; one trace per size)."""
        if self._scanned is None:  # as _program: over flat leaves unless Equinox needs static ones
            self._scanned = self._shared_program("scan", "_scanned_logged", model)
        return self._scanned

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
        program = self._program(model) if self.steps_per_call == 1 else self._scan_program(model)
        if self._shared is not None:
            self._shared.owner = self._ref
        return program.lower(model, opt_state, batch, key, self._new_halt_log(model))

    def run(self, model: Any, opt_state: Any, batch: Any, key: Any = None, log: Any = None, *,
            owned: bool = False, steps: int | None = None) -> Any:
        """One call of the jitted program: ``(model, opt_state, metrics, log)``; ``log`` is
        None or a tree :meth:`record` updates on device (the Trainer's metric buffer, whose
        ``rows`` hold the metrics: ``metrics`` is None then). ``owned``: the caller knows
        that no two leaves of ``model`` and ``opt_state`` share a buffer (the Trainer copies
        them once), so new inputs are not searched for aliases, and their arrays are looked
        through for a deleted one only when the call fails (the Trainer's epoch end passes
        a state with a new learning context every epoch). ``steps``: the steps this
        call runs (default ``steps_per_call``); above 1, ``batch`` holds that many
        minibatches stacked along its leading axis."""
        batch = private_arrays(batch)  # (a plain call's copies pass as they are)
        if not self._modes_checked:  # the first call: a fresh (inference-mode) model given a key
            self._modes_checked = True
            if key is not None:
                warn_step_in_inference(model)
        steps = self._steps_per_call if steps is None else steps
        if steps == 1:
            program = self._compiled or self._program(model)
        else:
            check_stacked(batch, steps)
            program = self._scan_program(model)
        if owned is not self._owned_call:  # another caller (the Trainer's owned calls, a plain one's): rare
            self._owned_call = owned
            if owned:  # a plain call goes through run() again: the direct path's inputs are never owned
                self._direct = None
        if self._placement is not None:
            where = self._placement
            if steps == 1:
                batch = where.shard_batch(batch)
            else:  # (its rows set `earlier`, as shard_batch's do: a short last minibatch is named)
                where.check_stacked(batch)
                batch = shard_stacked(where.mesh, where.data_axis, batch)
        if self._shared is not None:  # a shared program traces (new shapes) with this step's stages
            self._shared.owner = self._ref
        if program.__class__ is FlatJit:  # it runs _before, _explain and the guard off a loop's fast path
            if not owned and steps == 1 and self._directable:
                # __call__ goes straight to it from now on, by its bound method: Python calls
                # a method inline, an object through its type's slot
                self._direct = program.__call__
            return program(model, opt_state, batch, key, log)
        (model, opt_state, batch, key, log), _ = self._before((model, opt_state, batch, key, log), {})  # static leaves
        try:
            out = program(model, opt_state, batch, key, log)
        except NOT_A_JAX_TYPE as e:  # a jax.eval_shape template given as the model or state
            abstract = _abstract_input(e, (model, opt_state))
            if abstract is None:
                raise
            raise abstract from None
        except (RuntimeError, ValueError) as e:
            self._explain(e, (model, opt_state), {})
            raise
        self._guard.remember(out, (model, opt_state))
        return out

    def _before(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """``args`` (model, opt_state, ...) for a call whose model or state are not the
        previous call's results: a deleted array named (unless the caller owns them: then
        only if the call fails), placed on the step's mesh, one array at two leaves copied
        apart (with a warning naming both key paths) when donating."""
        model, opt_state = args[0], args[1]
        if not self._guard.fresh(model, opt_state):
            return args, kwargs
        owned = self._owned_call
        if not owned:  # (the owner's arrays are live: a deleted one is named if the call fails)
            self._check_donated(model, opt_state)
        if self._placement is not None:
            model, opt_state = self._placement.place(model, opt_state)
        rest = args[2:]
        if self._donate and not owned:
            warn_aliases(model, what="The model given to the train step",
                         trained=lambda: moved_view(self.optimizer, model))
            model, opt_state = copy_aliases((model, opt_state))
            rest = _batch_copied_apart(model, opt_state, rest)
        if len(rest) > 2 and rest[2] is self._loop.halt is not None and self._placement is None:  # (the Trainer's log: committed)
            rest = (*rest[:2], placed_as(rest[2], model), *rest[3:])  # placed as this call's model
        return (model, opt_state, *rest), kwargs

    def _explain(self, error: Exception, args: tuple, kwargs: dict[str, Any]) -> Exception | None:
        """Name a deleted array of the model or state (the caller's own are checked only now;
        another thread's call may have donated the others since :meth:`_before`), or the
        arguments committed to other devices than the model's; a stop log another thread's
        call consumed (:data:`SHARED_STOP_LOG`)."""
        log = next(iter(args[4:]), None)  # (the step's log argument)
        if log is not None and "halt" in log and "rows" not in log and (  # (the Trainer's log: its own)
                is_deletion_error(error) and log["halt"].is_deleted()):
            return RuntimeError(SHARED_STOP_LOG)
        if is_deletion_error(error):  # the owner's arrays (checked only now), or a call in another
            self._check_donated(args[0], args[1])  # thread donated them after this one's check
        abstract = _abstract_input(error, args)
        if abstract is not None:
            return abstract
        key = args[3] if len(args) > 3 else None
        if key is not None and key_batch(key) is None:  # step(model, state, x, y): y taken as the key
            return TypeError(NOT_A_KEY.format(given=describe_batch(key)))
        several = None if key is None else several_keys(key, "step")  # a whole split: fold_in refused it
        if several is not None:
            return several
        return devices_error("the train step", error, list(zip(("model", "opt_state", "batch", "key"), args)))

    def _check_donated(self, model: Any, opt_state: Any) -> None:
        """The error naming a deleted (donated) array of ``model`` or ``opt_state``, if any:
        :data:`STOPPED_CALL` after a call that a Ctrl-C stopped once it had donated them."""
        named = (("model", model), ("opt_state", opt_state))
        if self._stopped is not None:
            call, taken = self._stopped
            for name, tree in named:
                path = deleted_leaf(tree) if any(tree is t for t in taken) else None
                if path is not None:
                    raise ValueError(STOPPED_CALL.format(name=name, path=path, call=call, no_donation=NO_DONATION))
        self._guard.check_donated(named, what="The train step's", step="the train step", no_donation=NO_DONATION)

    def _was_stopped(self, error: BaseException) -> None:
        """A call stopped by ``error``: a Ctrl-C (or SystemExit), or XLA failing as it ran,
        may land once the program has donated its inputs (most often at the return of
        JAX's call), so the call's results are lost with them; an error of the step's own
        checks comes before any donation and records nothing. Where it had donated its
        inputs, its number and inputs are kept for :data:`STOPPED_CALL`, and a stop log it
        consumed is replaced: the step would have refused every later call (a deleted log
        reads as :data:`SHARED_STOP_LOG`, another thread's call)."""
        if isinstance(error, Exception) and not isinstance(error, jax.errors.JaxRuntimeError):
            return
        guard = self._guard
        if deleted_leaf(guard._last) is not None:  # stopped in the program's call: it took the last results
            self._stopped = (guard.calls + 1, guard._last)
        else:  # stopped after its results were made (the guard's last), before they reached the caller
            given = guard._given
            self._stopped = (guard.calls, given if isinstance(given, tuple) else (given,))
        loop = self._loop
        if loop.halt is not None and loop.halt["halt"].is_deleted():
            loop.halt, loop.calls = None, 0  # a new log at the next call, as for a first call

    def _new_halt_log(self, model: Any = None) -> Any:
        if self._on_nan != "stop":
            return None
        return self._place_log(new_halt_log()) if self._placement is not None else placed_as(new_halt_log(), model)

    def _place_log(self, log: Any) -> Any:
        """A new log where the step's program returns it (replicated over the mesh), so the
        second call finds the first call's program (a log on the default device compiled the
        step again on every mesh)."""
        return log if self._placement is None else self._placement.replicate(log)

    def __call__(self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None) -> Any:
        # What run() does for a plain call, inline once run() has set _direct: the program's
        # own call (its donation guard and checks inside), no run() frame per loop step.
        direct = self._direct
        if CURRENT.value is not TOP:  # inside the user's jit/vmap/scan: keep none of its values
            return traced_call(self, model, opt_state, batch, key)
        # NumPy leaves copied: the step runs after this call returns, and JAX would read a
        # buffer the caller refills for the next batch (functree/_host_buffers.py). A batch of
        # device arrays is looked at here, inline: a loop's call runs no Python frame for it.
        kind = batch.__class__
        if kind is tuple:
            plain = JAX_ARRAYS.issuperset(map(type, batch))  # (one C call: no Python loop)
        else:
            plain = kind is dict and JAX_ARRAYS.issuperset(map(type, batch.values()))
        if not plain:
            batch = private_arrays(batch)
        # (try costs a loop's call nothing: Python 3.11's exception tables)
        if self._on_nan != "stop":
            try:
                if direct is None:
                    return self.run(model, opt_state, batch, key)[:3]
                self._shared.owner = self._ref  # a retrace (new shapes) calls this step's stages
                return direct(model, opt_state, batch, key, None)[:3]
            except BaseException as e:
                self._was_stopped(e)
                raise
        loop = self._loop
        if not loop.calls & 15:  # (no log: no call since one stopped, and so calls 0)
            if loop.halt is None:
                loop.halt = self._new_halt_log(model)
                loop.inflight.clear()
            else:  # now and then, without waiting: has a step stopped?
                self._check(model, opt_state, block=False)
        loop.add((loop.calls * self._steps_per_call, batch, key))  # its first step
        try:
            if direct is None:
                model, opt_state, metrics, loop.halt = self.run(model, opt_state, batch, key, loop.halt)
            else:
                self._shared.owner = self._ref
                model, opt_state, metrics, loop.halt = direct(model, opt_state, batch, key, loop.halt)
        except BaseException as e:
            self._was_stopped(e)
            raise
        loop.calls += 1
        return model, opt_state, metrics

    def check(self) -> None:
        """Wait for the steps called so far and raise :class:`NonFiniteError` if one of them
        stopped (``on_nan="stop"``); the error holds that step's inputs."""
        last = self._guard._last
        if self._loop.halt is not None and last:
            self._check(last[0], last[1], block=True)

    def _check(self, model: Any, opt_state: Any, block: bool) -> None:
        loop = self._loop
        halt = loop.halt["halt"]
        try:
            if not (block or halt.is_ready()):
                return
            count, stopped, index = (int(v) for v in np.asarray(halt))
        except RuntimeError:
            if halt.is_deleted():  # another thread's call donated it since this one read it
                raise RuntimeError(SHARED_STOP_LOG) from None
            raise
        k = self._steps_per_call
        if stopped < 0:  # the first `count` steps are done: drop their inputs (held in call order)
            del loop.inflight[:bisect.bisect_right(loop.inflight, count - k, key=_FIRST)]
            return
        first, batch, key = next(x for x in loop.inflight if x[0] <= stopped < x[0] + k)
        loop.halt, loop.calls = None, 0  # a new log at the next call
        where = ""
        if k > 1:  # the minibatch of that step, and where it was in its call
            batch = step_slice(batch, stopped - first)
            where = f" (step {stopped + 1} was step {stopped - first + 1} of the {k} of call {first // k + 1})"
        raise nonfinite_error(stopped + 1, index, train_step=self, model=model, opt_state=opt_state,
                              batch=batch, key=key, history=where)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        where = "" if self.placement is None else f", {self.placement!r}"
        dtype = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        k = "" if self.steps_per_call == 1 else f", steps_per_call={self.steps_per_call}"
        return (f"{type(self).__name__}({name}, {self.optimizer!r}, metrics={list(self.metrics)}, "
                f"on_nan={self.on_nan!r}{where}{dtype}{k})")


def _batch_copied_apart(model: Any, opt_state: Any, rest: tuple) -> tuple:
    """``rest`` (batch, key, log) with each array of the batch or key that is also a leaf of
    the donated ``model`` or ``opt_state`` copied (:data:`BATCH_ALIASES`, an AliasWarning):
    XLA refuses a call that donates a buffer and reads it again (``step(model, state,
    model.w)``), an error naming no key path."""
    tree = (model, opt_state, *rest[:2])
    donated = len(jax.tree.leaves((model, opt_state)))
    pairs = [(a, b) for a, b in find_aliases(tree) if a < donated <= b]
    if not pairs:
        return rest
    names = [(_argument_name("0." + a, _ARGUMENTS), _argument_name("0." + b, _ARGUMENTS))
             for a, b in alias_names(tree, pairs)]
    pairs_shown = [f"{b} is {a}" for a, b in names]
    warn(BATCH_ALIASES.format(pairs=", ".join(pairs_shown), example=pairs_shown[0], no_donation=NO_DONATION),
         AliasWarning)
    copied = copy_aliases(tree, pairs)
    return (*copied[2:], *rest[2:])


def _abstract_input(error: Exception, args: tuple) -> TypeError | None:
    """:data:`ABSTRACT_STEP_INPUT` for a step that failed with a TypeError on a model or
    state holding ``jax.ShapeDtypeStruct`` leaves (a template not restored: JAX said
    "unsupported operand type(s) for +: 'ShapeDtypeStruct' and 'DynamicJaxprTracer'")."""
    if not isinstance(error, NOT_A_JAX_TYPE):
        return None
    for arg, tree in zip(("model", "opt_state"), args):
        found = abstract_leaf(tree)
        if found is not None:
            return TypeError(ABSTRACT_STEP_INPUT.format(arg=arg, path=found[0] or "it", leaf=short_array(found[1])))
    return None


def _calling_train(entry: Any, method: str) -> Callable[..., Any]:
    """A function that calls ``method`` (``_logged`` or ``_scanned_logged``) of the train step
    now running ``entry``'s program (the shared table must not hold the step)."""
    call = trampoline(entry, method)

    def run(model: Any, opt_state: Any, batch: Any, key: Any, log: Any) -> Any:
        return call()(model, opt_state, batch, key, log)

    return run


