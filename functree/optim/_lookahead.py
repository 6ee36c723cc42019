"""Lookahead with the slow weights in the optimizer state, the fast weights in the model.

``optax.lookahead`` wants its parameters wrapped, ``LookaheadParams(fast, slow)``, and
returns updates of both. A functree model is the fast weights alone, so
``ft.optim.lookahead`` keeps the slow weights in its state and runs optax's numerics on
``LookaheadParams(model's parameter view, state.slow)``: the fast half of the updates
moves the model, the slow half moves ``state.slow``. Every ``k`` fast steps::

    slow ← slow + α (fast − slow);   fast ← slow

``ft.optim.Optimizer(optax.lookahead(...))`` is rebuilt as ``ft.optim.lookahead(...)``
(the same arguments), so the optax spelling works through the Optimizer and the Trainer.
Two uses of optax's own model would train silently wrong and are refused, naming
``ft.optim.lookahead``: an ``optax.LookaheadParams(fast, slow)`` model (its slow half
would never move) and a raw ``optax.lookahead`` nested inside another transform (an
``optax.chain``), which would get the parameters without its ``LookaheadParams``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import optax

from functree._tree import is_none, register_record
from functree.optim._hyper import HyperState
from functree.optim._multisteps import multisteps_in

__all__ = ["SlowState", "lookahead", "from_optax"]

NEEDS_PARAMS = """\
ft.optim.lookahead moves the slow weights towards the parameters, so update needs them: \
pass the model.

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)
"""

LOOKAHEAD_MULTISTEPS = """\
ft.optim.lookahead counts sync_period in calls of its fast optimizer, but the fast optimizer \
holds an optax.MultiSteps, whose calls between its updates only sum gradients: the slow \
weights would sync every sync_period minibatches, not every sync_period updates (and move \
towards weights that did not change). Accumulate around the lookahead instead:

    wrong:  ft.optim.Optimizer(ft.optim.lookahead(optax.MultiSteps(tx, k), sync_period=5, slow_step_size=0.5))
    right:  ft.optim.Optimizer(ft.optim.lookahead(tx, sync_period=5, slow_step_size=0.5), accumulate=k)"""

LOOKAHEAD_PARAMS_MODEL = """\
ft.optim.lookahead (which ft.optim.Optimizer runs for optax.lookahead) keeps the slow \
weights in the optimizer state: the model is the fast weights alone. Given an \
optax.LookaheadParams(fast, slow) model, its slow half would never move. Give the fast \
weights; ft.optim.averaged(state, model) is the model with the slow ones:

    wrong:  model = optax.LookaheadParams.init_synced(params);  loss_fn = lambda m, x: f(m.fast, x)
    right:  model = params;                                      loss_fn = lambda m, x: f(m, x)
            opt = ft.optim.Optimizer(ft.optim.lookahead(optax.adam(1e-3), sync_period=5, slow_step_size=0.5))
"""

NESTED_LOOKAHEAD = """\
An optax.lookahead inside another transform (an optax.chain ...) needs \
optax.LookaheadParams(fast, slow) as its parameters; ft.optim.Optimizer gives the model's \
(the fast weights alone). Use ft.optim.lookahead in its place, which keeps the slow \
weights in the optimizer state:

    wrong:  optax.chain(optax.clip(1.0), optax.lookahead(optax.adam(1e-3), 5, 0.5))
    right:  optax.chain(optax.clip(1.0), ft.optim.lookahead(optax.adam(1e-3), 5, 0.5))
"""

OPAQUE_LOOKAHEAD = """\
This optax.lookahead cannot be read back (optax changed its closure); build it with \
functree instead, which keeps the slow weights in the optimizer state:

    wrong:  ft.optim.Optimizer(optax.lookahead(fast, sync_period=5, slow_step_size=0.5))
    right:  ft.optim.Optimizer(ft.optim.lookahead(fast, sync_period=5, slow_step_size=0.5))
"""


@dataclasses.dataclass(frozen=True)
class SlowState:
    """State of :func:`ft.optim.lookahead`.

    Attributes:
      inner: optax's ``LookaheadState`` (the fast optimizer's state, steps since sync).
      slow: the slow weights: the parameter view's structure (read them as a model with
        :func:`ft.optim.averaged`).

    Example:
      >>> import functree as ft, jax.numpy as jnp, optax
      >>> tx = ft.optim.lookahead(optax.adam(0.1), sync_period=5, slow_step_size=0.5)
      >>> tx.init({"w": jnp.zeros(2)}).slow
      {'w': Array([0., 0.], dtype=float32)}
    """

    inner: Any
    slow: Any

    def replace(self, **changes: Any) -> SlowState:
        return dataclasses.replace(self, **changes)


register_record(SlowState, ["inner", "slow"])


def _is_hyper(x: Any) -> bool:
    return isinstance(x, HyperState)


def _contexts_as(fresh: Any, current: Any) -> Any:
    """``fresh`` with each functree transform's context as in ``current`` (the Optimizer
    releases them): a reset fast state has the running state's structure."""
    return jax.tree.map(lambda f, c: f.replace(context=c.context) if _is_hyper(f) else f, fresh, current,
                        is_leaf=_is_hyper)


def _bound(fast: optax.GradientTransformationExtraArgs, current: Any, extra: dict[str, Any]) -> Any:
    """``fast`` with this step's extra arguments (the learning context) bound: optax's
    lookahead calls its fast optimizer without them."""
    def init(params: Any) -> Any:
        return _contexts_as(fast.init(params), current)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return fast.update(updates, state, params, **extra)

    return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]


def lookahead(fast_optimizer: optax.GradientTransformation, sync_period: int, slow_step_size: float,
              reset_state: bool = False) -> optax.GradientTransformationExtraArgs:
    """Lookahead (Zhang et al. 2019) over ``fast_optimizer``: optax's numerics, on plain parameters.

    ``k = sync_period`` fast steps, then ``slow ← slow + α (fast − slow)`` with
    ``α = slow_step_size``, and the fast weights restart from the slow ones
    (``reset_state=True`` also resets the fast optimizer's state). The model holds the
    fast weights; the slow weights live in the state (:class:`SlowState`), and
    :func:`ft.optim.averaged` gives the model with them (the weights to evaluate).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.lookahead(ft.optim.sgd(1.0), sync_period=2, slow_step_size=0.5))
      >>> w = {"w": jnp.zeros(())}
      >>> state = opt.init(w)
      >>> for _ in range(2):     # fast: 1, 2; then slow = 0 + 0.5 (2 - 0) and fast = slow
      ...     w, state, _ = opt.minimize(lambda p: -p["w"], w, state)
      >>> w["w"], ft.optim.averaged(state, w)["w"]
      (Array(1., dtype=float32), Array(1., dtype=float32))
    """
    optax.lookahead(fast_optimizer, sync_period, slow_step_size)  # optax's argument checks
    fast = optax.with_extra_args_support(fast_optimizer)

    def init(params: Any) -> SlowState:
        if isinstance(params, optax.LookaheadParams):
            raise ValueError(LOOKAHEAD_PARAMS_MODEL)
        inner = optax.lookahead(fast, sync_period, slow_step_size, reset_state)
        state: Any = inner.init(optax.LookaheadParams(params, params))
        if multisteps_in(state.fast_state):
            raise ValueError(LOOKAHEAD_MULTISTEPS)
        return SlowState(state, params)

    def update(updates: Any, state: SlowState, params: Any = None, **extra: Any) -> tuple[Any, SlowState]:
        if params is None:
            raise ValueError(NEEDS_PARAMS)
        inner = optax.lookahead(_bound(fast, state.inner.fast_state, extra), sync_period, slow_step_size,
                                reset_state)
        both: Any
        both, new_inner = inner.update(updates, state.inner, optax.LookaheadParams(params, state.slow))
        slow = jax.tree.map(lambda s, u: None if s is None else s + u, state.slow, both.slow, is_leaf=is_none)
        return both.fast, SlowState(new_inner, slow)

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


_OPTAX_UPDATE = "lookahead.<locals>.update_fn"


def _is_optax_lookahead(update: Any) -> bool:
    return getattr(update, "__qualname__", None) == _OPTAX_UPDATE and str(
        getattr(update, "__module__", "")).startswith("optax")


def _functions(value: Any) -> list[Any]:
    """The functions a closure cell holds: itself, a transformation's update, the items
    of a tuple, list or dict (optax.chain keeps its update functions in a tuple)."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "update"):
        return [f for v in value for f in _functions(v)]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _functions(v)]
    update = getattr(value, "update", None)
    if callable(update) and hasattr(value, "init"):
        return [update]
    return [value] if hasattr(value, "__code__") else []


def _has_nested_lookahead(update: Any, seen: set[int], depth: int = 0) -> bool:
    """Whether ``update`` reaches a raw ``optax.lookahead`` update through closures (at
    construction only: a bounded walk over closure cells)."""
    if depth > 16 or id(update) in seen:
        return False
    seen.add(id(update))
    if depth > 0 and _is_optax_lookahead(update):
        return True
    for cell in getattr(update, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if any(_has_nested_lookahead(f, seen, depth + 1) for f in _functions(value)):
            return True
    return False


def from_optax(transform: Any) -> Any:
    """``transform`` itself, or, for an ``optax.lookahead(...)``, the same lookahead as
    :func:`lookahead` (which takes the model's parameters as they are). A raw
    ``optax.lookahead`` nested inside ``transform`` is refused (``NESTED_LOOKAHEAD``)."""
    update = getattr(transform, "update", None)
    if not _is_optax_lookahead(update):
        if _has_nested_lookahead(update, set()):
            raise TypeError(NESTED_LOOKAHEAD)
        return transform
    env = inspect.getclosurevars(update).nonlocals  # type: ignore[arg-type]
    try:
        return lookahead(env["fast_optimizer"], env["sync_period"], env["slow_step_size"], env["reset_state"])
    except KeyError:
        raise TypeError(OPAQUE_LOOKAHEAD) from None
