"""Lookahead with the slow weights in the optimizer state, the fast weights in the model.

``optax.lookahead`` wants its parameters wrapped, ``LookaheadParams(fast, slow)``, and
returns updates of both. A functree model is the fast weights alone, so
``ft.optim.lookahead`` keeps the slow weights in its state and runs optax's numerics on
``LookaheadParams(model's parameter view, state.slow)``: the fast half of the updates
moves the model, the slow half moves ``state.slow``. Every ``k`` fast steps::

    slow ← slow + α (fast − slow);   fast ← slow

``ft.optim.Optimizer(optax.lookahead(...))`` is rebuilt as ``ft.optim.lookahead(...)``
(the same arguments), so the optax spelling works through the Optimizer and the Trainer.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import optax

from functree._tree import is_none, register_record
from functree.optim._hyper import HyperState

__all__ = ["SlowState", "lookahead", "from_optax"]

NEEDS_PARAMS = """\
ft.optim.lookahead moves the slow weights towards the parameters, so update needs them: \
pass the model.

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)
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
        inner = optax.lookahead(fast, sync_period, slow_step_size, reset_state)
        return SlowState(inner.init(optax.LookaheadParams(params, params)), params)

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


def from_optax(transform: Any) -> Any:
    """``transform`` itself, or, for an ``optax.lookahead(...)``, the same lookahead as
    :func:`lookahead` (which takes the model's parameters as they are)."""
    update = getattr(transform, "update", None)
    if getattr(update, "__qualname__", None) != _OPTAX_UPDATE or not str(
            getattr(update, "__module__", "")).startswith("optax"):
        return transform
    env = inspect.getclosurevars(update).nonlocals  # type: ignore[arg-type]
    try:
        return lookahead(env["fast_optimizer"], env["sync_period"], env["slow_step_size"], env["reset_state"])
    except KeyError:
        raise TypeError(OPAQUE_LOOKAHEAD) from None
