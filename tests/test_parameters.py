"""The parameter view: ft.parameters, with_parameters, update, tree_map, select/mask."""

from __future__ import annotations

import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hypothesis import examples
from _tolerance import needs_float16_conversions
from hypothesis import given, settings
from test_paths import assert_same_tree, nested_trees

import functree as ft


class BatchNorm(ft.Module):
    scale: jax.Array
    offset: jax.Array
    running_mean: jax.Array = ft.field(no_derivative=True)
    momentum: float = ft.field(static=True, default=0.9)


class Encoder(ft.Module):
    weight: jax.Array
    bias: jax.Array
    norm: BatchNorm


class Model(ft.Module):
    encoder: Encoder
    head: dict
    step: jax.Array
    flag: jax.Array


def make_model() -> Model:
    return Model(
        encoder=Encoder(jnp.ones((2, 3)), jnp.zeros(3), BatchNorm(jnp.ones(3), jnp.zeros(3), jnp.zeros(3))),
        head={"weight": jnp.ones((3, 1)), "bias": jnp.zeros(1)},
        step=jnp.zeros((), jnp.int32),
        flag=jnp.array(True),
    )


def test_parameters_puts_none_at_non_parameters_and_keeps_static():
    model = make_model()
    params = ft.parameters(model)
    assert isinstance(params, Model)
    assert params.step is None and params.flag is None
    assert params.encoder.norm.running_mean is None
    assert params.encoder.norm.momentum == 0.9
    assert params.encoder.weight is model.encoder.weight
    assert sorted(ft.to_flat_dict(params)) == [
        "encoder.bias", "encoder.norm.offset", "encoder.norm.scale", "encoder.weight",
        "head.bias", "head.weight",
    ]


def test_parameters_of_python_scalars():
    # Python numbers in a tree are static data (Equinox's Dropout.p, MaxPool2d.init=-inf);
    # a bare float point is differentiated (ft.gradient(f, at=1.5)).
    params = ft.parameters({"w": 1.5, "n": 3, "b": True})
    assert params == {"w": None, "n": None, "b": None}
    assert ft.parameters(1.5) == 1.5 and ft.parameters(1 + 1j) == 1 + 1j  # a bare point

    class Scaled(ft.Module):  # a float that is an ft.Module field's own value is declared: trained
        scale: float
        config: dict

    with pytest.warns(ft.NonDifferentiableFieldWarning, match=r"Scaled.config is a parameter field whose dict holds"):
        scaled = Scaled(0.5, {"p": 0.1})  # a float in the field's dict: static, and said so
    view = ft.parameters(scaled)
    assert view.scale == 0.5 and view.config == {"p": None}


def test_with_parameters_writes_back_and_none_keeps_the_model_leaf():
    model = make_model()
    params = jax.tree.map(lambda x: x + 1, ft.parameters(model))
    new = ft.with_parameters(model, params)
    np.testing.assert_array_equal(new.encoder.weight, np.full((2, 3), 2.0))
    assert new.step is model.step and new.encoder.norm.running_mean is model.encoder.norm.running_mean


def test_with_parameters_structure_mismatch_names_the_path():
    model = make_model()
    params = ft.parameters(model)
    wrong = params.replace(head={"weight": params.head["weight"]})
    with pytest.raises(ValueError) as info:
        ft.with_parameters(model, wrong)
    message = str(info.value)
    assert "ft.with_parameters" in message and ".head" in message
    assert "ft.parameters(model)" in message


def test_with_parameters_refuses_another_shape_by_key_path():
    model = make_model()
    params = ft.parameters(model)
    torch_like = params.replace(encoder=params.encoder.replace(weight=params.encoder.weight.T))
    with pytest.raises(ValueError) as info:
        ft.with_parameters(model, torch_like)
    message = str(info.value)
    assert "the value at .encoder.weight has shape (3, 2)" in message and "has shape (2, 3)" in message
    assert "transpose it" in message  # a (out, in) torch weight, named as such
    # A (1, 3) row where the model holds (3,) used to be written as is (later broadcast).
    flat = ft.with_parameters({"b": jnp.zeros(3)}, {"b": None})
    with pytest.raises(ValueError, match=r"the value at \['b'\] has shape \(1, 3\).*shape \(3,\)") as info:
        ft.with_parameters(flat, {"b": jnp.ones((1, 3))})
    assert "transpose" not in str(info.value)
    # Another dtype of the same shape is a cast, and stays allowed.
    assert ft.with_parameters(flat, {"b": jnp.ones(3, jnp.bfloat16)})["b"].dtype == jnp.bfloat16


def test_update_applies_the_updater_at_every_parameter():
    params = ft.parameters(make_model())
    grads = jax.tree.map(jnp.ones_like, params)
    new = ft.update(params, with_gradients=grads, updater=lambda p, g: p - 0.5 * g)
    np.testing.assert_array_equal(new.encoder.weight, np.full((2, 3), 0.5))
    assert new.step is None


def test_tree_map_skips_none_and_maps_several_trees():
    params = ft.parameters(make_model())
    seen = []
    ft.tree_map(lambda p: seen.append(p.shape), params)
    assert len(seen) == 6
    total = ft.tree_map(lambda a, b, c: a + b + c, params, params, params)
    np.testing.assert_array_equal(total.encoder.norm.scale, np.full(3, 3.0))


def test_tree_map_structure_mismatch_names_the_first_differing_key_path():
    a = {"layers": [{"w": jnp.ones(1)}, {"w": jnp.ones(1)}]}
    b = {"layers": [{"w": jnp.ones(1)}, {"u": jnp.ones(1)}]}
    with pytest.raises(ValueError) as info:
        ft.tree_map(jnp.add, a, b)
    message = str(info.value)
    assert "ft.tree_map: the trees differ first at ['layers'][1]" in message
    assert "ft.gradient(loss, at=model)" in message
    c = {"layers": [{"w": jnp.ones(1)}]}
    with pytest.raises(ValueError, match=r"differ first at \['layers'\]: the first has list"):
        ft.tree_map(jnp.add, a, c)


def test_tree_map_mismatch_between_modules_with_different_static_values():
    a = BatchNorm(jnp.ones(1), jnp.ones(1), jnp.ones(1), momentum=0.9)
    b = BatchNorm(jnp.ones(1), jnp.ones(1), jnp.ones(1), momentum=0.5)
    with pytest.raises(ValueError, match="differ first at <root>"):
        ft.tree_map(jnp.add, {"m": a}["m"], b)


_NET_CELL = """
class CellNet(ft.Module):
    w: jax.Array
    def __call__(self, x):
        return x @ self.w
"""


def test_trees_of_a_class_defined_again_are_named_as_two_definitions(monkeypatch):
    """A notebook: gradients of a model made before the cell with ``class Net`` ran again, passed
    with a model of the new class. The structures differ only in the class object, which the
    first-difference walk compared by short name: 'different structures' (opt.update) or JAX's
    'different types ... Net ... Net' (ft.move, ft.tree_map). Now it names both definitions."""
    # (CellNet, not Net: the classes this test leaves in a "__main__" made a later doctest's
    # __main__.Net ambiguous to a checkpoint load without a template, in the same process)
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    ns = main.__dict__
    for cell in ("import jax, jax.numpy as jnp, functree as ft", _NET_CELL,
                 "old = CellNet(jnp.ones((2, 2)))\ngrads = ft.gradient(lambda m: m(jnp.ones((1, 2))).sum(), at=old)",
                 _NET_CELL, "model = CellNet(jnp.ones((2, 2)))"):
        exec(compile(cell, "<cell>", "exec"), ns)
    model, grads = ns["model"], ns["grads"]
    again = ("the first has a __main__.CellNet of {}, the other a __main__.CellNet of {}: "
             "the `class CellNet` statement ran again")
    now, earlier = "the class defined now", "an earlier definition of it"
    with pytest.raises(ValueError) as e:
        ft.move(model, along=grads)
    assert again.format(earlier, now) in str(e.value) and "ft.move: the trees differ first at <root>" in str(e.value)
    with pytest.raises(ValueError, match=r"ft\.tree_map: the trees differ first at <root>") as e:
        ft.tree_map(jnp.add, model, grads)
    assert again.format(now, earlier) in str(e.value)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="The gradient does not fit the model's parameters at <root>") as e:
        opt.apply_gradients(grads, model, opt.init(model))
    assert again.format(now, earlier) in str(e.value)
    # the carry-over the message gives
    carried = jax.tree.unflatten(jax.tree.structure(ft.parameters(model)), jax.tree.leaves(grads))
    np.testing.assert_allclose(ft.move(model, along=carried).w, model.w + grads.w, rtol=0, atol=0)


def test_two_classes_of_one_short_name_are_named_by_their_modules():
    a, b = (type("Net", (ft.Module,), {"__annotations__": {"w": jax.Array}, "__module__": m}) for m in ("one", "two"))
    with pytest.raises(ValueError, match=r"the first has a one\.Net, the other a two\.Net"):
        ft.tree_map(jnp.add, a(jnp.ones(1)), b(jnp.ones(1)))


@needs_float16_conversions  # float16 leaves: XLA:CPU below AVX cannot link their conversions
def test_heterogeneous_dtypes_in_one_update_call():
    params = {
        "f32": jnp.ones(2, jnp.float32),
        "bf16": jnp.ones(2, jnp.bfloat16),
        "f16": jnp.ones(2, jnp.float16),
    }
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    new = ft.update(params, with_gradients=grads, updater=lambda p, g: p - 0.5 * g)
    for name, leaf in new.items():
        assert leaf.dtype == params[name].dtype
        np.testing.assert_allclose(np.asarray(leaf, np.float32), 0.75)


def test_float64_with_float32_under_x64():
    with jax.enable_x64(True):
        params = {"w": jnp.ones(2, jnp.float32), "d": jnp.ones(2, jnp.float64)}
        grads = ft.gradient(lambda p: p["w"].sum().astype(jnp.float64) + (p["d"] ** 2).sum(), at=params)
        assert grads["d"].dtype == jnp.float64
        new = ft.update(params, with_gradients=grads, updater=lambda p, g: p - 0.25 * g)
        assert new["d"].dtype == jnp.float64 and new["w"].dtype == jnp.float32
        np.testing.assert_allclose(new["d"], [0.5, 0.5])
        np.testing.assert_allclose(new["w"], [0.75, 0.75])


def test_select_and_mask_by_glob_over_dotted_names():
    model = make_model()
    chosen = ft.select(model, "encoder.*")
    assert isinstance(chosen, Model)
    assert chosen.encoder.weight is True and chosen.encoder.norm.scale is True
    assert chosen.head == {"weight": False, "bias": False}
    assert chosen.step is None and chosen.encoder.norm.running_mean is None
    biases = ft.mask(model, "*.bias")
    assert biases.encoder.bias is True and biases.head["bias"] is True
    assert biases.encoder.weight is False and biases.encoder.norm.offset is False
    # A node selects everything under it; exclude wins.
    assert ft.select(model, "encoder", exclude=["encoder.norm"]).encoder.norm.scale is False
    assert ft.select(model, "encoder", exclude=["encoder.norm"]).encoder.weight is True


def test_mask_drives_optax_weight_decay():
    model = make_model()
    params = ft.parameters(model)
    decay = optax.add_decayed_weights(0.1, mask=ft.mask(model, "*.weight"))
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = decay.update(grads, decay.init(params), params)
    np.testing.assert_allclose(updates.encoder.weight, np.full((2, 3), 0.1))
    np.testing.assert_allclose(updates.encoder.bias, np.zeros(3))


def test_select_errors():
    with pytest.raises(ValueError, match="at least one pattern"):
        ft.select(make_model())
    with pytest.raises(TypeError, match="Patterns are strings like"):
        ft.select(make_model(), 3)


def test_an_exclude_pattern_matching_no_name_is_an_error_naming_the_closest():
    """select/mask ignored an exclude typo ("encoder.wieght"), selecting what it meant to spare."""
    model = make_model()
    for fn in (ft.select, ft.mask):
        with pytest.raises(ValueError, match=r"ft\.select: the exclude pattern 'encoder\.wieght' matches no name in "
                                             r"the tree.*Closest names: 'encoder\.weight'.*\n.*\n.*right:  ft\.select"
                                             r"\(model, \.\.\., exclude=\['encoder\.weight'\]\)"):
            fn(model, "*", exclude=["encoder.wieght"])
    # A non-parameter's name is no typo: it may be excluded where it is not selected anyway.
    assert ft.select(model, "encoder.*", exclude=["step"]).encoder.weight is True


@needs_float16_conversions  # float16 leaves: XLA:CPU below AVX cannot link their conversions
@settings(max_examples=examples(30), deadline=None)
@given(nested_trees())
def test_parameters_and_with_parameters_round_trip_on_random_trees(tree: Any):
    params = ft.parameters(tree)
    for leaf in jax.tree.leaves(params):
        assert ft._parameters.is_parameter_leaf(leaf) or isinstance(leaf, float)  # an ft.Module field's own float
    assert_same_tree(ft.with_parameters(tree, params), tree)
    # Every parameter leaf of a no_derivative field is None in the view.
    for kp in ft.recursively_all_writable_key_paths(tree, to=ft._parameters.Module):
        node = kp.get(tree)
        if hasattr(node, "state") and node.state is not None:
            assert jax.tree.leaves(kp.get(params).state) == []
    doubled = ft.tree_map(lambda p: p * 2, params)
    back = ft.with_parameters(tree, doubled)
    for before, after in zip(jax.tree.leaves(params), jax.tree.leaves(ft.parameters(back))):
        np.testing.assert_allclose(np.asarray(after, np.float32), np.asarray(before, np.float32) * 2, rtol=1e-2)


def test_update_leaves_parameters_without_a_gradient_unchanged():
    model = make_model()
    grads = ft.gradient(lambda m: (m.encoder.weight**2).sum() + m.head["bias"].sum(), wrt="encoder.weight")(model)
    assert grads.head["bias"] is None
    new = ft.update(ft.parameters(model), with_gradients=grads, updater=lambda p, g: p - 0.25 * g)
    np.testing.assert_allclose(new.encoder.weight, np.full((2, 3), 0.5))
    assert new.head["bias"] is model.head["bias"]
    with pytest.raises(ValueError, match=r"ft.update: the trees differ first at \.head"):
        ft.update(ft.parameters(model), with_gradients=grads.replace(head=[1.0]), updater=jnp.subtract)


def test_caches_keyed_by_tree_definition_are_bounded():
    from functree import _diagnostics, _parameters, _plan, _tree

    cache: dict[int, int] = {}
    for i in range(_tree.CACHE_LIMIT + 10):
        _tree.bounded_put(cache, i, i)
    assert len(cache) <= _tree.CACHE_LIMIT
    assert cache[_tree.CACHE_LIMIT + 9] == _tree.CACHE_LIMIT + 9
    # one policy: every tree-definition cache is filled through _tree.bounded_put
    assert _parameters.bounded_put is _tree.bounded_put is _plan.bounded_put
    assert _diagnostics.bounded_put is _tree.bounded_put
    # one is_none and one dotted-name function: no module keeps a copy
    assert not hasattr(_parameters, "_is_none") and not hasattr(_parameters, "_jax_path_name")


def test_dotted_names_come_from_one_function():
    from functree._naming import names as _leaf_names

    model = {"layers": [{"w": jnp.ones(2)}, {"w": jnp.ones(2)}], "n": (jnp.zeros(()),)}
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    assert _leaf_names(model) == [jax.tree_util.keystr(p, simple=True, separator=".") for p in paths]
    assert _leaf_names(model) == ["layers.0.w", "layers.1.w", "n.0"]
