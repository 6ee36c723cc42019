"""The twenty-seventh session's operators audit: JAX's and torch's habits on functree's
differential operators. Each raised Python's bare "unexpected keyword argument" (JAX's
argnums / allow_int / reduce_axes, has_aux or holomorphic where the operator has none,
torch's create_graph / retain_graph), a bare IndexError or JAX's "two-element tuple" (a
has_aux function returning no pair), misled (the function and the point swapped: "pass the
value as float"; JAX's positional argnums, ft.gradient(f, 1)), or was a bare AttributeError
(ft.vjp, ft.jacfwd, ft.checkpoint, ft.custom_vjp, ft.enable_grad...). Each now names
functree's way, and every right line shown is run here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree._foreign_methods import FOREIGN_FUNCTION, FOREIGN_FUNCTIONS
from functree._operator_habits import (
    ARGNUMS_AS_POINT,
    ARGUMENTS_SWAPPED,
    AUX_NOT_A_PAIR,
    FOREIGN_KEYWORD,
    FOREIGN_KEYWORDS,
    VALUE_GIVEN,
)
from functree._operators import RESULT_WITH_AUX
from functree._plan import fn_name

# values of order 1-10 in float32, computed two ways (functree's and JAX's own transform):
# measured |Δ| = 0; ten float32 ulps of 10.
ATOL = 1e-5

OPS = ("gradient", "value_with_gradient", "pullback", "value_with_pullback", "differential",
       "value_with_differential", "derivative", "jacobian", "hessian")
SCALAR_FN = ("gradient", "value_with_gradient", "hessian")


def _point(op):
    return 2.0 if op == "derivative" else jnp.array([1.0, 2.0])


def _run(line, **names):
    """Run a right line (statements; a trailing comment allowed) with ``names`` defined."""
    scope = {"ft": ft, "jax": jax, "jnp": jnp, **names}
    exec(line, scope)  # the suggestion under test
    return scope


def _message(op, name, value):
    entry = FOREIGN_KEYWORDS[name]
    why, right = entry[op] if isinstance(entry, dict) else entry
    return FOREIGN_KEYWORD.format(op=op, name=name, value=value, why=why, right=right.format(op=op, value=value)), \
        right.format(op=op, value=value)


def _refused(op, name, value):
    with pytest.raises(TypeError) as info:
        getattr(ft, op)(lambda x: x, **{name: value})
    text, right = _message(op, name, value)
    assert str(info.value) == text
    return right


@pytest.mark.parametrize("op", OPS)
def test_argnums_names_wrt(op):
    """ft.gradient(loss, argnums=1) on every operator: wrt=1, and the right line gives JAX's
    derivative with respect to the second argument."""
    f = lambda a, b: a * b * b  # noqa: E731
    if True:
        right = _refused(op, "argnums", 1)
        out = _run("out = " + right, f=f, a=2.0, b=3.0)["out"]
        if op in ("pullback", "value_with_pullback", "differential", "value_with_differential"):
            pushed = out[1] if isinstance(out, tuple) else out
            out = pushed(jnp.float32(1.0))
        value = out[1] if op == "value_with_gradient" else out
        expected = jax.hessian(f, argnums=1)(2.0, 3.0) if op == "hessian" else jax.grad(f, argnums=1)(2.0, 3.0)
        np.testing.assert_allclose(value, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("op", OPS)
def test_allow_int_names_the_way(op):
    """JAX's allow_int: integer leaves are carried here (their derivative is None); the
    right line, the operator without it, runs on a point with an integer leaf."""
    f = lambda x: jnp.sum(x["w"] ** 3) * x["n"]  # noqa: E731
    x = {"w": _point(op), "n": 2}
    if op == "derivative":
        _run(_refused(op, "allow_int", True), f=lambda w: w ** 3 * 2, x=2.0)
    else:
        _run(_refused(op, "allow_int", True), f=f, x=x)


@pytest.mark.parametrize("name, value", [("reduce_axes", ("batch",)), ("create_graph", True), ("retain_graph", True)])
def test_jax_and_torch_keywords_name_the_way(name, value):
    """reduce_axes (psum under the mapped axis), torch's create_graph (the operators
    compose) and retain_graph (keep the pullback): refused by name on every operator; the
    right line (the same for all) runs."""
    f = lambda x: jnp.sum(x ** 3)  # noqa: E731
    lines = {op: _refused(op, name, value) for op in OPS}
    assert len(set(lines.values())) == 1
    _run(lines["gradient"], f=f, x=_point("gradient"), xs=jnp.ones((2, 3)))
    if name == "reduce_axes":
        got = _run("out = " + lines["gradient"], f=f, xs=jnp.ones((2, 3)))["out"]
        np.testing.assert_allclose(got, np.full((2, 3), 6.0), rtol=0, atol=ATOL)  # 3 x² summed over 2
    if name == "create_graph":
        x = jnp.array([1.0, 2.0])
        np.testing.assert_allclose(ft.jacobian(ft.gradient(f), at=x), ft.hessian(f, at=x), rtol=0, atol=ATOL)


@pytest.mark.parametrize("op", ["pullback", "value_with_pullback", "differential", "value_with_differential",
                                "derivative", "hessian"])
def test_holomorphic_where_the_operator_takes_none(op):
    """holomorphic=True on pullback / differential / derivative / hessian (JAX's vjp and jvp
    take none): each right line gives f'(z) (the Hessian's, f'') of a holomorphic f."""
    z = jnp.complex64(1.0 + 1.0j) if op == "derivative" else jnp.array([1.0 + 1.0j, 2.0 - 0.5j])
    f = (lambda z: jnp.sum(z ** 3)) if op == "hessian" else (lambda z: z ** 2)
    out = _run("out = " + _refused(op, "holomorphic", True).replace(";  ", ";  out = "), f=f, z=z)["out"]
    np.testing.assert_allclose(out, np.diag(6 * z) if op == "hessian" else 2 * z, rtol=0, atol=ATOL)


def test_has_aux_where_the_operator_takes_none():
    """has_aux on pullback / differential / derivative / hessian: the value_with_ operator's
    has_aux (or the loss alone), and the right lines run."""
    f = lambda x: (jnp.sum(x ** 3), 2.0 * x)  # noqa: E731
    for op in ("pullback", "differential", "derivative", "hessian"):
        x = _point(op)
        scope = _run(_refused(op, "has_aux", True), f=f, x=x)
        np.testing.assert_allclose(scope["aux"], 2.0 * x, rtol=0, atol=ATOL)
    assert float(_run(_refused("derivative", "has_aux", True), f=f, x=2.0)["dfdx"]) == 12.0


@pytest.mark.parametrize("op", OPS)
def test_swapped_value_given_and_positional_argnums(op):
    """ft.gradient(x, loss) said "pass the value as float: x.astype(jnp.float32)" (and
    ft.derivative "Cannot determine dtype of <function>"); torch's autograd.grad(loss, x)
    habit, a value for the function, failed inside functools; JAX's ft.gradient(f, 1) said
    the int "holds only non-differentiable values". Each names the fix, which runs."""
    op_fn, x = getattr(ft, op), _point(op)
    cube = lambda x: jnp.sum(x ** 3)  # noqa: E731
    for call in (lambda: op_fn(x, cube), lambda: op_fn(x, at=cube)):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == ARGUMENTS_SWAPPED.format(op=op, given="a float" if op == "derivative" else "a float32 array of shape (2,)",
                                                           fn=fn_name(cube), f="f")
    with pytest.raises(TypeError) as info:
        op_fn(cube(x), at=x)
    assert str(info.value) == VALUE_GIVEN.format(op=op, given="a float32 array of shape ()")
    _run(f"ft.{op}(f, at=x)", f=cube, x=x)  # the right line of both
    with pytest.raises(TypeError) as info:
        op_fn(lambda a, b: a * b, 1)
    assert str(info.value) == ARGNUMS_AS_POINT.format(op=op, at=1, point="1.0")
    _run(f"ft.{op}(f, wrt=1)(a, b)", f=lambda a, b: a * b, a=2.0, b=3.0)
    _run(f"ft.{op}(f, at=1.0)", f=lambda a: a * a)


@pytest.mark.parametrize("op, result, what", [
    ("gradient", lambda x: jnp.sum(x * x), "a float32 array of shape ()"),
    ("value_with_gradient", lambda x: jnp.sum(x * x), "a float32 array of shape ()"),
    ("gradient", lambda x: (jnp.sum(x), 1.0, 2.0), "a tuple of 3 items"),
    ("gradient", lambda x: {"loss": jnp.sum(x)}, "a dict"),
    ("value_with_pullback", lambda x: x * x, "a float32 array of shape (2,)"),
    ("value_with_differential", lambda x: x * x, "a float32 array of shape (2,)"),
    ("jacobian", lambda x: x * x, "a float32 array of shape (2,)"),
])
def test_has_aux_without_a_pair(op, result, what):
    """has_aux=True with a loss returning a plain scalar was a bare IndexError (gradient);
    a dict a bare KeyError; elsewhere JAX's "two-element tuple ... LinearizeTracer"."""
    x = jnp.array([1.0, 2.0])
    with pytest.raises(TypeError) as info:
        getattr(ft, op)(result, at=x, has_aux=True)
    assert str(info.value) == AUX_NOT_A_PAIR.format(op=op, fn=fn_name(result), what=what)


def test_hessian_of_a_loss_with_aux_names_a_line_that_runs():
    """ft.hessian of a (loss, aux) function suggested ft.hessian(..., has_aux=True), which
    ft.hessian does not take; the line it names now runs and gives the loss's Hessian."""
    loss_fn = lambda m: (jnp.sum(m ** 3), m)  # noqa: E731
    model = jnp.array([1.0, 2.0])
    with pytest.raises(TypeError) as info:
        ft.hessian(loss_fn, at=model)
    right = "ft.hessian(lambda m: loss_fn(m)[0], at=model);  aux = loss_fn(model)[1]"
    how = "ft.hessian takes no aux output:\ndifferentiate the loss alone and compute the aux apart:"
    assert str(info.value) == RESULT_WITH_AUX.format(op="ft.hessian", fn=fn_name(loss_fn), kind="tuple", how=how,
                                                     right=right)
    assert f"right:  {right}\n" in str(info.value)
    scope = _run("h = " + right, loss_fn=loss_fn, model=model)
    np.testing.assert_allclose(scope["h"], np.diag([6.0, 12.0]), rtol=0, atol=ATOL)


NAMES = ("stop_gradient", "detach", "vjp", "jvp", "linearize", "jacrev", "jacfwd", "checkpoint", "remat",
         "custom_vjp", "custom_jvp", "enable_grad", "set_grad_enabled", "autograd", "grad", "value_and_grad")


def _f(x):
    return jnp.sin(x) * x


X, T = jnp.array([0.5, 1.5]), jnp.array([1.0, -2.0])


def _loss_fn(m):
    return jnp.sum(m(jnp.ones((3, 2))) ** 2)


# name -> the check of its right line's result (scope, model): JAX's own transform agrees
CHECKS = {
    "stop_gradient": lambda s, m: (ft.gradient(lambda x: jnp.sum(s["y"] * x), at=X), X),
    "vjp": lambda s, m: (s["dx"], jax.vjp(_f, X)[1](jnp.ones(2))[0]),
    "jvp": lambda s, m: (s["dy"], jax.jvp(_f, (X,), (T,))[1]),
    "jacrev": lambda s, m: (s["J"], jax.jacrev(_f)(X)),
    "jacfwd": lambda s, m: (s["J"], jax.jacfwd(_f)(X)),
    "checkpoint": lambda s, m: (ft.jacobian(s["g"], at=X), jax.jacrev(_f)(X)),
    # the rule's 3, not f's own derivative: the rule is used
    "custom_vjp": lambda s, m: (ft.jacobian(s["f"], at=X), 3.0 * np.eye(2)),
    "custom_jvp": lambda s, m: (ft.jacobian(s["f"], at=X, mode="forward"), 3.0 * np.eye(2)),
    "grad": lambda s, m: (s["grads"].weight, jax.grad(lambda w: _loss_fn(m.replace(weight=w)))(m.weight)),
    "value_and_grad": lambda s, m: (s["grads"].weight, jax.grad(lambda w: _loss_fn(m.replace(weight=w)))(m.weight)),
}
CHECKS.update(detach=CHECKS["stop_gradient"], linearize=CHECKS["jvp"], remat=CHECKS["checkpoint"],
              enable_grad=CHECKS["grad"], set_grad_enabled=CHECKS["grad"], autograd=CHECKS["grad"])


@pytest.mark.parametrize("name", NAMES)
def test_jax_and_torch_names_on_ft_name_swifts(name, dense):
    """ft.vjp, ft.jvp, ft.jacfwd, ft.checkpoint, ft.custom_vjp, torch's ft.enable_grad...
    were bare AttributeErrors; each names functree's operator, and its line runs and agrees
    with JAX's own transform."""
    what, right = FOREIGN_FUNCTIONS["functree"][name]
    with pytest.raises(AttributeError) as info:
        getattr(ft, name)
    assert str(info.value) == FOREIGN_FUNCTION.format(package="functree", name=name, what=what, right=right)
    rule = (lambda x: (_f(x), lambda t: 3.0 * t)) if name == "custom_jvp" else (lambda x: (_f(x), lambda v: 3.0 * v))
    scope = _run(right, f=_f, x=X, t=T, model=dense, loss_fn=_loss_fn, rule=rule)
    got, expected = CHECKS[name](scope, dense)
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def dense():
    return ft.nn.Dense(2, 1, key=jax.random.key(0))


@pytest.mark.parametrize("op", ["gradient", "value_with_gradient", "hessian"])
def test_a_dict_of_outputs_names_the_loss_by_key(op):
    """A loss returning {"loss": ..., "acc": ...} was told to add has_aux=True, which then
    refused the dict (no pair); the right line picks the loss by key and runs."""
    loss_fn = lambda m: {"loss": jnp.sum(m ** 3), "acc": m[0]}  # noqa: E731
    model = jnp.array([1.0, 2.0])
    with pytest.raises(TypeError) as info:
        getattr(ft, op)(loss_fn, at=model)
    right = next(line for line in str(info.value).splitlines() if "right:" in line).split("right:", 1)[1].strip()
    assert 'loss_fn(m)["loss"]' in right
    out = _run("out = " + right, loss_fn=loss_fn, model=model)["out"]
    grads = out if op == "hessian" else out[1] if op == "value_with_gradient" else out[0]
    np.testing.assert_allclose(grads, np.diag([6.0, 12.0]) if op == "hessian" else [3.0, 12.0], rtol=0, atol=ATOL)
