"""Weight averaging: an EMA or a uniform (SWA) average of the parameters, kept by the optimizer.

``ft.optim.Optimizer(tx, average=ft.optim.ema(0.999))`` chains an averaging transform
after ``tx``. It leaves the updates alone and folds each step's new parameters
``θ_t = θ_{t-1} + u_t`` into an average kept in the optimizer state (float32 for
low-precision parameters), so checkpoints save it with the rest of the state and a jitted
step updates it in place. ``ft.optim.averaged(state, model)`` is the model with the
averaged parameters, for evaluation or validation.

Every average here is one incremental rule over the averaged steps ``k = 1, 2, ...``::

    θ̄_k = θ̄_{k-1} + w_k (θ_k − θ̄_{k-1})

* ``ema(d)`` (debiased, the default): ``w_k = (1 − d) / (1 − d^k)``. This is optax's
  debiased EMA ``m_k / (1 − d^k)`` with ``m_k = d m_{k-1} + (1 − d) θ_k``, ``m_0 = 0``:
  a weighted mean of the iterates with weights ``∝ d^{k-i}``, exact from the first step.
* ``ema(d, debias=False)``: ``w_1 = 1``, then ``w_k = 1 − d``: the first average is a copy,
  then a plain EMA (``torch.optim.swa_utils.AveragedModel`` with
  ``get_ema_multi_avg_fn(d)``, timm's ``ModelEmaV2``).
* ``uniform_average()``: ``w_k = 1 / k``: the mean of the iterates (SWA;
  ``AveragedModel``'s default).

Steps up to ``start`` are not averaged (the average follows the parameters until then);
after it, every ``every``-th step is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functree._alias import check_stale
from functree._tree import is_none, register_record
from functree.nn._precision import statistics_dtype
from functree.optim._hyper import hyper_dtype
from functree.optim._lookahead import SlowState
from functree.optim._multisteps import multisteps_in
from functree.optim._skip import applied_in, select

__all__ = ["AverageState", "ema", "uniform_average", "averaged", "averages_in", "keeps_average", "with_average",
           "check_average_placement", "is_average", "is_slot"]

NEEDS_PARAMS = """\
{name} averages the parameters, so update needs them: pass the model.

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)
"""

BAD_DECAY = "ft.optim.ema: decay must be a number in [0, 1), got {given!r} (0.999 is typical)."

BAD_SCHEDULE = "{name}: {what} must be a {kind} int, got {given!r}."

NOT_AVERAGING = """\
average= takes functree's average of the parameters, ft.optim.ema or \
ft.optim.uniform_average, got {given}. {why}

    wrong:  ft.optim.Optimizer(ft.optim.adam(1e-3), average=optax.ema(0.999))
    right:  ft.optim.Optimizer(ft.optim.adam(1e-3), average=ft.optim.ema(0.999))
            model = ft.optim.averaged(state, model)      # the averaged parameters
"""

# Why a transformation that has init/update is still refused: optax's own EMA (and any
# other transformation) would be chained into the update path and change the steps.
NOT_AVERAGING_WHY = (
    "A {given} transforms the updates (optax.ema averages the updates, not the "
    "parameters): chained after the optimizer it would change every step, and "
    "ft.optim.averaged would find no average.")

NO_AVERAGE = """\
ft.optim.averaged: this optimizer state keeps no averaged parameters. Average them with \
the optimizer:

    right:  opt = ft.optim.Optimizer(ft.optim.adam(1e-3), average=ft.optim.ema(0.999))
            model = ft.optim.averaged(state, model)      # state = opt.init(model), then steps
"""

OTHER_MODEL = """\
ft.optim.averaged: the optimizer state was made for another model (its averaged \
parameters do not fit this model's leaves). Give the model the state was made for:

    right:  state = opt.init(model);  ...;  ft.optim.averaged(state, model)
"""

TWO_AVERAGES = """\
ft.optim.averaged: this optimizer state keeps {count} averages of the parameters; \
give the optimizer one (average= or one ft.optim.ema / uniform_average / lookahead in the chain).
"""


AVERAGE_NOT_LAST = """\
{name} is element {index} of an optax.chain of {length}, not its last: it folds each \
step's new parameters θ + u into its average, where u is the update it is given, so a \
transformation before the optimizer hands it gradients, and one after it changes the step \
that is applied: the average would not be of the parameters the model takes. Give the \
average to the optimizer, or chain it last:

    wrong:  ft.optim.Optimizer(optax.chain(ft.optim.ema(0.999), optax.adam(1e-3)))
    right:  ft.optim.Optimizer(optax.adam(1e-3), average=ft.optim.ema(0.999))
       or:  ft.optim.Optimizer(optax.chain(optax.adam(1e-3), ft.optim.ema(0.999)))"""

AVERAGE_AFTER_MULTISTEPS = """\
{name} is chained after an optax.MultiSteps, whose calls between its updates only sum \
gradients: it would count every minibatch as a step (each update folded k times, start \
and every counted in minibatches, the lookahead's sync_period too). Give the average to \
the optimizer, which folds at the updates only, or accumulate with functree:

    wrong:  ft.optim.Optimizer(optax.chain(optax.MultiSteps(optax.adam(1e-3), 4), ft.optim.ema(0.999)))
    right:  ft.optim.Optimizer(optax.MultiSteps(optax.adam(1e-3), 4), average=ft.optim.ema(0.999))
       or:  ft.optim.Optimizer(optax.adam(1e-3), accumulate=4, average=ft.optim.ema(0.999))"""


@dataclasses.dataclass(frozen=True)
class AverageState:
    """State of :func:`ema` and :func:`uniform_average`.

    Attributes:
      steps: updates seen (applied steps of the optimizer).
      count: updates folded into the average (steps after ``start``, every ``every``-th).
      average: the averaged parameters: the parameter view's structure (``None`` at
        non-parameters and at parameters an ``Optimizer(wrt=)`` does not train), float32
        for parameters of lower precision.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.ema(0.9).init({"w": jnp.ones(2)})
      >>> int(state.count), state.average
      (0, {'w': Array([1., 1.], dtype=float32)})
    """

    steps: jax.Array
    count: jax.Array
    average: Any

    def replace(self, **changes: Any) -> AverageState:
        return dataclasses.replace(self, **changes)


register_record(AverageState, ["steps", "count", "average"])


class Averaging(optax.GradientTransformationExtraArgs):
    """The transformation of :func:`ema` and :func:`uniform_average`: an optax
    transformation that leaves the updates alone, marked so that ``Optimizer(average=)``
    takes these and refuses another transformation (which would change the steps)."""

    __slots__ = ()


def _wide(x: Any) -> Any:
    """The average's dtype: the parameter's, at least float32 (a bfloat16 average at
    decay 0.999 would round every step's change away). Read off the dtype, not
    ``jnp.promote_types(dtype, float32)``, which strict promotion refuses for every
    dtype but float32 (float64 under x64, bfloat16)."""
    dtype = jnp.result_type(x)
    return x.astype(statistics_dtype(dtype) if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32)


def _averaging(name: str, weight: Callable[[jax.Array, Any], jax.Array], start: int,
               every: int) -> optax.GradientTransformationExtraArgs:
    for what, value, low, kind in (("start", start, 0, "non-negative"), ("every", every, 1, "positive")):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(BAD_SCHEDULE.format(name=name, what=what, kind=kind, given=value))

    def init(params: Any) -> AverageState:
        zero = jnp.zeros((), jnp.int32)
        return AverageState(zero, zero.copy(), jax.tree.map(_wide, params))

    def update(updates: Any, state: AverageState, params: Any = None, **extra: Any) -> tuple[Any, AverageState]:
        if params is None:
            raise ValueError(NEEDS_PARAMS.format(name=name))
        steps = state.steps + 1
        take = (steps > start) & ((steps - start) % every == 0)
        count = state.count + take.astype(jnp.int32)
        # Before the first averaged step the average follows the parameters (w = 1);
        # between averaged steps it stays (w = 0). The weight in float64 for a float64
        # average (1/3 in float32 put SWA's mean 1e-8 off torch's AveragedModel in float64).
        dtype = hyper_dtype(state.average)
        w = jnp.where(take, weight(jnp.maximum(count, 1), dtype), jnp.where(count == 0, 1.0, 0.0).astype(dtype))

        def fold(avg: Any, p: Any, u: Any) -> Any:
            if avg is None or p is None:
                return avg
            new = p if u is None else p + u
            return avg + w.astype(avg.dtype) * (new.astype(avg.dtype) - avg)

        average = jax.tree.map(fold, state.average, params, updates, is_leaf=is_none)
        return updates, AverageState(steps, count, average)

    return Averaging(init, update)  # pyright: ignore[reportArgumentType]


def ema(decay: float, *, debias: bool = True, start: int = 0, every: int = 1) -> optax.GradientTransformationExtraArgs:
    """An exponential moving average of the parameters (Polyak–Ruppert with decay ``d``).

    ``θ̄_k = θ̄_{k-1} + w_k (θ_k − θ̄_{k-1})`` over the averaged steps, with
    ``w_k = (1 − d)/(1 − d^k)`` (``debias=True``: optax's debiased EMA, a normalized
    ``d``-weighted mean of the iterates) or ``w_1 = 1, w_k = 1 − d`` (``debias=False``:
    copy, then EMA, as ``torch.optim.swa_utils.AveragedModel(get_ema_multi_avg_fn(d))``).
    Use it as ``Optimizer(tx, average=ft.optim.ema(d))`` and read the averaged model with
    :func:`ft.optim.averaged`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(1.0), average=ft.optim.ema(0.5))
      >>> w = {"w": jnp.zeros(())}
      >>> state = opt.init(w)
      >>> for _ in range(2):     # parameters 1, then 2: averaged (0.5·1 + 1·2) / 1.5
      ...     w, state, _ = opt.minimize(lambda p: -p["w"], w, state)
      >>> float(w["w"]), round(float(ft.optim.averaged(state, w)["w"]), 4)
      (2.0, 1.6667)
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
        raise ValueError(BAD_DECAY.format(given=decay))
    d = float(decay)

    def weight(k: jax.Array, dtype: Any) -> jax.Array:
        if debias:
            return (1.0 - d) / (1.0 - jnp.power(jnp.asarray(d, dtype), k.astype(dtype)))
        return jnp.where(k == 1, 1.0, 1.0 - d).astype(dtype)

    return _averaging("ft.optim.ema", weight, start, every)


def uniform_average(*, start: int = 0, every: int = 1) -> optax.GradientTransformationExtraArgs:
    """The running mean of the parameters after each averaged step (stochastic weight averaging).

    ``θ̄_k = θ̄_{k-1} + (θ_k − θ̄_{k-1}) / k``: the mean of the ``k`` iterates averaged
    so far, as ``torch.optim.swa_utils.AveragedModel``'s default. SWA averages late in
    training: ``start`` steps are skipped, then every ``every``-th step is averaged (e.g.
    the steps per epoch, to average once an epoch).

    Limit: the mean is kept in float32 for float32 parameters (as torch's), so a step's
    share ``(θ_k − θ̄_{k-1}) / k`` rounds to the average's spacing once ``k`` is large.
    Parameters of order 1 moving 0.01 over the averaged steps (1e-3 between steps; the
    exact mean moves 0.005) gave a mean 3e-7 off the exact one over 1000 averaged steps,
    8e-7 over 10⁴, but 5e-4 over 10⁵ (a tenth of the averaged motion lost) and 4e-3 over
    10⁶ (the mean stuck near its early value). Keep ``k`` below about 10⁴: average every
    ``every``-th step (``every=100`` over a million steps), or use :func:`ema`, whose
    weight does not shrink (decay 0.9999 over 10⁵ such steps: 1.5e-6 off); float64 parameters
    (``jax_enable_x64``) keep a float64 mean.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(1.0), average=ft.optim.uniform_average(start=1))
      >>> w = {"w": jnp.zeros(())}
      >>> state = opt.init(w)
      >>> for _ in range(3):     # parameters 1, 2, 3: the mean of 2 and 3
      ...     w, state, _ = opt.minimize(lambda p: -p["w"], w, state)
      >>> ft.optim.averaged(state, w)["w"]
      Array(2.5, dtype=float32)
    """
    return _averaging("ft.optim.uniform_average", lambda k, dtype: 1.0 / k.astype(dtype), start, every)


def with_average(transform: Any, average: Any) -> Any:
    """``transform`` followed by the averaging transform ``average`` (``Optimizer(average=)``).

    The state is ``optax.chain``'s, ``(transform's, average's)``; a step that a
    :func:`ft.optim.skip_non_finite` inside ``transform`` skipped leaves the average as it was,
    and so does a micro-step of an ``optax.MultiSteps`` inside it (a minibatch whose
    gradients it sums without updating): the average is over the updates, as
    ``torch.optim.swa_utils.AveragedModel.update_parameters`` after each ``optimizer.step()``
    and as ``Optimizer(tx, accumulate=k)`` on minibatches ``k`` times as large.
    """
    if average is None:
        return transform
    if not isinstance(average, Averaging):
        given = type(average).__name__
        why = NOT_AVERAGING_WHY.format(given=given) if hasattr(average, "update") else ""
        raise TypeError(NOT_AVERAGING.format(given=given, why=why))
    inner, avg = optax.with_extra_args_support(transform), optax.with_extra_args_support(average)

    def init(params: Any) -> tuple[Any, Any]:
        return inner.init(params), avg.init(params)

    def update(updates: Any, state: tuple[Any, Any], params: Any = None, **extra: Any) -> tuple[Any, Any]:
        updates, first = inner.update(updates, state[0], params, **extra)
        updates, second = avg.update(updates, state[1], params, **extra)
        applied = _both(applied_in(first), _updated(state[0], first))
        if applied is not None:
            second = select(applied, second, state[1])
        return updates, (first, second)

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def _updated(old: Any, new: Any) -> jax.Array | None:
    """Whether every ``optax.MultiSteps`` in the state updated the parameters at this step
    (its ``gradient_step`` advanced; a micro-step only sums the gradients); None where
    there is none."""
    before, after = multisteps_in(old), multisteps_in(new)
    if not after or len(before) != len(after):
        return None
    flags = [a.gradient_step != b.gradient_step for b, a in zip(before, after)]
    return jnp.stack(flags).all() if len(flags) > 1 else flags[0]


def _both(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    return b if a is None else a if b is None else a & b


def is_average(x: Any) -> bool:
    """Whether ``x`` is a state node keeping averaged parameters: an :class:`AverageState`
    or a lookahead's :class:`SlowState`."""
    return isinstance(x, (AverageState, SlowState))


def is_slot(x: Any) -> bool:
    """A parameter's place in a per-parameter tree that holds no array: ``None`` (no
    parameter there) or ``optax.MaskedNode`` (a parameter another group or a mask holds),
    each one entry where a plain flatten gives none."""
    return x is None or isinstance(x, optax.MaskedNode)


def check_average_placement(state: Any, averaged: bool) -> None:
    """Refuse an average (``ft.optim.ema``, ``uniform_average``, ``lookahead``) that an
    ``optax.chain`` in the optimizer state holds anywhere but last, or after an
    ``optax.MultiSteps``: it would average something other than the parameters the steps
    make (``Optimizer.init`` calls this; ``averaged``: the state's top pair is
    ``Optimizer(average=)``'s own, which folds at the updates only, so it is not checked).

    A chain's state is a plain tuple, one element per transformation, in order.

    Example:
      >>> import optax, functree as ft, jax.numpy as jnp
      >>> state = optax.chain(ft.optim.ema(0.9), optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> try:
      ...     check_average_placement(state, averaged=False)
      ... except ValueError as e:
      ...     print(str(e).split(":")[0])
      ft.optim.ema / ft.optim.uniform_average is element 0 of an optax.chain of 2, not its last
    """
    for node in _nodes(state):
        if type(node) is tuple and not (averaged and node is state):
            _check_chain(node)


def _is_node(x: Any) -> bool:
    return type(x) is tuple or isinstance(x, (optax.MultiStepsState, AverageState, SlowState))


def _nodes(tree: Any) -> list[Any]:
    """``tree`` and every chain state, MultiSteps state and average inside it."""
    below = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: x is not tree and _is_node(x)) if _is_node(x)]
    return [tree] + [node for x in below for node in _nodes(x)]


def _check_chain(chain: tuple[Any, ...]) -> None:
    accumulating = False
    for index, element in enumerate(chain):
        found = [x for x in _nodes(element) if is_average(x)]
        if found:
            name = "ft.optim.lookahead" if isinstance(found[0], SlowState) else "ft.optim.ema / ft.optim.uniform_average"
            if accumulating:
                raise ValueError(AVERAGE_AFTER_MULTISTEPS.format(name=name))
            if index != len(chain) - 1:
                raise ValueError(AVERAGE_NOT_LAST.format(name=name, index=index, length=len(chain)))
        accumulating = accumulating or bool(multisteps_in(element))


def averages_in(state: Any) -> list[Any]:
    """The averages ``state`` keeps: its :class:`AverageState` s and lookahead :class:`SlowState` s."""
    return [x for x in jax.tree.leaves(state, is_leaf=is_average) if is_average(x)]


def keeps_average(state: Any) -> bool:
    """Whether the optimizer state keeps averaged parameters (:func:`averaged` reads them)."""
    return len(averages_in(state)) == 1


def averaged(state: Any, model: Any) -> Any:
    """``model`` with the averaged parameters that the optimizer state keeps.

    The average comes from an :func:`ema` or :func:`uniform_average` (``Optimizer(tx,
    average=...)`` or chained), or the slow weights of an :func:`ft.optim.lookahead`.
    Parameters without an average (frozen by ``Optimizer(wrt=)``, or in another group of
    ``ft.optim.groups`` than the one whose optimizer averages) and non-parameters
    (BatchNorm statistics) are the model's; averages are cast to the parameters' dtypes.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> opt = ft.optim.Optimizer(ft.optim.adam(1e-2), average=ft.optim.ema(0.99))
      >>> state = opt.init(model)
      >>> ft.optim.averaged(state, model).weight.shape    # before any step: the model
      (2, 1)
    """
    # Donated by a step (a deleted array): say so, not JAX at the first use of the result.
    check_stale([("state", state), ("model", model)], "ft.optim.averaged(state, model)")
    found = averages_in(state)
    if not found:
        raise ValueError(NO_AVERAGE)
    if len(found) > 1:
        raise ValueError(TWO_AVERAGES.format(count=len(found)))
    node = found[0]
    average = node.average if isinstance(node, AverageState) else node.slow
    # Leaf by leaf, not by tree structure: the model may be in another mode (a static
    # flag) than the one the state was made for. An average kept by one group of
    # ft.optim.groups (ASGD's, an ema chained in it) holds an optax.MaskedNode, no leaf, at
    # the other groups' parameters: they have no average (the model's, as torch's ASGD keeps
    # ``ax`` for its own parameters only), and counted as no leaf the averages did not fit.
    averages = [None if isinstance(a, optax.MaskedNode) else a
                for a in jax.tree.leaves(average, is_leaf=is_slot)]
    leaves, treedef = jax.tree.flatten(model, is_leaf=is_none)
    if len(averages) != len(leaves) or any(
            a is not None and jnp.shape(a) != jnp.shape(m) for a, m in zip(averages, leaves)):
        raise ValueError(OTHER_MODEL)
    return treedef.unflatten([m if a is None else a.astype(jnp.result_type(m)) for a, m in zip(averages, leaves)])
