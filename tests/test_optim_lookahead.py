"""optax.lookahead through ft.optim.Optimizer and the Trainer: slow weights in the state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft

X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 1)).astype(np.float32)
PARAMS = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(3, 1)), jnp.float32), "b": jnp.zeros(1)}


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)


def raw_optax(tx, steps, params=PARAMS):
    """optax's own lookahead loop: LookaheadParams, gradients of the fast weights."""
    lp = optax.LookaheadParams.init_synced(params)
    state = tx.init(lp)
    for _ in range(steps):
        g = jax.grad(loss)(lp.fast, X, Y)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int counts
            u, state = tx.update(g, state, lp)
        lp = optax.apply_updates(lp, u)
    return lp


def close(a, b):
    # the same float32 operations (jitted or not) on O(1) values over a dozen steps
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=2e-6), a, b)


@pytest.mark.parametrize("reset_state", [False, True])
def test_optax_lookahead_through_optimizer_equals_the_raw_optax_loop(reset_state):
    def make():
        return optax.lookahead(optax.adam(1e-2), sync_period=5, slow_step_size=0.5, reset_state=reset_state)

    want = raw_optax(make(), 12)
    for tx in (make(), ft.optim.lookahead(optax.adam(1e-2), 5, 0.5, reset_state)):
        opt = ft.optim.Optimizer(tx)
        p, state = PARAMS, opt.init(PARAMS)
        step = ft.jit(lambda p, s, opt=opt: opt.minimize(loss, p, s, X, Y))
        for _ in range(12):
            p, state, _ = step(p, state)
        close(p, want.fast)
        close(ft.optim.averaged(state, p), want.slow)
        assert not np.allclose(want.fast["w"], want.slow["w"], atol=1e-4)  # 12 = 2·5 + 2: not synced


def test_functree_fast_optimizers_get_the_learning_context():
    # A functree transform inside reads the Optimizer's one context (optax's lookahead
    # calls its fast optimizer without extra arguments); used raw it keeps its own.
    want = raw_optax(optax.lookahead(ft.optim.adam(1e-2), 3, 0.5), 7)
    opt = ft.optim.Optimizer(ft.optim.lookahead(ft.optim.adam(1e-2), 3, 0.5))
    p, state = PARAMS, opt.init(PARAMS)
    for _ in range(7):
        p, state, _ = opt.minimize(loss, p, state, X, Y)
    close(p, want.fast)
    close(ft.optim.averaged(state, p), want.slow)
    assert int(ft.optim.context(state).step) == 7
    # reset_state re-initializes the fast optimizer inside the Optimizer's state layout
    # (contexts released): as optax.adam's reset, which holds the same numbers
    want = raw_optax(optax.lookahead(optax.adam(1e-2), 3, 0.5, reset_state=True), 7)
    opt = ft.optim.Optimizer(ft.optim.lookahead(ft.optim.adam(1e-2), 3, 0.5, reset_state=True))
    p, state = PARAMS, opt.init(PARAMS)
    for _ in range(7):
        p, state, _ = opt.minimize(loss, p, state, X, Y)
    close(p, want.fast)


def test_trainer_with_optax_lookahead_and_its_checkpoint(tmp_path):
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    tx = optax.lookahead(optax.adam(1e-2), sync_period=5, slow_step_size=0.5)
    trainer = ft.train.Trainer(model, ft.optim.Optimizer(tx), lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    trainer.fit(ft.train.batches((X, Y), batch_size=16, shuffle=False), steps=12, progress=False)
    want = raw_optax(optax.lookahead(optax.adam(1e-2), 5, 0.5), 12, {"w": model.weight, "b": model.bias})
    close({"w": trainer.model.weight, "b": trainer.model.bias}, want.fast)
    close({"w": trainer.averaged_model.weight, "b": trainer.averaged_model.bias}, want.slow)
    ft.train.save(tmp_path / "state", trainer.opt_state)
    loaded = ft.train.load(tmp_path / "state")  # SlowState, optax.LookaheadState by registered names
    jax.tree.map(np.testing.assert_array_equal, loaded, trainer.opt_state)


def test_lookahead_errors():
    with pytest.raises(ValueError, match="Synchronization period must be >= 1"):
        ft.optim.lookahead(optax.sgd(0.1), sync_period=0, slow_step_size=0.5)
    tx = ft.optim.lookahead(optax.sgd(0.1), 2, 0.5)
    with pytest.raises(ValueError, match="pass the model"):
        tx.update(PARAMS, tx.init(PARAMS))

    def update_fn(updates, state, params=None):  # looks like optax's, without its closure
        return updates, state

    update_fn.__qualname__, update_fn.__module__ = "lookahead.<locals>.update_fn", "optax._src.lookahead"
    with pytest.raises(TypeError, match=r"right:  ft.optim.Optimizer\(ft.optim.lookahead\(fast"):
        ft.optim.Optimizer(optax.GradientTransformation(lambda p: optax.EmptyState(), update_fn))


def test_lookahead_around_multisteps_is_refused_and_accumulate_syncs_on_updates():
    """A MultiSteps inside the lookahead: sync_period counted its micro-steps (minibatches), the
    slow weights 5e-3 from accumulating around it; refused, and the fix's sync is per update."""
    for make in (ft.optim.lookahead, optax.lookahead):
        with pytest.raises(ValueError, match=r"^ft.optim.lookahead counts sync_period in calls of its fast "
                                             r"optimizer(.|\n)*right:  ft.optim.Optimizer\(ft.optim.lookahead\(tx, "
                                             r"sync_period=5, slow_step_size=0.5\), accumulate=k\)"):
            ft.optim.Optimizer(make(optax.MultiSteps(optax.sgd(0.1), 2), 2, 0.5)).init(PARAMS)
    opt = ft.optim.Optimizer(ft.optim.lookahead(optax.sgd(0.1), 2, 0.5), accumulate=2)
    params, state = PARAMS, opt.init(PARAMS)
    for _ in range(2):  # two updates of minibatches of 16: one sync
        params, state, _ = opt.minimize(lambda p, b: loss(p, *b), params, state, (X, Y))
    np.testing.assert_array_equal(ft.optim.averaged(state, params)["w"], params["w"])  # synced: fast = slow


def test_optax_lookahead_params_model_is_refused_naming_ft_lookahead():
    """optax's documented model, LookaheadParams(fast, slow) with the loss on .fast: through
    Optimizer/Trainer the slow weights never moved (an unused-parameter warning was all)."""
    model = optax.LookaheadParams(PARAMS, jax.tree.map(jnp.copy, PARAMS))
    for tx in (optax.lookahead(optax.adam(1e-2), 5, 0.5), ft.optim.lookahead(optax.adam(1e-2), 5, 0.5)):
        with pytest.raises(ValueError, match=r"optax\.LookaheadParams") as e:
            ft.optim.Optimizer(tx).init(model)
        assert "ft.optim.Optimizer(ft.optim.lookahead(" in str(e.value)
        with pytest.raises(ValueError, match="its slow half would never move"):
            ft.train.Trainer(model, tx, lambda m, b: loss(m.fast, *b))


@pytest.mark.parametrize("make", [
    lambda: optax.chain(optax.clip(1.0), optax.lookahead(optax.adam(1e-2), 5, 0.5)),
    lambda: optax.chain(optax.chain(optax.lookahead(optax.adam(1e-2), 5, 0.5))),
    lambda: ft.optim.groups({"*": optax.lookahead(optax.adam(1e-2), 5, 0.5)}),
])
def test_raw_optax_lookahead_nested_in_a_transform_is_refused(make):
    with pytest.raises(TypeError, match=r"ft\.optim\.lookahead in its place") as e:
        ft.optim.Optimizer(make())
    assert "optax.chain(optax.clip(1.0), ft.optim.lookahead(" in str(e.value)


def test_ft_lookahead_nested_in_a_chain_runs_optax_numerics():
    want = raw_optax(optax.lookahead(optax.chain(optax.clip(1.0), optax.adam(1e-2)), 3, 0.5), 7)
    opt = ft.optim.Optimizer(optax.chain(optax.clip(1.0), ft.optim.lookahead(optax.adam(1e-2), 3, 0.5)))
    p, state = PARAMS, opt.init(PARAMS)
    for _ in range(7):
        p, state, _ = opt.minimize(loss, p, state, X, Y)
    close(p, want.fast)
    close(ft.optim.averaged(state, p), want.slow)
