"""Losses with swift-apis' names and ``(predicted, expected)`` argument order, and torch's
losses that swift-apis lacks (``nll``, ``binary_cross_entropy``, ``smooth_l1``, ``gaussian_nll``,
``poisson_nll``, ``ctc``, the margin and embedding losses) with torch's numbers: its clamps,
eps and weighted means, the classes on the last axis and the batch first. torch's names
(``ft.losses.nll_loss``, ``ft.losses.NLLLoss``) name the equivalent here (:data:`OTHER_NAMES`).

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
from functree.losses._distance import cosine_embedding, triplet_margin, triplet_margin_with_distance
from functree.losses._likelihood import binary_cross_entropy, gaussian_nll, nll, poisson_nll
from functree.losses._linear_cross_entropy import linear_cross_entropy
from functree.losses._margin import (
    hinge_embedding,
    margin_ranking,
    multi_margin,
    multilabel_margin,
    multilabel_soft_margin,
    soft_margin,
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
    smooth_l1,
)
from functree.losses._sequence import ctc
from functree.losses._weighted import WeightedMean

__all__ = [
    "mean_squared_error",
    "mean_absolute_error",
    "l1",
    "l2",
    "huber",
    "softmax_cross_entropy",
    "linear_cross_entropy",
    "sigmoid_cross_entropy",
    "kl_divergence",
    "mean_squared_logarithmic_error",
    "mean_absolute_percentage_error",
    "log_cosh",
    "poisson",
    "hinge",
    "squared_hinge",
    "categorical_hinge",
    # torch's losses that swift-apis lacks, with torch's numbers
    "nll",
    "binary_cross_entropy",
    "smooth_l1",
    "gaussian_nll",
    "poisson_nll",
    "ctc",
    "cosine_embedding",
    "margin_ranking",
    "triplet_margin",
    "triplet_margin_with_distance",
    "hinge_embedding",
    "soft_margin",
    "multilabel_soft_margin",
    "multi_margin",
    "multilabel_margin",
    "REDUCTIONS",
    "WeightedMean",
]

# Other libraries' names for these losses: ``ft.losses.cross_entropy`` names its equivalent.
OTHER_NAMES = {
    "cross_entropy": "softmax_cross_entropy", "nll_loss": "nll",
    "categorical_crossentropy": "softmax_cross_entropy",
    "sparse_categorical_crossentropy": "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels": "softmax_cross_entropy",
    "linear_cross_entropy_loss": "linear_cross_entropy", "fused_linear_cross_entropy": "linear_cross_entropy",
    "binary_cross_entropy_with_logits": "sigmoid_cross_entropy", "binary_crossentropy": "sigmoid_cross_entropy",
    "sigmoid_binary_cross_entropy": "sigmoid_cross_entropy", "bce_with_logits": "sigmoid_cross_entropy",
    "mse_loss": "mean_squared_error", "mse": "mean_squared_error", "squared_error": "mean_squared_error",
    "l1_loss": "mean_absolute_error", "mae": "mean_absolute_error", "absolute_error": "mean_absolute_error",
    "huber_loss": "huber", "smooth_l1_loss": "smooth_l1", "kl_div": "kl_divergence", "kld": "kl_divergence",
    "poisson_nll_loss": "poisson_nll", "hinge_loss": "hinge",
    "gaussian_nll_loss": "gaussian_nll", "ctc_loss": "ctc", "cosine_embedding_loss": "cosine_embedding",
    "margin_ranking_loss": "margin_ranking", "triplet_margin_loss": "triplet_margin", "triplet_loss": "triplet_margin",
    "triplet_margin_with_distance_loss": "triplet_margin_with_distance", "hinge_embedding_loss": "hinge_embedding",
    "soft_margin_loss": "soft_margin", "multilabel_soft_margin_loss": "multilabel_soft_margin",
    "multi_margin_loss": "multi_margin", "multilabel_margin_loss": "multilabel_margin",
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
    "nll_loss": "ft.losses.nll(log_probs, labels)  # torch's [N, C, d1, ...] takes the classes last here: "
                "jnp.moveaxis(log_probs, 1, -1)",
    "categorical_crossentropy": f"ft.losses.softmax_cross_entropy(jnp.log({KERAS_CLIP}), labels)  # {KERAS_PROBS}",
    "sparse_categorical_crossentropy": f"ft.losses.softmax_cross_entropy(jnp.log({KERAS_CLIP}), labels)  "
                                       f"# {KERAS_PROBS}",
    "binary_crossentropy": f"ft.losses.sigmoid_cross_entropy(jax.scipy.special.logit({KERAS_CLIP}), labels)  "
                           f"# {KERAS_PROBS}",
    "kl_div": "ft.losses.kl_divergence(jnp.exp(log_q), p, reduction='sum') / log_q.shape[0]  # torch's input "
              "is log q; reduction='batchmean' divides the sum by the batch size alone: for [B, C] that is "
              "kl_divergence's default mean, for [B, T, C] it is T times that mean",
    "poisson_nll_loss": "ft.losses.poisson_nll(log_rate, target)  # torch's log_input=True, full, eps",
    "smooth_l1_loss": "ft.losses.smooth_l1(predicted, expected, beta=beta)  # torch's beta (0: the L1 loss)",
    "ctc_loss": "ft.losses.ctc(jnp.swapaxes(log_probs, 0, 1), labels, input_lengths, label_lengths)  # batch first "
                "here (torch's log_probs are [T, B, C]); labels padded [B, S], not concatenated",
}

# Other libraries' losses with no equivalent here: a spelling guess would name another loss
# (sigmoid_focal_loss looks like sigmoid_cross_entropy), so the error says there is none, and
# names optax's loss of that kind where it has one.
NO_EQUIVALENT = {
    "sigmoid_focal_loss": "optax.losses.sigmoid_focal_loss", "focal_loss": "optax.losses.sigmoid_focal_loss",
    "binary_focal_crossentropy": "optax.losses.sigmoid_focal_loss", "categorical_focal_crossentropy": None,
    "triplet_semihard_loss": None,
    "cosine_distance": "optax.losses.cosine_distance",
    "dice_loss": "optax.losses.dice_loss",
    "ntxent": "optax.losses.ntxent",
}

# torch.nn.functional's distances that are not losses: ft.nn's functions (torch's numbers).
IN_NN = {"cosine_similarity": "ft.nn.cosine_similarity(x1, x2)", "pairwise_distance": "ft.nn.pairwise_distance(x1, x2)"}

NOT_A_LOSS = """\
module 'functree.losses' has no attribute {name!r}: torch's F.{name} is not a loss; it is \
ft.nn.{name} here (over the last axis, torch's eps).

    wrong:  ft.losses.{name}(x1, x2)
    right:  {right}"""

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
    "KLDivergence": "kld", "GaussianNLLLoss": "gaussian_nll_loss", "CTCLoss": "ctc_loss",
    "CosineEmbeddingLoss": "cosine_embedding_loss", "MarginRankingLoss": "margin_ranking_loss",
    "TripletMarginLoss": "triplet_margin_loss", "TripletMarginWithDistanceLoss": "triplet_margin_with_distance_loss",
    "HingeEmbeddingLoss": "hinge_embedding_loss", "SoftMarginLoss": "soft_margin_loss",
    "MultiLabelSoftMarginLoss": "multilabel_soft_margin_loss", "MultiMarginLoss": "multi_margin_loss",
    "MultiLabelMarginLoss": "multilabel_margin_loss",
}
# (torch's BCELoss is binary_cross_entropy, which is ours: the class names it directly)
OTHER_NAMES.update({cls: OTHER_NAMES.get(fn, fn) for cls, fn in CLASS_NAMES.items()})


def __getattr__(name: str):
    """An error naming the equivalent of another library's loss name (torch's, Keras's, optax's)."""
    ours = OTHER_NAMES.get(name)
    if name in IN_NN:
        raise AttributeError(NOT_A_LOSS.format(name=name, right=IN_NN[name]))
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
