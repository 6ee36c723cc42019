"""Hyperparameters as arrays in the state: rate units, reading, setting, no recompiles."""

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


def test_per_samples_rate_with_changing_minibatch_size():
    # per_samples(v, n) on mean gradients: η = v · M / n.
    tx = fo.sgd(fo.per_samples(0.01, 4))
    state = tx.init(_params())
    got = []
    for m in [4, 8, 2, 32]:
        u, state = tx.update(ONE, state, minibatch_size=m)
        got.append(float(u["w"]))
    np.testing.assert_allclose(got, [-0.01, -0.02, -0.005, -0.08], rtol=1e-6)
    assert float(fo.hyperparameters(state)["learning_rate"]) == pytest.approx(0.01)
    state = fo.set_hyperparameters(state, learning_rate=0.1)
    u, _ = tx.update(ONE, state, minibatch_size=8)
    assert float(u["w"]) == pytest.approx(-0.2)


def test_per_samples_decay_rates_are_powers_and_other_hyperparameters_refuse_them():
    """A per-sample momentum was scaled like a learning rate: per_samples(0.9, 1) on
    minibatches of 8 ran momentum 7.2 and diverged. A decay rate takes γ^(M / samples)."""
    tx = fo.sgd(0.1, momentum=fo.per_samples(0.9, 2))
    state, trace, got = tx.init(_params()), 0.0, []
    for m in [8, 2, 5, 1]:
        u, state = tx.update(ONE, state, minibatch_size=m)
        trace = 0.9 ** (m / 2) * trace + 1.0  # u = γ_M u + g, w -= η u
        got.append((float(u["w"]), -0.1 * trace))
    np.testing.assert_allclose(*zip(*got), rtol=0, atol=1e-6)
    tx = fo.adam(0.1, beta1=fo.per_samples(0.9, 1), beta2=fo.per_samples(0.999, 1))
    u, _ = tx.update(ONE, tx.init(_params()), minibatch_size=4)
    assert float(u["w"]) == pytest.approx(-0.1, abs=1e-6)  # bias-corrected first step: -η sign(g)
    for make in (lambda: fo.adam(1e-3, epsilon=fo.per_samples(1e-8, 1)),
                 lambda: fo.adamw(1e-3, weight_decay=fo.per_samples(0.01, 1))):
        with pytest.raises(ValueError, match=r"a per-sample rate is for a learning rate .* or a\ndecay rate"):
            make()


def test_per_minibatch_is_the_plain_number():
    tx = fo.sgd(fo.per_minibatch(0.3))
    u, _ = tx.update(ONE, tx.init(_params()), minibatch_size=64)
    assert float(u["w"]) == pytest.approx(-0.3)


def test_per_samples_with_a_schedule_value():
    tx = fo.sgd(fo.per_samples(fo.piecewise([(1, 0.1), (1, 0.2)]), 1))
    state = tx.init(_params())
    u1, state = tx.update(ONE, state, minibatch_size=2)
    u2, state = tx.update(ONE, state, minibatch_size=3)
    assert (float(u1["w"]), float(u2["w"])) == pytest.approx((-0.2, -0.6))


def test_per_samples_bad_count():
    with pytest.raises(ValueError, match="samples must be a positive int, got 0"):
        fo.per_samples(0.1, 0)


def test_hyperparameters_by_name_and_set():
    tx = optax.chain(fo.clip_by_global_norm(2.0), fo.adam(1e-3, weight_decay=0.1))
    state = tx.init(_params())
    hp = fo.hyperparameters(state)
    assert sorted(hp) == ["beta1", "beta2", "epsilon", "learning_rate", "threshold", "weight_decay"]
    assert float(hp["beta2"]) == pytest.approx(0.999)
    state2 = fo.set_hyperparameters(state, learning_rate=0.5, threshold=1.0)
    hp2 = fo.hyperparameters(state2)
    assert (float(hp2["learning_rate"]), float(hp2["threshold"])) == pytest.approx((0.5, 1.0))
    assert jax.tree.structure(state2) == jax.tree.structure(state)


def test_set_hyperparameters_errors():
    state = fo.adam(fo.cosine_decay(1e-3, 10)).init(_params())
    with pytest.raises(ValueError, match="'learning_rate' follows a schedule"):
        fo.set_hyperparameters(state, learning_rate=1e-4)
    with pytest.raises(KeyError, match=r"no hyperparameter 'lr'\. It has: .*'learning_rate'"):
        fo.set_hyperparameters(state, lr=1e-4)
    with pytest.raises(ValueError, match=r"beta1=1\.5 is out of range"):
        fo.set_hyperparameters(state, beta1=1.5)
    with pytest.raises(ValueError, match=r"'beta1' takes a scalar \(this state is not stacked") as info:
        fo.set_hyperparameters(state, beta1=jnp.ones(2) * 0.5)  # said: jnp.array([...]) # shape ()
    right = next(line.split("right:")[1].strip() for line in str(info.value).splitlines() if "right:" in line)
    fixed = eval(right, {"ft": ft, "state": state})  # ft.optim.set_hyperparameters(state, beta1=0.9)
    np.testing.assert_allclose(fo.hyperparameters(fixed)["beta1"], 0.9, rtol=0, atol=1e-7)
    # the scheduled value is reported
    assert float(fo.hyperparameters(state)["learning_rate"]) == pytest.approx(1e-3)



def test_a_hyperparameter_that_is_no_value_is_refused_when_the_optimizer_is_built():
    """adam([1e-3, 1e-4]) was accepted; init then failed inside JAX ("Cannot stack arrays with
    different numbers of dimensions")."""
    model = {"head": ft.nn.Dense(3, 2, key=jax.random.key(0)), "body": ft.nn.Dense(3, 3, key=jax.random.key(1))}
    with pytest.raises(TypeError, match=r"ft\.optim\.adam: learning_rate is \[0\.001, 0\.0001\], no hyperparameter "
                                        r"value.*One value per group") as info:
        fo.adam([1e-3, 1e-4])
    fixes = [line.split(":", 1)[1].strip() for line in str(info.value).splitlines()
             if line.strip().startswith(("right:", "or:"))]
    assert fixes[0].startswith("ft.optim.adam(") and fixes[0].endswith("learning_rate=1e-3)")
    for fix in fixes:
        state = ft.optim.Optimizer(eval(fix, {"ft": ft})).init(model)
        assert 1e-3 in [pytest.approx(float(v)) for v in fo.hyperparameters(state).values()]
    grouped = fo.hyperparameters(ft.optim.Optimizer(eval(fixes[1], {"ft": ft})).init(model))
    assert sorted(float(v) for k, v in grouped.items() if k.endswith("learning_rate")) == pytest.approx([1e-4, 1e-3])
    for bad, shown in ((jnp.ones(3), r"an array of shape \(3,\)"), ("0.1", "'0.1'"), (None, "None")):
        with pytest.raises(TypeError, match=rf"ft\.optim\.sgd: learning_rate is {shown}, no hyperparameter value"):
            fo.sgd(bad)
    with pytest.raises(TypeError, match=r"beta2 is None.*\n\n    wrong:  ft\.optim\.adam\(learning_rate=0\.001, .*beta2=None\)\n"
                                        r"    right:  ft\.optim\.adam\(learning_rate=0\.001, .*beta2=0\.999\)"):
        fo.adam(1e-3, beta2=None)
    with pytest.raises(TypeError) as info:  # the fix keeps the call's other numbers (it trained at lr 0.01)
        fo.sgd(0.1, momentum=[0.9, 0.8])
    right = next(line.split(":", 1)[1].strip() for line in str(info.value).splitlines() if "right:" in line)
    assert fo.hyperparameters(ft.optim.Optimizer(eval(right, {"ft": ft})).init(model))["learning_rate"] == \
        pytest.approx(0.1)
    for good in (0.1, np.float32(0.1), jnp.float32(0.1), [(2, 0.1), (1, 0.01)], fo.per_samples(0.1, 1),
                 fo.cosine_decay(0.1, 10)):
        fo.sgd(good).init(model)  # still accepted


def test_changing_hyperparameters_does_not_recompile():
    opt = fo.Optimizer(fo.adam(1e-2))
    params = {"w": jnp.array([1.0, -2.0])}
    state = opt.init(params)
    traces = []

    def step(p, s):
        traces.append(1)
        return opt.minimize(lambda p: jnp.sum(p["w"] ** 2), p, s)

    step = ft.jit(step)
    params, state, _ = step(params, state)
    for lr in [1e-3, 0.5, 0.0]:
        state = fo.set_hyperparameters(state, learning_rate=lr, beta1=0.5)
        before = params
        params, state, _ = step(params, state)
    assert len(traces) == 1
    np.testing.assert_array_equal(params["w"], before["w"])  # lr 0 moved nothing


def test_grouped_hyperparameters_are_qualified():
    tx = fo.groups({"a": fo.sgd(0.1), "b": fo.sgd(0.2)})
    p = {"a": jnp.ones(()), "b": jnp.ones(())}
    state = tx.init(p)
    assert float(fo.hyperparameters(state)["b/learning_rate"]) == pytest.approx(0.2)
    state = fo.set_hyperparameters(state, {"a/learning_rate": 1.0})
    u, _ = tx.update(p, state, p)
    assert (float(u["a"]), float(u["b"])) == pytest.approx((-1.0, -0.2))
    state = fo.set_hyperparameters(state, learning_rate=0.0)
    u, _ = tx.update(p, state, p)
    assert (float(u["a"]), float(u["b"])) == (0.0, 0.0)


RATES = [1e-3, 1e-2, 3e-2, 1e-1]
X_SWEEP = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)


def _sweep_loss(m, x):
    return jnp.mean((m(x) - 0.5) ** 2)


@pytest.mark.parametrize("members", [3, 4])
@pytest.mark.parametrize("wrapped", [False, True], ids=["alias", "Optimizer"])
def test_a_vmapped_learning_rate_sweep_reads_per_member_values(members, wrapped):
    """Stacked states read one value per member under each name, as separate runs do."""
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    tx = fo.adam(1e-3)
    opt = fo.Optimizer(tx) if wrapped else None

    def init(lr):
        return fo.set_hyperparameters(opt.init(model) if wrapped else tx.init(model), learning_rate=lr)

    def step(m, s):
        if wrapped:
            return opt.minimize(_sweep_loss, m, s, X_SWEEP)[:2]
        u, s = tx.update(ft.gradient(lambda mm: _sweep_loss(mm, X_SWEEP), at=m), s, m, minibatch_size=8)
        return ft.move(m, along=u), s

    rates = jnp.array(RATES[:members])
    models, states = jax.vmap(lambda lr: (model, init(lr)))(rates)
    sweep, one = jax.jit(jax.vmap(step)), jax.jit(step)
    for _ in range(3):
        models, states = sweep(models, states)
    hp = fo.hyperparameters(states)
    assert sorted(hp) == ["beta1", "beta2", "epsilon", "learning_rate"]
    np.testing.assert_array_equal(hp["learning_rate"], rates)
    np.testing.assert_array_equal(hp["beta2"], np.full(members, 0.999, np.float32))
    np.testing.assert_array_equal(hp["epsilon"], np.full(members, 1e-8, np.float32))
    ctx = fo.context(states)
    np.testing.assert_array_equal(ctx.step, [3] * members)
    np.testing.assert_array_equal(ctx.samples_seen, [24] * members)
    # the members' values indexed in NumPy (no slice compiled per shape)
    weights, nus = np.asarray(models.weight), np.asarray(fo.moments(states)["nu"].weight)
    losses = np.asarray(fo.context(states).loss)
    for i, lr in enumerate(RATES[:members]):  # member i is the separate run with lr
        m, s = model, init(lr)
        for _ in range(3):
            m, s = one(m, s)
        np.testing.assert_allclose(weights[i], m.weight, atol=1e-6)  # weights ~0.5: float32 rounding
        np.testing.assert_allclose(nus[i], fo.moments(s)["nu"].weight, atol=1e-8)
        np.testing.assert_allclose(losses[i], fo.context(s).loss, atol=1e-6)
    # setting one value per member, or one for all
    states = fo.set_hyperparameters(states, learning_rate=rates[::-1], beta1=0.8)
    np.testing.assert_array_equal(fo.hyperparameters(states)["learning_rate"], rates[::-1])
    np.testing.assert_array_equal(fo.hyperparameters(states)["beta1"], np.full(members, 0.8, np.float32))
    with pytest.raises(ValueError, match=rf"one value per member .*\(shape \({members},\)\); given shape \(2,\)"):
        fo.set_hyperparameters(states, learning_rate=jnp.ones(2) * 0.1)
    with pytest.raises(ValueError, match=r"beta1=1\.5 is out of range"):
        fo.set_hyperparameters(states, beta1=jnp.array([0.5] * (members - 1) + [1.5]))


def test_states_stacked_along_a_later_axis_are_an_error_naming_the_fix():
    members = [fo.adam(lr).init({"w": jnp.ones(2)}) for lr in RATES[:3]]
    states = jax.tree.map(lambda *x: jnp.stack(x, axis=-1), *members)
    with pytest.raises(ValueError, match=r"(?s)packed in an array of shape \(4, 3\).*jnp.stack\(x\)"):
        fo.hyperparameters(states)
    with pytest.raises(ValueError, match=r"(?s)counters have shape \(5, 3\).*member axes first"):
        fo.context(states)


@pytest.mark.parametrize("first", ["inference", "training"])
def test_a_standalone_state_serves_the_model_in_either_mode(first):
    """NNX's order: the state built, then ft.nn.training(model). The state is kept mode-free
    (as an Optimizer's), so it fits the gradients of either mode; the updates come back in
    the gradients' mode (ft.move takes them), bit for bit those of a state built after."""
    keys = jax.random.split(jax.random.key(0), 2)
    model = ft.nn.Sequential(ft.nn.Dense(2, 4, key=keys[0]), ft.nn.Dropout(0.5), ft.nn.Dense(4, 1, key=keys[1]))
    before = ft.nn.training(model) if first == "training" else model
    after = ft.nn.inference(model) if first == "training" else ft.nn.training(model)
    tx = ft.optim.adam(1e-2)
    x = jnp.arange(6.0).reshape(3, 2)
    grads = jax.jit(lambda a: ft.gradient(lambda m: m(x, key=jax.random.key(1)).sum(), at=a))(after)
    early, late = tx.init(before), tx.init(after)
    update = jax.jit(tx.update)  # one program for both states (eagerly, each operation compiled apart)
    for _ in range(2):
        u_early, early = update(grads, early, after)
        u_late, late = update(grads, late, after)
    assert jax.tree.structure(u_early) == jax.tree.structure(grads)
    for a, b in zip(jax.tree.leaves(u_early), jax.tree.leaves(u_late)):
        np.testing.assert_array_equal(a, b)
    moved = ft.move(after, along=u_early)
    assert ft.nn.is_training(moved) == (first == "inference")


def test_a_complex_gradient_in_a_bare_transform_warns_with_both_fixes():
    """A bare transform follows optax's complex convention: ft.gradient's (JAX's) complex
    gradients made a torch user's hand loop climb (loss 5.97 -> 9.45), silently."""
    z = {"z": jnp.array([1.0 + 1.0j])}
    grads = jax.jit(lambda z: ft.gradient(lambda p: jnp.sum(jnp.abs(p["z"]) ** 2), at=z))(z)
    tx = fo.adam(0.1)
    with pytest.warns(fo.ComplexGradientWarning, match=r"(?s)ft.optim.adam: a complex gradient.*ft.optim.Optimizer"):
        tx.update(grads, tx.init(z), z)
    opt = fo.Optimizer(fo.adam(0.1))  # torch's numbers, no warning
    moved = jax.jit(lambda g, s: ft.move(z, along=opt.update(g, s, z)[0]))(grads, opt.init(z))  # one program
    assert abs(np.asarray(moved["z"])[0]) < abs(np.asarray(z["z"])[0])  # downhill


def test_float64_parameters_keep_float64_hyperparameters():
    """With x64, a float64 model's hyperparameters were stored in float32: sgd(0.1) stepped
    by 0.10000000149 (−0.030000000447 for −0.03) and Adam was 7.5e-7 off optax's float64 after
    five steps, silently (the results stayed float64). They now follow the parameters: within
    float64 rounding of optax's float64 steps, a schedule and a set value included; float32
    unchanged."""
    with jax.enable_x64(True):
        params = {"w": jnp.array([0.5, -1.25, 2.0], jnp.float64)}
        grads = [{"w": jnp.array([0.3, -0.7, 0.11]) * (k + 1)} for k in range(5)]
        schedule = optax.cosine_decay_schedule(0.1, 10)
        for ours, theirs in [(fo.sgd(0.1), optax.sgd(0.1)), (fo.adam(0.1), optax.adam(0.1)),
                             (fo.adamw(fo.schedule(schedule, unit="steps"), weight_decay=0.01),
                              optax.adamw(schedule, weight_decay=0.01))]:
            state, reference = ours.init(params), theirs.init(params)
            # one program each (eagerly, each operation compiled apart)
            ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
            for g in grads:
                u, state = ours_update(g, state, params)
                with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix ints and floats
                    v, reference = theirs_update(g, reference, params)
                assert u["w"].dtype == jnp.float64  # float32 rates were 4.5e-10 off here: 1e-14 is ~50 ulps
                np.testing.assert_allclose(u["w"], v["w"], rtol=0, atol=1e-14)
        state = fo.set_hyperparameters(fo.sgd(0.1).init(params), learning_rate=1 / 3)
        assert fo.hyperparameters(state)["learning_rate"].dtype == jnp.float64
        np.testing.assert_allclose(fo.sgd(0.1).update(grads[0], state)[0]["w"], -grads[0]["w"] / 3, rtol=0,
                                   atol=1e-15)
        np.testing.assert_allclose(
            fo.sgd(fo.per_samples(0.1, 3)).update(grads[0], fo.sgd(fo.per_samples(0.1, 3)).init(params),
                                                  minibatch_size=7)[0]["w"], -grads[0]["w"] * (0.1 * 7 / 3), rtol=0, atol=1e-15)
    state32 = fo.sgd(0.1).init({"w": jnp.ones(2)})
    assert fo.hyperparameters(state32)["learning_rate"].dtype == jnp.float32


def test_set_hyperparameters_compiles_one_program_and_sets_the_values_jnp_array_gives():
    """ReduceLROnPlateau's first reduction compiled eager programs (each a GPU compile):
    the values read, two conversions, an index, a squeeze, a scatter; now one jitted
    setter, whose values are bit for bit those of the eager ``jnp.array`` before."""
    from _compiles import compiled

    state = fo.adam(1e-2).init({"w": jnp.ones(3)})
    jax.block_until_ready(state)
    with compiled() as names:
        new = fo.set_hyperparameters(state, learning_rate=0.02, beta1=0.8)
        jax.block_until_ready(new)
    assert names == ["jit(_set_columns)"]  # main: unstack, convert_element_type twice, broadcast_in_dim, ...
    given = [0.1, 1 / 3, 3e-8, 1e-40, 2, np.float64(0.7), np.float32(0.25), jnp.float32(0.5), 0.123456789123]
    for value in given:
        got = fo.hyperparameters(fo.set_hyperparameters(state, learning_rate=value))["learning_rate"]
        assert np.asarray(got).tobytes() == np.asarray(jnp.array(value, jnp.float32)).tobytes(), value
    members = jax.vmap(lambda lr: fo.adam(lr).init({"w": jnp.ones(3)}))(jnp.array(RATES))
    for value in ([0.5, 1 / 3, 1e-40, 7.0], np.array(RATES[::-1], np.float64), 0.3):
        got = fo.hyperparameters(fo.set_hyperparameters(members, learning_rate=value, beta1=0.8))
        expected = np.broadcast_to(np.asarray(jnp.array(value, jnp.float32)), (len(RATES),))
        assert np.asarray(got["learning_rate"]).tobytes() == expected.tobytes()
        np.testing.assert_array_equal(got["beta1"], np.full(len(RATES), 0.8, np.float32))


# --- optax.inject_hyperparams: its numeric hyperparameters read and set as functree's ---

def _inject_problem():
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.3])}
    def grads(p):
        return jax.tree.map(lambda x: 2.0 * x + 0.1, p)
    return params, grads


def test_inject_hyperparams_are_read_and_set_exactly_as_optaxs_idiom():
    params, grads = _inject_problem()
    def make():
        return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
    opt, tx = ft.optim.Optimizer(make()), make()
    state, ref = opt.init(params), tx.init(params)
    assert ft.optim.hyperparameters(state)["learning_rate"] == np.float32(1e-2)  # was {}
    assert "learning_rate" in ft.optim.hyperparameter_names(state)
    ours, theirs = params, params

    @jax.jit  # one program each (eagerly, each operation compiled apart)
    def our_step(p, state):
        u, state = opt.update(grads(p), state, p)
        return optax.apply_updates(p, u), state

    @jax.jit
    def their_step(p, ref):
        with jax.numpy_dtype_promotion("standard"):
            v, ref = tx.update(grads(p), ref, p)
        return optax.apply_updates(p, v), ref

    for i in range(5):
        if i == 2:
            state = ft.optim.set_hyperparameters(state, learning_rate=0.05, weight_decay=0.0)  # was KeyError
            ref.hyperparams["learning_rate"] = jnp.asarray(0.05)  # optax's idiom
            ref.hyperparams["weight_decay"] = jnp.asarray(0.0)
        ours, state = our_step(ours, state)
        theirs, ref = their_step(theirs, ref)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)  # values ~1
    assert float(ft.optim.hyperparameters(state)["learning_rate"]) == np.float32(0.05)


def test_a_scheduled_inject_hyperparameter_reads_its_latest_value_and_cannot_be_set():
    params, grads = _inject_problem()
    opt = ft.optim.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(1.0, 0.0, 4)))
    state = opt.init(params)
    _, state = opt.update(grads(params), state, params)
    np.testing.assert_allclose(float(ft.optim.hyperparameters(state)["learning_rate"]), 1.0, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="learning_rate"):
        ft.optim.set_hyperparameters(state, learning_rate=0.5)


def test_trainer_history_logs_an_inject_hyperparams_learning_rate():
    params, _ = _inject_problem()
    def loss(m, b):
        return jnp.sum(m["w"] ** 2) + jnp.sum(m["b"] ** 2) + 0.0 * jnp.sum(b)
    trainer = ft.train.Trainer(params, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), loss)
    history = trainer.fit([jnp.ones(1)] * 3, epochs=1, progress=False)
    np.testing.assert_allclose(np.asarray(history.steps["learning_rate"]), 0.1, rtol=0, atol=1e-8)


def test_inject_hyperparameters_read_survive_a_donating_step():
    """A value read from an inject_hyperparams state is a copy: the next donating train_step
    deleted the state's own array under it (ft's own values were copies already)."""
    opt = ft.optim.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    step = ft.train.train_step(lambda w, x: jnp.sum((w * x) ** 2), opt)
    w = jnp.ones(3)
    state = opt.init(w)
    w, state, _ = step(w, state, 1.0)
    read = ft.optim.hyperparameters(state)
    w, state, _ = step(w, state, 1.0)
    assert float(read["learning_rate"]) == pytest.approx(0.1, abs=1e-7)


def _rebuilt_model():
    return {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}


def _rebuilt_loss(m):
    return jnp.sum(m["w"] ** 2) + m["b"] ** 2


_rebuilt_gradient = jax.jit(lambda m: ft.gradient(_rebuilt_loss, at=m))  # one program for the module


@pytest.mark.parametrize("old, new", [
    (lambda: fo.adam(1e-2), lambda: fo.adam(fo.cosine_decay(2e-2, 10))),
    (lambda: fo.sgd(0.1, momentum=0.9), lambda: fo.sgd(fo.cosine_decay(0.1, 10), momentum=0.9)),
    (lambda: fo.adam(fo.cosine_decay(1e-2, 10)), lambda: fo.adam(1e-3)),
    (lambda: fo.adam(1e-2), lambda: fo.adam(1e-2, weight_decay=0.01)),
], ids=["adam-to-schedule", "sgd-to-schedule", "schedule-to-number", "added-weight-decay"])
def test_a_state_of_an_optimizer_with_other_hyperparameters_is_refused_naming_both(old, new):
    # Before: adam(1e-2)'s packed values read as beta1=0.01, beta2=0.9, eps=0.999 (a silently
    # wrong step), or a bare AssertionError.
    model = _rebuilt_model()
    first = fo.Optimizer(old())
    state = first.init(model)
    model, state = jax.jit(first.apply_gradients)(_rebuilt_gradient(model), model, state)  # one program
    grads = _rebuilt_gradient(model)
    second = fo.Optimizer(new())
    pattern = r"this state was made by an optimizer with other hyperparameters: it stores \((learning_rate|beta1)"
    with pytest.raises(ValueError, match=pattern) as info:
        second.apply_gradients(grads, model, state)
    assert "opt.init(model)" in str(info.value) and "set_hyperparameters" in str(info.value)
    with pytest.raises(ValueError, match=pattern):  # jitted: at trace time
        ft.jit(lambda m, s: second.minimize(_rebuilt_loss, m, s))(model, state)
    with pytest.raises(ValueError, match=pattern):  # before: "Expected None, got JitTracer(float32[1])"
        ft.train.train_step(lambda m, batch: _rebuilt_loss(m), second)(model, state, ())
    jax.jit(second.apply_gradients)(grads, model, second.init(model))  # the fix runs


def test_a_hyperparameter_without_a_value_and_another_transforms_state_are_clear_errors():
    from functree.optim._context import initial_context
    from functree.optim._hyper import _Spec

    with pytest.raises(ValueError, match=r"ft.optim.adam: no value for the hyperparameter 'beta1'"):
        _Spec("beta1", 0.9).effective(initial_context(), None, jnp.float32, "ft.optim.adam")
    with pytest.raises(TypeError, match=r"ft.optim.adam: the state given is a EmptyState, not this optimizer's"):
        fo.adam(1e-3).update({"w": jnp.ones(2)}, optax.EmptyState())


def _donated_state():
    """An optimizer state a train step donated (the old one) and the one it returned."""
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    step = ft.train.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), opt)
    state = opt.init(model)
    _, new_state, _ = step(model, state, (jnp.ones((4, 3)), jnp.ones((4, 1))))
    return state, new_state


def test_hyperparameters_of_a_donated_state_name_the_call_and_the_fix():
    # JAX said only "Array has been deleted with shape=float32[4]".
    old, new = _donated_state()
    with pytest.raises(ValueError, match=r"The input of ft\.optim\.set_hyperparameters\(state, \.\.\.\) holds a "
                                         r"deleted array at state\..*call 1 of the train step donated it"
                                         r"(.|\n)*Use what the step returns"):
        fo.set_hyperparameters(old, learning_rate=0.1)
    with pytest.raises(ValueError, match=r"The input of ft\.optim\.hyperparameters\(state\) holds a deleted array"):
        fo.hyperparameters(old)
    new = fo.set_hyperparameters(new, learning_rate=0.1)  # the returned state: fine
    np.testing.assert_allclose(fo.hyperparameters(new)["learning_rate"], 0.1, rtol=0, atol=1e-8)


ZERO_DECAY = {
    "adamw": (lambda wd: fo.adamw(0.1, weight_decay=wd),
              lambda wd: optax.adamw(0.1, weight_decay=wd, mask={"weight": True, "bias": False})),
    "sgd": (lambda wd: fo.sgd(0.1, weight_decay=wd),
            lambda wd: optax.chain(optax.add_decayed_weights(wd), optax.sgd(0.1))),
}


@pytest.mark.parametrize("name", ZERO_DECAY)
def test_setting_a_weight_decay_built_as_zero_says_why_and_each_fix_sets_it(name):
    """weight_decay=0.0 (the number) builds no decay term, so the state has no weight_decay:
    set_hyperparameters raised a bare "no hyperparameter 'weight_decay'". It says why; each of
    its fixes then steps as optax with that decay (measured <= 6.7e-7 on steps <= 0.2)."""
    ours, reference = ZERO_DECAY[name]
    p = {"weight": jnp.full((2, 2), 2.0), "bias": jnp.full(2, 3.0)}
    g = {"weight": jnp.full((2, 2), 0.5), "bias": jnp.full(2, -0.25)}
    tx = ours(0.0)
    with pytest.raises(KeyError, match=r"no hyperparameter 'weight_decay'(?s:.*)given weight_decay=0 \(the number\) "
                                       r"is built without that term(?s:.*)right: .*weight_decay=1e-4"):
        fo.set_hyperparameters(tx.init(p), weight_decay=0.5)
    with pytest.raises(KeyError, match=r"no hyperparameter 'head\.\*/weight_decay'(?s:.*)given weight_decay=0"):
        fo.set_hyperparameters(fo.groups({"head.*": ours(0.0)}).init({"head": p}), {"head.*/weight_decay": 0.5})

    def steps(tx, state, n=3):
        got, update = [], jax.jit(tx.update)  # one program (eagerly, each operation compiled apart)
        for _ in range(n):
            with jax.numpy_dtype_promotion("standard"):  # optax's adamw: float rates, int counts
                u, state = update(g, state, p)
            got.append(u)
        return got

    expected = steps(reference(0.5), reference(0.5).init(p))
    for built in (1e-4, jnp.asarray(0.0)):  # nonzero, or a zero array: stored and settable
        tx = ours(built)
        for u, e in zip(steps(tx, fo.set_hyperparameters(tx.init(p), weight_decay=0.5)), expected):
            for k in p:
                np.testing.assert_allclose(u[k], e[k], rtol=0, atol=7e-6, err_msg=k)
    tx = ours(fo.piecewise([(1, 0.0), (1, 0.5)]))  # a schedule: 0, then 0.5 from step 1
    got = steps(tx, tx.init(p))
    undecayed = steps(reference(0.0), reference(0.0).init(p), 2)
    np.testing.assert_allclose(got[0]["weight"], undecayed[0]["weight"], rtol=0, atol=7e-6)
    assert not np.allclose(got[1]["weight"], undecayed[1]["weight"], rtol=0, atol=1e-2)  # decayed: 0.1 apart


def test_per_samples_through_an_optimizer_needs_the_minibatch_size():
    """Optimizer.update without minibatch_size ran a per_samples(0.01, 1) rate at M = 1 (the
    context's initial size): -0.01 on a minibatch of 32, where η · M / samples is -0.32.
    Now refused (apply_gradients too, jitted too); given M, the step is NumPy's."""
    x = np.arange(1.0, 33.0, dtype=np.float32)  # a minibatch of 32: loss = mean(w * x)
    opt = ft.optim.Optimizer(fo.sgd(fo.per_samples(0.01, 1), momentum=fo.per_samples(0.5, 4)))
    state = opt.init(_params())
    g = jax.grad(lambda p: jnp.mean(p["w"] * x))(_params())
    wrong = r"learning_rate=ft.optim.per_samples\(0.01, 1\) is a rate per 1 sample(?s:.*)no minibatch_size(?s:.*)" \
            r"wrong: +updates, state = opt.update\(grads, state, model\)\n +right: .*minibatch_size=x.shape\[0\]"
    for call in (lambda: opt.update(g, state, _params()), lambda: opt.apply_gradients(g, _params(), state),
                 lambda: jax.jit(opt.update)(g, state, _params())):
        with pytest.raises(ValueError, match=wrong):
            call()
    u, state = opt.update(g, state, _params(), minibatch_size=32)
    np.testing.assert_allclose(u["w"], -0.01 * 32 * x.mean(), rtol=0, atol=1e-5)  # the first step: no momentum yet
    assert int(fo.context(state).samples_seen) == 32
    u, _ = opt.update(g, state, _params(), minibatch_size=32)  # momentum 0.5^(32 / 4) on the first gradient
    np.testing.assert_allclose(u["w"], -0.01 * 32 * x.mean() * (1 + 0.5 ** 8), rtol=0, atol=1e-5)


def test_minimize_refuses_a_per_samples_rate_on_a_batch_whose_leading_axes_disagree():
    """minimize read M from the first array's leading axis: a time-major x of (T=10, B=2)
    counted 10 samples, a step 5x too large under per_samples. Refused when a per-sample
    rate reads M (naming both leaves); minibatch_size=B gives the step NumPy computes; a
    rate per minibatch never reads M, and is not refused."""
    x, y = np.ones((10, 2), np.float32) * np.arange(1, 11, dtype=np.float32)[:, None], np.ones(2, np.float32)

    def loss_fn(p, x, y):
        return jnp.mean(p["w"] * x.sum(0) * y)

    opt = ft.optim.Optimizer(fo.sgd(fo.per_samples(0.01, 1)))
    state = opt.init(_params())
    with pytest.raises(ValueError, match=r"batch\[0\] has 10 rows, batch\[1\] has 2(?s:.*)"
                                         r"right: .*minibatch_size=y.shape\[0\]"):
        opt.minimize(loss_fn, _params(), state, x, y)
    p, state, _ = opt.minimize(loss_fn, _params(), state, x, y, minibatch_size=2)
    np.testing.assert_allclose(p["w"], -0.01 * 2 * np.mean(x.sum(0) * y), rtol=0, atol=1e-5)  # dL/dw = 55
    assert int(fo.context(state).samples_seen) == 2
    plain = ft.optim.Optimizer(fo.sgd(0.01))
    p, _, _ = plain.minimize(loss_fn, _params(), plain.init(_params()), x, y)
    np.testing.assert_allclose(p["w"], -0.01 * np.mean(x.sum(0) * y), rtol=0, atol=1e-5)


def test_an_update_that_reads_the_parameters_without_the_model_names_the_model():
    # AdamW's weight decay reads the parameters: optax's error names its `params`, while
    # functree's update takes the model (as its third argument).
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    grads = ft.gradient(lambda m: m(jnp.ones((3, 2))).sum(), at=model)
    for tx, where in ((fo.adamw(1e-3), "ft.optim.adamw"),
                      (fo.Optimizer(optax.adamw(1e-3)), "ft.optim.Optimizer.update")):
        state = tx.init(model)
        with pytest.raises(ValueError) as info:
            tx.update(grads, state)
        message = str(info.value)
        assert message.startswith(where) and "no model was given" in message
        assert "right:  updates, state = tx.update(grads, state, model)" in message
        tx.update(grads, state, model)  # the fix runs
