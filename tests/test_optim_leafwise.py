"""The gated update leaf by leaf (functree/optim/_leafwise.py): the same numbers as the one
large ``cond``, one small ``cond`` per parameter in the compiled step, and the one large
``cond`` wherever the transform or the optimizer is not declared separable."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close_trained

import functree as ft
import functree.optim._leafwise as leafwise
from functree.optim._leafwise import is_separable, separable
from functree.optim._optimizer import Gradients


def _model():
    return ft.nn.Sequential([ft.nn.Dense(3, 8, key=jax.random.key(0)), ft.nn.LayerNorm(8), jax.nn.relu,
                             ft.nn.Dense(8, 1, key=jax.random.key(1))])


def _loss(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def _batch():
    return jax.random.normal(jax.random.key(2), (16, 3)), jax.random.normal(jax.random.key(3), (16, 1))


def _conditionals(opt, on_nan="skip", model=None) -> int:
    """``cond`` equations in the step's jaxpr."""
    model = _model() if model is None else model
    with jax.numpy_dtype_promotion("standard"):
        jaxpr = jax.make_jaxpr(lambda m, s, b: opt.step(_loss, m, s, (b,), on_nan=on_nan)[:2])(
            model, opt.init(model), _batch())
    return sum(e.primitive.name == "cond" for e in jaxpr.jaxpr.eqns)


def _expected_conditionals(model=None) -> int:
    """One ``cond`` per parameter on the CPU, the one large ``cond`` on every other backend
    (functree/optim/_leafwise.py: an accelerator has no thread pool to spare the hand-off)."""
    model = _model() if model is None else model
    return len(jax.tree.leaves(ft.parameters(model))) if jax.default_backend() == "cpu" else 1


@pytest.fixture(params=["gpu", "tpu"])
def faked_accelerator(request, monkeypatch):
    """``jax.default_backend()`` answering an accelerator (the step still compiles for this
    device): what the leafwise update asks while the step traces."""
    monkeypatch.setattr(jax, "default_backend", lambda: request.param)
    return request.param


def _three_steps(opt, enabled: bool):
    """Open gate, closed gate (a NaN gradient), open gate, from given gradients: the model
    and state after each (the update half of the step alone: a small program)."""
    leafwise.ENABLED = enabled
    try:
        model = _model()
        params = ft.parameters(model)
        grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1.5)), params) for k in range(3)]
        grads[1] = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads[1])
        loss = jnp.float32(1.0)

        @jax.jit
        def run(model, state):
            trail = []
            for g in grads:
                g = Gradients(loss, loss, g, {})
                model, state = opt.apply_step(g, model, state, minibatch_size=4, on_nan="skip")[:2]
                trail.append((model, state))
            return trail

        return run(model, opt.init(model))
    finally:
        leafwise.ENABLED = True


# (name, transform, bit for bit): one of each kind (momentum and L2, masks by key path,
# centred moments, bias correction); every function and form was compared the same way
# when this was written (sgd, rmsprop, adagrad, adadelta and lion bit for bit; adam, adamw,
# adamax, amsgrad and radam within one rounding). The bias-corrected optimizers compute 1 - β^t in each
# parameter's branch, where XLA fuses it into other kernels than in the one large cond: the
# results differ by float32 rounding (measured: at most 1.2e-7 of the values' size, one ulp,
# the same as between the gated and the ungated step before). The others are bit for bit.
ALIASES = [
    ("sgd-nesterov-l2", ft.optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=0.1), True),
    ("rmsprop-centered", ft.optim.rmsprop(0.05, centered=True, momentum=0.5), True),
    ("lion-masked-decay", ft.optim.lion(0.05, weight_decay=0.1), True),
    ("adamw", ft.optim.adamw(0.05), False),
    ("amsgrad", ft.optim.amsgrad(0.05), False),
]
SPREAD = 1.2e-7  # the measured scaled error of the bias-corrected optimizers (see above)


@pytest.mark.parametrize("tx,exact", [(tx, exact) for _, tx, exact in ALIASES], ids=[a[0] for a in ALIASES])
def test_optimizer_functions_give_the_one_cond_numbers(tx, exact):
    opt = ft.optim.Optimizer(tx)
    assert _conditionals(opt) == _expected_conditionals()  # on the CPU one per parameter: 6
    ours, reference = _three_steps(opt, True), _three_steps(opt, False)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        if exact:
            for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=f"step {i + 1}")
        else:
            assert_close_trained(a, b, spread=SPREAD, err_msg=f"step {i + 1}")
    # The closed gate (step 2) returned step 1's model and state, bit for bit.
    for u, v in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(ours[0])):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert int(ft.optim.context(ours[2][1]).step) == 2


def _kernels(computation: str) -> int:
    return len(re.findall(r"= \S+ (?:fusion|copy|dot|custom-call|dynamic-update-slice)\(", computation))


def _compiled_step_text() -> str:
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    model = _model()
    step = ft.train.train_step(_loss, opt)  # on_nan="stop", the default
    return step.lower(model, opt.init(model), _batch()).compile().as_text()


def _check_the_compiled_step(text: str) -> None:
    """On the CPU: Adam's parameter branches each write the parameter and its two moments
    (one kernel each, plus the bias corrections' scalars): few enough that XLA:CPU runs them
    in order, in place. Elsewhere: no conditional per parameter (the one large ``cond``, or
    none where the backend's compiler turned it into selects)."""
    conditionals = len(re.findall(r" conditional\(", text))
    if jax.default_backend() != "cpu":
        assert conditionals <= 1, conditionals
        return
    assert conditionals == 6  # one per parameter
    computations = {c.split(" ", 1)[0].lstrip("%"): c for c in re.split(r"\n(?=%|ENTRY)", text)}
    branches = [name.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", text)
                for name in group.split(",")]
    assert len(branches) == 2 * 6  # (keep, apply) per parameter
    assert max(_kernels(computations[b]) for b in branches) <= 6


def test_the_compiled_step_runs_a_few_kernels_per_parameter_branch():
    _check_the_compiled_step(_compiled_step_text())


def test_every_backend_but_the_cpu_keeps_the_one_cond(faked_accelerator):
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    assert _conditionals(opt) == _expected_conditionals() == 1
    text = _compiled_step_text()  # compiled for the real device
    if jax.devices()[0].platform == "cpu":  # XLA:CPU keeps the one large conditional
        assert len(re.findall(r" conditional\(", text)) == 1
    _check_the_compiled_step(text)


@pytest.mark.parametrize("make", [
    lambda: ft.optim.Optimizer(optax.adam(1e-3)),  # optax's own: not declared
    lambda: ft.optim.Optimizer(optax.chain(optax.clip_by_global_norm(1.0), ft.optim.adam(1e-3))),
    lambda: ft.optim.Optimizer(ft.optim.skip_non_finite(ft.optim.adam(1e-3))),
    lambda: ft.optim.Optimizer(ft.optim.adam(1e-3), average=ft.optim.ema(0.9)),
    lambda: ft.optim.Optimizer(ft.optim.adam(1e-3), wrt="layers.0.*"),
    lambda: ft.optim.Optimizer(ft.optim.adam(1e-3), apply_updates=lambda m, u: ft.move(m, along=u)),
    lambda: ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.adam(1e-3))),
], ids=["optax", "chain", "skip_non_finite", "average", "wrt", "apply_updates", "wrapper"])
def test_anything_not_declared_separable_keeps_the_one_cond(make):
    assert _conditionals(make()) == 1


def test_complex_parameters_keep_the_one_cond():
    model = {"z": jnp.ones(2, jnp.complex64), "w": jnp.ones(2)}
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    with jax.numpy_dtype_promotion("standard"):
        jaxpr = jax.make_jaxpr(lambda m, s: opt.step(lambda m: jnp.sum(jnp.abs(m["z"]) ** 2 + m["w"]), m, s, (),
                                                     on_nan="skip")[:2])(model, opt.init(model))
    assert sum(e.primitive.name == "cond" for e in jaxpr.jaxpr.eqns) == 1


def test_more_parameters_than_the_limit_keep_the_one_cond():
    model = {f"w{i:02d}": jnp.ones(2) for i in range(leafwise.MAX_PARAMETERS + 1)}
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    with jax.numpy_dtype_promotion("standard"):
        jaxpr = jax.make_jaxpr(lambda m, s: opt.step(lambda m: sum(jnp.sum(w) for w in m.values()), m, s, (),
                                                     on_nan="skip")[:2])(model, opt.init(model))
    assert sum(e.primitive.name == "cond" for e in jaxpr.jaxpr.eqns) == 1


def test_the_ungated_step_has_no_conditional():
    assert _conditionals(ft.optim.Optimizer(ft.optim.adam(1e-3)), on_nan="ignore") == 0


def test_separable_is_declared_not_guessed():
    assert is_separable(ft.optim.adam()) and is_separable(ft.optim.adamw()) and is_separable(ft.optim.sgd())
    assert not is_separable(optax.adam(1e-3))
    assert not is_separable(optax.chain(ft.optim.adam()))
    assert not is_separable(object())
    tx = optax.sgd(0.1)
    assert separable(tx) is tx and is_separable(tx)


@pytest.mark.parametrize("tx", [ft.optim.adam(1e-2), ft.optim.skip_non_finite(ft.optim.adam(1e-2))],
                         ids=["adam", "skip_non_finite"])
def test_eager_gated_steps_compile_nothing_after_the_first(tx):
    """An eager opt.step(on_nan="skip") compiled its lax.conds again at every step (one per
    parameter, or one around the update: 1-1.2 s a step on 4 parameters), their branches
    fresh closures. Eagerly the gate is known: the branch it takes runs. The same steps as
    the jitted one (float32 rounding), and a NaN batch leaves model and state bit for bit."""
    from _compiles import compiled

    opt = ft.optim.Optimizer(tx)
    model, batch = ft.nn.Dense(3, 1, key=jax.random.key(0)), _batch()  # (two parameters: the first step's ops are few)
    eager, state = model, opt.init(model)
    jitted, jitted_state = model, opt.init(model)
    step = jax.jit(lambda m, s, b: (lambda r: (r.model, r.state))(opt.step(_loss, m, s, (b,), on_nan="skip")))
    with compiled(clear=False) as names:
        for i in range(2):
            if i == 1:
                names.clear()
            r = opt.step(_loss, eager, state, (batch,), on_nan="skip")
            eager, state = r.model, r.state
            jax.block_until_ready(eager)
    assert names == []
    for _ in range(2):
        jitted, jitted_state = step(jitted, jitted_state, batch)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    r = opt.step(_loss, eager, state, ((batch[0] * jnp.nan, batch[1]),), on_nan="skip")
    for a, b in zip(jax.tree.leaves((r.model, r.state)), jax.tree.leaves((eager, state)), strict=True):
        np.testing.assert_array_equal(a, b)
