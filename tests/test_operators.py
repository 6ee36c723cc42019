"""Differential operators under Swift's names, checked against JAX and finite differences."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from _tolerance import needs_float16_conversions
from hypothesis import given, settings
from jax.test_util import check_grads
from test_paths import nested_trees

import functree as ft
from functree import _plan


class BatchNorm(ft.Module):
    scale: jax.Array
    running_mean: jax.Array = ft.field(no_derivative=True)


class Net(ft.Module):
    encoder: BatchNorm
    weight: jax.Array
    bias: float
    steps: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tanh(x * jax.lax.broadcast_to_rank(self.encoder.scale, x.ndim)
                     - jax.lax.broadcast_to_rank(self.encoder.running_mean, x.ndim))
        return h @ self.weight + self.bias


def make_net() -> Net:
    return Net(
        encoder=BatchNorm(jnp.array([1.0, 2.0]), jnp.array([0.1, -0.1])),
        weight=jnp.array([[0.5], [-1.5]]),
        bias=jnp.asarray(0.25),
        steps=jnp.zeros((), jnp.int32),
    )


X = jnp.array([[0.3, -0.7], [1.0, 0.2], [-0.4, 0.9]])


def loss(net: Net, x: jax.Array = X) -> jax.Array:
    return jnp.mean(net(x) ** 2)


def f(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.sin(x) * x**2)


def f_np(x: Any) -> np.ndarray:
    """``f`` in float64 NumPy (references compile no program)."""
    x = np.asarray(x, np.float64)
    return np.sum(np.sin(x) * x**2)


def grad_f_np(x: Any) -> np.ndarray:
    """d/dx Σ sin(x)·x² = cos(x)·x² + 2x·sin(x), in float64."""
    x = np.asarray(x, np.float64)
    return np.cos(x) * x**2 + 2 * x * np.sin(x)


def hessian_f_np(x: Any) -> np.ndarray:
    """The Hessian of ``f``: diagonal, −sin(x)·x² + 4x·cos(x) + 2·sin(x), in float64."""
    x = np.asarray(x, np.float64)
    return np.diag(-np.sin(x) * x**2 + 4 * x * np.cos(x) + 2 * np.sin(x))


def net_gradients_np(net: Net, x: Any, upstream: str = "mean_square") -> dict[str, np.ndarray]:
    """Gradients of ``loss(net, x)`` (upstream="mean_square") or of ``net(x).sum()`` ("sum")
    with respect to encoder.scale, weight and bias, in float64 NumPy."""
    x = np.asarray(x, np.float64)
    scale, mean = np.asarray(net.encoder.scale, np.float64), np.asarray(net.encoder.running_mean, np.float64)
    weight, bias = np.asarray(net.weight, np.float64), np.float64(net.bias)
    h = np.tanh(x * scale - mean)
    out = h @ weight + bias
    g = 2 * out / out.size if upstream == "mean_square" else np.ones_like(out)
    pre = (g @ weight.T) * (1 - h**2)
    return {"scale": (pre * x).sum(0), "weight": h.T @ g, "bias": g.sum()}


def finite_difference_gradient(fn: Any, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences in float64."""
    x = np.asarray(x, np.float64)
    fn = jax.jit(fn)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        out[i] = (float(fn(x + e)) - float(fn(x - e))) / (2 * eps)
    return out


# ------------------------------------------------------------------ gradients


def test_gradient_curried_and_at_a_point_match_jax_grad():
    x = jnp.array([0.3, -1.2, 2.0])
    expected = grad_f_np(x)
    np.testing.assert_allclose(ft.gradient(f)(x), expected, rtol=1e-6)
    np.testing.assert_allclose(ft.gradient(f, at=x), expected, rtol=1e-6)
    value, grad = ft.value_with_gradient(f, at=x)
    np.testing.assert_allclose(value, f_np(x), rtol=1e-6)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_gradient_matches_finite_differences_in_float64():
    # The subject is float64 values, not eager dispatch: each operator runs jitted (one program).
    with jax.enable_x64(True):
        x = np.array([0.3, -1.2, 2.0])
        np.testing.assert_allclose(
            jax.jit(ft.gradient(f))(jnp.asarray(x)), finite_difference_gradient(f, x), rtol=1e-6
        )
        net = make_net()
        as64 = jax.tree.map(
            lambda a: jnp.asarray(np.asarray(a, np.float64)) if ft._parameters.is_parameter_leaf(a) else a, net
        )
        x64 = jnp.asarray(np.asarray(X, np.float64))
        grads = jax.jit(ft.gradient(lambda n: loss(n, x64)))(as64)
        w = np.asarray(as64.weight)
        fd = finite_difference_gradient(lambda w_: loss(as64.replace(weight=jnp.asarray(w_)), x64), w)
        np.testing.assert_allclose(grads.weight, fd, rtol=1e-6)


def test_gradient_of_a_module_has_the_parameter_view_structure():
    net = make_net()
    grads = ft.gradient(loss, at=net)
    assert isinstance(grads, Net)
    assert grads.steps is None and grads.encoder.running_mean is None
    assert jax.tree.structure(grads) == jax.tree.structure(ft.parameters(net))
    expected = net_gradients_np(net, X)
    for got, name in ((grads.encoder.scale, "scale"), (grads.weight, "weight"), (grads.bias, "bias")):
        np.testing.assert_allclose(got, expected[name], rtol=1e-6, err_msg=name)
    assert len(jax.tree.leaves(grads)) == 3  # scale, weight, bias: each checked above
    # Usable with move and with the model's key paths.
    moved = ft.move(net, along=ft.tangent_scale(grads, -0.1))
    kp = ft.key_path(net, "encoder.scale")
    np.testing.assert_allclose(kp.get(moved), kp.get(net) - 0.1 * kp.get(grads), rtol=1e-6)
    assert loss(moved) < loss(net)


def test_gradient_passes_keyword_arguments_through():
    net = make_net()
    g1 = ft.gradient(loss)(net, x=X[:1])
    np.testing.assert_allclose(g1.weight, net_gradients_np(net, np.asarray(X)[:1])["weight"], rtol=1e-6)


def test_errors_name_a_function_called_with_keywords_by_its_name():
    # The call's keywords are bound to the function (a functools.partial): the errors showed
    # its repr, "CallKeywords(<function loss at 0x...>, x=Array([[...]]))", for the name.
    def scored(net: Net, weights: jax.Array, *, x: jax.Array) -> jax.Array:
        return net(x) * weights[None, :]

    net = make_net()
    with pytest.raises(TypeError, match=r"^ft.gradient needs a scalar result, but \S*\bscored returned shape \(3, 3\)"):
        ft.gradient(scored)(net, jnp.ones(3), x=X)
    with pytest.raises(TypeError, match=r"^Cannot differentiate with respect to argument 1 of \S*\bscored:"):
        ft.gradient(scored, wrt=1)(net, jnp.ones(3, jnp.int32), x=X)
    with pytest.raises(IndexError, match=r"wrt=2 names argument 2, but \S*\bscored was called with 2 arg"):
        ft.gradient(scored, wrt=2)(net, jnp.ones(3), x=X)


def test_has_aux():
    def with_aux(x: jax.Array) -> tuple[jax.Array, dict]:
        return f(x), {"norm": jnp.linalg.norm(x)}

    x = jnp.array([1.0, 2.0])
    (_, aux), grad = ft.value_with_gradient(with_aux, at=x, has_aux=True)
    np.testing.assert_allclose(aux["norm"], np.sqrt(5.0), rtol=1e-6)
    np.testing.assert_allclose(grad, grad_f_np(x), rtol=1e-6)
    grad2, aux2 = ft.gradient(with_aux, at=x, has_aux=True)
    np.testing.assert_allclose(grad2, grad)
    assert set(aux2) == {"norm"}
    _, pullback, _ = ft.value_with_pullback(with_aux, at=x, has_aux=True)
    np.testing.assert_allclose(pullback(jnp.ones(())), grad, rtol=1e-6)
    _, differential, _ = ft.value_with_differential(with_aux, at=x, has_aux=True)
    np.testing.assert_allclose(differential(jnp.array([1.0, 0.0])), grad[0], rtol=1e-5, atol=1e-6)


def test_wrt_index_tuple_and_negative_index():
    def g(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
        return jnp.sum(a * b**2 + c)

    a, b, c = jnp.ones(2), jnp.full(2, 3.0), jnp.zeros(2)
    np.testing.assert_allclose(ft.gradient(g, wrt=1)(a, b, c), [6.0, 6.0])
    np.testing.assert_allclose(ft.gradient(g, wrt=-1)(a, b, c), [1.0, 1.0])
    ga, gc = ft.gradient(g, wrt=(0, 2))(a, b, c)
    np.testing.assert_allclose(ga, [9.0, 9.0])
    np.testing.assert_allclose(gc, [1.0, 1.0])
    (ga1,) = ft.gradient(g, wrt=(0,))(a, b, c)  # a 1-tuple gives a 1-tuple
    np.testing.assert_allclose(ga1, ga)


def test_wrt_patterns_select_parameters_of_the_first_argument():
    net = make_net()
    grads = ft.gradient(loss, wrt="encoder")(net)
    assert grads.weight is None and grads.bias is None
    assert grads.encoder.scale is not None and grads.encoder.running_mean is None
    full = ft.gradient(loss, at=net)
    np.testing.assert_allclose(grads.encoder.scale, full.encoder.scale, rtol=1e-6)
    both = ft.gradient(loss, wrt=["weight", "bias"])(net)
    assert both.encoder.scale is None and both.weight is not None and both.bias is not None
    everything = ft.gradient(loss, wrt="*")(net)
    assert jax.tree.structure(everything) == jax.tree.structure(full)


# ------------------------------------------------------------------ pullbacks, differentials


def test_value_with_pullback_matches_vjp():
    def h(x: jax.Array) -> jax.Array:
        return jnp.stack([x[0] * x[1], jnp.exp(x[1]), x[0] ** 3])

    x = jnp.array([0.5, -0.3])
    value, pb = ft.value_with_pullback(h, at=x)
    _, vjp = jax.vjp(h, x)
    v = jnp.array([1.0, 2.0, -1.0])
    np.testing.assert_allclose(value, h(x))
    np.testing.assert_allclose(pb(v), vjp(v)[0], rtol=1e-6)
    np.testing.assert_allclose(ft.pullback(h, at=x)(v), vjp(v)[0], rtol=1e-6)
    np.testing.assert_allclose(ft.pullback(h)(x)(v), vjp(v)[0], rtol=1e-6)


def test_pullback_of_a_module_returns_the_parameter_view():
    net = make_net()
    value, pb = ft.value_with_pullback(lambda n: n(X), at=net)
    cot = pb(jnp.ones_like(value))
    assert isinstance(cot, Net) and cot.steps is None
    np.testing.assert_allclose(cot.weight, net_gradients_np(net, X, upstream="sum")["weight"], rtol=1e-6)


def test_value_with_differential_matches_jvp():
    x = jnp.array([0.3, -1.2, 2.0])
    t = jnp.array([1.0, 0.5, -2.0])
    value, df = ft.value_with_differential(jnp.sin, at=x)
    expected = jax.jvp(jnp.sin, (x,), (t,))
    np.testing.assert_allclose(value, expected[0])
    np.testing.assert_allclose(df(t), expected[1], rtol=1e-6)
    np.testing.assert_allclose(ft.differential(jnp.sin, at=x)(t), expected[1], rtol=1e-6)


def test_differential_with_respect_to_several_arguments_takes_a_tuple():
    def g(a: jax.Array, b: jax.Array) -> jax.Array:
        return a * jnp.exp(b)

    a, b = jnp.array([1.0, 2.0]), jnp.array([0.0, 1.0])
    df = ft.differential(g, wrt=(0, 1))(a, b)
    ta, tb = jnp.ones(2), jnp.array([1.0, 0.0])
    expected = jax.jvp(g, (a, b), (ta, tb))[1]
    np.testing.assert_allclose(df((ta, tb)), expected, rtol=1e-6)
    with pytest.raises(TypeError, match=r"takes a tuple of 2 tangents \(wrt=\(0, 1\)\)") as e:
        df(ta)
    assert "df((tx, ty))" in str(e.value)


def test_differential_of_a_module_takes_a_parameter_view_tangent():
    net = make_net()
    tangent = ft.tangent_scale(ft.zero_tangent_vector(net), 0.0)
    tangent = ft.set(tangent, ".weight", jnp.ones((2, 1)))
    _, df = ft.value_with_differential(loss, at=net)
    grads = ft.gradient(loss, at=net)
    np.testing.assert_allclose(df(tangent), grads.weight.sum(), rtol=1e-5, atol=1e-6)


def test_a_bare_complex_number_is_a_point_as_a_bare_float_is():
    """at=1 + 1j was refused as non-differentiable, its fix a cast to float32 (the imaginary
    part dropped); it is a point as at=2.0 is, with jax.grad's numbers. A complex number in a
    tree stays static data, its fix jnp.asarray."""
    def f(z):
        return jnp.abs(z) ** 2

    assert complex(ft.gradient(f, at=1 + 1j)) == complex(jax.grad(f)(1 + 1j))
    y, df = ft.value_with_differential(lambda z: z * z, at=1 + 1j)
    assert complex(y) == 2j and complex(df(1.0 + 0j)) == complex(jax.jvp(lambda z: z * z, (1 + 1j,), (1.0 + 0j,))[1])
    with pytest.raises(TypeError, match=re.escape("right:  pass the number as an array: jnp.asarray((1+1j))")):
        ft.gradient(lambda d: f(d["z"]), at={"z": 1 + 1j})


def test_scalar_derivative():
    np.testing.assert_allclose(ft.derivative(lambda x: x**3, at=2.0), 12.0)
    curve = ft.derivative(lambda t: jnp.array([jnp.cos(t), jnp.sin(t)]))
    np.testing.assert_allclose(curve(0.0), [0.0, 1.0], atol=1e-7)
    with pytest.raises(TypeError, match=r"scalar floating argument, got shape \(2,\)") as e:
        ft.derivative(jnp.sin, at=jnp.ones(2))
    assert 'right:  ft.jacobian(f, at=jnp.ones(3), mode="forward")' in str(e.value)
    with pytest.raises(TypeError, match="dtype int32"):
        ft.derivative(lambda n: n * 2.0, at=jnp.asarray(3))


# ------------------------------------------------------------------ jacobians, hessians


def some_function(x: jax.Array) -> jax.Array:
    return jnp.stack([x[0] * x[1], jnp.sin(x[0]), x[1] ** 3, x[0] + 2 * x[1]])


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_jacobian_both_modes_match_jax(mode):
    x = jnp.array([1.0, 2.0])
    x0, x1 = 1.0, 2.0
    expected = np.array([[x1, x0], [np.cos(x0), 0.0], [0.0, 3 * x1**2], [1.0, 2.0]])  # d some_function / dx
    np.testing.assert_allclose(ft.jacobian(some_function, at=x, mode=mode), expected, rtol=1e-5, atol=1e-6)
    net = make_net()
    # (jitted: the subject is the Jacobian's structure; one program instead of dozens eager)
    jac = jax.jit(lambda m: ft.jacobian(lambda n: n(X)[:, 0], at=m, mode=mode))(net)
    assert isinstance(jac, Net) and jac.weight.shape == (3, 2, 1) and jac.steps is None


def test_jacobian_mode_must_be_reverse_or_forward():
    with pytest.raises(ValueError, match="mode is 'reverse' or 'forward', got 'sideways'") as e:
        ft.jacobian(f, mode="sideways")
    assert 'mode="forward"' in str(e.value)


def test_hessian_matches_jax_and_finite_differences():
    x = jnp.array([0.3, -1.2, 2.0])
    np.testing.assert_allclose(ft.hessian(f, at=x), hessian_f_np(x), rtol=1e-5, atol=1e-6)
    with jax.enable_x64(True):
        x64 = np.array([0.3, -1.2, 2.0])
        grad = jax.jit(jax.grad(f))
        eps = 1e-6
        # fd[i, j] = (∂f/∂x_i at x + eps·e_j − at x − eps·e_j) / 2eps: central differences of the
        # float64 gradient, one jitted program for all (i, j).
        fd = np.stack(
            [(np.asarray(grad(x64 + eps * e)) - np.asarray(grad(x64 - eps * e))) / (2 * eps) for e in np.eye(3)],
            axis=1,
        )
        np.testing.assert_allclose(jax.jit(ft.hessian(f))(jnp.asarray(x64)), fd, rtol=1e-6)  # one program
    with pytest.raises(TypeError, match=r"ft\.hessian needs a scalar result"):
        ft.hessian(jnp.sin, at=x)


def test_operators_compose_with_jit_and_check_grads():
    x = jnp.array([0.3, -1.2, 2.0])
    jitted = jax.jit(ft.gradient(f))
    np.testing.assert_allclose(jitted(x), jax.grad(f)(x), rtol=1e-5, atol=1e-6)
    # The gradient function is itself differentiable (second order by finite differences).
    check_grads(ft.gradient(f), (x,), order=1, modes=("rev", "fwd"))


# ------------------------------------------------------------------ errors that say what to do


def test_gradient_of_a_non_scalar_result_is_an_error_with_the_fix():
    with pytest.raises(TypeError) as info:
        ft.gradient(jnp.sin, at=jnp.ones(3))
    message = str(info.value)
    assert "ft.gradient needs a scalar result" in message and "shape (3,)" in message
    assert "ft.gradient(lambda x: f(x).sum(), at=x)" in message
    assert "ft.value_with_pullback" in message and "ft.jacobian" in message
    with pytest.raises(TypeError, match=r"ft\.value_with_gradient needs a scalar result"):
        ft.value_with_gradient(jnp.sin, at=jnp.ones(3))


@pytest.mark.parametrize("point", [3, jnp.arange(3), jnp.array([True, False])])
def test_differentiating_with_respect_to_integers_or_bools_is_an_error(point):
    with pytest.raises(TypeError) as info:
        ft.gradient(lambda x: jnp.sum(x).astype(jnp.float32), at=point)
    message = str(info.value)
    assert "Cannot differentiate with respect to argument 0" in message
    assert "x.astype(jnp.float32)" in message


def _right_code(message):
    """The code of an error message's ``right:`` line, as the user would paste it."""
    return next(line for line in message.splitlines() if "right:" in line).split("right:", 1)[1].strip()


def test_integer_argument_alone_is_not_swapped_for_another_argument():
    # d/dn asked: the derivative with respect to x answers another question
    with pytest.raises(TypeError, match=r"argument 1 .*\n(.|\n)*right:  pass the value as float") as info:
        ft.gradient(lambda x, n: x * n, wrt=1)(2.0, 3)
    assert "wrt=0" not in str(info.value)


@pytest.mark.parametrize(("wrt", "suggested"), [((0, 1), "wrt=0"), ((0, 1, 2), "wrt=(0, 2)"), ((1, -1), "wrt=2")])
def test_integer_argument_error_suggests_the_requested_wrt_without_it(wrt, suggested):
    x, n, b = jnp.array([1.0, 2.0, 3.0]), jnp.arange(3), jnp.array([4.0, 5.0, 6.0])

    def f(a, n, b):
        return (a * a * n.astype(jnp.float32) + b * a).sum()

    with pytest.raises(TypeError) as info:
        ft.gradient(f, wrt=wrt)(x, n, b)
    right = _right_code(str(info.value))
    assert right.startswith(f"ft.gradient(f, {suggested})")
    got = eval(right.split("#")[0])(x, n, b)  # the message's right: line, pasted
    kept = [i for i in (i % 3 for i in wrt) if i != 1]
    expected = jax.grad(f, argnums=tuple(kept))(x, n, b)
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-6)


def test_module_without_parameters_is_an_error():
    class Frozen(ft.Module):
        table: jax.Array = ft.field(no_derivative=True)

    with pytest.raises(TypeError, match="Frozen has no parameters"):
        ft.gradient(lambda m: m.table.sum(), at=Frozen(jnp.ones(2)))


def test_wrt_pattern_selecting_a_no_derivative_field_is_an_error_naming_it():
    with pytest.raises(ValueError) as info:
        ft.gradient(loss, wrt="encoder.running_mean")(make_net())
    message = str(info.value)
    assert "selects encoder.running_mean, which is not a parameter (a no_derivative field)" in message
    assert 'ft.gradient(f, wrt="encoder.scale")' in message
    with pytest.raises(ValueError, match=r"selects steps, which is not a parameter \(dtype int32\)"):
        ft.gradient(loss, wrt="steps")(make_net())


def test_wrt_pattern_selecting_nothing_is_an_error_listing_names():
    with pytest.raises(ValueError) as info:
        ft.gradient(loss, wrt=["weight", "decoder.*"])(make_net())
    message = str(info.value)
    assert "wrt='decoder.*' selects no parameter" in message
    assert "'encoder.scale'" in message


def test_point_that_is_not_a_pytree_of_arrays_is_an_error():
    with pytest.raises(TypeError) as info:
        ft.gradient(lambda d: d["x"] * 2.0, at={"x": 1.0, "name": "hello"})
    message = str(info.value)
    assert "the value at ['name'] is a str" in message
    assert "ft.field(static=True)" in message


def test_negative_wrt_indices_count_from_the_end_and_a_repeated_argument_is_refused():
    def g(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
        return jnp.sum(a**2 * b + jnp.sin(c) * a)

    args = (jnp.array([1.0, -2.0]), jnp.array([3.0, 0.5]), jnp.array([0.3, 1.1]))
    expected = jax.grad(g, argnums=(2, 0))(*args)
    for got, want in zip(ft.gradient(g, wrt=(-1, 0))(*args), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want))))
    # The same argument twice gave the first copy a silent zero: [0, 0] and [6, 16].
    for wrt in [(0, 0), (0, -3), (-1, 1, 2)]:
        with pytest.raises(ValueError, match=rf"wrt={re.escape(repr(wrt))} names argument (0|2) twice"):
            ft.gradient(g, wrt=wrt)(*args)
    with pytest.raises(ValueError, match=r"(.|\n)*right:  ft.differential\(f, wrt=\(0,\)\)"):
        ft.differential(g, wrt=(0, -3))(*args)
    with pytest.raises(ValueError, match=r"names argument 1 twice"):
        ft.jacobian(g, wrt=(1, -2))(*args)


def test_bad_wrt_values():
    with pytest.raises(TypeError, match="wrt must be an argument index"):
        ft.gradient(f, wrt=1.5)(jnp.ones(2))
    with pytest.raises(TypeError, match="wrt must be an argument index"):
        ft.gradient(f, wrt=True)(jnp.ones(2))
    with pytest.raises(IndexError, match=r"wrt=2 names argument 2, but f was called with 1 arg") as e:
        ft.gradient(f, wrt=2)(jnp.ones(2))
    assert "right:  ft.gradient(f, wrt=0)(x, y)" in str(e.value)


def test_wrt_naming_an_argument_passed_by_keyword_says_keywords_are_not_differentiated():
    def loss(w, bias):
        return jnp.sum(w * bias)

    for wrt, right in ((1, "wrt=1"), ((0, 1), "wrt=(0, 1)"), ("bias", "wrt=1")):
        with pytest.raises((IndexError, ValueError)) as e:
            ft.gradient(loss, wrt=wrt)(jnp.ones(2), bias=jnp.ones(2))
        text = str(e.value)
        assert "loss gets bias as keyword argument(s), and keyword arguments are never differentiated" in text
        assert f"wrong:  ft.gradient(f, wrt={wrt!r})(x, bias=y)" in text and f"right:  ft.gradient(f, {right})(x, y)" in text
        assert "indices count from 0" not in text  # not an off-by-one
    assert "keyword arguments are never" in _plan.KEYWORDS_NOT_DIFFERENTIATED


@needs_float16_conversions  # the trees hold float16 arrays
@settings(max_examples=examples(30), deadline=None)
@given(nested_trees())
def test_gradient_of_random_trees_has_the_parameter_view_structure(tree: Any):
    def total(t: Any) -> jax.Array:
        leaves = jax.tree.leaves(ft.parameters(t))
        return sum((jnp.sin(jnp.asarray(x, jnp.float32)) ** 2).sum() for x in leaves) + jnp.zeros(())

    params = ft.parameters(tree)
    if not jax.tree.leaves(params):
        with pytest.raises(TypeError, match="Cannot differentiate with respect to argument 0"):
            ft.gradient(total, at=tree)
        return
    grads = ft.gradient(total, at=tree)
    assert jax.tree.structure(grads, is_leaf=lambda x: x is None) == jax.tree.structure(
        params, is_leaf=lambda x: x is None
    )
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert jnp.result_type(g) == jnp.result_type(p)
        # d/dx sin(x)² = sin(2x), at x rounded to its dtype (float64 NumPy: no program).
        expected = np.sin(2 * np.asarray(p, np.float64))
        np.testing.assert_allclose(np.asarray(g, np.float32), expected, rtol=1e-2, atol=1e-2)


# -- issue 22: tangents and cotangents have the parameter view's structure


class Body(ft.Module):
    position: jax.Array
    mass: jax.Array = ft.field(no_derivative=True)
    steps: jax.Array = ft.field(default_factory=lambda: jnp.zeros((), jnp.int32))


def test_differential_names_a_tangent_value_at_a_non_parameter_and_the_fix():
    body = Body(jnp.ones(2), jnp.asarray(2.0))
    df = ft.differential(lambda b: b.mass * (b.position**2).sum(), at=body)
    np.testing.assert_allclose(df(Body(jnp.ones(2), None, None)), 8.0)
    np.testing.assert_allclose(df(jax.tree.map(jnp.ones_like, ft.zero_tangent_vector(body))), 8.0)
    with pytest.raises(ValueError) as info:
        df(Body(jnp.ones(2), jnp.asarray(1.0), None))
    message = str(info.value)
    assert "ft.differential: the tangent has a value at .mass, which is a no_derivative field" in message
    assert "ft.zero_tangent_vector(model)" in message
    with pytest.raises(ValueError, match=r"value at \.steps, which is not floating \(int32\)"):
        df(Body(jnp.ones(2), None, jnp.ones((), jnp.int32)))
    with pytest.raises(ValueError, match=r"ft.differential: the trees differ first at \.position"):
        df(Body({"a": jnp.ones(2)}, None, None))  # type: ignore[arg-type]


def test_differential_takes_none_at_a_parameter_as_its_zero():
    # None at a parameter is its zero, as in a cotangent and ft.move; it was JAX's
    # "expected PyTreeDef(...), got PyTreeDef(...)" from inside the linearized function.
    body = Body(jnp.array([1.0, 2.0]), jnp.asarray(3.0))
    df = ft.differential(lambda b, x: b.mass * jnp.sum(b.position**2) * x, wrt=(0, 1))(body, jnp.asarray(0.5))
    np.testing.assert_allclose(df((Body(None, None, None), jnp.asarray(2.0))), 3.0 * 5.0 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(df((Body(jnp.array([1.0, 0.0]), None, None), None)), 3.0 * 2.0 * 0.5, rtol=1e-6)


def test_differential_names_a_tangent_value_at_a_parameter_outside_wrt():
    net = make_net()
    df = ft.differential(lambda n: n(X).sum(), at=net, wrt="weight")
    tangent = jax.tree.map(jnp.ones_like, ft.zero_tangent_vector(net))
    with pytest.raises(ValueError, match=r"\.encoder\.scale, a parameter outside wrt=") as info:
        df(tangent)
    # The fix the message shows (ft.zero_tangent_vector's own values were refused the same way).
    right = _right_code(str(info.value))
    assert right.startswith("df(jax.tree.map(lambda t, keep: None if keep is False else jnp.where(") and right.endswith(
        ", t, 0), tangent, ft.select(model, 'weight')))")
    fixed = eval(right.removeprefix("df"), {"jax": jax, "jnp": jnp, "ft": ft, "tangent": tangent, "model": net})
    weight_only = Net(BatchNorm(None, None), tangent.weight, None, None)  # type: ignore[arg-type]
    assert jax.tree.structure(fixed) == jax.tree.structure(weight_only)
    expected = ft.gradient(lambda n: n(X).sum(), at=net).weight.sum()
    np.testing.assert_allclose(df(weight_only), expected, rtol=1e-6)
    np.testing.assert_allclose(df(fixed), expected, rtol=1e-6)


def test_differential_names_a_tangent_value_at_a_stacked_member_outside_wrt():
    """wrt="h.[12].*" keeps the stacked leaf whole in the view: a tangent's values at members
    0 and 3 were dropped without a word (J t of the selected members only)."""
    h = ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, key=k), 4, key=jax.random.key(0))
    model = {"h": h}
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)

    @jax.jit  # one program each for the differential and the reference (not op by op)
    def loss(m):
        return (m["h"](x) ** 2).sum()

    df = ft.differential(loss, at=model, wrt="h.[12].*")
    ones = jax.tree.map(jnp.ones_like, ft.zero_tangent_vector(model))
    with pytest.raises(ValueError) as info:
        df(ones)
    message = str(info.value)
    assert message.startswith("ft.differential: the tangent at ['h'].layers.weight has values at member(s) [0, 3] "
                              "of a stacked leaf, which wrt=('h.[12].*',) leaves out (it selects member(s) [1, 2]")
    fixed = eval(_right_code(message).removeprefix("df"), {"jax": jax, "jnp": jnp, "ft": ft, "tangent": ones, "model": model})
    selected = jax.tree.map(lambda t: jnp.where((jnp.arange(4) % 3 != 0).reshape((4,) + (1,) * (t.ndim - 1)), t, 0.0), ones)
    expected = jax.jvp(loss, (model,), (jax.tree.map(jnp.zeros_like, model) | {"h": selected["h"]},))[1]
    np.testing.assert_allclose(df(selected), expected, rtol=1e-6)
    np.testing.assert_allclose(df(fixed), expected, rtol=1e-6)  # the message's fix, every leaf at once


def test_pullback_of_a_module_result_takes_its_parameter_view():
    def f(x: jax.Array) -> Body:
        return Body(2.0 * x, mass=x.sum())  # mass depends on x, but is no_derivative

    x = jnp.ones(2)
    value, pb = ft.value_with_pullback(f, at=x)
    # The cotangent at the no_derivative mass is not taken: the derivative is 2, not 3.
    np.testing.assert_allclose(pb(Body(jnp.ones(2), None, None)), [2.0, 2.0])
    np.testing.assert_allclose(pb(jax.tree.map(jnp.ones_like, ft.parameters(value))), [2.0, 2.0])
    float0 = np.zeros((), jax.dtypes.float0)
    np.testing.assert_allclose(pb(Body(jnp.ones(2), None, float0)), [2.0, 2.0])  # JAX's form
    with pytest.raises(ValueError) as info:
        pb(Body(jnp.ones(2), jnp.asarray(1.0), None))
    message = str(info.value)
    assert "ft.value_with_pullback: the tangent has a value at .mass" in message
    assert "ft.parameters(y)" in message


@pytest.mark.parametrize("cotangent, path, expected, given", [
    ((1.0,), "<root>", "a tuple of 2 item(s)", "a tuple of 1 item(s)"),
    ([1.0, 1.0], "<root>", "a tuple of 2 item(s)", "a list of 2 item(s)"),
    ((1.0, {"a": [1.0], "b": 1.0}), "[1]['a']", "a list of 2 item(s)", "a list of 1 item(s)"),
    ((1.0, {"a": [1.0, 1.0], "c": 1.0}), "[1]", "a dict with keys ['a', 'b']", "a dict with keys ['a', 'c']"),
    ((1.0, None), "[1]", "a dict with keys ['a', 'b']", "None"),
])
def test_a_cotangent_of_another_structure_is_an_error_naming_the_key_path(cotangent, path, expected, given):
    """JAX's error named a position in functree's wrapper (``g at _plan.py``), not the key path."""
    pb = ft.pullback(lambda x: (x, {"a": [x, 2.0 * x], "b": 3.0 * x}), at=jnp.ones(()))
    np.testing.assert_allclose(pb((1.0, {"a": [None, 1.0], "b": 1.0})), 6.0)
    with pytest.raises(ValueError) as info:
        pb(cotangent)
    message = str(info.value)
    assert message.startswith(f"ft.pullback: the cotangent's structure is not the result's: they "
                              f"differ first at {path}, where the result has {expected} and the cotangent {given}.")
    assert _right_code(message).startswith("pb(jax.tree.map(jnp.ones_like, ft.parameters(y)))")


def test_a_loss_with_aux_without_has_aux_names_the_fix():
    # (loss, aux) reached JAX's array conversion: TracerArrayConversionError, no hint.
    for op, name in ((ft.gradient, "ft.gradient"), (ft.value_with_gradient, "ft.value_with_gradient")):
        with pytest.raises(TypeError, match=rf"(?s){name} needs a scalar result, but \S*<lambda> returned a tuple.*has_aux=True"):
            op(lambda w: (jnp.sum(w**2), w), at=jnp.ones(2))
    with pytest.raises(TypeError, match=r"returned a dict"):
        ft.gradient(lambda w: {"loss": jnp.sum(w)}, at=jnp.ones(2))


def test_tangents_of_a_module_result_are_its_parameter_view():
    """A differential (and a Jacobian) of a Module-valued function gave values at its
    no_derivative field and a float0 at an integer leaf, which ft.move then refused."""
    class S(ft.Module):
        w: jax.Array
        n: jax.Array = ft.field(no_derivative=True, default=None)
        steps: jax.Array = ft.field(default=None)

    def f(x):
        return S(w=jnp.sin(x), n=10.0 * x, steps=jnp.ones((), jnp.int32))

    x = jnp.array([0.5, 2.0])
    y, df = ft.value_with_differential(f, at=x)
    dy = df(jnp.array([1.0, 0.0]))
    assert dy.n is None and dy.steps is None
    np.testing.assert_allclose(dy.w, [np.cos(0.5), 0.0], rtol=0, atol=1e-7)
    assert float(ft.move(y, along=dy).w[0]) == pytest.approx(np.sin(0.5) + np.cos(0.5), abs=1e-6)
    jac = ft.jacobian(f, at=x, mode="forward")
    assert jac.n is None and jac.steps is None
    np.testing.assert_allclose(jac.w, np.diag(np.cos([0.5, 2.0])), rtol=0, atol=1e-6)
    jac = ft.jacobian(lambda x: S(w=jnp.sin(x), n=10.0 * x), at=x)  # (jacrev takes no integer result)
    assert jac.n is None
    np.testing.assert_allclose(jac.w, np.diag(np.cos([0.5, 2.0])), rtol=0, atol=1e-6)


def test_a_forward_jacobian_of_a_bool_result_is_none_there():
    # jax.jacfwd's float0 column of a bool leaf crashed inside JAX ("a bytes-like object
    # is required, not 'int'"); the reverse Jacobian gave None there already.
    x = jnp.array([0.5, -2.0])
    for mode in ("forward", "reverse"):
        jac, positive, top = ft.jacobian(lambda x: (jnp.sin(x), x > 0, jnp.argmax(x)), at=x, mode=mode)
        assert positive is None and top is None
        np.testing.assert_allclose(jac, np.diag(np.cos([0.5, -2.0])), rtol=0, atol=1e-6)


def test_a_float_cotangent_at_an_integer_result_leaf_is_refused_after_a_float0_one():
    # The tangent check is cached per tree structure, which a float0 leaf and a float one
    # share: after a float0 there, a float value at the integer leaf passed unchecked.
    pb = ft.pullback(lambda x: (jnp.sin(x), jnp.argmax(x)), at=jnp.array([0.5, -2.0]))
    np.testing.assert_allclose(pb((jnp.ones(2), np.zeros((), jax.dtypes.float0))), np.cos([0.5, -2.0]), atol=1e-6)
    with pytest.raises(ValueError, match=r"the tangent has a value at \[1\], which is not floating \(int\d+\)"):
        pb((jnp.ones(2), jnp.ones(())))


def test_a_key_path_as_wrt_names_its_text():
    model = ft.nn.Sequential([ft.nn.Dense(2, 3, key=jax.random.key(0))])
    path = ft.KeyPath.parse(".layers[0].bias")
    with pytest.raises(TypeError, match=r"a pattern by its dotted name: path.name, here 'layers.0.bias'"):
        ft.gradient(lambda m: m(jnp.ones((1, 2))).sum(), at=model, wrt=path)
    grads = ft.gradient(lambda m: m(jnp.ones((1, 2))).sum(), at=model, wrt=path.name)
    assert grads.layers[0].weight is None and grads.layers[0].bias is not None


# -- results holding None and integer leaves, complex and holomorphic functions, dtypes


def test_a_pullback_keeps_none_where_the_result_holds_none_beside_an_integer_leaf() -> None:
    x = jnp.array([0.3, -1.0])
    y, pb = ft.value_with_pullback(lambda x: {"y": jnp.sin(x), "cache": None, "step": jnp.array(1)}, at=x)
    expected = jax.vjp(jnp.sin, x)[1](jnp.ones(2))[0]
    np.testing.assert_allclose(pb(jax.tree.map(jnp.ones_like, ft.parameters(y))), expected, rtol=0, atol=1e-7)
    np.testing.assert_allclose(pb({"y": jnp.ones(2), "cache": None, "step": None}), expected, rtol=0, atol=1e-7)


class _Counted(ft.Module):
    w: jax.Array
    count: jax.Array
    bias: jax.Array
    nd: jax.Array = ft.field(no_derivative=True)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_the_jacobian_of_a_result_with_an_integer_leaf_has_none_there(mode: str) -> None:
    x = jnp.array([0.3, -1.0])
    J = ft.jacobian(lambda x: _Counted(jnp.sin(x) * 2, jnp.array(3), jnp.zeros(1), x ** 2), at=x, mode=mode)
    assert J.count is None and J.nd is None
    np.testing.assert_allclose(J.w, jax.jacrev(lambda x: jnp.sin(x) * 2)(x), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(J.bias, np.zeros((1, 2), np.float32))


_Z = jnp.array([0.3 - 0.1j, 1.0 + 2.0j], jnp.complex64)


def test_holomorphic_gradient_and_jacobian_equal_jax() -> None:
    h = lambda q: jnp.sum(q ** 2)  # noqa: E731
    expected = jax.grad(h, holomorphic=True)(_Z)
    np.testing.assert_allclose(ft.gradient(h, at=_Z, holomorphic=True), expected, rtol=0, atol=1e-6)
    value, grad = ft.value_with_gradient(h, at=_Z, holomorphic=True)
    np.testing.assert_allclose(value, h(_Z), rtol=0, atol=1e-6)
    np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(grad, 2 * _Z, rtol=0, atol=1e-6)  # f'(z) = 2z
    square = lambda q: q ** 2  # noqa: E731
    for mode, jax_jacobian in [("reverse", jax.jacrev), ("forward", jax.jacfwd)]:
        np.testing.assert_allclose(ft.jacobian(square, at=_Z, mode=mode, holomorphic=True),
                                   jax_jacobian(square, holomorphic=True)(_Z), rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="pass holomorphic=True"):  # the advice JAX gives now exists
        ft.gradient(h, at=_Z)


def test_the_hessian_at_complex_parameters_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"ft.hessian: .* complex parameter \(argument 0, complex64\)(.|\n)*"
                                        r"z.real, z.imag"):
        ft.hessian(lambda q: jnp.sum(jnp.abs(q) ** 2), at=_Z)
    # The fix it shows: real and imaginary parts as real arrays; |z|² has Hessian 2·I in each.
    # (jitted: the subject is the value the fix gives; one program instead of dozens eager)
    fix = ft.hessian(lambda re, im: jnp.sum(jnp.abs(jax.lax.complex(re, im)) ** 2), wrt=(0, 1))
    H = jax.jit(fix)(jnp.asarray(np.real(_Z)), jnp.asarray(np.imag(_Z)))
    np.testing.assert_allclose(H[0][0], 2 * np.eye(2), rtol=0, atol=1e-6)
    np.testing.assert_allclose(H[0][1], np.zeros((2, 2)), rtol=0, atol=1e-6)


def _reverse_only() -> Any:
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    @ft.derivative(of=f)
    def rule(x: jax.Array) -> Any:
        return jnp.sin(x), lambda v: v * jnp.cos(x)

    return rule


def test_forward_mode_of_a_reverse_only_rule_under_jit_keeps_functree_explanation() -> None:
    f = _reverse_only()
    x = jnp.array([0.3, 1.0])
    for op, run in [("differential", lambda x: ft.differential(f, at=x)(jnp.ones(2))),
                    ("value_with_differential", lambda x: ft.value_with_differential(f, at=x)[0]),
                    ("jacobian", lambda x: ft.jacobian(f, at=x, mode="forward"))]:
        with pytest.raises(TypeError, match=rf"ft.{op}: .* reverse-mode only(.|\n)*mode=\"forward\""):
            jax.jit(run)(x)
    with pytest.raises(TypeError, match=r"ft.derivative: .* reverse-mode only"):
        jax.jit(lambda s: ft.derivative(f, at=s))(0.3)
    # Reverse mode under jit is untouched.
    np.testing.assert_allclose(jax.jit(ft.gradient(lambda x: f(x).sum()))(x), jnp.cos(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=needs_float16_conversions), "float32"])
def test_a_python_number_tangent_is_cast_to_the_parameter_dtype(dtype: str) -> None:
    p = jnp.asarray(2.0, dtype)
    got = ft.differential(lambda q: q ** 3, at=p)(1.0)
    expected = jax.jvp(lambda q: q ** 3, (p,), (jnp.asarray(1.0, dtype),))[1]
    assert got.dtype == p.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    _, pb = ft.value_with_pullback(lambda q: q ** 3, at=p)
    np.testing.assert_array_equal(np.asarray(pb(1.0), np.float32), np.asarray(expected, np.float32))


def test_a_tangent_or_cotangent_of_another_dtype_is_refused_naming_the_key_path() -> None:
    r = jnp.array([1.0, 2.0])
    with pytest.raises(ValueError, match=r"ft.differential: the tangent at \['w'\] has dtype bfloat16; the "
                                         r"parameter there has dtype float32(.|\n)*astype\(jnp.float32\)"):
        ft.differential(lambda m: jnp.sum(m["w"] ** 2), at={"w": r})({"w": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"the tangent at \[1\] has dtype float32; the parameter there has "
                                         r"dtype bfloat16"):
        ft.differential(lambda a, b: jnp.sum(a ** 2) + jnp.sum(b.astype(jnp.float32)), wrt=(0, 1))(
            r, r.astype(jnp.bfloat16))((jnp.ones(2), jnp.ones(2)))
    with pytest.raises(ValueError, match=r"the tangent at <root> has dtype float32; the parameter there has "
                                         r"dtype complex64"):
        ft.differential(lambda q: jnp.sum(jnp.abs(q) ** 2), at=_Z)(jnp.ones(2))
    with pytest.raises(ValueError, match=r"ft.pullback: the cotangent at <root> has dtype float16; the result "
                                         r"there has dtype float32"):
        ft.pullback(lambda q: q ** 2, at=r)(jnp.ones(2, jnp.float16))


def test_the_hessian_of_a_rule_calling_its_reverse_only_function_explains_the_fix() -> None:
    # ft.hessian gave JAX's bare "can't apply forward-mode autodiff (jvp) to a custom_vjp
    # function", eager and jitted, for the documented rule `return cube(x), lambda v: ...`.
    @ft.differentiable
    def cube(x: Any) -> Any:
        return x * x * x

    @ft.derivative(of=cube)
    def _d_cube(x: Any) -> Any:
        return cube(x), lambda v: 3.0 * x * x * v

    for run in (lambda x: ft.hessian(cube, at=x), jax.jit(ft.hessian(cube))):
        with pytest.raises(TypeError, match=r"ft.hessian: .*cube calls .* reverse-mode only(.|\n)*"
                                            r"right:  return x \* x \* x(.|\n)*mode=\"forward\""):
            run(2.0)

    # The fix it shows: the value computed directly. d²(x³)/dx² = 6x = 12 at 2.
    @ft.derivative(of=cube)
    def _d_cube_direct(x: Any) -> Any:
        return x * x * x, lambda v: 3.0 * x * x * v

    np.testing.assert_allclose(ft.hessian(cube, at=2.0), 12.0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(jax.jit(ft.hessian(cube))(2.0), 12.0, rtol=0, atol=1e-5)


def test_the_hessian_through_a_reverse_only_rule_is_computed_not_refused() -> None:
    # Forward mode meets only the rule's code: JAX's Hessian works, eager and jitted.
    # Σ w³·sin(d) + Σ sin(w) has Hessian diag(6 w sin d − sin w).
    f = _reverse_only()
    w, d = np.array([0.5, -1.5]), np.array([0.3, 1.0])
    expected = np.diag(6 * w * np.sin(d) - np.sin(w))
    loss = lambda w, d: jnp.sum(w ** 3 * f(d)) + jnp.sum(f(w))  # noqa: E731
    # float32 products of values below 10: measured spread 5e-7.
    for hessian in (ft.hessian(loss), jax.jit(ft.hessian(loss))):
        np.testing.assert_allclose(hessian(jnp.asarray(w), jnp.asarray(d)), expected, rtol=0, atol=5e-6)
