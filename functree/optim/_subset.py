"""Training a subset of the parameters: ``ft.optim.Optimizer(tx, wrt="encoder.*")``.

``wrt`` takes the key-path globs of ``ft.gradient(wrt=)`` (the same matcher, over the
dotted names of ``ft.to_flat_dict``). The optimizer then works on the *trained view*: the
parameter view with ``None`` at every parameter no pattern selects. So

* gradients are computed for the selected parameters only (``ft.gradient(wrt=)``);
* the transform is initialized on the trained view: frozen parameters get no optimizer
  state at all (their moments are ``None``, not zeros);
* updates are ``None`` at frozen parameters, which ``ft.move`` leaves bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax

from functree._parameters import _leaf_names, _matches, parameters
from functree._tree import bounded_put, is_none

__all__ = ["check_wrt", "trained_view", "drop_frozen"]

BAD_WRT = """\
wrt= takes key-path patterns (a string or a sequence of strings), as ft.gradient(wrt=) \
does; got {given!r}.

    right:  ft.optim.Optimizer(ft.optim.adam(1e-3), wrt="encoder.*")
       or:  ft.optim.Optimizer(ft.optim.adam(1e-3), wrt=("encoder.*", "head.bias"))
"""

SELECTS_NOTHING = """\
Optimizer(wrt={pattern!r}) selects no parameter of the model; patterns are globs over \
dotted names such as {examples}.

    right:  ft.optim.Optimizer(tx, wrt="{first}")
"""

def check_wrt(wrt: Any) -> tuple[str, ...] | None:
    """``wrt`` as a tuple of patterns (``None``: every parameter is trained)."""
    if wrt is None:
        return None
    if isinstance(wrt, str):
        return (wrt,)
    if isinstance(wrt, (list, tuple)) and wrt and all(isinstance(w, str) for w in wrt):
        return tuple(wrt)
    raise TypeError(BAD_WRT.format(given=wrt))


# (parameter-view tree definition, patterns) -> which leaf positions are trained.
_CHOSEN: dict[Any, tuple[bool, ...]] = {}


def _chosen(view: Any, leaves: list[Any], treedef: Any, patterns: tuple[str, ...]) -> tuple[bool, ...]:
    key = (treedef, patterns)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        names = _leaf_names(view)
        hits = [leaf is not None and _matches(n, patterns) for n, leaf in zip(names, leaves)]
        for p in patterns:  # as ft.gradient(wrt=): every pattern selects some parameter
            if not any(leaf is not None and _matches(n, (p,)) for n, leaf in zip(names, leaves)):
                examples = [n for n, leaf in zip(names, leaves) if leaf is not None][:3]
                raise ValueError(SELECTS_NOTHING.format(pattern=p, examples=examples,
                                                        first=examples[0] if examples else "*"))
        chosen = tuple(hits)
        bounded_put(_CHOSEN, key, chosen)
    return chosen


def trained_view(model: Any, patterns: tuple[str, ...] | None) -> Any:
    """The parameter view of ``model`` with ``None`` at parameters that ``patterns`` do not select.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.optim._subset import trained_view
      >>> trained_view({"encoder": {"w": jnp.ones(2)}, "head": jnp.ones(1)}, ("encoder.*",))
      {'encoder': {'w': Array([1., 1.], dtype=float32)}, 'head': None}
    """
    view = parameters(model)
    if patterns is None:
        return view
    leaves, treedef = jax.tree.flatten(view, is_leaf=is_none)
    chosen = _chosen(view, leaves, treedef, patterns)
    return treedef.unflatten([x if c else None for x, c in zip(leaves, chosen)])


def drop_frozen(grads: Any, view: Any) -> Any:
    """``grads`` with ``None`` where the trained ``view`` is ``None`` (gradients a custom
    ``get_gradients`` computed for frozen parameters are not applied)."""
    g_leaves, g_def = jax.tree.flatten(grads, is_leaf=is_none)
    v_leaves, v_def = jax.tree.flatten(view, is_leaf=is_none)
    if g_def != v_def:
        return grads  # the gradient check names the difference
    return g_def.unflatten([None if v is None else g for g, v in zip(g_leaves, v_leaves)])
