"""The optimizer's input check: a gradient tree against the model's parameter view."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._parameters import first_difference
from functree._tree import bounded_put, dotted_name, is_none
from functree.optim._complex import RealPair

__all__ = ["check_gradients", "checked_gradients", "keep_unchanged", "descent_direction"]

GRADIENT_MISMATCH = """\
The gradient does not fit the model's parameters at {path}: {detail}.
Gradients must have the parameter view's structure. Compute them from the same model:

    wrong:  grads = jax.grad(loss)(other_params)
    right:  grads = ft.gradient(loss, at=model)          # or opt.compute_gradients(...)
            updates, state = opt.update(grads, state, model)
"""


def check_gradients(grads: Any, params: Any) -> list[bool]:
    """Check that ``grads`` fits ``params`` (a parameter view); the positions without a gradient.

    Raises naming the first key path where the structures or shapes differ, or where a
    gradient is given for a non-parameter. A ``None`` gradient for a parameter is allowed
    (a partial gradient, e.g. ``ft.gradient(loss, wrt="head.*")``): the returned list has
    ``True`` at those leaf positions (flatten order of ``params`` with ``None`` leaves).
    Runs in Python: under ``jit`` only while tracing.
    """
    g_leaves, g_def = jax.tree.flatten(grads, is_leaf=is_none)
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=is_none)
    if g_def != p_def:
        diff = first_difference(params, grads) or first_difference(params, grads, none_is_leaf=True)
        path, detail = diff or ("<root>", "different structures")
        raise ValueError(GRADIENT_MISMATCH.format(path=path or "<root>", detail=detail))
    missing = []
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        missing.append(g is None and p is not None)
        if p is None and g is not None:
            detail = f"the leaf is not a parameter (None in the parameter view), the gradient has shape {np.shape(g)}"
            raise ValueError(GRADIENT_MISMATCH.format(path=_names(params, p_def)[i], detail=detail))
        if g is not None and np.shape(g) != np.shape(p):  # type: ignore[arg-type]  # p is an array here
            detail = f"expected shape {np.shape(p)} (the parameter's), given shape {np.shape(g)}"  # type: ignore[arg-type]
            raise ValueError(GRADIENT_MISMATCH.format(path=_names(params, p_def)[i], detail=detail))
    return missing


_NAMES: dict[Any, list[str]] = {}


def _names(tree: Any, treedef: Any) -> list[str]:
    names = _NAMES.get(treedef)
    if names is None:
        path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)
        names = [dotted_name(p) or "<root>" for p, _ in path_leaves]
        bounded_put(_NAMES, treedef, names)
    return names


def checked_gradients(grads: Any, params: Any) -> tuple[Any, Any]:
    """``(grads, partial)``: grads with zeros where a parameter has a ``None`` gradient, and the
    positions of those parameters (``None`` when every parameter has a gradient)."""
    if params is None:
        return grads, None
    missing = check_gradients(grads, params)
    if not any(missing):
        return grads, None
    filled = jax.tree.map(lambda g, p: jnp.zeros_like(p) if g is None and p is not None else g, grads, params,
                          is_leaf=is_none)
    return filled, (jax.tree.structure(params, is_leaf=is_none), tuple(missing))


def _unit(x: Any) -> bool:
    return x is None or isinstance(x, RealPair)


def keep_unchanged(partial: tuple[Any, tuple[bool, ...]], updates: Any, new_inner: Any,
                   old_inner: Any) -> tuple[Any, Any]:
    """No update for parameters without a gradient: ``None`` updates, their moments as they were
    (a complex parameter's moment is a :class:`RealPair`: one unit, as the parameter).

    An entry of ``partial`` may be a boolean member array (a stacked leaf partly frozen by
    ``Optimizer(wrt="h.2.*")``): those members only."""
    treedef, missing = partial

    def per_parameter(x: Any) -> bool:
        return jax.tree.structure(x, is_leaf=_unit) == treedef

    def keep(new: Any, old: Any) -> Any:
        if not per_parameter(new):
            return new
        news, olds = jax.tree.leaves(new, is_leaf=_unit), jax.tree.leaves(old, is_leaf=_unit)
        return treedef.unflatten([_kept(n, o, m) for n, o, m in zip(news, olds, missing)])

    inner = jax.tree.map(keep, new_inner, old_inner, is_leaf=per_parameter)
    leaves = jax.tree.leaves(updates, is_leaf=is_none)
    updates = treedef.unflatten([_no_update(u, m) for u, m in zip(leaves, missing)])
    return updates, inner


def _kept(new: Any, old: Any, m: Any) -> Any:
    """``old`` where ``m`` (a bool, or a member array of a partly frozen stacked leaf)."""
    if not isinstance(m, np.ndarray):
        return old if m else new
    if isinstance(new, RealPair):  # a complex parameter's moment: each half
        return RealPair(_kept(new.real, old.real, m), _kept(new.imag, old.imag, m))
    if new is None or np.ndim(new) < m.ndim or np.shape(new)[: m.ndim] != m.shape:
        return new  # a state leaf not shaped like its parameter (a count, a factored moment)
    return jnp.where(m.reshape(m.shape + (1,) * (np.ndim(new) - m.ndim)), old, new)


def _no_update(u: Any, m: Any) -> Any:
    """None where ``m``; ``-0.0`` at the frozen members of a member array (``w + -0.0 == w``
    bit for bit, whatever ``w``)."""
    if not isinstance(m, np.ndarray):
        return None if m else u
    return jnp.where(m.reshape(m.shape + (1,) * (np.ndim(u) - m.ndim)), jnp.asarray(-0.0, u.dtype), u)


def _complex(g: Any) -> bool:
    dtype = getattr(g, "dtype", None)
    return dtype is not None and dtype.kind == "c"


def descent_direction(grads: Any) -> Any:
    """``grads`` (``ft.gradient``'s convention, JAX's) in the convention of optax and
    torch.optim: the conjugate at complex leaves, real leaves as they are.

    For a real loss ``L`` of ``z = x + iy``, JAX's gradient is ``∂L/∂x − i ∂L/∂y``, the
    conjugate of the steepest-ascent direction ``∂L/∂x + i ∂L/∂y`` that an optimizer
    steps against (torch's ``z.grad``; optax expects it too). ``ft.optim.Optimizer``
    conjugates here, once, where gradients enter the transform; a model without complex
    parameters pays one pass over the dtypes, at trace time under jit.

    Example:
      >>> import jax.numpy as jnp
      >>> descent_direction({"z": jnp.array(1 - 2j, jnp.complex64), "w": jnp.ones(())})
      {'w': Array(1., dtype=float32), 'z': Array(1.+2.j, dtype=complex64)}
    """
    if not any(_complex(g) for g in jax.tree.leaves(grads)):
        return grads
    return jax.tree.map(lambda g: jnp.conj(g) if _complex(g) else g, grads)
