"""``ft.train.Trainer``: a small driver that advances one :class:`JobState` step by step.

One step through the driver: the epoch's iterator (``_epochs.py``) gives a minibatch at
the job's position; :meth:`Trainer._step` runs the :class:`TrainStep`'s jitted, donated
program, which writes its metrics into a device buffer (``_intervals.py``), and commits
its outputs as the next :class:`JobState` (the one place a step becomes the job's state;
a Ctrl-C waits for it: ``_interrupts.py``). Every ``log_every`` steps the reader
(``_reader.py``) closes the buffer and reads the interval before it (never waiting for
queued steps) into the job: history rows, means (``_means.py``), stops and skips; then the
progress bar (``_progress.py``) and the callbacks. Epoch ends and save points read
everything first; a save writes the record (``_job.py``). Evaluation and prediction:
``_evaluation.py``; the construction's checks: ``_setup.py``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from functree._alias import warn_aliases
from functree._jit import has_untraceable_leaves
from functree._parameters import floats_as_arrays
from functree._source import call_refusal
from functree._where import placement_of, put, several_devices
from functree.losses import OTHER_NAMES
from functree.nn._mode import mode_free
from functree.optim import next_sweep
from functree.optim._average import keeps_average
from functree.optim._multisteps import warn_unapplied
from functree.optim._optimizer import moved_view
from functree.optim._rate import check_horizon, training_horizon
from functree.optim._skip import DEFAULT_ON_NAN
from functree.optim._subset import trained_view
from functree.train._built import BuiltWith, Settings
from functree.train._built import short_value as _short
from functree.train._callbacks import (
    REQUIRED,
    Callback,
    ModelCheckpoint,
    TrainingContext,
    as_callback,
    closest_parameter,
    finish_saves,
    missing,
)
from functree.train._data import Batches, checked_key, to_arrays
from functree.train._dispatch import end_epoch, finish_pending
from functree.train._epochs import (
    KERAS_POSITIONAL,
    Epochs,
    as_data,
    batch_signature,
    check_row_minibatch,
    cut_by_batch_size,
    epoch_length,
    no_minibatch,
    ran_out,
)
from functree.train._eval_step import check_batch_argument
from functree.train._evaluation import Evaluation
from functree.train._history import History
from functree.train._interrupts import Interrupts
from functree.train._job import (
    JOB_ATTRIBUTES,
    MODEL_NOT_A_JOB,
    PLACED,
    JobState,
    add_readers,
    check_extra,
    check_new_step,
    load_callbacks,
    own_copy,
    read_job,
    save_job,
)
from functree.train._loggers import close_event_files
from functree.train._means import Means
from functree.train._metrics import counting_names, describe_batch, part_names, resolve_metrics
from functree.train._nonfinite import NONFINITE, NonFiniteError
from functree.train._progress import Progress
from functree.train._reader import Reader, reads_model, warn_no_label
from functree.train._scan import check_steps_per_call, stack_batches
from functree.train._setup import (
    MISSING,
    carried_state,
    check_arguments,
    check_key,
    check_same_model,
    in_training_mode,
    job_field,
    make_step,
    warn_frozen_state,
)
from functree.train._step import TrainStep
from functree.train._step_factories import eval_step
from functree.train.checkpoint._checkpoint import NOTHING_SAVED, Checkpoint, CheckpointManager
from functree.train.checkpoint._directory import read_path
from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["Trainer", "NonFiniteError"]

ALREADY_DONE = "Trainer.fit at step {step}, epoch {epoch}: nothing to train, the job {why}."

INEXACT_MEANS = """\
The checkpoint at step {step} ({where}) holds the {which} running mean of {names} without the \
counted labels (Σ hits / Σ counted): the functree that wrote it did not record them for this \
metric (before 2026-11-29 for any metric; until the session of 2026-11-29, eighth, for a \
compute_metrics override that does not call super() or a step built outside the Trainer), so its \
mean so far is weighted by minibatch size, which with labels of -100 is another number. \
The mean of the steps before step {step} cannot be made exact, and continuing it would mix the two.

    wrong:  trainer.restore(path)                  # a checkpoint written mid-epoch by an older functree
    right:  trainer.restore(path, step=<a step at an epoch's end>)   # its running means are empty
       or:  finish the epoch with the functree that wrote it, then continue here"""

METRICS_CHANGED = """\
The checkpoint at step {step} ({where}) is inside epoch {epoch}: its running means hold the \
epoch's steps so far for {saved}, but this trainer records {ours} ({change}){known}. The epoch's \
mean of an added metric would cover the steps after step {step} alone (one removed, those \
before), reported, ranked and monitored as the whole epoch's.

    wrong:  Trainer(model, opt, loss_fn, {given}).restore(path){then}   # other metrics, mid-epoch
    right:  trainer.restore(path, step=<a step at an epoch's end>)        # its epoch means are empty
       or:  old = Trainer(model, opt, loss_fn, {saved_given}).restore(path)
            old.fit(data, epochs=old.epoch + 1); old.save(path)          # finish the epoch, then
            trainer.restore(path)                                         # change the metrics"""

# METRICS_CHANGED's words for a step built from metrics= (its names known at the restore) and
# for one whose compute_metrics or step() is overridden (known when it traces: fit's first step).
_CHANGED_BY = {False: {"known": "", "given": "metrics={...}", "then": "", "saved_given": "metrics=<the saved ones>"},
               True: {"known": "; the step's compute_metrics (or step()) is its own: its names are read when it "
                               "traces, at a fit's first minibatch (refused before any step ran)",
                      "given": "train_step=OtherStep(...)", "then": ".fit(data)",
                      "saved_given": "train_step=<the step that saved it>"}}

_LOG = logging.getLogger("functree.train")
_KEEP: Any = object()  # Trainer.save(extra=) not given: the job's extra is saved


_NO_DATA: Any = REQUIRED  # data's default: fit(x=X, y=Y) reaches the error naming data=(x, y)

# Other libraries' keyword names, per method: (library, the call to write here, why). The call
# is formatted with ``value`` (the value given, shortened), ``on`` (Keras's verbose as a flag),
# ``epochs`` (fit's, for Keras's epochs × steps_per_epoch) and ``method``.
_WEIGHTS = "loss_fn = lambda model, batch: jnp.mean(batch[2] * per_example_loss(model, batch))"
_RESTORE = "trainer.restore({value}); trainer.fit(data, epochs=N)"
_RESTORE_DIR = _RESTORE.replace("{value}", "checkpoint_dir")
_AT_FIT = "the Trainer's fit() keyword"
_NO_BAR = "evaluate and predict show no progress bar: drop it"
_ISLICE = "list(itertools.islice(batches, {value}))"
SPELLINGS: dict[str, dict[str, tuple[str, str, str]]] = {
    "Trainer": {
        "verbose": ("Keras's", "trainer.fit(data, progress={on})", _AT_FIT),
        "max_epochs": ("Lightning's", "trainer.fit(data, epochs={value})", _AT_FIT + "; it counts the whole job too"),
        "max_steps": ("Lightning's", "trainer.fit(data, steps={value})", _AT_FIT + "; it counts the whole job too"),
        "callbacks": ("Lightning's and Hugging Face's", "trainer.fit(data, callbacks=[...])", _AT_FIT),
        "enable_progress_bar": ("Lightning's", "trainer.fit(data, progress={value})", _AT_FIT),
        "log_every_n_steps": ("Lightning's", "trainer.fit(data, log_every={value})", _AT_FIT),
        "num_train_epochs": ("Hugging Face's", "trainer.fit(data, epochs={value})", _AT_FIT + " (whole epochs)"),
        "train_dataset": ("Hugging Face's", "trainer.fit(train_dataset, ...)", "the data is fit()'s first argument"),
        "eval_dataset": ("Hugging Face's", "trainer.fit(data, validation_data=eval_dataset)", _AT_FIT),
        "compute_metrics": ("Hugging Face's", "ft.train.Trainer(model, optimizer, loss_fn, metrics=[ft.train.accuracy])",
                            "each metric is fn(StepOutput) -> scalar per minibatch, averaged over the data"),
        "optimizers": ("Hugging Face's", "ft.train.Trainer(model, ft.optim.adamw(ft.optim.warmup_cosine_decay(...)), "
                       "loss_fn)", "the optimizer is the second argument, its schedule inside it"),
    },
    "fit": {
        "verbose": ("Keras's", "trainer.fit(data, progress={on})", "the progress bar"),
        "steps_per_epoch": ("Keras's", "trainer.fit(data, steps={epochs} * {value})",
                            "steps= counts the job's steps in all (Lightning's max_steps), not per epoch; an "
                            "epoch is one pass over data: for epochs of {value} minibatches, give data of {value}"),
        "validation_split": ("Keras's", "n = int(len(x) * (1 - {value})); "
                             "trainer.fit((x[:n], y[:n]), validation_data=(x[n:], y[n:]))",
                             "no such keyword: hold out the last rows yourself, as Keras does"),
        "validation_steps": ("Keras's", "trainer.fit(data, validation_data=" + _ISLICE + ")",
                             "validation reads all of validation_data: give it those minibatches"),
        "validation_freq": ("Keras's", "for e in range({value}, {epochs} + 1, {value}): "
                            "trainer.fit(data, epochs=e); trainer.evaluate(validation_data)",
                            "validation_data= is evaluated at every epoch's end; epochs= counts the whole job"),
        "validation_batch_size": ("Keras's", "trainer.fit(data, validation_data=ft.train.batches(val, {value}, "
                                  "shuffle=False))", "batch_size= cuts validation arrays too"),
        "shuffle": ("Keras's", "trainer.fit(ft.train.batches((x, y), batch_size, shuffle={value}))",
                    "arrays are reshuffled every epoch; an iterable keeps its own order"),
        "initial_epoch": ("Keras's", _RESTORE_DIR, "a restored job continues from its saved epoch"),
        "class_weight": ("Keras's", "trainer.fit((x, y, class_weight[y]), ...) with " + _WEIGHTS,
                         "weigh the examples in the loss function"),
        "sample_weight": ("Keras's", "trainer.fit((x, y, sample_weight), ...) with " + _WEIGHTS,
                          "weigh the examples in the loss function"),
        "x": ("Keras's", "trainer.fit((x, y), ...)", "data= holds the inputs and the labels"),
        "y": ("Keras's", "trainer.fit((x, y), ...)", "data= holds the inputs and the labels"),
        "max_epochs": ("Lightning's", "trainer.fit(data, epochs={value})", "it counts the whole job too"),
        "max_steps": ("Lightning's", "trainer.fit(data, steps={value})", "it counts the whole job too"),
        "ckpt_path": ("Lightning's", _RESTORE, "a restored job continues from its saved step"),
        "train_dataloaders": ("Lightning's", "trainer.fit(train_dataloaders, ...)",
                              "data= is any iterable of minibatches (a torch DataLoader too)"),
        "val_dataloaders": ("Lightning's", "trainer.fit(data, validation_data=val_dataloaders)", "any iterable"),
        "num_train_epochs": ("Hugging Face's", "trainer.fit(data, epochs={value})",
                             "whole epochs; for a fraction, steps= in all"),
        "train_dataset": ("Hugging Face's", "trainer.fit(train_dataset, ...)", "the data is the first argument"),
        "eval_dataset": ("Hugging Face's", "trainer.fit(data, validation_data=eval_dataset)", ""),
        "resume_from_checkpoint": ("Hugging Face's", _RESTORE_DIR, "a restored job continues from its saved step"),
    },
}
_LOOKED_AT = {  # evaluate and predict: Keras's, Lightning's (validate / predict) and HF's names
    "verbose": ("Keras's", "trainer.{method}(data)", _NO_BAR),
    "x": ("Keras's", "trainer.{method}((x, y))", "data= holds the inputs (and the labels)"),
    "steps": ("Keras's", "trainer.{method}(" + _ISLICE + ")", "it reads all of data: give it those minibatches"),
    "callbacks": ("Keras's", "trainer.{method}(data)", "it calls no callbacks"),
    "dataloaders": ("Lightning's", "trainer.{method}(dataloaders)", "data= is any iterable of minibatches"),
    "ckpt_path": ("Lightning's", "trainer.restore({value}); trainer.{method}(data)", "restore first"),
}
SPELLINGS["evaluate"] = {**_LOOKED_AT, "y": _LOOKED_AT["x"],
                         "sample_weight": ("Keras's", "trainer.evaluate((x, y, sample_weight)) with " + _WEIGHTS,
                                           "weigh the examples in the loss function"),
                         "return_dict": ("Keras's", "trainer.evaluate(data)", "it returns {{name: value}} already"),
                         "eval_dataset": ("Hugging Face's", "trainer.evaluate(eval_dataset)", "")}
SPELLINGS["predict"] = {**_LOOKED_AT, "x": ("Keras's", "trainer.predict(x)", "data= holds the inputs"),
                        "test_dataset": ("Hugging Face's", "trainer.predict(test_dataset)", "")}

UNKNOWN_KEYWORD = """\
{method}() got an unexpected keyword argument {name!r}{why}.

    wrong:  {wrong}
    right:  {right}"""

# Other training loops' attribute names (Lightning's, Keras's, Hugging Face's, flax's
# TrainState's) and what holds that here: Python's own suggestion for `trainer.step` is the
# private `_step`.
OTHER_ATTRIBUTES = {
    "step": ("the count of training steps the job has run", "steps_run"),
    "global_step": ("the count of training steps the job has run", "steps_run"),
    "iterations": ("the count of training steps the job has run", "steps_run"),
    "current_epoch": ("the count of epochs completed", "epoch"),
    "params": ("the model (its leaves are the parameters)", "model"),
    "optimizer_state": ("the optimizer state", "opt_state"),
}

OTHER_ATTRIBUTE = """\
'Trainer' object has no attribute {name!r}: {what} is trainer.{ours} here.

    wrong:  trainer.{name}
    right:  trainer.{ours}"""

# Keras's model.optimizer.learning_rate, torch's param_groups[0]["lr"]: read on the trainer,
# the bare "no attribute" named no place (the names are BuiltWith guards against assignment).
RATE_READ = """\
'Trainer' object has no attribute {name!r}: the learning rate is a hyperparameter in the \
optimizer state (ft.optim's optimizers, optax.inject_hyperparams), read and set there (a \
scheduled rate reads the latest step's).

    wrong:  trainer.{name}
    right:  ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]
       or:  trainer.opt_state = ft.optim.set_hyperparameters(trainer.opt_state, learning_rate=1e-4)"""


# What the Trainer's step was built with: assigned after the constructor, each was ignored
# (`trainer.optimizer = sgd(0.0)`: the next fit trained on with the old optimizer, and its
# checkpoints named the new one), or made an attribute nothing reads (`trainer.wrt = ...`).
BUILT_WITH = {
    "optimizer": "its optimizer", "train_step": "its step", "eval_step": "its evaluation step",
    "on_nan": "its on_nan", "loss_fn": "its loss_fn", "metrics": "its metrics", "wrt": "its wrt=",
    "mesh": "its mesh", "data_axis": "its data_axis", "sharding": "its sharding",
    "compute_dtype": "its compute_dtype", "training": "its modes (training=)",
    "learning_rate": "the learning rate in the optimizer state", "lr": "the learning rate in the optimizer state",
}
# The optimizer state goes with the optimizer: another optimizer or wrt= starts its own.
_NEW_STATE = frozenset({"optimizer", "train_step", "wrt"})
_RATE = frozenset({"optimizer", "learning_rate", "lr"})

TRAINER_BUILT_WITH = """\
trainer.{name} cannot be set: the Trainer's compiled step was built with {what} by \
ft.train.Trainer(...), and the assignment would be ignored (the next fit trains on as before). \
To continue the job (its steps, history, key, position) with {new}, save it and restore it \
into a trainer built so:

    wrong:  trainer.{name} = {value}
    right:  trainer.save(path)
            trainer = ft.train.Trainer(trainer.model, optimizer, loss_fn, {keyword}).restore(path{keep})
{fresh}{rate}{moments}"""

_FRESH_STATE = """\
            # the optimizer state starts afresh: moments from zero, its step count (a schedule's place) from 0
"""

# Another wrt= with the same optimizer: the state's layout differs only in which parameters
# have moments, so the old state's context, hyperparameters and the moments of the parameters
# trained before and now carry over (the others: the new state's, zeros or None).
_KEEP_MOMENTS = """\
       or, with the same optimizer, to keep its step count and the moments of the parameters trained before and now:
            kept = trainer.opt_state
            trainer.save(path)
            trainer = ft.train.Trainer(trainer.model, optimizer, loss_fn, {keyword}).restore(path{keep})
            trainer.opt_state = jax.tree.map(lambda new, old: new if new is None or old is None else old,
                                             trainer.opt_state, kept, is_leaf=lambda x: x is None)
"""

_SET_RATE = """\
       or, to change the learning rate only (the moments and step count kept, no recompilation):
            trainer.opt_state = ft.optim.set_hyperparameters(trainer.opt_state, learning_rate=1e-4)
"""


def built_with(name: str, value: Any) -> AttributeError:
    """:data:`TRAINER_BUILT_WITH` for ``trainer.<name> = value``."""
    rate_only = name in ("learning_rate", "lr")
    shown = "..." if callable(value) or _short(value).startswith("<") else _short(value)
    keyword = "..." if rate_only or name in ("optimizer", "loss_fn") or shown == "..." else f"{name}={shown}"
    keep = ", optimizer_state=False" if name in _NEW_STATE else ""
    return AttributeError(TRAINER_BUILT_WITH.format(
        name=name, what=BUILT_WITH[name], value=shown, keyword=keyword,
        new="a new optimizer" if rate_only else f"the new {name}", keep=keep,
        fresh=_FRESH_STATE if keep else "", rate=_SET_RATE if name in _RATE else "",
        moments=_KEEP_MOMENTS.format(keyword=keyword, keep=keep) if name == "wrt" else ""))


def no_attribute(name: str, obj: Any) -> AttributeError:
    """The error for ``trainer.<name>``: another loop's name for an attribute here
    (:data:`OTHER_ATTRIBUTES`), or the closest public name ``obj`` has (a setting it was
    not given, a :class:`BuiltWith` without a value, is none)."""
    owner = type(obj)
    if name in OTHER_ATTRIBUTES:
        what, ours = OTHER_ATTRIBUTES[name]
        return AttributeError(OTHER_ATTRIBUTE.format(name=name, what=what, ours=ours))
    if name in ("learning_rate", "lr"):
        return AttributeError(RATE_READ.format(name=name))
    held = [n for n in dir(owner) if not n.startswith("_") and (
        not isinstance(getattr(owner, n, None), BuiltWith) or "_" + n in obj.__dict__)]
    close = [] if name.startswith("_") else difflib.get_close_matches(name, held, n=1)
    hint = f"; did you mean trainer.{close[0]}?" if close else ""
    return AttributeError(f"'{owner.__name__}' object has no attribute {name!r}{hint}")


# Keras's compile(loss="...") / a loss of (predictions, labels) given where loss_fn(model,
# batch) goes: accepted before, it failed at the first step ("'str' object is not callable",
# "logits must be a floating array, got object[3]": the model taken for the logits).
LOSS_FN_NOT_A_FUNCTION = """\
ft.train.Trainer's loss_fn must be a function loss_fn(model, batch) -> a scalar loss, got \
{given}{why}.

    wrong:  ft.train.Trainer(model, optimizer, {wrong})
    right:  ft.train.Trainer(model, optimizer, lambda model, batch: {right})"""

_LOSS_MODULES = ("functree.losses", "optax.losses", "optax._src.loss")  # (predicted, expected) losses

# Keras's evaluate(x, y): here the data is one argument (Python's "takes from 1 to 2
# positional arguments but 3 were given" before).
KERAS_EVALUATE = """\
trainer.{method} takes the data as one argument, got {count} positional arguments: Keras's \
{method}(x, y) is {method}((x, y)) here (a tuple of arrays, a loader, an iterator).

    wrong:  trainer.{method}(x, y)
    right:  trainer.{method}((x, y))"""


_F = TypeVar("_F", bound=Callable[..., Any])


def keras_positional(method: _F) -> _F:
    """``method`` (``fit``, ``evaluate``) refusing Keras's ``(x, y)`` as two positional
    arguments by name (:data:`KERAS_POSITIONAL`, :data:`KERAS_EVALUATE`) before Python's
    "got multiple values for argument 'epochs'" / "takes from 1 to 2 positional arguments"."""
    fit = method.__name__ == "fit"

    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2 and (not fit or (np.ndim(args[1]) >= 1 and (len(args) > 2 or "epochs" in kwargs))):
            if fit:
                raise ValueError(KERAS_POSITIONAL.format(shape=np.shape(args[1])))
            raise TypeError(KERAS_EVALUATE.format(method=method.__name__, count=len(args)))
        return method(self, *args, **kwargs)

    return checked  # type: ignore[return-value]

# trainer.predict(x, y): the labels taken for fn ("The truth value of an array ... is
# ambiguous" before, from deep inside).
PREDICT_FN = """\
trainer.predict's second argument is fn(model, batch), got {given}: predict takes the inputs \
alone (Keras's predict(x)); its output is the model's on them.

    wrong:  trainer.predict(x, y)
    right:  trainer.predict(x)                 # or trainer.predict(data, lambda model, batch: ...)"""

PREDICT_FN_ARGUMENTS = """\
trainer.predict(data, fn) calls fn(model, batch) on each minibatch (the model in inference \
mode, the minibatch as the data gives it), but {fn}{signature} cannot be called so (Python's \
"{problem}"); it would fail at the first minibatch. Take the model and the minibatch:

    wrong:  trainer.predict(data, {fn})   # {fn}{signature}
    right:  trainer.predict(data, lambda model, batch: ...)   # e.g. jax.nn.softmax(model(batch[0]))"""

# Keras's compile(optimizer="adam"): the name with Keras's defaults (docs/migration/defaults.md).
# Keras's Adam and AdamW add ε to √v before the bias correction (η √(1−β₂ᵗ)/(1−β₁ᵗ) ·
# m/(√v + ε)): here ε/√(1−β₂ᵗ) added to √v̂, 31.6ε at the first step (a plain ε = 1e-7 stepped
# 2.5× Keras's for gradients of order 1e-6); its RMSprop divides by √(s + ε) (eps_in_sqrt:
# g / (√s + ε) stepped 17× Keras's for gradients of order 1e-4)
KERAS_EPSILON = "ft.optim.schedule(lambda t: 1e-7 / (1 - 0.999 ** (t + 1)) ** 0.5)"
KERAS_OPTIMIZERS = {
    "adam": f"ft.optim.adam(1e-3, epsilon={KERAS_EPSILON})", "sgd": "ft.optim.sgd(0.01)",
    "rmsprop": "ft.optim.rmsprop(1e-3, rho=0.9, epsilon=1e-7, eps_in_sqrt=True)",
    "adamw": f"ft.optim.adamw(1e-3, weight_decay=0.004, epsilon={KERAS_EPSILON}, exclude=())",
    "adagrad": "ft.optim.adagrad(1e-3, initial_accumulator_value=0.1, epsilon=1e-7, eps_in_sqrt=True)",
    "adadelta": "ft.optim.adadelta(1e-3, rho=0.95, epsilon=1e-7)",
    "adamax": "ft.optim.adamax(1e-3, epsilon=1e-7, eps_in_max=False)",
    "lion": "ft.optim.lion(1e-3)",
    # Keras 3's Nadam is torch's NAdam with the momentum schedule's 0.96^t (momentum_decay 1.0,
    # not torch's 0.004): the same update otherwise, ε outside the root
    "nadam": "ft.optim.nadam(1e-3, momentum_decay=1.0, epsilon=1e-7)",
}

KERAS_OPTIMIZER = """\
ft.train.Trainer's optimizer is an optimizer, got the name {given!r}: Keras's \
compile(optimizer={given!r}) names one; here it is built, with its learning rate.

    wrong:  ft.train.Trainer(model, {given!r}, loss_fn)
    right:  ft.train.Trainer(model, {right}, loss_fn){note}"""


def check_optimizer_name(optimizer: Any) -> None:
    """:data:`KERAS_OPTIMIZER` for an optimizer given by name (Keras's ``"adam"``)."""
    if isinstance(optimizer, str):
        right = KERAS_OPTIMIZERS.get(optimizer.lower(), "ft.optim.adam(1e-3)")
        note = "   # Keras's defaults" if optimizer.lower() in KERAS_OPTIMIZERS else ""
        raise TypeError(KERAS_OPTIMIZER.format(given=optimizer, right=right, note=note))


def check_loss_fn(loss_fn: Any) -> None:
    """:data:`LOSS_FN_NOT_A_FUNCTION` for a Keras loss name (a string) or a loss of
    ``(predicted, expected)`` from ``ft.losses`` / optax given as ``loss_fn``."""
    ours = getattr(loss_fn, "__name__", "loss")
    if isinstance(loss_fn, str):
        given, why, wrong = repr(loss_fn), " (a Keras loss name)", repr(loss_fn)
    elif callable(loss_fn) and str(getattr(loss_fn, "__module__", "")).startswith(_LOSS_MODULES):
        module = "ft.losses" if loss_fn.__module__.startswith("functree") else "optax"
        given, wrong = f"{module}.{ours}", f"{module}.{ours}"
        why = " (a loss of predictions and labels: it would get the model and the batch)"
    elif loss_fn is not MISSING and not callable(loss_fn):
        given, why, wrong = type(loss_fn).__name__, "", "loss_fn"
    else:
        return
    module = "optax" if wrong.startswith("optax") else "ft.losses"
    # a name: the loss ft.losses names for it (Keras's "mse" is mean_squared_error)
    fn = ours if callable(loss_fn) else OTHER_NAMES.get(loss_fn, "softmax_cross_entropy")
    right = f"{module}.{fn}(model(batch[0]), batch[1])" + (".mean()" if module == "optax" else "")
    raise TypeError(LOSS_FN_NOT_A_FUNCTION.format(given=given, why=why, wrong=wrong, right=right))


_CALLS = {"Trainer": "ft.train.Trainer(model, optimizer, loss_fn, {})", "fit": "trainer.fit({})",
          "evaluate": "trainer.evaluate({})", "predict": "trainer.predict({})"}


def unknown_keyword(method: str, unknown: Mapping[str, Any], known: Callable[..., Any], data: Any = None,
                    epochs: Any = None) -> TypeError:
    """The error for the first keyword of ``unknown`` that ``method`` (``"fit"``, ...; its
    function ``known``) does not have: another library's name (:data:`SPELLINGS`) with the
    call to write here, else a typo's closest name (``difflib``, as ``ft.nn.generate``).
    ``data`` and ``epochs``: the call's, to write its wrong line and Keras's epochs × steps."""
    name, value = next(iter(unknown.items()))
    call, title = _CALLS[method], "Trainer.__init__" if method == "Trainer" else f"Trainer.{method}"
    if method != "Trainer":  # `data, ` where it was given, not in fit(x=X, y=Y)
        call = call.format("{}" if data is _NO_DATA else "data, {}")
    wrong = call.format(f"{name}={_short(value)}")
    if name in SPELLINGS[method]:
        library, right, note = SPELLINGS[method][name]
        on = bool(value) if isinstance(value, (bool, int, str)) else True  # Keras's verbose: 0 is off
        right = right.format(value=_short(value), on=on, method=method,
                             epochs="epochs" if epochs is None else _short(epochs))
        note = note.format(value=_short(value))
        return TypeError(UNKNOWN_KEYWORD.format(method=title, name=name, why=f" ({library} name)", wrong=wrong,
                                                right=f"{right}" + (f"   # {note}" if note else "")))
    close = closest_parameter(name, known)
    why, right = (f" (did you mean {close!r}?)", call.format(f"{close}=...")) if close else (
        "", call.format("...") + f"   # help(ft.train.Trainer{'' if method == 'Trainer' else '.' + method})")
    return TypeError(UNKNOWN_KEYWORD.format(method=title, name=name, why=why, wrong=wrong, right=right))


def _check_data(method: str, data: Any) -> None:
    """Python's own error for a missing ``data`` (it has a default only to reach the above)."""
    if data is _NO_DATA:
        raise missing(f"Trainer.{method}", "data")


class _Fit(NamedTuple):
    """One ``fit`` call's settings."""

    callbacks: list[Callback]
    bar: Progress
    log_every: int
    k: int  # steps per call
    steps: int | None
    save_every: list[int]  # ModelCheckpoint(every_steps=) values
    sync_logs: bool  # a callback reads the model at on_log: read intervals at once


class Trainer(Settings, Evaluation):
    """Fit a model: ``Trainer(model, optimizer, loss_fn, metrics=...).fit(data, epochs=...)``.

    Args:
      model: the initial model (copied: the caller's arrays stay valid; the trainer's
        steps donate their own). Trained in ``ft.nn.training`` mode, evaluated in
        ``ft.nn.inference`` mode: ``trainer.model`` is the training-mode model (Dropout
        there needs a key), :attr:`inference_model` the one to call for predictions. Which
        layers train in training mode is ``training``'s (below): by default a model with
        some layer in training mode trains as given, each submodule in its own mode
        (torch's ``model.train(); model.backbone.eval()`` is
        ``ft.set(ft.nn.training(net), "backbone", ft.nn.inference(net.backbone))``), and
        one wholly in inference mode (a fresh one) is switched to training.
        Leaves that are not arrays (an Equinox module's functions) are kept static. It
        trains where it lives: a model committed to a device or a mesh (``jax.device_put``)
        gets the trainer's own arrays (key, metric buffer, optimizer state) there. A model
        whose leaves are committed to different devices is refused (``LEAVES_ON_DEVICES``),
        and so is a later ``trainer.model``, ``opt_state`` or ``key`` committed to other
        devices than the job's (``TRAINER_ELSEWHERE``): to move a job, ``save`` it and
        ``restore`` it into a trainer whose model lives there.
      optimizer: a ``ft.optim.Optimizer`` or an optax transformation.
      loss_fn: ``loss_fn(model, batch)`` → loss or ``(loss, aux)``; with ``key=`` given to
        the Trainer, ``loss_fn(model, batch, *, key)`` (a fresh key every step).
        :meth:`evaluate` and validation call a loss that takes ``key`` with a fixed
        evaluation key (the model is in inference mode there, so Dropout ignores it).
      metrics: ``{name: fn(StepOutput)}`` or a list (``ft.train.accuracy``,
        ``ft.train.mean("mse")``); ``loss`` is always recorded.
      key: base PRNG key for the loss (dropout) and for shuffling in-memory data.
      on_nan: ``"stop"`` (default, as in :class:`TrainStep`: raise :class:`NonFiniteError`
        naming the step and the first parameter whose gradient was not finite; that step
        is not applied), ``"skip"`` (skip such steps, recorded in ``trainer.skipped``) or
        ``"ignore"``. A step an optimizer handles itself (a loss-scale overflow of the
        gradients) is neither; a loss that is not finite still is (no scale makes it
        finite: the error says so, and ``"skip"`` skips it with the scale kept).
      opt_state: an optimizer state to continue from (default ``optimizer.init(model)``).
      train_step: a :class:`TrainStep` subclass (or instance) with overridden stages.
      mesh, data_axis, sharding: a data-parallel step over ``mesh``'s ``data_axis``, the
        parameters placed by ``sharding`` (:class:`TrainStep`'s). The loss and gradients
        are the mean of the devices' own: the whole batch's for a mean over examples; a
        mean over unmasked tokens weights each device's tokens by its own count, as torch's
        DDP does (docs/guides/scale.md).
      compute_dtype: a floating dtype (``jnp.bfloat16``, ``jnp.float16``) the model runs in
        (:class:`TrainStep`'s ``compute_dtype``): the model (``ft.cast``) and the floating
        inputs are cast to it inside each step, :meth:`evaluate` (and validation) and
        :meth:`predict`; the parameters, gradients and optimizer state keep their dtype
        (float32 master weights), the loss is float32, and :meth:`predict` returns what
        the model computes in that dtype. :attr:`inference_model` is not cast. ``None``
        (default): the parameters' dtype.
      wrt: key-path patterns of the parameters to train (``ft.optim.Optimizer(wrt=)``);
        the others stay bit for bit and get no optimizer state.
      training: the modes the model trains in. ``True``: every layer in training mode
        (``ft.nn.training(model)``, torch's ``model.train()``). ``False``: the modes given,
        whatever they are (torch's ``backbone.eval()``: a part put in inference keeps its
        BatchNorm statistics and its Dropout off). ``None`` (default): a model with some
        layer in training mode trains as given, one wholly in inference mode is switched
        to training; as a fresh layer and one put in inference look alike, it warns
        (:class:`TrainingModeWarning`, naming the key paths and both fixes as code) where
        the guess may not be the user's: the model mixes modes (a fresh head's Dropout on
        a trained backbone stays off), or a switched BatchNorm has no parameter ``wrt``
        selects (:class:`FrozenStateWarning`) or holds trained or loaded statistics (they
        would change). Say ``True`` or ``False`` to silence it.
      steps_per_call: run ``k`` steps per compiled call (``TrainStep(steps_per_call=k)``):
        the Trainer stacks ``k`` minibatches from any iterable (a shorter group, at the
        end of an epoch or of ``steps=``, or minibatches of another shape, run as single
        steps). The history still has one row per step; callbacks, logging and
        checkpoints happen between calls. Default: the ``train_step`` instance's, else 1.
      **unknown: other libraries' names raise an error naming the equivalent (Lightning's
        ``max_epochs=`` is ``fit(epochs=)``, Hugging Face's ``compute_metrics=`` is
        ``metrics=``), as does a misspelt keyword (its closest name).

    The job (model, optimizer state, key, position, means, history, ...) is one
    :class:`JobState`, :attr:`state`; ``trainer.model``, ``trainer.steps_run``, ... read it.
    What callbacks see: ``on_log`` gets the :class:`TrainingContext` of a log interval
    (``context.step`` its last step), read one interval late so that the host never waits
    for the device; a callback that overrides ``on_log`` and reads ``trainer.model`` /
    ``trainer.opt_state`` (``Callback.reads_model``, True by default) makes the Trainer
    read each interval as it ends, so the model it sees is the one after
    ``context.step``. ``on_epoch_end``, ``on_train_end`` and checkpoints
    (:class:`ModelCheckpoint`) always see the model of their step. ``fit(epochs=N)`` /
    ``fit(steps=N)`` count the whole job; :meth:`save` / :meth:`restore` carry all of it
    (guide: ``docs/guides/training-jobs.md``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, numpy as np
      >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
      >>> y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
      >>> def loss_fn(model, batch):
      ...     x, y = batch
      ...     return jnp.mean((model(x) - y) ** 2)
      >>> trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)),
      ...                            ft.optim.Optimizer(ft.optim.adam(0.1)), loss_fn)
      >>> history = trainer.fit(ft.train.batches((x, y), 16), epochs=30, progress=False)
      >>> len(history.steps["loss"]), len(history.epochs["loss"])
      (120, 30)
      >>> bool(history.epochs["loss"][-1] < 1e-2)
      True
      >>> sorted(trainer.evaluate((x, y)))
      ['loss']
      >>> trainer.inference_model(x[:2]).shape  # the trained model, for predictions
      (2, 1)
    """

    model = job_field("model", "The model (training mode) after the last step committed. Set it to a model "
                      "with the job's arrays (key paths and shapes); another is refused (MODEL_CHANGED).",
                      settable=True, check=check_same_model, arrays=True,
                      also=lambda trainer, model: {"opt_state": carried_state(
                          trainer.optimizer, trainer.opt_state, trainer.model, model)})
    opt_state = job_field("opt_state", "The optimizer state (with its learning context).", settable=True,
                          arrays=True)
    key = job_field("key", "The base PRNG key (None: the loss takes none).", settable=True, arrays=True)
    extra = job_field("extra", "User state saved with every checkpoint: a tree of arrays and plain values.",
                      settable=True, check=lambda value, _: check_extra(value))
    stop_training = job_field("stopped", "Set True (a callback) to stop after this step.", settable=True)
    steps_run = job_field("steps_run", "Training steps run by the job (all ``fit`` calls).")
    epoch = job_field("epoch", "Epochs completed.")
    batch_in_epoch = job_field("batch_in_epoch", "Minibatches of the current epoch consumed.")
    history = job_field("history", "The job's :class:`History`.")
    steps_per_call: int  # (fit's default)
    nan_report: Any  # ft.NaNReport of the first stopped or skipped step
    preempted: bool  # the last fit stopped at a SIGTERM
    checkpoint: Checkpoint | None  # the Checkpoint the last restore read
    # Any other name assigned is refused (Settings: `trainer.epochs = 5` was an attribute
    # nothing read); the keywords of the constructor and of fit are named with the call.
    _NAMED = "trainer"
    _ARGUMENTS = (("__init__", "trainer = ft.train.Trainer(model, optimizer, loss_fn, {})"),
                  ("fit", "trainer.fit(data, {})"))
    # Every other field of the job's position (and any field added to JobState) is a read-only
    # attribute too, made from the record below (add_readers); a name defined here wins.
    def __getattr__(self, name: str) -> Any:
        # Only for names normal lookup did not find (no cost to the others).
        raise no_attribute(name, self)

    # The step's setup is the constructor's: set once there, refused after (BUILT_WITH).
    optimizer: Any = BuiltWith()
    train_step: Any = BuiltWith()
    eval_step: Any = BuiltWith()
    on_nan: Any = BuiltWith()
    loss_fn: Any = BuiltWith()
    metrics: Any = BuiltWith()
    wrt: Any = BuiltWith()
    mesh: Any = BuiltWith()
    data_axis: Any = BuiltWith()
    sharding: Any = BuiltWith()
    compute_dtype: Any = BuiltWith()
    training: Any = BuiltWith()
    learning_rate: Any = BuiltWith()
    lr: Any = BuiltWith()

    def _built_error(self, name: str, value: Any) -> AttributeError | None:
        """:data:`TRAINER_BUILT_WITH` once the Trainer is built (:class:`BuiltWith`)."""
        return built_with(name, value) if "_job" in self.__dict__ else None

    def __init__(self, model: Any, optimizer: Any = MISSING, loss_fn: Callable[..., Any] = MISSING, *,
                 metrics: Mapping[str, Any] | Sequence[Any] | None = None, key: jax.Array | None = None,
                 on_nan: str | None = DEFAULT_ON_NAN, opt_state: Any = None,
                 train_step: type[TrainStep] | TrainStep | None = None, mesh: Any = None, data_axis: str = "data",
                 sharding: Any = None, compute_dtype: Any = None, wrt: Any = None, steps_per_call: int | None = None,
                 training: bool | None = None, **unknown: Any):
        check_arguments(optimizer, loss_fn, unknown)  # Keras's loss=, Hugging Face's Trainer(model, args)
        check_optimizer_name(optimizer)  # Keras's optimizer="adam"
        check_loss_fn(loss_fn)  # Keras's loss name, a loss of (predicted, expected)
        if unknown:  # other libraries' names (max_epochs=, compute_metrics=) and typos, named with the fix
            raise unknown_keyword("Trainer", unknown, Trainer.__init__)
        parallel: dict[str, Any] = {}
        if mesh is not None or sharding is not None or compute_dtype is not None:
            parallel = {"mesh": mesh, "data_axis": data_axis, "sharding": sharding, "compute_dtype": compute_dtype}
        # (A counting metric's parts, for its exact means, are the steps' own: a step given
        # ready-made computes them as one built here does.)
        metrics = resolve_metrics(metrics)
        if train_step is None:  # (a given step calls loss_fn its own way)
            check_batch_argument(loss_fn, "ft.train.Trainer(model, optimizer, {loss}%s)"
                                 % (", key=key" if key is not None else ""))
        self.train_step = make_step(train_step, loss_fn, optimizer, metrics, on_nan, wrt, parallel)
        self.train_step._modes_checked = True  # modes are the Trainer's choice (in_training_mode, its warnings)
        self.optimizer = self.train_step.optimizer
        self.eval_step = eval_step(loss_fn, metrics=self.train_step.metrics, **parallel)
        self.on_nan = self.train_step.on_nan
        self.steps_per_call = check_steps_per_call(
            getattr(self.train_step, "steps_per_call", 1) if steps_per_call is None else steps_per_call)
        key = None if key is None else checked_key(key, "ft.train.Trainer")
        check_key(loss_fn, key, train_step)
        # An accidental tie (one array at two leaves) is named once here; the copy unties it.
        warn_aliases(model, what="The model given to ft.train.Trainer",
                     trained=lambda: moved_view(self.optimizer, model))
        if getattr(self.train_step, "placement", None) is None and (
                apart := several_devices(model, "ft.train.Trainer", "model")) is not None:
            raise apart  # (it put every leaf on the first one's devices, without a word; a mesh's step places them)
        trained = in_training_mode(model, training)  # the user's per-submodule modes kept
        warn_frozen_state(model, trained, getattr(self.optimizer, "wrt", None), training)  # a switched frozen BatchNorm
        model = own_copy(trained)
        # Every buffer is the job's own: the copies above, and Optimizer.init's state.
        opt_state = self.optimizer.init(model) if opt_state is None else own_copy(opt_state)
        placement = getattr(self.train_step, "placement", None)
        if placement is not None:  # a step over a mesh: arrays on it by its rules
            model, opt_state = placement.place(model, opt_state)
        # The trainer's own arrays live where the model does (a device, a mesh), committed as
        # restored arrays are: one compiled step for a fresh and a restored job.
        self._where = placement_of(model)
        model, opt_state, key = put((model, opt_state, key), self._where)
        self._job = JobState.start(model, opt_state, key)
        self.nan_report = None
        self.preempted = False
        self.checkpoint = None
        self._names_unchecked: str | None = None  # a mid-epoch restore's path: its means' names checked at the next trace
        self._reader = Reader(self)  # the device buffer of per-step metrics, read into the job
        self._epochs = Epochs()  # the data iterator and its position
        self._guard = Interrupts()  # SIGINT / SIGTERM inside fit
        self._callbacks: list[Callback] = []  # the last fit's: their states go into checkpoints
        self._fit: _Fit | None = None  # the current fit's settings
        static = has_untraceable_leaves(model)  # Equinox submodules keep functions
        self._eval_fused = self.eval_step.summing(static, model)  # one program per configuration in the process

    @property
    def state(self) -> JobState:
        """The job as of the last step committed: a :class:`JobState` (read-only: a value;
        set ``trainer.model``, ``trainer.stop_training``, ... to change the job)."""
        return self._job

    @property
    def skipped(self) -> list[tuple[int, str]]:
        """``(step, what)`` of each step skipped under ``on_nan="skip"``."""
        return list(self._job.skipped)

    # --- fit -----------------------------------------------------------------------------
    @keras_positional
    def fit(self, data: Any = _NO_DATA, epochs: int | None = None, *, steps: int | None = None,
            validation_data: Any = None, callbacks: Sequence[Callback | Callable[[TrainingContext], Any]] = (),
            progress: bool = True, log_every: int = 50, batch_size: int | None = None,
            steps_per_call: int | None = None, **unknown: Any) -> History:
        """Train until the job has run ``epochs`` epochs or ``steps`` steps in all.

        ``epochs`` and ``steps`` count the whole job, as Lightning's ``max_epochs`` /
        ``max_steps``: a fresh trainer trains ``N``; a restored (or already trained) one
        continues to ``N``; one already there, or stopped by a callback
        (``trainer.stop_training``), returns at once and logs so, after its callbacks'
        ``on_train_end`` (the job's end: ``EarlyStopping(restore_best=True)`` sets the best
        model, which the last checkpoint, written before that, does not hold). Run twice, a
        script that restores its latest checkpoint and calls ``fit(data, epochs=N)`` ends
        where the uninterrupted job ends.

        ``data`` is ``ft.train.batches(...)``, arrays / a tuple or dict of arrays (JAX's,
        NumPy's or torch tensors; cut into shuffled minibatches of ``batch_size``, default
        32), or any iterable of batches (a list, a torch DataLoader, a tf.data Dataset;
        ``iter(data)`` once per epoch; ``batch_size=`` there is refused, as it would not cut it;
        data that runs out before ``epochs``/``steps``, a generator, ends fit there with a warning).
        A list's items are minibatches: inputs and labels are the tuple ``(x, y)``, and a list
        of arrays of other dtypes or ranks (``[x, labels]``) is refused naming it.
        Continuing inside an epoch, ``Batches`` replays from its position, an iterator with
        ``get_state()``/``set_state(state)`` (grain's ``DataLoader`` and dataset
        iterators; a position of JSON values or bytes) is set to the saved position, and
        another re-iterable skips the minibatches already consumed (read, not computed on).
        Metrics reach the host every ``log_every`` steps, one interval late (the read
        never waits for the steps queued since), and at epoch ends and save points; callbacks
        get the :class:`TrainingContext` of each interval as it is read, and a callback that
        reads ``trainer.model`` in ``on_log`` (``Callback.reads_model``) sees the model
        after ``context.step``. ``steps_per_call`` (default: the Trainer's) runs that many
        steps per compiled call on stacked minibatches; the history keeps one row per step.
        Returns :attr:`history` (the whole job's).

        Ctrl-C (KeyboardInterrupt) or any exception leaves ``trainer.model`` and
        ``trainer.opt_state`` at the last completed step, ready to ``fit`` again or save.
        SIGTERM stops ``fit`` after the current step, saving a checkpoint there through each
        :class:`ModelCheckpoint` given (``trainer.preempted`` is then True).

        Other libraries' names raise an error naming the equivalent (Keras's ``verbose=`` is
        ``progress=``, ``steps_per_epoch=S`` is ``steps=epochs * S``; Lightning's
        ``max_epochs=`` is ``epochs=``; Hugging Face's ``eval_dataset=`` is
        ``validation_data=``), as does a misspelt keyword (its closest name).
        """
        if unknown:
            raise unknown_keyword("fit", unknown, Trainer.fit, data, epochs)
        _check_data("fit", data)
        epochs, steps, every = Epochs.check_counts(epochs=epochs, steps=steps, log_every=log_every)
        log_every = log_every if every is None else every  # never None: the parameter's default is 50
        k = self.steps_per_call if steps_per_call is None else check_steps_per_call(steps_per_call)
        if epochs is None and steps is None:
            epochs = 1
        # batch_size= also cuts validation arrays: unused by the training data, it may be theirs
        validates = validation_data is not None and cut_by_batch_size(validation_data)
        data = as_data(data, None if validates and not cut_by_batch_size(data) else batch_size, self.key)
        self._epochs.check_data(data, epochs, steps, self._job, getattr(self.optimizer, "accumulate", 1),
                                validation_data)
        cbs = [as_callback(c) for c in callbacks]
        if self._job.callbacks:  # the first fit after a restore: the saved states to their callbacks
            load_callbacks(self._job.callbacks, cbs)
            self._job = self._job._replace(callbacks=None)
        length = epoch_length(data)
        self._callbacks, self.preempted = cbs, False
        # An epoch whose steps all ran but whose end (validation, callbacks) did not: the
        # run that stopped there (an interrupt, a checkpoint at its last step) goes on here.
        end_pending = length is not None and 0 < length <= self.batch_in_epoch and not self.stop_training
        if (self.stop_training or self._reached(epochs, steps)) and not end_pending and self._job.position.pending is None:
            self._already_done(epochs, steps)
            # The job's end still runs: a restored (or rerun) job whose checkpoint was written
            # before the end's on_train_end (EarlyStopping(restore_best=True)) ends as the
            # uninterrupted job did. No save: this fit ran no step.
            self._train_end(cbs, save=False)
            return self.history
        self._job = self._job.replace(epoch_length=length)
        remaining = steps - self.steps_run if steps is not None else (
            (epochs - self.epoch) * length - self.batch_in_epoch if length is not None and epochs else None)
        horizon = _optimizer_horizon(self.opt_state, remaining)
        _check_horizon(self.optimizer, self.model, horizon)  # (its compiled step may be another run's: not traced)
        bar = Progress(remaining, enabled=progress and jax.process_index() == 0)  # one bar for all processes
        self._fit = fit = _Fit(cbs, bar, log_every, k, steps, sorted(
            {int(cb.every_steps) for cb in cbs if isinstance(cb, ModelCheckpoint) and cb.every_steps}),
            any(reads_model(cb) for cb in cbs))
        self._reader.log.last_context = self._reader.log.last_rates = None  # (state set between fits: its own)
        guard, start = self._guard, self.steps_run
        try:
            with guard.signals(), training_horizon(horizon):
                self._reader.read_all(bar)  # an interrupted fit's steps, if any
                self._reader.log.resize(log_every + k - 1)  # room for the call that passes log_every
                for cb in cbs:
                    if cb.on_train_begin is not None:  # `on_train_begin = None`: switched off (as call_hooks)
                        cb.on_train_begin(self)
                finish_pending(self, cbs)  # a round of hooks a raise cut short: its rest first
                while not (self.stop_training or guard.terminate) and (end_pending or not self._reached(epochs, steps)):
                    end_pending = False
                    ran, complete = self._run_epoch(data, fit)
                    if complete:
                        self._reader.read_all(bar, cbs)
                        self._end_epoch(validation_data, batch_size)
                    elif ran == 0 and not guard.terminate:
                        if self.steps_run == start:
                            raise no_minibatch(data)
                        ran_out(data, epochs, steps, self._job)  # a one-shot iterator is exhausted
                        break
                self._reader.read_all(bar, cbs)
                if guard.terminate:
                    self._save_point("terminate")
        except BaseException:
            if not isinstance(data, Iterator):
                self._epochs.forget()  # the next epoch iterator skips to the position instead
            finish_saves(cbs)  # a checkpoint being written: done before the process may end
            close_event_files(cbs)  # what the interrupted steps logged: on disk now, not in 2 minutes
            raise
        finally:  # the last line (no terminal) holds the means of the steps after the last epoch end
            means = self._job.epoch_means
            bar.close(means.means(self.on_nan) if means.weight else None)
            self._fit = None
        if not self.preempted:  # (a preempted job goes on from its checkpoint, summing)
            warn_unapplied(self.opt_state, self.steps_run)  # optax.MultiSteps's sum of the last minibatches
        self._train_end(cbs, save=True)
        return self.history

    def _train_end(self, cbs: list[Callback], *, save: bool) -> None:
        """The end of ``fit``: the final checkpoints (``save``), then every ``on_train_end``."""
        if not cbs:  # the context would be read from the device for nobody
            return
        end = self._reader.context("end", self._latest_means())
        if save:
            self._save_point("end", end)  # the final checkpoints first: no on_train_end has replaced the model
        for cb in cbs:
            if cb.on_train_end is not None:  # `on_train_end = None`: switched off (as call_hooks)
                cb.on_train_end(self, end)

    def _latest_means(self) -> dict[str, float]:
        """The metrics of the end of ``fit`` and of a save point: the means of the steps
        after the last epoch end (the epoch so far: the progress output's last line, Keras's
        batch logs), else the last epoch's row (its means and ``val_*``: Keras's
        ``on_train_end`` logs), else none. (The log window's means were another number for
        each ``log_every``: none where fit ended at a log point, and a best-``loss``
        checkpoint ranked by windows of other lengths.)"""
        means = self._job.epoch_means
        if means.weight:
            return means.means(self.on_nan)
        epochs = self.history.epochs
        if not epochs["epoch"]:
            return {}
        return {k: v[-1] for k, v in epochs.items() if k not in ("epoch", "last_step") and v[-1] is not None}

    def _reached(self, epochs: int | None, steps: int | None) -> bool:
        return (steps is not None and self.steps_run >= steps) or (epochs is not None and self.epoch >= epochs)

    def _already_done(self, epochs: int | None, steps: int | None) -> None:
        if self.stop_training:
            why = "was stopped by a callback (trainer.stop_training is True); set it to False to train on"
        else:
            by_steps = steps is not None and self.steps_run >= steps
            more = f"steps={self.steps_run + 100}" if by_steps else f"epochs={self.epoch + 1}"
            done = f"{self.steps_run} steps" if by_steps else f"{self.epoch} epochs"  # the job's, not the argument
            why = (f"has already run {done} (fit(epochs=N) and "
                   f"fit(steps=N) count the whole job): ask for more to train on, e.g. trainer.fit(data, {more})")
        _LOG.warning(ALREADY_DONE.format(step=self.steps_run, epoch=self.epoch, why=why))

    def _run_epoch(self, data: Any, fit: _Fit) -> tuple[int, bool]:
        """Steps of one epoch: ``(steps run, whether the epoch's end is reached)``."""
        ran, k, log, guard = 0, fit.k, self._reader.log, self._guard
        length = epoch_length(data)
        fit.bar.set_description(f"epoch {self.epoch + 1}")
        group: list[tuple[Any, int]] = []  # k > 1: the minibatches of the next call, of one signature
        signature: Any = None
        minibatches = self._epochs.iterate(data, self._job)
        if self._job.data_state is not None and not isinstance(data, Batches):  # a restored position, used
            self._job = self._job.replace(data_state=None)
        for batch in minibatches:
            if length is not None and self.batch_in_epoch + len(group) >= length:  # more than len(data)
                if group:  # the minibatches within len() first: the job ends at its epoch's end
                    ran += self._run_group(group, k)
                    group = []
                    self._after_call(fit)
                raise self._epochs.past_length(data, length, self._job)
            batch = to_arrays(batch)
            size = self._epochs.minibatch_size(batch, self._job, len(group))
            if log.names is None:
                if not isinstance(data, Batches):  # the trainer's first minibatch (a Batches' have the axis)
                    check_row_minibatch(batch, data, "trainer.fit")
                self._epochs.first_shapes = describe_batch(batch)
                names = self._reader.metric_names(batch)
                if self._names_unchecked is not None:  # a mid-epoch restore: its means' names, now known
                    self._check_names(self._job, self._names_unchecked, names, traced=True)
                    self._names_unchecked = None
                log.names = names
            if log.buffer is None:
                log.open(self.opt_state, self._place_log)
            if k == 1:  # the plain loop, kept lean
                self._step(batch, [(batch, size)], 1, 0)
                if guard.deferred:
                    guard.safe_point()
                ran += 1
            else:
                new = batch_signature(batch)
                if group and new != signature:
                    ran += self._run_group(group, k)  # minibatches of another shape: single steps
                    group = []
                    if self._after_call(fit):
                        return ran, False
                group.append((batch, size))
                signature = new
                if len(group) < self._boundary(fit):
                    continue
                ran += self._run_group(group, k)
                group = []
            if self._after_call(fit):
                return ran, (not guard.terminate and length is not None and self.batch_in_epoch >= length)
        if group:  # the epoch's last minibatches, fewer than k: single steps
            ran += self._run_group(group, k)
            if self._after_call(fit) and guard.terminate:
                return ran, False
        return ran, self.batch_in_epoch > 0

    def _place_log(self, log: Any) -> Any:
        """A new metric buffer where the step returns it: the model's devices."""
        return put(self.train_step._place_log(log), self._where)

    def _step(self, batch: Any, pairs: list[tuple[Any, int]], n: int, offset: int) -> None:
        """One call of the step on ``batch`` (``n`` minibatches, stacked when ``n > 1``),
        committed: the one place where a step's outputs become the job's state. A Ctrl-C
        waits from the call (it donates the job's buffers) to the commit."""
        job, log, guard = self._job, self._reader.log, self._guard
        guard.critical = True
        try:
            model, opt_state, _, log.buffer = self.train_step.run(job.model, job.opt_state, batch, job.key,
                                                                  log.buffer, owned=True, steps=n)
        except (ValueError, TypeError) as e:  # raised while tracing: nothing was donated
            guard.critical = False
            raise self._epochs.located(e, pairs[0][0], job, offset) from e.__cause__
        # The commit (into the instance dict: a private name, on every step, needs no check
        # of Settings' __setattr__, a Python call)
        self.__dict__["_job"] = job.stepped(model, opt_state, n)
        log.inflight.extend(pairs)
        log.buffered += n
        guard.critical = False

    def _run_group(self, group: list[tuple[Any, int]], k: int) -> int:
        """``k`` minibatches (``(batch, size)`` pairs) as one call of ``k`` steps; fewer as
        single steps."""
        assert self._reader.log.buffered + len(group) <= self._reader.log.capacity, "the log buffer would overflow"
        if len(group) == k:
            self._step(stack_batches([b for b, _ in group]), group, k, 0)
        else:
            for i, pair in enumerate(group):
                self._step(pair[0], [pair], 1, i)
        self._guard.safe_point()
        return len(group)

    def _boundary(self, fit: _Fit) -> int:
        """Steps until the next save point or the end of ``steps=`` (at most ``k``)."""
        n = fit.k if fit.steps is None else min(fit.k, fit.steps - self.steps_run)
        for every in fit.save_every:
            n = min(n, every - self.steps_run % every)
        return n

    def _after_call(self, fit: _Fit) -> bool:
        """Log and save points after a call; True when fit must leave the epoch."""
        if self._job.since_log >= fit.log_every:
            self._reader.log_point(fit.sync_logs, fit.bar, fit.callbacks)
        if fit.save_every and any(self._job.steps_run % e == 0 for e in fit.save_every):
            self._reader.read_all(fit.bar, fit.callbacks)
            self._save_point("step")
        job = self._job  # (after the callbacks: one may have set stop_training)
        return job.stopped or self._guard.terminate or (fit.steps is not None and job.steps_run >= fit.steps)

    def _end_epoch(self, validation_data: Any, batch_size: int | None) -> None:
        values = self._job.epoch_means.means(self.on_nan)
        warn_no_label(self._job.epoch_means, f"epoch {self._job.epoch + 1}")
        if validation_data is not None:  # may raise: nothing has changed yet
            val = self._evaluate(validation_data, batch_size, False, "validation")
            values.update({f"val_{k}": v for k, v in val.items()})
            if keeps_average(self.opt_state):  # Optimizer(average=) or lookahead: validate that model too
                val = self._evaluate(validation_data, batch_size, True, "validation")
                values.update({f"val_averaged_{k}": v for k, v in val.items()})
        job, opt_state = self._job, next_sweep(self.opt_state)
        self._guard.critical = True  # the epoch's end is one commit: a Ctrl-C waits for it
        # since_log and the log window run on across it: log_every counts the job's steps
        # (Lightning's log_every_n_steps, HF's logging_steps), so a window may span an epoch
        # end; restarted here, an epoch shorter than log_every never logged.
        self._job = job.replace(opt_state=opt_state, epoch=job.epoch + 1, batch_in_epoch=0, epoch_means=Means())
        job.history.add_epoch(job.epoch + 1, {**values, "last_step": job.steps_run})
        self._reader.log.last_context = None
        self._epochs.iterator = None
        self._guard.critical = False
        self._guard.safe_point()
        assert self._fit is not None
        self._fit.bar.end_epoch(values)
        if not self._fit.callbacks:  # the context would be read from the device for nobody
            return
        end_epoch(self, self._fit.callbacks, self._reader.context("epoch", values))  # hooks, then checkpoints

    def _save_point(self, event: str, ctx: TrainingContext | None = None) -> None:
        """``event``'s checkpoints through every :class:`ModelCheckpoint` (``"step"``: every
        ``every_steps``; ``"epoch"``; ``"end"`` of fit; ``"terminate"``: SIGTERM, then stop)."""
        if ctx is None:  # the epoch's means so far (Keras's logs there), whatever log_every
            ctx = self._reader.context("step", self._latest_means())
        saved = [cb for cb in self._callbacks if isinstance(cb, ModelCheckpoint)]
        for cb in saved:
            cb._save_point(self, ctx, event)
        if event == "terminate":
            self.preempted, self._guard.terminate = True, False
            where = f"saved a checkpoint at step {self.steps_run}" if saved else "no ModelCheckpoint to save through"
            _LOG.warning(f"SIGTERM during fit: stopped after step {self.steps_run}, {where}. "
                         "Run the job again: trainer.restore(...) then fit(...) continues from there.")

    # --- checkpoints ---------------------------------------------------------------------
    def save(self, manager: CheckpointManager | str, *, metrics: Mapping[str, Any] | None = None,
             extra: Any = _KEEP) -> None:
        """Checkpoint the job at the current step, atomically: its :class:`JobState`
        (model with its layer state, optimizer state with its learning context, PRNG key,
        position in the data with a positioned iterator's ``get_state()``, history, the
        states of the last ``fit``'s callbacks) and ``extra`` (a tree of arrays and plain
        values, default :attr:`extra`; it becomes :attr:`extra`). Every process of a
        multi-process job calls it (each writes its shards).

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp, numpy as np, tempfile
          >>> x = np.ones((8, 2), np.float32)
          >>> loss_fn = lambda m, b: jnp.mean(m(b) ** 2)
          >>> make = lambda: ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1), loss_fn)
          >>> trainer, path = make(), tempfile.mkdtemp() + "/ckpt"
          >>> _ = trainer.fit(ft.train.batches(x, 4), epochs=1, progress=False)
          >>> trainer.save(path, extra={"rounds": 3})
          >>> restored = make().restore(path)
          >>> restored.steps_run, restored.epoch, restored.extra
          (2, 1, {'rounds': 3})
        """
        if extra is not _KEEP:
            self.extra = extra  # (checked: a tree of arrays and plain values)
        if not isinstance(manager, CheckpointManager):
            with CheckpointManager(manager, max_to_keep=None) as owned:  # adds one: never prunes a run's
                return self.save(owned, metrics=metrics)
        self._reader.read_all(self._fit.bar if self._fit else None, self._callbacks)  # every step up to now
        check_new_step(manager, self._job.steps_run)
        job = self._job.replace(data_state=self._epochs.position(self._job))
        save_job(manager, job, self._callbacks, metrics=metrics, trained=self.optimizer.wrt, about={
            "on_nan": self.on_nan, "optimizer": repr(self.optimizer), "train_step": repr(self.train_step)})

    def restore(self, manager: CheckpointManager | str, step: int | None = None, *,
                optimizer_state: bool = True, callbacks: bool = True) -> Trainer:
        """Continue from a checkpoint (default: the latest) and return this trainer.

        Model and optimizer state are checked against the trainer's (key path, shape,
        dtype); position, key, history, :attr:`extra` and the stop flag are restored, and
        the saved callback states are handed to the callbacks of the next ``fit`` (matched
        by ``Callback.name``, else by class and position; ``callbacks=False`` drops them).
        The :class:`Checkpoint` read is :attr:`checkpoint`. Then ``fit(data, epochs=N)``
        continues the job to ``N`` epochs in all, bit for bit as if never interrupted.

        ``optimizer_state=False`` restores the model, position and key only and keeps this
        trainer's optimizer state: a saved model continued with new optimizer options
        (CNTK's new learners); the learning context then starts from this trainer's. A
        model's checkpoint (``CheckpointManager.save``: no job position) is read so only:
        its model, the rest this trainer's (with its optimizer state: :data:`MODEL_NOT_A_JOB`).
        """
        if not isinstance(manager, CheckpointManager):
            if not read_path(manager, "ft.train.Trainer.restore").is_dir():  # (a manager would create it: a restore writes nothing)
                raise CheckpointError(NOTHING_SAVED.format(path=manager, step=""))
            with CheckpointManager(manager) as owned:
                return self.restore(owned, step, optimizer_state=optimizer_state, callbacks=callbacks)
        job, checkpoint = read_job(manager, step, self._job, optimizer_state=optimizer_state,
                                   callbacks=callbacks, placement=self.train_step.placement)
        if "trainer" not in checkpoint.config:  # a model's checkpoint (CheckpointManager.save): no position
            if optimizer_state:
                raise CheckpointError(MODEL_NOT_A_JOB.format(path=manager.directory, step=checkpoint.step))
            job = self._job._replace(model=job.model)  # the model alone: this job's position, key and history
        self._check_means(job, f"{manager.directory}/{checkpoint.step}")
        self._job, self.checkpoint = job, checkpoint
        job = self._job  # its arrays (PLACED) on the model's devices, whatever the reader placed them by
        self._job = job._replace(**dict(zip(PLACED, put(tuple(getattr(job, name) for name in PLACED), self._where))))
        self._reader.log.drop()
        self._reader.log.names = None  # read again when the step next traces: checked against the restored means
        self._epochs.forget(restored=True)
        return self

    def _check_means(self, job: JobState, where: str) -> None:
        """Refuse running means of a counting metric stored without its parts (an older
        functree's, mid-epoch): read on, the epoch's accuracy would silently mix two means;
        and an epoch's means of other metrics than this trainer's (:data:`METRICS_CHANGED`).
        A step whose ``compute_metrics`` or ``step()`` is overridden names its metrics when
        it traces: checked then, at the next fit's first minibatch (:meth:`_check_names`;
        :meth:`restore` forgets the names an earlier fit read). (A log window spanning the
        restore: each name's mean covers the steps that recorded it, :class:`Means`.)"""
        cls = type(self.train_step)
        self._names_unchecked = None
        if job.epoch_means.weight:
            if cls.compute_metrics is TrainStep.compute_metrics and cls.step is TrainStep.step:
                self._check_names(job, where, ["loss", *self.train_step.metrics], traced=False)
            else:
                self._names_unchecked = where
        counting = counting_names(self.train_step.metrics)
        for which, means in (("epoch's", job.epoch_means), ("log window's", job.window)):
            names = means.inexact(counting)
            if names:
                raise CheckpointError(INEXACT_MEANS.format(step=job.steps_run, where=where,
                                                           which=which, names=", ".join(map(repr, names))))

    @staticmethod
    def _check_names(job: JobState, where: str, names: list[str], *, traced: bool) -> None:
        """:data:`METRICS_CHANGED` where the restored epoch's running means (not empty) hold
        other metrics than the step's ``names`` records (its parts and ``nonfinite`` aside):
        each name's mean would cover part of the epoch, reported as the epoch's. ``traced``:
        the names were read by tracing an overridden step (a Trainer of other
        ``compute_metrics`` restored mid-epoch reported rmse over the epoch's last 2 of 4
        steps, mae over its first 2)."""
        saved, ours = job.epoch_means.names(), set(names) - part_names(names) - {NONFINITE}
        if job.epoch_means.weight and saved != ours:  # (an epoch ended before the step traced: nothing to mix)
            change = ", ".join(f"{what} {sorted(differ)}" for what, differ in (
                ("added", ours - saved), ("removed", saved - ours)) if differ)
            raise CheckpointError(METRICS_CHANGED.format(step=job.steps_run, where=where, epoch=job.epoch + 1,
                                                         saved=sorted(saved), ours=sorted(ours), change=change,
                                                         **_CHANGED_BY[traced]))

    @keras_positional
    def evaluate(self, data: Any = _NO_DATA, *, batch_size: int | None = None, averaged: bool = False,
                 **unknown: Any) -> dict[str, float]:
        """The loss and metrics of the model (inference mode) over ``data``
        (:meth:`Evaluation.evaluate`): the loss and plain metrics weighted by minibatch size,
        a counting metric (``accuracy``) by its counted labels, Σ hits / Σ counted over
        every minibatch (labels of -100 left out, as torch's and HF's per-token accuracy).
        A ``reduction="weighted"`` loss that scored no label over all of ``data`` is NaN,
        with a :class:`~functree.train.NoLabelWarning` (its minibatches' 0s are no loss).
        Other libraries' names (Keras's ``x=``, ``verbose=``) raise an error naming the
        equivalent."""
        if unknown:
            raise unknown_keyword("evaluate", unknown, Trainer.evaluate, data)
        _check_data("evaluate", data)
        return super().evaluate(data, batch_size=batch_size, averaged=averaged)

    def predict(self, data: Any = _NO_DATA, fn: Callable[[Any, Any], Any] | None = None, *,
                batch_size: int | None = None, **unknown: Any) -> Any:
        if unknown:  # (the docstring is Evaluation.predict's, below)
            raise unknown_keyword("predict", unknown, Trainer.predict, data)
        _check_data("predict", data)
        if fn is not None and not callable(fn):
            given = f"an array of shape {np.shape(fn)}" if hasattr(fn, "shape") else type(fn).__name__
            raise TypeError(PREDICT_FN.format(given=given))
        if fn is not None:
            _check_predict_fn(fn)
        return super().predict(data, fn, batch_size=batch_size)

    predict.__doc__ = f"""{Evaluation.predict.__doc__}
        Other libraries' names (Keras's ``x=``, ``verbose=``) raise an error naming the
        equivalent.
        """

    def __repr__(self) -> str:
        return f"Trainer({self.train_step!r}, steps_run={self.steps_run}, epoch={self.epoch})"


def _optimizer_horizon(opt_state: Any, remaining: int | None) -> int | None:
    """The optimizer steps a fit ends at, counted from 0 (the state's steps so far, read once
    per fit, and the ``remaining`` steps: an accumulating optimizer takes fewer), for the rate
    check's schedules that turn (:func:`~functree.optim._rate.training_horizon`); None where
    either is unknown (then such a schedule is refused whatever the run's length)."""
    try:
        done = int(np.max(np.asarray(opt_state.context.step)))
    except Exception:  # no learning context here, or not readable on this process: unknown
        return None
    return None if remaining is None else done + max(remaining, 0)


def _check_horizon(optimizer: Any, model: Any, horizon: int | None) -> None:
    """:data:`~functree.optim._rate.ASCENDING_LATER` up front where ``optimizer``'s schedule
    turns within the fit's ``horizon``: its compiled step, shared with a shorter run of the
    same configuration, is not traced again to read it."""
    transform, adds = getattr(optimizer, "_raw_transform", None), getattr(optimizer, "_adds_updates", None)
    if transform is None or adds is None or not adds():  # (not an ft.optim.Optimizer adding its updates)
        return
    try:
        params = floats_as_arrays(mode_free(trained_view(model, optimizer.wrt)))
    except Exception:  # a view the step itself refuses, naming it: checked while it traces
        return
    check_horizon(transform, params, horizon)


def _check_predict_fn(fn: Callable[..., Any]) -> None:
    """Refuse an ``fn`` that cannot be called as ``fn(model, batch)`` (:data:`PREDICT_FN_ARGUMENTS`):
    Keras's ``predict(x)`` habit, ``lambda batch: ...``, failed at the first minibatch with
    Python's "takes 1 positional argument but 2 were given". Its ``key=`` is given by keyword."""
    try:
        keyed = "key" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: the call tells
        return
    refused = call_refusal(fn, None, None, **({"key": None} if keyed else {}))
    if refused is not None:
        name, signature, problem = refused
        raise TypeError(PREDICT_FN_ARGUMENTS.format(fn=name, signature=signature, problem=problem))


# trainer.<field> for each position field (and field added to JobState) it does not define itself.
add_readers(Trainer, JOB_ATTRIBUTES, lambda name: job_field(name, f"The job's ``{name}`` (:class:`JobState`)."))
