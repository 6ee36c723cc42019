"""Optimizers whose hyperparameters are written once: in the signature, as :data:`Hyper`.

An optimizer is one function: its signature declares every argument (a hyperparameter is
annotated :data:`Hyper`; any other argument is a static option) and its body builds the
optax transformation doing the numerics from the hyperparameters' current values.
:func:`optimizer` turns it into the public function: the call binds the arguments, checks
the static options at once, and gives the hyperparameters to
:func:`~functree.optim._hyper.inject`, which stores them in the state and calls the body
again, at trace time, with their values at each step (as ``optax.inject_hyperparams``
reads a function's signature; here the annotation, not the value's type, says which
arguments are hyperparameters, so a callable mask is never taken for a schedule).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any, ParamSpec

import optax

from functree.optim._hyper import inject

__all__ = ["Hyper", "optimizer", "PARAMETERS_GIVEN"]

P = ParamSpec("P")

HYPERPARAMETER = "hyperparameter"

Hyper = Annotated[Any, HYPERPARAMETER]
"""The annotation of an optimizer's hyperparameter: a number, a schedule, a piecewise list or
a rate with a unit (see :mod:`functree.optim._hyper`)."""

NO_HYPERPARAMETER = """\
{where}: the optimizer's body declares no hyperparameter; annotate them with Hyper:

    wrong:  def sgd(learning_rate=0.01): ...
    right:  def sgd(learning_rate: Hyper = 0.01): ...
"""

BAD_ARGUMENTS = """\
{where}: {error}. Its arguments: {names}.{renames}
"""

# Other libraries' names for functree's hyperparameters: optax's (b1, b2, eps, rmsprop's
# decay) and torch's (lr, betas, rmsprop's alpha).
FOREIGN_NAMES: dict[str, tuple[str, ...]] = {
    "b1": ("beta1",), "b2": ("beta2",), "eps": ("epsilon",), "lr": ("learning_rate",),
    "betas": ("beta1", "beta2"), "decay": ("rho",), "alpha": ("rho",),
}

RENAMES = """
Other libraries' names are functree's here: {pairs}.

    wrong:  {where}({wrong})
    right:  {where}({right})"""

TORCH_OPTION = """
torch's {name}= {what}:

    wrong:  {where}({wrong})
    right:  {right}"""

# torch's options that are another optimizer or a chain here: (where, keyword) -> (what it is,
# the right code for a true value). {lr}, {wd}: the call's learning rate and weight decay;
# {rest}: its other arguments; {value}: the keyword's value. A false value is the default.
_DECOUPLED = "optax.chain(ft.optim.{name}({lr}{rest}), ft.optim.weight_decay({lr} * {wd}, exclude=()))"
TORCH_OPTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("ft.optim.adam", "amsgrad"): ("is the optimizer ft.optim.amsgrad (torch's Adam(amsgrad=True))",
                                   "ft.optim.amsgrad({lr}{rest}{wd_arg})"),
    ("ft.optim.adam", "decoupled_weight_decay"): ("is ft.optim.adamw (torch's AdamW; exclude=() decays "
                                                  "every leaf, as torch)",
                                                  "ft.optim.adamw({lr}{rest}, weight_decay={wd}, exclude=())"),
    ("ft.optim.adamw", "amsgrad"): ("is ft.optim.amsgrad chained with the decoupled decay η·λ (a scheduled η: "
                                    "weight_decay gets the schedule's values times λ)",
                                    _DECOUPLED.replace("{name}", "amsgrad")),
    ("ft.optim.radam", "decoupled_weight_decay"): ("is ft.optim.radam chained with the decoupled decay η·λ "
                                                   "(a scheduled η: weight_decay gets the schedule's values times λ)",
                                                   _DECOUPLED.replace("{name}", "radam")),
    ("ft.optim.adagrad", "lr_decay"): ("is a learning-rate schedule, η / (1 + t·d) at update t from 0",
                                       "ft.optim.adagrad(ft.optim.schedule(lambda c: {lr} / (1 + {value} * c)){rest}"
                                       "{wd_arg})"),
}
# torch's defaults where functree's differ, added to the right code of TORCH_OPTIONS' entry.
TORCH_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("ft.optim.adagrad", "lr_decay"): {"initial_accumulator_value": 0.0, "epsilon": 1e-10},
}
# torch's kernel choices: XLA compiles the whole step into one program, there is nothing to choose.
TORCH_KERNEL_OPTIONS = ("foreach", "fused", "capturable", "differentiable")

# torch's torch.optim.Adam(model.parameters(), lr=1e-3): the parameters first. A model is
# callable, so it would pass for a learning-rate schedule and fail at init, far from here.
PARAMETERS_GIVEN = """\
{where}: got {given} as its first argument ({first}): torch's optimizers take the parameters \
first; here the optimizer takes its hyperparameters alone, and its state is made from the \
model by init.

    wrong:  opt = {where}(model.parameters(), lr=1e-3)
    right:  tx = {where}(1e-3);  opt_state = tx.init(ft.parameters(model))
       or:  optimizer = ft.optim.Optimizer({where}(1e-3));  opt_state = optimizer.init(model)"""

UNKNOWN_OFF_AT_ZERO = """\
{where}: off_at_zero names {names}, which are not hyperparameters of its signature ({known}).
"""


def _hyperparameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments annotated :data:`Hyper`, in signature order (read once, at decoration)."""
    hints = typing.get_type_hints(fn, include_extras=True)
    return tuple(
        name for name in inspect.signature(fn).parameters
        if HYPERPARAMETER in getattr(hints.get(name), "__metadata__", ())
    )


def _bad_arguments(where: str, signature: inspect.Signature, error: TypeError, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> TypeError:
    """BAD_ARGUMENTS: Python's error for a call the signature cannot bind, with the
    optimizer's name, its argument names, and functree's names for optax's and torch's."""
    names = list(signature.parameters)
    foreign = {k: FOREIGN_NAMES[k] for k in kwargs if k not in names and set(FOREIGN_NAMES.get(k, ("",))) <= set(names)}
    given = [repr(a) for a in args]
    # the call as given, foreign names renamed in place and torch's kernel options left out
    right = given + [_renamed(foreign[k], v, signature) if k in foreign else f"{k}={v!r}"
                     for k, v in kwargs.items() if k not in TORCH_KERNEL_OPTIONS]
    wrong = given + [f"{k}={v!r}" for k, v in kwargs.items()]
    renames = ""
    if foreign:
        renames = RENAMES.format(pairs=", ".join(f"{k} → {', '.join(ours)}" for k, ours in foreign.items()),
                                 where=where, wrong=", ".join(wrong), right=", ".join(right))
    # torch's option's right code renames too: shown alone, the one call that runs
    renames = _torch_option(where, signature, args, kwargs, foreign) or renames
    text = str(error)
    return TypeError(BAD_ARGUMENTS.format(where=where, error=text.split("() ", 1)[-1], names=", ".join(names),
                                          renames=renames))


def _torch_option(where: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                  foreign: dict[str, tuple[str, ...]]) -> str:
    """:data:`TORCH_OPTION` for the first of torch's options in ``kwargs`` that this
    optimizer has not (:data:`TORCH_OPTIONS`, :data:`TORCH_KERNEL_OPTIONS`), else ``""``:
    the right code is the whole call, foreign names renamed, every kernel option left out."""
    known: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in signature.parameters:
            known[k] = v
        elif k in foreign:  # betas=(0.8, 0.9): beta1=0.8, beta2=0.9
            known.update({n: x.strip() for n, x in (a.split("=", 1) for a in _renamed(foreign[k], v, signature)
                                                                      .split(", "))})
    wrong = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    for name, value in kwargs.items():
        if name in TORCH_KERNEL_OPTIONS:
            what, right = "chooses a torch kernel; XLA compiles the whole step: leave it out", "{where}({all})"
        elif (where, name) in TORCH_OPTIONS:
            what, right = TORCH_OPTIONS[where, name]
            if not value:
                what, right = f"is {value!r}, torch's default: leave it out", "{where}({all})"
        else:
            continue
        values = _torch_values(signature, args, known, where, name)
        return TORCH_OPTION.format(name=name, what=what, where=where, wrong=wrong,
                                   right=right.format(value=value, where=where, **values))
    return ""


def _torch_values(signature: inspect.Signature, args: tuple[Any, ...], known: dict[str, Any], where: str,
                  name: str) -> dict[str, str]:
    """The call's learning rate, weight decay and other arguments as written (``all``: every
    one; ``rest``: but the rate and the decay, ``", beta1=0.8"``), with torch's defaults where
    functree's differ (:data:`TORCH_DEFAULTS`), for :data:`TORCH_OPTIONS`' right code."""
    try:
        bound = dict(signature.bind_partial(*args, **known).arguments)
    except TypeError:
        bound = dict(known)
    shown = lambda v: v if isinstance(v, str) else repr(v)  # noqa: E731  (a renamed value is text already)
    every = ", ".join([repr(a) for a in args] + [f"{k}={shown(v)}" for k, v in known.items()])
    for k, v in TORCH_DEFAULTS.get((where, name), {}).items():
        bound.setdefault(k, v)
    lr = bound.pop("learning_rate", signature.parameters["learning_rate"].default)
    wd = bound.pop("weight_decay", signature.parameters["weight_decay"].default)
    bound.pop("exclude", None)
    rest = "".join(f", {k}={shown(v)}" for k, v in bound.items())
    return {"lr": shown(lr), "wd": shown(wd), "wd_arg": f", weight_decay={shown(wd)}" if wd else "",
            "rest": rest, "all": every}


def _renamed(ours: tuple[str, ...], value: Any, signature: inspect.Signature) -> str:
    """``value`` given under functree's names ``ours`` (torch's ``betas=(b1, b2)``: two); a
    value that is not one per name (``betas=0.9``) gives the first name the value and the
    others their defaults, so the suggested call runs."""
    if len(ours) == 1:
        return f"{ours[0]}={value!r}"
    if isinstance(value, (tuple, list)) and len(value) == len(ours):
        values = list(value)
    else:
        values = [value, *(signature.parameters[n].default for n in ours[1:])]
    return ", ".join(f"{n}={v!r}" for n, v in zip(ours, values))


def _parameters_given(value: Any) -> bool:
    """A model, a parameter dict or torch's ``model.parameters()`` generator: no
    hyperparameter (a number, a schedule, a piecewise list, a rate with a unit) is one."""
    from functree._module import Module

    return isinstance(value, (Module, Mapping, Iterator))


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == 0


def optimizer(
    where: str,
    *,
    off_at_zero: Sequence[str] = (),
    check: Callable[..., None] | None = None,
    then: Callable[[optax.GradientTransformationExtraArgs], optax.GradientTransformationExtraArgs] | None = None,
) -> Callable[[Callable[P, Any]], Callable[P, optax.GradientTransformationExtraArgs]]:
    """Make an optimizer from one function whose :data:`Hyper` arguments are its hyperparameters.

    The decorated body takes every argument of the signature and returns an optax
    transformation; the public function binds the call's arguments as the signature does
    (defaults included), calls ``check`` at once with the arguments it names (static
    options, or a hyperparameter's value as given: bad options fail at construction, not at
    ``init``), and returns ``then(inject(where, body, hyperparameters,
    static_options))``. A hyperparameter named in ``off_at_zero`` whose value is the number 0
    is not stored: the body gets ``None`` (no weight-decay term, no parameters needed).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from functree.optim._signature import Hyper, optimizer
      >>> @optimizer("scaled")
      ... def scaled(factor: Hyper = 2.0, *, flip: bool = False):
      ...     return optax.scale(-factor if flip else factor)
      >>> tx = scaled(3.0, flip=True)
      >>> g = {"w": jnp.ones(2)}; state = tx.init(g)
      >>> state.names, tx.update(g, state)[0]
      (('factor',), {'w': Array([-3., -3.], dtype=float32)})
    """

    def decorate(body: Callable[P, Any]) -> Callable[P, optax.GradientTransformationExtraArgs]:
        signature = inspect.signature(body)
        names = _hyperparameter_names(body)
        if not names:
            raise TypeError(NO_HYPERPARAMETER.format(where=where))
        checked = () if check is None else tuple(inspect.signature(check).parameters)
        unknown = sorted(set(off_at_zero) - set(names))
        if unknown:
            raise TypeError(UNKNOWN_OFF_AT_ZERO.format(where=where, names=unknown, known=list(names)))

        @functools.wraps(body)
        def public(*args: P.args, **kwargs: P.kwargs) -> optax.GradientTransformationExtraArgs:
            if args and _parameters_given(args[0]):
                first = next(iter(signature.parameters))
                raise TypeError(PARAMETERS_GIVEN.format(where=where, given=type(args[0]).__name__, first=first))
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as e:
                raise _bad_arguments(where, signature, e, args, kwargs) from None
            bound.apply_defaults()
            given = bound.arguments
            static = {k: v for k, v in given.items() if k not in names}
            if check is not None:  # the options it names: static ones, or a hyperparameter as given
                check(**{k: given[k] for k in checked})
            hyper = {}
            for name in names:
                if name in off_at_zero and _is_zero(given[name]):
                    static[name] = None  # not a hyperparameter of this state: the body gets None
                else:
                    hyper[name] = given[name]
            tx = inject(where, body, hyper, static)
            return tx if then is None else then(tx)

        return public

    return decorate
