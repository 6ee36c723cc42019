"""Weight-decay metadata: every bias and every normalization parameter is ``decay=False``."""

import dataclasses

import functree as ft
from functree._module import PARAMETER, field_kind

NORMALIZATION = (ft.nn.LayerNorm, ft.nn.BatchNorm, ft.nn.RMSNorm, ft.nn.GroupNorm, ft.nn.InstanceNorm2D.__base__)
# Parameters exempt by their layer's design: PReLU's learned slope (torch's docs: "weight decay
# should not be used when learning a for good performance").
EXEMPT = {"PReLU.slope"}


def _layer_classes():
    classes = [getattr(ft.nn, name) for name in ft.nn.__all__]
    layers = [c for c in classes if isinstance(c, type) and issubclass(c, ft.Module) and dataclasses.is_dataclass(c)]
    for cls in list(layers):  # private bases (Conv's _Conv) through the public subclasses
        layers.extend(b for b in cls.__mro__ if dataclasses.is_dataclass(b) and issubclass(b, ft.Module) and b not in layers)
    return layers


def test_every_bias_and_normalization_parameter_is_excluded_from_decay():
    checked = []
    for cls in _layer_classes():
        for f in dataclasses.fields(cls):
            if field_kind(f) != PARAMETER:
                continue
            exempt = "bias" in f.name or issubclass(cls, NORMALIZATION) or f"{cls.__name__}.{f.name}" in EXEMPT
            assert f.metadata.get("decay", True) is (not exempt), f"{cls.__name__}.{f.name}"
            checked.append(f"{cls.__name__}.{f.name}")
    for name in ("Dense.bias", "Conv2D.bias", "Conv1DTranspose.bias", "GRUCell.input_bias", "GRUCell.hidden_bias",
                 "LSTMCell.bias", "LayerNorm.offset", "BatchNorm.scale", "RMSNorm.scale", "GroupNorm.offset",
                 "Dense.weight", "Embedding.embeddings", "PReLU.slope", "Bilinear.weight", "EmbeddingBag.embeddings"):
        assert name in checked, name


def test_attention_projection_biases_are_dense_biases(key):
    mha = ft.nn.MultiheadAttention(4, 2, key=key)
    assert type(mha.query_projection) is ft.nn.Dense
