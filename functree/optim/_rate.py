"""The refusal of an optimizer whose transform applies no learning rate to some parameters.

optax's convention: a transform ends by scaling its direction by ``-learning_rate``
(``scale_by_learning_rate``, ``scale(-lr)``, inside an alias such as ``adam``), and
``apply_updates`` adds the update. A parameter the rate never reaches gets the direction
itself added, ``p + adam_direction``: a step up the loss, at rate 1. The way it happens:
``optax.masked`` around the rate, last in a chain
(``chain(scale_by_adam(), masked(scale(-lr), mask))``), passes the parameters its mask leaves
out through as the chain made them before it, unscaled; a transform with no rate at all
(``Optimizer(optax.scale_by_adam())``) is the same. No update leaf is the gradient object,
so :func:`~functree.optim._checks.check_not_passed_through` does not see it.

:meth:`ft.optim.Optimizer.update` reads it from the transform's structure while the step
traces (once per transform and parameter shapes): optax builds every transform as closures,
and the walk opens ``optax.chain`` (and ``named_chain``), ``optax.masked``,
``optax.partition`` (``multi_transform``), ``ft.optim.masked`` and ``ft.optim.groups``,
evaluating their masks and labels on the gradients as they do. It reads through the
wrappers that give their inner transform the same updates (:data:`WRAPPERS`,
``optax.MultiSteps``, ``ft.optim.per_member`` on parameters holding no Stack, ``optax.contrib``'s
``schedule_free``, ``sam``, ``mechanize``), ``optax.flatten`` (its inner transform on one
vector: a rate for all of them or none), ``optax.contrib.scale_by_galore`` (its base on the
low-rank updates it gets), and builds a
transform rebuilt at each step from its hyperparameters (``optax.inject_hyperparams``,
``ft.optim.inject`` and so ft.optim's optimizers) as the jitted step does, from abstract
values. ``optax.conditionally_transform`` forwards the updates unchanged on the steps it
skips: read once with it transforming and once with it skipping (its parameters then reached
by what comes after it alone), each apart, a skipped step's refusal :data:`SKIPPED_UNSCALED`
(``conditionally_transform(adam(lr), fn)``: p + g on those steps); not read as skipping where
its condition surely never skips (:func:`_never_skips`: ``step >= 0``, a constant True); where
it is the only one, a reading that climbs is refused, :data:`ASCENDING_ON_STEPS`
(``chain(conditionally_transform(adam(lr), fn), scale(-1))``: -lr, then -1, where fn is True). A parameter is refused
only where every transform that reaches it is one of optax's that give a direction with
neither a rate nor a sign (:data:`DIRECTIONS`: ``scale_by_adam``, ``scale_by_sign``,
``clip_by_global_norm``, ``identity``, ``optax.contrib.normalize`` ...; :data:`FACTORED`:
``scale_by_trust_ratio`` and ``normalize_by_update_norm`` with a factor that is no rate).
``optax.contrib.sam`` is read through its outer optimizer only: its adversarial optimizer's
steps ascend by design (sam negates them) and are undone at the outer step. The walk also
multiplies the signs of the concrete factors that reach a parameter (``optax.scale``, and so
``scale_by_learning_rate(lr)``: -lr; a :data:`FACTORED` factor; galore's ``scale``): where
they surely multiply to a plus, the update climbs, :data:`ASCENDING_UPDATE`
(``chain(adam(lr), scale(-1))``, ``chain(scale_by_adam(), scale(lr))``,
``optax.contrib.galore(1.0, base_optimizer=adam(lr))``: -lr, then -1.0). A factor built from
hyperparameters (traced: ``inject_hyperparams``, ft.optim's optimizers) gets its sign from the
build's jaxpr, ft.optim's checked ones (its learning rate) >= 0, a function of its learning
context read as a schedule below (:func:`_spec_sign`: ``ft.optim.sgd(lambda ctx: -0.1)``,
``ft.optim.sgd(ft.optim.schedule(optax.constant_schedule(-0.1)))`` refused), optax's the sign of the
number it was given, which its state starts from (:func:`_injected`: the first step's value;
``inject_hyperparams(adam)(learning_rate=-lr)`` and ``chain(ft.optim.adam(lr), scale(-1))``
are refused; a host number written into its state later, ``state.inner.hyperparams["learning_rate"]
= -0.1``, is read where the step runs eagerly (:func:`_written`), not inside a jitted step,
where it is traced: ``ft.optim.set_hyperparameters`` checks it). A schedule in optax's transforms
(``scale_by_schedule``, and so ``optax.adam(schedule)``; ``inject_hyperparams``' schedules) is
read once (:mod:`functree.optim._schedule_reads`: optax's constructors from the numbers they
hold, >= 0, with no program compiled; others evaluated at the step counts, one small program
for the CPU): its sign at step 0 is the first step's
(``optax.sgd(lambda step: -0.1)`` is refused), and where it holds a value of the other sign
at its end (optax's schedules hold their last: ``linear_schedule(lr, -lr, n)``), a walk
reading it there refuses what climbs from the step it turns, :data:`ASCENDING_LATER` (where the
run's steps are known, ``ft.train.Trainer.fit``'s, only a run that reaches that step:
:func:`training_horizon`, :func:`check_horizon`); a
function still changing at its end (a line falling past the steps trained) or one that
cannot be evaluated on concrete counts is of either sign there. ``ft.optim``'s
``maximize=True`` (the gradient negated before the optimizer) is not opened: a deliberate ascent. Anything else counts as
applying a rate (a rate or schedule of either sign, another library's or a hand-written
transform, a wrapper the walk does not open: ``per_member`` on a Stack, whose inner
transform sees each member as a parameter; ``optax.contrib``'s others; a factory that cannot be built from abstract values, a mask it cannot evaluate, a member
mask's partly selected leaf), so a valid optimizer is not refused; those ascend unseen.
Not checked where the updates are not simply added (``Optimizer(apply_updates=...)`` or a
subclass's ``apply_updates``), nor for complex parameters (trained as pairs of reals, a
tree the walk does not see).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import operator
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from functree._tree import WeakIdentity, bounded_put, cached, dotted_name, is_none
from functree.optim._average import is_slot
from functree.optim._checks import ConfigurationError
from functree.optim._context import LearningContext
from functree.optim._hyper import RULES
from functree.optim._masked import is_partial
from functree.optim._per_member import _has_stack
from functree.optim._schedule_reads import schedule_read, turning_step
from functree.optim._schedules import values_of

__all__ = ["NO_LEARNING_RATE", "ASCENDING_UPDATE", "ASCENDING_LATER", "ASCENDING_ON_STEPS", "SKIPPED_UNSCALED", "DIRECTIONS", "FACTORED", "WRAPPERS", "check_rate_applied", "check_horizon", "training_horizon"]

NO_LEARNING_RATE = """\
The optimizer's transform applies no learning rate to {paths} ({count} of {total} parameters): \
every transform that reaches them gives a direction with neither a rate nor a minus sign \
(optax.scale_by_adam, scale_by_sign, scale_by_trust_ratio, normalize_by_update_norm, \
clip_by_global_norm, trace, identity ...), and the update is added to the parameter: \
p + direction, a step up the loss at rate 1. A chain of such transforms needs the rate last: \
optax.scale_by_learning_rate(lr) scales by -lr. optax.masked (and ft.optim.masked) passes the \
parameters its mask leaves out through as the chain made them before it: around the learning \
rate, last in a chain, it leaves them unscaled.

    wrong:  optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio())   # no rate: p + direction
    right:  optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale_by_learning_rate(1e-3))
    wrong:  optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(-1e-3), mask))   # the others: p + adam direction
    right:  ft.optim.Optimizer(optax.chain(optax.scale_by_adam(), optax.scale(-1e-3)), wrt="head.*")   # the others frozen
       or:  optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(0.1), mask), optax.scale(-1e-3))   # a 10x smaller rate on some"""

ASCENDING_UPDATE = """\
The optimizer's transform moves {paths} ({count} of {total} parameters) up the loss: the \
factors that the transforms reaching them scale the direction by multiply to a positive number \
(two minus signs, a rate without its minus sign, or a negative learning rate), and the update is \
added to the parameter: p + lr * direction, a step up the loss.{detail} optax's rates carry the \
minus sign themselves (optax.adam(lr), optax.sgd(lr), optax.scale_by_learning_rate(lr) scale by \
-lr): a chain needs one of them, or optax.scale with a negative factor, not both. optax.contrib.galore scales by \
-learning_rate after its base: give it a base without a rate, as its docstring asks. To climb \
on purpose, pass maximize=True to an ft.optim optimizer, or minimize the negated objective.

    wrong:  optax.chain(optax.adam(1e-3), optax.scale(-1.0))   # -1e-3 * -1.0: p + 1e-3 * direction
    right:  optax.adam(1e-3)
    wrong:  optax.chain(optax.scale_by_adam(), optax.scale(1e-3))   # the minus sign forgotten
    right:  optax.chain(optax.scale_by_adam(), optax.scale(-1e-3))
    wrong:  optax.contrib.galore(1.0, base_optimizer=optax.adam(1e-3))   # -1e-3, then -1.0
    right:  optax.contrib.galore(1e-3, base_optimizer=optax.scale_by_adam())
    wrong:  optax.inject_hyperparams(optax.adam)(learning_rate=-1e-3)   # its state's rate: -(-1e-3)
    right:  optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    wrong:  state.inner.hyperparams["learning_rate"] = -1e-3   # written into the state by hand
    right:  state = ft.optim.set_hyperparameters(state, learning_rate=1e-3)   # checked: >= 0
    wrong:  optax.sgd(optax.constant_schedule(-0.1))   # -(-0.1) from step 0
    right:  optax.sgd(optax.constant_schedule(0.1))
    wrong:  ft.optim.sgd(lambda ctx: -0.1)   # a function of the learning context: -(-0.1) from step 0
    right:  ft.optim.sgd(lambda ctx: 0.1)
    right:  ft.optim.adam(1e-3, maximize=True)   # gradient ascent, on purpose"""

ASCENDING_LATER = """\
The optimizer's transform moves {paths} ({count} of {total} parameters) up the loss from the \
step its schedule turns: {detail}, and optax's schedules hold their last value at every step \
after it. From there the factors that the transforms reaching them scale the direction by \
multiply to a positive number, and the update is added to the parameter: p + lr * direction, \
a step up the loss at each step. optax's rates carry the minus sign themselves \
(optax.adam(schedule) scales by -schedule(step)): a learning-rate schedule stays >= 0; one that \
decays to nothing ends at 0. ft.train.Trainer.fit(data, steps=N) (or epochs of a known length) \
refuses it only where the job's N steps reach that step; a loop of your own, whose length \
functree cannot read, is refused up front.

    wrong:  optax.adam(optax.linear_schedule(1e-3, -1e-3, 100))   # -1e-3 from step 100: p + 1e-3 * direction
    right:  optax.adam(optax.linear_schedule(1e-3, 0.0, 100))
    right:  ft.optim.adam(1e-3, maximize=True)   # gradient ascent, on purpose"""

ASCENDING_ON_STEPS = """\
The optimizer's transform moves {paths} ({count} of {total} parameters) up the loss on the \
steps optax.conditionally_transform {detail}: there the factors that the transforms reaching \
them scale the direction by multiply to a positive number (two minus signs: a rate inside it \
and another factor of the wrong sign after it, or the other way round), and the update is \
added to the parameter: p + lr * direction, a step up the loss on each of those steps. A \
conditionally_transform around a whole optimizer needs nothing after it that changes the \
sign; one that only shapes the direction needs the rate after it.

    wrong:  optax.chain(optax.conditionally_transform(optax.adam(1e-3), fn), optax.scale(-1.0))   # -1e-3 * -1.0 where fn is True
    right:  optax.chain(optax.conditionally_transform(optax.scale_by_adam(), fn), optax.scale(-1e-3))
       or:  optax.conditionally_mask(optax.adam(1e-3), fn)   # no update where fn is False"""

_TRANSFORMING = "transforms (its should_transform_fn True)"
_SKIPPING = "skips (its should_transform_fn False: the updates passed through as they came)"

SKIPPED_UNSCALED = """\
optax.conditionally_transform passes the updates through unchanged on the steps it skips (its \
should_transform_fn False), and nothing after it applies a learning rate to {paths} ({count} \
of {total} parameters): on each skipped step the gradient (or the direction made before it) is \
added to the parameter as it came, p + g, a step up the loss at rate 1. Put the rate after it in \
a chain (the skipped steps then take a plain step down), or use optax.conditionally_mask, which \
gives the skipped steps no update. A condition is taken to never skip only where it reads as \
true at every step count (0 up to int32's largest): a constant, or a comparison of the step with \
a constant (step >= 0) and and/or/not of those; if yours never skips, the wrapper changes \
nothing: use its inner optimizer alone.

    wrong:  optax.conditionally_transform(optax.adam(1e-3), lambda step: step >= 100)   # steps 0-99: p + g
    right:  optax.chain(optax.conditionally_transform(optax.scale_by_adam(), lambda step: step >= 100), optax.scale(-1e-3))
       or:  optax.conditionally_mask(optax.adam(1e-3), lambda step: step >= 100)   # steps 0-99: no update
       or:  optax.adam(1e-3)   # a condition true on every step"""

# optax's transforms (the function building each, whose update is ``<name>.<locals>.update_fn``)
# that give a direction of the incoming updates with neither a rate nor a change of sign: a
# parameter reached by these alone is moved along its own ascent direction.
DIRECTIONS = frozenset({
    "identity", "scale_by_adam", "scale_by_adamax", "scale_by_amsgrad", "scale_by_belief", "scale_by_lion",
    "scale_by_radam", "scale_by_rms", "scale_by_rss", "scale_by_stddev", "scale_by_yogi", "trace", "ema", "clip",
    "clip_by_global_norm", "add_decayed_weights", "reduce_on_plateau",  # (contrib's: a factor in (0, 1])
    # moments, signs, preconditioners and positive factors of the updates (no rate argument)
    "scale_by_sign", "scale_by_adadelta", "scale_by_adan", "scale_by_novograd", "scale_by_sm3",
    "scale_by_factored_rms", "scale_by_lbfgs", "scale_by_param_block_norm", "scale_by_param_block_rms",
    "centralize", "zero_nans", "clip_by_block_rms", "adaptive_grad_clip",
    # optax.contrib's (normalize: sam's adversarial direction, unit norm)
    "normalize", "scale_by_acprop", "scale_by_ademamix", "scale_by_simplified_ademamix", "scale_by_adopt",
    "scale_by_muon",
})

# optax's transforms that scale the direction by a factor they close over: the function
# building each -> (the variable, whether any positive value of it applies no rate). A direction
# without a rate where the factor is concretely 1 (the default), or for a trust ratio's
# coefficient any positive value (LARS's 0.001 scales the ratio, its rate comes after it);
# another value (normalize_by_update_norm(scale_factor=-lr), a traced hyperparameter, a
# schedule) is a rate of either sign, as optax.scale's is.
FACTORED = {"scale_by_trust_ratio": ("trust_coefficient", True), "normalize_by_update_norm": ("scale_factor", False)}

# Wrappers that hand their inner transform the updates as they come, over the same
# parameters, and give the step its updates (or zeros on a step they skip): the inner
# transform's verdict is theirs. (package, the function building it) -> the closure variable
# holding the inner transform. optax.conditionally_transform passes the updates through
# unchanged on the steps it skips: the inner verdict on the steps it transforms, and none of its
# parameters rated on those it skips (read apart, :class:`_Walk`).
WRAPPERS = {
    ("optax", "with_extra_args_support"): "tx", ("optax", "lookahead"): "fast_optimizer",
    ("optax", "apply_if_finite"): "inner", ("optax", "conditionally_mask"): "inner",
    ("optax", "conditionally_transform"): "inner", ("functree", "lookahead"): "fast",
    ("functree", "skip_non_finite"): "inner", ("functree", "whole_stack"): "inner",
    ("functree", "reduce_on_plateau"): "tx",
    # optax.contrib's: z (and so the step) moves by the base's updates; the outer step by the
    # outer optimizer's (the adversarial steps ascend by design); mechanic's learned scale >= 0
    ("optax", "schedule_free"): "base_optimizer", ("optax", "sam"): "optimizer",
    ("optax", "mechanize"): "base_optimizer",
}

_DEPTH = 24  # one level per wrapper: chain, masked, partition ...
_COMBINED = 4  # conditionally_transforms read in every combination of skipping (2**4 walks) for an ascent
_UNRATED: dict[Any, Any] = {}  # (transform, gradient signature) -> indices refused, by message

# What the walk knows of a parameter's update: the sign of the factor it multiplies the
# ascent direction by (+1: up the loss), whether a factor (a rate) was met, and the traced
# factors (built from hyperparameters, numbered in :attr:`_Walk.traced`) whose signs multiply
# it, read when the build ends (:func:`_built`). A parameter the walk cannot tell (a
# scheduled rate, a transform it does not read) has no entry: never refused.
Factor = tuple[int, bool, frozenset[int]]
Factors = dict[int, Factor]
_DIRECTION: Factor = (1, False, frozenset())  # the gradient, or a direction of it: p + direction
_ASCENT: Factor = (1, True, frozenset())  # rates whose signs multiply to a plus: p + lr * direction


def _product(a: Factor, b: Factor) -> Factor:
    """Two factors one after the other (the traced ones: each numbered apart, all multiplied)."""
    return a[0] * b[0], a[1] or b[1], a[2] | b[2]


def _times(a: Factors, b: Factors) -> Factors:
    """Two transforms one after the other: the factors multiply; unknown in either, unknown."""
    return {i: _product(a[i], b[i]) for i in a.keys() & b.keys()}


def _directions(view: Any) -> Factors:
    return dict.fromkeys(_present(view), _DIRECTION)


def _concrete(value: Any, unit: bool, walk: _Walk) -> Factor | None:
    """The factor of a scale ``value``: concrete (1, or any positive value where ``unit``:
    no rate), or a traced scalar while :func:`_built` builds (numbered, its sign read from the
    build); None where it is another traced value, a schedule, zero, or of mixed signs."""
    if isinstance(value, Tracer) and walk.traced is not None and np.shape(value) == ():
        walk.traced.append(value)
        return 1, True, frozenset({len(walk.traced) - 1})
    try:
        array = np.asarray(value, dtype=float)
    except Exception:  # traced, callable: a rate of either sign
        return None
    if array.size == 0 or not (np.all(array > 0) or np.all(array < 0)):
        return None
    sign = 1 if np.all(array > 0) else -1
    return _DIRECTION if sign > 0 and (unit or bool(np.all(array == 1))) else (sign, True, frozenset())


def _scaled(found: Factors, factor: Factor | None) -> Factors:
    """``found`` times one factor (None: unknown)."""
    return {} if factor is None else {i: _product(f, factor) for i, f in found.items()}


@dataclasses.dataclass
class _Walk:
    """One reading of a transform: the gradient's leaves (indexed by the views), and which
    ``optax.conditionally_transform`` it reads on a step those skip (``skipping``: their
    places in the walk's order; the others transform). ``met`` counts those seen;
    ``traced`` holds the traced factors met while :func:`_built` builds (None outside);
    ``injected``, the values each ``optax.inject_hyperparams`` starts from
    (:func:`_injected`); ``reads``, the negative values read from those and from schedules,
    for the message. ``at_end``: schedules read at their held end (:func:`_scheduled`), else at
    step 0; ``turns``: one whose sign at
    its end differs from step 0's was met (an end walk is needed)."""

    leaves: list[Any]
    skipping: frozenset[int] = frozenset()
    met: list[int] = dataclasses.field(default_factory=lambda: [0])
    traced: list[Any] | None = None
    injected: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reads: list[Any] = dataclasses.field(default_factory=list)  # (strings, and _Turned)
    at_end: bool = False
    turns: list[bool] = dataclasses.field(default_factory=lambda: [False])

    def skips(self) -> bool:
        """Whether the conditionally_transform met now is a skipping one (counts it)."""
        self.met[0] += 1
        return self.met[0] - 1 in self.skipping


def _name(fn: Any) -> tuple[str, str]:
    """``fn``'s top package and the function that built it (``("optax", "chain")``)."""
    module = str(getattr(fn, "__module__", None) or "")
    return module.split(".")[0], str(getattr(fn, "__qualname__", "")).split(".<locals>")[0]


def _closure(fn: Any) -> dict[str, Any]:
    """The variables ``fn`` closes over (a bound method's: its object, as ``self``)."""
    if inspect.ismethod(fn):  # optax.MultiSteps(...).update
        return {"self": fn.__self__}
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):  # a builtin, a callable object: nothing to open
        return {}


def _present(view: Any) -> frozenset[int]:
    return frozenset(jax.tree.leaves(view))


def _selected(view: Any, mask: Any) -> Any:
    """``view`` with ``optax.MaskedNode`` where ``mask`` (a bool tree, a prefix) is False:
    ``optax.masked``'s own rule."""
    return jax.tree.map(lambda m, p: p if m else optax.MaskedNode(), mask, view)


def _is_function(mask: Any) -> bool:
    """``optax.masked``'s test of a mask that is a function of the updates."""
    found = jax.tree.leaves(jax.tree.map(callable, mask))
    return bool(found) and all(found)


def _through_mask(update: Any, view: Any, inner_view: Any, walk: _Walk, depth: int) -> Factors:
    """A masked transform's factors: the direction for those it leaves out (passed through
    as they came), its inner transform's (``update``) for the others."""
    left_out = dict.fromkeys(_present(view) - _present(inner_view), _DIRECTION)
    return left_out | _factors(update, inner_view, walk, depth + 1)


def _factors(update: Any, view: Any, walk: _Walk, depth: int = 0) -> Factors:
    """The factors (:data:`Factors`) of the parameters (indices into ``leaves``, the
    gradient's leaves) in ``view`` (those indices where ``update``'s transform receives a
    parameter, ``optax.MaskedNode`` where an outer mask left one out) whose update from
    ``update`` is surely a known multiple of the direction; the others left out."""
    package, built = _name(update)
    if package == "optax" and built in DIRECTIONS:
        return _directions(view)
    env = _closure(update) if depth <= _DEPTH and package in ("optax", "functree") else {}
    try:
        return _opened(package, built, env, view, walk, depth)
    except Exception:  # a mask or labels the walk cannot evaluate here: no verdict, nothing refused
        return {}


def _opened(package: str, built: str, env: dict[str, Any], view: Any, walk: _Walk, depth: int) -> Factors:
    """:func:`_factors` of a scale, chain, mask, partition or wrapper whose closure ``env``
    holds its parts. ``ft.optim.ascending`` (torch's ``maximize=True``) is not opened: its
    ascent is deliberate."""
    if package == "optax" and built == "scale" and "step_size" in env:  # (scale_by_learning_rate's too)
        return _scaled(_directions(view), _concrete(env["step_size"], False, walk))
    if package == "optax" and built == "scale_by_schedule" and "step_size_fn" in env:
        return _scaled(_directions(view), _step_size(env["step_size_fn"], walk))
    if package == "optax" and built in FACTORED and FACTORED[built][0] in env:
        name, any_positive = FACTORED[built]
        return _scaled(_directions(view), _concrete(env[name], any_positive, walk))
    updates = jax.tree.map(lambda i: walk.leaves[i], view)  # what the transform sees (its masks read it)
    if (inner := _wrapped(package, built, env, updates)) is not None:
        skipped = (package == "optax" and built == "conditionally_transform" and not _never_skips(env)
                   and walk.skips())
        found = _factors(inner.update, view, walk, depth + 1)  # (walked either way: the count of those met)
        return _directions(view) if skipped else found  # a skipped step: the updates forwarded as they came
    if package == "optax" and built == "scale_by_galore" and "base_optimizer" in env:
        return _galore(env, view, updates, walk, depth)
    if (factory := _factory(package, built, env, walk)) is not None:
        return _built(*factory, view, walk, depth)
    if package == "optax" and built == "flatten" and "inner" in env:
        return _flattened(env["inner"].update, view, walk, depth)
    if package == "optax" and built in ("chain", "named_chain") and ("update_fns" in env or "transforms" in env):
        fns = env["update_fns"] if "update_fns" in env else [tx.update for _, tx in env["transforms"]]
        found = _directions(view)
        for fn in fns:
            found = _times(found, _factors(fn, view, walk, depth + 1))
        return found
    if package == "optax" and built == "masked" and {"inner", "mask"} <= env.keys():
        mask = env["mask"](updates) if _is_function(env["mask"]) else env["mask"]
        return _through_mask(env["inner"].update, view, _selected(view, mask), walk, depth)
    if package == "optax" and built == "partition" and {"transforms", "param_labels", "make_mask"} <= env.keys():
        labels = env["param_labels"](updates) if callable(env["param_labels"]) else env["param_labels"]
        found = _directions(view)  # (each parameter in one group: the others pass it through)
        for group, tx in env["transforms"].items():
            found = _times(found, _through_mask(tx.update, view, _selected(view, env["make_mask"](labels, group)),
                                                walk, depth))
        return found
    if package == "functree" and built == "masked" and {"inner", "marks_of"} <= env.keys():
        marks = env["marks_of"](updates)  # a member array (part of a stacked leaf): transformed
        places, treedef = jax.tree.flatten(view, is_leaf=is_slot)
        inner_view = treedef.unflatten([p if is_slot(p) or is_partial(m) or m else optax.MaskedNode()
                                        for p, m in zip(places, marks)])
        return _through_mask(env["inner"].update, view, inner_view, walk, depth)
    if package == "functree" and built == "groups" and {"by_leaf", "split"} <= env.keys():
        return {} if env["split"](updates) else _factors(env["by_leaf"].update, view, walk, depth + 1)
    return {}


def _galore(env: dict[str, Any], view: Any, updates: Any, walk: _Walk, depth: int) -> Factors:
    """:func:`_factors` of ``optax.contrib.scale_by_galore``: its base transform's, read on
    the low-rank updates it gets (each projected matrix; its masks read those), times its
    ``scale`` where concrete. The projection and its transpose keep the direction's sign:
    with ``scale_by_adam``, its default base, it climbs; with ``adam(lr)`` as the base and
    galore's own ``learning_rate`` (``scale_by_learning_rate``) after it, it climbs too."""
    leaves = list(walk.leaves)
    for i, low in zip(jax.tree.leaves(view), jax.tree.leaves(_low_rank(env, updates))):
        leaves[i] = low
    base = _factors(env["base_optimizer"].update, view, dataclasses.replace(walk, leaves=leaves), depth + 1)
    return _times(base, _scaled(_directions(view), _concrete(env.get("scale"), False, walk)))


def _low_rank(env: dict[str, Any], updates: Any) -> Any:
    """The updates (abstract) that ``scale_by_galore`` hands its base: a copy of it, with
    the same rank and dimension numbers, traced around a base that records them."""
    seen: list[Any] = []

    def record(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        seen.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), updates))
        return updates, state

    def empty(params: Any) -> Any:
        return optax.EmptyState()

    numbers = _closure(env["_get_dim_nums"])["weight_dimension_numbers"]
    copy = optax.contrib.scale_by_galore(rank=env["rank"], update_proj_gap=env["update_proj_gap"],
                                         base_optimizer=optax.GradientTransformation(empty, record),
                                         weight_dimension_numbers=numbers)
    jax.eval_shape(lambda u: copy.update(u, copy.init(u))[0], updates)
    return seen[0]


class _Ends(frozenset):
    """The ends of a range of integers (the step count): a comparison with a constant takes
    its values over the range at the ends; no other operation reads it."""


_STEPS = _Ends({0, int(np.iinfo(np.int32).max)})  # conditionally_transform's count: from 0, saturating
_ORDERED = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
_LOGICAL = {"and": operator.and_, "or": operator.or_, "xor": operator.xor}


def _never_skips(env: dict[str, Any]) -> bool:
    """Whether ``optax.conditionally_transform``'s condition (its closure ``env``) is True at
    every step count it can be given (0 to int32's largest: optax counts from 0 and
    saturates), read from its jaxpr on an abstract count: a constant, a comparison of the
    count with a constant (``step >= 0``), and/or/not of those. Anything else (a condition
    on the extra arguments, Python control flow, arithmetic on the count) may skip."""
    fn = env.get("should_transform_fn")
    if not callable(fn) or env.get("forward_extra_args") is not False:
        return False
    try:
        closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((), jnp.int32))
        return _condition_values(closed) == {True}
    except Exception:  # traced Python control flow, an output not one scalar: may skip
        return False


def _condition_values(closed: Any) -> Any:
    """The values a one-argument jaxpr's output takes over :data:`_STEPS` (a set, or None
    where an operation is not one :func:`_possible` reads)."""
    from jax.extend import core as jcore

    jaxpr = closed.jaxpr
    known: dict[Any, Any] = {v: _scalar(c) for v, c in zip(jaxpr.constvars, closed.consts)}
    known[jaxpr.invars[0]] = _STEPS

    def read(atom: Any) -> Any:
        return _scalar(atom.val) if isinstance(atom, jcore.Literal) else known.get(atom)

    for eqn in jaxpr.eqns:
        known[eqn.outvars[0]] = _possible(eqn.primitive.name, [read(a) for a in eqn.invars], eqn.params)
    (out,) = jaxpr.outvars
    return read(out)


def _scalar(value: Any) -> Any:
    """A constant's one possible value, or None (an array: not read)."""
    array = np.asarray(value)
    return frozenset({array.item()}) if array.size == 1 else None


def _possible(name: str, args: list[Any], params: dict[str, Any]) -> Any:
    """The values an operation's output can take given its inputs' (None: unknown). A
    comparison with the count's ends gives its values over the whole range (monotone);
    and/or/not combine booleans' values apart, so a correlated pair may read as both: a
    refusal, never a pass on a guess."""
    if any(a is None for a in args):
        return None
    if name in _ORDERED and len(args) == 2:
        return frozenset(_ORDERED[name](x, y) for x in args[0] for y in args[1])
    booleans = all(not isinstance(a, _Ends) and all(isinstance(x, bool) for x in a) for a in args)
    if name in _LOGICAL and len(args) == 2 and booleans:
        return frozenset(_LOGICAL[name](x, y) for x in args[0] for y in args[1])
    if name == "not" and len(args) == 1 and booleans:
        return frozenset(not x for x in args[0])
    if name == "convert_element_type" and len(args) == 1:  # monotone: the count's ends stay its ends
        converted = frozenset(np.asarray(x, params["new_dtype"]).item() for x in args[0])
        return _Ends(converted) if isinstance(args[0], _Ends) else converted
    return None


def _step_size(fn: Any, walk: _Walk) -> Factor | None:
    """The factor of ``optax.scale_by_schedule(fn)``: ``scale_by_learning_rate(schedule)``'s
    ``m * schedule(count)`` read as the learning rate's schedule times its sign ``m``."""
    env = _closure(fn)
    if _name(fn) == ("optax", "scale_by_learning_rate") and env.get("m") in (1, -1) and callable(
            env.get("learning_rate")):
        return _scheduled(env["learning_rate"], env["m"], walk, f"the learning rate {_schedule_name(env['learning_rate'])}")
    return _scheduled(fn, 1, walk, f"optax.scale_by_schedule({_schedule_name(fn)})")


def _schedule_name(fn: Any) -> str:
    """A schedule for the message: optax's by the function that made it, another by its name."""
    package, built = _name(fn)
    return f"optax.{built}" if package == "optax" else str(getattr(fn, "__name__", "") or repr(fn))


def _scheduled(fn: Any, sign: int, walk: _Walk, what: str, unit: str = "step", steps: bool = True
               ) -> Factor | None:
    """The factor of ``sign * fn(count)``, a schedule of the step count: its sign at step 0
    (the first step's), or with ``walk.at_end`` at its end where it holds one value from a
    step on (optax's schedules hold their last value; a function still changing there, as a
    line falling past its last step, has none: not read). None where it is 0 there, or cannot
    be read (:func:`~functree.optim._schedule_reads.schedule_read`: optax's constructors from
    their numbers, other functions evaluated on concrete counts). ``steps``: its count is the
    optimizer's steps (a run's horizon bounds it, :func:`training_horizon`)."""
    read = schedule_read(fn)
    if read is None:
        return None
    first = _constant_sign(read.start)
    end = None if read.end is None else _constant_sign(read.end)
    walk.turns[0] = walk.turns[0] or (end is not None and end != first)
    at, known = (read.end, end) if walk.at_end else (read.start, first)
    if known is None or at is None:
        return None
    if walk.at_end and end != first:  # (the schedule that turns: named with the step it turns at, if refused)
        walk.reads.append(_Turned(what, at, read, fn, known, unit, steps and unit == "step"))
    elif not walk.at_end and at < 0:
        walk.reads.append(f"{what} is {at:.6g} at {unit} 0")
    return sign * known, True, frozenset()


@dataclasses.dataclass(frozen=True)
class _Turned:
    """A schedule that turns, for :data:`ASCENDING_LATER`'s message: the step it turns at is
    found (for one derived from its numbers, evaluated) only where the message is made."""

    what: str
    at: float
    read: Any
    fn: Any
    sign: int
    unit: str = "step"
    steps: bool = True  # (counted in the optimizer's steps: a run's horizon bounds it)

    def turn(self) -> int | None:
        """The optimizer step it turns at (None: counted otherwise, or not found)."""
        return turning_step(self.read, self.fn, self.sign) if self.steps else None

    def __str__(self) -> str:
        since = turning_step(self.read, self.fn, self.sign)
        if since is None:
            return f"{self.what} is {self.at:.6g} at its end"
        # (the sign holds from `since` on; the value there may be another: a line still falling)
        return f"{self.what} is {'negative' if self.at < 0 else 'positive'} from {self.unit} {since} on, {self.at:.6g} at its end"


def _flattened(update: Any, view: Any, walk: _Walk, depth: int) -> Factors:
    """:func:`_factors` of ``optax.flatten``'s inner transform, which sees one vector, the
    parameters it receives raveled end to end: they all get its one factor. Read on an
    abstract vector (its masks evaluated on that, as optax evaluates them on the vector)."""
    present = _present(view)
    if not present:
        return {}
    size = sum(int(np.size(walk.leaves[i])) for i in present)
    flat = jax.ShapeDtypeStruct((size,), jnp.result_type(*(walk.leaves[i] for i in present)))
    inner = dataclasses.replace(walk, leaves=[flat])  # (the count of conditionally_transforms shared)
    found = _factors(update, 0, inner, depth + 1)
    return dict.fromkeys(present, found[0]) if 0 in found else {}


def _wrapped(package: str, built: str, env: dict[str, Any], updates: Any) -> Any:
    """The inner transform of a wrapper that gives it the updates over the same parameters
    (:data:`WRAPPERS`, ``optax.MultiSteps``, ``ft.optim.per_member`` on no Stack), or None."""
    if (package, built) in WRAPPERS:
        return env.get(WRAPPERS[package, built])
    if package == "optax" and built == "MultiSteps.update" and isinstance(env.get("self"), optax.MultiSteps):
        return env["self"].inner_opt  # (every k-th step the inner update of the summed gradients, else zeros)
    if package == "functree" and built == "per_member" and "inner" in env and not _has_stack(updates):
        return env["inner"]  # (on a Stack it sees each member as a parameter: another tree, not walked)
    return None


def _factory(package: str, built: str, env: dict[str, Any], walk: _Walk
             ) -> tuple[Any, list[str], dict[str, Any], dict[str, int | None]] | None:
    """``(factory, hyperparameter names, fixed arguments, the signs known of some)`` of a
    transform rebuilt at each step from its hyperparameters (``optax.inject_hyperparams``,
    ``ft.optim.inject`` and the ft.optim optimizers made by it), or None. optax's take the
    sign of the number given (its state starts from it: the first step's value,
    :func:`_injected`), its schedules none; ft.optim's checks keep some >= 0
    (:func:`_non_negative`)."""
    if package == "optax" and built == "inject_hyperparams" and {"inner_factory", "other_hps"} <= env.keys():
        fixed = env["other_hps"]  # (booleans, None, static_args: the rest are numbers or schedules)
        named = inspect.signature(env["inner_factory"]).parameters.values()
        names = [p.name for p in named if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed]
        numbers = walk.injected.get(id(env.get("sched_hps")), {})
        signs = {name: _constant_sign(value) for name, value in numbers.items()}
        walk.reads.extend(f"{_factory_name(env['inner_factory'])}({name}={_shown(numbers[name])})"
                          for name, sign in signs.items() if sign == -1)
        for name, schedule in (env.get("sched_hps") or {}).items():  # (a StatefulSchedule: not read)
            what = f"{_factory_name(env['inner_factory'])}({name}=schedule)"
            if callable(fn := getattr(schedule, "schedule_fn", None)):
                found = _scheduled(fn, 1, walk, what)
                signs[name] = None if found is None else found[0]
        return env["inner_factory"], names, fixed, signs
    if package == "functree" and built == "inject" and "step" in env:
        made = _closure(_closure(env["step"]).get("build"))
        if {"factory", "specs", "static"} <= made.keys():
            where = str(made.get("where", "ft.optim"))
            signed = {name: _spec_sign(name, spec, where, walk) for name, spec in made["specs"].items()}
            return made["factory"], list(made["specs"]), made["static"], signed
    return None


def _factory_name(factory: Any) -> str:
    """``optax.inject_hyperparams(optax.adam)`` for the message (the factory's own name)."""
    package, built = _name(factory)
    return f"optax.inject_hyperparams({package + '.' if package == 'optax' else ''}{built or 'factory'})"


def _shown(value: Any) -> str:
    """A hyperparameter's value as code (a scalar array as its number)."""
    if isinstance(value, _Written):
        return f"{float(value)!r}, written into its state's hyperparams"
    try:
        return repr(np.asarray(value).item())
    except Exception:  # an array of several values: its repr
        return repr(value)


def _injected(init: Any) -> dict[int, dict[str, Any]]:
    """The numbers each ``optax.inject_hyperparams`` reachable from ``init`` (the user's
    transform's init function) was given, keyed by the identity of its dict of schedules
    (``sched_hps``), which its init and update functions share. Its state starts from them,
    the first step's values: the update function, which the walk reads, finds them only in
    the state (traced in the jitted step). Read from the closures of optax's and functree's
    functions, tuples (a transform's init and update), dicts and optax's objects."""
    found: dict[int, dict[str, Any]] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(init, 0)]
    while stack:
        part, depth = stack.pop()
        if id(part) in seen or depth > _DEPTH:
            continue
        seen.add(id(part))
        stack.extend((inner, depth + 1) for inner in _parts(part, found))
    return found


def _parts(part: Any, found: dict[int, dict[str, Any]]) -> list[Any]:
    """What :func:`_injected` reads next in ``part`` (an inject_hyperparams' init: its numbers, into ``found``)."""
    if isinstance(part, (tuple, list)):
        return list(part)
    if isinstance(part, dict):
        return list(part.values())
    package, built = _name(part)
    if package not in ("optax", "functree"):
        return []
    if inspect.isfunction(part) or inspect.ismethod(part):
        env = _closure(part)
        if package == "optax" and built == "inject_hyperparams" and {"numeric_hps", "sched_hps"} <= env.keys():
            found[id(env["sched_hps"])] = env["numeric_hps"]
        return list(env.values())
    return list(vars(part).values()) if package == "optax" and hasattr(part, "__dict__") else []


class _Written(float):
    """A number the user wrote into an ``optax.inject_hyperparams`` state (named so in the message)."""


def _written(state: Any) -> tuple[tuple[str, float], ...]:
    """The host numbers (Python's, NumPy's: never a device array, whose read would wait for
    the step) in the hyperparameters of the one ``optax.inject_hyperparams`` state in
    ``state``: optax keeps arrays there, so these were written by hand
    (``state.inner.hyperparams["learning_rate"] = -0.1``), and the next step uses them. None
    where there is no such state or several (whose is whose is not read), and while a step
    traces (the values are traced)."""
    nodes = [n for n in jax.tree.leaves(state, is_leaf=_is_injected_state) if _is_injected_state(n)]
    if len(nodes) != 1 or not isinstance(getattr(nodes[0], "hyperparams", None), dict):
        return ()
    return tuple(sorted((str(name), float(value)) for name, value in nodes[0].hyperparams.items()
                        if isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))))


def _is_injected_state(x: Any) -> bool:
    return isinstance(x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))


def _overwritten(injected: dict[int, dict[str, Any]], written: tuple[tuple[str, float], ...]
                 ) -> dict[int, dict[str, Any]]:
    """:func:`_injected`'s numbers with those ``written`` into the state (:func:`_written`),
    where the transform holds one ``inject_hyperparams`` (the state's); its numbers only (a
    scheduled one is computed again at the step)."""
    if not written or len(injected) != 1:
        return injected
    ((key, numbers),) = injected.items()
    return {key: {**numbers, **{name: _Written(value) for name, value in written if name in numbers}}}


def _non_negative(name: str, spec: Any) -> bool:
    """Whether ft.optim keeps hyperparameter ``name`` (its :class:`_Spec`) >= 0: its rule
    (:data:`RULES`, checked where it is given and set) refuses a negative value, and it is a
    number or one of functree's schedules (their values checked too); a function's values are not."""
    rule = RULES.get(name)
    scheduled = getattr(spec, "scheduled", True)
    return rule is not None and not rule[0](-1e-30) and (not scheduled or values_of(spec.rate.value) is not None)


def _spec_sign(name: str, spec: Any, where: str, walk: _Walk) -> int | None:
    """The sign of ft.optim hyperparameter ``name`` (its :class:`_Spec`): +1 where ft.optim
    keeps it >= 0 (:func:`_non_negative`); a function of the learning context read as a
    schedule (:func:`_context_schedule`: ``sgd(lambda ctx: -0.1)`` is negative at step 0);
    else unknown (None). A rate per samples scales it by M / samples > 0: the same sign."""
    if _non_negative(name, spec):
        return 1
    fn = getattr(getattr(spec, "rate", None), "value", None)
    if not getattr(spec, "scheduled", False) or not callable(fn):
        return None
    inner, unit, steps = _context_schedule(fn)
    found = _scheduled(inner, 1, walk, f"{where}({name}={_context_name(fn)})", unit, steps)
    return None if found is None else found[0]


def _context_schedule(fn: Any) -> tuple[Any, str, bool]:
    """A function of the learning context as a schedule of one count, that count's unit, and
    whether it counts the optimizer's steps alone: ``ft.optim.schedule(optax_fn, unit)``'s own
    optax schedule (read from its numbers); any other with the step, sweep and samples seen
    all at the count (minibatch 1: the same at step 0, and each held end where it holds one),
    named in steps, but not bounded by a run's steps (samples run ahead of them)."""
    wrapped = _wrapped_schedule(fn)
    if wrapped is not None:
        inner, unit = wrapped
        return inner, _UNITS[unit], unit == "steps"
    try:
        return _OF_COUNT[fn], "step", False
    except (KeyError, TypeError):  # (not made yet; a callable taking no weak reference: made each time)
        pass
    held = _held(fn)

    def of_count(count: Any) -> Any:
        counters = jnp.stack([count, count, count, jnp.ones_like(count), jnp.zeros_like(count)])
        return held()(LearningContext(counters.astype(jnp.int32), jnp.asarray(jnp.nan)))

    with contextlib.suppress(TypeError):
        _OF_COUNT[fn] = of_count  # (the same function each walk: its values read once)
    return of_count, "step", False


# a function of the learning context -> its schedule of the count (held weakly by both)
_OF_COUNT: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _held(fn: Any) -> Any:
    """A weak reference to ``fn`` where it takes one (a cached schedule must not keep it alive)."""
    try:
        return weakref.ref(fn)
    except TypeError:
        return lambda: fn


_UNITS = {"steps": "step", "sweeps": "sweep", "samples": "sample"}


def _wrapped_schedule(fn: Any) -> tuple[Any, str] | None:
    """``(optax_fn, unit)`` where ``fn`` is ``ft.optim.schedule(optax_fn, unit)`` (its record)."""
    wrapped = getattr(fn, "__ft_schedule__", None)
    return wrapped if isinstance(wrapped, tuple) and len(wrapped) == 2 and wrapped[1] in _UNITS else None


def _context_name(fn: Any) -> str:
    """A function of the learning context for the message (``ft.optim.schedule(optax.constant_schedule)``)."""
    wrapped = _wrapped_schedule(fn)
    if wrapped is not None:
        inner, unit = wrapped
        return f"ft.optim.schedule({_schedule_name(inner)}{'' if unit == 'steps' else f', unit={unit!r}'})"
    return _schedule_name(fn)


def _built(factory: Any, names: list[str], fixed: dict[str, Any], signs: dict[str, int | None], view: Any,
           walk: _Walk, depth: int) -> Factors:
    """:func:`_factors` of ``factory(**fixed, **hyperparameters)``, built as the jitted step
    builds it: each hyperparameter an abstract scalar, so its structure is the step's (a
    factory whose structure reads a value raises here: no verdict). A factor made of
    hyperparameters (optax's ``scale_by_learning_rate``: ``-1.0 * learning_rate``) is traced;
    its sign is read from the build's jaxpr (:func:`_traced_signs`), the hyperparameters'
    from ``signs`` (+1: >= 0, -1: < 0), the others of either sign (no refusal on a guess)."""
    found: list[Factors] = []
    traced: list[Any] = []

    def build(values: dict[str, Any]) -> list[Any]:
        found.append(_factors(factory(**fixed, **values).update, view, dataclasses.replace(walk, traced=traced),
                              depth + 1))
        return traced

    closed = jax.make_jaxpr(build)({name: jax.ShapeDtypeStruct((), jnp.float32) for name in names})
    factors = _traced_signs(closed, [signs.get(name) for name in sorted(names)])
    return {i: (f[0] * math.prod(factors[k] or 0 for k in f[2]), f[1], frozenset())
            for i, f in found[0].items() if all(factors[k] for k in f[2])}


_SIGN_KEEPING = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
_SIGN_MULTIPLYING = frozenset({"mul", "div"})


def _traced_signs(closed: Any, inputs: list[int | None]) -> list[int | None]:
    """The signs of a jaxpr's outputs (+1: >= 0, -1: <= 0, None: unknown) given its inputs':
    a product, quotient or negation of those and of constants; anything else unknown."""
    from jax.extend import core as jcore

    jaxpr = closed.jaxpr
    known: dict[Any, int | None] = dict(zip(jaxpr.invars, inputs))
    known.update((v, _constant_sign(c)) for v, c in zip(jaxpr.constvars, closed.consts))

    def read(atom: Any) -> int | None:
        return _constant_sign(atom.val) if isinstance(atom, jcore.Literal) else known.get(atom)

    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        name, sign = eqn.primitive.name, None
        if all(args) and name in _SIGN_MULTIPLYING | _SIGN_KEEPING | {"neg"}:
            sign = math.prod(a or 0 for a in args) * (-1 if name == "neg" else 1)
        known.update(dict.fromkeys(eqn.outvars, sign))
    return [read(out) for out in jaxpr.outvars]


def _constant_sign(value: Any) -> int | None:
    """A constant's sign where all of it is of one sign, not zero (a zero factor moves nothing)."""
    try:
        array = np.asarray(value)
    except Exception:  # an outer trace's value, closed over by the factory: unknown
        return None
    return 1 if np.all(array > 0) else -1 if np.all(array < 0) else None


def _unrated_indices(transform: Any, grads: Any, written: tuple[tuple[str, float], ...] = ()
                     ) -> tuple[Any, int | None]:
    """The indices of ``grads``' leaves (flattened with ``None`` as a leaf) whose parameter
    ``transform`` applies no rate to at any step, those it surely moves up the loss (on a
    step an ``optax.conditionally_transform`` skips too), those it applies no rate to on the
    steps one skips, and those it moves up the loss once a schedule turns, each with the
    values read for its message (:attr:`_Walk.reads`), and the step the schedules turn at
    (:func:`_first_turn`): once per transform, gradient signature and ``written`` numbers
    (:func:`_written`)."""
    leaves, treedef = jax.tree.flatten(grads, is_leaf=is_none)
    try:
        who: Any = WeakIdentity(transform)
    except TypeError:  # a transform taking no weak reference: walked, never cached
        who = None
    signature = tuple(None if g is None else (np.shape(g), jnp.result_type(g)) for g in leaves)
    key, found = cached(_UNRATED, (who, treedef, signature, written))
    if found is None:
        view = treedef.unflatten([None if g is None else i for i, g in enumerate(leaves)])
        found = _unrated_walks(transform, view, leaves, written)
        if key is not None and who is not None:
            bounded_put(_UNRATED, key, found)
    return found


def _unrated_walks(transform: Any, view: Any, leaves: list[Any], written: tuple[tuple[str, float], ...] = ()
                   ) -> tuple[Any, int | None]:
    """:func:`_unrated_indices` walked: once with every conditionally_transform transforming,
    then once per one of them skipping (each has its own condition: never all at once). A
    direction stays one whatever else skips; an ascent is refused where every combination of
    them skipping ascends (two that skip on alternate steps, each with a minus sign, never
    apply both), not read past :data:`_COMBINED` of them; with one, where either reading
    ascends (:data:`ASCENDING_ON_STEPS`: it transforms on some steps and may skip on others,
    ``chain(conditionally_transform(adam(lr), fn), scale(-1))`` climbs where fn is True). Where a
    schedule turns sign, its held end is read too (:data:`ASCENDING_LATER`). Each refusal's
    indices come with the values read for its message; last, the step the schedules turn at
    (:func:`_first_turn`)."""
    update = getattr(transform, "update", None)
    first = _Walk(leaves, injected=_overwritten(_injected(getattr(transform, "init", None)), written))
    walk = functools.partial(_Walk, leaves, injected=first.injected)
    always = _factors(update, view, first)
    count = first.met[0]
    unrated = {i for i, f in always.items() if f == _DIRECTION}
    skips = [_factors(update, view, walk(frozenset({k}))) for k in range(count)]
    skipped = set().union(*({i for i, f in found.items() if f == _DIRECTION} for found in skips)) - unrated
    ascending = _ascending(update, view, walk, always, count)
    # one conditionally_transform: each reading happens (its condition may skip), so an ascent in either is sure
    transforming, skipping = ({i for i, f in found.items() if f == _ASCENT} - ascending if count == 1 else set()
                              for found in (always, skips[0] if skips else {}))
    later: set[int] = set()
    end = walk(at_end=True)
    if first.turns[0]:  # (else each schedule's end has its step 0's sign: the same verdict)
        later = _ascending(update, view, functools.partial(walk, at_end=True), _factors(update, view, end), count)
    turned = "; ".join(dict.fromkeys(map(str, end.reads))) if later - ascending else ""  # (a step evaluated: refused only)
    return ((tuple(sorted(unrated)), ""), (tuple(sorted(ascending)), _given(first.reads)), (tuple(sorted(skipped)), ""),
            (tuple(sorted(transforming)), _TRANSFORMING), (tuple(sorted(skipping)), _SKIPPING),
            (tuple(sorted(later - ascending)), turned)), _first_turn(end.reads) if later - ascending else None


def _first_turn(reads: list[Any]) -> int | None:
    """The first optimizer step a schedule read at its end turns at (:class:`_Turned`), for a
    run's horizon; None where one is counted otherwise (sweeps, samples, a function of the
    whole context) or its step is not found: refused whatever the horizon."""
    turns = [read.turn() for read in reads if isinstance(read, _Turned)]
    known = [turn for turn in turns if turn is not None]
    return min(known) if known and len(known) == len(turns) else None


def _ascending(update: Any, view: Any, walk: Any, always: Factors, count: int) -> set[int]:
    """The parameters ``always`` (the walk with every conditionally_transform transforming)
    moves up the loss, which every combination of them skipping (``walk(skipping)``) does too."""
    ascending = {i for i, f in always.items() if f == _ASCENT} if count <= _COMBINED else set()
    for combination in range(1, 2**count if ascending else 1):
        skipping = frozenset(k for k in range(count) if combination >> k & 1)
        found = _factors(update, view, walk(skipping))
        ascending = {i for i in ascending if found.get(i) == _ASCENT}
    return ascending


def _given(reads: list[str]) -> str:
    """The values read for :data:`ASCENDING_UPDATE` (a sentence, or nothing)."""
    return f" Given: {', '.join(dict.fromkeys(reads))}." if reads else ""


def _trained(missing: Any) -> bool:
    """Whether a gradient leaf gets an update: not missing (``None``), not all its members frozen."""
    return not bool(np.all(missing))


def check_rate_applied(transform: Any, grads: Any, partial: Any, only_later: bool = False, state: Any = None) -> None:
    """Raise :data:`NO_LEARNING_RATE` where ``transform`` (the user's, as given to the
    Optimizer) surely applies no learning rate to a parameter that has a gradient, and
    :data:`ASCENDING_UPDATE` where its rates surely multiply to a positive factor (``grads``:
    what the transform receives; ``partial``: :func:`checked_gradients`' marks of missing
    gradients and frozen members, or None; ``state``: the transform's state, whose
    hyperparameters written by hand are read, :func:`_written`). Under :func:`training_horizon`, a schedule that
    turns past the run's steps is not refused; ``only_later``: only that refusal is read
    (:func:`check_horizon`).

    Example:
      >>> import optax, jax.numpy as jnp
      >>> grads = {"body": jnp.ones(2), "head": jnp.ones(2)}
      >>> check_rate_applied(optax.adam(1e-3), grads, None)
      >>> try:
      ...     check_rate_applied(optax.chain(optax.scale_by_adam(),
      ...                                    optax.masked(optax.scale(-1e-3), {"body": False, "head": True})), grads, None)
      ... except ValueError as e:
      ...     print(str(e)[:78])
      The optimizer's transform applies no learning rate to body (1 of 2 parameters)
    """
    if any(jnp.iscomplexobj(g) for g in jax.tree.leaves(grads)):
        return  # trained as pairs of reals (RealPair): another tree than the one walked here
    refused, turn = _unrated_indices(transform, grads, _written(state))
    if not any(indices for indices, _ in refused):
        return
    flat = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
    missing = [False] * len(flat) if partial is None else list(partial[1])
    trained = {i for i, ((_, g), m) in enumerate(zip(flat, missing)) if g is not None and _trained(m)}
    for (unrated, detail), message in zip(refused, (NO_LEARNING_RATE, ASCENDING_UPDATE, SKIPPED_UNSCALED,
                                                    ASCENDING_ON_STEPS, ASCENDING_ON_STEPS, ASCENDING_LATER)):
        if only_later and message is not ASCENDING_LATER:
            continue
        same = [dotted_name(flat[i][0]) or "<root>" for i in unrated if i in trained]
        if same:
            shown = ", ".join(same[:4]) + (f" and {len(same) - 4} more" if len(same) > 4 else "")
            error = ConfigurationError(message.format(paths=shown, count=len(same), total=len(trained), detail=detail))
            if message is ASCENDING_LATER and _before_turn(turn):
                continue
            raise error


_HORIZON: contextvars.ContextVar[int | None] = contextvars.ContextVar("ft_training_horizon", default=None)


@contextlib.contextmanager
def training_horizon(steps: int | None) -> Iterator[None]:
    """While a run of ``steps`` optimizer steps in all (counted from 0: the last is
    ``steps - 1``; None: unknown) traces its step, a schedule that turns at a later step is
    not refused (:data:`ASCENDING_LATER`). A compiled step is shared by runs of other lengths
    (``ft.train``'s programs): each run is checked up front too (:func:`check_horizon`).
    ``ft.train.Trainer.fit`` sets both."""
    token = _HORIZON.set(steps)
    try:
        yield
    finally:
        _HORIZON.reset(token)


def _before_turn(turn: int | None) -> bool:
    """Whether the running horizon (:func:`training_horizon`) ends before step ``turn``."""
    horizon = _HORIZON.get()
    return horizon is not None and turn is not None and turn >= horizon


def check_horizon(transform: Any, params: Any, steps: int | None) -> None:
    """Raise :data:`ASCENDING_LATER` before a run of ``steps`` optimizer steps in all of
    ``transform`` on ``params`` (the trained parameters, as its gradients) where one of its
    schedules turns within them (or at a step not known, or ``steps`` is None): the read of
    :func:`check_rate_applied`, cached, with nothing traced."""
    with training_horizon(steps):
        check_rate_applied(transform, params, None, only_later=True)
