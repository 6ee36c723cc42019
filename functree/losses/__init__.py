"""Losses with swift-apis' names and ``(predicted, expected)`` argument order.

Every loss takes ``reduction="mean" | "sum" | "none"`` and defaults to the mean (over
examples for the per-example losses: cross entropies, ``kl_divergence``,
``categorical_hinge``). Inputs are checked: shapes that would silently broadcast, float
labels where class indices are needed, integer labels where probabilities are, are errors.

float16 and bfloat16 inputs are computed in float32 and the loss is float32, as torch's
autocast runs its losses and Hugging Face's loss functions take ``logits.float()``: a
float16 loss overflows under a loss scale of 65536 or more (``ft.optim.LossScaleOptimizer``),
and a bfloat16 mean loses the small terms. The gradients flow back in the inputs' dtype.
"""

from functree.losses._classification import (
    categorical_hinge,
    hinge,
    kl_divergence,
    sigmoid_cross_entropy,
    softmax_cross_entropy,
    squared_hinge,
)
from functree.losses._reduction import REDUCTIONS
from functree.losses._regression import (
    huber,
    l1,
    l2,
    log_cosh,
    mean_absolute_error,
    mean_absolute_percentage_error,
    mean_squared_error,
    mean_squared_logarithmic_error,
    poisson,
)

__all__ = [
    "mean_squared_error",
    "mean_absolute_error",
    "l1",
    "l2",
    "huber",
    "softmax_cross_entropy",
    "sigmoid_cross_entropy",
    "kl_divergence",
    "mean_squared_logarithmic_error",
    "mean_absolute_percentage_error",
    "log_cosh",
    "poisson",
    "hinge",
    "squared_hinge",
    "categorical_hinge",
    "REDUCTIONS",
]
