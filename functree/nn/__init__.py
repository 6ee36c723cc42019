"""Layers: every layer is a :class:`functree.Module` (and a :class:`functree.nn.Layer`).

Training vs inference is a static flag switched for a whole model with
``ft.nn.training(model)`` / ``ft.nn.inference(model)`` (inference is the default);
layer state such as BatchNorm's running statistics travels explicitly through
``ft.nn.collect_state`` and ``ft.nn.apply_state`` (in a hand-written loop:
``ft.nn.value_with_gradient_and_state``); values a layer computes on the way (a sparse
MoE's router logits) through ``ft.nn.record_intermediate`` and ``ft.nn.collect_intermediates``.

``ft.nn`` holds layers. Converting models and generating text live in the packages built
on it, :mod:`functree.hf`, :mod:`functree.interop` and :mod:`functree.generation`; their
public functions are also names here (``ft.nn.from_hf``, ``ft.nn.generate``...), where they
were first documented, looked up on first use (:data:`ELSEWHERE`): this package cannot
import the packages that import it.
"""

from typing import TYPE_CHECKING

from functree._activations import (
    celu,
    elu,
    gelu,
    gelu_10,
    gelu_exact,
    glu,
    hard_sigmoid,
    hard_swish,
    hard_tanh,
    identity,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    mish,
    quick_gelu,
    relu,
    relu2,
    relu6,
    selu,
    sigmoid,
    silu,
    softmax,
    softplus,
    swish,
    tanh,
)
from functree._lazy import lazy_names
from functree.nn import initializers
from functree.nn._adaptive_softmax import AdaptiveLogSoftmaxWithLoss, AdaptiveSoftmaxOutput
from functree.nn._attention import KVCache, MultiheadAttention
from functree.nn._bilinear import Bilinear
from functree.nn._check import LayerInputError
from functree.nn._conv import (
    Conv1D,
    Conv1DTranspose,
    Conv2D,
    Conv2DTranspose,
    Conv3D,
    Conv3DTranspose,
)
from functree.nn._dropout import (
    AlphaDropout,
    Dropout,
    Dropout1D,
    Dropout2D,
    Dropout3D,
    FeatureAlphaDropout,
)
from functree.nn._embedding import Embedding
from functree.nn._embedding_bag import EmbeddingBag
from functree.nn._fold import Fold, Unfold
from functree.nn._fractional_pool import (
    FractionalMaxPool2D,
    FractionalMaxPool3D,
    fractional_intervals,
)
from functree.nn._grid_sample import affine_grid, grid_sample
from functree.nn._linear import Dense
from functree.nn._lora import LoraBaseWarning, LoraDense, lora, merge_lora
from functree.nn._lora_experts import LoraExperts, LoraParameter
from functree.nn._lp_pool import LPPool1D, LPPool2D, LPPool3D
from functree.nn._mlp import MLP
from functree.nn._mode import Layer, inference, inferring, is_training, training
from functree.nn._moe import Experts, SparseMoE, load_balancing_loss
from functree.nn._normalization import (
    BatchNorm,
    GroupNorm,
    InstanceNorm1D,
    InstanceNorm2D,
    InstanceNorm3D,
    LayerNorm,
    LocalResponseNorm,
    RMSNorm,
)
from functree.nn._padding import (
    CircularPad1D,
    CircularPad2D,
    CircularPad3D,
    ConstantPad1D,
    ConstantPad2D,
    ConstantPad3D,
    ReflectionPad1D,
    ReflectionPad2D,
    ReflectionPad3D,
    ReplicationPad1D,
    ReplicationPad2D,
    ReplicationPad3D,
    ZeroPad1D,
    ZeroPad2D,
    ZeroPad3D,
)
from functree.nn._pooling import (
    AdaptiveAvgPool1D,
    AdaptiveAvgPool2D,
    AdaptiveAvgPool3D,
    AdaptiveMaxPool1D,
    AdaptiveMaxPool2D,
    AdaptiveMaxPool3D,
    AvgPool1D,
    AvgPool2D,
    AvgPool3D,
    Flatten,
    GlobalAvgPool1D,
    GlobalAvgPool2D,
    GlobalAvgPool3D,
    GlobalMaxPool1D,
    GlobalMaxPool2D,
    GlobalMaxPool3D,
    MaxPool1D,
    MaxPool2D,
    MaxPool3D,
    MaxUnpool1D,
    MaxUnpool2D,
    MaxUnpool3D,
)
from functree.nn._prelu import PReLU
from functree.nn._recurrent import RNN, GRUCell, LSTMCell, LSTMState, SimpleRNNCell
from functree.nn._recurrent_layers import GRU, LSTM, Bidirectional, SimpleRNN, StackedRNN
from functree.nn._remat import Remat
from functree.nn._resample import (
    Upsample1D,
    Upsample2D,
    Upsample3D,
    UpsamplingBilinear2D,
    UpsamplingNearest2D,
    interpolate,
)
from functree.nn._rotary import RopeScaling, RotaryEmbedding, apply_rotary
from functree.nn._rrelu import RReLU
from functree.nn._sequential import Lambda, Sequential
from functree.nn._shared import Shared
from functree.nn._shuffle import ChannelShuffle, PixelShuffle, PixelUnshuffle, Unflatten
from functree.nn._similarity import cosine_similarity, normalize, pairwise_distance
from functree.nn._stack import Stack
from functree.nn._state import (
    UncollectedStateWarning,
    apply_state,
    collect_intermediates,
    collect_state,
    record_intermediate,
    record_state,
    value_with_gradient_and_state,
)
from functree.nn._transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from functree.nn._update_bn import update_bn
from functree.nn._weight_norm import SpectralNorm, WeightNorm

if TYPE_CHECKING:  # what ELSEWHERE's names are, for type checkers and editors
    from functree.generation import generate
    from functree.hf import from_hf, load_lora, save_hf, save_lora, to_hf_state_dict
    from functree.interop import load_torch_state_dict, torch_state_dict

# The public names of ft.nn that live in a package above it: name -> that package.
ELSEWHERE = {
    "generate": "functree.generation",
    "from_hf": "functree.hf",
    "to_hf_state_dict": "functree.hf",
    "save_hf": "functree.hf",
    "load_lora": "functree.hf",
    "save_lora": "functree.hf",
    "load_torch_state_dict": "functree.interop",
    "torch_state_dict": "functree.interop",
}


# ``ft.nn.from_hf`` and the other names of ELSEWHERE: the object itself, from its package
# (imported on this first read, as ``import functree`` imports no subpackage).
__getattr__, __dir__ = lazy_names(__name__, ELSEWHERE)
del lazy_names


__all__ = [
    # base, modes and state
    "Layer",
    "LayerInputError",
    "training",
    "inference",
    "inferring",
    "is_training",
    "record_state",
    "collect_state",
    "apply_state",
    "value_with_gradient_and_state",
    "UncollectedStateWarning",
    "record_intermediate",
    "collect_intermediates",
    "update_bn",
    # layers
    "Dense",
    "MLP",
    "SparseMoE",
    "Experts",
    "load_balancing_loss",
    "Sequential",
    "Lambda",
    "Shared",
    "Stack",
    "Remat",
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "MaxPool1D",
    "MaxPool2D",
    "MaxPool3D",
    "AvgPool1D",
    "AvgPool2D",
    "AvgPool3D",
    "GlobalMaxPool1D",
    "GlobalMaxPool2D",
    "GlobalMaxPool3D",
    "GlobalAvgPool1D",
    "GlobalAvgPool2D",
    "GlobalAvgPool3D",
    "AdaptiveAvgPool1D",
    "AdaptiveAvgPool2D",
    "AdaptiveAvgPool3D",
    "AdaptiveMaxPool1D",
    "AdaptiveMaxPool2D",
    "AdaptiveMaxPool3D",
    "MaxUnpool1D",
    "MaxUnpool2D",
    "MaxUnpool3D",
    "Flatten",
    "Unflatten",
    "LPPool1D",
    "LPPool2D",
    "LPPool3D",
    "ZeroPad1D",
    "ZeroPad2D",
    "ZeroPad3D",
    "ConstantPad1D",
    "ConstantPad2D",
    "ConstantPad3D",
    "ReflectionPad1D",
    "ReflectionPad2D",
    "ReflectionPad3D",
    "ReplicationPad1D",
    "ReplicationPad2D",
    "ReplicationPad3D",
    "CircularPad1D",
    "CircularPad2D",
    "CircularPad3D",
    "Upsample1D",
    "Upsample2D",
    "Upsample3D",
    "UpsamplingNearest2D",
    "UpsamplingBilinear2D",
    "PixelShuffle",
    "PixelUnshuffle",
    "ChannelShuffle",
    "Fold",
    "Unfold",
    "Dropout",
    "Dropout1D",
    "Dropout2D",
    "Dropout3D",
    "AlphaDropout",
    "FeatureAlphaDropout",
    "LayerNorm",
    "BatchNorm",
    "RMSNorm",
    "GroupNorm",
    "InstanceNorm1D",
    "InstanceNorm2D",
    "InstanceNorm3D",
    "LocalResponseNorm",
    "Embedding",
    "EmbeddingBag",
    "Bilinear",
    "PReLU",
    "RReLU",
    "FractionalMaxPool2D",
    "FractionalMaxPool3D",
    "fractional_intervals",
    "AdaptiveLogSoftmaxWithLoss",
    "AdaptiveSoftmaxOutput",
    "WeightNorm",
    "SpectralNorm",
    "SimpleRNNCell",
    "GRUCell",
    "LSTMCell",
    "LSTMState",
    "RNN",
    "Bidirectional",
    "StackedRNN",
    "LSTM",
    "GRU",
    "SimpleRNN",
    "MultiheadAttention",
    "KVCache",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
    "RotaryEmbedding",
    "RopeScaling",
    "apply_rotary",
    # generation
    "generate",
    # torch interop
    "load_torch_state_dict",
    "torch_state_dict",
    "from_hf",
    "to_hf_state_dict",
    "save_hf",
    # LoRA
    "LoraDense",
    "LoraExperts",
    "LoraParameter",
    "LoraBaseWarning",
    "lora",
    "merge_lora",
    "save_lora",
    "load_lora",
    # activations and initializers
    "identity",
    "relu",
    "relu6",
    "leaky_relu",
    "elu",
    "celu",
    "selu",
    "gelu",
    "gelu_exact",
    "gelu_10",
    "quick_gelu",
    "relu2",
    "glu",
    "sigmoid",
    "log_sigmoid",
    "hard_sigmoid",
    "hard_swish",
    "hard_tanh",
    "silu",
    "swish",
    "mish",
    "softplus",
    "softmax",
    "log_softmax",
    "tanh",
    "cosine_similarity",
    "normalize",
    "pairwise_distance",
    "interpolate",
    "grid_sample",
    "affine_grid",
    "initializers",
]
