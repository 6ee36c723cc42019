"""Checkpoints of random trees: every round trip bit for bit, every template that differs refused.

Trees are drawn as a user builds them: frozen Modules with parameter, no-derivative and
static fields (ints, floats, text, None, tuples), nested in tuples, lists and dicts, with
leaves of every dtype a checkpoint holds (zero-size and 0-d arrays, NumPy scalars, Python
numbers, None). A tree read back, with or without a template, has the saved treedef (classes
and static values), dtypes, shapes and bytes; a template off in one leaf's shape or dtype is
a CheckpointError naming that leaf. Exploring (``--hypothesis-profile=explore``) draws ten
times as many. The tests after the two properties pin what exploring found (about 1,500
trees, 850 mismatched templates, and the odd leaves, keys and static values they led to).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functree as ft
from functree.train import CheckpointError

# The drawn Modules hold any leaf in their parameter fields (a bool, an int array): as a user
# may, after the warning that it will be carried, not trained.
pytestmark = pytest.mark.filterwarnings("ignore::functree.NonDifferentiableFieldWarning")


class Cell(ft.Module):
    w: object
    buffer: object = ft.field(no_derivative=True)
    n: int = ft.field(static=True, default=1)
    name: str = ft.field(static=True, default="cell")
    rate: float = ft.field(static=True, default=0.5)
    option: object = ft.field(static=True, default=None)


class Wrapper(ft.Module):
    child: object
    extra: object = None
    tag: tuple = ft.field(static=True, default=(1, "a"))


DTYPES = ["float32", "bfloat16", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "bool",
          "complex64"]


def _array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bits of ``dtype`` (NaNs and infinities included for the floating ones)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(jnp.dtype(dtype))
    raw = rng.integers(0, 256, math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return (raw % 2).astype(bool).reshape(shape) if dtype == "bool" else raw.view(dt).reshape(shape)


@st.composite
def _arrays(draw):
    a = _array(draw(st.sampled_from(DTYPES)), tuple(draw(st.lists(st.integers(0, 3), max_size=3))),
               draw(st.integers(0, 2**16)))
    return jnp.asarray(a) if draw(st.booleans()) and a.dtype.itemsize < 8 else a  # (no 64-bit jax array without x64)


@st.composite
def _leaf(draw):
    kind = draw(st.sampled_from(["array", "array", "scalar", "int", "float", "bool", "none"]))
    if kind == "array":
        return draw(_arrays())
    if kind == "scalar":
        return _array(draw(st.sampled_from(DTYPES)), (), draw(st.integers(0, 99)))[()]
    return draw({"int": st.integers(-2**63, 2**63 - 1), "float": st.floats(), "bool": st.booleans(),
                 "none": st.none()}[kind])


_STATIC = st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=False), st.text(max_size=4), st.none(),
                    st.booleans(), st.tuples(st.integers(-9, 9), st.text(max_size=2)))


def _trees():
    def nodes(children):
        return st.one_of(
            st.lists(children, max_size=3).map(tuple),
            st.lists(children, max_size=3),
            st.dictionaries(st.text("ab_", min_size=1, max_size=3), children, max_size=3),
            st.dictionaries(st.integers(-3, 3), children, max_size=2),
            st.builds(Cell, children, children, st.integers(-5, 5), st.text(max_size=3),
                      st.floats(allow_nan=False, allow_infinity=False), _STATIC),
            st.builds(Wrapper, children, children),
        )
    return st.recursive(_leaf(), nodes, max_leaves=6)


def assert_identical(saved, back):
    """Same treedef (classes, static values, dict keys), and each leaf of the same type,
    dtype, shape and bytes (a Python float by its bits: NaN and -0.0 too)."""
    assert jax.tree.structure(back) == jax.tree.structure(saved)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(back), strict=True):
        where = jax.tree_util.keystr(path)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            assert isinstance(y, (jax.Array, np.ndarray, np.generic)), (where, type(y))
            assert not isinstance(x, np.generic) or type(y) is type(x), (where, type(x), type(y))
            assert (y.dtype, y.shape) == (x.dtype, x.shape), (where, y.dtype, y.shape, x.dtype, x.shape)
            assert np.asarray(y).tobytes() == np.asarray(x).tobytes(), where
        else:
            assert type(y) is type(x), (where, type(x), type(y))
            assert np.asarray(y, np.float64 if isinstance(x, float) else None).tobytes() == \
                np.asarray(x, np.float64 if isinstance(x, float) else None).tobytes(), (where, x, y)


_count = itertools.count()


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
@given(tree=_trees())
def test_random_trees_round_trip_bit_for_bit_with_and_without_a_template(tmp_path, tree):
    path = tmp_path / str(next(_count))
    ft.train.save(path, tree)
    assert_identical(tree, ft.train.load(path))
    assert_identical(tree, ft.train.load(path, tree))


_OTHER_DTYPE = {"float32": "bfloat16", "bfloat16": "float16", "float16": "float32", "float64": "float32", "int8": "uint8",
                "int16": "int8", "int32": "uint32", "int64": "int32", "uint8": "int8", "uint32": "int32", "bool": "uint8",
                "complex64": "float32"}


@settings(max_examples=examples(5), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
@given(tree=st.tuples(_trees(), _arrays()), which=st.integers(0, 99), change=st.sampled_from(["shape", "dtype"]))
def test_a_template_off_in_one_leaf_is_refused_naming_it(tmp_path, tree, which, change):
    """Never a crash inside orbax or JAX, never a silent cast: a CheckpointError naming the leaf."""
    names = list(ft.to_flat_dict(tree))
    leaves = jax.tree.leaves(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
    i = arrays[which % len(arrays)]
    x = np.asarray(leaves[i])
    # (a template's values are never read: zeros, as casting the drawn values warned of
    # overflow or a dropped imaginary part under the explore profile's draws)
    other = np.zeros((*x.shape, 1) if change == "shape" else x.shape,
                     x.dtype if change == "shape" else jnp.dtype(_OTHER_DTYPE[x.dtype.name]))
    template = jax.tree.unflatten(jax.tree.structure(tree), [other if k == i else y for k, y in enumerate(leaves)])
    path = tmp_path / str(next(_count))
    ft.train.save(path, tree)
    with pytest.raises(CheckpointError, match="does not fit the template") as info:
        ft.train.load(path, template)
    assert f"{names[i]}: expected shape {other.shape} dtype {other.dtype}" in str(info.value)


def test_a_zero_size_64_bit_array_keeps_its_dtype(tmp_path):
    """A zero-size float64/int64/uint64 NumPy array (stored by its shape and dtype alone) came
    back as float32/int32/uint32 without a template (jnp.zeros without x64), and its own tree
    as the template was refused; it comes back on the host, as a 64-bit array of any size."""
    tree = {"f": np.zeros((0, 3)), "i": np.zeros(0, np.int64), "u": np.zeros((2, 0), np.uint64),
            "full": np.arange(3, dtype=np.int64)}
    ft.train.save(tmp_path / "t", tree)
    for back in (ft.train.load(tmp_path / "t"), ft.train.load(tmp_path / "t", tree)):
        assert_identical(tree, back)


@pytest.mark.parametrize("field, saved, mine", [("n", 1, True), ("rate", 1.0, 1), ("rate", 0.0, -0.0),
                                                ("option", (1, 2), (1, 2.0))], ids=["1-True", "1.0-1", "0.0--0.0", "tuple"])
def test_a_static_value_equal_to_the_saved_one_but_not_it_is_refused(tmp_path, field, saved, mine):
    """``==`` compared the saved static values with the template's: the template's True, 1,
    -0.0 or (1, 2.0) replaced the saved 1, 1.0, 0.0 or (1, 2) silently (``int_array * 1.0`` is
    a float array, ``1 / -0.0`` is -inf)."""
    ft.train.save(tmp_path / "t", Cell(jnp.ones(2), jnp.zeros(1), **{field: saved}))
    with pytest.raises(CheckpointError, match="was saved with other static configuration") as info:
        ft.train.load(tmp_path / "t", Cell(jnp.ones(2), jnp.zeros(1), **{field: mine}))
    assert f"    {field}: saved {saved!r}, the template's {mine!r}" in str(info.value)


def test_a_nan_static_value_reads_into_its_own_template(tmp_path):
    """A NaN static value (``nan != nan``) was a difference from every template, its own too."""
    tree = Cell(jnp.ones(2), jnp.zeros(1), rate=math.nan, option=(math.nan, -0.0))
    ft.train.save(tmp_path / "t", tree)
    back = ft.train.load(tmp_path / "t", Cell(jnp.ones(2), jnp.zeros(1), rate=math.nan, option=(math.nan, -0.0)))
    assert math.isnan(back.rate) and math.isnan(back.option[0]) and math.copysign(1.0, back.option[1]) == -1.0


@pytest.mark.parametrize("saved, template", [
    (jax.random.key(0), jax.random.key(0, impl="rbg")),  # another PRNG implementation
    (jax.random.PRNGKey(0), jax.random.key(0)),  # a raw uint32 key into a typed key
    (jax.random.key(0), jax.random.split(jax.random.key(0), 2)),  # one key into two
], ids=["rbg", "raw", "split"])
def test_a_prng_key_template_of_another_kind_is_refused_naming_the_leaf(tmp_path, saved, template):
    """A typed PRNG key's template crashed in the mismatch report's hint (``np.dtype('key<fry>')``:
    TypeError "Cannot interpret 'key<fry>' as a data type")."""
    ft.train.save(tmp_path / "k", {"key": saved})
    with pytest.raises(CheckpointError, match="does not fit the template") as info:
        ft.train.load(tmp_path / "k", {"key": template})
    assert f"key: expected shape {template.shape} dtype {template.dtype}" in str(info.value)


def test_a_dict_keyed_by_empty_text_reads_into_its_own_template(tmp_path):
    """The leaf at key path "" is stored as "value" (no name orbax takes); read against a
    template it was looked for by its stored name: "missing keys: [''], unexpected keys: ['value']"."""
    tree = {"": jnp.arange(2.0), "b": {"": jnp.ones(1, jnp.int8)}}
    ft.train.save(tmp_path / "t", tree)
    assert_identical(tree, ft.train.load(tmp_path / "t", tree))
    with ft.train.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, tree)
        assert_identical(tree, manager.restore(template=tree).model)


def test_a_dict_key_that_is_no_unicode_is_refused_before_anything_is_written(tmp_path):
    """A key with a lone surrogate (bytes decoded with surrogateescape) crashed orbax's writer
    thread: RuntimeError "Unable to cast Python instance of type <class 'str'> to C++ type"."""
    with pytest.raises(CheckpointError, match=r"(?s)The dict at 'model' has the key 'caf\\udce9', text that is no "
                                              r"Unicode.*Nothing was written.*right:  \{'caf\?': value\}"):
        ft.train.save(tmp_path / "t", {"model": {"caf\udce9": jnp.ones(1)}})
    assert not any(tmp_path.iterdir())


class Scaled(ft.Module):
    scale: jax.Array = ft.field(no_derivative=True)

    def __call__(self, x):
        return x * self.scale


def test_a_weakly_typed_array_is_read_back_weakly_typed(tmp_path):
    """``jnp.asarray(0.5)`` (a Python number's array, weakly typed) came back strong: the
    restored model's ``bfloat16_x * scale`` was a float32 array, the saved one's bfloat16."""
    model = Scaled(jnp.asarray(0.5))
    ft.train.save(tmp_path / "m", model)
    x = jnp.ones(2, jnp.bfloat16)
    for back in (ft.train.load(tmp_path / "m"), ft.train.load(tmp_path / "m", model)):
        assert back.scale.weak_type and back(x).dtype == jnp.bfloat16
