"""Display: a model's short repr, its HTML form, and ft.summary tables."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import functree as ft


class Dense(ft.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable[[jax.Array], jax.Array] = ft.field(static=True, default=jax.nn.relu)


class BatchNorm(ft.Module):
    scale: jax.Array
    running_mean: jax.Array = ft.field(no_derivative=True)
    step: jax.Array = ft.field(default_factory=lambda: jnp.zeros((), jnp.int32))


class Net(ft.Module):
    layers: list
    norm: BatchNorm
    table: dict
    scale: float
    bias: jax.Array | None = None


def make_net() -> Net:
    return Net(
        layers=[Dense(jnp.ones((2, 4)), jnp.zeros(4)), Dense(jnp.ones((4, 1), jnp.bfloat16), jnp.zeros(1))],
        norm=BatchNorm(jnp.ones(4), jnp.zeros(4)),
        table={"emb": jnp.ones((3, 2), jnp.float16)},
        scale=0.5,
    )


def test_dense_repr_is_short():
    assert repr(Dense(jnp.ones((2, 4)), jnp.zeros(4))) == "Dense(weight=f32[2,4], bias=f32[4], activation=relu)"


def test_repr_of_scalars_containers_none_and_dtypes():
    bn = BatchNorm(jnp.ones(4), jnp.zeros(4))
    assert repr(bn) == "BatchNorm(scale=f32[4], running_mean=f32[4], step=i32[])"
    r = repr(make_net())
    assert r.startswith("Net(\n  layers=[\n    Dense(")
    assert "bf16[4,1]" in r and "{'emb': f16[3,2]}" in r and "scale=0.5" in r and "bias=None" in r
    assert repr(ft.parameters(bn)) == "BatchNorm(scale=f32[4], running_mean=None, step=None)"
    assert repr(Dense((jnp.ones(1),), jnp.ones(1))) == "Dense(weight=(f32[1],), bias=f32[1], activation=relu)"


def test_repr_of_a_model_inside_jit_shows_tracers_shortly():
    seen = []
    jax.jit(lambda m: seen.append(repr(m)) or m.weight)(Dense(jnp.ones((2, 4)), jnp.zeros(4)))
    assert seen == ["Dense(weight=f32[2,4], bias=f32[4], activation=relu)"]


def test_a_model_and_optimizer_state_a_step_donated_print_their_arrays_as_deleted():
    # print(state) after `model, state, out = step(model, state, batch)` kept the old state:
    # JAX's "Array has been deleted" came from deep inside the repr (the learning context's,
    # then each optax state's arrays); the model printed as if its arrays were there
    model = ft.nn.Dense(2, 3, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    state = opt.init(model)
    step = ft.train.train_step(lambda m, b: jnp.mean(m(b) ** 2), opt)
    new_model, new_state, _ = step(model, state, jnp.ones((4, 2)))
    assert model.weight.is_deleted() and ft.optim.context(new_state).step == 1
    shown = "Dense(weight=<deleted f32[2,3]>, bias=<deleted f32[3]>, activation=identity)"
    assert repr(model) == str(model) == shown and model._repr_html_() == f"<pre>{html.escape(shown)}</pre>"
    text = repr(state)
    assert text.startswith("OptimizerState(context=LearningContext(counters=<deleted i32[5]>, loss=<deleted f32[]>), "
                           "inner=HyperState(context=None, values=<deleted f32[4]>")
    assert f"ScaleByAdamState(count=<deleted i32[]>, mu={shown}, nu={shown})" in text and str(state) == text
    pretty = pytest.importorskip("IPython.lib.pretty")
    assert pretty.pretty(state) == text and pretty.pretty(model) == shown
    # the live ones as before: values, shapes
    assert repr(new_state).startswith("OptimizerState(context=LearningContext(step=1, sweep=0, samples_seen=4, "
                                      "minibatch_size=4, loss=")
    assert "count=Array(1, dtype=int32)" in repr(new_state) and "<deleted" not in repr(new_state)
    assert repr(new_model) == "Dense(weight=f32[2,3], bias=f32[3], activation=identity)"


def test_a_tree_that_cannot_hold_the_deleted_stand_ins_names_how_many_were_deleted():
    from functree._repr import shown_repr

    @jax.tree_util.register_pytree_node_class
    class Checked:
        def __init__(self, a, b):
            if not isinstance(a, jax.Array):
                raise TypeError("arrays only")
            self.a, self.b = a, b

        def tree_flatten(self):
            return (self.a, self.b), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    a = jnp.ones(2)
    a.delete()
    assert shown_repr(Checked(a, jnp.zeros(1))) == "<Checked: 1 of its 2 arrays deleted>"
    assert shown_repr([a, 1]) == "[<deleted f32[2]>, 1]"


def test_module_html_and_pretty_forms():
    d = Dense(jnp.ones((2, 4)), jnp.zeros(4))
    assert d._repr_html_() == "<pre>Dense(weight=f32[2,4], bias=f32[4], activation=relu)</pre>"

    class Printer:
        def __init__(self) -> None:
            self.text_: list[str] = []

        def text(self, s: str) -> None:
            self.text_.append(s)

    p = Printer()
    d._repr_pretty_(p, cycle=False)
    assert p.text_ == [repr(d)]


def test_summary_table_and_totals():
    s = ft.summary(make_net())
    text = str(s)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "count", "bytes", "kind"]
    rows = {line.split()[0]: line for line in lines[2:-2]}
    assert set(rows) == {
        "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
        "norm.scale", "norm.running_mean", "norm.step", "table.emb", "scale",
    }
    assert rows["layers.1.weight"].split()[3] == "bfloat16"
    assert rows["norm.running_mean"].endswith("carried") and rows["norm.step"].endswith("carried")
    assert rows["layers.0.weight"].endswith("parameter")
    # 8 + 4 + 4 + 1 + 4 + 6 + 1 parameters; 8*4 + 4*4 + 4*2 + 1*4 + 4*4 + 6*2 + 4 bytes.
    assert s.parameter_count == 28
    assert s.parameter_bytes == 32 + 16 + 8 + 4 + 16 + 12 + 4  # the Python float is float32
    assert lines[-1] == "Net: 28 parameters (92 B), 5 carried values"
    assert repr(s) == text


def test_summary_html_table():
    html = ft.summary(make_net())._repr_html_()
    assert html.startswith("<table><thead><tr><th>path</th>")
    assert "<td>layers.0.weight</td>" in html and "<td>carried</td>" in html
    assert html.endswith("<p>Net: 28 parameters (92 B), 5 carried values</p>")


def test_summary_units_for_large_models():
    s = ft.summary({"w": jnp.zeros((1024, 1024))})
    assert str(s).splitlines()[-1] == "dict: 1,048,576 parameters (4.0 MiB)"


def test_summary_leaves_out_function_leaves():
    table = ft.summary({"w": jnp.ones((2, 3)), "fn": jax.nn.relu})
    assert [r.path for r in table.rows] == ["w"] and table.parameter_count == 6
    assert "fn" not in str(table)


def test_a_foreign_multiline_repr_is_indented_under_its_field():
    class Foreign:
        def __repr__(self):
            return "Foreign(\n  a=1,\n)"

    class Holder(ft.Module):
        inner: Any = ft.field(static=True)
        weight: jax.Array

    text = repr(Holder(Foreign(), jnp.ones(2)))
    assert text.splitlines() == ["Holder(", "  inner=Foreign(", "    a=1,", "  ),", "  weight=f32[2],", ")"]


def test_summary_grouped_by_depth():
    model = ft.nn.Sequential([ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.BatchNorm(3),
                              ft.nn.Dense(3, 1, key=jax.random.key(1))])
    full = ft.summary(model)
    grouped = ft.summary(model, depth=2)
    assert [(r.path, r.parameter, r.leaves, r.count) for r in grouped.rows] == [
        ("layers.0", True, 2, 9), ("layers.1", True, 2, 6), ("layers.1", False, 2, 6), ("layers.2", True, 2, 4)]
    assert grouped.parameter_count == full.parameter_count == 19
    assert "2 leaves" in str(grouped)
    assert [r.path for r in ft.summary(model, depth=1).rows] == ["layers", "layers"]
    with pytest.raises(ValueError, match=r"k must be a positive int, got 0"):
        ft.summary(model, depth=0)
