"""Weight averaging: ft.optim.ema / uniform_average, ft.optim.averaged, the Trainer's averaged model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft

X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 1)).astype(np.float32)


def mse(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def iterates(average, steps=8):
    """Train a Dense with sgd and ``average``; the parameters after each step and the state."""
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), average=average)
    state = opt.init(model)
    seen = []
    for _ in range(steps):
        model, state, _ = opt.minimize(mse, model, state, X, Y)
        seen.append(np.asarray(model.weight, np.float64))
    return model, state, seen


def hand_ema(seen, d, debias):
    avg, m = None, 0.0
    for k, p in enumerate(seen, 1):
        if debias:  # optax's debiased EMA: m_k / (1 - d^k), m_0 = 0
            m = d * m + (1 - d) * p
            avg = m / (1 - d**k)
        else:  # copy, then EMA
            avg = p if avg is None else d * avg + (1 - d) * p
    return avg


@pytest.mark.parametrize("debias", [True, False])
def test_ema_equals_a_hand_written_ema(debias):
    model, state, seen = iterates(ft.optim.ema(0.8, debias=debias))
    got = ft.optim.averaged(state, model).weight
    # float32 incremental update vs float64 closed form over 8 steps of O(1) weights
    np.testing.assert_allclose(got, hand_ema(seen, 0.8, debias), rtol=0, atol=1e-6)
    assert not np.allclose(got, model.weight, atol=1e-3)  # an average, not the last iterate


def test_ema_and_uniform_average_equal_torch_averaged_model():
    torch = pytest.importorskip("torch")
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    for average, torch_fn in [(ft.optim.ema(0.8, debias=False), get_ema_multi_avg_fn(0.8)),
                              (ft.optim.uniform_average(), None)]:
        model, state, seen = iterates(average)
        live = torch.nn.Linear(3, 1, bias=False).double()
        swa = AveragedModel(live, multi_avg_fn=torch_fn) if torch_fn else AveragedModel(live)
        for p in seen:
            with torch.no_grad():
                live.weight.copy_(torch.from_numpy(p.T))
            swa.update_parameters(live)
        want = swa.module.weight.detach().numpy().T
        np.testing.assert_allclose(ft.optim.averaged(state, model).weight, want, rtol=0, atol=1e-6)


def test_start_and_every_choose_the_averaged_steps():
    model, state, seen = iterates(ft.optim.uniform_average(start=2, every=3), steps=8)
    # steps 1..8: averaged are 5 and 8 (after start=2, every 3rd)
    np.testing.assert_allclose(ft.optim.averaged(state, model).weight, (seen[4] + seen[7]) / 2, rtol=0, atol=1e-6)
    assert int(state.inner[1].count) == 2 and int(state.inner[1].steps) == 8
    _, state, seen = iterates(ft.optim.ema(0.5, start=4), steps=3)  # before start: follows the model
    np.testing.assert_array_equal(state.inner[1].average.weight, seen[-1])


def test_skipped_steps_leave_the_average_and_low_precision_averages_in_float32():
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ft.nn.Dense(3, 1, key=jax.random.key(0)))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), average=ft.optim.ema(0.99))
    state = opt.init(model)
    assert state.inner[1].average.weight.dtype == jnp.float32
    x, y = X.astype(jnp.bfloat16), Y.astype(jnp.bfloat16)
    result = opt.step(mse, model, state, (x, y), enabled=jnp.array(False))
    jax.tree.map(np.testing.assert_array_equal, result.state, state)
    model, state, _ = opt.minimize(mse, model, state, x, y)
    assert ft.optim.averaged(state, model).weight.dtype == jnp.bfloat16
    # a step skipped by skip_non_finite inside the transform: the average stays too
    w = {"w": jnp.ones(2)}
    opt = ft.optim.Optimizer(ft.optim.skip_non_finite(ft.optim.sgd(0.1)), average=ft.optim.ema(0.5))
    w, state, _ = opt.minimize(lambda p: p["w"].sum(), w, opt.init(w))
    _, skipped = opt.update({"w": jnp.array([jnp.nan, 1.0])}, state, w)
    assert int(skipped.inner[0].skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, skipped.inner[1], state.inner[1])


@pytest.mark.parametrize("average", [ft.optim.ema(0.5), ft.optim.uniform_average(start=1)], ids=["ema", "uniform"])
def test_multisteps_micro_steps_leave_the_average_as_accumulation_does(average):
    """optax.MultiSteps(k=2) updates at every 2nd minibatch: the average is over those 4
    updates, as accumulate=2 on minibatches twice as large (the same parameters); folding
    every minibatch counted each update twice (ema 0.054 off on weights of 1.4)."""
    opts = [ft.optim.Optimizer(optax.MultiSteps(optax.sgd(0.1), 2), average=average),
            ft.optim.Optimizer(optax.sgd(0.1), accumulate=2, average=average)]
    out = []
    for opt, size in zip(opts, (2, 4)):
        model = ft.nn.Dense(3, 1, key=jax.random.key(0))
        state = opt.init(model)
        step = jax.jit(lambda m, s, x, y, opt=opt: opt.minimize(mse, m, s, x, y)[:2])  # one program, not eager ops
        for i in range(0, 16, size):
            model, state = step(model, state, X[i:i + size], Y[i:i + size])
        out.append((model, state))
    (multi, multi_state), (whole, whole_state) = out
    # the same updates in another summation order (float32 rounding of O(1) weights)
    np.testing.assert_allclose(multi.weight, whole.weight, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ft.optim.averaged(multi_state, multi).weight,
                               ft.optim.averaged(whole_state, whole).weight, rtol=0, atol=1e-6)
    assert int(multi_state.inner[1].steps) == int(whole_state.inner[1].steps) == 4


def test_an_average_kept_by_one_group_averages_its_parameters_and_leaves_the_others():
    """An ema chained in one group of ft.optim.groups (ASGD's average alike) holds
    optax.MaskedNode at the other groups' parameters: ft.optim.averaged refused the model
    the state was made for ("made for another model"); now that group's parameters are the
    hand-written EMA of their iterates and the others the model's."""
    model = {"a": ft.nn.Dense(3, 1, key=jax.random.key(0)), "b": ft.nn.Dense(3, 1, key=jax.random.key(1))}
    opt = ft.optim.Optimizer(ft.optim.groups(
        {"a.*": optax.chain(ft.optim.sgd(0.1), ft.optim.ema(0.8, debias=False))}, default=ft.optim.sgd(0.1)))
    state = opt.init(model)
    loss = lambda m, x, y: jnp.mean((m["a"](x) + m["b"](x) - y) ** 2)  # noqa: E731
    seen = []
    for _ in range(6):
        model, state, _ = opt.minimize(loss, model, state, X, Y)
        seen.append(np.asarray(model["a"].weight, np.float64))
    avg = ft.optim.averaged(state, model)
    # float32 incremental update vs float64 closed form over 6 steps of O(1) weights
    np.testing.assert_allclose(avg["a"].weight, hand_ema(seen, 0.8, debias=False), rtol=0, atol=1e-6)
    assert not np.allclose(avg["a"].weight, model["a"].weight, atol=1e-3)
    np.testing.assert_array_equal(avg["b"].weight, model["b"].weight)   # another group's: the model's


def test_frozen_parameters_have_no_average():
    model = ft.nn.training(ft.nn.Sequential([ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2),
                                             ft.nn.Dense(2, 1, key=jax.random.key(1))]))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), average=ft.optim.ema(0.9), wrt="layers.2.*")
    state = opt.init(model)
    average = state.inner[1].average
    assert average.layers[0].weight is None and average.layers[1].running_mean is None
    trained, state, _ = opt.minimize(mse, model, state, X, Y)
    avg = ft.optim.averaged(state, ft.nn.inference(trained))  # any mode: leaf by leaf
    np.testing.assert_array_equal(avg.layers[0].weight, model.layers[0].weight)
    np.testing.assert_array_equal(avg.layers[1].running_mean, trained.layers[1].running_mean)  # statistics: the model's


def test_trainer_averaged_model_evaluation_and_checkpoint(tmp_path):
    loss_fn = lambda m, b: mse(m, *b)  # noqa: E731
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), average=ft.optim.ema(0.9))
    trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), opt, loss_fn)
    data = ft.train.batches((X, Y), batch_size=8, shuffle=False)
    history = trainer.fit(data, epochs=3, validation_data=(X, Y), progress=False)
    avg = trainer.averaged_model
    assert not ft.nn.is_training(avg)
    np.testing.assert_array_equal(avg.weight, ft.optim.averaged(trainer.opt_state, trainer.model).weight)
    want = float(mse(avg, X, Y))
    got = trainer.evaluate((X, Y), batch_size=16, averaged=True)["loss"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, want))
    assert got != trainer.evaluate((X, Y), batch_size=16)["loss"]
    np.testing.assert_allclose(history.epochs["val_averaged_loss"][-1], got, rtol=0, atol=1e-6 * max(1.0, want))
    ft.train.save(tmp_path / "state", trainer.opt_state)
    loaded = ft.train.load(tmp_path / "state")  # no template: AverageState by its registered name
    assert type(loaded.inner[1]).__name__ == "AverageState"
    np.testing.assert_array_equal(ft.optim.averaged(loaded, trainer.model).weight, avg.weight)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_ema_and_uniform_average_used_directly_work_under_strict_promotion(dtype):
    """ema(...).init took the average's dtype from jnp.promote_types(dtype, float32), which
    strict promotion (the suite's, and users') refuses for float64 (x64) and bfloat16."""
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        w = {"w": jnp.array([1.0, -2.0], dtype)}
        for tx in (ft.optim.ema(0.5), ft.optim.uniform_average()):
            state = tx.init(w)
            assert state.average["w"].dtype == (jnp.float64 if dtype == "float64" else jnp.float32)
            _, state = tx.update({"w": jnp.array([1.0, 1.0], dtype)}, state, w)
            # the first averaged step: the average is the new parameters, w + u
            np.testing.assert_allclose(state.average["w"], [2.0, -1.0], rtol=0, atol=1e-6)


def test_average_errors():
    w = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\)"):
        ft.optim.ema(1.0)
    with pytest.raises(ValueError, match="every must be a positive int"):
        ft.optim.ema(0.9, every=0)
    with pytest.raises(ValueError, match="start must be a non-negative int"):
        ft.optim.uniform_average(start=-1)
    with pytest.raises(TypeError, match="average= takes functree's average of the parameters"):
        ft.optim.Optimizer(ft.optim.adam(), average=0.999)
    with pytest.raises(ValueError, match="keeps no averaged parameters") as info:
        ft.optim.averaged(ft.optim.Optimizer(ft.optim.adam()).init(w), w)
    assert "average=ft.optim.ema(0.999)" in str(info.value)
    tx = ft.optim.ema(0.9)
    with pytest.raises(ValueError, match="pass the model"):
        tx.update(w, tx.init(w))
    two = ft.optim.Optimizer(ft.optim.lookahead(ft.optim.sgd(0.1), 2, 0.5), average=ft.optim.ema(0.9))
    with pytest.raises(ValueError, match="made for another model"):
        ft.optim.averaged(ft.optim.Optimizer(ft.optim.sgd(), average=tx).init(w), {"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="keeps 2 averages"):
        ft.optim.averaged(two.init(w), w)


def test_an_optax_ema_is_refused_and_the_fix_averages():
    """optax.ema averages the updates: chained by average= it changed the steps (0.020 off
    plain sgd after 3 steps) and ft.optim.averaged found no average."""
    optax = pytest.importorskip("optax")
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    for other in (optax.ema(0.5), optax.identity()):
        with pytest.raises(TypeError, match=r"optax\.ema averages the updates, not the parameters") as info:
            ft.optim.Optimizer(ft.optim.sgd(0.1), average=other)
    right = next(line.split("right:")[1].strip() for line in str(info.value).splitlines() if "right:" in line)
    assert "average=ft.optim.ema(0.999)" in right
    state = eval(right, {"ft": ft}).init(model)
    np.testing.assert_array_equal(ft.optim.averaged(state, model).weight, model.weight)
    # the fix: the steps are plain sgd's and the average is kept
    trained, state, seen = iterates(ft.optim.ema(0.5), steps=3)
    _, _, plain_seen = iterates(None, steps=3)
    np.testing.assert_array_equal(seen[-1], plain_seen[-1])
    np.testing.assert_allclose(ft.optim.averaged(state, trained).weight, hand_ema(seen, 0.5, True),
                               rtol=0, atol=1e-6)


def test_averaged_of_a_donated_state_or_model_names_the_call_and_the_fix():
    # JAX said "BlockHostUntilReady() called on deleted or donated buffer" at the first use
    # of the result (the old model: not even there when every leaf has an average).
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), average=ft.optim.ema(0.9))
    step = ft.train.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), opt)
    state = opt.init(model)
    new_model, new_state, _ = step(model, state, (jnp.ones((4, 3)), jnp.ones((4, 1))))
    call = r"The input of ft\.optim\.averaged\(state, model\) holds a deleted array at "
    with pytest.raises(ValueError, match=call + r"state\..*call 1 of the train step(.|\n)*Use what the step returns"):
        ft.optim.averaged(state, model)
    with pytest.raises(ValueError, match=call + r"model\.weight"):
        ft.optim.averaged(new_state, model)
    assert ft.optim.averaged(new_state, new_model).weight.shape == (3, 1)


def test_an_average_chained_anywhere_but_last_or_after_multisteps_is_refused():
    """An average in an optax.chain folds θ + u, u the update it is given: chained first it
    folded the gradients (2.6 off the average of the steps' parameters after 8 Adam steps),
    before another transformation it missed that change (0.080), after an optax.MultiSteps
    it folded every minibatch (0.0080). Refused at init; chained last it equals average=."""
    w = {"w": jnp.ones(2)}
    refused = {
        "element 0 of an optax.chain of 2": optax.chain(ft.optim.ema(0.5), optax.adam(0.1)),
        "element 1 of an optax.chain of 3": optax.chain(optax.adam(0.1), ft.optim.uniform_average(), optax.scale(0.5)),
        "ft.optim.lookahead is element 0": optax.chain(ft.optim.lookahead(optax.sgd(0.1), 2, 0.5), optax.clip(1.0)),
        "chained after an optax.MultiSteps": optax.chain(optax.MultiSteps(optax.adam(0.1), 2), ft.optim.ema(0.5)),
        "lookahead is chained after an optax.MultiSteps":
            optax.chain(optax.MultiSteps(optax.adam(0.1), 2), ft.optim.lookahead(optax.sgd(0.1), 2, 0.5)),
    }
    for message, tx in refused.items():
        for average in (None, ft.optim.ema(0.9)):  # also inside Optimizer(average=)'s own pair
            with pytest.raises(ValueError, match=message) as info:
                ft.optim.Optimizer(tx, average=average).init(w)
        fixes = [line.split(":", 1)[1].strip() for line in str(info.value).splitlines()
                 if line.strip().startswith(("right:", "or:"))]
        assert len(fixes) == 2
        for fix in fixes:  # every fix the message shows is taken
            eval(fix, {"ft": ft, "optax": optax}).init(w)
    # chained last (also inside a skip, or averaging inside the MultiSteps): the average of average=
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    got = []
    for opt in (ft.optim.Optimizer(optax.adam(0.1), average=ft.optim.ema(0.5)),
                ft.optim.Optimizer(optax.chain(optax.adam(0.1), ft.optim.ema(0.5))),
                ft.optim.Optimizer(ft.optim.skip_non_finite(optax.chain(optax.adam(0.1), ft.optim.ema(0.5))))):
        m, state = model, opt.init(model)
        for i in range(0, 16, 4):
            m, state, _ = opt.minimize(mse, m, state, X[i:i + 4], Y[i:i + 4])
        got.append(ft.optim.averaged(state, m).weight)
    np.testing.assert_array_equal(got[1], got[0])
    np.testing.assert_array_equal(got[2], got[0])
    ft.optim.Optimizer(optax.MultiSteps(optax.chain(optax.adam(0.1), ft.optim.ema(0.5)), 2)).init(w)
