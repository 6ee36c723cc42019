"""functree.optim: optimizers as optax transformations, with a learning context.

Every optimizer here is an optax ``GradientTransformation`` (and every optax
transformation works wherever a functree optimizer does). An :class:`Optimizer`'s state
(:class:`OptimizerState`) carries one :class:`LearningContext` (step, sweep, samples
seen, minibatch size, loss); the hyperparameters live as arrays in the transforms'
states, so schedules read the context and changing a learning rate never recompiles a
jitted step::

    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    state = opt.init(model)
    model, state, loss = opt.minimize(loss_fn, model, state, x, y)
"""

from functree._tree import all_finite
from functree.optim._aliases import (
    DECLARED,
    DEFAULT_NO_DECAY,
    LEAF,
    adadelta,
    adagrad,
    adam,
    adamax,
    adamw,
    amsgrad,
    decay_mask,
    lion,
    moments,
    radam,
    rmsprop,
    sgd,
)
from functree.optim._average import AverageState, averaged, ema, uniform_average
from functree.optim._complex import RealPair
from functree.optim._context import LearningContext, context, initial_context, next_sweep
from functree.optim._groups import groups
from functree.optim._hyper import (
    ComplexGradientWarning,
    HyperState,
    Rate,
    hyperparameter_names,
    hyperparameters,
    inject,
    per_minibatch,
    per_samples,
    set_hyperparameters,
)
from functree.optim._lookahead import SlowState, lookahead
from functree.optim._loss_scale import LossScaleOptimizer, LossScaleState, UnscaledFloat16Warning
from functree.optim._masked import masked
from functree.optim._multisteps import UnappliedGradientsWarning
from functree.optim._optimizer import Optimizer, OptimizerWrapper, StepResult
from functree.optim._per_member import PerMemberState, WholeStackState, per_member, whole_stack
from functree.optim._schedules import (
    constant,
    cosine_decay,
    cosine_warm_restarts,
    cyclic,
    cyclic_momentum,
    exponential_decay,
    inverse_time_decay,
    linear_warmup,
    one_cycle,
    one_cycle_momentum,
    piecewise,
    schedule,
    warmup_cosine_decay,
)
from functree.optim._skip import SkipState, skip_non_finite
from functree.optim._state import OptimizerState, upgrade_state
from functree.optim._torch_optimizers import asgd, nadam, rprop
from functree.optim._transforms import (
    add_gradient_noise,
    add_parameter_noise,
    clip,
    clip_by_global_norm,
    clip_by_norm,
    clip_per_sample,
    freeze,
    l1_regularization,
    l2_regularization,
    per_example_clipping,
    reduce_on_plateau,
    weight_decay,
)

__all__ = [
    # optimizers
    "sgd",
    "rmsprop",
    "adagrad",
    "adadelta",
    "adam",
    "adamw",
    "adamax",
    "amsgrad",
    "radam",
    "lion",
    "nadam",
    "rprop",
    "asgd",
    "moments",
    "DEFAULT_NO_DECAY",
    "DECLARED",
    "LEAF",
    "decay_mask",
    # Optimizer and hooks
    "Optimizer",
    "OptimizerWrapper",
    "OptimizerState",
    "upgrade_state",
    "StepResult",
    "RealPair",
    "SkipState",
    "LossScaleOptimizer",
    "LossScaleState",
    "UnscaledFloat16Warning",
    "all_finite",
    # gradient transformations and groups
    "clip",
    "clip_by_norm",
    "clip_by_global_norm",
    "clip_per_sample",
    "per_example_clipping",
    "l1_regularization",
    "l2_regularization",
    "weight_decay",
    "add_parameter_noise",
    "add_gradient_noise",
    "skip_non_finite",
    "freeze",
    "reduce_on_plateau",
    "groups",
    "masked",
    # per-tensor statistics on an ft.nn.Stack: each member's, or the stacked leaf's
    "per_member",
    "whole_stack",
    "PerMemberState",
    "WholeStackState",
    # weight averaging and lookahead (averaged parameters kept by the optimizer)
    "ema",
    "uniform_average",
    "averaged",
    "AverageState",
    "lookahead",
    "SlowState",
    # learning context
    "LearningContext",
    "context",
    "next_sweep",
    "initial_context",
    # hyperparameters and rate units
    "hyperparameters",
    "hyperparameter_names",
    "set_hyperparameters",
    "inject",
    "HyperState",
    "Rate",
    "ComplexGradientWarning",
    "UnappliedGradientsWarning",
    "per_minibatch",
    "per_samples",
    # schedules
    "schedule",
    "constant",
    "piecewise",
    "exponential_decay",
    "cosine_decay",
    "linear_warmup",
    "warmup_cosine_decay",
    "inverse_time_decay",
    # schedules: torch.optim.lr_scheduler's cycles (OneCycleLR, CyclicLR, CosineAnnealingWarmRestarts)
    "one_cycle",
    "one_cycle_momentum",
    "cyclic",
    "cyclic_momentum",
    "cosine_warm_restarts",
]


def __getattr__(name: str):
    """Another library's name (torch's ``torch.optim.Adam``, ``lr_scheduler``) names
    functree's way (:data:`functree._foreign_methods.FOREIGN_FUNCTIONS`); else Python's error."""
    from functree._foreign_methods import missing_module_attribute

    raise missing_module_attribute(__name__, name)
