"""How an operator call splits its arguments into differentiated views and the rest.

A :class:`Plan` reads ``wrt`` (an argument index, a tuple of distinct indices, negative
ones counting from the end, or key-path glob patterns over the first argument), checks each chosen argument is a pytree of arrays
with at least one parameter, and builds the differentiated *primals*: each argument's
parameter view (``None`` at non-parameters), narrowed to the leaves the patterns select
(a stacked leaf partly selected, ``wrt="h.2.*"``, stays whole; derivatives flow through
its selected members only, the others' are zero).
``plan.wrap()`` is the function of the primals that JAX differentiates: it writes them
back into the arguments (``ft.with_parameters``) and calls the user's function.

Both the operators and the diagnostics use plans; neither imports the other for it.

Example:
  >>> import jax.numpy as jnp
  >>> from functree._plan import Plan
  >>> plan = Plan("gradient", lambda w, n: w * n, (jnp.ones(2), 3), 0)
  >>> plan.primals, plan.argnums
  ((Array([1., 1.], dtype=float32),), 0)
  >>> plan.wrap()(jnp.full(2, 2.0)).tolist()
  [6.0, 6.0]
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import Module
from functree._naming import (
    NothingSelected,
    broadcast,
    key_path_hint,
    matches,
    names,
    refuse_batched_selection,
    selection,
)
from functree._parameters import is_parameter_leaf, parameters, with_parameters
from functree._source import unwrap
from functree._tree import bounded_put, cached, is_none

__all__ = ["Plan", "fn_name"]

NOT_DIFFERENTIABLE_ARGUMENT = """\
Cannot differentiate with respect to argument {index} of {fn}: {why}
Only floating-point values carry derivatives (integers and bools do not; \
no_derivative fields are carried, not differentiated).

{right}"""

WITHOUT_ARGUMENT = """\
    right:  ft.{op}(f, wrt={suggest})   # wrt= as asked, without argument {index}
       or:  pass the value as float: x.astype(jnp.float32)
"""

AS_FLOAT = """\
    right:  pass the value as float: x.astype(jnp.float32)
"""

AS_ARRAY = """\
    right:  pass the number as an array: jnp.asarray({value!r})
"""

NOT_A_PYTREE_OF_ARRAYS = """\
Cannot differentiate at argument {index} of {fn}: the value at {path} is a \
{type}, not an array or number.
Differentiation points are pytrees of arrays. Keep configuration in a static field:

    class Model(ft.Module):
        name: str = ft.field(static=True)
"""

PATTERN_SELECTS_NOTHING = """\
wrt={patterns!r} selects no parameter of {fn}'s first argument{extra}.
Patterns are globs over dotted names such as {examples}.
{right}"""

PATTERN_SELECTS_NON_PARAMETER = """\
wrt={patterns!r} selects {path}, which is not a parameter ({why}). \
Non-parameters are carried, not differentiated.
    right:  ft.{op}(f, wrt="{example}")   # select parameters only
"""

BAD_WRT = "wrt must be an argument index, a tuple of indices, or key-path pattern(s); got {wrt!r}."

WRT_OUT_OF_RANGE = """\
wrt={wrt!r} names argument {index}, but {fn} was called with {count} argument(s).

    right:  ft.gradient(f, wrt=0)(x, y)        # argument indices count from 0
"""

KEYWORDS_NOT_DIFFERENTIATED = """\
{fn} gets {names} as keyword argument(s), and keyword arguments are never \
differentiated (wrt= counts positional arguments, as jax.grad's argnums; its patterns name \
parameters of the first argument). Pass the argument positionally:

    wrong:  ft.{op}(f, wrt={wrt!r})(x, {keyword}=y)
    right:  ft.{op}(f, wrt={right!r})(x, y)
"""

DUPLICATE_WRT = """\
wrt={wrt!r} names argument {index} twice (negative indices count from the end: {count} \
argument(s) here). Each argument is differentiated once; a second copy's derivative \
would silently be zero.

    wrong:  ft.{op}(f, wrt={wrt!r})
    right:  ft.{op}(f, wrt={right!r})
"""

TANGENT_TUPLE = """\
This differential takes a tuple of {count} tangents (wrt={wrt}), one per argument:

    right:  df = ft.differential(f, wrt=(0, 1))(x, y);  df((tx, ty))
"""


def fn_name(f: Callable[..., Any]) -> str:
    """The name an error message gives ``f``: its qualified name, else its ``repr``."""
    f = unwrap(f)  # a call's keywords bound (CallKeywords, a partial): not a repr of their arrays
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or repr(f)


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex)
_POINT_TYPES: dict[type, bool] = {}  # leaf types known to be arrays or numbers


def _is_point_leaf(leaf: Any) -> bool:
    t = type(leaf)
    if t in _POINT_TYPES:
        return True
    if issubclass(t, _ARRAY_TYPES):
        bounded_put(_POINT_TYPES, t, True)
        return True
    if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return True
    return callable(leaf)  # a function kept as a leaf (Equinox modules): carried, not differentiated


def _check_point(f: Callable[..., Any], index: int, x: Any) -> None:
    if all(_is_point_leaf(leaf) for leaf in jax.tree.leaves(x)):
        return  # the common case: no key paths built
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        if not _is_point_leaf(leaf):
            raise TypeError(
                NOT_A_PYTREE_OF_ARRAYS.format(
                    index=index,
                    fn=fn_name(f),
                    path=jax.tree_util.keystr(path) or "<root>",
                    type=type(leaf).__name__,
                )
            )


def _distinct(op: str, indices: tuple[int, ...], wrt: Any, count: int) -> tuple[int, ...]:
    """``indices`` (counted from 0), each at most once: ``wrt=(0, 0)`` or ``(0, -2)`` of two
    arguments would differentiate argument 0 twice and give the first copy zero."""
    if len(set(indices)) == len(indices):
        return indices
    twice = next(i for k, i in enumerate(indices) if i in indices[:k])
    raise ValueError(DUPLICATE_WRT.format(
        op=op, wrt=wrt, index=twice, count=count, right=tuple(dict.fromkeys(indices))))


def _keywords(f: Any) -> dict[str, Any]:
    """The keyword arguments bound to ``f`` (the call's, bound by the operators, or a partial's)."""
    return dict(f.keywords) if isinstance(f, functools.partial) else {}


def _keyword_named(f: Any, pattern: str) -> str | None:
    """The keyword argument a ``wrt=`` pattern names (``wrt="b"`` for ``f(x, b=y)``), if any."""
    return next((k for k in _keywords(f) if matches(k, pattern)), None)


def _position(f: Any, keyword: str, count: int) -> int:
    """``keyword``'s positional index in ``f``'s signature (else after the ``count`` given)."""
    try:
        listed = list(inspect.signature(unwrap(f)).parameters)
    except (TypeError, ValueError):
        return count
    return listed.index(keyword) if keyword in listed else count


def _keywords_hint(op: str, f: Any, wrt: Any, right: Any) -> str:
    """:data:`KEYWORDS_NOT_DIFFERENTIATED` where ``f`` was called with keywords, else ``""``."""
    given = _keywords(f)
    if not given:
        return ""
    first = next(iter(given))
    return "\n" + KEYWORDS_NOT_DIFFERENTIATED.format(
        fn=fn_name(f), names=", ".join(given), op=op, wrt=wrt, keyword=first, right=right)


class Plan:
    """How to split the call's arguments into differentiated views and the rest."""

    def __init__(self, op: str, f: Callable[..., Any], args: tuple, wrt: Any):
        self.op, self.f, self.args = op, f, args
        self.patterns: tuple[str, ...] | None = None
        if isinstance(wrt, str):
            wrt = (wrt,)
        if isinstance(wrt, (list, tuple)) and wrt and all(isinstance(w, str) for w in wrt):
            self.patterns, self.indices, self.single = tuple(wrt), (0,), True
        elif isinstance(wrt, int) and not isinstance(wrt, bool):
            self.indices, self.single = (wrt,), True
        elif isinstance(wrt, tuple) and wrt and all(isinstance(i, int) for i in wrt):
            self.indices, self.single = tuple(wrt), False
        else:
            raise TypeError(BAD_WRT.format(wrt=wrt) + key_path_hint(wrt))
        for i in self.indices:
            if not -len(args) <= i < len(args):
                text = WRT_OUT_OF_RANGE.format(wrt=wrt, index=i, fn=fn_name(f), count=len(args))
                hint = _keywords_hint(op, f, wrt, wrt)  # then not an off-by-one: the first line, and why
                raise IndexError(text.split("\n")[0] + hint if hint else text)
        self.indices = _distinct(op, tuple(i % len(args) for i in self.indices), wrt, len(args))
        self.members: list[tuple[Any, ...]] = []  # per pattern-selected argument: member arrays
        self.primals = tuple(self._view(i) for i in self.indices)

    def _view(self, i: int) -> Any:
        x = self.args[i]
        _check_point(self.f, i, x)
        view = parameters(x)
        if self.patterns is not None:
            view = self._select(x, view)
        if not jax.tree.leaves(view):
            raise TypeError(self._why_not(i, x))
        return view

    def _select(self, x: Any, view: Any) -> Any:
        assert self.patterns is not None
        leaves, treedef = jax.tree.flatten(view, is_leaf=is_none)
        key, chosen = cached(_SELECTION_CACHE, (jax.tree.structure(x, is_leaf=is_none), treedef, self.patterns))
        if chosen is None:
            chosen = self._choose(x, leaves)
            if key is not None:
                bounded_put(_SELECTION_CACHE, key, chosen)
        else:  # cached per structure; a batch of models (same structure, more axes) is refused
            refuse_batched_selection(x, chosen, self.patterns)
        self.members.append(tuple(c if isinstance(c, np.ndarray) else None for c in chosen))
        return jax.tree.unflatten(
            treedef, [leaf if pick is not False else None for leaf, pick in zip(leaves, chosen)]
        )

    def _choose(self, x: Any, leaves: list[Any]) -> tuple[Any, ...]:
        """Which parameter leaves the patterns select (True, False, or a member array for
        a stacked leaf partly selected); the naming layer caches it per tree definition.

        Each pattern must select at least one parameter. Non-parameters under a selected
        node are skipped (``wrt="encoder"`` takes encoder's parameters, not its running
        statistics); a pattern that selects only non-parameters is an error.
        """
        assert self.patterns is not None
        model_leaves = jax.tree.leaves(x, is_leaf=is_none)
        present = tuple(leaf is not None for leaf in model_leaves)
        usable_only = tuple(leaf is not None for leaf in leaves)
        for pattern in self.patterns:
            self._check_pattern(x, pattern, present, usable_only)
        return selection(x, self.patterns, what=f"ft.{self.op}(wrt=)", only=usable_only)

    def _check_pattern(self, x: Any, pattern: str, present: tuple[bool, ...], usable: tuple[bool, ...]) -> None:
        try:
            hits = selection(x, (pattern,), what=f"ft.{self.op}(wrt=)", only=present)
        except NothingSelected as e:
            if e.out_of_range is not None:
                raise ValueError(e.out_of_range) from None
            parameter_names = [n for n, ok in zip(names(x), usable) if ok]
            examples = list(dict.fromkeys(e.close + parameter_names[:3]))
            right = "" if e.suggestion is None else f"    right:  wrt={e.suggestion!r}\n"
            keyword = _keyword_named(self.f, pattern)
            if keyword is not None:
                right = _keywords_hint(self.op, self.f, pattern, _position(self.f, keyword, len(self.args)))
            raise ValueError(PATTERN_SELECTS_NOTHING.format(
                patterns=pattern, fn=fn_name(self.f), extra="", examples=examples, right=right)) from None
        if any(np.any(h) and ok for h, ok in zip(hits, usable)):
            return
        first = next(i for i, h in enumerate(hits) if np.any(h))
        orig = jax.tree.leaves(x, is_leaf=is_none)[first]
        why = "a no_derivative field" if is_parameter_leaf(orig) else f"dtype {getattr(orig, 'dtype', type(orig).__name__)}"
        parameter_names = [n for n, ok in zip(names(x), usable) if ok]
        raise ValueError(PATTERN_SELECTS_NON_PARAMETER.format(
            patterns=pattern, path=names(x)[first], why=why, op=self.op,
            example=parameter_names[0] if parameter_names else "*"))

    def _why_not(self, i: int, x: Any) -> str:
        if isinstance(x, Module):
            why = f"{type(x).__name__} has no parameters (only no_derivative, integer or bool leaves)."
        else:
            dtypes = sorted({str(getattr(leaf, "dtype", type(leaf).__name__)) for leaf in jax.tree.leaves(x)})
            why = f"it holds only non-differentiable values ({', '.join(dtypes) or 'no leaves'})."
        floats = [(p, v) for p, v in jax.tree_util.tree_flatten_with_path(x)[0] if isinstance(v, (float, complex))]
        right = self._without(i)
        if floats:
            path, value = floats[0]
            why += (f" Python numbers in a tree are static data, not parameters ("
                    f"{jax.tree_util.keystr(path)} = {value!r}); to differentiate one, make it an array: "
                    f"jnp.asarray({value!r}).")
            if right is AS_FLOAT:  # (a cast to float32 would drop a complex number's imaginary part)
                right = AS_ARRAY.format(value=value)
        return NOT_DIFFERENTIABLE_ARGUMENT.format(index=i, fn=fn_name(self.f), why=why, right=right)

    def _without(self, i: int) -> str:
        """The fix's lines: ``wrt=`` the arguments asked for that carry derivatives, without
        ``i`` (never another argument: its derivative would answer another question)."""
        rest = [j for j in self.indices if j != i and jax.tree.leaves(parameters(self.args[j]))]
        if not rest:
            return AS_FLOAT
        return WITHOUT_ARGUMENT.format(op=self.op, index=i, suggest=rest[0] if len(rest) == 1 else tuple(rest))

    def rebuild(self, primals: Sequence[Any]) -> tuple:
        args = list(self.args)
        for k, (i, p) in enumerate(zip(self.indices, primals)):
            if self.members and k == 0 and any(m is not None for m in self.members[0]):
                p = _members_only(p, self.members[0])
            args[i] = with_parameters(self.args[i], p)
        return tuple(args)

    def wrap(self, pack: Callable[[Any], Any] = lambda out: out) -> Callable[..., Any]:
        def g(*primals: Any) -> Any:
            return pack(self.f(*self.rebuild(primals)))

        return g

    @property
    def argnums(self) -> int | tuple[int, ...]:
        return 0 if self.single else tuple(range(len(self.primals)))

    def result(self, tangents: Sequence[Any]) -> Any:
        return tangents[0] if self.single else tuple(tangents)

    def split_input(self, t: Any) -> tuple:
        if self.single:
            return (t,)
        if not isinstance(t, tuple) or len(t) != len(self.indices):
            raise TypeError(TANGENT_TUPLE.format(count=len(self.indices), wrt=self.indices))
        return t


def _members_only(primal: Any, members: tuple[Any, ...]) -> Any:
    """The primal with derivatives through the selected members only: a stacked leaf partly
    selected (``wrt="h.2.*"``) is ``where(m, w, stop_gradient(w))``, the same values, so
    the other members' derivatives are exactly zero."""
    leaves, treedef = jax.tree.flatten(primal, is_leaf=is_none)
    return treedef.unflatten([
        w if m is None or w is None else jnp.where(broadcast(m, w), w, jax.lax.stop_gradient(w))
        for w, m in zip(leaves, members)
    ])


# (structure of x, structure of its parameter view, patterns) -> what the patterns select.
_SELECTION_CACHE: dict[Any, tuple[Any, ...]] = {}
