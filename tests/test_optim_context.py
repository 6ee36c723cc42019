"""Learning context, hyperparameters in the state, rate units and schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
import functree.optim as fo


def _params():
    return {"w": jnp.zeros(())}


ONE = {"w": jnp.ones(())}


def test_context_advances_with_minibatch_size_and_loss():
    tx = fo.sgd(0.1)
    state = tx.init(_params())
    ctx = fo.context(state)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size)) == (0, 0, 1)
    assert np.isnan(float(ctx.loss))
    for size, loss in [(4, 3.0), (6, 2.0), (5, 1.0)]:
        _, state = tx.update(ONE, state, minibatch_size=size, loss=loss)
    ctx = fo.context(state)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size), float(ctx.loss)) == (3, 15, 5, 1.0)
    _, state = tx.update(ONE, state)  # minibatch size kept
    assert int(fo.context(state).samples_seen) == 20


def test_next_sweep_advances_every_context():
    tx = optax.chain(fo.clip(1.0), fo.adam())
    state = fo.next_sweep(fo.next_sweep(tx.init(_params())))
    from functree.optim._context import contexts

    assert [int(c.sweep) for c in contexts(state)] == [2, 2]


def test_next_sweep_equals_a_walk_of_the_state_and_finds_the_contexts_once_per_structure():
    from functree.optim import _context
    from functree.optim._context import LearningContext, contexts

    def walked(state):  # every context's sweep + 1, by a walk of the whole state
        return jax.tree.map(lambda x: LearningContext(x.counters + jnp.array([0, 1, 0, 0, 0], jnp.int32)[(None,) * (x.counters.ndim - 1)], x.loss)
                            if isinstance(x, LearningContext) else x, state,
                            is_leaf=lambda x: isinstance(x, LearningContext))

    model = {"head": {"w": jnp.ones(3)}, "body": jnp.ones((2, 2))}
    states = [optax.chain(fo.clip(1.0), fo.adam()).init(model),
              fo.groups({"head.*": fo.sgd(0.1), "body": fo.adam(1e-3)}).init(model),
              fo.Optimizer(fo.adam(1e-3)).init(ft.nn.Dense(2, 3, key=jax.random.key(0))),
              jax.vmap(lambda w: fo.sgd(0.1).init({"w": w}))(jnp.ones((3, 2)))]
    for state in states:
        got, expected = fo.next_sweep(state), walked(state)
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)
        assert len(contexts(got)) >= 1
        assert _context._COUNTERS_AT[jax.tree.structure(state)] == _context._counters_at(jax.tree.structure(state))
    traced = jax.jit(fo.next_sweep)(states[1])  # inside a trace too
    assert [int(c.sweep) for c in contexts(traced)] == [1, 1]
    wrong = jax.tree.map(lambda *x: jnp.stack(x, axis=-1), *[fo.sgd(0.1).init({"w": jnp.ones(2)})] * 3)
    with pytest.raises(ValueError, match="put their member axes first"):
        fo.next_sweep(wrong)


def test_context_of_a_state_without_one():
    with pytest.raises(ValueError, match=r"holds no ft\.optim\.LearningContext") as info:
        fo.context(optax.adam(1e-3).init(_params()))
    assert "right:" in str(info.value)
    with pytest.raises(ValueError, match=r"holds no ft\.optim\.LearningContext"):
        fo.next_sweep(optax.sgd(1e-3).init(_params()))


def test_optimizer_adds_a_context_to_plain_optax():
    opt = fo.Optimizer(optax.sgd(0.5))
    state = opt.init(_params())
    assert isinstance(state, fo.OptimizerState)
    updates, state = opt.update(ONE, state, _params(), minibatch_size=4)
    assert float(updates["w"]) == -0.5
    assert int(fo.context(state).samples_seen) == 4


def test_context_replace_and_repr():
    ctx = fo.initial_context().replace(step=3, loss=0.25)
    assert repr(ctx) == "LearningContext(step=3, sweep=0, samples_seen=0, minibatch_size=1, loss=0.25)"
    assert int(jax.jit(lambda c: c.replace(sweep=c.step + 1))(ctx).sweep) == 4
    with pytest.raises(TypeError, match=r"no field\(s\) \['epoch'\]"):
        ctx.replace(epoch=1)


def _contexts(state):
    from functree.optim._context import contexts

    return contexts(state)


def _model():
    import functree as ft

    return ft.nn.Sequential([ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.Dense(3, 1, key=jax.random.key(1))])


def _loss(m, x):
    return jnp.mean(m(x) ** 2)


X = jnp.ones((4, 2))
NAN_X = jnp.full((4, 2), jnp.nan)


@pytest.mark.parametrize("kind", ["chain", "groups", "skip", "accumulate", "loss_scale"])
def test_one_consistent_context_in_every_optimizer_state(kind):
    """Chains, groups, skipped steps, accumulation and loss-scale overflow: one context,
    advanced by one rule (a step and its samples when applied, nothing when skipped)."""
    if kind == "chain":
        opt = fo.Optimizer(optax.chain(fo.clip_by_norm(1.0), fo.weight_decay(1e-3), fo.adam(1e-2)))
    elif kind == "groups":
        opt = fo.Optimizer(fo.groups({"layers.0.*": fo.sgd(0.1), "layers.1.*": fo.adam(1e-2)}))
    elif kind == "skip":
        opt = fo.Optimizer(optax.chain(fo.clip_by_norm(1.0), fo.skip_non_finite(fo.adam(1e-2))))
    elif kind == "accumulate":
        opt = fo.Optimizer(optax.chain(fo.clip(1.0), fo.adam(1e-2)), accumulate=2)
    else:
        opt = fo.LossScaleOptimizer(fo.Optimizer(optax.chain(fo.clip(1.0), fo.adam(1e-2))), initial_scale=4.0)
    model = _model()
    state = opt.init(model)
    assert len(_contexts(state)) == 1
    assert all(h.context is None for h in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fo.HyperState))
               if isinstance(h, fo.HyperState))
    step = jax.jit(lambda m, s, x: opt.minimize(_loss, m, s, x))  # one program (eagerly, each operation)
    model, state, _ = step(model, state, X)
    model, state, _ = step(model, state, X)
    if kind in ("skip", "loss_scale"):  # a non-finite step is skipped: no step, no samples
        before = state
        model, state, _ = step(model, state, NAN_X)
        assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b, equal_nan=True),
                                         fo.moments(state), fo.moments(before)))
    (ctx,) = _contexts(state)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size)) == (2, 8, 4)
    assert fo.context(state) is ctx
    state = fo.next_sweep(state)
    assert int(fo.context(state).sweep) == 1


class _OldContextState(__import__("typing").NamedTuple):
    """The pre-redesign wrapper of a plain optax transform's state."""

    context: fo.LearningContext
    inner: object


def test_upgrade_state_converts_pre_redesign_layouts():
    model = _model()
    ctx = fo.initial_context().replace(step=5, samples_seen=40, minibatch_size=8, loss=0.5)
    # ft adam: the old state was the HyperState itself, holding its own context
    opt = fo.Optimizer(fo.adam(1e-2))
    new = opt.init(model)
    old = new.inner.replace(context=ctx)
    up = fo.upgrade_state(old, opt, model)
    assert fo.context(up) is ctx and len(_contexts(up)) == 1
    assert jax.tree.structure(up) == jax.tree.structure(new)
    # a plain optax transform: the old state was ContextState(context, inner)
    opt = fo.Optimizer(optax.sgd(0.1, momentum=0.9))
    up = fo.upgrade_state(_OldContextState(ctx, opt.init(model).inner), opt, model)
    assert int(fo.context(up).step) == 5
    # the old skip_non_finite was optax.apply_if_finite; the old LossScaleState wrapped it all
    inner_tx = fo.adam(1e-2)
    old_skip = optax.apply_if_finite(inner_tx, 10).init(ft.parameters(model))
    old_skip = old_skip._replace(total_notfinite=jnp.asarray(3, jnp.int32), inner_state=old_skip.inner_state.replace(context=ctx))
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.skip_non_finite(inner_tx)))
    old = fo.LossScaleState(jnp.asarray(8.0), jnp.asarray(1, jnp.int32), jnp.asarray(2, jnp.int32), old_skip)
    up = fo.upgrade_state(old, opt, model)
    assert int(up.inner.inner.skipped) == 3 and float(up.scale) == 8.0 and int(fo.context(up).step) == 5
    model, up, _ = jax.jit(lambda m, s: opt.minimize(_loss, m, s, X))(model, up)  # and it trains on (one program)
    assert int(fo.context(up).step) == 6
    with pytest.raises(ValueError, match=r"upgrade_state: the old state does not fit"):
        fo.upgrade_state(old, fo.Optimizer(fo.sgd(0.1)), model)
    with pytest.raises(ValueError, match=r"holds no ft\.optim\.LearningContext"):
        fo.upgrade_state(optax.adam(1e-3).init(ft.parameters(model)), opt, model)


def _ensemble_step(tx, wrapped):
    opt = fo.Optimizer(tx) if wrapped else None

    def loss(m, x):
        return jnp.mean((m(x) - 0.5) ** 2)

    def step(m, s, x, on):
        value, grads = ft.value_with_gradient(lambda mm: loss(mm, x), at=m)
        if wrapped:  # members skip different steps: their step counts differ
            u, s = opt.update(grads, s, m, minibatch_size=x.shape[0], loss=value, apply_if=on)
        else:
            u, s = tx.update(grads, s, m, minibatch_size=x.shape[0], loss=value)
        return ft.move(m, along=u), s

    return (opt.init if wrapped else tx.init), step


@pytest.mark.parametrize("members", [3, 4])
@pytest.mark.parametrize("wrapped", [False, True], ids=["alias", "Optimizer"])
def test_a_vmapped_ensemble_reads_one_context_per_member(members, wrapped):
    """Each member's context, moments and hyperparameters equal those of its separate run."""
    init, step = _ensemble_step(fo.sgd(0.1, momentum=0.9), wrapped)
    models = jax.vmap(lambda k: ft.nn.Dense(3, 1, key=k))(jax.random.split(jax.random.key(0), members))
    states = jax.vmap(init)(models)
    # NumPy inputs, indexed in NumPy below (no slice compiled per shape)
    xs = np.linspace(-1.0, 1.0, members * 12, dtype=np.float32).reshape(members, 4, 3)
    ons = np.array([[t % (i + 1) == 0 for i in range(members)] for t in range(5)])  # member i: every (i+1)th
    vstep, one = jax.jit(jax.vmap(step)), jax.jit(step)
    for on in ons:
        models, states = vstep(models, states, xs, on)
    ctx = fo.context(states)
    expected_steps = [int(ons[:, i].sum()) if wrapped else 5 for i in range(members)]
    np.testing.assert_array_equal(ctx.step, expected_steps)
    np.testing.assert_array_equal(ctx.samples_seen, 4 * np.array(expected_steps))
    np.testing.assert_array_equal(ctx.minibatch_size, [4] * members)
    np.testing.assert_array_equal(ctx.sweep, [0] * members)
    np.testing.assert_array_equal(fo.context(fo.next_sweep(states)).sweep, [1] * members)
    hp = fo.hyperparameters(states)
    np.testing.assert_array_equal(hp["learning_rate"], np.full(members, 0.1, np.float32))
    np.testing.assert_array_equal(hp["momentum"], np.full(members, 0.9, np.float32))
    ctx_step, ctx_loss = np.asarray(ctx.step), np.asarray(ctx.loss)
    traces = np.asarray(fo.moments(states)["trace"].weight)
    for i, k in enumerate(jax.random.split(jax.random.key(0), members)):
        model = jax.tree.map(lambda a, i=i: np.asarray(a)[i], models)
        m = ft.nn.Dense(3, 1, key=k)
        s = init(m)
        for on in ons:
            m, s = one(m, s, xs[i], on[i])
        np.testing.assert_allclose(model.weight, m.weight, atol=1e-6)  # weights ~1: float32 rounding
        np.testing.assert_allclose(traces[i], fo.moments(s)["trace"].weight, atol=1e-6)
        np.testing.assert_array_equal(ctx_step[i], fo.context(s).step)
        np.testing.assert_allclose(ctx_loss[i], fo.context(s).loss, atol=1e-6)
    assert repr(ctx).startswith(f"LearningContext(step={expected_steps}, sweep={[0] * members}")
    changed = ctx.replace(step=jnp.arange(members), loss=0.0)
    np.testing.assert_array_equal(changed.step, np.arange(members))
    np.testing.assert_array_equal(changed.samples_seen, ctx.samples_seen)
    np.testing.assert_array_equal(changed.loss, np.zeros(members, np.float32))


@pytest.mark.parametrize("gated", [False, True], ids=["minimize", "gated"])
def test_the_context_advances_elementwise_in_a_step(gated):
    # The counters' update is arithmetic and a select, not a scatter: one kernel that
    # writes the donated buffer in place (a scatter was a dynamic-update-slice kernel and a
    # copy in every step). The numbers: step, samples and minibatch size as before.
    model = ft.nn.Dense(3, 2, key=jax.random.key(0))
    opt = ft.optim.Optimizer(fo.adam(1e-2))

    def loss_fn(m, x):
        return jnp.mean(m(x) ** 2)

    @jax.jit
    def step(m, s, x):
        if gated:
            return opt.step(loss_fn, m, s, (x,), on_nan="skip")[:2]
        return opt.minimize(loss_fn, m, s, x)[:2]

    state = opt.init(model)
    x = jnp.ones((4, 3))
    text = step.lower(model, state, x).as_text()
    assert "scatter" not in text and "dynamic_update_slice" not in text
    for batch in (x, jnp.ones((6, 3)), x):
        model, state = step(model, state, batch)
    ctx = fo.context(state)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size)) == (3, 14, 4)


@pytest.mark.parametrize("x64", [False, True])
def test_the_loss_keeps_float64_under_x64_and_a_scanned_step_carries_one_dtype(x64):
    """Under ``jax_enable_x64`` a float64 loss is stored as float64 (it was rounded to
    float32: 1/3 held as 0.3333333432674408, off by 1e-8); without x64, float32 as before.
    The initial context has the dtype the step writes: ``lax.scan`` carrying the state
    (which refuses a carry whose dtype changes) runs, and the states' dtypes are equal."""
    losses = np.array([1.0, 0.5, 1 / 3])  # NumPy float64: the reference
    with jax.enable_x64(x64):
        tx = fo.adam(0.1)
        state = tx.init({"w": jnp.zeros(2)})

        def step(state, loss):
            _, state = tx.update({"w": jnp.ones(2)}, state, minibatch_size=4, loss=loss)
            return state, fo.context(state).loss

        final, seen = jax.lax.scan(step, state, jnp.asarray(losses))
        dtype = np.float64 if x64 else np.float32
        assert fo.context(state).loss.dtype == fo.context(final).loss.dtype == seen.dtype == dtype
        assert jax.tree.map(lambda a: a.dtype, state) == jax.tree.map(lambda a: a.dtype, final)
        np.testing.assert_array_equal(np.asarray(seen), losses.astype(dtype))
        assert float(fo.context(final).replace(loss=np.float64(0.1)).loss) == float(np.float64(0.1).astype(dtype))


BIG = 2**31  # past int32: one word of samples_seen wrapped negative here


@pytest.mark.parametrize("start", [BIG - 3, 5 * BIG - 1, 2**31 - 8], ids=["carry", "carry_again", "to_the_edge"])
def test_samples_seen_counts_past_two_to_the_31_exactly(start):
    # main held samples_seen in one int32: a job past 2^31 - 1 examples (1600 epochs of
    # ImageNet) read -2147483643 and a schedule in samples started over, silently. Two words
    # (high · 2^31 + low) count on, exact on the host; the jitted step carries them.
    tx = fo.sgd(0.1)
    state = tx.init(_params())
    state = jax.tree.map(lambda x: x.replace(samples_seen=start) if isinstance(x, fo.LearningContext) else x, state,
                         is_leaf=lambda x: isinstance(x, fo.LearningContext))
    assert int(fo.context(state).samples_seen) == start

    @jax.jit
    def step(s, size):
        return tx.update(ONE, s, minibatch_size=size)[1]

    seen = start
    for size in (8, 2**31 - 1, 5):
        state = step(state, size)
        seen += size
        ctx = fo.context(state)
        assert int(ctx.samples_seen) == seen and type(int(ctx.samples_seen)) is int
        low, high = (int(w) for w in np.asarray(ctx.counters)[[2, 4]])
        assert 0 <= low < BIG and high * BIG + low == seen
    assert f"samples_seen={seen}," in repr(ctx)
    state = tx.update(ONE, state)[1]  # the minibatch size kept: 5 more
    assert int(fo.context(state).samples_seen) == seen + 5


def test_samples_seen_replace_splits_host_and_traced_counts():
    ctx = fo.initial_context()
    for n in (0, 7, BIG - 1, BIG, 2**40 + 12345, -1):
        assert int(ctx.replace(samples_seen=n).samples_seen) == n
        assert int(ctx.replace(samples_seen=np.int64(n)).samples_seen) == n
    traced = jax.jit(lambda n: ctx.replace(samples_seen=n).counters)(jnp.int32(BIG - 1))
    assert int(fo.LearningContext(traced, ctx.loss).samples_seen) == BIG - 1
    # Traced without x64 it is float32 (JAX has no int64 there): the value, to 7 digits
    inside = jax.jit(lambda c: c.samples_seen)(ctx.replace(samples_seen=3 * BIG + 5))
    assert inside.dtype == jnp.float32 and float(inside) == float(np.float32(3 * BIG + 5))
    stacked = jax.vmap(lambda n: fo.initial_context().replace(samples_seen=n))(jnp.arange(3))
    np.testing.assert_array_equal(stacked.counters.shape, (3, 5))
    wide = stacked.replace(samples_seen=BIG + 1)
    assert np.asarray(wide.samples_seen).tolist() == [BIG + 1] * 3 and np.asarray(wide.samples_seen).dtype == np.int64


def test_samples_seen_is_int64_under_x64_traced_too():
    from functree.optim._context import advance

    with jax.enable_x64(True):
        ctx = fo.initial_context().replace(samples_seen=3 * BIG + 5)
        assert ctx.samples_seen.dtype == jnp.int64 and int(ctx.samples_seen) == 3 * BIG + 5
        inside = jax.jit(lambda c: c.samples_seen)(ctx)
        assert inside.dtype == jnp.int64 and int(inside) == 3 * BIG + 5
        after = jax.jit(lambda c: advance(c, 2**31 - 1))(ctx)
        assert int(after.samples_seen) == 4 * BIG + 4


def test_counters_written_with_four_words_read_in_todays_layout():
    from functree.optim._context import widen_counters

    old = jnp.asarray([[3, 1, 24, 8], [4, 1, 32, 8]], jnp.int32)  # two stacked members, before the high word
    ctx = fo.LearningContext(widen_counters(old), jnp.zeros(2))
    assert np.asarray(ctx.samples_seen).tolist() == [24, 32] and np.asarray(ctx.minibatch_size).tolist() == [8, 8]
    assert widen_counters(ctx.counters) is ctx.counters  # today's five words: as they are


def test_a_state_of_four_counters_kept_another_way_is_named_and_upgraded():
    from functree.optim._context import LearningContext

    opt, w = fo.Optimizer(fo.sgd(0.1, momentum=0.9)), {"w": jnp.ones(2)}
    new = opt.init(w)
    old = new.replace(context=LearningContext(jnp.asarray([7, 1, 56, 8], jnp.int32), new.context.loss))
    with pytest.raises(ValueError, match=r"(?s)shape \(4,\).*before samples_seen took two words.*upgrade_state"):
        fo.context(old)
    ctx = fo.context(fo.upgrade_state(old, opt, w))
    assert (int(ctx.step), int(ctx.sweep), int(ctx.samples_seen), int(ctx.minibatch_size)) == (7, 1, 56, 8)
