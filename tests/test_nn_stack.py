"""ft.nn.Stack: stacked members applied with lax.scan, addressed by per-member key paths."""

import contextlib
import functools
import json
import math
import re
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _jaxpr import all_equations
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import functree as ft

D = 8


class Block(ft.Module):
    norm: ft.nn.LayerNorm
    up: ft.nn.Dense
    down: ft.nn.Dense

    def __init__(self, d=D, *, key):
        k1, k2 = jax.random.split(key)
        self.norm = ft.nn.LayerNorm(d)
        self.up = ft.nn.Dense(d, 4 * d, jax.nn.gelu, key=k1)
        self.down = ft.nn.Dense(4 * d, d, key=k2)

    def __call__(self, x):
        return x + self.down(self.up(self.norm(x)))


class Model(ft.Module):
    blocks: ft.nn.Stack
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.blocks(x))


def build(n=4, remat=None, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return Model(ft.nn.Stack(lambda k: Block(key=k), n, key=k1, remat=remat), ft.nn.Dense(D, 2, key=k2))


def built_once(make):
    """``make()``, built in one compiled program on the first call and shared after it.

    Eager initializers compile once per shape (seconds for a model); one program compiles
    them together. Sharing is safe: arrays are immutable and no test donates them (the
    Trainer copies its model). Under a trace, call ``make`` itself (the cache would keep
    tracers).
    """
    return functools.cache(lambda: jax.jit(make)())


# The tests share this model (of N members) unless a member count is what they test.
N = 4
model = built_once(lambda: build(N))


def unrolled(m):
    return Model(m.blocks.unstack(), m.head)


# Drawn by NumPy: jax.random.normal would compile at import here and in test_parallel_rules.
X = jax.device_put(np.random.default_rng(9).normal(size=(5, D)).astype(np.float32))  # device_put: no `stage` program


def _amax(a):
    """``max |a|`` as a float, on the host (eagerly, jnp.abs and jnp.max compiled a program per shape)."""
    return float(np.max(np.abs(np.asarray(a))))


def loss(m, x=X):
    return jnp.mean(m(x) ** 2)


# ------------------------------------------------------------------ construction and indexing
def test_init_stacks_parameters_on_a_leading_axis():
    m = model()
    assert len(m.blocks) == N
    assert m.blocks.layers.up.weight.shape == (N, D, 4 * D)
    assert isinstance(m.blocks[1], Block) and m.blocks[1].up.weight.shape == (D, 4 * D)
    np.testing.assert_array_equal(m.blocks[-1].down.bias, m.blocks.layers.down.bias[N - 1])
    assert not np.array_equal(m.blocks[0].up.weight, m.blocks[1].up.weight)  # one key per member
    assert [b.up.weight.shape for b in m.blocks] == [(D, 4 * D)] * N
    assert len(m.blocks[1:]) == N - 1 and isinstance(m.blocks[1:], ft.nn.Stack)


def test_init_runs_make_once():
    calls = []

    def make(k):
        calls.append(k)
        return Block(key=k)

    jax.eval_shape(lambda: ft.nn.Stack(make, 16, key=jax.random.key(0)))  # traced only: compiles nothing
    assert len(calls) == 1


def test_a_make_that_cannot_take_a_key_is_refused_with_the_lambda_that_does():
    # session 60: ft.nn.Stack(lambda: Block(...), n, key=k), or the block's class needing
    # its sizes, failed inside jax.vmap with Python's "takes 0 positional arguments but 1
    # was given", naming neither the Stack nor make(key)
    from functree.nn._stack import MAKE_TAKES_KEY

    with pytest.raises(TypeError) as info:
        ft.nn.Stack(lambda: Block(key=jax.random.key(0)), 2, key=jax.random.key(0))
    assert str(info.value) == MAKE_TAKES_KEY.format(name="<lambda>", signature="()",
                                                    problem="too many positional arguments")
    with pytest.raises(TypeError, match=r"wrong:  ft\.nn\.Stack\(Block, n, key=k\)   # Block\(d=8, \*, key\)\n"
                                        r"    right:  ft\.nn\.Stack\(lambda k: Block\(\.\.\., key=k\), n, key=k\)"):
        ft.nn.Stack(Block, 2, key=jax.random.key(0))  # its key is keyword-only
    shapes = jax.eval_shape(lambda: ft.nn.Stack(lambda k, d=D: Block(d, key=k), 2, key=jax.random.key(0)))
    assert shapes.layers.up.weight.shape == (2, D, 4 * D)  # a make taking the key (and defaults) as before

def test_from_layers_and_unstack_round_trip():
    blocks = list(model().blocks)[:3]  # three distinct Blocks (one key each, above)
    stack = ft.nn.Stack.from_layers(blocks)
    assert len(stack) == 3
    for i, b in enumerate(stack.unstack()):
        for a, c in zip(jax.tree.leaves(b), jax.tree.leaves(blocks[i])):
            np.testing.assert_array_equal(a, c)


# ------------------------------------------------------------------ Stack == unrolled model
def stacked_and_unrolled(m, x=X):
    """The loss and the gradient of ``m`` and of ``unrolled(m)``, the latter's member
    gradients stacked like the Stack's: one program (two would compile twice as long)."""
    y, g = jax.value_and_grad(loss)(m, x)
    y_ref, g_ref = jax.value_and_grad(loss)(unrolled(m), x)
    return y, g.blocks.layers, y_ref, jax.tree.map(lambda *xs: jnp.stack(xs), *g_ref.blocks.layers)


def test_output_and_gradient_equal_the_unrolled_model():
    y, g, y_ref, stacked_ref = jax.jit(stacked_and_unrolled)(model())
    # Same operations in the same order, measured under the four instruction sets (compiled
    # apart or in one program, the same): loss 0 to 1e-7, gradients 4.2e-7 to 6.3e-7 of max|b|.
    np.testing.assert_allclose(y, y_ref, atol=1e-6 * abs(float(y_ref)))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(stacked_ref)):
        np.testing.assert_allclose(a, b, atol=1e-5 * _amax(b))


def test_gradient_equals_the_unrolled_gradient_in_float64():
    m = model()  # outside enable_x64: the shared model stays float32
    with jax.enable_x64(True):
        # cast inside the program: eager casts would compile once per leaf shape
        as64 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.float64))
        _, g, _, stacked_ref = jax.jit(lambda m, x: stacked_and_unrolled(as64(m), as64(x)))(m, X)
        assert g.up.weight.dtype == jnp.float64
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(stacked_ref)):
            np.testing.assert_allclose(a, b, atol=1e-12)


def test_extra_arguments_reach_every_member():
    class Scale(ft.Module):
        w: jax.Array

        def __call__(self, x, factor, *, shift):
            return x * self.w * factor + shift

    stack = ft.nn.Stack(lambda k: Scale(jnp.full((2,), 2.0)), 3, key=jax.random.key(0))
    np.testing.assert_allclose(stack(jnp.ones(2), 0.5, shift=1.0), jnp.full((2,), 4.0))  # x -> x + 1, 3 times


class Norms(ft.Module):
    """A pre-norm transformer block: causal attention and a GELU MLP (RMSNorm, LayerNorm)."""

    norm1: ft.nn.RMSNorm
    attention: ft.nn.MultiheadAttention
    norm2: ft.nn.LayerNorm
    mlp: ft.nn.Sequential

    def __init__(self, d=D, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = ft.nn.RMSNorm(d), ft.nn.LayerNorm(d)
        self.attention = ft.nn.MultiheadAttention(d, 2, causal=True, key=k1)
        self.mlp = ft.nn.Sequential(ft.nn.Dense(d, 2 * d, ft.nn.gelu, key=k2), ft.nn.Dense(2 * d, d, key=k3))

    def __call__(self, x, *, mask=None):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


def test_transformer_blocks_with_a_mask_keyword():
    x = jax.device_put(np.random.default_rng(1).normal(size=(2, 5, D)).astype(np.float32))  # NumPy's: no eager programs
    mask = np.ones((5, 5), bool)
    mask[:, 0], mask[0, 0] = False, True
    mask = jnp.asarray(mask)

    @jax.jit  # built inside the program: eager initializers would compile once per shape
    def stacked_and_applied(key):
        stack = ft.nn.Stack(lambda k: Norms(key=k), 3, key=key, remat=True)
        return stack(x, mask=mask), _apply(stack, x, mask)

    y, y_ref = stacked_and_applied(jax.random.key(0))
    np.testing.assert_allclose(y, y_ref, atol=1e-5 * _amax(y_ref))


def _apply(stack, x, mask):
    for block in stack:
        x = block(x, mask=mask)
    return x


# ------------------------------------------------------------------ dropout and layer state
class Noisy(ft.Module):
    dense: ft.nn.Dense
    norm: ft.nn.BatchNorm
    drop: ft.nn.Dropout

    def __init__(self, *, key):
        self.dense, self.norm, self.drop = ft.nn.Dense(3, 3, key=key), ft.nn.BatchNorm(3), ft.nn.Dropout(0.5)

    def __call__(self, x, *, key=None):
        return self.drop(self.norm(self.dense(x)), key=key)


noisy_stack = built_once(lambda: ft.nn.Stack(lambda k: Noisy(key=k), 3, key=jax.random.key(0)))


def test_dropout_gets_a_fresh_key_per_member_and_state_is_collected():
    stack = ft.nn.training(noisy_stack())
    x, key = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(4, 3)), jax.random.key(5)
    y, state = ft.nn.collect_state(lambda s: s(x, key=key), stack)
    # Sequential splits its key the same way among the members that take one.
    y_ref, state_ref = ft.nn.collect_state(lambda s: s(x, key=key), stack.unstack())
    np.testing.assert_allclose(y, y_ref, atol=1e-6)
    assert sorted(map(str, state)) == [".layers.norm.running_mean", ".layers.norm.running_variance"]
    for name in ("running_mean", "running_variance"):
        ref = jnp.stack([state_ref[ft.KeyPath.parse(f".layers[{i}].norm.{name}")] for i in range(3)])
        np.testing.assert_allclose(state[ft.KeyPath.parse(f".layers.norm.{name}")], ref, atol=1e-6)
    updated = ft.nn.apply_state(stack, state)
    assert updated.layers.norm.running_mean.shape == (3, 3)
    same_key = ft.nn.Stack.from_layers([stack[0]] * 3)
    masks = [ft.nn.training(b.drop)(jnp.ones(64), key=k) for b, k in zip(same_key, jax.random.split(key, 3))]
    assert not np.array_equal(masks[0], masks[1])


def test_state_under_value_with_gradient_and_state_inside_a_model():
    m = ft.nn.training(ft.nn.Sequential(noisy_stack()))
    x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(4, 3))
    _, grads, state = ft.nn.value_with_gradient_and_state(
        lambda mm, xx: jnp.mean(mm(xx, key=jax.random.key(1)) ** 2), m, x)
    assert sorted(map(str, state)) == [".layers[0].layers.norm.running_mean",
                                       ".layers[0].layers.norm.running_variance"]
    assert grads.layers[0].layers.dense.weight.shape == (3, 3, 3)


def test_eager_steps_collecting_state_compile_the_scan_once():
    """Under collect_state (value_with_gradient_and_state, a hand-written eager loop) the
    Stack ran a plain scan: its body a new closure at each call, two scan programs compiled
    at every step (0.35 s for three Dense members). Now the compiled scan of its signature,
    the state's key paths kept from its one trace; the numbers of the step traced under
    jax.jit (another program: float32 rounding apart)."""
    from _compiles import compiled

    x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(4, 3))

    def loss(m, xx):
        return jnp.mean(m(xx, key=jax.random.key(1)) ** 2)

    def step(m):
        value, grads, state = ft.nn.value_with_gradient_and_state(loss, m, x)
        return value, ft.nn.apply_state(ft.move(m, along=jax.tree.map(lambda g: -0.1 * g, grads)), state)

    eager = jitted = ft.nn.training(ft.nn.Sequential(noisy_stack()))
    step(eager)  # the first step compiles
    with compiled(clear=False) as names:
        step(eager)
        names.clear()
        for _ in range(2):
            value, eager = step(eager)
            value_jitted, jitted = jax.jit(step)(jitted)
            np.testing.assert_allclose(np.asarray(value), np.asarray(value_jitted), rtol=0, atol=2e-6)  # measured 1.8e-7 (value 3)
    assert [n for n in names if "scan" in n or n == "jit(run)"] == [], names
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)  # measured 1.2e-7
    assert float(jnp.abs(eager.layers[0].layers.norm.running_mean).min()) > 0  # the state was applied


# ------------------------------------------------------------------ per-member key paths
def test_get_and_set_one_member():
    m = model()
    w = ft.get(m, "blocks.3.up.weight")
    np.testing.assert_array_equal(w, m.blocks.layers.up.weight[3])
    np.testing.assert_array_equal(ft.get(m, ".blocks[3].up.weight"), w)
    np.testing.assert_array_equal(ft.get(m, ".blocks[-1].up.weight"), w)
    m2 = ft.set(m, "blocks.3.up.weight", jnp.zeros_like(w))
    np.testing.assert_array_equal(m2.blocks.layers.up.weight[3], 0)
    np.testing.assert_array_equal(m2.blocks.layers.up.weight[:3], m.blocks.layers.up.weight[:3])
    block = ft.get(m, "blocks.1")
    assert isinstance(block, Block)
    m3 = ft.set(m, "blocks.0", block)
    np.testing.assert_array_equal(m3.blocks.layers.down.weight[0], m.blocks.layers.down.weight[1])
    assert ft.get(m, "blocks.layers.up.weight").shape == (4, D, 4 * D)


def test_per_member_set_with_the_wrong_shape_names_the_path():
    m = model()
    with pytest.raises(ValueError, match=r"ft.set\(.blocks\[3\].up.weight\): expected shape \(8, 32\)"):
        ft.set(m, "blocks.3.up.weight", jnp.zeros((4, D, 4 * D)))
    with pytest.raises(ValueError, match=r"a member of this Stack is a Block"):
        ft.set(m, "blocks.2", Block(d=4, key=jax.random.key(0)))


def test_member_key_paths_on_an_abstract_template():
    # jax.eval_shape's template: a member is read as a ShapeDtypeStruct of one member's shape
    # (ft.get, stack[i], iteration, slices, unstack=True); an abstract leaf holds no values to
    # set one member in (refused, naming both names), the whole stacked leaf may be set.
    template = jax.eval_shape(functools.partial(build, N))
    assert ft.get(template, "blocks.3.up.weight") == jax.ShapeDtypeStruct((D, 4 * D), jnp.float32)
    assert template.blocks[1].down.weight.shape == (4 * D, D)
    assert [type(b) for b in template.blocks] == [Block] * N
    assert template.blocks[1:3].layers.up.bias.shape == (2, 4 * D)
    assert ft.to_flat_dict(template, unstack=True)["blocks.2.norm.scale"].shape == (D,)
    restored = ft.from_flat_dict(template, ft.to_flat_dict(model(), unstack=True))
    np.testing.assert_array_equal(restored.blocks.layers.up.weight, model().blocks.layers.up.weight)
    mesh = AbstractMesh((1,), ("data",))
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
        mesh, P(*[None] * (a.ndim - 1), "data"))), template)
    assert ft.get(placed, "blocks.0.up.weight").sharding.spec == P(None, "data")   # the layer axis's entry dropped
    with pytest.raises(ValueError, match=r'"blocks.2.up.bias" is in member 2 of a Stack whose leaf '
                                         r'"blocks.layers.up.bias" is abstract \(f32\[4,32\]'):
        ft.set(template, "blocks.2.up.bias", jnp.zeros(4 * D))
    whole = ft.set(template, "blocks.layers.up.bias", jnp.zeros((N, 4 * D)))
    assert whole.blocks.layers.up.bias.shape == (N, 4 * D)


def _right_code(message):
    """The code of an error message's ``right:`` line, as the user would paste it."""
    return next(line for line in message.splitlines() if "right:" in line).split("right:", 1)[1].split("#")[0].strip()


def test_a_wrong_member_names_its_full_path_and_the_fix_runs():
    """BAD_MEMBER's fix once named '[1]', relative to the Stack: a KeyError when pasted."""
    k = jax.random.key(0)
    model = {"h": ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, key=k), 3, key=k)}
    with pytest.raises(ValueError, match=r"ft\.set\(\['h'\]\[1\]\): a member of this Stack (.|\n)*at \.weight") as info:
        ft.set(model, "h.1", ft.nn.Dense(4, 5, key=k))
    assert _right_code(str(info.value)) == 'ft.set(model, "h.1", block)'
    block = ft.nn.Dense(4, 4, key=jax.random.key(1))
    out = eval(_right_code(str(info.value)))  # pasted
    np.testing.assert_array_equal(out["h"].layers.weight[1], block.weight)
    np.testing.assert_array_equal(out["h"].layers.weight[::2], model["h"].layers.weight[::2])


def test_a_members_static_field_is_set_on_the_stacks_block_for_every_member():
    """STATIC_FIELD's fix for h.1.activation once replaced one member: refused (BAD_MEMBER)."""
    k = jax.random.key(0)
    model = {"h": ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, key=k), 2, key=k)}
    value = jax.nn.relu
    with pytest.raises(ValueError, match=r"members of the Stack at \['h'\] share their static fields") as info:
        ft.set(model, "h.1.activation", value)
    namespace = {"ft": ft, "model": model, "value": value}
    exec(_right_code(str(info.value)), namespace)  # pasted: model = ft.set(model, "['h'].layers", ...)
    x = np.array([[-1.0, 2.0, 0.5]], np.float32)
    w, b = np.asarray(model["h"].layers.weight), np.asarray(model["h"].layers.bias)
    expected = np.maximum(np.maximum(x @ w[0] + b[0], 0) @ w[1] + b[1], 0)  # relu in every member
    np.testing.assert_allclose(namespace["model"]["h"](jnp.asarray(x)), expected, rtol=0, atol=1e-6)


def test_member_out_of_range():
    m = model()
    with pytest.raises(IndexError, match=r"member 4 does not exist; the Stack holds 4 members(.|\n)*right:  ft.get\(model, 'blocks.3.up.weight'\)"):
        ft.get(m, "blocks.4.up.weight")
    with pytest.raises(IndexError, match=r"member 4 does not exist"):
        ft.get(m, ".blocks[4].up.weight")
    with pytest.raises(IndexError, match=r"stack\[-5\]: the Stack holds 4 members(.|\n)*right:  stack\[3\]"):
        m.blocks[-5]


def test_flat_dict_stacked_and_per_member_forms():
    m = model()
    stacked = ft.to_flat_dict(m)
    assert "blocks.layers.up.weight" in stacked and stacked["blocks.layers.up.weight"].shape == (N, D, 4 * D)
    members = ft.to_flat_dict(m, unstack=True)
    assert list(members)[:2] == ["blocks.0.norm.scale", "blocks.0.norm.offset"]
    assert members[f"blocks.{N - 1}.up.weight"].shape == (D, 4 * D) and "head.weight" in members
    assert len(members) == N * 6 + 2
    zero = jax.tree.map(jnp.zeros_like, m)
    for flat in (stacked, members):
        back = ft.from_flat_dict(zero, flat)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(m)):
            np.testing.assert_array_equal(a, b)
        assert jax.tree.structure(back) == jax.tree.structure(m)


def test_torch_style_state_dict_maps_onto_a_stack():
    m = model()
    torch_like = {k: np.asarray(v, np.float64) for k, v in ft.to_flat_dict(m, unstack=True).items()}
    back = ft.from_flat_dict(m, torch_like, cast=True)
    np.testing.assert_allclose(back.blocks.layers.up.weight, m.blocks.layers.up.weight, atol=1e-7)
    del torch_like["blocks.1.up.bias"]
    _, report = ft.from_flat_dict(m, torch_like, strict=False, cast=True)
    assert report.missing == ("blocks.1.up.bias",)
    with pytest.raises(ValueError, match=r"missing keys:    \['blocks.1.up.bias'\]"):
        ft.from_flat_dict(m, torch_like, cast=True)


# ------------------------------------------------------------------ globs: decay, groups, sharding
def first_update(tx, grads, params):
    """``tx``'s first update, in one program (eager, each operation compiles per leaf shape)."""
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def test_decay_mask_and_groups_by_glob_on_stacked_leaves():
    params = ft.parameters(model())
    mask = ft.optim.decay_mask(params)
    assert mask.blocks.layers.up.weight is True and mask.blocks.layers.up.bias is False
    assert mask.blocks.layers.norm.scale is False
    tx = ft.optim.groups({"blocks.*": ft.optim.sgd(0.1), "head.*": ft.optim.sgd(1.0)})
    updates = first_update(tx, params, params)
    np.testing.assert_allclose(updates.blocks.layers.up.weight, -0.1 * params.blocks.layers.up.weight, atol=1e-7)


def test_fsdp_never_splits_the_layer_axis_unless_a_rule_asks():
    mesh = AbstractMesh((8,), ("data",))
    # The rules read shapes only: the Stacks are built abstractly (eval_shape), compiling nothing.
    stack = jax.eval_shape(lambda: ft.nn.Stack(lambda k: ft.nn.Dense(16, 8, key=k), 64,
                                               key=jax.random.key(0)))  # weight (64, 16, 8)
    assert ft.partition_specs(stack, "fsdp", mesh=mesh).layers.weight == P(None, "data")
    assert ft.partition_specs(stack, {"*.weight": P(None, "data")}, mesh=mesh,
                              strict=False).layers.weight == P(None, None, "data")  # one member's spec
    assert ft.partition_specs(stack, {"*.weight": P("data", None, None)}, mesh=mesh,
                              strict=False).layers.weight == P("data", None, None)  # asks for the layer axis
    nested = jax.eval_shape(lambda: ft.nn.Stack(lambda k: ft.nn.Stack(lambda k2: ft.nn.Dense(16, 8, key=k2), 8, key=k),
                                                8, key=jax.random.key(0)))  # weight (8, 8, 16, 8)
    assert ft.partition_specs(nested, "fsdp", mesh=mesh).layers.layers.weight == P(None, None, "data")


# ------------------------------------------------------------------ display, training, checkpoints
def test_summary_shows_a_stack_once():
    m = model()
    text = str(ft.summary(m))
    per = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(m.blocks[0]))
    assert re.search(rf"\nblocks +{N} × Block \({per:,} each\) +float32 +{N * per:,} ", text), text
    assert ft.summary(m).parameter_count == ft.summary(unrolled(m)).parameter_count
    assert "blocks.layers" not in text
    assert f"{N} × Block" in str(ft.summary(m, depth=1))


def test_trainer_and_checkpoint_round_trip():
    m = model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, D)).astype(np.float32)
    y = rng.normal(size=(32, 2)).astype(np.float32)
    trainer = ft.train.Trainer(m, ft.optim.Optimizer(ft.optim.adam(1e-2)),
                               lambda mm, b: jnp.mean((mm(b[0]) - b[1]) ** 2))
    history = trainer.fit(ft.train.batches((x, y), 16), epochs=3, progress=False)
    assert history.epochs["loss"][-1] < history.epochs["loss"][0]
    trained = trainer.model
    assert isinstance(trained.blocks, ft.nn.Stack) and trained.blocks.layers.up.weight.shape == (N, D, 4 * D)
    with tempfile.TemporaryDirectory() as d:
        ft.train.save(d + "/m", trained)
        for restored in (ft.train.load(d + "/m"), ft.train.load(d + "/m", trained)):
            assert jax.tree.structure(restored) == jax.tree.structure(trained)
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(trained)):
                np.testing.assert_array_equal(a, b)


def test_the_train_step_jaxpr_does_not_grow_with_depth():
    opt = ft.optim.Optimizer(ft.optim.adamw(1e-3))

    def step(m, state):
        _, grads = ft.value_with_gradient(loss, at=m)
        updates, state = opt.update(grads, state, m)
        return ft.move(m, along=updates), state

    sizes = []
    for n in (2, 9):  # traced on abstract arrays (eval_shape): building them would compile
        m = jax.eval_shape(functools.partial(build, n))
        sizes.append(all_equations(jax.make_jaxpr(step)(m, jax.eval_shape(opt.init, m)).jaxpr))
    assert sizes[0] == sizes[1]


# ------------------------------------------------------------------ bad input
def test_bad_n_and_make():
    for n in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"ft\.nn\.Stack needs n >= 1 members"):
            ft.nn.Stack(lambda k: Block(key=k), n, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"make\(key\) must return an ft.Module"):
        ft.nn.Stack(lambda k: jax.random.normal(k, (2,)), 3, key=jax.random.key(0))


def test_members_of_different_structure():
    k = jax.random.key(0)
    with pytest.raises(ValueError, match=r"member 1 differs from member 0 at .weight: f32\[2,3\] in member 0, "
                                         r"f32\[2,4\] in member 1"):
        ft.nn.Stack.from_layers([ft.nn.Dense(2, 3, key=k), ft.nn.Dense(2, 4, key=k)])
    with pytest.raises(ValueError, match=r"at .activation: identity in member 0, relu in member 1"):
        ft.nn.Stack.from_layers([ft.nn.Dense(2, 3, key=k), ft.nn.Dense(2, 3, jax.nn.relu, key=k)])
    with pytest.raises(ValueError, match=r"at <root>: a Dense in member 0, a LayerNorm in member 2"):
        ft.nn.Stack.from_layers([ft.nn.Dense(2, 3, key=k)] * 2 + [ft.nn.LayerNorm(3)])
    with pytest.raises(ValueError, match=r"from_layers needs at least one module"):
        ft.nn.Stack.from_layers([])


def test_a_block_that_changes_the_shape_of_x():
    stack = ft.nn.Stack(lambda k: ft.nn.Dense(4, 6, key=k), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"a Dense maps f32\[3,4\] to f32\[3,6\](.|\n)*Dense\(64, 64"):
        stack(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=r"maps f32\[3,4\] to bf16\[3,4\]"):
        ft.nn.Stack(lambda k: ft.nn.Lambda(lambda x: x.astype(jnp.bfloat16)), 2, key=jax.random.key(0))(
            jnp.ones((3, 4)))
    # x promoted by the members' weights (standard promotion: bf16 x f32 -> f32): the fix is a
    # cast, not a change of shape (the message's example was Dense(64, 128) -> Dense(64, 64))
    square = ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, key=k), 2, key=jax.random.key(0))
    x = jnp.ones((3, 4), jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"), pytest.raises(
            ValueError, match=r"(?s)maps bf16\[3,4\] to f32\[3,4\]: its parameters are float32.*"
                              r"right:  ft\.cast\(stack, jnp\.bfloat16\)\(x\).*or:  stack\(x\.astype\(jnp\.float32\)\)"):
        square(x)
    assert ft.cast(square, jnp.bfloat16)(x).dtype == jnp.bfloat16  # the fix it shows runs


# The FSDP and tensor-parallel Stack on 8 devices: test_parallel_step.py's
# test_a_stack_on_fsdp_and_tensor_parallel_meshes_equals_one_device (its 8-device subprocess,
# one start-up for all of them).


# ------------------------------------------------------------------ member patterns (functree/_naming.py)
def test_freeze_and_decay_masks_select_members():
    import optax

    m = model()
    params = ft.parameters(m)
    grads = jax.tree.map(jnp.ones_like, params)
    tx = optax.chain(ft.optim.sgd(1.0), ft.optim.freeze("blocks.[0-1].*"))
    u = first_update(tx, grads, params)
    np.testing.assert_array_equal(u.blocks.layers.up.weight[:2], 0.0)
    np.testing.assert_array_equal(u.blocks.layers.up.weight[2:], -1.0)
    mask = ft.optim.decay_mask(params, ("*.bias", "blocks.3.*"))
    np.testing.assert_array_equal(mask.blocks.layers.up.weight, [True, True, True, False])
    assert mask.blocks.layers.up.bias is False and mask.head.weight is True
    zero = jax.tree.map(jnp.zeros_like, params)
    tx = ft.optim.adamw(0.1, weight_decay=0.5, exclude=("*.bias", "blocks.3.*"))
    u = first_update(tx, zero, params)
    w = params.blocks.layers.up.weight
    np.testing.assert_allclose(u.blocks.layers.up.weight[:3], -0.05 * w[:3], rtol=0, atol=1e-7)
    np.testing.assert_array_equal(u.blocks.layers.up.weight[3], 0.0)
    tx = ft.optim.weight_decay(0.5, exclude=("*.bias", "blocks.0.*"))
    u = first_update(tx, zero, params)
    np.testing.assert_array_equal(u.blocks.layers.up.weight[0], 0.0)
    np.testing.assert_allclose(u.blocks.layers.up.weight[1:], -0.5 * w[1:], rtol=0, atol=1e-7)


def test_optimizer_trains_the_top_blocks_only():
    m = model()
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), wrt=("blocks.[2-3].*", "head"))
    state = opt.init(m)
    trained = m
    minimize = jax.jit(lambda mm, s: opt.minimize(loss, mm, s))  # eager, each op compiles per shape
    for _ in range(5):
        trained, state, _ = minimize(trained, state)
    for before, after in zip(jax.tree.leaves(m.blocks), jax.tree.leaves(trained.blocks)):
        np.testing.assert_array_equal(after[:2], before[:2])
        assert not np.array_equal(after[2:], before[2:])
    np.testing.assert_array_equal(ft.optim.moments(state)["mu"].blocks.layers.up.weight[:2], 0.0)


# ------------------------------------------------------------------ caches, unstack's arguments, error paths
class AttentionBlock(ft.Module):
    norm: ft.nn.LayerNorm
    attn: ft.nn.MultiheadAttention

    def __init__(self, d=D, *, key):
        self.norm = ft.nn.LayerNorm(d)
        self.attn = ft.nn.MultiheadAttention(d, 2, rotary=True, causal=True, key=key)

    def init_cache(self, batch_size, max_length, dtype=None):
        return self.attn.init_cache(batch_size, max_length, dtype)

    def __call__(self, x, *, mask=None, positions=None, cache=None):
        if cache is None:
            return x + self.attn(self.norm(x), mask=mask)
        y, cache = self.attn(self.norm(x), mask=mask, positions=positions, cache=cache)
        return x + y, cache


attention_stack = built_once(lambda: ft.nn.Stack(lambda k: AttentionBlock(key=k), 2, key=jax.random.key(0)))


def test_a_stack_carries_one_cache_per_member_and_unstack_takes_its_arguments():
    stack = attention_stack()
    x = jax.device_put(np.random.default_rng(1).normal(size=(2, 5, D)).astype(np.float32))  # NumPy's: no eager programs
    pos = jax.device_put(np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5)))
    am = jax.device_put(np.ones((2, 5), np.int32))  # a slot mask: keyword arguments reach every member

    @jax.jit
    def run(stack, x):
        caches = stack.init_cache(2, 5)
        first, caches = stack(x[:, :4], cache=caches, positions=pos[:, :4], mask=am)
        last, caches = stack(x[:, 4:], cache=caches, positions=pos[:, 4:], mask=am)
        unstacked = stack.unstack()  # the same function, with the Stack's arguments
        y, per_layer = unstacked(x, cache=unstacked.init_cache(2, 5), positions=pos, mask=am)
        return jnp.concatenate([first, last], 1), stack(x), y, caches, per_layer

    decoded, full, unrolled, caches, per_layer = run(stack, x)
    assert caches.keys.shape == (2, 2, 5, 2, D // 2) and len(per_layer) == 2
    atol = 1e-5 * float(np.abs(full).max())
    np.testing.assert_allclose(decoded, full, rtol=0, atol=atol)
    np.testing.assert_allclose(unrolled, full, rtol=0, atol=atol)
    np.testing.assert_allclose(per_layer[1].values, caches.values[1], rtol=0, atol=atol)


def test_an_error_inside_a_stack_names_the_member_layer():
    stack = attention_stack()
    with pytest.raises(ft.nn.LayerInputError, match=r"LayerNorm at .layers.norm expects inputs \[\.\.\., 8\]"):
        stack(jnp.ones((2, 3, 4)))
    with pytest.raises(ft.nn.LayerInputError, match=r"LayerNorm at .layers\[0\].norm expects"):
        stack.unstack()(jnp.ones((2, 3, 4)))
    with pytest.raises(ft.nn.LayerInputError, match=r"MultiheadAttention at .layers.attn expects inputs "
                                                    r"positions \[2, 3\] \(int\), got f32\[2,3\]"):
        stack(jnp.ones((2, 3, D)), cache=stack.init_cache(2, 4), positions=jnp.ones((2, 3)))


def test_cache_errors_in_stack_and_sequential():
    stack = attention_stack()
    x, pos = jnp.ones((2, 3, D)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"Stack of 2 members: cache= holds one cache per member stacked on axis 0 "
                                         r"\(every leaf \[2, \.\.\.\]\), got a KVCache with f32\[3,4,2,4\]"):
        stack(jnp.ones((3, 3, D)), cache=stack[0].init_cache(3, 4), positions=jnp.zeros((3, 3), jnp.int32))
    dense = ft.nn.Stack(lambda k: ft.nn.Dense(D, D, key=k), 2, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"ft.nn.Stack.init_cache: each member is a Dense, which has no init_cache"):
        dense.init_cache(2, 4)
    with pytest.raises(TypeError, match=r"Sequential.init_cache: layer 0 is a Dense"):
        dense.unstack().init_cache(2, 4)
    with pytest.raises(ValueError, match=r"Sequential of 2 layers: cache= is a tuple of one cache per layer, got a "
                                         r"KVCache"):
        stack.unstack()(x, cache=stack[0].init_cache(2, 4), positions=pos)

    class Forgets(AttentionBlock):
        def __call__(self, x, **kwargs):
            return super().__call__(x, **kwargs)[0]

    forgets = ft.nn.Stack(lambda k: Forgets(key=k), 2, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"ft.nn.Stack: called with cache=, each member \(a Forgets\) must return "
                                        r"\(x, cache\), got an array f32\[2,3,8\]"):
        forgets(x, cache=forgets.init_cache(2, 4), positions=pos)
    tied = ft.nn.Shared({"a": stack[0], "b": stack[1]}, {"b": "a"})
    with pytest.raises(TypeError, match=r"ft.nn.Shared.init_cache: the tied model is a dict"):
        tied.init_cache(2, 4)


# ------------------------------------------------------------------ a jax.vmap-ed ensemble of Stack models
class Blk(ft.Module):
    d: ft.nn.Dense

    def __call__(self, x):
        return jnp.tanh(self.d(x))


class Net(ft.Module):
    blocks: ft.nn.Stack

    def __call__(self, x):
        return self.blocks(x)


@functools.cache
def ensemble(size, n=3):
    """``size`` models of an ``n``-member Stack, built by jax.vmap: leaves (size, n, ...).

    Built once per size as one compiled program (eagerly, each vmapped initializer compiled
    apart) and shared: arrays are immutable and no test donates them."""
    make = lambda k: Net(ft.nn.Stack(lambda kk: Blk(ft.nn.Dense(2, 2, key=kk)), n, key=k))  # noqa: E731
    return jax.jit(lambda: jax.vmap(make)(jax.random.split(jax.random.key(0), size)))()


X2 = jax.device_put(np.random.default_rng(3).normal(size=(4, 2)).astype(np.float32))


def one_loss(m):
    return jnp.sum(m(X2) ** 2)


def ensemble_loss(ms):
    return jax.vmap(one_loss)(ms).sum()


def refused(path, size):
    return rf"'{re.escape(path)}' addresses a member of the ft.nn.Stack 'blocks' \(3 members\), but its leaf " \
           rf"'blocks.layers.d.(weight|bias)' has shape \({size}, 3, 2(, 2)?\).*each model's leaf is \(3, 2(, 2)?\)" \
           rf"(.|\n)*jax.vmap\(ft.gradient\(loss, wrt={re.escape(repr(path))}\)\)\(ensemble\)"  # the user's name


@pytest.mark.parametrize("size", [3, 2])  # as many models as members (the old code read the wrong axis) or not
def test_member_key_paths_and_patterns_on_an_ensemble_are_refused(size):
    # Every leaf is (models, members, ...): a member index or pattern cannot say which axis is
    # the members'. With size == 3 the old code silently took model 1 for member 1.
    ens = ensemble(size)
    opt = ft.optim.Optimizer(ft.optim.sgd(1.0), wrt="blocks.1.*")
    frozen = optax.chain(ft.optim.sgd(1.0), ft.optim.freeze("blocks.1.*"))
    calls = {
        "blocks.1.d.weight": [lambda: ft.get(ens, "blocks.1.d.weight"),
                              lambda: ft.set(ens, "blocks.1.d.weight", jnp.zeros((size, 2, 2)))],
        "blocks.1": [lambda: ft.get(ens, "blocks.1")],
        "blocks.1.*": [lambda: ft.select(ens, "blocks.1.*"),
                       lambda: ft.gradient(ensemble_loss, wrt="blocks.1.*")(ens),
                       lambda: opt.init(ens),
                       lambda: opt.minimize(ensemble_loss, ens, ft.optim.Optimizer(ft.optim.sgd(1.0)).init(ens)),
                       lambda: frozen.update(ft.gradient(ensemble_loss)(ens), frozen.init(ens), ens)],
        "blocks.0": [lambda: ft.to_flat_dict(ens, unstack=True)],
    }
    for path, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=refused(path, size)):
                fn()
    for index in (1, slice(0, 2)):
        with pytest.raises(ValueError, match=r"addresses a member of the ft.nn.Stack .*jax.vmap"):
            ens.blocks[index]


@pytest.mark.parametrize("size", [3, 2])
def test_an_ensemble_of_stacks_called_outside_vmap_is_refused(size):
    # 2 models: the scan's "length argument of 3 which disagrees with leading axis sizes [2, 2]";
    # 3 models (as many as members): the scan ran over the models, each Dense given [3, 2, 2].
    with pytest.raises(ft.nn.LayerInputError, match=rf"Stack holds layers.d.weight of shape \({size}, 3, 2, 2\), but one "
                                                    r"Stack's leaves are \[3, ...\] \(layers.d.weight: 3 axes\)"):
        ensemble(size)(X2)
    assert jax.vmap(lambda m: m(X2))(ensemble(size)).shape == (size, 4, 2)   # the fix


def test_member_patterns_inside_vmap_are_exact_and_the_ensemble_is_still_refused_after():
    # The right code: the pattern inside jax.vmap, one model at a time. A selection cached by
    # that call (same tree structure) must not let the ensemble through afterwards.
    ens = ensemble(3)
    weight = np.asarray(ens.blocks.layers.d.weight)
    # each jax.vmap below jitted (one program; eagerly, each vmapped operation compiled apart),
    # the comparisons in NumPy
    full, inside = (np.asarray(g.blocks.layers.d.weight) for g in jax.jit(
        lambda e: (ft.gradient(ensemble_loss)(e), jax.vmap(ft.gradient(one_loss, wrt="blocks.1.*"))(e)))(ens))
    np.testing.assert_allclose(inside[:, 1], full[:, 1], rtol=0, atol=1e-6)
    assert not inside[:, [0, 2]].any()
    with pytest.raises(ValueError, match=refused("blocks.1.*", 3)):
        ft.gradient(ensemble_loss, wrt="blocks.1.*")(ens)
    got = jax.jit(jax.vmap(lambda m: ft.get(m, "blocks.1.d.weight")))(ens)
    np.testing.assert_allclose(got, weight[:, 1], rtol=0, atol=0)
    opt = ft.optim.Optimizer(ft.optim.sgd(1.0), wrt="blocks.1.*")
    new, _, _ = jax.jit(lambda e: jax.vmap(lambda m, s: opt.minimize(one_loss, m, s))(e, jax.vmap(opt.init)(e)))(ens)
    changed = np.abs(np.asarray(new.blocks.layers.d.weight) - weight).sum((-1, -2)) > 0
    np.testing.assert_array_equal(changed, [[False, True, False]] * 3)


def test_whole_leaf_patterns_work_on_an_ensemble():
    ens = ensemble(2)
    # one program (eagerly, each operation compiled apart), the comparisons in NumPy
    full, some = jax.jit(lambda e: (ft.gradient(ensemble_loss)(e), ft.gradient(ensemble_loss, wrt="blocks.*")(e)))(ens)
    for a, b in zip(jax.tree.leaves(some), jax.tree.leaves(full)):
        np.testing.assert_allclose(a, b, rtol=0, atol=0)
    assert ft.select(ens, "*.weight").blocks.layers.d.weight is True
    assert ft.get(ens, "blocks.layers.d.weight").shape == (2, 3, 2, 2)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.5), wrt="*.bias")
    new, _, _ = jax.jit(lambda e: opt.minimize(ensemble_loss, e, opt.init(e)))(ens)
    bias = np.asarray(ens.blocks.layers.d.bias)
    np.testing.assert_allclose(new.blocks.layers.d.bias, bias - 0.5 * np.asarray(full.blocks.layers.d.bias),
                               rtol=0, atol=1e-6)
    assert np.array_equal(np.asarray(new.blocks.layers.d.weight), np.asarray(ens.blocks.layers.d.weight))


def test_summary_of_an_ensemble_counts_one_member_of_one_model():
    text = str(ft.summary(ensemble(2)))
    assert re.search(r"\nblocks +3 × Blk \(6 each\) in each of 2 models +float32 +36 ", text), text


def test_nested_stacks_in_an_ensemble_are_refused_and_work_inside_vmap():
    def make(k):
        return ft.nn.Stack(lambda kk: ft.nn.Stack(lambda j: ft.nn.Dense(2, 2, key=j), 2, key=kk), 3, key=k)

    # built as one program (eagerly, each vmapped initializer compiled apart)
    ens = jax.jit(lambda: jax.vmap(lambda k: {"blocks": make(k)})(jax.random.split(jax.random.key(1), 2)))()
    assert ens["blocks"].ranks == (("layers.weight", 3), ("layers.bias", 2))
    assert "ranks" not in repr(ens["blocks"])  # derived bookkeeping: a notebook's repr does not show it
    with pytest.raises(ValueError, match=r"'blocks.2.1.weight' addresses a member .* shape \(2, 3, 2, 2, 2\)"):
        ft.get(ens, "blocks.2.1.weight")
    got = jax.jit(jax.vmap(lambda m: ft.get(m, "blocks.2.1.weight")))(ens)
    np.testing.assert_allclose(got, np.asarray(ens["blocks"].layers.layers.weight)[:, 2, 1], rtol=0, atol=0)


def test_a_stack_pickled_or_saved_before_ranks_existed_reads_and_keeps_working():
    # ranks came later: a pickle or checkpoint without it derives them from its leaves (its
    # tree structure is then a Stack's built now: an optimizer state or a jitted step built for
    # a fresh model takes it); a restore's template gives its own; a stack whose leaves do not
    # have its n members on axis 0 (an old ensemble) reads None and refuses member paths.
    import pickle

    from functree.train.checkpoint._treespec import decode, encode

    m = model()  # the shared build(N) (not mutated: pickled, saved and read back)
    older = pickle.loads(pickle.dumps(m))
    older.blocks.__dict__.pop("ranks")  # what an earlier functree's pickle holds
    back = pickle.loads(pickle.dumps(older))
    assert back.blocks.ranks == m.blocks.ranks and jax.tree.structure(back) == jax.tree.structure(m)
    np.testing.assert_allclose(ft.get(back, "blocks.1.up.weight"), m.blocks.layers.up.weight[1], rtol=0, atol=0)
    arrays, spec = encode(m.blocks)
    stored = json.loads(json.dumps(spec))
    del stored["static"]["ranks"]
    assert decode(stored, arrays).ranks == m.blocks.ranks
    with tempfile.TemporaryDirectory() as d:
        ft.train.save(d + "/m", back)
        assert ft.train.load(d + "/m", m).blocks.ranks == m.blocks.ranks
    # built as one program (eagerly, each vmapped initializer compiled apart)
    ens = jax.jit(lambda: jax.vmap(lambda k: ft.nn.Stack(lambda kk: ft.nn.Dense(2, 2, key=kk), 3, key=k))(
        jax.random.split(jax.random.key(0), 2)))()
    old = ft.Module.replace(ens, ranks=None)
    with pytest.raises(ValueError, match=r"'0.weight' addresses a member .* shape \(2, 3, 2, 2\).*\(3, \.\.\.\)"):
        ft.get(old, "0.weight")


@contextlib.contextmanager
def counting_compiles():
    """``[n]``: the XLA compilations inside the block."""
    count = [0]

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class Gated(ft.Module):
    """A member taking an array (mask), a Python number (scale) and a flag as arguments."""

    dense: ft.nn.Dense

    def __init__(self, *, key):
        self.dense = ft.nn.Dense(D, D, jax.nn.tanh, key=key)

    def __call__(self, x, mask, *, scale=1.0, flip=False):
        # Python arithmetic on `scale`, whose type and sign matter (1 and True equal 1.0,
        # -0.0 equals 0.0 in Python): constants of the traced body.
        offset = (0.5 if isinstance(scale, bool) else 0.0) + math.copysign(0.25, scale)
        y = jnp.where(mask, self.dense(x), x) * float(scale) + offset
        return -y if flip else y


def test_an_eager_stack_compiles_its_scan_once_and_its_gradient_once():
    """main: the body was a fresh closure, so every eager call traced and compiled the scan
    again (1 compile per call; jax.grad 2). Now 0 after the first call, same values."""
    m = model()  # the shared build(N): an eager build would compile every initializer apart
    x = jax.device_put(np.random.default_rng(3).normal(size=(2, D)).astype(np.float32))  # NumPy's: no eager programs
    loss = lambda mm: jnp.sum(mm(x) ** 2)  # noqa: E731
    first, grad = m(x), jax.grad(loss)(m)  # compiles
    with counting_compiles() as count:
        for _ in range(3):
            again, grad_again = m(x), jax.grad(loss)(m)
        jax.block_until_ready((again, grad_again))
    assert count[0] == 0
    np.testing.assert_array_equal(again, first)
    for a, b in zip(jax.tree.leaves(grad_again), jax.tree.leaves(grad)):
        np.testing.assert_array_equal(a, b)
    # Under jit nothing changes: the same jaxpr, the scan in it (no inner jit).
    eqns = jax.make_jaxpr(lambda mm: mm.blocks(x))(m).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["scan"]


def test_an_eager_stack_passes_its_arguments_in_and_keys_plain_values_by_type():
    """The compiled scan is reused across calls: its array arguments are passed in (a
    closure would keep the first call's mask), and Python values are compiled in keyed by
    type and exact value (1.0, 1 and True; 0.0 and -0.0), as the unrolled members see them."""
    stack = ft.nn.Stack(lambda k: Gated(key=k), 3, key=jax.random.key(0))
    x = jax.device_put(np.random.default_rng(1).normal(size=(2, D)).astype(np.float32))  # NumPy's: no eager programs
    masks = [jax.device_put(np.arange(D) < 3), jax.device_put(np.arange(D) >= 5)]
    unrolled = [stack.unstack()(x, mask) for mask in masks]
    stack(x, masks[0])  # compiles
    with counting_compiles() as count:
        got = [stack(x, mask) for mask in masks]
        jax.block_until_ready(got)
    assert count[0] == 0  # main: 1 per call
    for y, y_ref in zip(got, unrolled):  # main: the same, compiled afresh
        np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-6)
    for scale in (1.0, 1, True, 0.0, -0.0, np.float32(2.0), 2):
        for flip in (False, True):
            np.testing.assert_allclose(stack(x, masks[1], scale=scale, flip=flip),
                                       stack.unstack()(x, masks[1], scale=scale, flip=flip), rtol=0, atol=1e-6)
    with counting_compiles() as count:
        stack(x, masks[1], scale=-0.0, flip=True)
    assert count[0] == 0


def test_an_eager_stack_with_a_function_argument_or_collected_state_takes_the_plain_scan():
    """Values the compiled scan cannot key (a function) and collected layer state run the
    scan as before: same values."""

    class Applied(ft.Module):
        dense: ft.nn.Dense

        def __call__(self, x, fn):
            return fn(self.dense(x))

    stack = ft.nn.Stack(lambda k: Applied(ft.nn.Dense(D, D, key=k)), 2, key=jax.random.key(0))
    x = jnp.ones((2, D))
    np.testing.assert_allclose(stack(x, jnp.tanh), stack.unstack()(x, jnp.tanh), rtol=0, atol=1e-6)
    norms = ft.nn.training(ft.nn.Stack(lambda k: ft.nn.BatchNorm(D), 2, key=jax.random.key(0)))
    y, state = ft.nn.collect_state(lambda s: s(x + jnp.arange(2.0)[:, None]), norms)
    y_ref, state_ref = ft.nn.collect_state(lambda s: s(x + jnp.arange(2.0)[:, None]), norms.unstack())
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-5)
    for name in ("running_mean", "running_variance"):
        members = [v for k, v in state_ref.items() if str(k).endswith(name)]
        (stacked,) = [v for k, v in state.items() if str(k).endswith(name)]
        np.testing.assert_allclose(stacked, np.stack([np.asarray(v) for v in members]), rtol=0, atol=1e-6)


def notebook():
    """A simulated notebook: ``run(cell)`` execs each cell into one ``__main__`` namespace."""
    ns = {"__name__": "__main__"}

    def run(cell):
        exec(compile(cell, "<cell>", "exec"), ns)
        return ns

    run("import jax, jax.numpy as jnp, numpy as np, functree as ft\nx = jnp.ones((2, 3))\n")
    return run


def _eager_matches_unrolled(ns):
    """The eager Stack call and its gradient against the members called one by one. XLA may
    round the scan otherwise than the calls one by one (jax 0.12's CPU: 2e-5 of the gradient
    at most, and a saturated tanh's derivative 0 called alone against 2.8e-4 in the scan,
    where the loss's scale 2 |y| |x| is 12), so each atol is 10x that spread of its scale;
    a stale program (0.575 off, its gradient 10.4 off) is far outside."""
    stack, x = ns["stack"], ns["x"]
    y, y_unrolled = stack(x), stack.unstack()(x)
    scale = max(1.0, _amax(y_unrolled))
    np.testing.assert_allclose(y, y_unrolled, rtol=0, atol=1e-5 * scale)
    grad = jax.grad(lambda s: jnp.sum(s(x) ** 2))(stack).layers.lin.weight
    unrolled = jax.grad(lambda s: jnp.sum(s.unstack()(x) ** 2))(stack).layers.lin.weight
    grad_scale = max(_amax(unrolled), 2 * scale * _amax(x))
    np.testing.assert_allclose(grad, unrolled, rtol=0, atol=2e-4 * grad_scale)


def test_an_eager_stack_reads_the_notebook_globals_and_methods_its_block_reads_now():
    """main: the compiled scan was keyed on structure only, so after ``GAIN = 0.0`` in a later
    cell (or ``Block.__call__`` patched, a class constant or a helper's global changed) an
    eager ``stack(x)`` returned the first cell's values (0.575 off, gradient 10.4 off)."""
    run = notebook()
    run("""
import types
GAIN, SHIFT = 1.0, 0.0
CFG = types.SimpleNamespace(power=1)
def shift(y):            # a user helper: its own global is read too
    return y ** CFG.power + SHIFT
class Block(ft.Module):
    lin: ft.nn.Dense
    SCALE = 1.0
    def squash(self, y):
        return jnp.tanh(y) * self.SCALE
    def __call__(self, x):
        return shift(self.squash(self.lin(x))) * GAIN
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    _eager_matches_unrolled(run("stack(x)"))
    with counting_compiles() as count:
        run("stack(x)")
    assert count[0] == 0  # nothing changed: the compiled scan is reused
    for cell in ("GAIN = 0.0", "GAIN = 5.0", "SHIFT = 0.5", "CFG.power = 3", "Block.SCALE = -2.0",
                 "Block.squash = lambda self, y: jnp.sin(y)",
                 "def patched(self, x):\n    return self.lin(x) * 0.25\nBlock.__call__ = patched"):
        _eager_matches_unrolled(run(cell))


def test_an_eager_stack_reads_the_globals_of_a_user_activation_held_as_a_static_field():
    run = notebook()
    run("""
SLOPE = 1.0
def act(y):
    return y * SLOPE
stack = ft.nn.Stack(lambda key: ft.nn.Dense(3, 3, act, key=key), n=2, key=jax.random.key(0))
""")
    for cell in ("pass", "SLOPE = -3.0", "def act(y):\n    return y * 0.0\nSLOPE = 2.0"):
        ns = run(cell)
        stack, x = ns["stack"], ns["x"]
        np.testing.assert_allclose(stack(x), stack.unstack()(x), rtol=0, atol=1e-5)
    ns = run("CYCLE = []\nCYCLE.append(CYCLE)\ndef act(y):\n    return y * len(CYCLE)\n"
             "stack = ft.nn.Stack(lambda key: ft.nn.Dense(3, 3, act, key=key), n=2, key=jax.random.key(0))")
    np.testing.assert_allclose(ns["stack"](ns["x"]), ns["stack"].unstack()(ns["x"]), rtol=0, atol=1e-5)


def _numpy_dense_stack(dense, x, gain):
    """Stacked ``Dense(3, 3)`` layers, each followed by ``y * gain``, in float64 NumPy."""
    y = np.asarray(x, np.float64)
    for w, b in zip(np.asarray(dense.weight, np.float64), np.asarray(dense.bias, np.float64)):
        y = (y @ w + b) * gain
    return y


def test_an_eager_stack_reads_the_globals_of_a_user_callable_object_held_as_a_static_field():
    """main: only functions held as static values were keyed, not the class of a callable
    object (``Dense(3, 3, Act())``), so after ``G2 = 2.0`` the eager stack kept G2 = 1.0's
    program (sum -1.6335, the members one by one -13.068)."""
    run = notebook()
    run("""
class Act:               # equal and hashed alike: the tree definition cannot tell them apart
    def __call__(self, y):
        return y * G2
    def __eq__(self, other):
        return type(other) is type(self)
    def __hash__(self):
        return 1
G2 = 1.0
stack = ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, Act(), key=k), 3, key=jax.random.key(0))
stack(x)
""")
    for cell, gain in (("pass", 1.0), ("G2 = 2.0", 2.0), ("Act.__call__ = lambda self, y: y * -G2", -2.0)):
        ns: dict[str, Any] = run(cell)
        stack, x = ns["stack"], ns["x"]
        expected = _numpy_dense_stack(stack.layers, x, gain)
        np.testing.assert_allclose(stack.unstack()(x), expected, rtol=0, atol=1e-4)
        np.testing.assert_allclose(stack(x), expected, rtol=0, atol=1e-4)  # main: G2 = 1.0's


def test_an_eager_stack_reads_the_globals_of_a_frozen_dataclass_activation_of_a_user_block():
    """main: a frozen dataclass activation reading ``GAIN`` kept the first cell's program in
    an eager stack of user blocks after ``GAIN = 0.0`` (the members gave 0)."""
    run = notebook()
    run("""
import dataclasses
GAIN = 1.0
@dataclasses.dataclass(frozen=True)
class Scaled:
    def __call__(self, y):
        return y * GAIN
class Block(ft.Module):
    lin: ft.nn.Dense
    act: object = ft.field(static=True, default=None)
    def __call__(self, x):
        return self.act(self.lin(x))
stack = ft.nn.Stack(lambda k: Block(ft.nn.Dense(3, 3, key=k), Scaled()), 2, key=jax.random.key(0))
stack(x)
""")
    for cell in ("GAIN = 0.0", "GAIN = -3.0"):
        ns: dict[str, Any] = run(cell)
        stack, x = ns["stack"], ns["x"]
        expected = _numpy_dense_stack(stack.layers.lin, x, ns["GAIN"])
        np.testing.assert_allclose(stack.unstack()(x), expected, rtol=0, atol=1e-4)
        _eager_matches_unrolled(ns)  # main: GAIN = 1.0's values and gradient


def test_an_eager_stack_whose_block_reads_a_large_numpy_global_takes_the_plain_scan():
    """A NumPy array over the size keyed by bytes may change in place: the call is traced
    afresh each time (never a stale constant)."""
    run = notebook()
    run("""
MASK = np.ones((64, 64), np.float32)
class Block(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        return self.lin(x) * MASK[None, 0, :3]
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    _eager_matches_unrolled(run("stack(x)"))
    ns = run("MASK[:] = 0.0")
    np.testing.assert_array_equal(ns["stack"](ns["x"]), np.zeros((2, 3), np.float32))


def test_an_eager_stack_reads_the_base_classes_code_a_super_call_runs():
    """Before: a block whose ``__call__`` returns ``super().__call__(x) + 0.1`` was keyed on
    its own code alone: after ``G = 3.0`` (read by the base's ``__call__``) or a patched
    ``Base.__call__`` the eager Stack returned the old values (1.20 off the Python loop)."""
    run = notebook()
    run("""
G = 1.0
class Base(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        return jnp.tanh(self.lin(x)) * G
class Mid(Base):
    pass
class Block(Mid):
    def __call__(self, x):
        return super().__call__(x) + 0.1
class Named(Base):
    def __call__(self, x):
        return super(Named, self).__call__(x) - 0.1
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    _eager_matches_unrolled(run("stack(x)"))
    for cell in ("G = 3.0", "Base.__call__ = lambda self, x: jnp.sin(self.lin(x)) * G",
                 "G = -2.0", "Mid.__call__ = lambda self, x: self.lin(x) * 0.5",
                 "stack = ft.nn.Stack(lambda key: Named(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))",
                 "Mid.__call__ = lambda self, x: self.lin(x) * 4.0"):
        _eager_matches_unrolled(run(cell))


def test_an_eager_stack_reads_the_attributes_of_a_user_module_its_block_names(tmp_path, monkeypatch):
    """Before: modules were keyed by identity, so after ``mycfg.GAIN = 3.0`` the eager Stack
    returned the old values (2.56 off the Python loop). A user's module (not an installed
    package) is keyed by the attributes of it the code names, followed as globals are."""
    (tmp_path / "f10_user_cfg.py").write_text("GAIN = 1.0\nPOWER = [1]\ndef shift(y):\n    return y + GAIN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = notebook()
    run("""
import f10_user_cfg as cfg
class Block(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        return cfg.shift(jnp.tanh(self.lin(x)) ** cfg.POWER[0]) * cfg.GAIN
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    _eager_matches_unrolled(run("stack(x)"))
    with counting_compiles() as count:
        run("stack(x)")
    assert count[0] == 0  # nothing changed: the compiled scan is reused
    for cell in ("cfg.GAIN = 3.0", "cfg.POWER[0] = 3", "cfg.shift = lambda y: y * 0.5"):
        _eager_matches_unrolled(run(cell))


def test_an_eager_stack_reads_the_call_a_mixin_gives_its_block():
    """A block whose ``__call__`` comes from a mixin (a class that is not a Module) runs it
    through ``ft.Module``'s label-aware forwarder: the key reads the mixin's code and globals."""
    run = notebook()
    run("""
G = 1.0
class Forward:
    def __call__(self, x):
        return jnp.tanh(self.lin(x)) * G
class Block(Forward, ft.Module):
    lin: ft.nn.Dense
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    for cell in ("stack(x)", "G = 3.0", "Forward.__call__ = lambda self, x: jnp.sin(self.lin(x)) * G", "G = 0.5"):
        _eager_matches_unrolled(run(cell))


def test_an_eager_stack_reads_the_init_of_a_user_class_its_block_builds():
    """Before: only a user class's ``__call__`` was read, so a block building ``Scaler()``
    whose ``__init__`` reads ``GAIN`` kept the first cell's program after ``GAIN = 0.2``
    (-0.151 against the Python loop's -0.001)."""
    run = notebook()
    run("""
GAIN = 1.0
class Scaler:
    def __init__(self):
        self.g = GAIN
    def __call__(self, y):
        return y * self.g
class Block(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        return jnp.tanh(Scaler()(self.lin(x)))
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    for cell in ("stack(x)", "GAIN = 0.2", "Scaler.__init__ = lambda self: setattr(self, 'g', -GAIN)", "GAIN = 3.0"):
        _eager_matches_unrolled(run(cell))


def test_an_eager_stack_reads_the_operators_of_a_user_object_its_block_uses():
    """Before: a global instance was keyed by identity and its fields, not by its class's
    code, so ``y * g`` (``Gain.__rmul__``) and ``g[0]`` (``Gain.__getitem__``) reading
    ``GAIN`` kept the first cell's program after ``GAIN = 0.2``."""
    run = notebook()
    run("""
GAIN = 1.0
class Gain:
    def __rmul__(self, y):
        return y * GAIN
    def __getitem__(self, i):
        return GAIN + i
g = Gain()
class Block(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        return jnp.tanh(self.lin(x) * g + g[0])
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    for cell in ("stack(x)", "GAIN = 0.2", "Gain.__getitem__ = lambda self, i: -GAIN", "GAIN = -1.5",
                 "Gain.__rmul__ = lambda self, y: y * 0.5"):
        _eager_matches_unrolled(run(cell))


def test_an_eager_stack_reads_the_default_factories_of_a_dataclass_its_block_builds():
    """Before: ``Cfg()`` in the block ran a dataclass ``__init__`` whose default factory
    reads ``G2`` (and whose defaults live in ``__init__.__defaults__``), neither read: the
    eager Stack kept the first cell's program. A Module's fields' factories (functree's
    generic ``__init__`` reads them from the fields) and ``__post_init__`` are read too."""
    run = notebook()
    run("""
import dataclasses
G2, G3 = 1.0, 0.0
@dataclasses.dataclass
class Cfg:
    gain: float = dataclasses.field(default_factory=lambda: G2)
    bias: float = 0.0
class Shift(ft.Module):
    by: float = ft.field(static=True, default_factory=lambda: G3)
    def __post_init__(self):
        object.__setattr__(self, "by", self.by * POST)
POST = 1.0
class Block(ft.Module):
    lin: ft.nn.Dense
    def __call__(self, x):
        c = Cfg()
        return jnp.tanh(self.lin(x) * c.gain + c.bias) + Shift().by
stack = ft.nn.Stack(lambda key: Block(ft.nn.Dense(3, 3, key=key)), n=2, key=jax.random.key(0))
""")
    for cell in ("stack(x)", "G2 = 2.0", "Cfg.__init__.__defaults__ = (Cfg.__init__.__defaults__[0], 0.7)",
                 "G3 = 0.25", "POST = -2.0"):
        _eager_matches_unrolled(run(cell))


class _Recip(ft.Module):
    """``x + 1 / (w * s) + [s is a Python float]`` with a static ``s``: ``s = -0.0`` gives ``-inf``."""

    w: jax.Array
    s: float = ft.field(static=True, default=1.0)

    def __call__(self, x):
        typed = 1.0 if isinstance(self.s, float) else 0.0  # what a block may do with the type
        return x + 1.0 / (self.w * self.s) + typed


def _recip_stack(s):
    return ft.nn.Stack(lambda k: _Recip(jnp.ones(2), s), 2, key=jax.random.key(0))  # pyright: ignore[reportCallIssue]


def test_an_eager_stack_keys_its_blocks_static_values_by_exact_type_and_value():
    """main: the compiled scan's key compared the blocks' static values with ==, so a stack
    with s = -0.0 after one with s = 0.0 ran the first's program ([inf inf], not the
    members' [-inf -inf]); s = 2.0 after np.float32(2.0) ran the program of a non-float."""
    x = jnp.zeros(2)
    _recip_stack(0.0)(x)  # fills the cache
    second = _recip_stack(-0.0)
    with np.errstate(divide="ignore"):
        expected = 0.0 + 2 * (1.0 / (np.ones(2) * -0.0) + 1.0)  # x + 1 / (w * s) + 1, twice: -inf
    np.testing.assert_array_equal(np.asarray(second[1](second[0](x))), expected)  # the members one by one
    np.testing.assert_array_equal(np.asarray(second(x)), expected)  # main: [inf inf]
    # the type of an equal value: a block's Python sees np.float32(2.0) is not a float
    _recip_stack(np.float32(2.0))(x)
    plain = _recip_stack(2.0)
    np.testing.assert_array_equal(np.asarray(plain(x)), np.asarray(plain.unstack()(x)))  # main: the float32's
    np.testing.assert_array_equal(np.asarray(plain(x)), np.full(2, 2 * (0.5 + 1.0)))


class _Knobs:  # a plain mutable object, hashed by identity
    def __init__(self):
        self.gain = 1.0


class _Knobbed(ft.Module):
    w: jax.Array
    knobs: _Knobs = ft.field(static=True, default=None)

    def __call__(self, x):
        return x * self.w * self.knobs.gain


def test_an_eager_stack_sees_a_mutable_static_object_edited_in_place():
    """main: a static field holding a mutable object keyed the compiled scan by identity, so
    after ``knobs.gain = 0.5`` the stack kept computing with 1.0 ([8 8], the members [1 1]).
    Such a value cannot be keyed by its state cheaply: the scan is traced afresh."""
    knobs = _Knobs()
    stack = ft.nn.Stack(lambda k: _Knobbed(jnp.full(2, 2.0), knobs), 3, key=jax.random.key(0))  # pyright: ignore[reportCallIssue]
    x = jnp.ones(2)
    np.testing.assert_array_equal(np.asarray(stack(x)), np.full(2, (2.0 * 1.0) ** 3))
    knobs.gain = 0.5
    np.testing.assert_array_equal(np.asarray(stack(x)), np.full(2, (2.0 * 0.5) ** 3))  # main: [8 8]
    np.testing.assert_array_equal(np.asarray(stack.unstack()(x)), np.full(2, 1.0))


class _Act(__import__("enum").Enum):
    DOUBLE = 2.0
    HALF = 0.5


class _Enumed(ft.Module):
    w: jax.Array
    act: _Act = ft.field(static=True, default=_Act.DOUBLE)

    def __call__(self, x):
        return x * self.w * self.act.value


def test_an_eager_stack_keys_enum_members_and_compiles_once(monkeypatch):
    """An Enum member as a static value was taken for a mutable object (Enum compares by
    identity): the eager Stack left every call to a fresh plain scan (729 ms a call for
    0.7). A member is one object, never edited: keyed by itself, one compiled scan per
    member, reused by later calls."""
    from functree.nn import _stack

    made = []
    original = _stack._compiled_scan

    def counted(*args, **kwargs):
        made.append(None)
        return original(*args, **kwargs)

    monkeypatch.setattr(_stack, "_compiled_scan", counted)
    x = jnp.ones(2)
    for act, expected in ((_Act.DOUBLE, (2.0 * 2.0) ** 3), (_Act.HALF, (2.0 * 0.5) ** 3)):
        stack = ft.nn.Stack(lambda k, act=act: _Enumed(jnp.full(2, 2.0), act), 3, key=jax.random.key(0))  # pyright: ignore[reportCallIssue]
        before = len(made)
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(stack(x)), np.full(2, expected))
        assert len(made) - before == 1, (act, len(made) - before)  # main: 0 (no compiled scan: a plain one a call)


def test_a_member_leaf_is_set_from_a_numpy_array_a_constant_under_vmap_and_under_grad():
    """A member's leaf set from an array of another type (a NumPy array; a constant under
    jax.vmap over an ensemble, the error's own fix; a tracer under jax.grad) was refused
    as BAD_MEMBER naming equal shapes: its check compared the leaves' Python types."""
    make = lambda k: ft.nn.Dense(2, 2, key=k)  # noqa: E731
    # the stack and the ensemble built in one program (eagerly, each initializer compiled apart)
    stack, ensemble = jax.jit(lambda: (ft.nn.Stack(make, 3, key=jax.random.key(0)), jax.vmap(
        lambda k: ft.nn.Stack(make, 3, key=k))(jax.random.split(jax.random.key(1), 4))))()
    out = ft.set(stack, "1.weight", np.zeros((2, 2), np.float32))
    np.testing.assert_array_equal(out.layers.weight[1], 0)
    np.testing.assert_array_equal(out.layers.weight[::2], stack.layers.weight[::2])
    out = jax.vmap(lambda s: ft.set(s, "1.weight", jnp.zeros((2, 2))))(ensemble)
    np.testing.assert_array_equal(out.layers.weight[:, 1], 0)
    np.testing.assert_array_equal(out.layers.weight[:, ::2], ensemble.layers.weight[:, ::2])
    grad = jax.grad(lambda w: jnp.sum(ft.set(stack, "1.weight", w).layers.weight * 3.0))(jnp.zeros((2, 2)))
    np.testing.assert_array_equal(grad, np.full((2, 2), 3.0, np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\) and dtype float32, got shape \(2, 2\) and dtype float64"):
        ft.set(stack, "1.weight", np.zeros((2, 2), np.float64))  # another dtype stays refused
