"""Gradient transformations optax lacks, or needs the learning context for (CNTK's options).

All are optax transformations taking ``minibatch_size=``/``loss=`` extra arguments; their
thresholds, weights and noise scales are hyperparameters (numbers, schedules, rates),
declared once as the ``Hyper`` arguments of their signatures (:mod:`functree.optim._signature`).
Chain them with an optimizer: ``optax.chain(ft.optim.clip_by_norm(1.0), ft.optim.adam())``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._naming import (
    broadcast,
    check_patterns,
    is_stacked,
    leaf_infos,
    refuse_split_tie,
    required_selection,
)
from functree._operators import value_with_gradient
from functree._random import flat_key
from functree._traces import staged
from functree._tree import is_array_value, is_none
from functree.nn._precision import statistics_dtype
from functree.optim._aliases import DEFAULT_NO_DECAY, decay_mask_of, exclude_patterns
from functree.optim._arguments import check_argument
from functree.optim._average import is_slot
from functree.optim._complex import RealPair, is_pair
from functree.optim._context import LearningContext
from functree.optim._hooks import CALLS_LOSS_AS_GIVEN
from functree.optim._hyper import inject
from functree.optim._masked import declare_frozen, masked
from functree.optim._signature import Hyper, optimizer

__all__ = [
    "clip",
    "clip_by_norm",
    "clip_by_global_norm",
    "clip_per_sample",
    "per_example_clipping",
    "l1_regularization",
    "l2_regularization",
    "weight_decay",
    "add_parameter_noise",
    "add_gradient_noise",
    "freeze",
    "reduce_on_plateau",
]

NEEDS_PARAMS = """\
{name} needs the parameters: pass the model to update.

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)
"""

NEEDS_LOSS = """\
ft.optim.reduce_on_plateau needs the loss of each step (it lowers the rate when the loss \
stops improving; an Optimizer step given no loss= has none):

    wrong:  updates, state = tx.update(grads, state, model)
    right:  updates, state = tx.update(grads, state, model, loss=loss)
    wrong:  model, state = opt.apply_gradients(grads, model, state)          # or opt.update(grads, state, model)
    right:  model, state = opt.apply_gradients(grads, model, state, loss=loss)
       or:  model, state, loss = opt.minimize(loss_fn, model, state, *batch)
"""


def _stateless(fn: Callable[[Any, Any], Any], name: str, needs_params: bool = False) -> optax.GradientTransformation:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if needs_params and params is None:
            raise ValueError(NEEDS_PARAMS.format(name=name))
        return fn(updates, params), state

    def init(params: Any) -> optax.EmptyState:
        return optax.EmptyState()

    return optax.GradientTransformation(init, update)


@optimizer("ft.optim.clip")
def clip(threshold: Hyper) -> optax.GradientTransformation:
    """Elementwise truncation: ``g ← clip(g, −t, t)`` (``optax.clip``).

    Through an ``ft.optim.Optimizer`` a complex parameter's real and imaginary parts are
    clipped each (torch's ``clip_grad_value_`` refuses complex gradients: "clamp is not
    supported for complex types").

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx, g = ft.optim.clip(1.0), {"w": jnp.array([-3.0, 0.5, 2.0])}
      >>> tx.update(g, tx.init(g))[0]
      {'w': Array([-1. ,  0.5,  1. ], dtype=float32)}
    """
    return optax.clip(threshold)


def _clip_tensor(g: Any, t: Any, members: int = 0) -> Any:
    """``g · min(1, t / ‖g‖₂)``, the norm over the trailing axes of one member: a stacked
    leaf's ``members`` leading axes (an ``ft.nn.Stack``'s layer axis) are not reduced. A
    complex parameter is one tensor: its :class:`RealPair`'s parts (inside an
    ``ft.optim.Optimizer``) or its complex elements share one norm, ``√Σ|g|²``, as torch's
    ``clip_grad_norm_`` takes it. The norm is summed in float32 at least (a bfloat16
    gradient's), in float64 for a float64 gradient."""
    parts = tuple(g) if is_pair(g) else (g,)
    axes = tuple(range(min(members, jnp.ndim(parts[0])), jnp.ndim(parts[0])))
    square = sum(jnp.sum(_abs_squared(x), axis=axes, keepdims=True) for x in parts)
    norm = jnp.sqrt(square)
    factor = jnp.minimum(1.0, t / jnp.maximum(norm, 1e-30))
    clipped = tuple((x * factor.astype(jnp.finfo(x.dtype).dtype)).astype(x.dtype) for x in parts)
    return RealPair(*clipped) if is_pair(g) else clipped[0]


def _abs_squared(x: Any) -> Any:
    """``|x|²`` elementwise, in ``x``'s real dtype (float32 at least)."""
    real = jnp.dtype(jnp.finfo(x.dtype).dtype)
    wide = real if real.itemsize >= 4 else jnp.dtype(jnp.float32)  # (promote_types refuses float64 under strict)
    if jnp.iscomplexobj(x):
        return jnp.square(x.real.astype(wide)) + jnp.square(x.imag.astype(wide))
    return jnp.square(x.astype(wide))


def _per_tensor(fn: Callable[[Any, int], Any], tree: Any) -> Any:
    """``fn(leaf, members)`` on each array leaf of ``tree``, ``members`` the count of its
    leading stack axes: a leaf of an ``ft.nn.Stack`` holds one tensor per member (the
    blocks unrolled are separate parameters), each clipped by its own norm. A leaf with
    more leading axes than its stack's (a batch of models made with ``jax.vmap``) keeps
    one tensor per model and member: only the trailing axes of one member are reduced.
    A :class:`RealPair` (a complex parameter inside an ``ft.optim.Optimizer``) is one
    leaf: ``fn`` gets the pair."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: is_none(x) or is_pair(x))
    if not any(is_stacked(x) for x in jax.tree.leaves(tree, is_leaf=is_stacked)):
        return treedef.unflatten([None if x is None else fn(x, 0) for x in leaves])
    infos = iter(leaf_infos(tree))  # a pair's two parts have two infos, of one stacked leaf
    out = []
    for x in leaves:
        if x is None:
            next(infos)
            out.append(None)
            continue
        info = next(infos)
        if is_pair(x):
            next(infos)
        stacks, rank = len(info.sizes), jnp.ndim(x.real if is_pair(x) else x)
        member_rank = rank - stacks if info.ndim is None else info.ndim - stacks
        out.append(fn(x, rank - member_rank if stacks else 0))
    return treedef.unflatten(out)


@optimizer("ft.optim.clip_by_norm")
def clip_by_norm(threshold: Hyper) -> optax.GradientTransformation:
    """Per-tensor norm clipping: ``g ← g · min(1, t / ‖g‖₂)`` for each parameter separately.

    A leaf of an ``ft.nn.Stack`` holds one parameter per member: each member's tensor is
    clipped by its own norm, as the blocks unrolled (``stack.unstack()``) would be. A
    complex parameter's norm is ``√Σ|g|²`` over its elements (real and imaginary parts
    together, as torch's ``clip_grad_norm_([p], t)``, whose ``+ 1e-6`` is as in
    :func:`clip_by_global_norm`).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.clip_by_norm(1.0)
      >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.3, 0.4])}
      >>> tx.update(g, tx.init(g))[0]
      {'a': Array([0.6, 0.8], dtype=float32), 'b': Array([0.3, 0.4], dtype=float32)}
    """
    return _stateless(lambda g, _: _per_tensor(lambda x, members: _clip_tensor(x, threshold, members), g),
                      "clip_by_norm")


BAD_NORM_TYPE = """\
ft.optim.clip_by_global_norm: norm_type must be a positive number or float("inf") (torch's \
clip_grad_norm_(norm_type=)), got {given!r}.

    wrong:  ft.optim.clip_by_global_norm(1.0, norm_type={given!r})
    right:  ft.optim.clip_by_global_norm(1.0, norm_type=float("inf"))     # the largest |g|; 2.0: the 2-norm
"""


def _norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float in ``(0, inf]`` (torch's string ``"inf"`` too), else
    :data:`BAD_NORM_TYPE` (NaN, 0: no norm; a bool is no number)."""
    try:
        p = float(norm_type) if isinstance(norm_type, (int, float, str)) and not isinstance(norm_type, bool) else 0.0
    except ValueError:
        p = 0.0
    if not p > 0:
        raise ValueError(BAD_NORM_TYPE.format(given=norm_type))
    return p


def _check_norm_type(norm_type: Any) -> None:
    _norm_type(norm_type)


@optimizer("ft.optim.clip_by_global_norm", check=_check_norm_type)
def clip_by_global_norm(threshold: Hyper, *, norm_type: float = 2.0) -> optax.GradientTransformation:
    """Global norm clipping: ``g ← g · min(1, t / ‖g‖)`` over all parameters (optax).

    ``‖g‖`` is the 2-norm of all leaves together, so every tensor is scaled by one factor;
    ``norm_type=p`` takes the p-norm ``(Σ |g|^p)^(1/p)`` instead, and ``float("inf")`` the
    largest ``|g|`` (torch's ``clip_grad_norm_(params, t, norm_type=p)``; the norm is
    taken in float32 at least; torch's string ``"inf"`` is taken too). torch's ``clip_grad_norm_(params, t)`` scales by
    ``t / (‖g‖ + 1e-6)``: its clipped gradients are ``‖g‖ / (‖g‖ + 1e-6)`` times these
    (1e-6 smaller, relatively, at ``‖g‖ = 1``); a gradient within the threshold is
    unchanged by both. A non-finite gradient makes every gradient 0 or NaN, as torch's
    (whose ``error_if_nonfinite=True`` raises): skip such steps with
    :func:`ft.optim.skip_non_finite` or a :class:`LossScaleOptimizer`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.clip_by_global_norm(1.0)
      >>> g = {"a": jnp.array([3.0]), "b": jnp.array([4.0])}     # global norm 5
      >>> tx.update(g, tx.init(g))[0]
      {'a': Array([0.6], dtype=float32), 'b': Array([0.8], dtype=float32)}
      >>> tx = ft.optim.clip_by_global_norm(1.0, norm_type=float("inf"))   # largest |g|: 4
      >>> tx.update(g, tx.init(g))[0]
      {'a': Array([0.75], dtype=float32), 'b': Array([1.], dtype=float32)}
    """
    p = _norm_type(norm_type)
    # Not optax.clip_by_global_norm for p = 2: its lax.select of a bfloat16 gradient and the
    # float32 threshold (the hyperparameter's array) raised a TypeError inside JAX.
    return _stateless(lambda g, _: _clipped_by_p_norm(g, threshold, p), "clip_by_global_norm")


def _p_norm(tree: Any, p: float) -> jax.Array:
    """``(Σ |g|^p)^(1/p)`` over every element of ``tree`` (``p = inf``: the largest
    ``|g|``), in float32 at least (float64 under x64 for float64 gradients)."""
    magnitudes = [jnp.abs(x) for x in jax.tree.leaves(tree)]
    leaves = [a.astype(jnp.promote_types(a.dtype, jnp.float32)) for a in magnitudes]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    if p == float("inf"):
        return jnp.max(jnp.stack([jnp.max(x, initial=0.0) for x in leaves]))
    total = sum(jnp.sum(x**p) for x in leaves)
    return jnp.sqrt(total) if p == 2 else jnp.asarray(total) ** (1.0 / p)  # sqrt: optax's 2-norm, bit for bit


def _clipped_by_p_norm(tree: Any, threshold: Any, p: float) -> Any:
    """``tree`` scaled by ``t / ‖tree‖_p`` where that norm exceeds ``t`` (optax's rule for the 2-norm)."""
    norm = _p_norm(tree, p)
    return jax.tree.map(lambda g: jnp.where(norm < threshold, g, g / norm.astype(g.dtype) * threshold).astype(g.dtype),
                        tree)


def clip_per_sample(threshold: Any, *, truncation: bool = True) -> optax.GradientTransformationExtraArgs:
    """CNTK's ``gradient_clipping_threshold_per_sample``: clip the *summed* gradient.

    The minibatch's summed gradient ``M ḡ`` is clipped at ``t · M`` (``M`` from the
    learning context), elementwise (``truncation=True``) or by each tensor's norm (each
    member's, in an ``ft.nn.Stack``: see :func:`clip_by_norm`); the
    result is divided by ``M`` again. Since functree gradients are means, this equals
    clipping the mean gradient at ``t``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.clip_per_sample(0.5)
      >>> g = {"w": jnp.array([0.2, 2.0])}
      >>> tx.update(g, tx.init(g), minibatch_size=10)[0]["w"]
      Array([0.2, 0.5], dtype=float32)
    """

    def factory(threshold: Any, minibatch: Any) -> Any:
        def fn(g: Any, _: Any) -> Any:
            def one(x: Any, members: int) -> Any:  # x: an array, or a complex parameter's RealPair
                parts = tuple(x) if is_pair(x) else (x,)
                totals = tuple(part * minibatch for part in parts)
                limit = threshold * minibatch
                if truncation:
                    clipped = tuple(jnp.clip(total, -limit, limit) for total in totals)
                else:
                    joint = _clip_tensor(RealPair(*totals) if is_pair(x) else totals[0], limit, members)
                    clipped = tuple(joint) if is_pair(x) else (joint,)
                out = tuple((c / minibatch).astype(part.dtype) for c, part in zip(clipped, parts))
                return RealPair(*out) if is_pair(x) else out[0]

            return _per_tensor(one, g)

        return _stateless(fn, "clip_per_sample")

    minibatch = _MinibatchSize()
    return inject("ft.optim.clip_per_sample", factory, {"threshold": threshold, "minibatch": minibatch})


class _MinibatchSize:
    """A schedule returning the context's minibatch size (internal)."""

    def __call__(self, ctx: LearningContext) -> jax.Array:
        return ctx.minibatch_size.astype(jnp.float32)


def per_example_clipping(threshold: float) -> Callable[..., Any]:
    """A ``get_gradients`` hook: clip each example's gradient to global norm ``t``, then average.

    .. math:: g = \\frac{1}{M} \\sum_i g_i \\min(1, t / \\|g_i\\|)

    Per-example gradients come from ``vmap`` over the batch's leading axis (each example
    is given to ``loss_fn`` as a batch of one). Used for differential privacy. With
    ``Optimizer(wrt=)`` the norm ``‖g_i‖`` is over the trained parameters only (the
    Optimizer passes the hook its ``wrt=``; frozen ones get no gradient), as Opacus'.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(1.0), get_gradients=ft.optim.per_example_clipping(1.0))
      >>> w = {"w": jnp.zeros(())}
      >>> x = jnp.array([1.0, 100.0])          # example gradients: -1 and -100
      >>> w, state, loss = opt.minimize(lambda p, x: -(p["w"] * x).mean(), w, opt.init(w), x)
      >>> w["w"]                               # mean of clipped: (1 + 1) / 2
      Array(1., dtype=float32)
    """
    if not threshold > 0:
        raise ValueError(f"per_example_clipping: threshold must be > 0, got {threshold!r}.")

    def get_gradients(loss_fn: Callable[..., Any], model: Any, *batch: Any, has_aux: bool = False,
                      scale: Any = None, wrt: Any = None) -> Any:
        # With wrt (the Optimizer's trained patterns): the gradients, and so each example's
        # norm, of the trained parameters only; a frozen one's would shrink the clip factor.
        wrt = 0 if wrt is None else wrt
        # With a loss scale s (LossScaleOptimizer): the gradients of s * loss_i, clipped at
        # s * t, which the optimizer divides by s: the same clip in the loss's own units.
        def scaled(m: Any, *single: Any) -> Any:
            out = loss_fn(m, *single)
            loss = out[0] if has_aux else out
            return loss * jnp.asarray(scale).astype(jnp.result_type(loss)), out

        def one(example: tuple) -> Any:
            single = jax.tree.map(lambda x: x[None], example)
            if scale is None:
                return value_with_gradient(lambda m: loss_fn(m, *single), at=model, wrt=wrt, has_aux=has_aux)
            (_, out), g = value_with_gradient(lambda m: scaled(m, *single), at=model, wrt=wrt, has_aux=True)
            return out, g

        outs, grads = jax.vmap(one)(batch)
        # |g|² in the gradient's real dtype (float32 at least): a complex gradient's imaginary
        # part counts (cast to float32 it was dropped), a float64 one's norm is float64's.
        norms = jnp.sqrt(sum(jnp.sum(_abs_squared(g), axis=tuple(range(1, g.ndim)))
                             for g in jax.tree.leaves(grads)))
        limit = threshold if scale is None else threshold * jnp.asarray(scale, jnp.float32).astype(norms.dtype)
        factor = jnp.minimum(1.0, limit / jnp.maximum(norms, 1e-30))
        mean = jax.tree.map(lambda g: _weighted_sum(factor, g) / g.shape[0], grads)
        if has_aux:
            return (jnp.mean(outs[0]), outs[1]), mean
        return jnp.mean(outs), mean

    setattr(get_gradients, CALLS_LOSS_AS_GIVEN, True)  # loss_fn(m, *example): the optimizer checks the loss
    return get_gradients


def _weighted_sum(factor: jax.Array, g: jax.Array) -> jax.Array:
    """``sum_i factor[i] g[i]`` in ``g``'s dtype, computed in the wider of the two (a complex
    gradient times real factors, a bfloat16 one summed in float32)."""
    wide = g.dtype if jnp.dtype(g.dtype).itemsize >= jnp.dtype(factor.dtype).itemsize else factor.dtype
    return jnp.tensordot(factor.astype(wide), g.astype(wide), axes=1).astype(g.dtype)


@optimizer("ft.optim.l1_regularization")
def l1_regularization(weight: Hyper) -> optax.GradientTransformation:
    """L1 penalty ``λ‖w‖₁`` added to the gradient: ``g ← g + λ sign(w)``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx, w = ft.optim.l1_regularization(0.1), {"w": jnp.array([2.0, -3.0])}
      >>> tx.update({"w": jnp.zeros(2)}, tx.init(w), w)[0]["w"]
      Array([ 0.1, -0.1], dtype=float32)
    """
    return _stateless(lambda g, p: jax.tree.map(lambda g, w: g + weight * jnp.sign(w), g, p),
                      "l1_regularization", needs_params=True)


@optimizer("ft.optim.l2_regularization")
def l2_regularization(weight: Hyper) -> optax.GradientTransformation:
    """L2 penalty ``λ/2 ‖w‖²`` added to the gradient (CNTK's ``l2_regularization_weight``): ``g ← g + λ w``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx, w = ft.optim.l2_regularization(0.1), {"w": jnp.array([2.0, -3.0])}
      >>> tx.update({"w": jnp.ones(2)}, tx.init(w), w)[0]["w"]
      Array([1.2, 0.7], dtype=float32)
    """
    return _stateless(lambda g, p: jax.tree.map(lambda g, w: g + weight * w, g, p),
                      "l2_regularization", needs_params=True)


def weight_decay(rate: Any, *, exclude: Sequence[str] = DEFAULT_NO_DECAY) -> optax.GradientTransformationExtraArgs:
    """Decoupled weight decay after the optimizer: ``u ← u − r w`` where no ``exclude`` glob matches.

    Put it after the optimizer in a chain (``r`` is the per-step shrink factor, i.e.
    ``η λ`` in AdamW's notation; give a schedule to follow the learning rate). What
    ``exclude`` names is not decayed (:func:`decay_mask`); by default the fields a layer
    declares ``ft.field(decay=False)`` (every ``ft.nn`` bias and normalisation
    scale/offset) and the leaves named ``bias`` or ``scale`` (:data:`LEAF` globs: whole
    leaf names); ``exclude=()`` decays everything.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.weight_decay(0.1)
      >>> p = {"weight": jnp.ones(1), "bias": jnp.ones(1)}
      >>> tx.update({"weight": jnp.zeros(1), "bias": jnp.zeros(1)}, tx.init(p), p)[0]
      {'bias': Array([0.], dtype=float32), 'weight': Array([-0.1], dtype=float32)}
    """
    exclude = exclude_patterns(exclude, "ft.optim.weight_decay")

    def factory(weight_decay: Any) -> Any:
        def fn(u: Any, p: Any) -> Any:
            mask = decay_mask_of(p, exclude, "ft.optim.weight_decay")
            return jax.tree.map(lambda u, w, m: _decay(u, w, m, weight_decay), u, p, mask)

        return _stateless(fn, "weight_decay", needs_params=True)

    return inject("ft.optim.weight_decay", factory, {"weight_decay": rate})


def _decay(u: Any, w: Any, m: Any, rate: Any) -> Any:
    """``u - rate * w`` where the decay mask ``m`` holds (a bool, or a member array)."""
    if isinstance(m, np.ndarray):
        return jnp.where(broadcast(m, u), u - rate * w, u)
    return u - rate * w if m else u


class NoiseState(NamedTuple):
    """The random key of a noise transformation."""

    key: jax.Array


def _split_like(key: jax.Array, tree: Any) -> tuple[jax.Array, Any]:
    leaves, treedef = jax.tree.flatten(tree)
    key, *keys = jax.random.split(key, len(leaves) + 1)
    return key, jax.tree.unflatten(treedef, keys)


@optimizer("ft.optim.add_parameter_noise")
def add_parameter_noise(std: Hyper, *, seed: int = 0) -> optax.GradientTransformation:
    """CNTK's ``gaussian_noise_injection_std_dev``: ``u ← u + 𝒩(0, σ²)``, after the update.

    Put it last in a chain; the parameters move by the update plus fresh noise each step.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx, u = ft.optim.add_parameter_noise(0.01, seed=0), {"w": jnp.zeros(1000)}
      >>> noisy, state = tx.update(u, tx.init(u))
      >>> round(float(noisy["w"].std()), 2)
      0.01
    """

    def init(params: Any) -> NoiseState:
        return NoiseState(jax.random.key(seed))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, NoiseState]:
        key, keys = _split_like(state.key, updates)
        noisy = jax.tree.map(lambda x, k: x + (std * jax.random.normal(flat_key(k), x.shape, _noise_dtype(x))).astype(x.dtype),
                             updates, keys)
        return noisy, NoiseState(key)

    return optax.GradientTransformation(init, update)


def _noise_dtype(x: Any) -> Any:
    """The dtype ``x``'s noise is drawn in: its real dtype, float32 at least (a bfloat16 leaf's
    noise rounded once; a float64 one's under x64 with float64's digits, not float32's)."""
    return statistics_dtype(jnp.finfo(x.dtype).dtype)


@optimizer("ft.optim.add_gradient_noise")
def add_gradient_noise(eta: Hyper, gamma: float = 0.55, *, seed: int = 0) -> optax.GradientTransformation:
    """Annealed Gaussian gradient noise (``optax.add_noise``): ``g ← g + 𝒩(0, η / (1 + t)^γ)``.

    ``η`` is the variance (not the standard deviation); ``t`` counts steps from 0.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx, g = ft.optim.add_gradient_noise(0.01, seed=0), {"w": jnp.zeros(10_000)}
      >>> noisy, state = tx.update(g, tx.init(g))
      >>> round(float(noisy["w"].std()), 2)        # √η at the first step
      0.1
    """
    return optax.add_noise(eta, gamma, seed)


FREEZE_SELECTS_NOTHING = """\
ft.optim.freeze: the pattern {pattern!r} matches no name in the model (no parameter's, \
nor a frozen part's or another parameter group's), so it freezes nothing. Closest names: {close}.
    wrong:  ft.optim.freeze({pattern!r})
    right:  ft.optim.freeze({right!r})"""


def freeze(*patterns: str) -> optax.GradientTransformationExtraArgs:
    """Zero the updates of parameters whose dotted names match ``patterns`` (all if none given).

    Member patterns (``"h.[0-3].*"``) zero those members of a stacked leaf only. Inside
    ``ft.optim.groups`` it freezes its own group's parameters; a pattern may name another
    group's too (one freeze list shared by the groups' optimizers), which it leaves to
    that group: to freeze across groups, chain it after ``groups(...)``. A pattern that
    matches no name at all is an error (:data:`FREEZE_SELECTS_NOTHING`).

    Example:
      >>> import functree as ft, jax.numpy as jnp, optax
      >>> tx = optax.chain(ft.optim.sgd(1.0), ft.optim.freeze("encoder.*"))
      >>> p = {"encoder": {"w": jnp.ones(1)}, "head": jnp.ones(1)}
      >>> tx.update(p, tx.init(p), p)[0]
      {'encoder': {'w': Array([0.], dtype=float32)}, 'head': Array([-1.], dtype=float32)}
    """
    # (declared frozen: a tie it leaves unchanged is no accidental alias to warn of)
    every = declare_frozen(optax.with_extra_args_support(optax.set_to_zero()), _every_leaf)
    if not patterns:
        return every
    check_patterns(patterns)
    return masked(every, lambda params: _frozen(params, patterns))


def _every_leaf(params: Any) -> list[bool]:
    return [True] * len(jax.tree.leaves(params, is_leaf=is_none))


def _frozen(params: Any, patterns: tuple[str, ...]) -> Any:
    """The freeze mask of ``params``: True (or a member array) where a pattern selects.
    Names of non-parameters and of other groups' parameters (``optax.MaskedNode`` inside
    ``groups``, as ``None`` here) count, as for adamw's ``exclude``: no typo, nothing frozen."""
    named = jax.tree.map(lambda x: None if isinstance(x, optax.MaskedNode) else x, params,
                         is_leaf=is_slot)
    leaves, treedef = jax.tree.flatten(named, is_leaf=is_none)
    chosen: list[Any] = [False] * len(leaves)
    for pattern in patterns:
        picks = required_selection(named, pattern, "ft.optim.freeze", FREEZE_SELECTS_NOTHING, "*")
        chosen = [c | p for c, p in zip(chosen, picks)]
    # a tie frozen by a target's name only ("head.*": head.weight, not embed.embeddings): refused
    refuse_split_tie(named, patterns, "ft.optim.freeze", lambda given: f"ft.optim.freeze({', '.join(map(repr, given))})",
                     only=[x is not None for x in leaves])
    return jax.tree.unflatten(treedef, [None if x is None else c for x, c in zip(leaves, chosen)])


# reduce_on_plateau's integer arguments: (least, rule, why, a right value).
_PLATEAU_RULES = {
    "patience": (1, "an int >= 1", "the steps without improvement that reduce the rate (optax's rule, "
                 "count >= patience, holds at 0 on every step: factor 0.5 on falling losses 3, 2, 1 "
                 "gave rates 0.5, 0.25, 0.125); torch's ReduceLROnPlateau(patience=p) reduces after "
                 "p + 1 such steps, patience=p + 1 here", "1"),
    "cooldown": (0, "an int >= 0", "the steps after a reduction before counting again", "0"),
    "accumulation_size": (1, "an int >= 1", "the losses averaged into one", "1"),
}


def _check_plateau(**given: Any) -> None:
    """:data:`~functree.optim._arguments.ARGUMENT_OUT_OF_RANGE` for an argument optax takes
    without a check (a patience of 0 reduced at the first step; a negative one or cooldown
    never counted)."""
    for arg, value in given.items():
        least, rule, why, right = _PLATEAU_RULES[arg]
        whole = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        check_argument("reduce_on_plateau", arg, value, bool(whole and value >= least), rule, why, right)


class PlateauState(NamedTuple):
    """optax's reduce-on-plateau state; ``inner.scale`` multiplies the updates."""

    inner: Any


def reduce_on_plateau(
    factor: float = 0.1, patience: int = 10, *, rtol: float = 1e-4, atol: float = 0.0, cooldown: int = 0,
    accumulation_size: int = 1, min_scale: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """Scale the updates by ``factor`` when the loss stops improving (``optax.contrib``).

    Reads the loss each step from ``update(..., loss=)`` (``Optimizer.minimize`` passes
    it; ``Optimizer.update``/``apply_gradients`` pass their ``loss=``, and refuse a step
    without one: :data:`NEEDS_LOSS`). Put it after the optimizer: ``optax.chain(ft.optim.sgd(0.1), ft.optim.reduce_on_plateau())``.
    Use ``accumulation_size`` to average noisy minibatch losses.

    Example:
      >>> import functree as ft, jax.numpy as jnp, optax
      >>> tx = optax.chain(ft.optim.sgd(1.0), ft.optim.reduce_on_plateau(factor=0.5, patience=1))
      >>> w = {"w": jnp.zeros(())}; state = tx.init(w)
      >>> for loss in [1.0, 1.0, 1.0]:                # no improvement: halve each step
      ...     updates, state = tx.update({"w": jnp.ones(())}, state, w, loss=loss)
      ...     print(float(updates["w"]))
      -1.0
      -0.5
      -0.25
    """
    _check_plateau(patience=patience, cooldown=cooldown, accumulation_size=accumulation_size)
    tx = optax.contrib.reduce_on_plateau(factor, patience, rtol, atol, cooldown, accumulation_size, min_scale)
    # optax's update builds its lax.cond branches afresh at each call: eagerly (a notebook's
    # opt.minimize) it traced and compiled them at every step. Compiled once per signature.
    compiled = jax.jit(tx.update)

    def init(params: Any) -> PlateauState:
        return PlateauState(tx.init(params))

    def update(updates: Any, state: Any, params: Any = None, *, loss: Any = None,
               **extra: Any) -> tuple[Any, PlateauState]:
        # Inside an Optimizer the loss comes as loss= only when the step was given one:
        # context.loss would be NaN or an earlier step's, lowering the rate silently.
        if loss is None:
            raise ValueError(NEEDS_LOSS)
        with jax.numpy_dtype_promotion("standard"):  # optax.contrib mixes int counters and floats
            eager = not staged() and all(map(is_array_value, jax.tree.leaves((updates, state.inner, params, loss))))
            updates, inner = (compiled if eager else tx.update)(updates, state.inner, params,
                                                                value=jnp.asarray(loss, jnp.float32))
        return updates, PlateauState(inner)

    return optax.GradientTransformationExtraArgs(init, update)
