"""training / inference / inferring: one static switch for a whole model."""

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn._mode import mode_free


class Net(ft.nn.Layer):
    body: ft.nn.Sequential
    extra: dict

    def __call__(self, x, *, key=None):
        return self.extra["drop"](self.body(x, key=key), key=key)


def _net(key):
    body = ft.nn.Sequential(ft.nn.Dense(2, 4, key=key), ft.nn.BatchNorm(4), ft.nn.Dropout(0.5))
    return Net(body, {"drop": ft.nn.Dropout(0.2)})


def test_switches_every_flag_and_keeps_parameters(key):
    net = _net(key)
    assert not ft.nn.is_training(net)
    t = ft.nn.training(net)
    assert t.body.layers[1].training and t.body.layers[2].training and t.extra["drop"].training
    assert t.body.layers[0].weight is net.body.layers[0].weight
    back = ft.nn.inference(t)
    assert not ft.nn.is_training(back)
    assert jax.tree.structure(back) == jax.tree.structure(net)


def test_inferring_function_and_method(key):
    t = ft.nn.training(_net(key))
    x = jax.random.normal(jax.random.key(1), (3, 2))
    expected = ft.nn.inference(t)(x)
    np.testing.assert_array_equal(ft.nn.inferring(t, x), expected)
    np.testing.assert_array_equal(t.inferring(x), expected)
    assert ft.nn.is_training(t)  # the model itself is unchanged


def test_switching_costs_no_recompilation_per_call(key):
    traces = []

    @jax.jit
    def f(m, x):
        traces.append(1)
        return ft.nn.collect_state(lambda m: m(x, key=jax.random.key(0)), m)

    net, x = _net(key), jnp.ones((3, 2))
    for _ in range(3):
        f(ft.nn.training(net), x)
        f(ft.nn.inference(net), x)
    assert len(traces) == 2


def test_models_without_flags_are_unchanged(key):
    dense = ft.nn.Dense(2, 2, key=key)
    assert jax.tree.structure(ft.nn.training(dense)) == jax.tree.structure(dense)
    assert ft.nn.training({"a": [dense]})["a"][0].weight is dense.weight


# --- foreign layers with Equinox's convention: a Python-bool leaf attribute `inference` ---

@jax.tree_util.register_pytree_with_keys_class
class _ForeignDropout:
    """A hand-written foreign layer shaped like eqx.nn.Dropout: `p` and `inference` are
    leaves (attribute keys), no functree or equinox class."""

    def __init__(self, p, inference=False):
        self.p, self.inference = p, inference

    def tree_flatten_with_keys(self):
        key = jax.tree_util.GetAttrKey
        return ((key("p"), self.p), (key("inference"), self.inference)), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __call__(self, x, *, key):
        if self.inference:
            return x
        keep = jax.random.bernoulli(key, 1 - self.p, x.shape)
        return jnp.where(keep, x / (1 - self.p), 0.0)


class Mixed(ft.Module):
    foreign: dict  # {"layer": a foreign layer} (a dict: a callable field would be taken for configuration)
    drop: ft.nn.Dropout

    def __call__(self, x, *, key):
        return self.drop(self.foreign["layer"](x, key=key), key=key)


def test_modes_set_foreign_inference_flags(key):
    m = Mixed({"layer": _ForeignDropout(0.5)}, ft.nn.Dropout(0.5))
    x = jnp.ones(8)
    inf = ft.nn.inference(m)
    assert inf.foreign["layer"].inference is True and not inf.drop.training
    np.testing.assert_array_equal(np.asarray(inf(x, key=key)), np.ones(8))  # was dropped: [0, 0, 2, 2, ...]
    tr = ft.nn.training(inf)
    assert tr.foreign["layer"].inference is False and tr.drop.training
    assert not bool(jnp.all(tr(x, key=key) == 1))
    nested = ft.nn.inference({"a": [_ForeignDropout(0.5)], "b": (1, True)})
    assert nested["a"][0].inference is True and nested["b"] == (1, True)  # a bool not named inference: kept


def test_a_foreign_flag_held_as_a_bool_array_is_set_and_another_kind_kept(key):
    """jax.device_put(model) makes an Equinox flag a 0-d bool array (eqx.nn.inference_mode
    sets it): set as a Python bool, so a jitted step does not trace it; an int is kept."""
    for flag in (jnp.asarray(False), np.bool_(False), np.asarray(False)):
        m = ft.nn.inference(_ForeignDropout(0.5, inference=flag))
        assert m.inference is True
    kept = ft.nn.inference(_ForeignDropout(0.5, inference=jnp.asarray(0)))
    assert isinstance(kept.inference, jax.Array) and int(kept.inference) == 0


def test_modes_match_equinox_inference_mode(key):
    eqx = pytest.importorskip("equinox")
    m = Mixed({"layer": eqx.nn.Sequential([eqx.nn.Dropout(0.5), eqx.nn.Dropout(0.1)])}, ft.nn.Dropout(0.5))
    for ours, theirs in [(ft.nn.inference(m), eqx.nn.inference_mode(m)),
                         (ft.nn.training(ft.nn.inference(m)), eqx.nn.inference_mode(m, value=False))]:
        assert [d.inference for d in ours.foreign["layer"].layers] == [d.inference for d in theirs.foreign["layer"].layers]
    np.testing.assert_array_equal(np.asarray(ft.nn.inference(m)(jnp.ones(8), key=key)), np.ones(8))


@pytest.mark.parametrize("declared, kind", [("no_derivative", "no-derivative"), ("plain", "parameter")])
def test_a_training_flag_that_is_not_static_is_named_with_its_declaration(declared, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.NonDifferentiableFieldWarning)  # the plain bool's own warning

        class Noisy(ft.Module):
            w: jax.Array
            training: bool = ft.field(no_derivative=True, default=False) if declared == "no_derivative" else False

            def __call__(self, x):
                return x @ self.w + (1.0 if self.training else 0.0)

    model = ft.nn.Sequential(Noisy(jnp.ones((2, 2))), ft.nn.Dropout(0.5))
    # was: ft.nn.training(model).layers[0].training stayed False, silently (its noise never on)
    for switch in (ft.nn.training, ft.nn.inference):
        with pytest.raises(TypeError, match=rf"Noisy\.training holds a bool but is a {kind} field, not a static one"):
            switch(model)
    with pytest.raises(TypeError, match=r"right:  training: bool = ft.field\(static=True, default=False\)"):
        ft.nn.training(jax.jit(lambda m: m)(model))  # the flag an array after jit: the same


def test_a_non_bool_field_named_training_is_left_alone():
    class Data(ft.Module):
        w: jax.Array
        training: jax.Array = ft.field(no_derivative=True)  # not a flag: data named so

    model = Data(jnp.ones(2), jnp.arange(3.0))
    assert ft.nn.training(model).training is model.training


# The switch's cache once mapped a tree definition to the FIRST model's switched definition;
# a later model whose definition was merely equal (static values compared with ==) came back
# with the first model's static values. Each test switches a first model (filling the
# cache), then checks the second against the model itself (built, never switched).
@dataclasses.dataclass(frozen=True)
class _Cfg:
    gain: float
    note: str = dataclasses.field(default="", compare=False)  # not part of equality


class _Scaled(ft.Module):
    w: jax.Array
    scale: float = ft.field(static=True, default=1.0)
    cfg: _Cfg = ft.field(static=True, default=_Cfg(1.0))
    drop: ft.nn.Dropout | None = None

    def __call__(self, x):
        return 1.0 / (self.w * x * self.scale)


def _scaled(scale, note="", dtype=jnp.float32):
    return _Scaled(jnp.ones(2, dtype), scale, _Cfg(1.0, note), ft.nn.Dropout(0.0))  # pyright: ignore[reportCallIssue]


@pytest.mark.parametrize("switch", [ft.nn.training, ft.nn.inference, lambda m: ft.nn.inference(ft.nn.training(m))])
def test_a_switched_model_keeps_its_own_static_values_after_an_equal_one(switch):
    switch(_scaled(0.0, "first"))  # fills the cache
    second = _scaled(-0.0, "second")
    out = switch(second)
    assert math.copysign(1.0, out.scale) == -1.0 and out.cfg.note == "second"  # was 0.0 and "first"
    expected = np.asarray(second(jnp.ones(2)))  # 1 / -0.0 = -inf, the unswitched model's own
    np.testing.assert_array_equal(np.asarray(out(jnp.ones(2))), expected)  # was [inf inf]
    np.testing.assert_array_equal(expected, np.full(2, -np.inf))


def test_a_switched_model_keeps_its_static_scalars_type_and_so_its_output_dtype():
    x = jnp.ones(2, jnp.bfloat16)
    ft.nn.training(_scaled(np.float32(0.5), dtype=jnp.bfloat16))  # a NumPy scalar: promotes to float32
    second = _scaled(0.5, dtype=jnp.bfloat16)  # a Python float: stays bfloat16
    out = ft.nn.training(second)
    assert type(out.scale) is float and out(x).dtype == second(x).dtype == jnp.bfloat16  # was float32
    np.testing.assert_array_equal(np.asarray(out(x), np.float32), np.asarray(second(x), np.float32))


def test_a_trainer_keeps_the_static_values_of_its_own_model():
    def loss(m, batch):
        return jnp.mean(m(batch).astype(jnp.float32) ** 2)

    x = jnp.ones(2, jnp.bfloat16)
    ft.train.Trainer(_scaled(np.float32(0.5), dtype=jnp.bfloat16), ft.optim.sgd(0.0), loss)
    second = _scaled(0.5, dtype=jnp.bfloat16)
    trainer = ft.train.Trainer(second, ft.optim.sgd(0.0), loss)
    assert type(trainer.model.scale) is float and trainer.inference_model(x).dtype == jnp.bfloat16  # was float32


def test_switching_a_second_model_of_one_definition_sets_every_flag(key):
    model = _net(key)
    ft.nn.training(_net(key))  # the cache filled by another model of the definition
    t = ft.nn.training(model)
    assert t.body.layers[1].training and t.body.layers[2].training and t.extra["drop"].training
    assert mode_free(model) is model  # no flag to clear: the tree itself
    assert not ft.nn.is_training(mode_free(t)) and jax.tree.structure(mode_free(t)) == jax.tree.structure(model)


@pytest.mark.parametrize("switch", ["inference", "training"])
def test_modes_switch_equinox_flags_inside_the_users_jit_as_equinox(switch):
    """Under the user's jax.jit an Equinox flag is a bool[] tracer: it was skipped, and
    equinox's `if inference` raised TracerBoolConversionError; eqx.nn.inference_mode sets it."""
    eqx = pytest.importorskip("equinox")
    x, key = jnp.arange(1.0, 9.0), jax.random.key(3)
    start = {"drop": eqx.nn.Dropout(0.5, inference=switch == "training")}
    ours = getattr(ft.nn, switch)
    theirs = lambda m: eqx.nn.inference_mode(m, value=switch == "inference")  # noqa: E731
    got = jax.jit(lambda m: ours(m)["drop"](x, key=key))(start)
    expected = jax.jit(lambda m: theirs(m)["drop"](x, key=key))(start)
    np.testing.assert_array_equal(got, expected)
    if switch == "inference":
        np.testing.assert_array_equal(got, x)
    else:
        assert set(np.unique(np.asarray(got) / np.asarray(x)).tolist()) <= {0.0, 2.0}


def test_is_training_counts_equinox_flags():
    eqx = pytest.importorskip("equinox")
    built = {"drop": eqx.nn.Dropout(0.1)}  # equinox builds it with inference=False: training
    assert ft.nn.is_training(built)
    assert not ft.nn.is_training(ft.nn.inference(built))
    assert ft.nn.is_training(ft.nn.training(ft.nn.inference(built)))
    assert not ft.nn.is_training({"drop": eqx.nn.Dropout(0.1, inference=True)})
