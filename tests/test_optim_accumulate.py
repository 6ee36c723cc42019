"""Gradient accumulation's bookkeeping: ``Optimizer(accumulate=k)`` (one update per
minibatch, its microbatches' mean) and ``optax.MultiSteps`` (one update per ``k``
minibatches) in the Trainer: the update, the learning context and the schedule's count,
and MultiSteps's sum left unapplied at the end of ``fit``."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.optim._multisteps import unapplied_microsteps

RNG = np.random.default_rng(3)
X = RNG.normal(size=(48, 4)).astype(np.float32)
Y = RNG.normal(size=(48, 2)).astype(np.float32)


def _model():
    return ft.nn.Dense(4, 2, key=jax.random.key(0))


def _loss(m, b):
    return jnp.mean((m(b[0]) - b[1]) ** 2)


def _leaves(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("make", [lambda: ft.optim.sgd(0.1), lambda: ft.optim.adam(0.1)], ids=["sgd", "adam"])
def test_accumulate_k_equals_one_step_on_the_whole_minibatch(make):
    """The mean of k equal microbatches' mean gradients is the minibatch's mean gradient:
    three steps with k = 2, 4, 8 end where k = 1 ends (measured: 6e-8 on values of 0.66)."""
    def run(k):
        opt = ft.optim.Optimizer(make(), accumulate=k)
        model, state = _model(), None
        state = opt.init(model)
        for i in range(3):
            batch = (X[i * 16:(i + 1) * 16], Y[i * 16:(i + 1) * 16])
            model, state, _ = opt.minimize(_loss, model, state, batch)
        return _leaves(model), ft.optim.context(state)

    whole, context = run(1)
    for k in (2, 4, 8):
        leaves, ctx = run(k)
        np.testing.assert_allclose(leaves, whole, rtol=0, atol=1e-6)
        assert (int(ctx.step), int(ctx.samples_seen)) == (int(context.step), int(context.samples_seen)) == (3, 48)


def test_the_schedule_counts_updates_not_microbatches_nor_calls():
    """Under accumulate=4 and steps_per_call=3 (4 minibatches an epoch: one call of 3, one
    single step) every history row's learning rate is the schedule at that update's count,
    and the context counts minibatches and their examples."""
    schedule = optax.linear_schedule(1.0, 0.0, 100)
    opt = ft.optim.Optimizer(ft.optim.sgd(ft.optim.schedule(schedule, unit="steps")), accumulate=4)
    trainer = ft.train.Trainer(_model(), opt, _loss, steps_per_call=3)
    history = trainer.fit(ft.train.batches((X[:32], Y[:32]), 8), epochs=3, progress=False)
    steps = np.array(history.steps["step"])
    np.testing.assert_array_equal(steps, np.arange(1, 13))
    np.testing.assert_allclose(history.steps["learning_rate"], [schedule(s - 1) for s in steps], rtol=0, atol=1e-6)
    ctx = ft.optim.context(trainer.opt_state)
    assert (int(ctx.step), int(ctx.sweep), int(ctx.samples_seen)) == (12, 3, 96)


def _by_hand(minibatches, k):
    """optax.MultiSteps(optax.sgd(0.1), k) run by hand over the minibatches' gradients."""
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k)
    params = _model()
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's mean divides by its int count
        for batch in minibatches:
            updates, state = tx.update(jax.grad(_loss)(params, batch), state, params)
            params = optax.apply_updates(params, updates)
    return params


def test_multisteps_sum_left_unapplied_at_the_end_of_fit_is_named_and_kept():
    """6 minibatches with every_k_schedule=4: one update, and the last 2 minibatches'
    gradients summed in the state. fit returned that model silently (the 2 minibatches
    never trained it); it now warns with the count, and the next fit goes on summing:
    12 steps in all are 3 updates, as optax by hand, with no warning."""
    data = ft.train.batches((X, Y), 8, shuffle=False)
    minibatches = list(data.in_order().iterate(0))
    trainer = ft.train.Trainer(_model(), optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4), _loss)
    with pytest.warns(ft.optim.UnappliedGradientsWarning, match=r"(?s)step 6 with the gradients of the last 2 .*accumulate=4"):
        trainer.fit(data, epochs=1, progress=False)
    assert unapplied_microsteps(trainer.opt_state) == 2
    np.testing.assert_allclose(_leaves(trainer.model), _leaves(_by_hand(minibatches[:4], 4)), rtol=0, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(data, epochs=2, progress=False)
    assert unapplied_microsteps(trainer.opt_state) == 0
    np.testing.assert_allclose(_leaves(trainer.model), _leaves(_by_hand(minibatches * 2, 4)), rtol=0, atol=1e-6)


def test_unapplied_microsteps_reads_none_where_there_is_no_multisteps():
    params = {"w": jnp.ones(2)}
    assert unapplied_microsteps(ft.optim.Optimizer(ft.optim.adam(0.1), accumulate=2).init(params)) == 0
    assert unapplied_microsteps(optax.MultiSteps(optax.sgd(0.1), 3).init(params)) == 0


SCALE = 1.0


def test_eager_accumulated_steps_compile_the_scan_once():
    """An eager opt.minimize with accumulate=2 (a notebook's loop) compiled the microbatches'
    jit(scan) again at every step (0.6-1.7 s a step on a tiny MLP, with and without
    BatchNorm): the body was a fresh closure over the model. Now one compiled accumulation
    per optimizer and loss function: nothing compiled after the first step, the same
    losses as the step traced under jax.jit, and a global the loss reads is read again."""
    global SCALE
    from _compiles import compiled

    x, y = jnp.asarray(X[:8]), jnp.asarray(Y[:8])

    def loss(m, x, y):
        return SCALE * jnp.mean((m(x) - y) ** 2)

    for model in (_model(), ft.nn.training(ft.nn.Sequential(ft.nn.Dense(X.shape[1], 4, key=jax.random.key(0)),
                                                            ft.nn.BatchNorm(4), ft.nn.Dense(4, Y.shape[1], key=jax.random.key(1))))):
        opt = ft.optim.Optimizer(ft.optim.adam(0.1), accumulate=2)
        eager = jitted = model
        state = jitted_state = opt.init(model)
        step = jax.jit(lambda m, s, opt=opt: opt.minimize(loss, m, s, x, y))
        with compiled(clear=False) as names:
            eager, state, _ = opt.minimize(loss, eager, state, x, y)
            jitted, jitted_state, _ = step(jitted, jitted_state)
            names.clear()
            for _ in range(1):  # the second step: nothing compiled
                eager, state, value = opt.minimize(loss, eager, state, x, y)
                jitted, jitted_state, value_jitted = step(jitted, jitted_state)
                np.testing.assert_allclose(float(value), float(value_jitted), rtol=1e-6)
        assert names == []
    SCALE = 2.0
    try:
        _, _, doubled = opt.minimize(loss, model, opt.init(model), x, y)
    finally:
        SCALE = 1.0
    _, _, once = opt.minimize(loss, model, opt.init(model), x, y)
    np.testing.assert_allclose(float(doubled), 2 * float(once), rtol=1e-6)


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted_mean"])
def test_bfloat16_microbatch_gradients_are_summed_in_float32(weighted):
    """A bfloat16 model's microbatch gradients were summed in bfloat16: 256 plus seven 1s
    stayed 256, so the mean of 8 came out 32 instead of 32.875 (33 once rounded to
    bfloat16). The sum is float32 now, rounded to the parameter's dtype after the mean."""
    x = jnp.asarray([256.0] + [1.0] * 7, jnp.bfloat16)

    def loss(p, x):
        value = jnp.sum(p["w"] * x).astype(jnp.float32)
        return ft.losses.WeightedMean(value, jnp.float32(1.0)) if weighted else value

    opt = ft.optim.Optimizer(ft.optim.sgd(1.0), accumulate=8)
    w = {"w": jnp.ones((), jnp.bfloat16)}
    _, grads = opt.compute_gradients(loss, w, x, state=opt.init(w))
    assert grads["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(grads["w"]), 33.0, rtol=0, atol=0)
