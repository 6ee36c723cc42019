"""Trainer.__init__ / fit / evaluate / predict answer another library's keyword (Keras,
PyTorch Lightning, Hugging Face) with an error naming functree's equivalent, and a typo with
its closest name (was: Python's bare "got an unexpected keyword argument 'verbose'"). The
error's ``right:`` line is run here to check that it does what the other library's call did."""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train import Trainer
from functree.train._trainer import SPELLINGS, UNKNOWN_KEYWORD

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 3)).astype(np.float32)
M = np.ones((32, 1), np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def masked_mse(model, batch):
    x, m, y = batch
    return jnp.sum(m * (model(x) - y) ** 2) / jnp.sum(m)


def mse(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def make(loss=mse, **kw):
    return Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(0.05), loss, **kw)


def error_of(call):
    with pytest.raises(TypeError) as info:
        call()
    return str(info.value)


def right_line(message):
    """The code of the error's ``right:`` line (its comment dropped)."""
    line = next(x for x in message.splitlines() if x.strip().startswith("right:"))
    return line.split("right:", 1)[1].split("   #")[0].strip()


def test_the_users_keras_call_names_progress_and_its_right_line_runs():
    """The report: fit((X, M, Y), epochs=5, batch_size=16, verbose=False)."""
    trainer = make(masked_mse)
    message = error_of(lambda: trainer.fit((X, M, Y), epochs=5, batch_size=16, verbose=False))
    assert message.startswith("Trainer.fit() got an unexpected keyword argument 'verbose' (Keras's name).")
    assert "wrong:  trainer.fit(data, verbose=False)" in message
    assert right_line(message) == "trainer.fit(data, progress=False)"
    assert trainer.steps_run == 0  # refused before any step
    trainer.fit((X, M, Y), epochs=5, batch_size=16, progress=False)  # the right line, with its arguments
    assert (trainer.steps_run, trainer.epoch) == (5 * 2, 5)  # Keras: 5 epochs of ceil(32 / 16) steps
    assert len(trainer.history.epochs["loss"]) == 5


def test_verbose_one_is_progress_true():
    assert right_line(error_of(lambda: make().fit((X, Y), verbose=1))) == "trainer.fit(data, progress=True)"


@pytest.mark.parametrize("name, value, steps, epochs", [
    ("max_epochs", 3, 6, 3),             # Lightning: the job's epochs (2 minibatches of 16 each)
    ("num_train_epochs", 2, 4, 2),       # Hugging Face
    ("max_steps", 3, 3, 1),              # Lightning: the job's steps
])
def test_lightning_and_hf_counts_run_as_named(name, value, steps, epochs):
    trainer = make()
    message = error_of(lambda: trainer.fit((X, Y), batch_size=16, **{name: value}))
    assert f"unexpected keyword argument {name!r}" in message
    data = ft.train.batches((X, Y), 16, key=jax.random.key(1))
    exec(right_line(message).replace("trainer.fit(data,", "trainer.fit(data, progress=False,"),
         {"trainer": trainer, "data": data})
    assert (trainer.steps_run, trainer.epoch) == (steps, epochs)


def test_max_epochs_in_the_constructor_names_fit():
    message = error_of(lambda: make(max_epochs=4))
    assert message.startswith("Trainer.__init__() got an unexpected keyword argument 'max_epochs' (Lightning's name).")
    assert "wrong:  ft.train.Trainer(model, optimizer, loss_fn, max_epochs=4)" in message
    assert right_line(message) == "trainer.fit(data, epochs=4)"


def test_steps_per_epoch_is_epochs_times_it_in_all():
    """Keras's fit(epochs=3, steps_per_epoch=2) runs 3 × 2 = 6 steps; fit(steps=) counts them all."""
    trainer = make()
    message = error_of(lambda: trainer.fit((X, Y), epochs=3, steps_per_epoch=2))
    assert right_line(message) == "trainer.fit(data, steps=3 * 2)"
    assert "not per epoch" in message
    exec(right_line(message).replace(")", ", progress=False)"),
         {"trainer": trainer, "data": ft.train.batches((X, Y), 8)})
    assert trainer.steps_run == 3 * 2


def test_validation_split_holds_out_the_last_rows_as_keras():
    trainer = make()
    message = error_of(lambda: trainer.fit((X, Y), validation_split=0.25, progress=False))
    scope = {"trainer": trainer, "x": X, "y": Y}
    exec(right_line(message).replace("validation_data=", "progress=False, validation_data="), scope)
    n = scope["n"]
    assert n == 24  # Keras: floor(32 * (1 - 0.25)) training rows, the last 8 for validation
    expected = float(np.mean((np.asarray(trainer.inference_model(X[24:])) - Y[24:]) ** 2))
    np.testing.assert_allclose(trainer.history.epochs["val_loss"][-1], expected, rtol=0, atol=1e-6 * expected)  # measured: 1e-7 x the value


def test_x_and_y_name_data_without_a_data_argument():
    trainer = make()
    message = error_of(lambda: trainer.fit(x=X, y=Y, epochs=1))
    assert "unexpected keyword argument 'x' (Keras's name)" in message
    assert "wrong:  trainer.fit(x=" in message  # no `data, ` the caller never wrote
    assert right_line(message) == "trainer.fit((x, y), ...)"
    assert "wrong:  trainer.evaluate(x=" in error_of(lambda: trainer.evaluate(x=X, y=Y))
    assert right_line(error_of(lambda: trainer.predict(x=X))) == "trainer.predict(x)"


def test_validation_keywords_run_as_named():
    trainer = make()
    val = ft.train.batches((X, Y), 8, shuffle=False)
    message = error_of(lambda: trainer.fit((X, Y), validation_steps=2))
    exec(right_line(message).replace("trainer.fit(data,", "trainer.fit(data, progress=False,"),
         {"trainer": trainer, "data": (X, Y), "itertools": itertools, "batches": val})
    expected = float(np.mean((np.asarray(trainer.inference_model(X[:16])) - Y[:16]) ** 2))  # 2 minibatches of 8
    np.testing.assert_allclose(trainer.history.epochs["val_loss"][-1], expected, rtol=0, atol=1e-6 * expected)  # measured: 1e-7 x the value
    for name, library in (("val_dataloaders", "Lightning's"), ("eval_dataset", "Hugging Face's")):
        kw: dict[str, object] = {name: val}  # (not one of fit's keywords)
        message = error_of(lambda kw=kw: trainer.fit((X, Y), **kw))
        assert f"({library} name)" in message and "validation_data=" in right_line(message)


def test_validation_freq_rounds_validate_every_n_epochs():
    trainer, seen = make(), []
    message = error_of(lambda: trainer.fit((X, Y), epochs=4, validation_freq=2))
    code = right_line(message).replace("trainer.fit(data,", "trainer.fit(data, progress=False,")
    code = code.replace("trainer.evaluate(validation_data)", "seen.append((trainer.epoch, trainer.evaluate(validation_data)))")
    exec(code, {"trainer": trainer, "data": (X, Y), "epochs": 4, "validation_data": (X, Y), "seen": seen})
    assert [epoch for epoch, _ in seen] == [2, 4]


def test_restore_spellings_continue_from_a_checkpoint(tmp_path):
    trainer = make()
    trainer.fit((X, Y), epochs=1, progress=False)
    trainer.save(str(tmp_path / "run"))
    for name, call in (("initial_epoch", lambda t: t.fit((X, Y), initial_epoch=1)),
                       ("ckpt_path", lambda t: t.fit((X, Y), ckpt_path=str(tmp_path / "run"))),
                       ("resume_from_checkpoint", lambda t: t.fit((X, Y), resume_from_checkpoint=True))):
        message = error_of(lambda call=call: call(make()))
        assert f"argument {name!r}" in message and "trainer.restore(" in right_line(message)
    restored = make()
    code = right_line(error_of(lambda: restored.fit((X, Y), ckpt_path=str(tmp_path / "run"))))
    exec(code.replace("epochs=N", "epochs=2, progress=False"), {"trainer": restored, "data": (X, Y)})
    trainer.fit((X, Y), epochs=2, progress=False)
    for a, b in zip(jax.tree.leaves(restored.model), jax.tree.leaves(trainer.model)):
        np.testing.assert_array_equal(a, b)  # as if never interrupted


@pytest.mark.parametrize("method, name, says", [
    ("fit", "shuffle", "ft.train.batches((x, y), batch_size, shuffle=False)"),
    ("fit", "class_weight", "per_example_loss"),
    ("fit", "sample_weight", "per_example_loss"),
    ("fit", "validation_batch_size", "validation_data=ft.train.batches(val, False, shuffle=False)"),
    ("fit", "train_dataloaders", "trainer.fit(train_dataloaders, ...)"),
    ("fit", "train_dataset", "trainer.fit(train_dataset, ...)"),
    ("evaluate", "verbose", "trainer.evaluate(data)   # evaluate and predict show no progress bar"),
    ("evaluate", "sample_weight", "per_example_loss"),
    ("evaluate", "steps", "trainer.evaluate(list(itertools.islice(batches, False)))"),
    ("evaluate", "return_dict", "it returns {name: value} already"),
    ("evaluate", "eval_dataset", "trainer.evaluate(eval_dataset)"),
    ("evaluate", "dataloaders", "trainer.evaluate(dataloaders)"),
    ("predict", "verbose", "trainer.predict(data)"),
    ("predict", "callbacks", "it calls no callbacks"),
    ("predict", "test_dataset", "trainer.predict(test_dataset)"),
])
def test_each_spelling_names_its_equivalent(method, name, says):
    trainer = make()
    message = error_of(lambda: getattr(trainer, method)((X, Y), **{name: False}))
    assert message.startswith(f"Trainer.{method}() got an unexpected keyword argument {name!r} (")
    assert says in message


@pytest.mark.parametrize("name, says", [
    ("compute_metrics", "metrics=[ft.train.accuracy]"),
    ("optimizers", "ft.optim.adamw(ft.optim.warmup_cosine_decay(...))"),
    ("train_dataset", "trainer.fit(train_dataset, ...)"),
    ("eval_dataset", "validation_data=eval_dataset"),
    ("callbacks", "trainer.fit(data, callbacks=[...])"),
    ("verbose", "trainer.fit(data, progress=False)"),
])
def test_constructor_spellings(name, says):
    assert says in error_of(lambda: make(**{name: False}))


def test_every_spelling_formats():
    """Each table entry makes its message (no stray braces), for every method."""
    trainer = make()
    calls = {"Trainer": make, "fit": lambda **kw: trainer.fit((X, Y), **kw),
             "evaluate": lambda **kw: trainer.evaluate((X, Y), **kw), "predict": lambda **kw: trainer.predict(X, **kw)}
    for method, names in SPELLINGS.items():
        for name in names:
            message = error_of(lambda method=method, name=name: calls[method](**{name: 2}))
            assert f"unexpected keyword argument {name!r} (" in message and "{" not in message.replace("{name", "")


@pytest.mark.parametrize("method, typo, meant", [
    ("fit", "epoch", "epochs"), ("fit", "validation", "validation_data"), ("fit", "log_evry", "log_every"),
    ("evaluate", "batchsize", "batch_size"), ("predict", "batch", "batch_size"), ("Trainer", "metric", "metrics"),
])
def test_a_typo_names_the_closest_keyword(method, typo, meant):
    trainer = make()
    call = make if method == "Trainer" else lambda **kw: getattr(trainer, method)((X, Y), **kw)
    message = error_of(lambda: call(**{typo: 1}))
    assert f"unexpected keyword argument {typo!r} (did you mean {meant!r}?)" in message
    assert f"{meant}=..." in right_line(message)


def test_a_name_like_none_says_where_to_look():
    message = error_of(lambda: make().fit((X, Y), zzz=1))
    assert message == UNKNOWN_KEYWORD.format(method="Trainer.fit", name="zzz", why="", wrong="trainer.fit(data, zzz=1)",
                                             right="trainer.fit(data, ...)   # help(ft.train.Trainer.fit)")


def test_data_is_still_required():
    trainer = make()
    for method in ("fit", "evaluate", "predict"):
        assert error_of(getattr(trainer, method)) == f"Trainer.{method}() missing 1 required positional argument: 'data'"


def test_signatures_keep_their_keywords():
    for fn, first in ((Trainer.__init__, "model"), (Trainer.fit, "data"), (Trainer.evaluate, "data"),
                      (Trainer.predict, "data")):
        params = list(inspect.signature(fn).parameters.values())
        assert params[1].name == first and params[-1].kind is inspect.Parameter.VAR_KEYWORD
    names = inspect.signature(Trainer.fit).parameters
    assert {"epochs", "steps", "validation_data", "callbacks", "progress", "log_every", "batch_size"} <= set(names)
    assert "Other libraries' names" in (Trainer.predict.__doc__ or "") and "each twice" in (Trainer.predict.__doc__ or "")


def test_known_keywords_still_work():
    trainer = make()
    assert trainer.fit(data=(X, Y), epochs=1, progress=False) is trainer.history
    assert sorted(trainer.evaluate(data=(X, Y), batch_size=8)) == ["loss"]
    assert trainer.predict(data=X, batch_size=8).shape == (32, 1)


def test_kerass_positional_fit_x_y_names_the_tuple():
    """fit(X, Y) (Keras's positional x, y) put Y in epochs: the error printed the whole
    array as "epochs must be a positive int"; it names fit((x, y)), which then runs."""
    trainer = make()
    with pytest.raises(ValueError, match=r"(?s)got an array of shape \(32, 1\): Keras's positional fit\(x, y\)"
                                         r".*right:  trainer.fit\(\(x, y\), epochs=5\)"):
        trainer.fit(X, Y, progress=False)
    assert trainer.steps_run == 0
    trainer.fit((X, Y), epochs=2, batch_size=16, progress=False)
    assert trainer.steps_run == 4


@pytest.mark.parametrize("name", ["step", "global_step", "iterations", "current_epoch", "params", "optimizer_state"])
def test_another_loops_attribute_names_ours_and_its_right_line_reads_it(name):
    """`trainer.step` (Lightning's global_step, Keras's iterations, flax's params) raised
    Python's AttributeError suggesting the private `_step`; it names the attribute here,
    whose right line reads the same value."""
    trainer = make()
    trainer.fit((X, Y), steps=3, batch_size=8, progress=False)
    with pytest.raises(AttributeError, match=rf"has no attribute '{name}': .* is trainer\.") as info:
        getattr(trainer, name)
    right = right_line(str(info.value))
    value = eval(right, {"trainer": trainer})
    expected = {"steps_run": 3, "epoch": 0}.get(right.split(".")[1])
    assert value == expected if expected is not None else value is not None


@pytest.mark.parametrize("name", ["learning_rate", "lr"])
def test_reading_the_learning_rate_on_the_trainer_names_the_optimizer_state(name):
    """`trainer.learning_rate` (Keras's optimizer.learning_rate, torch's lr) raised a bare
    "no attribute 'learning_rate'"; it names the optimizer state's hyperparameter, whose right
    line reads the rate the job trains with."""
    trainer = make()
    with pytest.raises(AttributeError, match=rf"has no attribute '{name}': the learning rate is a hyperparameter") as info:
        getattr(trainer, name)
    rate = eval(right_line(str(info.value)), {"trainer": trainer, "ft": ft})
    np.testing.assert_allclose(rate, ft.optim.hyperparameters(trainer.opt_state)["learning_rate"], rtol=0, atol=0)

def test_an_attribute_typo_names_the_closest_public_attribute():
    trainer = make()
    with pytest.raises(AttributeError, match=r"no attribute 'histroy'; did you mean trainer\.history\?"):
        trainer.histroy  # noqa: B018
    with pytest.raises(AttributeError, match=r"no attribute '_stp'$"):  # private names: no guess
        trainer._stp  # noqa: B018
    assert not hasattr(trainer, "global_step") and getattr(trainer, "_none", 7) == 7


def test_an_unknown_attribute_assigned_is_refused_naming_the_setting_or_the_call_that_takes_it():
    """`trainer.epochs = 5` and a callback's `trainer.stop_trainig = True` made attributes
    nothing read: fit trained its default epoch, and on past the stop. Each right line runs."""
    trainer = make()
    with pytest.raises(AttributeError, match=r"(?s)Trainer has no setting 'epochs': it is an argument of "
                                             r"trainer\.fit\(\.\.\.\).*nothing reads") as info:
        trainer.epochs = 2
    assert right_line(str(info.value)) == "trainer.fit(data, epochs=2)" and "epochs" not in vars(trainer)
    eval(right_line(str(info.value)), {"trainer": trainer, "data": ft.train.batches((X, Y), 16)})
    assert trainer.steps_run == 4

    class Stop(ft.train.Callback):
        line = "trainer.stop_trainig = True"

        def on_epoch_end(self, trainer, context):
            exec(self.line, {"trainer": trainer})

    with pytest.raises(AttributeError, match=r"(?s)no setting 'stop_trainig' \(did you mean 'stop_training'.*"
                                             r"Settings it takes now: model, opt_state, key, extra, stop_training, "
                                             r"steps_per_call.*right:  trainer\.stop_training = True$") as info:
        trainer.fit((X, Y), epochs=4, batch_size=16, progress=False, callbacks=[Stop()])
    Stop.line = right_line(str(info.value))
    trainer = make()
    trainer.fit((X, Y), epochs=4, batch_size=16, progress=False, callbacks=[Stop()])
    assert trainer.epoch == 1  # stopped after its first epoch
    with pytest.raises(AttributeError, match=r"right:  trainer = ft\.train\.Trainer\(model, None, loss_fn\)$"):
        trainer.optimzer = None
    trainer.steps_per_call, trainer.stop_training = 2, False  # its settings take values


def test_a_fit_assigns_nothing_per_step_through_the_settings_check(monkeypatch):
    """The check is a Python __setattr__: a step's commit writes the instance dict."""
    from functree.train._built import Settings

    assigned = []
    checked = Settings.__setattr__
    monkeypatch.setattr(Settings, "__setattr__", lambda self, n, v: (assigned.append(n), checked(self, n, v))[1])
    trainer = make()
    counts = []
    for steps in (1, 2, 8):  # (the first builds the step)
        del assigned[:]
        trainer.fit((X, Y), steps=trainer.steps_run + steps, batch_size=2, progress=False, log_every=100)
        counts.append(sorted(assigned))
    assert counts[1] == counts[2]


def _keras_step(name, w, state, g, t, lr=1e-3, centered=False, momentum=0.0):
    """One Keras 3 ``update_step`` (keras/src/optimizers/<name>.py, transcribed in NumPy) at
    Keras's defaults; ``state`` holds its slots, ``t`` counts from 1."""
    m, v, u = state
    if name in ("adam", "adamw"):  # ε added to √v before the bias correction
        if name == "adamw":
            w = w - w * 0.004 * lr
        m, v = m + (g - m) * 0.1, v + (g * g - v) * 0.001
        w = w - m * (lr * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)) / (np.sqrt(v) + 1e-7)
    elif name == "rmsprop":  # ε inside the root; momentum's buffer holds the rate
        v = 0.9 * v + 0.1 * g * g
        u = 0.9 * u + 0.1 * g if centered else u
        m = momentum * m + lr * g / np.sqrt(v - (u * u if centered else 0) + 1e-7)
        w = w - m
    elif name == "adagrad":
        v = v + g * g
        w = w - lr * g / np.sqrt(v + 1e-7)
    elif name == "adadelta":
        v = 0.95 * v + 0.05 * g * g
        delta = -np.sqrt(u + 1e-7) * g / np.sqrt(v + 1e-7)
        u = 0.95 * u + 0.05 * delta * delta
        w = w + lr * delta
    elif name == "adamax":
        m, u = m + (g - m) * 0.1, np.maximum(0.999 * u, np.abs(g))
        w = w - lr * m / ((1 - 0.9**t) * (u + 1e-7))
    elif name == "lion":
        w, m = w - lr * np.sign(0.9 * m + 0.1 * g), 0.99 * m + 0.01 * g
    elif name == "sgd":
        w = w - 0.01 * g
    return w, (m, v, u)


def test_keras_optimizer_names_give_keras_3s_own_numbers():
    """Each ``right:`` line of :data:`KERAS_OPTIMIZERS` against Keras 3 itself (JAX backend,
    float64 variables), 8 steps, gradients of magnitude 1e-8 ... 1. Before: adagrad 7.4e-7
    and adamax 1.4e-3 of Keras's move apart (torch's ε placement); measured now: 0 for
    every line but adamw, 2.0e-12 (Keras's decay multiplies by ``lr * wd`` first)."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs another backend (KERAS_BACKEND)")
    from functree.train._trainer import KERAS_OPTIMIZERS

    classes = {"adam": "Adam", "sgd": "SGD", "rmsprop": "RMSprop", "adamw": "AdamW", "adagrad": "Adagrad",
               "adadelta": "Adadelta", "adamax": "Adamax", "lion": "Lion", "nadam": "Nadam"}
    assert set(classes) == set(KERAS_OPTIMIZERS)
    scales = 10.0 ** np.arange(-8, 1)
    rng = np.random.default_rng(1)
    w0, grads = rng.normal(size=scales.size), rng.normal(size=(8, scales.size)) * scales
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    try:
        with jax.enable_x64(True):
            for name, line in KERAS_OPTIMIZERS.items():
                theirs = getattr(keras.optimizers, classes[name])()
                v = keras.Variable(w0, dtype="float64")
                theirs.build([v])
                tx = eval(line, {"ft": ft})
                w, state = jnp.asarray(w0), tx.init(jnp.asarray(w0))
                for g in grads:
                    theirs.apply_gradients([(jnp.asarray(g), v)])
                    updates, state = tx.update(jnp.asarray(g), state, w)
                    w = w + updates
                expected = np.asarray(v.value)  # (v.numpy(): a NumPy 2 DeprecationWarning in Keras)
                moved = np.abs(expected - w0)  # from 1e-8 (the 1e-8 gradients' column) to 8e-3
                np.testing.assert_array_less(np.abs(np.asarray(w) - expected), 1e-10 * moved + 1e-300,
                                             err_msg=f"{name}: {line}")
    finally:
        keras.config.set_floatx(floatx)


KERAS_EXTRA = {"rmsprop centered momentum": (
    "ft.optim.rmsprop(1e-3, epsilon=1e-7, momentum=0.5, centered=True, eps_in_sqrt=True)",
    {"centered": True, "momentum": 0.5})}


def test_keras_optimizer_names_give_keras_numbers_for_small_gradients_too():
    """Each ``right:`` line of :data:`KERAS_OPTIMIZERS` against Keras 3's update, float64,
    8 steps, gradients of magnitude 1e-8 ... 1 (where ε's place shows). Before: "adam" and
    "adamw" took ε = 1e-7 after the bias correction (their moves 15×, 2.5×, 1.4× Keras's for
    gradients of order 1e-8, 1e-6, 1e-5), "rmsprop" outside the root (17× for 1e-4, 3000×
    for 1e-8), "adagrad" 2.5e-7 (torch's √s + ε for Keras's √(s + ε), s >= 0.1) and
    "adamax" 1.2e-3 (torch's max(β₂u, |g| + ε) for Keras's max(β₂u, |g|) + ε), relative to
    Keras's move, at gradients of order 1e-7. Measured now: below 1e-9 for every line."""
    from functree.train._trainer import KERAS_OPTIMIZERS

    scales = 10.0 ** np.arange(-8, 1)
    rng = np.random.default_rng(1)
    w0, grads = rng.normal(size=scales.size), rng.normal(size=(8, scales.size)) * scales
    cases = {name: (line, {}) for name, line in KERAS_OPTIMIZERS.items() if name != "nadam"}  # nadam: test_user_programs_27
    cases.update(KERAS_EXTRA)
    with jax.enable_x64(True):
        txs = {name: eval(line, {"ft": ft}) for name, (line, _) in cases.items()}

        def run(gs):
            out = {}
            for name, tx in txs.items():
                w = jnp.asarray(w0)
                state = tx.init(w)
                for g in gs:
                    updates, state = tx.update(g, state, w)
                    w = w + updates
                out[name] = w
            return out

        ours = jax.tree.map(np.asarray, jax.jit(run)(jnp.asarray(grads)))
    tolerance: dict[str, float] = {}
    for name, (line, options) in cases.items():
        w, state = w0, (np.zeros_like(w0), np.full_like(w0, 0.1 if name == "adagrad" else 0.0), np.zeros_like(w0))
        for t, g in enumerate(grads, start=1):
            w, state = _keras_step(name.split()[0], w, state, g, t, **options)
        moved = np.abs(w - w0)  # from 8e-9 (the 1e-8 gradients' column) to 8e-3
        np.testing.assert_array_less(np.abs(ours[name] - w), tolerance.get(name, 1e-9) * moved + 1e-15,
                                     err_msg=f"{name}: {line}")
