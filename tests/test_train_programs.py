"""The process-wide compiled training steps (functree/train/_programs.py): a new Trainer or
TrainStep with the same loss function, optimizer configuration and shapes compiles nothing;
any difference in what the step computes gets its own program (issue 27 item 8)."""

import contextlib
import gc
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.train import _programs

COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def compilations():
    """The XLA compilations run inside the block (JAX's monitoring events), as a list."""
    seen: list[str] = []

    def listen(event, duration, **kwargs):
        if event == COMPILE:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def data(n=3):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
            for _ in range(n)]


def fit(optimizer, loss=mse, validation=False, **options):
    trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), optimizer, loss, **options)
    trainer.fit(data(), progress=False, validation_data=data(1) if validation else None)
    return trainer


def test_a_new_trainer_with_the_same_configuration_compiles_nothing():
    first = fit(ft.optim.adam(1e-2), validation=True)  # compiles the steps (and the loop's small programs)
    with compilations() as seen:
        second = fit(ft.optim.adam(1e-2), validation=True)  # a fresh optimizer object, the same configuration
    assert seen == []  # main: the step compiled again
    assert second.train_step._compiled is not first.train_step._compiled  # its own state ...
    assert second.train_step._shared is first.train_step._shared  # ... over the same programs
    assert second.eval_step._shared is first.eval_step._shared
    jax.tree.map(np.testing.assert_array_equal, second.model, first.model)  # the same numbers


def test_a_restore_or_a_replaced_model_in_the_same_process_compiles_nothing(tmp_path):
    """Restored arrays are committed to their device and a fresh trainer's were not: jax.jit
    keys its cache on that, so continuing a job in the process compiled the step again."""
    first = fit(ft.optim.adam(1e-2), validation=True)
    first.save(tmp_path)
    with compilations() as seen:
        restored = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.adam(1e-2), mse)
        restored.restore(tmp_path)
        restored.fit(data(), epochs=2, progress=False, validation_data=data(1))
        restored.model = ft.nn.training(ft.nn.Dense(3, 1, key=jax.random.key(1)))  # a callback's new model
        restored.fit(data(), epochs=3, progress=False)
    assert seen == []  # main: 4 (the step twice, two of the loop's small programs)
    assert restored.steps_run == first.steps_run + 6


def test_log_intervals_of_one_size_class_share_the_compiled_step():
    """The log buffer's rows are part of the step's signature: rounded up to a power of
    two, log_every 9 to 16 share one program (main: each log_every compiled its own)."""
    def run(log_every):
        trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.adam(1e-2), mse)
        trainer.fit(data(20), progress=False, log_every=log_every)
        return trainer

    first = run(10)
    with compilations() as seen:
        second = run(16)
    assert seen == []
    assert len(second.history.steps["loss"]) == len(first.history.steps["loss"]) == 20
    np.testing.assert_array_equal(second.history.steps["loss"], first.history.steps["loss"])


def test_another_configuration_gets_another_program():
    """Anything that may change what the step computes keys another program (no compilation
    needed to see it: the keys differ); the same configuration built anew keys the same."""
    def key(optimizer=None, loss=mse, **options):
        step = ft.train.TrainStep(loss, optimizer or ft.optim.adam(1e-2), **options)
        return _programs.program_key("TrainStep", step, step._RUNTIME)

    base = key()
    assert base is not None and key() == base and hash(key()) == hash(base)
    assert key(ft.optim.Optimizer(ft.optim.adam(1e-2))) == base  # an Optimizer around it: the same
    others = {
        "learning rate": key(ft.optim.adam(2e-2)),
        "schedule": key(ft.optim.adam(optax.linear_schedule(1e-2, 0.0, 100))),
        "optax": key(optax.adam(1e-2)),
        "accumulate": key(ft.optim.Optimizer(ft.optim.adam(1e-2), accumulate=2)),
        "clipping": key(ft.optim.Optimizer(ft.optim.adam(1e-2), transform_gradients=lambda g: g)),
        "wrt": key(ft.optim.Optimizer(ft.optim.adam(1e-2), wrt="weight")),
        "loss": key(loss=lambda m, b: jnp.mean(jnp.abs(m(b[0]) - b[1]))),
        "on_nan": key(on_nan="skip"),
        "metrics": key(metrics={"mae": lambda out: out.loss * 2}),
        "compute_dtype": key(compute_dtype=jnp.bfloat16),
        "donate": key(donate=False),
        "mesh": key(mesh=jax.make_mesh((1,), ("data",)), sharding="fsdp"),
    }
    for name, other in others.items():
        assert other is not None and other != base, name
    assert key(optimizer=ft.optim.adam(optax.linear_schedule(1e-2, 0.0, 100))) == others["schedule"]


def test_a_step_subclass_setting_shares_only_with_an_equal_setting():
    class Penalized(ft.train.TrainStep):
        def __init__(self, *args, weight=0.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.weight = weight

        def compute_loss(self, model, batch, key=None):
            loss, aux = super().compute_loss(model, batch, key)
            return loss + self.weight * jnp.sum(model.weight ** 2), aux

    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    out = {}
    for weight in (0.0, 1.0, 1.0):
        step = Penalized(mse, opt, weight=weight, donate=False)
        out.setdefault(weight, []).append((step, step(model, opt.init(model), data(1)[0])[0]))
    (a, ma), (b, mb), (c, mc) = out[0.0][0], out[1.0][0], out[1.0][1]
    assert a._shared is not b._shared and b._shared is c._shared
    assert not np.array_equal(ma.weight, mb.weight)  # the penalty acted: not the 0.0 program
    np.testing.assert_array_equal(mb.weight, mc.weight)


def test_an_entry_leaves_with_its_loss_function():
    namespace: dict = {"jnp": jnp}
    exec("def loss(model, batch):\n    return jnp.mean((model(batch[0]) - batch[1]) ** 2)", namespace)
    step = ft.train.train_step(namespace.pop("loss"), ft.optim.adam(1e-2))  # not a module's: by identity
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    with ft.config.override(diagnostics=False):  # their cache keeps the functions it analysed
        step(model, step.optimizer.init(model), data(1)[0])
    assert len(_programs._PROGRAMS) == 1
    del step
    gc.collect()
    assert len(_programs._PROGRAMS) == 0  # nothing in the table kept the step or its loss alive


def test_a_reloaded_module_s_loss_gets_its_own_program(tmp_path, monkeypatch):
    """``importlib.reload`` (``%autoreload``) re-runs a module into the same globals: its new
    loss equals the old one by code, and was keyed so; a new step ran the old program (loss
    6.16 where the reloaded loss is 0, and the weights moved)."""
    source = "import jax.numpy as jnp\nWEIGHT = {}\ndef loss(m, b):\n    return WEIGHT * jnp.mean((m(b[0]) - b[1]) ** 2)\n"
    (tmp_path / "reloaded_losses.py").write_text(source.format(1.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("reloaded_losses")
    model, batch = ft.nn.Dense(3, 1, key=jax.random.key(0)), data(1)[0]

    def first_step(loss):
        step = ft.train.train_step(loss, ft.optim.sgd(0.1), donate=False)
        return step(model, step.optimizer.init(model), batch)

    assert float(first_step(module.loss)[2]["loss"]) > 0
    (tmp_path / "reloaded_losses.py").write_text(source.format(0.0))
    for cached in (tmp_path / "__pycache__").glob("*"):
        cached.unlink()  # the same second's mtime: the source is read again
    module = importlib.reload(module)
    with pytest.warns(ft.ZeroDerivativeWarning):  # WEIGHT = 0: the new loss is constant
        moved, _, metrics = first_step(module.loss)
    assert float(metrics["loss"]) == 0.0
    np.testing.assert_array_equal(moved.weight, model.weight)


_SCALED_CELL = """
import jax, jax.numpy as jnp, functree as ft
G = 1.0
class Net(ft.Module):
    w: jax.Array
    def __call__(self, x):
        return G * (x @ self.w)
def loss_fn(m, batch):
    return jnp.sum(m(batch))
"""

_TRAINER_CELL = """
trainer = ft.train.Trainer(Net(jnp.ones((2, 1))), ft.optim.sgd(1.0), loss_fn)
trainer.fit([x], epochs=1, progress=False)
results = (trainer.model.w, trainer.evaluate([x])["loss"], trainer.predict(x))
"""


def test_a_trainer_cell_run_again_after_a_global_changed_runs_the_new_value():
    """A notebook: ``G = 3.0`` in a later cell, read by the model's ``__call__``, then the cell
    making the Trainer run again. The new Trainer's fit, evaluate and predict ran the programs
    the first Trainer traced with ``G = 1.0`` (found by loss function and configuration): the
    weights moved by 4 where the eager gradient says 12, evaluate and predict 3 times too
    small. The programs are keyed by what the user's code reads too; unchanged, they are shared."""
    ns: dict = {"x": np.ones((4, 2), np.float32)}
    for cell in (_SCALED_CELL, _TRAINER_CELL):
        exec(compile(cell, "<cell>", "exec"), ns)
    with compilations() as seen:
        exec(compile(_TRAINER_CELL, "<cell>", "exec"), ns)  # nothing changed: the same programs
    assert seen == []
    exec(compile("G = 3.0", "<cell>", "exec"), ns)
    exec(compile(_TRAINER_CELL, "<cell>", "exec"), ns)
    w, loss, out = ns["results"]
    np.testing.assert_allclose(w, -11.0, rtol=0, atol=1e-6)  # sgd(1.0): 1 - Σ_rows x·G = 1 - 4·3
    np.testing.assert_allclose(loss, 3.0 * 4 * 2 * -11.0, rtol=1e-6)  # eager: Σ G·x@w over 4 rows
    np.testing.assert_allclose(out, np.full((4, 1), 3.0 * 2 * -11.0), rtol=1e-6)


_SQUARE_CELL = """
@ft.differentiable
def sq(y):
    return y * y
def sq_loss(m, batch):
    return jnp.sum(sq(m(batch)))
"""

_RULE_CELL = """
@ft.derivative(of=sq)
def d_sq(x):
    return sq(x), lambda v: SLOPE * x * v
"""

_RULE_TRAINER_CELL = """
trainer = ft.train.Trainer(Net(jnp.ones((2, 1))), ft.optim.sgd(0.1), sq_loss)
trainer.fit([x], epochs=1, progress=False)
step = ft.train.train_step(sq_loss, ft.optim.sgd(0.1))
net = Net(jnp.ones((2, 1)))
results = (trainer.model.w, step(net, step.optimizer.init(net), x)[0].w)
"""


def test_a_derivative_rule_registered_again_trains_with_the_new_rule():
    """A notebook: the ``@ft.derivative(of=sq)`` cell edited and run again (or a global its rule
    reads set), then the Trainer cell. The rule is set on ``sq`` in place, and the programs were
    keyed by ``sq``'s identity: the new Trainer and a new train_step ran the old rule's program
    (w 0.6 where the new rule gives 0.8, then 0.0), silently."""
    ns: dict = {"x": np.ones((1, 2), np.float32), "SLOPE": 2.0}
    exec(compile(_SCALED_CELL + _SQUARE_CELL, "<cell>", "exec"), ns)
    for cell in (_RULE_CELL, _RULE_TRAINER_CELL):
        exec(compile(cell, "<cell>", "exec"), ns)
    # sum(sq(x @ w)) at x @ w = 2: the rule's SLOPE * 2 for each weight, times sgd's 0.1
    np.testing.assert_allclose(ns["results"], np.full((2, 2, 1), 1 - 0.1 * 2.0 * 2), rtol=0, atol=1e-6)
    exec(compile("SLOPE = 1.0", "<cell>", "exec"), ns)  # a global the rule reads
    exec(compile(_RULE_TRAINER_CELL, "<cell>", "exec"), ns)
    np.testing.assert_allclose(ns["results"], np.full((2, 2, 1), 1 - 0.1 * 1.0 * 2), rtol=0, atol=1e-6)
    exec(compile(_RULE_CELL.replace("SLOPE", "5.0"), "<cell>", "exec"), ns)  # the rule edited, run again
    exec(compile(_RULE_TRAINER_CELL, "<cell>", "exec"), ns)
    np.testing.assert_allclose(ns["results"], np.full((2, 2, 1), 1 - 0.1 * 5.0 * 2), rtol=0, atol=1e-6)


_JAX_RULES_CELL = """
@jax.custom_vjp
def clip(y):
    return y
def clip_fwd(y):
    return y, None
def clip_loss(m, batch):
    return jnp.sum(clip(m(batch)) ** 2)
@jax.custom_jvp
def cube(y):
    return y ** 3
def cube_loss(m, batch):
    return jnp.sum(cube(m(batch)))
"""

_JAX_RULE_DEFINITIONS = """
def clip_bwd(_, g):
    return (SLOPE * g,)
clip.defvjp(clip_fwd, clip_bwd)
@cube.defjvp
def cube_jvp(primals, tangents):
    return primals[0] ** 3, SLOPE * 3 * primals[0] ** 2 * tangents[0]
"""

_JAX_RULES_TRAINER_CELL = """
results = []
for loss in (clip_loss, cube_loss):
    trainer = ft.train.Trainer(Net(jnp.ones((2, 1))), ft.optim.sgd(0.1), loss)
    trainer.fit([x], epochs=1, progress=False)
    results.append(trainer.model.w)
"""


def test_a_jax_custom_vjp_or_jvp_rule_defined_again_trains_with_the_new_rule():
    """A notebook's ``clip.defvjp(fwd, bwd)`` / ``@cube.defjvp`` cell edited and run again (or a
    global the rule reads set), then the Trainer cell: the rules are set on the custom_vjp and
    custom_jvp objects in place, which the programs keyed by identity: the new Trainer ran the
    old rules (w 0.6 and -0.2 where the new ones give 0.8 and 0.4), silently."""
    ns: dict = {"x": np.ones((1, 2), np.float32), "SLOPE": 1.0}
    exec(compile(_SCALED_CELL + _JAX_RULES_CELL + _JAX_RULE_DEFINITIONS, "<cell>", "exec"), ns)
    exec(compile(_JAX_RULES_TRAINER_CELL, "<cell>", "exec"), ns)
    # at x @ w = 2: clip's 2 * 2 * SLOPE and cube's 3 * 4 * SLOPE for each weight, times sgd's 0.1
    expected = [1 - 0.1 * 4.0, 1 - 0.1 * 12.0]
    np.testing.assert_allclose(np.ravel(ns["results"]), np.repeat(expected, 2), rtol=0, atol=1e-6)
    exec(compile("SLOPE = 0.5", "<cell>", "exec"), ns)  # a global the rules read
    exec(compile(_JAX_RULES_TRAINER_CELL, "<cell>", "exec"), ns)
    expected = [1 - 0.1 * 2.0, 1 - 0.1 * 6.0]
    np.testing.assert_allclose(np.ravel(ns["results"]), np.repeat(expected, 2), rtol=0, atol=1e-6)
    exec(compile(_JAX_RULE_DEFINITIONS.replace("SLOPE", "0.25"), "<cell>", "exec"), ns)  # the rules edited
    exec(compile(_JAX_RULES_TRAINER_CELL, "<cell>", "exec"), ns)
    expected = [1 - 0.1 * 1.0, 1 - 0.1 * 3.0]
    np.testing.assert_allclose(np.ravel(ns["results"]), np.repeat(expected, 2), rtol=0, atol=1e-6)


_ACTIVATION_TRAINER_CELL = """
layer = ft.nn.Dense(2, 1, activation=sq, key=jax.random.key(0))
trainer = ft.train.Trainer(layer, ft.optim.sgd(0.1), sum_loss)
trainer.fit([x], epochs=1, progress=False)
results = (layer.weight, layer.bias, trainer.model.weight)
"""


def test_a_layer_whose_activation_rule_is_registered_again_trains_with_the_new_rule():
    """``ft.nn.Dense(..., activation=sq)`` with ``sq`` an ``ft.differentiable`` function: the
    rule cell edited and run again, a new Trainer ran the program traced with the old rule
    (the activation, a static value, was keyed by identity: weights 0.74 where the new rule
    gives -3.97), silently."""
    ns: dict = {"x": np.ones((1, 2), np.float32), "SLOPE": 2.0}
    exec(compile(_SCALED_CELL + _SQUARE_CELL + _RULE_CELL + "def sum_loss(m, batch):\n    return jnp.sum(m(batch))\n",
                 "<cell>", "exec"), ns)
    for cell, slope in ((_ACTIVATION_TRAINER_CELL, 2.0), (_RULE_CELL.replace("SLOPE", "20.0"), None),
                        (_ACTIVATION_TRAINER_CELL, 20.0)):
        exec(compile(cell, "<cell>", "exec"), ns)
        if slope is not None:  # sum(sq(x @ w + b)) at x = 1: the rule's slope * y for each weight
            w, b, trained = map(np.asarray, ns["results"])
            np.testing.assert_allclose(trained, w - 0.1 * slope * (w.sum() + b), rtol=0, atol=1e-5)
