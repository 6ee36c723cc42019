"""Property tests of key paths and flat dicts on random trees with arbitrary dict keys.

Keys hold quotes, backslashes, control characters, dots, brackets and unicode, so printed
key paths must round-trip exactly and a string must never resolve to a different value.
"""

from __future__ import annotations

import re
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import example, given, settings
from test_paths import Carry, Pair, _quietly, arrays, assert_same_tree

import functree as ft
from functree import _paths, _state_dict
from functree._key_entries import ATTR, INDEX, KEY, Entry, mapping_entry
from functree._tree import dotted_name

SETTINGS = settings(max_examples=examples(50), deadline=None)

# Keys chosen to collide: a printed path ("['a']", ".a", "[0]"), dots, the root's names.
TRICKY = ["a", "a.b", "['a']", '["a"]', ".a", "[0]", "0", "<root>", "", "b", "'", '"', "\\", "\n"]
STR_KEYS = st.one_of(st.sampled_from(TRICKY), st.text(max_size=4))
INT_KEYS = st.integers(-3, 3)


def trees() -> st.SearchStrategy:
    """Nested dicts (all-str or all-int keys), lists, tuples and Modules of array and float leaves."""
    leaves = st.one_of(arrays(), st.floats(-10, 10, allow_nan=False, width=32))

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(
            st.dictionaries(STR_KEYS, children, min_size=1, max_size=3),
            st.dictionaries(INT_KEYS, children, min_size=1, max_size=2),
            st.dictionaries(INT_KEYS.map(np.int64), children, min_size=1, max_size=2),  # np.unique's keys
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=2).map(tuple),
            st.builds(_quietly(Pair), children, children, st.sampled_from(["p", "q"])),
            st.builds(_quietly(Carry), children, st.one_of(st.none(), arrays())),
        )

    return st.recursive(leaves, extend, max_leaves=6)


def readings(tree: Any, text: str, all_paths: list[ft.KeyPath]) -> set[ft.KeyPath]:
    """The key paths ``text`` names in ``tree`` by ``ft.key_path``'s rule: every path whose
    dotted name it is, and the key path it prints (``ft.KeyPath.parse``: keys in any Python
    quoting, ``["a"]`` is ``['a']``) where that reaches a value."""
    found = {p for p in all_paths if p.name == text}
    try:
        printed = ft.KeyPath.parse(text)
        printed.get(tree)
    except (ValueError, KeyError):
        return found
    return found | {printed}


def assert_resolves_to(tree: Any, text: str, kp: ft.KeyPath, all_paths: list[ft.KeyPath]) -> None:
    """``text`` resolves to ``kp`` when that is its one reading; else it raises as ambiguous."""
    names = readings(tree, text, all_paths)
    assert kp in names
    if names == {kp}:
        assert ft.key_path(tree, text) == kp
    else:
        with pytest.raises(ValueError, match="different values in this tree"):
            ft.key_path(tree, text)


# ----------------------------------------------------------------- printing and parsing


entries = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True).map(lambda k: Entry(ATTR, k)),
    st.integers(-(10**6), 10**6).map(lambda k: Entry(INDEX, k)),
    st.text().map(lambda k: Entry(KEY, k)),
    st.one_of(st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.none(), st.tuples(st.integers(), st.text(max_size=3)))
    .map(lambda k: Entry(KEY, k)),
    # keys as NumPy gives them (np.unique's) and infinite floats: entries of their dicts (mapping_entry)
    st.one_of(st.integers(-(10**6), 10**6).map(np.int64), st.text(max_size=3).map(np.str_),
              st.binary(max_size=3).map(np.bytes_),
              st.floats(allow_nan=False, width=32).map(np.float32), st.booleans().map(np.bool_),
              st.sampled_from([float("inf"), float("-inf")])).map(mapping_entry),
    # infinities inside a key: a tuple's float, a complex number's part (repr prints names)
    st.one_of(st.tuples(st.floats(allow_nan=False), st.integers()), st.complex_numbers(allow_nan=False)).map(mapping_entry),
)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(entries, max_size=5))
# printed as np.int64(3), np.str_('a'), inf: no literal, so KeyPath.parse refused what str(kp) printed
@example([mapping_entry(np.int64(3)), mapping_entry(np.str_("a")), mapping_entry(float("inf"))])
# printed as (inf, 1) and (1-infj): no literal inside the brackets, refused
@example([mapping_entry((float("inf"), 1)), mapping_entry(complex(1, float("-inf"))), mapping_entry(complex(float("-inf"), 0))])
# NumPy text keys with trailing NULs: .item() dropped them, printed ['a'] and [b''] for other keys
@example([mapping_entry(np.str_("a\x00")), mapping_entry(np.str_("\x00")), mapping_entry(np.bytes_(b"\x00"))])
def test_printed_key_paths_parse_back_exactly(path_entries: list[Entry]):
    kp = ft.KeyPath(path_entries)
    assert ft.KeyPath.parse(str(kp)) == kp
    assert ft.key_path(None, str(kp)) == kp
    assert eval(repr(kp), {"KeyPath": ft.KeyPath.parse}) == kp  # repr shows the printed form


# ----------------------------------------------------------------- get, set, names


@SETTINGS
@given(trees())
# A dict key that reads as a printed key path in another quoting, or as another dotted name.
@example({"a": 0.0, '["a"]': 0.0})  # '["a"]' prints ['a'] and is the dotted name of ['["a"]']
@example({"a": 0.0, "['a']": 0.0})
@example({"'": 0.0, '["\'"]': 0.0, '"': 0.0, "['\"']": 0.0})  # either quote inside the key
@example({"a": {"b": 0.0}, "a.b": 0.0})  # two dotted names a.b
@example({"": {"a": 0.0}, ".a": 0.0, "a": 0.0})  # a leading dot: .a is no attribute of a dict
@example({"[0]": 0.0, "0": 0.0})  # [0] prints an index a str-keyed dict lacks
@example([{"[0]": 0.0}, 0.0])
@example(_quietly(Pair)({".left": 0.0}, {"['right']": 0.0}))
@example({"": 0.0, "<root>": 0.0})  # the root's printed forms
def test_every_path_and_its_strings_reach_their_own_value(tree: Any):
    paths = ft.recursively_all_key_paths(tree)
    for kp in paths:
        value = kp.get(tree)
        assert ft.get(tree, kp) is value
        assert ft.KeyPath.parse(str(kp)) == kp
        assert_resolves_to(tree, str(kp), kp, paths)
        assert_resolves_to(tree, kp.name, kp, paths)


@SETTINGS
@given(trees())
def test_set_then_get_returns_the_new_value_and_leaves_the_others(tree: Any):
    leaf_paths = ft.recursively_all_writable_key_paths(tree, to=jax.Array)
    for kp in leaf_paths:
        old = kp.get(tree)
        new_value = jnp.zeros_like(old) if old.dtype != jnp.bool_ else ~old
        new = ft.set(tree, kp, new_value)
        assert ft.get(new, kp) is new_value
        assert jax.tree.structure(new) == jax.tree.structure(tree)
        for other in leaf_paths:
            if other != kp:
                assert other.get(new) is other.get(tree)


@SETTINGS
@given(trees())
def test_scalar_leaves_reject_strings_complex_numbers_and_arrays(tree: Any):
    for kp in ft.recursively_all_writable_key_paths(tree, to=float):
        assert ft.get(ft.set(tree, kp, 2), kp) == 2.0 and isinstance(ft.get(ft.set(tree, kp, 2), kp), float)
        for bad in ("1.0", 1 + 2j, jnp.ones(5)):
            with pytest.raises(ValueError, match=r"the value there is a Python float"):
                ft.set(tree, kp, bad)
    for kp in ft.recursively_all_writable_key_paths(tree, to=jax.Array):
        with pytest.raises(ValueError, match=re.escape(f"ft.set({kp})")):
            ft.set(tree, kp, "not an array")


# ----------------------------------------------------------------- flat dicts


@SETTINGS
@given(trees())
def test_flat_dict_round_trips_or_names_the_colliding_leaves(tree: Any):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in leaves]
    try:
        flat = ft.to_flat_dict(tree)
    except ValueError as error:
        assert "share the dotted name" in str(error)
        assert len(frozenset(names)) < len(names)
        return
    assert len(flat) == len(leaves)
    assert_same_tree(ft.from_flat_dict(tree, flat), tree)
    # float64 NumPy copies of every leaf come back in the template's dtypes with cast=True.
    wide = {k: np.asarray(v, np.float64) if jnp.issubdtype(jnp.result_type(v), jnp.floating) else v
            for k, v in flat.items()}
    assert_same_tree(ft.from_flat_dict(tree, wide, cast=True), tree)


# ----------------------------------------------------- caches per tree definition


def _uncached_flat(tree: Any) -> dict[str, Any] | None:
    """to_flat_dict as it was before its cache: JAX's paths named one by one."""
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = {dotted_name(p): leaf for p, leaf in path_leaves}
    return flat if len(flat) == len(path_leaves) else None


def _reordered(tree: Any) -> Any:
    """The same tree definition, new leaves, and every dict's keys in JAX's (sorted) order."""
    return jax.tree.map(lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) else x, tree)


@SETTINGS
@given(trees())
def test_cached_and_uncached_key_paths_and_flat_dicts_agree(tree: Any):
    _paths._WALKS.clear()
    _state_dict._NAMES.clear()
    for t in (tree, tree, _reordered(tree), tree):  # a miss, a hit, a twin, the first again
        for writable in (False, True):
            listed = ft.recursively_all_writable_key_paths if writable else ft.recursively_all_key_paths
            walked = list(_paths.walk(t, writable=writable))
            assert listed(t) == [p for p, _ in walked]
            for to in (jax.Array, jnp.float32, Pair, float):
                keep = _paths._type_filter(to)
                assert listed(t, to=to) == [p for p, v in walked if keep(v)]
        expected = _uncached_flat(t)
        if expected is None:
            with pytest.raises(ValueError, match="share the dotted name"):
                ft.to_flat_dict(t)
            continue
        flat = ft.to_flat_dict(t)
        assert list(flat) == list(expected) and all(flat[k] is v for k, v in expected.items())
