"""Input checks shared by the optimizers: gradient trees against the model's parameters."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from functree._parameters import _jax_path_name, first_difference

__all__ = ["check_gradients"]

GRADIENT_MISMATCH = """\
The gradient does not fit the model's parameters at {path}: {detail}.
Gradients must have the parameter view's structure. Compute them from the same model:

    wrong:  grads = jax.grad(loss)(other_params)
    right:  grads = ft.gradient(loss, at=model)          # or opt.compute_gradients(...)
            updates, state = opt.update(grads, state, model)
"""


def _is_none(x: Any) -> bool:
    return x is None


def check_gradients(grads: Any, params: Any) -> None:
    """Raise naming the first key path where ``grads`` does not fit ``params`` (a view).

    Structures are compared first (one C++ comparison), then each leaf's shape. Runs in
    Python: under ``jit`` only while tracing.
    """
    g_leaves, g_def = jax.tree.flatten(grads, is_leaf=_is_none)
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=_is_none)
    if g_def != p_def:
        diff = first_difference(params, grads) or first_difference(params, grads, none_is_leaf=True)
        path, detail = diff or ("<root>", "different structures")
        raise ValueError(GRADIENT_MISMATCH.format(path=path or "<root>", detail=detail))
    for name, g, p in zip(_names(params, p_def), g_leaves, p_leaves):
        if g is None or p is None:
            if (g is None) != (p is None):
                given = "None" if g is None else f"shape {np.shape(g)}"
                detail = f"the parameter is {'None' if p is None else 'an array'}, the gradient is {given}"
                raise ValueError(GRADIENT_MISMATCH.format(path=name, detail=detail))
            continue
        if np.shape(g) != np.shape(p):
            detail = f"expected shape {np.shape(p)} (the parameter's), given shape {np.shape(g)}"
            raise ValueError(GRADIENT_MISMATCH.format(path=name, detail=detail))


_NAMES: dict[Any, list[str]] = {}


def _names(tree: Any, treedef: Any) -> list[str]:
    names = _NAMES.get(treedef)
    if names is None:
        path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
        names = [_jax_path_name(p) or "<root>" for p, _ in path_leaves]
        _NAMES[treedef] = names
    return names
