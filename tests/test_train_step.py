"""ft.train.train_step / eval_step: the jitted, donated step and its overridable stages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _references import optax_lbfgs
from _tolerance import assert_close_trained

import functree as ft
from functree.train import TrainStep


def mse(model, batch):
    x, y = batch
    out = model(x)
    return jnp.mean((out - jax.lax.broadcast_to_rank(y, out.ndim)) ** 2)


def problem(seed=0):
    kx, km = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (16, 3))
    y = x @ jnp.array([[1.0], [-2.0], [0.5]])
    return ft.nn.Dense(3, 1, key=km), (x, y)


def test_an_ensembles_losses_are_summed_as_the_error_says_and_train_each_model_alone():
    # A loss per model of a jax.vmap ensemble is refused; the error's jnp.mean would divide each
    # model's SGD step by their number, its .sum() gives each model its own step (a loop's).
    model, batch = problem()
    rng = np.random.default_rng(1)  # 3 models' leaves stacked, as jax.vmap builds them (no eager vmap to compile)
    models = model.replace(weight=rng.normal(size=(3, 3, 1)).astype(np.float32), bias=np.zeros((3, 1), np.float32))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    per_model = lambda ms, b: jax.vmap(mse, in_axes=(0, None))(ms, b)  # noqa: E731
    with pytest.raises(ValueError, match=r"shape \(3,\)(.|\n)*jax.vmap\(loss, in_axes=\(0, None\)\)\(models, batch\).sum\(\)"):
        ft.train.train_step(per_model, opt, donate=False)(models, opt.init(models), batch)
    step = ft.train.train_step(lambda ms, b: per_model(ms, b).sum(), opt, donate=False)
    trained, state = models, opt.init(models)
    for _ in range(3):
        trained, state, _ = step(trained, state, batch)
    x, y = (np.asarray(a, np.float64) for a in batch)
    for i in range(3):  # each model alone, by hand: SGD on the mean squared error of x @ w + b
        w, b = np.asarray(models.weight[i], np.float64), np.asarray(models.bias[i], np.float64)
        for _ in range(3):
            r = 2 * (x @ w + b - y) / len(x)
            w, b = w - 0.1 * x.T @ r, b - 0.1 * r.sum(0)
        np.testing.assert_allclose(trained.weight[i], w, rtol=0, atol=1e-5)   # weights ~1
        np.testing.assert_allclose(trained.bias[i], b, rtol=0, atol=1e-5)


def test_a_template_not_filled_is_refused_naming_the_leaf_and_the_fix():
    # jax.eval_shape's model (a template meant for ft.train.load or trainer.restore) given to
    # a step: JAX said "unsupported operand type(s) for +: 'ShapeDtypeStruct' and 'DynamicJaxprTracer'".
    template = jax.eval_shape(lambda: problem()[0])
    _, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    refused = r"The train step's model holds abstract leaves: weight is f32\[3,1\], a jax.ShapeDtypeStruct" \
              r"(.|\n)*right:  model = ft.train.load\(path, template\)"
    with pytest.raises(TypeError, match=refused):
        ft.train.train_step(mse, opt)(template, opt.init(template), batch)
    with pytest.raises(TypeError, match=refused):
        ft.train.Trainer(template, opt, mse).fit([batch], steps=1, progress=False)


def test_step_equals_optimizer_minimize_and_converges():
    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    step = ft.train.train_step(mse, opt)
    minimize = jax.jit(lambda m, s, b: opt.minimize(mse, m, s, b))
    m1, s1 = model, opt.init(model)
    m2, s2 = jax.tree.map(jnp.copy, model), opt.init(model)
    for _ in range(200):
        m1, s1, metrics = step(m1, s1, batch)
        m2, s2, _ = minimize(m2, s2, batch)
    # TrainStep (gated) vs jitted minimize, 200 Adam steps: the same math in other fusions,
    # measured 3.5e-8 on a bias that converges to ~0, so compared at the model's scale
    # (weights up to 2), not the bias's own
    # ravel_pytree's vector (its leaves in order), in NumPy: eagerly it compiled a program per operation
    flat = [np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(ft.parameters(m))]) for m in (m1, m2)]
    assert_close_trained(flat[0], flat[1], spread=0)
    assert float(metrics["loss"]) < 1e-4
    ctx = ft.optim.context(s1)
    assert int(ctx.step) == 200 and int(ctx.samples_seen) == 200 * 16


def test_donates_model_and_state_and_never_recompiles():
    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01))
    step = ft.train.train_step(mse, opt)
    state = opt.init(model)
    new_model, state, _ = step(model, state, batch)
    assert model.weight.is_deleted()
    assert not new_model.weight.is_deleted()
    new_model, state, _ = step(new_model, state, batch)
    state = ft.optim.set_hyperparameters(state, learning_rate=0.5)
    new_model, state, _ = step(new_model, state, batch)
    assert step._compiled._cache_size() == 1


def test_reusing_a_donated_model_names_the_argument_the_step_and_the_fix():
    """XLA said only "INVALID_ARGUMENT ... Buffer has been deleted or donated"."""
    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01))
    step = ft.train.train_step(mse, opt)
    state = opt.init(model)
    new_model, new_state, _ = step(model, state, batch)
    with pytest.raises(ValueError, match="'model' holds a deleted array at weight") as e:
        step(model, new_state, batch)
    message = str(e.value)
    assert "the previous call of the train step (call 1)" in message
    assert "model, state, out = step(model, state, batch)" in message and "donate=False" in message
    with pytest.raises(ValueError, match="'opt_state' holds a deleted array"):
        step(new_model, state, batch)
    new_model, new_state, _ = step(new_model, new_state, batch)  # the returned ones work


_LOOP_CELL = """
for _ in range(3):
    model, state, out = step(model, state, batch)
"""


@pytest.mark.parametrize("on_nan", ["stop", "ignore"])
def test_a_loop_cell_stopped_by_ctrl_c_names_the_stopped_call_and_the_step_goes_on(on_nan, monkeypatch):
    """A notebook: Ctrl-C in a cell looping over ``step``, landing once the program had taken
    (donated) the model (where a Ctrl-C lands most often: at the return of JAX's call).
    Running the cell again said "called from two threads at once ... Its model and optimizer
    state were not donated: they are still valid" (on_nan="stop": the step's stop log was
    consumed too, so a fresh model got that error as well, for good), or "Use the values the
    step returns" (they were lost). Now it names the stopped call and the fixes, and a fresh
    model trains as with a new step."""
    from functree import _flat

    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01))
    ns = {"step": ft.train.train_step(mse, opt, on_nan=on_nan), "model": model, "state": opt.init(model),
          "batch": batch}
    exec(compile(_LOOP_CELL, "<cell>", "exec"), ns)
    build = _flat._Program.build

    def interrupted(self, leaves):  # after the program's call: the inputs are donated, the results lost
        monkeypatch.setattr(_flat._Program, "build", build)
        raise KeyboardInterrupt

    monkeypatch.setattr(_flat._Program, "build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exec(compile(_LOOP_CELL, "<cell>", "exec"), ns)
    assert ns["model"].weight.is_deleted()
    with pytest.raises(ValueError, match="'model' holds a deleted array at weight: call 4 of the train step took it "
                                         "and was stopped before it returned") as e:
        exec(compile(_LOOP_CELL, "<cell>", "exec"), ns)
    assert "ft.train.Trainer" in str(e.value) and "donate=False" in str(e.value)
    ns["model"] = problem()[0]  # started again
    ns["state"] = opt.init(ns["model"])
    exec(compile(_LOOP_CELL, "<cell>", "exec"), ns)
    reference = {"step": ft.train.train_step(mse, opt, on_nan=on_nan), "model": problem()[0], "batch": batch}
    reference["state"] = opt.init(reference["model"])
    exec(compile(_LOOP_CELL, "<cell>", "exec"), reference)
    np.testing.assert_allclose(ns["model"].weight, reference["model"].weight, rtol=0, atol=0)


def one_device_placement():
    from functree.train._eval_step import placement_of_step

    return placement_of_step(jax.make_mesh((1,), ("data",)), "data", "fsdp", "ft.train.train_step")


@pytest.mark.parametrize("name", ["optimizer", "loss_fn", "metrics", "compute_dtype", "on_nan", "steps_per_call",
                                  "placement"])
def test_a_setting_its_programs_were_built_with_is_refused_after_the_step_ran(name):
    # step.optimizer = sgd(0.0) after a call was ignored: the next call of the same shapes
    # ran the program built with the old optimizer, which went on moving the model (and
    # step.on_nan = "skip" applied the next NaN step; steps_per_call = 2 ran one step;
    # step.placement = <a mesh's> ran the unmeshed program on the default device)
    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    new = {"optimizer": ft.optim.Optimizer(ft.optim.sgd(0.0)), "loss_fn": lambda m, b: 0.0 * mse(m, b),
           "metrics": {}, "compute_dtype": jnp.bfloat16, "on_nan": "skip", "steps_per_call": 2,
           "placement": one_device_placement()}[name]
    before = ft.train.train_step(mse, opt, donate=False)
    setattr(before, name, new)  # before any call: the step is still being set up
    step = ft.train.train_step(mse, opt, donate=False)
    state = opt.init(model)
    model, state, _ = step(model, state, batch)
    with pytest.raises(AttributeError, match=rf"(?s)TrainStep\.{name} cannot be set after the step has run.*"
                                             r"step = ft\.train\.train_step\(loss_fn, optimizer"):
        setattr(step, name, new)
    assert getattr(step, name) is not new


@pytest.mark.parametrize("name", ["loss_fn", "metrics", "compute_dtype", "placement"])
def test_an_eval_steps_setting_is_refused_after_it_ran(name):
    # evaluate.loss_fn = ... after a call was ignored: the next call of the same shapes ran
    # the program built with the old loss (its old number, silently), and placement the
    # program built without the mesh's sharding constraints
    model, batch = problem()
    new = {"loss_fn": lambda m, b: 100.0 + mse(m, b), "metrics": {"peak": lambda out: jnp.max(out.loss)},
           "compute_dtype": jnp.bfloat16, "placement": one_device_placement()}[name]
    before = ft.train.eval_step(mse)
    setattr(before, name, new)  # before any call: still being set up
    evaluate = ft.train.eval_step(mse)
    evaluate(model, batch)
    with pytest.raises(AttributeError, match=rf"(?s)EvalStep\.{name} cannot be set after the step has run.*"
                                             r"step = ft\.train\.eval_step\(loss_fn"):
        setattr(evaluate, name, new)
    assert getattr(evaluate, name) is not new


def test_an_unknown_attribute_of_a_step_is_refused_naming_the_call_that_takes_it():
    # step.donate = False made an attribute nothing read: the step donated on, and the
    # model the user kept was deleted by the next call
    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(mse, opt)
    with pytest.raises(AttributeError, match=r"(?s)TrainStep has no setting 'donate': it is an argument of "
                                             r"ft\.train\.train_step\(\.\.\.\).*nothing reads.*"
                                             r"wrong:  step\.donate = False\n"
                                             r"    right:  step = ft\.train\.train_step\(loss_fn, optimizer, "
                                             r"donate=False\)$"):
        step.donate = False
    assert "donate" not in vars(step)
    with pytest.raises(AttributeError, match=r"(?s)no setting 'on_nana' \(did you mean 'on_nan'\?\).*"
                                             r"Settings it takes now: optimizer, loss_fn, metrics, compute_dtype, "
                                             r"on_nan, steps_per_call, placement\..*right:  step\.on_nan = 'skip'$"):
        step.on_nana = "skip"
    step.on_nan = "skip"  # a setting still takes a value before the step runs
    step = ft.train.train_step(mse, opt, donate=False)  # the right line: the inputs stay valid
    step(model, opt.init(model), batch)
    assert not model.weight.is_deleted()
    # After a run: a setting the programs were built with keeps its own message, and the
    # fix of an unknown name is a new step
    with pytest.raises(AttributeError, match=r"TrainStep\.on_nan cannot be set after the step has run"):
        step.on_nan = "skip"
    with pytest.raises(AttributeError, match=r"(?s)It takes no setting now\..*"
                                             r"right:  step = ft\.train\.train_step\(loss_fn, optimizer, on_nan='skip'\)$"):
        step.on_nana = "skip"
    step._note = 1  # (a private name: the step's own)
    evaluate = ft.train.eval_step(mse)
    with pytest.raises(AttributeError, match=r"(?s)EvalStep has no setting 'metric' \(did you mean 'metrics'\?\)"
                                             r".*right:  evaluate\.metrics = \[\]$"):
        evaluate.metric = []
    evaluate.metrics = {}


def test_a_subclass_of_a_step_sets_names_of_its_own():
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))

    class Weighted(TrainStep):
        def __init__(self, loss_fn, optimizer, weight):
            super().__init__(loss_fn, optimizer, donate=False)
            self.weight = weight

        def compute_loss(self, model, batch, key=None):
            loss, aux = super().compute_loss(model, batch, key)
            return self.weight * loss, aux

    model, batch = problem()
    weighted = Weighted(mse, opt, 2.0)
    weighted.weight = 3.0  # before its first call, read by its trace
    out = weighted(model, opt.init(model), batch)[2]["loss"]
    np.testing.assert_allclose(out, 3.0 * mse(model, batch), rtol=1e-6)


def test_a_loops_calls_assign_nothing_through_the_settings_check(monkeypatch):
    # The check is a Python __setattr__; a loop's call writes its state to the step's Loop
    # (plain slots), so it runs on assignment only, never per call.
    from functree.train._built import Settings

    _, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    steps = {on_nan: ft.train.train_step(mse, opt, on_nan=on_nan) for on_nan in ("stop", "ignore")}
    steps["scan"] = ft.train.train_step(mse, opt, steps_per_call=2)
    batches = {"stop": batch, "ignore": batch, "scan": ft.train.stack_batches([batch, batch])}
    carried = {}
    for name, step in steps.items():  # built, and a plain loop's direct call set
        model = problem()[0]
        carried[name] = step(model, opt.init(model), batches[name])[:2]
        carried[name] = step(*carried[name], batches[name])[:2]
    assigned = []
    checked = Settings.__setattr__
    monkeypatch.setattr(Settings, "__setattr__", lambda self, n, v: (assigned.append(n), checked(self, n, v))[1])
    for name, step in steps.items():
        for _ in range(17):  # past a periodic stop check (every 16 calls)
            carried[name] = step(*carried[name], batches[name])[:2]
        step.check()
    assert assigned == []


def test_optax_transform_accepted_and_no_donation_option():
    model, batch = problem()
    step = ft.train.train_step(mse, optax.sgd(0.1), donate=False)
    state = step.optimizer.init(model)
    out, state, _ = step(model, state, batch)
    assert not model.weight.is_deleted()
    assert float(mse(out, batch)) < float(mse(model, batch))


def test_optax_state_given_to_a_step_names_step_optimizer_init():
    model, batch = problem()
    tx = optax.sgd(0.1)
    step = ft.train.train_step(mse, tx, donate=False)
    with pytest.raises(TypeError, match=r"got ScaleByScheduleState|got tuple") as info:
        step(model, tx.init(model), batch)
    assert "state = step.optimizer.init(model)" in str(info.value)  # was "opt.init(model)": no `opt` here


def test_key_is_folded_with_the_step():
    seen = []

    def loss(model, batch, *, key):
        noise = jax.random.normal(key, ())
        return mse(model, batch) + 0.0 * noise, noise

    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.0))
    step = ft.train.train_step(loss, opt, metrics={"noise": lambda out: out.aux})
    state = opt.init(model)
    key = jax.random.key(7)
    for _ in range(3):
        model, state, metrics = step(model, state, batch, key)
        seen.append(float(metrics["noise"]))
    assert len(set(seen)) == 3
    expected = float(jax.random.normal(jax.random.fold_in(key, 1), ()))
    assert seen[1] == pytest.approx(expected)


def test_batchnorm_statistics_are_threaded():
    key = jax.random.key(0)
    model = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(2, 2, key=key), ft.nn.BatchNorm(2)))
    x = jnp.array([[0.0, 1.0], [2.0, 5.0], [1.0, -1.0]])
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01))
    step = ft.train.train_step(lambda m, b: jnp.mean(m(b) ** 2), opt)
    before = np.asarray(model.layers[1].running_mean).copy()
    model, _, _ = step(model, opt.init(model), x)
    assert not np.allclose(model.layers[1].running_mean, before)


def test_skip_non_finite_steps_and_name_the_parameter():
    model, (x, y) = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(mse, opt, on_nan="skip", donate=False)
    state = opt.init(model)
    bad = (x.at[0, 0].set(jnp.nan), y)
    out, new_state, metrics = step(model, state, bad)
    np.testing.assert_array_equal(out.weight, model.weight)
    assert int(ft.optim.context(new_state).step) == 0
    names = ft.train._nonfinite.parameter_names(model)
    assert names[int(metrics["nonfinite"])] == "weight"
    out, new_state, metrics = step(model, state, (x, y))
    assert int(metrics["nonfinite"]) == -1 and int(ft.optim.context(new_state).step) == 1


def _gradient_is(model, grads):
    """A loss whose gradient with respect to ``model`` is ``grads["g"]`` (the batch), and
    whose value is ``grads["loss"]`` (0 · g elsewhere: finite for a huge finite g)."""
    return sum(jnp.sum((w - jax.lax.stop_gradient(w)) * g.astype(w.dtype)).astype(jnp.float32) for w, g in
               zip(jax.tree.leaves(model), jax.tree.leaves(grads["g"]))) + grads["loss"]


GATE_MODEL = {"a": jnp.ones(3), "b": jnp.ones((2, 2), jnp.bfloat16), "c": jnp.ones((4, 5))}


@pytest.mark.parametrize("leaf, value, expected", [
    (None, 0.0, -1),
    ("a", jnp.nan, 0), ("b", jnp.inf, 1), ("c", -jnp.inf, 2), ("b", jnp.nan, 1),
    ("a", 3e38, -1), ("c", -3e38, -1),  # finite, though its square (a norm) overflows
    ("loss", jnp.inf, -2), ("loss", jnp.nan, -2),
])
def test_the_gate_names_the_first_gradient_that_is_not_finite(leaf, value, expected):
    """``metrics["nonfinite"]``: -1 (applied), the flatten-order index of the first
    gradient with a NaN or an infinity, -2 for the loss alone; a huge finite gradient (one
    element or all) is finite."""
    grads = {"g": jax.tree.map(lambda w: jnp.full(w.shape, 0.5, jnp.float32), GATE_MODEL), "loss": jnp.float32(0)}
    if leaf == "loss":
        grads["loss"] = jnp.float32(value)
    elif leaf is not None:
        grads["g"][leaf] = grads["g"][leaf].at[(1,) * grads["g"][leaf].ndim].set(value)
        if leaf == "c":
            grads["g"]["a"] = jnp.full(3, 3e38, jnp.float32)  # every element huge, still finite
    opt = ft.optim.Optimizer(ft.optim.sgd(1e-40))
    step = ft.train.train_step(_gradient_is, opt, on_nan="skip", donate=False)
    _, state, metrics = step(GATE_MODEL, opt.init(GATE_MODEL), grads)
    assert int(metrics["nonfinite"]) == expected
    assert int(ft.optim.context(state).step) == (expected == -1)


def _all_isfinite(loss, grads):  # the gate's check as it was: all(isfinite(g)) per leaf
    ok = jnp.stack([jnp.all(jnp.isfinite(x)) for x in (*jax.tree.leaves(grads), loss)])
    first = jnp.argmin(ok)
    n = len(jax.tree.leaves(grads))
    return jnp.where(ok[first], -1, jnp.where(first == n, -2, first)).astype(jnp.int32), ok[n]


def test_the_gate_s_check_leaves_every_number_of_the_step_bit_for_bit(monkeypatch):
    """The gate's finiteness check is its own reduction: written as isfinite(sum(g - g))
    or as all(isfinite(g)), the steps' models, optimizer states and metrics are the same
    bits (AdamW, six steps, the third with a NaN in the batch: skipped)."""
    from functree.optim import _skip

    model, (x, y) = problem()
    batches = [(x + i, y) for i in range(6)]
    batches[2] = (x.at[3, 1].set(jnp.nan), y)

    def run():
        opt = ft.optim.Optimizer(ft.optim.adamw(0.05, weight_decay=0.1))
        step = ft.train.train_step(lambda m, b: mse(m, b), opt, on_nan="skip")  # its own programs
        m, s, rows = jax.tree.map(jnp.copy, model), opt.init(model), []
        for batch in batches:
            m, s, metrics = step(m, s, batch)
            rows.append(metrics)
        assert [int(r["nonfinite"]) for r in rows] == [-1, -1, 0, -1, -1, -1]  # the weight's gradient
        return [np.asarray(v) for v in jax.tree.leaves((m, s, rows))]

    now = run()
    monkeypatch.setattr(_skip, "_finiteness", _all_isfinite)
    before = run()
    assert len(now) == len(before)
    for a, b in zip(now, before):
        np.testing.assert_array_equal(a, b)


def test_overriding_compute_loss():
    class L2Step(TrainStep):
        def compute_loss(self, model, batch, key=None):
            loss, aux = super().compute_loss(model, batch, key)
            return loss + 10.0 * jnp.sum(model.weight**2), aux

    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01))
    plain = ft.train.train_step(mse, opt, donate=False)
    penalised = L2Step(mse, opt, donate=False)
    state = opt.init(model)
    a, _, la = plain(model, state, batch)
    b, _, lb = penalised(model, state, batch)
    assert float(lb["loss"]) > float(la["loss"])
    # (in NumPy: no eager programs)
    assert float(np.sum(np.asarray(b.weight) ** 2)) < float(np.sum(np.asarray(a.weight) ** 2))


def test_eval_step_metrics():
    model, (x, y) = problem()

    def loss(m, batch):
        logits = m(batch[0])
        return jnp.mean(logits**2), logits

    evaluate = ft.train.eval_step(loss, metrics=[ft.train.accuracy])
    labels = (y > 0).astype(jnp.float32)
    metrics = evaluate(model, (x, labels))
    assert sorted(metrics) == ["accuracy", "loss"]
    expected = jnp.mean(((model(x) > 0) == (labels > 0.5)).astype(jnp.float32))
    assert float(metrics["accuracy"]) == pytest.approx(float(expected))
    assert not model.weight.is_deleted()


def test_eval_step_metric_shapes_are_traced_once_per_signature():
    # The evaluation sums' structure: main traced the loss on every evaluation. A model
    # with a leaf JAX cannot trace (a function, as Equinox keeps) takes the same path.
    traced = []

    def loss(m, batch):
        traced.append(batch.shape)
        return jnp.mean(m["act"](batch * m["w"]))

    evaluate = ft.train.eval_step(loss, metrics={"peak": lambda out: jnp.max(out.batch)})
    model = {"w": jnp.ones(()), "act": jnp.tanh}
    for size in (4, 4, 8, 4):
        shapes = evaluate.metric_shapes(model, jnp.ones(size))
    assert traced == [(4,), (8,)]
    assert shapes == {"loss": jax.ShapeDtypeStruct((), jnp.float32), "peak": jax.ShapeDtypeStruct((), jnp.float32)}


def test_errors():
    with pytest.raises(ValueError, match=r'on_nan must be "stop", "skip" or "ignore", got \'nan\''):
        ft.train.train_step(mse, optax.sgd(0.1), on_nan="nan")
    with pytest.raises(TypeError, match=r"wrong:  ft.train.train_step\(loss_fn, 1e-3\)"):
        ft.train.train_step(mse, 1e-3)
    model, (x, y) = problem()
    step = ft.train.train_step(lambda m, b: (m(b[0]) - b[1]) ** 2, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"scalar loss.*shape \(16, 1\)"):
        step(model, step.optimizer.init(model), (x, y))


def test_gradient_accumulation_keeps_aux_per_example_and_state():
    key = jax.random.key(0)
    model = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(3, 2, key=key), ft.nn.BatchNorm(2)))
    x, labels = jax.random.normal(key, (8, 3)), jnp.array([0, 1] * 4)

    def loss(m, batch):
        logits = m(batch[0])
        return jnp.mean(logits**2), logits

    opt = ft.optim.Optimizer(ft.optim.sgd(0.01), accumulate=2)
    step = ft.train.train_step(loss, opt, metrics=[ft.train.accuracy], donate=False)
    out, state, metrics = step(model, opt.init(model), (x, labels))
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0
    assert int(ft.optim.context(state).samples_seen) == 8
    assert not np.allclose(out.layers[1].running_mean, model.layers[1].running_mean)


def test_a_state_holding_the_parameters_themselves_is_donated_safely():
    """Donation aliasing is handled where the state is created: no retry, no error text."""
    keep_params = optax.GradientTransformation(lambda p: p, lambda u, s, p=None: (u, s))  # state IS params
    model, batch = problem()
    opt = ft.optim.Optimizer(optax.chain(keep_params, optax.sgd(0.1)))
    state = opt.init(model)
    assert state.inner[0].weight is not model.weight  # a fresh buffer, made by init
    step = ft.train.train_step(mse, opt)
    for _ in range(3):
        model, state, _ = step(model, state, batch)
    assert step._compiled._cache_size() == 1


def test_a_model_holding_one_array_twice_is_copied_once_before_donation():
    class Twice(ft.Module):
        a: jax.Array
        b: jax.Array

        def __call__(self, x):
            return x @ self.a + x @ self.b

    w = jnp.ones((3, 1))
    model, (x, y) = Twice(w, w), problem()[1]
    step = ft.train.train_step(mse, ft.optim.Optimizer(optax.sgd(0.01)))
    state = step.optimizer.init(Twice(w, jnp.copy(w)))  # (init given the tie names it, the step then not)
    with pytest.warns(ft.AliasWarning, match=r"'a' and 'b'"):
        model, state, _ = step(model, state, (x, y))
    model, state, _ = step(model, state, (x, y))  # its own outputs: not looked at again
    assert model.a is not model.b


@pytest.mark.parametrize("on_nan", ["stop", "ignore"])
def test_a_batch_holding_an_array_of_the_donated_model_or_state_is_copied_with_a_warning(on_nan):
    # step(model, state, (x, model.bias)) failed in XLA ("Attempt to use a buffer that was
    # previously donated", naming no key path), on fresh inputs and on a loop's own results
    model, (x, _) = problem()
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    step = ft.train.train_step(mse, opt, on_nan=on_nan)
    plain = ft.train.train_step(mse, opt, on_nan=on_nan, donate=False)  # (the same program, undonated)
    state = opt.init(model)
    want = plain(jax.tree.map(jnp.copy, model), opt.init(model), (x, jnp.copy(model.bias)))
    with pytest.warns(ft.AliasWarning, match=r"holds an array of the model or optimizer state it donates: "
                                             r"batch\.1 is model\.bias\. ") as caught:
        got = step(model, state, (x, model.bias))
    assert caught[0].filename == __file__
    _close(got[:2], want[:2])
    want = plain(*want[:2], (x, want[0].bias))
    with pytest.warns(ft.AliasWarning, match=r"batch\.1 is model\.bias"):
        got = step(*got[:2], (x, got[0].bias))  # the previous call's results: XLA refused, checked again
    _close(got[:2], want[:2])
    mu = got[1].inner.inner[0][0].mu.bias  # an Adam moment as the targets
    want = plain(*want[:2], (x, jnp.copy(mu)))
    with pytest.warns(ft.AliasWarning, match=r"batch\.1 is opt_state\.inner\.inner\.0\.0\.mu\.bias"):
        got = step(*got[:2], (x, mu))
    _close(got[:2], want[:2])


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)  # values up to ~2


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def test_stop_is_the_default_and_halts_then_raises_with_the_failing_inputs():
    model, (x, y) = problem()
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    step = ft.train.train_step(mse, opt, donate=False)
    assert step.on_nan == ft.train.Trainer(model, opt, mse).on_nan == "stop"  # one default
    state = opt.init(model)
    model1, state1, _ = step(model, state, (x, y))
    bad = (x.at[3, 1].set(jnp.inf), y)
    model2, state2, metrics = step(model1, state1, bad)
    assert int(metrics["nonfinite"]) == 0  # leaf 0: the weight
    _same((model2, state2), (model1, state1))  # not applied: bit for bit
    model3, state3, _ = step(model2, state2, (x, y))  # halted: later steps are not applied either
    _same((model3, state3), (model1, state1))
    with pytest.raises(ft.train.NonFiniteError, match=r"step 2: the gradient of parameter 'weight'") as info:
        step.check()
    assert info.value.batch is bad and info.value.parameter == "weight" and info.value.model is model3
    step.check()  # raised once; the step runs again afterwards
    model4, _, _ = step(model3, state3, (x, y))
    assert not np.array_equal(model4.weight, model3.weight)


def test_a_stop_after_many_checked_calls_names_its_own_step_and_batch():
    # Every 16th call prunes the finished calls' inputs (held for the error): a step that
    # stops after several prunings still gets its own step number and minibatch.
    model, (x, y) = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01))
    step = ft.train.train_step(mse, opt)
    state = opt.init(model)
    bad = (x.at[0, 0].set(jnp.nan), y)
    batches = [(x, y) for _ in range(53)] + [bad, (x, y)]
    for batch in batches:
        model, state, _ = step(model, state, batch)
    assert len(step._loop.inflight) < len(batches)  # pruned along the way
    with pytest.raises(ft.train.NonFiniteError, match=r"step 54: ") as info:
        step.check()
    assert info.value.batch is bad


def test_skip_and_ignore_do_not_halt_and_none_means_ignore():
    model, (x, y) = problem()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    state = opt.init(model)
    skip = ft.train.train_step(mse, opt, on_nan="skip", donate=False)
    bad = (x.at[0, 0].set(jnp.nan), y)
    same, _, _ = skip(model, state, bad)
    _same(same, model)
    moved, _, _ = skip(same, state, (x, y))  # the next finite step is applied
    assert not np.array_equal(moved.weight, model.weight)
    ignore = ft.train.train_step(mse, opt, on_nan=None, donate=False)
    assert ignore.on_nan == "ignore"
    broken, _, metrics = ignore(model, state, bad)
    assert "nonfinite" not in metrics and not bool(np.all(np.isfinite(np.asarray(broken.weight))))


class Halving(ft.optim.Optimizer):
    """An overridden Optimizer.step: half of every update (and a hook through the constructor)."""

    def step(self, loss_fn, model, state, batch, **options):
        result = super().step(loss_fn, model, state, batch, **options)
        return result._replace(model=ft.tree_map(lambda new, old: (new + old) / 2, result.model, model))


def test_an_overridden_optimizer_step_and_hooks_are_honoured_with_and_without_a_mesh():
    model, batch = problem()
    mesh = jax.make_mesh((1,), ("data",))
    clip = lambda g: ft.tree_map(lambda v: jnp.clip(v, -0.1, 0.1), g)  # noqa: E731
    plain = ft.optim.Optimizer(ft.optim.sgd(0.1), transform_gradients=clip)
    halving = Halving(ft.optim.sgd(0.1), transform_gradients=clip)
    state = plain.init(model)
    full, _, _ = ft.train.train_step(mse, plain, donate=False)(model, state, batch)
    for where in ({}, {"mesh": mesh}, {"mesh": mesh, "sharding": "fsdp"}):
        half, _, _ = ft.train.TrainStep(mse, halving, donate=False, **where)(model, state, batch)
        np.testing.assert_allclose(half.weight, (full.weight + model.weight) / 2, rtol=0, atol=1e-7)
        moved = np.abs(np.asarray(half.weight) - np.asarray(model.weight))  # (in NumPy: no eager programs)
        assert float(np.max(moved)) <= 0.1 * 0.1 / 2 + 1e-7  # clipped


def test_parallel_never_imports_train():
    """No import cycle: functree.parallel's modules import nothing of functree.train at import
    time (train imports parallel; the older step names resolve lazily)."""
    import ast
    import pathlib

    root = pathlib.Path(ft.__file__).parent / "parallel"
    for path in root.glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level: what runs on import
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("functree.train") for n in names), (path.name, names)
    assert ft.parallel.DataParallelStep is ft.train._step_factories.DataParallelStep  # the older name, kept
    assert isinstance(ft.parallel.DataParallelStep(mse, ft.optim.sgd(0.1)), TrainStep)


def test_lbfgs_through_the_trainer_equals_optax_loop():
    """optax.lbfgs needs value, grad and value_fn: TrainStep (run by the Trainer) passes them."""
    model, batch = problem()
    params = ft.parameters(model)

    def fn(p):
        return mse(ft.with_parameters(model, p), batch)

    params = optax_lbfgs(fn, params, 3)
    trainer = ft.train.Trainer(model, optax.lbfgs(), mse)  # runs a TrainStep's program
    trainer.fit([batch], steps=3, progress=False)
    m = trainer.model
    np.testing.assert_allclose(m.weight, params.weight, rtol=0, atol=1e-5)  # weights up to 2
    np.testing.assert_allclose(m.bias, params.bias, rtol=0, atol=1e-5)
    assert float(mse(m, batch)) < 1e-2 * float(mse(model, batch))


def test_accumulating_step_folds_the_step_key_then_the_microbatch_index():
    """TrainStep with a key and accumulate=k: microbatch i of step s gets
    fold_in(fold_in(key, s), i), the keys Optimizer.step(key=) hands out."""
    drop = ft.nn.training(ft.nn.Dropout(0.5))
    model = ft.nn.Dense(3, 2, key=jax.random.key(0))

    def loss(m, batch, *, key):
        return jnp.mean((drop(m(batch[0]), key=key) - batch[1]) ** 2)

    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=2)
    batch = (jax.random.normal(jax.random.key(1), (4, 3)), jnp.ones((4, 2)))
    base = jax.random.key(5)
    stepped, _, _ = ft.train.train_step(loss, opt, donate=False)(model, opt.init(model), batch, base)
    by_hand = opt.step(lambda m, b, key: loss(m, b, key=key), model, opt.init(model), (batch,),
                       key=jax.random.fold_in(base, 0)).model
    # jitted against eager: float32 fusion differences on parameters of magnitude ~1 (measured 6e-8);
    # another key would change them by ~0.1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), stepped, by_hand)


def _bn_model():
    k = jax.random.split(jax.random.key(0), 2)
    return ft.nn.training(ft.nn.Sequential(ft.nn.Dense(3, 8, key=k[0]), ft.nn.BatchNorm(8, momentum=0.5),
                                           ft.nn.Dense(8, 1, key=k[1])))


def test_bfloat16_compute_with_batch_norm_in_training_mode():
    """Issue 27 item 5: compute_dtype=bfloat16 trains a BatchNorm model (main: ValueError from
    record_state, the cast model's layers unknown to collect_state); its statistics stay
    float32 and match a float32 run within bfloat16 rounding; the Trainer too."""
    def loss(m, batch):
        return jnp.mean((m(batch[0]) - batch[1]) ** 2)

    x = jax.random.normal(jax.random.key(2), (16, 3)) * 3.0 + 1.0
    batch = (x, jnp.ones((16, 1)))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.05))
    runs = {}
    for dtype in (None, jnp.bfloat16):
        step = ft.train.train_step(loss, opt, compute_dtype=dtype)
        model, state = _bn_model(), opt.init(_bn_model())
        for _ in range(3):
            model, state, metrics = step(model, state, batch)
        runs[dtype] = model, metrics["loss"]
    (ref, ref_loss), (half, half_loss) = runs[None], runs[jnp.bfloat16]
    bn, bn_ref = half.layers[1], ref.layers[1]
    assert bn.running_mean.dtype == bn.running_variance.dtype == jnp.float32
    start = np.asarray(_bn_model().layers[1].running_mean)  # (the checks below in NumPy: no eager programs)
    assert float(np.max(np.abs(np.asarray(bn.running_mean) - start))) > 0.05  # updated
    # bfloat16 keeps 8 bits (relative rounding 2^-8) in the Dense layers feeding the statistics;
    # measured against float32: 0.0011 (mean, magnitude 1), 0.010 (variance, magnitude 8),
    # 1.3e-4 (loss, 0.22): the bounds are 3 roundings of the magnitude, about 10x those.
    def bf16_close(a, b, magnitude):
        np.testing.assert_allclose(a, b, rtol=0, atol=3 * 2.0**-8 * magnitude)

    bf16_close(bn.running_mean, bn_ref.running_mean, float(np.max(np.abs(np.asarray(bn_ref.running_mean)))))
    bf16_close(bn.running_variance, bn_ref.running_variance, float(np.max(np.asarray(bn_ref.running_variance))))
    bf16_close(half_loss, ref_loss, float(ref_loss) * 1.5)
    trainer = ft.train.Trainer(_bn_model(), opt, loss, compute_dtype=jnp.bfloat16)
    trainer.fit([batch] * 3, progress=False)
    jax.tree.map(np.testing.assert_array_equal, trainer.model, half)  # the same step


def test_a_float64_compute_dtype_s_loss_is_float64_under_x64():
    """compute_dtype=jnp.float64 under jax_enable_x64 (a float32 model computed in float64):
    the step and the eval step rounded the loss to float32 (2e-7 off a loss of ~1, reported in
    a float64 metric); both now give the float64 loss the loss function computed, a WeightedMean's
    parts too, and a bfloat16 compute_dtype's loss stays float32."""
    def loss(m, batch):
        return jnp.mean((batch[0] @ m["w"] - batch[1]) ** 2)

    def weighted(m, batch):
        return ft.losses.WeightedMean(jnp.sum((batch[0] @ m["w"] - batch[1]) ** 2), jnp.float64(batch[1].size))

    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        w, x, y = rng.normal(size=3).astype(np.float32), rng.normal(size=(8, 3)), rng.normal(size=8)
        model, batch = {"w": jnp.asarray(w)}, (jnp.asarray(x), jnp.asarray(y))
        want = np.mean((x @ w.astype(np.float64) - y) ** 2)
        step = ft.train.train_step(loss, ft.optim.Optimizer(ft.optim.sgd(0.1)), compute_dtype=jnp.float64)
        got = [step.compute_loss(model, batch)[0], *(ft.train.eval_step(fn, compute_dtype=jnp.float64).compute_loss(
            model, batch)[0] for fn in (loss, weighted))]  # (the stage each step's program traces)
        for value in (got[0], got[1], got[2].total / got[2].count):
            assert value.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(value), want, rtol=1e-14, atol=0)
        half = ft.train.eval_step(loss, compute_dtype=jnp.bfloat16)
        assert half.compute_loss(model, batch)[0].dtype == jnp.float32


def test_a_tracing_error_in_the_step_names_the_models_key_path():
    class Cell(ft.Module):
        w: jax.Array
        hidden_size: jax.Array  # an array where a Python int was meant

    def loss(m, b):
        return sum(m.w.sum() for _ in range(m.hidden_size)) * jnp.mean(b)

    model = Cell(jnp.ones(2), jnp.asarray(3))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"depends on the value of the argument model\.hidden_size") as info:
        ft.train.train_step(loss, opt)(model, opt.init(model), jnp.ones(2))
    assert "donated[" not in str(info.value) and "function flat" not in str(info.value)


def test_a_donated_model_used_later_names_the_key_path_the_call_and_the_fixes():
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(mse, opt)
    best, state = model, opt.init(model)
    model, state, _ = step(model, state, (jnp.ones((3, 2)), jnp.ones((3, 1))))
    uses = {
        "a Module call": lambda: best(jnp.ones((1, 2))),
        "ft.nn.inference": lambda: ft.nn.inference(best),
        "an eval step": lambda: ft.train.eval_step(mse)(best, (jnp.ones((1, 2)), jnp.ones((1, 1)))),
        "ft.jit": lambda: ft.jit(lambda m, x: m(x))(best, jnp.ones((1, 2))),
    }
    for use in uses.values():
        with pytest.raises(ValueError, match=r"deleted array at (model|m)\.weight: call \d+ of the train step") as info:
            use()
        assert "jax.tree.map(jnp.copy, model)" in str(info.value) and "donate=False" in str(info.value)
    kept = jax.tree.map(jnp.copy, model)
    model, state, _ = step(model, state, (jnp.ones((3, 2)), jnp.ones((3, 1))))
    assert kept(jnp.ones((1, 2))).shape == (1, 1)  # a copy stays valid


def test_a_donated_nested_model_names_the_path_from_the_model_called():
    """The inner layer's call raised first and named its own leaf (`model.weight`); the
    donated array is the outer model's `conv.weight`."""

    class Net(ft.Module):
        conv: ft.nn.Conv1D
        dense: ft.nn.Dense

        def __call__(self, x):
            return self.dense(self.conv(x).mean(axis=1))

    k1, k2 = jax.random.split(jax.random.key(0))
    model = Net(ft.nn.Conv1D(2, 3, 2, key=k1), ft.nn.Dense(3, 1, key=k2))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    best, state = model, opt.init(model)
    ft.train.train_step(mse, opt)(model, state, (jnp.ones((3, 4, 2)), jnp.ones((3, 1))))
    with pytest.raises(ValueError, match=r"deleted array at model\.conv\.weight: call \d+ of the train step"):
        best(jnp.ones((1, 4, 2)))
    with pytest.raises(ValueError, match=r"deleted array at model\.weight: call \d+ of the train step"):
        best.conv(jnp.ones((1, 4, 2)))  # the layer called on its own: its own path


def test_a_float_field_of_an_ft_module_is_trained_in_the_step():
    class Perceptron(ft.Module):  # Swift's `var bias: Float`: declared, so trained
        weight: jax.Array
        bias: float = 0.0

        def __call__(self, x):
            return (jax.lax.broadcast_to_rank(self.weight, x.ndim) * x).sum(-1) + self.bias

    model, opt = Perceptron(jnp.ones(2), 1.0), ft.optim.Optimizer(ft.optim.sgd(0.1))
    step, state = ft.train.train_step(lambda m, b: jnp.mean(m(b) ** 2), opt), opt.init(model)
    for _ in range(3):  # prediction p <- 0.4 p from 3: the bias and each weight move by 0.2 p
        model, state, metrics = step(model, state, jnp.ones((4, 2)))
    np.testing.assert_allclose([float(model.bias), *model.weight.tolist()], [0.064] * 3, rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), 0.48**2, rtol=0, atol=1e-6)


def test_a_step_on_a_mesh_compiles_once_and_the_trainer_too():
    """The halt log starts where the step returns it (replicated over the mesh): a new log
    on the default device made every mesh step compile again at its second call."""
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    mesh = jax.make_mesh((1,), ("data",))
    loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    batch = (np.ones((8, 3), np.float32), np.ones((8, 1), np.float32))
    step = ft.train.train_step(loss, opt, mesh=mesh)
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    state = opt.init(model)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        model, state, _ = step(model, state, batch)  # compiles
        del compiles[:]
        for _ in range(2):
            model, state, metrics = step(model, state, batch)
        jax.block_until_ready(metrics)
        assert compiles == []  # main: the second call compiled the step again
        trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.adam(1e-2), loss, mesh=mesh)
        trainer.fit([batch], progress=False, log_every=1)  # compiles
        del compiles[:]
        trainer.fit([batch] * 3, epochs=2, progress=False, log_every=1)
        assert compiles == []  # main: one more compile, the step again
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_the_first_call_compiles_one_program():
    # Nothing eager before the step (each would be a GPU compile of its own): the NaN
    # gate's record comes from the host.
    from _compiles import compiled

    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    state, batch = opt.init(model), (jnp.ones((4, 3)), jnp.zeros((4, 1)))
    step = ft.train.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), opt)
    with compiled() as names:
        model, state, metrics = step(model, state, batch)
        step.check()
    assert names == ["jit(flat)"] and bool(jnp.isfinite(metrics["loss"]))



def test_committed_and_uncommitted_inputs_compile_the_step_as_jax_jit_does():
    """The halt log follows the model's placement: jax.jit keys its cache on each argument's
    committedness, and a program given one committed argument returns all committed. Raw
    jax.jit + optax compiles [1, 0, 1, 0, 0, 0, 0] over this sequence; main compiled
    [1, 0, 1, 1, 0, 1, 0] (its kept log committed after the restored call) and twice for
    a first call on committed arrays."""
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    def mse_of_own(m, b):  # its own program: no other test compiled it
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    _, batch = problem()
    commit = lambda tree: jax.device_put(tree, jax.devices()[0])  # noqa: E731  (as ft.train.load returns)
    fresh = lambda seed: (lambda m: (m, opt.init(m)))(ft.nn.Dense(3, 1, key=jax.random.key(seed)))  # noqa: E731
    step = ft.train.train_step(mse_of_own, opt)
    model, state = fresh(0)
    counts = []
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for given in ("fresh", "own", "committed", "own", "own", "fresh", "own"):
            if given == "committed":
                model, state = commit((model, state))
            elif given == "fresh":
                model, state = fresh(len(counts))
            del compiles[:]
            model, state, metrics = step(model, state, batch)
            jax.block_until_ready(metrics)
            counts.append(len(compiles))
        assert counts == [1, 0, 1, 0, 0, 0, 0]  # main: [1, 0, 1, 1, 0, 1, 0]
        step.check()  # the log went through the host at the fresh model: it counts every step called
        assert int(step._loop.halt["halt"][0]) == 7 and bool(jnp.isfinite(metrics["loss"]))
        step = ft.train.train_step(lambda m, b: mse_of_own(m, b) * 2.0, opt)  # first called on committed arrays
        model, state = commit(fresh(9))
        del compiles[:]
        for _ in range(3):
            model, state, metrics = step(model, state, batch)
        jax.block_until_ready(metrics)
        assert len(compiles) == 1  # main: 2 (its log was uncommitted, then the step's committed result)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_step_is_freed_with_its_last_results_when_dropped():
    # Its program holds its checks weakly: no reference cycle, so the model and state it
    # remembers (device memory) go when the step goes, without waiting for the collector.
    import gc
    import weakref

    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    state, batch = opt.init(model), (jnp.ones((4, 3)), jnp.zeros((4, 1)))
    step = ft.train.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), opt)
    for _ in range(3):
        model, state, _ = step(model, state, batch)
    step.check()
    dropped = weakref.ref(step)
    gc.disable()
    try:
        del step
        assert dropped() is None
    finally:
        gc.enable()


def test_accumulated_aux_rows_merge_and_a_per_class_table_is_refused():
    """With accumulate=k the microbatches' aux came back stacked: a (4, 4) table of 16 examples
    became (16, 4) (its trace 5 read as 0) and a scalar became k numbers. Rows per example
    merge, floating means are meaned, and what cannot be combined is refused by name."""
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    y = np.arange(16, dtype=np.int32) % 4
    model = ft.nn.Dense(3, 4, key=jax.random.key(0))

    def loss(m, batch, table=False):
        logits = m(batch[0])
        per = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1)[:, 0]
        aux = {"rows": per, "mean": jnp.mean(per)}
        if table:
            aux["table"] = jax.ops.segment_sum(per, batch[1], num_segments=4)
        return jnp.mean(per), aux

    metrics = {"rows": lambda o: jnp.mean(o.aux["rows"]), "mean": lambda o: o.aux["mean"],
               "n": lambda o: jnp.float32(o.aux["rows"].shape[0])}
    got = {}
    for k in (1, 2, 4):
        opt = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=k)
        step = ft.train.train_step(loss, opt, metrics=metrics, on_nan="ignore")
        got[k] = {n: float(v) for n, v in step(jax.tree.map(jnp.copy, model), opt.init(model), (x, y))[2].items()}
    for k in (2, 4):
        assert got[k]["n"] == 16.0
        for name in ("loss", "rows", "mean"):
            np.testing.assert_allclose(got[k][name], got[1][name], rtol=0, atol=1e-6 * max(1.0, abs(got[1][name])))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=4)  # 4 examples per microbatch, 4 classes
    step = ft.train.train_step(lambda m, b: loss(m, b, table=True), opt, on_nan="ignore")
    with pytest.raises(ValueError, match=r"aux\['table'\] has shape \(4,\) \(float32\) per microbatch(.|\n)*"
                                         r"with accumulate=4"):
        step(jax.tree.map(jnp.copy, model), opt.init(model), (x, y))


def test_a_batch_leaf_of_another_leading_size_is_refused_when_the_step_splits_the_batch():
    """Per-class weights (4,) beside x (16, 3): with accumulate=2 each microbatch read a slice
    of them (loss 5.47 where the unsplit step gives 4.65), silently. Refused by name now;
    the unsplit step takes the batch as before."""
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    batch = {"x": x, "y": np.arange(16, dtype=np.int32) % 4, "cw": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}

    def loss(m, b):
        per = -jnp.take_along_axis(jax.nn.log_softmax(m(b["x"])), b["y"][:, None], axis=1)[:, 0]
        return jnp.mean(per * b["cw"][b["y"]])

    model = ft.nn.Dense(3, 4, key=jax.random.key(0))
    plain = ft.optim.Optimizer(ft.optim.sgd(0.1))
    ft.train.train_step(loss, plain, on_nan="ignore")(jax.tree.map(jnp.copy, model), plain.init(model), batch)
    split = ft.optim.Optimizer(ft.optim.sgd(0.1), accumulate=2)
    with pytest.raises(ValueError, match=r"\['x'\] has 16 rows, \['cw'\] has 4\. Split over accumulate=2 microbatches"):
        ft.train.train_step(loss, split, on_nan="ignore")(jax.tree.map(jnp.copy, model), split.init(model), batch)


def test_a_batch_given_as_two_arguments_is_named():
    """step(model, state, x, y), as Optimizer.minimize takes *batch: y became the PRNG key
    and JAX failed with "invalid PRNG key data ... shape (4, 1)"."""
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2))
    step = ft.train.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), opt)
    x, y = np.ones((4, 3), np.float32), np.ones((4, 1), np.float32)
    with pytest.raises(TypeError, match=r"(?s)fourth argument is its PRNG key, and float32\[4, 1\] is none.*step\(model, state, \(x, y\)\)"):
        step(model, opt.init(model), x, y)
    _, _, metrics = step(model, opt.init(model), (x, y))
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("options", [{}, {"on_nan": "ignore"}, {"steps_per_call": 2}])
def test_several_keys_or_a_seed_as_the_steps_key_are_named(options):
    """step(model, state, batch, jax.random.split(key, 3)) failed inside JAX's fold_in ("accepts
    a single key", naming no argument); it names key= and the fix (SEVERAL_KEYS), as an int
    seed is named (the step's NOT_A_KEY), on every path of the call, and under jax.jit."""
    from functree.train._data import SEVERAL_KEYS

    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(lambda m, b, *, key: jnp.mean((m(b[0]) - b[1]) ** 2), opt, donate=False, **options)
    lead = (2,) if "steps_per_call" in options else ()  # two minibatches stacked
    batch = (np.ones((*lead, 2, 3), np.float32), np.ones((*lead, 2, 1), np.float32))
    for keys, what in ((jax.random.split(jax.random.key(0), 3), "a key array"),
                       (jax.random.split(jax.random.PRNGKey(0), 3), "raw uint32 key data")):
        expected = SEVERAL_KEYS.format(caller="step", n=3, what=what, shape=keys.shape)
        with pytest.raises(ValueError) as info:
            step(model, opt.init(model), batch, keys)
        assert str(info.value) == expected
        with pytest.raises(ValueError) as info:
            jax.jit(lambda m, s, k: step(m, s, batch, k))(model, opt.init(model), keys)
        assert str(info.value) == expected
    with pytest.raises(TypeError, match=r"fourth argument is its PRNG key, and int\[\] is none"):
        step(model, opt.init(model), batch, 0)
    _, _, metrics = step(model, opt.init(model), batch, jax.random.key(0))
    assert np.isfinite(np.asarray(metrics["loss"])).all()


# --- a step called inside the user's jax.jit / jax.vmap / lax.scan ---------------------------


def _plain_steps(model, opt, batch, n):
    """n plain calls of a fresh step: the reference."""
    step, state, losses = ft.train.train_step(mse, opt, donate=False), opt.init(model), []
    for _ in range(n):
        model, state, metrics = step(model, state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return model, state, np.stack(losses)  # (NumPy: no program compiled for the stack)


def _close(a, b, atol=1e-6):  # values of order 1 (weights, Adam moments, losses ~ 10)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol * max(1.0, float(np.abs(y).max())))


def test_a_step_called_inside_jit_then_plainly_keeps_working_with_a_plain_call_s_numbers():
    # Before: the traced call stored its halt log (an int32[3] tracer): the next plain call
    # raised UnexpectedTracerError.
    model, batch = problem()
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    step = ft.train.train_step(mse, opt, donate=False)  # on_nan="stop", the default
    m1, s1, met1 = jax.jit(lambda a, b: step(a, b, batch))(model, opt.init(model))
    m2, s2, met2 = step(m1, s1, batch)  # a plain call afterwards
    step.check()
    ref_m, ref_s, ref_losses = _plain_steps(model, opt, batch, 2)
    _close((m2, s2), (ref_m, ref_s))
    _close(jnp.stack([met1["loss"], met2["loss"]]), ref_losses)
    # donating (the default) inside a jit: the outer jit owns the buffers; no warning, same numbers
    donating = ft.train.train_step(mse, opt)
    m3, s3, _ = jax.jit(lambda a, b: donating(a, b, batch))(model, opt.init(model))
    m3, s3, _ = donating(m3, s3, batch)
    _close((m3, s3), (ref_m, ref_s))


def test_a_vmapped_ensemble_loop_and_a_scan_of_steps_equal_plain_calls():
    _, batch = problem()
    members = [problem(seed)[0] for seed in (1, 2)]
    # stacked in NumPy, put on the device (jnp.stack compiled a program per leaf shape)
    ensemble = jax.tree.map(lambda *a: jax.device_put(np.stack([np.asarray(x) for x in a])), *members)
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    step = ft.train.train_step(mse, opt, donate=False)
    ens, ens_state = ensemble, jax.vmap(opt.init)(ensemble)
    for _ in range(3):  # failed at the second iteration before
        ens, ens_state, metrics = jax.vmap(lambda a, b: step(a, b, batch))(ens, ens_state)
    for i, member in enumerate(members):
        ref_m, ref_s, ref_losses = _plain_steps(member, opt, batch, 3)
        # member i read in NumPy (eager indexing compiled a program per leaf shape)
        _close(jax.tree.map(lambda a, i=i: np.asarray(a)[i], (ens, ens_state)), (ref_m, ref_s))
        _close(np.asarray(metrics["loss"])[i], ref_losses[-1])

    def body(carry, _):
        m, s, met = step(*carry, batch)
        return (m, s), met["loss"]

    (m, s), losses = jax.lax.scan(body, (members[0], opt.init(members[0])), None, length=3)
    ref_m, ref_s, ref_losses = _plain_steps(members[0], opt, batch, 3)
    _close((m, s, losses), (ref_m, ref_s, ref_losses))
    m, s, _ = step(members[0], opt.init(members[0]), batch)  # and a plain call after both
    _close(m, _plain_steps(members[0], opt, batch, 1)[0])


def test_stop_inside_a_transformation_skips_the_step_and_leaves_later_calls_alone():
    model, (x, y) = problem()
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    step = ft.train.train_step(mse, opt, donate=False)
    state = opt.init(model)
    bad = (x.at[3, 1].set(jnp.inf), y)
    m1, s1, metrics = jax.jit(lambda a, b, c: step(a, b, c))(model, state, bad)
    assert int(metrics["nonfinite"]) == 0  # reported (leaf 0: the weight) ...
    _same((m1, s1), (model, state))  # ... and not applied, bit for bit
    m2, s2, _ = step(m1, s1, (x, y))  # nothing kept from the traced call: no stop, no error
    step.check()
    _close((m2, s2), _plain_steps(model, opt, (x, y), 1)[:2])


class _PercentStep(ft.train.TrainStep):
    """step() rescaling super()'s accuracy: its parts stay the unscaled value's."""

    def step(self, model, opt_state, batch, key=None, enabled=None):
        new, state, metrics = super().step(model, opt_state, batch, key, enabled)
        return new, state, {**metrics, "accuracy": 100 * metrics["accuracy"]}


class _PercentMetrics(ft.train.TrainStep):
    """The same in compute_metrics (STEP_CHANGED_PARTS's right line): measured, parts rescaled."""

    def compute_metrics(self, out):
        metrics = super().compute_metrics(out)
        return {**metrics, "accuracy": 100 * metrics["accuracy"]}


def test_a_step_override_rescaling_accuracy_is_refused_and_compute_metrics_rescales_exactly():
    """Before: step rows showed 100 · acc_b while the epoch mean, 0.2533, came from the
    unscaled parts (regress15 p24). step() changing a measured value is refused by name
    (STEP_CHANGED_PARTS); its fix, in compute_metrics, is exact: 100 · numpy's per-token."""
    from functree.train._step import STEP_CHANGED_PARTS

    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5, 3)).astype(np.float32)
    y = rng.integers(0, 4, size=(24, 5)).astype(np.int32)
    for i in range(24):
        y[i, rng.integers(1, 6):] = -100  # pads, unevenly over the minibatches
    model = ft.nn.Dense(3, 4, key=jax.random.key(0))

    def loss_fn(m, b):
        logits = m(b[0])
        return ft.losses.softmax_cross_entropy(logits, b[1]), logits

    data = [(x[i:i + 8], y[i:i + 8]) for i in (0, 8, 16)]
    pred = np.asarray(model(jnp.asarray(x))).argmax(-1)
    keep = y != -100
    want = 100 * ((pred == y) & keep).sum() / keep.sum()
    weighted = np.mean([100 * ((pred == y) & keep)[i:i + 8].sum() / keep[i:i + 8].sum() for i in (0, 8, 16)])
    assert abs(weighted - want) > 0.05  # the data tells the two means apart (25.2308 vs 25.3333)
    opt = ft.optim.sgd(0.0)
    t = ft.train.Trainer(model, opt, loss_fn, metrics=[ft.train.accuracy], train_step=_PercentStep)
    with pytest.raises(ValueError) as info:
        t.fit(data, epochs=1, progress=False)
    assert STEP_CHANGED_PARTS.format(cls="_PercentStep", name="accuracy") in str(info.value)
    t = ft.train.Trainer(model, opt, loss_fn, metrics=[ft.train.accuracy], train_step=_PercentMetrics)
    t.fit(data, epochs=1, progress=False)
    np.testing.assert_allclose(t.history.epochs["accuracy"][0], want, rtol=0, atol=1e-4)
    by_hand = _PercentStep(loss_fn, opt, metrics=[ft.train.accuracy], donate=False)  # a call: no means
    got = by_hand(model, by_hand.optimizer.init(model), data[0])[2]["accuracy"]
    np.testing.assert_allclose(got, 100 * ((pred == y) & keep)[:8].sum() / keep[:8].sum(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("make", [ft.train.train_step, TrainStep], ids=["train_step", "TrainStep"])
def test_an_optimizers_option_given_to_the_step_names_the_optimizer(make):
    """wrt= (the LoRA guide's ``wrt="*.lora_*"``) and the other options of ft.optim.Optimizer
    given to the step: the error shows them inside ``ft.optim.Optimizer(tx, ...)``, which runs
    (Python's "unexpected keyword argument 'wrt'" before); a typo gets its closest name."""
    model, batch = problem()
    for name, value in [("wrt", "*.bias"), ("accumulate", 2), ("transform_gradients", ())]:
        with pytest.raises(TypeError, match=f"got {name}=, an option of the optimizer") as caught:
            make(mse, ft.optim.adam(0.1), **{name: value})
        assert f"right:  ft.train.train_step(loss_fn, ft.optim.Optimizer(tx, {name}={value!r}))" in str(caught.value)
    step = make(mse, ft.optim.Optimizer(ft.optim.adam(0.1), wrt="*.bias"))  # the printed fix
    weight, bias = np.array(model.weight), np.array(model.bias)  # (the step donates model)
    new, _, _ = step(model, step.optimizer.init(model), batch)
    np.testing.assert_array_equal(new.weight, weight)
    assert not np.array_equal(new.bias, bias)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'steps_per_cal' \(did you mean 'steps_per_call'"):
        make(mse, ft.optim.adam(0.1), steps_per_cal=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'learning_rate'\.(.|\n)*help\(ft.train.train_step\)"):
        make(mse, ft.optim.adam(0.1), learning_rate=0.1)


def test_a_loss_taking_no_batch_is_refused_where_the_step_is_built():
    # session 60: Optimizer.minimize's loss_fn(model), given to the Trainer or train_step,
    # failed at the first step with "<lambda>() takes 1 positional argument but 2 were given"
    from functree.train._eval_step import LOSS_TAKES_NO_BATCH

    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))

    def loss(m):
        return ft.losses.mean_squared_error(m(x), y)

    with pytest.raises(TypeError) as info:
        ft.train.Trainer(model, ft.optim.sgd(0.1), loss)
    assert str(info.value) == LOSS_TAKES_NO_BATCH.format(
        name="loss", signature="(m)", count=1, s="", wrong="ft.train.Trainer(model, optimizer, loss_fn)")
    with pytest.raises(TypeError, match=r"takes 0 positional arguments: no batch"):
        ft.train.train_step(lambda *, key: 0.0, ft.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"right:  ft\.train\.train_step\(loss_fn, optimizer\)   # def loss_fn\(model, batch\)"):
        ft.train.train_step(loss, ft.optim.sgd(0.1))
    # the loss as the message shows it trains; minimize still takes the loss without a batch
    step = ft.train.train_step(lambda m, b: ft.losses.mean_squared_error(m(b[0]), b[1]), ft.optim.sgd(0.1), donate=False)
    _, _, metrics = step(model, step.optimizer.init(model), (x, y))
    np.testing.assert_allclose(float(metrics["loss"]), float(loss(model)), rtol=0, atol=1e-6)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    assert float(opt.minimize(loss, model, opt.init(model))[2]) == pytest.approx(float(loss(model)), abs=1e-6)
