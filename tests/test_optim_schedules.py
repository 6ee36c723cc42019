"""Schedules of the learning context: piecewise (CNTK), optax schedules by unit."""

import jax.numpy as jnp
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
