"""Optax's extra arguments, as ``ft.optim.Optimizer`` passes them to its transform: the
learning context (``context=``), the step's loss when given (``loss=``), L-BFGS's
``value``, ``value_fn`` and ``grad``; and the transformations that take only some (``optax.contrib.sam``'s update, ``optax.MultiSteps``
behind ``optax.with_extra_args_support``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import optax

from functree._parameters import with_parameters
from functree._tree import dotted_name
from functree.nn._mode import in_mode
from functree.optim._checks import descent_direction
from functree.optim._hyper import HyperState

if TYPE_CHECKING:
    from functree.optim._optimizer import Optimizer

__all__ = ["taking_extras", "check_context_reaches", "with_extras", "loss_value_fn", "extra_arguments",
           "EXTRAS_REFUSED", "CONTEXT_NOT_PASSED"]

EXTRAS_REFUSED = """\
A transformation inside the Optimizer's transform refuses optax's extra arguments ({error}). \
ft.optim.Optimizer passes the learning context to its transform as the extra argument \
context=, which optax.chain (optax.masked, ...) hands to every transformation inside; an \
optax.GradientTransformationExtraArgs whose update takes no **extra_args (optax.contrib.sam's) \
refuses it. Make that transformation the outermost one: the Optimizer gives it only the \
keywords its update takes.

    wrong:  ft.optim.Optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.sam(opt, adv_opt)))
    right:  ft.optim.Optimizer(optax.contrib.sam(optax.chain(optax.clip_by_global_norm(1.0), opt), adv_opt))
"""

CONTEXT_NOT_PASSED = """\
The transform's update {given} takes no optax extra arguments (no **extra_args), so it cannot pass the \
learning context to the ft.optim transformations inside it ({where}): their hyperparameters \
and schedules read it. Inside such a transformation (optax.contrib.sam), use optax's own:

    wrong:  ft.optim.Optimizer(optax.contrib.sam(ft.optim.sgd(0.1), adv_opt))
    right:  ft.optim.Optimizer(optax.contrib.sam(optax.sgd(0.1), adv_opt))
"""


def _keywords(transform: Any) -> frozenset[str] | None:
    """The keyword arguments ``transform.update`` takes beyond ``(updates, state, params)``
    when it is an ``optax.GradientTransformationExtraArgs`` whose update has no
    ``**extra_args`` (``optax.contrib.sam``'s takes ``grad_fn`` only); else None (it takes
    any, or optax.with_extra_args_support drops those of a plain transformation)."""
    if not isinstance(transform, optax.GradientTransformationExtraArgs):
        return None
    try:
        parameters = list(inspect.signature(transform.update).parameters.values())
    except (TypeError, ValueError):  # an update without a signature: given every keyword
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters[3:]
                     if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def taking_extras(transform: Any) -> Any:
    """``transform`` given only the extra arguments its update takes (:func:`_keywords`):
    optax's contract is that a GradientTransformationExtraArgs ignores those it does not
    know, which ``optax.contrib.sam`` breaks, refusing the Optimizer's ``context=``."""
    names = _keywords(transform)
    if names is None:
        return transform

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return transform.update(updates, state, params, **{k: v for k, v in extra.items() if k in names})

    return optax.GradientTransformationExtraArgs(transform.init, update)


def check_context_reaches(transform: Any, inner: Any) -> None:
    """:data:`CONTEXT_NOT_PASSED` where ``transform`` passes no extra arguments (so no
    ``context=``) on, and its state holds a functree transform's (which needs it)."""
    names = _keywords(transform)
    if names is None or "context" in names:
        return
    paths = jax.tree_util.tree_flatten_with_path(inner, is_leaf=lambda x: isinstance(x, HyperState))[0]
    hyper = [dotted_name(p) or "<root>" for p, x in paths if isinstance(x, HyperState)]
    if hyper:
        given = getattr(transform.update, "__qualname__", type(transform).__name__)
        raise TypeError(CONTEXT_NOT_PASSED.format(given=given, where="the state at " + ", ".join(hyper)))


def with_extras(transform: Any) -> Any:
    """``transform``, an ``optax.MultiSteps`` as the ``GradientTransformationExtraArgs`` its
    ``update`` is (it takes ``**extra_args`` and passes them on, but is no such instance:
    ``optax.with_extra_args_support`` wrapped it in a layer that dropped them, and an inner
    ``reduce_on_plateau`` never got its ``value=``)."""
    if isinstance(transform, optax.MultiSteps):
        return optax.GradientTransformationExtraArgs(transform.init, transform.update)  # pyright: ignore[reportArgumentType]
    return transform


def loss_value_fn(opt: Optimizer, loss_fn: Callable[..., Any], batch: tuple, has_aux: bool) -> Callable[[Any], Any]:
    """The differentiated loss of this batch as a function of the model (L-BFGS's line
    search evaluates it at trial points; nothing runs unless a transform calls it)."""
    def value_fn(model: Any) -> Any:
        out = loss_fn(model, *batch)
        return opt.transform_loss(out[0] if has_aux else out)

    return value_fn


def extra_arguments(extra: dict[str, Any], grads: Any, model: Any, view: Any = None) -> dict[str, Any]:
    """Optax's extra arguments for the transform, from :meth:`Optimizer.update`'s keywords:
    ``value_fn`` (a function of the model) as a function of the parameter view the
    transform sees (``None`` leaves keep the model's; mode-free, so put back in the mode of
    ``view``, the model's parameter view's tree definition: a Trainer's model in training
    mode is another tree than its optimizer's parameters), ``grad`` defaulting to ``grads``
    (conjugated already) when ``value`` or ``value_fn`` is given, and ``grad_fn(params, i)``
    (``optax.contrib.sam``'s in opaque mode) defaulting to the gradient of that
    ``value_fn``, conjugated as ``grads`` are (the batch's loss: ``i``, optax's index of
    the adversarial step, is not read; the gradient hooks do not run on it)."""
    extra = dict(extra)
    value_fn = extra.get("value_fn")
    if value_fn is not None and model is not None:
        # optax's line search passes value_fn the Optimizer's other extra arguments (and
        # refuses any it does not take): context=, loss=, grad_fn= (below) are not read
        def on_view(params: Any, context: Any = None, loss: Any = None, grad_fn: Any = None) -> Any:
            return value_fn(with_parameters(model, in_mode(params, (view,))))

        extra["value_fn"] = on_view
        if "grad_fn" not in extra:  # optax.contrib.sam(opaque_mode=True): gradients at its adversarial points
            def grad_fn(params: Any, i: Any = None) -> Any:
                return descent_direction(jax.grad(on_view)(params))

            extra["grad_fn"] = grad_fn
    if "grad" in extra:
        extra["grad"] = descent_direction(extra["grad"])
    elif "value" in extra or "value_fn" in extra:
        extra["grad"] = grads
    return extra
