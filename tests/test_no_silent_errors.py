"""The catalogue of edges that once gave a silently wrong answer (issue 22, items 1-3 and
10: differentiation). One test per edge, named after the issue's item, its docstring
quoting the wrong number measured on main; each asserts the right number now, or an
error naming the argument or key path and the fix. New edges join here (optimization's
are in ``test_no_silent_errors_optim.py``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from test_derivative import make_square_with_both_rules

import functree as ft


def test_item01_a_custom_derivative_wrt_a_subset_refuses_the_uncovered_argument():
    """Main: ``@ft.derivative(of=f, wrt=0)`` then ``ft.gradient(f, wrt=1)`` gave 0.0 for
    ``f(x, scale) = scale * ||x||`` (true value 5.0), in reverse and forward mode, and
    ``ft.diagnose`` reported nothing."""

    def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
        return scale * jnp.linalg.norm(x)

    @ft.derivative(of=norm, wrt=0)
    def reverse(x: jax.Array, scale: jax.Array) -> Any:
        n = jnp.linalg.norm(x)
        return scale * n, lambda v: v * scale * x / n

    forward = ft.differentiable(lambda x, scale: scale * jnp.linalg.norm(x))

    @ft.derivative(of=forward, wrt=0, mode="forward")
    def _(x: jax.Array, scale: jax.Array) -> Any:
        n = jnp.linalg.norm(x)
        return scale * n, lambda t: scale * jnp.dot(x, t) / n

    x = jnp.array([3.0, 4.0])
    for call in (
        lambda: ft.gradient(reverse, wrt=1)(x, 2.0),
        lambda: ft.gradient(forward, wrt=1)(x, 2.0),
        lambda: ft.derivative(forward, wrt=1)(x, 2.0),
    ):
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert "argument 1 (`scale`)" in message
        assert "wrt=(0, 1)" in message and "ft.without_derivative(at=scale)" in message
    # What the rule covers is unchanged.
    np.testing.assert_allclose(ft.gradient(reverse)(x, 2.0), [1.2, 1.6], rtol=0, atol=1e-6)
    report = ft.diagnose(reverse, wrt=1)(x, 2.0)
    assert not report.ok and "argument 1 (`scale`)" in report.findings[0].message


def _bessel(order: jax.Array, z: jax.Array) -> jax.Array:
    shape = jax.ShapeDtypeStruct(jnp.shape(z), jnp.float32)
    return jax.pure_callback(
        lambda v, z: scipy.special.jv(v, z).astype(np.float32), shape, order, z
    )


def test_item01_a_callback_registered_wrt_z_refuses_the_derivative_in_the_order():
    """Main: scipy's Bessel J_v(z) through ``jax.pure_callback``, registered ``wrt=1``
    (z), gave 0.0 as its derivative in the order v, where bare JAX raises."""

    @ft.derivative(of=_bessel, wrt=1)
    def bessel(order: jax.Array, z: jax.Array) -> Any:
        y = _bessel(order, z)
        return y, lambda v: v * (_bessel(order - 1.0, z) - _bessel(order + 1.0, z)) / 2.0

    # d/dz J_1(2) = (J_0(2) - J_2(2)) / 2, from scipy.
    expected = (scipy.special.jv(0, 2.0) - scipy.special.jv(2, 2.0)) / 2.0
    np.testing.assert_allclose(ft.gradient(bessel, wrt=1)(1.0, 2.0), expected, rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match=r"argument 0 \(`order`\)(.|\n)*wrt=\(0, 1\)"):
        ft.gradient(bessel, wrt=0)(1.0, 2.0)


def test_item02_forward_operators_use_the_forward_rule_when_both_are_registered():
    """Main: with ``@ft.derivative(of=f)`` and ``@ft.derivative(of=f, mode="forward")``,
    ``ft.differential`` and ``ft.jacobian(mode="forward")`` raised "reverse-mode only ...
    register mode=forward". The two rules here differ on purpose (10 forward, 100
    reverse), so each mode shows which one it used."""
    square = make_square_with_both_rules()
    x = jnp.ones(2)
    np.testing.assert_allclose(ft.differential(square, at=x)(x), [10.0, 10.0])
    np.testing.assert_allclose(ft.jacobian(square, at=x, mode="forward"), 10.0 * np.eye(2))
    np.testing.assert_allclose(ft.derivative(square, at=2.0), 10.0)
    np.testing.assert_allclose(ft.gradient(lambda x: square(x).sum(), at=x), [100.0, 100.0])
    np.testing.assert_allclose(ft.jacobian(square, at=x), 100.0 * np.eye(2))


class Body(ft.Module):
    position: jax.Array
    mass: jax.Array = ft.field(no_derivative=True)


def _energy(body: Body) -> jax.Array:
    return 0.5 * body.mass * (body.position**2).sum()  # ∂/∂mass = 1 at position (1, 1)


def test_item03_move_refuses_a_tangent_with_a_value_at_a_no_derivative_field():
    """Main: ``ft.move(body, along=-0.2 * jax.grad(energy)(body))`` changed the
    ``no_derivative`` mass 1.0 → 0.8, while ``ft.tangent_add`` on the same trees refused."""
    body = Body(jnp.ones(2), jnp.asarray(1.0))
    full = jax.tree.map(lambda g: -0.2 * g, jax.grad(_energy)(body))  # a value at .mass
    for call in (
        lambda: ft.move(body, along=full),
        lambda: jax.jit(lambda b, t: ft.move(b, along=t))(body, full),
        lambda: ft.optim.Optimizer(ft.optim.sgd(0.1)).apply_updates(body, full),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "ft.move" in message and ".mass" in message and "no_derivative" in message
        assert "ft.gradient(loss, at=model)" in message and "ft.parameters(tangent)" in message
    with pytest.raises(ValueError, match=r"ft.tangent_add: the trees differ first at \.mass"):
        ft.tangent_add(full, ft.zero_tangent_vector(body))
    # The parameter view moves the parameters and only them.
    moved = ft.move(body, along=ft.parameters(full))
    np.testing.assert_allclose(moved.position, [0.8, 0.8], rtol=0, atol=1e-6)
    assert float(moved.mass) == 1.0


def test_item10_differential_names_the_no_derivative_field_of_a_tangent():
    """Main: a tangent with a value at a no-derivative field given to ``ft.differential``
    raised a bare ``PyTreeDef`` mismatch, naming neither the field nor the fix."""
    body = Body(jnp.ones(2), jnp.asarray(1.0))
    df = ft.differential(_energy, at=body)
    with pytest.raises(ValueError) as info:
        df(Body(jnp.ones(2), jnp.asarray(1.0)))
    message = str(info.value)
    assert "ft.differential" in message and ".mass" in message and "no_derivative" in message
    assert "ft.zero_tangent_vector(model)" in message
    np.testing.assert_allclose(df(Body(jnp.ones(2), None)), 2.0, rtol=0, atol=1e-6)
