"""Flat state dicts: ft.to_flat_dict and ft.from_flat_dict, checked by key path."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import given, settings
from test_paths import assert_same_tree, nested_trees

import functree as ft


class Dense(ft.Module):
    weight: jax.Array
    bias: jax.Array


class Net(ft.Module):
    layers: list
    scale: float
    steps: jax.Array = ft.field(no_derivative=True, default=None)
    name: str = ft.field(static=True, default="net")


def make_net() -> Net:
    return Net(
        layers=[Dense(jnp.ones((2, 3)), jnp.zeros(3)), Dense(jnp.ones((3, 1)), jnp.zeros(1))],
        scale=0.5,
        steps=jnp.zeros((), jnp.int32),
    )


def test_to_flat_dict_names_leaves_by_dotted_key_path():
    flat = ft.to_flat_dict(make_net())
    assert sorted(flat) == [
        "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight", "scale", "steps",
    ]
    assert flat["layers.1.weight"].shape == (3, 1)
    # The parameter view has no None entries in its flat dict.
    assert "steps" not in ft.to_flat_dict(ft.parameters(make_net()))


def test_from_flat_dict_round_trip_rebuilds_the_model():
    net = make_net()
    flat = {k: (v + 1 if k != "steps" else v) for k, v in ft.to_flat_dict(net).items()}
    new = ft.from_flat_dict(net, flat)
    assert isinstance(new, Net) and new.name == "net"
    np.testing.assert_array_equal(new.layers[0].weight, np.full((2, 3), 2.0))
    assert new.scale == 1.5


def test_from_flat_dict_accepts_numpy_and_a_float_scalar_for_a_python_float():
    net = make_net()
    flat = {k: np.asarray(v) for k, v in ft.to_flat_dict(net).items()}
    new = ft.from_flat_dict(net, flat)
    np.testing.assert_array_equal(new.layers[1].bias, [0.0])


def test_strict_mismatch_lists_missing_unexpected_and_mismatched_in_one_error():
    net = make_net()
    flat = ft.to_flat_dict(net)
    del flat["layers.0.bias"]
    flat["layers.2.weight"] = jnp.ones(1)
    flat["layers.1.weight"] = jnp.ones((1, 3))
    flat["steps"] = jnp.zeros((), jnp.float32)
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(net, flat)
    message = str(info.value)
    assert "missing keys:    ['layers.0.bias']" in message
    assert "unexpected keys: ['layers.2.weight']" in message
    assert "layers.1.weight: expected shape (3, 1) dtype float32, given shape (1, 3) dtype float32" in message
    assert "steps: expected shape () dtype int32, given shape () dtype float32" in message
    assert "strict=False" in message


def test_non_strict_fills_what_matches_and_returns_the_report():
    net = make_net()
    flat = {"layers.0.weight": jnp.full((2, 3), 7.0), "layers.1.bias": jnp.ones(5), "extra": 1.0}
    new, report = ft.from_flat_dict(net, flat, strict=False)
    np.testing.assert_array_equal(new.layers[0].weight, np.full((2, 3), 7.0))
    assert new.layers[1].bias is net.layers[1].bias
    assert not report.ok
    assert report.unexpected == ("extra",)
    assert "layers.0.bias" in report.missing and "layers.0.weight" not in report.missing
    assert report.mismatched == (("layers.1.bias", "shape (1,) dtype float32", "shape (5,) dtype float32"),)
    _, clean = ft.from_flat_dict(net, ft.to_flat_dict(net), strict=False)
    assert clean.ok and str(clean) == "  everything matched"


def test_flat_dict_of_a_parameter_view_restores_into_the_parameter_view():
    net = make_net()
    params = ft.parameters(net)
    restored = ft.from_flat_dict(params, ft.to_flat_dict(params))
    assert restored.steps is None
    assert_same_tree(restored, params)


@settings(max_examples=examples(30), deadline=None)
@given(nested_trees())
def test_flat_dict_round_trip_on_random_trees(tree: Any):
    flat = ft.to_flat_dict(tree)
    assert len(flat) == len(jax.tree.leaves(tree))
    assert_same_tree(ft.from_flat_dict(tree, flat), tree)
    rebuilt, report = ft.from_flat_dict(tree, flat, strict=False)
    assert report.ok
    assert_same_tree(rebuilt, tree)


def test_dotted_dict_key_colliding_with_a_nested_path_is_an_error():
    with pytest.raises(ValueError) as info:
        ft.to_flat_dict({"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
    message = str(info.value)
    assert "share the dotted name 'a.b'" in message and "['a']['b']" in message
    assert "Rename the key, e.g. 'a_b'" in message


def test_python_scalars_accept_scalar_arrays_of_their_kind_only():
    template = {"f": 0.5, "i": 3, "b": True}
    restored = ft.from_flat_dict(template, {"f": jnp.float32(1.5), "i": np.int32(4), "b": np.bool_(False)})
    assert float(restored["f"]) == 1.5 and int(restored["i"]) == 4 and not bool(restored["b"])
    _, report = ft.from_flat_dict(template, {"f": jnp.int32(1), "i": np.float32(4), "b": 1}, strict=False)
    assert [name for name, _, _ in report.mismatched] == ["b", "f", "i"]


# ----------------------------------------------------------------- torch tensors and cast=True


def torch_state_dict(torch: Any, dtype: Any) -> dict[str, Any]:
    """A torch state dict shaped like make_net() (weights transposed to the template's shapes)."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)]
    flat = {}
    for i, linear in enumerate(linears):
        flat[f"layers.{i}.weight"] = linear.weight.T.to(dtype)  # requires grad: cast detaches
        flat[f"layers.{i}.bias"] = linear.bias.to(dtype)
    flat["scale"] = torch.tensor(0.25, dtype=torch.float64)
    flat["steps"] = torch.tensor(7, dtype=torch.int32)
    return flat


def test_torch_tensors_are_reported_with_what_to_do():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(make_net(), torch_state_dict(torch, torch.float32))
    message = str(info.value)
    assert "layers.0.weight: expected shape (2, 3) dtype float32, given shape (2, 3) dtype torch.float32" in message
    assert "hint: torch tensors (layers.0.weight, layers.0.bias, layers.1.weight, layers.1.bias, scale and 1 more)" in message
    assert "pass cast=True" in message and "{k: v.detach().cpu().numpy() for k, v in state_dict.items()}" in message


def test_cast_converts_torch_tensors_to_the_template_dtypes():
    torch = pytest.importorskip("torch")
    net = make_net().replace(layers=[make_net().layers[0], Dense(jnp.ones((3, 1), jnp.bfloat16), jnp.zeros(1, jnp.bfloat16))])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        flat = torch_state_dict(torch, dtype)
        new = ft.from_flat_dict(net, flat, cast=True)
        assert_same_tree(jax.tree.map(jnp.zeros_like, new), jax.tree.map(jnp.zeros_like, net))
        assert isinstance(new.layers[0].weight, jax.Array) and isinstance(new.scale, float)
        expected = flat["layers.0.weight"].detach().double().numpy()
        np.testing.assert_allclose(np.asarray(new.layers[0].weight, np.float64), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        np.testing.assert_allclose(np.asarray(new.layers[1].bias, np.float64), flat["layers.1.bias"].detach().double().numpy(), rtol=1e-2)
        assert new.scale == 0.25 and int(new.steps) == 7 and new.steps.dtype == jnp.int32


def test_cast_never_reshapes_and_casts_integers_only_where_they_fit():
    torch = pytest.importorskip("torch")
    flat = torch_state_dict(torch, torch.float32)
    flat["steps"] = torch.tensor(7)  # int64, torch's integer dtype: held by the int32 leaf
    loaded = ft.from_flat_dict(make_net(), flat, cast=True)
    assert int(loaded.steps) == 7 and loaded.steps.dtype == jnp.int32
    flat["layers.0.weight"] = flat["layers.0.weight"].T  # (3, 2): the torch layout
    flat["steps"] = torch.tensor(2**40)  # past int32: refused, never wrapped
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(make_net(), flat, cast=True)
    message = str(info.value)
    assert "layers.0.weight: expected shape (2, 3) dtype float32, given shape (3, 2) dtype torch.float32" in message
    assert "steps: expected shape () dtype int32, given shape () dtype torch.int64" in message
    assert ("hint: cast=True converts floating values of the same shape, and integers to an integer dtype that "
            "holds them; convert these yourself: layers.0.weight\n") in message
    assert "hint: steps: integers beyond the leaf's int32 range" in message  # (its own hint: the range, a clip)
    _, report = ft.from_flat_dict(make_net(), flat, cast=True, strict=False)
    assert [name for name, _, _ in report.mismatched] == ["layers.0.weight", "steps"]


def test_float64_numpy_arrays_need_cast_and_get_a_hint():
    net = make_net()
    flat = {k: np.asarray(v, np.float64) if k != "steps" else v for k, v in ft.to_flat_dict(net).items()}
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(net, flat)
    message = str(info.value)
    assert "layers.0.weight: expected shape (2, 3) dtype float32, given shape (2, 3) dtype float64" in message
    assert "hint: floating dtypes differ (layers.0.weight, layers.0.bias, layers.1.weight, layers.1.bias): pass cast=True" in message
    new = ft.from_flat_dict(net, flat, cast=True)
    assert_same_tree(new, net)
    assert isinstance(new.layers[0].weight, jax.Array)
    _, report = ft.from_flat_dict(net, {**flat, "steps": np.float32(1.0)}, cast=True, strict=False)
    assert report.mismatched == (("steps", "shape () dtype int32", "shape () dtype float32"),)


def _range_hint_and_its_clip_loads(dtype, big, bound):
    """The message of casting ``[1, big, 2]`` into a ``dtype`` leaf ``w``; the clip at
    ``bound`` it shows loads, ``big`` read as ``bound``."""
    template, given = {"w": np.zeros(3, dtype)}, np.array([1.0, big, 2.0], np.float32)
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(template, {"w": given}, cast=True)
    clipped = ft.from_flat_dict(template, {"w": np.clip(given, -bound, bound)}, cast=True)
    np.testing.assert_array_equal(np.asarray(clipped["w"], np.float32), [1.0, bound, 2.0])
    return str(info.value)


def test_values_past_a_float16_template_s_range_hint_from_flat_dict_s_own_fix():
    """The hint showed torch's loader and ``v.clamp(...)``, no method of the NumPy arrays
    from_flat_dict is given (a float32 checkpoint cast into a float16 model, as the
    checkpoint's dtype hint shows, comes here)."""
    message = _range_hint_and_its_clip_loads(np.float16, 7e4, 65504)
    assert "w: values beyond the largest finite value of the leaf's floating dtype" in message
    assert "right:  ft.from_flat_dict(float32_model, flat, cast=True)" in message
    assert "np.clip(v, -65504, 65504) for k, v in flat.items()" in message
    assert "load_torch_state_dict" not in message and ".clamp(" not in message


def test_values_past_a_float8_template_s_range_hint_the_leaf_s_own_bound():
    """The range hint named float16's 65504 for every leaf: clipped there as it said, a
    float8_e4m3fn leaf's values (largest 448) were still beyond its range. It names the
    leaf's dtype and bound, and the clip it writes loads."""
    message = _range_hint_and_its_clip_loads(jnp.float8_e4m3fn, 500.0, 448)
    assert "w: values beyond the largest finite value of the leaf's floating dtype (float8_e4m3fn's is 448)" in message
    assert "wrong:  ft.from_flat_dict(float8_e4m3fn_model, flat, cast=True)   # values beyond 448" in message
    assert "np.clip(v, -448, 448) for k, v in flat.items()" in message and "65504" not in message


def test_integers_past_an_int32_template_s_range_hint_the_range_and_a_clip_that_loads():
    """cast=True refused an int64 2**40 for an int32 leaf (never wrapped) with the hint for
    another kind of value ("cast=True converts ... convert these yourself"), no range nor fix.
    It names int32's range, the leaf to widen (int64, under x64) and a clip, which loads."""
    template, flat = {"n": np.zeros(2, np.int32)}, {"n": np.array([3, 2**40])}
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(template, flat, cast=True)
    message = str(info.value)
    assert ("n: integers beyond the leaf's int32 range (-2147483648 to 2147483647), which the cast would wrap "
            "around") in message and "Give the model's n the dtype int64" in message
    assert "convert these yourself" not in message
    right = re.search(r"right:  (.*)", message).group(1)
    loaded = eval(right, {"ft": ft, "np": np, "model": template, "flat": flat})
    np.testing.assert_array_equal(loaded["n"], [3, 2**31 - 1])


def test_an_int64_step_count_for_an_int32_leaf_is_told_cast_true_which_loads_it():
    """An int64 step count (np.save's, a Python int) for an int32 leaf was refused with no hint,
    where float64 weights are told cast=True: cast=True converts integers the leaf's dtype
    holds. Integers past int32's range get the range hint (its clip, never a wrap)."""
    net = make_net()
    for count in (np.array(7, np.int64), 7):
        flat = {**ft.to_flat_dict(net), "steps": count}
        with pytest.raises(ValueError) as info:
            ft.from_flat_dict(net, flat)
        assert ("hint: integer dtypes differ (steps): pass cast=True to convert integers to the template's integer "
                "dtypes") in str(info.value)
        right = str(info.value).split("dtypes (")[1].split("): ")[1].splitlines()[0]
        loaded = eval(right, {"ft": ft, "template": net, "flat": flat})
        assert loaded.steps.dtype == jnp.int32 and int(loaded.steps) == 7
    with pytest.raises(ValueError, match=r"hint: steps: integers beyond the leaf's int32 range"):
        ft.from_flat_dict(net, {**ft.to_flat_dict(net), "steps": np.array(2**40)})


@pytest.mark.parametrize("cast", [False, True])
def test_values_of_another_kind_are_told_the_conversion_that_loads(cast):
    """An int32 array for a float32 weight (and a float for the int32 step count) was refused
    with cast=False with no hint at all (cast=True: "convert these yourself", no code). The
    hint names each key path and both dtypes, says cast=True changes no kind, and its code loads."""
    net = make_net()
    flat = {**ft.to_flat_dict(net), "layers.0.weight": np.full((2, 3), 3, np.int32), "steps": np.float32(7.0)}
    with pytest.raises(ValueError) as info:
        ft.from_flat_dict(net, flat, cast=cast)
    message = str(info.value)
    assert ("hint: layers.0.weight, steps: values of another kind than the template's leaves (int32 for float32 at "
            "layers.0.weight, float32 for int32 at steps). cast=True never changes a value's kind") in message
    right = re.search(r"right:  (.*)", message).group(1)
    assert right == ("ft.from_flat_dict(model, {**flat, 'layers.0.weight': np.asarray(flat['layers.0.weight'], "
                     "jnp.float32), 'steps': np.asarray(flat['steps'], jnp.int32)}" + (", cast=True)" if cast else ")"))
    loaded = eval(right, {"ft": ft, "np": np, "jnp": jnp, "model": net, "flat": flat})
    np.testing.assert_array_equal(loaded.layers[0].weight, np.full((2, 3), 3.0, np.float32))
    assert loaded.layers[0].weight.dtype == jnp.float32 and int(loaded.steps) == 7


def test_from_flat_dict_rejects_a_template_whose_names_collide():
    with pytest.raises(ValueError, match=r"ft\.from_flat_dict: two leaves share the dotted name 'a\.b'"):
        ft.from_flat_dict({"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}}, {"a.b": jnp.ones(1)})


def test_a_stacked_leaf_the_template_lacks_is_named_against_the_stacked_names():
    """A file's stacked leaf the template lacks (a LoraDense's member_scale, saved after
    load_lora) was read as a member name: every leaf reported missing per member and the
    one real difference buried; member names still select the per-member form."""
    template = {"blocks": ft.nn.Stack.from_layers([ft.nn.Dense(2, 2, key=k) for k in jax.random.split(jax.random.key(0), 3)])}
    flat = {**ft.to_flat_dict(template), "blocks.layers.member_scale": jnp.ones(3)}
    _, report = ft.from_flat_dict(template, flat, strict=False)
    assert "'blocks.layers.member_scale'" in str(report) and "missing" not in str(report)
    per_member = ft.to_flat_dict(template, unstack=True)
    back = ft.from_flat_dict(template, per_member)
    assert_same_tree(back, template)


def test_a_function_leaf_of_another_kind_is_named_by_its_function():
    template = {"w": jnp.ones(2), "act": jax.nn.relu}  # a custom_jvp
    with pytest.raises(ValueError, match=r"act: expected function jax\.nn\.relu, given function jax\.nn\.sigmoid"):
        ft.from_flat_dict(template, {"w": jnp.ones(2), "act": jax.nn.sigmoid})  # a jitted function
