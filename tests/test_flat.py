"""functree._flat: a jitted function of pytrees called over flat leaves.

Checked: the generated builder rebuilds every kind of node as ``treedef.unflatten`` does;
a loop passing results back runs the same numbers as ``jax.jit``; results passed back are
not flattened again (unless they hold a mutable container, which may have been changed
in place); keyword calls and ``lower`` work; a result tree that changes with shapes is an
error that says so.
"""

from __future__ import annotations

import collections
import gc
import inspect
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree._flat import CHANGED_OUTPUT, PAUSE_NODES, PENDING, builder, flat_jit

Pair = collections.namedtuple("Pair", ["a", "b"])


def _model():
    return ft.nn.Sequential([ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(0)),
                             ft.nn.Dense(4, 1, key=jax.random.key(1))])


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x is y


@pytest.mark.parametrize("tree", [
    {"a": (1, None), "b": [2, 3]},
    Pair(1, (2,)),
    (),
    None,
    _model(),
], ids=["containers", "namedtuple", "empty", "none", "module"])
def test_builder_equals_unflatten(tree):
    leaves, treedef = jax.tree.flatten(tree)
    _same(builder(treedef)(leaves), treedef.unflatten(leaves))


def test_builder_rebuilds_optimizer_state_records_and_optax_states():
    model = _model()
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    state = opt.init(model)
    leaves, treedef = jax.tree.flatten((model, state))
    rebuilt = builder(treedef)(leaves)
    _same(rebuilt, (model, state))
    assert type(rebuilt[1]) is type(state) and ft.optim.context(rebuilt[1]).step == 0


def test_builder_uses_a_nodes_own_unflatten_for_other_pytrees():
    import optax

    state = optax.inject_hyperparams(optax.sgd)(0.1).init({"w": jnp.ones(2)})  # holds a dict
    leaves, treedef = jax.tree.flatten(state)
    _same(builder(treedef)(leaves), state)


def _sgd(model, opt_state, x, y):
    return ft.optim.Optimizer(ft.optim.sgd(0.1)).minimize(lambda m, x, y: jnp.mean((m(x) - y) ** 2),
                                                         model, opt_state, x, y)


def test_a_loop_runs_the_numbers_of_jax_jit():
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    x, y = jnp.ones((5, 3)), jnp.zeros((5, 1))
    flat = flat_jit(_sgd, donate=(0, 1))
    plain = jax.jit(_sgd)
    m1, m2 = _model(), _model()
    s1, s2 = opt.init(m1), opt.init(m2)
    for _ in range(4):
        m1, s1, loss1 = flat(m1, s1, x, y)
        m2, s2, loss2 = plain(m2, s2, x, y)
        np.testing.assert_array_equal(loss1, loss2)
    for a, b in zip(jax.tree.leaves((m1, s1)), jax.tree.leaves((m2, s2))):
        np.testing.assert_array_equal(a, b)


def test_a_loops_optimizer_state_is_built_on_first_read_with_the_steps_values():
    # A loop passes the state back by its leaves: neither its learning context nor its
    # transform's state is built per call (one object, not their trees), and the first
    # read of any field (by name, jax.tree, pickle) builds both, with the step's values.
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    x, y = jnp.ones((5, 3)), jnp.zeros((5, 1))
    flat, plain = flat_jit(_sgd, donate=(0, 1)), jax.jit(_sgd)
    m1, m2 = _model(), _model()
    s1, s2 = opt.init(m1), opt.init(m2)
    for _ in range(3):
        m1, s1, _ = flat(m1, s1, x, y)
        m2, s2, _ = plain(m2, s2, x, y)
    assert set(vars(s1)) == {PENDING}  # nothing built yet
    read = pickle.loads(pickle.dumps(s1))  # pickle reads the fields: built now
    assert ft.optim.context(read).step == 3 and set(vars(s1)) == {"context", "inner"}
    assert int(ft.optim.context(s1).step) == int(ft.optim.context(s2).step) == 3
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_results_passed_back_are_not_flattened_again():
    class Weights(ft.Module):
        w: jax.Array

    step = flat_jit(lambda m, x: (Weights(m.w + x), jnp.sum(m.w)), donate=(0,))
    model, _ = step(Weights(jnp.zeros(2)), 1.0)  # fresh: flattened
    model, _ = step(model, 1.0)  # finds that the model is the previous result
    assert step._last[0].loop == (0,)  # from now on: argument 0 is result 0, by its leaves
    model, total = step(model, 1.0)
    np.testing.assert_array_equal(model.w, jnp.full(2, 3.0))
    assert float(total) == 4.0


def test_donated_results_apart_and_out_of_order_are_gathered_in_argument_order():
    # Arguments 0 and 2 are donated; the loop passes result 2 back as argument 0 and
    # result 0 as argument 2 (a metric between): their leaves are taken in argument order.
    class Weights(ft.Module):
        w: jax.Array
        b: jax.Array

    def f(a, x, c):
        return Weights(c.w * x, c.b + 1.0), jnp.sum(a.w), Weights(a.w + x, a.b - 1.0)

    flat, plain = flat_jit(f, donate=(0, 2)), jax.jit(f)
    a1, c1 = Weights(jnp.arange(3.0), jnp.zeros(())), Weights(jnp.ones(3), jnp.full((), 5.0))
    a2, c2 = Weights(jnp.arange(3.0), jnp.zeros(())), Weights(jnp.ones(3), jnp.full((), 5.0))
    for _ in range(4):
        c1, t1, a1 = flat(a1, 2.0, c1)  # result 0 is passed back as argument 2, result 2 as 0
        c2, t2, a2 = plain(a2, 2.0, c2)
        np.testing.assert_array_equal(t1, t2)
    assert flat._last[0].loop == (2, 0)  # on the fast path
    for x, y in zip(jax.tree.leaves((a1, c1)), jax.tree.leaves((a2, c2))):
        np.testing.assert_array_equal(x, y)


def test_another_structure_of_the_other_arguments_in_a_loop_runs_in_the_same_program(monkeypatch):
    # The loop passes the arguments not donated to JAX as they are (flattened in C++): a
    # batch that turns from a tuple into a dict mid-loop, and back, is traced once per
    # structure in the loop's program (same results' tree definition) and kept in JAX's
    # cache: alternating kinds of batch costs no failed trace per switch.
    from functree import _flat

    failed = []

    class Counted(_flat._Restructured):
        def __init__(self, *args):
            failed.append(1)
            super().__init__(*args)

    monkeypatch.setattr(_flat, "_Restructured", Counted)

    class Weights(ft.Module):
        w: jax.Array

    def f(m, batch):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        return Weights(m.w + x * y), jnp.sum(m.w)

    traces = []

    def counted(m, batch):
        traces.append(jax.tree.structure(batch))
        return f(m, batch)

    flat, plain = flat_jit(counted, donate=(0,)), jax.jit(f)
    m1, m2 = Weights(jnp.zeros(2)), Weights(jnp.zeros(2))
    x, y = jnp.ones(2), jnp.full(2, 3.0)
    batches = [(x, y), (x, y), (x, y), {"x": x, "y": y}, (x, y), {"x": x, "y": y}, (x, y), [x, y], (x, y), [x, y]]
    for batch in batches:
        m1, t1 = flat(m1, batch)
        m2, t2 = plain(m2, batch)
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(m1.w, m2.w)
    assert len(traces) == 3  # tuple, dict, list: one trace each, however often they alternate
    assert failed == []
    assert len(flat._programs) == 1


def test_another_structure_whose_results_differ_takes_its_own_program():
    # The results' tree follows the batch's: the loop's program cannot build them, so the
    # call goes the full way and another program runs it (the numbers are jax.jit's).
    def f(w, batch):
        return w + 1.0, jax.tree.map(lambda b: b * w[0], batch)

    flat, plain = flat_jit(f, donate=(0,)), jax.jit(f)
    w1, w2 = jnp.zeros(2), jnp.zeros(2)
    for batch in [(jnp.ones(2),), (jnp.ones(2),), {"x": jnp.ones(2)}, (jnp.ones(2),), {"x": jnp.ones(2)}]:
        w1, out1 = flat(w1, batch)
        w2, out2 = plain(w2, batch)
        assert jax.tree.structure(out1) == jax.tree.structure(out2)
        np.testing.assert_array_equal(w1, w2)
        for a, b in zip(jax.tree.leaves(out1), jax.tree.leaves(out2)):
            np.testing.assert_array_equal(a, b)
    assert len(flat._programs) == 2


def test_an_argument_not_donated_is_named_by_its_parameter_in_trace_errors():
    def scale(model, batch):
        return model * (2.0 if batch[1] > 0 else 3.0)

    step = ft.jit(scale, donate=0)
    with pytest.raises(ft.ControlFlowError, match=r"argument batch\.1\b") as info:
        step(jnp.ones(2), (jnp.ones(()), jnp.ones(())))
    assert "others[" not in str(info.value) and "function flat" not in str(info.value)


def test_a_new_tree_in_a_loops_place_is_flattened_alone_and_keeps_the_fast_path(monkeypatch):
    # The Trainer passes a new log buffer every log_every steps (the model and state are
    # the previous results): that argument alone is flattened; another structure there
    # takes the full path (and compiles for it).
    class Weights(ft.Module):
        w: jax.Array

    def f(m, log, x):
        return Weights(m.w + x), {"n": log["n"] + 1}, jnp.sum(m.w)

    step = flat_jit(f, donate=(0, 1), owned=(1,))  # the log dict is the caller's own
    model, log, _ = step(Weights(jnp.zeros(2)), {"n": jnp.zeros((), jnp.int32)}, 1.0)
    model, log, _ = step(model, log, 1.0)
    assert step._last[0].loop == (0, 1)
    full = []
    original = step._program
    monkeypatch.setattr(step, "_program", lambda args: full.append(1) or original(args))
    model, log, total = step(model, {"n": jnp.full((), 10, jnp.int32)}, 1.0)  # a new buffer
    assert full == [] and int(log["n"]) == 11 and float(total) == 4.0
    np.testing.assert_array_equal(model.w, jnp.full(2, 3.0))
    model, log, total = step(model, log, 1.0)
    assert full == [] and int(log["n"]) == 12
    model, log, total = step(model, {"n": jnp.zeros((), jnp.int32), "m": jnp.ones(())}, 1.0)  # another structure
    assert full == [1] and int(log["n"]) == 1 and float(total) == 8.0


def test_a_dict_passed_back_is_flattened_again_it_may_have_changed_in_place():
    step = flat_jit(lambda p, x: ({"w": p["w"] + x}, p["w"].sum()), donate=(0,))
    params, _ = step({"w": jnp.zeros(2)}, 1.0)
    params, _ = step(params, 1.0)
    params["w"] = jnp.full(2, 10.0)  # changed in place: must be seen
    params, total = step(params, 1.0)
    assert float(total) == 20.0
    np.testing.assert_array_equal(params["w"], jnp.full(2, 11.0))


@pytest.mark.parametrize("tree_when_mutable", [False, True])
def test_a_donated_dict_loop_equals_jax_jit_and_sees_in_place_changes(tree_when_mutable):
    # tree_when_mutable (ft.jit's path): a dict can never be passed back by its leaves, so
    # the calls run jax.jit of the function itself (no flat program compiled at all).
    def fn(p, x):
        return {"w": p["w"] * 0.5 + x, "b": p["b"] - x}, p["w"].sum() + p["b"].sum()

    step = flat_jit(fn, donate=(0,), tree_when_mutable=tree_when_mutable)
    reference = jax.jit(fn)
    params = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    expected = {k: jnp.array(v) for k, v in params.items()}
    for i in range(5):
        if i == 4:  # changed in place between calls: must be seen
            params["w"], expected["w"] = jnp.full(3, 10.0), jnp.full(3, 10.0)
        params, total = step(params, 1.0)
        expected, expected_total = reference(expected, 1.0)
        for k in params:
            np.testing.assert_array_equal(params[k], expected[k])
        assert float(total) == float(expected_total)
        if i == 1:
            compiled = step._cache_size()
        if i == 3:
            assert step._cache_size() == compiled  # the loop compiles nothing after its second call
    flat_compiled = sum(p.jitted._cache_size() for p in step._programs.values())
    assert (flat_compiled == 0) == tree_when_mutable


def test_tree_when_mutable_keeps_the_flat_loop_for_modules():
    class Weights(ft.Module):
        w: jax.Array

    step = flat_jit(lambda m, x: (Weights(m.w + x), jnp.sum(m.w)), donate=(0,), tree_when_mutable=True)
    model, _ = step(Weights(jnp.zeros(2)), 1.0)
    model, _ = step(model, 1.0)
    assert step._last[0].loop == (0,)  # a frozen Module: passed back by its leaves


def test_keyword_calls_and_lower_work():
    step = flat_jit(lambda w, x: (w * x, jnp.sum(w)), donate=(0,))
    w, _ = step(w=jnp.ones(2), x=2.0)
    np.testing.assert_array_equal(w, jnp.full(2, 2.0))
    compiled = step.lower(jnp.ones(2), 2.0).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == 8  # the donated leaf, in place
    w, _ = compiled(jnp.ones(2), 2.0)  # compiled for the arguments as they are
    np.testing.assert_array_equal(w, jnp.full(2, 2.0))


def test_a_result_tree_that_changes_with_shapes_is_an_error():
    step = flat_jit(lambda x: (x,) if x.shape[0] == 1 else [x])
    step(jnp.ones(1))
    with pytest.raises(TypeError) as info:
        step(jnp.ones(2))
    assert str(info.value).startswith(CHANGED_OUTPUT.split("\n")[0][:40])
    assert "jit one function per structure" in str(info.value)


def test_ft_jit_with_donation_runs_over_flat_leaves():
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    step = ft.jit(lambda m, s, x, y: opt.minimize(lambda m, x, y: jnp.mean((m(x) - y) ** 2), m, s, x, y),
                  donate=(0, 1))
    model = _model()
    state = opt.init(model)
    leaves = jax.tree.leaves((model, state))
    for _ in range(3):
        model, state, loss = step(model, state, jnp.ones((2, 3)), jnp.zeros((2, 1)))
    assert all(x.is_deleted() for x in leaves)
    assert isinstance(model, ft.nn.Sequential) and bool(jnp.isfinite(loss))


class _Box:
    def __init__(self, x, meta):
        self.x, self.meta = x, meta


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.x,), b.meta), lambda meta, kids: _Box(kids[0], meta))


def test_a_tree_definition_that_cannot_be_hashed_runs_through_jax_jit():
    step = flat_jit(lambda b: _Box(b.x + 1, b.meta), donate=(0,))
    box = step(_Box(jnp.ones(2), [1]))  # a list as auxiliary data: unhashable
    box = step(box)
    np.testing.assert_array_equal(box.x, jnp.full(2, 3.0))
    assert box.meta == [1]


def test_a_donating_ft_jit_on_a_method_is_called_with_its_instance():
    # ft.jit's donating object is a method as a function is (a Module's step method).
    class Weights(ft.Module):
        w: jax.Array

        @ft.jit(donate=(0,))
        def step(self, x):
            return Weights(self.w + x), jnp.sum(self.w)

    model = Weights(jnp.ones(2))
    for _ in range(3):
        model, total = model.step(1.0)
    np.testing.assert_array_equal(model.w, jnp.full(2, 4.0))
    assert float(total) == 6.0
    assert Weights.step.__name__ == "step" and list(inspect.signature(Weights.step).parameters) == ["self", "x"]


def _records_the_collector(seen):
    def f(w, x):
        seen.append(gc.isenabled())  # runs while JAX traces
        if x.ndim == 2:
            raise ValueError("a trace that fails")
        return jax.tree.map(lambda v: v + x, w)

    return f


@pytest.mark.parametrize("tree_when_mutable", [False, True])
def test_the_collector_is_off_while_a_first_call_traces_and_on_again_after(tree_when_mutable):
    # Tracing allocates objects that live on in the jaxpr: the cyclic collector would walk
    # the heap again and again (see _CollectorPaused). A dict donated with tree_when_mutable
    # takes jax.jit of the function itself: off there too.
    assert gc.isenabled()
    seen = []
    step = flat_jit(_records_the_collector(seen), donate=(0,), tree_when_mutable=tree_when_mutable)
    w = {"a": jnp.ones(2)} if tree_when_mutable else jnp.ones(2)
    w = step(w, jnp.ones(2))
    for _ in range(2):  # the loop's fast path traces nothing more
        w = step(w, jnp.ones(2))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ValueError, match="a trace that fails"):  # new arguments: off the fast path
        step({"a": jnp.ones(2)} if tree_when_mutable else jnp.ones(2), jnp.ones((1, 2)))
    assert seen == [False, False] and gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    seen = []
    step = flat_jit(_records_the_collector(seen), donate=(0,))
    gc.disable()
    try:
        step(jnp.ones(2), jnp.ones(2))
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False]


def _collections_inside(step, w, calls):
    """``(w, generations)``: two loop calls of ``step`` (compiled, the fast path set), then
    ``calls`` more and the collections of the cyclic collector that started inside them (its
    first generation collecting after 100 net allocations of tracked objects, so that any call
    allocating more collects). The caller's ``w`` is the first input (held throughout)."""
    for _ in range(2):
        w, _ = step(w, 1.0)
    inside, calling = [], [False]

    def record(phase, info):
        if phase == "start" and calling[0]:
            inside.append(info["generation"])

    threshold = gc.get_threshold()
    gc.collect()  # (its count of allocations from zero: a few a call stay, until the next collection)
    gc.callbacks.append(record)
    gc.set_threshold(100, *threshold[1:])
    try:
        for _ in range(calls):
            calling[0] = True
            w, _ = step(w, 1.0)
            calling[0] = False
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(record)
    return w, inside


def _shifted(t, x):
    return tuple(a + x for a in t), x  # the first result passed back, donated


def test_a_loop_call_with_many_results_runs_no_collection_inside():
    # Each node of the results is a tracked allocation (an array JAX returns, an object the
    # builder makes): results of hundreds of nodes made the collector run inside every loop
    # call, promoting the live model and state (then walking the whole heap now and then).
    step = ft.jit(_shifted, donate=(0,))  # (its guard frees the inputs of two calls ago inside the call)
    w, inside = _collections_inside(step, tuple(jnp.full((), float(i)) for i in range(PAUSE_NODES)), calls=3)
    assert step._last[0].loop == (0,) and step._last[0].pause
    assert inside == [] and gc.isenabled()
    np.testing.assert_array_equal(np.stack(w), np.arange(PAUSE_NODES) + 5.0)


def test_a_loop_call_with_few_results_leaves_the_collector_alone():
    step = ft.jit(_shifted, donate=(0,))
    w, _ = _collections_inside(step, (jnp.zeros(()), jnp.ones(())), calls=2)
    assert step._last[0].loop == (0,) and not step._last[0].pause  # (the fast path as before)
    np.testing.assert_array_equal(np.stack(w), [4.0, 5.0])


def test_the_collector_is_on_again_after_a_paused_call_fails_and_stays_off_if_the_caller_turned_it_off():
    step = ft.jit(_shifted, donate=(0,))
    w = tuple(jnp.full((), float(i)) for i in range(PAUSE_NODES))
    for _ in range(2):
        w, _ = step(w, 1.0)
    gc.disable()
    try:
        w, _ = step(w, 1.0)
        assert not gc.isenabled()
    finally:
        gc.enable()
    w[0].delete()  # the fast path's program call fails
    with pytest.raises(ValueError, match=r"deleted array at t\.0"):
        step(w, 1.0)
    assert gc.isenabled()
