"""Hyperparameters as arrays in the optimizer state, driven by the learning context.

One mechanism serves every functree optimizer (like ``optax.inject_hyperparams``, but the
names are declared, so a callable mask is never mistaken for a schedule, and schedules
read the :class:`~functree.optim.LearningContext` instead of a private count).

A hyperparameter is one of

* a number: stored in the state; :func:`set_hyperparameters` changes it between steps
  without recompiling a jitted step;
* a schedule: any callable of the learning context (``ft.optim.piecewise``,
  ``ft.optim.cosine_decay`` ...), evaluated every step;
* a rate with a unit: ``ft.optim.per_minibatch(v)`` (the same as ``v``) or
  ``ft.optim.per_samples(v, n)``: losses are means over the minibatch, so a rate meant
  for ``n`` samples becomes ``v · M / n`` on a minibatch of ``M`` (CNTK's
  ``RateOnMinibatch``). ``v`` may itself be a number (settable) or a schedule.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._alias import check_stale, warn_aliases
from functree._host_buffers import private
from functree._parameters import parameters
from functree._tree import is_none, register_record
from functree._warnings import warn
from functree._where import following, placement_of, put
from functree.nn._mode import in_mode, mode_free
from functree.optim._checks import check_redefined, checked_gradients, keep_unchanged
from functree.optim._context import LearningContext, advance, current, initial_context
from functree.optim._schedules import piecewise, values_of

__all__ = [
    "HyperState",
    "NEEDS_MODEL",
    "model_not_given",
    "Rate",
    "per_minibatch",
    "per_samples",
    "inject",
    "hyperparameters",
    "set_hyperparameters",
    "hyperparameter_names",
]

OUT_OF_RANGE = """\
{where}: {name}={value!r} is out of range; {name} must be finite and {rule}.

    right:  {where}({name}={example})
"""

SCHEDULE_OUT_OF_RANGE = """\
{where}: {name} follows a schedule that takes the value {value!r}, out of range; {name} \
must be finite and {rule} at every step (the schedule's values are used as they are).

    wrong:  {where}({name}={wrong})
    right:  {where}({name}={right})
"""

BAD_HYPERPARAMETER = """\
{where}: {name} is {given}, no hyperparameter value: {name} takes one number, a schedule (a \
function of the learning context: ft.optim.cosine_decay(...), ft.optim.schedule(...)), a \
piecewise list of (count, value) pairs, or a rate with a unit (ft.optim.per_samples(...)).{hint}

    wrong:  {where}({others}{name}={code})
    right:  {where}({others}{name}={example})
{more}"""

# A list of numbers is most often meant as one rate per group of parameters.
PER_GROUP_HINT = " One value per group of parameters is one optimizer per group:"
PER_GROUP_FIX = """\
       or:  ft.optim.groups({{"head.*": {where}({others}{name}={first})}}, default={where}({others}{name}={second}))
"""

NEEDS_CONTEXT = """\
{where}: this state belongs to an ft.optim.Optimizer (which owns the learning context), \
so update it through the optimizer:

    wrong:  updates, state.inner = tx.update(grads, state.inner, model)
    right:  updates, state = opt.update(grads, state, model)     # opt = ft.optim.Optimizer(tx)
"""

NOT_A_SCHEDULE = """\
The schedule given for {name} failed when called with the learning context: {error}
functree schedules take a ft.optim.LearningContext, not a step count. Wrap an optax schedule:

    wrong:  ft.optim.adam(optax.cosine_decay_schedule(1e-3, 1000))
    right:  ft.optim.adam(ft.optim.schedule(optax.cosine_decay_schedule(1e-3, 1000), unit="steps"))
"""

UNKNOWN_HYPERPARAMETER = """\
set_hyperparameters: this state has no hyperparameter {name!r}. It has: {known}.
"""

OFF_AT_ZERO = ("weight_decay",)
"""Hyperparameters an ``ft.optim`` optimizer leaves out when given the number 0: no term is
built (no decay computed, no parameters read), so its state stores no such value."""

DROPPED: dict[str, tuple[str, str, str]] = {
    "weight_decay": ("no decay is computed", "ft.optim.adamw(1e-3, ", "1e-4"),
    "dampening": ("torch's momentum buffer without dampening", "ft.optim.sgd(0.1, momentum=0.9, ", "0.1"),
}
"""Every name an ``ft.optim`` optimizer leaves out at 0 (:data:`OFF_AT_ZERO`, ``sgd``'s
``dampening``): what is left out, the call that builds one, and a nonzero value
(:data:`DROPPED_AT_ZERO`)."""

DROPPED_AT_ZERO = """\
set_hyperparameters: this state has no hyperparameter {key!r}. It has: {known}. An ft.optim \
optimizer given {name}=0 (the number) is built without that term ({what}), so \
its state holds no {name} to set. Build it with the value stored, or give the values to come \
as a schedule:

    wrong:  tx = {call}{name}=0.0); state = tx.init(model)
            state = ft.optim.set_hyperparameters(state, {name}={example})
    right:  tx = {call}{name}={example})               # nonzero: stored, settable
       or:  tx = {call}{name}=jnp.asarray(0.0))   # a zero array: stored, settable
       or:  tx = {call}{name}=ft.optim.piecewise([(1000, 0.0), (1, {example})]))  # {example} from step 1000
"""

SCHEDULED_HYPERPARAMETER = """\
set_hyperparameters: {name!r} follows a schedule, which would overwrite the value at the \
next step. Give a number when building the optimizer to make it settable:

    wrong:  ft.optim.adam(ft.optim.cosine_decay(1e-3, 1000)); set_hyperparameters(state, {name}=...)
    right:  ft.optim.adam(1e-3);                            set_hyperparameters(state, {name}=...)
"""

PARTIAL_WITHOUT_MODEL = """\
{where}: the gradient has None leaves and no model was given, so the optimizer cannot \
tell parameters without a gradient (no update) from non-parameters ({error}). Pass the model:

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)
"""

NEEDS_MODEL = """\
{where}: its update reads the parameters' values (AdamW's weight decay, a trust ratio ...), \
but no model was given ({error}). Pass the model as the third argument:

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)
"""

# optax's words for a transformation given params=None that reads them (optax.add_decayed_weights)
_OPTAX_NEEDS_PARAMS = "requires the current value of parameters"


def model_not_given(where: str, error: ValueError, params: Any) -> ValueError | None:
    """NEEDS_MODEL in place of optax's error when ``params`` is None and a transformation read
    them: optax names its ``params`` argument, not the model functree's update takes."""
    if params is not None or _OPTAX_NEEDS_PARAMS not in str(error):
        return None
    return ValueError(NEEDS_MODEL.format(where=where, error=error))


BAD_HYPERPARAMETER_SHAPE = """\
set_hyperparameters: {name!r} takes a scalar, or one value per member of a stacked state \
(shape {members}); given shape {shape}.

    right:  set_hyperparameters(states, {name}=jnp.array([...]))    # shape {members}
"""

BAD_HYPERPARAMETER_UNSTACKED = """\
set_hyperparameters: {name!r} takes a scalar (this state is not stacked: one optimizer); \
given shape {shape}.

    wrong:  ft.optim.set_hyperparameters(state, {name}=jnp.ones({shape}))
    right:  ft.optim.set_hyperparameters(state, {name}={example})
"""

STACKED_ALONG_ANOTHER_AXIS = """\
These hyperparameters are packed in an array of shape {shape}: {n} values {names} along the \
last axis, so stacked optimizer states must put their member axes first:

    wrong:  states = jax.tree.map(lambda *x: jnp.stack(x, axis=-1), *member_states)
    right:  states = jax.tree.map(lambda *x: jnp.stack(x), *member_states)   # or jax.vmap(opt.init)
"""

OTHER_HYPERPARAMETERS = """\
{where}: this state was made by an optimizer with other hyperparameters: it stores \
{state_names} and schedules {state_scheduled}; this {where} stores {names} and schedules \
{scheduled}. Its packed values would be read under the wrong names (a silently wrong step). \
A state continues the optimizer that made it: change that optimizer's numbers with \
set_hyperparameters, or make a new state for the new optimizer (moments start from zero):

    wrong:  opt = ft.optim.Optimizer({where}(ft.optim.cosine_decay(1e-2, 1000)))
            model, state, loss = opt.minimize(loss_fn, model, old_state, x, y)   # old_state: {where}(1e-2)'s
    right:  old_state = ft.optim.set_hyperparameters(old_state, learning_rate=1e-3)   # the same optimizer
       or:  state = opt.init(model)                                              # the new optimizer's
"""

MISSING_HYPERPARAMETER = """\
{where}: no value for the hyperparameter {name!r}: the state does not store it (it was made by \
an optimizer that scheduled it or had no {name!r}). Make a state for this optimizer:

    right:  state = opt.init(model)
"""

# name -> (predicate on a float, human rule, example value)
DECAY_RATES = frozenset({"momentum", "beta1", "beta2", "rho"})
"""Hyperparameters that are decay rates: given :func:`per_samples`, a minibatch of M takes
``γ^(M / samples)`` (CNTK's per-sample momentum: the same decay per example whatever the
minibatch size), where a learning rate takes ``η · M / samples``."""

RATE_UNITS = frozenset({"learning_rate"}) | DECAY_RATES
"""The hyperparameters a :func:`per_samples` rate may be given for."""

RATE_NOT_A_LEARNING_RATE = """\
{where}: {name}={spec!r}: a per-sample rate is for a learning rate (η · M / samples) or a
decay rate (momentum, beta1, beta2, rho: γ^(M / samples)); {name} is neither. Give it as a
number, or as a function of the learning context:
    right:  {where}(..., {name}=lambda ctx: ...)     # ctx.minibatch_size, ctx.step, ..."""

RULES: dict[str, tuple[Callable[[float], bool], str, str]] = {
    "learning_rate": (lambda v: v >= 0, ">= 0", "1e-3"),
    "momentum": (lambda v: 0 <= v <= 1, "in [0, 1]", "0.9"),
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)", "0.9"),
    "beta2": (lambda v: 0 <= v < 1, "in [0, 1)", "0.999"),
    "rho": (lambda v: 0 <= v <= 1, "in [0, 1]", "0.9"),
    "epsilon": (lambda v: v >= 0, ">= 0", "1e-8"),
    "weight_decay": (lambda v: v >= 0, ">= 0", "1e-4"),
    "initial_accumulator_value": (lambda v: v >= 0, ">= 0", "0.1"),
    "threshold": (lambda v: v > 0, "> 0", "1.0"),
    "weight": (lambda v: v >= 0, ">= 0", "1e-4"),
    "std": (lambda v: v >= 0, ">= 0", "0.01"),
    "eta": (lambda v: v >= 0, ">= 0", "0.01"),
    # torch's SGD (dampening), NAdam (momentum_decay) and ASGD (lambd, alpha, t0)
    "dampening": (lambda v: 0 <= v <= 1, "in [0, 1]", "0.1"),
    "momentum_decay": (lambda v: v >= 0, ">= 0", "4e-3"),
    "lambd": (lambda v: v >= 0, ">= 0", "1e-4"),
    "alpha": (lambda v: v >= 0, ">= 0", "0.75"),
    "t0": (lambda v: v >= 0, ">= 0", "1e6"),
}


@dataclasses.dataclass(frozen=True)
class Rate:
    """A rate meant for ``samples`` examples (``None``: per minibatch), CNTK's RateOnMinibatch.

    Made by :func:`per_samples` and :func:`per_minibatch`; optimizers take one wherever they
    take a learning rate.

    Example:
      >>> import functree as ft
      >>> ft.optim.per_samples(0.01, 1)
      Rate(value=0.01, samples=1)
    """

    value: Any
    samples: int | None = None

    def scale(self, ctx: LearningContext, dtype: Any = jnp.float32) -> Any:
        """``M / samples`` for the context's minibatch of ``M`` (1 per minibatch)."""
        if self.samples is None:
            return 1.0
        return ctx.minibatch_size.astype(dtype) / jnp.asarray(self.samples, dtype)


PER_SAMPLES_WITHOUT_SIZE = """\
{where}: {name}={rate} is a rate per {samples} sample(s): a minibatch of M takes {rule}. \
This update was given no minibatch_size, so M would be the size the learning context kept \
(1 before any was given), silently: per_samples(0.01, 1) on a minibatch of 32 stepped \
0.01, not 0.32. Give the minibatch's size:

    wrong:  updates, state = opt.update(grads, state, model)
    right:  updates, state = opt.update(grads, state, model, minibatch_size=x.shape[0])
       or:  model, state, loss = opt.minimize(loss_fn, model, state, x, y)   # M: the batch's leading axis
"""

PER_SAMPLES_LEADING_AXES = """\
{where}: {name}={rate} is a rate per {samples} sample(s): a minibatch of M takes {rule}. \
M is read from the batch's leading axis, and its array leaves disagree: {first} has {rows} \
rows, {other} has {given}. M = {rows} would be used, silently (a time-major x of shape \
(T, B) counts T examples). Give the minibatch's size, or put the example axis first:

    wrong:  opt.minimize(loss_fn, model, state, x, y)                       # x: (T, B), y: (B,)
    right:  opt.minimize(loss_fn, model, state, x, y, minibatch_size=y.shape[0])
       or:  opt.minimize(loss_fn, model, state, x.swapaxes(0, 1), y)      # x: (B, T)
"""

SIZE_NOT_GIVEN = "not given"
"""The :data:`_SIZE_SOURCE` of an update given no ``minibatch_size``."""

_SIZE_SOURCE: contextvars.ContextVar[Any] = contextvars.ContextVar("ft_minibatch_size_source", default=None)
"""Where the running update's minibatch size came from, for a per-sample rate to check at
trace time: ``None`` (given, or no Optimizer step runs: nothing to check),
:data:`SIZE_NOT_GIVEN`, or the batch (tuple of ``minimize``'s arguments) whose first
array's leading axis it is. Only a rate per samples reads M, so only one checks."""


@contextlib.contextmanager
def minibatch_size_source(source: Any) -> Iterator[None]:
    """Set :data:`_SIZE_SOURCE` while an Optimizer's update (or step) runs."""
    token = _SIZE_SOURCE.set(source)
    try:
        yield
    finally:
        _SIZE_SOURCE.reset(token)


def _check_size_source(where: str, name: str, rate: Rate) -> None:
    """Refuse a per-sample rate whose minibatch size M was not given (the context's 1, or a
    stale size), or was read from the first of a batch's leaves that disagree on it."""
    source = _SIZE_SOURCE.get()
    if source is None:
        return
    rule = "γ^(M / samples)" if name in DECAY_RATES else "η · M / samples"
    shown = {"where": where, "name": name, "rate": f"ft.optim.per_samples({rate.value!r}, {rate.samples})",
             "samples": rate.samples, "rule": rule}
    if isinstance(source, str):
        raise ValueError(PER_SAMPLES_WITHOUT_SIZE.format(**shown))
    rows = [(f"batch{jax.tree_util.keystr(path)}", np.shape(x)[0])
            for path, x in jax.tree_util.tree_flatten_with_path(source)[0] if np.ndim(x) >= 1]
    other = next(((where_, n) for where_, n in rows if n != rows[0][1]), None)
    if other is not None:
        raise ValueError(PER_SAMPLES_LEADING_AXES.format(**shown, first=rows[0][0], rows=rows[0][1],
                                                         other=other[0], given=other[1]))


def per_minibatch(value: Any) -> Rate:
    """A rate applied to each minibatch's mean gradient as it is (the default for numbers).

    Example:
      >>> import functree as ft
      >>> tx = ft.optim.sgd(ft.optim.per_minibatch(0.1))
    """
    return Rate(value, None)


def per_samples(value: Any, samples: int) -> Rate:
    """A rate meant for ``samples`` examples: ``η_eff = value · M / samples`` for a minibatch of M.

    Losses are means, so ``per_samples(v, 1)`` is CNTK's per-sample rate: the summed
    gradient times ``v``. Given for a decay rate (``momentum``, ``beta1``, ``beta2``,
    ``rho``), a minibatch of M takes ``value^(M / samples)``: the decay per example is the
    same whatever the minibatch size (CNTK's per-sample momentum). Other hyperparameters
    refuse it. Through an :class:`ft.optim.Optimizer`, ``update``/``apply_gradients`` need
    ``minibatch_size=`` (without it M would be 1, silently: an error), and ``minimize``
    refuses a batch whose array leaves disagree on the leading axis it reads M from.
    ``ft.optim.hyperparameters`` (and the Trainer's ``learning_rate`` column)
    report the value given, ``v``, for a number; a schedule's is reported as applied.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.sgd(ft.optim.per_samples(0.01, 1))
      >>> state = tx.init({"w": jnp.zeros(())})
      >>> updates, state = tx.update({"w": jnp.ones(())}, state, minibatch_size=32)
      >>> updates["w"]   # -0.01 * 32 / 1
      Array(-0.32, dtype=float32)
    """
    if not isinstance(samples, int) or isinstance(samples, bool) or samples <= 0:
        raise ValueError(f"per_samples(value, samples): samples must be a positive int, got {samples!r}.")
    return Rate(value, samples)


@dataclasses.dataclass(frozen=True)
class HyperState:
    """State of a functree optimizer: the context, hyperparameters and the optax state.

    Attributes:
      context: the transform's own :class:`LearningContext` when it is used as a plain
        optax transformation; ``None`` inside an :class:`ft.optim.Optimizer`, whose
        :class:`OptimizerState` holds the one context and passes it to ``update``.
      values: settable hyperparameters (numbers, and the ``v`` of ``per_samples(v, n)``),
        packed along the last axis of one float32 array in the order of ``names``
        (``None`` if there are none); a stacked state adds leading member axes.
      scheduled: values that scheduled hyperparameters took at the latest step (read
        only), in the order of ``scheduled_names`` (``None`` if there are none).
      inner: the state of the optax transformation doing the numerics; per-parameter
        moments in it have the model's parameter-view structure.
      names, scheduled_names: static (part of the tree definition).

    Read them by name with :func:`hyperparameters`; packing keeps a jitted step's
    dispatch cost independent of how many hyperparameters there are.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.adam(0.1).init({"w": jnp.zeros(2)})
      >>> state.names
      ('learning_rate', 'beta1', 'beta2', 'epsilon')
      >>> ft.optim.hyperparameters(state)["learning_rate"]
      Array(0.1, dtype=float32)
    """

    context: LearningContext | None
    values: jax.Array | None
    scheduled: jax.Array | None
    inner: Any
    names: tuple[str, ...] = ()
    scheduled_names: tuple[str, ...] = ()

    def replace(self, **changes: Any) -> HyperState:
        return dataclasses.replace(self, **changes)


register_record(HyperState, ["context", "values", "scheduled", "inner"], ["names", "scheduled_names"])


def _pack(xs: list[jax.Array]) -> jax.Array | None:
    return jnp.stack(xs) if xs else None


def _on_device(x: Any) -> Any:
    """``x`` as a device array if it is a NumPy one, in a buffer of its own (JAX takes an
    aligned NumPy array's memory as the device buffer: a later write to ``x`` would change it)."""
    return jax.device_put(private(x)) if isinstance(x, (np.ndarray, np.generic)) else x


def _on_host(x: Any) -> bool:
    """A Python or NumPy number (not a device array, which may be traced)."""
    return _is_number(x) and not isinstance(x, jax.Array)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float, np.number)) and not isinstance(x, bool)) or (
        isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) == 0
    )


def _is_concrete(x: jax.Array) -> bool:
    try:
        float(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False
    return True


def _validate(where: str, name: str, spec: Any) -> None:
    rule = RULES.get(name)
    value = spec.value if isinstance(spec, Rate) else spec
    if rule is None or not _is_number(value) or (isinstance(value, jax.Array) and not _is_concrete(value)):
        return
    ok, text, example = rule
    v = float(value)
    if not math.isfinite(v) or not ok(v):
        raise ValueError(OUT_OF_RANGE.format(where=where, name=name, value=value, rule=text, example=example))


def _validate_schedule(where: str, name: str, spec: Any) -> None:
    """:data:`SCHEDULE_OUT_OF_RANGE` where one of functree's schedules (given as it is or in
    a :class:`Rate`) was built with a value out of ``name``'s range: a piecewise list's
    ``(1000, -1e-3)``, a decay from a negative rate (:func:`~functree.optim._schedules.values_of`)."""
    rule = RULES.get(name)
    recorded = values_of(spec.value if isinstance(spec, Rate) else spec)
    if rule is None or recorded is None:
        return
    ok, text, example = rule
    values, code = recorded
    if isinstance(spec, Rate) and spec.samples is not None:
        inner, samples = code, spec.samples
        code = lambda write: f"ft.optim.per_samples({inner(write)}, {samples})"  # noqa: E731
    for value in values:
        if _is_number(value) and not (math.isfinite(float(value)) and ok(float(value))):
            raise ValueError(SCHEDULE_OUT_OF_RANGE.format(
                where=where, name=name, value=value, rule=text, wrong=code(repr),
                right=code(lambda v, bad=value: example if v is bad else repr(v))))


def _check_value(where: str, name: str, spec: Any, hyper: Mapping[str, Any] | None = None) -> None:
    """A BAD_HYPERPARAMETER error unless ``spec`` (after :func:`_as_spec`) is a number (0-d),
    a schedule, or a :class:`Rate` of one: anything else failed at ``init`` inside JAX
    (``jnp.stack`` of the packed values) or later."""
    value = spec.value if isinstance(spec, Rate) else spec
    if callable(value) or _is_number(value):
        return
    shaped = hasattr(value, "shape")  # an array: its shape, not its values
    given = f"an array of shape {tuple(np.shape(value))}" if shaped else repr(spec)
    example = RULES.get(name, (None, None, "1e-3"))[2]
    values = list(value) if isinstance(value, (list, tuple)) else []
    hint, more = "", ""
    # the call's other numbers as they were: a fix naming only this one would train with the
    # others' defaults (sgd(0.1, momentum=[...]) -> sgd(momentum=0.9) at learning rate 0.01)
    others = "".join(f"{k}={v!r}, " for k, v in (hyper or {}).items() if k != name and _is_number(v))
    if len(values) > 1 and all(_is_number(v) for v in values):
        hint, more = PER_GROUP_HINT, PER_GROUP_FIX.format(where=where, name=name, first=values[0], second=values[1],
                                                          others=others)
    raise TypeError(BAD_HYPERPARAMETER.format(where=where, name=name, given=given, example=example, others=others,
                                              code="..." if shaped else given, hint=hint, more=more))


def _piecewise_values(spec: Any) -> list[Any]:
    """The values of a raw CNTK schedule list (checked like numbers), else nothing."""
    inner = spec.value if isinstance(spec, Rate) else spec
    if isinstance(inner, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in inner):
        return [p[1] for p in inner]
    return []


def _as_spec(spec: Any) -> Any:
    if isinstance(spec, Rate):
        return Rate(_as_spec(spec.value), spec.samples)
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(p, (list, tuple)) for p in spec):
        return piecewise(spec)
    return spec


def _call(name: str, fn: Callable[[LearningContext], Any], ctx: LearningContext, dtype: Any) -> jax.Array:
    try:
        out = fn(ctx)
    except (TypeError, AttributeError) as e:
        raise TypeError(NOT_A_SCHEDULE.format(name=name, error=e)) from None
    return jnp.asarray(out).astype(dtype)


def _is_concrete_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, list, tuple)) or (isinstance(x, jax.Array) and _is_concrete_value(x))


def _is_concrete_value(x: jax.Array) -> bool:
    try:
        np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False
    return True


def _scalar(x: Any, dtype: Any = jnp.float32) -> jax.Array:
    return jnp.array(x, dtype=dtype)  # a fresh buffer: states may be donated


def hyper_dtype(tree: Any) -> Any:
    """The hyperparameters' dtype for parameters (or gradients) ``tree``: float64 where it
    holds float64 or complex128 leaves (``jax_enable_x64``), else float32. A float32 rate
    in a float64 step is off by its own rounding (``sgd(0.1)``: −0.030000000447 for −0.03;
    Adam 7.5e-7 after five steps against optax's float64)."""
    wide = (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex128))
    leaves = jax.tree.leaves(tree)
    return jnp.float64 if any(jnp.dtype(getattr(x, "dtype", np.float32)) in wide for x in leaves) else jnp.float32


class _Spec:
    """How one hyperparameter is computed: a stored value or a schedule, times a rate unit."""

    def __init__(self, name: str, spec: Any):
        self.name = name
        self.rate = spec if isinstance(spec, Rate) else Rate(spec, None)
        self.scheduled = callable(self.rate.value)

    def effective(self, ctx: LearningContext, stored: jax.Array | None, dtype: Any, where: str = "ft.optim"
                  ) -> jax.Array:
        base = _call(self.name, self.rate.value, ctx, dtype) if self.scheduled else stored
        if base is None:  # (step() refuses another optimizer's state before this)
            raise ValueError(MISSING_HYPERPARAMETER.format(where=where, name=self.name))
        if self.rate.samples is None:
            return base
        _check_size_source(where, self.name, self.rate)  # at trace time: M is static here
        scale = self.rate.scale(ctx, dtype)
        if self.name in DECAY_RATES:  # the per-example decay, M times: γ^(M / samples)
            return jnp.asarray(base, dtype) ** scale
        return base * scale


def inject(
    where: str,
    factory: Callable[..., optax.GradientTransformation],
    hyper: Mapping[str, Any],
    static: Mapping[str, Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """An optax transformation whose named hyperparameters live in a :class:`HyperState`.

    ``factory(**hyper_values, **static)`` builds the optax transformation doing the
    numerics; it is rebuilt each step (at trace time) with the current values as arrays.
    ``update`` takes the extra arguments ``minibatch_size=`` and ``loss=``, which advance
    the learning context; others pass through to the inner transformation.

    Example:
      >>> import functree as ft, jax.numpy as jnp, optax
      >>> tx = ft.optim.inject("scale", lambda factor: optax.scale(factor), {"factor": 2.0})
      >>> g = {"w": jnp.ones(2)}; state = tx.init(g)
      >>> ft.optim.hyperparameters(state), tx.update(g, state)[0]
      ({'factor': Array(2., dtype=float32)}, {'w': Array([2., 2.], dtype=float32)})
    """
    static = dict(static or {})
    specs = {}
    for name, spec in hyper.items():
        if isinstance(spec, Rate) and spec.samples is not None and name not in RATE_UNITS:
            raise ValueError(RATE_NOT_A_LEARNING_RATE.format(where=where, name=name, spec=spec))
        for value in _piecewise_values(spec):
            _validate(where, name, value)
        spec = _as_spec(spec)
        _check_value(where, name, spec, hyper)
        _validate(where, name, spec)
        _validate_schedule(where, name, spec)
        specs[name] = _Spec(name, spec)

    names = tuple(n for n, sp in specs.items() if not sp.scheduled)
    scheduled_names = tuple(n for n, sp in specs.items() if sp.scheduled)

    def build(ctx: LearningContext, values: jax.Array | None, dtype: Any,
              stored: dict[str, Any] | None = None) -> tuple[Any, jax.Array | None]:
        if stored is None:
            stored = dict(zip(names, jnp.unstack(values, axis=-1))) if values is not None else {}
        eff = {n: sp.effective(ctx, stored.get(n), dtype, where) for n, sp in specs.items()}
        tx = optax.with_extra_args_support(factory(**eff, **static))
        return tx, _pack([eff[n] for n in scheduled_names])

    def init(params: Any) -> HyperState:
        # kept mode-free, as an Optimizer's state: it serves the model in either mode
        # (NNX's order, the state built before ft.nn.training(model), works)
        params = mode_free(parameters(params))
        # One array at two parameters: the hand loop's first ft.move unties it, silently (once, here)
        warn_aliases(params, what=f"The model given to {where}(...).init", copied=False)
        ctx = initial_context()
        given = [specs[n].rate.value for n in names]
        dtype = hyper_dtype(params)
        stored = None
        if all(_on_host(v) for v in given):
            # Packed on the host, and the transformation built for its init with NumPy
            # values: no eager programs (on a GPU each compiles before the first step; an
            # update builds it again, traced, from the packed values).
            values = jax.device_put(np.array(given, dtype)) if given else None
            stored = {n: np.dtype(dtype).type(v) for n, v in zip(names, given)}
        else:
            values = _pack([_scalar(v, dtype) for v in given])
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float hyperparameters and int counts
            tx, scheduled = build(ctx, values, dtype, stored)
            inner = jax.tree.map(_on_device, tx.init(params))  # (a transformation that keeps a value)
            state = HyperState(ctx, values, scheduled, inner, names, scheduled_names)
            placed = placement_of(params)  # host-made leaves on the parameters' devices
            return state if placed is None else put(state, placed)

    def step(updates: Any, state: HyperState, params: Any, ctx: LearningContext,
             extra: dict[str, Any]) -> tuple[Any, HyperState]:
        """The numerics at the learning context ``ctx``: the updates and the next state."""
        _check_names(where, state, names, scheduled_names)
        packed = state.values if state.values is not None else state.scheduled
        dtype = packed.dtype if packed is not None else hyper_dtype(updates)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float hyperparameters and int counts
            tx, scheduled = build(ctx, state.values, dtype)
            try:
                new_updates, inner = tx.update(updates, state.inner, params, **extra)
            except ValueError as e:  # a partial gradient without the model: which are parameters?
                if params is not None or not any(x is None for x in jax.tree.leaves(updates, is_leaf=is_none)):
                    if (unread := model_not_given(where, e, params)) is not None:
                        raise unread from None
                    raise
                raise ValueError(PARTIAL_WITHOUT_MODEL.format(where=where, error=e)) from None
        # float32 hyperparameters must not promote bfloat16 moments or updates: a state
        # whose dtypes drift would recompile the jitted step on its second call.
        inner = jax.tree.map(_like, inner, state.inner)
        return jax.tree.map(_like, new_updates, updates), state.replace(scheduled=scheduled, inner=inner)

    def update(
        updates: Any,
        state: Any,
        params: Any = None,
        *,
        context: LearningContext | None = None,
        minibatch_size: Any = None,
        loss: Any = None,
        **extra: Any,
    ) -> tuple[Any, HyperState]:
        if not isinstance(state, HyperState):  # another transform's state (a group's optimizer changed)
            raise TypeError(NOT_THIS_STATE.format(where=where, given=type(state).__name__))
        if state.context is not None:  # standalone optax use: this transform keeps its own context
            return _standalone(step, updates, state, params, minibatch_size, loss, extra, where)
        # Inside an ft.optim.Optimizer: it made the parameter view, checked the gradients
        # and owns the one learning context; trust all three.
        if context is None:
            raise ValueError(NEEDS_CONTEXT.format(where=where))
        return step(updates, state, params, context, extra)

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


NOT_THIS_STATE = """\
{where}: the state given is a {given}, not this optimizer's HyperState: it was made by another \
transformation (a group of ft.optim.groups whose optimizer was changed, freeze() -> adam, sgd -> \
adam). Make a state for this optimizer:

    right:  state = opt.init(model)
"""


def _check_names(where: str, state: HyperState, names: tuple[str, ...], scheduled: tuple[str, ...]) -> None:
    """:data:`OTHER_HYPERPARAMETERS` unless ``state`` stores and schedules the hyperparameters
    this transform does (static: a trace-time comparison of two tuples)."""
    if state.names == names and state.scheduled_names == scheduled:
        return
    raise ValueError(OTHER_HYPERPARAMETERS.format(
        where=where, state_names=_listed(state.names), state_scheduled=_listed(state.scheduled_names),
        names=_listed(names), scheduled=_listed(scheduled)))


def _listed(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(names) + ")" if names else "nothing"


class ComplexGradientWarning(UserWarning):
    """A complex gradient reached a bare ``ft.optim`` transformation (optax's convention)."""


COMPLEX_BARE = """\
{where}: a complex gradient, used as a plain optax transformation: it follows optax's
convention (it descends along the gradient as given). ft.gradient's complex gradients are
JAX's, which that convention climbs: wrap the optimizer for torch's numbers,
    right:  opt = ft.optim.Optimizer({where}(...)); updates, state = opt.update(grads, state, model)
       or:  tx.update(jax.tree.map(jnp.conj, grads), state, model)     # optax's complex convention"""


def _standalone(step: Callable[..., tuple[Any, HyperState]], updates: Any, state: HyperState, params: Any,
                minibatch_size: Any, loss: Any, extra: dict[str, Any], where: str = "ft.optim") -> tuple[Any, HyperState]:
    """:func:`inject`'s update used as a plain optax transformation, around ``step`` (the
    numerics): the parameter view of ``params``, the gradients in the state's (mode-free)
    form (a failing step's state read by :func:`check_redefined`, for a message naming a
    model class defined again), a ``None`` gradient as no update (as through an Optimizer),
    and the state's own learning context read at ``minibatch_size``/``loss`` and advanced."""
    if any(jnp.iscomplexobj(g) for g in jax.tree.leaves(updates)):  # a torch user's loop climbed, silently
        warn(COMPLEX_BARE.format(where=where), ComplexGradientWarning)
    params = None if params is None else parameters(params)
    given = (jax.tree.structure(updates), None if params is None else jax.tree.structure(params))
    updates, params = mode_free(updates), mode_free(params)  # the state's form (init)
    updates, partial = checked_gradients(updates, params)
    assert state.context is not None
    ctx = current(state.context, minibatch_size, loss)
    try:
        new_updates, new = step(updates, state, params, ctx, extra)
    except ValueError:
        # optax's own error, inside its tree_map, names neither the state nor the fix where a
        # model class was defined again (two types of one name): read after a failure only
        try:
            check_redefined(state.inner, updates)
        except ValueError as named:
            raise named from None
        raise
    if partial is not None:
        new_updates, inner = keep_unchanged(partial, new_updates, new.inner, state.inner)
        new = new.replace(inner=inner)
    return in_mode(new_updates, given), new.replace(context=advance(state.context, minibatch_size, loss))


def _like(new: Any, old: Any) -> Any:
    dtype = getattr(old, "dtype", None)
    return new if dtype is None or new.dtype == dtype else new.astype(dtype)


def _is_hyper(x: Any) -> bool:
    return isinstance(x, HyperState)


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_node(x: Any) -> bool:
    """A node holding hyperparameters: functree's, or ``optax.inject_hyperparams``'."""
    return isinstance(x, (HyperState, *_INJECTED))


def _injected(node: Any) -> list[tuple[str, bool, Any]]:
    """``(name, settable, value)`` of an ``optax.inject_hyperparams`` state's numeric
    hyperparameters (a scheduled one reads the value its latest step used; not settable:
    the schedule decides the next)."""
    scheduled = getattr(node, "hyperparams_states", None) or {}
    return [(n, n not in scheduled, v) for n, v in node.hyperparams.items()
            if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.number)]


def _label(path: tuple) -> str:
    for key in reversed(path):
        if isinstance(key, jax.tree_util.DictKey):
            return str(key.key)
    return jax.tree_util.keystr(path)


def _entries(state: Any, values: bool | str = True) -> list[tuple[str, str, bool, Any]]:
    """(label, name, settable, value) for every hyperparameter in the state (value None
    unless ``values``: reading them is one ``unstack`` per transform, not one op per value;
    ``"shapes"``: each value's ``jax.ShapeDtypeStruct``, nothing read)."""
    found = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_node)[0]
    out = []
    for path, node in found:
        if isinstance(node, _INJECTED):  # optax's own: its numbers, then the state it wraps
            # A copy (as the unstacked values of ft's are): a later donating step deletes the state's.
            shown = {"shapes": lambda v: jax.ShapeDtypeStruct(jnp.shape(v), v.dtype), True: jnp.copy}
            out += [(_label(path), n, settable, shown.get(values, lambda v: None)(v))
                    for n, settable, v in _injected(node)]
            out += _entries(node.inner_state, values)
            continue
        if not _is_hyper(node):
            continue
        label = _label(path)
        stored = _unpacked(node.values, node.names, values) if values else [None] * len(node.names)
        latest = (_unpacked(node.scheduled, node.scheduled_names, values) if values
                  else [None] * len(node.scheduled_names))
        out += [(label, n, True, v) for n, v in zip(node.names, stored)]
        out += [(label, n, False, v) for n, v in zip(node.scheduled_names, latest)]
    return out


def _unpacked(packed: jax.Array | None, names: tuple[str, ...], values: bool | str = True) -> list[Any]:
    """One array per name from values packed along the last axis (leading axes: members);
    ``values="shapes"``: their shapes and dtype only."""
    if not names:
        return []
    assert packed is not None
    if jnp.shape(packed)[-1:] != (len(names),):
        raise ValueError(STACKED_ALONG_ANOTHER_AXIS.format(shape=jnp.shape(packed), n=len(names), names=names))
    if values == "shapes":
        return [jax.ShapeDtypeStruct(jnp.shape(packed)[:-1], packed.dtype)] * len(names)
    return list(jnp.unstack(packed, axis=-1))


def hyperparameter_names(state: Any) -> list[str]:
    """The names :func:`hyperparameters` lists, without reading any value.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.optim.hyperparameter_names(ft.optim.sgd(0.1).init({"w": jnp.ones(2)}))
      ['learning_rate', 'momentum']
    """
    return _keys(_entries(state, values=False))


def learning_rate_names(state: Any) -> list[str]:
    """The learning rates among :func:`hyperparameter_names`: ``["learning_rate"]``, or
    with ``ft.optim.groups`` one per group, ``"<group>/learning_rate"`` (the names the
    Trainer's history and callbacks use).

    Example:
      >>> import jax.numpy as jnp, functree as ft
      >>> from functree.optim._hyper import learning_rate_names
      >>> tx = ft.optim.groups({"body": ft.optim.adam(1e-3), "head": ft.optim.sgd(0.1)})
      >>> learning_rate_names(tx.init({"body": jnp.ones(2), "head": jnp.ones(1)}))
      ['body/learning_rate', 'head/learning_rate']
    """
    return [k for k in hyperparameter_names(state) if k == "learning_rate" or k.endswith("/learning_rate")]


def _is_plateau(x: Any) -> bool:
    return isinstance(x, optax.contrib.ReduceLROnPlateauState)


def applied_learning_rates(state: Any, names: list[str] | None = None) -> dict[str, jax.Array]:
    """The learning rates of :func:`learning_rate_names` (or ``names``) as the updates apply
    them: :func:`hyperparameters`' value times the ``scale`` of every
    ``ft.optim.reduce_on_plateau`` (``optax.contrib.reduce_on_plateau``) that scales them:
    the one in the rate's own group, and any chained outside every group.

    Example:
      >>> import jax.numpy as jnp, optax, functree as ft
      >>> from functree.optim._hyper import applied_learning_rates
      >>> tx = optax.chain(ft.optim.sgd(0.1), ft.optim.reduce_on_plateau())
      >>> applied_learning_rates(tx.init({"w": jnp.ones(1)}))
      {'learning_rate': Array(0.1, dtype=float32)}
    """
    names = learning_rate_names(state) if names is None else names
    if not names:
        return {}
    values = hyperparameters(state)
    entries = _entries(state, values=False)
    labels = {key: e[0] for key, e in zip(_keys(entries), entries)}
    own = {labels[n] for n in names}
    found = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_plateau)[0]
    plateaus = [(_label(path), node.scale) for path, node in found if _is_plateau(node)]
    out = {}
    for name in names:
        value = values[name]
        for label, scale in plateaus:
            if label == labels[name] or label not in own:
                value = value * jnp.asarray(scale).astype(value.dtype)
        out[name] = value
    return out


def group_learning_rate(state: Any, group: str) -> str | None:
    """The :func:`hyperparameters` name of group ``group``'s learning rate (``ft.optim.groups``:
    ``"<group>/learning_rate"``, or ``"learning_rate"`` where no other group has one), or None.

    Example:
      >>> import jax.numpy as jnp, functree as ft
      >>> from functree.optim._hyper import group_learning_rate
      >>> tx = ft.optim.groups({"body": ft.optim.freeze(), "head": ft.optim.sgd(0.1)})
      >>> state = tx.init({"body": jnp.ones(2), "head": jnp.ones(1)})
      >>> group_learning_rate(state, "head"), group_learning_rate(state, "body")
      ('learning_rate', None)
    """
    entries = _entries(state, values=False)
    for key, (label, name, _, _) in zip(_keys(entries), entries):
        if name == "learning_rate" and label == group:
            return key
    return None


def _keys(entries: list[tuple[str, str, bool, Any]]) -> list[str]:
    counts: dict[str, int] = {}
    for _, name, _, _ in entries:
        counts[name] = counts.get(name, 0) + 1
    return [name if counts[name] == 1 else f"{label}/{name}" for label, name, _, _ in entries]


def hyperparameters(state: Any) -> dict[str, jax.Array]:
    """Current hyperparameter values by name (a name used twice is prefixed by its group).

    Numbers read as stored (a ``per_samples(v, n)`` rate reads ``v``); scheduled ones
    read the value the latest step used. An ``optax.inject_hyperparams`` state's numeric
    hyperparameters are listed too (and set by :func:`set_hyperparameters`).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.adam(1e-3).init({"w": jnp.ones(2)})
      >>> sorted(ft.optim.hyperparameters(state))
      ['beta1', 'beta2', 'epsilon', 'learning_rate']
      >>> state = ft.optim.set_hyperparameters(state, learning_rate=1e-4)
      >>> ft.optim.hyperparameters(state)["learning_rate"]
      Array(0.0001, dtype=float32)
    """
    check_stale([("state", state)], "ft.optim.hyperparameters(state)")  # donated by a step
    entries = _entries(state)
    return {k: e[3] for k, e in zip(_keys(entries), entries)}


def set_hyperparameters(state: Any, values: Mapping[str, Any] | None = None, **changes: Any) -> Any:
    """A new state with hyperparameters changed; jitted steps do not recompile.

    A bare name (``learning_rate``) changes it everywhere in the state; a qualified name
    (``"head.*/learning_rate"``, as :func:`hyperparameters` lists it) changes one group's.
    Scheduled hyperparameters cannot be set (a ``ValueError``); the state is not mutated.
    On a stacked state (a vmapped ensemble or sweep) give a scalar for every member or an
    array with one value per member. A value committed to other devices than the state's (a
    rate read from another job's state) is put on the state's, as a NumPy value is.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.sgd(0.1)
      >>> state = ft.optim.set_hyperparameters(tx.init({"w": jnp.ones(2)}), learning_rate=0.5)
      >>> tx.update({"w": jnp.ones(2)}, state)[0]          # the step uses 0.5, not 0.1
      {'w': Array([-0.5, -0.5], dtype=float32)}
    """
    check_stale([("state", state)], "ft.optim.set_hyperparameters(state, ...)")  # donated by a step
    changes = {**(values or {}), **changes}
    entries = _entries(state, values="shapes")  # (reading the values was an eager program)
    keys = _keys(entries)
    todo: dict[tuple[str, str], Any] = {}
    for key, value in changes.items():
        hits = [e for k, e in zip(keys, entries) if k == key or e[1] == key]
        if not hits:
            raise KeyError(_unknown(key, keys))
        for label, name, settable, now in hits:
            if not settable:
                raise ValueError(SCHEDULED_HYPERPARAMETER.format(name=name))
            for v in np.ravel(value).tolist() if _is_concrete_array(value) else [value]:
                _validate("set_hyperparameters", name, v)
            if np.ndim(value) != 0 and np.shape(value) != now.shape:  # one per member
                if now.shape == ():
                    raise ValueError(BAD_HYPERPARAMETER_UNSTACKED.format(
                        name=key, shape=np.shape(value), example=RULES.get(name, (None, None, "1e-3"))[2]))
                raise ValueError(BAD_HYPERPARAMETER_SHAPE.format(name=key, shape=np.shape(value), members=now.shape))
            todo[(label, name)] = value

    def replace(path: tuple, node: Any) -> Any:
        if isinstance(node, _INJECTED):  # a fresh buffer, the stored dtype and weak type: no recompilation
            label = _label(path)
            new = {n: jnp.full_like(v, todo[(label, n)]) if (label, n) in todo else v
                   for n, v in node.hyperparams.items()}
            inner = jax.tree_util.tree_map_with_path(replace, node.inner_state, is_leaf=_is_node)
            return node._replace(hyperparams=new, inner_state=inner)
        if not _is_hyper(node):
            return node
        label = _label(path)
        hits = [(i, todo[(label, n)]) for i, n in enumerate(node.names) if (label, n) in todo]
        if not hits:
            return node
        dtype = node.values.dtype  # the state's precision: host values rounded on the host, as jnp.array does
        new = tuple(v if isinstance(v, jax.Array) else np.array(v, dtype) for _, v in hits)
        new = following(node.values, new)  # a value committed to another device: to the state's, as NumPy's
        return node.replace(values=_set_columns(node.values, tuple(i for i, _ in hits), new))

    return jax.tree_util.tree_map_with_path(replace, state, is_leaf=_is_node)


def _unknown(key: str, keys: list[str]) -> str:
    """The error for a hyperparameter ``key`` the state does not hold: :data:`DROPPED_AT_ZERO`
    for a name an optimizer leaves out at 0 (``weight_decay=0.0``, sgd's ``dampening=0.0``;
    ``"head.*/weight_decay"`` by its last part, :data:`DROPPED`), else :data:`UNKNOWN_HYPERPARAMETER`."""
    name, known = key.rsplit("/", 1)[-1], sorted(set(keys))
    if name in DROPPED:
        what, call, example = DROPPED[name]
        return DROPPED_AT_ZERO.format(key=key, name=name, known=known, what=what, call=call, example=example)
    return UNKNOWN_HYPERPARAMETER.format(name=key, known=known)


@functools.partial(jax.jit, static_argnums=1)
def _set_columns(values: jax.Array, columns: tuple[int, ...], new: tuple[Any, ...]) -> jax.Array:
    """``values`` with column ``columns[k]`` of its last axis set to ``new[k]`` (cast to its
    dtype; a fresh buffer: states may be donated). One program per signature: the eager
    ``values.at[..., i].set(...)`` compiled three (each a GPU compile) at a first
    ``set_hyperparameters`` (``ReduceLROnPlateau``'s first reduction)."""
    for i, v in zip(columns, new):
        values = values.at[..., i].set(jnp.asarray(v, values.dtype))
    return values
