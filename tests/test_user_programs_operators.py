"""User programs of the core: custom derivatives as a JAX or Swift user writes them, and the
differentiation diagnostics they must get (session 46, "operators").

A custom derivative's rule, not its body, decides which operands its derivative reaches. A
rule that gives an operand no cotangent (``None`` in a ``custom_vjp`` pullback, a tangent
rule that ignores the tangent, ``jnp.zeros_like`` in an ``ft.derivative`` pullback) makes
every parameter that reaches the result only through that operand's gradient identically
zero: JAX returns zeros silently, so functree warns, naming the key path. A rule that
restores a derivative its body cuts (a straight-through ``round``) is not warned about.

``ft.diagnose`` is used where it can be: it traces and analyses, without compiling.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree._operators import CALLBACK_NOT_DIFFERENTIABLE, WHILE_NOT_REVERSE
from tests._errors import raises_named


class Gate(ft.Module):
    w: jax.Array
    v: jax.Array


GATE = Gate(jnp.array([0.3, -1.2]), jnp.array([0.7, 0.1]))  # pyright: ignore[reportCallIssue]
X = jnp.array([1.0, 2.0])


@jax.custom_jvp
def _tangent_dropped(x):
    return x * 2.0


_tangent_dropped.defjvp(lambda p, t: (p[0] * 2.0, jnp.zeros_like(t[0])))  # forgot the tangent


@jax.custom_vjp
def _scaled(x, w):
    return x * w


_scaled.defvjp(lambda x, w: (x * w, (x, w)), lambda r, g: (g * r[1], None))  # forgot w's cotangent


def _scaled_primal(x, w):
    return x * w


def _scaled_rule(x, w):
    return x * w, lambda g: (g * w, jnp.zeros_like(w))  # w's cotangent left at zero


_ft_scaled = ft.derivative(of=_scaled_primal)(_scaled_rule)


@jax.custom_jvp
def _straight_through(x):
    return jnp.round(x)  # a zero derivative in the body ...


_straight_through.defjvp(lambda p, t: (jnp.round(p[0]), t[0]))  # ... restored by the rule


def _correct_rule(x, w):
    return x * w, lambda g: (g * w, g * x)


_ft_correct = ft.derivative(of=_scaled_primal)(_correct_rule)


@jax.custom_vjp
def _pair(a, b):
    return a * 2.0, a * b


# b's cotangent comes from the second output only; a's from both.
_pair.defvjp(lambda a, b: (_pair(a, b), (a, b)), lambda r, g: (2.0 * g[0] + g[1] * r[1], g[1] * r[0]))


def _statuses(report):
    return {leaf.name: leaf.status for leaf in report.activity}


ZERO_RULES = {
    "custom_jvp tangent dropped": lambda m: _tangent_dropped(m.w).sum() + (m.v * X).sum(),
    "custom_vjp cotangent None": lambda m: _scaled(X, m.w).sum() + (m.v * X).sum(),
    "ft.derivative cotangent zeros": lambda m: _ft_scaled(X, m.w).sum() + (m.v * X).sum(),
}
WRAPS = {
    "plain": lambda f: f,
    "jit": jax.jit,
    "scan": lambda f: lambda m: jax.lax.scan(lambda c, _: (c + f(m), None), 0.0, None, length=2)[0],
    "vmap": lambda f: lambda m: jax.vmap(lambda s: f(m) * s)(jnp.ones(2)).sum(),
}


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("rule", ZERO_RULES)
def test_a_rule_that_gives_no_cotangent_is_found_through_every_transformation(rule, wrap):
    # Old code: every custom derivative counted as reaching every operand: 'active', no finding.
    report = ft.diagnose(WRAPS[wrap](ZERO_RULES[rule]), at=GATE)
    assert _statuses(report) == {"w": "non-differentiable", "v": "active"}
    (finding,) = report.findings
    assert finding.category is ft.NonDifferentiableWarning and finding.paths == ("w",)
    assert "custom derivative of" in finding.message and "zero cotangent" in finding.message


def test_the_warning_names_the_key_path_and_the_call_of_the_rule():
    def loss(m):
        return _ft_scaled(X, m.w).sum() + (m.v * X).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = ft.gradient(loss, at=GATE)
    (w,) = caught
    assert w.category is ft.NonDifferentiableWarning
    assert "\n    w   (through the custom derivative of `_scaled_primal`" in str(w.message)
    # Placed at the user's call of the rule, not inside functree's ft.derivative wrapper.
    assert w.filename == __file__ and "functree/_derivative.py" not in str(w.message)
    np.testing.assert_array_equal(grads.w, np.zeros(2))  # the zero the warning is about


def test_only_the_output_the_rule_leaves_out_is_cut():
    # b reaches only the second output: a loss of the first gives b a zero gradient; of the
    # second, both are differentiated (old code: both 'active' in both).
    pair = Gate(jnp.array(0.5), jnp.array(1.5))  # pyright: ignore[reportCallIssue]
    first = ft.diagnose(lambda m: _pair(m.w * 1.0, m.v)[0] + 0.0 * m.v, at=pair)
    second = ft.diagnose(lambda m: _pair(m.w, m.v)[1], at=pair)
    assert _statuses(second) == {"w": "active", "v": "active"} and second.ok
    assert _statuses(first)["v"] in ("non-differentiable", "zero mask")
    assert [f.paths for f in first.findings] == [("v",)]


CORRECT = {
    "straight-through round": lambda m: _straight_through(m.w).sum() + (m.v * X).sum(),
    "ft.derivative correct rule": lambda m: _ft_correct(X, m.w).sum() + (m.v * X).sum(),
    "jax.nn.relu and logsumexp": lambda m: jax.nn.logsumexp(jax.nn.relu(m.w) * X) + (m.v * X).sum(),
}


@pytest.mark.parametrize("name", CORRECT)
def test_a_rule_that_gives_the_derivative_is_not_warned(name):
    report = ft.diagnose(jax.jit(CORRECT[name]), at=GATE)
    assert report.ok and report.findings == () and _statuses(report) == {"w": "active", "v": "active"}


def test_a_rule_that_cannot_be_traced_alone_counts_as_reaching_everything():
    @jax.custom_vjp
    def picky(x):
        return x * 1.0

    def bwd(r, g):
        if float(jnp.sum(g)) > 0:  # Python control flow on a value: untraceable abstractly
            return (g,)
        return (g,)

    picky.defvjp(lambda x: (x * 1.0, None), bwd)
    report = ft.diagnose(lambda m: picky(m.w).sum() + (m.v * X).sum(), at=GATE)
    assert report.ok and _statuses(report) == {"w": "active", "v": "active"}


def _host_double(a):
    return np.asarray(a) * 2


def _callback_loss(m):
    doubled = jax.pure_callback(_host_double, jax.ShapeDtypeStruct(m.w.shape, m.w.dtype), m.w)
    return (doubled * X).sum() + (m.v * X).sum()


CALLBACK_CALLS = {
    "gradient": lambda: ft.gradient(_callback_loss, at=GATE),
    "jit gradient in scan": lambda: jax.jit(ft.gradient(
        lambda m: jax.lax.scan(lambda c, _: (c + _callback_loss(m), None), 0.0, None, length=2)[0]))(GATE),
    "pullback": lambda: ft.value_with_pullback(_callback_loss, at=GATE),
    "differential": lambda: ft.differential(_callback_loss, at=GATE),
}


@pytest.mark.parametrize("name", CALLBACK_CALLS)
def test_a_callback_reached_by_a_parameter_is_an_error_naming_its_key_path(name):
    # Old code: JAX's "Pure callbacks do not support JVP", with no key path and no line.

    raises_named(CALLBACK_CALLS[name], ValueError, CALLBACK_NOT_DIFFERENTIABLE, "ft.without_derivative(at=x)")
    with pytest.raises(ValueError) as info:
        CALLBACK_CALLS[name]()
    assert "\n    w\n" in str(info.value) and "`pure_callback` at " + __file__ in str(info.value)
    assert "    v\n" not in str(info.value)


def test_the_callback_fixes_run():
    def on_host(w):
        return jax.pure_callback(_host_double, jax.ShapeDtypeStruct(w.shape, w.dtype), w)

    on_host = ft.derivative(of=on_host)(lambda w: (on_host(w), lambda v: 2.0 * v))
    grads = jax.jit(ft.gradient(lambda m: (on_host(m.w) * X).sum() + (m.v * X).sum()))(GATE)
    np.testing.assert_array_equal(grads.w, 2.0 * X)
    stopped = ft.gradient(lambda m: (on_host(ft.without_derivative(at=m.w)) * X).sum() + (m.v * X).sum(), at=GATE)
    np.testing.assert_array_equal(stopped.w, np.zeros(2))


def _while_loss(m):
    steps, carried = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * m.w), (0, X))
    return carried.sum() + (m.v * X).sum() + 0.0 * steps


@pytest.mark.parametrize("jit", [False, True])
def test_a_while_loop_in_reverse_mode_is_an_error_naming_the_key_path(jit):
    # Old code: JAX's "Reverse-mode differentiation does not work for lax.while_loop ...",
    # with no key path and no line.
    grad = ft.gradient(_while_loss)
    call = (lambda: jax.jit(grad)(GATE)) if jit else (lambda: grad(GATE))
    raises_named(call, ValueError, WHILE_NOT_REVERSE, "jax.lax.scan(lambda c, _: (body(c), None), carry, length=n)")
    with pytest.raises(ValueError) as info:
        call()
    assert "\n    w\n" in str(info.value) and "    v\n" not in str(info.value) and f"(at {__file__}:" in str(info.value)
    # The fix it names runs: forward mode through the same loop.
    tangent = ft.differential(_while_loss, at=GATE)(Gate(jnp.ones(2), jnp.zeros(2)))  # pyright: ignore[reportCallIssue]
    np.testing.assert_allclose(tangent, float(jnp.sum(3 * GATE.w ** 2 * X)), rtol=0, atol=1e-5)


def test_a_parameter_read_only_by_the_loop_condition_is_not_named():
    """The explanation listed every differentiated leaf that reached the while loop, its
    condition's constants included: JAX differentiates the body's constants and the carry,
    never the condition's, so a leaf read only by the condition is not why it refused."""
    def loss(m):  # v bounds the loop (its condition); w is multiplied in (its body)
        _, carried = jax.lax.while_loop(lambda c: c[0] < 3.0 * m.v.sum(), lambda c: (c[0] + 1.0, c[1] * m.w),
                                        (0.0, X))
        return carried.sum()

    with pytest.warns(ft.NonDifferentiableWarning, match=r"    v   \(through comparison `lt`\)"), \
            pytest.raises(ValueError) as info:  # (v's zero derivative is warned of first)
        ft.gradient(loss, at=GATE)
    assert "carries 1 differentiated parameter(s)" in str(info.value)
    assert "\n    w\n" in str(info.value) and "    v\n" not in str(info.value)
