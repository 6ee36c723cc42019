"""ft.Module construction: a user's __init__ runs as for a normal class; JAX's unflatten
rebuilds instances without it; copies carry fields only."""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree._module import from_fields
from functree._tree import dotted_name

CALLS: list[tuple] = []


class Scaled(ft.Module):
    weight: jax.Array
    scale: float = ft.field(static=True)

    def __init__(self, weight, scale: float = 1.0):
        CALLS.append((weight, scale))
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.weight = jnp.asarray(weight, jnp.float32)
        self.scale = float(scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.scale * self.weight * x


class Sized(ft.Module):
    w: jax.Array
    n: int = ft.field(static=True)

    def __init__(self, size: int):
        self.w = jnp.ones(size)
        self.n = size


class Normed(ft.Module):
    w: jax.Array

    @functools.cached_property
    def norm(self) -> jax.Array:
        return jnp.sqrt(jnp.sum(self.w**2))


def test_wrong_keywords_for_a_custom_init_raise_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'w'"):
        Sized(w="not an array", n=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'w'"):
        Sized(w=jnp.ones(2), n=2)  # the fields' names are not arguments of __init__
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'size'"):
        Sized()
    assert Sized(size=3).w.shape == (3,)


def test_keyword_construction_with_field_names_runs_the_custom_init():
    CALLS.clear()
    s = Scaled(weight=[1.0, 2.0], scale=2.0)
    assert CALLS == [([1.0, 2.0], 2.0)]
    assert isinstance(s.weight, jax.Array) and s.weight.dtype == jnp.float32
    np.testing.assert_array_equal(s(jnp.ones(2)), [2.0, 4.0])
    with pytest.raises(ValueError, match="scale must be positive, got -1"):
        Scaled(weight=[1.0], scale=-1)


def test_jax_rebuilds_instances_without_calling_init():
    s = Scaled([1.0, 2.0], 3.0)
    CALLS.clear()
    rebuilt = [
        jax.jit(lambda m: m)(s),
        jax.tree.map(lambda x: x * 2, s),
        jax.grad(lambda m: m(jnp.ones(2)).sum())(s),
        jax.tree.unflatten(*reversed(jax.tree.flatten(s))),
    ]
    assert CALLS == []
    for r in rebuilt:
        assert type(r) is Scaled and r.scale == 3.0
        assert "__ft_building__" not in vars(r)
        with pytest.raises(ft.FrozenModuleError):
            r.weight = jnp.zeros(2)
    np.testing.assert_array_equal(rebuilt[1].weight, [2.0, 4.0])
    np.testing.assert_array_equal(rebuilt[2].weight, [3.0, 3.0])


def test_unflatten_accepts_any_leaves_without_checks():
    # Transforms put non-arrays in leaf positions (None, object(), tracers): no validation.
    s = Scaled([1.0], 2.0)
    marker = object()
    r = jax.tree.unflatten(jax.tree.structure(s), [marker])
    assert r.weight is marker and r.scale == 2.0


def test_construction_is_frozen_validated_and_leaves_no_marker():
    s = Scaled([1.0], 2.0)
    assert set(vars(s)) == {"weight", "scale"}
    with pytest.raises(ft.FrozenModuleError):
        s.scale = 3.0

    class Broken(ft.Module):
        w: jax.Array

        def __init__(self):
            self.w = jnp.ones(1)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Broken()


def test_static_values_are_the_aux_data_and_key_paths_are_unchanged():
    a, b, c = Scaled([1.0], 2.0), Scaled([5.0], 2.0), Scaled([1.0], 3.0)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.structure(a) != jax.tree.structure(c)
    assert hash(jax.tree.structure(a)) == hash(jax.tree.structure(b))
    model = ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), Scaled([1.0], 2.0))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    assert [jax.tree_util.keystr(p) for p in paths] == [
        ".layers[0].weight", ".layers[0].bias", ".layers[1].weight"
    ]
    assert [dotted_name(p) for p in paths] == ["layers.0.weight", "layers.0.bias", "layers.1.weight"]


def test_super_init_chain_and_inherited_custom_init():
    class Base(ft.Module):
        w: jax.Array
        n: int = ft.field(static=True)

        def __init__(self, n: int):
            self.w = jnp.zeros(n)
            self.n = n

    class Child(Base):
        extra: jax.Array = ft.field(default=None)

    class Grandchild(Base):
        u: jax.Array

        def __init__(self, n: int):
            super().__init__(n)
            self.u = jnp.ones(1)

    child = Child(2)  # inherits Base.__init__; extra gets its default
    assert child.n == 2 and child.extra is None
    with pytest.raises(TypeError):
        Child(w=jnp.ones(2), n=2, extra=None)  # Base.__init__ takes n only
    g = Grandchild(3)
    assert g.w.shape == (3,) and g.u.shape == (1,)
    assert set(vars(g)) == {"w", "n", "u"}
    assert inspect.signature(Child).parameters.keys() == {"n"}


def test_a_mixins_init_runs_and_its_assignments_must_be_fields():
    class Seeded:
        def __init__(self, seed: int):
            self.w = jax.random.normal(jax.random.key(seed), (2,))

    class Model(Seeded, ft.Module):
        w: jax.Array

    np.testing.assert_array_equal(Model(0).w, jax.random.normal(jax.random.key(0), (2,)))
    with pytest.raises(ft.FrozenModuleError):
        Model(0).w = jnp.zeros(2)


def _unannotated(cls) -> str:
    signature = inspect.signature(cls)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_generated_init_binds_fields_and_has_their_signature():
    class Point(ft.Module):
        x: jax.Array
        y: jax.Array = ft.field(default=None)
        tags: tuple = ft.field(static=True, default_factory=tuple)

    class Point3(Point):
        z: jax.Array = ft.field(default=None)

    assert list(inspect.signature(Point).parameters) == ["x", "y", "tags"]
    assert _unannotated(Point3) == "(x, y=None, tags=<factory tuple>, z=None)"
    assert inspect.signature(Point3).parameters["tags"].annotation is tuple  # the fields' annotations
    p = Point3(jnp.ones(1), z=jnp.zeros(1))
    assert p.y is None and p.tags == () and p.z.shape == (1,)
    with pytest.raises(TypeError, match="Point3 has no field 'w'"):
        Point3(w=1.0)

    class Labeled(Point):
        label: str = ft.field(static=True)  # no default after fields with defaults

    assert _unannotated(Labeled) == "(x, y=None, tags=<factory tuple>, *, label)"
    assert Labeled(jnp.ones(1), label="a").label == "a"
    with pytest.raises(TypeError, match=r"missing field\(s\) \['label'\]"):
        Labeled(jnp.ones(1))

    class Odd(ft.Module):
        self: jax.Array  # no signature fits; construction still binds

    assert Odd(self=jnp.ones(1)).self.shape == (1,)


def test_replace_drops_cached_properties():
    m = Normed(jnp.array([2.0, 0.0]))
    assert float(m.norm) == 2.0
    zeros = m.replace(w=jnp.zeros(2))
    assert "norm" not in vars(zeros)
    assert float(zeros.norm) == 0.0
    assert float(m.norm) == 2.0


def test_ft_set_and_tree_map_drop_cached_properties():
    m = Normed(jnp.array([3.0, 4.0]))
    assert float(m.norm) == 5.0
    assert float(ft.set(m, ".w", jnp.zeros(2)).norm) == 0.0
    nested = {"layer": m}
    assert float(ft.set(nested, "['layer'].w", jnp.ones(2))["layer"].norm) == pytest.approx(2**0.5)
    assert float(jax.tree.map(lambda x: 2 * x, m).norm) == 10.0
    assert float(jax.jit(lambda m: m.norm)(m)) == 5.0


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_copy_and_pickle_carry_fields_only_and_skip_init(clone):
    s = Scaled([1.0, 2.0], 2.0)
    CALLS.clear()
    c = clone(s)
    assert CALLS == [] and type(c) is Scaled and set(vars(c)) == {"weight", "scale"}
    np.testing.assert_array_equal(c.weight, s.weight)
    m = Normed(jnp.array([3.0, 4.0]))
    _ = m.norm
    assert set(vars(clone(m))) == {"w"}


def test_from_fields_builds_without_init():
    CALLS.clear()
    s = from_fields(Scaled, {"weight": jnp.ones(2), "scale": 5.0})
    assert CALLS == [] and s.scale == 5.0
    with pytest.raises(ft.FrozenModuleError):
        s.scale = 1.0


def test_callable_in_a_parameter_field_warns_on_construction_only():
    class Holder(ft.Module):
        w: jax.Array
        fn: object

    with pytest.warns(ft.NonDifferentiableFieldWarning, match="Holder.fn"):
        h = Holder(jnp.ones(1), jnp.sin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.tree.map(lambda x: x, h)  # rebuilding does not re-validate


# --- every ft.nn layer: keyword construction runs the layer's __init__ -----------------

K = jax.random.key(0)


def _cell() -> ft.nn.GRUCell:
    return ft.nn.GRUCell(2, 3, key=K)


# (positional call, the same call by keywords)
LAYER_CALLS: dict[type, tuple[Callable[[], ft.Module], Callable[[], ft.Module]]] = {
    ft.nn.Dense: (
        lambda: ft.nn.Dense(2, 3, jax.nn.relu, False, key=K),
        lambda: ft.nn.Dense(input_size=2, output_size=3, activation=jax.nn.relu, use_bias=False, key=K),
    ),
    ft.nn.Lambda: (lambda: ft.nn.Lambda(jnp.tanh), lambda: ft.nn.Lambda(fn=jnp.tanh)),
    ft.nn.WeightNorm: (lambda: ft.nn.WeightNorm(ft.nn.Dense(2, 3, key=K), 0),
                       lambda: ft.nn.WeightNorm(layer=ft.nn.Dense(2, 3, key=K), dim=0)),
    ft.nn.SpectralNorm: (lambda: ft.nn.SpectralNorm(ft.nn.Dense(2, 3, key=K), 2, key=K),
                         lambda: ft.nn.SpectralNorm(layer=ft.nn.Dense(2, 3, key=K), n_power_iterations=2, key=K)),
    ft.nn.MLP: (
        lambda: ft.nn.MLP(2, 1, 4, 2, key=K),
        lambda: ft.nn.MLP(in_size=2, out_size=1, width_size=4, depth=2, key=K),
    ),
    **{
        cls: (
            lambda cls=cls: cls(2, 4, 3, 1, "VALID", key=K),
            lambda cls=cls: cls(in_channels=2, out_channels=4, kernel_size=3, strides=1, padding="VALID", key=K),
        )
        for cls in (ft.nn.Conv1D, ft.nn.Conv2D, ft.nn.Conv3D, ft.nn.Conv1DTranspose, ft.nn.Conv2DTranspose,
                    ft.nn.Conv3DTranspose)
    },
    **{
        cls: (lambda cls=cls: cls(3, 1, "same"), lambda cls=cls: cls(pool_size=3, strides=1, padding="same"))
        for cls in (ft.nn.MaxPool1D, ft.nn.MaxPool2D, ft.nn.MaxPool3D, ft.nn.AvgPool1D, ft.nn.AvgPool2D, ft.nn.AvgPool3D)
    },
    **{
        cls: (lambda cls=cls: cls(2), lambda cls=cls: cls(output_size=2))
        for cls in (ft.nn.AdaptiveAvgPool1D, ft.nn.AdaptiveAvgPool2D, ft.nn.AdaptiveAvgPool3D, ft.nn.AdaptiveMaxPool1D,
                    ft.nn.AdaptiveMaxPool2D, ft.nn.AdaptiveMaxPool3D)
    },
    **{
        cls: (cls, cls)
        for cls in (ft.nn.GlobalMaxPool1D, ft.nn.GlobalMaxPool2D, ft.nn.GlobalMaxPool3D, ft.nn.GlobalAvgPool1D,
                    ft.nn.GlobalAvgPool2D, ft.nn.GlobalAvgPool3D)
    },
    ft.nn.Flatten: (lambda: ft.nn.Flatten(2), lambda: ft.nn.Flatten(batch_dims=2)),
    ft.nn.Dropout: (
        lambda: ft.nn.Dropout(0.25, training=True),
        lambda: ft.nn.Dropout(rate=0.25, training=True),
    ),
    ft.nn.LayerNorm: (lambda: ft.nn.LayerNorm(4, 1e-3), lambda: ft.nn.LayerNorm(shape=4, epsilon=1e-3)),
    ft.nn.BatchNorm: (
        lambda: ft.nn.BatchNorm(4, -1, 0.9),
        lambda: ft.nn.BatchNorm(feature_count=4, axis=-1, momentum=0.9),
    ),
    ft.nn.Embedding: (
        lambda: ft.nn.Embedding(5, 3, key=K),
        lambda: ft.nn.Embedding(vocabulary_size=5, embedding_size=3, key=K),
    ),
    ft.nn.GRUCell: (_cell, lambda: ft.nn.GRUCell(input_size=2, hidden_size=3, key=K)),
    ft.nn.SimpleRNNCell: (
        lambda: ft.nn.SimpleRNNCell(2, 3, key=K, activation=jax.nn.relu),
        lambda: ft.nn.SimpleRNNCell(input_size=2, hidden_size=3, key=K, activation=jax.nn.relu),
    ),
    ft.nn.LSTMCell: (
        lambda: ft.nn.LSTMCell(2, 3, key=K),
        lambda: ft.nn.LSTMCell(input_size=2, hidden_size=3, key=K),
    ),
    ft.nn.RNN: (lambda: ft.nn.RNN(_cell(), -3, True), lambda: ft.nn.RNN(cell=_cell(), time_axis=-3, reverse=True)),
    ft.nn.MultiheadAttention: (
        lambda: ft.nn.MultiheadAttention(4, 2, key=K),
        lambda: ft.nn.MultiheadAttention(query_size=4, num_heads=2, key=K),
    ),
    ft.nn.KVCache: (
        lambda: ft.nn.KVCache(jnp.zeros((1, 4, 2, 2)), jnp.ones((1, 4, 2, 2))),
        lambda: ft.nn.KVCache(keys=jnp.zeros((1, 4, 2, 2)), values=jnp.ones((1, 4, 2, 2))),
    ),
    ft.nn.LoraDense: (
        lambda: ft.nn.LoraDense(ft.nn.Dense(2, 3, key=K), 2, 4.0, 0.0, key=K),
        lambda: ft.nn.LoraDense(dense=ft.nn.Dense(2, 3, key=K), rank=2, alpha=4.0, dropout=0.0, key=K),
    ),
}


def _dense(key: jax.Array) -> ft.Module:
    return ft.nn.Dense(2, 2, key=key)


def _tied() -> ft.Module:
    return ft.nn.Sequential(ft.nn.Dense(2, 2, key=K), ft.nn.Dense(2, 2, key=K))


# Layers newer than this file's first version: covered wherever ft.nn has them.
_NEWER: dict[str, tuple[Callable[[type], ft.Module], Callable[[type], ft.Module]]] = {
    "RMSNorm": (lambda c: c(4, 1e-5), lambda c: c(shape=4, epsilon=1e-5)),
    "GroupNorm": (lambda c: c(2, 4, 1e-5), lambda c: c(groups=2, channels=4, epsilon=1e-5)),
    "RotaryEmbedding": (lambda c: c(4, 100.0, seq_axis=-3), lambda c: c(size=4, base=100.0, seq_axis=-3)),
    "Shared": (
        lambda c: c(_tied(), {".layers[1].weight": ".layers[0].weight"}),
        lambda c: c(model=_tied(), ties={".layers[1].weight": ".layers[0].weight"}),
    ),
    "Stack": (lambda c: c(_dense, 3, key=K, remat=True), lambda c: c(make=_dense, n=3, key=K, remat=True)),
    "Remat": (lambda c: c(_tied(), policy="dots_saveable"), lambda c: c(layer=_tied(), policy="dots_saveable")),
    "Bidirectional": (lambda c: c(ft.nn.RNN(_cell()), ft.nn.RNN(_cell(), reverse=True)),
                      lambda c: c(forward=ft.nn.RNN(_cell()), backward=ft.nn.RNN(_cell(), reverse=True))),
    "StackedRNN": (lambda c: c([ft.nn.RNN(_cell())], 0.1), lambda c: c(layers=[ft.nn.RNN(_cell())], dropout=0.1)),
    **{name: (lambda c: c(2, 3, 2, key=K, bidirectional=True, batch_first=True),
              lambda c: c(input_size=2, hidden_size=3, num_layers=2, key=K, bidirectional=True, batch_first=True))
       for name in ("LSTM", "GRU", "SimpleRNN")},
    **{f"MaxUnpool{n}D": (lambda c: c(2, 2, 0), lambda c: c(pool_size=2, strides=2, padding=0)) for n in (1, 2, 3)},
    # torch's padding, resampling, instance-norm, channel-dropout and LP pooling layers (session 28)
    **{f"{kind}Pad{n}D": (lambda c: c(((1, 2),) * c._rank), lambda c: c(padding=((1, 2),) * c._rank))
       for kind in ("Zero", "Reflection", "Replication", "Circular") for n in (1, 2, 3)},
    **{f"ConstantPad{n}D": (lambda c: c(1, 0.5), lambda c: c(padding=1, value=0.5)) for n in (1, 2, 3)},
    **{f"Upsample{n}D": (lambda c: c(None, 2.0, "area", None, True, False),
                         lambda c: c(size=None, scale_factor=2.0, mode="area", align_corners=None,
                                     recompute_scale_factor=True, antialias=False)) for n in (1, 2, 3)},
    "UpsamplingNearest2D": (lambda c: c(4), lambda c: c(size=4)),
    "UpsamplingBilinear2D": (lambda c: c(None, 2), lambda c: c(size=None, scale_factor=2)),
    "PixelShuffle": (lambda c: c(2), lambda c: c(factor=2)),
    "PixelUnshuffle": (lambda c: c(2), lambda c: c(factor=2)),
    "ChannelShuffle": (lambda c: c(3), lambda c: c(groups=3)),
    "Unflatten": (lambda c: c(1, (2, -1)), lambda c: c(axis=1, shape=(2, -1))),
    "Unfold": (lambda c: c(2, 1, 1, 2), lambda c: c(kernel_size=2, dilation=1, padding=1, strides=2)),
    "Fold": (lambda c: c(4, 2, 1, 1, 2), lambda c: c(output_size=4, kernel_size=2, dilation=1, padding=1, strides=2)),
    **{f"LPPool{n}D": (lambda c: c(2, 3, 2, True), lambda c: c(norm_type=2, pool_size=3, strides=2, ceil_mode=True))
       for n in (1, 2, 3)},
    **{f"InstanceNorm{n}D": (lambda c: c(4, 1e-3), lambda c: c(channels=4, epsilon=1e-3)) for n in (1, 2, 3)},
    "LocalResponseNorm": (lambda c: c(3, 1e-3, 0.5, 2.0), lambda c: c(size=3, alpha=1e-3, beta=0.5, k=2.0)),
    **{name: (lambda c: c(0.2), lambda c: c(rate=0.2))
       for name in ("Dropout1D", "Dropout2D", "Dropout3D", "AlphaDropout", "FeatureAlphaDropout")},
    # torch's Transformer family, PReLU, Bilinear and EmbeddingBag (session 28)
    **{name: (lambda c: c(4, 2, 8, 0.1, "gelu", 1e-5, True, True, False, key=K),
              lambda c: c(d_model=4, nhead=2, dim_feedforward=8, dropout=0.1, activation="gelu", layer_norm_eps=1e-5,
                          batch_first=True, norm_first=True, bias=False, key=K))
       for name in ("TransformerEncoderLayer", "TransformerDecoderLayer")},
    "TransformerEncoder": (
        lambda c: c(ft.nn.TransformerEncoderLayer(4, 2, 8, key=K), 2, ft.nn.LayerNorm(4), key=K),
        lambda c: c(encoder_layer=ft.nn.TransformerEncoderLayer(4, 2, 8, key=K), num_layers=2,
                    norm=ft.nn.LayerNorm(4), key=K)),
    "TransformerDecoder": (
        lambda c: c(ft.nn.TransformerDecoderLayer(4, 2, 8, key=K), 2, ft.nn.LayerNorm(4), key=K),
        lambda c: c(decoder_layer=ft.nn.TransformerDecoderLayer(4, 2, 8, key=K), num_layers=2,
                    norm=ft.nn.LayerNorm(4), key=K)),
    "Transformer": (
        lambda c: c(4, 2, 1, 1, 8, 0.0, "relu", key=K),
        lambda c: c(d_model=4, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8, dropout=0.0,
                    activation="relu", key=K)),
    "PReLU": (lambda c: c(3, 0.1), lambda c: c(num_parameters=3, init=0.1)),
    "Bilinear": (lambda c: c(2, 3, 4, False, key=K), lambda c: c(in1_features=2, in2_features=3, out_features=4,
                                                               bias=False, key=K)),
    "EmbeddingBag": (lambda c: c(5, 3, "sum", key=K), lambda c: c(vocabulary_size=5, embedding_size=3, mode="sum", key=K)),
    "SparseMoE": (lambda c: c(4, 6, num_experts=3, top_k=2, key=K),
                  lambda c: c(d=4, hidden=6, num_experts=3, top_k=2, key=K)),
    "Experts": (lambda c: c(4, 6, 3, key=K), lambda c: c(d=4, hidden=6, num_experts=3, key=K)),
    "LoraExperts": (lambda c: c(ft.nn.Experts(4, 6, 3, key=K), 2, 4.0, key=K, fields=("down_proj",)),
                    lambda c: c(experts=ft.nn.Experts(4, 6, 3, key=K), rank=2, alpha=4.0, key=K, fields=("down_proj",))),
    "LoraParameter": (lambda c: c(jnp.ones((3, 4, 6)), 2, 4.0, key=K),
                      lambda c: c(weight=jnp.ones((3, 4, 6)), rank=2, alpha=4.0, key=K)),
    "RReLU": (lambda c: c(0.1, 0.3, training=True), lambda c: c(lower=0.1, upper=0.3, training=True)),
    "FractionalMaxPool2D": (lambda c: c((2, 3), (4, 5), None, True),
                            lambda c: c(pool_size=(2, 3), output_size=(4, 5), return_indices=True)),
    "FractionalMaxPool3D": (lambda c: c(2, None, 0.5), lambda c: c(pool_size=2, output_ratio=0.5)),
    "AdaptiveLogSoftmaxWithLoss": (
        lambda c: c(8, 20, [4, 10], 2.0, True, key=K),
        lambda c: c(in_features=8, n_classes=20, cutoffs=[4, 10], div_value=2.0, head_bias=True, key=K)),
}
for _name, (_positional, _keywords) in _NEWER.items():
    if hasattr(ft.nn, _name):
        _cls = getattr(ft.nn, _name)
        LAYER_CALLS[_cls] = (functools.partial(_positional, _cls), functools.partial(_keywords, _cls))


def _layer_classes() -> list[type]:
    return [
        getattr(ft.nn, n)
        for n in ft.nn.__all__
        if inspect.isclass(getattr(ft.nn, n)) and issubclass(getattr(ft.nn, n), ft.Module)
        and getattr(ft.nn, n) is not ft.nn.Layer
    ]


def test_every_layer_class_is_covered():
    # Sequential takes its layers positionally only (``Sequential(*layers)``).
    assert set(_layer_classes()) == set(LAYER_CALLS) | {ft.nn.Sequential}


@pytest.mark.parametrize("cls", list(LAYER_CALLS), ids=lambda c: c.__name__)
def test_keyword_construction_equals_positional_construction(cls):
    positional, keywords = (make() for make in LAYER_CALLS[cls])
    assert type(keywords) is cls
    assert jax.tree.structure(keywords) == jax.tree.structure(positional)
    for a, b in zip(jax.tree.leaves(keywords), jax.tree.leaves(positional)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", _layer_classes(), ids=lambda c: c.__name__)
def test_field_names_as_keywords_go_through_the_layers_init(cls):
    """Passing the fields themselves is either the layer's own __init__ call (which runs,
    and may reject the values) or a TypeError: never a silent bypass of __init__."""
    layer = LAYER_CALLS[cls][0]() if cls in LAYER_CALLS else ft.nn.Sequential(ft.nn.Lambda(jnp.tanh))
    fields = dict(vars(layer))
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = {n for n, p in inspect.signature(cls).parameters.items() if p.kind not in kinds}
    if set(fields) <= params:
        try:
            again = cls(**fields)
        except ValueError as e:  # the layer's __init__ validated the stored form
            assert cls.__name__ == "Shared", e
        else:
            assert jax.tree.structure(again) == jax.tree.structure(layer)
    else:
        with pytest.raises(TypeError):
            cls(**fields)


def test_pool_by_keywords_normalizes_its_sizes():
    pool = ft.nn.MaxPool2D(pool_size=3, strides=1, padding="same")
    assert pool.pool_size == (3, 3) and pool.strides == (1, 1) and pool.padding == "SAME"
    assert ft.nn.MaxPool2D(pool_size=3, strides=1, padding="same")(jnp.ones((1, 4, 4, 1))).shape == (1, 4, 4, 1)


@pytest.mark.parametrize("make", [
    lambda: ft.nn.Dropout(1.5),
    lambda: ft.nn.Dropout(rate=1.5),
    lambda: ft.nn.Dropout(rate=1.5, training=True),
    lambda: ft.nn.Dropout(rate=-0.1, training=True),
    lambda: ft.nn.Dropout(rate=float("nan")),
])
def test_dropout_rate_outside_zero_one_is_a_value_error(make):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "rate must be in [0, 1), got" in message
    assert "wrong:  ft.nn.Dropout(rate=" in message and "right:  ft.nn.Dropout(rate=0.1)" in message
