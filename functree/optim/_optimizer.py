"""``ft.optim.Optimizer``: optax numerics behind TF RFC 234's overridable ``minimize`` hooks.

``minimize`` runs, in order (each step is a method a subclass overrides, or a function
given to the constructor)::

    transform_loss(loss)                          # e.g. loss scaling
    get_gradients(loss_fn, model, *batch)         # → (loss, grads), grads = ∇ transform_loss(loss)
    transform_unaggregated_gradients(grads)       # per replica, before the all-reduce
    aggregate_gradients(grads)                    # mean over the data-parallel axis, if bound
    transform_gradients(grads)                    # e.g. clipping
    update(grads, state, model) → (updates, state)   # the optax transformation
    apply_updates(model, updates) → model         # ft.move(model, along=updates)

``step`` (what ``minimize`` and ``ft.train.TrainStep`` run) is two halves, each a method:
``gradients`` (the loss, the gradients through the hooks above, recorded layer state: per
replica, inside ``shard_map`` on a mesh) and ``apply_step`` (the one gate, from one
finiteness reduction: ``on_nan``, ``enabled`` and an optimizer that handles overflow itself;
then ``update`` and ``apply_updates`` inside one ``lax.cond`` on it; on the CPU, for a
transform declared separable, one small ``lax.cond`` per parameter: see
:mod:`functree.optim._leafwise`).

Everything is pure: the optimizer object holds configuration only, the state is a pytree
of arrays and NamedTuples, and one ``ft.jit``-compiled step runs all of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.core import Tracer

from functree._alias import copy_aliases, warn_aliases
from functree._foreign_methods import OPTIMIZER_METHODS, missing_attribute
from functree._module import Module
from functree._operators import value_with_gradient
from functree._parameters import floats_as_arrays, parameters, with_parameters
from functree._source import USER_FUNCTION
from functree._tangent import move
from functree._tree import bounded_put, cached, dotted_name, is_none
from functree._where import devices_error, placement_of, put, several_devices
from functree.losses._weighted import WeightedMean, loss_value
from functree.nn._lora import check_base_untrained
from functree.nn._mode import in_mode, mode_free
from functree.nn._state import apply_state, collect_state
from functree.optim._accumulate import accumulated_gradients, leading_dimension
from functree.optim._average import check_average_placement, with_average
from functree.optim._checks import (
    check_not_passed_through,
    check_state_fits,
    checked_gradients,
    descent_direction,
    keep_unchanged,
    named_structure_errors,
)
from functree.optim._complex import real_pairs
from functree.optim._context import advance, current, initial_context
from functree.optim._extras import (
    EXTRAS_REFUSED,
    check_context_reaches,
    extra_arguments,
    loss_value_fn,
    taking_extras,
    with_extras,
)
from functree.optim._groups import GroupStateChanged
from functree.optim._hooks import (
    BOTH_LOSS_HOOKS,
    CALLS_LOSS_AS_GIVEN,
    HOOK_WITHOUT_SCALE,
    SCALED_HOOK,
    chain_hooks,
    check_hook_call,
    check_loss_call,
    checked_hook,
    checked_hooks,
    takes_keyword,
    takes_scale,
)
from functree.optim._hyper import SIZE_NOT_GIVEN, HyperState, minibatch_size_source, model_not_given
from functree.optim._leafwise import is_separable, leafwise_gated_update
from functree.optim._lookahead import from_optax
from functree.optim._masked import frozen_leaves, named_member_masks
from functree.optim._multisteps import check_multisteps
from functree.optim._per_tensor import check_stack_statistics
from functree.optim._rate import check_rate_applied
from functree.optim._replicas import (
    all_varying,
    as_varying,
    axis_size,
    replica_mean,
    replica_weighted_mean,
    tracks_varying,
    varying_axes,
)
from functree.optim._skip import (
    SkipState,
    applied_in,
    apply_or_keep,
    check_on_nan,
    gate,
    guard,
    select,
)
from functree.optim._skip import keep_nonfinite as _keep
from functree.optim._state import OptimizerState, release_contexts
from functree.optim._subset import (
    check_wrt,
    drop_frozen,
    frozen_members,
    trained_view,
    with_frozen_members,
)

__all__ = ["Optimizer", "OptimizerWrapper", "StepResult", "Gradients", "with_wrt", "with_axis_name", "moved_view"]

FROZEN_OPTIMIZER = """\
Optimizers are immutable; build a new one instead of assigning {name!r}:

    wrong:  opt.{name} = {value}
    right:  opt = ft.optim.Optimizer({arguments})
"""

FROZEN_HYPERPARAMETER = """\
Optimizers are immutable, and {name!r} is no option of ft.optim.Optimizer: a hyperparameter \
(learning_rate, ...) lives in the optimizer state. Set it there (jitted steps do not \
recompile; ft.optim.hyperparameters(state) lists the names), or build a new optimizer:

    wrong:  opt.{name} = {value}
    right:  state = ft.optim.set_hyperparameters(state, {name}={value})      # state = opt.init(model)
       or:  opt = ft.optim.Optimizer(ft.optim.adam({name}={value}))          # a new state: opt.init(model)
"""

MASK_IN_TRAINING_MODE = """\
The optax transformation refused the parameters' structure: a mask or label tree given to \
it (optax.masked, adamw(mask=...), multi_transform) does not have the structure of the \
parameters the optimizer passes it (JAX's error is below: a key missing, or another \
structure). If the model has Dropout/BatchNorm, it may have been built in training mode \
(ft.nn.training: the flags are part of a tree's structure); the optimizer keeps its state \
mode-free, in inference mode's structure, so build the tree from that:

    wrong:  optax.masked(tx, ft.mask(model, "*.weight"))                  # model in training mode
    right:  optax.masked(tx, ft.mask(ft.nn.inference(model), "*.weight"))
       or:  ft.optim.Optimizer(tx, wrt="*.weight")      # train a subset: a key-path pattern

JAX: {error}"""

NOT_A_TRANSFORM = """\
ft.optim.Optimizer needs an optax GradientTransformation (an object with init and update), \
got {given}.

    right:  ft.optim.Optimizer(ft.optim.adam(1e-3))
       or:  ft.optim.Optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
"""

# Flax NNX's nnx.Optimizer(model, tx, wrt=nnx.Param) takes the model first and keeps the state
# inside; here the transform alone, and the state is init's.
MODEL_FIRST = """ft.optim.Optimizer takes the transformation alone, got {count} positional arguments ({given}): \
Flax NNX's nnx.Optimizer(model, tx) holds the model and its state; here the state is \
optimizer.init(model)'s, passed to and returned by each step.

    wrong:  optimizer = ft.optim.Optimizer(model, optax.adam(1e-3))
    right:  optimizer = ft.optim.Optimizer(optax.adam(1e-3))
            opt_state = optimizer.init(model)
            updates, opt_state = optimizer.update(grads, opt_state, model)   # or a train step
"""

# torch's loop: loss.backward() leaves gradients in the parameters, optimizer.step() applies them.
TORCH_STEP = """\
Optimizer.step takes the loss function, the model, the state and the batch, got {given}: \
torch's optimizer.step() applies the gradients that loss.backward() left in the parameters; \
here gradients are values, and one call computes them and returns the new model and state.

    wrong:  loss.backward();  optimizer.step()
    right:  model, opt_state, loss = optimizer.minimize(loss_fn, model, opt_state, x, y)
       or:  grads = ft.gradient(loss_fn, at=model)
            updates, opt_state = optimizer.update(grads, opt_state, model)
            model = ft.move(model, along=updates)
"""

_NOT_GIVEN: Any = object()  # step's arguments, refused by name when missing (torch's step())


NESTED_SKIP = """\
ft.optim.skip_non_finite sits inside {inside} (state {path}): on a non-finite gradient it \
skips {what}, while the optimizer's one learning context stops for the whole step, so \
{consequence}. Skip the whole step: put skip_non_finite outside, or leave it out and let \
the step skip (ft.train.train_step(loss_fn, opt, on_nan="skip"), the Trainer's on_nan):

    wrong:  {wrong}
    right:  {right}"""

NESTED_SKIP_CASES = {
    "inner_states": (
        "ft.optim.groups", "that group's update only",
        "the other groups, which did update, take this step's scheduled rate again at the next "
        "(a piecewise rate of 1, 2, 3, 4, 5 gave them 1, 2, 2, 3, 4), and its samples go uncounted",
        'ft.optim.groups({"head.*": ft.optim.skip_non_finite(tx)}, default=other)',
        'ft.optim.skip_non_finite(ft.optim.groups({"head.*": tx}, default=other))'),
    "fast_state": (
        "ft.optim.lookahead's fast optimizer", "the fast update only",
        "lookahead counts the skipped step towards sync_period and syncs the weights at a step "
        "that did not happen (sgd(1.0), sync_period=2, a NaN at step 2: fast weights 2.5 and slow "
        "1.5 after 5 steps, where 4 real steps give 2.0 and 2.0)",
        "ft.optim.lookahead(ft.optim.skip_non_finite(tx), sync_period=5, slow_step_size=0.5)",
        "ft.optim.skip_non_finite(ft.optim.lookahead(tx, sync_period=5, slow_step_size=0.5))"),
    "masked": (
        "optax.masked", "the masked parameters' update only",
        "the other parameters, which did update, take this step's scheduled rate again at the "
        "next (a piecewise rate of 1, 2, 3, 4, 5 gave them 1, 2, 2, 3, 4)",
        "optax.chain(optax.masked(ft.optim.skip_non_finite(tx), mask), other)",
        "ft.optim.skip_non_finite(optax.chain(optax.masked(tx, mask), other))"),
}
"""Where a :func:`ft.optim.skip_non_finite` may not sit inside an Optimizer's transform (the
attribute of the enclosing state on its path, or ``"masked"`` for an ``optax.masked`` state,
whose attribute ``inner_state`` ``optax.inject_hyperparams`` shares): what it would skip, and
the fix."""


NOT_OPTIMIZER_STATE = """\
Optimizer.update needs the state that Optimizer.init made (an ft.optim.OptimizerState), \
got {given}:

    wrong:  state = ft.optim.adam().init(model);  opt.update(grads, state, model)
    right:  state = opt.init(model);              opt.update(grads, state, model)
"""

# Flax NNX's optimizer.update(model, grads) (0.11; update(grads) before) updates in place.
NNX_UPDATE = """\
Optimizer.update takes (grads, state, model) and returns (updates, state), got {given}: \
Flax NNX's optimizer.update(model, grads) updates the model and its state in place; here \
both are values, passed in and returned.

    wrong:  optimizer.update(model, grads)
    right:  updates, opt_state = optimizer.update(grads, opt_state, model)
            model = ft.move(model, along=updates)
"""


class StepResult(NamedTuple):
    """What :meth:`Optimizer.step` returns: the new model and state, the loss function's
    output and the gradients after the hooks (what a training loop reports).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.5))
      >>> w = {"w": jnp.ones(2)}
      >>> result = opt.step(lambda p, x: jnp.sum(p["w"] * x), w, opt.init(w), (jnp.ones(2),))
      >>> result.model["w"], result.grads["w"]
      (Array([0.5, 0.5], dtype=float32), Array([1., 1.], dtype=float32))
    """

    model: Any
    state: Any
    out: Any
    grads: Any
    nonfinite: Any = None
    """-1, or the index of the first parameter whose gradient was not finite (-2: only the
    loss) when the step's gate closed on it; None when the step did not check."""


class Gradients(NamedTuple):
    """The first half of a step (:meth:`Optimizer.gradients`): the loss, the loss function's
    output (the loss or ``(loss, aux)``), the gradients after the hooks, and the layer state
    the model recorded (``{key path: value}``)."""

    loss: Any
    out: Any
    grads: Any
    layer_state: Any


def _strongly_typed(tree: Any) -> Any:
    """``tree`` with its weakly typed leaves made strong (same dtype and values).

    An update returns strongly typed leaves, and a restored checkpoint holds them: a
    weakly typed initial leaf (``optax.lbfgs``'s line-search counts) would give a jitted
    step another input type at its second call, and a second compile.
    """
    return jax.tree.map(lambda x: jnp.asarray(x, x.dtype) if getattr(x, "weak_type", False) else x, tree)


class Optimizer:
    """An optimizer with TF RFC 234's overridable ``minimize`` hooks, over an optax transform.

    Args:
      transform: any optax ``GradientTransformation`` (``ft.optim.adam(...)``,
        ``optax.adam(...)``, chains, groups ...). The optimizer's state holds the one
        learning context; functree transforms read it through the optax extra argument
        ``context=``.
      transform_loss: ``loss -> loss`` applied before differentiation.
      get_gradients: ``(loss_fn, model, *batch, has_aux=) -> (loss_or_(loss, aux), grads)``;
        given ``wrt=`` (the patterns below) too when it takes that keyword.
      transform_unaggregated_gradients: ``grads -> grads`` (or a sequence, applied in
        order) before aggregation.
      aggregate_gradients: ``grads -> grads``; default: mean over ``axis_name`` when bound.
      transform_gradients: ``grads -> grads`` (or a sequence) after aggregation, e.g.
        clipping.
      apply_updates: ``(model, updates) -> model``; default ``ft.move(model, along=updates)``.
      axis_name: the data-parallel axis name (for the default aggregation).
      accumulate: split each batch into this many microbatches along its leading axis and
        average their gradients inside the step (``lax.scan``: memory of one microbatch;
        a bfloat16/float16 parameter's summed in float32, rounded once after the mean);
        one optimizer step per call, ``samples_seen`` grows by the whole batch. A step
        given a ``key`` hands microbatch ``i`` the key ``jax.random.fold_in(key, i)``:
        each has its own dropout masks, as the rows of the whole batch would. Layer
        state is threaded: microbatch ``i``'s BatchNorm update starts from microbatch
        ``i - 1``'s running statistics, so one step updates them ``k`` times, as torch's
        ``k`` forwards do (stored dropout keys advance once per step, for any ``k``).
      average: a weight-averaging transform (``ft.optim.ema(0.999)``,
        ``ft.optim.uniform_average()``) chained after ``transform``; the averaged model
        is ``ft.optim.averaged(state, model)``.
      wrt: key-path patterns (as ``ft.gradient(wrt=)``): train only those parameters.
        Gradients are computed for them alone, the others get no optimizer state and
        stay bit for bit.

    An ``optax.lookahead(...)`` transform runs as ``ft.optim.lookahead(...)`` (slow
    weights in the state, the model holds the fast ones).

    ``minimize`` returns ``(model, state, loss)`` or ``(model, state, (loss, aux))``; with
    ``accumulate`` the loss is the microbatches' mean and ``aux`` is stacked.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(3, 1, key=jax.random.key(0))
      >>> clip = lambda grads: ft.tree_map(lambda g: jnp.clip(g, -1.0, 1.0), grads)
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1), transform_gradients=clip)
      >>> state = opt.init(model)
      >>> loss_fn = lambda m, x, y: ((m(x) - y) ** 2).mean()
      >>> step = ft.jit(lambda m, s, x, y: opt.minimize(loss_fn, m, s, x, y), donate=(0, 1))
      >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
      >>> for _ in range(50):
      ...     model, state, loss = step(model, state, x, y)
      >>> bool(loss < 1e-3), int(ft.optim.context(state).samples_seen)
      (True, 400)
    """

    _transform: optax.GradientTransformationExtraArgs
    _raw_transform: optax.GradientTransformation
    _transform_loss: Callable[[Any], Any] | None
    _get_gradients: Callable[..., Any] | None
    _unaggregated: tuple[Callable[[Any], Any], ...]
    _aggregate: Callable[[Any], Any] | None
    _transform_gradients: tuple[Callable[[Any], Any], ...]
    _apply_updates: Callable[[Any, Any], Any] | None
    _axis_name: Any
    _step_axis: bool = False  # axis_name bound by a mesh step (with_axis_name), not the user's
    _accumulate: int
    _wrt: tuple[str, ...] | None
    _separable: bool
    _averaged: bool  # average= given: the state's top pair is with_average's

    def __init__(
        self,
        transform: optax.GradientTransformation,
        *misplaced: Any,
        transform_loss: Callable[[Any], Any] | None = None,
        get_gradients: Callable[..., Any] | None = None,
        transform_unaggregated_gradients: Any = (),
        aggregate_gradients: Callable[[Any], Any] | None = None,
        transform_gradients: Any = (),
        apply_updates: Callable[[Any, Any], Any] | None = None,
        axis_name: Any = None,
        accumulate: int = 1,
        average: Any = None,
        wrt: Any = None,
    ):
        if misplaced:  # nnx.Optimizer(model, tx): Python's "takes 2 positional arguments" named
            given = ", ".join(type(a).__name__ for a in (transform, *misplaced))
            raise TypeError(MODEL_FIRST.format(count=1 + len(misplaced), given=given))
        if not (hasattr(transform, "init") and hasattr(transform, "update")):
            raise TypeError(NOT_A_TRANSFORM.format(given=type(transform).__name__))
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive int (microbatches per step), got {accumulate!r}.")
        if transform_loss is not None and get_gradients is not None:
            raise ValueError(BOTH_LOSS_HOOKS)
        set_ = object.__setattr__
        set_(self, "_transform", optax.with_extra_args_support(
            with_average(real_pairs(taking_extras(from_optax(with_extras(transform)))), average)))
        set_(self, "_raw_transform", transform)
        set_(self, "_transform_loss", checked_hook("transform_loss", transform_loss))
        set_(self, "_get_gradients", get_gradients)
        set_(self, "_unaggregated", checked_hooks("transform_unaggregated_gradients", transform_unaggregated_gradients))
        set_(self, "_aggregate", checked_hook("aggregate_gradients", aggregate_gradients))
        set_(self, "_transform_gradients", checked_hooks("transform_gradients", transform_gradients))
        set_(self, "_apply_updates", checked_hook("apply_updates", apply_updates))
        set_(self, "_axis_name", axis_name)
        set_(self, "_accumulate", accumulate)
        set_(self, "_wrt", check_wrt(wrt))
        set_(self, "_separable", is_separable(transform) and average is None)
        set_(self, "_averaged", average is not None)

    def __setattr__(self, name: str, value: Any) -> None:
        shown = repr(value) if isinstance(value, (int, float)) else "..."
        if name not in inspect.signature(Optimizer.__init__).parameters:
            raise AttributeError(FROZEN_HYPERPARAMETER.format(name=name, value=shown))
        arguments = "new_transform" if name == "transform" else f"transform, {name}={shown}"
        raise AttributeError(FROZEN_OPTIMIZER.format(name=name, value=shown, arguments=arguments))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._raw_transform!r})"

    if not typing.TYPE_CHECKING:  # (a class-level __getattr__ would type every attribute Any)
        def __getattr__(self, name: str) -> Any:
            # Only for a name normal lookup did not find: torch's zero_grad(), param_groups ...
            # A property whose own code raised AttributeError lands here too: run it again.
            if any(name in k.__dict__ for k in type(self).__mro__):
                return object.__getattribute__(self, name)
            raise missing_attribute(self, name, OPTIMIZER_METHODS)

    # --- configuration, read by the orchestration (wrappers delegate these) ---------------
    @property
    def transform(self) -> optax.GradientTransformationExtraArgs:
        """The optax transformation doing the numerics (it takes optax extra arguments)."""
        return self._transform

    @property
    def accumulate(self) -> int:
        """Microbatches per step."""
        return self._accumulate

    @property
    def wrt(self) -> tuple[str, ...] | None:
        """The key-path patterns of the trained parameters (``None``: all of them)."""
        return self._wrt

    # --- state ---------------------------------------------------------------------------
    def init(self, model: Any) -> Any:
        """The :class:`OptimizerState` for ``model`` (a Module or pytree; its parameter view is used).

        It holds one learning context; the functree transforms inside hold none of their
        own. A known per-tensor optax transform (LAMB, LARS, Adafactor, clip_by_block_rms
        ...) on parameters holding an ``ft.nn.Stack`` is refused
        (:data:`~functree.optim._per_tensor.PER_TENSOR_ON_STACK`) unless wrapped in
        :func:`~functree.optim.per_member` or :func:`~functree.optim.whole_stack`. No leaf
        shares a buffer with the model or another leaf, so a step may donate both. The state does not depend on the model's mode: one made before
        ``ft.nn.training(model)`` (NNX's order) serves the model in training mode too.
        A model holding LoRA adapters with no ``wrt=`` warns
        (:class:`~functree.nn.LoraBaseWarning`) unless the transform freezes the adapted
        layers' own weights (a ``freeze()`` or ``set_to_zero()`` group): they would train too, which
        ``ft.hf.save_lora`` does not write; ``wrt="*.lora_*"`` trains the adapters alone,
        ``wrt="*"`` everything. One array object at two parameters (one layer at two fields)
        warns (:class:`~functree.AliasWarning`): the first update unties them.
        """
        if (apart := several_devices(model, "ft.optim.Optimizer.init", "model")) is not None:
            raise apart  # (the state went to the first leaf's devices; the step then refused the leaf's moments)
        # LoRA without wrt=: save_lora would lose the base's training (unless a freeze() group holds it)
        check_base_untrained(model, self.wrt, trained=lambda: moved_view(self, model))
        # One array at two parameters: the hand loop's first ft.move unties it, silently (once, here)
        trained = trained_view(model, self.wrt)  # (a tie wrt= or a freeze() group leaves frozen stays one value)
        warn_aliases(parameters(model), what="The model given to ft.optim.Optimizer.init", copied=False,
                     trained=lambda: moved_view(self, model))
        params = floats_as_arrays(mode_free(trained))  # (a Python float field is a parameter: an array here)
        # optax mixes floats and ints; its masks' errors named (a tree of another structure,
        # a Stack's member mask in optax.masked)
        with jax.numpy_dtype_promotion("standard"), named_structure_errors(MASK_IN_TRAINING_MODE), named_member_masks():
            inner = self._transform.init(params)
        check_multisteps(inner, HyperState)
        check_average_placement(inner, self._averaged)
        check_context_reaches(self._raw_transform, inner)
        check_stack_statistics(self._raw_transform, inner, params)  # LAMB, Adafactor ... over a Stack's members
        _check_nested_skip(inner)
        state = OptimizerState(initial_context(), release_contexts(_strongly_typed(inner)))
        # A transform may keep the parameters themselves (an EMA, lookahead): fresh buffers
        # here, where the state is created, so a step can donate both.
        state = copy_aliases((model, state))[1]
        # The context and hyperparameters are put from the host: on the model's devices.
        where = placement_of(model)
        return state if where is None else put(state, where)

    def update(self, grads: Any, state: Any = _NOT_GIVEN, model: Any = None, *, minibatch_size: Any = None,
               loss: Any = None, apply_if: Any = None, finite: Any = None, **extra: Any) -> tuple[Any, Any]:
        """``(updates, state)`` for ``grads`` (the parameter view's structure).

        The one boundary of the optimizer: the parameter view is made and the gradients
        are checked here, once; the transforms trust both. A ``None`` gradient leaves its
        parameter and that parameter's moments unchanged. The learning context advances
        by one step and ``minibatch_size`` samples (kept from the previous step if not
        given; a :func:`~functree.optim.per_samples` rate, which reads it, refuses a step
        without it: :data:`~functree.optim._hyper.PER_SAMPLES_WITHOUT_SIZE`) unless the step is skipped: ``apply_if`` is False, or a
        :func:`skip_non_finite` inside skipped it; a skipped step returns zero updates
        and the state it was given. ``finite`` is the step's finiteness of ``grads`` when
        it was computed already (see :attr:`handles_nonfinite`; unused here).

        ``grads`` are in ``ft.gradient``'s (JAX's) convention: complex leaves are conjugated
        here, once, and complex parameters are trained as pairs of reals, as torch.optim
        does (see :mod:`functree.optim._complex`). Other keyword arguments go to the
        transform (optax's extra arguments): L-BFGS's ``value`` and ``value_fn`` (a function
        of the model, as ``loss_fn``; see :func:`extra_arguments`), with ``grad`` defaulting
        to these gradients and ``grad_fn`` (``optax.contrib.sam(..., opaque_mode=True)``'s)
        to the gradient of ``value_fn``. Called eagerly with a state or gradients committed to
        other devices than the model's, it names them by key path with the ``jax.device_put``
        that fixes it (:data:`~functree._where.INCOMPATIBLE_DEVICES`; as :meth:`minimize` does
        for its batch).
        """
        if not isinstance(state, OptimizerState):
            if state is _NOT_GIVEN or (isinstance(grads, Module) and isinstance(state, Module)):
                given = "(grads)" if state is _NOT_GIVEN else "(model, grads)"  # NNX's orders
                raise TypeError(NNX_UPDATE.format(given=given))
            raise TypeError(NOT_OPTIMIZER_STATE.format(given=type(state).__name__))
        # The state is kept mode-free (Optimizer.init): the training flag, static, is taken
        # out of the trees optax sees and put back into the updates.
        named = [("model", model), ("state", state), ("grads", grads)]  # (an eager call's devices, by key path)
        params = None if model is None else trained_view(model, self.wrt)
        frozen = None if params is None else frozen_members(model, self.wrt)  # members of stacked leaves
        if self.wrt is not None and params is not None:
            grads = drop_frozen(grads, params, frozen)
        given = (jax.tree.structure(grads), None if params is None else jax.tree.structure(params))
        grads, params = mode_free(grads), floats_as_arrays(mode_free(params))
        grads, partial = checked_gradients(grads, params)
        check_state_fits(state.inner, grads, self._transform.init, params)  # at trace time under jit; cached
        partial = with_frozen_members(partial, params, frozen)
        grads = descent_direction(grads)  # complex leaves: JAX's gradient convention -> optax's
        ctx = current(state.context, minibatch_size, loss)
        if extra:
            extra = extra_arguments(extra, grads, model, given[1])
        if loss is not None:  # the step's loss, only when given: context.loss may be stale or NaN
            extra = {**extra, "loss": loss}
        # A per_samples rate reads M: without minibatch_size it would be the context's 1, silently
        unsized = minibatch_size_source(SIZE_NOT_GIVEN) if minibatch_size is None else contextlib.nullcontext()
        with jax.numpy_dtype_promotion("standard"), unsized:  # optax mixes float hyperparameters and int counts
            try:
                updates, inner = self._transform.update(grads, state.inner, params, context=ctx, **extra)
            except TypeError as e:  # a transformation inside a chain refusing context= (optax.contrib.sam)
                if "unexpected keyword argument 'context'" not in str(e):
                    raise
                raise TypeError(EXTRAS_REFUSED.format(error=e)) from e
            except GroupStateChanged as e:  # its recipe's key paths from this state's root
                raise ValueError(e.message(_partition_path(state.inner, e.labels), optimizer=True)) from None
            except ValueError as e:  # eager: a state (or grads) committed to other devices than the model's
                if (unread := model_not_given("ft.optim.Optimizer.update", e, params)) is not None:
                    raise unread from None
                if (apart := devices_error("ft.optim.Optimizer.update", e, named)) is None:
                    raise
                raise apart from None
        check_not_passed_through(grads, updates)  # optax.masked's pass-through as the last step: p + g
        if self._adds_updates():  # optax.masked around the rate, last in a chain: p + direction
            check_rate_applied(self._raw_transform, grads, partial, state=state.inner)  # (its written rates)
        if partial is not None:
            updates, inner = keep_unchanged(partial, updates, inner, state.inner)
        if apply_if is not None:
            updates, inner = guard(apply_if, updates, inner, state.inner)
        applied = _both(apply_if, applied_in(inner))
        new = OptimizerState(advance(state.context, minibatch_size, loss), inner)
        if applied is not None:
            new = new.replace(context=select(applied, new.context, state.context))
        return in_mode(updates, given), new

    # --- RFC 234 hooks -------------------------------------------------------------------
    def transform_loss(self, loss: Any) -> Any:
        """The loss that is differentiated (identity by default)."""
        return loss if self._transform_loss is None else self._transform_loss(loss)

    def get_gradients(self, loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                      state: Any = None, scale: Any = None) -> tuple[Any, Any]:
        """``(loss, grads)`` or ``((loss, aux), grads)``: grads of ``transform_loss(loss_fn(model, *batch))``.

        ``scale`` (a loss scale, :class:`LossScaleOptimizer`'s): the grads of ``scale *
        transform_loss(...)``, the scale applied last, so the transform sees the loss itself
        (the returned loss is never scaled). A ``get_gradients`` hook gets it as ``scale=``
        and returns the gradients of the scaled loss. A hook that takes ``wrt=`` gets the
        trained parameters' patterns (:attr:`wrt`, when set): a per-example clip's norm is
        over those alone, as Opacus' over the parameters that require grad."""
        hook = self._get_gradients
        if hook is not None:
            kw: dict[str, Any] = {}
            if self.wrt is not None and takes_keyword(hook, "wrt"):
                kw["wrt"] = self.wrt
            if scale is not None:
                if not takes_scale(hook):
                    raise TypeError(HOOK_WITHOUT_SCALE.format(hook=getattr(hook, "__qualname__", "hook"),
                                                              scaled_hook=SCALED_HOOK))
                kw["scale"] = scale
            check_hook_call(hook, loss_fn, model, batch, has_aux=has_aux, **kw)
            return hook(loss_fn, model, *batch, has_aux=has_aux, **kw)

        def objective(m: Any) -> tuple[Any, Any]:
            out = loss_fn(m, *batch)
            loss = self.transform_loss(loss_value(out[0] if has_aux else out))  # a WeightedMean: its value
            return (loss if scale is None else _scaled(loss, scale)), out
        objective.__qualname__ = getattr(loss_fn, "__qualname__", "loss_fn")  # wrt='s errors name the user's loss
        setattr(objective, USER_FUNCTION, loss_fn)  # the diagnostics' warnings: its name and line

        (_, out), grads = value_with_gradient(objective, at=model, wrt=self.wrt or 0, has_aux=True)
        return out, grads

    def transform_unaggregated_gradients(self, grads: Any) -> Any:
        """Per-replica gradient transforms, before aggregation."""
        return chain_hooks(self._unaggregated, grads)

    @property
    def axis_name(self) -> Any:
        """The data-parallel axis name (``None``: no data parallelism)."""
        return self._axis_name

    def aggregate_gradients(self, grads: Any) -> Any:
        """The data-parallel all-reduce: the replicas' mean gradient over ``axis_name``
        (weighed by their counts for a :class:`~functree.losses.WeightedMean` loss, also
        when an override reaches it through ``super()``).

        Identity without an ``axis_name``; a ``ValueError`` naming it when that axis is
        not bound where the step runs. Under ``shard_map`` both ``check_vma`` settings
        give the mean (see :func:`functree.optim._replicas.replica_mean`).
        """
        if self._aggregate is not None:
            return self._aggregate(grads)
        if self._axis_name is None:
            return grads
        record = _WEIGHED.get()
        if record is not None:
            return replica_weighted_mean(record, grads, self._axis_name)[1]
        return replica_mean(grads, self._axis_name, reduced="sum")

    def _custom_aggregation(self) -> bool:
        """Whether ``aggregate_gradients=`` was given: a function that cannot reach the
        default (an override can, through ``super()``)."""
        return self._aggregate is not None

    def transform_gradients(self, grads: Any) -> Any:
        """Gradient transforms after aggregation (clipping, ...)."""
        return chain_hooks(self._transform_gradients, grads)

    def apply_updates(self, model: Any, updates: Any) -> Any:
        """``ft.move(model, along=updates)`` by default."""
        if self._apply_updates is not None:
            return self._apply_updates(model, updates)
        return move(model, along=updates)

    def _adds_updates(self) -> bool:
        """Whether the updates are added to the parameters (optax's convention, which
        :func:`~functree.optim._rate.check_rate_applied` reads): no ``apply_updates=`` hook
        or override, which may apply a rate of its own."""
        return self._apply_updates is None and type(self).apply_updates is Optimizer.apply_updates

    # --- orchestration -------------------------------------------------------------------
    def compute_gradients(self, loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                          state: Any = None, key: Any = None, checked: bool | None = None) -> tuple[Any, Any]:
        """``(loss, grads)`` after the gradient hooks (``((loss, aux), grads)`` with ``has_aux``).

        With a ``key`` (a PRNG key), ``loss_fn`` is called as ``loss_fn(model, *batch, key=...)``:
        with :attr:`accumulate` ``= k``, microbatch ``i`` (``0 <= i < k``) gets
        ``jax.random.fold_in(key, i)`` (its own dropout masks, as the rows of one batch get
        theirs); with one microbatch, ``key`` itself.

        ``checked`` (a finiteness check follows: ``on_nan="stop"``/``"skip"``; by default,
        when this optimizer :attr:`handles_nonfinite`): a gradient not finite before a hook
        comes out of it NaN (:func:`~functree.optim._skip.keep_nonfinite`; a clip would make
        an overflowed ``inf`` a plausible 1, where torch's ``unscale_`` checks before it).

        With an ``axis_name`` and the default aggregation (an override's ``super()``
        included), a :class:`~functree.losses.WeightedMean` loss (``reduction="weighted"``)
        weighs each replica's gradient by its count
        (:func:`~functree.optim._replicas.replica_weighted_mean`): the global batch's mean,
        as ``ft.train.train_step(mesh=)`` takes it. On a mesh step's axis, what a custom
        aggregation leaves varying over it is averaged (so weighed) before
        ``transform_gradients`` (:func:`_complete_aggregation`)."""
        if _calls_loss_as_given(self):  # (from gradients: its state objective, which binds anything)
            check_loss_call(loss_fn, model, batch, key)
        def differentiated(model: Any) -> tuple[Any, Any]:
            if self.accumulate > 1:
                return accumulated_gradients(self, loss_fn, model, batch, has_aux, state, key)
            fn = loss_fn if key is None else functools.partial(loss_fn, key=key)
            return self.get_gradients(fn, model, *batch, has_aux=has_aux, state=state)

        out, grads = differentiated(model)
        axis, custom = self.axis_name, self._custom_aggregation()
        weighed = axis is not None and isinstance(out[0] if has_aux else out, WeightedMean)
        if weighed and not custom and not all_varying(grads, axis):
            # shard_map summed the replicated parameters' gradients: once more, each replica's own
            out, grads = differentiated(as_varying(model, axis))
        checked = self.handles_nonfinite if checked is None else checked
        hooked = self.transform_unaggregated_gradients(grads)
        record = (out[0] if has_aux else out) if weighed else None
        token = _WEIGHED.set(record)  # the default aggregation weighs by it (an override's super() too)
        try:
            grads = self.aggregate_gradients(_keep(grads, hooked) if checked else hooked)
        finally:
            _WEIGHED.reset(token)
        if axis is not None and _innermost(self)._step_axis:  # what any aggregation left varying
            grads = _complete_aggregation(grads, record, axis)
        hooked = self.transform_gradients(grads)
        return out, _keep(grads, hooked) if checked else hooked

    def apply_gradients(self, grads: Any, model: Any, state: Any, *, minibatch_size: Any = None,
                        loss: Any = None, apply_if: Any = None, finite: Any = None,
                        **extra: Any) -> tuple[Any, Any]:
        """``(model, state)`` after one optimizer step along ``grads`` (see :meth:`update`).

        ``grads`` are gradients that went through the hooks (:meth:`compute_gradients`'
        output, as ``minimize`` passes them): this runs none. RFC 234's ``apply_gradients``
        aggregates and transforms (its ``compute_gradients`` does not), so a loop porting
        ``opt.apply_gradients(tape.gradient(...))`` with raw gradients passes them through
        the hooks first, or its clipping is lost::

            grads = opt.transform_gradients(opt.aggregate_gradients(jax_grads))
            model, state = opt.apply_gradients(grads, model, state)
        """
        updates, state = self.update(grads, state, model, minibatch_size=minibatch_size, loss=loss,
                                     apply_if=apply_if, finite=finite, **extra)
        return self.apply_updates(model, updates), state

    @property
    def handles_nonfinite(self) -> bool:
        """Whether this optimizer handles non-finite gradients itself (``LossScaleOptimizer``:
        it skips the step and lowers the scale). :meth:`step` then hands it the finiteness
        of the gradients (``update(..., finite=)``) from its one reduction, and such a step
        is never a NaN stop or skip; only a non-finite loss is."""
        return False

    def minimize(self, loss_fn: Callable[..., Any], model: Any, state: Any, *batch: Any, has_aux: bool = False,
                 minibatch_size: Any = None) -> tuple[Any, Any, Any]:
        """One step on ``loss_fn(model, *batch)``: ``(model, state, loss)`` or ``(..., (loss, aux))``.

        Advances the learning context by one step and ``minibatch_size`` samples (the
        batch's leading dimension, times the replicas when ``axis_name`` is bound; read so,
        a :func:`~functree.optim.per_samples` rate refuses a batch whose array leaves
        disagree on it: :data:`~functree.optim._hyper.PER_SAMPLES_LEADING_AXES`) and
        stores the loss in it. With an ``axis_name`` the loss returned (and stored) is the
        mean over the replicas: the global batch's loss. Layer state that the model records in training mode
        (BatchNorm statistics) is collected and written back into the returned model.
        """
        try:
            result = self.step(loss_fn, model, state, batch, has_aux=has_aux, minibatch_size=minibatch_size)
        except ValueError as e:  # eager: state or batch committed to other devices than the model's
            named = [("model", model), ("state", state), ("batch", batch[0] if len(batch) == 1 else batch)]
            if (apart := devices_error("ft.optim.Optimizer.minimize", e, named)) is None:
                raise
            raise apart from None
        out = result.out  # a WeightedMean loss comes back as its value
        return result.model, result.state, ((loss_value(out[0]), *out[1:]) if has_aux else loss_value(out))

    def step(self, loss_fn: Callable[..., Any] = _NOT_GIVEN, model: Any = _NOT_GIVEN, state: Any = _NOT_GIVEN,
             batch: tuple = _NOT_GIVEN, *, has_aux: bool = False,
             minibatch_size: Any = None, on_nan: str = "ignore", enabled: Any = None,
             skip_non_finite: bool = False, replicas: Callable[..., Gradients] | None = None,
             key: Any = None) -> StepResult:
        """The whole step, with what a training loop reports: a :class:`StepResult`.

        Its two halves, each overridable: :meth:`gradients` (the loss and the gradients
        through the hooks) and :meth:`apply_step` (the update through the one gate).
        ``on_nan="skip"``/``"stop"`` (``skip_non_finite=True`` is ``"skip"``) and
        ``enabled=False`` (an array) close the gate: the model (with its layer state) and
        the optimizer state come back unchanged, bit for bit, and ``nonfinite`` reports
        the first parameter whose gradient was not finite (see :func:`gate`).
        ``replicas(half, model, state, batch)`` runs ``half`` (the gradient half) once per
        data-parallel replica and returns their aggregate (``ft.train.TrainStep(mesh=)``
        passes one; the update then runs once, on the placed parameters). With a ``key``,
        ``loss_fn`` takes it as ``loss_fn(model, *batch, key=...)``, one key per microbatch
        (see :meth:`compute_gradients`). Called with none of them (torch's
        ``optimizer.step()``), it raises :data:`TORCH_STEP`.
        """
        missing = [n for n, v in zip(("loss_fn", "model", "state", "batch"), (loss_fn, model, state, batch))
                   if v is _NOT_GIVEN]
        if missing:
            given = f"{4 - len(missing)} of them" if len(missing) < 4 else "none"
            raise TypeError(TORCH_STEP.format(given=f"{given} (missing {', '.join(missing)})"))
        on_nan = check_on_nan(on_nan)
        if skip_non_finite and on_nan == "ignore":
            on_nan = "skip"
        read = minibatch_size is None  # from the first array's leading axis: per_samples rates check the others
        if read:
            minibatch_size = leading_dimension(batch)
            if self.axis_name is not None and replicas is None:
                minibatch_size *= axis_size(self.axis_name)

        checked = on_nan != "ignore" or self.handles_nonfinite  # the gate checks the hooks' input

        def half(m: Any, s: Any, b: tuple) -> Gradients:
            return self.gradients(loss_fn, m, s, b, has_aux=has_aux, key=key, checked=checked)

        g = half(model, state, batch) if replicas is None else replicas(half, model, state, batch)
        whole = _valued(loss_fn if key is None else functools.partial(loss_fn, key=key), has_aux)  # L-BFGS: the whole batch
        with minibatch_size_source(batch) if read else contextlib.nullcontext():
            return self.apply_step(g, model, state, minibatch_size=minibatch_size, on_nan=on_nan, enabled=enabled,
                                   value_fn=loss_value_fn(self, whole, batch, has_aux))

    def gradients(self, loss_fn: Callable[..., Any], model: Any, state: Any, batch: tuple, *,
                  has_aux: bool = False, key: Any = None, checked: bool | None = None) -> Gradients:
        """The first half of :meth:`step`: the loss, the gradients after the hooks
        (:meth:`compute_gradients`, ``key`` and ``checked`` included) and the layer state
        the model recorded, per replica."""
        if _calls_loss_as_given(self):  # the user's loss, before any wrapper
            check_loss_call(loss_fn, model, batch, key)
        if _has_layer_state(model):  # collect what BatchNorm & co. record in training mode
            objective = _state_objective(loss_fn, has_aux)
            (loss, (out, layer_state)), grads = self.compute_gradients(objective, model, *batch, has_aux=True,
                                                                       state=state, key=key, checked=checked)
        else:  # the user's loss function as it is (custom get_gradients hooks see it unchanged)
            out, grads = self.compute_gradients(loss_fn, model, *batch, has_aux=has_aux, state=state, key=key,
                                                checked=checked)
            loss, layer_state = (out[0] if has_aux else out), {}
        # A WeightedMean loss (reduction="weighted"): the step gates and stores its value, and
        # `out` keeps the record (the Trainer's means weigh the step by its count).
        record, loss = loss, loss_value(loss)
        if self.accumulate > 1:  # microbatch outputs come stacked: (k, ...); the last one's state
            # (threaded: microbatch i's BatchNorm update starts from microbatch i - 1's)
            layer_state = jax.tree.map(lambda u: u[-1], layer_state)
            out = (record, out[1]) if has_aux else record
        if self.axis_name is not None:  # the global batch's loss: replicas' states stay identical
            if isinstance(record, WeightedMean):
                record = replica_weighted_mean(record, None, self.axis_name)[0]  # Σ total / Σ count
                loss = record.value
            else:
                record = loss = replica_mean(loss, self.axis_name, reduced="value")
            out = (record, out[1]) if has_aux else record
        return Gradients(loss, out, grads, layer_state)

    def apply_step(self, g: Gradients, model: Any, state: Any, *, minibatch_size: Any, on_nan: str = "ignore",
                   enabled: Any = None, value_fn: Callable[[Any], Any] | None = None) -> StepResult:
        """The second half of :meth:`step`: :func:`gate` (one finiteness reduction), the update
        through it, the recorded layer state written back; a closed gate returns ``model``
        and ``state`` as they were, bit for bit (one ``lax.cond``, or one per parameter: see
        :mod:`functree.optim._leafwise`). ``value_fn`` (the loss as a function of
        the model) goes to the transform with ``value=g.loss`` (optax's L-BFGS takes both)."""
        door = gate(g.loss, g.grads, on_nan=on_nan, enabled=enabled, handled=self.handles_nonfinite)
        extra = {} if value_fn is None else {"value": g.loss, "value_fn": value_fn}

        def applied(model: Any, state: Any) -> tuple[Any, Any]:
            new_model, new_state = self.apply_gradients(g.grads, model, state, minibatch_size=minibatch_size,
                                                        loss=g.loss, finite=door.finite, **extra)
            if g.layer_state:
                new_model = apply_state(new_model, _like(g.layer_state, model))
            return new_model, new_state

        if door.apply is None:
            new_model, new_state = applied(model, state)
        elif not isinstance(door.apply, Tracer):  # eager: the gate is known, take its branch
            # (a lax.cond here, its branches fresh closures over this step's arrays, compiled
            # one program per parameter again at every eager step)
            new_model, new_state = applied(model, state) if bool(door.apply) else (model, state)
        else:  # one cond around the whole update (or one per parameter): buffers written in place
            leafwise = self._leafwise(g, model, state, door.apply, minibatch_size)
            new_model, new_state = leafwise or apply_or_keep(door.apply, applied, model, state)
        return StepResult(new_model, new_state, g.out, g.grads, door.nonfinite)

    def _leafwise(self, g: Gradients, model: Any, state: Any, ok: Any, minibatch_size: Any) -> tuple[Any, Any] | None:
        """The gated update one parameter at a time (:mod:`functree.optim._leafwise`), or None
        where that is not the same step: a transform not declared separable, ``average=``,
        ``wrt=``, recorded layer state, partial gradients, or a hook that changes the update."""
        cls = type(self)
        if (not getattr(self, "_separable", False) or g.layer_state or self.wrt is not None
                or self._apply_updates is not None or cls.update is not Optimizer.update
                or cls.apply_gradients is not Optimizer.apply_gradients
                or cls.apply_updates is not Optimizer.apply_updates):
            return None
        params = trained_view(model, None)
        grads, partial = checked_gradients(g.grads, params)  # the boundary's checks and errors
        if partial is not None:
            return None
        check_rate_applied(self._raw_transform, grads, None, state=state.inner)  # as update's (ft.optim's rate functions)
        # The state is kept mode-free (mode_free): so are the trees the transform sees.
        free = mode_free(descent_direction(grads))
        free_params = floats_as_arrays(mode_free(params))
        check_state_fits(state.inner, free, self.transform.init, free_params)  # at trace time: in the compiled step
        out = leafwise_gated_update(self.transform, ok, free, model, state,
                                    free_params, minibatch_size=minibatch_size, loss=g.loss)
        if out is None:
            return None
        new_params = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(out[0]))  # the model's mode
        return with_parameters(model, new_params), out[1]


# One state-collecting objective per loss function and has_aux: the same function at every
# eager step, so what is compiled for it (an accumulated step's scan) is found again.
_OBJECTIVES: dict[Any, Callable[..., Any]] = {}


def _state_objective(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``loss_fn`` run under ``collect_state``: ``(loss, (out, layer_state))``."""
    signature, found = cached(_OBJECTIVES, (loss_fn, has_aux))
    if found is not None:
        return found

    def objective(m: Any, *b: Any, **kw: Any) -> tuple[Any, Any]:
        out, layer_state = collect_state(lambda mm: loss_fn(mm, *b, **kw), m)
        return (out[0], (out, layer_state)) if has_aux else (out, (out, layer_state))
    objective.__qualname__ = getattr(loss_fn, "__qualname__", "loss_fn")  # (as get_gradients')
    setattr(objective, USER_FUNCTION, loss_fn)
    objective.__ft_records_state__ = True  # type: ignore[attr-defined]  # accumulation threads it
    if signature is not None:
        bounded_put(_OBJECTIVES, signature, objective)
    return objective


def _is_skip(x: Any) -> bool:
    return isinstance(x, SkipState)


def _check_nested_skip(inner: Any) -> None:
    """:data:`NESTED_SKIP` for a :func:`ft.optim.skip_non_finite` whose state lies inside a
    parameter group's (``ft.optim.groups``), lookahead's fast optimizer's or an
    ``optax.masked`` transform's (``ft.optim.masked``'s): it would skip part of a step that
    the one learning context counts as not taken. Inside a chain, an
    ``Optimizer(average=)`` or at the top it skips the whole step (the average and the
    chained EMA keep theirs)."""
    def stop(x: Any) -> bool:
        return _is_skip(x) or isinstance(x, optax.MaskedState)

    def refuse(case: str, path: tuple[Any, ...]) -> None:
        inside, what, consequence, wrong, right = NESTED_SKIP_CASES[case]
        raise ValueError(NESTED_SKIP.format(
            inside=inside, path="inner" + jax.tree_util.keystr(path), what=what,
            consequence=consequence, wrong=wrong, right=right))

    def visit(tree: Any, prefix: tuple[Any, ...]) -> None:
        for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop)[0]:
            path = prefix + tuple(path)
            names = [getattr(k, "name", None) for k in path]
            if isinstance(node, optax.MaskedState):
                inside = jax.tree_util.tree_flatten_with_path(node.inner_state, is_leaf=_is_skip)[0]
                skips = [p for p, x in inside if _is_skip(x)]
                if skips and "inner_states" not in names:  # (a group's own mask: the groups case)
                    refuse("masked", path + (jax.tree_util.GetAttrKey("inner_state"), *skips[0]))
                visit(node.inner_state, path + (jax.tree_util.GetAttrKey("inner_state"),))
            elif _is_skip(node):
                for case in ("inner_states", "fast_state"):
                    if case in names:
                        refuse(case, path)

    visit(inner, ())


def _partition_path(inner: Any, labels: frozenset[str]) -> str:
    """The dotted name, from an OptimizerState's root, of the ``ft.optim.groups`` state in
    ``inner`` whose groups are ``labels`` (``inner`` when none is found)."""
    def groups_state(x: Any) -> bool:
        return isinstance(x, optax.PartitionState) and frozenset(x.inner_states) == labels

    for path, x in jax.tree_util.tree_flatten_with_path(inner, is_leaf=groups_state)[0]:
        if groups_state(x):
            return dotted_name(("inner", *path)) if path else "inner"
    return "inner"


def _valued(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``loss_fn`` with a :class:`~functree.losses.WeightedMean` loss replaced by its value
    (what a line search evaluates); the loss function's output otherwise as it is."""
    def valued(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        return (loss_value(out[0]), *out[1:]) if has_aux else loss_value(out)
    return valued


def _scaled(loss: Any, scale: Any) -> Any:
    """``loss * scale`` in float32 at least: in float16 it is ``inf`` from a scale of 65536
    (a float16 loss's cotangent still is float16: such a loss caps the scale at 32768)."""
    dtype = jnp.result_type(loss)
    wide = dtype if jnp.finfo(dtype).bits >= 32 else jnp.float32
    return jnp.asarray(loss).astype(wide) * jnp.asarray(scale).astype(wide)


def _stateful(x: Any) -> bool:
    return isinstance(x, Module) and bool(type(x).__ft_no_derivative__)


def _has_layer_state(model: Any) -> bool:
    """Whether ``model`` holds a layer with ``no_derivative`` fields (state it may record)."""
    return any(_stateful(x) for x in jax.tree.leaves(model, is_leaf=_stateful))


def _like(layer_state: dict[Any, Any], model: Any) -> dict[Any, Any]:
    """Recorded layer state in the dtypes of the fields it replaces (a compute dtype's
    statistics go back to the float32 fields)."""
    out = {}
    for path, value in layer_state.items():
        old = path.get(model) if hasattr(path, "get") else None
        dtype = getattr(old, "dtype", None)
        out[path] = value if dtype is None or value.dtype == dtype else value.astype(dtype)
    return out


def _both(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else a & b


class OptimizerWrapper(Optimizer):
    """An Optimizer that delegates every hook to ``inner``; subclasses override some.

    Wrappers compose: ``LossScaleOptimizer(OptimizerWrapper(Optimizer(adam())))``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Halve(ft.optim.OptimizerWrapper):
      ...     def transform_gradients(self, grads):
      ...         return ft.tree_map(lambda g: g / 2, super().transform_gradients(grads))
      >>> opt = Halve(ft.optim.Optimizer(ft.optim.sgd(1.0)))
      >>> w, state = {"w": jnp.zeros(())}, None
      >>> state = opt.init(w)
      >>> w, state, loss = opt.minimize(lambda w: w["w"] * 4.0, w, state)
      >>> w["w"]
      Array(-2., dtype=float32)
    """

    inner: Optimizer

    def __init__(self, inner: Any):
        if not isinstance(inner, Optimizer):  # an optax transformation: as Trainer and train_step take it
            inner = Optimizer(inner)
        object.__setattr__(self, "inner", inner)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def transform(self) -> optax.GradientTransformationExtraArgs:
        return self.inner.transform

    @property
    def accumulate(self) -> int:
        return self.inner.accumulate

    @property
    def wrt(self) -> tuple[str, ...] | None:
        return self.inner.wrt

    @property
    def axis_name(self) -> Any:
        return self.inner.axis_name

    def init(self, model: Any) -> Any:
        return self.inner.init(model)

    def update(self, grads: Any, state: Any = _NOT_GIVEN, model: Any = None, *, minibatch_size: Any = None,
               loss: Any = None, apply_if: Any = None, finite: Any = None, **extra: Any) -> tuple[Any, Any]:
        return self.inner.update(grads, state, model, minibatch_size=minibatch_size, loss=loss,
                                 apply_if=apply_if, finite=finite, **extra)

    @property
    def handles_nonfinite(self) -> bool:
        return self.inner.handles_nonfinite

    def transform_loss(self, loss: Any) -> Any:
        return self.inner.transform_loss(loss)

    def get_gradients(self, loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                      state: Any = None, scale: Any = None) -> tuple[Any, Any]:
        # The inner get_gradients differentiates inner.transform_loss; route ours through it
        # (the scale, applied innermost, comes after every transform).
        if type(self).transform_loss is OptimizerWrapper.transform_loss:
            return self.inner.get_gradients(loss_fn, model, *batch, has_aux=has_aux, state=state, scale=scale)

        def objective(m: Any, *b: Any) -> tuple[Any, Any]:
            out = loss_fn(m, *b)
            return self.transform_loss(out[0] if has_aux else out), out

        (_, out), grads = self.inner.get_gradients(objective, model, *batch, has_aux=True, state=state, scale=scale)
        return out, grads

    def transform_unaggregated_gradients(self, grads: Any) -> Any:
        return self.inner.transform_unaggregated_gradients(grads)

    def aggregate_gradients(self, grads: Any) -> Any:
        return self.inner.aggregate_gradients(grads)

    def _custom_aggregation(self) -> bool:
        return self.inner._custom_aggregation()

    def transform_gradients(self, grads: Any) -> Any:
        return self.inner.transform_gradients(grads)

    def apply_updates(self, model: Any, updates: Any) -> Any:
        return self.inner.apply_updates(model, updates)


WRT_CONFLICT = """\
The optimizer already trains wrt={old!r}; cannot also restrict it to wrt={new!r}. \
Give the patterns in one place:

    wrong:  ft.train.Trainer(model, ft.optim.Optimizer(tx, wrt="a.*"), loss_fn, wrt="b.*")
    right:  ft.train.Trainer(model, ft.optim.Optimizer(tx), loss_fn, wrt="b.*")
"""


def with_wrt(optimizer: Any, wrt: Any) -> Any:
    """``optimizer`` training only the parameters ``wrt`` selects (``ft.train.Trainer(wrt=)``).

    A plain optax transformation becomes ``Optimizer(transform, wrt=wrt)``; an Optimizer
    (or a wrapper around one) is copied with the patterns set on the innermost Optimizer.
    """
    patterns = check_wrt(wrt)
    if patterns is None:
        return optimizer
    if not isinstance(optimizer, Optimizer):
        return Optimizer(optimizer, wrt=patterns)
    old = optimizer.wrt  # (a wrapper's is its inner's)
    if old is not None and old != patterns:
        raise ValueError(WRT_CONFLICT.format(old=old, new=patterns))
    return _innermost_set(optimizer, _wrt=patterns)


def with_axis_name(optimizer: Any, axis: str) -> Any:
    """``optimizer`` with its data-parallel ``axis_name`` bound to ``axis``, for the gradient
    half a mesh step runs per device (``ft.train.TrainStep(mesh=)``). Its default
    aggregation (the mean, or the count-weighted mean of a ``WeightedMean`` loss) then runs
    between ``transform_unaggregated_gradients`` and ``transform_gradients``, as on one
    device: a global-norm clip in ``transform_gradients`` sees the whole batch's gradient,
    not each device's (which clipped each device's gradient by its own norm before the
    mean: parameters 4.6e-2 of their largest value from one device's after 3 SGD steps on
    8 devices). An override of ``aggregate_gradients`` reaches that default through
    ``super()``; what a custom aggregation (an override, or ``aggregate_gradients=``)
    leaves varying over the axis is averaged before ``transform_gradients`` too
    (:func:`_complete_aggregation`). An optimizer that names an axis of its own is kept.

    Example:
      >>> import functree as ft
      >>> opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1)))
      >>> with_axis_name(opt, "data").axis_name, opt.axis_name
      ('data', None)
    """
    if optimizer.axis_name is not None:
        return optimizer
    return _innermost_set(optimizer, _axis_name=axis, _step_axis=True)


def moved_view(optimizer: Any, model: Any) -> Any:
    """What a step of ``optimizer`` moves of ``model``: its trained view (``wrt=``) with
    ``None`` also at the parameters its transform declares it never updates (a group of
    ``ft.optim.groups`` mapped to ``ft.optim.freeze()``, ``ft.optim.freeze``, ``masked``
    around one: :func:`frozen_leaves`, by key path). For :class:`~functree.AliasWarning`: a
    tie frozen so stays one value. An optimizer whose hooks or subclass may move a
    parameter otherwise is read by its ``wrt=`` alone."""
    view = trained_view(model, getattr(optimizer, "wrt", None))
    cls = type(optimizer)
    if (not isinstance(optimizer, Optimizer) or cls.update is not Optimizer.update
            or cls.apply_gradients is not Optimizer.apply_gradients
            or cls.apply_updates is not Optimizer.apply_updates or optimizer._apply_updates is not None):
        return view
    leaves, treedef = jax.tree.flatten(view, is_leaf=is_none)
    try:
        frozen = frozen_leaves(optimizer._raw_transform, mode_free(view))
    except (ValueError, TypeError):  # the transform's own refusal (a pattern naming nothing): its init raises it
        return view
    return treedef.unflatten([None if f else x for x, f in zip(leaves, frozen)])


def _calls_loss_as_given(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` calls ``loss_fn(model, *batch)`` with the batch it is given, so
    that a loss which cannot take it is refused first: functree's own ``get_gradients`` and
    ``compute_gradients`` at every level, and no get_gradients hook but one marked
    :data:`~functree.optim._hooks.CALLS_LOSS_AS_GIVEN`. A user's override or hook may call
    the loss its own way (a dict batch unpacked), which no signature check may refuse."""
    for _ in range(16):
        if not all(getattr(type(optimizer), m).__module__.startswith("functree.")
                   for m in ("get_gradients", "compute_gradients")):
            return False
        if not isinstance(optimizer, OptimizerWrapper):
            hook = optimizer._get_gradients
            return hook is None or getattr(hook, CALLS_LOSS_AS_GIVEN, False)
        optimizer = optimizer.inner
    return False


def _innermost(optimizer: Optimizer) -> Optimizer:
    while isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.inner
    return optimizer


# The WeightedMean record whose replicas the default aggregation weighs (set by
# compute_gradients around the aggregate_gradients call, read by the default body, which an
# override may reach through super(); None: a plain mean).
_WEIGHED: contextvars.ContextVar[Any] = contextvars.ContextVar("functree_weighed_record", default=None)


def _complete_aggregation(grads: Any, record: Any, axis: Any) -> Any:
    """The aggregated gradients with what the aggregation left varying over ``axis``
    averaged (weighed by ``record``'s counts when it is a WeightedMean): a custom
    aggregation's, as after the default (whose gradients arrive reduced: nothing to do).
    ``transform_gradients`` then sees the replicas' aggregate. A leaf the aggregation
    reduced (a ``psum``, a ``pmean``) is kept as it is. Only on a mesh step's axis
    (:func:`with_axis_name`): there every parameter is whole on each device, so a
    gradient still varying is a device's own, which the step would average after the hook.
    Under a user's own ``shard_map`` a varying gradient may be a shard (a ``psum_scatter``
    of FSDP's), and where JAX does not track varying values (``vmap``, ``pmap``) nothing
    tells: there the aggregation is trusted."""
    if not tracks_varying(axis):
        return grads
    varying = jax.tree.map(lambda g: g if isinstance(g, jax.Array) and axis in varying_axes(g) else None, grads)
    if not jax.tree.leaves(varying):
        return grads
    meaned = (replica_weighted_mean(record, varying, axis)[1] if record is not None
              else replica_mean(varying, axis, reduced="value"))
    return jax.tree.map(lambda g, m: g if m is None else m, grads, meaned, is_leaf=lambda x: x is None)


def _innermost_set(optimizer: Optimizer, **values: Any) -> Optimizer:
    """A copy of ``optimizer`` whose innermost Optimizer has the attributes ``values`` (each
    wrapper copied, its own hooks kept)."""
    new = copy.copy(optimizer)
    if isinstance(optimizer, OptimizerWrapper):
        object.__setattr__(new, "inner", _innermost_set(optimizer.inner, **values))
    else:
        for name, value in values.items():
            object.__setattr__(new, name, value)
    return new
