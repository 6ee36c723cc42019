"""Complex parameters trained as pairs of reals, as ``torch.optim`` trains them.

A complex parameter ``z = x + iy`` is two real parameters to an optimizer: torch views it
as ``(x, y)`` (``torch.view_as_real``), so Adam keeps one second moment per component,
``E[(∂L/∂x)²]`` and ``E[(∂L/∂y)²]``, and every torch optimizer gives the numbers it gives
the real problem in ``(x, y)``. ``ft.optim.Optimizer`` does the same: its transform sees
each complex leaf of the gradients and parameters as a :class:`RealPair` and the updates
it returns are put back together as complex arrays. Per-parameter state (moments) holds
a :class:`RealPair` at a complex parameter; a model without complex parameters goes
through untouched (the same state, the same program).

The gradient that enters is first conjugated (:func:`~functree.optim._checks.descent_direction`):
JAX's gradient of a real loss is ``∂L/∂x − i ∂L/∂y``; the pair is ``(∂L/∂x, ∂L/∂y)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

__all__ = ["RealPair", "has_complex", "as_pairs", "from_pairs", "real_pairs", "is_pair"]


class RealPair(NamedTuple):
    """The real and imaginary parts of a complex parameter (or of its gradient, update or
    moment), as two real arrays: how an optimizer state holds a complex leaf's moments,
    one per real component, as torch.optim does.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
      >>> nu = ft.optim.moments(opt.init({"z": jnp.zeros(2, jnp.complex64)}))["nu"]
      >>> nu["z"]
      RealPair(real=Array([0., 0.], dtype=float32), imag=Array([0., 0.], dtype=float32))
    """

    real: Any
    imag: Any


def _is_complex(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype.kind == "c"


def has_complex(tree: Any) -> bool:
    """Whether ``tree`` has a complex leaf (Python, over dtypes: at trace time under jit)."""
    return any(_is_complex(x) for x in jax.tree.leaves(tree))


def as_pairs(tree: Any) -> Any:
    """``tree`` with each complex leaf as a :class:`RealPair` (``None`` and real leaves as they are).

    Example:
      >>> import jax.numpy as jnp
      >>> as_pairs({"z": jnp.array(1 + 2j, jnp.complex64), "w": None})
      {'w': None, 'z': RealPair(real=Array(1., dtype=float32), imag=Array(2., dtype=float32))}
    """
    return jax.tree.map(lambda x: RealPair(x.real, x.imag) if _is_complex(x) else x, tree)


def is_pair(x: Any) -> bool:
    return isinstance(x, RealPair)


def from_pairs(tree: Any) -> Any:
    """The inverse of :func:`as_pairs`: each :class:`RealPair` back as one complex array."""
    return jax.tree.map(lambda x: jax.lax.complex(x.real, x.imag) if is_pair(x) else x, tree, is_leaf=is_pair)


def real_pairs(transform: Any) -> optax.GradientTransformationExtraArgs:
    """``transform`` training complex parameters as pairs of reals (torch.optim's numbers).

    ``init`` and ``update`` pass a tree without complex leaves to ``transform`` as it is;
    otherwise the parameters, the gradients and the extra arguments ``grad`` and
    ``value_fn`` (L-BFGS's) are given in pairs and the updates put back as complex arrays.
    The gradients must already be in the descent convention (conjugated JAX gradients).
    """
    inner = optax.with_extra_args_support(transform)

    def init(params: Any) -> Any:
        return inner.init(as_pairs(params) if has_complex(params) else params)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        if not (has_complex(updates) or has_complex(params)):
            return inner.update(updates, state, params, **extra)
        if "grad" in extra:
            extra["grad"] = as_pairs(extra["grad"])
        if extra.get("value_fn") is not None:
            value_fn = extra["value_fn"]

            def on_pairs(params: Any, context: Any = None) -> Any:  # the Optimizer's value_fn
                return value_fn(from_pairs(params), context=context)

            extra["value_fn"] = on_pairs
        new, state = inner.update(as_pairs(updates), state, as_pairs(params), **extra)
        return from_pairs(new), state

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]
