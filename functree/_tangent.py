"""The Differentiable protocol as functions: move along tangents, zero tangents, arithmetic.

A tangent vector of a model has the model's parameter view structure (``None`` at
non-parameters). These functions are pure and jit-friendly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._alias import warn_aliases
from functree._parameters import (
    STRUCTURE_MISMATCH,
    ShapeMismatch,
    field_mask,
    first_difference,
    is_no_derivative_field,
    is_parameter_leaf,
    map_checked,
    parameters,
    path_of,
)
from functree._tree import bounded_put, cached, is_none
from functree._where import committed_sharding

__all__ = [
    "move",
    "zero_tangent_vector",
    "zero_tangent_vector_initializer",
    "tangent_add",
    "tangent_subtract",
    "tangent_scale",
    "inner_product",
    "tangent_norm",
    "check_tangent",
]

TANGENT_DTYPE = """\
{what}: the {kind} at {path} has dtype {given}; {against} there has dtype {expected}. \
JAX takes a {kind} in exactly that dtype, and casting it for you would round it (or drop \
an imaginary part) without a word. A Python number is cast for you (it has no dtype of its own).
    wrong:  {what}(... {kind} of dtype {given} at {path} ...)
    right:  cast it yourself: jax.tree.map(lambda t: t.astype(jnp.{expected}), {kind})
       or:  build it from the parameters: jax.tree.map(jnp.ones_like, ft.parameters(x))"""

OPERATOR_TANGENT_SHAPE = """\
{what}: the {kind} at {path} has shape {given}; {against} there has shape {expected}. \
JAX takes a {kind} of exactly that shape (a Python number too: it is not broadcast).
    wrong:  {call}(...)   # {path}: shape {given}
    right:  {call}(jax.tree.map(jnp.ones_like, ft.parameters({like})))   # {like}: {likewhat}, shaped {expected} at {path}"""

# kind -> (the call, what it is matched against, what to shape it like), for OPERATOR_TANGENT_SHAPE
_SHAPE_ADVICE = {
    "tangent": ("df", "the parameter", "x", "the point"),
    "cotangent": ("pb", "the result", "y", "the result"),
}

COMPLEX_ON_REAL = """\
ft.move: the tangent at {path} is complex ({given}); the parameter there is real \
({expected}). Moving along it would silently drop the imaginary part.
    wrong:  ft.move(model, along=complex_tangent)
    right:  ft.move(model, along=jax.tree.map(jnp.real, complex_tangent))   # if the real part is meant
       or:  make the parameter complex: x.astype(jnp.complex64)"""

TANGENT_AT_NON_PARAMETER = """\
{what}: the tangent has a value at {path}, which is {why}. A tangent (a gradient, an \
update, a direction) has the parameter view's structure, None at every non-parameter; \
{effect}
    wrong:  {wrong}
    right:  {right}
       or:  ft.parameters(tangent)            # keep the parameters' values, None elsewhere
       or:  ft.zero_tangent_vector(model)     # zeros at every parameter, None elsewhere"""

TANGENT_OUTSIDE_WRT = """\
{what}: the tangent has a value at {path}, a parameter outside wrt= (not differentiated \
here). The differential is taken along the parameters wrt= selects only: a tangent holds \
None at every other parameter (the structure ft.gradient(f, at=model, wrt=...) returns), \
or that part of the direction would be dropped without a word.
    wrong:  df(ft.zero_tangent_vector(model))   # a value at every parameter
    right:  {outside}"""


class Advice(NamedTuple):
    """What a refused tangent would do, and the wrong and right code, for one operation;
    ``outside``: the right code for a value at a parameter outside ``wrt=`` patterns
    (:data:`TANGENT_OUTSIDE_WRT`), where the operation has them."""

    effect: str
    wrong: str
    right: str
    outside: str = ""


_MOVE = Advice(
    effect="moving along it would change a value that is never differentiated.",
    wrong="ft.move(model, along=jax.grad(loss)(model))   # values at no_derivative fields too",
    right="ft.move(model, along=ft.gradient(loss, at=model))   # None at non-parameters",
)


class _NonParameterValue(Exception):
    """A tangent's value met a leaf that is not a parameter (raised inside a map)."""


class _ComplexOnReal(Exception):
    """A complex tangent met a real parameter (raised inside a map)."""

    def __init__(self, t: Any, x: Any):
        super().__init__()
        self.leaf, self.given, self.expected = t, jnp.result_type(t), jnp.result_type(x)



def move_leaf(t: Any, x: Any) -> Any:
    """One parameter moved along its tangent: ``x + t`` in ``x``'s dtype (``None``: no move).

    The tangent has the parameter's shape (a smaller one would broadcast the parameter to
    another shape, silently). The sum is taken in the wider of the two dtypes and rounded
    once to the parameter's, as ``optax.apply_updates`` does: a float32 update moves a
    bfloat16 weight to the bfloat16 nearest ``x + t`` (rounding ``t`` first lost steps)."""
    if t is None:
        return x
    if isinstance(x, int) or (hasattr(x, "dtype") and not is_parameter_leaf(x)):
        raise _NonParameterValue  # a dtype change under a tree definition already checked
    if isinstance(x, float):
        return x + t
    if hasattr(x, "shape") and np.shape(t) != x.shape:
        raise ShapeMismatch(t, x)
    dtype = jnp.result_type(x)
    t = jnp.asarray(t)
    if t.dtype == dtype:
        return x + t
    if jnp.iscomplexobj(t) and not jnp.iscomplexobj(x):
        raise _ComplexOnReal(t, x)
    with jax.numpy_dtype_promotion("standard"):  # the type the sum is exact in (f16, f32: f32)
        wide = jnp.promote_types(dtype, t.dtype)
    return (jnp.asarray(x).astype(wide) + t.astype(wide)).astype(dtype)


def move(x: Any, *, along: Any) -> Any:
    """Swift's ``move(along:)``: ``x + along`` at every parameter; ``None`` means unchanged.

    ``along`` has the parameter view's structure: a gradient, an optimizer update, a
    tangent. Each parameter keeps its dtype. A value at a non-parameter (a
    ``no_derivative`` field, an integer leaf), as in the full-structure tree ``jax.grad``
    returns, is an error naming its key path (see :func:`check_tangent`): never written.
    One array object at two parameters (one layer put at two fields) given the same update
    at both (a frozen group's zeros) stays one array; given different ones it is untied by
    the move: the first move of each model holding one warns (:class:`ft.AliasWarning`),
    unless an optimizer's ``init`` named that tie already.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.move({"w": jnp.ones(2), "n": 3}, along={"w": -0.5 * jnp.ones(2), "n": None})
      {'n': 3, 'w': Array([0.5, 0.5], dtype=float32)}
    """
    check_tangent("ft.move", along, x, advice=_MOVE)
    first: dict[int, tuple[Any, Any]] = {}  # id of a leaf -> (its tangent, its moved value)
    apart: set[int] = set()  # arrays at several leaves given different tangents

    def moved(t: Any, leaf: Any) -> Any:
        new = move_leaf(t, leaf)  # (the repeats are found on the way: a second pass costs a flatten)
        seen = first.setdefault(id(leaf), (t, new))
        if seen[1] is new:
            return new
        if _same_tangent(seen[0], t):  # a tie moved alike (a frozen one: zeros) stays one array
            return seen[1]
        apart.add(id(leaf))
        return new

    try:
        out = map_checked("ft.move", moved, along, x, is_leaf=is_none)
        if apart:  # a hand loop with a plain optax init: one array at two parameters is untied now
            warn_aliases(parameters(x), what="The model given to ft.move", copied=False,
                         trained=lambda: jax.tree.map(lambda v: v if id(v) in apart else None, parameters(x)))
        return out
    except ShapeMismatch as e:
        raise ValueError(TANGENT_SHAPE.format(what="ft.move", path=path_of(along, e.leaf), given=e.given,
                                              expected=e.expected)) from None
    except _ComplexOnReal as e:
        raise ValueError(COMPLEX_ON_REAL.format(path=path_of(along, e.leaf), given=e.given,
                                                expected=e.expected)) from None
    except _NonParameterValue:
        check_tangent("ft.move", along, x, advice=_MOVE, cache=False, structure=True)
        raise ValueError(  # the check above names the key path; this is its fallback
            "ft.move: the tangent has a value at a leaf that is not a parameter (an integer "
            "or bool leaf). Build it with ft.gradient(loss, at=model) or ft.parameters(tangent)."
        ) from None


def _same_tangent(a: Any, b: Any) -> bool:
    """Whether two tangents move one array to the same value (``None`` is zero): the tie
    then survives the move. A traced tangent is not known here, so it counts as another.
    Compared where the arrays are (one boolean read back, not the arrays: a tied embedding
    on a GPU would cross to the host at every step of an eager loop)."""
    if a is b:
        return True
    if isinstance(a, Tracer) or isinstance(b, Tracer):
        return False
    if a is None or b is None:
        given = b if a is None else a
        return given is None or not bool(jnp.any(given))
    return np.shape(a) == np.shape(b) and jnp.result_type(a) == jnp.result_type(b) and bool(jnp.array_equal(a, b))


TANGENT_SHAPE = """\
{what}: the tangent at {path} has shape {given}; the parameter there has shape {expected}. \
Added, it would broadcast the parameter to another shape (or fail inside JAX).
    wrong:  {what}(model, along=updates)      # updates{path}: shape {given}
    right:  a tangent with the parameter view's shapes: ft.gradient(loss, at=model), an optimizer's updates"""


# (tree definition of the point, of the view, of the tangent) already checked.
_CHECKED: dict[Any, bool] = {}


def check_tangent(
    what: str, tangent: Any, x: Any, view: Any = None, *, advice: Advice,
    cache: bool = True, structure: bool = False, allow_float0: bool = False,
) -> bool:
    """Refuse a tangent with a value where ``view`` (by default ``ft.parameters(x)``) has
    ``None``: a no-derivative field, an integer leaf, a parameter not differentiated.

    The one check of every operation that takes a tangent (``ft.move``, the optimizers'
    ``move``, ``ft.differential``'s tangents). It reads tree definitions only, once per
    pair of them (a jitted step pays it at trace time); trees of other structures are left
    to the operation's own structure check. Returns whether it checked (False: these tree
    definitions were checked before), for a caller's own once-per-structure check.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Body(ft.Module):
      ...     x: jnp.ndarray
      ...     mass: jnp.ndarray = ft.field(no_derivative=True)
      >>> body = Body(jnp.zeros(2), jnp.ones(()))
      >>> ft.move(body, along=Body(jnp.ones(2), -0.2 * jnp.ones(())))
      Traceback (most recent call last):
      ValueError: ft.move: the tangent has a value at .mass, which is a no_derivative field...
    """
    key, known = cached(
        _CHECKED,
        # Without is_leaf: None is then no leaf, so where the Nones are is part of the key.
        (jax.tree.structure(x), None if view is None else jax.tree.structure(view),
         jax.tree.structure(tangent),
         # where the float0 leaves are: one passes where a float value is refused (without
         # it in the key, a pullback given float0 once took a float at an integer leaf)
         allow_float0 and tuple(map(_is_float0, jax.tree.leaves(tangent)))),
    )
    if known and cache:
        return False
    view = parameters(x) if view is None else view
    t_leaves, t_def = jax.tree_util.tree_flatten_with_path(tangent, is_leaf=is_none)
    v_leaves, v_def = jax.tree.flatten(view, is_leaf=is_none)
    if t_def != v_def and structure:
        diff = first_difference(view, tangent, none_is_leaf=True)
        if diff is not None:
            path, detail = diff
            raise ValueError(STRUCTURE_MISMATCH.format(what=what, path=path, detail=detail))
    if t_def == v_def:
        for (path, t), v, (k, leaf) in zip(t_leaves, v_leaves, enumerate(jax.tree.leaves(x, is_leaf=is_none))):
            if t is not None and v is None and not (allow_float0 and _is_float0(t)):
                why, where = _why_not_parameter(x, k, leaf), jax.tree_util.keystr(path) or "<root>"
                if why == _OUTSIDE_WRT and advice.outside:
                    raise ValueError(TANGENT_OUTSIDE_WRT.format(what=what, path=where, outside=advice.outside))
                raise ValueError(TANGENT_AT_NON_PARAMETER.format(what=what, path=where, why=why, **advice._asdict()))
    if key is not None:
        bounded_put(_CHECKED, key, True)
    return True


def _is_python_number(t: Any) -> bool:
    return isinstance(t, (int, float, complex)) and not isinstance(t, (bool, np.generic))


def matched_dtypes(what: str, kind: str, tangent: Any, expected: Any, prefix: str = "") -> Any:
    """``tangent`` in the dtypes of ``expected``'s leaves (a differential's primal view, a
    pullback's result), as JAX's linearized functions and pullbacks take it.

    A Python number is cast to its leaf's dtype (``df(1.0)`` at a bfloat16 point), as JAX
    casts a weakly typed scalar; a real number to a complex leaf too (exact). An array of
    another shape (a Python number at a non-scalar leaf too) is refused with
    :data:`OPERATOR_TANGENT_SHAPE`, an array of
    another dtype with :data:`TANGENT_DTYPE`, naming the key path: a bfloat16
    tangent of a float32 parameter is rounded already, a float32 one of a bfloat16 parameter
    would be rounded. ``None``, float0 and leaves that are not parameters are left to the
    structure checks. Trees of another structure are returned as they are. ``prefix``
    starts the key path an error names (``[1]``: the second of several tangents).
    """
    t_leaves, t_def = jax.tree.flatten(tangent, is_leaf=is_none)
    e_leaves = jax.tree.leaves(expected, is_leaf=is_none)
    if len(t_leaves) != len(e_leaves):
        return tangent
    out, changed = [], False
    for k, (t, e) in enumerate(zip(t_leaves, e_leaves)):
        if t is None or e is None or _is_float0(t) or not (isinstance(e, float) or is_parameter_leaf(e)):
            out.append(t)
            continue
        if np.shape(t) != np.shape(e):  # JAX's own error names no key path
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tangent, is_leaf=is_none)[0][k][0])
            call, against, like, likewhat = _SHAPE_ADVICE[kind]
            raise ValueError(OPERATOR_TANGENT_SHAPE.format(
                what=what, kind=kind, path=prefix + path or "<root>", given=np.shape(t), expected=np.shape(e),
                against=against, call=call, like=like, likewhat=likewhat))
        want = jnp.result_type(e)
        if _is_python_number(t) and not (isinstance(t, complex) and not jnp.iscomplexobj(e)):
            if jnp.result_type(t) == want:  # float32 already: JAX takes it as is (weakly typed)
                out.append(t)
                continue
            out.append(jnp.asarray(t, want))
            changed = True
            continue
        given = jnp.result_type(t)
        if given != want:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tangent, is_leaf=is_none)[0][k][0])
            raise ValueError(TANGENT_DTYPE.format(
                what=what, kind=kind, path=prefix + path or "<root>", given=given, expected=want,
                against="the parameter" if kind == "tangent" else "the result"))
        out.append(t)
    return t_def.unflatten(out) if changed else tangent


def _is_float0(t: Any) -> bool:
    return getattr(t, "dtype", None) == jax.dtypes.float0


def _why_not_parameter(x: Any, k: int, leaf: Any) -> str:
    """Why leaf ``k`` of ``x`` (flattened with ``None`` as leaves) is not differentiated."""
    if leaf is None:
        return "None in the model"
    no_derivative = jax.tree.leaves(field_mask(x, is_no_derivative_field), is_leaf=is_none)
    if k < len(no_derivative) and no_derivative[k] is True:
        return "a no_derivative field"
    if isinstance(leaf, (float, complex)):
        return (f"a Python {type(leaf).__name__}: static data, not a parameter (to train it, make it "
                f"an array: jnp.asarray({leaf!r}))")
    if not is_parameter_leaf(leaf):
        return f"not floating ({getattr(leaf, 'dtype', type(leaf).__name__)}): not a parameter"
    return _OUTSIDE_WRT


_OUTSIDE_WRT = "a parameter not differentiated here (outside wrt=: give None there)"


def _zeros(spec: Any) -> Any:
    return jnp.zeros(spec.shape, spec.dtype, device=spec.sharding)


def zero_tangent_vector(x: Any) -> Any:
    """Zeros shaped like the parameter view of ``x``: ``move(x, along=zero) == x``.

    Non-parameters (here an integer array) are ``None`` in the result. Each zero lies where
    its parameter does (a committed array's sharding: a model on device 3 or a mesh).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.zero_tangent_vector({"w": jnp.ones(2), "n": jnp.zeros((), jnp.int32)})
      {'n': None, 'w': Array([0., 0.], dtype=float32)}
    """
    return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a), device=committed_sharding(a)),
                        parameters(x))


def zero_tangent_vector_initializer(x: Any) -> Callable[[], Any]:
    """A closure making :func:`zero_tangent_vector` of ``x`` that holds only shapes and dtypes.

    The closure never references ``x``'s arrays, so it can outlive them (Swift's
    ``zeroTangentVectorInitializer``: "does not capture self").

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> init = ft.zero_tangent_vector_initializer({"w": jnp.ones(3)})
      >>> init()["w"]
      Array([0., 0., 0.], dtype=float32)
    """
    specs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=committed_sharding(a)),
        parameters(x)
    )
    return lambda: jax.tree.map(_zeros, specs)


def tangent_add(a: Any, b: Any) -> Any:
    """``a + b`` leafwise over two tangent trees.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_add({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])})
      {'w': Array([4., 6.], dtype=float32)}
    """
    return _leafwise("ft.tangent_add", jnp.add, a, b)


def tangent_subtract(a: Any, b: Any) -> Any:
    """``a - b`` leafwise over two tangent trees.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_subtract({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])})
      {'w': Array([-2., -2.], dtype=float32)}
    """
    return _leafwise("ft.tangent_subtract", jnp.subtract, a, b)


TANGENT_NOT_FLOATING = """\
{what}: the tangent has a value at {path} of dtype {dtype}, which is not floating: no \
parameter's tangent (integer and bool leaves have none; jax.grad(..., allow_int=True) puts \
float0 placeholders there). Taken as a number it would change the result silently (an \
integer step counter scaled by 0.5 truncates to 0, and adds into a norm).
    wrong:  {what}(jax.grad(loss, allow_int=True)(model), ...)   # or the model itself
    right:  {what}(ft.gradient(loss, at=model), ...)             # None at non-parameters
       or:  {what}(ft.parameters(tree), ...)                     # the parameters' values, None elsewhere"""


class _NotFloating(Exception):
    """A tangent's leaf that is not floating (raised inside a map; the caller names its path)."""

    def __init__(self, leaf: Any):
        super().__init__()
        self.leaf = leaf


def _floating(t: Any) -> Any:
    """``t``, refused (:class:`_NotFloating`) if it is an integer, bool or float0 value: a
    Python ``float``/``complex`` or an inexact array is a tangent's; another object is left
    to the arithmetic."""
    if isinstance(t, int) or (hasattr(t, "dtype") and not jnp.issubdtype(t.dtype, jnp.inexact)):
        raise _NotFloating(t)
    return t


def _not_floating(what: str, e: _NotFloating, *trees: Any) -> ValueError:
    """:data:`TANGENT_NOT_FLOATING` for the leaf of ``e``, named by its key path in ``trees``."""
    path = next((p for p in (path_of(t, e.leaf) for t in trees) if p != "a leaf"), "a leaf")
    dtype = np.dtype(e.leaf.dtype) if hasattr(e.leaf, "dtype") else type(e.leaf).__name__
    return ValueError(TANGENT_NOT_FLOATING.format(what=what, path=path, dtype=dtype))


TANGENTS_DIFFER = """\
{what}: the tangents differ in shape at {path}: {a} and {b}. Combined, they would broadcast
to another shape than the parameter's.
    wrong:  {what}(grads, other)          # other{path}: shape {b}
    right:  two tangents of the same model's parameter view (ft.gradient(loss, at=model))"""


def _leafwise(what: str, op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """``op`` at every leaf of two tangent trees of the same structure and shapes."""
    def combined(x: Any, y: Any) -> Any:
        if np.shape(x) != np.shape(y):
            raise ShapeMismatch(x, y)
        return op(_floating(x), _floating(y))

    try:
        return map_checked(what, combined, a, b)
    except ShapeMismatch as e:
        raise ValueError(TANGENTS_DIFFER.format(what=what, path=path_of(a, e.leaf), a=e.given, b=e.expected)) from None
    except _NotFloating as e:
        raise _not_floating(what, e, a, b) from None


SCALE_NOT_SCALAR = """\
ft.tangent_scale: the scale has shape {shape}; it multiplies every leaf, so it is one \
number (a Python number or a 0-d array). An array would broadcast each leaf to another \
shape (a (3, 1) scale turns a (3,) leaf into (3, 3)) or scale it elementwise.
    wrong:  ft.tangent_scale(tangent, scales)         # scales: shape {shape}
    right:  ft.tangent_scale(tangent, float(scale))   # one number
       or:  jax.tree.map(lambda t, s: t * s, tangent, scales)   # a scale per leaf, shaped like it"""

COMPLEX_SCALE = """\
ft.tangent_scale: the scale is complex ({dtype}) and the leaf at {path} is real \
({leaf_dtype}): the product would silently drop the imaginary part.
    wrong:  ft.tangent_scale(tangent, {scale})
    right:  ft.tangent_scale(tangent, jnp.real(scale))   # if the real part is meant
       or:  make the parameter complex: x.astype(jnp.complex64)"""


def tangent_scale(a: Any, scale: Any) -> Any:
    """``scale * a`` at every leaf, keeping each leaf's dtype.

    ``scale`` may be a Python number or a scalar array of any float dtype (a learning rate
    held as a float32 array scales bfloat16 leaves without a promotion error). The product
    is taken in at least float32 (``promote_types(dtype, float32)``) and rounded once to the
    leaf's dtype, as torch's ``bf16_tensor * lr`` and :func:`move` do: rounding the scale to
    bfloat16 first (``0.003`` is ``0.0030059…`` there) biased every product by +0.2%.
    A scale of another shape (:data:`SCALE_NOT_SCALAR`), or a complex one for a real leaf
    (:data:`COMPLEX_SCALE`), is an error: the product would change the leaf's shape or drop
    the imaginary part.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_scale({"w": jnp.array([1.0, 2.0])}, 0.5)
      {'w': Array([0.5, 1. ], dtype=float32)}
    """
    if jnp.shape(scale) != ():
        raise ValueError(SCALE_NOT_SCALAR.format(shape=jnp.shape(scale)))
    if jnp.iscomplexobj(scale):
        for path, t in jax.tree_util.tree_flatten_with_path(a)[0]:
            if not jnp.iscomplexobj(t):
                raise ValueError(COMPLEX_SCALE.format(
                    dtype=jnp.result_type(scale), path=jax.tree_util.keystr(path) or "<root>",
                    leaf_dtype=jnp.result_type(t), scale=scale if isinstance(scale, complex) else "scale"))

    def scaled(t: Any) -> Any:
        dtype = jnp.result_type(_floating(t))
        # promote_types(dtype, float32), read off the size (strict promotion refuses the call):
        # float32 for bfloat16, float16 and float8; the dtype itself from 32 bits up.
        wide = dtype if np.dtype(dtype).itemsize >= 4 else np.dtype(np.float32)
        product = jnp.asarray(t, wide) * jax.lax.convert_element_type(scale, wide)
        return product.astype(dtype)

    try:
        return jax.tree.map(scaled, a)
    except _NotFloating as e:
        raise _not_floating("ft.tangent_scale", e, a) from None


_WIDE = (np.dtype("float64"), np.dtype("complex128"))


def _accumulation_dtype(leaves: list[Any]) -> Any:
    """float64 if any leaf is float64 or complex128, else float32."""
    return jnp.float64 if any(jnp.result_type(x) in _WIDE for x in leaves) else jnp.float32


def _leaf_inner(x: Any, y: Any, acc: Any) -> jax.Array:
    """``Re Σ conj(x)·y`` of one leaf pair, in ``acc``: both are cast before the product, so
    a bfloat16 leaf's products and their sum are float32 (a bfloat16 vdot cast afterwards
    kept bfloat16's 8 bits: -106.5 for -106.44 over 4096 values); a complex leaf's real part
    is taken, not cast away."""
    if jnp.iscomplexobj(x) or jnp.iscomplexobj(y):
        wide = jnp.complex128 if acc == jnp.float64 else jnp.complex64
        return jnp.real(jnp.vdot(jnp.asarray(x, wide), jnp.asarray(y, wide)))
    return jnp.vdot(jnp.asarray(x, acc), jnp.asarray(y, acc))


def inner_product(a: Any, b: Any) -> jax.Array:
    """``Σ Re⟨a_i, b_i⟩`` over leaves, each leaf's products and the sum taken in float32
    (float64 if any leaf is float64 or complex128): bfloat16 leaves are cast first.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.inner_product({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])})
      Array(11., dtype=float32)
    """
    return _inner("ft.inner_product", a, b)


TANGENT_AT_NO_DERIVATIVE = """\
{what}: the tree has a floating value at {path}, a no_derivative field (a running statistic, \
a buffer), where no parameter's tangent has one: it is the model itself, or jax.grad's \
full-structure tree (whose entry there is the loss's slope in a value no step trains), and \
would count in the result silently. Give the parameter view:
    wrong:  {what}({other}model)                          # or jax.grad(loss)(model)
    right:  {what}({other}ft.parameters(model))           # the parameters' values, None elsewhere
       or:  {what}({other}ft.gradient(loss, at=model))    # the gradient: None at non-parameters"""


def _check_parameter_view(what: str, tree: Any) -> None:
    """:data:`TANGENT_AT_NO_DERIVATIVE` for a floating array of ``tree`` in a ``no_derivative``
    field (BatchNorm's running statistics), which :func:`ft.gradient <functree.gradient>`
    leaves None: a norm or inner product of the model counted them (one flatten; the
    field positions are cached per tree definition)."""
    leaves, treedef = jax.tree.flatten(tree)
    kept = treedef.flatten_up_to(parameters(tree))
    found = next((x for x, k in zip(leaves, kept)
                  if k is None and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)), None)
    if found is not None:
        other = "tangent, " if what == "ft.inner_product" else ""
        raise ValueError(TANGENT_AT_NO_DERIVATIVE.format(what=what, path=path_of(tree, found), other=other))


def _inner(what: str, a: Any, b: Any) -> jax.Array:
    """:func:`inner_product`, its errors naming ``what`` (the public function called)."""
    for tree in (a,) if b is a else (a, b):
        _check_parameter_view(what, tree)
    acc = _accumulation_dtype(jax.tree.leaves(a) + jax.tree.leaves(b))
    try:
        products = jax.tree.leaves(map_checked(what, lambda x, y: _leaf_inner(_floating(x), _floating(y), acc), a, b))
    except _NotFloating as e:
        raise _not_floating(what, e, a, b) from None
    return sum(products, start=jnp.zeros((), acc))


def tangent_norm(a: Any) -> jax.Array:
    """The Euclidean norm ``sqrt(⟨a, a⟩)`` of a tangent tree.

    Its derivative at a zero tree is zero, as torch's ``linalg.vector_norm``'s (a
    subgradient): ``sqrt``'s infinite slope at 0 times the zero derivative of ``⟨a, a⟩`` gave
    NaN, so a norm penalty on parameters that start at zero (LoRA's ``B``, zero biases) or on
    a gradient that vanishes made every gradient NaN. A NaN or infinite norm stays so.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_norm({"w": jnp.array([3.0, 4.0])})
      Array(5., dtype=float32)
      >>> ft.gradient(ft.tangent_norm, at={"w": jnp.zeros(2)})["w"]
      Array([0., 0.], dtype=float32)
    """
    squared = _inner("ft.tangent_norm", a, a)
    zero = squared == 0  # sqrt's slope there is infinite: the branch taken is the constant 0
    return jnp.where(zero, jnp.zeros_like(squared), jnp.sqrt(jnp.where(zero, jnp.ones_like(squared), squared)))
