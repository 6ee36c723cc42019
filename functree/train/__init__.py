"""functree.train: the training step, the Trainer, data, metrics and checkpoints."""

import sys
from typing import TYPE_CHECKING

from functree import losses, nn, optim
from functree.train._callbacks import (
    Callback,
    EarlyStopping,
    HistoryLogger,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TrainerView,
    TrainingContext,
)
from functree.train._classification_metrics import f1, precision, recall, top_k_accuracy
from functree.train._data import Batches, DataContext, batches, to_arrays
from functree.train._evaluation import NoLabelWarning
from functree.train._history import History
from functree.train._job import JobState
from functree.train._loggers import CSVLogger, TensorBoardLogger
from functree.train._metrics import (
    StepOutput,
    UnrecordedAuxWarning,
    accuracy,
    binary_accuracy,
    mean,
)
from functree.train._nonfinite import NonFiniteError
from functree.train._scan import stack_batches
from functree.train._setup import FrozenStateWarning, TrainingModeWarning
from functree.train._step import EvalStep, TrainStep
from functree.train._step_factories import eval_step, train_step
from functree.train._trainer import Trainer
from functree.train.checkpoint._checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    load,
    save,
)
from functree.train.checkpoint._migrate import migrate
from functree.train.checkpoint._registry import register, register_packages

# Checkpoints name functree's public classes: the registry (below the subpackages) is handed
# their namespaces here, in the package every save and load goes through (``import functree``
# imports the subpackages on first use; this one imports those the registry reads).
register_packages(sys.modules["functree"], nn, optim, sys.modules[__name__], losses)
del losses, nn, optim, register_packages, sys

__all__ = [
    "Trainer",
    "JobState",
    "TrainerView",
    "NonFiniteError",
    "FrozenStateWarning",
    "TrainingModeWarning",
    "UnrecordedAuxWarning",
    "NoLabelWarning",
    "History",
    "TrainingContext",
    "Callback",
    "EarlyStopping",
    "ReduceLROnPlateau",
    "ModelCheckpoint",
    "HistoryLogger",
    "CSVLogger",
    "TensorBoardLogger",
    "train_step",
    "eval_step",
    "TrainStep",
    "EvalStep",
    "StepOutput",
    "accuracy",
    "binary_accuracy",
    "precision",
    "recall",
    "f1",
    "top_k_accuracy",
    "mean",
    "batches",
    "Batches",
    "DataContext",
    "to_arrays",
    "stack_batches",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "load",
    "save",
    "migrate",
    "register",
]

if not TYPE_CHECKING:  # hidden from type checkers: `ft.train.laod` stays an error there

    def __getattr__(name: str):
        """Another library's name (Orbax's ``restore``, Keras's ``TensorBoard`` callback) names
        functree's way (:data:`functree._foreign_methods.FOREIGN_FUNCTIONS`); else Python's
        error with the close public names."""
        from functree._foreign_methods import missing_module_attribute

        raise missing_module_attribute(__name__, name)
