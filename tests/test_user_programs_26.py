"""The twenty-sixth session's migration audit: six programs written as Equinox / Flax NNX /
optax users would (notes/user/twentysixth/) ran and matched raw JAX + optax; the mistakes a
migrating user makes along the way each raise an error naming the fix. Pinned here: the
ones that raised Python's bare errors before (model.apply / model.eval on a model,
nnx.Optimizer's argument order, an integer seed as a key, a loss taking the batch unpacked)."""

from __future__ import annotations

import importlib
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import functree as ft
from functree._foreign_methods import FOREIGN_FUNCTION, FOREIGN_FUNCTIONS, FOREIGN_METHODS
from functree._jit import OPTIMIZER_ARGUMENT
from functree._random import NOT_A_KEY
from functree.optim._optimizer import MODEL_FIRST
from functree.train._eval_step import LOSS_UNPACKS_BATCH


@pytest.fixture(scope="module")
def dense():
    return ft.nn.Dense(2, 3, key=jax.random.key(0))


@pytest.mark.parametrize("name, right", [
    ("apply", "model(x)"), ("init", "ft.parameters(model)"), ("train", "ft.nn.training(model)"),
    ("eval", "ft.nn.inference(model)"), ("parameters", "ft.parameters(model)"),
    ("state_dict", "ft.to_flat_dict(model)"),
])
def test_other_libraries_methods_name_the_fix(dense, name, right):
    """Flax's model.apply(params, x) / model.init, NNX's and torch's model.train() /
    model.eval(), torch's parameters() / state_dict() raised Python's bare "'Dense' object
    has no attribute 'apply'"; each names functree's way now."""
    with pytest.raises(AttributeError, match=f"no attribute '{name}': ") as info:
        getattr(dense, name)
    assert FOREIGN_METHODS[name][0] in str(info.value)
    assert right in str(info.value)
    assert info.value.name == name and info.value.obj is dense  # Python's "Did you mean" reads them


def test_other_attributes_keep_python_errors(dense):
    """Another missing name keeps Python's message; a property whose own code raised
    AttributeError raises its own error, not "no attribute <the property>"."""
    with pytest.raises(AttributeError, match=r"^'Dense' object has no attribute 'weigth'$"):
        dense.weigth  # noqa: B018

    class Broken(ft.Module):
        w: jax.Array

        @property
        def width(self):
            return self.w.shapee

    with pytest.raises(AttributeError, match="shapee"):
        Broken(jnp.ones(2)).width  # noqa: B018
    assert not hasattr(dense, "init_cache") and hasattr(dense, "weight")


def test_optimizer_in_nnx_argument_order(dense):
    """nnx.Optimizer(model, tx) written as ft.optim.Optimizer(model, tx) raised Python's
    "takes 2 positional arguments but 3 were given"."""
    with pytest.raises(TypeError) as info:
        ft.optim.Optimizer(dense, optax.adam(1e-3))
    assert str(info.value) == MODEL_FIRST.format(count=2, given="Dense, GradientTransformationExtraArgs")
    assert "opt_state = optimizer.init(model)" in str(info.value)


@pytest.mark.parametrize("seed, given", [(0, "int 0"), (jnp.arange(2.0), "an array of float32[2]")])
def test_integer_seed_as_key(seed, given):
    """ft.nn.Dense(4, 3, key=0) (torch's seed habit) and Dropout(x, key=5) raised
    "'int' object has no attribute 'dtype'" from deep inside the draw."""
    expected = NOT_A_KEY.format(given=given)
    with pytest.raises(TypeError) as info:
        ft.nn.Dense(4, 3, key=seed)
    assert str(info.value) == expected
    with pytest.raises(TypeError) as info:
        ft.nn.training(ft.nn.Dropout(0.5))(jnp.ones(3), key=seed)
    assert str(info.value) == expected


def test_legacy_keys_still_accepted():
    """jax.random.PRNGKey's raw uint32 keys are keys: the check refuses only non-keys."""
    a = ft.nn.Dense(4, 3, key=jax.random.PRNGKey(0)).weight
    b = ft.nn.Dense(4, 3, key=jax.random.wrap_key_data(jax.random.PRNGKey(0))).weight
    assert bool((a == b).all())


def test_loss_taking_the_batch_unpacked(dense):
    """Equinox's loss(model, x, y) given to the Trainer or train_step failed at the first
    step with "<lambda>() missing 1 required positional argument: 'y'"; refused at
    construction, naming the unpacking lambda."""
    def loss(model, x, y):
        return ft.losses.softmax_cross_entropy(model(x), y)

    def keyed(model, x, y, *, key):
        return loss(model, x, y)

    common = dict(name="loss", count=3)
    with pytest.raises(TypeError) as info:
        ft.train.Trainer(dense, optax.adam(1e-3), loss)
    assert str(info.value) == LOSS_UNPACKS_BATCH.format(
        signature="(model, x, y)", wrong="ft.train.Trainer(model, optimizer, loss_fn)",
        right="ft.train.Trainer(model, optimizer, lambda model, batch: loss_fn(model, *batch))", **common)
    with pytest.raises(TypeError) as info:
        ft.train.Trainer(dense, optax.adam(1e-3), keyed, key=jax.random.key(0))
    assert "lambda model, batch, *, key: loss_fn(model, *batch, key=key), key=key)" in str(info.value)
    with pytest.raises(TypeError) as info:
        ft.train.train_step(loss, optax.adam(1e-3))
    assert "ft.train.train_step(lambda model, batch: loss_fn(model, *batch), optimizer)" in str(info.value)
    # the fix trains; a loss with *batch, a default third argument or a key is accepted as before
    x, y = jnp.ones((4, 2)), jnp.array([0, 1, 2, 0])
    step = ft.train.train_step(lambda m, b: loss(m, *b), optax.sgd(0.1), donate=False)
    _, _, metrics = step(dense, step.optimizer.init(dense), (x, y))
    assert metrics["loss"].shape == ()
    for fine in (lambda m, *b: 0.0, lambda m, b, scale=1.0: 0.0, lambda m, b, key=None: 0.0):
        ft.train.train_step(fine, optax.sgd(0.1))


@pytest.mark.parametrize("package, name, right", [
    ("functree", "filter_jit", "ft.jit(step)"), ("functree", "filter_value_and_grad", "ft.value_with_gradient"),
    ("functree", "apply_updates", "ft.move(model, along=updates)"), ("functree", "tree_at", "ft.set(model"),
    ("functree.nn", "Linear", "ft.nn.Dense(in_size, out_size"), ("functree.nn", "inference_mode", "ft.nn.inference"),
])
def test_other_libraries_functions_name_the_fix(package, name, right):
    """ft.filter_jit, ft.apply_updates, ft.nn.Linear, ft.nn.inference_mode (Equinox's and
    NNX's names) raised "module 'functree' has no attribute 'filter_jit'"; each names
    functree's way now, and another missing name keeps Python's message."""
    module = importlib.import_module(package)
    what, fix = FOREIGN_FUNCTIONS[package][name]
    with pytest.raises(AttributeError) as info:
        getattr(module, name)
    assert str(info.value) == FOREIGN_FUNCTION.format(package=package, name=name, what=what, right=fix)
    assert right in fix
    with pytest.raises(AttributeError, match=rf"^module '{package}' has no attribute 'nothing_here'$"):
        module.nothing_here  # noqa: B018


@pytest.mark.parametrize("make", [lambda: ft.optim.Optimizer(ft.optim.adam(1e-3)), lambda: optax.adam(1e-3)],
                         ids=["Optimizer", "optax"])
def test_optimizer_passed_into_jit(dense, make):
    """NNX's `@nnx.jit def train_step(model, optimizer, batch)` written with ft.jit: the
    error told to make the optimizer static (static_leaves=True) or, for an optax
    transformation, named its `init` function as a model's leaf; it names the optimizer and
    shows the step that closes over it and takes its state."""
    optimizer = make()

    @ft.jit
    def step(model, optimizer, x):
        return model(x)

    with pytest.raises(TypeError) as info:
        step(dense, optimizer, jnp.ones((1, 2)))
    assert str(info.value) == OPTIMIZER_ARGUMENT.format(fn="step", path="optimizer", type=type(optimizer).__name__)


def test_module_getattr_hidden_from_type_checkers():
    """Module.__getattr__ is defined only when not type checking: a class-level __getattr__
    tells pyright and mypy that every attribute exists (typed Any), and `model.weigth`
    (pyright: "Cannot access attribute") was accepted silently. Read from the source: the
    suite runs no type checker."""
    import ast
    import inspect

    from functree import _module

    module_class = next(node for node in ast.parse(inspect.getsource(_module)).body
                        if isinstance(node, ast.ClassDef) and node.name == "Module")
    direct = [n.name for n in module_class.body if isinstance(n, ast.FunctionDef)]
    guarded = [n.name for branch in module_class.body if isinstance(branch, ast.If)
               and ast.unparse(branch.test) == "not typing.TYPE_CHECKING"
               for n in branch.body if isinstance(n, ast.FunctionDef)]
    assert "__getattr__" not in direct and guarded == ["__getattr__"]


def test_overridden_stage_calls_the_loss_its_own_way(dense):
    """A TrainStep subclass overriding step (or apply, compute_loss) may call loss_fn(model,
    *batch): its three-argument loss is not refused."""
    class Unpacking(ft.train.TrainStep):
        def step(self, model, opt_state, batch, key=None, enabled=None):
            return super().step(model, opt_state, batch, key, enabled)

    Unpacking(lambda m, x, y: 0.0, optax.sgd(0.1))


@pytest.fixture(scope="module")
def dropout_net():
    return ft.nn.Sequential(ft.nn.Dense(2, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4), ft.nn.Dropout(0.5),
                            ft.nn.Dense(4, 1, key=jax.random.key(1)))


def _dropout_loss(m, b, *, key=None):
    return jnp.mean((m(b[0], key=key) - b[1]) ** 2)


def test_train_step_on_a_fresh_model_given_a_key_warns(dropout_net):
    """An Equinox/NNX/torch habit: a fresh model (functree's start in inference mode) trained
    by train_step with a key trained silently with Dropout off and BatchNorm frozen (the
    running mean stayed 0); the first call warns, naming the layers and ft.nn.training."""
    from functree.train._setup import STEP_IN_INFERENCE

    batch = (jnp.ones((8, 2)), jnp.ones((8, 1)))
    step = ft.train.train_step(_dropout_loss, optax.sgd(0.1), donate=False)
    state = step.optimizer.init(dropout_net)
    with pytest.warns(ft.train.TrainingModeWarning) as record:
        step(dropout_net, state, batch, key=jax.random.key(0))
    assert str(record[0].message) == STEP_IN_INFERENCE.format(
        paths="layers.1 (BatchNorm), layers.2 (Dropout)", run="run")
    assert record[0].filename == __file__  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(dropout_net, state, batch, key=jax.random.key(1))             # once per step
        for model, key in ((ft.nn.training(dropout_net), jax.random.key(0)), (dropout_net, None)):
            fresh = ft.train.train_step(_dropout_loss, optax.sgd(0.1), donate=False)
            fresh(model, state, batch, key=key)                              # training mode, or no key
        trainer = ft.train.Trainer(dropout_net, optax.sgd(0.1), _dropout_loss, key=jax.random.key(0))
        trainer.fit([batch], epochs=1, progress=False)                      # the Trainer switches it
    assert bool((trainer.model.layers[1].running_mean != 0).all())
