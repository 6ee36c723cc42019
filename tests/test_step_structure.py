"""Structural checks of a training step (no timing; the benchmarks in benchmarks/ time it).

The step is the dispatch-bound benchmark's: an MLP 8-16-16-1 on a batch of 4, one Adam
step. Checked: ``ft.train.train_step`` traces once over three calls; the donated model and
optimizer state alias the outputs in the compiled program (``memory_analysis``) and are
deleted after a call; the step's jaxpr has about as many equations as raw JAX + optax's;
after its first calls a loop sends nothing to the device implicitly and compiles nothing
(``jax.transfer_guard``, JAX's log of compiles).
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import compiled
from _jaxpr import all_equations

import functree as ft
import functree.optim._leafwise as leafwise

SIZES = (8, 16, 16, 1)
LR = 1e-3
# raw 150, functree 176 (opt.minimize under ft.jit and ft.train.train_step; 177 before the
# optimizer-core rewrite, 171 before samples_seen took two words). What is left is the price
# of hyperparameters kept as arrays (no recompile on set_hyperparameters): optax computes
# 1 - beta per leaf when beta is traced (12 scalar subs here), reading the packed values
# (1 unstack) and the learning context's update (6, and 5 for samples_seen's carry into its
# high word). All are scalar operations that XLA folds into the fused update kernels (the
# kernel counts of benchmarks/host_ops.py did not change with the carry).
EXTRA_EQUATIONS = 26


def _batch():
    x = jax.random.normal(jax.random.key(1), (4, SIZES[0]))
    y = jax.random.normal(jax.random.key(2), (4, SIZES[-1]))
    return x, y


def _model():
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    last = len(SIZES) - 2
    return ft.nn.Sequential([
        ft.nn.Dense(i, o, jax.nn.relu if n < last else ft.nn.identity, key=k)
        for n, (i, o, k) in enumerate(zip(SIZES[:-1], SIZES[1:], keys))
    ])


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _raw_step():
    tx = optax.adam(LR)

    def loss_fn(params, x, y):
        for i in range(len(SIZES) - 1):
            x = x @ params[f"w{i}"] + params[f"b{i}"][None, :]
            if i < len(SIZES) - 2:
                x = jax.nn.relu(x)
        return jnp.mean((x - y) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params = {}
    for i, layer in enumerate(_model().layers):
        params[f"w{i}"], params[f"b{i}"] = jnp.array(layer.weight), jnp.array(layer.bias)
    return step, (params, tx.init(params))


def _minimize_step():
    opt = ft.optim.Optimizer(ft.optim.adam(LR))

    @ft.jit(donate=(0, 1))
    def step(model, state, x, y):
        return opt.minimize(_loss, model, state, x, y)

    model = _model()
    return step, (model, opt.init(model))


def _train_step(on_nan="ignore"):  # like raw: no NaN gate (test_the_nan_gate_... counts it)
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)
    model = _model()
    return (lambda model, state, x, y: step(model, state, (x, y))), (model, opt.init(model))


def _equations(step, carry) -> int:
    """Equations in the jitted step's program (the body of its one ``jit`` equation)."""
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes float and int32
        closed = jax.make_jaxpr(step)(*carry, *_batch())
    eqns = closed.jaxpr.eqns
    if len(eqns) == 1 and "jaxpr" in eqns[0].params:  # a call of the jitted step
        return len(eqns[0].params["jaxpr"].jaxpr.eqns)
    return len(eqns)  # ft.jit's wrapper exposes the jitted function's own trace: the body


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_train_step_traces_once_over_three_calls():
    traces = []

    def loss_fn(model, batch):
        traces.append(1)  # runs only while JAX traces
        return _loss(model, *batch)

    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(loss_fn, opt)
    model = _model()
    state, batch = opt.init(model), _batch()
    counts = []
    for _ in range(3):
        model, state, metrics = step(model, state, batch)
        counts.append(len(traces))
    assert 1 <= counts[0] <= 2  # the trace, and the diagnostics' analysis of the loss
    assert counts[1] == counts[2] == counts[0]
    assert jnp.isfinite(metrics["loss"])


def test_train_step_traces_once_over_three_calls_with_new_batches():
    traces = []

    def loss_fn(model, batch):
        traces.append(1)
        return _loss(model, *batch)

    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(loss_fn, opt)
    model = _model()
    state = opt.init(model)
    counts = []
    for i in range(3):
        x, y = _batch()
        model, state, _ = step(model, state, (x + i, y))
        counts.append(len(traces))
    assert counts == [counts[0]] * 3


def test_donated_parameters_and_adam_moments_alias_the_outputs():
    step, (model, state) = _minimize_step()
    compiled = step.lower(model, state, *_batch()).compile()
    aliased = compiled.memory_analysis().alias_size_in_bytes
    assert aliased >= 3 * _nbytes(model)  # parameters, m and v, written in place
    raw_step, (params, raw_state) = _raw_step()
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes float and int32
        raw_aliased = raw_step.lower(params, raw_state, *_batch()).compile().memory_analysis().alias_size_in_bytes
    assert raw_aliased == _nbytes((params, raw_state))  # the reference aliases everything


@pytest.mark.parametrize("make", [_minimize_step, _train_step], ids=["ft.jit", "train_step"])
def test_donated_model_buffers_are_deleted_after_a_call(make):
    step, (model, state) = make()
    leaves = jax.tree.leaves(model)
    model, state, _ = step(model, state, *_batch())
    assert all(x.is_deleted() for x in leaves)
    assert not any(x.is_deleted() for x in jax.tree.leaves((model, state)))


@pytest.mark.parametrize("make", [_minimize_step, _train_step], ids=["ft.jit", "train_step"])
def test_every_optimizer_state_buffer_is_donated(make):
    step, (model, state) = make()
    leaves = jax.tree.leaves(state)
    step(model, state, *_batch())
    assert all(x.is_deleted() for x in leaves)


def test_raw_reference_step_equation_count_is_stable():
    step, carry = _raw_step()
    assert 120 <= _equations(step, carry) <= 180  # 150 with jax 0.10.2 / optax 0.2.8


@pytest.mark.parametrize("make", [_minimize_step, _train_step], ids=["ft.jit", "train_step"])
def test_step_equation_count_is_within_a_few_of_raw(make):
    raw_step, raw_carry = _raw_step()
    step, carry = make()
    assert _equations(step, carry) <= _equations(raw_step, raw_carry) + EXTRA_EQUATIONS


# The one gate of on_nan="skip"/"stop": one finiteness reduction (per leaf
# isfinite(sum(g - g)), stacked, argmin: 24 here), one lax.cond around the update and the
# flattening around it. 219 - 175 = 44 with jax 0.10.2, counting the equations inside the
# cond's branches (213 with all(isfinite(g)) per leaf, one equation less per leaf but a
# boolean array XLA tree-reduces; selects leaf by leaf before: 64 more than ungated).
GATE_EQUATIONS = 48
# On the CPU a separable transform's update runs leaf by leaf, one small cond per parameter
# (functree/optim/_leafwise.py): each branch repeats the transform's scalar work (bias
# corrections, hyperparameters: 287 - 213 = 74 for the 6 parameters here, with jax 0.10.2;
# 299 - 215 = 84 with jax 0.11.2, whose branches trace one equation more each).
BRANCH_EQUATIONS = 14


def _step_equations(on_nan: str) -> int:
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)
    model = _model()
    with jax.numpy_dtype_promotion("standard"):
        closed = jax.make_jaxpr(lambda m, s, x, y: step.step(m, s, (x, y)))(model, opt.init(model), *_batch())
    return all_equations(closed.jaxpr)


def test_the_nan_gate_costs_one_reduction_and_one_cond(monkeypatch):
    ignore, skip = _step_equations("ignore"), _step_equations("skip")
    assert ignore < skip <= ignore + GATE_EQUATIONS + BRANCH_EQUATIONS * 6
    assert _step_equations("stop") == skip  # the same step; "stop" differs in what follows
    monkeypatch.setattr(leafwise, "ENABLED", False)  # the one cond around the whole update
    assert ignore < _step_equations("skip") <= ignore + GATE_EQUATIONS


def test_the_nan_gate_reduces_each_gradient_to_one_float(monkeypatch):
    """The finiteness check is ``isfinite(sum(g - g))`` per gradient: every ``is_finite``
    of the gated step is on a scalar. ``all(isfinite(g))`` wrote a boolean array the size
    of each gradient, which XLA tree-reduced: four kernels per leaf, 4x the compile time
    of the check (benchmarks/hlo_compare.py)."""
    for enabled in (True, False):  # leaf by leaf (the CPU's) and the one cond
        monkeypatch.setattr(leafwise, "ENABLED", enabled)
        opt = ft.optim.Optimizer(ft.optim.adam(LR))
        step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan="stop")
        model = _model()
        text = step.lower(model, opt.init(model), _batch()).as_text()
        checked = re.findall(r"stablehlo\.is_finite %\S+ : \((tensor<[^>]*>)\)", text)
        assert len(checked) == len(jax.tree.leaves(model)) + 1  # each gradient and the loss
        assert set(checked) == {"tensor<f32>"}


def _copies(on_nan: str) -> int:
    """``copy`` instructions in the compiled train step (XLA copies a donated buffer
    before writing it when the old value is still read afterwards)."""
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)
    model = _model()
    text = step.lower(model, opt.init(model), _batch()).compile().as_text()
    return len(re.findall(r"= \S+ copy\(", text))


def test_the_nan_gate_adds_no_buffer_copies():
    ignore = _copies("ignore")
    assert _copies("skip") <= ignore
    assert _copies("stop") <= ignore  # a select leaf by leaf made it 15 against 5


@pytest.mark.parametrize("on_nan", ["skip", "stop"])
def test_the_gated_step_aliases_every_donated_byte(on_nan):
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)
    model = _model()
    state = opt.init(model)
    aliased = step.lower(model, state, _batch()).compile().memory_analysis().alias_size_in_bytes
    assert aliased >= _nbytes((model, state))


@pytest.mark.parametrize("on_nan", ["skip", "stop"])
def test_a_closed_gate_returns_the_donated_model_and_state_bit_for_bit(on_nan):
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)
    model = _model()
    state = opt.init(model)
    x, y = _batch()
    for _ in range(3):  # the loop's fast path: model and state passed back by their leaves
        model, state, _ = step(model, state, (x, y))
    before = [np.asarray(v) for v in jax.tree.leaves((model, state))]
    model, state, metrics = step(model, state, (x.at[0, 0].set(jnp.nan), y))
    assert int(metrics["nonfinite"]) == 0  # the first layer's weight
    after = jax.tree.leaves((model, state))
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert int(ft.optim.context(state).step) == 3


# Operations that would move data between the host and the device, or call back into Python,
# inside the compiled step (none may appear: the step runs asynchronously on any backend).
HOST_OPERATIONS = ("custom_call", "infeed", "outfeed", "send", "recv", "after_all", "!stablehlo.token")
HOST_PRIMITIVES = ("pure_callback", "io_callback", "debug_callback", "callback", "device_put")


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_the_gated_step_has_no_host_transfer_or_callback(on_nan):
    """The lowered (StableHLO) gated step: its conditionals branch on a predicate the step
    computes on the device (``is_finite``, ``reduce``, ``compare``), and nothing in it talks
    to the host. Whether a backend's *runtime* reads that predicate on the host is that
    backend's choice (XLA:CPU shares the memory; see functree/optim/_leafwise.py)."""
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)
    model = _model()
    state = opt.init(model)
    text = step.lower(model, state, _batch()).as_text()
    assert re.search(r"stablehlo\.case", text)
    for op in HOST_OPERATIONS:
        assert op not in text, op
    with jax.numpy_dtype_promotion("standard"):
        closed = jax.make_jaxpr(lambda m, s, x, y: step.step(m, s, (x, y)))(model, state, *_batch())

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from primitives(inner)

    names = set(primitives(closed.jaxpr))
    assert "cond" in names
    assert not names & set(HOST_PRIMITIVES)


# --- the host's work per step: Python frames, not time -------------------------------------
def _python_calls(call, *args) -> tuple[list[str], object]:
    """The Python functions ``call(*args)`` enters (C functions not listed), in order,
    and its result."""
    entered: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        out = call(*args)
    finally:
        sys.setprofile(None)
    return entered, out


def test_a_donating_loop_step_runs_its_call_and_two_generated_functions():
    # The host side of a loop step under ft.jit(donate=...): the flat program's own call
    # (the donation guard inside it, not a wrapper around it), its generated test that the
    # donated arguments are the previous results (taking their leaves) and the generated builder.
    step, (model, state) = _minimize_step()
    x, y = _batch()
    for _ in range(3):
        model, state, _ = step(model, state, x, y)
    entered, (model, state, loss) = _python_calls(step, model, state, x, y)
    assert entered == ["__call__", "take", "build"]
    assert isinstance(model, ft.nn.Sequential) and bool(jnp.isfinite(loss))


@pytest.mark.parametrize("on_nan", ["stop", "ignore"])
def test_a_train_step_call_in_a_loop_runs_two_calls_and_the_generated_functions(on_nan):
    # TrainStep.__call__ goes straight to its flat program (no run() frame), which runs
    # the donation guard inside; then the generated loop test and builder of the results.
    opt = ft.optim.Optimizer(ft.optim.adam(LR))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, on_nan=on_nan)  # "stop": the default
    model, batch = _model(), _batch()
    state = opt.init(model)
    for _ in range(3):
        model, state, _ = step(model, state, batch)
    entered, (model, state, metrics) = _python_calls(step, model, state, batch)
    assert entered == ["__call__", "__call__", "take", "build"]
    step.check()
    assert bool(jnp.isfinite(metrics["loss"]))


def test_a_subclass_overriding_run_has_it_called_on_every_step():
    class Counted(ft.train.TrainStep):
        runs = 0

        def run(self, *args, **kwargs):
            type(self).runs += 1
            return super().run(*args, **kwargs)

    opt = ft.optim.Optimizer(ft.optim.sgd(LR))
    step = Counted(lambda m, b: _loss(m, *b), opt)
    model, batch = _model(), _batch()
    state = opt.init(model)
    for _ in range(4):
        model, state, _ = step(model, state, batch)
    assert Counted.runs == 4


def test_a_several_steps_call_never_takes_the_one_step_program():
    # run(steps=1) of a steps_per_call=2 step runs one step; a plain call after it still
    # runs two (the one-step program is not taken for __call__).
    opt = ft.optim.Optimizer(ft.optim.sgd(0.5))
    step = ft.train.train_step(lambda m, b: _loss(m, *b), opt, steps_per_call=2, donate=False)
    model, (x, y) = _model(), _batch()
    state = opt.init(model)
    one = step.run(model, state, (x, y), steps=1)
    two = step(model, state, (jnp.stack([x, x]), jnp.stack([y, y])))
    again = step.run(one[0], one[1], (x, y), steps=1)
    for a, b in zip(jax.tree.leaves(two[0]), jax.tree.leaves(again[0])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_fresh_model_in_a_loop_is_still_checked_for_aliases_and_deleted_arrays():
    # Off the fast path (a model that is not the previous result) the guard runs again.
    step, (model, state) = _minimize_step()
    x, y = _batch()
    for _ in range(3):
        old, (model, state, _) = model, step(model, state, x, y)
    with pytest.raises(ValueError, match=r"'model' holds a deleted array at layers\.0\.weight"):
        step(old, state, x, y)
    first, second, last = model.layers
    tied = model.replace(layers=(first, second.replace(bias=first.bias), last))  # one array, two places
    with pytest.warns(ft.AliasWarning, match=r"layers\.0\.bias' and 'model\.layers\.1\.bias"):
        step(tied, state, x, y)


# --- the steady state: after the first calls, no implicit transfer and no compile ------------
# A Python scalar or NumPy array reaching a jitted program (or `jnp.asarray` of one) on each
# step is a host-to-device copy per step: invisible on a CPU, a synchronising transfer on
# an accelerator. jax.transfer_guard("disallow") refuses it (the explicit ones,
# jax.device_put, pass), on the CPU backend too; the compiles are JAX's log of them.
STEADY = 18  # > 16: a gated step's look at its stop log (every 16 calls) runs inside


@contextlib.contextmanager
def _steady():
    """The block runs no implicit host-to-device transfer; the list it gives holds the
    programs compiled inside it."""
    with compiled(clear=False) as names, jax.transfer_guard("disallow"):
        yield names


def _ft_jit_step(tx):
    """A hand-written step: ft.value_with_gradient, an ft.optim optimizer, ft.move."""
    @ft.jit(donate=(0, 1))
    def step(model, state, batch):
        loss, grads = ft.value_with_gradient(lambda m: _loss(m, *batch), model)
        updates, state = tx.update(grads, state, model)
        return ft.move(model, along=updates), state, loss

    return step, tx


def _train_step_of(tx, **options):
    step = ft.train.train_step(lambda m, b: _loss(m, *b), tx, **options)
    return step, step.optimizer


STEADY_STEPS = {
    "stop": lambda: _train_step_of(ft.optim.adam(LR)),
    "skip": lambda: _train_step_of(ft.optim.adam(LR), on_nan="skip"),
    "ignore": lambda: _train_step_of(ft.optim.adam(LR), on_nan="ignore"),
    "accumulate": lambda: _train_step_of(ft.optim.Optimizer(ft.optim.adam(LR), accumulate=2)),
    # the schedule's boundary (step 4) falls inside the block: the learning context, on device
    "schedule": lambda: _train_step_of(ft.optim.adam(ft.optim.piecewise([(4, 0.1), (100, 0.01)]))),
    "optax": lambda: _train_step_of(optax.chain(optax.clip_by_global_norm(1.0),
                                                optax.adam(optax.cosine_decay_schedule(0.1, 6)))),
    "ft.jit": lambda: _ft_jit_step(ft.optim.adam(ft.optim.cosine_decay(0.1, 6))),
}


@pytest.mark.parametrize("make", list(STEADY_STEPS.values()), ids=list(STEADY_STEPS))
def test_a_training_loop_sends_nothing_implicitly_and_compiles_nothing_after_its_first_calls(make):
    step, tx = make()
    model, batch = _model(), _batch()
    state = tx.init(model)
    with jax.numpy_dtype_promotion("standard"):  # (optax's adam mixes float and int32)
        for _ in range(2):
            model, state, _ = step(model, state, batch)
        with _steady() as names:
            for _ in range(STEADY):
                model, state, out = step(model, state, batch)
    assert names == []
    loss = out["loss"] if isinstance(out, dict) else out
    assert np.isfinite(np.asarray(loss))


def test_steps_after_a_save_and_between_evaluations_send_nothing_and_compile_nothing(tmp_path):
    step, opt = _train_step_of(ft.optim.adam(ft.optim.piecewise([(3, 0.1), (100, 0.01)])))
    evaluate = ft.train.eval_step(lambda m, b: _loss(m, *b))
    model, batch = _model(), _batch()
    state = opt.init(model)
    for _ in range(2):
        model, state, _ = step(model, state, batch)
    before = evaluate(model, batch)["loss"]
    ft.train.save(tmp_path / "job", {"model": model, "opt_state": state})
    with _steady() as names:
        for _ in range(4):
            model, state, _ = step(model, state, batch)
            after = evaluate(model, batch)["loss"]
    assert names == []
    assert float(after) < float(before)


def test_a_fit_on_device_batches_sends_nothing_and_compiles_nothing_after_its_first_epoch(tmp_path):
    # Epoch 1 compiles the step, the log's programs and validation's; from epoch 2's first
    # step to epoch 3's second (log reads, a schedule's boundary, a ModelCheckpoint save,
    # validation and the epoch's end inside) nothing is sent implicitly or compiled.
    batches = [(x + i, y) for i, (x, y) in enumerate([_batch()] * 6)]

    class Watched:  # the minibatches, with the block entered and left between two of them
        def __init__(self):
            self.epochs, self.names, self.inside = 0, None, contextlib.ExitStack()

        def __iter__(self):
            self.epochs += 1
            for i, b in enumerate(batches):
                if (self.epochs, i) == (2, 0):
                    self.names = self.inside.enter_context(_steady())
                if (self.epochs, i) == (3, 1):
                    self.inside.close()
                yield b

    trainer = ft.train.Trainer(_model(), ft.optim.adam(ft.optim.piecewise([(8, LR), (100, LR / 10)])),
                               lambda m, b: _loss(m, *b))
    data = Watched()
    with data.inside:  # (left at once should fit raise inside)
        trainer.fit(data, epochs=3, log_every=2, progress=False, validation_data=batches[:2],
                    callbacks=[ft.train.ModelCheckpoint(tmp_path, every_steps=9)])
    assert data.names == [] and trainer.steps_run == 18
    assert trainer.history.epochs["val_loss"][-1] < trainer.history.epochs["val_loss"][0]


def test_an_evaluation_after_its_first_call_sends_nothing_and_compiles_nothing():
    evaluate = ft.train.eval_step(lambda m, b: _loss(m, *b))
    model, batch = _model(), _batch()
    evaluate(model, batch)
    with _steady() as names:
        for _ in range(4):
            evaluate(model, batch)
    assert names == []

