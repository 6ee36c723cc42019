"""The naming layer's properties over odd trees (functree/_naming.py): the dict key "", dotted
keys, Stacks of tied blocks, a tie whose target comes first: every leaf keeps its own
name, a pattern selects what the same pattern selects on the unstacked tree, and a tree
whose names collide is refused, never silently merged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _errors import raises_named
from _hypothesis import examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

import functree as ft
from functree import _naming, _stacked
from functree._naming import TIE_SPLIT


class Pair(ft.Module):
    emb: ft.nn.Dense
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.emb(x))


class Two(ft.Module):
    a: jax.Array
    b: jax.Array


def dense_stack(n, seed):
    return ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), n, key=jax.random.key(seed))


def tied_pair(key, transposed):
    k1, k2 = jax.random.split(key)
    tie = ("emb.weight", jnp.transpose) if transposed else "emb.weight"
    return ft.nn.Shared(Pair(ft.nn.Dense(3, 3, key=k1), ft.nn.Dense(3, 3, key=k2)), {"head.weight": tie})


def jax_names(tree):
    return [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def chosen(selection):
    """The names of the leaves a selection picks (wholly or some members)."""
    return sorted(k for k, v in ft.to_flat_dict(selection).items() if np.any(v))


# ------------------------------------------------------------------ 1, 5: the key "" and dotted keys
KEYS = st.sampled_from(["", "a", "b", "layers", "0", "model", "a.b", "layers.weight"])


@st.composite
def node(draw, depth=0):
    kind = draw(st.sampled_from(["array", "stack", "shared"] + (["dict"] * 2 if depth < 2 else [])))
    seed = draw(st.integers(0, 100))
    if kind == "array":
        return jnp.full((2,), float(seed))
    if kind == "stack":
        return dense_stack(draw(st.integers(1, 3)), seed)
    if kind == "shared":
        return ft.nn.Shared(Two(jnp.full((2,), float(seed)), jnp.zeros(2)), {"b": "a"})
    keys = draw(st.lists(KEYS, min_size=1, max_size=3, unique=True))
    return {k: draw(node(depth + 1)) for k in keys}


def ambiguous(names):
    """Whether a pattern cannot tell some of ``names`` apart (the grammar's reference): two
    equal, one a dotted prefix of another, or a node's name another's with a leading dot."""
    if len(set(names)) != len(names):
        return True
    spans = {}
    for j, n in enumerate(names):
        parts = n.split(".")
        for end in range(1, len(parts) + 1):
            spans.setdefault(".".join(parts[:end]), set()).add(j)
    full = {n: j for j, n in enumerate(names)}
    if any(spans.get(n, {j}) != {j} for n, j in full.items()):
        return True
    return any(("." + s) in spans and spans["." + s] != owners for s, owners in spans.items())


@settings(max_examples=examples(100), deadline=None)
@given(st.dictionaries(KEYS, node(), min_size=1, max_size=3))
@example({"": {"": jnp.zeros(2), "a": jnp.zeros(2)}})  # "." names a leaf and the node over it and ".a"
def test_every_leaf_keeps_its_name_and_a_pattern_selects_it_alone_or_the_tree_is_refused(tree):
    leaves = jax.tree.leaves(tree)
    try:
        flat = ft.to_flat_dict(tree)
    except ValueError as e:  # two leaves of one name: refused, never one dropped
        assert "share the dotted name" in str(e)
        assert len(set(jax_names(tree))) < len(leaves)
        return
    assert list(flat) == jax_names(tree)  # the naming layer's names are JAX's, the key "" kept
    back = ft.from_flat_dict(tree, flat)
    for a, b in zip(jax.tree.leaves(back), leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    members = list(ft.to_flat_dict(tree, unstack=True))
    try:
        ft.select(tree, "*")
    except ValueError as e:
        assert "cannot tell them apart" in str(e)
        assert ambiguous(list(flat) + members)
        return
    assert not ambiguous(list(flat) + [m for m in members if m not in flat])
    for name in flat:  # a leaf's name selects that leaf and nothing else
        assert chosen(ft.select(tree, name)) == [name]
    for name in members:
        picked = ft.to_flat_dict(ft.select(_stacked.expand(tree), name))
        assert [k for k, v in picked.items() if v] == [name]


def test_the_leaf_named_dot_beside_a_sibling_under_the_key_empty_is_refused():
    # "." is the leaf [""][""] and, written with its leading dot, the node [""] over both
    # leaves: ft.select(tree, ".") picked the sibling too (freezing or decaying a leaf not named).
    tree = {"": {"": jnp.zeros(2), "a": jnp.ones(2)}}
    with pytest.raises(ValueError, match=r"named '\.a' and the leaf at \[''\]\[''\] is named '\.'.*'\.' selects both"):
        ft.select(tree, ".")
    ft.select({"": {"": jnp.zeros(2)}}, ".")  # alone under the key "", "." is that one leaf either way


def test_a_stack_under_the_key_empty_keeps_its_leaves_and_member_names():
    tree = {"": dense_stack(3, 0), "x": {"weight": jnp.full((3, 2, 2), 7.0)}}
    flat = ft.to_flat_dict(tree)
    assert list(flat) == [".layers.weight", ".layers.bias", "x.weight"]  # 3 leaves, 3 names
    infos = _naming.leaf_infos(tree)
    assert _naming.member_names(infos[0]) == [".0.weight", ".1.weight", ".2.weight"]
    assert list(ft.to_flat_dict(tree, unstack=True))[:2] == [".0.weight", ".0.bias"]
    picked = ft.select(tree, ".1.weight")[""].layers.weight
    np.testing.assert_array_equal(picked, [False, True, False])
    back = ft.from_flat_dict(tree, flat)
    np.testing.assert_allclose(back[""].layers.weight, tree[""].layers.weight, rtol=0, atol=0)
    shared = {"": ft.nn.Shared(Two(jnp.ones(2), jnp.ones(2)), {"b": "a"}), "model": {"a": jnp.full((2,), 5.0)}}
    assert list(ft.to_flat_dict(shared)) == [".model.a", "model.a"]


# ------------------------------------------------------------------ 2: a Stack of tied blocks
PATTERNS = ["h.1.head.weight", "h.1.emb.weight", "h.*.head.weight", "*.head.weight", "*.head.*", "h.[0-1].head.*",
            "h.0", "*.emb.*", "h.1.model.emb.weight", "*.bias", "*"]


@settings(max_examples=examples(12), deadline=None)
@given(st.integers(2, 3), st.booleans(), st.sampled_from(PATTERNS), st.sampled_from(["", "*.head.*", "h.0.*"]))
def test_a_stack_of_tied_blocks_selects_as_the_blocks_one_by_one(n, transposed, pattern, exclude):
    blocks = [tied_pair(k, transposed) for k in jax.random.split(jax.random.key(n), n)]
    stacked = {"h": ft.nn.Stack.from_layers(blocks)}
    listed = {"h": blocks}
    excluded = [exclude] if exclude else []

    def select(tree):
        try:
            return ft.to_flat_dict(ft.select(tree, pattern, exclude=excluded))
        except ValueError as e:
            return str(e).split(":")[1]

    got, want = select(stacked), select(listed)
    if isinstance(want, str):
        assert got == want
        return
    for name, value in got.items():  # h.layers.model.emb.weight: one bool per block
        members = np.broadcast_to(value, (n,))
        expected = [want[name.replace("layers", str(i), 1)] for i in range(n)]
        np.testing.assert_array_equal(members, expected, err_msg=f"{pattern} {name}")


def test_groups_treat_a_tied_weight_alike_inside_and_outside_a_stack():
    """A group glob selecting a tie by its target's name only (``"*.head.*"``: ``head.weight``,
    not ``emb.weight``) is refused alike inside and outside a Stack (torch's recipes put it
    in either group); named by its own name, the tie is in the head's group alike."""
    blocks = [tied_pair(k, False) for k in jax.random.split(jax.random.key(0), 2)]
    for model, weight, fix in [({"h": blocks[0]}, lambda u: u["h"].model.emb.weight, ("h.head.bias", "h.emb.weight")),
                               ({"h": ft.nn.Stack.from_layers(blocks)}, lambda u: u["h"].layers.model.emb.weight,
                                ("h.*.head.bias", "h.*.emb.weight"))]:
        params = ft.parameters(model)
        right = "{" + ", ".join(f"{p!r}: tx" for p in fix) + "}, default=...)"
        raises_named(lambda p=params: ft.optim.groups({"*.head.*": optax.sgd(0.0)}, default=optax.sgd(1.0)).init(p),
                     ValueError, TIE_SPLIT, right)
        tx = ft.optim.groups({p: optax.sgd(0.0) for p in fix}, default=optax.sgd(1.0))
        updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
        np.testing.assert_allclose(weight(updates), 0.0, rtol=0, atol=0)  # the head's group: sgd(0)


def test_a_transformed_tie_in_a_stack_loads_through_each_members_target_name():
    stacked = {"h": ft.nn.Stack.from_layers([tied_pair(k, True) for k in jax.random.split(jax.random.key(1), 2)])}
    flat = {k: v for k, v in ft.to_flat_dict(stacked, unstack=True).items() if not k.endswith("emb.weight")}
    given = [np.arange(9.0, dtype=np.float32).reshape(3, 3) + 10 * i for i in range(2)]
    for i in range(2):
        flat[f"h.{i}.head.weight"] = given[i]
    back = ft.from_flat_dict(stacked, flat)
    for i in range(2):  # the head's weight is the embedding's transpose: the source holds given.T
        np.testing.assert_allclose(back["h"].layers.model.emb.weight[i], given[i].T, rtol=0, atol=0)


# ------------------------------------------------------------------ 3: a tie whose target comes first
class HeadFirst(ft.Module):
    head: ft.nn.Dense  # the tie's target, before its source in flatten order
    embed: ft.nn.Embedding


class EmbedFirst(ft.Module):
    embed: ft.nn.Embedding
    head: ft.nn.Dense


@pytest.mark.parametrize("cls", [HeadFirst, EmbedFirst])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("strict", [True, False])
def test_a_value_under_the_tie_targets_name_lands_on_its_source(cls, transposed, strict):
    e, h = ft.nn.Embedding(3, 3, key=jax.random.key(1)), ft.nn.Dense(3, 3, key=jax.random.key(2))
    parts = {"head": h, "embed": e}
    tie = ("embed.embeddings", jnp.transpose) if transposed else "embed.embeddings"
    lm = ft.nn.Shared(cls(**parts), {"head.weight": tie})
    new = np.arange(9.0, dtype=np.float32).reshape(3, 3)
    out = ft.from_flat_dict(lm, {"head.weight": new, "model.head.bias": np.zeros(3, np.float32)}, strict=strict)
    tree = out if strict else out[0]
    if not strict:
        assert out[1].ok, out[1]
    np.testing.assert_allclose(tree.model.embed.embeddings, new.T if transposed else new, rtol=0, atol=0)
    assert _naming.resolve_alias(lm, "head.weight") == "model.embed.embeddings"


_DIGIT = st.integers(0, 9).map(str)
_ITEM = st.one_of(_DIGIT, st.tuples(_DIGIT, _DIGIT).map(lambda ab: "-".join(sorted(ab))))  # "7" or "2-5"


def _one_number_range(content):
    """Whether a class's content is one range of numbers as layers are named, one of them of
    several digits ("10-15", "0-15"): what MULTI_DIGIT_RANGE refuses."""
    lo, dash, hi = content.partition("-")
    numbers = [n for n in (lo, hi) if n.isdigit() and (n == "0" or not n.startswith("0"))]
    return bool(dash) and len(numbers) == 2 and max(map(len, numbers)) > 1


@settings(max_examples=examples(60), deadline=None)
@given(st.booleans(), st.lists(_ITEM, min_size=1, max_size=4))
def test_a_class_of_digits_and_ranges_selects_as_fnmatch_reads_it_unless_it_is_one_number_range(negated, items):
    """Property: a class mixing literal digits and ranges ("[05-9]", "[0-35-9]", "[!3-47]")
    passes the check and selects the names fnmatch.fnmatchcase selects; only a class that is
    one number range of several digits ("[10-15]", "[!0-15]") is refused, naming the class."""
    import fnmatch
    import re

    content = "".join(items)
    pattern = "layers.[" + "!" * negated + content + "].w"
    if _one_number_range(content):
        with pytest.raises(ValueError, match=re.escape(f"holds the character class '[{'!' * negated}{content}]'")):
            _naming.check_patterns([pattern])
        return
    _naming.check_patterns([pattern])
    names = [f"layers.{n}.w" for n in range(12)]
    assert [_naming.matches(n, pattern) for n in names] == [fnmatch.fnmatchcase(n, pattern) for n in names]
