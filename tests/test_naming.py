"""The naming layer (functree/_naming.py): names, member names, tie aliases, one glob semantics."""

import re
import tempfile

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _errors import raises_named
from _hypothesis import examples
from hypothesis import given, settings
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import functree as ft
from functree import _naming


class Block(ft.Module):
    up: ft.nn.Dense
    norm: ft.nn.LayerNorm

    def __init__(self, d, *, key):
        self.up = ft.nn.Dense(d, d, jax.nn.tanh, key=key)
        self.norm = ft.nn.LayerNorm(d)

    def __call__(self, x):
        return self.norm(x + self.up(x))


class Net(ft.Module):
    embed: ft.nn.Dense
    h: ft.nn.Stack
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.h(self.embed(x)))


def make_net(n=4, d=3, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return Net(ft.nn.Dense(2, d, key=k1), ft.nn.Stack(lambda k: Block(d, key=k), n, key=k2),
               ft.nn.Dense(d, 1, key=k3))


class LM(ft.Module):
    embed: ft.nn.Embedding
    head: ft.nn.Dense

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def make_lm():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Shared(LM(ft.nn.Embedding(10, 4, key=k1), ft.nn.Dense(4, 10, key=k2)),
                        {"head.weight": ("embed.embeddings", jnp.transpose)})


# ------------------------------------------------------------------ names
def test_stacked_leaves_have_member_names():
    infos = _naming.leaf_infos(make_net())
    by_name = {i.name: i for i in infos}
    info = by_name["h.layers.up.weight"]
    assert info.sizes == (4,)
    assert _naming.member_names(info) == [f"h.{i}.up.weight" for i in range(4)]
    assert _naming.names(make_net()) == list(ft.to_flat_dict(make_net()))  # the names of to_flat_dict


def test_nested_stacks_have_two_member_indices():
    outer = ft.nn.Stack(lambda k: ft.nn.Stack(lambda k2: ft.nn.Dense(2, 2, key=k2), 3, key=k), 2,
                        key=jax.random.key(0))
    info = _naming.leaf_infos({"a": outer})[0]
    assert info.sizes == (2, 3)
    assert _naming.member_names(info)[:4] == ["a.0.0.weight", "a.0.1.weight", "a.0.2.weight", "a.1.0.weight"]
    chosen = ft.select({"a": outer}, "a.1.[0-1].*")["a"].layers.layers.weight
    np.testing.assert_array_equal(chosen, [[False, False, False], [True, True, False]])


def test_tied_parameter_answers_to_every_name():
    lm = make_lm()
    info = {i.name: i for i in _naming.leaf_infos(lm)}["model.embed.embeddings"]
    assert set(info.aliases) == {"embed.embeddings", "head.weight"}
    assert sorted(ft.to_flat_dict(lm)) == ["model.embed.embeddings", "model.head.bias"]  # stored once
    np.testing.assert_array_equal(ft.get(lm, "embed.embeddings"), lm.model.embed.embeddings)
    np.testing.assert_array_equal(ft.get(lm, "head.weight"), lm.model.embed.embeddings.T)
    np.testing.assert_array_equal(ft.get(lm, "head.bias"), lm.model.head.bias)
    for name in ("head.weight", "embed.embeddings", "model.embed.embeddings", "embed"):
        assert ft.select(lm, name).model.embed.embeddings is True, name
    new = ft.set(lm, "head.weight", jnp.arange(40.0).reshape(4, 10))
    np.testing.assert_array_equal(new.model.embed.embeddings, jnp.arange(40.0).reshape(4, 10).T)
    np.testing.assert_array_equal(new.resolve().head.weight, jnp.arange(40.0).reshape(4, 10))


def test_from_flat_dict_fills_a_tie_from_any_of_its_names():
    lm = make_lm()
    e = np.arange(40, dtype=np.float32).reshape(10, 4)
    bias = np.zeros(10, np.float32)
    for flat in ({"embed.embeddings": e, "head.bias": bias}, {"head.weight": e.T, "head.bias": bias},
                 {"embed.embeddings": e, "head.weight": e.T, "head.bias": bias},
                 {"model.embed.embeddings": e, "model.head.bias": bias}):
        out = ft.from_flat_dict(lm, flat)
        np.testing.assert_array_equal(out.model.embed.embeddings, e)
        np.testing.assert_array_equal(out.resolve().head.weight, e.T)


def test_tied_names_that_disagree_are_an_error_naming_both():
    e = np.ones((10, 4), np.float32)
    flat = {"embed.embeddings": e, "head.weight": 2 * e.T, "head.bias": np.zeros(10, np.float32)}
    with pytest.raises(ValueError, match=r"'embed\.embeddings' and 'head\.weight' name one tied parameter"
                                         r"(.|\n)*right:  flat\.pop\('head\.weight'\)"):
        ft.from_flat_dict(make_lm(), flat)
    with pytest.raises(ValueError, match=r"The tied head\.weight takes shape \(4, 10\)"):
        ft.from_flat_dict(make_lm(), {"head.weight": e, "head.bias": np.zeros(10, np.float32)})


def test_a_tie_without_an_inverse_is_an_error_naming_the_source():
    lm = ft.nn.Shared(LM(ft.nn.Embedding(10, 4, key=jax.random.key(0)), ft.nn.Dense(4, 10, key=jax.random.key(1))),
                      {"head.weight": ("embed.embeddings", lambda w: jnp.tanh(w.T))})
    with pytest.raises(ValueError, match=r"Cannot write head\.weight(.|\n)*ft\.set\(model, \"embed\.embeddings\""):
        ft.set(lm, "head.weight", jnp.zeros((4, 10)))
    with pytest.raises(ValueError, match=r"set the whole target or the source"):
        ft.set(lm, ".head.weight[0]", jnp.zeros(10))


# ------------------------------------------------------------------ patterns
@pytest.mark.parametrize(("pattern", "members"), [
    ("h.2.*", [2]), ("h.[0-1].*", [0, 1]), ("h.*", None), ("h", None), ("*.up.weight", None),
    ("h.3.up.weight", [3]), (".h.1.up", [1]), ("h.?.up.weight", None),
])
def test_member_patterns(pattern, members):
    chosen = ft.select(make_net(), pattern).h.layers.up.weight
    if members is None:
        assert chosen is True
    else:
        np.testing.assert_array_equal(chosen, np.isin(np.arange(4), members))


def test_glob_semantics_prefixes_and_anywhere():
    assert _naming.matches("encoder.weight", "encoder")
    assert _naming.matches("encoder.weight", ".encoder.*")
    assert not _naming.matches("encoder.weight", "weight")
    assert _naming.match_kind("1.mu.encoder.weight", "encoder.*", anywhere=True) == "suffix"
    assert _naming.match_kind("encoder.weight", "encoder.*", anywhere=True) == "direct"


def test_exclude_members_and_partial_selection_collapses():
    net = make_net()
    chosen = ft.select(net, "h.*", exclude=["h.0.*"])
    np.testing.assert_array_equal(chosen.h.layers.norm.scale, [False, True, True, True])
    assert ft.select(net, "h.[0-3].*").h.layers.up.weight is True  # every member: a bool
    flat = ft.to_flat_dict(chosen, unstack=True)  # a mask tree: per-member bools
    assert flat["h.0.up.weight"] is False and flat["h.1.up.weight"] is True and flat["embed.weight"] is False


def test_pattern_selecting_nothing_names_the_closest_names():
    with pytest.raises(ValueError, match=r"ft\.select: the pattern 'hh\.0\.up\.weight' selects no parameter\. "
                                         r"Closest names: 'h\.0\.up\.weight'"):
        ft.select(make_net(), "hh.0.up.weight")


def test_member_out_of_range_names_the_stack_length():
    for call in (lambda m: ft.select(m, "h.7.*"), lambda m: ft.gradient(lambda m: m(jnp.ones((1, 2))).sum(),
                                                                         wrt="h.7.*")(m),
                 lambda m: ft.optim.Optimizer(ft.optim.adam(), wrt="h.4").init(m)):
        with pytest.raises(ValueError, match=r"'h\.[47](\.\*)?' names member [47] of 'h', which holds 4 members "
                                             r"\(0 to 3\)(.|\n)*right:  'h\.3"):
            call(make_net())


class _Inner(ft.Module):
    b: ft.nn.Stack


def test_a_member_past_an_inner_stacks_end_or_counted_from_the_end_names_the_stack_length():
    """A Stack ``b`` (4 members) inside the Stack ``a``: ``a.1.b.4.*`` selected nothing with the
    fix ``'*.b'`` (every member of every b; the inner stack's name held member 0 of ``a``, so
    only ``a.0.b.4.*`` was named out of range); ``a.-1.*`` (a key path's index from the end,
    no member name) had the fix ``'*'``, every leaf."""
    a = {"a": ft.nn.Stack.from_layers([_Inner(ft.nn.Stack(lambda k: ft.nn.Dense(1, 1, key=k), 4, key=jax.random.key(i)))
                                       for i in range(2)])}
    for pattern, stack, index, right in [("a.1.b.4.*", "a.1.b", 4, "a.1.b.3.*"), ("a.*.b.7.bias", "a.*.b", 7, "a.*.b.3.bias"),
                                         ("a.1.b.-1.*", "a.1.b", -1, "a.1.b.3.*"), ("a.2.b.0.*", "a", 2, "a.1.b.0.*"),
                                         ("a.-1.*", "a", -1, "a.1.*")]:
        n = 2 if stack == "a" else 4
        with pytest.raises(ValueError, match=rf"(?s)'{re.escape(pattern)}' names member {index} of '{re.escape(stack)}', "
                                             rf"which holds {n} members \(0 to {n - 1}\).*right:  '{re.escape(right)}'$"):
            ft.select(a, pattern)


def test_non_string_pattern_is_an_error():
    with pytest.raises(TypeError, match=r"Patterns are strings like '\*\.bias' or 'h\.2\.\*', got 3"):
        ft.select(make_net(), "h.*", exclude=[3])


def _adamw_init(params, pattern):
    return ft.optim.Optimizer(ft.optim.adamw(1e-4), wrt=pattern).init(params)


@pytest.mark.parametrize(("pattern", "right"), [
    ("model.layers.[14-15].*", "'model.layers.1[4-5].*'"),  # the README's: fnmatch read it as [15]
    ("layers.[2-0].*", "'layers.[0-2].*'"),                # fnmatch: matches nothing
    ("layers.[8-12].*", "('layers.[8-9].*', 'layers.1[0-2].*')"),
    ("*.[z-a]", "'*.[a-z]'"), ("h.[!9-0x]", "'h.[!0-9x]'"),
    ("layers.[05-3].*", "'layers.[03-5].*'"),  # 0 and 5-3 turned round: not the numbers 3-5 (which dropped 0)
])
def test_a_character_class_with_a_reversed_range_is_refused_with_the_right_spelling(pattern, right):
    params = {"model": {"layers": [{"w": jnp.ones(2)} for _ in range(16)]}}
    for call in (lambda: ft.select(params, pattern), lambda: _adamw_init(params, pattern),
                 lambda: ft.gradient(lambda p: 0.0, wrt=pattern)(params)):
        with pytest.raises(ValueError, match=rf"The pattern {re.escape(repr(pattern))} holds the character class "
                                             rf"(.|\n)*right:  {re.escape(right)}"):
            call()


def test_the_right_spelling_of_a_number_range_selects_exactly_those_numbers():
    # the globs _number_globs writes, against Python's own range, through fnmatch
    for lo, hi in [(14, 15), (0, 2), (8, 12), (3, 117), (95, 205), (0, 0), (10, 99)]:
        globs = _naming._number_globs(lo, hi)
        hit = [n for n in range(300) if any(_naming.matches(str(n), g) for g in globs)]
        assert hit == list(range(lo, hi + 1)), (lo, hi, globs)
    params = {"model": {"layers": [{"w": jnp.ones(2)} for _ in range(16)]}}  # the README's, fixed
    state = ft.optim.Optimizer(ft.optim.adamw(1e-4), wrt="model.layers.1[45].*").init(params)
    mu = ft.to_flat_dict(ft.optim.moments(state)["mu"])
    assert [k for k, v in mu.items() if v is not None] == ["model.layers.14.w", "model.layers.15.w"]
    for fine in ("h.[0-3].*", "x[-a]", "x[a-]", "x[]-a]", "x[", "h.[!0-1].*"):  # no reversed range
        _naming.check_patterns([fine])


# ------------------------------------------------------------------ consumers
def test_gradient_wrt_members_is_zero_elsewhere_and_exact_on_the_members():
    net = make_net()
    x = jnp.ones((2, 2))

    def loss(m):
        return jnp.sum(m(x) ** 2)

    # (jitted: the subject is which values the selection keeps; one program each, not dozens eager)
    full = jax.jit(ft.gradient(loss))(net)
    part = jax.jit(ft.gradient(loss, wrt="h.[1-2].*"))(net)
    assert part.embed.weight is None and part.head.weight is None
    g, f = np.asarray(part.h.layers.up.weight), np.asarray(full.h.layers.up.weight)
    np.testing.assert_array_equal(g[[0, 3]], np.zeros((2, 3, 3)))
    np.testing.assert_array_equal(g[1:3], f[1:3])


def test_member_masks_with_ft_optim_masked_and_optax():
    net = make_net()
    params = ft.parameters(net)
    grads = jax.tree.map(jnp.ones_like, params)
    mask = ft.mask(net, "h.[0-1].*")
    tx = ft.optim.masked(optax.sgd(0.5), mask)
    updates, _ = tx.update(grads, tx.init(params), params)
    w = updates.h.layers.up.weight
    np.testing.assert_array_equal(w[:2], -0.5 * np.ones((2, 3, 3)))
    np.testing.assert_array_equal(w[2:], np.ones((2, 3, 3)))  # passed through, as optax.masked
    np.testing.assert_array_equal(updates.head.weight, np.ones((3, 1)))
    # whole-leaf masks stay bools: optax.masked and optax.multi_transform take them as they are
    whole = ft.mask(net, "h.*")
    updates, _ = optax.masked(optax.sgd(0.5), whole).update(grads, optax.masked(optax.sgd(0.5), whole).init(params))
    np.testing.assert_array_equal(updates.h.layers.up.weight, -0.5 * np.ones((4, 3, 3)))
    labels = jax.tree.map(lambda m: "a" if m else "b", whole)
    multi = optax.multi_transform({"a": optax.sgd(1.0), "b": optax.set_to_zero()}, labels)
    updates, _ = multi.update(grads, multi.init(params))
    np.testing.assert_array_equal(updates.head.weight, np.zeros((3, 1)))
    np.testing.assert_array_equal(updates.h.layers.up.weight, -np.ones((4, 3, 3)))


def test_to_flat_dict_unstack_on_any_tree_shaped_like_the_model():
    net = make_net()
    labels = jax.tree.map(lambda x: "w", ft.parameters(net))
    assert ft.to_flat_dict(labels, unstack=True)["h.2.norm.scale"] == "w"
    mask = ft.optim.decay_mask(ft.parameters(net))
    assert ft.to_flat_dict(mask, unstack=True)["h.2.up.weight"] is True
    state = ft.optim.adam().init(ft.parameters(net))
    mu = ft.optim.moments(state)["mu"]
    assert ft.to_flat_dict(mu, unstack=True)["h.3.up.weight"].shape == (3, 3)


def test_sharding_rule_naming_one_member_is_an_error_that_says_so():
    mesh = AbstractMesh((1,), ("data",))
    params = ft.parameters(make_net())
    with pytest.raises(ValueError, match=r"The sharding rule 'h\.2\.up\.weight' matches no parameter, only members "
                                         r"of a stacked leaf(.|\n)*right:  sharding=\{'h\.layers\.up\.weight'"):
        ft.partition_specs(params, {"h.2.up.weight": P(None, "data")}, mesh=mesh)
    specs = ft.partition_specs(params, {"h.*.up.weight": P(None, "data")}, mesh=mesh)  # every member: fine
    assert specs.h.layers.up.weight == P(None, None, "data")


def test_summary_and_checkpoint_use_the_stored_names():
    lm = make_lm()
    rows = [r.path for r in ft.summary(lm).rows]
    assert rows == list(ft.to_flat_dict(lm))
    with tempfile.TemporaryDirectory() as d:
        ft.train.save(f"{d}/ck", lm)
        back = ft.train.load(f"{d}/ck", make_lm())
    np.testing.assert_array_equal(back.model.embed.embeddings, lm.model.embed.embeddings)


# ------------------------------------------------------------------ the property
def stacked_model(n, d, nested, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    if nested:
        h = ft.nn.Stack(lambda k: ft.nn.Stack(lambda k2: ft.nn.Dense(d, d, key=k2), 2, key=k), n, key=k2)
    else:
        h = ft.nn.Stack(lambda k: Block(d, key=k), n, key=k2)
    return {"pre": ft.nn.Dense(d, d, key=k1), "h": h, "tail": [jnp.ones(d)]}


# stacked_model in one compiled program per shape, the seed an argument (eagerly, a nested
# Stack's initialisation compiled ~15 programs of one operation each per example)
_stacked_model = jax.jit(stacked_model, static_argnums=(0, 1, 2))


@settings(max_examples=examples(6), deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.booleans(), st.integers(0, 3))
def test_every_member_name_round_trips(n, d, nested, seed):
    model = _stacked_model(n, d, nested, seed)
    flat = ft.to_flat_dict(model, unstack=True)
    with tempfile.TemporaryDirectory() as d:
        ft.train.save(f"{d}/ck", model)
        back = ft.train.load(f"{d}/ck")
    restored = ft.to_flat_dict(back, unstack=True)
    assert list(restored) == list(flat)
    for name, value in flat.items():
        np.testing.assert_array_equal(ft.get(model, name), value)
        np.testing.assert_array_equal(restored[name], value)
        new = ft.set(model, name, value + 1.0)
        np.testing.assert_array_equal(ft.get(new, name), value + 1.0)
        others = {k: v for k, v in ft.to_flat_dict(new, unstack=True).items() if k != name}
        assert all(np.array_equal(v, flat[k]) for k, v in others.items()), name
        chosen = ft.to_flat_dict(ft.select(model, name), unstack=True)
        assert [k for k, v in chosen.items() if v] == [name]


def test_names_of_abstract_trees_slice_nothing():
    abstract = jax.eval_shape(make_net)
    assert list(ft.to_flat_dict(abstract)) == list(ft.to_flat_dict(make_net()))
    chosen = ft.to_flat_dict(ft.select(make_net(), "h.1"), unstack=True)
    assert [k for k, v in chosen.items() if v] == ["h.1.up.weight", "h.1.up.bias", "h.1.norm.scale",
                                                   "h.1.norm.offset"]


def _llama_like():
    """HF's Llama names on ft.nn layers: attention projections under ft's names."""
    def block(k):
        return {"self_attn": ft.nn.MultiheadAttention(4, 2, key=k), "mlp": {"up_proj": ft.nn.Dense(4, 4, key=k)},
                "input_layernorm": ft.nn.RMSNorm(4)}
    return {"model": {"layers": [block(k) for k in jax.random.split(jax.random.key(0), 2)],
                      "embed_tokens": ft.nn.Embedding(5, 4, key=jax.random.key(1))}}


@pytest.mark.parametrize("pattern, meant", [
    ("*.q_proj", "*.query_projection"),                       # abbreviated words, not the look-alike up_proj
    ("*.q_proj.*", "*.query_projection.*"),
    ("model.layers.*.self_attn.o_proj.weight", "model.layers.*.self_attn.output_projection.weight"),
    ("*.embed_tokens.weight", "*.embed_tokens.embeddings"),   # torch's names of ft.nn leaves
    ("*.input_layernorm.weight", "*.input_layernorm.scale"),
    ("*.foo", None),                                          # nothing close: no suggestion at all
    ("*.mlp.bias_x", None),
])
def test_a_pattern_that_selects_nothing_suggests_the_closest_name_by_parts(pattern, meant):
    tree = jax.eval_shape(_llama_like)
    infos = _naming.leaf_infos(tree)
    assert _naming.suggestion(pattern, infos) == meant
    if meant is not None:
        assert all(_naming.matches(n, meant) for n in _naming.closest(pattern, infos)[:1])


@pytest.mark.parametrize("pattern, meant", [
    ("*.lora_B.weight", "*.lora_b"),                          # PEFT's spelling of ft's leaf
    ("*.lora_A.default.weight", "*.lora_a"),
    ("*.up_proj.lora_b.weight", "*.up_proj.lora_b"),          # only the parts below a leaf dropped
    ("model.layers.0.mlp.up_proj.foo", None),                 # below a layer, not a leaf: its every leaf is no fit
    ("*.lora_B.*", None),                                     # a glob below: nothing dropped
])
def test_a_pattern_naming_parts_below_a_leaf_suggests_the_leaf(pattern, meant):
    tree = jax.eval_shape(lambda: ft.nn.lora(_llama_like(), "*.up_proj", rank=2, key=jax.random.key(2)))
    assert _naming.suggestion(pattern, _naming.leaf_infos(tree)) == meant


@pytest.mark.parametrize("pattern, meant", [
    ("model.layers[0].*", "model.layers.0.*"),                # Python's index for the dotted name's
    ("model.layers[0].mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("model.layers[0-1].mlp.*", "model.layers.[0-1].mlp.*"),  # a range stays a class
])
def test_a_python_index_in_a_pattern_suggests_the_dotted_index(pattern, meant):
    """fnmatch reads layers[0] as a class (the name "layers0"); the suggestion was a glob over
    the leaf's last part (*.weight), which selects every layer's."""
    tree = jax.eval_shape(_llama_like)
    assert _naming.suggestion(pattern, _naming.leaf_infos(tree)) == meant
    with pytest.raises(ValueError, match=re.escape(f"right:  ft.select(..., {meant!r})")):
        ft.select(tree, pattern)
    selected = [n for n, keep in ft.to_flat_dict(ft.select(tree, meant)).items() if keep]
    layers = {n.split(".")[2] for n in selected}
    assert selected and layers == ({"0", "1"} if "-" in pattern else {"0"})  # the layers meant, no other


def test_a_peft_spelled_group_is_refused_with_fts_leaf():
    model = ft.nn.lora(_llama_like(), "*.up_proj", rank=2, key=jax.random.key(2))
    tx = ft.optim.groups({"*.lora_B.weight": optax.sgd(16.0)}, default=optax.sgd(1.0))
    with pytest.raises(ValueError, match=r"right:  ft.optim.groups\(\{'\*.lora_b': ...\}"):
        ft.optim.Optimizer(tx, wrt="*.lora_*").init(model)


def test_wrt_errors_name_the_suggested_pattern():
    model = jax.eval_shape(_llama_like)
    with pytest.raises(ValueError, match=r"(?s)wrt='\*.q_proj' selects no parameter.*right:  wrt='\*.query_projection'"):
        ft.gradient(lambda m: 0.0, at=model, wrt="*.q_proj")
    with pytest.raises(ValueError, match=r"right:  ft.optim.Optimizer\(tx, wrt=\"\*.query_projection\"\)"):
        ft.optim.Optimizer(optax.sgd(0.1), wrt="*.q_proj").init(model)
    with pytest.raises(ValueError, match=r"right:  ft.select\(..., '\*.query_projection'\)"):
        ft.select(model, "*.q_proj")
    with pytest.raises(ValueError) as unrelated:
        ft.gradient(lambda m: 0.0, at=model, wrt="*.foo")
    assert "right:" not in str(unrelated.value)


# ------------------------------------------------------------------ a jax.vmap-ed ensemble of stacked models
@settings(max_examples=examples(8), deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.booleans(), st.data())
def test_member_names_on_an_ensemble_are_refused_and_exact_inside_vmap(size, n, nested, data):
    # Leaves (size, n, ...): a member name cannot say which leading axis is the members'
    # (size == n read model i for member i before). Inside jax.vmap it is member i of each model.
    i = data.draw(st.integers(0, n - 1))
    # (built jitted: one program per example; eagerly the vmap-ed initialisation compiled dozens)
    ens = jax.jit(jax.vmap(lambda s: stacked_model(n, 2, nested, s)))(np.arange(size))
    name, leaf = (f"h.{i}.0.weight", np.asarray(ens["h"].layers.layers.weight)[:, i, 0]) if nested else \
        (f"h.{i}.up.weight", np.asarray(ens["h"].layers.up.weight)[:, i])
    np.testing.assert_array_equal(jax.vmap(lambda m: ft.get(m, name))(ens), leaf)
    shape = rf"\({size}, {n}, {'2, ' if nested else ''}2, 2\)"
    calls = [(lambda: ft.get(ens, name), name), (lambda: ft.to_flat_dict(ens, unstack=True), "h.0")]
    if n > 1:  # some members of a leaf (with one member, h.0.* is the whole leaf)
        calls.append((lambda: ft.select(ens, f"h.{i}.*"), f"h.{i}.*"))
    for fn, path in calls:
        with pytest.raises(ValueError, match=rf"'{path}' addresses a member of the ft.nn.Stack 'h' \({n} members\), "
                                             rf"but its leaf 'h.layers.*' has shape {shape[:-2]}.*jax.vmap") as e:
            fn()
        assert f"right:  jax.vmap(lambda m: ft.get(m, {path!r}))(ensemble)" in str(e.value)  # the user's name
        assert f"jax.vmap(ft.gradient(loss, wrt={path!r}))(ensemble)" in str(e.value)
    assert ft.select(ens, "h.*")["h"].layers is not None  # whole leaves: no member axis needed


def test_a_member_selection_meeting_a_leaf_of_other_leading_axes_is_refused():
    assert _naming.broadcast(np.array([True, False, True]), jnp.zeros((3, 2, 2))).shape == (3, 1, 1)
    with pytest.raises(ValueError, match=r"A member selection of shape \(3,\) .* meets a leaf of shape \(2, 3, 2\)"
                                         r"(.|\n)*jax.vmap\(ft.gradient\(loss, wrt=\"blocks.1.\*\"\)\)\(ensemble\)"):
        _naming.broadcast(np.array([True, False, True]), jnp.zeros((2, 3, 2)))


# ------------------------------------------------------- a typo's suggestion stays a glob


def _right_pattern(call):
    """The first pattern quoted in the right: line of the error ``call()`` raises."""
    with pytest.raises(ValueError) as info:
        call()
    line = next(line for line in str(info.value).splitlines() if "right:" in line)
    return re.search(r"""['"]([^'"]*)['"]""", line.split("right:", 1)[1]).group(1)


def _encoder_head():
    return {"encoder": ft.nn.Dense(3, 4, key=jax.random.key(0)), "head": ft.nn.Dense(4, 2, key=jax.random.key(1))}


def test_a_misspelt_part_is_scored_as_close():
    assert _naming._part_score("encodr", "encoder") > 0  # once 0: the suggestion fell back to one leaf
    assert _naming._part_score("bias", "beta") == 0


def test_a_glob_with_a_typo_is_corrected_inside_the_glob_by_every_consumer():
    """'encodr.*' once got 'encoder.bias' back: freezing with it still trained encoder.weight."""
    model = _encoder_head()
    mesh = jax.make_mesh((1,), ("data",))
    calls = {
        "groups": lambda: ft.optim.Optimizer(ft.optim.groups({"encodr.*": ft.optim.sgd(0.0)},
                                                             default=ft.optim.sgd(0.1))).init(model),
        "wrt": lambda: ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="encodr.*").init(model),
        "gradient": lambda: ft.gradient(lambda m: m["encoder"](jnp.ones(3)).sum(), wrt="encodr.*")(model),
        "exclude": lambda: ft.select(model, "*", exclude=["encodr.*"]),
        "sharding": lambda: ft.partition_specs(model, {"encodr.*": P()}, mesh=mesh),
    }
    for name, call in calls.items():
        assert _right_pattern(call) == "encoder.*", name


def test_following_the_glob_suggestion_freezes_the_whole_layer():
    model = _encoder_head()
    x, y = jnp.ones((8, 3)), jnp.zeros((8, 2))

    def loss(m, x, y):
        return jnp.mean((m["head"](m["encoder"](x)) - y) ** 2)

    def make(pattern):
        return ft.optim.Optimizer(ft.optim.groups({pattern: ft.optim.sgd(0.0)}, default=ft.optim.sgd(0.1)))

    right = _right_pattern(lambda: make("encodr.*").init(model))
    opt = make(right)
    # (one jitted step: the subject is which leaves the groups freeze, not eager dispatch)
    new = jax.jit(lambda m, s: opt.minimize(loss, m, s, x, y)[0])(model, opt.init(model))
    np.testing.assert_array_equal(new["encoder"].weight, model["encoder"].weight)  # frozen, all of it
    np.testing.assert_array_equal(new["encoder"].bias, model["encoder"].bias)
    g = jax.jit(jax.grad(loss))(model, x, y)
    np.testing.assert_allclose(new["head"].weight, model["head"].weight - 0.1 * g["head"].weight, rtol=0, atol=1e-6)


def test_a_glob_nothing_corrects_gets_no_leaf_name_back():
    assert _naming.right_name("zzz.*", ["encoder.bias"], "*") == "*"
    assert _naming.right_name("encoder.bais", ["encoder.bias"], "*") == "encoder.bias"


def test_an_unmatched_sharding_glob_on_a_flax_tree_suggests_a_glob_that_matches():
    """``layers.1.kernel*`` on Flax NNX params (``layers.0.kernel.value``; layer 1 is relu)
    listed the right close names but suggested ``*.weight``, which matches no leaf there
    (following it gave the same error). The suggestion is now ``*.kernel``, and the rule it
    suggests shards exactly the kernels, as the names say."""
    nnx = pytest.importorskip("flax.nnx")
    from jax.sharding import PartitionSpec as P
    model = nnx.Sequential(nnx.Linear(2, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 4, rngs=nnx.Rngs(1)))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with pytest.raises(ValueError) as e:
        ft.partition_specs(params, {"layers.1.kernel*": P(None, "data")}, mesh=mesh)
    message = str(e.value)
    assert "'layers.1.kernel*' matches no parameter" in message and "'layers.2.kernel.value'" in message
    right = re.search(r"right:\s+sharding=\{'([^']+)'", message)
    assert right is not None and right.group(1) == "*.kernel" and "*.weight" not in message
    specs = ft.to_flat_dict(ft.partition_specs(params, {right.group(1): P(None, "data")}, mesh=mesh))
    assert specs == {"layers.0.bias.value": P(), "layers.0.kernel.value": P(None, "data"),
                     "layers.2.bias.value": P(), "layers.2.kernel.value": P(None, "data")}
    # a glob like no part of the closest name: the fallback only where it selects that name
    assert _naming.right_name("*.weight", ["layers.2.bias.value"], "*.weight") == "layers.2.bias.value"


class _Block(ft.Module):
    q_proj: ft.nn.Dense

    def __call__(self, x):
        return self.q_proj(x)


def test_a_bare_layer_name_suggests_a_glob_over_every_stack_member():
    """'q_proj' once got one member's path back ('h.1.q_proj'), which LoRA refuses (PART_OF_STACK)."""
    model = {"h": ft.nn.Stack(lambda k: _Block(ft.nn.Dense(4, 4, key=k)), 3, key=jax.random.key(0))}
    right = _right_pattern(lambda: ft.nn.lora(model, "q_proj", rank=2, key=jax.random.key(1)))
    assert right == "*.q_proj"
    adapted = ft.nn.lora(model, right, rank=2, key=jax.random.key(1))
    assert ft.get(adapted, "h.layers.q_proj.lora_a").shape == (3, 4, 2)  # every member adapted
    x = jnp.arange(4.0).reshape(1, 4)
    np.testing.assert_allclose(adapted["h"](x), model["h"](x), rtol=0, atol=1e-6)  # lora_b = 0: unchanged


# ---------------------------------------------- a class with a number range of several digits
_SIXTEEN = {"layers": [{"w": jnp.ones(1)} for _ in range(16)]}


def _selected(pattern):
    """The layer numbers ``pattern`` selects from _SIXTEEN (a pattern or a tuple of them)."""
    patterns = pattern if isinstance(pattern, tuple) else (pattern,)
    flat = ft.to_flat_dict(ft.select(_SIXTEEN, *patterns))
    return sorted(int(k.split(".")[1]) for k, v in flat.items() if v is True)


@pytest.mark.parametrize(("pattern", "reading", "right"), [
    ("layers.[10-15].*", "one character of 0, 1, 5", "'layers.1[0-5].*'"),  # selected 0, 1 and 5
    ("layers.[0-15].*", "one character of 0, 1, 5", "('layers.[0-9].*', 'layers.1[0-5].*')"),
    ("layers.[0-10].*", "one character of 0, 1", "('layers.[0-9].*', 'layers.10.*')"),
    ("layers.[1-10].*", "one character of 0, 1", "('layers.[1-9].*', 'layers.10.*')"),
    ("layers.[!10-15].*", "any one character but 0, 1, 5", "'layers.1[0-5].*'   # the numbers 10-15"),
])
def test_a_class_with_a_multi_digit_number_range_is_refused_with_one_class_per_digit(pattern, reading, right):
    """REVERSED_RANGE caught [14-15] (4-1 reversed) but not [10-15]: fnmatch's {1, 0-1, 5}
    selected layers 0, 1 and 5 silently. The right spelling selects exactly the numbers."""
    with pytest.raises(ValueError, match=rf"The pattern {re.escape(repr(pattern))} holds the character class "
                                         rf"(.|\n)*reads it as {re.escape(reading)}, not as the numbers"
                                         rf"(.|\n)*right:  {re.escape(right)}"):
        ft.select(_SIXTEEN, pattern)
    globs = eval(right.split("   #")[0])  # the message's suggestion, run
    number = re.search(r"\[!?(\d+)-(\d+)\]", pattern)
    assert number is not None
    lo, hi = sorted(int(x) for x in number.groups())
    assert _selected(globs) == list(range(lo, hi + 1))


@pytest.mark.parametrize(("pattern", "numbers"), [
    ("layers.[0-9].*", list(range(10))), ("layers.[!0-9].*", []), ("layers.1[0-5].*", list(range(10, 16))),
    ("layers.[]].*", []), ("layers.[]-a].*", []), ("layers.[--/].*", []), ("layers.[!]].*", list(range(10))),
    ("layers.[a-].*", []), ("layers.[a-z].*", []), ("layers.1[!0-3].*", [14, 15]), ("layers.[13].*", [1, 3]),
    # literals and ranges mixed: refused as [5-9] and [0-35] (numbers 0-35) until the class was read as fnmatch does
    ("layers.[05-9].*", [0, 5, 6, 7, 8, 9]), ("layers.[0-35-9].*", [0, 1, 2, 3, 5, 6, 7, 8, 9]),
    ("layers.1[!05-9].*", [11, 12, 13, 14]), ("layers.[00-1].*", [0, 1]), ("layers.1[0-23-5].*", list(range(10, 16))),
])
def test_classes_without_a_multi_digit_range_select_as_fnmatch_does(pattern, numbers):
    """The valid classes of the audit's list still pass the check and select what fnmatch's
    own reading of them does (the reference: fnmatch.fnmatchcase on each name)."""
    import fnmatch

    _naming.check_patterns([pattern])
    expected = [n for n in range(16) if fnmatch.fnmatchcase(f"layers.{n}.w", pattern)]
    assert expected == numbers
    if numbers:
        assert _selected(pattern) == numbers
    else:  # selects nothing: the no-match error, not the class's
        with pytest.raises(ValueError, match=r"wrong:  ft.select\(\.\.\., "):
            ft.select(_SIXTEEN, pattern)


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 120), st.integers(0, 120))
def test_every_number_range_class_is_refused_unless_it_is_one_digit_low_to_high(a, b):
    """Property: '[a-b]' passes only when fnmatch reads it as the numbers a..b (one digit each,
    a <= b); every other one is refused, and its suggestion spells exactly min..max."""
    pattern = f"x.[{a}-{b}]"
    if a <= b <= 9:
        _naming.check_patterns([pattern])
        return
    with pytest.raises(ValueError, match=r"right:  ") as info:
        _naming.check_patterns([pattern])
    right = eval(str(info.value).split("right:  ")[1])
    globs = right if isinstance(right, tuple) else (right,)
    hit = [n for n in range(200) if any(_naming.matches(f"x.{n}", g) for g in globs)]
    assert hit == list(range(min(a, b), max(a, b) + 1))


def test_a_stack_selects_by_a_class_of_literals_and_ranges_as_fnmatch_reads_it():
    """The audit's case: "h.[05-9].*" on a Stack of 10 Dense was refused, its fix 'h.[5-9].*'
    dropping layer 0; "h.[0-35-9].*" was refused, its fix selecting 0-35. Both are globs
    fnmatch reads one character at a time (the reference: fnmatch.fnmatchcase per member)."""
    import fnmatch

    h = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 10, key=jax.random.key(0))
    for pattern in ("h.[05-9].*", "h.[0-35-9].*"):
        picked = ft.select({"h": h}, pattern)["h"].layers.weight
        expected = [fnmatch.fnmatchcase(f"h.{n}.weight", pattern) for n in range(10)]
        assert list(np.asarray(picked)) == expected


# ---------------------------------------------- a class that starts with "^"
def test_a_class_starting_with_a_caret_is_refused_with_the_glob_negation():
    """The fifty-sixth audit's case: fnmatch reads "[^0]" as "^ or 0", so
    freeze("layers.[^0].*") (a regex's and PEFT's "every layer but 0") froze layer 0 only,
    and wrt="h.[^0].*" trained member 0 only, silently. Refused (CARET_CLASS) at every
    consumer; its fix "[!0]" selects exactly the hand-written list."""
    h = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 4, key=jax.random.key(0))
    model = {"h": h, "layers": [{"w": jnp.ones(1)} for _ in range(3)]}
    fix = "right:  'layers.[!0].*'"
    raises_named(lambda: ft.select(model, "layers.[^0].*"), ValueError, _naming.CARET_CLASS, fix)
    raises_named(lambda: ft.optim.freeze("layers.[^0].*"), ValueError, _naming.CARET_CLASS, fix)
    raises_named(lambda: ft.optim.Optimizer(optax.sgd(0.1), wrt="h.[^0].*").init(model), ValueError, _naming.CARET_CLASS,
                 "right:  'h.[!0].*'")
    raises_named(lambda: ft.optim.decay_mask(ft.parameters(model), ("h.[^12].*",)), ValueError,
                 _naming.CARET_CLASS, "right:  'h.[!12].*'")
    flat = ft.to_flat_dict(ft.select(model, "layers.[!0].*"))
    assert sorted(k for k, v in flat.items() if v is True) == ["layers.1.w", "layers.2.w"]
    assert list(np.asarray(ft.select(model, "h.[!0].*")["h"].layers.weight)) == [False, True, True, True]
    for ok in ("layers.[!^0].*", "layers.[0^].*", "x.[^]"):  # fnmatch's own negation, a literal '^' later or alone
        _naming.check_patterns([ok])


# ---------------------------------------------- a printed key path given as a pattern
def test_a_printed_key_path_as_a_pattern_is_refused_with_its_dotted_name():
    """The fifty-sixth audit's case: ft.get(model, "['qk'].weight") reads qk's weight, but as a
    pattern fnmatch read "['qk']" as one character of ', q, k: ft.select selected q.weight and
    k.weight (not qk.weight), and freeze froze them, silently. Refused (KEY_PATH_STRING) with
    the dotted name, which selects exactly qk.weight."""
    dense = {name: ft.nn.Dense(1, 1, key=jax.random.key(i)) for i, name in enumerate(("q", "k", "qk"))}
    model = {**dense, "layers": [{"w": jnp.ones(1)} for _ in range(2)]}
    kp = next(kp for kp in ft.recursively_all_writable_key_paths(model, to=jax.Array) if kp.name == "qk.weight")
    assert str(kp) == "['qk'].weight" and ft.get(model, str(kp)) is model["qk"].weight
    raises_named(lambda: ft.select(model, str(kp)), ValueError, _naming.KEY_PATH_STRING, "right:  'qk.weight'")
    raises_named(lambda: ft.optim.freeze("['qk'].*"), ValueError, _naming.KEY_PATH_STRING, "right:  'qk.*'")
    raises_named(lambda: ft.select(model, "['layers'][1].w"), ValueError, _naming.KEY_PATH_STRING,
                 "right:  'layers.1.w'")
    flat = ft.to_flat_dict(ft.select(model, kp.name))
    assert sorted(k for k, v in flat.items() if v is True) == ["qk.weight"]
