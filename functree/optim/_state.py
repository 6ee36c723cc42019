"""``OptimizerState``: the one state of an :class:`ft.optim.Optimizer`.

An optimizer's state holds the :class:`LearningContext` once, next to the state of the
optax transformation doing the numerics::

    OptimizerState(context=LearningContext(step, sweep, samples_seen, minibatch_size, loss),
                   inner=<the transform's state: hyperparameters, moments, ...>)

Every functree transform inside reads the context from the optax extra argument
``context=`` that the optimizer passes to ``update``; their own ``HyperState`` then holds
no context (``context=None``). A functree transform used on its own, as a plain optax
``GradientTransformation``, keeps and advances a context of its own instead.

The context advances by one rule, in :meth:`Optimizer.update`: by one step and the
minibatch's samples when the update is applied, not at all when it is skipped (a
non-finite step under ``skip_non_finite``, a loss-scale overflow, ``on_nan="skip"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax

from functree._flat import PENDING
from functree._repr import shown_repr
from functree._tree import register_record
from functree.optim._checks import release_contexts
from functree.optim._context import LearningContext, widen_counters
from functree.optim._skip import SkipState

__all__ = ["OptimizerState", "release_contexts", "upgrade_state", "OPTAX_STATE_FIELD"]

OPTAX_STATE_FIELD = """\
'OptimizerState' object has no attribute {name!r}{holder}. An ft.optim.Optimizer's state \
is the learning context and, in .inner, the optax transformation's state (of the \
parameter view: None at non-parameters). Give optax's state readers .inner and the \
parameter view, and put the result into the model:

    wrong:  optax.contrib.schedule_free_eval_params(opt_state, model)
    right:  params = optax.contrib.schedule_free_eval_params(opt_state.inner, ft.parameters(model))
            eval_model = ft.with_parameters(model, params)
       or:  optax.tree_utils.tree_get(opt_state, {name!r})      # a field by name, at any depth
"""


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """The state of an :class:`ft.optim.Optimizer`: one learning context and the transform's state.

    Attributes:
      context: the :class:`LearningContext` (read it with :func:`ft.optim.context`).
      inner: the optax transformation's state. Per-parameter moments in it have the
        model's parameter-view structure (read them with :func:`ft.optim.moments`);
        hyperparameters live in its ``HyperState`` nodes (:func:`ft.optim.hyperparameters`).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.Optimizer(ft.optim.adam(1e-3)).init({"w": jnp.ones(2)})
      >>> type(state).__name__, ft.optim.context(state).step
      ('OptimizerState', Array(0, dtype=int32))
    """

    context: LearningContext
    inner: Any

    # A step's result is rebuilt with both fields pending (functree._flat): a training loop
    # passes the state back by its leaves and never builds the context or the moment
    # trees; the first read of either (by name, by jax.tree, pickle, repr ...) builds both.
    __ft_lazy__: ClassVar[tuple[str, ...]] = ("context", "inner")

    def __getattr__(self, name: str) -> Any:  # only for a field not yet in the instance dict
        d = self.__dict__
        pending = d.get(PENDING)
        if pending is None:
            inner = d.get("inner")
            if name.startswith("_") or inner is None:  # Python's and libraries' probes (copy, pickle)
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            holder = f"; its .inner, a {type(inner).__name__}, has {name!r}" if hasattr(inner, name) else ""
            raise AttributeError(OPTAX_STATE_FIELD.format(name=name, holder=holder))
        parts, leaves = pending
        for field, build in parts:
            d[field] = build(leaves)
        # Dropped only now: a read from another thread meanwhile builds them again (the
        # same leaves) instead of finding neither the fields nor the pending entry.
        d.pop(PENDING, None)
        return getattr(self, name)

    def __getstate__(self) -> dict[str, Any]:
        self.inner  # noqa: B018 (built, if it was pending)
        return self.__dict__

    def replace(self, **changes: Any) -> OptimizerState:
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        # The dataclass's, but an array a step donated is shown as <deleted f32[4,4]>
        # (shown_repr): JAX's own repr of it raised "Array has been deleted".
        return f"{type(self).__name__}(context={self.context!r}, inner={shown_repr(self.inner)})"


register_record(OptimizerState, ["context", "inner"])


UPGRADE_MISMATCH = """\
ft.optim.upgrade_state: the old state does not fit {optimizer}: {detail}.
Give the optimizer (same transforms, same order) and the model the old state was made for:

    right:  state = ft.optim.upgrade_state(old_state, optimizer, model)
"""

NO_OLD_CONTEXT = """\
ft.optim.upgrade_state: the old state holds no ft.optim.LearningContext, so it was not \
made by a functree optimizer; build a new one with optimizer.init(model).
"""


class ContextState(NamedTuple):
    """The state layout before the one-context redesign, for plain optax transforms (read
    from old checkpoints only; :func:`upgrade_state` converts it)."""

    context: LearningContext
    inner: Any


def _is_context(x: Any) -> bool:
    return isinstance(x, LearningContext)


def _legacy_nodes(x: Any) -> Any:
    """Old states' nodes as the new ones: optax's ``ApplyIfFiniteState`` (the old
    ``skip_non_finite``) becomes a ``SkipState`` with the same counts."""
    fields = getattr(x, "_fields", None) if isinstance(x, tuple) else None
    if fields == ("notfinite_count", "last_finite", "total_notfinite", "inner_state"):
        consecutive, last_finite, total, inner = x  # optax.ApplyIfFiniteState, by position
        return SkipState(total, consecutive, last_finite, inner)
    return x


def upgrade_state(old_state: Any, optimizer: Any, model: Any) -> Any:
    """An optimizer state saved by functree before the one-context redesign, as today's state.

    Old states kept a learning context in every functree transform (and wrapped plain
    optax transforms in a ``ContextState``). The new state keeps the first of those
    contexts once; every other value (hyperparameters, moments, counts, loss scale) is
    carried over in order, checked against ``optimizer.init(model)``'s shapes and dtypes.
    A context of four counters (saved before samples_seen took two int32 words) is widened.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> from functree.optim._hyper import HyperState
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1, momentum=0.9))
      >>> w = {"w": jnp.ones(2)}
      >>> new = opt.init(w)
      >>> old = new.inner.replace(context=new.context.replace(step=7))   # the old layout
      >>> int(ft.optim.context(ft.optim.upgrade_state(old, opt, w)).step)
      7
    """
    contexts = [x for x in jax.tree.leaves(old_state, is_leaf=_is_context) if _is_context(x)]
    if not contexts:
        raise ValueError(NO_OLD_CONTEXT)
    template = optimizer.init(model)
    def strip(tree: Any) -> Any:  # contexts out, legacy nodes converted (and their insides)
        def one(x: Any) -> Any:
            return None if _is_context(x) else strip(_legacy_nodes(x)) if _legacy_nodes(x) is not x else x

        return jax.tree.map(one, tree, is_leaf=lambda x: _is_context(x) or _legacy_nodes(x) is not x)

    old_leaves = jax.tree.leaves(strip(old_state))
    new_leaves, treedef = jax.tree.flatten(strip(template))
    if len(old_leaves) != len(new_leaves):
        raise ValueError(UPGRADE_MISMATCH.format(
            optimizer=optimizer, detail=f"{len(old_leaves)} arrays besides the contexts, expected {len(new_leaves)}"))
    for i, (o, n) in enumerate(zip(old_leaves, new_leaves)):
        if jax.numpy.shape(o) != jax.numpy.shape(n) or jax.numpy.result_type(o) != jax.numpy.result_type(n):
            raise ValueError(UPGRADE_MISMATCH.format(
                optimizer=optimizer,
                detail=f"array {i} has shape {jax.numpy.shape(o)} {jax.numpy.result_type(o)}, expected "
                       f"{jax.numpy.shape(n)} {jax.numpy.result_type(n)}"))
    rebuilt = treedef.unflatten([jax.numpy.asarray(o) for o in old_leaves])
    ctx = contexts[0]
    counters = widen_counters(ctx.counters)  # four counters: saved before samples_seen's high word
    ctx = ctx if counters is ctx.counters else LearningContext(counters, ctx.loss)
    return jax.tree.map(lambda x: x.replace(context=ctx) if isinstance(x, OptimizerState) else x, rebuilt,
                        is_leaf=lambda x: isinstance(x, OptimizerState))
