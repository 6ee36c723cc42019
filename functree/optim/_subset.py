"""Training a subset of the parameters: ``ft.optim.Optimizer(tx, wrt="encoder.*")``.

``wrt`` takes the key-path globs of ``ft.gradient(wrt=)`` (the same matcher, over the
dotted names of ``ft.to_flat_dict``). The optimizer then works on the *trained view*: the
parameter view with ``None`` at every parameter no pattern selects. So

* gradients are computed for the selected parameters only (``ft.gradient(wrt=)``);
* the transform is initialized on the trained view: frozen parameters get no optimizer
  state at all (their moments are ``None``, not zeros);
* updates are ``None`` at frozen parameters, which ``ft.move`` leaves bit for bit.

A pattern may select members of an ``ft.nn.Stack`` (``wrt="h.[2-3].*"``): the stacked
leaf is then trained whole with zero gradients at the frozen members, whose updates are
``-0.0`` (``w + (-0.0) == w`` bit for bit, ``-0.0`` included) and whose moments are
restored after each update, so they never move.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._naming import (
    NothingSelected,
    broadcast,
    names,
    refuse_split_tie,
    selection,
)
from functree._parameters import is_parameter_leaf, parameters
from functree._tree import is_none
from functree.optim._masked import is_partial

__all__ = ["check_wrt", "trained_view", "drop_frozen", "frozen_members", "with_frozen_members"]

BAD_WRT = """\
wrt= takes key-path patterns (a string or a sequence of strings), as ft.gradient(wrt=) \
does; got {given!r}.

    right:  ft.optim.Optimizer(ft.optim.adam(1e-3), wrt="encoder.*")
       or:  ft.optim.Optimizer(ft.optim.adam(1e-3), wrt=("encoder.*", "head.bias"))
"""

SELECTS_NOTHING = """\
Optimizer(wrt={pattern!r}) selects no parameter of the model; patterns are globs over \
dotted names such as {examples}.

    right:  ft.optim.Optimizer(tx, wrt="{first}"){why}
"""

SELECTS_NON_PARAMETERS = """\
Optimizer(wrt={pattern!r}) selects {name!r}, which is no parameter ({why}): it is carried, \
never differentiated nor updated, so wrt= has nothing of it to train. Select parameters:
    wrong:  ft.optim.Optimizer(tx, wrt={pattern!r})
    right:  ft.optim.Optimizer(tx, wrt="{example}")   # a parameter; or make the field one (no no_derivative=True)
"""

# The reason given beside the fix: the names it selects, when they are not the pattern's own.
FOREIGN_FIX = "  # Hugging Face's {pattern!r}, in functree's names"
AN_EXAMPLE = "  # a name above (no parameter's name is close): say which you mean"

def check_wrt(wrt: Any) -> tuple[str, ...] | None:
    """``wrt`` as a tuple of patterns (``None``: every parameter is trained)."""
    if wrt is None:
        return None
    if isinstance(wrt, str):
        return (wrt,)
    if isinstance(wrt, (list, tuple)) and wrt and all(isinstance(w, str) for w in wrt):
        return tuple(wrt)
    raise TypeError(BAD_WRT.format(given=wrt))


def _chosen(view: Any, leaves: list[Any], patterns: tuple[str, ...], model: Any = None) -> tuple[Any, ...]:
    """Per leaf of the parameter view: True, False or a member array (cached by the
    naming layer per tree definition); every pattern selects some parameter."""
    only = tuple(leaf is not None for leaf in leaves)
    try:
        chosen = selection(view, patterns, what="Optimizer(wrt=)", only=only)
    except NothingSelected as e:
        if e.out_of_range is not None:
            raise ValueError(e.out_of_range) from None
        _refuse_non_parameters(model, e.pattern, view, only)
        examples = e.close or [n for n, ok in zip(names(view), only) if ok][:3]
        if e.suggestion is not None:
            first, why = e.suggestion, FOREIGN_FIX.format(pattern=e.pattern) if e.foreign else ""
        else:
            first, why = (examples[0] if examples else "*"), AN_EXAMPLE
        raise ValueError(SELECTS_NOTHING.format(pattern=e.pattern, examples=examples, first=first, why=why)) from None
    refuse_split_tie(view, patterns, "Optimizer(wrt=)", _wrt_code, only)  # (wrt="head.*": a tie by one name)
    return chosen


def _refuse_non_parameters(model: Any, pattern: str, view: Any, only: tuple[bool, ...]) -> None:
    """:data:`SELECTS_NON_PARAMETERS` where ``pattern`` selects leaves of ``model`` that are
    no parameters (a ``no_derivative`` field, an integer array): its "closest name" had
    been some parameter's, "no parameter's name is close", as if a typo."""
    if model is None:
        return
    hits = selection(model, (pattern,), what="Optimizer(wrt=)", strict=False)
    leaves = jax.tree.leaves(model, is_leaf=is_none)
    found = next((i for i, (h, x) in enumerate(zip(hits, leaves)) if np.any(h) and x is not None), None)
    if found is None:
        return
    leaf = leaves[found]
    why = "a no_derivative field" if is_parameter_leaf(leaf) else f"dtype {getattr(leaf, 'dtype', type(leaf).__name__)}"
    name = names(model)[found]
    params = [n for n, ok in zip(names(view), only) if ok]
    # the parameter of the nearest layer (most leading name parts in common): the same layer's scale
    example = max(params, key=lambda n: _shared_parts(n, name), default="*")
    raise ValueError(SELECTS_NON_PARAMETERS.format(pattern=pattern, name=name, why=why, example=example))


def _shared_parts(a: str, b: str) -> int:
    """How many leading dotted parts ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a.split("."), b.split("."))) if x != y),
                min(a.count("."), b.count(".")) + 1)


def _wrt_code(patterns: tuple[str, ...]) -> str:
    return f"ft.optim.Optimizer(tx, wrt={patterns[0] if len(patterns) == 1 else patterns!r})"


def trained_view(model: Any, patterns: tuple[str, ...] | None) -> Any:
    """The parameter view of ``model`` with ``None`` at parameters that ``patterns`` do not select.

    A stacked leaf partly selected (``wrt="h.2.*"``) stays whole here; :func:`frozen_members`
    says which of its members are frozen.

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
    chosen = _chosen(view, leaves, patterns, model)
    return treedef.unflatten([x if c is not False else None for x, c in zip(leaves, chosen)])


def frozen_members(model: Any, patterns: tuple[str, ...] | None) -> tuple[Any, ...] | None:
    """Per leaf of the parameter view, the members ``patterns`` leave frozen (a boolean
    array) where a stacked leaf is partly selected, else False; None when no leaf is."""
    if patterns is None:
        return None
    view = parameters(model)
    leaves = jax.tree.leaves(view, is_leaf=is_none)
    chosen = _chosen(view, leaves, patterns, model)
    if not any(is_partial(c) for c in chosen):
        return None
    return tuple(~c if is_partial(c) else False for c in chosen)


def with_frozen_members(partial: Any, params: Any, frozen: tuple[Any, ...] | None) -> Any:
    """The positions :func:`keep_unchanged` keeps, with the frozen members of partly
    trained leaves added (their updates are ``-0.0``, their moments restored)."""
    if frozen is None:
        return partial
    treedef = jax.tree.structure(params, is_leaf=is_none)
    missing = (False,) * len(frozen) if partial is None else partial[1]
    return treedef, tuple(True if m is True else f for m, f in zip(missing, frozen))


def drop_frozen(grads: Any, view: Any, frozen: tuple[Any, ...] | None = None) -> Any:
    """``grads`` with ``None`` where the trained ``view`` is ``None``, and zeros at the
    ``frozen`` members of partly trained leaves (gradients a custom ``get_gradients``
    computed for frozen parameters are not applied)."""
    g_leaves, g_def = jax.tree.flatten(grads, is_leaf=is_none)
    v_leaves, v_def = jax.tree.flatten(view, is_leaf=is_none)
    if g_def != v_def:
        return grads  # the gradient check names the difference
    marks = frozen or (False,) * len(g_leaves)
    return g_def.unflatten([
        None if v is None else (jnp.where(broadcast(f, g), jnp.zeros_like(g), g) if is_partial(f) and g is not None
                                else g)
        for g, v, f in zip(g_leaves, v_leaves, marks)
    ])
