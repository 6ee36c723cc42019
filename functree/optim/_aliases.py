"""The optimizers: optax numerics behind functree hyperparameters and learning context.

Each function returns an optax ``GradientTransformationExtraArgs``: ``tx.init(model)``
(a Module or any pytree; its parameter view is used) and ``tx.update(grads, state,
model, minibatch_size=..., loss=...)``. Defaults follow swift-apis where it has the
optimizer. ``weight_decay`` is the L2 term added to the gradient (torch's coupled
``weight_decay``), except in :func:`adamw` and :func:`lion`, where it is decoupled.
Each optimizer is one function: its signature declares the hyperparameters (the
arguments annotated ``Hyper``, :mod:`functree.optim._signature`) and its body builds the
optax numerics from their values. Every hyperparameter may be a number, a schedule of the
learning context, a piecewise list or a rate with a unit (see :mod:`functree.optim._hyper`).

A ``None`` gradient (a partial gradient, ``ft.gradient(loss, at=model, wrt="head")``)
means no update: that parameter and its moments stay as they are, alone as through an
:class:`ft.optim.Optimizer` (give the model to ``update`` so it can tell parameters from
non-parameters)::

    grads = ft.gradient(loss, at=model, wrt="layers.1")
    updates, state = tx.update(grads, state, model)     # updates.layers[0].weight is None

The step count in the state (the Adam family's bias correction) is one for all parameters
and advances with every update, as in optax; torch.optim counts per parameter and skips a
parameter whose ``.grad`` is None. So a parameter left out of some steps (gradual
unfreezing) takes its first real Adam step bias-corrected as step n, not 1 (0.0744 instead
of 0.1 at ``adam(0.1)`` after one step without it). To start a part with a count of its
own, give it its own optimizer state when it joins (``ft.optim.groups``, one state per
group, initialized then).

Complex parameters: through an :class:`ft.optim.Optimizer` (which conjugates
``ft.gradient``'s gradients and trains each complex leaf as a pair of reals) every
optimizer here gives torch.optim's numbers. Used as a plain optax transformation it
follows optax: give it conjugated gradients (``jnp.conj(grad)``), and the Adam family's
second moment is ``|g|²`` per complex element.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._alias import check_stale
from functree._naming import (
    NothingSelected,
    check_patterns,
    refuse_split_tie,
    right_name,
    selection,
)
from functree._parameters import field_mask, selected
from functree._tree import is_none
from functree.optim._checks import MOMENT_FIELDS, moment_fields  # noqa: F401  (MOMENT_FIELDS: read here before)
from functree.optim._complex import RealPair, is_pair
from functree.optim._groups import merge_members
from functree.optim._hyper import OFF_AT_ZERO
from functree.optim._leafwise import separable
from functree.optim._masked import masked
from functree.optim._radam import scale_by_radam
from functree.optim._signature import Hyper, _is_zero, optimizer

__all__ = [
    "sgd",
    "rmsprop",
    "adagrad",
    "adadelta",
    "adam",
    "adamw",
    "adamax",
    "amsgrad",
    "radam",
    "lion",
    "moments",
    "DEFAULT_NO_DECAY",
    "DECLARED",
    "LEAF",
    "decay_mask",
]

DECLARED = "<declared>"
"""In an ``exclude`` list: the fields layers declare ``ft.field(decay=False)`` (every bias
and normalisation scale/offset of ``ft.nn``), wherever they are in the model.

Example:
  >>> import functree as ft, jax
  >>> model = ft.nn.Sequential([ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.LayerNorm(2)])
  >>> mask = ft.optim.decay_mask(ft.parameters(model), exclude=(ft.optim.DECLARED,))
  >>> bool(mask.layers[0].weight), bool(mask.layers[0].bias), bool(mask.layers[1].scale)
  (True, False, False)
"""

LEAF = "<leaf>"
"""Before a glob in an ``exclude`` list (``"<leaf>*.scale"``): the glob matches whole leaf
names only, never a dotted prefix, so it spares a leaf named ``scale`` and not the weight
of a sub-layer named ``scale`` (``film.scale.weight``). A glob without it follows the
pattern grammar of every consumer (``"head"`` spares everything under ``head``).

Example:
  >>> import functree as ft, jax.numpy as jnp
  >>> params = {"film": {"scale": {"weight": jnp.ones(2), "bias": jnp.ones(2)}}, "scale": jnp.ones(2)}
  >>> spared = lambda exclude: [k for k, v in ft.to_flat_dict(ft.optim.decay_mask(params, exclude)).items() if not v]
  >>> spared((ft.optim.LEAF + "*.scale",)), spared(("*.scale",))
  (['scale'], ['film.scale.bias', 'film.scale.weight', 'scale'])
"""

DEFAULT_NO_DECAY = (DECLARED, LEAF + "*.bias", LEAF + "*.scale")
"""What weight decay skips by default: the declared fields (:data:`DECLARED`) and the
leaves named ``bias`` or ``scale`` (whole leaf names: a sub-layer named ``scale``, as a
FiLM layer's, keeps its weight decayed, as torch's AdamW with biases and norms spared). An
``exclude=`` given replaces it: ``exclude=()`` decays every parameter, as torch;
``exclude=(*ft.optim.DEFAULT_NO_DECAY, "head.*")`` adds to it.

Example:
  >>> import functree as ft
  >>> ft.optim.DEFAULT_NO_DECAY
  ('<declared>', '<leaf>*.bias', '<leaf>*.scale')
  >>> tx = ft.optim.adamw(1e-3, exclude=(*ft.optim.DEFAULT_NO_DECAY, "head.*"))   # and the head
"""

P = ParamSpec("P")

BAD_MOMENTUM_FORM = """\
momentum_form={form!r}; use "literature" (u = γu + g, w -= ηu), "additive" (v = γ'v + ηg, w -= v)
or "cntk_unit_gain" (CNTK's unit gain: v = γv + η(1 − γ)g, w -= v).{extra}
"""

UNIT_GAIN_RENAMED = """\
momentum_form="unit_gain" named two forms: functree's, until 2026-11-29, was the additive
v = γ'v + ηg (w -= v), and CNTK's unit gain is v = γv + η(1 − γ)g (w -= v), steps (1 − γ)
times as large: 10x apart at γ = 0.9. Say which:
    right:  ft.optim.sgd(lr, momentum=0.9, momentum_form="additive")         # functree's former "unit_gain"
       or:  ft.optim.sgd(lr, momentum=0.9, momentum_form="cntk_unit_gain")   # a CNTK model's rate as it is"""


def _no_decay(f: Any) -> bool:
    return f.metadata.get("decay", True) is False


def decay_mask(params: Any, exclude: Sequence[str] = DEFAULT_NO_DECAY) -> Any:
    """Which parameters weight decay applies to: a tree of bools shaped like ``params``.

    A parameter is decayed unless its dotted name matches a glob in ``exclude`` (a glob
    after ``"<leaf>"``, :data:`LEAF`, matches whole leaf names only: the default's
    ``"<leaf>*.scale"``) or, when ``exclude`` holds :data:`DECLARED` (the default
    :data:`DEFAULT_NO_DECAY` does), its layer declares the field ``ft.field(decay=False)``
    (every bias, and every scale and offset of a normalisation layer in ``ft.nn``).
    ``exclude=()`` decays everything. An ``exclude`` naming members of a Stack
    (``"h.0.*"``) gives that leaf a boolean member array.

    Example:
      >>> import functree as ft, jax
      >>> model = ft.nn.Sequential([ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.LayerNorm(2)])
      >>> mask = lambda exclude: {k: bool(v) for k, v in ft.to_flat_dict(
      ...     ft.optim.decay_mask(ft.parameters(model), exclude)).items()}
      >>> mask((ft.optim.DECLARED,))
      {'layers.0.weight': True, 'layers.0.bias': False, 'layers.1.scale': False, 'layers.1.offset': False}
      >>> mask(())
      {'layers.0.weight': True, 'layers.0.bias': True, 'layers.1.scale': True, 'layers.1.offset': True}
    """
    return decay_mask_of(params, exclude_patterns(exclude, "ft.optim.decay_mask"), "ft.optim.decay_mask")


def decay_mask_of(params: Any, exclude: tuple[str, ...], where: str) -> Any:
    """:func:`decay_mask` as the optimizer ``where`` (``"ft.optim.adamw"``) computes it: its
    errors name that optimizer, the one the user called.

    Inside an :class:`ft.optim.Optimizer` a complex parameter comes as a :class:`RealPair`
    (``bias`` as ``bias.real`` and ``bias.imag``): its mask entry is the complex leaf's,
    taken under the leaf's own name (the default's ``"<leaf>*.bias"`` had matched neither
    part, so a complex ``bias`` was decayed), and given to both parts."""
    if not any(is_pair(x) for x in jax.tree.leaves(params, is_leaf=is_pair)):
        return _decay_mask_named(params, exclude, where)
    mask = _decay_mask_named(jax.tree.map(lambda x: x.real if is_pair(x) else x, params, is_leaf=is_pair),
                             exclude, where)
    paired = jax.tree.map(is_pair, params, is_leaf=is_pair)  # another group's pair: MaskedNode parts
    return jax.tree.map(lambda m, pair: RealPair(m, m) if pair is True else m, mask, paired,
                        is_leaf=lambda x: x is None or _masked(x))


def _decay_mask_named(params: Any, exclude: tuple[str, ...], where: str) -> Any:
    """:func:`decay_mask_of` of a tree whose every leaf is a parameter under its own name."""
    check_patterns(exclude)
    globs = tuple(e for e in exclude if e != DECLARED and not e.startswith(LEAF))
    leaf_globs = tuple(e[len(LEAF):] for e in exclude if e.startswith(LEAF))
    _check_excludes(params, exclude, where)
    # a tie excluded by a target's name only ("head.*": head.weight, not embed.embeddings): refused
    refuse_split_tie(params, globs, where, lambda given: f"{where}(..., exclude={given!r})",
                     only=[x is not None for x in jax.tree.leaves(params, is_leaf=is_none)])
    by_name = selected(params, ("*",), globs, strict=False, exclude_whole=leaf_globs)
    if DECLARED not in exclude:
        return jax.tree.map(lambda m: _decayed_where(m, False), by_name, is_leaf=is_none)
    declared = field_mask(params, _no_decay)
    return jax.tree.map(_decayed_where, by_name, declared, is_leaf=is_none)


EXCLUDE_SELECTS_NOTHING = """\
{where}: the exclude pattern {pattern!r} matches no name in the model
(no parameter's, nor a frozen part's or another parameter group's), so it excludes nothing
and those parameters would be decayed. Closest names: {close}.
    wrong:  {call}exclude={wrong})
    right:  {call}exclude={right})"""


def _check_excludes(params: Any, exclude: tuple[str, ...], where: str) -> None:
    """Refuse a glob of the user's that matches no name of the model (a typo, "layer.1.*" for
    "layers.1.*", decayed what it meant to spare; a :data:`LEAF` glob, no whole name).
    :data:`DEFAULT_NO_DECAY`'s own globs may match nothing (a model without biases). Names
    of non-parameters count: a pattern for a part frozen elsewhere is no typo; so do those of
    the ``optax.MaskedNode`` s standing for other groups' parameters inside ``ft.optim.groups``
    (``optax.partition``): one ``exclude`` list shared by every group's optimizer names them,
    as torch users build one no-decay list for all param groups. Read at ``init`` and
    ``update``, once per tree definition."""
    named = jax.tree.map(lambda x: None if _masked(x) else x, params, is_leaf=lambda x: x is None or _masked(x))
    for glob in exclude:
        if glob in DEFAULT_NO_DECAY:
            continue
        whole = glob.startswith(LEAF)
        try:
            selection(named, (glob[len(LEAF):] if whole else glob,), what="exclude", strict=True, whole=whole)
        except NothingSelected as e:
            raise ValueError(_exclude_message(exclude, glob, _exclude_fix(named, glob, e), e.close, where)) from None


EXCLUDE_STRING = """\
{where}: exclude takes a tuple of patterns, got the string {given!r}, which would be read \
as its characters ({chars}), one pattern each.
    wrong:  {call}exclude={given!r})
    right:  {call}exclude=({given!r},))
       or:  {call}exclude=(*ft.optim.DEFAULT_NO_DECAY, {given!r}))     # the default's too"""


def exclude_patterns(exclude: Any, where: str) -> tuple[str, ...]:
    """``exclude`` as a tuple of patterns; :data:`EXCLUDE_STRING` for one string (a sequence
    of its characters: ``"*.bias"`` became ``("*", ".", "b", ...)``)."""
    if isinstance(exclude, str):
        call = "ft.optim.decay_mask(params, " if where == "ft.optim.decay_mask" else f"{where}(..., "
        chars = ", ".join(map(repr, exclude[:4])) + (", ..." if len(exclude) > 4 else "")
        raise TypeError(EXCLUDE_STRING.format(where=where, given=exclude, chars=chars, call=call))
    return tuple(exclude)


def _exclude_check(where: str) -> Callable[..., None]:
    """The construction-time check of an optimizer taking ``exclude`` (:func:`exclude_patterns`)."""
    def check(exclude: Any) -> None:
        exclude_patterns(exclude, where)

    return check


def _exclude_fix(named: Any, glob: str, e: NothingSelected) -> str:
    """The exclude pattern meant by ``glob``, which matches no name of ``named``: for a
    :data:`LEAF` glob naming a layer (``"<leaf>film.scale"``), the glob without ``<leaf>``;
    else the closest pattern, kept a :data:`LEAF` glob where it matches a whole name."""
    guess = e.suggestion or right_name(e.pattern, e.close, "*.bias")
    if not glob.startswith(LEAF):
        return guess
    if _selects(named, glob[len(LEAF):], whole=False):
        return glob[len(LEAF):]
    return LEAF + guess if _selects(named, guess, whole=True) else guess


def _selects(named: Any, pattern: str, whole: bool) -> bool:
    return any(np.any(s) for s in selection(named, (pattern,), what="exclude", strict=False, whole=whole))


def _exclude_message(exclude: tuple[str, ...], glob: str, fixed: str, close: Sequence[str], where: str) -> str:
    """:data:`EXCLUDE_SELECTS_NOTHING` for ``glob`` of ``exclude``, the fix ``fixed`` in its
    place, naming the optimizer ``where`` that runs the check (``ft.optim.decay_mask`` called alone)."""
    call = "ft.optim.decay_mask(params, " if where == "ft.optim.decay_mask" else f"{where}(..., "
    return EXCLUDE_SELECTS_NOTHING.format(
        where=where, pattern=glob, close=", ".join(map(repr, close)) or "none", call=call,
        wrong=_exclude_code(exclude), right=_exclude_code(tuple(fixed if e == glob else e for e in exclude)))


def _exclude_code(exclude: tuple[str, ...]) -> str:
    """``exclude`` as code, ``*ft.optim.DEFAULT_NO_DECAY`` for its default entries first."""
    n = len(DEFAULT_NO_DECAY)
    if exclude[:n] == DEFAULT_NO_DECAY:
        return "(" + ", ".join(["*ft.optim.DEFAULT_NO_DECAY", *map(repr, exclude[n:])]) + ")"
    return repr(exclude)


def _decayed_where(by_name: Any, declared: Any) -> Any:
    """A leaf of the decay mask: a bool, or a member array where ``exclude`` names members."""
    if by_name is None:
        return None
    if isinstance(by_name, np.ndarray) and not declared:
        return by_name
    return bool(np.all(by_name)) and not declared


def _decay_mask(exclude: Sequence[str], where: str) -> Any:
    exclude = exclude_patterns(exclude, where)
    return lambda params: decay_mask_of(params, exclude, where)


def _l2(weight_decay: Any) -> optax.GradientTransformation:
    return optax.add_decayed_weights(weight_decay)


def _optimizer(
    where: str, check: Callable[..., None] | None = None, off_at_zero: Sequence[str] = OFF_AT_ZERO
) -> Callable[[Callable[P, Any]], Callable[P, optax.GradientTransformationExtraArgs]]:
    """An optimizer of this module: its ``weight_decay=0`` (the number) adds no L2 term and
    needs no parameters; its update is declared :func:`separable`; one whose signature has
    ``maximize`` ascends when it is True (:func:`_maximizing`)."""
    made = optimizer(where, off_at_zero=off_at_zero, check=check, then=separable)
    return lambda body: made(_maximizing(body))


def _maximizing(body: Callable[P, Any]) -> Callable[P, Any]:
    """``body`` (an optimizer's, declaring ``maximize: bool = False`` as torch.optim's do),
    built as :func:`ascending` when ``maximize`` is True: one way for every optimizer."""
    if "maximize" not in inspect.signature(body).parameters:
        return body

    @functools.wraps(body)
    def build(*args: P.args, **kwargs: P.kwargs) -> Any:
        tx = body(*args, **kwargs)
        return ascending(tx) if kwargs.get("maximize") else tx

    return build


def ascending(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` given the negated gradient: it ascends (torch.optim's ``maximize=True``).

    The negation comes before everything ``tx`` does, as torch negates the gradient before
    its weight decay adds ``λw`` (the step climbs ``f`` and still shrinks ``w``). The state
    is ``tx``'s own: a state saved with ``maximize=False`` fits."""
    tx = optax.with_extra_args_support(tx)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return tx.update(jax.tree.map(jnp.negative, updates), state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def _decayed(weight_decay: Any, *rest: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    return optax.chain(*rest) if weight_decay is None else optax.chain(_l2(weight_decay), *rest)


def _tree_zeros(params: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, params)


class UnitGainState(NamedTuple):
    """Velocity ``v`` of the additive momentum form (parameter-view structure; the name is
    the form's old one)."""

    velocity: Any


def _unit_gain_momentum(learning_rate: Any, momentum: Any) -> optax.GradientTransformation:
    def init(params: Any) -> UnitGainState:
        return UnitGainState(_tree_zeros(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, UnitGainState]:
        v = jax.tree.map(lambda v, g: momentum * v + learning_rate * g, state.velocity, updates)
        return jax.tree.map(jnp.negative, v), UnitGainState(v)

    return optax.GradientTransformation(init, update)


def _cntk_unit_gain(learning_rate: Any, momentum: Any) -> optax.GradientTransformation:
    """CNTK's unit-gain momentum as its dense ``NormalGrad`` computes it: ``v ← γv + η(1 − γ)g;
    w ← w − v``, the rate inside the velocity (the additive form at rate ``η (1 − γ)``), so a
    changing η (a schedule, a per-sample rate on minibatches of other sizes) leaves the
    velocity taken at the earlier rates as it was. State: ``UnitGainState`` (``velocity``)."""
    return _unit_gain_momentum(learning_rate * (1 - momentum), momentum)


FORMS = ("literature", "additive", "cntk_unit_gain")


NESTEROV_WITHOUT_MOMENTUM = """\
ft.optim.sgd: nesterov=True with momentum={momentum!r} is plain SGD (Nesterov's look-ahead is
γ times the momentum); torch.optim.SGD refuses it too. Give the momentum:

    wrong:  ft.optim.sgd(0.1, nesterov=True)
    right:  ft.optim.sgd(0.1, momentum=0.9, nesterov=True)"""


NESTEROV_WITH_DAMPENING = """\
ft.optim.sgd: nesterov=True with dampening={dampening!r}: Nesterov momentum is defined without
dampening, and torch.optim.SGD refuses the pair too. Drop one:

    wrong:  ft.optim.sgd(0.1, momentum=0.9, nesterov=True, dampening={dampening!r})
    right:  ft.optim.sgd(0.1, momentum=0.9, nesterov=True)
       or:  ft.optim.sgd(0.1, momentum=0.9, dampening={dampening!r})"""

DAMPENING_FORM = """\
ft.optim.sgd: dampening={dampening!r} is torch's, for the literature form; the
{form!r} form has none (CNTK's unit gain scales the gradient by 1 − γ already):

    wrong:  ft.optim.sgd(0.1, momentum=0.9, momentum_form={form!r}, dampening={dampening!r})
    right:  ft.optim.sgd(0.1, momentum=0.9, dampening={dampening!r})"""


def _check_sgd(nesterov: bool, momentum_form: str, momentum: Any, dampening: Any) -> None:
    if nesterov and _is_zero(momentum):
        raise ValueError(NESTEROV_WITHOUT_MOMENTUM.format(momentum=momentum))
    if nesterov and not _is_zero(dampening):
        raise ValueError(NESTEROV_WITH_DAMPENING.format(dampening=dampening))
    if momentum_form != "literature" and not _is_zero(dampening):
        raise ValueError(DAMPENING_FORM.format(dampening=dampening, form=momentum_form))
    if momentum_form == "unit_gain":
        raise ValueError(UNIT_GAIN_RENAMED)
    if momentum_form not in FORMS:
        raise ValueError(BAD_MOMENTUM_FORM.format(form=momentum_form, extra=""))
    if momentum_form != "literature" and nesterov:
        raise ValueError(BAD_MOMENTUM_FORM.format(form=momentum_form, extra=" Nesterov needs the literature form."))


class DampenedTraceState(NamedTuple):
    """torch's momentum buffer with dampening: the step count (the first step takes the
    gradient undampened) and the buffer ``trace`` (parameter view)."""

    count: jax.Array
    trace: Any


def _dampened_trace(momentum: Any, dampening: Any, nesterov: bool) -> optax.GradientTransformation:
    """``u₁ = g``, ``uₜ = γ uₜ₋₁ + (1 − δ) g`` (torch.optim.SGD's buffer); the direction
    ``u`` (``g + γu`` with ``nesterov``), ``g`` itself where γ is 0 (torch keeps no buffer)."""

    def init(params: Any) -> DampenedTraceState:
        return DampenedTraceState(jnp.zeros((), jnp.int32), _tree_zeros(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, DampenedTraceState]:
        first = state.count == 0
        trace = jax.tree.map(lambda u, g: jnp.where(first, g, momentum * u + (1 - dampening) * g),
                             state.trace, updates)
        step = jax.tree.map(lambda u, g: g + momentum * u, trace, updates) if nesterov else trace
        step = jax.tree.map(lambda s, g: jnp.where(momentum == 0, g, s), step, updates)
        return step, DampenedTraceState(jnp.asarray(optax.safe_increment(state.count)), trace)

    return optax.GradientTransformation(init, update)


@_optimizer("ft.optim.sgd", check=_check_sgd, off_at_zero=(*OFF_AT_ZERO, "dampening"))
def sgd(
    learning_rate: Hyper = 0.01,
    momentum: Hyper = 0.0,
    nesterov: bool = False,
    weight_decay: Hyper = 0.0,
    *,
    momentum_form: str = "literature",
    dampening: Hyper = 0.0,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Stochastic gradient descent with momentum (torch.optim.SGD, swift-apis SGD).

    Literature form (default; ``nesterov`` uses ``g + γu`` as the step)::

        u ← γ u + (g + λ w);   w ← w − η u

    Additive form (the CNTK learner discussion's "more additively computable form",
    ``momentum_form="additive"``)::

        v ← γ' v + η (g + λ w);   w ← w − v

    With a constant η it agrees with the literature form when ``γ' = γ``; for a rate
    changing from η₋ to η, ``γ' = γ η / η₋``.

    CNTK's unit-gain form (``momentum_sgd(..., unit_gain=True)``,
    ``momentum_form="cntk_unit_gain"``)::

        v ← γ v + η (1 − γ)(g + λ w);   w ← w − v

    the additive form at rate ``η (1 − γ)``, as CNTK's ``NormalGrad`` puts the rate inside
    the velocity: a CNTK model's rate ported as it is. While η is constant it is the
    literature form at rate ``η (1 − γ)``; when η changes (a schedule's step, or
    ``ft.optim.per_samples`` on a minibatch of another size: ``η · M``) the velocity
    keeps the rates it was taken at, as CNTK's does (before 2026-12-04 the new η scaled
    the whole momentum). ``"unit_gain"``, which until 2026-11-29 named the additive form,
    is refused with both. State: ``optax.TraceState`` (``trace``, literature) or
    ``UnitGainState`` (``velocity``, additive and CNTK's), shaped like the model's parameters.

    ``dampening=δ`` (torch's; literature form only, never with ``nesterov``, as torch)::

        u₁ = g + λw;   uₜ ← γ uₜ₋₁ + (1 − δ)(g + λw);   w ← w − η u

    the first step undampened, as torch's buffer starts as the gradient. State then:
    ``DampenedTraceState`` (``count``, ``trace``). ``maximize=True`` (torch's) ascends: the
    gradient is negated before anything else (before the weight decay adds ``λw``), as in
    every optimizer here that has it.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.sgd(0.1, momentum=0.9)
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> updates, state = tx.update({"w": jnp.ones(2)}, state)
      >>> updates["w"]
      Array([-0.1, -0.1], dtype=float32)
      >>> tx, g = ft.optim.sgd(0.1, momentum=0.9, dampening=0.5), {"w": jnp.ones(1)}
      >>> first, state = tx.update(g, tx.init(g))
      >>> second, _ = tx.update(g, state)       # u = 0.9 · 1 + (1 − 0.5) · 1
      >>> first["w"], second["w"]
      (Array([-0.1], dtype=float32), Array([-0.14], dtype=float32))
    """
    if momentum_form == "additive":
        return _decayed(weight_decay, _unit_gain_momentum(learning_rate, momentum))
    if momentum_form == "cntk_unit_gain":
        return _decayed(weight_decay, _cntk_unit_gain(learning_rate, momentum))
    if dampening is not None:
        return _decayed(weight_decay, _dampened_trace(momentum, dampening, nesterov),
                        optax.scale_by_learning_rate(learning_rate))
    return _decayed(weight_decay, optax.sgd(learning_rate, momentum, nesterov))


@_optimizer("ft.optim.rmsprop")
def rmsprop(
    learning_rate: Hyper = 1e-3,
    rho: Hyper = 0.9,
    epsilon: Hyper = 1e-8,
    momentum: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    *,
    centered: bool = False,
    eps_in_sqrt: bool = False,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """RMSProp (torch.optim.RMSprop with ``alpha=rho``; swift-apis RMSProp)::

        s ← ρ s + (1 − ρ) g²;   u ← μ u + g / (√s + ε);   w ← w − η u

    (``centered``: ``√(s − ḡ²)`` with ``ḡ ← ρ ḡ + (1 − ρ) g``.) ``eps_in_sqrt=True``
    divides by ``√(s + ε)`` instead, as Keras's RMSprop and optax's ``rmsprop`` (its
    default): not a detail, since ``√ε`` is the floor there (3.2e-4 at Keras's ε = 1e-7,
    where ``g / (√s + ε)`` would step 3× more for gradients of order 1e-4). State: optax's
    ``ScaleByRmsState`` (``nu``) and ``TraceState``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.rmsprop(0.01)
      >>> updates, _ = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]   # -0.01 / sqrt(0.1)
      Array([-0.0316...], dtype=float32)
    """
    scale = (optax.scale_by_stddev if centered else optax.scale_by_rms)(rho, epsilon, eps_in_sqrt=eps_in_sqrt)
    return _decayed(weight_decay, _momentum_then_rate(scale, learning_rate, momentum))


def _momentum_then_rate(scale: optax.GradientTransformation, learning_rate: Any,
                        momentum: Any) -> optax.GradientTransformation:
    """``u ← μu + scaled g;  −η u``: the momentum before the learning rate, as torch.

    ``optax.rmsprop`` traces the update already scaled by η (``u ← μu + η g/(√s+ε)``, as
    Keras), which is the same only while η is constant: across a schedule's change from
    0.1 to 0.01 the old buffer kept moving at 0.1 (two steps: −0.624 for torch's −0.368).
    The state keeps ``optax.rmsprop``'s layout, ``(rms, EmptyState(), TraceState)``, so
    states saved before read as they were."""
    trace, rate = optax.trace(decay=momentum), optax.scale_by_learning_rate(learning_rate)

    def init(params: Any) -> tuple[Any, Any, Any]:
        return scale.init(params), rate.init(params), trace.init(params)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, tuple[Any, Any, Any]]:
        updates, scaled = scale.update(updates, state[0], params)
        updates, traced = trace.update(updates, state[2], params)
        updates, rated = rate.update(updates, state[1], params)
        return updates, (scaled, rated, traced)

    return optax.GradientTransformation(init, update)


class AdagradState(NamedTuple):
    """Sum of squared gradients (parameter-view structure)."""

    sum_of_squares: Any


def _scale_by_adagrad(initial: Any, epsilon: Any, eps_in_sqrt: bool = False) -> optax.GradientTransformation:
    def init(params: Any) -> AdagradState:
        return AdagradState(jax.tree.map(lambda p: jnp.full_like(p, initial), params))

    def scaled(g: Any, s: Any) -> Any:
        return g / jnp.sqrt(s + epsilon) if eps_in_sqrt else g / (jnp.sqrt(s) + epsilon)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, AdagradState]:
        s = jax.tree.map(lambda s, g: s + g * g, state.sum_of_squares, updates)
        return jax.tree.map(scaled, updates, s), AdagradState(s)

    return optax.GradientTransformation(init, update)


@_optimizer("ft.optim.adagrad")
def adagrad(
    learning_rate: Hyper = 1e-3,
    initial_accumulator_value: Hyper = 0.1,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    eps_in_sqrt: bool = False,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AdaGrad (torch.optim.Adagrad, swift-apis AdaGrad)::

        s ← s + g²   (s₀ = initial_accumulator_value);   w ← w − η g / (√s + ε)

    ``eps_in_sqrt=True`` divides by ``√(s + ε)`` instead, as Keras's Adagrad and optax's
    ``adagrad`` do; the default follows torch.
    torch's ``lr_decay=d`` (``η / (1 + (t − 1) d)`` at update ``t``) is the rate
    ``ft.optim.schedule(lambda c: η / (1 + d * c))``: the step count ``c`` is 0 at the first
    update (:func:`ft.optim.inverse_time_decay` is swift-apis' decay, counted from 1).
    State: ``AdagradState`` (``sum_of_squares``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.adagrad(0.1, initial_accumulator_value=0.0)
      >>> updates, _ = tx.update({"w": jnp.full(1, 2.0)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]
      Array([-0.1], dtype=float32)
    """
    return _decayed(
        weight_decay,
        _scale_by_adagrad(initial_accumulator_value, epsilon, eps_in_sqrt),
        optax.scale_by_learning_rate(learning_rate),
    )


@_optimizer("ft.optim.adadelta")
def adadelta(
    learning_rate: Hyper = 1.0,
    rho: Hyper = 0.95,
    epsilon: Hyper = 1e-6,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AdaDelta (torch.optim.Adadelta, swift-apis AdaDelta)::

        s ← ρ s + (1 − ρ) g²;   Δ = √(d + ε) / √(s + ε) · g;   d ← ρ d + (1 − ρ) Δ²;   w ← w − η Δ

    State: optax's ``ScaleByAdaDeltaState`` (``e_g``, ``e_x``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.adadelta()
      >>> updates, _ = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]   # -sqrt(1e-6) / sqrt(0.05 + 1e-6)
      Array([-0.00447...], dtype=float32)
    """
    return _decayed(
        weight_decay, optax.scale_by_adadelta(rho, epsilon), optax.scale_by_learning_rate(learning_rate)
    )


@_optimizer("ft.optim.adam")
def adam(
    learning_rate: Hyper = 1e-3,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.999,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Adam (torch.optim.Adam's and optax.adam's numbers)::

        m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²
        m̂ = m / (1 − β₁ᵗ);   v̂ = v / (1 − β₂ᵗ);   w ← w − η m̂ / (√v̂ + ε)

    swift-apis and Keras put ε before the bias correction (``η √(1−β₂ᵗ)/(1−β₁ᵗ) ·
    m/(√v + ε)``): that is ``ε/√(1−β₂ᵗ)`` added to ``√v̂``, 31.6ε at the first step, so
    theirs step less where gradients are small (Keras's ε = 1e-7 as a plain ε here stepped
    2.5× Keras's for gradients of order 1e-6, 1.4× for 1e-5, over eight steps). Their
    numbers exactly: ``epsilon=ft.optim.schedule(lambda t: 1e-7 / (1 - 0.999 ** (t + 1)) ** 0.5)``
    (``t`` counts from 0; β₂ = 0.999).

    State: optax's ``ScaleByAdamState`` (``mu``, ``nu``) shaped like the model's
    parameters; read them with :func:`moments`.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
      >>> state = opt.init(model)
      >>> loss = lambda m, x, y: ((m(x) - y) ** 2).mean()
      >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
      >>> model, state, value = opt.minimize(loss, model, state, x, y)
      >>> ft.optim.moments(state)["mu"].weight.shape
      (2, 1)
    """
    return _decayed(weight_decay, optax.adam(learning_rate, beta1, beta2, epsilon))


@_optimizer("ft.optim.adamw", check=_exclude_check("ft.optim.adamw"))
def adamw(
    learning_rate: Hyper = 1e-3,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.999,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.01,
    *,
    exclude: Sequence[str] = DEFAULT_NO_DECAY,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Adam with decoupled weight decay (torch.optim.AdamW, optax.adamw)::

        w ← w − η (m̂ / (√v̂ + ε) + λ w)     (λ w only where the name matches no ``exclude``)

    ``exclude`` (see :func:`decay_mask`): by default :data:`DEFAULT_NO_DECAY`, the fields
    layers declare ``ft.field(decay=False)`` (biases, normalisation scales and offsets)
    and the leaves named ``bias`` or ``scale`` (whole names: a sub-layer named ``scale``
    keeps its weight decayed). ``exclude=()`` decays everything, as torch's
    AdamW; ``exclude=(ft.optim.DECLARED, "head.*")`` skips the declared fields and ``head``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.adamw(0.1, weight_decay=0.5)
      >>> params = {"weight": jnp.ones(1), "bias": jnp.ones(1)}
      >>> updates, _ = tx.update({"weight": jnp.zeros(1), "bias": jnp.zeros(1)}, tx.init(params), params)
      >>> updates
      {'bias': Array([-0.], dtype=float32), 'weight': Array([-0.05], dtype=float32)}
    """
    if weight_decay is None:
        return optax.adam(learning_rate, beta1, beta2, epsilon)
    return optax.chain(optax.scale_by_adam(beta1, beta2, epsilon),  # optax.adamw, its state too
                       masked(optax.add_decayed_weights(weight_decay), _decay_mask(exclude, "ft.optim.adamw")),
                       optax.scale_by_learning_rate(learning_rate))


@_optimizer("ft.optim.adamax")
def adamax(
    learning_rate: Hyper = 0.002,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.999,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    eps_in_max: bool = True,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AdaMax (torch.optim.Adamax, optax.adamax, swift-apis AdaMax)::

        m ← β₁ m + (1 − β₁) g;   u ← max(β₂ u, |g| + ε);   w ← w − η m / ((1 − β₁ᵗ) u)

    ``eps_in_max=False`` is Keras's Adamax: ``u ← max(β₂ u, |g|)`` and ``w ← w − η m /
    ((1 − β₁ᵗ)(u + ε))`` (the two differ where gradients are of order ε). State: optax's
    ``ScaleByAdamState`` (``mu``, ``nu`` = ``u``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.adamax(0.1)
      >>> updates, _ = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]
      Array([-0.1], dtype=float32)
    """
    if eps_in_max:
        return _decayed(weight_decay, optax.adamax(learning_rate, beta1, beta2, epsilon))
    return _decayed(weight_decay, optax.chain(_scale_by_keras_adamax(beta1, beta2, epsilon),
                                              optax.scale_by_learning_rate(learning_rate)))


def _scale_by_keras_adamax(beta1: Any, beta2: Any, epsilon: Any) -> optax.GradientTransformation:
    """Keras 3's Adamax update before the rate, in its own order of operations."""
    def init(params: Any) -> optax.ScaleByAdamState:
        zeros = optax.tree_utils.tree_zeros_like(params)
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), zeros, optax.tree_utils.tree_zeros_like(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, optax.ScaleByAdamState]:
        mu = jax.tree.map(lambda m, g: m + (g - m) * (1 - beta1), state.mu, updates)
        nu = jax.tree.map(lambda u, g: jnp.maximum(beta2 * u, jnp.abs(g)), state.nu, updates)
        count = optax.safe_increment(state.count)
        correction = 1 - jnp.asarray(beta1, jnp.result_type(float)) ** count
        moved = jax.tree.map(lambda m, u: (m / (u + epsilon) / correction).astype(m.dtype), mu, nu)
        return moved, optax.ScaleByAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


class AMSGradState(NamedTuple):
    """First and second moments and the running maximum of the second (parameter view)."""

    count: jax.Array
    mu: Any
    nu: Any
    nu_max: Any


def _scale_by_amsgrad(beta1: Any, beta2: Any, epsilon: Any) -> optax.GradientTransformation:
    def init(params: Any) -> AMSGradState:
        return AMSGradState(jnp.zeros((), jnp.int32), _tree_zeros(params), _tree_zeros(params), _tree_zeros(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, AMSGradState]:
        g = updates
        count = state.count + 1
        t = count.astype(jnp.float32)
        mu = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.mu, g)
        nu = jax.tree.map(lambda v, g: beta2 * v + (1 - beta2) * g * g, state.nu, g)
        nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu)
        c1, c2 = 1 - beta1**t, 1 - beta2**t
        out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v) / jnp.sqrt(c2) + epsilon), mu, nu_max)
        return out, AMSGradState(count, mu, nu, nu_max)

    return optax.GradientTransformation(init, update)


@_optimizer("ft.optim.amsgrad")
def amsgrad(
    learning_rate: Hyper = 1e-3,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.999,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AMSGrad (torch.optim.Adam(amsgrad=True), swift-apis AMSGrad)::

        m, v as in Adam;   v̄ ← max(v̄, v);   w ← w − η (m / (1 − β₁ᵗ)) / (√v̄ / √(1 − β₂ᵗ) + ε)

    The maximum is over raw second moments, as torch and swift-apis; ``optax.amsgrad``
    takes it over bias-corrected ones, so it differs in early steps. torch's
    ``AdamW(lr=η, weight_decay=λ, amsgrad=True)`` is ``optax.chain(ft.optim.amsgrad(η),
    ft.optim.weight_decay(η * λ, exclude=()))`` (give both a schedule's values when η follows one).
    State: ``AMSGradState`` (``mu``, ``nu``, ``nu_max``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.amsgrad(0.1)
      >>> updates, _ = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]
      Array([-0.1], dtype=float32)
    """
    return _decayed(
        weight_decay, _scale_by_amsgrad(beta1, beta2, epsilon), optax.scale_by_learning_rate(learning_rate)
    )


@_optimizer("ft.optim.radam")
def radam(
    learning_rate: Hyper = 1e-3,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.999,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Rectified Adam (torch.optim.RAdam's numbers; swift-apis RAdam)::

        ρ∞ = 2/(1 − β₂) − 1;   ρₜ = ρ∞ − 2t β₂ᵗ / (1 − β₂ᵗ)
        ρₜ > 5:  w ← w − η rₜ m̂ √(1 − β₂ᵗ)/(√v + ε),  rₜ = √((ρₜ−4)(ρₜ−2)ρ∞ / ((ρ∞−4)(ρ∞−2)ρₜ))
        else:    w ← w − η m̂

    ρₜ is computed without the cancellation of the formula as written (``_radam.py``), and ε
    sits where torch and the paper's code put it (optax's ``radam`` uses ``√v̂ + ε``).
    ``weight_decay`` is torch's coupled L2 term; torch's ``RAdam(lr=η, weight_decay=λ,
    decoupled_weight_decay=True)`` is ``optax.chain(ft.optim.radam(η),
    ft.optim.weight_decay(η * λ, exclude=()))``. State: ``optax.ScaleByAdamState``, as
    ``optax.radam``'s.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.radam(0.1)
      >>> updates, _ = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]     # no rectification yet: -η m̂
      Array([-0.1], dtype=float32)
    """
    return _decayed(weight_decay, scale_by_radam(beta1, beta2, epsilon, threshold=5.0),
                    optax.scale_by_learning_rate(learning_rate))


@_optimizer("ft.optim.lion", check=_exclude_check("ft.optim.lion"))
def lion(
    learning_rate: Hyper = 1e-4,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.99,
    weight_decay: Hyper = 0.0,
    *,
    exclude: Sequence[str] = DEFAULT_NO_DECAY,
) -> optax.GradientTransformationExtraArgs:
    """Lion (optax.lion; Chen et al. 2023), decoupled weight decay with ``exclude`` masks (as :func:`adamw`)::

        w ← w − η (sign(β₁ m + (1 − β₁) g) + λ w);   m ← β₂ m + (1 − β₂) g

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.lion(0.1)
      >>> updates, _ = tx.update({"w": jnp.full(1, 3.0)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]
      Array([-0.1], dtype=float32)
    """
    if weight_decay is None:
        return optax.chain(optax.scale_by_lion(beta1, beta2), optax.scale_by_learning_rate(learning_rate))
    return optax.chain(optax.scale_by_lion(beta1, beta2),  # optax.lion, its state too
                       masked(optax.add_decayed_weights(weight_decay), _decay_mask(exclude, "ft.optim.lion")),
                       optax.scale_by_learning_rate(learning_rate))


def _is_moment_state(x: Any) -> bool:
    return isinstance(x, tuple) and bool(moment_fields(x))


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _merge(trees: list[Any], labels: list[Any]) -> Any | None:
    """One tree from parameter groups' moments (each filled only at its group's parameters,
    or, where groups split a Stack's members, at its members), or None when they overlap
    or differ in structure."""
    flat = [jax.tree.flatten(t, is_leaf=lambda x: _masked(x) or x is None) for t in trees]
    treedef = flat[0][1]
    if any(d != treedef for _, d in flat):
        return None
    out = []
    for values in zip(*(leaves for leaves, _ in flat)):
        given = [v for v in values if not _masked(v) and v is not None]
        if len(given) > 1:  # groups splitting a Stack's members: each member from its group
            members = merge_members([leaves for leaves, _ in flat], labels, treedef,
                                    lambda x: _masked(x) or x is None)
            return None if members is None else treedef.unflatten(members)
        out.append(given[0] if given else None)
    return treedef.unflatten(out)


def _group_label(path: tuple) -> Any:
    """The ``ft.optim.groups`` label a moment state at ``path`` belongs to (the key after
    the innermost ``inner_states``), else None."""
    label = None
    for before, key in itertools.pairwise(path):
        if getattr(before, "name", None) == "inner_states" and isinstance(key, jax.tree_util.DictKey):
            label = key.key
    return label


def moments(state: Any) -> dict[str, Any]:
    """The per-parameter state (moments) by name; each has the parameter view's structure.

    Names are the optax state fields (``mu``, ``nu``, ``trace``, ``sum_of_squares``, ...;
    adafactor's factored second moment as ``v_row`` and ``v_col``, the parameter's shape
    less one axis, and ``v``, the full second moment of a parameter it does not factor;
    each is ``(1,)`` where the other form holds the statistics). Read one parameter's
    moment with the model's key path: ``ft.get(moments(state)["mu"], kp)``.
    Parameter groups' moments are merged into one tree (``None`` where a group's
    optimizer keeps no such moment; where groups split a Stack's members, each member's
    from its group, zeros at members whose group keeps no such moment); a name found in
    several overlapping places (two momentum transforms in a chain) is listed once per
    place as ``name``, ``name#1``, ...

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.sgd(0.1, momentum=0.9)
      >>> _, state = tx.update({"w": jnp.array([1.0, -2.0])}, tx.init({"w": jnp.ones(2)}))
      >>> ft.optim.moments(state)
      {'trace': {'w': Array([ 1., -2.], dtype=float32)}}
      >>> sorted(ft.optim.moments(ft.optim.adam().init({"w": jnp.ones(2)})))
      ['mu', 'nu']
      >>> tx = ft.optim.groups({"a": ft.optim.adam(), "b": ft.optim.adam()})
      >>> ft.optim.moments(tx.init({"a": jnp.ones(1), "b": jnp.zeros(2)}))["mu"]
      {'a': Array([0.], dtype=float32), 'b': Array([0., 0.], dtype=float32)}
    """
    check_stale([("state", state)], "ft.optim.moments(state)")  # donated by a step
    found: dict[str, list[Any]] = {}
    labels: dict[str, list[Any]] = {}
    for path, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_moment_state)[0]:
        if not _is_moment_state(node):
            continue
        for field in moment_fields(node):  # adafactor's v_row/v_col/v on its state only
            found.setdefault(field, []).append(getattr(node, field))
            labels.setdefault(field, []).append(_group_label(path))
    out: dict[str, Any] = {}
    for field, trees in found.items():
        merged = _merge(trees, labels[field])
        if merged is not None:
            out[field] = merged
            continue
        for i, tree in enumerate(trees):
            out[field if i == 0 else f"{field}#{i}"] = tree
    return out
