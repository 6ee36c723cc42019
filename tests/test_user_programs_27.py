"""The twenty-seventh session's migration audit: four programs written as torch, Keras, optax
and Flax users would (a torch training loop with a learning-rate schedule and gradient
clipping, a Keras classifier with validation and early stopping through the Trainer, an
optax multi-optimizer over key-path labels, a Flax checkpoint-restore-continue loop) match
raw JAX + optax; the mistakes such users make on the way raise an error naming the fix.
Pinned here: those that raised Python's bare errors before (torch's and Keras's methods on
a model or an optimizer, torch's and Keras's names in ft / ft.nn / ft.optim / ft.losses,
Keras's fit(x, y, epochs=) and evaluate(x, y)) or misled (torch's Adam(model.parameters(),
lr) taken for a schedule; a Keras loss name or a loss of (predicted, expected) accepted as
loss_fn and failing at the first step)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree._foreign_methods import (
    FOREIGN_FUNCTION,
    FOREIGN_FUNCTIONS,
    FOREIGN_METHODS,
    LINEN_SETUP,
    OPTIMIZER_METHODS,
)
from functree.optim._optimizer import NNX_UPDATE, NOT_OPTIMIZER_STATE, TORCH_STEP
from functree.optim._signature import PARAMETERS_GIVEN
from functree.train._epochs import KERAS_POSITIONAL
from functree.train._trainer import (
    KERAS_EVALUATE,
    KERAS_OPTIMIZER,
    KERAS_OPTIMIZERS,
    LOSS_FN_NOT_A_FUNCTION,
    PREDICT_FN,
)

# |ft - raw| on losses of about 1: the SGD and AdamW programs measured 0 (ATOL: ten float32
# ulps of 1.0); Adam's with injected hyperparameters (runtime arrays, where the raw program
# folds constants: another rounding of each update) measured 2.6e-6 after nine steps (the
# torch loop) and 7.2e-7 (the multi-transform); ten times the larger.
ATOL = 1.2e-6
ATOL_ADAM = 3e-5


@pytest.fixture(scope="module")
def mlp():
    return ft.nn.Sequential(ft.nn.Dense(4, 8, key=jax.random.key(0)), ft.nn.relu,
                            ft.nn.Dense(8, 3, key=jax.random.key(1)))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
    return x, y


def _raw(model):
    """The model's parameters as the raw program's dict."""
    a, b = model.layers[0], model.layers[2]
    return {"w0": a.weight, "b0": a.bias, "w1": b.weight, "b1": b.bias}


def _raw_loss(p, x, y):
    logits = jax.nn.relu(x @ p["w0"] + p["b0"][None, :]) @ p["w1"] + p["b1"][None, :]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _loss(model, batch):
    return ft.losses.softmax_cross_entropy(model(batch[0]), batch[1])


def _raw_losses(tx, params, batches):
    """The raw JAX + optax loop's losses, one per batch (under standard dtype promotion:
    optax's schedules and bias corrections mix floats and ints; the suite runs strict)."""
    with jax.numpy_dtype_promotion("standard"):
        return _raw_loop(tx, params, batches)


def _raw_loop(tx, params, batches):
    state = tx.init(params)

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(_raw_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    out = []
    for x, y in batches:
        params, state, loss = step(params, state, x, y)
        out.append(float(loss))
    return np.array(out), params


def _minibatches(data, size=16, epochs=1):
    x, y = data
    return [(x[i:i + size], y[i:i + size]) for _ in range(epochs) for i in range(0, len(x), size)]


# --- 1. a torch user's loop: cosine schedule, clipping, opt.step() habits ---------------------

def test_torch_loop_with_schedule_and_clipping(mlp, data):
    """torch: `opt = Adam(model.parameters(), lr); sched = CosineAnnealingLR(opt, T);
    clip_grad_norm_(..., 0.5); opt.step(); sched.step()`, written functree's way: the
    schedule is the learning rate, clipping a transformation before it, one jitted
    minimize per step. Losses match raw JAX + optax's chain step for step."""
    batches = _minibatches(data, epochs=3)
    schedule = optax.cosine_decay_schedule(0.05, len(batches))
    opt = ft.optim.Optimizer(optax.chain(ft.optim.clip_by_global_norm(0.5),
                                         ft.optim.adam(ft.optim.schedule(schedule, unit="steps"))))
    step = ft.jit(lambda m, s, x, y: opt.minimize(lambda m, x, y: _loss(m, (x, y)), m, s, x, y))
    model, state, losses = mlp, opt.init(mlp), []
    for x, y in batches:
        model, state, loss = step(model, state, x, y)
        losses.append(float(loss))
    raw, params = _raw_losses(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(schedule)), _raw(mlp), batches)
    np.testing.assert_allclose(losses, raw, rtol=0, atol=ATOL_ADAM)
    np.testing.assert_allclose(model.layers[2].weight, params["w1"], rtol=0, atol=ATOL_ADAM)
    assert losses[-1] < losses[0]


def test_torch_optimizer_habits_name_the_fix(mlp):
    """torch's `optimizer.step()` raised "missing 4 required positional arguments",
    `zero_grad()` / `param_groups` / `state_dict()` Python's bare "no attribute", and
    `ft.optim.adam(model.parameters(), 1e-3)` took the model for a learning-rate schedule
    and failed at init ("schedules take a LearningContext, not a step count")."""
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    with pytest.raises(TypeError) as info:
        opt.step()
    assert str(info.value) == TORCH_STEP.format(given="none (missing loss_fn, model, state, batch)")
    with pytest.raises(TypeError, match="missing state, batch"):
        opt.step(_loss, mlp)
    for name, (why, _, right) in OPTIMIZER_METHODS.items():
        with pytest.raises(AttributeError) as info:
            getattr(opt, name)
        assert why in str(info.value) and right in str(info.value) and info.value.name == name
    with pytest.raises(AttributeError, match=r"^'Optimizer' object has no attribute 'nothing_here'$"):
        opt.nothing_here  # noqa: B018
    assert opt.accumulate == 1 and ft.optim.Optimizer.__name__ == "Optimizer"
    for given in (mlp, ft.parameters(mlp), {"w": jnp.ones(2)}, iter([jnp.ones(2)])):
        with pytest.raises(TypeError) as info:
            ft.optim.adam(given, 1e-3)
        assert str(info.value) == PARAMETERS_GIVEN.format(where="ft.optim.adam", given=type(given).__name__,
                                                          first="learning_rate")
    with pytest.raises(TypeError, match=r"tx = ft\.optim\.adamw"):
        ft.optim.adamw(mlp, lr=1e-3)
    ft.optim.adam(optax.constant_schedule(1e-3))  # a callable schedule is no model: the check lets it pass


@pytest.mark.parametrize("name, right", [
    ("to", "jax.device_put(model"), ("cuda", "jax.device_put(model"), ("half", "ft.cast(model, jnp.float16)"),
    ("named_parameters", "ft.to_flat_dict(ft.parameters(model)).items()"), ("load_state_dict", "ft.from_flat_dict"),
    ("zero_grad", "ft.gradient(loss_fn, at=model)"), ("forward", "model(x)"),
    ("compile", "ft.train.Trainer(model"), ("fit", "trainer.fit((x, y)"), ("summary", "ft.summary(model)"),
    ("predict", "model(x)"), ("evaluate", "trainer.evaluate((x, y))"), ("save_weights", "ft.train.save(path"),
    ("variables", "ft.to_flat_dict(model)"), ("bind", "ft.with_parameters(model, params)"),
    ("make_rng", "key=None"), ("sow", "return out, {"),
])
def test_torch_and_keras_model_methods_name_the_fix(mlp, name, right):
    """torch's model.to(device) / .cuda() / .half() / .named_parameters() /
    .load_state_dict(sd) / .zero_grad() / .forward(x), Keras's model.compile / fit /
    summary / predict / evaluate / save_weights, Flax linen's model.variables / bind /
    make_rng / sow raised Python's bare "'Sequential' object has no attribute ..."."""
    with pytest.raises(AttributeError, match=f"no attribute '{name}': ") as info:
        getattr(mlp, name)
    assert FOREIGN_METHODS[name][0] in str(info.value) and right in FOREIGN_METHODS[name][2]


def test_the_named_fixes_run(mlp, tmp_path):
    """The `right:` lines of the model methods above are code that runs."""
    flat = dict(ft.to_flat_dict(ft.parameters(mlp)).items())
    assert list(flat) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    assert ft.from_flat_dict(mlp, flat).layers[2].weight is flat["layers.2.weight"]
    assert ft.cast(mlp, jnp.bfloat16).layers[0].weight.dtype == jnp.bfloat16  # (float16: XLA CPU without F16C has no convert)
    assert jax.device_put(mlp, jax.devices()[0]).layers[0].weight.shape == (4, 8)
    assert ft.summary(mlp).parameter_count == 4 * 8 + 8 + 8 * 3 + 3
    ft.train.save(tmp_path / "w", mlp)
    assert bool((ft.train.load(tmp_path / "w", mlp).layers[0].weight == mlp.layers[0].weight).all())


@pytest.mark.parametrize("package, name, right", [
    ("functree", "no_grad", "out = model(x)"), ("functree", "manual_seed", "jax.random.key(seed)"),
    ("functree", "save", "ft.train.save(path, model)"), ("functree.nn", "Module", "ft.Module"),
    ("functree.nn", "ReLU", "ft.nn.relu"), ("functree.nn", "CrossEntropyLoss", "ft.losses.softmax_cross_entropy"),
    ("functree.nn", "BatchNorm2d", "momentum=0.9, epsilon=1e-5"), ("functree.nn", "utils", "clip_by_global_norm"),
    ("functree.optim", "Adam", "tx.init(ft.parameters(model))"), ("functree.optim", "SGD", "ft.optim.sgd(0.1"),
    ("functree.optim", "lr_scheduler", "ft.optim.schedule(optax.cosine_decay_schedule"),
])
def test_torch_names_in_packages_name_the_fix(package, name, right):
    """torch.no_grad / manual_seed / save, torch.nn's Module / ReLU / CrossEntropyLoss /
    BatchNorm2d / utils, torch.optim's Adam / SGD / lr_scheduler spelt on ft, ft.nn and
    ft.optim raised "module 'functree.optim' has no attribute 'Adam'"."""
    module = importlib.import_module(package)
    what, fix = FOREIGN_FUNCTIONS[package][name]
    with pytest.raises(AttributeError) as info:
        getattr(module, name)
    assert str(info.value) == FOREIGN_FUNCTION.format(package=package, name=name, what=what, right=fix)
    assert right in fix
    with pytest.raises(AttributeError, match=rf"^module '{package}' has no attribute 'nothing_here'$"):
        module.nothing_here  # noqa: B018


@pytest.mark.parametrize("name, ours", [("CrossEntropyLoss", "softmax_cross_entropy"),
                                        ("SparseCategoricalCrossentropy", "softmax_cross_entropy"),
                                        ("MSELoss", "mean_squared_error"), ("BCEWithLogitsLoss", "sigmoid_cross_entropy")])
def test_loss_classes_name_the_function(name, ours):
    """torch's nn.CrossEntropyLoss and Keras's losses.SparseCategoricalCrossentropy spelt on
    ft.losses raised Python's bare error; each names its function (Keras's class with its
    probabilities' note, as its function name's)."""
    with pytest.raises(AttributeError, match=f"its equivalent here is ft.losses.{ours} ") as info:
        getattr(ft.losses, name)
    if name == "SparseCategoricalCrossentropy":
        assert "jnp.clip(probs, 1e-7, 1 - 1e-7)" in str(info.value)


# --- 2. a Keras user's classifier: validation, early stopping, the Trainer -------------------

def test_keras_classifier_with_early_stopping(mlp, data):
    """Keras: `model.compile("sgd", "sparse_categorical_crossentropy", ["accuracy"]);
    model.fit(x, y, epochs=20, validation_data=..., callbacks=[EarlyStopping(patience=1,
    min_delta=...)])`, with the Trainer on minibatches in order. Its step losses, the
    epoch it stops at and its validation losses match a raw loop with Keras's rule."""
    x, y = data
    train, val = _minibatches((x[:32], y[:32])), [(x[32:], y[32:])]
    stop = ft.train.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)
    def loss_fn(model, batch):  # the logits as aux: what ft.train.accuracy reads
        logits = model(batch[0])
        return ft.losses.softmax_cross_entropy(logits, batch[1]), logits

    trainer = ft.train.Trainer(mlp, ft.optim.sgd(0.5), loss_fn, metrics=[ft.train.accuracy])
    history = trainer.fit(train, epochs=20, validation_data=val, callbacks=[stop], progress=False)

    @jax.jit
    def raw_step(p, x, y):  # Keras's SGD: p - 0.5 * g
        loss, g = jax.value_and_grad(_raw_loss)(p, x, y)
        return jax.tree.map(lambda p, g: p - 0.5 * g, p, g), loss

    params, raw_val, raw_steps = _raw(mlp), [], []
    best, wait = np.inf, 0
    for _ in range(20):
        for x_, y_ in train:
            params, loss = raw_step(params, x_, y_)
            raw_steps.append(float(loss))
        raw_val.append(float(jax.jit(_raw_loss)(params, *val[0])))
        if raw_val[-1] < best - 0.02:
            best, wait = raw_val[-1], 0
        else:
            wait += 1
            if wait >= 1:
                break
    assert 2 <= len(raw_val) < 20  # it stopped early
    assert history.epochs["epoch"][-1] == len(raw_val)
    np.testing.assert_allclose(history.epochs["val_loss"], raw_val, rtol=0, atol=ATOL)
    np.testing.assert_allclose(history.steps["loss"], raw_steps, rtol=0, atol=ATOL)


def test_keras_habits_on_the_trainer(mlp, data):
    """Keras's `fit(x, y, epochs=5)` raised Python's "got multiple values for argument
    'epochs'" and `evaluate(x, y)` "takes from 1 to 2 positional arguments but 3 were
    given"; a Keras loss name or ft.losses' (predicted, expected) loss given as loss_fn was
    accepted and failed at the first step ("'str' object is not callable"; "logits must be
    a floating array, got object[3]")."""
    x, y = data
    trainer = ft.train.Trainer(mlp, ft.optim.sgd(0.1), _loss)
    with pytest.raises(ValueError) as info:
        trainer.fit(x, y, epochs=2)
    assert str(info.value) == KERAS_POSITIONAL.format(shape=(48,))
    with pytest.raises(TypeError) as info:
        trainer.evaluate(x, y)
    assert str(info.value) == KERAS_EVALUATE.format(method="evaluate", count=2)
    assert trainer.steps_run == 0  # refused before anything ran
    cases = [("sparse_categorical_crossentropy", "'sparse_categorical_crossentropy' (a Keras loss name)",
              "'sparse_categorical_crossentropy'", "ft.losses.softmax_cross_entropy(model(batch[0]), batch[1])"),
             ("mse", "'mse' (a Keras loss name)", "'mse'", "ft.losses.mean_squared_error(model(batch[0]), batch[1])"),
             (ft.losses.mean_squared_error, "ft.losses.mean_squared_error (a loss of predictions and labels: it "
              "would get the model and the batch)", "ft.losses.mean_squared_error",
              "ft.losses.mean_squared_error(model(batch[0]), batch[1])"),
             (optax.softmax_cross_entropy_with_integer_labels, "optax.softmax_cross_entropy_with_integer_labels (a "
              "loss of predictions and labels: it would get the model and the batch)",
              "optax.softmax_cross_entropy_with_integer_labels",
              "optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()")]
    for loss_fn, given, wrong, right in cases:
        with pytest.raises(TypeError) as info:
            ft.train.Trainer(mlp, ft.optim.sgd(0.1), loss_fn)
        why = given[len(wrong):]
        assert str(info.value) == LOSS_FN_NOT_A_FUNCTION.format(given=wrong, why=why, wrong=wrong, right=right)
    # the positional epochs and a one-argument evaluate still run
    trainer.fit([(x, y)], 1, progress=False)
    assert trainer.steps_run == 1 and set(trainer.evaluate([(x, y)])) == {"loss"}


# --- 3. an optax user's multi-optimizer over key-path labels ----------------------------------

def test_optax_multi_transform_over_key_path_labels(mlp, data):
    """optax: `optax.multi_transform({"body": adam, "head": sgd+momentum}, labels)` with the
    labels made from a key-path mask of the model, stepped by hand (ft.value_with_gradient,
    tx.update, ft.move), and ft.optim.groups by pattern: both match raw optax on a dict."""
    transforms = {"body": optax.adam(1e-2), "head": optax.sgd(0.1, momentum=0.9)}
    labels = jax.tree.map(lambda head: "head" if head else "body", ft.mask(mlp, "layers.2.*"))
    batches = _minibatches(data, epochs=2)

    def run(tx):
        @ft.jit
        def step(m, s, x, y):
            loss, g = ft.value_with_gradient(lambda m: _loss(m, (x, y)), at=m)
            u, s = tx.update(g, s, ft.parameters(m))
            return ft.move(m, along=u), s, loss

        model, state, out = mlp, tx.init(ft.parameters(mlp)), []
        with jax.numpy_dtype_promotion("standard"):  # plain optax's adam, as _raw_losses
            for x, y in batches:
                model, state, loss = step(model, state, x, y)
                out.append(float(loss))
        return np.array(out)

    raw_labels = {"w0": "body", "b0": "body", "w1": "head", "b1": "head"}
    raw, _ = _raw_losses(optax.multi_transform(transforms, raw_labels), _raw(mlp), batches)
    np.testing.assert_allclose(run(optax.multi_transform(transforms, labels)), raw, rtol=0, atol=ATOL_ADAM)
    by_pattern = ft.optim.groups({"layers.0.*": optax.adam(1e-2), "layers.2.*": optax.sgd(0.1, momentum=0.9)})
    np.testing.assert_allclose(run(by_pattern), raw, rtol=0, atol=ATOL_ADAM)


# --- 4. a Flax user's checkpoint, restore and continue -----------------------------------------

def test_flax_checkpoint_restore_continue(mlp, data, tmp_path):
    """Flax: `checkpoints.save_checkpoint(dir, TrainState(params, opt_state, step))`, later
    `restore_checkpoint(dir, target=state)` and train on: here ft.train.save of the model
    and optimizer state and ft.train.load against a fresh template. The restored run ends
    where the uninterrupted one does, and both match raw JAX + optax."""
    opt = ft.optim.Optimizer(ft.optim.adamw(1e-2, weight_decay=0.01))
    step = ft.jit(lambda m, s, x, y: opt.minimize(lambda m, x, y: _loss(m, (x, y)), m, s, x, y))
    batches = _minibatches(data, epochs=2)

    def train(model, state, part):
        losses = []
        for x, y in part:
            model, state, loss = step(model, state, x, y)
            losses.append(float(loss))
        return model, state, losses

    model, state, first = train(mlp, opt.init(mlp), batches[:3])
    ft.train.save(tmp_path / "ckpt", {"model": model, "opt_state": state, "step": 3})
    template = {"model": mlp, "opt_state": opt.init(mlp), "step": 0}  # a fresh run's, as Flax's target=
    restored = ft.train.load(tmp_path / "ckpt", template)
    assert restored["step"] == 3
    model, _, rest = train(restored["model"], restored["opt_state"], batches[3:])
    _, _, whole = train(mlp, opt.init(mlp), batches)
    assert first + rest == whole  # bit for bit: the state carries the step count and the moments
    # functree's adamw decays weights but not biases (optax's mask: the ndim > 1 leaves)
    raw_tx = optax.adamw(1e-2, weight_decay=0.01, mask=lambda p: jax.tree.map(lambda v: v.ndim > 1, p))
    raw, params = _raw_losses(raw_tx, _raw(mlp), batches)
    np.testing.assert_allclose(whole, raw, rtol=0, atol=ATOL_ADAM)
    np.testing.assert_allclose(model.layers[0].weight, params["w0"], rtol=0, atol=ATOL_ADAM)


def test_flax_linen_setup_names_the_fields():
    """A Flax linen port that makes its submodules in setup() (never called here) failed
    at the first call with Python's bare "'Net' object has no attribute 'dense'"; a class
    without setup keeps Python's message."""
    class Net(ft.Module):
        def setup(self):
            self.dense = ft.nn.Dense(2, 3, key=jax.random.key(0))

        def __call__(self, x):
            return self.dense(x)

    with pytest.raises(AttributeError) as info:
        Net()(jnp.ones(2))
    assert str(info.value) == LINEN_SETUP.format(cls="Net", name="dense")

    class Plain(ft.Module):
        def __call__(self, x):
            return self.dense(x)

    with pytest.raises(AttributeError, match=r"^'Plain' object has no attribute 'dense'$"):
        Plain()(jnp.ones(2))


def test_nnx_optimizer_update_orders(mlp):
    """Flax NNX's optimizer.update(model, grads) was refused as "needs the state that
    Optimizer.init made ... got Sequential" (which named the wrong cause) and the older
    optimizer.update(grads) raised Python's "missing 1 required positional argument:
    'state'"; both name the (grads, state, model) order and ft.move."""
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    state = opt.init(mlp)
    grads = ft.gradient(lambda m: m(jnp.ones((1, 4))).sum(), at=mlp)
    for args, given in (((mlp, grads), "(model, grads)"), ((grads,), "(grads)")):
        with pytest.raises(TypeError) as info:
            opt.update(*args)
        assert str(info.value) == NNX_UPDATE.format(given=given)
    with pytest.raises(TypeError) as info:  # another library's state keeps its own message
        opt.update(grads, optax.sgd(0.1).init(ft.parameters(mlp)), mlp)
    assert str(info.value) == NOT_OPTIMIZER_STATE.format(given="tuple")
    updates, _ = opt.update(grads, state, mlp)
    assert ft.move(mlp, along=updates).layers[0].weight.shape == (4, 8)


def test_predict_given_the_labels(mlp, data):
    """trainer.predict(x, y) took the labels for fn and failed deep inside with "The truth
    value of an array with more than one element is ambiguous"."""
    x, y = data
    trainer = ft.train.Trainer(mlp, ft.optim.sgd(0.1), _loss)
    with pytest.raises(TypeError) as info:
        trainer.predict(x, y)
    assert str(info.value) == PREDICT_FN.format(given="an array of shape (48,)")
    assert trainer.predict(x[:4]).shape == (4, 3)


def test_jax_grad_moves_running_statistics_ft_gradient_does_not():
    """The migration pages' caution, pinned: jax.grad differentiates BatchNorm's running
    statistics (in inference mode, the default, they get a real gradient), optax.adamw
    trains them and optax.apply_updates(model, updates) applies it: silently wrong.
    ft.gradient holds None there, and ft.move keeps them bit for bit."""
    net = ft.nn.Sequential(ft.nn.Dense(2, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4))
    net = ft.set(net, "layers.1.running_variance", jnp.full(4, 2.0))
    tx, x = optax.adamw(0.1, weight_decay=0.1), jnp.arange(6.0).reshape(3, 2)

    def loss(m):
        return m(x).sum()

    @jax.jit
    def raw_step(m, s):
        u, s = tx.update(jax.grad(loss)(m), s, m)
        return optax.apply_updates(m, u), s

    @ft.jit
    def our_step(m, s):
        u, s = tx.update(ft.gradient(loss, at=m), s, ft.parameters(m))
        return ft.move(m, along=u), s

    with jax.numpy_dtype_promotion("standard"):  # optax's adamw, as _raw_losses
        raw, state, ours, our_state = net, tx.init(net), net, tx.init(ft.parameters(net))
        for _ in range(5):
            raw, state = raw_step(raw, state)
            ours, our_state = our_step(ours, our_state)
    assert float(jnp.abs(raw.layers[1].running_variance - 2.0).max()) > 0.3  # trained as a parameter
    assert bool((ours.layers[1].running_variance == 2.0).all())
    assert not bool((ours.layers[0].weight == net.layers[0].weight).all())  # the parameters trained


def test_keras_optimizer_name():
    """Keras's compile(optimizer="adam") carried over as ft.train.Trainer(model, "adam",
    loss_fn) raised "train_step needs a ft.optim.Optimizer ..., got 'adam'" with a
    train_step call as its fix; it names the optimizer with Keras's defaults, each of which
    builds."""
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    with pytest.raises(TypeError) as info:
        ft.train.Trainer(model, "adam", _loss)
    assert str(info.value) == KERAS_OPTIMIZER.format(given="adam", right=KERAS_OPTIMIZERS["adam"],
                                                     note="   # Keras's defaults")
    with pytest.raises(TypeError, match=r"right:  ft\.train\.Trainer\(model, ft\.optim\.adam\(1e-3\), loss_fn\)$"):
        ft.train.Trainer(model, "ftrl", _loss)  # no entry: the message's generic line
    for right in KERAS_OPTIMIZERS.values():
        eval(right, {"ft": ft})  # the `right:` lines build


def _keras_nadam(w, grads, lr=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Keras 3's Nadam update, transcribed in NumPy from its documented algorithm: the
    momentum schedule u_t = β₁ (1 − ½ 0.96^t), its running product, Nesterov's blend."""
    m, v, product = np.zeros_like(w), np.zeros_like(w), 1.0
    for t, g in enumerate(grads, start=1):
        u_t, u_next = (beta_1 * (1 - 0.5 * 0.96 ** s) for s in (t, t + 1))
        product *= u_t
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g * g
        m_hat = u_next * m / (1 - product * u_next) + (1 - u_t) * g / (1 - product)
        w = w - lr * m_hat / (np.sqrt(v / (1 - beta_2 ** t)) + epsilon)
    return w


def test_keras_nadam_is_named_with_its_momentum_schedule():
    """Keras's "nadam" got the generic ft.optim.adam line. Keras 3's Nadam is torch's NAdam
    with momentum_decay 1.0 (its schedule's 0.96^t, torch's 0.96^(0.004 t)) and ε 1e-7: the
    line built so gives Keras's update (float64, 6 steps, measured 2.8e-17: atol 1e-15 of
    weights of about 1), and torch's default schedule is another (1.6e-4 apart here)."""
    rng = np.random.default_rng(0)
    w0, grads = rng.normal(size=5), rng.normal(size=(6, 5))
    with pytest.raises(TypeError, match=r"ft\.optim\.nadam\(1e-3, momentum_decay=1\.0, epsilon=1e-7\)"):
        ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), "Nadam", _loss)
    expected = _keras_nadam(w0, grads)
    with jax.enable_x64(True):
        runs = {}
        for name, tx in (("keras", eval(KERAS_OPTIMIZERS["nadam"], {"ft": ft})),
                         ("torch's schedule", ft.optim.nadam(1e-3, epsilon=1e-7))):
            w, state = jnp.asarray(w0), tx.init(jnp.asarray(w0))
            for g in grads:
                updates, state = tx.update(jnp.asarray(g), state, w)
                w = w + updates
            runs[name] = np.asarray(w)
    np.testing.assert_allclose(runs["keras"], expected, rtol=0, atol=1e-15)
    assert np.abs(runs["torch's schedule"] - expected).max() > 1e-5
