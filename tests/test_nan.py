"""NaN provenance (functree/_nan.py): the catalogue of non-finite programs, the ones that
must not be reported, the report's form, and the Trainer's use of it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import functree as ft
from functree.train._provenance import (
    ANALYSIS_FAILED,
    FINITE_AGAIN,
    LATER_MODEL,
    provenance_for_step,
    step_report,
)


def _line(fn: Callable, marker: str) -> int:
    """The line number of the one source line of ``fn`` that contains ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + k for k, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def _check(report: ft.NaNReport, fn: Callable, marker: str, primitive: str, phase: str) -> None:
    assert report.kind == "operation", report
    assert (report.primitive, report.phase) == (primitive, phase), report
    assert report.file == os.path.abspath(__file__)
    assert report.line == _line(fn, marker), report
    assert report.where == f"test_nan.py:{_line(fn, marker)}"


# ----------------------------------------------------------------------------- catalogue


def _log_of_zero(w):
    return jnp.sum(jnp.log(w))  # <- log


def test_log_of_zero_is_the_forward_log():
    report = ft.diagnose(_log_of_zero, at=jnp.array([1.0, 0.0]), nan=True)
    _check(report, _log_of_zero, "<- log", "log", "forward")
    assert report.value == "-inf (1 of 2 elements)"
    assert report.parameters == ("<root>",)


def _sqrt(w):
    return jnp.sum(jnp.sqrt(w))  # <- sqrt


def test_sqrt_at_zero_has_a_finite_value_and_an_infinite_derivative():
    w = jnp.array([0.0, 4.0])
    assert np.isfinite(float(_sqrt(w)))
    report = ft.diagnose(_sqrt, at=w, nan=True)
    _check(report, _sqrt, "<- sqrt", "sqrt", "backward")
    assert report.value == "inf (1 of 2 elements)"
    assert "the derivative of `sqrt`" in report.summary()


def _normalize(x):
    n = jnp.linalg.norm(x)
    return jnp.sum(x / n)  # <- div


def test_division_by_a_zero_norm():
    _check(ft.diagnose(_normalize, at=jnp.zeros(3), nan=True), _normalize, "<- div", "div", "forward")


def _exp_overflow(w):
    return jnp.mean(jnp.exp(w * 100.0))  # <- exp


def test_overflow_in_exp():
    report = ft.diagnose(_exp_overflow, at=jnp.array([0.1, 1.0]), nan=True)
    _check(report, _exp_overflow, "<- exp", "exp", "forward")
    assert report.value == "inf (1 of 2 elements)"


def _masked_softmax(logits):
    z = jnp.where(logits > 0, logits, -jnp.inf)  # masked: an intentional -inf
    return jnp.sum(jax.nn.softmax(z, axis=-1)[:, 0])  # <- softmax


def test_softmax_of_an_all_minus_inf_row_is_the_subtraction_of_infinities():
    logits = jnp.array([[1.0, 2.0], [-1.0, -2.0]])  # second row all masked
    report = ft.diagnose(_masked_softmax, at=logits, nan=True)
    _check(report, _masked_softmax, "<- softmax", "sub", "forward")
    assert report.value.startswith("nan")


def test_a_partly_masked_softmax_is_finite():
    assert ft.diagnose(_masked_softmax, at=jnp.array([[1.0, -2.0], [3.0, 2.0]]), nan=True).ok


def _mse(model, batch):
    x, y = batch
    return jnp.mean((x @ model["w"] - y) ** 2)


def test_a_nan_in_the_batch_is_named_as_that_input():
    batch = (jnp.array([[1.0], [jnp.nan]]), jnp.zeros(2))
    report = ft.diagnose(_mse, nan=True)({"w": jnp.ones(1)}, batch)
    assert (report.kind, report.phase, report.argument) == ("input", "input", 1)
    assert report.path == "argument 1 (`batch`, key path 0)"
    assert report.primitive is None and report.value == "nan (1 of 2 elements)"


def test_a_nan_in_a_parameter_is_named_by_key_path():
    model = {"encoder": {"w": jnp.array([jnp.inf])}}
    report = ft.diagnose(lambda m, b: jnp.sum(m["encoder"]["w"] * b), nan=True)(model, jnp.ones(1))
    assert (report.kind, report.argument) == ("input", 0)
    assert report.path == "argument 0 (`m`, key path encoder.w)"


def _scan_log(x):
    def body(carry, a):
        return carry + jnp.log(a * carry), None  # <- scan log

    total, _ = lax.scan(body, 1.0, x)
    return total


def test_inside_a_scan_body():
    report = ft.diagnose(_scan_log, at=jnp.array([1.0, 2.0, 0.0, 3.0]), nan=True)
    _check(report, _scan_log, "<- scan log", "log", "forward")
    assert report.context == ("scan iteration 2 of 4",)


def _scan_sqrt(x):
    def body(carry, a):
        return carry + jnp.sqrt(a), None  # <- scan sqrt

    total, _ = lax.scan(body, 0.0, x)
    return total


def test_inside_a_scan_body_backward():
    report = ft.diagnose(_scan_sqrt, at=jnp.array([1.0, 0.0, 4.0]), nan=True)
    _check(report, _scan_sqrt, "<- scan sqrt", "sqrt", "backward")
    assert report.context == ("scan iteration 1 of 3",)


def _checkpointed(x):
    @jax.checkpoint
    def block(h):
        return jnp.exp(h * 1000.0)  # <- remat exp

    return jnp.sum(block(x))


def test_inside_a_checkpoint_body():
    report = ft.diagnose(_checkpointed, at=jnp.array([0.0, 1.0]), nan=True)
    _check(report, _checkpointed, "<- remat exp", "exp", "forward")
    assert report.context == ("jax.checkpoint",)


def _checkpointed_backward(x):
    block = jax.checkpoint(lambda h: jnp.sqrt(h))  # <- remat sqrt
    return jnp.sum(block(x))


def test_inside_a_checkpoint_body_backward():
    report = ft.diagnose(_checkpointed_backward, at=jnp.array([0.0, 1.0]), nan=True)
    _check(report, _checkpointed_backward, "<- remat sqrt", "sqrt", "backward")


def _per_row_normalize(x):
    return jnp.sum(jax.vmap(lambda r: r / jnp.sqrt(jnp.sum(r * r)))(x))  # <- vmap


def test_under_vmap():
    x = jnp.array([[1.0, 2.0], [0.0, 0.0]])
    _check(ft.diagnose(_per_row_normalize, at=x, nan=True), _per_row_normalize, "<- vmap", "div",
           "forward")


def _jitted_log(x):
    return jnp.sum(jax.jit(lambda y: jnp.log(y - 1.0))(x))  # <- jit log


def test_inside_a_jit_call():
    report = ft.diagnose(_jitted_log, at=jnp.array([0.5, 2.0]), nan=True)
    _check(report, _jitted_log, "<- jit log", "log", "forward")
    assert report.context == ("jit(<lambda>)",)


def _branchy(x):
    return lax.cond(x[0] > 0, lambda y: jnp.sum(jnp.log(y)), lambda y: jnp.sum(y), x)  # <- cond


def test_inside_the_branch_a_cond_takes():
    _check(ft.diagnose(_branchy, at=jnp.array([1.0, -1.0]), nan=True), _branchy, "<- cond", "log",
           "forward")
    assert ft.diagnose(_branchy, at=jnp.array([-1.0, -1.0]), nan=True).ok


@jax.custom_jvp
def _root(x):
    return jnp.sqrt(x)


@_root.defjvp
def _root_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sqrt(x), t / (2.0 * jnp.sqrt(x))


@jax.custom_jvp
def _logged(x):
    return jnp.log(x)  # <- custom body


@_logged.defjvp
def _logged_jvp(primals, tangents):
    return _logged(primals[0]), tangents[0] / primals[0]


def _custom(x):
    return jnp.sum(_root(x))  # <- custom root


def test_through_a_custom_jvp():
    """Forward inside the body; backward the custom rule as a whole, at the user's call."""
    _check(ft.diagnose(_custom, at=jnp.array([0.0, 4.0]), nan=True), _custom, "<- custom root",
           "custom_jvp_call", "backward")
    report = ft.diagnose(lambda x: jnp.sum(_logged(x)), at=jnp.array([0.0, 4.0]), nan=True)
    _check(report, _logged, "<- custom body", "log", "forward")
    assert report.context == ("custom_jvp",)


@jax.custom_vjp
def _clipped(x):
    return jnp.log(x)  # <- vjp body


def _clipped_fwd(x):
    return jnp.log(x), x


def _clipped_bwd(x, g):
    return (g / x,)


_clipped.defvjp(_clipped_fwd, _clipped_bwd)


def _uses_custom_vjp(x):
    return jnp.sum(_clipped(x + 1.0))  # <- vjp call


def test_through_a_custom_vjp():
    report = ft.diagnose(_uses_custom_vjp, at=jnp.array([-1.0, 1.0]), nan=True)
    _check(report, _clipped, "<- vjp body", "log", "forward")
    assert report.context == ("custom_vjp",)
    exp_of_log = ft.diagnose(lambda x: jnp.sum(jnp.exp(_clipped(x))), at=jnp.array([0.0, 1.0]), nan=True)
    assert (exp_of_log.primitive, exp_of_log.phase) == ("custom_vjp_call", "backward")


def _while_log(x):
    def body(state):
        i, total = state
        return i + 1, total + jnp.log(x[i])  # <- while log

    return lax.while_loop(lambda s: s[0] < x.shape[0], body, (0, 0.0))[1]


def test_inside_a_while_loop_forward():
    report = ft.diagnose(_while_log, at=jnp.array([1.0, 0.0]), nan=True)
    _check(report, _while_log, "<- while log", "log", "forward")
    assert report.context == ("while iteration 1",)


def test_an_empty_scan():
    def loss(x):
        total, ys = lax.scan(lambda c, a: (c + a, a * 2.0), 0.0, x)
        return total + jnp.sum(ys) + jnp.log(jnp.sum(x))

    assert ft.diagnose(loss, at=jnp.zeros(0), nan=True).primitive == "log"


def _where_trap(x):
    return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))  # <- where trap


def test_the_where_trap_is_the_derivative_of_the_guarded_log():
    """The forward is finite (the -inf is masked); the gradient is 0 · (1/0) = NaN.

    docs/guides/debugging-nans.md says so: "the derivative of `log`" (nan), not of `sqrt`.
    """
    x = jnp.array([0.0, 1.0])
    assert np.isfinite(float(_where_trap(x)))
    report = ft.diagnose(_where_trap, at=x, nan=True)
    _check(report, _where_trap, "<- where trap", "log", "backward")
    assert report.value == "nan (1 of 2 elements)"
    assert "the derivative of `log`" in report.summary()


# ----------------------------------------------------------------------------- must not report


def _safe_log(x):
    safe = jnp.where(x > 0, x, 1.0)
    return jnp.sum(jnp.where(x > 0, jnp.log(safe), 0.0))


def _safe_norm(x):
    squared = jnp.sum(x * x)
    safe = jnp.where(squared > 0, squared, 1.0)
    return jnp.where(squared > 0, jnp.sqrt(safe), 0.0)


def _masked_logsumexp(x):
    return jax.nn.logsumexp(jnp.where(x > 0, x, -jnp.inf))


@pytest.mark.parametrize("fn", [_safe_log, _safe_norm, _masked_logsumexp, _exp_overflow])
def test_finite_programs_report_nothing(fn):
    report = ft.diagnose(fn, at=jnp.array([0.0, 0.02]), nan=True)
    assert report.ok and report.kind is None and report.primitive is None
    assert str(report) == f"NaNReport: {fn.__name__}: loss and gradient are finite"


def test_a_non_finite_input_that_never_reaches_the_loss_is_not_reported():
    report = ft.diagnose(lambda w, b: jnp.sum(w * b[0]), nan=True)(jnp.ones(2), (jnp.ones(2), jnp.nan))
    assert report.ok


# ----------------------------------------------------------------------------- key paths


class _Net(ft.Module):
    encoder: ft.nn.Dense
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.encoder(x))


def _net_loss(net, x):
    h = net.encoder(x)
    return jnp.mean(jnp.log(h)) + jnp.mean(net(x))  # <- net log


def test_forward_names_the_parameters_it_depends_on():
    net = _Net(ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.Dense(3, 1, key=jax.random.key(1)))
    report = ft.diagnose(_net_loss, nan=True)(net, -jnp.ones((4, 2)) * 10.0)
    _check(report, _net_loss, "<- net log", "log", "forward")
    assert report.parameters == ("encoder.weight", "encoder.bias")
    assert report.inputs == ("x",)


def _two_parameters(p):
    return jnp.sqrt(p["a"]) + p["b"] ** 2  # <- two


def test_backward_names_the_parameters_whose_gradient_it_feeds():
    report = ft.diagnose(_two_parameters, at={"a": jnp.zeros(()), "b": jnp.ones(())}, nan=True)
    _check(report, _two_parameters, "<- two", "sqrt", "backward")
    assert report.parameters == ("a",)


def test_wrt_and_has_aux():
    def loss(p, x):
        return jnp.sum(jnp.sqrt(p["a"] * x)) + jnp.sum(p["b"]), {"x": x}

    p = {"a": jnp.ones(2), "b": jnp.ones(2)}
    assert ft.diagnose(loss, wrt="b", has_aux=True, nan=True)(p, jnp.zeros(2)).ok
    report = ft.diagnose(loss, wrt="a", has_aux=True, nan=True)(p, jnp.zeros(2))
    assert (report.primitive, report.phase, report.parameters) == ("sqrt", "backward", ("a",))


# ----------------------------------------------------------------------------- the record


def test_the_report_prints_and_renders():
    report = ft.diagnose(_log_of_zero, at=jnp.array([1.0, 0.0]), nan=True)
    line = _line(_log_of_zero, "<- log")
    assert str(report).splitlines() == [
        f"NaNReport: _log_of_zero: `log` first produced -inf (1 of 2 elements) at "
        f"test_nan.py:{line} (forward pass)",
        f"  line:       {os.path.abspath(__file__)}:{line}",
        "  depends on: <root>",
    ]
    assert repr(report) == str(report)
    page = report._repr_html_()
    assert "<table>" in page and "<code>log</code>" in page and "&lt;root&gt;" in page


def test_a_constant_non_finite_loss():
    report = ft.diagnose(lambda w: jnp.sum(w) * 0.0 + jnp.nan, at=jnp.ones(2), nan=True)
    assert (report.kind, report.primitive) == ("operation", "add")
    report = ft.diagnose(lambda w: (jnp.float32(jnp.inf), w), at=jnp.ones(2), has_aux=True, nan=True)
    assert (report.kind, report.note) == ("unknown", "the loss is a non-finite constant: it is computed from no argument")
    assert str(report).endswith("note: the loss is a non-finite constant: it is computed from no argument")


def test_non_array_leaves_are_carried():
    def loss(p, scale, name):
        return jnp.sum(jnp.log(p * scale)) if name == "log" else jnp.sum(p)

    assert ft.diagnose(loss, nan=True)(jnp.ones(2), 2, "log").ok
    report = ft.diagnose(loss, nan=True)(jnp.ones(2), 0, "log")
    assert report.primitive == "log"


# ----------------------------------------------------------------------------- training


def _train_loss(model, batch):
    x, y = batch
    return jnp.mean((jnp.log(x @ model["w"]) - y) ** 2)  # <- train log


def test_a_stopped_trainer_names_the_operation_and_line():
    x = np.ones((8, 1), np.float32)
    x[5] = -1.0  # the sixth example: step 3 with batches of 2
    trainer = ft.train.Trainer({"w": jnp.ones(1)}, ft.optim.sgd(0.01), _train_loss)
    data = ft.train.batches((x, np.zeros(8, np.float32)), 2, shuffle=False)
    with pytest.raises(ft.train.NonFiniteError) as info:
        trainer.fit(data, progress=False)
    message = str(info.value)
    line = _line(_train_loss, "<- train log")
    assert message.startswith("Training stopped at step 3: ")
    assert f"`log` first produced nan (1 of 2 elements) at test_nan.py:{line}" in message
    assert "(forward pass at step 3)" in message and "depends on: w" in message
    report = trainer.nan_report
    assert (report.primitive, report.line, report.step) == ("log", line, 3)


def test_a_parameter_made_infinite_by_an_update_is_named_by_key_path_and_step():
    def loss(model, batch):
        return jnp.mean((batch * model["layer"]["w"] - 1.0) ** 2)

    # Step 1 is finite, but its update overflows: w = 1 - 1e36 · 2e5 = -inf in float32.
    trainer = ft.train.Trainer({"layer": {"w": jnp.ones(())}}, ft.optim.sgd(1e36), loss)
    with pytest.raises(ft.train.NonFiniteError, match="step 2") as info:
        trainer.fit([jnp.full(4, 100.0)] * 3, progress=False)
    report = trainer.nan_report
    assert (report.kind, report.argument, report.step) == ("input", 0, 2)
    assert report.path == "argument 0 (`model`, key path layer.w)"
    assert "argument 0 (`model`, key path layer.w) holds -inf at step 2" in str(info.value)


def test_skipped_steps_keep_the_first_provenance():
    def loss(model, batch, *, key):
        noise = 0.0 * jax.random.normal(key, batch.shape)
        return jnp.mean(jnp.sqrt(model["w"][None, :] * batch + noise))  # <- skip sqrt

    x = np.ones((12, 1), np.float32)
    x[[4, 9]] = 0.0
    trainer = ft.train.Trainer({"w": jnp.ones(1)}, ft.optim.sgd(0.01), loss, key=jax.random.key(0),
                               on_nan="skip")
    trainer.fit(ft.train.batches(x, 1, shuffle=False), progress=False, log_every=5)
    assert [s for s, _ in trainer.skipped] == [5, 10]
    report = trainer.nan_report
    assert (report.primitive, report.phase, report.step) == ("sqrt", "backward", 5)
    assert report.line == _line(loss, "<- skip sqrt")
    # The Trainer reads the window of steps 1-5 at step 10 (one interval late, so the read
    # never waits for queued steps): the model it replays with is 4 applied steps later.
    assert report.note == "analysed with the model after 4 later step(s): the model before a skipped step is not kept"


def test_a_one_shot_iterator_is_diagnosed_from_the_batch_in_flight():
    # A DataLoader-like iterator cannot be read again: the Trainer keeps references to the
    # batches of the steps in flight, so the failing step's batch is at hand.
    trainer = ft.train.Trainer({"w": jnp.ones(1)}, ft.optim.sgd(0.1), lambda m, b: jnp.sum(jnp.log(m["w"] * b)))
    with pytest.raises(ft.train.NonFiniteError, match="`log` first produced -inf") as info:
        trainer.fit(iter([jnp.ones(1), jnp.zeros(1)]), progress=False)
    assert info.value.report.step == 2 and trainer.nan_report is info.value.report


def test_provenance_for_step_runs_layer_state_and_keys():
    model = ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2))
    model = ft.nn.training(model)

    def loss(m, b, *, key):
        return jnp.mean(jnp.log(m(b) + jax.random.uniform(key, (2,))[None, :] * 0.0)), {"n": b.shape[0]}

    report = provenance_for_step(loss, model, jnp.ones((4, 2)), jax.random.key(1))
    assert report is not None and (report.primitive, report.phase) == ("log", "forward")
    assert provenance_for_step(lambda m, b: jnp.sum(m["w"] * b), {"w": jnp.ones(2)}, jnp.ones(2)) is None


def test_a_failed_analysis_is_a_note_not_an_error():
    def loss(m, b):
        if b.shape[0] > 1:
            raise RuntimeError("boom")
        return jnp.sum(m["w"] * b)

    report = provenance_for_step(loss, {"w": jnp.ones(2)}, jnp.ones((2, 2)))
    assert (report.kind, report.note) == ("unknown", ANALYSIS_FAILED.format(error="RuntimeError: boom"))


def test_a_step_finite_when_run_again_and_a_later_model_are_said():
    data = [jnp.ones(2), jnp.zeros(2)]
    trainer = ft.train.Trainer({"w": jnp.ones(2)}, ft.optim.sgd(0.1), lambda m, b: jnp.sum(jnp.log(m["w"] * b)),
                               on_nan="skip")
    trainer.fit(data, progress=False)
    assert [s for s, _ in trainer.skipped] == [2] and trainer.nan_report.primitive == "log"
    loss = trainer.train_step.loss_fn
    assert step_report(loss, trainer.model, data[0], None, step=1).note == FINITE_AGAIN.format(step=1)
    assert step_report(loss, trainer.model, data[1], None, step=2, applied_after=3).note == LATER_MODEL.format(count=3)


# ------------------------------------------------------------------ jnp's jitted functions, keywords

_CONSTANT_ROW = (jnp.eye(2), jnp.array([[1.0, 2.0], [3.0, 3.0]]))  # row 1 has zero variance


def _standardized(w, x):
    h = x @ w
    z = (h - h.mean(-1, keepdims=True)) / (jnp.std(h, axis=-1, keepdims=True) + 1e-5)  # <- std
    return jnp.sum(z ** 2)


def _norms(w, x):
    return jnp.sum(jnp.linalg.norm(x @ w, axis=-1))  # <- norm


def test_a_nan_gradient_through_std_is_the_derivative_of_its_sqrt_at_the_users_line():
    """jnp.std of a constant row: the gradient is NaN and the report said
    "`convert_element_type` first produced nan at <unknown> (forward pass)", blaming the
    NaN literal jnp.var masks away where ddof leaves no degree of freedom."""
    h = np.asarray(_CONSTANT_ROW[1]) @ np.asarray(_CONSTANT_ROW[0])
    variance = h.var(-1)  # numpy: row 1 exactly 0, where d√v/dv = 1 / (2√v) is infinite
    with np.errstate(divide="ignore"):
        assert variance[1] == 0 and np.isinf(1.0 / (2 * np.sqrt(variance[1])))
    assert not np.isfinite(np.asarray(jax.grad(_standardized)(*_CONSTANT_ROW))).all()
    report = ft.diagnose(_standardized, nan=True)(*_CONSTANT_ROW)
    _check(report, _standardized, "<- std", "sqrt", "backward")
    assert report.parameters == ("<root>",) and "nan" in report.value


def test_an_operation_inside_jnps_jitted_function_is_located_at_the_users_call():
    """jnp.linalg.norm of a zero row: its sqrt runs inside jit(norm), whose equations record
    no frame of the user's; the report said `at <unknown>` and `line: :0`."""
    x = jnp.array([[1.0, 2.0], [0.0, 0.0]])
    # d‖r‖/dr = r/‖r‖: 0/0 at the zero row (numpy: the same division, non-finite).
    with np.errstate(invalid="ignore", divide="ignore"):
        assert not np.isfinite(np.asarray(x) / np.linalg.norm(np.asarray(x), axis=-1, keepdims=True)).all()
    report = ft.diagnose(_norms, nan=True)(jnp.eye(2), x)
    _check(report, _norms, "<- norm", "sqrt", "backward")
    assert report.context == ("jit(norm)",) and "<unknown>" not in str(report)


def _masked(w, x, mask=None):
    return jnp.sum(w * x * mask)


def test_a_nan_passed_by_keyword_is_named_as_that_argument():
    """loss(w, x, mask=bad) said "`mul` first produced nan": keyword leaves were not inputs."""
    w, x, bad = jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0]), jnp.array([1.0, jnp.nan])
    positional = ft.diagnose(_masked, nan=True)(w, x, bad)
    report = ft.diagnose(_masked, nan=True)(w, x, mask=bad)
    assert report == positional
    assert (report.kind, report.argument, report.path) == ("input", 2, "argument 2 (`mask`)")
    assert report.value == f"nan ({int(np.isnan(np.asarray(bad)).sum())} of 2 elements)"
    unnamed = ft.diagnose(lambda w, **kw: jnp.sum(w * kw["m"]["a"]), nan=True)(w, m={"a": bad})
    assert (unnamed.argument, unnamed.path) == (None, "keyword argument `m` (key path a)")
