"""Schedules of the learning context: piecewise (CNTK), optax schedules by unit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree.optim as fo


def _params():
    return {"w": jnp.zeros(())}


ONE = {"w": jnp.ones(())}


@pytest.mark.parametrize(
    ("unit", "sizes", "sweep_at", "expected"),
    [
        ("steps", [1] * 6, (), [1.0, 1.0, 0.5, 0.5, 0.5, 0.25]),
        ("samples", [2] * 6, (), [1.0, 0.5, 0.5, 0.25, 0.25, 0.25]),  # seen 0,2,4,6,...
        ("sweeps", [1] * 6, (2, 4), [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]),  # sweep 0,0,1,1,2,2
    ],
)
def test_piecewise_units(unit, sizes, sweep_at, expected):
    tx = fo.sgd(fo.piecewise([(2, 1.0), (3, 0.5), (1, 0.25)], unit=unit))
    state = tx.init(_params())
    got = []
    for i, m in enumerate(sizes):
        if i in sweep_at:
            state = fo.next_sweep(state)
        u, state = tx.update(ONE, state, minibatch_size=m)
        got.append(-float(u["w"]))
    assert got == pytest.approx(expected)
    assert fo.hyperparameters(state)["learning_rate"] == pytest.approx(expected[-1])


def test_raw_piecewise_list_is_accepted():
    tx = fo.sgd([(1, 1.0), (1, 0.5)])
    state = tx.init(_params())
    got = [-float(tx.update(ONE, state)[0]["w"])]
    _, state = tx.update(ONE, state)
    got.append(-float(tx.update(ONE, state)[0]["w"]))
    assert got == [1.0, 0.5]


@pytest.mark.parametrize("pairs", [[], [(0, 1.0)], [(1, 2.0, 3.0)], [(True, 1.0)], [("3", 1.0)]])
def test_piecewise_bad_pairs(pairs):
    with pytest.raises(ValueError, match="takes \\(count, value\\) pairs"):
        fo.piecewise(pairs)


@pytest.mark.parametrize("unit, fix", [("sweeps", "(1.5 * steps_per_sweep, 0.1), ...], unit='steps'"),
                                       ("samples", "(2, 0.1), ...], unit='samples'")])
def test_piecewise_fractional_count_is_refused(unit, fix):
    # int() truncated the count: 1.5 sweeps at 0.1 held for 1 sweep, the next value came early.
    with pytest.raises(ValueError, match="not a whole number") as e:
        fo.piecewise([(1.5, 0.1), (1, 0.01)], unit=unit)
    assert "was read as 1 " in str(e.value) and fix in str(e.value)
    at = fo.piecewise([(1e3, 0.5), (1, 0.25)])  # a whole float count is a count
    assert [float(at(fo.initial_context().replace(step=s))) for s in (999, 1000)] == [0.5, 0.25]


def test_bad_unit():
    with pytest.raises(ValueError, match="unit='epochs' is not a learning-context counter"):
        fo.piecewise([(1, 1.0)], unit="epochs")


def test_schedules_reuse_optax():
    ctx = fo.initial_context()
    at = lambda s, c: float(s(ctx.replace(step=jnp.asarray(c, jnp.int32))))  # noqa: E731
    cos = optax.cosine_decay_schedule(1.0, 10)
    assert at(fo.cosine_decay(1.0, 10), 3) == pytest.approx(float(cos(3)))
    assert at(fo.exponential_decay(1.0, 2, 0.5), 4) == pytest.approx(0.25)
    assert at(fo.linear_warmup(1.0, 4), 1) == pytest.approx(0.25)
    assert at(fo.linear_warmup(1.0, 4), 9) == pytest.approx(1.0)
    wc = fo.warmup_cosine_decay(0.0, 1.0, 2, 12)
    assert [at(wc, c) for c in (0, 1, 2)] == pytest.approx([0.0, 0.5, 1.0])
    assert at(wc, 12) == pytest.approx(0.0, abs=1e-6)
    assert at(fo.constant(0.3), 99) == pytest.approx(0.3)
    assert at(fo.inverse_time_decay(1.0, 0.5), 1) == pytest.approx(0.5)  # update 2: 1 / (1 + 0.5 * 2)
    sweeps = fo.schedule(optax.linear_schedule(1.0, 0.0, 4), unit="sweeps")
    assert float(sweeps(ctx.replace(sweep=jnp.asarray(2, jnp.int32)))) == pytest.approx(0.5)


def test_inverse_time_decay_is_swift_apis_decay():
    """swift-apis (seed 000's Adam) increments its step, then reads lr / (1 + decay * step):
    the first updates take 1/2, 1/3, 1/4 at decay 1 (functree took 1, 1/2, 1/3)."""
    tx = fo.sgd(fo.inverse_time_decay(1.0, 1.0))
    state, moves = tx.init({"w": jnp.zeros(())}), []
    for _ in range(3):
        u, state = tx.update({"w": jnp.ones(())}, state)
        moves.append(-float(u["w"]))
    assert moves == pytest.approx([1 / 2, 1 / 3, 1 / 4], rel=1e-6)


def test_an_optax_schedule_given_directly_explains_the_fix():
    tx = fo.adam(optax.cosine_decay_schedule(1e-3, 100))
    with pytest.raises(TypeError, match=r"take a ft\.optim\.LearningContext, not a step count") as info:
        tx.init(_params())
    assert "ft.optim.schedule(" in str(info.value)


def test_linear_warmup_of_zero_steps_is_the_peak():
    # HF's get_constant_schedule_with_warmup(opt, 0) (TrainingArguments' warmup_steps=0): the
    # peak from the first step. optax's linear_schedule without transition steps stays at
    # init_value: the rate was 0.0 at every step, and the model never moved.
    tx = fo.sgd(fo.linear_warmup(0.1, 0))
    state = tx.init(_params())
    rates = []
    for _ in range(2):
        updates, state = tx.update(ONE, state)
        rates.append(-float(updates["w"]))
    assert rates == [float(jnp.float32(0.1))] * 2


@pytest.mark.parametrize("make, message", [
    (lambda: fo.linear_warmup(0.1, -1), "warmup_steps=-1; it must be >= 0"),
    (lambda: fo.exponential_decay(0.1, 0, 0.5), "transition_steps=0; it must be > 0: optax reads 0 as no decay"),
    (lambda: fo.inverse_time_decay(0.1, -0.5), "decay=-0.5; it must be >= 0: 1 \\+ -0.5·c reaches 0 at c = 2"),
], ids=["warmup", "exponential", "inverse_time"])
def test_degenerate_schedule_arguments_are_refused(make, message):
    # Each was another schedule, silently: a constant (exponential_decay, transition_steps=0),
    # an infinite then negative rate (inverse_time_decay, decay < 0).
    with pytest.raises(ValueError, match=message):
        make()


BIG = 2**31  # samples_seen's low word holds 31 bits; one int32 wrapped negative here


def _at(samples):
    return fo.initial_context().replace(samples_seen=samples)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_schedules_in_samples_go_on_past_two_to_the_31(jitted):
    # main read samples_seen as one int32: at 2^31 samples it wrapped to -2^31 and every
    # schedule in samples started over (a warmup back to 0, a decay back to its peak),
    # silently. Below 2^31 the count is the exact int32 as before; past it float32 (7 digits).
    import jax
    import numpy as np

    call = jax.jit(lambda f, c: f(c), static_argnums=0) if jitted else (lambda f, c: f(c))
    piece = fo.piecewise([(BIG + 10, 1.0), (2 * BIG, 0.5), (1, 0.25)], unit="samples")
    got = [float(call(piece, _at(n))) for n in (BIG - 1, BIG + 9, BIG + 10, 3 * BIG + 9, 3 * BIG + 10)]
    assert got == [1.0, 1.0, 0.5, 0.5, 0.25]  # the switches at the exact sample, both words compared
    warm = fo.linear_warmup(1.0, 3 * 10**9, unit="samples")
    for n in (BIG - 1, BIG, 25 * 10**8, 4 * 10**9):
        np.testing.assert_allclose(float(call(warm, _at(n))), min(n / 3e9, 1.0), rtol=0, atol=1e-6)
    cosine = fo.warmup_cosine_decay(0.0, 1.0, warmup_steps=10**9, decay_steps=5 * 10**9, unit="samples")
    want = (1 + np.cos(np.pi * (3e9 - 1e9) / 4e9)) / 2
    np.testing.assert_allclose(float(call(cosine, _at(3 * 10**9))), want, rtol=0, atol=1e-6)
    decay = fo.schedule(optax.linear_schedule(1.0, 0.0, 4e9), unit="samples")  # a user's (a float: JAX's int is int32)
    np.testing.assert_allclose(float(call(decay, _at(3 * 10**9))), 0.25, rtol=0, atol=1e-6)
    inverse = fo.inverse_time_decay(1.0, 1e-9, unit="samples")
    np.testing.assert_allclose(float(call(inverse, _at(5 * 10**9))), 1 / 6, rtol=0, atol=1e-6)
    # periodic ones keep their place: torch's CosineAnnealingWarmRestarts(T_0=2^30, T_mult=2)
    # restarts at 2^30, 3·2^30, 7·2^30, lengths doubling (past int32: its list of restarts went to 2^31 only)
    restarts = fo.cosine_warm_restarts(1.0, 2**30, period_mult=2, unit="samples")
    # (float32 past 2^31: a sample within 2^7 of a restart may round onto it; 2^10 before it cannot)
    for n, since, length in ((3 * 2**30 - 2**10, 2**31 - 2**10, 2**31), (7 * 2**30 + 2**29, 2**29, 2**33)):
        want = (1 + np.cos(np.pi * since / length)) / 2
        np.testing.assert_allclose(float(call(restarts, _at(n))), want, rtol=0, atol=1e-6)
    cyc = fo.cyclic(0.0, 1.0, step_size_up=2**28, unit="samples")  # triangular, period 2^29
    for n in (BIG - 2**27, 5 * BIG + 2**27):
        x = (n % 2**29) / 2**28
        np.testing.assert_allclose(float(call(cyc, _at(n))), x if x <= 1 else 2 - x, rtol=0, atol=1e-6)


def test_schedules_in_samples_are_exact_int64_under_x64():
    import jax

    with jax.enable_x64(True):
        piece = fo.piecewise([(3 * BIG + 1, 1.0), (1, 0.5)], unit="samples")
        assert [float(jax.jit(piece)(_at(n))) for n in (3 * BIG, 3 * BIG + 1)] == [1.0, 0.5]
        seen = []
        fo.schedule(lambda c: seen.append(c.dtype) or c * 0.0, unit="samples")(_at(3 * BIG))
        assert seen == [jnp.int64]


@pytest.mark.parametrize("make, message", [
    (lambda: fo.linear_warmup(1e-3, 0.5, unit="sweeps"),
     r"(?s)warmup_steps=0.5 is not a whole number.*whole first sweep at init_value.*"
     r"right:  ft.optim.linear_warmup\(0.001, round\(0.5 \* steps_per_sweep\)\)"),
    (lambda: fo.linear_warmup(0.0, 1e-3, 1000),
     r"(?s)warmup_steps=0.001 is not a whole number.*optax.linear_schedule's order.*"
     r"right:  ft.optim.linear_warmup\(0.001, 1000\)"),
    (lambda: fo.warmup_cosine_decay(0.0, 1e-3, 0.5, 4689),
     r"(?s)warmup_steps=0.5 is not a whole number.*peak only at step 1.*"
     r"right:  ft.optim.warmup_cosine_decay\(0.0, 0.001, 1, 4689\)"),
], ids=["half_a_sweep", "optax_order", "half_a_step"])
def test_a_warmup_of_a_fraction_of_a_count_is_refused(make, message):
    # The context counts in integers: linear_warmup(1e-3, 0.5, unit="sweeps") held the rate at
    # 0.0 through the whole first epoch (the model never moved), and linear_warmup(0.0, 1e-3, 1000),
    # optax.linear_schedule's order, stepped at a rate of 1000 and then 0.0, silently.
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "wrong:  ft.optim." in str(info.value)
    for whole in (0, 4, 4.0, np.int64(4)):  # whole counts, floats and NumPy's included, are taken
        fo.linear_warmup(1e-3, whole)
        fo.warmup_cosine_decay(0.0, 1e-3, whole, 100)
    # a fraction of many steps is HF's continuous ramp, min(s, w) / w: 0.1 * 4689 steps
    ramp = fo.linear_warmup(1e-3, 0.1 * 4689)
    for step in (0, 468, 469, 1000):
        at = fo.initial_context().replace(step=step)
        np.testing.assert_allclose(float(ramp(at)), 1e-3 * min(step, 468.9) / 468.9, rtol=0, atol=1e-9)


# optax calls a schedule with its int32 update count: functree's schedules in steps take one.
def _steps_schedules():
    return {
        "constant": fo.constant(0.3),
        "piecewise": fo.piecewise([(2, 1.0), (3, 0.5), (1, 0.25)]),
        "exponential_decay": fo.exponential_decay(1.0, 4, 0.5),
        "cosine_decay": fo.cosine_decay(1.0, 10, alpha=0.1),
        "linear_warmup": fo.linear_warmup(1.0, 4),
        "warmup_cosine_decay": fo.warmup_cosine_decay(0.0, 1.0, 3, 12),
        "inverse_time_decay": fo.inverse_time_decay(1.0, 0.5),
        "one_cycle": fo.one_cycle(1.0, 10),
        "one_cycle_momentum": fo.one_cycle_momentum(10),
        "cyclic": fo.cyclic(0.1, 0.5, 2, mode="triangular2"),
        "cyclic_momentum": fo.cyclic_momentum(step_size_up=3),
        "cosine_warm_restarts": fo.cosine_warm_restarts(1.0, 2, period_mult=2),
        "schedule": fo.schedule(optax.polynomial_schedule(1.0, 0.1, 2, 8)),
    }


@pytest.mark.parametrize("name", list(_steps_schedules()))
def test_schedule_takes_a_step_count_as_optax_passes(name):
    lr, ctx = _steps_schedules()[name], fo.initial_context()
    counts = [0, 1, 3, 7, 12, 25]
    expected = np.asarray([lr(ctx.replace(step=n)) for n in counts])
    for given in (lambda n: n, np.int32, np.int64, lambda n: jnp.asarray(n, jnp.int32)):
        got = np.asarray([lr(given(n)) for n in counts])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    traced = jax.vmap(jax.jit(lr))(jnp.asarray(counts, jnp.int32))  # a traced count, and a batch of them
    np.testing.assert_allclose(traced, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("make, ours, theirs", [
    (optax.sgd, lambda: fo.cosine_decay(0.5, 4), lambda: optax.cosine_decay_schedule(0.5, 4)),
    (optax.adam, lambda: fo.warmup_cosine_decay(0.0, 0.1, 2, 6), lambda: optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 6)),
    (optax.adam, lambda: fo.exponential_decay(0.1, 2, 0.5), lambda: optax.exponential_decay(0.1, 2, 0.5)),
])
def test_schedule_inside_an_optax_optimizer(make, ours, theirs):
    # optax.sgd(ft.optim.cosine_decay(...)) failed in update: 'ArrayImpl' object has no attribute 'step'
    w = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    grad = jax.grad(lambda p: jnp.sum(p["w"] ** 2 + jnp.sin(p["w"])))
    runs = []
    for tx in (make(ours()), make(theirs())):
        p, state, step = w, tx.init(w), jax.jit(tx.update)
        with jax.numpy_dtype_promotion("standard"):  # optax's adam and schedules mix int counts and floats
            for _ in range(5):
                updates, state = step(grad(p), state)
                p = optax.apply_updates(p, updates)
        runs.append(p["w"])
    np.testing.assert_allclose(runs[0], runs[1], rtol=0, atol=1e-6 * float(jnp.abs(runs[1]).max()))


@pytest.mark.parametrize("unit", ["samples", "sweeps"])
def test_schedule_in_samples_or_sweeps_refuses_a_step_count(unit):
    # optax passes a count of steps: read as samples or sweeps, silently wrong rates
    lr = fo.cosine_decay(1.0, 10, unit=unit)
    with pytest.raises(TypeError, match=f"counts {unit} \\(unit='{unit}'\\).*an int \\(3\\)") as e:
        lr(3)
    assert f"ft.optim.adam(ft.optim.cosine_decay(1.0, 10, unit='{unit}'))" in str(e.value)
    tx, w = optax.sgd(lr), {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match=f"counts {unit}"):
        tx.update(w, tx.init(w))
    # the fixes it names run, and read the context's count in that unit
    inject = fo.inject("adam", lambda learning_rate: optax.adam(learning_rate), {"learning_rate": lr})
    for fix in (fo.adam(lr), inject):
        assert float(fo.hyperparameters(fix.init(w))["learning_rate"]) == pytest.approx(1.0)
        fix.update(w, fix.init(w), minibatch_size=2)
    with pytest.raises(TypeError, match="counts samples"):  # the decorator's schedules too
        fo.schedule(optax.linear_schedule(0.0, 1.0, 10), unit="samples")(jnp.int32(3))


@pytest.mark.parametrize("given, words", [
    (0.5, "a float (0.5)"), ({"step": 3}, "a dict ({'step': 3})"), (True, "a bool (True)"),
    (jnp.float32(2.0), "an array of dtype float32 and shape ()"),
])
def test_schedule_given_neither_context_nor_count(given, words):
    # a float failed deep inside: AttributeError: 'float' object has no attribute 'step'
    for lr in (fo.cosine_decay(1.0, 10), fo.piecewise([(2, 1.0), (1, 0.5)]), fo.constant(0.1)):
        with pytest.raises(TypeError, match="was called with " + re.escape(words)) as e:
            lr(given)
        assert "lr(ft.optim.initial_context().replace(step=100))" in str(e.value)


def test_step_count_past_int32_is_refused():
    with pytest.raises(ValueError, match=re.escape("ft.optim.cosine_decay(1.0, 10) was called with the step count 4294967301")):
        fo.cosine_decay(1.0, 10)(2**32 + 5)  # would wrap to step 5, silently
    with pytest.raises(ValueError, match="step count -1"):
        fo.one_cycle(1.0, 10)(-1)
