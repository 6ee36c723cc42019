"""The functions ``ft.optim.Optimizer`` takes for TF RFC 234's hooks: checked at
construction (functions of a gradient tree, never a stateful optax transformation),
chained in order, and a ``get_gradients`` hook's contract with a loss scale (``scale=``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import optax

from functree._source import call_refusal

__all__ = ["checked_hooks", "checked_hook", "chain_hooks", "takes_scale", "takes_keyword", "check_hook_call", "check_loss_call",
           "STATEFUL_HOOK", "BOTH_LOSS_HOOKS", "HOOK_WITHOUT_SCALE", "SCALED_HOOK", "HOOK_CALL", "LOSS_CALL",
           "HOOK_ARITY", "CALLS_LOSS_AS_GIVEN"]

STATEFUL_HOOK = """\
{hook}= takes functions from a gradient tree to a gradient tree; got the optax \
transformation {given}, which has state. Chain it into the transform instead:

    wrong:  ft.optim.Optimizer(ft.optim.adam(), {hook}=optax.clip_by_global_norm(1.0))
    right:  ft.optim.Optimizer(optax.chain(optax.clip_by_global_norm(1.0), ft.optim.adam()))
"""

BOTH_LOSS_HOOKS = """\
Optimizer(transform_loss=..., get_gradients=...): a get_gradients hook computes the gradients \
itself and would ignore transform_loss silently. Apply the transform inside the loss function \
(or inside the hook):

    wrong:  ft.optim.Optimizer(tx, transform_loss=f, get_gradients=hook)
    right:  ft.optim.Optimizer(tx, get_gradients=hook), with loss_fn returning f(loss)"""

HOOK_WITHOUT_SCALE = """\
The get_gradients hook {hook} takes no scale=, and a LossScaleOptimizer differentiates the \
loss times its scale: a hook that clips or otherwise changes gradients nonlinearly would see \
them scaled (per-example clipping would clip at threshold / scale). Take the scale and return \
the pair (unscaled loss, grads of scale * loss), applying any threshold to scaled units \
(ft.optim.per_example_clipping does):

    wrong:  def hook(loss_fn, model, *batch, has_aux=False): ...
{scaled_hook}"""

# A get_gradients hook that takes the loss scale (LossScaleOptimizer's HOOK_RESULT shows it too).
SCALED_HOOK = """\
    right:  def hook(loss_fn, model, *batch, has_aux=False, scale=None):
                s = 1.0 if scale is None else scale
                def scaled(m, *b):
                    out = loss_fn(m, *b)                  # loss, or (loss, aux) with has_aux
                    return s * (out[0] if has_aux else out), out
                (_, out), grads = jax.value_and_grad(scaled, has_aux=True)(model, *batch)
                return out, grads                         # (unscaled loss, grads of scale * loss)"""


HOOK_ARITY = """\
ft.optim.Optimizer calls its {hook}= hook as {call} and takes back {returns}; {name}{signature} \
cannot be called so (Python's "{problem}", which the step would raise from inside its trace). \
Take exactly those arguments:

    wrong:  {hook}={wrong}
    right:  {hook}={right}"""

# hook -> (its call, what it returns, a hook that takes the call)
_HOOK_CALLS = {
    "transform_loss": ("f(loss)", "the loss that is differentiated", "lambda loss: ..."),
    "transform_unaggregated_gradients": ("f(grads)", "a gradient tree (one replica's)", "lambda grads: ..."),
    "aggregate_gradients": ("f(grads)", "the replicas' aggregate gradient tree",
                            'lambda grads: jax.lax.pmean(grads, "data")'),
    "transform_gradients": ("f(grads)", "a gradient tree", "lambda grads: ..."),
    "apply_updates": ("f(model, updates)", "the new model", "lambda model, updates: ft.move(model, along=updates)"),
}


def checked_hook(hook: str, f: Any) -> Any:
    """``f`` (None passes), refused with :data:`HOOK_ARITY` where its signature cannot bind the
    call the optimizer makes of ``hook`` (``transform_gradients=lambda g, s: ...``): Python's
    bare arity error came from inside the step's trace, naming neither the hook nor the call.
    A function taking ``*args``, or one without a readable signature, is never refused."""
    if f is None:
        return f
    call, returns, right = _HOOK_CALLS[hook]
    refused = call_refusal(f, *call[2:-1].split(", "))
    if refused is not None:
        name, signature, problem = refused
        wrong = _written(name, ", ".join(map(str, signature.parameters.values())))
        raise TypeError(HOOK_ARITY.format(hook=hook, call=call, returns=returns, name=name, signature=signature,
                                          problem=problem, wrong=wrong, right=right))
    return f


def checked_hooks(hook: str, fns: Any) -> tuple[Callable[[Any], Any], ...]:
    """The functions given as the ``hook=`` argument (one, a sequence, or None) as a tuple:
    :data:`STATEFUL_HOOK` for an optax transformation (it has state) or anything not callable,
    :data:`HOOK_ARITY` for one that cannot take the gradients alone."""
    if fns is None:
        return ()
    if callable(fns) and not isinstance(fns, optax.GradientTransformation):
        fns = (fns,)
    if isinstance(fns, optax.GradientTransformation):
        raise TypeError(STATEFUL_HOOK.format(hook=hook, given=type(fns).__name__))
    fns = tuple(fns)
    for f in fns:
        if isinstance(f, optax.GradientTransformation) or not callable(f):
            raise TypeError(STATEFUL_HOOK.format(hook=hook, given=type(f).__name__))
        checked_hook(hook, f)
    return fns


def chain_hooks(fns: Sequence[Callable[[Any], Any]], grads: Any) -> Any:
    """``grads`` through each of ``fns`` in order: ``fns[-1](...fns[0](grads))``."""
    for f in fns:
        grads = f(grads)
    return grads


def takes_keyword(hook: Callable[..., Any], name: str) -> bool:
    """Whether a get_gradients hook accepts the keyword ``name`` (a parameter of that name, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def takes_scale(hook: Callable[..., Any]) -> bool:
    """Whether a get_gradients hook accepts ``scale=`` (a parameter of that name, or ``**kwargs``)."""
    return takes_keyword(hook, "scale")


HOOK_CALL = """\
The optimizer calls its get_gradients hook as {call}, with {count} batch argument{s}, and takes \
back (loss, grads) (((loss, aux), grads) with has_aux=True); {name}{signature} cannot be called \
so (Python's "{problem}").{note} Take the loss function, the model, the batch arguments and \
has_aux:

    wrong:  def {name}{signature}: ...
{right}"""

HOOK_RIGHT = """\
    right:  def hook(loss_fn, model, *batch, has_aux=False{keywords}):
                return jax.value_and_grad(lambda m: loss_fn(m, *batch), has_aux=has_aux)(model)"""
"""The default fix of :data:`HOOK_CALL` (a hook given ``scale=`` shows :data:`SCALED_HOOK`)."""

GRADIENTS_ALONE = """ A function of the gradients alone goes to transform_gradients= (after the \
replicas' mean) or transform_unaggregated_gradients= (before it)."""

LOSS_CALL = """\
The optimizer calls the loss function as {call}: the model, then the {count} batch argument{s} \
(opt.minimize(loss_fn, model, state, *batch)'s, opt.step(loss_fn, model, state, batch)'s tuple \
unpacked){key}. {name}{signature} cannot be called so (Python's "{problem}", which the step \
would raise from inside its trace). Take one parameter per batch argument, or give the batch \
as the loss takes it:

    wrong:  {wrong}
    right:  {right}"""

CALLS_LOSS_AS_GIVEN = "__ft_calls_loss_as_given__"
"""The attribute by which a library get_gradients hook (``per_example_clipping``) says it calls
``loss_fn(model, *batch)`` with the batch arguments it is given, so the optimizer checks the
loss's signature first (:func:`check_loss_call`); another hook may call it its own way."""


def _arguments(count: int) -> str:
    return "" if count == 1 else "s"


def check_hook_call(hook: Callable[..., Any], loss_fn: Any, model: Any, batch: tuple, **keywords: Any) -> None:
    """:data:`HOOK_CALL` for a get_gradients hook that cannot be called with the arguments it
    is about to get (``lambda grads: ...``, a hook without ``has_aux=``), which failed with
    Python's bare arity error; a hook taking ``*args``/``**kwargs`` binds anything."""
    refused = call_refusal(hook, loss_fn, model, *batch, **keywords)
    if refused is None:
        return
    name, signature, problem = refused
    shown = "".join(f", {k}={v!r}" if k == "has_aux" else f", {k}=..." for k, v in keywords.items())
    positional = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra = "".join(f", {k}=None" for k in keywords if k != "has_aux")
    right = SCALED_HOOK if "scale" in keywords else HOOK_RIGHT.format(keywords=extra)
    raise TypeError(HOOK_CALL.format(
        call=f"hook(loss_fn, model, *batch{shown})", count=len(batch), s=_arguments(len(batch)), name=name,
        signature=signature, problem=problem, note=GRADIENTS_ALONE if len(positional) == 1 else "", right=right))


def check_loss_call(loss_fn: Callable[..., Any], model: Any, batch: tuple, key: Any = None) -> None:
    """:data:`LOSS_CALL` for a loss that cannot be called as ``loss_fn(model, *batch)`` (with
    ``key=`` when the step has a key): ``loss(model)`` given a batch, ``loss(model, x, y)``
    given one array, which failed inside the step's trace with Python's bare arity error."""
    keywords = {} if key is None else {"key": key}
    refused = call_refusal(loss_fn, model, *batch, **keywords)
    if refused is None:
        return
    name, signature, problem = refused
    names = {0: [], 1: ["x"], 2: ["x", "y"]}.get(len(batch), [f"x{i}" for i in range(len(batch))])
    params = ", ".join(["model", *names]) + (", *, key" if key is not None else "")
    raise TypeError(LOSS_CALL.format(
        call=f"loss_fn({', '.join(['model', *names])}{', key=key' if key is not None else ''})", count=len(batch),
        s=_arguments(len(batch)), key=", and the step's key as key=" if key is not None else "", name=name,
        signature=signature, problem=problem, wrong=_written(name, ", ".join(map(str, signature.parameters.values()))),
        right=_written(name, params)))


def _written(name: str, params: str) -> str:
    """A function of ``params`` as code: ``lambda model, x: ...`` for a lambda, else a def."""
    return f"lambda {params}: ..." if name == "<lambda>" else f"def {name}({params}): ..."
