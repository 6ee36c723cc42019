"""The functions ``ft.optim.Optimizer`` takes for TF RFC 234's hooks: checked at
construction (functions of a gradient tree, never a stateful optax transformation),
chained in order, and a ``get_gradients`` hook's contract with a loss scale (``scale=``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import optax

__all__ = ["checked_hooks", "chain_hooks", "takes_scale", "takes_keyword", "STATEFUL_HOOK", "BOTH_LOSS_HOOKS",
           "HOOK_WITHOUT_SCALE", "SCALED_HOOK"]

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


def checked_hooks(hook: str, fns: Any) -> tuple[Callable[[Any], Any], ...]:
    """The functions given as the ``hook=`` argument (one, a sequence, or None) as a tuple:
    :data:`STATEFUL_HOOK` for an optax transformation (it has state) or anything not callable."""
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
