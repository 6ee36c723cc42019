"""Key paths: ft.KeyPath, ft.get/ft.set, all_key_paths and the recursive variants."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hypothesis import examples
from _tolerance import needs_float16_conversions
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


def _quietly(cls: type) -> Any:
    """``cls`` built without the warning that a field's Python floats are static: these trees
    hold them on purpose (the parameter view's rules are what the tests check)."""

    def build(*args: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ft.NonDifferentiableFieldWarning)
            return cls(*args)

    return build


def nested_trees(float_only: bool = False) -> st.SearchStrategy:
    """Nested dicts, lists, tuples and Modules (static, no_derivative fields) of arrays."""
    keys = st.text("abcxyz", min_size=1, max_size=3)

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.builds(_quietly(Pair), children, children, st.sampled_from(["p", "q"])),
            st.builds(_quietly(Carry), children, st.one_of(st.none(), arrays())),
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
    with pytest.raises(TypeError, match=r"to='float33' \(str\) is neither a type nor a dtype"):
        ft.recursively_all_key_paths(make_net(), to="float33")  # was isinstance's TypeError, later


def test_key_paths_filtered_by_a_kind_of_dtypes():
    """to=jnp.floating (jnp.inexact, jnp.integer) failed in NumPy's dtype conversion."""
    tree = {"h": jnp.ones(2, jnp.bfloat16), "z": jnp.ones(1, jnp.complex64), "w": jnp.ones(2),
            "n": jnp.arange(2), "f": 0.5, "b": jnp.ones(1, bool)}
    def named(to):
        return [str(p) for p in ft.recursively_all_writable_key_paths(tree, to=to)]
    assert named(jnp.floating) == ["['h']", "['w']", "['f']"]  # a Python float reads as float32
    assert named(jnp.inexact) == ["['h']", "['z']", "['w']", "['f']"]
    assert named(jnp.integer) == ["['n']"]
    assert named(jnp.complexfloating) == ["['z']"]
    assert [str(p) for p in ft.all_writable_key_paths(tree, to=jnp.number)] == [
        "['h']", "['z']", "['w']", "['n']", "['f']"]


def test_writable_key_paths_skip_static_fields_and_everything_under_them():
    class Holder(ft.Module):
        w: jax.Array
        frozen: tuple = ft.field(static=True, default=(1.0, 2.0))

    h = Holder(jnp.ones(1))
    assert [str(p) for p in ft.recursively_all_key_paths(h)] == [".w", ".frozen", ".frozen[0]", ".frozen[1]"]
    assert [str(p) for p in ft.recursively_all_writable_key_paths(h)] == [".w"]
    assert [str(p) for p in ft.recursively_all_writable_key_paths(h, to=float)] == []


def test_set_refuses_static_fields_naming_the_path_and_the_replace_fix():
    net = make_net()
    writable = {str(p) for p in ft.recursively_all_writable_key_paths(net)}
    for path, fix in [
        (".config", "model = model.replace(config=value)"),
        (".config[1]", "model = model.replace(config=...)"),
        (".layers[0].activation", 'ft.set(model, ".layers[0]", ft.get(model, ".layers[0]").replace(activation=value))'),
    ]:
        assert path not in writable  # the two agree: not writable, and set refuses
        with pytest.raises(ValueError, match=r"static field") as info:
            ft.set(net, path, jax.nn.tanh if path.endswith("activation") else 2)
        assert f"ft.set({path})" in str(info.value) and fix in str(info.value)
        with pytest.raises(ValueError, match=re.escape(f"ft.set({path})")):
            ft.key_path(net, path).set(net, 2)
    # The fix works, and ft.get still reads static fields.
    new = ft.set(net, ".layers[0]", ft.get(net, ".layers[0]").replace(activation=jax.nn.tanh))
    assert ft.get(new, "layers.0.activation") is jax.nn.tanh and ft.get(net, ".config") == ("a", 1)

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
    assert "new_value)   # of shape (2, 2) (this one has 6 elements, the leaf 4)" in message  # no reshape makes it
    # the fix shown is code that keeps every number in place: a reshape only adds or removes
    # axes of length 1; a broadcast where it broadcasts; a flat vector's layout is unknown
    with pytest.raises(ValueError, match=r"value.astype\(jnp.float32\).reshape\(\(2, 2\)\)"):
        ft.set(net, ".layers[0].weight", jnp.ones((2, 1, 2), jnp.float16))
    with pytest.raises(ValueError, match=r"jnp.broadcast_to\(value, \(2, 2\)\)"):
        ft.set(net, ".layers[0].weight", jnp.ones(1))
    with pytest.raises(ValueError, match=r"new_value\)   # of shape \(2, 2\)\nBoth hold 4 numbers") as info:
        ft.set(net, ".layers[0].weight", jnp.ones(4))
    assert "reshape(" not in str(info.value)
    with pytest.raises(ValueError, match=r"expected shape \(2,\) and dtype float32, got shape \(2,\) and dtype int32"):
        ft.set(net, ".inner.w", jnp.ones(2, jnp.int32))


def _right_code(message: str) -> str:
    """The code of an error message's ``right:`` line, to run as the user would paste it."""
    return next(line for line in message.splitlines() if "right:" in line).split("right:", 1)[1].strip()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_set_of_a_transposed_torch_weight_suggests_the_transpose_not_a_reshape(dtype):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    linear = torch.nn.Linear(2, 3)
    tree = ft.set(ft.nn.Dense(2, 3, key=jax.random.key(0)), "bias", linear.bias.detach().numpy())
    value = linear.weight.detach().numpy().astype(dtype)  # (out, in) = (3, 2); the Dense holds (2, 3)
    with pytest.raises(ValueError) as info:
        ft.set(tree, "weight", value)
    message = str(info.value)
    assert "reshape" not in _right_code(message) and "value.T" in message
    fixed = eval(_right_code(message))  # the message's right: line, pasted
    x = np.random.default_rng(0).standard_normal((4, 2)).astype(np.float32)
    expected = linear(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(fixed(jnp.asarray(x))), expected, rtol=0, atol=1e-6)


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


@needs_float16_conversions  # float16 leaves: XLA:CPU below AVX cannot link their conversions
@settings(max_examples=examples(30), deadline=None)
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


# ----------------------------------------------------------------- scalar leaves of ft.set


def test_set_on_a_python_float_leaf_takes_floats_ints_and_0d_floating_arrays_only():
    tree = {"lr": 0.5, "count": 3, "flag": True}
    assert ft.set(tree, "lr", 0.25)["lr"] == 0.25
    assert type(ft.set(tree, "lr", 2)["lr"]) is float  # an int becomes a float: the leaf stays a float
    assert ft.set(tree, "lr", jnp.float32(2.0))["lr"] == 2.0
    assert ft.set(tree, "count", np.int32(4))["count"] == 4
    assert ft.set(tree, "flag", False)["flag"] is False
    with pytest.raises(ValueError) as info:
        ft.set(tree, "lr", "0.1")
    message = str(info.value)
    assert "ft.set(['lr']): the value there is a Python float" in message
    assert "takes a float, an int or a 0-d floating array; given a str '0.1'" in message
    assert "right:  ft.set(tree, \"['lr']\", float(value))" in message
    for bad, described in ((jnp.ones(5), "an array of shape (5,) and dtype float32"), (1 + 2j, "a Python complex"),
                       (True, "a Python bool True"), (None, "a NoneType None")):
        with pytest.raises(ValueError, match=re.escape(described)):
            ft.set(tree, "lr", bad)
    with pytest.raises(ValueError) as info:  # float(value) of 5 numbers would fail: a number is shown
        ft.set(tree, "lr", jnp.ones(5))
    assert "right:  ft.set(tree, \"['lr']\", 2.0)   # one float: the leaf holds one number, the value 5" in str(info.value)
    assert ft.set(tree, "lr", 2.0)["lr"] == 2.0
    with pytest.raises(ValueError, match=r"the value there is a Python int, .* given a Python float 2\.5"):
        ft.set(tree, "count", 2.5)
    with pytest.raises(ValueError, match=r"a Python bool, so it takes a bool or a 0-d bool array"):
        ft.set(tree, "flag", 1)


def test_set_on_a_0d_array_leaf_takes_numbers_of_its_kind_only():
    tree = {"i": jnp.zeros((), jnp.int32), "f": jnp.zeros(())}
    assert ft.set(tree, "i", 7)["i"] == 7
    assert ft.set(tree, "f", 7)["f"] == 7  # an int fits a floating leaf
    with pytest.raises(ValueError) as info:
        ft.set(tree, "i", "abc")
    message = str(info.value)
    assert "the value there is an array of shape () and dtype int32" in message
    assert "takes an array of that shape and dtype or a Python int; given a str 'abc'" in message
    assert "jnp.asarray(value, jnp.int32).reshape(())" in message
    for bad in (2.5, 1 + 2j, True):
        with pytest.raises(ValueError, match=r"ft\.set\(\['i'\]\)"):
            ft.set(tree, "i", bad)
    with pytest.raises(ValueError, match=r"expected shape \(\) and dtype int32, got shape \(5,\)"):
        ft.set(tree, "i", jnp.ones(5, jnp.int32))
    with pytest.raises(ValueError, match=r"Python float or int; given a Python complex"):
        ft.set(tree, "f", 1j)


def test_set_on_a_python_float_leaf_inside_jit_takes_a_traced_scalar():
    tree = {"lr": 0.5, "w": jnp.ones(2)}  # closed over: "lr" stays a Python float under jit
    out = jax.jit(lambda v: ft.set(tree, "lr", v))(jnp.float32(0.1))
    np.testing.assert_allclose(out["lr"], 0.1, rtol=1e-6)
    with pytest.raises(ValueError, match=r"a Python float, .* given an array of shape \(2,\)"):
        jax.jit(lambda w: ft.set(tree, "lr", w))(tree["w"])


# ----------------------------------------------------------------- cycles


class Holder(ft.Module):
    items: list
    w: jax.Array


def test_a_module_that_contains_itself_raises_naming_where_the_cycle_closes():
    looped = Holder([jnp.ones(1)], jnp.zeros(2))
    looped.items.append(looped)  # a list field that holds its own module
    for walk in (ft.recursively_all_key_paths, ft.recursively_all_writable_key_paths):
        with pytest.raises(ValueError) as info:
            walk(looped)
        message = str(info.value)
        assert "The tree contains itself: the Holder at .items[1] is the same object as its ancestor at <root>" in message
        assert "build a new Holder" in message
    inner = Holder([], jnp.zeros(2))
    object.__setattr__(inner, "items", [inner])  # past the frozen check
    with pytest.raises(ValueError, match=r"Holder at \['m'\]\.items\[0\] is the same object as its ancestor at \['m'\]"):
        ft.recursively_all_key_paths({"m": inner})
    with pytest.raises(ValueError, match=r"contains itself"):
        ft.to_flat_dict(looped)
    with pytest.raises(ValueError, match=r"contains itself"):
        ft.from_flat_dict(looped, {})


def test_a_shared_subtree_is_no_cycle():
    shared = [jnp.ones(1), {"x": jnp.ones(2)}]
    tree = {"a": shared, "b": shared, "c": Holder(shared, jnp.ones(1))}
    paths = [str(p) for p in ft.recursively_all_key_paths(tree, to=jax.Array)]
    assert paths == [
        "['a'][0]", "['a'][1]['x']", "['b'][0]", "['b'][1]['x']", "['c'].items[0]", "['c'].items[1]['x']", "['c'].w",
    ]


# ----------------------------------------------------------------- printed key paths and names


def test_printed_key_paths_round_trip_quotes_backslashes_control_characters_and_unicode():
    keys = ["it's", 'say "hi"', "both ' and \"", "back\\slash", "line\nbreak\ttab\x00nul", "ünï ✓", "]", "", "a.b"]
    tree = {k: [jnp.ones(1)] for k in keys}
    paths = ft.recursively_all_key_paths(tree, to=jax.Array)
    assert len(paths) == len(keys)
    for key, kp in zip(keys, paths):
        assert ft.KeyPath.parse(str(kp)) == kp
        assert ft.key_path(tree, str(kp)) == kp
        assert ft.get(tree, str(kp)) is tree[key][0]
    assert str(paths[3]) == "['back\\\\slash'][0]"
    assert ft.get(tree, "['line\\nbreak\\ttab\\x00nul'][0]") is tree["line\nbreak\ttab\x00nul"][0]


def test_a_numpy_text_key_with_trailing_nuls_prints_them_and_reads_back_its_own_value():
    # np.str_('a\x00') is the dict key 'a\x00' (equal, same hash), but its .item() and str()
    # drop the NUL: its path printed ['a'] and read back the other key's value
    tree = {np.str_("a\x00"): jnp.ones(2), "a": jnp.zeros(2), np.bytes_(b"b\x00"): jnp.ones(1), b"b": jnp.zeros(1)}
    paths = ft.recursively_all_key_paths(tree)
    assert [str(p) for p in paths] == ["['a\\x00']", "['a']", "[b'b\\x00']", "[b'b']"]
    for kp in paths:
        assert ft.KeyPath.parse(str(kp)) == kp
        assert ft.get(tree, str(kp)) is kp.get(tree)


def test_int_and_other_literal_dict_keys_round_trip():
    tree = {0: jnp.ones(1), -2: jnp.ones(2)}
    paths = ft.recursively_all_key_paths(tree)
    assert [str(p) for p in paths] == ["[0]", "[-2]"]
    assert all(ft.KeyPath.parse(str(p)) == p and ft.key_path(tree, str(p)) == p for p in paths)
    odd = {1.5: 1.0, (1, "]"): 2.0, None: 3.0}
    for kp in ft.recursively_all_key_paths(odd):
        assert ft.KeyPath.parse(str(kp)) == kp
        assert ft.get(odd, str(kp)) == kp.get(odd)
    assert [str(p) for p in ft.recursively_all_key_paths(odd)] == ["[1.5]", "[(1, ']')]", "[None]"]


def test_key_path_parse_rejects_text_that_is_no_printed_path():
    for text in ("[x", ".layers[", "['a\\q']", "a.b", "[1.5"):
        with pytest.raises(ValueError, match=r"Cannot parse key path"):
            ft.KeyPath.parse(text)


def test_a_flat_name_never_resolves_to_a_different_leaf():
    x, y = jnp.ones(1), jnp.zeros(1)
    # "['a']" is both the printed path of key 'a' and the flat name of key "['a']".
    both = {"['a']": x, "a": y}
    with pytest.raises(ValueError) as info:
        ft.get(both, "['a']")
    message = str(info.value)
    assert "\"['a']\" names 2 different values in this tree" in message
    assert "['a'] (dotted name 'a')" in message and "[\"['a']\"] (dotted name \"['a']\")" in message
    assert "ft.get(tree, ft.KeyPath.parse('[\"[\\'a\\']\"]'))" in message
    assert "It reads both as a printed key path and as a dotted flat-dict name" in message
    assert ft.get(both, ft.KeyPath.parse("[\"['a']\"]")) is x
    assert ft.get(both, "a") is y
    assert list(ft.to_flat_dict(both)) == ["['a']", "a"]
    # With no rival, a flat name that looks printed resolves to its own leaf.
    assert ft.get({"['a']": x}, "['a']") is x
    assert ft.get({".w": x}, ".w") is x
    # Dict keys holding dots: the flat name resolves; a nested path of the same name is ambiguous.
    assert ft.get({"a.b": x, "c": y}, "a.b") is x
    with pytest.raises(ValueError, match=r"'a\.b' names 2 different values.* Several dotted flat-dict names"):
        ft.get({"a.b": x, "a": {"b": y}}, "a.b")
    with pytest.raises(ValueError, match=r"'0' names 2 different values"):
        ft.get({0: x, "0": y}, "0")
    assert ft.get({0: x, "0": y}, "[0]") is x and ft.get({0: x, "0": y}, "['0']") is y
    with pytest.raises(ValueError, match=r"'<root>' names 2 different values"):
        ft.get({"<root>": x}, "<root>")


def test_an_unknown_dotted_name_names_the_closest_names():
    net = make_net()
    with pytest.raises(KeyError) as info:
        ft.get(net, "layers.0.weigth")
    message = info.value.args[0]
    assert "No value in this Net has the dotted name 'layers.0.weigth'" in message
    assert "the Dense at .layers[0] has no child named 'weigth' (its children: ['weight', 'bias', 'activation'])" in message
    assert "Closest names: ['layers.0.weight'" in message
    assert "right:  ft.get(tree, 'layers.0.weight')" in message
    with pytest.raises(KeyError, match=r"the Net has no child named 'lyers'"):
        ft.get(net, "lyers.0")


# ----------------------------------------------------- caches per tree definition


class Frozen(Mapping):
    """A Mapping JAX does not know (a leaf to JAX, a node to the walk)."""

    def __init__(self, **items: Any):
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_equal_tree_definitions_with_keys_of_other_types_get_their_own_names():
    one, true, half = {1: jnp.ones(1)}, {True: jnp.ones(1)}, {1.0: jnp.ones(1)}
    assert jax.tree.structure(one) == jax.tree.structure(true) == jax.tree.structure(half)
    for _ in range(2):
        assert list(ft.to_flat_dict(one)) == ["1"] and list(ft.to_flat_dict(true)) == ["True"]
        assert list(ft.to_flat_dict(half)) == ["1.0"]
        assert [str(p) for p in ft.recursively_all_key_paths(one)] == ["[1]"]
        assert [str(p) for p in ft.recursively_all_key_paths(true)] == ["[True]"]


def test_dict_insertion_order_and_unregistered_mappings_are_rechecked_on_a_cache_hit():
    ab, ba = {"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0}
    assert [str(p) for p in ft.recursively_all_key_paths(ab)] == ["['a']", "['b']"]
    assert [str(p) for p in ft.recursively_all_key_paths(ba)] == ["['b']", "['a']"]
    leaf, mapping = [jnp.ones(1)], [Frozen(w=jnp.ones(1))]
    assert jax.tree.structure(leaf) == jax.tree.structure(mapping)
    assert [str(p) for p in ft.recursively_all_key_paths(leaf)] == ["[0]"]
    assert [str(p) for p in ft.recursively_all_key_paths(mapping)] == ["[0]", "[0]['w']"]
    assert ft.recursively_all_key_paths(mapping, to=jax.Array) == [ft.KeyPath.parse("[0]['w']")]


class Loop(ft.Module):
    """A module built holding itself: immutable afterwards, but a cycle."""

    inner: tuple

    def __init__(self):
        self.inner = (jnp.ones(1), self)


def test_cycles_are_found_before_any_flatten_also_in_frozen_looking_trees():
    loop = Loop()
    for call in (ft.to_flat_dict, ft.recursively_all_key_paths, ft.recursively_all_writable_key_paths):
        with pytest.raises(ValueError, match=r"the Loop at \.inner\[1\] is the same object as its ancestor at <root>"):
            call(loop)
    cyclic = [jnp.ones(1)]
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match=r"the list at \[1\] is the same object"):
        ft.to_flat_dict(cyclic)
    shared = Dense(jnp.ones((2, 2)), jnp.ones(2))
    tied = ft.nn.Sequential(Inner(shared.weight), Inner(shared.weight))  # shared leaves: no cycle
    assert list(ft.to_flat_dict(tied)) == ["layers.0.w", "layers.1.w"]


def test_dotted_names_through_sequences_take_canonical_indices_negative_from_the_end():
    model = {"layers": [jnp.ones(1), jnp.zeros(2)]}
    assert ft.get(model, "layers.1").shape == (2,)
    assert ft.get(model, "layers.-1") is model["layers"][1]  # as the key path ['layers'][-1]
    assert ft.key_path(model, "layers.-2") == ft.KeyPath.parse("['layers'][-2]")
    assert ft.set(model, "layers.-1", jnp.ones(2))["layers"][1].tolist() == [1.0, 1.0]
    for wrong in ("layers.01", "layers.-0", "layers.-3", "layers.+1", "layers.2", "layers.١"):
        with pytest.raises(KeyError, match="has no child named"):
            ft.get(model, wrong)


def test_a_stack_member_counts_from_the_end_in_dotted_names_and_its_error_keeps_the_path():
    h = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 12, key=jax.random.key(0))
    model = {"h": h, "head": {"bias": jnp.ones(1)}}
    np.testing.assert_array_equal(ft.get(model, "h.-1.bias"), h.layers.bias[11])
    np.testing.assert_array_equal(ft.get(model, "h.-12.weight"), h.layers.weight[0])
    assert ft.key_path(model, "h.-1.bias") == ft.KeyPath.parse("['h'][-1].bias")
    moved = ft.set(model, "h.-1.bias", jnp.full(2, 5.0))["h"].layers.bias
    np.testing.assert_array_equal(moved[11], [5.0, 5.0])
    np.testing.assert_array_equal(moved[:11], h.layers.bias[:11])
    # The error advertised negative indices that dotted names refused, and its fix dropped
    # the rest of the path ('h.11' for 'h.12.bias').
    for text in ("h.12.bias", "['h'][12].bias"):
        with pytest.raises(IndexError, match=(
                r"member 12 does not exist; the Stack holds 12 members \(0 to 11, or -12 to -1 "
                r"from the end, in a key path or a dotted name: 'h.-1.bias'\)\.\n"
                r"    wrong:  ft.get\(model, 'h.12.bias'\)\n    right:  ft.get\(model, 'h.11.bias'\)")):
            ft.get(model, text)
    with pytest.raises(IndexError, match=r"right:  ft.get\(model, 'h.-12.weight'\)"):
        ft.set(model, "h.-13.weight", jnp.zeros((2, 2)))
