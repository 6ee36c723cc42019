"""Key paths: ft.KeyPath, ft.get/ft.set, all_key_paths and the recursive variants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import functree as ft


class Dense(ft.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable[[jax.Array], jax.Array] = ft.field(static=True, default=jax.nn.relu)


class Inner(ft.Module):
    w: jax.Array


class Net(ft.Module):
    inner: Inner
    layers: list
    table: dict
    pair: tuple
    nothing: Any
    config: tuple = ft.field(static=True, default=("a", 1))
    running: jax.Array = ft.field(no_derivative=True, default=None)


def make_net() -> Net:
    return Net(
        inner=Inner(jnp.ones(2)),
        layers=[Dense(jnp.ones((2, 2)), jnp.zeros(2)), Dense(jnp.ones((2, 1)), jnp.zeros(1))],
        table={"z": jnp.ones(1), "a": jnp.arange(3)},
        pair=(jnp.ones(()), 2.0),
        nothing=None,
        running=jnp.zeros(2),
    )


# ----------------------------------------------------------------- random nested trees
# Shared with the other test modules (`from test_paths import nested_trees`).


class Pair(ft.Module):
    left: Any
    right: Any
    tag: str = ft.field(static=True, default="pair")


class Carry(ft.Module):
    value: Any
    state: Any = ft.field(no_derivative=True, default=None)


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.bool_]


@st.composite
def arrays(draw: Any, float_only: bool = False) -> jax.Array:
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dtype = draw(st.sampled_from(DTYPES[:3] if float_only else DTYPES))
    seed = draw(st.integers(0, 2**16))
    values = np.random.default_rng(seed).normal(size=shape)
    if dtype == jnp.bool_:
        return jnp.asarray(values > 0)
    return jnp.asarray(values * 4).astype(dtype)


def leaves_strategy(float_only: bool = False) -> st.SearchStrategy:
    floats = st.floats(-10, 10, allow_nan=False, allow_subnormal=False, width=32)
    return st.one_of(arrays(float_only), floats) if float_only else st.one_of(arrays(), floats)


def nested_trees(float_only: bool = False) -> st.SearchStrategy:
    """Nested dicts, lists, tuples and Modules (static, no_derivative fields) of arrays."""
    keys = st.text("abcxyz", min_size=1, max_size=3)

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.builds(Pair, children, children, st.sampled_from(["p", "q"])),
            st.builds(Carry, children, st.one_of(st.none(), arrays())),
        )

    return st.recursive(leaves_strategy(float_only), extend, max_leaves=8)


def assert_same_tree(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ----------------------------------------------------------------- key path values


def test_key_paths_print_hash_and_compare():
    kp = ft.key_path(None, ".layers[0].weight")
    assert str(kp) == ".layers[0].weight"
    assert repr(kp) == "KeyPath('.layers[0].weight')"
    assert kp == ft.key_path(make_net(), "layers.0.weight")
    assert {kp: 1}[ft.key_path(None, ".layers[0].weight")] == 1
    assert str(ft.key_path(None, "['a'][2]")) == "['a'][2]"
    assert str(ft.KeyPath()) == "<root>"
    assert str(kp + ft.key_path(None, "[1]")) == ".layers[0].weight[1]"
    assert ft.key_path(None, "[-1]").get([1, 2, 3]) == 3


def test_all_key_paths_direct_children_in_declaration_order_static_included():
    net = make_net()
    assert [str(p) for p in ft.all_key_paths(net)] == [
        ".inner", ".layers", ".table", ".pair", ".nothing", ".config", ".running",
    ]
    assert [str(p) for p in ft.all_writable_key_paths(net)] == [
        ".inner", ".layers", ".table", ".pair", ".nothing", ".running",
    ]
    assert [str(p) for p in ft.all_writable_key_paths(net, to=Inner)] == [".inner"]
    # dicts in insertion order (JAX's own path tools sort them)
    assert [str(p) for p in ft.all_key_paths(net.table)] == ["['z']", "['a']"]
    assert ft.all_key_paths(None) == []
    assert ft.all_key_paths(jnp.ones(2)) == []


def test_recursively_all_key_paths_pre_order_with_interior_nodes():
    net = make_net()
    paths = [str(p) for p in ft.recursively_all_key_paths(net)]
    assert paths[:4] == [".inner", ".inner.w", ".layers", ".layers[0]"]
    assert paths.index(".layers[0]") < paths.index(".layers[0].weight") < paths.index(".layers[1]")
    assert ".layers[0].activation" in paths and ".config" in paths and ".config[0]" in paths
    assert paths[-1] == ".running"
    assert ".nothing" in paths and not any(p.startswith(".nothing.") for p in paths)


def test_recursively_all_key_paths_filtered_by_type_and_dtype():
    net = make_net()
    arrays_ = [str(p) for p in ft.recursively_all_key_paths(net, to=jax.Array)]
    assert arrays_ == [
        ".inner.w", ".layers[0].weight", ".layers[0].bias", ".layers[1].weight",
        ".layers[1].bias", ".table['z']", ".table['a']", ".pair[0]", ".running",
    ]
    floats = [str(p) for p in ft.recursively_all_key_paths(net, to=jnp.float32)]
    assert ".table['a']" not in floats and ".pair[1]" in floats  # a Python float is float32
    assert [str(p) for p in ft.recursively_all_key_paths(net, to=jnp.int32)] == [".table['a']"]
    assert [str(p) for p in ft.recursively_all_key_paths(net, to=Dense)] == [".layers[0]", ".layers[1]"]
    assert [str(p) for p in ft.recursively_all_key_paths({"a": np.ones(1)}, to=np.ndarray)] == ["['a']"]
    assert len(ft.recursively_all_key_paths(net, to=int | float)) == 2  # .config[1], .pair[1]


def test_bad_to_argument_is_an_error():
    with pytest.raises(TypeError, match=r"to=3 \(int\) is neither a type nor a dtype"):
        ft.recursively_all_key_paths(make_net(), to=3)


def test_writable_key_paths_skip_static_fields_and_everything_under_them():
    class Holder(ft.Module):
        w: jax.Array
        frozen: tuple = ft.field(static=True, default=(1.0, 2.0))

    h = Holder(jnp.ones(1))
    assert [str(p) for p in ft.recursively_all_key_paths(h)] == [".w", ".frozen", ".frozen[0]", ".frozen[1]"]
    assert [str(p) for p in ft.recursively_all_writable_key_paths(h)] == [".w"]
    assert [str(p) for p in ft.recursively_all_writable_key_paths(h, to=float)] == []


def test_get_and_set_by_key_path_or_string():
    net = make_net()
    w = ft.get(net, ".layers[1].weight")
    assert w.shape == (2, 1)
    assert ft.get(net, "layers.1.weight") is w
    new = ft.set(net, "layers.1.weight", jnp.full((2, 1), 3.0))
    np.testing.assert_array_equal(new.layers[1].weight, [[3.0], [3.0]])
    np.testing.assert_array_equal(net.layers[1].weight, [[1.0], [1.0]])
    assert new.layers[0] is net.layers[0]
    kp = ft.key_path(net, "table.z")
    assert str(kp) == ".table['z']"
    new = kp.set(net, jnp.zeros(1))
    assert list(new.table) == ["z", "a"]  # insertion order kept
    new = ft.set(net, ".pair[1]", 5.0)
    assert new.pair == (net.pair[0], 5.0) and isinstance(new.pair, tuple)
    new = ft.set(net, ".pair[0]", 4.0)  # a Python float fits a scalar array
    assert new.pair[0] == 4.0


def test_namedtuple_children_are_attributes():
    class Point(NamedTuple):
        x: jax.Array
        y: jax.Array

    tree = {"p": Point(jnp.ones(1), jnp.zeros(1))}
    assert [str(p) for p in ft.recursively_all_key_paths(tree)] == ["['p']", "['p'].x", "['p'].y"]
    new = ft.set(tree, "['p'].y", jnp.ones(1))
    assert isinstance(new["p"], Point)
    np.testing.assert_array_equal(new["p"].y, [1.0])


def test_set_checks_shape_and_dtype_naming_the_path():
    net = make_net()
    with pytest.raises(ValueError) as info:
        ft.set(net, ".layers[0].weight", jnp.ones((3, 2)))
    message = str(info.value)
    assert ".layers[0].weight" in message
    assert "expected shape (2, 2) and dtype float32" in message
    assert "got shape (3, 2) and dtype float32" in message
    assert "astype(jnp.float32).reshape((2, 2))" in message
    with pytest.raises(ValueError, match=r"expected shape \(2,\) and dtype float32, got shape \(2,\) and dtype int32"):
        ft.set(net, ".inner.w", jnp.ones(2, jnp.int32))


def test_missing_path_names_the_node_and_its_children():
    net = make_net()
    with pytest.raises(KeyError) as info:
        ft.get(net, ".layers[0].wieght")
    message = str(info.value)
    assert ".layers[0].wieght" in message and "Dense at .layers[0]" in message
    assert "'.weight', '.bias', '.activation'" in message
    with pytest.raises(KeyError, match=r"no_derivative|non-parameter"):
        ft.get(ft.parameters(net), ".running[0]")
    with pytest.raises(KeyError, match=r"list at \.layers has no \[5\]"):
        ft.get(net, ".layers[5]")
    with pytest.raises(KeyError, match=r"no .*nope"):
        ft.get(net, "layers.0.nope")


def test_unparseable_path_string_is_an_error():
    with pytest.raises(ValueError, match=r"Cannot parse key path '\.layers\[x'"):
        ft.get(make_net(), ".layers[x")
    with pytest.raises(TypeError, match=r"ft\.KeyPath or a string"):
        ft.get(make_net(), 3)


def test_one_key_path_reads_model_parameters_gradient_and_optimizer_state():
    net = make_net()
    params = ft.parameters(net)

    def loss(n: Net) -> jax.Array:
        return sum(leaf.astype(jnp.float32).sum() ** 2 for leaf in jax.tree.leaves(ft.parameters(n)))

    grads = ft.gradient(loss, at=net)
    with jax.numpy_dtype_promotion("standard"):
        state = optax.adam(0.1).init(params)
    kp = ft.key_path(net, "layers.0.weight")
    for tree in (net, params, grads, state[0].mu, state[0].nu):
        assert kp.get(tree).shape == (2, 2)
    # Non-parameters are None in every tree shaped like the parameter view.
    run = ft.key_path(net, "running")
    assert run.get(params) is None and run.get(grads) is None and run.get(state[0].mu) is None


def test_set_works_inside_jit():
    net = make_net()
    kp = ft.key_path(net, "inner.w")
    out = jax.jit(lambda n: kp.set(n, kp.get(n) * 2))(net)
    np.testing.assert_array_equal(out.inner.w, [2.0, 2.0])


@settings(max_examples=30, deadline=None)
@given(nested_trees())
def test_get_set_round_trip_on_random_trees(tree: Any):
    for kp in ft.recursively_all_writable_key_paths(tree):
        value = kp.get(tree)
        assert_same_tree(kp.set(tree, value), tree)
        # The string form parses back to the same path.
        assert ft.key_path(tree, str(kp)) == kp
    for kp in ft.recursively_all_writable_key_paths(tree, to=jax.Array):
        value = kp.get(tree)
        bumped = kp.set(tree, jnp.zeros_like(value))
        np.testing.assert_array_equal(np.asarray(kp.get(bumped), np.float32), 0.0)
        others = [p for p in ft.recursively_all_writable_key_paths(tree, to=jax.Array) if p != kp]
        for other in others:
            if other[: len(kp)] != kp:
                np.testing.assert_array_equal(
                    np.asarray(other.get(bumped), np.float32), np.asarray(other.get(tree), np.float32)
                )


def test_int_dict_keys_negative_tuple_indices_and_other_pytree_nodes():
    tree = {0: jnp.ones(1), "x": {1: jnp.ones(2)}}
    for kp in ft.recursively_all_key_paths(tree):
        assert ft.get(tree, str(kp)) is kp.get(tree)
    assert ft.set(tree, "[0]", jnp.zeros(1))[0].shape == (1,)
    assert ft.set((1.0, 2.0), "[-1]", 5.0) == (1.0, 5.0)
    with jax.numpy_dtype_promotion("standard"):
        state = optax.chain(optax.clip(1.0), optax.adam(0.1)).init({"w": jnp.ones(2)})
    paths = [str(p) for p in ft.recursively_all_key_paths(state, to=jax.Array)]
    assert paths == ["[1][0].count", "[1][0].mu['w']", "[1][0].nu['w']"]
    new = ft.set(state, "[1][0].mu['w']", jnp.full(2, 3.0))
    assert type(new[1][0]) is type(state[1][0])
    np.testing.assert_array_equal(new[1][0].mu["w"], [3.0, 3.0])


@jax.tree_util.register_pytree_with_keys_class
class Box:
    """A pytree node that is neither a Module nor a container."""

    def __init__(self, a: Any, b: Any):
        self.a, self.b = a, b

    def tree_flatten_with_keys(self) -> Any:
        return ((jax.tree_util.GetAttrKey("a"), self.a), (jax.tree_util.GetAttrKey("b"), self.b)), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> Box:
        return cls(*children)


def test_key_paths_through_any_registered_pytree_node():
    box = {"box": Box(jnp.ones(1), [jnp.ones(2)])}
    assert [str(p) for p in ft.recursively_all_key_paths(box)] == [
        "['box']", "['box'].a", "['box'].b", "['box'].b[0]",
    ]
    new = ft.set(box, "['box'].b[0]", jnp.zeros(2))
    assert isinstance(new["box"], Box)
    np.testing.assert_array_equal(new["box"].b[0], [0.0, 0.0])
    with pytest.raises(KeyError, match=r"has no \.c"):
        ft.get(box, "['box'].c")


def test_module_paths_address_fields_only():
    with pytest.raises(KeyError, match=r"has no \.replace"):
        ft.get(make_net(), ".replace")
