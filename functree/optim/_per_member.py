"""Per-tensor statistics on an ``ft.nn.Stack``: one per member, or one per stacked leaf.

An ``ft.nn.Stack`` of ``n`` blocks holds each parameter of its blocks as one leaf of shape
``(n, ...)``. An elementwise transform (Adam, SGD, Lion) updates it exactly as it updates
the ``n`` blocks unrolled; a transform that computes a statistic per tensor sees one tensor
spanning all members instead of ``n``: LAMB's and LARS' trust ratio ``‖w‖ / ‖u‖``,
Adafactor's update clipping, parameter scale and factoring, ``optax.clip_by_block_rms``'s
``u / max(1, rms(u) / t)``, Muon's orthogonalisation of each matrix.

:func:`per_member` runs a transform on the expanded view, every stack a tuple of its
members (:func:`functree._stacked.expand`): each member is its own tensor, exactly as the
blocks unrolled, while a global statistic (``clip_by_global_norm``) stays global. The
updates and the state come back stacked: each subtree of the state shaped like the
parameters (moments, Adafactor's factored rows, one norm per tensor) holds one leaf
``(n, ...)`` per stacked leaf, so one key path (``blocks.layers.up.weight``) reads the
parameters, the gradients and the moments, and checkpoints and sharding rules see stacked
leaves. :func:`whole_stack` keeps optax's reading (one statistic per stacked leaf) and says
so: ``ft.optim.Optimizer`` refuses a known per-tensor transform on a Stack wrapped in
neither (:mod:`functree.optim._per_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from functree._stacked import expand, is_stacked, members_like, outermost, restack
from functree.optim._checks import named_structure_errors

__all__ = ["per_member", "whole_stack", "PerMemberState", "WholeStackState", "STACK_CHOICE", "ENSEMBLE_MEMBERS",
           "MASK_INSIDE"]

STACK_CHOICE = "__ft_stack_statistics__"
"""The attribute :func:`per_member` and :func:`whole_stack` set on their ``update``
(``"per_member"``, ``"whole_stack"``): the refusal's walk over a transform stops there."""

ENSEMBLE_MEMBERS = """\
ft.optim.per_member: the ft.nn.Stack {path!r} ({n} members) has a leaf {leaf!r} of shape \
{shape}, with leading axes before the member axis: a batch of models (an ensemble made with \
jax.vmap), whose members per_member cannot tell from the batch axes. Run the optimizer inside \
jax.vmap over the ensemble, one model at a time:

    wrong:  state = opt.init(ensemble)
    right:  state = jax.vmap(opt.init)(ensemble)
            ensemble, state, loss = jax.vmap(lambda m, s: opt.minimize(loss_fn, m, s, x, y))(ensemble, state)"""


MASK_INSIDE = """\
The transform inside ft.optim.per_member refused the parameters' structure: inside, every \
ft.nn.Stack is a tuple of its members (blocks.0, blocks.1, ...), so a mask or label tree made \
from the stacked model (ft.mask(model, ...), a tree for optax.masked, adamw(mask=...) or \
multi_transform) does not fit it. Put the mask outside per_member (member patterns work there), \
or give a function of the parameters, which gets the members' view (JAX's error is below):

    wrong:  ft.optim.per_member(optax.masked(tx, ft.mask(model, "blocks.*")))
    right:  ft.optim.masked(ft.optim.per_member(tx), ft.mask(model, "blocks.*"))
       or:  ft.optim.per_member(optax.masked(tx, lambda params: ft.mask(params, "blocks.*")))

JAX: {error}"""


class PerMemberState(NamedTuple):
    """State of :func:`per_member`: the wrapped transform's, every subtree shaped like the
    parameters stacked as they are (``inner.mu.blocks.layers.up.weight``: ``(n, ...)``)."""

    inner: Any


class WholeStackState(NamedTuple):
    """State of :func:`whole_stack`: the wrapped transform's, as it is."""

    inner: Any


def _is_stack(x: Any) -> bool:
    return is_stacked(x)


def _has_stack(tree: Any) -> bool:
    """Whether ``tree`` holds an ``ft.nn.Stack`` (a walk over its nodes, no array touched)."""
    return any(is_stacked(x) for x in jax.tree.leaves(tree, is_leaf=_is_stack))


def _refuse_ensembles(tree: Any) -> None:
    """:data:`ENSEMBLE_MEMBERS` for a stack whose leaves have axes before the member axis."""
    for name, stack in outermost(tree):
        bad = stack._batched_leaf() if hasattr(stack, "_batched_leaf") else None
        if bad is not None:
            leaf, shape, _ = bad
            raise ValueError(ENSEMBLE_MEMBERS.format(path=name or "<root>", n=len(stack),
                                                     leaf=f"{name}.layers.{leaf}" if name else f"layers.{leaf}",
                                                     shape=shape))


def _mirrors(expanded: Any) -> Callable[[Any], bool]:
    """Whether a node is shaped like ``expanded`` (the parameters with every stack a tuple of
    members) down to its leaves, each leaf standing for any subtree (an ``is_leaf``)."""
    treedef = jax.tree.structure(expanded)
    kind = type(expanded)

    def mirrors(x: Any) -> bool:
        if type(x) is not kind:  # most nodes: no flatten tried
            return False
        try:
            treedef.flatten_up_to(x)
        except (ValueError, TypeError):
            return False
        return True

    return mirrors


def _restacked(state: Any, template: Any, expanded: Any) -> Any:
    """``state`` with every subtree shaped like ``expanded`` (``template`` expanded)
    stacked like ``template``; the rest (counts, hyperparameters) as it is."""
    mirrors = _mirrors(expanded)
    return jax.tree.map(lambda x: restack(template, x) if mirrors(x) else x, state, is_leaf=mirrors)


def _expanded_state(state: Any, template: Any) -> Any:
    """Inverse of :func:`_restacked`: every subtree shaped like ``template`` (stacks kept)
    with its stacks as member tuples."""
    mirrors = _mirrors(template)
    return jax.tree.map(lambda x: members_like(template, x) if mirrors(x) else x, state, is_leaf=mirrors)


def _expanded_extras(extra: dict[str, Any], updates: Any) -> dict[str, Any]:
    """Optax's extra arguments for the expanded view: a tree shaped like the updates
    (L-BFGS' ``grad``) expanded, ``value_fn`` given the parameters stacked again."""
    treedef = jax.tree.structure(updates)
    out = {}
    for name, value in extra.items():
        if name == "value_fn" and callable(value):
            out[name] = lambda params, *args, _fn=value, **kwargs: _fn(restack(updates, params), *args, **kwargs)
        elif jax.tree.structure(value) == treedef:
            out[name] = expand(value)
        else:
            out[name] = value
    return out


def per_member(transform: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``transform`` with each member of every ``ft.nn.Stack`` its own tensor, as the blocks unrolled.

    ``init`` and ``update`` run ``transform`` on the parameters and updates with every
    stack replaced by the tuple of its members, so a per-tensor statistic (LAMB's and LARS'
    trust ratio ``‖w_i‖ / ‖u_i‖``, Adafactor's ``rms(u_i)`` clipping and factoring,
    ``optax.clip_by_block_rms``, Muon's orthogonalisation) is member ``i``'s alone: ``n``
    steps on a Stack give the numbers of the same steps on ``stack.unstack()``. A global
    statistic (``optax.clip_by_global_norm``) stays one over all parameters. The updates
    come back stacked, and so does the state (:class:`PerMemberState`): each subtree of it
    shaped like the parameters has one leaf ``(n, ...)`` per stacked leaf; counts and
    hyperparameters are kept as they are.

    Inside, ``transform`` sees each member as a parameter of its own, named
    ``blocks.3.up.weight``: a mask or label *function* (``optax.masked(tx, fn)``) is given
    that view; to mask by the stacked model's names, put the mask outside
    (``ft.optim.masked(ft.optim.per_member(tx), ft.mask(params, "blocks.*"))``, member
    patterns included); a mask tree of the stacked model inside is refused (:data:`MASK_INSIDE`). Parameters without a Stack go to ``transform`` as they are (no
    cost). A batch of models made with ``jax.vmap`` is trained inside ``jax.vmap`` over the
    ensemble (refused outside: :data:`ENSEMBLE_MEMBERS`). Extra arguments pass through.

    Cost: the expanded update holds one copy of the transform's arithmetic per member, so
    it compiles like the unrolled model's; the model's forward and backward pass stay one
    scanned block.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, optax
      >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, jnp.tanh, key=k), 3, key=jax.random.key(0))
      >>> opt = ft.optim.Optimizer(ft.optim.per_member(optax.lamb(1e-2)))
      >>> state = opt.init(stack)
      >>> state.inner.inner[0].mu.layers.weight.shape     # Adam's moment, stacked as the parameters
      (3, 4, 4)
      >>> loss_fn, x = lambda m, x: jnp.sum(m(x) ** 2), jnp.ones((2, 4))
      >>> trained, state, _ = opt.minimize(loss_fn, stack, state, x)
      >>> plain, unrolled = ft.optim.Optimizer(optax.lamb(1e-2)), stack.unstack()   # the blocks unrolled
      >>> unrolled, _, _ = plain.minimize(loss_fn, unrolled, plain.init(unrolled), x)
      >>> bool(jnp.allclose(trained.layers.weight[2], unrolled.layers[2].weight, rtol=0, atol=1e-6))
      True
    """
    inner = optax.with_extra_args_support(transform)

    def init(params: Any) -> PerMemberState:
        if not _has_stack(params):
            return PerMemberState(inner.init(params))
        _refuse_ensembles(params)
        expanded = expand(params)
        with named_structure_errors(MASK_INSIDE):  # a mask of the stacked model inside
            state = inner.init(expanded)
        return PerMemberState(_restacked(state, params, expanded))

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, PerMemberState]:
        if not _has_stack(updates):
            new, inner_state = inner.update(updates, state.inner, params, **extra)
            return new, PerMemberState(inner_state)
        _refuse_ensembles(updates)
        expanded = expand(updates)
        expanded_params = None if params is None else expand(params)
        # The state mirrors what init was given: the parameters (a None gradient's moment is
        # an array), or the updates where none are passed.
        template, view = (updates, expanded) if params is None else (params, expanded_params)
        with named_structure_errors(MASK_INSIDE):  # a mask of the stacked model inside
            new, inner_state = inner.update(expanded, _expanded_state(state.inner, template), expanded_params,
                                            **_expanded_extras(extra, updates))
        return restack(updates, new), PerMemberState(_restacked(inner_state, template, view))

    setattr(update, STACK_CHOICE, "per_member")
    return optax.GradientTransformationExtraArgs(init, update)


def whole_stack(transform: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``transform`` as it is, a per-tensor statistic taken over each stacked leaf on purpose.

    optax sees a leaf of an ``ft.nn.Stack`` (``(n, ...)``) as one tensor: LAMB's trust ratio
    or Adafactor's clipping over all ``n`` members together, which is not what the blocks
    unrolled compute. ``ft.optim.Optimizer`` refuses such a transform on a Stack
    (:data:`~functree.optim._per_tensor.PER_TENSOR_ON_STACK`); this wrapper says the
    whole-stack statistic is meant (or that the transform never reaches the Stack's
    leaves), and changes no number. :func:`per_member` gives each member its own.

    Example:
      >>> import functree as ft, jax, optax
      >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, key=k), 3, key=jax.random.key(0))
      >>> opt = ft.optim.Optimizer(ft.optim.whole_stack(optax.lamb(1e-2)))
      >>> type(opt.init(stack).inner).__name__
      'WholeStackState'
    """
    inner = optax.with_extra_args_support(transform)

    def init(params: Any) -> WholeStackState:
        return WholeStackState(inner.init(params))

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, WholeStackState]:
        new, inner_state = inner.update(updates, state.inner, params, **extra)
        return new, WholeStackState(inner_state)

    setattr(update, STACK_CHOICE, "whole_stack")
    return optax.GradientTransformationExtraArgs(init, update)
