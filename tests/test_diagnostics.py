"""Differentiation diagnostics: activity analysis on the jaxpr, warnings, errors, switches."""

from __future__ import annotations

import inspect
import itertools
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import functree as ft
from functree import _activity, _diagnostics

X3 = jnp.array([0.5, -1.0, 2.0])


def _line(f: Callable) -> int:
    return inspect.getsourcelines(f)[1]


@jax.custom_jvp
def _straight_through_round(x):
    return jnp.round(x)


@_straight_through_round.defjvp
def _straight_through_round_jvp(primals, tangents):
    return _straight_through_round(primals[0]), tangents[0]


@ft.differentiable
def _rounded(x):
    return jnp.round(x)


@ft.derivative(of=_rounded)
def _rounded_pullback(x):
    return _rounded(x), lambda v: v  # a registered derivative: trusted, never second-guessed


def _scan_active(x):
    return lax.scan(lambda c, xi: (0.5 * c + xi, c), 0.0, x)[0]


def _scan_inactive(x):
    count = lax.scan(lambda c, _: (c + 1.0, None), 0.0, None, length=3)[0]
    return count + 0.0 * lax.stop_gradient(x.sum())


# (id, program, point, expected warning category or None, expected activity of the leaf)
CATALOGUE = [
    # must NOT warn: comparisons only choose between active values
    ("where", lambda x: jnp.where(x > 0, x, 0.0).sum(), X3, None, "active"),
    ("clip", lambda x: jnp.clip(x, -1.0, 1.0).sum(), X3, None, "active"),
    ("maximum", lambda x: jnp.maximum(x, 0.5).sum(), X3, None, "active"),
    ("relu", lambda x: jax.nn.relu(x).sum(), X3, None, "active"),
    ("abs", lambda x: jnp.abs(x).sum(), X3, None, "active"),
    ("sort", lambda x: jnp.sort(x)[-1], X3, None, "active"),
    ("top_k", lambda x: lax.top_k(x, 2)[0].sum(), X3, None, "active"),
    ("gather", lambda x: x[jnp.array([0, 2])].sum(), X3, None, "active"),
    ("argmax_gather", lambda x: x[jnp.argmax(x)], X3, None, "active"),
    ("argsort_gather", lambda x: jnp.take_along_axis(x, jnp.argsort(x), 0)[0], X3, None, "active"),
    ("piecewise", lambda x: jnp.where(x < 1, x**2, 2 * x - 1).sum(), X3, None, "active"),
    ("cond", lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x).sum(), X3, None, "active"),
    ("scan", _scan_active, X3, None, "active"),
    ("fori", lambda x: lax.fori_loop(0, 3, lambda i, c: c * 2.0, x).sum(), X3, None, "active"),
    # a scan of no step returns its initial carry: the body's round is never applied to it
    ("scan_no_step", lambda x: lax.scan(lambda c, _: (jnp.round(c), None), x, None, length=0)[0].sum(), X3, None,
     "active"),
    (
        "while",
        lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1].sum(),
        X3,
        None,
        "active",
    ),
    ("remat", lambda x: jax.checkpoint(jnp.sin)(x).sum(), X3, None, "active"),
    ("jit", lambda x: jax.jit(lambda a: a * a)(x).sum(), X3, None, "active"),
    ("vmap", lambda x: jax.vmap(lambda a: a * 2.0)(x).sum(), X3, None, "active"),
    ("softmax", lambda x: jax.nn.softmax(x)[0] + jax.nn.logsumexp(x), X3, None, "active"),
    ("custom_jvp_straight_through", lambda x: _straight_through_round(x).sum(), X3, None, "active"),
    ("registered_derivative", lambda x: _rounded(x).sum(), X3, None, "active"),
    ("straight_through", lambda x: x + ft.without_derivative(at=jnp.round(x) - x), 1.5, None, "active"),
    ("norm", lambda x: jnp.linalg.norm(x), X3, None, "active"),
    # intentional zero derivatives: quiet
    ("without_derivative", lambda x: ft.without_derivative(at=x) * 2.0, 1.0, None, "without_derivative"),
    (
        "without_derivative_of_round",
        lambda x: ft.without_derivative(at=jnp.round(x)).sum(),
        X3,
        None,
        "without_derivative",
    ),
    ("seed_silenced", lambda x: ft.without_derivative(at=jnp.sqrt(3.0)), 1.0, None, "unused"),
    # must warn
    ("seed_constant", lambda x: jnp.sqrt(3.0), 1.0, ft.ZeroDerivativeWarning, "unused"),
    ("times_zero", lambda x: x * 0.0, 1.0, ft.ZeroDerivativeWarning, "zero mask"),
    ("scan_inactive", _scan_inactive, X3, ft.NonDifferentiableWarning, "non-differentiable"),
    # a scan of one step or more returns the body's carry, not the initial one (a fixed
    # point joining the initial carry in kept x active through round and stop_gradient)
    ("fori_round", lambda x: lax.fori_loop(0, 2, lambda i, c: jnp.round(c), x).sum(), X3,
     ft.NonDifferentiableWarning, "non-differentiable"),
    ("scan_stop_gradient_carry", lambda x: lax.scan(lambda c, _: (lax.stop_gradient(c), None), x, None, length=1)[0].sum(),
     X3, ft.NonDifferentiableWarning, "non-differentiable"),
    (
        "int_roundtrip",
        lambda x: x.astype(jnp.int32).astype(jnp.float32),
        1.0,
        ft.NonDifferentiableWarning,
        "non-differentiable",
    ),
    ("round", lambda x: jnp.round(x).sum(), X3, ft.NonDifferentiableWarning, "non-differentiable"),
    ("floor_sign", lambda x: (jnp.floor(x) + jnp.sign(x)).sum(), X3, ft.NonDifferentiableWarning, "non-differentiable"),
    ("argmax", lambda x: jnp.argmax(x).astype(jnp.float32), X3, ft.NonDifferentiableWarning, "non-differentiable"),
    ("fraction_positive", lambda x: jnp.mean(x > 0), X3, ft.NonDifferentiableWarning, "non-differentiable"),
    ("stop_gradient", lambda x: lax.stop_gradient(x).sum(), X3, ft.NonDifferentiableWarning, "non-differentiable"),
    (
        "cond_on_constants",
        lambda x: lax.cond(x > 0, lambda: 1.0, lambda: 0.0),
        1.0,
        ft.NonDifferentiableWarning,
        "non-differentiable",
    ),
    (
        "bitwise",
        lambda x: (x.astype(jnp.int32) & 1).astype(jnp.float32),
        3.0,
        ft.NonDifferentiableWarning,
        "non-differentiable",
    ),
]


@pytest.mark.parametrize(
    "program, point, category, status", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE]
)
def test_catalogue(program, point, category, status):
    report = ft.diagnose(program, at=point)
    assert report.analysed, report.note
    assert [f.category for f in report.findings] == ([category] if category else [])
    assert report.activity == (("<root>", status),)
    assert report.ok == (category is None)


@pytest.mark.parametrize(
    "program, point, category, status", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE]
)
def test_diagnostics_never_change_results(program, point, category, status):
    def derivatives():
        try:
            value, pullback = ft.value_with_pullback(program, at=point)
            return value, pullback(jnp.ones_like(value))
        except ValueError:  # lax.while_loop has no reverse mode: use forward mode
            value, differential = ft.value_with_differential(program, at=point)
            return value, differential(jnp.ones_like(jnp.asarray(point)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.DifferentiationWarning)
        on = derivatives()
        with ft.config.override(diagnostics=False):
            off = derivatives()
    # NumPy compiles no program per shape; the dtypes compared as jnp's strict equality required
    assert all(jnp.result_type(a) == jnp.result_type(b) and np.array_equal(a, b) for a, b in zip(on, off))


# ------------------------------------------------------------------ warnings and locations


def test_seed_002_zero_derivative_warns_at_the_function():
    f = lambda x: jnp.sqrt(3.0)  # noqa: E731
    with pytest.warns(ft.ZeroDerivativeWarning, match="will always have a zero derivative") as rec:
        grad = ft.gradient(f, at=1.0)
    assert grad == 0.0
    assert rec[0].filename == __file__
    assert rec[0].lineno == _line(f)
    assert "ft.without_derivative(at=" in str(rec[0].message)


def test_seed_002_without_derivative_silences():
    ft.gradient(lambda x: ft.without_derivative(at=jnp.sqrt(3.0)), at=1.0)  # no warning


@pytest.mark.parametrize("jitted", [False, True])
def test_a_stopped_data_target_does_not_silence_an_unused_model(jitted):
    """Swift's withoutDerivative(at:) of the *result* silences the warning; a stopped target
    beside a model the loss forgot to call does not (eager: a constant; jitted: the jaxpr)."""
    model = ft.nn.Dense(3, 2, key=jax.random.key(0))
    # the call's data, put on the device as it is (jnp.arange/ones compile a program per shape)
    x, y = jax.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3)), jax.device_put(np.ones((2, 2), np.float32))

    def forgot_the_model(m, x, y):
        return jnp.mean((x[:, :2] - ft.without_derivative(at=y)) ** 2)

    grad = ft.gradient(forgot_the_model)
    with pytest.warns(ft.ZeroDerivativeWarning, match="will always have a zero derivative"):
        (jax.jit(grad) if jitted else grad)(model, x, y)
    assert not ft.diagnose(forgot_the_model)(model, x, y).ok


def test_a_zero_buffer_of_the_model_is_data_not_a_known_zero():
    """A no_derivative gate that is 0 now (a warm-up factor) changes later: no warning."""
    class Warm(ft.Module):
        dense: ft.nn.Dense
        gate: jax.Array = ft.field(no_derivative=True)

        def __call__(self, x):
            return self.dense(x) * self.gate

    model = Warm(ft.nn.Dense(3, 2, key=jax.random.key(0)), jnp.zeros(()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.gradient(lambda m, x: m(x).sum())(model, jnp.ones((2, 3)))
    with pytest.warns(ft.ZeroDerivativeWarning, match="multiplied by a constant zero"):  # a literal's zero still is
        ft.gradient(lambda m, x: (m.dense(x) * 0.0).sum())(model, jnp.ones((2, 3)))


@pytest.mark.parametrize("operator", [ft.gradient, ft.value_with_gradient, ft.diagnose])
def test_an_array_passed_by_keyword_is_data_not_a_known_zero(operator):
    """loss(m, x, mask=zeros): the mask is the call's data, as if passed positionally
    (it warned "a ... will always have a zero gradient": the keyword was read as a closure)."""
    class Pair(ft.Module):
        a: jax.Array
        b: jax.Array

    def loss(m, x, mask=None):
        return jnp.sum(m.a * x * mask) + jnp.sum(m.b * x)

    model, mask = Pair(jnp.ones(3), jnp.ones(3)), jnp.zeros(3)  # pyright: ignore[reportCallIssue]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = operator(loss)(model, X3, mask=mask)
    if operator is ft.diagnose:
        assert out.ok and {a.status for a in out.activity} == {"active"}
        return
    grads = out[1] if operator is ft.value_with_gradient else out
    # d/da Σ a·x·mask = x·mask, d/db Σ b·x = x (numpy); exact in float32.
    np.testing.assert_allclose(grads.a, np.asarray(X3) * 0.0, rtol=0, atol=0)
    np.testing.assert_allclose(grads.b, np.asarray(X3), rtol=0, atol=0)


@pytest.mark.parametrize("flag", [np.array(False), np.bool_(False), np.int32(0)])
def test_a_data_flag_choosing_a_cond_branch_is_data_not_a_known_branch(flag):
    """The check's trace bakes a NumPy flag argument into the jaxpr as a literal index; the
    other branch runs for another flag, so its parameters are no finding."""
    def loss(m, x, flag):
        return lax.cond(flag, lambda: jnp.sum(m["b"] * x), lambda: jnp.sum(m["a"] * x))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.gradient(loss)({"a": X3, "b": X3}, X3, flag)
    assert ft.gradient(loss)({"a": X3, "b": X3}, X3, np.array(True))["b"].tolist() == X3.tolist()


def test_non_differentiable_names_operation_and_line():
    def f(x):
        y = x * 2.0
        return y.astype(jnp.int32).astype(jnp.float32)

    with pytest.warns(ft.NonDifferentiableWarning, match="cannot differentiate through") as rec:
        ft.gradient(f, at=1.0)
    message = str(rec[0].message)
    assert "conversion to int32" in message
    assert f"{__file__}:{_line(f) + 2}" in message
    assert (rec[0].filename, rec[0].lineno) == (__file__, _line(f) + 2)


def test_stop_gradient_suggests_without_derivative():
    with pytest.warns(ft.NonDifferentiableWarning, match="stop_gradient") as rec:
        ft.gradient(lambda x: lax.stop_gradient(x) * 2.0, at=1.0)
    assert "ft.without_derivative" in str(rec[0].message)


class _TargetNetwork(ft.Module):
    online: ft.nn.Dense
    target: ft.nn.Dense


def test_a_target_network_cut_by_stop_gradient_is_told_to_say_so_and_both_fixes_are_quiet():
    # the fix shown was the threshold's smooth gate, which a target network has no use for
    m = _TargetNetwork(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.Dense(3, 2, key=jax.random.key(1)))
    x = jnp.ones((4, 3))

    def loss(m, cut=lax.stop_gradient):
        return jnp.mean((m.online(x) - cut(m.target(x))) ** 2)

    with pytest.warns(ft.NonDifferentiableWarning, match="target.weight") as rec:
        ft.gradient(loss, at=m)
    message = str(rec[0].message)
    assert "ft.without_derivative(at=model.target(x))" in message and 'wrt="online.*"' in message
    assert "threshold" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.gradient(lambda m: loss(m, lambda t: ft.without_derivative(at=t)), at=m)
        ft.gradient(loss, at=m, wrt="online.*")


def test_a_cut_other_than_stop_gradient_keeps_the_smooth_gate_fix():
    with pytest.warns(ft.NonDifferentiableWarning, match="weight") as rec:
        ft.gradient(lambda d: jnp.round(d.weight).sum() + lax.stop_gradient(d.weight).sum() + d.bias.sum(),
                    at=ft.nn.Dense(3, 2, key=jax.random.key(0)))
    assert "jax.nn.sigmoid" in str(rec[0].message) and "target" not in str(rec[0].message)


@pytest.mark.parametrize("operator", [ft.value_with_pullback, ft.value_with_differential])
def test_pullback_and_differential_warn_too(operator):
    with pytest.warns(ft.ZeroDerivativeWarning):
        operator(lambda x: jnp.ones(2) * 4.0, at=1.0)


def test_has_aux_analyses_the_value_only():
    def loss(x):
        return (x * x).sum(), jnp.argmax(x).astype(jnp.float32)  # aux is non-differentiable

    (_, _), grad = ft.value_with_gradient(loss, at=X3, has_aux=True)  # no warning
    np.testing.assert_allclose(grad, 2 * np.asarray(X3), rtol=0, atol=0)  # d/dx Σ x² = 2x (numpy): exact in float32
    assert ft.diagnose(loss, at=X3, has_aux=True).ok


class _WithHead(ft.Module):
    w: jax.Array
    head: jax.Array


@pytest.mark.parametrize("operator", [
    lambda f, m: ft.value_with_gradient(f, at=m, has_aux=True),
    lambda f, m: ft.value_with_pullback(f, at=m, has_aux=True),
    lambda f, m: ft.value_with_differential(f, at=m, has_aux=True),
    lambda f, m: ft.jacobian(f, at=m, has_aux=True),
])
def test_every_operator_with_aux_analyses_the_result_only(operator):
    """A parameter read only by the aux has a zero derivative: each operator says so."""
    _diagnostics._CACHE.clear()  # value_with_pullback and jacobian share a kind: analysed once

    def loss(m):
        return jnp.sum(X3 * m.w), {"probe": jnp.sum(X3 * m.head)}

    with pytest.warns(ft.UnusedParameterWarning, match="head"):
        operator(loss, _WithHead(jnp.ones(3), jnp.ones(3)))
    with warnings.catch_warnings():  # an argmax in the aux is no finding either
        warnings.simplefilter("error")
        operator(lambda m: (jnp.sum(X3 * m.w * m.head), jnp.argmax(m.w)), _WithHead(jnp.ones(3), jnp.ones(3)))


class _Calls:
    n = 0


def test_an_eager_minimize_loop_analyses_its_loss_once():
    """An optimizer wraps the loss in a new objective at every call. The check is keyed by
    the wrapper's code and closure (the loss among them), so an eager loop traces the loss
    for the analysis once, not at every step; another loss is analysed, and warns, afresh."""
    calls = _Calls()  # (a list in the closure would be part of the key: it grows)

    def loss(m, x):
        calls.n += 1
        return jnp.sum(m.w * x)

    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    model = _WithHead(jnp.ones(3), jnp.ones(3))
    state = opt.init(model)
    with pytest.warns(ft.UnusedParameterWarning, match="head"):
        model, state, _ = opt.minimize(loss, model, state, X3)
    assert calls.n == 2  # the check's trace, then the step's own run
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second analysis would warn again
        for _ in range(3):
            model, state, _ = opt.minimize(loss, model, state, X3)
    assert calls.n == 5
    np.testing.assert_allclose(model.w, 1.0 - 4 * 0.1 * np.asarray(X3), atol=1e-6)

    def other(m, x):
        return jnp.sum(m.w * x * 2.0)

    with pytest.warns(ft.UnusedParameterWarning, match="head"):
        opt.minimize(other, model, state, X3)


def test_warnings_raised_in_the_loss_keep_their_module_for_filters(tmp_path, monkeypatch):
    """A pytest-style filter scoped to a module (``module="mylib"``) still matches a warning
    the check caught while tracing and emits again (the jitted step's replay)."""
    (tmp_path / "mylib_ft_test.py").write_text(
        "import warnings\n"
        "def old_scale(w):\n"
        "    warnings.warn('old_scale is deprecated', DeprecationWarning)\n"
        "    return w * 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mylib_ft_test

    def loss(w):
        return jnp.sum(mylib_ft_test.old_scale(w) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="mylib_ft_test")
        assert jax.jit(ft.gradient(loss))(jnp.ones(2)).tolist() == [8.0, 8.0]
        assert ft.gradient(loss)(jnp.ones(2)).tolist() == [8.0, 8.0]
    with pytest.warns(DeprecationWarning, match="old_scale is deprecated"):  # unfiltered: still shown
        jax.jit(ft.gradient(lambda w: jnp.sum(mylib_ft_test.old_scale(w))))(jnp.ones(2))


def test_unused_argument_among_several():
    f = lambda x, y: x * 2.0  # noqa: E731
    with pytest.warns(ft.ZeroDerivativeWarning, match="argument 1 \\(`y`\\)"):
        ft.gradient(f, wrt=(0, 1))(1.0, 2.0)


def test_warnings_are_one_family():
    for w in (ft.ZeroDerivativeWarning, ft.NonDifferentiableWarning, ft.UnusedParameterWarning):
        assert issubclass(w, ft.DifferentiationWarning)
    assert issubclass(ft.NonDifferentiableFieldWarning, ft.DifferentiationWarning)


# ------------------------------------------------------------------ modules


class Net(ft.Module):
    first: ft.nn.Dense
    second: ft.nn.Dense
    mask: jax.Array = ft.field(no_derivative=True)

    def __call__(self, x):
        return self.first(x) * 2.0


class Gated(ft.Module):
    weight: jax.Array
    bias: jax.Array
    mask: jax.Array = ft.field(no_derivative=True)

    def __call__(self, x):
        return x @ self.weight + self.bias * self.mask


class Thresholded(ft.Module):
    weight: jax.Array
    threshold: jax.Array

    def __call__(self, x):
        return jnp.where(x.sum() > self.threshold, x @ self.weight, 0.0)


def _net(key):
    k1, k2 = jax.random.split(key)
    return Net(ft.nn.Dense(3, 2, key=k1), ft.nn.Dense(3, 2, key=k2), jnp.zeros(2))


def test_unused_layer_lists_key_paths(key):
    net = _net(key)
    loss = lambda m: m(jnp.ones(3)).sum()  # noqa: E731
    with pytest.warns(ft.UnusedParameterWarning, match="2 parameter") as rec:
        grads = ft.gradient(loss, at=net)
    message = str(rec[0].message)
    assert "second.weight" in message and "second.bias" in message
    assert "first.weight" not in message.split("zero gradient:")[1].split("Call")[0]
    assert rec[0].lineno == _line(loss)
    np.testing.assert_array_equal(grads.second.weight, np.zeros(net.second.weight.shape))


def test_pattern_selecting_used_parameters_is_quiet(key):
    ft.gradient(lambda m: m(jnp.ones(3)).sum(), at=_net(key), wrt="first.*")


def test_bias_times_constant_zero_mask(key):
    model = Gated(jnp.ones((3, 2)), jnp.ones(2), jnp.zeros(2))
    # The model's own no_derivative mask is data (another call may pass another), as under jit.
    assert ft.diagnose(lambda m: m(jnp.ones(3)).sum(), at=model).ok
    mask = jnp.zeros(2)  # a constant of the function's: its zero is known
    report = ft.diagnose(lambda m: (jnp.ones(3) @ m.weight + m.bias * mask).sum(), at=model)
    assert [f.category for f in report.findings] == [ft.UnusedParameterWarning]
    assert report.findings[0].paths == ("bias",)
    assert "multiplied by a constant zero" in report.findings[0].message
    assert dict(report.activity) == {"weight": "active", "bias": "zero mask"}
    # a nonzero mask uses the bias
    assert ft.diagnose(lambda m: m(jnp.ones(3)).sum(), at=model.replace(mask=jnp.ones(2))).ok


class _TwoBranch(ft.Module):
    weight: jax.Array
    other: jax.Array


def _where_loss(m, x, condition):
    return jnp.sum(jnp.where(condition, m.weight * x, m.other))


def test_branch_a_constant_where_condition_never_selects_is_unused():
    model = _TwoBranch(jnp.ones(3), jnp.ones(3))
    loss = lambda m, x: _where_loss(m, x, True)  # noqa: E731
    with pytest.warns(ft.UnusedParameterWarning, match="never selects") as rec:
        grads = ft.gradient(loss)(model, X3)
    message = str(rec[0].message).split("Call the layers")[0]
    assert "    other   (in a jnp.where branch" in message and "weight" not in message
    assert f"{__file__}:{_line(_where_loss) + 1}" in message
    np.testing.assert_array_equal(grads.other, np.zeros(3))
    report = ft.diagnose(lambda m: _where_loss(m, X3, jnp.zeros(3) > 1), at=model)
    assert report.findings[0].paths == ("weight",)
    assert dict(report.activity) == {"weight": "zero mask", "other": "active"}
    zero = ft.diagnose(lambda x: jnp.sum(jnp.where(False, x, 1.0)), at=X3).findings[0]
    assert zero.category is ft.ZeroDerivativeWarning and "never selects" in zero.message


def test_where_condition_from_the_call_or_mixed_is_quiet():
    # The call's data (any form) may select the other branch on another call; a mixed
    # constant mask (a causal one) selects both; a mask sliced per scan step is per step.
    model = _TwoBranch(jnp.ones(3), jnp.ones(3))
    for condition in (np.ones(3, bool), jnp.ones(3, bool), True):
        ft.gradient(_where_loss)(model, X3, condition)
    ft.gradient(lambda m, x: _where_loss(m, x, jnp.array([True, False, True])))(model, X3)
    steps = jnp.array([[True] * 3, [False] * 3])
    scanned = lambda m: lax.scan(lambda c, s: (c + jnp.where(s, m.weight, m.other), None), jnp.zeros(3), steps)  # noqa: E731
    ft.gradient(lambda m: scanned(m)[0].sum(), at=model)


def test_parameter_only_in_a_comparison_is_non_differentiable():
    model = Thresholded(jnp.ones((3, 2)), jnp.array(0.5))
    with pytest.warns(ft.NonDifferentiableWarning, match="threshold") as rec:
        ft.gradient(lambda m: m(jnp.ones(3)).sum(), at=model)
    assert "comparison `gt`" in str(rec[0].message)


@pytest.mark.slow  # mostly JAX's first compilations of the layers' initializers
def test_realistic_mlp_classifier_finds_nothing(key):
    k1, k2 = jax.random.split(key)
    model = [ft.nn.Dense(64, 32, jax.nn.relu, key=k1), ft.nn.Dense(32, 10, key=k2)]
    # the batch made in NumPy and put on the device: no program of its own (jax.random.normal's, iota's)
    x = jax.device_put(np.random.default_rng(3).standard_normal((256, 64)).astype(np.float32))
    y = jax.device_put(np.arange(256, dtype=np.int32) % 10)

    def loss(model, x, y):
        for layer in model:
            x = layer(x)
        logp = jax.nn.log_softmax(x)
        accuracy = jnp.mean(jnp.argmax(x, -1) == y)
        return -jnp.take_along_axis(logp, y[:, None], 1).mean(), accuracy

    report = ft.diagnose(loss, has_aux=True)(model, x, y)
    assert report.ok, str(report)
    assert {s for _, s in report.activity} == {"active"}
    assert len(report.activity) == 4
    ft.jit(ft.gradient(loss, has_aux=True))(model, x, y)  # and no warning


# ------------------------------------------------------------------ robustness, cost, switches


def test_python_control_flow_under_eager_gradient_is_not_flagged():
    # make_jaxpr cannot trace this, jax.grad can: no analysis, no warning, same result
    grad = ft.gradient(lambda x: x * x if x > 0 else -x, at=2.0)
    assert grad == 4.0


def test_unknown_primitive_is_assumed_differentiable():
    from jax.extend.core import Primitive

    opaque = Primitive("ft_test_opaque")
    opaque.def_impl(lambda x: x)
    opaque.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    report = ft.diagnose(lambda x: opaque.bind(x).sum(), at=X3)
    assert report.ok and report.activity == (("<root>", "active"),)


def test_under_vmap():
    per_example = jax.vmap(lambda x: ft.gradient(lambda y: (y * y).sum(), at=x))
    assert per_example(jnp.ones((2, 3))).shape == (2, 3)  # no warning
    with pytest.warns(ft.NonDifferentiableWarning):
        jax.vmap(lambda x: ft.gradient(lambda y: jnp.floor(y).sum(), at=x))(jnp.ones((2, 3)))


def test_analysis_failure_never_breaks_differentiation(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("analysis bug")

    monkeypatch.setattr(_diagnostics, "analyse", broken)
    f = lambda x: jnp.sqrt(3.0) + 0.0 * x  # noqa: E731
    assert ft.gradient(f, at=1.0) == 0.0
    report = ft.diagnose(f, at=1.0)
    assert not report.analysed and "analysis bug" in report.note


def test_analysis_runs_once_per_signature():
    traces = itertools.count()  # not a pytree: the closure's key stays the same

    def f(x):
        next(traces)
        return (x * x).sum()

    ft.gradient(f, at=jnp.ones(3))
    assert next(traces) == 2  # the analysis's trace, then the eager jax.grad's run (no replay eagerly)
    ft.gradient(f, at=jnp.ones(3) * 2)
    assert next(traces) == 4  # only jax.grad's run
    ft.gradient(f, at=jnp.ones(4))  # a new signature is analysed again
    assert next(traces) == 7


def test_warns_once_per_signature():
    f = lambda x: jnp.sqrt(3.0) + 0.0 * lax.stop_gradient(x)  # noqa: E731
    with pytest.warns(ft.NonDifferentiableWarning):
        ft.gradient(f, at=1.0)
    ft.gradient(f, at=2.0)  # same signature: analysed already, no warning (filters: error)


def test_python_values_in_closures_are_part_of_the_key():
    def scaled(scale):
        return lambda x: x * scale

    ft.gradient(scaled(1.0), at=1.0)  # active: no warning
    with pytest.warns(ft.ZeroDerivativeWarning, match="multiplied by a constant zero"):
        ft.gradient(scaled(0.0), at=1.0)


def test_nested_operators():
    inner = lambda x: ft.gradient(lambda y: (y**3).sum(), at=x).sum()  # noqa: E731
    assert ft.gradient(inner, at=jnp.array([1.0, 2.0])).tolist() == [6.0, 12.0]
    quiet = lambda x: ft.gradient(lambda y: (y * y).sum(), at=x).sum() + ft.without_derivative(at=2.0)  # noqa: E731
    ft.gradient(quiet, at=jnp.ones(2))


def test_jitted_step_analyses_at_trace_time_only():
    calls = []
    original = _diagnostics._run

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    step = ft.jit(lambda w, x: w - 0.1 * ft.gradient(lambda w: ((x @ w) ** 2).sum(), at=w))
    w, x = jnp.ones(3), jnp.ones((4, 3))
    _diagnostics._run = counting
    try:
        for _ in range(3):
            w = step(w, x)
    finally:
        _diagnostics._run = original
    assert len(calls) == 1


def test_config_switch_turns_warnings_off():
    with ft.config.override(diagnostics=False):
        assert ft.gradient(lambda x: jnp.sqrt(3.0), at=1.0) == 0.0  # no warning
    assert ft.config.diagnostics is True
    assert repr(ft.config) == "ft.config(diagnostics=True)"


def test_config_rejects_non_bool():
    with pytest.raises(TypeError, match=r"ft\.config\.diagnostics = False"):
        ft.config.diagnostics = "no"
    with pytest.raises(AttributeError, match="has no option 'speed'"), ft.config.override(speed=True):
        pass


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("1", True), ("", True)])
def test_environment_variable(monkeypatch, value, expected):
    # ft.config is a Config built at import: a fresh Config reads the variable as import
    # does (test_environment_variable_typo_is_an_error imports functree under it, once).
    monkeypatch.setenv("FUNCTREE_DIAGNOSTICS", value)
    assert type(ft.config)().diagnostics is expected


# One interpreter for both imports (a start + jax import is ~3 CPU-s): a typo stops the
# import with the message; then, the variable fixed, functree imports again (its modules
# dropped, jax kept) and reads "off".
_IMPORT_TWICE = """\
import os, sys, traceback
try:
    import functree
except ValueError:
    traceback.print_exc()
else:
    sys.exit("imported under a typo")
os.environ["FUNCTREE_DIAGNOSTICS"] = "off"
for name in [m for m in sys.modules if m == "functree" or m.startswith("functree.")]:
    del sys.modules[name]
import functree as ft
print(ft.config.diagnostics)
"""


def test_environment_variable_typo_is_an_error(monkeypatch):
    env = {**os.environ, "FUNCTREE_DIAGNOSTICS": "maybe"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_TWICE], env=env, capture_output=True, text=True)
    assert "FUNCTREE_DIAGNOSTICS='maybe' is not a switch" in out.stderr
    assert out.stdout.strip() == "False", out.stderr  # read at import
    monkeypatch.setenv("FUNCTREE_DIAGNOSTICS", "maybe")
    with pytest.raises(ValueError, match="FUNCTREE_DIAGNOSTICS='maybe' is not a switch"):
        type(ft.config)()


def test_report_text_and_html():
    report = ft.diagnose(lambda x: jnp.round(x), at=1.0)
    text = str(report)
    assert "1 finding(s)" in text and "NonDifferentiableWarning" in text and "`round`" in text
    page = report._repr_html_()
    assert "<table>" in page and "non-differentiable" in page
    assert "no findings" in str(ft.diagnose(jnp.sin, at=1.0))


def test_diagnose_raises_the_functions_own_errors():
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        ft.diagnose(lambda x, y: x * y, at=1.0)


# ------------------------------------------------------------------ errors that show the fix


def test_integer_argument_error():
    with pytest.raises(TypeError, match="Only floating-point values carry derivatives") as e:
        ft.gradient(lambda x, y: x * y, wrt=1)(1.0, 2)
    # the fix is the value as float, never another argument's derivative (wrt=0 is d/dx, not d/dy)
    assert "wrt=0" not in str(e.value) and "astype(jnp.float32)" in str(e.value)


def test_no_derivative_field_error():
    model = Gated(jnp.ones((3, 2)), jnp.ones(2), jnp.ones(2))
    with pytest.raises(ValueError, match="selects mask, which is not a parameter") as e:
        ft.gradient(lambda m: m(jnp.ones(3)).sum(), at=model, wrt="mask")
    assert "no_derivative" in str(e.value)


def test_non_scalar_result_error():
    with pytest.raises(TypeError, match="needs a scalar result") as e:
        ft.gradient(lambda x: x * 2.0, at=X3)
    assert "ft.jacobian(f, at=x)" in str(e.value)


def test_control_flow_error_names_the_line_and_the_fix():
    @ft.jit
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(ft.ControlFlowError, match=r"jnp\.where") as e:
        f(X3)
    message = str(e.value)
    assert f"{__file__}:{_line(f) + 2}" in message
    assert "if x.sum() > 0:" in message and "jax.lax.cond" in message
    assert isinstance(e.value, TypeError)


def test_control_flow_error_for_traced_integer():
    @ft.jit
    def f(x, n):
        for _ in range(n):
            x = x * 2.0
        return x

    with pytest.raises(ft.ControlFlowError, match="fori_loop") as e:
        f(X3, jnp.array(3))
    assert f"{__file__}:{_line(f) + 2}" in str(e.value)


def test_control_flow_in_differentiated_function_under_jit():
    def loss(w):
        return w.sum() if w.sum() > 0 else -w.sum()

    with pytest.raises(ft.ControlFlowError, match=r"jnp\.where"):
        ft.jit(lambda w: ft.gradient(loss, at=w))(X3)


# ------------------------------------------------------------------ construction-time checks


def test_annotation_warning_at_class_definition():
    with pytest.warns(ft.NonDifferentiableFieldWarning) as rec:

        class M(ft.Module):
            weight: jax.Array
            flag: bool
            count: int
            name: str
            act: Callable[[jax.Array], jax.Array]

    assert [str(r.message).split(" is a")[0] for r in rec] == ["M.flag", "M.count", "M.name", "M.act"]
    assert all(r.filename == __file__ for r in rec)
    assert rec[0].lineno == inspect.currentframe().f_lineno - 9
    assert "flag: bool = ft.field(static=True)" in str(rec[0].message)
    assert "flag: jax.Array = ft.field(no_derivative=True)" in str(rec[0].message)  # state: an array


def test_annotation_warning_without_postponed_annotations():
    namespace: dict = {}
    with pytest.warns(ft.NonDifferentiableFieldWarning, match="M.flag") as rec:
        exec("import functree as ft\nclass M(ft.Module):\n    flag: bool\n", namespace)
    assert len(rec) == 1 and rec[0].lineno == 2


def test_value_warning_at_construction_and_no_double_warning():
    class M(ft.Module):
        weight: jax.Array
        extra: object

    with pytest.warns(ft.NonDifferentiableFieldWarning, match="M.extra") as rec:
        m = M(jnp.ones(2), 3)
    assert len(rec) == 1 and rec[0].filename == __file__
    jax.tree.map(lambda x: x, m)  # unflattening does not warn again

    with pytest.warns(ft.NonDifferentiableFieldWarning) as rec:

        class N(ft.Module):
            weight: jax.Array
            count: int

    N(jnp.ones(2), 3)  # annotated: warned once at the class, not again per instance
    assert len(rec) == 1


def test_marked_fields_do_not_warn():
    class M(ft.Module):
        weight: jax.Array
        count: int = ft.field(static=True, default=1)
        steps: jax.Array = ft.field(no_derivative=True, default=0)
        act: Callable = ft.field(static=True, default=jax.nn.relu)

    M(jnp.ones(2))


# ------------------------------------------------------------------ the unused-parameter fix


class _Stack(ft.Module):
    layers: list
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.layers[2](self.layers[0](x)))  # layers[1] is never called


def _stack(key):
    keys = jax.random.split(key, 4)
    return _Stack([ft.nn.Dense(3, 3, key=k) for k in keys[:3]], ft.nn.Dense(3, 1, key=keys[3]))


def _suggested_wrt(message: str):
    import ast
    import re

    return ast.literal_eval(re.search(r"wrt=(.*?)\)( |\()", message).group(1))


def test_unused_layer_suggestion_excludes_it_and_silences_the_warning(key):
    model = _stack(key)
    loss = lambda m: m(jnp.ones(3)).sum()  # noqa: E731
    with pytest.warns(ft.UnusedParameterWarning) as rec:
        ft.gradient(loss, at=model)
    message = str(rec[0].message)
    assert "layers.1.weight" in message and '"layers.*"' not in message
    wrt = _suggested_wrt(message)
    assert wrt == ("layers.0", "layers.2", "head")
    grads = ft.gradient(loss, at=model, wrt=wrt)  # no warning (filterwarnings: error)
    assert grads.layers[1].weight is None and grads.head.weight.shape == (3, 1)


def test_unused_suggestion_is_one_pattern_when_one_subtree_is_used(key):
    model = _net(key)  # second is unused; mask is not a parameter
    with pytest.warns(ft.UnusedParameterWarning) as rec:
        ft.gradient(lambda m: m(jnp.ones(3)).sum(), at=model)
    assert _suggested_wrt(str(rec[0].message)) == "first"


def test_unused_suggestion_for_a_model_that_is_not_the_first_argument(key):
    net = _net(key)
    with pytest.warns(ft.UnusedParameterWarning) as rec:
        ft.gradient(lambda x, m: m(x).sum(), wrt=1)(jnp.ones(3), net)
    message = str(rec[0].message)
    assert 'ft.gradient(loss, wrt="first")(model, ...)' in message
    assert "patterns select in argument 0" in message


def test_used_patterns_never_cover_an_unused_parameter():
    every = ["a.0.w", "a.0.b", "a.1.w", "a.10.w", "b*c.w"]
    patterns = _diagnostics.used_patterns(["a.0.w", "a.0.b", "a.10.w", "b*c.w"], every)
    assert patterns == ("a.0", "a.10", "b[*]c")
    from functree._naming import matches

    assert [n for n in every if any(matches(n, p) for p in patterns)] == ["a.0.w", "a.0.b", "a.10.w", "b*c.w"]
    assert _diagnostics.used_patterns(["a.0.w"], ["a.0.w", "a.0.b"]) == ("a.0.w",)


# ------------------------------------------------------------------ records and internals


def test_activity_records_are_named():
    (leaf,) = ft.diagnose(lambda x: jnp.round(x), at=1.0).activity
    assert (leaf.name, leaf.status) == ("<root>", "non-differentiable")
    assert isinstance(leaf, _diagnostics.LeafActivity)


def test_source_line_of_an_equation_without_traceback_never_raises():
    from types import SimpleNamespace

    assert _activity.where(SimpleNamespace(source_info=None)) == ("<unknown>", 0)
    eqn = jax.make_jaxpr(jnp.round)(1.0).jaxpr.eqns[0]
    assert _activity.where(eqn) == ("<unknown>", 0)  # only JAX's own frames
    f = lambda x: jnp.round(x)  # noqa: E731
    (eqn,) = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    assert _activity.where(eqn) == (__file__, _line(f))


def test_no_private_jax_imports_and_no_import_cycle():
    import ast
    import pathlib

    root = pathlib.Path(ft.__file__).parent
    modules = ["_diagnostics", "_activity", "_diagnostics_key", "_operators", "_plan"]
    modules += ["_parameters", "_tangent", "_derivative"]
    imported = {}
    for name in modules:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported[name] = {
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        assert not any(m and m.startswith("jax._src") for m in imported[name]), name
    assert "functree._operators" not in imported["_diagnostics"]
    assert "functree._diagnostics" not in imported["_plan"]
    assert "functree._diagnostics" not in imported["_activity"]  # the analysis is a leaf


def test_diagnose_names_an_argument_of_star_args_as_the_function_reads_it():
    # argument 2 is args[1] (not `args`, not a keyword-only parameter's name)
    def loss(extra: jax.Array, *args: jax.Array, scale: float = 1.0) -> jax.Array:
        return scale * jnp.sum(extra) + jnp.sum(jnp.floor(args[1]))

    report = ft.diagnose(loss, wrt=(0, 2))(jnp.ones(2), jnp.ones(2), jnp.ones(3))
    (finding,) = report.findings
    assert "argument 2 (`args[1]`)" in finding.message


def test_diagnose_reports_a_custom_derivative_that_does_not_cover_the_argument():
    @ft.differentiable
    def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
        return scale * jnp.linalg.norm(x)

    @ft.derivative(of=norm, wrt=0)
    def _(x: jax.Array, scale: jax.Array) -> Any:
        n = jnp.linalg.norm(x)
        return scale * n, lambda v: v * scale * x / n

    x = jnp.array([3.0, 4.0])
    report = ft.diagnose(norm, wrt=1)(x, 2.0)
    (finding,) = report.findings
    assert finding.category is ft.ZeroDerivativeWarning
    assert finding.paths == ("argument 1 (`scale`)",)
    assert "@ft.derivative(of=norm, wrt=(0, 1))" in finding.message
    assert ft.diagnose(norm, wrt=0)(x, 2.0).ok


def test_the_check_cache_holds_a_closures_objects_weakly():
    # A loss closing over an object equal only to itself (a TrainStep, a user's holder of
    # arrays): the cache of checked functions must not keep it, or its arrays, alive.
    import gc
    import weakref

    from functree import _diagnostics

    class Holder:
        def __init__(self):
            self.scale = jnp.full(3, 2.0)

    box = [Holder()]

    def loss(x):
        return jnp.sum(x * box[0].scale)

    before = len(_diagnostics._CACHE)
    for _ in range(2):  # checked once: the second call finds its key
        assert ft.gradient(loss)(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert len(_diagnostics._CACHE) == before + 1
    held = weakref.ref(box[0])
    gc.disable()
    try:
        box.clear()
        assert held() is None
    finally:
        gc.enable()


# ------------------------------------------------------- the check's trace, differentiated


class _Block(ft.Module):
    dense: ft.nn.Dense
    norm: ft.nn.LayerNorm

    def __call__(self, x):
        return self.norm(jax.checkpoint(self.dense)(x))


@ft.derivative(of=_rounded)
def _rounded_again(x):
    return _rounded(x), lambda v: v


def _replay_cases():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = ft.nn.Sequential([_Block(ft.nn.Dense(3, 4, jax.nn.gelu, key=k1), ft.nn.LayerNorm(4)),
                              ft.nn.Dense(4, 2, key=k2)])
    x = jax.device_put(np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32))  # compiles no program

    def loss(m, x):
        return jnp.mean(jnp.tanh(m(x)) ** 2) + 0.1 * _rounded(jnp.sum(m.layers[1].bias))

    def loss_aux(m, x):
        y = m(x)
        return jnp.mean(y ** 2), {"y": y, "n": jnp.int32(3), "rate": 0.5, "count": 2}

    return model, x, loss, loss_aux


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_the_operator_differentiates_the_checks_jaxpr_bit_for_bit(jitted):
    # The analysis traced the function; the operator differentiates that jaxpr instead of
    # tracing the function again. The numbers are the function's own, bit for bit
    # (diagnostics off: the operator traces the function itself): a checkpointed layer,
    # a custom derivative, has_aux with integer aux and Python numbers (returned as the
    # same Python objects, not the jaxpr's literals), value_with_pullback, and forward mode
    # (value_with_differential, jacobian both ways, hessian, derivative).
    model, x, loss, loss_aux = _replay_cases()
    wrap = jax.jit if jitted else (lambda f: f)

    def run():
        out = [wrap(ft.value_with_gradient(loss))(model, x),
               wrap(ft.value_with_gradient(loss_aux, has_aux=True))(model, x),
               wrap(lambda m, x: ft.gradient(loss, wrt=(0, 1))(m, x))(model, x)]
        value, pullback = ft.value_with_pullback(lambda m: jnp.tanh(m(x)), at=model)
        v = jnp.linspace(-1.0, 2.0, 4)
        f = lambda v: jnp.sin(v) * jnp.sum(v ** 2)  # noqa: E731
        y, differential = ft.value_with_differential(f, at=v)
        forward = [y, differential(jnp.ones(4)), ft.jacobian(f, at=v), ft.jacobian(f, at=v, mode="forward"),
                   ft.hessian(lambda v: jnp.sum(jnp.sin(v) * v ** 3), at=v), ft.derivative(lambda t: f(v * t), at=1.5)]
        return out + [value, pullback(jnp.ones_like(value))] + forward

    _diagnostics._CACHE.clear()
    on = run()
    with ft.config.override(diagnostics=False):
        off = run()
    on_leaves, off_leaves = jax.tree.leaves(on), jax.tree.leaves(off)
    assert jax.tree.structure(on) == jax.tree.structure(off) and len(on_leaves) > 20
    for a, b in zip(on_leaves, off_leaves):  # aux's Python numbers stay Python numbers eagerly
        assert type(a) is type(b) and jnp.result_type(a) == jnp.result_type(b) and np.array_equal(a, b)


@pytest.mark.parametrize("operator", ["gradient", "value_with_pullback", "value_with_differential", "jacobian",
                                      "jacobian_forward", "hessian"])
def test_every_operator_runs_the_functions_python_once(operator):
    calls = itertools.count()  # not a pytree: the closure's key stays the same

    def f(v):
        next(calls)
        return jnp.sum(jnp.sin(v) * v ** 2)

    _diagnostics._CACHE.clear()
    run = {"gradient": lambda v: ft.gradient(f, at=v),
           "value_with_pullback": lambda v: ft.value_with_pullback(f, at=v)[1](1.0),
           "value_with_differential": lambda v: ft.value_with_differential(f, at=v)[1](jnp.ones(3)),
           "jacobian": lambda v: ft.jacobian(f, at=v),
           "jacobian_forward": lambda v: ft.jacobian(f, at=v, mode="forward"),
           "hessian": lambda v: ft.hessian(f, at=v)}[operator]
    jax.jit(run)(jnp.arange(3.0))
    assert next(calls) == 1  # the check's trace, which the operator differentiates
    _diagnostics._CACHE.clear()
    run(jnp.arange(3.0))  # eagerly: the check's trace, then the operator's own run (no replay)
    run(jnp.arange(3.0) + 1)  # the operator's run only
    assert next(calls) == 2 + 2 + 1  # 2 counted above (a run and the count), then 2 runs, then 1


def _counting_compiles():
    """``(count, stop)``: ``count[0]`` the XLA compilations until ``stop()``."""
    count = [0]

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    return count, lambda: jax.monitoring.unregister_event_duration_listener(listen)


def test_eager_differentiation_compiles_the_function_once_as_jax_grad_does():
    """main: the first eager call differentiated the check's jaxpr (its primitives, jnp's
    jitted functions inlined) and the next ones the function's Python (jnp's functions
    compiled whole): the forward pass compiled twice, in two forms (16, then 7 more, for
    this loss). Now eager calls all run the Python, as jax.grad does: nothing compiles
    after the first call, a fresh lambda per call (a notebook cell run again) included,
    and the numbers are jax.grad's bit for bit."""
    rng = np.random.default_rng(1)  # device_put compiles no program (jax.random.normal: one per shape)
    x, y = (jax.device_put(rng.standard_normal(shape).astype(np.float32)) for shape in ((8, 3), (8, 1)))
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    loss = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    _diagnostics._CACHE.clear()
    first = ft.value_with_gradient(lambda m: loss(m), at=model)  # compiles
    count, stop = _counting_compiles()
    try:
        again = [ft.value_with_gradient(lambda m: loss(m), at=model) for _ in range(2)]
        again.append(ft.gradient(lambda m: loss(m), at=model))
        jax.block_until_ready(again)
    finally:
        stop()
    assert count[0] == 0  # main: 7
    expected = jax.value_and_grad(loss)(model)
    for got in (first, *again[:2]):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(again[2]), jax.tree.leaves(expected[1])):
        np.testing.assert_array_equal(a, b)


def test_a_train_steps_loss_runs_once_per_signature():
    # The first step traces the loss once (the check's trace is what is differentiated):
    # the user's Python, and what it prints or counts, runs once per compile.
    model, x, loss, _ = _replay_cases()
    calls = []

    def counted(m, batch):
        calls.append(1)
        return loss(m, batch[0])

    _diagnostics._CACHE.clear()
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    step = ft.train.train_step(counted, opt)
    state = opt.init(model)
    for _ in range(3):
        model, state, _ = step(model, state, (x,))
    assert len(calls) == 1


def test_the_functions_warnings_are_emitted_once_and_errors_stay_errors():
    def noisy(x):
        warnings.warn("from the loss", UserWarning, stacklevel=1)
        return jnp.sum(x ** 2)

    _diagnostics._CACHE.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(ft.gradient(noisy))(jnp.ones(3))
    assert [str(w.message) for w in caught] == ["from the loss"]
    assert caught[0].filename == __file__  # at the line that warned, as Python's warn puts it
    _diagnostics._CACHE.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="from the loss"):
            jax.jit(ft.gradient(noisy))(jnp.ones(4))


def test_a_value_handed_out_through_an_outer_collector_traces_the_function_again():
    # A layer recording into a collector opened outside the differentiated function (the
    # layer closed over, the input differentiated) hands a value out of the check's trace:
    # that jaxpr cannot stand for the function, which is traced again (as before), and the
    # recorded state is the real trace's.
    bn = ft.nn.training(ft.nn.BatchNorm(2))
    x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
    calls = []

    def step(m, x):
        def loss(x):
            calls.append(1)
            return jnp.sum(m(x) ** 2)

        return ft.nn.collect_state(lambda mm: ft.gradient(loss)(x), m)

    _diagnostics._CACHE.clear()
    grads, updates = jax.jit(step)(bn, x)
    assert len(calls) == 2  # the check's trace and the operator's own
    np.testing.assert_allclose(ft.nn.apply_state(bn, updates).running_mean, [0.01, 0.03], rtol=0, atol=1e-7)  # momentum 0.99
    with ft.config.override(diagnostics=False):
        expected = step(bn, x)  # eager: the operator's trace only
    assert len(calls) == 3
    for a, b in zip(jax.tree.leaves((grads, updates)), jax.tree.leaves(expected)):
        assert jnp.result_type(a) == jnp.result_type(b) and np.array_equal(a, b)


def test_an_all_zero_batch_is_data_not_a_known_zero():
    """The batch is baked into the check's trace as a constant; an all-zero one (padding,
    a first batch of zeros) made the weight read as "cannot affect the result" and warned
    (UnusedParameterWarning), cached for every later batch of that shape. An argument is
    data, whatever its values; a closure's zero array still zeroes the weight."""
    model = ft.nn.Dense(3, 2, key=jax.random.key(0))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    for batch in (jnp.zeros((4, 3)), np.zeros((4, 3), np.float32)):
        report = ft.diagnose(loss)(model, batch)
        assert [(a.name, a.status) for a in report.activity] == [("weight", "active"), ("bias", "active")]
        assert not report.findings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ft.gradient(loss)(model, batch)
    zeros = jnp.zeros((4, 3))
    closed = ft.diagnose(lambda m: jnp.sum(m(zeros) ** 2))(model)
    assert dict((a.name, a.status) for a in closed.activity)["weight"] != "active"


def test_an_operation_inside_a_jitted_library_function_is_located_at_the_users_call():
    """jnp.round runs inside jnp's own jit: its equation records no frame of the user's, and
    the warning said "`round` at <unknown>:0" (floor, a plain primitive, named the line)."""
    import inspect

    def f(x):
        return jnp.round(x) * 2.0

    line = inspect.getsourcelines(f)[1] + 1
    with pytest.warns(ft.NonDifferentiableWarning) as record:
        ft.gradient(f, at=1.3)
    message = str(record[0].message)
    assert f"`round` at {__file__}:{line}" in message and "<unknown>" not in message
    assert record[0].filename == __file__ and record[0].lineno == line


def test_a_function_from_no_modules_file_still_warns():
    """A notebook cell's or `python -c`'s function lives in a file no module was loaded from:
    its findings are shown (passing module=None to warn_explicit showed nothing)."""
    namespace: dict[str, Any] = {"jnp": jnp}
    exec(compile("def f(x):\n    return jnp.sqrt(3.0)\n", "<ipython-input-1-abc>", "exec"), namespace)
    with pytest.warns(ft.ZeroDerivativeWarning):
        ft.gradient(namespace["f"], at=jnp.ones(2))
    exec(compile("def g(x):\n    return jnp.round(x).sum()\n", "/tmp/ipykernel_1/2.py", "exec"), namespace)
    with pytest.warns(ft.NonDifferentiableWarning):
        jax.jit(ft.gradient(namespace["g"]))(jnp.ones(2))


def test_a_new_function_of_the_same_code_is_checked_afresh():
    """main: the check's cache was keyed on the code and the closure's abstract values, so a
    re-run cell's fresh lambda warned only the first time, and a factory's function closing
    over a zero mask after one over a ones mask gave no ZeroDerivativeWarning."""

    def make(mask):
        return lambda x: jnp.sum(x * mask)

    def caught(f):
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            ft.gradient(f, at=jnp.ones(2))
        return [type(w.message).__name__ for w in found]

    _diagnostics._CACHE.clear()
    for _ in range(2):  # the same cell run twice: a new lambda each time
        assert caught(lambda x: jnp.sqrt(3.0)) == ["ZeroDerivativeWarning"]
    assert caught(make(jnp.ones(2))) == []
    assert caught(make(jnp.zeros(2))) == ["ZeroDerivativeWarning"]  # main: []
    kept = make(jnp.zeros(2))
    before = len(_diagnostics._CACHE)
    assert caught(kept) == ["ZeroDerivativeWarning"]
    assert caught(kept) == []  # a function kept and called again: checked once
    assert len(_diagnostics._CACHE) == before + 1


class _Gated(ft.Module):
    body: jax.Array
    aux: jax.Array
    gate: Any = ft.field(no_derivative=True, default=1.0)


_GATED = _Gated(jnp.array([0.5, -1.0]), jnp.array([2.0, 0.3]))  # pyright: ignore[reportCallIssue]
_X2 = jnp.array([1.0, 2.0])


def _gated_loss(m, x, aux_weight):
    return jnp.sum(m.body * x) ** 2 + jnp.sum(aux_weight * m.gate * jnp.tanh(m.aux * x))


@pytest.mark.parametrize("weight", [0.0, np.float32(0.0), np.zeros(()), 0, False, np.zeros(2), "keyword", "gate"])
def test_the_calls_numbers_and_numpy_arrays_are_data_not_known_zeros(weight):
    """ft.gradient(loss)(m, x, 0.0) warned "aux ... will always have a zero gradient": a
    Python number enters the trace as a literal and a NumPy array converted (float64 to
    float32), so neither was known as the call's data. A zero written in the function
    (0.0 * ...) still warns."""
    model, grad = _GATED, ft.gradient(_gated_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if isinstance(weight, str) and weight == "keyword":
            out, w = grad(model, _X2, aux_weight=0.0), 0.0
        elif isinstance(weight, str):  # a no_derivative field holding a Python 0.0
            model = _Gated(model.body, model.aux, 0.0)  # pyright: ignore[reportCallIssue]
            out, w = grad(model, _X2, 1.0), 1.0
        else:
            out, w = grad(model, _X2, weight), weight
        report = ft.diagnose(_gated_loss)(model, _X2, w)
    assert [a.status for a in report.activity] == ["active", "active"] and report.ok
    body, aux, x = (np.asarray(a, np.float64) for a in (model.body, model.aux, _X2))
    # d/dbody (body·x)² = 2 (body·x) x; d/daux w·gate·Σ tanh(aux x) = w·gate·(1 - tanh²(aux x)) x (numpy, float64)
    np.testing.assert_allclose(out.body, 2 * (body @ x) * x, rtol=0, atol=1e-6)
    expected_aux = np.asarray(w, np.float64) * float(model.gate) * (1 - np.tanh(aux * x) ** 2) * x
    np.testing.assert_allclose(out.aux, np.broadcast_to(expected_aux, (2,)), rtol=0, atol=1e-6)
    written = lambda m, x, w: jnp.sum(m.body * x) + jnp.sum(w * 0.0 * m.aux)  # noqa: E731
    with pytest.warns(ft.UnusedParameterWarning, match="aux   \\(multiplied by a constant zero\\)"):
        ft.gradient(written)(model, _X2, 0.0 if isinstance(w, bool) else w)  # bool * float: strict promotion


def test_parameters_left_out_by_wrt_are_data_not_known_zeros():
    """Training LoRA's A while B is 0 (its initialisation) warned ZeroDerivativeWarning, a
    ReZero gate alpha = 0 beside wrt="f" too, and ft.diagnose said `f: zero mask`: the
    parameters wrt= leaves out were read as constants of the function."""
    class Lora(ft.Module):
        A: jax.Array
        B: jax.Array
        W: jax.Array

        def __call__(self, x):
            return x @ self.W + (x @ self.A) @ self.B

    class ReZero(ft.Module):
        f: jax.Array
        alpha: jax.Array

        def __call__(self, x):
            return x + self.alpha * jnp.tanh(x @ self.f)

    lora = Lora(jnp.full((2, 3), 0.1), jnp.zeros((3, 2)), jnp.eye(2))  # pyright: ignore[reportCallIssue]
    rezero = ReZero(jnp.eye(2), jnp.array(0.0))  # pyright: ignore[reportCallIssue]
    square = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grad_a = ft.gradient(square, wrt="A")(lora, _X2)
        ft.gradient(square, wrt="f")(rezero, _X2)
        report = ft.diagnose(square, wrt="f")(rezero, _X2)
    assert report.activity == (_diagnostics.LeafActivity("f", "active"),)
    # d/dA Σ y², y = xW + xAB: outer(x, 2y Bᵀ) (numpy, float64): zero while B is 0.
    x, a, b, w = (np.asarray(v, np.float64) for v in (_X2, lora.A, lora.B, lora.W))
    np.testing.assert_allclose(grad_a.A, np.outer(x, 2 * (x @ w + x @ a @ b) @ b.T), rtol=0, atol=0)


class _SpareNet(ft.Module):
    body: jax.Array
    spare: jax.Array  # never read: UnusedParameterWarning

    def __call__(self, x):
        return x @ self.body


def _spare_loss(model, batch, key=None):  # a key: the accumulation loop binds it by a partial
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def test_a_train_steps_warning_names_the_users_loss_and_its_line():
    """A train step's UnusedParameterWarning named `TrainStep.apply.<locals>.loss_fn` at
    functree/optim/_optimizer.py (the optimizer's wrapper): a user's filter by module did
    not match it, and the message named neither the loss nor its argument."""
    model = _SpareNet(jnp.ones((2, 1)), jnp.ones(3))  # pyright: ignore[reportCallIssue]
    batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(_spare_loss, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, opt.init(model), batch)
    (w,) = [w for w in caught if issubclass(w.category, ft.UnusedParameterWarning)]
    assert (w.filename, w.lineno) == (__file__, _line(_spare_loss))
    assert str(w.message).startswith("_spare_loss: 1 parameter(s) of argument 0 (`model`)")
    with warnings.catch_warnings(record=True) as caught:  # a filter by the user's module applies
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=ft.UnusedParameterWarning, module=__name__)
        model = _SpareNet(jnp.ones((2, 1)), jnp.ones(3))  # pyright: ignore[reportCallIssue]
        ft.train.train_step(_spare_loss, opt)(model, opt.init(model), batch)
    assert not [w for w in caught if issubclass(w.category, ft.DifferentiationWarning)]


def test_a_train_steps_overridden_compute_loss_is_the_function_named():
    class Penalised(ft.train.TrainStep):
        def compute_loss(self, model, batch, key=None):
            loss, aux = super().compute_loss(model, batch, key)
            return loss + 1e-3 * jnp.sum(model.body ** 2), aux

    model = _SpareNet(jnp.ones((2, 1)), jnp.ones(3))  # pyright: ignore[reportCallIssue]
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Penalised(_spare_loss, opt)(model, opt.init(model), (jnp.ones((4, 2)), jnp.ones((4, 1))))
    (w,) = [w for w in caught if issubclass(w.category, ft.UnusedParameterWarning)]
    assert (w.filename, w.lineno) == (__file__, _line(Penalised.compute_loss))
    assert "Penalised.compute_loss: 1 parameter(s) of argument 0 (`model`)" in str(w.message)


def test_a_stopped_output_does_not_silence_an_argument_no_output_reads():
    """A pullback of (a·x, without_derivative(sin x)) with respect to (a, b): b reaches no
    output, and the marked second output silenced its ZeroDerivativeWarning."""
    def two_outputs(a, b):
        return a * X3, ft.without_derivative(at=jnp.sin(X3))

    report = ft.diagnose(two_outputs, wrt=(0, 1))(X3, X3)
    assert [f.category for f in report.findings] == [ft.ZeroDerivativeWarning]
    assert "argument 1 (`b`)" in report.findings[0].message
    def only_stopped(a):  # the whole result stopped: intentional, silent
        return ft.without_derivative(at=jnp.sin(X3)), ft.without_derivative(at=jnp.cos(X3))

    assert ft.diagnose(only_stopped)(X3).ok


def test_a_parameter_that_loses_its_weak_type_is_not_checked_again():
    """An eager loop warned twice: `jnp.asarray(0.1)` is weakly typed, ft.move's result is
    not, and the new abstract signature was checked (and warned) again at step 2."""
    class Gate(ft.Module):
        w: jax.Array
        spare: jax.Array

    def loss(m, x):
        return jnp.sum(m.w * x)

    model = Gate(jnp.ones(2), jnp.asarray(0.1))  # pyright: ignore[reportCallIssue]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            g = ft.gradient(loss)(model, jnp.ones(2))
            model = ft.move(model, along=ft.tangent_scale(g, -0.1))
    assert [w.category for w in caught] == [ft.UnusedParameterWarning]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_train_steps_unused_warning_shows_the_optimizers_wrt(accumulate):
    """The fix a train step's UnusedParameterWarning shows is the optimizer's wrt= (the
    step's loss is no ft.gradient of the user's), which silences it."""
    model = _SpareNet(jnp.ones((2, 1)), jnp.ones(3))  # pyright: ignore[reportCallIssue]
    batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=accumulate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ft.train.train_step(_spare_loss, opt)(model, opt.init(model), batch, key=jax.random.key(0))
    (w,) = [w for w in caught if issubclass(w.category, ft.UnusedParameterWarning)]
    assert "argument 0 (`model`)" in str(w.message)
    assert 'right:  ft.optim.Optimizer(transform, wrt="body")' in str(w.message)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="body", accumulate=accumulate)
    model = _SpareNet(jnp.ones((2, 1)), jnp.ones(3))  # pyright: ignore[reportCallIssue]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.train.train_step(_spare_loss, opt)(model, opt.init(model), batch, key=jax.random.key(0))
