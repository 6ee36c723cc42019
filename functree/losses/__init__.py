"""Losses with swift-apis' names and ``(predicted, expected)`` argument order.

Every loss takes ``reduction="mean" | "sum" | "none" | "weighted"`` and defaults to the
mean (over examples for the per-example losses: cross entropies, ``kl_divergence``,
``categorical_hinge``; over the kept positions for ``softmax_cross_entropy``'s ignored
labels). ``"weighted"`` returns that mean as its parts, :class:`WeightedMean` ``(total,
count)``, which ``ft.optim.Optimizer(accumulate=k)`` combines exactly over microbatches
of unequal counts (kept tokens). Inputs are checked: shapes that would silently broadcast, float
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
from functree.losses._weighted import WeightedMean

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
    "WeightedMean",
]

# Other libraries' names for these losses: ``ft.losses.cross_entropy`` names its equivalent.
OTHER_NAMES = {
    "cross_entropy": "softmax_cross_entropy", "nll_loss": "softmax_cross_entropy",
    "categorical_crossentropy": "softmax_cross_entropy",
    "sparse_categorical_crossentropy": "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels": "softmax_cross_entropy",
    "binary_cross_entropy_with_logits": "sigmoid_cross_entropy", "binary_crossentropy": "sigmoid_cross_entropy",
    "sigmoid_binary_cross_entropy": "sigmoid_cross_entropy", "bce_with_logits": "sigmoid_cross_entropy",
    "mse_loss": "mean_squared_error", "mse": "mean_squared_error", "squared_error": "mean_squared_error",
    "l1_loss": "mean_absolute_error", "mae": "mean_absolute_error", "absolute_error": "mean_absolute_error",
    "huber_loss": "huber", "smooth_l1_loss": "huber", "kl_div": "kl_divergence", "kld": "kl_divergence",
    "poisson_nll_loss": "poisson", "hinge_loss": "hinge", "binary_cross_entropy": "sigmoid_cross_entropy",
}

# Keras's default from_logits=False takes probabilities and clips them to [1e-7, 1 - 1e-7] (its
# epsilon) before the log: a saturated probability of 0 or 1 is log(0) = -inf unclipped, and the
# loss NaN (0 * -inf).
KERAS_CLIP = "jnp.clip(probs, 1e-7, 1 - 1e-7)"
KERAS_PROBS = ("Keras's default from_logits=False takes probabilities, clipped as Keras clips them (a "
               "probability of 0 or 1 is log(0): NaN); with logits pass them")

# Where the other library's loss takes other inputs (log-space, probabilities for logits, a
# scale), the call that computes its number here: the `right:` line of the error.
OTHER_CALLS = {
    "nll_loss": "ft.losses.softmax_cross_entropy(log_probs, labels)  # torch's input: log-probabilities "
                "(log_softmax of them is themselves)",
    "categorical_crossentropy": f"ft.losses.softmax_cross_entropy(jnp.log({KERAS_CLIP}), labels)  # {KERAS_PROBS}",
    "sparse_categorical_crossentropy": f"ft.losses.softmax_cross_entropy(jnp.log({KERAS_CLIP}), labels)  "
                                       f"# {KERAS_PROBS}",
    "binary_crossentropy": f"ft.losses.sigmoid_cross_entropy(jax.scipy.special.logit({KERAS_CLIP}), labels)  "
                           f"# {KERAS_PROBS}",
    # torch clamps each log at -100 instead: the two agree for probabilities in [1e-7, 1 - 1e-7]
    "binary_cross_entropy": f"ft.losses.sigmoid_cross_entropy(jax.scipy.special.logit({KERAS_CLIP}), labels)  "
                            "# torch's F.binary_cross_entropy takes probabilities (with logits: "
                            "binary_cross_entropy_with_logits, sigmoid_cross_entropy(logits, labels))",
    "kl_div": "ft.losses.kl_divergence(jnp.exp(log_q), p, reduction='sum') / log_q.shape[0]  # torch's input "
              "is log q; reduction='batchmean' divides the sum by the batch size alone: for [B, C] that is "
              "kl_divergence's default mean, for [B, T, C] it is T times that mean",
    "poisson_nll_loss": "ft.losses.poisson(jnp.exp(log_rate), target)  # torch's default log_input=True",
    "smooth_l1_loss": "ft.losses.huber(predicted, expected, delta=beta) / beta  # torch's beta > 0 (1: huber "
                      "itself); beta=0 is the L1 loss: ft.losses.l1(predicted, expected)",
}

# Other libraries' losses with no equivalent here: a spelling guess would name another loss
# (sigmoid_focal_loss looks like sigmoid_cross_entropy), so the error says there is none, and
# names optax's loss of that kind where it has one.
NO_EQUIVALENT = {
    "sigmoid_focal_loss": "optax.losses.sigmoid_focal_loss", "focal_loss": "optax.losses.sigmoid_focal_loss",
    "binary_focal_crossentropy": "optax.losses.sigmoid_focal_loss", "categorical_focal_crossentropy": None,
    "ctc_loss": "optax.losses.ctc_loss", "ctc": "optax.losses.ctc_loss",
    "triplet_margin_loss": "optax.losses.triplet_margin_loss", "triplet_loss": "optax.losses.triplet_margin_loss",
    "triplet_semihard_loss": None, "triplet_margin_with_distance_loss": None,
    "cosine_similarity": "optax.losses.cosine_similarity", "cosine_distance": "optax.losses.cosine_distance",
    "cosine_embedding_loss": None, "margin_ranking_loss": None, "hinge_embedding_loss": None,
    "multilabel_margin_loss": None, "multi_margin_loss": None, "multilabel_soft_margin_loss": None,
    "soft_margin_loss": None, "gaussian_nll_loss": None, "dice_loss": "optax.losses.dice_loss",
    "ntxent": "optax.losses.ntxent",
}

NO_EQUIVALENT_LOSS = """\
module 'functree.losses' has no attribute {name!r}, and no loss here computes it{alike}. \
{elsewhere} from its formula with jnp:

    right:  def {name}(predicted, expected): ...     # its formula, in jnp"""

OTHER_NAME = """\
module 'functree.losses' has no attribute {name!r}: its equivalent here is \
ft.losses.{ours} (swift-apis' names, the (predicted, expected) order; its docstring says how \
its arguments differ from the one you know).

    wrong:  ft.losses.{name}(predicted, expected)
    right:  {right}"""

# torch's and Keras's loss classes (nn.CrossEntropyLoss(), keras.losses.SparseCategoricalCrossentropy())
# -> their functional names above: a class's instance computes what its function does (Keras's
# classes default to from_logits=False too).
CLASS_NAMES = {
    "CrossEntropyLoss": "cross_entropy", "NLLLoss": "nll_loss", "BCEWithLogitsLoss": "binary_cross_entropy_with_logits",
    "BCELoss": "binary_cross_entropy", "MSELoss": "mse_loss", "L1Loss": "l1_loss", "SmoothL1Loss": "smooth_l1_loss",
    "HuberLoss": "huber_loss", "KLDivLoss": "kl_div", "PoissonNLLLoss": "poisson_nll_loss",
    "SparseCategoricalCrossentropy": "sparse_categorical_crossentropy",
    "CategoricalCrossentropy": "categorical_crossentropy", "BinaryCrossentropy": "binary_crossentropy",
    "MeanSquaredError": "mse", "MeanAbsoluteError": "mae", "Huber": "huber_loss",
    "KLDivergence": "kld",
}
OTHER_NAMES.update({cls: OTHER_NAMES[fn] for cls, fn in CLASS_NAMES.items()})


def __getattr__(name: str):
    """An error naming the equivalent of another library's loss name (torch's, Keras's, optax's)."""
    ours = OTHER_NAMES.get(name)
    if ours is None:
        import difflib

        close = difflib.get_close_matches(name, __all__, n=1)
        if name in NO_EQUIVALENT:
            raise AttributeError(_no_equivalent(name, close[0] if close else None))
        hint = f"; did you mean ft.losses.{close[0]}?" if close else ""
        raise AttributeError(f"module 'functree.losses' has no attribute {name!r}{hint}")
    right = OTHER_CALLS.get(CLASS_NAMES.get(name, name), f"ft.losses.{ours}(predicted, expected)")
    raise AttributeError(OTHER_NAME.format(name=name, ours=ours, right=right))


def _no_equivalent(name: str, alike: str | None) -> str:
    """:data:`NO_EQUIVALENT_LOSS` for ``name``: the loss whose name looks alike, if any, is
    said to be another one; optax's loss of that kind is named where there is one."""
    other = NO_EQUIVALENT[name]
    return NO_EQUIVALENT_LOSS.format(
        name=name, alike=f" (ft.losses.{alike}, whose name looks alike, is another loss)" if alike else "",
        elsewhere=(f"Use optax's loss of its kind, {other} (its own arguments and defaults: check its numbers "
                   f"against the library you port from), or write it" if other else "Write it"))
