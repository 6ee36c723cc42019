"""ft.optim.Optimizer: minimize, RFC 234 hooks, wrappers, aggregation, loss scaling, checkpoints."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from _references import optax_lbfgs
from _tolerance import assert_close_trained, needs_float16_conversions

import functree as ft
import functree.optim as fo


def _model():
    return ft.nn.Dense(3, 2, key=jax.random.key(0))


X = jnp.ones((8, 3))
Y = jnp.zeros((8, 2))


def _loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def test_minimize_contract_with_ft_and_optax_transforms():
    for tx in [fo.adam(1e-2), optax.adam(1e-2)]:
        opt = fo.Optimizer(tx)
        model = _model()

        @jax.jit  # the three calls in one program (eager, each op compiled on its own)
        def calls(model, state, opt=opt):
            model2, state, loss = opt.minimize(_loss, model, state, X, Y)
            ctx = fo.context(state)
            model3, state, (_, aux) = opt.minimize(lambda m, x, y: (_loss(m, x, y), m(x)), model2, state, X, Y,
                                                   has_aux=True)
            _, state, _ = opt.minimize(_loss, model3, state, X, Y, minibatch_size=100)
            return loss, ctx, aux, model3, fo.context(state)

        loss, ctx, aux, model3, last = calls(model, opt.init(model))
        assert float(loss) == pytest.approx(float(_loss(model, X, Y)), rel=1e-5)
        assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size)) == (1, 8, 8)
        assert float(ctx.loss) == pytest.approx(float(loss))
        assert aux.shape == (8, 2)
        assert float(_loss(model3, X, Y)) < float(_loss(model, X, Y))
        assert int(last.samples_seen) == 116


def test_compute_then_apply_gradients_equals_minimize():
    opt = fo.Optimizer(fo.sgd(0.1, 0.9))
    model = _model()
    state = opt.init(model)

    @jax.jit  # both ways in one program (eager, each operation compiled on its own)
    def both(model, state):
        loss, grads = opt.compute_gradients(_loss, model, X, Y)
        m1, s1 = opt.apply_gradients(grads, model, state, minibatch_size=8, loss=loss)
        m2, s2, _ = opt.minimize(_loss, model, state, X, Y)
        return m1, s1, m2, s2

    m1, s1, m2, s2 = both(model, state)
    np.testing.assert_array_equal(m1.weight, m2.weight)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b) | jnp.all(jnp.isnan(a))), s1, s2))


def test_hooks_via_constructor_run_in_rfc_order():
    calls = []

    def tag(name, f=lambda g: g):
        def hook(x):
            calls.append(name)
            return f(x)

        return hook

    opt = fo.Optimizer(
        fo.sgd(1.0),
        transform_loss=tag("loss", lambda loss: 2.0 * loss),
        transform_unaggregated_gradients=tag("unaggregated"),
        aggregate_gradients=tag("aggregate"),
        transform_gradients=[tag("clip", lambda g: ft.tree_map(lambda x: jnp.clip(x, -0.5, 0.5), g)), tag("after")],
        apply_updates=lambda m, u: (calls.append("apply"), ft.move(m, along=u))[1],
    )
    p = {"w": jnp.zeros(())}
    p, _, loss = opt.minimize(lambda p: 3.0 * p["w"], p, opt.init(p))
    assert list(dict.fromkeys(calls)) == ["loss", "unaggregated", "aggregate", "clip", "after", "apply"]
    assert float(p["w"]) == -0.5  # d(2·3w)/dw = 6, clipped to 0.5
    assert float(loss) == 0.0  # the reported loss is not transformed


def test_hooks_via_subclass_and_wrappers_compose():
    class Doubling(fo.Optimizer):
        def transform_gradients(self, grads):
            return ft.tree_map(lambda g: 2 * g, grads)

    class Plus(fo.OptimizerWrapper):
        def transform_gradients(self, grads):
            return ft.tree_map(lambda g: g + 1, super().transform_gradients(grads))

    class ScaleLoss(fo.OptimizerWrapper):
        def transform_loss(self, loss):
            return 10.0 * super().transform_loss(loss)

    opt = ScaleLoss(Plus(Doubling(fo.sgd(1.0))))
    p = {"w": jnp.zeros(())}
    p, state, _ = opt.minimize(lambda p: p["w"], p, opt.init(p))
    assert float(p["w"]) == -21.0  # (10 · 1) · 2 + 1
    assert int(fo.context(state).step) == 1
    assert "ScaleLoss(Plus(Doubling(" in repr(opt)


def test_optimizer_is_immutable_and_checks_its_arguments():
    opt = fo.Optimizer(fo.adam())
    with pytest.raises(AttributeError, match="Optimizers are immutable") as info:
        opt.transform = None
    assert "right:  opt = ft.optim.Optimizer(new_transform)" in str(info.value)
    with pytest.raises(AttributeError, match="build a new one instead of assigning 'accumulate'") as info:
        opt.accumulate = 2
    assert "right:  opt = ft.optim.Optimizer(transform, accumulate=2)" in str(info.value)


def test_assigning_a_learning_rate_suggests_set_hyperparameters_and_its_fix_runs():
    """FROZEN_OPTIMIZER's fix was ft.optim.Optimizer(transform, learning_rate=...): a TypeError."""
    model = {"w": jnp.ones(2)}
    opt = fo.Optimizer(fo.adam(1e-3))
    state = opt.init(model)
    with pytest.raises(AttributeError, match=r"'learning_rate' is no option of ft\.optim\.Optimizer") as info:
        opt.learning_rate = 0.01
    fixes = [line.split(":", 1)[1].split("#")[0].strip() for line in str(info.value).splitlines()
             if line.strip().startswith(("right:", "or:"))]
    space = {"ft": ft, "state": state, "model": model}
    exec(fixes[0], space)  # state = ft.optim.set_hyperparameters(state, learning_rate=0.01)
    np.testing.assert_allclose(fo.hyperparameters(space["state"])["learning_rate"], 0.01, rtol=0, atol=1e-9)
    exec(fixes[1], space)  # opt = ft.optim.Optimizer(ft.optim.adam(learning_rate=0.01))
    np.testing.assert_allclose(fo.hyperparameters(space["opt"].init(model))["learning_rate"], 0.01,
                               rtol=0, atol=1e-9)
    with pytest.raises(TypeError, match="needs an optax GradientTransformation"):
        fo.Optimizer(lambda g: g)
    with pytest.raises(TypeError, match=r"transform_gradients= takes functions .* Chain it into the transform"):
        fo.Optimizer(fo.adam(), transform_gradients=optax.clip_by_global_norm(1.0))
    assert isinstance(fo.OptimizerWrapper(fo.adam()).inner, fo.Optimizer)  # a transformation: wrapped
    with pytest.raises(TypeError, match="needs an optax GradientTransformation"):
        fo.OptimizerWrapper(0.1)


def test_default_aggregation_is_the_mean_over_a_bound_axis():
    opt = fo.Optimizer(fo.sgd(1.0), axis_name="data")
    p = {"w": jnp.zeros(())}
    xs = jnp.array([1.0, 2.0, 3.0, 6.0])

    def step(x):
        _, grads = opt.compute_gradients(lambda p, x: p["w"] * x, p, x)
        return grads["w"]

    np.testing.assert_allclose(jax.vmap(step, axis_name="data")(xs), [3.0] * 4)
    with pytest.raises(ValueError, match=r"axis_name='data', but no axis of that name is bound") as info:
        step(xs[0])  # never a silent single replica
    assert "jax.vmap(step, axis_name='data')" in str(info.value)
    custom = fo.Optimizer(fo.sgd(1.0), aggregate_gradients=lambda g: ft.tree_map(lambda x: 10 * x, g))
    _, grads = custom.compute_gradients(lambda p: p["w"], p)
    assert float(grads["w"]) == 10.0


def test_state_is_checkpointable_with_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    model = _model()
    opt = fo.Optimizer(optax.chain(fo.clip_by_global_norm(1.0), fo.adam(fo.piecewise([(2, 0.1), (1, 0.01)]))))
    state = opt.init(model)
    # one compiled step (eager, each of its operations compiled a program of its own)
    model, state, _ = jax.jit(lambda m, s: opt.minimize(_loss, m, s, X, Y))(model, state)
    state = fo.set_hyperparameters(state, threshold=0.5)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "state", opt.init(_model()))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert int(fo.context(restored).step) == 1
    assert float(fo.hyperparameters(restored)["threshold"]) == 0.5
    np.testing.assert_array_equal(fo.moments(restored)["mu"].weight, fo.moments(state)["mu"].weight)


def test_a_jitted_step_donates_and_never_recompiles():
    opt = fo.LossScaleOptimizer(fo.Optimizer(optax.chain(fo.clip(1.0), fo.adamw(1e-2)), accumulate=2))
    model = _model()
    state = opt.init(model)
    traces = []

    def step(m, s, x, y):
        traces.append(1)
        return opt.minimize(_loss, m, s, x, y)

    step = ft.jit(step, donate=(0, 1))
    for i in range(5):
        model, state, _ = step(model, state, X + i, Y)
        state = fo.set_hyperparameters(fo.next_sweep(state), learning_rate=1e-2 / (i + 1))
    assert len(traces) == 1
    ctx = fo.context(state)
    assert (int(ctx.step), int(ctx.sweep), int(ctx.samples_seen)) == (5, 5, 40)


_STEADY = {
    "adam": lambda: fo.adam(0.1), "sgd momentum": lambda: fo.sgd(0.1, momentum=0.9),
    "lion": lambda: fo.lion(0.1), "radam": lambda: fo.radam(0.1), "adadelta": lambda: fo.adadelta(1.0),
    "skip + ema": lambda: optax.chain(fo.skip_non_finite(fo.adam(0.1)), fo.ema(0.9)),
    "lookahead": lambda: fo.lookahead(fo.sgd(0.1), 2, 0.5),
    "reduce_on_plateau": lambda: optax.chain(fo.sgd(0.1), fo.reduce_on_plateau(patience=1)),
    "optax.lbfgs": lambda: optax.lbfgs(), "optax.adafactor": lambda: optax.adafactor(0.1),
}


@pytest.mark.parametrize("make", _STEADY.values(), ids=_STEADY.keys())
def test_a_step_returns_the_state_types_init_made(make):
    """A jitted step compiles once only if the state it returns has the types it was given:
    optax.lbfgs's initial line-search counts were weakly typed and came back strong."""
    opt = fo.Optimizer(make())
    model = _model()
    state = opt.init(model)
    # traced, not run: the types a jitted step's trace gives its output are what decides a
    # recompile (eager, each operation of the step compiled a program of its own)
    _, after, _ = jax.eval_shape(lambda m, s: opt.minimize(_loss, m, s, X, Y), model, state)

    def types(tree):
        return [(jax.tree_util.keystr(p), x.shape, x.dtype, x.weak_type)
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]

    assert jax.tree.structure(after) == jax.tree.structure(state)
    assert types(after) == types(state)


class Normed(ft.Module):
    dense: ft.nn.Dense
    running_mean: jax.Array = ft.field(no_derivative=True)
    calls: jax.Array = ft.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.dense(x - jax.lax.broadcast_to_rank(self.running_mean, x.ndim))


def test_models_with_non_parameters_keep_them_untouched():
    model = Normed(_model(), jnp.full((3,), 0.5))
    opt = fo.Optimizer(fo.adamw(0.1, weight_decay=0.5))
    state = opt.init(model)
    assert fo.moments(state)["mu"].running_mean is None and fo.moments(state)["mu"].calls is None
    new, state, _ = ft.jit(lambda m, s: opt.minimize(_loss, m, s, X, Y))(model, state)
    np.testing.assert_array_equal(new.running_mean, model.running_mean)
    assert new.calls.dtype == jnp.int32 and int(new.calls) == 0
    assert not np.allclose(new.dense.weight, model.dense.weight)
    # the same transform used directly as an optax transform over the parameter view
    tx = fo.adamw(0.1, weight_decay=0.5)

    @jax.jit  # one program (eager, each operation compiled on its own)
    def direct(model):
        view = ft.parameters(model)
        grads = ft.gradient(lambda m: _loss(m, X, Y), at=model)
        updates, _ = tx.update(grads, tx.init(view), view)
        return ft.move(model, along=updates)

    assert_close_trained(direct(model).dense.weight, new.dense.weight, spread=2e-8)  # measured max 1.7e-8


def test_data_parallel_replicas_keep_identical_state():
    # Each replica sees another shard; gradients and the stored loss are means over the
    # axis, so model and optimizer state come out unmapped (identical on every replica).
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), axis_name="r")
    model = {"w": jnp.ones(3)}
    state = opt.init(model)
    shards = jnp.arange(12.0).reshape(4, 1, 3)

    def loss(m, x):
        return jnp.sum((m["w"][None, :] * x) ** 2)

    new_model, new_state, losses = jax.jit(jax.vmap(  # jitted: one compile, not one per batched op
        lambda x: opt.minimize(loss, model, state, x), axis_name="r", out_axes=(None, None, 0)
    ))(shards)
    grads = jnp.mean(jax.jit(jax.vmap(lambda x: jax.grad(loss)(model, x)["w"]))(shards), axis=0)
    assert_close_trained(new_model["w"], model["w"] - 0.1 * grads, spread=0)  # measured 0: one rounding allowed
    assert_close_trained(ft.optim.context(new_state).loss, jnp.mean(losses), spread=0)


def test_a_misspelt_axis_name_is_an_error_not_a_single_replica():
    opt = fo.Optimizer(fo.sgd(0.1), axis_name="btach")
    w = {"w": jnp.zeros(2)}
    state = opt.init(w)
    xs = jnp.array([[1.0, 3.0], [3.0, 1.0]])
    def step(x):
        return opt.minimize(lambda p, x: -jnp.sum(p["w"][None, :] * x), w, state, x[None])[0]
    with pytest.raises(ValueError, match="axis_name='btach'"):
        jax.jit(jax.vmap(step, axis_name="batch"))(xs)  # jitted, as the right one below: one compile
    right = fo.Optimizer(fo.sgd(0.1), axis_name="batch")
    new = jax.jit(jax.vmap(lambda x: right.minimize(lambda p, x: -jnp.sum(p["w"][None, :] * x), w, right.init(w), x[None])[0],
                           axis_name="batch"))(xs)
    np.testing.assert_allclose(new["w"], [[0.2, 0.2], [0.2, 0.2]], rtol=1e-6)


@pytest.mark.parametrize("make", [lambda: fo.adam(0.1), lambda: fo.sgd(0.1, momentum=0.9),
                                  lambda: optax.chain(fo.clip_by_global_norm(1.0), fo.adamw(0.1))])
def test_a_none_gradient_means_no_update(make):
    """A partial gradient (ft.gradient(wrt=...)) leaves the other parameters and their moments."""
    model = ft.nn.Sequential([ft.nn.Dense(3, 4, key=jax.random.key(0)), ft.nn.Dense(4, 2, key=jax.random.key(1))])
    opt = fo.Optimizer(make())

    @jax.jit  # both steps in one program: one compile per optimizer
    def steps(model, state):
        full = ft.gradient(lambda m: _loss(m, X, Y), at=model)
        model, state = opt.apply_gradients(full, model, state)  # moments become non-zero everywhere
        grads = ft.gradient(lambda m: _loss(m, X, Y), at=model, wrt="layers.1.*")
        return model, state, grads, *opt.apply_gradients(grads, model, state)

    model, state, grads, new_model, new_state = steps(model, opt.init(model))
    assert grads.layers[0].weight is None and grads.layers[1].weight is not None
    np.testing.assert_array_equal(new_model.layers[0].weight, model.layers[0].weight)
    np.testing.assert_array_equal(new_model.layers[0].bias, model.layers[0].bias)
    assert not np.array_equal(new_model.layers[1].weight, model.layers[1].weight)
    for name, moment in fo.moments(new_state).items():
        np.testing.assert_array_equal(moment.layers[0].weight, fo.moments(state)[name].layers[0].weight)
    assert int(fo.context(new_state).step) == 2


def test_a_gradient_for_a_non_parameter_is_an_error_naming_it():
    model = ft.nn.BatchNorm(2)
    opt = fo.Optimizer(fo.sgd(0.1))
    grads = jax.tree.map(jnp.ones_like, model)  # running statistics are not parameters
    with pytest.raises(ValueError, match=r"at running_mean: the leaf is not a parameter"):
        opt.update(grads, opt.init(model), model)


def test_minimize_updates_layer_state_of_a_model_in_training_mode():
    """BatchNorm statistics follow the data in a hand-written minimize loop."""
    model = ft.nn.training(ft.nn.Sequential([ft.nn.BatchNorm(4, momentum=0.9), ft.nn.Dense(4, 1, key=jax.random.key(0))]))
    opt = fo.Optimizer(fo.adam(1e-2))
    state = opt.init(model)
    x = 5.0 + jax.random.normal(jax.random.key(1), (32, 4))
    step = ft.jit(lambda m, s, x: opt.minimize(lambda m, x: jnp.mean((m(x) - 1.0) ** 2), m, s, x), donate=(0, 1))
    for _ in range(100):
        model, state, _ = step(model, state, x)
    np.testing.assert_allclose(model.layers[0].running_mean, x.mean(0), rtol=1e-3)  # 0.9^100: converged


A = jnp.array(1.0 + 2.0j, jnp.complex64)


def _distance(m):
    return jnp.abs(m["z"] - A) ** 2


@pytest.mark.parametrize("make", [lambda: fo.sgd(0.1), lambda: fo.adam(0.1), lambda: optax.adam(0.1)])
def test_complex_parameters_descend_through_minimize_update_and_train_step(make):
    """SGD on |z − a|² diverged (6.25 → 2.3e32 in 100 steps) and Adam's loss rose (6.25 →
    210): JAX's gradient of a real loss is the conjugate of the descent direction."""
    opt = fo.Optimizer(make())
    z = {"z": jnp.array(-0.5 + 0.0j, jnp.complex64)}

    def by_minimize_and_update(_, carry):
        (m1, s1), (m2, s2) = carry
        m1, s1, _ = opt.minimize(_distance, m1, s1)
        updates, s2 = opt.update(ft.gradient(_distance, at=m2), s2, m2)  # ft.gradient's (JAX's) convention
        return (m1, s1), (ft.move(m2, along=updates), s2)

    # the 100 steps of both hand-written loops in one compiled program (eager, every op of
    # every step was dispatched one by one)
    loops = jax.jit(lambda m, s: jax.lax.fori_loop(0, 100, by_minimize_and_update, ((m, s), (m, s))))
    (m1, _), (m2, _) = loops(z, opt.init(z))
    step = ft.train.train_step(lambda m, b: _distance(m), opt, donate=False)
    m3, s3 = z, opt.init(z)
    for _ in range(100):
        m3, s3, _ = step(m3, s3, jnp.zeros(1))
    for m in (m1, m2, m3):
        assert float(_distance(m)) < 1e-3  # from 6.25
    np.testing.assert_allclose(m1["z"], m2["z"], rtol=0, atol=1e-6)


def test_complex_moments_are_pairs_of_reals_and_real_models_are_untouched():
    opt = fo.Optimizer(fo.adam(0.1))
    z = {"z": jnp.array([3.0 + 6.0j], jnp.complex64), "w": jnp.ones(2)}
    # one program (eager, each operation compiled on its own)
    _, state, _ = jax.jit(lambda z, s: opt.minimize(lambda m: _distance(m).sum() + jnp.sum(m["w"] ** 2), z, s))(
        z, opt.init(z))
    nu = fo.moments(state)["nu"]
    assert isinstance(nu["z"], fo.RealPair)
    # torch's second moments: one per real component of the gradient 2(z − a) = (4, 8)
    np.testing.assert_allclose(nu["z"].real, 0.001 * 4.0**2, rtol=0, atol=1e-6)  # |g|²: 0.08
    np.testing.assert_allclose(nu["z"].imag, 0.001 * 8.0**2, rtol=0, atol=1e-6)
    real = {"w": jnp.ones(2)}
    assert jax.tree.structure(fo.moments(fo.Optimizer(fo.adam()).init(real))["nu"]) == jax.tree.structure(real)


def _rosenbrock(p):
    x = p["x"]
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def test_lbfgs_through_minimize_and_update_equals_optax_loop():
    """ft.optim.Optimizer(optax.lbfgs()) raised optax's "missing ... 'value', 'grad', and
    'value_fn'" in minimize, and Optimizer.update rejected those keywords."""
    start = {"x": jnp.array([-1.2, 1.0, -0.5, 0.8])}
    expected = optax_lbfgs(_rosenbrock, start, 10)
    opt = fo.Optimizer(optax.lbfgs())

    @jax.jit  # both ways in one program: L-BFGS's line search makes each a large one to compile
    def step(p, s, q, s_q):
        p, s, _ = opt.minimize(_rosenbrock, p, s)
        # the keywords given by hand: value_fn takes the model, as loss_fn
        value, grads = ft.value_with_gradient(_rosenbrock, at=q)
        updates, s_q = opt.update(grads, s_q, q, value=value, value_fn=_rosenbrock)
        return p, s, ft.move(q, along=updates), s_q

    # optax's initial state holds weakly typed line-search counts that a step returns
    # strongly typed: Optimizer.init makes them strong, so the step compiles once.
    state = opt.init(start)
    p, state, q, state_q = start, state, start, state
    for _ in range(10):
        p, state, q, state_q = step(p, state, q, state_q)
    assert step._cache_size() == 1
    np.testing.assert_allclose(p["x"], expected["x"], rtol=0, atol=1e-6)  # |x| ≤ 1.2
    np.testing.assert_allclose(q["x"], expected["x"], rtol=0, atol=1e-6)
    assert float(_rosenbrock(expected)) < float(_rosenbrock(start)) / 10


class _DroppedRosenbrock(ft.Module):
    """Rosenbrock's parameters behind a Dropout(0.0): a layer with a training flag."""
    x: jax.Array
    drop: ft.nn.Dropout

    def __call__(self):
        return _rosenbrock({"x": self.drop(self.x)})


def test_lbfgs_line_search_runs_on_a_model_in_training_mode():
    """A model with a Dropout in training mode (as the Trainer trains it) under L-BFGS:
    its line search wrote the optimizer's mode-free parameters (training off) into the
    training-mode model, refused by ft.with_parameters as another tree. Now the trial
    points take the model's mode: the same steps as the model in inference mode."""
    start = _DroppedRosenbrock(jnp.array([-1.2, 1.0, -0.5, 0.8]), ft.nn.Dropout(0.0))
    opt = fo.Optimizer(optax.lbfgs())
    step = jax.jit(lambda m, s: opt.minimize(lambda q: q(), m, s))
    trained, frozen = ft.nn.training(start), start
    state_t = state_f = opt.init(start)
    for _ in range(3):
        trained, state_t, _ = step(trained, state_t)
        frozen, state_f, _ = step(frozen, state_f)
    assert trained.drop.training
    np.testing.assert_allclose(trained.x, frozen.x, rtol=0, atol=1e-6)  # |x| ≤ 1.2


def test_a_complex_parameter_without_a_gradient_keeps_its_moments():
    opt = fo.Optimizer(fo.adam(0.1))
    z = {"z": jnp.array([3.0 + 6.0j], jnp.complex64), "w": jnp.ones(2)}

    @jax.jit  # one program (eager, each operation compiled on its own)
    def steps(z, state):
        _, state, _ = opt.minimize(lambda m: _distance(m).sum() + jnp.sum(m["w"] ** 2), z, state)
        return state, *opt.update({"z": None, "w": jnp.ones(2)}, state, z)

    state, updates, new = steps(z, opt.init(z))
    assert updates["z"] is None
    before, after = fo.moments(state), fo.moments(new)
    for name in ("mu", "nu"):
        np.testing.assert_array_equal(after[name]["z"].real, before[name]["z"].real)
        np.testing.assert_array_equal(after[name]["z"].imag, before[name]["z"].imag)
    assert not np.array_equal(after["mu"]["w"], before["mu"]["w"])


def test_accumulated_microbatches_get_their_own_keys_and_equal_the_steps_by_hand():
    """Issue 27 item 5: with accumulate=k and a key, microbatch i gets fold_in(key, i):
    dropout masks differ across microbatches, and the accumulated gradient is the mean of
    the k microbatches' gradients computed by hand with those keys."""
    k, rows = 4, 8
    drop = ft.nn.training(ft.nn.Dropout(0.5))
    model = _model()

    def loss(m, batch, *, key):  # aux: the dropout mask of each row
        x, y = batch
        mask = drop(jnp.ones((x.shape[0], 16)), key=key)
        return jnp.mean((m(x) * mask[:, :2] - y) ** 2), mask

    x = jax.random.normal(jax.random.key(1), (rows, 3))
    y = jnp.ones((rows, 2))
    base = jax.random.key(7)
    opt = fo.Optimizer(fo.sgd(0.1), accumulate=k)
    result = opt.step(loss, model, opt.init(model), ((x, y),), has_aux=True, key=base)
    masks = result.out[1].reshape(k, rows // k, 16)
    assert all(not np.array_equal(masks[0], masks[i]) for i in range(1, k))  # main: all equal

    size = rows // k

    @jax.jit  # the k gradients by hand in one program
    def by_hand(model):
        grads = [ft.gradient(lambda m, i=i: loss(m, (x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]),
                                                 key=jax.random.fold_in(base, i))[0], at=model)
                 for i in range(k)]
        mask = loss(model, (x[size:2 * size], y[size:2 * size]), key=jax.random.fold_in(base, 1))[1]
        return jax.tree.map(lambda *g: sum(g) / k, *grads), mask

    mean, mask = by_hand(model)
    # float32 reassociation of the k-term sum, on gradients of magnitude < 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), result.grads, mean)
    np.testing.assert_array_equal(masks[1], np.asarray(mask))


def test_state_made_before_training_mode_serves_the_model_in_training_mode():
    # NNX's order (nnx.Optimizer(model), then model.train()): the mode is static, in the
    # tree definition; the optimizer keeps its state mode-free.
    key = jax.random.key(0)
    model = ft.nn.Sequential(ft.nn.Dense(2, 3, key=key), ft.nn.Dropout(0.5), ft.nn.Dense(3, 1, key=key))
    opt = fo.Optimizer(fo.adam(1e-2))
    before, after = opt.init(model), opt.init(ft.nn.training(model))
    assert jax.tree.structure(before) == jax.tree.structure(after)
    step = ft.train.train_step(lambda m, b, key: jnp.mean(m(b, key=key) ** 2), opt, donate=False)
    trained = ft.nn.training(model)
    new, _, _ = step(trained, before, jnp.ones((4, 2)), key=key)
    same, _, _ = step(trained, after, jnp.ones((4, 2)), key=key)
    assert ft.nn.is_training(new)  # the updates came back in the model's mode (ft.move took them)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)


def test_init_compiles_only_what_optax_init_does():
    # On a GPU each eager operation compiles a program of its own: the learning context and
    # the hyperparameters are put from the host, so init adds no program to optax's own.
    from _compiles import compiled

    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    with compiled() as ours:
        state = fo.Optimizer(fo.adamw(1e-3, weight_decay=0.1)).init(params)
    with compiled() as optax_own:
        optax.adamw(1e-3, weight_decay=0.1).init(params)
    assert sorted(ours) == sorted(optax_own)
    assert fo.hyperparameters(state)["learning_rate"].dtype == jnp.float32
    np.testing.assert_allclose(float(fo.hyperparameters(state)["learning_rate"]), 1e-3, rtol=1e-7)
    assert fo.context(state).step == 0 and bool(jnp.isnan(fo.context(state).loss))


# ---- the finiteness the gate checks is the gradients' own, before the hooks ------------------

def _clip(grads):  # Optimizer's docstring's hook: torch's clip_grad_value_(1.0)
    return ft.tree_map(lambda g: jnp.clip(g, -1.0, 1.0), grads)


def _inf_gradient(p, *batch):  # a finite loss (2e38) whose gradient (4e38) is inf in float32
    return jnp.sum(p["w"] ** 2 * 2e38) + jnp.sum(p["b"] ** 2)


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_a_clip_hook_does_not_hide_an_infinite_gradient_from_on_nan(on_nan):
    """transform_gradients ran before the gate's finiteness check: jnp.clip made the inf
    gradient 1, and on_nan="stop"/"skip" applied the step with nonfinite=-1. The gate now
    sees the gradients as they were before the hooks (nonfinite names "w", leaf 1)."""
    p = {"b": jnp.ones(2), "w": jnp.ones(1)}
    for hooks in ({"transform_gradients": _clip}, {"transform_unaggregated_gradients": [_clip, _clip]}):
        opt = fo.Optimizer(fo.sgd(0.1), **hooks)
        result = ft.jit(lambda p, s, opt=opt: opt.step(_inf_gradient, p, s, (), on_nan=on_nan))(p, opt.init(p))
        assert int(result.nonfinite) == 1
        jax.tree.map(np.testing.assert_array_equal, result.model, p)
        assert int(fo.context(result.state).step) == 0
        assert np.isnan(np.asarray(result.grads["w"])).all()
        np.testing.assert_array_equal(result.grads["b"], [1.0, 1.0])  # a finite leaf as the hook made it
    step = ft.train.train_step(_inf_gradient, opt, on_nan="skip", donate=False)
    moved, _, metrics = step(p, opt.init(p), (jnp.zeros(1),))
    assert int(metrics["nonfinite"]) == 1 and np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, moved, p)


def test_an_unchecked_step_applies_the_hooks_output_as_torch_without_a_scaler():
    """on_nan="ignore" (minimize) checks nothing: the clipped gradient is applied, as torch's
    clip_grad_value_ then step does without a GradScaler."""
    torch_w = torch.ones(1, requires_grad=True)
    (torch_w**2 * 2e38).sum().backward()
    torch.nn.utils.clip_grad_value_([torch_w], 1.0)
    torch.optim.SGD([torch_w], lr=0.1).step()
    opt = fo.Optimizer(fo.sgd(0.1), transform_gradients=_clip)
    p = {"b": jnp.ones(2), "w": jnp.ones(1)}
    w, _, _ = jax.jit(lambda p, s: opt.minimize(_inf_gradient, p, s))(p, opt.init(p))  # one program
    np.testing.assert_array_equal(np.asarray(w["w"]), torch_w.detach().numpy())  # 0.9
    np.testing.assert_array_equal(np.asarray(w["b"]), np.float32(1) - np.float32(0.1))  # 1 - 0.1 * clip(2)


def test_an_overflow_on_one_replica_closes_every_replicas_gate():
    """Each replica marks its own non-finite gradient before the hooks; the mean over the
    axis carries it to all of them, so they skip together (state kept identical)."""
    opt = fo.Optimizer(fo.sgd(0.1), axis_name="r", transform_unaggregated_gradients=_clip,
                       transform_gradients=_clip)
    p = {"w": jnp.ones(())}
    state = opt.init(p)
    scales = jnp.array([1.0, 1.0, 1e38, 1.0])  # replica 2's gradient is 4e38: inf

    def step(s):
        r = opt.step(lambda p, s: p["w"] ** 2 * s * 2.0, p, state, (s,), on_nan="skip")
        return r.model, r.nonfinite

    model, nonfinite = jax.jit(jax.vmap(step, axis_name="r", out_axes=(None, 0)))(scales)
    assert float(model["w"]) == 1.0
    np.testing.assert_array_equal(nonfinite, [0, 0, 0, 0])
    model, nonfinite = jax.jit(jax.vmap(step, axis_name="r", out_axes=(None, 0)))(jnp.ones(4))
    np.testing.assert_allclose(float(model["w"]), 0.9, rtol=0, atol=1e-7)  # 1 - 0.1 * clip(4): applied
    np.testing.assert_array_equal(nonfinite, [-1, -1, -1, -1])


def test_keep_nonfinite_marks_leaves_and_a_changed_structure():
    from functree.optim._skip import keep_nonfinite

    g = {"a": jnp.array([jnp.inf, 0.5]), "b": jnp.ones(2)}
    assert keep_nonfinite(g, g) is g  # no hook: nothing computed
    same_b = keep_nonfinite(g, {"a": jnp.zeros(2), "b": g["b"]})
    assert same_b["b"] is g["b"] and np.isnan(same_b["a"]).all()
    merged = keep_nonfinite(g, {"both": jnp.zeros(2), "n": jnp.zeros(1, jnp.int32)})
    assert np.isnan(merged["both"]).all() and merged["n"].dtype == jnp.int32
    fine = {"a": jnp.ones(2)}
    np.testing.assert_array_equal(keep_nonfinite(fine, {"x": jnp.full(2, 3.0)})["x"], [3.0, 3.0])


@pytest.mark.parametrize("trainer", [False, True])
def test_optax_multisteps_takes_the_optimizers_extra_arguments_and_refuses_a_functree_one(trainer):
    """optax.MultiSteps is no GradientTransformationExtraArgs but forwards update's extra
    arguments to the optimizer it wraps, at every micro-step: optax's adam inside equals
    optax run by hand; a functree optimizer inside would count micro-steps as steps (a
    schedule k times too fast: it refused its state before, misleadingly) and is refused
    for accumulate=k, which is the same accumulation."""
    loss = lambda p, b=None: jnp.sum((p["w"] - 0.5) ** 2)  # noqa: E731
    reference = {"w": jnp.ones(3)}
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    state = tx.init(reference)

    @jax.jit  # a step is one program (eager, each of its operations compiled one)
    def by_hand(reference, state):
        updates, state = tx.update(jax.grad(loss)(reference), state, reference)
        return optax.apply_updates(reference, updates), state

    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and float
        for _ in range(4):
            reference, state = by_hand(reference, state)
    if trainer:
        t = ft.train.Trainer({"w": jnp.ones(3)}, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), loss)
        t.fit([None] * 4, epochs=1, progress=False)
        params = t.model
    else:
        opt = ft.optim.Optimizer(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))
        params = {"w": jnp.ones(3)}
        opt_state = opt.init(params)
        step = jax.jit(lambda p, s: opt.minimize(loss, p, s))  # one program, as the Trainer's
        for _ in range(4):
            params, opt_state, _ = step(params, opt_state)
    np.testing.assert_allclose(params["w"], reference["w"], rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(params["w"] - 1.0))) > 1e-2  # two applied steps
    scheduled = ft.optim.sgd(ft.optim.schedule(optax.linear_schedule(1.0, 0.0, 4), unit="steps"))
    with pytest.raises(TypeError, match=r"(?s)MultiSteps wraps a functree optimizer.*accumulate=4"):
        ft.optim.Optimizer(optax.MultiSteps(scheduled, every_k_schedule=2)).init({"w": jnp.ones(3)})


def test_a_bool_mask_built_in_training_mode_is_named_at_init():
    """optax.masked uses a bool mask tree as it is: one built from the model in training mode
    has another structure than the mode-free parameters the optimizer passes (JAX's error
    named neither); one built in inference mode trains as raw optax does."""
    net = ft.nn.Sequential(ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.Dropout(0.1))
    training = ft.nn.training(net)
    with pytest.raises(ValueError, match=r"(?s)mask or label tree.*right:  optax.masked\(tx, ft.mask\(ft.nn.inference"):
        ft.optim.Optimizer(optax.masked(optax.sgd(0.1), ft.mask(training, "*.weight"))).init(training)
    decay = optax.masked(optax.add_decayed_weights(0.5), ft.mask(net, "*.weight"))
    opt = ft.optim.Optimizer(optax.chain(decay, optax.sgd(0.1)))
    state = opt.init(training)

    @jax.jit  # one program (eager, each operation compiled on its own)
    def step(training, state):
        grads = ft.gradient(lambda m: jnp.sum(m(jnp.ones((1, 2)), key=jax.random.key(1))), at=training)
        return grads, opt.apply_gradients(grads, training, state)[0]

    grads, moved = step(training, state)
    w = training.layers[0].weight
    np.testing.assert_allclose(moved.layers[0].weight, w - 0.1 * (grads.layers[0].weight + 0.5 * w), rtol=0, atol=1e-7)
    # masked out: optax passes the update through undecayed
    np.testing.assert_allclose(moved.layers[0].bias, training.layers[0].bias - 0.1 * grads.layers[0].bias, rtol=0,
                               atol=1e-7)


def test_multisteps_as_a_gradient_transformation_around_a_functree_optimizer_is_refused_too():
    for tx in (optax.MultiSteps(ft.optim.sgd(0.1), 2).gradient_transformation(),
               optax.chain(optax.clip(1.0), optax.MultiSteps(ft.optim.sgd(0.1), 2).gradient_transformation())):
        with pytest.raises(TypeError, match="MultiSteps wraps a functree optimizer"):
            ft.optim.Optimizer(tx).init({"w": jnp.ones(2)})
    ft.optim.Optimizer(optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()).init({"w": jnp.ones(2)})


def test_a_mask_missing_a_key_shows_jaxs_own_error_beside_the_fix():
    with pytest.raises(ValueError, match=r"(?s)mask or label tree.*JAX: .*"):
        ft.optim.Optimizer(optax.masked(optax.sgd(0.1), {"a": True})).init({"a": jnp.ones(2), "b": jnp.ones(2)})


# --- a state made for another structure (functree/optim/_checks.py: check_state_fits) -----------
class Chain(ft.Module):
    ws: list

    def __call__(self, x):
        for w in self.ws:
            x = x * w
        return x


def _chain_loss(m, b):
    return jnp.sum(m(b))


@pytest.mark.parametrize("tx", [fo.adam(0.1), optax.adam(0.1), optax.sgd(0.1, momentum=0.9)], ids=["ft", "optax", "trace"])
def test_update_with_a_state_made_for_another_structure_names_the_key_path(tx):
    opt = fo.Optimizer(tx)
    model = Chain([jnp.ones(2)])
    state = opt.init(model)
    model.ws.append(jnp.full(2, 2.0))  # the list itself is mutable: the model's structure changed
    grads = ft.gradient(lambda m: _chain_loss(m, jnp.ones(2)), at=model)
    # was: ValueError "pytree structure error: different lengths of list at key path tree_map tree.ws"
    # from optax's update_moment
    match = r"state was made for a model of another structure: its moment (mu|trace) differs from the gradients at ws"
    with pytest.raises(ValueError, match=match) as e:
        opt.update(grads, state, model)
    assert "the gradients have a list of length 2, the state a list of length 1" in str(e.value)
    assert "opt_state = optimizer.init(model)" in str(e.value)
    new_state = opt.init(model)  # the fix
    updates, _ = opt.update(grads, new_state, model)
    assert len(updates.ws) == 2


@pytest.mark.parametrize("on_nan", ["stop", "ignore"])  # the gated leafwise update and the plain one
def test_train_step_with_a_state_made_for_another_structure_names_the_key_path(on_nan):
    opt = fo.Optimizer(fo.adam(0.1))
    model = Chain([jnp.ones(2)])
    state = opt.init(model)
    step = ft.train.train_step(_chain_loss, opt, on_nan=on_nan)
    with pytest.raises(ValueError, match=r"another structure: its moment mu differs from the gradients at ws"):
        step(model.replace(ws=[jnp.ones(2), jnp.ones(2)]), state, jnp.ones(2))


def test_a_state_for_other_shapes_is_named_with_both_shapes():
    opt = fo.Optimizer(fo.adam(0.1))
    state = opt.init(ft.nn.Dense(3, 4, key=jax.random.key(0)))
    small = ft.nn.Dense(3, 1, key=jax.random.key(0))
    grads = ft.gradient(lambda m: jnp.sum(m(X)), at=small)
    with pytest.raises(ValueError, match=r"differs from the gradients at weight: the gradient has shape \(3, 1\), "
                                         r"the moment \(3, 4\)"):
        opt.update(grads, state, small)


def test_state_checks_keep_masked_complex_and_partial_states_working():
    model = {"w": jnp.ones(2), "z": jnp.ones(2, jnp.complex64), "b": jnp.ones(1)}
    tx = optax.chain(optax.masked(optax.adam(0.1), {"w": True, "z": True, "b": False}),
                     optax.multi_transform({"a": optax.adam(0.1), "s": optax.sgd(0.1)}, {"w": "a", "z": "a", "b": "s"}))
    opt = fo.Optimizer(tx)
    state = opt.init(model)
    grads = jax.tree.map(jnp.ones_like, model)
    for _ in range(2):  # eagerly, then the cached definitions
        updates, state = opt.update(grads, state, model)
    assert jax.tree.structure(updates) == jax.tree.structure(model)


@pytest.mark.parametrize("tx", [optax.novograd(0.1), optax.sm3(0.1)], ids=["novograd", "sm3"])
def test_state_checks_keep_reduced_and_per_axis_moments_working(tx):
    # NovoGrad's nu is one scalar per parameter, SM3's mu one vector per axis: not the gradient's shape
    opt, model = fo.Optimizer(tx), _model()

    @jax.jit  # one program (eager, each operation compiled on its own)
    def two_updates(model, state):
        grads = ft.gradient(lambda m: _loss(m, X, Y), at=model)
        for _ in range(2):
            updates, state = opt.update(grads, state, model)
        return updates

    updates = two_updates(model, opt.init(model))
    assert updates.weight.shape == model.weight.shape


def test_moment_fields_are_those_of_ft_optim_moments():
    from functree.optim import _aliases, _checks

    assert _checks.MOMENT_FIELDS == _aliases.MOMENT_FIELDS


class _NormState(typing.NamedTuple):
    mu: jax.Array  # a user's scalar running mean of the gradient norm, not a per-parameter moment


def test_a_user_state_field_named_like_a_moment_is_not_checked_as_one():
    """check_state_fits read every state field named mu, nu, trace ... as optax's moments:
    a user's transformation keeping a scalar ``mu`` was refused as made for another model."""

    def init(params):
        return _NormState(jnp.zeros(()))

    def update(g, s, params=None):
        mu = 0.9 * s.mu + 0.1 * jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(g)))
        return jax.tree.map(lambda x: -0.1 * x / (mu + 1e-3), g), _NormState(mu)

    tx = optax.GradientTransformation(init, update)
    params, grads = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)}, {"w": jnp.array([0.1, -0.2]), "b": jnp.array(0.3)}
    expected, _ = tx.update(grads, tx.init(params), params)
    opt = ft.optim.Optimizer(tx)
    updates = opt.update(grads, opt.init(params), params)[0]
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


def test_a_wrt_that_selects_nothing_names_the_users_loss():
    # Before: "... selects no parameter of Optimizer.get_gradients.<locals>.objective's first argument".
    net = {"d": ft.nn.Dense(3, 2, key=jax.random.key(0))}

    def my_loss(m):
        return jnp.sum(m["d"](jnp.ones((1, 3))))

    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), wrt="*.lora_*")
    with pytest.raises(ValueError, match=r"wrt='\*\.lora_\*' selects no parameter of "
                                         r"test_a_wrt_that_selects_nothing_names_the_users_loss.<locals>.my_loss's"):
        opt.minimize(my_loss, net, ft.optim.Optimizer(ft.optim.adam(1e-2)).init(net))


def test_multisteps_passes_the_extra_arguments_to_the_transform_it_wraps():
    """optax.MultiSteps takes **extra_args and passes them on, but is no
    GradientTransformationExtraArgs: the Optimizer's wrapper dropped them, and an inner
    reduce_on_plateau failed in optax ("missing ... 'value'"). 3 steps equal plain optax's."""
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array(0.3)}

    def loss(p):
        return jnp.sum((p["w"] - 0.5) ** 2) + p["b"] ** 2

    def make():
        return optax.MultiSteps(optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1)), 2)

    opt = ft.optim.Optimizer(make())
    model, state = params, opt.init(params)
    tx = make()
    ref, ref_state = params, tx.init(params)

    @jax.jit  # a step of each is one program (eager, each operation compiled on its own)
    def step(model, state):
        value, grads = jax.value_and_grad(loss)(model)
        updates, state = opt.update(grads, state, model, value=value)
        return optax.apply_updates(model, updates), state

    @jax.jit
    def ref_step(ref, ref_state):
        ref_value, ref_grads = jax.value_and_grad(loss)(ref)
        ref_updates, ref_state = tx.update(ref_grads, ref_state, ref, value=ref_value)
        return optax.apply_updates(ref, ref_updates), ref_state

    with jax.numpy_dtype_promotion("standard"):  # optax's reduce_on_plateau mixes int32 and float32
        for _ in range(4):
            model, state = step(model, state)
            ref, ref_state = ref_step(ref, ref_state)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(("param", "grad", "why"), [
    (jnp.ones(2), jnp.ones(2, jnp.int32), "rounds to 0"),        # adam's update was int32 [0, 0]
    (jnp.ones(2), jnp.ones(2, jnp.bool_), "a bool adds"),        # sgd's update was True: +1
    (jnp.ones(2), jnp.ones(2, jnp.complex64), "imaginary part"),  # optax's tree-map structure error
    (jnp.ones(2, jnp.complex64), jnp.ones(2), "pair of reals"),   # "Only integer scalar arrays ..."
])
def test_a_gradient_of_another_kind_of_number_is_refused_naming_its_key_path(param, grad, why):
    opt = fo.Optimizer(fo.adam(0.1))
    params = {"head": {"w": param}, "b": jnp.ones(2)}
    with pytest.raises(TypeError, match=rf"(?s)at head\.w: the parameter is {param.dtype}.*{why}"):
        opt.update({"head": {"w": grad}, "b": jnp.ones(2)}, opt.init(params), params)


@needs_float16_conversions
def test_floating_gradients_of_other_widths_keep_the_parameters_dtypes():
    # A float32 gradient for a bfloat16 weight: the float32 update is added and rounded once.
    opt = fo.Optimizer(fo.sgd(0.6))
    params = {"w": jnp.asarray([1.0, 2.0, 3.0], jnp.bfloat16), "h": jnp.ones(2, jnp.float16)}
    grads = {"w": jnp.asarray([2.0**-8, 2.0**-7, 2.0**-6], jnp.float32), "h": jnp.ones(2, jnp.float32)}
    new, _ = opt.apply_gradients(grads, params, opt.init(params))
    assert (new["w"].dtype, new["h"].dtype) == (jnp.bfloat16, jnp.float16)
    np.testing.assert_array_equal(np.asarray(new["w"], np.float32), [0.99609375, 1.9921875, 2.984375])


def test_a_narrower_gradient_is_widened_to_its_master_parameters_dtype():
    # bfloat16 gradients (jax.grad at a bfloat16 copy) for float32 weights made a bfloat16
    # update, rounded: Adam's differed from the float32 update by 5e-4 relative.
    opt = fo.Optimizer(fo.adam(1e-3))
    w = {"w": jnp.asarray(np.random.default_rng(0).normal(size=64), jnp.float32)}
    g = jnp.asarray(np.random.default_rng(1).normal(size=64), jnp.bfloat16)
    updates, _ = opt.update({"w": g}, opt.init(w), w)
    wide, _ = opt.update({"w": g.astype(jnp.float32)}, opt.init(w), w)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(wide["w"]))  # bfloat16 -> float32 is exact


def test_a_python_float_field_trains_under_transforms_reading_its_dtype_as_an_array_field_does():
    # session 60: an ft.Module field `bias: float = 0.5` is a parameter, and Optimizer.init
    # with an EMA average, or LAMB's and Adafactor's update, failed with "'float' object has
    # no attribute 'astype'" ('dtype', 'shape'): optax was given the Python number
    class Affine(ft.Module):
        w: jax.Array
        bias: typing.Any = 0.5

        def __call__(self, x):
            return x @ self.w + self.bias

    x, y = jnp.array([[1.0, 2.0], [0.5, -1.0]]), jnp.array([[1.0], [0.0]])

    def loss_fn(m, batch):
        return ft.losses.mean_squared_error(m(batch[0]), batch[1])

    makers = [(lambda: ft.optim.Optimizer(ft.optim.sgd(0.1), average=ft.optim.ema(0.9)), True),
              (lambda: ft.optim.Optimizer(optax.lamb(0.1)), False), (lambda: ft.optim.Optimizer(optax.adafactor(0.1)), False)]
    for make, averaged in makers:
        trained = []
        for bias in (0.5, jnp.asarray(0.5)):  # the float field, and the array field as reference
            model, opt = Affine(jnp.ones((2, 1)), bias), make()
            state = opt.init(model)
            for _ in range(2):
                model, state, _ = opt.minimize(loss_fn, model, state, (x, y))
            trained.append(ft.optim.averaged(state, model) if averaged else model)
        np.testing.assert_allclose(float(trained[0].bias), float(trained[1].bias), rtol=0, atol=1e-7)
        np.testing.assert_allclose(trained[0].w, trained[1].w, rtol=0, atol=1e-7)
        assert float(trained[0].bias) != 0.5  # it trained


def test_a_loss_or_get_gradients_hook_of_the_wrong_arity_is_refused_naming_the_call():
    """A loss without the batch (opt.minimize(lambda m: ..., model, state, x)), one taking more
    batch arguments than given, and a get_gradients hook of another shape (lambda grads: ...,
    one without has_aux=) failed inside the step with Python's bare arity error. LOSS_CALL and
    HOOK_CALL name the function, the call it gets and the code that takes it; that code trains,
    and a loss or hook taking *args, or a user's own hook (which may call the loss its way),
    is never refused."""
    from functree.optim._hooks import HOOK_CALL, LOSS_CALL
    from tests._errors import raises_named

    w, x = {"w": jnp.zeros(())}, jnp.array([1.0, 2.0])
    sgd = ft.optim.Optimizer(optax.sgd(0.5))
    for loss in (lambda m: m["w"] ** 2, lambda m, x, y: m["w"] * x.mean()):
        raises_named(lambda loss=loss: sgd.minimize(loss, w, sgd.init(w), x), TypeError, LOSS_CALL, "right:  lambda model, x: ...")
    clipped = ft.optim.Optimizer(optax.sgd(0.5), get_gradients=ft.optim.per_example_clipping(1.0))
    raises_named(lambda: clipped.minimize(lambda m: m["w"] ** 2, w, clipped.init(w), x), TypeError, LOSS_CALL,
                 "loss_fn(model, x)")
    for hook in (lambda grads: grads, lambda loss_fn, model, x: jax.value_and_grad(loss_fn)(model, x)):
        opt = ft.optim.Optimizer(optax.sgd(0.5), get_gradients=hook)
        raises_named(lambda opt=opt: opt.minimize(lambda m, x: -(m["w"] * x).mean(), w, opt.init(w), x), TypeError, HOOK_CALL,
                     "right:  def hook(loss_fn, model, *batch, has_aux=False):")

    def hook(loss_fn, model, *batch, has_aux=False):  # HOOK_CALL's right
        return jax.value_and_grad(lambda m: loss_fn(m, *batch), has_aux=has_aux)(model)

    own = ft.optim.Optimizer(optax.sgd(0.5), get_gradients=lambda loss_fn, model, b, has_aux=False:
                             jax.value_and_grad(lambda m: loss_fn(m, b["x"]), has_aux=has_aux)(model))
    for opt, loss, batch in ((sgd, lambda *a: -(a[0]["w"] * a[1]).mean(), (x,)),
                             (ft.optim.Optimizer(optax.sgd(0.5), get_gradients=hook), lambda m, x: -(m["w"] * x).mean(), (x,)),
                             (own, lambda m, x: -(m["w"] * x).mean(), ({"x": x},))):
        trained, _, _ = opt.minimize(loss, w, opt.init(w), *batch)
        np.testing.assert_allclose(trained["w"], 0.75, rtol=0, atol=1e-6)  # 0.5 * mean(x)


def test_a_gradient_loss_or_update_hook_of_the_wrong_arity_is_refused_naming_the_hook_and_its_call():
    """transform_gradients=lambda g, s: ..., apply_updates=lambda updates: ... and their kin
    failed inside the step with Python's bare arity error, naming neither the hook nor the
    call it gets. HOOK_ARITY names both at the Optimizer, with code that takes the call; a
    hook taking *args or a default for the rest is never refused, and trains."""
    from functree.optim._hooks import HOOK_ARITY
    from tests._errors import raises_named

    for hook, wrong, right in (("transform_loss", lambda loss, model: loss, "right:  transform_loss=lambda loss: ..."),
                               ("transform_unaggregated_gradients", lambda: 0, "f(grads)"),
                               ("aggregate_gradients", lambda g, axis: g, "f(grads)"),
                               ("transform_gradients", lambda g, state: g, "right:  transform_gradients=lambda grads: ..."),
                               ("transform_gradients", (lambda g: g, lambda g, s: g), "wrong:  transform_gradients=lambda g, s: ..."),
                               ("apply_updates", lambda updates: updates, "f(model, updates)"),
                               ("apply_updates", lambda m, u, s: m,
                                "right:  apply_updates=lambda model, updates: ft.move(model, along=updates)")):
        raises_named(lambda hook=hook, wrong=wrong: ft.optim.Optimizer(optax.sgd(0.5), **{hook: wrong}), TypeError,
                     HOOK_ARITY, right)
    w, x = {"w": jnp.zeros(())}, jnp.array([1.0, 2.0])
    opt = ft.optim.Optimizer(optax.sgd(0.5), transform_loss=lambda loss, scale=1.0: loss * scale,
                             transform_gradients=lambda *grads: grads[0], aggregate_gradients=lambda g, **_: g,
                             apply_updates=lambda model, updates, *rest: ft.move(model, along=updates))
    trained, _, _ = opt.minimize(lambda m, x: -(m["w"] * x).mean(), w, opt.init(w), x)
    np.testing.assert_allclose(trained["w"], 0.75, rtol=0, atol=1e-6)  # 0.5 * mean(x)
